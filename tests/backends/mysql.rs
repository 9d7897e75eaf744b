//! The conformance and sweeper suites on MariaDB / MySQL (a fresh database per test), and the
//! SQL fault suite.

use idemflow::store::mysql::MySqlStore;
use idemflow::{KeyId, async_trait};
use sqlx::migrate::Migrator;
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection};
use sqlx::{AssertSqlSafe, ConnectOptions, Executor};

use crate::sql_faults::SqlDatabase;
use crate::support::mysql::{drop_database, fresh_database, pool_for};

mod suite {
    idemflow::conformance_tests!(crate::support::mysql::store);
}

mod sweeper {
    idemflow::sweeper_tests!(crate::support::mysql::store);
}

mod faults {
    crate::sql_faults::sql_fault_tests!(super::Database);
}

/// A test's own database.
pub struct Database {
    options: MySqlConnectOptions,
    name: String,
}

#[async_trait]
impl SqlDatabase for Database {
    const BACKEND: &'static str = "mysql";
    type Store = MySqlStore;
    type Session = MySqlConnection;

    async fn fresh() -> Option<Self> {
        let (options, name) = fresh_database().await?;
        Some(Self { options, name })
    }
    async fn store(&self, max: u32) -> MySqlStore {
        MySqlStore::from_pool(pool_for(&self.options, max).await)
    }
    async fn session(&self) -> MySqlConnection {
        self.options.connect().await.unwrap()
    }
    async fn drop(self) {
        drop_database(&self.options, &self.name).await;
    }

    async fn run_migrator(store: &MySqlStore, migrator: &Migrator) {
        migrator.run(store.pool()).await.unwrap();
    }
    async fn execute(store: &MySqlStore, sql: &str) {
        sqlx::query(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .unwrap();
    }
    async fn count(store: &MySqlStore, sql: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(store.pool())
            .await
            .unwrap()
    }
    async fn strings(store: &MySqlStore, sql: &str) -> Vec<String> {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(store.pool())
            .await
            .unwrap()
    }

    async fn connection_id(store: &MySqlStore) -> u64 {
        sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(store.pool())
            .await
            .unwrap()
    }
    async fn lock_row(session: &mut MySqlConnection, id: &KeyId) {
        session.execute("BEGIN").await.unwrap();
        sqlx::query("SELECT 1 FROM idempotency_keys WHERE scope = ? AND `key` = ? FOR UPDATE")
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .execute(&mut *session)
            .await
            .unwrap();
    }
    async fn rollback(session: &mut MySqlConnection) {
        session.execute("ROLLBACK").await.unwrap();
    }
    async fn waits_on_a_lock(admin: &mut MySqlConnection, conn: u64) -> bool {
        current_statement(admin, conn)
            .await
            .is_some_and(|q| q.starts_with("UPDATE"))
    }
    async fn kill(admin: &mut MySqlConnection, conn: u64) -> bool {
        admin
            .execute(AssertSqlSafe(format!("KILL CONNECTION {conn}")))
            .await
            .unwrap();
        true
    }
    async fn is_gone(admin: &mut MySqlConnection, conn: u64) -> bool {
        let n: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?")
                .bind(conn)
                .fetch_one(&mut *admin)
                .await
                .unwrap();
        n == 0
    }
    async fn close_pool(store: &MySqlStore) {
        store.pool().close().await;
    }
}

/// The statement connection `conn` is running, as the process list shows it (inside a
/// procedure: the procedure's current statement).
async fn current_statement(admin: &mut MySqlConnection, conn: u64) -> Option<String> {
    sqlx::query_scalar("SELECT INFO FROM information_schema.PROCESSLIST WHERE ID = ?")
        .bind(conn)
        .fetch_optional(admin)
        .await
        .unwrap()
        .flatten()
}

/// Issue 11, finding 3: the claim must not depend on `ON DUPLICATE KEY UPDATE` assigning left
/// to right. With `SIMULTANEOUS_ASSIGNMENT` in the session's `sql_mode` (a server-wide setting
/// sqlx inherits), a retry's takeover of an expired key must still move the token on and fence
/// the zombie holder out.
mod simultaneous_assignment {
    use std::sync::Arc;
    use std::time::Duration;

    use idemflow::conformance::{self, claim_for, claimed, done, id, unique};
    use idemflow::store::mysql::MySqlStore;
    use idemflow::{Store, StoreError, StoredResponse, record::LeaseToken};
    use sqlx::Executor;
    use sqlx::mysql::MySqlPoolOptions;

    use crate::support::mysql::fresh_database;

