//! Faults every SQL backend must survive, written once and run on PostgreSQL and MariaDB through
//! [`sql_fault_tests!`]: two app instances (two pools) racing for one key or waiting for each
//! other's answer, the connection of a write killed mid-transaction or while idle in the pool,
//! and sharing a database with the host app's migrations.
//!
//! A backend provides the few statements that differ ([`SqlDatabase`]); the story and every
//! assertion live here.

use idemflow::store::OperatorStore;
use std::sync::Arc;
use std::time::Duration;

use idemflow::conformance::{self, claim_for, claimed, done, id};
use idemflow::{KeyId, KeyState, Store, StoreError, StoredResponse, async_trait};
use sqlx::migrate::Migrator;

/// A test's own database (a schema or a database) on one SQL backend, and the backend-specific
/// statements the fault tests need.
#[async_trait]
pub trait SqlDatabase: Sized + Send + Sync + 'static {
    /// The backend's name in [`StoreError::Database`].
    const BACKEND: &'static str;
    type Store: Store + Clone + 'static;
    /// One connection of its own inside the test's database.
    type Session: Send;

    /// A fresh, empty database for this test; `None` skips it.
    async fn fresh() -> Option<Self>;
    /// A store on a new pool of `max` connections (not migrated).
    async fn store(&self, max: u32) -> Self::Store;
    async fn session(&self) -> Self::Session;
    /// Drops the test's database.
    async fn drop(self);

    async fn run_migrator(store: &Self::Store, migrator: &Migrator);
    async fn execute(store: &Self::Store, sql: &str);
    async fn count(store: &Self::Store, sql: &str) -> i64;
    async fn strings(store: &Self::Store, sql: &str) -> Vec<String>;

    /// The server's id of the store's (only) connection.
    async fn connection_id(store: &Self::Store) -> u64;
    /// Begins a transaction on `session` that holds the row lock of `id`.
    async fn lock_row(session: &mut Self::Session, id: &KeyId);
    async fn rollback(session: &mut Self::Session);
    /// Whether connection `conn` is waiting on a row lock.
    async fn waits_on_a_lock(admin: &mut Self::Session, conn: u64) -> bool;
    /// Kills connection `conn`; whether the server says it did.
    async fn kill(admin: &mut Self::Session, conn: u64) -> bool;
    /// Whether connection `conn` is gone from the server's list of sessions.
    async fn is_gone(admin: &mut Self::Session, conn: u64) -> bool;
}

/// Expands to one test per fault test for the [`SqlDatabase`] `$db`.
macro_rules! sql_fault_tests {
    ($db:ty) => {
        $crate::sql_faults::sql_fault_tests!(@each $db;
            two_pools_race_500_claims_of_one_key,
            duplicates_through_another_pool_wait_for_the_first_answer,
            killed_connection_mid_transaction_leaves_old_state_and_retry_succeeds,
            connection_killed_while_idle_is_replaced_before_a_call_gets_it,
            app_migrations_and_idemflow_migrations_share_a_database
        );
    };
    (@each $db:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::sql_faults::$name::<$db>().await;
            }
        )*
    };
}
pub(crate) use sql_fault_tests;

pub async fn two_pools_race_500_claims_of_one_key<D: SqlDatabase>() {
    let Some(db) = D::fresh().await else {
        return;
    };
    let a = db.store(5).await;
    a.migrate().await.unwrap();
    let b = db.store(5).await;
    let stores: [Arc<dyn Store>; 2] = [Arc::new(a), Arc::new(b)];
    conformance::race_claims_across(&stores, 500).await;
    db.drop().await;
}

pub async fn duplicates_through_another_pool_wait_for_the_first_answer<D: SqlDatabase>() {
    let Some(db) = D::fresh().await else {
        return;
    };
    let a = db.store(5).await;
    a.migrate().await.unwrap();
    let b = db.store(5).await;
    let stores: [Arc<dyn Store>; 2] = [Arc::new(a), Arc::new(b)];
    conformance::waiting_across_stores(&stores).await;
    db.drop().await;
}

pub async fn killed_connection_mid_transaction_leaves_old_state_and_retry_succeeds<
    D: SqlDatabase,
