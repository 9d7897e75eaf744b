#![cfg_attr(
    all(
        feature = "sqlite",
        feature = "axum",
        feature = "rabbitmq",
        feature = "nats"
    ),
    doc = include_str!("../../docs/consumers.md")
)]
#![cfg_attr(
    not(all(
        feature = "sqlite",
        feature = "axum",
        feature = "rabbitmq",
        feature = "nats"
    )),
    doc = "Queue consumers: each message's handler runs under a key taken from the message, and \
           the message is acknowledged only once its key is settled. Its guide, \
           `docs/consumers.md`, is rendered here when the features `sqlite`, `axum`, `rabbitmq` \
           and `nats` are on, as on docs.rs."
)]

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use tracing::{Instrument, info_span};

use crate::error::{BoxError, RequestError};
use crate::fingerprint::{Fingerprint, canonical_json, parse_json};
use crate::provider::{Provider, Providers};
use crate::setters::setters;
use crate::{
    Context, Error, Execution, Idempotency, IdempotentRequest, Outcome, Sweeper, key::Scope,
};

#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod amqp;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;

/// The operation name of every message's key.
pub const OPERATION: &str = "consume";

/// The default [`Consumer::retry_after`]: 1 s.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The largest [`Consumer::concurrency`]: 65,535 messages at once, RabbitMQ's largest prefetch
/// count (a larger value is taken as this).
pub const MAX_CONCURRENCY: usize = u16::MAX as usize;

/// The default [`Consumer::concurrency`]: 16 messages handled at once.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// The default [`Consumer::sweep_every`]: the in-process sweeper looks for stale keys every 5 s.
pub const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(5);

/// The header a dead-lettered message carries its refusal's reason in (RabbitMQ: an entry of
/// its `headers` table; NATS: a header).
pub const REFUSED_HEADER: &str = "x-idemflow-refused";

/// Where a message's key is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// The broker's message id (the default): AMQP's `message-id` property, NATS's
    /// `Nats-Msg-Id` header.
    MessageId,
    /// A header (AMQP: an entry of the `headers` table holding a string or an integer; NATS: a
    /// header, its first value).
    Header(String),
    /// A member of the body, read as JSON: a JSON pointer (`/order/id`) or the name of a
    /// top-level member (`event_id`); its value a string or an integer.
    JsonField(String),
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::MessageId => f.write_str("the message id"),
            KeySource::Header(name) => write!(f, "header {name:?}"),
            KeySource::JsonField(field) => write!(f, "JSON field {field:?}"),
        }
    }
}

/// What a message's fingerprint covers: a delivery of a key whose fingerprint differs from the
/// first delivery's is another message reusing the key, and is refused
/// ([`ConsumerError::KeyReused`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintSource {
    /// The body's bytes (the default): a broker redelivers the same bytes.
    Body,
    /// The values at these places of the body, read as JSON, in canonical JSON (the form the
    /// HTTP layer fingerprints): a copy its publisher encoded again (members in another order,
    /// other spacing, `1.0` for `1`) is the same message, and the parts not named (a trace id,
    /// a send time) may differ. Each place is a JSON pointer (`/order/id`; `""` is the whole
    /// body) or the name of a top-level member, as in [`KeySource::JsonField`]; a place the
    /// body lacks counts as absent, which differs from `null`.
    JsonPointers(Vec<String>),
}

impl fmt::Display for FingerprintSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FingerprintSource::Body => f.write_str("the body's bytes"),
            FingerprintSource::JsonPointers(places) => write!(f, "the JSON places {places:?}"),
        }
    }
}

/// Why a message was refused for good ([`Disposition::Reject`]), or why a broker's loop stopped
/// or did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The message has no key where the consumer reads it.
    #[error("message has no key: {from} is missing")]
    NoKey {
        /// Where the key was looked for.
        from: KeySource,
    },
    /// The key's place holds something that is not a key (a body that is not JSON, a member
    /// that is neither a string nor an integer, a header that is not text).
    #[error("message key unreadable from {from}: {reason}")]
    KeyUnreadable {
        /// Where the key was looked for.
        from: KeySource,
        /// What was wrong.
        reason: String,
    },
    /// The body cannot be fingerprinted as the consumer says (it is not JSON, or names a member
    /// twice).
    #[error("message fingerprint unreadable from {from}: {reason}")]
    FingerprintUnreadable {
        /// What the fingerprint covers.
        from: FingerprintSource,
        /// What was wrong.
        reason: String,
    },
    /// The key breaks the rules of a key (empty, over 255 bytes, not visible ASCII).
    #[error("message key unusable: {0}")]
    InvalidKey(#[source] RequestError),
    /// The message cannot be made into the provider's request ([`Consumer::sending`]).
    #[error("message cannot be sent: {source}")]
    Unsendable {
        /// The request builder's error.
        #[source]
        source: BoxError,
    },
    /// The key was first handled with another fingerprint: this message is not a redelivery of
    /// that one, and is not handled under its key.
    #[error("message key {key:?} was first handled with another message: {source}")]
    KeyReused {
        /// The key.
        key: String,
        /// The executor's refusal ([`Error::FingerprintMismatch`]).
        #[source]
        source: Box<Error>,
    },
    /// A broker loop would drop refused messages: no dead-letter target is named, or the one
    /// named does not exist. The loop does not start.
    #[error("{broker}: refused messages have nowhere to go: {problem}. {how}")]
    NoDeadLetter {
        /// `"rabbitmq"` or `"nats"`.
        broker: &'static str,
        /// What is missing.
        problem: String,
        /// How to give them a place, or to accept losing them.
        how: &'static str,
    },
    /// The broker failed: connecting, consuming, or acknowledging.
    #[error("{broker}: {source}")]
    Broker {
        /// `"rabbitmq"` or `"nats"`.
        broker: &'static str,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

impl ConsumerError {
    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    pub(crate) fn broker(broker: &'static str, source: impl Into<BoxError>) -> Self {
        ConsumerError::Broker {
            broker,
            source: source.into(),
        }
    }
}

/// A message as the consumer sees it, whatever the broker carried it: its id, headers and body.
/// The broker loops build it; another broker's loop builds it with [`Message::new`] and the
/// setters, and hands it to [`Consumer::handle`].
#[derive(Debug, Clone, Default)]
pub struct Message {
    message_id: Option<String>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    redelivered: bool,
}

impl Message {
    /// A message with this body, no id and no headers.
    pub fn new(body: impl Into<Vec<u8>>) -> Self {
        Self {
            body: body.into(),
            ..Self::default()
        }
    }

    /// Sets the broker's message id ([`KeySource::MessageId`]).
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Marks the message as delivered before (the broker says so).
    pub fn redelivered(mut self, redelivered: bool) -> Self {
        self.redelivered = redelivered;
        self
    }

    /// The broker's message id.
    pub fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    /// The first header named `name` (compared as the broker stores names: exactly).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The headers, in the order the broker gave them.
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> {
        self.headers.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The body read as JSON into `T`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }

    /// Whether the broker says it delivered the message before (informative only: the key
    /// decides).
    pub fn is_redelivered(&self) -> bool {
        self.redelivered
    }
}

/// Why a delivery is left for the broker to deliver again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Redeliver {
    /// Another delivery of the key is being handled now (the executor's
    /// [`Error::InFlight`]).
    InFlight,
    /// A run's outcome is unknown (the handler said `Unknown`, or a run crashed and its lease
    /// ran out): the key stays `processing` until the sweeper (or a takeover) settles it
    /// ([`Error::OutcomeUnknown`]).
    OutcomeUnknown,
    /// The handler failed (an `Err`, `Retryable`, a panic): the key is `failed{retryable}` and
    /// the next delivery runs the handler again ([`Error::FailedRetryable`]).
    Failed,
    /// The store failed, or this run's lease was taken over before it finished; nothing this
    /// delivery did is known to be recorded. Also a refused message that could not be
    /// dead-lettered.
    Error,
}

/// What to do with a delivery once [`Consumer::handle`] is done with it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Disposition {
    /// Acknowledge it: the key is settled (`done`, or `failed{permanent}`), and no delivery of
    /// it runs the handler again.
    Ack {
        /// Whether this delivery ran the handler (`false`: the key was settled before, and its
        /// answer was replayed).
        ran: bool,
    },
    /// Do not acknowledge it: the broker delivers it again, no sooner than `after`.
    Redeliver {
        /// The least delay before the next delivery.
        after: Duration,
        /// Why.
        reason: Redeliver,
    },
    /// Refuse it for good (dead-letter it): nothing was recorded, and no delivery of it could
    /// do better.
    Reject(ConsumerError),
}

