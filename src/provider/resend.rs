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
//! outcome, and `lookup` is a re-send while the key is still remembered (24 h minus
//! [`Resend::redrive_margin`]). Past that, Resend offers no way to find an email by our key:
//! `lookup` answers `Unknown { retry_after: None }` and the key needs an operator.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::http::{
    ApiKey, Classified, HttpClient, HttpConfig, HttpError, HttpReply, RetryUnknown, body_snippet,
    classify_status,
};
use super::{CallOutcome, KeySpec, Lookup, Provider};
use crate::Outcome;

/// Resend's API base.
pub const DEFAULT_BASE_URL: &str = "https://api.resend.com";
/// How long Resend remembers a key.
pub const RETENTION: Duration = Duration::from_secs(24 * 3600);
/// Default margin kept before the end of [`RETENTION`] when re-sending as a lookup.
pub const DEFAULT_REDRIVE_MARGIN: Duration = Duration::from_secs(15 * 60);

/// Resend transactional email.
#[derive(Debug, Clone)]
pub struct Resend {
    name: String,
    base_url: String,
    api_key: ApiKey,
    http: HttpClient,
    redrive_margin: Duration,
}

impl Resend {
    /// Resend at its real API base, with an API key (`re_...`).
    pub fn new(api_key: impl Into<String>) -> Result<Self, HttpError> {
        Self::with_base_url(DEFAULT_BASE_URL, api_key)
    }

    /// Resend at another base URL (a fake server, a proxy).
    pub fn with_base_url(base_url: &str, api_key: impl Into<String>) -> Result<Self, HttpError> {
        Ok(Self {
            name: "resend".to_owned(),
            base_url: super::http::base_url(base_url)?,
            api_key: ApiKey::new(api_key)?,
            http: HttpClient::new(HttpConfig::default())?,
            redrive_margin: DEFAULT_REDRIVE_MARGIN,
        })
    }

    /// Sets the name stored in key rows (default `resend`).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Replaces the timeouts and retry settings.
    pub fn http_config(mut self, config: HttpConfig) -> Result<Self, HttpError> {
        self.http = HttpClient::new(config)?;
        Ok(self)
    }

    /// Sets the margin kept before the end of Resend's 24 h key window: `lookup` re-sends only
    /// while `age + margin < 24 h`.
    pub fn redrive_margin(mut self, margin: Duration) -> Self {
        self.redrive_margin = margin;
        self
    }

    /// The base URL in use.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    fn classify(reply: &HttpReply) -> Classified {
        let body = reply.json();
        let name = body
            .as_ref()
            .and_then(|b| b.get("name"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let message = body
            .as_ref()
            .and_then(|b| b.get("message"))
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| body_snippet(&reply.body));
        let status = reply.status;
        let outcome = match status {
            200..=299 => CallOutcome::Succeeded {
                response: reply.to_response(&[]),
                replayed: false,
            },
            409 if name == "invalid_idempotent_request" => {
                CallOutcome::KeyConflict { detail: message }
            }
            409 => CallOutcome::InFlight {
                retry_after: reply.retry_after(),
            },
            401 | 403 => CallOutcome::Retryable {
                reason: format!(
                    "Resend refused the API key ({status} {name}), nothing was sent: {message}"
                ),
                retry_after: None,
            },
            400 | 404 | 405 | 413 | 422 => CallOutcome::Rejected {
                response: reply.to_response(&[]),
            },
            _ => classify_status(reply),
        };
        Classified::new(outcome)
    }
}

#[async_trait]
impl Provider for Resend {
    fn name(&self) -> &str {
        &self.name
    }

    fn key_spec(&self) -> KeySpec {
        KeySpec {
            max_len: 256,
            retention: Some(RETENTION),
            replays_same_key: true,
        }
    }

    #[tracing::instrument(name = "idemflow.provider.call", skip_all, fields(provider = %self.name, provider_key = %provider_key))]
    async fn call(&self, provider_key: &str, request: &Value) -> CallOutcome {
        let url = format!("{}/emails", self.base_url);
        let outcome = self
            .http
            .send(
                RetryUnknown::SameKeyReplays,
                |c| {
                    c.post(&url)
                        .bearer_auth(self.api_key.expose())
                        .header("Idempotency-Key", provider_key)
                        .json(request)
                },
                Self::classify,
            )
            .await;
        tracing::debug!(?outcome, "resend call");
        outcome
    }

    #[tracing::instrument(name = "idemflow.provider.lookup", skip_all, fields(provider = %self.name, provider_key = %provider_key))]
    async fn lookup(
        &self,
        provider_key: &str,
        request: &Value,
        first_sent_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Lookup {
        let age = (now - first_sent_at).to_std().unwrap_or_default();
        if age + self.redrive_margin >= RETENTION {
            // Resend may have forgotten the key: a re-send could send a second email, and
            // Resend cannot be searched by our key.
            return Lookup::Unknown { retry_after: None };
        }
        match self.call(provider_key, request).await {
            CallOutcome::Succeeded { response, .. } => Lookup::Found(Outcome::Succeeded(response)),
            CallOutcome::Rejected { response } => Lookup::Found(Outcome::Rejected(response)),
            CallOutcome::Retryable { retry_after, .. } | CallOutcome::InFlight { retry_after } => {
                Lookup::Unknown { retry_after }
            }
            CallOutcome::KeyConflict { detail } => {
                tracing::warn!(%detail, "resend holds this key for another payload");
                Lookup::Unknown { retry_after: None }
            }
            CallOutcome::Unknown { reason } => {
                tracing::warn!(%reason, "resend re-send outcome unknown");
                Lookup::Unknown { retry_after: None }
            }
        }
    }
}
