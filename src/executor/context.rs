//! What an operation is given: [`Context`], its key, provider key and lease. What the operation
//! returns is the domain's [`Outcome`](crate::outcome::Outcome); what `execute` gives back is
//! [`Execution`](super::Execution).

use chrono::{DateTime, Utc};
use tokio::time::Instant;

use super::heartbeat::LeaseWatch;
use crate::KeyId;
use crate::record::LeaseToken;

/// What the operation is given: the key to forward to the provider and its lease.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) id: KeyId,
    pub(crate) provider_key: String,
    pub(crate) token: LeaseToken,
    pub(crate) attempt: i32,
    /// Whether an earlier attempt of the key may have acted (`Lease::may_have_acted`).
    pub(crate) may_have_acted: bool,
    pub(crate) lease: LeaseWatch,
    /// After a takeover: the end of the window in which the provider still dedupes the first
    /// send (the takeover window counted from the key's first claim), on this process's clock.
    pub(crate) send_by: Option<Instant>,
    pub(crate) request: String,
    /// The state of a workflow's run, kept by the workflow layer (`hook.rs`): its steps run
    /// through it.
    pub(crate) run: Option<std::sync::Arc<dyn super::hook::RunState>>,
}

impl Context {
    /// The key to forward to the provider (`Idempotency-Key` header, metadata, ...). The same on
    /// every attempt, by every process, and for the sweeper.
    pub fn provider_key(&self) -> &str {
        &self.provider_key
    }

    /// Scope and key.
    pub fn id(&self) -> &KeyId {
        &self.id
    }

    /// The fencing token of this attempt.
    pub fn lease_token(&self) -> LeaseToken {
        self.token
    }

    /// 1 for the first attempt, more after a retryable failure or a takeover.
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// When the lease ends (database clock), as last renewed. `execute` renews it every third
    /// of the lease while the operation runs; past it, a sweeper may take the key over.
    pub fn lease_expires_at(&self) -> DateTime<Utc> {
        self.lease.state().expires_at
    }

    /// Whether this attempt has lost its lease: another process took the key over (renewal was
    /// refused), or the store could not be reached until the lease ran out. The operation should
    /// stop as soon as it can; whatever it returns is only stored if the key is still held
    /// under this attempt's token (else `execute` returns [`Error::LeaseLost`]).
    ///
    /// [`Error::LeaseLost`]: crate::Error::LeaseLost
    pub fn lease_lost(&self) -> bool {
        self.lease.state().lost
    }

    /// Resolves when this attempt loses its lease (see [`lease_lost`](Self::lease_lost)); never
    /// while the lease is held. Use it in a `tokio::select!` to stop a long operation.
    pub async fn lost(&self) {
        self.lease.lost().await;
    }

    /// Whether this attempt may still send the request that acts, judged now on this process's
    /// monotonic clock:
    ///
    /// * its lease is surely held: not lost, and not run out since the claim or the last
    ///   renewal was *sent* (a process paused past its lease, say by a long GC pause or a
    ///   suspended VM, cannot see that from the lease it last heard of, but this can);
    /// * after a takeover ([`ExecutorConfig::retry_takeover_window`]), the window is still
    ///   open: the provider dedupes the re-send only inside it, counted from the key's first
    ///   claim.
    ///
    /// Check it immediately before the call that acts, and do not send when it is `false`:
    /// [`Idempotency::call`] does exactly that (the attempt then ends as "nothing sent", and a
    /// key that an earlier attempt may have acted on is left to the sweeper). What it cannot
    /// cover is a pause *between* this check and the request reaching the provider: the
    /// provider re-drive margin and the adapters' search lag are sized for that
    /// (`docs/reliability.md`, "What the guarantee assumes").
    ///
    /// [`ExecutorConfig::retry_takeover_window`]: crate::executor::ExecutorConfig::retry_takeover_window
    /// [`Idempotency::call`]: crate::Idempotency::call
    pub fn may_send(&self) -> bool {
        self.send_refusal().is_none()
    }

    /// Why this attempt must not send now, if it must not (see [`may_send`](Self::may_send)).
    pub(crate) fn send_refusal(&self) -> Option<&'static str> {
        let lease = self.lease.state();
        let now = Instant::now();
        if lease.lost {
            Some("the lease was lost before sending")
        } else if now >= lease.held_until {
            Some("the lease ran out before sending (the process was paused or the store slow)")
        } else if self.send_by.is_some_and(|by| now >= by) {
            Some("the provider's dedup window closed before the takeover could re-send")
        } else {
            None
        }
    }

    /// The canonical JSON request.
    pub fn request(&self) -> &str {
        &self.request
    }
}
