//! The public entry point: [`Idempotency::execute`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use crate::error::{Error, RequestError, StoreError};
use crate::provider_key;
use crate::record::{Actor, KeyRecord, LeaseToken};
use crate::setters::setters;
use crate::state::KeyState;
use crate::store::{ClaimOutcome, Finish, Lease, NewClaim, Release, Store};
use crate::{KeyId, StoredResponse};

mod config;
mod context;
mod decide;
mod execution;
pub(crate) mod heartbeat;
pub(crate) mod hook;
mod one_commit;
mod provider_call;
mod replay_cache;
mod request;
mod wait;

use crate::Outcome;
pub use config::{ExecutorConfig, Redactor};
pub use context::Context;
use decide::{WorkerDecision, decide};
pub use execution::Execution;
#[cfg(feature = "axum")]
pub(crate) use provider_call::send as send_to_provider;
pub use request::IdempotentRequest;
pub(crate) use request::StepOf;
pub(crate) use request::validate_operation;

/// The span of one key's run, named `$name`: the key's scope and key (from the `KeyId` `$id`),
/// its operation under the field `$field`, and the outcome, recorded when known.
macro_rules! key_span {
    ($name:literal, $id:expr, $field:ident = $operation:expr) => {
        tracing::info_span!(
            $name,
            scope = %$id.scope,
            key = %$id.key,
            $field = %$operation,
            outcome = tracing::field::Empty,
        )
    };
}
pub(crate) use key_span;

/// Makes operations safe to retry: claims the key, runs the operation at most once at a time,
/// stores its outcome and replays it.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use idemflow::{Idempotency, Outcome, IdempotentRequest, StoredResponse, Store, store::sqlite::SqliteStore};
///
/// let store = SqliteStore::connect("sqlite::memory:").await?;
/// store.migrate().await?;
/// let idem = Idempotency::new(Arc::new(store));
///
/// let body = serde_json::json!({"amount": 500, "currency": "usd"});
/// let charge = |ctx: idemflow::Context| async move {
///     // Forward ctx.provider_key() to the provider here.
///     Outcome::Succeeded(StoredResponse::json(201, &serde_json::json!({"charged": 500})).unwrap())
/// };
/// let first = idem.execute(IdempotentRequest::new("acct_1", "k1", "charge", &body)?, charge).await?;
/// let again = idem.execute(IdempotentRequest::new("acct_1", "k1", "charge", &body)?, charge).await?;
/// assert!(!first.is_replay() && again.is_replay());
/// assert_eq!(first.response(), again.response());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Idempotency {
    store: Arc<dyn Store>,
    config: Arc<ExecutorConfig>,
    /// Duplicates waiting for an in-flight answer, shared by the clones.
    waiters: Arc<wait::WaiterCount>,
    /// Finished keys' answers, shared by the clones (`replay_cache`).
    replays: Arc<replay_cache::ReplayCache>,
}

