//! The SQLite store (feature `sqlite`, on by default): embedded, works on a fresh machine.
//!
//! File databases use WAL with `synchronous=FULL` by default (a claim must survive power loss)
//! and a busy timeout. Writes go through **one writer task** that owns the writer connection and
//! commits the writes of concurrent callers together (group commit: one transaction and one
//! `fsync` per batch, each caller answered only once its write is committed; see the `writer`
//! module). Reads go through a small pool of reader connections. `sqlite::memory:` databases use
//! a single connection that is never recycled (each SQLite connection to `:memory:` is its own
//! database), written through the same writer task.
//!
//! A claim is one statement for a new key (an `INSERT .. ON CONFLICT DO UPDATE .. RETURNING`
//! on the writer; a second one, a read on the same connection, only when the key exists and is
//! not claimable), and a finish is one statement: two per new key. A claim of a key this store
//! has seen before (kept as a bounded set of hashes, only a hint) reads first on a reader, so a
//! replay is one read that never queues behind the writer.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{ConnectOptions, Row};
use tracing::instrument;

use super::kit::{check_finish, claimable, fenced_write, millis, refused_write};
use super::rows::{SqlRow, decode_lease, decode_record, ms_to_time};
use super::sql_core::{self, SqlCore, sql_operator_store};
use super::{ClaimOutcome, Finish, FinishMode, NewClaim, Release, Store, SweeperStore, TakeStale};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::{KeyRecord, LeaseToken};
use crate::setters::setters;
use crate::store::known_keys::{self, KnownKeys};

mod atomic;
pub(super) mod sql;
mod writer;

pub use writer::{BatchFailed, BoxFut, JobAborted, WriterStats};
use writer::{Writer, job};

const BACKEND: &str = "sqlite";

/// The table that records which of idemflow's migrations ran; the host app's own sqlx migrations
/// table is never touched.
pub const MIGRATIONS_TABLE: &str = "_idemflow_migrations";

/// idemflow's SQLite migrations, recorded in [`MIGRATIONS_TABLE`].
pub fn migrator() -> Migrator {
    let mut m = sqlx::migrate!("./migrations/sqlite");
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}

fn db(e: sqlx::Error) -> StoreError {
    StoreError::database(BACKEND, e)
}

/// The default of [`SqliteConfig::phase_timeout`], as long as the default busy timeout (how long
/// another process's writes wait for the lock a phase holds).
use crate::store::phase::DEFAULT_PHASE_TIMEOUT;

/// Options for [`SqliteStore::connect_with`]. Its `Debug` shows the URL as
/// [`redact_url`](crate::store::connect_error::redact_url) does.
#[derive(Clone)]
pub struct SqliteConfig {
    /// `sqlite://path/to/file.db`, `sqlite:file.db` or `sqlite::memory:`.
    pub url: String,
    /// Durability of commits on file databases. Default `Full`: a claim survives power loss.
    pub synchronous: SqliteSynchronous,
    /// How long a connection waits for another process's write lock.
    pub busy_timeout: Duration,
    /// Reader connections for file databases (writes always use one connection).
    pub readers: u32,
    /// How long an atomic phase's writes may run on the writer connection before they are cut
    /// off and rolled back: every other write of the store waits while a phase runs.
    pub phase_timeout: Duration,
}

impl std::fmt::Debug for SqliteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            url,
            synchronous,
            busy_timeout,
            readers,
            phase_timeout,
        } = self;
        f.debug_struct("SqliteConfig")
            .field("url", &crate::store::connect_error::RedactedUrl(url))
            .field("synchronous", synchronous)
            .field("busy_timeout", busy_timeout)
            .field("readers", readers)
            .field("phase_timeout", phase_timeout)
            .finish()
    }
}

impl SqliteConfig {
    /// Defaults for `url`: WAL, `synchronous=FULL`, 5 s busy timeout, 4 readers, 5 s phase
    /// timeout.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            synchronous: SqliteSynchronous::Full,
            busy_timeout: Duration::from_secs(5),
            readers: 4,
            phase_timeout: DEFAULT_PHASE_TIMEOUT,
        }
    }

    setters! {
        /// Sets how long an atomic phase's writes may hold the writer
        /// ([`SqliteConfig::phase_timeout`]).
        phase_timeout(phase_timeout: Duration);

        /// Sets the `synchronous` pragma (for example `Normal` when losing the last commits on power
        /// loss is acceptable).
        synchronous(synchronous: SqliteSynchronous);

        /// Sets the busy timeout (at most `i32::MAX` milliseconds, about 24.8 days: SQLite's
        /// limit; a longer one is refused with [`StoreError::Config`] when the store connects).
        busy_timeout(busy_timeout: Duration);
    }

    /// Sets the number of reader connections (at least 1, at most [`MAX_READERS`]: a larger
    /// number is refused with [`StoreError::Config`] when the store connects).
    pub fn readers(mut self, readers: u32) -> Self {
        self.readers = readers.max(1);
        self
    }
}

