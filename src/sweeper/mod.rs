#![cfg_attr(feature = "sqlite", doc = include_str!("../../docs/operations.md"))]
#![cfg_attr(
    not(feature = "sqlite"),
    doc = "The recovery sweeper: settles keys left `processing` by a worker that crashed, timed \
           out or lost the provider's answer, from the provider's own records. Its guide, \
           `docs/operations.md`, is rendered here when the feature `sqlite` is on, as on \
           docs.rs."
)]

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::{Instrument, info_span};

use crate::error::StoreError;
use crate::provider::{Attempts, CallReply, Lookup, Providers};
use crate::record::{Actor, KeyKind, KeyRecord};
use crate::setters::setters;
use crate::store::{Finish, Release, Store, TakeStale};
use crate::{KeyId, KeyState};

mod clock;
mod decide;
mod event;
mod renew;
mod report;
mod workflow;

pub use event::{EventSettlement, EventTarget, ProviderEvent};
pub use report::{LostKey, RunSummary, SweepReport, Unresolved, UnresolvedKey};

use clock::BatchClock;
use decide::{SweeperDecision, SweeperPlan};
use report::ms;

/// A key about to be re-driven, and through whom (`Sweeper::redrive`).
struct Redrive<'a> {
    id: &'a KeyId,
    record: &'a KeyRecord,
    provider: &'a dyn crate::provider::Provider,
    name: &'a str,
    spec: Option<&'a crate::provider::KeySpec>,
}

/// The settings of a [`Sweeper`], as read back with [`Sweeper::config`].
///
/// This is a read-only view: every setting is set with the builder method of the same name on
/// [`Sweeper`] (`Sweeper::new(store, providers).batch_size(..).lease(..)`; both backoff bounds
/// with [`Sweeper::backoff`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SweeperConfig {
    /// Keys taken per batch. Default 100.
    pub batch_size: u32,
    /// The lease each taken key gets. It is short and renewed by a heartbeat, as an executor's
    /// lease is: while the sweeper works through a batch it renews the lease of every key of the
    /// batch not yet handled every third of it (sooner after a failed renewal), so a sweeper that
    /// dies strands its batch for at most about one lease (`docs/reliability.md`, "A sweeper
    /// that dies"). Default 6 s, the executor's default lease.
    pub lease: Duration,
    /// Name recorded as the lease owner. Default `sweeper-<pid>`.
    pub owner: String,
    /// First recheck delay for a key that could not be settled. Default 30 s.
    pub backoff_base: Duration,
    /// Longest recheck delay (a provider's `Retry-After` may ask for more). Default 1 h.
    pub backoff_cap: Duration,
    /// Recheck delay for a key that needs an operator. Default 6 h.
    pub operator_recheck: Duration,
    /// A re-drive is only attempted while the key is younger than the provider's dedup window
    /// less this margin. Default 1 h.
    pub redrive_margin: Duration,
    /// At most this many keys per run (the rest wait for the next run). Default 10,000.
    pub max_keys_per_run: u64,
    /// Longest wait for one provider `call` or `lookup`; past it the key is deferred (a
    /// re-drive's outcome is then unknown). Default 2 min.
    pub call_timeout: Duration,
    /// Only keys of this scope are taken (`None`, the default: every scope). A queue
    /// consumer's in-process sweeper sweeps its own scope
    /// ([`Consumer::sweeper`](crate::consumer::Consumer::sweeper)).
    pub scope: Option<String>,
}

impl SweeperConfig {
    fn defaults() -> Self {
        Self {
            batch_size: 100,
            lease: DEFAULT_LEASE,
            owner: format!("sweeper-{}", std::process::id()),
            backoff_base: Duration::from_secs(30),
            backoff_cap: Duration::from_secs(3600),
            operator_recheck: Duration::from_secs(6 * 3600),
            redrive_margin: crate::provider::DEFAULT_REDRIVE_MARGIN,
            max_keys_per_run: 10_000,
            call_timeout: Duration::from_secs(120),
            scope: None,
        }
    }
}

