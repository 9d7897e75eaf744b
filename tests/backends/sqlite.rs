//! The conformance suite and the sweeper suite on SQLite: a fresh in-memory database per test,
//! and the same suites on a WAL file database with separate writer and reader connections;
//! and, in [`group_commit`], what the single writer's batching must not change.

use std::sync::Arc;

use idemflow::Store;

use crate::support::sqlite;

mod group_commit;

async fn memory_store() -> Option<Arc<dyn Store>> {
    Some(sqlite::memory().await)
}

async fn file_store() -> Option<Arc<dyn Store>> {
    Some(sqlite::file().await)
}

mod memory {
    idemflow::conformance_tests!(super::memory_store);
}

mod file {
    idemflow::conformance_tests!(super::file_store);
}

mod sweeper_memory {
    idemflow::sweeper_tests!(super::memory_store);
}

mod sweeper_file {
    idemflow::sweeper_tests!(super::file_store);
}

/// Two stores on one WAL file (two processes' worth of connections): duplicates through the
/// second wait for the first's answer, which nothing wakes them for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_across_two_stores_on_one_file() {
    use idemflow::store::sqlite::SqliteStore;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let a = SqliteStore::connect(&url).await.unwrap();
    a.migrate().await.unwrap();
    let b = SqliteStore::connect(&url).await.unwrap();
    let stores: [Arc<dyn Store>; 2] = [Arc::new(a), Arc::new(b)];
    idemflow::conformance::waiting_across_stores(&stores).await;
}
