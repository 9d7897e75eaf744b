//! `IdempotencyContext::call`: the layer's one-line provider call, against the testkit's fake
//! Stripe. What each answer of the provider becomes (stored, replayed, retried, left for the
//! sweeper), that secrets are masked for the first caller too, and that a provider the layer was
//! not declared with is never called.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idemflow::axum::{IdempotencyContext, IdempotencyLayer, ScopeSource};
use idemflow::provider::Stripe;
use idemflow::provider::http::HttpConfig;
use idemflow::store::OperatorStore;
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::FakeStripe;
use idemflow::{Idempotency, KeyId, KeyState, Store, key::Scope};

use crate::http_layer::{Answer, send};

const BODY: &str = r#"{"amount": 1999, "currency": "eur"}"#;

struct Fixture {
    app: Router,
    fake: FakeStripe,
    store: Arc<SqliteStore>,
}

async fn charge(State(stripe): State<Arc<Stripe>>, ctx: IdempotencyContext) -> Response {
    match ctx.call(stripe.as_ref()).await {
        Ok(answer) => answer.into_response(),
        Err(no_answer_yet) => no_answer_yet,
    }
}

/// The layer declared with `declared` (a Stripe adapter named `stripe`, or another name), the
/// handler calling an adapter named `stripe` that tries once (no retry inside the adapter).
async fn fixture(declared: &str) -> Fixture {
    let fake = FakeStripe::start().await.unwrap();
    let one_try = HttpConfig {
        max_attempts: 1,
        ..HttpConfig::default()
    };
    let stripe = Arc::new(
        Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
            .unwrap()
            .http_config(one_try.clone())
            .unwrap(),
    );
    let label = Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
        .unwrap()
        .with_name(declared);
    let store = Arc::new(SqliteStore::connect("sqlite::memory:").await.unwrap());
    store.migrate().await.unwrap();
    let idem = Idempotency::new(store.clone() as Arc<dyn Store>);
    let layer = IdempotencyLayer::new(idem, ScopeSource::fixed(Scope::new("acct").unwrap()))
        .operation("payments.create")
        .provider(&label);
    let app = Router::new()
        .route("/payments", post(charge))
        .layer(layer)
        .with_state(stripe);
    Fixture { app, fake, store }
}

async fn post_key(app: &Router, key: &str) -> Answer {
    let req = Request::post("/payments")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(BODY))
        .unwrap();
    send(app, req).await
}

fn key_id(key: &str) -> KeyId {
    idemflow::conformance::id("acct", key)
}

#[tokio::test]
async fn a_charge_is_stored_masked_for_the_first_caller_too_and_replayed() {
    let f = fixture("stripe").await;
    let first = post_key(&f.app, "pay-1").await;
    assert_eq!(first.status, StatusCode::OK, "{:?}", first.body);
    let pi = first.json();
    assert_eq!(pi["object"], "payment_intent");
    assert_eq!(
        pi["client_secret"], "[redacted]",
        "the first caller gets the masked answer: {pi}"
    );
    let again = post_key(&f.app, "pay-1").await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body, "the replay is the first answer");
    assert_eq!(f.fake.ledger().len(), 1, "one charge");
    // Counted by the client's key, as a user's test would (the derived key unknown to it).
    let stripe = Stripe::with_base_url(f.fake.base_url(), FakeStripe::API_KEY).unwrap();
    let ledger = f.fake.ledger();
    assert_eq!(
        ledger.count_for_client_key(&stripe, &key_id("pay-1"), "payments.create"),
        1
    );
    assert_eq!(
        ledger.count_for_client_key(&stripe, &key_id("pay-2"), "payments.create"),
        0
    );
    let record = f.store.get(&key_id("pay-1")).await.unwrap().unwrap();
    assert_eq!(record.state, KeyState::Done);
    assert_eq!(record.provider.as_deref(), Some("stripe"));
}

