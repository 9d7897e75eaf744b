//! Atomic phases: a workflow step whose effect is the application's own writes, committed in
//! one database transaction with the step's record (`docs/workflows.md`, "Atomic phases").
//!
//! The SQL stores hand out an [`AtomicPhase`] for the application's writes
//! (`PostgresStore::atomic_phase`, `MySqlStore::atomic_phase`);
//! [`Context::atomic_step`] claims the step, then the phase begins a transaction, runs the
//! writes, finishes the step `done` (fenced by the step's lease token, its history row
//! included) and commits. So the writes and the step's record are both there or both absent:
//!
//! * the writes fail: the transaction rolls back and the step becomes `failed{retryable}`;
//! * the step was taken over meanwhile (the fenced finish matches no row): it rolls back;
//! * the process dies before the commit: nothing was written, and the sweeper, seeing the step
//!   still `processing` once its lease ran out, makes it `failed{retryable}` (a step of kind
//!   [`KeyKind::AtomicStep`](crate::record::KeyKind::AtomicStep) is `processing` only while its
//!   transaction has not committed);
//! * when the workflow runs again, a committed step replays its answer and its writes are not
//!   made again.

use tracing::{Instrument, info_span};

use crate::error::Error;
use crate::executor::heartbeat;
use crate::executor::{Context, Execution, Idempotency, IdempotentRequest, fail_retryable};
use crate::store::ClaimOutcome;
use crate::store::phase::{AtomicPhase, PhaseError, Prepare};

use super::Step;

impl Context {
    /// Runs the next step of this workflow as an **atomic phase**: `phase` (from the SQL
    /// store's `atomic_phase`) writes the application's rows and the step's record in one
    /// transaction. The first time, it commits both (or neither); when the workflow runs again,
    /// the recorded answer is returned and nothing is written again. See the module docs for
    /// every failure; the errors are those of [`Context::step`], and a failure of the writes is
    /// [`Error::FailedRetryable`] (rolled back; the workflow may run it again).
    pub async fn atomic_step(
        &self,
        step: Step,
        phase: impl AtomicPhase + 'static,
    ) -> Result<Execution, Error> {
        let step = step.with_provider(crate::record::ATOMIC_STEP_MARKER);
        let (wf, mut of) = self.workflow_for_step(&step, None)?;
        // Never taken over: a stale one surely did nothing (see the module docs).
        of.takeover = None;
        let executor = wf.executor.clone();
        let result = run_atomic(&executor, Self::step_request(step, of), Box::new(phase)).await;
        wf.note(result)
    }
}

/// Runs an atomic-phase step (`Context::atomic_step`): claims `request`'s key, then lets
/// `phase` write the application's rows and finish the key in one transaction, renewing the
/// lease meanwhile.
async fn run_atomic(
    executor: &Idempotency,
    request: IdempotentRequest,
    phase: Box<dyn AtomicPhase>,
) -> Result<Execution, Error> {
    let cfg = executor.config();
    let store = executor.store();
    let claim = executor.new_claim(&request);
    let asked = tokio::time::Instant::now();
    let lease = match store.claim(&claim).await? {
        ClaimOutcome::Existing { record, now } => {
            return executor.existing(&request, *record, now);
        }
        ClaimOutcome::Claimed(lease) => lease,
    };
    let id = request.id.clone();
    let span = info_span!(
        "idemflow.atomic_step",
        scope = %id.scope,
        key = %id.key,
        step = %request.operation,
    );
    let held_until = heartbeat::held_from(asked, cfg.lease);
    let (held, _watch) = heartbeat::LeaseWatch::new(lease.expires_at, held_until);
    let renew = heartbeat::renew(&**store, &id, lease.token, cfg.lease, &held);
    let prep_cfg = executor.shared_config().clone();
    let prepare: Prepare = std::sync::Arc::new(move |resp| {
        prep_cfg
            .prepare_answer(resp)
            .map_err(|(size, limit)| PhaseError::ResponseTooLarge { size, limit })
    });
    let committed = heartbeat::alongside(phase.commit(&id, lease.token, prepare), renew)
        .instrument(span)
        .await;
    match committed {
        Ok(resp) => Ok(Execution::Executed(resp)),
        Err(PhaseError::Writes(e)) => {
            // Rolled back: nothing happened, so a retry may run the step again.
            let error = format!("the step's writes failed and were rolled back: {e}");
            let why = "atomic phase rolled back; a retry runs it again";
            Err(fail_retryable(&**store, &id, lease.token, error, why).await)
        }
        Err(PhaseError::LeaseLost) => Err(Error::LeaseLost(
            crate::store::kit::refused_write(&**store, &id, Some(lease.token)).await,
        )),
        Err(PhaseError::Store(e)) => {
            // A failed commit may have committed: the row says. If it did not, the step
            // stays processing and the sweeper makes it retryable once its lease runs out.
            Err(Error::Store(e))
        }
        Err(PhaseError::ResponseTooLarge { size, limit }) => {
            // Rolled back; the same writes would give the same answer again, so the step
            // fails permanently, as an oversized answer of an operation does.
            Err(executor.too_large(&id, lease.token, size, limit).await)
        }
    }
}