    async fn store() -> Option<Arc<dyn Store>> {
        let (options, _) = fresh_database().await?;
        let pool = MySqlPoolOptions::new()
            .max_connections(5)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute(
                        "SET SESSION sql_mode = CONCAT(@@sql_mode, ',SIMULTANEOUS_ASSIGNMENT')",
                    )
                    .await?;
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .unwrap();
        let store = MySqlStore::from_pool(pool);
        store.migrate().await.unwrap();
        Some(Arc::new(store))
    }

    #[test]
    fn takeover_moves_the_token_and_fences_the_zombie() {
        conformance::run(async {
            let Some(store) = store().await else { return };
            let id = id(&unique("simul"), "k1");
            let zombie = claimed(&store, &claim_for(&id, "{}", Duration::ZERO)).await;
            let mut retry = claim_for(&id, "{}", Duration::from_secs(30));
            retry.takeover_window = Some(Duration::from_secs(3600));
            let winner = claimed(&store, &retry).await;
            assert_eq!(
                winner.token,
                LeaseToken(zombie.token.0 + 1),
                "two holders with one token"
            );
            let r = store.get(&id).await.unwrap().unwrap();
            assert_eq!(r.lease_token, winner.token);
            assert!(r.lease_expires_at.unwrap() > store.now().await.unwrap());
            assert!(matches!(
                store
                    .finish(&id, zombie.token, &done(StoredResponse::new(299)))
                    .await,
                Err(StoreError::LeaseLost { .. })
            ));
            store
                .finish(&id, winner.token, &done(StoredResponse::new(201)))
                .await
                .unwrap();
        });
    }

    #[test]
    fn conformance_takeover_case() {
        conformance::run(async {
            let Some(store) = store().await else { return };
            conformance::store::retry_takeover_only_inside_the_window(store).await;
        });
    }

    #[test]
    fn conformance_reclaim_case() {
        conformance::run(async {
            let Some(store) = store().await else { return };
            conformance::store::retryable_failure_is_reclaimed_by_the_same_request(store).await;
        });
    }
}

/// Issue 12: a new key costs two round trips (the claim, the finish) and a replay one; before,
/// seven and one. Counted with the session's `Questions` status (statements sent by the client,
/// not those run inside the procedures) on a pool of one connection, after a first key has
/// prepared every statement.
mod round_trips {
    use std::sync::Arc;
    use std::time::Duration;

    use idemflow::conformance::{claim_for, claimed, done, id, unique};
    use idemflow::store::ClaimOutcome;
    use idemflow::store::mysql::MySqlStore;
    use idemflow::{Store, StoredResponse};

    use crate::support::mysql::{drop_database, fresh_database, pool_for};

    async fn questions(store: &MySqlStore) -> i64 {
        let (_, v): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Questions'")
            .fetch_one(store.pool())
            .await
            .unwrap();
        v.parse().unwrap()
    }

    async fn new_key(store: &Arc<dyn Store>, key: &idemflow::KeyId) {
        let lease = claimed(store, &claim_for(key, "{}", Duration::from_secs(30))).await;
        store
            .finish(key, lease.token, &done(StoredResponse::new(201)))
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn new_key_takes_two_round_trips_and_a_replay_one() {
        let Some((options, name)) = fresh_database().await else {
            return;
        };
        let mysql = MySqlStore::from_pool(pool_for(&options, 1).await);
        mysql.migrate().await.unwrap();
        let store: Arc<dyn Store> = Arc::new(mysql.clone());
        let scope = unique("rt");
        // Warm-up: prepares the statements on the one connection.
        new_key(&store, &id(&scope, "warm")).await;
        let replay = store
            .claim(&claim_for(
                &id(&scope, "warm"),
                "{}",
                Duration::from_secs(30),
            ))
            .await
            .unwrap();
        assert!(matches!(replay, ClaimOutcome::Existing { .. }));

        let before = questions(&mysql).await;
        new_key(&store, &id(&scope, "k1")).await;
        let after = questions(&mysql).await;
        assert_eq!(after - before - 1, 2, "round trips for a new key");

        let before = questions(&mysql).await;
        let replay = store
            .claim(&claim_for(&id(&scope, "k1"), "{}", Duration::from_secs(30)))
            .await
            .unwrap();
        let after = questions(&mysql).await;
        assert!(matches!(replay, ClaimOutcome::Existing { .. }));
        assert_eq!(after - before - 1, 1, "round trips for a replay");
        drop_database(&options, &name).await;
    }
}

mod pool {
    use std::time::Duration;

    use idemflow::StoreError;
    use idemflow::store::mysql::MySqlStore;
    use idemflow::store::{PoolExhausted, PoolOptions};

