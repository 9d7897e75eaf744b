//! What an operation returns ([`Outcome`]), what it is given ([`Context`]) and what `execute`
//! returns ([`Execution`]).

use chrono::{DateTime, Utc};

use super::heartbeat::LeaseWatch;
use crate::record::LeaseToken;
use crate::{KeyId, StoredResponse};

/// How the caller classifies one run of the operation (`docs/design.md`, *States*).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It worked: the key becomes `done` and this response is replayed.
    Succeeded(StoredResponse),
    /// A permanent refusal (card declined, invalid recipient): the key becomes
    /// `failed{permanent}` and this response is replayed.
    Rejected(StoredResponse),
    /// The provider surely did nothing (connection refused before sending, 429, an explicit
    /// "should retry"): the key becomes `failed{retryable}` and a retry runs it again.
    Retryable {
        /// Why.
        reason: String,
    },
    /// It may or may not have happened (timeout after sending, reset, a 5xx that may have
    /// executed): the key stays `processing` with its lease released for the sweeper.
    Unknown {
        /// Why.
        reason: String,
    },
}

impl Outcome {
    /// Shorthand for [`Outcome::Retryable`].
    pub fn retryable(reason: impl Into<String>) -> Self {
        Outcome::Retryable {
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Outcome::Unknown`].
    pub fn unknown(reason: impl Into<String>) -> Self {
        Outcome::Unknown {
            reason: reason.into(),
        }
    }
}

/// What the operation is given: the key to forward to the provider and its lease.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) id: KeyId,
    pub(crate) provider_key: String,
    pub(crate) token: LeaseToken,
    pub(crate) attempt: i32,
    pub(crate) lease: LeaseWatch,
    pub(crate) request: String,
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

    /// The canonical JSON request.
    pub fn request(&self) -> &str {
        &self.request
    }
}

/// The result of [`Idempotency::execute`](crate::Idempotency::execute).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Execution {
    /// The operation ran now; this is its response (success or permanent refusal).
    Executed(StoredResponse),
    /// The operation had already run; this is the stored response, byte for byte.
    Replayed(StoredResponse),
}

impl Execution {
    /// The response, executed or replayed.
    pub fn response(&self) -> &StoredResponse {
        match self {
            Execution::Executed(r) | Execution::Replayed(r) => r,
        }
    }

    /// Takes the response.
    pub fn into_response(self) -> StoredResponse {
        match self {
            Execution::Executed(r) | Execution::Replayed(r) => r,
        }
    }

    /// Whether this is a replay.
    pub fn is_replay(&self) -> bool {
        matches!(self, Execution::Replayed(_))
    }
}
