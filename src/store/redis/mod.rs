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
//! - `P:{b}:k:<member>`: a hash with the key's row (short field names, see `FIELDS` below);
//! - `P:{b}:h:<member>`: a list with the key's history, one compact entry per transition
//!   (`seq|from|from_rt|to|to_rt|token|at|#actor|actor[|reason]`; entries written as JSON by
//!   earlier versions are still read), capped at [`RedisConfig::history_cap`] entries;
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
//! crate's client is the single-node [`ConnectionManager`]: the layout is Cluster-ready, the
//! client is not yet.
//!
//! # Clock and expiry
//!
//! Every time is Redis `TIME` read inside the script (Redis 7 replicates scripts by effects, so
//! replicas and the AOF get the computed values). A finished key's hash gets a native
//! `PEXPIREAT expires_at + expiry_grace` as a backstop; [`Store::purge_expired`] deletes due keys
//! before that in bounded batches and records each purge in history. A key that Redis expired
//! first is recorded by the next purge ("expired by Redis before purge"). The history list
//! expires [`RedisConfig::history_ttl`] after the key's `expires_at` (or after its purge), so it
//! survives the key; it never expires while the key is processing.

use std::collections::HashMap;
use std::fmt;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};
use tracing::instrument;

use super::rows::ms_to_time;
use super::{
    ClaimOutcome, Finish, Lease, NewClaim, RawEvent, RawRecord, Release, Stats, Store, Stuck,
    TakeStale, check_finish, claimable, millis,
};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::{KeyEvent, KeyRecord, LeaseToken};
use crate::state::{KeyState, Transition};

const BACKEND: &str = "redis";

/// The format of the data written by this version; [`Store::migrate`] records it and refuses a
/// prefix written in another format.
pub const FORMAT_VERSION: &str = "1";

/// Durations are capped at about 100 years (in ms) so `now + d` stays exact in Lua's doubles.
const MAX_MS: i64 = 100 * 366 * 24 * 3600 * 1000;

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(include_str!("common.lua"), include_str!($file)))
    };
}

struct Scripts {
    claim: Script,
    finish: Script,
    release: Script,
    extend: Script,
    take_stale: Script,
    purge: Script,
    stats: Script,
    stuck: Script,
    count_expired: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: script!("claim.lua"),
    finish: script!("finish.lua"),
    release: script!("release.lua"),
    extend: script!("extend.lua"),
    take_stale: script!("take_stale.lua"),
    purge: script!("purge.lua"),
    stats: script!("stats.lua"),
    stuck: script!("stuck.lua"),
    count_expired: script!("count_expired.lua"),
});

fn db(e: redis::RedisError) -> StoreError {
    StoreError::database(BACKEND, e)
}

fn corrupt(detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        backend: BACKEND,
        detail: detail.into(),
    }
}

/// Options for [`RedisStore::connect_with`].
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// `redis://host:port/db` (or `rediss://` when the crate's TLS features are enabled).
    pub url: String,
    /// Prefix of every Redis key this store writes (default `idemflow`). Visible ASCII without
    /// `{` or `}`. Stores with different prefixes never see each other's keys.
    pub prefix: String,
    /// Number of hash-tag buckets (default 1). On Redis Cluster use several per primary. Never
    /// change it for a live data set.
    pub buckets: u32,
    /// History entries kept per key (default 100; the oldest are trimmed; 0: unlimited).
    pub history_cap: u32,
    /// How long a key's history outlives its `expires_at` (default 7 days).
    pub history_ttl: Duration,
    /// Redis deletes a finished key's hash this long after its `expires_at` if
    /// [`Store::purge_expired`] has not (default 1 hour; `None`: never, purge only).
    pub expiry_grace: Option<Duration>,
    /// Timeout of one command (default 5 s).
    pub response_timeout: Duration,
    /// Slots of the per-store hint of keys known to exist (default 65,536, 8 bytes each; 0: no
    /// hint). A claim of a key the hint knows (this store claimed, finished or found it) first
    /// reads it without a script (`MULTI TIME HGETALL EXEC`, one round trip) and runs the claim
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

    /// Sets the history cap per key (0: unlimited).
    pub fn history_cap(mut self, cap: u32) -> Self {
        self.history_cap = cap;
        self
    }

    /// Sets how long history outlives a key's `expires_at`.
    pub fn history_ttl(mut self, ttl: Duration) -> Self {
        self.history_ttl = ttl;
        self
    }

    /// Sets the native-expiry backstop (`None`: keys are deleted by purge only).
    pub fn expiry_grace(mut self, grace: Option<Duration>) -> Self {
        self.expiry_grace = grace;
        self
    }

    /// Sets the number of slots of the known-keys hint (0: no hint, every claim runs the
    /// claim script).
    pub fn known_keys(mut self, slots: usize) -> Self {
        self.known_keys = slots;
        self
    }

    /// Sets the command timeout.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }
}

