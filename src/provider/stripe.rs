//! Stripe PaymentIntents, and their captures and refunds (feature `http`).
//!
//! One adapter performs one [`StripeOperation`]: by default the create described here; a
//! capture ([`StripeOperation::Capture`], `stripe/capture.rs`) and a refund
//! ([`StripeOperation::Refund`], `stripe/refund.rs`) are adapters of their own, stored under
//! their own provider names, sharing the answers table, `Stripe-Version` and `Stripe-Account`
//! (`docs/providers.md`, "Stripe", "Captures and refunds").
//!
//! `send` sends `POST /v1/payment_intents`, form-encoded, with `Idempotency-Key: <provider key>`
//! and `metadata[idemflow_key]=<provider key>` (so a lost result can be found by search after
//! Stripe's 24 h key window), and `confirm=true` unless the request sets `confirm`.
//!
//! The canonical JSON request is an object of PaymentIntent parameters, flattened the way Stripe
//! expects (`{"metadata": {"order": "7"}}` becomes `metadata[order]=7`, arrays become
//! `field[0]=..`), in sorted order so that every attempt sends identical parameters:
//!
//! ```json
//! {"amount": 500, "currency": "usd", "customer": "cus_1", "payment_method": "pm_card_visa"}
//! ```
//!
//! | Stripe answers                                        | [`CallReply`]                  |
//! |-------------------------------------------------------|----------------------------------|
//! | 2xx (`Idempotent-Replayed: true` sets `replayed`)     | `Succeeded`                      |
//! | 402 (`card_error`: declined; definitive for the key)  | `Rejected`                       |
//! | 400 `idempotency_error` (same key, other parameters)  | `KeyConflict`                    |
//! | 409 (`idempotency_key_in_use`)                        | `InFlight { retry_after }`       |
//! | 429 (rate limit, `lock_timeout`)                      | `Retryable { retry_after }`      |
//! | other 4xx but 401/403 (invalid request)               | `Rejected`                       |
//! | 401, 403 (API key or permissions: nothing was done)   | `Retryable`                      |
//! | 5xx / 424 with `Stripe-Should-Retry: true`            | `Retryable`                      |
//! | 5xx / 424 otherwise (a stored 500 replays as such)    | `Unknown`                        |
//!
//! `Stripe-Should-Retry: false` stops the adapter's own retry loop.
//!
//! `lookup` searches `metadata['idemflow_key']:'<key>'`. Stripe search is eventually consistent
//! (usually under a minute, up to an hour during incidents, and unavailable for accounts in
//! India), so an empty result is only authoritative once [`Stripe::search_lag`] (default 60 s)
//! has passed since the first send. Within Stripe's 24 h key window a wrong "not found" is
//! harmless anyway: the retry it allows carries the same key and is replayed, not re-executed.
//! Without the stored request the search runs on the platform account only, so an empty result
//! cannot rule out a connected account's PaymentIntent: it answers `Lookup::NeedsOperator`.
//!
//! Webhooks: [`Stripe::event_outcome`] reads the same answer from a `payment_intent.*` event,
//! for the webhook receiver to settle a stuck key without waiting for a search
//! (`docs/consumers.md`); the webhook signature scheme is in `provider::stripe_signature`.
//!
//! A PaymentIntent found by search is replayed as a decline (402 `card_error`) only when it is
//! `requires_payment_method` with a `last_payment_error`; any other one (waiting for a payment
//! method, canceled, succeeded, ...) was created by the call and is replayed as 200 with the
//! PaymentIntent.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::endpoint::{Auth, Endpoint, http_adapter};
use super::answers::{Answers, refused_unsent};
use super::http::{Classified, HttpReply, RetryUnknown, classify_status};
use super::search::MetadataSearch;
use super::spans::Method;
use super::{Attempts, CallReply, KeySpec, Lookup, Provider};
use crate::{Outcome, StoredResponse};

/// Stripe's API base.
pub const DEFAULT_BASE_URL: &str = "https://api.stripe.com";

/// The Stripe API version the adapter was written against and sends by default as
/// `Stripe-Version` on every request (the call, the search, the retrieve), so that an account
/// upgraded to a newer default version does not change the answers the adapter classifies;
/// [`Stripe::api_version`] sends another.
pub const API_VERSION: &str = "2025-04-30.basil";
/// The metadata field that carries our key.
pub const METADATA_KEY: &str = "idemflow_key";

