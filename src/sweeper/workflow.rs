//! A stale workflow key: wait for its steps, then resume it or report it waiting.
//!
//! A workflow acts only through its steps, and each step is a key of its own that this sweeper
//! settles from its provider like any single call. So the workflow key itself is never settled
//! from a provider: while one of its steps is unsettled it waits (deferred); once all are
//! settled, a resumer registered for its operation runs it to its end, or, without one, it is
//! reported as waiting for a resumer (the next client retry continues it).

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::decide::{self, SweeperDecision};
use super::report::{SweepReport, Unresolved};
use super::{KeyResult, Sweeper, lost_or};
use crate::error::{Error, StoreError};
use crate::record::KeyRecord;
use crate::{KeyId, KeyState};

/// The shortest wait before a workflow that waits for one of its steps is looked at again.
const STEP_RECHECK: Duration = Duration::from_secs(1);

impl Sweeper {
    pub(super) async fn handle_workflow(
        &self,
        id: &KeyId,
        record: KeyRecord,
        now: DateTime<Utc>,
        report: &mut SweepReport,
    ) -> Result<KeyResult, StoreError> {
        // Steps first: each is settled as a key of its own (in this batch or a later one).
        let steps = crate::workflow::steps(&*self.store, id).await?;
        if let Some((position, step)) = crate::workflow::unsettled_step(&steps) {
            tracing::Span::current().record("decision", "wait_for_step");
            let reason = format!(
                "workflow waits for its step {position} ({}) to be settled",
                step.operation
            );
            // Not after the whole exponential backoff (the workflow itself did nothing): look
            // again when the step can next move, when its holder's lease runs out or its own
            // next check is due, at least STEP_RECHECK from now and at most the backoff. A step orphaned with its resumer (a
            // sweeper that died mid-step) is settled within about a lease, and the workflow
            // follows a moment later.
            // A step this sweeper holds (taken in the same batch) is settled in this sweep.
            let ours = step.lease_owner.as_deref() == Some(self.config.owner.as_str());
            let due = [step.lease_expires_at.filter(|_| !ours), step.next_check_at]
                .into_iter()
                .flatten()
                .max();
            let cfg = &self.config;
            let backoff = decide::backoff(record.attempts, cfg.backoff_base, cfg.backoff_cap, None);
            let recheck = due
                .and_then(|at| (at - now).to_std().ok())
                .unwrap_or_default()
                .max(STEP_RECHECK)
                .min(backoff);
            return self
                .release_unresolved(id, &record, Unresolved::Deferred, reason, recheck)
                .await;
        }
        let Some((executor, resume)) = self.resumers.0.get(&record.operation).cloned() else {
            tracing::Span::current().record("decision", "wait_for_resumer");
            let reason = format!(
                "workflow {:?}: every step so far is settled; the next client retry or a \
                 sweeper with a resumer for {:?} continues it",
                record.operation, record.operation
            );
            return self.wait_for_resumer(id, &record, reason).await;
        };
        // The same bound the executor keeps (`workflow::step_window`): past it, a step's
        // record may be purged and resuming could run it again. It follows the retention stored
        // with the workflow and its steps, not the executor's current one.
        let cfg = executor.config();
        let window = crate::workflow::step_window(&*self.store, &record, &steps, cfg.lease).await?;
        let closes = chrono::Duration::from_std(window)
            .ok()
            .and_then(|w| record.created_at.checked_add_signed(w));
        if closes.is_some_and(|c| now >= c) {
            tracing::Span::current().record("decision", "needs_operator");
            let e = Error::WorkflowExpired {
                key: id.clone(),
                retention: crate::workflow::stored_retention(&record),
            };
            let decision = SweeperDecision::NeedsOperator {
                reason: e.to_string(),
            };
            return self.apply(id, &record, decision).await;
        }
        tracing::Span::current().record("decision", "resume");
        report.resumed += 1;
        crate::telemetry::sweeper("resume");
        match crate::workflow::resume(&executor, &record, resume).await {
            Ok(to) => Ok(KeyResult::Finished(to)),
            Err(Error::FailedRetryable { .. }) => {
                Ok(KeyResult::Finished(KeyState::Failed { retryable: true }))
            }
            Err(Error::LeaseLost(e)) => lost_or(e, &record),
            Err(Error::Store(e)) => Err(e),
            Err(e @ (Error::StepChanged { .. } | Error::WorkflowExpired { .. })) => {
                let decision = SweeperDecision::NeedsOperator {
                    reason: e.to_string(),
                };
                self.apply(id, &record, decision).await
            }
            // The workflow did not finish (a step's outcome is unknown, a step is in flight):
            // the executor released it; look again after the usual backoff.
            Err(e) => {
                let decision = SweeperDecision::Defer {
                    reason: format!("resumed workflow did not finish: {e}"),
                    retry_after: None,
                };
                self.apply(id, &record, decision).await
            }
        }
    }

    async fn wait_for_resumer(
        &self,
        id: &KeyId,
        record: &KeyRecord,
        reason: String,
    ) -> Result<KeyResult, StoreError> {
        let cfg = &self.config;
        let recheck = decide::backoff(record.attempts, cfg.backoff_base, cfg.backoff_cap, None);
        tracing::info!(reason = %reason, "workflow waits for a resumer");
        self.release_unresolved(id, record, Unresolved::WaitingForResumer, reason, recheck)
            .await
    }
}
