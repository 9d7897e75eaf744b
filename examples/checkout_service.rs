//! A checkout service: `POST /orders` is a **workflow** of two steps behind the idemflow layer:
//! charge the card (Stripe), then email the receipt (Resend). A retried order is answered from
//! the stored result; a crash between or during the steps never charges or emails twice: the
//! retry (or this process's own sweeper, which has a resumer for `checkout`) replays the
//! finished step and runs the rest (`docs/workflows.md`).
//!
//! ```text
//! STRIPE_API_KEY=sk_test_... RESEND_API_KEY=re_... \
//!   cargo run --example checkout_service --features axum,http
//! curl -i localhost:3000/orders -H 'Idempotency-Key: "order-8e03978e"' -H 'X-Account-Id: acct_1' \
//!      -H 'content-type: application/json' \
//!      -d '{"amount": 1500, "currency": "usd", "payment_method": "pm_card_visa", "email": "ana@example.org"}'
//! ```
//!
//! Environment: `STRIPE_API_KEY`, `RESEND_API_KEY` (required); `STRIPE_API_BASE`,
//! `RESEND_API_BASE` (default: the providers' own); `DATABASE_URL` (default
//! `sqlite://checkout_service.db`); `LISTEN_ADDR` (default `127.0.0.1:3000`; port 0 picks one,
//! printed as `checkout_service listening on http://ADDR`); `RECEIPT_FROM` (default
//! `shop@example.com`).
//!
//! Answers: 201 `{"order", "payment", "receipt", "amount", "currency"}`; 402 when the card is
//! declined (stored and replayed; no receipt); 400 naming an invalid field; 409 / 422 / 503 from
//! the layer (`docs/http.md`). While a step's outcome is unknown the answer is 503 with
//! `Retry-After`; the sweeper settles the step from the provider and resumes the order.

// This file is also compiled into tests/services/checkout_service.rs, which uses only part of it.
#![allow(dead_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use idemflow::axum::{IdempotencyContext, IdempotencyLayer, NothingHappened, Problem, ScopeSource};
use idemflow::provider::{Resend, Stripe};
use idemflow::{Context, Idempotency, Outcome, Providers, StoredResponse, Sweeper, workflow::Step};
use serde_json::{Value, json};

/// The service's settings, from the environment.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where idemflow keeps its keys.
    pub database_url: String,
    /// Where to listen.
    pub listen_addr: String,
    /// Stripe's API base and secret key.
    pub stripe: (String, String),
    /// Resend's API base and key.
    pub resend: (String, String),
    /// The receipts' sender.
    pub receipt_from: String,
    /// The key lease (`None`: the library's default).
    pub lease: Option<Duration>,
}

impl Settings {
    /// Reads the environment; a missing key is an error naming it.
    pub fn from_env() -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let need = |name: &str| var(name).ok_or(format!("{name} is not set"));
        Ok(Self {
            database_url: var("DATABASE_URL")
                .unwrap_or_else(|| "sqlite://checkout_service.db".into()),
            listen_addr: var("LISTEN_ADDR").unwrap_or_else(|| "127.0.0.1:3000".into()),
            stripe: (
                var("STRIPE_API_BASE")
                    .unwrap_or_else(|| idemflow::provider::stripe::DEFAULT_BASE_URL.into()),
                need("STRIPE_API_KEY")?,
            ),
            resend: (
                var("RESEND_API_BASE")
                    .unwrap_or_else(|| idemflow::provider::resend::DEFAULT_BASE_URL.into()),
                need("RESEND_API_KEY")?,
            ),
            receipt_from: var("RECEIPT_FROM").unwrap_or_else(|| "shop@example.com".into()),
            lease: None,
        })
    }
}

/// What the checkout workflow needs: its providers and the receipts' sender.
#[derive(Debug)]
pub struct Shop {
    /// The card processor.
    pub stripe: Arc<Stripe>,
    /// The email provider.
    pub resend: Arc<Resend>,
    /// The receipts' sender.
    pub receipt_from: String,
}