/// A [`Store`] on Redis (feature `redis`).
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemflow::StoreError> {
/// use idemflow::{Store, store::redis::RedisStore};
/// let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
/// store.migrate().await?;
/// assert_eq!(store.backend(), "redis");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    con: ConnectionManager,
    prefix: String,
    buckets: u32,
    /// The five common script arguments (history cap, history TTL, grace).
    cap: i64,
    history_ttl: i64,
    grace: i64,
    /// Keys known to exist, as a direct-mapped table of member hashes (see
    /// [`RedisConfig::known_keys`]).
    known: std::sync::Arc<[AtomicU64]>,
    /// Where the next bucket-wide operation starts, so no bucket starves.
    cursor: std::sync::Arc<AtomicU32>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("buckets", &self.buckets)
            .finish_non_exhaustive()
    }
}

/// The escaped `scope:key` member of an id.
fn member(id: &KeyId) -> String {
    let mut out = String::with_capacity(id.scope.as_str().len() + id.key.as_str().len() + 8);
    escape(id.scope.as_str(), &mut out);
    out.push(':');
    escape(id.key.as_str(), &mut out);
    out
}

fn escape(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            ':' => out.push_str("%3A"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
}

fn unescape(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut it = s.split('%');
    out.push_str(it.next()?);
    for part in it {
        let (code, rest) = (part.get(..2)?, part.get(2..)?);
        out.push(match code {
            "25" => '%',
            "3A" => ':',
            "7B" => '{',
            "7D" => '}',
            _ => return None,
        });
        out.push_str(rest);
    }
    Some(out)
}

/// Splits a member back into (scope, key).
fn unmember(m: &str) -> Option<(String, String)> {
    let (s, k) = m.split_once(':')?;
    Some((unescape(s)?, unescape(k)?))
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// `'0'` for an absent optional argument, `'1' + value` for a present one.
fn opt(v: Option<&[u8]>) -> Vec<u8> {
    match v {
        None => b"0".to_vec(),
        Some(v) => {
            let mut out = Vec::with_capacity(v.len() + 1);
            out.push(b'1');
            out.extend_from_slice(v);
            out
        }
    }
}

fn ms(d: Duration) -> i64 {
    millis(d).min(MAX_MS)
}

fn validate_prefix(prefix: &str) -> Result<(), StoreError> {
    if prefix.is_empty()
        || !prefix.bytes().all(|b| b.is_ascii_graphic())
        || prefix.contains(['{', '}'])
    {
        return Err(StoreError::Config(format!(
            "bad Redis key prefix {prefix:?}: visible ASCII without braces, not empty"
        )));
    }
    Ok(())
}

struct Keys {
    hash: String,
    hist: String,
    idx: [String; 6],
}

impl RedisStore {
    /// Connects to `url` with the default prefix `idemflow` and the defaults of [`RedisConfig`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(RedisConfig::new(url)).await
    }

    /// Connects to `url` with the key prefix `prefix`.
    pub async fn connect_with_prefix(url: &str, prefix: &str) -> Result<Self, StoreError> {
        Self::connect_with(RedisConfig::new(url).prefix(prefix)).await
    }

    /// Connects with explicit options. The connection manager reconnects on its own; a command
    /// that failed with the connection is not retried (a script may or may not have run).
    pub async fn connect_with(config: RedisConfig) -> Result<Self, StoreError> {
        validate_prefix(&config.prefix)?;
        let client = redis::Client::open(config.url.as_str())
            .map_err(|e| StoreError::Config(format!("bad Redis URL: {e}")))?;
        let cm = ConnectionManagerConfig::new()
            .set_response_timeout(Some(config.response_timeout))
            .set_connection_timeout(Some(config.connection_timeout))
            .set_number_of_retries(2);
        let con = ConnectionManager::new_with_config(client, cm)
            .await
            .map_err(db)?;
        Ok(Self::from_manager(con, config))
    }

    /// Uses a connection manager you built; the URL in `config` is ignored.
    pub fn from_manager(con: ConnectionManager, config: RedisConfig) -> Self {
        Self {
            con,
            prefix: config.prefix,
            buckets: config.buckets.max(1),
            cap: i64::from(config.history_cap),
            history_ttl: ms(config.history_ttl),
            grace: config.expiry_grace.map_or(-1, ms),
            known: (0..config.known_keys).map(|_| AtomicU64::new(0)).collect(),
            cursor: std::sync::Arc::new(AtomicU32::new(0)),
        }
    }

    /// The connection manager (for tests and tools that need raw access).
    pub fn connection(&self) -> ConnectionManager {
        self.con.clone()
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key of the hash holding `id`'s row (for inspection, e.g. `MEMORY USAGE`).
    pub fn record_key(&self, id: &KeyId) -> String {
        self.keys(&member(id)).hash
    }

    /// The Redis key of the list holding `id`'s history.
    pub fn history_key(&self, id: &KeyId) -> String {
        self.keys(&member(id)).hist
    }

    fn bucket_of(&self, member: &str) -> u32 {
        // The remainder is below `buckets`, a u32.
        (fnv1a(member) % u64::from(self.buckets)) as u32
    }

    fn tag(&self, bucket: u32) -> String {
        format!("{}:{{{bucket}}}", self.prefix)
    }

    fn bucket_indexes(&self, bucket: u32) -> [String; 6] {
        let t = self.tag(bucket);
        ["due", "lease", "created", "done", "failed_r", "failed_p"].map(|n| format!("{t}:{n}"))
    }

    fn keys(&self, member: &str) -> Keys {
        let b = self.bucket_of(member);
        let t = self.tag(b);
        Keys {
            hash: format!("{t}:k:{member}"),
            hist: format!("{t}:h:{member}"),
            idx: self.bucket_indexes(b),
        }
    }

    /// A per-key script invocation with KEYS and the common ARGV filled in.
    fn per_key<'a>(&self, script: &'a Script, k: &Keys) -> redis::ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        inv.key(&k.hash).key(&k.hist);
        for i in &k.idx {
            inv.key(i);
        }
        inv.arg(self.cap)
            .arg(self.history_ttl)
            .arg(self.grace)
            .arg("")
            .arg("");
        inv
    }

    /// A bucket-wide script invocation.
    fn per_bucket<'a>(&self, script: &'a Script, bucket: u32) -> redis::ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        for i in self.bucket_indexes(bucket) {
            inv.key(i);
        }
        let t = self.tag(bucket);
        inv.arg(self.cap)
            .arg(self.history_ttl)
            .arg(self.grace)
            .arg(format!("{t}:k:"))
            .arg(format!("{t}:h:"));
        inv
    }

    /// Buckets in the order a bucket-wide operation should visit them.
    fn bucket_order(&self) -> impl Iterator<Item = u32> + use<> {
        let n = self.buckets;
        let start = self.cursor.fetch_add(1, Ordering::Relaxed) % n;
        (0..n).map(move |i| (start + i) % n)
    }

    async fn invoke(&self, inv: &redis::ScriptInvocation<'_>) -> Result<Value, StoreError> {
        let mut con = self.con.clone();
        inv.invoke_async(&mut con).await.map_err(db)
    }

    async fn hgetall(&self, key: &str) -> Result<Value, StoreError> {
        let mut con = self.con.clone();
        redis::cmd("HGETALL")
            .arg(key)
            .query_async(&mut con)
            .await
            .map_err(db)
    }

    /// The hint slot of a member and the value it holds when the member is known (never 0).
    fn known_slot(&self, member: &str) -> Option<(&AtomicU64, u64)> {
        if self.known.is_empty() {
            return None;
        }
        let h = fnv1a(member).max(1);
        // FNV-1a's low bits depend only on the low bits of the state: index by the high bits
        // of a multiplicative mix instead. The remainder is below `known.len()`, a usize.
        let mixed = h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let slot = &self.known[(mixed % self.known.len() as u64) as usize];
        Some((slot, h))
    }

    fn is_known(&self, member: &str) -> bool {
        self.known_slot(member)
            .is_some_and(|(slot, h)| slot.load(Ordering::Relaxed) == h)
    }

    fn set_known(&self, member: &str) {
        if let Some((slot, h)) = self.known_slot(member) {
            slot.store(h, Ordering::Relaxed);
        }
    }

    /// The key's row and the Redis clock, read atomically (`MULTI TIME HGETALL EXEC`: one round
    /// trip, no script).
    async fn snapshot(
        &self,
        id: &KeyId,
        hash: &str,
    ) -> Result<(Option<KeyRecord>, DateTime<Utc>), StoreError> {
        let mut con = self.con.clone();
        let (time, row): (Vec<i64>, Value) = redis::pipe()
            .atomic()
            .cmd("TIME")
            .cmd("HGETALL")
            .arg(hash)
            .query_async(&mut con)
            .await
            .map_err(db)?;
        let [sec, usec] = time[..] else {
            return Err(corrupt("TIME reply"));
        };
        let now = ms_to_time(BACKEND, sec * 1000 + usec / 1000)?;
        let fields = fields(row)?;
        if fields.is_empty() {
            return Ok((None, now));
        }
        let r = record(id.scope.as_str(), id.key.as_str(), fields)?;
        Ok((Some(r), now))
    }

    async fn current(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        let v = self.hgetall(&self.keys(&member(id)).hash).await?;
        let fields = fields(v)?;
        if fields.is_empty() {
            return Ok(None);
        }
        record(id.scope.as_str(), id.key.as_str(), fields).map(Some)
    }

    /// Turns a `{'notfound'}` / `{'lost', tok, st, rt}` reply into the error.
    fn refusal(id: &KeyId, presented: Option<LeaseToken>, reply: &[Value]) -> StoreError {
        match (text(reply.first()).as_deref(), presented) {
            (Some("lost"), Some(presented)) => {
                let current = int(reply.get(1)).unwrap_or(0);
                let st = text(reply.get(2)).unwrap_or_default();
                let rt = text(reply.get(3)).as_deref() == Some("1");
                match KeyState::from_columns(&st, rt) {
                    Ok(state) => StoreError::LeaseLost {
                        key: id.to_string(),
                        presented,
                        current: LeaseToken(current),
                        state,
                    },
                    Err(e) => corrupt(e.to_string()),
                }
            }
            (Some("notfound"), _) => StoreError::NotFound {
                key: id.to_string(),
            },
            (other, _) => corrupt(format!("unexpected script reply {other:?}")),
        }
    }
}

