//! The axum Idempotency-Key layer, driven with `tower::ServiceExt::oneshot` on a Router: every
//! status of the semantics table, quoted and bare keys, replays, scoping and pass-through.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use http_body_util::BodyExt;
use idemflow::axum::{IdempotencyContext, IdempotencyLayer, NothingHappened, ScopeSource};
use idemflow::store::sqlite::SqliteStore;
use idemflow::{Idempotency, KeyState, Store};
use serde_json::{Value, json};
use tokio::sync::Notify;
use tower::{Layer, ServiceExt};

#[derive(Default)]
struct Counters {
    runs: AtomicUsize,
    flaky: AtomicUsize,
    keys: std::sync::Mutex<Vec<String>>,
    started: Notify,
    release: Notify,
}

type App = Arc<Counters>;

async fn create(State(c): State<App>, ctx: IdempotencyContext, body: Bytes) -> Response {
    let n = c.runs.fetch_add(1, Ordering::SeqCst) + 1;
    c.keys.lock().unwrap().push(ctx.provider_key().to_owned());
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    (
        StatusCode::CREATED,
        [
            ("content-type", "application/json"),
            ("location", &format!("/payments/{n}")),
            ("x-request-cost", "7"),
        ],
        json!({"payment": n, "key": ctx.key().as_str(), "scope": ctx.scope().as_str(),
               "echo": body, "attempt": ctx.attempt()})
        .to_string(),
    )
        .into_response()
}

async fn declined(State(c): State<App>) -> Response {
    c.runs.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::PAYMENT_REQUIRED,
        [("content-type", "application/json")],
        r#"{"error":"card_declined"}"#,
    )
        .into_response()
}

async fn slow(State(c): State<App>) -> Response {
    c.runs.fetch_add(1, Ordering::SeqCst);
    c.started.notify_one();
    c.release.notified().await;
    (StatusCode::CREATED, "slow done").into_response()
}

async fn boom(State(c): State<App>) -> Response {
    c.runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::BAD_GATEWAY, "provider timed out").into_response()
}

async fn flaky(State(c): State<App>, ctx: IdempotencyContext) -> Response {
    let n = c.flaky.fetch_add(1, Ordering::SeqCst) + 1;
    c.keys.lock().unwrap().push(ctx.provider_key().to_owned());
    if n == 1 {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Extension(NothingHappened),
            "rate limited upstream",
        )
            .into_response()
    } else {
        (
            StatusCode::CREATED,
            format!("ok on attempt {}", ctx.attempt()),
        )
            .into_response()
    }
}

async fn optional(ctx: Option<IdempotencyContext>) -> String {
    match ctx {
        Some(c) => format!("protected {}", c.key()),
        None => "unprotected".to_owned(),
    }
}

fn account_header() -> ScopeSource {
    ScopeSource::header(HeaderName::from_static("x-account-id"))
}

fn fixed(scope: &str) -> ScopeSource {
    ScopeSource::fixed(scope.parse().unwrap())
}

async fn store() -> Arc<SqliteStore> {
    let s = SqliteStore::connect("sqlite::memory:").await.unwrap();
    s.migrate().await.unwrap();
    Arc::new(s)
}

fn router(
    store: Arc<SqliteStore>,
    counters: App,
    layer: impl Fn(IdempotencyLayer) -> IdempotencyLayer,
) -> Router {
    let idem = Idempotency::new(store).lease(Duration::from_secs(30));
    let layer = layer(IdempotencyLayer::new(idem, account_header()).max_body_bytes(1024));
    Router::new()
        .route("/payments", post(create).get(|| async { "listing" }))
        .route("/declined", post(declined))
        .route("/slow", post(slow))
        .route("/boom", post(boom))
        .route("/flaky", post(flaky))
        .route("/ping", get(|| async { "pong" }))
        .layer(layer)
        .with_state(counters)
}

async fn app() -> (Router, App, Arc<SqliteStore>) {
    let s = store().await;
    let c = App::default();
    (router(s.clone(), c.clone(), |l| l), c, s)
}

