//! The fake Square (`POST /v2/payments`, `POST /v2/payments/cancel`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use serde_json::{Value, json};

use super::server::{FakeApi, Received, Shared, fake_handle};
use super::{
    Delivery, Effect, KeyEntry, Keys, Known, bearer_is, json_object, json_response, lock,
    missing_field,
};
use crate::provider::square::{CANCEL_BY_KEY_PATH, KEY_MAX_LEN, PAYMENTS_PATH};

fake_handle! {
    /// An in-process Square Payments look-alike (see the [module docs](super)).
    pub struct FakeSquare(SquareState);
    routes: Router::new()
            .route(PAYMENTS_PATH, post(create))
            .route(CANCEL_BY_KEY_PATH, post(cancel_by_key)),
    ledger: "The payments taken, with their current status (`COMPLETED`, `APPROVED`, `CANCELED`, `FAILED`).",
    faults: "Fault injection (on CreatePayment) and latency settings.",
}

/// What the fake keeps for a key: the body it was first used with, and the payment made.
#[derive(Debug, Clone)]
struct KeptPayment {
    params: String,
    id: String,
}

#[derive(Debug, Default)]
struct SquareState {
    keys: Keys<KeptPayment>,
    payments: Mutex<HashMap<String, Value>>,
}

impl FakeSquare {
    /// The access token the fake accepts (`Authorization: Bearer ...`).
    pub const API_KEY: &'static str = "EAAA_test_idemflow_fake";
    /// A `source_id` that is declined (`PAYMENT_METHOD_ERROR` / `GENERIC_DECLINE`), as
    /// Square's sandbox test nonce of that name.
    pub const DECLINED_CARD: &'static str = "cnon:card-nonce-declined";
}

fn square_error(status: u16, category: &str, code: &str, detail: &str) -> Response {
    json_response(
        status,
        &json!({"errors": [{"category": category, "code": code, "detail": detail}]}),
        &[],
    )
}

impl FakeApi for SquareState {
    fn refusal(headers: &HeaderMap) -> Option<Response> {
        (!bearer_is(headers, FakeSquare::API_KEY)).then(|| {
            square_error(
                401,
                "AUTHENTICATION_ERROR",
                "UNAUTHORIZED",
                "This request could not be authorized.",
            )
        })
    }

    fn server_error(status: u16) -> Response {
        square_error(
            status,
            "API_ERROR",
            "INTERNAL_SERVER_ERROR",
            "injected server error (nothing executed)",
        )
    }

    fn rate_limited() -> Value {
        json!({"errors": [{"category": "RATE_LIMIT_ERROR", "code": "RATE_LIMITED",
                           "detail": "Too many requests"}]})
    }
}

fn payment_response(payment: &Value) -> Response {
    json_response(200, &json!({ "payment": payment }), &[])
}

/// CreatePayment, handled to its end in a task of its own: a request Square received is
/// processed even when its client stops waiting (a timeout during a [`Fault::Delay`] included).
async fn create(State(s): State<Arc<Shared<SquareState>>>, received: Received) -> Response {
    match tokio::spawn(create_to_the_end(s, received)).await {
        Ok(response) => response,
        Err(_) => square_error(500, "API_ERROR", "INTERNAL_SERVER_ERROR", "fake failed"),
    }
}

