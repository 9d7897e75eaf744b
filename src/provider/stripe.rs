//! Stripe PaymentIntents (feature `http`).
//!
//! `call` sends `POST /v1/payment_intents`, form-encoded, with `Idempotency-Key: <provider key>`
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
//! | Stripe answers                                        | [`CallOutcome`]                  |
//! |-------------------------------------------------------|----------------------------------|
//! | 2xx (`Idempotent-Replayed: true` sets `replayed`)     | `Succeeded`                      |
//! | 402 (`card_error`: declined)                          | `Rejected`                       |
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

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::http::{
    ApiKey, Classified, HttpClient, HttpConfig, HttpError, HttpReply, RetryUnknown, body_snippet,
    classify_status,
};
use super::{CallOutcome, KeySpec, Lookup, Provider};
use crate::{Outcome, StoredResponse};

/// Stripe's API base.
pub const DEFAULT_BASE_URL: &str = "https://api.stripe.com";
/// The metadata field that carries our key.
pub const METADATA_KEY: &str = "idemflow_key";
/// Default margin before an empty search result is trusted.
pub const DEFAULT_SEARCH_LAG: Duration = Duration::from_secs(60);

const KEPT_HEADERS: &[&str] = &["request-id", "idempotent-replayed"];

/// Stripe PaymentIntents (create + confirm).
#[derive(Debug, Clone)]
pub struct Stripe {
    name: String,
    base_url: String,
    api_key: ApiKey,
    http: HttpClient,
    search_lag: Duration,
}

impl Stripe {
    /// Stripe at its real API base, with a secret key (`sk_...`).
    pub fn new(api_key: impl Into<String>) -> Result<Self, HttpError> {
        Self::with_base_url(DEFAULT_BASE_URL, api_key)
    }

    /// Stripe at another base URL (a fake server, a proxy), e.g. `http://127.0.0.1:4242`.
    pub fn with_base_url(base_url: &str, api_key: impl Into<String>) -> Result<Self, HttpError> {
        Ok(Self {
            name: "stripe".to_owned(),
            base_url: super::http::base_url(base_url)?,
            api_key: ApiKey::new(api_key)?,
            http: HttpClient::new(HttpConfig::default())?,
            search_lag: DEFAULT_SEARCH_LAG,
        })
    }

    /// Sets the name stored in key rows (default `stripe`).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Replaces the timeouts and retry settings.
    pub fn http_config(mut self, config: HttpConfig) -> Result<Self, HttpError> {
        self.http = HttpClient::new(config)?;
        Ok(self)
    }

    /// Sets how long after the first send an empty search result is still not trusted.
    pub fn search_lag(mut self, lag: Duration) -> Self {
        self.search_lag = lag;
        self
    }

    /// The base URL in use.
    pub fn base_url(&self) -> &str {
        &self.base_url
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
        let mut out = Vec::new();
        for (k, v) in map {
            flatten(k.clone(), v, &mut out);
        }
        let meta = format!("metadata[{METADATA_KEY}]");
        out.retain(|(k, _)| *k != meta);
        if !map.contains_key("confirm") {
            out.push(("confirm".to_owned(), "true".to_owned()));
        }
        out.push((meta, provider_key.to_owned()));
        Ok(out)
    }

