//! Postmark email (feature `http`). Postmark has **no idempotency key**.
//!
//! `call` sends `POST /email` with the canonical JSON request as the body (Postmark's own fields:
//! `From`, `To`, `Subject`, `TextBody`, `HtmlBody`, `Metadata`, ...), our provider key added as
//! `Metadata.idemflow_key`, and the server token in `X-Postmark-Server-Token`.
//!
//! Because a re-send is a second email, the adapter never re-sends after an unknown outcome, and
//! its [`KeySpec`] forbids the sweeper to re-drive: a lost result is settled by `lookup`,
//! `GET /messages/outbound?metadata_idemflow_key=<key>`.
//!
//! | Postmark answers                                  | [`CallOutcome`]              |
//! |---------------------------------------------------|------------------------------|
//! | 200 with `ErrorCode: 0`                           | `Succeeded`                  |
//! | 422 `ErrorCode` 300 (invalid request), 406 (inactive recipient), other API error codes | `Rejected` |
//! | 401 (server token: nothing was sent)              | `Retryable`                  |
//! | 429 (rate limit)                                  | `Retryable { retry_after }`  |
//! | 5xx, anything else, timeouts after sending        | `Unknown` (never re-sent)    |
//!
//! The outbound-messages search is not documented as read-after-write: an empty result is
//! authoritative only [`Postmark::search_lag`] (default 5 min) after the first send, and never
//! once Postmark's 45-day message retention may have removed the message.

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

/// Postmark's API base.
pub const DEFAULT_BASE_URL: &str = "https://api.postmarkapp.com";
/// The metadata field that carries our key.
pub const METADATA_KEY: &str = "idemflow_key";
/// Default margin before an empty search result is trusted.
pub const DEFAULT_SEARCH_LAG: Duration = Duration::from_secs(5 * 60);
/// How long Postmark keeps outbound messages by default.
pub const MESSAGE_RETENTION: Duration = Duration::from_secs(45 * 24 * 3600);
/// Postmark's limit on a metadata value's length.
pub const METADATA_VALUE_MAX: usize = 80;

/// Postmark transactional email.
#[derive(Debug, Clone)]
pub struct Postmark {
    name: String,
    base_url: String,
    server_token: ApiKey,
    http: HttpClient,
    search_lag: Duration,
}

impl Postmark {
    /// Postmark at its real API base, with a server token.
    pub fn new(server_token: impl Into<String>) -> Result<Self, HttpError> {
        Self::with_base_url(DEFAULT_BASE_URL, server_token)
    }

    /// Postmark at another base URL (a fake server, a proxy).
    pub fn with_base_url(
        base_url: &str,
        server_token: impl Into<String>,
    ) -> Result<Self, HttpError> {
        Ok(Self {
            name: "postmark".to_owned(),
            base_url: super::http::base_url(base_url)?,
            server_token: ApiKey::new(server_token)?,
            http: HttpClient::new(HttpConfig::default())?,
            search_lag: DEFAULT_SEARCH_LAG,
        })
    }

    /// Sets the name stored in key rows (default `postmark`).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Replaces the timeouts and retry settings (unknown outcomes are never retried).
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

    /// The body sent for `request`: the request with `Metadata.idemflow_key` set.
    pub fn body(provider_key: &str, request: &Value) -> Result<Value, String> {
        let Value::Object(map) = request else {
            return Err(
                "a Postmark request must be a JSON object (From, To, Subject, ...)".to_owned(),
            );
        };
        let mut map = map.clone();
        let meta = map
            .entry("Metadata")
            .or_insert_with(|| Value::Object(Default::default()));
        let Value::Object(meta) = meta else {
            return Err("Metadata must be a JSON object".to_owned());
        };
        meta.insert(
            METADATA_KEY.to_owned(),
            Value::String(provider_key.to_owned()),
        );
        Ok(Value::Object(map))
    }

