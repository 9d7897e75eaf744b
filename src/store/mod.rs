#![cfg_attr(
    all(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis"
    ),
    doc = include_str!("../../docs/backends.md")
)]
#![cfg_attr(
    not(all(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis"
    )),
    doc = "The [`Store`] trait, the types its methods exchange, and one module per backend, each \
           behind a cargo feature. Its guide, `docs/backends.md`, is rendered here when the \
           features `sqlite`, `postgres`, `mysql` and `redis` are on, as on docs.rs."
)]

use std::fmt::Debug;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::error::StoreError;
use crate::record::{Actor, KeyEvent, KeyRecord, LeaseToken};
use crate::state::{KeyState, Transition};
use crate::{KeyId, StoredResponse, fingerprint::Fingerprint};

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "sqlite")]
pub mod sqlite;

mod connect;
pub mod connect_error;
pub(crate) mod ends;
pub mod kit;
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "redis"
))]
pub(crate) mod known_keys;
pub mod phase;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod pool;
mod rows;
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "redis"
))]
mod spans;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod sql_core;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod warm;
pub use connect::connect;
pub use ends::KeyEnd;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use pool::{PoolExhausted, PoolOptions};

/// A claim request: everything the key row holds from its first write.
#[derive(Debug, Clone)]
pub struct NewClaim {
    /// Scope and key.
    pub id: KeyId,
    /// The operation name.
    pub operation: String,
    /// The provider the operation calls, if any.
    pub provider: Option<String>,
    /// The key to forward to the provider. Kept as first stored on reclaim and takeover. A
    /// reclaim that changes the provider (see [`kit::claimable`]) keeps it too, when
    /// `renewed_key_base` is set and the stored key is no longer than this one (nothing may
    /// have acted on it anywhere, and no earlier row of the key sent it); with
    /// `renewed_key_base` unset (an explicit key) the row takes this one.
    pub provider_key: String,
    /// The base of the key to forward instead ([`provider_key::renewed_base`]) when the key had
    /// an earlier row, purged after its retention (its history is kept): the provider may
    /// still hold the earlier row's key and answer with the earlier effect, so a re-created
    /// row sends a key of its own, [`provider_key::renewed`]`(base, n)` where `n` is the
    /// position of the claim's own event in the key's history (1-based, across purges). A
    /// provider change whose stored key is longer than `provider_key` (a tighter limit) takes
    /// the same. Read from the store's state before the write, never drawn at random, so a
    /// claim that a failover loses is made again under the same key. `None`: always
    /// `provider_key` (an explicit key). The row stores the key it chose, and every later
    /// attempt sends that (`docs/design.md`, "Provider keys").
    ///
    /// [`provider_key::renewed_base`]: crate::provider_key::renewed_base
    /// [`provider_key::renewed`]: crate::provider_key::renewed
    pub renewed_key_base: Option<String>,
    /// The request fingerprint.
    pub fingerprint: Fingerprint,
    /// The canonical request, when it is to be stored.
    pub request: Option<String>,
    /// Who takes the lease (for operators reading history).
    pub owner: String,
    /// How long the lease lasts.
    pub lease: Duration,
    /// How long the finished key is kept.
    pub retention: Duration,
    /// When `Some(w)`, a retry with the same fingerprint may take over a processing key whose
    /// lease has expired, provided the key was created less than `w` ago (the provider's dedup
    /// window). `None`: only the sweeper takes expired keys over.
    pub takeover_window: Option<Duration>,
}

/// A lease granted by a claim or takeover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The fencing token to present on every later write.
    pub token: LeaseToken,
    /// When the lease ends (database clock).
    pub expires_at: DateTime<Utc>,
    /// Claims and takeovers so far, this one included.
    pub attempts: i32,
    /// The key forwarded to the provider (the stored one).
    pub provider_key: String,
    /// Which transition granted it: [`Transition::Claim`], [`Transition::Reclaim`] or
    /// [`Transition::Takeover`].
    pub transition: Transition,
    /// Whether an earlier attempt may have reached the provider without its outcome being
    /// recorded (the key's `may_have_acted` as this attempt starts: always `true` after a
    /// takeover). When `true`, a retryable answer to this attempt cannot make the key retryable
    /// (see [`crate::state::may_become_retryable`]).
    pub may_have_acted: bool,
    /// When the key was first claimed (database clock). A provider's dedup window counts from
    /// it, so a takeover inside [`NewClaim::takeover_window`] must send before
    /// `created_at + takeover_window`.
    pub created_at: DateTime<Utc>,
}

