//! One commit for local work (`Idempotency::execute_atomic`) beside its floor, the textbook
//! design on raw sqlx: `BEGIN`, insert the key, insert the application's
//! row, store the answer, `COMMIT`, on a lean key table, one connection (a hand-written SQLite
//! implementation's). SQLite on a WAL file with `synchronous = FULL` (the store's default), at
//! 1 and 64 callers; each new key writes one order row. Run with
//! `cargo bench --bench one_commit` (`IDEMFLOW_BENCH_N`, default 2,000 keys per measurement;
//! `IDEMFLOW_BENCH_ONLY=ours` or `floor` runs one side alone, to profile it;
//! `IDEMFLOW_BENCH_KEEP=1` keeps the databases; `IDEMFLOW_BENCH_CALLERS=1` or `64` measures
//! one count of callers alone).
//! Issue 23's targets: >= 0.9x the floor with 1 caller, >= 4x with 64 (group commit).
//!
//! With `IDEMFLOW_BENCH_POSTGRES_URL` set (and feature `postgres`), the same on PostgreSQL, in a
//! schema of its own dropped afterwards: `PostgresStore::atomic_phase` against the seed's one
//! transaction on raw sqlx, both on pools of 16 connections (the store's default; the floor's
//! pool pings nothing before handing a connection over). No target; for the record.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idemflow::store::phase::AtomicPhase;
use idemflow::store::sqlite::SqliteStore;
use idemflow::{Execution, Idempotency, IdempotentRequest, Store, StoredResponse};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

type BoxFut = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

const ORDERS: &str =
    "CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL, created_at INTEGER)";
#[allow(dead_code)] // each benchmark uses part of it
mod support;
use support::sqlite_floor::{CLAIM, DONE, LEAN};
const BODY: &[u8] = br#"{"order":"o","amount":1999,"currency":"eur","status":"created"}"#;

struct Stats {
    ops_per_s: f64,
    p50: Duration,
    p99: Duration,
}

/// Runs `op(i)` for i in 0..n on `conc` tasks taking the next index as they go.
async fn measure<F>(n: usize, conc: usize, op: F) -> Stats
where
    F: Fn(usize) -> BoxFut + Send + Sync + 'static,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..conc)
        .map(|_| {
            let (op, next) = (op.clone(), next.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break lat;
                    }
                    let t = Instant::now();
                    op(i).await;
                    lat.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut lat = Vec::with_capacity(n);
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    let wall = t0.elapsed();
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 - 1.0) * p) as usize];
    Stats {
        ops_per_s: lat.len() as f64 / wall.as_secs_f64(),
        p50: pct(0.50),
        p99: pct(0.99),
    }
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().next().unwrap_or("?").to_owned())
        .unwrap_or_else(|_| "?".into())
}

fn line(label: &str, s: &Stats, load: &str) {
    println!(
        "    {label:<40} {:>8.0} ops/s  p50 {:>7.3} ms  p99 {:>8.3} ms  (load {load})",
        s.ops_per_s,
        s.p50.as_secs_f64() * 1e3,
        s.p99.as_secs_f64() * 1e3,
    );
}

async fn floor_pool(path: &std::path::Path) -> SqlitePool {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    for sql in [LEAN, ORDERS] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    pool
}

/// The seed's design: one transaction per new key.
fn floor_op(pool: SqlitePool, run: usize) -> impl Fn(usize) -> BoxFut + Send + Sync + 'static {
    move |i| {
        let pool = pool.clone();
        Box::pin(async move {
            let key = format!("{run}-{i}");
            let mut tx = pool.begin().await.unwrap();
            let claimed = sqlx::query(CLAIM)
                .bind(&key)
                .execute(&mut *tx)
                .await
                .unwrap();
            assert_eq!(claimed.rows_affected(), 1);
            sqlx::query("INSERT INTO orders (id, amount, created_at) VALUES (?1, 1999, 0)")
                .bind(&key)
                .execute(&mut *tx)
                .await
                .unwrap();
            sqlx::query(DONE)
                .bind(&key)
                .bind(BODY)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        })
    }
}

/// A new key through `execute_atomic` whose phase, made by `phase` from the key, writes one
/// order row.
fn ours_op<P, M>(
    idem: Idempotency,
    run: usize,
    phase: M,
) -> impl Fn(usize) -> BoxFut + Send + Sync + 'static
where
    P: AtomicPhase + 'static,
    M: Fn(String) -> P + Send + Sync + 'static,
{
    let phase = Arc::new(phase);
    move |i| {
        let (idem, phase) = (idem.clone(), phase.clone());
        Box::pin(async move {
            let key = format!("{run}-{i}");
            let request = IdempotentRequest::new(
                "bench",
                &key,
                "orders.create",
                &serde_json::json!({"amount": 1999, "key": key}),
            )
            .unwrap();
            let done = idem.execute_atomic(request, phase(key)).await.unwrap();
            assert!(matches!(done, Execution::Executed(_)));
        })
    }
}

