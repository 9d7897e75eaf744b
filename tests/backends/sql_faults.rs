//! Faults every SQL backend must survive, written once and run on PostgreSQL and MariaDB through
//! [`sql_fault_tests!`]: two app instances (two pools) racing for one key or waiting for each
//! other's answer, the connection of a write killed mid-transaction or while idle in the pool,
//! reads on connections kept between reads (`store::warm`) while the server kills them, and
//! sharing a database with the host app's migrations.
//!
//! A backend provides the few statements that differ ([`SqlDatabase`]); the story and every
//! assertion live here.

use idemflow::store::OperatorStore;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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
    /// Closes the store's pool.
    async fn close_pool(store: &Self::Store);
}

/// Expands to one test per fault test for the [`SqlDatabase`] `$db`.
macro_rules! sql_fault_tests {
    ($db:ty) => {
        $crate::sql_faults::sql_fault_tests!(@each $db;
            two_pools_race_500_claims_of_one_key,
            duplicates_through_another_pool_wait_for_the_first_answer,
            killed_connection_mid_transaction_leaves_old_state_and_retry_succeeds,
            connection_killed_while_idle_is_replaced_before_a_call_gets_it,
            reads_go_on_while_the_server_kills_their_kept_connection,
            a_pool_user_gets_a_connection_while_reads_keep_the_store_busy,
            closing_the_pool_does_not_wait_for_kept_connections,
            app_migrations_and_idemflow_migrations_share_a_database,
            instances_migrating_one_database_at_once_all_succeed
        );
        $crate::sql_faults::sql_fault_tests!(@current_thread $db;
            a_write_does_not_run_on_a_kept_connection_that_died,
            a_write_after_a_write_does_not_run_on_a_kept_connection_that_died
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
    (@current_thread $db:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test]
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
/// it: the pool pings a connection before handing it over (`docs/performance.md`, "Connections
/// and pings").
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

/// A fresh database, a migrated store on a pool of `max` connections (also as `dyn Store`),
/// and a finished key of it.
async fn with_a_finished_key<D: SqlDatabase>(
    max: u32,
) -> Option<(D, D::Store, Arc<dyn Store>, KeyId)> {
    let db = D::fresh().await?;
    let store = db.store(max).await;
    store.migrate().await.unwrap();
    let reader: Arc<dyn Store> = Arc::new(store.clone());
    let k = finished_key(&reader, "k").await;
    Some((db, store, reader, k))
}

/// A new key `key` of a fresh scope, claimed and finished through `store`.
async fn finished_key(store: &Arc<dyn Store>, key: &str) -> KeyId {
    let k = id(&conformance::unique("warm"), key);
    let lease = claimed(store, &claim_for(&k, "{}", Duration::from_secs(30))).await;
    store
        .finish(&k, lease.token, &done(StoredResponse::new(200)))
        .await
        .unwrap();
    k
}

/// `readers` tasks read `k` through `store` in a loop until `stop`; their count of reads, and
/// the errors they met.
fn read_loop(
    store: &Arc<dyn Store>,
    k: &KeyId,
    readers: usize,
    stop: &Arc<AtomicBool>,
) -> (Arc<AtomicUsize>, Vec<tokio::task::JoinHandle<Vec<String>>>) {
    let reads = Arc::new(AtomicUsize::new(0));
    let tasks = (0..readers)
        .map(|_| {
            let (store, k, stop, reads) = (store.clone(), k.clone(), stop.clone(), reads.clone());
            tokio::spawn(async move {
                let mut errors = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    match store.get(&k).await {
                        Ok(Some(_)) => {}
                        Ok(None) => errors.push("the key was not found".to_owned()),
                        Err(e) => errors.push(e.to_string()),
                    }
                    reads.fetch_add(1, Ordering::SeqCst);
                }
                errors
            })
        })
        .collect();
    (reads, tasks)
}

/// The server kills the store's only connection 30 times while a task reads a key without a
/// pause (the connection is kept between reads, not pinged: `store::warm`): no read fails.
/// After each kill, the next waits until the killed connection is gone and three more reads
/// went on, so it never meets a second attempt's connection. Without the second attempt on a
/// connection from the pool, a read on a killed kept connection fails.
pub async fn reads_go_on_while_the_server_kills_their_kept_connection<D: SqlDatabase>() {
    let Some((db, store, reader, k)) = with_a_finished_key::<D>(1).await else {
        return;
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, tasks) = read_loop(&reader, &k, 1, &stop);
    let mut admin = db.session().await;
    let mut killed = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while killed < 30 && Instant::now() < deadline {
        let conn = D::connection_id(&store).await;
        assert!(D::kill(&mut admin, conn).await);
        killed += 1;
        let mut gone_at = None;
        while Instant::now() < deadline {
            if gone_at.is_none() && D::is_gone(&mut admin, conn).await {
                gone_at = Some(reads.load(Ordering::SeqCst));
            }
            if gone_at.is_some_and(|n| reads.load(Ordering::SeqCst) >= n + 3) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let mut errors = Vec::new();
    for t in tasks {
        errors.extend(t.await.unwrap());
    }
    let reads = reads.load(Ordering::SeqCst);
    assert!(
        killed >= 30,
        "only {killed} connections were killed within 60 s"
    );
    assert!(
        errors.is_empty(),
        "{} of {reads} reads failed ({killed} connections killed), the first: {}",
        errors.len(),
        errors[0]
    );
    drop(admin);
    db.drop().await;
}

/// A write takes a connection a read kept (instead of waiting until it goes back to the pool)
/// only after pinging it, as the pool pings every connection it hands out: here the server
/// killed it while it was kept, and the write must run on a new one. The test runs on a
/// current-thread runtime and kills from a thread of its own, so the store's task that gives
/// kept connections back cannot run in between: the write meets the dead connection every
/// time. Without the ping the claim fails ("expected to read 4 bytes" / "connection reset").
pub async fn a_write_does_not_run_on_a_kept_connection_that_died<D: SqlDatabase>() {
    let Some((db, store, reader, k)) = with_a_finished_key::<D>(1).await else {
        return;
    };
    // The pool's one connection: the read takes it and keeps it.
    let conn = D::connection_id(&store).await;
    assert!(reader.get(&k).await.unwrap().is_some());
    kill_from_a_thread_of_its_own(&db, conn);
    // Writes: the claim of a new key, and its finish.
    finished_key(&reader, "k2").await;
    assert_ne!(D::connection_id(&store).await, conn);
    db.drop().await;
}

/// A PostgreSQL write keeps its connection too (as a read does), and the next write pings it
/// first: here the claim kept the pool's one connection, the server killed it, and the finish
/// must run on a new one (current-thread runtime, as above). Without the ping the finish fails.
/// (MariaDB's writes give their connection back to the pool, whose ping finds it dead.)
pub async fn a_write_after_a_write_does_not_run_on_a_kept_connection_that_died<D: SqlDatabase>() {
    let Some(db) = D::fresh().await else {
        return;
    };
    let store = db.store(1).await;
    store.migrate().await.unwrap();
    let writer: Arc<dyn Store> = Arc::new(store.clone());
    // The pool's one connection: the claim takes it and keeps it.
    let conn = D::connection_id(&store).await;
    let k = id(&conformance::unique("warm"), "k");
    let lease = claimed(&writer, &claim_for(&k, "{}", Duration::from_secs(30))).await;
    kill_from_a_thread_of_its_own(&db, conn);
    let record = writer
        .finish(&k, lease.token, &done(StoredResponse::new(200)))
        .await
        .unwrap();
    assert_eq!(record.state, KeyState::Done);
    assert_ne!(D::connection_id(&store).await, conn);
    db.drop().await;
}

/// Kills the server session `conn` and waits until the server no longer lists it, on a thread
/// and runtime of its own: the caller's current-thread runtime runs nothing meanwhile.
fn kill_from_a_thread_of_its_own<D: SqlDatabase>(db: &D, conn: u64) {
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let mut admin = db.session().await;
                assert!(D::kill(&mut admin, conn).await);
                while !D::is_gone(&mut admin, conn).await {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            });
        })
        .join()
        .unwrap();
    });
}

