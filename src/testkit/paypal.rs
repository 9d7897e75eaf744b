//! The fake PayPal (`POST /v2/checkout/orders`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use serde_json::{Value, json};

use super::server::{EffectRequest, FakeApi, Shared, fake_handle};
use super::{
    Effect, Keys, Known, bearer_is, header_value, json_object, json_response, lock, missing_field,
};
use crate::provider::paypal::{KEY_MAX_LEN, ORDERS_PATH};

fake_handle! {
    /// An in-process PayPal Orders v2 look-alike (see the [module docs](super)).
    pub struct FakePayPal(PayPalState);
    routes: Router::new().route(ORDERS_PATH, post(create)),
    ledger: "The orders created, with their current status.",
    faults: "Fault injection and latency settings.",
}

#[derive(Debug, Default)]
struct PayPalState {
    /// The order each `PayPal-Request-Id` created.
    ids: Keys<String>,
    orders: Mutex<HashMap<String, Value>>,
}

impl FakePayPal {
    /// The access token the fake accepts (`Authorization: Bearer ...`).
    pub const API_KEY: &'static str = "A21AA_test_idemflow_fake";
    /// A `payment_source.card.number` that is declined (422 `INSTRUMENT_DECLINED`).
    pub const DECLINED_CARD: &'static str = "4000000000000002";

    /// Moves an order to `status` (the buyer approved it, it was captured or voided), as later
    /// events at PayPal do: a same-id re-send then returns the order in this state.
    pub fn set_order_status(&self, order_id: &str, status: &str) {
        if let Some(order) = lock(&self.state.orders).get_mut(order_id) {
            order["status"] = json!(status);
        }
        self.state.common.ledger.set_status(order_id, status);
    }
}

impl FakeApi for PayPalState {
    fn refusal(headers: &HeaderMap) -> Option<Response> {
        (!bearer_is(headers, FakePayPal::API_KEY)).then(|| {
            paypal_error(
                401,
                "AUTHENTICATION_FAILURE",
                None,
                "Authentication failed due to invalid authentication credentials or a missing Authorization header.",
            )
        })
    }

    fn server_error(status: u16) -> Response {
        paypal_error(
            status,
            "INTERNAL_SERVER_ERROR",
            None,
            "injected server error (nothing executed)",
        )
    }

    fn rate_limited() -> Value {
        json!({"name": "RATE_LIMIT_REACHED", "message": "Too many requests."})
    }
}

fn paypal_error(status: u16, name: &str, issue: Option<&str>, message: &str) -> Response {
    let mut body = json!({"name": name, "message": message, "debug_id": "fakedebug"});
    if let Some(issue) = issue {
        body["details"] = json!([{"issue": issue, "description": message}]);
    }
    json_response(status, &body, &[])
}

/// Why PayPal refuses an order request without creating anything (nothing is saved under its
/// id): a missing field, or the declined card.
fn refusal(order_req: &Value, card: Option<&str>) -> Option<Response> {
    if let Some(field) = missing_field(order_req, &["intent", "purchase_units"]) {
        return Some(paypal_error(
            400,
            "INVALID_REQUEST",
            Some("MISSING_REQUIRED_PARAMETER"),
            &format!("A required field / parameter is missing: /{field}."),
        ));
    }
    (card == Some(FakePayPal::DECLINED_CARD)).then(|| {
        paypal_error(
            422,
            "UNPROCESSABLE_ENTITY",
            Some("INSTRUMENT_DECLINED"),
            "The instrument presented was either declined by the processor or bank, or it can't be used for this payment.",
        )
    })
}

async fn create(State(s): State<Arc<Shared<PayPalState>>>, request: EffectRequest) -> Response {
    let (headers, body, delivery) = (request.headers, request.body, request.delivery);
    let Some(order_req) = json_object(&body) else {
        return paypal_error(
            400,
            "INVALID_REQUEST",
            Some("MALFORMED_REQUEST_JSON"),
            "The request JSON is not well formed.",
        );
    };
    let request_id = header_value(&headers, "paypal-request-id");
    if let Some(rid) = &request_id {
        if rid.is_empty() || rid.len() > KEY_MAX_LEN {
            return paypal_error(
                400,
                "INVALID_REQUEST",
                Some("INVALID_STRING_LENGTH"),
                "PayPal-Request-Id must be 1 to 108 characters.",
            );
        }
        // "PayPal processes the first request and might fail the second."
        let running = || {
            paypal_error(
                409,
                "RESOURCE_CONFLICT",
                None,
                "A request with this PayPal-Request-Id is in progress.",
            )
        };
        // "Returns the latest status of the previous request."
        let done = |id: &String| {
            Known::Replay(json_response(
                200,
                &lock(&s.orders)[id.as_str()],
                &[("paypal-debug-id", "fakedebug".to_owned())],
            ))
        };
        if let Err(r) = delivery.claim(&s.ids, rid, running, done).await {
            return r;
        }
    }
    let card = order_req
        .pointer("/payment_source/card/number")
        .and_then(Value::as_str)
        .map(str::to_owned);
    if let Some(refusal) = refusal(&order_req, card.as_deref()) {
        return s.ids.refuse(request_id.as_deref(), refusal);
    }

    let task_id = request_id.clone();
    let exec = s.execute(move |s, n| {
        let id = format!("FAKEORDER{n:08}");
        // A card order with intent CAPTURE completes at once; others wait for the buyer.
        let status = if card.is_some()
            && order_req.get("intent").and_then(Value::as_str) == Some("CAPTURE")
        {
            "COMPLETED"
        } else {
            "CREATED"
        };
        let order = json!({
            "id": id,
            "status": status,
            "intent": order_req.get("intent").cloned().unwrap_or(Value::Null),
            "purchase_units": order_req.get("purchase_units").cloned().unwrap_or(Value::Null),
            "create_time": chrono::Utc::now().to_rfc3339(),
        });
        s.common.ledger.push(Effect {
            id: id.clone(),
            kind: "order",
            idempotency_key: task_id.clone(),
            metadata_key: None,
            status: status.to_owned(),
            request: order_req,
        });
        lock(&s.orders).insert(id.clone(), order.clone());
        if let Some(rid) = task_id {
            s.ids.finish(rid, id);
        }
        order
    });
    let Some(order) = exec.await else {
        return paypal_error(500, "INTERNAL_SERVER_ERROR", None, "fake failed");
    };
    let r = json_response(201, &order, &[("paypal-debug-id", "fakedebug".to_owned())]);
    delivery.deliver(r).await
}
