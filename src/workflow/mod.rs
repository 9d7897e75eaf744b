#![cfg_attr(
    all(feature = "sqlite", feature = "postgres", feature = "conformance"),
    doc = include_str!("../../docs/workflows.md")
)]
#![cfg_attr(
    not(all(feature = "sqlite", feature = "postgres", feature = "conformance")),
    doc = "Multi-step workflows: named steps inside one key, each step a key of its own, so a \
           finished step replays when the workflow runs again. Its guide, `docs/workflows.md`, \
           is rendered here when the features `sqlite`, `postgres` and `conformance` are on, as \
           on docs.rs."
)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::Outcome;
use crate::error::{Error, RequestError};
use crate::executor::StepOf;
use crate::executor::{Context, Execution, Idempotency, IdempotentRequest};
use crate::fingerprint::{Fingerprint, canonical_json, hex, parse_json};
use crate::key::{IdempotencyKey, KeyId, MAX_LEN, STEP_MARK};
use crate::provider::Provider;
use crate::record::KeyKind;

mod atomic;
mod run;

pub(crate) use run::{Runs, resume};

/// Most steps one workflow may run (positions `0..MAX_STEPS`).
pub const MAX_STEPS: u32 = 256;

/// The key of the step at `position` of the workflow `parent`: `<key>#step:<position>`, or, when
/// that would exceed 255 bytes, the first 32 hex digits of SHA-256 of the key in its place.
pub fn step_key(parent: &KeyId, position: u32) -> KeyId {
    let suffix = format!("{STEP_MARK}{position}");
    let key = parent.key.as_str();
    let value = if key.len() + suffix.len() <= MAX_LEN {
        format!("{key}{suffix}")
    } else {
        let digest = hex(&Sha256::digest(key.as_bytes()));
        format!("{}{suffix}", &digest[..32])
    };
    // Visible ASCII: the key was, the digest and the suffix are.
    let key = IdempotencyKey::new(value).expect("a step key is visible ASCII of at most 255 bytes");
    KeyId::new(parent.scope.clone(), key)
}

/// The step rows of the workflow `id`, in order (positions `0..`, up to the first missing one).
/// The last finished one (`done` or `failed{permanent}`) is the workflow's recovery point
/// ([`recovery_point`]).
pub async fn steps(
    store: &dyn crate::Store,
    id: &KeyId,
) -> Result<Vec<crate::record::KeyRecord>, crate::StoreError> {
    let mut steps = Vec::new();
    for position in 0..MAX_STEPS {
        match store.get(&step_key(id, position)).await? {
            Some(step) => steps.push(step),
            None => break,
        }
    }
    Ok(steps)
}

/// The recovery point of a workflow whose step rows are `steps` (as [`steps`] returns them):
/// the position and name of the last step of the finished prefix, `None` before any step
/// finished. Steps after it are still running, unknown, or retryable.
pub fn recovery_point(steps: &[crate::record::KeyRecord]) -> Option<(u32, &str)> {
    let finished = steps
        .iter()
        .take_while(|s| {
            matches!(
                s.state,
                crate::KeyState::Done | crate::KeyState::Failed { retryable: false }
            )
        })
        .count();
    let last = finished.checked_sub(1)?;
    Some((u32::try_from(last).ok()?, steps[last].operation.as_str()))
}

/// How long after the first claim of `workflow` a step may still start: until the first of its
/// steps' records may be purged, less one `lease` (a step started just before keeps running for
/// up to a lease). Judged from what the store holds, never from the executor's current
/// retention (a deploy may have changed it since the steps finished):
///
/// * each finished step (`steps`, as [`steps`] returns them) is kept until its own expiry, set
///   by the retention of the run that finished it;
/// * a step that ran and was purged leaves its history behind: then the window is closed;
/// * steps yet to run get the retention stored with the workflow row (its latest claim's).
///
/// See `docs/workflows.md`, "Takeover and retention".
pub(crate) async fn step_window(
    store: &dyn crate::Store,
    workflow: &crate::record::KeyRecord,
    steps: &[crate::record::KeyRecord],
    lease: std::time::Duration,
) -> Result<std::time::Duration, crate::StoreError> {
    let id = KeyId::new(workflow.scope.clone(), workflow.key.clone());
    let next = u32::try_from(steps.len()).unwrap_or(MAX_STEPS);
    if next < MAX_STEPS && !store.history(&step_key(&id, next)).await?.is_empty() {
        return Ok(std::time::Duration::ZERO);
    }
    let kept = steps
        .iter()
        .filter_map(|s| s.expires_at)
        .map(|at| (at - workflow.created_at).to_std().unwrap_or_default())
        .fold(stored_retention(workflow), std::cmp::Ord::min);
    Ok(kept.saturating_sub(lease))
}

