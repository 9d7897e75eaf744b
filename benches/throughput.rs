//! Throughput figures, printed as ratios measured in one run (DESIGN section 6).
//!
//! `cargo bench --bench throughput` (SQLite file, `synchronous=FULL`). Set
//! `IDEMFLOW_BENCH_N` to change the number of keys (default 2000) and `IDEMFLOW_BENCH_BIG`
//! to change the number of finished keys for the sweep-scaling check (default 1,000,000).
//!
//! Runtime: tokio current_thread (reported), sequential callers unless said otherwise.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idemflow::store::TakeStale;
use idemflow::store::sqlite::SqliteStore;
use idemflow::{Execution, Idempotency, Outcome, Request, Response, Store};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

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
        "{name:<44} {:>9.0} ops/s   p50 {:>7.0} us   p99 {:>7.0} us",
        s.ops_per_s, s.p50_us, s.p99_us
    );
}

async fn fresh_store(dir: &std::path::Path, name: &str) -> Arc<SqliteStore> {
    let url = format!("sqlite://{}", dir.join(name).display());
    let s = SqliteStore::connect(&url).await.unwrap();
    s.migrate().await.unwrap();
    Arc::new(s)
}

/// The same two statements the store issues for a fresh key, by hand: an insert of the claim
/// row and an update to done (on the same table, with its history triggers).
async fn raw_claim_complete(store: &SqliteStore, n: usize) -> Stats {
    let pool = store.writer_pool();
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        sqlx::query(
            "INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, fingerprint, \
             request, lease_token, lease_owner, lease_expires_at, attempts, created_at, updated_at, \
             retention_ms, version, last_actor, last_reason) VALUES ('raw', ?1, 'op', 'pk', \
             'processing', 'v1:x', '{}', 1, 'w', 0, 1, 0, 0, 86400000, 1, 'worker', 'claimed') \
             ON CONFLICT DO NOTHING",
        )
        .bind(format!("k{i}"))
        .execute(pool)
        .await
        .unwrap();
        sqlx::query(
            "UPDATE idempotency_keys SET state = 'done', response_status = 201, \
             response_headers = '[]', response_body = ?2, lease_expires_at = NULL, \
             expires_at = 86400000, version = version + 1 \
             WHERE scope = 'raw' AND key = ?1 AND lease_token = 1",
        )
        .bind(format!("k{i}"))
        .bind(&b"{\"payment_id\":1}"[..])
        .execute(pool)
        .await
        .unwrap();
        lat.push(t.elapsed());
    }
    stats(lat, t0.elapsed())
}

async fn raw_pk_read(store: &SqliteStore, n: usize) -> Stats {
    let url_pool = store.writer_pool();
    let _ = url_pool;
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        let row: Option<(i64, Vec<u8>)> = sqlx::query_as(
            "SELECT response_status, response_body FROM idempotency_keys WHERE scope = 'raw' AND key = ?1",
        )
        .bind(format!("k{i}"))
        .fetch_optional(store.writer_pool())
        .await
        .unwrap();
        assert!(row.is_some());
        lat.push(t.elapsed());
    }
    stats(lat, t0.elapsed())
}

fn request(scope: &str, i: usize) -> Request {
    Request::new(
        scope,
        &format!("k{i}"),
        "payments.create",
        &serde_json::json!({"amount": 500, "i": i}),
    )
    .unwrap()
}

async fn execute_fresh(idem: &Idempotency, n: usize) -> Stats {
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        let r = idem
            .execute(request("bench", i), |_ctx| async {
                Outcome::Succeeded(Response::new(201).with_body(&b"{\"payment_id\":1}"[..]))
            })
            .await
            .unwrap();
        assert!(!r.is_replay());
        lat.push(t.elapsed());
    }
    stats(lat, t0.elapsed())
}

async fn execute_replay(idem: &Idempotency, n: usize) -> Stats {
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        let r = idem
            .execute(request("bench", i), |_ctx| async {
                unreachable!("replay only")
            })
            .await
            .unwrap();
        assert!(r.is_replay());
        lat.push(t.elapsed());
    }
    stats(lat, t0.elapsed())
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
                Outcome::Succeeded(Response::new(201))
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

async fn sweep_time(store: &SqliteStore, stale: usize, finished: usize) -> Duration {
    let pool = store.writer_pool();
    if finished > 0 {
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1) \
             INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, fingerprint, \
             lease_token, attempts, created_at, updated_at, expires_at, retention_ms, version, \
             last_actor) SELECT 'big', 'k' || i, 'op', 'pk', 'done', 'v1:x', 1, 1, 0, 0, \
             4102444800000, 86400000, 1, 'worker' FROM n",
        )
        .bind(finished as i64)
        .execute(pool)
        .await
        .unwrap();
    }
    sqlx::query(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1) \
         INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, fingerprint, \
         lease_token, lease_expires_at, attempts, created_at, updated_at, retention_ms, version, \
         last_actor) SELECT 'stale', 'k' || i, 'op', 'pk', 'processing', 'v1:x', 1, 0, 1, 0, 0, \
         86400000, 1, 'worker' FROM n",
    )
    .bind(stale as i64)
    .execute(pool)
    .await
    .unwrap();
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
    assert_eq!(taken, stale);
    t.elapsed()
}

fn main() {
    let n = env("IDEMFLOW_BENCH_N", 2000);
    let big = env("IDEMFLOW_BENCH_BIG", 1_000_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        println!("idemflow throughput, SQLite file, WAL, synchronous=FULL, tokio current_thread, N={n}");
        let store = fresh_store(dir.path(), "bench.db").await;
        let idem = Idempotency::new(store.clone());
        let raw = raw_claim_complete(&store, n).await;
        let ours = execute_fresh(&idem, n).await;
        let raw_read = raw_pk_read(&store, n).await;
        let replay = execute_replay(&idem, n).await;
        line("raw INSERT + UPDATE (by hand)", &raw);
        line("execute() on fresh keys", &ours);
        line("raw primary-key read", &raw_read);
        line("execute() replay", &replay);
        println!(
            "ratios: fresh {:.2}x of raw (target >= 0.7), replay {:.2}x of raw read (target >= 0.8)",
            ours.ops_per_s / raw.ops_per_s,
            replay.ops_per_s / raw_read.ops_per_s
        );
        let (runs, executed) = duplicates(&idem, 1000).await;
        println!("1000 concurrent duplicates of one key: body ran {runs} time(s), {executed} Executed");

        let small = fresh_store(dir.path(), "sweep-small.db").await;
        let t_small = sweep_time(&small, 1000, 0).await;
        let large = fresh_store(dir.path(), "sweep-large.db").await;
        let t_large = sweep_time(&large, 1000, big).await;
        println!(
            "take_stale of 1000 stale keys: {:.1} ms alone, {:.1} ms beside {big} finished keys ({:.2}x, target < 1.5x)",
            t_small.as_secs_f64() * 1e3,
            t_large.as_secs_f64() * 1e3,
            t_large.as_secs_f64() / t_small.as_secs_f64()
        );
    });
}
