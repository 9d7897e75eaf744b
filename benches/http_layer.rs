//! What the axum layer adds to a request (`docs/performance.md`, "The HTTP layer"): the same
//! handler, answering a 201 at once, served bare and behind [`IdempotencyLayer`], loaded by
//! `wrk` over loopback with a new `Idempotency-Key` on every request.
//!
//! ```text
//! apt-get install wrk        # Debian's package; the bench says so and stops when it is missing
//! cargo bench --bench http_layer --features axum,redis
//! ```
//!
//! The servers run in this process (tokio `multi_thread`, two workers, as many as the machine's
//! cores), `wrk` in a child process with one thread; both share the machine, so compare the
//! ratios of one run, never absolute figures across runs. Per connection count it measures the
//! bare handler, then the layer over SQLite (a file, WAL, `synchronous=NORMAL`: the layer's own
//! cost, not an `fsync`'s) and, when `IDEMFLOW_BENCH_REDIS_URL` is set (and feature `redis` is
//! on), over Redis, and prints the p50 and p99 the layer adds and its requests/s as a ratio of
//! the bare handler's.
//!
//! - `IDEMFLOW_BENCH_HTTP_SECS`: seconds per measurement (default 10).
//! - `IDEMFLOW_BENCH_HTTP_CONNS`: connection counts (default `1,8,64`).
//! - `IDEMFLOW_BENCH_SQLITE=0` skips SQLite.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::routing::post;
use idemflow::axum::{IdempotencyLayer, ScopeSource};
use idemflow::{Idempotency, IdempotentRequest, Outcome, Store, StoredResponse, key::Scope};

mod support;

const BODY: &str = r#"{"id":"pi_3NxYz2eZvKYlo2C0","status":"succeeded","amount":1999}"#;

/// The handler measured, bare and behind the layer: it answers at once.
async fn pay(_body: Bytes) -> (StatusCode, &'static str) {
    (StatusCode::CREATED, BODY)
}

/// The `wrk` script: a POST with a JSON body and a new `Idempotency-Key` per request (the run's
/// prefix, from the script's first argument, and a counter).
const SCRIPT: &str = r#"
local counter = 0
local prefix = "k"
wrk.method = "POST"
wrk.body = '{"amount":1999,"currency":"usd","customer":"cus_bench"}'
wrk.headers["Content-Type"] = "application/json"
function init(args)
  prefix = args[1]
end
function request()
  counter = counter + 1
  local headers = {}
  for k, v in pairs(wrk.headers) do headers[k] = v end
  headers["Idempotency-Key"] = prefix .. "-" .. counter
  return wrk.format(nil, nil, headers)
end
"#;

/// One `wrk` run's figures.
#[derive(Debug, Clone, Copy)]
struct Load {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// Non-2xx answers and socket errors: a measurement with any is reported, not trusted.
    errors: u64,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// `1.23ms`, `456.00us`, `1.01s` in milliseconds.
fn millis(v: &str) -> Option<f64> {
    let (num, scale) = if let Some(n) = v.strip_suffix("us") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|n| n * scale)
}

/// Reads requests/s, the 50 % and 99 % latencies and the error counts from `wrk --latency`.
fn parse(out: &str) -> Option<Load> {
    let mut load = Load {
        rps: f64::NAN,
        p50_ms: f64::NAN,
        p99_ms: f64::NAN,
        errors: 0,
    };
    for line in out.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Requests/sec:", v] => load.rps = v.parse().ok()?,
            ["50%", v] => load.p50_ms = millis(v)?,
            ["99%", v] => load.p99_ms = millis(v)?,
            ["Non-2xx", "or", "3xx", "responses:", n] => load.errors += n.parse::<u64>().ok()?,
            ["Socket", "errors:", rest @ ..] => {
                // "connect 0, read 0, write 0, timeout 0"
                load.errors += rest
                    .iter()
                    .filter_map(|w| w.trim_end_matches(',').parse::<u64>().ok())
                    .sum::<u64>();
            }
            _ => {}
        }
    }
    (load.rps.is_finite() && load.p50_ms.is_finite() && load.p99_ms.is_finite()).then_some(load)
}

