//! Stripe webhook deliveries, signed as Stripe signs them ([`WebhookSender`]), and Stripe
//! events ([`stripe_event`]).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};

use crate::provider::stripe_signature::{SIGNATURE_HEADER, sign, signature_header};

/// A Stripe event of type `kind` around `object` (`data.object`), with a fresh id and `created`
/// now.
///
/// The id is `evt_fake_<time>_<pid>_<n>`: the time this process made its first event, in
/// nanoseconds since the Unix epoch, and its process id, both in base 36, then a count of the
/// process's events. Ids differ across processes and across runs, also when a later run gets
/// the same process id, so a database kept from one run to the next never takes a new run's
/// event for an old one. They are Stripe-shaped: `evt_`, then lowercase letters, digits and
/// underscores, about 35 bytes.
pub fn stripe_event(kind: &str, object: Value) -> Value {
    static N: AtomicU64 = AtomicU64::new(0);
    static RUN: OnceLock<String> = OnceLock::new();
    let run = RUN.get_or_init(|| run_tag(std::process::id(), SystemTime::now()));
    let n = N.fetch_add(1, Ordering::Relaxed);
    json!({
        "id": event_id(run, n),
        "object": "event",
        "api_version": "2025-04-30.basil",
        "created": chrono::Utc::now().timestamp(),
        "livemode": false,
        "pending_webhooks": 1,
        "type": kind,
        "data": { "object": object },
    })
}

/// A run's part of its event ids: `<time>_<pid>`, the time it started (nanoseconds since the
/// Unix epoch) and its process id, each in base 36. The time tells apart runs that reuse a
/// process id; the process id tells apart processes started in the same clock tick.
fn run_tag(pid: u32, started: SystemTime) -> String {
    let nanos = started
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}_{}", base36(nanos), base36(u128::from(pid)))
}

/// The `n`th event id of the run tagged `run`.
fn event_id(run: &str, n: u64) -> String {
    format!("evt_fake_{run}_{n:06}")
}

/// `n` in base 36 (digits and lowercase letters).
fn base36(mut n: u128) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut digits = Vec::new();
    loop {
        digits.push(char::from(DIGITS[(n % 36) as usize]));
        n /= 36;
        if n == 0 {
            break;
        }
    }
    digits.iter().rev().collect()
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

crate::debug_fields::debug_fields!(WebhookSender {
    url => crate::store::connect_error::RedactedUrl(url),
    secrets => secrets.len(),
    clock_offset,
    client,
});

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

    /// Stripe-shaped: `evt_`, then lowercase letters, digits and underscores, under 255 bytes.
    fn stripe_shaped(id: &str) -> bool {
        id.starts_with("evt_")
            && id.len() < 255
            && id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    }

    /// Two runs with the same process id and the same count make different ids: the run's
    /// start time is in them (a process id alone repeats across runs).
    #[test]
    fn runs_with_the_same_pid_and_count_make_different_ids() {
        let started = SystemTime::UNIX_EPOCH + Duration::from_secs(1_780_000_000);
        let first = event_id(&run_tag(4242, started), 0);
        let second = event_id(&run_tag(4242, started + Duration::from_nanos(1)), 0);
        assert_ne!(first, second);
        // Processes started in the same clock tick differ by their process id.
        assert_ne!(first, event_id(&run_tag(4243, started), 0));
        for id in [&first, &second] {
            assert!(stripe_shaped(id), "{id}");
        }
        // The parts are kept apart: no two (time, pid, n) make one id.
        assert_eq!(
            event_id(
                &run_tag(36, SystemTime::UNIX_EPOCH + Duration::from_nanos(35)),
                7
            ),
            "evt_fake_z_10_000007"
        );
        let latest = event_id(
            &run_tag(
                u32::MAX,
                SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 40),
            ),
            u64::MAX,
        );
        assert!(stripe_shaped(&latest), "{latest}");
    }

    /// This process's events share its run tag and count up.
    #[test]
    fn events_of_one_process_carry_its_run_and_differ() {
        let id = |e: &Value| e["id"].as_str().unwrap().to_owned();
        let (a, b) = (
            id(&stripe_event("invoice.paid", json!({}))),
            id(&stripe_event("invoice.paid", json!({}))),
        );
        assert_ne!(a, b);
        assert!(stripe_shaped(&a) && stripe_shaped(&b), "{a} {b}");
        let run = |id: &str| id.rsplit_once('_').unwrap().0.to_owned();
        assert_eq!(run(&a), run(&b));
        let pid = base36(u128::from(std::process::id()));
        assert!(run(&a).ends_with(&format!("_{pid}")), "{a}");
        // More than the pid and the count: evt_fake_<time>_<pid>.
        assert_eq!(run(&a).split('_').count(), 4, "{a}");
    }

    #[test]
    fn debug_never_shows_a_signing_secret() {
        let sender = WebhookSender::new("http://127.0.0.1:1/hook", "whsec_first")
            .with_secret("whsec_second");
        let shown = format!("{sender:?}");
        assert!(!shown.contains("whsec_"), "{shown}");
        assert!(shown.contains("secrets: 2"), "{shown}");
    }
}
