//! [`IdempotencyService`]: the per-request logic of the layer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tracing::Instrument;

use super::context::{IdempotencyContext, NothingHappened};
use super::problem::{Problem, retry_after_value};
use super::{REPLAYED_HEADER, Settings, StoreDown, UNPROTECTED_HEADER, parse_key_header};
use crate::fingerprint::{Fingerprint, JsonError, canonical_json, hex, parse_json};
use crate::{
    Error, Execution, IdempotentRequest, KeyId, Outcome, StoredResponse, error::RequestError,
};

/// The service [`IdempotencyLayer`](super::IdempotencyLayer) wraps around an inner service.
pub struct IdempotencyService<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S: Clone> Clone for IdempotencyService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>) -> Self {
        Self { inner, settings }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S> tower::Service<Request> for IdempotencyService<S>
where
    S: tower::Service<Request, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        // Clone-and-swap: the service that was polled ready serves this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let settings = self.settings.clone();
        Box::pin(async move {
            if !settings.methods.contains(req.method()) {
                let mut inner = inner;
                return inner.call(req).await;
            }
            let span = tracing::info_span!(
                "idemflow.http",
                method = %req.method(),
                path = %req.uri().path(),
                scope = tracing::field::Empty,
                key = tracing::field::Empty,
                status = tracing::field::Empty,
            );
            let result = handle(settings, inner, req).instrument(span.clone()).await;
            if let Ok(resp) = &result {
                span.record("status", resp.status().as_u16());
            }
            result
        })
    }
}

/// What the handler produced while the key was claimed.
enum Produced<E> {
    Answer(Response),
    Failed(E),
}

async fn handle<S>(
    settings: Arc<Settings>,
    mut inner: S,
    req: Request,
) -> Result<Response, S::Error>
where
    S: tower::Service<Request, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    let Parsed {
        request,
        parts,
        bytes,
        operation,
    } = match parse(&settings, req).await {
        Ok(parsed) => parsed,
        Err(NotRun::PassThrough(parts, body)) => {
            return inner.call(Request::from_parts(parts, body)).await;
        }
        Err(NotRun::Answer(resp)) => return Ok(resp),
    };

    // Kept for a pass-through when the store is down (`StoreDown::RunUnprotected`); a clone
    // of `Bytes` shares the buffer. Never for a workflow: its run reads the store after the
    // claim, so a store error there does not mean the claim failed.
    let workflow = settings.provider.as_deref() == Some(crate::record::WORKFLOW_MARKER);
    let unprotected_body =
        (settings.store_down == StoreDown::RunUnprotected && !workflow).then(|| bytes.clone());
    let mut parts_slot = Some(parts);
    let mut produced: Option<Produced<S::Error>> = None;
    let stored_headers = &settings.stored_headers;
    let declared_provider = settings.provider.clone();
    let unknown_retry_after = settings.idem.config().unknown_retry_after;
    let secret_fields: Vec<&str> = settings.secret_fields.iter().map(String::as_str).collect();
    let secret_fields = &secret_fields;
    let result = {
        let parts_slot = &mut parts_slot;
        let produced = &mut produced;
        let inner = &mut inner;
        settings
            .idem
            .execute(request, move |ctx| async move {
                let Some(parts) = parts_slot.take() else {
                    return Outcome::unknown("the request head was already used");
                };
                // The last check the layer can make before the handler acts: a process paused
                // past its lease since the claim, or a takeover past its window, runs nothing.
                if let Some(why) = ctx.send_refusal() {
                    return Outcome::retryable(format!("handler not run: {why}"));
                }
                let handler_ctx = IdempotencyContext {
                    operation,
                    request: Arc::new(serde_json::from_str(ctx.request()).unwrap_or(Value::Null)),
                    attempt_ctx: ctx,
                    provider: declared_provider,
                    unknown_retry_after,
                };
                let mut req = Request::from_parts(parts, Body::from(bytes));
                req.extensions_mut().insert(handler_ctx);
                let resp = match inner.call(req).await {
                    Ok(r) => r,
                    Err(e) => {
                        *produced = Some(Produced::Failed(e));
                        return Outcome::unknown("the inner service returned an error");
                    }
                };
                let (mut rparts, rbody) = resp.into_parts();
                // The replay marker is idemflow's alone: one the handler set (say, forwarded
                // from a provider that replayed its own answer) is not this answer's.
                rparts.headers.remove(REPLAYED_HEADER);
                let rbytes = match rbody.collect().await {
                    Ok(c) => c.to_bytes(),
                    Err(e) => {
                        let reason = format!("the handler's response body failed: {e}");
                        *produced = Some(Produced::Answer(
                            Problem::new(
                                StatusCode::INTERNAL_SERVER_ERROR,
                                "response-failed",
                                "Response failed",
                            )
                            .detail(reason.clone())
                            .retry_after(Duration::from_secs(1))
                            .into_response(),
                        ));
                        return Outcome::unknown(reason);
                    }
                };
                let status = rparts.status;
                let retryable = rparts.extensions.get::<NothingHappened>().is_some();
                let headers = rparts
                    .headers
                    .iter()
                    .filter(|(n, _)| is_stored(stored_headers, n))
                    .filter_map(|(n, v)| Some((n.as_str().to_owned(), v.to_str().ok()?.to_owned())))
                    .collect();
                // The provider's secrets are masked here, before the executor stores the answer
                // (and applies `redact_with`); the first caller gets the stored answer too.
                let to_store = crate::provider::secrets::mask_fields(
                    StoredResponse::from_parts(status.as_u16(), headers, rbytes.to_vec()),
                    secret_fields,
                );
                *produced = Some(Produced::Answer(Response::from_parts(
                    rparts,
                    Body::from(rbytes),
                )));
                outcome_of(status, retryable, to_store)
            })
            .await
    };

    let store_down = match (&result, &produced) {
        (Err(Error::Store(e)), None) if e.is_unavailable() => Some(e.to_string()),
        _ => None,
    };
    if let (Some(error), Some(body)) = (store_down, unprotected_body)
        && let Some(parts) = parts_slot.take()
    {
        // The handler never ran (its request head is still here): run it unprotected, loudly.
        let operation = operation_name(&settings, &parts);
        tracing::warn!(
            %error,
            operation = %operation,
            "idempotency store unavailable: running the handler WITHOUT idempotency protection \
             (StoreDown::RunUnprotected); a retry of this request may act again"
        );
        crate::telemetry::unprotected(&operation, "store_unavailable");
        let mut resp = inner
            .call(Request::from_parts(parts, Body::from(body)))
            .await?;
        resp.headers_mut().insert(
            HeaderName::from_static(UNPROTECTED_HEADER),
            HeaderValue::from_static("store-unavailable"),
        );
        return Ok(resp);
    }
    respond(result, produced, parts_slot.as_ref(), &settings).await
}

