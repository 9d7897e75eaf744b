//! The MariaDB / MySQL store (feature `mysql`): many app instances, workers and sweepers on one
//! database, coordinated by InnoDB row locks, `ON DUPLICATE KEY UPDATE` and
//! `FOR UPDATE SKIP LOCKED` (MariaDB >= 10.6, tested on 10.11; written to MySQL 8's syntax as
//! well, but not tested on it: `docs/backends.md`, "Versions").
//!
//! - A claim is one round trip, a call of the claim procedure (`procedures/`): a replay is a
//!   primary-key read inside it (no lock, no write); a new key runs one `INSERT .. ON DUPLICATE
//!   KEY UPDATE` that decides atomically, then the read-back (there is no `RETURNING` on MySQL;
//!   a random `claim_nonce` written by the winning claim tells the claimer it won).
//! - A finish and a renewal are one round trip each (procedures that update and read back in
//!   one transaction), so a new key costs two round trips in all.
//! - Every time is the server's `UTC_TIMESTAMP(6)` (independent of the session time zone); the
//!   application hosts' clocks are never used.
//! - History rows are written by triggers keyed on the row's `version`, inside the statement
//!   that makes the transition.
//! - idemflow's migrations are recorded in [`MIGRATIONS_TABLE`], never in the host app's
//!   `_sqlx_migrations`. `Store::migrate` then creates the procedures under versioned names
//!   (`idempotency_keys_claim_v1`, ...): a database that [`migrator`] alone migrated has none.

use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::migrate::Migrator;
use sqlx::mysql::{MySqlPool, MySqlRow};
use sqlx::{AssertSqlSafe, Executor, Row};
use tracing::{Instrument, instrument};

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
mod migrate;
pub(super) mod procedures;
pub(super) mod sql;

const BACKEND: &str = "mysql";

/// The table that records which of idemflow's migrations ran; the host app's own sqlx migrations
/// table is never touched.
pub const MIGRATIONS_TABLE: &str = "_idemflow_migrations";

/// The most keys one sweep or purge batch takes (two placeholders each, well under MySQL's
/// 65,535).
const MAX_BATCH: u32 = 10_000;

/// How often a claim, a `take_stale` or a purge runs when InnoDB keeps choosing it as a deadlock
/// victim.
const LOCK_ATTEMPTS: usize = 5;

fn micros(d: Duration) -> i64 {
    millis(d) * 1000
}

/// idemflow's MariaDB / MySQL migrations (the tables and triggers), recorded in
/// [`MIGRATIONS_TABLE`]. The claim, finish and extend procedures are not among them:
/// [`Store::migrate`] runs these migrations and then creates the procedures.
pub fn migrator() -> Migrator {
    let mut m = sqlx::migrate!("./migrations/mysql");
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}

fn db(e: sqlx::Error) -> StoreError {
    StoreError::database(BACKEND, e)
}

fn corrupt(detail: String) -> StoreError {
    StoreError::Corrupt {
        backend: BACKEND,
        detail,
    }
}

/// Deadlock (1213) or lock wait timeout (1205): the statement was rolled back and may be retried.
fn is_retryable_lock_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => d
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|m| matches!(m.number(), 1213 | 1205)),
        _ => false,
    }
}

/// Whether a store error is a lock conflict the server resolved by rolling the transaction back.
fn is_lock_conflict(e: &StoreError) -> bool {
    match e {
        StoreError::Database { source, .. } => source
            .downcast_ref::<sqlx::Error>()
            .is_some_and(is_retryable_lock_error),
        _ => false,
    }
}

/// A fresh random value for `claim_nonce`.
fn nonce() -> i64 {
    static N: AtomicU64 = AtomicU64::new(0);
    let state = std::collections::hash_map::RandomState::new();
    let h = state.hash_one((
        N.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now(),
        std::process::id(),
    ));
    i64::from_ne_bytes(h.to_ne_bytes())
}

/// A [`Store`] on MariaDB or MySQL (InnoDB).
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemflow::StoreError> {
/// use idemflow::{Store, store::mysql::MySqlStore};
/// let store = MySqlStore::connect("mysql://app@db.internal/app").await?;
/// store.migrate().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    /// Connections kept between back-to-back reads of a key (`store::warm`).
    warm: Warm<sqlx::MySql>,
    /// Keys this store has seen exist: their claims read first (a replay is one plain read,
    /// cheaper than the claim procedure's call); any other claim calls the procedure first.
    known: KnownKeys,
}

impl MySqlStore {
    /// This store's identity, shared by its clones (`store::phase::StoreId`).
    pub(crate) fn store_id(&self) -> crate::store::phase::StoreId {
        crate::store::phase::StoreId(self.known.identity())
    }

