//! Shared reqwest plumbing for the built-in adapters (feature `http`): a client with connect and
//! request timeouts, a bounded retry loop with jittered exponential backoff that sends the **same**
//! provider key on every attempt and honours `Retry-After`, and the transport-level
//! classification every adapter shares.
//!
//! | What happened                                   | [`CallReply`]                          |
//! |-------------------------------------------------|------------------------------------------|
//! | connection refused / DNS / TLS (nothing sent)   | `Retryable`                              |
//! | timeout after sending, reset, body cut short    | `Unknown`                                |
//! | 429                                             | `Retryable { retry_after }`              |
//! | 5xx                                             | `Unknown` (unless the adapter knows more) |
//!
//! Once one attempt of a call may have acted (it ended `Unknown`: a timeout after sending, a 5xx;
//! or `InFlight`: a 409 "request in progress"), a later attempt's `Retryable` is reported as
//! `Unknown`: the earlier attempt may have acted, so "the provider surely did nothing" no longer
//! holds. A later attempt's `Rejected` is reported as `Unknown` too, unless the adapter marked
//! it [`Classified::definitive`]: a refusal of the re-send (a 400 or 422 while the first attempt
//! is still running at the provider, which Square and PayPal do not document, or PayPal's "might
//! fail the second") says nothing about what the first attempt did (`docs/providers.md`,
//! "Error → outcome", "Cards").
//!
//! Adapters for other providers can reuse [`HttpClient`]: build each attempt's request with
//! [`HttpClient::send`] and classify the [`HttpReply`], or hold an
//! [`Endpoint`](super::endpoint::Endpoint), which adds the name, base URL and credentials.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::BuildHasher;
use std::time::Duration;

use crate::StoredResponse;
use crate::provider::CallReply;
use crate::store::connect_error::redact_url;

/// Timeouts and retry settings of an [`HttpClient`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// Longest time to establish a connection (nothing has been sent yet). Default 5 s.
    pub connect_timeout: Duration,
    /// Longest time for a whole request, from sending to the last body byte. Default 30 s.
    pub request_timeout: Duration,
    /// Attempts per call, the first included (1 = no retry). Default 3.
    pub max_attempts: u32,
    /// Backoff before the second attempt; doubled each time, with 50–100 % jitter. Default
    /// 200 ms.
    pub initial_backoff: Duration,
    /// Longest backoff between two attempts. Default 5 s.
    pub max_backoff: Duration,
    /// A `Retry-After` longer than this ends the loop (the outcome is returned to the caller,
    /// who can wait longer than a request should). Default 30 s.
    pub max_retry_after: Duration,
    /// The `User-Agent` sent. Default `idemflow/<version>`.
    pub user_agent: String,
}

impl HttpConfig {
    /// The longest wait between two attempts a client accepts ([`Self::initial_backoff`],
    /// [`Self::max_backoff`], [`Self::max_retry_after`]): one hour. A longer one is refused
    /// with [`HttpError::InvalidConfig`].
    pub const MAX_WAIT: Duration = Duration::from_secs(3600);

    /// The most attempts per call a client accepts ([`Self::max_attempts`]): 100. More are
    /// refused with [`HttpError::InvalidConfig`]; 0 is taken as 1.
    pub const MAX_ATTEMPTS: u32 = 100;
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            max_attempts: 3,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(30),
            user_agent: concat!("idemflow/", env!("CARGO_PKG_VERSION")).to_owned(),
        }
    }
}

impl HttpConfig {
    /// The longest one adapter call can take, all tries included: `max_attempts` x
    /// (`connect_timeout` + `request_timeout`) plus, between tries, the longest wait
    /// (`max_backoff` or `max_retry_after`, whichever is larger). With the defaults:
    /// 3 x 35 s + 2 x 30 s = 165 s, well inside the sweeper's default re-drive margin (1 h), so
    /// a call cannot still be live when the provider's dedup window closes.
    pub fn total_deadline(&self) -> Duration {
        let tries = self.max_attempts.max(1);
        let per_try = self.connect_timeout.saturating_add(self.request_timeout);
        let wait = self.max_backoff.max(self.max_retry_after);
        per_try
            .saturating_mul(tries)
            .saturating_add(wait.saturating_mul(tries - 1))
    }
}

