//! Fast recovery with default settings (issue 11), on every backend: the card service
//! (`examples/card_service.rs`, library defaults: a 6 s lease renewed every 2 s while a charge
//! runs) is killed with payments stopped at three crash points, restarted at once on the same
//! store and the same fake Stripe, with `idemflow reconcile --every 5s` running (the real binary,
//! default sweeper settings; on Redis the same sweeper in-process, see below), and a client per
//! payment retrying it with the same `Idempotency-Key` every second (the nine clients' retries
//! spread over the second: each retries a connection error after 0.1 to 0.9 s). Every payment
//! must get its final answer (201, or 402 for the declined card) within 15 s of the restart, with
//! the PaymentIntent the fake recorded for it, and the fake must have charged each payment once.
//!
//! Crash points, three payments each (two cards, one declined card):
//!
//! * `a` **claimed, not sent**: the key is claimed (processing, 6 s lease), the charge has not
//!   left for Stripe (the store decorator holds the claim's answer: the heartbeat never starts).
//! * `b` **charged, answer lost**: the fake charged and saved its idempotent answer but never
//!   answers (`Faults::hang_next_response`); the service is killed right after the first
//!   heartbeat renewal of these keys, so their lease has nearly 6 s left: the worst case.
//! * `c` **answered, not finished**: Stripe's answer reached the handler, the layer built the
//!   response, and the decorator holds the executor's `finish` (the heartbeat has stopped with
//!   the operation, as in the real code).
//!
//! **Timeline.** The reconciler runs from the start, like a deployment's. `b` is sent so that the
//! kill, right after `b`'s first renewal (a third of the lease later), comes
//! `IDEMFLOW_FAST_RECOVERY_SWEEP_AT` seconds (default 3.5) before one of the reconciler's sweeps;
//! `a` and `c` are sent 1 s before that renewal, so the kill leaves them about 5 s of lease and
//! `b` 6 s. The restart follows at once (a few ms). Over all phases of the reconciler the `b` keys
//! are settled 6 to 11 s after the crash (a sweep just before their lease runs out misses them
//! and the next comes 5 s later), then a client sees the answer at its next retry, up to 1 s
//! later. The default phase is the median case; `IDEMFLOW_FAST_RECOVERY_SWEEP_AT=0.97` puts a
//! sweep just before the `b` leases run out: the worst case (docs/reliability.md, "Crash
//! matrix").
//!
//! **The kill is in-process.** Each service instance runs on a tokio runtime of its own, holding
//! its own store connections; killing it is `Runtime::shutdown_background`: the server task,
//! every request future in flight (with the heartbeats running inside them) and the store's
//! connections are dropped where they stand. Nothing is finished or released; the store's rows
//! stay as written. Not a process kill: the crash points need a hook inside the service (the
//! store decorator), which the example binary does not offer (`tests/services/card_service.rs`
//! kills that binary with SIGKILL mid-load, at no chosen point, and reconciles with `--once`).
//!
//! **The reconciler** is `idemflow reconcile --every 5s --config <file naming the fake as
//! stripe>` against the run's `DATABASE_URL` (a SQLite file, a fresh PostgreSQL schema through
//! `search_path`, a fresh MariaDB database). On Redis it is `Sweeper::run` every 5 s in this
//! process, with the provider built from the same configuration (`build_with_env`): the CLI
//! always uses Redis's default key prefix (`DATABASE_URL` cannot name one), and a run on a shared
//! server needs a prefix of its own, or sweepers of other runs would take its keys.
//!
//! Each test prints n, p50 and max of "crash -> final answer", and per payment the answer, the
//! time, where the time went (lease left at the crash, when the sweeper took the key over and
//! settled it) and what the client saw. The only timed assertion is the 15 s bound.

#[path = "../../examples/card_service.rs"]
mod card_service;

use idemflow::store::FinishMode;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemflow::conformance::Delegate;
use idemflow::provider::config::{ProviderConfig, build_with_env};
use idemflow::store::{ClaimOutcome, Finish, NewClaim};
use idemflow::testkit::FakeStripe;
use idemflow::{
    Idempotency, KeyId, KeyState, Providers, Store, StoreError, Sweeper, async_trait,
    record::Actor, record::KeyRecord, record::LeaseToken,
};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::support::KillOnDrop;

