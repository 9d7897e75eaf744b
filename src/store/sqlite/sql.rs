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

use crate::store::rows::key_columns;
use crate::store::sql_core::{HistorySql, ReadSql};

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
/// replay or an in-flight answer never needs it. The key's scope and key are the parameters
/// named.
macro_rules! claim_read {
    ($scope:literal, $key:literal) => {
        concat!(
            "SELECT ",
            key_columns!("key", request: "NULL AS request"),
            ", ",
            now!(),
            " AS db_now FROM idempotency_keys WHERE scope = ",
            $scope,
            " AND key = ",
            $key
        )
    };
}

/// [`claim_read!`] of `?1`, `?2`.
pub(super) const CLAIM_READ: &str = claim_read!("?1", "?2");

/// [`claim_read!`] of the 17th and 18th arguments: the next phase's read, sent after
/// [`CLAIM_DONE`] (whose parameters are `?1` .. `?16`) in one query string (`atomic.rs`).
/// Spelled `$17`, `$18`: SQLite numbers `$NNN` parameters as names, in order (1, 2), where
/// `?17` would open sixteen unused slots, which sqlx binds as if they were plain `?`s, in
/// sequence, from where the statement before stopped, and leaves the rest unbound once that
/// sequence passes the last argument. sqlx takes a `$NNN` name as the argument's number.
pub(super) const CLAIM_READ_NEXT: &str = claim_read!("$17", "$18");

/// One history entry (`rows::decode_history_entry`) as an expression over SQL fragments: seq,
/// from state, from retryable, to state, to retryable, token, actor, reason (`NULL` fields are
/// written empty). The reason is cut to 512 characters, then its `\` and line feeds are escaped,
/// so an entry never holds a line feed.
///
/// One `printf` call, not a chain of `||`: each `||` allocates and copies a new string; in
/// SQLite 3.40 a chain of 18 took 2.3 us where `printf` takes 0.9 us (`docs/performance.md`,
/// "The VM's idle policy, and the key's work counted in instructions"). `%s` writes a `NULL` as
/// the empty string, as `ifnull(.., '')` did; the seq, the clock and the actor are never `NULL`.
macro_rules! entry {
    ($seq:expr, $from:expr, $from_rt:expr, $to:expr, $to_rt:expr, $tok:expr, $actor:expr,
     $reason:expr) => {
        concat!(
            "printf('%s|%s|%s|%s|%s|%s|%s|%s|%s%s', ",
            $seq,
            ", ",
            $from,
            ", ",
            $from_rt,
            ", ",
            $to,
            ", ",
            $to_rt,
            ", ",
            $tok,
            ", ",
            now!(),
            ", length(",
            $actor,
            "), ",
            $actor,
            ", ifnull('|' || replace(replace(substr(",
            $reason,
            ", 1, 512), '\\', '\\\\'), char(10), '\\n'), ''))"
        )
    };
}

/// `$history` with `$entry` appended, its oldest entries dropped past 14,336 characters (an
/// entry is at most ~1.2 KB, so the column stays under 16 KB).
macro_rules! append {
    ($history:expr, $entry:expr) => {
        concat!(
            "CASE WHEN length(",
            $history,
            ") <= 14336 THEN ",
            $history,
            " ELSE substr(substr(",
            $history,
            ", -14336), instr(substr(",
            $history,
            ", -14336), char(10)) + 1) END || char(10) || ",
            $entry
        )
    };
}

/// The digits `provider_key::renewed` appends to a renewed key's base: the life number (the
/// position of the claim's event in the key's history) modulo 2^32 as 8 lowercase hex digits.
macro_rules! renewed {
    ($life:expr) => {
        concat!("printf('%08x', (", $life, ") & 4294967295)")
    };
}

/// A new row's life number, `s.seq`: one after the last of its key's purged lives (the
/// tombstone), or 1 (`?1` scope, `?2` key).
macro_rules! new_seq {
    () => {
        "(SELECT COALESCE((SELECT last_seq FROM idempotency_key_tombstones \
         WHERE scope = ?1 AND key = ?2), 0) + 1 AS seq) s"
    };
}

/// A new row's provider key: `?5`, or, for a key re-created after its purge (`s.seq > 1`) with a
/// renewable key (`?12` its base), the base and the life number.
macro_rules! new_provider_key {
    () => {
        concat!(
            "CASE WHEN ?12 IS NOT NULL AND s.seq > 1 THEN ?12 || ",
            renewed!("s.seq"),
            " ELSE ?5 END"
        )
    };
}

