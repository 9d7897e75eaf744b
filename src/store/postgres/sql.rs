//! The PostgreSQL statements. Every time comes from the server's `statement_timestamp()`, which
//! is one instant for the whole statement (triggers included) and moves on between statements
//! of one transaction. Durations are bound as integer milliseconds.

macro_rules! now {
    () => {
        "statement_timestamp()"
    };
}

use crate::store::rows::{event_columns, key_columns};
use crate::store::sql_core::ReadSql;

macro_rules! cols {
    ($t:literal) => {
        key_columns!($t, "key")
    };
}

pub(super) const NOW: &str = concat!("SELECT ", now!());

pub(super) const GET: &str = concat!(
    "SELECT ",
    cols!(""),
    ", ",
    now!(),
    " AS db_now FROM idempotency_keys WHERE scope = $1 AND key = $2"
);

/// The claimable rule, on the row's columns (parameters: `$4` provider, `$6` fingerprint, `$11`
/// takeover window in ms or NULL); the same rule as the `ON CONFLICT .. DO UPDATE .. WHERE` of
/// `idempotency_keys_claim_write`.
macro_rules! replay {
    () => {
        concat!(
            "scope = $1::text AND key = $2::text \
             AND NOT COALESCE(fingerprint = $6::text AND ((state = 'failed' AND retryable \
                 AND (provider IS NOT DISTINCT FROM $4::text OR NOT may_have_acted)) \
               OR ($11::bigint IS NOT NULL AND state = 'processing' \
                 AND provider IS NOT DISTINCT FROM $4::text AND lease_expires_at <= ",
            now!(),
            " AND created_at > ",
            now!(),
            " - $11::bigint * interval '1 millisecond')), false)"
        )
    };
}

/// Claim or read in one statement. A replay is the primary-key read of the first branch (the
/// row is present and not claimable: it is returned as it is, `claimed = false`) plus the same
/// probe once more as the second branch's one-time filter, which then skips the write: the
/// function is never called. Only when the row is absent or claimable does the second branch
/// call `idempotency_keys_claim_write` (migration `20261130200001_lean_writes.sql`), which runs
/// `INSERT .. ON CONFLICT (scope, key) DO UPDATE .. WHERE <claimable>`, judging the latest
/// committed row version under its row lock. The result is one row: `claimed = true` with the
/// new lease, or `claimed = false` with the existing row. No row at all means a concurrent
/// writer committed a row that is not claimable after the read: the caller reads again.
///
/// Before, every replay called the set-returning `idempotency_keys_claim` in `FROM` (a plpgsql
/// call, an SPI query and a one-row tuplestore): 32-35 us of server execution per replay against
/// 16-18 us for the primary-key read alone (`EXPLAIN ANALYZE EXECUTE`, generic plan); this
/// statement 26-31 us.
pub(super) const CLAIM: &str = concat!(
    "SELECT false AS claimed, last_reason, ",
    cols!(""),
    ", ",
    now!(),
    " AS db_now FROM idempotency_keys WHERE ",
    replay!(),
    " UNION ALL \
     SELECT (c).* FROM (SELECT idempotency_keys_claim_write($1::text, $2::text, $3::text, \
       $4::text, $5::text, $6::text, $7::text, $8::text, $9::bigint, $10::bigint, $11::bigint, \
       $12::text) \
       AS c WHERE NOT EXISTS (SELECT 1 FROM idempotency_keys WHERE ",
    replay!(),
    ") OFFSET 0) w WHERE (c).claimed IS NOT NULL"
);

/// The claim functions' sources, for the test that checks their reason spellings.
#[cfg(test)]
pub(in crate::store) const CLAIM_FUNCTIONS: [&str; 3] = [
    include_str!("../../../migrations/postgres/20261130180001_claim_function.sql"),
    include_str!("../../../migrations/postgres/20261130200001_lean_writes.sql"),
    include_str!("../../../migrations/postgres/20261201220001_claim_provider_rule.sql"),
];

pub(super) const FINISH: &str = concat!(
    "UPDATE idempotency_keys SET state = $3::text, retryable = $4::boolean, \
       response_status = $5::integer, response_headers = $6::text, response_body = $7::bytea, \
       error = $8::text, \
       lease_token = CASE WHEN $9::bigint IS NULL THEN lease_token + 1 ELSE lease_token END, \
       lease_owner = NULL, lease_expires_at = NULL, \
       may_have_acted = CASE WHEN $4::boolean THEN false ELSE may_have_acted END, updated_at = ",
    now!(),
    ", expires_at = ",
    now!(),
    " + retention_ms * interval '1 millisecond', next_check_at = NULL, version = version + 1, \
       last_actor = $10::text, last_reason = $11::text \
     WHERE scope = $1::text AND key = $2::text \
       AND ($9::bigint IS NULL OR (state = 'processing' AND lease_token = $9::bigint)) \
       AND ($12::bigint IS NULL OR (state = 'processing' AND lease_token = $12::bigint)) \
     RETURNING ",
    cols!("")
);

