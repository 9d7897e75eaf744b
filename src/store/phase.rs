//! The contract between a SQL store and an atomic phase: the application's writes and a
//! workflow step's record committed in one database transaction (`docs/workflows.md`, "Atomic
//! phases").
//!
//! A SQL store hands out an [`AtomicPhase`] for the application's writes
//! (`SqliteStore::atomic_phase`, `PostgresStore::atomic_phase`, `MySqlStore::atomic_phase`);
//! the workflow's `Context::atomic_step` claims the step and calls [`AtomicPhase::commit`].
//! It lives on the store side so that the stores depend on nothing above them
//! (`ARCHITECTURE.md`).

use async_trait::async_trait;

use crate::error::StoreError;
use crate::record::LeaseToken;
use crate::{KeyId, StoredResponse};

/// An error from the application's writes inside an atomic phase.
pub type WritesError = Box<dyn std::error::Error + Send + Sync>;

/// The future of an atomic phase's writes, borrowing the transaction's connection.
pub type WritesFuture<'c> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<StoredResponse, WritesError>> + Send + 'c>,
>;

/// What a step's answer goes through before it is stored (the executor's header filter,
/// redaction and size cap), given to [`AtomicPhase::commit`]. An `Err` (an answer over the cap)
/// must roll the phase back and be returned as it is.
pub type Prepare =
    std::sync::Arc<dyn Fn(StoredResponse) -> Result<StoredResponse, PhaseError> + Send + Sync>;

/// Why an atomic phase did not commit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PhaseError {
    /// The application's writes failed: the transaction was rolled back, nothing was written.
    #[error("the step's writes failed and were rolled back: {0}")]
    Writes(#[source] WritesError),
    /// The step's record could not be written under this attempt's lease (it was taken over):
    /// the transaction was rolled back.
    #[error("the step was taken over before its transaction committed; rolled back")]
    LeaseLost,
    /// The store failed while beginning, recording or committing. A failed commit may or may
    /// not have committed: the step's row tells (`done` if it did).
    #[error("store: {0}")]
    Store(#[source] StoreError),
    /// The step's answer (after the header filter and redaction) is larger than the executor's
    /// `max_response_bytes`: rolled back, nothing was written.
    #[error("the step's answer of {size} bytes exceeds the cap of {limit} bytes; rolled back")]
    ResponseTooLarge {
        /// The answer's stored size.
        size: usize,
        /// The cap.
        limit: usize,
    },
}

/// The application's writes for one atomic phase, bound to a SQL store; made by the store's
/// `atomic_phase` and run by the workflow's `Context::atomic_step`.
#[async_trait]
pub trait AtomicPhase: Send {
    /// Begins a transaction, runs the writes, finishes `step` (held under `token`) `done` with
    /// the response the writes return (after `prepare`), its history row included, and
    /// commits. Returns the stored response.
    async fn commit(
        self: Box<Self>,
        step: &KeyId,
        token: LeaseToken,
        prepare: Prepare,
    ) -> Result<StoredResponse, PhaseError>;
}

/// How long a SQL store's atomic phase may run (its writes included) before it is cut off and
/// rolled back. On SQLite it is the default of `SqliteConfig::phase_timeout` (every other write
/// of the store waits while a phase runs); on PostgreSQL and MariaDB/MySQL it bounds how long a
/// hung phase holds its pooled connection and row locks.
pub const DEFAULT_PHASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs a PostgreSQL or MariaDB/MySQL phase (`BEGIN`, the writes, the record, `COMMIT`) on a task
/// of its own, so a caller that stops waiting (a client that went away) never cuts it on the
/// wire: a `BEGIN` or a statement cut off after it was sent leaves the pooled connection inside
/// a transaction the driver does not know of (its later autocommit writes then stay
/// uncommitted, holding their locks), or out of the pool. The phase runs to its end, fenced by
/// the step's token like any write, or until [`DEFAULT_PHASE_TIMEOUT`], when it is dropped and
/// rolls back. A panic in the application's writes fails the step only
/// ([`PhaseError::Writes`]); its transaction is dropped and rolls back.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn detached<Fut>(
    backend: &'static str,
    phase: Fut,
) -> Result<StoredResponse, PhaseError>
where
    Fut: std::future::Future<Output = Result<StoredResponse, PhaseError>> + Send + 'static,
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

/// The reason history gives for a step whose atomic phase committed.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) const COMMITTED_REASON: &str =
    "atomic phase: the step's writes and this record committed together";

/// The step's record of a committed phase: `done` with the phase's answer, by the worker.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn step_record(answer: &StoredResponse) -> crate::store::Finish {
    crate::store::Finish {
        to: crate::state::KeyState::Done,
        response: Some(answer.clone()),
        error: None,
        actor: crate::record::Actor::Worker,
        reason: COMMITTED_REASON.to_owned(),
    }
}

/// Writes a step's record on a phase's transaction: `true` when it was written (the step is
/// still held under the token), `false` when the step was taken over.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) type RecordStep<DB> = for<'c> fn(
    &'c mut <DB as sqlx::Database>::Connection,
    &'c KeyId,
    LeaseToken,
    &'c StoredResponse,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<bool, sqlx::Error>> + Send + 'c>,
>;

/// The atomic phase of a pooled SQL store (PostgreSQL, MariaDB/MySQL): `BEGIN` on a pooled
/// connection, the application's writes, the answer's checks, the step's record (each backend's
/// [`RecordStep`]), `COMMIT`; run [`detached`]. Any failure drops the transaction, which rolls
/// back.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct PooledPhase<DB: sqlx::Database, F> {
    pub(crate) backend: &'static str,
    pub(crate) pool: sqlx::Pool<DB>,
    pub(crate) writes: F,
    pub(crate) record: RecordStep<DB>,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[async_trait]
impl<DB, F> AtomicPhase for PooledPhase<DB, F>
where
    DB: sqlx::Database,
    F: for<'c> FnOnce(&'c mut DB::Connection) -> WritesFuture<'c> + Send + 'static,
{
    async fn commit(
        self: Box<Self>,
        step: &KeyId,
        token: LeaseToken,
        prepare: Prepare,
    ) -> Result<StoredResponse, PhaseError> {
        let PooledPhase {
            backend,
            pool,
            writes,
            record,
        } = *self;
        let step = step.clone();
        let failed = move |e: sqlx::Error| PhaseError::Store(StoreError::database(backend, e));
        detached(backend, async move {
            let mut tx = pool.begin().await.map_err(failed)?;
            let answer = prepare(writes(&mut *tx).await.map_err(PhaseError::Writes)?)?;
            if !record(&mut *tx, &step, token, &answer)
                .await
                .map_err(failed)?
            {
                return Err(PhaseError::LeaseLost);
            }
            tx.commit().await.map_err(failed)?;
            Ok(answer)
        })
        .await
    }
}

/// A phase chosen at run time (`Box<dyn AtomicPhase>`, e.g. by backend) is a phase too.
#[async_trait]
impl AtomicPhase for Box<dyn AtomicPhase> {
    async fn commit(
        self: Box<Self>,
        step: &KeyId,
        token: LeaseToken,
        prepare: Prepare,
    ) -> Result<StoredResponse, PhaseError> {
        (*self).commit(step, token, prepare).await
    }
}

/// The message of a caught panic (a phase's writes panicked), for the step's error.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}
