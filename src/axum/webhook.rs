//! A webhook receiver (feature `axum`): verifies each delivery, runs the handler once per event
//! id through [`Idempotency::execute`], and answers so that the sender's retries converge on one
//! effect. Stripe's is built in ([`WebhookReceiver::stripe`]); any other provider's is
//! [`WebhookReceiver::new`] with a [`VerifyWebhook`] and an event id extractor of its own.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use axum::Router;
//! use idemflow::{Idempotency, Store, store::sqlite::SqliteStore};
//! use idemflow::axum::webhook::{WebhookEvent, WebhookReceiver};
//! use idemflow::provider::stripe_signature::StripeSignature;
//!
//! let store = SqliteStore::connect("sqlite::memory:").await?;
//! store.migrate().await?;
//! let idem = Idempotency::new(Arc::new(store));
//! let receiver = WebhookReceiver::stripe(idem, StripeSignature::new("whsec_..."), |event: WebhookEvent| async move {
//!     println!("{} {}", event.id(), event.kind());
//!     Ok::<(), String>(())
//! });
//! let app: Router = Router::new().route_service("/webhooks/stripe", receiver);
//! # Ok(())
//! # }
//! ```
//!
//! | Delivery                                                  | Answer                                      |
//! |-----------------------------------------------------------|---------------------------------------------|
//! | not `POST`                                                | 405 `method-not-allowed`                    |
//! | body over the cap ([`DEFAULT_MAX_BODY_BYTES`], 1 MiB)      | 413 `body-too-large`                        |
//! | signature missing, malformed, wrong, or outside the tolerance | 400 `signature-invalid`; nothing recorded |
//! | event unreadable (not JSON, no `id` / `type`), or its id not a valid key | 400 `event-invalid`; nothing recorded |
//! | a new event; the handler returns `Ok`                     | 200 `{"received":true,"event":"evt_..."}`, once the key is `done` |
//! | an event already handled                                  | the same 200 + `Idempotent-Replayed: true`; the handler does not run |
//! | an event whose first delivery is still being handled      | 409 `request-in-flight` + `Retry-After`     |
//! | the handler returns `Err` or panics                       | 503 `retryable` + `Retry-After`; the key is `failed{retryable}`, the next delivery runs the handler again |
//! | an event whose run crashed (process killed) and whose lease ran out | the next delivery takes the key over and runs the handler again |
//! | the store cannot be reached                               | 503 `store-unavailable` + `Retry-After`     |
//! | Redis with `WAIT`: too few replicas acknowledged           | 503 `store-not-replicated` + `Retry-After`  |
//! | the store fails otherwise                                 | 500 `store-error`                           |
//!
//! Every answer but a 2xx makes Stripe deliver the event again later (with backoff, for up to
//! three days). The key of an event is its id, in the receiver's scope (`webhook:stripe` for
//! Stripe, [`WebhookReceiver::scope`] to change it), under the operation `webhook`; its
//! fingerprint covers the event's id and type, not the body (a redelivery is the same event,
//! whatever bytes carry it), and the request stored with the key is that pair. See
//! `docs/consumers.md` for what is promised and its limits.
//!
//! The run (claim, handler, finish) goes on in a task of its own, so a sender that hangs up
//! (a timeout on its side) does not cut it between the handler's effect and the key's finish.
//!
//! With feature `http`, [`WebhookReceiver::settle_keys`] also settles idemflow keys still
//! `processing` from the `payment_intent.*` events that report them (see [`SettleKeys`]).

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, Limited};
use serde_json::{Value, json};
use tracing::{Instrument, info_span};

use super::{Problem, REPLAYED_HEADER};
use crate::error::RequestError;
use crate::provider::stripe_signature::{SIGNATURE_HEADER, SignatureError, StripeSignature};
use crate::setters::setters;
use crate::store::phase::AtomicPhase;
use crate::{Execution, Idempotency, IdempotentRequest, Outcome, StoredResponse, key::Scope};

