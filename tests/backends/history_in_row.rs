//! Issue 22's history in the key's row, on SQLite and PostgreSQL: the column keeps its newest
//! entries within its bound and any reason exactly; and the schema change (history in the row,
//! tombstones for purged keys) carries existing rows forward: a database written by the schema before it, through that schema's own
//! triggers, is migrated, and its keys and their history are read back through the store, then
//! written on. SQLite and PostgreSQL (MariaDB keeps its history table).
//!
//! The rows are written the way the stores wrote them before: a key row whose every transition
//! bumps `version` with `last_actor` / `last_reason`, and the old triggers writing one history row
//! per bump and one per delete.

use std::sync::Arc;
use std::time::Duration;

use idemflow::conformance::{claim_for, claimed, done, id};
use idemflow::record::Actor;
use idemflow::store::{ClaimOutcome, Release};
use idemflow::{Fingerprint, KeyId, KeyState, LeaseToken, Store, StoredResponse};

/// The first migration of the new schema, on both backends.
const FIRST_NEW: i64 = 20261203120001;

/// A reason with a line feed and a backslash, which the history column escapes.
const ODD_REASON: &str = "provider said: try later\nline two \\ back";

/// The old schema's statements for the three keys, in order (placeholders: `{fp}` the
/// fingerprint, `{past}` / `{soon}` / `{later}` times before now, and after).
const SCENARIO: [&str; 8] = [
    // "paid": claimed, then done.
    "INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, state, \
       fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, created_at, \
       updated_at, retention_ms, version, last_actor, last_reason, last_attempt_at) \
     VALUES ('carry', 'paid', 'payments.create', 'fake', 'pk-paid', 'processing', '{fp}', '{}', \
       100, 'w1', {later}, 1, {past}, {past}, 3600000, 1, 'worker', 'claimed', {past})",
    "UPDATE idempotency_keys SET state = 'done', response_status = 201, \
       response_body = {body}, lease_owner = NULL, lease_expires_at = NULL, updated_at = {past}, \
       expires_at = {later}, version = version + 1, last_actor = 'worker', \
       last_reason = 'succeeded' WHERE key = 'paid'",
    // "retried": claimed, failed (retryable), reclaimed: processing under token 101.
    "INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, state, \
       fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, created_at, \
       updated_at, retention_ms, version, last_actor, last_reason, last_attempt_at) \
     VALUES ('carry', 'retried', 'payments.create', 'fake', 'pk-retried', 'processing', '{fp}', \
       '{}', 100, 'w1', {later}, 1, {past}, {past}, 3600000, 1, 'worker', 'claimed', {past})",
    "UPDATE idempotency_keys SET state = 'failed', retryable = {true}, lease_token = 100, \
       lease_owner = NULL, lease_expires_at = NULL, expires_at = {later}, \
       version = version + 1, last_actor = 'worker', last_reason = {odd} \
     WHERE key = 'retried'",
    "UPDATE idempotency_keys SET state = 'processing', retryable = {false}, lease_token = 101, \
       lease_owner = 'w2', lease_expires_at = {later}, expires_at = NULL, attempts = 2, \
       version = version + 1, last_actor = 'worker', \
       last_reason = 'reclaimed after a retryable failure' WHERE key = 'retried'",
    // "purged": claimed, done, purged (the old delete trigger records the purge).
    "INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, state, \
       fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, created_at, \
       updated_at, retention_ms, version, last_actor, last_reason, last_attempt_at) \
     VALUES ('carry', 'purged', 'payments.create', 'fake', 'pk-purged', 'processing', '{fp}', \
       '{}', 100, 'w1', {later}, 1, {past}, {past}, 0, 1, 'worker', 'claimed', {past})",
    "UPDATE idempotency_keys SET state = 'done', response_status = 200, lease_owner = NULL, \
       lease_expires_at = NULL, expires_at = {past}, version = version + 1, \
       last_actor = 'worker', last_reason = 'succeeded' WHERE key = 'purged'",
    "DELETE FROM idempotency_keys WHERE key = 'purged'",
];

/// The old schema's statements with the dialect's values filled in.
fn scenario(past: &str, later: &str, body: &str, yes: &str, no: &str) -> Vec<String> {
    let fp = Fingerprint::compute("payments.create", "{}");
    let odd = format!("'{}'", ODD_REASON.replace('\'', "''"));
    SCENARIO
        .iter()
        .map(|s| {
            s.replace("{fp}", fp.as_str())
                .replace("{past}", past)
                .replace("{later}", later)
                .replace("{body}", body)
                .replace("{true}", yes)
                .replace("{false}", no)
                .replace("{odd}", &odd)
        })
        .collect()
}