fn text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn array(v: Value) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(a) => Ok(a),
        Value::Set(a) => Ok(a),
        other => Err(corrupt(format!("expected an array, got {other:?}"))),
    }
}

/// A flat `HGETALL` reply to field -> bytes.
fn fields(v: Value) -> Result<HashMap<String, Vec<u8>>, StoreError> {
    let pairs: Vec<(Value, Value)> = match v {
        Value::Map(m) => m,
        v => {
            let a = array(v)?;
            if a.len() % 2 != 0 {
                return Err(corrupt("odd HGETALL reply"));
            }
            let mut it = a.into_iter();
            let mut out = Vec::new();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                out.push((k, v));
            }
            out
        }
    };
    pairs
        .into_iter()
        .map(|(k, v)| {
            let k = text(Some(&k)).ok_or_else(|| corrupt("hash field name"))?;
            let v = match v {
                Value::BulkString(b) => b,
                Value::SimpleString(s) => s.into_bytes(),
                Value::Int(i) => i.to_string().into_bytes(),
                other => return Err(corrupt(format!("hash value {other:?}"))),
            };
            Ok((k, v))
        })
        .collect()
}

/// Decodes a key hash. Fields: op, prov, pk, st, rt, fp, req, rs (status), rh (headers JSON),
/// rb (body), err, tok, own, lex (lease expiry), att, cat, uat, exp, nca (next check), ret
/// (retention ms), hs (last history sequence). Times are ms since the epoch.
fn record(
    scope: &str,
    key: &str,
    mut f: HashMap<String, Vec<u8>>,
) -> Result<KeyRecord, StoreError> {
    fn s(f: &mut HashMap<String, Vec<u8>>, k: &str) -> Result<Option<String>, StoreError> {
        f.remove(k)
            .map(|v| String::from_utf8(v).map_err(|_| corrupt(format!("field {k} is not UTF-8"))))
            .transpose()
    }
    fn req(f: &mut HashMap<String, Vec<u8>>, k: &str) -> Result<String, StoreError> {
        s(f, k)?.ok_or_else(|| corrupt(format!("field {k} missing")))
    }
    fn n(f: &mut HashMap<String, Vec<u8>>, k: &str) -> Result<Option<i64>, StoreError> {
        s(f, k)?
            .map(|v| {
                v.parse::<i64>()
                    .map_err(|_| corrupt(format!("field {k} = {v:?}")))
            })
            .transpose()
    }
    fn t(f: &mut HashMap<String, Vec<u8>>, k: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        n(f, k)?.map(|ms| ms_to_time(BACKEND, ms)).transpose()
    }
    fn need<T>(v: Option<T>, k: &str) -> Result<T, StoreError> {
        v.ok_or_else(|| corrupt(format!("field {k} missing")))
    }
    let status = n(&mut f, "rs")?
        .map(|v| i32::try_from(v).map_err(|_| corrupt(format!("status {v}"))))
        .transpose()?;
    RawRecord {
        scope: scope.to_owned(),
        key: key.to_owned(),
        operation: req(&mut f, "op")?,
        provider: s(&mut f, "prov")?,
        provider_key: req(&mut f, "pk")?,
        state: req(&mut f, "st")?,
        retryable: req(&mut f, "rt")? == "1",
        fingerprint: req(&mut f, "fp")?,
        request: s(&mut f, "req")?,
        response_status: status,
        response_headers: s(&mut f, "rh")?,
        response_body: f.remove("rb"),
        error: s(&mut f, "err")?,
        lease_token: need(n(&mut f, "tok")?, "tok")?,
        lease_owner: s(&mut f, "own")?,
        lease_expires_at: t(&mut f, "lex")?,
        attempts: i32::try_from(need(n(&mut f, "att")?, "att")?)
            .map_err(|_| corrupt("attempts"))?,
        created_at: need(t(&mut f, "cat")?, "cat")?,
        updated_at: need(t(&mut f, "uat")?, "uat")?,
        expires_at: t(&mut f, "exp")?,
        next_check_at: t(&mut f, "nca")?,
        retention_ms: need(n(&mut f, "ret")?, "ret")?,
    }
    .into_record(BACKEND)
}

