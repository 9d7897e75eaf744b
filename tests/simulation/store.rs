//! The store decorator: parks the calling actor before and after every store call (crash points)
//! and records every lease it sees granted.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idemflow::store::{ClaimOutcome, Finish, NewClaim, Release, Stats, Stuck, TakeStale};
use idemflow::{KeyEvent, KeyId, KeyRecord, LeaseToken, Store, StoreError, async_trait};

use crate::gate::{SharedRef, park};

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
}

#[async_trait]
impl Store for GatedStore {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        self.inner.migrate().await
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        park("store.now", "before", "-").await;
        self.inner.now().await
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        let l = label(&claim.id);
        park("store.claim", "before", &l).await;
        let r = self.inner.claim(claim).await;
        if let (Ok(_), Some(a)) = (&r, crate::gate::current_actor()) {
            let mut sh = self.shared.lock().unwrap();
            let g = sh.generation(&l);
            sh.claimed_in.insert((a, l.clone()), g);
        }
        if let Ok(ClaimOutcome::Claimed(lease)) = &r {
            let how = format!("claim ({:?})", lease.transition);
            self.shared.lock().unwrap().granted(
                &l,
                &lease.provider_key,
                lease.token.0,
                Some(lease.expires_at),
                &how,
            );
        }
        park("store.claim", "after", &l).await;
        r
    }

    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        let l = label(id);
        park("store.mark_attempt", "before", &l).await;
        let r = self.inner.mark_attempt(id, token).await;
        park("store.mark_attempt", "after", &l).await;
        r
    }

    async fn finish(
        &self,
        id: &KeyId,
        token: Option<LeaseToken>,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        let l = label(id);
        park("store.finish", "before", &l).await;
        let r = self.inner.finish(id, token, finish).await;
        if token.is_none()
            && let Ok(rec) = &r
        {
            self.shared.lock().unwrap().granted(
                &l,
                &rec.provider_key,
                rec.lease_token.0,
                None,
                "operator override",
            );
        }
        park("store.finish", "after", &l).await;
        r
    }

    async fn release(
        &self,
        id: &KeyId,
        token: LeaseToken,
        release: &Release,
    ) -> Result<(), StoreError> {
        let l = label(id);
        park("store.release", "before", &l).await;
        let r = self.inner.release(id, token, release).await;
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
        let r = self.inner.extend(id, token, lease).await;
        if let (Ok(exp), Some(a)) = (&r, crate::gate::current_actor()) {
            self.shared
                .lock()
                .unwrap()
                .holding
                .insert((a, label(id)), (token.0, *exp));
        }
        r
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        let l = label(id);
        park("store.get", "before", &l).await;
        self.inner.get(id).await
    }

    async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError> {
        self.inner.history(id).await
    }

    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        park("store.take_stale", "before", "-").await;
        let r = self.inner.take_stale(take).await;
        if let Ok(records) = &r {
            let mut sh = self.shared.lock().unwrap();
            for rec in records {
                sh.granted(
                    &record_label(rec),
                    &rec.provider_key,
                    rec.lease_token.0,
                    rec.lease_expires_at,
                    "take_stale",
                );
            }
        }
        park("store.take_stale", "after", "-").await;
        r
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        park("store.purge_expired", "before", "-").await;
        let r = self.inner.purge_expired(batch).await;
        park("store.purge_expired", "after", "-").await;
        r
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        self.inner.stats().await
    }

    async fn stuck(&self, older_than: Duration, limit: u32) -> Result<Stuck, StoreError> {
        self.inner.stuck(older_than, limit).await
    }

    async fn count_expired(&self) -> Result<u64, StoreError> {
        self.inner.count_expired().await
    }
}