/// How many deliveries a [`Consumer`] disposed of, and how ([`Consumer::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Acknowledged after running the handler.
    pub ran: u64,
    /// Acknowledged without running it: the key was settled before (a duplicate).
    pub replayed: u64,
    /// Left for redelivery because another delivery of the key was being handled.
    pub in_flight: u64,
    /// Left for redelivery because a run's outcome is unknown.
    pub unknown: u64,
    /// Left for redelivery because the handler failed.
    pub failed: u64,
    /// Left for redelivery because the store failed or the lease was lost.
    pub errors: u64,
    /// Refused for good.
    pub rejected: u64,
    /// Refused messages a broker loop put on the dead-letter target.
    pub dead_lettered: u64,
    /// Refused messages a broker loop dropped ([`Consumer::drop_refused`]).
    pub dropped: u64,
}

impl ConsumerStats {
    fn count(&mut self, d: &Disposition) {
        let counter = match d {
            Disposition::Ack { ran: true } => &mut self.ran,
            Disposition::Ack { ran: false } => &mut self.replayed,
            Disposition::Redeliver { reason, .. } => match reason {
                Redeliver::InFlight => &mut self.in_flight,
                Redeliver::OutcomeUnknown => &mut self.unknown,
                Redeliver::Failed => &mut self.failed,
                Redeliver::Error => &mut self.errors,
            },
            Disposition::Reject(_) => &mut self.rejected,
        };
        *counter += 1;
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type HandlerFn = Arc<dyn Fn(Message, Context) -> BoxFuture<Outcome> + Send + Sync>;
type RequestFn = Arc<dyn Fn(&Message) -> Result<Value, BoxError> + Send + Sync>;

/// What runs under a message's key.
#[derive(Clone)]
enum Run {
    /// The application's handler ([`Consumer::new`]).
    Handler(HandlerFn),
    /// The provider's request built from the message, sent through the consumer's provider
    /// ([`Consumer::sending`]).
    Send(RequestFn),
}

/// What a broker loop does with a refused message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refusals {
    /// Nothing said: the loop refuses to start.
    Unset,
    /// Put it on this target (RabbitMQ: an exchange; NATS: a subject).
    DeadLetter(String),
    /// Drop it, logged at `ERROR` and counted.
    Drop,
}

/// A queue consumer: runs its handler once per message key, in its scope, and says when a
/// delivery may be acknowledged. Cheap to clone (one consumer serves every delivery). See the
/// [module](self) for an example.
#[derive(Clone)]
pub struct Consumer {
    inner: Arc<Inner>,
    stats: Arc<Mutex<ConsumerStats>>,
}

#[derive(Clone)]
struct Inner {
    /// The executor the runs go through: `given`, with an unbounded takeover window
    /// (`LOCAL_EFFECT_TAKEOVER`) until a provider is named.
    idem: Idempotency,
    /// The executor as given (storing no request for a handler: [`Consumer::new`]).
    given: Idempotency,
    scope: Scope,
    key: KeySource,
    fingerprint: FingerprintSource,
    /// The provider the handler acts through, or the consumer sends through.
    provider: Option<Arc<dyn Provider>>,
    run: Run,
    refusals: Refusals,
    /// How often the in-process sweeper sweeps (`None`: it does not run).
    sweep_every: Option<Duration>,
    concurrency: usize,
    retry_after: Duration,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.inner;
        f.debug_struct("Consumer")
            .field("scope", &r.scope)
            .field("key", &r.key)
            .field("fingerprint", &r.fingerprint)
            .field(
                "provider",
                &r.provider.as_ref().map(|p| p.name().to_owned()),
            )
            .field("sends", &matches!(r.run, Run::Send(_)))
            .field("refusals", &r.refusals)
            .field("sweep_every", &r.sweep_every)
            .field("concurrency", &r.concurrency)
            .field("retry_after", &r.retry_after)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A consumer whose `handler` acts on each message once per key in `scope` (give each
    /// queue, or each consumer of a shared queue, its own scope). The key is the message id
    /// unless [`key`](Self::key) says otherwise.
    ///
    /// The handler's `Succeeded` or `Rejected` is recorded before the delivery is acknowledged;
    /// `Retryable`, or a panic, leaves the key retryable and the message for redelivery;
    /// `Unknown` leaves the key `processing` (see the module's table). The handler runs more
    /// than once for a key only after a run that failed, crashed or ended `Unknown`: its effect
    /// must be all or nothing, or keyed by the message's key (`docs/consumers.md`).
    ///
    /// `idem` is used with its store, lease and retention; until [`provider`](Self::provider)
    /// names a provider, a later delivery takes a crashed run over once its lease has run out,
    /// however old the key (the handler's effect is the application's own), as the webhook
    /// receiver does. The keys store no request ([`Idempotency::store_request`] off): what the
    /// handler sends is its own, so the sweeper looks a crashed run up by its provider key
    /// rather than re-sending anything. A handler that sends one request to a provider is
    /// better written with [`sending`](Self::sending), whose keys store that request.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use idemflow::consumer::{Consumer, Disposition, Message};
    /// use idemflow::{Context, Idempotency, Outcome, Store, StoredResponse, key::Scope};
    /// use idemflow::store::sqlite::SqliteStore;
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let idem = Idempotency::new(Arc::new(store));
    /// let consumer = Consumer::new(idem, Scope::new("receipts")?, |message: Message, _: Context| async move {
    ///     // Send the receipt for `message.body()` here.
    ///     Outcome::Succeeded(StoredResponse::new(200))
    /// });
    /// let delivery = Message::new(r#"{"order": 42}"#).with_message_id("order-42");
    /// assert!(matches!(consumer.handle(delivery.clone()).await, Disposition::Ack { .. }));
    /// // A redelivery of the same message is acknowledged without running the handler again.
    /// assert!(matches!(consumer.handle(delivery.redelivered(true)).await, Disposition::Ack { .. }));
    /// # Ok(()) }
    /// ```
    pub fn new<F, Fut>(idem: Idempotency, scope: Scope, handler: F) -> Self
    where
        F: Fn(Message, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let handler: HandlerFn = Arc::new(move |message, ctx| Box::pin(handler(message, ctx)));
        Self::with_run(idem.store_request(false), scope, Run::Handler(handler))
    }

    /// A consumer that sends one request to `provider` per message key, under the key's
    /// provider key, as [`Idempotency::call`] does: `request` builds it from the message (an
    /// `Err` refuses the message for good, [`ConsumerError::Unsendable`]). The key stores that
    /// request, so the sweeper settles a run that crashed or ended `Unknown` by re-sending it
    /// inside the provider's dedup window (the provider replays its first answer) and by
    /// looking it up outside it. The in-process sweeper ([`sweeper`](Self::sweeper)) runs in
    /// the broker loops.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idemflow::{Idempotency, Provider, key::Scope};
    /// use idemflow::consumer::{Consumer, FingerprintSource, KeySource, Message};
    /// use serde_json::{Value, json};
    ///
    /// # fn example(idem: Idempotency, resend: Arc<dyn Provider>) -> Result<(), Box<dyn std::error::Error>> {
    /// let consumer = Consumer::sending(idem, Scope::new("queue:receipts")?, resend, |message: &Message| {
    ///     let receipt: Value = message.json()?;
    ///     let to = receipt["email"].as_str().ok_or("no email")?;
    ///     Ok(json!({"from": "shop@example.com", "to": to, "subject": "Your receipt"}))
    /// })
    /// .key(KeySource::JsonField("order_id".into()))
    /// .fingerprint(FingerprintSource::JsonPointers(vec!["/order_id".into(), "/email".into()]))
    /// .dead_letter("receipts.dead");
    /// # Ok(())
    /// # }
    /// ```
    pub fn sending<F>(
        idem: Idempotency,
        scope: Scope,
        provider: Arc<dyn Provider>,
        request: F,
    ) -> Self
    where
        F: Fn(&Message) -> Result<Value, BoxError> + Send + Sync + 'static,
    {
        Self::with_run(idem, scope, Run::Send(Arc::new(request))).provider(provider)
    }

    fn with_run(idem: Idempotency, scope: Scope, run: Run) -> Self {
        Self {
            inner: Arc::new(Inner {
                idem: idem
                    .clone()
                    .retry_takeover_window(Some(crate::executor::LOCAL_EFFECT_TAKEOVER)),
                given: idem,
                scope,
                key: KeySource::MessageId,
                fingerprint: FingerprintSource::Body,
                provider: None,
                run,
                refusals: Refusals::Unset,
                sweep_every: Some(DEFAULT_SWEEP_EVERY),
                concurrency: DEFAULT_CONCURRENCY,
                retry_after: DEFAULT_RETRY_AFTER,
            }),
            stats: Arc::default(),
        }
    }

    setters! { shared inner;
        /// Where each message's key is read from (default [`KeySource::MessageId`]).
        key(key: KeySource);

        /// What each message's fingerprint covers (default [`FingerprintSource::Body`]).
        fingerprint(fingerprint: FingerprintSource);
    }

    /// Declares the provider the handler acts through (forwarding [`Context::provider_key`] as
    /// its idempotency key), so that the sweeper, with that provider registered, settles a run
    /// that crashed or ended `Unknown` by asking it; the broker loops run such a sweeper
    /// ([`sweeper`](Self::sweeper)). A delivery then never takes such a run over beyond the
    /// executor's own `retry_takeover_window`, itself capped by the provider's dedup window
    /// (none for a provider that does not dedupe by key), as with [`Idempotency::call`]: it is
    /// redelivered until the sweeper has settled the key. The provider key is derived within
    /// the provider's length limit.
    pub fn provider(mut self, provider: Arc<dyn Provider>) -> Self {
        let c = Arc::make_mut(&mut self.inner);
        c.provider = Some(provider);
        c.idem = c.given.clone();
        self
    }

    /// Where a broker loop puts a refused message ([`Disposition::Reject`]): a RabbitMQ
    /// exchange (typically the queue's own dead-letter exchange), or a NATS subject a stream
    /// captures. The loop publishes the message there, with its headers and the refusal's
    /// reason in [`REFUSED_HEADER`], and only then acknowledges it; it checks at start that
    /// the target exists. Without this, or [`drop_refused`](Self::drop_refused), a broker loop
    /// does not start.
    pub fn dead_letter(mut self, target: impl Into<String>) -> Self {
        let target = target.into();
        Arc::make_mut(&mut self.inner).refusals = Refusals::DeadLetter(target);
        self
    }

    /// Lets a broker loop drop refused messages (RabbitMQ: `basic.reject` without requeue,
    /// which the queue's own dead-letter exchange, if it has one, still receives; NATS: `Term`).
    /// Each one is logged at `ERROR` and counted ([`ConsumerStats::dropped`], metric
    /// `idemflow_consumer_refused_total{outcome="dropped"}`).
    pub fn drop_refused(mut self) -> Self {
        Arc::make_mut(&mut self.inner).refusals = Refusals::Drop;
        self
    }

    /// How often the in-process sweeper looks for stale keys (default
    /// [`DEFAULT_SWEEP_EVERY`]).
    pub fn sweep_every(mut self, every: Duration) -> Self {
        Arc::make_mut(&mut self.inner).sweep_every = Some(every);
        self
    }

    /// Runs no sweeper in the worker: the keys of runs that crashed or ended `Unknown` wait
    /// for `idemflow reconcile` (or another process's sweeper) to settle them.
    pub fn without_sweeper(mut self) -> Self {
        Arc::make_mut(&mut self.inner).sweep_every = None;
        self
    }

    /// How many messages a broker loop handles at once (default [`DEFAULT_CONCURRENCY`]): the
    /// AMQP prefetch count, the NATS batch size. At least 1, at most [`MAX_CONCURRENCY`].
    pub fn concurrency(mut self, n: usize) -> Self {
        Arc::make_mut(&mut self.inner).concurrency = n.clamp(1, MAX_CONCURRENCY);
        self
    }

    setters! { shared inner;
        /// The delay before a delivery whose handler failed, or whose store failed, is delivered
        /// again (default [`DEFAULT_RETRY_AFTER`]).
        retry_after(retry_after: Duration);
    }

    /// The scope of the messages' keys.
    pub fn scope(&self) -> &str {
        self.inner.scope.as_str()
    }

    /// The deliveries disposed of so far, by disposition.
    pub fn stats(&self) -> ConsumerStats {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The in-process sweeper and its interval: over the consumer's store and scope (the keys
    /// of other scopes in a shared store are left alone), asking the consumer's provider, with
    /// the same leases and rules as `idemflow reconcile`, so many workers (and the cron job)
    /// sweep together safely. `None` without a provider, or after
    /// [`without_sweeper`](Self::without_sweeper). The broker loops run it until they stop;
    /// another broker's loop runs it with [`Sweeper::run`].
    pub fn sweeper(&self) -> Option<(Sweeper, Duration)> {
        let r = &self.inner;
        let (provider, every) = (r.provider.clone()?, r.sweep_every?);
        let sweeper = Sweeper::new(r.given.store().clone(), Providers::new().with(provider))
            .scope(&r.scope)
            .owner(format!("consumer-sweeper-{}", std::process::id()));
        Some((sweeper, every))
    }

    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    pub(crate) fn concurrency_limit(&self) -> usize {
        self.inner.concurrency
    }

    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    pub(crate) fn retry_delay(&self) -> Duration {
        self.inner.retry_after
    }

    /// Where a broker loop puts refused messages: `Some(target)`, `None` to drop them, or the
    /// error that keeps the loop from starting (`how`: the broker's advice).
    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    pub(crate) fn refusal_target(
        &self,
        broker: &'static str,
        how: &'static str,
    ) -> Result<Option<&str>, ConsumerError> {
        match &self.inner.refusals {
            Refusals::DeadLetter(target) => Ok(Some(target)),
            Refusals::Drop => Ok(None),
            Refusals::Unset => Err(ConsumerError::NoDeadLetter {
                broker,
                problem: "no dead-letter target is named".to_owned(),
                how,
            }),
        }
    }

    /// Counts a refused message the loop dead-lettered (`true`) or dropped (`false`), and logs
    /// a drop at `ERROR`.
    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    pub(crate) fn refused(&self, dead_lettered: bool, error: &ConsumerError) {
        {
            let mut stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
            if dead_lettered {
                stats.dead_lettered += 1;
            } else {
                stats.dropped += 1;
            }
        }
        if dead_lettered {
            crate::telemetry::consumer_refused("dead_lettered");
            tracing::info!(scope = %self.inner.scope, %error, "refused message dead-lettered");
        } else {
            crate::telemetry::consumer_refused("dropped");
            tracing::error!(scope = %self.inner.scope, %error, "refused message dropped (drop_refused)");
        }
    }

    /// Counts and logs a refused message that could not be dead-lettered (it is left for
    /// redelivery).
    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    pub(crate) fn dead_letter_failed(&self, target: &str, error: &dyn fmt::Display) {
        crate::telemetry::consumer_refused("dead_letter_failed");
        tracing::error!(
            scope = %self.inner.scope,
            target,
            %error,
            "dead-lettering a refused message failed; it is left for redelivery"
        );
    }

    /// Handles one delivery: reads its key, runs the handler under it (unless the key is
    /// settled or in flight), and says what to do with the delivery. Never panics; the run goes
    /// on in a task of its own, so dropping this future does not cut it between the handler's
    /// effect and the key's finish.
    pub async fn handle(&self, message: Message) -> Disposition {
        let span = info_span!(
            "idemflow.consume",
            scope = %self.inner.scope,
            key = tracing::field::Empty,
            redelivered = message.is_redelivered(),
            disposition = tracing::field::Empty,
        );
        let disposition = self.dispose(message).instrument(span.clone()).await;
        let _in = span.enter();
        match &disposition {
            Disposition::Ack { ran } => {
                span.record("disposition", if *ran { "ack" } else { "ack_replayed" });
            }
            Disposition::Redeliver { after, reason } => {
                span.record("disposition", "redeliver");
                tracing::info!(?reason, ?after, "message left for redelivery");
            }
            Disposition::Reject(error) => {
                span.record("disposition", "reject");
                tracing::warn!(%error, "message refused");
            }
        }
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .count(&disposition);
        disposition
    }

    /// The request run under `message`'s key `key`: its stored body (the provider's request
    /// when the consumer sends one; the key and its identity otherwise) and its fingerprint (of
    /// the key and the message's identity).
    fn request(&self, message: &Message, key: &str) -> Result<IdempotentRequest, ConsumerError> {
        let r = &self.inner;
        let identity = json!({"key": key, "message": identity(message, &r.fingerprint)?});
        let fingerprint = Fingerprint::compute(OPERATION, &canonical_json(&identity));
        let stored = match &r.run {
            Run::Handler(_) => identity,
            Run::Send(build) => {
                build(message).map_err(|source| ConsumerError::Unsendable { source })?
            }
        };
        let id = crate::KeyId::new(
            r.scope.clone(),
            crate::key::IdempotencyKey::new(key)
                .map_err(|e| ConsumerError::InvalidKey(RequestError::InvalidKey(e)))?,
        );
        crate::key::check_client_key(&id.key)
            .map_err(|e| ConsumerError::InvalidKey(RequestError::InvalidKey(e)))?;
        let request = IdempotentRequest::with_fingerprint(
            id,
            OPERATION.to_owned(),
            canonical_json(&stored),
            fingerprint,
        )
        .map_err(ConsumerError::InvalidKey)?;
        Ok(match &r.provider {
            Some(provider) => request.sent_through(provider.name(), &provider.key_spec()),
            None => request,
        })
    }

    async fn dispose(&self, message: Message) -> Disposition {
        let r = &self.inner;
        let key = match key_of(&message, &r.key) {
            Ok(key) => key,
            Err(e) => return Disposition::Reject(e),
        };
        tracing::Span::current().record("key", key.as_str());
        let request = match self.request(&message, &key) {
            Ok(request) => request,
            Err(e) => return Disposition::Reject(e),
        };
        let this = self.clone();
        let run = tokio::spawn(
            async move {
                let r = &this.inner;
                match (&r.run, &r.provider) {
                    (Run::Send(_), Some(provider)) => r.idem.call(request, provider.as_ref()).await,
                    _ => {
                        r.idem
                            .execute(request, |ctx| this.run_handler(message, ctx))
                            .await
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        match run.await {
            Ok(result) => disposition(key, result, r.retry_after),
            Err(crashed) => {
                tracing::error!(error = %crashed, "the consumer's run crashed");
                Disposition::Redeliver {
                    after: r.retry_after,
                    reason: Redeliver::Error,
                }
            }
        }
    }

    /// The operation run under the message's key: the handler, in a task of its own so that a
    /// panic is caught as a failure.
    async fn run_handler(&self, message: Message, ctx: Context) -> Outcome {
        let Run::Handler(handler) = &self.inner.run else {
            return Outcome::retryable("a sending consumer has no handler");
        };
        match tokio::spawn(handler(message, ctx)).await {
            Ok(outcome) => outcome,
            Err(e) if e.is_panic() => {
                let panic = e.into_panic();
                let text = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned());
                Outcome::retryable(format!(
                    "the handler panicked: {}",
                    text.as_deref().unwrap_or("a panic without a message")
                ))
            }
            Err(e) => Outcome::retryable(format!("the handler did not finish: {e}")),
        }
    }
}

/// Runs `consumer`'s in-process sweeper ([`Consumer::sweeper`]) in a task until `stopping`
/// says so (or its sender is gone); `None` when it has none.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) fn spawn_sweeper(
    consumer: &Consumer,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let (sweeper, every) = consumer.sweeper()?;
    Some(tokio::spawn(async move {
        let stop = async move {
            let _ = stopping.wait_for(|stop| *stop).await;
        };
        sweeper.run(every, stop).await;
    }))
}

/// The value at `place` of `body`: a JSON pointer, or the name of a top-level member.
fn at<'v>(body: &'v Value, place: &str) -> Option<&'v Value> {
    if place.is_empty() || place.starts_with('/') {
        body.pointer(place)
    } else {
        body.get(place)
    }
}

/// What `message`'s fingerprint covers, as JSON: its body's digest, or the values at the named
/// places (absent ones left out).
fn identity(message: &Message, from: &FingerprintSource) -> Result<Value, ConsumerError> {
    match from {
        // The digest, not the body: a body of any size fits the request cap.
        FingerprintSource::Body => Ok(json!({
            "body_sha256": crate::fingerprint::hex(&Sha256::digest(message.body()))
        })),
        FingerprintSource::JsonPointers(places) => {
            let body =
                parse_json(message.body()).map_err(|e| ConsumerError::FingerprintUnreadable {
                    from: from.clone(),
                    reason: format!("the body is not JSON: {e}"),
                })?;
            let parts: Map<String, Value> = places
                .iter()
                .filter_map(|p| at(&body, p).map(|v| (p.clone(), v.clone())))
                .collect();
            Ok(Value::Object(parts))
        }
    }
}

/// Reads `message`'s key from `from`.
fn key_of(message: &Message, from: &KeySource) -> Result<String, ConsumerError> {
    let missing = || ConsumerError::NoKey { from: from.clone() };
    match from {
        KeySource::MessageId => message.message_id().map(str::to_owned).ok_or_else(missing),
        KeySource::Header(name) => message.header(name).map(str::to_owned).ok_or_else(missing),
        KeySource::JsonField(field) => {
            let unreadable = |reason: String| ConsumerError::KeyUnreadable {
                from: from.clone(),
                reason,
            };
            let body: Value = serde_json::from_slice(message.body())
                .map_err(|e| unreadable(format!("the body is not JSON: {e}")))?;
            match at(&body, field) {
                None | Some(Value::Null) => Err(missing()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
                Some(other) => Err(unreadable(format!(
                    "a key is a string or an integer, not {other}"
                ))),
            }
        }
    }
}

/// What the executor's answer for a delivery's key means for the delivery (`key`: for the
/// refusal's error; `retry_after`: [`Consumer::retry_after`]).
fn disposition(
    key: String,
    result: Result<Execution, Error>,
    retry_after: Duration,
) -> Disposition {
    let redeliver = |after, reason| Disposition::Redeliver { after, reason };
    match result {
        Ok(Execution::Executed(_)) => Disposition::Ack { ran: true },
        Ok(Execution::Replayed(_)) => Disposition::Ack { ran: false },
        // The handler ran, and its answer was over the cap: the key is `failed{permanent}`.
        Err(Error::ResponseTooLarge { .. }) => Disposition::Ack { ran: true },
        // Settled without an answer to replay (an operator's decision): settled all the same.
        Err(Error::NoStoredResponse { .. }) => Disposition::Ack { ran: false },
        Err(Error::InFlight { retry_after, .. }) => redeliver(retry_after, Redeliver::InFlight),
        Err(Error::OutcomeUnknown { retry_after, .. }) => {
            redeliver(retry_after, Redeliver::OutcomeUnknown)
        }
        Err(Error::FailedRetryable { .. }) => redeliver(retry_after, Redeliver::Failed),
        Err(e @ Error::FingerprintMismatch { .. }) => {
            Disposition::Reject(ConsumerError::KeyReused {
                key,
                source: Box::new(e),
            })
        }
        Err(Error::Request(e)) => Disposition::Reject(ConsumerError::InvalidKey(e)),
        // The store failed, the lease was taken over, or the key's unsettled attempt went
        // through another provider (the sweeper settles it): nothing to ack yet.
        Err(_) => redeliver(retry_after, Redeliver::Error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KeyId, StoredResponse};

    fn id() -> KeyId {
        IdempotentRequest::new("queue:t", "m-1", OPERATION, &1)
            .unwrap()
            .id()
            .clone()
    }

    #[test]
    fn every_answer_of_the_executor_disposes_as_the_table_says() {
        let second = Duration::from_secs(1);
        let d = |result| disposition("m-1".to_owned(), result, second);
        let ok = StoredResponse::new(200);
        assert!(matches!(
            d(Ok(Execution::Executed(ok.clone()))),
            Disposition::Ack { ran: true }
        ));
        assert!(matches!(
            d(Ok(Execution::Replayed(ok))),
            Disposition::Ack { ran: false }
        ));
        assert!(matches!(
            d(Err(Error::ResponseTooLarge { size: 2, limit: 1 })),
            Disposition::Ack { ran: true }
        ));
        // Each error left for redelivery, with the wait and the reason it is redelivered with.
        let redelivered = [
            (
                Error::InFlight {
                    key: id(),
                    retry_after: Duration::from_millis(300),
                },
                Duration::from_millis(300),
                Redeliver::InFlight,
            ),
            (
                Error::OutcomeUnknown {
                    key: id(),
                    reason: "timeout".to_owned(),
                    retry_after: Duration::from_secs(5),
                },
                Duration::from_secs(5),
                Redeliver::OutcomeUnknown,
            ),
            (
                Error::FailedRetryable {
                    key: id(),
                    reason: "boom".to_owned(),
                },
                second,
                Redeliver::Failed,
            ),
        ];
        for (error, wait, why) in redelivered {
            match d(Err(error)) {
                Disposition::Redeliver { after, reason } => {
                    assert_eq!((after, reason), (wait, why))
                }
                other => panic!("{why:?} is redelivered, not {other:?}"),
            }
        }
        let reused = Error::FingerprintMismatch {
            key: id(),
            stored: "a".to_owned(),
            presented: "b".to_owned(),
        };
        assert!(matches!(
            d(Err(reused)),
            Disposition::Reject(ConsumerError::KeyReused { .. })
        ));
        let store = Error::Store(crate::StoreError::Config("down".to_owned()));
        assert!(matches!(
            d(Err(store)),
            Disposition::Redeliver {
                reason: Redeliver::Error,
                ..
            }
        ));
    }

    #[test]
    fn keys_are_read_from_the_id_a_header_or_a_json_field() {
        let m = Message::new(r#"{"event_id":"evt_1","n":{"id":42},"f":1.5,"o":{}}"#)
            .with_message_id("m-1")
            .with_header("Event-Id", "h-1");
        let read = |from: KeySource| key_of(&m, &from);
        assert_eq!(read(KeySource::MessageId).unwrap(), "m-1");
        assert_eq!(read(KeySource::Header("Event-Id".into())).unwrap(), "h-1");
        assert_eq!(
            read(KeySource::JsonField("event_id".into())).unwrap(),
            "evt_1"
        );
        assert_eq!(read(KeySource::JsonField("/n/id".into())).unwrap(), "42");
        assert!(matches!(
            read(KeySource::Header("Other".into())),
            Err(ConsumerError::NoKey { .. })
        ));
        assert!(matches!(
            read(KeySource::JsonField("missing".into())),
            Err(ConsumerError::NoKey { .. })
        ));
        for bad in ["f", "o"] {
            assert!(matches!(
                read(KeySource::JsonField(bad.into())),
                Err(ConsumerError::KeyUnreadable { .. })
            ));
        }
        let not_json = Message::new("nope");
        assert!(matches!(
            key_of(&not_json, &KeySource::JsonField("id".into())),
            Err(ConsumerError::KeyUnreadable { .. })
        ));
        assert!(matches!(
            key_of(&Message::new("{}"), &KeySource::MessageId),
            Err(ConsumerError::NoKey { .. })
        ));
    }

    /// A test provider: its name and key rules, its answer to the `n`th send (from 0), and
    /// whether its lookup's "not found" is authoritative. It records every request it is sent.
    #[cfg(feature = "sqlite")]
    #[derive(Debug)]
    struct Scripted {
        name: &'static str,
        spec: crate::provider::KeySpec,
        reply: fn(usize) -> crate::provider::CallReply,
        lookup_authoritative: bool,
        sent: std::sync::Mutex<Vec<Value>>,
    }

    #[cfg(feature = "sqlite")]
    impl Scripted {
        fn new(
            name: &'static str,
            spec: crate::provider::KeySpec,
            reply: fn(usize) -> crate::provider::CallReply,
        ) -> Self {
            Self {
                name,
                spec,
                reply,
                lookup_authoritative: false,
                sent: std::sync::Mutex::default(),
            }
        }

        /// Dedupes by key for `window`.
        fn dedupes(window: Duration) -> crate::provider::KeySpec {
            crate::provider::KeySpec {
                max_len: 255,
                retention: Some(window),
                replays_same_key: true,
            }
        }

        fn sent(&self) -> Vec<Value> {
            self.sent.lock().unwrap().clone()
        }
    }

    #[cfg(feature = "sqlite")]
    #[async_trait::async_trait]
    impl crate::Provider for Scripted {
        fn name(&self) -> &str {
            self.name
        }

        fn key_spec(&self) -> crate::provider::KeySpec {
            self.spec.clone()
        }

        async fn send(&self, _provider_key: &str, request: &Value) -> crate::provider::CallReply {
            let n = {
                let mut sent = self.sent.lock().unwrap();
                sent.push(request.clone());
                sent.len() - 1
            };
            (self.reply)(n)
        }

        async fn lookup(
            &self,
            _provider_key: &str,
            _request: &Value,
            _attempts: crate::provider::Attempts,
            _now: chrono::DateTime<chrono::Utc>,
        ) -> crate::provider::Lookup {
            crate::provider::Lookup::NotFound {
                authoritative: self.lookup_authoritative,
            }
        }
    }

    /// A handler that counts its runs in `runs` and answers the `n`th (from 0) with `answer(n)`.
    #[cfg(feature = "sqlite")]
    fn counted(
        runs: Arc<std::sync::atomic::AtomicUsize>,
        answer: fn(usize) -> Outcome,
    ) -> impl Fn(Message, Context) -> std::future::Ready<Outcome> + Send + Sync + 'static {
        move |_message, _ctx| {
            std::future::ready(answer(
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
            ))
        }
    }

    /// Whether the delivery was left for redelivery with its outcome unknown.
    #[cfg(feature = "sqlite")]
    fn left_unknown(d: &Disposition) -> bool {
        matches!(
            d,
            Disposition::Redeliver {
                reason: Redeliver::OutcomeUnknown,
                ..
            }
        )
    }

    /// A migrated in-memory SQLite store.
    #[cfg(feature = "sqlite")]
    async fn memory_store() -> Arc<dyn crate::Store> {
        let store = crate::store::sqlite::SqliteStore::connect("sqlite::memory:")
            .await
            .unwrap();
        crate::Store::migrate(&store).await.unwrap();
        Arc::new(store)
    }

    /// An executor on a [`memory_store`] with a 200 ms lease, whose retries may take over an
    /// expired lease within `window`.
    #[cfg(feature = "sqlite")]
    async fn short_lease(window: Duration) -> Idempotency {
        Idempotency::new(memory_store().await)
            .lease(Duration::from_millis(200))
            .retry_takeover_window(Some(window))
    }

    /// Handles `message` once (its outcome left unknown), then again once the 200 ms lease has
    /// run out, as the broker redelivers it; the redelivery's disposition.
    #[cfg(feature = "sqlite")]
    async fn redelivered(consumer: &Consumer, message: impl Fn() -> Message) -> Disposition {
        let first = consumer.handle(message()).await;
        assert!(left_unknown(&first), "{first:?}");
        tokio::time::sleep(Duration::from_millis(600)).await;
        consumer.handle(message()).await
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_redelivery_never_takes_over_a_run_whose_provider_does_not_dedupe() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        // An executor that lets a retry take over an expired lease within an hour (set for
        // another provider, say): the consumer's provider does not dedupe, so its rules cap
        // that at none, as `Idempotency::call` does.
        let idem = short_lease(Duration::from_secs(3600)).await;
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = counted(runs.clone(), |_| {
            Outcome::unknown("the email went out; its answer was lost")
        });
        // A provider without idempotency keys (every send acts), which the sweeper cannot
        // settle.
        let keyless = Scripted::new("keyless", crate::provider::KeySpec::no_keys(), |_| {
            crate::provider::CallReply::Unknown {
                reason: "unused".to_owned(),
            }
        });
        let consumer = Consumer::new(idem, Scope::new("queue:mail").unwrap(), handler)
            .provider(Arc::new(keyless));
        let again = redelivered(&consumer, || Message::new("{}").with_message_id("m-1")).await;
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "a redelivery ran the handler again, which sends again: {again:?}"
        );
        assert!(matches!(again, Disposition::Redeliver { .. }), "{again:?}");
    }

    /// `Context::send` in a handler: after a takeover, a refusal that does not say what the
    /// first send did leaves the key to the sweeper; the message is not acknowledged as refused
    /// while the first send charged.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_refused_resend_after_a_takeover_is_not_the_messages_answer() {
        let idem = short_lease(Duration::from_secs(600)).await;
        // It dedupes by key for an hour: the first send acts and its answer is lost; a re-send
        // of the same key is refused without saying anything of the first (a fraud rule
        // declining what looks like a duplicate charge).
        let provider = Arc::new(Scripted::new(
            "refuses-resends",
            Scripted::dedupes(Duration::from_secs(3600)),
            |n| match n {
                0 => crate::provider::CallReply::Unknown {
                    reason: "charged; the answer was lost".to_owned(),
                },
                _ => crate::provider::CallReply::Rejected {
                    response: StoredResponse::new(402).with_body("declined: duplicate"),
                },
            },
        ));
        let handler = {
            let provider = provider.clone();
            move |message: Message, ctx: Context| {
                let provider = provider.clone();
                async move {
                    let body: Value = serde_json::from_slice(message.body()).unwrap_or_default();
                    ctx.send(provider.as_ref(), &body).await
                }
            }
        };
        let consumer = Consumer::new(idem.clone(), Scope::new("queue:pay").unwrap(), handler)
            .provider(provider.clone());
        // The redelivery takes the key over inside the provider's window and sends again,
        // which the provider refuses.
        let message = || Message::new(r#"{"amount": 5}"#).with_message_id("m-1");
        let again = redelivered(&consumer, message).await;
        assert_eq!(
            provider.sent().len(),
            2,
            "the redelivery did not re-send: {again:?}"
        );
        assert!(
            left_unknown(&again),
            "the re-send's refusal became the message's answer: {again:?}"
        );
        let key = IdempotentRequest::new("queue:pay", "m-1", OPERATION, &1)
            .unwrap()
            .id()
            .clone();
        let record = idem.store().get(&key).await.unwrap().unwrap();
        assert_eq!(record.state, crate::KeyState::Processing, "{record:?}");
    }

    /// The sweeper never re-sends a consumer's stored request to its provider: what the
    /// consumer stores is the message's key and digest, not what the handler sends. A run that
    /// ended before sending is looked up instead, and the next delivery sends the handler's own
    /// request. (Found by the simulation's queue deliveries: the re-drive acted on the digest.)
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn the_sweeper_never_sends_a_consumers_stored_request() {
        let store = memory_store().await;
        let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(200));
        // It dedupes by key for a day (as Stripe does), so the sweeper would re-drive a stored
        // request; its lookup finds nothing, for sure.
        let provider = Arc::new(Scripted {
            lookup_authoritative: true,
            ..Scripted::new(
                "recording",
                Scripted::dedupes(Duration::from_secs(24 * 3600)),
                |_| crate::provider::CallReply::Succeeded {
                    response: StoredResponse::new(201),
                    replayed: false,
                },
            )
        });
        let first_run = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let handler = {
            let provider = provider.clone();
            let first_run = first_run.clone();
            move |message: Message, ctx: Context| {
                let provider = provider.clone();
                let first = first_run.swap(false, std::sync::atomic::Ordering::SeqCst);
                async move {
                    if first {
                        // The process dies before the request leaves.
                        return Outcome::unknown("killed before sending");
                    }
                    let body: Value = serde_json::from_slice(message.body()).unwrap_or_default();
                    ctx.send(provider.as_ref(), &body).await
                }
            }
        };
        let consumer = Consumer::new(idem, Scope::new("queue:pay").unwrap(), handler)
            .provider(provider.clone());
        let message = || Message::new(r#"{"amount": 5}"#).with_message_id("m-1");
        let first = consumer.handle(message()).await;
        assert!(left_unknown(&first), "{first:?}");
        tokio::time::sleep(Duration::from_millis(600)).await;
        let sweeper = crate::Sweeper::new(
            store,
            crate::Providers::new().with(provider.clone() as Arc<dyn crate::Provider>),
        );
        let swept = sweeper.run_once().await.unwrap();
        assert_eq!(
            provider.sent(),
            Vec::<Value>::new(),
            "the sweeper sent the consumer's stored request ({})",
            swept.summary()
        );
        let again = consumer.handle(message()).await;
        assert!(matches!(again, Disposition::Ack { ran: true }), "{again:?}");
        assert_eq!(provider.sent(), vec![serde_json::json!({"amount": 5})]);
    }

    /// A consumer without a provider (the effect is the application's own): a run that ended
    /// unknown (or crashed) is taken over by the next delivery once its lease has run out, as
    /// `docs/consumers.md` promises, also when that delivery comes after the retention and
    /// after a sweep found nobody to ask about the key. (The takeover was bounded by the
    /// retention: the delivery was left for redelivery, as every later one, for good.)
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_redelivery_takes_over_a_run_without_a_provider_after_its_retention() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let store = memory_store().await;
        let idem = Idempotency::new(store.clone())
            .lease(Duration::from_millis(200))
            .retention(Duration::from_millis(300));
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = counted(runs.clone(), |run| match run {
            0 => Outcome::unknown("the process died before its answer"),
            _ => Outcome::Succeeded(crate::StoredResponse::new(200)),
        });
        let consumer = Consumer::new(idem, Scope::new("queue:own").unwrap(), handler);
        let message = || Message::new("{}").with_message_id("m-1");
        let first = consumer.handle(message()).await;
        assert!(left_unknown(&first), "{first:?}");
        tokio::time::sleep(Duration::from_millis(400)).await;
        // A sweep finds the key stale and nobody to ask (no provider).
        let sweeper = crate::Sweeper::new(store.clone(), crate::Providers::new());
        sweeper.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        let again = consumer.handle(message()).await;
        assert!(matches!(again, Disposition::Ack { ran: true }), "{again:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    /// A consumer fingerprinting by JSON places: a copy its publisher encoded again (members
    /// reordered, other spacing) is the same message, and so is one whose unnamed parts differ;
    /// another value at a named place is another message reusing the key, refused; a body that
    /// is not JSON cannot be fingerprinted, and is refused without a record.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_pointer_fingerprint_takes_a_re_encoded_copy_for_the_same_message() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let store = memory_store().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = counted(runs.clone(), |_| {
            Outcome::Succeeded(StoredResponse::new(200))
        });
        let consumer = Consumer::new(
            Idempotency::new(store.clone()),
            Scope::new("queue:receipts").unwrap(),
            handler,
        )
        .key(KeySource::JsonField("order_id".into()))
        .fingerprint(FingerprintSource::JsonPointers(vec![
            "/order_id".into(),
            "email".into(),
        ]));
        let handle = |body: &str| consumer.handle(Message::new(body.to_owned()));
        let first = handle(r#"{"order_id":7,"email":"a@example.com","sent_at":"09:00"}"#).await;
        assert!(matches!(first, Disposition::Ack { ran: true }), "{first:?}");
        for same in [
            r#"{ "email" : "a@example.com" , "order_id" : 7, "sent_at": "09:00" }"#,
            r#"{"order_id":7,"email":"a@example.com","sent_at":"09:05"}"#,
        ] {
            let again = handle(same).await;
            assert!(
                matches!(again, Disposition::Ack { ran: false }),
                "{same}: {again:?}"
            );
        }
        let corrected = handle(r#"{"order_id":7,"email":"b@example.com"}"#).await;
        assert!(
            matches!(
                corrected,
                Disposition::Reject(ConsumerError::KeyReused { .. })
            ),
            "{corrected:?}"
        );
        let without_email = handle(r#"{"order_id":7}"#).await;
        assert!(
            matches!(
                without_email,
                Disposition::Reject(ConsumerError::KeyReused { .. })
            ),
            "an absent place is not the value it had: {without_email:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // A key read from a header, a body that is not JSON: refused, nothing recorded.
        let by_header = consumer.clone().key(KeySource::Header("Order-Id".into()));
        let not_json = by_header
            .handle(Message::new("not json").with_header("Order-Id", "8"))
            .await;
        assert!(
            matches!(
                not_json,
                Disposition::Reject(ConsumerError::FingerprintUnreadable { .. })
            ),
            "{not_json:?}"
        );
        let key = KeyId::new(
            Scope::new("queue:receipts").unwrap(),
            crate::key::IdempotencyKey::new("8").unwrap(),
        );
        assert!(store.get(&key).await.unwrap().is_none());
    }

    /// A sending consumer stores the provider's request (built from the message), so its
    /// sweeper settles a send whose answer was lost by re-sending it inside the provider's
    /// dedup window; the redelivery is then acknowledged without sending again. A message the
    /// request cannot be built from is refused, with nothing recorded.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_sending_consumers_sweeper_re_sends_its_stored_request() {
        let store = memory_store().await;
        let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(200));
        let provider = Arc::new(Scripted::new(
            "mailer",
            Scripted::dedupes(Duration::from_secs(24 * 3600)),
            |n| match n {
                0 => crate::provider::CallReply::Unknown {
                    reason: "sent; the answer was lost".to_owned(),
                },
                _ => crate::provider::CallReply::Succeeded {
                    response: StoredResponse::new(200).with_body(r#"{"id":"email_1"}"#),
                    replayed: true,
                },
            },
        ));
        let consumer = Consumer::sending(
            idem,
            Scope::new("queue:receipts").unwrap(),
            provider.clone(),
            |message: &Message| {
                let body: Value = message.json()?;
                let to = body["email"].as_str().ok_or("no email")?;
                Ok(json!({"to": to, "subject": "Your receipt"}))
            },
        )
        .key(KeySource::JsonField("order_id".into()));
        let message = || Message::new(r#"{"order_id": 7, "email": "a@example.com"}"#);
        let first = consumer.handle(message()).await;
        assert!(left_unknown(&first), "{first:?}");
        tokio::time::sleep(Duration::from_millis(400)).await;
        let (sweeper, _) = consumer
            .sweeper()
            .expect("a sending consumer has a sweeper");
        let swept = sweeper.run_once().await.unwrap();
        let email = json!({"to": "a@example.com", "subject": "Your receipt"});
        assert_eq!(
            provider.sent(),
            vec![email.clone(), email],
            "the sweeper re-sent the stored request ({})",
            swept.summary()
        );
        let again = consumer.handle(message()).await;
        assert!(
            matches!(again, Disposition::Ack { ran: false }),
            "{again:?}"
        );
        assert_eq!(provider.sent().len(), 2);
        let unsendable = consumer.handle(Message::new(r#"{"order_id": 8}"#)).await;
        assert!(
            matches!(
                unsendable,
                Disposition::Reject(ConsumerError::Unsendable { .. })
            ),
            "{unsendable:?}"
        );
        assert!(
            consumer.clone().without_sweeper().sweeper().is_none(),
            "without_sweeper leaves none"
        );
    }
}
