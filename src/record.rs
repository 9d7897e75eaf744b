//! What a store returns: the key row ([`KeyRecord`]) and its history ([`KeyEvent`]).

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{KeyState, StoredResponse, fingerprint::Fingerprint, key::IdempotencyKey, key::Scope};

/// A fencing token: every claim and takeover gets a new, larger one. Writes with an older token
/// fail with `LeaseLost`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct LeaseToken(pub i64);

impl std::fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Who made a transition, as recorded in history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Actor {
    /// The application's executor.
    Worker,
    /// The recovery sweeper.
    Sweeper,
    /// A person, through the CLI's `resolve`.
    Operator,
    /// Retention housekeeping.
    Purge,
}

impl Actor {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Actor::Worker => "worker",
            Actor::Sweeper => "sweeper",
            Actor::Operator => "operator",
            Actor::Purge => "purge",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "worker" => Actor::Worker,
            "sweeper" => Actor::Sweeper,
            "operator" => Actor::Operator,
            "purge" => Actor::Purge,
            _ => return None,
        })
    }
}

/// What a key stands for. A key's row records it in its provider column, with a reserved
/// provider name for the two kinds idemflow itself runs ([`KeyKind::marker`]); every other
/// provider name (or none) is a [`KeyKind::Call`].
///
/// ```
/// use idemflow::record::KeyKind;
/// assert_eq!(KeyKind::of(Some("idemflow.workflow")), KeyKind::Workflow);
/// assert_eq!(KeyKind::of(Some("stripe")), KeyKind::Call);
/// assert_eq!(KeyKind::of(None), KeyKind::Call);
/// assert_eq!(KeyKind::of(KeyKind::AtomicStep.marker()), KeyKind::AtomicStep);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyKind {
    /// An operation calling a provider (or no provider): settled from the provider's records.
    Call,
    /// A workflow (`IdempotentRequest::workflow`): it acts only through its steps, each a key of
    /// its own, and is settled once they are (`docs/workflows.md`).
    Workflow,
    /// A key whose effect is the application's own writes, claimed and finished with them in
    /// one commit (`Idempotency::execute_atomic`, `Context::atomic_step`): it is never seen
    /// `processing`. A row of this kind left `processing` by an earlier version (which claimed
    /// atomic steps in a transaction of their own) surely did nothing once its lease ran out.
    AtomicStep,
}

/// The provider name of a workflow's key ([`KeyKind::Workflow`]).
pub(crate) const WORKFLOW_MARKER: &str = "idemflow.workflow";
/// The provider name of an atomic phase's step ([`KeyKind::AtomicStep`]).
pub(crate) const ATOMIC_STEP_MARKER: &str = "idemflow.local";

impl KeyKind {
    /// The provider name a key of this kind records: `idemflow.workflow`, `idemflow.local`, and
    /// `None` for a call (whose provider is the application's choice).
    pub const fn marker(self) -> Option<&'static str> {
        match self {
            KeyKind::Call => None,
            KeyKind::Workflow => Some(WORKFLOW_MARKER),
            KeyKind::AtomicStep => Some(ATOMIC_STEP_MARKER),
        }
    }

    /// The kind of a key that records `provider`.
    pub fn of(provider: Option<&str>) -> KeyKind {
        [KeyKind::Workflow, KeyKind::AtomicStep]
            .into_iter()
            .find(|kind| kind.marker().is_some() && kind.marker() == provider)
            .unwrap_or(KeyKind::Call)
    }
}

/// One key row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KeyRecord {
    /// The scope.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
    /// The operation name given at claim.
    pub operation: String,
    /// The provider the operation calls, if any (used by the sweeper).
    pub provider: Option<String>,
    /// The key forwarded to the provider: the same on every attempt, by every process.
    pub provider_key: String,
    /// The current state.
    pub state: KeyState,
    /// The request fingerprint.
    #[serde(serialize_with = "ser_fp")]
    pub fingerprint: Fingerprint,
    /// The canonical request JSON, when stored.
    pub request: Option<String>,
    /// The stored response, when finished with one.
    pub response: Option<StoredResponse>,
    /// An error description (why it failed, or why the outcome is unknown).
    pub error: Option<String>,
    /// The current fencing token.
    pub lease_token: LeaseToken,
    /// Who holds the lease.
    pub lease_owner: Option<String>,
    /// When the lease ends (database clock); `None` once finished.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// How many claims and takeovers the key has seen.
    pub attempts: i32,
    /// First claim (database clock).
    pub created_at: DateTime<Utc>,
    /// The latest time (database clock) at which an attempt may have reached the provider: set
    /// by every claim, reclaim and takeover, by a release with an unknown outcome and by
    /// [`Store::mark_attempt`](crate::Store::mark_attempt); a sweeper takeover of an expired
    /// lease moves it to that lease's end. Lookups judge the provider's search lag from it.
    pub last_attempt_at: DateTime<Utc>,
    /// Whether some earlier attempt may have reached the provider without its outcome being
    /// recorded. Once set, only [`state::may_become_retryable`](crate::state::may_become_retryable)
    /// with authoritative evidence lets the key become `failed{retryable}` (which clears it).
    pub may_have_acted: bool,
    /// Last write (database clock).
    pub updated_at: DateTime<Utc>,
    /// When a finished key may be purged (database clock).
    pub expires_at: Option<DateTime<Utc>>,
    /// When the sweeper should look at the key again.
    pub next_check_at: Option<DateTime<Utc>>,
    /// How long a finished key is kept, in milliseconds.
    pub retention_ms: i64,
}

impl KeyRecord {
    /// What the key stands for, from the provider its row records.
    pub fn kind(&self) -> KeyKind {
        KeyKind::of(self.provider.as_deref())
    }
}

fn ser_fp<S: serde::Serializer>(fp: &Fingerprint, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(fp.as_str())
}

/// One history row: a transition of one key.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KeyEvent {
    /// Order of the events of one key.
    pub seq: i64,
    /// The state before (`None`: the key was created).
    pub from: Option<KeyState>,
    /// The state after (`None`: the row was purged).
    pub to: Option<KeyState>,
    /// The fencing token after the transition.
    pub lease_token: Option<LeaseToken>,
    /// Who did it.
    pub actor: Actor,
    /// Why.
    pub reason: Option<String>,
    /// When (database clock).
    pub at: DateTime<Utc>,
}
