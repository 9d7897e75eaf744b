//! A one-commit Stripe webhook receiver: `POST /webhooks/stripe` verifies `Stripe-Signature`,
//! and a `payment_intent.succeeded` event records its order as paid in the service's own
//! `paid_orders` table, in the same transaction as the event's key
//! (`WebhookReceiver::stripe_atomic`, `docs/one-commit.md`). `GET /orders` answers
//! `[{"order": "ord_...", "payments": N, "amount": ...}, ...]`, so anyone can check from outside
//! that each payment was recorded once.
//!
//! ```text
//! STRIPE_WEBHOOK_SECRET=whsec_...           # required; several, comma-separated, while rotating
//! DATABASE_URL=sqlite://stripe_atomic.db    # default; a SQLite file (created if missing)
//! LISTEN_ADDR=127.0.0.1:3002                # default
//! cargo run --example stripe_atomic --features axum
//! stripe listen --forward-to localhost:3002/webhooks/stripe
//! stripe trigger payment_intent.succeeded --add payment_intent:metadata.order_id=ord_1
//! ```
//!
//! The row and the key commit together or not at all. A crash before the commit leaves
//! neither, so Stripe's redelivery records the payment once; after it, the redelivery is
//! answered from the key (200, `Idempotent-Replayed: true`) and writes nothing. A write that
//! fails rolls both back and answers 503, and Stripe delivers the event again later. The table
//! has no unique constraint on purpose: a second recording would show as `"payments": 2`.
//!
//! Other events, and a `payment_intent.succeeded` without `metadata.order_id`, are acknowledged
//! and write no row; their keys still commit, so they are answered as replays too.
//!
//! The writes run on the store's writer connection, inside its transaction. On SQLite they may
//! run more than once before the commit (the writer runs a batch again when another key's error
//! rolled it back), each time from nothing written, so they clone what they bind. On PostgreSQL
//! and MariaDB the writes take the same shape, given to `PostgresStore::atomic_phase` or
//! `MySqlStore::atomic_phase`.

// The tests include this file as a module (`tests/services/stripe_atomic.rs`), where `main` is
// unused.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use axum::{Json, http::StatusCode};
use idemflow::axum::webhook::{WebhookEvent, WebhookReceiver, acknowledgement};
use idemflow::provider::stripe_signature::StripeSignature;
use idemflow::store::sqlite::SqliteStore;
use idemflow::{Idempotency, Store};
use serde_json::{Value, json};
use sqlx::SqlitePool;

/// The service's settings, read from the environment.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The endpoint's signing secrets (`whsec_...`); the first signs, all are accepted.
    pub secrets: Vec<String>,
    /// A SQLite URL: idemflow's keys and the `paid_orders` table live in it.
    pub database_url: String,
    /// Where to listen.
    pub listen_addr: String,
}

impl Settings {
    /// Reads the environment; a missing `STRIPE_WEBHOOK_SECRET` is an error naming it.
    pub fn from_env() -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let secrets: Vec<String> = var("STRIPE_WEBHOOK_SECRET")
            .ok_or("STRIPE_WEBHOOK_SECRET is not set: export the endpoint's signing secret (whsec_...)")?
            .split(',')
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        Ok(Self {
            secrets,
            database_url: var("DATABASE_URL").unwrap_or_else(|| "sqlite://stripe_atomic.db".into()),
            listen_addr: var("LISTEN_ADDR").unwrap_or_else(|| "127.0.0.1:3002".into()),
        })
    }
}

/// The application's table. It lives in the keys' database: the writes reach it through the
/// store's transaction.
const PAID_ORDERS: &str = "CREATE TABLE IF NOT EXISTS paid_orders ( \
    id INTEGER PRIMARY KEY AUTOINCREMENT, \
    order_id TEXT NOT NULL, \
    payment_intent TEXT NOT NULL, \
    amount INTEGER NOT NULL, \
    currency TEXT NOT NULL, \
    event TEXT NOT NULL, \
    paid_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)";