pub(super) const RELEASE: &str = concat!(
    "UPDATE idempotency_keys SET lease_owner = NULL, \
       lease_expires_at = LEAST(lease_expires_at, ",
    now!(),
    "), next_check_at = CASE WHEN $4::bigint IS NULL THEN NULL ELSE ",
    now!(),
    " + $4::bigint * interval '1 millisecond' END, error = COALESCE($5::text, error), \
       updated_at = ",
    now!(),
    ", last_attempt_at = CASE WHEN $6::text = 'worker' THEN ",
    now!(),
    " ELSE last_attempt_at END, \
       may_have_acted = may_have_acted OR $6::text = 'worker', \
       version = version + 1, last_actor = $6::text, last_reason = $7::text \
     WHERE scope = $1::text AND key = $2::text AND state = 'processing' \
       AND lease_token = $3::bigint"
);

pub(super) const MARK_ATTEMPT: &str = concat!(
    "UPDATE idempotency_keys SET last_attempt_at = ",
    now!(),
    ", may_have_acted = true, updated_at = ",
    now!(),
    " WHERE scope = $1::text AND key = $2::text AND state = 'processing' \
       AND lease_token = $3::bigint"
);

pub(super) const EXTEND: &str = concat!(
    "UPDATE idempotency_keys SET lease_expires_at = ",
    now!(),
    " + $4::bigint * interval '1 millisecond' \
     WHERE scope = $1::text AND key = $2::text AND state = 'processing' \
       AND lease_token = $3::bigint AND lease_owner IS NOT NULL \
     RETURNING lease_expires_at"
);

/// The stale keys are picked through the partial index with `FOR UPDATE SKIP LOCKED`, so
/// concurrent sweepers never pick the same key, then each gets a new fencing token.
pub(super) const TAKE_STALE: &str = concat!(
    "WITH picked AS MATERIALIZED (SELECT scope, key FROM idempotency_keys \
       WHERE state = 'processing' AND lease_expires_at <= ",
    now!(),
    " AND (next_check_at IS NULL OR next_check_at <= ",
    now!(),
    ") ORDER BY lease_expires_at LIMIT $3::bigint FOR UPDATE SKIP LOCKED) \
     UPDATE idempotency_keys k SET lease_token = k.lease_token + 1, lease_owner = $1::text, \
       last_attempt_at = CASE WHEN k.lease_owner IS NULL THEN k.last_attempt_at \
         ELSE GREATEST(COALESCE(k.last_attempt_at, k.created_at), k.lease_expires_at) END, \
       may_have_acted = true, lease_expires_at = ",
    now!(),
    " + $2::bigint * interval '1 millisecond', attempts = k.attempts + 1, updated_at = ",
    now!(),
    ", version = k.version + 1, last_actor = 'sweeper', \
       last_reason = 'sweeper took over an expired lease' \
     FROM picked WHERE k.scope = picked.scope AND k.key = picked.key AND k.state = 'processing' \
     RETURNING ",
    cols!("k.")
);

pub(super) const PURGE: &str = concat!(
    "WITH picked AS MATERIALIZED (SELECT scope, key FROM idempotency_keys \
       WHERE state <> 'processing' AND expires_at <= ",
    now!(),
    " ORDER BY expires_at LIMIT $1::bigint FOR UPDATE SKIP LOCKED) \
     DELETE FROM idempotency_keys k USING picked \
     WHERE k.scope = picked.scope AND k.key = picked.key AND k.state <> 'processing'"
);

/// The statements of the reads written once in `store::sql_core`.
pub(super) const READS: ReadSql = ReadSql {
    history: concat!(
        "SELECT ",
        event_columns!(),
        " FROM idempotency_key_events WHERE scope = $1 AND key = $2 ORDER BY id"
    ),
    stats: concat!(
        "SELECT \
           count(*) FILTER (WHERE state = 'processing') AS processing, \
           count(*) FILTER (WHERE state = 'processing' AND lease_expires_at <= ",
        now!(),
        ") AS stale, \
           count(*) FILTER (WHERE state = 'done') AS done, \
           count(*) FILTER (WHERE state = 'failed' AND retryable) AS failed_retryable, \
           count(*) FILTER (WHERE state = 'failed' AND NOT retryable) AS failed_permanent, \
           min(created_at) FILTER (WHERE state = 'processing') AS oldest_processing, ",
        now!(),
        " AS db_now FROM idempotency_keys"
    ),
    // Processing keys first claimed at least `$1` ms ago.
    stuck_count: concat!(
        "SELECT count(*) FROM idempotency_keys WHERE state = 'processing' AND created_at <= ",
        now!(),
        " - $1::bigint * interval '1 millisecond'"
    ),
    // The oldest `$2` of them, oldest first.
    stuck_list: concat!(
        "SELECT ",
        cols!(""),
        " FROM idempotency_keys WHERE state = 'processing' AND created_at <= ",
        now!(),
        " - $1::bigint * interval '1 millisecond' ORDER BY created_at, scope, key LIMIT $2::bigint"
    ),
    // Finished keys `PURGE` would delete now.
    count_expired: concat!(
        "SELECT count(*) FROM idempotency_keys WHERE state <> 'processing' AND expires_at <= ",
        now!()
    ),
};
