//! The consumer scenarios, written once over [`Broker`]; `amqp.rs` and `nats.rs` run them.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemflow::consumer::{
    Consumer, ConsumerError, ConsumerStats, FingerprintSource, KeySource, Message,
};
use idemflow::provider::{Attempts, CallReply, KeySpec, Lookup};
use idemflow::store::sqlite::SqliteStore;
use idemflow::{
    Context, Idempotency, KeyId, KeyState, Outcome, Provider, Store, StoredResponse, key::Scope,
    record::Actor,
};
use sqlx::SqlitePool;
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::support::KillOnDrop;

/// The name of the provider whose records are the effects table ([`Ledger`]).
pub const LEDGER: &str = "ledger";
/// Where the kill test's child finds its broker, store and effects: see [`ChildSpec`].
const CHILD_SPEC: &str = "IDEMFLOW_CONSUMER_KILL";
/// A duplicate is published at least this long after its original: beyond JetStream's
/// shortest duplicate window (100 ms), which would drop it at publish.
pub const PUBLISH_GAP: Duration = Duration::from_millis(150);
/// The lease of the tests that wait one out.
const SHORT_LEASE: Duration = Duration::from_millis(1000);

/// A broker with one queue (or stream) of the test's own.
pub trait Broker: Send + Sync + Sized + 'static {
    /// Publishes `body` with the message id `id` (none when `id` is empty); `false` when the
    /// broker dropped it as a duplicate at publish (JetStream's duplicate window).
    fn publish(&self, id: &str, body: &[u8]) -> impl Future<Output = bool> + Send;
    /// Starts `consumer`'s loop on the queue, its refused messages dead-lettered to the
    /// queue's dead-letter target ([`dead_letter_target`](Self::dead_letter_target)).
    fn start(&self, consumer: Consumer) -> impl Future<Output = Running> + Send {
        self.start_as_is(consumer.dead_letter(self.dead_letter_target()))
    }
    /// Starts `consumer`'s loop on the queue as it is configured.
    fn start_as_is(&self, consumer: Consumer) -> impl Future<Output = Running> + Send;
    /// The queue's dead-letter target: a RabbitMQ exchange, a NATS subject another stream
    /// captures.
    fn dead_letter_target(&self) -> String;
    /// The messages dead-lettered so far: each one's refusal reason (its
    /// `consumer::REFUSED_HEADER`) and body.
    fn dead_letters(&self) -> impl Future<Output = Vec<(String, Vec<u8>)>> + Send;
    /// Messages on the queue not yet acknowledged (ready or delivered), once every loop has
    /// stopped.
    fn unacked(&self) -> impl Future<Output = u64> + Send;
    /// How a child process finds this queue: `<kind> <url> <name>`.
    fn spec(&self) -> String;
    /// Deletes the queue.
    fn delete(self) -> impl Future<Output = ()> + Send;
}

/// The scenarios as tests on `$broker`, whose `fresh()` gives a queue of the test's own, or
/// `None` (the test is skipped) when the broker is not configured.
macro_rules! scenario_tests {
    ($broker:ty) => {
        crate::scenarios::scenario_tests!(
            $broker,
            a_thousand_messages_with_duplicates_take_effect_once_each,
            a_duplicate_in_flight_is_redelivered_then_acked_without_running,
            an_unknown_outcome_is_left_unacked_until_the_sweeper_settles_it,
            a_consumer_killed_mid_message_leaves_one_effect,
            a_consumer_without_a_provider_killed_mid_message_keeps_one_effect,
            a_keyless_message_is_rejected_and_a_panic_redelivered,
            a_consumer_asked_for_any_concurrency_handles_its_messages,
            refused_messages_are_dead_lettered_with_their_reason,
            a_consumer_with_nowhere_for_refused_messages_does_not_start,
            drop_refused_drops_with_an_error_log_and_a_count
        );
    };
    ($broker:ty, $($scenario:ident),+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $scenario() {
                let Some(broker) = <$broker>::fresh().await else {
                    return;
                };
                $crate::scenarios::$scenario(broker).await;
            }
        )+
    };
}
pub(crate) use scenario_tests;

/// A consumer's loop, running in a task.
pub struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), ConsumerError>>,
}

impl Running {
    /// Runs `run` (a broker's `consume`, given its shutdown future) in a task.
    pub fn spawn<F, Fut>(run: F) -> Self
    where
        F: FnOnce(Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
        Fut: Future<Output = Result<(), ConsumerError>> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel();
        let shutdown: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(async move {
            let _ = stopped.await;
        });
        Self {
            stop,
            task: tokio::spawn(run(shutdown)),
        }
    }

