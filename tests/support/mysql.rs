//! MariaDB / MySQL: a fresh database per test, pools and connections inside it, and clean-up.
//! Needs `IDEMFLOW_TEST_MYSQL_URL`.

use std::str::FromStr;
use std::sync::Arc;

use idemflow::Store;
use idemflow::store::mysql::MySqlStore;
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Executor};

use super::{backend_url, fresh_name, left_behind, unreachable};

pub const URL_VAR: &str = "IDEMFLOW_TEST_MYSQL_URL";

/// Creates a fresh database (dropping this suite's databases older than an hour) and returns
/// the options to reach it and its name.
pub async fn fresh_database() -> Option<(MySqlConnectOptions, String)> {
    let url = backend_url(URL_VAR)?;
    let base = MySqlConnectOptions::from_str(&url).unwrap();
    let mut admin = match base.connect().await {
        Ok(c) => c,
        Err(e) => return unreachable("MariaDB/MySQL", URL_VAR, e),
    };
    let old: Vec<String> = sqlx::query_scalar(
        "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'idemflow\\_t\\_%'",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    for name in old.iter().filter(|n| left_behind(n)) {
        let _ = admin
            .execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS `{name}`")))
            .await;
    }
    let name = fresh_name();
    admin
        .execute(AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .unwrap();
    admin.close().await.unwrap();
    Some((base.database(&name), name))
}

/// A migrated store on a fresh database, for the suites.
pub async fn store() -> Option<Arc<dyn Store>> {
    let (options, _) = fresh_database().await?;
    let store = MySqlStore::from_pool(pool_for(&options, 5).await);
    store.migrate().await.unwrap();
    Some(Arc::new(store))
}

pub async fn pool_for(options: &MySqlConnectOptions, max: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(max)
        .connect_with(options.clone())
        .await
        .unwrap()
}

pub async fn drop_database(options: &MySqlConnectOptions, name: &str) {
    let mut admin: MySqlConnection = options.clone().database("mysql").connect().await.unwrap();
    admin
        .execute(AssertSqlSafe(format!("DROP DATABASE {name}")))
        .await
        .unwrap();
}
