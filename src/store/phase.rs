#![cfg_attr(feature = "sqlite", doc = include_str!("../../docs/one-commit.md"))]
#![cfg_attr(
    not(feature = "sqlite"),
    doc = "Atomic phases: a key's claim, the application's writes and the key's answer \
           committed in one database transaction of a SQL store ([`AtomicPhase`]). Its guide, \
           `docs/one-commit.md`, is rendered here when the feature `sqlite` is on, as on \
           docs.rs."
)]

use async_trait::async_trait;

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use crate::KeyId;
use crate::StoredResponse;
use crate::error::StoreError;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::record::LeaseToken;

/// An error from the application's writes inside an atomic phase.
pub type WritesError = Box<dyn std::error::Error + Send + Sync>;

/// The future of an atomic phase's writes, borrowing the transaction's connection.
pub type WritesFuture<'c> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<StoredResponse, WritesError>> + Send + 'c>,
>;

/// What a key's answer goes through before it is stored (the executor's header filter,
/// redaction and size cap), given to [`AtomicPhase::claim_and_commit`]. An `Err` (an answer over the cap)
/// must roll the phase back and be returned as it is.
pub type Prepare =
    std::sync::Arc<dyn Fn(StoredResponse) -> Result<StoredResponse, PhaseError> + Send + Sync>;

/// Why an atomic phase did not commit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PhaseError {
    /// The application's writes failed: the transaction was rolled back, nothing was written
    /// (the key's claim neither).
    #[error("the application's writes failed and were rolled back: {0}")]
    Writes(#[source] WritesError),
    /// The store failed while beginning, claiming, recording or committing. A failed commit may
    /// or may not have committed: the key's row tells (`done` if it did, absent if not).
    #[error("store: {0}")]
    Store(#[source] StoreError),
    /// The key's answer (after the header filter and redaction) is larger than the executor's
    /// `max_response_bytes`: rolled back, nothing was written.
    #[error("the answer of {size} bytes exceeds the cap of {limit} bytes; rolled back")]
    ResponseTooLarge {
        /// The answer's stored size.
        size: usize,
        /// The cap.
        limit: usize,
    },
}

/// The answer the application's writes give to refuse, kept as the key's answer while the
/// writes are undone: return `Err(Refusal::new(answer).into())` from the writes (for example
/// when a constraint of the application's own tables, one order per cart, says no). The key is
/// finished `done` with `answer`, none of the writes is kept, and a retry with the same key
/// replays `answer`. Any other error of the writes rolls back the key's claim as well: the key
/// is not recorded and a retry runs the writes again.
#[derive(Debug, Clone)]
pub struct Refusal(pub StoredResponse);

impl Refusal {
    /// A refusal answering `answer`.
    pub fn new(answer: StoredResponse) -> Self {
        Self(answer)
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the application's writes refused with status {}",
            self.0.status()
        )
    }
}

impl std::error::Error for Refusal {}

/// Which store a phase writes through, to refuse a phase given to an executor of another store
/// (the key would then be claimed in a database the executor never reads). Each store and its
/// clones share one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreId(pub(crate) usize);

/// What [`AtomicPhase::claim_and_commit`] came to: the key's claim, the application's writes
/// and the key's answer in one commit, or the row that stood in the way.
#[derive(Debug)]
#[non_exhaustive]
pub enum OneCommit {
    /// The writes, the claim and the answer committed together.
    Committed(StoredResponse),
    /// The writes refused ([`Refusal`]): they were undone, and the claim and this answer
    /// committed.
    Refused(StoredResponse),
    /// The key was there and not claimable: nothing ran, nothing was written.
    Existing {
        /// The row as read.
        record: Box<crate::record::KeyRecord>,
        /// The database clock at the read.
        now: chrono::DateTime<chrono::Utc>,
    },
}

/// The reason history gives for a key claimed and finished in one commit.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) const ONE_COMMIT_REASON: &str =
    "one commit: the claim, the application's writes and this answer committed together";

/// The reason history gives for a key whose writes refused in one commit.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) const REFUSED_REASON: &str =
    "one commit: the application's writes refused and were undone; their answer is kept";

/// The error of writes that refused, when they did.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) fn refusal(e: &WritesError) -> Option<StoredResponse> {
    e.downcast_ref::<Refusal>().map(|r| r.0.clone())
}

/// The application's writes for one atomic phase, bound to a SQL store: made by the store's
/// `atomic_phase`, run by `Idempotency::execute_atomic` for a request's key and by the
/// workflow's `Context::atomic_step` for a step's key.
#[async_trait]
pub trait AtomicPhase: Send {
    /// The store the phase writes through.
    fn store_id(&self) -> StoreId;

    /// Begins a transaction, claims the key of `claim`, and when it is the caller's, runs the
    /// writes and finishes the key `done` with their answer (after `prepare`), then commits:
    /// one commit for all of it, so nobody ever sees the key `processing`. When the key stands
    /// in the way, nothing runs ([`OneCommit::Existing`]). A failure of the writes rolls
    /// everything back, the claim included ([`PhaseError::Writes`]); a [`Refusal`] keeps the
    /// claim and its answer only.
    async fn claim_and_commit(
        self: Box<Self>,
        claim: &crate::store::NewClaim,
        prepare: Prepare,
    ) -> Result<OneCommit, PhaseError>;
}