    /// Waits for the loop to end on its own: its result.
    pub async fn ended(self) -> Result<(), ConsumerError> {
        let Running { stop, task } = self;
        let ended = task.await.unwrap();
        drop(stop);
        ended
    }

    /// Waits for the loop to end on its own (the kill test's child: never).
    async fn join(self) {
        let Running { stop, task } = self;
        task.await.unwrap().unwrap();
        drop(stop);
    }

    /// Stops the loop and waits for it; its error, if it ended with one, fails the test.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

/// The effects the handlers record, in a SQLite file both processes open: one row per run of a
/// handler that acted, with the message's key and the provider key it acted under. No unique
/// constraint: a second effect is a second row, and the tests count them.
#[derive(Clone)]
pub struct Effects(SqlitePool);

impl Effects {
    pub async fn open(path: &Path) -> Self {
        let url = format!("sqlite://{}?mode=rwc", path.display());
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .unwrap();
        for stmt in [
            "PRAGMA journal_mode = WAL",
            "PRAGMA busy_timeout = 10000",
            "CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, provider_key TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS own_effects (key TEXT PRIMARY KEY)",
        ] {
            sqlx::query(stmt).execute(&pool).await.unwrap();
        }
        Self(pool)
    }

    /// Records the effect of the run `ctx` holds.
    pub async fn record(&self, ctx: &Context) {
        sqlx::query("INSERT INTO effects (key, provider_key) VALUES (?, ?)")
            .bind(ctx.id().key.as_str())
            .bind(ctx.provider_key())
            .execute(&self.0)
            .await
            .unwrap();
    }

    /// Records the run `ctx` holds (in `effects`, one row per run) and the message's own effect
    /// keyed by its key, all or nothing in one transaction (`own_effects`: a second run finds
    /// the first one's row and adds none), as `docs/consumers.md` asks of the effect of a
    /// consumer without a provider.
    pub async fn record_keyed(&self, ctx: &Context) {
        let mut tx = self.0.begin().await.unwrap();
        sqlx::query("INSERT INTO effects (key, provider_key) VALUES (?, ?)")
            .bind(ctx.id().key.as_str())
            .bind(ctx.provider_key())
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("INSERT INTO own_effects (key) VALUES (?) ON CONFLICT (key) DO NOTHING")
            .bind(ctx.id().key.as_str())
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    /// The messages whose own effect was recorded.
    pub async fn own(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM own_effects", None).await
    }

    async fn count(&self, sql: &'static str, bind: Option<&str>) -> i64 {
        let mut q = sqlx::query_scalar(sql);
        if let Some(b) = bind {
            q = q.bind(b.to_owned());
        }
        q.fetch_one(&self.0).await.unwrap()
    }

    /// Effects of the message key `key`.
    pub async fn of(&self, key: &str) -> i64 {
        self.count("SELECT COUNT(*) FROM effects WHERE key = ?", Some(key))
            .await
    }

    /// Effects recorded under `provider_key`.
    async fn under(&self, provider_key: &str) -> i64 {
        self.count(
            "SELECT COUNT(*) FROM effects WHERE provider_key = ?",
            Some(provider_key),
        )
        .await
    }

    /// (effects, distinct keys, the most effects of one key).
    pub async fn summary(&self) -> (i64, i64, i64) {
        let all = self.count("SELECT COUNT(*) FROM effects", None).await;
        let distinct = self
            .count("SELECT COUNT(DISTINCT key) FROM effects", None)
            .await;
        let most = self
            .count(
                "SELECT COALESCE(MAX(n), 0) FROM (SELECT COUNT(*) AS n FROM effects GROUP BY key)",
                None,
            )
            .await;
        (all, distinct, most)
    }
}

/// The provider the handlers act "through": its records are the effects table, so the sweeper
/// settles a key from whether its run's effect was recorded, as it would ask a card processor
/// whether a charge was made under the key.
#[derive(Clone)]
struct Ledger(Effects);

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ledger")
    }
}

#[idemflow::async_trait]
impl Provider for Ledger {
    fn name(&self) -> &str {
        LEDGER
    }

    fn key_spec(&self) -> KeySpec {
        KeySpec::no_keys()
    }

    async fn send(&self, _provider_key: &str, _request: &serde_json::Value) -> CallReply {
        CallReply::Unknown {
            reason: "the ledger is only looked up".to_owned(),
        }
    }

    async fn lookup(
        &self,
        provider_key: &str,
        _request: &serde_json::Value,
        _attempts: Attempts,
        _now: DateTime<Utc>,
    ) -> Lookup {
        match self.0.under(provider_key).await {
            0 => Lookup::NotFound {
                authoritative: true,
            },
            _ => Lookup::Found(Outcome::Succeeded(StoredResponse::new(200))),
        }
    }
}

