//! The PostgreSQL store (feature `postgres`): many app instances, workers and sweepers on one
//! database, coordinated by row locks, `ON CONFLICT` and `FOR UPDATE SKIP LOCKED`.
//!
//! - A claim is one plain statement (`INSERT .. ON CONFLICT DO NOTHING` and a primary-key
//!   read): a new key and a replay are one round trip each, and a replay takes no lock and
//!   writes nothing. A claim of a key this store has seen (a bounded set of hashes, only a
//!   hint) is a plain primary-key read first, which settles a replay alone. A reclaim or a
//!   takeover is one more (`sql::RECLAIM`). A finish is one more: a new key is two statements
//!   in all. No function runs on that path, and one trigger is only looked at: its `WHEN`
//!   condition is false unless a duplicate waits on the key (`announce_end`; the trigger then
//!   sends `NOTIFY idemflow_key_ends` when the attempt ends, see `docs/http.md`).
//! - Every time is the server's `statement_timestamp()`; the application hosts' clocks are
//!   never used.
//! - A key's history is in its row (`history`, one entry per transition, appended by the
//!   statement that makes the transition); a purge moves it into `idempotency_key_tombstones`.
//! - Tables live in the first schema of the connection's `search_path`; idemflow's migrations
//!   are recorded in [`MIGRATIONS_TABLE`], never in the host app's `_sqlx_migrations`.
//!
//! Run it at the default `READ COMMITTED` isolation (the claim relies on `ON CONFLICT` judging
//! the latest committed row).

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::Row;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use tracing::instrument;

use super::kit::{check_finish, claimable, fenced_write, millis, refused_write};
use super::pool::PoolOptions;
use super::rows::{SqlRow, decode_lease, decode_record};
use super::sql_core::{self, SqlCore, sql_operator_store};
use super::warm::{Warm, WarmConn};
use super::{ClaimOutcome, Finish, FinishMode, NewClaim, Release, Store, SweeperStore, TakeStale};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::{KeyRecord, LeaseToken};
use crate::store::known_keys::{self, KnownKeys};

mod atomic;
pub(super) mod sql;

const BACKEND: &str = "postgres";

/// The table that records which of idemflow's migrations ran; the host app's own sqlx migrations
/// table is never touched.
pub const MIGRATIONS_TABLE: &str = "_idemflow_migrations";

/// The sweeper's statement (stale keys picked with `FOR UPDATE SKIP LOCKED`, then fenced), for
/// `EXPLAIN` checks. Parameters: `$1` owner, `$2` lease in ms, `$3` batch limit.
pub const TAKE_STALE_SQL: &str = sql::TAKE_STALE;

fn ms(d: Duration) -> i64 {
    millis(d)
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
    /// Connections kept between back-to-back reads of a key (`store::warm`).
    warm: Warm<sqlx::Postgres>,
    /// Keys this store has seen exist: their claims read first (a replay is one plain
    /// primary-key read); any other claim runs the claim statement first.
    known: KnownKeys,
    /// The ends of announced keys, heard on `idemflow_key_ends` (shared by the clones).
    ends: std::sync::Arc<crate::store::ends::EndFeed>,
}

impl PostgresStore {
    /// This store's identity, shared by its clones (`store::phase::StoreId`).
    pub(crate) fn store_id(&self) -> crate::store::phase::StoreId {
        crate::store::phase::StoreId(self.known.identity())
    }

