//! The fake Resend (`POST /emails`).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use serde_json::{Value, json};

use super::server::{EffectRequest, FakeApi, Shared, fake_handle};
use super::{
    Effect, Keys, Saved, header_value, json_object, json_response, missing_field, raw_response,
};

fake_handle! {
    /// An in-process Resend look-alike (see the [module docs](super)).
    pub struct FakeResend(ResendState);
    routes: Router::new().route("/emails", post(send)),
    ledger: "The emails sent.",
    faults: "Fault injection and latency settings.",
}

#[derive(Debug, Default)]
struct ResendState {
    keys: Keys<Saved>,
}

impl FakeResend {
    /// The API key the fake accepts (`Authorization: Bearer ...`).
    pub const API_KEY: &'static str = "re_test_idemflow_fake";
}

impl FakeApi for ResendState {
    fn refusal(headers: &HeaderMap) -> Option<Response> {
        match header_value(headers, "authorization") {
            None => Some(resend_error(
                401,
                "missing_api_key",
                "Missing API key in the authorization header.",
            )),
            Some(v) if v != format!("Bearer {}", FakeResend::API_KEY) => {
                Some(resend_error(403, "invalid_api_key", "API key is invalid."))
            }
            Some(_) => None,
        }
    }

    fn server_error(status: u16) -> Response {
        resend_error(
            status,
            "internal_server_error",
            "injected server error (nothing sent)",
        )
    }

    fn rate_limited() -> Value {
        json!({"statusCode": 429, "name": "rate_limit_exceeded",
               "message": "Too many requests."})
    }
}

fn resend_error(status: u16, name: &str, message: &str) -> Response {
    json_response(
        status,
        &json!({"statusCode": status, "name": name, "message": message}),
        &[],
    )
}

async fn send(State(s): State<Arc<Shared<ResendState>>>, request: EffectRequest) -> Response {
    let (headers, body, delivery) = (request.headers, request.body, request.delivery);
    let Some(email) = json_object(&body) else {
        return resend_error(400, "validation_error", "The body must be a JSON object.");
    };
    let key = header_value(&headers, "idempotency-key");
    // The fingerprint of the payload: canonical JSON, so key order does not matter.
    let params = crate::fingerprint::canonical_json(&email);
    if let Some(key) = &key {
        if key.is_empty() || key.len() > 256 {
            return resend_error(
                400,
                "invalid_idempotency_key",
                "The key must be between 1-256 chars.",
            );
        }
        let running = || {
            resend_error(
                409,
                "concurrent_idempotent_requests",
                "Same idempotency key used while original request is still in progress.",
            )
        };
        let conflict = || {
            resend_error(
                409,
                "invalid_idempotent_request",
                "Same idempotency key used with a different request payload.",
            )
        };
        let done = |saved: &Saved| saved.answer(&params, conflict, &[]);
        if let Err(r) = delivery.claim(&s.keys, key, running, done).await {
            return r;
        }
    }
    if let Some(field) = missing_field(&email, &["from", "to", "subject"]) {
        let refusal = resend_error(
            422,
            "missing_required_field",
            &format!("Missing `{field}` field."),
        );
        return s.keys.refuse(key.as_deref(), refusal);
    }

    let task_key = key.clone();
    let exec = s.execute(move |s, n| {
        let id = format!("4ef9a417-02e9-4d39-ad75-{n:012}");
        s.common.ledger.push(Effect {
            id: id.clone(),
            kind: "email",
            idempotency_key: task_key.clone(),
            metadata_key: None,
            status: "sent".to_owned(),
            request: email,
        });
        let bytes = serde_json::to_vec(&json!({ "id": id })).unwrap_or_default();
        s.keys.save(task_key, params, 200, &bytes);
        bytes
    });
    let Some(bytes) = exec.await else {
        return resend_error(500, "application_error", "fake failed");
    };
    delivery.deliver(raw_response(200, bytes, &[])).await
}
