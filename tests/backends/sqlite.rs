//! The conformance suite and the sweeper suite on SQLite: a fresh in-memory database per test,
//! and the same suites on a WAL file database with separate writer and reader connections.

use std::sync::Arc;

use idemflow::Store;

use crate::support::sqlite;

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

/// A store call dropped mid-query (a client disconnect drops the handler's future; a heartbeat
/// renewal is dropped when its operation ends) must not lose an in-memory database. sqlx closes
/// a connection returned to the pool in the middle of a command, and each `:memory:` database
/// lives only as long as its connections: with one pooled connection, the next query found a
/// fresh, empty database ("no such table", found by the simulation).
#[tokio::test]
async fn memory_database_survives_cancelled_queries() {
    use std::time::Duration;

    use idemflow::conformance::{claim_for, id};
    use idemflow::store::ClaimOutcome;

    let store = sqlite::memory().await;
    let k0 = id("s", "k0");
    let first = match store
        .claim(&claim_for(&k0, "{}", Duration::from_secs(30)))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(l) => l,
        other => panic!("{other:?}"),
    };
    // Drop renewals and claims at every point of their execution.
    for i in 0..400u64 {
        let cut = Duration::from_micros(i % 40 * 5);
        let renew = store.extend(&k0, first.token, Duration::from_secs(30));
        let _ = tokio::time::timeout(cut, renew).await;
        let other = claim_for(
            &id("s", &format!("k{}", i + 1)),
            "{}",
            Duration::from_secs(30),
        );
        let _ = tokio::time::timeout(cut, store.claim(&other)).await;
    }
    let rec = store
        .get(&k0)
        .await
        .expect("the database is still there")
        .expect("the first key is still there");
    assert_eq!(rec.lease_token, first.token);
}
