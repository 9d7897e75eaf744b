//! Connections kept between back-to-back reads of a key (`store::warm`, PostgreSQL and
//! MariaDB): a read whose kept connection the server closed is run again on a connection from
//! the pool, and kept connections go back to the pool after 20 ms out of it however busy the
//! store is, and after 1 ms without a read, so a pool user gets its turn and `Pool::close` does
//! not wait for them.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idemflow::conformance::{claim_for, claimed, done, id, unique};
use idemflow::{KeyId, Store, StoredResponse};

/// A finished key of `store`, in a scope of its own.
async fn finished_key(store: &Arc<dyn Store>) -> KeyId {
    let k = id(&unique("warm"), "k");
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

/// How a test reaches the server's view of the store's one connection.
#[idemflow::async_trait]
trait Server: Send + Sync {
    /// The store's connections that sit idle now.
    async fn idle(&self) -> Vec<i64>;
    /// The server closes connection `id`.
    async fn close(&self, id: i64);
    /// Whether connection `id` is still there.
    async fn alive(&self, id: i64) -> bool;
}

/// The server closes `store`'s only connection 30 times, each time while it sits idle between
/// two reads of a task that reads a key without a pause (the connection is kept between reads,
/// not pinged): no read fails. After each closing, the next waits until the closed connection is
/// gone and three more reads went on, so it never meets a second attempt's connection. Without
/// the second attempt on a connection from the pool, a read on a closed kept connection fails.
async fn reads_go_on_while_the_server_closes_their_connection(
    store: Arc<dyn Store>,
    server: &dyn Server,
) {
    let k = finished_key(&store).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, tasks) = read_loop(&store, &k, 1, &stop);
    let mut closed = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while closed < 30 && Instant::now() < deadline {
        let [conn] = server.idle().await[..] else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        server.close(conn).await;
        closed += 1;
        let mut gone_at = None;
        while Instant::now() < deadline {
            if gone_at.is_none() && !server.alive(conn).await {
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
        closed >= 30,
        "only {closed} connections were closed within 60 s"
    );
    assert!(
        errors.is_empty(),
        "{} of {reads} reads failed ({closed} connections closed), the first: {}",
        errors.len(),
        errors[0]
    );
}

/// Two tasks read without a pause through `store`'s 2-connection pool; meanwhile `user` (a pool
/// acquire and a statement) must finish within 3 s. Kept forever while busy, the two
/// connections would never go back to the pool and the user would wait.
async fn a_pool_user_gets_its_turn(store: Arc<dyn Store>, user: impl Future<Output = ()>) {
    let k = finished_key(&store).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, tasks) = read_loop(&store, &k, 2, &stop);
    while reads.load(Ordering::SeqCst) < 100 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let before = reads.load(Ordering::SeqCst);
    let turn = tokio::time::timeout(Duration::from_secs(3), user).await;
    let during = reads.load(Ordering::SeqCst) - before;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        let errors = t.await.unwrap();
        assert!(errors.is_empty(), "{errors:?}");
    }
    assert!(
        turn.is_ok(),
        "a pool user got no connection within 3 s while the store was busy ({during} reads \
         meanwhile)"
    );
    assert!(during > 0, "the store made no read while the user waited");
}

