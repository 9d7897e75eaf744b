//! Atomic phases on SQLite: a key's claim, the application's writes and the key's answer in one
//! transaction (`idemflow::store::phase::AtomicPhase`, `docs/one-commit.md`).
//!
//! The phase is a guarded job of the group-committing writer (`writer.rs`, "Phase jobs"): it
//! runs on the writer's connection inside a transaction of the writer's (alone or in a batch),
//! within a savepoint of its own, so a failure of the writes undoes only this phase (its claim
//! included); its caller is answered once the transaction has committed. If the batch is
//! rolled back for another job's error, the writer runs the phase again, so its writes closure
//! is `Fn` (each run starts from nothing written). A panic, a hang past the store's phase
//! timeout, a statement that ends the transaction, or a write through the same store from
//! inside the phase fails this key only ([`PhaseError::Writes`], rolled back); the writer and
//! every other key go on.

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::SqliteConnection;

use super::writer::{BoxFut, JobAborted, job};
use super::{SqliteStore, claim_on, db, sql};
use crate::record::{KeyRecord, LeaseToken};
use crate::store::kit::FinishMode;
use crate::store::phase::{
    AtomicPhase, ONE_COMMIT_REASON, OneCommit, PhaseError, Prepare, REFUSED_REASON, StoreId,
    WritesError, WritesFuture, own_claim_gone, refusal, step_record,
};
use crate::store::{ClaimOutcome, NewClaim, sql_core};
use crate::{KeyId, StoredResponse};

/// What one run of the phase inside the writer came to.
enum Ran {
    Committed(StoredResponse),
    /// The writes refused ([`crate::store::phase::Refusal`]): undone, their answer kept.
    Refusal(StoredResponse),
    /// The key stood in the way: nothing ran.
    Existing(Box<KeyRecord>, chrono::DateTime<chrono::Utc>),
    /// The record found the key not held under the phase's own claim (it cannot be).
    Fenced,
    WritesFailed(WritesError),
    /// The answer was refused before the record (too large): rolled back.
    TooLarge(PhaseError),
}

type Writes = Arc<dyn for<'c> Fn(&'c mut SqliteConnection) -> WritesFuture<'c> + Send + Sync>;

impl SqliteStore {
    /// An atomic phase for [`Idempotency::execute_atomic`](crate::Idempotency::execute_atomic)
    /// or [`Context::atomic_step`](crate::Context::atomic_step) on the database of this store
    /// (a file database, or the store's own in-memory one): `writes` runs on the writer's
    /// connection inside the transaction that claims the key, and returns the key's answer;
    /// the key's claim and answer commit with them, or none does. `writes` may run more than
    /// once (see the module docs), each time from nothing written.
    pub fn atomic_phase<F>(&self, writes: F) -> impl AtomicPhase + 'static + use<F>
    where
        F: for<'c> Fn(&'c mut SqliteConnection) -> WritesFuture<'c> + Send + Sync + 'static,
    {
        SqlitePhase {
            store: self.clone(),
            writes: Arc::new(writes),
        }
    }
}

struct SqlitePhase {
    store: SqliteStore,
    writes: Writes,
}

#[async_trait]
impl AtomicPhase for SqlitePhase {
    fn store_id(&self) -> StoreId {
        self.store.store_id()
    }

    async fn claim_and_commit(
        self: Box<Self>,
        claim: &NewClaim,
        prepare: Prepare,
    ) -> Result<OneCommit, PhaseError> {
        let claim_id = claim.id.clone();
        let claim = Arc::new(claim.clone());
        let ran = self
            .run_guarded(prepare, move |conn, writes, prepare| {
                let claim = claim.clone();
                Box::pin(async move {
                    let mut lease = match claim_on(&mut *conn, &claim).await? {
                        ClaimOutcome::Claimed(lease) => lease,
                        ClaimOutcome::Existing { record, now } => {
                            return Ok(Ran::Existing(record, now));
                        }
                    };
                    let (answer, reason, refused) = match writes(&mut *conn).await {
                        Ok(a) => (a, ONE_COMMIT_REASON, false),
                        Err(e) => match refusal(&e) {
                            Some(a) => {
                                // Undo the writes and the claim (no savepoint of their own: two
                                // statements fewer on every key), then claim again; nothing
                                // else writes in between (this job holds the writer).
                                savepoint(conn, "ROLLBACK TO idemflow_phase").await?;
                                lease = match claim_on(&mut *conn, &claim).await? {
                                    ClaimOutcome::Claimed(lease) => lease,
                                    ClaimOutcome::Existing { record, now } => {
                                        return Ok(Ran::Existing(record, now));
                                    }
                                };
                                (a, REFUSED_REASON, true)
                            }
                            None => return Ok(Ran::WritesFailed(e)),
                        },
                    };
                    let answer = match prepare(answer) {
                        Ok(a) => a,
                        Err(e) => return Ok(Ran::TooLarge(e)),
                    };
                    record(conn, &claim.id, lease.token, answer, reason, refused).await
                })
            })
            .await?;
        match ran {
            Ran::Committed(answer) => Ok(OneCommit::Committed(answer)),
            Ran::Refusal(answer) => Ok(OneCommit::Refused(answer)),
            Ran::Existing(record, now) => Ok(OneCommit::Existing { record, now }),
            Ran::Fenced => Err(own_claim_gone(super::BACKEND, &claim_id)),
            Ran::WritesFailed(e) => Err(PhaseError::Writes(e)),
            Ran::TooLarge(e) => Err(e),
        }
    }
}

