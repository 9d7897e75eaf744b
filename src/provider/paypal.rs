//! PayPal Orders v2 (feature `http`).
//!
//! `send` sends `POST /v2/checkout/orders` with the canonical JSON request as the body (PayPal's
//! own fields: `intent`, `purchase_units`, `payment_source`, ...), `PayPal-Request-Id: <provider
//! key>` (1 to 108 characters for Orders v2, so keys are derived with `max_len` 108) and an OAuth
//! access token as `Authorization: Bearer` (the adapter does not fetch or refresh the token).
//!
//! A re-send with the same `PayPal-Request-Id` does not act again: PayPal "returns the **latest
//! status** of the previous request", the order as it stands *now* (approved, completed,
//! voided), not the first answer. Orders v2 keeps the id for only **6 hours** (72 h on request
//! through an account manager: set [`PayPal::retention`]). So the adapter's retry loop re-sends
//! after an unknown outcome, the sweeper re-drives inside the window less its margin, and
//! `lookup` is a re-send there too: whatever the order's state, the order was created by the
//! call, so the current order settles the key as done (`COMPLETED` -> done with the completed
//! order, `CREATED` / `APPROVED` -> done with the order awaiting the buyer, and so on). Past the
//! window less [`PayPal::redrive_margin`] nothing is re-sent and the key needs an operator
//! (Transaction Search lags up to 3 h and cannot filter by our id).
//!
//! | PayPal answers                                                  | [`CallReply`]             |
//! |-----------------------------------------------------------------|-----------------------------|
//! | 2xx (the order, as it stands)                                    | `Succeeded`                 |
//! | 422 `PAYPAL_REQUEST_ID_PREVIOUSLY_USED` / `DUPLICATE_REQUEST_ID` | `KeyConflict`               |
//! | 400, 404, 422 (`INVALID_REQUEST`, `UNPROCESSABLE_ENTITY`: e.g. `INSTRUMENT_DECLINED`) | `Rejected` |
//! | 401, 403 (token or permissions: nothing was done)                | `Retryable`                 |
//! | 409 (two requests with one id at once: "might fail the second")  | `InFlight`                  |
//! | 429 (`RATE_LIMIT_REACHED`)                                       | `Retryable { retry_after }` |
//! | 5xx, anything else, timeouts after sending                       | `Unknown`                   |
//!
//! After an attempt of the same call that may have acted (a 5xx, a timeout, a 409), a refusal is
//! `Unknown`, not `Rejected`: PayPal "processes the first … might fail the second", so the
//! second's refusal says nothing about the first, and the sweeper settles the key.

use std::time::Duration;

use super::CallReply;
use super::answers::Answers;
use super::endpoint::{Auth, Endpoint, http_adapter};
use super::http::{Classified, HttpReply};
use super::replay::same_key_provider;

/// PayPal's REST API base (live; the sandbox is `https://api-m.sandbox.paypal.com`).
pub const DEFAULT_BASE_URL: &str = "https://api-m.paypal.com";
/// Create order.
pub const ORDERS_PATH: &str = "/v2/checkout/orders";
/// How long Orders v2 keeps a `PayPal-Request-Id` by default.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(6 * 3600);
/// The longest `PayPal-Request-Id` Orders v2 accepts.
pub const KEY_MAX_LEN: usize = 108;
/// Default margin kept before the end of the retention when re-sending as a lookup.
pub const DEFAULT_REDRIVE_MARGIN: Duration = super::DEFAULT_REDRIVE_MARGIN;

const KEPT_HEADERS: &[&str] = &["paypal-debug-id"];

const ANSWERS: Answers = Answers {
    provider: "PayPal",
    credential: "access token",
    effect: "done",
    kept_headers: KEPT_HEADERS,
    in_flight_on_409: true,
    rejects: |s| matches!(s, 400 | 404 | 405 | 415 | 422),
};

/// PayPal Orders v2 (create order).
#[derive(Debug, Clone)]
pub struct PayPal {
    endpoint: Endpoint,
    retention: Duration,
    redrive_margin: Duration,
}

http_adapter!(PayPal {
    name: "paypal",
    key: "an OAuth access token",
    auth: Auth::Bearer,
    headers: &[("Prefer", "return=representation")],
    settings: {
        /// Sets how long PayPal keeps a `PayPal-Request-Id` for this account (default 6 h; 72 h
        /// when PayPal raised it). Never set it longer than PayPal confirmed.
        retention: Duration = DEFAULT_RETENTION,
        /// Sets the margin kept before the end of the retention: `lookup` re-sends only while
        /// `age + margin < retention`. Keep it at least the sweeper's `redrive_margin`.
        redrive_margin: Duration = DEFAULT_REDRIVE_MARGIN,
    },
});

impl PayPal {
    fn classify(reply: &HttpReply) -> Classified {
        let name = reply.json_str("/name").unwrap_or_default();
        let issue = reply.json_str("/details/0/issue").unwrap_or_default();
        let message = reply.message("/message");
        let reused = |s: &str| {
            matches!(
                s,
                "PAYPAL_REQUEST_ID_PREVIOUSLY_USED" | "DUPLICATE_REQUEST_ID"
            )
        };
        let outcome = match reply.status {
            200..=299 => ANSWERS.succeeded(reply, false),
            _ if reused(&issue) || reused(&name) => CallReply::KeyConflict {
                detail: format!("{name} {issue}: {message}"),
            },
            _ => ANSWERS.classify(reply, Some(&name), &message),
        };
        Classified::new(outcome)
    }
}

same_key_provider!(PayPal {
    provider: "PayPal",
    path: ORDERS_PATH,
    key_header: "PayPal-Request-Id",
    max_len: KEY_MAX_LEN,
    key_window: |paypal| paypal.retention,
});
