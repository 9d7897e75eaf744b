//! Atomic phases on PostgreSQL: a key's claim, the application's writes and the key's answer
//! in one transaction (`idemflow::store::phase::AtomicPhase`, `docs/one-commit.md`); the
//! transaction itself is the pooled stores' one scaffold (`store::phase::PooledPhase`).

use std::future::Future;
use std::pin::Pin;

use sqlx::PgConnection;

use super::{BACKEND, PostgresStore, claim_on, finish_query};
use crate::record::LeaseToken;
use crate::store::FinishMode;
use crate::store::phase::{AtomicPhase, PooledOps, PooledPhase, WritesFuture, step_record};
use crate::{KeyId, StoredResponse};

impl PostgresStore {
    /// An atomic phase for [`Idempotency::execute_atomic`](crate::Idempotency::execute_atomic)
    /// or [`Context::atomic_step`](crate::Context::atomic_step): `writes` runs on the connection
    /// of the transaction that claims the key, and returns the key's answer; the key's claim and
    /// answer commit with them, or none does.
    ///
    /// ```no_run
    /// # async fn f(ctx: idemflow::Context, pg: idemflow::store::postgres::PostgresStore) -> Result<(), idemflow::Error> {
    /// use idemflow::{workflow::Step, StoredResponse};
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
    pub fn atomic_phase<F>(&self, writes: F) -> impl AtomicPhase + 'static + use<F>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> WritesFuture<'c> + Send + 'static,
    {
        PooledPhase {
            warm: self.warm.clone(),
            writes,
            ops: PooledOps {
                backend: BACKEND,
                id: self.store_id(),
                begin: PHASE_BEGIN,
                claim: |conn, claim| Box::pin(claim_on(conn, claim)),
                record: record_step,
                claim_again: |_| false,
            },
        }
    }
}

/// A phase's `BEGIN`: each statement of it, the application's included, is cancelled by the
/// server after [`DEFAULT_PHASE_TIMEOUT`](crate::store::phase::DEFAULT_PHASE_TIMEOUT), for the
/// transaction only (`SET LOCAL`).
pub(super) const PHASE_BEGIN: &str = "BEGIN; SET LOCAL statement_timeout = 5000";

/// The step's record: the store's own finish statement, fenced by the step's token.
fn record_step<'c>(
    conn: &'c mut PgConnection,
    step: &'c KeyId,
    token: LeaseToken,
    answer: &'c StoredResponse,
    reason: &'static str,
) -> Pin<Box<dyn Future<Output = Result<bool, sqlx::Error>> + Send + 'c>> {
    Box::pin(async move {
        let finish = step_record(answer, reason);
        let row = finish_query(step, FinishMode::Holder(token), &finish)
            .fetch_optional(conn)
            .await?;
        Ok(row.is_some())
    })
}

#[cfg(test)]
mod tests {
    /// The server's bound on a phase's statements is the phase timeout.
    #[test]
    fn the_begin_bounds_statements_by_the_phase_timeout() {
        let ms = crate::store::phase::DEFAULT_PHASE_TIMEOUT.as_millis();
        assert!(
            super::PHASE_BEGIN.ends_with(&format!("statement_timeout = {ms}")),
            "{}",
            super::PHASE_BEGIN
        );
    }
}
