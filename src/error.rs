//! Errors. Every variant is typed and keeps its source; nothing is stringly.

use std::time::Duration;

use crate::key::{KeyError, KeyId};
use crate::record::LeaseToken;
use crate::state::{InvalidTransition, KeyState};

mod outage;

/// A boxed error source from a backend driver.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors from a [`Store`](crate::Store).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The write carried a fencing token that is no longer the key's: another worker or the
    /// sweeper took the key over, or an operator decided it; or, for a renewal
    /// ([`Store::extend`](crate::Store::extend)), the holder had given the lease back. Nothing was
    /// changed.
    #[error(
        "lease lost on {key}: the write carried token {presented}, the key now has token {current} in state {state}; nothing was changed"
    )]
    LeaseLost {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// The token the caller presented.
        presented: LeaseToken,
        /// The key's token now.
        current: LeaseToken,
        /// The key's state now.
        state: KeyState,
    },
    /// No row for this key.
    #[error("no idempotency key {key}")]
    NotFound {
        /// The key (`scope/key` when shown).
        key: KeyId,
    },
    /// The state machine refuses the transition.
    #[error(transparent)]
    InvalidTransition(#[from] InvalidTransition),
    /// The database failed or could not be reached.
    #[error("{backend} store error: {source}")]
    Database {
        /// Which backend.
        backend: &'static str,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
    /// The store could not connect: the cause named, the URL with its password masked. A
    /// first connection is tried with a short timeout, so this comes in seconds.
    #[error("{backend}: cannot connect to {url}: {cause}: {source}")]
    Connect {
        /// Which backend.
        backend: &'static str,
        /// The URL, its password masked
        /// ([`redact_url`](crate::store::connect_error::redact_url)).
        url: String,
        /// Why, as far as the driver's error tells.
        cause: ConnectCause,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
    /// Applying idemflow's migrations failed.
    #[error("{backend} migration failed: {source}")]
    Migrate {
        /// Which backend.
        backend: &'static str,
        /// The migrator's error.
        #[source]
        source: BoxError,
    },
    /// A stored row could not be read back (a value outside what idemflow writes).
    #[error("{backend} store holds a row idemflow cannot read: {detail}")]
    Corrupt {
        /// Which backend.
        backend: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The store was configured wrongly (bad URL, bad option).
    #[error("store configuration: {0}")]
    Config(String),
    /// The write was applied on the primary, but fewer replicas than asked for acknowledged it
    /// within the timeout (Redis `WAIT`, see `store::redis::RedisConfig::wait`): a failover now
    /// could lose it. A claim that was not acknowledged is given back unused (`failed{retryable}`) when no
    /// earlier attempt may have acted, so its caller must not send anything and may retry with
    /// the same key; a finish that was not acknowledged stands on the primary and may be lost
    /// with it, in which case the sweeper settles the key again from the provider, or a retry
    /// runs it again with the same provider key (`docs/backends.md`, "Redis Sentinel").
    #[error(
        "{backend}: the {write} of {key} was acknowledged by {acknowledged} of the {wanted} replicas asked for within {timeout:?}; a failover could lose it"
    )]
    NotReplicated {
        /// Which backend.
        backend: &'static str,
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// Which write.
        write: ReplicatedWrite,
        /// How many replicas acknowledged it.
        acknowledged: u32,
        /// How many were asked for.
        wanted: u32,
        /// How long the primary waited.
        timeout: Duration,
    },
}

/// The write a [`StoreError::NotReplicated`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplicatedWrite {
    /// A claim ([`Store::claim`](crate::Store::claim)): nothing may be sent for it.
    Claim,
    /// A finish ([`Store::finish`](crate::Store::finish) or an operator's override): the
    /// answer may be lost with the primary.
    Finish,
}

impl std::fmt::Display for ReplicatedWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReplicatedWrite::Claim => "claim",
            ReplicatedWrite::Finish => "finish",
        })
    }
}

impl StoreError {
    /// Wraps a driver error.
    pub fn database(backend: &'static str, source: impl Into<BoxError>) -> Self {
        StoreError::Database {
            backend,
            source: source.into(),
        }
    }