/// The store's answer to a claim ([`Store::claim`]): the key is the caller's now, or the row
/// that stood in the way.
#[derive(Debug, Clone)]
pub enum ClaimOutcome {
    /// The caller holds the key now.
    Claimed(Lease),
    /// The key exists and was not claimable (in flight, finished, or another request).
    Existing {
        /// The row as read. Stores may leave `request` out (`None`) on this hot path; read the
        /// key with [`Store::get`] for the whole row.
        record: Box<KeyRecord>,
        /// The database clock at the read, to judge the lease.
        now: DateTime<Utc>,
    },
}

/// A final write by the lease holder or an operator ([`Store::finish_as`]).
#[derive(Debug, Clone)]
pub struct Finish {
    /// `Done` or `Failed { .. }`.
    pub to: KeyState,
    /// The response to store and replay.
    pub response: Option<StoredResponse>,
    /// An error description.
    pub error: Option<String>,
    /// Who decides.
    pub actor: Actor,
    /// Why, for history.
    pub reason: String,
}

impl Finish {
    /// The stored response as column values: status, headers (a JSON array of pairs), body.
    pub fn response_columns(&self) -> (Option<i32>, Option<String>, Option<&[u8]>) {
        match self.response.as_ref().map(response_columns) {
            Some((status, headers, body)) => (Some(status), Some(headers), Some(body)),
            None => (None, None, None),
        }
    }
}

/// A response as the columns that store it: status, headers (a JSON array of pairs), body.
pub(crate) fn response_columns(r: &StoredResponse) -> (i32, String, &[u8]) {
    (i32::from(r.status()), r.headers_json(), r.body())
}

/// Which finish write [`Store::finish_as`] is asked for: the lease holder's, or one of an
/// operator's two overrides. A backend usually writes one statement for all three, with
/// [`holder`](Self::holder) and [`expected`](Self::expected) as its two token parameters
/// (`kit::check_finish` checks the mode against the state machine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishMode {
    /// The lease holder finishes: only while the key is processing under this token.
    Holder(LeaseToken),
    /// An operator's override from any state; it also moves the token on, fencing out any
    /// worker still running.
    Override,
    /// An operator's override that holds only while the key is still processing under this
    /// token (the lease the operator read): a compare-and-set.
    OverrideIf(LeaseToken),
}

impl FinishMode {
    /// The holder's token (the fence of a holder's write), if this is one.
    pub fn holder(self) -> Option<LeaseToken> {
        match self {
            Self::Holder(t) => Some(t),
            Self::Override | Self::OverrideIf(_) => None,
        }
    }

    /// The token a compare-and-set override expects, if this is one.
    pub fn expected(self) -> Option<LeaseToken> {
        match self {
            Self::OverrideIf(t) => Some(t),
            Self::Holder(_) | Self::Override => None,
        }
    }

    /// The token the write presented, for [`refused_write`](kit::refused_write): `None` for an
    /// unconditional override.
    pub fn presented(self) -> Option<LeaseToken> {
        self.holder().or(self.expected())
    }
}

/// Giving a lease back while the key stays processing (outcome unknown, or a deferred check).
#[derive(Debug, Clone)]
pub struct Release {
    /// Who releases.
    pub actor: Actor,
    /// Why, for history.
    pub reason: String,
    /// An error description kept on the row.
    pub error: Option<String>,
    /// The sweeper should not look again before this much time has passed (`None`: at once).
    pub recheck_after: Option<Duration>,
}

/// A batch takeover of stale keys by a sweeper.
#[derive(Debug, Clone)]
pub struct TakeStale {
    /// The sweeper's name.
    pub owner: String,
    /// The lease each taken key gets.
    pub lease: Duration,
    /// At most this many keys.
    pub limit: u32,
    /// Only keys of this scope (`None`: any). A queue consumer's in-process sweeper takes only
    /// its own scope's keys, and leaves the rest of a shared store to the sweepers that know
    /// their providers.
    pub scope: Option<String>,
}

/// Counts for `idemflow stats`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Keys in `processing`.
    pub processing: i64,
    /// Processing keys whose lease has expired (waiting for the sweeper).
    pub stale: i64,
    /// Keys in `done`.
    pub done: i64,
    /// Keys in `failed{retryable}`.
    pub failed_retryable: i64,
    /// Keys in `failed{permanent}`.
    pub failed_permanent: i64,
    /// Creation time of the oldest processing key.
    pub oldest_processing_created_at: Option<DateTime<Utc>>,
    /// The database clock when counted.
    pub now: DateTime<Utc>,
}