/// The request member naming the connected account to act on (Connect): sent as the
/// `Stripe-Account` header on the create, its retries and the sweeper's search, never as a form
/// field (`docs/providers.md`, "Stripe").
pub const ACCOUNT_FIELD: &str = "stripe_account";
/// The webhook events that settle the key of the PaymentIntent they carry
/// ([`Stripe::event_outcome`]): the PaymentIntent reached a state the create call answered.
pub const SETTLING_EVENTS: &[&str] = &[
    "payment_intent.succeeded",
    "payment_intent.payment_failed",
    "payment_intent.canceled",
];
/// Default margin before an empty search result is trusted.
pub const DEFAULT_SEARCH_LAG: Duration = Duration::from_secs(60);

/// The headers of Stripe's answer kept in the answer idemflow stores (besides `content-type`):
/// none. `Request-Id` would replay one request's id on every replay, and `Idempotent-Replayed`
/// marks *Stripe's* replay (read into the `replayed` flag of `CallReply::Succeeded` instead), which must
/// never pass for idemflow's own (see `docs/http.md`, "What is fingerprinted and what is stored").
const KEPT_HEADERS: &[&str] = &[];

/// A 402 (a decline) and the other 4xx but 424 refuse the request; 429, 401 and 403 are read
/// before.
const ANSWERS: Answers = Answers {
    provider: "Stripe",
    credential: "API key",
    effect: "done",
    kept_headers: KEPT_HEADERS,
    in_flight_on_409: true,
    rejects: |s| (400..=499).contains(&s) && s != 424,
};

mod capture;
mod refund;

/// What a [`Stripe`] adapter does with the request a key stores: one operation per adapter, so
/// that each has its own provider name in key rows, its own derived key and its own lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StripeOperation {
    /// Create (and, unless the request says otherwise, confirm) a PaymentIntent:
    /// `POST /v1/payment_intents`. Looked up by search.
    #[default]
    CreatePayment,
    /// Capture an authorised PaymentIntent (`capture_method: manual`):
    /// `POST /v1/payment_intents/{id}/capture`. Looked up by retrieving the PaymentIntent.
    Capture,
    /// Refund a payment: `POST /v1/refunds`. Looked up by listing the payment's refunds.
    Refund,
}

impl StripeOperation {
    /// The provider name an adapter for this operation stores in key rows unless renamed:
    /// `stripe`, `stripe_capture`, `stripe_refund` (also the CLI configuration's kinds).
    pub fn default_name(self) -> &'static str {
        match self {
            Self::CreatePayment => "stripe",
            Self::Capture => "stripe_capture",
            Self::Refund => "stripe_refund",
        }
    }
}

/// Stripe PaymentIntents (create + confirm), captures or refunds ([`StripeOperation`]).
#[derive(Debug, Clone)]
pub struct Stripe {
    endpoint: Endpoint,
    search_lag: Duration,
    operation: StripeOperation,
}

http_adapter!(Stripe {
    name: "stripe",
    key: "a secret key (`sk_...`)",
    auth: Auth::Bearer,
    headers: &[("Stripe-Version", API_VERSION)],
    settings: {
        /// Sets how long after the latest attempt an empty lookup is still not trusted (the
        /// search's lag for a create; for a capture or a refund, a margin for a request Stripe
        /// may still be running).
        search_lag: Duration = DEFAULT_SEARCH_LAG,
    },
    fields: { operation: StripeOperation::CreatePayment },
});

impl Stripe {
    /// Makes this adapter perform `operation` (default [`StripeOperation::CreatePayment`]). An
    /// adapter still under its operation's default name takes the new operation's
    /// ([`StripeOperation::default_name`]); call [`with_name`](Self::with_name) afterwards to
    /// choose another.
    ///
    /// ```
    /// # fn f() -> Result<(), idemflow::provider::http::HttpError> {
    /// use idemflow::Provider;
    /// use idemflow::provider::{Stripe, stripe::StripeOperation};
    /// let refunds = Stripe::new("sk_test_123")?.operation(StripeOperation::Refund);
    /// assert_eq!(refunds.name(), "stripe_refund");
    /// let eu = Stripe::new("sk_test_123")?.operation(StripeOperation::Capture).with_name("eu_capture");
    /// assert_eq!(eu.name(), "eu_capture");
    /// # Ok(()) }
    /// ```
    pub fn operation(mut self, operation: StripeOperation) -> Self {
        if self.endpoint.name() == self.operation.default_name() {
            self.endpoint.set_name(operation.default_name());
        }
        self.operation = operation;
        self
    }

