//! The conformance suite and the sweeper suite on SQLite: a fresh in-memory database per test,
//! and the same suites on a WAL file database with separate writer and reader connections;
//! and, in [`group_commit`], what the single writer's batching must not change.

use std::sync::Arc;

use idemflow::Store;

use crate::support::sqlite;

pub(crate) mod group_commit;

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

/// Workers that start together on one database file (several processes sharing a queue and
/// its keys) each migrate it: every migration is applied once and every `migrate` succeeds.
/// (Each store read the migrations applied so far, then ran the first one missing; all but one
/// failed with "table idempotency_keys already exists" or "duplicate column name".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_migrating_one_file_at_once_all_succeed() {
    use idemflow::store::sqlite::SqliteStore;
    for round in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let mut stores: Vec<Arc<dyn Store>> = Vec::new();
        for _ in 0..4 {
            stores.push(Arc::new(SqliteStore::connect(&url).await.unwrap()));
        }
        let mut migrating = tokio::task::JoinSet::new();
        for store in &stores {
            let store = store.clone();
            migrating.spawn(async move { store.migrate().await });
        }
        while let Some(migrated) = migrating.join_next().await {
            let migrated = migrated.unwrap();
            assert!(migrated.is_ok(), "round {round}: {migrated:?}");
        }
        let store = stores.pop().unwrap();
        idemflow::conformance::store::claim_new_key_grants_first_token_and_history(store).await;
    }
}

/// Lone writes (one caller: each claim and finish commits on its own, outside a batch) keep the
/// WAL checkpointed. Each such write is an `.. RETURNING` statement, and SQLite runs the
/// automatic checkpoint only when a statement that commits steps to its end: read for its first
/// row alone, none ever ran while the store was open, and the WAL grew by ~30 KB per key
/// (12 MB here) while the database file stayed empty.
#[tokio::test(flavor = "current_thread")]
async fn lone_writes_keep_the_wal_checkpointed() {
    use idemflow::store::sqlite::{SqliteConfig, SqliteStore};
    use idemflow::{Idempotency, IdempotentRequest, Outcome, StoredResponse};
    use sqlx::sqlite::SqliteSynchronous;

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("wal.db");
    // Off: the checkpoint does not depend on it, and the test stays fast.
    let config =
        SqliteConfig::new(format!("sqlite://{}", db.display())).synchronous(SqliteSynchronous::Off);
    let store = SqliteStore::connect_with(config).await.unwrap();
    store.migrate().await.unwrap();
    let idem = Idempotency::new(Arc::new(store.clone()));
    let keys = 400;
    for i in 0..keys {
        let key = format!("wal-{i}");
        let request = IdempotentRequest::new("wal", &key, "payments.create", &i).unwrap();
        idem.execute(request, |_| async {
            Outcome::Succeeded(StoredResponse::new(201).with_body(vec![b'x'; 200]))
        })
        .await
        .unwrap();
    }
    let size = |suffix: &str| {
        let mut p = db.clone().into_os_string();
        p.push(suffix);
        std::fs::metadata(p).map_or(0, |m| m.len())
    };
    let (wal, file) = (size("-wal"), size(""));
    // The automatic checkpoint starts a new WAL pass past 1,000 pages (4 MiB with the frame
    // headers); 400 keys write about three times that.
    assert!(
        wal <= 5 * 1024 * 1024,
        "the WAL grew to {wal} bytes after {keys} keys: never checkpointed (database file \
         {file} bytes)"
    );
    assert!(
        file > 64 * 1024,
        "the database file holds {file} bytes after {keys} keys: nothing was checkpointed \
         into it (WAL {wal} bytes)"
    );
    assert_eq!(
        store.writer_stats().commits,
        2 * keys as u64,
        "lone writes, not batches"
    );
}