impl Idempotency {
    /// An executor over `store` with default settings; change them with the builder methods
    /// below.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::{sync::Arc, time::Duration};
    /// use idemflow::{Idempotency, Store, store::sqlite::SqliteStore};
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let idem = Idempotency::new(Arc::new(store)).lease(Duration::from_secs(30));
    /// assert_eq!(idem.config().lease, Duration::from_secs(30));
    /// # Ok(()) }
    /// ```
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            config: Arc::new(ExecutorConfig::defaults()),
            waiters: Arc::default(),
            replays: Arc::default(),
        }
    }

    setters! { shared config;
        /// Sets the lease length ([`ExecutorConfig::lease`]).
        lease(lease: Duration);

        /// Sets the retention of finished keys ([`ExecutorConfig::retention`]).
        retention(retention: Duration);
    }

    setters! { shared config;
        /// Sets the bytes of answers kept for replays in memory; zero turns the cache off
        /// ([`ExecutorConfig::replay_cache_bytes`]).
        replay_cache_bytes(replay_cache_bytes: usize);

        /// Sets how long a cached answer is given back at most
        /// ([`ExecutorConfig::replay_cache_max_age`]).
        replay_cache_max_age(replay_cache_max_age: Duration);
    }

    /// Sets the lease owner name ([`ExecutorConfig::owner`]).
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        let owner = owner.into();
        Arc::make_mut(&mut self.config).owner = owner;
        self
    }

    setters! { shared config;
        /// Whether the canonical request is stored ([`ExecutorConfig::store_request`]).
        store_request(store_request: bool);

        /// Sets the request cap in bytes ([`ExecutorConfig::max_request_bytes`]).
        max_request_bytes(max_request_bytes: usize);

        /// Sets the stored response cap in bytes ([`ExecutorConfig::max_response_bytes`]).
        max_response_bytes(max_response_bytes: usize);

        /// Sets the headers kept for replay, compared case-insensitively (`None`: all)
        /// ([`ExecutorConfig::stored_headers`]).
        stored_headers(stored_headers: Option<Vec<String>>);
    }

    /// Lets a retry take over an expired lease within `window` of the first claim
    /// ([`ExecutorConfig::retry_takeover_window`]).
    pub fn retry_takeover_window(mut self, window: Option<Duration>) -> Self {
        Arc::make_mut(&mut self.config).retry_takeover_window = window;
        self
    }

    setters! { shared config;
        /// Sets the `Retry-After` given to a duplicate of a running request
        /// ([`ExecutorConfig::in_flight_retry_after`]).
        in_flight_retry_after(in_flight_retry_after: Duration);
    }

    /// Lets a duplicate whose first request is still running wait up to `bound` for that
    /// request's answer, instead of being refused at once ([`ExecutorConfig::wait_in_flight`];
    /// `None` or zero: no waiting, the default).
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # fn store() -> Arc<dyn idemflow::Store> { unimplemented!() }
    /// # fn _f() {
    /// let idem = idemflow::Idempotency::new(store()).wait_in_flight(Some(Duration::from_secs(2)));
    /// # }
    /// ```
    pub fn wait_in_flight(mut self, bound: Option<Duration>) -> Self {
        Arc::make_mut(&mut self.config).wait_in_flight = bound;
        self
    }

    setters! { shared config;
        /// Sets how many duplicates may wait at once ([`ExecutorConfig::max_in_flight_waiters`]).
        max_in_flight_waiters(max_in_flight_waiters: usize);
    }

    /// Duplicates waiting for an in-flight answer now, in this executor and its clones.
    pub fn in_flight_waiters(&self) -> usize {
        self.waiters.now()
    }

    setters! { shared config;
        /// Sets the `Retry-After` given while an outcome is unknown
        /// ([`ExecutorConfig::unknown_retry_after`]).
        unknown_retry_after(unknown_retry_after: Duration);
    }

    /// Masks the application's own secrets in every response before it is stored
    /// ([`ExecutorConfig::redact`]); [`provider::secrets::mask_fields`] masks JSON members by name:
    ///
    /// ```
    /// # use std::sync::Arc;
    /// use idemflow::provider::secrets::mask_fields;
    /// # fn store() -> Arc<dyn idemflow::Store> { unimplemented!() }
    /// # fn _f() {
    /// let idem = idemflow::Idempotency::new(store())
    ///     .redact_with(|resp| mask_fields(resp, &["card_number", "api_token"]));
    /// # }
    /// ```
    ///
    /// [`provider::secrets::mask_fields`]: crate::provider::secrets::mask_fields
    pub fn redact_with(
        mut self,
        redact: impl Fn(StoredResponse) -> StoredResponse + Send + Sync + 'static,
    ) -> Self {
        let redact = Redactor(std::sync::Arc::new(redact));
        Arc::make_mut(&mut self.config).redact = Some(redact);
        self
    }

    /// The settings.
    pub fn config(&self) -> &ExecutorConfig {
        &self.config
    }

    /// The settings, shared (for a closure that outlives the call, as an atomic phase's).
    pub(crate) fn shared_config(&self) -> &Arc<ExecutorConfig> {
        &self.config
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Runs `op` at most once for the request's (scope, key) and returns its response, or
    /// replays the stored one.
    ///
    /// While `op` runs, its lease is renewed every third of [`ExecutorConfig::lease`] (in this
    /// task, concurrently with `op`); if renewal is refused, [`Context::lease_lost`] turns true
    /// and the result is not stored over the new owner's ([`Error::LeaseLost`]).
    ///
    /// Cancel-safe: if this future is dropped while `op` runs, renewal stops with it, the key
    /// stays `processing` until its lease runs out (at most one lease), and the sweeper (or,
    /// within the takeover window, a retry) settles it.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use idemflow::{Context, Idempotency, IdempotentRequest, Outcome, Store, StoredResponse};
    /// use idemflow::store::sqlite::SqliteStore;
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let idem = Idempotency::new(Arc::new(store));
    /// let body = serde_json::json!({"amount": 500});
    /// let charge = |_: Context| async { Outcome::Succeeded(StoredResponse::new(201)) };
    ///
    /// let first = idem.execute(IdempotentRequest::new("acct_1", "k1", "charge", &body)?, charge).await?;
    /// let again = idem.execute(IdempotentRequest::new("acct_1", "k1", "charge", &body)?, charge).await?;
    /// assert!(!first.is_replay() && again.is_replay());
    /// assert_eq!(first.response(), again.response());
    /// # Ok(()) }
    /// ```
    pub async fn execute<F, Fut>(
        &self,
        request: IdempotentRequest,
        op: F,
    ) -> Result<Execution, Error>
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Outcome>,
    {
        let span = key_span!(
            "idemflow.execute",
            request.id,
            operation = request.operation
        );
        let operation = request.operation.clone();
        measured(&operation, span, async {
            let cfg = &*self.config;
            if request.canonical.len() > cfg.max_request_bytes {
                return Err(RequestError::RequestTooLarge {
                    size: request.canonical.len(),
                    limit: cfg.max_request_bytes,
                }
                .into());
            }
            if cfg.replay_cache_bytes > 0
                && let Some(response) =
                    self.replays
                        .get(&request.id, &request.fingerprint, &request.operation)
            {
                tracing::Span::current().record("outcome", "replayed");
                return Ok(Execution::Replayed(response));
            }
            let claim = self.new_claim(&request);
            let id = request.id.clone();
            let mut wait =
                wait::InFlightWait::new(&self.store, &id, &operation, cfg, &self.waiters);
            // A duplicate of a running request reads the key again after each wait until it
            // gets an answer, runs the request itself, or is refused (`wait.rs`).
            let (lease, asked) = loop {
                // Sent before the claim: the lease the database grants runs at least `lease`
                // from here.
                let asked = tokio::time::Instant::now();
                let claimed = crate::telemetry::timed(
                    self.store.backend(),
                    "claim",
                    self.store.claim(&claim),
                )
                .await;
                let answer = match claimed {
                    Ok(ClaimOutcome::Claimed(lease)) => {
                        wait.finish(&Ok(()), true);
                        break (lease, asked);
                    }
                    Ok(ClaimOutcome::Existing { record, now }) => {
                        self.keep_answer(&record, asked, now);
                        self.existing(&request, *record, now)
                    }
                    Err(e) => Err(e.into()),
                };
                match answer {
                    Err(e @ Error::InFlight { .. }) => wait.again(e).await?,
                    answer => {
                        wait.finish(&answer, false);
                        return answer;
                    }
                }
            };
            crate::telemetry::claim(&request.operation, lease.transition);
            let (_, stored) = self.run_claimed(request, lease, asked, op).await?;
            Ok(Execution::Executed(stored))
        })
        .await
    }

    pub(crate) fn new_claim(&self, request: &IdempotentRequest) -> NewClaim {
        let cfg = &*self.config;
        // An explicit key is sent as given; a derived one is the pure derivation for the key's
        // first row, and the renewed base's key for a row re-created after the earlier was
        // purged (the store chooses at insert: only it knows whether the key has history, and
        // it appends the claim's life number, so a re-creation lost in a failover is made again
        // under the same key).
        let (provider_key, renewed_key_base) = match &request.provider_key {
            Some(explicit) => (explicit.clone(), None),
            None => {
                let (scope, key, op) = (&request.id.scope, &request.id.key, &request.operation);
                (
                    provider_key::derive(scope, key, op, request.key_max_len),
                    Some(provider_key::renewed_base(
                        scope,
                        key,
                        op,
                        request.key_max_len,
                    )),
                )
            }
        };
        NewClaim {
            id: request.id.clone(),
            operation: request.operation.clone(),
            provider: request.provider.clone(),
            provider_key,
            fingerprint: request.fingerprint.clone(),
            request: cfg.store_request.then(|| request.canonical.clone()),
            owner: cfg.owner.clone(),
            lease: cfg.lease,
            retention: cfg.retention,
            takeover_window: self.takeover_window(request),
            renewed_key_base,
        }
    }

    /// The window after a key's first claim in which a retry may take over its expired lease.
    /// A workflow acts only through its steps, each deduplicated by its own key, so it may be
    /// taken over for as long as its steps' records are surely kept: its retention, less one
    /// lease (`docs/workflows.md`). A step takes the window its workflow's run chose for it
    /// (`StepOf::takeover`); any other key, [`ExecutorConfig::retry_takeover_window`].
    fn takeover_window(&self, request: &IdempotentRequest) -> Option<Duration> {
        let cfg = &*self.config;
        if let Some(of) = &request.step {
            of.takeover
        } else if request.is_workflow() {
            Some(cfg.retention.saturating_sub(cfg.lease))
        } else {
            match request.dedup_window {
                // Sent through a provider: never re-sent outside what it dedupes.
                Some(window) => cfg.retry_takeover_window.zip(window).map(|(t, w)| t.min(w)),
                None => cfg.retry_takeover_window,
            }
        }
    }

    /// Runs `op` under `lease` (granted by a claim sent at `asked`, or held by the sweeper for a
    /// resumer), renewing it while `op` runs, and stores the outcome. Returns the state the key
    /// was finished in and its stored response.
    pub(crate) async fn run_claimed<F, Fut>(
        &self,
        request: IdempotentRequest,
        lease: Lease,
        asked: tokio::time::Instant,
        op: F,
    ) -> Result<(KeyState, StoredResponse), Error>
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Outcome>,
    {
        let id = request.id.clone();
        let result = async {
            let cfg = &*self.config;
            let request_operation = request.operation.clone();
            let window = self.takeover_window(&request);
            let held_until = heartbeat::held_from(asked, cfg.lease);
            let (held, watch) = heartbeat::LeaseWatch::new(lease.expires_at, held_until);
            // A workflow key runs with the state the workflow layer keeps for it (`hook.rs`).
            let run = if request.is_workflow() {
                Some(
                    crate::WORKFLOW_RUNS
                        .begin(hook::RunStart {
                            executor: self,
                            id: &id,
                            lease: &lease,
                            asked,
                            window,
                        })
                        .await?,
                )
            } else {
                None
            };
            let ctx = Context {
                id: id.clone(),
                provider_key: lease.provider_key.clone(),
                token: lease.token,
                attempt: lease.attempts,
                may_have_acted: lease.may_have_acted,
                lease: watch,
                send_by: if lease.transition == crate::state::Transition::Takeover {
                    window_closes(&lease, cfg.lease, window, asked)
                } else {
                    None
                },
                request: request.canonical,
                run: run.clone(),
            };
            // The lease is renewed while the operation runs (same task, stops with it).
            let renew = heartbeat::renew(&*self.store, &id, lease.token, cfg.lease, &held);
            let outcome = heartbeat::alongside(op(ctx), renew).await;
            if let Some(run) = &run
                && let Some(e) = run.after(self, &id, &outcome).await?
            {
                tracing::Span::current().record("outcome", "workflow_changed");
                let release = Release {
                    actor: Actor::Worker,
                    reason: "the workflow's code changed; left for an operator".to_owned(),
                    error: Some(e.to_string()),
                    recheck_after: None,
                };
                self.store.release(&id, lease.token, &release).await?;
                return Err(e);
            }
            crate::telemetry::outcome(
                &request_operation,
                match &outcome {
                    Outcome::Succeeded(_) => "succeeded",
                    Outcome::Rejected(_) => "rejected",
                    Outcome::Retryable { .. } => "retryable",
                    Outcome::Unknown { .. } => "unknown",
                },
            );
            let (to, resp) = match decide(outcome, lease.may_have_acted) {
                WorkerDecision::Store { to, response } => (to, response),
                WorkerDecision::Retryable { error } => {
                    tracing::Span::current().record("outcome", "retryable");
                    let why = "the provider surely did nothing; a retry runs it again";
                    return Err(fail_retryable(&*self.store, &id, lease.token, error, why).await);
                }
                WorkerDecision::Release {
                    reason,
                    error,
                    told,
                } => {
                    tracing::Span::current().record("outcome", "unknown");
                    let release = Release {
                        actor: Actor::Worker,
                        reason: reason.to_owned(),
                        error: Some(error),
                        recheck_after: None,
                    };
                    self.store.release(&id, lease.token, &release).await?;
                    return Err(Error::OutcomeUnknown {
                        key: id.clone(),
                        reason: told,
                        retry_after: cfg.unknown_retry_after,
                    });
                }
            };
            self.store_answer(&id, lease.token, to, resp).await
        }
        .await;
        // Whatever was written (an answer, a failure, a release), this process's duplicates
        // waiting on the key read it now.
        wait::wake(&self.store, &id);
        result
    }

    /// Stores an operation's answer (`done` or `failed{permanent}`) after the header filter,
    /// redaction and size cap, fenced by `token`; returns it as stored.
    async fn store_answer(
        &self,
        id: &KeyId,
        token: LeaseToken,
        to: KeyState,
        resp: StoredResponse,
    ) -> Result<(KeyState, StoredResponse), Error> {
        let resp = match self.config.prepare_answer(resp) {
            Ok(resp) => resp,
            // The operation ran, so the key must not vanish (a retry would run it again).
            Err((size, limit)) => return Err(self.too_large(id, token, size, limit).await),
        };
        tracing::Span::current().record(
            "outcome",
            if to == KeyState::Done {
                "done"
            } else {
                "rejected"
            },
        );
        let finish = Finish {
            to,
            response: Some(resp),
            error: None,
            actor: Actor::Worker,
            reason: if to == KeyState::Done {
                "operation succeeded".to_owned()
            } else {
                "operation refused permanently".to_owned()
            },
        };
        let sent = tokio::time::Instant::now();
        let record = crate::telemetry::timed(
            self.store.backend(),
            "finish",
            self.store.finish(id, token, &finish),
        )
        .await?;
        self.keep_answer(&record, sent, record.updated_at);
        let stored = record.response.or(finish.response).ok_or_else(|| {
            Error::Store(StoreError::Corrupt {
                backend: self.store.backend(),
                detail: "finished key returned without its response".to_owned(),
            })
        })?;
        Ok((to, stored))
    }

    /// Finishes a key whose answer is over the response cap as a permanent failure that names
    /// the problem, and returns the error for its caller.
    pub(crate) async fn too_large(
        &self,
        id: &KeyId,
        token: LeaseToken,
        size: usize,
        limit: usize,
    ) -> Error {
        tracing::Span::current().record("outcome", "response_too_large");
        let detail = format!("response of {size} bytes exceeds the cap of {limit} bytes");
        let finish = Finish {
            to: KeyState::Failed { retryable: false },
            response: None,
            error: Some(detail.clone()),
            actor: Actor::Worker,
            reason: detail,
        };
        match self.store.finish(id, token, &finish).await {
            Ok(_) => Error::ResponseTooLarge { size, limit },
            Err(e) => Error::Store(e),
        }
    }

    /// Keeps `record`'s answer in the replay cache when it is final: `since` is a point on
    /// this host's clock before the store wrote or read it, `now` the database's time then.
    fn keep_answer(
        &self,
        record: &KeyRecord,
        since: tokio::time::Instant,
        now: chrono::DateTime<chrono::Utc>,
    ) {
        let cfg = &*self.config;
        self.replays.keep(
            record,
            since,
            now,
            cfg.replay_cache_max_age,
            cfg.replay_cache_bytes,
        );
    }

    pub(crate) fn existing(
        &self,
        request: &IdempotentRequest,
        record: KeyRecord,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<Execution, Error> {
        let key = request.id.clone();
        if let Some(of) = &request.step
            && record.operation != request.operation
        {
            tracing::Span::current().record("outcome", "workflow_changed");
            return Err(Error::StepChanged {
                key: of.workflow.clone(),
                position: of.position,
                recorded: record.operation,
                found: Some(request.operation.clone()),
            });
        }
        if record.fingerprint != request.fingerprint {
            tracing::Span::current().record("outcome", "fingerprint_mismatch");
            return Err(Error::FingerprintMismatch {
                key,
                stored: record.fingerprint.to_string(),
                presented: request.fingerprint.to_string(),
            });
        }
        // An unsettled key that the claim did not take through this request's provider: an
        // attempt through the recorded one may have acted (`store::claimable`), so this request
        // must not reach another provider. A live lease is still answered "in flight".
        let unsettled = match record.state {
            KeyState::Processing => record.lease_expires_at.is_none_or(|exp| exp <= now),
            KeyState::Failed { retryable } => retryable,
            KeyState::Done => false,
        };
        if unsettled && record.provider != request.provider {
            tracing::Span::current().record("outcome", "provider_changed");
            return Err(Error::ProviderChanged {
                key,
                recorded: record.provider,
                requested: request.provider.clone(),
            });
        }
        match record.state {
            KeyState::Done | KeyState::Failed { retryable: false } => {
                tracing::Span::current().record("outcome", "replayed");
                match record.response {
                    Some(resp) => Ok(Execution::Replayed(resp)),
                    None => Err(Error::NoStoredResponse {
                        key,
                        state: record.state,
                        reason: record
                            .error
                            .unwrap_or_else(|| "no reason recorded".to_owned()),
                    }),
                }
            }
            KeyState::Processing => {
                let live = record.lease_expires_at.is_some_and(|exp| exp > now);
                if live {
                    tracing::Span::current().record("outcome", "in_flight");
                    let left = record
                        .lease_expires_at
                        .and_then(|exp| (exp - now).to_std().ok())
                        .unwrap_or_default();
                    Err(Error::InFlight {
                        key,
                        retry_after: left
                            .min(self.config.in_flight_retry_after)
                            .max(Duration::from_millis(100)),
                    })
                } else if request.is_workflow() {
                    // A workflow is taken over whenever its lease has run out, until its
                    // retention (less a lease) has passed: the claim refused it, so it has.
                    tracing::Span::current().record("outcome", "workflow_expired");
                    Err(Error::WorkflowExpired {
                        key,
                        retention: self.config.retention,
                    })
                } else {
                    tracing::Span::current().record("outcome", "unknown");
                    Err(Error::OutcomeUnknown {
                        key,
                        reason: record
                            .error
                            .unwrap_or_else(|| "the first attempt's lease expired".to_owned()),
                        retry_after: self.config.unknown_retry_after,
                    })
                }
            }
            // A retryable failure that the claim did not take: another retry just reclaimed it.
            KeyState::Failed { retryable: true } => Err(Error::InFlight {
                key,
                retry_after: self.config.in_flight_retry_after,
            }),
        }
    }
}

/// The takeover window of a key whose effect is the application's own (a queue consumer without
/// a provider, the webhook receiver): a later delivery takes a crashed or unknown run over
/// whenever its lease has run out, however old the key is. No provider's dedup window bounds
/// such a re-run, and the effect must be keyed by the message anyway (`docs/consumers.md`). The
/// stores cap it at `store::kit::MAX_DURATION_MS`. It is not bounded by the retention: a run
/// that crashed and was delivered again only after the retention would never be taken over, and
/// every later delivery would be left for a sweeper that has nobody to ask.
pub(crate) const LOCAL_EFFECT_TAKEOVER: Duration = Duration::MAX;

/// The local instant at which a takeover window closes: `window` counted from the key's first
/// claim (database clock), moved onto this process's clock from the claim, which was sent at
/// `asked` and answered with the database time `expires_at - lease` (no earlier than `asked`, so
/// the instant is never late). A takeover must send before it; a workflow starts no step after
/// it. `None` without a window, or when the window is too large to add (the store caps durations
/// at 100 years).
pub(crate) fn window_closes(
    lease: &Lease,
    lease_len: Duration,
    window: Option<Duration>,
    asked: tokio::time::Instant,
) -> Option<tokio::time::Instant> {
    let window = chrono::Duration::from_std(window?).ok()?;
    let lease_len = chrono::Duration::from_std(crate::store::kit::capped(lease_len)).ok()?;
    let db_now = lease.expires_at.checked_sub_signed(lease_len)?;
    let closes = lease.created_at.checked_add_signed(window)?;
    let left = (closes - db_now).to_std().unwrap_or_default();
    asked.checked_add(left)
}

/// Runs one request's `work` in `span`, and records its result and how long it took under
/// `operation` ([`record_result`]).
pub(crate) async fn measured(
    operation: &str,
    span: tracing::Span,
    work: impl Future<Output = Result<Execution, Error>>,
) -> Result<Execution, Error> {
    let started = std::time::Instant::now();
    let result = work.instrument(span).await;
    record_result(operation, &result, started.elapsed());
    result
}

/// The counters of one `execute` (`crate::telemetry`): what the caller was told.
pub(crate) fn record_result(operation: &str, result: &Result<Execution, Error>, took: Duration) {
    use crate::telemetry as t;
    match result {
        Ok(Execution::Replayed(_)) => t::replay(operation),
        Ok(Execution::Executed(_)) => t::operation_time(operation, took),
        Err(Error::InFlight { .. }) => t::in_flight(operation),
        Err(Error::FingerprintMismatch { .. }) => t::fingerprint_mismatch(operation),
        Err(Error::LeaseLost(_)) => t::lease_lost("worker"),
        Err(Error::Store(e)) => t::store_error(operation, e.is_unavailable()),
        Err(_) => {}
    }
}

/// Ends a worker's attempt that surely did nothing: the key becomes `failed{retryable}` (`why`
/// in its history, `error` on the row), and the caller gets [`Error::FailedRetryable`], or the
/// store's error when that write failed.
async fn fail_retryable(
    store: &dyn Store,
    id: &KeyId,
    token: LeaseToken,
    error: String,
    why: &str,
) -> Error {
    let finish = Finish {
        to: KeyState::Failed { retryable: true },
        response: None,
        error: Some(error.clone()),
        actor: Actor::Worker,
        reason: why.to_owned(),
    };
    match store.finish(id, token, &finish).await {
        Ok(_) => Error::FailedRetryable {
            key: id.clone(),
            reason: error,
        },
        Err(e) => e.into(),
    }
}
