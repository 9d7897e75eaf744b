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
