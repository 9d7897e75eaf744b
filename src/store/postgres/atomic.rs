//! Atomic phases on PostgreSQL: the application's writes and a workflow step's record in one
//! transaction (`idemflow::store::phase::AtomicPhase`, `docs/workflows.md`).

use async_trait::async_trait;
use sqlx::PgConnection;
use sqlx::postgres::PgPool;

use super::{PostgresStore, db, finish_query};
use crate::record::{Actor, LeaseToken};
use crate::state::KeyState;
use crate::store::Finish;
use crate::store::phase::{AtomicPhase, PhaseError, Prepare, WritesFuture};
use crate::{KeyId, StoredResponse};

impl PostgresStore {
    /// An atomic phase for [`Context::atomic_step`](crate::Context::atomic_step): `writes` runs
    /// on the transaction's connection, and returns the step's answer; the step's record commits
    /// with them, or neither does.
    ///
    /// ```no_run
    /// # async fn f(ctx: idemflow::Context, pg: idemflow::store::postgres::PostgresStore) -> Result<(), idemflow::Error> {
    /// use idemflow::{Step, StoredResponse};
    /// let order = ctx.atomic_step(
    ///     Step::new("create_order", &serde_json::json!({"order": "o-1"}))?,
    ///     pg.atomic_phase(|tx| Box::pin(async move {
    ///         sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
    ///             .bind("o-1").bind(1500_i64)
    ///             .execute(&mut *tx).await?;
    ///         Ok(StoredResponse::json(201, &serde_json::json!({"order": "o-1"}))?)
    ///     })),
    /// ).await?;
    /// # Ok(()) }
    /// ```
    pub fn atomic_phase<F>(&self, writes: F) -> impl AtomicPhase + 'static
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> WritesFuture<'c> + Send + 'static,
    {
        PgPhase {
            pool: self.pool.clone(),
            writes,
        }
    }
}

struct PgPhase<F> {
    pool: PgPool,
    writes: F,
}

#[async_trait]
impl<F> AtomicPhase for PgPhase<F>
where
    F: for<'c> FnOnce(&'c mut PgConnection) -> WritesFuture<'c> + Send + 'static,
{
    async fn commit(
        self: Box<Self>,
        step: &KeyId,
        token: LeaseToken,
        prepare: Prepare,
    ) -> Result<StoredResponse, PhaseError> {
        let PgPhase { pool, writes } = *self;
        let step = step.clone();
        crate::store::phase::detached(super::BACKEND, async move {
            let mut tx = pool.begin().await.map_err(|e| PhaseError::Store(db(e)))?;
            // A failure below drops `tx`: the transaction rolls back.
            let answer = prepare(writes(&mut tx).await.map_err(PhaseError::Writes)?)?;
            let finish = Finish {
                to: KeyState::Done,
                response: Some(answer.clone()),
                error: None,
                actor: Actor::Worker,
                reason: "atomic phase: the step's writes and this record committed together"
                    .to_owned(),
                expect_token: None,
            };
            let (status, headers, body) = finish.response_columns();
            let row = finish_query(&step, Some(token), &finish, status, headers, body)
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| PhaseError::Store(db(e)))?;
            if row.is_none() {
                return Err(PhaseError::LeaseLost);
            }
            tx.commit().await.map_err(|e| PhaseError::Store(db(e)))?;
            Ok(answer)
        })
        .await
    }
}