    /// Whether the store could not be reached or could not write right now: the server down or
    /// restarting, the connection lost or refused, the pool exhausted, a SQLite file that is
    /// read-only, full or locked. Retrying later may succeed. The call that failed may still
    /// have been applied (a connection lost after its commit was sent); the key's fencing and
    /// the sweeper keep either case safe. The HTTP layer answers it 503 `store-unavailable`
    /// (`docs/http.md`, "When the store is down").
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Connect { .. } => true,
            StoreError::Database { source, .. } => outage::is_outage(&**source),
            _ => false,
        }
    }
}

/// A request that breaks a rule, found before anything touches the store: its key, scope or
/// operation name or its body (when the [`IdempotentRequest`](crate::IdempotentRequest) or
/// [`Step`](crate::workflow::Step) is built), or its size (when the executor checks it against its cap).
/// Nothing was run and no row was written. Inside an [`Error`] it is [`Error::Request`]; its
/// HTTP answer is [`RequestError::http_answer`] (400, or 413 for a request too large).
///
/// ```
/// use idemflow::{Error, IdempotentRequest, error::RequestError};
///
/// let e = IdempotentRequest::new("acct", "", "charge", &1).unwrap_err();
/// assert!(matches!(e, RequestError::InvalidKey(_)));
/// assert!(e.to_string().starts_with("invalid idempotency key: "));
/// let e = Error::from(e);
/// assert_eq!(e.http_answer().slug, "key-malformed");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The idempotency key broke a rule (HTTP 400).
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[source] KeyError),
    /// The scope broke a rule (HTTP 400).
    #[error("invalid scope: {0}")]
    InvalidScope(#[source] KeyError),
    /// The operation name broke a rule (HTTP 400).
    #[error("invalid operation name: {0}")]
    InvalidOperation(#[source] KeyError),
    /// The request body is not valid JSON (HTTP 400).
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    /// The request body names an object member twice (HTTP 400); it is refused, never read
    /// last-wins.
    #[error(
        "request body names the JSON object member {name:?} more than once; send each member once"
    )]
    DuplicateJsonKey {
        /// The repeated member name.
        name: String,
    },
    /// The canonical request is larger than the configured cap (HTTP 413).
    #[error("request of {size} bytes exceeds the cap of {limit} bytes")]
    RequestTooLarge {
        /// Canonical size in bytes.
        size: usize,
        /// The configured cap.
        limit: usize,
    },
}

impl From<crate::fingerprint::JsonError> for RequestError {
    fn from(e: crate::fingerprint::JsonError) -> Self {
        match e {
            crate::fingerprint::JsonError::DuplicateKey { name } => {
                RequestError::DuplicateJsonKey { name }
            }
            crate::fingerprint::JsonError::Syntax(e) => RequestError::InvalidJson(e),
        }
    }
}