/// How the handler's answer, as a status and whether it was marked retryable, classifies the
/// run: a 2xx is stored as a success and a 4xx as a permanent refusal, both replayed; a 5xx is
/// not stored (the key is left for a retry or the sweeper); a marked answer did nothing.
fn outcome_of(status: StatusCode, retryable: bool, to_store: StoredResponse) -> Outcome {
    if retryable {
        Outcome::retryable(format!(
            "the handler answered {status} and marked it retryable"
        ))
    } else if status.is_server_error() {
        Outcome::unknown(format!("the handler answered {status}; not stored"))
    } else if status.is_client_error() {
        Outcome::Rejected(to_store)
    } else {
        Outcome::Succeeded(to_store)
    }
}

/// The answer a client gets: the handler's first answer (or its error), a replay with the
/// replay marker, or the error of the key.
async fn respond<E>(
    result: Result<Execution, Error>,
    produced: Option<Produced<E>>,
    parts: Option<&Parts>,
    settings: &Settings,
) -> Result<Response, E> {
    match (result, produced) {
        (_, Some(Produced::Failed(e))) => Err(e),
        (Ok(Execution::Executed(stored)), Some(Produced::Answer(resp))) => {
            Ok(first_answer(resp, stored, &settings.stored_headers))
        }
        (Ok(Execution::Executed(stored)), None) => Ok(to_http(stored)),
        (Ok(Execution::Replayed(stored)), _) => {
            let stored = match (&settings.replay, parts) {
                (Some(f), Some(parts)) => f(parts, stored),
                _ => stored,
            };
            let mut resp = to_http(stored);
            resp.headers_mut().insert(
                HeaderName::from_static(REPLAYED_HEADER),
                HeaderValue::from_static("true"),
            );
            Ok(resp)
        }
        (
            Err(e @ (Error::OutcomeUnknown { .. } | Error::FailedRetryable { .. })),
            Some(Produced::Answer(resp)),
        ) => {
            // The handler's own answer (5xx, or marked retryable), not stored, masked as every
            // answer the layer gives.
            let mut resp = masked_unstored(resp, settings).await;
            let after = e.retry_after().unwrap_or(Duration::from_secs(1));
            if !resp.headers().contains_key(header::RETRY_AFTER) {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, retry_after_value(after));
            }
            Ok(resp)
        }
        (Err(e @ Error::ResponseTooLarge { .. }), Some(Produced::Answer(resp))) => {
            // The operation ran: give this client its answer, masked as a stored one would be;
            // retries get the recorded reason.
            tracing::warn!(error = %e, "answer too large to store; the key is failed{{permanent}} without it");
            Ok(masked_unstored(resp, settings).await)
        }
        (Err(e), _) => {
            if matches!(e, Error::Store(_) | Error::LeaseLost(_)) {
                tracing::error!(error = %e, "idempotency store failed");
            }
            Ok(error_response(&e))
        }
    }
}