    fn classify(reply: &HttpReply) -> Classified {
        let body = reply.json();
        let code = body
            .as_ref()
            .and_then(|b| b.get("ErrorCode"))
            .and_then(Value::as_i64);
        let message = body
            .as_ref()
            .and_then(|b| b.get("Message"))
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| body_snippet(&reply.body));
        let status = reply.status;
        let outcome = match status {
            200..=299 if code.unwrap_or(0) == 0 => CallOutcome::Succeeded {
                response: reply.to_response(&[]),
                replayed: false,
            },
            200..=299 | 400 | 404 | 413 | 422 => CallOutcome::Rejected {
                response: reply.to_response(&[]),
            },
            401 | 403 => CallOutcome::Retryable {
                reason: format!(
                    "Postmark refused the server token ({status}), nothing was sent: {message}"
                ),
                retry_after: None,
            },
            _ => classify_status(reply),
        };
        Classified::new(outcome)
    }

    fn found(message: &Value) -> Outcome {
        // The answer Postmark gave to the send call, rebuilt from the message record.
        let to = match message.get("To") {
            Some(Value::Array(list)) => list
                .iter()
                .filter_map(|r| r.get("Email").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(", "),
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        };
        let answer = json!({
            "To": to,
            "SubmittedAt": message.get("ReceivedAt").cloned().unwrap_or(Value::Null),
            "MessageID": message.get("MessageID").cloned().unwrap_or(Value::Null),
            "ErrorCode": 0,
            "Message": "OK",
        });
        Outcome::Succeeded(
            StoredResponse::json(200, &answer).unwrap_or_else(|_| StoredResponse::new(200)),
        )
    }
}

#[async_trait]
impl Provider for Postmark {
    fn name(&self) -> &str {
        &self.name
    }

    fn key_spec(&self) -> KeySpec {
        KeySpec {
            max_len: METADATA_VALUE_MAX,
            retention: None,
            replays_same_key: false,
        }
    }

    #[tracing::instrument(name = "idemflow.provider.call", skip_all, fields(provider = %self.name, provider_key = %provider_key))]
    async fn call(&self, provider_key: &str, request: &Value) -> CallOutcome {
        let body = match Self::body(provider_key, request) {
            Ok(b) => b,
            Err(detail) => {
                return CallOutcome::Rejected {
                    response: StoredResponse::json(
                        422,
                        &json!({"ErrorCode": 300, "Message": detail}),
                    )
                    .unwrap_or_else(|_| StoredResponse::new(422)),
                };
            }
        };
        let url = format!("{}/email", self.base_url);
        let outcome = self
            .http
            .send(
                RetryUnknown::Never,
                |c| {
                    c.post(&url)
                        .header("X-Postmark-Server-Token", self.server_token.expose())
                        .header("Accept", "application/json")
                        .json(&body)
                },
                Self::classify,
            )
            .await;
        tracing::debug!(?outcome, "postmark call");
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
        let url = format!("{}/messages/outbound", self.base_url);
        let param = format!("metadata_{METADATA_KEY}");
        let req = self
            .http
            .inner()
            .get(&url)
            .header("X-Postmark-Server-Token", self.server_token.expose())
            .header("Accept", "application/json")
            .query(&[
                ("count", "10"),
                ("offset", "0"),
                (param.as_str(), provider_key),
            ]);
        let reply = match self.http.send_once(req).await {
            Ok(r) => r,
            Err(outcome) => {
                tracing::warn!(?outcome, "postmark search failed");
                return Lookup::Unknown { retry_after: None };
            }
        };
        if reply.status != 200 {
            tracing::warn!(status = reply.status, body = %body_snippet(&reply.body), "postmark search refused");
            return Lookup::Unknown {
                retry_after: reply.retry_after(),
            };
        }
        let messages = reply.json().and_then(|b| b.get("Messages").cloned());
        let Some(Value::Array(messages)) = messages else {
            return Lookup::Unknown { retry_after: None };
        };
        match messages.first() {
            Some(m) => Lookup::Found(Self::found(m)),
            None => {
                let age = (now - first_sent_at).to_std().unwrap_or_default();
                Lookup::NotFound {
                    authoritative: age >= self.search_lag && age < MESSAGE_RETENTION,
                }
            }
        }
    }
}
