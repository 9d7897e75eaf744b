//! `application/problem+json` answers (RFC 9457).

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::error::{Error, HttpAnswer};

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
            kind: format!("{}{slug}", HttpAnswer::PROBLEM_TYPE_PREFIX),
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

impl From<&Error> for Problem {
    /// The problem answering an executor error: status, `Retry-After`, type and title from
    /// [`Error::http_answer`] (the one mapping), the error's message as `detail`.
    fn from(e: &Error) -> Self {
        let a = e.http_answer();
        Self {
            kind: a.problem_type(),
            title: a.title.to_owned(),
            status: a.status,
            detail: Some(e.to_string()),
            retry_after: a.retry_after,
        }
    }
}

/// `Retry-After` in whole seconds, rounded up, at least 1.
pub fn retry_after_value(d: Duration) -> HeaderValue {
    let secs = d
        .as_secs()
        .saturating_add(u64::from(d.subsec_nanos() > 0))
        .max(1);
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::http::header;
    use axum::response::IntoResponse;

    use super::Problem;
    use crate::error::{Error, RequestError, StoreError};
    use crate::key::KeyError;
    use crate::state::KeyState;

    fn test_id() -> crate::KeyId {
        crate::KeyId::new(
            crate::key::Scope::new("a").unwrap(),
            crate::key::IdempotencyKey::new("k").unwrap(),
        )
    }

    /// One of each variant; the match below stops compiling when a variant is added unlisted.
    fn every_error() -> Vec<Error> {
        let errors = vec![
            RequestError::InvalidKey(KeyError::Empty { what: "key" }).into(),
            RequestError::InvalidScope(KeyError::Empty { what: "scope" }).into(),
            RequestError::InvalidOperation(KeyError::Empty { what: "operation" }).into(),
            RequestError::InvalidJson(serde_json::from_str::<u8>("{").unwrap_err()).into(),
            RequestError::DuplicateJsonKey { name: "a".into() }.into(),
            RequestError::RequestTooLarge { size: 2, limit: 1 }.into(),
            Error::FingerprintMismatch {
                key: test_id(),
                stored: "v1:aa".into(),
                presented: "v1:bb".into(),
            },
            Error::InFlight {
                key: test_id(),
                retry_after: Duration::from_millis(1500),
            },
            Error::OutcomeUnknown {
                key: test_id(),
                reason: "timeout".into(),
                retry_after: Duration::from_secs(5),
            },
            Error::FailedRetryable {
                key: test_id(),
                reason: "429".into(),
            },
            Error::ResponseTooLarge { size: 2, limit: 1 },
            Error::NoStoredResponse {
                key: test_id(),
                state: KeyState::Failed { retryable: false },
                reason: "operator".into(),
            },
            Error::LeaseLost(StoreError::NotFound { key: test_id() }),
            Error::Store(StoreError::Config("bad".into())),
            Error::StepChanged {
                key: test_id(),
                position: 1,
                recorded: "charge".into(),
                found: Some("email".into()),
            },
            Error::NotAWorkflow { key: test_id() },
            Error::WorkflowExpired {
                key: test_id(),
                retention: Duration::from_secs(3600),
            },
            Error::ProviderChanged {
                key: test_id(),
                recorded: Some("mail_a".into()),
                requested: Some("mail_b".into()),
            },
            Error::RolledBack {
                key: test_id(),
                source: "constraint".into(),
            },
            Error::NoSharedTransaction {
                key: test_id(),
                reason: "redis",
            },
        ];
        for e in &errors {
            match e {
                Error::Request(
                    RequestError::InvalidKey(_)
                    | RequestError::InvalidScope(_)
                    | RequestError::InvalidOperation(_)
                    | RequestError::InvalidJson(_)
                    | RequestError::DuplicateJsonKey { .. }
                    | RequestError::RequestTooLarge { .. },
                )
                | Error::FingerprintMismatch { .. }
                | Error::InFlight { .. }
                | Error::OutcomeUnknown { .. }
                | Error::FailedRetryable { .. }
                | Error::ResponseTooLarge { .. }
                | Error::NoStoredResponse { .. }
                | Error::LeaseLost(_)
                | Error::Store(_)
                | Error::StepChanged { .. }
                | Error::NotAWorkflow { .. }
                | Error::WorkflowExpired { .. }
                | Error::ProviderChanged { .. }
                | Error::RolledBack { .. }
                | Error::NoSharedTransaction { .. } => {}
            }
        }
        errors
    }

    /// The layer's problem answer and `Error::http_status` / `Error::retry_after` come from one
    /// mapping: they agree on every variant (they used to disagree on `Retry-After` for a
    /// retryable failure and on the status of a lost lease).
    #[tokio::test]
    async fn problem_answers_agree_with_http_status_and_retry_after() {
        for e in every_error() {
            let answer = e.http_answer();
            assert_eq!(e.http_status(), answer.status, "{e:?}");
            assert_eq!(e.retry_after(), answer.retry_after, "{e:?}");
            let resp = Problem::from(&e).into_response();
            assert_eq!(resp.status().as_u16(), e.http_status(), "{e:?}");
            let header = resp
                .headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.to_str().unwrap().to_owned());
            let expected = e
                .retry_after()
                .map(|d| super::retry_after_value(d).to_str().unwrap().to_owned());
            assert_eq!(header, expected, "{e:?}");
            assert_eq!(resp.headers()[header::CONTENT_TYPE], super::PROBLEM_JSON);
            let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
                .await
                .unwrap();
            let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(doc["type"], answer.problem_type(), "{e:?}");
            assert_eq!(doc["title"], answer.title, "{e:?}");
            assert_eq!(doc["status"], answer.status, "{e:?}");
            assert_eq!(doc["detail"], e.to_string(), "{e:?}");
        }
    }

    #[test]
    fn the_mapping_pins_statuses_and_waits() {
        let table: Vec<(u16, Option<u64>, &str)> = every_error()
            .iter()
            .map(|e| {
                let a = e.http_answer();
                (
                    a.status,
                    a.retry_after.map(|d| d.as_millis() as u64),
                    a.slug,
                )
            })
            .collect();
        assert_eq!(
            table,
            [
                (400, None, "key-malformed"),
                (400, None, "scope-invalid"),
                (400, None, "operation-invalid"),
                (400, None, "body-invalid"),
                (400, None, "body-duplicate-key"),
                (413, None, "body-too-large"),
                (422, None, "key-reused"),
                (409, Some(1500), "request-in-flight"),
                (503, Some(5000), "outcome-unknown"),
                (503, Some(1000), "retryable"),
                (500, None, "no-stored-answer"),
                (500, None, "no-stored-answer"),
                (503, Some(1000), "settled-elsewhere"),
                (500, None, "store-error"),
                (500, None, "workflow-needs-operator"),
                (500, None, "not-a-workflow"),
                (500, None, "workflow-needs-operator"),
                (422, None, "provider-changed"),
                (503, Some(1000), "rolled-back"),
                (500, None, "no-shared-transaction"),
            ]
        );
    }
}
