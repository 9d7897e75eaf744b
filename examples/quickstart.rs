//! From zero to a protected endpoint (docs/http.md): `POST /payments` charges through Stripe once
//! per `Idempotency-Key`, the store from `DATABASE_URL`, Prometheus metrics on `/metrics`, and a
//! test that a retry charges once. docs/http.md shows this file as a new crate's `src/main.rs`.
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderName;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idemflow::Idempotency;
use idemflow::axum::{IdempotencyContext, IdempotencyLayer, ScopeSource};
use idemflow::provider::Stripe;

/// `POST /payments` behind the layer: one Stripe charge per (account, key).
pub fn app(idem: Idempotency, stripe: Arc<Stripe>) -> Router {
    // Keys live per scope: in a real service, the account your authentication found.
    let scope = ScopeSource::header(HeaderName::from_static("x-account-id"));
    let layer = IdempotencyLayer::new(idem, scope)
        .operation("payments.create")
        .provider(stripe.as_ref()); // the reconciler asks Stripe about stuck keys
    Router::new()
        .route("/payments", post(pay))
        .layer(layer)
        .with_state(stripe)
}

async fn pay(State(stripe): State<Arc<Stripe>>, ctx: IdempotencyContext) -> Response {
    // The stored request with the key's provider key; a 503 when there is no answer yet.
    match ctx.call(stripe.as_ref()).await {
        Ok(answer) => answer.into_response(),
        Err(no_answer_yet) => no_answer_yet,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://payments.db".into());
    // sqlite:, postgres:, mysql: or redis:, each with its idemflow feature (here sqlite, postgres).
    let store = idemflow::store::connect(&url).await?;
    store.migrate().await?;
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    // The processing and stale gauges, for a service whose reconciler runs elsewhere.
    let _gauges = idemflow::telemetry::report_key_gauges(store.clone(), Duration::from_secs(15));
    let key = std::env::var("STRIPE_API_KEY").map_err(|_| "set STRIPE_API_KEY (sk_test_...)")?;
    let stripe = Arc::new(Stripe::new(key)?);
    let app = app(Idempotency::new(store), stripe).route(
        "/metrics",
        get(move || std::future::ready(prometheus.render())),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use idemflow::store::sqlite::SqliteStore;
    use idemflow::testkit::FakeStripe;
    use idemflow::{KeyId, Store};
    use tower::ServiceExt;

    #[tokio::test]
    async fn a_retry_charges_once() {
        let fake = FakeStripe::start().await.unwrap();
        let stripe = Arc::new(Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY).unwrap());
        let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
        store.migrate().await.unwrap();
        let app = app(Idempotency::new(Arc::new(store)), stripe.clone());
        let pay = || {
            Request::post("/payments")
                .header("x-account-id", "acct_42")
                .header("idempotency-key", "order-1001")
                .header("content-type", "application/json")
                .body(Body::from(r#"{"amount": 1999, "currency": "eur"}"#))
                .unwrap()
        };
        let first = app.clone().oneshot(pay()).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK); // Stripe's 200 and PaymentIntent, passed on
        let retry = app.oneshot(pay()).await.unwrap();
        assert_eq!(retry.status(), StatusCode::OK);
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        let key = KeyId::new("acct_42".parse().unwrap(), "order-1001".parse().unwrap());
        let charges = fake
            .ledger()
            .count_for_client_key(stripe.as_ref(), &key, "payments.create");
        assert_eq!(charges, 1, "the retry was answered from the store");
    }
}
