//! The MariaDB / MySQL statements. Every time comes from the server's `UTC_TIMESTAMP(6)`, which
//! is one instant for the whole statement (triggers included). Durations are bound as integer
//! microseconds. No statement relies on `RETURNING` (MariaDB has none on `UPDATE`, MySQL none
//! at all).

macro_rules! now {
    () => {
        "UTC_TIMESTAMP(6)"
    };
}

use crate::store::rows::{event_columns, key_columns};

macro_rules! cols {
    () => {
        key_columns!("", "`key`")
    };
}

/// Inside `CLAIM`'s `ON DUPLICATE KEY UPDATE`, after `claim_nonce` was assigned first: whether
/// this claim won the row.
macro_rules! won {
    () => {
        "claim_nonce <=> VALUES(claim_nonce)"
    };
}

pub(super) const NOW: &str = concat!("SELECT ", now!());

pub(super) const GET: &str = concat!(
    "SELECT ",
    cols!(),
    ", claim_nonce, last_reason, ",
    now!(),
    " AS db_now FROM idempotency_keys WHERE scope = ? AND `key` = ?"
);

/// Insert, or take the existing row when it is claimable: a `failed{retryable}` row with the
/// same fingerprint, or an expired processing row created inside the takeover window (the last
/// parameter, in microseconds, or NULL). `ON DUPLICATE KEY UPDATE` assigns left to right, so the
/// first assignment judges the old row and records the verdict in `claim_nonce`; every later
/// assignment follows it. Parameters: scope, key, operation, provider, provider_key,
/// fingerprint, request, owner, lease µs, retention ms, nonce, window µs.
pub(super) const CLAIM: &str = concat!(
    "INSERT INTO idempotency_keys (scope, `key`, operation, provider, provider_key, state, \
       retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, \
       created_at, updated_at, retention_ms, version, last_actor, last_reason, claim_nonce, \
       last_attempt_at, may_have_acted) \
     VALUES (?, ?, ?, ?, ?, 'processing', FALSE, ?, ?, 1, ?, ",
    now!(),
    " + INTERVAL ? MICROSECOND, 1, ",
    now!(),
    ", ",
    now!(),
    ", ?, 1, 'worker', 'claimed', ?, ",
    now!(),
    ", FALSE) \
     ON DUPLICATE KEY UPDATE \
       claim_nonce = IF(IFNULL(fingerprint = VALUES(fingerprint) AND ( \
           (state = 'failed' AND retryable) \
           OR (state = 'processing' AND lease_expires_at <= ",
    now!(),
    " AND created_at > ",
    now!(),
    " - INTERVAL ? MICROSECOND)), FALSE), VALUES(claim_nonce), claim_nonce), \
       may_have_acted = IF(",
    won!(),
    ", IF(state = 'failed', may_have_acted, TRUE), may_have_acted), \
       last_attempt_at = IF(",
    won!(),
    ", VALUES(last_attempt_at), last_attempt_at), \
       last_reason = IF(",
    won!(),
    ", IF(state = 'failed', 'reclaimed after a retryable failure', \
           'retry took over an expired lease'), last_reason), \
       state = IF(",
    won!(),
    ", 'processing', state), \
       retryable = IF(",
    won!(),
    ", FALSE, retryable), \
       request = IF(",
    won!(),
    ", COALESCE(VALUES(request), request), request), \
       lease_token = IF(",
    won!(),
    ", lease_token + 1, lease_token), \
       lease_owner = IF(",
    won!(),
    ", VALUES(lease_owner), lease_owner), \
       lease_expires_at = IF(",
    won!(),
    ", VALUES(lease_expires_at), lease_expires_at), \
       attempts = IF(",
    won!(),
    ", attempts + 1, attempts), \
       updated_at = IF(",
    won!(),
    ", VALUES(updated_at), updated_at), \
       expires_at = IF(",
    won!(),
    ", NULL, expires_at), \
       next_check_at = IF(",
    won!(),
    ", NULL, next_check_at), \
       error = IF(",
    won!(),
    ", NULL, error), \
       response_status = IF(",
    won!(),
    ", NULL, response_status), \
       response_headers = IF(",
    won!(),
    ", NULL, response_headers), \
       response_body = IF(",
    won!(),
    ", NULL, response_body), \
       retention_ms = IF(",
    won!(),
    ", VALUES(retention_ms), retention_ms), \
       last_actor = IF(",
    won!(),
    ", 'worker', last_actor), \
       version = IF(",
    won!(),
    ", version + 1, version)"
);

/// Parameters: retryable, state, retryable, status, headers, body, error, token, actor, reason,
/// scope, key, token, token.
pub(super) const FINISH: &str = concat!(
    "UPDATE idempotency_keys SET may_have_acted = IF(?, FALSE, may_have_acted), state = ?, retryable = ?, response_status = ?, \
       response_headers = ?, response_body = ?, error = ?, \
       lease_token = IF(? IS NULL, lease_token + 1, lease_token), \
       lease_owner = NULL, lease_expires_at = NULL, \
       updated_at = ",
    now!(),
    ", expires_at = ",
    now!(),
    " + INTERVAL (retention_ms * 1000) MICROSECOND, next_check_at = NULL, \
       version = version + 1, last_actor = ?, last_reason = ?, claim_nonce = NULL \
     WHERE scope = ? AND `key` = ? AND (? IS NULL OR (state = 'processing' AND lease_token = ?))"
);

