//! The MariaDB / MySQL statements. Every time comes from the server's `UTC_TIMESTAMP(6)`, which
//! is one instant for the whole statement (triggers included). Durations are bound as integer
//! microseconds. No statement relies on `RETURNING` (MariaDB has none on `UPDATE`, MySQL none
//! at all).

use crate::store::sql_core::{HistorySql, ReadSql};

pub(super) const NOW: &str = include_str!("now.sql");

pub(super) const GET: &str = include_str!("get.sql");

/// The claim, one round trip: a call of the claim procedure (`procedures/claim.sql`). It reads
/// the row and returns it untouched when it is present and not claimable (a replay writes
/// nothing); otherwise a key it found absent is inserted by a plain `INSERT`, and a key that is
/// there (or was inserted since the read) goes through the `INSERT .. ON DUPLICATE KEY UPDATE`
/// that decides atomically; the row is read back.
/// The claimer won when the returned `claim_nonce` is its own nonce. No row: purged between the
/// write and the read-back. Parameters: scope, key, operation, provider, provider key,
/// fingerprint, request, owner, lease µs, retention ms, takeover window µs or NULL, nonce, the
/// base of a re-created key's provider key or NULL.
pub(super) const CLAIM: &str = include_str!("claim.sql");

/// The finish, one round trip: the fenced `UPDATE` and the read of the row it wrote, in one
/// transaction inside the finish procedure (`procedures/finish.sql`). No row: the fence refused
/// it and nothing was written. Parameters: scope, key, state, retryable, status, headers, body,
/// error, token or NULL, actor, reason, expected token or NULL.
pub(super) const FINISH: &str = include_str!("finish.sql");

/// An atomic phase's record of its step (`store::phase::AtomicPhase`): the fenced finish into `done`
/// as the finish procedure does it, as a plain statement inside the application's
/// transaction (the procedure has a transaction of its own); the update trigger writes the
/// history row. No column reads another the statement assigns, so assignment order is moot.
pub(super) const ATOMIC_DONE: &str = include_str!("atomic_done.sql");

/// The lease renewal, one round trip (`procedures/extend.sql`): the new expiry, or no row when
/// the fence refused it. Parameters: scope, key, token, lease µs.
pub(super) const EXTEND: &str = include_str!("extend.sql");

/// Parameters: recheck µs or NULL, error, actor, reason, actor, actor, scope, key, token.
pub(super) const RELEASE: &str = include_str!("release.sql");

/// Parameters: scope, key, token.
pub(super) const MARK_ATTEMPT: &str = include_str!("mark_attempt.sql");

/// Picks stale keys, locking them and skipping keys another sweeper holds.
pub(super) const PICK_STALE: &str = include_str!("pick_stale.sql");

/// Followed by `(scope, key) IN (..)`. Parameters: owner, lease µs.
pub(super) const TAKE_PICKED: &str = include_str!("take_picked.sql");

/// Followed by `(scope, key) IN (..)`.
pub(super) const READ_PICKED: &str = include_str!("read_picked.sql");

pub(super) const PICK_EXPIRED: &str = include_str!("pick_expired.sql");

/// Followed by `(scope, key) IN (..)`.
pub(super) const DELETE_PICKED: &str = include_str!("delete_picked.sql");

pub(super) const READ_COMMITTED: &str = include_str!("read_committed.sql");

/// The statements of the reads written once in `store::sql_core`.
pub(super) const READS: ReadSql = ReadSql {
    history: HistorySql::Rows(include_str!("history.sql")),
    stats: include_str!("stats.sql"),
    // Processing keys first claimed at least the given µs ago.
    stuck_count: include_str!("stuck_count.sql"),
    // The oldest of them, oldest first. Parameters: age µs, limit.
    stuck_list: include_str!("stuck_list.sql"),
    // Finished keys a purge would delete now.
    count_expired: include_str!("count_expired.sql"),
};
