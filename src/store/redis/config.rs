//! [`RedisConfig`]: the options of [`RedisStore::connect_with`](super::RedisStore::connect_with).

use std::time::Duration;

use crate::setters::setters;

/// Options for [`RedisStore::connect_with`](super::RedisStore::connect_with).
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// `redis://host:port/db` (or `rediss://` when the crate's TLS features are enabled). With
    /// [`cluster`](Self::cluster()): one or more seed nodes of the cluster, separated by commas
    /// (`redis://10.0.0.1:7000/,redis://10.0.0.2:7000/`); the client learns the rest.
    pub url: String,
    /// Connect to a Redis Cluster (default `false`: one server). Every key of a bucket carries
    /// the bucket's hash tag, so each script runs on the shard of its bucket's slot; give the
    /// store several buckets per primary ([`buckets`](Self::buckets)) so that the buckets, and
    /// the load, spread over the shards.
    pub cluster: bool,
    /// Prefix of every Redis key this store writes (default `idemflow`). Visible ASCII without
    /// `{` or `}`. Stores with different prefixes never see each other's keys.
    pub prefix: String,
    /// Number of hash-tag buckets (default 1). On Redis Cluster use several per primary. Never
    /// change it for a live data set.
    pub buckets: u32,
    /// History entries kept per key (default 100; the oldest are trimmed; 0: unlimited).
    pub history_cap: u32,
    /// How long a key's history outlives its purge (default 7 days): the purge leaves the
    /// history behind, and Redis deletes it this long after.
    pub history_ttl: Duration,
    /// Redis deletes a finished key (with its history) this long after its `expires_at` if
    /// [`SweeperStore::purge_expired`](crate::store::SweeperStore::purge_expired) has not (default 1 hour; `None`:
    /// never, purge only). The next purge records that Redis expired it, in a new history.
    pub expiry_grace: Option<Duration>,
    /// Timeout of one command (default 5 s).
    pub response_timeout: Duration,
    /// Slots of the per-store hint of keys known to exist (default 65,536, 8 bytes each; 0: no
    /// hint). A claim of a key the hint knows (this store claimed, finished or found it) first
    /// reads it without a script (`MULTI TIME GET EXEC`, one round trip) and runs the claim
    /// script only if it is missing or claimable; any other claim runs the script at once. So a
    /// replay costs one round trip either way (without Lua when known), and claim + finish on a
    /// fresh key stays at two. The hint is never trusted for a decision: a wrong one costs one
    /// extra round trip.
    pub known_keys: usize,
    /// Timeout of one connection attempt (default 2 s).
    pub connection_timeout: Duration,
}

impl RedisConfig {
    /// The defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            cluster: false,
            prefix: "idemflow".into(),
            buckets: 1,
            history_cap: 100,
            history_ttl: Duration::from_secs(7 * 24 * 3600),
            expiry_grace: Some(Duration::from_secs(3600)),
            response_timeout: Duration::from_secs(5),
            known_keys: 1 << 16,
            connection_timeout: Duration::from_secs(2),
        }
    }

    /// With `true`, connects to a Redis Cluster: `url` lists seed nodes, separated by commas
    /// (see the field of the same name).
    pub fn cluster(mut self, cluster: bool) -> Self {
        self.cluster = cluster;
        self
    }

    /// Sets the key prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the number of buckets (at least 1).
    pub fn buckets(mut self, buckets: u32) -> Self {
        self.buckets = buckets.max(1);
        self
    }

    setters! {
        /// Sets the history cap per key (0: unlimited).
        history_cap(history_cap: u32);

        /// Sets how long history outlives a key's `expires_at`.
        history_ttl(history_ttl: Duration);

        /// Sets the native-expiry backstop (`None`: keys are deleted by purge only).
        expiry_grace(expiry_grace: Option<Duration>);

        /// Sets the number of slots of the known-keys hint (0: no hint, every claim runs the
        /// claim script).
        known_keys(known_keys: usize);

        /// Sets the command timeout.
        response_timeout(response_timeout: Duration);
    }
}