/// A temporary directory with the key store and the effects.
pub struct Files {
    pub dir: PathBuf,
}

impl Files {
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap().keep(),
        }
    }

    fn store_url(&self) -> String {
        format!("sqlite://{}", self.dir.join("keys.db").display())
    }

    pub async fn store(&self) -> Arc<dyn Store> {
        let store = SqliteStore::connect(&self.store_url()).await.unwrap();
        store.migrate().await.unwrap();
        Arc::new(store)
    }

    pub async fn effects(&self) -> Effects {
        Effects::open(&self.dir.join("effects.db")).await
    }
}

/// The scope of a test's keys.
fn scope(broker: &impl Broker) -> Scope {
    let name = broker.spec();
    let queue = name.rsplit(' ').next().unwrap_or("queue");
    Scope::new(format!("queue:{queue}")).unwrap()
}

/// A handler that records its run's effect and succeeds.
fn recording(
    effects: Effects,
) -> impl Fn(Message, Context) -> Pin<Box<dyn Future<Output = Outcome> + Send>> + Send + Sync + 'static
{
    move |_message, ctx| {
        let effects = effects.clone();
        Box::pin(async move {
            effects.record(&ctx).await;
            Outcome::Succeeded(StoredResponse::new(200))
        })
    }
}

/// Waits until `done` holds, polling every 50 ms, for at most `within`; fails with `what`.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !done().await {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `consumer`'s stats satisfy `done` (see [`eventually`]).
async fn until_stats(
    consumer: &Consumer,
    within: Duration,
    what: &str,
    done: impl Fn(&ConsumerStats) -> bool,
) {
    eventually(within, what, || std::future::ready(done(&consumer.stats()))).await;
}

/// The URL at `var` and a connection made from it by `connect`; `None` (the test is skipped,
/// with a printed reason) when the URL is unset or the broker does not answer within 5 s, and a
/// failure of either under `CI=true`.
pub async fn reach<T, E, Fut>(
    broker: &str,
    var: &str,
    connect: impl FnOnce(String) -> Fut,
) -> Option<(String, T)>
where
    E: std::fmt::Display,
    Fut: Future<Output = Result<T, E>>,
{
    let url = crate::support::backend_url(var)?;
    match connect_within(connect(url.clone())).await {
        Ok(connected) => Some((url, connected)),
        Err(e) => crate::support::unreachable(broker, var, e),
    }
}

/// Runs `connect` with a deadline of 5 s; its error, or the deadline, as text.
pub async fn connect_within<T, E: std::fmt::Display>(
    connect: impl Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(connected)) => Ok(connected),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no answer within 5 s".to_owned()),
    }
}

