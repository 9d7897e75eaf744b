//! Atomic phases: a workflow step whose effect is the application's own writes, committed in
//! one database transaction with the step's record (`docs/workflows.md`, "Atomic phases").
//!
//! The SQL stores hand out an [`AtomicPhase`](crate::store::phase::AtomicPhase) for the application's writes
//! (`PostgresStore::atomic_phase`, `MySqlStore::atomic_phase`);
//! [`Context::atomic_step`] claims the step, then the phase begins a transaction, runs the
//! writes, finishes the step `done` (fenced by the step's lease token, its history row
//! included) and commits. So the writes and the step's record are both there or both absent:
//!
//! * the writes fail: the transaction rolls back and the step becomes `failed{retryable}`;
//! * the step was taken over meanwhile (the fenced finish matches no row): it rolls back;
//! * the process dies before the commit: nothing was written, and the sweeper, seeing the step
//!   still `processing` once its lease ran out, makes it `failed{retryable}` (a step of
//!   kind [`KeyKind::AtomicStep`](crate::record::KeyKind::AtomicStep) is `processing` only while its transaction has not committed);
//! * when the workflow runs again, a committed step replays its answer and its writes are not
//!   made again.

use crate::error::Error;
use crate::executor::{Context, Execution};
use crate::store::phase::AtomicPhase;

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
        let result = executor
            .run_atomic(Self::step_request(step, of), Box::new(phase))
            .await;
        wf.note(result)
    }
}
