//! [`ScopeSource`]: where the layer takes each request's scope from.

use std::fmt;
use std::sync::Arc;

use axum::http::request::Parts;
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{Problem, ScopeFn};
use crate::key::Scope;

/// Where [`IdempotencyLayer`](super::IdempotencyLayer) takes each request's scope from: the
/// tenant, account or API client the request acts for. Keys live per scope, so one scope never
/// sees, blocks or replays another's; a scope shared by several callers lets one of them replay
/// another's answer (its status, `Location` and body), which is why the layer has no default.
///
/// ```
/// use axum::http::{HeaderName, StatusCode, request::Parts};
/// use idemflow::key::Scope;
/// use idemflow::axum::ScopeSource;
///
/// /// What your authentication layer puts in the request extensions.
/// #[derive(Clone)]
/// struct Principal { tenant: String }
///
/// // The authenticated principal (401 without one): the usual choice.
/// let from_auth = ScopeSource::from_fn(|parts: &Parts| {
///     parts.extensions.get::<Principal>().map(|p| p.tenant.clone()).ok_or(StatusCode::UNAUTHORIZED)
/// });
/// // A header your own stack sets (and replaces, never appends to).
/// let from_header = ScopeSource::header(HeaderName::from_static("x-account-id"));
/// // One scope for a service with a single caller.
/// let single = ScopeSource::fixed(Scope::new("backoffice").unwrap());
/// ```
#[derive(Clone)]
pub struct ScopeSource(Source);

#[derive(Clone)]
enum Source {
    Fixed(Scope),
    Header(HeaderName),
    Fn(ScopeFn),
}

impl fmt::Debug for ScopeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::Fixed(s) => f.debug_tuple("Fixed").field(&s.as_str()).finish(),
            Source::Header(h) => f.debug_tuple("Header").field(h).finish(),
            Source::Fn(_) => f.write_str("Fn(..)"),
        }
    }
}

impl ScopeSource {
    /// Every request in one scope. Only for a service whose callers may all see each other's
    /// answers (one client, an internal job runner).
    pub fn fixed(scope: Scope) -> Self {
        Self(Source::Fixed(scope))
    }

    /// The scope is the value of `header` (e.g. `X-Account-Id`, set by your authentication),
    /// trimmed. A request without it (or with it empty) gets 400 `scope-missing`; one that
    /// sends it more than once, or with bytes outside visible ASCII, gets 400 `scope-invalid`,
    /// so a client's own `X-Account-Id` never wins over one an authentication layer appended.
    /// Only use a header your own stack sets or verifies: the scope is what keeps tenants apart.
    ///
    /// Header names are case-insensitive: build the name with `HeaderName::from_static` in
    /// lowercase, or with `HeaderName::from_bytes` / `try_from` from any case (an invalid name
    /// is then a typed `InvalidHeaderName` error, never a panic).
    ///
    /// ```
    /// use axum::http::HeaderName;
    /// use idemflow::axum::ScopeSource;
    /// # fn f() -> Result<(), axum::http::header::InvalidHeaderName> {
    /// let source = ScopeSource::header(HeaderName::try_from("X-Account-Id")?);
    /// # Ok(())
    /// # }
    /// ```
    pub fn header(header: HeaderName) -> Self {
        Self(Source::Header(header))
    }

    /// Any function of the request head: typically the authenticated principal an earlier layer
    /// put in `parts.extensions`. Answer `Err(response)` to refuse the request (it is sent as
    /// is, and nothing is stored); a scope that is not a valid [`Scope`] gets 400
    /// `scope-invalid`.
    pub fn from_fn<F, E>(f: F) -> Self
    where
        F: Fn(&Parts) -> Result<String, E> + Send + Sync + 'static,
        E: IntoResponse,
    {
        Self(Source::Fn(Arc::new(move |p| {
            f(p).map_err(IntoResponse::into_response)
        })))
    }

    /// The scope of a request, or the answer refusing it.
    pub(crate) fn scope_of(&self, parts: &Parts) -> Result<Scope, Response> {
        let raw = match &self.0 {
            Source::Fixed(s) => return Ok(s.clone()),
            Source::Header(name) => from_header(name, parts)?,
            Source::Fn(f) => f(parts)?,
        };
        Scope::new(raw).map_err(|e| invalid(e.to_string()))
    }
}

fn invalid(detail: String) -> Response {
    Problem::new(StatusCode::BAD_REQUEST, "scope-invalid", "Scope invalid")
        .detail(detail)
        .into_response()
}

fn from_header(name: &HeaderName, parts: &Parts) -> Result<String, Response> {
    let mut values = parts.headers.get_all(name).iter();
    let value = match (values.next(), values.next()) {
        (Some(_), Some(_)) => {
            return Err(invalid(format!(
                "the {name} header appears more than once; send exactly one"
            )));
        }
        (Some(v), None) => v,
        (None, _) => return Err(missing(name)),
    };
    let Ok(value) = value.to_str() else {
        return Err(invalid(format!(
            "the {name} header holds bytes outside visible ASCII"
        )));
    };
    match value.trim() {
        "" => Err(missing(name)),
        v => Ok(v.to_owned()),
    }
}

fn missing(name: &HeaderName) -> Response {
    Problem::new(StatusCode::BAD_REQUEST, "scope-missing", "Scope missing")
        .detail(format!(
            "the {name} header is required: it names the account this request acts for"
        ))
        .into_response()
}
