//! A store kept in memory behind one mutex, written as a crate outside idemflow would write it:
//! only idemflow's public API (`idemflow::store`, `idemflow::store::kit`). It is the worked
//! example of `docs/writing-a-store.md`, and it passes both exported suites below.
//!
//! Every method takes the lock once and does its whole read-check-write under it, so each call
//! is one atomic transition; the lock is never held across an `.await`, so a dropped call
//! changes all or nothing. Not durable, one process only: a test double, not a backend.

use idemflow::store::FinishMode;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemflow::state::Transition;
use idemflow::store::kit::{
    check_finish, claimable, millis, provider_key_on_change, provider_key_on_insert, refused_write,
};
use idemflow::store::{
    ClaimOutcome, Finish, Lease, NewClaim, OperatorStore, Release, Stats, Store, Stuck,
    SweeperStore, TakeStale,
};
use idemflow::{
    KeyId, KeyState, StoreError, async_trait, record::Actor, record::KeyEvent, record::KeyRecord,
    record::LeaseToken,
};

/// The in-memory store.
#[derive(Debug, Default)]
pub struct MemoryStore {
    db: Mutex<Db>,
}

#[derive(Debug, Default)]
struct Db {
    keys: HashMap<KeyId, Key>,
    /// The latest clock reading: the store's clock never goes back.
    clock: DateTime<Utc>,
}

/// A key: its row (`None` once purged) and its history, which outlives the row.
#[derive(Debug, Default)]
struct Key {
    row: Option<KeyRecord>,
    history: Vec<KeyEvent>,
}

fn after(now: DateTime<Utc>, ms: i64) -> DateTime<Utc> {
    now + chrono::Duration::milliseconds(ms)
}

impl Key {
    /// Appends the history event of a transition from `from` to the row's state now.
    fn log(
        &mut self,
        from: Option<KeyState>,
        token: LeaseToken,
        actor: Actor,
        why: &str,
        at: DateTime<Utc>,
    ) {
        self.history.push(KeyEvent {
            seq: self.history.len() as i64 + 1,
            from,
            to: self.row.as_ref().map(|r| r.state),
            lease_token: Some(token),
            actor,
            reason: Some(why.to_owned()),
            at,
        });
    }
}

impl Db {
    /// The store's clock: the system clock, but never earlier than a time already handed out.
    fn now(&mut self) -> DateTime<Utc> {
        self.clock = self.clock.max(Utc::now());
        self.clock
    }

    /// Runs `write` on the row of `id` if the fence holds: the row is processing under
    /// `presented` (any row when `None`). A transition (`log`: who and why) also appends its
    /// history event. `None`: refused, nothing changed.
    fn write<T>(
        &mut self,
        id: &KeyId,
        presented: Option<LeaseToken>,
        log: Option<(Actor, &str)>,
        write: impl FnOnce(&mut KeyRecord, DateTime<Utc>) -> T,
    ) -> Option<T> {
        let now = self.now();
        let key = self.keys.get_mut(id)?;
        let r = key.row.as_mut().filter(|r| {
            presented.is_none_or(|t| r.state == KeyState::Processing && r.lease_token == t)
        })?;
        let from = r.state;
        let out = write(r, now);
        if let Some((actor, why)) = log {
            let token = r.lease_token;
            key.log(Some(from), token, actor, why, now);
        }
        Some(out)
    }

    fn rows(&self) -> impl Iterator<Item = &KeyRecord> {
        self.keys.values().filter_map(|k| k.row.as_ref())
    }

    /// Finished keys past their retention, earliest first.
    fn expired(&self, now: DateTime<Utc>) -> Vec<(DateTime<Utc>, KeyId)> {
        let mut due: Vec<_> = self
            .keys
            .iter()
            .filter_map(|(id, k)| Some((k.row.as_ref()?.expires_at?, id.clone())))
            .filter(|(at, _)| *at <= now)
            .collect();
        due.sort_by_key(|(at, _)| *at);
        due
    }
}

