//! The history in the key's row, on SQLite and PostgreSQL (MariaDB keeps a history table): the
//! column keeps its newest entries within its bound, and any reason exactly.

use std::sync::Arc;
use std::time::Duration;

use idemflow::Store;
use idemflow::conformance::{claim_for, claimed, id};
use idemflow::record::Actor;
use idemflow::store::Release;

/// A reason with a line feed and a backslash, which the history column escapes.
const ODD_REASON: &str = "provider said: try later\nline two \\ back";

/// Many transitions with long reasons: the column keeps the newest entries, numbered on without
/// a gap, under its bound; a reason with a line feed and a backslash comes back exactly.
async fn check_bound_and_escapes(store: Arc<dyn Store>) {
    let k = id(&idemflow::conformance::unique("bound"), "k1");
    let lease = claimed(&store, &claim_for(&k, "{}", Duration::from_secs(60))).await;
    let release = |reason: String| Release {
        actor: Actor::Worker,
        reason,
        error: None,
        recheck_after: None,
    };
    for i in 0..200 {
        let reason = format!("{i:03} {}", "r".repeat(600));
        store
            .release(&k, lease.token, &release(reason))
            .await
            .unwrap();
    }
    store
        .release(&k, lease.token, &release(ODD_REASON.into()))
        .await
        .unwrap();
    let h = store.history(&k).await.unwrap();
    let seqs: Vec<i64> = h.iter().map(|e| e.seq).collect();
    assert_eq!(seqs.last(), Some(&202), "claim + 201 releases");
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    assert!(
        h.len() < 60,
        "the oldest entries are dropped: {} kept",
        h.len()
    );
    let kept: usize = h
        .iter()
        .map(|e| e.reason.as_deref().map_or(0, str::len))
        .sum();
    assert!(kept < 16 * 1024, "{kept} bytes of reasons kept");
    assert_eq!(h.last().unwrap().reason.as_deref(), Some(ODD_REASON));
    // Reasons are cut at 512 characters in the history (the row's columns are not).
    let long = h[h.len() - 2].reason.as_deref().unwrap();
    assert_eq!((long.len(), &long[..4]), (512, "199 "));
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_history_keeps_its_newest_entries_and_exact_reasons() {
    check_bound_and_escapes(crate::support::sqlite::memory().await).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_history_keeps_its_newest_entries_and_exact_reasons() {
    let Some(store) = crate::support::postgres::store().await else {
        return;
    };
    check_bound_and_escapes(store).await;
}
