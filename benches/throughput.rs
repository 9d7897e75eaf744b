//! Throughput figures, printed as ratios measured in one run (DESIGN section 6).
//!
//! `cargo bench --bench throughput --all-features`. SQLite (file, WAL, `synchronous=FULL`) always
//! runs; PostgreSQL and MariaDB / MySQL run when `IDEMFLOW_BENCH_POSTGRES_URL` /
//! `IDEMFLOW_BENCH_MYSQL_URL` are set (and the `postgres` / `mysql` features are on), each in a
//! fresh schema / database that is dropped afterwards.
//!
//! - `IDEMFLOW_BENCH_N`: keys per sequential measurement (default 2000).
//! - `IDEMFLOW_BENCH_BIG`: finished keys beside the stale ones in the sweep-scaling check
//!   (default 1,000,000); `IDEMFLOW_BENCH_BIG_MYSQL` overrides it for MariaDB / MySQL.
//! - `IDEMFLOW_BENCH_RUNTIME`: `current_thread` (default) or `multi_thread`; printed.
//!
//! Per backend: the raw statements a hand-rolled implementation would issue (claim insert
//! ignoring duplicates + update to done; a primary-key read) against `execute()` on fresh keys
//! and on replays, sequential, one caller; 1,000 concurrent duplicates of one key; and
//! `take_stale` of 1,000 stale keys alone against beside many finished keys.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idemflow::store::TakeStale;
use idemflow::store::sqlite::SqliteStore;
use idemflow::{Execution, Idempotency, IdempotentRequest, Outcome, Store, StoredResponse};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const BODY: &[u8] = b"{\"payment_id\":1}";
const STALE: usize = 1000;
const DUPLICATES: usize = 1000;

struct Stats {
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

fn stats(mut lat: Vec<Duration>, total: Duration) -> Stats {
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 - 1.0) * p) as usize].as_secs_f64() * 1e6;
    Stats {
        ops_per_s: lat.len() as f64 / total.as_secs_f64(),
        p50_us: pct(0.50),
        p99_us: pct(0.99),
    }
}

fn line(name: &str, s: &Stats) {
    println!(
        "  {name:<42} {:>9.0} ops/s   p50 {:>7.0} us   p99 {:>7.0} us",
        s.ops_per_s, s.p50_us, s.p99_us
    );
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

/// What differs between backends: how to get a fresh store, and the hand-written statements
/// the library is compared with. Everything else is the generic [`run`].
trait Backend {
    type S: Store + 'static;

    /// One line: server, durability settings.
    async fn describe(&self) -> String;
    /// A store on a fresh, migrated schema / database / file (dropped by [`Backend::cleanup`]).
    async fn fresh(&mut self, tag: &str) -> Arc<Self::S>;
    /// Claim insert that ignores duplicates, then the update to done: the two statements of a
    /// hand-rolled implementation, each its own commit.
    async fn raw_claim_complete(&self, store: &Self::S, key: &str);
    /// A primary-key read of a stored response.
    async fn raw_read(&self, store: &Self::S, key: &str) -> bool;
    /// Bulk-loads `n` finished keys (scope `big`); returns how many were loaded.
    async fn load_finished(&self, store: &Self::S, n: usize) -> usize;
    /// Loads `n` processing keys whose lease has expired (scope `stale`), then refreshes the
    /// planner statistics where the backend has any.
    async fn load_stale(&self, store: &Self::S, n: usize);
    async fn cleanup(self);
}

async fn timed<F: AsyncFnMut(usize)>(n: usize, mut op: F) -> Stats {
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        op(i).await;
        lat.push(t.elapsed());
    }
    stats(lat, t0.elapsed())
}

fn request(scope: &str, i: usize) -> IdempotentRequest {
    IdempotentRequest::new(
        scope,
        &format!("k{i}"),
        "payments.create",
        &serde_json::json!({"amount": 500, "i": i}),
    )
    .unwrap()
}

async fn execute_fresh(idem: &Idempotency, n: usize) -> Stats {
    timed(n, async |i| {
        let r = idem
            .execute(request("bench", i), |_ctx| async {
                Outcome::Succeeded(StoredResponse::new(201).with_body(BODY))
            })
            .await
            .unwrap();
        assert!(!r.is_replay());
    })
    .await
}