/// The largest [`SqliteConfig::readers`]: each reader is a connection with a thread of its own,
/// and the pool sets aside room for every one it may open.
pub const MAX_READERS: u32 = 1_024;

/// A [`Store`] on SQLite.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemflow::StoreError> {
/// use idemflow::{Store, store::sqlite::SqliteStore};
/// let store = SqliteStore::connect("sqlite::memory:").await?;
/// store.migrate().await?;
/// assert_eq!(store.backend(), "sqlite");
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteStore {
    /// The writer task (group commit), which takes its connection from `writer_pool`.
    writer: Writer,
    writer_pool: SqlitePool,
    reader: SqlitePool,
    /// Keys this store has claimed, finished or found: their claims read first.
    seen: KnownKeys,
    /// For `sqlite::memory:`: one more connection to the same database, never used, so the
    /// database outlives its pooled connection (see [`MemoryKeeper`]).
    _keeper: Option<MemoryKeeper>,
}

/// Keeps an in-memory database alive. sqlx names each `sqlite::memory:` database and opens it
/// in shared-cache mode; such a database is dropped when its last connection closes, and sqlx
/// closes a pooled connection whose command was cancelled halfway (a dropped future: a client
/// that disconnected, a lease renewal stopped with its operation). Without a second connection
/// the pool then reopened a fresh, empty database. This one runs no command, so nothing
/// cancels it, and it closes with the last clone of the store.
#[derive(Clone)]
struct MemoryKeeper(#[allow(dead_code)] Arc<tokio::sync::Mutex<SqliteConnection>>);

impl std::fmt::Debug for MemoryKeeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MemoryKeeper")
    }
}

fn is_memory(url: &str) -> bool {
    url.contains(":memory:") || url.contains("mode=memory")
}

impl SqliteStore {
    /// This store's identity, shared by its clones (`store::phase::StoreId`).
    pub(crate) fn store_id(&self) -> crate::store::phase::StoreId {
        crate::store::phase::StoreId(self.seen.identity())
    }

