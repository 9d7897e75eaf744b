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
//! let outcome = resend.send("idf_0123", &email).await; // the adapter retries with the same key
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
//!   the search lag has passed. `Stripe-Account: acct_...` (Connect) acts on that connected
//!   account: its keys and PaymentIntents are its own (a search sees only the account's), the
//!   ledger's `request` records the header as `"Stripe-Account"`, and its events name it.
//!   `capture_method=manual` leaves a confirmed PaymentIntent `requires_capture`;
//!   `POST /v1/payment_intents/{id}/capture` (keyed the same way) captures it (ledger kind
//!   `capture`; 400 `payment_intent_unexpected_state` when it is not capturable, 404 when the
//!   account holds no such PaymentIntent), and `GET /v1/payment_intents/{id}` retrieves one
//!   (no search lag). `POST /v1/refunds` (keyed; `payment_intent` or `charge`, the
//!   PaymentIntent's `latest_charge`; `amount` defaults to what is left) refunds a succeeded
//!   payment (ledger kind `refund`; 400 `charge_already_refunded` or `amount_too_large`
//!   past what was received), and `GET /v1/refunds?payment_intent=..|charge=..` lists the
//!   payment's refunds, newest first (`limit`, `starting_after`, `has_more`).
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
//! [`WebhookSender`] delivers Stripe webhook events signed as Stripe signs them (`Stripe-Signature`,
//! one `v1` per secret), once, with retries until a 2xx, or as concurrent duplicates;
//! [`FakeStripe::payment_intent_event`] builds the event Stripe would send for a PaymentIntent the
//! fake made.
//!
//! Faults (see [`Faults`]) apply to the effect endpoint (the `POST`), one queued fault per
//! request, in order; latency and search lag are settings.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

mod adyen;
mod paypal;
mod postmark;
mod resend;
mod server;
mod square;
mod stripe;
mod webhook;