/// 1,000 messages and 200 duplicates with the same message ids and bodies: 90 published among
/// the originals (in bursts of 100, each duplicating the burst before), 110 once every original
/// was acknowledged. One effect per id, every delivery acknowledged (the queue drains), and each
/// duplicate acknowledged without running.
pub async fn a_thousand_messages_with_duplicates_take_effect_once_each(broker: impl Broker) {
    const N: usize = 1000;
    const BURST: usize = 100;
    let files = Files::new();
    let effects = files.effects().await;
    let idem = Idempotency::new(files.store().await);
    let consumer = Consumer::new(idem, scope(&broker), recording(effects.clone()));
    let running = broker.start(consumer.clone()).await;
    let started = Instant::now();
    let body = |i: usize| format!(r#"{{"order":{i}}}"#).into_bytes();
    // Deliveries the broker stored (JetStream drops a duplicate inside its window).
    let stored = std::cell::Cell::new(0u64);
    let publish = async |i: usize| {
        let kept = broker.publish(&format!("m-{i}"), &body(i)).await;
        stored.set(stored.get() + u64::from(kept));
    };
    for i in 0..N {
        publish(i).await;
        if i >= BURST && i % 10 == 5 {
            publish(i - BURST).await;
        }
        if i % BURST == BURST - 1 {
            tokio::time::sleep(PUBLISH_GAP).await;
        }
    }
    // Every delivery stored so far is acknowledged.
    let all_acknowledged = async |within: Duration, what: &str| {
        let want = stored.get();
        until_stats(&consumer, within, what, |s| s.ran + s.replayed >= want).await;
    };
    all_acknowledged(
        Duration::from_secs(120),
        "every original and early duplicate acknowledged",
    )
    .await;
    // The originals are acknowledged: their duplicates now find their keys done.
    for i in (0..N).filter(|i| i % 10 == 7 || i % BURST == 3) {
        publish(i).await;
    }
    all_acknowledged(Duration::from_secs(60), "every late duplicate acknowledged").await;
    let took = started.elapsed();
    let stored = stored.get();
    running.stop().await;
    let stats = consumer.stats();
    let (all, distinct, most) = effects.summary().await;
    eprintln!("{N} messages, {stored} stored deliveries: {stats:?} in {took:?}");
    assert_eq!((all, distinct, most), (N as i64, N as i64, 1), "{stats:?}");
    assert_eq!(stats.ran, N as u64, "{stats:?}");
    assert_eq!(stats.replayed, stored - N as u64, "{stats:?}");
    assert_eq!(stats.rejected, 0, "{stats:?}");
    assert_eq!(broker.unacked().await, 0, "the queue drained");
    broker.delete().await;
}

/// A duplicate delivered while the first delivery's handler runs is left for redelivery (the
/// key is in flight), then acknowledged without running once the first is done.
pub async fn a_duplicate_in_flight_is_redelivered_then_acked_without_running(broker: impl Broker) {
    let files = Files::new();
    let effects = files.effects().await;
    let idem = Idempotency::new(files.store().await)
        .lease(SHORT_LEASE)
        .in_flight_retry_after(Duration::from_millis(200));
    let gate = Arc::new(Notify::new());
    let handler = {
        let (effects, gate) = (effects.clone(), gate.clone());
        move |_message: Message, ctx: Context| {
            let (effects, gate) = (effects.clone(), gate.clone());
            async move {
                gate.notified().await;
                effects.record(&ctx).await;
                Outcome::Succeeded(StoredResponse::new(200))
            }
        }
    };
    let consumer = Consumer::new(idem, scope(&broker), handler).concurrency(2);
    let running = broker.start(consumer.clone()).await;
    assert!(broker.publish("dup-1", b"{}").await);
    tokio::time::sleep(PUBLISH_GAP).await;
    assert!(broker.publish("dup-1", b"{}").await, "stored twice");
    until_stats(
        &consumer,
        Duration::from_secs(20),
        "the duplicate found the key in flight",
        |s| s.in_flight >= 1,
    )
    .await;
    gate.notify_one();
    until_stats(
        &consumer,
        Duration::from_secs(20),
        "both deliveries acknowledged",
        |s| s.ran == 1 && s.replayed == 1,
    )
    .await;
    running.stop().await;
    assert_eq!(effects.of("dup-1").await, 1);
    assert_eq!(broker.unacked().await, 0, "the queue drained");
    broker.delete().await;
}

/// A message without a message id is rejected for good (dead-lettered / terminated), never
/// handled; a handler that panics leaves its key retryable and its message for redelivery, and
/// the redelivery runs it again.
pub async fn a_keyless_message_is_rejected_and_a_panic_redelivered(broker: impl Broker) {
    let files = Files::new();
    let effects = files.effects().await;
    let idem = Idempotency::new(files.store().await);
    let panicked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = {
        let (effects, panicked) = (effects.clone(), panicked.clone());
        move |_message: Message, ctx: Context| {
            let (effects, panicked) = (effects.clone(), panicked.clone());
            async move {
                if !panicked.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    panic!("the handler's first run panics");
                }
                effects.record(&ctx).await;
                Outcome::Succeeded(StoredResponse::new(200))
            }
        }
    };
    let consumer =
        Consumer::new(idem, scope(&broker), handler).retry_after(Duration::from_millis(100));
    let running = broker.start(consumer.clone()).await;
    assert!(broker.publish("", b"{}").await);
    assert!(broker.publish("boom-1", b"{}").await);
    until_stats(
        &consumer,
        Duration::from_secs(20),
        "the keyless message rejected, the other acknowledged",
        |s| s.rejected == 1 && s.ran == 1,
    )
    .await;
    running.stop().await;
    let stats = consumer.stats();
    assert_eq!(stats.failed, 1, "{stats:?}");
    assert_eq!(effects.summary().await, (1, 1, 1), "{stats:?}");
    assert_eq!(broker.unacked().await, 0, "the queue drained");
    broker.delete().await;
}

