//! The fake Stripe (PaymentIntents + search).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::{get, post};
use serde_json::{Map, Value, json};

use super::server::{EffectRequest, FakeApi, Received, Shared, fake_handle};
use super::{
    Effect, Keys, Saved, Searchable, bearer_is, header_value, json_response, query_pairs,
    raw_response,
};

fake_handle! {
    /// An in-process Stripe look-alike (see the [module docs](super)).
    pub struct FakeStripe(StripeState);
    routes: Router::new()
            .route("/v1/payment_intents", post(create))
            .route("/v1/payment_intents/search", get(search)),
    ledger: "The PaymentIntents created (declined ones included, with their status).",
    faults: "Fault injection and latency / search-lag settings.",
}

#[derive(Debug, Default)]
struct StripeState {
    keys: Keys<Saved>,
    intents: Searchable,
}

impl FakeStripe {
    /// The secret key the fake accepts (`Authorization: Bearer ...`).
    pub const API_KEY: &'static str = "sk_test_idemflow_fake";
    /// A `payment_method` that is declined with 402 `card_error` / `card_declined`.
    pub const DECLINED_CARD: &'static str = "pm_card_chargeDeclined";

    /// The event Stripe would send now for the PaymentIntent `id` the fake made (its search
    /// lag does not apply): `payment_intent.succeeded`, `payment_intent.payment_failed` (a
    /// decline) or `payment_intent.canceled` by its status, `payment_intent.created` otherwise;
    /// `None` for an unknown id. Each call makes a new event id; deliver it with a
    /// [`WebhookSender`](super::WebhookSender).
    pub fn payment_intent_event(&self, id: &str) -> Option<Value> {
        let (pi, account) = without_account(self.state.intents.held(|pi| pi["id"] == id)?);
        let kind = match pi["status"].as_str() {
            Some("succeeded") => "payment_intent.succeeded",
            Some("canceled") => "payment_intent.canceled",
            Some("requires_payment_method") if pi["last_payment_error"].is_object() => {
                "payment_intent.payment_failed"
            }
            _ => "payment_intent.created",
        };
        let mut event = super::stripe_event(kind, pi);
        // A connected account's event names it, as Stripe's Connect events do.
        if let (Some(acct), Value::Object(m)) = (account, &mut event) {
            m.insert("account".to_owned(), Value::String(acct));
        }
        Some(event)
    }
}

/// Where the fake keeps, inside a PaymentIntent it holds, the connected account it was made on
/// (`Stripe-Account`); never in what it answers.
const ACCOUNT: &str = "__fake_account";

/// A held PaymentIntent as answered, and the connected account it was made on.
fn without_account(mut pi: Value) -> (Value, Option<String>) {
    let account = match &mut pi {
        Value::Object(m) => m
            .remove(ACCOUNT)
            .and_then(|a| a.as_str().map(str::to_owned)),
        _ => None,
    };
    (pi, account)
}

fn stripe_error(status: u16, error: Value) -> Response {
    json_response(status, &json!({ "error": error }), &[])
}

impl FakeApi for StripeState {
    fn refusal(headers: &HeaderMap) -> Option<Response> {
        (!bearer_is(headers, FakeStripe::API_KEY)).then(|| {
            stripe_error(
                401,
                json!({"type": "invalid_request_error", "message": "Invalid API Key provided"}),
            )
        })
    }

    fn server_error(status: u16) -> Response {
        stripe_error(
            status,
            json!({"type": "api_error", "message": "injected server error (nothing executed)"}),
        )
    }

    fn rate_limited() -> Value {
        json!({"error": {"type": "invalid_request_error", "code": "rate_limit",
                         "message": "Too many requests"}})
    }
}