impl MemoryStore {
    fn db(&self) -> std::sync::MutexGuard<'_, Db> {
        self.db
            .lock()
            .expect("a panic while the memory store was locked")
    }

    /// A fenced write ([`Db::write`]); a refused one is the kit's error for the row as it is.
    async fn fenced<T>(
        &self,
        id: &KeyId,
        presented: Option<LeaseToken>,
        log: Option<(Actor, &str)>,
        write: impl FnOnce(&mut KeyRecord, DateTime<Utc>) -> T + Send,
    ) -> Result<T, StoreError> {
        let done = self.db().write(id, presented, log, write);
        match done {
            Some(out) => Ok(out),
            None => Err(refused_write(self, id, presented).await),
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        Ok(self.db().now())
    }

    async fn claim(&self, c: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        let mut db = self.db();
        let now = db.now();
        let key = db.keys.entry(c.id.clone()).or_default();
        let (from, transition) = match &mut key.row {
            // A new row, or a key re-created after a purge: its history is kept, its first token
            // is the clock in µs and above any token of its earlier life, and it sends a
            // provider key of its own.
            None => {
                let last = key.history.iter().rev().find_map(|e| e.lease_token);
                let token = now.timestamp_micros().max(last.map_or(0, |t| t.0 + 1));
                let provider_key = provider_key_on_insert(c, key.history.len() as u64 + 1);
                key.row = Some(KeyRecord {
                    scope: c.id.scope.clone(),
                    key: c.id.key.clone(),
                    operation: c.operation.clone(),
                    provider: c.provider.clone(),
                    provider_key,
                    state: KeyState::Processing,
                    fingerprint: c.fingerprint.clone(),
                    request: c.request.clone(),
                    response: None,
                    error: None,
                    lease_token: LeaseToken(token),
                    lease_owner: Some(c.owner.clone()),
                    lease_expires_at: Some(after(now, millis(c.lease))),
                    attempts: 1,
                    created_at: now,
                    last_attempt_at: now,
                    may_have_acted: false,
                    updated_at: now,
                    expires_at: None,
                    next_check_at: None,
                    retention_ms: millis(c.retention),
                });
                (None, Transition::Claim)
            }
            Some(r) if !claimable(c, r, now) => {
                let record = Box::new(r.clone());
                return Ok(ClaimOutcome::Existing { record, now });
            }
            // A reclaim of failed{retryable}, or a retry's takeover of an expired lease.
            Some(r) => {
                let from = r.state;
                let transition = if from == KeyState::Processing {
                    r.may_have_acted = true; // the earlier holder never recorded its outcome
                    Transition::Takeover
                } else {
                    if r.provider != c.provider {
                        // Nothing may have acted at the recorded provider (`claimable`).
                        r.provider = c.provider.clone();
                        let life = key.history.len() as u64 + 1;
                        r.provider_key = provider_key_on_change(c, &r.provider_key, life);
                    }
                    Transition::Reclaim
                };
                r.state = KeyState::Processing;
                r.lease_token.0 += 1;
                r.lease_owner = Some(c.owner.clone());
                r.lease_expires_at = Some(after(now, millis(c.lease)));
                r.attempts += 1;
                r.request = c.request.clone().or(r.request.take());
                (r.response, r.error, r.expires_at, r.next_check_at) = (None, None, None, None);
                (r.last_attempt_at, r.updated_at) = (now, now);
                r.retention_ms = millis(c.retention);
                (Some(from), transition)
            }
        };
        let r = key.row.clone().expect("claimed");
        let why = transition.claim_reason().expect("a claim transition");
        key.log(from, r.lease_token, Actor::Worker, why, now);
        Ok(ClaimOutcome::Claimed(Lease {
            token: r.lease_token,
            expires_at: r.lease_expires_at.expect("a processing row has a lease"),
            attempts: r.attempts,
            provider_key: r.provider_key,
            transition,
            may_have_acted: r.may_have_acted,
            created_at: r.created_at,
        }))
    }

    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        f: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        check_finish(mode, f.to)?;
        let log = Some((f.actor, f.reason.as_str()));
        self.fenced(id, mode.presented(), log, |r, now| {
            if mode.holder().is_none() {
                r.lease_token.0 += 1; // an operator's write fences out every running worker
            }
            r.state = f.to;
            r.response = f.response.clone();
            r.error = f.error.clone();
            (r.lease_owner, r.lease_expires_at, r.next_check_at) = (None, None, None);
            r.may_have_acted &= !f.to.is_retryable();
            r.updated_at = now;
            r.expires_at = Some(after(now, r.retention_ms));
            r.clone()
        })
        .await
    }

    async fn release(
        &self,
        id: &KeyId,
        token: LeaseToken,
        rel: &Release,
    ) -> Result<(), StoreError> {
        let log = Some((rel.actor, rel.reason.as_str()));
        self.fenced(id, Some(token), log, |r, now| {
            r.lease_owner = None;
            r.lease_expires_at = r.lease_expires_at.map(|exp| exp.min(now));
            r.next_check_at = rel.recheck_after.map(|d| after(now, millis(d)));
            r.error = rel.error.clone().or(r.error.take());
            r.updated_at = now;
            if rel.actor == Actor::Worker {
                // The worker's attempt may have reached the provider until now.
                (r.last_attempt_at, r.may_have_acted) = (now, true);
            }
        })
        .await
    }

    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        self.fenced(id, Some(token), None, |r, now| {
            (r.last_attempt_at, r.may_have_acted, r.updated_at) = (now, true, now);
        })
        .await
    }

    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        let renewed = self
            .fenced(id, Some(token), None, |r, now| {
                // A lease given back (no owner) is not renewed.
                r.lease_owner.as_ref()?;
                r.lease_expires_at = Some(after(now, millis(lease)));
                r.lease_expires_at
            })
            .await?;
        match renewed {
            Some(exp) => Ok(exp),
            None => Err(refused_write(self, id, Some(token)).await),
        }
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.db().keys.get(id).and_then(|k| k.row.clone()))
    }
}

