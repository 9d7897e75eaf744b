//! The SQLite statements. Times are integer milliseconds from SQLite's own clock; within one
//! statement `now` is a single instant.

macro_rules! now {
    () => {
        "CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}

/// A new row's first lease token: the clock in microseconds since the epoch (ms resolution
/// here), so tokens only grow across purge.
macro_rules! now_us {
    () => {
        "(CAST(unixepoch('subsec') * 1000 AS INTEGER) * 1000)"
    };
}

use crate::store::rows::{event_columns, key_columns};
use crate::store::sql_core::ReadSql;

macro_rules! cols {
    () => {
        key_columns!("", "key")
    };
}

pub(super) const NOW: &str = concat!("SELECT ", now!());

pub(super) const GET: &str = concat!(
    "SELECT ",
    cols!(),
    ", ",
    now!(),
    " AS db_now FROM idempotency_keys WHERE scope = ?1 AND key = ?2"
);

/// `GET` without the stored request (up to the request cap in size), for the claim's read: a
/// replay or an in-flight answer never needs it.
pub(super) const CLAIM_READ: &str = concat!(
    "SELECT ",
    key_columns!("key", request: "NULL AS request"),
    ", ",
    now!(),
    " AS db_now FROM idempotency_keys WHERE scope = ?1 AND key = ?2"
);

pub(in crate::store) const CLAIM: &str = concat!(
    "INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, state, retryable, \
       fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, created_at, \
       updated_at, retention_ms, version, last_actor, last_reason, last_attempt_at, \
       may_have_acted) \
     VALUES (?1, ?2, ?3, ?4, \
       CASE WHEN ?12 IS NOT NULL AND EXISTS (SELECT 1 FROM idempotency_key_events \
         WHERE scope = ?1 AND key = ?2) THEN ?12 ELSE ?5 END, 'processing', 0, ?6, ?7, ",
    now_us!(),
    ", ?8, ",
    now!(),
    " + ?9, 1, ",
    now!(),
    ", ",
    now!(),
    ", ?10, 1, 'worker', 'claimed', ",
    now!(),
    ", 0) \
     ON CONFLICT (scope, key) DO UPDATE SET \
       state = 'processing', retryable = 0, \
       request = COALESCE(excluded.request, idempotency_keys.request), \
       provider_key = CASE WHEN idempotency_keys.state = 'failed' \
         AND idempotency_keys.provider IS NOT excluded.provider \
         THEN excluded.provider_key ELSE idempotency_keys.provider_key END, \
       provider = CASE WHEN idempotency_keys.state = 'failed' \
         THEN excluded.provider ELSE idempotency_keys.provider END, \
       lease_token = idempotency_keys.lease_token + 1, lease_owner = excluded.lease_owner, \
       lease_expires_at = excluded.lease_expires_at, attempts = idempotency_keys.attempts + 1, \
       updated_at = excluded.updated_at, expires_at = NULL, next_check_at = NULL, error = NULL, \
       response_status = NULL, response_headers = NULL, response_body = NULL, \
       retention_ms = excluded.retention_ms, version = idempotency_keys.version + 1, \
       last_actor = 'worker', last_attempt_at = excluded.last_attempt_at, \
       may_have_acted = CASE WHEN idempotency_keys.state = 'failed' \
         THEN idempotency_keys.may_have_acted ELSE 1 END, \
       last_reason = CASE WHEN idempotency_keys.state = 'failed' \
         THEN 'reclaimed after a retryable failure' ELSE 'retry took over an expired lease' END \
     WHERE idempotency_keys.fingerprint = excluded.fingerprint AND ( \
       (idempotency_keys.state = 'failed' AND idempotency_keys.retryable = 1 \
         AND (idempotency_keys.provider IS excluded.provider \
           OR idempotency_keys.may_have_acted = 0)) \
       OR (?11 IS NOT NULL AND idempotency_keys.state = 'processing' \
           AND idempotency_keys.provider IS excluded.provider \
           AND idempotency_keys.lease_expires_at <= excluded.updated_at \
           AND idempotency_keys.created_at > excluded.updated_at - ?11)) \
     RETURNING lease_token, lease_expires_at, attempts, provider_key, may_have_acted, last_reason, \
       created_at"
);

pub(super) const FINISH: &str = concat!(
    "UPDATE idempotency_keys SET state = ?3, retryable = ?4, response_status = ?5, \
       response_headers = ?6, response_body = ?7, error = ?8, \
       lease_token = CASE WHEN ?9 IS NULL THEN lease_token + 1 ELSE lease_token END, \
       lease_owner = NULL, lease_expires_at = NULL, \
       may_have_acted = CASE WHEN ?4 THEN 0 ELSE may_have_acted END, updated_at = ",
    now!(),
    ", expires_at = ",
    now!(),
    " + retention_ms, next_check_at = NULL, version = version + 1, \
       last_actor = ?10, last_reason = ?11 \
     WHERE scope = ?1 AND key = ?2 AND (?9 IS NULL OR (state = 'processing' AND lease_token = ?9)) \
       AND (?12 IS NULL OR (state = 'processing' AND lease_token = ?12)) \
     RETURNING ",
    cols!()
);

pub(super) const RELEASE: &str = concat!(
    "UPDATE idempotency_keys SET lease_owner = NULL, \
       lease_expires_at = MIN(lease_expires_at, ",
    now!(),
    "), next_check_at = CASE WHEN ?4 IS NULL THEN NULL ELSE ",
    now!(),
    " + ?4 END, error = COALESCE(?5, error), updated_at = ",
    now!(),
    ", last_attempt_at = CASE WHEN ?6 = 'worker' THEN ",
    now!(),
    " ELSE last_attempt_at END, \
       may_have_acted = CASE WHEN ?6 = 'worker' THEN 1 ELSE may_have_acted END, \
       version = version + 1, last_actor = ?6, last_reason = ?7 \
     WHERE scope = ?1 AND key = ?2 AND state = 'processing' AND lease_token = ?3"
);

pub(super) const MARK_ATTEMPT: &str = concat!(
    "UPDATE idempotency_keys SET last_attempt_at = ",
    now!(),
    ", may_have_acted = 1, updated_at = ",
    now!(),
    " WHERE scope = ?1 AND key = ?2 AND state = 'processing' AND lease_token = ?3"
);

pub(super) const EXTEND: &str = concat!(
    "UPDATE idempotency_keys SET lease_expires_at = ",
    now!(),
    " + ?4 WHERE scope = ?1 AND key = ?2 AND state = 'processing' AND lease_token = ?3 \
       AND lease_owner IS NOT NULL \
     RETURNING lease_expires_at"
);

pub(super) const TAKE_STALE: &str = concat!(
    "UPDATE idempotency_keys SET lease_token = lease_token + 1, lease_owner = ?1, \
       last_attempt_at = CASE WHEN lease_owner IS NULL THEN last_attempt_at \
         ELSE MAX(COALESCE(last_attempt_at, created_at), lease_expires_at) END, \
       may_have_acted = 1, lease_expires_at = ",
    now!(),
    " + ?2, attempts = attempts + 1, updated_at = ",
    now!(),
    ", version = version + 1, last_actor = 'sweeper', \
       last_reason = 'sweeper took over an expired lease' \
     WHERE state = 'processing' AND (scope, key) IN ( \
       SELECT scope, key FROM idempotency_keys \
       WHERE state = 'processing' AND lease_expires_at <= ",
    now!(),
    " AND (next_check_at IS NULL OR next_check_at <= ",
    now!(),
    ") ORDER BY lease_expires_at LIMIT ?3) \
     RETURNING ",
    cols!()
);

pub(super) const PURGE: &str = concat!(
    "DELETE FROM idempotency_keys WHERE (scope, key) IN ( \
       SELECT scope, key FROM idempotency_keys \
       WHERE state <> 'processing' AND expires_at <= ",
    now!(),
    " ORDER BY expires_at LIMIT ?1)"
);

/// The statements of the reads written once in `store::sql_core`.
pub(super) const READS: ReadSql = ReadSql {
    history: concat!(
        "SELECT ",
        event_columns!(),
        " FROM idempotency_key_events WHERE scope = ?1 AND key = ?2 ORDER BY id"
    ),
    stats: concat!(
        "SELECT \
           COALESCE(SUM(state = 'processing'), 0) AS processing, \
           COALESCE(SUM(state = 'processing' AND lease_expires_at <= ",
        now!(),
        "), 0) AS stale, \
           COALESCE(SUM(state = 'done'), 0) AS done, \
           COALESCE(SUM(state = 'failed' AND retryable = 1), 0) AS failed_retryable, \
           COALESCE(SUM(state = 'failed' AND retryable = 0), 0) AS failed_permanent, \
           MIN(CASE WHEN state = 'processing' THEN created_at END) AS oldest_processing, ",
        now!(),
        " AS db_now FROM idempotency_keys"
    ),
    stuck_count: concat!(
        "SELECT COUNT(*) FROM idempotency_keys WHERE state = 'processing' AND created_at <= ",
        now!(),
        " - ?1"
    ),
    stuck_list: concat!(
        "SELECT ",
        cols!(),
        " FROM idempotency_keys WHERE state = 'processing' AND created_at <= ",
        now!(),
        " - ?1 ORDER BY created_at LIMIT ?2"
    ),
    count_expired: concat!(
        "SELECT COUNT(*) FROM idempotency_keys WHERE state <> 'processing' AND expires_at <= ",
        now!()
    ),
};
