//! Metrics through the [`metrics`] facade: every name and label idemflow records, defined here
//! once (`docs/operations.md`, "Metrics", lists them with alert rules). The library only
//! records; the application installs a recorder or exporter if it wants them (the CLI serves
//! them in Prometheus text format with `reconcile --metrics-addr`). Without a recorder each
//! call is a no-op.

use std::time::Duration;

use crate::state::KeyState;

/// Counter: keys claimed by a worker (`transition`: `claim`, `reclaim`, `takeover`).
pub const CLAIMS: &str = "idemflow_claims_total";
/// Counter: requests answered from a stored outcome.
pub const REPLAYS: &str = "idemflow_replays_total";
/// Counter: requests refused because the first one is still running.
pub const IN_FLIGHT: &str = "idemflow_in_flight_total";
/// Counter: requests refused because the key was first used with another request.
pub const FINGERPRINT_MISMATCHES: &str = "idemflow_fingerprint_mismatches_total";
/// Counter: outcomes of operations that ran (`outcome`: `succeeded`, `rejected`, `retryable`,
/// `unknown`).
pub const OUTCOMES: &str = "idemflow_outcomes_total";
/// Counter: writes refused because the writer's lease was lost (`actor`: `worker`, `sweeper`).
pub const LEASE_LOST: &str = "idemflow_lease_lost_total";
/// Counter: the sweeper's decisions per key (`decision`: `done`, `failed_permanent`,
/// `retryable`, `deferred`, `needs_operator`, `waiting_for_resumer`, `released`, `lease_lost`)
/// and its provider calls (`decision`: `redrive`, `lookup`, `resume`).
pub const SWEEPER_DECISIONS: &str = "idemflow_sweeper_decisions_total";
/// Histogram, seconds: one `execute` / `call`, from the claim to the stored outcome.
pub const OPERATION_SECONDS: &str = "idemflow_operation_duration_seconds";
/// Histogram, seconds: one store call made by the executor or the sweeper (`call`: `claim`,
/// `finish`, `release`, `take_stale`, `stats`).
pub const STORE_SECONDS: &str = "idemflow_store_duration_seconds";
/// Gauge: keys in `processing` (set by the sweeper after each run and by `idemflow stats`).
pub const PROCESSING_KEYS: &str = "idemflow_processing_keys";
/// Gauge: processing keys whose lease has run out (waiting for the sweeper).
pub const STALE_KEYS: &str = "idemflow_stale_keys";
/// Gauge, seconds: age of the oldest processing key (0 when none).
pub const OLDEST_PROCESSING_SECONDS: &str = "idemflow_oldest_processing_age_seconds";

/// Every metric name, for the docs test and exporters that want to describe them.
pub const ALL: &[&str] = &[
    CLAIMS,
    REPLAYS,
    IN_FLIGHT,
    FINGERPRINT_MISMATCHES,
    OUTCOMES,
    LEASE_LOST,
    SWEEPER_DECISIONS,
    OPERATION_SECONDS,
    STORE_SECONDS,
    PROCESSING_KEYS,
    STALE_KEYS,
    OLDEST_PROCESSING_SECONDS,
];

/// Registers a description of every metric with the installed recorder.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(CLAIMS, "Keys claimed by a worker, by transition");
    describe_counter!(REPLAYS, "Requests answered from a stored outcome");
    describe_counter!(
        IN_FLIGHT,
        "Requests refused: the first one is still running"
    );
    describe_counter!(
        FINGERPRINT_MISMATCHES,
        "Requests refused: key reused with another request"
    );
    describe_counter!(OUTCOMES, "Outcomes of operations that ran, by kind");
    describe_counter!(LEASE_LOST, "Writes refused because the lease was lost");
    describe_counter!(SWEEPER_DECISIONS, "Sweeper decisions and provider calls");
    describe_histogram!(
        OPERATION_SECONDS,
        Unit::Seconds,
        "One execute/call, claim to stored outcome"
    );
    describe_histogram!(STORE_SECONDS, Unit::Seconds, "One store call");
    describe_gauge!(PROCESSING_KEYS, "Keys in processing");
    describe_gauge!(STALE_KEYS, "Processing keys whose lease ran out");
    describe_gauge!(
        OLDEST_PROCESSING_SECONDS,
        Unit::Seconds,
        "Age of the oldest processing key"
    );
}

pub(crate) fn claim(operation: &str, transition: crate::state::Transition) {
    let t = match transition {
        crate::state::Transition::Claim => "claim",
        crate::state::Transition::Reclaim => "reclaim",
        crate::state::Transition::Takeover => "takeover",
        _ => "other",
    };
    metrics::counter!(CLAIMS, "operation" => operation.to_owned(), "transition" => t).increment(1);
}

pub(crate) fn replay(operation: &str) {
    metrics::counter!(REPLAYS, "operation" => operation.to_owned()).increment(1);
}

pub(crate) fn in_flight(operation: &str) {
    metrics::counter!(IN_FLIGHT, "operation" => operation.to_owned()).increment(1);
}

pub(crate) fn fingerprint_mismatch(operation: &str) {
    metrics::counter!(FINGERPRINT_MISMATCHES, "operation" => operation.to_owned()).increment(1);
}

pub(crate) fn outcome(operation: &str, outcome: &'static str) {
    metrics::counter!(OUTCOMES, "operation" => operation.to_owned(), "outcome" => outcome)
        .increment(1);
}

pub(crate) fn lease_lost(actor: &'static str) {
    metrics::counter!(LEASE_LOST, "actor" => actor).increment(1);
}

pub(crate) fn sweeper(decision: &'static str) {
    metrics::counter!(SWEEPER_DECISIONS, "decision" => decision).increment(1);
}

pub(crate) fn sweeper_finish(to: KeyState) {
    sweeper(match to {
        KeyState::Done => "done",
        KeyState::Failed { retryable: false } => "failed_permanent",
        KeyState::Failed { retryable: true } => "retryable",
        KeyState::Processing => "deferred",
    });
}

pub(crate) fn operation_time(operation: &str, took: Duration) {
    metrics::histogram!(OPERATION_SECONDS, "operation" => operation.to_owned())
        .record(took.as_secs_f64());
}

pub(crate) fn store_time(backend: &'static str, call: &'static str, took: Duration) {
    metrics::histogram!(STORE_SECONDS, "backend" => backend, "call" => call)
        .record(took.as_secs_f64());
}

/// Sets the key gauges from a store's [`Stats`](crate::store::Stats).
pub fn key_gauges(stats: &crate::store::Stats) {
    metrics::gauge!(PROCESSING_KEYS).set(stats.processing as f64);
    metrics::gauge!(STALE_KEYS).set(stats.stale as f64);
    let oldest = stats
        .oldest_processing_created_at
        .and_then(|t| (stats.now - t).to_std().ok())
        .unwrap_or_default();
    metrics::gauge!(OLDEST_PROCESSING_SECONDS).set(oldest.as_secs_f64());
}

/// Times `fut` as a store call.
pub(crate) async fn timed<T>(
    backend: &'static str,
    call: &'static str,
    fut: impl std::future::Future<Output = T>,
) -> T {
    let started = std::time::Instant::now();
    let out = fut.await;
    store_time(backend, call, started.elapsed());
    out
}
