//! Square payments (feature `http`), with **void by key**.
//!
//! `send` sends `POST /v2/payments` with the canonical JSON request as the body (Square's own
//! fields: `source_id`, `amount_money`, `location_id`, `autocomplete`, ...) and our provider key
//! as the body's `idempotency_key` (CreatePayment takes at most 45 characters, so keys are
//! derived with `max_len` 45). A same-key, same-body re-send returns "the first successful
//! response" and takes no second payment.
//!
//! | Square answers                                                  | [`CallReply`]             |
//! |-----------------------------------------------------------------|-----------------------------|
//! | 2xx with a payment `COMPLETED`, `APPROVED` or `PENDING`          | `Succeeded`                 |
//! | 2xx with a payment `CANCELED` or `FAILED` (e.g. voided by key)   | `Rejected` (stored as answered) |
//! | `IDEMPOTENCY_KEY_REUSED` (same key, other body)                  | `KeyConflict`               |
//! | category `PAYMENT_METHOD_ERROR` (card declined, ...)             | `Rejected`                  |
//! | other 400, 402, 404, 422 (invalid request)                       | `Rejected`                  |
//! | 401, 403 (access token or permissions: nothing was done)         | `Retryable`                 |
//! | 409 (not documented for CreatePayment; a request with this key is running) | `InFlight`        |
//! | 429 (category `RATE_LIMIT_ERROR`)                                | `Retryable { retry_after }` |
//! | `TEMPORARY_ERROR` ("safely retry … with the same key"), 5xx, timeouts | `Unknown` (re-sent with the same key) |
//!
//! After an attempt of the same call that may have acted (a 5xx, a timeout, a 409), only a 2xx
//! reporting the key's payment `CANCELED` or `FAILED` still ends the call `Rejected`: Square does
//! not document what a same-key request gets while the first is running, so a 4xx refusal then
//! (a decline included) is `Unknown` and the sweeper settles the key.
//!
//! **Void by key.** Square's `CancelPaymentByIdempotencyKey` (`POST /v2/payments/cancel`) is made
//! "when the status of a CreatePayment request is unknown": it voids the payment made with the
//! key, and succeeds when there is none. [`Square::void_by_key`] sends it; the sweeper tries it
//! before a lookup:
//!
//! | CancelPaymentByIdempotencyKey answers                   | [`VoidReply`]                       |
//! |---------------------------------------------------------|---------------------------------------|
//! | 200 without `errors`                                    | `Voided`: nothing stands charged; the key turns retryable once the latest attempt is [`Square::processing_window`] old (sooner: checked again after it) |
//! | 400 / 404 (the payment cannot be voided: it completed or failed) | `Refused`: look it up         |
//! | 401, 403, 429, 5xx, transport failure                   | `Unknown`                             |
//!
//! The void is not sent for a delayed capture (`"autocomplete": false`): it would destroy the
//! authorisation rather than undo a charge, and Square keeps the key, so the retry could not
//! authorise again. Such a key is looked up instead ([`VoidReply::Unsupported`]).
//!
//! `lookup` is a same-key re-send of the stored request, answered from the payment Square holds
//! under the key. Square does not document how long it remembers a key, so the [`KeySpec`] has
//! no retention (the sweeper never re-drives), and the sweeper looks a key up only after the void
//! was refused, which shows Square holds a payment under the key (or for a delayed capture).

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::endpoint::{Auth, Endpoint, http_adapter};
use super::answers::{Answers, refused_unsent};
use super::http::{Classified, HttpReply, RetryUnknown};
use super::replay::answer_of_resend;
use super::spans::Method;
use super::{Attempts, CallReply, KeySpec, Lookup, Provider, VoidReply};

/// Square's API base (production; the sandbox is `https://connect.squareupsandbox.com`).
pub const DEFAULT_BASE_URL: &str = "https://connect.squareup.com";
/// CreatePayment.
pub const PAYMENTS_PATH: &str = "/v2/payments";
/// CancelPaymentByIdempotencyKey.
pub const CANCEL_BY_KEY_PATH: &str = "/v2/payments/cancel";
/// The longest `idempotency_key` CreatePayment accepts.
pub const KEY_MAX_LEN: usize = 45;
/// How long after a CreatePayment was sent Square may still make the payment, by default: a
/// void by key answered sooner does not make the key retryable. Square does not document how
/// long a CreatePayment can run on its side; five minutes is well past any client timeout
/// (`HttpConfig::total_deadline` is 165 s by default). Set it with [`Square::processing_window`].
pub const DEFAULT_PROCESSING_WINDOW: std::time::Duration = std::time::Duration::from_secs(300);
/// The Square API version sent in `Square-Version`.
pub const API_VERSION: &str = "2025-01-23";

const ANSWERS: Answers = Answers {
    provider: "Square",
    credential: "access token",
    effect: "done",
    kept_headers: &[],
    in_flight_on_409: true,
    rejects: |s| matches!(s, 400 | 402 | 404 | 405 | 413 | 415 | 422),
};

/// Square Payments API (CreatePayment, CancelPaymentByIdempotencyKey).
#[derive(Debug, Clone)]
pub struct Square {
    endpoint: Endpoint,
    processing_window: std::time::Duration,
}