    /// The reads written once for the SQL stores (`store::sql_core`).
    fn core(&self) -> SqlCore<'_, sqlx::Sqlite> {
        SqlCore {
            backend: BACKEND,
            pool: &self.reader,
            sql: &sql::READS,
            duration: millis,
            error: |backend, _, e| StoreError::database(backend, e),
        }
    }

    /// Opens (creating if missing) the database at `url` with the defaults of [`SqliteConfig`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(SqliteConfig::new(url)).await
    }

    /// Opens the database with explicit options.
    pub async fn connect_with(config: SqliteConfig) -> Result<Self, StoreError> {
        // SQLite takes the busy timeout in milliseconds as a C int.
        if config.busy_timeout.as_millis() > i32::MAX as u128 {
            return Err(StoreError::Config(format!(
                "SqliteConfig::busy_timeout must be at most {:?}, not {:?}",
                Duration::from_millis(i32::MAX as u64),
                config.busy_timeout
            )));
        }
        if config.readers > MAX_READERS {
            return Err(StoreError::Config(format!(
                "SqliteConfig::readers must be at most {MAX_READERS}, not {}",
                config.readers
            )));
        }
        if !config.url.starts_with("sqlite:") {
            return Err(StoreError::Config(format!(
                "{:?} is not a SQLite URL (expected sqlite://path, sqlite:path or sqlite::memory:)",
                crate::store::connect_error::redact_url(&config.url)
            )));
        }
        let base = SqliteConnectOptions::from_str(&config.url)
            .map_err(|e| {
                StoreError::Config(format!(
                    "bad SQLite URL {:?}: {e}",
                    crate::store::connect_error::redact_url(&config.url)
                ))
            })?
            .busy_timeout(config.busy_timeout)
            .foreign_keys(true);
        if is_memory(&config.url) {
            // First, so the database exists as long as the store does.
            let keeper = base.connect().await.map_err(db)?;
            let pool = SqlitePoolOptions::new()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .test_before_acquire(false)
                .connect_with(base)
                .await
                .map_err(db)?;
            let mut store = Self::with_pools(pool.clone(), pool, config.phase_timeout);
            store._keeper = Some(MemoryKeeper(Arc::new(tokio::sync::Mutex::new(keeper))));
            return Ok(store);
        }
        let file = base
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(config.synchronous);
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_with(file.clone())
            .await
            .map_err(db)?;
        // No ping before each read: a local file connection has no network to lose, and the
        // ping is a round trip to the connection's thread, as long as the read itself.
        let reader = SqlitePoolOptions::new()
            .max_connections(config.readers.max(1))
            .test_before_acquire(false)
            .connect_with(file.read_only(true))
            .await
            .map_err(db)?;
        Ok(Self::with_pools(writer, reader, config.phase_timeout))
    }

    /// Uses pools you manage: `writer` should have one connection, `reader` may have several
    /// (pass the same pool twice for a single pool). The store's writer task starts with its
    /// first write, on that write's tokio runtime, and takes a connection from `writer` for each
    /// batch of writes.
    /// Atomic phases get [`DEFAULT_PHASE_TIMEOUT`].
    pub fn from_pools(writer: SqlitePool, reader: SqlitePool) -> Self {
        Self::with_pools(writer, reader, DEFAULT_PHASE_TIMEOUT)
    }

    fn with_pools(writer: SqlitePool, reader: SqlitePool, phase_timeout: Duration) -> Self {
        Self {
            writer: Writer::new(writer.clone(), phase_timeout),
            writer_pool: writer,
            reader,
            seen: KnownKeys::new(known_keys::DEFAULT_SLOTS),
            _keeper: None,
        }
    }

    /// The writer pool (for tests and tools that need raw access). Its connection is shared
    /// with the writer task, which keeps it while writes keep coming and gives it back after
    /// 1 ms without one or 20 ms of holding it (`docs/backends.md`, "Group commit").
    pub fn writer_pool(&self) -> &SqlitePool {
        &self.writer_pool
    }

    /// What the writer task has done so far: commits, the writes they carried, writes queued.
    pub fn writer_stats(&self) -> WriterStats {
        self.writer.stats()
    }

    /// Runs `f` on the writer connection as a job of the group-committing writer, batched with
    /// concurrent writes and answered once committed, as the store's own writes are. `f` must
    /// write with at most one statement (reads around it are free): a lone job runs in autocommit
    /// mode. It may run more than once if its batch is rolled back for another job's error.
    /// For tests and tools.
    #[doc(hidden)]
    pub async fn write_job<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'c> Fn(&'c mut SqliteConnection) -> BoxFut<'c, Result<T, StoreError>>
            + Send
            + 'static,
    {
        self.writer.call(f).await
    }

    /// A key's row and the database's time, read on a reader by `statement`: `sql::GET`, or
    /// `sql::CLAIM_READ` for the claim's read (without the stored request).
    async fn read_with_now(
        &self,
        statement: &'static str,
        id: &KeyId,
    ) -> Result<Option<(KeyRecord, DateTime<Utc>)>, StoreError> {
        let row = sqlx::query(statement)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .fetch_optional(&self.reader)
            .await
            .map_err(db)?;
        row.as_ref().map(decode_with_now).transpose()
    }

    /// The claim's write, on the writer: the upsert, and when it changed nothing, the row as it
    /// is (read on the writer connection, inside the same batch).
    async fn claim_write(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        let claim = Arc::new(claim.clone());
        self.writer
            .call(job(move |conn| {
                let claim = claim.clone();
                Box::pin(async move { claim_on(conn, &claim).await })
            }))
            .await
    }

    /// Runs a fenced `UPDATE` (bound to scope, key, token and `extra`) on the writer; returns
    /// the rows it changed.
    async fn write_execute(
        &self,
        statement: &'static str,
        id: &KeyId,
        token: LeaseToken,
        extra: Vec<Bind>,
    ) -> Result<u64, StoreError> {
        let (scope, key) = (id.scope.as_str().to_owned(), id.key.as_str().to_owned());
        self.writer
            .call(job(move |conn| {
                let mut q = sqlx::query(statement)
                    .bind(scope.clone())
                    .bind(key.clone())
                    .bind(token.0);
                for b in &extra {
                    q = b.bind_to(q);
                }
                Box::pin(
                    async move { Ok(q.execute(&mut *conn).await.map_err(db)?.rows_affected()) },
                )
            }))
            .await
    }
}

/// An owned bind value for statements built inside writer jobs.
#[derive(Debug, Clone)]
enum Bind {
    Int(Option<i64>),
    Text(Option<String>),
}

