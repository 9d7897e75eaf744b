//! Redis store benchmark: `Store::claim + finish` on fresh keys and replays (`claim` on a done
//! key) against the raw round trips a hand-written Redis idempotency layer would make (`SET NX PX`
//! + `SET`, and `GET`), in the same run, plus memory per finished key.
//!
//! ```text
//! cargo run --release --features redis --example bench_redis -- [N] [CONCURRENCY]
//! ```
//!
//! Uses `IDEMFLOW_BENCH_REDIS_URL`, else `IDEMFLOW_TEST_REDIS_URL`, else
//! `redis://127.0.0.1:6379/`, under a fresh key prefix that it deletes at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow::store::redis::{RedisConfig, RedisStore};
use idemflow::store::{ClaimOutcome, Finish, NewClaim};
use idemflow::{Actor, Fingerprint, IdempotencyKey, KeyId, KeyState, Scope, Store, StoredResponse};
use redis::aio::ConnectionManager;

const REQUEST: &str =
    r#"{"amount":1999,"currency":"eur","customer":"cus_0123456789","description":"order 42"}"#;

fn response() -> StoredResponse {
    StoredResponse::new(201)
        .with_header("content-type", "application/json")
        .with_body(
            &br#"{"id":"pi_3NxYz2eZvKYlo2C0","status":"succeeded","amount":1999,"currency":"eur","created":1700000000}"#[..],
        )
}

fn claim(scope: &str, key: &str) -> NewClaim {
    let id = KeyId::new(
        Scope::new(scope).expect("scope"),
        IdempotencyKey::new(key).expect("key"),
    );
    NewClaim {
        provider_key: format!("pk-{key}"),
        id,
        operation: "payments.create".into(),
        provider: Some("stripe".into()),
        fingerprint: Fingerprint::compute("payments.create", REQUEST),
        request: Some(REQUEST.into()),
        owner: "bench".into(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(24 * 3600),
        takeover_window: None,
    }
}

fn finish() -> Finish {
    Finish {
        to: KeyState::Done,
        response: Some(response()),
        error: None,
        actor: Actor::Worker,
        reason: "ok".into(),
        expect_token: None,
    }
}

struct Figures {
    name: &'static str,
    ops_per_s: f64,
    p50: Duration,
    p99: Duration,
}

/// Runs `op(i)` for i in 0..n on `conc` tasks; ops/s over the wall time, latency per op.
async fn run<F, Fut>(name: &'static str, n: usize, conc: usize, op: F) -> Figures
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..conc {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = t;
            while i < n {
                let s = Instant::now();
                op(i).await;
                lat.push(s.elapsed());
                i += conc;
            }
            lat
        }));
    }
    let mut lat = Vec::with_capacity(n);
    for t in tasks {
        lat.extend(t.await.expect("task"));
    }
    let wall = start.elapsed();
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    Figures {
        name,
        ops_per_s: n as f64 / wall.as_secs_f64(),
        p50: pct(0.50),
        p99: pct(0.99),
    }
}

async fn used_memory(con: &mut ConnectionManager) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(con)
        .await
        .expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory")
}

async fn memory_usage(con: &mut ConnectionManager, key: &str) -> i64 {
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(con)
        .await
        .unwrap_or(0)
}

