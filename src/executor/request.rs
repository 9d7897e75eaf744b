//! [`IdempotentRequest`]: one call to make idempotent, validated before anything touches the store.

use serde::Serialize;
use serde_json::Value;

use crate::error::RequestError;
use crate::fingerprint::{Fingerprint, canonical_json, parse_json};
use crate::key::{IdempotencyKey, KeyError, KeyId, Scope};
use crate::record::KeyKind;

/// A validated request: scope, key, operation, canonical body and its fingerprint.
///
/// ```
/// use idemflow::IdempotentRequest;
/// let r = IdempotentRequest::new("acct_1", "order-7", "payments.create",
///                      &serde_json::json!({"amount": 500, "currency": "usd"})).unwrap();
/// assert_eq!(r.canonical_body(), r#"{"amount":500,"currency":"usd"}"#);
/// assert!(IdempotentRequest::new("acct_1", "", "payments.create", &1).is_err());
/// ```
#[derive(Debug, Clone)]
pub struct IdempotentRequest {
    pub(crate) id: KeyId,
    pub(crate) operation: String,
    pub(crate) canonical: String,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) provider: Option<String>,
    pub(crate) provider_key: Option<String>,
    /// The length limit a derived provider key must fit (the provider's `KeySpec::max_len`
    /// when run through [`Idempotency::call`](crate::Idempotency::call)).
    pub(crate) key_max_len: usize,
    /// Set on the request of a workflow step: which workflow, which position.
    pub(crate) step: Option<StepOf>,
    /// The dedup window of the provider the request is sent through, when sent by
    /// [`Idempotency::call`](crate::Idempotency::call): `Some(None)` for a provider that does
    /// not dedupe by key. A retry takeover never outlasts it (`ExecutorConfig::retry_takeover_window`).
    pub(crate) dedup_window: Option<Option<std::time::Duration>>,
}

/// Which step of which workflow a request runs (set on a step's request).
#[derive(Debug, Clone)]
pub(crate) struct StepOf {
    pub(crate) workflow: KeyId,
    pub(crate) position: u32,
    /// The step's takeover window: the executor's `retry_takeover_window` for a step of any
    /// code; for a provider step, only when the provider replays a same-key re-send, and never
    /// longer than its dedup window (a step of a keyless provider is never taken over).
    pub(crate) takeover: Option<std::time::Duration>,
}

pub(crate) fn validate_operation(operation: &str) -> Result<(), RequestError> {
    // Same rules as keys: visible ASCII, 1..=255 bytes.
    IdempotencyKey::new(operation).map(|_| ()).map_err(|e| {
        RequestError::InvalidOperation(match e {
            KeyError::Empty { .. } => KeyError::Empty { what: "operation" },
            KeyError::TooLong { len, .. } => KeyError::TooLong {
                what: "operation",
                len,
            },
            KeyError::ForbiddenByte { byte, offset, .. } => KeyError::ForbiddenByte {
                what: "operation",
                byte,
                offset,
            },
            other => other,
        })
    })
}

impl IdempotentRequest {
    /// Builds a request from any serialisable body. A body that serialises an object member
    /// twice (e.g. through `#[serde(flatten)]`) is [`RequestError::DuplicateJsonKey`].
    ///
    /// # Examples
    ///
    /// ```
    /// use idemflow::IdempotentRequest;
    ///
    /// let body = serde_json::json!({"amount": 500, "currency": "eur"});
    /// let request = IdempotentRequest::new("acct_1", "order-42", "charge", &body)?;
    /// assert_eq!(request.operation(), "charge");
    /// // The key is checked: an empty one is refused.
    /// assert!(IdempotentRequest::new("acct_1", "", "charge", &body).is_err());
    /// # Ok::<(), idemflow::error::RequestError>(())
    /// ```
    pub fn new<B: Serialize + ?Sized>(
        scope: &str,
        key: &str,
        operation: &str,
        body: &B,
    ) -> Result<Self, RequestError> {
        // Through the bytes, not `to_value`: a `Value` keeps the last of two equal names.
        let bytes = serde_json::to_vec(body).map_err(RequestError::InvalidJson)?;
        Self::from_json_bytes(scope, key, operation, &bytes)
    }

