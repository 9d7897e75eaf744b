#![cfg_attr(
    all(feature = "sqlite", feature = "http"),
    doc = include_str!("../../docs/http.md")
)]
#![cfg_attr(
    not(all(feature = "sqlite", feature = "http")),
    doc = "An axum / tower layer giving any handler `Idempotency-Key` semantics, on top of \
           [`Idempotency`] (feature `axum`). Its guide, `docs/http.md`, is rendered here when \
           the features `sqlite` and `http` are on too, as on docs.rs."
)]
// The stored closures answer with a `Response` (as axum's extractor rejections do); the public
// builders take any `IntoResponse` error, so callers' closures stay small.
#![allow(clippy::result_large_err)]

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::request::Parts;
use axum::http::{HeaderName, Method};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use crate::setters::setters;
use crate::{Idempotency, Provider, StoredResponse};

mod context;
mod key_header;
mod problem;
mod scope;
mod service;
pub mod webhook;

pub use context::{IdempotencyContext, NothingHappened};
pub use key_header::{KeyHeaderError, parse_key_bytes, parse_key_header};
pub use problem::{PROBLEM_JSON, Problem, retry_after_value};
pub use scope::ScopeSource;
pub use service::IdempotencyService;

/// The header a replayed answer carries: `Idempotent-Replayed: true`.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The header on an answer made without idempotency protection
/// ([`StoreDown::RunUnprotected`]): `Idempotency-Unprotected: store-unavailable`.
pub const UNPROTECTED_HEADER: &str = "idempotency-unprotected";

/// What the layer does when the idempotency store cannot be reached before the handler runs
/// ([`StoreError::is_unavailable`](crate::StoreError::is_unavailable)). See `docs/http.md`,
/// "When the store is down".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StoreDown {
    /// Answer 503 `store-unavailable` + `Retry-After`; the handler does not run, nothing is sent
    /// anywhere. Safe: the cost is visible downtime. The default.
    #[default]
    Refuse,
    /// Run the handler **without protection**: a retry of the same request may act again. Only
    /// for effects a duplicate cannot hurt. Every such request is logged at `warn`, counted in
    /// `idemflow_unprotected_requests_total`, and its answer carries
    /// `Idempotency-Unprotected: store-unavailable`. A store that fails after the handler ran
    /// (its answer not stored) is never a reason to run it again. Not applied to a
    /// [`workflow`](IdempotencyLayer::workflow) layer, which reads the store after its claim.
    ///
    /// A claim the database applied whose answer was lost with the connection leaves the key
    /// `processing`: with [`provider`](IdempotencyLayer::provider) set, the sweeper later
    /// settles it by asking the provider, which may send the stored request once more (with
    /// the stored provider key, which the unprotected run did not use). Choose this policy only
    /// where that second send is harmless too.
    RunUnprotected,
}

/// The default key header, `Idempotency-Key`.
pub const KEY_HEADER: &str = "idempotency-key";

/// Derives the scope from a request, or answers it (e.g. 401 without an account); see
/// [`ScopeSource::from_fn`].
pub type ScopeFn = Arc<dyn Fn(&Parts) -> Result<String, Response> + Send + Sync>;
/// Names the operation of a request.
pub type OperationFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;
/// Builds the request stored with the key from the request head and body, or answers it (a
/// refusal here is not stored: the client may correct the request and reuse the key).
pub type StoredRequestFn = Arc<dyn Fn(&Parts, &Bytes) -> Result<Value, Response> + Send + Sync>;
/// Rewrites a stored answer before it is replayed.
pub type ReplayFn = Arc<dyn Fn(&Parts, StoredResponse) -> StoredResponse + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) idem: Idempotency,
    pub(crate) methods: Vec<Method>,
    pub(crate) header: HeaderName,
    pub(crate) required: bool,
    pub(crate) scope: ScopeSource,
    pub(crate) stored_headers: Vec<String>,
    pub(crate) max_body_bytes: usize,
    pub(crate) operation: Option<OperationFn>,
    pub(crate) provider: Option<String>,
    /// The key rules of the provider [`IdempotencyLayer::provider`] declared (`None`: no
    /// provider, or a workflow): its length limit and dedup window, as `Idempotency::call`
    /// applies them.
    pub(crate) key_spec: Option<crate::provider::KeySpec>,
    /// The provider's secret fields ([`Provider::secret_fields`]), masked in the handler's
    /// answer before it is stored or given to the first caller.
    pub(crate) secret_fields: Vec<String>,
    pub(crate) stored_request: Option<StoredRequestFn>,
    pub(crate) replay: Option<ReplayFn>,
    pub(crate) store_down: StoreDown,
}