pub use adyen::FakeAdyen;
pub use paypal::FakePayPal;
pub use postmark::FakePostmark;
pub use resend::FakeResend;
pub use square::FakeSquare;
pub use stripe::FakeStripe;
pub use webhook::{Delivered, WebhookSender, stripe_event};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One real effect a fake performed: a PaymentIntent, payment or order created, an email sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Effect {
    /// The provider's id (`pi_...`, an email id, a Postmark `MessageID`).
    pub id: String,
    /// `payment_intent`, `capture` and `refund` (Stripe), `payment` (Adyen, Square), `order`
    /// (PayPal) or `email`.
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

    /// How many effects a client's key made: the effects that carry the provider key idemflow
    /// derives for `id` and `operation` when it calls `provider` ([`KeySpec::derive`], the key
    /// of the key's first life), as idempotency key or as `idemflow_key` metadata. Use it to
    /// assert "one charge per client key" without knowing the derived key.
    ///
    /// [`KeySpec::derive`]: crate::provider::KeySpec::derive
    pub fn count_for_client_key(
        &self,
        provider: &dyn crate::Provider,
        id: &crate::KeyId,
        operation: &str,
    ) -> usize {
        let derived = provider.key_spec().derive(&id.scope, &id.key, operation);
        self.count_for_key(&derived)
    }

    /// How many effects carry `key` (a provider key: the derived `idf_...`, or one the request
    /// set), as idempotency key or as `idemflow_key` metadata. For a client's key, see
    /// [`count_for_client_key`](Self::count_for_client_key).
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

/// Where an idempotency key stands at a fake: its first request still running, or done with
/// what the fake keeps for it (`T`).
#[derive(Debug, Clone)]
pub(crate) enum KeyEntry<T> {
    Running,
    Done(T),
}

/// What a fake keeps for a key whose answer it saved: the request's fingerprint and the answer.
#[derive(Debug, Clone)]
pub(crate) struct Saved {
    pub(crate) params: String,
    pub(crate) status: u16,
    pub(crate) body: Vec<u8>,
}

impl Saved {
    /// The answer to a same-key request with fingerprint `params`: the saved answer with the
    /// `extra` headers, or `conflict` when the request differs from the first.
    pub(crate) fn answer(
        &self,
        params: &str,
        conflict: impl FnOnce() -> axum::response::Response,
        extra: &[(&str, String)],
    ) -> Known {
        if self.params != params {
            return Known::Refuse(conflict());
        }
        Known::Replay(raw_response(self.status, self.body.clone(), extra))
    }
}

impl Keys<Saved> {
    /// Saves the answer (`status`, `body`) to a request with fingerprint `params` under its key,
    /// if it had one.
    pub(crate) fn save(&self, key: Option<String>, params: String, status: u16, body: &[u8]) {
        if let Some(key) = key {
            let body = body.to_vec();
            self.finish(
                key,
                Saved {
                    params,
                    status,
                    body,
                },
            );
        }
    }
}

/// A fake's answer to a request under a key it already knows.
pub(crate) enum Known {
    /// Refused at once (the first still runs, another request under the key).
    Refuse(axum::response::Response),
    /// The answer for the key, replayed (a queued lost-response fault applies to it too).
    Replay(axum::response::Response),
}

/// A fake's idempotency keys.
#[derive(Debug)]
pub(crate) struct Keys<T>(Mutex<HashMap<String, KeyEntry<T>>>);

impl<T> Default for Keys<T> {
    fn default() -> Self {
        Self(Mutex::default())
    }
}

impl<T> Keys<T> {
    /// Claims `key` (marks it running) for a new request when the fake does not know it;
    /// otherwise answers from the key: `running` while its first request runs, `done` after.
    pub(crate) fn claim(
        &self,
        key: &str,
        running: impl FnOnce() -> axum::response::Response,
        done: impl FnOnce(&T) -> Known,
    ) -> Option<Known> {
        let mut keys = lock(&self.0);
        match keys.get(key) {
            Some(KeyEntry::Running) => Some(Known::Refuse(running())),
            Some(KeyEntry::Done(kept)) => Some(done(kept)),
            None => {
                keys.insert(key.to_owned(), KeyEntry::Running);
                None
            }
        }
    }

    /// Where `key` stands, if the fake knows it.
    pub(crate) fn get(&self, key: &str) -> Option<KeyEntry<T>>
    where
        T: Clone,
    {
        lock(&self.0).get(key).cloned()
    }

    /// Forgets `key`, if any, and answers `refusal`: a request refused by validation is not
    /// saved, so the key can be used again.
    pub(crate) fn refuse(
        &self,
        key: Option<&str>,
        refusal: axum::response::Response,
    ) -> axum::response::Response {
        if let Some(key) = key {
            lock(&self.0).remove(key);
        }
        refusal
    }

    /// Saves what the fake keeps for `key` once its request is done.
    pub(crate) fn finish(&self, key: String, kept: T) {
        lock(&self.0).insert(key, KeyEntry::Done(kept));
    }
}

/// What a fake keeps visible to search only once the search lag has passed.
#[derive(Debug, Default)]
pub(crate) struct Searchable(Mutex<Vec<(Instant, serde_json::Value)>>);

impl Searchable {
    /// Adds `item`, visible `lag` from now.
    pub(crate) fn push(&self, lag: Duration, item: serde_json::Value) {
        lock(&self.0).push((Instant::now() + lag, item));
    }

    /// The items visible now that `matches` accepts, oldest first.
    pub(crate) fn find(
        &self,
        matches: impl Fn(&serde_json::Value) -> bool,
    ) -> Vec<serde_json::Value> {
        let now = Instant::now();
        lock(&self.0)
            .iter()
            .filter(|(visible, item)| *visible <= now && matches(item))
            .map(|(_, item)| item.clone())
            .collect()
    }

    /// Changes the newest item `matches` accepts, visible to search yet or not, with `change`;
    /// `None` when there is none.
    pub(crate) fn update<T>(
        &self,
        matches: impl Fn(&serde_json::Value) -> bool,
        change: impl FnOnce(&mut serde_json::Value) -> T,
    ) -> Option<T> {
        lock(&self.0)
            .iter_mut()
            .rev()
            .map(|(_, item)| item)
            .find(|item| matches(item))
            .map(change)
    }

    /// The newest item `matches` accepts, visible to search yet or not (what the provider
    /// holds).
    pub(crate) fn held(
        &self,
        matches: impl Fn(&serde_json::Value) -> bool,
    ) -> Option<serde_json::Value> {
        lock(&self.0)
            .iter()
            .rev()
            .map(|(_, item)| item)
            .find(|item| matches(item))
            .cloned()
    }
}

/// What the fault queued for an effect request does to its answer once the request was
/// executed: nothing, drop the connection, or hang.
pub(crate) struct Delivery {
    after: Option<Fault>,
    kill: server::KillSwitch,
}

impl Delivery {
    /// Takes the fault queued for an effect request to the fake `A` (after waiting out a
    /// [`Fault::Delay`]): an injected 5xx ([`FakeApi::server_error`](server::FakeApi::server_error))
    /// or 429 (with [`FakeApi::rate_limited`](server::FakeApi::rate_limited) as its body and a
    /// `Retry-After`) is the answer at once, nothing executed; any other fault waits for the
    /// answer.
    pub(crate) async fn take<A: server::FakeApi>(
        faults: &Faults,
        kill: server::KillSwitch,
    ) -> Result<Self, axum::response::Response> {
        match faults.next().await {
            Some(Fault::ServerError { status }) => Err(A::server_error(status)),
            Some(Fault::RateLimited { retry_after }) => Err(json_response(
                429,
                &A::rate_limited(),
                &[("retry-after", retry_after_secs(retry_after))],
            )),
            after => Ok(Self { after, kill }),
        }
    }

    /// Answers, drops the connection, or hangs, as the fault says.
    pub(crate) async fn deliver(
        &self,
        response: axum::response::Response,
    ) -> axum::response::Response {
        match self.after {
            Some(Fault::LoseResponse) => {
                self.kill.kill();
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

    /// Claims `key` in `keys` for this request, or answers from the key (see [`Keys::claim`]):
    /// a refusal at once, a replay delivered as the fault says.
    pub(crate) async fn claim<T>(
        &self,
        keys: &Keys<T>,
        key: &str,
        running: impl FnOnce() -> axum::response::Response,
        done: impl FnOnce(&T) -> Known,
    ) -> Result<(), axum::response::Response> {
        match keys.claim(key, running, done) {
            None => Ok(()),
            Some(Known::Refuse(r)) => Err(r),
            Some(Known::Replay(r)) => Err(self.deliver(r).await),
        }
    }
}

/// A metadata member as [`Effect::metadata_key`] holds it: its text, when it is a string.
fn metadata_text(member: Option<&serde_json::Value>) -> Option<String> {
    member
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
}

/// The request body as a JSON object, if it is one.
fn json_object(body: &[u8]) -> Option<serde_json::Value> {
    serde_json::from_slice(body)
        .ok()
        .filter(serde_json::Value::is_object)
}

/// The first of the required `fields` that `request` lacks (or has as `null`).
fn missing_field(request: &serde_json::Value, fields: &[&'static str]) -> Option<&'static str> {
    fields
        .iter()
        .copied()
        .find(|f| request.get(*f).is_none_or(serde_json::Value::is_null))
}

/// Whether `headers` carry `Authorization: Bearer <key>`.
fn bearer_is(headers: &axum::http::HeaderMap, key: &str) -> bool {
    header_value(headers, "authorization").as_deref() == Some(&format!("Bearer {key}"))
}

/// The query string's parameters, in order.
fn query_pairs(uri: &axum::http::Uri) -> Vec<(String, String)> {
    serde_urlencoded::from_str(uri.query().unwrap_or("")).unwrap_or_default()
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
