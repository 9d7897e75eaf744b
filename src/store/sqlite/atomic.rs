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

use std::sync::{Arc, LazyLock};

use async_trait::async_trait;
use sqlx::SqliteConnection;

use super::writer::{Ahead, BoxFut, JobAborted, Turn, phase_job};
use super::{SqliteStore, claim_on, db, decode_with_now, sql};
use crate::record::{KeyRecord, LeaseToken};
use crate::store::FinishMode;
use crate::store::kit::{claimable, millis};
use crate::store::phase::{
    AtomicPhase, ONE_COMMIT_REASON, OneCommit, PhaseError, Prepare, REFUSED_REASON, StoreId,
    WritesError, WritesFuture, own_claim_gone_detail, refusal, step_record,
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
    /// The record found the key not held under the phase's own claim (it cannot be: this job
    /// holds the writer since the claim), and released the savepoint all the same.
    Fenced,
    WritesFailed(WritesError),
    /// The answer was refused before the record (too large): rolled back.
    TooLarge(PhaseError),
}

type Writes = Arc<dyn for<'c> Fn(&'c mut SqliteConnection) -> WritesFuture<'c> + Send + Sync>;

/// The phase's savepoint and the read of its key's row, sent together: one trip to the
/// connection's thread (sqlx runs every statement of a query string, binding the arguments to
/// each).
static SAVEPOINT_AND_READ: LazyLock<String> =
    LazyLock::new(|| format!("SAVEPOINT idemflow_phase;\n{}", sql::CLAIM_READ));

/// [`SAVEPOINT_AND_READ`] after the batch's `BEGIN IMMEDIATE`, for a phase first in its batch
/// (`writer.rs`, "Trips").
static BEGIN_SAVEPOINT_AND_READ: LazyLock<String> =
    LazyLock::new(|| format!("BEGIN IMMEDIATE;\n{}", *SAVEPOINT_AND_READ));

/// A new key's row, written `done`, and the savepoint's release, sent together (as
/// [`SAVEPOINT_AND_READ`]).
static CLAIM_DONE_AND_RELEASE: LazyLock<String> =
    LazyLock::new(|| format!("{};\nRELEASE idemflow_phase", sql::CLAIM_DONE));

/// [`CLAIM_DONE_AND_RELEASE`], then the next phase's savepoint and read ([`sql::CLAIM_READ_NEXT`]),
/// for a phase with a phase after it in its batch (`writer.rs`, "Trips").
static CLAIM_DONE_RELEASE_AND_NEXT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{};\nSAVEPOINT idemflow_phase;\n{}",
        *CLAIM_DONE_AND_RELEASE,
        sql::CLAIM_READ_NEXT
    )
});

/// [`CLAIM_DONE_AND_RELEASE`] and the batch's `COMMIT`, for a phase last in its batch
/// (`writer.rs`, "Trips").
static CLAIM_DONE_RELEASE_AND_COMMIT: LazyLock<String> =
    LazyLock::new(|| format!("{};\nCOMMIT", *CLAIM_DONE_AND_RELEASE));

/// The key's answer and the savepoint's release, sent together (as [`SAVEPOINT_AND_READ`]).
static FINISH_AND_RELEASE: LazyLock<String> =
    LazyLock::new(|| format!("{};\nRELEASE idemflow_phase", sql::FINISH));

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

    /// Runs the phase as a guarded phase job of the writer (module docs) inside a savepoint of
    /// its own: kept when it comes to [`Ran::Committed`], [`Ran::Refusal`] or [`Ran::Existing`],
    /// undone otherwise.
    async fn claim_and_commit(
        self: Box<Self>,
        claim: &NewClaim,
        prepare: Prepare,
    ) -> Result<OneCommit, PhaseError> {
        let SqlitePhase { store, writes } = *self;
        let claim_id = Arc::new(claim.id.clone());
        let claim = Arc::new(claim.clone());
        let ran = store
            .writer
            .call_phase(
                claim_id.clone(),
                phase_job(move |conn, turn| -> BoxFut<'_, _> {
                    let (claim, writes, prepare) = (claim.clone(), writes.clone(), prepare.clone());
                    Box::pin(async move {
                        match run(conn, turn, &claim, &writes, &prepare).await {
                            // The record released the savepoint.
                            Ok(ran @ (Ran::Committed(_) | Ran::Refusal(_))) => Ok(ran),
                            Ok(ran @ Ran::Existing(..)) => {
                                savepoint(conn, "RELEASE idemflow_phase").await?;
                                Ok(ran)
                            }
                            // The savepoint is gone, so the phase's writes cannot be undone alone:
                            // an error of the database kind makes the writer roll the whole batch
                            // back (`writer.rs`, `may_end_transaction`).
                            Ok(Ran::Fenced) => Err(claim_gone(&claim.id)),
                            Ok(other) => {
                                undo(conn).await?;
                                Ok(other)
                            }
                            Err(e) => {
                                // Nothing of the phase may stay in the batch's transaction (unless
                                // its own `BEGIN` or `COMMIT` failed: the writer ends it then).
                                if turn.left_open() {
                                    undo(conn).await?;
                                }
                                Err(e)
                            }
                        }
                    })
                }),
            )
            .await;
        let ran = match ran {
            Ok(ran) => ran,
            // The writer rolled the phase back (a panic, a timeout, its transaction ended):
            // nothing of it was written.
            Err(e) if JobAborted::of(&e).is_some() => return Err(PhaseError::Writes(Box::new(e))),
            Err(e) => return Err(PhaseError::Store(e)),
        };
        match ran {
            Ran::Committed(answer) => Ok(OneCommit::Committed(answer)),
            Ran::Refusal(answer) => Ok(OneCommit::Refused(answer)),
            Ran::Existing(record, now) => Ok(OneCommit::Existing { record, now }),
            // Turned into an error in the job (above), so that the batch is rolled back.
            Ran::Fenced => Err(PhaseError::Store(claim_gone(&claim_id))),
            Ran::WritesFailed(e) => Err(PhaseError::Writes(e)),
            Ran::TooLarge(e) => Err(e),
        }
    }
}