impl Bind {
    fn bind_to<'q>(
        &self,
        q: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments> {
        match self {
            Bind::Int(v) => q.bind(*v),
            Bind::Text(v) => q.bind(v.clone()),
        }
    }
}

/// Runs a write that returns at most one row (`.. RETURNING`) to its end, on the writer
/// connection.
///
/// `fetch_optional` stops after the first row; SQLite then commits an autocommit statement in
/// its reset, and a commit made there skips the WAL hook, which is what runs the automatic
/// checkpoint. With every lone write made that way, the WAL was never checkpointed while the
/// store was open: it grew by ~30 KB per key without bound, and each commit's `fsync` appended
/// to it instead of rewriting its start (`docs/performance.md`, "Why the gaps", "SQLite").
/// Stepping the statement to its end commits where the hook runs.
async fn write_returning<'q>(
    q: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
    conn: &mut SqliteConnection,
) -> Result<Option<SqliteRow>, StoreError> {
    Ok(q.fetch_all(&mut *conn)
        .await
        .map_err(db)?
        .into_iter()
        .next())
}

fn decode_with_now(row: &SqliteRow) -> Result<(KeyRecord, DateTime<Utc>), StoreError> {
    Ok((decode_record(row)?, row.time_at("db_now")?))
}

/// The claim on one connection: the insert of a new key; when the key is there, its row as it
/// is, and when that row is claimable, the reclaim (at most one of the two writes changes
/// anything). In a batch they run in one transaction; a lone job runs them in autocommit mode,
/// where another process may change or purge the row in between, hence the retries.
async fn claim_on(
    conn: &mut SqliteConnection,
    claim: &NewClaim,
) -> Result<ClaimOutcome, StoreError> {
    for _ in 0..3 {
        let row = write_returning(
            sql_core::bind_claim(sqlx::query(sql::CLAIM), claim, millis, None),
            conn,
        )
        .await?;
        if let Some(row) = row {
            return claimed(&row);
        }
        let row = sqlx::query(sql::CLAIM_READ)
            .bind(claim.id.scope.as_str())
            .bind(claim.id.key.as_str())
            .fetch_optional(&mut *conn)
            .await
            .map_err(db)?;
        // The row vanished between the insert and the read (purged): try again.
        let Some(row) = row else { continue };
        let (record, now) = decode_with_now(&row)?;
        if !claimable(claim, &record, now) {
            return Ok(ClaimOutcome::Existing {
                record: Box::new(record),
                now,
            });
        }
        let row = write_returning(
            sql_core::bind_claim(sqlx::query(sql::RECLAIM), claim, millis, None)
                .bind(record.state.as_str()),
            conn,
        )
        .await?;
        if let Some(row) = row {
            return claimed(&row);
        }
        // The row changed since it was read (another process): try again.
    }
    Err(StoreError::Corrupt {
        backend: BACKEND,
        detail: format!("claim of {} neither inserted nor found a row", claim.id),
    })
}

fn claimed(row: &SqliteRow) -> Result<ClaimOutcome, StoreError> {
    let lease = decode_lease(row)?;
    tracing::debug!(transition = ?lease.transition, "key claimed");
    Ok(ClaimOutcome::Claimed(lease))
}

impl SqlRow for SqliteRow {
    const BACKEND: &'static str = BACKEND;

    fn time(&self, col: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.try_get::<Option<i64>, _>(col)
            .map_err(db)?
            .map(|ms| ms_to_time(BACKEND, ms))
            .transpose()
    }

    fn text(&self, col: &str) -> Result<Option<String>, StoreError> {
        self.try_get(col).map_err(db)
    }
}

