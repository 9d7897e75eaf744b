//! Stripe webhook deliveries, signed as Stripe signs them ([`WebhookSender`]), and Stripe
//! events ([`stripe_event`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::provider::stripe_signature::{SIGNATURE_HEADER, sign, signature_header};

/// A Stripe event of type `kind` around `object` (`data.object`), with a fresh id
/// (`evt_fake_<n>`, unique in this process) and `created` now.
pub fn stripe_event(kind: &str, object: Value) -> Value {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    json!({
        "id": format!("evt_fake_{}_{n:06}", std::process::id()),
        "object": "event",
        "api_version": "2025-04-30.basil",
        "created": chrono::Utc::now().timestamp(),
        "livemode": false,
        "pending_webhooks": 1,
        "type": kind,
        "data": { "object": object },
    })
}

/// One delivery's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    /// The HTTP status; 0 when no answer came (connection refused or reset).
    pub status: u16,
    /// Whether the answer carried `Idempotent-Replayed: true`.
    pub replayed: bool,
    /// The answer's body (or the transport error).
    pub body: String,
}

impl Delivered {
    /// Whether Stripe would count it delivered (a 2xx).
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// Delivers Stripe events to one endpoint, signed with one secret or several (several `v1`, as
/// while Stripe rolls an endpoint's secret).
///
/// ```no_run
/// # async fn demo() {
/// use idemflow::testkit::{WebhookSender, stripe_event};
/// let sender = WebhookSender::new("http://127.0.0.1:3000/webhooks/stripe", "whsec_test");
/// let event = stripe_event("payment_intent.succeeded", serde_json::json!({"id": "pi_1"}));
/// let first = sender.send(&event).await;             // one delivery
/// let copies = sender.send_concurrently(&event, 50).await; // 50 at once
/// let retried = sender.deliver(&event, 5, std::time::Duration::from_millis(100)).await;
/// # }
/// ```
///
/// Its `Debug` shows how many signing secrets it holds, not the secrets.
#[derive(Clone)]
pub struct WebhookSender {
    url: String,
    secrets: Vec<String>,
    clock_offset: i64,
    client: reqwest::Client,
}

impl std::fmt::Debug for WebhookSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            url,
            secrets,
            clock_offset,
            client,
        } = self;
        f.debug_struct("WebhookSender")
            .field("url", &crate::store::connect_error::RedactedUrl(url))
            .field("secrets", &secrets.len())
            .field("clock_offset", clock_offset)
            .field("client", client)
            .finish()
    }
}

impl WebhookSender {
    /// A sender to `url` signing with `secret`.
    pub fn new(url: impl Into<String>, secret: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            secrets: vec![secret.into()],
            clock_offset: 0,
            client: reqwest::Client::new(),
        }
    }

    /// Also signs with `secret`: each delivery carries one `v1` per secret.
    pub fn with_secret(mut self, secret: impl Into<String>) -> Self {
        self.secrets.push(secret.into());
        self
    }

    /// Signs with a timestamp `seconds` off the real clock (negative: in the past), to test
    /// the receiver's tolerance.
    pub fn clock_offset(mut self, seconds: i64) -> Self {
        self.clock_offset = seconds;
        self
    }

    /// The `Stripe-Signature` header for `body` signed now (plus the clock offset).
    pub fn signature(&self, body: &[u8]) -> String {
        let t = chrono::Utc::now().timestamp() + self.clock_offset;
        let sigs: Vec<String> = self.secrets.iter().map(|s| sign(s, t, body)).collect();
        signature_header(t, &sigs)
    }

    /// One delivery of `event`, signed.
    pub async fn send(&self, event: &Value) -> Delivered {
        let body = serde_json::to_vec(event).unwrap_or_default();
        let signature = self.signature(&body);
        self.send_raw(body, Some(signature)).await
    }

    /// One delivery of raw `body` with this `Stripe-Signature` (`None`: without the header).
    pub async fn send_raw(&self, body: Vec<u8>, signature: Option<String>) -> Delivered {
        let mut req = self
            .client
            .post(&self.url)
            .header("content-type", "application/json")
            .body(body);
        if let Some(sig) = signature {
            req = req.header(SIGNATURE_HEADER, sig);
        }
        match req.send().await {
            Ok(resp) => Delivered {
                status: resp.status().as_u16(),
                replayed: resp
                    .headers()
                    .get("idempotent-replayed")
                    .is_some_and(|v| v == "true"),
                body: resp.text().await.unwrap_or_default(),
            },
            Err(e) => Delivered {
                status: 0,
                replayed: false,
                body: e.to_string(),
            },
        }
    }

    /// Delivers `event` as Stripe does: again after each answer that is not a 2xx (each time
    /// signed anew), `backoff` apart, at most `attempts` times. Returns every attempt's answer.
    pub async fn deliver(&self, event: &Value, attempts: u32, backoff: Duration) -> Vec<Delivered> {
        let mut answers = Vec::new();
        for attempt in 0..attempts.max(1) {
            if attempt > 0 {
                tokio::time::sleep(backoff).await;
            }
            let answer = self.send(event).await;
            let done = answer.is_success();
            answers.push(answer);
            if done {
                break;
            }
        }
        answers
    }

    /// `copies` deliveries of `event` at once (duplicates, as Stripe may send).
    pub async fn send_concurrently(&self, event: &Value, copies: usize) -> Vec<Delivered> {
        let sends: Vec<_> = (0..copies)
            .map(|_| {
                let this = self.clone();
                let event = event.clone();
                tokio::spawn(async move { this.send(&event).await })
            })
            .collect();
        let mut answers = Vec::with_capacity(copies);
        for send in sends {
            answers.push(send.await.unwrap_or_else(|e| Delivered {
                status: 0,
                replayed: false,
                body: e.to_string(),
            }));
        }
        answers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_a_signing_secret() {
        let sender = WebhookSender::new("http://127.0.0.1:1/hook", "whsec_first")
            .with_secret("whsec_second");
        let shown = format!("{sender:?}");
        assert!(!shown.contains("whsec_"), "{shown}");
        assert!(shown.contains("secrets: 2"), "{shown}");
    }
}
