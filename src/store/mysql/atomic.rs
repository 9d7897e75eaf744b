//! Atomic phases on MariaDB / MySQL: a key's claim, the application's writes and the key's
//! answer in one transaction (`idemflow::store::phase::AtomicPhase`, `docs/one-commit.md`); the
//! transaction itself is the pooled stores' one scaffold (`store::phase::PooledPhase`).

use std::future::Future;
use std::pin::Pin;

use sqlx::MySqlConnection;

use super::{BACKEND, MySqlStore, claim_on, is_lock_conflict, sql};
use crate::record::LeaseToken;
use crate::store::phase::{AtomicPhase, PooledOps, PooledPhase, WritesFuture};
use crate::{KeyId, StoredResponse};

impl MySqlStore {
    /// An atomic phase for [`Idempotency::execute_atomic`](crate::Idempotency::execute_atomic)
    /// or [`Context::atomic_step`](crate::Context::atomic_step): `writes` runs on the connection
    /// of the transaction that claims the key and returns the key's answer; the key's claim and
    /// answer commit with them, or none does (see `PostgresStore::atomic_phase` for an example).
    pub fn atomic_phase<F>(&self, writes: F) -> impl AtomicPhase + 'static + use<F>
    where
        F: for<'c> FnOnce(&'c mut MySqlConnection) -> WritesFuture<'c> + Send + 'static,
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
                claim_again: is_lock_conflict,
            },
        }
    }
}

/// A phase's `BEGIN`, after `READ COMMITTED` (the claim's read after a concurrent claim commits
/// must see that claim's row) and `max_statement_time`: each statement of the phase, the
/// application's included, is cut off by the server after
/// [`DEFAULT_PHASE_TIMEOUT`](crate::store::phase::DEFAULT_PHASE_TIMEOUT). MariaDB has no
/// transaction-scoped setting: the connection keeps that bound for the statements it runs after
/// the phase (the store's own take milliseconds).
pub(super) const PHASE_BEGIN: &str = "SET SESSION max_statement_time = 5; \
     SET TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN";

/// The step's record, fenced by its token ([`sql::ATOMIC_DONE`]).
fn record_step<'c>(
    conn: &'c mut MySqlConnection,
    step: &'c KeyId,
    token: LeaseToken,
    answer: &'c StoredResponse,
    reason: &'static str,
) -> Pin<Box<dyn Future<Output = Result<bool, sqlx::Error>> + Send + 'c>> {
    Box::pin(async move {
        let done = sqlx::query(sql::ATOMIC_DONE)
            .bind(i32::from(answer.status()))
            .bind(answer.headers_json())
            .bind(answer.body())
            .bind(reason)
            .bind(step.scope.as_str())
            .bind(step.key.as_str())
            .bind(token.0)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    })
}

#[cfg(test)]
mod tests {
    /// The server's bound on a phase's statements is the phase timeout.
    #[test]
    fn the_begin_bounds_statements_by_the_phase_timeout() {
        let secs = crate::store::phase::DEFAULT_PHASE_TIMEOUT.as_secs_f64();
        assert!(
            super::PHASE_BEGIN.contains(&format!("max_statement_time = {secs};")),
            "{}",
            super::PHASE_BEGIN
        );
    }
}
