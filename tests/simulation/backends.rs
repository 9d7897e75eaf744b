//! Isolated stores for the schedules (`take_stale` and `purge` are table-wide, so schedules
//! running at once never share one). SQLite in memory and Redis get a fresh store per schedule
//! (cheap: a new in-memory database, a new key prefix). PostgreSQL and MariaDB/MySQL keep a pool
//! of slots, one per schedule running at once: a schema or database created and migrated once per
//! slot, emptied between schedules (both tables deleted, then checked empty), dropped at the end.

use std::sync::{Arc, Mutex};

use idemflow::Store;

#[derive(Debug, Clone)]
pub enum Backend {
    SqliteMemory,
    #[cfg(feature = "postgres")]
    Postgres(String),
    #[cfg(feature = "mysql")]
    MySql(String),
    #[cfg(feature = "redis")]
    Redis(String),
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::SqliteMemory => "sqlite",
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => "postgres",
            #[cfg(feature = "mysql")]
            Backend::MySql(_) => "mysql",
            #[cfg(feature = "redis")]
            Backend::Redis(_) => "redis",
        }
    }

    /// A new migrated, empty store, and what to keep to empty and drop it. `file`: on SQLite, a
    /// database file of its own (in a temporary directory) instead of one in memory.
    async fn open(&self, file: bool) -> Result<Slot, String> {
        match self {
            Backend::SqliteMemory => sqlite_open(file).await,
            #[cfg(feature = "postgres")]
            Backend::Postgres(url) => pg::open(url).await,
            #[cfg(feature = "mysql")]
            Backend::MySql(url) => my::open(url).await,
            #[cfg(feature = "redis")]
            Backend::Redis(url) => {
                let prefix = idemflow::conformance::unique("idemflow-sim");
                let replica = crate::failover::Replica::connect(url, &prefix).await?;
                let cfg = idemflow::store::redis::RedisConfig::new(url.clone()).prefix(prefix);
                let s = idemflow::store::redis::RedisStore::connect_with(cfg)
                    .await
                    .map_err(|e| e.to_string())?;
                s.migrate().await.map_err(|e| e.to_string())?;
                Ok(Slot {
                    store: Arc::new(s),
                    kind: SlotKind::OneShot,
                    app: None,
                    replica: Some(replica),
                    _dir: None,
                })
            }
        }
    }
}

/// A SQLite store with the application's tables of the atomic phases (`atomic::SQLITE_SCHEMA`): in
/// memory, or in a file of its own with a second connection to it (another process).
async fn sqlite_open(file: bool) -> Result<Slot, String> {
    use idemflow::store::sqlite::{SqliteConfig, SqliteStore};
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let (dir, url) = if file {
        let dir = tempfile::tempdir().map_err(|x| e(&x))?;
        let url = format!("sqlite://{}", dir.path().join("sim.db").display());
        (Some(dir), url)
    } else {
        (None, "sqlite::memory:".to_owned())
    };
    // A short busy timeout: the phases' contention faults wait for it.
    // A phase timeout of a second, past the busy timeout (the lock faults wait that out) and
    // short enough that a phase stuck in a statement (`atomic::Fault::Stuck`) is cut off
    // within the schedule.
    let config = SqliteConfig::new(&url)
        .busy_timeout(std::time::Duration::from_millis(300))
        .phase_timeout(std::time::Duration::from_secs(1))
        .readers(1);
    // WAL without a sync per commit: a reopened file still holds every commit (a process
    // restart, not a power cut), and the schedules' leases are not starved by fsyncs.
    let config = if file {
        config.synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
    } else {
        config
    };
    let s = SqliteStore::connect_with(config).await.map_err(|x| e(&x))?;
    s.migrate().await.map_err(|x| e(&x))?;
    for sql in crate::atomic::SQLITE_SCHEMA {
        sqlx::query(sqlx::AssertSqlSafe(*sql))
            .execute(s.writer_pool())
            .await
            .map_err(|x| e(&x))?;
    }
    let (other, read) = if file {
        let opts = SqliteConnectOptions::from_str(&url).map_err(|x| e(&x))?;
        let other = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                opts.clone()
                    .busy_timeout(std::time::Duration::from_millis(50)),
            )
            .await
            .map_err(|x| e(&x))?;
        let read = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(opts.read_only(true))
            .await
            .map_err(|x| e(&x))?;
        (Some(other), read)
    } else {
        (None, s.writer_pool().clone())
    };
    Ok(Slot {
        store: Arc::new(s.clone()),
        kind: SlotKind::OneShot,
        app: Some(crate::atomic::Db {
            store: crate::atomic::PhaseStore::Sqlite(s),
            url: file.then_some(url),
            other: other.map(crate::atomic::AppPool::Sqlite),
            read: crate::atomic::AppPool::Sqlite(read),
        }),
        replica: None,
        _dir: dir,
    })
}