/// Decodes one history entry: the compact form written by the scripts
/// (`seq|from|from_rt|to|to_rt|token|at|#actor|actor[|reason]`) or, for entries written by an
/// earlier version, JSON.
fn event(raw: &str) -> Result<KeyEvent, StoreError> {
    if raw.starts_with('{') {
        return json_event(raw);
    }
    let bad = || corrupt(format!("history entry {raw:?}"));
    let mut it = raw.splitn(8, '|');
    let mut next = || it.next().ok_or_else(bad);
    let seq: i64 = next()?.parse().map_err(|_| bad())?;
    let opt = |v: &str| (!v.is_empty()).then(|| v.to_owned());
    let from_state = opt(next()?);
    let from_retryable = opt(next()?).map(|v| v == "1");
    let to_state = opt(next()?);
    let to_retryable = opt(next()?).map(|v| v == "1");
    let lease_token = opt(next()?)
        .map(|v| v.parse::<i64>().map_err(|_| bad()))
        .transpose()?;
    let at: i64 = next()?.parse().map_err(|_| bad())?;
    let rest = next()?;
    let (len, rest) = rest.split_once('|').ok_or_else(bad)?;
    let len: usize = len.parse().map_err(|_| bad())?;
    let actor = rest.get(..len).ok_or_else(bad)?.to_owned();
    let reason = match rest.get(len..).ok_or_else(bad)? {
        "" => None,
        r => Some(r.strip_prefix('|').ok_or_else(bad)?.to_owned()),
    };
    RawEvent {
        seq,
        from_state,
        from_retryable,
        to_state,
        to_retryable,
        lease_token,
        actor,
        reason,
        at: ms_to_time(BACKEND, at)?,
    }
    .into_event(BACKEND)
}