/// A consumer asked for the largest concurrency a `usize` holds: taken as
/// `consumer::MAX_CONCURRENCY`, its loop handles messages as any other (a broker loop sized by
/// the value as given would panic or ask the broker for more than it allows).
pub async fn a_consumer_asked_for_any_concurrency_handles_its_messages(broker: impl Broker) {
    let files = Files::new();
    let effects = files.effects().await;
    let idem = Idempotency::new(files.store().await);
    let handler = {
        let effects = effects.clone();
        move |_message: Message, ctx: Context| {
            let effects = effects.clone();
            async move {
                effects.record(&ctx).await;
                Outcome::Succeeded(StoredResponse::new(200))
            }
        }
    };
    let consumer = Consumer::new(idem, scope(&broker), handler).concurrency(usize::MAX);
    let running = broker.start(consumer.clone()).await;
    assert!(broker.publish("wide-1", b"{}").await);
    assert!(broker.publish("wide-2", b"{}").await);
    until_stats(
        &consumer,
        Duration::from_secs(20),
        "both messages handled",
        |s| s.ran == 2,
    )
    .await;
    running.stop().await;
    assert_eq!(effects.summary().await, (2, 2, 1));
    assert_eq!(broker.unacked().await, 0, "the queue drained");
    broker.delete().await;
}

/// Checks that the key of `id` is `done`, settled by the sweeper.
async fn settled_by_the_sweeper(store: &Arc<dyn Store>, scope: &Scope, id: &str) {
    let key = KeyId::new(
        scope.clone(),
        idemflow::key::IdempotencyKey::new(id).unwrap(),
    );
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, KeyState::Done);
    let history = store.history(&key).await.unwrap();
    let last = history.last().unwrap();
    assert_eq!(last.actor, Actor::Sweeper, "{history:?}");
}

/// A handler that acted and lost its answer (`Unknown`): the message is left unacknowledged,
/// the key `processing`, until the loop's in-process sweeper asks the provider (the ledger)
/// and settles it; the next delivery is then acknowledged without running the handler again.
pub async fn an_unknown_outcome_is_left_unacked_until_the_sweeper_settles_it(broker: impl Broker) {
    let files = Files::new();
    let effects = files.effects().await;
    let store = files.store().await;
    let idem = Idempotency::new(store.clone())
        .lease(SHORT_LEASE)
        .unknown_retry_after(Duration::from_millis(200));
    let handler = {
        let effects = effects.clone();
        move |_message: Message, ctx: Context| {
            let effects = effects.clone();
            async move {
                effects.record(&ctx).await;
                Outcome::unknown("the answer was lost after the effect")
            }
        }
    };
    let scope = scope(&broker);
    let consumer = Consumer::new(idem, scope.clone(), handler)
        .provider(Arc::new(Ledger(effects.clone())))
        .sweep_every(Duration::from_millis(100));
    let running = broker.start(consumer.clone()).await;
    assert!(broker.publish("lost-1", b"{}").await);
    until_stats(
        &consumer,
        Duration::from_secs(20),
        "acknowledged once the in-process sweeper settled the key",
        |s| s.replayed == 1,
    )
    .await;
    running.stop().await;
    assert_eq!(effects.of("lost-1").await, 1);
    let stats = consumer.stats();
    assert!(stats.unknown >= 1, "{stats:?}");
    assert_eq!(stats.ran, 0, "{stats:?}");
    settled_by_the_sweeper(&store, &scope, "lost-1").await;
    assert_eq!(broker.unacked().await, 0, "the queue drained");
    broker.delete().await;
}

/// What the kill test's child needs: `<kind> <url> <queue> <dir>`.
struct ChildSpec {
    broker: String,
    dir: PathBuf,
}

/// The consumer of the kill tests, in the child and in the test. With a provider (`own`
/// false): keys under the ledger, so that a run that died is settled by the sweeper from the
/// effects, never run again. Without one (`own`): the effect is the application's own, keyed
/// by the message, so that a run that died is taken over by a later delivery and runs again,
/// leaving one effect.
fn kill_consumer(
    idem: Idempotency,
    scope: Scope,
    effects: Effects,
    hang: bool,
    own: bool,
) -> Consumer {
    let ledger = Ledger(effects.clone());
    let handler = move |_message: Message, ctx: Context| {
        let effects = effects.clone();
        async move {
            if own {
                effects.record_keyed(&ctx).await;
            } else {
                effects.record(&ctx).await;
            }
            if hang {
                // Killed here: the effect is recorded, the key not finished.
                std::future::pending::<()>().await;
            }
            Outcome::Succeeded(StoredResponse::new(200))
        }
    };
    let consumer = Consumer::new(idem, scope, handler).concurrency(1);
    if own {
        consumer
    } else {
        consumer
            .provider(Arc::new(ledger))
            .sweep_every(Duration::from_millis(100))
    }
}

/// Set for the kill test's child when its consumer has no provider.
const CHILD_OWN: &str = "IDEMFLOW_CONSUMER_KILL_OWN";