/// Serves `app` on a free loopback port until the process ends.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The p50 of `n` calls of [`Idempotency::execute`] on new keys, one at a time: the store's own
/// part of a request (a claim and a finish), without HTTP.
async fn execute_p50(idem: &Idempotency, n: usize) -> f64 {
    let mut took = Vec::with_capacity(n);
    let run = std::process::id();
    for i in 0..n {
        let body = serde_json::json!({"amount": 1999, "currency": "usd", "customer": "cus_bench"});
        let request =
            IdempotentRequest::new("bench", &format!("direct-{run}-{i}"), "pay", &body).unwrap();
        let started = std::time::Instant::now();
        idem.execute(request, |_ctx| async {
            Outcome::Succeeded(StoredResponse::new(201).with_body(BODY))
        })
        .await
        .unwrap();
        took.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    took.sort_by(f64::total_cmp);
    took[n / 2]
}

/// [`execute_p50`] on a runtime worker, where the layer's handlers run too (not on the thread
/// that blocks on the runtime, whose every wake-up is a hop to another thread).
async fn on_worker(idem: &Idempotency) -> f64 {
    let idem = idem.clone();
    tokio::spawn(async move { execute_p50(&idem, 2000).await })
        .await
        .unwrap()
}

fn layered(idem: Idempotency) -> Router {
    let scope = ScopeSource::fixed(Scope::new("bench").unwrap());
    Router::new()
        .route("/pay", post(pay))
        .layer(IdempotencyLayer::new(idem, scope))
}

/// Runs `wrk` against `addr` with `conns` connections; `run` makes the run's keys unique.
fn wrk(script: &std::path::Path, addr: SocketAddr, conns: usize, secs: u64, run: &str) -> Load {
    let out = Command::new("wrk")
        .args([
            "-t1",
            &format!("-c{conns}"),
            &format!("-d{secs}s"),
            "--latency",
        ])
        .arg("-s")
        .arg(script)
        .arg(format!("http://{addr}/pay"))
        .args(["--", run])
        .output()
        .expect("wrk runs");
    let text = String::from_utf8_lossy(&out.stdout);
    parse(&text).unwrap_or_else(|| panic!("wrk printed no figures:\n{text}"))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

fn main() {
    if Command::new("wrk").arg("--version").output().is_err() {
        println!(
            "http_layer: `wrk` is not installed (Debian: apt-get install wrk); nothing measured"
        );
        return;
    }
    let secs: u64 = env("IDEMFLOW_BENCH_HTTP_SECS").map_or(10, |v| v.parse().expect("seconds"));
    let conns: Vec<usize> = env("IDEMFLOW_BENCH_HTTP_CONNS")
        .unwrap_or_else(|| "1,8,64".into())
        .split(',')
        .map(|c| c.trim().parse().expect("a connection count"))
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("keys.lua");
    std::fs::write(&script, SCRIPT).unwrap();

    let mut targets: Vec<(&str, SocketAddr)> = Vec::new();
    let mut direct: Vec<(&str, f64)> = Vec::new();
    rt.block_on(async {
        targets.push((
            "bare handler",
            serve(Router::new().route("/pay", post(pay))).await,
        ));
        if env("IDEMFLOW_BENCH_SQLITE").as_deref() != Some("0") {
            use idemflow::store::sqlite::{SqliteConfig, SqliteStore};
            use sqlx::sqlite::SqliteSynchronous;
            let url = format!("sqlite://{}", dir.path().join("http.db").display());
            let config = SqliteConfig::new(url).synchronous(SqliteSynchronous::Normal);
            let store = SqliteStore::connect_with(config).await.unwrap();
            store.migrate().await.unwrap();
            let idem = Idempotency::new(Arc::new(store));
            direct.push(("SQLite NORMAL", on_worker(&idem).await));
            targets.push(("layer, SQLite NORMAL", serve(layered(idem)).await));
        }
        #[cfg(feature = "redis")]
        if let Some(url) = env("IDEMFLOW_BENCH_REDIS_URL") {
            use idemflow::store::redis::{RedisConfig, RedisStore};
            let prefix = format!("idemflow-bench-http-{}", std::process::id());
            let store = RedisStore::connect_with(RedisConfig::new(url).prefix(prefix))
                .await
                .unwrap();
            store.migrate().await.unwrap();
            let idem = Idempotency::new(Arc::new(store));
            direct.push(("Redis", on_worker(&idem).await));
            targets.push(("layer, Redis", serve(layered(idem)).await));
        }
    });
    if targets.len() == 1 {
        println!("http_layer: no store to measure (IDEMFLOW_BENCH_SQLITE=0 and no Redis URL)");
        return;
    }

    println!(
        "== Idempotency::execute alone, 1 caller, 2,000 new keys (the store's part of a request)"
    );
    for (name, p50) in &direct {
        println!("  {name:<22} p50 {p50:.3} ms");
    }
    println!();
    println!(
        "== the axum layer over a handler that answers at once: wrk -t1, {secs} s each, a new key per request"
    );
    println!(
        "{:>5}  {:<22} {:>10} {:>9} {:>9} {:>11} {:>11} {:>8} {:>6} {:>5}",
        "conns",
        "target",
        "req/s",
        "p50 ms",
        "p99 ms",
        "+p50 ms",
        "+p99 ms",
        "ratio",
        "errors",
        "load"
    );
    let mut run = 0;
    for &c in &conns {
        let mut bare: Option<Load> = None;
        for (name, addr) in &targets {
            run += 1;
            let load_at_start = load_average();
            // Warm the connections and the store (a second of the same load), then measure.
            let warm = format!("warm-{}-{run}", std::process::id());
            wrk(&script, *addr, c, 1, &warm);
            let tag = format!("run-{}-{run}", std::process::id());
            let l = wrk(&script, *addr, c, secs, &tag);
            let (add50, add99, ratio) = match bare {
                None => {
                    bare = Some(l);
                    ("-".to_owned(), "-".to_owned(), "1.00".to_owned())
                }
                Some(b) => (
                    format!("{:.3}", l.p50_ms - b.p50_ms),
                    format!("{:.3}", l.p99_ms - b.p99_ms),
                    format!("{:.2}", l.rps / b.rps),
                ),
            };
            println!(
                "{c:>5}  {name:<22} {:>10.0} {:>9.3} {:>9.3} {add50:>11} {add99:>11} {ratio:>8} {:>6} {load_at_start:>5}",
                l.rps, l.p50_ms, l.p99_ms, l.errors
            );
        }
    }
    // The SQLite file goes with `dir`; the Redis keys of this run are deleted.
    #[cfg(feature = "redis")]
    if let Some(url) = env("IDEMFLOW_BENCH_REDIS_URL") {
        rt.block_on(delete_redis_keys(&url));
    }
}

/// Deletes every key of this run from Redis.
#[cfg(feature = "redis")]
async fn delete_redis_keys(url: &str) {
    let mut c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let pattern = format!("*idemflow-bench-http-{}*", std::process::id());
    support::unlink_matching(&mut c, &pattern).await;
}
