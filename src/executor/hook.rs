//! What the executor asks of the layer above it for a workflow key, so that it imports nothing
//! above it (`ARCHITECTURE.md`). The workflow layer implements [`RunHook`], and the crate root
//! hands it to the executor (`crate::WORKFLOW_RUNS`): dependency inversion, with the crate
//! root as the one place where the two are wired together.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::Idempotency;
use crate::error::Error;
use crate::store::Lease;
use crate::{KeyId, Outcome};

/// A workflow key about to run: its executor and key, the `lease` a claim sent at `asked`
/// granted (claimed or taken over), and the key's takeover `window`.
pub(crate) struct RunStart<'a> {
    pub(crate) executor: &'a Idempotency,
    pub(crate) id: &'a KeyId,
    pub(crate) lease: &'a Lease,
    pub(crate) asked: Instant,
    pub(crate) window: Option<Duration>,
}

/// The run of a workflow key, as the executor drives it.
#[async_trait]
pub(crate) trait RunHook: Send + Sync {
    /// Before the operation runs: the state its [`Context`](super::Context) carries while it
    /// runs.
    async fn begin(&self, start: RunStart<'_>) -> Result<Arc<dyn RunState>, Error>;
}

/// One run's state, kept by the operation's [`Context`](super::Context).
#[async_trait]
pub(crate) trait RunState: Any + Send + Sync + std::fmt::Debug {
    /// After the operation returned `outcome`, before it is stored: the error that ends the
    /// run instead, if any (the key is then released for an operator).
    async fn after(
        &self,
        executor: &Idempotency,
        id: &KeyId,
        outcome: &Outcome,
    ) -> Result<Option<Error>, Error>;

    /// For the layer that made it, to read its own state back.
    fn as_any(&self) -> &dyn Any;
}