    /// The operation this adapter performs.
    pub fn performs(&self) -> StripeOperation {
        self.operation
    }

    /// Pins another Stripe API version (`Stripe-Version` on every request; default
    /// [`API_VERSION`]). Use the version your integration was tested with: the adapter reads the
    /// PaymentIntent fields `id`, `status`, `amount`, `currency`, `metadata` and
    /// `last_payment_error`, and the error object's `type` and `code`.
    ///
    /// ```
    /// # fn f() -> Result<(), idemflow::provider::http::HttpError> {
    /// use idemflow::provider::Stripe;
    /// let stripe = Stripe::new("sk_test_123")?.api_version("2024-06-20")?;
    /// assert_eq!(stripe.sent_api_version(), "2024-06-20");
    /// assert_eq!(Stripe::new("sk_test_123")?.sent_api_version(), idemflow::provider::stripe::API_VERSION);
    /// assert!(Stripe::new("sk_test_123")?.api_version("bad\nversion").is_err());
    /// # Ok(()) }
    /// ```
    pub fn api_version(mut self, version: &str) -> Result<Self, super::http::HttpError> {
        self.endpoint.set_header("Stripe-Version", version)?;
        Ok(self)
    }

    /// The `Stripe-Version` this adapter sends.
    pub fn sent_api_version(&self) -> &str {
        self.endpoint.header("Stripe-Version").unwrap_or(API_VERSION)
    }

    /// The form fields sent for `request` with `provider_key`, in the order sent.
    pub fn form_fields(
        provider_key: &str,
        request: &Value,
    ) -> Result<Vec<(String, String)>, String> {
        let Value::Object(map) = request else {
            return Err(
                "a Stripe request must be a JSON object of PaymentIntent parameters".to_owned(),
            );
        };
        Self::account(request)?;
        let mut out = Vec::new();
        for (k, v) in map {
            if k != ACCOUNT_FIELD {
                flatten(k.clone(), v, &mut out);
            }
        }
        let meta = format!("metadata[{METADATA_KEY}]");
        out.retain(|(k, _)| *k != meta);
        if !map.contains_key("confirm") {
            out.push(("confirm".to_owned(), "true".to_owned()));
        }
        out.push((meta, provider_key.to_owned()));
        Ok(out)
    }

