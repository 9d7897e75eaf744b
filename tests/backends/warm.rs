//! Connections kept between back-to-back reads of a key (`store::warm`, PostgreSQL): a read
//! whose kept connection the server closed is run again on a connection from the pool, and kept
//! connections go back to the pool after 20 ms out of it however busy the store is, and after
//! 1 ms without a read, so a pool user gets its turn and `Pool::close` does not wait for them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use idemflow::conformance::{claim_for, claimed, done, id, unique};
use idemflow::store::postgres::PostgresStore;
use idemflow::{KeyId, Store, StoredResponse};
use sqlx::postgres::PgPoolOptions;

use crate::support::postgres::{drop_schema, fresh_schema, options_in, pool_in};

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

/// A store on a 2-connection pool of a fresh schema, and a finished key of it.
struct Setup {
    url: String,
    schema: String,
    pool: sqlx::PgPool,
    store: Arc<dyn Store>,
    k: KeyId,
}

async fn two_connection_store() -> Option<Setup> {
    let (url, schema) = fresh_schema().await?;
    let pool = pool_in(&url, &schema, 2).await;
    let store: Arc<dyn Store> = Arc::new(PostgresStore::from_pool(pool.clone()));
    store.migrate().await.unwrap();
    let k = finished_key(&store).await;
    Some(Setup {
        url,
        schema,
        pool,
        store,
        k,
    })
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

/// The server closes the store's only connection 30 times, each time while it sits idle
/// between two reads of a task that reads a key without a pause (the connection is kept between
/// reads, not pinged): no read fails. The next closing waits until reads went on after the
/// closed connection was gone, so it never meets a second attempt's connection. Without the second attempt on a connection from the
/// pool, a read on a closed kept connection fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_go_on_while_the_server_closes_their_kept_connection() {
    let Some((url, schema)) = fresh_schema().await else {
        return;
    };
    let app = unique("warm-kill");
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options_in(&url, &schema).application_name(&app))
        .await
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(PostgresStore::from_pool(pool));
    store.migrate().await.unwrap();
    let k = finished_key(&store).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, tasks) = read_loop(&store, &k, 1, &stop);
    let admin = pool_in(&url, &schema, 1).await;
    let mut killed = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while killed < 30 && std::time::Instant::now() < deadline {
        // The store's one connection, when it sits idle between two reads.
        let idle: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND state = 'idle'",
        )
        .bind(&app)
        .fetch_all(&admin)
        .await
        .unwrap();
        let [pid] = idle[..] else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        let closed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&admin)
            .await
            .unwrap();
        killed += i32::from(closed);
        // Gone, then three reads after that (the first of them found the connection closed
        // and made its second attempt on a new one) before the next closing: a closing never
        // meets a second attempt.
        let mut gone_at = None;
        while std::time::Instant::now() < deadline {
            if gone_at.is_none() {
                let alive: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)",
                )
                .bind(pid)
                .fetch_one(&admin)
                .await
                .unwrap();
                if !alive {
                    gone_at = Some(reads.load(Ordering::SeqCst));
                }
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
        "only {killed} connections were closed within 60 s"
    );
    assert!(
        errors.is_empty(),
        "{} of {reads} reads failed ({killed} connections closed), the first: {}",
        errors.len(),
        errors[0]
    );
    admin.close().await;
    drop_schema(&url, &schema).await;
}

/// Two tasks read without a pause through a 2-connection pool; meanwhile a pool user (an
/// acquire and a statement) must finish within 3 s. Kept forever while busy, the two
/// connections would never go back to the pool and the user would wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_user_gets_a_connection_while_reads_keep_the_store_busy() {
    let Some(Setup {
        url,
        schema,
        pool,
        store,
        k,
    }) = two_connection_store().await
    else {
        return;
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, tasks) = read_loop(&store, &k, 2, &stop);
    while reads.load(Ordering::SeqCst) < 100 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let before = reads.load(Ordering::SeqCst);
    let user = async {
        let mut conn = pool.acquire().await.unwrap();
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(one, 1);
    };
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
    drop_schema(&url, &schema).await;
}

/// After back-to-back reads, `Pool::close` returns at once (kept connections go back within
/// about 1 ms) and the store reports the closed pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_pool_does_not_wait_for_kept_connections() {
    let Some(setup) = two_connection_store().await else {
        return;
    };
    let Setup {
        url,
        schema,
        pool,
        store,
        k,
    } = setup;
    for _ in 0..20 {
        assert!(store.get(&k).await.unwrap().is_some());
    }
    tokio::time::timeout(Duration::from_secs(5), pool.close())
        .await
        .expect("the pool closed within 5 s of the last read");
    let err = store.get(&k).await.unwrap_err();
    assert!(err.to_string().contains("closed"), "{err}");
    drop_schema(&url, &schema).await;
}