/// The scope of a Stripe receiver's keys unless [`WebhookReceiver::scope`] sets another.
pub const STRIPE_SCOPE: &str = "webhook:stripe";

/// The operation name of every event's key.
pub const OPERATION: &str = "webhook";

/// The default body cap: 1 MiB (Stripe's events are a few KiB; an `invoice` with many lines can
/// be larger than the executor's 64 KiB request cap, which only bounds the stored id and type).
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;

/// Why a delivery was refused before its handler could run. Nothing is recorded for any of
/// them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookError {
    /// The request is not a `POST` (405).
    #[error("webhooks are delivered with POST, not {0}")]
    MethodNotAllowed(Method),
    /// The body is over the cap (413).
    #[error("body over {limit} bytes")]
    BodyTooLarge {
        /// The cap.
        limit: usize,
    },
    /// The body could not be read (400).
    #[error("body could not be read: {0}")]
    BodyUnreadable(String),
    /// Stripe's signature does not hold (400).
    #[error(transparent)]
    Signature(#[from] SignatureError),
    /// A caller-supplied verifier refused the delivery (400).
    #[error("delivery not verified: {reason}")]
    Unverified {
        /// Why.
        reason: String,
    },
    /// The event cannot be read: not JSON, or no id or type (400).
    #[error("event unreadable: {reason}")]
    InvalidEvent {
        /// Why.
        reason: String,
    },
    /// The event's id cannot be a key (empty, over 255 bytes, not visible ASCII) (400).
    #[error("event id unusable as a key: {0}")]
    InvalidEventId(#[source] RequestError),
}

impl WebhookError {
    /// The HTTP status this refusal is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            WebhookError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            WebhookError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            WebhookError::BodyUnreadable(_)
            | WebhookError::Signature(_)
            | WebhookError::Unverified { .. }
            | WebhookError::InvalidEvent { .. }
            | WebhookError::InvalidEventId(_) => StatusCode::BAD_REQUEST,
        }
    }

    fn slug(&self) -> (&'static str, &'static str) {
        match self {
            WebhookError::MethodNotAllowed(_) => ("method-not-allowed", "Method not allowed"),
            WebhookError::BodyTooLarge { .. } => ("body-too-large", "Request too large"),
            WebhookError::BodyUnreadable(_) => ("body-unreadable", "Request body unreadable"),
            WebhookError::Signature(_) | WebhookError::Unverified { .. } => {
                ("signature-invalid", "Webhook signature invalid")
            }
            WebhookError::InvalidEvent { .. } | WebhookError::InvalidEventId(_) => {
                ("event-invalid", "Webhook event invalid")
            }
        }
    }
}

impl IntoResponse for WebhookError {
    fn into_response(self) -> Response {
        let (slug, title) = self.slug();
        let mut resp = Problem::new(self.status(), slug, title)
            .detail(self.to_string())
            .into_response();
        if matches!(self, WebhookError::MethodNotAllowed(_)) {
            resp.headers_mut()
                .insert(axum::http::header::ALLOW, HeaderValue::from_static("POST"));
        }
        resp
    }
}

/// Checks that a delivery comes from the provider (a signature over the raw body, say).
/// [`StripeSignature`] is Stripe's.
pub trait VerifyWebhook: Send + Sync + 'static {
    /// `Ok` when the delivery with these headers and this raw body is genuine; a refusal is
    /// answered 400 and nothing is recorded.
    fn verify_delivery(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), WebhookError>;
}

