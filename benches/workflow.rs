//! The cost of a workflow against single calls (issue 13; `docs/workflows.md`, "Cost").
//!
//! ```text
//! cargo bench --bench workflow --all-features
//! IDEMFLOW_BENCH_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test cargo bench --bench workflow --all-features
//! ```
//!
//! Per backend, one caller (tokio `current_thread`), N orders (`IDEMFLOW_BENCH_N`, default
//! 2,000): a 3-step workflow per order (three `Context::step` calls whose bodies answer at once)
//! against 3 single keys per order (three `Idempotency::execute` calls whose bodies answer at
//! once), measured in the same run, alternating in blocks so both see the same machine. Prints
//! orders/s, p50 / p99 per order, and the ratio workflow time / 3-single-keys time. Then the
//! replay of a finished workflow against the replay of its 3 single keys.
//!
//! SQLite is a file database with WAL and `synchronous=FULL` (`SqliteStore::connect`);
//! PostgreSQL runs in a schema of its own, dropped afterwards.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow::{Idempotency, IdempotentRequest, Outcome, Store, StoredResponse, workflow::Step};

fn ok() -> Outcome {
    Outcome::Succeeded(StoredResponse::json(201, &serde_json::json!({"ok": true})).unwrap())
}

fn order(i: usize, run: &str) -> serde_json::Value {
    serde_json::json!({"order": format!("{run}-{i}"), "amount": 1500})
}

async fn workflow(idem: &Idempotency, run: &str, i: usize) {
    let req = IdempotentRequest::new("bench", &format!("{run}-w{i}"), "checkout", &order(i, run))
        .unwrap()
        .workflow();
    idem.execute(req, |ctx| async move {
        for name in ["charge", "email", "notify"] {
            let step = Step::new(name, &serde_json::json!({"step": name})).unwrap();
            if let Err(e) = ctx.step(step, |_| async { ok() }).await {
                return Outcome::from_step_error(&e);
            }
        }
        ok()
    })
    .await
    .unwrap();
}

async fn singles(idem: &Idempotency, run: &str, i: usize) {
    for name in ["charge", "email", "notify"] {
        let req =
            IdempotentRequest::new("bench", &format!("{run}-{name}-{i}"), name, &order(i, run))
                .unwrap();
        idem.execute(req, |_| async { ok() }).await.unwrap();
    }
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

struct Side {
    total: Duration,
    each: Vec<Duration>,
}

impl Side {
    fn new() -> Self {
        Self {
            total: Duration::ZERO,
            each: Vec::new(),
        }
    }
    fn line(&mut self, label: &str) -> f64 {
        self.each.sort();
        let rate = self.each.len() as f64 / self.total.as_secs_f64();
        println!(
            "    {label:<34} {rate:>8.0} orders/s  p50 {:>7.3} ms  p99 {:>7.3} ms",
            pct(&self.each, 0.5),
            pct(&self.each, 0.99)
        );
        self.total.as_secs_f64()
    }
}

async fn measure(name: &str, store: Arc<dyn Store>, n: usize) {
    let idem = Idempotency::new(store);
    let run = format!("r{}", std::process::id());
    let (mut wf, mut single) = (Side::new(), Side::new());
    const BLOCK: usize = 100;
    for block in (0..n).step_by(BLOCK) {
        for i in block..(block + BLOCK).min(n) {
            let t = Instant::now();
            workflow(&idem, &run, i).await;
            let d = t.elapsed();
            wf.total += d;
            wf.each.push(d);
        }
        for i in block..(block + BLOCK).min(n) {
            let t = Instant::now();
            singles(&idem, &run, i).await;
            let d = t.elapsed();
            single.total += d;
            single.each.push(d);
        }
    }
    println!("== {name}: {n} orders, 1 caller");
    let a = wf.line("3-step workflow");
    let b = single.line("3 single keys");
    println!(
        "    ratio workflow / 3 single keys: {:.2}x (time per order)",
        a / b
    );

    let (mut wf, mut single) = (Side::new(), Side::new());
    for i in 0..n.min(1000) {
        let t = Instant::now();
        workflow(&idem, &run, i).await;
        let d = t.elapsed();
        wf.total += d;
        wf.each.push(d);
        let t = Instant::now();
        singles(&idem, &run, i).await;
        let d = t.elapsed();
        single.total += d;
        single.each.push(d);
    }
    println!("  replays of finished orders:");
    let a = wf.line("workflow replay");
    let b = single.line("3 single-key replays");
    println!("    ratio workflow / 3 single keys: {:.2}x", a / b);
}

fn main() {
    let n = std::env::var("IDEMFLOW_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        if std::env::var("IDEMFLOW_BENCH_SQLITE").as_deref() != Ok("0") {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("sqlite://{}", dir.path().join("wf.db").display());
            let store = idemflow::store::sqlite::SqliteStore::connect(&url)
                .await
                .unwrap();
            store.migrate().await.unwrap();
            measure("SQLite file, WAL, synchronous=FULL", Arc::new(store), n).await;
        }
        #[cfg(feature = "postgres")]
        if let Ok(url) = std::env::var("IDEMFLOW_BENCH_POSTGRES_URL") {
            use sqlx::{AssertSqlSafe, Connection, Executor};
            use std::str::FromStr;
            let schema = format!("idemflow_wfbench_{}", std::process::id());
            let mut admin = sqlx::PgConnection::connect(&url).await.unwrap();
            admin
                .execute(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                .await
                .unwrap();
            let options = sqlx::postgres::PgConnectOptions::from_str(&url)
                .unwrap()
                .options([("search_path", schema.as_str())]);
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .connect_with(options)
                .await
                .unwrap();
            let store = idemflow::store::postgres::PostgresStore::from_pool(pool);
            store.migrate().await.unwrap();
            measure("PostgreSQL", Arc::new(store), n).await;
            admin
                .execute(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                .await
                .unwrap();
        }
    });
}
