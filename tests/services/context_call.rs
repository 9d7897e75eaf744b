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
use idemflow::{Idempotency, KeyId, KeyState, Scope, Store};

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
