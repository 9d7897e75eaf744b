//! Row decoding, once for every backend: each backend reads its columns into [`RawRecord`] /
//! [`RawEvent`], and the checks that turn them into typed values live here. The SQL backends
//! also share the decoders of the columns their statements select, by name (`decode_record`,
//! `decode_event`, `decode_lease`, `decode_stats`), written once over [`SqlRow`]; each SQL
//! backend only says how it reads its time columns and its text.
//!
//! A new nullable column on the key row is: a migration per backend, a field of
//! [`KeyRecord`], and here a field of [`RawRecord`], its line in `into_record` and its line in
//! `decode_record`; then each statement file that reads or writes the key row names it.

use chrono::{DateTime, Utc};

use crate::error::StoreError;
use crate::record::{Actor, KeyEvent, KeyRecord, LeaseToken};
use crate::state::KeyState;
use crate::{StoredResponse, fingerprint::Fingerprint, key::IdempotencyKey, key::Scope};

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
    /// `None` only on rows written before the column existed: read as `created_at`.
    pub last_attempt_at: Option<DateTime<Utc>>,
    pub may_have_acted: bool,
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
            last_attempt_at: self.last_attempt_at.unwrap_or(self.created_at),
            may_have_acted: self.may_have_acted,
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

/// One history entry as the Redis scripts and the SQLite / PostgreSQL statements write it:
/// `seq|from|from_rt|to|to_rt|token|at_ms|#actor|actor[|reason]`. Absent values are empty; the
/// actor is length-prefixed and the reason, last, is the rest of the entry. `escaped`: the
/// reason has `\` and line feeds escaped (`\\`, `\n`), as in a SQL history column, whose
/// entries are separated by line feeds.
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "redis"
))]
pub(crate) fn decode_history_entry(
    backend: &'static str,
    raw: &str,
    escaped: bool,
) -> Result<KeyEvent, StoreError> {
    let bad = || corrupt(backend, format!("history entry {raw:?}"));
    let mut it = raw.splitn(8, '|');
    let mut next = || it.next().ok_or_else(bad);
    let seq: i64 = next()?.parse().map_err(|_| bad())?;
    let opt = |v: &str| (!v.is_empty()).then(|| v.to_owned());
    let from_state = opt(next()?);
    let from_retryable = opt(next()?).map(|v| v == "1");
    let to_state = opt(next()?);
    let to_retryable = opt(next()?).map(|v| v == "1");
    let lease_token = opt(next()?)
        .map(|v| v.parse::<i64>().map_err(|_| bad()))
        .transpose()?;
    let at: i64 = next()?.parse().map_err(|_| bad())?;
    let rest = next()?;
    let (len, rest) = rest.split_once('|').ok_or_else(bad)?;
    let len: usize = len.parse().map_err(|_| bad())?;
    let actor = rest.get(..len).ok_or_else(bad)?.to_owned();
    let reason = match rest.get(len..).ok_or_else(bad)? {
        "" => None,
        r => {
            let r = r.strip_prefix('|').ok_or_else(bad)?;
            Some(if escaped {
                unescape_reason(r)
            } else {
                r.to_owned()
            })
        }
    };
    RawEvent {
        seq,
        from_state,
        from_retryable,
        to_state,
        to_retryable,
        lease_token,
        actor,
        reason,
        at: ms_to_time(backend, at)?,
    }
    .into_event(backend)
}

