//! A card-payment service: `POST /payments` behind the idemflow Idempotency-Key layer, charging
//! through the Stripe adapter. A retried payment is answered from the stored result and is never
//! charged twice, even when the service is killed mid-charge (run `idemflow reconcile --once`
//! with a config naming the `stripe` provider to settle what was in flight).
//!
//! ```text
//! STRIPE_API_KEY=sk_test_... cargo run --example card_service --features axum,http
//! curl -i localhost:3000/payments -H 'Idempotency-Key: "8e03978e-40d5"' -H 'X-Account-Id: acct_1' \
//!      -H 'content-type: application/json' \
//!      -d '{"amount": 500, "currency": "usd", "customer": "cus_123", "payment_method": "pm_card_visa"}'
//! ```
//!
//! Environment:
//! * `STRIPE_API_KEY` (required): the Stripe secret key.
//! * `STRIPE_API_BASE` (default `https://api.stripe.com`): another base, e.g. a fake Stripe.
//! * `DATABASE_URL` (default `sqlite://card_service.db`): where idemflow keeps its keys.
//! * `LISTEN_ADDR` (default `127.0.0.1:3000`; port 0 picks one). The bound address is printed
//!   as `card_service listening on http://ADDR`.
//! * `IDEMFLOW_LEASE_SECS` (default: the library's [`ExecutorConfig::lease`], 6 s, renewed every
//!   third of it, 2 s, while a charge runs): how long a key orphaned by a crash stays held before
//!   the sweeper may settle it.
//! * `IDEMFLOW_WAIT_IN_FLIGHT_MS` (default unset: off): how long a duplicate that arrives while
//!   the first request with its key is charging waits for that charge's answer (then answered
//!   as a replay) instead of getting 409 at once ([`Idempotency::wait_in_flight`]).
//!
//! [`ExecutorConfig::lease`]: idemflow::executor::ExecutorConfig::lease
//! [`Idempotency::wait_in_flight`]: idemflow::Idempotency::wait_in_flight
//!
//! Answers: 201 `{"payment_id", "provider_id", "status", "amount", "currency"}`; 402 with the
//! decline (stored and replayed); 400 naming the invalid field (not stored: fix the body and
//! retry with the same key); 400 / 409 / 422 / 503 from the layer (see `docs/http.md`).
//!
//! The payment id is derived from the Stripe PaymentIntent id, so an answer the sweeper recorded
//! from Stripe's own record renders the same as one the handler produced.

// This file is also compiled into tests/services/card_service.rs, which uses only part of it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idemflow::axum::{IdempotencyContext, IdempotencyLayer, Problem, ScopeSource};
use idemflow::provider::Stripe;
use idemflow::{Idempotency, Store};
use serde_json::{Map, Value, json};

/// The service's settings, from the environment.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where idemflow keeps its keys.
    pub database_url: String,
    /// Where to listen.
    pub listen_addr: String,
    /// Stripe's API base.
    pub stripe_base: String,
    /// The Stripe secret key.
    pub stripe_key: String,
    /// The key lease (`None`: the library's default, [`idemflow::executor::ExecutorConfig::lease`]).
    pub lease: Option<Duration>,
    /// How long a duplicate waits for the first request's answer (`None`: 409 at once).
    pub wait_in_flight: Option<Duration>,
}

impl Settings {
    /// Reads the environment; a missing `STRIPE_API_KEY` is an error naming it.
    pub fn from_env() -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let stripe_key = var("STRIPE_API_KEY").ok_or(
            "STRIPE_API_KEY is not set: export your Stripe secret key (sk_test_... or sk_live_...)",
        )?;
        let lease = match var("IDEMFLOW_LEASE_SECS") {
            None => None,
            Some(v) => Some(Duration::from_secs_f64(
                v.parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .ok_or(format!(
                        "IDEMFLOW_LEASE_SECS={v:?} is not a positive number"
                    ))?,
            )),
        };
        let wait_in_flight = match var("IDEMFLOW_WAIT_IN_FLIGHT_MS") {
            None => None,
            Some(v) => Some(Duration::from_millis(v.trim().parse::<u64>().map_err(
                |_| {
                    format!(
                        "IDEMFLOW_WAIT_IN_FLIGHT_MS={v:?} is not a whole number of milliseconds"
                    )
                },
            )?)),
        };
        Ok(Self {
            database_url: var("DATABASE_URL").unwrap_or_else(|| "sqlite://card_service.db".into()),
            listen_addr: var("LISTEN_ADDR").unwrap_or_else(|| "127.0.0.1:3000".into()),
            stripe_base: var("STRIPE_API_BASE")
                .unwrap_or_else(|| idemflow::provider::stripe::DEFAULT_BASE_URL.into()),
            stripe_key,
            lease,
            wait_in_flight,
        })
    }
}