/// One isolated store, used by one schedule at a time.
pub struct Slot {
    pub store: Arc<dyn Store>,
    kind: SlotKind,
    /// On the SQL backends: the store itself and the application's tables, for atomic phases.
    pub app: Option<crate::atomic::Db>,
    /// On Redis: the schedule's keys as a primary and its replica, for failovers.
    pub replica: Option<crate::failover::Replica>,
    /// A file database's directory, removed with the slot.
    _dir: Option<tempfile::TempDir>,
}

enum SlotKind {
    /// Used by one schedule, then dropped (SQLite in memory, a Redis prefix).
    OneShot,
    #[cfg(feature = "postgres")]
    Postgres {
        pool: sqlx::PgPool,
        url: String,
        schema: String,
    },
    #[cfg(feature = "mysql")]
    MySql {
        pool: sqlx::MySqlPool,
        base: Box<sqlx::mysql::MySqlConnectOptions>,
        name: String,
    },
}

/// The slots of one backend: at most one per schedule running at once.
pub struct StorePool {
    backend: Backend,
    free: Mutex<Vec<Slot>>,
    created: std::sync::atomic::AtomicUsize,
}

impl StorePool {
    pub fn new(backend: Backend) -> Self {
        Self {
            backend,
            free: Mutex::new(Vec::new()),
            created: Default::default(),
        }
    }

    pub fn name(&self) -> &'static str {
        self.backend.name()
    }

    /// Stores created so far.
    pub fn created(&self) -> usize {
        self.created.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// An empty store of its own: a free slot, or a new one (`file`: see [`Backend::open`]).
    pub async fn take(&self, file: bool) -> Result<Slot, String> {
        if let Some(slot) = self.free.lock().unwrap().pop() {
            return Ok(slot);
        }
        self.created
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.backend.open(file).await
    }

    /// Takes a slot back after its schedule: empties it for the next one (every task of the
    /// schedule has ended by now), or drops it when it is used once.
    pub async fn give_back(&self, slot: Slot) -> Result<(), String> {
        if empty(&slot.kind).await? {
            self.free.lock().unwrap().push(slot);
        }
        Ok(())
    }

    /// Drops every slot's schema or database.
    pub async fn close(&self) {
        let slots: Vec<Slot> = std::mem::take(&mut *self.free.lock().unwrap());
        for slot in slots {
            drop(slot.store);
            match slot.kind {
                SlotKind::OneShot => {}
                #[cfg(feature = "postgres")]
                SlotKind::Postgres { pool, url, schema } => {
                    pool.close().await;
                    crate::support::postgres::drop_schema(&url, &schema).await;
                }
                #[cfg(feature = "mysql")]
                SlotKind::MySql { pool, base, name } => {
                    use sqlx::{AssertSqlSafe, ConnectOptions, Executor};
                    pool.close().await;
                    if let Ok(mut admin) = base.connect().await {
                        let _ = admin
                            .execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
                            .await;
                    }
                }
            }
        }
    }
}

/// The tables of the PostgreSQL store (`migrations/postgres/`), then the application's
/// (`atomic::APP_TABLES`).
#[cfg(feature = "postgres")]
const PG_TABLES: [&str; 5] = [
    "idempotency_key_tombstones",
    "idempotency_keys",
    crate::atomic::APP_TABLES[0],
    crate::atomic::APP_TABLES[1],
    crate::atomic::APP_TABLES[2],
];

/// The tables of the MariaDB/MySQL store (`migrations/mysql/`), events first, then the
/// application's (`atomic::APP_TABLES`).
#[cfg(feature = "mysql")]
const MYSQL_TABLES: [&str; 5] = [
    "idempotency_key_events",
    "idempotency_keys",
    crate::atomic::APP_TABLES[0],
    crate::atomic::APP_TABLES[1],
    crate::atomic::APP_TABLES[2],
];