/// Undoes the SQL statements' escape of a history reason: `\\` -> `\`, `\n` -> line feed; any
/// other backslash (a reason cut short inside an escape) is kept as it is.
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "redis"
))]
fn unescape_reason(r: &str) -> String {
    let mut out = String::with_capacity(r.len());
    let mut chars = r.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('\\') => out.push('\\'),
            Some('n') => out.push('\n'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// The history of a key on SQLite / PostgreSQL: what the tombstone of its purged rows kept
/// (`archived`), then the live row's (`live`); each a column of entries separated by line
/// feeds, oldest first ([`decode_history_entry`]).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) fn decode_history_columns(
    backend: &'static str,
    archived: Option<&str>,
    live: Option<&str>,
) -> Result<Vec<KeyEvent>, StoreError> {
    archived
        .into_iter()
        .chain(live)
        .flat_map(|text| text.split('\n'))
        .filter(|entry| !entry.is_empty())
        .map(|entry| decode_history_entry(backend, entry, true))
        .collect()
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) use sql::{Plain, SqlRow, decode_event, decode_lease, decode_record, decode_stats};

/// The decoders of the SQL backends, written once over [`SqlRow`].
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod sql {
    use chrono::{DateTime, Utc};
    use sqlx::{ColumnIndex, Decode, Row, Type};

    use super::{RawEvent, RawRecord, corrupt};
    use crate::error::StoreError;
    use crate::record::{KeyEvent, KeyRecord, LeaseToken};
    use crate::state::Transition;
    use crate::store::{Lease, Stats};

    /// A column type that a backend decodes as it is (a bound, written once).
    pub(crate) trait Plain<DB: sqlx::Database>: for<'r> Decode<'r, DB> + Type<DB> {}
    impl<DB: sqlx::Database, T: for<'r> Decode<'r, DB> + Type<DB>> Plain<DB> for T {}

    /// A row of one SQL backend. The decoders below are written once over it; a backend says
    /// only how it reads the columns whose SQL types really differ.
    pub(crate) trait SqlRow: Row {
        /// The backend's name, for errors.
        const BACKEND: &'static str;

        /// A time column (`NULL`: `None`). SQLite stores epoch milliseconds, PostgreSQL
        /// `timestamptz`, MariaDB `DATETIME(6)` in UTC.
        fn time(&self, col: &str) -> Result<Option<DateTime<Utc>>, StoreError>;

        /// A text column (`NULL`: `None`). MariaDB returns the `VARBINARY` scope and key as bytes.
        fn text(&self, col: &str) -> Result<Option<String>, StoreError>;

        /// A time column that is never `NULL`.
        fn time_at(&self, col: &str) -> Result<DateTime<Utc>, StoreError> {
            not_null(Self::BACKEND, col, self.time(col)?)
        }
    }

    fn not_null<T>(backend: &'static str, col: &str, v: Option<T>) -> Result<T, StoreError> {
        v.ok_or_else(|| corrupt(backend, format!("{col} is NULL")))
    }

    fn get<R, T>(row: &R, col: &str) -> Result<T, StoreError>
    where
        R: SqlRow,
        T: Plain<R::Database>,
        for<'c> &'c str: ColumnIndex<R>,
    {
        row.try_get(col)
            .map_err(|e| StoreError::database(R::BACKEND, e))
    }

    /// Decodes a key row: the columns of `idempotency_keys` each backend's `get.sql` selects.
    pub(crate) fn decode_record<R>(row: &R) -> Result<KeyRecord, StoreError>
    where
        R: SqlRow,
        for<'c> &'c str: ColumnIndex<R>,
        bool: Plain<R::Database>,
        i32: Plain<R::Database>,
        i64: Plain<R::Database>,
        Vec<u8>: Plain<R::Database>,
    {
        let text = |c: &str| not_null(R::BACKEND, c, row.text(c)?);
        RawRecord {
            scope: text("scope")?,
            key: text("key")?,
            operation: text("operation")?,
            provider: row.text("provider")?,
            provider_key: text("provider_key")?,
            state: text("state")?,
            retryable: get(row, "retryable")?,
            fingerprint: text("fingerprint")?,
            request: row.text("request")?,
            response_status: get(row, "response_status")?,
            response_headers: row.text("response_headers")?,
            response_body: get(row, "response_body")?,
            error: row.text("error")?,
            lease_token: get(row, "lease_token")?,
            lease_owner: row.text("lease_owner")?,
            lease_expires_at: row.time("lease_expires_at")?,
            attempts: get(row, "attempts")?,
            created_at: row.time_at("created_at")?,
            updated_at: row.time_at("updated_at")?,
            expires_at: row.time("expires_at")?,
            next_check_at: row.time("next_check_at")?,
            retention_ms: get(row, "retention_ms")?,
            last_attempt_at: row.time("last_attempt_at")?,
            may_have_acted: get(row, "may_have_acted")?,
        }
        .into_record(R::BACKEND)
    }

    /// Decodes a history row of MariaDB's events table (`mysql/history.sql`).
    pub(crate) fn decode_event<R>(row: &R) -> Result<KeyEvent, StoreError>
    where
        R: SqlRow,
        for<'c> &'c str: ColumnIndex<R>,
        bool: Plain<R::Database>,
        i64: Plain<R::Database>,
    {
        RawEvent {
            seq: get(row, "id")?,
            from_state: row.text("from_state")?,
            from_retryable: get(row, "from_retryable")?,
            to_state: row.text("to_state")?,
            to_retryable: get(row, "to_retryable")?,
            lease_token: get(row, "lease_token")?,
            actor: not_null(R::BACKEND, "actor", row.text("actor")?)?,
            reason: row.text("reason")?,
            at: row.time_at("at")?,
        }
        .into_event(R::BACKEND)
    }

    /// Decodes the lease a claim granted from the claimed row: its `lease_token`,
    /// `lease_expires_at`, `attempts`, `provider_key`, `may_have_acted`, and `last_reason` (one of
    /// [`Transition::CLAIM_REASONS`], which says which transition it was).
    pub(crate) fn decode_lease<R>(row: &R) -> Result<Lease, StoreError>
    where
        R: SqlRow,
        for<'c> &'c str: ColumnIndex<R>,
        bool: Plain<R::Database>,
        i32: Plain<R::Database>,
        i64: Plain<R::Database>,
    {
        let reason = row.text("last_reason")?;
        let transition = reason
            .as_deref()
            .and_then(Transition::from_claim_reason)
            .ok_or_else(|| corrupt(R::BACKEND, format!("claim returned reason {reason:?}")))?;
        Ok(Lease {
            token: LeaseToken(get(row, "lease_token")?),
            expires_at: row.time_at("lease_expires_at")?,
            attempts: get(row, "attempts")?,
            provider_key: not_null(R::BACKEND, "provider_key", row.text("provider_key")?)?,
            transition,
            may_have_acted: get(row, "may_have_acted")?,
            created_at: row.time_at("created_at")?,
        })
    }

    /// Decodes the counts of a stats statement, whose columns are named after the fields of
    /// [`Stats`] (`oldest_processing_created_at` as `oldest_processing`, `now` as `db_now`).
    pub(crate) fn decode_stats<R>(row: &R) -> Result<Stats, StoreError>
    where
        R: SqlRow,
        for<'c> &'c str: ColumnIndex<R>,
        i64: Plain<R::Database>,
    {
        Ok(Stats {
            processing: get(row, "processing")?,
            stale: get(row, "stale")?,
            done: get(row, "done")?,
            failed_retryable: get(row, "failed_retryable")?,
            failed_permanent: get(row, "failed_permanent")?,
            oldest_processing_created_at: row.time("oldest_processing")?,
            now: row.time_at("db_now")?,
        })
    }
}

#[cfg(all(test, any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
mod tests {
    use super::*;

    #[test]
    fn history_columns_decode_archived_then_live_with_escaped_reasons() {
        let archived = "1|||processing|0|7|1700000000000|6|worker|claimed\n\
                        2|processing|0|done|0|7|1700000000100|6|worker|succeeded\n\
                        3|done|0|||7|1700000000200|5|purge|retention expired";
        let live = "4|||processing|0|9|1700000000300|6|worker|claimed\n\
                    5|processing|0|failed|1|9|1700000000400|6|worker|a\\nb \\\\ c \\x|d";
        let h = decode_history_columns("sqlite", Some(archived), Some(live)).unwrap();
        assert_eq!(h.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
        assert_eq!((h[2].to, h[2].actor), (None, Actor::Purge));
        assert_eq!(h[4].to, Some(KeyState::Failed { retryable: true }));
        assert_eq!(h[4].reason.as_deref(), Some("a\nb \\ c \\x|d"));
        assert_eq!(h[4].at.timestamp_millis(), 1_700_000_000_400);
        assert!(
            decode_history_columns("sqlite", None, None)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_damaged_history_entry_is_a_corrupt_error() {
        for bad in [
            "x|||processing|0|1|1|6|worker",
            "1|||processing|0|1|1|9|worker",
            "1|",
        ] {
            let err = decode_history_columns("postgres", None, Some(bad)).unwrap_err();
            assert!(matches!(err, StoreError::Corrupt { .. }), "{bad}: {err}");
        }
    }
}
