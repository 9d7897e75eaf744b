//! The PostgreSQL store (feature `postgres`): many app instances, workers and sweepers on one
//! database, coordinated by row locks, `ON CONFLICT` and `FOR UPDATE SKIP LOCKED`.
//!
//! - A claim is one statement: a replay is one round trip and takes no lock; a new key is one
//!   round trip (two only when a concurrent claimer commits the same key at the same moment).
//! - Every time is the server's `statement_timestamp()`; the application hosts' clocks are
//!   never used.
//! - History rows are written by a trigger keyed on the row's `version`, inside the statement
//!   that makes the transition.
//! - Tables live in the first schema of the connection's `search_path`; idemflow's migrations
//!   are recorded in [`MIGRATIONS_TABLE`], never in the host app's `_sqlx_migrations`.
//!
//! Run it at the default `READ COMMITTED` isolation (the claim relies on `ON CONFLICT` judging
//! the latest committed row).

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::Row;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use tracing::instrument;

use super::{
    ClaimOutcome, Finish, Lease, NewClaim, RawEvent, RawRecord, Release, Stats, Store, Stuck,
    TakeStale, check_finish, millis, refused_write,
};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::{KeyEvent, KeyRecord, LeaseToken};
use crate::state::Transition;

mod sql;

const BACKEND: &str = "postgres";

/// The table that records which of idemflow's migrations ran; the host app's own sqlx migrations
/// table is never touched.
pub const MIGRATIONS_TABLE: &str = "_idemflow_migrations";

/// The sweeper's statement (stale keys picked with `FOR UPDATE SKIP LOCKED`, then fenced), for
/// `EXPLAIN` checks. Parameters: `$1` owner, `$2` lease in ms, `$3` batch limit.
pub const TAKE_STALE_SQL: &str = sql::TAKE_STALE;

/// Durations are capped at 1,000 years so that `now + duration` stays a valid timestamp.
const MAX_MS: i64 = 1000 * 366 * 24 * 3600 * 1000;

fn ms(d: Duration) -> i64 {
    millis(d).min(MAX_MS)
}

/// idemflow's PostgreSQL migrations, recorded in [`MIGRATIONS_TABLE`].
pub fn migrator() -> Migrator {
    let mut m = sqlx::migrate!("./migrations/postgres");
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}

fn db(e: sqlx::Error) -> StoreError {
    StoreError::database(BACKEND, e)
}

/// A [`Store`] on PostgreSQL.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemflow::StoreError> {
/// use idemflow::{Store, store::postgres::PostgresStore};
/// let store = PostgresStore::connect("postgres://app@db.internal/app").await?;
/// store.migrate().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// Connects a pool (10 connections at most) to `url`.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::Config(format!("bad PostgreSQL URL: {e}")))?;
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .connect_with(options)
            .await
            .map_err(db)?;
        Ok(Self::from_pool(pool))
    }

    /// Uses a pool you manage (its `search_path` decides the schema).
    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
    }

    /// The pool (for tests and tools that need raw access).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn read_with_now(
        &self,
        id: &KeyId,
    ) -> Result<Option<(KeyRecord, DateTime<Utc>)>, StoreError> {
        let row = sqlx::query(sql::GET)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db)?;
        match row {
            None => Ok(None),
            Some(row) => {
                let now: DateTime<Utc> = row.try_get("db_now").map_err(db)?;
                Ok(Some((record(&row)?, now)))
            }
        }
    }

    async fn lease_lost_or_missing(&self, id: &KeyId, presented: LeaseToken) -> StoreError {
        refused_write(id, presented, self.get(id).await)
    }
}

