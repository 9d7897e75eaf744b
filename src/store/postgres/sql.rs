//! The PostgreSQL statements. Every time comes from the server's `statement_timestamp()`, which
//! is one instant for the whole statement (triggers included) and moves on between statements
//! of one transaction. Durations are bound as integer milliseconds.

macro_rules! now {
    () => {
        "statement_timestamp()"
    };
}

use crate::store::rows::key_columns;
use crate::store::sql_core::{HistorySql, ReadSql};

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

/// The server's clock in ms since the epoch, for history entries.
macro_rules! now_ms {
    () => {
        "floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint"
    };
}

/// A new row's first lease token: the clock in microseconds since the epoch, so tokens only
/// grow across purge.
macro_rules! now_us {
    () => {
        "(extract(epoch FROM statement_timestamp()) * 1000000)::bigint"
    };
}

/// A boolean expression as a history entry's `0` / `1`.
macro_rules! flag {
    ($b:expr) => {
        concat!("CASE WHEN ", $b, " THEN '1' ELSE '0' END")
    };
}

/// One history entry (`rows::decode_history_entry`) as an expression over SQL fragments: seq,
/// from state, from retryable (`0`/`1` text), to state, to retryable, token, actor, reason
/// (`NULL` fields are written empty by `concat`). The reason is cut to 512 characters, then its
/// `\` and line feeds are escaped, so an entry never holds a line feed.
macro_rules! entry {
    ($seq:expr, $from:expr, $from_rt:expr, $to:expr, $to_rt:expr, $tok:expr,
     $actor:expr, $reason:expr) => {
        concat!(
            "concat(",
            $seq,
            ", '|', ",
            $from,
            ", '|', ",
            $from_rt,
            ", '|', ",
            $to,
            ", '|', ",
            $to_rt,
            ", '|', ",
            $tok,
            ", '|', ",
            now_ms!(),
            ", '|', length(",
            $actor,
            "), '|', ",
            $actor,
            ", '|' || replace(replace(left(",
            $reason,
            ", 512), '\\', '\\\\'), E'\\n', '\\n'))"
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
            " ELSE substr(right(",
            $history,
            ", 14336), strpos(right(",
            $history,
            ", 14336), E'\\n') + 1) END || E'\\n' || ",
            $entry
        )
    };
}

/// The claimable rule on `k` (parameters: `$4` provider, `$6` fingerprint, `$11` takeover window
/// in ms or NULL): the SQL twin of `store::kit::claimable`, which the store asks first.
macro_rules! claimable {
    () => {
        concat!(
            "COALESCE(k.fingerprint = $6::text AND ((k.state = 'failed' AND k.retryable \
                 AND (k.provider IS NOT DISTINCT FROM $4::text OR NOT k.may_have_acted)) \
               OR ($11::bigint IS NOT NULL AND k.state = 'processing' \
                 AND k.provider IS NOT DISTINCT FROM $4::text AND k.lease_expires_at <= ",
            now!(),
            " AND k.created_at > ",
            now!(),
            " - $11::bigint * interval '1 millisecond')), false)"
        )
    };
}

/// The digits `provider_key::renewed` appends to a renewed key's base: the life number (the
/// position of the claim's event in the key's history) modulo 2^32 as 8 lowercase hex digits.
macro_rules! renewed {
    ($life:expr) => {
        concat!("lpad(to_hex((", $life, ")::bigint & 4294967295), 8, '0')")
    };
}