/// Parameters: recheck µs or NULL, error, actor, reason, actor, actor, scope, key, token.
pub(super) const RELEASE: &str = concat!(
    "UPDATE idempotency_keys SET lease_owner = NULL, \
       lease_expires_at = LEAST(lease_expires_at, ",
    now!(),
    "), next_check_at = ",
    now!(),
    " + INTERVAL ? MICROSECOND, error = COALESCE(?, error), updated_at = ",
    now!(),
    ", version = version + 1, last_actor = ?, last_reason = ?, \
       last_attempt_at = IF(? = 'worker', ",
    now!(),
    ", last_attempt_at), may_have_acted = (may_have_acted OR ? = 'worker') \
     WHERE scope = ? AND `key` = ? AND state = 'processing' AND lease_token = ?"
);

/// Parameters: scope, key, token.
pub(super) const MARK_ATTEMPT: &str = concat!(
    "UPDATE idempotency_keys SET last_attempt_at = ",
    now!(),
    ", may_have_acted = TRUE, updated_at = ",
    now!(),
    " WHERE scope = ? AND `key` = ? AND state = 'processing' AND lease_token = ?"
);

/// Parameters: lease µs, scope, key, token.
pub(super) const EXTEND: &str = concat!(
    "UPDATE idempotency_keys SET lease_expires_at = ",
    now!(),
    " + INTERVAL ? MICROSECOND \
     WHERE scope = ? AND `key` = ? AND state = 'processing' AND lease_token = ?"
);

pub(super) const LEASE_OF: &str =
    "SELECT lease_expires_at FROM idempotency_keys WHERE scope = ? AND `key` = ?";

/// Picks stale keys, locking them and skipping keys another sweeper holds.
pub(super) const PICK_STALE: &str = concat!(
    "SELECT scope, `key` FROM idempotency_keys \
     WHERE state = 'processing' AND lease_expires_at <= ",
    now!(),
    " AND (next_check_at IS NULL OR next_check_at <= ",
    now!(),
    ") ORDER BY lease_expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
);

/// Followed by `(scope, key) IN (..)`. Parameters: owner, lease µs.
pub(super) const TAKE_PICKED: &str = concat!(
    "UPDATE idempotency_keys SET last_attempt_at = IF(lease_owner IS NULL, last_attempt_at, \
         GREATEST(COALESCE(last_attempt_at, created_at), lease_expires_at)), \
       may_have_acted = TRUE, lease_token = lease_token + 1, lease_owner = ?, \
       lease_expires_at = ",
    now!(),
    " + INTERVAL ? MICROSECOND, attempts = attempts + 1, updated_at = ",
    now!(),
    ", version = version + 1, last_actor = 'sweeper', \
       last_reason = 'sweeper took over an expired lease', claim_nonce = NULL \
     WHERE state = 'processing' AND (scope, `key`) IN "
);

/// Followed by `(scope, key) IN (..)`.
pub(super) const READ_PICKED: &str = concat!(
    "SELECT ",
    cols!(),
    " FROM idempotency_keys WHERE (scope, `key`) IN "
);

pub(super) const PICK_EXPIRED: &str = concat!(
    "SELECT scope, `key` FROM idempotency_keys \
     WHERE state <> 'processing' AND expires_at <= ",
    now!(),
    " ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
);

/// Followed by `(scope, key) IN (..)`.
pub(super) const DELETE_PICKED: &str =
    "DELETE FROM idempotency_keys WHERE state <> 'processing' AND (scope, `key`) IN ";

pub(super) const READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

pub(super) const HISTORY: &str = concat!(
    "SELECT ",
    event_columns!(),
    " FROM idempotency_key_events WHERE scope = ? AND `key` = ? ORDER BY id"
);

pub(super) const STATS: &str = concat!(
    "SELECT \
       COUNT(CASE WHEN state = 'processing' THEN 1 END) AS processing, \
       COUNT(CASE WHEN state = 'processing' AND lease_expires_at <= ",
    now!(),
    " THEN 1 END) AS stale, \
       COUNT(CASE WHEN state = 'done' THEN 1 END) AS done, \
       COUNT(CASE WHEN state = 'failed' AND retryable THEN 1 END) AS failed_retryable, \
       COUNT(CASE WHEN state = 'failed' AND NOT retryable THEN 1 END) AS failed_permanent, \
       MIN(CASE WHEN state = 'processing' THEN created_at END) AS oldest_processing, ",
    now!(),
    " AS db_now FROM idempotency_keys"
);

/// Processing keys first claimed at least the given µs ago.
pub(super) const STUCK_COUNT: &str = concat!(
    "SELECT COUNT(*) FROM idempotency_keys WHERE state = 'processing' AND created_at <= ",
    now!(),
    " - INTERVAL ? MICROSECOND"
);

/// The oldest of them, oldest first. Parameters: age µs, limit.
pub(super) const STUCK_LIST: &str = concat!(
    "SELECT ",
    cols!(),
    " FROM idempotency_keys WHERE state = 'processing' AND created_at <= ",
    now!(),
    " - INTERVAL ? MICROSECOND ORDER BY created_at, scope, `key` LIMIT ?"
);

/// Finished keys a purge would delete now.
pub(super) const COUNT_EXPIRED: &str = concat!(
    "SELECT COUNT(*) FROM idempotency_keys WHERE state <> 'processing' AND expires_at <= ",
    now!()
);

#[cfg(test)]
mod tests {
    #[test]
    fn claim_spells_the_claim_reasons() {
        crate::store::assert_claim_reasons(super::CLAIM);
    }
}
