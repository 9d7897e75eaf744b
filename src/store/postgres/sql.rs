//! The PostgreSQL statements. Every time comes from the server's `statement_timestamp()`, which
//! is one instant for the whole statement (triggers included) and moves on between statements
//! of one transaction. Durations are bound as integer milliseconds.

use crate::store::sql_core::{HistorySql, ReadSql};

pub(super) const NOW: &str = include_str!("now.sql");

pub(super) const GET: &str = include_str!("get.sql");

/// Claim a new key or read the row: one plain statement. `INSERT .. ON CONFLICT DO NOTHING`
/// inserts an absent key (`claimed = true`, with its first history entry, numbered after any
/// purged life's in the tombstone); a present key is not locked and not written, and the second
/// branch returns it as it is (`claimed = false`): a replay is an index probe and a primary-key
/// read, in one round trip. When that row is claimable the store runs [`RECLAIM`]. No row at all
/// means a concurrent claimer committed the key after this statement's snapshot: the store reads
/// again.
///
/// Bound by `sql_core::bind_claim` ($1 scope .. $12 the base of a re-created key's provider key).
pub(in crate::store) const CLAIM: &str = include_str!("claim.sql");

/// Claim a present row that `kit::claimable` judged claimable when the store read it in state
/// `$13`: a reclaim of `failed{retryable}` or a takeover of an expired lease. The `WHERE`
/// judges the latest committed row version under its row lock (`READ COMMITTED` re-checks
/// it), so of concurrent claimers one wins; no row: the row changed since it was read, and the
/// store claims again. Bound as [`CLAIM`], then `$13`.
pub(in crate::store) const RECLAIM: &str = include_str!("reclaim.sql");

pub(super) const FINISH: &str = include_str!("finish.sql");

pub(super) const RELEASE: &str = include_str!("release.sql");

/// Marks a processing key as waited on (`Store::announce_end`); a no-op on any other key.
pub(super) const ANNOUNCE_END: &str = include_str!("announce_end.sql");

pub(super) const MARK_ATTEMPT: &str = include_str!("mark_attempt.sql");

pub(super) const EXTEND: &str = include_str!("extend.sql");

/// The stale keys are picked through the partial index with `FOR UPDATE SKIP LOCKED`, so
/// concurrent sweepers never pick the same key, then each gets a new fencing token.
pub(super) const TAKE_STALE: &str = include_str!("take_stale.sql");

/// Deletes up to `$1` expired finished keys, and moves each one's history, with a last entry for
/// the purge, into its tombstone (created, or appended to when the key had an earlier life).
pub(super) const PURGE: &str = include_str!("purge.sql");

/// The statements of the reads written once in `store::sql_core`.
pub(super) const READS: ReadSql = ReadSql {
    history: HistorySql::Columns(include_str!("history.sql")),
    stats: include_str!("stats.sql"),
    // Processing keys first claimed at least `$1` ms ago.
    stuck_count: include_str!("stuck_count.sql"),
    // The oldest `$2` of them, oldest first.
    stuck_list: include_str!("stuck_list.sql"),
    // Finished keys `PURGE` would delete now.
    count_expired: include_str!("count_expired.sql"),
};
