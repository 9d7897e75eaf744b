//! What an operation's outcome does to its key ([`decide`]): a pure decision, apart from the
//! store writes that carry it out (`Idempotency::run_claimed`), as the sweeper's decisions are
//! apart in `sweeper/decide.rs`.

use crate::Outcome;
use crate::response::StoredResponse;
use crate::state::{KeyState, RetryEvidence, may_become_retryable};

/// The transition an outcome asks for, and what the caller is then told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WorkerDecision {
    /// Store the answer: the key becomes `to` (`done` or `failed{permanent}`) and the answer
    /// is replayed from then on.
    Store {
        to: KeyState,
        response: StoredResponse,
    },
    /// The provider surely did nothing: `failed{retryable}`, with `error`; the caller is told
    /// `FailedRetryable`.
    Retryable { error: String },
    /// It may have happened: the lease is released for the sweeper (history reason
    /// `reason`, `error` kept); the caller is told `OutcomeUnknown` with `told`.
    Release {
        reason: &'static str,
        error: String,
        told: String,
    },
}

/// What `outcome` does to a key held by an attempt for which `may_have_acted` says whether an
/// earlier attempt may have acted (`docs/design.md`, *States*).
pub(crate) fn decide(outcome: Outcome, may_have_acted: bool) -> WorkerDecision {
    match outcome {
        Outcome::Succeeded(response) => WorkerDecision::Store {
            to: KeyState::Done,
            response,
        },
        Outcome::Rejected(response) => WorkerDecision::Store {
            to: KeyState::Failed { retryable: false },
            response,
        },
        // This attempt did nothing, but an earlier one may have acted: the key must not become
        // retryable (a retry could act twice). The sweeper finds out.
        Outcome::Retryable { reason }
            if !may_become_retryable(may_have_acted, RetryEvidence::ThisAttemptDidNothing) =>
        {
            WorkerDecision::Release {
                reason: "retryable answer after an earlier attempt that may have acted; outcome \
                         unknown, left for the sweeper",
                told: format!("an earlier attempt may have acted; this one: {reason}"),
                error: reason,
            }
        }
        Outcome::Retryable { reason } => WorkerDecision::Retryable { error: reason },
        Outcome::Unknown { reason } => WorkerDecision::Release {
            reason: "outcome unknown; left for the sweeper",
            told: reason.clone(),
            error: reason,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_settles_as_the_table_says() {
        let ok = StoredResponse::new(201);
        let no = StoredResponse::new(402);
        let unknown = |reason: &str, told: &str| WorkerDecision::Release {
            reason: "outcome unknown; left for the sweeper",
            error: reason.to_owned(),
            told: told.to_owned(),
        };
        let table = [
            // (outcome, an earlier attempt may have acted, settled as)
            (
                Outcome::Succeeded(ok.clone()),
                false,
                WorkerDecision::Store {
                    to: KeyState::Done,
                    response: ok.clone(),
                },
            ),
            (
                Outcome::Succeeded(ok.clone()),
                true,
                WorkerDecision::Store {
                    to: KeyState::Done,
                    response: ok.clone(),
                },
            ),
            (
                Outcome::Rejected(no.clone()),
                true,
                WorkerDecision::Store {
                    to: KeyState::Failed { retryable: false },
                    response: no.clone(),
                },
            ),
            (
                Outcome::retryable("429"),
                false,
                WorkerDecision::Retryable {
                    error: "429".to_owned(),
                },
            ),
            (
                Outcome::retryable("429"),
                true,
                WorkerDecision::Release {
                    reason: "retryable answer after an earlier attempt that may have acted; \
                             outcome unknown, left for the sweeper",
                    error: "429".to_owned(),
                    told: "an earlier attempt may have acted; this one: 429".to_owned(),
                },
            ),
            (
                Outcome::unknown("timeout"),
                false,
                unknown("timeout", "timeout"),
            ),
            (
                Outcome::unknown("timeout"),
                true,
                unknown("timeout", "timeout"),
            ),
        ];
        for (outcome, acted, want) in table {
            assert_eq!(
                decide(outcome.clone(), acted),
                want,
                "{outcome:?}, acted {acted}"
            );
        }
    }
}
