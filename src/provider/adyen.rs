//! Adyen Checkout payments (feature `http`).
//!
//! `send` sends `POST /v71/payments` with the canonical JSON request as the body (Adyen's own
//! fields: `amount`, `reference`, `paymentMethod`, `merchantAccount`, ...), `Idempotency-Key:
//! <provider key>` (at most 64 characters, so keys are derived with `max_len` 64) and the API
//! key in `X-API-Key`.
//!
//! Adyen keeps a key for at least 31 days and answers a same-key re-send with "the response to
//! the first attempt"; it has no replay marker (the `Idempotency-Key` header it echoes is on
//! every answer). So the adapter's retry loop re-sends after an unknown outcome, the sweeper
//! re-drives inside the window, and `lookup` is a re-send while the key is surely remembered
//! (younger than 31 days minus [`Adyen::redrive_margin`]): Adyen has no search by our key.
//!
//! | Adyen answers                                                 | [`CallReply`](super::CallReply) |
//! |---------------------------------------------------------------|-----------------------------|
//! | 2xx, `resultCode` `Refused`, `Cancelled` or `Error`           | `Rejected` (the answer is stored) |
//! | 2xx, any other `resultCode` (`Authorised`, `Pending`, ...)     | `Succeeded`                 |
//! | 400, 404, 422 (validation, unknown merchant account, ...)      | `Rejected`                  |
//! | 401, 403 (API key or permissions: nothing was done)            | `Retryable`                 |
//! | 409 (not documented by Adyen; treated as "a request with this key is running") | `InFlight` |
//! | 429                                                            | `Retryable { retry_after }` |
//! | 5xx, anything else, timeouts after sending                     | `Unknown`                   |
//!
//! After an attempt of the same call that may have acted (a 5xx, a timeout, a 409), only a 2xx
//! with a refused `resultCode` (the answer about the key's payment) still ends the call
//! `Rejected`; a 4xx then is `Unknown` and the sweeper settles the key.

use std::time::Duration;

use super::answers::Answers;
use super::endpoint::{Auth, Endpoint, http_adapter};
use super::http::{Classified, HttpReply};
use super::replay::same_key_provider;

/// Adyen's Checkout API base (test environment; live accounts use their own prefix URL).
pub const DEFAULT_BASE_URL: &str = "https://checkout-test.adyen.com";
/// The payments path.
pub const PAYMENTS_PATH: &str = "/v71/payments";
/// How long Adyen remembers a key (at least).
pub const RETENTION: Duration = Duration::from_secs(31 * 24 * 3600);
/// The longest key Adyen accepts.
pub const KEY_MAX_LEN: usize = 64;
/// Default margin kept before the end of [`RETENTION`] when re-sending as a lookup.
pub const DEFAULT_REDRIVE_MARGIN: Duration = super::DEFAULT_REDRIVE_MARGIN;

/// The headers of Adyen's answer kept in the answer idemflow stores (besides `content-type`):
/// none. The `Idempotency-Key` Adyen echoes is our provider key, not the client's, and the PSP
/// reference is in the body (`pspReference`).
const KEPT_HEADERS: &[&str] = &[];

const ANSWERS: Answers = Answers {
    provider: "Adyen",
    credential: "API key",
    effect: "done",
    kept_headers: KEPT_HEADERS,
    in_flight_on_409: true,
    rejects: |s| matches!(s, 400 | 404 | 405 | 413 | 415 | 422),
};

/// Adyen Checkout `/payments`.
#[derive(Debug, Clone)]
pub struct Adyen {
    endpoint: Endpoint,
    redrive_margin: Duration,
}

http_adapter!(Adyen {
    name: "adyen",
    key: "an API key (sent as `X-API-Key`)",
    auth: Auth::Header("X-API-Key"),
    headers: &[("Accept", "application/json")],
    settings: {
        /// Sets the margin kept before the end of Adyen's 31-day key window: `lookup` re-sends
        /// only while `age + margin < 31 days`. Keep it at least the sweeper's `redrive_margin`.
        redrive_margin: Duration = DEFAULT_REDRIVE_MARGIN,
    },
});

impl Adyen {
    fn classify(reply: &HttpReply) -> Classified {
        if (200..=299).contains(&reply.status) {
            // The payment made under the key, as the provider reports it: a refusal is
            // definitive.
            let result = reply.json_str("/resultCode").unwrap_or_default();
            let refused = matches!(result.as_str(), "Refused" | "Cancelled" | "Error");
            return ANSWERS.payment(reply, refused);
        }
        Classified::new(ANSWERS.classify(reply, None, &reply.message("/message")))
    }
}

same_key_provider!(Adyen {
    provider: "Adyen",
    path: PAYMENTS_PATH,
    key_header: "Idempotency-Key",
    max_len: KEY_MAX_LEN,
    key_window: |_| RETENTION,
});
