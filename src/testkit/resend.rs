//! The fake Resend (`POST /emails`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Extension, State};
use axum::response::Response;
use axum::routing::post;
use serde_json::{Value, json};

use super::server::{KillSwitch, Received, Shared, fake_handle};
use super::{
    Effect, Fault, KeyEntry, deliver, header_value, json_response, lock, raw_response,
    retry_after_secs,
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
    keys: Mutex<HashMap<String, KeyEntry>>,
}

impl FakeResend {
    /// The API key the fake accepts (`Authorization: Bearer ...`).
    pub const API_KEY: &'static str = "re_test_idemflow_fake";
}

fn resend_error(status: u16, name: &str, message: &str) -> Response {
    json_response(
        status,
        &json!({"statusCode": status, "name": name, "message": message}),
        &[],
    )
}

async fn send(
    State(s): State<Arc<Shared<ResendState>>>,
    Extension(kill): Extension<KillSwitch>,
    Received { headers, body, .. }: Received,
) -> Response {
    match header_value(&headers, "authorization") {
        None => {
            return resend_error(
                401,
                "missing_api_key",
                "Missing API key in the authorization header.",
            );
        }
        Some(v) if v != format!("Bearer {}", FakeResend::API_KEY) => {
            return resend_error(403, "invalid_api_key", "API key is invalid.");
        }
        Some(_) => {}
    }
    let after = match s.common.faults.next().await {
        Some(Fault::ServerError { status }) => {
            return resend_error(
                status,
                "internal_server_error",
                "injected server error (nothing sent)",
            );
        }
        Some(Fault::RateLimited { retry_after }) => {
            return json_response(
                429,
                &json!({"statusCode": 429, "name": "rate_limit_exceeded",
                        "message": "Too many requests."}),
                &[("retry-after", retry_after_secs(retry_after))],
            );
        }
        other => other,
    };
    let email: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        _ => return resend_error(400, "validation_error", "The body must be a JSON object."),
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
        let replay = {
            let mut keys = lock(&s.keys);
            match keys.get(key) {
                Some(KeyEntry::Running) => {
                    return resend_error(
                        409,
                        "concurrent_idempotent_requests",
                        "Same idempotency key used while original request is still in progress.",
                    );
                }
                Some(KeyEntry::Done { params: p, .. }) if *p != params => {
                    return resend_error(
                        409,
                        "invalid_idempotent_request",
                        "Same idempotency key used with a different request payload.",
                    );
                }
                Some(KeyEntry::Done { status, body, .. }) => {
                    Some(raw_response(*status, body.clone(), &[]))
                }
                None => {
                    keys.insert(key.clone(), KeyEntry::Running);
                    None
                }
            }
        };
        if let Some(r) = replay {
            return deliver(after, &kill, r).await;
        }
    }
    let missing = ["from", "to", "subject"]
        .into_iter()
        .find(|f| email.get(*f).is_none_or(Value::is_null));
    if let Some(field) = missing {
        if let Some(key) = &key {
            lock(&s.keys).remove(key);
        }
        return resend_error(
            422,
            "missing_required_field",
            &format!("Missing `{field}` field."),
        );
    }

    let task_state = s.clone();
    let task_key = key.clone();
    let exec = tokio::spawn(async move {
        let s = task_state;
        tokio::time::sleep(s.common.faults.latency()).await;
        let n = s.common.next_id();
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
        if let Some(key) = task_key {
            lock(&s.keys).insert(
                key,
                KeyEntry::Done {
                    params,
                    status: 200,
                    body: bytes.clone(),
                },
            );
        }
        bytes
    });
    let Ok(bytes) = exec.await else {
        return resend_error(500, "application_error", "fake failed");
    };
    deliver(after, &kill, raw_response(200, bytes, &[])).await
}