/// Why an HTTP provider could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The base URL is not an absolute `http` or `https` URL.
    #[error("invalid base URL {url:?}: {reason}")]
    InvalidBaseUrl {
        /// The URL given, its secrets masked ([`redact_url`]).
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The API key is empty or cannot travel in an HTTP header.
    #[error("invalid API key: {reason}")]
    InvalidApiKey {
        /// What is wrong (the key itself is never shown).
        reason: &'static str,
    },
    /// A setting of [`HttpConfig`] is out of range.
    #[error("invalid HttpConfig::{setting}: {reason}")]
    InvalidConfig {
        /// The setting.
        setting: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A header an adapter was configured to send cannot travel in HTTP.
    #[error("invalid value for the {name} header: {reason}")]
    InvalidHeader {
        /// The header.
        name: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// reqwest could not build the client (TLS initialisation, ...).
    #[error("could not build the HTTP client: {source}")]
    Client {
        /// reqwest's error.
        #[source]
        source: reqwest::Error,
    },
}

/// An API key that never shows in `Debug` output or logs.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Wraps a key, refusing an empty one or one that cannot be an HTTP header value.
    pub fn new(key: impl Into<String>) -> Result<Self, HttpError> {
        let key = key.into();
        if key.trim().is_empty() {
            return Err(HttpError::InvalidApiKey { reason: "empty" });
        }
        if !key.bytes().all(|b| (0x21..0x7f).contains(&b)) {
            return Err(HttpError::InvalidApiKey {
                reason: "only visible ASCII characters are allowed",
            });
        }
        Ok(Self(key))
    }

    /// The key itself, to put in a header.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(***)")
    }
}

/// Checks and normalises a base URL: absolute, `http` or `https`, no trailing slash.
pub fn base_url(url: &str) -> Result<String, HttpError> {
    let parsed = reqwest::Url::parse(url).map_err(|e| HttpError::InvalidBaseUrl {
        url: redact_url(url),
        reason: e.to_string(),
    })?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(HttpError::InvalidBaseUrl {
            url: redact_url(url),
            reason: format!("scheme {:?} is not http or https", parsed.scheme()),
        });
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(HttpError::InvalidBaseUrl {
            url: redact_url(url),
            reason: "a base URL takes no query or fragment".to_owned(),
        });
    }
    Ok(url.trim_end_matches('/').to_owned())
}

/// A provider's complete answer to one attempt.
#[derive(Debug, Clone)]
pub struct HttpReply {
    /// The status code.
    pub status: u16,
    /// The response headers.
    pub headers: reqwest::header::HeaderMap,
    /// The body bytes.
    pub body: Vec<u8>,
}

impl HttpReply {
    /// A header's value, if present and visible ASCII.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as JSON, if it is JSON.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// The string at a JSON pointer of the body (e.g. `/error/code`), if the body is JSON and
    /// the string is there.
    pub fn json_str(&self, pointer: &str) -> Option<String> {
        self.json()?.pointer(pointer)?.as_str().map(str::to_owned)
    }

    /// The provider's message at a JSON pointer of the body, or the start of the body.
    pub fn message(&self, pointer: &str) -> String {
        self.json_str(pointer)
            .unwrap_or_else(|| body_snippet(&self.body))
    }

    /// The `Retry-After` header: delay-seconds or an HTTP date (a date in the past is zero).
    pub fn retry_after(&self) -> Option<Duration> {
        parse_retry_after(self.header("retry-after")?)
    }

    /// The answer as a stored [`StoredResponse`]: status, body, and the headers named in `keep`
    /// (`content-type` is always kept).
    pub fn to_response(&self, keep: &[&str]) -> StoredResponse {
        let mut headers = Vec::new();
        for name in std::iter::once(&"content-type").chain(keep.iter()) {
            if let Some(v) = self.header(name) {
                headers.push(((*name).to_owned(), v.to_owned()));
            }
        }
        StoredResponse::from_parts(self.status, headers, self.body.clone())
    }
}

/// Parses a `Retry-After` value.
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(1e9)));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    Some(
        (at.with_timezone(&chrono::Utc) - chrono::Utc::now())
            .to_std()
            .unwrap_or_default(),
    )
}

/// An outcome plus whether the retry loop may try again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classified {
    /// The outcome of this attempt.
    pub outcome: CallReply,
    /// Whether another attempt with the same key may follow (still subject to the loop's
    /// policy and limits).
    pub retry: bool,
    /// Whether a `Rejected` outcome is, by the provider's documentation, the answer about the
    /// key's request itself (e.g. a payment reported under the key with a failed status), so
    /// it stands even after an earlier attempt of the call that may have acted. `false`: such a
    /// refusal is reported as `Unknown` after that attempt.
    pub definitive: bool,
}

