//! Throughput against raw floors, the way users call idemflow (issue 12; method and latest
//! figures in `docs/performance.md`).
//!
//! ```text
//! cargo bench --bench throughput --all-features
//! ```
//!
//! SQLite (file, WAL, `synchronous=FULL`) always runs; PostgreSQL, MariaDB / MySQL and Redis run
//! when `IDEMFLOW_BENCH_POSTGRES_URL` / `IDEMFLOW_BENCH_MYSQL_URL` / `IDEMFLOW_BENCH_REDIS_URL`
//! are set (and the matching feature is on), each in a schema / database / key prefix of its own
//! that is dropped afterwards. `IDEMFLOW_BENCH_SQLITE=0` skips SQLite.
//!
//! - `IDEMFLOW_BENCH_N`: keys per measurement (default 10,000).
//! - `IDEMFLOW_BENCH_CALLERS`: only these new-key measurements, e.g. `64` or `8,64` (default
//!   all: `1,8,64`); when set, the replays, the storm, the bytes pass and the targets are skipped.
//! - `IDEMFLOW_BENCH_PG_POOL`: PostgreSQL pool size cap (default 24): idemflow and the floor
//!   each get a pool of min(callers, this) connections.
//! - `IDEMFLOW_BENCH_PG_IDEMFLOW_POOL`: the cap of idemflow's PostgreSQL pool alone (default
//!   `IDEMFLOW_BENCH_PG_POOL`), to vary idemflow's pool beside a fixed floor.
//! - `IDEMFLOW_BENCH_MYSQL_POOL`, `IDEMFLOW_BENCH_MYSQL_IDEMFLOW_POOL`: the same for MariaDB /
//!   MySQL (default 64).
//! - `IDEMFLOW_BENCH_POOL_FIXED=1`: each PostgreSQL / MariaDB pool gets its cap whatever the
//!   number of callers (so one caller has spare connections, as with the stores' default pool
//!   of 16: sqlx pings a connection given back to its pool, and the next call then takes another).
//! - `IDEMFLOW_BENCH_PG_WAL=1`: around each PostgreSQL new-key measurement, also print per key
//!   the server's `pg_stat_wal` counts (records, full-page images, bytes, writes, syncs) and the
//!   database's commits (`pg_stat_database.xact_commit`); adds ~1.2 s per measurement. The
//!   PostgreSQL pools are named (`application_name`) `idemflow_bench_store` and
//!   `idemflow_bench_floor`, so that `pg_stat_activity` can be grouped by side.
//!
//! Per backend: `Idempotency::execute` on new, distinct keys with 1, 8 and 64 concurrent callers
//! (tokio `current_thread` for 1 caller, `multi_thread` for 8 and 64), replays (1 caller: from
//! the executor's replay cache, then with the cache off, from the store) and
//! 1,000 concurrent duplicates of one key (the body must run once), each beside its raw floor
//! measured in the same run: the statements a hand-written implementation issues on a lean table
//! (claim insert ignoring duplicates + update to done; a primary-key read; Redis `SET NX` + `SET`
//! and `GET`) at the same concurrency. Then bytes written per new key (SQLite WAL growth,
//! PostgreSQL WAL from `pg_current_wal_lsn()`, Redis `used_memory`) and the targets.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idemflow::{Execution, Idempotency, IdempotentRequest, Outcome, StoredResponse};

mod support;

const BODY: &[u8] = br#"{"id":"pi_3NxYz2eZvKYlo2C0","status":"succeeded","amount":1999}"#;
const DUPLICATES: usize = 1000;
/// How long the body of the duplicate storm's winner takes.
const STORM_BODY: Duration = Duration::from_millis(50);

type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send>>;
/// A raw claim: insert ignoring duplicates; if this call inserted, (sleep `body`, then) mark
/// done with the response. Returns whether it inserted.
type RawNew = Arc<dyn Fn(String, Duration) -> BoxFut<bool> + Send + Sync>;
/// A raw primary-key read; returns whether the key was found.
type RawRead = Arc<dyn Fn(String) -> BoxFut<bool> + Send + Sync>;
/// Bytes counter (WAL size or position, used_memory); `true` for idemflow's side.
type Counter = Arc<dyn Fn(bool) -> BoxFut<i64> + Send + Sync>;
/// Server-side counters (name, cumulative value) read before and after each new-key
/// measurement, printed per key (PostgreSQL with `IDEMFLOW_BENCH_PG_WAL=1`).
type Probe = Arc<dyn Fn() -> BoxFut<Vec<(&'static str, i64)>> + Send + Sync>;

/// What one measurement phase needs, connected inside the phase's runtime.
struct Phase {
    idem: Idempotency,
    raw_new: RawNew,
    raw_read: RawRead,
    counter: Option<Counter>,
    probe: Option<Probe>,
}

/// A PostgreSQL / MariaDB pool's size for `conc` callers under `cap`: `conc` at most, or the cap
/// whatever the callers with `IDEMFLOW_BENCH_POOL_FIXED=1`.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn pool_size(conc: usize, cap: usize) -> u32 {
    let size = if std::env::var("IDEMFLOW_BENCH_POOL_FIXED").is_ok() {
        cap
    } else {
        conc.min(cap)
    };
    u32::try_from(size).expect("a pool size")
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn url_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

// ---------------------------------------------------------------------------------------------
// Measuring and printing

#[derive(Clone, Copy, Default)]
struct Stats {
    ops_per_s: f64,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

/// Runs `op(i)` for i in 0..n on `conc` spawned tasks that take the next index as they go.
async fn measure<F>(n: usize, conc: usize, op: F) -> Stats
where
    F: Fn(usize) -> BoxFut<()> + Send + Sync + 'static,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (op, next) = (op.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
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
        }));
    }
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
        max: lat[lat.len() - 1],
    }
}

