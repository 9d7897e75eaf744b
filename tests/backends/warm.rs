//! Connections kept between back-to-back calls (`store::warm`, PostgreSQL):
//! they go back to the pool after 20 ms out of it however busy the store is, and after 1 ms
//! without a call, so a pool user gets its turn and `Pool::close` does not wait for them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use idemflow::conformance::{claimed, done, id, unique};
use idemflow::{Store, StoredResponse};

/// As many callers as the pool has connections (two) claim and finish fresh keys in a loop;
/// meanwhile `user` (a pool acquire and a statement) must finish within 10 s. Kept forever
/// while busy, the two connections would never go back to the pool and `user` would wait.
async fn a_pool_user_gets_its_turn<F>(store: Arc<dyn Store>, user: F)
where
    F: std::future::Future<Output = ()>,
{
    let scope = unique("warm");
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::new();
    for caller in 0..2 {
        let (store, scope, stop, calls) =
            (store.clone(), scope.clone(), stop.clone(), calls.clone());
        callers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let k = id(&scope, &format!("c{caller}-{i}"));
                let lease = claimed(
                    &store,
                    &idemflow::conformance::claim_for(&k, "{}", Duration::from_secs(30)),
                )
                .await;
                store
                    .finish(&k, lease.token, &done(StoredResponse::new(200)))
                    .await
                    .unwrap();
                calls.fetch_add(2, Ordering::SeqCst);
                i += 1;
            }
        }));
    }
    while calls.load(Ordering::SeqCst) < 100 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let before = calls.load(Ordering::SeqCst);
    let turn = tokio::time::timeout(Duration::from_secs(10), user).await;
    let during = calls.load(Ordering::SeqCst) - before;
    stop.store(true, Ordering::SeqCst);
    for c in callers {
        c.await.unwrap();
    }
    assert!(
        turn.is_ok(),
        "a pool user got no connection within 10 s while the store was busy ({during} store \
         calls meanwhile)"
    );
    assert!(during > 0, "the store made no call while the user waited");
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::sync::Arc;
    use std::time::Duration;

    use idemflow::conformance::{claim_for, claimed, done, id, unique};
    use idemflow::store::postgres::PostgresStore;
    use idemflow::{Store, StoredResponse};

    use crate::support::postgres::{drop_schema, fresh_schema, pool_in};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pool_user_gets_a_connection_while_callers_keep_the_store_busy() {
        let Some((url, schema)) = fresh_schema().await else {
            return;
        };
        let pool = pool_in(&url, &schema, 2).await;
        let store = PostgresStore::from_pool(pool.clone());
        store.migrate().await.unwrap();
        let user = async move {
            let mut conn = pool.acquire().await.unwrap();
            let one: i32 = sqlx::query_scalar("SELECT 1")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            assert_eq!(one, 1);
        };
        super::a_pool_user_gets_its_turn(Arc::new(store), user).await;
        drop_schema(&url, &schema).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn closing_the_pool_does_not_wait_for_kept_connections() {
        let Some((url, schema)) = fresh_schema().await else {
            return;
        };
        let pool = pool_in(&url, &schema, 2).await;
        let store: Arc<dyn Store> = Arc::new(PostgresStore::from_pool(pool.clone()));
        store.migrate().await.unwrap();
        let scope = unique("warm-close");
        for i in 0..20 {
            let k = id(&scope, &format!("k{i}"));
            let lease = claimed(&store, &claim_for(&k, "{}", Duration::from_secs(30))).await;
            store
                .finish(&k, lease.token, &done(StoredResponse::new(200)))
                .await
                .unwrap();
        }
        tokio::time::timeout(Duration::from_secs(5), pool.close())
            .await
            .expect("the pool closed within 5 s of the last call");
        let err = store.get(&id(&scope, "k0")).await.unwrap_err();
        assert!(err.to_string().contains("closed"), "{err}");
        drop_schema(&url, &schema).await;
    }
}