impl VerifyWebhook for StripeSignature {
    /// Reads `Stripe-Signature` (sent twice: malformed) and checks it against now.
    fn verify_delivery(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), WebhookError> {
        let mut values = headers.get_all(SIGNATURE_HEADER).iter();
        let header = values.next();
        if values.next().is_some() {
            return Err(SignatureError::Malformed {
                reason: "sent twice".to_owned(),
            }
            .into());
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        self.verify(header.map(HeaderValue::as_bytes), body, now)?;
        Ok(())
    }
}

/// One delivered event, verified: its id (the key), its type, the raw body and its JSON.
#[derive(Debug, Clone)]
pub struct WebhookEvent {
    id: String,
    kind: String,
    body: Bytes,
    json: Value,
}

impl WebhookEvent {
    /// An event with this id and type, delivered as `body` (`json`: its parsed form, or
    /// `Value::Null` when it is not JSON).
    pub fn new(id: impl Into<String>, kind: impl Into<String>, body: Bytes, json: Value) -> Self {
        Self {
            id: id.into(),
            kind: kind.into(),
            body,
            json,
        }
    }

    /// The event's id (`evt_...`): its key.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The event's type (`payment_intent.succeeded`).
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The raw body, as signed.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> &Value {
        &self.json
    }
}

/// Reads a Stripe event: a JSON object with a string `id` and a string `type`.
pub fn stripe_event(_headers: &HeaderMap, body: &Bytes) -> Result<WebhookEvent, WebhookError> {
    let invalid = |reason: String| WebhookError::InvalidEvent { reason };
    let json: Value =
        serde_json::from_slice(body).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let field = |name: &str| {
        json.get(name)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| invalid(format!("no string `{name}`")))
    };
    let (id, kind) = (field("id")?, field("type")?);
    Ok(WebhookEvent {
        id,
        kind,
        body: body.clone(),
        json,
    })
}

/// Reads a delivery into its event (see [`WebhookReceiver::new`]).
pub type ExtractFn =
    Arc<dyn Fn(&HeaderMap, &Bytes) -> Result<WebhookEvent, WebhookError> + Send + Sync>;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The scope of Stripe's events, [`STRIPE_SCOPE`].
fn stripe_scope() -> Scope {
    match Scope::new(STRIPE_SCOPE) {
        Ok(scope) => scope,
        // A constant of visible ASCII (`tests::the_stripe_scope_is_a_valid_scope`).
        Err(e) => unreachable!("{STRIPE_SCOPE:?} is not a valid scope: {e}"),
    }
}
type HandlerFn = Arc<dyn Fn(WebhookEvent) -> BoxFuture<Result<(), String>> + Send + Sync>;
type PhaseFn = Arc<dyn Fn(WebhookEvent) -> Box<dyn AtomicPhase> + Send + Sync>;

/// What a receiver runs for a new event.
#[derive(Clone)]
enum Handler {
    /// The application's handler, under the event's key (`execute`).
    Run(HandlerFn),
    /// The application's writes, in one commit with the event's key (`execute_atomic`).
    OneCommit(PhaseFn),
}

/// The answer a receiver gives for a handled event: 200 `{"received":true,"event":"<id>"}`.
/// A one-commit receiver's writes return it ([`WebhookReceiver::new_atomic`]).
pub fn acknowledgement(event_id: &str) -> StoredResponse {
    StoredResponse::new(200)
        .with_header("content-type", "application/json")
        .with_body(json!({"received": true, "event": event_id}).to_string())
}

#[derive(Clone)]
struct Receiver {
    idem: Idempotency,
    scope: String,
    verifier: Arc<dyn VerifyWebhook>,
    extract: ExtractFn,
    handler: Handler,
    max_body_bytes: usize,
    #[cfg(feature = "http")]
    settle: Option<SettleKeys>,
}

/// A webhook endpoint as a tower service: mount it with
/// [`Router::route_service`](axum::Router::route_service). Cheap to clone. See the
/// [module docs](self) for what it answers when.
#[derive(Clone)]
pub struct WebhookReceiver {
    inner: Arc<Receiver>,
}

impl fmt::Debug for WebhookReceiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebhookReceiver")
            .field("scope", &self.inner.scope)
            .field("max_body_bytes", &self.inner.max_body_bytes)
            .finish_non_exhaustive()
    }
}

