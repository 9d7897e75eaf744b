//! [`SweepReport`]: what one sweep did, for logs, the CLI's `--json` and exit codes.

use std::time::Duration;

use serde::Serialize;

use crate::KeyState;

/// Why a key is still unresolved after a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Unresolved {
    /// The provider could not say yet (unknown, lagging search, in flight); checked again later.
    Deferred,
    /// Nothing automatic can settle it (no provider recorded, provider not registered, key
    /// conflict at the provider): an operator must decide with `idemflow resolve`.
    NeedsOperator,
    /// The sweeper was shutting down and gave the key back untouched.
    Released,
    /// A workflow whose steps are all settled but that no resumer of this sweeper can run
    /// (the CLI sweeper cannot run application code): the next client retry, or an
    /// application sweeper with a resumer for its operation, continues it.
    WaitingForResumer,
}

/// One key the sweep could not settle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnresolvedKey {
    /// The scope.
    pub scope: String,
    /// The client's key.
    pub key: String,
    /// The operation name.
    pub operation: String,
    /// The provider recorded for the key, if any.
    pub provider: Option<String>,
    /// Claims and takeovers so far.
    pub attempts: i32,
    /// What kind of unresolved.
    pub kind: Unresolved,
    /// Why, as recorded in history.
    pub reason: String,
    /// When the sweeper looks again, in milliseconds from the sweep (`None`: at once).
    pub recheck_after_ms: Option<u64>,
}

/// One key another party decided while the sweeper held it (its write got `LeaseLost`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LostKey {
    /// The scope.
    pub scope: String,
    /// The client's key.
    pub key: String,
    /// What the store said.
    pub detail: String,
}

/// What one [`Sweeper::run_once`](super::Sweeper::run_once) did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SweepReport {
    /// Batches taken.
    pub batches: u32,
    /// Stale keys taken over.
    pub taken: u64,
    /// Keys finished `done`.
    pub done: u64,
    /// Keys finished `failed{permanent}`.
    pub failed_permanent: u64,
    /// Keys finished `failed{retryable}` (the provider surely did nothing).
    pub retryable: u64,
    /// Keys kept processing for a later check.
    pub deferred: u64,
    /// Keys that need an operator.
    pub needs_operator: u64,
    /// Keys given back untouched at shutdown.
    pub released: u64,
    /// Workflows waiting for a client retry or a resumer ([`Unresolved::WaitingForResumer`]).
    pub waiting_for_resumer: u64,
    /// Workflows a resumer ran (finished or not).
    pub resumed: u64,
    /// Keys someone else decided first (the sweeper's write was fenced out).
    pub lease_lost: u64,
    /// Provider `call`s made (re-drives).
    pub redrives: u64,
    /// Provider `lookup`s made.
    pub lookups: u64,
    /// The run stopped at the per-run key limit with keys possibly left.
    pub hit_key_limit: bool,
    /// The run stopped early for shutdown.
    pub shut_down: bool,
    /// How long the run took, in milliseconds.
    pub elapsed_ms: u64,
    /// The keys left unresolved, with reasons.
    pub unresolved: Vec<UnresolvedKey>,
    /// The keys whose lease was lost.
    pub lost: Vec<LostKey>,
}

impl SweepReport {
    /// Whether every key taken was settled (or settled by someone else): nothing deferred,
    /// nothing for an operator, nothing given back.
    pub fn is_clean(&self) -> bool {
        self.unresolved.is_empty()
    }

    /// Keys settled by this sweep.
    pub fn settled(&self) -> u64 {
        self.done + self.failed_permanent + self.retryable
    }

    /// One human line: `taken 10: done 7, failed 1, retryable 1, deferred 1, ...`.
    pub fn summary(&self) -> String {
        format!(
            "taken {}: done {}, failed(permanent) {}, failed(retryable) {}, deferred {}, needs operator {}, waiting for resumer {}, released {}, lease lost {} ({} re-drives, {} lookups, {} resumed, {} ms)",
            self.taken,
            self.done,
            self.failed_permanent,
            self.retryable,
            self.deferred,
            self.needs_operator,
            self.waiting_for_resumer,
            self.released,
            self.lease_lost,
            self.redrives,
            self.lookups,
            self.resumed,
            self.elapsed_ms
        )
    }

    pub(super) fn count_finish(&mut self, to: KeyState) {
        match to {
            KeyState::Done => self.done += 1,
            KeyState::Failed { retryable: false } => self.failed_permanent += 1,
            KeyState::Failed { retryable: true } => self.retryable += 1,
            KeyState::Processing => {}
        }
    }

    pub(super) fn push_unresolved(&mut self, u: UnresolvedKey) {
        match u.kind {
            Unresolved::Deferred => self.deferred += 1,
            Unresolved::NeedsOperator => self.needs_operator += 1,
            Unresolved::Released => self.released += 1,
            Unresolved::WaitingForResumer => self.waiting_for_resumer += 1,
        }
        self.unresolved.push(u);
    }
}

pub(super) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What [`Sweeper::run`](super::Sweeper::run) did until shutdown.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RunSummary {
    /// Sweeps completed.
    pub runs: u64,
    /// Sweeps that ended with an error (logged; the loop went on).
    pub errors: u64,
    /// The last completed sweep's report.
    pub last: Option<SweepReport>,
}