/// Errors from [`Idempotency::execute`](crate::Idempotency::execute) and the calls built on it
/// (a provider call, a workflow's steps). A request that breaks a rule is [`Error::Request`];
/// the others are the protocol's answers and the store's failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request broke a rule (HTTP 400, or 413 when too large); nothing was run.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The same key was used with a different request (HTTP 422). Nothing was run.
    #[error(
        "idempotency key {key} was first used with a different request (stored fingerprint {stored}, this request {presented}); it is refused, not replayed"
    )]
    FingerprintMismatch {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// The fingerprint stored at first use.
        stored: String,
        /// This request's fingerprint.
        presented: String,
    },
    /// The first request with this key is still running (HTTP 409 + `Retry-After`).
    #[error("idempotency key {key} is in flight; retry after {retry_after:?}")]
    InFlight {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// How long to wait before retrying.
        retry_after: Duration,
    },
    /// The outcome of the operation is not known (a provider timed out after the request was
    /// sent, or a worker died). The key stays `processing` for the sweeper; retry later with the
    /// same key (HTTP 503 + `Retry-After`).
    #[error(
        "outcome for {key} is unknown ({reason}); the sweeper will settle it, retry after {retry_after:?}"
    )]
    OutcomeUnknown {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// What happened.
        reason: String,
        /// How long to wait before retrying.
        retry_after: Duration,
    },
    /// The operation failed in a way that surely did nothing; the key is `failed{retryable}` and
    /// a retry with the same key and request runs it again (HTTP 503).
    #[error("operation for {key} failed and may be retried with the same key: {reason}")]
    FailedRetryable {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// What happened.
        reason: String,
    },
    /// The response is larger than the configured cap. The operation did run, so the key is
    /// recorded as `failed{permanent}` with this reason (never deleted: deleting would let a
    /// retry run the operation a second time).
    #[error("response of {size} bytes exceeds the cap of {limit} bytes")]
    ResponseTooLarge {
        /// Stored size in bytes.
        size: usize,
        /// The configured cap.
        limit: usize,
    },
    /// The key was finished without a response to replay (for example an operator decision
    /// without one, or an oversized response); its recorded reason is returned.
    #[error("idempotency key {key} is {state} without a stored response: {reason}")]
    NoStoredResponse {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// Its state.
        state: KeyState,
        /// The recorded error or reason.
        reason: String,
    },
    /// This worker's lease was taken over before it stored its result; its result was not
    /// written (the provider key made both attempts the same operation).
    #[error(
        "lease lost: another process took the key over while this attempt ran; this attempt's result was not stored over the new owner's: {0}"
    )]
    LeaseLost(#[source] StoreError),
    /// The store failed.
    #[error("store: {0}")]
    Store(#[source] StoreError),
    /// The workflow's code no longer matches the steps recorded for the key: a step was renamed,
    /// removed or reordered between deploys. Nothing was run for it and nothing is skipped: the
    /// key stays `processing` for an operator (`docs/workflows.md`, "When the code changes").
    #[error(
        "workflow {key} changed: step {position} was recorded as {recorded:?} but the code {}",
        match found { Some(f) => format!("now runs {f:?} there"), None => "ended without running it".to_owned() }
    )]
    StepChanged {
        /// The workflow's key.
        key: KeyId,
        /// The step's position (0 for the first step).
        position: u32,
        /// The step name recorded at that position.
        recorded: String,
        /// The step the code runs there now (`None`: the code ended before that position).
        found: Option<String>,
    },
    /// A step was run through a [`Context`](crate::Context) whose request was not declared a
    /// workflow ([`IdempotentRequest::workflow`](crate::IdempotentRequest::workflow)), or from a
    /// step's own context (steps do not nest). Nothing was run.
    #[error(
        "{key} is not a workflow: declare the request with IdempotentRequest::workflow() to run steps (steps do not nest)"
    )]
    NotAWorkflow {
        /// The key (`scope/key` when shown).
        key: KeyId,
    },
    /// The workflow is older than the retention its finished steps are kept for, so a step's
    /// record may already be purged; resuming could run it again, so it is not resumed. The
    /// key stays `processing` for an operator.
    #[error(
        "workflow {key} was first claimed more than its retention ({retention:?}, less one lease) ago; its step records may be purged, so it is not resumed"
    )]
    WorkflowExpired {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// The retention the executor keeps finished keys for.
        retention: Duration,
    },
    /// The key's unsettled attempt went through another provider (HTTP 422): an attempt
    /// through `recorded` may have acted, so sending this request to `requested` could act a
    /// second time, and the sweeper would still ask only `recorded`. Nothing was sent. Retry
    /// through `recorded`, or use a new key once the first settles (`docs/design.md`, "One
    /// provider per attempt that may have acted").
    #[error(
        "idempotency key {key} is unsettled at provider {recorded:?}; refusing to send it through {requested:?}"
    )]
    ProviderChanged {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// The provider the key's row records (the one an attempt may have reached).
        recorded: Option<String>,
        /// The provider of this request.
        requested: Option<String>,
    },
    /// The application's writes of a one-commit run (`Idempotency::execute_atomic`, or
    /// `Context::atomic_step` for a step's key) failed: they and the key's claim were rolled
    /// back together, so nothing of this request was recorded and a retry with the same key
    /// runs them again (HTTP 503).
    #[error("the writes for {key} failed and were rolled back with the key's claim: {source}")]
    RolledBack {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// The writes' error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// `Idempotency::execute_atomic` cannot commit the application's writes with the key
    /// (HTTP 500, a mistake in the code, not in the request). Nothing was run.
    #[error("{key} cannot run in one commit with the application's writes: {reason}")]
    NoSharedTransaction {
        /// The key (`scope/key` when shown).
        key: KeyId,
        /// Why: the store has no transactions to share (Redis), the phase was made by
        /// another store, or the request names a provider.
        reason: &'static str,
    },
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        match e {
            e @ StoreError::LeaseLost { .. } => Error::LeaseLost(e),
            e => Error::Store(e),
        }
    }
}