/// The default [`SweeperConfig::lease`]: the executor's default lease
/// ([`ExecutorConfig::lease`](crate::executor::ExecutorConfig::lease)).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(6);

/// Why a sweep stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SweepError {
    /// The store failed; keys already taken keep their lease until it expires and are taken again
    /// by the next sweep. `report` holds what was done before.
    #[error("sweep stopped after {} keys: store error: {source}", report.taken)]
    Store {
        /// The store's error.
        #[source]
        source: StoreError,
        /// What the sweep did before the error.
        report: Box<SweepReport>,
    },
}

impl SweepError {
    /// What the sweep did before it stopped.
    pub fn report(&self) -> &SweepReport {
        match self {
            SweepError::Store { report, .. } => report,
        }
    }
}

/// How often [`Sweeper::run`] refreshes the key gauges (`idemflow_processing_keys`, ...) with a
/// [`Store::stats`] query: after its first sweep, then at most once a minute.
const GAUGE_INTERVAL: Duration = Duration::from_secs(60);

/// The recovery sweeper. Cheap to clone; share one per process, or run several processes.
#[derive(Debug, Clone)]
pub struct Sweeper {
    store: Arc<dyn Store>,
    providers: Providers,
    config: SweeperConfig,
    resumers: crate::workflow::Resumers,
}

/// What happened to one key.
enum KeyResult {
    Finished(KeyState),
    Unresolved(UnresolvedKey),
    Lost(LostKey),
}

impl Sweeper {
    /// A sweeper over `store` asking `providers`, with default settings; change them with the
    /// builder methods below.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::{sync::Arc, time::Duration};
    /// use idemflow::{Providers, Store, Sweeper, store::sqlite::SqliteStore};
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// // Register the providers your keys were sent through (`Providers::new().with(..)`).
    /// let sweeper = Sweeper::new(Arc::new(store), Providers::new()).lease(Duration::from_secs(60));
    /// let report = sweeper.run_once().await?;
    /// assert_eq!(report.taken, 0); // nothing was stuck
    /// # Ok(()) }
    /// ```
    pub fn new(store: Arc<dyn Store>, providers: Providers) -> Self {
        Self {
            store,
            providers,
            config: SweeperConfig::defaults(),
            resumers: Default::default(),
        }
    }

    /// Registers the operation of the workflows named `operation`, so this sweeper pushes a
    /// stale one to its end without waiting for a client retry: once its steps are settled,
    /// `resume` runs under the sweeper's lease through `executor` (the executor the workflow
    /// runs with: its lease and retention apply), its finished steps replay and the rest run
    /// (`docs/workflows.md`, "Resumption"). Pass the same closure the application gives
    /// [`Idempotency::execute`](crate::Idempotency::execute).
    pub fn resumer<F, Fut>(
        mut self,
        operation: impl Into<String>,
        executor: crate::Idempotency,
        resume: F,
    ) -> Self
    where
        F: Fn(crate::Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = crate::Outcome> + Send + 'static,
    {
        let resume: crate::workflow::Resume = Arc::new(move |ctx| Box::pin(resume(ctx)));
        self.resumers.0.insert(operation.into(), (executor, resume));
        self
    }

    /// Sets the batch size (at least 1).
    pub fn batch_size(mut self, n: u32) -> Self {
        self.config.batch_size = n.max(1);
        self
    }

    /// Sets the owner name recorded on taken keys.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.config.owner = owner.into();
        self
    }