impl WebhookReceiver {
    /// A receiver for any provider: `verifier` checks each delivery, `extract` reads its event
    /// (id and type), and `handler` acts on it, once per event id in `scope`.
    ///
    /// The handler's `Ok` is recorded (the key `done`) before the sender gets its 2xx; an `Err`
    /// or a panic leaves the key retryable and answers 503, so the next delivery runs it again.
    /// A handler therefore runs more than once only after a failed run: its effect must be all
    /// or nothing, or keyed by the event id (`docs/consumers.md`).
    ///
    /// `idem` is used with its store, lease and retention; a retry takes a crashed run over
    /// once its lease has run out, however old the key (the handler's effect is the
    /// application's own, not a provider's).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use axum::Router;
    /// use idemflow::axum::webhook::{WebhookEvent, WebhookReceiver, stripe_event};
    /// use idemflow::provider::stripe_signature::StripeSignature;
    /// use idemflow::{Idempotency, Store, key::Scope, store::sqlite::SqliteStore};
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let idem = Idempotency::new(Arc::new(store));
    /// let receiver = WebhookReceiver::new(
    ///     idem,
    ///     Scope::new("stripe-events")?,
    ///     StripeSignature::new("whsec_..."),
    ///     stripe_event,
    ///     |event: WebhookEvent| async move {
    ///         // Act on `event.kind()` once per event id.
    ///         Ok::<(), std::convert::Infallible>(())
    ///     },
    /// );
    /// let app: Router = Router::new().route_service("/webhooks/stripe", receiver);
    /// # drop(app);
    /// # Ok(()) }
    /// ```
    pub fn new<V, X, F, Fut, E>(
        idem: Idempotency,
        scope: Scope,
        verifier: V,
        extract: X,
        handler: F,
    ) -> Self
    where
        V: VerifyWebhook,
        X: Fn(&HeaderMap, &Bytes) -> Result<WebhookEvent, WebhookError> + Send + Sync + 'static,
        F: Fn(WebhookEvent) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let handler: HandlerFn = Arc::new(move |event| {
            let run = handler(event);
            Box::pin(async move { run.await.map_err(|e| e.to_string()) })
        });
        Self::build(idem, scope, verifier, extract, Handler::Run(handler))
    }

    /// A receiver whose effect commits **with the event's key**, in one database transaction
    /// (`Idempotency::execute_atomic`, `docs/one-commit.md`): `phase(event)` makes the SQL
    /// store's phase for the event (`store.atomic_phase(..)`), whose writes record the effect
    /// and return the answer, usually [`acknowledgement`]. A crash anywhere before the commit
    /// leaves neither the effect nor the key, so the next delivery makes the effect once; a
    /// failure of the writes rolls both back and answers 503. `idem` must run on the store the
    /// phases are made by (else 500 `no-shared-transaction`, nothing recorded).
    pub fn new_atomic<V, X, M, P>(
        idem: Idempotency,
        scope: Scope,
        verifier: V,
        extract: X,
        phase: M,
    ) -> Self
    where
        V: VerifyWebhook,
        X: Fn(&HeaderMap, &Bytes) -> Result<WebhookEvent, WebhookError> + Send + Sync + 'static,
        M: Fn(WebhookEvent) -> P + Send + Sync + 'static,
        P: AtomicPhase + 'static,
    {
        let phase: PhaseFn = Arc::new(move |event| Box::new(phase(event)));
        Self::build(idem, scope, verifier, extract, Handler::OneCommit(phase))
    }

    fn build<V, X>(
        idem: Idempotency,
        scope: Scope,
        verifier: V,
        extract: X,
        handler: Handler,
    ) -> Self
    where
        V: VerifyWebhook,
        X: Fn(&HeaderMap, &Bytes) -> Result<WebhookEvent, WebhookError> + Send + Sync + 'static,
    {
        Self {
            inner: Arc::new(Receiver {
                idem: idem.retry_takeover_window(Some(crate::executor::LOCAL_EFFECT_TAKEOVER)),
                scope: scope.as_str().to_owned(),
                verifier: Arc::new(verifier),
                extract: Arc::new(extract),
                handler,
                max_body_bytes: DEFAULT_MAX_BODY_BYTES,
                #[cfg(feature = "http")]
                settle: None,
            }),
        }
    }

    /// A Stripe receiver: `Stripe-Signature` checked by `signature`, events read by
    /// [`stripe_event`], keys in the scope [`STRIPE_SCOPE`].
    pub fn stripe<F, Fut, E>(idem: Idempotency, signature: StripeSignature, handler: F) -> Self
    where
        F: Fn(WebhookEvent) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        Self::new(idem, stripe_scope(), signature, stripe_event, handler)
    }

    /// A Stripe receiver whose effect commits with the event's key: [`WebhookReceiver::stripe`]
    /// as [`WebhookReceiver::new_atomic`] is to [`WebhookReceiver::new`].
    pub fn stripe_atomic<M, P>(idem: Idempotency, signature: StripeSignature, phase: M) -> Self
    where
        M: Fn(WebhookEvent) -> P + Send + Sync + 'static,
        P: AtomicPhase + 'static,
    {
        Self::new_atomic(idem, stripe_scope(), signature, stripe_event, phase)
    }

    /// The scope of the events' keys: one per endpoint (two endpoints receiving the same
    /// events, each with its own handler, need two scopes).
    pub fn scope(mut self, scope: Scope) -> Self {
        Arc::make_mut(&mut self.inner).scope = scope.as_str().to_owned();
        self
    }

    setters! { shared inner;
        /// The largest body accepted (413 above). Default [`DEFAULT_MAX_BODY_BYTES`].
        max_body_bytes(max_body_bytes: usize);
    }

    async fn receive(self, req: Request) -> Response {
        let span = info_span!(
            "idemflow.webhook",
            scope = %self.inner.scope,
            event = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        let answer = match self.answer(req).instrument(span.clone()).await {
            Ok(resp) => resp,
            Err(refused) => {
                let _in = span.enter();
                tracing::info!(error = %refused, "webhook delivery refused");
                refused.into_response()
            }
        };
        span.record("status", answer.status().as_u16());
        answer
    }

    async fn answer(self, req: Request) -> Result<Response, WebhookError> {
        let r = &self.inner;
        if req.method() != Method::POST {
            return Err(WebhookError::MethodNotAllowed(req.method().clone()));
        }
        let (parts, body) = req.into_parts();
        let body = match Limited::new(body, r.max_body_bytes).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(WebhookError::BodyTooLarge {
                    limit: r.max_body_bytes,
                });
            }
            Err(e) => return Err(WebhookError::BodyUnreadable(e.to_string())),
        };
        r.verifier.verify_delivery(&parts.headers, &body)?;
        let event = (r.extract)(&parts.headers, &body)?;
        tracing::Span::current().record("event", event.id());
        let fingerprinted = json!({"id": event.id(), "type": event.kind()});
        let request = IdempotentRequest::new(&r.scope, event.id(), OPERATION, &fingerprinted)
            .map_err(WebhookError::InvalidEventId)?;
        // The run goes on in its own task: a sender hanging up does not cut it between the
        // handler's effect and the key's finish.
        let this = self.clone();
        let run = tokio::spawn(
            async move {
                let r = &this.inner;
                match &r.handler {
                    Handler::Run(_) => {
                        r.idem
                            .execute(request, |_ctx| this.run_handler(event))
                            .await
                    }
                    Handler::OneCommit(phase) => {
                        if let Err(reason) = this.settle_first(&event).await {
                            return Err(crate::Error::FailedRetryable {
                                key: request.id().clone(),
                                reason,
                            });
                        }
                        r.idem.execute_atomic(request, phase(event)).await
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        Ok(match run.await {
            Ok(Ok(Execution::Executed(stored))) => super::service::to_http(stored),
            Ok(Ok(Execution::Replayed(stored))) => {
                let mut resp = super::service::to_http(stored);
                resp.headers_mut()
                    .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
                resp
            }
            Ok(Err(e)) => {
                tracing::info!(error = %e, "webhook event not acknowledged");
                Problem::from(&e).into_response()
            }
            Err(crashed) => {
                tracing::error!(error = %crashed, "webhook run crashed");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "webhook-crashed",
                    "The webhook's run crashed",
                )
                .into_response()
            }
        })
    }

    /// Settles the key the event reports, when asked to ([`WebhookReceiver::settle_keys`]):
    /// before the event's own run, so that a failure leaves the event to be delivered again.
    async fn settle_first(&self, event: &WebhookEvent) -> Result<(), String> {
        #[cfg(feature = "http")]
        if let Some(settle) = &self.inner.settle {
            return settle
                .settle(event)
                .await
                .map(|_| ())
                .map_err(|e| format!("settling the key the event reports failed: {e}"));
        }
        let _ = event;
        Ok(())
    }

    /// The operation run under the event's key: settle the key the event reports (if asked),
    /// then the handler, in a task of its own so that a panic is caught as a failure.
    async fn run_handler(&self, event: WebhookEvent) -> Outcome {
        let r = &self.inner;
        if let Err(reason) = self.settle_first(&event).await {
            return Outcome::retryable(reason);
        }
        let Handler::Run(handler) = &r.handler else {
            return Outcome::retryable("a one-commit receiver has no handler to run".to_owned());
        };
        let id = event.id().to_owned();
        match tokio::spawn(handler(event)).await {
            Ok(Ok(())) => Outcome::Succeeded(acknowledgement(&id)),
            Ok(Err(reason)) => Outcome::retryable(format!("the handler failed: {reason}")),
            Err(e) if e.is_panic() => Outcome::retryable(format!(
                "the handler panicked: {}",
                crate::store::phase::panic_message(&*e.into_panic())
            )),
            Err(e) => Outcome::retryable(format!("the handler did not finish: {e}")),
        }
    }
}

impl tower::Service<Request> for WebhookReceiver {
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.receive(req).await) })
    }
}

