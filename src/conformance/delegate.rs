//! A store that passes every call on to another, changing only the calls it names: the way to
//! write a test store that injects faults, pauses or records ([`FaultyStore`] is one).
//!
//! Implement [`Delegate`] with [`inner`](Delegate::inner) and the methods you change; every other
//! method passes through, and the type is a [`Store`] (with its [`SweeperStore`] and
//! [`OperatorStore`] parts).
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//!
//! use idemflow::conformance::Delegate;
//! use idemflow::store::{ClaimOutcome, NewClaim};
//! use idemflow::{Store, StoreError, async_trait};
//!
//! /// Counts claims.
//! #[derive(Debug)]
//! struct CountingClaims {
//!     inner: Arc<dyn Store>,
//!     claims: AtomicU32,
//! }
//!
//! #[async_trait]
//! impl Delegate for CountingClaims {
//!     fn inner(&self) -> &dyn Store {
//!         &*self.inner
//!     }
//!
//!     async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
//!         self.claims.fetch_add(1, Ordering::Relaxed);
//!         self.inner.claim(claim).await
//!     }
//! }
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! # let store = idemflow::store::sqlite::SqliteStore::connect("sqlite::memory:").await.unwrap();
//! # store.migrate().await.unwrap();
//! let counted: Arc<dyn Store> = Arc::new(CountingClaims {
//!     inner: Arc::new(store),
//!     claims: AtomicU32::new(0),
//! });
//! assert_eq!(counted.backend(), "sqlite");
//! # }
//! ```
//!
//! [`FaultyStore`]: super::FaultyStore

use crate::store::FinishMode;
use std::fmt::Debug;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::KeyId;
use crate::error::StoreError;
use crate::record::{KeyEvent, KeyRecord, LeaseToken};
use crate::store::{
    ClaimOutcome, Finish, NewClaim, OperatorStore, Release, Stats, Store, Stuck, SweeperStore,
    TakeStale,
};

/// A store that passes calls on to [`inner`](Delegate::inner); each method's default does just
/// that. Every `Delegate` is a [`Store`].
#[async_trait]
#[allow(missing_docs)] // Each method is the `Store` method of the same name.
pub trait Delegate: Debug + Send + Sync + 'static {
    /// The store the calls go to.
    fn inner(&self) -> &dyn Store;

    fn backend(&self) -> &'static str {
        self.inner().backend()
    }
    fn phase_store(&self) -> Option<crate::store::phase::StoreId> {
        self.inner().phase_store()
    }
    async fn migrate(&self) -> Result<(), StoreError> {
        self.inner().migrate().await
    }
    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        self.inner().now().await
    }
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        self.inner().claim(claim).await
    }
    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        self.inner().finish_as(id, mode, finish).await
    }
    async fn release(&self, id: &KeyId, token: LeaseToken, r: &Release) -> Result<(), StoreError> {
        self.inner().release(id, token, r).await
    }
    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        self.inner().mark_attempt(id, token).await
    }
    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        self.inner().extend(id, token, lease).await
    }
    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        self.inner().get(id).await
    }
    async fn announce_end(&self, id: &KeyId) -> Result<bool, StoreError> {
        self.inner().announce_end(id).await
    }
    fn key_ends(&self) -> Option<tokio::sync::broadcast::Receiver<crate::store::KeyEnd>> {
        self.inner().key_ends()
    }
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        self.inner().take_stale(take).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.inner().purge_expired(batch).await
    }
    async fn count_expired(&self) -> Result<u64, StoreError> {
        self.inner().count_expired().await
    }
    async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError> {
        self.inner().history(id).await
    }
    async fn stats(&self) -> Result<Stats, StoreError> {
        self.inner().stats().await
    }
    async fn stuck(&self, older_than: Duration, limit: u32) -> Result<Stuck, StoreError> {
        self.inner().stuck(older_than, limit).await
    }
}

#[async_trait]
impl<D: Delegate> Store for D {
    fn backend(&self) -> &'static str {
        Delegate::backend(self)
    }
    fn phase_store(&self) -> Option<crate::store::phase::StoreId> {
        Delegate::phase_store(self)
    }
    async fn migrate(&self) -> Result<(), StoreError> {
        Delegate::migrate(self).await
    }
    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        Delegate::now(self).await
    }
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        Delegate::claim(self, claim).await
    }
    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        Delegate::finish_as(self, id, mode, finish).await
    }
    async fn release(&self, id: &KeyId, token: LeaseToken, r: &Release) -> Result<(), StoreError> {
        Delegate::release(self, id, token, r).await
    }
    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        Delegate::mark_attempt(self, id, token).await
    }
    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        Delegate::extend(self, id, token, lease).await
    }
    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        Delegate::get(self, id).await
    }
    async fn announce_end(&self, id: &KeyId) -> Result<bool, StoreError> {
        Delegate::announce_end(self, id).await
    }
    fn key_ends(&self) -> Option<tokio::sync::broadcast::Receiver<crate::store::KeyEnd>> {
        Delegate::key_ends(self)
    }
}

#[async_trait]
impl<D: Delegate> SweeperStore for D {
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        Delegate::take_stale(self, take).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        Delegate::purge_expired(self, batch).await
    }
    async fn count_expired(&self) -> Result<u64, StoreError> {
        Delegate::count_expired(self).await
    }
}

#[async_trait]
impl<D: Delegate> OperatorStore for D {
    async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError> {
        Delegate::history(self, id).await
    }
    async fn stats(&self) -> Result<Stats, StoreError> {
        Delegate::stats(self).await
    }
    async fn stuck(&self, older_than: Duration, limit: u32) -> Result<Stuck, StoreError> {
        Delegate::stuck(self, older_than, limit).await
    }
}