fn record(row: &PgRow) -> Result<KeyRecord, StoreError> {
    fn get<'r, T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>>(
        row: &'r PgRow,
        col: &str,
    ) -> Result<T, StoreError> {
        row.try_get(col).map_err(db)
    }
    RawRecord {
        scope: get(row, "scope")?,
        key: get(row, "key")?,
        operation: get(row, "operation")?,
        provider: get(row, "provider")?,
        provider_key: get(row, "provider_key")?,
        state: get(row, "state")?,
        retryable: get(row, "retryable")?,
        fingerprint: get(row, "fingerprint")?,
        request: get(row, "request")?,
        response_status: get(row, "response_status")?,
        response_headers: get(row, "response_headers")?,
        response_body: get(row, "response_body")?,
        error: get(row, "error")?,
        lease_token: get(row, "lease_token")?,
        lease_owner: get(row, "lease_owner")?,
        lease_expires_at: get(row, "lease_expires_at")?,
        attempts: get(row, "attempts")?,
        created_at: get(row, "created_at")?,
        updated_at: get(row, "updated_at")?,
        expires_at: get(row, "expires_at")?,
        next_check_at: get(row, "next_check_at")?,
        retention_ms: get(row, "retention_ms")?,
    }
    .into_record(BACKEND)
}

fn transition_of(reason: &str) -> Result<Transition, StoreError> {
    Transition::from_claim_reason(reason).ok_or_else(|| StoreError::Corrupt {
        backend: BACKEND,
        detail: format!("claim returned reason {reason:?}"),
    })
}