/// Deletes every row of `$tables` through `$pool` until none is left (the same SQL on
/// PostgreSQL and MariaDB/MySQL, on two pool types). A statement sent by an actor that the
/// schedule aborted mid-query can still commit on the server after the first `DELETE` (the
/// server runs what it received; dropping the future only closes the connection), so a few
/// rounds are allowed before a leftover row is an error.
#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! empty_tables {
    ($pool:expr, $tables:expr) => {{
        let mut left = Vec::new();
        for _ in 0..40 {
            left.clear();
            for t in $tables {
                sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {t}")))
                    .execute($pool)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            for t in $tables {
                let n: i64 =
                    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {t}")))
                        .fetch_one($pool)
                        .await
                        .map_err(|e| e.to_string())?;
                if n != 0 {
                    left.push(format!("{t}: {n}"));
                }
            }
            if left.is_empty() {
                return Ok(true);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Err(format!(
            "rows left after emptying for 2 s: {}",
            left.join(", ")
        ))
    }};
}

/// Deletes every row of the slot's tables and checks none is left. `false`: the slot is not
/// reusable (used once).
async fn empty(kind: &SlotKind) -> Result<bool, String> {
    match kind {
        SlotKind::OneShot => Ok(false),
        #[cfg(feature = "postgres")]
        SlotKind::Postgres { pool, .. } => {
            empty_tables!(pool, PG_TABLES)
        }
        #[cfg(feature = "mysql")]
        SlotKind::MySql { pool, .. } => {
            empty_tables!(pool, MYSQL_TABLES)
        }
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use crate::support::postgres::pool_in;
    use sqlx::{AssertSqlSafe, Connection, Executor};

    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    pub async fn open(url: &str) -> Result<Slot, String> {
        let schema = format!(
            "idemflow_sim_{}_{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mut admin = sqlx::postgres::PgConnection::connect(url)
            .await
            .map_err(|e| e.to_string())?;
        admin
            .execute(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
            )))
            .await
            .map_err(|e| e.to_string())?;
        let _ = admin.close().await;
        let pool = pool_in(url, &schema, 2).await;
        let s = idemflow::store::postgres::PostgresStore::from_pool(pool.clone());
        s.migrate().await.map_err(|e| e.to_string())?;
        for sql in crate::atomic::PG_SCHEMA {
            sqlx::raw_sql(AssertSqlSafe(*sql))
                .execute(&pool)
                .await
                .map_err(|e| e.to_string())?;
        }
        let app = crate::atomic::Db {
            store: crate::atomic::PhaseStore::Postgres(s.clone()),
            url: None,
            other: Some(crate::atomic::AppPool::Postgres(
                pool_in(url, &schema, 1).await,
            )),
            read: crate::atomic::AppPool::Postgres(pool_in(url, &schema, 1).await),
        };
        Ok(Slot {
            store: Arc::new(s),
            kind: SlotKind::Postgres {
                pool,
                url: url.to_owned(),
                schema,
            },
            app: Some(app),
            replica: None,
            _dir: None,
        })
    }
}

#[cfg(feature = "mysql")]
mod my {
    use super::*;
    use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
    use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Executor};
    use std::str::FromStr;

    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    pub async fn open(url: &str) -> Result<Slot, String> {
        let name = format!(
            "idemflow_sim_{}_{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let base = MySqlConnectOptions::from_str(url).map_err(|e| e.to_string())?;
        let mut admin = base.connect().await.map_err(|e| e.to_string())?;
        admin
            .execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
            .await
            .map_err(|e| e.to_string())?;
        admin
            .execute(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .map_err(|e| e.to_string())?;
        let _ = admin.close().await;
        let options = base.clone().database(&name);
        // `IDEMFLOW_SIM_MYSQL_SQL_MODE=SIMULTANEOUS_ASSIGNMENT` adds a server mode to every
        // session, as a server-wide setting would (finding 3).
        let extra_mode = std::env::var("IDEMFLOW_SIM_MYSQL_SQL_MODE").ok();
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .after_connect(move |conn, _| {
                let extra_mode = extra_mode.clone();
                Box::pin(async move {
                    if let Some(mode) = extra_mode.filter(|m| !m.is_empty()) {
                        conn.execute(AssertSqlSafe(format!(
                            "SET SESSION sql_mode = CONCAT(@@sql_mode, ',{mode}')"
                        )))
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options.clone())
            .await
            .map_err(|e| e.to_string())?;
        let s = idemflow::store::mysql::MySqlStore::from_pool(pool.clone());
        s.migrate().await.map_err(|e| e.to_string())?;
        for sql in crate::atomic::MYSQL_SCHEMA {
            sqlx::raw_sql(AssertSqlSafe(*sql))
                .execute(&pool)
                .await
                .map_err(|e| e.to_string())?;
        }
        let one = || {
            MySqlPoolOptions::new()
                .max_connections(1)
                .connect_with(options.clone())
        };
        let app = crate::atomic::Db {
            store: crate::atomic::PhaseStore::MySql(s.clone()),
            url: None,
            other: Some(crate::atomic::AppPool::MySql(
                one().await.map_err(|e| e.to_string())?,
            )),
            read: crate::atomic::AppPool::MySql(one().await.map_err(|e| e.to_string())?),
        };
        Ok(Slot {
            store: Arc::new(s),
            kind: SlotKind::MySql {
                pool,
                base: Box::new(base),
                name,
            },
            app: Some(app),
            replica: None,
            _dir: None,
        })
    }
}
