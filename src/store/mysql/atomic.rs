//! Atomic phases on MariaDB / MySQL: the application's writes and a workflow step's record in
//! one transaction (`idemflow::store::phase::AtomicPhase`, `docs/workflows.md`).

use async_trait::async_trait;
use sqlx::MySqlConnection;
use sqlx::mysql::MySqlPool;

use super::{MySqlStore, db, sql};
use crate::record::LeaseToken;
use crate::store::phase::{AtomicPhase, PhaseError, Prepare, WritesFuture};
use crate::{KeyId, StoredResponse};

impl MySqlStore {
    /// An atomic phase for [`Context::atomic_step`](crate::Context::atomic_step): `writes` runs
    /// on the transaction's connection and returns the step's answer; the step's record commits
    /// with them, or neither does (see `PostgresStore::atomic_phase` for an example).
    pub fn atomic_phase<F>(&self, writes: F) -> impl AtomicPhase + 'static
    where
        F: for<'c> FnOnce(&'c mut MySqlConnection) -> WritesFuture<'c> + Send + 'static,
    {
        MySqlPhase {
            pool: self.pool().clone(),
            writes,
        }
    }
}

struct MySqlPhase<F> {
    pool: MySqlPool,
    writes: F,
}

#[async_trait]
impl<F> AtomicPhase for MySqlPhase<F>
where
    F: for<'c> FnOnce(&'c mut MySqlConnection) -> WritesFuture<'c> + Send + 'static,
{
    async fn commit(
        self: Box<Self>,
        step: &KeyId,
        token: LeaseToken,
        prepare: Prepare,
    ) -> Result<StoredResponse, PhaseError> {
        let MySqlPhase { pool, writes } = *self;
        let step = step.clone();
        crate::store::phase::detached(super::BACKEND, async move {
            let mut tx = pool.begin().await.map_err(|e| PhaseError::Store(db(e)))?;
            // A failure below drops `tx`: the transaction rolls back.
            let answer = prepare(writes(&mut tx).await.map_err(PhaseError::Writes)?)?;
            let done = sqlx::query(sql::ATOMIC_DONE)
                .bind(i32::from(answer.status()))
                .bind(answer.headers_json())
                .bind(answer.body())
                .bind("atomic phase: the step's writes and this record committed together")
                .bind(step.scope.as_str())
                .bind(step.key.as_str())
                .bind(token.0)
                .execute(&mut *tx)
                .await
                .map_err(|e| PhaseError::Store(db(e)))?;
            if done.rows_affected() != 1 {
                return Err(PhaseError::LeaseLost);
            }
            tx.commit().await.map_err(|e| PhaseError::Store(db(e)))?;
            Ok(answer)
        })
        .await
    }
}