/// Processing keys older than an alert age (`idemflow stats --alert-age`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Stuck {
    /// How many processing keys were first claimed at least that long ago.
    pub count: i64,
    /// The oldest of them, oldest first, up to the limit asked for.
    pub oldest: Vec<KeyRecord>,
}

/// Persistence for idempotency keys: the request path. Implementations: [`sqlite::SqliteStore`]
/// (feature `sqlite`, default), and others behind their features. Used as `Arc<dyn Store>`.
///
/// The contract has three parts, one per audience: this trait (what a request needs), the
/// sweeper's [`SweeperStore`] and the operator's [`OperatorStore`]. Every store implements all
/// three, so an `Arc<dyn Store>` serves the executor, the sweeper and the CLI alike; call the
/// other parts' methods with their trait in scope. `docs/writing-a-store.md` walks through
/// writing one, [`kit`] holds the helpers the backends share, and the `conformance` feature's
/// suites certify it.
#[async_trait]
pub trait Store: SweeperStore + OperatorStore + Debug + Send + Sync + 'static {
    /// A short backend name (`"sqlite"`, `"postgres"`, ...).
    fn backend(&self) -> &'static str;

    /// The store whose atomic phases write through the same database as this store's keys
    /// (`Idempotency::execute_atomic` refuses a phase of any other). `None`: this store has no
    /// transaction to share with the application's writes (Redis).
    fn phase_store(&self) -> Option<phase::StoreId> {
        None
    }

    /// Applies idemflow's migrations, tracked in idemflow's own migrations table.
    async fn migrate(&self) -> Result<(), StoreError>;

    /// The database clock.
    async fn now(&self) -> Result<DateTime<Utc>, StoreError>;

    /// Claims a key atomically: inserts it as processing with a new lease, or reclaims a
    /// `failed{retryable}` key with the same fingerprint, or (when allowed) takes over an
    /// expired processing key with the same fingerprint; otherwise returns the row as it is.
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError>;

    /// Finishes a key, as `mode` allows ([`FinishMode`]): the lease holder's finish, only while
    /// the key is processing under its token; an operator's override from any state, which moves
    /// the token on so that any worker still running is fenced out; or an operator's
    /// compare-and-set, only while the key is still processing under the token the operator read.
    /// A refused write changes nothing: [`StoreError::LeaseLost`] (or [`StoreError::NotFound`]
    /// when the key is gone). A worker that finished before an operator's compare-and-set keeps
    /// its answer.
    ///
    /// This is the one finish a store writes; [`finish`](Store::finish) is the holder's case.
    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError>;

    /// The lease holder's finish: [`finish_as`](Store::finish_as) with
    /// [`FinishMode::Holder`]`(token)`.
    async fn finish(
        &self,
        id: &KeyId,
        token: LeaseToken,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        self.finish_as(id, FinishMode::Holder(token), finish).await
    }

    /// Gives the lease back early; the key stays processing for the sweeper. A release by a
    /// worker ([`Actor::Worker`]: the outcome of its attempt is unknown) also sets
    /// `last_attempt_at` to now and `may_have_acted`; a sweeper's release (a deferred check)
    /// leaves both as they are.
    async fn release(
        &self,
        id: &KeyId,
        token: LeaseToken,
        release: &Release,
    ) -> Result<(), StoreError>;

    /// Records that the holder of `token` is about to send (again) to the provider: sets
    /// `last_attempt_at` to now (database clock) and `may_have_acted`. Fenced like
    /// [`release`](Store::release). The sweeper calls it right before a re-drive.
    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError>;

    /// Extends the lease of a processing key held under `token`; returns the new expiry. A lease
    /// given back with [`release`](Store::release) is not renewed ([`StoreError::LeaseLost`]): a
    /// heartbeat's renewal landing after the holder's own release must not hold the key away
    /// from the sweeper for another lease.
    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError>;

    /// Reads one key.
    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError>;

    /// Asks the store to announce the end of `id`'s current attempt (its finish, failure or
    /// release, written by any process) on [`key_ends`](Store::key_ends): a duplicate calls it
    /// before it waits for that attempt's answer. `Ok(false)` when this store cannot announce
    /// (the default; the waiters then read the key on a backoff). Marking a key that is no
    /// longer processing does nothing: the waiter's next read finds its answer (`ends`).
    async fn announce_end(&self, id: &KeyId) -> Result<bool, StoreError> {
        let _ = id;
        Ok(false)
    }

    /// The ends this store announces, from every process ([`announce_end`](Store::announce_end));
    /// the first call starts the store's listener (a task: call it from within a Tokio runtime),
    /// which sends a [`KeyEnd::Gap`] each time it starts listening. `None` when this store
    /// cannot announce (the default).
    fn key_ends(&self) -> Option<tokio::sync::broadcast::Receiver<KeyEnd>> {
        None
    }
}