/// The retention stored with `record` (by its latest claim).
pub(crate) fn stored_retention(record: &crate::record::KeyRecord) -> std::time::Duration {
    std::time::Duration::from_millis(u64::try_from(record.retention_ms).unwrap_or(0))
}

/// [`step_window`] of the workflow `id` as the store holds it now, and its stored retention.
pub(crate) async fn stored_step_window(
    store: &dyn crate::Store,
    id: &KeyId,
    lease: std::time::Duration,
) -> Result<(std::time::Duration, std::time::Duration), crate::StoreError> {
    let Some(workflow) = store.get(id).await? else {
        return Err(crate::StoreError::NotFound { key: id.clone() });
    };
    let steps = steps(store, id).await?;
    let window = step_window(store, &workflow, &steps, lease).await?;
    Ok((window, stored_retention(&workflow)))
}

/// The first step of `steps` (as [`steps`] returns them) still `processing`, with its
/// position: while there is one, the workflow waits for it to be settled (by its worker, or by
/// the sweeper from its provider) before anything may continue it.
pub fn unsettled_step(
    steps: &[crate::record::KeyRecord],
) -> Option<(u32, &crate::record::KeyRecord)> {
    steps
        .iter()
        .enumerate()
        .find(|(_, s)| s.state == crate::KeyState::Processing)
        .and_then(|(position, s)| Some((u32::try_from(position).ok()?, s)))
}

/// The workflow keys waiting for a resumer (or a client retry), oldest first: `processing`, no
/// worker holds them (the lease expired or was given back), and every step they ran so far is
/// settled ([`unsettled_step`] finds none). Nothing but a client retry or a sweeper with a
/// [resumer](crate::Sweeper::resumer) for their operation moves them on; `idemflow stats`
/// counts them.
///
/// It reads every processing key ([`OperatorStore::stuck`](crate::store::OperatorStore::stuck) with no age), then the
/// steps of each stale workflow among them: an operator's query, not one for a hot path.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use idemflow::workflow::{self, Step};
/// use idemflow::{Idempotency, IdempotentRequest, Outcome, Store, StoredResponse};
/// use idemflow::store::sqlite::SqliteStore;
///
/// let store: Arc<dyn Store> = Arc::new(SqliteStore::connect("sqlite::memory:").await?);
/// store.migrate().await?;
/// let idem = Idempotency::new(store.clone());
/// let order = IdempotentRequest::new("shop", "order-1", "checkout", &1)?.workflow();
/// // The first step finishes; then the workflow's own outcome is lost (as in a crash).
/// let run = idem.execute(order, |ctx| async move {
///     let charge = Step::new("charge", &500).unwrap();
///     let paid = ctx.step(charge, |_| async { Outcome::Succeeded(StoredResponse::new(201)) });
///     if let Err(e) = paid.await {
///         return Outcome::from_step_error(&e);
///     }
///     Outcome::unknown("the process died here")
/// }).await;
/// assert!(run.is_err());
/// let waiting = workflow::waiting_for_resumer(&*store).await?;
/// assert_eq!(waiting.len(), 1);
/// assert_eq!(waiting[0].key.as_str(), "order-1");
/// # Ok(())
/// # }
/// ```
pub async fn waiting_for_resumer(
    store: &dyn crate::Store,
) -> Result<Vec<crate::record::KeyRecord>, crate::StoreError> {
    let now = store.now().await?;
    let processing = store.stuck(std::time::Duration::ZERO, u32::MAX).await?;
    let mut waiting = Vec::new();
    for record in processing.oldest {
        let stale = record.lease_expires_at.is_none_or(|at| at <= now);
        if !stale || record.kind() != KeyKind::Workflow {
            continue;
        }
        let id = KeyId::new(record.scope.clone(), record.key.clone());
        if unsettled_step(&steps(store, &id).await?).is_none() {
            waiting.push(record);
        }
    }
    Ok(waiting)
}