    /// The reads written once for the SQL stores (`store::sql_core`).
    fn core(&self) -> SqlCore<'_, sqlx::MySql> {
        SqlCore {
            backend: BACKEND,
            pool: &self.pool,
            sql: &sql::READS,
            duration: micros,
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
    /// use idemflow::store::{PoolOptions, mysql::MySqlStore};
    /// let store = MySqlStore::connect_with(
    ///     "mysql://app@db.internal/app",
    ///     PoolOptions::default()
    ///         .max_connections(64)
    ///         .acquire_timeout(Duration::from_secs(2)),
    /// )
    /// .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect_with(url: &str, options: PoolOptions) -> Result<Self, StoreError> {
        let pool = super::pool::connect(BACKEND, "MySQL", url, &options).await?;
        Ok(Self::from_pool(pool))
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        super::pool::pool_error(BACKEND, &self.pool, e)
    }

    /// A pinged connection for one write (`store::warm`, `Warm::for_write`), dropped at the end
    /// of the write's statement: back to the pool before any read that follows. MariaDB's writes
    /// do not keep theirs (`docs/performance.md`, "Connections and pings": no gain
    /// measured, and a CI run under load failed a `take_stale` with `BeginFailed` while they
    /// did).
    async fn write_conn(&self) -> Result<WarmConn<sqlx::MySql>, StoreError> {
        self.warm.for_write().await.map_err(|e| self.err(e))
    }

    /// Uses a pool you manage.
    pub fn from_pool(pool: MySqlPool) -> Self {
        Self {
            warm: Warm::new(pool.clone(), false),
            pool,
            known: KnownKeys::new(known_keys::DEFAULT_SLOTS),
        }
    }

    /// The pool (for tests and tools that need raw access).
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    async fn read(&self, id: &KeyId) -> Result<Option<MySqlRow>, StoreError> {
        // A replay's one statement, on a connection kept from the last read (`store::warm`).
        self.warm
            .read_key(sql::GET, id)
            .await
            .map_err(|e| self.err(e))
    }

    async fn read_with_now(
        &self,
        id: &KeyId,
    ) -> Result<Option<(KeyRecord, DateTime<Utc>)>, StoreError> {
        match self.read(id).await? {
            None => Ok(None),
            Some(row) => Ok(Some((decode_record(&row)?, row.time_at("db_now")?))),
        }
    }

    /// Calls the claim procedure, retrying deadlock victims (each statement inside it is its own
    /// autocommit transaction, rolled back whole when chosen as a victim). Returns the row.
    async fn claim_call(
        &self,
        claim: &NewClaim,
        nonce: i64,
    ) -> Result<Option<MySqlRow>, StoreError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let res = sql_core::bind_claim(sqlx::query(sql::CLAIM), claim, micros, Some(nonce))
                // All of it: the procedure's result set, then its status.
                .fetch_all(&mut *self.write_conn().await?)
                .await;
            match res {
                Ok(rows) => return Ok(rows.into_iter().next()),
                Err(e) if attempt < LOCK_ATTEMPTS && is_retryable_lock_error(&e) => {
                    tracing::debug!(error = %e, "claim retried after a lock conflict");
                }
                Err(e) => return Err(self.err(e)),
            }
        }
    }

    /// Locks up to `limit` rows picked by `pick` (skipping rows other transactions hold) in a
    /// READ COMMITTED transaction, and hands them to `then` inside it.
    async fn with_picked<T>(
        &self,
        pick: &'static str,
        scope: Option<&str>,
        limit: u32,
        then: impl AsyncFnOnce(
            &mut sqlx::MySqlConnection,
            &[(Vec<u8>, Vec<u8>)],
        ) -> Result<T, StoreError>,
    ) -> Result<Option<T>, StoreError> {
        let mut conn = self.write_conn().await?;
        conn.execute(sql::READ_COMMITTED).await.map_err(db)?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(db)?;
        let picked: Vec<(Vec<u8>, Vec<u8>)> = sqlx::query_as(pick)
            .bind(scope)
            .bind(scope)
            .bind(i64::from(limit.min(MAX_BATCH)))
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
        if picked.is_empty() {
            tx.commit().await.map_err(db)?;
            return Ok(None);
        }
        let out = then(&mut tx, &picked).await?;
        tx.commit().await.map_err(db)?;
        Ok(Some(out))
    }
}

/// Runs the transaction `once` makes again when the server chose it as a deadlock victim (or
/// timed it out on a lock): it was rolled back whole. Claims have always done this; a sweep's
/// `take_stale` and a purge did not, and a sweep stopped on "Deadlock found" while claims and
/// renewals ran on the same keys (found by the simulation).
async fn retry_lock_conflicts<T, Fut>(mut once: impl FnMut() -> Fut) -> Result<T, StoreError>
where
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        match once().await {
            Err(e) if attempt < LOCK_ATTEMPTS && is_lock_conflict(&e) => {
                tracing::debug!(error = %e, "transaction retried after a lock conflict");
            }
            done => return done,
        }
    }
}