/// After back-to-back reads, closing the pool (`close`) returns at once (kept connections go
/// back within about 1 ms) and the store reports the closed pool.
async fn closing_the_pool_does_not_wait(store: Arc<dyn Store>, close: impl Future<Output = ()>) {
    let k = finished_key(&store).await;
    for _ in 0..20 {
        assert!(store.get(&k).await.unwrap().is_some());
    }
    tokio::time::timeout(Duration::from_secs(5), close)
        .await
        .expect("the pool closed within 5 s of the last read");
    let err = store.get(&k).await.unwrap_err();
    assert!(err.to_string().contains("closed"), "{err}");
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::sync::Arc;

    use idemflow::Store;
    use idemflow::conformance::unique;
    use idemflow::store::postgres::PostgresStore;
    use sqlx::PgPool;
    use sqlx::postgres::PgPoolOptions;

    use crate::support::postgres::{drop_schema, fresh_schema, options_in, pool_in};

    /// The store's connections by their `application_name`.
    struct Pg {
        admin: PgPool,
        app: String,
    }

    #[idemflow::async_trait]
    impl super::Server for Pg {
        async fn idle(&self) -> Vec<i64> {
            sqlx::query_scalar(
                "SELECT pid::int8 FROM pg_stat_activity \
                 WHERE application_name = $1 AND state = 'idle'",
            )
            .bind(&self.app)
            .fetch_all(&self.admin)
            .await
            .unwrap()
        }
        async fn close(&self, id: i64) {
            sqlx::query("SELECT pg_terminate_backend($1::int4)")
                .bind(id)
                .execute(&self.admin)
                .await
                .unwrap();
        }
        async fn alive(&self, id: i64) -> bool {
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                .bind(id)
                .fetch_one(&self.admin)
                .await
                .unwrap()
        }
    }

    /// A migrated store on a pool of `max` connections in a fresh schema.
    async fn store(max: u32) -> Option<(PgPool, Arc<dyn Store>, String, String, String)> {
        let (url, schema) = fresh_schema().await?;
        let app = unique("warm");
        let pool = PgPoolOptions::new()
            .max_connections(max)
            .connect_with(options_in(&url, &schema).application_name(&app))
            .await
            .unwrap();
        let store = PostgresStore::from_pool(pool.clone());
        store.migrate().await.unwrap();
        Some((pool, Arc::new(store), app, url, schema))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_go_on_while_the_server_closes_their_kept_connection() {
        let Some((_, store, app, url, schema)) = store(1).await else {
            return;
        };
        let admin = pool_in(&url, &schema, 1).await;
        let server = Pg { admin, app };
        super::reads_go_on_while_the_server_closes_their_connection(store, &server).await;
        server.admin.close().await;
        drop_schema(&url, &schema).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pool_user_gets_a_connection_while_reads_keep_the_store_busy() {
        let Some((pool, store, _, url, schema)) = store(2).await else {
            return;
        };
        let user = async move {
            let one: i32 = sqlx::query_scalar("SELECT 1")
                .fetch_one(&mut *pool.acquire().await.unwrap())
                .await
                .unwrap();
            assert_eq!(one, 1);
        };
        super::a_pool_user_gets_its_turn(store, user).await;
        drop_schema(&url, &schema).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn closing_the_pool_does_not_wait_for_kept_connections() {
        let Some((pool, store, _, url, schema)) = store(2).await else {
            return;
        };
        super::closing_the_pool_does_not_wait(store, async move { pool.close().await }).await;
        drop_schema(&url, &schema).await;
    }
}

#[cfg(feature = "mysql")]
mod mariadb {
    use std::sync::Arc;

    use idemflow::Store;
    use idemflow::store::mysql::MySqlStore;
    use sqlx::MySqlPool;
    use sqlx::mysql::MySqlConnectOptions;

    use crate::support::mysql::{drop_database, fresh_database, pool_for};

    /// The store's connections by their database, a fresh one of its own.
    struct Maria {
        admin: MySqlPool,
        database: String,
    }

    #[idemflow::async_trait]
    impl super::Server for Maria {
        async fn idle(&self) -> Vec<i64> {
            sqlx::query_scalar(
                "SELECT id FROM information_schema.processlist \
                 WHERE db = ? AND command = 'Sleep' AND id <> CONNECTION_ID()",
            )
            .bind(&self.database)
            .fetch_all(&self.admin)
            .await
            .unwrap()
        }
        async fn close(&self, id: i64) {
            // Gone already when the connection closed meanwhile (error 1094): the same end.
            let _ = sqlx::query("KILL CONNECTION ?")
                .bind(id)
                .execute(&self.admin)
                .await;
        }
        async fn alive(&self, id: i64) -> bool {
            let n: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.processlist WHERE id = ?",
            )
            .bind(id)
            .fetch_one(&self.admin)
            .await
            .unwrap();
            n > 0
        }
    }

    /// A migrated store on a pool of `max` connections in a fresh database, and the admin pool
    /// (one connection, on the server's default database so it is not counted as the store's).
    async fn store(max: u32) -> Option<(MySqlPool, Arc<dyn Store>, MySqlConnectOptions, String)> {
        let (options, name) = fresh_database().await?;
        let pool = pool_for(&options, max).await;
        let store = MySqlStore::from_pool(pool.clone());
        store.migrate().await.unwrap();
        Some((pool, Arc::new(store), options, name))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_go_on_while_the_server_closes_their_kept_connection() {
        let Some((_, store, options, database)) = store(1).await else {
            return;
        };
        let admin = pool_for(&options.clone().database("information_schema"), 1).await;
        let server = Maria { admin, database };
        super::reads_go_on_while_the_server_closes_their_connection(store, &server).await;
        server.admin.close().await;
        drop_database(&options, &server.database).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pool_user_gets_a_connection_while_reads_keep_the_store_busy() {
        let Some((pool, store, options, database)) = store(2).await else {
            return;
        };
        let user = async move {
            let one: i64 = sqlx::query_scalar("SELECT 1")
                .fetch_one(&mut *pool.acquire().await.unwrap())
                .await
                .unwrap();
            assert_eq!(one, 1);
        };
        super::a_pool_user_gets_its_turn(store, user).await;
        drop_database(&options, &database).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn closing_the_pool_does_not_wait_for_kept_connections() {
        let Some((pool, store, options, database)) = store(2).await else {
            return;
        };
        super::closing_the_pool_does_not_wait(store, async move { pool.close().await }).await;
        drop_database(&options, &database).await;
    }
}