/// A tower [`Layer`](tower::Layer) making the protected methods of the services it wraps
/// idempotent by key. Cheap to clone. See the [module docs](self) for the semantics.
#[derive(Clone)]
pub struct IdempotencyLayer {
    settings: Arc<Settings>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.settings;
        f.debug_struct("IdempotencyLayer")
            .field("methods", &s.methods)
            .field("header", &s.header)
            .field("required", &s.required)
            .field("scope", &s.scope)
            .field("stored_headers", &s.stored_headers)
            .field("max_body_bytes", &s.max_body_bytes)
            .field("provider", &s.provider)
            .field("secret_fields", &s.secret_fields)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `idem` whose keys live in the scope `scope` names for each request (the
    /// tenant, account or API client: see [`ScopeSource`]). There is no default scope: one
    /// shared scope would let one caller replay another's answer. It protects POST and PATCH,
    /// reads `Idempotency-Key` (required), stores the headers `idem` is configured to keep (by
    /// default `content-type` and `location`), caps bodies at `idem`'s request cap, and names
    /// operations `METHOD:/matched/path`.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use axum::{Router, routing::post};
    /// use idemflow::axum::{IdempotencyLayer, ScopeSource};
    /// use idemflow::{Idempotency, Store, key::Scope, store::sqlite::SqliteStore};
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let idem = Idempotency::new(Arc::new(store));
    /// // One scope for a single caller; a service with tenants reads it from the request.
    /// let scope = ScopeSource::fixed(Scope::new("backoffice")?);
    /// let app: Router = Router::new()
    ///     .route("/payments", post(|| async { "charged" }))
    ///     .layer(IdempotencyLayer::new(idem, scope));
    /// # drop(app);
    /// # Ok(()) }
    /// ```
    pub fn new(idem: Idempotency, scope: ScopeSource) -> Self {
        let stored_headers = idem
            .config()
            .stored_headers
            .clone()
            .unwrap_or_else(|| vec!["content-type".to_owned(), "location".to_owned()])
            .iter()
            .map(|h| h.to_ascii_lowercase())
            .collect();
        let max_body_bytes = idem.config().max_request_bytes;
        // The layer chooses the headers itself, so the executor keeps what it is given.
        let idem = idem.stored_headers(None);
        Self {
            settings: Arc::new(Settings {
                idem,
                methods: vec![Method::POST, Method::PATCH],
                header: HeaderName::from_static(KEY_HEADER),
                required: true,
                scope,
                stored_headers,
                max_body_bytes,
                operation: None,
                provider: None,
                key_spec: None,
                secret_fields: Vec::new(),
                stored_request: None,
                replay: None,
                store_down: StoreDown::Refuse,
            }),
        }
    }

    /// The methods protected; others pass through untouched. Default POST and PATCH.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        Arc::make_mut(&mut self.settings).methods = methods;
        self
    }

    setters! { shared settings;
        /// The header carrying the key. Default `Idempotency-Key`.
        header_name(header: HeaderName);

        /// Whether a protected request without a key is refused (400, the default) or passed
        /// through unprotected.
        key_required(required: bool);
    }