/// The sweeper's part of the store contract ([`Store`]): taking stale keys over and purging
/// finished ones after their retention.
#[async_trait]
pub trait SweeperStore: Send + Sync {
    /// Takes over up to `limit` processing keys whose lease has expired and whose next check is
    /// due, oldest lease first, each with a new fencing token. Concurrent callers never get the
    /// same key.
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError>;

    /// Deletes up to `batch` finished keys whose retention has expired; returns how many. Each
    /// deletion is recorded in history.
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError>;

    /// How many finished keys [`purge_expired`](SweeperStore::purge_expired) would delete now
    /// (database clock), for a dry run.
    async fn count_expired(&self) -> Result<u64, StoreError>;
}

/// The operator's part of the store contract ([`Store`]): reads for `idemflow` commands and
/// alerts (`idemflow resolve` writes through [`Store::finish_as`]).
#[async_trait]
pub trait OperatorStore: Send + Sync {
    /// The key's history, oldest first (kept after the key is purged).
    async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError>;

    /// Counts per state.
    async fn stats(&self) -> Result<Stats, StoreError>;

    /// Processing keys first claimed at least `older_than` ago (database clock): their count and
    /// the oldest `limit` of them, oldest first, for operators' alerts.
    async fn stuck(&self, older_than: Duration, limit: u32) -> Result<Stuck, StoreError>;
}

/// Checks that a claim statement spells exactly the reasons of [`Transition::CLAIM_REASONS`]:
/// every quoted literal in it is a claim reason, a state, an actor or an interval unit, and every
/// claim reason is there. The stores read the reason back to learn which transition a claim
/// made, so a reason spelled differently in SQL would be a corrupt-row error at run time.
#[cfg(all(test, any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
pub(crate) fn assert_claim_reasons(statement: &str) {
    use std::collections::BTreeSet;
    let others = [
        "processing",
        "done",
        "failed",
        "worker",
        "subsec",
        "1 millisecond",
        "1970-01-01 00:00:00",
        // Renewed provider keys: the life number's format and padding.
        "%08x",
        // History entries: SQLite's format, separators, flags, escapes.
        "%s|%s|%s|%s|%s|%s|%s|%s|%s%s",
        "",
        "|",
        "0",
        "1",
        "\\",
        "\\\\",
        "\\n",
    ];
    let literals: BTreeSet<&str> = statement.split('\'').skip(1).step_by(2).collect();
    let reasons: BTreeSet<&str> = Transition::CLAIM_REASONS.iter().map(|(_, r)| *r).collect();
    let spelled: BTreeSet<&str> = literals
        .into_iter()
        .filter(|l| !others.contains(l))
        .collect();
    assert_eq!(spelled, reasons, "claim reasons in {statement}");
}

#[cfg(all(test, any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
mod tests {
    /// Every SQL backend's claim statements (SQLite's and PostgreSQL's claim and reclaim, MariaDB's
    /// procedure) spell exactly the claim reasons.
    #[test]
    fn every_claim_statement_spells_the_claim_reasons() {
        #[cfg(feature = "sqlite")]
        super::assert_claim_reasons(
            &[super::sqlite::sql::CLAIM, super::sqlite::sql::RECLAIM].concat(),
        );
        #[cfg(feature = "postgres")]
        super::assert_claim_reasons(
            &[super::postgres::sql::CLAIM, super::postgres::sql::RECLAIM].concat(),
        );
        #[cfg(feature = "mysql")]
        {
            // The procedure from its `CREATE`: the comments above it are prose.
            let claim = super::mysql::procedures::CLAIM;
            super::assert_claim_reasons(&claim[claim.find("CREATE PROCEDURE").unwrap()..]);
        }
    }
}
