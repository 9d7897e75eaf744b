//! What one run of an operation is classified as ([`Outcome`]): the answer an operation gives
//! the executor, and what a provider's records say it did (`provider::Lookup::Found`). Part of
//! the domain, below the stores, providers and the executor (`ARCHITECTURE.md`).

use crate::StoredResponse;

/// What one run of an operation did, as its caller classifies it: the operation's outcome, which
/// decides the key's state (`docs/design.md`, *States*). A provider's reply to a call is a
/// [`CallReply`](crate::provider::CallReply); what `execute` gives back is an
/// [`Execution`](crate::Execution).
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
