//! [`FaultyStore`]: a store with injected faults, for the sweeper suite and for tests of a
//! store's recovery.

use crate::store::FinishMode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::Delegate;
use crate::KeyId;
use crate::error::StoreError;
use crate::record::{Actor, KeyRecord, LeaseToken};
use crate::setters::setters;
use crate::store::{ClaimOutcome, Finish, NewClaim, Store, TakeStale};

/// A store with injected faults: failed worker finishes (crash point (d): during completion),
/// failed renewals (a partition), and answers that arrive late (the database acted, then the
/// process was paused or the network slow before the caller heard of it).
#[derive(Debug)]
pub struct FaultyStore {
    inner: Arc<dyn Store>,
    fail_worker_finishes: AtomicU32,
    fail_extends: bool,
    late_claims: Duration,
    late_take_stale: Duration,
    late_mark_attempts: Duration,
    late_clock: Duration,
}

impl FaultyStore {
    /// Wraps `inner`, with no fault yet.
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            fail_worker_finishes: AtomicU32::new(0),
            fail_extends: false,
            late_claims: Duration::ZERO,
            late_take_stale: Duration::ZERO,
            late_mark_attempts: Duration::ZERO,
            late_clock: Duration::ZERO,
        }
    }

    /// Fails the next `n` worker finishes, as a lost connection would.
    pub fn fail_worker_finishes(self, n: u32) -> Self {
        self.fail_worker_finishes.store(n, Ordering::SeqCst);
        self
    }

    /// Fails every lease renewal, as a network partition or a paused process would: the
    /// worker's lease runs out while it is stalled.
    pub fn partitioned(mut self) -> Self {
        self.fail_extends = true;
        self
    }

    setters! {
        /// Answers every claim `late_claims` after the database granted it.
        answer_claims_late(late_claims: Duration);

        /// Answers every `take_stale` `late_take_stale` after the database granted it.
        answer_take_stale_late(late_take_stale: Duration);

        /// Answers every `mark_attempt` `late_mark_attempts` after the database recorded it.
        answer_mark_attempts_late(late_mark_attempts: Duration);

        /// Reads the database clock (`now`) `late_clock` after it was asked for, as a loaded database
        /// that runs the query late does: the answer is the database's time when it ran.
        read_clock_late(late_clock: Duration);
    }
}

#[async_trait]
impl Delegate for FaultyStore {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }
    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        tokio::time::sleep(self.late_clock).await;
        self.inner.now().await
    }
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        let r = self.inner.claim(claim).await;
        tokio::time::sleep(self.late_claims).await;
        r
    }
    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        if finish.actor == Actor::Worker
            && self
                .fail_worker_finishes
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(StoreError::database(
                "test",
                "injected: connection lost while completing",
            ));
        }
        self.inner.finish_as(id, mode, finish).await
    }
    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        let r = self.inner.mark_attempt(id, token).await;
        tokio::time::sleep(self.late_mark_attempts).await;
        r
    }
    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        if self.fail_extends {
            return Err(StoreError::database("test", "injected: partitioned"));
        }
        self.inner.extend(id, token, lease).await
    }
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        let r = self.inner.take_stale(take).await;
        tokio::time::sleep(self.late_take_stale).await;
        r
    }
}
