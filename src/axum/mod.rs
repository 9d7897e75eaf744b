//! An axum / tower layer giving any handler `Idempotency-Key` semantics
//! (draft-ietf-httpapi-idempotency-key-header), on top of [`Idempotency`] (feature `axum`).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use axum::{Router, routing::post, http::{HeaderName, StatusCode}};
//! use idemflow::{Idempotency, Store, store::sqlite::SqliteStore};
//! use idemflow::axum::{IdempotencyContext, IdempotencyLayer};
//!
//! let store = SqliteStore::connect("sqlite::memory:").await?;
//! store.migrate().await?;
//! let idem = Idempotency::new(Arc::new(store));
//!
//! async fn create(ctx: IdempotencyContext, body: String) -> (StatusCode, String) {
//!     // Forward ctx.provider_key() to the provider as its idempotency key.
//!     (StatusCode::CREATED, format!("created {}", ctx.key()))
//! }
//! let app: Router = Router::new()
//!     .route("/payments", post(create))
//!     .layer(IdempotencyLayer::new(idem).scope_from_header(HeaderName::from_static("x-account-id")));
//! # Ok(())
//! # }
//! ```
//!
//! | Situation                                              | Answer                                   |
//! |--------------------------------------------------------|------------------------------------------|
//! | method not protected (default: only POST and PATCH)    | passed through                           |
//! | key missing, required (default)                        | 400 `key-missing`                        |
//! | key missing, optional                                  | passed through, nothing stored           |
//! | key malformed, or sent twice                           | 400 `key-malformed`, with the reason     |
//! | scope cannot be derived                                | whatever the scope function answers      |
//! | body larger than the cap                               | 413 `body-too-large`                     |
//! | same key, other method / path / query / body           | 422 `key-reused`                         |
//! | first request with the key still running               | 409 `request-in-flight` + `Retry-After`  |
//! | handler answers 1xx-4xx                                | that answer, stored (2xx/3xx `done`, 4xx `failed{permanent}`) |
//! | handler answers 5xx                                    | that answer (+ `Retry-After`), not stored; key left `processing` for the sweeper |
//! | handler marks its answer [`NothingHappened`]                 | that answer, not stored; key `failed{retryable}`, the next retry runs it |
//! | retry after a stored answer                            | the stored status, headers, body + `Idempotent-Replayed: true` |
//! | retry while the outcome is unknown                     | 503 `outcome-unknown` + `Retry-After`    |
//! | the store fails                                        | 500 `store-error`                        |
//!
//! Every answer the layer makes itself is `application/problem+json` ([`Problem`]). The inner
//! service's own errors pass through unchanged (`Error = S::Error`); the key is then left for
//! the sweeper, like a 5xx.
//!
//! The fingerprint covers the method, the path and query, and the body (JSON bodies compared as
//! canonical JSON, other bodies by their bytes' SHA-256). The request *stored* with the key, which
//! the sweeper re-sends to the provider named by [`IdempotencyLayer::provider`], is by default
//! the JSON body; [`IdempotencyLayer::stored_request`] chooses another. See `docs/http.md`.

// The stored closures answer with a `Response` (as axum's extractor rejections do); the public
// builders take any `IntoResponse` error, so callers' closures stay small.
#![allow(clippy::result_large_err)]

use std::fmt;
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::request::Parts;
use axum::http::{HeaderName, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use crate::{Idempotency, StoredResponse};

mod context;
mod key_header;
mod problem;
mod service;

pub use context::{IdempotencyContext, NothingHappened};
pub use key_header::{KeyHeaderError, parse_key_bytes, parse_key_header};
pub use problem::{PROBLEM_JSON, Problem, retry_after_value};
pub use service::IdempotencyService;

/// The header a replayed answer carries: `Idempotent-Replayed: true`.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The default key header, `Idempotency-Key`.
pub const KEY_HEADER: &str = "idempotency-key";

/// Derives the scope from a request, or answers it (e.g. 401 without an account).
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
    pub(crate) scope: ScopeFn,
    pub(crate) stored_headers: Vec<String>,
    pub(crate) max_body_bytes: usize,
    pub(crate) operation: Option<OperationFn>,
    pub(crate) provider: Option<String>,
    pub(crate) stored_request: Option<StoredRequestFn>,
    pub(crate) replay: Option<ReplayFn>,
}

