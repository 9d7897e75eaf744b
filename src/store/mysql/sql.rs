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
use crate::store::sql_core::{HistorySql, ReadSql};

macro_rules! cols {
    () => {
        key_columns!("", "`key`")
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

/// The claim, one round trip: a call of the `idempotency_keys_claim` procedure (migration
/// `migrations/mysql/20261208000001_baseline.sql`). It reads the
/// row and returns it untouched when it is present and not claimable (a replay writes nothing);
/// otherwise a key it found absent is inserted by a plain `INSERT`, and a key that is there (or
/// was inserted since the read) goes through the `INSERT .. ON DUPLICATE KEY UPDATE` that
/// decides atomically; the row is read back.
/// The claimer won when the returned `claim_nonce` is its own nonce. No row: purged between the
/// write and the read-back. Parameters: scope, key, operation, provider, provider key,
/// fingerprint, request, owner, lease µs, retention ms, takeover window µs or NULL, nonce, the
/// base of a re-created key's provider key or NULL.
pub(super) const CLAIM: &str = "CALL idempotency_keys_claim(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

/// The claim procedure's source, for the test that checks its reason spellings.
#[cfg(test)]
pub(in crate::store) const CLAIM_PROCEDURE: &str =
    include_str!("../../../migrations/mysql/20261208000001_baseline.sql");

/// The finish, one round trip: the fenced `UPDATE` and the read of the row it wrote, in one
/// transaction inside the `idempotency_keys_finish` procedure. No row: the fence refused it and
/// nothing was written. Parameters: scope, key, state, retryable, status, headers, body, error,
/// token or NULL, actor, reason, expected token or NULL.
pub(super) const FINISH: &str = "CALL idempotency_keys_finish(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

/// The lease renewal, one round trip (`idempotency_keys_extend`): the new expiry, or no row when
/// the fence refused it. Parameters: scope, key, token, lease µs.
/// An atomic phase's record of its step (`store::phase::AtomicPhase`): the fenced finish into `done`
/// as `idempotency_keys_finish` does it, as a plain statement inside the application's
/// transaction (the procedure has a transaction of its own); the update trigger writes the
/// history row. No column reads another the statement assigns, so assignment order is moot.
pub(super) const ATOMIC_DONE: &str = "UPDATE idempotency_keys SET state = 'done', retryable = FALSE, \
    response_status = ?, response_headers = ?, response_body = ?, error = NULL, \
    lease_owner = NULL, lease_expires_at = NULL, updated_at = UTC_TIMESTAMP(6), \
    expires_at = UTC_TIMESTAMP(6) + INTERVAL (retention_ms * 1000) MICROSECOND, \
    next_check_at = NULL, version = version + 1, last_actor = 'worker', last_reason = ?, \
    claim_nonce = NULL \
    WHERE scope = ? AND `key` = ? AND state = 'processing' AND lease_token = ?";

pub(super) const EXTEND: &str = "CALL idempotency_keys_extend(?, ?, ?, ?)";

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

/// Picks stale keys, locking them and skipping keys another sweeper holds.
pub(super) const PICK_STALE: &str = concat!(
    "SELECT scope, `key` FROM idempotency_keys \
     WHERE state = 'processing' AND lease_expires_at <= ",
    now!(),
    " AND (next_check_at IS NULL OR next_check_at <= ",
    now!(),
    ") AND (? IS NULL OR scope = ?) ORDER BY lease_expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
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
    " AND (? IS NULL OR scope = ?) ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
);

/// Followed by `(scope, key) IN (..)`.
pub(super) const DELETE_PICKED: &str =
    "DELETE FROM idempotency_keys WHERE state <> 'processing' AND (scope, `key`) IN ";

pub(super) const READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// The statements of the reads written once in `store::sql_core`.
pub(super) const READS: ReadSql = ReadSql {
    history: HistorySql::Rows(concat!(
        "SELECT ",
        event_columns!(),
        " FROM idempotency_key_events WHERE scope = ? AND `key` = ? ORDER BY id"
    )),
    stats: concat!(
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
    ),
    // Processing keys first claimed at least the given µs ago.
    stuck_count: concat!(
        "SELECT COUNT(*) FROM idempotency_keys WHERE state = 'processing' AND created_at <= ",
        now!(),
        " - INTERVAL ? MICROSECOND"
    ),
    // The oldest of them, oldest first. Parameters: age µs, limit.
    stuck_list: concat!(
        "SELECT ",
        cols!(),
        " FROM idempotency_keys WHERE state = 'processing' AND created_at <= ",
        now!(),
        " - INTERVAL ? MICROSECOND ORDER BY created_at, scope, `key` LIMIT ?"
    ),
    // Finished keys a purge would delete now.
    count_expired: concat!(
        "SELECT COUNT(*) FROM idempotency_keys WHERE state <> 'processing' AND expires_at <= ",
        now!()
    ),
};
