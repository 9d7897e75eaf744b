//! PostgreSQL test support shared by the test files: a fresh schema per test (found through
//! `search_path`), pools inside it, and clean-up. Needs `IDEMFLOW_TEST_POSTGRES_URL`; unset means
//! skip (printed), and unset or unreachable under `CI=true` is a failure.

#![allow(dead_code)]

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor};

use crate::conformance::backend_url;

pub const URL_VAR: &str = "IDEMFLOW_TEST_POSTGRES_URL";
const PREFIX: &str = "idemflow_t_";
static SCHEMAS: AtomicU64 = AtomicU64::new(0);

fn unreachable<T>(e: impl std::fmt::Display) -> Option<T> {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("PostgreSQL at {URL_VAR} is unreachable and CI=true: {e}");
    }
    eprintln!("skipping: PostgreSQL at {URL_VAR} is unreachable: {e}");
    None
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Creates a fresh schema (dropping this suite's schemas older than an hour) and returns the URL
/// and its name.
pub async fn fresh_schema() -> Option<(String, String)> {
    let url = backend_url(URL_VAR)?;
    let mut admin = match PgConnection::connect(&url).await {
        Ok(c) => c,
        Err(e) => return unreachable(e),
    };
    let old: Vec<String> = sqlx::query_scalar(
        "SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, 'idemflow_t_')",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    for name in old {
        let born: Option<u64> = name[PREFIX.len()..]
            .split('_')
            .next()
            .and_then(|s| s.parse().ok());
        if born.is_some_and(|b| b + 3600 < now_secs()) {
            let _ = admin
                .execute(AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS \"{name}\" CASCADE"
                )))
                .await;
        }
    }
    let schema = format!(
        "{PREFIX}{}_{}_{}",
        now_secs(),
        std::process::id(),
        SCHEMAS.fetch_add(1, Ordering::Relaxed)
    );
    admin
        .execute(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .await
        .unwrap();
    admin.close().await.unwrap();
    Some((url, schema))
}

pub async fn pool_in(url: &str, schema: &str, max: u32) -> PgPool {
    let options = PgConnectOptions::from_str(url)
        .unwrap()
        .options([("search_path", schema)]);
    PgPoolOptions::new()
        .max_connections(max)
        .connect_with(options)
        .await
        .unwrap()
}

pub async fn drop_schema(url: &str, schema: &str) {
    let mut admin = PgConnection::connect(url).await.unwrap();
    admin
        .execute(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .await
        .unwrap();
}

/// A URL that selects `schema` through the connection's `search_path` (for processes such as
/// the CLI, which only take a URL).
pub fn url_in(url: &str, schema: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-c%20search_path%3D{schema}")
}