/// A new row's first history entry: claimed by the worker under the first token.
macro_rules! claimed_entry {
    () => {
        entry!(
            "s.seq",
            "NULL",
            "NULL",
            "'processing'",
            "'0'",
            now_us!(),
            "'worker'",
            "'claimed'"
        )
    };
}

/// Claim a new key: `INSERT .. ON CONFLICT DO NOTHING`, with its first history entry, numbered
/// after any purged life's in the tombstone. A present key is not written (no row returned):
/// the store reads it, and runs [`RECLAIM`] when it is claimable.
///
/// Bound by `sql_core::bind_claim` (?1 scope .. ?12 the base of a re-created key's provider key).
pub(in crate::store) const CLAIM: &str = concat!(
    "INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, state, \
       retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, \
       created_at, updated_at, retention_ms, version, history, last_attempt_at, may_have_acted) \
     SELECT ?1, ?2, ?3, ?4, ",
    new_provider_key!(),
    ", \
       'processing', 0, ?6, ?7, ",
    now_us!(),
    ", ?8, ",
    now!(),
    " + ?9, 1, ",
    now!(),
    ", ",
    now!(),
    ", ?10, s.seq, ",
    claimed_entry!(),
    ", ",
    now!(),
    ", 0 FROM ",
    new_seq!(),
    " WHERE true \
     ON CONFLICT (scope, key) DO NOTHING \
     RETURNING lease_token, lease_expires_at, attempts, provider_key, may_have_acted, \
       'claimed' AS last_reason, created_at"
);

/// An atomic phase's new key, claimed and finished `done` in one insert after the application's
/// writes (`atomic.rs`): the row [`CLAIM`] writes, then [`FINISH`] by its holder, with both
/// history entries, written once. Run only by the writer, inside its `BEGIN IMMEDIATE`, after a
/// read found no row: the write lock keeps the key absent until this insert, and the primary
/// key would refuse a second row all the same (no `ON CONFLICT`).
///
/// Bound as [`CLAIM`] (`?8` the owner, `?9` the lease and `?11` unused: the key is never
/// held), then `?13` status, `?14` headers, `?15` body, `?16` the reason.
pub(super) const CLAIM_DONE: &str = concat!(
    "INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, state, \
       retryable, fingerprint, request, response_status, response_headers, response_body, \
       lease_token, attempts, created_at, updated_at, expires_at, retention_ms, version, \
       history, last_attempt_at, may_have_acted) \
     SELECT ?1, ?2, ?3, ?4, ",
    new_provider_key!(),
    ", 'done', 0, ?6, ?7, ?13, ?14, ?15, ",
    now_us!(),
    ", 1, ",
    now!(),
    ", ",
    now!(),
    ", ",
    now!(),
    " + ?10, ?10, s.seq + 1, ",
    claimed_entry!(),
    " || char(10) || ",
    entry!(
        "s.seq + 1",
        "'processing'",
        "'0'",
        "'done'",
        "'0'",
        now_us!(),
        "'worker'",
        "?16"
    ),
    ", ",
    now!(),
    ", 0 FROM ",
    new_seq!()
);

/// The reason a reclaim records (`?13`: the state the store read).
macro_rules! reclaim_reason {
    () => {
        "CASE WHEN ?13 = 'failed' THEN 'reclaimed after a retryable failure' \
         ELSE 'retry took over an expired lease' END"
    };
}