async fn delete_prefix(con: &mut ConnectionManager, pattern: &str) {
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(con)
            .await
            .expect("SCAN");
        if !keys.is_empty() {
            let _: i64 = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(con)
                .await
                .expect("UNLINK");
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}

fn print(f: &Figures) {
    println!(
        "{:<38} {:>10.0} ops/s   p50 {:>7.3} ms   p99 {:>7.3} ms",
        f.name,
        f.ops_per_s,
        f.p50.as_secs_f64() * 1e3,
        f.p99.as_secs_f64() * 1e3
    );
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let conc: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(16);
    let url = std::env::var("IDEMFLOW_BENCH_REDIS_URL")
        .or_else(|_| std::env::var("IDEMFLOW_TEST_REDIS_URL"))
        .unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let pid = std::process::id();
    let prefix = format!("idemflow-bench-{pid}");
    let raw_prefix = format!("idemflow-bench-raw-{pid}");
    let store = RedisStore::connect_with(RedisConfig::new(&url).prefix(&prefix))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let store = Arc::new(store);
    let mut con = store.connection();
    println!("Redis at {url}; N = {n}, concurrency = {conc}");

    // Warm up both paths (connections, script cache).
    for i in 0..200 {
        let c = claim("warm", &format!("w{i}"));
        if let ClaimOutcome::Claimed(l) = store.claim(&c).await.expect("claim") {
            store
                .finish(&c.id, Some(l.token), &finish())
                .await
                .expect("finish");
        }
    }

    let body = response().body().to_vec();
    let s = store.clone();
    let fresh = run("Store::claim + finish (fresh keys)", n, conc, move |i| {
        let s = s.clone();
        async move {
            let c = claim("bench", &format!("k{i}"));
            let ClaimOutcome::Claimed(l) = s.claim(&c).await.expect("claim") else {
                panic!("fresh key was not claimed")
            };
            s.finish(&c.id, Some(l.token), &finish())
                .await
                .expect("finish");
        }
    })
    .await;

    let rc = con.clone();
    let rp = raw_prefix.clone();
    let b = body.clone();
    let raw_fresh = run("raw SET NX PX + SET (fresh keys)", n, conc, move |i| {
        let (mut rc, rp, b) = (rc.clone(), rp.clone(), b.clone());
        async move {
            let key = format!("{rp}:k{i}");
            let ok: Option<String> = redis::cmd("SET")
                .arg(format!("{key}:lock"))
                .arg("1")
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(&mut rc)
                .await
                .expect("SET NX");
            assert!(ok.is_some());
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg(&b)
                .arg("PX")
                .arg(86_400_000)
                .query_async(&mut rc)
                .await
                .expect("SET");
        }
    })
    .await;

    let s = store.clone();
    let replay = run("Store::claim on a done key (replay)", n, conc, move |i| {
        let s = s.clone();
        async move {
            let c = claim("bench", &format!("k{i}"));
            match s.claim(&c).await.expect("claim") {
                ClaimOutcome::Existing { record, .. } => {
                    assert_eq!(record.state, KeyState::Done);
                }
                ClaimOutcome::Claimed(_) => panic!("a done key was claimed"),
            }
        }
    })
    .await;

    // The same replays through a second store on the same prefix with the known-keys hint off, as
    // when the retry reaches another instance: each claim runs the claim script.
    let other = Arc::new(
        RedisStore::connect_with(RedisConfig::new(&url).prefix(&prefix).known_keys(0))
            .await
            .expect("connect"),
    );
    let s = other.clone();
    let replay_other = run("Store::claim replay, no hint (script)", n, conc, move |i| {
        let s = s.clone();
        async move {
            let c = claim("bench", &format!("k{i}"));
            match s.claim(&c).await.expect("claim") {
                ClaimOutcome::Existing { record, .. } => {
                    assert_eq!(record.state, KeyState::Done);
                }
                ClaimOutcome::Claimed(_) => panic!("a done key was claimed"),
            }
        }
    })
    .await;

    let rc = con.clone();
    let rp = raw_prefix.clone();
    let raw_get = run("raw GET (replay)", n, conc, move |i| {
        let (mut rc, rp) = (rc.clone(), rp.clone());
        async move {
            let v: Option<Vec<u8>> = redis::cmd("GET")
                .arg(format!("{rp}:k{i}"))
                .query_async(&mut rc)
                .await
                .expect("GET");
            assert!(v.is_some());
        }
    })
    .await;

    println!();
    for f in [&fresh, &raw_fresh, &replay, &replay_other, &raw_get] {
        print(f);
    }
    println!();
    println!(
        "ratio claim+finish / raw SET NX+SET: throughput {:.2}x, p50 {:.2}x, p99 {:.2}x",
        fresh.ops_per_s / raw_fresh.ops_per_s,
        fresh.p50.as_secs_f64() / raw_fresh.p50.as_secs_f64(),
        fresh.p99.as_secs_f64() / raw_fresh.p99.as_secs_f64()
    );
    println!(
        "ratio replay / raw GET:             throughput {:.2}x, p50 {:.2}x, p99 {:.2}x",
        replay.ops_per_s / raw_get.ops_per_s,
        replay.p50.as_secs_f64() / raw_get.p50.as_secs_f64(),
        replay.p99.as_secs_f64() / raw_get.p99.as_secs_f64()
    );
    println!(
        "ratio replay (no hint) / raw GET:   throughput {:.2}x, p50 {:.2}x, p99 {:.2}x",
        replay_other.ops_per_s / raw_get.ops_per_s,
        replay_other.p50.as_secs_f64() / raw_get.p50.as_secs_f64(),
        replay_other.p99.as_secs_f64() / raw_get.p99.as_secs_f64()
    );

    // Memory per finished key: used_memory delta over M fresh keys, sequentially, so nothing
    // else of ours is in flight. (Other clients of the same Redis add noise; MEMORY USAGE of one
    // key's hash + history is printed too.)
    let m = 10_000usize;
    let before = used_memory(&mut con).await;
    let s = store.clone();
    run("memory fill", m, conc, move |i| {
        let s = s.clone();
        async move {
            let c = claim("memory", &format!("m{i}"));
            let ClaimOutcome::Claimed(l) = s.claim(&c).await.expect("claim") else {
                panic!("not claimed")
            };
            s.finish(&c.id, Some(l.token), &finish())
                .await
                .expect("finish");
        }
    })
    .await;
    let after = used_memory(&mut con).await;
    let raw_before = used_memory(&mut con).await;
    let rc = con.clone();
    let rp = format!("{raw_prefix}-mem");
    let b = body.clone();
    run("raw memory fill", m, conc, move |i| {
        let (mut rc, rp, b) = (rc.clone(), rp.clone(), b.clone());
        async move {
            let _: () = redis::cmd("SET")
                .arg(format!("{rp}:m{i}"))
                .arg(&b)
                .arg("PX")
                .arg(86_400_000)
                .query_async(&mut rc)
                .await
                .expect("SET");
        }
    })
    .await;
    let raw_after = used_memory(&mut con).await;
    let one = claim("memory", "m0").id;
    let hash = memory_usage(&mut con, &store.record_key(&one)).await;
    let hist = memory_usage(&mut con, &store.history_key(&one)).await;
    println!();
    println!(
        "memory per finished key (INFO used_memory delta / {m}): {} bytes \
         (raw SET of the same response body: {} bytes)",
        (after - before) / m as i64,
        (raw_after - raw_before) / m as i64
    );
    println!(
        "MEMORY USAGE of one finished key: hash {hash} B + history {hist} B = {} B \
         (plus its member in the done index)",
        hash + hist
    );
    println!(
        "payload: request {} B, response body {} B",
        REQUEST.len(),
        body.len()
    );

    delete_prefix(&mut con, &format!("{prefix}*")).await;
    delete_prefix(&mut con, &format!("{raw_prefix}*")).await;
}