/// How long a SQL store's atomic phase may run (its writes included) before it is cut off and
/// rolled back. On SQLite it is the default of `SqliteConfig::phase_timeout` (every other write
/// of the store waits while a phase runs); on PostgreSQL and MariaDB/MySQL it bounds how long a
/// hung phase holds its pooled connection and row locks.
pub const DEFAULT_PHASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs a PostgreSQL or MariaDB/MySQL phase (`BEGIN`, the claim, the writes, the record, `COMMIT`) on a task
/// of its own, so a caller that stops waiting (a client that went away) never cuts it on the
/// wire: a `BEGIN` or a statement cut off after it was sent leaves the pooled connection inside
/// a transaction the driver does not know of (its later autocommit writes then stay
/// uncommitted, holding their locks), or out of the pool. The phase runs to its end or until
/// [`DEFAULT_PHASE_TIMEOUT`], when it is dropped and rolls back, its claim with it. A panic in the
/// application's writes fails this key only ([`PhaseError::Writes`]); its transaction is dropped
/// and rolls back.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn detached<T, Fut>(backend: &'static str, phase: Fut) -> Result<T, PhaseError>
where
    T: Send + 'static,
    Fut: std::future::Future<Output = Result<T, PhaseError>> + Send + 'static,
{
    use tracing::Instrument;
    let bounded = async move {
        match tokio::time::timeout(DEFAULT_PHASE_TIMEOUT, phase).await {
            Ok(r) => r,
            Err(_) => Err(PhaseError::Writes(
                format!(
                    "the atomic phase ran longer than {DEFAULT_PHASE_TIMEOUT:?} and was rolled back"
                )
                .into(),
            )),
        }
    };
    match tokio::spawn(bounded.in_current_span()).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => {
            let message = panic_message(&*e.into_panic());
            Err(PhaseError::Writes(
                format!("the atomic phase panicked and was rolled back: {message}").into(),
            ))
        }
        Err(e) => Err(PhaseError::Store(StoreError::database(
            backend,
            format!("the atomic phase's task ended: {e}"),
        ))),
    }
}

/// The key's record of a committed phase: `done` with the phase's answer, by the worker, for
/// `reason` ([`ONE_COMMIT_REASON`] or [`REFUSED_REASON`]).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn step_record(answer: &StoredResponse, reason: &str) -> crate::store::Finish {
    crate::store::Finish {
        to: crate::state::KeyState::Done,
        response: Some(answer.clone()),
        error: None,
        actor: crate::record::Actor::Worker,
        reason: reason.to_owned(),
    }
}

/// Writes a key's record on a phase's transaction (`done` with the answer, for the reason):
/// `true` when it was written, `false` when the row is not held under the token (it cannot be
/// otherwise inside the transaction that claimed it: [`own_claim_gone`]).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) type RecordStep<DB> = for<'c> fn(
    &'c mut <DB as sqlx::Database>::Connection,
    &'c KeyId,
    LeaseToken,
    &'c StoredResponse,
    &'static str,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<bool, sqlx::Error>> + Send + 'c>,
>;

/// Claims a key on a phase's transaction (each backend's claim, run on one connection).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) type ClaimOn<DB> = for<'c> fn(
    &'c mut <DB as sqlx::Database>::Connection,
    &'c crate::store::NewClaim,
) -> std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<crate::store::ClaimOutcome, StoreError>>
            + Send
            + 'c,
    >,
>;

