//! Metrics through the [`metrics`] facade: every name and label idemflow records, defined here
//! once (`docs/operations.md`, "Metrics", lists them with alert rules). The library only
//! records; the application installs a recorder or exporter if it wants them (the CLI serves
//! them in Prometheus text format with `reconcile --metrics-addr`). Without a recorder each
//! call is a no-op.

use std::time::Duration;

use crate::state::KeyState;

/// Declares every metric once: its name constant (with its doc), its kind, unit and
/// description; writes [`ALL`] and [`describe`] from the same list.
macro_rules! metrics_table {
    ($($(#[$doc:meta])* $name:ident = $value:literal, $kind:ident $(($unit:ident))?, $desc:literal;)*) => {
        $(
            $(#[$doc])*
            pub const $name: &str = $value;
        )*

        /// Every metric name, for the docs test and exporters that want to describe them.
        pub const ALL: &[&str] = &[$($name),*];

        /// Registers a description of every metric with the installed recorder.
        pub fn describe() {
            $(metrics_table!(@describe $kind, $name $(, metrics::Unit::$unit)?, $desc);)*
        }
    };
    (@describe counter, $($args:tt)*) => { metrics::describe_counter!($($args)*) };
    (@describe gauge, $($args:tt)*) => { metrics::describe_gauge!($($args)*) };
    (@describe histogram, $($args:tt)*) => { metrics::describe_histogram!($($args)*) };
}

metrics_table! {
    /// Counter: keys claimed by a worker (`transition`: `claim`, `reclaim`, `takeover`).
    CLAIMS = "idemflow_claims_total", counter, "Keys claimed by a worker, by transition";
    /// Counter: requests answered from a stored outcome.
    REPLAYS = "idemflow_replays_total", counter, "Requests answered from a stored outcome";
    /// Counter: requests refused because the first one is still running.
    IN_FLIGHT = "idemflow_in_flight_total", counter,
        "Requests refused: the first one is still running";
    /// Counter: duplicates that waited for their first request's answer
    /// ([`Idempotency::wait_in_flight`](crate::Idempotency::wait_in_flight)), by how the wait
    /// ended (`result`: `replayed`, `ran`, `timed_out`, `refused`, `other`, `cancelled`).
    IN_FLIGHT_WAITS = "idemflow_in_flight_waits_total", counter,
        "Duplicates that waited for the first request's answer, by how the wait ended";
    /// Counter: requests whose key could not be handled because of a store error (`kind`:
    /// `unavailable` for an outage, `other`).
    STORE_ERRORS = "idemflow_store_errors_total", counter,
        "Requests that met a store error, by kind (unavailable, other)";
    /// Counter: requests the HTTP layer ran without idempotency protection (`reason`:
    /// `store_unavailable`, with `StoreDown::RunUnprotected`).
    UNPROTECTED = "idemflow_unprotected_requests_total", counter,
        "Requests run without idempotency protection, by reason";
    /// Counter: requests refused because the key was first used with another request.
    FINGERPRINT_MISMATCHES = "idemflow_fingerprint_mismatches_total", counter,
        "Requests refused: key reused with another request";
    /// Counter: outcomes of operations that ran (`outcome`: `succeeded`, `rejected`,
    /// `retryable`, `unknown`).
    OUTCOMES = "idemflow_outcomes_total", counter, "Outcomes of operations that ran, by kind";
    /// Counter: writes refused because the writer's lease was lost (`actor`: `worker`,
    /// `sweeper`).
    LEASE_LOST = "idemflow_lease_lost_total", counter,
        "Writes refused because the lease was lost";
    /// Counter: the sweeper's decisions per key (`decision`: `done`, `failed_permanent`,
    /// `retryable`, `deferred`, `needs_operator`, `waiting_for_resumer`, `released`,
    /// `lease_lost`) and its provider calls (`decision`: `redrive`, `lookup`, `resume`).
    SWEEPER_DECISIONS = "idemflow_sweeper_decisions_total", counter,
        "Sweeper decisions and provider calls";
    /// Counter: messages a queue consumer's broker loop refused for good, by what became of
    /// them (`outcome`: `dead_lettered`, `dropped` with `Consumer::drop_refused`, and
    /// `dead_letter_failed`, left for redelivery).
    CONSUMER_REFUSED = "idemflow_consumer_refused_total", counter,
        "Messages a queue consumer refused, by what became of them";
    /// Histogram, seconds: one `execute` / `call`, from the claim to the stored outcome.
    OPERATION_SECONDS = "idemflow_operation_duration_seconds", histogram(Seconds),
        "One execute/call, claim to stored outcome";
    /// Histogram, seconds: one store call made by the executor or the sweeper (`call`:
    /// `claim`, `finish`, `release`, `take_stale`, `stats`).
    STORE_SECONDS = "idemflow_store_duration_seconds", histogram(Seconds), "One store call";
    /// Gauge: keys in `processing` (set by the sweeper after each run and by `idemflow stats`).
    PROCESSING_KEYS = "idemflow_processing_keys", gauge, "Keys in processing";
    /// Gauge: processing keys whose lease has run out (waiting for the sweeper).
    STALE_KEYS = "idemflow_stale_keys", gauge, "Processing keys whose lease ran out";
    /// Gauge, seconds: age of the oldest processing key (0 when none).
    OLDEST_PROCESSING_SECONDS = "idemflow_oldest_processing_age_seconds", gauge(Seconds),
        "Age of the oldest processing key";
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

pub(crate) fn in_flight_wait(operation: &str, result: &'static str) {
    metrics::counter!(IN_FLIGHT_WAITS, "operation" => operation.to_owned(), "result" => result)
        .increment(1);
}

pub(crate) fn store_error(operation: &str, unavailable: bool) {
    let kind = if unavailable { "unavailable" } else { "other" };
    metrics::counter!(STORE_ERRORS, "operation" => operation.to_owned(), "kind" => kind)
        .increment(1);
}

#[cfg(feature = "axum")]
pub(crate) fn unprotected(operation: &str, reason: &'static str) {
    metrics::counter!(UNPROTECTED, "operation" => operation.to_owned(), "reason" => reason)
        .increment(1);
}

pub(crate) fn fingerprint_mismatch(operation: &str) {
    metrics::counter!(FINGERPRINT_MISMATCHES, "operation" => operation.to_owned()).increment(1);
}

pub(crate) fn outcome(operation: &str, outcome: &'static str) {
    metrics::counter!(OUTCOMES, "operation" => operation.to_owned(), "outcome" => outcome)
        .increment(1);
}

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) fn consumer_refused(outcome: &'static str) {
    metrics::counter!(CONSUMER_REFUSED, "outcome" => outcome).increment(1);
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

/// Sets the key gauges from a count of the keys, or logs why there is none (the gauges keep
/// their last values).
pub(crate) fn key_gauges_from(counted: Result<crate::store::Stats, crate::StoreError>) {
    match counted {
        Ok(stats) => key_gauges(&stats),
        Err(e) => tracing::warn!(error = %e, "could not count keys for the gauges"),
    }
}

/// Keeps the key gauges (`idemflow_processing_keys`, `idemflow_stale_keys`,
/// `idemflow_oldest_processing_age_seconds`) current in a service that runs no
/// [`Sweeper`](crate::Sweeper) (the reconciler runs as a cron job, say): counts the keys now and
/// every `every`, until the returned guard is dropped. A sweeper sets the same gauges; run one or
/// the other in a process. A count that fails leaves the gauges as they were and is logged at
/// `warn`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemflow::StoreError> {
/// use std::{sync::Arc, time::Duration};
/// use idemflow::{Store, store::sqlite::SqliteStore};
/// let store = Arc::new(SqliteStore::connect("sqlite::memory:").await?);
/// store.migrate().await?;
/// // Kept for as long as the service serves `/metrics`.
/// let _gauges = idemflow::telemetry::report_key_gauges(store, Duration::from_secs(15));
/// # Ok(()) }
/// ```
///
/// # Panics
/// When called outside a Tokio runtime.
pub fn report_key_gauges(
    store: std::sync::Arc<dyn crate::store::OperatorStore>,
    every: Duration,
) -> KeyGauges {
    let every = every.max(Duration::from_millis(1));
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            key_gauges_from(store.stats().await);
        }
    });
    KeyGauges(task.abort_handle())
}

/// The task of [`report_key_gauges`]; dropping it stops the task.
#[derive(Debug)]
#[must_use = "the gauges stop being refreshed when this guard is dropped"]
pub struct KeyGauges(tokio::task::AbortHandle);

impl Drop for KeyGauges {
    fn drop(&mut self) {
        self.0.abort();
    }
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };

    /// Records what [`super::describe`] registers: (kind, name, unit).
    #[derive(Default)]
    struct Described(Mutex<Vec<(&'static str, String, Option<Unit>)>>);

    impl Described {
        fn note(&self, kind: &'static str, key: KeyName, unit: Option<Unit>) {
            let name = key.as_str().to_owned();
            self.0.lock().unwrap().push((kind, name, unit));
        }
    }

    impl Recorder for Described {
        fn describe_counter(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.note("counter", key, unit);
        }
        fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.note("gauge", key, unit);
        }
        fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.note("histogram", key, unit);
        }
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    /// Every metric of [`super::ALL`] is described once, as the kind its name says (a
    /// `*_total` is a counter), and every one measured in seconds says so.
    #[test]
    fn describe_registers_every_metric_once_with_its_kind_and_unit() {
        let recorder = Described::default();
        metrics::with_local_recorder(&recorder, super::describe);
        let described = recorder.0.into_inner().unwrap();
        let names: Vec<&str> = described.iter().map(|(_, n, _)| n.as_str()).collect();
        assert_eq!(names, super::ALL);
        for (kind, name, unit) in &described {
            assert_eq!(
                *kind == "counter",
                name.ends_with("_total"),
                "{name} is a {kind}"
            );
            let seconds = name.ends_with("_seconds");
            assert_eq!(
                *unit == Some(Unit::Seconds),
                seconds,
                "{name}: unit {unit:?}"
            );
        }
        let histograms = described.iter().filter(|(k, ..)| *k == "histogram").count();
        assert_eq!(histograms, 2, "{described:?}");
    }
}