    /// The response headers stored and replayed with the status and body (case-insensitive).
    /// Default: those of the [`Idempotency`] config, `content-type` and `location`.
    /// [`REPLAYED_HEADER`] is never stored: it marks idemflow's replays only.
    pub fn stored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let headers = headers.into_iter().map(|h| h.as_str().to_owned()).collect();
        Arc::make_mut(&mut self.settings).stored_headers = headers;
        self
    }

    setters! { shared settings;
        /// The largest request body accepted on protected requests (413 above). Default: the
        /// executor's request cap (64 KiB).
        max_body_bytes(max_body_bytes: usize);
    }

    /// One fixed operation name for every protected request (part of the fingerprint and of the
    /// derived provider key).
    pub fn operation(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.operation_with(move |_| name.clone())
    }

    /// Names the operation of each request. Default `METHOD:/matched/path` (the route's
    /// template when axum matched one, else the path), e.g. `POST:/payments`.
    pub fn operation_with<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts) -> String + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.settings).operation = Some(Arc::new(f));
        self
    }

    /// Declares every covered request a **workflow** (see
    /// [`IdempotentRequest::workflow`](crate::IdempotentRequest::workflow)): the handler acts
    /// only through steps ([`IdempotencyContext::step`], [`IdempotencyContext::call_step`]), a
    /// retry continues a crashed request from its first unfinished step, and the sweeper waits
    /// for the steps, then resumes it with a resumer or reports it waiting. Replaces
    /// [`provider`](Self::provider): a workflow's providers are its steps'.
    pub fn workflow(mut self) -> Self {
        let s = Arc::make_mut(&mut self.settings);
        s.provider = Some(crate::record::WORKFLOW_MARKER.to_owned());
        s.key_spec = None;
        s.secret_fields.clear();
        self
    }

    /// Records `provider`'s name as the provider of every key, so the sweeper (and `idemflow
    /// reconcile`) settles stuck keys by asking that provider, re-sending the stored request
    /// with the stored provider key. The handler must then send the provider exactly
    /// [`IdempotencyContext::request`] with [`IdempotencyContext::provider_key`].
    ///
    /// The provider's [secret fields](Provider::secret_fields) (Stripe: `client_secret`) are
    /// masked in the handler's answer before it is stored and before the first caller gets it,
    /// and its [key rules](Provider::key_spec) apply, as [`Idempotency::call`] does: the
    /// provider key is derived within the provider's length limit, and a retry takes over a
    /// crashed request's key (the executor's
    /// [`retry_takeover_window`](Idempotency::retry_takeover_window)) only inside the
    /// provider's dedup window, never for a provider that does not dedupe by key.
    pub fn provider(mut self, provider: &dyn Provider) -> Self {
        let name = provider.name().to_owned();
        let spec = provider.key_spec();
        let secrets = provider
            .secret_fields()
            .iter()
            .map(|f| (*f).to_owned())
            .collect();
        let s = Arc::make_mut(&mut self.settings);
        s.provider = Some(name);
        s.key_spec = Some(spec);
        s.secret_fields = secrets;
        self
    }

    /// How long a duplicate waits for the running first request's answer before it gets 409
    /// `request-in-flight` (`None` or zero: 409 at once). A duplicate that waits is answered the
    /// stored answer with `Idempotent-Replayed: true`, byte for byte what a later retry gets.
    /// Default: the executor's [`wait_in_flight`](Idempotency::wait_in_flight) (off unless set
    /// there); this sets it for this layer's routes only. See `docs/http.md`, "Waiting for the
    /// first answer".
    pub fn wait_in_flight(mut self, bound: Option<Duration>) -> Self {
        let s = Arc::make_mut(&mut self.settings);
        s.idem = s.idem.clone().wait_in_flight(bound);
        self
    }

    setters! { shared settings;
        /// What to do when the store cannot be reached before the handler runs. Default
        /// [`StoreDown::Refuse`] (503); [`StoreDown::RunUnprotected`] runs the handler without
        /// protection, loudly. Set it per route by layering routes separately.
        when_store_down(store_down: StoreDown);
    }

    /// Builds the request stored with the key (and given to the handler as
    /// [`IdempotencyContext::request`]) from the request head and body. Default: the body as
    /// JSON when it is JSON, else the body as a JSON string when it is UTF-8, else its SHA-256.
    ///
    /// It runs before the key is claimed, so it is also the place to validate: an `Err`
    /// response is sent as is and nothing is stored, so the client may fix the request and
    /// retry with the same key.
    pub fn stored_request<F, E>(mut self, f: F) -> Self
    where
        F: Fn(&Parts, &Bytes) -> Result<Value, E> + Send + Sync + 'static,
        E: IntoResponse,
    {
        let s = Arc::make_mut(&mut self.settings);
        s.stored_request = Some(Arc::new(move |p, b| {
            f(p, b).map_err(IntoResponse::into_response)
        }));
        self
    }

    /// Rewrites a stored answer before it is replayed (the `Idempotent-Replayed` header is added
    /// after). Answers written by the handler are replayed as stored, so this is the place to
    /// render the ones the sweeper settled from the provider's own answer.
    pub fn replay_with<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts, StoredResponse) -> StoredResponse + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.settings).replay = Some(Arc::new(f));
        self
    }

    /// The executor in use.
    pub fn idempotency(&self) -> &Idempotency {
        &self.settings.idem
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.settings.clone())
    }
}