/// Connects the store (running idemflow's migrations) and the Stripe adapter.
pub async fn connect(
    settings: &Settings,
) -> Result<(Idempotency, Arc<Stripe>), Box<dyn std::error::Error>> {
    // Any backend this build has: sqlite:, postgres://, mysql:// or redis://.
    let store = idemflow::store::connect(&settings.database_url).await?;
    store.migrate().await?;
    with_store(settings, store)
}

/// The executor over a store already open (with the settings' lease, else the library's
/// default) and the Stripe adapter.
pub fn with_store(
    settings: &Settings,
    store: Arc<dyn Store>,
) -> Result<(Idempotency, Arc<Stripe>), Box<dyn std::error::Error>> {
    let mut idem = Idempotency::new(store);
    if let Some(lease) = settings.lease {
        idem = idem.lease(lease);
    }
    idem = idem.wait_in_flight(settings.wait_in_flight);
    let stripe = Stripe::with_base_url(&settings.stripe_base, settings.stripe_key.clone())?;
    Ok((idem, Arc::new(stripe)))
}

/// The service: `POST /payments` behind the layer.
pub fn router(idem: Idempotency, stripe: Arc<Stripe>) -> Router {
    // In a real service the scope is the authenticated account (`ScopeSource::from_fn` over
    // what your authentication put in the request extensions); here a header stands for it.
    let scope = ScopeSource::header(HeaderName::from_static("x-account-id"));
    let layer = IdempotencyLayer::new(idem, scope)
        .operation("payments.create")
        // Stuck keys are settled by asking Stripe (re-sending the stored request, same key);
        // Stripe's `client_secret` is masked in what is stored and in the first answer alike.
        .provider(stripe.as_ref())
        .stored_request(payment_params)
        // Answers the sweeper recorded from Stripe are rendered like the handler's own.
        .replay_with(|_, stored| render(stored))
        .max_body_bytes(16 * 1024);
    Router::new()
        .route("/payments", post(create_payment))
        .layer(layer)
        .with_state(stripe)
}

fn invalid(field: &str, detail: impl Into<String>) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "invalid-request",
        format!("Invalid {field}"),
    )
    .detail(detail)
}

/// Validates the body and builds the Stripe PaymentIntent parameters stored with the key (what
/// the handler sends, and what the sweeper re-sends).
fn payment_params(parts: &Parts, body: &Bytes) -> Result<Value, Problem> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| invalid("body", format!("the body is not valid JSON: {e}")))?;
    let Value::Object(map) = v else {
        return Err(invalid("body", "the body must be a JSON object"));
    };
    for k in map.keys() {
        if !matches!(
            k.as_str(),
            "amount" | "currency" | "customer" | "payment_method"
        ) {
            return Err(invalid(k, format!("unknown field {k:?}")));
        }
    }
    let amount = map
        .get("amount")
        .and_then(Value::as_u64)
        .filter(|a| *a > 0)
        .ok_or_else(|| invalid("amount", "amount must be a positive integer (minor units)"))?;
    let currency = map
        .get("currency")
        .and_then(Value::as_str)
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_alphabetic()))
        .ok_or_else(|| invalid("currency", "currency must be a three-letter ISO code"))?
        .to_ascii_lowercase();
    let customer = map
        .get("customer")
        .and_then(Value::as_str)
        .filter(|c| c.starts_with("cus_") && c.len() <= 255)
        .ok_or_else(|| {
            invalid(
                "customer",
                "customer must be a Stripe customer id (cus_...)",
            )
        })?;
    let mut params = Map::new();
    params.insert("amount".into(), amount.into());
    params.insert("currency".into(), currency.into());
    params.insert("customer".into(), customer.into());
    match map.get("payment_method") {
        None | Some(Value::Null) => {}
        Some(Value::String(pm)) if pm.starts_with("pm_") => {
            params.insert("payment_method".into(), pm.clone().into());
        }
        Some(_) => {
            return Err(invalid(
                "payment_method",
                "payment_method must be a Stripe payment method id (pm_...)",
            ));
        }
    }
    if let Some(account) = parts
        .headers
        .get("x-account-id")
        .and_then(|v| v.to_str().ok())
    {
        params.insert("metadata".into(), json!({ "account": account }));
    }
    Ok(Value::Object(params))
}