    /// The reads written once for the SQL stores (`store::sql_core`).
    fn core(&self) -> SqlCore<'_, sqlx::Postgres> {
        SqlCore {
            backend: BACKEND,
            pool: &self.pool,
            sql: &sql::READS,
            duration: millis,
            error: super::pool::pool_error,
        }
    }

    /// Connects a pool with the default [`PoolOptions`] (16 connections at most, callers
    /// beyond that wait up to 5 s for a connection) to `url`.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, PoolOptions::default()).await
    }

    /// Connects a pool sized by `options` to `url`.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemflow::StoreError> {
    /// use std::time::Duration;
    /// use idemflow::store::{PoolOptions, postgres::PostgresStore};
    /// let store = PostgresStore::connect_with(
    ///     "postgres://app@db.internal/app",
    ///     PoolOptions::default()
    ///         .max_connections(64)
    ///         .acquire_timeout(Duration::from_secs(2)),
    /// )
    /// .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect_with(url: &str, options: PoolOptions) -> Result<Self, StoreError> {
        let pool = super::pool::connect(BACKEND, "PostgreSQL", url, &options).await?;
        Ok(Self::from_pool(pool))
    }

    /// Uses a pool you manage (its `search_path` decides the schema).
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            warm: Warm::new(pool.clone(), true),
            pool,
            known: KnownKeys::new(known_keys::DEFAULT_SLOTS),
            ends: std::sync::Arc::default(),
        }
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        super::pool::pool_error(BACKEND, &self.pool, e)
    }

    /// A pinged connection for one write (`store::warm`, `Warm::for_write`): `keep()` it once
    /// the write ran to its end; dropped, it goes back to the pool.
    async fn write_conn(&self) -> Result<WarmConn<sqlx::Postgres>, StoreError> {
        self.warm.for_write().await.map_err(|e| self.err(e))
    }

    /// The pool (for tests and tools that need raw access).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn read_with_now(
        &self,
        id: &KeyId,
    ) -> Result<Option<(KeyRecord, DateTime<Utc>)>, StoreError> {
        // A replay's one statement, on a connection kept from the last read (`store::warm`).
        let row = self
            .warm
            .read_key(sql::GET, id)
            .await
            .map_err(|e| self.err(e))?;
        match row {
            None => Ok(None),
            Some(row) => Ok(Some((decode_record(&row)?, row.time_at("db_now")?))),
        }
    }
}

/// The finish statement of `id` (in `mode`), for the pool or an atomic phase's transaction.
fn finish_query<'q>(
    id: &KeyId,
    mode: FinishMode,
    finish: &Finish,
) -> sql_core::Statement<'q, sqlx::Postgres> {
    sql_core::bind_finish(sqlx::query(sql::FINISH), id, mode, finish)
}