async fn execute_replay(idem: &Idempotency, n: usize) -> Stats {
    timed(n, async |i| {
        let r = idem
            .execute(request("bench", i), |_ctx| async {
                unreachable!("replay only")
            })
            .await
            .unwrap();
        assert!(r.is_replay());
    })
    .await
}

async fn duplicates(idem: &Idempotency, n: usize) -> (usize, usize) {
    let runs = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let idem = idem.clone();
        let runs = runs.clone();
        tasks.push(tokio::spawn(async move {
            idem.execute(request("dup", 0), |_ctx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                Outcome::Succeeded(StoredResponse::new(201))
            })
            .await
        }));
    }
    let mut executed = 0;
    for t in tasks {
        if let Ok(Execution::Executed(_)) = t.await.unwrap() {
            executed += 1;
        }
    }
    (runs.load(Ordering::SeqCst), executed)
}

/// Loads the table, then times `take_stale` (batches of 100) until no stale key is left.
async fn sweep_time<B: Backend>(b: &B, store: &B::S, finished: usize) -> (Duration, usize) {
    let loaded = if finished > 0 {
        b.load_finished(store, finished).await
    } else {
        0
    };
    b.load_stale(store, STALE).await;
    let t = Instant::now();
    let mut taken = 0;
    loop {
        let batch = store
            .take_stale(&TakeStale {
                owner: "bench".into(),
                lease: Duration::from_secs(600),
                limit: 100,
            })
            .await
            .unwrap();
        if batch.is_empty() {
            break;
        }
        taken += batch.len();
    }
    assert_eq!(taken, STALE);
    (t.elapsed(), loaded)
}

