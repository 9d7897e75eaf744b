//! The conformance and sweeper suites on PostgreSQL (a fresh schema per test, found through
//! `search_path`), and PostgreSQL's own faults: two app instances racing, a backend killed mid-transaction,
//! sharing a database with the host app's migrations, and the sweeper's plan on a big table.
//!
//! Needs `IDEMFLOW_TEST_POSTGRES_URL`; skipped when unset, and a failure when unset or
//! unreachable under `CI=true`.

#![cfg(feature = "postgres")]

#[macro_use]
mod conformance;
mod pg_support;
#[macro_use]
mod sweeper_suite;

use std::sync::Arc;
use std::time::Duration;

use conformance::{claim_for, claimed, done, id};
use idemflow::store::TakeStale;
use idemflow::store::postgres::{PostgresStore, TAKE_STALE_SQL};
use idemflow::{KeyState, LeaseToken, Store, StoreError, StoredResponse};
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection, Executor, Row};

use pg_support::{drop_schema, fresh_schema, pool_in};

async fn store() -> Option<Arc<dyn Store>> {
    let (url, schema) = fresh_schema().await?;
    let store = PostgresStore::from_pool(pool_in(&url, &schema, 5).await);
    store.migrate().await.unwrap();
    Some(Arc::new(store))
}

mod suite {
    use super::*;
    conformance_tests!(store);
}

mod sweeper {
    use super::*;
    sweeper_tests!(store);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pools_race_500_claims_of_one_key() {
    let Some((url, schema)) = fresh_schema().await else {
        return;
    };
    let a = PostgresStore::from_pool(pool_in(&url, &schema, 5).await);
    a.migrate().await.unwrap();
    let b = PostgresStore::from_pool(pool_in(&url, &schema, 5).await);
    let stores: [Arc<dyn Store>; 2] = [Arc::new(a), Arc::new(b)];
    conformance::race_claims_across(&stores, 500).await;
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_backend_mid_transaction_leaves_old_state_and_retry_succeeds() {
    let Some((url, schema)) = fresh_schema().await else {
        return;
    };
    // One connection, so the backend we terminate is the one the worker's write uses.
    let store = PostgresStore::from_pool(pool_in(&url, &schema, 1).await);
    store.migrate().await.unwrap();
    let id = id(&conformance::unique("kill"), "k1");
    let lease = claimed(
        &(Arc::new(store.clone()) as Arc<dyn Store>),
        &claim_for(&id, "{}", Duration::from_secs(60)),
    )
    .await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .unwrap();

    // Another session holds the row lock, so the worker's finish stops inside its transaction.
    let mut locker = pool_in(&url, &schema, 1).await.acquire().await.unwrap();
    locker.execute("BEGIN").await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE scope = $1 AND key = $2 FOR UPDATE")
        .bind(id.scope.as_str())
        .bind(id.key.as_str())
        .execute(&mut *locker)
        .await
        .unwrap();
    let worker = {
        let store = store.clone();
        let id = id.clone();
        tokio::spawn(async move {
            store
                .finish(&id, Some(lease.token), &done(StoredResponse::new(201)))
                .await
        })
    };
    let mut admin = PgConnection::connect(&url).await.unwrap();
    let mut waiting = false;
    for _ in 0..200 {
        let w: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_optional(&mut admin)
                .await
                .unwrap()
                .flatten();
        if w.as_deref() == Some("Lock") {
            waiting = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        waiting,
        "the worker's write should be waiting on the row lock"
    );
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert!(killed);
    let err = worker.await.unwrap().unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Database {
                backend: "postgres",
                ..
            }
        ),
        "a clear store error, got {err}"
    );
    eprintln!("terminated worker got: {err}");
    locker.execute("ROLLBACK").await.unwrap();

    // The old state, whole: still processing under the first token, one history row.
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.lease_token),
        (KeyState::Processing, lease.token)
    );
    assert!(r.response.is_none());
    assert_eq!(store.history(&id).await.unwrap().len(), 1);
    // The pool reconnects and the retry succeeds.
    let r = store
        .finish(&id, Some(lease.token), &done(StoredResponse::new(201)))
        .await
        .unwrap();
    assert_eq!(r.state, KeyState::Done);
    assert_eq!(store.history(&id).await.unwrap().len(), 2);
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_migrations_and_idemflow_migrations_share_a_database() {
    let Some((url, schema)) = fresh_schema().await else {
        return;
    };
    let pool = pool_in(&url, &schema, 2).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("20240101000000_app_users.sql"),
        "CREATE TABLE app_users (id bigint PRIMARY KEY, name text NOT NULL);",
    )
    .unwrap();
    let app = sqlx::migrate::Migrator::new(dir.path()).await.unwrap();
    app.run(&pool).await.unwrap();
    let store = PostgresStore::from_pool(pool.clone());
    store.migrate().await.unwrap();
    // Each migrator sees only its own table: running both again is a no-op, not an error about
    // unknown applied migrations.
    app.run(&pool).await.unwrap();
    store.migrate().await.unwrap();
    let app_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    let ours: Vec<String> = sqlx::query_scalar("SELECT description FROM _idemflow_migrations")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(app_rows, 1);
    assert_eq!(ours, ["idempotency keys"]);
    sqlx::query("INSERT INTO app_users VALUES (1, 'a')")
        .execute(&pool)
        .await
        .unwrap();
    let s: Arc<dyn Store> = Arc::new(store);
    claimed(
        &s,
        &claim_for(&id("app", "k"), "{}", Duration::from_secs(5)),
    )
    .await;
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_key_query_uses_the_partial_index_on_a_big_table() {
    let Some((url, schema)) = fresh_schema().await else {
        return;
    };
    let pool = pool_in(&url, &schema, 2).await;
    let store = PostgresStore::from_pool(pool.clone());
    store.migrate().await.unwrap();
    // 100,000 done keys and 100 stale processing ones.
    sqlx::query(
        "INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, fingerprint, \
           lease_token, attempts, created_at, updated_at, expires_at, retention_ms, version, \
           last_actor) \
         SELECT 'big', 'done-' || g, 'op', 'pk-' || g, 'done', 'v1:x', 1, 1, now(), now(), \
           now() + interval '1 day', 86400000, 1, 'worker' \
         FROM generate_series(1, 100000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, fingerprint, \
           lease_token, lease_expires_at, attempts, created_at, updated_at, retention_ms, \
           version, last_actor) \
         SELECT 'big', 'stale-' || g, 'op', 'pk-' || g, 'processing', 'v1:x', 1, \
           now() - interval '1 minute', 1, now(), now(), 86400000, 1, 'worker' \
         FROM generate_series(1, 100) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE idempotency_keys")
        .execute(&pool)
        .await
        .unwrap();
    let rows = sqlx::query(AssertSqlSafe(format!("EXPLAIN {TAKE_STALE_SQL}")))
        .bind("sweeper")
        .bind(30_000i64)
        .bind(100i64)
        .fetch_all(&pool)
        .await
        .unwrap();
    let plan: Vec<String> = rows.iter().map(|r| r.get::<String, _>(0)).collect();
    let plan = plan.join("\n");
    println!("{plan}");
    assert!(
        plan.contains("idempotency_keys_stale"),
        "the sweeper must use the partial index:\n{plan}"
    );
    let taken = store
        .take_stale(&TakeStale {
            owner: "sweeper".into(),
            lease: Duration::from_secs(30),
            limit: 1000,
        })
        .await
        .unwrap();
    assert_eq!(taken.len(), 100);
    assert!(taken.iter().all(|r| r.lease_token == LeaseToken(2)));
    drop_schema(&url, &schema).await;
}
