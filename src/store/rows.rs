//! Backend-neutral row decoding: each backend reads its columns into [`RawRecord`] /
//! [`RawEvent`], and the checks that turn them into typed values live here once.

use chrono::{DateTime, Utc};

use crate::error::StoreError;
use crate::record::{Actor, KeyEvent, KeyRecord, LeaseToken};
use crate::state::KeyState;
use crate::{Fingerprint, IdempotencyKey, Scope, StoredResponse};

/// A key row as plain column values.
#[derive(Debug, Clone)]
#[allow(missing_docs)]
pub struct RawRecord {
    pub scope: String,
    pub key: String,
    pub operation: String,
    pub provider: Option<String>,
    pub provider_key: String,
    pub state: String,
    pub retryable: bool,
    pub fingerprint: String,
    pub request: Option<String>,
    pub response_status: Option<i32>,
    pub response_headers: Option<String>,
    pub response_body: Option<Vec<u8>>,
    pub error: Option<String>,
    pub lease_token: i64,
    pub lease_owner: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub next_check_at: Option<DateTime<Utc>>,
    pub retention_ms: i64,
}

fn corrupt(backend: &'static str, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        backend,
        detail: detail.into(),
    }
}

/// Milliseconds since the epoch to a time, or a `Corrupt` error.
#[cfg_attr(not(any(feature = "sqlite", feature = "redis")), allow(dead_code))]
pub(crate) fn ms_to_time(backend: &'static str, ms: i64) -> Result<DateTime<Utc>, StoreError> {
    DateTime::from_timestamp_millis(ms)
        .ok_or_else(|| corrupt(backend, format!("timestamp {ms} ms")))
}

impl RawRecord {
    /// Checks and converts the columns.
    pub fn into_record(self, backend: &'static str) -> Result<KeyRecord, StoreError> {
        let scope = Scope::new(self.scope).map_err(|e| corrupt(backend, e.to_string()))?;
        let key = IdempotencyKey::new(self.key).map_err(|e| corrupt(backend, e.to_string()))?;
        let state = KeyState::from_columns(&self.state, self.retryable)
            .map_err(|e| corrupt(backend, e.to_string()))?;
        let response = match self.response_status {
            None => None,
            Some(status) => {
                let status = u16::try_from(status)
                    .map_err(|_| corrupt(backend, format!("response status {status}")))?;
                let headers: Vec<(String, String)> = match self.response_headers.as_deref() {
                    None | Some("") => Vec::new(),
                    Some(h) => serde_json::from_str(h)
                        .map_err(|e| corrupt(backend, format!("response headers: {e}")))?,
                };
                Some(StoredResponse::from_parts(
                    status,
                    headers,
                    self.response_body.unwrap_or_default(),
                ))
            }
        };
        Ok(KeyRecord {
            scope,
            key,
            operation: self.operation,
            provider: self.provider,
            provider_key: self.provider_key,
            state,
            fingerprint: Fingerprint::from_stored(self.fingerprint),
            request: self.request,
            response,
            error: self.error,
            lease_token: LeaseToken(self.lease_token),
            lease_owner: self.lease_owner,
            lease_expires_at: self.lease_expires_at,
            attempts: self.attempts,
            created_at: self.created_at,
            updated_at: self.updated_at,
            expires_at: self.expires_at,
            next_check_at: self.next_check_at,
            retention_ms: self.retention_ms,
        })
    }
}

/// A history row as plain column values.
#[derive(Debug, Clone)]
#[allow(missing_docs)]
pub struct RawEvent {
    pub seq: i64,
    pub from_state: Option<String>,
    pub from_retryable: Option<bool>,
    pub to_state: Option<String>,
    pub to_retryable: Option<bool>,
    pub lease_token: Option<i64>,
    pub actor: String,
    pub reason: Option<String>,
    pub at: DateTime<Utc>,
}

impl RawEvent {
    /// Checks and converts the columns.
    pub fn into_event(self, backend: &'static str) -> Result<KeyEvent, StoreError> {
        let state = |s: Option<String>, r: Option<bool>| -> Result<Option<KeyState>, StoreError> {
            s.map(|s| KeyState::from_columns(&s, r.unwrap_or(false)))
                .transpose()
                .map_err(|e| corrupt(backend, e.to_string()))
        };
        Ok(KeyEvent {
            seq: self.seq,
            from: state(self.from_state, self.from_retryable)?,
            to: state(self.to_state, self.to_retryable)?,
            lease_token: self.lease_token.map(LeaseToken),
            actor: Actor::parse(&self.actor)
                .ok_or_else(|| corrupt(backend, format!("actor {:?}", self.actor)))?,
            reason: self.reason,
            at: self.at,
        })
    }
}