/// The four comparisons, the duplicates check and the sweep-scaling check on one backend.
async fn run<B: Backend>(name: &str, mut b: B, n: usize, big: usize) {
    println!("\n== {name}: {}", b.describe().await);
    let store = b.fresh("main").await;
    let idem = Idempotency::new(store.clone());
    let raw = timed(n, async |i| {
        b.raw_claim_complete(&store, &format!("k{i}")).await
    })
    .await;
    let ours = execute_fresh(&idem, n).await;
    let raw_read = timed(n, async |i| {
        assert!(b.raw_read(&store, &format!("k{i}")).await);
    })
    .await;
    let replay = execute_replay(&idem, n).await;
    line("raw claim INSERT + UPDATE done (by hand)", &raw);
    line("execute() on fresh keys", &ours);
    line("raw primary-key read (by hand)", &raw_read);
    line("execute() replay", &replay);
    let fresh_ratio = ours.ops_per_s / raw.ops_per_s;
    let replay_ratio = replay.ops_per_s / raw_read.ops_per_s;
    println!(
        "  ratio fresh:  {fresh_ratio:.2}x of raw      (target >= 0.70: {})",
        verdict(fresh_ratio >= 0.7)
    );
    println!(
        "  ratio replay: {replay_ratio:.2}x of raw read (target >= 0.80: {})",
        verdict(replay_ratio >= 0.8)
    );
    let (runs, executed) = duplicates(&idem, DUPLICATES).await;
    println!(
        "  {DUPLICATES} concurrent duplicates of one key: body ran {runs} time(s), {executed} Executed (target 1: {})",
        verdict(runs == 1 && executed == 1)
    );

    let small = b.fresh("sweep_small").await;
    let (t_small, _) = sweep_time(&b, &small, 0).await;
    let large = b.fresh("sweep_large").await;
    let (t_large, loaded) = sweep_time(&b, &large, big).await;
    let growth = t_large.as_secs_f64() / t_small.as_secs_f64();
    println!(
        "  take_stale of {STALE} stale keys: {:.1} ms alone, {:.1} ms beside {loaded} finished keys ({growth:.2}x, target < 1.5x: {})",
        t_small.as_secs_f64() * 1e3,
        t_large.as_secs_f64() * 1e3,
        verdict(growth < 1.5)
    );
    drop((idem, store, small, large));
    b.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// SQLite

struct Sqlite {
    dir: tempfile::TempDir,
}

impl Backend for Sqlite {
    type S = SqliteStore;

    async fn describe(&self) -> String {
        "SQLite file, WAL, synchronous=FULL, 1 writer connection".into()
    }

    async fn fresh(&mut self, tag: &str) -> Arc<SqliteStore> {
        let url = format!("sqlite://{}", self.dir.path().join(tag).display());
        let s = SqliteStore::connect(&url).await.unwrap();
        s.migrate().await.unwrap();
        Arc::new(s)
    }

    async fn raw_claim_complete(&self, store: &SqliteStore, key: &str) {
        let pool = store.writer_pool();
        sqlx::query(
            "INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, fingerprint, \
             request, lease_token, lease_owner, lease_expires_at, attempts, created_at, updated_at, \
             retention_ms, version, last_actor, last_reason) VALUES ('raw', ?1, 'op', 'pk', \
             'processing', 'v1:x', '{}', 1, 'w', 0, 1, 0, 0, 86400000, 1, 'worker', 'claimed') \
             ON CONFLICT DO NOTHING",
        )
        .bind(key)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query(
            "UPDATE idempotency_keys SET state = 'done', response_status = 201, \
             response_headers = '[]', response_body = ?2, lease_expires_at = NULL, \
             expires_at = 86400000, version = version + 1 \
             WHERE scope = 'raw' AND key = ?1 AND lease_token = 1",
        )
        .bind(key)
        .bind(BODY)
        .execute(pool)
        .await
        .unwrap();
    }

    async fn raw_read(&self, store: &SqliteStore, key: &str) -> bool {
        let row: Option<(i64, Vec<u8>)> = sqlx::query_as(
            "SELECT response_status, response_body FROM idempotency_keys WHERE scope = 'raw' AND key = ?1",
        )
        .bind(key)
        .fetch_optional(store.writer_pool())
        .await
        .unwrap();
        row.is_some()
    }

    async fn load_finished(&self, store: &SqliteStore, n: usize) -> usize {
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1) \
             INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, fingerprint, \
             lease_token, attempts, created_at, updated_at, expires_at, retention_ms, version, \
             last_actor) SELECT 'big', 'k' || i, 'op', 'pk', 'done', 'v1:x', 1, 1, 0, 0, \
             4102444800000, 86400000, 1, 'worker' FROM n",
        )
        .bind(n as i64)
        .execute(store.writer_pool())
        .await
        .unwrap();
        n
    }

    async fn load_stale(&self, store: &SqliteStore, n: usize) {
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1) \
             INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, fingerprint, \
             lease_token, lease_expires_at, attempts, created_at, updated_at, retention_ms, version, \
             last_actor) SELECT 'stale', 'k' || i, 'op', 'pk', 'processing', 'v1:x', 1, 0, 1, 0, 0, \
             86400000, 1, 'worker' FROM n",
        )
        .bind(n as i64)
        .execute(store.writer_pool())
        .await
        .unwrap();
    }

    async fn cleanup(self) {
        drop(self.dir);
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
fn bench_name(tag: &str) -> String {
    format!("idemflow_bench_{}_{tag}", std::process::id())
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL

#[cfg(feature = "postgres")]
mod pg {
    use std::str::FromStr;
    use std::sync::Arc;

    use idemflow::Store;
    use idemflow::store::postgres::PostgresStore;
    use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
    use sqlx::{AssertSqlSafe, Connection, Executor};

    use super::{BODY, Backend, bench_name};

    pub struct Postgres {
        pub url: String,
        pub schemas: Vec<String>,
    }

    impl Postgres {
        async fn admin(&self) -> PgConnection {
            PgConnection::connect(&self.url).await.unwrap()
        }
    }

    impl Backend for Postgres {
        type S = PostgresStore;

        async fn describe(&self) -> String {
            let mut c = self.admin().await;
            let (v, sc): (String, String) = sqlx::query_as(
                "SELECT current_setting('server_version'), current_setting('synchronous_commit')",
            )
            .fetch_one(&mut c)
            .await
            .unwrap();
            format!("PostgreSQL {v}, synchronous_commit={sc}, pool of 10")
        }

        async fn fresh(&mut self, tag: &str) -> Arc<PostgresStore> {
            let schema = bench_name(tag);
            let mut c = self.admin().await;
            c.execute(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE"
            )))
            .await
            .unwrap();
            c.execute(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                .await
                .unwrap();
            self.schemas.push(schema.clone());
            let options = PgConnectOptions::from_str(&self.url)
                .unwrap()
                .options([("search_path", schema.as_str())]);
            let pool = PgPoolOptions::new()
                .max_connections(10)
                .connect_with(options)
                .await
                .unwrap();
            let s = PostgresStore::from_pool(pool);
            s.migrate().await.unwrap();
            Arc::new(s)
        }

        async fn raw_claim_complete(&self, store: &PostgresStore, key: &str) {
            sqlx::query(
                "INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, \
                 fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, \
                 created_at, updated_at, retention_ms, version, last_actor, last_reason) \
                 VALUES ('raw', $1, 'op', 'pk', 'processing', 'v1:x', '{}', 1, 'w', \
                 now() + interval '1 minute', 1, now(), now(), 86400000, 1, 'worker', 'claimed') \
                 ON CONFLICT DO NOTHING",
            )
            .bind(key)
            .execute(store.pool())
            .await
            .unwrap();
            sqlx::query(
                "UPDATE idempotency_keys SET state = 'done', response_status = 201, \
                 response_headers = '[]', response_body = $2, lease_owner = NULL, \
                 lease_expires_at = NULL, expires_at = now() + interval '1 day', \
                 updated_at = now(), version = version + 1 \
                 WHERE scope = 'raw' AND key = $1 AND lease_token = 1",
            )
            .bind(key)
            .bind(BODY)
            .execute(store.pool())
            .await
            .unwrap();
        }

        async fn raw_read(&self, store: &PostgresStore, key: &str) -> bool {
            let row: Option<(i32, Vec<u8>)> = sqlx::query_as(
                "SELECT response_status, response_body FROM idempotency_keys \
                 WHERE scope = 'raw' AND key = $1",
            )
            .bind(key)
            .fetch_optional(store.pool())
            .await
            .unwrap();
            row.is_some()
        }

        async fn load_finished(&self, store: &PostgresStore, n: usize) -> usize {
            sqlx::query(
                "INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, \
                 fingerprint, lease_token, attempts, created_at, updated_at, expires_at, \
                 retention_ms, version, last_actor) \
                 SELECT 'big', 'k' || i, 'op', 'pk', 'done', 'v1:x', 1, 1, now(), now(), \
                 now() + interval '1 day', 86400000, 1, 'worker' \
                 FROM generate_series(1, $1::bigint) AS i",
            )
            .bind(n as i64)
            .execute(store.pool())
            .await
            .unwrap();
            n
        }

        async fn load_stale(&self, store: &PostgresStore, n: usize) {
            sqlx::query(
                "INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, \
                 fingerprint, lease_token, lease_owner, lease_expires_at, attempts, created_at, \
                 updated_at, retention_ms, version, last_actor) \
                 SELECT 'stale', 'k' || i, 'op', 'pk', 'processing', 'v1:x', 1, 'w', \
                 now() - interval '1 minute', 1, now(), now(), 86400000, 1, 'worker' \
                 FROM generate_series(1, $1::bigint) AS i",
            )
            .bind(n as i64)
            .execute(store.pool())
            .await
            .unwrap();
            sqlx::query("ANALYZE idempotency_keys")
                .execute(store.pool())
                .await
                .unwrap();
        }

        async fn cleanup(self) {
            let mut c = self.admin().await;
            for s in &self.schemas {
                c.execute(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE")))
                    .await
                    .unwrap();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// MariaDB / MySQL

#[cfg(feature = "mysql")]
mod my {
    use std::str::FromStr;
    use std::sync::Arc;
    use std::time::Instant;

    use idemflow::Store;
    use idemflow::store::mysql::MySqlStore;
    use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPoolOptions};
    use sqlx::{AssertSqlSafe, ConnectOptions, Executor};

    use super::{BODY, Backend, bench_name};

    pub struct MySql {
        pub url: String,
        pub databases: Vec<String>,
    }

    impl MySql {
        async fn admin(&self) -> MySqlConnection {
            MySqlConnectOptions::from_str(&self.url)
                .unwrap()
                .connect()
                .await
                .unwrap()
        }
    }

    /// Rows per bulk-load statement (one commit each).
    const CHUNK: usize = 100_000;

    /// 0..100,000 as column `i`: a cross join of a ten-row digits table.
    const NUMBERS: &str = "(SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS i \
         FROM bench_digits a, bench_digits b, bench_digits c, bench_digits e, bench_digits f) n";

    async fn digits(store: &MySqlStore) {
        let pool = store.pool();
        pool.execute("CREATE TABLE IF NOT EXISTS bench_digits (d INT PRIMARY KEY)")
            .await
            .unwrap();
        pool.execute(
            "INSERT IGNORE INTO bench_digits VALUES (0),(1),(2),(3),(4),(5),(6),(7),(8),(9)",
        )
        .await
        .unwrap();
    }

    impl Backend for MySql {
        type S = MySqlStore;

        async fn describe(&self) -> String {
            let mut c = self.admin().await;
            let (v, flush): (String, i64) = sqlx::query_as(
                "SELECT VERSION(), CAST(@@innodb_flush_log_at_trx_commit AS SIGNED)",
            )
            .fetch_one(&mut c)
            .await
            .unwrap();
            format!("{v}, innodb_flush_log_at_trx_commit={flush}, pool of 10")
        }

        async fn fresh(&mut self, tag: &str) -> Arc<MySqlStore> {
            let name = bench_name(tag);
            let mut c = self.admin().await;
            c.execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
                .await
                .unwrap();
            c.execute(AssertSqlSafe(format!("CREATE DATABASE {name}")))
                .await
                .unwrap();
            self.databases.push(name.clone());
            let options = MySqlConnectOptions::from_str(&self.url)
                .unwrap()
                .database(&name);
            let pool = MySqlPoolOptions::new()
                .max_connections(10)
                .connect_with(options)
                .await
                .unwrap();
            let s = MySqlStore::from_pool(pool);
            s.migrate().await.unwrap();
            Arc::new(s)
        }

        async fn raw_claim_complete(&self, store: &MySqlStore, key: &str) {
            sqlx::query(
                "INSERT IGNORE INTO idempotency_keys (scope, `key`, operation, provider_key, state, \
                 fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, \
                 created_at, updated_at, retention_ms, version, last_actor, last_reason) \
                 VALUES ('raw', ?, 'op', 'pk', 'processing', 'v1:x', '{}', 1, 'w', \
                 UTC_TIMESTAMP(6) + INTERVAL 1 MINUTE, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), \
                 86400000, 1, 'worker', 'claimed')",
            )
            .bind(key)
            .execute(store.pool())
            .await
            .unwrap();
            sqlx::query(
                "UPDATE idempotency_keys SET state = 'done', response_status = 201, \
                 response_headers = '[]', response_body = ?, lease_owner = NULL, \
                 lease_expires_at = NULL, expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 DAY, \
                 updated_at = UTC_TIMESTAMP(6), version = version + 1 \
                 WHERE scope = 'raw' AND `key` = ? AND lease_token = 1",
            )
            .bind(BODY)
            .bind(key)
            .execute(store.pool())
            .await
            .unwrap();
        }

        async fn raw_read(&self, store: &MySqlStore, key: &str) -> bool {
            let row: Option<(i32, Vec<u8>)> = sqlx::query_as(
                "SELECT response_status, response_body FROM idempotency_keys \
                 WHERE scope = 'raw' AND `key` = ?",
            )
            .bind(key)
            .fetch_optional(store.pool())
            .await
            .unwrap();
            row.is_some()
        }

        /// `INSERT .. SELECT` from [`NUMBERS`], CHUNK rows per statement (history triggers on,
        /// as in production).
        async fn load_finished(&self, store: &MySqlStore, n: usize) -> usize {
            let pool = store.pool();
            digits(store).await;
            let t = Instant::now();
            let mut done = 0;
            while done < n {
                let rows = CHUNK.min(n - done);
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO idempotency_keys (scope, `key`, operation, provider_key, state, \
                     fingerprint, lease_token, attempts, created_at, updated_at, expires_at, \
                     retention_ms, version, last_actor) \
                     SELECT 'big', CONCAT('k', ? + i), 'op', 'pk', 'done', 'v1:x', 1, 1, \
                     UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 DAY, \
                     86400000, 1, 'worker' FROM {NUMBERS} WHERE i < ?"
                )))
                .bind(done as i64)
                .bind(rows as i64)
                .execute(pool)
                .await
                .unwrap();
                done += rows;
            }
            println!(
                "  (bulk load of {done} finished keys, history triggers on: {:.1} s)",
                t.elapsed().as_secs_f64()
            );
            done
        }

        async fn load_stale(&self, store: &MySqlStore, n: usize) {
            let pool = store.pool();
            digits(store).await;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO idempotency_keys (scope, `key`, operation, provider_key, state, \
                 fingerprint, lease_token, lease_owner, lease_expires_at, attempts, created_at, \
                 updated_at, retention_ms, version, last_actor) \
                 SELECT 'stale', CONCAT('k', i), 'op', 'pk', 'processing', 'v1:x', 1, 'w', \
                 UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), \
                 86400000, 1, 'worker' FROM {NUMBERS} WHERE i < ?"
            )))
            .bind(n as i64)
            .execute(pool)
            .await
            .unwrap();
            pool.execute("ANALYZE TABLE idempotency_keys")
                .await
                .unwrap();
        }

        async fn cleanup(self) {
            let mut c = self.admin().await;
            for d in &self.databases {
                c.execute(AssertSqlSafe(format!("DROP DATABASE {d}")))
                    .await
                    .unwrap();
            }
        }
    }
}

