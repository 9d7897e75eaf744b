//! One commit for local work: [`Idempotency::execute_atomic`] (a request's key) and
//! `Context::atomic_step` (a workflow step's key) claim the key, run the application's writes and
//! store their answer in one database transaction (`docs/one-commit.md`).

use super::{Idempotency, IdempotentRequest, key_span, measured};
use crate::error::{Error, RequestError};
use crate::executor::Execution;
use crate::store::phase::{AtomicPhase, OneCommit, PhaseError, Prepare};

impl Idempotency {
    /// Runs `phase`'s writes (the application's own rows, through the SQL store's
    /// `atomic_phase`) at most once for the request's key, **in the same transaction as the
    /// key's claim and its stored answer**: a new key costs one commit, and a crash anywhere
    /// before it leaves neither the key nor the rows.
    ///
    /// - The key is new (or `failed{retryable}`): the writes run and their answer is stored;
    ///   [`Execution::Executed`].
    /// - The key is done: its answer is replayed, the writes do not run;
    ///   [`Execution::Replayed`]. A concurrent duplicate waits on the key's unique constraint
    ///   until the first transaction ends, then replays its answer (or runs, if it rolled back).
    /// - The writes return an error: everything is rolled back, the claim included;
    ///   [`Error::RolledBack`], and a retry runs them again.
    /// - The writes refuse with [`Refusal`](crate::store::phase::Refusal) (say a constraint of
    ///   the application's own tables said no): their rows are undone, the refusal's answer is
    ///   stored as the key's and returned as [`Execution::Executed`].
    ///
    /// For local effects only: a provider call in the middle of a transaction could act and
    /// then be rolled back. Call providers after the commit through an outbox row written by
    /// the phase, or use [`execute`](Self::execute). A request that names a provider, a workflow
    /// request, a store without transactions to share (Redis) and a phase of another store than
    /// this executor's are refused with [`Error::NoSharedTransaction`], before anything runs.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use idemflow::store::sqlite::SqliteStore;
    /// use idemflow::{Idempotency, IdempotentRequest, Store, StoredResponse};
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, cart TEXT UNIQUE)")
    ///     .execute(store.writer_pool()).await?;
    /// let idem = Idempotency::new(Arc::new(store.clone()));
    /// let body = serde_json::json!({"cart": "c-1"});
    /// for _ in 0..2 {
    ///     let request = IdempotentRequest::new("shop", "key-1", "create_order", &body)?;
    ///     let done = idem.execute_atomic(request, store.atomic_phase(|conn| Box::pin(async move {
    ///         sqlx::query("INSERT INTO orders (id, cart) VALUES ('o-1', 'c-1')")
    ///             .execute(&mut *conn).await?;
    ///         Ok(StoredResponse::json(201, &serde_json::json!({"order": "o-1"}))?)
    ///     }))).await?;
    ///     assert_eq!(done.response().status(), 201);
    /// }
    /// let (orders,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM orders")
    ///     .fetch_one(store.writer_pool()).await?;
    /// assert_eq!(orders, 1); // the second call replayed
    /// # Ok(()) }
    /// ```
    pub async fn execute_atomic(
        &self,
        request: IdempotentRequest,
        phase: impl AtomicPhase + 'static,
    ) -> Result<Execution, Error> {
        let span = key_span!(
            "idemflow.execute_atomic",
            request.id,
            operation = request.operation
        );
        let operation = request.operation.clone();
        measured(&operation, span, self.one_commit(request, Box::new(phase))).await
    }

    async fn one_commit(
        &self,
        request: IdempotentRequest,
        phase: Box<dyn AtomicPhase>,
    ) -> Result<Execution, Error> {
        let refuse = |reason| {
            Err(Error::NoSharedTransaction {
                key: request.id.clone(),
                reason,
            })
        };
        if request.provider.is_some() {
            return refuse(
                "the request names a provider; a provider is called after the commit (an \
                 outbox) or through execute",
            );
        }
        if request.is_workflow() || request.step.is_some() {
            return refuse("a workflow runs its local writes with Context::atomic_step");
        }
        self.commit_once(request, phase).await
    }

    /// Claims `request`'s key, runs `phase`'s writes and stores their answer in one commit
    /// (`execute_atomic`, and `Context::atomic_step` for a step's key), or answers from the key
    /// that stood in the way. Records the outcome on the current span's `outcome` field.
    pub(crate) async fn commit_once(
        &self,
        request: IdempotentRequest,
        phase: Box<dyn AtomicPhase>,
    ) -> Result<Execution, Error> {
        let cfg = self.config();
        if request.canonical.len() > cfg.max_request_bytes {
            return Err(RequestError::RequestTooLarge {
                size: request.canonical.len(),
                limit: cfg.max_request_bytes,
            }
            .into());
        }
        let refuse = |reason| {
            Err(Error::NoSharedTransaction {
                key: request.id.clone(),
                reason,
            })
        };
        match self.store().phase_store() {
            None => {
                return refuse(
                    "the executor's store has no transaction to share with the application's \
                     writes (Redis); use a SQL store, or execute with an outbox",
                );
            }
            Some(id) if id != phase.store_id() => {
                return refuse(
                    "the phase was made by another store than the executor's; the key would \
                     be claimed where this executor never reads",
                );
            }
            Some(_) => {}
        }
        let request = request.provider(crate::record::ATOMIC_STEP_MARKER);
        let mut claim = self.new_claim(&request);
        // The key is never seen `processing` by anyone else: it commits finished or not at all.
        claim.takeover_window = None;
        let prep_cfg = self.shared_config().clone();
        let prepare: Prepare = std::sync::Arc::new(move |resp| {
            prep_cfg
                .prepare_answer(resp)
                .map_err(|(size, limit)| PhaseError::ResponseTooLarge { size, limit })
        });
        let id = request.id.clone();
        let outcome = |o: &'static str| {
            tracing::Span::current().record("outcome", o);
        };
        match phase.claim_and_commit(&claim, prepare).await {
            Ok(OneCommit::Committed(answer)) => {
                outcome("committed");
                Ok(Execution::Executed(answer))
            }
            Ok(OneCommit::Refused(answer)) => {
                outcome("refused");
                Ok(Execution::Executed(answer))
            }
            Ok(OneCommit::Existing { record, now }) => self.existing(&request, *record, now),
            Err(PhaseError::Writes(source)) => {
                outcome("rolled_back");
                Err(Error::RolledBack { key: id, source })
            }
            Err(PhaseError::ResponseTooLarge { size, limit }) => {
                outcome("response_too_large");
                Err(Error::ResponseTooLarge { size, limit })
            }
            Err(PhaseError::Store(e)) => Err(Error::Store(e)),
        }
    }
}