/// The child of the kill tests: consumes the queue named by [`CHILD_SPEC`] with a handler that
/// records its effect and hangs; the test kills it. Run alone (no variable) it says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of the consumer kill tests"]
async fn child_consumes_until_killed() {
    let Ok(spec) = std::env::var(CHILD_SPEC) else {
        eprintln!("skipping: run by the consumer kill tests as their child process");
        return;
    };
    let (broker, dir) = spec.rsplit_once(' ').unwrap();
    let spec = ChildSpec {
        broker: broker.to_owned(),
        dir: PathBuf::from(dir),
    };
    {
        let files = Files { dir: spec.dir };
        let idem = Idempotency::new(files.store().await)
            .lease(SHORT_LEASE)
            .owner("doomed-consumer");
        let effects = files.effects().await;
        let own = std::env::var(CHILD_OWN).is_ok();
        let parts: Vec<&str> = spec.broker.split(' ').collect();
        let running = match parts.as_slice() {
            ["amqp", url, queue] => {
                let broker = crate::amqp::Amqp::attach(url, queue).await;
                let consumer = kill_consumer(idem, scope(&broker), effects, true, own);
                broker.start(consumer).await
            }
            ["nats", url, stream] => {
                let broker = crate::nats::Nats::attach(url, stream).await;
                let consumer = kill_consumer(idem, scope(&broker), effects, true, own);
                broker.start(consumer).await
            }
            _ => panic!("not a broker spec: {:?}", spec.broker),
        };
        running.join().await;
        eprintln!("the child's consumer ended before the kill");
    }
}

/// The kill tests' first part: three messages published, a child consumer (with the ledger as
/// its provider, or none when `own`) records the first message's effect and hangs, and is
/// killed with SIGKILL. Returns the files and when the kill was.
async fn killed_mid_message(broker: &impl Broker, own: bool) -> (Files, Instant) {
    let files = Files::new();
    let effects = files.effects().await;
    for id in ["kill-1", "kill-2", "kill-3"] {
        assert!(broker.publish(id, b"{}").await);
    }
    let mut command = crate::support::child_test(module_path!(), "child_consumes_until_killed");
    command
        .env(
            CHILD_SPEC,
            format!("{} {}", broker.spec(), files.dir.display()),
        )
        .stdout(Stdio::null());
    if own {
        command.env(CHILD_OWN, "1");
    }
    let mut child = KillOnDrop(command.spawn().unwrap());
    eventually(
        Duration::from_secs(30),
        "the child recorded its first effect",
        || {
            let effects = effects.clone();
            async move { effects.summary().await.0 >= 1 }
        },
    )
    .await;
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the child ended on its own"
    );
    child.0.kill().unwrap(); // SIGKILL
    child.0.wait().unwrap();
    (files, Instant::now())
}

/// The kill tests' second part: `consumer` runs on the queue until its stats say every message
/// was acknowledged (`all_acked`, within a minute), and stops; its stats.
async fn consume_after_kill(
    broker: &impl Broker,
    consumer: &Consumer,
    killed_at: Instant,
    all_acked: impl Fn(&ConsumerStats) -> bool,
) -> ConsumerStats {
    let running = broker.start(consumer.clone()).await;
    until_stats(
        consumer,
        Duration::from_secs(60),
        "every message acknowledged after the kill",
        all_acked,
    )
    .await;
    running.stop().await;
    let stats = consumer.stats();
    eprintln!(
        "acknowledged {:?} after the kill: {stats:?}",
        killed_at.elapsed()
    );
    stats
}

/// The kill test: a child consumer records the first message's effect and hangs; SIGKILL; the
/// broker redelivers to a consumer here. The key is `processing` under the dead child's lease:
/// the deliveries are left for redelivery (in flight, then unknown) until the sweeper, asking
/// the ledger, finds the effect and settles the key `done`; the next delivery is acknowledged
/// without running. The effect stays single, and the other messages take effect once each.
pub async fn a_consumer_killed_mid_message_leaves_one_effect(broker: impl Broker) {
    let (files, killed_at) = killed_mid_message(&broker, false).await;
    let store = files.store().await;
    let effects = files.effects().await;
    let (_, _, most) = effects.summary().await;
    assert_eq!(most, 1);
    let idem = Idempotency::new(store.clone())
        .lease(SHORT_LEASE)
        .in_flight_retry_after(Duration::from_millis(200))
        .unknown_retry_after(Duration::from_millis(200));
    let scope = scope(&broker);
    // Its in-process sweeper settles the dead child's key: no other sweeper runs.
    let consumer = kill_consumer(idem, scope.clone(), effects.clone(), false, false).concurrency(4);
    let stats =
        consume_after_kill(&broker, &consumer, killed_at, |s| s.ran + s.replayed == 3).await;
    assert_eq!(effects.summary().await, (3, 3, 1), "{stats:?}");
    assert_eq!((stats.ran, stats.replayed), (2, 1), "{stats:?}");
    let died_on = ["kill-1", "kill-2", "kill-3"];
    let mut settled = 0;
    for id in died_on {
        let key = KeyId::new(
            scope.clone(),
            idemflow::key::IdempotencyKey::new(id).unwrap(),
        );
        let history = store.history(&key).await.unwrap();
        if history.iter().any(|e| e.actor == Actor::Sweeper) {
            settled_by_the_sweeper(&store, &scope, id).await;
            settled += 1;
        }
    }
    assert_eq!(
        settled, 1,
        "the dead child's key was settled by the sweeper"
    );
    assert_eq!(broker.unacked().await, 0, "the queue drained");
    broker.delete().await;
}