/// Claim a new key or read the row: one plain statement. `INSERT .. ON CONFLICT DO NOTHING`
/// inserts an absent key (`claimed = true`, with its first history entry, numbered after any
/// purged life's in the tombstone); a present key is not locked and not written, and the second
/// branch returns it as it is (`claimed = false`): a replay is an index probe and a primary-key
/// read, in one round trip. When that row is claimable the store runs [`RECLAIM`]. No row at all
/// means a concurrent claimer committed the key after this statement's snapshot: the store reads
/// again.
///
/// Bound by `sql_core::bind_claim` ($1 scope .. $12 the base of a re-created key's provider key).
pub(in crate::store) const CLAIM: &str = concat!(
    "WITH ins AS (INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, \
       state, retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at, \
       attempts, created_at, updated_at, retention_ms, version, history, last_attempt_at, \
       may_have_acted) \
     SELECT $1::text, $2::text, $3::text, $4::text, \
       CASE WHEN $12::text IS NOT NULL AND s.seq > 1 THEN $12::text || ",
    renewed!("s.seq"),
    " ELSE $5::text END, \
       'processing', false, $6::text, $7::text, ",
    now_us!(),
    ", $8::text, ",
    now!(),
    " + $9::bigint * interval '1 millisecond', 1, ",
    now!(),
    ", ",
    now!(),
    ", $10::bigint, s.seq, ",
    entry!(
        "s.seq",
        "NULL",
        "NULL",
        "'processing'",
        "'0'",
        now_us!(),
        "'worker'",
        "'claimed'"
    ),
    ", ",
    now!(),
    ", false FROM (SELECT COALESCE((SELECT last_seq FROM idempotency_key_tombstones \
       WHERE scope = $1::text AND key = $2::text), 0) + 1 AS seq) s \
     ON CONFLICT (scope, key) DO NOTHING RETURNING ",
    cols!(""),
    ") SELECT true AS claimed, 'claimed'::text AS last_reason, ",
    cols!("ins."),
    ", ",
    now!(),
    " AS db_now FROM ins \
     UNION ALL SELECT false, NULL::text, ",
    cols!(""),
    ", ",
    now!(),
    " FROM idempotency_keys WHERE scope = $1::text AND key = $2::text"
);

/// The reason a reclaim records (`$13`: the state the store read).
macro_rules! reclaim_reason {
    () => {
        "CASE WHEN $13::text = 'failed' THEN 'reclaimed after a retryable failure' \
         ELSE 'retry took over an expired lease' END"
    };
}

/// Claim a present row that `kit::claimable` judged claimable when the store read it in state
/// `$13`: a reclaim of `failed{retryable}` or a takeover of an expired lease. The `WHERE`
/// judges the latest committed row version under its row lock (`READ COMMITTED` re-checks
/// it), so of concurrent claimers one wins; no row: the row changed since it was read, and the
/// store claims again. Bound as [`CLAIM`], then `$13`.
pub(in crate::store) const RECLAIM: &str = concat!(
    "UPDATE idempotency_keys AS k SET state = 'processing', retryable = false, \
       request = COALESCE($7::text, k.request), \
       provider_key = CASE WHEN k.state = 'failed' AND k.provider IS DISTINCT FROM $4::text \
         THEN (CASE WHEN $12::text IS NULL THEN $5::text \
           WHEN length(k.provider_key) <= length($5::text) THEN k.provider_key \
           ELSE $12::text || ",
    renewed!("k.version + 1"),
    " END) \
         ELSE k.provider_key END, \
       provider = CASE WHEN k.state = 'failed' THEN $4::text ELSE k.provider END, \
       lease_token = k.lease_token + 1, lease_owner = $8::text, lease_expires_at = ",
    now!(),
    " + $9::bigint * interval '1 millisecond', attempts = k.attempts + 1, updated_at = ",
    now!(),
    ", expires_at = NULL, next_check_at = NULL, error = NULL, response_status = NULL, \
       response_headers = NULL, response_body = NULL, retention_ms = $10::bigint, \
       version = k.version + 1, last_attempt_at = ",
    now!(),
    ", may_have_acted = CASE WHEN k.state = 'failed' THEN k.may_have_acted ELSE true END, \
       history = ",
    append!(
        "k.history",
        entry!(
            "k.version + 1",
            "k.state",
            flag!("k.retryable"),
            "'processing'",
            "'0'",
            "k.lease_token + 1",
            "'worker'",
            reclaim_reason!()
        )
    ),
    " WHERE k.scope = $1::text AND k.key = $2::text AND k.state = $13::text AND ",
    claimable!(),
    " RETURNING ",
    reclaim_reason!(),
    " AS last_reason, ",
    cols!("k.")
);

/// The new token of a finish (`$9`: the holder's token, or NULL for an override).
macro_rules! finish_token {
    () => {
        "CASE WHEN $9::bigint IS NULL THEN lease_token + 1 ELSE lease_token END"
    };
}