http_adapter!(Square {
    name: "square",
    key: "an access token",
    auth: Auth::Bearer,
    headers: &[("Square-Version", API_VERSION), ("Accept", "application/json")],
    settings: {
        /// Sets how long after a CreatePayment was sent Square may still make the payment
        /// (default [`DEFAULT_PROCESSING_WINDOW`]): a void by key confirmed sooner after the key's
        /// latest attempt leaves the key processing, and the sweeper voids (or finds the payment)
        /// again once the window has passed.
        processing_window: std::time::Duration = DEFAULT_PROCESSING_WINDOW,
    },
});

impl Square {
    /// The body sent for `request` with `provider_key`: the request with `idempotency_key` set.
    pub fn body(provider_key: &str, request: &Value) -> Result<Value, String> {
        let Value::Object(map) = request else {
            return Err(
                "a Square request must be a JSON object of CreatePayment fields".to_owned(),
            );
        };
        let mut map = map.clone();
        map.insert(
            "idempotency_key".to_owned(),
            Value::String(provider_key.to_owned()),
        );
        Ok(Value::Object(map))
    }

    fn first_error(reply: &HttpReply) -> (String, String, String) {
        let body = reply.json().unwrap_or(Value::Null);
        let e = body.pointer("/errors/0").cloned().unwrap_or(Value::Null);
        let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        (s("category"), s("code"), s("detail"))
    }

    fn classify(reply: &HttpReply) -> Classified {
        let status = reply.status;
        if (200..=299).contains(&status) {
            // The payment made under the key, as the provider reports it: a refusal is
            // definitive.
            let state = reply.json_str("/payment/status").unwrap_or_default();
            return ANSWERS.payment(reply, matches!(state.as_str(), "CANCELED" | "FAILED"));
        }
        let (category, code, detail) = Self::first_error(reply);
        let outcome = if code == "IDEMPOTENCY_KEY_REUSED" {
            CallReply::KeyConflict { detail }
        } else if code == "TEMPORARY_ERROR" {
            CallReply::Unknown {
                reason: format!("Square {status} TEMPORARY_ERROR: {detail}"),
            }
        } else if category == "PAYMENT_METHOD_ERROR" {
            ANSWERS.rejected(reply)
        } else {
            ANSWERS.classify(reply, Some(&code), &detail)
        };
        Classified::new(outcome)
    }

    fn classify_void(reply: &HttpReply) -> VoidReply {
        let status = reply.status;
        let (_, code, detail) = Self::first_error(reply);
        let has_errors = reply
            .json()
            .and_then(|b| b.get("errors").and_then(Value::as_array).map(|a| !a.is_empty()))
            .unwrap_or(false);
        match status {
            200..=299 if !has_errors => VoidReply::Voided {
                detail: "Square voided the payment made with this key, or there was none"
                    .to_owned(),
            },
            400 | 404 => VoidReply::Refused {
                reason: format!("Square refused to void ({status} {code}): {detail}"),
            },
            _ => VoidReply::Unknown {
                reason: format!("Square answered the void with {status} {code}: {detail}"),
                retry_after: reply.retry_after(),
            },
        }
    }
}

#[async_trait]
impl Provider for Square {
    fn name(&self) -> &str {
        self.endpoint.name()
    }

    fn key_spec(&self) -> KeySpec {
        KeySpec {
            max_len: KEY_MAX_LEN,
            retention: None,
            replays_same_key: true,
        }
    }

    async fn send(&self, provider_key: &str, request: &Value) -> CallReply {
        self.endpoint.traced(Method::Call, provider_key, async move {
            let body = match Self::body(provider_key, request) {
                Ok(b) => b,
                Err(detail) => {
                    let error = json!({"category": "INVALID_REQUEST_ERROR",
                                       "code": "BAD_REQUEST", "detail": detail});
                    return refused_unsent(400, &json!({ "errors": [error] }));
                }
            };
            self.endpoint
                .send(
                    RetryUnknown::SameKeyReplays,
                    PAYMENTS_PATH,
                    |req| req.json(&body),
                    Self::classify,
                )
                .await
        })
        .await
    }

    fn processing_window(&self) -> std::time::Duration {
        self.processing_window
    }

    async fn void_by_key(&self, provider_key: &str, request: &Value) -> VoidReply {
        self.endpoint.traced(Method::VoidByKey, provider_key, async move {
            if request.get("autocomplete") == Some(&Value::Bool(false)) {
                // A delayed capture: voiding would destroy the authorisation under a key Square
                // keeps; a same-key re-send finds it instead.
                return VoidReply::Unsupported;
            }
            let req = self
                .endpoint
                .request(reqwest::Method::POST, CANCEL_BY_KEY_PATH)
                .json(&json!({ "idempotency_key": provider_key }));
            match self.endpoint.http().send_once(req).await {
                Ok(reply) => Self::classify_void(&reply),
                Err(outcome) => VoidReply::Unknown {
                    reason: format!("the void did not get an answer: {outcome:?}"),
                    retry_after: None,
                },
            }
        })
        .await
    }

    async fn lookup(
        &self,
        provider_key: &str,
        request: &Value,
        _attempts: Attempts,
        _now: DateTime<Utc>,
    ) -> Lookup {
        self.endpoint.traced(Method::Lookup, provider_key, async move {
            if request.is_null() {
                return Lookup::NeedsOperator {
                    reason: "the request was not stored, so it cannot be re-sent, and Square cannot be searched by our key".to_owned(),
                };
            }
            answer_of_resend("Square", self.send(provider_key, request).await)
        })
        .await
    }
}
