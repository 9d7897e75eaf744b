//! The fake Adyen (`POST /v71/payments`).

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
    /// An in-process Adyen Checkout look-alike (see the [module docs](super)).
    pub struct FakeAdyen(AdyenState);
    routes: Router::new().route(crate::provider::adyen::PAYMENTS_PATH, post(payments)),
    ledger: "The payments made (refused ones included, with their `resultCode`).",
    faults: "Fault injection and latency settings.",
}

#[derive(Debug, Default)]
struct AdyenState {
    keys: Mutex<HashMap<String, KeyEntry>>,
}

impl FakeAdyen {
    /// The API key the fake accepts (`X-API-Key`).
    pub const API_KEY: &'static str = "AQE_test_idemflow_fake";
    /// A `paymentMethod.number` that is refused (`resultCode: Refused`).
    pub const REFUSED_CARD: &'static str = "4000300011112220";
}

fn adyen_error(status: u16, code: &str, message: &str, kind: &str) -> Response {
    json_response(
        status,
        &json!({"status": status, "errorCode": code, "message": message, "errorType": kind}),
        &[],
    )
}

async fn payments(
    State(s): State<Arc<Shared<AdyenState>>>,
    Extension(kill): Extension<KillSwitch>,
    Received { headers, body, .. }: Received,
) -> Response {
    if header_value(&headers, "x-api-key").as_deref() != Some(FakeAdyen::API_KEY) {
        return adyen_error(
            401,
            "000",
            "HTTP Status Response - Unauthorized",
            "security",
        );
    }
    let after = match s.common.faults.next().await {
        Some(Fault::ServerError { status }) => {
            return adyen_error(
                status,
                "905",
                "injected server error (nothing executed)",
                "internal",
            );
        }
        Some(Fault::RateLimited { retry_after }) => {
            return json_response(
                429,
                &json!({"status": 429, "errorCode": "000", "message": "Too many requests",
                        "errorType": "validation"}),
                &[("retry-after", retry_after_secs(retry_after))],
            );
        }
        other => other,
    };
    let payment: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        _ => return adyen_error(400, "702", "Malformed JSON", "validation"),
    };
    let key = header_value(&headers, "idempotency-key");
    let params = crate::fingerprint::canonical_json(&payment);
    let echo = |k: &Option<String>| {
        k.as_ref()
            .map(|k| vec![("idempotency-key", k.clone())])
            .unwrap_or_default()
    };
    if let Some(key) = &key {
        if key.is_empty() || key.len() > crate::provider::adyen::KEY_MAX_LEN {
            return adyen_error(
                400,
                "702",
                "Idempotency-Key must be 1 to 64 characters",
                "validation",
            );
        }
        let replay = {
            let mut keys = lock(&s.keys);
            match keys.get(key) {
                // Not documented by Adyen: the fake answers 409 while the first runs.
                Some(KeyEntry::Running) => {
                    return adyen_error(
                        409,
                        "000",
                        "a request with this Idempotency-Key is in progress",
                        "validation",
                    );
                }
                // Not documented by Adyen either: another payload under a used key is refused.
                Some(KeyEntry::Done { params: p, .. }) if *p != params => {
                    return adyen_error(
                        422,
                        "000",
                        "Idempotency-Key already used with another request",
                        "validation",
                    );
                }
                Some(KeyEntry::Done { status, body, .. }) => Some(raw_response(
                    *status,
                    body.clone(),
                    &echo(&Some(key.clone())),
                )),
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
    let missing = ["amount", "merchantAccount", "paymentMethod", "reference"]
        .into_iter()
        .find(|f| payment.get(*f).is_none_or(Value::is_null));
    if let Some(field) = missing {
        if let Some(key) = &key {
            lock(&s.keys).remove(key);
        }
        return adyen_error(
            422,
            "14_0",
            &format!("Required field '{field}' is not provided."),
            "validation",
        );
    }

    let task_state = s.clone();
    let task_key = key.clone();
    let exec = tokio::spawn(async move {
        let s = task_state;
        tokio::time::sleep(s.common.faults.latency()).await;
        let n = s.common.next_id();
        let psp = format!("FAKEPSP{n:09}");
        let refused = payment
            .pointer("/paymentMethod/number")
            .and_then(Value::as_str)
            == Some(FakeAdyen::REFUSED_CARD);
        let result = if refused { "Refused" } else { "Authorised" };
        let mut answer = json!({
            "pspReference": psp,
            "resultCode": result,
            "merchantReference": payment.get("reference").cloned().unwrap_or(Value::Null),
            "amount": payment.get("amount").cloned().unwrap_or(Value::Null),
        });
        if refused {
            answer["refusalReason"] = json!("Refused");
            answer["refusalReasonCode"] = json!("2");
        }
        s.common.ledger.push(Effect {
            id: psp.clone(),
            kind: "payment",
            idempotency_key: task_key.clone(),
            metadata_key: None,
            status: result.to_owned(),
            request: payment,
        });
        let bytes = serde_json::to_vec(&answer).unwrap_or_default();
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
        (bytes, psp)
    });
    let Ok((bytes, psp)) = exec.await else {
        return adyen_error(500, "905", "fake failed", "internal");
    };
    let mut extra = echo(&key);
    extra.push(("pspreference", psp));
    deliver(after, &kill, raw_response(200, bytes, &extra)).await
}
