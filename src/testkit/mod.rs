//! Fake provider servers for tests (feature `testkit`): in-process Stripe, Adyen, Square,
//! PayPal, Resend and Postmark look-alikes on `127.0.0.1` (port 0), following the documented idempotency behaviours, with a
//! [`Ledger`] of the real effects they performed and [`Faults`] to inject failures.
//!
//! Use them to test your own integration: point an adapter (or your own client) at
//! `base_url()`, inject a fault, and assert on the ledger that exactly one charge or email
//! happened.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idemflow::provider::{Provider, Resend};
//! use idemflow::testkit::FakeResend;
//!
//! let fake = FakeResend::start().await?;
//! let resend = Resend::with_base_url(fake.base_url(), FakeResend::API_KEY)?;
//! fake.faults().lose_next_response(); // the email is sent, the answer is lost
//! let email = serde_json::json!({"from": "a@x.test", "to": ["b@y.test"], "subject": "Hi", "text": "…"});
//! let outcome = resend.call("idf_0123", &email).await; // the adapter retries with the same key
//! assert_eq!(fake.ledger().count_for_key("idf_0123"), 1);
//! # Ok(()) }
//! ```
//!
//! What the fakes do:
//!
//! * [`FakeStripe`]: `POST /v1/payment_intents` (form-encoded; `Authorization: Bearer
//!   <FakeStripe::API_KEY>`). Same `Idempotency-Key` + same parameters: the saved status and body
//!   with `Idempotent-Replayed: true`; other parameters: 400 `idempotency_error`; while the first
//!   runs: 409 `idempotency_key_in_use`. `payment_method` = [`FakeStripe::DECLINED_CARD`]:
//!   402 `card_error` (the PaymentIntent is created with status `requires_payment_method`).
//!   Validation errors (missing `amount` / `currency`) are not saved, as at Stripe.
//!   `GET /v1/payment_intents/search?query=metadata['k']:'v'` sees a PaymentIntent only once
//!   the search lag has passed.
//! * [`FakeAdyen`]: `POST /v71/payments` (JSON, `X-API-Key: <FakeAdyen::API_KEY>`). Same
//!   `Idempotency-Key` (at most 64 characters) + same body: the first answer, the key echoed.
//!   `paymentMethod.number` = [`FakeAdyen::REFUSED_CARD`]: 200 `resultCode: Refused`. Missing
//!   `amount` / `merchantAccount` / `paymentMethod` / `reference`: 422, not saved. Not documented
//!   by Adyen, so chosen here: 409 while the first runs, 422 for another body under a used key.
//! * [`FakeSquare`]: `POST /v2/payments` (JSON with `idempotency_key`, at most 45 characters;
//!   Bearer token). Same key + same body: the payment made with it, **as it stands now**; other
//!   body: 400 `IDEMPOTENCY_KEY_REUSED`; 409 while the first runs. `autocomplete: false` makes an
//!   `APPROVED` payment, otherwise `COMPLETED`; `source_id` = [`FakeSquare::DECLINED_CARD`]: 402
//!   `PAYMENT_METHOD_ERROR` / `GENERIC_DECLINE` (a `FAILED` payment; the key is not kept).
//!   `POST /v2/payments/cancel` voids by key: `APPROVED` becomes `CANCELED` (ledger too), no
//!   payment or an already canceled one is a 200, a `COMPLETED` or `FAILED` one a 400.
//! * [`FakePayPal`]: `POST /v2/checkout/orders` (JSON, Bearer token, `PayPal-Request-Id` of 1 to
//!   108 characters). Same id: 200 with the order's **current** state (move it with
//!   [`FakePayPal::set_order_status`]); 409 while the first runs. A card `payment_source` with
//!   intent `CAPTURE` completes at once, others are `CREATED`; card
//!   [`FakePayPal::DECLINED_CARD`]: 422 `INSTRUMENT_DECLINED`, not saved.
//! * [`FakeResend`]: `POST /emails` (JSON, Bearer key). Same key + same body: the first answer
//!   (no marker); other body: 409 `invalid_idempotent_request`; while the first runs: 409
//!   `concurrent_idempotent_requests`; key over 256 characters: 400 `invalid_idempotency_key`;
//!   missing `from` / `to` / `subject`: 422.
//! * [`FakePostmark`]: `POST /email` (`X-Postmark-Server-Token`), no idempotency: every accepted
//!   request is an email. Missing `From` / `To`: 422 `ErrorCode` 300; a recipient containing
//!   `inactive`: 422 `ErrorCode` 406. `GET /messages/outbound?metadata_<k>=<v>` searches
//!   metadata, after the search lag.
//!
//! Faults (see [`Faults`]) apply to the effect endpoint (the `POST`), one queued fault per
//! request, in order; latency and search lag are settings.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