/// `prefix` followed by `((?, ?), (?, ?), ..)` for `n` keys. Only placeholders are added, never
/// values.
fn with_in_list(prefix: &str, n: usize) -> AssertSqlSafe<String> {
    let mut sql = String::with_capacity(prefix.len() + 2 + n * 8);
    sql.push_str(prefix);
    sql.push('(');
    for i in 0..n {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push_str("(?, ?)");
    }
    sql.push(')');
    AssertSqlSafe(sql)
}

/// What the claim procedure's row says: the lease when this call's nonce won, else the row
/// that stood in the way; `None` when there was no row (purged between the write and the
/// read: claim again).
fn claim_outcome(row: Option<MySqlRow>, nonce: i64) -> Result<Option<ClaimOutcome>, StoreError> {
    let Some(row) = row else { return Ok(None) };
    let won: Option<i64> = row.try_get("claim_nonce").map_err(db)?;
    if won != Some(nonce) {
        return Ok(Some(ClaimOutcome::Existing {
            record: Box::new(decode_record(&row)?),
            now: row.time_at("db_now")?,
        }));
    }
    let lease = decode_lease(&row)?;
    tracing::debug!(transition = ?lease.transition, "key claimed");
    Ok(Some(ClaimOutcome::Claimed(lease)))
}

/// The claim on an atomic phase's transaction (`READ COMMITTED`, so the procedure's read after
/// a concurrent claim commits sees that claim's row). A lock conflict is returned as it is: it
/// rolled the whole transaction back, and the phase begins again.
pub(super) async fn claim_on(
    conn: &mut sqlx::MySqlConnection,
    claim: &NewClaim,
) -> Result<ClaimOutcome, StoreError> {
    for _ in 0..3 {
        let nonce = nonce();
        let rows = sql_core::bind_claim(sqlx::query(sql::CLAIM), claim, micros, Some(nonce))
            .fetch_all(&mut *conn)
            .await
            .map_err(db)?;
        if let Some(outcome) = claim_outcome(rows.into_iter().next(), nonce)? {
            return Ok(outcome);
        }
    }
    Err(corrupt(format!(
        "claim of {} neither inserted nor found a row",
        claim.id
    )))
}

impl SqlRow for MySqlRow {
    const BACKEND: &'static str = BACKEND;

    fn time(&self, col: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        let t: Option<NaiveDateTime> = self.try_get(col).map_err(db)?;
        Ok(t.map(|t| t.and_utc()))
    }

    fn text(&self, col: &str) -> Result<Option<String>, StoreError> {
        let bytes: Option<Vec<u8>> = self.try_get(col).map_err(db)?;
        bytes
            .map(|b| String::from_utf8(b).map_err(|e| corrupt(format!("{col} is not UTF-8: {e}"))))
            .transpose()
    }
}