    /// The connected account `request` acts on ([`ACCOUNT_FIELD`], sent as `Stripe-Account`),
    /// if it names one; an error when the member is not an account id (`acct_` and letters or
    /// digits, at most 255 characters).
    ///
    /// ```
    /// use idemflow::provider::Stripe;
    /// use serde_json::json;
    /// assert_eq!(Stripe::account(&json!({"amount": 5, "stripe_account": "acct_1Nv0"})), Ok(Some("acct_1Nv0")));
    /// assert_eq!(Stripe::account(&json!({"amount": 5})), Ok(None));
    /// assert!(Stripe::account(&json!({"stripe_account": "cus_123"})).is_err());
    /// ```
    pub fn account(request: &Value) -> Result<Option<&str>, String> {
        let Some(v) = request.get(ACCOUNT_FIELD) else {
            return Ok(None);
        };
        let id = v.as_str().unwrap_or_default();
        let valid = id.len() <= 255
            && id
                .strip_prefix("acct_")
                .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric()));
        if valid {
            Ok(Some(id))
        } else {
            Err(format!(
                "`{ACCOUNT_FIELD}` must be a connected account id (acct_ and letters or digits), \
                 got {v}"
            ))
        }
    }

    fn classify(reply: &HttpReply) -> Classified {
        let err_type = reply.json_str("/error/type").unwrap_or_default();
        let err_code = reply.json_str("/error/code").unwrap_or_default();
        let message = reply.message("/error/message");
        let should_retry = reply
            .header("stripe-should-retry")
            .map(|v| v.eq_ignore_ascii_case("true"));
        let status = reply.status;
        let outcome = match status {
            200..=299 => ANSWERS.succeeded(
                reply,
                reply
                    .header("idempotent-replayed")
                    .is_some_and(|v| v.eq_ignore_ascii_case("true")),
            ),
            400 if err_type == "idempotency_error" => CallReply::KeyConflict { detail: message },
            429 => CallReply::Retryable {
                reason: format!("Stripe 429 {err_code}: {message}"),
                retry_after: reply.retry_after(),
            },
            _ => ANSWERS.classify_or(reply, None, &message, || match should_retry {
                Some(true) => CallReply::Retryable {
                    reason: format!("Stripe {status} with Stripe-Should-Retry: true: {message}"),
                    retry_after: reply.retry_after(),
                },
                _ => classify_status(reply),
            }),
        };
        let classified = match should_retry {
            Some(false) => Classified::final_answer(outcome),
            _ => Classified::new(outcome),
        };
        Classified {
            definitive: declined(status, &err_type),
            ..classified
        }
    }

    /// Whether `response` (a refusal) is a card decline, definitive for its key.
    fn is_decline(response: &StoredResponse) -> bool {
        let err_type = serde_json::from_slice::<serde_json::Value>(response.body())
            .ok()
            .and_then(|v| v.pointer("/error/type").and_then(|t| t.as_str().map(str::to_owned)))
            .unwrap_or_default();
        declined(response.status(), &err_type)
    }

    /// What a webhook event says about a request idemflow sent: for a
    /// `payment_intent.succeeded`, `payment_intent.payment_failed` or `payment_intent.canceled`
    /// event whose PaymentIntent carries `metadata.idemflow_key`, that provider key and the
    /// answer the create call gave ([`payment_intent_outcome`](Self::payment_intent_outcome));
    /// `None` for any other event.
    pub fn event_outcome(event: &Value) -> Option<(&str, Outcome)> {
        let kind = event.get("type").and_then(Value::as_str)?;
        if !SETTLING_EVENTS.contains(&kind) {
            return None;
        }
        let pi = event.pointer("/data/object")?;
        if pi.get("object").and_then(Value::as_str) != Some("payment_intent") {
            return None;
        }
        let key = pi
            .get("metadata")
            .and_then(|m| m.get(METADATA_KEY))
            .and_then(Value::as_str)
            .filter(|k| !k.is_empty())?;
        Some((key, Self::payment_intent_outcome(pi)))
    }

    /// The search query for a provider key.
    pub fn search_query(provider_key: &str) -> String {
        let escaped = provider_key.replace('\\', "\\\\").replace('\'', "\\'");
        format!("metadata['{METADATA_KEY}']:'{escaped}'")
    }

    /// The answer a create call that made the PaymentIntent `pi` gave, as it stands now: what
    /// a lookup by search rebuilds, and what a webhook event carrying `pi` settles a key with
    /// (see the module docs).
    pub fn payment_intent_outcome(pi: &Value) -> Outcome {
        let status = pi.get("status").and_then(Value::as_str).unwrap_or("");
        let as_json = |code: u16, v: &Value| {
            StoredResponse::from_parts(
                code,
                vec![("content-type".to_owned(), "application/json".to_owned())],
                serde_json::to_vec(v).unwrap_or_default(),
            )
        };
        // Only a payment error Stripe recorded is a decline: the create call was refused with
        // it (402). Any other PaymentIntent (succeeded, waiting for a payment method or an
        // action, canceled after authorisation) was created by the call, which answered 200
        // with it: replay what Stripe holds now.
        let last_error = pi
            .get("last_payment_error")
            .filter(|e| e.is_object())
            .cloned();
        match (status, last_error) {
            ("requires_payment_method", Some(mut error)) => {
                if let Value::Object(m) = &mut error {
                    m.insert("payment_intent".to_owned(), pi.clone());
                }
                Outcome::Rejected(as_json(402, &json!({ "error": error })))
            }
            _ => Outcome::Succeeded(as_json(200, pi)),
        }
    }
}

