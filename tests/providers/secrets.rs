//! Secrets stay out of storage and output: Stripe's `client_secret` (a field the adapter
//! declares secret) is masked before any answer is stored, whether the worker or the sweeper
//! stores it; the application's own fields are masked by `redact_with`; and neither `inspect`
//! nor `reconcile --json` prints the client secret or the API key.

use std::sync::Arc;
use std::time::Duration;

use idemflow::provider::Stripe;
use idemflow::provider::http::HttpConfig;
use idemflow::provider::secrets::{REDACTED, mask_fields};
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::FakeStripe;
use idemflow::{
    Idempotency, IdempotentRequest, KeyState, Outcome, Providers, Store, StoredResponse, Sweeper,
};
use serde_json::{Value, json};

const SECRET_MARK: &str = "_secret_";

fn stripe(fake: &FakeStripe) -> Arc<Stripe> {
    Arc::new(
        Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
            .unwrap()
            .http_config(HttpConfig {
                request_timeout: Duration::from_secs(2),
                max_attempts: 1,
                ..HttpConfig::default()
            })
            .unwrap(),
    )
}

fn charge(key: &str) -> IdempotentRequest {
    IdempotentRequest::new(
        "shop-1",
        key,
        "payments.create",
        &json!({"amount": 1500, "currency": "usd", "payment_method": "pm_card_visa"}),
    )
    .unwrap()
}