/// The SQLite phase: the order's row, in the key's transaction.
fn sqlite_phase(store: SqliteStore) -> impl Fn(String) -> Box<dyn AtomicPhase> + Send + Sync {
    move |key| {
        Box::new(store.atomic_phase(move |conn| {
            let key = key.clone();
            Box::pin(async move {
                sqlx::query("INSERT INTO orders (id, amount, created_at) VALUES (?1, 1999, 0)")
                    .bind(&key)
                    .execute(&mut *conn)
                    .await?;
                Ok(StoredResponse::new(201).with_body(BODY))
            })
        }))
    }
}

/// Measures `ours` and `floor` at `conc` callers, twice each, alternating (so a slow stretch of
/// the disk hits both), and prints the best-of-two ratio against `target`, if any.
/// `ours(run)` and `floor(run)` make the operation of a measurement (`run` tells its keys apart).
async fn compare<O, F, OO, FO>(n: usize, conc: usize, target: Option<f64>, ours: O, floor: F)
where
    O: Fn(usize) -> OO,
    F: Fn(usize) -> FO,
    OO: Fn(usize) -> BoxFut + Send + Sync + 'static,
    FO: Fn(usize) -> BoxFut + Send + Sync + 'static,
{
    let mut ours_best: Option<Stats> = None;
    let mut floor_best: Option<Stats> = None;
    // `IDEMFLOW_BENCH_ONLY=ours` (or `floor`) runs one side alone, for a profile of it.
    let only = std::env::var("IDEMFLOW_BENCH_ONLY").unwrap_or_default();
    println!("  {conc} caller(s)");
    for round in 0..2 {
        if only != "floor" {
            let l = load();
            let s = measure(n, conc, ours(conc * 10 + round)).await;
            line("idemflow execute_atomic()", &s, &l);
            if ours_best.as_ref().is_none_or(|b| s.ops_per_s > b.ops_per_s) {
                ours_best = Some(s);
            }
        }
        if only != "ours" {
            let l = load();
            let s = measure(n, conc, floor(conc * 10 + round)).await;
            line("floor: the seed's one transaction (sqlx)", &s, &l);
            if floor_best
                .as_ref()
                .is_none_or(|b| s.ops_per_s > b.ops_per_s)
            {
                floor_best = Some(s);
            }
        }
    }
    let (Some(o), Some(f)) = (ours_best, floor_best) else {
        println!("    one side only ({only}): no ratio");
        return;
    };
    let ratio = o.ops_per_s / f.ops_per_s;
    match target {
        Some(target) => println!(
            "    best of two: idemflow / floor = {ratio:.2}x (target >= {target}x: {})",
            if ratio >= target { "met" } else { "missed" }
        ),
        None => println!("    best of two: idemflow / floor = {ratio:.2}x"),
    }
}

fn runtime(conc: usize) -> tokio::runtime::Runtime {
    if conc == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap()
    }
}

/// The caller counts to measure: `IDEMFLOW_BENCH_CALLERS=1` (or `64`) measures one alone.
fn callers() -> Vec<usize> {
    match std::env::var("IDEMFLOW_BENCH_CALLERS") {
        Ok(c) => vec![
            c.parse()
                .expect("IDEMFLOW_BENCH_CALLERS: a number of callers"),
        ],
        Err(_) => vec![1, 64],
    }
}

