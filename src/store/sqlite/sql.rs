//! The SQLite statements. Times are integer milliseconds from SQLite's own clock; within one
//! statement `now` is a single instant.

use crate::store::sql_core::{HistorySql, ReadSql};

pub(super) const NOW: &str = include_str!("now.sql");

pub(super) const GET: &str = include_str!("get.sql");

/// A claim's read of the key `?1`, `?2`: the row and the database clock.
pub(super) const CLAIM_READ: &str = include_str!("claim_read.sql");

/// [`CLAIM_READ`] of the 17th and 18th arguments: the next phase's read, sent after
/// [`CLAIM_DONE`] (whose parameters are `?1` .. `?16`) in one query string (`atomic.rs`).
/// Spelled `$17`, `$18`: SQLite numbers `$NNN` parameters as names, in order (1, 2), where
/// `?17` would open sixteen unused slots, which sqlx binds as if they were plain `?`s, in
/// sequence, from where the statement before stopped, and leaves the rest unbound once that
/// sequence passes the last argument. sqlx takes a `$NNN` name as the argument's number.
pub(super) const CLAIM_READ_NEXT: &str = include_str!("claim_read_next.sql");

/// Claim a new key: `INSERT .. ON CONFLICT DO NOTHING`, with its first history entry, numbered
/// after any purged life's in the tombstone. A present key is not written (no row returned):
/// the store reads it, and runs [`RECLAIM`] when it is claimable.
///
/// Bound by `sql_core::bind_claim` (?1 scope .. ?12 the base of a re-created key's provider key).
pub(in crate::store) const CLAIM: &str = include_str!("claim.sql");

/// An atomic phase's new key, claimed and finished `done` in one insert after the application's
/// writes (`atomic.rs`): the row [`CLAIM`] writes, then [`FINISH`] by its holder, with both
/// history entries, written once. Run only by the writer, inside its `BEGIN IMMEDIATE`, after a
/// read found no row: the write lock keeps the key absent until this insert, and the primary
/// key would refuse a second row all the same (no `ON CONFLICT`).
///
/// Bound as [`CLAIM`] (`?8` the owner, `?9` the lease and `?11` unused: the key is never
/// held), then `?13` status, `?14` headers, `?15` body, `?16` the reason.
pub(super) const CLAIM_DONE: &str = include_str!("claim_done.sql");

/// Claim a present row that `kit::claimable` judged claimable when the store read it in state
/// `?13`: a reclaim of `failed{retryable}` or a takeover of an expired lease. The `WHERE` judges
/// the row as it is now (the same rule, on the writer), so no row means it changed since it was
/// read, and the store claims again. Bound as [`CLAIM`], then `?13`.
pub(in crate::store) const RECLAIM: &str = include_str!("reclaim.sql");

pub(super) const FINISH: &str = include_str!("finish.sql");

pub(super) const RELEASE: &str = include_str!("release.sql");

pub(super) const MARK_ATTEMPT: &str = include_str!("mark_attempt.sql");

pub(super) const EXTEND: &str = include_str!("extend.sql");

pub(super) const TAKE_STALE: &str = include_str!("take_stale.sql");

/// Deletes up to `?1` expired finished keys. The `idempotency_keys_archive` trigger (purge only,
/// never on a claim or a finish) moves each one's history, with a last entry for the purge, into
/// its tombstone, inside this statement.
pub(super) const PURGE: &str = include_str!("purge.sql");

/// The statements of the reads written once in `store::sql_core`.
pub(super) const READS: ReadSql = ReadSql {
    history: HistorySql::Columns(include_str!("history.sql")),
    stats: include_str!("stats.sql"),
    stuck_count: include_str!("stuck_count.sql"),
    stuck_list: include_str!("stuck_list.sql"),
    count_expired: include_str!("count_expired.sql"),
};