/// The claim on one connection (the pool's, or an atomic phase's transaction): the insert of a
/// new key and the row as it is, in one statement; when that row is claimable, the reclaim.
pub(super) async fn claim_on(
    conn: &mut PgConnection,
    claim: &NewClaim,
) -> Result<ClaimOutcome, StoreError> {
    for _ in 0..3 {
        let row = sql_core::bind_claim(sqlx::query(sql::CLAIM), claim, ms, None)
            .fetch_optional(&mut *conn)
            .await
            .map_err(db)?;
        let row = match row {
            Some(row) => row,
            // A concurrent claimer committed the key after this statement's snapshot: the
            // row is there now.
            None => match read_on(&mut *conn, &claim.id).await? {
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
        let row = if claimed {
            row
        } else {
            let (record, now) = (decode_record(&row)?, row.time_at("db_now")?);
            if !claimable(claim, &record, now) {
                return Ok(ClaimOutcome::Existing {
                    record: Box::new(record),
                    now,
                });
            }
            let reclaim = sql_core::bind_claim(sqlx::query(sql::RECLAIM), claim, ms, None)
                .bind(record.state.as_str());
            match reclaim.fetch_optional(&mut *conn).await.map_err(db)? {
                Some(row) => row,
                // The row changed since it was read: claim again.
                None => continue,
            }
        };
        let lease = decode_lease(&row)?;
        tracing::debug!(transition = ?lease.transition, "key claimed");
        return Ok(ClaimOutcome::Claimed(lease));
    }
    Err(StoreError::Corrupt {
        backend: BACKEND,
        detail: format!("claim of {} neither inserted nor found a row", claim.id),
    })
}

/// A key's row and the database's time, read on `conn`.
async fn read_on(
    conn: &mut PgConnection,
    id: &KeyId,
) -> Result<Option<(KeyRecord, DateTime<Utc>)>, StoreError> {
    let row = sqlx::query(sql::GET)
        .bind(id.scope.as_str())
        .bind(id.key.as_str())
        .fetch_optional(conn)
        .await
        .map_err(db)?;
    row.map(|row| Ok((decode_record(&row)?, row.time_at("db_now")?)))
        .transpose()
}

impl SqlRow for PgRow {
    const BACKEND: &'static str = BACKEND;

    fn time(&self, col: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.try_get(col).map_err(db)
    }

    fn text(&self, col: &str) -> Result<Option<String>, StoreError> {
        self.try_get(col).map_err(db)
    }
}

#[async_trait]
impl Store for PostgresStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn phase_store(&self) -> Option<crate::store::phase::StoreId> {
        Some(self.store_id())
    }

    #[instrument(skip(self), err)]
    async fn migrate(&self) -> Result<(), StoreError> {
        sql_core::migrate(BACKEND, &self.pool, migrator()).await
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        sqlx::query_scalar(sql::NOW)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.err(e))
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        crate::store::spans::traced(crate::store::spans::claim(BACKEND, claim), async move {
            // A key seen before is most likely there: a plain read settles a replay or an
            // in-flight duplicate (the claim statements decide everything else, atomically).
            if self.known.contains(known_keys::of(&claim.id))
                && let Some((record, now)) = self.read_with_now(&claim.id).await?
                && !claimable(claim, &record, now)
            {
                return Ok(ClaimOutcome::Existing {
                    record: Box::new(record),
                    now,
                });
            }
            self.known.insert(known_keys::of(&claim.id));
            let mut conn = self.write_conn().await?;
            let outcome = claim_on(&mut conn, claim).await?;
            conn.keep_write();
            Ok(outcome)
        })
        .await
    }

    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        crate::store::spans::traced(
            crate::store::spans::finish(BACKEND, id, finish),
            async move {
                check_finish(mode, finish.to)?;
                let mut conn = self.write_conn().await?;
                let row = finish_query(id, mode, finish)
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(|e| self.err(e))?;
                conn.keep_write();
                match row {
                    Some(row) => decode_record(&row),
                    None => Err(refused_write(self, id, mode.presented()).await),
                }
            },
        )
        .await
    }

    async fn release(
        &self,
        id: &KeyId,
        token: LeaseToken,
        release: &Release,
    ) -> Result<(), StoreError> {
        crate::store::spans::traced(
            crate::store::spans::release(BACKEND, id, release),
            async move {
                let mut conn = self.write_conn().await?;
                let done = sqlx::query(sql::RELEASE)
                    .bind(id.scope.as_str())
                    .bind(id.key.as_str())
                    .bind(token.0)
                    .bind(release.recheck_after.map(ms))
                    .bind(release.error.as_deref())
                    .bind(release.actor.as_str())
                    .bind(&release.reason)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| self.err(e))?;
                conn.keep_write();
                fenced_write(self, id, token, done.rows_affected()).await
            },
        )
        .await
    }

    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        crate::store::spans::traced(crate::store::spans::mark_attempt(BACKEND, id), async move {
            let mut conn = self.write_conn().await?;
            let done = sql_core::bind_fence(sqlx::query(sql::MARK_ATTEMPT), id, token)
                .execute(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
            conn.keep_write();
            fenced_write(self, id, token, done.rows_affected()).await
        })
        .await
    }

    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        crate::store::spans::traced(crate::store::spans::extend(BACKEND, id), async move {
            let mut conn = self.write_conn().await?;
            let exp: Option<DateTime<Utc>> = sqlx::query_scalar(sql::EXTEND)
                .bind(id.scope.as_str())
                .bind(id.key.as_str())
                .bind(token.0)
                .bind(ms(lease))
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
            conn.keep_write();
            match exp {
                Some(exp) => Ok(exp),
                None => Err(refused_write(self, id, Some(token)).await),
            }
        })
        .await
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.read_with_now(id).await?.map(|(r, _)| r))
    }

    /// Sets `waiters` on the key while it is processing: the write that ends its attempt then
    /// NOTIFYs `idemflow_key_ends` (the trigger of migration `announce_ends`).
    async fn announce_end(&self, id: &KeyId) -> Result<bool, StoreError> {
        let mut conn = self.write_conn().await?;
        sqlx::query(sql::ANNOUNCE_END)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .execute(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        conn.keep_write();
        Ok(true)
    }

    /// LISTENs on `idemflow_key_ends` through a connection of its own (opened with the pool's
    /// options, outside the pool), from the first call until the store is dropped.
    fn key_ends(&self) -> Option<tokio::sync::broadcast::Receiver<crate::store::KeyEnd>> {
        let options = (*self.pool.connect_options()).clone();
        Some(self.ends.subscribe(move |tx| listen(options, tx)))
    }
}