fn key(k: &str) -> KeyId {
    id("carry", k)
}

/// What every backend must read back, and then write on.
async fn check_carried(store: Arc<dyn Store>) {
    // A finished key: its row and both events.
    let paid = store.get(&key("paid")).await.unwrap().unwrap();
    assert_eq!(paid.state, KeyState::Done);
    let response = paid.response.expect("the stored response is carried");
    assert_eq!((response.status(), response.body()), (201, &b"ok"[..]));
    let h = store.history(&key("paid")).await.unwrap();
    assert_eq!(h.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
    assert_eq!((h[0].from, h[0].to), (None, Some(KeyState::Processing)));
    assert_eq!(
        (h[1].from, h[1].to),
        (Some(KeyState::Processing), Some(KeyState::Done))
    );
    assert_eq!(h[1].lease_token, Some(LeaseToken(100)));
    assert_eq!(
        (h[1].actor, h[1].reason.as_deref()),
        (Actor::Worker, Some("succeeded"))
    );

    // A processing key: three events, the odd reason exactly, and it can be finished.
    let h = store.history(&key("retried")).await.unwrap();
    assert_eq!(h.len(), 3, "{h:?}");
    assert_eq!(h[1].to, Some(KeyState::Failed { retryable: true }));
    assert_eq!(h[1].reason.as_deref(), Some(ODD_REASON));
    assert_eq!(
        (h[2].from, h[2].to, h[2].lease_token),
        (
            Some(KeyState::Failed { retryable: true }),
            Some(KeyState::Processing),
            Some(LeaseToken(101))
        )
    );
    store
        .finish(
            &key("retried"),
            LeaseToken(101),
            &done(StoredResponse::new(202)),
        )
        .await
        .unwrap();
    let h = store.history(&key("retried")).await.unwrap();
    assert_eq!(h.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(h[3].to, Some(KeyState::Done));

    // A purged key: no row, its history with the purge, and a re-created key continues it
    // and sends a provider key of its own.
    assert!(store.get(&key("purged")).await.unwrap().is_none());
    let h = store.history(&key("purged")).await.unwrap();
    assert_eq!(h.len(), 3, "{h:?}");
    assert_eq!((h[2].to, h[2].actor), (None, Actor::Purge));
    let mut again = claim_for(&key("purged"), "{}", Duration::from_secs(30));
    again.renewed_key_base = Some("pk-purged-renewed-".into());
    let lease = claimed(&store, &again).await;
    assert_eq!(lease.provider_key, "pk-purged-renewed-00000004");
    let h = store.history(&key("purged")).await.unwrap();
    assert_eq!(h.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!((h[3].from, h[3].to), (None, Some(KeyState::Processing)));

    // A replay of the carried finished key is a replay.
    let c = claim_for(&key("paid"), "{}", Duration::from_secs(30));
    match store.claim(&c).await.unwrap() {
        ClaimOutcome::Existing { record, .. } => assert_eq!(record.state, KeyState::Done),
        other => panic!("expected the finished key, got {other:?}"),
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_rows_and_history_are_carried_forward() {
    use idemflow::store::sqlite::{SqliteStore, migrator};
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    let m = migrator();
    let before = m.iter().map(|x| x.version).filter(|v| *v < FIRST_NEW).max();
    m.run_to(before.unwrap(), &pool).await.unwrap();
    let now = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";
    let (past, later) = (format!("({now} - 60000)"), format!("({now} + 3600000)"));
    for s in scenario(&past, &later, "X'6F6B'", "1", "0") {
        sqlx::query(sqlx::AssertSqlSafe(s))
            .execute(&pool)
            .await
            .unwrap();
    }
    pool.close().await;

    let store = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    check_carried(Arc::new(store)).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_and_history_are_carried_forward() {
    use crate::support::postgres::{drop_schema, fresh_schema, pool_in};
    use idemflow::store::postgres::{PostgresStore, migrator};

    let Some((url, schema)) = fresh_schema().await else {
        return;
    };
    let pool = pool_in(&url, &schema, 2).await;
    let m = migrator();
    let before = m.iter().map(|x| x.version).filter(|v| *v < FIRST_NEW).max();
    m.run_to(before.unwrap(), &pool).await.unwrap();
    let (past, later) = (
        "(now() - interval '1 minute')",
        "(now() + interval '1 hour')",
    );
    for s in scenario(past, later, "'\\x6f6b'::bytea", "true", "false") {
        sqlx::query(sqlx::AssertSqlSafe(s))
            .execute(&pool)
            .await
            .unwrap();
    }
    let store = PostgresStore::from_pool(pool);
    store.migrate().await.unwrap();
    check_carried(Arc::new(store)).await;
    drop_schema(&url, &schema).await;
}

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
