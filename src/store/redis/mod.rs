//! The Redis store (feature `redis`): the same fenced per-key state machine as the SQL stores,
//! with every transition one Lua script.
//!
//! # Layout
//!
//! With prefix `P` (default `idemflow`) and `B` buckets (default 1), the (scope, key) pair is
//! encoded as a *member* `esc(scope) ":" esc(key)`, where `esc` writes `%`, `:`, `{` and `}` as
//! `%25`, `%3A`, `%7B` and `%7D` (scope and key are visible ASCII, so the encoding is injective
//! and the member never contains a brace). Its bucket is `b = fnv1a64(member) % B`, and it uses
//! two Redis keys:
//!
//! - `P:{b}:k:<member>`: a string, the key's **record**: one MessagePack array (written by
//!   Redis's built-in `cmsgpack`) holding the row at fixed positions and, in the same value, the
//!   key's history, one compact text entry per transition
//!   (`seq|from|from_rt|to|to_rt|token|at|#actor|actor[|reason]`), capped at
//!   [`RedisConfig::history_cap`] entries. One key per idempotency key keeps memory low (no
//!   per-field overhead) and a claim or finish to one `GET` and one `SET`;
//! - `P:{b}:idx`: the bucket's **index**, one sorted set with one entry per key whose score
//!   carries the key's state in its band: processing keys at `max(lease_expires_at,
//!   next_check_at) - 2^50` (negative; the sweeper's range), done keys at `expires_at`,
//!   `failed{retryable}` at `expires_at + 2^50`, `failed{permanent}` at `expires_at + 2^51`
//!   (purge, `count_expired` and the per-state counts of `stats` are score ranges). A
//!   transition moves the entry with one `ZADD`.
//!
//! So a claim of a new key runs 4 commands (`TIME GET SET ZADD`) and a finish 4 (`GET TIME
//! SET ZADD`, the `SET` with its native expiry). `stats` (stale keys, oldest processing key)
//! and `stuck` read the processing keys themselves, page by page: they are the in-flight ones.
//!
//! Both keys carry the hash tag `{b}`, so every script touches exactly one hash slot: on Redis
//! Cluster ([`RedisConfig::cluster()`]), a bucket lives on one shard, per-key scripts run on the
//! shard of their bucket, and the bucket-wide operations (`take_stale`, `purge_expired`,
//! `stats`, `stuck`, `count_expired`) run one script per bucket, each routed to the bucket's
//! shard. Use more buckets than shards (e.g. 16 per primary) so buckets spread; the number must
//! never change for a live data set (a key would be looked for in the wrong bucket).
//!
//! # Clock and expiry
//!
//! Every time is Redis `TIME` read inside the script (Redis 7 replicates scripts by effects, so
//! replicas and the AOF get the computed values; on a cluster, each shard's clock decides the
//! leases of its buckets). A finished key's record gets a native `PXAT expires_at +
//! expiry_grace` as a backstop; [`SweeperStore::purge_expired`](crate::store::SweeperStore::purge_expired) deletes
//! due keys before that in bounded batches and records each purge in history: the record is
//! replaced by a tombstone holding only the history and the last token, which expires
//! [`RedisConfig::history_ttl`] after the purge (a new claim of the key continues its history
//! and its tokens). A key that Redis expired first took its history with it; the next purge
//! records the expiry ("expired by Redis before purge") in a new history.

// One file per job: `layout` (members, buckets, key names), `decode` (replies, key hashes and
// history entries), `config` (`RedisConfig`) and `store` (the
// `Store` impl and its script calls); `common.lua` is prepended to every `*.lua` script.
mod config;
mod decode;
mod layout;
mod sentinel;
mod store;

pub use config::{
    DEFAULT_SENTINEL_PORT, RedisConfig, SENTINEL_SCHEME, SentinelConfig, WaitReplicas,
};
pub use sentinel::SentinelConnection;
pub use store::{RedisConnection, RedisStore};

/// The decoders, reachable for the fuzz targets and property tests (not a stable API).
#[doc(hidden)]
pub mod fuzzing {
    use crate::error::StoreError;
    use crate::record::{KeyEvent, KeyRecord};

    /// Decodes one history list entry (`seq|from|from_rt|to|to_rt|token|at|#actor|actor[|reason]`).
    pub fn decode_history_entry(raw: &str) -> Result<KeyEvent, StoreError> {
        super::decode::event(raw)
    }

    /// Decodes a stored record (a MessagePack array; `None`: a purged key's tombstone).
    pub fn decode_record(
        scope: &str,
        key: &str,
        raw: &[u8],
    ) -> Result<Option<KeyRecord>, StoreError> {
        super::decode::record_of(scope, key, raw)
    }

    /// Decodes the history stored in a record or tombstone.
    pub fn decode_history(raw: &[u8]) -> Result<Vec<KeyEvent>, StoreError> {
        super::decode::history_of(raw)
    }
}

use crate::error::StoreError;

const BACKEND: &str = "redis";

/// The format of the data written by this version; [`Store::migrate`](crate::Store::migrate)
/// records it and refuses a prefix written in another format.
pub const FORMAT_VERSION: &str = "2";

fn db(e: redis::RedisError) -> StoreError {
    StoreError::database(BACKEND, e)
}

fn corrupt(detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        backend: BACKEND,
        detail: detail.into(),
    }
}