/// One named step of a workflow, with the request it acts on (its fingerprint guards the step
/// like a request guards a key: the same step with a different request is refused).
///
/// ```
/// use idemflow::workflow::Step;
/// let charge = Step::new("charge", &serde_json::json!({"amount": 500})).unwrap()
///     .provider("stripe");
/// assert_eq!(charge.name(), "charge");
/// assert!(Step::new("", &1).is_err());
/// ```
#[derive(Debug, Clone)]
pub struct Step {
    pub(crate) name: String,
    pub(crate) canonical: String,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) provider: Option<String>,
}

impl Step {
    /// A step named `name` (the rules of an operation name: 1 to 255 bytes of visible ASCII)
    /// acting on `body`.
    pub fn new<B: Serialize + ?Sized>(name: &str, body: &B) -> Result<Self, RequestError> {
        let bytes = serde_json::to_vec(body).map_err(RequestError::InvalidJson)?;
        let value = parse_json(&bytes)?;
        crate::executor::validate_operation(name)?;
        let canonical = canonical_json(&value);
        let fingerprint = Fingerprint::compute(name, &canonical);
        Ok(Self {
            name: name.to_owned(),
            canonical,
            fingerprint,
            provider: None,
        })
    }

    /// Names the provider the step calls, so the sweeper knows whom to ask
    /// ([`Context::call_step`] sets it).
    pub fn provider(mut self, provider: impl Into<String>) -> Self {
        self.provider = Some(provider.into());
        self
    }

    /// The step's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The fields of an [`Error::StepChanged`], kept by the running workflow.
#[derive(Debug)]
pub(crate) struct Changed {
    key: KeyId,
    position: u32,
    recorded: String,
    found: Option<String>,
}

/// The running workflow, shared by the clones of its [`Context`].
#[derive(Debug)]
pub(crate) struct Workflow {
    pub(crate) executor: Idempotency,
    /// The position of the next step.
    pub(crate) next: AtomicU32,
    /// After this instant (this process's clock) no step may start: the steps' records may be
    /// purged from then on ([`step_window`] from its first claim).
    pub(crate) resume_by: Instant,
    /// The retention `resume_by` was judged by (the one stored with the workflow), for
    /// [`Error::WorkflowExpired`].
    pub(crate) retention: std::time::Duration,
    /// The first [`Error::StepChanged`] a step of this run met: the workflow then ends with it,
    /// whatever the operation returns.
    pub(crate) changed: std::sync::Mutex<Option<Changed>>,
}

impl Workflow {
    pub(crate) fn new(
        executor: Idempotency,
        resume_by: Instant,
        retention: std::time::Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            executor,
            next: AtomicU32::new(0),
            resume_by,
            retention,
            changed: std::sync::Mutex::new(None),
        })
    }

    /// How many steps the operation ran.
    pub(crate) fn steps_run(&self) -> u32 {
        self.next.load(Ordering::SeqCst)
    }

    /// Keeps the first `StepChanged` a step met (see `changed`).
    pub(crate) fn note(&self, result: Result<Execution, Error>) -> Result<Execution, Error> {
        if let Err(e) = &result {
            self.keep(e);
        }
        result
    }

    fn keep(&self, e: &Error) {
        if let Error::StepChanged {
            key,
            position,
            recorded,
            found,
        } = e
        {
            let mut changed = self.changed.lock().unwrap_or_else(|p| p.into_inner());
            changed.get_or_insert_with(|| Changed {
                key: key.clone(),
                position: *position,
                recorded: recorded.clone(),
                found: found.clone(),
            });
        }
    }

    /// The `StepChanged` a step of this run met, if any.
    pub(crate) fn take_changed(&self) -> Option<Error> {
        let changed = self
            .changed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        Some(Error::StepChanged {
            key: changed.key,
            position: changed.position,
            recorded: changed.recorded,
            found: changed.found,
        })
    }
}