#[tokio::test]
async fn a_rate_limit_is_503_retryable_with_the_providers_retry_after_and_the_retry_charges() {
    let f = fixture("stripe").await;
    f.fake.faults().rate_limit_next(Duration::from_secs(7));
    let limited = post_key(&f.app, "pay-2").await;
    assert_eq!(limited.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(limited.problem_type(), "urn:idemflow:problem:retryable");
    assert_eq!(limited.header("retry-after"), Some("7"));
    assert_eq!(f.fake.ledger().len(), 0, "Stripe did nothing");
    let record = f.store.get(&key_id("pay-2")).await.unwrap().unwrap();
    assert_eq!(record.state, KeyState::Failed { retryable: true });
    let retry = post_key(&f.app, "pay-2").await;
    assert_eq!(retry.status, StatusCode::OK, "{:?}", retry.body);
    assert_eq!(retry.header("idempotent-replayed"), None, "the retry ran");
    assert_eq!(f.fake.ledger().len(), 1, "one charge");
}

#[tokio::test]
async fn a_server_error_is_503_outcome_unknown_and_the_key_waits_for_the_sweeper() {
    let f = fixture("stripe").await;
    f.fake.faults().server_error_next(500);
    let unknown = post_key(&f.app, "pay-3").await;
    assert_eq!(unknown.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        unknown.problem_type(),
        "urn:idemflow:problem:outcome-unknown"
    );
    assert_eq!(unknown.header("retry-after"), Some("5"));
    let record = f.store.get(&key_id("pay-3")).await.unwrap().unwrap();
    assert_eq!(record.state, KeyState::Processing, "left for the sweeper");
    assert!(
        record.may_have_acted,
        "the request was sent: it may have acted"
    );
    let stuck = f.store.stuck(Duration::ZERO, 10).await.unwrap();
    assert_eq!(stuck.count, 1);
}

#[tokio::test]
async fn a_provider_the_layer_was_not_declared_with_is_never_called() {
    let f = fixture("stripe-eu").await;
    let refused = post_key(&f.app, "pay-4").await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        refused.problem_type(),
        "urn:idemflow:problem:provider-not-declared"
    );
    assert!(
        refused.json()["detail"]
            .as_str()
            .unwrap()
            .contains("\"stripe-eu\""),
        "{}",
        refused.json()
    );
    assert_eq!(f.fake.ledger().len(), 0, "nothing was sent");
    let record = f.store.get(&key_id("pay-4")).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        KeyState::Failed { retryable: true },
        "nothing happened: a retry (with the code fixed) may run it"
    );
}

/// A provider whose keys are at most 36 characters (a UUID's length), recording the keys it is
/// sent; with `keyless`, one that does not dedupe by key at all (every send acts).
#[derive(Debug, Default)]
struct ShortKeys {
    sent: std::sync::Mutex<Vec<String>>,
    keyless: bool,
}

#[idemflow::async_trait]
impl idemflow::Provider for ShortKeys {
    fn name(&self) -> &str {
        "short-keys"
    }

    fn key_spec(&self) -> idemflow::provider::KeySpec {
        if self.keyless {
            idemflow::provider::KeySpec::no_keys()
        } else {
            idemflow::provider::KeySpec {
                max_len: 36,
                retention: Some(Duration::from_secs(24 * 3600)),
                replays_same_key: true,
            }
        }
    }

    async fn send(
        &self,
        provider_key: &str,
        _request: &serde_json::Value,
    ) -> idemflow::provider::CallReply {
        self.sent.lock().unwrap().push(provider_key.to_owned());
        idemflow::provider::CallReply::Succeeded {
            response: idemflow::StoredResponse::new(201),
            replayed: false,
        }
    }

    async fn lookup(
        &self,
        _provider_key: &str,
        _request: &serde_json::Value,
        _attempts: idemflow::provider::Attempts,
        _now: chrono::DateTime<chrono::Utc>,
    ) -> idemflow::provider::Lookup {
        idemflow::provider::Lookup::NotFound {
            authoritative: false,
        }
    }
}

async fn call_short(State(p): State<Arc<ShortKeys>>, ctx: IdempotencyContext) -> Response {
    match ctx.call(p.as_ref()).await {
        Ok(answer) => answer.into_response(),
        Err(no_answer_yet) => no_answer_yet,
    }
}