/// How a pooled SQL store takes part in a phase: its claim and its record, run on the phase's
/// transaction.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct PooledOps<DB: sqlx::Database> {
    pub(crate) backend: &'static str,
    pub(crate) id: StoreId,
    /// The statements that begin a phase's transaction, in one round trip: `BEGIN` with what
    /// bounds each statement of the phase on the server to [`DEFAULT_PHASE_TIMEOUT`] (a phase
    /// cut off by its timeout is dropped, but a statement it sent would run on at the server,
    /// holding its locks); on MariaDB/MySQL also `READ COMMITTED`, so the claim's read after a
    /// concurrent claim commits sees that claim's row.
    pub(crate) begin: &'static str,
    pub(crate) claim: ClaimOn<DB>,
    pub(crate) record: RecordStep<DB>,
    /// Whether a claim's error rolled its transaction back whole and may be tried again in a
    /// new one (a lock conflict; nothing else had run in it).
    pub(crate) claim_again: fn(&StoreError) -> bool,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> Clone for PooledOps<DB> {
    fn clone(&self) -> Self {
        *self
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> Copy for PooledOps<DB> {}

/// The atomic phase of a pooled SQL store (PostgreSQL, MariaDB/MySQL): `BEGIN` on a pinged
/// connection (the store's kept one, or one from its pool: `store::warm`), the key's claim, the
/// application's writes, the answer's checks, the key's record (each backend's [`RecordStep`]),
/// `COMMIT`; run [`detached`]. Any failure drops the transaction, which rolls back; after a
/// commit the connection is kept for the store's next call where the store keeps its writes'
/// connections ([`WarmConn::keep_write`](crate::store::warm::WarmConn::keep_write)).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct PooledPhase<DB: sqlx::Database, F> {
    pub(crate) warm: crate::store::warm::Warm<DB>,
    pub(crate) writes: F,
    pub(crate) ops: PooledOps<DB>,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[async_trait]
impl<DB, F> AtomicPhase for PooledPhase<DB, F>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    F: for<'c> FnOnce(&'c mut DB::Connection) -> WritesFuture<'c> + Send + 'static,
{
    fn store_id(&self) -> StoreId {
        self.ops.id
    }

    async fn claim_and_commit(
        self: Box<Self>,
        claim: &crate::store::NewClaim,
        prepare: Prepare,
    ) -> Result<OneCommit, PhaseError> {
        use crate::store::ClaimOutcome;
        let PooledPhase { warm, writes, ops } = *self;
        let claim = claim.clone();
        let backend = ops.backend;
        let failed = move |e: sqlx::Error| PhaseError::Store(StoreError::database(backend, e));
        detached(backend, async move {
            let mut writes = Some(writes);
            // Set when the writes refused: their transaction was rolled back whole, and the
            // next one commits the claim with the refusal's answer only.
            let mut refused: Option<StoredResponse> = None;
            for attempt in 1..=4 {
                let mut conn = warm.for_write().await.map_err(failed)?;
                // A dropped transaction rolls back (also on every early return below).
                let mut tx = sqlx::Connection::begin_with(&mut *conn, ops.begin)
                    .await
                    .map_err(failed)?;
                let lease = match (ops.claim)(&mut *tx, &claim).await {
                    Ok(ClaimOutcome::Claimed(lease)) => lease,
                    // Nothing ran, nothing was written.
                    Ok(ClaimOutcome::Existing { record, now }) => {
                        return Ok(OneCommit::Existing { record, now });
                    }
                    Err(e) if attempt < 3 && (ops.claim_again)(&e) => continue,
                    Err(e) => return Err(PhaseError::Store(e)),
                };
                let (answer, reason) = match (refused.take(), writes.take()) {
                    (Some(answer), _) => (answer, REFUSED_REASON),
                    (None, Some(writes)) => match writes(&mut *tx).await {
                        Ok(answer) => (prepare(answer)?, ONE_COMMIT_REASON),
                        Err(e) => match refusal(&e) {
                            Some(answer) => {
                                // No savepoint (on PostgreSQL each costs a transaction id):
                                // undo everything, then claim again with the answer alone.
                                refused = Some(prepare(answer)?);
                                tx.rollback().await.map_err(failed)?;
                                continue;
                            }
                            None => return Err(PhaseError::Writes(e)),
                        },
                    },
                    (None, None) => break,
                };
                if !(ops.record)(&mut *tx, &claim.id, lease.token, &answer, reason)
                    .await
                    .map_err(failed)?
                {
                    return Err(own_claim_gone(backend, &claim.id));
                }
                tx.commit().await.map_err(failed)?;
                // Kept for the store's next call where the store keeps its writes' connections.
                conn.keep_write();
                return Ok(if reason == REFUSED_REASON {
                    OneCommit::Refused(answer)
                } else {
                    OneCommit::Committed(answer)
                });
            }
            Err(PhaseError::Store(StoreError::Corrupt {
                backend,
                detail: format!(
                    "the one-commit claim of {} ended without an answer",
                    claim.id
                ),
            }))
        })
        .await
    }
}

/// A phase chosen at run time (`Box<dyn AtomicPhase>`, e.g. by backend) is a phase too.
#[async_trait]
impl AtomicPhase for Box<dyn AtomicPhase> {
    fn store_id(&self) -> StoreId {
        (**self).store_id()
    }

    async fn claim_and_commit(
        self: Box<Self>,
        claim: &crate::store::NewClaim,
        prepare: Prepare,
    ) -> Result<OneCommit, PhaseError> {
        (*self).claim_and_commit(claim, prepare).await
    }
}

/// The error of a key's record that found the claim made in its own transaction gone (it cannot
/// be: nothing else sees the uncommitted claim): the transaction is rolled back.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn own_claim_gone(backend: &'static str, id: &KeyId) -> PhaseError {
    PhaseError::Store(StoreError::Corrupt {
        backend,
        detail: own_claim_gone_detail(id),
    })
}

/// What `own_claim_gone` says (on SQLite, where the record also ends the phase's savepoint, the
/// detail of a database error that rolls the writer's batch back).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) fn own_claim_gone_detail(id: &KeyId) -> String {
    format!("the one-commit record of {id} found its own claim gone")
}

/// The message of a caught panic (a phase's writes panicked, a webhook handler panicked), for
/// the error that reports it.
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "axum"
))]
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}
