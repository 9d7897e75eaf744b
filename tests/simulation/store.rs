//! The store decorator: parks the calling actor before and after every store call (crash points),
//! records every lease it sees granted, and drops the store connection under some calls (a fault
//! drawn per schedule).

use idemflow::store::FinishMode;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemflow::conformance::Delegate;
use idemflow::store::{ClaimOutcome, Finish, NewClaim, Release, TakeStale};
use idemflow::{KeyId, Store, StoreError, async_trait, record::KeyRecord, record::LeaseToken};

use crate::gate::{SharedRef, park};
use crate::rng::Rng;

pub fn label(id: &KeyId) -> String {
    format!("{}/{}", id.scope, id.key)
}

pub fn record_label(r: &KeyRecord) -> String {
    format!("{}/{}", r.scope, r.key)
}

#[derive(Debug)]
pub struct GatedStore {
    pub inner: std::sync::Arc<dyn Store>,
    pub shared: SharedRef,
    /// Dropped connections, if this schedule has them.
    pub faults: Option<StoreFaults>,
}

/// A store client whose connection drops under some of an actor's calls (per mille of them, drawn
/// per schedule): before the command reached the server (nothing happened), after the server ran
/// it (the answer is lost), or after it ran with the client sending it again on a new connection
/// and answering with the second reply (what a client that retries on a dropped connection does;
/// idemflow's own clients never re-send, `docs/design.md`). The caller gets
/// [`dropped`] for the first two: the outcome is unknown to it, as after a real reset.
#[derive(Debug)]
pub struct StoreFaults {
    pub per_mille: u64,
    pub rng: Mutex<Rng>,
}

/// Where a dropped connection cut a store call.
#[derive(Debug, Clone, Copy)]
enum Cut {
    /// Before the command left: nothing ran.
    Before,
    /// After the server ran it: the answer is lost.
    After,
    /// It ran, the client re-sent it on a new connection and answers with the second reply.
    Resent,
}

/// The error a dropped connection gives the caller (the backend named `sim`, so the checks can
/// tell it from a real store failure).
pub fn dropped() -> StoreError {
    StoreError::database(
        "sim",
        std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection dropped (injected by the simulation)",
        ),
    )
}

/// Whether `e` is a dropped connection the simulation injected.
pub fn injected(e: &StoreError) -> bool {
    matches!(e, StoreError::Database { backend: "sim", .. })
}

impl GatedStore {
    /// Draws whether the connection drops under this call (only inside an actor, only while the
    /// faults are on), and where; records it as a disruption (a crash of that call).
    fn cut(&self, what: &str, on: &str) -> Option<Cut> {
        crate::gate::current_actor()?;
        {
            let mut sh = self.shared.lock().unwrap();
            if sh.healthy {
                return None;
            }
            if sh.store_down.is_some() {
                sh.trace
                    .push(format!("    the store is down: {what}({on}) refused unrun"));
                return Some(Cut::Before);
            }
        }
        let faults = self.faults.as_ref()?;
        let cut = {
            let mut rng = faults.rng.lock().unwrap();
            if !rng.chance(faults.per_mille) {
                return None;
            }
            [Cut::Before, Cut::After, Cut::Resent][rng.below(3) as usize]
        };
        let mut sh = self.shared.lock().unwrap();
        sh.last_disruption = Some(std::time::Instant::now());
        let how = match cut {
            Cut::Before => "before it was sent (nothing ran)",
            Cut::After => "after it ran (the answer is lost)",
            Cut::Resent => "after it ran; the client sent it again",
        };
        sh.trace.push(format!(
            "    the store connection dropped under {what}({on}) {how}"
        ));
        Some(cut)
    }

    /// A finish (`operator`: an override, whose new token is a lease no worker holds) between
    /// its park points.
    async fn finish_gated<F, Fut>(
        &self,
        id: &KeyId,
        operator: bool,
        call: F,
    ) -> Result<KeyRecord, StoreError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<KeyRecord, StoreError>>,
    {
        let l = label(id);
        park("store.finish", "before", &l).await;
        let seen = |r: &Result<KeyRecord, StoreError>, _known: bool| {
            if operator && let Ok(rec) = r {
                self.shared.lock().unwrap().granted(
                    &l,
                    &rec.provider_key,
                    rec.lease_token.0,
                    None,
                    "operator override",
                );
            }
        };
        let r = self.run("store.finish", &l, call, seen).await;
        park("store.finish", "after", &l).await;
        r
    }

