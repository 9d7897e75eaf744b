//! The key state machine: the one place that says which transitions are legal.
//!
//! ```text
//!  (none) --claim--> processing --complete--> done
//!                    |   ^   \---reject----> failed{permanent}
//!                    |   |    \--fail------> failed{retryable} --reclaim--> processing
//!                    |   +-- takeover (lease expired; new token) / release / defer
//!  done | failed --purge--> (none)
//! ```
//!
//! Stores enforce the same rules in their statements (a `WHERE state = ...` on every write); the
//! executor, the sweeper and the operator tools ask [`transition`] first, so an illegal request is
//! refused with [`InvalidTransition`] before any statement runs.

use std::fmt;
use std::str::FromStr;

/// The state of one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyState {
    /// Claimed; the operation may be running. Guarded by a lease with a fencing token.
    Processing,
    /// Finished with a result that is replayed until the key expires.
    Done,
    /// Finished without success.
    Failed {
        /// `true`: the provider surely did nothing and a retry with the same request runs it
        /// again. `false`: a permanent answer (card declined) that is replayed.
        retryable: bool,
    },
}

impl KeyState {
    /// The name stored in the `state` column.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::Processing => "processing",
            KeyState::Done => "done",
            KeyState::Failed { .. } => "failed",
        }
    }

    /// Rebuilds a state from its column values.
    pub fn from_columns(state: &str, retryable: bool) -> Result<Self, ParseStateError> {
        match state {
            "processing" => Ok(KeyState::Processing),
            "done" => Ok(KeyState::Done),
            "failed" => Ok(KeyState::Failed { retryable }),
            other => Err(ParseStateError(other.to_owned())),
        }
    }

    /// Whether the `retryable` column is set.
    pub fn is_retryable(self) -> bool {
        matches!(self, KeyState::Failed { retryable: true })
    }

    /// Whether this state is final for a client (replayed).
    pub fn is_terminal(self) -> bool {
        matches!(self, KeyState::Done | KeyState::Failed { retryable: false })
    }
}

impl fmt::Display for KeyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyState::Failed { retryable: true } => f.write_str("failed(retryable)"),
            KeyState::Failed { retryable: false } => f.write_str("failed(permanent)"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// A stored state name that is not one of ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown key state {0:?} in the store")]
pub struct ParseStateError(pub String);

impl FromStr for KeyState {
    type Err = ParseStateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "failed(retryable)" => Ok(KeyState::Failed { retryable: true }),
            "failed(permanent)" | "failed" => Ok(KeyState::Failed { retryable: false }),
            other => KeyState::from_columns(other, false),
        }
    }
}

/// Everything that can happen to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transition {
    /// A new key is claimed by a worker.
    Claim,
    /// A `failed{retryable}` key is claimed again by a retry with the same request.
    Reclaim,
    /// A processing key whose lease expired is taken over (sweeper, or a retry when re-drive is
    /// safe) with a new fencing token.
    Takeover,
    /// The lease holder stores a success.
    Complete,
    /// The lease holder stores a permanent failure (replayed).
    Reject,
    /// The lease holder records that the provider surely did nothing.
    FailRetryable,
    /// The lease holder gives the lease back early: the outcome is unknown and the sweeper must
    /// find out. The key stays processing.
    Release,
    /// The sweeper could not decide yet and postpones the next check. The key stays processing.
    Defer,
    /// An operator decides a key by hand, whatever its state (audited).
    Override(KeyState),
    /// The retention window is over and the row is deleted.
    Purge,
}

impl Transition {
    /// The history reason a claim records: one definition for every backend. The claim
    /// statements write these strings and the stores read them back with
    /// [`Transition::from_claim_reason`] to learn which transition granted the lease.
    pub const CLAIM_REASONS: [(Transition, &'static str); 3] = [
        (Transition::Claim, "claimed"),
        (Transition::Reclaim, "reclaimed after a retryable failure"),
        (Transition::Takeover, "retry took over an expired lease"),
    ];

    /// The history reason recorded by a claim that made this transition (`None` for the
    /// transitions a claim never makes).
    pub fn claim_reason(self) -> Option<&'static str> {
        Self::CLAIM_REASONS
            .iter()
            .find(|(t, _)| *t == self)
            .map(|(_, r)| *r)
    }

    /// The claim transition a stored reason stands for (`None`: not a claim reason).
    ///
    /// ```
    /// use idemflow::state::Transition;
    /// let r = Transition::Reclaim.claim_reason().unwrap();
    /// assert_eq!(Transition::from_claim_reason(r), Some(Transition::Reclaim));
    /// assert_eq!(Transition::from_claim_reason("purged"), None);
    /// ```
    pub fn from_claim_reason(reason: &str) -> Option<Self> {
        Self::CLAIM_REASONS
            .iter()
            .find(|(_, r)| *r == reason)
            .map(|(t, _)| *t)
    }
}

/// A transition that the state machine refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("transition {transition:?} is not allowed from {}", from.map_or("(no row)".to_owned(), |s| s.to_string()))]
pub struct InvalidTransition {
    /// The state the key was in (`None`: no row).
    pub from: Option<KeyState>,
    /// What was asked.
    pub transition: Transition,
}