/// The probe's counters now, or none without a probe.
async fn counters(probe: &Option<Probe>) -> Vec<(&'static str, i64)> {
    match probe {
        Some(probe) => probe().await,
        None => Vec::new(),
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn line(label: &str, s: &Stats) {
    println!(
        "    {label:<34} {:>9.0} ops/s  p50 {:>8.3} ms  p99 {:>8.3} ms  max {:>8.3} ms",
        s.ops_per_s,
        ms(s.p50),
        ms(s.p99),
        ms(s.max)
    );
}

/// Prints idemflow's row, its floor's row and the ratio; returns the ratio.
fn pair(title: &str, runtime: &str, ours: &Stats, floor: &Stats, floor_name: &str) -> f64 {
    let ratio = ours.ops_per_s / floor.ops_per_s;
    println!("  {title} [tokio {runtime}]");
    line("idemflow execute()", ours);
    line(floor_name, floor);
    println!("    ratio idemflow / floor: {ratio:.2}x");
    ratio
}

fn runtime(conc: usize) -> (tokio::runtime::Runtime, &'static str) {
    if conc == 1 {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        (rt, "current_thread")
    } else {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        (rt, "multi_thread")
    }
}

fn request(key: &str) -> IdempotentRequest {
    IdempotentRequest::new(
        "bench",
        key,
        "payments.create",
        &serde_json::json!({"amount": 1999, "currency": "eur", "key": key}),
    )
    .unwrap()
}

fn respond() -> Outcome {
    Outcome::Succeeded(StoredResponse::new(201).with_body(BODY))
}

/// Targets of issue 12, filled as the backends run and printed at the end (not when
/// `IDEMFLOW_BENCH_CALLERS` leaves measurements out).
struct Targets(Vec<String>);

impl Targets {
    fn check(&mut self, what: &str, measured: String, ok: bool) {
        self.put(what, measured, if ok { "met" } else { "missed" });
    }

    fn put(&mut self, what: &str, measured: String, v: &str) {
        if callers() != CALLERS {
            return;
        }
        let s = format!("  {what:<58} {measured:<28} {v}");
        println!("{s}");
        self.0.push(s);
    }
}

/// What a backend measured, for its targets.
struct Measured {
    new: [(Stats, Stats); 3],
    replay: f64,
    /// Bytes per new key (idemflow, floor), if the backend reports them.
    bytes: Option<(f64, f64)>,
}

const CALLERS: [usize; 3] = [1, 8, 64];

/// The caller counts to measure: `IDEMFLOW_BENCH_CALLERS` (a comma-separated subset of
/// `CALLERS`), or all of them.
fn callers() -> Vec<usize> {
    match std::env::var("IDEMFLOW_BENCH_CALLERS") {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|c| c.trim().parse().expect("IDEMFLOW_BENCH_CALLERS: numbers"))
            .filter(|c| CALLERS.contains(c))
            .collect(),
        _ => CALLERS.to_vec(),
    }
}

/// Runs every measurement on one backend. `phase(conc, tag)` connects inside the current runtime;
/// `tag` names the phase (keys are `{tag}-{i}`).
fn run_backend<P, Fp>(
    name: &str,
    n: usize,
    phase: P,
    bytes_label: &str,
    floor_name: &str,
) -> Measured
where
    P: Fn(usize, bool) -> Fp,
    Fp: Future<Output = Phase>,
{
    let mut new = Vec::new();
    let mut replay = 0.0;
    for conc in CALLERS {
        if !callers().contains(&conc) {
            new.push(Default::default());
            continue;
        }
        let (rt, rt_name) = runtime(conc);
        rt.block_on(async {
            let p = phase(conc, false).await;
            let tag = format!("c{conc}");
            let probe = p.probe.clone();
            let s0 = counters(&probe).await;
            let raw_new = p.raw_new.clone();
            let t = tag.clone();
            let floor_from = unix_now();
            let floor = measure(n, conc, move |i| {
                let f = raw_new(format!("{t}-{i}"), Duration::ZERO);
                Box::pin(async move { assert!(f.await, "raw floor: a new key was not inserted") })
            })
            .await;
            let floor_to = unix_now();
            let s1 = counters(&probe).await;
            let idem = p.idem.clone();
            let t = tag.clone();
            let ours_from = unix_now();
            let ours = measure(n, conc, move |i| {
                let idem = idem.clone();
                let key = format!("{t}-{i}");
                Box::pin(async move {
                    let r = idem
                        .execute(request(&key), |_ctx| async { respond() })
                        .await
                        .unwrap();
                    assert!(!r.is_replay());
                })
            })
            .await;
            let ours_to = unix_now();
            let s2 = counters(&probe).await;
            pair(
                &format!("{name}: new keys, {conc} caller(s)"),
                rt_name,
                &ours,
                &floor,
                &format!("raw floor: {floor_name}"),
            );
            if !s0.is_empty() {
                println!(
                    "    server counters per key (idemflow / floor); unix time: idemflow \
                     {ours_from:.3}-{ours_to:.3}, floor {floor_from:.3}-{floor_to:.3}"
                );
                for (((k, a), (_, b)), (_, c)) in s0.iter().zip(&s1).zip(&s2) {
                    let per = |d: i64| d as f64 / n as f64;
                    println!("      {k:<12} {:>9.3} / {:>9.3}", per(c - b), per(b - a));
                }
            }
            new.push((ours, floor));
            if conc == 1 {
                let raw_read = p.raw_read.clone();
                let floor = measure(n, 1, move |i| {
                    let f = raw_read(format!("c1-{i}"));
                    Box::pin(async move { assert!(f.await, "raw read: key missing") })
                })
                .await;
                // Replays of the keys just written, 1 caller, through `idem`.
                let replays = |idem: Idempotency| {
                    measure(n, 1, move |i| {
                        let idem = idem.clone();
                        Box::pin(async move {
                            let r = idem
                                .execute(request(&format!("c1-{i}")), |_ctx| async {
                                    unreachable!("replay only")
                                })
                                .await
                                .unwrap();
                            assert!(r.is_replay());
                        })
                    })
                };
                let ours = replays(p.idem.clone()).await;
                replay = pair(
                    &format!("{name}: replays, 1 caller"),
                    rt_name,
                    &ours,
                    &floor,
                    "raw floor: primary-key read",
                );
                // The same replays with the replay cache off: each one reads the store.
                let stored = replays(p.idem.clone().replay_cache_bytes(0)).await;
                pair(
                    &format!("{name}: replays from the store (cache off), 1 caller"),
                    rt_name,
                    &stored,
                    &floor,
                    "raw floor: primary-key read",
                );
            }
        });
    }

    if callers() != CALLERS {
        return Measured {
            new: [new[0], new[1], new[2]],
            replay,
            bytes: None,
        };
    }
    // The duplicate storm.
    let (rt, rt_name) = runtime(DUPLICATES);
    rt.block_on(async {
        let p = phase(DUPLICATES, false).await;
        let runs = Arc::new(AtomicUsize::new(0));
        let executed = Arc::new(AtomicUsize::new(0));
        let (idem, r, e) = (p.idem.clone(), runs.clone(), executed.clone());
        let ours = measure(DUPLICATES, DUPLICATES, move |_| {
            let (idem, r, e) = (idem.clone(), r.clone(), e.clone());
            Box::pin(async move {
                let out = idem
                    .execute(request("storm"), |_ctx| async move {
                        r.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(STORM_BODY).await;
                        respond()
                    })
                    .await;
                if let Ok(Execution::Executed(_)) = out {
                    e.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .await;
        let won = Arc::new(AtomicUsize::new(0));
        let (raw_new, w) = (p.raw_new.clone(), won.clone());
        let floor = measure(DUPLICATES, DUPLICATES, move |_| {
            let (f, w) = (raw_new("storm".into(), STORM_BODY), w.clone());
            Box::pin(async move {
                if f.await {
                    w.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .await;
        let (runs, executed, won) = (
            runs.load(Ordering::SeqCst),
            executed.load(Ordering::SeqCst),
            won.load(Ordering::SeqCst),
        );
        pair(
            &format!(
                "{name}: {DUPLICATES} concurrent duplicates of one key (body {} ms)",
                STORM_BODY.as_millis()
            ),
            rt_name,
            &ours,
            &floor,
            "raw floor: claim, winner sleeps+done",
        );
        println!(
            "    body ran {runs} time(s), {executed} Executed; raw: {won} insert(s) won (must be 1)"
        );
        assert_eq!(
            runs, 1,
            "{name}: the duplicate storm ran the body {runs} times"
        );
        assert_eq!(executed, 1, "{name}: {executed} callers got Executed");
        assert_eq!(
            won, 1,
            "{name}: raw floor claimed the storm key {won} times"
        );
    });

    // Bytes written per new key: a separate, sequential pass so the timed runs are untouched.
    let m = n.min(2000);
    let (rt, _) = runtime(1);
    let bytes = rt.block_on(async {
        let p = phase(1, true).await;
        let counter = p.counter.clone()?;
        let before = counter(true).await;
        let idem = p.idem.clone();
        measure(m, 1, move |i| {
            let idem = idem.clone();
            Box::pin(async move {
                idem.execute(request(&format!("bytes-{i}")), |_ctx| async { respond() })
                    .await
                    .unwrap();
            })
        })
        .await;
        let ours = (counter(true).await - before) as f64 / m as f64;
        let before = counter(false).await;
        let raw_new = p.raw_new.clone();
        measure(m, 1, move |i| {
            let f = raw_new(format!("bytes-{i}"), Duration::ZERO);
            Box::pin(async move {
                f.await;
            })
        })
        .await;
        let raw = (counter(false).await - before) as f64 / m as f64;
        println!(
            "  {name}: {bytes_label} per new key over {m} keys, 1 caller: idemflow {ours:.0} B, \
             raw floor {raw:.0} B ({:.2}x)",
            ours / raw
        );
        Some((ours, raw))
    });
    Measured {
        new: [new[0], new[1], new[2]],
        replay,
        bytes,
    }
}

fn ratio(m: &Measured, i: usize) -> f64 {
    m.new[i].0.ops_per_s / m.new[i].1.ops_per_s
}

// ---------------------------------------------------------------------------------------------
// SQLite

mod sqlite {
    use std::path::{Path, PathBuf};
    use std::sync::Arc;
    use std::time::Duration;

    use idemflow::store::sqlite::SqliteStore;
    use idemflow::{Idempotency, Store};
    use sqlx::sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
    };

    use super::{BODY, Counter, Phase, RawNew, RawRead};

    pub use crate::support::sqlite_floor::LEAN;

    pub async fn phase(dir: &Path, bytes: bool) -> Phase {
        let ours_path: PathBuf = dir.join("idemflow.db");
        let raw_path: PathBuf = dir.join("raw.db");
        let store = SqliteStore::connect(&format!("sqlite://{}", ours_path.display()))
            .await
            .unwrap();
        store.migrate().await.unwrap();
        // The raw floor: one connection, as a hand-written SQLite implementation would have.
        let raw = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(&raw_path)
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    .busy_timeout(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        sqlx::query(LEAN).execute(&raw).await.unwrap();
        let mut counter = None;
        if bytes {
            // WAL growth is only the bytes written if nothing checkpoints (and rewinds the WAL)
            // meanwhile: start from an empty WAL, automatic checkpoints off for this pass.
            for pool in [store.writer_pool(), &raw] {
                sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
                    .execute(pool)
                    .await
                    .unwrap();
                sqlx::query("PRAGMA wal_autocheckpoint = 0")
                    .execute(pool)
                    .await
                    .unwrap();
            }
            let (o, r) = (wal(&ours_path), wal(&raw_path));
            let c: Counter = Arc::new(move |ours| {
                let p = if ours { o.clone() } else { r.clone() };
                Box::pin(async move { std::fs::metadata(&p).map_or(0, |m| m.len() as i64) })
            });
            counter = Some(c);
        }
        let pool = raw.clone();
        let raw_new: RawNew = Arc::new(move |key, body| {
            let pool = pool.clone();
            Box::pin(async move {
                let ins = sqlx::query(crate::support::sqlite_floor::CLAIM)
                    .bind(&key)
                    .execute(&pool)
                    .await
                    .unwrap();
                if ins.rows_affected() == 0 {
                    return false;
                }
                if !body.is_zero() {
                    // (not for zero: tokio's timer would round it up to its 1 ms tick)
                    tokio::time::sleep(body).await;
                }
                sqlx::query(crate::support::sqlite_floor::DONE)
                    .bind(&key)
                    .bind(BODY)
                    .execute(&pool)
                    .await
                    .unwrap();
                true
            })
        });
        let pool = raw.clone();
        let raw_read: RawRead = Arc::new(move |key| {
            let pool = pool.clone();
            Box::pin(async move {
                let row: Option<(String, Option<Vec<u8>>)> = sqlx::query_as(
                    "SELECT state, response FROM raw_keys WHERE scope = 'raw' AND key = ?1",
                )
                .bind(&key)
                .fetch_optional(&pool)
                .await
                .unwrap();
                row.is_some()
            })
        });
        Phase {
            idem: Idempotency::new(Arc::new(store)),
            raw_new,
            raw_read,
            counter,
            probe: None,
        }
    }

    fn wal(db: &Path) -> PathBuf {
        let mut s = db.as_os_str().to_owned();
        s.push("-wal");
        PathBuf::from(s)
    }
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL

#[cfg(feature = "postgres")]
mod pg {
    use std::str::FromStr;
    use std::sync::Arc;
    use std::time::Duration;

    use idemflow::store::PoolOptions;
    use idemflow::store::postgres::PostgresStore;
    use idemflow::{Idempotency, Store};
    use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
    use sqlx::{AssertSqlSafe, Connection, Executor};

    use super::{BODY, Counter, Phase, Probe, RawNew, RawRead};

    pub fn schema() -> String {
        format!("idemflow_bench_{}", std::process::id())
    }

    pub async fn describe(url: &str) -> String {
        let mut c = PgConnection::connect(url).await.unwrap();
        let (v, sc): (String, String) = sqlx::query_as(
            "SELECT current_setting('server_version'), current_setting('synchronous_commit')",
        )
        .fetch_one(&mut c)
        .await
        .unwrap();
        format!("PostgreSQL {v}, synchronous_commit={sc}")
    }

    pub async fn setup(url: &str) {
        let s = schema();
        let mut c = PgConnection::connect(url).await.unwrap();
        c.execute(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {s} CASCADE")))
            .await
            .unwrap();
        c.execute(AssertSqlSafe(format!("CREATE SCHEMA {s}")))
            .await
            .unwrap();
        c.execute(AssertSqlSafe(format!(
            "CREATE TABLE {s}.raw_keys (scope TEXT NOT NULL, key TEXT NOT NULL, \
             state TEXT NOT NULL, fingerprint TEXT NOT NULL, response BYTEA, \
             expires_at TIMESTAMPTZ NOT NULL, PRIMARY KEY (scope, key))"
        )))
        .await
        .unwrap();
    }

    pub async fn cleanup(url: &str) {
        let mut c = PgConnection::connect(url).await.unwrap();
        c.execute(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", schema())))
            .await
            .unwrap();
    }

    /// idemflow and the floor each get a pool of `conc` connections, at most
    /// `IDEMFLOW_BENCH_PG_POOL` (default 24: both pools must fit the server's `max_connections`
    /// beside its other clients).
    pub fn pool_cap() -> usize {
        super::env("IDEMFLOW_BENCH_PG_POOL", 24)
    }

    /// idemflow's pool cap alone: `IDEMFLOW_BENCH_PG_IDEMFLOW_POOL`, default [`pool_cap`].
    pub fn idemflow_pool_cap() -> usize {
        super::env("IDEMFLOW_BENCH_PG_IDEMFLOW_POOL", pool_cap())
    }

    pub async fn phase(url: &str, conc: usize) -> Phase {
        let size = super::pool_size(conc, pool_cap());
        let idemflow_size = super::pool_size(conc, idemflow_pool_cap());
        let options = PgConnectOptions::from_str(url)
            .unwrap()
            .options([("search_path", schema().as_str())]);
        // idemflow as a user gets it: `connect_with` and its pool (the schema through the URL).
        // Named so that pg_stat_activity tells idemflow's connections from the floor's.
        let sep = if url.contains('?') { '&' } else { '?' };
        let store_url = format!(
            "{url}{sep}options=-c%20search_path%3D{}&application_name=idemflow_bench_store",
            schema()
        );
        let store = PostgresStore::connect_with(
            &store_url,
            PoolOptions::default().max_connections(idemflow_size),
        )
        .await
        .unwrap();
        store.migrate().await.unwrap();
        // The floor's pool pings no connection before handing it over (sqlx's default pings
        // each time: a round trip per statement).
        let raw = PgPoolOptions::new()
            .max_connections(size)
            .test_before_acquire(false)
            .connect_with(options.clone().application_name("idemflow_bench_floor"))
            .await
            .unwrap();
        let p = raw.clone();
        let raw_new: RawNew = Arc::new(move |key, body| {
            let pool = p.clone();
            Box::pin(async move {
                let ins = sqlx::query(
                    "INSERT INTO raw_keys (scope, key, state, fingerprint, expires_at) \
                     VALUES ('raw', $1, 'processing', 'v1:x', now() + interval '1 day') \
                     ON CONFLICT DO NOTHING",
                )
                .bind(&key)
                .execute(&pool)
                .await
                .unwrap();
                if ins.rows_affected() == 0 {
                    return false;
                }
                if !body.is_zero() {
                    // (not for zero: tokio's timer would round it up to its 1 ms tick)
                    tokio::time::sleep(body).await;
                }
                sqlx::query(
                    "UPDATE raw_keys SET state = 'done', response = $2 \
                     WHERE scope = 'raw' AND key = $1",
                )
                .bind(&key)
                .bind(BODY)
                .execute(&pool)
                .await
                .unwrap();
                true
            })
        });
        let p = raw.clone();
        let raw_read: RawRead = Arc::new(move |key| {
            let pool = p.clone();
            Box::pin(async move {
                let row: Option<(String, Option<Vec<u8>>)> = sqlx::query_as(
                    "SELECT state, response FROM raw_keys WHERE scope = 'raw' AND key = $1",
                )
                .bind(&key)
                .fetch_optional(&pool)
                .await
                .unwrap();
                row.is_some()
            })
        });
        let p = raw.clone();
        // Server-wide WAL position: other clients of the same server add to it.
        let counter: Counter = Arc::new(move |_| {
            let pool = p.clone();
            Box::pin(async move {
                let (lsn,): (i64,) =
                    sqlx::query_as("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                lsn
            })
        });
        let probe = (std::env::var("IDEMFLOW_BENCH_PG_WAL").as_deref() == Ok("1"))
            .then(|| probe(url, vec![store.pool().clone(), raw.clone()]));
        Phase {
            idem: Idempotency::new(Arc::new(store)),
            raw_new,
            raw_read,
            counter: Some(counter),
            probe,
        }
    }

    /// Reads `pg_stat_wal` and the database's commit count. A backend publishes its WAL and
    /// transaction counts when it goes idle at least 1 s after its last report, so the probe
    /// waits 1.1 s, then runs `SELECT 1` on every connection of `pools` before reading.
    /// Server-wide: other clients of the server add to these counts.
    fn probe(url: &str, pools: Vec<PgPool>) -> Probe {
        let url = url.to_string();
        Arc::new(move || {
            let (url, pools) = (url.clone(), pools.clone());
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(1100)).await;
                for pool in &pools {
                    let mut held = Vec::new();
                    for _ in 0..pool.options().get_max_connections() {
                        let mut c = pool.acquire().await.unwrap();
                        sqlx::query("SELECT 1").execute(&mut *c).await.unwrap();
                        held.push(c);
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut c = PgConnection::connect(&url).await.unwrap();
                let row: (i64, i64, i64, i64, i64, i64) = sqlx::query_as(
                    "SELECT w.wal_records, w.wal_fpi, w.wal_bytes::bigint, w.wal_write, \
                     w.wal_sync, d.xact_commit FROM pg_stat_wal w, pg_stat_database d \
                     WHERE d.datname = current_database()",
                )
                .fetch_one(&mut c)
                .await
                .unwrap();
                let _ = c.close().await;
                vec![
                    ("wal_records", row.0),
                    ("wal_fpi", row.1),
                    ("wal_bytes", row.2),
                    ("wal_write", row.3),
                    ("wal_sync", row.4),
                    ("xact_commit", row.5),
                ]
            })
        })
    }
}

// ---------------------------------------------------------------------------------------------
// MariaDB / MySQL

#[cfg(feature = "mysql")]
mod my {
    use std::str::FromStr;
    use std::sync::Arc;

    use idemflow::store::PoolOptions;
    use idemflow::store::mysql::MySqlStore;
    use idemflow::{Idempotency, Store};
    use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPoolOptions};
    use sqlx::{AssertSqlSafe, ConnectOptions, Executor};

    use super::{BODY, Phase, RawNew, RawRead};

    pub fn database() -> String {
        format!("idemflow_bench_{}", std::process::id())
    }

    async fn admin(url: &str) -> MySqlConnection {
        MySqlConnectOptions::from_str(url)
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn describe(url: &str) -> String {
        let mut c = admin(url).await;
        let (v, flush): (String, i64) =
            sqlx::query_as("SELECT VERSION(), CAST(@@innodb_flush_log_at_trx_commit AS SIGNED)")
                .fetch_one(&mut c)
                .await
                .unwrap();
        format!("{v}, innodb_flush_log_at_trx_commit={flush}")
    }

    pub async fn setup(url: &str) {
        let d = database();
        let mut c = admin(url).await;
        c.execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {d}")))
            .await
            .unwrap();
        c.execute(AssertSqlSafe(format!("CREATE DATABASE {d}")))
            .await
            .unwrap();
        c.execute(AssertSqlSafe(format!(
            "CREATE TABLE {d}.raw_keys (scope VARCHAR(255) NOT NULL, `key` VARCHAR(255) NOT NULL, \
             state VARCHAR(16) NOT NULL, fingerprint VARCHAR(80) NOT NULL, response BLOB, \
             expires_at DATETIME(6) NOT NULL, PRIMARY KEY (scope, `key`))"
        )))
        .await
        .unwrap();
    }

    pub async fn cleanup(url: &str) {
        let mut c = admin(url).await;
        c.execute(AssertSqlSafe(format!("DROP DATABASE {}", database())))
            .await
            .unwrap();
    }

    /// idemflow's and the floor's pool caps: `IDEMFLOW_BENCH_MYSQL_IDEMFLOW_POOL` (idemflow's
    /// alone) and `IDEMFLOW_BENCH_MYSQL_POOL` (both; default 64).
    pub fn pool_caps() -> (usize, usize) {
        let both = super::env("IDEMFLOW_BENCH_MYSQL_POOL", 64);
        (super::env("IDEMFLOW_BENCH_MYSQL_IDEMFLOW_POOL", both), both)
    }

    pub async fn phase(url: &str, conc: usize) -> Phase {
        let (idemflow_cap, cap) = pool_caps();
        let (idemflow_size, size) = (
            super::pool_size(conc, idemflow_cap),
            super::pool_size(conc, cap),
        );
        let options = MySqlConnectOptions::from_str(url)
            .unwrap()
            .database(&database());
        // idemflow as a user gets it: `connect_with` and its pool.
        let base = url.split('?').next().unwrap_or(url);
        let store_url = format!(
            "{}/{}",
            base.rsplit_once('/').map_or(base, |(server, _)| server),
            database()
        );
        let store = MySqlStore::connect_with(
            &store_url,
            PoolOptions::default().max_connections(idemflow_size),
        )
        .await
        .unwrap();
        store.migrate().await.unwrap();
        // The floor's pool pings no connection before handing it over (sqlx's default pings
        // each time: a round trip per statement).
        let raw = MySqlPoolOptions::new()
            .max_connections(size)
            .test_before_acquire(false)
            .connect_with(options.clone())
            .await
            .unwrap();
        let p = raw.clone();
        let raw_new: RawNew = Arc::new(move |key, body| {
            let pool = p.clone();
            Box::pin(async move {
                let ins = sqlx::query(
                    "INSERT IGNORE INTO raw_keys (scope, `key`, state, fingerprint, expires_at) \
                     VALUES ('raw', ?, 'processing', 'v1:x', UTC_TIMESTAMP(6) + INTERVAL 1 DAY)",
                )
                .bind(&key)
                .execute(&pool)
                .await
                .unwrap();
                if ins.rows_affected() == 0 {
                    return false;
                }
                if !body.is_zero() {
                    // (not for zero: tokio's timer would round it up to its 1 ms tick)
                    tokio::time::sleep(body).await;
                }
                sqlx::query(
                    "UPDATE raw_keys SET state = 'done', response = ? \
                     WHERE scope = 'raw' AND `key` = ?",
                )
                .bind(BODY)
                .bind(&key)
                .execute(&pool)
                .await
                .unwrap();
                true
            })
        });
        let p = raw.clone();
        let raw_read: RawRead = Arc::new(move |key| {
            let pool = p.clone();
            Box::pin(async move {
                let row: Option<(String, Option<Vec<u8>>)> = sqlx::query_as(
                    "SELECT state, response FROM raw_keys WHERE scope = 'raw' AND `key` = ?",
                )
                .bind(&key)
                .fetch_optional(&pool)
                .await
                .unwrap();
                row.is_some()
            })
        });
        Phase {
            idem: Idempotency::new(Arc::new(store)),
            raw_new,
            raw_read,
            counter: None,
            probe: None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Redis

#[cfg(feature = "redis")]
mod rd {
    use std::sync::Arc;

    use idemflow::store::redis::{RedisConfig, RedisStore};
    use idemflow::{Idempotency, Store};
    use redis::aio::ConnectionManager;

    use super::{BODY, Counter, Phase, RawNew, RawRead};

    pub fn prefix() -> String {
        format!("idemflow-bench-{}", std::process::id())
    }

    async fn con(url: &str) -> ConnectionManager {
        redis::Client::open(url)
            .unwrap()
            .get_connection_manager()
            .await
            .unwrap()
    }

    pub async fn describe(url: &str) -> String {
        let mut c = con(url).await;
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut c)
            .await
            .unwrap();
        let v = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .unwrap_or("?")
            .trim()
            .to_string();
        format!("Redis {v}, one multiplexed connection each")
    }

    pub async fn used_memory(c: &mut ConnectionManager) -> i64 {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(c)
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    }

    /// Deletes every key of this run (idemflow's prefix and the raw floor's).
    pub async fn cleanup(url: &str) {
        let mut c = con(url).await;
        crate::support::unlink_matching(&mut c, &format!("{}*", prefix())).await;
    }

    pub async fn phase(url: &str) -> Phase {
        let store = RedisStore::connect_with(RedisConfig::new(url).prefix(prefix()))
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let raw = con(url).await;
        let raw_prefix = format!("{}-raw", prefix());
        let (c, rp) = (raw.clone(), raw_prefix.clone());
        let raw_new: RawNew = Arc::new(move |key, body| {
            let (mut c, key) = (c.clone(), format!("{rp}:{key}"));
            Box::pin(async move {
                let ok: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg("processing")
                    .arg("NX")
                    .arg("PX")
                    .arg(30_000)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                if ok.is_none() {
                    return false;
                }
                if !body.is_zero() {
                    // (not for zero: tokio's timer would round it up to its 1 ms tick)
                    tokio::time::sleep(body).await;
                }
                let _: () = redis::cmd("SET")
                    .arg(&key)
                    .arg(BODY)
                    .arg("PX")
                    .arg(86_400_000)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                true
            })
        });
        let (c, rp) = (raw.clone(), raw_prefix);
        let raw_read: RawRead = Arc::new(move |key| {
            let (mut c, key) = (c.clone(), format!("{rp}:{key}"));
            Box::pin(async move {
                let v: Option<Vec<u8>> = redis::cmd("GET")
                    .arg(&key)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                v.is_some()
            })
        });
        let c = raw.clone();
        let counter: Counter = Arc::new(move |_| {
            let mut c = c.clone();
            Box::pin(async move { used_memory(&mut c).await })
        });
        Phase {
            idem: Idempotency::new(Arc::new(store)),
            raw_new,
            raw_read,
            counter: Some(counter),
            probe: None,
        }
    }
}

// ---------------------------------------------------------------------------------------------

/// Runs `f` to its end on a runtime of its own (the server backends' set-up and descriptions).
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
fn block<F: Future>(f: F) -> F::Output {
    runtime(1).0.block_on(f)
}

#[allow(unused_variables, unused_mut)]
fn main() {
    let n = env("IDEMFLOW_BENCH_N", 10_000);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "idemflow throughput: N={n} keys per measurement, callers 1 (tokio current_thread) and \
         8 / 64 (tokio multi_thread), {} cores, load average at start: {}",
        std::thread::available_parallelism().map_or(0, |p| p.get()),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut targets = Targets(Vec::new());

    if std::env::var("IDEMFLOW_BENCH_SQLITE").as_deref() != Ok("0") {
        let dir = tempfile::tempdir().unwrap();
        println!(
            "\n== SQLite file, WAL, synchronous=FULL (idemflow: SqliteStore::connect, 1 writer \
             connection; floor: 1 connection)"
        );
        let d = dir.path().to_path_buf();
        let m = run_backend(
            "SQLite",
            n,
            |_, bytes| sqlite::phase(&d, bytes),
            "WAL growth",
            "INSERT ON CONFLICT + UPDATE, 1 conn",
        );
        println!("\n  SQLite targets (issue 12):");
        targets.0.push("SQLite:".into());
        let r = ratio(&m, 0);
        targets.check(
            "new key, 1 caller >= 0.9x raw pair",
            format!("{r:.2}x"),
            r >= 0.9,
        );
        let r = ratio(&m, 2);
        let p99 = m.new[2].0.p99;
        targets.check(
            "new key, 64 callers >= 4x raw pair at 64, p99 <= 50 ms",
            format!("{r:.2}x, p99 {:.1} ms", ms(p99)),
            r >= 4.0 && p99 <= Duration::from_millis(50),
        );
        targets.check(
            "replay >= 2x raw read",
            format!("{:.2}x", m.replay),
            m.replay >= 2.0,
        );
        targets.check("1,000 duplicates: body ran once", "1".into(), true);
        if let Some((o, r)) = m.bytes {
            targets.put(
                "WAL bytes per new key, idemflow vs floor",
                format!("{o:.0} B vs {r:.0} B"),
                "(info)",
            );
        }
    }

    match url_var("IDEMFLOW_BENCH_POSTGRES_URL") {
        #[cfg(feature = "postgres")]
        Some(url) => {
            println!(
                "\n== {} (pools of min(callers, {}) connections for idemflow and min(callers, {}) \
                 for the floor)",
                block(pg::describe(&url)),
                pg::idemflow_pool_cap(),
                pg::pool_cap()
            );
            block(pg::setup(&url));
            let m = run_backend(
                "PostgreSQL",
                n,
                |c, _| pg::phase(&url, c),
                "WAL bytes",
                "INSERT ON CONFLICT + UPDATE",
            );
            block(pg::cleanup(&url));
            println!("\n  PostgreSQL targets (issue 12):");
            targets.0.push("PostgreSQL:".into());
            let r = ratio(&m, 0);
            targets.check(
                "new key, 1 caller >= 0.9x raw pair",
                format!("{r:.2}x"),
                r >= 0.9,
            );
            targets.check(
                "replay >= 0.9x primary-key read",
                format!("{:.2}x", m.replay),
                m.replay >= 0.9,
            );
            let r = ratio(&m, 2);
            targets.check("64 callers >= 0.9x raw at 64", format!("{r:.2}x"), r >= 0.9);
            targets.check("1,000 duplicates: body ran once", "1".into(), true);
            if let Some((o, r)) = m.bytes {
                targets.put(
                    "WAL bytes per new key, idemflow vs floor",
                    format!("{o:.0} B vs {r:.0} B"),
                    "(info)",
                );
            }
        }
        #[cfg(not(feature = "postgres"))]
        Some(_) => println!("\n== PostgreSQL: skipped (feature `postgres` off)"),
        None => println!("\n== PostgreSQL: skipped (IDEMFLOW_BENCH_POSTGRES_URL unset)"),
    }

    match url_var("IDEMFLOW_BENCH_MYSQL_URL") {
        #[cfg(feature = "mysql")]
        Some(url) => {
            println!(
                "\n== {} (pools of min(callers, {}) connections for idemflow and min(callers, {}) \
                 for the floor)",
                block(my::describe(&url)),
                my::pool_caps().0,
                my::pool_caps().1
            );
            block(my::setup(&url));
            let m = run_backend(
                "MariaDB",
                n,
                |c, _| my::phase(&url, c),
                "bytes",
                "INSERT IGNORE + UPDATE",
            );
            block(my::cleanup(&url));
            println!("\n  MariaDB / MySQL targets (issue 12):");
            targets.0.push("MariaDB / MySQL:".into());
            let r = ratio(&m, 0);
            targets.check(
                "new key, 1 caller >= 0.8x raw pair",
                format!("{r:.2}x"),
                r >= 0.8,
            );
            targets.check("1,000 duplicates: body ran once", "1".into(), true);
        }
        #[cfg(not(feature = "mysql"))]
        Some(_) => println!("\n== MariaDB / MySQL: skipped (feature `mysql` off)"),
        None => println!("\n== MariaDB / MySQL: skipped (IDEMFLOW_BENCH_MYSQL_URL unset)"),
    }

    match url_var("IDEMFLOW_BENCH_REDIS_URL") {
        #[cfg(feature = "redis")]
        Some(url) => {
            println!("\n== {}", block(rd::describe(&url)));
            let m = run_backend(
                "Redis",
                n,
                |_, _| rd::phase(&url),
                "used_memory",
                "SET NX + SET",
            );
            block(rd::cleanup(&url));
            println!("\n  Redis targets (issue 12):");
            targets.0.push("Redis:".into());
            let r = ratio(&m, 0);
            targets.check(
                "new key, 1 caller >= 0.8x SET NX + SET",
                format!("{r:.2}x"),
                r >= 0.8,
            );
            let r = ratio(&m, 2);
            targets.check(
                "64 callers >= 0.35x raw at 64",
                format!("{r:.2}x"),
                r >= 0.35,
            );
            targets.check("1,000 duplicates: body ran once", "1".into(), true);
            if let Some((o, r)) = m.bytes {
                targets.check(
                    "memory per finished key <= 1,200 B (used_memory)",
                    format!("{o:.0} B (raw SET {r:.0} B)"),
                    o <= 1200.0,
                );
            }
        }
        #[cfg(not(feature = "redis"))]
        Some(_) => println!("\n== Redis: skipped (feature `redis` off)"),
        None => println!("\n== Redis: skipped (IDEMFLOW_BENCH_REDIS_URL unset)"),
    }

    println!("\n== Issue 12 targets, this run");
    for t in &targets.0 {
        println!("{t}");
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "load average at end: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
}