/// Two tasks read without a pause through a 2-connection pool; meanwhile a pool user (an
/// acquire and a statement) must finish within 3 s. Kept forever while busy, the two
/// connections would never go back to the pool and the user would wait.
pub async fn a_pool_user_gets_a_connection_while_reads_keep_the_store_busy<D: SqlDatabase>() {
    let Some((db, store, reader, k)) = with_a_finished_key::<D>(2).await else {
        return;
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, tasks) = read_loop(&reader, &k, 2, &stop);
    while reads.load(Ordering::SeqCst) < 100 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let before = reads.load(Ordering::SeqCst);
    // One key in the table: the user reads 1.
    let user = D::count(&store, "SELECT COUNT(*) FROM idempotency_keys");
    let turn = tokio::time::timeout(Duration::from_secs(3), user).await;
    let during = reads.load(Ordering::SeqCst) - before;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        let errors = t.await.unwrap();
        assert!(errors.is_empty(), "{errors:?}");
    }
    assert_eq!(
        turn.ok(),
        Some(1),
        "a pool user got no connection within 3 s while the store was busy ({during} reads \
         meanwhile)"
    );
    assert!(during > 0, "the store made no read while the user waited");
    db.drop().await;
}

/// After back-to-back reads, closing the pool returns at once (kept connections go back within
/// about 1 ms) and the store reports the closed pool.
pub async fn closing_the_pool_does_not_wait_for_kept_connections<D: SqlDatabase>() {
    let Some((db, store, _, k)) = with_a_finished_key::<D>(2).await else {
        return;
    };
    for _ in 0..20 {
        assert!(store.get(&k).await.unwrap().is_some());
    }
    tokio::time::timeout(Duration::from_secs(5), D::close_pool(&store))
        .await
        .expect("the pool closed within 5 s of the last read");
    let err = store.get(&k).await.unwrap_err();
    assert!(err.to_string().contains("closed"), "{err}");
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
    // Then the backend's own migration: its baseline.
    assert_eq!(ours, ["baseline"]);
    D::execute(&store, "INSERT INTO app_users VALUES (1, 'a')").await;
    let s: Arc<dyn Store> = Arc::new(store);
    claimed(
        &s,
        &claim_for(&id("app", "k"), "{}", Duration::from_secs(5)),
    )
    .await;
    db.drop().await;
}

/// Instances starting together each run `migrate()` (MariaDB's also creates its procedures): all
/// succeed, a later run is a no-op, and the schema they leave serves a claim and its finish.
pub async fn instances_migrating_one_database_at_once_all_succeed<D: SqlDatabase>() {
    let Some(db) = D::fresh().await else {
        return;
    };
    let mut stores = Vec::new();
    for _ in 0..6 {
        stores.push(db.store(2).await);
    }
    let runs: Vec<_> = stores
        .iter()
        .map(|s| {
            let s = s.clone();
            tokio::spawn(async move { s.migrate().await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    stores[0].migrate().await.unwrap();
    let s: Arc<dyn Store> = Arc::new(stores.pop().unwrap());
    let k = id("migrate", "k");
    let lease = claimed(&s, &claim_for(&k, "{}", Duration::from_secs(5))).await;
    let record = s
        .finish(&k, lease.token, &done(StoredResponse::new(200)))
        .await
        .unwrap();
    assert_eq!(record.state, KeyState::Done);
    db.drop().await;
}