/// A request with a usable key, read and fingerprinted by [`parse`].
struct Parsed {
    request: IdempotentRequest,
    parts: Parts,
    bytes: Bytes,
    operation: String,
}

/// What [`parse`] found instead of a request to run under a key.
enum NotRun {
    /// No key, and none required: the handler runs as if the layer were not there.
    PassThrough(Parts, Body),
    /// Refused (a missing or malformed key, a scope, body or request error): this answer.
    Answer(Response),
}

/// Reads the key, the scope and the body of `req`, and builds the request to run under the key.
async fn parse(settings: &Settings, req: Request) -> Result<Parsed, NotRun> {
    let (parts, body) = req.into_parts();
    let mut values = parts.headers.get_all(&settings.header).iter();
    let key = match (values.next(), values.next()) {
        (None, _) if !settings.required => return Err(NotRun::PassThrough(parts, body)),
        (None, _) => {
            return Err(NotRun::Answer(Problem::new(StatusCode::BAD_REQUEST, "key-missing", "Idempotency key missing")
                .detail(format!(
                    "this endpoint requires an {} header; send a unique value (e.g. a UUID) and reuse it when retrying",
                    settings.header
                ))
                .into_response()));
        }
        (Some(_), Some(_)) => Err(super::KeyHeaderError::Repeated),
        (Some(v), None) => parse_key_header(v),
    };
    let key = match key {
        Ok(k) => k,
        Err(e) => {
            return Err(NotRun::Answer(
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    "key-malformed",
                    "Idempotency key malformed",
                )
                .detail(e.to_string())
                .into_response(),
            ));
        }
    };
    let scope = match settings.scope.scope_of(&parts) {
        Ok(s) => s,
        Err(resp) => return Err(NotRun::Answer(resp)),
    };
    let span = tracing::Span::current();
    span.record("scope", tracing::field::display(&scope));
    span.record("key", tracing::field::display(&key));

    let bytes = match read_body(body, settings.max_body_bytes).await {
        Ok(b) => b,
        Err(resp) => return Err(NotRun::Answer(resp)),
    };
    // JSON bodies are fingerprinted as canonical JSON, others by their bytes; JSON that names a
    // member twice is refused (400), never read last-wins.
    let json = match parse_json(&bytes) {
        Ok(v) => Some(v),
        Err(JsonError::DuplicateKey { name }) => {
            return Err(NotRun::Answer(error_response(&Error::from(
                RequestError::DuplicateJsonKey { name },
            ))));
        }
        Err(_) => None,
    };
    let operation = operation_name(settings, &parts);
    let stored = match &settings.stored_request {
        Some(f) => match f(&parts, &bytes) {
            Ok(v) => v,
            Err(resp) => return Err(NotRun::Answer(resp)),
        },
        None => body_value(&bytes, json.as_ref()),
    };
    let fingerprint = fingerprint(&operation, &parts, &bytes, json.as_ref());
    let id = KeyId::new(scope, key);
    let request = IdempotentRequest::with_fingerprint(
        id,
        operation.clone(),
        canonical_json(&stored),
        fingerprint,
    );
    let mut request = match request {
        Ok(r) => r,
        Err(e) => return Err(NotRun::Answer(error_response(&Error::from(e)))),
    };
    request = match (&settings.provider, &settings.key_spec) {
        (Some(p), Some(spec)) => request.sent_through(p, spec),
        (Some(p), None) => request.provider(p.clone()),
        (None, _) => request,
    };
    Ok(Parsed {
        request,
        parts,
        bytes,
        operation,
    })
}

/// Reads the body up to `limit` bytes; 413 above it, 400 when it cannot be read.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, Response> {
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            "Request body too large",
        )
        .detail(format!(
            "the request body exceeds {limit} bytes, the most this endpoint accepts"
        ))
        .into_response()),
        Err(e) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "body-unreadable",
            "Request body unreadable",
        )
        .detail(format!("the request body could not be read: {e}"))
        .into_response()),
    }
}

/// The operation name: configured, or `METHOD:/matched/path` (at most 255 bytes).
fn operation_name(settings: &Settings, parts: &Parts) -> String {
    if let Some(f) = &settings.operation {
        return f(parts);
    }
    let path = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path(), MatchedPath::as_str);
    let mut name = format!("{}:{}", parts.method, path);
    if name.len() > crate::key::MAX_LEN {
        // ASCII (a method and a URI path), so any byte offset is a char boundary.
        name.truncate(crate::key::MAX_LEN);
    }
    name
}

