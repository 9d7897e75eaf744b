//! One schedule: the world a seed describes (keys, providers, executors, sweepers, an operator,
//! purge) and the scheduler that runs it one await point at a time, checking the invariants
//! after every step and at quiescence.

use idemflow::store::FinishMode;
use std::collections::BTreeSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemflow::store::Finish;
use idemflow::{
    Error, Idempotency, IdempotentRequest, KeyId, KeyState, Outcome, Provider, Providers, Store,
    StoreError, Sweeper, key::IdempotencyKey, key::Scope, record::Actor,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::atomic::AtomicSim;
use crate::checks::Check;
use crate::failover::Replica;
use crate::gate::{ACTOR, ActorCtx, Event, Point, Shared, SharedRef, decided, park};
use crate::provider::{Faults, SimProvider};
use crate::rng::Rng;
use crate::store::GatedStore;

/// How long one actor may run before the scheduler calls it stuck.
const STUCK_AFTER: Duration = Duration::from_secs(30);

/// One idempotency key of the schedule.
#[derive(Debug, Clone)]
pub struct KeyDef {
    pub label: String,
    pub id: KeyId,
    pub operation: &'static str,
    pub body: serde_json::Value,
    /// Index into the providers (0: keyed, 1: keyless).
    pub provider: usize,
    pub pk: String,
    pub role: Role,
    /// An atomic-phase step (`Context::atomic_step`, `crate::atomic`): its effect is its app row.
    pub local: bool,
    /// A single call served through the axum layer (`crate::http`, [`Mode::Http`]).
    pub http: bool,
    /// A queue's message delivered to a consumer (`crate::queue`, [`Mode::Queues`]).
    pub queued: bool,
    /// A queue's message whose consumer has no provider: its handler's effect is the
    /// application's own, recorded in `Shared::own_effects` ([`Mode::OwnEffects`]).
    pub own_effect: bool,
}

/// What a key is in the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A single call through its provider.
    Call,
    /// A workflow of two steps (`Context::call_step`): a keyed charge, then a keyless email. It
    /// never calls a provider itself; its provider index only picks its executor.
    Workflow,
    /// Step `.1` of the workflow key `.0` (an index into the keys).
    Step(usize, u32),
    /// A key run in one commit with its app row (`Idempotency::execute_atomic`, SQL backends,
    /// [`Mode::OneCommit`]): its effect is its app row, as an atomic step's.
    Local,
}

/// Which actors and faults a schedule may hold. Each later mode holds every earlier one's and
/// draws its additions from seed streams of their own, so a seed found in an earlier mode
/// replays its schedule there. Declared in that order ([`Mode::holds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    /// Single calls, sweepers, an operator and purge (issue 11).
    Classic,
    /// Also a workflow of two steps, atomic phases on the SQL backends and provider changes
    /// (issue 20).
    Workflows,
    /// Also resumers racing client retries, sweepers on the default lease ratio, dropped store
    /// connections and the liveness check (issue 20).
    Full,
    /// Also, on the SQL backends with atomic phases, a key run in one commit with its app row
    /// (`Idempotency::execute_atomic`, issue 23).
    OneCommit,
    /// Also webhooks: the providers' events for effects that happened, delivered late, twice
    /// or for keys long settled, to `Sweeper::settle_from_event` (issue 23's "webhooks settle
    /// stuck keys").
    Webhooks,
    /// Also clients that wait for the first attempt's answer (`Idempotency::wait_in_flight`,
    /// issue 24) instead of taking the in-flight answer at once, each with a bound of its own.
    Waiting,
    /// Also store outages (issue 24's "store down"): in some schedules the store goes down for a
    /// few steps, refusing every store call of every actor unrun (claims, finishes, releases,
    /// reads, lease renewals), then comes back.
    Outages,
    /// Also, on Redis, a failover that loses acknowledged writes (issue 24's Sentinel): in some
    /// schedules a replica's copy of the keys is taken at one step and promoted at a later one,
    /// so every write in between is lost ([`crate::failover`]).
    Failover,
    /// Also single calls served through the axum layer (`crate::http`, feature `axum`): a third
    /// of the single-call keys are posted with `Idempotency-Key` to a router whose layer is
    /// declared with the key's provider. What the simulation runs by default (on the backends
    /// other than Redis without the failovers: their commits are not lost).
    Http,
    /// Also queue deliveries (`crate::queue`): three in ten of the single-call keys not served
    /// through the layer are a queue's messages, delivered (and redelivered while the consumer
    /// says so) to a consumer declared with the key's provider, whose handler sends with
    /// `Context::send`.
    Queues,
    /// Also queue messages whose handler's effect is the application's own (a consumer without
    /// a provider): half the queue's messages. The handler records its effect keyed by the
    /// message (all or nothing, as `docs/consumers.md` asks of such an effect); nothing but a
    /// redelivery after the lease settles a run that crashed.
    OwnEffects,
    /// Also, in half the schedules, a keyed provider whose lookup needs the key's stored request
    /// (as Stripe's refunds and captures: which payment to read), so that a key stored without
    /// one (a queue's message, sent with `Context::send`; and, in half of those schedules, the
    /// single calls of an executor with `store_request(false)`) can only be looked up as "needs
    /// an operator"; at quiescence an operator settles what the sweeper reports so, from the
    /// provider's records, as on-call would.
    RequestLookups,
    /// Also, on SQLite, atomic phases stuck in a statement that never ends
    /// ([`crate::atomic::Fault::Stuck`]): the store's phase timeout interrupts it and the writer
    /// goes on. What the simulation runs by default.
    StuckStatements,
}

impl Mode {
    /// Whether the additions of `earlier` are on: each mode holds every earlier one's (the
    /// variants are declared in that order).
    fn holds(self, earlier: Mode) -> bool {
        self >= earlier
    }

    pub fn workflows(self) -> bool {
        self.holds(Mode::Workflows)
    }

    /// Whether the additions of [`Mode::Full`] are on.
    pub fn full(self) -> bool {
        self.holds(Mode::Full)
    }

    /// Whether the additions of [`Mode::OneCommit`] are on.
    pub fn one_commit(self) -> bool {
        self.holds(Mode::OneCommit)
    }

    /// Whether the additions of [`Mode::Webhooks`] are on.
    pub fn webhooks(self) -> bool {
        self.holds(Mode::Webhooks)
    }

    /// Whether the additions of [`Mode::Waiting`] are on.
    pub fn waiting(self) -> bool {
        self.holds(Mode::Waiting)
    }

    /// Whether the additions of [`Mode::Outages`] are on.
    pub fn outages(self) -> bool {
        self.holds(Mode::Outages)
    }

    /// Whether the additions of [`Mode::Failover`] are on (Redis only).
    pub fn failovers(self) -> bool {
        self.holds(Mode::Failover)
    }

    /// Whether the additions of [`Mode::Queues`] are on.
    pub fn queues(self) -> bool {
        self.holds(Mode::Queues)
    }

    /// Whether the additions of [`Mode::OwnEffects`] are on.
    pub fn own_effects(self) -> bool {
        self.holds(Mode::OwnEffects)
    }

    /// Whether the additions of [`Mode::RequestLookups`] are on.
    pub fn request_lookups(self) -> bool {
        self.holds(Mode::RequestLookups)
    }

    /// Whether the additions of [`Mode::StuckStatements`] are on.
    pub fn stuck_statements(self) -> bool {
        self.holds(Mode::StuckStatements)
    }
}

/// The additions of [`Mode::Full`], drawn from a stream of their own.
#[derive(Debug, Clone, Copy, Default)]
pub struct Extras {
    /// The sweeper's lease is the request lease times the library's ratio of defaults
    /// (`sweeper::DEFAULT_LEASE` over the executor's default lease): how a service that sets
    /// only the request lease runs. Otherwise it is drawn on its own (120-250 ms).
    pub default_sweeper_lease: bool,
    /// Sweepers carry a resumer for the workflows, racing their clients' retries.
    pub resumer: bool,
    /// Per mille of an actor's store calls under which the connection drops.
    pub store_faults: u64,
}

impl Extras {
    fn draw(seed: u64) -> Self {
        let mut r = Rng::new(seed ^ 0xE57A_A5E5);
        Self {
            default_sweeper_lease: r.chance(500),
            resumer: r.chance(500),
            store_faults: if r.chance(500) { r.range(20, 80) } else { 0 },
        }
    }
}

/// The schedule's settings, all drawn from the seed.
#[derive(Debug, Clone)]
pub struct Settings {
    pub lease: Duration,
    pub sweeper_lease: Duration,
    pub retention: Duration,
    pub window: Duration,
    pub pay_lag: Duration,
    pub mail_lag: Duration,
    pub margin: Duration,
    pub takeover: bool,
    /// Emulate the heartbeat of issue 11: the scheduler renews every lease a parked (not
    /// crashed) actor holds after each step and during each clock advance, so only crashes
    /// orphan keys. Off: leases are fixed, as today.
    pub heartbeat: bool,
    pub steps: usize,
    pub max_actors: usize,
    pub pay_faults: Faults,
    pub mail_faults: Faults,
}