async fn create_to_the_end(
    s: Arc<Shared<SquareState>>,
    Received { body, kill, .. }: Received,
) -> Response {
    let delivery = match Delivery::take::<SquareState>(&s.common.faults, kill).await {
        Ok(d) => d,
        Err(r) => return r,
    };
    let Some(mut request) = json_object(&body) else {
        return square_error(
            400,
            "INVALID_REQUEST_ERROR",
            "BAD_REQUEST",
            "The body must be a JSON object.",
        );
    };
    let key = match request.get("idempotency_key").and_then(Value::as_str) {
        Some(k) if !k.is_empty() && k.chars().count() <= KEY_MAX_LEN => k.to_owned(),
        Some(k) if !k.is_empty() => {
            return square_error(
                400,
                "INVALID_REQUEST_ERROR",
                "VALUE_TOO_LONG",
                "Field `idempotency_key` must not be longer than 45 characters.",
            );
        }
        _ => {
            return square_error(
                400,
                "INVALID_REQUEST_ERROR",
                "MISSING_REQUIRED_PARAMETER",
                "Field `idempotency_key` is missing.",
            );
        }
    };
    let params = crate::fingerprint::canonical_json(&request);
    // Not documented for CreatePayment: the fake answers 409 while the first runs.
    let running = || {
        square_error(
            409,
            "INVALID_REQUEST_ERROR",
            "CONFLICT",
            "A request with this idempotency key is in progress.",
        )
    };
    // The payment made with the key, as it stands now (a payment voided by key comes back
    // `CANCELED`).
    let done = |kept: &KeptPayment| {
        if kept.params != params {
            return Known::Refuse(square_error(
                400,
                "INVALID_REQUEST_ERROR",
                "IDEMPOTENCY_KEY_REUSED",
                "The idempotency key can only be retried with the same request data.",
            ));
        }
        Known::Replay(payment_response(&lock(&s.payments)[kept.id.as_str()]))
    };
    if let Err(r) = delivery.claim(&s.keys, &key, running, done).await {
        return r;
    }
    if let Some(field) = missing_field(&request, &["source_id", "amount_money"]) {
        let refusal = square_error(
            400,
            "INVALID_REQUEST_ERROR",
            "MISSING_REQUIRED_PARAMETER",
            &format!("Field `{field}` is missing."),
        );
        return s.keys.refuse(Some(&key), refusal);
    }

    let exec = s.execute(move |s, n| {
        let id = format!("fake_sq_pay_{n:06}");
        let declined =
            request.get("source_id").and_then(Value::as_str) == Some(FakeSquare::DECLINED_CARD);
        let status = if declined {
            "FAILED"
        } else if request.get("autocomplete") == Some(&Value::Bool(false)) {
            "APPROVED"
        } else {
            "COMPLETED"
        };
        let payment = json!({
            "id": id,
            "status": status,
            "amount_money": request.get("amount_money").cloned().unwrap_or(Value::Null),
            "source_type": "CARD",
            "created_at": chrono::Utc::now().to_rfc3339(),
        });
        if let Value::Object(m) = &mut request {
            m.remove("idempotency_key");
        }
        s.common.ledger.push(Effect {
            id: id.clone(),
            kind: "payment",
            idempotency_key: Some(key.clone()),
            metadata_key: None,
            status: status.to_owned(),
            request,
        });
        lock(&s.payments).insert(id.clone(), payment.clone());
        if declined {
            // Only a successful answer is kept for the key: a decline can be retried.
            let decline = square_error(
                402,
                "PAYMENT_METHOD_ERROR",
                "GENERIC_DECLINE",
                "Authorization error: 'GENERIC_DECLINE'",
            );
            s.keys.refuse(Some(&key), decline)
        } else {
            s.keys.finish(key, KeptPayment { params, id });
            payment_response(&payment)
        }
    });
    let Some(response) = exec.await else {
        return square_error(500, "API_ERROR", "INTERNAL_SERVER_ERROR", "fake failed");
    };
    delivery.deliver(response).await
}

async fn cancel_by_key(
    State(s): State<Arc<Shared<SquareState>>>,
    Received { body, .. }: Received,
) -> Response {
    let key = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|b| b.get("idempotency_key")?.as_str().map(str::to_owned));
    let Some(key) = key else {
        return square_error(
            400,
            "INVALID_REQUEST_ERROR",
            "MISSING_REQUIRED_PARAMETER",
            "Field `idempotency_key` is missing.",
        );
    };
    let id = match s.keys.get(&key) {
        Some(KeyEntry::Done(kept)) => kept.id,
        Some(KeyEntry::Running) => {
            return square_error(
                409,
                "INVALID_REQUEST_ERROR",
                "CONFLICT",
                "The CreatePayment request with this key is in progress.",
            );
        }
        // "If no payment with the specified idempotency key is found, no action is taken and
        // the endpoint returns successfully."
        None => return json_response(200, &json!({}), &[]),
    };
    let mut payments = lock(&s.payments);
    let Some(payment) = payments.get_mut(&id) else {
        return json_response(200, &json!({}), &[]);
    };
    match payment["status"].as_str() {
        Some("APPROVED") => {
            payment["status"] = json!("CANCELED");
            s.common.ledger.set_status(&id, "CANCELED");
            json_response(200, &json!({}), &[])
        }
        Some("CANCELED") => json_response(200, &json!({}), &[]),
        other => square_error(
            400,
            "INVALID_REQUEST_ERROR",
            "BAD_REQUEST",
            &format!(
                "Payment {id} is {} and cannot be canceled.",
                other.unwrap_or("unknown")
            ),
        ),
    }
}