/// An answer of the router, read whole (also used by `context_call`).
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Answer {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
    /// The problem's `type`, after checking it is problem details with its status and title.
    pub(crate) fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{:?}",
            self.body
        );
        let p = self.json();
        assert_eq!(p["status"], self.status.as_u16());
        assert!(p["title"].is_string());
        p["type"].as_str().unwrap().to_owned()
    }
}

pub(crate) async fn send(app: &Router, req: Request<Body>) -> Answer {
    let resp = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

fn post_req(path: &str, key: Option<&str>, account: &str, body: &str) -> Request<Body> {
    let mut b = Request::post(path)
        .header("content-type", "application/json")
        .header("x-account-id", account);
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

const BODY: &str = r#"{"amount": 500, "currency": "usd"}"#;

#[tokio::test]
async fn missing_key_is_400_problem() {
    let (app, c, _) = app().await;
    let a = send(&app, post_req("/payments", None, "acct_1", BODY)).await;
    assert_eq!(a.status, 400);
    assert_eq!(a.problem_type(), "urn:idemflow:problem:key-missing");
    assert!(
        a.json()["detail"]
            .as_str()
            .unwrap()
            .contains("idempotency-key")
    );
    assert_eq!(c.runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn malformed_keys_are_400_with_the_reason() {
    let (app, c, _) = app().await;
    let long = "k".repeat(256);
    let quoted_long = format!("\"{long}\"");
    let cases: &[(&str, &str)] = &[
        ("\"abc", "closing double quote"),
        ("\"a\\nb\"", "escapes"),
        ("\"a\";p=1", "follow the closing"),
        ("\"\"", "empty"),
        ("ab\"c", "bare idempotency key"),
        ("a b", "0x20"),
        ("\"a b\"", "0x20"),
        (&long, "256 bytes"),
        (&quoted_long, "256 bytes"),
    ];
    for (value, reason) in cases {
        let a = send(&app, post_req("/payments", Some(value), "acct_1", BODY)).await;
        assert_eq!(a.status, 400, "{value}");
        assert_eq!(a.problem_type(), "urn:idemflow:problem:key-malformed");
        let detail = a.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(reason), "{value}: {detail}");
    }
    // A non-visible byte (obs-text) and a repeated header.
    let mut req = post_req("/payments", None, "acct_1", BODY);
    req.headers_mut().insert(
        "idempotency-key",
        axum::http::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
    );
    let a = send(&app, req).await;
    assert_eq!(a.status, 400);
    assert!(a.json()["detail"].as_str().unwrap().contains("0xE9"));
    let mut req = post_req("/payments", Some("k1"), "acct_1", BODY);
    req.headers_mut()
        .append("idempotency-key", "k2".parse().unwrap());
    let a = send(&app, req).await;
    assert_eq!(a.status, 400);
    assert!(
        a.json()["detail"]
            .as_str()
            .unwrap()
            .contains("more than once")
    );
    assert_eq!(c.runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn quoted_and_bare_keys_are_the_same_key() {
    let (app, c, _) = app().await;
    let first = send(
        &app,
        post_req("/payments", Some("\"8e03-40d5\""), "acct_1", BODY),
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.json()["key"], "8e03-40d5");
    let bare = send(
        &app,
        post_req("/payments", Some("8e03-40d5"), "acct_1", BODY),
    )
    .await;
    assert_eq!(bare.status, 201);
    assert_eq!(bare.header("idempotent-replayed"), Some("true"));
    assert_eq!(bare.body, first.body);
    // Escapes name the unescaped key.
    let esc = send(
        &app,
        post_req("/payments", Some(r#""a\"b\\c""#), "acct_1", BODY),
    )
    .await;
    assert_eq!(esc.json()["key"], r#"a"b\c"#);
    let esc_bare = send(
        &app,
        post_req("/payments", Some(r#"a"b\c"#), "acct_1", BODY),
    )
    .await;
    assert_eq!(esc_bare.status, 400, "a bare key may not hold quotes");
    assert_eq!(c.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn replay_returns_stored_status_headers_and_body() {
    let (app, c, _) = app().await;
    let first = send(
        &app,
        post_req("/payments", Some("k-replay"), "acct_1", BODY),
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("x-request-cost"), Some("7"));
    assert_eq!(first.header("idempotent-replayed"), None);
    // Member order and whitespace do not change the request.
    let same = r#"{ "currency":"usd","amount":500 }"#;
    for _ in 0..3 {
        let again = send(
            &app,
            post_req("/payments", Some("k-replay"), "acct_1", same),
        )
        .await;
        assert_eq!(again.status, 201);
        assert_eq!(again.body, first.body, "byte for byte");
        assert_eq!(again.header("content-type"), Some("application/json"));
        assert_eq!(again.header("location"), first.header("location"));
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.header("x-request-cost"), None, "not a stored header");
    }
    assert_eq!(c.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn stored_headers_are_configurable() {
    let s = store().await;
    let c = App::default();
    let app = router(s, c.clone(), |l| {
        l.stored_headers(
            ["Content-Type", "X-Request-Cost"]
                .map(|h| HeaderName::from_bytes(h.as_bytes()).unwrap()),
        )
    });
    let first = send(&app, post_req("/payments", Some("k-h"), "acct_1", BODY)).await;
    let again = send(&app, post_req("/payments", Some("k-h"), "acct_1", BODY)).await;
    assert_eq!(again.header("x-request-cost"), Some("7"));
    assert_eq!(again.header("location"), None);
    assert_eq!(again.body, first.body);
}

#[tokio::test]
async fn same_key_other_request_is_422() {
    let (app, c, _) = app().await;
    let first = send(&app, post_req("/payments", Some("k-mis"), "acct_1", BODY)).await;
    assert_eq!(first.status, 201);
    let other_body = send(
        &app,
        post_req(
            "/payments",
            Some("k-mis"),
            "acct_1",
            r#"{"amount": 900, "currency": "usd"}"#,
        ),
    )
    .await;
    assert_eq!(other_body.status, 422);
    assert_eq!(other_body.problem_type(), "urn:idemflow:problem:key-reused");
    let other_query = send(
        &app,
        post_req("/payments?expand=1", Some("k-mis"), "acct_1", BODY),
    )
    .await;
    assert_eq!(other_query.status, 422);
    let other_path = send(&app, post_req("/declined", Some("k-mis"), "acct_1", BODY)).await;
    assert_eq!(other_path.status, 422);
    // A non-JSON body is compared by its bytes.
    let raw = send(
        &app,
        post_req("/payments", Some("k-raw"), "acct_1", "plain text"),
    )
    .await;
    assert_eq!(raw.status, 201);
    let raw2 = send(
        &app,
        post_req("/payments", Some("k-raw"), "acct_1", "plain text!"),
    )
    .await;
    assert_eq!(raw2.status, 422);
    assert_eq!(c.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn in_flight_duplicate_is_409_with_retry_after() {
    let (app, c, _) = app().await;
    let first = {
        let app = app.clone();
        tokio::spawn(
            async move { send(&app, post_req("/slow", Some("k-slow"), "acct_1", "{}")).await },
        )
    };
    c.started.notified().await;
    let dup = send(&app, post_req("/slow", Some("k-slow"), "acct_1", "{}")).await;
    assert_eq!(dup.status, 409);
    assert_eq!(dup.problem_type(), "urn:idemflow:problem:request-in-flight");
    let after: u64 = dup.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&after), "{after}");
    c.release.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let replay = send(&app, post_req("/slow", Some("k-slow"), "acct_1", "{}")).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(c.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn handler_5xx_is_not_stored_and_the_key_waits_for_the_sweeper() {
    let (app, c, store) = app().await;
    let first = send(&app, post_req("/boom", Some("k-boom"), "acct_1", "{}")).await;
    assert_eq!(first.status, 502, "the handler's own answer");
    assert_eq!(first.body, "provider timed out");
    assert!(first.header("retry-after").is_some());
    let retry = send(&app, post_req("/boom", Some("k-boom"), "acct_1", "{}")).await;
    assert_eq!(retry.status, 503);
    assert_eq!(retry.problem_type(), "urn:idemflow:problem:outcome-unknown");
    assert!(retry.header("retry-after").is_some());
    assert_eq!(c.runs.load(Ordering::SeqCst), 1, "never run twice");
    let id = idemflow::KeyId::new("acct_1".parse().unwrap(), "k-boom".parse().unwrap());
    let rec = store.get(&id).await.unwrap().unwrap();
    assert_eq!(rec.state, KeyState::Processing);
    assert_eq!(rec.provider, None);
}

#[tokio::test]
async fn retryable_marker_lets_the_retry_run_again() {
    let (app, c, _) = app().await;
    let first = send(&app, post_req("/flaky", Some("k-flaky"), "acct_1", "{}")).await;
    assert_eq!(first.status, 503);
    assert_eq!(first.body, "rate limited upstream");
    let second = send(&app, post_req("/flaky", Some("k-flaky"), "acct_1", "{}")).await;
    assert_eq!(second.status, 201);
    assert_eq!(second.body, "ok on attempt 2");
    let third = send(&app, post_req("/flaky", Some("k-flaky"), "acct_1", "{}")).await;
    assert_eq!(third.header("idempotent-replayed"), Some("true"));
    assert_eq!(c.flaky.load(Ordering::SeqCst), 2);
    let keys = c.keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1], "the same provider key on every attempt");
    assert!(keys[0].starts_with("idf_"));
}

#[tokio::test]
async fn permanent_failure_4xx_is_stored_and_replayed() {
    let (app, c, _) = app().await;
    let first = send(&app, post_req("/declined", Some("k-dec"), "acct_1", BODY)).await;
    assert_eq!(first.status, 402);
    let again = send(&app, post_req("/declined", Some("k-dec"), "acct_1", BODY)).await;
    assert_eq!(again.status, 402);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(c.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn body_over_the_cap_is_413() {
    let (app, c, _) = app().await;
    let big = format!(r#"{{"memo": "{}"}}"#, "x".repeat(2000));
    let a = send(&app, post_req("/payments", Some("k-big"), "acct_1", &big)).await;
    assert_eq!(a.status, 413);
    assert_eq!(a.problem_type(), "urn:idemflow:problem:body-too-large");
    assert_eq!(c.runs.load(Ordering::SeqCst), 0);
    // Nothing was claimed: the key is free for a smaller request.
    let ok = send(&app, post_req("/payments", Some("k-big"), "acct_1", BODY)).await;
    assert_eq!(ok.status, 201);
}

#[tokio::test]
async fn json_body_with_duplicate_member_names_is_400() {
    let (app, c, store) = app().await;
    let dup = r#"{"amount": 1, "currency": "usd", "amount": 500}"#;
    let a = send(&app, post_req("/payments", Some("k-dup"), "acct_1", dup)).await;
    assert_eq!(a.status, 400);
    assert_eq!(a.problem_type(), "urn:idemflow:problem:body-duplicate-key");
    assert!(a.json()["detail"].as_str().unwrap().contains("amount"));
    assert_eq!(c.runs.load(Ordering::SeqCst), 0);
    // Nothing was claimed; the last-wins reading of the body is not a replay of it either.
    let id = idemflow::KeyId::new(
        idemflow::key::Scope::new("acct_1").unwrap(),
        idemflow::key::IdempotencyKey::new("k-dup").unwrap(),
    );
    assert!(store.get(&id).await.unwrap().is_none());
    let ok = send(&app, post_req("/payments", Some("k-dup"), "acct_1", BODY)).await;
    assert_eq!(ok.status, 201);
    let again = send(&app, post_req("/payments", Some("k-dup"), "acct_1", dup)).await;
    assert_eq!(again.status, 400);
    assert_eq!(c.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn scopes_are_separate() {
    let (app, c, _) = app().await;
    let a = send(&app, post_req("/payments", Some("shared"), "acct_a", BODY)).await;
    let b = send(&app, post_req("/payments", Some("shared"), "acct_b", BODY)).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(b.header("idempotent-replayed"), None);
    assert_ne!(a.json()["payment"], b.json()["payment"]);
    assert_eq!(b.json()["scope"], "acct_b");
    // Another scope's different body is not a mismatch either.
    let b2 = send(&app, post_req("/payments", Some("shared2"), "acct_b", "{}")).await;
    let a2 = send(&app, post_req("/payments", Some("shared2"), "acct_a", BODY)).await;
    assert_eq!(
        (b2.status, a2.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(c.runs.load(Ordering::SeqCst), 4);
    let keys = c.keys.lock().unwrap().clone();
    assert_ne!(keys[0], keys[1], "provider keys differ per scope");
    // No scope header: refused before anything is claimed.
    let mut req = post_req("/payments", Some("k"), "x", BODY);
    req.headers_mut().remove("x-account-id");
    let none = send(&app, req).await;
    assert_eq!(none.status, 400);
    assert_eq!(none.problem_type(), "urn:idemflow:problem:scope-missing");
}

#[tokio::test]
async fn unprotected_methods_and_optional_keys_pass_through() {
    let (app, c, _) = app().await;
    let get = send(&app, Request::get("/ping").body(Body::empty()).unwrap()).await;
    assert_eq!((get.status, &get.body[..]), (StatusCode::OK, &b"pong"[..]));
    let list = send(&app, Request::get("/payments").body(Body::empty()).unwrap()).await;
    assert_eq!(list.status, 200);

    let s = store().await;
    let idem = Idempotency::new(s);
    let opt = Router::new()
        .route("/opt", post(optional))
        .layer(IdempotencyLayer::new(idem, fixed("default")).key_required(false));
    let a = send(&opt, Request::post("/opt").body(Body::empty()).unwrap()).await;
    assert_eq!(a.body, "unprotected");
    let b = send(
        &opt,
        Request::post("/opt")
            .header("idempotency-key", "\"o1\"")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(b.body, "protected o1");
    assert_eq!(c.runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn store_failure_is_500_problem() {
    let (app, c, store) = app().await;
    store.writer_pool().close().await;
    let a = send(&app, post_req("/payments", Some("k-db"), "acct_1", BODY)).await;
    assert_eq!(a.status, 500);
    assert_eq!(a.problem_type(), "urn:idemflow:problem:store-error");
    assert_eq!(
        c.runs.load(Ordering::SeqCst),
        0,
        "fails closed: nothing runs"
    );
}

#[tokio::test]
async fn inner_service_errors_pass_through() {
    let s = store().await;
    let layer = IdempotencyLayer::new(Idempotency::new(s.clone()), fixed("default"));
    let svc = layer.layer(tower::service_fn(|_req: Request<Body>| async {
        Err::<Response, _>("inner failed")
    }));
    let err = svc
        .oneshot(
            Request::post("/x")
                .header("idempotency-key", "k-err")
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(err, "inner failed");
    let id = idemflow::KeyId::new("default".parse().unwrap(), "k-err".parse().unwrap());
    let rec = s.get(&id).await.unwrap().unwrap();
    assert_eq!(rec.state, KeyState::Processing, "left for the sweeper");
    assert_eq!(rec.operation, "POST:/x");
}

#[tokio::test]
async fn stored_request_provider_and_operation_are_recorded() {
    let s = store().await;
    let idem = Idempotency::new(s.clone());
    let stripe = idemflow::conformance::FakeProvider::keyed("stripe", Duration::from_secs(3600));
    let layer = IdempotencyLayer::new(idem, fixed("default"))
        .provider(stripe.as_ref())
        .operation("payments.create")
        .stored_request(|_parts, body: &Bytes| {
            let v: Value = serde_json::from_slice(body).map_err(|_| StatusCode::BAD_REQUEST)?;
            if v["amount"].as_u64().unwrap_or(0) == 0 {
                return Err(StatusCode::BAD_REQUEST);
            }
            Ok(json!({"amount": v["amount"], "currency": "usd"}))
        });
    let app = Router::new()
        .route(
            "/p",
            post(|ctx: IdempotencyContext| async move { ctx.request().to_string() }),
        )
        .layer(layer);
    let bad = send(&app, post_req("/p", Some("k-sr"), "a", r#"{"amount": 0}"#)).await;
    assert_eq!(bad.status, 400);
    // The refusal was not stored: the corrected request may reuse the key.
    let ok = send(
        &app,
        post_req("/p", Some("k-sr"), "a", r#"{"amount": 5, "note": "x"}"#),
    )
    .await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.body, r#"{"amount":5,"currency":"usd"}"#);
    let id = idemflow::KeyId::new("default".parse().unwrap(), "k-sr".parse().unwrap());
    let rec = s.get(&id).await.unwrap().unwrap();
    assert_eq!(rec.provider.as_deref(), Some("stripe"));
    assert_eq!(rec.operation, "payments.create");
    assert_eq!(
        rec.request.as_deref(),
        Some(r#"{"amount":5,"currency":"usd"}"#)
    );
}

/// Regression (issue 11, bug 9): the layer copied the executor's `stored_headers` as given and
/// compared them case-sensitively with the (lowercase) response header names, so
/// `stored_headers: ["Content-Type"]` stored no header at all and replays lost `content-type`
/// and `location`.
#[tokio::test]
async fn executor_stored_headers_are_matched_case_insensitively() {
    let s = store().await;
    let c = App::default();
    let idem = Idempotency::new(s)
        .stored_headers(Some(vec!["Content-Type".to_owned(), "Location".to_owned()]));
    let app = Router::new()
        .route("/payments", post(create))
        .layer(IdempotencyLayer::new(idem, account_header()))
        .with_state(c.clone());
    let first = send(&app, post_req("/payments", Some("k-case"), "acct_1", BODY)).await;
    assert_eq!(first.status, 201);
    let again = send(&app, post_req("/payments", Some("k-case"), "acct_1", BODY)).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.header("content-type"), Some("application/json"));
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(again.header("x-request-cost"), None, "not a stored header");
    assert_eq!(again.body, first.body);
    assert_eq!(c.runs.load(Ordering::SeqCst), 1);
}

/// Regression (issue 10): `scope_from_header(&'static str)` went through
/// `HeaderName::from_static`, which panics on the mixed-case `X-Account-Id` its own docs named.
/// It now takes a `HeaderName`; one built from any case works, an invalid one is a typed error.
#[tokio::test]
async fn scope_header_named_in_mixed_case_works() {
    let s = store().await;
    let c = App::default();
    let name = HeaderName::try_from("X-Account-Id").expect("a valid header name");
    assert!(
        HeaderName::try_from("X Account").is_err(),
        "typed error, no panic"
    );
    let app = Router::new()
        .route("/payments", post(create))
        .layer(IdempotencyLayer::new(
            Idempotency::new(s),
            ScopeSource::header(name),
        ))
        .with_state(c.clone());
    let first = send(&app, post_req("/payments", Some("k-mixed"), "acct_9", BODY)).await;
    assert_eq!(first.status, 201);
    let body: Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(body["scope"], "acct_9");
    let again = send(&app, post_req("/payments", Some("k-mixed"), "acct_9", BODY)).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(c.runs.load(Ordering::SeqCst), 1);
}

/// Issue 11, finding 2, through the layer: the first run's outcome is unknown (a 502 after
/// sending); a retry takes the key over and the handler marks its answer `NothingHappened` (a
/// 429 upstream). The first run may have acted, so the key must not become retryable: it stays
/// for the sweeper and a third retry does not run the handler again.
#[tokio::test]
async fn retryable_marker_after_an_unknown_run_does_not_make_the_key_retryable() {
    let s = store().await;
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let r = runs.clone();
    let handler = move || {
        let r = r.clone();
        async move {
            if r.fetch_add(1, Ordering::SeqCst) == 0 {
                (StatusCode::BAD_GATEWAY, "provider timed out").into_response()
            } else {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    Extension(NothingHappened),
                    "rate limited upstream",
                )
                    .into_response()
            }
        }
    };
    let idem = Idempotency::new(s.clone())
        .lease(Duration::from_secs(30))
        .retry_takeover_window(Some(Duration::from_secs(3600)));
    let app = Router::new()
        .route("/acted", post(handler))
        .layer(IdempotencyLayer::new(idem, account_header()));
    let first = send(&app, post_req("/acted", Some("k-acted"), "acct_1", "{}")).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    let second = send(&app, post_req("/acted", Some("k-acted"), "acct_1", "{}")).await;
    assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the retry took the key over"
    );
    let id = idemflow::KeyId::new("acct_1".parse().unwrap(), "k-acted".parse().unwrap());
    let rec = s.get(&id).await.unwrap().unwrap();
    assert_eq!(rec.state, KeyState::Processing, "must not become retryable");
    let _third = send(&app, post_req("/acted", Some("k-acted"), "acct_1", "{}")).await;
    let rec = s.get(&id).await.unwrap().unwrap();
    assert_eq!(rec.state, KeyState::Processing);
}

/// A server paused past its lease between the claim and the handler (a long GC pause, a
/// suspended VM) runs nothing when it wakes: the layer checks `may_send` before the handler, as
/// `Idempotency::call` does before the provider call. The key is left retryable (nothing ran) and
/// the client's retry runs the handler once.
#[tokio::test]
async fn a_claim_answered_after_its_lease_runs_no_handler() {
    let inner = store().await;
    let lease = Duration::from_millis(300);
    let paused: Arc<dyn Store> = Arc::new(
        idemflow::conformance::FaultyStore::new(inner.clone())
            .answer_claims_late(lease + Duration::from_millis(200)),
    );
    let c = App::default();
    let layer = IdempotencyLayer::new(Idempotency::new(paused).lease(lease), account_header());
    let slow_app = Router::new()
        .route("/payments", post(create))
        .layer(layer)
        .with_state(c.clone());
    let a = send(
        &slow_app,
        post_req("/payments", Some("k-paused"), "acct_1", BODY),
    )
    .await;
    assert!(a.status.is_server_error(), "{:?} {:?}", a.status, a.body);
    assert_eq!(c.runs.load(Ordering::SeqCst), 0, "the handler must not run");
    let id = idemflow::KeyId::new(
        idemflow::key::Scope::new("acct_1").unwrap(),
        idemflow::key::IdempotencyKey::new("k-paused").unwrap(),
    );
    let row = inner.get(&id).await.unwrap().expect("key row");
    assert_eq!(row.state, KeyState::Failed { retryable: true });

    let app = router(inner, c.clone(), |l| l);
    let retry = send(
        &app,
        post_req("/payments", Some("k-paused"), "acct_1", BODY),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(c.runs.load(Ordering::SeqCst), 1);
}

/// The authenticated caller, as an authentication layer in front of the idempotency layer
/// records it.
#[derive(Clone)]
struct Principal(String);

/// Two tenants sending the same key with the same body each get their own answer: the scope is
/// the authenticated principal, never one shared default.
#[tokio::test]
async fn tenants_with_the_same_key_and_body_never_share_an_answer() {
    let s = store().await;
    let c = App::default();
    let auth = axum::middleware::map_request(|mut req: Request<Body>| async move {
        let who = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::to_owned);
        if let Some(who) = who {
            req.extensions_mut().insert(Principal(who));
        }
        req
    });
    // The scope is the principal the authentication layer (outside this one) recorded.
    let layer = IdempotencyLayer::new(
        Idempotency::new(s),
        ScopeSource::from_fn(|parts: &axum::http::request::Parts| {
            parts
                .extensions
                .get::<Principal>()
                .map(|p| p.0.clone())
                .ok_or(StatusCode::UNAUTHORIZED)
        }),
    );
    let app = Router::new()
        .route("/payments", post(create))
        .layer(layer)
        .layer(auth)
        .with_state(c.clone());
    let as_tenant = |tenant: &str| {
        Request::post("/payments")
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {tenant}"))
            .header("idempotency-key", "1")
            .body(Body::from(BODY))
            .unwrap()
    };
    let a = send(&app, as_tenant("tenant-a")).await;
    let b = send(&app, as_tenant("tenant-b")).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(b.header("idempotent-replayed"), None, "B got A's answer");
    assert_ne!(b.header("location"), a.header("location"));
    assert_eq!(c.runs.load(Ordering::SeqCst), 2, "B's handler ran");
    // Each tenant's retry replays its own answer.
    let b_again = send(&app, as_tenant("tenant-b")).await;
    assert_eq!(b_again.header("idempotent-replayed"), Some("true"));
    assert_eq!(b_again.body, b.body);
    assert_eq!(c.runs.load(Ordering::SeqCst), 2);
    // No principal: the scope function's refusal, nothing claimed.
    let mut anonymous = as_tenant("x");
    anonymous.headers_mut().remove("authorization");
    assert_eq!(send(&app, anonymous).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(c.runs.load(Ordering::SeqCst), 2);
}

/// A scope header sent twice is refused like a repeated key header: an authentication layer
/// that appends its `X-Account-Id` instead of replacing the client's must not let the client's
/// value (`victim`) win.
#[tokio::test]
async fn a_repeated_scope_header_is_refused() {
    let (app, c, _) = app().await;
    let victim = send(&app, post_req("/payments", Some("k-dup"), "victim", BODY)).await;
    assert_eq!(victim.status, StatusCode::CREATED);
    let mut req = post_req("/payments", Some("k-dup"), "victim", BODY);
    req.headers_mut()
        .append("x-account-id", "attacker".parse().unwrap());
    let a = send(&app, req).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{:?}", a.body);
    assert_eq!(a.problem_type(), "urn:idemflow:problem:scope-invalid");
    let detail = a.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("more than once"), "{detail}");
    assert_eq!(c.runs.load(Ordering::SeqCst), 1);
}

/// `Idempotent-Replayed` means idemflow replayed a stored answer, nothing else: a handler's own
/// (e.g. forwarded from a provider that replayed its answer to a retry) is neither given to the
/// first caller nor stored, even when `stored_headers` names it.
#[tokio::test]
async fn the_replay_marker_is_idemflows_alone() {
    let s = store().await;
    let forwarded = || async {
        (
            StatusCode::OK,
            [
                ("content-type", "application/json"),
                ("idempotent-replayed", "true"),
            ],
            r#"{"id":"pi_1"}"#,
        )
            .into_response()
    };
    let layer = IdempotencyLayer::new(Idempotency::new(s.clone()), account_header())
        .stored_headers(["content-type", "idempotent-replayed"].map(HeaderName::from_static));
    let app = Router::new()
        .route("/forwarded", post(forwarded))
        .layer(layer);
    let first = send(&app, post_req("/forwarded", Some("k-fw"), "acct_1", "{}")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        first.header("idempotent-replayed"),
        None,
        "the first answer is no replay"
    );
    let id = idemflow::KeyId::new("acct_1".parse().unwrap(), "k-fw".parse().unwrap());
    let row = s.get(&id).await.unwrap().unwrap();
    assert_eq!(
        row.response.unwrap().headers(),
        [("content-type".to_owned(), "application/json".to_owned())]
    );
    let again = send(&app, post_req("/forwarded", Some("k-fw"), "acct_1", "{}")).await;
    assert_eq!(
        again.headers.get_all("idempotent-replayed").iter().count(),
        1,
        "{:?}",
        again.headers
    );
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
}