/// The channel the ends of announced keys are published on (migration `announce_ends`).
const ENDS_CHANNEL: &str = "idemflow_key_ends";

/// Forwards the ends announced on [`ENDS_CHANNEL`] to `tx` while anyone subscribes, through a
/// one-connection pool of its own; a lost or failed connection is a [`KeyEnd::Gap`] and is
/// opened again after a pause.
///
/// [`KeyEnd::Gap`]: crate::store::KeyEnd::Gap
async fn listen(
    options: sqlx::postgres::PgConnectOptions,
    tx: tokio::sync::broadcast::Sender<crate::store::KeyEnd>,
) {
    use crate::store::KeyEnd;
    // A short acquire timeout: a server that is gone is reported (a `Gap`) and tried again
    // every second or so, not after the pool's default 30 s.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options);
    while tx.receiver_count() > 0 {
        let connected = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
            // A lost connection is reported at once (`Ok(None)`), then opened again here.
            listener.eager_reconnect(false);
            listener.listen(ENDS_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        }
        .await;
        let mut listener = match connected {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "idemflow: cannot LISTEN for key ends; waiters poll");
                let _ = tx.send(KeyEnd::Gap);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        // Anything announced before the LISTEN took effect was missed.
        let _ = tx.send(KeyEnd::Gap);
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) => {
                    if let Some(id) = crate::store::ends::parse(n.payload()) {
                        // No receiver left: nobody waits; the next subscriber starts again.
                        if tx.send(KeyEnd::Ended(id)).is_err() {
                            return;
                        }
                    }
                }
                Ok(None) | Err(_) => {
                    let _ = tx.send(KeyEnd::Gap);
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[async_trait]
impl SweeperStore for PostgresStore {
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        crate::store::spans::traced(crate::store::spans::take_stale(BACKEND, take), async move {
            let mut conn = self.write_conn().await?;
            let rows = sqlx::query(sql::TAKE_STALE)
                .bind(&take.owner)
                .bind(ms(take.lease))
                .bind(i64::from(take.limit))
                .bind(take.scope.as_deref())
                .fetch_all(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
            conn.keep_write();
            rows.iter().map(decode_record).collect()
        })
        .await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        crate::store::spans::traced(crate::store::spans::purge(BACKEND, batch), async move {
            let mut conn = self.write_conn().await?;
            let done = sqlx::query(sql::PURGE)
                .bind(i64::from(batch))
                .execute(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
            conn.keep_write();
            Ok(done.rows_affected())
        })
        .await
    }

    async fn count_expired(&self) -> Result<u64, StoreError> {
        self.core().count_expired().await
    }
}

sql_operator_store!(PostgresStore);