/// How many times [`SqliteStore::migrate`] runs the migrations before it gives up.
const MIGRATE_ATTEMPTS: u32 = 10;

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn phase_store(&self) -> Option<crate::store::phase::StoreId> {
        Some(self.store_id())
    }

    #[instrument(skip(self), err)]
    /// SQLite has no lock for migrations across connections (sqlx's is a no-op there), so
    /// stores that migrate one file at once (workers starting together) race: each reads the
    /// migrations applied so far and runs the first one missing, and all but one fail. Each
    /// migration runs in a transaction of its own, so a failed one left nothing: the migration
    /// is run again, up to 10 times, and skips what the others applied.
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut attempt = 1;
        loop {
            match sql_core::migrate(BACKEND, &self.writer_pool, migrator()).await {
                Err(e) if attempt < MIGRATE_ATTEMPTS => {
                    tracing::debug!(error = %e, attempt, "sqlite migration failed; running it again");
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
                    attempt += 1;
                }
                done => return done,
            }
        }
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        let ms: i64 = sqlx::query_scalar(sql::NOW)
            .fetch_one(&self.reader)
            .await
            .map_err(db)?;
        ms_to_time(BACKEND, ms)
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        crate::store::spans::traced(crate::store::spans::claim(BACKEND, claim), async move {
            // A key seen before is most likely there: read first, on a reader, so replays and
            // in-flight duplicates never queue behind the writer. Any other key: write first.
            if self.seen.contains(known_keys::of(&claim.id))
                && let Some((record, now)) = self.read_with_now(sql::CLAIM_READ, &claim.id).await?
                && !claimable(claim, &record, now)
            {
                return Ok(ClaimOutcome::Existing {
                    record: Box::new(record),
                    now,
                });
            }
            let outcome = self.claim_write(claim).await?;
            self.seen.insert(known_keys::of(&claim.id));
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
                let (key, finish_data) = (id.clone(), Arc::new(finish.clone()));
                let row = self
                    .writer
                    .call(job(move |conn| {
                        let (id, finish) = (key.clone(), finish_data.clone());
                        Box::pin(async move {
                            write_returning(
                                sql_core::bind_finish(sqlx::query(sql::FINISH), &id, mode, &finish),
                                conn,
                            )
                            .await?
                            .as_ref()
                            .map(decode_record)
                            .transpose()
                        })
                    }))
                    .await?;
                match row {
                    Some(record) => {
                        self.seen.insert(known_keys::of(id));
                        Ok(record)
                    }
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
                let done = self
                    .write_execute(
                        sql::RELEASE,
                        id,
                        token,
                        vec![
                            Bind::Int(release.recheck_after.map(millis)),
                            Bind::Text(release.error.clone()),
                            Bind::Text(Some(release.actor.as_str().to_owned())),
                            Bind::Text(Some(release.reason.clone())),
                        ],
                    )
                    .await?;
                fenced_write(self, id, token, done).await
            },
        )
        .await
    }

    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        crate::store::spans::traced(crate::store::spans::mark_attempt(BACKEND, id), async move {
            let done = self
                .write_execute(sql::MARK_ATTEMPT, id, token, Vec::new())
                .await?;
            fenced_write(self, id, token, done).await
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
            let (scope, key) = (id.scope.as_str().to_owned(), id.key.as_str().to_owned());
            let lease_ms = millis(lease);
            let expires = self
                .writer
                .call(job(move |conn| {
                    let q = sqlx::query(sql::EXTEND)
                        .bind(scope.clone())
                        .bind(key.clone())
                        .bind(token.0)
                        .bind(lease_ms);
                    Box::pin(async move {
                        write_returning(q, conn)
                            .await?
                            .map(|row| row.time_at("lease_expires_at"))
                            .transpose()
                    })
                }))
                .await?;
            match expires {
                Some(at) => Ok(at),
                None => Err(refused_write(self, id, Some(token)).await),
            }
        })
        .await
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.read_with_now(sql::GET, id).await?.map(|(r, _)| r))
    }
}

#[async_trait]
impl SweeperStore for SqliteStore {
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        crate::store::spans::traced(crate::store::spans::take_stale(BACKEND, take), async move {
            let (owner, lease, limit) = (take.owner.clone(), millis(take.lease), take.limit);
            let scope = take.scope.clone();
            self.writer
                .call(job(move |conn| {
                    let q = sqlx::query(sql::TAKE_STALE)
                        .bind(owner.clone())
                        .bind(lease)
                        .bind(i64::from(limit))
                        .bind(scope.clone());
                    Box::pin(async move {
                        let rows = q.fetch_all(&mut *conn).await.map_err(db)?;
                        rows.iter().map(decode_record).collect()
                    })
                }))
                .await
        })
        .await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        crate::store::spans::traced(crate::store::spans::purge(BACKEND, batch), async move {
            self.writer
                .call(job(move |conn| {
                    let q = sqlx::query(sql::PURGE).bind(i64::from(batch));
                    Box::pin(
                        async move { Ok(q.execute(&mut *conn).await.map_err(db)?.rows_affected()) },
                    )
                }))
                .await
        })
        .await
    }

    async fn count_expired(&self) -> Result<u64, StoreError> {
        self.core().count_expired().await
    }
}

sql_operator_store!(SqliteStore);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_the_url_redacted() {
        let config = SqliteConfig::new("sqlite://app.db?mode=rwc&key=s3cret");
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("sqlite://app.db?mode=rwc&key=***"),
            "{shown}"
        );
    }
}
