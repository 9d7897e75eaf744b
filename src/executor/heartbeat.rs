//! Lease renewal while an operation runs: every third of the lease, `execute` extends its lease
//! with its token, in the same task as the operation (no detached spawn outlives `execute`).
//!
//! The operation sees the lease through [`LeaseWatch`] (inside its `Context`): when renewal is
//! refused (`LeaseLost`: another process took the key over) or keeps failing until the lease has
//! run out, the watch turns lost. The result is still offered to the store afterwards: the
//! fenced finish stores it only if the key is still held under this token.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::KeyId;
use crate::error::StoreError;
use crate::record::LeaseToken;
use crate::store::Store;

/// The lease of a running attempt as the operation sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LeaseState {
    pub(crate) expires_at: DateTime<Utc>,
    /// Until when the lease is surely held, on this process's monotonic clock: the instant the
    /// claim (or the last successful renewal) was *sent*, plus the lease. The database granted
    /// at least that much, whatever the network and a paused process did since.
    pub(crate) held_until: Instant,
    pub(crate) lost: bool,
}

/// A read-only view of the running attempt's lease, renewed by `execute`.
#[derive(Debug, Clone)]
pub(crate) struct LeaseWatch(watch::Receiver<LeaseState>);

impl LeaseWatch {
    pub(crate) fn new(
        expires_at: DateTime<Utc>,
        held_until: Instant,
    ) -> (watch::Sender<LeaseState>, Self) {
        let (tx, rx) = watch::channel(LeaseState {
            expires_at,
            held_until,
            lost: false,
        });
        (tx, Self(rx))
    }

    pub(crate) fn state(&self) -> LeaseState {
        *self.0.borrow()
    }

    /// Resolves once the lease is lost; never, if the attempt ends with its lease held.
    pub(crate) async fn lost(&self) {
        let mut rx = self.0.clone();
        if rx.wait_for(|s| s.lost).await.is_err() {
            // The attempt ended (sender dropped) without losing its lease.
            std::future::pending::<()>().await;
        }
    }
}

/// Until when a lease of `lease` asked for at `sent` is surely held, on this process's clock.
pub(crate) fn held_from(sent: Instant, lease: Duration) -> Instant {
    sent + crate::store::kit::surely_held_for(lease)
}

/// How often a lease of `lease` is renewed: every third of it (at least every millisecond).
pub(crate) fn period(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(1))
}

/// Renews the lease until it is lost; returns only then (after setting `lost` on the watch).
///
/// A zero lease is not renewed. A refused renewal (`LeaseLost`, `NotFound`) is final. Any other store error is retried (at
/// most every second, at least every period) until the lease, as last renewed, would have run
/// out; then the attempt is treated as lost too (someone may take the key over from now on).
pub(crate) async fn renew(
    store: &dyn Store,
    id: &KeyId,
    token: LeaseToken,
    lease: Duration,
    tx: &watch::Sender<LeaseState>,
) {
    if lease.is_zero() {
        // A zero lease is stale from the start by choice: there is nothing to keep.
        return std::future::pending().await;
    }
    // What the store grants (leases are capped at 100 years); local instants use the same.
    let lease = crate::store::kit::capped(lease);
    let every = period(lease);
    // Local deadline of the lease as last renewed; a renewal counts from when it was sent.
    let mut held_until = tx.borrow().held_until;
    // The first renewal is due a period after the claim was sent, not after the operation
    // started: a claim whose answer was slow has less of its lease left.
    let mut wait = every
        .saturating_sub(lease.saturating_sub(held_until.saturating_duration_since(Instant::now())));
    loop {
        tokio::time::sleep(wait).await;
        let sent = Instant::now();
        match store.extend(id, token, lease).await {
            Ok(expires_at) => {
                held_until = held_from(sent, lease);
                wait = every;
                tx.send_modify(|s| {
                    s.expires_at = expires_at;
                    s.held_until = held_until;
                });
            }
            Err(e @ (StoreError::LeaseLost { .. } | StoreError::NotFound { .. })) => {
                tracing::warn!(key = %id, error = %e, "lease lost while the operation runs");
                break;
            }
            Err(e) => {
                if Instant::now() >= held_until {
                    tracing::warn!(key = %id, error = %e, "lease could not be renewed before it ran out");
                    break;
                }
                tracing::debug!(key = %id, error = %e, "lease renewal failed; retrying");
                wait = every
                    .min(Duration::from_secs(1))
                    .min(held_until.saturating_duration_since(Instant::now()));
            }
        }
    }
    tx.send_modify(|s| s.lost = true);
}

/// Runs `op` to completion while `heartbeat` renews its lease; the heartbeat stops with `op`.
pub(crate) async fn alongside<T>(
    op: impl Future<Output = T>,
    heartbeat: impl Future<Output = ()>,
) -> T {
    tokio::pin!(op);
    tokio::pin!(heartbeat);
    tokio::select! {
        biased;
        out = &mut op => out,
        () = &mut heartbeat => op.await,
    }
}