/// The bound issue 11 asks for: restart -> final answer.
const BOUND: Duration = Duration::from_secs(15);
/// The reconciler's interval (`--every 5s`).
const EVERY: Duration = Duration::from_secs(5);
/// Clients retry at least this often (a shorter `Retry-After` is honoured).
const RETRY_CAP: Duration = Duration::from_secs(1);
/// Clients stop trying this long after the restart (a failing run ends).
const GIVE_UP: Duration = Duration::from_secs(25);

/// Opens the run's store anew (new connections, in the calling runtime).
type Opener = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Arc<dyn Store>> + Send>> + Send + Sync>;

/// One backend's store for a run.
pub struct Backend {
    name: &'static str,
    /// The `DATABASE_URL` the CLI gets; `None`: the sweeper runs in-process.
    url: Option<String>,
    open: Opener,
}

impl Backend {
    /// A backend reached by URL, opened as the example does (`idemflow::store::connect`).
    fn by_url(name: &'static str, url: String) -> Self {
        let u = url.clone();
        Self {
            name,
            url: Some(url),
            open: Arc::new(move || {
                let u = u.clone();
                Box::pin(async move { idemflow::store::connect(&u).await.unwrap() })
            }),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Point {
    Claimed,
    Charged,
    Answered,
}

impl Point {
    fn label(self) -> &'static str {
        match self {
            Point::Claimed => "a claimed, not sent",
            Point::Charged => "b charged, answer lost",
            Point::Answered => "c answered, not finished",
        }
    }
}

#[derive(Debug, Clone)]
struct Payment {
    key: String,
    point: Point,
    amount: u64,
    declined: bool,
    /// The client's retry after a connection error (the crash) comes this soon, so that the
    /// clients' retries are spread over the second instead of all in step with the crash.
    phase: Duration,
}

impl Payment {
    fn body(&self) -> Value {
        let pm = if self.declined {
            FakeStripe::DECLINED_CARD
        } else {
            "pm_card_visa"
        };
        json!({"amount": self.amount, "currency": "usd", "customer": "cus_fast", "payment_method": pm})
    }

    fn expected(&self) -> u16 {
        if self.declined { 402 } else { 201 }
    }
}

/// Nine payments: three per crash point, the third of each with the declined card; the clients'
/// retry phases spread over the second.
fn payments() -> Vec<Payment> {
    let mut out = Vec::new();
    for (n, (letter, point)) in [
        ("a", Point::Claimed),
        ("b", Point::Charged),
        ("c", Point::Answered),
    ]
    .into_iter()
    .enumerate()
    {
        for i in 1..=3u64 {
            out.push(Payment {
                key: format!("pay-{letter}{i}"),
                point,
                amount: 1000 + 100 * n as u64 + i,
                declined: i == 3,
                // a1 0.1 s, b1 0.2 s, c1 0.3 s, a2 0.4 s, ..., c3 0.9 s.
                phase: Duration::from_millis(100 * (3 * (i - 1) + n as u64 + 1)),
            });
        }
    }
    out
}

/// What the store decorator of the first instance saw.
#[derive(Debug)]
enum Reached {
    /// A held claim (crash point `a`).
    Claimed(String),
    /// A held `finish` (crash point `c`).
    Finishing(String),
    /// A heartbeat renewal went through.
    Renewed(String),
}

/// The first instance's store: holds the claims of the `a` keys and the executor's `finish` of
/// the `c` keys forever (until the kill drops them), and reports renewals.
#[derive(Debug)]
struct CrashPoints {
    inner: Arc<dyn Store>,
    hold_claim: BTreeSet<String>,
    hold_finish: BTreeSet<String>,
    events: mpsc::UnboundedSender<Reached>,
}

#[async_trait]
impl Delegate for CrashPoints {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        let r = self.inner.claim(claim).await;
        let key = claim.id.key.as_str();
        if matches!(r, Ok(ClaimOutcome::Claimed(_))) && self.hold_claim.contains(key) {
            let _ = self.events.send(Reached::Claimed(key.to_owned()));
            std::future::pending::<()>().await;
        }
        r
    }
    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        let key = id.key.as_str();
        if finish.actor == Actor::Worker && self.hold_finish.contains(key) {
            let _ = self.events.send(Reached::Finishing(key.to_owned()));
            std::future::pending::<()>().await;
        }
        self.inner.finish_as(id, mode, finish).await
    }
    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        let r = self.inner.extend(id, token, lease).await;
        if r.is_ok() {
            let _ = self
                .events
                .send(Reached::Renewed(id.key.as_str().to_owned()));
        }
        r
    }
}