/// The default scope when none is configured.
pub const DEFAULT_SCOPE: &str = "default";

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
            .field("stored_headers", &s.stored_headers)
            .field("max_body_bytes", &s.max_body_bytes)
            .field("provider", &s.provider)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `idem`: protects POST and PATCH, reads `Idempotency-Key` (required), one
    /// fixed scope ([`DEFAULT_SCOPE`]), stores the headers `idem` is configured to keep (by
    /// default `content-type` and `location`), caps bodies at `idem`'s request cap, and names
    /// operations `METHOD:/matched/path`.
    pub fn new(idem: Idempotency) -> Self {
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
                scope: Arc::new(|_| Ok(DEFAULT_SCOPE.to_owned())),
                stored_headers,
                max_body_bytes,
                operation: None,
                provider: None,
                stored_request: None,
                replay: None,
            }),
        }
    }

    fn set(mut self, f: impl FnOnce(&mut Settings)) -> Self {
        f(Arc::make_mut(&mut self.settings));
        self
    }

    /// The methods protected; others pass through untouched. Default POST and PATCH.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.set(|s| s.methods = methods)
    }

    /// The header carrying the key. Default `Idempotency-Key`.
    pub fn header_name(self, name: HeaderName) -> Self {
        self.set(|s| s.header = name)
    }

    /// Whether a protected request without a key is refused (400, the default) or passed
    /// through unprotected.
    pub fn key_required(self, required: bool) -> Self {
        self.set(|s| s.required = required)
    }

    /// Derives the scope (tenant, account, API client) from the request: keys live per scope,
    /// so one scope never sees, blocks or replays another's. Answer `Err(response)` to refuse
    /// the request (it is sent as is, and nothing is stored).
    pub fn scope<F, E>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> Result<String, E> + Send + Sync + 'static,
        E: IntoResponse,
    {
        self.set(|s| s.scope = Arc::new(move |p| f(p).map_err(IntoResponse::into_response)))
    }

    /// Every request in one fixed scope.
    pub fn fixed_scope(self, scope: impl Into<String>) -> Self {
        let scope = scope.into();
        self.scope(move |_| Ok::<_, Response>(scope.clone()))
    }

    /// The scope is the value of `header` (e.g. `X-Account-Id`, set by your authentication);
    /// a request without it gets 400 `scope-missing`. Only use a header your own stack sets or
    /// verifies: the scope is what keeps tenants apart.
    ///
    /// Header names are case-insensitive: build the name with `HeaderName::from_static` in
    /// lowercase, or with `HeaderName::from_bytes` / `try_from` from any case (an invalid name
    /// is then a typed `InvalidHeaderName` error, never a panic).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idemflow::{Idempotency, store::sqlite::SqliteStore};
    /// use axum::http::HeaderName;
    /// use idemflow::axum::IdempotencyLayer;
    /// # async fn f(store: Arc<SqliteStore>) -> Result<(), axum::http::header::InvalidHeaderName> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(store))
    ///     .scope_from_header(HeaderName::try_from("X-Account-Id")?);
    /// # Ok(())
    /// # }
    /// ```
    pub fn scope_from_header(self, header: HeaderName) -> Self {
        let name = header;
        self.scope(
            move |parts| {
                match parts.headers.get(&name).map(|v| v.to_str()) {
                    Some(Ok(v)) if !v.trim().is_empty() => Ok(v.trim().to_owned()),
                    _ => Err(Problem::new(
                        StatusCode::BAD_REQUEST,
                        "scope-missing",
                        "Scope missing",
                    )
                    .detail(format!(
                        "the {name} header is required: it names the account this request acts for"
                    ))),
                }
            },
        )
    }

    /// The response headers stored and replayed with the status and body (case-insensitive).
    /// Default: those of the [`Idempotency`] config, `content-type` and `location`.
    pub fn stored_headers(self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let headers = headers.into_iter().map(|h| h.as_str().to_owned()).collect();
        self.set(|s| s.stored_headers = headers)
    }

    /// The largest request body accepted on protected requests (413 above). Default: the
    /// executor's request cap (64 KiB).
    pub fn max_body_bytes(self, limit: usize) -> Self {
        self.set(|s| s.max_body_bytes = limit)
    }

    /// One fixed operation name for every protected request (part of the fingerprint and of the
    /// derived provider key).
    pub fn operation(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.operation_with(move |_| name.clone())
    }

    /// Names the operation of each request. Default `METHOD:/matched/path` (the route's
    /// template when axum matched one, else the path), e.g. `POST:/payments`.
    pub fn operation_with<F>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> String + Send + Sync + 'static,
    {
        self.set(|s| s.operation = Some(Arc::new(f)))
    }

    /// Declares every covered request a **workflow** (see
    /// [`IdempotentRequest::workflow`](crate::IdempotentRequest::workflow)): the handler acts
    /// only through steps ([`IdempotencyContext::step`], [`IdempotencyContext::call_step`]), a
    /// retry continues a crashed request from its first unfinished step, and the sweeper waits
    /// for the steps, then resumes it with a resumer or reports it waiting. Replaces
    /// [`provider`](Self::provider): a workflow's providers are its steps'.
    pub fn workflow(self) -> Self {
        self.provider(crate::workflow::WORKFLOW_PROVIDER)
    }

    /// Records `name` as the provider of every key, so the sweeper (and `idemflow reconcile`)
    /// settles stuck keys by asking that provider, re-sending the stored request with the
    /// stored provider key. The handler must then send the provider exactly
    /// [`IdempotencyContext::request`] with [`IdempotencyContext::provider_key`].
    pub fn provider(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.set(|s| s.provider = Some(name))
    }

    /// Builds the request stored with the key (and given to the handler as
    /// [`IdempotencyContext::request`]) from the request head and body. Default: the body as
    /// JSON when it is JSON, else the body as a JSON string when it is UTF-8, else its SHA-256.
    ///
    /// It runs before the key is claimed, so it is also the place to validate: an `Err`
    /// response is sent as is and nothing is stored, so the client may fix the request and
    /// retry with the same key.
    pub fn stored_request<F, E>(self, f: F) -> Self
    where
        F: Fn(&Parts, &Bytes) -> Result<Value, E> + Send + Sync + 'static,
        E: IntoResponse,
    {
        self.set(|s| {
            s.stored_request = Some(Arc::new(move |p, b| {
                f(p, b).map_err(IntoResponse::into_response)
            }))
        })
    }

    /// Rewrites a stored answer before it is replayed (the `Idempotent-Replayed` header is added
    /// after). Answers written by the handler are replayed as stored, so this is the place to
    /// render the ones the sweeper settled from the provider's own answer.
    pub fn replay_with<F>(self, f: F) -> Self
    where
        F: Fn(&Parts, StoredResponse) -> StoredResponse + Send + Sync + 'static,
    {
        self.set(|s| s.replay = Some(Arc::new(f)))
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
