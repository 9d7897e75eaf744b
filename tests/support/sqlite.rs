//! SQLite: a fresh in-memory database, or a fresh WAL file database (separate writer and reader
//! connections) in a temporary directory.

use std::sync::Arc;

use idemflow::Store;
use idemflow::store::sqlite::SqliteStore;

pub async fn memory() -> Arc<SqliteStore> {
    let s = SqliteStore::connect("sqlite::memory:").await.unwrap();
    s.migrate().await.unwrap();
    Arc::new(s)
}

pub async fn file() -> Arc<SqliteStore> {
    let dir = tempfile::tempdir().unwrap().keep();
    let s = SqliteStore::connect(&format!("sqlite://{}", dir.join("t.db").display()))
        .await
        .unwrap();
    s.migrate().await.unwrap();
    Arc::new(s)
}