#[cfg(feature = "http")]
pub use settle::SettleKeys;

#[cfg(feature = "http")]
mod settle {
    use std::sync::Arc;

    use serde_json::Value;

    use super::{WebhookEvent, WebhookReceiver};
    use crate::error::StoreError;
    use crate::provider::Stripe;
    use crate::sweeper::{EventSettlement, EventTarget, ProviderEvent};
    use crate::{KeyId, Sweeper};

    /// The default [`SettleKeys::scan_limit`].
    const DEFAULT_SCAN_LIMIT: u32 = 1000;

    type LocateFn = Arc<dyn Fn(&Value) -> Option<KeyId> + Send + Sync>;

    /// How a Stripe receiver settles idemflow keys from the events that report them (feature
    /// `http`): a `payment_intent.succeeded`, `payment_intent.payment_failed` or
    /// `payment_intent.canceled` event whose PaymentIntent carries `metadata.idemflow_key`
    /// settles the key that sent it, if it is still `processing` with its lease run out, at
    /// once and through the sweeper's own fenced write ([`Sweeper::settle_from_event`]). Its
    /// provider (default `"stripe"`) must be registered with the sweeper.
    ///
    /// The provider key is a hash of the key, so the key is found by reading the processing
    /// keys (up to [`scan_limit`](Self::scan_limit), oldest first), unless
    /// [`locate_with`](Self::locate_with) names it from the PaymentIntent.
    #[derive(Clone)]
    pub struct SettleKeys {
        sweeper: Sweeper,
        provider: String,
        scan_limit: u32,
        locate: Option<LocateFn>,
    }

