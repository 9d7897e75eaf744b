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

/// Inside `CLAIM`'s `ON DUPLICATE KEY UPDATE`: whether the existing row is claimable, judged
/// from its columns as they were before the statement (parameters: fingerprint, window µs).
macro_rules! claimable {
    () => {
        concat!(
            "IFNULL(fingerprint = ? AND ((state = 'failed' AND retryable) \
               OR (state = 'processing' AND lease_expires_at <= ",
            now!(),
            " AND created_at > ",
            now!(),
            " - INTERVAL ? MICROSECOND)), FALSE)"
        )
    };
}

/// Inside `CLAIM`'s `ON DUPLICATE KEY UPDATE`: whether this claim won the row (parameters:
/// nonce, fingerprint, window µs). Right whichever order the server assigns in: assigning left
/// to right, `claim_nonce` (assigned first) already holds this claim's nonce when it won, and
/// no column changed when it lost, so [`claimable!`] still sees the old row; with
/// `SIMULTANEOUS_ASSIGNMENT`, every expression sees the old row and [`claimable!`] decides.
macro_rules! won {
    () => {
        concat!("(claim_nonce <=> ? OR ", claimable!(), ")")
    };
}

/// One parameter of [`CLAIM`], in statement order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClaimParam {
    Scope,
    Key,
    Operation,
    Provider,
    ProviderKey,
    Fingerprint,
    Request,
    Owner,
    LeaseMicros,
    RetentionMs,
    Nonce,
    WindowMicros,
}

use ClaimParam as P;

/// The parameters of [`won!`], in order.
macro_rules! won_params {
    () => {
        [P::Nonce, P::Fingerprint, P::WindowMicros]
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

/// Insert, or take the existing row when it is claimable: a `failed{retryable}` row with the same
/// fingerprint, or an expired processing row created inside the takeover window (NULL: none).
/// The first assignment records the verdict in `claim_nonce`; every later assignment asks
/// [`won!`], which does not depend on the order the server assigns in (`sql_mode`
/// `SIMULTANEOUS_ASSIGNMENT` or not). No `VALUES()` (deprecated in MySQL 8.0.20): the new values
/// are bound again. Parameters: [`CLAIM_PARAMS`].
pub(super) const CLAIM: &str = concat!(
    "INSERT INTO idempotency_keys (scope, `key`, operation, provider, provider_key, state, \
       retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, \
       created_at, updated_at, retention_ms, version, last_actor, last_reason, claim_nonce, \
       last_attempt_at, may_have_acted) \
     VALUES (?, ?, ?, ?, ?, 'processing', FALSE, ?, ?, \
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', ",
    now!(),
    "), ?, ",
    now!(),
    " + INTERVAL ? MICROSECOND, 1, ",
    now!(),
    ", ",
    now!(),
    ", ?, 1, 'worker', 'claimed', ?, ",
    now!(),
    ", FALSE) \
     ON DUPLICATE KEY UPDATE \
       claim_nonce = IF(",
    claimable!(),
    ", ?, claim_nonce), \
       last_reason = IF(",
    won!(),
    ", IF(state = 'failed', 'reclaimed after a retryable failure', \
           'retry took over an expired lease'), last_reason), \
       request = IF(",
    won!(),
    ", COALESCE(?, request), request), \
       lease_token = IF(",
    won!(),
    ", lease_token + 1, lease_token), \
       lease_owner = IF(",
    won!(),
    ", ?, lease_owner), \
       attempts = IF(",
    won!(),
    ", attempts + 1, attempts), \
       updated_at = IF(",
    won!(),
    ", ",
    now!(),
    ", updated_at), \
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
    ", ?, retention_ms), \
       last_actor = IF(",
    won!(),
    ", 'worker', last_actor), \
       version = IF(",
    won!(),
    ", version + 1, version), \
       may_have_acted = IF(",
    won!(),
    ", IF(state = 'failed', may_have_acted, TRUE), may_have_acted), \
       last_attempt_at = IF(",
    won!(),
    ", ",
    now!(),
    ", last_attempt_at), \
       lease_expires_at = IF(",
    won!(),
    ", ",
    now!(),
    " + INTERVAL ? MICROSECOND, lease_expires_at), \
       retryable = IF(",
    won!(),
    ", FALSE, retryable), \
       state = IF(",
    won!(),
    ", 'processing', state)"
);

/// The parameters of [`CLAIM`], in statement order (a unit test counts the placeholders).
pub(super) const CLAIM_PARAMS: &[ClaimParam] = &concat_params();

const fn concat_params() -> [ClaimParam; 78] {
    let head = [
        P::Scope,
        P::Key,
        P::Operation,
        P::Provider,
        P::ProviderKey,
        P::Fingerprint,
        P::Request,
        P::Owner,
        P::LeaseMicros,
        P::RetentionMs,
        P::Nonce,
        // claim_nonce = IF(claimable, nonce, ..)
        P::Fingerprint,
        P::WindowMicros,
        P::Nonce,
    ];
    // After each won!(): the assignment's own parameter, if any.
    let own: [Option<ClaimParam>; 20] = [
        None,                 // last_reason
        Some(P::Request),     // request
        None,                 // lease_token
        Some(P::Owner),       // lease_owner
        None,                 // attempts
        None,                 // updated_at
        None,                 // expires_at
        None,                 // next_check_at
        None,                 // error
        None,                 // response_status
        None,                 // response_headers
        None,                 // response_body
        Some(P::RetentionMs), // retention_ms
        None,                 // last_actor
        None,                 // version
        None,                 // may_have_acted
        None,                 // last_attempt_at
        Some(P::LeaseMicros), // lease_expires_at
        None,                 // retryable
        None,                 // state
    ];
    let mut out = [P::Scope; 78];
    let mut n = 0;
    while n < head.len() {
        out[n] = head[n];
        n += 1;
    }
    let won = won_params!();
    let mut i = 0;
    while i < 20 {
        let mut j = 0;
        while j < won.len() {
            out[n] = won[j];
            n += 1;
            j += 1;
        }
        if let Some(p) = own[i] {
            out[n] = p;
            n += 1;
        }
        i += 1;
    }
    assert!(n == 78);
    out
}

/// Parameters: retryable (clears `may_have_acted` when the outcome says nothing happened), state,
/// retryable, status, headers, body, error, token, actor, reason, scope, key, token, token,
/// expected token, expected token.
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
     WHERE scope = ? AND `key` = ? AND (? IS NULL OR (state = 'processing' AND lease_token = ?)) \
       AND (? IS NULL OR (state = 'processing' AND lease_token = ?))"
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

    #[test]
    fn claim_binds_one_parameter_per_placeholder_and_no_values() {
        assert_eq!(super::CLAIM.matches('?').count(), super::CLAIM_PARAMS.len());
        assert!(!super::CLAIM.contains("VALUES("), "VALUES() is deprecated");
    }
}