/// The transactional writes, run by the `Store` methods of the same name in a task of their own
/// (see [`MySqlStore::detached`]).
impl MySqlStore {
    /// Runs `f` on a clone of the store in a task of its own, so that dropping the caller's
    /// future (a client that disconnected, a renewal stopped with its operation) never cuts a
    /// transaction in half. A `BEGIN` cut off on the wire leaves the pooled connection inside a
    /// transaction sqlx does not know of; the next autocommit write on that connection then
    /// stays uncommitted, invisible and holding its row locks (found by the simulation: every
    /// `take_stale` failed, then the pool ran dry behind the locks).
    async fn detached<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(MySqlStore) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let task = tokio::spawn(f(self.clone()).in_current_span());
        match task.await {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(StoreError::database(
                BACKEND,
                format!("store task ended: {e}"),
            )),
        }
    }

    async fn finish_now(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        check_finish(mode, finish.to)?;
        // The update and the read-back share a transaction inside the procedure, so the row
        // returned is the one written (the update's row lock is held until commit).
        let rows = sql_core::bind_finish(sqlx::query(sql::FINISH), id, mode, finish)
            .fetch_all(&mut *self.write_conn().await?)
            .await
            .map_err(|e| self.err(e))?;
        match rows.first() {
            Some(row) => decode_record(row),
            None => Err(refused_write(self, id, mode.presented()).await),
        }
    }
    async fn extend_now(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        let exp: Option<Option<NaiveDateTime>> = sqlx::query_scalar(sql::EXTEND)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .bind(token.0)
            .bind(micros(lease))
            .fetch_all(&mut *self.write_conn().await?)
            .await
            .map_err(|e| self.err(e))?
            .into_iter()
            .next();
        match exp {
            Some(exp) => exp
                .map(|t| t.and_utc())
                .ok_or_else(|| corrupt(format!("extended key {id} has no lease"))),
            None => Err(refused_write(self, id, Some(token)).await),
        }
    }
    async fn take_stale_once(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        let lease = micros(take.lease);
        let taken = self
            .with_picked(
                sql::PICK_STALE,
                take.scope.as_deref(),
                take.limit,
                async |tx, picked| {
                    let update = with_in_list(sql::TAKE_PICKED, picked.len());
                    let mut update = sqlx::query(update).bind(&take.owner).bind(lease);
                    for (scope, key) in picked {
                        update = update.bind(scope).bind(key);
                    }
                    update.execute(&mut *tx).await.map_err(db)?;
                    let read = with_in_list(sql::READ_PICKED, picked.len());
                    let mut read = sqlx::query(read);
                    for (scope, key) in picked {
                        read = read.bind(scope).bind(key);
                    }
                    let rows = read.fetch_all(&mut *tx).await.map_err(db)?;
                    rows.iter()
                        .map(decode_record)
                        .collect::<Result<Vec<_>, _>>()
                },
            )
            .await?;
        Ok(taken.unwrap_or_default())
    }
    async fn purge_expired_once(&self, batch: u32) -> Result<u64, StoreError> {
        let deleted = self
            .with_picked(sql::PICK_EXPIRED, None, batch, async |tx, picked| {
                let delete = with_in_list(sql::DELETE_PICKED, picked.len());
                let mut delete = sqlx::query(delete);
                for (scope, key) in picked {
                    delete = delete.bind(scope).bind(key);
                }
                let done = delete.execute(&mut *tx).await.map_err(db)?;
                Ok(done.rows_affected())
            })
            .await?;
        Ok(deleted.unwrap_or(0))
    }
}

#[async_trait]
impl Store for MySqlStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn phase_store(&self) -> Option<crate::store::phase::StoreId> {
        Some(self.store_id())
    }

    #[instrument(skip(self), err)]
    async fn migrate(&self) -> Result<(), StoreError> {
        migrate::run(&self.pool).await
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        let t: NaiveDateTime = sqlx::query_scalar(sql::NOW)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(t.and_utc())
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        crate::store::spans::traced(crate::store::spans::claim(BACKEND, claim), async move {
            // A key seen before is most likely there: a plain read settles a replay or an
            // in-flight duplicate (the procedure decides everything else, atomically).
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
            for _ in 0..3 {
                let nonce = nonce();
                let row = self.claim_call(claim, nonce).await?;
                if let Some(outcome) = claim_outcome(row, nonce)? {
                    return Ok(outcome);
                }
            }
            Err(corrupt(format!(
                "claim of {} neither inserted nor found a row",
                claim.id
            )))
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
                let (id, finish) = (id.clone(), finish.clone());
                self.detached(move |s| async move { s.finish_now(&id, mode, &finish).await })
                    .await
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
                let done = sqlx::query(sql::RELEASE)
                    .bind(release.recheck_after.map(micros))
                    .bind(release.error.as_deref())
                    .bind(release.actor.as_str())
                    .bind(&release.reason)
                    .bind(release.actor.as_str())
                    .bind(release.actor.as_str())
                    .bind(id.scope.as_str())
                    .bind(id.key.as_str())
                    .bind(token.0)
                    .execute(&mut *self.write_conn().await?)
                    .await
                    .map_err(|e| self.err(e))?;
                fenced_write(self, id, token, done.rows_affected()).await
            },
        )
        .await
    }

    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        crate::store::spans::traced(crate::store::spans::mark_attempt(BACKEND, id), async move {
            let done = sql_core::bind_fence(sqlx::query(sql::MARK_ATTEMPT), id, token)
                .execute(&mut *self.write_conn().await?)
                .await
                .map_err(|e| self.err(e))?;
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
            let id = id.clone();
            self.detached(move |s| async move { s.extend_now(&id, token, lease).await })
                .await
        })
        .await
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.read_with_now(id).await?.map(|(r, _)| r))
    }
}

#[async_trait]
impl SweeperStore for MySqlStore {
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        crate::store::spans::traced(crate::store::spans::take_stale(BACKEND, take), async move {
            let take = take.clone();
            self.detached(move |s| async move {
                retry_lock_conflicts(|| s.take_stale_once(&take)).await
            })
            .await
        })
        .await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        crate::store::spans::traced(crate::store::spans::purge(BACKEND, batch), async move {
            self.detached(move |s| async move {
                retry_lock_conflicts(|| s.purge_expired_once(batch)).await
            })
            .await
        })
        .await
    }

    async fn count_expired(&self) -> Result<u64, StoreError> {
        self.core().count_expired().await
    }
}

sql_operator_store!(MySqlStore);