impl Shop {
    /// The providers, for the sweeper.
    pub fn providers(&self) -> Providers {
        Providers::new()
            .with(self.stripe.clone())
            .with(self.resend.clone())
    }
}

/// Opens the store (running idemflow's migrations) and the providers.
pub async fn connect(
    settings: &Settings,
) -> Result<(Idempotency, Arc<Shop>), Box<dyn std::error::Error>> {
    let store = idemflow::store::connect(&settings.database_url).await?;
    store.migrate().await?;
    let mut idem = Idempotency::new(store);
    if let Some(lease) = settings.lease {
        idem = idem.lease(lease);
    }
    let shop = Shop {
        stripe: Arc::new(Stripe::with_base_url(
            &settings.stripe.0,
            settings.stripe.1.clone(),
        )?),
        resend: Arc::new(Resend::with_base_url(
            &settings.resend.0,
            settings.resend.1.clone(),
        )?),
        receipt_from: settings.receipt_from.clone(),
    };
    Ok((idem, Arc::new(shop)))
}

/// The checkout workflow: what the handler runs and what the sweeper's resumer runs. `ctx`
/// carries the stored order (see [`order_request`]).
pub async fn checkout(ctx: Context, shop: Arc<Shop>) -> Outcome {
    let order: Value = match serde_json::from_str(ctx.request()) {
        Ok(v) => v,
        Err(e) => return Outcome::unknown(format!("the stored order is not JSON: {e}")),
    };
    let steps = async {
        let charge = Step::new(
            "charge",
            &json!({"amount": order["amount"], "currency": order["currency"],
                    "payment_method": order["payment_method"], "confirm": true,
                    "metadata": {"order": order["order"]}}),
        )?;
        let paid = ctx.call_step(charge, &*shop.stripe).await?;
        let pi: Value = paid.response().body_json().unwrap_or(Value::Null);
        if paid.response().status() == 402 || pi["status"] != "succeeded" {
            // Declined: the order ends here, stored and replayed; no receipt.
            return Ok(Err(paid.into_response()));
        }
        let receipt = Step::new(
            "receipt",
            &json!({"from": shop.receipt_from, "to": [order["email"]],
                    "subject": format!("Receipt for order {}", order["order"].as_str().unwrap_or("")),
                    "text": format!("We charged {} {} ({}).", order["amount"], order["currency"], pi["id"])}),
        )?;
        let sent = ctx.call_step(receipt, &*shop.resend).await?;
        let email: Value = sent.response().body_json().unwrap_or(Value::Null);
        Ok::<_, idemflow::Error>(Ok(json!({
            "order": order["order"], "payment": pi["id"], "receipt": email["id"],
            "amount": order["amount"], "currency": order["currency"],
        })))
    };
    match steps.await {
        Ok(Ok(body)) => match StoredResponse::json(201, &body) {
            Ok(r) => Outcome::Succeeded(r),
            Err(e) => Outcome::unknown(format!("cannot encode the answer: {e}")),
        },
        Ok(Err(declined)) => Outcome::Rejected(
            StoredResponse::json(
                402,
                &json!({"error": "card_declined", "stripe": declined.body_json::<Value>().ok()}),
            )
            .unwrap_or_else(|_| StoredResponse::new(402)),
        ),
        Err(e) => Outcome::from_step_error(&e),
    }
}

fn invalid(field: &str, detail: impl Into<String>) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "invalid-request",
        format!("Invalid {field}"),
    )
    .detail(detail)
}

