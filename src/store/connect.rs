//! [`connect`]: a store from a URL, whichever backend this build has.

use std::sync::Arc;

use super::Store;
use crate::error::StoreError;

/// Opens `$store` (`connect(url)`) when this build has `$feature`, else the error that names the
/// feature.
macro_rules! open {
    ($feature:literal, $store:ty, $url:expr, $scheme:expr) => {{
        #[cfg(feature = $feature)]
        return Ok(Arc::new(<$store>::connect($url).await?));
        #[cfg(not(feature = $feature))]
        return Err(missing($feature, $scheme));
    }};
}

/// Opens the store a URL names: `sqlite:` (feature `sqlite`), `postgres://` / `postgresql://`
/// (feature `postgres`), `mysql://` / `mariadb://` (feature `mysql`), `redis://` / `rediss://`
/// and `redis+sentinel://` (feature `redis`; the last finds the primary through Redis Sentinel,
/// see `store::redis::SentinelConfig::parse_url`). It does not migrate: call
/// [`Store::migrate`] when you own the schema.
///
/// A scheme this build was compiled without is a [`StoreError::Config`] that names the feature
/// to enable.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idemflow::StoreError> {
/// let store = idemflow::store::connect("sqlite::memory:").await?;
/// store.migrate().await?;
/// assert_eq!(store.backend(), "sqlite");
/// assert!(idemflow::store::connect("ftp://nope").await.is_err());
/// # Ok(())
/// # }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn Store>, StoreError> {
    let scheme = url.split(':').next().unwrap_or_default();
    match scheme {
        "sqlite" => open!("sqlite", super::sqlite::SqliteStore, url, scheme),
        "postgres" | "postgresql" => {
            open!("postgres", super::postgres::PostgresStore, url, scheme)
        }
        "mysql" | "mariadb" => open!("mysql", super::mysql::MySqlStore, url, scheme),
        "redis" | "rediss" | "redis+sentinel" => {
            open!("redis", super::redis::RedisStore, url, scheme)
        }
        "" => Err(StoreError::Config("the database URL is empty".to_owned())),
        other => Err(StoreError::Config(format!(
            "unsupported database URL scheme {other:?} (expected sqlite:, postgres://, mysql://, redis:// or redis+sentinel://)"
        ))),
    }
}

/// The error for a scheme whose backend this build was compiled without.
#[cfg_attr(
    all(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis"
    ),
    allow(dead_code)
)]
fn missing(feature: &str, scheme: &str) -> StoreError {
    StoreError::Config(format!(
        "this build has no {feature} support for {scheme}: URLs; enable the cargo feature `{feature}`"
    ))
}
