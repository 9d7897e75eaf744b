//! What the three SQL stores (SQLite, PostgreSQL, MariaDB/MySQL) do alike, written once over
//! [`sqlx::Database`]: the migrations run, the operator's reads (`history`, `stats`, `stuck`)
//! and the sweeper's `count_expired`. Each backend keeps its own statements (`*/sql.rs`) and
//! its own hot path (claim, finish, release, extend, take_stale), where performance work needs
//! the dialect; only how a statement is run and decoded is shared here.
//!
//! [`sql_operator_store!`] writes a backend's [`OperatorStore`](super::OperatorStore) impl from
//! its [`SqlCore`] and its own `finish_as(id, FinishMode, finish)`.

use std::time::Duration;

use sqlx::{ColumnIndex, Database, Encode, Executor, FromRow, IntoArguments, Pool, Type};

use super::FinishMode;
use super::rows::{
    Plain, SqlRow, decode_event, decode_history_columns, decode_record, decode_stats,
};
use super::{Finish, NewClaim};
use super::{Stats, Stuck};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::KeyEvent;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::record::LeaseToken;

/// A statement with its parameters, on any SQL backend.
pub(crate) type Statement<'q, DB> = sqlx::query::Query<'q, DB, <DB as Database>::Arguments>;

/// Binds a claim's parameters, in the order the claim statement of every SQL backend takes
/// them: scope, key, operation, provider, provider key, fingerprint, request, owner, lease,
/// retention (ms), takeover window (or NULL), then `nonce` when given (MariaDB's), then the
/// provider key of a re-created key (or NULL). The lease and the window are bound in
/// `duration`'s unit (the backend's, as [`SqlCore::duration`]).
pub(crate) fn bind_claim<'q, DB>(
    q: Statement<'q, DB>,
    claim: &NewClaim,
    duration: fn(Duration) -> i64,
    nonce: Option<i64>,
) -> Statement<'q, DB>
where
    DB: Database,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> Option<&'t str>: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Type<DB>,
    for<'t> Option<i64>: Encode<'t, DB> + Type<DB>,
{
    let q = q
        .bind(claim.id.scope.as_str())
        .bind(claim.id.key.as_str())
        .bind(claim.operation.as_str())
        .bind(claim.provider.as_deref())
        .bind(claim.provider_key.as_str())
        .bind(claim.fingerprint.as_str())
        .bind(claim.request.as_deref())
        .bind(claim.owner.as_str())
        .bind(duration(claim.lease))
        .bind(super::kit::millis(claim.retention))
        .bind(claim.takeover_window.map(duration));
    let q = match nonce {
        Some(nonce) => q.bind(nonce),
        None => q,
    };
    q.bind(claim.renewed_key_base.as_deref())
}

/// Binds a finish's parameters, in the order the finish statement of every SQL backend takes
/// them: scope, key, state, retryable, status, headers, body, error, the holder's token (or
/// NULL), actor, reason, the expected token of a compare-and-set override (or NULL).
pub(crate) fn bind_finish<'q, DB>(
    q: Statement<'q, DB>,
    id: &KeyId,
    mode: FinishMode,
    finish: &Finish,
) -> Statement<'q, DB>
where
    DB: Database,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> Option<&'t str>: Encode<'t, DB> + Type<DB>,
    for<'t> Option<&'t [u8]>: Encode<'t, DB> + Type<DB>,
    for<'t> Option<String>: Encode<'t, DB> + Type<DB>,
    for<'t> Option<i32>: Encode<'t, DB> + Type<DB>,
    for<'t> Option<i64>: Encode<'t, DB> + Type<DB>,
    for<'t> bool: Encode<'t, DB> + Type<DB>,
{
    let (status, headers, body) = finish.response_columns();
    q.bind(id.scope.as_str())
        .bind(id.key.as_str())
        .bind(finish.to.as_str())
        .bind(finish.to.is_retryable())
        .bind(status)
        .bind(headers)
        .bind(body)
        .bind(finish.error.as_deref())
        .bind(mode.holder().map(|t| t.0))
        .bind(finish.actor.as_str())
        .bind(finish.reason.as_str())
        .bind(mode.expected().map(|t| t.0))
}

/// Binds the key and the holder's token: all the parameters of the pooled SQL backends'
/// `mark_attempt`.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn bind_fence<'q, DB>(
    q: Statement<'q, DB>,
    id: &KeyId,
    token: LeaseToken,
) -> Statement<'q, DB>
where
    DB: Database,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Type<DB>,
{
    q.bind(id.scope.as_str())
        .bind(id.key.as_str())
        .bind(token.0)
}

/// A backend's statements for the shared reads. Parameters: `history` scope, key; `stuck_count`
/// the age; `stuck_list` the age, the limit. Ages are bound in the backend's
/// [`SqlCore::duration`] unit.
#[derive(Debug)]
pub(crate) struct ReadSql {
    pub(crate) history: HistorySql,
    pub(crate) stats: &'static str,
    pub(crate) stuck_count: &'static str,
    pub(crate) stuck_list: &'static str,
    pub(crate) count_expired: &'static str,
}