    impl std::fmt::Debug for SettleKeys {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("SettleKeys")
                .field("provider", &self.provider)
                .field("scan_limit", &self.scan_limit)
                .field("locate", &self.locate.is_some())
                .finish_non_exhaustive()
        }
    }

    impl SettleKeys {
        /// Settles keys through `sweeper` (its store and providers).
        pub fn new(sweeper: Sweeper) -> Self {
            Self {
                sweeper,
                provider: "stripe".to_owned(),
                scan_limit: DEFAULT_SCAN_LIMIT,
                locate: None,
            }
        }

        /// The name the Stripe adapter is registered under (default `"stripe"`).
        pub fn provider(mut self, name: impl Into<String>) -> Self {
            self.provider = name.into();
            self
        }

        /// How many processing keys one event reads at most to find its key (default 1000).
        pub fn scan_limit(mut self, limit: u32) -> Self {
            self.scan_limit = limit.max(1);
            self
        }

        /// Names the key from the event's PaymentIntent (say, from metadata the application
        /// sends with its request) instead of scanning; `None` settles nothing. The key is
        /// settled only if its provider key is the event's `idemflow_key`.
        pub fn locate_with<F>(mut self, locate: F) -> Self
        where
            F: Fn(&Value) -> Option<KeyId> + Send + Sync + 'static,
        {
            self.locate = Some(Arc::new(locate));
            self
        }

        /// Settles the key `event` reports, if it reports one.
        pub(super) async fn settle(
            &self,
            event: &WebhookEvent,
        ) -> Result<Option<EventSettlement>, StoreError> {
            let Some((provider_key, outcome)) = Stripe::event_outcome(event.json()) else {
                return Ok(None);
            };
            let reported = ProviderEvent::new(&self.provider, provider_key, outcome, event.id());
            let located;
            let target = match &self.locate {
                Some(locate) => match event
                    .json()
                    .pointer("/data/object")
                    .and_then(|pi| locate(pi))
                {
                    Some(id) => {
                        located = id;
                        EventTarget::Key(&located)
                    }
                    None => return Ok(Some(EventSettlement::NotFound)),
                },
                None => EventTarget::ScanProcessing {
                    limit: self.scan_limit,
                },
            };
            let settled = self.sweeper.settle_from_event(target, &reported).await?;
            tracing::info!(result = ?settled, "key reported by the event");
            Ok(Some(settled))
        }
    }

    impl WebhookReceiver {
        /// Also settles the idemflow keys Stripe's `payment_intent.*` events report (see
        /// [`SettleKeys`]), before the handler runs, under the event's key: a store error
        /// while settling fails the run (503), so the event is delivered again.
        pub fn settle_keys(mut self, settle: SettleKeys) -> Self {
            Arc::make_mut(&mut self.inner).settle = Some(settle);
            self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stripe_scope_is_a_valid_scope() {
        assert_eq!(Scope::new(STRIPE_SCOPE).unwrap().as_str(), "webhook:stripe");
    }

    #[test]
    fn a_stripe_event_needs_an_id_and_a_type() {
        let read = |body: &'static [u8]| stripe_event(&HeaderMap::new(), &Bytes::from_static(body));
        let event = read(br#"{"id":"evt_1","type":"invoice.paid","data":{}}"#).unwrap();
        assert_eq!((event.id(), event.kind()), ("evt_1", "invoice.paid"));
        assert_eq!(event.json()["data"], json!({}));
        for bad in [
            &b"nope"[..],
            b"[]",
            br#"{"id":1,"type":"x"}"#,
            br#"{"id":"evt_1"}"#,
        ] {
            let refused = read(bad).unwrap_err();
            assert!(
                matches!(refused, WebhookError::InvalidEvent { .. }),
                "{refused:?}"
            );
            assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        }
    }
}
