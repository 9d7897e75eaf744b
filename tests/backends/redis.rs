//! The conformance and sweeper suites on Redis, each test on its own key prefix, with one
//! bucket and with four, and on a Redis Cluster (six buckets over three shards); plus racing claims from two connection managers, fencing, concurrent
//! sweepers, the server clock, prefix isolation, history retention and the native expiry
//! backstop.

use idemflow::store::FinishMode;
use idemflow::store::{OperatorStore, SweeperStore};
use std::sync::Arc;
use std::time::Duration;

use idemflow::conformance::{self, claim_for, done, id, unique};
use idemflow::state::Transition;
use idemflow::store::redis::{RedisConfig, RedisStore};
use idemflow::store::{ClaimOutcome, Finish, Release, TakeStale};
use idemflow::{KeyState, Store, StoreError, StoredResponse, record::Actor, record::LeaseToken};

use crate::support::backend_url;
use crate::support::redis::{
    CLUSTER_BUCKETS, CLUSTER_URL_VAR, URL_VAR, cluster_store_with, store_with,
};

mod single {
    idemflow::conformance_tests!(crate::support::redis::one_bucket);
}

mod bucketed {
    idemflow::conformance_tests!(crate::support::redis::four_buckets);
}

mod sweeper {
    idemflow::sweeper_tests!(crate::support::redis::one_bucket);
}

mod sweeper_bucketed {
    idemflow::sweeper_tests!(crate::support::redis::four_buckets);
}

/// On a Redis Cluster (`IDEMFLOW_TEST_REDIS_CLUSTER_URL`): every key's scripts run on the shard
/// of its bucket, the bucket-wide operations visit the buckets on every shard.
mod cluster {
    idemflow::conformance_tests!(crate::support::redis::cluster);
}

mod sweeper_cluster {
    idemflow::sweeper_tests!(crate::support::redis::cluster);
}

/// Through Redis Sentinel (`IDEMFLOW_TEST_REDIS_SENTINEL_URL`), with `WAIT` for one replica
/// after every claim and finish: the claim and finish scripts go out in one pipeline with their
/// `WAIT`.
mod sentinel {
    idemflow::conformance_tests!(crate::support::redis::sentinel_waiting);
}

/// Through Redis Sentinel, without `WAIT`.
mod sweeper_sentinel {
    idemflow::sweeper_tests!(crate::support::redis::sentinel);
}

