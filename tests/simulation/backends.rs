//! A fresh, migrated, isolated store per schedule (`take_stale` and `purge` are table-wide):
//! SQLite in memory, a new PostgreSQL schema, a new MariaDB/MySQL database, a new Redis prefix.

use std::sync::Arc;

use idemflow::Store;

/// A store for one schedule, and how to clean up after it.
pub struct CaseStore {
    pub store: Arc<dyn Store>,
    pub cleanup: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
}

#[derive(Debug, Clone)]
pub enum Backend {
    SqliteMemory,
    #[cfg(feature = "postgres")]
    Postgres(String),
    #[cfg(feature = "mysql")]
    MySql(String),
    #[cfg(feature = "redis")]
    Redis(String),
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::SqliteMemory => "sqlite",
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => "postgres",
            #[cfg(feature = "mysql")]
            Backend::MySql(_) => "mysql",
            #[cfg(feature = "redis")]
            Backend::Redis(_) => "redis",
        }
    }

    pub async fn store(&self) -> Result<CaseStore, String> {
        match self {
            Backend::SqliteMemory => {
                let s = idemflow::store::sqlite::SqliteStore::connect("sqlite::memory:")
                    .await
                    .map_err(|e| e.to_string())?;
                s.migrate().await.map_err(|e| e.to_string())?;
                Ok(CaseStore {
                    store: Arc::new(s),
                    cleanup: None,
                })
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres(url) => pg::store(url).await,
            #[cfg(feature = "mysql")]
            Backend::MySql(url) => my::store(url).await,
            #[cfg(feature = "redis")]
            Backend::Redis(url) => {
                let prefix = idemflow::conformance::unique("idemflow-sim");
                let cfg = idemflow::store::redis::RedisConfig::new(url.clone()).prefix(prefix);
                let s = idemflow::store::redis::RedisStore::connect_with(cfg)
                    .await
                    .map_err(|e| e.to_string())?;
                s.migrate().await.map_err(|e| e.to_string())?;
                Ok(CaseStore {
                    store: Arc::new(s),
                    cleanup: None,
                })
            }
        }
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use crate::support::postgres::{drop_schema, pool_in};
    use sqlx::{AssertSqlSafe, Connection, Executor};

    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    pub async fn store(url: &str) -> Result<CaseStore, String> {
        let schema = format!(
            "idemflow_sim_{}_{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mut admin = sqlx::postgres::PgConnection::connect(url)
            .await
            .map_err(|e| e.to_string())?;
        admin
            .execute(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
            )))
            .await
            .map_err(|e| e.to_string())?;
        let _ = admin.close().await;
        let pool = pool_in(url, &schema, 2).await;
        let s = idemflow::store::postgres::PostgresStore::from_pool(pool);
        s.migrate().await.map_err(|e| e.to_string())?;
        let url = url.to_owned();
        Ok(CaseStore {
            store: Arc::new(s),
            cleanup: Some(Box::pin(async move { drop_schema(&url, &schema).await })),
        })
    }
}

#[cfg(feature = "mysql")]
mod my {
    use super::*;
    use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
    use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Executor};
    use std::str::FromStr;

    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    pub async fn store(url: &str) -> Result<CaseStore, String> {
        let name = format!(
            "idemflow_sim_{}_{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let base = MySqlConnectOptions::from_str(url).map_err(|e| e.to_string())?;
        let mut admin = base.connect().await.map_err(|e| e.to_string())?;
        admin
            .execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
            .await
            .map_err(|e| e.to_string())?;
        admin
            .execute(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .map_err(|e| e.to_string())?;
        let _ = admin.close().await;
        let options = base.clone().database(&name);
        // `IDEMFLOW_SIM_MYSQL_SQL_MODE=SIMULTANEOUS_ASSIGNMENT` adds a server mode to every
        // session, as a server-wide setting would (finding 3).
        let extra_mode = std::env::var("IDEMFLOW_SIM_MYSQL_SQL_MODE").ok();
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .after_connect(move |conn, _| {
                let extra_mode = extra_mode.clone();
                Box::pin(async move {
                    if let Some(mode) = extra_mode.filter(|m| !m.is_empty()) {
                        conn.execute(AssertSqlSafe(format!(
                            "SET SESSION sql_mode = CONCAT(@@sql_mode, ',{mode}')"
                        )))
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .map_err(|e| e.to_string())?;
        let s = idemflow::store::mysql::MySqlStore::from_pool(pool);
        s.migrate().await.map_err(|e| e.to_string())?;
        Ok(CaseStore {
            store: Arc::new(s),
            cleanup: Some(Box::pin(async move {
                if let Ok(mut admin) = base.connect().await {
                    let _ = admin
                        .execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
                        .await;
                }
            })),
        })
    }
}