    /// Sets the backoff: first delay `base`, doubling per attempt up to `cap`.
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.config.backoff_base = base;
        self.config.backoff_cap = cap.max(base);
        self
    }

    /// Sweeps only the keys of `scope`, leaving the rest of a shared store to other sweepers
    /// (on Redis, from the earliest 1,000 due keys of each bucket per batch).
    pub fn scope(mut self, scope: &crate::key::Scope) -> Self {
        self.config.scope = Some(scope.as_str().to_owned());
        self
    }

    /// Sets the most keys one run handles (at least 1).
    pub fn max_keys_per_run(mut self, n: u64) -> Self {
        self.config.max_keys_per_run = n.max(1);
        self
    }

    setters! { in config;
        /// Sets the lease of taken keys ([`SweeperConfig::lease`]): how long the keys of a
        /// sweeper that died stay held. Keep it short; the heartbeat renews it while the
        /// sweeper works.
        lease(lease: Duration);

        /// Sets the recheck delay of keys that need an operator.
        operator_recheck(operator_recheck: Duration);

        /// Sets the safety margin kept before the end of a provider's dedup window.
        redrive_margin(redrive_margin: Duration);

        /// Sets the longest wait for one provider call or lookup.
        call_timeout(call_timeout: Duration);
    }

    /// The settings.
    pub fn config(&self) -> &SweeperConfig {
        &self.config
    }

    /// The providers.
    pub fn providers(&self) -> &Providers {
        &self.providers
    }

    /// Takes and settles stale keys until none is due (or the per-run limit is reached).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use idemflow::{Providers, Store, Sweeper, store::sqlite::SqliteStore};
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let sweeper = Sweeper::new(Arc::new(store), Providers::new());
    /// // A cron job runs one pass and reports; a service calls this on a timer.
    /// let report = sweeper.run_once().await?;
    /// println!("taken {}, done {}, needs an operator {}", report.taken, report.done, report.needs_operator);
    /// # Ok(()) }
    /// ```
    pub async fn run_once(&self) -> Result<SweepReport, SweepError> {
        self.run_once_with(|_| {}).await
    }

    /// Like [`run_once`](Self::run_once), calling `progress` with the report so far after each
    /// batch (for a progress line).
    pub async fn run_once_with(
        &self,
        progress: impl FnMut(&SweepReport),
    ) -> Result<SweepReport, SweepError> {
        let (_tx, rx) = watch::channel(false);
        self.sweep(&rx, progress).await
    }

    /// Sweeps every `interval` until `shutdown` completes. A sweep in progress when it does
    /// finishes the key at hand, gives the rest of its batch back (so another sweeper can take
    /// them at once) and stops. A failed sweep is logged and the loop goes on.
    pub async fn run(&self, interval: Duration, shutdown: impl Future<Output = ()>) -> RunSummary {
        self.run_with(interval, shutdown, |_| {}).await
    }

    /// Like [`run`](Self::run), calling `on_sweep` with each sweep's result.
    pub async fn run_with(
        &self,
        interval: Duration,
        shutdown: impl Future<Output = ()>,
        mut on_sweep: impl FnMut(&Result<SweepReport, SweepError>),
    ) -> RunSummary {
        let (tx, rx) = watch::channel(false);
        let mut shutdown = std::pin::pin!(shutdown);
        let mut stopping = false;
        let mut summary = RunSummary::default();
        let mut gauges_due: Option<Instant> = None;
        loop {
            let result = {
                let sweep = self.sweep(&rx, |_| {});
                let mut sweep = std::pin::pin!(sweep);
                tokio::select! {
                    r = &mut sweep => r,
                    () = &mut shutdown, if !stopping => {
                        stopping = true;
                        let _ = tx.send(true);
                        sweep.await
                    }
                }
            };
            if gauges_due.is_none_or(|at: Instant| at.elapsed() >= GAUGE_INTERVAL) {
                gauges_due = Some(Instant::now());
                let counting = self.store.stats();
                crate::telemetry::key_gauges_from(
                    crate::telemetry::timed(self.store.backend(), "stats", counting).await,
                );
            }
            match &result {
                Ok(report) => {
                    summary.runs += 1;
                    if report.taken > 0 || !report.is_clean() {
                        tracing::info!(summary = %report.summary(), "sweep finished");
                    }
                    summary.last = Some(report.clone());
                }
                Err(e) => {
                    summary.errors += 1;
                    tracing::error!(error = %e, "sweep failed");
                }
            }
            on_sweep(&result);
            if stopping {
                break;
            }
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = &mut shutdown => break,
            }
        }
        summary
    }

    async fn sweep(
        &self,
        stop: &watch::Receiver<bool>,
        mut progress: impl FnMut(&SweepReport),
    ) -> Result<SweepReport, SweepError> {
        let started = Instant::now();
        let mut report = SweepReport::default();
        let fail = |source: StoreError, mut report: SweepReport| {
            report.elapsed_ms = ms(started.elapsed());
            SweepError::Store {
                source,
                report: Box::new(report),
            }
        };
        let cfg = &self.config;
        loop {
            if *stop.borrow() {
                report.shut_down = true;
                break;
            }
            let left = cfg.max_keys_per_run.saturating_sub(report.taken);
            if left == 0 {
                report.hit_key_limit = true;
                break;
            }
            let limit = u32::try_from(left.min(u64::from(cfg.batch_size))).unwrap_or(1);
            let take = TakeStale {
                owner: cfg.owner.clone(),
                lease: cfg.lease,
                limit,
                scope: cfg.scope.clone(),
            };
            let taking = self.store.take_stale(&take);
            let batch =
                match crate::telemetry::timed(self.store.backend(), "take_stale", taking).await {
                    Ok(b) => b,
                    Err(e) => return Err(fail(e, report)),
                };
            if batch.is_empty() {
                break;
            }
            let taken_at = Instant::now();
            let clock = match self.store.now().await {
                Ok(db_now) => BatchClock {
                    db_now,
                    asked: taken_at,
                    answered: Instant::now(),
                },
                Err(e) => return Err(fail(e, report)),
            };
            report.batches += 1;
            report.taken += batch.len() as u64;
            let full = batch.len() as u32 == limit;
            // Every key of the batch keeps its lease while the batch is worked through.
            let held: Vec<_> = batch
                .iter()
                .map(|r| (KeyId::new(r.scope.clone(), r.key.clone()), r.lease_token))
                .collect();
            let mut renewed_at = taken_at;
            let mut keys = batch.into_iter();
            let mut at = 0;
            while let Some(record) = keys.next() {
                if *stop.borrow() {
                    report.shut_down = true;
                    for record in std::iter::once(record).chain(keys.by_ref()) {
                        match self.give_back(record).await {
                            Ok(r) => Self::count(&mut report, r),
                            Err(e) => return Err(fail(e, report)),
                        }
                    }
                    break;
                }
                let span = info_span!(
                    "idemflow.sweep_key",
                    scope = %record.scope,
                    key = %record.key,
                    provider = record.provider.as_deref().unwrap_or("-"),
                    attempt = record.attempts,
                    decision = tracing::field::Empty,
                );
                let work = self
                    .handle(record, clock, taken_at, &mut report)
                    .instrument(span);
                let result = renew::while_working(
                    &*self.store,
                    &held[at..],
                    cfg.lease,
                    &mut renewed_at,
                    work,
                )
                .await;
                at += 1;
                match result {
                    Ok(r) => Self::count(&mut report, r),
                    Err(e) => return Err(fail(e, report)),
                }
            }
            progress(&report);
            // A short batch means nothing else was due when it was taken: the run is over.
            if report.shut_down || !full {
                break;
            }
        }
        report.elapsed_ms = ms(started.elapsed());
        Ok(report)
    }

    fn count(report: &mut SweepReport, r: KeyResult) {
        use crate::telemetry as t;
        match r {
            KeyResult::Finished(to) => {
                t::sweeper_finish(to);
                report.count_finish(to);
            }
            KeyResult::Unresolved(u) => {
                t::sweeper(match u.kind {
                    Unresolved::Deferred => "deferred",
                    Unresolved::NeedsOperator => "needs_operator",
                    Unresolved::Released => "released",
                    Unresolved::WaitingForResumer => "waiting_for_resumer",
                });
                report.push_unresolved(u);
            }
            KeyResult::Lost(l) => {
                t::sweeper("lease_lost");
                t::lease_lost("sweeper");
                report.lease_lost += 1;
                report.lost.push(l);
            }
        }
    }

    /// Settles one taken key. Windows that close are judged on the database's time at the
    /// latest, lags that must have passed on its time at the earliest (`clock.rs`).
    async fn handle(
        &self,
        record: KeyRecord,
        clock: BatchClock,
        taken_at: Instant,
        report: &mut SweepReport,
    ) -> Result<KeyResult, StoreError> {
        let now = clock.latest();
        let id = KeyId::new(record.scope.clone(), record.key.clone());
        // A long batch: keep the lease so no other sweeper takes the key while we ask.
        if taken_at.elapsed() > self.config.lease / 2 {
            match self
                .store
                .extend(&id, record.lease_token, self.config.lease)
                .await
            {
                Ok(_) => {}
                Err(e) => return lost_or(e, &record),
            }
        }
        if record.kind() == KeyKind::Workflow {
            return self.handle_workflow(&id, record, now, report).await;
        }
        if record.kind() == KeyKind::AtomicStep {
            return self.settle_atomic_step(&id, &record).await;
        }
        let provider = record
            .provider
            .as_deref()
            .and_then(|name| self.providers.get(name))
            .cloned();
        let spec = provider.as_ref().map(|p| p.key_spec());
        let name = record.provider.clone().unwrap_or_default();
        let plan = decide::plan(
            &record,
            spec.as_ref().map(|s| (name.as_str(), s)),
            now,
            self.config.redrive_margin,
        );
        let decision = match (plan, provider.clone()) {
            (SweeperPlan::NeedsOperator { reason }, _) => {
                tracing::Span::current().record("decision", "needs_operator");
                SweeperDecision::NeedsOperator { reason }
            }
            (SweeperPlan::Redrive { request }, Some(p)) => {
                report.redrives += 1;
                crate::telemetry::sweeper("redrive");
                tracing::Span::current().record("decision", "redrive");
                let redrive = Redrive {
                    id: &id,
                    record: &record,
                    provider: &*p,
                    name: &name,
                    spec: spec.as_ref(),
                };
                match self.redrive(redrive, &request, clock).await {
                    Ok(decision) => decision,
                    Err(e) => return lost_or(e, &record),
                }
            }
            (SweeperPlan::Lookup { request, why }, Some(p)) => {
                report.lookups += 1;
                crate::telemetry::sweeper("lookup");
                tracing::Span::current().record("decision", "lookup");
                self.look_up(&record, &*p, &name, &request, &why, clock)
                    .await
            }
            // plan() only re-drives or looks up with a registered provider.
            (_, None) => SweeperDecision::NeedsOperator {
                reason: format!("provider {name:?} is not registered with this sweeper"),
            },
        };
        let decision = masked(decision, provider.as_deref());
        self.apply(&id, &record, decision).await
    }

    /// A stale atomic phase's key. Since one commit claims and finishes such a key with its
    /// writes, only a row of an earlier version (which claimed atomic steps in a transaction of
    /// their own) can be seen processing: with its lease run out, its transaction never
    /// committed and it surely did nothing.
    async fn settle_atomic_step(
        &self,
        id: &KeyId,
        record: &KeyRecord,
    ) -> Result<KeyResult, StoreError> {
        // An atomic phase's record commits with its writes: still processing with its
        // lease run out, its transaction never committed, so it surely did nothing.
        tracing::Span::current().record("decision", "local_rolled_back");
        let decision = SweeperDecision::Finish {
            to: KeyState::Failed { retryable: true },
            response: None,
            error: Some("the atomic phase's transaction never committed".to_owned()),
            reason: "atomic phase still processing after its lease: its writes and record \
                     commit together, so nothing was written; retryable"
                .to_owned(),
        };
        self.apply(id, record, decision).await
    }

    /// Re-drives a taken key inside its provider's window (`SweeperPlan::Redrive`): what the answer
    /// means for the key. A store error (the lease lost) ends the key's handling.
    async fn redrive(
        &self,
        Redrive {
            id,
            record,
            provider: p,
            name,
            spec,
        }: Redrive<'_>,
        request: &serde_json::Value,
        clock: BatchClock,
    ) -> Result<SweeperDecision, StoreError> {
        // The re-drive may act: hold the key for a full lease from here (the batch
        // lease may have run out while this process was paused, and a fenced write
        // alone does not renew it), then record the attempt before sending, so a later
        // lookup judges the search lag from this send.
        let asked = Instant::now();
        self.store
            .extend(id, record.lease_token, self.config.lease)
            .await?;
        self.store.mark_attempt(id, record.lease_token).await?;
        // The last checks before the re-send leaves, on this process's clock: the
        // lease renewed above has not run out, and the provider's window (less the
        // margin) has not closed while the store answered.
        let send_now = clock.latest();
        let refusal = if asked.elapsed() >= crate::store::kit::surely_held_for(self.config.lease) {
            Some("the lease ran out before the re-drive could be sent".to_owned())
        } else if !spec
            .as_ref()
            .is_some_and(|s| s.may_redrive(record.created_at, send_now, self.config.redrive_margin))
        {
            Some(format!(
                "{name}'s dedup window (less the re-drive margin) closed before the \
                 re-drive could be sent"
            ))
        } else {
            None
        };
        if let Some(why) = refusal {
            return Ok(SweeperDecision::Defer {
                reason: format!("{why}; nothing sent, the key is checked again later"),
                retry_after: None,
            });
        }
        let call = p.send(&record.provider_key, request);
        let outcome = tokio::time::timeout(self.config.call_timeout, call)
            .await
            .unwrap_or_else(|_| CallReply::Unknown {
                reason: format!(
                    "no answer within {:?} (sweeper call timeout)",
                    self.config.call_timeout
                ),
            });
        let decision = decide::after_call(name, outcome);
        if !matches!(decision, SweeperDecision::Finish { .. }) {
            // Not settled: the re-drive may have reached the provider until its answer.
            self.store.mark_attempt(id, record.lease_token).await?;
        }
        Ok(decision)
    }

    /// Asks the provider what happened to a taken key (`SweeperPlan::Lookup`): a void by key first
    /// where the provider has one, then a lookup.
    async fn look_up(
        &self,
        record: &KeyRecord,
        p: &dyn crate::provider::Provider,
        name: &str,
        request: &serde_json::Value,
        why: &str,
        clock: BatchClock,
    ) -> SweeperDecision {
        // A provider that voids by key turns "unknown" into "surely not charged"
        // before anything is looked up (Square's CancelPaymentByIdempotencyKey).
        // The void is sent no earlier than this (the database's time at the earliest).
        let void_sent = clock.earliest();
        let void = tokio::time::timeout(
            self.config.call_timeout,
            p.void_by_key(&record.provider_key, request),
        )
        .await
        .unwrap_or_else(|_| crate::provider::VoidReply::Unknown {
            reason: format!(
                "no answer within {:?} (sweeper call timeout)",
                self.config.call_timeout
            ),
            retry_after: None,
        });
        // The void proves nothing was charged only past the provider's processing
        // window since the latest attempt, counted up to when the void was sent at the
        // earliest.
        let since_last_attempt = (void_sent - record.last_attempt_at)
            .to_std()
            .unwrap_or_default();
        if let Some(decision) =
            decide::after_void(name, void, since_last_attempt, p.processing_window())
        {
            tracing::Span::current().record("decision", "void_by_key");
            return decision;
        }
        // Search lag counts from the latest attempt that may have reached the provider
        // (the re-drive window above counts from the first use: `created_at`).
        // Its empty answer is trusted only once the lag has surely passed: the
        // database's time at the earliest (never ahead of it, however slow `now` was).
        let lookup = p.lookup(
            &record.provider_key,
            request,
            Attempts::new(record.created_at, record.last_attempt_at),
            clock.earliest(),
        );
        let found = tokio::time::timeout(self.config.call_timeout, lookup)
            .await
            .unwrap_or(Lookup::Unknown { retry_after: None });
        decide::after_lookup(name, why, found)
    }

    async fn apply(
        &self,
        id: &KeyId,
        record: &KeyRecord,
        decision: SweeperDecision,
    ) -> Result<KeyResult, StoreError> {
        let cfg = &self.config;
        let (kind, reason, recheck) = match decision {
            SweeperDecision::Finish {
                to,
                response,
                error,
                reason,
            } => {
                let finish = Finish {
                    to,
                    response,
                    error,
                    actor: Actor::Sweeper,
                    reason,
                };
                tracing::info!(to = %to, reason = %finish.reason, "sweeper settled key");
                return match self.store.finish(id, record.lease_token, &finish).await {
                    Ok(_) => Ok(KeyResult::Finished(to)),
                    Err(e) => lost_or(e, record),
                };
            }
            SweeperDecision::Defer {
                reason,
                retry_after,
            } => {
                let after = decide::backoff(
                    record.attempts,
                    cfg.backoff_base,
                    cfg.backoff_cap,
                    retry_after,
                );
                (Unresolved::Deferred, reason, after)
            }
            SweeperDecision::NeedsOperator { reason } => {
                (Unresolved::NeedsOperator, reason, cfg.operator_recheck)
            }
        };
        tracing::warn!(kind = ?kind, reason = %reason, recheck_after = ?recheck, "key left unresolved");
        self.release_unresolved(id, record, kind, reason, recheck)
            .await
    }

    /// Gives a key back unresolved, to be looked at again `recheck` from now.
    async fn release_unresolved(
        &self,
        id: &KeyId,
        record: &KeyRecord,
        kind: Unresolved,
        reason: String,
        recheck: Duration,
    ) -> Result<KeyResult, StoreError> {
        let release = Release {
            actor: Actor::Sweeper,
            reason: format!("{reason}; next check in {}s", recheck.as_secs()),
            error: Some(reason.clone()),
            recheck_after: Some(recheck),
        };
        match self.store.release(id, record.lease_token, &release).await {
            Ok(()) => Ok(KeyResult::Unresolved(unresolved(
                record,
                kind,
                reason,
                Some(recheck),
            ))),
            Err(e) => lost_or(e, record),
        }
    }

    /// Gives a taken key back untouched (shutdown).
    async fn give_back(&self, record: KeyRecord) -> Result<KeyResult, StoreError> {
        let id = KeyId::new(record.scope.clone(), record.key.clone());
        let reason = "sweeper shutting down; key given back for another sweep".to_owned();
        let release = Release {
            actor: Actor::Sweeper,
            reason: reason.clone(),
            error: None,
            recheck_after: None,
        };
        match self.store.release(&id, record.lease_token, &release).await {
            Ok(()) => Ok(KeyResult::Unresolved(unresolved(
                &record,
                Unresolved::Released,
                reason,
                None,
            ))),
            Err(e) => lost_or(e, &record),
        }
    }
}

