//! PostgreSQL: a fresh schema per test (found through `search_path`), pools and connections
//! inside it, and clean-up. Needs `IDEMFLOW_TEST_POSTGRES_URL`.

use std::str::FromStr;
use std::sync::Arc;

use idemflow::Store;
use idemflow::store::postgres::PostgresStore;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Executor};

use super::{backend_url, fresh_name, left_behind, unreachable};

pub const URL_VAR: &str = "IDEMFLOW_TEST_POSTGRES_URL";

/// Creates a fresh schema (dropping this suite's schemas older than an hour) and returns the URL
/// and its name.
pub async fn fresh_schema() -> Option<(String, String)> {
    let url = backend_url(URL_VAR)?;
    let mut admin = match PgConnection::connect(&url).await {
        Ok(c) => c,
        Err(e) => return unreachable("PostgreSQL", URL_VAR, e),
    };
    let old: Vec<String> = sqlx::query_scalar(
        "SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, 'idemflow_t_')",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    for name in old.iter().filter(|n| left_behind(n)) {
        let _ = admin
            .execute(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS \"{name}\" CASCADE"
            )))
            .await;
    }
    let schema = fresh_name();
    admin
        .execute(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .await
        .unwrap();
    admin.close().await.unwrap();
    Some((url, schema))
}

/// A migrated store on a fresh schema, for the suites.
pub async fn store() -> Option<Arc<dyn Store>> {
    let (url, schema) = fresh_schema().await?;
    let store = PostgresStore::from_pool(pool_in(&url, &schema, 5).await);
    store.migrate().await.unwrap();
    Some(Arc::new(store))
}

fn options_in(url: &str, schema: &str) -> PgConnectOptions {
    PgConnectOptions::from_str(url)
        .unwrap()
        .options([("search_path", schema)])
}

pub async fn pool_in(url: &str, schema: &str, max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .connect_with(options_in(url, schema))
        .await
        .unwrap()
}

/// One connection of its own inside `schema`.
pub async fn connection_in(url: &str, schema: &str) -> PgConnection {
    options_in(url, schema).connect().await.unwrap()
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