/// Applies `transition` to `from` (`None` means the key has no row) and returns the new state
/// (`None` means the row is gone), or refuses.
///
/// ```
/// use idemflow::state::{transition, KeyState, Transition};
/// assert_eq!(transition(None, Transition::Claim), Ok(Some(KeyState::Processing)));
/// assert!(transition(Some(KeyState::Done), Transition::Complete).is_err());
/// ```
pub fn transition(
    from: Option<KeyState>,
    transition: Transition,
) -> Result<Option<KeyState>, InvalidTransition> {
    use KeyState::{Done, Failed, Processing};
    use Transition as T;
    let to = match (from, transition) {
        (None, T::Claim) => Some(Processing),
        (Some(Failed { retryable: true }), T::Reclaim) => Some(Processing),
        (Some(Processing), T::Takeover | T::Release | T::Defer) => Some(Processing),
        (Some(Processing), T::Complete) => Some(Done),
        (Some(Processing), T::Reject) => Some(Failed { retryable: false }),
        (Some(Processing), T::FailRetryable) => Some(Failed { retryable: true }),
        (Some(_), T::Override(to @ (Done | Failed { .. }))) => Some(to),
        (Some(Done | Failed { .. }), T::Purge) => None,
        _ => return Err(InvalidTransition { from, transition }),
    };
    Ok(to)
}

/// Why a key would become `failed{retryable}` (the client's next retry runs the operation again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetryEvidence {
    /// This attempt's answer says it surely did nothing (a 429, a refused connection, a
    /// `Retryable` outcome). It says nothing about earlier attempts.
    ThisAttemptDidNothing,
    /// The provider authoritatively has no record of the request: a lookup made after the latest
    /// attempt's search lag (the lookup adapter judges that from `last_attempt_at`).
    AuthoritativeNotFound,
    /// The provider confirmed that the request was voided (where a provider offers one).
    ConfirmedVoid,
}

/// The one rule for "no double effect": whether a key may become `failed{retryable}` given
/// whether an earlier attempt may have acted (`KeyRecord::may_have_acted`,
/// `Lease::may_have_acted`) and the evidence at hand. Once an attempt may have acted, only
/// authoritative evidence about the provider's side (an authoritative not-found, a confirmed
/// void) may make the key retryable; an attempt that merely did nothing itself may not, because
/// the earlier one may have charged. The executor, the axum layer (through the executor) and the
/// sweeper all ask it; when it says no, the key is released as unknown for the sweeper.
///
/// ```
/// use idemflow::state::{may_become_retryable, RetryEvidence};
/// assert!(may_become_retryable(false, RetryEvidence::ThisAttemptDidNothing));
/// assert!(!may_become_retryable(true, RetryEvidence::ThisAttemptDidNothing));
/// assert!(may_become_retryable(true, RetryEvidence::AuthoritativeNotFound));
/// ```
pub fn may_become_retryable(may_have_acted: bool, evidence: RetryEvidence) -> bool {
    match evidence {
        RetryEvidence::ThisAttemptDidNothing => !may_have_acted,
        RetryEvidence::AuthoritativeNotFound | RetryEvidence::ConfirmedVoid => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_authoritative_evidence_makes_an_acted_key_retryable() {
        use RetryEvidence as E;
        for acted in [false, true] {
            assert_eq!(
                may_become_retryable(acted, E::ThisAttemptDidNothing),
                !acted
            );
            assert!(may_become_retryable(acted, E::AuthoritativeNotFound));
            assert!(may_become_retryable(acted, E::ConfirmedVoid));
        }
    }

    const STATES: [Option<KeyState>; 5] = [
        None,
        Some(KeyState::Processing),
        Some(KeyState::Done),
        Some(KeyState::Failed { retryable: true }),
        Some(KeyState::Failed { retryable: false }),
    ];

    #[test]
    fn exactly_the_listed_transitions_are_legal() {
        use Transition as T;
        let all = [
            T::Claim,
            T::Reclaim,
            T::Takeover,
            T::Complete,
            T::Reject,
            T::FailRetryable,
            T::Release,
            T::Defer,
            T::Override(KeyState::Done),
            T::Override(KeyState::Failed { retryable: true }),
            T::Override(KeyState::Processing),
            T::Purge,
        ];
        let mut legal = 0;
        for from in STATES {
            for t in all {
                if transition(from, t).is_ok() {
                    legal += 1;
                }
            }
        }
        // claim 1, reclaim 1, takeover/release/defer 3, complete/reject/fail 3,
        // override to done or failed from 4 states = 8, purge from 3 finished states = 3.
        assert_eq!(legal, 1 + 1 + 3 + 3 + 8 + 3);
        assert!(transition(Some(KeyState::Processing), T::Purge).is_err());
        assert!(transition(Some(KeyState::Failed { retryable: false }), T::Reclaim).is_err());
        assert!(transition(Some(KeyState::Done), T::Takeover).is_err());
        assert!(transition(None, T::Complete).is_err());
        assert!(transition(Some(KeyState::Done), T::Override(KeyState::Processing)).is_err());
    }

    #[test]
    fn states_round_trip_through_text() {
        for s in STATES.into_iter().flatten() {
            assert_eq!(s.to_string().parse::<KeyState>(), Ok(s));
            assert_eq!(KeyState::from_columns(s.as_str(), s.is_retryable()), Ok(s));
        }
        assert!(KeyState::from_columns("weird", false).is_err());
    }
}
