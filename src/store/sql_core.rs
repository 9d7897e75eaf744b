//! What the three SQL stores (SQLite, PostgreSQL, MariaDB/MySQL) do alike, written once over
//! [`sqlx::Database`]: the migrations run, the operator's reads (`history`, `stats`, `stuck`)
//! and the sweeper's `count_expired`. Each backend keeps its own statements (`*/sql.rs`) and
//! its own hot path (claim, finish, release, extend, take_stale), where performance work needs
//! the dialect; only how a statement is run and decoded is shared here.
//!
//! [`sql_operator_store!`] writes a backend's [`OperatorStore`](super::OperatorStore) impl from
//! its [`SqlCore`] and its own `finish_as(id, FinishMode, finish)`.

use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::{ColumnIndex, Database, Encode, Executor, FromRow, IntoArguments, Pool, Type};

use super::rows::{Plain, SqlRow, decode_event, decode_record, decode_stats};
use super::{Stats, Stuck};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::KeyEvent;

/// A backend's statements for the shared reads. Parameters: `history` scope, key; `stuck_count`
/// the age; `stuck_list` the age, the limit. Ages are bound in the backend's
/// [`SqlCore::duration`] unit.
#[derive(Debug)]
pub(crate) struct ReadSql {
    pub(crate) history: &'static str,
    pub(crate) stats: &'static str,
    pub(crate) stuck_count: &'static str,
    pub(crate) stuck_list: &'static str,
    pub(crate) count_expired: &'static str,
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
        let rows = sqlx::query(self.sql.history)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .fetch_all(self.pool)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter().map(decode_event).collect()
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
/// reads go through the store's `fn core(&self) -> SqlCore<'_, DB>`, the two overrides through
/// its `async fn finish_as(&self, &KeyId, FinishMode, &Finish)`.
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

            async fn override_finish(
                &self,
                id: &$crate::KeyId,
                finish: &$crate::store::Finish,
            ) -> Result<$crate::record::KeyRecord, $crate::StoreError> {
                self.finish_as(id, $crate::store::kit::FinishMode::Override, finish)
                    .await
            }

            async fn override_finish_if(
                &self,
                id: &$crate::KeyId,
                expected: $crate::record::LeaseToken,
                finish: &$crate::store::Finish,
            ) -> Result<$crate::record::KeyRecord, $crate::StoreError> {
                let mode = $crate::store::kit::FinishMode::OverrideIf(expected);
                self.finish_as(id, mode, finish).await
            }
        }
    };
}
pub(crate) use sql_operator_store;

/// Runs a SQL backend's migrations on `pool` (SQLite: the writer's, as the readers are
/// read-only), recorded in the backend's own migrations table.
pub(crate) async fn migrate<DB>(
    backend: &'static str,
    pool: &Pool<DB>,
    migrator: Migrator,
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