/// The kill test for a consumer without a provider (the effect is the application's own,
/// keyed by the message): a child consumer records the first message's effect and hangs;
/// SIGKILL; the broker redelivers to a consumer here, with no sweeper running. Once the dead
/// child's lease has run out, a delivery takes the key over and runs the handler again, which
/// finds the first run's effect: each message has one effect, the first one two runs, and its
/// key was taken over by a worker, not settled by a sweeper.
pub async fn a_consumer_without_a_provider_killed_mid_message_keeps_one_effect(
    broker: impl Broker,
) {
    let (files, killed_at) = killed_mid_message(&broker, true).await;
    let store = files.store().await;
    let effects = files.effects().await;
    let (runs, _, most) = effects.summary().await;
    assert_eq!((runs, most), (1, 1));
    let idem = Idempotency::new(store.clone())
        .lease(SHORT_LEASE)
        .in_flight_retry_after(Duration::from_millis(200));
    let scope = scope(&broker);
    let consumer = kill_consumer(idem, scope.clone(), effects.clone(), false, true).concurrency(4);
    let stats = consume_after_kill(&broker, &consumer, killed_at, |s| s.ran == 3).await;
    assert_eq!(effects.own().await, 3, "one effect per message: {stats:?}");
    // Four runs: the dead child's, its takeover's, and one each for the other two.
    assert_eq!(effects.summary().await, (4, 3, 2), "{stats:?}");
    let mut taken_over = 0;
    for id in ["kill-1", "kill-2", "kill-3"] {
        let key = KeyId::new(
            scope.clone(),
            idemflow::key::IdempotencyKey::new(id).unwrap(),
        );
        let record = store.get(&key).await.unwrap().unwrap();
        assert_eq!(record.state, KeyState::Done, "{id}");
        let history = store.history(&key).await.unwrap();
        assert!(
            history.iter().all(|e| e.actor != Actor::Sweeper),
            "{id}: settled by a sweeper: {history:?}"
        );
        if record.attempts > 1 {
            taken_over += 1;
        }
    }
    assert_eq!(taken_over, 1, "the dead child's key was taken over");
    assert_eq!(broker.unacked().await, 0, "the queue drained");
    broker.delete().await;
}

/// The ERROR events logged in this process, as text (a subscriber installed once for the whole
/// binary: the loops log from tasks on every worker thread).
fn error_log() -> Arc<std::sync::Mutex<Vec<String>>> {
    use tracing_subscriber::layer::SubscriberExt;
    static LOG: std::sync::OnceLock<Arc<std::sync::Mutex<Vec<String>>>> =
        std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(Errors(log.clone()));
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other subscriber in the consumers binary");
        log
    })
    .clone()
}

struct Errors(Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Errors {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={value:?} ", field.name()));
            }
        }
        if *event.metadata().level() == tracing::Level::ERROR {
            let mut text = Text(String::new());
            event.record(&mut text);
            self.0.lock().unwrap().push(text.0);
        }
    }
}