impl Classified {
    /// An outcome that a later attempt may improve on (`Retryable`, `InFlight`, `Unknown`).
    pub fn new(outcome: CallReply) -> Self {
        let retry = matches!(
            outcome,
            CallReply::Retryable { .. }
                | CallReply::InFlight { .. }
                | CallReply::Unknown { .. }
        );
        Self {
            outcome,
            retry,
            definitive: false,
        }
    }

    /// The same outcome, never retried in this call (e.g. `Stripe-Should-Retry: false`).
    pub fn final_answer(outcome: CallReply) -> Self {
        Self {
            outcome,
            retry: false,
            definitive: false,
        }
    }

    /// A refusal the provider documents as the answer about the key's request itself (a
    /// payment under the key reported failed or cancelled): it ends the call as `Rejected`
    /// even after an earlier attempt that may have acted.
    pub fn definitive(outcome: CallReply) -> Self {
        Self {
            definitive: true,
            ..Self::new(outcome)
        }
    }
}

impl From<CallReply> for Classified {
    fn from(outcome: CallReply) -> Self {
        Self::new(outcome)
    }
}

/// Whether an `Unknown` attempt may be sent again within one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryUnknown {
    /// The provider replays a same-key request (Stripe, Resend): re-sending after an unknown
    /// outcome cannot act twice.
    SameKeyReplays,
    /// The provider has no keys (Postmark): an unknown outcome is never re-sent.
    Never,
}

/// The shared client: timeouts, retry loop, transport classification.
#[derive(Debug, Clone)]
pub struct HttpClient {
    client: reqwest::Client,
    config: HttpConfig,
}

impl HttpClient {
    /// Builds a client (rustls, no proxy discovery beyond reqwest's defaults).
    pub fn new(config: HttpConfig) -> Result<Self, HttpError> {
        if config.max_attempts > HttpConfig::MAX_ATTEMPTS {
            return Err(HttpError::InvalidConfig {
                setting: "max_attempts",
                reason: format!(
                    "{} is more than {} attempts per call",
                    config.max_attempts,
                    HttpConfig::MAX_ATTEMPTS
                ),
            });
        }
        for (setting, value) in [
            ("initial_backoff", config.initial_backoff),
            ("max_backoff", config.max_backoff),
            ("max_retry_after", config.max_retry_after),
        ] {
            if value > HttpConfig::MAX_WAIT {
                return Err(HttpError::InvalidConfig {
                    setting,
                    reason: format!(
                        "{value:?} is longer than {:?}: a call would sleep that long between \
                         two attempts",
                        HttpConfig::MAX_WAIT
                    ),
                });
            }
        }
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .timeout(config.request_timeout)
            .user_agent(config.user_agent.clone())
            .build()
            .map_err(|source| HttpError::Client { source })?;
        Ok(Self { client, config })
    }

    /// The settings.
    pub fn config(&self) -> &HttpConfig {
        &self.config
    }

    /// The underlying reqwest client.
    pub fn inner(&self) -> &reqwest::Client {
        &self.client
    }