const LEASE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_from_two_connection_managers_have_one_winner() {
    let Some(a) = store_with(|c| c).await else {
        return;
    };
    // A second store on the same prefix, with its own connection manager.
    let url = backend_url(URL_VAR).unwrap();
    let b = RedisStore::connect_with_prefix(&url, a.prefix())
        .await
        .unwrap();
    let (a, b): (Arc<dyn Store>, Arc<dyn Store>) = (Arc::new(a), Arc::new(b));
    conformance::race_claims_across(&[a, b.clone()], 500).await;
    assert_eq!(b.stats().await.unwrap().processing, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_through_another_connection_manager_wait_for_the_first_answer() {
    let Some(a) = store_with(|c| c).await else {
        return;
    };
    let url = backend_url(URL_VAR).unwrap();
    let b = RedisStore::connect_with_prefix(&url, a.prefix())
        .await
        .unwrap();
    let (a, b): (Arc<dyn Store>, Arc<dyn Store>) = (Arc::new(a), Arc::new(b));
    conformance::waiting_across_stores(&[a, b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_with_a_superseded_token_is_fenced() {
    let Some(store) = store_with(|c| c).await else {
        return;
    };
    let id = id(&unique("fencing"), "k1");
    let first = claimed_on(&store, &claim_for(&id, "{}", Duration::ZERO)).await;
    let taken = store
        .take_stale(&TakeStale {
            owner: "sweeper".into(),
            lease: LEASE,
            limit: 10,
            scope: None,
        })
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);
    let second = taken[0].lease_token;
    assert_eq!(second, LeaseToken(first.token.0 + 1));
    let before = store.get(&id).await.unwrap().unwrap();
    let rel = Release {
        actor: Actor::Worker,
        reason: "late".into(),
        error: None,
        recheck_after: None,
    };
    let lost = |r: Result<_, StoreError>| {
        matches!(
            r,
            Err(StoreError::LeaseLost {
                presented,
                current,
                state: KeyState::Processing,
                ..
            }) if presented == first.token && current == second
        )
    };
    assert!(lost(
        store
            .finish(&id, first.token, &done(StoredResponse::new(201)))
            .await
            .map(|_| ())
    ));
    assert!(lost(store.release(&id, first.token, &rel).await));
    assert!(lost(
        store.extend(&id, first.token, LEASE).await.map(|_| ())
    ));
    assert_eq!(store.get(&id).await.unwrap().unwrap(), before);
    // An operator override moves the token on again: the sweeper is fenced out too.
    let r = store
        .finish_as(
            &id,
            FinishMode::Override,
            &Finish {
                to: KeyState::Done,
                response: Some(StoredResponse::new(200)),
                error: None,
                actor: Actor::Operator,
                reason: "provider shows the charge".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(r.lease_token, LeaseToken(second.0 + 1));
    assert!(matches!(
        store
            .finish(&id, second, &done(StoredResponse::new(201)))
            .await,
        Err(StoreError::LeaseLost {
            state: KeyState::Done,
            ..
        })
    ));
    let h = store.history(&id).await.unwrap();
    let tokens: Vec<Option<LeaseToken>> = h.iter().map(|e| e.lease_token).collect();
    assert_eq!(
        tokens,
        [
            Some(first.token),
            Some(second),
            Some(LeaseToken(second.0 + 1))
        ]
    );
}

async fn claimed_on(store: &RedisStore, c: &idemflow::store::NewClaim) -> idemflow::store::Lease {
    match store.claim(c).await.unwrap() {
        ClaimOutcome::Claimed(l) => l,
        ClaimOutcome::Existing { record, .. } => panic!("expected a claim, found {record:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sweepers_never_take_the_same_key() {
    let Some(a) = store_with(|c| c.buckets(3)).await else {
        return;
    };
    let url = backend_url(URL_VAR).unwrap();
    let b = RedisStore::connect_with(RedisConfig::new(url).prefix(a.prefix()).buckets(3))
        .await
        .unwrap();
    // Two stores (two connection managers), three buckets: each key still goes to one sweeper.
    conformance::sweepers_take_each_key_once_across(&[Arc::new(a), Arc::new(b)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_creation_use_the_redis_clock() {
    let Some(store) = store_with(|c| c).await else {
        return;
    };
    let mut con = store.connection();
    let time = |con: &mut idemflow::store::redis::RedisConnection| {
        let mut con = con.clone();
        async move {
            let (s, us): (i64, i64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
            s * 1000 + us / 1000
        }
    };
    let before = time(&mut con).await;
    let id = id(&unique("clock"), "k1");
    let l = claimed_on(&store, &claim_for(&id, "{}", Duration::from_secs(30))).await;
    let after = time(&mut con).await;
    let r = store.get(&id).await.unwrap().unwrap();
    let created = r.created_at.timestamp_millis();
    assert!(
        (before..=after).contains(&created),
        "created_at {created} not within Redis TIME [{before}, {after}]"
    );
    assert_eq!(l.expires_at.timestamp_millis(), created + 30_000);
    // The raw hash holds the same instant the record reports.
    let raw: Vec<u8> = redis::cmd("GET")
        .arg(store.record_key(&id))
        .query_async(&mut con)
        .await
        .unwrap();
    let raw =
        idemflow::store::redis::fuzzing::decode_record(id.scope.as_str(), id.key.as_str(), &raw)
            .unwrap()
            .unwrap();
    assert_eq!(
        raw.lease_expires_at.unwrap().timestamp_millis(),
        created + 30_000
    );
    let extended = store
        .extend(&id, l.token, Duration::from_secs(60))
        .await
        .unwrap()
        .timestamp_millis();
    let after2 = time(&mut con).await;
    assert!(extended >= after + 60_000 && extended <= after2 + 60_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_are_isolated() {
    let (Some(a), Some(b)) = (store_with(|c| c).await, store_with(|c| c).await) else {
        return;
    };
    let id = id("shared-scope", "same-key");
    claimed_on(&a, &claim_for(&id, "{}", Duration::ZERO)).await;
    assert!(b.get(&id).await.unwrap().is_none());
    assert_eq!(b.stats().await.unwrap().processing, 0);
    let none = b
        .take_stale(&TakeStale {
            owner: "b".into(),
            lease: LEASE,
            limit: 10,
            scope: None,
        })
        .await
        .unwrap();
    assert!(none.is_empty());
    // The same key is independent on the other prefix.
    assert_eq!(
        claimed_on(&b, &claim_for(&id, "{\"other\":1}", LEASE))
            .await
            .transition,
        Transition::Claim
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_keeps_history_with_its_own_ttl() {
    let Some(store) = store_with(|c| c.history_ttl(Duration::from_secs(600))).await else {
        return;
    };
    let id = id(&unique("histttl"), "k1");
    let mut c = claim_for(&id, "{}", LEASE);
    c.retention = Duration::ZERO;
    let l = claimed_on(&store, &c).await;
    let con = store.connection();
    let base = con.clone();
    let pttl = |key: String| {
        let mut con = base.clone();
        async move {
            let t: i64 = redis::cmd("PTTL")
                .arg(key)
                .query_async(&mut con)
                .await
                .unwrap();
            t
        }
    };
    assert_eq!(
        pttl(store.record_key(&id)).await,
        -1,
        "no expiry while processing"
    );
    store
        .finish(&id, l.token, &done(StoredResponse::new(201)))
        .await
        .unwrap();
    let hash_ttl = pttl(store.record_key(&id)).await;
    assert!(hash_ttl > 3_500_000, "backstop after the grace: {hash_ttl}");
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.purge_expired(10).await.unwrap(), 1);
    assert!(store.get(&id).await.unwrap().is_none(), "purged");
    let t = pttl(store.record_key(&id)).await;
    assert!(t > 590_000 && t <= 600_000, "history TTL {t}");
    let h = store.history(&id).await.unwrap();
    assert_eq!(h.len(), 3);
    assert_eq!((h[2].to, h[2].actor), (None, Actor::Purge));
    assert_eq!(h[2].lease_token, Some(l.token));
    // A new claim of the purged key starts a new life (with a larger token); history goes on in
    // order.
    let again = claimed_on(&store, &claim_for(&id, "{}", LEASE)).await;
    assert!(again.token > l.token, "{again:?} after {l:?}");
    let h = store.history(&id).await.unwrap();
    assert_eq!(h.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(pttl(store.record_key(&id)).await, -1);
}

/// Finding 11 of the simulation, through the executor: a re-creation of a purged key that a
/// failover loses (the replica promoted holds the tombstone, not the new life's record) is made
/// again under the same provider key, so a provider that saw the lost attempt deduplicates the
/// next. Before, each claim drew its renewed key at random, and the provider acted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_creation_lost_in_a_failover_is_made_again_under_its_provider_key() {
    let Some(store) = store_with(|c| c).await else {
        return;
    };
    let store = Arc::new(store);
    let idem = idemflow::Idempotency::new(store.clone()).retention(Duration::ZERO);
    let scope = unique("lostlife");
    let req = idemflow::IdempotentRequest::new(&scope, "k1", "op", &serde_json::json!({})).unwrap();
    let id = req.id().clone();
    let sent = |req: idemflow::IdempotentRequest| {
        let idem = idem.clone();
        async move {
            let mut key = None;
            idem.execute(req, |ctx| {
                key = Some(ctx.provider_key().to_owned());
                async { idemflow::Outcome::Succeeded(StoredResponse::new(201)) }
            })
            .await
            .unwrap();
            key.expect("the operation ran")
        }
    };
    let first = sent(req.clone()).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.purge_expired(10).await.unwrap(), 1);
    // The replica's copy: the tombstone, with its expiry.
    let mut con = store.connection();
    let record = store.record_key(&id);
    let copy: Vec<u8> = redis::cmd("DUMP")
        .arg(&record)
        .query_async(&mut con)
        .await
        .unwrap();
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&record)
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(ttl > 0, "the tombstone expires with the history TTL: {ttl}");
    let lost = sent(req.clone()).await;
    assert_ne!(lost, first, "a re-created key sends a key of its own");
    // The failover: the copy is promoted, the re-creation and its answer are gone.
    let () = redis::cmd("RESTORE")
        .arg(&record)
        .arg(ttl)
        .arg(copy)
        .arg("REPLACE")
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(
        store.get(&id).await.unwrap().is_none(),
        "the re-creation was lost"
    );
    assert_eq!(
        sent(req).await,
        lost,
        "the re-creation made again sends the key the lost one sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_expiry_backstop_is_recorded_by_the_next_purge() {
    let Some(store) = store_with(|c| c.expiry_grace(Some(Duration::ZERO))).await else {
        return;
    };
    let id = id(&unique("backstop"), "k1");
    let mut c = claim_for(&id, "{}", LEASE);
    c.retention = Duration::from_millis(1);
    let l = claimed_on(&store, &c).await;
    store
        .finish(&id, l.token, &done(StoredResponse::new(201)))
        .await
        .unwrap();
    // Redis deletes the hash itself (lazily on access, or by its active expiry cycle).
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(store.get(&id).await.unwrap().is_none());
    assert_eq!(store.stats().await.unwrap().done, 1, "still indexed");
    assert_eq!(store.purge_expired(10).await.unwrap(), 1);
    assert_eq!(store.stats().await.unwrap().done, 0);
    let h = store.history(&id).await.unwrap();
    let last = h.last().unwrap();
    assert_eq!(
        (last.from, last.to, last.actor, last.reason.as_deref()),
        (
            Some(KeyState::Done),
            None,
            Actor::Purge,
            Some("expired by Redis before purge")
        )
    );
}

#[tokio::test]
async fn bad_prefix_and_unreachable_server_are_errors_not_panics() {
    let e = RedisStore::connect_with_prefix("redis://127.0.0.1:6379/", "a{b}")
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Config(_)), "{e}");
    let e = RedisStore::connect_with_prefix("not a url", "p")
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Config(_)), "{e}");
    let e = RedisStore::connect("redis://127.0.0.1:1/")
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::Connect {
                cause: idemflow::error::ConnectCause::Refused,
                ..
            }
        ),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_data_format_on_the_prefix_is_refused() {
    let Some(store) = store_with(|c| c).await else {
        return;
    };
    let mut con = store.connection();
    let _: () = redis::cmd("SET")
        .arg(format!("{}:format", store.prefix()))
        .arg("999")
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(matches!(store.migrate().await, Err(StoreError::Config(_))));
}

/// A second store, with its own cluster connection, on `a`'s prefix.
async fn second_cluster_store(a: &RedisStore) -> RedisStore {
    let url = backend_url(CLUSTER_URL_VAR).unwrap();
    RedisStore::connect_with(
        RedisConfig::new(url)
            .cluster(true)
            .prefix(a.prefix())
            .buckets(CLUSTER_BUCKETS),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_claimers_and_sweepers_on_two_connections() {
    let Some(a) = cluster_store_with(|c| c).await else {
        return;
    };
    let b = second_cluster_store(&a).await;
    let (a, b): (Arc<dyn Store>, Arc<dyn Store>) = (Arc::new(a), Arc::new(b));
    conformance::race_claims_across(&[a, b.clone()], 200).await;
    assert_eq!(b.stats().await.unwrap().processing, 1);
    // Two cluster connections, six buckets on three shards: each key still goes to one sweeper.
    let c = cluster_store_with(|c| c).await.unwrap();
    let d = second_cluster_store(&c).await;
    conformance::sweepers_take_each_key_once_across(&[Arc::new(c), Arc::new(d)]).await;
}

/// The buckets' hash tags put them on more than one shard, and a sweep visits every one: keys
/// made stale in every bucket are all taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_buckets_spread_over_the_shards_and_all_are_swept() {
    let Some(store) = cluster_store_with(|c| c).await else {
        return;
    };
    let mut con = store.connection();
    let scope = unique("spread");
    let mut nodes = std::collections::BTreeSet::new();
    let mut ids = Vec::new();
    for i in 0..60 {
        let id = id(&scope, &format!("k{i}"));
        claimed_on(&store, &claim_for(&id, "{}", Duration::ZERO)).await;
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(store.record_key(&id))
            .query_async(&mut con)
            .await
            .unwrap();
        nodes.insert(shard_of(&mut con, slot).await);
        ids.push(id);
    }
    assert!(nodes.len() >= 2, "buckets on one shard only: {nodes:?}");
    // One sweep takes them all, whichever shard their bucket is on.
    let taken = store
        .take_stale(&TakeStale {
            owner: "sweeper".into(),
            lease: LEASE,
            limit: 100,
            scope: None,
        })
        .await
        .unwrap();
    assert_eq!(taken.len(), ids.len());
    assert_eq!(store.stats().await.unwrap().processing, 60);
}

/// The port of the primary serving `slot` (from `CLUSTER SLOTS`).
async fn shard_of(con: &mut idemflow::store::redis::RedisConnection, slot: i64) -> i64 {
    let ranges: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(con)
        .await
        .unwrap();
    for r in ranges {
        let redis::Value::Array(r) = r else { continue };
        let (
            Some(redis::Value::Int(lo)),
            Some(redis::Value::Int(hi)),
            Some(redis::Value::Array(node)),
        ) = (r.first(), r.get(1), r.get(2))
        else {
            continue;
        };
        if (*lo..=*hi).contains(&slot)
            && let Some(redis::Value::Int(port)) = node.get(1)
        {
            return *port;
        }
    }
    panic!("slot {slot} is served by no shard");
}

/// The cluster node that serves `key`'s slot: its address and a plain connection to it.
async fn node_serving(key: &str) -> (String, u16, redis::aio::MultiplexedConnection) {
    use redis::FromRedisValue;
    let url = backend_url(CLUSTER_URL_VAR).unwrap();
    let seed = url.split(',').next().unwrap().trim().to_owned();
    let mut con = redis::Client::open(seed.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut con)
        .await
        .unwrap();
    let ranges: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut con)
        .await
        .unwrap();
    for range in ranges {
        let start = i64::from_redis_value_ref(&range[0]).unwrap();
        let end = i64::from_redis_value_ref(&range[1]).unwrap();
        if (start..=end).contains(&slot) {
            let node = Vec::<redis::Value>::from_redis_value_ref(&range[2]).unwrap();
            let host = String::from_redis_value_ref(&node[0]).unwrap();
            let port = u16::from_redis_value_ref(&node[1]).unwrap();
            let con = redis::Client::open(format!("redis://{host}:{port}/"))
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            return (host, port, con);
        }
    }
    panic!("no node serves slot {slot}");
}

/// The id (`CLIENT ID`) of the cluster store's own connection to the node at `host:port`.
async fn store_connection_id(store: &RedisStore, host: &str, port: u16) -> i64 {
    use idemflow::store::redis::RedisConnection;
    use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
    let RedisConnection::Cluster(mut con) = store.connection() else {
        panic!("a cluster store");
    };
    let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port,
    });
    let id = con
        .route_command(redis::cmd("CLIENT").arg("ID").clone(), to)
        .await;
    redis::FromRedisValue::from_redis_value(id.unwrap()).unwrap()
}

/// Runs `op` (one store call sending one script to the node serving `key`) so that the script
/// runs but its answer is lost with the connection: the node pauses all its clients
/// (`CLIENT PAUSE .. ALL`), the script queues, a `CLIENT KILL` of the store's connection queues
/// behind it; when the pause ends the script runs, then its connection is closed before the
/// answer is written.
async fn with_answer_lost<T: Send + 'static>(
    store: &RedisStore,
    key: &str,
    op: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let (host, port, mut killer) = node_serving(key).await;
    let victim = store_connection_id(store, &host, port).await;
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(300)
        .arg("ALL")
        .query_async(&mut killer)
        .await
        .unwrap();
    let running = tokio::spawn(op);
    // The script reaches the paused node first; the kill is answered once the pause ends.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(victim)
        .query_async(&mut killer)
        .await
        .unwrap();
    assert_eq!(killed, 1, "the store's connection was killed");
    running.await.unwrap()
}

/// A script whose answer is lost with its connection (it ran; see [`with_answer_lost`]) is never
/// sent again by the cluster client: a re-sent claim would tell the claim's winner that the key
/// is someone else's (its lease orphaned), a re-sent finish that its own write was a lost lease.
/// The caller gets a store error instead, which the executor treats as an unknown outcome, and
/// the script's one run stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_scripts_are_not_re_sent_when_their_answer_is_lost() {
    let Some(store) = cluster_store_with(|c| c).await else {
        return;
    };
    let scope = unique("resend");

    let k1 = id(&scope, "k1");
    let (s, k) = (store.clone(), k1.clone());
    let claimed = with_answer_lost(&store, &store.record_key(&k1), async move {
        s.claim(&claim_for(&k, "{}", LEASE)).await
    })
    .await;
    let row = store.get(&k1).await.unwrap().expect("the claim ran");
    assert_eq!((row.state, row.attempts), (KeyState::Processing, 1));
    assert!(
        matches!(claimed, Err(StoreError::Database { .. })),
        "the claim's one run won the key; its caller must not be told otherwise: {claimed:?}"
    );

    let k2 = id(&scope, "k2");
    let lease = claimed_on(&store, &claim_for(&k2, "{}", LEASE)).await;
    let (s, k) = (store.clone(), k2.clone());
    let finished = with_answer_lost(&store, &store.record_key(&k2), async move {
        s.finish(&k, lease.token, &done(StoredResponse::new(201)))
            .await
    })
    .await;
    let row = store.get(&k2).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Done, "the finish ran");
    assert!(
        matches!(finished, Err(StoreError::Database { .. })),
        "a finish that succeeded must not be reported as a lost lease: {finished:?}"
    );
}

/// `WAIT` where no replica exists (the single server and the cluster of `.ci/run` have none):
/// asking for one replica fails the claim and the finish with `NotReplicated` (the `WAIT` goes
/// in the script's pipeline, routed with it on the cluster); asking for none passes. The URL
/// parameters set it on a single server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_that_do_not_exist_fails_claims_and_finishes() {
    let timeout = Duration::from_millis(100);
    let Some(single) = store_with(|c| c).await else {
        return;
    };
    let url = backend_url(URL_VAR).unwrap();
    let by_url = RedisStore::connect_with(
        RedisConfig::new(format!("{url}?wait_replicas=1&wait_timeout_ms=100"))
            .prefix(single.prefix()),
    )
    .await
    .unwrap();
    let none = RedisStore::connect_with(
        RedisConfig::new(format!("{url}?wait_replicas=0")).prefix(single.prefix()),
    )
    .await
    .unwrap();
    let Some(cluster) = cluster_store_with(|c| c.wait(1, timeout)).await else {
        return;
    };
    let cluster_none = RedisStore::connect_with(
        RedisConfig::new(backend_url(CLUSTER_URL_VAR).unwrap())
            .cluster(true)
            .buckets(CLUSTER_BUCKETS)
            .prefix(cluster.prefix())
            .wait(0, timeout),
    )
    .await
    .unwrap();
    for (waiting, passing) in [(by_url, none), (cluster, cluster_none)] {
        let short = |e: &StoreError, write: idemflow::error::ReplicatedWrite| matches!(e, StoreError::NotReplicated { write: w, acknowledged: 0, wanted: 1, .. } if *w == write);
        let a = id(&unique("wait"), "a");
        let e = waiting
            .claim(&claim_for(&a, "{}", LEASE))
            .await
            .unwrap_err();
        assert!(short(&e, idemflow::error::ReplicatedWrite::Claim), "{e}");
        // Given back: nothing may have acted.
        assert_eq!(
            passing.get(&a).await.unwrap().unwrap().state,
            KeyState::Failed { retryable: true }
        );
        let lease = claimed_on(&passing, &claim_for(&a, "{}", LEASE)).await;
        assert_eq!(lease.transition, Transition::Reclaim);
        let e = waiting
            .finish(&a, lease.token, &done(StoredResponse::new(200)))
            .await
            .unwrap_err();
        assert!(short(&e, idemflow::error::ReplicatedWrite::Finish), "{e}");
        assert_eq!(
            passing.get(&a).await.unwrap().unwrap().state,
            KeyState::Done
        );
        let b = id(&unique("wait"), "b");
        let lease = claimed_on(&passing, &claim_for(&b, "{}", LEASE)).await;
        passing
            .finish(&b, lease.token, &done(StoredResponse::new(200)))
            .await
            .unwrap();
    }
}

/// A store on one server, on a cluster and through Sentinel subscribes to the ends it announces
/// (so waiters across processes are woken, not polling); one built on a caller's connection
/// cannot, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connected_store_announces_ends_and_a_given_connection_does_not() {
    let Some(single) = store_with(|c| c).await else {
        return;
    };
    assert!(single.key_ends().is_some(), "one server");
    if let Some(cluster) = crate::support::redis::cluster_store_with(|c| c).await {
        assert!(cluster.key_ends().is_some(), "a cluster");
    }
    if let Some(sentinel) = crate::support::redis::sentinel_store_with(|c| c).await {
        assert!(sentinel.key_ends().is_some(), "through Sentinel");
    }
    let given = RedisStore::from_connection(
        single.connection(),
        idemflow::store::redis::RedisConfig::new("redis://unused/").prefix(single.prefix()),
    );
    assert!(given.key_ends().is_none());
    let id = idemflow::IdempotentRequest::new("s", "k", "op", &serde_json::json!({}))
        .unwrap()
        .id()
        .clone();
    assert!(!given.announce_end(&id).await.unwrap());
}
