//! The fake Adyen (`POST /v71/payments`).

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
    /// An in-process Adyen Checkout look-alike (see the [module docs](super)).
    pub struct FakeAdyen(AdyenState);
    routes: Router::new().route(crate::provider::adyen::PAYMENTS_PATH, post(payments)),
    ledger: "The payments made (refused ones included, with their `resultCode`).",
    faults: "Fault injection and latency settings.",
}

#[derive(Debug, Default)]
struct AdyenState {
    keys: Keys<Saved>,
}

impl FakeAdyen {
    /// The API key the fake accepts (`X-API-Key`).
    pub const API_KEY: &'static str = "AQE_test_idemflow_fake";
    /// A `paymentMethod.number` that is refused (`resultCode: Refused`).
    pub const REFUSED_CARD: &'static str = "4000300011112220";
}

impl FakeApi for AdyenState {
    fn refusal(headers: &HeaderMap) -> Option<Response> {
        (header_value(headers, "x-api-key").as_deref() != Some(FakeAdyen::API_KEY)).then(|| {
            adyen_error(
                401,
                "000",
                "HTTP Status Response - Unauthorized",
                "security",
            )
        })
    }

    fn server_error(status: u16) -> Response {
        adyen_error(
            status,
            "905",
            "injected server error (nothing executed)",
            "internal",
        )
    }

    fn rate_limited() -> Value {
        json!({"status": 429, "errorCode": "000", "message": "Too many requests",
               "errorType": "validation"})
    }
}

fn adyen_error(status: u16, code: &str, message: &str, kind: &str) -> Response {
    json_response(
        status,
        &json!({"status": status, "errorCode": code, "message": message, "errorType": kind}),
        &[],
    )
}

async fn payments(State(s): State<Arc<Shared<AdyenState>>>, request: EffectRequest) -> Response {
    let (headers, body, delivery) = (request.headers, request.body, request.delivery);
    let Some(payment) = json_object(&body) else {
        return adyen_error(400, "702", "Malformed JSON", "validation");
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
        // Not documented by Adyen: the fake answers 409 while the first runs, and refuses
        // another payload under a used key.
        let running = || {
            adyen_error(
                409,
                "000",
                "a request with this Idempotency-Key is in progress",
                "validation",
            )
        };
        let conflict = || {
            adyen_error(
                422,
                "000",
                "Idempotency-Key already used with another request",
                "validation",
            )
        };
        let done = |saved: &Saved| saved.answer(&params, conflict, &echo(&Some(key.clone())));
        if let Err(r) = delivery.claim(&s.keys, key, running, done).await {
            return r;
        }
    }
    let required = ["amount", "merchantAccount", "paymentMethod", "reference"];
    if let Some(field) = missing_field(&payment, &required) {
        let refusal = adyen_error(
            422,
            "14_0",
            &format!("Required field '{field}' is not provided."),
            "validation",
        );
        return s.keys.refuse(key.as_deref(), refusal);
    }

    let task_key = key.clone();
    let exec = s.execute(move |s, n| {
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
        s.keys.save(task_key, params, 200, &bytes);
        (bytes, psp)
    });
    let Some((bytes, psp)) = exec.await else {
        return adyen_error(500, "905", "fake failed", "internal");
    };
    let mut extra = echo(&key);
    extra.push(("pspreference", psp));
    delivery.deliver(raw_response(200, bytes, &extra)).await
}