type Wrap = Box<dyn FnOnce(Arc<dyn Store>) -> Arc<dyn Store> + Send>;

/// A card service instance on a runtime of its own (so that killing it drops everything it
/// runs, as a process death would).
struct Instance {
    runtime: Option<tokio::runtime::Runtime>,
    base: String,
}

impl Instance {
    /// Starts the example's service: opens the store, migrates, builds the executor and the
    /// adapter from `settings` (`card_service::with_store`), binds and serves.
    async fn start(open: Opener, settings: card_service::Settings, wrap: Option<Wrap>) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("card-service")
            .enable_all()
            .build()
            .unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        runtime.spawn(async move {
            let store = open().await;
            store.migrate().await.unwrap();
            let store = match wrap {
                Some(w) => w(store),
                None => store,
            };
            let (idem, stripe) = card_service::with_store(&settings, store).unwrap();
            let listener = tokio::net::TcpListener::bind(&settings.listen_addr)
                .await
                .unwrap();
            let _ = tx.send(format!("http://{}", listener.local_addr().unwrap()));
            axum::serve(listener, card_service::router(idem, stripe))
                .await
                .unwrap();
        });
        let base = rx.await.expect("the card service did not start");
        Self {
            runtime: Some(runtime),
            base,
        }
    }

    /// The crash: every task of the instance is dropped where it stands.
    fn kill(mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// The running reconciler, and when each of its sweeps ended (with its summary).
struct Reconciler {
    kind: Kind,
    sweeps: Arc<Mutex<Vec<(Instant, String)>>>,
}

enum Kind {
    /// `idemflow -v reconcile --every 5s`: stdout (one line per sweep) is read as it is written,
    /// stderr (the log) at the end.
    Cli {
        child: KillOnDrop,
        stderr: PathBuf,
        tail: tokio::task::JoinHandle<()>,
    },
    /// `Sweeper::run` every 5 s in this process.
    InProcess {
        stop: tokio::sync::oneshot::Sender<()>,
        task: tokio::task::JoinHandle<()>,
    },
}

impl Reconciler {
    /// When its first sweep ended.
    async fn first_sweep(&self) -> Instant {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some((at, _)) = self.sweeps.lock().unwrap().first() {
                return *at;
            }
            if Instant::now() > deadline {
                let log = match &self.kind {
                    Kind::Cli { stderr, .. } => std::fs::read_to_string(stderr).unwrap_or_default(),
                    Kind::InProcess { .. } => String::new(),
                };
                panic!("the reconciler never finished a sweep: {log}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The sweeps that ended after `t`.
    fn sweeps_after(&self, t: Instant) -> Vec<(Instant, String)> {
        let sweeps = self.sweeps.lock().unwrap();
        sweeps.iter().filter(|(at, _)| *at > t).cloned().collect()
    }

    /// Stops it (SIGTERM for the CLI) and returns its log.
    async fn stop(self) -> Vec<String> {
        match self.kind {
            Kind::Cli {
                mut child,
                stderr,
                tail,
            } => {
                let _ = Command::new("kill")
                    .args(["-TERM", &child.0.id().to_string()])
                    .status();
                let deadline = Instant::now() + Duration::from_secs(10);
                while child.0.try_wait().unwrap().is_none() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                drop(child);
                tail.abort();
                let text = std::fs::read_to_string(&stderr).unwrap_or_default();
                text.lines().map(|l| format!("cli: {l}")).collect()
            }
            Kind::InProcess { stop, task } => {
                let _ = stop.send(());
                let _ = task.await;
                Vec::new()
            }
        }
    }
}

/// The `[[providers]]` entry both reconcilers use.
fn stripe_config(fake: &FakeStripe) -> ProviderConfig {
    serde_json::from_value(json!({
        "kind": "stripe",
        "base_url": fake.base_url(),
        "api_key_env": "STRIPE_API_KEY",
    }))
    .unwrap()
}

fn start_cli(url: &str, fake: &FakeStripe, dir: &Path) -> Reconciler {
    let config = dir.join("idemflow.toml");
    std::fs::write(
        &config,
        format!(
            "[[providers]]\nkind = \"stripe\"\nbase_url = \"{}\"\napi_key_env = \"STRIPE_API_KEY\"\n",
            fake.base_url()
        ),
    )
    .unwrap();
    let stdout = dir.join("reconcile.out");
    let stderr = dir.join("reconcile.err");
    let child = Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["-v", "reconcile", "--every", "5s", "--config"])
        .arg(&config)
        .env("DATABASE_URL", url)
        .env("STRIPE_API_KEY", FakeStripe::API_KEY)
        .env("NO_COLOR", "1")
        .env_remove("IDEMFLOW_CONFIG")
        .env_remove("IDEMFLOW_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    // The CLI prints one line per sweep (Rust's stdout is line-buffered, also into a file).
    let sweeps = Arc::new(Mutex::new(Vec::new()));
    let sink = sweeps.clone();
    let tail = tokio::spawn(async move {
        let mut seen = 0;
        loop {
            let text = tokio::fs::read_to_string(&stdout).await.unwrap_or_default();
            let complete: Vec<&str> = text
                .split_inclusive('\n')
                .filter(|l| l.ends_with('\n'))
                .collect();
            let now = Instant::now();
            for l in &complete[seen.min(complete.len())..] {
                sink.lock().unwrap().push((now, l.trim_end().to_owned()));
            }
            seen = complete.len();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    Reconciler {
        kind: Kind::Cli {
            child: KillOnDrop(child),
            stderr,
            tail,
        },
        sweeps,
    }
}

fn start_in_process(store: Arc<dyn Store>, fake: &FakeStripe) -> Reconciler {
    let env = |var: &str| (var == "STRIPE_API_KEY").then(|| FakeStripe::API_KEY.to_owned());
    let stripe = build_with_env(&stripe_config(fake), env).unwrap();
    let sweeper = Sweeper::new(store, Providers::new().with(stripe));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sweeps = Arc::new(Mutex::new(Vec::new()));
    let sink = sweeps.clone();
    let task = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        sweeper
            .run_with(EVERY, shutdown, |r| {
                let line = match r {
                    Ok(report) => format!("sweep: {}", report.summary()),
                    Err(e) => format!("sweep failed: {e}"),
                };
                sink.lock().unwrap().push((Instant::now(), line));
            })
            .await;
    });
    Reconciler {
        kind: Kind::InProcess { stop, task },
        sweeps,
    }
}

/// When the reconciler's first sweep after the crash comes, after the crash:
/// `IDEMFLOW_FAST_RECOVERY_SWEEP_AT` seconds (0 to 5), default 3.5 (the median case with the
/// default 6 s lease: over all phases the `b` keys are settled 6 to 11 s after the crash, here at
/// 8.5 s).
fn sweep_at() -> Duration {
    match std::env::var("IDEMFLOW_FAST_RECOVERY_SWEEP_AT") {
        Ok(v) if !v.is_empty() => {
            let s: f64 = v
                .parse()
                .unwrap_or_else(|_| panic!("IDEMFLOW_FAST_RECOVERY_SWEEP_AT={v:?}: seconds"));
            assert!(
                (0.0..5.0).contains(&s),
                "IDEMFLOW_FAST_RECOVERY_SWEEP_AT={v:?}: between 0 and 5 s"
            );
            Duration::from_secs_f64(s)
        }
        _ => Duration::from_millis(3500),
    }
}

/// What a client ended with.
#[derive(Debug)]
struct Answer {
    status: Option<u16>,
    replayed: bool,
    body: Value,
    at: Instant,
    trail: Vec<String>,
}

/// Sends the payment with its key until an answer other than 409 / 503 comes (or `give_up`),
/// waiting `Retry-After` capped at 1 s between tries (the payment's phase, under 1 s, after a
/// connection error).
async fn pay_until_final(
    http: reqwest::Client,
    base: watch::Receiver<String>,
    scope: String,
    p: Payment,
    give_up: watch::Receiver<Option<Instant>>,
) -> Answer {
    let mut trail = Vec::new();
    loop {
        let url = format!("{}/payments", base.borrow().clone());
        let sent = http
            .post(url)
            .header("idempotency-key", format!("\"{}\"", p.key))
            .header("x-account-id", &scope)
            .json(&p.body())
            .send()
            .await;
        let wait = match sent {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let replayed = resp
                    .headers()
                    .get("idempotent-replayed")
                    .is_some_and(|v| v == "true");
                let retry_after = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse::<f64>().ok())
                    .map(Duration::from_secs_f64);
                let body: Value = resp.json().await.unwrap_or(Value::Null);
                let at = Instant::now();
                trail.push(status.to_string());
                if status != 409 && status != 503 {
                    return Answer {
                        status: Some(status),
                        replayed,
                        body,
                        at,
                        trail,
                    };
                }
                retry_after.unwrap_or(RETRY_CAP).min(RETRY_CAP)
            }
            Err(e) => {
                trail.push(
                    if e.is_timeout() {
                        "timeout"
                    } else {
                        "conn-error"
                    }
                    .into(),
                );
                p.phase
            }
        };
        if give_up.borrow().is_some_and(|g| Instant::now() + wait > g) {
            return Answer {
                status: None,
                replayed: false,
                body: Value::Null,
                at: Instant::now(),
                trail,
            };
        }
        tokio::time::sleep(wait).await;
    }
}

/// `409 409 409 503 201` as `409x3 503 201`.
fn squeeze(trail: &[String]) -> String {
    let mut out: Vec<(String, usize)> = Vec::new();
    for t in trail {
        match out.last_mut() {
            Some((last, n)) if last == t => *n += 1,
            _ => out.push((t.clone(), 1)),
        }
    }
    out.iter()
        .map(|(t, n)| {
            if *n > 1 {
                format!("{t}x{n}")
            } else {
                t.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn rel(at: Instant, crash: Instant) -> String {
    if at >= crash {
        format!("+{:.2} s", (at - crash).as_secs_f64())
    } else {
        format!("-{:.2} s", (crash - at).as_secs_f64())
    }
}

fn rel_db(at: DateTime<Utc>, crash: DateTime<Utc>) -> String {
    format!("{:+.2} s", (at - crash).as_seconds_f64())
}

/// Waits for the decorator's events until `done` says every crash point is reached.
async fn wait_for(
    events: &mut mpsc::UnboundedReceiver<Reached>,
    seen: &mut BTreeMap<&'static str, BTreeSet<String>>,
    done: impl Fn(&BTreeMap<&'static str, BTreeSet<String>>) -> bool,
    what: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(seen) {
        let ev = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}: {seen:?}"))
            .expect("the decorator is gone");
        let (kind, key) = match ev {
            Reached::Claimed(k) => ("claimed", k),
            Reached::Finishing(k) => ("finishing", k),
            Reached::Renewed(k) => ("renewed", k),
        };
        seen.entry(kind).or_default().insert(key);
    }
}

/// The whole scenario on one backend.
pub async fn run(backend: Backend) {
    let wall = Instant::now();
    let name = backend.name;
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeStripe::start().await.unwrap();
    let store = (backend.open)().await;
    store.migrate().await.unwrap();
    // A scope of its own, on top of the run's own store.
    let scope = format!(
        "acct_fast_{}_{}",
        std::process::id(),
        Utc::now().timestamp_micros()
    );
    let settings = card_service::Settings {
        database_url: backend.url.clone().unwrap_or_else(|| "(redis)".into()),
        listen_addr: "127.0.0.1:0".into(),
        stripe_base: fake.base_url().to_owned(),
        stripe_key: FakeStripe::API_KEY.into(),
        // IDEMFLOW_LEASE_SECS unset: the library's default lease.
        lease: None,
        wait_in_flight: None,
    };
    let lease = settings
        .lease
        .unwrap_or(Idempotency::new(store.clone()).config().lease);

    // The reconciler runs all along, like a deployment's.
    let reconciler = match &backend.url {
        Some(url) => start_cli(url, &fake, dir.path()),
        None => start_in_process(store.clone(), &fake),
    };

    let pays = payments();
    let keys_at = |point: Point| -> BTreeSet<String> {
        pays.iter()
            .filter(|p| p.point == point)
            .map(|p| p.key.clone())
            .collect()
    };
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let wrap: Wrap = {
        let (hold_claim, hold_finish) = (keys_at(Point::Claimed), keys_at(Point::Answered));
        Box::new(move |inner| {
            Arc::new(CrashPoints {
                inner,
                hold_claim,
                hold_finish,
                events: events_tx,
            }) as Arc<dyn Store>
        })
    };
    let first = Instance::start(backend.open.clone(), settings.clone(), Some(wrap)).await;
    let (base_tx, base_rx) = watch::channel(first.base.clone());
    let (give_up_tx, give_up_rx) = watch::channel(None::<Instant>);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut clients = tokio::task::JoinSet::new();
    let mut spawn = |point: Point| {
        for p in pays.iter().filter(|p| p.point == point) {
            let (http, base, scope, p2, give_up) = (
                http.clone(),
                base_rx.clone(),
                scope.clone(),
                p.clone(),
                give_up_rx.clone(),
            );
            clients.spawn(async move {
                let a = pay_until_final(http, base, scope, p2.clone(), give_up).await;
                (p2, a)
            });
        }
    };

    // b: the fake charges, then never answers.
    let faults = fake.faults();
    for _ in 0..keys_at(Point::Charged).len() {
        faults.hang_next_response();
    }
    // Place the crash (right after b's first renewal, a third of the lease after b is sent)
    // `sweep_at` before one of the reconciler's sweeps.
    let first_sweep = reconciler.first_sweep().await;
    let (sweep_at, renew_after) = (sweep_at(), lease / 3);
    let mut next = first_sweep;
    while next < Instant::now() + sweep_at + renew_after + Duration::from_millis(50) {
        next += EVERY;
    }
    let b_sent = next - sweep_at - renew_after;
    tokio::time::sleep_until(b_sent).await;
    spawn(Point::Charged);
    let deadline = Instant::now() + Duration::from_secs(20);
    while fake.ledger().len() < keys_at(Point::Charged).len() || faults.pending() > 0 {
        assert!(
            Instant::now() < deadline,
            "[{name}] the b charges never happened"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // a and c about 1 s before b's first renewal.
    tokio::time::sleep_until(b_sent + renew_after.saturating_sub(Duration::from_secs(1))).await;
    spawn(Point::Claimed);
    spawn(Point::Answered);
    let mut seen = BTreeMap::new();
    let (a_keys, b_keys, c_keys) = (
        keys_at(Point::Claimed),
        keys_at(Point::Charged),
        keys_at(Point::Answered),
    );
    let reached = |s: &BTreeMap<&'static str, BTreeSet<String>>| {
        let has = |kind: &str, keys: &BTreeSet<String>| {
            s.get(kind).is_some_and(|got| keys.is_subset(got))
        };
        has("claimed", &a_keys) && has("finishing", &c_keys) && has("renewed", &b_keys)
    };
    wait_for(&mut events, &mut seen, reached, "the crash points").await;

    // The crash, right after b's renewal; the restart at once.
    let crash = Instant::now();
    let crash_db = Utc::now();
    first.kill();
    let charged_at_crash = fake.ledger().entries();
    let second = Instance::start(backend.open.clone(), settings.clone(), None).await;
    let restart = Instant::now();
    base_tx.send(second.base.clone()).unwrap();
    give_up_tx.send(Some(restart + GIVE_UP)).unwrap();

    // What the crash left: each key's lease as last written.
    let id = |key: &str| KeyId::new(scope.parse().unwrap(), key.parse().unwrap());
    let mut left_at_crash = BTreeMap::new();
    for p in &pays {
        let rec = store.get(&id(&p.key)).await.unwrap().unwrap();
        assert_eq!(rec.state, KeyState::Processing, "[{name}] {}", p.key);
        left_at_crash.insert(p.key.clone(), rec.lease_expires_at);
    }

    let mut answers = BTreeMap::new();
    while let Some(r) = clients.join_next().await {
        let (p, a) = r.unwrap();
        answers.insert(p.key.clone(), (p, a));
    }
    let sweeps = reconciler.sweeps_after(crash);
    let reconciler_log = reconciler.stop().await;
    drop(second);

    // Report.
    let mut times: Vec<Duration> = Vec::new();
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    let ledger = fake.ledger().entries();
    for (key, (p, a)) in &answers {
        let rec = store.get(&id(key)).await.unwrap().unwrap();
        let history = store.history(&id(key)).await.unwrap();
        let taken = history
            .iter()
            .find(|e| e.actor == Actor::Sweeper)
            .map(|e| rel_db(e.at, crash_db));
        let settled = history
            .iter()
            .rfind(|e| e.to != Some(KeyState::Processing) && e.to.is_some())
            .map(|e| format!("{} by {:?}", rel_db(e.at, crash_db), e.actor));
        let lease_left = left_at_crash[key].map(|exp| rel_db(exp, crash_db));
        let since_crash = a.at - crash;
        let since_restart = a.at.saturating_duration_since(restart);
        if a.status.is_some() {
            times.push(since_crash);
        }
        lines.push(format!(
            "  {:<26} {key}: {} after {} (restart -> answer {}); lease expired {}, sweeper took it {}, settled {}; client: {}",
            p.point.label(),
            a.status.map_or("no answer".into(), |s| {
                format!("{s}{}", if a.replayed { " replayed" } else { "" })
            }),
            secs(since_crash),
            secs(since_restart),
            lease_left.unwrap_or_else(|| "-".into()),
            taken.unwrap_or_else(|| "never".into()),
            settled.unwrap_or_else(|| "never".into()),
            squeeze(&a.trail),
        ));

        // Checks.
        let mut fail = |what: String| failures.push(format!("{key} ({}): {what}", p.point.label()));
        if a.status != Some(p.expected()) {
            fail(format!(
                "final answer {:?}, expected {}: {}",
                a.status,
                p.expected(),
                a.body
            ));
            continue;
        }
        if since_restart > BOUND {
            fail(format!(
                "answered {} after the restart, more than {}",
                secs(since_restart),
                secs(BOUND)
            ));
        }
        let charges: Vec<_> = ledger
            .iter()
            .filter(|e| e.idempotency_key.as_deref() == Some(rec.provider_key.as_str()))
            .collect();
        if charges.len() != 1 {
            fail(format!("charged {} times: {charges:?}", charges.len()));
            continue;
        }
        let charge = charges[0];
        let before_crash = charged_at_crash.iter().any(|e| e.id == charge.id);
        if before_crash != (p.point != Point::Claimed) {
            fail(format!(
                "crash point not as planned: charged before the crash: {before_crash}"
            ));
        }
        if a.body["provider_id"] != charge.id.as_str() {
            fail(format!(
                "answer names {} but the fake charged {}",
                a.body["provider_id"], charge.id
            ));
        }
        let want_state = if p.declined {
            KeyState::Failed { retryable: false }
        } else {
            KeyState::Done
        };
        if rec.state != want_state {
            fail(format!("key ended {}, expected {want_state}", rec.state));
        }
        if p.declined {
            if a.body["error"] != "card_declined" || charge.status != "requires_payment_method" {
                fail(format!("not a decline: {} / {}", a.body, charge.status));
            }
        } else if a.body["amount"] != p.amount || charge.status != "succeeded" {
            fail(format!("wrong charge: {} / {:?}", a.body, charge));
        }
    }
    if ledger.len() != pays.len() {
        failures.push(format!(
            "the fake holds {} PaymentIntents for {} payments",
            ledger.len(),
            pays.len()
        ));
    }

    times.sort();
    let p50 = times.get(times.len().saturating_sub(1) / 2).copied();
    let max = times.last().copied();
    let how = if backend.url.is_some() {
        "idemflow reconcile --every 5s (CLI)"
    } else {
        "Sweeper::run every 5 s (in-process)"
    };
    println!(
        "fast recovery [{name}]: lease {lease:?}{}, {how}; crash -> restart {:.0} ms; \
         n={}, crash -> final answer p50 {}, max {}; wall {}",
        if settings.lease.is_none() {
            " (library default)"
        } else {
            ""
        },
        (restart - crash).as_secs_f64() * 1000.0,
        times.len(),
        p50.map_or("-".into(), secs),
        max.map_or("-".into(), secs),
        secs(wall.elapsed()),
    );
    println!(
        "  [{name}] reconciler sweeps after the crash (planned first at +{:.2} s): {}",
        sweep_at.as_secs_f64(),
        sweeps
            .iter()
            .map(|(at, line)| format!(
                "{} ({})",
                rel(*at, crash),
                line.split(':')
                    .nth(1)
                    .unwrap_or("")
                    .trim()
                    .split(',')
                    .next()
                    .unwrap_or("")
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut by_point: BTreeMap<Point, Vec<Duration>> = BTreeMap::new();
    for (p, a) in answers.values() {
        if a.status.is_some() {
            by_point.entry(p.point).or_default().push(a.at - crash);
        }
    }
    for (point, mut t) in by_point {
        t.sort();
        println!(
            "  [{name}] {}: {}",
            point.label(),
            t.iter().map(|d| secs(*d)).collect::<Vec<_>>().join(", ")
        );
    }
    for l in &lines {
        println!("  [{name}]{l}");
    }
    // The reconciler's log when something failed or looks wrong.
    let shown: Vec<&String> = reconciler_log
        .iter()
        .filter(|l| !failures.is_empty() || l.contains("WARN") || l.contains("ERROR"))
        .collect();
    if !shown.is_empty() {
        println!(
            "  [{name}] crash at {} (UTC); reconciler log:",
            crash_db.format("%H:%M:%S%.3f")
        );
        for l in shown {
            println!("    [{name}] {l}");
        }
    }
    assert!(
        failures.is_empty(),
        "[{name}] fast recovery failed:\n{}",
        failures.join("\n")
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("cards.db").display());
    run(Backend::by_url("sqlite", url)).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    use crate::support::postgres::{drop_schema, fresh_schema, url_in};
    let Some((admin, schema)) = fresh_schema().await else {
        return;
    };
    run(Backend::by_url("postgres", url_in(&admin, &schema))).await;
    drop_schema(&admin, &schema).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    use crate::support::mysql::{URL_VAR, drop_database, fresh_database};
    let Some((options, name)) = fresh_database().await else {
        return;
    };
    // The same server URL, naming the fresh database.
    let mut url = reqwest::Url::parse(&std::env::var(URL_VAR).unwrap()).unwrap();
    url.set_path(&format!("/{name}"));
    run(Backend::by_url("mysql", url.to_string())).await;
    drop_database(&options, &name).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    use idemflow::store::redis::{RedisConfig, RedisStore};
    let prefix = idemflow::conformance::unique("idemflow-fast");
    let p = prefix.clone();
    let Some(_) = crate::support::redis::store_with(|c| c.prefix(p)).await else {
        return;
    };
    let url = std::env::var(crate::support::redis::URL_VAR).unwrap();
    run(Backend {
        name: "redis",
        url: None,
        open: Arc::new(move || {
            let config = RedisConfig::new(url.clone()).prefix(prefix.clone());
            Box::pin(async move {
                Arc::new(RedisStore::connect_with(config).await.unwrap()) as Arc<dyn Store>
            })
        }),
    })
    .await;
}