/// Decodes one JSON history entry (the format before the compact one).
fn json_event(raw: &str) -> Result<KeyEvent, StoreError> {
    let v: serde_json::Value =
        serde_json::from_str(raw).map_err(|e| corrupt(format!("history entry: {e}")))?;
    let num = |k: &str| -> Option<i64> {
        let x = v.get(k)?;
        x.as_i64().or_else(|| x.as_f64().map(|f| f as i64))
    };
    let string = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
    let flag = |k: &str| string(k).map(|s| s == "1");
    RawEvent {
        seq: num("q").ok_or_else(|| corrupt("history entry without q"))?,
        from_state: string("f"),
        from_retryable: flag("fr"),
        to_state: string("t"),
        to_retryable: flag("tr"),
        lease_token: num("k"),
        actor: string("a").unwrap_or_default(),
        reason: string("r"),
        at: ms_to_time(
            BACKEND,
            num("at").ok_or_else(|| corrupt("history entry without at"))?,
        )?,
    }
    .into_event(BACKEND)
}

#[async_trait]
impl Store for RedisStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// Nothing to create: records the data format under `P:format` (refusing another one) and
    /// loads the scripts.
    #[instrument(skip(self), fields(backend = BACKEND, prefix = %self.prefix), err)]
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut con = self.con.clone();
        let key = format!("{}:format", self.prefix);
        let _: Value = redis::cmd("SET")
            .arg(&key)
            .arg(FORMAT_VERSION)
            .arg("NX")
            .query_async(&mut con)
            .await
            .map_err(db)?;
        let found: Option<String> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut con)
            .await
            .map_err(db)?;
        if found.as_deref() != Some(FORMAT_VERSION) {
            return Err(StoreError::Config(format!(
                "Redis prefix {:?} holds data format {found:?}, this version writes {FORMAT_VERSION}",
                self.prefix
            )));
        }
        let s = &*SCRIPTS;
        for script in [
            &s.claim,
            &s.finish,
            &s.release,
            &s.extend,
            &s.take_stale,
            &s.purge,
            &s.stats,
            &s.stuck,
            &s.count_expired,
        ] {
            script.load_async(&mut con).await.map_err(db)?;
        }
        Ok(())
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        let mut con = self.con.clone();
        let (sec, usec): (i64, i64) = redis::cmd("TIME").query_async(&mut con).await.map_err(db)?;
        ms_to_time(BACKEND, sec * 1000 + usec / 1000)
    }

    #[instrument(name = "idemflow.claim", skip_all, fields(backend = BACKEND, scope = %claim.id.scope, key = %claim.id.key, operation = %claim.operation), err)]
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        let m = member(&claim.id);
        let k = self.keys(&m);
        if self.is_known(&m) {
            // The script decides again, atomically; this read only spares it for keys that
            // exist and are not claimable (replays, in-flight keys, other requests).
            if let (Some(record), now) = self.snapshot(&claim.id, &k.hash).await?
                && !claimable(claim, &record, now)
            {
                return Ok(ClaimOutcome::Existing {
                    record: Box::new(record),
                    now,
                });
            }
        }
        let window = claim.takeover_window.map(|w| ms(w).to_string());
        let mut inv = self.per_key(&SCRIPTS.claim, &k);
        inv.arg(&m)
            .arg(&claim.operation)
            .arg(opt(claim.provider.as_deref().map(str::as_bytes)))
            .arg(&claim.provider_key)
            .arg(claim.fingerprint.as_str())
            .arg(opt(claim.request.as_deref().map(str::as_bytes)))
            .arg(&claim.owner)
            .arg(ms(claim.lease))
            .arg(ms(claim.retention))
            .arg(opt(window.as_deref().map(str::as_bytes)));
        let reply = array(self.invoke(&inv).await?)?;
        self.set_known(&m);
        match text(reply.first()).as_deref() {
            Some("claimed") => {
                let transition = match text(reply.get(5)).as_deref() {
                    Some("claim") => Transition::Claim,
                    Some("reclaim") => Transition::Reclaim,
                    Some("takeover") => Transition::Takeover,
                    other => return Err(corrupt(format!("claim transition {other:?}"))),
                };
                let get = |i: usize| int(reply.get(i)).ok_or_else(|| corrupt("claim reply"));
                tracing::debug!(?transition, "key claimed");
                Ok(ClaimOutcome::Claimed(Lease {
                    token: LeaseToken(get(1)?),
                    expires_at: ms_to_time(BACKEND, get(2)?)?,
                    attempts: i32::try_from(get(3)?).map_err(|_| corrupt("attempts"))?,
                    provider_key: text(reply.get(4)).ok_or_else(|| corrupt("claim reply"))?,
                    transition,
                }))
            }
            Some("existing") => {
                let now = ms_to_time(
                    BACKEND,
                    int(reply.get(1)).ok_or_else(|| corrupt("claim reply"))?,
                )?;
                let hash = reply
                    .into_iter()
                    .nth(2)
                    .ok_or_else(|| corrupt("claim reply"))?;
                let record = record(
                    claim.id.scope.as_str(),
                    claim.id.key.as_str(),
                    fields(hash)?,
                )?;
                Ok(ClaimOutcome::Existing {
                    record: Box::new(record),
                    now,
                })
            }
            other => Err(corrupt(format!("claim reply {other:?}"))),
        }
    }

    #[instrument(name = "idemflow.finish", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key, to = %finish.to, actor = finish.actor.as_str()), err)]
    async fn finish(
        &self,
        id: &KeyId,
        token: Option<LeaseToken>,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        check_finish(token, finish.to)?;
        let m = member(id);
        let k = self.keys(&m);
        let (status, headers) = match &finish.response {
            Some(r) => (Some(r.status().to_string()), Some(r.headers_json())),
            None => (None, None),
        };
        let token_arg = token.map(|t| t.0.to_string());
        let mut inv = self.per_key(&SCRIPTS.finish, &k);
        inv.arg(&m)
            .arg(finish.to.as_str())
            .arg(if finish.to.is_retryable() { "1" } else { "0" })
            .arg(opt(status.as_deref().map(str::as_bytes)))
            .arg(opt(headers.as_deref().map(str::as_bytes)))
            .arg(opt(finish.response.as_ref().map(|r| r.body())))
            .arg(opt(finish.error.as_deref().map(str::as_bytes)))
            .arg(opt(token_arg.as_deref().map(str::as_bytes)))
            .arg(finish.actor.as_str())
            .arg(&finish.reason);
        let mut reply = array(self.invoke(&inv).await?)?;
        if text(reply.first()).as_deref() == Some("ok") && reply.len() == 2 {
            let hash = reply.swap_remove(1);
            return record(id.scope.as_str(), id.key.as_str(), fields(hash)?);
        }
        Err(Self::refusal(id, token, &reply))
    }

    #[instrument(name = "idemflow.release", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key, actor = release.actor.as_str()), err)]
    async fn release(
        &self,
        id: &KeyId,
        token: LeaseToken,
        release: &Release,
    ) -> Result<(), StoreError> {
        let m = member(id);
        let k = self.keys(&m);
        let recheck = release.recheck_after.map(|d| ms(d).to_string());
        let mut inv = self.per_key(&SCRIPTS.release, &k);
        inv.arg(&m)
            .arg(token.0)
            .arg(opt(recheck.as_deref().map(str::as_bytes)))
            .arg(opt(release.error.as_deref().map(str::as_bytes)))
            .arg(release.actor.as_str())
            .arg(&release.reason);
        let reply = array(self.invoke(&inv).await?)?;
        if text(reply.first()).as_deref() == Some("ok") {
            return Ok(());
        }
        Err(Self::refusal(id, Some(token), &reply))
    }

    #[instrument(name = "idemflow.extend", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key), err)]
    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        let m = member(id);
        let k = self.keys(&m);
        let mut inv = self.per_key(&SCRIPTS.extend, &k);
        inv.arg(&m).arg(token.0).arg(ms(lease));
        let reply = array(self.invoke(&inv).await?)?;
        if text(reply.first()).as_deref() == Some("ok") {
            let at = int(reply.get(1)).ok_or_else(|| corrupt("extend reply"))?;
            return ms_to_time(BACKEND, at);
        }
        Err(Self::refusal(id, Some(token), &reply))
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        self.current(id).await
    }

    async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError> {
        let mut con = self.con.clone();
        let entries: Vec<String> = redis::cmd("LRANGE")
            .arg(self.keys(&member(id)).hist)
            .arg(0)
            .arg(-1)
            .query_async(&mut con)
            .await
            .map_err(db)?;
        entries.iter().map(|e| event(e)).collect()
    }

    #[instrument(name = "idemflow.take_stale", skip_all, fields(backend = BACKEND, owner = %take.owner, limit = take.limit), err)]
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        let mut out = Vec::new();
        for bucket in self.bucket_order() {
            let left = take.limit as usize - out.len();
            if left == 0 {
                break;
            }
            let mut inv = self.per_bucket(&SCRIPTS.take_stale, bucket);
            inv.arg(&take.owner).arg(ms(take.lease)).arg(left);
            for entry in array(self.invoke(&inv).await?)? {
                let mut pair = array(entry)?.into_iter();
                let (Some(m), Some(hash)) = (pair.next(), pair.next()) else {
                    return Err(corrupt("take_stale reply"));
                };
                let m = text(Some(&m)).ok_or_else(|| corrupt("take_stale member"))?;
                let (scope, key) =
                    unmember(&m).ok_or_else(|| corrupt(format!("index member {m:?}")))?;
                out.push(record(&scope, &key, fields(hash)?)?);
            }
        }
        Ok(out)
    }

    #[instrument(name = "idemflow.purge", skip(self), fields(backend = BACKEND), err)]
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let mut total = 0u64;
        for bucket in self.bucket_order() {
            let left = u64::from(batch) - total;
            if left == 0 {
                break;
            }
            let mut inv = self.per_bucket(&SCRIPTS.purge, bucket);
            inv.arg(left);
            let n = int(Some(&self.invoke(&inv).await?)).ok_or_else(|| corrupt("purge reply"))?;
            total += u64::try_from(n).map_err(|_| corrupt("purge reply"))?;
        }
        Ok(total)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut st = Stats::default();
        let mut oldest: Option<i64> = None;
        let mut now = 0i64;
        for bucket in 0..self.buckets {
            let inv = self.per_bucket(&SCRIPTS.stats, bucket);
            let r = array(self.invoke(&inv).await?)?;
            let get = |i: usize| int(r.get(i)).ok_or_else(|| corrupt("stats reply"));
            st.processing += get(0)?;
            st.stale += get(1)?;
            st.done += get(2)?;
            st.failed_retryable += get(3)?;
            st.failed_permanent += get(4)?;
            let o = get(5)?;
            if o >= 0 {
                oldest = Some(oldest.map_or(o, |x| x.min(o)));
            }
            now = now.max(get(6)?);
        }
        st.oldest_processing_created_at = oldest.map(|ms| ms_to_time(BACKEND, ms)).transpose()?;
        st.now = ms_to_time(BACKEND, now)?;
        Ok(st)
    }

    /// Per bucket: the count from the `created` index and its oldest `limit` members; the
    /// buckets' lists are merged by creation time.
    async fn stuck(&self, older_than: Duration, limit: u32) -> Result<Stuck, StoreError> {
        let mut count = 0i64;
        let mut oldest = Vec::new();
        for bucket in 0..self.buckets {
            let mut inv = self.per_bucket(&SCRIPTS.stuck, bucket);
            inv.arg(ms(older_than)).arg(limit);
            let mut reply = array(self.invoke(&inv).await?)?.into_iter();
            let (Some(n), Some(list)) = (reply.next(), reply.next()) else {
                return Err(corrupt("stuck reply"));
            };
            count += int(Some(&n)).ok_or_else(|| corrupt("stuck reply"))?;
            for entry in array(list)? {
                let mut pair = array(entry)?.into_iter();
                let (Some(m), Some(hash)) = (pair.next(), pair.next()) else {
                    return Err(corrupt("stuck reply"));
                };
                let m = text(Some(&m)).ok_or_else(|| corrupt("stuck member"))?;
                let (scope, key) =
                    unmember(&m).ok_or_else(|| corrupt(format!("index member {m:?}")))?;
                oldest.push(record(&scope, &key, fields(hash)?)?);
            }
        }
        oldest.sort_by(|a: &KeyRecord, b: &KeyRecord| {
            (a.created_at, a.scope.as_str(), a.key.as_str()).cmp(&(
                b.created_at,
                b.scope.as_str(),
                b.key.as_str(),
            ))
        });
        oldest.truncate(limit as usize);
        Ok(Stuck { count, oldest })
    }

    async fn count_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0u64;
        for bucket in 0..self.buckets {
            let inv = self.per_bucket(&SCRIPTS.count_expired, bucket);
            let n = int(Some(&self.invoke(&inv).await?))
                .ok_or_else(|| corrupt("count_expired reply"))?;
            total += u64::try_from(n).map_err(|_| corrupt("count_expired reply"))?;
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_round_trip_and_never_hold_braces() {
        for (s, k) in [
            ("a", "b"),
            ("a:b", "c"),
            ("a", "b:c"),
            ("%3A", "{x}"),
            ("}{%", ":::"),
        ] {
            let id = KeyId::new(
                crate::Scope::new(s).unwrap(),
                crate::IdempotencyKey::new(k).unwrap(),
            );
            let m = member(&id);
            assert!(!m.contains(['{', '}']));
            assert_eq!(unmember(&m), Some((s.to_owned(), k.to_owned())));
        }
        assert_eq!(unescape("%zz"), None);
        assert_eq!(unescape("%2"), None);
    }

    #[test]
    fn history_entries_decode_compact_and_json() {
        let e = event("1|||processing|0|1|1700000000000|6|worker|claimed").unwrap();
        assert_eq!(e.seq, 1);
        assert_eq!(e.from, None);
        assert_eq!(e.to, Some(KeyState::Processing));
        assert_eq!(e.lease_token, Some(LeaseToken(1)));
        assert_eq!(e.actor, crate::Actor::Worker);
        assert_eq!(e.reason.as_deref(), Some("claimed"));
        assert_eq!(e.at.timestamp_millis(), 1_700_000_000_000);
        // A reason may hold the separator; an empty reason differs from none.
        let e = event("3|processing|0|failed|1|2|5|8|operator|a|b|c").unwrap();
        assert_eq!(e.from, Some(KeyState::Processing));
        assert_eq!(e.to, Some(KeyState::Failed { retryable: true }));
        assert_eq!(e.actor, crate::Actor::Operator);
        assert_eq!(e.reason.as_deref(), Some("a|b|c"));
        assert_eq!(
            event("4|done|0|||2|5|5|purge|").unwrap().reason.as_deref(),
            Some("")
        );
        let e = event("5|done|0||||5|5|purge").unwrap();
        assert_eq!((e.to, e.lease_token, e.reason), (None, None, None));
        // Entries written by earlier versions.
        let e = event(
            r#"{"q":2,"f":"processing","fr":"0","t":"done","tr":"0","k":1,"a":"worker","r":"ok","at":1700000000000}"#,
        )
        .unwrap();
        assert_eq!((e.seq, e.to), (2, Some(KeyState::Done)));
        for bad in [
            "",
            "x|",
            "1|||done|0|1|5|9|worker",
            "1|||done|0|1|5|6|workerX",
        ] {
            assert!(event(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn prefixes_are_checked() {
        assert!(validate_prefix("idemflow").is_ok());
        for bad in ["", "a{b", "a}b", "a b", "é"] {
            assert!(validate_prefix(bad).is_err(), "{bad:?}");
        }
    }
}
