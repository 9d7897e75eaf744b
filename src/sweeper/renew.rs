//! The sweeper's heartbeat: keeps the short leases of a whole taken batch while the sweeper
//! works through it, as the executor's heartbeat keeps a request's. Every third of the lease,
//! each key of the batch not yet handled (the one in hand included) is extended with its token;
//! a round in which a renewal failed on a store error is retried within a second. A key whose renewal is refused was settled elsewhere; its own write will say so
//! (the fenced finish or release returns `LeaseLost`), so refusals are not acted on here.

use std::convert::Infallible;
use std::future::Future;
use std::time::{Duration, Instant};

use crate::KeyId;
use crate::error::StoreError;
use crate::record::LeaseToken;
use crate::store::Store;

/// The keys of a batch with the token each was taken under.
pub(super) type Held = [(KeyId, LeaseToken)];

/// Runs `work` while renewing the leases of `held` every third of `lease`. `renewed_at` is when
/// they were last renewed (or taken), kept across keys so that a batch of many quick keys is
/// renewed on time too.
pub(super) async fn while_working<T>(
    store: &dyn Store,
    held: &Held,
    lease: Duration,
    renewed_at: &mut Instant,
    work: impl Future<Output = T>,
) -> T {
    let renew = renew_forever(store, held, lease, renewed_at);
    tokio::pin!(work);
    tokio::pin!(renew);
    tokio::select! {
        biased;
        out = &mut work => out,
        never = &mut renew => match never {},
    }
}

async fn renew_forever(
    store: &dyn Store,
    held: &Held,
    lease: Duration,
    renewed_at: &mut Instant,
) -> Infallible {
    // Capped as the store caps it: `Instant + Duration::MAX` would panic.
    let every = (crate::store::kit::capped(lease) / 3).max(Duration::from_millis(1));
    // After a renewal that failed on a store error (not a refusal), the next round comes this
    // soon, as the executor's heartbeat retries: a short lease leaves little room for a blip.
    let retry = every.min(Duration::from_secs(1));
    loop {
        let due = *renewed_at + every;
        tokio::time::sleep_until(due.into()).await;
        let sent = Instant::now();
        *renewed_at = sent;
        let mut failed = false;
        for (id, token) in held {
            match store.extend(id, *token, lease).await {
                Ok(_) => {}
                // Settled elsewhere: the key's own fenced write will say so.
                Err(e @ (StoreError::LeaseLost { .. } | StoreError::NotFound { .. })) => {
                    tracing::debug!(key = %id, error = %e, "a batch lease was not renewed");
                }
                Err(e) => {
                    failed = true;
                    tracing::warn!(key = %id, error = %e, "sweeper could not renew a batch lease");
                }
            }
        }
        if failed {
            *renewed_at = sent.checked_sub(every - retry).unwrap_or(sent);
        }
    }
}