    fn classify(reply: &HttpReply) -> Classified {
        let body = reply.json();
        let err = body.as_ref().and_then(|b| b.get("error"));
        let err_type = err
            .and_then(|e| e.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let err_code = err
            .and_then(|e| e.get("code"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let message = err
            .and_then(|e| e.get("message"))
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| body_snippet(&reply.body));
        let should_retry = reply
            .header("stripe-should-retry")
            .map(|v| v.eq_ignore_ascii_case("true"));
        let status = reply.status;
        let outcome = match status {
            200..=299 => CallOutcome::Succeeded {
                response: reply.to_response(KEPT_HEADERS),
                replayed: reply
                    .header("idempotent-replayed")
                    .is_some_and(|v| v.eq_ignore_ascii_case("true")),
            },
            402 => CallOutcome::Rejected {
                response: reply.to_response(KEPT_HEADERS),
            },
            400 if err_type == "idempotency_error" => CallOutcome::KeyConflict { detail: message },
            409 => CallOutcome::InFlight {
                retry_after: reply.retry_after(),
            },
            429 => CallOutcome::Retryable {
                reason: format!("Stripe 429 {err_code}: {message}"),
                retry_after: reply.retry_after(),
            },
            401 | 403 => CallOutcome::Retryable {
                reason: format!(
                    "Stripe refused the API key ({status}), nothing was done: {message}"
                ),
                retry_after: None,
            },
            400..=499 if status != 424 => CallOutcome::Rejected {
                response: reply.to_response(KEPT_HEADERS),
            },
            _ if should_retry == Some(true) => CallOutcome::Retryable {
                reason: format!("Stripe {status} with Stripe-Should-Retry: true: {message}"),
                retry_after: reply.retry_after(),
            },
            _ => classify_status(reply),
        };
        match should_retry {
            Some(false) => Classified::final_answer(outcome),
            _ => Classified::new(outcome),
        }
    }

    /// The search query for a provider key.
    pub fn search_query(provider_key: &str) -> String {
        let escaped = provider_key.replace('\\', "\\\\").replace('\'', "\\'");
        format!("metadata['{METADATA_KEY}']:'{escaped}'")
    }

    fn found(pi: &Value) -> Outcome {
        let status = pi.get("status").and_then(Value::as_str).unwrap_or("");
        let as_json = |code: u16, v: &Value| {
            StoredResponse::from_parts(
                code,
                vec![("content-type".to_owned(), "application/json".to_owned())],
                serde_json::to_vec(v).unwrap_or_default(),
            )
        };
        match status {
            "requires_payment_method" | "canceled" => {
                // Rebuild the decline answer Stripe gave to the create call.
                let last = pi.get("last_payment_error").cloned().unwrap_or(Value::Null);
                let mut error = match last {
                    Value::Object(m) => Value::Object(m),
                    _ => {
                        json!({"type": "card_error", "message": format!("payment intent is {status}")})
                    }
                };
                if let Value::Object(m) = &mut error {
                    m.insert("payment_intent".to_owned(), pi.clone());
                }
                Outcome::Rejected(as_json(402, &json!({ "error": error })))
            }
            _ => Outcome::Succeeded(as_json(200, pi)),
        }
    }
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

#[async_trait]
impl Provider for Stripe {
    fn name(&self) -> &str {
        &self.name
    }

    fn key_spec(&self) -> KeySpec {
        KeySpec {
            max_len: 255,
            retention: Some(Duration::from_secs(24 * 3600)),
            replays_same_key: true,
        }
    }

    #[tracing::instrument(name = "idemflow.provider.call", skip_all, fields(provider = %self.name, provider_key = %provider_key))]
    async fn call(&self, provider_key: &str, request: &Value) -> CallOutcome {
        let fields = match Self::form_fields(provider_key, request) {
            Ok(f) => f,
            Err(detail) => {
                return CallOutcome::Rejected {
                    response: StoredResponse::json(
                        400,
                        &json!({"error": {"type": "idemflow_invalid_request", "message": detail}}),
                    )
                    .unwrap_or_else(|_| StoredResponse::new(400)),
                };
            }
        };
        let url = format!("{}/v1/payment_intents", self.base_url);
        let outcome = self
            .http
            .send(
                RetryUnknown::SameKeyReplays,
                |c| {
                    c.post(&url)
                        .bearer_auth(self.api_key.expose())
                        .header("Idempotency-Key", provider_key)
                        .form(&fields)
                },
                Self::classify,
            )
            .await;
        tracing::debug!(?outcome, "stripe call");
        outcome
    }

    #[tracing::instrument(name = "idemflow.provider.lookup", skip_all, fields(provider = %self.name, provider_key = %provider_key))]
    async fn lookup(
        &self,
        provider_key: &str,
        _request: &Value,
        first_sent_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Lookup {
        let url = format!("{}/v1/payment_intents/search", self.base_url);
        let query = Self::search_query(provider_key);
        let req = self
            .http
            .inner()
            .get(&url)
            .bearer_auth(self.api_key.expose())
            .query(&[("query", query.as_str()), ("limit", "10")]);
        let reply = match self.http.send_once(req).await {
            Ok(r) => r,
            Err(outcome) => {
                tracing::warn!(?outcome, "stripe search failed");
                return Lookup::Unknown { retry_after: None };
            }
        };
        if reply.status != 200 {
            tracing::warn!(status = reply.status, body = %body_snippet(&reply.body), "stripe search refused");
            return Lookup::Unknown {
                retry_after: reply.retry_after(),
            };
        }
        let Some(data) = reply.json().and_then(|b| b.get("data").cloned()) else {
            return Lookup::Unknown { retry_after: None };
        };
        match data.as_array().and_then(|d| d.first()) {
            Some(pi) => Lookup::Found(Self::found(pi)),
            None => {
                let age = (now - first_sent_at).to_std().unwrap_or_default();
                Lookup::NotFound {
                    authoritative: age >= self.search_lag,
                }
            }
        }
    }
}
