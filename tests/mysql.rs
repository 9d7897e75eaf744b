//! The conformance and sweeper suites on MariaDB / MySQL (a fresh database per test), and two
//! app instances racing, and sharing a database with the host app's migrations.
//!
//! Needs `IDEMFLOW_TEST_MYSQL_URL`; skipped when unset, and a failure when unset or unreachable
//! under `CI=true`.

#![cfg(feature = "mysql")]

#[macro_use]
mod conformance;
#[macro_use]
mod sweeper_suite;

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use conformance::{backend_url, claim_for, claimed, id};
use idemflow::Store;
use idemflow::store::mysql::MySqlStore;
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Executor};

const URL_VAR: &str = "IDEMFLOW_TEST_MYSQL_URL";
const PREFIX: &str = "idemflow_t_";
static DATABASES: AtomicU64 = AtomicU64::new(0);

fn unreachable<T>(e: impl std::fmt::Display) -> Option<T> {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("MariaDB/MySQL at {URL_VAR} is unreachable and CI=true: {e}");
    }
    eprintln!("skipping: MariaDB/MySQL at {URL_VAR} is unreachable: {e}");
    None
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Creates a fresh database (dropping this suite's databases older than an hour) and returns
/// the options to reach it and its name.
async fn fresh_database() -> Option<(MySqlConnectOptions, String)> {
    let url = backend_url(URL_VAR)?;
    let base = MySqlConnectOptions::from_str(&url).unwrap();
    let mut admin = match base.connect().await {
        Ok(c) => c,
        Err(e) => return unreachable(e),
    };
    let old: Vec<String> = sqlx::query_scalar(
        "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'idemflow\\_t\\_%'",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    for name in old {
        let born: Option<u64> = name[PREFIX.len()..]
            .split('_')
            .next()
            .and_then(|s| s.parse().ok());
        if born.is_some_and(|b| b + 3600 < now_secs()) {
            let _ = admin
                .execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS `{name}`")))
                .await;
        }
    }
    let name = format!(
        "{PREFIX}{}_{}_{}",
        now_secs(),
        std::process::id(),
        DATABASES.fetch_add(1, Ordering::Relaxed)
    );
    admin
        .execute(AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .unwrap();
    admin.close().await.unwrap();
    Some((base.database(&name), name))
}

async fn pool_for(options: &MySqlConnectOptions, max: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(max)
        .connect_with(options.clone())
        .await
        .unwrap()
}

async fn store() -> Option<Arc<dyn Store>> {
    let (options, _) = fresh_database().await?;
    let store = MySqlStore::from_pool(pool_for(&options, 5).await);
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

async fn drop_database(options: &MySqlConnectOptions, name: &str) {
    let mut admin: MySqlConnection = options.clone().database("mysql").connect().await.unwrap();
    admin
        .execute(AssertSqlSafe(format!("DROP DATABASE {name}")))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pools_race_500_claims_of_one_key() {
    let Some((options, name)) = fresh_database().await else {
        return;
    };
    let a = MySqlStore::from_pool(pool_for(&options, 5).await);
    a.migrate().await.unwrap();
    let b = MySqlStore::from_pool(pool_for(&options, 5).await);
    let stores: [Arc<dyn Store>; 2] = [Arc::new(a), Arc::new(b)];
    conformance::race_claims_across(&stores, 500).await;
    drop_database(&options, &name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_migrations_and_idemflow_migrations_share_a_database() {
    let Some((options, name)) = fresh_database().await else {
        return;
    };
    let pool = pool_for(&options, 2).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("20240101000000_app_users.sql"),
        "CREATE TABLE app_users (id BIGINT PRIMARY KEY, name TEXT NOT NULL);",
    )
    .unwrap();
    let app = sqlx::migrate::Migrator::new(dir.path()).await.unwrap();
    app.run(&pool).await.unwrap();
    let store = MySqlStore::from_pool(pool.clone());
    store.migrate().await.unwrap();
    // Each migrator sees only its own table: running both again is a no-op, not an error about
    // unknown applied migrations.
    app.run(&pool).await.unwrap();
    store.migrate().await.unwrap();
    let app_rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    let ours: Vec<String> = sqlx::query_scalar("SELECT description FROM _idemflow_migrations")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(app_rows, 1);
    assert_eq!(ours, ["idempotency keys"]);
    let s: Arc<dyn Store> = Arc::new(store);
    claimed(
        &s,
        &claim_for(&id("app", "k"), "{}", Duration::from_secs(5)),
    )
    .await;
    drop_database(&options, &name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connection_mid_transaction_leaves_old_state_and_retry_succeeds() {
    let Some((options, name)) = fresh_database().await else {
        return;
    };
    // One connection, so the connection we kill is the one the worker's write uses.
    let store = MySqlStore::from_pool(pool_for(&options, 1).await);
    store.migrate().await.unwrap();
    let id = id(&conformance::unique("kill"), "k1");
    let lease = claimed(
        &(Arc::new(store.clone()) as Arc<dyn Store>),
        &claim_for(&id, "{}", Duration::from_secs(60)),
    )
    .await;
    let conn_id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(store.pool())
        .await
        .unwrap();

    // Another session holds the row lock, so the worker's finish stops inside its transaction.
    let mut locker: MySqlConnection = options.connect().await.unwrap();
    locker.execute("BEGIN").await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE scope = ? AND `key` = ? FOR UPDATE")
        .bind(id.scope.as_str())
        .bind(id.key.as_str())
        .execute(&mut locker)
        .await
        .unwrap();
    let worker = {
        let store = store.clone();
        let id = id.clone();
        tokio::spawn(async move {
            store
                .finish(
                    &id,
                    Some(lease.token),
                    &conformance::done(idemflow::StoredResponse::new(201)),
                )
                .await
        })
    };
    let mut admin: MySqlConnection = options.connect().await.unwrap();
    let mut waiting = false;
    for _ in 0..200 {
        let info: Option<String> =
            sqlx::query_scalar("SELECT INFO FROM information_schema.PROCESSLIST WHERE ID = ?")
                .bind(conn_id)
                .fetch_optional(&mut admin)
                .await
                .unwrap()
                .flatten();
        if info.is_some_and(|q| q.starts_with("UPDATE")) {
            waiting = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        waiting,
        "the worker's write should be waiting on the row lock"
    );
    admin
        .execute(AssertSqlSafe(format!("KILL CONNECTION {conn_id}")))
        .await
        .unwrap();
    let err = worker.await.unwrap().unwrap_err();
    assert!(
        matches!(
            err,
            idemflow::StoreError::Database {
                backend: "mysql",
                ..
            }
        ),
        "a clear store error, got {err}"
    );
    eprintln!("killed worker got: {err}");
    locker.execute("ROLLBACK").await.unwrap();

    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.lease_token),
        (idemflow::KeyState::Processing, lease.token)
    );
    assert_eq!(store.history(&id).await.unwrap().len(), 1);
    let r = store
        .finish(
            &id,
            Some(lease.token),
            &conformance::done(idemflow::StoredResponse::new(201)),
        )
        .await
        .unwrap();
    assert_eq!(r.state, idemflow::KeyState::Done);
    assert_eq!(store.history(&id).await.unwrap().len(), 2);
    drop_database(&options, &name).await;
}
