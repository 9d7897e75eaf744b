//! The Redis store (feature `redis`): the same fenced per-key state machine as the SQL stores,
//! with every transition one Lua script.
//!
//! # Layout
//!
//! With prefix `P` (default `idemflow`) and `B` buckets (default 1), the (scope, key) pair is
//! encoded as a *member* `esc(scope) ":" esc(key)`, where `esc` writes `%`, `:`, `{` and `}` as
//! `%25`, `%3A`, `%7B` and `%7D` (scope and key are visible ASCII, so the encoding is injective
//! and the member never contains a brace). Its bucket is `b = fnv1a64(member) % B`, and it uses:
//!
//! - `P:{b}:k:<member>`: a hash with the key's row (short field names, e.g. `st` for the state
//!   and `tok` for the lease token);
//! - `P:{b}:h:<member>`: a list with the key's history, one compact entry per transition
//!   (`seq|from|from_rt|to|to_rt|token|at|#actor|actor[|reason]`), capped at
//!   [`RedisConfig::history_cap`] entries;
//!
//! and the bucket's indexes, sorted sets of members:
//!
//! - `P:{b}:due` (processing keys by `max(lease_expires_at, next_check_at)`, for the sweeper),
//!   `P:{b}:lease` (processing keys by lease expiry, for `stats.stale`), `P:{b}:created`
//!   (processing keys by creation, for `stats.oldest_processing_created_at` and `stuck`);
//! - `P:{b}:done`, `P:{b}:failed_r`, `P:{b}:failed_p` (finished keys by `expires_at`, for purge,
//!   `count_expired` and `stats`).
//!
//! All of them carry the hash tag `{b}`, so every script touches exactly one hash slot: on Redis
//! Cluster, a bucket lives on one shard, per-key scripts touch one slot, and the bucket-wide
//! operations (`take_stale`, `purge_expired`, `stats`, `stuck`, `count_expired`) run one script
//! per bucket. Use more buckets than shards (e.g. 16 per primary) so buckets spread; the number
//! must never change for a live data set (a key would be looked for in the wrong bucket). This
//! crate's client is the single-node
//! [`ConnectionManager`](redis::aio::ConnectionManager): the layout is Cluster-ready, the
//! client is not yet.
//!
//! # Clock and expiry
//!
//! Every time is Redis `TIME` read inside the script (Redis 7 replicates scripts by effects, so
//! replicas and the AOF get the computed values). A finished key's hash gets a native
//! `PEXPIREAT expires_at + expiry_grace` as a backstop; [`Store::purge_expired`](crate::Store::purge_expired)
//! deletes due keys before that in bounded batches and records each purge in history. A key that Redis expired
//! first is recorded by the next purge ("expired by Redis before purge"). The history list
//! expires [`RedisConfig::history_ttl`] after the key's `expires_at` (or after its purge), so it
//! survives the key; it never expires while the key is processing.

// One file per job: `layout` (members, buckets, key names), `decode` (replies, key hashes and
// history entries), `hint` (the known-keys hint), `config` (`RedisConfig`) and `store` (the
// `Store` impl and its script calls); `common.lua` is prepended to every `*.lua` script.
mod config;
mod decode;
mod hint;
mod layout;
mod store;

pub use config::RedisConfig;
pub use store::RedisStore;

/// The decoders, reachable for the fuzz targets and property tests (not a stable API).
#[doc(hidden)]
pub mod fuzzing {
    use std::collections::HashMap;

    use crate::error::StoreError;
    use crate::record::{KeyEvent, KeyRecord};

    /// Decodes one history list entry (`seq|from|from_rt|to|to_rt|token|at|#actor|actor[|reason]`).
    pub fn decode_history_entry(raw: &str) -> Result<KeyEvent, StoreError> {
        super::decode::event(raw)
    }

    /// Decodes a key hash given as field -> bytes.
    pub fn decode_key_hash(
        scope: &str,
        key: &str,
        fields: HashMap<String, Vec<u8>>,
    ) -> Result<KeyRecord, StoreError> {
        super::decode::record_of(scope, key, fields)
    }
}

use crate::error::StoreError;

const BACKEND: &str = "redis";

/// The format of the data written by this version; [`Store::migrate`](crate::Store::migrate)
/// records it and refuses a prefix written in another format.
pub const FORMAT_VERSION: &str = "1";

fn db(e: redis::RedisError) -> StoreError {
    StoreError::database(BACKEND, e)
}

fn corrupt(detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        backend: BACKEND,
        detail: detail.into(),
    }
}