mod adyen;
mod paypal;
mod postmark;
mod resend;
mod server;
mod square;
mod stripe;

pub use adyen::FakeAdyen;
pub use paypal::FakePayPal;
pub use postmark::FakePostmark;
pub use resend::FakeResend;
pub use square::FakeSquare;
pub use stripe::FakeStripe;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One real effect a fake performed: a PaymentIntent, payment or order created, an email sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Effect {
    /// The provider's id (`pi_...`, an email id, a Postmark `MessageID`).
    pub id: String,
    /// `payment_intent`, `payment` (Adyen, Square), `order` (PayPal) or `email`.
    pub kind: &'static str,
    /// The `Idempotency-Key` header it was created with, if any.
    pub idempotency_key: Option<String>,
    /// The `idemflow_key` metadata value it carries, if any.
    pub metadata_key: Option<String>,
    /// For a PaymentIntent its status (`succeeded`, `requires_payment_method`), for an Adyen
    /// payment its `resultCode`, for a Square payment or a PayPal order its current status, for
    /// an email `sent`.
    pub status: String,
    /// The request that caused it (form fields as a JSON object for Stripe).
    pub request: serde_json::Value,
}

/// The effects a fake performed, shared with the fake (clones see the same entries).
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    inner: Arc<Mutex<Vec<Effect>>>,
}

impl Ledger {
    /// A snapshot of every effect, oldest first.
    pub fn entries(&self) -> Vec<Effect> {
        lock(&self.inner).clone()
    }

    /// How many effects there are.
    pub fn len(&self) -> usize {
        lock(&self.inner).len()
    }

    /// Whether nothing happened.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many effects carry `key`, as idempotency key or as `idemflow_key` metadata.
    pub fn count_for_key(&self, key: &str) -> usize {
        lock(&self.inner)
            .iter()
            .filter(|e| {
                e.idempotency_key.as_deref() == Some(key) || e.metadata_key.as_deref() == Some(key)
            })
            .count()
    }

    /// Forgets every effect.
    pub fn clear(&self) {
        lock(&self.inner).clear();
    }

    pub(crate) fn push(&self, effect: Effect) {
        lock(&self.inner).push(effect);
    }

    /// Sets the status of the effect with this id (a payment voided, an order captured).
    pub(crate) fn set_status(&self, id: &str, status: &str) {
        for e in lock(&self.inner).iter_mut().filter(|e| e.id == id) {
            e.status = status.to_owned();
        }
    }
}

/// A failure to inject into the next request to a fake's effect endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Answer with this 5xx status **before** doing anything (nothing is executed or saved).
    ServerError {
        /// The status, e.g. 500 or 503.
        status: u16,
    },
    /// Answer 429 with `Retry-After` before doing anything.
    RateLimited {
        /// The `Retry-After` sent (whole seconds, rounded up).
        retry_after: Duration,
    },
    /// Execute (and save the idempotent answer), then close the connection without answering.
    LoseResponse,
    /// Execute (and save the idempotent answer), then never answer: the client times out.
    Hang,
    /// Hold the request this long **before** the provider records its key or does anything
    /// (it sits in the provider's queue), then handle it normally: a void or lookup sent
    /// meanwhile finds no trace of it yet. [`FakeSquare`] finishes the request even when its
    /// client has stopped waiting; the other fakes stop handling a request whose connection
    /// closed.
    Delay {
        /// How long the request waits.
        before: Duration,
    },
}

#[derive(Debug, Default)]
struct FaultState {
    queue: VecDeque<Fault>,
    latency: Duration,
    search_lag: Duration,
}

/// Fault injection for one fake (clones control the same fake).
#[derive(Debug, Clone, Default)]
pub struct Faults {
    inner: Arc<Mutex<FaultState>>,
}

impl Faults {
    /// Queues a fault for the next effect request not yet faulted.
    pub fn push(&self, fault: Fault) -> &Self {
        lock(&self.inner).queue.push_back(fault);
        self
    }

    /// The next effect request gets this 5xx before anything is executed.
    pub fn server_error_next(&self, status: u16) -> &Self {
        self.push(Fault::ServerError { status })
    }

    /// The next effect request gets 429 with `Retry-After`.
    pub fn rate_limit_next(&self, retry_after: Duration) -> &Self {
        self.push(Fault::RateLimited { retry_after })
    }

    /// The next effect request is executed, then its connection is closed without an answer.
    pub fn lose_next_response(&self) -> &Self {
        self.push(Fault::LoseResponse)
    }

