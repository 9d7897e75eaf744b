//! A workflow key's run through the executor: the workflow layer's side of the executor's hook
//! (`executor/hook.rs`), and the resumption of a stale workflow for the sweeper.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use tracing::Instrument;

use super::{Resume, Workflow, step_key, stored_step_window};
use crate::error::Error;
use crate::executor::hook::{RunHook, RunStart, RunState};
use crate::executor::{Idempotency, IdempotentRequest};
use crate::record::KeyRecord;
use crate::state::{KeyState, Transition};
use crate::store::Lease;
use crate::{KeyId, Outcome, provider_key};

/// The workflow layer's [`RunHook`], handed to the executor at the crate root.
pub(crate) struct Runs;

#[async_trait]
impl RunHook for Runs {
    async fn begin(&self, start: RunStart<'_>) -> Result<Arc<dyn RunState>, Error> {
        let RunStart {
            executor,
            id,
            lease,
            asked,
            window,
        } = start;
        let cfg = executor.config();
        // No step may start once its records may be purged: judged by the retention stored
        // with the workflow and its finished steps (`step_window`), which a key claimed now has
        // from this executor. A deadline too far to represent is none.
        let (steps_window, retention) = if lease.transition == Transition::Claim {
            (window, cfg.retention)
        } else {
            let (w, r) = stored_step_window(&**executor.store(), id, cfg.lease).await?;
            (Some(w), r)
        };
        let far = asked + Duration::from_secs(100 * 366 * 24 * 3600);
        let resume_by =
            crate::executor::window_closes(lease, cfg.lease, steps_window, asked).unwrap_or(far);
        Ok(Workflow::new(executor.clone(), resume_by, retention))
    }
}

#[async_trait]
impl RunState for Workflow {
    async fn after(
        &self,
        executor: &Idempotency,
        id: &KeyId,
        outcome: &Outcome,
    ) -> Result<Option<Error>, Error> {
        // The code changed: a step met a recorded step of another name, or (when it ended
        // well) a step is recorded after the last one this code ran. Never finished past it.
        Ok(match (self.take_changed(), outcome) {
            (Some(e), _) => Some(e),
            (None, Outcome::Succeeded(_) | Outcome::Rejected(_)) => {
                dropped_step(executor, id, self.steps_run()).await?
            }
            (None, _) => None,
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// After a workflow's operation ended well: the step recorded at the position after the last
/// one it ran, if any (the code dropped a step that already ran or was started).
async fn dropped_step(
    executor: &Idempotency,
    id: &KeyId,
    steps_run: u32,
) -> Result<Option<Error>, Error> {
    let next = step_key(id, steps_run);
    Ok(executor
        .store()
        .get(&next)
        .await?
        .map(|recorded| Error::StepChanged {
            key: id.clone(),
            position: steps_run,
            recorded: recorded.operation,
            found: None,
        }))
}

/// Runs a stale workflow's operation to its end under the lease the sweeper took it with
/// (`record.lease_token`, renewed here for one lease of `executor`). Its finished steps replay.
/// Returns the state the workflow was finished in.
pub(crate) async fn resume(
    executor: &Idempotency,
    record: &KeyRecord,
    op: Resume,
) -> Result<KeyState, Error> {
    let id = KeyId::new(record.scope.clone(), record.key.clone());
    let asked = Instant::now();
    let expires_at = executor
        .store()
        .extend(&id, record.lease_token, executor.config().lease)
        .await?;
    let span = crate::executor::key_span!("idemflow.resume", id, operation = record.operation);
    let Some(canonical) = record.request.clone() else {
        return Err(Error::NoStoredResponse {
            key: id.clone(),
            state: record.state,
            reason: "the workflow's request was not stored (store_request is off), so it \
                     cannot be resumed"
                .to_owned(),
        });
    };
    let request = IdempotentRequest {
        id,
        operation: record.operation.clone(),
        canonical,
        fingerprint: record.fingerprint.clone(),
        provider: record.provider.clone(),
        provider_key: Some(record.provider_key.clone()),
        key_max_len: provider_key::DEFAULT_LEN,
        dedup_window: None,
        step: None,
    };
    let lease = Lease {
        token: record.lease_token,
        expires_at,
        attempts: record.attempts,
        provider_key: record.provider_key.clone(),
        transition: Transition::Takeover,
        may_have_acted: true,
        created_at: record.created_at,
    };
    let (to, _) = executor
        .run_claimed(request, lease, asked, move |ctx| op(ctx))
        .instrument(span)
        .await?;
    Ok(to)
}
