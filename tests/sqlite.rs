//! The conformance suite and the sweeper suite on SQLite: a fresh in-memory database per test,
//! and the same suites on a WAL file database with separate writer and reader connections. The
//! other backends run the same suites from `tests/postgres.rs`, `tests/mysql.rs` and
//! `tests/redis.rs`.

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

async fn file_store() -> Option<Arc<dyn Store>> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.keep().join("idemflow.db");
    let store = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    Some(Arc::new(store))
}

mod memory {
    use super::*;
    conformance_tests!(memory_store);
}

mod file {
    use super::*;
    conformance_tests!(file_store);
}

mod sweeper_memory {
    use super::*;
    sweeper_tests!(memory_store);
}

mod sweeper_file {
    use super::*;
    sweeper_tests!(file_store);
}