/// Validates the body and builds the order stored with the key (what the workflow reads on
/// every run, the resumer's included). The order id is the idempotency key.
fn order_request(parts: &Parts, body: &Bytes) -> Result<Value, Problem> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| invalid("body", format!("the body is not valid JSON: {e}")))?;
    let amount = v["amount"]
        .as_u64()
        .filter(|a| *a > 0)
        .ok_or_else(|| invalid("amount", "amount must be a positive integer (minor units)"))?;
    let currency = v["currency"]
        .as_str()
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_alphabetic()))
        .ok_or_else(|| invalid("currency", "currency must be a three-letter ISO code"))?
        .to_ascii_lowercase();
    let payment_method = v["payment_method"]
        .as_str()
        .filter(|p| p.starts_with("pm_"))
        .ok_or_else(|| invalid("payment_method", "payment_method must be pm_..."))?;
    let email = v["email"]
        .as_str()
        .filter(|e| e.contains('@') && e.len() <= 254)
        .ok_or_else(|| invalid("email", "email must be an email address"))?;
    let order = parts
        .headers
        .get("idempotency-key")
        .and_then(|k| k.to_str().ok())
        .map(|k| k.trim_matches('"').to_owned())
        .unwrap_or_default();
    Ok(
        json!({"order": order, "amount": amount, "currency": currency,
              "payment_method": payment_method, "email": email}),
    )
}

async fn create_order(State(shop): State<Arc<Shop>>, ctx: IdempotencyContext) -> Response {
    let json = |r: StoredResponse| {
        let (status, _, body) = r.into_parts();
        (
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            [("content-type", "application/json")],
            body,
        )
            .into_response()
    };
    match checkout(ctx.context().clone(), shop).await {
        Outcome::Succeeded(r) | Outcome::Rejected(r) => json(r),
        // Nothing happened (a step refused without acting): the retry runs it again.
        Outcome::Retryable { reason } => (
            Extension(NothingHappened),
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, "retry", "Retry the order")
                .detail(reason)
                .retry_after(Duration::from_secs(1)),
        )
            .into_response(),
        // Not stored: the order stays for the sweeper, which settles the step and resumes it.
        Outcome::Unknown { reason } => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "outcome-unknown",
            "The order is not finished yet",
        )
        .detail(reason)
        .retry_after(Duration::from_secs(5))
        .into_response(),
    }
}

/// The service: `POST /orders` behind the layer, as a workflow.
pub fn router(idem: Idempotency, shop: Arc<Shop>) -> Router {
    let scope = ScopeSource::header(HeaderName::from_static("x-account-id"));
    let layer = IdempotencyLayer::new(idem, scope)
        .operation("checkout")
        .workflow()
        .stored_request(order_request)
        .max_body_bytes(16 * 1024);
    Router::new()
        .route("/orders", post(create_order))
        .layer(layer)
        .with_state(shop)
}

/// This process's sweeper: settles stuck steps from Stripe and Resend and resumes stuck orders
/// with [`checkout`], so an order finishes even when its client never retries.
pub fn sweeper(idem: &Idempotency, shop: Arc<Shop>) -> Sweeper {
    let resume_shop = shop.clone();
    Sweeper::new(idem.store().clone(), shop.providers())
        .resumer("checkout", idem.clone(), move |ctx| {
            checkout(ctx, resume_shop.clone())
        })
        // A service's own sweeper checks its few stuck orders again soon (2 s, doubling up to a
        // minute) rather than the reconciler's 30 s: a client waiting on a lost answer gets its
        // final answer within seconds. Stripe and Resend are re-driven with the same key.
        .backoff(Duration::from_secs(2), Duration::from_secs(60))
}

/// What `main` runs: the store, the layer on `listen_addr` and the sweeper, until Ctrl-C.
pub async fn serve(settings: Settings) -> Result<(), Box<dyn std::error::Error>> {
    let (idem, shop) = connect(&settings).await?;
    let listener = tokio::net::TcpListener::bind(&settings.listen_addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", settings.listen_addr))?;
    println!(
        "checkout_service listening on http://{}",
        listener.local_addr()?
    );
    let sweeper = sweeper(&idem, shop.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sweeping = tokio::spawn(async move {
        sweeper
            .run(Duration::from_secs(2), async {
                let _ = stopped.await;
            })
            .await
    });
    axum::serve(listener, router(idem, shop))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    let _ = stop.send(());
    let _ = sweeping.await;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let settings = match Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("checkout_service: {e}");
            return ExitCode::from(2);
        }
    };
    match serve(settings).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("checkout_service: {e}");
            ExitCode::FAILURE
        }
    }
}