    /// Sends one request (no retry) and reads the whole answer; a transport failure comes back
    /// already classified.
    pub async fn send_once(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<HttpReply, CallReply> {
        let resp = request.send().await.map_err(|e| classify_transport(&e))?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        match resp.bytes().await {
            Ok(body) => Ok(HttpReply {
                status,
                headers,
                body: body.to_vec(),
            }),
            Err(e) => Err(CallReply::Unknown {
                reason: format!("status {status} arrived but its body was cut short: {e}"),
            }),
        }
    }

    /// Runs up to [`HttpConfig::max_attempts`] attempts: `build` makes each attempt's request
    /// (with the same provider key every time), `classify` reads each answer. Retryable and
    /// in-flight answers are retried after a jittered backoff or the provider's `Retry-After`;
    /// unknown ones only when `retry_unknown` says the provider replays a same-key request.
    pub async fn send<B, C>(
        &self,
        retry_unknown: RetryUnknown,
        build: B,
        classify: C,
    ) -> CallReply
    where
        B: Fn(&reqwest::Client) -> reqwest::RequestBuilder,
        C: Fn(&HttpReply) -> Classified,
    {
        let mut attempt: u32 = 1;
        let mut maybe_acted = false;
        loop {
            let classified = match self.send_once(build(&self.client)).await {
                Ok(reply) => classify(&reply),
                Err(outcome) => Classified::new(outcome),
            };
            let outcome = classified.outcome;
            let definitive = classified.definitive;
            let hint = match &outcome {
                CallReply::Retryable { retry_after, .. } => Some(*retry_after),
                // A request with this key is in progress: maybe an earlier try of this call.
                CallReply::InFlight { retry_after } => {
                    maybe_acted = true;
                    Some(*retry_after)
                }
                CallReply::Unknown { .. } => {
                    maybe_acted = true;
                    (retry_unknown == RetryUnknown::SameKeyReplays).then_some(None)
                }
                _ => None,
            };
            let give_up = |outcome: CallReply| match outcome {
                CallReply::Retryable { reason, .. } if maybe_acted => CallReply::Unknown {
                    reason: format!(
                        "an earlier attempt's outcome is unknown; the last said: {reason}"
                    ),
                },
                // A refusal of this attempt says nothing about an earlier one still at work.
                CallReply::Rejected { response } if maybe_acted && !definitive => {
                    CallReply::Unknown {
                        reason: format!(
                            "an earlier attempt's outcome is unknown; the last was refused with \
                             status {}, which does not say what the earlier one did",
                            response.status()
                        ),
                    }
                }
                other => other,
            };
            let Some(hint) = hint.filter(|_| classified.retry) else {
                return give_up(outcome);
            };
            if attempt >= self.config.max_attempts.max(1) {
                return give_up(outcome);
            }
            let delay = match hint {
                Some(d) if d > self.config.max_retry_after => return give_up(outcome),
                Some(d) => d,
                None => self.backoff(attempt),
            };
            tracing::debug!(attempt, ?delay, ?outcome, "retrying with the same key");
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// The jittered exponential delay after `attempt` (1-based).
    fn backoff(&self, attempt: u32) -> Duration {
        let exp = self
            .config
            .initial_backoff
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20))
            .min(self.config.max_backoff);
        // 50-100 % of the delay: spreads retries from many workers.
        let r = RandomState::new().hash_one(attempt) % 1000;
        exp.mul_f64(0.5 + (r as f64) / 2000.0)
    }
}

/// Classifies a reqwest transport error: a connection that never opened sent nothing
/// (`Retryable`); anything after that may have reached the provider (`Unknown`).
pub fn classify_transport(e: &reqwest::Error) -> CallReply {
    if e.is_connect() {
        CallReply::Retryable {
            reason: format!("could not connect, nothing was sent: {e}"),
            retry_after: None,
        }
    } else if e.is_builder() {
        CallReply::Retryable {
            reason: format!("the request could not be built, nothing was sent: {e}"),
            retry_after: None,
        }
    } else if e.is_timeout() {
        CallReply::Unknown {
            reason: format!("timed out after sending: {e}"),
        }
    } else {
        CallReply::Unknown {
            reason: format!("the connection failed after sending: {e}"),
        }
    }
}

/// The shared status classification for answers an adapter does not recognise: 429 is
/// `Retryable`, 5xx and anything unexpected `Unknown`.
pub fn classify_status(reply: &HttpReply) -> CallReply {
    let snippet = body_snippet(&reply.body);
    match reply.status {
        429 => CallReply::Retryable {
            reason: format!("rate limited (429): {snippet}"),
            retry_after: reply.retry_after(),
        },
        s => CallReply::Unknown {
            reason: format!("status {s}: {snippet}"),
        },
    }
}

/// The first 200 characters of a body, for messages.
pub fn body_snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut out: String = text.chars().take(200).collect();
    if text.chars().count() > 200 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn total_deadline_is_documented_and_inside_the_redrive_margin() {
        let c = HttpConfig::default();
        assert_eq!(c.total_deadline(), Duration::from_secs(165));
        // The sweeper's default re-drive margin (`SweeperConfig::redrive_margin`).
        assert!(c.total_deadline() < Duration::from_secs(3600));
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(parse_retry_after("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_retry_after("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(parse_retry_after("-1"), None);
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
    }

    #[test]
    fn base_urls() {
        assert_eq!(
            base_url("http://127.0.0.1:9/").unwrap(),
            "http://127.0.0.1:9"
        );
        assert!(base_url("ftp://x").is_err());
        assert!(base_url("not a url").is_err());
        assert!(base_url("https://api.x.com/v1?x=1").is_err());
    }

    #[test]
    fn api_keys_hidden() {
        let k = ApiKey::new("sk_test_secret").unwrap();
        assert!(!format!("{k:?}").contains("secret"));
        assert!(ApiKey::new(" ").is_err());
        assert!(ApiKey::new("a\nb").is_err());
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let c = HttpClient::new(HttpConfig {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(300),
            ..HttpConfig::default()
        })
        .unwrap();
        for attempt in 1..10 {
            let d = c.backoff(attempt);
            let cap = Duration::from_millis((100u64 << (attempt - 1).min(20)).min(300));
            assert!(d <= cap && d >= cap / 2, "{attempt}: {d:?}");
        }
    }
}