#[async_trait]
impl Store for PostgresStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    #[instrument(skip(self), err)]
    async fn migrate(&self) -> Result<(), StoreError> {
        migrator()
            .run(&self.pool)
            .await
            .map_err(|e| StoreError::Migrate {
                backend: BACKEND,
                source: Box::new(e),
            })
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        sqlx::query_scalar(sql::NOW)
            .fetch_one(&self.pool)
            .await
            .map_err(db)
    }

    #[instrument(name = "idemflow.claim", skip_all, fields(backend = BACKEND, scope = %claim.id.scope, key = %claim.id.key, operation = %claim.operation), err)]
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        for _ in 0..3 {
            let row = sqlx::query(sql::CLAIM)
                .bind(claim.id.scope.as_str())
                .bind(claim.id.key.as_str())
                .bind(&claim.operation)
                .bind(claim.provider.as_deref())
                .bind(&claim.provider_key)
                .bind(claim.fingerprint.as_str())
                .bind(claim.request.as_deref())
                .bind(&claim.owner)
                .bind(ms(claim.lease))
                .bind(ms(claim.retention))
                .bind(claim.takeover_window.map(ms))
                .fetch_optional(&self.pool)
                .await
                .map_err(db)?;
            let row = match row {
                Some(row) => row,
                // A concurrent claimer committed the key after this statement's snapshot: the
                // row is there now.
                None => match self.read_with_now(&claim.id).await? {
                    Some((record, now)) => {
                        return Ok(ClaimOutcome::Existing {
                            record: Box::new(record),
                            now,
                        });
                    }
                    // ... or it was purged in between: try again.
                    None => continue,
                },
            };
            let claimed: bool = row.try_get("claimed").map_err(db)?;
            if !claimed {
                return Ok(ClaimOutcome::Existing {
                    record: Box::new(record(&row)?),
                    now: row.try_get("db_now").map_err(db)?,
                });
            }
            let reason: String = row.try_get("last_reason").map_err(db)?;
            let transition = transition_of(&reason)?;
            tracing::debug!(?transition, "key claimed");
            return Ok(ClaimOutcome::Claimed(Lease {
                token: LeaseToken(row.try_get("lease_token").map_err(db)?),
                expires_at: row.try_get("lease_expires_at").map_err(db)?,
                attempts: row.try_get("attempts").map_err(db)?,
                provider_key: row.try_get("provider_key").map_err(db)?,
                transition,
            }));
        }
        Err(StoreError::Corrupt {
            backend: BACKEND,
            detail: format!("claim of {} neither inserted nor found a row", claim.id),
        })
    }

    #[instrument(name = "idemflow.finish", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key, to = %finish.to, actor = finish.actor.as_str()), err)]
    async fn finish(
        &self,
        id: &KeyId,
        token: Option<LeaseToken>,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        check_finish(token, finish.to)?;
        let (status, headers, body) = finish.response_columns();
        let row = sqlx::query(sql::FINISH)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .bind(finish.to.as_str())
            .bind(finish.to.is_retryable())
            .bind(status)
            .bind(headers)
            .bind(body)
            .bind(finish.error.as_deref())
            .bind(token.map(|t| t.0))
            .bind(finish.actor.as_str())
            .bind(&finish.reason)
            .fetch_optional(&self.pool)
            .await
            .map_err(db)?;
        match row {
            Some(row) => record(&row),
            None => Err(match token {
                Some(t) => self.lease_lost_or_missing(id, t).await,
                None => StoreError::NotFound {
                    key: id.to_string(),
                },
            }),
        }
    }

    #[instrument(name = "idemflow.release", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key, actor = release.actor.as_str()), err)]
    async fn release(
        &self,
        id: &KeyId,
        token: LeaseToken,
        release: &Release,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(sql::RELEASE)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .bind(token.0)
            .bind(release.recheck_after.map(ms))
            .bind(release.error.as_deref())
            .bind(release.actor.as_str())
            .bind(&release.reason)
            .execute(&self.pool)
            .await
            .map_err(db)?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(self.lease_lost_or_missing(id, token).await)
        }
    }

    #[instrument(name = "idemflow.extend", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key), err)]
    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        let exp: Option<DateTime<Utc>> = sqlx::query_scalar(sql::EXTEND)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .bind(token.0)
            .bind(ms(lease))
            .fetch_optional(&self.pool)
            .await
            .map_err(db)?;
        match exp {
            Some(exp) => Ok(exp),
            None => Err(self.lease_lost_or_missing(id, token).await),
        }
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.read_with_now(id).await?.map(|(r, _)| r))
    }

    async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError> {
        let rows = sqlx::query(sql::HISTORY)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(db)?;
        rows.iter()
            .map(|row| {
                RawEvent {
                    seq: row.try_get("id").map_err(db)?,
                    from_state: row.try_get("from_state").map_err(db)?,
                    from_retryable: row.try_get("from_retryable").map_err(db)?,
                    to_state: row.try_get("to_state").map_err(db)?,
                    to_retryable: row.try_get("to_retryable").map_err(db)?,
                    lease_token: row.try_get("lease_token").map_err(db)?,
                    actor: row.try_get("actor").map_err(db)?,
                    reason: row.try_get("reason").map_err(db)?,
                    at: row.try_get("at").map_err(db)?,
                }
                .into_event(BACKEND)
            })
            .collect()
    }

    #[instrument(name = "idemflow.take_stale", skip_all, fields(backend = BACKEND, owner = %take.owner, limit = take.limit), err)]
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        let rows = sqlx::query(sql::TAKE_STALE)
            .bind(&take.owner)
            .bind(ms(take.lease))
            .bind(i64::from(take.limit))
            .fetch_all(&self.pool)
            .await
            .map_err(db)?;
        rows.iter().map(record).collect()
    }

    #[instrument(name = "idemflow.purge", skip(self), fields(backend = BACKEND), err)]
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(sql::PURGE)
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await
            .map_err(db)?;
        Ok(done.rows_affected())
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let row = sqlx::query(sql::STATS)
            .fetch_one(&self.pool)
            .await
            .map_err(db)?;
        Ok(Stats {
            processing: row.try_get(0).map_err(db)?,
            stale: row.try_get(1).map_err(db)?,
            done: row.try_get(2).map_err(db)?,
            failed_retryable: row.try_get(3).map_err(db)?,
            failed_permanent: row.try_get(4).map_err(db)?,
            oldest_processing_created_at: row.try_get(5).map_err(db)?,
            now: row.try_get(6).map_err(db)?,
        })
    }

    async fn stuck(&self, older_than: Duration, limit: u32) -> Result<Stuck, StoreError> {
        let count: i64 = sqlx::query_scalar(sql::STUCK_COUNT)
            .bind(ms(older_than))
            .fetch_one(&self.pool)
            .await
            .map_err(db)?;
        let rows = sqlx::query(sql::STUCK_LIST)
            .bind(ms(older_than))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(db)?;
        Ok(Stuck {
            count,
            oldest: rows.iter().map(record).collect::<Result<_, _>>()?,
        })
    }

    async fn count_expired(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(sql::COUNT_EXPIRED)
            .fetch_one(&self.pool)
            .await
            .map_err(db)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