/// How a backend keeps a key's history.
#[derive(Debug)]
pub(crate) enum HistorySql {
    /// One row per event (MariaDB/MySQL): `id, from_state, from_retryable, to_state,
    /// to_retryable, lease_token, actor, reason, at`, in order.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    Rows(&'static str),
    /// In the key's row and its tombstone (SQLite, PostgreSQL): one row of two text columns,
    /// `archived` and `live` ([`decode_history_columns`]).
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    Columns(&'static str),
}

/// One SQL backend's pool for reads, its statements and its duration unit.
pub(crate) struct SqlCore<'a, DB: Database> {
    pub(crate) backend: &'static str,
    /// The pool reads run on (SQLite: its readers, never the writer).
    pub(crate) pool: &'a Pool<DB>,
    pub(crate) sql: &'a ReadSql,
    /// A duration as the statements bind it: milliseconds (SQLite, PostgreSQL) or
    /// microseconds (MariaDB/MySQL).
    pub(crate) duration: fn(Duration) -> i64,
    /// The backend's error mapping (the pooled backends name an exhausted pool).
    pub(crate) error: fn(&'static str, &Pool<DB>, sqlx::Error) -> StoreError,
}

impl<DB> SqlCore<'_, DB>
where
    DB: Database,
    DB::Row: SqlRow,
    DB::Arguments: IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'c> &'c str: ColumnIndex<DB::Row> + Encode<'c, DB> + Type<DB>,
    for<'r> (i64,): FromRow<'r, DB::Row>,
    i64: for<'q> Encode<'q, DB> + Plain<DB>,
    bool: Plain<DB>,
    i32: Plain<DB>,
    Vec<u8>: Plain<DB>,
{
    fn err(&self, e: sqlx::Error) -> StoreError {
        (self.error)(self.backend, self.pool, e)
    }

    pub(crate) async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError> {
        let statement = match self.sql.history {
            HistorySql::Rows(s) | HistorySql::Columns(s) => s,
        };
        let rows = sqlx::query(statement)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .fetch_all(self.pool)
            .await
            .map_err(|e| self.err(e))?;
        match self.sql.history {
            HistorySql::Rows(_) => rows.iter().map(decode_event).collect(),
            HistorySql::Columns(_) => {
                let Some(row) = rows.first() else {
                    return Ok(Vec::new());
                };
                let (archived, live) = (row.text("archived")?, row.text("live")?);
                decode_history_columns(self.backend, archived.as_deref(), live.as_deref())
            }
        }
    }

    pub(crate) async fn stats(&self) -> Result<Stats, StoreError> {
        let row = sqlx::query(self.sql.stats)
            .fetch_one(self.pool)
            .await
            .map_err(|e| self.err(e))?;
        decode_stats(&row)
    }

    pub(crate) async fn stuck(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<Stuck, StoreError> {
        let age = (self.duration)(older_than);
        let count: i64 = sqlx::query_scalar(self.sql.stuck_count)
            .bind(age)
            .fetch_one(self.pool)
            .await
            .map_err(|e| self.err(e))?;
        let rows = sqlx::query(self.sql.stuck_list)
            .bind(age)
            .bind(i64::from(limit))
            .fetch_all(self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(Stuck {
            count,
            oldest: rows.iter().map(decode_record).collect::<Result<_, _>>()?,
        })
    }

    pub(crate) async fn count_expired(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(self.sql.count_expired)
            .fetch_one(self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}

/// The [`OperatorStore`](crate::store::OperatorStore) impl of a SQL store, written once: the
/// reads go through the store's `fn core(&self) -> SqlCore<'_, DB>`.
macro_rules! sql_operator_store {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::OperatorStore for $store {
            async fn history(
                &self,
                id: &$crate::KeyId,
            ) -> Result<Vec<$crate::record::KeyEvent>, $crate::StoreError> {
                self.core().history(id).await
            }

            async fn stats(&self) -> Result<$crate::store::Stats, $crate::StoreError> {
                self.core().stats().await
            }

            async fn stuck(
                &self,
                older_than: std::time::Duration,
                limit: u32,
            ) -> Result<$crate::store::Stuck, $crate::StoreError> {
                self.core().stuck(older_than, limit).await
            }
        }
    };
}
pub(crate) use sql_operator_store;

/// Runs a SQL backend's migrations on `pool` (SQLite: the writer's, as the readers are
/// read-only), recorded in the backend's own migrations table. MariaDB's `migrate` is its own
/// (`store::mysql::migrate`: a lock sqlx's does not give there, and the procedures).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) async fn migrate<DB>(
    backend: &'static str,
    pool: &Pool<DB>,
    migrator: sqlx::migrate::Migrator,
) -> Result<(), StoreError>
where
    DB: Database,
    DB::Connection: sqlx::migrate::Migrate,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
{
    migrator.run(pool).await.map_err(|e| StoreError::Migrate {
        backend,
        source: Box::new(e),
    })
}