/// One run of the phase: its savepoint and the key's row as it is (one trip; first in its
/// batch, after the batch's `BEGIN IMMEDIATE`), then, for a new key, the application's writes,
/// the answer's checks and the key's row written `done` at once ([`sql::CLAIM_DONE`], which
/// releases the savepoint; last in its batch, followed by the `COMMIT`). The writer holds
/// SQLite's write lock from the `BEGIN IMMEDIATE`, so the key found absent stays absent until
/// that insert: the row is written once, never `processing`, one statement and one index fewer
/// per key than a claim and a record (`docs/one-commit.md`). A key that is there is answered
/// from, or, when claimable, claimed and recorded as any other ([`run_claimed`]).
async fn run(
    conn: &mut SqliteConnection,
    turn: &mut Turn,
    claim: &NewClaim,
    writes: &Writes,
    prepare: &Prepare,
) -> Result<Ran, crate::StoreError> {
    let read = match turn.take_ahead() {
        // The phase before this one in its batch set the savepoint and read the row.
        Some(Ahead::Read(rows)) => Ok(rows),
        ahead => {
            let sql = match ahead {
                // It set the savepoint only.
                Some(Ahead::Savepoint) => sql::CLAIM_READ,
                _ if turn.begins() => BEGIN_SAVEPOINT_AND_READ.as_str(),
                _ => SAVEPOINT_AND_READ.as_str(),
            };
            let query = sqlx::query(sql)
                .bind(claim.id.scope.as_str())
                .bind(claim.id.key.as_str());
            trip(&mut *conn, query).await
        }
    };
    let row = match read {
        Ok(rows) => rows.into_iter().next(),
        Err((0, e)) if turn.begins() => {
            // The `BEGIN IMMEDIATE` itself failed: nothing began.
            turn.begin_failed(e);
            return Err(crate::StoreError::database(
                super::BACKEND,
                "the writer's batch could not begin",
            ));
        }
        Err((_, e)) => return Err(db(e)),
    };
    if let Some(row) = row {
        let (record, now) = decode_with_now(&row)?;
        if !claimable(claim, &record, now) {
            return Ok(Ran::Existing(Box::new(record), now));
        }
        return run_claimed(conn, claim, writes, prepare).await;
    }
    let (answer, reason, refused) = match writes(&mut *conn).await {
        Ok(a) => (a, ONE_COMMIT_REASON, false),
        Err(e) => match refusal(&e) {
            Some(a) => {
                // Undo the writes; the key is not written yet.
                savepoint(conn, "ROLLBACK TO idemflow_phase").await?;
                (a, REFUSED_REASON, true)
            }
            None => return Ok(Ran::WritesFailed(e)),
        },
    };
    let answer = match prepare(answer) {
        Ok(a) => a,
        Err(e) => return Ok(Ran::TooLarge(e)),
    };
    let (status, headers, body) = crate::store::response_columns(&answer);
    // Last in its batch, the phase commits it with its last statement; with a phase after it,
    // it sets that phase's savepoint and reads its row (`writer.rs`, "Trips").
    let commits = turn.take_commit();
    let next = turn.take_next();
    let insert = match (&next, commits) {
        (_, true) => CLAIM_DONE_RELEASE_AND_COMMIT.as_str(),
        (Some(_), false) => CLAIM_DONE_RELEASE_AND_NEXT.as_str(),
        (None, false) => CLAIM_DONE_AND_RELEASE.as_str(),
    };
    let query = sql_core::bind_claim(sqlx::query(insert), claim, millis, None)
        .bind(status)
        .bind(headers)
        .bind(body)
        .bind(reason);
    let query = match &next {
        Some(next) if !commits => query.bind(next.scope.as_str()).bind(next.key.as_str()),
        _ => query,
    };
    match trip(&mut *conn, query).await {
        Ok(_) if commits => turn.committed(),
        Ok(rows) if next.is_some() => turn.hand(Ahead::Read(rows)),
        Ok(_) => {}
        // This phase's insert and release went through; the next phase's savepoint (2) or its
        // read (3) did not: the next phase sets its savepoint (2), or reads (3), on its own. An
        // error that ended the transaction is the writer's to see (its rollback hook).
        Err((2, _)) if next.is_some() && !commits => {}
        Err((3, _)) if next.is_some() && !commits => turn.hand(Ahead::Savepoint),
        // The insert and the release went through, the `COMMIT` did not.
        Err((2, e)) if commits => {
            turn.commit_failed(e);
            return Err(crate::StoreError::database(
                super::BACKEND,
                "the commit of the one-commit insert failed",
            ));
        }
        Err((_, e)) => {
            return Err(match e.as_database_error() {
                // The key was not there when the phase read it, and only this connection can
                // write until the commit: the application's writes wrote it.
                Some(d) if d.is_unique_violation() => crate::StoreError::database(
                    super::BACKEND,
                    format!(
                        "the one-commit insert of {} found the key written during the phase (by \
                         the application's writes?): {d}",
                        claim.id
                    ),
                ),
                _ => db(e),
            });
        }
    }
    Ok(if refused {
        Ran::Refusal(answer)
    } else {
        Ran::Committed(answer)
    })
}