fn main() {
    let n: usize = std::env::var("IDEMFLOW_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let dir = tempfile::tempdir().unwrap();
    // `IDEMFLOW_BENCH_KEEP=1` keeps the databases, to look into them afterwards.
    let dir = if std::env::var_os("IDEMFLOW_BENCH_KEEP").is_some() {
        let kept = dir.keep();
        println!("databases kept in {}", kept.display());
        kept
    } else {
        dir.path().to_owned()
    };
    println!("one commit for local work: SQLite WAL, synchronous=FULL, N = {n} new keys each");
    for conc in callers() {
        runtime(conc).block_on(async {
            let path = dir.join(format!("ours-{conc}.db"));
            let store = SqliteStore::connect(&format!("sqlite://{}?mode=rwc", path.display()))
                .await
                .unwrap();
            store.migrate().await.unwrap();
            sqlx::query(ORDERS)
                .execute(store.writer_pool())
                .await
                .unwrap();
            let idem = Idempotency::new(Arc::new(store.clone()));
            let floor = floor_pool(&dir.join(format!("floor-{conc}.db"))).await;
            let target = if conc == 1 { 0.9 } else { 4.0 };
            compare(
                n,
                conc,
                Some(target),
                |run| ours_op(idem.clone(), run, sqlite_phase(store.clone())),
                |run| floor_op(floor.clone(), run),
            )
            .await;
            let w = store.writer_stats();
            println!(
                "    idemflow's writer: {} commits carried {} writes (mean batch {:.1}), {} \
                 batches rolled back",
                w.commits,
                w.writes,
                w.writes as f64 / w.commits.max(1) as f64,
                w.rolled_back
            );
        });
    }
    #[cfg(feature = "postgres")]
    if let Some(url) = std::env::var("IDEMFLOW_BENCH_POSTGRES_URL")
        .ok()
        .filter(|u| !u.is_empty())
    {
        pg::run(&url, n);
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use idemflow::store::PoolOptions;
    use idemflow::store::postgres::PostgresStore;
    use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
    use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};
    use std::str::FromStr;

    const POOL: u32 = 16;

    fn schema() -> String {
        format!("idemflow_bench_one_commit_{}", std::process::id())
    }

    pub fn run(url: &str, n: usize) {
        println!(
            "\none commit for local work: PostgreSQL, synchronous_commit as the server has it, \
             N = {n} new keys each, pools of {POOL}"
        );
        runtime(1).block_on(async {
            let mut c = PgConnection::connect(url).await.unwrap();
            c.execute(AssertSqlSafe(format!("CREATE SCHEMA {}", schema())))
                .await
                .unwrap();
        });
        for conc in callers() {
            runtime(conc).block_on(async {
                let sep = if url.contains('?') { '&' } else { '?' };
                let store = PostgresStore::connect_with(
                    &format!("{url}{sep}options=-c%20search_path%3D{}", schema()),
                    PoolOptions::default().max_connections(POOL),
                )
                .await
                .unwrap();
                store.migrate().await.unwrap();
                let floor = PgPoolOptions::new()
                    .max_connections(POOL)
                    .test_before_acquire(false)
                    .connect_with(
                        PgConnectOptions::from_str(url)
                            .unwrap()
                            .options([("search_path", schema().as_str())]),
                    )
                    .await
                    .unwrap();
                for sql in [
                    "CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, amount bigint NOT \
                     NULL, created_at bigint)",
                    "CREATE TABLE IF NOT EXISTS floor_orders (id text PRIMARY KEY, amount bigint \
                     NOT NULL, created_at bigint)",
                    "CREATE TABLE IF NOT EXISTS raw_keys (scope text NOT NULL, key text NOT \
                     NULL, state text NOT NULL, fingerprint text NOT NULL, response bytea, \
                     expires_at timestamptz NOT NULL, PRIMARY KEY (scope, key))",
                ] {
                    sqlx::query(sql).execute(&floor).await.unwrap();
                }
                let idem = Idempotency::new(Arc::new(store.clone()));
                compare(
                    n,
                    conc,
                    None,
                    |run| ours_op(idem.clone(), run, pg_phase(store.clone())),
                    |run| floor_op(floor.clone(), run),
                )
                .await;
                store.pool().close().await;
                floor.close().await;
            });
        }
        runtime(1).block_on(async {
            let mut c = PgConnection::connect(url).await.unwrap();
            c.execute(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", schema())))
                .await
                .unwrap();
        });
    }

    /// The seed's design on PostgreSQL: one transaction per new key.
    fn floor_op(pool: PgPool, run: usize) -> impl Fn(usize) -> BoxFut + Send + Sync + 'static {
        move |i| {
            let pool = pool.clone();
            Box::pin(async move {
                let key = format!("{run}-{i}");
                let mut tx = pool.begin().await.unwrap();
                let claimed = sqlx::query(
                    "INSERT INTO raw_keys (scope, key, state, fingerprint, expires_at) \
                     VALUES ('raw', $1, 'processing', 'v1:x', now() + interval '1 day') \
                     ON CONFLICT DO NOTHING",
                )
                .bind(&key)
                .execute(&mut *tx)
                .await
                .unwrap();
                assert_eq!(claimed.rows_affected(), 1);
                sqlx::query(
                    "INSERT INTO floor_orders (id, amount, created_at) VALUES ($1, 1999, 0)",
                )
                .bind(&key)
                .execute(&mut *tx)
                .await
                .unwrap();
                sqlx::query(
                    "UPDATE raw_keys SET state = 'done', response = $2 \
                     WHERE scope = 'raw' AND key = $1",
                )
                .bind(&key)
                .bind(BODY)
                .execute(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
            })
        }
    }

    /// The PostgreSQL phase: the order's row, in the key's transaction.
    fn pg_phase(store: PostgresStore) -> impl Fn(String) -> Box<dyn AtomicPhase> + Send + Sync {
        move |key| {
            Box::new(store.atomic_phase(move |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO orders (id, amount, created_at) VALUES ($1, 1999, 0)")
                        .bind(&key)
                        .execute(&mut *conn)
                        .await?;
                    Ok(StoredResponse::new(201).with_body(BODY))
                })
            }))
        }
    }
}
