//! A Stripe webhook receiver: `POST /webhooks/stripe` verifies `Stripe-Signature`, and runs the
//! handler once per event id through idemflow; the handler records one row per effect in its
//! own table, and `GET /effects` answers `[{"event": "evt_...", "count": N}, ...]`, so anyone can
//! check from outside that each event took effect once.
//!
//! ```text
//! STRIPE_WEBHOOK_SECRET=whsec_...            # required; several, comma-separated, while rotating
//! DATABASE_URL=sqlite://webhook_service.db   # default; a SQLite file (created if missing)
//! LISTEN_ADDR=127.0.0.1:3001                 # default
//! cargo run --example webhook_service --features axum
//! stripe listen --forward-to localhost:3001/webhooks/stripe
//! ```
//!
//! The effects table has no unique constraint on the event id on purpose: a second effect of
//! one event would show as a count of 2. The one case idemflow cannot rule out here is a crash
//! after the handler's insert and before the key's finish (the insert is not in the key's
//! transaction): the next delivery runs the handler again (`docs/consumers.md`, "Limits").

// The tests include this file as a module (`tests/services/webhooks.rs`), where `main` is unused.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use axum::{Json, http::StatusCode};
use idemflow::axum::webhook::{WebhookEvent, WebhookReceiver};
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
    /// A SQLite URL: idemflow's keys and the effects table live in it.
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
            database_url: var("DATABASE_URL")
                .unwrap_or_else(|| "sqlite://webhook_service.db".into()),
            listen_addr: var("LISTEN_ADDR").unwrap_or_else(|| "127.0.0.1:3001".into()),
        })
    }
}

/// The store (migrated) and the application's own pool on the same database, its effects
/// table created.
pub async fn connect(
    settings: &Settings,
) -> Result<(Idempotency, SqlitePool), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect(&settings.database_url).await?;
    store.migrate().await?;
    let url = if settings.database_url.contains('?') {
        settings.database_url.clone()
    } else {
        format!("{}?mode=rwc", settings.database_url)
    };
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await?;
    sqlx::query("PRAGMA busy_timeout = 5000")
        .execute(&pool)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS webhook_effects ( \
           id INTEGER PRIMARY KEY AUTOINCREMENT, \
           event TEXT NOT NULL, \
           kind TEXT NOT NULL, \
           at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    )
    .execute(&pool)
    .await?;
    Ok((Idempotency::new(Arc::new(store)), pool))
}

/// The service: `POST /webhooks/stripe` and `GET /effects`.
pub fn router(idem: Idempotency, pool: SqlitePool, secrets: &[String]) -> Router {
    let mut signature = StripeSignature::new(secrets.first().cloned().unwrap_or_default());
    for more in secrets.iter().skip(1) {
        signature = signature.with_secret(more.clone());
    }
    let effects = pool.clone();
    let receiver = WebhookReceiver::stripe(idem, signature, move |event: WebhookEvent| {
        let pool = effects.clone();
        async move {
            // The effect: one row per run of the handler.
            sqlx::query("INSERT INTO webhook_effects (event, kind) VALUES (?, ?)")
                .bind(event.id())
                .bind(event.kind())
                .execute(&pool)
                .await
                .map(drop)
        }
    });
    Router::new()
        .route_service("/webhooks/stripe", receiver)
        .route("/effects", get(effects_of))
        .with_state(pool)
}

/// `[{"event": "evt_...", "count": N}, ...]`, by event id.
async fn effects_of(State(pool): State<SqlitePool>) -> Result<Json<Value>, StatusCode> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT event, COUNT(*) FROM webhook_effects GROUP BY event ORDER BY event")
            .fetch_all(&pool)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let list: Vec<Value> = rows
        .into_iter()
        .map(|(event, count)| json!({"event": event, "count": count}))
        .collect();
    Ok(Json(Value::Array(list)))
}

/// Binds `settings.listen_addr` and serves until Ctrl-C.
pub async fn serve(settings: Settings) -> Result<(), Box<dyn std::error::Error>> {
    let (idem, pool) = connect(&settings).await?;
    let listener = tokio::net::TcpListener::bind(&settings.listen_addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", settings.listen_addr))?;
    let addr: SocketAddr = listener.local_addr()?;
    println!("webhook_service listening on http://{addr}/webhooks/stripe");
    axum::serve(listener, router(idem, pool, &settings.secrets))
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
            eprintln!("webhook_service: {e}");
            return ExitCode::from(2);
        }
    };
    match serve(settings).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("webhook_service: {e}");
            ExitCode::FAILURE
        }
    }
}