/// [`run`] for a key that is there and claimable (a retryable failure, or an expired lease of
/// another kind of key): its claim, the application's writes, the answer's checks and the
/// record (which releases the savepoint).
async fn run_claimed(
    conn: &mut SqliteConnection,
    claim: &NewClaim,
    writes: &Writes,
    prepare: &Prepare,
) -> Result<Ran, crate::StoreError> {
    let mut lease = match claim_on(&mut *conn, claim).await? {
        ClaimOutcome::Claimed(lease) => lease,
        ClaimOutcome::Existing { record, now } => return Ok(Ran::Existing(record, now)),
    };
    let (answer, reason, refused) = match writes(&mut *conn).await {
        Ok(a) => (a, ONE_COMMIT_REASON, false),
        Err(e) => match refusal(&e) {
            Some(a) => {
                // Undo the writes and the claim (no savepoint of their own), then claim again;
                // nothing else writes in between (this job holds the writer).
                savepoint(conn, "ROLLBACK TO idemflow_phase").await?;
                lease = match claim_on(&mut *conn, claim).await? {
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
}

/// Runs every statement of `query` in one trip to the connection's thread and returns their
/// rows; on an error, how many of the statements had completed before it, with the error (sqlx
/// stops at a failed statement: none after it ran).
async fn trip<'q>(
    conn: &mut SqliteConnection,
    query: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
) -> Result<Vec<sqlx::sqlite::SqliteRow>, (usize, sqlx::Error)> {
    use futures_util::StreamExt;
    use sqlx::Executor;
    let mut steps = conn.fetch_many(query);
    let (mut rows, mut completed) = (Vec::new(), 0);
    while let Some(step) = steps.next().await {
        match step {
            Ok(sqlx::Either::Left(_)) => completed += 1,
            Ok(sqlx::Either::Right(row)) => rows.push(row),
            Err(e) => return Err((completed, e)),
        }
    }
    Ok(rows)
}

/// The error of a record that found the phase's own claim gone: of the database kind, so that
/// the writer rolls the batch back.
fn claim_gone(id: &KeyId) -> crate::StoreError {
    crate::StoreError::database(super::BACKEND, own_claim_gone_detail(id))
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
/// this transaction, and the release of the phase's savepoint, in one trip.
async fn record(
    conn: &mut SqliteConnection,
    id: &KeyId,
    token: LeaseToken,
    answer: StoredResponse,
    reason: &'static str,
    refused: bool,
) -> Result<Ran, crate::StoreError> {
    let finish = step_record(&answer, reason);
    let rows = sql_core::bind_finish(
        sqlx::query(FINISH_AND_RELEASE.as_str()),
        id,
        FinishMode::Holder(token),
        &finish,
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(db)?;
    Ok(match (rows.is_empty(), refused) {
        (true, _) => Ran::Fenced,
        (false, false) => Ran::Committed(answer),
        (false, true) => Ran::Refusal(answer),
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
