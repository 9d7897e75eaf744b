//! Redis: a fresh key prefix per test. Needs `IDEMFLOW_TEST_REDIS_URL`.

use std::sync::Arc;

use idemflow::Store;
use idemflow::conformance::unique;
use idemflow::store::redis::{RedisConfig, RedisStore};

use super::{backend_url, unreachable};

pub const URL_VAR: &str = "IDEMFLOW_TEST_REDIS_URL";

/// A migrated store on a fresh prefix; `None` (skip) when Redis is not configured or not
/// reachable, a panic in either case under `CI=true`.
pub async fn store_with(config: impl FnOnce(RedisConfig) -> RedisConfig) -> Option<RedisStore> {
    let url = backend_url(URL_VAR)?;
    let cfg = config(RedisConfig::new(url).prefix(unique("idemflow-test")));
    match RedisStore::connect_with(cfg).await {
        Ok(store) => {
            store.migrate().await.unwrap();
            Some(store)
        }
        Err(e) => unreachable("Redis", URL_VAR, e),
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