/// How an [`Error`] is answered over HTTP: status, `Retry-After` and the problem kind. This is
/// the one error-to-HTTP mapping ([`Error::http_answer`], which answers a refused request with
/// [`RequestError::http_answer`]): [`Error::http_status`] and [`Error::retry_after`] read it, and
/// the axum layer answers every executor error with it (as `application/problem+json`).
///
/// ```
/// use std::time::Duration;
/// use idemflow::{Error, key::IdempotencyKey, KeyId, key::Scope};
///
/// let key = KeyId::new(Scope::new("acct").unwrap(), IdempotencyKey::new("k1").unwrap());
/// let e = Error::InFlight { key, retry_after: Duration::from_secs(2) };
/// assert!(e.to_string().starts_with("idempotency key acct/k1 is in flight"));
/// let a = e.http_answer();
/// assert_eq!((a.status, a.retry_after), (409, Some(Duration::from_secs(2))));
/// assert_eq!(a.problem_type(), "urn:idemflow:problem:request-in-flight");
/// assert_eq!(e.http_status(), a.status);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HttpAnswer {
    /// The HTTP status code.
    pub status: u16,
    /// The `Retry-After` a client should honour, if any.
    pub retry_after: Option<Duration>,
    /// The problem's slug: its type is `urn:idemflow:problem:<slug>`.
    pub slug: &'static str,
    /// The problem's title.
    pub title: &'static str,
}

impl HttpAnswer {
    /// The prefix of idemflow's problem types.
    pub const PROBLEM_TYPE_PREFIX: &'static str = "urn:idemflow:problem:";

    /// The problem type URI, `urn:idemflow:problem:<slug>`.
    pub fn problem_type(&self) -> String {
        format!("{}{}", Self::PROBLEM_TYPE_PREFIX, self.slug)
    }
}

/// The wait given when the error itself names none but a retry soon is the right move.
const RETRY_SOON: Duration = Duration::from_secs(1);
/// `Retry-After` when the store cannot be reached: long enough for a restart or a failover to
/// begin, short enough that clients come back soon after.
const STORE_DOWN_RETRY: Duration = Duration::from_secs(2);

impl RequestError {
    /// The HTTP answer to this refusal: 400 with the rule broken, or 413 for a request too large
    /// (no `Retry-After`: the same request would be refused again).
    pub fn http_answer(&self) -> HttpAnswer {
        let (status, slug, title) = match self {
            RequestError::InvalidKey(_) => (400, "key-malformed", "Idempotency key malformed"),
            RequestError::InvalidScope(_) => (400, "scope-invalid", "Scope invalid"),
            RequestError::InvalidOperation(_) => {
                (400, "operation-invalid", "Operation name invalid")
            }
            RequestError::InvalidJson(_) => (400, "body-invalid", "Request body invalid"),
            RequestError::DuplicateJsonKey { .. } => (
                400,
                "body-duplicate-key",
                "Request body names a member twice",
            ),
            RequestError::RequestTooLarge { .. } => (413, "body-too-large", "Request too large"),
        };
        HttpAnswer {
            status,
            retry_after: None,
            slug,
            title,
        }
    }

    /// The HTTP status code of [`http_answer`](Self::http_answer).
    pub fn http_status(&self) -> u16 {
        self.http_answer().status
    }
}