/// A consumer keyed by the body's `order_id` and fingerprinted by `/order_id` and `/email`: the
/// same message encoded again is acknowledged as a duplicate; a corrected copy (another email
/// under the order) and a message without `order_id` are refused, and each lands on the
/// queue's dead-letter target with its reason; nothing is left on the queue.
pub async fn refused_messages_are_dead_lettered_with_their_reason(broker: impl Broker) {
    let files = Files::new();
    let effects = files.effects().await;
    let idem = Idempotency::new(files.store().await);
    let consumer = Consumer::new(idem, scope(&broker), recording(effects.clone()))
        .key(KeySource::JsonField("order_id".into()))
        .fingerprint(FingerprintSource::JsonPointers(vec![
            "/order_id".into(),
            "/email".into(),
        ]));
    let running = broker.start(consumer.clone()).await;
    let original = br#"{"order_id": 41, "email": "a@example.com"}"#;
    let corrected = br#"{"order_id": 41, "email": "b@example.com"}"#;
    let keyless = br#"{"email": "c@example.com"}"#;
    assert!(broker.publish("", original).await);
    until_stats(
        &consumer,
        Duration::from_secs(20),
        "the original handled",
        |s| s.ran == 1,
    )
    .await;
    assert!(
        broker
            .publish("", br#"{ "email":"a@example.com",  "order_id":41 }"#)
            .await
    );
    assert!(broker.publish("", corrected).await);
    assert!(broker.publish("", keyless).await);
    until_stats(
        &consumer,
        Duration::from_secs(20),
        "the copy acknowledged, the other two dead-lettered",
        |s| s.replayed == 1 && s.dead_lettered == 2,
    )
    .await;
    running.stop().await;
    let stats = consumer.stats();
    assert_eq!((stats.rejected, stats.dropped), (2, 0), "{stats:?}");
    assert_eq!(effects.summary().await, (1, 1, 1), "{stats:?}");
    // The dead letters are confirmed before the originals are acknowledged: all are there.
    let mut dead = broker.dead_letters().await;
    dead.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(dead.len(), 2, "{dead:?}");
    let (missing, reused) = (&dead[0], &dead[1]);
    assert_eq!(reused.1, corrected, "{dead:?}");
    assert!(reused.0.contains("another message"), "{}", reused.0);
    assert_eq!(missing.1, keyless, "{dead:?}");
    assert!(missing.0.contains("no key"), "{}", missing.0);
    assert_eq!(broker.unacked().await, 0, "the queue drained");
    broker.delete().await;
}

/// A loop with nowhere to put a refused message does not start: without a dead-letter target,
/// and with one that does not exist, it ends at once with `ConsumerError::NoDeadLetter`, whose
/// text says how to add one; the message on the queue stays there.
pub async fn a_consumer_with_nowhere_for_refused_messages_does_not_start(broker: impl Broker) {
    let files = Files::new();
    let effects = files.effects().await;
    let idem = Idempotency::new(files.store().await);
    let consumer = Consumer::new(idem, scope(&broker), recording(effects.clone()));
    assert!(broker.publish("waiting-1", b"{}").await);
    let missing = format!("{}-missing", broker.dead_letter_target());
    for (consumer, what) in [
        (consumer.clone(), "no target"),
        (consumer.clone().dead_letter(missing), "a missing target"),
    ] {
        let ended = broker.start_as_is(consumer).await;
        let ended = tokio::time::timeout(Duration::from_secs(20), ended.ended())
            .await
            .unwrap_or_else(|_| panic!("{what}: the loop started"));
        match ended {
            Err(e @ ConsumerError::NoDeadLetter { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("Consumer::dead_letter") && text.contains("drop_refused"),
                    "{what}: {text}"
                );
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    assert_eq!(consumer.stats(), ConsumerStats::default());
    assert_eq!(effects.summary().await, (0, 0, 0));
    assert_eq!(broker.unacked().await, 1, "the message waits on the queue");
    broker.delete().await;
}

/// With `drop_refused`, a refused message is dropped: the queue drains, nothing is dead-lettered,
/// and each drop is counted and logged at ERROR with the refusal.
pub async fn drop_refused_drops_with_an_error_log_and_a_count(broker: impl Broker) {
    let log = error_log();
    let files = Files::new();
    let effects = files.effects().await;
    let idem = Idempotency::new(files.store().await);
    let scope = scope(&broker);
    let consumer = Consumer::new(idem, scope.clone(), recording(effects.clone())).drop_refused();
    let running = broker.start_as_is(consumer.clone()).await;
    assert!(broker.publish("", b"{}").await);
    assert!(broker.publish("kept-1", b"{}").await);
    until_stats(
        &consumer,
        Duration::from_secs(20),
        "the keyless message dropped, the other handled",
        |s| s.dropped == 1 && s.ran == 1,
    )
    .await;
    running.stop().await;
    assert_eq!(consumer.stats().dead_lettered, 0);
    assert_eq!(effects.summary().await, (1, 1, 1));
    assert!(broker.dead_letters().await.is_empty());
    let logged = log.lock().unwrap().clone();
    assert!(
        logged
            .iter()
            .any(|line| line.contains("refused message dropped")
                && line.contains(scope.as_str())
                && line.contains("no key")),
        "no ERROR line for the drop: {logged:?}"
    );
    assert_eq!(broker.unacked().await, 0, "the queue drained");
    broker.delete().await;
}