/// The statements of one run of a phase inside its savepoint, given the connection, the
/// application's writes and the answer's checks.
type PhaseRun = Arc<
    dyn for<'c> Fn(
            &'c mut SqliteConnection,
            &'c Writes,
            &'c Prepare,
        ) -> BoxFut<'c, Result<Ran, crate::StoreError>>
        + Send
        + Sync,
>;

impl SqlitePhase {
    /// Runs `run` as a guarded phase job of the writer (module docs) inside a savepoint of its
    /// own: kept when it comes to [`Ran::Committed`], [`Ran::Refusal`] or [`Ran::Existing`],
    /// undone otherwise.
    async fn run_guarded<R>(self: Box<Self>, prepare: Prepare, run: R) -> Result<Ran, PhaseError>
    where
        R: for<'c> Fn(
                &'c mut SqliteConnection,
                &'c Writes,
                &'c Prepare,
            ) -> BoxFut<'c, Result<Ran, crate::StoreError>>
            + Send
            + Sync
            + 'static,
    {
        let SqlitePhase { store, writes } = *self;
        let run: PhaseRun = Arc::new(run);
        let ran = store
            .writer
            .call_phase(job(move |conn: &mut SqliteConnection| -> BoxFut<'_, _> {
                let (writes, prepare, run) = (writes.clone(), prepare.clone(), run.clone());
                Box::pin(async move {
                    savepoint(conn, "SAVEPOINT idemflow_phase").await?;
                    match run(conn, &writes, &prepare).await {
                        Ok(ran @ (Ran::Committed(_) | Ran::Refusal(_) | Ran::Existing(..))) => {
                            savepoint(conn, "RELEASE idemflow_phase").await?;
                            Ok(ran)
                        }
                        Ok(other) => {
                            undo(conn).await?;
                            Ok(other)
                        }
                        Err(e) => {
                            // Nothing of the phase may stay in the batch's transaction.
                            undo(conn).await?;
                            Err(e)
                        }
                    }
                })
            }))
            .await;
        match ran {
            Ok(ran) => Ok(ran),
            // The writer rolled the phase back (a panic, a timeout, its transaction ended):
            // nothing of it was written.
            Err(e) if JobAborted::of(&e).is_some() => Err(PhaseError::Writes(Box::new(e))),
            Err(e) => Err(PhaseError::Store(e)),
        }
    }
}

/// Runs one savepoint statement.
async fn savepoint(
    conn: &mut SqliteConnection,
    sql: &'static str,
) -> Result<(), crate::StoreError> {
    sqlx::query(sql).execute(&mut *conn).await.map_err(db)?;
    Ok(())
}

/// The key's record (`done` with `answer`, for `reason`), fenced by `token` of the claim made in
/// this transaction.
async fn record(
    conn: &mut SqliteConnection,
    id: &KeyId,
    token: LeaseToken,
    answer: StoredResponse,
    reason: &'static str,
    refused: bool,
) -> Result<Ran, crate::StoreError> {
    let finish = step_record(&answer, reason);
    let row = sql_core::bind_finish(
        sqlx::query(sql::FINISH),
        id,
        FinishMode::Holder(token),
        &finish,
    )
    .fetch_optional(&mut *conn)
    .await
    .map_err(db)?;
    Ok(match (row, refused) {
        (None, _) => Ran::Fenced,
        (Some(_), false) => Ran::Committed(answer),
        (Some(_), true) => Ran::Refusal(answer),
    })
}

/// Undoes the phase's writes and leaves its savepoint. When that fails, the savepoint is gone
/// (a statement ended the transaction): the writer must roll the batch back, so the error is
/// one that says so.
async fn undo(conn: &mut SqliteConnection) -> Result<(), crate::StoreError> {
    let undone = async {
        sqlx::query("ROLLBACK TO idemflow_phase")
            .execute(&mut *conn)
            .await?;
        sqlx::query("RELEASE idemflow_phase")
            .execute(&mut *conn)
            .await
    }
    .await;
    undone
        .map(|_| ())
        .map_err(|_| crate::StoreError::database(super::BACKEND, JobAborted::TransactionEnded))
}
