//! Redis: a fresh key prefix per test. Needs `IDEMFLOW_TEST_REDIS_URL` (one server),
//! `IDEMFLOW_TEST_REDIS_CLUSTER_URL` (a Redis Cluster's seed nodes, comma-separated) and
//! `IDEMFLOW_TEST_REDIS_SENTINEL_URL` (a `redis+sentinel://` URL: a primary with two replicas
//! behind three sentinels; `.ci/redis-sentinel` starts one).

use std::sync::Arc;

use idemflow::Store;
use idemflow::conformance::unique;
use idemflow::store::redis::{RedisConfig, RedisStore};

use super::{backend_url, unreachable};

pub const URL_VAR: &str = "IDEMFLOW_TEST_REDIS_URL";
pub const CLUSTER_URL_VAR: &str = "IDEMFLOW_TEST_REDIS_CLUSTER_URL";
pub const SENTINEL_URL_VAR: &str = "IDEMFLOW_TEST_REDIS_SENTINEL_URL";
/// A second master of the Sentinel set, for the failover test alone (it kills its primary).
pub const SENTINEL_FAILOVER_URL_VAR: &str = "IDEMFLOW_TEST_REDIS_SENTINEL_FAILOVER_URL";
/// A Sentinel whose sentinel and data node both want passwords (`.ci/redis-sentinel-auth`),
/// its URL carrying both.
pub const SENTINEL_AUTH_URL_VAR: &str = "IDEMFLOW_TEST_REDIS_SENTINEL_AUTH_URL";

/// The `WAIT` of the Sentinel suites' waiting store: one replica, with a timeout a loaded CI
/// machine meets.
pub const SUITE_WAIT: (u32, std::time::Duration) = (1, std::time::Duration::from_secs(5));

/// Buckets of the cluster stores: twice the three primaries of `.ci/run`'s cluster, so that the
/// bucket-wide operations visit every shard.
pub const CLUSTER_BUCKETS: u32 = 6;

/// A migrated store on a fresh prefix; `None` (skip) when Redis is not configured or not
/// reachable, a panic in either case under `CI=true`.
pub async fn store_with(config: impl FnOnce(RedisConfig) -> RedisConfig) -> Option<RedisStore> {
    store_at(URL_VAR, config).await
}

/// A migrated store on a fresh prefix on the Redis Cluster, with [`CLUSTER_BUCKETS`] buckets;
/// `None` (skip) when the cluster is not configured or not reachable, a panic in either case
/// under `CI=true`.
pub async fn cluster_store_with(
    config: impl FnOnce(RedisConfig) -> RedisConfig,
) -> Option<RedisStore> {
    store_at(CLUSTER_URL_VAR, |c| {
        config(c.cluster(true).buckets(CLUSTER_BUCKETS))
    })
    .await
}

/// A migrated store on a fresh prefix on the primary the Sentinel set names; `None` (skip) when
/// the set is not configured or not reachable, a panic in either case under `CI=true`.
pub async fn sentinel_store_with(
    config: impl FnOnce(RedisConfig) -> RedisConfig,
) -> Option<RedisStore> {
    store_at(SENTINEL_URL_VAR, config).await
}

pub async fn store_at(
    var: &str,
    config: impl FnOnce(RedisConfig) -> RedisConfig,
) -> Option<RedisStore> {
    let url = backend_url(var)?;
    let cfg = config(RedisConfig::new(url).prefix(unique("idemflow-test")));
    match RedisStore::connect_with(cfg).await {
        Ok(store) => {
            store.migrate().await.unwrap();
            Some(store)
        }
        Err(e) => unreachable("Redis", var, e),
    }
}

/// A migrated store on a fresh prefix with one bucket, for the suites.
pub async fn one_bucket() -> Option<Arc<dyn Store>> {
    Some(Arc::new(store_with(|c| c).await?))
}

/// A migrated store on a fresh prefix with four buckets, for the suites.
pub async fn four_buckets() -> Option<Arc<dyn Store>> {
    Some(Arc::new(store_with(|c| c.buckets(4)).await?))
}

/// A migrated store on a fresh prefix on the Redis Cluster, for the suites.
pub async fn cluster() -> Option<Arc<dyn Store>> {
    Some(Arc::new(cluster_store_with(|c| c).await?))
}

/// A migrated store on a fresh prefix through Sentinel, for the suites.
pub async fn sentinel() -> Option<Arc<dyn Store>> {
    Some(Arc::new(sentinel_store_with(|c| c).await?))
}

/// A migrated store on a fresh prefix through Sentinel that `WAIT`s for one replica after
/// every claim and finish ([`SUITE_WAIT`]), for the suites.
pub async fn sentinel_waiting() -> Option<Arc<dyn Store>> {
    let (replicas, timeout) = SUITE_WAIT;
    Some(Arc::new(
        sentinel_store_with(|c| c.wait(replicas, timeout)).await?,
    ))
}