    /// The next effect request is executed, then never answered.
    pub fn hang_next_response(&self) -> &Self {
        self.push(Fault::Hang)
    }

    /// The next effect request waits `before` before anything about it is recorded, then is
    /// handled normally (see [`Fault::Delay`]).
    pub fn delay_next(&self, before: Duration) -> &Self {
        self.push(Fault::Delay { before })
    }

    /// How long executing an effect takes (the key is "in flight" meanwhile, so a concurrent
    /// same-key request sees the provider's 409). Default zero.
    pub fn set_latency(&self, latency: Duration) -> &Self {
        lock(&self.inner).latency = latency;
        self
    }

    /// How long after its creation an object becomes visible to search. Default zero.
    pub fn set_search_lag(&self, lag: Duration) -> &Self {
        lock(&self.inner).search_lag = lag;
        self
    }

    /// Faults still queued.
    pub fn pending(&self) -> usize {
        lock(&self.inner).queue.len()
    }

    /// Drops queued faults and resets latency and search lag.
    pub fn clear(&self) {
        *lock(&self.inner) = FaultState::default();
    }

    /// The next queued fault, after waiting out a [`Fault::Delay`] (which then leaves no other
    /// fault for this request).
    pub(crate) async fn next(&self) -> Option<Fault> {
        let fault = lock(&self.inner).queue.pop_front();
        match fault {
            Some(Fault::Delay { before }) => {
                tokio::time::sleep(before).await;
                None
            }
            other => other,
        }
    }

    pub(crate) fn latency(&self) -> Duration {
        lock(&self.inner).latency
    }

    pub(crate) fn search_lag(&self) -> Duration {
        lock(&self.inner).search_lag
    }
}

/// A request a fake received, as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path, e.g. `/v1/payment_intents`.
    pub path: String,
    /// The raw query string, if any.
    pub query: Option<String>,
    /// Headers with lower-case names, in order.
    pub headers: Vec<(String, String)>,
    /// The body bytes.
    pub body: Vec<u8>,
}

impl RecordedRequest {
    /// The first header with this name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as text.
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// State every fake shares: ledger, faults, received requests.
#[derive(Debug, Clone, Default)]
pub(crate) struct Common {
    pub(crate) ledger: Ledger,
    pub(crate) faults: Faults,
    pub(crate) requests: Arc<Mutex<Vec<RecordedRequest>>>,
    pub(crate) counter: Arc<Mutex<u64>>,
}

impl Common {
    pub(crate) fn record(
        &self,
        method: &axum::http::Method,
        uri: &axum::http::Uri,
        headers: &axum::http::HeaderMap,
        body: &[u8],
    ) {
        let headers = headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        lock(&self.requests).push(RecordedRequest {
            method: method.as_str().to_owned(),
            path: uri.path().to_owned(),
            query: uri.query().map(str::to_owned),
            headers,
            body: body.to_vec(),
        });
    }

    pub(crate) fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.requests).clone()
    }

    /// A fresh sequence number for ids.
    pub(crate) fn next_id(&self) -> u64 {
        let mut c = lock(&self.counter);
        *c += 1;
        *c
    }
}

/// Where an idempotency key stands at a fake.
#[derive(Debug, Clone)]
pub(crate) enum KeyEntry {
    Running,
    Done {
        params: String,
        status: u16,
        body: Vec<u8>,
    },
}

/// What to do after executing: answer, drop the connection, or hang.
pub(crate) async fn deliver(
    after: Option<Fault>,
    kill: &server::KillSwitch,
    response: axum::response::Response,
) -> axum::response::Response {
    match after {
        Some(Fault::LoseResponse) => {
            kill.kill();
            std::future::pending::<()>().await;
            response
        }
        Some(Fault::Hang) => {
            std::future::pending::<()>().await;
            response
        }
        _ => response,
    }
}

fn header_value(headers: &axum::http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn json_response(
    status: u16,
    body: &serde_json::Value,
    extra: &[(&str, String)],
) -> axum::response::Response {
    raw_response(status, serde_json::to_vec(body).unwrap_or_default(), extra)
}

fn raw_response(status: u16, body: Vec<u8>, extra: &[(&str, String)]) -> axum::response::Response {
    let mut b = axum::http::Response::builder()
        .status(status)
        .header("content-type", "application/json");
    for (n, v) in extra {
        b = b.header(*n, v.as_str());
    }
    b.body(axum::body::Body::from(body))
        .unwrap_or_else(|_| axum::http::Response::new(axum::body::Body::empty()))
}

/// Seconds for a `Retry-After` header, rounded up.
fn retry_after_secs(d: Duration) -> String {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.to_string()
}