impl Settings {
    fn draw(rng: &mut Rng) -> Self {
        let ms = Duration::from_millis;
        Self {
            lease: ms(rng.range(120, 250)),
            sweeper_lease: ms(rng.range(120, 250)),
            retention: ms(rng.range(50, 600)),
            window: ms(rng.range(700, 1400)),
            pay_lag: ms(rng.range(0, 150)),
            mail_lag: ms(rng.range(80, 400)),
            margin: ms(rng.range(40, 120)),
            takeover: rng.chance(500),
            heartbeat: rng.chance(500),
            steps: rng.range(15, 60) as usize,
            max_actors: rng.range(3, 6) as usize,
            pay_faults: Faults::draw(rng),
            mail_faults: Faults::draw(rng),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    /// A client of key `.0` that tries up to `.1` times in a row while the answer is "in flight",
    /// "unknown" or "retryable".
    Client(usize, u32),
    /// A sweeper (with a resumer for the workflows when [`Extras::resumer`]).
    Sweeper,
    Operator(usize),
    Purge,
    /// A webhook delivering the provider's event for effect #`.0` of the ledger
    /// ([`Mode::Webhooks`]); `.1`: whether the receiver names the key (else it scans).
    Webhook(u64, bool),
}

struct Slot {
    id: usize,
    kind: Kind,
    events: mpsc::UnboundedReceiver<Event>,
    handle: JoinHandle<()>,
    parked: Option<(Point, oneshot::Sender<()>)>,
    /// When it parked there.
    parked_since: std::time::Instant,
}

/// What a schedule ended with.
pub struct CaseResult {
    pub seed: u64,
    pub violations: Vec<crate::checks::Violation>,
    pub trace: Vec<String>,
    pub effects: usize,
    pub steps: usize,
    /// Takeovers during a live call whose holder's renewals could not get through (counted,
    /// not failed: `Shared::starved`).
    pub starved: usize,
    /// Violations on keys after such a takeover: outside the guarantee's assumptions, printed,
    /// not failed.
    pub excused: Vec<String>,
    /// Failovers that lost writes ([`Mode::Failover`]), and the keys they rolled back.
    pub failovers: usize,
    pub rolled_back: usize,
    /// Violations on rolled-back keys that a lossy failover explains (check, key, detail, why).
    pub lost_writes_excused: Vec<String>,
    /// Queue deliveries refused and dead-lettered (`crate::queue`).
    pub dead_lettered: u32,
}

struct World {
    rng: Rng,
    settings: Settings,
    keys: Vec<KeyDef>,
    shared: SharedRef,
    inner: Arc<dyn Store>,
    gated: Arc<dyn Store>,
    providers: [Arc<SimProvider>; 2],
    registry: Providers,
    executors: [Idempotency; 2],
    /// The executor of the workflow key and its steps: the schedule's lease and takeover
    /// window, a longer retention (a workflow is resumed only within its retention less a
    /// lease, so the schedules' 50-600 ms would rarely let one resume).
    workflow_exec: Idempotency,
    slots: Vec<Slot>,
    next_id: usize,
    /// Key labels that existed at the last check (to see purges).
    existed: BTreeSet<String>,
    /// The schedule's atomic phases (the SQL backends, with the new actors).
    atomic: Option<Arc<AtomicSim>>,
    /// The draws of the actors added with workflows (provider switches), apart from the main
    /// stream the regression seeds replay.
    alt: Option<Rng>,
    /// The draws of the webhooks ([`Mode::Webhooks`]), a stream of their own.
    hooks: Option<Rng>,
    /// The draws of the waiting clients ([`Mode::Waiting`]), a stream of their own.
    waits: Option<Rng>,
    /// The draws of the store's outages ([`Mode::Outages`], in the schedules that have them), a
    /// stream of their own.
    outages: Option<Rng>,
    /// The draws of the failovers ([`Mode::Failover`], Redis, in the schedules that have them)
    /// and the schedule's keys as a primary and its replica.
    failover: Option<(Rng, Replica)>,
    /// The replica's copy, when one was taken and not promoted yet: (step, copy).
    copy: Option<(usize, crate::failover::Copy)>,
    extras: Extras,
    /// The workflows' bodies by operation (for the resumers).
    workflows: Vec<(&'static str, Vec<KeyDef>)>,
    /// (actor, key label, token) whose emulated heartbeat failed: not renewed again.
    lost_leases: BTreeSet<(usize, String, i64)>,
    /// Key label -> its state and token at the last check (traced when it changes).
    states: std::collections::BTreeMap<String, String>,
    /// (check, label, generation) already reported, so a state is reported once.
    reported: BTreeSet<(Check, String, u32)>,
    /// At quiescence an operator settles the keys the sweeper reports as needing one
    /// ([`Mode::RequestLookups`]).
    operator_settles: bool,
}

fn key_id(scope: &str, key: &str) -> KeyId {
    KeyId::new(
        Scope::new(scope).expect("scope"),
        IdempotencyKey::new(key).expect("key"),
    )
}

impl World {
    /// The step keys of workflow key `k`, in order (empty for any other key).
    fn steps_of(&self, k: usize) -> Vec<KeyDef> {
        let mut steps: Vec<KeyDef> = self
            .keys
            .iter()
            .filter(|s| matches!(s.role, Role::Step(p, _) if p == k))
            .cloned()
            .collect();
        steps.sort_by_key(|s| match s.role {
            Role::Step(_, i) => i,
            _ => 0,
        });
        steps
    }

    /// The key a client of key `k` runs: a step's workflow, else `k`.
    fn client_key(&self, k: usize) -> usize {
        match self.keys[k].role {
            Role::Step(p, _) => p,
            _ => k,
        }
    }

    fn trace(&self, line: String) {
        self.shared.lock().unwrap().trace.push(line);
    }

    /// Every key's record as the store has it now (its debug form), in the order of `keys`.
    async fn records(&self) -> Result<Vec<Option<String>>, String> {
        let mut out = Vec::with_capacity(self.keys.len());
        for key in &self.keys {
            let rec = self
                .inner
                .get(&key.id)
                .await
                .map_err(|e| format!("get {}: {e}", key.label))?;
            out.push(rec.map(|r| format!("{r:?}")));
        }
        Ok(out)
    }

    fn violate(&self, check: Check, key: &str, detail: String) {
        self.shared.lock().unwrap().violate(check, key, detail);
    }

    fn describe(&self, kind: Kind) -> String {
        match kind {
            Kind::Client(k, tries) => {
                format!("client {} (up to {tries} tries)", self.keys[k].label)
            }
            Kind::Sweeper => "sweeper".into(),
            Kind::Operator(k) => format!("operator {}", self.keys[k].label),
            Kind::Purge => "purge".into(),
            Kind::Webhook(n, by_key) => format!(
                "webhook for effect #{n} ({})",
                if by_key { "key named" } else { "scan" }
            ),
        }
    }

    fn spawn(&mut self, kind: Kind) -> usize {
        let id = self.next_id;
        self.next_id += 1;
        let (tx, rx) = mpsc::unbounded_channel();
        let ctx = ActorCtx {
            id,
            events: tx.clone(),
        };
        let body = self.actor_body(kind);
        let shared = self.shared.clone();
        let handle = tokio::spawn(ACTOR.scope(ctx, async move {
            let summary = crate::gate::with_stall_probe(id, shared, body).await;
            let _ = tx.send(Event::Done(summary));
        }));
        self.slots.push(Slot {
            id,
            kind,
            events: rx,
            handle,
            parked: None,
            parked_since: std::time::Instant::now(),
        });
        id
    }

    fn actor_body(&mut self, kind: Kind) -> std::pin::Pin<Box<dyn Future<Output = String> + Send>> {
        match kind {
            Kind::Client(k, tries) => {
                // A client may retry through the other provider (a failover between attempts).
                let switches: Vec<bool> = match (&mut self.alt, self.keys[k].role) {
                    (Some(alt), Role::Call) => (0..tries).map(|_| alt.chance(150)).collect(),
                    _ => vec![false; tries as usize],
                };
                let atomic = self.atomic.clone();
                let exec = match self.keys[k].role {
                    Role::Workflow => self.workflow_exec.clone(),
                    _ => self.executors[self.keys[k].provider].clone(),
                };
                // Some clients wait for the first attempt's answer, each up to its own bound.
                let wait = match (&mut self.waits, self.keys[k].role) {
                    (Some(w), Role::Call | Role::Workflow) => w
                        .chance(WAITING_PER_MILLE)
                        .then(|| Duration::from_millis(w.range(20, 400))),
                    _ => None,
                };
                let exec = exec.wait_in_flight(wait);
                let key = self.keys[k].clone();
                let provider = self.providers[self.keys[k].provider].clone();
                let shared = self.shared.clone();
                let steps = self.steps_of(k);
                let providers = self.providers.clone();
                let gated = self.gated.clone();
                Box::pin(async move {
                    let mut said = Vec::new();
                    for switch in switches {
                        let (summary, again) = if key.role == Role::Local {
                            match &atomic {
                                Some(sim) => {
                                    local_client(exec.clone(), key.clone(), sim, shared.clone())
                                        .await
                                }
                                None => ("no atomic phases in this schedule".to_owned(), false),
                            }
                        } else if key.role == Role::Workflow {
                            workflow_client(
                                exec.clone(),
                                key.clone(),
                                steps.clone(),
                                providers.clone(),
                                atomic.clone(),
                                shared.clone(),
                            )
                            .await
                        } else if key.queued {
                            // The consumer is declared with one provider: no switch.
                            crate::queue::client(
                                exec.clone(),
                                key.clone(),
                                provider.clone(),
                                gated.clone(),
                                shared.clone(),
                            )
                            .await
                        } else if key.http {
                            // The layer is declared with one provider: no switch.
                            crate::http::client(
                                exec.clone(),
                                key.clone(),
                                provider.clone(),
                                shared.clone(),
                            )
                            .await
                        } else {
                            let provider = if switch {
                                providers[1 - key.provider].clone()
                            } else {
                                provider.clone()
                            };
                            let (summary, again) =
                                client(exec.clone(), key.clone(), provider, shared.clone()).await;
                            if switch {
                                (
                                    format!("via {}: {summary}", providers[1 - key.provider].name),
                                    again,
                                )
                            } else {
                                (summary, again)
                            }
                        };
                        said.push(summary);
                        if !again {
                            break;
                        }
                    }
                    match wait {
                        Some(bound) => format!("(waits up to {bound:?}) {}", said.join("; ")),
                        None => said.join("; "),
                    }
                })
            }
            Kind::Sweeper => {
                let sweeper = self.sweeper(self.gated.clone(), "sweeper");
                let shared = self.shared.clone();
                Box::pin(async move {
                    match sweeper.run_once().await {
                        Ok(r) => format!("sweep: {}", r.summary()),
                        Err(idemflow::sweeper::SweepError::Store { source, .. })
                            if crate::store::injected(&source) =>
                        {
                            format!("sweep stopped: {source}")
                        }
                        Err(e) => {
                            shared.lock().unwrap().violate(
                                Check::NoStoreErrors,
                                "-",
                                format!("sweep: {e}"),
                            );
                            format!("sweep failed: {e}")
                        }
                    }
                })
            }
            Kind::Operator(k) => Box::pin(operator(
                self.gated.clone(),
                self.keys[k].clone(),
                self.shared.clone(),
            )),
            Kind::Webhook(n, by_key) => {
                let sweeper = self.sweeper(self.gated.clone(), "webhook");
                let shared = self.shared.clone();
                let keys = self.keys.clone();
                Box::pin(webhook(sweeper, n, by_key, keys, shared))
            }
            Kind::Purge => {
                let store = self.gated.clone();
                let shared = self.shared.clone();
                Box::pin(async move {
                    match store.purge_expired(100).await {
                        Ok(n) => format!("purged {n}"),
                        Err(e) => {
                            shared.lock().unwrap().violate(
                                Check::NoStoreErrors,
                                "-",
                                format!("purge: {e}"),
                            );
                            format!("purge failed: {e}")
                        }
                    }
                })
            }
        }
    }

    fn sweeper(&self, store: Arc<dyn Store>, owner: &str) -> Sweeper {
        let s = &self.settings;
        let mut sweeper = Sweeper::new(store, self.registry.clone())
            .owner(owner)
            .batch_size(2)
            .lease(s.sweeper_lease)
            .backoff(Duration::from_millis(5), Duration::from_millis(20))
            .operator_recheck(Duration::from_millis(20))
            .redrive_margin(s.margin)
            .call_timeout(Duration::from_secs(60))
            // A run takes keys until none is due; with the simulation's 5-20 ms backoff, a key
            // it deferred is due again before a loaded machine finishes the next batch, so a run
            // is bounded (`SweeperConfig::max_keys_per_run`; the final sweeps loop anyway).
            .max_keys_per_run(8);
        if self.extras.resumer {
            for (operation, steps) in &self.workflows {
                let (steps, providers, atomic) =
                    (steps.clone(), self.providers.clone(), self.atomic.clone());
                sweeper = sweeper.resumer(*operation, self.workflow_exec.clone(), move |ctx| {
                    run_workflow(ctx, steps.clone(), providers.clone(), atomic.clone())
                });
            }
        }
        sweeper
    }

    /// Lets actor `id` run to its next park point (or to its end).
    async fn run_actor(&mut self, idx: usize) -> Result<(), String> {
        let slot = &mut self.slots[idx];
        if let Some((_, resume)) = slot.parked.take() {
            let _ = resume.send(());
        }
        let ev = tokio::time::timeout(STUCK_AFTER, slot.events.recv()).await;
        let line = match ev {
            Ok(Some(Event::Parked { point, resume })) => {
                let l = format!("    a{} parked at {point}", slot.id);
                slot.parked = Some((point, resume));
                slot.parked_since = std::time::Instant::now();
                l
            }
            Ok(Some(Event::Done(summary))) => {
                let l = format!("    a{} done: {summary}", slot.id);
                let id = slot.id;
                {
                    let mut sh = self.shared.lock().unwrap();
                    sh.holding.retain(|(a, _), _| *a != id);
                    sh.renewing.retain(|(a, _), _| *a != id);
                    sh.ticked.remove(&id);
                }
                let slot = self.slots.remove(idx);
                let _ = slot.handle.await;
                l
            }
            Ok(None) => {
                let slot = self.slots.remove(idx);
                let r = slot.handle.await;
                format!("    a{} ended without a word: {r:?}", slot.id)
            }
            Err(_) => {
                return Err(format!(
                    "actor a{} ran {STUCK_AFTER:?} without reaching an await point",
                    slot.id
                ));
            }
        };
        self.trace(line);
        Ok(())
    }

    async fn crash(&mut self, idx: usize) {
        let slot = self.slots.remove(idx);
        slot.handle.abort();
        let _ = slot.handle.await;
        let id = slot.id;
        {
            let mut sh = self.shared.lock().unwrap();
            sh.holding.retain(|(a, _), _| *a != id);
            sh.renewing.retain(|(a, _), _| *a != id);
            sh.ticked.remove(&id);
            sh.last_disruption = Some(std::time::Instant::now());
            sh.kill(id);
        }
        let at = slot
            .parked
            .as_ref()
            .map_or_else(|| "?".to_owned(), |(p, _)| p.to_string());
        self.trace(format!("    a{} crashed at {at}", slot.id));
    }

    /// The emulated heartbeat: renews every lease a live actor holds.
    async fn heartbeat(&mut self) {
        if !self.settings.heartbeat {
            return;
        }
        {
            // The store is down: no renewal gets through (each is tried again next step).
            let sh = self.shared.lock().unwrap();
            if sh.store_down.is_some() && !sh.healthy {
                return;
            }
        }
        let holdings: Vec<((usize, String), i64)> = {
            let sh = self.shared.lock().unwrap();
            sh.holding
                .iter()
                .map(|(k, (t, _))| (k.clone(), *t))
                .collect()
        };
        for ((actor, label), token) in holdings {
            if self.lost_leases.contains(&(actor, label.clone(), token)) {
                continue;
            }
            let Some(slot) = self.slots.iter().find(|s| s.id == actor) else {
                continue;
            };
            let lease = match slot.kind {
                Kind::Sweeper => self.settings.sweeper_lease,
                _ => self.settings.lease,
            };
            let Some(key) = self.keys.iter().find(|k| k.label == label) else {
                continue;
            };
            let r = self
                .inner
                .extend(&key.id, idemflow::record::LeaseToken(token), lease)
                .await;
            // A failed renewal keeps the holding as it was: if the actor's provider call still
            // acts, `no_effect_outside_lease` names the lost lease.
            if let Ok(exp) = r {
                let mut sh = self.shared.lock().unwrap();
                sh.holding.insert((actor, label.clone()), (token, exp));
            } else {
                self.trace(format!(
                    "    heartbeat of a{actor} on {label} failed: {r:?}"
                ));
                self.lost_leases.insert((actor, label, token));
            }
        }
    }

    /// Requests in transit reach the provider before the clock moves: an actor parked at
    /// `provider.call:before` (its last check passed, the request not yet at the provider) is
    /// resumed first. This is the one timing the simulation assumes: the time from an actor's
    /// last check (`Context::may_send`, the sweeper's window check) to the provider receiving
    /// the request is shorter than the margins sized for it (re-drive margin, search lag); see
    /// docs/reliability.md, "What the guarantee assumes". A crash can still lose the request.
    ///
    /// Before a clock advance every request in transit is delivered; at the start of every
    /// other step, those in transit for [`MAX_TRANSIT`] or more (steps take real time too).
    async fn deliver_in_transit(&mut self, older_than: Duration) -> Result<(), String> {
        while let Some(idx) = self.slots.iter().position(|s| {
            s.parked_since.elapsed() >= older_than
                && s.parked
                    .as_ref()
                    .is_some_and(|(p, _)| p.what == "provider.call" && p.phase == "before")
        }) {
            let id = self.slots[idx].id;
            self.trace(format!(
                "    a{id}'s request reaches the provider before the clock moves"
            ));
            self.run_actor(idx).await?;
        }
        Ok(())
    }

    /// Sleeps `d` (after delivering requests in transit), renewing leases along the way when
    /// the heartbeat is emulated.
    async fn advance(&mut self, d: Duration) -> Result<(), String> {
        self.deliver_in_transit(Duration::ZERO).await?;
        let chunk = (self.settings.lease.min(self.settings.sweeper_lease) / 3)
            .max(Duration::from_millis(5));
        let mut left = d;
        while !left.is_zero() {
            let now = left.min(chunk);
            tokio::time::sleep(now).await;
            left -= now;
            self.heartbeat().await;
        }
        Ok(())
    }

    /// The invariants that hold after every step.
    async fn check(&mut self) {
        for k in 0..self.keys.len() {
            let key = self.keys[k].clone();
            let rec = match self.inner.get(&key.id).await {
                Ok(r) => r,
                Err(e) => {
                    self.violate(Check::NoStoreErrors, &key.label, format!("get: {e}"));
                    continue;
                }
            };
            let Some(rec) = rec else {
                if self.existed.remove(&key.label) {
                    self.states.remove(&key.label);
                    let mut sh = self.shared.lock().unwrap();
                    *sh.generations.entry(key.label.clone()).or_default() += 1;
                    sh.purged_since_grant.insert(key.label.clone());
                    sh.trace.push(format!("    {} purged", key.label));
                }
                continue;
            };
            self.existed.insert(key.label.clone());
            let now_state = format!("{} token {}", rec.state, rec.lease_token);
            if self.states.get(&key.label) != Some(&now_state) {
                self.trace(format!("    {} is {now_state}", key.label));
                self.states.insert(key.label.clone(), now_state);
            }
            if key.role == Role::Workflow {
                // A workflow acts only through its steps, which are checked as keys of their own.
                continue;
            }
            if key.local {
                // An atomic phase acts only on the database: its app row, checked below.
                self.check_atomic_step(&key).await;
                continue;
            }
            if key.own_effect {
                // Its handler acts on no provider: its effect is recorded by the run.
                let recorded = self
                    .shared
                    .lock()
                    .unwrap()
                    .own_effects
                    .contains_key(&key.label);
                if rec.state == KeyState::Done && !recorded {
                    let generation = self.shared.lock().unwrap().generation(&key.label);
                    self.report(
                        Check::AckedAfterItsOwnEffect,
                        &key.label,
                        generation,
                        "done with no run of its handler recorded".into(),
                    );
                }
                continue;
            }
            let (generation, effects, any) = {
                let sh = self.shared.lock().unwrap();
                let g = sh.generation(&key.label);
                let eff: Vec<_> = sh.effects(&key.label, g).into_iter().cloned().collect();
                let any: Vec<_> = sh
                    .ledger
                    .iter()
                    .filter(|e| e.label == key.label)
                    .cloned()
                    .collect();
                (g, eff, any)
            };
            // A rolled-back key whose keyed provider acted under two provider keys within its
            // dedup window: the claim that chose the first was lost, and the next drew another
            // (finding 11). Past the window the provider would have acted again anyway.
            let rekeyed = effects.len() > 1 && {
                let sh = self.shared.lock().unwrap();
                sh.rolled_back.contains_key(&key.label)
                    && effects.iter().any(|e| {
                        let Some(window) = sh
                            .provider_windows
                            .get(e.provider.as_str())
                            .copied()
                            .flatten()
                        else {
                            return false;
                        };
                        effects.iter().any(|f| {
                            f.provider == e.provider
                                && f.provider_key != e.provider_key
                                && (f.at - e.at).to_std().is_ok_and(|d| d < window)
                        })
                    })
            };
            if rekeyed {
                self.report(
                    Check::ProviderKeyKeptAcrossLostWrites,
                    &key.label,
                    generation,
                    format!(
                        "the provider acted {} times, under provider keys {:?}",
                        effects.len(),
                        effects
                            .iter()
                            .map(|e| format!("#{} {} {}", e.n, e.provider, e.provider_key))
                            .collect::<Vec<_>>()
                    ),
                );
            } else if effects.len() > 1 {
                self.report(
                    Check::AtMostOneEffect,
                    &key.label,
                    generation,
                    format!(
                        "the provider acted {} times: effects {:?}",
                        effects.len(),
                        effects
                            .iter()
                            .map(|e| format!("#{} for {}", e.n, e.label))
                            .collect::<Vec<_>>()
                    ),
                );
            }
            if decided(rec.state) {
                match &rec.response {
                    Some(r) if any.iter().any(|e| &e.response == r) => {}
                    Some(r) => self.report(
                        Check::DoneMatchesAnEffect,
                        &key.label,
                        generation,
                        format!(
                            "{} stores {} {} which no effect answered",
                            rec.state,
                            r.status(),
                            String::from_utf8_lossy(r.body())
                        ),
                    ),
                    None => self.report(
                        Check::DoneMatchesAnEffect,
                        &key.label,
                        generation,
                        format!("{} without a stored response", rec.state),
                    ),
                }
            }
            if rec.state == (KeyState::Failed { retryable: true }) && !effects.is_empty() {
                let by = match self.inner.history(&key.id).await {
                    Ok(h) => h
                        .iter()
                        .rev()
                        .find(|e| e.to == Some(KeyState::Failed { retryable: true }))
                        .map(|e| (e.actor, e.reason.clone().unwrap_or_default())),
                    Err(_) => None,
                };
                let (check, why) = match by {
                    Some((Actor::Sweeper, r)) => (Check::SweeperNeverRetryableAfterEffect, r),
                    Some((Actor::Operator, r)) => (Check::OperatorNeverRetryableAfterEffect, r),
                    Some((_, r)) => (Check::WorkerNeverRetryableAfterEffect, r),
                    None => (Check::WorkerNeverRetryableAfterEffect, String::new()),
                };
                self.report(
                    check,
                    &key.label,
                    generation,
                    format!(
                        "failed{{retryable}} although effect #{} happened: {why}",
                        effects[0].n
                    ),
                );
            }
        }
    }

    /// The app's row of an atomic phase exists exactly when its step is `done` (read with the
    /// step's row in one statement).
    async fn check_atomic_step(&mut self, key: &KeyDef) {
        let Some(sim) = self.atomic.clone() else {
            return;
        };
        let generation = self.shared.lock().unwrap().generation(&key.label);
        match crate::atomic::step_rows(&sim.db.read, &key.id).await {
            Ok(Some((state, token, rows))) => {
                let expected = i64::from(state == "done" && !sim.read_only(&key.label, token));
                if rows != expected {
                    self.report(
                        Check::AtomicRowsIffDone,
                        &key.label,
                        generation,
                        format!(
                            "the step is {state} (token {token}) with {rows} app rows under its answer's token"
                        ),
                    );
                }
            }
            Ok(None) => {}
            Err(e) => self.violate(Check::NoStoreErrors, &key.label, format!("app rows: {e}")),
        }
    }

    /// At quiescence, on the atomic phases' database: every phase's caller was told what
    /// committed (its app row), every other caller of its batches too (their notes); then the
    /// acknowledged keys are decided, and, for a file, all of it holds again after the file is
    /// reopened (a new process).
    async fn check_atomic_at_end(&mut self) {
        if let Some(sim) = self.atomic.clone() {
            sim.settle().await;
            self.check_told(&sim, &sim.db.read.clone(), "").await;
            if let Some(url) = sim.db.url.clone() {
                match sqlx::SqlitePool::connect(&url).await {
                    Ok(fresh) => {
                        let fresh = crate::atomic::AppPool::Sqlite(fresh);
                        self.check_told(&sim, &fresh, " after reopening the file")
                            .await;
                        for k in self.keys.clone().iter().filter(|k| k.local) {
                            if let (Ok(a), Ok(b)) = (
                                crate::atomic::step_rows(&sim.db.read, &k.id).await,
                                crate::atomic::step_rows(&fresh, &k.id).await,
                            ) && let Some((state, token, rows)) = &b
                                && *rows
                                    != i64::from(
                                        state == "done" && !sim.read_only(&k.label, *token),
                                    )
                            {
                                let g = self.shared.lock().unwrap().generation(&k.label);
                                self.report(
                                    Check::AtomicRowsIffDone,
                                    &k.label,
                                    g,
                                    format!("after reopening: {state} (token {token}) with {rows} app rows (before: {a:?})"),
                                );
                            }
                        }
                        fresh.close().await;
                    }
                    Err(e) => self.violate(Check::NoStoreErrors, "-", format!("reopen: {e}")),
                }
            }
        }
        self.check_acked().await;
    }

    async fn check_told(&mut self, sim: &AtomicSim, pool: &crate::atomic::AppPool, when: &str) {
        let told = sim.told.lock().unwrap().clone();
        for t in told {
            let Some(committed) = t.committed else {
                continue;
            };
            let committed = committed && !sim.read_only(&t.label, t.token);
            match crate::atomic::row_there(pool, &t.label, t.token).await {
                Ok(there) if there != committed => self.violate(
                    Check::ToldWhatCommitted,
                    &t.label,
                    format!(
                        "the phase of token {} was told \"{}\" but its app row is {}{when}",
                        t.token,
                        t.what,
                        if there { "there" } else { "absent" }
                    ),
                ),
                Ok(_) => {}
                Err(e) => self.violate(Check::NoStoreErrors, &t.label, format!("app row: {e}")),
            }
        }
        let notes = sim.notes.lock().unwrap().clone();
        for (id, ok) in notes {
            match crate::atomic::note_there(pool, &id).await {
                Ok(there) if there != ok => self.violate(
                    Check::ToldWhatCommitted,
                    "-",
                    format!(
                        "a write batched with a phase was told {} but its row is {}{when}",
                        if ok { "it committed" } else { "it failed" },
                        if there { "there" } else { "absent" }
                    ),
                ),
                Ok(_) => {}
                Err(e) => self.violate(Check::NoStoreErrors, "-", format!("note: {e}")),
            }
        }
    }

    /// Every key a client was told an answer for (in the key's current generation) is decided,
    /// in the store and, for a file, after reopening it: the same state and token.
    async fn check_acked(&mut self) {
        let fresh = match self.atomic.as_ref().and_then(|a| a.db.url.clone()) {
            Some(url) => match idemflow::store::sqlite::SqliteStore::connect(&url).await {
                Ok(s) => Some(s),
                Err(e) => {
                    self.violate(Check::NoStoreErrors, "-", format!("reopen: {e}"));
                    None
                }
            },
            None => None,
        };
        let acked = self.shared.lock().unwrap().acked.clone();
        for k in self.keys.clone() {
            let Ok(now) = self.inner.get(&k.id).await else {
                continue;
            };
            let generation = self.shared.lock().unwrap().generation(&k.label);
            let after = match &fresh {
                Some(f) => match f.get(&k.id).await {
                    Ok(r) => Some(r),
                    Err(e) => {
                        self.violate(Check::NoStoreErrors, &k.label, format!("reopened get: {e}"));
                        continue;
                    }
                },
                None => None,
            };
            let seen = |r: &Option<idemflow::record::KeyRecord>| {
                r.as_ref().map(|r| (r.state, r.lease_token.0))
            };
            if let Some(after) = &after
                && seen(after) != seen(&now)
            {
                self.report(
                    Check::AckedWriteSurvivesReopen,
                    &k.label,
                    generation,
                    format!(
                        "the store says {:?}, the reopened file {:?}",
                        seen(&now),
                        seen(after)
                    ),
                );
            }
            if acked.get(&k.label) == Some(&generation) {
                let last = after.unwrap_or(now);
                if !last.as_ref().is_some_and(|r| decided(r.state)) {
                    self.report(
                        Check::AckedWriteSurvivesReopen,
                        &k.label,
                        generation,
                        format!(
                            "a client was told an answer, but the key is {:?}{}",
                            seen(&last),
                            if fresh.is_some() {
                                " after reopening the file"
                            } else {
                                ""
                            }
                        ),
                    );
                }
            }
        }
    }

    /// Sweeps (every 10 ms) until no key is processing or `until` has passed; returns the keys
    /// still processing with their state. A workflow counts only when the sweepers resume
    /// workflows and its resumption window (its retention less a lease, `docs/workflows.md`) is
    /// still open; otherwise it waits for its client's retry or an operator, by design.
    async fn sweep_until_settled(
        &mut self,
        sweeper: &Sweeper,
        until: std::time::Instant,
    ) -> Vec<(String, String)> {
        loop {
            match sweeper.run_once().await {
                Ok(report) if self.operator_settles => {
                    // On-call settles what the sweeper hands over, from the provider's records.
                    for u in report
                        .unresolved
                        .iter()
                        .filter(|u| u.kind == idemflow::sweeper::Unresolved::NeedsOperator)
                    {
                        let Some(key) = self
                            .keys
                            .iter()
                            .find(|k| k.id.scope.as_str() == u.scope && k.id.key.as_str() == u.key)
                            .cloned()
                        else {
                            continue;
                        };
                        let label = key.label.clone();
                        let done = operator(self.gated.clone(), key, self.shared.clone()).await;
                        self.trace(format!("end: operator settles {label}: {done}"));
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    self.violate(Check::NoStoreErrors, "-", format!("final sweep: {e}"));
                }
            }
            self.redeliver_own_effects().await;
            self.check().await;
            let mut open = Vec::new();
            for k in &self.keys {
                let Ok(Some(r)) = self.inner.get(&k.id).await else {
                    continue;
                };
                if r.state != KeyState::Processing {
                    continue;
                }
                if k.role == Role::Workflow {
                    let window = chrono::Duration::milliseconds(r.retention_ms)
                        - chrono::Duration::from_std(self.settings.lease).unwrap_or_default()
                        - chrono::Duration::seconds(1);
                    if !self.extras.resumer || chrono::Utc::now() >= r.created_at + window {
                        continue;
                    }
                }
                open.push((
                    k.label.clone(),
                    format!(
                        "processing (token {}, owner {:?}, lease until {:?}, next check {:?})",
                        r.lease_token, r.lease_owner, r.lease_expires_at, r.next_check_at
                    ),
                ));
            }
            if open.is_empty() || std::time::Instant::now() >= until {
                return open;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The broker redelivers each message whose handler acts on no provider and whose run's
    /// lease ran out: nothing else settles its key (the sweeper has nobody to ask).
    async fn redeliver_own_effects(&mut self) {
        for k in self.keys.clone().iter().filter(|k| k.own_effect) {
            let Ok(Some(r)) = self.inner.get(&k.id).await else {
                continue;
            };
            let expired = r.lease_expires_at.is_some_and(|e| e <= chrono::Utc::now());
            if r.state != KeyState::Processing || !expired {
                continue;
            }
            let (summary, _) = crate::queue::client(
                self.executors[k.provider].clone(),
                k.clone(),
                self.providers[k.provider].clone(),
                self.gated.clone(),
                self.shared.clone(),
            )
            .await;
            self.trace(format!("end: {} redelivered: {summary}", k.label));
        }
    }

    fn report(&mut self, check: Check, label: &str, generation: u32, detail: String) {
        if self.reported.insert((check, label.to_owned(), generation)) {
            self.violate(check, label, detail);
        }
    }

    /// The final invariants: after the hangs end, the provider heals and sweepers settle.
    async fn quiesce(&mut self) -> Result<(), String> {
        // End every hang: resume to completion, or crash.
        while !self.slots.is_empty() {
            if self.rng.chance(500) {
                self.trace(format!("end: crash a{}", self.slots[0].id));
                self.crash(0).await;
            } else {
                let id = self.slots[0].id;
                self.trace(format!("end: run a{id} to completion"));
                let mut n = 0;
                while self.slots.first().is_some_and(|s| s.id == id) {
                    self.run_actor(0).await?;
                    self.heartbeat().await;
                    n += 1;
                    if n > 500 {
                        return Err(format!("a{id} did not finish in 500 steps"));
                    }
                }
            }
            self.check().await;
        }
        {
            // The end of the schedule: the store is back, for good.
            let mut sh = self.shared.lock().unwrap();
            sh.healthy = true;
            if sh.store_down.take().is_some() {
                let now = std::time::Instant::now();
                if let Some(last) = sh.outages.last_mut() {
                    last.1 = Some(now);
                }
                sh.last_disruption = Some(now);
                sh.trace.push("the store is back".to_owned());
            }
        }
        // Liveness: a key orphaned by the last crash (or dropped connection) is free once the
        // lease its dead holder held runs out: the request lease, or the sweeper's where this
        // schedule sets it apart from the defaults' ratio. Then one search lag for a lookup, and
        // a request lease plus a second of slack for the sweeps themselves (a loaded machine).
        let s = self.settings.clone();
        let lag = s.pay_lag.max(s.mail_lag);
        let holder = if self.extras.default_sweeper_lease {
            s.lease
        } else {
            s.lease.max(s.sweeper_lease)
        };
        let start = std::time::Instant::now();
        let deadline = start + holder + lag + s.lease + Duration::from_secs(1);
        let wait = holder + lag + Duration::from_millis(10);
        self.trace(format!(
            "end: provider healthy; sleep {wait:?}, then sweep until settled (every key within {:?})",
            deadline - start
        ));
        tokio::time::sleep(wait).await;
        let sweeper = self.sweeper(self.gated.clone(), "final-sweeper");
        let open = self.sweep_until_settled(&sweeper, deadline).await;
        if !open.is_empty() {
            let since = self
                .shared
                .lock()
                .unwrap()
                .last_disruption
                .map_or_else(|| "-".to_owned(), |t| format!("{:?}", t.elapsed()));
            for (label, state) in &open {
                let generation = self.shared.lock().unwrap().generation(label);
                self.report(
                    Check::SettlesWithinALeaseOfTheLastCrash,
                    label,
                    generation,
                    format!(
                        "still {state} {:?} after the faults ended ({since} after the last crash)",
                        start.elapsed()
                    ),
                );
            }
            // Let the rest settle for the checks that follow.
            tokio::time::sleep(s.sweeper_lease.max(s.lease) + lag).await;
            let later = std::time::Instant::now() + Duration::from_secs(2);
            self.sweep_until_settled(&sweeper, later).await;
        }
        // Every client retries once more (a workflow's client for its steps).
        for k in 0..self.keys.len() {
            let key = self.keys[k].clone();
            let (summary, _) = match key.role {
                Role::Step(..) => continue,
                Role::Workflow => {
                    workflow_client(
                        self.workflow_exec.clone(),
                        key.clone(),
                        self.steps_of(k),
                        self.providers.clone(),
                        self.atomic.clone(),
                        self.shared.clone(),
                    )
                    .await
                }
                Role::Call if key.queued => {
                    crate::queue::client(
                        self.executors[key.provider].clone(),
                        key.clone(),
                        self.providers[key.provider].clone(),
                        self.gated.clone(),
                        self.shared.clone(),
                    )
                    .await
                }
                Role::Call if key.http => {
                    crate::http::client(
                        self.executors[key.provider].clone(),
                        key.clone(),
                        self.providers[key.provider].clone(),
                        self.shared.clone(),
                    )
                    .await
                }
                Role::Call => {
                    client(
                        self.executors[key.provider].clone(),
                        key.clone(),
                        self.providers[key.provider].clone(),
                        self.shared.clone(),
                    )
                    .await
                }
                Role::Local => match self.atomic.clone() {
                    Some(sim) => {
                        local_client(
                            self.executors[key.provider].clone(),
                            key.clone(),
                            &sim,
                            self.shared.clone(),
                        )
                        .await
                    }
                    None => continue,
                },
            };
            self.trace(format!("end: client {} retries: {summary}", key.label));
        }
        self.check().await;
        for k in 0..self.keys.len() {
            let key = self.keys[k].clone();
            let Ok(Some(rec)) = self.inner.get(&key.id).await else {
                continue;
            };
            let generation = self.shared.lock().unwrap().generation(&key.label);
            let acted = !self
                .shared
                .lock()
                .unwrap()
                .effects(&key.label, generation)
                .is_empty();
            if acted && !decided(rec.state) {
                self.report(
                    Check::EffectSettlesAtQuiescence,
                    &key.label,
                    generation,
                    format!("the provider acted but the key ends {}", rec.state),
                );
            }
        }
        self.check_atomic_at_end().await;
        Ok(())
    }
}

/// A client: runs the key's request through its provider once. Returns what it got and
/// whether a client would try again.
async fn client(
    exec: Idempotency,
    key: KeyDef,
    provider: Arc<SimProvider>,
    shared: SharedRef,
) -> (String, bool) {
    let req = match IdempotentRequest::new(
        key.id.scope.as_str(),
        key.id.key.as_str(),
        key.operation,
        &key.body,
    ) {
        Ok(r) => r,
        Err(e) => return (format!("bad request: {e}"), false),
    };
    let r = exec.call(req, provider.as_ref() as &dyn Provider).await;
    let mut sh = shared.lock().unwrap();
    match r {
        Ok(ex) => {
            let resp = ex.response().clone();
            let pk = resp
                .body_json::<serde_json::Value>()
                .ok()
                .and_then(|v| v.get("pk").and_then(|p| p.as_str().map(str::to_owned)));
            // The first row's provider key, or the one a re-created row sent.
            let ours = pk
                .as_deref()
                .is_some_and(|pk| pk == key.pk || sh.labels.get(pk) == Some(&key.label));
            if !ours {
                sh.violate(
                    Check::ScopesIsolated,
                    &key.label,
                    format!("got a response for provider key {pk:?}"),
                );
            }
            sh.acknowledged(&key.label, &resp);
            let said = format!(
                "{} {}",
                if ex.is_replay() {
                    "replayed"
                } else {
                    "executed"
                },
                resp.status()
            );
            (said, false)
        }
        Err(e @ Error::FingerprintMismatch { .. }) => {
            sh.violate(Check::ScopesIsolated, &key.label, e.to_string());
            (format!("error: {e}"), false)
        }
        Err(Error::Store(e)) if !expected(&e) => {
            sh.violate(Check::NoStoreErrors, &key.label, e.to_string());
            (format!("store error: {e}"), false)
        }
        Err(
            e @ (Error::InFlight { .. }
            | Error::OutcomeUnknown { .. }
            | Error::FailedRetryable { .. }),
        ) => (format!("error: {e}"), true),
        Err(e) => (format!("error: {e}"), false),
    }
}

/// A one-commit key's client: runs `execute_atomic` with the key's phase (its app row) once.
/// Returns what it got and whether a client would try again.
async fn local_client(
    exec: Idempotency,
    key: KeyDef,
    sim: &Arc<AtomicSim>,
    shared: SharedRef,
) -> (String, bool) {
    let req = match IdempotentRequest::new(
        key.id.scope.as_str(),
        key.id.key.as_str(),
        key.operation,
        &key.body,
    ) {
        Ok(r) => r,
        Err(e) => return (format!("bad request: {e}"), false),
    };
    let r = exec.execute_atomic(req, sim.phase(&key.label)).await;
    let mut sh = shared.lock().unwrap();
    match r {
        Ok(ex) => {
            let resp = ex.response().clone();
            sh.acknowledged(&key.label, &resp);
            let how = if ex.is_replay() {
                "replayed"
            } else {
                "executed"
            };
            (format!("one commit {how} {}", resp.status()), false)
        }
        Err(e @ Error::FingerprintMismatch { .. }) => {
            sh.violate(Check::ScopesIsolated, &key.label, e.to_string());
            (format!("error: {e}"), false)
        }
        // The server killed the phase's connection after its writes: nothing committed, the
        // client is told it does not know (as after any lost connection) and tries again.
        Err(Error::Store(e)) if !expected(&e) && sim.killed_late(&key.label) => {
            (format!("store error (a killed connection): {e}"), true)
        }
        Err(Error::Store(e)) if !expected(&e) => {
            sh.violate(Check::NoStoreErrors, &key.label, e.to_string());
            (format!("store error: {e}"), false)
        }
        Err(e @ (Error::InFlight { .. } | Error::RolledBack { .. })) => {
            (format!("error: {e}"), true)
        }
        Err(e) => (format!("error: {e}"), false),
    }
}

/// A workflow's client: runs the workflow (its steps through their providers with
/// `Context::call_step`) once. Returns what it got and whether a client would try again.
async fn workflow_client(
    exec: Idempotency,
    key: KeyDef,
    steps: Vec<KeyDef>,
    providers: [Arc<SimProvider>; 2],
    atomic: Option<Arc<AtomicSim>>,
    shared: SharedRef,
) -> (String, bool) {
    let req = match IdempotentRequest::new(
        key.id.scope.as_str(),
        key.id.key.as_str(),
        key.operation,
        &key.body,
    ) {
        Ok(r) => r.workflow(),
        Err(e) => return (format!("bad request: {e}"), false),
    };
    let r = exec
        .execute(req, move |ctx| {
            run_workflow(ctx, steps.clone(), providers.clone(), atomic.clone())
        })
        .await;
    let mut sh = shared.lock().unwrap();
    match r {
        Ok(ex) => {
            let resp = ex.response().clone();
            sh.acknowledged(&key.label, &resp);
            let said = if ex.is_replay() {
                "replayed"
            } else {
                "executed"
            };
            (format!("workflow {said} {}", resp.status()), false)
        }
        Err(e @ Error::FingerprintMismatch { .. }) => {
            sh.violate(Check::ScopesIsolated, &key.label, e.to_string());
            (format!("error: {e}"), false)
        }
        Err(Error::Store(e)) if !expected(&e) => {
            sh.violate(Check::NoStoreErrors, &key.label, e.to_string());
            (format!("store error: {e}"), false)
        }
        Err(
            e @ (Error::InFlight { .. }
            | Error::OutcomeUnknown { .. }
            | Error::FailedRetryable { .. }),
        ) => (format!("error: {e}"), true),
        Err(e) => (format!("error: {e}"), false),
    }
}

/// The workflow's body, for its client and for a sweeper's resumer alike: its steps in order
/// (an atomic phase or a provider call each), answering with their answers.
async fn run_workflow(
    ctx: idemflow::Context,
    steps: Vec<KeyDef>,
    providers: [Arc<SimProvider>; 2],
    atomic: Option<Arc<AtomicSim>>,
) -> Outcome {
    let mut answers = Vec::new();
    for s in &steps {
        let step = match idemflow::workflow::Step::new(s.operation, &s.body) {
            Ok(step) => step,
            Err(e) => return Outcome::unknown(format!("bad step: {e}")),
        };
        let ran = match (&atomic, s.local) {
            (Some(sim), true) => ctx.atomic_step(step, sim.phase(&s.label)).await,
            _ => {
                ctx.call_step(step, providers[s.provider].as_ref() as &dyn Provider)
                    .await
            }
        };
        match ran {
            Ok(ex) => answers.push(String::from_utf8_lossy(ex.response().body()).into_owned()),
            Err(e) => return Outcome::from_step_error(&e),
        }
    }
    match idemflow::StoredResponse::json(201, &serde_json::json!({"steps": answers})) {
        Ok(r) => Outcome::Succeeded(r),
        Err(e) => Outcome::unknown(format!("cannot encode: {e}")),
    }
}

/// A store error the schedule expects: a fenced-out write, or a connection the simulation
/// dropped.
fn expected(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::LeaseLost { .. } | StoreError::NotFound { .. }
    ) || crate::store::injected(e)
}

/// An operator resolving a stuck key as `idemflow resolve` does (read, check, write), deciding
/// from the provider's dashboard (the ledger, without search lag): done with its answer, or
/// failed{retryable} when it shows nothing.
/// A webhook: the provider's event for effect #`n` of the ledger (what the provider did, as its
/// lookup would find it), given to `Sweeper::settle_from_event`, the key named (`by_key`, the
/// key whose label the provider key belongs to) or found by a scan of the processing keys.
async fn webhook(
    sweeper: idemflow::Sweeper,
    n: u64,
    by_key: bool,
    keys: Vec<KeyDef>,
    shared: SharedRef,
) -> String {
    use idemflow::sweeper::{EventTarget, ProviderEvent};
    let Some(effect) = shared
        .lock()
        .unwrap()
        .ledger
        .iter()
        .find(|e| e.n == n)
        .cloned()
    else {
        return format!("no effect #{n}");
    };
    let outcome = if effect.response.status() < 300 {
        Outcome::Succeeded(effect.response.clone())
    } else {
        Outcome::Rejected(effect.response.clone())
    };
    let event = ProviderEvent::new(
        effect.provider.clone(),
        effect.provider_key.clone(),
        outcome,
        format!("evt_{n}"),
    );
    let named = keys
        .iter()
        .find(|k| k.label == effect.label)
        .map(|k| k.id.clone());
    let target = match (&named, by_key) {
        (Some(id), true) => EventTarget::Key(id),
        _ => EventTarget::ScanProcessing { limit: 1000 },
    };
    match sweeper.settle_from_event(target, &event).await {
        Ok(r) => format!(
            "event for {} ({}): {r:?}",
            effect.label, effect.provider_key
        ),
        Err(e) if crate::store::injected(&e) => format!("event stopped: {e}"),
        Err(e) => {
            shared.lock().unwrap().violate(
                Check::NoStoreErrors,
                &effect.label,
                format!("webhook: {e}"),
            );
            format!("event failed: {e}")
        }
    }
}

async fn operator(store: Arc<dyn Store>, key: KeyDef, shared: SharedRef) -> String {
    let current = match store.get(&key.id).await {
        Ok(Some(r)) => r,
        Ok(None) => return "no such key".into(),
        Err(e) => return format!("get failed: {e}"),
    };
    let expired = current
        .lease_expires_at
        .is_some_and(|e| e <= chrono::Utc::now());
    if current.state != KeyState::Processing || !expired {
        return format!("left alone ({}, lease expired: {expired})", current.state);
    }
    let seen = {
        let sh = shared.lock().unwrap();
        let g = sh.generation(&key.label);
        sh.effects(&key.label, g)
            .first()
            .map(|e| e.response.clone())
    };
    let (to, response) = match seen {
        Some(r) if r.status() < 300 => (KeyState::Done, Some(r)),
        Some(r) => (KeyState::Failed { retryable: false }, Some(r)),
        None => (KeyState::Failed { retryable: true }, None),
    };
    let finish = Finish {
        to,
        response,
        error: Some("resolved by an operator: sim".into()),
        actor: Actor::Operator,
        reason: "operator: sim".into(),
    };
    park("operator.resolve", "decided", &key.label).await;
    // As `idemflow resolve` does: only while the key is still as read.
    match store
        .finish_as(
            &key.id,
            FinishMode::OverrideIf(current.lease_token),
            &finish,
        )
        .await
    {
        Ok(rec) => {
            let from = store
                .history(&key.id)
                .await
                .ok()
                .and_then(|h| h.into_iter().rev().find(|e| e.actor == Actor::Operator))
                .and_then(|e| e.from);
            if from.is_some_and(|f| f != KeyState::Processing) {
                shared.lock().unwrap().violate(
                    Check::ResolveNeverOverwritesADecision,
                    &key.label,
                    format!(
                        "resolve read processing, then overwrote {} with {to}",
                        from.map_or("-".into(), |f| f.to_string())
                    ),
                );
            }
            format!("resolved -> {}", rec.state)
        }
        Err(e) => format!("resolve failed: {e}"),
    }
}

impl Shared {
    /// A client of `label` was told `resp`: the key is acknowledged in the generation the
    /// client's claim (or one-commit phase) saw, and a replay must equal that generation's first
    /// answer.
    pub fn acknowledged(&mut self, label: &str, resp: &idemflow::StoredResponse) {
        let g = self.told_settled(label);
        let first = self.first_response(label, g, resp);
        if first != *resp {
            self.violate(
                Check::ReplaysIdentical,
                label,
                format!(
                    "got {} {} after {} {}",
                    resp.status(),
                    String::from_utf8_lossy(resp.body()),
                    first.status(),
                    String::from_utf8_lossy(first.body())
                ),
            );
        }
    }

    /// A client of `label` was told the key is settled (a queue delivery's acknowledgement,
    /// which carries no answer to compare; [`acknowledged`](Self::acknowledged) with one): the
    /// key counts as told an answer in the generation the client's claim saw. Returns that
    /// generation.
    pub fn told_settled(&mut self, label: &str) -> u32 {
        let g = crate::gate::current_actor()
            .and_then(|a| self.claimed_in.get(&(a, label.to_owned())).copied())
            .unwrap_or_else(|| self.generation(label));
        self.acked.insert(label.to_owned(), g);
        g
    }

    /// The first response a client of (label, generation) got, recording `resp` if none yet.
    pub fn first_response(
        &mut self,
        label: &str,
        generation: u32,
        resp: &idemflow::StoredResponse,
    ) -> idemflow::StoredResponse {
        self.responses
            .entry((label.to_owned(), generation))
            .or_insert_with(|| resp.clone())
            .clone()
    }
}

/// Runs the schedule `seed` against `store` (migrated, empty, used by this schedule only).
/// `mode`: which actors and faults the schedule may hold (a regression seed replays the schedule
/// it was found with in the mode it was found in).
pub async fn run_case(
    seed: u64,
    store: Arc<dyn Store>,
    app: Option<crate::atomic::Db>,
    replica: Option<Replica>,
    mode: Mode,
) -> CaseResult {
    let with_workflows = mode.workflows();
    let mut rng = Rng::new(seed);
    let mut settings = Settings::draw(&mut rng);
    let extras = if mode.full() {
        Extras::draw(seed)
    } else {
        Extras::default()
    };
    if extras.default_sweeper_lease {
        let request = Idempotency::new(store.clone()).config().lease;
        settings.sweeper_lease = settings
            .lease
            .mul_f64(idemflow::sweeper::DEFAULT_LEASE.as_secs_f64() / request.as_secs_f64());
    }
    let shared: SharedRef = Arc::new(Mutex::new(Shared {
        shortest_lease: settings.lease.min(settings.sweeper_lease),
        ..Shared::default()
    }));
    // The stall probe: how late this process's runtime runs a 5 ms timer (`renewals_starved`).
    let probe = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let tick = Duration::from_millis(5);
            loop {
                let t = std::time::Instant::now();
                tokio::time::sleep(tick).await;
                let late = t.elapsed().saturating_sub(tick);
                if late >= Duration::from_millis(10) {
                    let mut sh = shared.lock().unwrap();
                    sh.stalls.push((std::time::Instant::now(), late));
                }
            }
        })
    };
    let mut lookups = Rng::new(seed ^ REQUEST_LOOKUP_STREAM);
    let (needs_request, unstored) = if mode.request_lookups() {
        (lookups.chance(500), lookups.chance(500))
    } else {
        (false, false)
    };
    let pay = Arc::new(SimProvider {
        name: "simpay",
        lookup_needs_request: needs_request,
        window: Some(settings.window),
        search_lag: settings.pay_lag,
        faults: settings.pay_faults,
        rng: Mutex::new(rng.fork()),
        shared: shared.clone(),
    });
    let mail = Arc::new(SimProvider {
        name: "simmail",
        lookup_needs_request: false,
        window: None,
        search_lag: settings.mail_lag,
        faults: settings.mail_faults,
        rng: Mutex::new(rng.fork()),
        shared: shared.clone(),
    });
    {
        let mut sh = shared.lock().unwrap();
        for p in [&pay, &mail] {
            sh.provider_windows.insert(p.name, p.window);
        }
    }
    let registry = Providers::new()
        .with(pay.clone() as Arc<dyn Provider>)
        .with(mail.clone() as Arc<dyn Provider>);
    // Few keys, two scopes that reuse key names.
    let mut keys: Vec<KeyDef> = Vec::new();
    let n_keys = rng.range(2, 4) as usize;
    while keys.len() < n_keys {
        let scope = ["a", "b"][rng.below(2) as usize];
        let key = format!("k{}", rng.range(1, 2));
        let label = format!("{scope}/{key}");
        if keys.iter().any(|k| k.label == label) {
            continue;
        }
        let provider = rng.below(2) as usize;
        let operation = ["charge", "email.send"][provider];
        let id = key_id(scope, &key);
        let spec = [&pay, &mail][provider].key_spec();
        let pk = spec.derive(&id.scope, &id.key, operation);
        keys.push(KeyDef {
            label,
            id,
            operation,
            body: serde_json::json!({"amount": rng.range(1, 12)}),
            provider,
            pk,
            role: Role::Call,
            local: false,
            http: false,
            queued: false,
            own_effect: false,
        });
    }
    // With the layer, a third of the single calls are served through it (a stream of its own).
    if mode.holds(Mode::Http) && cfg!(feature = "axum") {
        let mut h = Rng::new(seed ^ HTTP_STREAM);
        for k in &mut keys {
            k.http = h.chance(HTTP_PER_MILLE);
        }
    }
    // With queues, three in ten of the single calls not served through the layer are a queue's
    // messages (a stream of their own): the consumer's operation, and the provider key derived
    // from it.
    if mode.queues() {
        let mut q = Rng::new(seed ^ QUEUE_STREAM);
        for k in keys.iter_mut().filter(|k| !k.http) {
            if q.chance(QUEUE_PER_MILLE) {
                let spec = [&pay, &mail][k.provider].key_spec();
                k.queued = true;
                k.operation = idemflow::consumer::OPERATION;
                k.pk = spec.derive(&k.id.scope, &k.id.key, k.operation);
            }
        }
    }
    // With own effects, half the queue's messages go to a consumer without a provider (a
    // stream of their own).
    if mode.own_effects() {
        let mut o = Rng::new(seed ^ OWN_EFFECT_STREAM);
        for k in keys.iter_mut().filter(|k| k.queued) {
            k.own_effect = o.chance(OWN_EFFECT_PER_MILLE);
        }
    }
    // Half the schedules hold a workflow of two steps: a keyed charge, then a keyless email
    // (drawn apart from the main stream, which the regression seeds replay unchanged).
    let mut wf_rng = Rng::new(seed ^ 0x5EED_F10E);
    let workflow_retention = Duration::from_millis(wf_rng.range(500, 1500));
    if with_workflows && wf_rng.chance(500) {
        let scope = ["a", "b"][rng.below(2) as usize];
        let id = key_id(scope, "w1");
        let parent = keys.len();
        keys.push(KeyDef {
            label: format!("{scope}/w1"),
            id: id.clone(),
            operation: "checkout",
            body: serde_json::json!({"order": rng.range(1, 12)}),
            provider: rng.below(2) as usize,
            pk: String::new(),
            role: Role::Workflow,
            local: false,
            http: false,
            queued: false,
            own_effect: false,
        });
        for (position, (operation, provider)) in
            [("charge", 0), ("email.send", 1)].into_iter().enumerate()
        {
            let step = idemflow::workflow::step_key(&id, position as u32);
            let spec = [&pay, &mail][provider].key_spec();
            let pk = spec.derive(&step.scope, &step.key, operation);
            keys.push(KeyDef {
                label: format!("{}/{}", step.scope, step.key),
                id: step,
                operation,
                body: serde_json::json!({"amount": rng.range(1, 12)}),
                provider,
                pk,
                role: Role::Step(parent, position as u32),
                local: false,
                http: false,
                queued: false,
                own_effect: false,
            });
        }
    }
    // On the SQL backends, some schedules hold a workflow whose first step is an atomic phase
    // (its app row in `sim_orders`), then a keyed charge (`crate::atomic`; drawn apart too).
    let mut at_rng = Rng::new(seed ^ ATOMIC_STREAM);
    let atomic = match &app {
        Some(db) if with_workflows && at_rng.chance(ATOMIC_PER_MILLE) => {
            let _file = at_rng.chance(FILE_PER_MILLE);
            let scope = ["a", "b"][at_rng.below(2) as usize];
            let id = key_id(scope, "w2");
            let parent = keys.len();
            keys.push(KeyDef {
                label: format!("{scope}/w2"),
                id: id.clone(),
                operation: "order",
                body: serde_json::json!({"order": at_rng.range(1, 12)}),
                provider: 0,
                pk: String::new(),
                role: Role::Workflow,
                local: false,
                http: false,
                queued: false,
                own_effect: false,
            });
            for (position, (operation, provider, local)) in
                [("order.record", 0, true), ("charge", 0, false)]
                    .into_iter()
                    .enumerate()
            {
                let step = idemflow::workflow::step_key(&id, position as u32);
                let label = format!("{}/{}", step.scope, step.key);
                let pk = if local {
                    format!("local:{label}")
                } else {
                    pay.key_spec().derive(&step.scope, &step.key, operation)
                };
                keys.push(KeyDef {
                    label,
                    id: step,
                    operation,
                    body: serde_json::json!({"amount": at_rng.range(1, 12)}),
                    provider,
                    pk,
                    role: Role::Step(parent, position as u32),
                    local,
                    http: false,
                    queued: false,
                    own_effect: false,
                });
            }
            // With one commit, a key run by `execute_atomic` too (drawn from a stream of its
            // own, so the schedules of the earlier modes stay as they were).
            let mut oc_rng = Rng::new(seed ^ ONE_COMMIT_STREAM);
            if mode.one_commit() && oc_rng.chance(ONE_COMMIT_PER_MILLE) {
                let scope = ["a", "b"][oc_rng.below(2) as usize];
                let label = format!("{scope}/l1");
                keys.push(KeyDef {
                    pk: format!("local:{label}"),
                    label,
                    id: key_id(scope, "l1"),
                    operation: "order.local",
                    body: serde_json::json!({"amount": oc_rng.range(1, 12)}),
                    provider: 0,
                    role: Role::Local,
                    local: true,
                    http: false,
                    queued: false,
                    own_effect: false,
                });
            }
            Some(Arc::new(AtomicSim::new(
                db.clone(),
                at_rng.fork(),
                shared.clone(),
                mode.stuck_statements(),
            )))
        }
        _ => None,
    };
    let alt = with_workflows.then(|| Rng::new(seed ^ 0xA17E_F0DE));
    let hooks = mode.webhooks().then(|| Rng::new(seed ^ WEBHOOK_STREAM));
    let waits = mode.waiting().then(|| Rng::new(seed ^ WAIT_STREAM));
    let outages = mode
        .outages()
        .then(|| Rng::new(seed ^ OUTAGE_STREAM))
        .and_then(|mut r| r.chance(OUTAGE_SCHEDULES_PER_MILLE).then_some(r));
    let failover = replica
        .filter(|_| mode.failovers())
        .map(|replica| (Rng::new(seed ^ FAILOVER_STREAM), replica))
        .and_then(|(mut r, replica)| {
            r.chance(FAILOVER_SCHEDULES_PER_MILLE)
                .then_some((r, replica))
        });
    {
        let mut sh = shared.lock().unwrap();
        for k in keys.iter().filter(|k| k.role != Role::Workflow) {
            sh.labels.insert(k.pk.clone(), k.label.clone());
            if k.queued {
                // What the consumer's handler sends: the message's body.
                sh.requests.insert(k.pk.clone(), k.body.clone());
            }
            if k.role == Role::Call {
                // The provider key the other provider would send (a client's failover).
                let other = [&pay, &mail][1 - k.provider].key_spec();
                let pk = other.derive(&k.id.scope, &k.id.key, k.operation);
                sh.labels.insert(pk, k.label.clone());
            }
        }
    }
    let gated: Arc<dyn Store> = Arc::new(GatedStore {
        inner: store.clone(),
        shared: shared.clone(),
        faults: (extras.store_faults > 0).then(|| crate::store::StoreFaults {
            per_mille: extras.store_faults,
            rng: Mutex::new(Rng::new(seed ^ 0xD5_0FF5)),
        }),
    });
    let exec = |takeover: Option<Duration>, owner: &str| {
        Idempotency::new(gated.clone())
            .lease(settings.lease)
            .retention(settings.retention)
            .retry_takeover_window(takeover)
            .owner(owner)
    };
    let takeover = settings
        .takeover
        .then(|| settings.window.saturating_sub(settings.margin));
    // The keyless provider's executor gets the same takeover window: a call through it (direct
    // or through the layer) must never be taken over, since its provider does not dedupe by
    // key (the window is capped at the provider's, none: `Idempotency::call`, and the layer
    // declared with the provider).
    let executors = [
        exec(takeover, "worker-pay").store_request(!unstored),
        exec(takeover, "worker-mail"),
    ];
    let workflow_exec = exec(takeover, "worker-flow").retention(workflow_retention);
    let mut w = World {
        rng,
        extras,
        workflows: Vec::new(),
        settings: settings.clone(),
        keys,
        shared: shared.clone(),
        inner: store.clone(),
        gated,
        providers: [pay, mail],
        registry,
        executors,
        workflow_exec,
        slots: Vec::new(),
        next_id: 1,
        existed: BTreeSet::new(),
        hooks,
        atomic,
        alt,
        waits,
        outages,
        failover,
        copy: None,
        states: std::collections::BTreeMap::new(),
        lost_leases: BTreeSet::new(),
        reported: BTreeSet::new(),
        operator_settles: mode.request_lookups(),
    };
    w.workflows = (0..w.keys.len())
        .filter(|&k| w.keys[k].role == Role::Workflow)
        .map(|k| (w.keys[k].operation, w.steps_of(k)))
        .collect();
    w.trace(format!("seed {seed} ({mode:?}): {settings:?}"));
    if mode.full() {
        w.trace(format!("{extras:?}"));
    }
    for k in &w.keys {
        w.trace(format!(
            "key {} via {} body {} (provider key {}){}",
            k.label,
            ["simpay (keyed)", "simmail (keyless)"][k.provider],
            k.body,
            k.pk,
            if k.own_effect {
                ", a queue's message with its own effect"
            } else if k.queued {
                ", a queue's message"
            } else if k.http {
                ", through the HTTP layer"
            } else {
                ""
            }
        ));
    }
    let outcome = run_steps(&mut w).await;
    let outcome = match outcome {
        Ok(()) => w.quiesce().await,
        Err(e) => Err(e),
    };
    // Abort and wait for every actor left, so none touches the store after the schedule (the
    // store is emptied and reused by the next schedule on this slot).
    for slot in w.slots.drain(..) {
        // A queue consumer's runs go on in tasks of their own: they make no more calls either.
        w.shared.lock().unwrap().kill(slot.id);
        slot.handle.abort();
        let _ = slot.handle.await;
    }
    if let Err(e) = outcome {
        w.violate(Check::NoStoreErrors, "-", format!("scheduler: {e}"));
    }
    probe.abort();
    let mut sh = shared.lock().unwrap();
    CaseResult {
        starved: sh.starved.len(),
        excused: std::mem::take(&mut sh.excused),
        failovers: sh.failovers,
        rolled_back: sh.rolled_back.len(),
        lost_writes_excused: std::mem::take(&mut sh.lost_writes_excused),
        seed,
        violations: std::mem::take(&mut sh.violations),
        trace: std::mem::take(&mut sh.trace),
        effects: sh.ledger.len(),
        steps: settings.steps,
        dead_lettered: sh.dead_lettered.values().sum(),
    }
}

/// The seed stream of the atomic-phase workflow, how often a schedule holds one (per mille), and
/// how often such a schedule runs on a file database (with the second process's faults).
const ATOMIC_STREAM: u64 = 0xA70_41C5;
/// (A file schedule costs about three in memory: the file is created and migrated, reopened at
/// the end, and its second connection's faults wait out busy timeouts.)
const ATOMIC_PER_MILLE: u64 = 150;
const FILE_PER_MILLE: u64 = 350;
/// The seed stream of the one-commit key, and how often an atomic-phase schedule holds one (per
/// mille, [`Mode::OneCommit`]).
const ONE_COMMIT_STREAM: u64 = 0x0C0_33A7;
const ONE_COMMIT_PER_MILLE: u64 = 600;
/// The seed stream of the keys served through the axum layer ([`Mode::Http`]), and how many
/// single-call keys in a thousand are.
const HTTP_STREAM: u64 = 0x4771_9A7E;
const HTTP_PER_MILLE: u64 = 350;
/// The seed stream of the queue deliveries ([`Mode::Queues`]), and how many single-call keys in
/// a thousand not served through the layer are.
const QUEUE_STREAM: u64 = 0x0C0E_0E5D;
const QUEUE_PER_MILLE: u64 = 300;
/// The seed stream of the queue messages whose effect is the application's own
/// ([`Mode::OwnEffects`]), and how many queue messages in a thousand are.
const OWN_EFFECT_STREAM: u64 = 0x0E1F_EC75;
const OWN_EFFECT_PER_MILLE: u64 = 500;
/// The seed stream of [`Mode::RequestLookups`]: whether the keyed provider's lookup needs the
/// stored request, and whether the keyed provider's executor stores none (each in half the
/// schedules).
const REQUEST_LOOKUP_STREAM: u64 = 0x0E00_57ED;

/// The seed stream of the waiting clients ([`Mode::Waiting`]), and how many clients in a
/// thousand wait for the first attempt's answer.
const WAIT_STREAM: u64 = 0x3A17_1F17;
const WAITING_PER_MILLE: u64 = 400;

/// The seed stream of the store's outages ([`Mode::Outages`]); how many schedules in a thousand
/// have them; how often, per mille of the steps, the store goes down when up, and comes back
/// when down (a few steps, each of which may advance the clock past leases).
const OUTAGE_STREAM: u64 = 0x0D0_3E5D;
const OUTAGE_SCHEDULES_PER_MILLE: u64 = 300;
const OUTAGE_START_PER_MILLE: u64 = 60;
const OUTAGE_END_PER_MILLE: u64 = 300;

/// With outages, sometimes: the store goes down, or comes back.
fn toggle_outage(w: &mut World, step: usize) {
    let Some(r) = w.outages.as_mut() else {
        return;
    };
    let now = std::time::Instant::now();
    let down = w.shared.lock().unwrap().store_down.is_some();
    let line = if !down && r.chance(OUTAGE_START_PER_MILLE) {
        let mut sh = w.shared.lock().unwrap();
        sh.store_down = Some(now);
        sh.outages.push((now, None));
        sh.last_disruption = Some(now);
        format!("#{step} the store goes down")
    } else if down && r.chance(OUTAGE_END_PER_MILLE) {
        let mut sh = w.shared.lock().unwrap();
        sh.store_down = None;
        if let Some(last) = sh.outages.last_mut() {
            last.1 = Some(now);
        }
        sh.last_disruption = Some(now);
        format!("#{step} the store is back")
    } else {
        return;
    };
    w.trace(line);
}

/// The seed stream of the failovers ([`Mode::Failover`]); how many Redis schedules in a
/// thousand have them; how often, per mille of the steps, the replica's copy is taken when none
/// is held, and promoted when one is (a few steps of writes lost each time).
const FAILOVER_STREAM: u64 = 0x0FA1_10E5;
const FAILOVER_SCHEDULES_PER_MILLE: u64 = 400;
const FAILOVER_SYNC_PER_MILLE: u64 = 80;
const FAILOVER_PROMOTE_PER_MILLE: u64 = 200;

/// With failovers, sometimes: the replica's copy is taken, or promoted (every write since the
/// copy lost). The keys whose record the promotion changed are rolled back: the checks a lossy
/// failover cannot keep are excused on them from then on ([`crate::gate::Shared::violate`]).
// Without Redis, `Replica` has no value: everything after its clone is unreachable.
#[cfg_attr(not(feature = "redis"), allow(unused_variables, unreachable_code))]
async fn toggle_failover(w: &mut World, step: usize) -> Result<(), String> {
    let Some((r, replica)) = w.failover.as_mut() else {
        return Ok(());
    };
    let replica = replica.clone();
    if w.copy.is_none() {
        if r.chance(FAILOVER_SYNC_PER_MILLE) {
            let copy = replica.sync().await?;
            w.trace(format!("#{step} the replica syncs ({} keys)", copy.len()));
            w.copy = Some((step, copy));
        }
        return Ok(());
    }
    if !r.chance(FAILOVER_PROMOTE_PER_MILLE) {
        return Ok(());
    }
    let (synced, copy) = w.copy.take().expect("a copy is held");
    let before = w.records().await?;
    let restored = replica.promote(&copy).await?;
    let after = w.records().await?;
    let now = std::time::Instant::now();
    let mut lost = Vec::new();
    {
        let mut sh = w.shared.lock().unwrap();
        sh.failovers += 1;
        sh.last_disruption = Some(now);
        for (k, key) in w.keys.iter().enumerate() {
            if before[k] == after[k] {
                continue;
            }
            lost.push(key.label.clone());
            // Keyless (and a workflow, which holds a keyless step): a re-run acts again.
            let window = (key.role != Role::Workflow && !key.local)
                .then(|| w.providers[key.provider].window)
                .flatten();
            sh.rolled_back.insert(key.label.clone(), window);
            let generation = sh.generation(&key.label);
            sh.rolled_back_in.insert(key.label.clone(), generation);
        }
    }
    for (k, key) in w.keys.iter().enumerate() {
        if after[k].is_none() {
            // Its life since the copy is lost, not purged: the same generation goes on.
            w.existed.remove(&key.label);
            w.states.remove(&key.label);
        }
    }
    w.trace(format!(
        "#{step} failover: the replica synced at #{synced} is promoted ({restored} keys); \
         writes lost on {lost:?}"
    ));
    Ok(())
}

/// The seed stream of the webhooks ([`Mode::Webhooks`]), and how often a step delivers one (per
/// mille of the steps, when the ledger holds an effect).
const WEBHOOK_STREAM: u64 = 0x3EB_400C;
const WEBHOOK_PER_MILLE: u64 = 80;

/// Whether schedule `seed` runs on a SQLite file (an atomic-phase schedule drawn for a file).
pub fn on_file(seed: u64) -> bool {
    let mut r = Rng::new(seed ^ ATOMIC_STREAM);
    r.chance(ATOMIC_PER_MILLE) && r.chance(FILE_PER_MILLE)
}

/// The longest a request stays in transit while other steps run: below the smallest re-drive
/// margin (40 ms) and the keyless provider's smallest search lag (80 ms).
const MAX_TRANSIT: Duration = Duration::from_millis(20);

/// With webhooks, sometimes: an actor delivering the provider's event for an effect of the
/// ledger (any: recent, old, already delivered), run to its first park point.
async fn deliver_webhook(w: &mut World, step: usize) -> Result<(), String> {
    let effects = w.shared.lock().unwrap().ledger.len() as u64;
    let can_spawn = w.slots.len() < w.settings.max_actors;
    let Some(hooks) = w.hooks.as_mut() else {
        return Ok(());
    };
    if effects == 0 || !can_spawn || !hooks.chance(WEBHOOK_PER_MILLE) {
        return Ok(());
    }
    let kind = Kind::Webhook(hooks.range(1, effects), hooks.chance(500));
    let id = w.next_id;
    w.trace(format!("#{step} start a{id}: {}", w.describe(kind)));
    w.spawn(kind);
    let idx = w.slots.len() - 1;
    w.run_actor(idx).await
}

async fn run_steps(w: &mut World) -> Result<(), String> {
    for step in 0..w.settings.steps {
        w.shared.lock().unwrap().step = step;
        w.deliver_in_transit(MAX_TRANSIT).await?;
        toggle_outage(w, step);
        toggle_failover(w, step).await?;
        deliver_webhook(w, step).await?;
        let parked = w.slots.len();
        let can_spawn = parked < w.settings.max_actors;
        // spawn client, sweeper, operator, purge, resume, crash, advance time, sweep at once
        let weights = [
            if can_spawn { 30 } else { 0 },
            if can_spawn { 6 } else { 0 },
            if can_spawn { 2 } else { 0 },
            if can_spawn { 3 } else { 0 },
            if parked > 0 { 40 } else { 0 },
            if parked > 0 { 7 } else { 0 },
            8,
            4,
        ];
        match w.rng.weighted(&weights) {
            7 => {
                let id = w.next_id;
                w.trace(format!("#{step} start a{id}: sweeper, run to completion"));
                w.spawn(Kind::Sweeper);
                let mut n = 0;
                while w.slots.last().is_some_and(|s| s.id == id) {
                    let idx = w.slots.len() - 1;
                    w.run_actor(idx).await?;
                    w.heartbeat().await;
                    n += 1;
                    if n > 500 {
                        return Err(format!("a{id} did not finish in 500 steps"));
                    }
                }
            }
            a @ 0..=3 => {
                let kind = match a {
                    0 => {
                        let k = w.rng.below(w.keys.len() as u64) as usize;
                        Kind::Client(w.client_key(k), w.rng.range(1, 3) as u32)
                    }
                    1 => Kind::Sweeper,
                    2 => Kind::Operator(w.rng.below(w.keys.len() as u64) as usize),
                    _ => Kind::Purge,
                };
                let id = w.next_id;
                w.trace(format!("#{step} start a{id}: {}", w.describe(kind)));
                w.spawn(kind);
                let idx = w.slots.len() - 1;
                w.run_actor(idx).await?;
            }
            4 => {
                let idx = w.rng.below(parked as u64) as usize;
                w.trace(format!(
                    "#{step} resume a{} ({})",
                    w.slots[idx].id,
                    w.describe(w.slots[idx].kind)
                ));
                w.run_actor(idx).await?;
            }
            5 => {
                let idx = w.rng.below(parked as u64) as usize;
                w.trace(format!(
                    "#{step} crash a{} ({})",
                    w.slots[idx].id,
                    w.describe(w.slots[idx].kind)
                ));
                w.crash(idx).await;
            }
            _ => {
                let s = &w.settings;
                let choices = [
                    s.lease + Duration::from_millis(5),
                    s.pay_lag.max(s.mail_lag) + Duration::from_millis(5),
                    s.retention + Duration::from_millis(5),
                    s.window.saturating_sub(s.margin),
                    Duration::from_millis(10),
                ];
                let d = choices[w.rng.weighted(&[40, 20, 15, 5, 20])];
                w.trace(format!("#{step} advance {d:?}"));
                w.advance(d).await?;
            }
        }
        w.heartbeat().await;
        w.check().await;
    }
    Ok(())
}