#[async_trait]
impl SweeperStore for MemoryStore {
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        let mut db = self.db();
        let now = db.now();
        let mut due: Vec<_> = db
            .rows()
            .filter(|r| r.state == KeyState::Processing)
            .filter(|r| r.lease_expires_at.is_some_and(|exp| exp <= now))
            .filter(|r| r.next_check_at.is_none_or(|at| at <= now))
            .filter(|r| take.scope.as_deref().is_none_or(|s| r.scope.as_str() == s))
            .map(|r| {
                (
                    r.lease_expires_at,
                    KeyId::new(r.scope.clone(), r.key.clone()),
                )
            })
            .collect();
        due.sort_by_key(|(exp, _)| *exp);
        due.truncate(take.limit as usize);
        let why = "sweeper took over an expired lease";
        let taken = due.iter().filter_map(|(_, id)| {
            db.write(id, None, Some((Actor::Sweeper, why)), |r, now| {
                if r.lease_owner.is_some() {
                    // The holder did not give the lease back: it may have sent until its end.
                    r.last_attempt_at = r.last_attempt_at.max(r.lease_expires_at.unwrap_or(now));
                }
                r.lease_token.0 += 1;
                r.lease_owner = Some(take.owner.clone());
                r.lease_expires_at = Some(after(now, millis(take.lease)));
                r.attempts += 1;
                (r.may_have_acted, r.updated_at) = (true, now);
                r.clone()
            })
        });
        Ok(taken.collect())
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let mut db = self.db();
        let now = db.now();
        let mut due = db.expired(now);
        due.truncate(batch as usize);
        for (_, id) in &due {
            let key = db.keys.get_mut(id).expect("listed");
            let gone = key.row.take().expect("listed");
            key.log(
                Some(gone.state),
                gone.lease_token,
                Actor::Purge,
                "retention expired",
                now,
            );
        }
        Ok(due.len() as u64)
    }

    async fn count_expired(&self) -> Result<u64, StoreError> {
        let mut db = self.db();
        let now = db.now();
        Ok(db.expired(now).len() as u64)
    }
}

#[async_trait]
impl OperatorStore for MemoryStore {
    async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError> {
        Ok(self
            .db()
            .keys
            .get(id)
            .map(|k| k.history.clone())
            .unwrap_or_default())
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut db = self.db();
        let now = db.now();
        let mut s = Stats {
            now,
            ..Stats::default()
        };
        for r in db.rows() {
            match r.state {
                KeyState::Processing => {
                    s.processing += 1;
                    s.stale += i64::from(r.lease_expires_at.is_some_and(|exp| exp <= now));
                    let oldest = s.oldest_processing_created_at.get_or_insert(r.created_at);
                    *oldest = (*oldest).min(r.created_at);
                }
                KeyState::Done => s.done += 1,
                KeyState::Failed { retryable: true } => s.failed_retryable += 1,
                KeyState::Failed { retryable: false } => s.failed_permanent += 1,
            }
        }
        Ok(s)
    }

    async fn stuck(&self, older_than: Duration, limit: u32) -> Result<Stuck, StoreError> {
        let mut db = self.db();
        let cutoff = after(db.now(), -millis(older_than));
        let mut oldest: Vec<KeyRecord> = db
            .rows()
            .filter(|r| r.state == KeyState::Processing && r.created_at <= cutoff)
            .cloned()
            .collect();
        oldest.sort_by_key(|r| r.created_at);
        let count = oldest.len() as i64;
        oldest.truncate(limit as usize);
        Ok(Stuck { count, oldest })
    }
}

/// The suites' factory: a fresh store per test, so the table-wide calls (`take_stale`, `purge`,
/// `stats`) see only that test's keys.
async fn memory_store() -> Option<Arc<dyn Store>> {
    Some(Arc::new(MemoryStore::default()))
}

mod store_suite {
    idemflow::conformance_tests!(super::memory_store);
}

mod sweeper_suite {
    idemflow::sweeper_tests!(super::memory_store);
}