fn url_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn main() {
    let n = env("IDEMFLOW_BENCH_N", 2000);
    let big = env("IDEMFLOW_BENCH_BIG", 1_000_000);
    let flavour =
        std::env::var("IDEMFLOW_BENCH_RUNTIME").unwrap_or_else(|_| "current_thread".into());
    let rt = match flavour.as_str() {
        "current_thread" => tokio::runtime::Builder::new_current_thread(),
        "multi_thread" => tokio::runtime::Builder::new_multi_thread(),
        other => panic!("IDEMFLOW_BENCH_RUNTIME: {other}? (current_thread or multi_thread)"),
    }
    .enable_all()
    .build()
    .unwrap();
    println!(
        "idemflow throughput: tokio {flavour} runtime, N={n} sequential keys (one caller), \
         {} cores",
        std::thread::available_parallelism().map_or(0, |p| p.get())
    );
    rt.block_on(async {
        let sqlite = Sqlite {
            dir: tempfile::tempdir().unwrap(),
        };
        run("SQLite", sqlite, n, big).await;

        match url_var("IDEMFLOW_BENCH_POSTGRES_URL") {
            #[cfg(feature = "postgres")]
            Some(url) => {
                let b = pg::Postgres {
                    url,
                    schemas: Vec::new(),
                };
                run("PostgreSQL", b, n, big).await;
            }
            #[cfg(not(feature = "postgres"))]
            Some(_) => println!("\n== PostgreSQL: skipped (feature `postgres` off)"),
            None => println!("\n== PostgreSQL: skipped (IDEMFLOW_BENCH_POSTGRES_URL unset)"),
        }

        match url_var("IDEMFLOW_BENCH_MYSQL_URL") {
            #[cfg(feature = "mysql")]
            Some(url) => {
                let b = my::MySql {
                    url,
                    databases: Vec::new(),
                };
                run(
                    "MariaDB / MySQL",
                    b,
                    n,
                    env("IDEMFLOW_BENCH_BIG_MYSQL", big),
                )
                .await;
            }
            #[cfg(not(feature = "mysql"))]
            Some(_) => println!("\n== MariaDB / MySQL: skipped (feature `mysql` off)"),
            None => println!("\n== MariaDB / MySQL: skipped (IDEMFLOW_BENCH_MYSQL_URL unset)"),
        }
    });
}
