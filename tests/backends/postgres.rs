//! The conformance and sweeper suites on PostgreSQL (a fresh schema per test, found through
//! `search_path`), the SQL fault suite, and the sweeper's plan on a big table.

use idemflow::store::SweeperStore;
use std::time::Duration;

use idemflow::store::postgres::{PostgresStore, TAKE_STALE_SQL};
use idemflow::store::{PoolExhausted, PoolOptions, TakeStale};
use idemflow::{KeyId, Store, async_trait, record::LeaseToken};
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Executor, Row};

use crate::sql_faults::SqlDatabase;
use crate::support::backend_url;
use crate::support::postgres::{URL_VAR, connection_in, drop_schema, fresh_schema, pool_in};

mod suite {
    idemflow::conformance_tests!(crate::support::postgres::store);
}

mod sweeper {
    idemflow::sweeper_tests!(crate::support::postgres::store);
}

mod faults {
    crate::sql_faults::sql_fault_tests!(super::Schema);
}

/// A test's own schema.
pub struct Schema {
    url: String,
    name: String,
}

#[async_trait]
impl SqlDatabase for Schema {
    const BACKEND: &'static str = "postgres";
    type Store = PostgresStore;
    type Session = PgConnection;

    async fn fresh() -> Option<Self> {
        let (url, name) = fresh_schema().await?;
        Some(Self { url, name })
    }
    async fn store(&self, max: u32) -> PostgresStore {
        PostgresStore::from_pool(pool_in(&self.url, &self.name, max).await)
    }
    async fn session(&self) -> PgConnection {
        connection_in(&self.url, &self.name).await
    }
    async fn drop(self) {
        drop_schema(&self.url, &self.name).await;
    }

    async fn run_migrator(store: &PostgresStore, migrator: &Migrator) {
        migrator.run(store.pool()).await.unwrap();
    }
    async fn execute(store: &PostgresStore, sql: &str) {
        sqlx::query(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .unwrap();
    }
    async fn count(store: &PostgresStore, sql: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(store.pool())
            .await
            .unwrap()
    }
    async fn strings(store: &PostgresStore, sql: &str) -> Vec<String> {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(store.pool())
            .await
            .unwrap()
    }

    async fn connection_id(store: &PostgresStore) -> u64 {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(store.pool())
            .await
            .unwrap();
        pid.try_into().unwrap()
    }
    async fn lock_row(session: &mut PgConnection, id: &KeyId) {
        session.execute("BEGIN").await.unwrap();
        sqlx::query("SELECT 1 FROM idempotency_keys WHERE scope = $1 AND key = $2 FOR UPDATE")
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .execute(&mut *session)
            .await
            .unwrap();
    }
    async fn rollback(session: &mut PgConnection) {
        session.execute("ROLLBACK").await.unwrap();
    }
    async fn waits_on_a_lock(admin: &mut PgConnection, conn: u64) -> bool {
        let w: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(i32::try_from(conn).unwrap())
                .fetch_optional(&mut *admin)
                .await
                .unwrap()
                .flatten();
        w.as_deref() == Some("Lock")
    }
    async fn kill(admin: &mut PgConnection, conn: u64) -> bool {
        sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(i32::try_from(conn).unwrap())
            .fetch_one(&mut *admin)
            .await
            .unwrap()
    }
    async fn is_gone(admin: &mut PgConnection, conn: u64) -> bool {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
            .bind(i32::try_from(conn).unwrap())
            .fetch_one(&mut *admin)
            .await
            .unwrap();
        n == 0
    }
    async fn close_pool(store: &PostgresStore) {
        store.pool().close().await;
    }
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
           history) \
         SELECT 'big', 'done-' || g, 'op', 'pk-' || g, 'done', 'v1:x', 1, 1, now(), now(), \
           now() + interval '1 day', 86400000, 1, '' \
         FROM generate_series(1, 100000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (scope, key, operation, provider_key, state, fingerprint, \
           lease_token, lease_expires_at, attempts, created_at, updated_at, retention_ms, \
           version, history) \
         SELECT 'big', 'stale-' || g, 'op', 'pk-' || g, 'processing', 'v1:x', 1, \
           now() - interval '1 minute', 1, now(), now(), 86400000, 1, '' \
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
        .bind(None::<String>)
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
            scope: None,
        })
        .await
        .unwrap();
    assert_eq!(taken.len(), 100);
    assert!(taken.iter().all(|r| r.lease_token == LeaseToken(2)));
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_sizes_the_pool_for_concurrency_and_connect_with_is_honoured() {
    let Some(url) = backend_url(URL_VAR) else {
        return;
    };
    let store = PostgresStore::connect(&url).await.unwrap();
    assert_eq!(PoolOptions::DEFAULT_MAX_CONNECTIONS, 16);
    assert_eq!(store.pool().options().get_max_connections(), 16);
    assert_eq!(
        store.pool().options().get_acquire_timeout(),
        Duration::from_secs(5)
    );

    let options = PoolOptions::default()
        .max_connections(7)
        .min_connections(2)
        .acquire_timeout(Duration::from_secs(30));
    let store = PostgresStore::connect_with(&url, options).await.unwrap();
    let o = store.pool().options();
    assert_eq!(o.get_max_connections(), 7);
    assert_eq!(o.get_min_connections(), 2);
    assert_eq!(o.get_acquire_timeout(), Duration::from_secs(30));

    let zero = PostgresStore::connect_with(&url, PoolOptions::default().max_connections(0)).await;
    assert!(
        matches!(zero, Err(idemflow::StoreError::Config(_))),
        "{zero:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_beyond_the_pool_wait_then_get_pool_exhausted() {
    let Some(url) = backend_url(URL_VAR) else {
        return;
    };
    let options = PoolOptions::default()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300));
    let store = PostgresStore::connect_with(&url, options).await.unwrap();
    let held = store.pool().acquire().await.unwrap();
    let started = std::time::Instant::now();
    let err = store.now().await.unwrap_err();
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    let source = std::error::Error::source(&err).expect("a source");
    let exhausted = source
        .downcast_ref::<PoolExhausted>()
        .unwrap_or_else(|| panic!("not PoolExhausted: {err}"));
    assert_eq!(exhausted.max_connections, 1);
    assert!(err.to_string().contains("max_connections"), "{err}");
    drop(held);
    store.now().await.unwrap();
}