/// The members of the request object flattened into form fields, but `skip` and
/// [`ACCOUNT_FIELD`]; an error when the request is not an object or names no valid account.
fn form_without(request: &Value, skip: &[&str]) -> Result<Vec<(String, String)>, String> {
    let Value::Object(map) = request else {
        return Err("a Stripe request must be a JSON object of parameters".to_owned());
    };
    Stripe::account(request)?;
    let mut out = Vec::new();
    for (k, v) in map {
        if k != ACCOUNT_FIELD && !skip.contains(&k.as_str()) {
            flatten(k.clone(), v, &mut out);
        }
    }
    Ok(out)
}

/// The Stripe object id in member `field` of `request`, if present: one of `prefixes` followed by
/// letters, digits or `_` (so it can travel in a path), at most 255 characters.
fn object_id<'a>(
    request: &'a Value,
    field: &str,
    prefixes: &[&str],
) -> Result<Option<&'a str>, String> {
    let Some(v) = request.get(field) else {
        return Ok(None);
    };
    let id = v.as_str().unwrap_or_default();
    let valid = id.len() <= 255
        && prefixes.iter().any(|p| {
            id.strip_prefix(p).is_some_and(|rest| {
                !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            })
        });
    if valid {
        Ok(Some(id))
    } else {
        Err(format!(
            "`{field}` must be a Stripe id starting with {}, got {v}",
            prefixes.join(" or ")
        ))
    }
}

impl Stripe {
    /// `GET path?query` on the connected `account` (if any), for a lookup: the JSON answer of
    /// a 200; a 404 (no such object: the request under the key surely did nothing to it) is an
    /// authoritative not-found, anything else an unknown.
    async fn retrieve(
        &self,
        path: &str,
        query: &[(&str, &str)],
        account: Option<&str>,
    ) -> Result<Value, Lookup> {
        let mut req = self
            .endpoint
            .request(reqwest::Method::GET, path)
            .query(query);
        if let Some(acct) = account {
            req = req.header("Stripe-Account", acct);
        }
        let reply = match self.endpoint.http().send_once(req).await {
            Ok(r) => r,
            Err(outcome) => {
                tracing::warn!(provider = %self.endpoint.name(), ?outcome, "retrieve failed");
                return Err(Lookup::Unknown { retry_after: None });
            }
        };
        match reply.status {
            200 => reply.json().ok_or(Lookup::Unknown { retry_after: None }),
            404 => Err(Lookup::NotFound {
                authoritative: true,
            }),
            status => {
                tracing::warn!(provider = %self.endpoint.name(), status, body = %super::http::body_snippet(&reply.body), "retrieve refused");
                Err(Lookup::Unknown {
                    retry_after: reply.retry_after(),
                })
            }
        }
    }

}

/// One key's lookup, as an operation that reads its object back (a capture, a refund) is given
/// it: the adapter, the key's provider key, its stored request (`Null` when not stored), the
/// connected account the request names, and the key's attempts as of `now`.
struct KeyLookup<'a> {
    stripe: &'a Stripe,
    provider_key: &'a str,
    request: &'a Value,
    account: Option<&'a str>,
    attempts: Attempts,
    now: DateTime<Utc>,
}

impl KeyLookup<'_> {
    /// Whether a lookup that found no effect of the key's request may say so for certain: the
    /// latest attempt is at least `search_lag` old, so Stripe is no longer running it.
    fn absence_is_authoritative(&self) -> bool {
        super::search::empty_result_is_authoritative(
            self.attempts,
            self.now,
            self.stripe.search_lag,
            None,
        )
    }
}

/// The answer a call that returned `object` with 200 gave.
fn ok_json(object: &Value) -> Outcome {
    Outcome::Succeeded(StoredResponse::from_parts(
        200,
        vec![("content-type".to_owned(), "application/json".to_owned())],
        serde_json::to_vec(object).unwrap_or_default(),
    ))
}

/// Flattens a JSON value into Stripe's bracketed form fields; nulls are left out.
fn flatten(prefix: String, v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Null => {}
        Value::Bool(b) => out.push((prefix, b.to_string())),
        Value::Number(n) => out.push((prefix, n.to_string())),
        Value::String(s) => out.push((prefix, s.clone())),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                flatten(format!("{prefix}[{i}]"), item, out);
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                flatten(format!("{prefix}[{k}]"), item, out);
            }
        }
    }
}

