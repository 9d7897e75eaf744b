//! Atomic phases: a workflow step whose effect is the application's own writes, committed in
//! one database transaction with the step's claim and answer (`docs/workflows.md`, "Atomic
//! phases"; `docs/one-commit.md`).
//!
//! The SQL stores hand out an [`AtomicPhase`] for the application's writes
//! (`SqliteStore::atomic_phase`, `PostgresStore::atomic_phase`, `MySqlStore::atomic_phase`);
//! [`Context::atomic_step`] runs it as [`Idempotency::execute_atomic`](crate::Idempotency::execute_atomic)
//! runs a request's: the phase begins a transaction, claims the step's key, runs the writes,
//! finishes the step `done` with their answer and commits. One commit per step, and nobody ever
//! sees the step `processing`, so the writes and the step's record are both there or both
//! absent:
//!
//! * the writes fail: everything rolls back, the step's claim included, and the step is
//!   [`Error::RolledBack`] (nothing was kept: [`Outcome::from_step_error`](crate::Outcome::from_step_error)
//!   makes the workflow retryable, and its retry runs the step again);
//! * the process dies before the commit: nothing was written, the step has no row, and the
//!   workflow's retry (or resumer) runs the step again;
//! * when the workflow runs again, a committed step replays its answer and its writes are not
//!   made again; a concurrent run of the same step waits for the first transaction to end.
//!
//! (Rows of kind [`KeyKind::AtomicStep`](crate::record::KeyKind::AtomicStep) left `processing`
//! by earlier versions, which claimed the step in a transaction of its own, are made
//! `failed{retryable}` by the sweeper once their lease ran out.)

use crate::error::Error;
use crate::executor::{Context, Execution, key_span, measured};
use crate::store::phase::AtomicPhase;

use super::Step;

impl Context {
    /// Runs the next step of this workflow as an **atomic phase**: `phase` (from the SQL
    /// store's `atomic_phase`) claims the step, writes the application's rows and the step's
    /// answer in one transaction, one commit. The first time, it commits all of it (or
    /// nothing); when the workflow runs again, the recorded answer is returned and nothing is
    /// written again. See the module docs for every failure; the errors are those of
    /// [`Idempotency::execute_atomic`](crate::Idempotency::execute_atomic) for the step's key
    /// (a failure of the writes is [`Error::RolledBack`]), plus [`Error::StepChanged`],
    /// [`Error::NotAWorkflow`] and [`Error::WorkflowExpired`]. A phase of another store than the
    /// workflow's executor's, or an executor on a store without transactions to share (Redis),
    /// is refused with [`Error::NoSharedTransaction`] before anything runs.
    pub async fn atomic_step(
        &self,
        step: Step,
        phase: impl AtomicPhase + 'static,
    ) -> Result<Execution, Error> {
        let (wf, of) = self.workflow_for_step(&step, None)?;
        let executor = wf.executor.clone();
        let request = Self::step_request(step, of);
        let span = key_span!("idemflow.atomic_step", request.id, step = request.operation);
        let operation = request.operation.clone();
        let work = executor.commit_once(request, Box::new(phase));
        wf.note(measured(&operation, span, work).await)
    }
}
