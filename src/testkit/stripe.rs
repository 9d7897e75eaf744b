//! The fake Stripe (PaymentIntents + search).

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
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
            .route("/v1/payment_intents/search", get(search))
            .route("/v1/payment_intents/{id}", get(retrieve))
            .route("/v1/payment_intents/{id}/capture", post(capture))
            .route("/v1/refunds", post(refund).get(list_refunds)),
    ledger: "The PaymentIntents created (declined ones included, with their status), the captures and the refunds.",
    faults: "Fault injection and latency / search-lag settings.",
}

#[derive(Debug, Default)]
struct StripeState {
    keys: Keys<Saved>,
    intents: Searchable,
    /// The refunds made, oldest first, each with the account it was made on ([`ACCOUNT`]).
    refunds: std::sync::Mutex<Vec<Value>>,
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

/// A form body's fields, sorted, and their fingerprint for the key's saved answer; Stripe's 400
/// for a body that is not a form.
fn form(body: &[u8]) -> Result<(Vec<(String, String)>, String), String> {
    let mut fields: Vec<(String, String)> =
        serde_urlencoded::from_bytes(body).map_err(|e| format!("invalid form body: {e}"))?;
    fields.sort();
    let params = serde_json::to_string(&fields).unwrap_or_default();
    Ok((fields, params))
}

/// Stripe's answer to a body that is not a form.
fn bad_form(message: String) -> Response {
    stripe_error(
        400,
        json!({"type": "invalid_request_error", "message": message}),
    )
}

/// The connected account a request acts on (`Stripe-Account`), and where its key lives: a
/// connected account's keys are its own.
struct Keyed {
    key: Option<String>,
    slot: Option<String>,
    account: Option<String>,
}

/// Reads the request's key and account and claims the key for it, as Stripe does for every
/// POST: a replay of the saved answer, 409 while the first runs, 400 for other parameters.
async fn keyed(
    s: &Shared<StripeState>,
    headers: &HeaderMap,
    params: &str,
    delivery: &super::Delivery,
) -> Result<Keyed, Response> {
    let key = header_value(headers, "idempotency-key");
    let account = header_value(headers, "stripe-account");
    let slot = key.as_ref().map(|k| match &account {
        Some(acct) => format!("{acct}/{k}"),
        None => k.clone(),
    });
    if let (Some(key), Some(slot)) = (&key, &slot) {
        if key.len() > 255 {
            return Err(stripe_error(
                400,
                json!({"type": "invalid_request_error",
                       "message": "Idempotency-Key must be at most 255 characters"}),
            ));
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
        let done = |saved: &Saved| saved.answer(params, conflict, &replayed);
        delivery.claim(&s.keys, slot, running, done).await?;
    }
    Ok(Keyed { key, slot, account })
}

/// A POST as the handlers take it: its form, the fingerprint of its parameters, its key claimed
/// for it, and how its answer is delivered.
struct Posted {
    fields: Vec<(String, String)>,
    params: String,
    keyed: Keyed,
    delivery: super::Delivery,
}

/// Reads a POST's form and claims its key ([`keyed`]); the answer to give at once otherwise (a
/// body that is not a form, a replay, 409, another request under the key).
async fn posted(s: &Shared<StripeState>, request: EffectRequest) -> Result<Posted, Response> {
    let (headers, body, delivery) = (request.headers, request.body, request.delivery);
    let (fields, params) = form(&body).map_err(bad_form)?;
    let keyed = keyed(s, &headers, &params, &delivery).await?;
    Ok(Posted {
        fields,
        params,
        keyed,
        delivery,
    })
}

/// What a POST's work reads: its form fields, the key it came with and its connected account.
struct Form {
    fields: Vec<(String, String)>,
    key: Option<String>,
    account: Option<String>,
}

impl Posted {
    /// Refuses the POST before anything is saved under its key (validation, as at Stripe).
    fn refuse(self, s: &Shared<StripeState>, refusal: Response) -> Response {
        s.keys.refuse(self.keyed.slot.as_deref(), refusal)
    }

    /// Runs the POST's `work` (which answers a status and a JSON body), saves the answer under
    /// the key and delivers it as the queued fault says.
    async fn run(
        self,
        s: &Arc<Shared<StripeState>>,
        work: impl FnOnce(&Shared<StripeState>, u64, Form) -> (u16, Value) + Send + 'static,
    ) -> Response {
        let Posted {
            fields,
            params,
            keyed: Keyed { key, slot, account },
            delivery,
        } = self;
        let form = Form {
            fields,
            key,
            account,
        };
        let exec = s.execute(move |s, n| {
            let (code, body) = work(s, n, form);
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
}

/// `item` as the fake holds it: with the connected account it was made on, if any.
fn with_account(mut item: Value, account: Option<&str>) -> Value {
    if let (Some(acct), Value::Object(m)) = (account, &mut item) {
        m.insert(ACCOUNT.to_owned(), Value::String(acct.to_owned()));
    }
    item
}

/// The PaymentIntent the account holds whose `by` (`payment_intent`: its id, `charge`: its
/// `latest_charge`) is `id`.
fn held_payment(s: &StripeState, by: &str, id: &str, account: Option<&str>) -> Option<Value> {
    let member = if by == "charge" {
        "latest_charge"
    } else {
        "id"
    };
    s.intents
        .held(|pi| pi[member] == id && on_account(pi, account))
}

/// Whether the held object `item` was made on `account`.
fn on_account(item: &Value, account: Option<&str>) -> bool {
    item.get(ACCOUNT).and_then(Value::as_str) == account
}

async fn create(State(s): State<Arc<Shared<StripeState>>>, request: EffectRequest) -> Response {
    let post = match posted(&s, request).await {
        Ok(p) => p,
        Err(r) => return r,
    };

    // Validation: not saved, as at Stripe.
    if let Some(param) = missing_param(&post.fields) {
        let refusal = stripe_error(
            400,
            json!({"type": "invalid_request_error", "code": "parameter_missing", "param": param,
                   "message": format!("Missing or invalid required param: {param}.")}),
        );
        return post.refuse(&s, refusal);
    }

    post.run(&s, move |s, n, Form { fields, key, account }| {
        let get = |name: &str| field(&fields, name);
        let (metadata, request) = metadata_and_request(&fields, account.as_deref());
        let declined = get("payment_method").as_deref() == Some(FakeStripe::DECLINED_CARD);
        let confirm = get("confirm").as_deref() == Some("true");
        let capture_method = get("capture_method").unwrap_or_else(|| "automatic".to_owned());
        let status = if declined {
            "requires_payment_method"
        } else if !confirm {
            "requires_confirmation"
        } else if capture_method == "manual" {
            "requires_capture"
        } else {
            "succeeded"
        };
        let amount = get("amount").and_then(|a| a.parse::<u64>().ok());
        let held = |in_state: &str| if status == in_state { amount.unwrap_or(0) } else { 0 };
        let id = format!("pi_fake_{n:06}");
        let decline = json!({"type": "card_error", "code": "card_declined",
                             "decline_code": "generic_decline", "message": "Your card was declined."});
        let pi = json!({
            "id": id,
            "object": "payment_intent",
            // As Stripe: whoever holds it can confirm the payment from a browser.
            "client_secret": format!("{id}_secret_{:016x}", n.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            "amount": amount,
            "amount_capturable": held("requires_capture"),
            "amount_received": held("succeeded"),
            "capture_method": capture_method,
            "latest_charge": (status == "succeeded" || status == "requires_capture")
                .then(|| format!("ch_fake_{n:06}")),
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
            idempotency_key: key,
            metadata_key: super::metadata_text(metadata.get(crate::provider::stripe::METADATA_KEY)),
            status: status.to_owned(),
            request: Value::Object(request),
        });
        s.intents.push(
            s.common.faults.search_lag(),
            with_account(pi.clone(), account.as_deref()),
        );
        if declined {
            let mut err = decline;
            if let Value::Object(m) = &mut err {
                m.insert("payment_intent".to_owned(), pi);
            }
            (402, json!({ "error": err }))
        } else {
            (200, pi)
        }
    })
    .await
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

/// The form's `metadata[...]` entries, and every field as the request the ledger records, with
/// the connected account as `"Stripe-Account"`.
fn metadata_and_request(
    fields: &[(String, String)],
    account: Option<&str>,
) -> (Map<String, Value>, Map<String, Value>) {
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
    if let Some(acct) = account {
        request.insert("Stripe-Account".to_owned(), Value::String(acct.to_owned()));
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
            pi["metadata"][&k].as_str() == Some(v.as_str()) && on_account(pi, account.as_deref())
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

/// Stripe's 404 for an id the account does not hold.
fn no_such(kind: &str, id: &str) -> (u16, Value) {
    (
        404,
        json!({"error": {"type": "invalid_request_error", "code": "resource_missing",
                         "message": format!("No such {kind}: '{id}'")}}),
    )
}

async fn capture(
    State(s): State<Arc<Shared<StripeState>>>,
    Path(id): Path<String>,
    request: EffectRequest,
) -> Response {
    let post = match posted(&s, request).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    post.run(&s, move |s, _, Form { fields, key, account }| {
        let (_, request) = metadata_and_request(&fields, account.as_deref());
        let wanted = field(&fields, "amount_to_capture").map(|a| a.parse::<u64>());
        let captured = s.intents.update(
            |pi| pi["id"] == id.as_str() && on_account(pi, account.as_deref()),
            |pi| {
                let capturable = pi["amount_capturable"].as_u64().unwrap_or(0);
                if pi["status"] != "requires_capture" {
                    let status = pi["status"].as_str().unwrap_or_default().to_owned();
                    return Err((
                        400,
                        json!({"error": {"type": "invalid_request_error",
                            "code": "payment_intent_unexpected_state",
                            "message": format!("This PaymentIntent could not be captured because it has a status of {status}.")}}),
                    ));
                }
                let amount = match wanted {
                    None => capturable,
                    Some(Ok(a)) if a > 0 && a <= capturable => a,
                    Some(_) => {
                        return Err((
                            400,
                            json!({"error": {"type": "invalid_request_error",
                                "code": "amount_too_large", "param": "amount_to_capture",
                                "message": format!("amount_to_capture must be between 1 and {capturable}.")}}),
                        ));
                    }
                };
                if let Value::Object(m) = pi {
                    m.insert("status".to_owned(), json!("succeeded"));
                    m.insert("amount_received".to_owned(), json!(amount));
                    m.insert("amount_capturable".to_owned(), json!(0));
                }
                Ok(without_account(pi.clone()).0)
            },
        );
        match captured {
            None => no_such("payment_intent", &id),
            Some(Err(refusal)) => refusal,
            Some(Ok(pi)) => {
                s.common.ledger.push(Effect {
                    id: id.clone(),
                    kind: "capture",
                    idempotency_key: key,
                    metadata_key: None,
                    status: "succeeded".to_owned(),
                    request: Value::Object(request),
                });
                (200, pi)
            }
        }
    })
    .await
}

async fn retrieve(
    State(s): State<Arc<Shared<StripeState>>>,
    Path(id): Path<String>,
    Received { headers, .. }: Received,
) -> Response {
    let account = header_value(&headers, "stripe-account");
    let held = s
        .intents
        .held(|pi| pi["id"] == id.as_str() && on_account(pi, account.as_deref()));
    let (code, body) = match held {
        Some(pi) => (200, without_account(pi).0),
        None => no_such("payment_intent", &id),
    };
    json_response(code, &body, &[])
}

/// The payment a refund request or a refund list names: `("payment_intent", id)` or
/// `("charge", id)`; `None` when it names neither.
fn refunded_payment(pairs: &[(String, String)]) -> Option<(&'static str, String)> {
    ["payment_intent", "charge"].into_iter().find_map(|by| {
        pairs
            .iter()
            .find(|(k, _)| k == by)
            .map(|(_, v)| (by, v.clone()))
    })
}

async fn refund(State(s): State<Arc<Shared<StripeState>>>, request: EffectRequest) -> Response {
    let post = match posted(&s, request).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    // Validation: not saved, as at Stripe.
    let Some((by, payment)) = refunded_payment(&post.fields) else {
        let refusal = stripe_error(
            400,
            json!({"type": "invalid_request_error", "code": "parameter_missing",
                   "message": "One of the following params should be provided for this request: payment_intent or charge."}),
        );
        return post.refuse(&s, refusal);
    };
    post.run(&s, move |s, n, Form { fields, key, account }| {
        let (metadata, request) = metadata_and_request(&fields, account.as_deref());
        let Some(pi) = held_payment(s, by, &payment, account.as_deref()) else {
            return no_such(by, &payment);
        };
        let received = pi["amount_received"].as_u64().unwrap_or(0);
        let mut refunds = super::lock(&s.refunds);
        let refunded: u64 = refunds
            .iter()
            .filter(|r| r["payment_intent"] == pi["id"])
            .filter_map(|r| r["amount"].as_u64())
            .sum();
        let left = received.saturating_sub(refunded);
        let refused = |code: &str, message: String| {
            (
                400,
                json!({"error": {"type": "invalid_request_error", "code": code, "message": message}}),
            )
        };
        if pi["status"] != "succeeded" || left == 0 {
            let charge = pi["latest_charge"].as_str().unwrap_or_default().to_owned();
            return refused(
                "charge_already_refunded",
                format!("Charge {charge} has already been refunded or was not captured."),
            );
        }
        let amount = match field(&fields, "amount").map(|a| a.parse::<u64>()) {
            None => left,
            Some(Ok(a)) if a > 0 && a <= left => a,
            Some(_) => {
                return refused(
                    "amount_too_large",
                    format!("Refund amount must be between 1 and {left}."),
                );
            }
        };
        let id = format!("re_fake_{n:06}");
        let refund = json!({
            "id": id,
            "object": "refund",
            "amount": amount,
            "currency": pi["currency"],
            "payment_intent": pi["id"],
            "charge": pi["latest_charge"],
            "reason": field(&fields, "reason"),
            "status": "succeeded",
            "metadata": metadata,
            "created": chrono::Utc::now().timestamp(),
        });
        s.common.ledger.push(Effect {
            id,
            kind: "refund",
            idempotency_key: key,
            metadata_key: super::metadata_text(metadata.get(crate::provider::stripe::METADATA_KEY)),
            status: "succeeded".to_owned(),
            request: Value::Object(request),
        });
        refunds.push(with_account(refund.clone(), account.as_deref()));
        (200, refund)
    })
    .await
}

async fn list_refunds(
    State(s): State<Arc<Shared<StripeState>>>,
    Received { uri, headers, .. }: Received,
) -> Response {
    let account = header_value(&headers, "stripe-account");
    let pairs = query_pairs(&uri);
    let get = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let limit = get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .unwrap_or(10)
        .clamp(1, 100);
    let payment = refunded_payment(&pairs);
    // As Stripe: a payment the account does not hold is a 404, not an empty list.
    if let Some((by, id)) = &payment
        && held_payment(&s, by, id, account.as_deref()).is_none()
    {
        let (code, body) = no_such(by, id);
        return json_response(code, &body, &[]);
    }
    let newest_first: Vec<Value> = super::lock(&s.refunds)
        .iter()
        .rev()
        .filter(|r| on_account(r, account.as_deref()))
        .filter(|r| {
            payment
                .as_ref()
                .is_none_or(|(by, id)| r[*by] == id.as_str())
        })
        .map(|r| without_account(r.clone()).0)
        .collect();
    let start = match get("starting_after") {
        Some(after) => newest_first
            .iter()
            .position(|r| r["id"] == after.as_str())
            .map_or(newest_first.len(), |i| i + 1),
        None => 0,
    };
    let page: Vec<Value> = newest_first
        .iter()
        .skip(start)
        .take(limit)
        .cloned()
        .collect();
    let has_more = start + page.len() < newest_first.len();
    json_response(
        200,
        &json!({"object": "list", "url": "/v1/refunds", "has_more": has_more, "data": page}),
        &[],
    )
}