impl Context {
    pub(crate) fn workflow_for_step(
        &self,
        step: &Step,
        provider: Option<&crate::provider::KeySpec>,
    ) -> Result<(&Workflow, StepOf), Error> {
        let wf = self
            .run
            .as_ref()
            .and_then(|run| run.as_any().downcast_ref::<Workflow>())
            .ok_or_else(|| Error::NotAWorkflow {
                key: self.id.clone(),
            })?;
        if Instant::now() >= wf.resume_by {
            return Err(Error::WorkflowExpired {
                key: self.id.clone(),
                retention: wf.retention,
            });
        }
        let position = wf.next.fetch_add(1, Ordering::SeqCst);
        if position >= MAX_STEPS {
            let e = Error::StepChanged {
                key: self.id.clone(),
                position,
                recorded: format!("nothing (at most {MAX_STEPS} steps)"),
                found: Some(step.name.clone()),
            };
            wf.keep(&e);
            return Err(e);
        }
        let window = wf.executor.config().retry_takeover_window;
        let takeover = match provider {
            None => window,
            Some(spec) if spec.replays_same_key => match (window, spec.retention) {
                (Some(w), Some(r)) => Some(w.min(r)),
                _ => None,
            },
            Some(_) => None,
        };
        Ok((
            wf,
            StepOf {
                workflow: self.id.clone(),
                position,
                takeover,
            },
        ))
    }

    pub(crate) fn step_request(step: Step, of: StepOf) -> IdempotentRequest {
        IdempotentRequest {
            id: step_key(&of.workflow, of.position),
            operation: step.name,
            canonical: step.canonical,
            fingerprint: step.fingerprint,
            provider: step.provider,
            provider_key: None,
            key_max_len: crate::provider_key::DEFAULT_LEN,
            dedup_window: None,
            step: Some(of),
        }
    }

    /// Runs the next step of this workflow at most once: the first time, `op` runs under the
    /// step's own claim and lease (its [`Context`] carries the step's provider key) and its
    /// outcome is stored; when the workflow runs again, the stored answer is returned without
    /// running `op`. Steps run one after the other, in the same order on every run: a step
    /// is known by its position and name.
    ///
    /// Errors are those of [`Idempotency::execute`] for the step's key (an unknown outcome is
    /// [`Error::OutcomeUnknown`]: return [`Outcome::from_step_error`] and the workflow waits for
    /// the sweeper), plus [`Error::StepChanged`] when the step recorded at this position has
    /// another name, [`Error::NotAWorkflow`] and [`Error::WorkflowExpired`].
    pub async fn step<F, Fut>(&self, step: Step, op: F) -> Result<Execution, Error>
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Outcome>,
    {
        let (wf, of) = self.workflow_for_step(&step, None)?;
        let executor = wf.executor.clone();
        wf.note(executor.execute(Self::step_request(step, of), op).await)
    }

    /// Runs the next step of this workflow through `provider` at most once
    /// ([`Idempotency::call`] for the step's key, whose provider key is derived within the
    /// provider's limits from the step's key and name). See [`step`](Self::step).
    pub async fn call_step(&self, step: Step, provider: &dyn Provider) -> Result<Execution, Error> {
        let spec = provider.key_spec();
        let (wf, of) = self.workflow_for_step(&step, Some(&spec))?;
        let executor = wf.executor.clone();
        wf.note(executor.call(Self::step_request(step, of), provider).await)
    }
}

impl Outcome {
    /// How a workflow should end when one of its steps returned `e`: the failure of a step
    /// that surely did nothing (a step `failed{retryable}`, an atomic step rolled back) lets the
    /// workflow be retried ([`Outcome::Retryable`]; its finished steps replay); anything else
    /// leaves the workflow `processing` ([`Outcome::Unknown`]) until the step is settled, the
    /// code is fixed, or an operator decides.
    pub fn from_step_error(e: &Error) -> Outcome {
        match e {
            Error::FailedRetryable { .. } | Error::RolledBack { .. } => {
                Outcome::retryable(format!("a step failed: {e}"))
            }
            _ => Outcome::unknown(format!("a step did not finish: {e}")),
        }
    }
}

/// The resumers a [`Sweeper`](crate::Sweeper) runs, by workflow operation name, each with the
/// executor whose settings (lease, retention) the workflow was started with.
#[derive(Clone, Default)]
pub(crate) struct Resumers(pub(crate) std::collections::HashMap<String, (Idempotency, Resume)>);

impl std::fmt::Debug for Resumers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<_> = self.0.keys().collect();
        names.sort();
        f.debug_tuple("Resumers").field(&names).finish()
    }
}

/// A resumer: the workflow's operation, registered with the sweeper by operation name
/// ([`Sweeper::resumer`](crate::Sweeper::resumer)).
pub type Resume = Arc<dyn Fn(Context) -> BoxedOutcome + Send + Sync>;

/// The future a [`Resume`] returns.
pub type BoxedOutcome = Pin<Box<dyn Future<Output = Outcome> + Send>>;