    use crate::support::backend_url;
    use crate::support::mysql::URL_VAR;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connect_sizes_the_pool_for_concurrency_and_connect_with_is_honoured() {
        let Some(url) = backend_url(URL_VAR) else {
            return;
        };
        let store = MySqlStore::connect(&url).await.unwrap();
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
        let store = MySqlStore::connect_with(&url, options).await.unwrap();
        let o = store.pool().options();
        assert_eq!(o.get_max_connections(), 7);
        assert_eq!(o.get_min_connections(), 2);
        assert_eq!(o.get_acquire_timeout(), Duration::from_secs(30));

        let zero = MySqlStore::connect_with(&url, PoolOptions::default().max_connections(0)).await;
        assert!(matches!(zero, Err(StoreError::Config(_))), "{zero:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_beyond_the_pool_wait_then_get_pool_exhausted() {
        let Some(url) = backend_url(URL_VAR) else {
            return;
        };
        let options = PoolOptions::default()
            .max_connections(1)
            .acquire_timeout(Duration::from_millis(300));
        let store = MySqlStore::connect_with(&url, options).await.unwrap();
        let held = store.pool().acquire().await.unwrap();
        let err = idemflow::Store::now(&store).await.unwrap_err();
        let source = std::error::Error::source(&err).expect("a source");
        let exhausted = source
            .downcast_ref::<PoolExhausted>()
            .unwrap_or_else(|| panic!("not PoolExhausted: {err}"));
        assert_eq!(exhausted.max_connections, 1);
        assert!(err.to_string().contains("max_connections"), "{err}");
        drop(held);
        idemflow::Store::now(&store).await.unwrap();
    }
}

/// The claim procedure's plain `INSERT` meeting a key that another session inserted after the
/// procedure's read (`migrations/mysql/`): the duplicate-key error is caught and the upsert
/// of before decides, here that the key is the other session's. The other session holds its row
/// uncommitted, so the store's read does not see it and its `INSERT` waits on the row's lock;
/// the other session commits once the store's session is seen at its `INSERT`.
mod claim_race {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use idemflow::Store;
    use idemflow::conformance::{claim_for, id, unique};
    use idemflow::store::ClaimOutcome;
    use sqlx::Executor;

    use super::{Database, current_statement};
    use crate::sql_faults::SqlDatabase;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_whose_insert_meets_a_key_inserted_since_its_read_finds_it() {
        let Some(db) = Database::fresh().await else {
            return;
        };
        // One connection, so that its thread id names the store's transaction.
        let mysql = db.store(1).await;
        mysql.migrate().await.unwrap();
        let store_thread = Database::connection_id(&mysql).await;
        let key = id(&unique("race"), "k");
        let claim = claim_for(&key, "{}", Duration::from_secs(30));

        let mut other = db.session().await;
        other.execute("START TRANSACTION").await.unwrap();
        sqlx::query(
            "CALL idempotency_keys_claim_v1(?, ?, 'payments.create', 'fake', 'pk-other', \
             'fp-other', NULL, 'other-worker', 30000000, 3600000, NULL, 7, NULL)",
        )
        .bind(key.scope.as_str())
        .bind(key.key.as_str())
        .fetch_all(&mut other)
        .await
        .unwrap();

        let store: Arc<dyn Store> = Arc::new(mysql.clone());
        let racer = {
            let (store, claim) = (store.clone(), claim.clone());
            tokio::spawn(async move { store.claim(&claim).await })
        };
        // The store's session is past the procedure's read once its statement is the INSERT
        // (MariaDB shows a procedure's current statement in the process list). A transaction
        // that waits on a lock before it has written is not always in `innodb_trx`: committing
        // now, whether the INSERT already waits or is about to, makes it meet the key.
        let mut watch = db.session().await;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let info = current_statement(&mut watch, store_thread).await;
            if info.is_some_and(|q| q.starts_with("INSERT INTO idempotency_keys")) {
                break;
            }
            assert!(
                !racer.is_finished(),
                "the store's claim ended before its INSERT met the other session's row"
            );
            assert!(
                Instant::now() < deadline,
                "the store's claim never reached its INSERT"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        other.execute("COMMIT").await.unwrap();

        let outcome = racer.await.unwrap().unwrap();
        let ClaimOutcome::Existing { record, .. } = outcome else {
            panic!("the key is the other session's: {outcome:?}");
        };
        assert_eq!(record.fingerprint.as_str(), "fp-other");
        assert_eq!(record.provider_key, "pk-other");
        // One claim in the history: the store's claim wrote nothing.
        assert_eq!(store.history(&key).await.unwrap().len(), 1);
        db.drop().await;
    }
}