/// `decision` with the provider's secret fields masked in the answer it stores: the provider's
/// secrets never reach the store, whoever settles the key.
fn masked(
    decision: SweeperDecision,
    provider: Option<&dyn crate::provider::Provider>,
) -> SweeperDecision {
    match (decision, provider) {
        (
            SweeperDecision::Finish {
                to,
                response: Some(r),
                error,
                reason,
            },
            Some(p),
        ) => SweeperDecision::Finish {
            to,
            response: Some(crate::provider::secrets::mask_fields(r, p.secret_fields())),
            error,
            reason,
        },
        (d, _) => d,
    }
}

fn unresolved(
    record: &KeyRecord,
    kind: Unresolved,
    reason: String,
    recheck: Option<Duration>,
) -> UnresolvedKey {
    UnresolvedKey {
        scope: record.scope.to_string(),
        key: record.key.to_string(),
        operation: record.operation.clone(),
        provider: record.provider.clone(),
        attempts: record.attempts,
        kind,
        reason,
        recheck_after_ms: recheck.map(ms),
    }
}

/// `LeaseLost` (someone else decided) and `NotFound` are reported; anything else is an error.
fn lost_or(e: StoreError, record: &KeyRecord) -> Result<KeyResult, StoreError> {
    match e {
        StoreError::LeaseLost { .. } | StoreError::NotFound { .. } => {
            tracing::info!(error = %e, "another party decided the key first");
            Ok(KeyResult::Lost(LostKey {
                scope: record.scope.to_string(),
                key: record.key.to_string(),
                detail: e.to_string(),
            }))
        }
        e => Err(e),
    }
}