#[tokio::test]
async fn the_forwarded_key_fits_the_declared_providers_limit_as_with_idempotency_call() {
    let provider = Arc::new(ShortKeys::default());
    let store = Arc::new(SqliteStore::connect("sqlite::memory:").await.unwrap());
    store.migrate().await.unwrap();
    let idem = Idempotency::new(store.clone() as Arc<dyn Store>);
    let layer = IdempotencyLayer::new(
        idem.clone(),
        ScopeSource::fixed(Scope::new("acct").unwrap()),
    )
    .operation("payments.create")
    .provider(provider.as_ref());
    let app = Router::new()
        .route("/payments", post(call_short))
        .layer(layer)
        .with_state(provider.clone());
    let answer = post_key(&app, "pay-5").await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    // The same key of another scope through `Idempotency::call`: the same derivation.
    let request = idemflow::IdempotentRequest::new(
        "other",
        "pay-5",
        "payments.create",
        &serde_json::json!({"amount": 1999, "currency": "eur"}),
    )
    .unwrap();
    idem.call(request, provider.as_ref()).await.unwrap();
    let sent = provider.sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 2, "{sent:?}");
    let spec = idemflow::Provider::key_spec(provider.as_ref());
    for (scope, pk) in ["acct", "other"].into_iter().zip(&sent) {
        let id = idemflow::conformance::id(scope, "pay-5");
        assert!(pk.len() <= 36, "{pk:?} is longer than the provider's 36");
        assert_eq!(*pk, spec.derive(&id.scope, &id.key, "payments.create"));
        let record = store.get(&id).await.unwrap().unwrap();
        assert_eq!(&record.provider_key, pk, "the stored key is the one sent");
    }
}

/// The handler of the takeover test: calls the provider, then (on the first request only) hangs
/// until the test drops it, as a process that died after the provider acted.
async fn call_then_hang(State(p): State<Arc<ShortKeys>>, ctx: IdempotencyContext) -> Response {
    let answer = ctx.call(p.as_ref()).await;
    if p.sent.lock().unwrap().len() == 1 {
        std::future::pending::<()>().await;
    }
    match answer {
        Ok(answer) => answer.into_response(),
        Err(no_answer_yet) => no_answer_yet,
    }
}

#[tokio::test]
async fn a_retry_never_takes_over_a_key_of_a_provider_that_does_not_dedupe() {
    // An executor that lets a retry take over an expired lease within an hour, and a layer
    // declared with a provider that does not dedupe by key: a re-send would act again, so no
    // retry may take over (as with `Idempotency::call`); the sweeper settles the key.
    let provider = Arc::new(ShortKeys {
        keyless: true,
        ..ShortKeys::default()
    });
    let store = Arc::new(SqliteStore::connect("sqlite::memory:").await.unwrap());
    store.migrate().await.unwrap();
    let idem = Idempotency::new(store.clone() as Arc<dyn Store>)
        .lease(Duration::from_millis(300))
        .retry_takeover_window(Some(Duration::from_secs(3600)));
    let layer = IdempotencyLayer::new(idem, ScopeSource::fixed(Scope::new("acct").unwrap()))
        .operation("email.send")
        .provider(provider.as_ref());
    let app = Router::new()
        .route("/payments", post(call_then_hang))
        .layer(layer)
        .with_state(provider.clone());
    let first = tokio::spawn({
        let app = app.clone();
        async move { post_key(&app, "mail-1").await }
    });
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while provider.sent.lock().unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < until,
            "the first request never sent"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The process dies after the provider acted: its lease runs out unrenewed.
    first.abort();
    let _ = first.await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    let retry = post_key(&app, "mail-1").await;
    assert_eq!(
        provider.sent.lock().unwrap().len(),
        1,
        "the retry sent the request again to a provider that does not dedupe: {} {:?}",
        retry.status,
        retry.body
    );
    assert!(
        retry.status.is_server_error() || retry.status == StatusCode::CONFLICT,
        "the retry is told to wait for the sweeper: {} {:?}",
        retry.status,
        retry.body
    );
    let record = store.get(&key_id("mail-1")).await.unwrap().unwrap();
    assert_eq!(record.state, KeyState::Processing, "left for the sweeper");
}