/// Whether a reply of `status` with error type `err_type` is a card decline: Stripe ran the
/// key's request and saved the decline as the key's answer (`docs/providers.md`, "Error ->
/// outcome", "Cards").
fn declined(status: u16, err_type: &str) -> bool {
    status == 402 && err_type == "card_error"
}

#[async_trait]
impl Provider for Stripe {
    fn name(&self) -> &str {
        self.endpoint.name()
    }

    /// A PaymentIntent's `client_secret` lets whoever holds it confirm the payment from a
    /// browser: never stored.
    fn secret_fields(&self) -> &[&str] {
        &["client_secret"]
    }

    /// A card decline (402 `card_error`) under the key: Stripe saves the result of the first
    /// request that ran under a key and answers every later one with it, and answers 409 while
    /// that request still runs, so a decline is the key's own answer however many attempts were
    /// made; any other refusal is left to the sweeper.
    fn definitive_refusal(&self, response: &StoredResponse) -> bool {
        (200..300).contains(&response.status()) || Self::is_decline(response)
    }

    fn key_spec(&self) -> KeySpec {
        KeySpec {
            max_len: 255,
            retention: Some(Duration::from_secs(24 * 3600)),
            replays_same_key: true,
        }
    }

    async fn send(&self, provider_key: &str, request: &Value) -> CallReply {
        self.endpoint.traced(Method::Call, provider_key, async move {
            let built = match self.operation {
                StripeOperation::CreatePayment => Self::form_fields(provider_key, request)
                    .map(|fields| ("/v1/payment_intents".to_owned(), fields)),
                StripeOperation::Capture => capture::form(request),
                StripeOperation::Refund => refund::form(provider_key, request),
            };
            let (path, fields) = match built {
                Ok(f) => f,
                Err(detail) => {
                    let error = json!({"type": "idemflow_invalid_request", "message": detail});
                    return refused_unsent(400, &json!({ "error": error }));
                }
            };
            // Checked by `form_fields` above.
            let account = Self::account(request).ok().flatten();
            self.endpoint
                .send(
                    RetryUnknown::SameKeyReplays,
                    &path,
                    |req| {
                        let req = req.header("Idempotency-Key", provider_key).form(&fields);
                        match account {
                            Some(acct) => req.header("Stripe-Account", acct),
                            None => req,
                        }
                    },
                    Self::classify,
                )
                .await
        })
        .await
    }

    async fn lookup(
        &self,
        provider_key: &str,
        request: &Value,
        attempts: Attempts,
        now: DateTime<Utc>,
    ) -> Lookup {
        self.endpoint.traced(Method::Lookup, provider_key, async move {
            // A request that could not name its account was never sent: nothing to find.
            let Ok(account) = Self::account(request) else {
                return Lookup::NotFound {
                    authoritative: true,
                };
            };
            let key = KeyLookup {
                stripe: self,
                provider_key,
                request,
                account,
                attempts,
                now,
            };
            match self.operation {
                StripeOperation::CreatePayment => {}
                StripeOperation::Capture => return capture::lookup(&key).await,
                StripeOperation::Refund => return refund::lookup(&key).await,
            }
            let query = Self::search_query(provider_key);
            let found = MetadataSearch {
                path: "/v1/payment_intents/search",
                query: &[("query", query.as_str()), ("limit", "10")],
                results: "data",
                search_lag: self.search_lag,
                retention: None,
            }
            .run_as(
                &self.endpoint,
                account.map(|acct| ("Stripe-Account", acct)),
                attempts,
                now,
                Self::payment_intent_outcome,
            )
            .await;
            match found {
                // Without the request, the connected account it may have named is unknown: the
                // platform's search proves nothing absent there.
                Lookup::NotFound { .. } if request.is_null() => Lookup::NeedsOperator {
                    reason: format!(
                        "the request was not stored, so the connected account it may have named \
                         ({ACCOUNT_FIELD}) is unknown, and the platform account holds no \
                         PaymentIntent with metadata {METADATA_KEY}={provider_key}; an operator \
                         must check the connected accounts"
                    ),
                },
                found => found,
            }
        })
        .await
    }
}