async fn file_store(dir: &tempfile::TempDir) -> (Arc<dyn Store>, String) {
    let url = format!("sqlite://{}", dir.path().join("secrets.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    (Arc::new(store), url)
}

fn text(r: &StoredResponse) -> String {
    String::from_utf8_lossy(r.body()).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_secret_is_never_stored_nor_printed() {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = stripe(&fake);
    let dir = tempfile::tempdir().unwrap();
    // `url` is the CLI's (feature `cli`).
    #[cfg_attr(not(feature = "cli"), allow(unused_variables))]
    let (store, url) = file_store(&dir).await;
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(400));

    // The worker stores Stripe's answer.
    let paid = idem.call(charge("order-1"), stripe.as_ref()).await.unwrap();
    let body: Value = paid.response().body_json().unwrap();
    assert_eq!(body["client_secret"], REDACTED, "{body}");
    assert_eq!(body["object"], "payment_intent");
    // Stripe did send one: the fake's ledger has it.
    assert!(fake.requests().len() == 1);

    // The sweeper stores Stripe's answer after a lost response (a same-key re-drive).
    fake.faults().lose_next_response();
    let lost = idem.call(charge("order-2"), stripe.as_ref()).await;
    assert!(lost.is_err(), "{lost:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = Sweeper::new(store.clone(), Providers::new().with(stripe.clone()))
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.done, 1, "{report:?}");

    for key in ["order-1", "order-2"] {
        let row = store.get(charge(key).id()).await.unwrap().unwrap();
        assert_eq!(row.state, KeyState::Done);
        let stored = text(row.response.as_ref().unwrap());
        assert!(!stored.contains(SECRET_MARK), "{key}: {stored}");
        assert!(stored.contains(REDACTED), "{key}: {stored}");
    }

    #[cfg(feature = "cli")]
    {
        let config = dir.path().join("idemflow.toml");
        std::fs::write(
            &config,
            "[[providers]]\nname = \"stripe\"\nkind = \"stripe\"\napi_key_env = \"TEST_STRIPE_KEY\"\n",
        )
        .unwrap();
        let run = |args: &[&str]| {
            std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
                .args(args)
                .env("DATABASE_URL", &url)
                .env("TEST_STRIPE_KEY", FakeStripe::API_KEY)
                .env_remove("IDEMFLOW_CONFIG")
                .output()
                .unwrap()
        };
        for args in [
            vec!["inspect", "shop-1", "order-1"],
            vec!["--json", "inspect", "shop-1", "order-2"],
            vec![
                "-vv",
                "--json",
                "reconcile",
                "--once",
                "--config",
                config.to_str().unwrap(),
            ],
            vec!["--json", "stats"],
        ] {
            let o = run(&args);
            let out = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            assert!(o.status.success(), "{args:?}: {out}");
            assert!(
                !out.contains(SECRET_MARK),
                "{args:?} printed a client secret: {out}"
            );
            assert!(
                !out.contains(FakeStripe::API_KEY),
                "{args:?} printed the API key: {out}"
            );
        }
    }
}

/// The application's own fields are masked by `redact_with` before storing, for the first
/// caller and every replay alike.
#[tokio::test]
async fn redact_with_masks_the_applications_fields() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    let idem = Idempotency::new(store.clone())
        .redact_with(|resp| mask_fields(resp, &["card_number", "token"]));
    let answer = || async {
        Outcome::Succeeded(
            StoredResponse::json(
                201,
                &json!({"id": "u1", "card_number": "4242424242424242", "nested": {"token": "tok_9"}}),
            )
            .unwrap(),
        )
    };
    let first = idem.execute(charge("u1"), |_| answer()).await.unwrap();
    let again = idem.execute(charge("u1"), |_| answer()).await.unwrap();
    assert!(again.is_replay());
    assert_eq!(first.response(), again.response());
    let stored = text(
        store
            .get(charge("u1").id())
            .await
            .unwrap()
            .unwrap()
            .response
            .as_ref()
            .unwrap(),
    );
    for secret in ["4242424242424242", "tok_9"] {
        assert!(!stored.contains(secret), "{stored}");
        assert!(!text(first.response()).contains(secret));
    }
    assert!(stored.contains("\"id\":\"u1\""), "{stored}");
}

/// `Idempotency::call`: the first caller gets the masked answer, and a replay is that answer
/// byte for byte.
#[tokio::test]
async fn the_first_answer_of_a_call_is_the_masked_stored_one() {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = stripe(&fake);
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    let idem = Idempotency::new(store.clone());
    let first = idem.call(charge("c-1"), stripe.as_ref()).await.unwrap();
    let again = idem.call(charge("c-1"), stripe.as_ref()).await.unwrap();
    assert!(!first.is_replay() && again.is_replay());
    assert!(
        !text(first.response()).contains(SECRET_MARK),
        "{}",
        text(first.response())
    );
    assert_eq!(first.response(), again.response(), "byte for byte");
    assert_eq!(fake.ledger().len(), 1);
}

#[cfg(feature = "axum")]
mod layer {
    //! Behind `IdempotencyLayer`, a handler calls the provider itself (as `docs/http.md` says:
    //! `ctx.provider_key()` and `ctx.request()`) and answers with the provider's answer.

    use axum::Router;
    use axum::body::Body;
    use axum::extract::State;
    use axum::http::{HeaderName, Request, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use http_body_util::BodyExt;
    use idemflow::axum::{IdempotencyContext, IdempotencyLayer, ScopeSource};
    use idemflow::provider::CallReply;
    use idemflow::provider::Provider;
    use tower::ServiceExt;

    use super::*;

    /// The handler: sends the stored request with the provider key and answers with Stripe's
    /// answer as it came (status, every header it kept, body).
    async fn pay(State(stripe): State<Arc<Stripe>>, ctx: IdempotencyContext) -> Response {
        let answer = match stripe.send(ctx.provider_key(), ctx.request()).await {
            CallReply::Succeeded { response, .. } | CallReply::Rejected { response } => response,
            other => return (StatusCode::BAD_GATEWAY, format!("{other:?}")).into_response(),
        };
        let (status, headers, body) = answer.into_parts();
        let mut resp = (StatusCode::from_u16(status).unwrap(), body).into_response();
        for (n, v) in headers {
            resp.headers_mut()
                .append(HeaderName::try_from(n).unwrap(), v.parse().unwrap());
        }
        resp
    }

    fn account() -> ScopeSource {
        ScopeSource::header(HeaderName::from_static("x-account-id"))
    }

    fn app(idem: Idempotency, stripe: Arc<Stripe>) -> Router {
        let layer = IdempotencyLayer::new(idem, account())
            // Names the provider the sweeper asks, and the secret fields masked.
            .provider(stripe.as_ref());
        Router::new()
            .route("/payments", post(pay))
            .layer(layer)
            .with_state(stripe)
    }

    struct Answer {
        status: StatusCode,
        replayed: bool,
        body: String,
    }

    async fn send(app: &Router, key: &str) -> Answer {
        let req = Request::post("/payments")
            .header("content-type", "application/json")
            .header("x-account-id", "shop-1")
            .header("idempotency-key", key)
            .body(Body::from(
                r#"{"amount": 1500, "currency": "usd", "payment_method": "pm_card_visa"}"#,
            ))
            .unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        Answer {
            status: parts.status,
            replayed: parts.headers.contains_key("idempotent-replayed"),
            body: String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap(),
        }
    }

    fn id(key: &str) -> idemflow::KeyId {
        idemflow::KeyId::new("shop-1".parse().unwrap(), key.parse().unwrap())
    }

    /// The provider's secret fields are masked for the first caller and in the stored answer
    /// alike, so the replay is the first answer byte for byte.
    #[tokio::test]
    async fn the_layer_masks_the_providers_secrets_for_the_first_caller_too() {
        let fake = FakeStripe::start().await.unwrap();
        let stripe = stripe(&fake);
        let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
        store.migrate().await.unwrap();
        let store: Arc<dyn Store> = Arc::new(store);
        let app = app(Idempotency::new(store.clone()), stripe);

        let first = send(&app, "l-1").await;
        assert_eq!(first.status, StatusCode::OK, "{}", first.body);
        assert!(!first.replayed);
        assert!(
            !first.body.contains(SECRET_MARK),
            "first answer: {}",
            first.body
        );
        assert!(first.body.contains(REDACTED), "{}", first.body);
        let row = store.get(&id("l-1")).await.unwrap().unwrap();
        let stored = text(row.response.as_ref().unwrap());
        assert!(!stored.contains(SECRET_MARK), "stored: {stored}");
        let again = send(&app, "l-1").await;
        assert!(again.replayed);
        assert_eq!(again.status, first.status);
        assert_eq!(again.body, first.body, "byte for byte");
        assert_eq!(fake.ledger().len(), 1);
    }

    /// `redact_with` applies to the first answer as to the stored one on the layer path too.
    #[tokio::test]
    async fn redact_with_masks_the_layers_first_answer_like_its_replay() {
        let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
        store.migrate().await.unwrap();
        let idem = Idempotency::new(Arc::new(store))
            .redact_with(|resp| mask_fields(resp, &["card_number"]));
        let handler = || async {
            (
                StatusCode::CREATED,
                [("content-type", "application/json")],
                r#"{"id": "u1", "card_number": "4242424242424242"}"#,
            )
        };
        // An answer the layer does not store (marked "nothing happened") is masked too.
        let unstored = || async {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                axum::Extension(idemflow::axum::NothingHappened),
                [("content-type", "application/json")],
                r#"{"card_number": "4242424242424242", "retry": true}"#,
            )
        };
        let app = Router::new()
            .route("/payments", post(handler))
            .route("/later", post(unstored))
            .layer(IdempotencyLayer::new(idem, account()));
        let first = send(&app, "r-1").await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(!first.body.contains("4242424242424242"), "{}", first.body);
        let again = send(&app, "r-1").await;
        assert!(again.replayed);
        assert_eq!(again.body, first.body, "byte for byte");
        let req = Request::post("/later")
            .header("x-account-id", "shop-1")
            .header("idempotency-key", "r-2")
            .body(Body::from("{}"))
            .unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body);
        assert!(!body.contains("4242424242424242"), "{body}");
        assert!(body.contains(REDACTED), "{body}");
    }

    /// A layer key whose answer was lost is settled by the sweeper from Stripe: its recorded
    /// answer, replayed through the layer, holds no secret.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_sweepers_answer_for_a_layer_key_is_masked() {
        let fake = FakeStripe::start().await.unwrap();
        let stripe = stripe(&fake);
        let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
        store.migrate().await.unwrap();
        let store: Arc<dyn Store> = Arc::new(store);
        let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(300));
        let app = app(idem, stripe.clone());
        fake.faults().lose_next_response();
        let lost = send(&app, "s-1").await;
        assert_eq!(lost.status, StatusCode::BAD_GATEWAY, "{}", lost.body);
        tokio::time::sleep(Duration::from_millis(350)).await;
        let report = Sweeper::new(store.clone(), Providers::new().with(stripe))
            .run_once()
            .await
            .unwrap();
        assert_eq!(report.done, 1, "{report:?}");
        let again = send(&app, "s-1").await;
        assert!(again.replayed, "{}", again.body);
        assert!(!again.body.contains(SECRET_MARK), "{}", again.body);
        assert!(again.body.contains(REDACTED), "{}", again.body);
        assert_eq!(fake.ledger().len(), 1);
    }
}
