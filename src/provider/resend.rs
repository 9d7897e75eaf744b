//! Resend emails (feature `http`).
//!
//! `send` sends `POST /emails` with the canonical JSON request as the body (Resend's own fields:
//! `from`, `to`, `subject`, `html`, `text`, ...) and `Idempotency-Key: <provider key>`.
//!
//! | Resend answers                                   | [`CallReply`]              |
//! |--------------------------------------------------|------------------------------|
//! | 2xx                                              | `Succeeded` (Resend has no replay marker) |
//! | 409 `invalid_idempotent_request` (other payload) | `KeyConflict`                |
//! | 409 `concurrent_idempotent_requests`             | `InFlight { retry_after }`   |
//! | 400 `invalid_idempotency_key`, other 400, 404, 422 (validation) | `Rejected`    |
//! | 401, 403 (API key: nothing was sent)             | `Retryable`                  |
//! | 429 (rate limit, daily quota)                    | `Retryable { retry_after }`  |
//! | 5xx, anything else                               | `Unknown`                    |
//!
//! Resend keeps keys for 24 h and answers a same-key, same-payload re-send with the first result
//! "without actually sending", so the adapter's retry loop re-sends after an unknown outcome, and
//! `lookup` is a re-send while the key is still remembered: younger than 24 h minus
//! [`Resend::redrive_margin`] (default [`DEFAULT_REDRIVE_MARGIN`], the sweeper's default
//! `redrive_margin`; keep the two equal, or this one larger). Resend offers no way to find an email
//! by our key, so `lookup` answers [`Lookup::NeedsOperator`](super::Lookup::NeedsOperator) without
//! sending anything when the key is within that margin of the window's end or past it, or when the
//! request to re-send was not stored (the sweeper passes `Null`), or when Resend holds the key for
//! another payload: the sweeper reports the key for an operator.

use std::time::Duration;

use super::CallReply;
use super::answers::Answers;
use super::endpoint::{Auth, Endpoint, http_adapter};
use super::http::{Classified, HttpReply};
use super::replay::same_key_provider;

/// Resend's API base.
pub const DEFAULT_BASE_URL: &str = "https://api.resend.com";
/// How long Resend remembers a key.
pub const RETENTION: Duration = Duration::from_secs(24 * 3600);
/// Default margin kept before the end of [`RETENTION`] when re-sending as a lookup: the
/// sweeper's default (`provider::DEFAULT_REDRIVE_MARGIN`, 1 h).
pub const DEFAULT_REDRIVE_MARGIN: Duration = super::DEFAULT_REDRIVE_MARGIN;

const ANSWERS: Answers = Answers {
    provider: "Resend",
    credential: "API key",
    effect: "sent",
    kept_headers: &[],
    in_flight_on_409: true,
    rejects: |s| matches!(s, 400 | 404 | 405 | 413 | 422),
};

/// Resend transactional email.
#[derive(Debug, Clone)]
pub struct Resend {
    endpoint: Endpoint,
    redrive_margin: Duration,
}

http_adapter!(Resend {
    name: "resend",
    key: "an API key (`re_...`)",
    auth: Auth::Bearer,
    headers: &[],
    settings: {
        /// Sets the margin kept before the end of Resend's 24 h key window: `lookup` re-sends
        /// only while `age + margin < 24 h`. Keep it at least the sweeper's `redrive_margin`
        /// (both default to 1 h): the sweeper looks a key up once it judges a re-send unsafe.
        redrive_margin: Duration = DEFAULT_REDRIVE_MARGIN,
    },
});

impl Resend {
    fn classify(reply: &HttpReply) -> Classified {
        let name = reply.json_str("/name").unwrap_or_default();
        let message = reply.message("/message");
        let outcome = match reply.status {
            409 if name == "invalid_idempotent_request" => {
                CallReply::KeyConflict { detail: message }
            }
            _ => ANSWERS.classify(reply, Some(&name), &message),
        };
        Classified::new(outcome)
    }
}

// Resend's key window counts from the first send, not from a later attempt. Without a stored
// request (re-sending `null` draws a 400 that would read as a refusal of the email), or near or
// past the window's end (a re-send could send a second email), `lookup` sends nothing: Resend
// cannot be searched by our key, and waiting does not help.
same_key_provider!(Resend {
    provider: "Resend",
    path: "/emails",
    key_header: "Idempotency-Key",
    max_len: 256,
    key_window: |_| RETENTION,
});
