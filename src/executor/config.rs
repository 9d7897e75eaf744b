//! The settings of an executor: [`ExecutorConfig`], and the [`Redactor`] it applies to answers.

use std::time::Duration;

use crate::StoredResponse;
#[cfg(doc)]
use {super::Idempotency, crate::Error};

/// The settings of an [`Idempotency`] executor, as read back with [`Idempotency::config`].
///
/// This is a read-only view: every setting is set with the builder method of the same name on
/// [`Idempotency`] (`Idempotency::new(store).lease(..).retention(..)`).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ExecutorConfig {
    /// How long a claim holds the key before a sweeper (or a retry within the takeover window)
    /// may take it over. `execute` renews it every third of the lease while the operation runs,
    /// so a live operation keeps its key however long it takes, and a key orphaned by a crash
    /// is free again within one lease. Default 6 s: a renewal every 2 s, each with about 2 s to
    /// get through before the next is due and two that may fail before the lease runs out; an
    /// orphaned key is free within 6 s, so a sweep every 5 s answers it within about 12 s of a
    /// crash (`docs/reliability.md`, "Crash matrix").
    pub lease: Duration,
    /// How long a finished key is kept and replayed. Default 24 h.
    pub retention: Duration,
    /// Name recorded as the lease owner. Default `worker-<pid>`.
    pub owner: String,
    /// Whether the canonical request is stored (the sweeper needs it to re-drive). Default on.
    pub store_request: bool,
    /// Largest canonical request accepted, in bytes. Default 64 KiB.
    pub max_request_bytes: usize,
    /// Largest stored response (body + headers), in bytes. Default 1 MiB.
    pub max_response_bytes: usize,
    /// Response headers kept for replay (case-insensitive); `None` keeps all. Default
    /// `content-type` and `location`.
    pub stored_headers: Option<Vec<String>>,
    /// Lets a retry take over a processing key whose lease expired, within this window after
    /// the first claim. Only safe when the operation dedupes by the provider key inside that
    /// window. Default `None`: the sweeper settles expired keys. Through
    /// [`Idempotency::call`] the window is cut to the provider's own dedup window
    /// (`KeySpec::retention` when it replays same-key requests), and a provider that does not
    /// dedupe by key is never taken over.
    pub retry_takeover_window: Option<Duration>,
    /// `Retry-After` given to a duplicate whose first request is still running. Default 1 s.
    pub in_flight_retry_after: Duration,
    /// How long a duplicate whose first request is still running waits for that request's
    /// answer before it is refused with [`Error::InFlight`]. Default `None`: refused at once.
    /// A waiter gets the stored answer as a replay; it holds no connection and no lease while
    /// it waits, is woken at once by a finish written in this process and reads the key again
    /// after a backoff (10 ms doubling to 250 ms, jittered) otherwise (`docs/http.md`,
    /// "Waiting for the first answer").
    pub wait_in_flight: Option<Duration>,
    /// Most duplicates waiting at once in this executor and its clones; the excess are refused
    /// at once. Default 1,000.
    pub max_in_flight_waiters: usize,
    /// `Retry-After` given when the outcome is unknown. Default 5 s.
    pub unknown_retry_after: Duration,
    /// Applied to every response before it is stored (and so to what every caller, the first
    /// included, gets back): masks the application's own secret fields. Default none. The
    /// providers' secret fields are masked whatever this is ([`Provider::secret_fields`]).
    ///
    /// [`Provider::secret_fields`]: crate::Provider::secret_fields
    pub redact: Option<Redactor>,
    /// The bytes of finished keys' answers this executor keeps in memory, so that a replay
    /// needs no store round trip (`executor::replay_cache`). Default 16 MiB; zero turns the
    /// cache off. An entry lives until its key expires, and at most
    /// [`replay_cache_max_age`](Self::replay_cache_max_age).
    pub replay_cache_bytes: usize,
    /// How long a cached answer is given back at most. It bounds how long an operator's forced
    /// resolve of a finished key, made by another process, goes unseen by this one. Default 60 s.
    pub replay_cache_max_age: Duration,
}

/// A function that masks secrets in a response before it is stored
/// ([`Idempotency::redact_with`]).
#[derive(Clone)]
pub struct Redactor(
    pub(super) std::sync::Arc<dyn Fn(StoredResponse) -> StoredResponse + Send + Sync>,
);

impl Redactor {
    /// Masks `response` as it is masked before storing.
    pub(crate) fn apply(&self, response: StoredResponse) -> StoredResponse {
        (self.0)(response)
    }
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Redactor(..)")
    }
}

impl ExecutorConfig {
    /// An answer as it is stored: the header filter, then redaction; `Err((size, limit))` when
    /// it is still over `max_response_bytes`. Every answer goes through it, an operation's and
    /// an atomic phase's alike.
    pub(crate) fn prepare_answer(
        &self,
        mut resp: StoredResponse,
    ) -> Result<StoredResponse, (usize, usize)> {
        if let Some(allow) = &self.stored_headers {
            resp.retain_headers(allow);
        }
        if let Some(redactor) = &self.redact {
            resp = redactor.apply(resp);
        }
        match resp.stored_size() {
            size if size > self.max_response_bytes => Err((size, self.max_response_bytes)),
            _ => Ok(resp),
        }
    }

    pub(super) fn defaults() -> Self {
        Self {
            lease: Duration::from_secs(6),
            retention: Duration::from_secs(24 * 3600),
            owner: format!("worker-{}", std::process::id()),
            store_request: true,
            max_request_bytes: 64 * 1024,
            max_response_bytes: 1024 * 1024,
            stored_headers: Some(vec!["content-type".to_owned(), "location".to_owned()]),
            retry_takeover_window: None,
            in_flight_retry_after: Duration::from_secs(1),
            wait_in_flight: None,
            max_in_flight_waiters: 1000,
            unknown_retry_after: Duration::from_secs(5),
            redact: None,
            replay_cache_bytes: 16 << 20,
            replay_cache_max_age: Duration::from_secs(60),
        }
    }
}