>() {
    let Some(db) = D::fresh().await else {
        return;
    };
    // One connection, so the connection we kill is the one the worker's write uses.
    let store = db.store(1).await;
    store.migrate().await.unwrap();
    let id = id(&conformance::unique("kill"), "k1");
    let lease = claimed(
        &(Arc::new(store.clone()) as Arc<dyn Store>),
        &claim_for(&id, "{}", Duration::from_secs(60)),
    )
    .await;
    let conn = D::connection_id(&store).await;

    // Another session holds the row lock, so the worker's finish stops inside its transaction.
    let mut locker = db.session().await;
    D::lock_row(&mut locker, &id).await;
    let worker = {
        let store = store.clone();
        let id = id.clone();
        tokio::spawn(async move {
            store
                .finish(&id, lease.token, &done(StoredResponse::new(201)))
                .await
        })
    };
    let mut admin = db.session().await;
    let mut waiting = false;
    for _ in 0..200 {
        if D::waits_on_a_lock(&mut admin, conn).await {
            waiting = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        waiting,
        "the worker's write should be waiting on the row lock"
    );
    assert!(D::kill(&mut admin, conn).await);
    let err = worker.await.unwrap().unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Database { backend, .. } if backend == D::BACKEND
        ),
        "a clear store error, got {err}"
    );
    eprintln!("killed worker got: {err}");
    D::rollback(&mut locker).await;

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
        .finish(&id, lease.token, &done(StoredResponse::new(201)))
        .await
        .unwrap();
    assert_eq!(r.state, KeyState::Done);
    assert_eq!(store.history(&id).await.unwrap().len(), 2);
    db.drop().await;
}

/// A pool connection that the server dropped while it sat idle is replaced before a call gets
/// it: the pool pings a connection before handing it over (`docs/performance.md`, "The ping
/// before each call", and "Reverted: a stale connection that ran a handler twice").
pub async fn connection_killed_while_idle_is_replaced_before_a_call_gets_it<D: SqlDatabase>() {
    let Some(db) = D::fresh().await else {
        return;
    };
    // One connection, so the one killed is the one the next call gets.
    let store = db.store(1).await;
    let conn = D::connection_id(&store).await;
    let mut admin = db.session().await;
    assert!(D::kill(&mut admin, conn).await);
    while !D::is_gone(&mut admin, conn).await {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    store
        .now()
        .await
        .expect("the dropped connection was replaced");
    assert_ne!(D::connection_id(&store).await, conn);
    db.drop().await;
}

pub async fn app_migrations_and_idemflow_migrations_share_a_database<D: SqlDatabase>() {
    let Some(db) = D::fresh().await else {
        return;
    };
    let store = db.store(2).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("20240101000000_app_users.sql"),
        "CREATE TABLE app_users (id BIGINT PRIMARY KEY, name TEXT NOT NULL);",
    )
    .unwrap();
    let app = Migrator::new(dir.path()).await.unwrap();
    D::run_migrator(&store, &app).await;
    store.migrate().await.unwrap();
    // Each migrator sees only its own table: running both again is a no-op, not an error about
    // unknown applied migrations.
    D::run_migrator(&store, &app).await;
    store.migrate().await.unwrap();
    let app_rows = D::count(&store, "SELECT COUNT(*) FROM _sqlx_migrations").await;
    let ours = D::strings(&store, "SELECT description FROM _idemflow_migrations").await;
    assert_eq!(app_rows, 1);
    // Then each backend's own migrations.
    let expected: &[&str] = if D::BACKEND == "postgres" {
        &[
            "idempotency keys",
            "attempt history",
            "claim function",
            "lean writes",
            "claim provider rule",
            "history in the row",
            "announce ends",
        ]
    } else {
        &[
            "idempotency keys",
            "attempt history",
            "claim and finish procedures",
            "claim provider rule",
            "extend not after release",
            "claim inserts first",
            "provider change keeps the key",
            "renewed key by life",
        ]
    };
    assert_eq!(ours, expected);
    D::execute(&store, "INSERT INTO app_users VALUES (1, 'a')").await;
    let s: Arc<dyn Store> = Arc::new(store);
    claimed(
        &s,
        &claim_for(&id("app", "k"), "{}", Duration::from_secs(5)),
    )
    .await;
    db.drop().await;
}