/// The store (migrated, the `paid_orders` table created) and a pool for the service's reads.
pub async fn connect(
    settings: &Settings,
) -> Result<(SqliteStore, SqlitePool), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect(&settings.database_url).await?;
    store.migrate().await?;
    sqlx::query(PAID_ORDERS)
        .execute(store.writer_pool())
        .await?;
    let url = if settings.database_url.contains('?') {
        settings.database_url.clone()
    } else {
        format!("{}?mode=ro", settings.database_url)
    };
    let reads = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await?;
    Ok((store, reads))
}

/// What a `payment_intent.succeeded` event pays: its order, from `metadata.order_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    /// The application's order id.
    pub order_id: String,
    /// The PaymentIntent (`pi_...`).
    pub payment_intent: String,
    /// The amount received, in the currency's smallest unit.
    pub amount: i64,
    /// The currency (`eur`).
    pub currency: String,
}

impl Payment {
    /// The payment an event reports, if it is one this service records.
    pub fn of(event: &WebhookEvent) -> Option<Self> {
        if event.kind() != "payment_intent.succeeded" {
            return None;
        }
        let intent = &event.json()["data"]["object"];
        let text = |v: &Value| v.as_str().map(str::to_owned);
        Some(Self {
            order_id: text(&intent["metadata"]["order_id"])?,
            payment_intent: text(&intent["id"])?,
            amount: intent["amount_received"].as_i64()?,
            currency: text(&intent["currency"]).unwrap_or_default(),
        })
    }
}

/// The service: `POST /webhooks/stripe` and `GET /orders`. The receiver runs on `store`, the
/// store its phases are made by.
pub fn router(store: SqliteStore, reads: SqlitePool, secrets: &[String]) -> Router {
    let mut signature = StripeSignature::new(secrets.first().cloned().unwrap_or_default());
    for more in secrets.iter().skip(1) {
        signature = signature.with_secret(more.clone());
    }
    let phases = store.clone();
    let receiver = WebhookReceiver::stripe_atomic(
        Idempotency::new(Arc::new(store)),
        signature,
        move |event: WebhookEvent| {
            let (id, payment) = (event.id().to_owned(), Payment::of(&event));
            phases.atomic_phase(move |conn| {
                // Each run of the writes owns its copy.
                let (id, payment) = (id.clone(), payment.clone());
                Box::pin(async move {
                    if let Some(p) = payment {
                        sqlx::query(
                            "INSERT INTO paid_orders \
                               (order_id, payment_intent, amount, currency, event) \
                             VALUES (?, ?, ?, ?, ?)",
                        )
                        .bind(&p.order_id)
                        .bind(&p.payment_intent)
                        .bind(p.amount)
                        .bind(&p.currency)
                        .bind(&id)
                        .execute(&mut *conn)
                        .await?;
                    }
                    Ok(acknowledgement(&id))
                })
            })
        },
    );
    Router::new()
        .route_service("/webhooks/stripe", receiver)
        .route("/orders", get(orders))
        .with_state(reads)
}

/// `[{"order": "ord_...", "payments": N, "amount": ...}, ...]`, by order id.
async fn orders(State(reads): State<SqlitePool>) -> Result<Json<Value>, StatusCode> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT order_id, COUNT(*), SUM(amount) FROM paid_orders GROUP BY order_id ORDER BY order_id",
    )
    .fetch_all(&reads)
    .await
    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let list: Vec<Value> = rows
        .into_iter()
        .map(|(order, payments, amount)| {
            json!({"order": order, "payments": payments, "amount": amount})
        })
        .collect();
    Ok(Json(Value::Array(list)))
}

/// Binds `settings.listen_addr` and serves until Ctrl-C.
pub async fn serve(settings: Settings) -> Result<(), Box<dyn std::error::Error>> {
    let (store, reads) = connect(&settings).await?;
    let listener = tokio::net::TcpListener::bind(&settings.listen_addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", settings.listen_addr))?;
    let addr: SocketAddr = listener.local_addr()?;
    println!("stripe_atomic listening on http://{addr}/webhooks/stripe");
    axum::serve(listener, router(store, reads, &settings.secrets))
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
            eprintln!("stripe_atomic: {e}");
            return ExitCode::from(2);
        }
    };
    match serve(settings).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stripe_atomic: {e}");
            ExitCode::FAILURE
        }
    }
}
