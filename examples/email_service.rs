//! An email service: `POST /emails` behind the idemflow Idempotency-Key layer, sending through
//! the Resend adapter. A retried send is answered from the stored result and the email goes out
//! once, even when the service is killed mid-send (run `idemflow reconcile --once` with a config
//! naming the `resend` provider to settle what was in flight).
//!
//! ```text
//! RESEND_API_KEY=re_... cargo run --example email_service --features axum,http
//! curl -i localhost:3001/emails -H 'Idempotency-Key: "welcome-42"' -H 'X-Account-Id: acct_1' \
//!      -H 'content-type: application/json' \
//!      -d '{"from": "shop@example.com", "to": ["ana@example.org"], "subject": "Hi", "text": "Welcome"}'
//! ```
//!
//! Environment: `RESEND_API_KEY` (required), `RESEND_API_BASE` (default
//! `https://api.resend.com`), `DATABASE_URL` (default `sqlite://email_service.db`),
//! `LISTEN_ADDR` (default `127.0.0.1:3001`), `IDEMFLOW_LEASE_SECS` (default 30).
//!
//! Answers: 201 `{"email_id", "provider_id", "status": "sent"}`; 400 naming the invalid field
//! (not stored); 400 when Resend rejects the email (stored and replayed); 400 / 409 / 422 / 503
//! from the layer (see `docs/http.md`).

// tests/services/email_service.rs includes this file as a module and uses `router` only.
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
use idemflow::Idempotency;
use idemflow::axum::{IdempotencyContext, IdempotencyLayer, Problem, ScopeSource};
use idemflow::provider::Resend;
use serde_json::{Map, Value, json};

fn invalid(field: &str, detail: impl Into<String>) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "invalid-request",
        format!("Invalid {field}"),
    )
    .detail(detail)
}

fn address(v: &Value) -> bool {
    v.as_str()
        .is_some_and(|s| s.contains('@') && s.len() <= 320 && !s.contains(['\r', '\n']))
}

/// Validates the body and builds the Resend request stored with the key.
fn email_params(_parts: &Parts, body: &Bytes) -> Result<Value, Problem> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| invalid("body", format!("the body is not valid JSON: {e}")))?;
    let Value::Object(map) = v else {
        return Err(invalid("body", "the body must be a JSON object"));
    };
    for k in map.keys() {
        if !matches!(k.as_str(), "from" | "to" | "subject" | "text" | "html") {
            return Err(invalid(k, format!("unknown field {k:?}")));
        }
    }
    let from = map
        .get("from")
        .filter(|v| address(v))
        .ok_or_else(|| invalid("from", "from must be an email address"))?;
    let to: Vec<Value> = match map.get("to") {
        Some(Value::String(_)) => vec![map["to"].clone()],
        Some(Value::Array(a)) => a.clone(),
        _ => Vec::new(),
    };
    if to.is_empty() || to.len() > 50 || !to.iter().all(address) {
        return Err(invalid("to", "to must be 1 to 50 email addresses"));
    }
    let subject = map
        .get("subject")
        .and_then(Value::as_str)
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| invalid("subject", "subject must be a non-empty string"))?;
    let mut params = Map::new();
    params.insert("from".into(), from.clone());
    params.insert("to".into(), Value::Array(to));
    params.insert("subject".into(), subject.into());
    let mut has_content = false;
    for part in ["text", "html"] {
        match map.get(part) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => {
                params.insert(part.into(), s.clone().into());
                has_content = true;
            }
            Some(_) => return Err(invalid(part, format!("{part} must be a string"))),
        }
    }
    if !has_content {
        return Err(invalid("text", "text or html is required"));
    }
    Ok(Value::Object(params))
}

/// Renders Resend's answer as this service's; answers already rendered pass unchanged.
fn render(resend: idemflow::StoredResponse) -> idemflow::StoredResponse {
    let Ok(body) = resend.body_json::<Value>() else {
        return resend;
    };
    let json = |status: u16, v: Value| {
        idemflow::StoredResponse::json(status, &v)
            .unwrap_or_else(|_| idemflow::StoredResponse::new(500))
    };
    if (200..300).contains(&resend.status())
        && let Some(id) = body.get("id").and_then(Value::as_str)
        && body.get("email_id").is_none()
    {
        return json(
            201,
            json!({"email_id": format!("eml_{id}"), "provider_id": id, "status": "sent"}),
        );
    }
    if (400..500).contains(&resend.status()) && body.get("type").is_none() {
        let problem = json!({"type": "urn:email-service:problem:provider-rejected",
            "title": "The email provider rejected the email", "status": 400,
            "detail": body["message"], "name": body["name"]});
        return idemflow::StoredResponse::from_parts(
            400,
            vec![("content-type".into(), "application/problem+json".into())],
            problem.to_string().into_bytes(),
        );
    }
    resend
}

async fn send_email(State(resend): State<Arc<Resend>>, ctx: IdempotencyContext) -> Response {
    // The stored request with the stored key (what the sweeper re-sends). No answer yet is a
    // 503: `retryable` when Resend surely sent nothing, `outcome-unknown` when it may have.
    match ctx.call(resend.as_ref()).await {
        Ok(answer) => render(answer).into_response(),
        Err(no_answer_yet) => no_answer_yet,
    }
}

/// The service: `POST /emails` behind the idempotency layer, scoped by `X-Account-Id`.
pub fn router(idem: Idempotency, resend: Arc<Resend>) -> Router {
    let scope = ScopeSource::header(HeaderName::from_static("x-account-id"));
    let layer = IdempotencyLayer::new(idem, scope)
        .operation("emails.send")
        .provider(resend.as_ref())
        .stored_request(email_params)
        .replay_with(|_, stored| render(stored));
    Router::new()
        .route("/emails", post(send_email))
        .layer(layer)
        .with_state(resend)
}

async fn serve() -> Result<(), Box<dyn std::error::Error>> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let api_key = var("RESEND_API_KEY")
        .ok_or("RESEND_API_KEY is not set: export your Resend API key (re_...)")?;
    let base = var("RESEND_API_BASE")
        .unwrap_or_else(|| idemflow::provider::resend::DEFAULT_BASE_URL.into());
    let db = var("DATABASE_URL").unwrap_or_else(|| "sqlite://email_service.db".into());
    let addr = var("LISTEN_ADDR").unwrap_or_else(|| "127.0.0.1:3001".into());
    let lease = var("IDEMFLOW_LEASE_SECS")
        .map(|v| {
            v.parse::<u64>()
                .map_err(|_| format!("IDEMFLOW_LEASE_SECS={v:?} is not whole seconds"))
        })
        .transpose()?
        .unwrap_or(30);

    // Any backend this build has: sqlite:, postgres://, mysql:// or redis://.
    let store = idemflow::store::connect(&db).await?;
    store.migrate().await?;
    let idem = Idempotency::new(store).lease(Duration::from_secs(lease.max(1)));
    let resend = Arc::new(Resend::with_base_url(&base, api_key)?);
    let app = router(idem, resend);

    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local: SocketAddr = listener.local_addr()?;
    println!("email_service listening on http://{local}");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    match serve().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("email_service: {e}");
            ExitCode::FAILURE
        }
    }
}