/// Claim a present row that `kit::claimable` judged claimable when the store read it in state
/// `?13`: a reclaim of `failed{retryable}` or a takeover of an expired lease. The `WHERE` judges
/// the row as it is now (the same rule, on the writer), so no row means it changed since it was
/// read, and the store claims again. Bound as [`CLAIM`], then `?13`.
pub(in crate::store) const RECLAIM: &str = concat!(
    "UPDATE idempotency_keys SET state = 'processing', retryable = 0, \
       request = COALESCE(?7, request), \
       provider_key = CASE WHEN state = 'failed' AND provider IS NOT ?4 THEN \
         (CASE WHEN ?12 IS NULL THEN ?5 WHEN length(provider_key) <= length(?5) THEN provider_key \
           ELSE ?12 || ",
    renewed!("version + 1"),
    " END) \
         ELSE provider_key END, \
       provider = CASE WHEN state = 'failed' THEN ?4 ELSE provider END, \
       lease_token = lease_token + 1, lease_owner = ?8, lease_expires_at = ",
    now!(),
    " + ?9, attempts = attempts + 1, updated_at = ",
    now!(),
    ", expires_at = NULL, next_check_at = NULL, error = NULL, response_status = NULL, \
       response_headers = NULL, response_body = NULL, retention_ms = ?10, \
       version = version + 1, last_attempt_at = ",
    now!(),
    ", may_have_acted = CASE WHEN state = 'failed' THEN may_have_acted ELSE 1 END, history = ",
    append!(
        "history",
        entry!(
            "version + 1",
            "state",
            "retryable",
            "'processing'",
            "'0'",
            "lease_token + 1",
            "'worker'",
            reclaim_reason!()
        )
    ),
    " WHERE scope = ?1 AND key = ?2 AND state = ?13 AND fingerprint = ?6 AND ( \
       (state = 'failed' AND retryable = 1 AND (provider IS ?4 OR may_have_acted = 0)) \
       OR (?11 IS NOT NULL AND state = 'processing' AND provider IS ?4 \
         AND lease_expires_at <= ",
    now!(),
    " AND created_at > ",
    now!(),
    " - ?11)) \
     RETURNING lease_token, lease_expires_at, attempts, provider_key, may_have_acted, ",
    reclaim_reason!(),
    " AS last_reason, created_at"
);

/// The new token of a finish (`?9`: the holder's token, or NULL for an override).
macro_rules! finish_token {
    () => {
        "CASE WHEN ?9 IS NULL THEN lease_token + 1 ELSE lease_token END"
    };
}

pub(super) const FINISH: &str = concat!(
    "UPDATE idempotency_keys SET state = ?3, retryable = ?4, response_status = ?5, \
       response_headers = ?6, response_body = ?7, error = ?8, lease_token = ",
    finish_token!(),
    ", lease_owner = NULL, lease_expires_at = NULL, \
       may_have_acted = CASE WHEN ?4 THEN 0 ELSE may_have_acted END, updated_at = ",
    now!(),
    ", expires_at = ",
    now!(),
    " + retention_ms, next_check_at = NULL, version = version + 1, history = ",
    append!(
        "history",
        entry!(
            "version + 1",
            "state",
            "retryable",
            "?3",
            "CASE WHEN ?4 THEN '1' ELSE '0' END",
            finish_token!(),
            "?10",
            "?11"
        )
    ),
    " WHERE scope = ?1 AND key = ?2 AND (?9 IS NULL OR (state = 'processing' AND lease_token = ?9)) \
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
       version = version + 1, history = ",
    append!(
        "history",
        entry!(
            "version + 1",
            "state",
            "retryable",
            "state",
            "retryable",
            "lease_token",
            "?6",
            "?7"
        )
    ),
    " WHERE scope = ?1 AND key = ?2 AND state = 'processing' AND lease_token = ?3"
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
    ", version = version + 1, history = ",
    append!(
        "history",
        entry!(
            "version + 1",
            "state",
            "retryable",
            "state",
            "retryable",
            "lease_token + 1",
            "'sweeper'",
            "'sweeper took over an expired lease'"
        )
    ),
    " WHERE state = 'processing' AND (scope, key) IN ( \
       SELECT scope, key FROM idempotency_keys \
       WHERE state = 'processing' AND lease_expires_at <= ",
    now!(),
    " AND (next_check_at IS NULL OR next_check_at <= ",
    now!(),
    ") AND (?4 IS NULL OR scope = ?4) ORDER BY lease_expires_at LIMIT ?3) \
     RETURNING ",
    cols!()
);

/// Deletes up to `?1` expired finished keys. The `idempotency_keys_archive` trigger (purge only,
/// never on a claim or a finish) moves each one's history, with a last entry for the purge, into
/// its tombstone, inside this statement.
pub(super) const PURGE: &str = concat!(
    "DELETE FROM idempotency_keys WHERE (scope, key) IN ( \
       SELECT scope, key FROM idempotency_keys \
       WHERE state <> 'processing' AND expires_at <= ",
    now!(),
    " ORDER BY expires_at LIMIT ?1)"
);

/// The statements of the reads written once in `store::sql_core`.
pub(super) const READS: ReadSql = ReadSql {
    history: HistorySql::Columns(
        "SELECT (SELECT history FROM idempotency_key_tombstones \
           WHERE scope = ?1 AND key = ?2) AS archived, \
         (SELECT history FROM idempotency_keys WHERE scope = ?1 AND key = ?2) AS live",
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
