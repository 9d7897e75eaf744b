//! The feed of announced ends (`Store::key_ends`) when its listening connection is lost: the
//! store reaches its server through a TCP proxy the test stops and starts again (PostgreSQL's
//! `LISTEN` session, Redis's subscriber), so no other test's connections are touched. The feed
//! says so with a `KeyEnd::Gap` (waiters read their keys at once), listens again on its own, and
//! the ends of keys waited on are announced again: a lost connection delays an answer, it never
//! silences the feed.

use std::sync::Arc;
use std::time::Duration;

use idemflow::store::KeyEnd;
use idemflow::{Idempotency, IdempotentRequest, Outcome, Store, StoredResponse};
use tokio::sync::broadcast::Receiver;

use crate::support::proxy::Proxy;

const PATIENCE: Duration = Duration::from_secs(30);

async fn next(ends: &mut Receiver<KeyEnd>, what: &str) -> KeyEnd {
    match tokio::time::timeout(PATIENCE, ends.recv()).await {
        Ok(Ok(end)) => end,
        other => panic!("{what}: {other:?}"),
    }
}

/// A key held open, announced, then finished; whether `ends` names it within 2 s (`false` also
/// when the store fails the try: its connection may not be back yet).
async fn announced_end_heard(
    store: &Arc<dyn Store>,
    ends: &mut Receiver<KeyEnd>,
    key: &str,
) -> bool {
    let idem = Idempotency::new(store.clone());
    let req = IdempotentRequest::new("ends-feed", key, "op", &serde_json::json!({})).unwrap();
    let (open, gate) = tokio::sync::oneshot::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let run = {
        let req = req.clone();
        tokio::spawn(async move {
            idem.execute(req, |_| async move {
                let _ = started_tx.send(());
                let _ = gate.await;
                Outcome::Succeeded(StoredResponse::new(201))
            })
            .await
        })
    };
    if started.await.is_err() {
        // The claim failed (the store's connection is not back yet): nothing ran.
        return false;
    }
    let announced = store.announce_end(req.id()).await;
    let _ = open.send(());
    if !matches!(announced, Ok(true)) || run.await.unwrap().is_err() {
        return false;
    }
    let heard = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            match ends.recv().await {
                Ok(KeyEnd::Ended(id)) if &id == req.id() => return,
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("the feed closed: {e}"),
            }
        }
    })
    .await;
    heard.is_ok()
}

/// The story on `store`, which reaches its server through `proxy`.
async fn the_feed_listens_again_after_its_connection_drops(store: Arc<dyn Store>, proxy: &Proxy) {
    let mut ends = store.key_ends().expect("this store announces ends");
    assert_eq!(next(&mut ends, "listening").await, KeyEnd::Gap);
    assert!(
        announced_end_heard(&store, &mut ends, "before").await,
        "heard before the drop"
    );

    // The server goes away for this store alone, then comes back.
    proxy.stop().await;
    assert_eq!(next(&mut ends, "the loss reported").await, KeyEnd::Gap);
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.restart().await;

    // The feed listens again on its own: an end announced once it does is heard (each try is a
    // key of its own; the first may come before the feed listens again).
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut tries = 0;
    loop {
        tries += 1;
        if announced_end_heard(&store, &mut ends, &format!("after-{tries}")).await {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no announced end heard in {PATIENCE:?} after the connection came back ({tries} tries)"
        );
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_listens_again_after_its_connection_drops() {
    use crate::support::postgres::{drop_schema, fresh_schema, pool_in};
    use crate::support::proxy::{host_port, via};
    let Some((url, schema)) = fresh_schema().await else {
        return;
    };
    let proxy = Proxy::start(&host_port(&url)).await;
    let store = idemflow::store::postgres::PostgresStore::from_pool(
        pool_in(&via(&url, proxy.addr()), &schema, 4).await,
    );
    store.migrate().await.unwrap();
    the_feed_listens_again_after_its_connection_drops(Arc::new(store), &proxy).await;
    drop_schema(&url, &schema).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_subscribes_again_after_its_connection_drops() {
    use crate::support::proxy::{host_port, via};
    use idemflow::store::redis::{RedisConfig, RedisStore};
    let Some(url) = crate::support::backend_url(crate::support::redis::URL_VAR) else {
        return;
    };
    let proxy = Proxy::start(&host_port(&url)).await;
    let store = RedisStore::connect_with(
        RedisConfig::new(via(&url, proxy.addr()))
            .prefix(idemflow::conformance::unique("ends-feed")),
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    the_feed_listens_again_after_its_connection_drops(Arc::new(store), &proxy).await;
}