pub(super) const FINISH: &str = concat!(
    "UPDATE idempotency_keys SET state = $3::text, retryable = $4::boolean, \
       response_status = $5::integer, response_headers = $6::text, response_body = $7::bytea, \
       error = $8::text, lease_token = ",
    finish_token!(),
    ", lease_owner = NULL, lease_expires_at = NULL, \
       may_have_acted = CASE WHEN $4::boolean THEN false ELSE may_have_acted END, updated_at = ",
    now!(),
    ", expires_at = ",
    now!(),
    " + retention_ms * interval '1 millisecond', next_check_at = NULL, version = version + 1, \
       history = ",
    append!(
        "history",
        entry!(
            "version + 1",
            "state",
            flag!("retryable"),
            "$3::text",
            flag!("$4::boolean"),
            finish_token!(),
            "$10::text",
            "$11::text"
        )
    ),
    " WHERE scope = $1::text AND key = $2::text \
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
       version = version + 1, history = ",
    append!(
        "history",
        entry!(
            "version + 1",
            "state",
            flag!("retryable"),
            "state",
            flag!("retryable"),
            "lease_token",
            "$6::text",
            "$7::text"
        )
    ),
    " WHERE scope = $1::text AND key = $2::text AND state = 'processing' \
       AND lease_token = $3::bigint"
);

/// Marks a processing key as waited on (`Store::announce_end`); a no-op on any other key.
pub(super) const ANNOUNCE_END: &str = "UPDATE idempotency_keys SET waiters = true \
     WHERE scope = $1::text AND key = $2::text AND state = 'processing' AND NOT waiters";

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
    ") AND ($4::text IS NULL OR scope = $4::text) \
       ORDER BY lease_expires_at LIMIT $3::bigint FOR UPDATE SKIP LOCKED) \
     UPDATE idempotency_keys k SET lease_token = k.lease_token + 1, lease_owner = $1::text, \
       last_attempt_at = CASE WHEN k.lease_owner IS NULL THEN k.last_attempt_at \
         ELSE GREATEST(COALESCE(k.last_attempt_at, k.created_at), k.lease_expires_at) END, \
       may_have_acted = true, lease_expires_at = ",
    now!(),
    " + $2::bigint * interval '1 millisecond', attempts = k.attempts + 1, updated_at = ",
    now!(),
    ", version = k.version + 1, history = ",
    append!(
        "k.history",
        entry!(
            "k.version + 1",
            "k.state",
            flag!("k.retryable"),
            "k.state",
            flag!("k.retryable"),
            "k.lease_token + 1",
            "'sweeper'",
            "'sweeper took over an expired lease'"
        )
    ),
    " FROM picked WHERE k.scope = picked.scope AND k.key = picked.key AND k.state = 'processing' \
     RETURNING ",
    cols!("k.")
);

/// Deletes up to `$1` expired finished keys, and moves each one's history, with a last entry for
/// the purge, into its tombstone (created, or appended to when the key had an earlier life).
pub(super) const PURGE: &str = concat!(
    "WITH picked AS MATERIALIZED (SELECT scope, key FROM idempotency_keys \
       WHERE state <> 'processing' AND expires_at <= ",
    now!(),
    " ORDER BY expires_at LIMIT $1::bigint FOR UPDATE SKIP LOCKED), \
     gone AS (DELETE FROM idempotency_keys k USING picked \
       WHERE k.scope = picked.scope AND k.key = picked.key AND k.state <> 'processing' \
       RETURNING k.scope, k.key, k.version + 1 AS seq, k.history || E'\\n' || ",
    entry!(
        "k.version + 1",
        "k.state",
        flag!("k.retryable"),
        "NULL",
        "NULL",
        "k.lease_token",
        "'purge'",
        "'retention expired'"
    ),
    " AS history) \
     INSERT INTO idempotency_key_tombstones AS t (scope, key, last_seq, history) \
     SELECT scope, key, seq, history FROM gone \
     ON CONFLICT (scope, key) DO UPDATE SET last_seq = excluded.last_seq, history = ",
    append!("t.history", "excluded.history")
);

/// The statements of the reads written once in `store::sql_core`.
pub(super) const READS: ReadSql = ReadSql {
    history: HistorySql::Columns(
        "SELECT (SELECT history FROM idempotency_key_tombstones \
           WHERE scope = $1 AND key = $2) AS archived, \
         (SELECT history FROM idempotency_keys WHERE scope = $1 AND key = $2) AS live",
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