    /// Builds a request from raw JSON bytes (an HTTP body); invalid JSON is
    /// [`RequestError::InvalidJson`], an object naming a member twice
    /// [`RequestError::DuplicateJsonKey`].
    pub fn from_json_bytes(
        scope: &str,
        key: &str,
        operation: &str,
        body: &[u8],
    ) -> Result<Self, RequestError> {
        let value = parse_json(body)?;
        Self::from_value(scope, key, operation, &value)
    }

    /// Builds a request from a JSON value.
    pub fn from_value(
        scope: &str,
        key: &str,
        operation: &str,
        body: &Value,
    ) -> Result<Self, RequestError> {
        let scope = Scope::new(scope).map_err(RequestError::InvalidScope)?;
        let key = IdempotencyKey::new(key).map_err(RequestError::InvalidKey)?;
        crate::key::check_client_key(&key).map_err(RequestError::InvalidKey)?;
        let canonical = canonical_json(body);
        let fingerprint = Fingerprint::compute(operation, &canonical);
        Self::with_fingerprint(
            KeyId::new(scope, key),
            operation.to_owned(),
            canonical,
            fingerprint,
        )
    }

    /// A request whose fingerprint was computed by the caller (the HTTP layer fingerprints
    /// method, path, query and body, and stores a request of its own choosing; a queue
    /// consumer fingerprints the parts of a message it names).
    pub(crate) fn with_fingerprint(
        id: KeyId,
        operation: String,
        canonical: String,
        fingerprint: Fingerprint,
    ) -> Result<Self, RequestError> {
        validate_operation(&operation)?;
        Ok(Self {
            id,
            operation,
            canonical,
            fingerprint,
            provider: None,
            provider_key: None,
            key_max_len: crate::provider_key::DEFAULT_LEN,
            dedup_window: None,
            step: None,
        })
    }

    /// Names the provider this operation calls, so the sweeper knows whom to ask.
    pub fn provider(mut self, provider: impl Into<String>) -> Self {
        self.provider = Some(provider.into());
        self
    }

    /// The request as sent through a provider of key rules `spec` named `name`
    /// ([`Idempotency::call`](crate::Idempotency::call), and the axum layer declared with
    /// [`IdempotencyLayer::provider`](crate::axum::IdempotencyLayer::provider)): the provider
    /// key is derived within the provider's length limit (unless the request sets one), and a
    /// retry takes the key over only inside the provider's dedup window, never for a provider
    /// that does not dedupe by key (a re-send would act again).
    pub(crate) fn sent_through(mut self, name: &str, spec: &crate::provider::KeySpec) -> Self {
        self.provider = Some(name.to_owned());
        self.key_max_len = spec.max_len;
        self.dedup_window = Some(spec.retention.filter(|_| spec.replays_same_key));
        self
    }

    /// Declares the request a **workflow**: its operation runs named steps
    /// ([`Context::step`](crate::Context::step), [`Context::call_step`](crate::Context::call_step)),
    /// each recorded under its own key, and does nothing to the outside world except through
    /// them. The key is marked [`KeyKind::Workflow`] (so the sweeper
    /// knows it), and a retry may take it over whenever its lease has run out,
    /// within its retention: the steps it already ran replay (`docs/workflows.md`).
    pub fn workflow(self) -> Self {
        self.provider(crate::record::WORKFLOW_MARKER)
    }

    /// Whether the request was declared a workflow ([`workflow`](Self::workflow)).
    pub fn is_workflow(&self) -> bool {
        KeyKind::of(self.provider.as_deref()) == KeyKind::Workflow
    }

    /// Sets the provider key explicitly instead of the default derivation
    /// ([`provider_key::derive`](crate::provider_key::derive)). It is stored at claim and reused
    /// on every attempt.
    pub fn provider_key(mut self, provider_key: impl Into<String>) -> Self {
        self.provider_key = Some(provider_key.into());
        self
    }

    /// Scope and key.
    pub fn id(&self) -> &KeyId {
        &self.id
    }

    /// The operation name.
    pub fn operation(&self) -> &str {
        &self.operation
    }

    /// The canonical JSON of the body.
    pub fn canonical_body(&self) -> &str {
        &self.canonical
    }

    /// The request fingerprint.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
}