async fn create_payment(State(stripe): State<Arc<Stripe>>, ctx: IdempotencyContext) -> Response {
    // The stored request, with the stored provider key: exactly what the sweeper would send.
    // No answer yet is a 503: `retryable` when Stripe surely did nothing (the retry runs again),
    // `outcome-unknown` when it may have charged (the sweeper asks Stripe).
    match ctx.call(stripe.as_ref()).await {
        Ok(answer) => render(answer).into_response(),
        Err(no_answer_yet) => no_answer_yet,
    }
}

fn payment_id(provider_id: &str) -> String {
    format!("pay_{}", provider_id.trim_start_matches("pi_"))
}

/// Renders Stripe's answer (a PaymentIntent, or a `card_error`) as this service's answer;
/// answers already rendered are returned unchanged.
pub fn render(stripe: idemflow::StoredResponse) -> idemflow::StoredResponse {
    let Ok(body) = stripe.body_json::<Value>() else {
        return stripe;
    };
    let json = |status: u16, v: Value| {
        idemflow::StoredResponse::json(status, &v)
            .unwrap_or_else(|_| idemflow::StoredResponse::new(500))
    };
    if (200..300).contains(&stripe.status()) && body["object"] == "payment_intent" {
        let id = body["id"].as_str().unwrap_or_default();
        let pay = payment_id(id);
        return json(
            201,
            json!({"payment_id": pay, "provider_id": id, "status": body["status"],
                   "amount": body["amount"], "currency": body["currency"]}),
        )
        .with_header("location", format!("/payments/{pay}"));
    }
    let err = &body["error"];
    if stripe.status() == 402 && err.is_object() {
        let pi = &err["payment_intent"];
        return json(
            402,
            json!({"error": "card_declined", "code": err["code"], "decline_code": err["decline_code"],
                   "message": err["message"], "provider_id": pi["id"],
                   "payment_id": pi["id"].as_str().map(payment_id)}),
        );
    }
    if (400..500).contains(&stripe.status()) && err.is_object() {
        let problem = json!({"type": "urn:card-service:problem:provider-rejected",
            "title": "The card processor rejected the payment", "status": 400,
            "detail": err["message"], "param": err["param"]});
        return idemflow::StoredResponse::from_parts(
            400,
            vec![("content-type".into(), "application/problem+json".into())],
            problem.to_string().into_bytes(),
        );
    }
    stripe
}

/// Binds `settings.listen_addr` and serves until Ctrl-C.
pub async fn serve(settings: Settings) -> Result<(), Box<dyn std::error::Error>> {
    let (idem, stripe) = connect(&settings).await?;
    let listener = tokio::net::TcpListener::bind(&settings.listen_addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", settings.listen_addr))?;
    let addr: SocketAddr = listener.local_addr()?;
    println!("card_service listening on http://{addr}");
    eprintln!(
        "card_service: keys in {}, Stripe at {}, lease {:?}",
        settings.database_url,
        settings.stripe_base,
        idem.config().lease
    );
    axum::serve(listener, router(idem, stripe))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let settings = match Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("card_service: {e}");
            return ExitCode::from(2);
        }
    };
    match serve(settings).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("card_service: {e}");
            ExitCode::FAILURE
        }
    }
}