impl Error {
    /// The HTTP answer to this error (status, `Retry-After`, problem type and title), as the
    /// IETF draft and common practice give it.
    pub fn http_answer(&self) -> HttpAnswer {
        let (status, retry_after, slug, title) = match self {
            Error::Request(e) => return e.http_answer(),
            Error::FingerprintMismatch { .. } => (
                422,
                None,
                "key-reused",
                "Idempotency key reused with a different request",
            ),
            Error::InFlight { retry_after, .. } => (
                409,
                Some(*retry_after),
                "request-in-flight",
                "A request with this idempotency key is still in progress",
            ),
            Error::OutcomeUnknown { retry_after, .. } => (
                503,
                Some(*retry_after),
                "outcome-unknown",
                "The outcome of the first request is not known yet",
            ),
            Error::FailedRetryable { .. } => (
                503,
                Some(RETRY_SOON),
                "retryable",
                "The request failed without effect; retry it with the same key",
            ),
            Error::LeaseLost(_) => (
                503,
                Some(RETRY_SOON),
                "settled-elsewhere",
                "The key was settled by another process while this request ran",
            ),
            Error::NoStoredResponse { .. } | Error::ResponseTooLarge { .. } => (
                500,
                None,
                "no-stored-answer",
                "The request was handled but its answer was not stored",
            ),
            Error::Store(StoreError::NotReplicated { .. }) => (
                503,
                Some(RETRY_SOON),
                "store-not-replicated",
                "The idempotency store could not confirm the write on its replicas; retry with the same key",
            ),
            Error::Store(e) if e.is_unavailable() => (
                503,
                Some(STORE_DOWN_RETRY),
                "store-unavailable",
                "The idempotency store cannot be reached; retry later with the same key",
            ),
            Error::Store(_) => (500, None, "store-error", "Idempotency store error"),
            Error::StepChanged { .. } | Error::WorkflowExpired { .. } => (
                500,
                None,
                "workflow-needs-operator",
                "The workflow cannot be resumed safely; an operator must decide",
            ),
            Error::NotAWorkflow { .. } => (
                500,
                None,
                "not-a-workflow",
                "Steps were run outside a workflow",
            ),
            Error::ProviderChanged { .. } => (
                422,
                None,
                "provider-changed",
                "Idempotency key reused through another provider while its outcome is unsettled",
            ),
            Error::RolledBack { .. } => (
                503,
                Some(RETRY_SOON),
                "rolled-back",
                "The request failed and nothing of it was kept; retry it with the same key",
            ),
            Error::NoSharedTransaction { .. } => (
                500,
                None,
                "no-shared-transaction",
                "The request's writes cannot commit with its idempotency key",
            ),
        };
        HttpAnswer {
            status,
            retry_after,
            slug,
            title,
        }
    }

    /// The HTTP status code of [`http_answer`](Self::http_answer).
    pub fn http_status(&self) -> u16 {
        self.http_answer().status
    }

    /// The `Retry-After` a client should honour, if any (that of
    /// [`http_answer`](Self::http_answer)).
    pub fn retry_after(&self) -> Option<Duration> {
        self.http_answer().retry_after
    }
}

/// Why a connection could not be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectCause {
    /// Nothing listens at the address (the server is down, or the port is wrong).
    Refused,
    /// The host name does not resolve.
    UnknownHost,
    /// The server refused the credentials.
    AuthenticationFailed,
    /// The server has no database of that name.
    DatabaseMissing,
    /// The TLS handshake failed.
    Tls,
    /// No answer within the connect timeout.
    TimedOut,
    /// Anything else (the error's own message says what).
    Other,
}

impl std::fmt::Display for ConnectCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConnectCause::Refused => "connection refused",
            ConnectCause::UnknownHost => "unknown host",
            ConnectCause::AuthenticationFailed => "authentication failed",
            ConnectCause::DatabaseMissing => "database missing",
            ConnectCause::Tls => "TLS handshake failed",
            ConnectCause::TimedOut => "timed out",
            ConnectCause::Other => "connection failed",
        })
    }
}