    /// Runs `call` as the connection allows; `seen(result, known)` is told of every run, with
    /// `known` false for a run whose answer the caller never gets.
    async fn run<T, F, Fut>(
        &self,
        what: &str,
        on: &str,
        call: F,
        seen: impl Fn(&Result<T, StoreError>, bool),
    ) -> Result<T, StoreError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        match self.cut(what, on) {
            None => {
                let r = call().await;
                seen(&r, true);
                r
            }
            Some(Cut::Before) => Err(dropped()),
            Some(Cut::After) => {
                seen(&call().await, false);
                Err(dropped())
            }
            Some(Cut::Resent) => {
                seen(&call().await, false);
                let r = call().await;
                seen(&r, true);
                r
            }
        }
    }
}

#[async_trait]
impl Delegate for GatedStore {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        park("store.now", "before", "-").await;
        self.inner.now().await
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        let l = label(&claim.id);
        park("store.claim", "before", &l).await;
        let seen = |r: &Result<ClaimOutcome, StoreError>, known: bool| {
            if let (Ok(_), Some(a), true) = (r, crate::gate::current_actor(), known) {
                let mut sh = self.shared.lock().unwrap();
                let g = sh.generation(&l);
                sh.claimed_in.insert((a, l.clone()), g);
            }
            if let Ok(ClaimOutcome::Claimed(lease)) = r {
                let how = format!("claim ({:?})", lease.transition);
                // A lease whose answer was lost is held by no one who knows it.
                let expires = known.then_some(lease.expires_at);
                self.shared.lock().unwrap().granted(
                    &l,
                    &lease.provider_key,
                    lease.token.0,
                    expires,
                    &how,
                );
            }
        };
        let r = self
            .run("store.claim", &l, || self.inner.claim(claim), seen)
            .await;
        park("store.claim", "after", &l).await;
        r
    }

    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        let l = label(id);
        park("store.mark_attempt", "before", &l).await;
        let r = self
            .run(
                "store.mark_attempt",
                &l,
                || self.inner.mark_attempt(id, token),
                |_, _| {},
            )
            .await;
        park("store.mark_attempt", "after", &l).await;
        r
    }

    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        f: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        let operator = mode.holder().is_none();
        self.finish_gated(id, operator, || self.inner.finish_as(id, mode, f))
            .await
    }

    async fn release(
        &self,
        id: &KeyId,
        token: LeaseToken,
        release: &Release,
    ) -> Result<(), StoreError> {
        let l = label(id);
        park("store.release", "before", &l).await;
        let r = self
            .run(
                "store.release",
                &l,
                || self.inner.release(id, token, release),
                |_, _| {},
            )
            .await;
        park("store.release", "after", &l).await;
        r
    }

    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        // Not a park point: a heartbeat may renew from beside the operation.
        let me = crate::gate::current_actor().map(|a| (a, label(id)));
        {
            let mut sh = self.shared.lock().unwrap();
            if me.is_some() && sh.store_down.is_some() && !sh.healthy {
                sh.trace.push(format!(
                    "    the store is down: extend({}) refused unrun",
                    label(id)
                ));
                return Err(dropped());
            }
        }
        if let Some(k) = &me {
            self.shared
                .lock()
                .unwrap()
                .renewing
                .insert(k.clone(), std::time::Instant::now());
        }
        let r = self.inner.extend(id, token, lease).await;
        if let Some(k) = &me {
            self.shared.lock().unwrap().renewing.remove(k);
        }
        if let (Ok(exp), Some(a)) = (&r, crate::gate::current_actor()) {
            let mut sh = self.shared.lock().unwrap();
            sh.holding.insert((a, label(id)), (token.0, *exp));
            sh.renewed.insert((a, label(id)), std::time::Instant::now());
        }
        r
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        let l = label(id);
        park("store.get", "before", &l).await;
        self.run("store.get", &l, || self.inner.get(id), |_, _| {})
            .await
    }

    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        park("store.take_stale", "before", "-").await;
        let seen = |r: &Result<Vec<KeyRecord>, StoreError>, known: bool| {
            if let Ok(records) = r {
                let mut sh = self.shared.lock().unwrap();
                for rec in records {
                    sh.granted(
                        &record_label(rec),
                        &rec.provider_key,
                        rec.lease_token.0,
                        rec.lease_expires_at.filter(|_| known),
                        "take_stale",
                    );
                }
            }
        };
        let r = self
            .run(
                "store.take_stale",
                "-",
                || self.inner.take_stale(take),
                seen,
            )
            .await;
        park("store.take_stale", "after", "-").await;
        r
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        park("store.purge_expired", "before", "-").await;
        let r = self.inner.purge_expired(batch).await;
        park("store.purge_expired", "after", "-").await;
        r
    }
}
