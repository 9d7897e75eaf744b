//! The sweeper suite on SQLite: a fresh in-memory database per test, and the same suite on a WAL
//! file database with separate writer and reader connections. The other backends run the same
//! suite (`sweeper_tests!(their_factory)`) from their own test files: `tests/postgres.rs`,
//! `tests/mysql.rs`, `tests/redis.rs`.

#[macro_use]
mod conformance;
#[macro_use]
mod sweeper_suite;

use std::sync::Arc;

use idemflow::Store;
use idemflow::store::sqlite::SqliteStore;

async fn memory_store() -> Option<Arc<dyn Store>> {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    Some(Arc::new(store))
}

mod memory {
    use super::*;
    sweeper_tests!(memory_store);
}

async fn file_store() -> Option<Arc<dyn Store>> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.keep().join("idemflow.db");
    let store = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    Some(Arc::new(store))
}

mod file {
    use super::*;
    sweeper_tests!(file_store);
}
