//! What [`Idempotency::execute`](crate::Idempotency::execute) gives back: [`Execution`].

use crate::StoredResponse;

/// What [`Idempotency::execute`](crate::Idempotency::execute) gives back: the operation was
/// executed now, or its stored answer was replayed.
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
