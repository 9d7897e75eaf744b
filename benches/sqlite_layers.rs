//! Where SQLite's one-caller new key spends its time, layer by layer (issue 22): the raw pair
//! of statements on a lean table (the throughput benchmark's floor), then the store's own claim
//! and finish called directly, then `Idempotency::execute` on top. Each beside the floor in the
//! same run, so a ratio shows which layer a gap is in: the statements the store runs, or the
//! executor around them. One caller, tokio `current_thread`, a file database in WAL mode with
//! `synchronous=FULL` on both sides (the store's default), a fresh key per call.
//!
//! ```text
//! cargo bench --bench sqlite_layers
//! ```
//!
//! `IDEMFLOW_BENCH_N`: keys per measurement (default 3,000); `IDEMFLOW_BENCH_ROUNDS`: rounds
//! (default 2). What the layers cost and why: `docs/performance.md`, "Why the gaps", "SQLite".

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow::store::sqlite::SqliteStore;
use idemflow::store::{ClaimOutcome, Finish, NewClaim};
use idemflow::{
    Idempotency, IdempotentRequest, KeyId, KeyState, Outcome, Store, StoredResponse,
    fingerprint::Fingerprint, key::IdempotencyKey, key::Scope, record::Actor,
};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

#[allow(dead_code)] // each benchmark uses part of it
mod support;
use support::sqlite_floor;

const BODY: &[u8] = br#"{"id":"pi_3NxYz2eZvKYlo2C0","status":"succeeded","amount":1999}"#;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}: a number")))
        .unwrap_or(default)
}