/// The stored request by default: the body's JSON (`json`, parsed once by the caller) when it
/// is JSON, a string when it is UTF-8, its SHA-256 otherwise.
fn body_value(bytes: &Bytes, json: Option<&Value>) -> Value {
    if bytes.is_empty() {
        return Value::Null;
    }
    if let Some(v) = json {
        return v.clone();
    }
    match std::str::from_utf8(bytes) {
        Ok(s) => Value::String(s.to_owned()),
        Err(_) => json!({ "body_sha256": hex(&Sha256::digest(bytes)) }),
    }
}

/// The fingerprint: operation, method, path, query and body (JSON bodies as canonical JSON,
/// other bodies by the SHA-256 of their bytes).
fn fingerprint(operation: &str, parts: &Parts, bytes: &Bytes, json: Option<&Value>) -> Fingerprint {
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        match json {
            Some(v) => json!({ "json": v }),
            None => json!({ "sha256": hex(&Sha256::digest(bytes)) }),
        }
    };
    let doc = json!({
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": parts.uri.query(),
        "body": body,
    });
    Fingerprint::compute(operation, &canonical_json(&doc))
}

/// Whether a response header is stored: named by `stored_headers`, and never the replay marker.
fn is_stored(stored_headers: &[String], name: &HeaderName) -> bool {
    name.as_str() != REPLAYED_HEADER
        && stored_headers
            .iter()
            .any(|h| h.eq_ignore_ascii_case(name.as_str()))
}

/// The first caller's answer: the stored answer (status, stored headers and body, as masked and
/// redacted before storing) plus the handler's headers that are not stored, so that a replay is
/// this answer byte for byte in everything it stores.
fn first_answer(handler: Response, stored: StoredResponse, stored_headers: &[String]) -> Response {
    let (mut parts, _) = handler.into_parts();
    let (status, headers, body) = stored.into_parts();
    parts.status = StatusCode::from_u16(status).unwrap_or(parts.status);
    let unstored: Vec<_> = parts
        .headers
        .iter()
        .filter(|(n, _)| !is_stored(stored_headers, n) && *n != header::CONTENT_LENGTH)
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    parts.headers.clear();
    for (n, v) in headers {
        if let (Ok(n), Ok(v)) = (HeaderName::try_from(n), HeaderValue::try_from(v)) {
            parts.headers.append(n, v);
        }
    }
    for (n, v) in unstored {
        parts.headers.append(n, v);
    }
    Response::from_parts(parts, Body::from(body))
}

/// An answer the layer gives without storing it (too large, a 5xx, marked retryable): the
/// provider's secret fields and `redact_with` applied as they would have been before storing.
async fn masked_unstored(resp: Response, settings: &Settings) -> Response {
    let (parts, body) = resp.into_parts();
    let Ok(bytes) = body.collect().await.map(|c| c.to_bytes()) else {
        return Response::from_parts(parts, Body::empty());
    };
    let fields: Vec<&str> = settings.secret_fields.iter().map(String::as_str).collect();
    let mut answer = crate::provider::secrets::mask_fields(
        StoredResponse::from_parts(parts.status.as_u16(), Vec::new(), bytes.to_vec()),
        &fields,
    );
    if let Some(redact) = &settings.idem.config().redact {
        answer = redact.apply(answer);
    }
    let (_, _, body) = answer.into_parts();
    let mut parts = parts;
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body))
}

/// A stored answer as an HTTP response.
pub(super) fn to_http(stored: StoredResponse) -> Response {
    stored.into_response()
}

/// A stored answer as the HTTP response it records: its status (500 if it is not a valid
/// status), its headers (any that are not valid HTTP headers left out) and its body, byte for
/// byte. What the layer sends for a replay, before it adds `Idempotent-Replayed: true`.
///
/// ```
/// use axum::response::IntoResponse;
/// use idemflow::StoredResponse;
///
/// let stored = StoredResponse::json(201, &serde_json::json!({"payment": "p-1"})).unwrap();
/// let resp = stored.into_response();
/// assert_eq!(resp.status(), 201);
/// assert_eq!(resp.headers()["content-type"], "application/json");
/// ```
impl IntoResponse for StoredResponse {
    fn into_response(self) -> Response {
        let (status, headers, body) = self.into_parts();
        let mut resp = Response::new(Body::from(body));
        *resp.status_mut() =
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        for (n, v) in headers {
            if let (Ok(n), Ok(v)) = (HeaderName::try_from(n), HeaderValue::try_from(v)) {
                resp.headers_mut().append(n, v);
            }
        }
        resp
    }
}

/// The layer's answer to an executor error: [`Error::http_answer`] as problem details.
fn error_response(e: &Error) -> Response {
    Problem::from(e).into_response()
}
