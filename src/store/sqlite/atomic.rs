//! Atomic phases on SQLite: the application's writes and a workflow step's record in one
//! transaction (`idemflow::store::phase::AtomicPhase`, `docs/workflows.md`).
//!
//! The phase is a guarded job of the group-committing writer (`writer.rs`, "Phase jobs"): it
//! runs on the writer's connection inside a transaction of the writer's (alone or in a batch),
//! within a savepoint of its own, so a failure of the writes or a fenced-out record undoes only
//! this phase; its caller is answered once the transaction has committed. If the batch is
//! rolled back for another job's error, the writer runs the phase again, so its writes closure
//! is `Fn` (each run starts from nothing written). A panic, a hang past the store's phase
//! timeout, a statement that ends the transaction, or a write through the same store from
//! inside the phase fails this step only ([`PhaseError::Writes`], rolled back); the writer and
//! every other key go on.

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::SqliteConnection;

use super::writer::{BoxFut, JobAborted, job};
use super::{SqliteStore, db, sql};
use crate::record::LeaseToken;
use crate::store::phase::{AtomicPhase, PhaseError, Prepare, WritesFuture, step_record};
use crate::{KeyId, StoredResponse};

/// What one run of the phase inside the writer came to.
enum Ran {
    Committed(StoredResponse),
    Fenced,
    WritesFailed(String),
    /// The answer was refused before the record (too large): rolled back.
    Refused(PhaseError),
}

type Writes = Arc<dyn for<'c> Fn(&'c mut SqliteConnection) -> WritesFuture<'c> + Send + Sync>;

impl SqliteStore {
    /// An atomic phase for [`Context::atomic_step`](crate::Context::atomic_step) on the
    /// database of this store (a file database, or the store's own in-memory one): `writes`
    /// runs on the writer's connection inside the transaction, and returns the step's answer;
    /// the step's record commits with them, or neither does. `writes` may run more than once
    /// (see the module docs), each time from nothing written.
    pub fn atomic_phase<F>(&self, writes: F) -> impl AtomicPhase + 'static
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
    async fn commit(
        self: Box<Self>,
        step: &KeyId,
        token: LeaseToken,
        prepare: Prepare,
    ) -> Result<StoredResponse, PhaseError> {
        let SqlitePhase { store, writes } = *self;
        let (scope, key) = (step.scope.as_str().to_owned(), step.key.as_str().to_owned());
        let ran = store
            .writer
            .call_phase(job(move |conn: &mut SqliteConnection| -> BoxFut<'_, _> {
                let (writes, scope, key) = (writes.clone(), scope.clone(), key.clone());
                let prepare = prepare.clone();
                Box::pin(async move {
                    sqlx::query("SAVEPOINT idemflow_phase")
                        .execute(&mut *conn)
                        .await
                        .map_err(db)?;
                    match run(conn, &writes, &prepare, &scope, &key, token).await {
                        Ok(Ran::Committed(answer)) => {
                            sqlx::query("RELEASE idemflow_phase")
                                .execute(&mut *conn)
                                .await
                                .map_err(db)?;
                            Ok(Ran::Committed(answer))
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
            Ok(Ran::Committed(answer)) => Ok(answer),
            Ok(Ran::Fenced) => Err(PhaseError::LeaseLost),
            Ok(Ran::WritesFailed(e)) => Err(PhaseError::Writes(e.into())),
            Ok(Ran::Refused(e)) => Err(e),
            // The writer rolled the phase back (a panic, a timeout, its transaction ended):
            // nothing of it was written.
            Err(e) if JobAborted::of(&e).is_some() => Err(PhaseError::Writes(Box::new(e))),
            Err(e) => Err(PhaseError::Store(e)),
        }
    }
}

/// The phase inside its savepoint: the writes, the answer's checks, the fenced record.
async fn run(
    conn: &mut SqliteConnection,
    writes: &Writes,
    prepare: &Prepare,
    scope: &str,
    key: &str,
    token: LeaseToken,
) -> Result<Ran, crate::StoreError> {
    let answer = match writes(&mut *conn).await {
        Ok(a) => match prepare(a) {
            Ok(a) => a,
            Err(e) => return Ok(Ran::Refused(e)),
        },
        Err(e) => return Ok(Ran::WritesFailed(e.to_string())),
    };
    let finish = step_record(&answer);
    let (status, headers, body) = finish.response_columns();
    let row = sqlx::query(sql::FINISH)
        .bind(scope)
        .bind(key)
        .bind(finish.to.as_str())
        .bind(false)
        .bind(status)
        .bind(headers)
        .bind(body)
        .bind(None::<String>)
        .bind(Some(token.0))
        .bind(finish.actor.as_str())
        .bind(&finish.reason)
        .bind(None::<i64>)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db)?;
    Ok(match row {
        Some(_) => Ran::Committed(answer),
        None => Ran::Fenced,
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
