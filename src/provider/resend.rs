//! Resend emails (feature `http`).
//!
//! `call` sends `POST /emails` with the canonical JSON request as the body (Resend's own fields:
//! `from`, `to`, `subject`, `html`, `text`, ...) and `Idempotency-Key: <provider key>`.
//!
//! | Resend answers                                   | [`CallOutcome`]              |
//! |--------------------------------------------------|------------------------------|
//! | 2xx                                              | `Succeeded` (Resend has no replay marker) |
//! | 409 `invalid_idempotent_request` (other payload) | `KeyConflict`                |
//! | 409 `concurrent_idempotent_requests`             | `InFlight { retry_after }`   |
//! | 400 `invalid_idempotency_key`, other 400, 404, 422 (validation) | `Rejected`    |
//! | 401, 403 (API key: nothing was sent)             | `Retryable`                  |
//! | 429 (rate limit, daily quota)                    | `Retryable { retry_after }`  |
//! | 5xx, anything else                               | `Unknown`                    |
//!
//! Resend keeps keys for 24 h and answers a same-key, same-payload re-send with the first
//! result "without actually sending", so the adapter's retry loop re-sends after an unknown
//! outcome, and `lookup` is a re-send while the key is still remembered: younger than 24 h
//! minus [`Resend::redrive_margin`] (default [`DEFAULT_REDRIVE_MARGIN`], the sweeper's default
//! `redrive_margin`; keep the two equal, or this one larger). Resend offers no way to find an
//! email by our key, so `lookup` answers [`Lookup::NeedsOperator`] without sending anything when
//! the key is within that margin of the window's end or past it, or when the request to re-send
//! was not stored (the sweeper passes `Null`), or when Resend holds the key for another
//! payload: the sweeper reports the key for an operator.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::endpoint::{Auth, Endpoint, http_adapter};
use super::answers::Answers;
use super::http::{Classified, HttpReply, RetryUnknown};
use super::replay::ReplayLookup;
use super::{Attempts, CallOutcome, KeySpec, Lookup, Provider};

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
    defaults: { redrive_margin: DEFAULT_REDRIVE_MARGIN },
});

impl Resend {
    /// Sets the margin kept before the end of Resend's 24 h key window: `lookup` re-sends only
    /// while `age + margin < 24 h`. Keep it at least the sweeper's `redrive_margin` (both
    /// default to 1 h): the sweeper looks a key up once it judges a re-send unsafe.
    pub fn redrive_margin(mut self, margin: Duration) -> Self {
        self.redrive_margin = margin;
        self
    }

    fn classify(reply: &HttpReply) -> Classified {
        let name = reply.json_str("/name").unwrap_or_default();
        let message = reply.message("/message");
        let outcome = match reply.status {
            409 if name == "invalid_idempotent_request" => {
                CallOutcome::KeyConflict { detail: message }
            }
            _ => ANSWERS.classify(reply, Some(&name), &message),
        };
        Classified::new(outcome)
    }
}

#[async_trait]
impl Provider for Resend {
    fn name(&self) -> &str {
        self.endpoint.name()
    }

    fn key_spec(&self) -> KeySpec {
        KeySpec {
            max_len: 256,
            retention: Some(RETENTION),
            replays_same_key: true,
        }
    }

    #[tracing::instrument(name = "idemflow.provider.call", skip_all, fields(provider = %self.endpoint.name(), provider_key = %provider_key))]
    async fn call(&self, provider_key: &str, request: &Value) -> CallOutcome {
        self.endpoint
            .send(
                RetryUnknown::SameKeyReplays,
                "/emails",
                |req| req.header("Idempotency-Key", provider_key).json(request),
                Self::classify,
            )
            .await
    }

    #[tracing::instrument(name = "idemflow.provider.lookup", skip_all, fields(provider = %self.endpoint.name(), provider_key = %provider_key))]
    async fn lookup(
        &self,
        provider_key: &str,
        request: &Value,
        attempts: Attempts,
        now: DateTime<Utc>,
    ) -> Lookup {
        // Resend's key window counts from the first send, not from a later attempt. Without a
        // stored request (re-sending `null` draws a 400 that would read as a refusal of the
        // email), or near or past the window's end (a re-send could send a second email),
        // nothing is sent: Resend cannot be searched by our key, and waiting does not help.
        ReplayLookup {
            provider: "Resend",
            window: RETENTION,
            margin: self.redrive_margin,
        }
        .run(request, attempts, now, self.call(provider_key, request))
        .await
    }
}
