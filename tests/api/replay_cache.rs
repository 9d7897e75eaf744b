//! The executor's replay cache: a finished key's answer is given back from memory, without a
//! store call, to the same request only, for no longer than the key lasts and the cache's age
//! limit, and not at all when it is off.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemflow::conformance::Delegate;
use idemflow::record::Actor;
use idemflow::store::sqlite::SqliteStore;
use idemflow::store::{ClaimOutcome, Finish, FinishMode, NewClaim};
use idemflow::{
    Context, Error, Execution, Idempotency, IdempotentRequest, KeyId, KeyState, Outcome, Store,
    StoreError, StoredResponse, async_trait,
};
use serde_json::json;

/// A store that counts its claims.
#[derive(Debug)]
struct Counted {
    inner: SqliteStore,
    claims: AtomicUsize,
}

#[async_trait]
impl Delegate for Counted {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(claim).await
    }
}

async fn counted() -> Arc<Counted> {
    let inner = SqliteStore::connect("sqlite::memory:").await.unwrap();
    inner.migrate().await.unwrap();
    Arc::new(Counted {
        inner,
        claims: AtomicUsize::new(0),
    })
}

fn request(key: &str, amount: i64) -> IdempotentRequest {
    IdempotentRequest::new("acct", key, "charge", &json!({"amount": amount})).unwrap()
}

async fn run(idem: &Idempotency, key: &str, amount: i64) -> Result<Execution, Error> {
    idem.execute(request(key, amount), |_: Context| async move {
        Outcome::Succeeded(StoredResponse::json(201, &json!({"charged": amount})).unwrap())
    })
    .await
}

#[tokio::test]
async fn a_replay_of_a_finished_key_needs_no_store_call() {
    let store = counted().await;
    let idem = Idempotency::new(store.clone());
    let first = run(&idem, "k1", 5).await.unwrap();
    assert_eq!(store.claims.load(Ordering::SeqCst), 1);
    for _ in 0..3 {
        let again = run(&idem, "k1", 5).await.unwrap();
        assert!(again.is_replay());
        assert_eq!(again.response(), first.response());
    }
    assert_eq!(
        store.claims.load(Ordering::SeqCst),
        1,
        "a replay went to the store"
    );
    // A clone shares the cache (the axum layer and the consumers hold clones).
    assert!(run(&idem.clone(), "k1", 5).await.unwrap().is_replay());
    assert_eq!(store.claims.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_read_from_the_store_is_kept_too() {
    let store = counted().await;
    run(&Idempotency::new(store.clone()), "k1", 5)
        .await
        .unwrap();
    // Another executor (another process) replays from the store once, then from memory.
    let other = Idempotency::new(store.clone());
    assert!(run(&other, "k1", 5).await.unwrap().is_replay());
    assert!(run(&other, "k1", 5).await.unwrap().is_replay());
    assert_eq!(store.claims.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn another_request_under_the_key_gets_the_stores_answer() {
    let store = counted().await;
    let idem = Idempotency::new(store.clone());
    run(&idem, "k1", 5).await.unwrap();
    let other = run(&idem, "k1", 6).await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch { .. })),
        "{other:?}"
    );
    assert_eq!(store.claims.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn with_the_cache_off_every_replay_reads_the_store() {
    let store = counted().await;
    let idem = Idempotency::new(store.clone()).replay_cache_bytes(0);
    run(&idem, "k1", 5).await.unwrap();
    run(&idem, "k1", 5).await.unwrap();
    run(&idem, "k1", 5).await.unwrap();
    assert_eq!(store.claims.load(Ordering::SeqCst), 3);
    // Turned off on a clone of an executor whose cache holds the key: the clone reads the store.
    let cached = Idempotency::new(store.clone());
    run(&cached, "k2", 5).await.unwrap();
    let off = cached.clone().replay_cache_bytes(0);
    run(&off, "k2", 5).await.unwrap();
    assert_eq!(store.claims.load(Ordering::SeqCst), 5);
}

#[tokio::test]
async fn no_entry_outlives_its_key() {
    let store = counted().await;
    let idem = Idempotency::new(store.clone()).retention(Duration::from_millis(300));
    run(&idem, "k1", 5).await.unwrap();
    tokio::time::sleep(Duration::from_millis(350)).await;
    // The key has expired: the request goes to the store (which replays until a purge).
    run(&idem, "k1", 5).await.unwrap();
    assert_eq!(store.claims.load(Ordering::SeqCst), 2);
}

/// An operator's forced resolve elsewhere is seen once the entry's age limit has passed (the
/// promise `docs/design.md` states for other processes).
#[tokio::test]
async fn a_forced_resolve_elsewhere_is_seen_within_the_age_limit() {
    let store = counted().await;
    let age = Duration::from_millis(300);
    let idem = Idempotency::new(store.clone()).replay_cache_max_age(age);
    run(&idem, "k1", 5).await.unwrap();
    let id = KeyId::new(
        idemflow::key::Scope::new("acct").unwrap(),
        idemflow::key::IdempotencyKey::new("k1").unwrap(),
    );
    let refund = StoredResponse::json(402, &json!({"refunded": true})).unwrap();
    store
        .inner
        .finish_as(
            &id,
            FinishMode::Override,
            &Finish {
                to: KeyState::Failed { retryable: false },
                response: Some(refund.clone()),
                error: None,
                actor: Actor::Operator,
                reason: "charged by mistake".to_owned(),
            },
        )
        .await
        .unwrap();
    tokio::time::sleep(age + Duration::from_millis(50)).await;
    let after = run(&idem, "k1", 5).await.unwrap();
    assert_eq!(after.response(), &refund);
}