async fn create(State(s): State<Arc<Shared<StripeState>>>, request: EffectRequest) -> Response {
    let (headers, body, delivery) = (request.headers, request.body, request.delivery);
    let mut fields: Vec<(String, String)> = match serde_urlencoded::from_bytes(&body) {
        Ok(f) => f,
        Err(e) => {
            return stripe_error(
                400,
                json!({"type": "invalid_request_error", "message": format!("invalid form body: {e}")}),
            );
        }
    };
    fields.sort();
    let params = serde_json::to_string(&fields).unwrap_or_default();
    let key = header_value(&headers, "idempotency-key");
    // Connect: a connected account's keys and PaymentIntents are its own.
    let account = header_value(&headers, "stripe-account");
    let slot = key.as_ref().map(|k| match &account {
        Some(acct) => format!("{acct}/{k}"),
        None => k.clone(),
    });

    if let Some(key) = &key {
        if key.len() > 255 {
            return stripe_error(
                400,
                json!({"type": "invalid_request_error",
                       "message": "Idempotency-Key must be at most 255 characters"}),
            );
        }
        let running = || {
            stripe_error(
                409,
                json!({"type": "invalid_request_error", "code": "idempotency_key_in_use",
                   "message": "There is currently another in-progress request using this Idempotent Key (that probably means you submitted twice, and the other request is still going through): ..."}),
            )
        };
        let conflict = || {
            stripe_error(
                400,
                json!({"type": "idempotency_error",
                   "message": "Keys for idempotent requests can only be used with the same parameters they were first used with."}),
            )
        };
        let replayed = [("idempotent-replayed", "true".to_owned())];
        let done = |saved: &Saved| saved.answer(&params, conflict, &replayed);
        let slot = slot.as_deref().unwrap_or(key);
        if let Err(r) = delivery.claim(&s.keys, slot, running, done).await {
            return r;
        }
    }

    // Validation: not saved, as at Stripe.
    if let Some(param) = missing_param(&fields) {
        let refusal = stripe_error(
            400,
            json!({"type": "invalid_request_error", "code": "parameter_missing", "param": param,
                   "message": format!("Missing or invalid required param: {param}.")}),
        );
        return s.keys.refuse(slot.as_deref(), refusal);
    }

    let task_key = key.clone();
    let exec = s.execute(move |s, n| {
        let slot = slot.clone();
        let get = |name: &str| field(&fields, name);
        let (metadata, mut request) = metadata_and_request(&fields);
        if let Some(acct) = &account {
            request.insert("Stripe-Account".to_owned(), Value::String(acct.clone()));
        }
        let declined = get("payment_method").as_deref() == Some(FakeStripe::DECLINED_CARD);
        let confirm = get("confirm").as_deref() == Some("true");
        let status = if declined {
            "requires_payment_method"
        } else if confirm {
            "succeeded"
        } else {
            "requires_confirmation"
        };
        let id = format!("pi_fake_{n:06}");
        let decline = json!({"type": "card_error", "code": "card_declined",
                             "decline_code": "generic_decline", "message": "Your card was declined."});
        let pi = json!({
            "id": id,
            "object": "payment_intent",
            // As Stripe: whoever holds it can confirm the payment from a browser.
            "client_secret": format!("{id}_secret_{:016x}", n.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            "amount": get("amount").and_then(|a| a.parse::<u64>().ok()),
            "currency": get("currency"),
            "customer": get("customer"),
            "payment_method": get("payment_method"),
            "status": status,
            "metadata": metadata,
            "last_payment_error": if declined { decline.clone() } else { Value::Null },
            "created": chrono::Utc::now().timestamp(),
        });
        s.common.ledger.push(Effect {
            id: id.clone(),
            kind: "payment_intent",
            idempotency_key: task_key.clone(),
            metadata_key: metadata
                .get(crate::provider::stripe::METADATA_KEY)
                .and_then(Value::as_str)
                .map(str::to_owned),
            status: status.to_owned(),
            request: Value::Object(request),
        });
        let mut kept = pi.clone();
        if let (Some(acct), Value::Object(m)) = (&account, &mut kept) {
            m.insert(ACCOUNT.to_owned(), Value::String(acct.clone()));
        }
        s.intents.push(s.common.faults.search_lag(), kept);
        let (code, body) = if declined {
            let mut err = decline;
            if let Value::Object(m) = &mut err {
                m.insert("payment_intent".to_owned(), pi);
            }
            (402, json!({ "error": err }))
        } else {
            (200, pi)
        };
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        s.keys.save(slot, params, code, &bytes);
        (code, bytes, n)
    });
    let Some((code, bytes, n)) = exec.await else {
        return stripe_error(500, json!({"type": "api_error", "message": "fake failed"}));
    };
    let r = raw_response(code, bytes, &[("request-id", format!("req_fake_{n:06}"))]);
    delivery.deliver(r).await
}

/// The first required parameter missing or invalid (`amount` must be a positive integer).
fn missing_param(fields: &[(String, String)]) -> Option<&'static str> {
    match (field(fields, "amount"), field(fields, "currency")) {
        (None, _) => Some("amount"),
        (_, None) => Some("currency"),
        (Some(a), _) if a.parse::<u64>().map_or(true, |a| a == 0) => Some("amount"),
        _ => None,
    }
}

/// The form's `metadata[...]` entries, and every field as the request the ledger records.
fn metadata_and_request(fields: &[(String, String)]) -> (Map<String, Value>, Map<String, Value>) {
    let mut metadata = Map::new();
    let mut request = Map::new();
    for (k, v) in fields {
        if let Some(m) = k
            .strip_prefix("metadata[")
            .and_then(|r| r.strip_suffix(']'))
        {
            metadata.insert(m.to_owned(), Value::String(v.clone()));
        }
        request.insert(k.clone(), Value::String(v.clone()));
    }
    (metadata, request)
}

fn field(fields: &[(String, String)], name: &str) -> Option<String> {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

/// Parses `metadata['k']:'v'` (the only query form the fake understands).
fn parse_query(q: &str) -> Option<(String, String)> {
    let rest = q.trim().strip_prefix("metadata['")?;
    let (k, rest) = rest.split_once("']:'")?;
    let v = rest.strip_suffix('\'')?;
    Some((k.to_owned(), v.replace("\\'", "'").replace("\\\\", "\\")))
}

async fn search(
    State(s): State<Arc<Shared<StripeState>>>,
    Received { uri, headers, .. }: Received,
) -> Response {
    let account = header_value(&headers, "stripe-account");
    let Some((k, v)) = query_pairs(&uri)
        .iter()
        .find(|(n, _)| n == "query")
        .and_then(|(_, q)| parse_query(q))
    else {
        return stripe_error(
            400,
            json!({"type": "invalid_request_error", "param": "query",
                   "message": "the fake understands only metadata['k']:'v'"}),
        );
    };
    let data: Vec<Value> = s
        .intents
        .find(|pi| {
            pi["metadata"][&k].as_str() == Some(v.as_str())
                && pi.get(ACCOUNT).and_then(Value::as_str) == account.as_deref()
        })
        .into_iter()
        .map(|pi| without_account(pi).0)
        .collect();
    json_response(
        200,
        &json!({"object": "search_result", "url": "/v1/payment_intents/search",
                "has_more": false, "next_page": null, "data": data}),
        &[],
    )
}
