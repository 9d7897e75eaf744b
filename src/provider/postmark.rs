//! Postmark email (feature `http`). Postmark has **no idempotency key**.
//!
//! `send` sends `POST /email` with the canonical JSON request as the body (Postmark's own fields:
//! `From`, `To`, `Subject`, `TextBody`, `HtmlBody`, `Metadata`, ...), our provider key added as
//! `Metadata.idemflow_key`, and the server token in `X-Postmark-Server-Token`.
//!
//! Because a re-send is a second email, the adapter never re-sends after an unknown outcome, and
//! its [`KeySpec`] forbids the sweeper to re-drive: a lost result is settled by `lookup`,
//! `GET /messages/outbound?metadata_idemflow_key=<key>`.
//!
//! | Postmark answers                                  | [`CallReply`]              |
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

use super::endpoint::{Auth, Endpoint, http_adapter};
use super::answers::{Answers, refused_unsent};
use super::http::{Classified, HttpReply, RetryUnknown};
use super::search::MetadataSearch;
use super::spans::Method;
use super::{Attempts, CallReply, KeySpec, Lookup, Provider};
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

const ANSWERS: Answers = Answers {
    provider: "Postmark",
    credential: "server token",
    effect: "sent",
    kept_headers: &[],
    in_flight_on_409: false,
    rejects: |s| matches!(s, 400 | 404 | 413 | 422),
};

/// Postmark transactional email.
#[derive(Debug, Clone)]
pub struct Postmark {
    endpoint: Endpoint,
    search_lag: Duration,
}

http_adapter!(Postmark {
    name: "postmark",
    key: "a server token",
    auth: Auth::Header("X-Postmark-Server-Token"),
    headers: &[("Accept", "application/json")],
    settings: {
        /// Sets how long after the first send an empty search result is still not trusted.
        search_lag: Duration = DEFAULT_SEARCH_LAG,
    },
});

impl Postmark {
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
        let code = reply.json().and_then(|b| b.get("ErrorCode")?.as_i64());
        let outcome = match reply.status {
            200..=299 if code.unwrap_or(0) == 0 => ANSWERS.succeeded(reply, false),
            200..=299 => ANSWERS.rejected(reply),
            _ => ANSWERS.classify(reply, None, &reply.message("/Message")),
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
        Outcome::Succeeded(StoredResponse::json(200, &answer).unwrap_or_else(|_| StoredResponse::new(200)))
    }
}

#[async_trait]
impl Provider for Postmark {
    fn name(&self) -> &str {
        self.endpoint.name()
    }

    fn key_spec(&self) -> KeySpec {
        KeySpec {
            max_len: METADATA_VALUE_MAX,
            retention: None,
            replays_same_key: false,
        }
    }

    async fn send(&self, provider_key: &str, request: &Value) -> CallReply {
        self.endpoint.traced(Method::Call, provider_key, async move {
            let body = match Self::body(provider_key, request) {
                Ok(b) => b,
                Err(detail) => {
                    return refused_unsent(422, &json!({"ErrorCode": 300, "Message": detail}));
                }
            };
            self.endpoint
                .send(
                    RetryUnknown::Never,
                    "/email",
                    |req| req.json(&body),
                    Self::classify,
                )
                .await
        })
        .await
    }

    async fn lookup(
        &self,
        provider_key: &str,
        _request: &Value,
        attempts: Attempts,
        now: DateTime<Utc>,
    ) -> Lookup {
        self.endpoint.traced(Method::Lookup, provider_key, async move {
            let param = format!("metadata_{METADATA_KEY}");
            MetadataSearch {
                path: "/messages/outbound",
                query: &[
                    ("count", "10"),
                    ("offset", "0"),
                    (param.as_str(), provider_key),
                ],
                results: "Messages",
                search_lag: self.search_lag,
                retention: Some(MESSAGE_RETENTION),
            }
            .run(&self.endpoint, attempts, now, Self::found)
            .await
        })
        .await
    }
}