fn claim(id: KeyId) -> NewClaim {
    NewClaim {
        operation: "payments.create".into(),
        provider: None,
        provider_key: format!("pk-{}", id.key),
        fingerprint: Fingerprint::compute("payments.create", "{}"),
        request: Some("{}".into()),
        owner: "bench".into(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
        takeover_window: None,
        renewed_key_base: None,
        id,
    }
}

/// The request of `execute`'s key `i` in round `r`.
fn request(r: usize, i: usize) -> IdempotentRequest {
    let body = serde_json::json!({"amount": 1999});
    IdempotentRequest::new("bench", &format!("{r}-e{i}"), "payments.create", &body).unwrap()
}

fn finish() -> Finish {
    Finish {
        to: KeyState::Done,
        response: Some(StoredResponse::new(201).with_body(BODY.to_vec())),
        error: None,
        actor: Actor::Worker,
        reason: "ok".into(),
    }
}

/// µs per key of `n` runs of `f`.
async fn per_key<F, Fut>(n: usize, mut f: F) -> f64
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let t = Instant::now();
    for i in 0..n {
        f(i).await;
    }
    t.elapsed().as_secs_f64() * 1e6 / n as f64
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let (n, rounds) = (
        env("IDEMFLOW_BENCH_N", 3_000),
        env("IDEMFLOW_BENCH_ROUNDS", 2),
    );
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("idemflow.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    let idem = Idempotency::new(store.clone());
    // The floor: one connection, as the throughput benchmark's (sqlx's default pool options).
    let raw = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(dir.path().join("raw.db"))
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full),
        )
        .await
        .unwrap();
    sqlx::query(sqlite_floor::LEAN).execute(&raw).await.unwrap();
    let raw_insert = |key: String| {
        let raw = raw.clone();
        async move {
            let done = sqlx::query(sqlite_floor::CLAIM)
                .bind(&key)
                .execute(&raw)
                .await
                .unwrap();
            assert_eq!(
                done.rows_affected(),
                1,
                "raw floor: a new key was not inserted"
            );
            key
        }
    };
    let raw_update = |key: String| {
        let raw = raw.clone();
        async move {
            sqlx::query(sqlite_floor::DONE)
                .bind(&key)
                .bind(BODY)
                .execute(&raw)
                .await
                .unwrap();
        }
    };
    let id = |r: usize, what: &str, i: usize| {
        KeyId::new(
            Scope::new("bench").unwrap(),
            IdempotencyKey::new(format!("{r}-{what}{i}")).unwrap(),
        )
    };
    println!(
        "SQLite new keys by layer: N={n} per measurement, {rounds} round(s), 1 caller \
         (tokio current_thread), WAL, synchronous=FULL; µs per key (ratio: floor / layer)"
    );
    for r in 0..rounds {
        let pair = per_key(n, |i| {
            let (ins, upd) = (raw_insert, raw_update);
            async move { upd(ins(format!("{r}-p{i}")).await).await }
        })
        .await;
        let insert = per_key(n, |i| {
            let ins = raw_insert;
            async move {
                ins(format!("{r}-i{i}")).await;
            }
        })
        .await;
        let store_pair = per_key(n, |i| {
            let (store, k) = (store.clone(), id(r, "s", i));
            async move {
                let ClaimOutcome::Claimed(lease) = store.claim(&claim(k.clone())).await.unwrap()
                else {
                    panic!("store: a new key was not claimed")
                };
                store.finish(&k, lease.token, &finish()).await.unwrap();
            }
        })
        .await;
        let store_claim = per_key(n, |i| {
            let (store, k) = (store.clone(), id(r, "c", i));
            async move {
                let outcome = store.claim(&claim(k)).await.unwrap();
                assert!(
                    matches!(outcome, ClaimOutcome::Claimed(_)),
                    "store: not claimed"
                );
            }
        })
        .await;
        let execute = per_key(n, |i| {
            let idem = idem.clone();
            async move {
                let req = request(r, i);
                idem.execute(req, |_| async {
                    Outcome::Succeeded(StoredResponse::new(201).with_body(BODY.to_vec()))
                })
                .await
                .unwrap();
            }
        })
        .await;
        // Replays: each layer reads back the keys it finished above.
        let read = per_key(n, |i| {
            let raw = raw.clone();
            async move {
                let row: Option<(String,)> =
                    sqlx::query_as("SELECT state FROM raw_keys WHERE scope = 'raw' AND key = ?1")
                        .bind(format!("{r}-p{i}"))
                        .fetch_optional(&raw)
                        .await
                        .unwrap();
                assert!(row.is_some(), "raw read: key missing");
            }
        })
        .await;
        let store_replay = per_key(n, |i| {
            let (store, k) = (store.clone(), id(r, "s", i));
            async move {
                let outcome = store.claim(&claim(k)).await.unwrap();
                assert!(
                    matches!(outcome, ClaimOutcome::Existing { .. }),
                    "store: not a replay"
                );
            }
        })
        .await;
        let replay = per_key(n, |i| {
            let idem = idem.clone();
            async move {
                let req = request(r, i);
                let done = idem
                    .execute(req, |_| async { panic!("a replay ran its operation") })
                    .await
                    .unwrap();
                assert!(
                    matches!(done, idemflow::Execution::Replayed(_)),
                    "not a replay"
                );
            }
        })
        .await;
        println!("round {}", r + 1);
        println!("  raw floor: INSERT + UPDATE           {pair:7.1}");
        println!(
            "  store.claim + store.finish            {store_pair:7.1}  ({:.2}x)",
            pair / store_pair
        );
        println!(
            "  Idempotency::execute                  {execute:7.1}  ({:.2}x)",
            pair / execute
        );
        println!("  raw INSERT alone                      {insert:7.1}");
        println!(
            "  store.claim alone                     {store_claim:7.1}  ({:.2}x)",
            insert / store_claim
        );
        println!("  raw primary-key read                  {read:7.1}");
        println!(
            "  store.claim of a finished key         {store_replay:7.1}  ({:.2}x)",
            read / store_replay
        );
        println!(
            "  Idempotency::execute, a replay        {replay:7.1}  ({:.2}x)",
            read / replay
        );
        if execute > pair {
            println!(
                "  the executor's share of execute's gap to the floor: {:.0} %",
                100.0 * (execute - store_pair).max(0.0) / (execute - pair)
            );
        } else {
            println!("  the executor's share of execute's gap to the floor: none (no gap)");
        }
    }
}
