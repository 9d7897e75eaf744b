//! Atomic phases on SQLite: the application's writes and a workflow step's record in one
//! transaction (`idemflow::workflow::AtomicPhase`, `docs/workflows.md`).
//!
//! The phase is a job of the group-committing writer (`writer.rs`): it runs on the writer's
//! connection inside the batch's transaction, within a savepoint of its own, so a failure of
//! the writes or a fenced-out record undoes only this phase; its caller is answered once the
//! batch has committed. If the batch is rolled back for another job's error, the writer runs
//! the phase again, so its writes closure is `Fn` (each run starts from nothing written).

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::SqliteConnection;

use super::writer::{BoxFut, job};
use super::{SqliteStore, db, sql};
use crate::record::LeaseToken;
use crate::store::Finish;
use crate::workflow::{AtomicPhase, PhaseError, Prepare, WritesFuture};
use crate::{KeyId, StoredResponse};

/// What one run of the phase inside the writer came to.
enum Ran {
    Committed(StoredResponse),
    Fenced,
    WritesFailed(String),
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
            .call(job(move |conn: &mut SqliteConnection| -> BoxFut<'_, _> {
                let (writes, scope, key) = (writes.clone(), scope.clone(), key.clone());
                let prepare = prepare.clone();
                Box::pin(async move {
                    sqlx::query("SAVEPOINT idemflow_phase")
                        .execute(&mut *conn)
                        .await
                        .map_err(db)?;
                    let answer = match writes(&mut *conn).await {
                        Ok(a) => prepare(a),
                        Err(e) => {
                            undo(conn).await?;
                            return Ok(Ran::WritesFailed(e.to_string()));
                        }
                    };
                    let finish = Finish {
                        to: crate::state::KeyState::Done,
                        response: Some(answer.clone()),
                        error: None,
                        actor: crate::record::Actor::Worker,
                        reason: "atomic phase: the step's writes and this record committed \
                                 together"
                            .to_owned(),
                        expect_token: None,
                    };
                    let (status, headers, body) = finish.response_columns();
                    let row = sqlx::query(sql::FINISH)
                        .bind(&scope)
                        .bind(&key)
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
                    if row.is_none() {
                        undo(conn).await?;
                        return Ok(Ran::Fenced);
                    }
                    sqlx::query("RELEASE idemflow_phase")
                        .execute(&mut *conn)
                        .await
                        .map_err(db)?;
                    Ok(Ran::Committed(answer))
                })
            }))
            .await
            .map_err(PhaseError::Store)?;
        match ran {
            Ran::Committed(answer) => Ok(answer),
            Ran::Fenced => Err(PhaseError::LeaseLost),
            Ran::WritesFailed(e) => Err(PhaseError::Writes(e.into())),
        }
    }
}

/// Undoes the phase's writes and leaves its savepoint.
async fn undo(conn: &mut SqliteConnection) -> Result<(), crate::StoreError> {
    sqlx::query("ROLLBACK TO idemflow_phase")
        .execute(&mut *conn)
        .await
        .map_err(db)?;
    sqlx::query("RELEASE idemflow_phase")
        .execute(&mut *conn)
        .await
        .map_err(db)?;
    Ok(())
}
