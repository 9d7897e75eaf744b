//! `application/problem+json` answers (RFC 9457).

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// The media type of problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// A problem details document: `type`, `title`, `status`, `detail`, answered as
/// `application/problem+json`, with `Retry-After` when set.
///
/// The layer's own `type`s are `urn:idemflow:problem:<slug>` (for example
/// `urn:idemflow:problem:key-missing`), so a client can tell the cases apart without parsing
/// `detail`.
///
/// ```
/// use axum::http::StatusCode;
/// use axum::response::IntoResponse;
/// use idemflow::axum::Problem;
///
/// let resp = Problem::new(StatusCode::BAD_REQUEST, "invalid-amount", "Invalid amount")
///     .detail("amount must be a positive integer")
///     .into_response();
/// assert_eq!(resp.status(), 400);
/// assert_eq!(resp.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// A URI naming the kind of problem.
    #[serde(rename = "type")]
    pub kind: String,
    /// A short summary of the kind.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What happened this time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Sent as `Retry-After` (whole seconds, rounded up), not in the body.
    #[serde(skip)]
    pub retry_after: Option<Duration>,
}

impl Problem {
    /// A problem of kind `urn:idemflow:problem:<slug>`.
    pub fn new(status: StatusCode, slug: &str, title: impl Into<String>) -> Self {
        Self {
            kind: format!("urn:idemflow:problem:{slug}"),
            title: title.into(),
            status: status.as_u16(),
            detail: None,
            retry_after: None,
        }
    }

    /// Sets `detail`.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Sets `Retry-After`.
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }
}

/// `Retry-After` in whole seconds, rounded up, at least 1.
pub fn retry_after_value(d: Duration) -> HeaderValue {
    let secs = (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1);
    HeaderValue::from(secs)
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).unwrap_or_else(|_| b"{}".to_vec());
        let mut resp = (status, body).into_response();
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, retry_after_value(after));
        }
        resp
    }
}
