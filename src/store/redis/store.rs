//! [`RedisStore`]: the [`Store`] impl, one Lua script call per transition.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, ScriptInvocation, Value};
use tracing::instrument;

use super::config::{SENTINEL_SCHEME, SentinelConfig, WaitReplicas, take_wait_params};
use super::decode::{
    array, history_of, int, maybe_record, member_records, record, record_of, refusal, text,
};
use super::layout::{Keys, Layout, fnv1a, member, scope_prefix, unmember, validate_prefix};
use super::sentinel::SentinelConnection;
use super::{BACKEND, FORMAT_VERSION, RedisConfig, corrupt, db};
use crate::KeyId;
use crate::error::{ReplicatedWrite, StoreError};
use crate::record::{KeyEvent, KeyRecord, LeaseToken};
use crate::state::KeyState;
use crate::state::Transition;
use crate::store::FinishMode;
use crate::store::connect_error::{redis_cause, within};
use crate::store::kit::{check_finish, claimable, millis};
use crate::store::known_keys::KnownKeys;
use crate::store::rows::ms_to_time;
use crate::store::{
    ClaimOutcome, Finish, Lease, NewClaim, OperatorStore, Release, Stats, Store, Stuck,
    SweeperStore, TakeStale,
};

/// The claims a claim script makes, in the order it takes their history reasons as arguments.
const CLAIMS: [Transition; 3] = [Transition::Claim, Transition::Reclaim, Transition::Takeover];

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(include_str!("common.lua"), include_str!($file)))
    };
}

struct Scripts {
    announce_end: Script,
    claim: Script,
    finish: Script,
    release: Script,
    extend: Script,
    mark_attempt: Script,
    take_stale: Script,
    purge: Script,
    scan: Script,
    count_expired: Script,
}

impl Scripts {
    fn all(&self) -> [&Script; 10] {
        [
            &self.announce_end,
            &self.claim,
            &self.finish,
            &self.release,
            &self.extend,
            &self.mark_attempt,
            &self.take_stale,
            &self.purge,
            &self.scan,
            &self.count_expired,
        ]
    }
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    announce_end: script!("announce_end.lua"),
    claim: script!("claim.lua"),
    finish: script!("finish.lua"),
    release: script!("release.lua"),
    extend: script!("extend.lua"),
    mark_attempt: script!("mark_attempt.lua"),
    take_stale: script!("take_stale.lua"),
    purge: script!("purge.lua"),
    scan: script!("scan.lua"),
    count_expired: script!("count_expired.lua"),
});

/// What `scan.lua` returns for one bucket.
struct Scan {
    now: i64,
    counts: [i64; 4],
    keys: Vec<(String, i64, i64)>,
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
    millis(d)
}

/// A connection to a single Redis server (a [`ConnectionManager`]), to a Redis Cluster (a
/// [`ClusterConnection`], which routes each command by its key's hash slot) or to the primary
/// Redis Sentinel names (a [`SentinelConnection`], which asks the sentinels again after a
/// failover). Cheap to clone: the clones share one multiplexed connection (per node).
#[derive(Clone)]
pub enum RedisConnection {
    /// One Redis server.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
    /// The primary of a Redis Sentinel set.
    Sentinel(SentinelConnection),
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            Self::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            Self::Sentinel(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Sentinel(c) => c.get_db(),
        }
    }
}

/// A [`Store`] on Redis (feature `redis`), on one server, on a Redis Cluster
/// ([`RedisConfig::cluster()`]) or on the primary of a Redis Sentinel set
/// ([`RedisConfig::sentinel()`], or a `redis+sentinel://` URL).
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
    con: RedisConnection,
    layout: Layout,
    /// The first three common script arguments (history cap, history TTL, grace).
    cap: i64,
    history_ttl: i64,
    grace: i64,
    /// Keys known to exist (see [`RedisConfig::known_keys`]).
    known: KnownKeys,
    /// Where the next bucket-wide operation starts, so no bucket starves.
    cursor: Arc<AtomicU32>,
    /// `WAIT` after claims and finishes.
    wait: Option<WaitReplicas>,
    /// Where this store subscribes to the ends it announces (`Store::key_ends`): one server,
    /// one node of the cluster (a cluster's PUBLISH reaches every node), or the primary the
    /// sentinels name; `None` for a connection built by the caller (the waiters then poll).
    announcer: Option<Announcer>,
    /// The ends heard on the channel (shared by the clones).
    ends: Arc<crate::store::ends::EndFeed>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.layout.prefix())
            .field("buckets", &self.layout.buckets())
            .field("cluster", &matches!(self.con, RedisConnection::Cluster(_)))
            .field(
                "sentinel",
                &matches!(self.con, RedisConnection::Sentinel(_)),
            )
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

/// How often [`RedisStore::invoke`] sends a script again that the server refused unrun.
const NOT_RUN_RETRIES: u32 = 3;

/// Whether the server refused the command before running it: a cluster redirect (`MOVED`,
/// `ASK`), `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `LOADING` or `READONLY` (a former primary,
/// now a replica: a script fails at its first write, and a replica has written nothing before
/// it). Such a command is safe to send again; nothing else is (a dropped connection or a
/// timeout may follow a run).
fn not_run(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind as S};
    matches!(
        e.kind(),
        ErrorKind::Server(
            S::Moved
                | S::Ask
                | S::TryAgain
                | S::ClusterDown
                | S::MasterDown
                | S::BusyLoading
                | S::ReadOnly
        )
    )
}

/// Processing keys read per `scan.lua` call (stats, stuck).
const SCAN_PAGE: i64 = 1000;

impl RedisStore {
    /// Connects to `url` with the default prefix `idemflow` and the defaults of [`RedisConfig`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(RedisConfig::new(url)).await
    }

    /// Connects to `url` with the key prefix `prefix`.
    pub async fn connect_with_prefix(url: &str, prefix: &str) -> Result<Self, StoreError> {
        Self::connect_with(RedisConfig::new(url).prefix(prefix)).await
    }

    /// Connects with explicit options: to one server, with [`RedisConfig::cluster()`] to a
    /// Redis Cluster through its seed nodes, or with [`RedisConfig::sentinel()`] (or a
    /// `redis+sentinel://` URL, see [`SentinelConfig::parse_url`]) to the primary a Redis
    /// Sentinel set names. The connection reconnects on its own (through Sentinel: to the
    /// primary the sentinels name then); a command that failed with the connection is not
    /// retried (a script may or may not have run).
    ///
    /// A single server's URL may carry `wait_replicas=N` and `wait_timeout_ms=T` query
    /// parameters, like a Sentinel URL, to set [`RedisConfig::wait`].
    pub async fn connect_with(mut config: RedisConfig) -> Result<Self, StoreError> {
        validate_prefix(&config.prefix)?;
        let mut url_wait = None;
        let mut single_url = config.url.clone();
        if config.sentinel.is_none() && config.url.starts_with(SENTINEL_SCHEME) {
            let (sentinel, wait) = SentinelConfig::parse_url(&config.url)?;
            config.sentinel = Some(sentinel);
            url_wait = wait;
        } else if config.sentinel.is_none()
            && !config.cluster
            && let Some((head, query)) = config.url.split_once('?')
        {
            let (wait, rest) = take_wait_params(query)
                .map_err(|why| StoreError::Config(format!("bad Redis URL: {why}")))?;
            url_wait = wait;
            single_url = if rest.is_empty() {
                head.to_owned()
            } else {
                format!("{head}?{}", rest.join("&"))
            };
        }
        if config.wait.is_none() {
            config.wait = url_wait;
        }
        if let Some(w) = config.wait
            && w.timeout.is_zero()
        {
            return Err(StoreError::Config(
                "the WAIT timeout must be above zero (WAIT with 0 waits forever)".into(),
            ));
        }
        let con = if let Some(sentinel) = &config.sentinel {
            if sentinel.master.is_empty() {
                return Err(StoreError::Config("Redis Sentinel: no master name".into()));
            }
            if sentinel.sentinels.is_empty() {
                return Err(StoreError::Config(
                    "Redis Sentinel: no sentinel address".into(),
                ));
            }
            if config.cluster {
                return Err(StoreError::Config(
                    "Redis Sentinel and Redis Cluster are exclusive: choose one".into(),
                ));
            }
            RedisConnection::Sentinel(
                within(
                    BACKEND,
                    &config.url,
                    // The lookup is bounded by `connection_timeout`, the connection too.
                    config
                        .connection_timeout
                        .saturating_mul(2)
                        .saturating_add(Duration::from_secs(1)),
                    SentinelConnection::connect(
                        sentinel,
                        config.response_timeout,
                        config.connection_timeout,
                    ),
                    redis_cause,
                )
                .await?,
            )
        } else if config.cluster {
            let seeds: Vec<&str> = config
                .url
                .split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .collect();
            if seeds.is_empty() {
                return Err(StoreError::Config("no Redis Cluster seed URL".into()));
            }
            // No retries: the cluster client re-sends a command after a dropped connection or
            // a timeout, and a script that already ran would then run again (a claim's winner
            // told the key is someone else's, a finish that succeeded told its lease was lost).
            // The redirects and refusals that mean "not run" are retried in `invoke`.
            let client = ClusterClientBuilder::new(seeds)
                .response_timeout(config.response_timeout)
                .connection_timeout(config.connection_timeout)
                .retries(0)
                .build()
                .map_err(|e| StoreError::Config(format!("bad Redis Cluster URL: {e}")))?;
            RedisConnection::Cluster(
                within(
                    BACKEND,
                    &config.url,
                    config.connection_timeout + Duration::from_secs(1),
                    client.get_async_connection(),
                    redis_cause,
                )
                .await?,
            )
        } else {
            let client = redis::Client::open(single_url.as_str())
                .map_err(|e| StoreError::Config(format!("bad Redis URL: {e}")))?;
            let cm = ConnectionManagerConfig::new()
                .set_response_timeout(Some(config.response_timeout))
                .set_connection_timeout(Some(config.connection_timeout))
                .set_number_of_retries(2);
            RedisConnection::Single(
                within(
                    BACKEND,
                    &config.url,
                    config.connection_timeout + Duration::from_secs(1),
                    ConnectionManager::new_with_config(client, cm),
                    redis_cause,
                )
                .await?,
            )
        };
        // Where the store subscribes to announced ends: the server, the cluster's first seed
        // node, or the primary the sentinels name.
        let announcer = match &con {
            RedisConnection::Sentinel(s) => Some(Announcer::Sentinel(s.clone())),
            RedisConnection::Cluster(_) => config
                .url
                .split(',')
                .map(str::trim)
                .find(|u| !u.is_empty())
                .and_then(|url| redis::Client::open(url).ok())
                .map(Announcer::Node),
            RedisConnection::Single(_) => redis::Client::open(single_url.as_str())
                .ok()
                .map(Announcer::Node),
        };
        Ok(Self {
            announcer,
            ..Self::from_connection(con, config)
        })
    }

    /// Uses a connection you built; the URL and the `cluster` switch in `config` are ignored.
    pub fn from_connection(con: RedisConnection, config: RedisConfig) -> Self {
        Self {
            con,
            layout: Layout::new(config.prefix, config.buckets),
            cap: i64::from(config.history_cap),
            history_ttl: ms(config.history_ttl),
            grace: config.expiry_grace.map_or(-1, ms),
            known: KnownKeys::new(config.known_keys),
            cursor: Arc::new(AtomicU32::new(0)),
            wait: config.wait,
            announcer: None,
            ends: Arc::default(),
        }
    }

    /// The channel the ends of announced keys are published on: `<prefix>:ends`.
    fn ends_channel(&self) -> String {
        format!("{}:ends", self.layout.prefix())
    }

    /// The connection (for tests and tools that need raw access).
    pub fn connection(&self) -> RedisConnection {
        self.con.clone()
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        self.layout.prefix()
    }

    /// The Redis key of the string holding `id`'s record and history (for inspection, e.g.
    /// `MEMORY USAGE`).
    pub fn record_key(&self, id: &KeyId) -> String {
        self.layout.keys(&member(id)).rec
    }

    /// Sets the four common arguments (see `common.lua`); the last, the record-name prefix of
    /// the bucket, only bucket scripts use.
    fn common_args(&self, inv: &mut ScriptInvocation<'_>, record_prefix: String) {
        inv.arg(self.cap)
            .arg(self.history_ttl)
            .arg(self.grace)
            .arg(record_prefix);
    }

    /// A per-key script invocation with KEYS and the common ARGV filled in.
    fn per_key<'a>(&self, script: &'a Script, k: &Keys) -> ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        inv.key(&k.rec).key(&k.idx);
        self.common_args(&mut inv, String::new());
        inv
    }

    /// A bucket-wide script invocation.
    fn per_bucket<'a>(&self, script: &'a Script, bucket: u32) -> ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        inv.key(self.layout.bucket_index(bucket));
        self.common_args(&mut inv, self.layout.record_prefix(bucket));
        inv
    }

    /// Buckets in the order a bucket-wide operation should visit them.
    fn bucket_order(&self) -> impl Iterator<Item = u32> + use<> {
        let n = self.layout.buckets();
        let start = self.cursor.fetch_add(1, Ordering::Relaxed) % n;
        (0..n).map(move |i| (start + i) % n)
    }

    /// Runs a script. It is sent again only when the server refused it without running it (a
    /// cluster redirect during resharding, a failover in progress); an answer lost with the
    /// connection or to the response timeout is a store error, never a re-send: the script may
    /// have run, and its second run would answer differently (`docs/backends.md`, "Redis").
    async fn invoke(&self, inv: &ScriptInvocation<'_>) -> Result<Value, StoreError> {
        let mut con = self.con.clone();
        let mut refused = 0;
        loop {
            match inv.invoke_async(&mut con).await {
                Ok(v) => return Ok(v),
                Err(e) if refused < NOT_RUN_RETRIES && not_run(&e) => {
                    refused += 1;
                    // Lets the cluster client refresh its slot map first.
                    tokio::time::sleep(Duration::from_millis(50) * refused).await;
                }
                Err(e) => return Err(db(e)),
            }
        }
    }

    /// Runs a script that writes (a claim or a finish), with [`RedisConfig::wait`] followed by
    /// `WAIT` in the same round trip (one pipeline, on one connection, so the `WAIT` covers the
    /// script's writes); returns the reply and, with `WAIT`, how many replicas acknowledged.
    /// Refusals are retried as in [`invoke`](Self::invoke); a script unknown to the server
    /// (`NOSCRIPT`, e.g. on a replica just promoted) is loaded and sent again (it did not run).
    async fn invoke_waited(
        &self,
        inv: &ScriptInvocation<'_>,
    ) -> Result<(Value, Option<u32>), StoreError> {
        let Some(wait) = self.wait else {
            return Ok((self.invoke(inv).await?, None));
        };
        let mut con = self.con.clone();
        let (mut refused, mut loaded) = (0, false);
        loop {
            let mut pipe = redis::pipe();
            pipe.ignore_errors()
                .invoke_script(inv)
                .cmd("WAIT")
                .arg(wait.replicas)
                .arg(ms(wait.timeout));
            let replies: Vec<redis::RedisResult<Value>> = match pipe.query_async(&mut con).await {
                Ok(r) => r,
                Err(e) if refused < NOT_RUN_RETRIES && not_run(&e) => {
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(50) * refused).await;
                    continue;
                }
                Err(e) => return Err(db(e)),
            };
            let mut replies = replies.into_iter();
            let (Some(script), Some(acked)) = (replies.next(), replies.next()) else {
                return Err(corrupt("script and WAIT reply"));
            };
            match script {
                Ok(v) => {
                    let acked = acked.map_err(db)?;
                    let acked = int(Some(&acked)).ok_or_else(|| corrupt("WAIT reply"))?;
                    return Ok((v, Some(u32::try_from(acked).unwrap_or(0))));
                }
                Err(e)
                    if !loaded
                        && e.kind()
                            == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    loaded = true;
                    inv.load_async(&mut con).await.map_err(db)?;
                }
                Err(e) if refused < NOT_RUN_RETRIES && not_run(&e) => {
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(50) * refused).await;
                }
                Err(e) => return Err(db(e)),
            }
        }
    }

    /// The error for a write `acked` replicas acknowledged, fewer than [`RedisConfig::wait`]
    /// asks for; `None` when enough did (or without `WAIT`).
    fn short(&self, id: &KeyId, write: ReplicatedWrite, acked: Option<u32>) -> Option<StoreError> {
        let (wait, acked) = (self.wait?, acked?);
        (acked < wait.replicas).then(|| {
            tracing::warn!(scope = %id.scope, key = %id.key, %write, acked, wanted = wait.replicas, "write not acknowledged by enough replicas");
            StoreError::NotReplicated {
                backend: BACKEND,
                key: id.clone(),
                write,
                acknowledged: acked,
                wanted: wait.replicas,
                timeout: wait.timeout,
            }
        })
    }

    /// Sends a read (a command that changes nothing, so safe to repeat) and sends it again,
    /// a few times, after a refusal, a redirect or a dropped connection: the retries the
    /// cluster client no longer makes (see `connect_with`). A timeout is not retried.
    async fn read<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(RedisConnection) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let mut tries = 0;
        loop {
            match f(self.con.clone()).await {
                Ok(v) => return Ok(v),
                Err(e) if tries < NOT_RUN_RETRIES && (not_run(&e) || e.is_connection_dropped()) => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(50) * tries).await;
                }
                Err(e) => return Err(db(e)),
            }
        }
    }

    /// The key's record and the Redis clock, read atomically (`MULTI TIME GET EXEC`: one round
    /// trip, no script).
    async fn snapshot(
        &self,
        id: &KeyId,
        rec: &str,
    ) -> Result<(Option<KeyRecord>, DateTime<Utc>), StoreError> {
        let (time, raw): (Vec<i64>, Value) = self
            .read(|mut con| async move {
                redis::pipe()
                    .atomic()
                    .cmd("TIME")
                    .cmd("GET")
                    .arg(rec)
                    .query_async(&mut con)
                    .await
            })
            .await?;
        let [sec, usec] = time[..] else {
            return Err(corrupt("TIME reply"));
        };
        let now = ms_to_time(BACKEND, sec * 1000 + usec / 1000)?;
        Ok((maybe_record(id, raw)?, now))
    }

    /// One bucket's counts and a page of its processing keys (`scan.lua`): (now, [processing,
    /// done, failed_retryable, failed_permanent], [(member, lease expiry, created)]).
    async fn scan(&self, bucket: u32, offset: i64, count: i64) -> Result<Scan, StoreError> {
        let mut inv = self.per_bucket(&SCRIPTS.scan, bucket);
        inv.arg(offset).arg(count);
        let r = array(self.invoke(&inv).await?)?;
        let bad = || corrupt("scan reply");
        let get = |i: usize| int(r.get(i)).ok_or_else(bad);
        let counts = [get(1)?, get(2)?, get(3)?, get(4)?];
        let now = get(0)?;
        let page = array(r.into_iter().nth(5).ok_or_else(bad)?)?;
        let mut keys = Vec::with_capacity(page.len() / 3);
        for t in page.chunks(3) {
            let [m, lex, cat] = t else { return Err(bad()) };
            let m = text(Some(m)).ok_or_else(bad)?;
            keys.push((
                m,
                int(Some(lex)).ok_or_else(bad)?,
                int(Some(cat)).ok_or_else(bad)?,
            ));
        }
        Ok(Scan { now, counts, keys })
    }

    /// Every processing key of `bucket` (member, lease expiry, created), page by page, with the
    /// counts and clock of the first page.
    async fn scan_all(&self, bucket: u32) -> Result<Scan, StoreError> {
        let mut all = self.scan(bucket, 0, SCAN_PAGE).await?;
        let mut offset = SCAN_PAGE;
        while offset < all.counts[0] {
            let next = self.scan(bucket, offset, SCAN_PAGE).await?;
            if next.keys.is_empty() {
                break;
            }
            all.keys.extend(next.keys);
            offset += SCAN_PAGE;
        }
        Ok(all)
    }

    /// The lease of a `{'claimed', tok, lex, att, pk, reason, may_have_acted, created_at}` claim
    /// reply.
    fn lease(reply: &[Value]) -> Result<Lease, StoreError> {
        let reason = text(reply.get(5));
        let transition = reason
            .as_deref()
            .and_then(Transition::from_claim_reason)
            .ok_or_else(|| corrupt(format!("claim returned reason {reason:?}")))?;
        let get = |i: usize| int(reply.get(i)).ok_or_else(|| corrupt("claim reply"));
        tracing::debug!(?transition, "key claimed");
        Ok(Lease {
            token: LeaseToken(get(1)?),
            expires_at: ms_to_time(BACKEND, get(2)?)?,
            attempts: i32::try_from(get(3)?).map_err(|_| corrupt("attempts"))?,
            provider_key: text(reply.get(4)).ok_or_else(|| corrupt("claim reply"))?,
            transition,
            may_have_acted: text(reply.get(6)).as_deref() == Some("1"),
            created_at: ms_to_time(BACKEND, get(7)?)?,
        })
    }
}

impl RedisStore {
    /// [`Store::finish_as`] without judging the replicas' acknowledgement: the
    /// record, and how many replicas acknowledged (with `WAIT`, and `wait`).
    async fn finish_unchecked(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
        wait: bool,
    ) -> Result<(KeyRecord, Option<u32>), StoreError> {
        check_finish(mode, finish.to)?;
        let m = member(id);
        let k = self.layout.keys(&m);
        let (status, headers) = match &finish.response {
            Some(r) => (Some(r.status().to_string()), Some(r.headers_json())),
            None => (None, None),
        };
        let token_arg = mode.holder().map(|t| t.0.to_string());
        let expect_arg = mode.expected().map(|t| t.0.to_string());
        let mut inv = self.per_key(&SCRIPTS.finish, &k);
        let code = match finish.to {
            KeyState::Processing => 0,
            KeyState::Done => 1,
            KeyState::Failed { retryable: true } => 2,
            KeyState::Failed { retryable: false } => 3,
        };
        inv.arg(&m)
            .arg(code)
            .arg(opt(status.as_deref().map(str::as_bytes)))
            .arg(opt(headers.as_deref().map(str::as_bytes)))
            .arg(opt(finish.response.as_ref().map(|r| r.body())))
            .arg(opt(finish.error.as_deref().map(str::as_bytes)))
            .arg(opt(token_arg.as_deref().map(str::as_bytes)))
            .arg(finish.actor.as_str())
            .arg(&finish.reason)
            .arg(opt(expect_arg.as_deref().map(str::as_bytes)));
        let (reply, acked) = if wait {
            self.invoke_waited(&inv).await?
        } else {
            (self.invoke(&inv).await?, None)
        };
        let mut reply = array(reply)?;
        if text(reply.first()).as_deref() == Some("ok") && reply.len() == 2 {
            return Ok((record(id, reply.swap_remove(1))?, acked));
        }
        Err(refusal(id, mode.presented(), &reply))
    }

    /// Gives back a claim too few replicas acknowledged: when no earlier attempt may have
    /// acted, the key becomes `failed{retryable}` at once (nothing was sent for it, so a retry
    /// may run it); otherwise it stays `processing` under the unused lease, for a takeover or
    /// the sweeper once the lease ends, as after any claim whose holder vanished. Best effort:
    /// the primary may be gone already.
    async fn give_back(&self, id: &KeyId, lease: &Lease, acked: u32) {
        if lease.may_have_acted {
            return;
        }
        let why = format!(
            "claim acknowledged by {acked} replicas, fewer than asked for; nothing was sent"
        );
        let finish = Finish {
            to: KeyState::Failed { retryable: true },
            response: None,
            error: Some(why.clone()),
            actor: crate::record::Actor::Worker,
            reason: why,
        };
        if let Err(e) = self
            // Without `WAIT`: the caller has waited once already.
            .finish_unchecked(id, FinishMode::Holder(lease.token), &finish, false)
            .await
        {
            tracing::warn!(scope = %id.scope, key = %id.key, error = %e, "could not give back an unreplicated claim; it stays processing until its lease ends");
        }
    }
}

#[async_trait]
impl Store for RedisStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// Nothing to create: records the data format under `P:format` (refusing another one) and
    /// loads the scripts.
    #[instrument(skip(self), fields(backend = BACKEND, prefix = %self.layout.prefix()), err)]
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut con = self.con.clone();
        let key = self.layout.format_key();
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
                self.layout.prefix()
            )));
        }
        for script in SCRIPTS.all() {
            script.load_async(&mut con).await.map_err(db)?;
        }
        Ok(())
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        let (sec, usec): (i64, i64) = self
            .read(|mut con| async move { redis::cmd("TIME").query_async(&mut con).await })
            .await?;
        ms_to_time(BACKEND, sec * 1000 + usec / 1000)
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        crate::store::spans::traced(crate::store::spans::claim(BACKEND, claim), async move {
            let m = member(&claim.id);
            let k = self.layout.keys(&m);
            if self.known.contains(fnv1a(&m)) {
                // The script decides again, atomically; this read only spares it for keys that
                // exist and are not claimable (replays, in-flight keys, other requests).
                if let (Some(record), now) = self.snapshot(&claim.id, &k.rec).await?
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
            for t in CLAIMS {
                inv.arg(t.claim_reason().unwrap_or_default());
            }
            inv.arg(opt(claim.renewed_key_base.as_deref().map(str::as_bytes)));
            let (reply, acked) = self.invoke_waited(&inv).await?;
            let reply = array(reply)?;
            self.known.insert(fnv1a(&m));
            match text(reply.first()).as_deref() {
                Some("claimed") => {
                    let lease = Self::lease(&reply)?;
                    if let Some(e) = self.short(&claim.id, ReplicatedWrite::Claim, acked) {
                        self.give_back(&claim.id, &lease, acked.unwrap_or(0)).await;
                        return Err(e);
                    }
                    Ok(ClaimOutcome::Claimed(lease))
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
                    Ok(ClaimOutcome::Existing {
                        record: Box::new(record(&claim.id, hash)?),
                        now,
                    })
                }
                other => Err(corrupt(format!("claim reply {other:?}"))),
            }
        })
        .await
    }

    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        crate::store::spans::traced(
            crate::store::spans::finish(BACKEND, id, finish),
            async move {
                let (record, acked) = self.finish_unchecked(id, mode, finish, true).await?;
                match self.short(id, ReplicatedWrite::Finish, acked) {
                    Some(e) => Err(e),
                    None => Ok(record),
                }
            },
        )
        .await
    }

    async fn release(
        &self,
        id: &KeyId,
        token: LeaseToken,
        release: &Release,
    ) -> Result<(), StoreError> {
        crate::store::spans::traced(
            crate::store::spans::release(BACKEND, id, release),
            async move {
                let m = member(id);
                let k = self.layout.keys(&m);
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
                Err(refusal(id, Some(token), &reply))
            },
        )
        .await
    }

    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        crate::store::spans::traced(crate::store::spans::mark_attempt(BACKEND, id), async move {
            let m = member(id);
            let k = self.layout.keys(&m);
            let mut inv = self.per_key(&SCRIPTS.mark_attempt, &k);
            inv.arg(&m).arg(token.0);
            let reply = array(self.invoke(&inv).await?)?;
            if text(reply.first()).as_deref() == Some("ok") {
                return Ok(());
            }
            Err(refusal(id, Some(token), &reply))
        })
        .await
    }

    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        crate::store::spans::traced(crate::store::spans::extend(BACKEND, id), async move {
            let m = member(id);
            let k = self.layout.keys(&m);
            let mut inv = self.per_key(&SCRIPTS.extend, &k);
            inv.arg(&m).arg(token.0).arg(ms(lease));
            let reply = array(self.invoke(&inv).await?)?;
            if text(reply.first()).as_deref() == Some("ok") {
                let at = int(reply.get(1)).ok_or_else(|| corrupt("extend reply"))?;
                return ms_to_time(BACKEND, at);
            }
            Err(refusal(id, Some(token), &reply))
        })
        .await
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        let rec = self.record_key(id);
        let raw: Value = self
            .read(|mut con| {
                let rec = rec.clone();
                async move { redis::cmd("GET").arg(rec).query_async(&mut con).await }
            })
            .await?;
        maybe_record(id, raw)
    }

    /// Marks the processing key for its finish or release to PUBLISH it on `<prefix>:ends`
    /// (`announce_end.lua`); the mark lives at most a day. `Ok(false)` for a connection given to
    /// [`from_connection`](RedisStore::from_connection): nothing listens.
    async fn announce_end(&self, id: &KeyId) -> Result<bool, StoreError> {
        if self.announcer.is_none() {
            return Ok(false);
        }
        let k = self.layout.keys(&member(id));
        let mut inv = self.per_key(&SCRIPTS.announce_end, &k);
        inv.arg(self.ends_channel())
            .arg(crate::store::ends::payload(id))
            .arg(ANNOUNCE_MARK_TTL_MS);
        self.invoke(&inv).await?;
        Ok(true)
    }

    /// SUBSCRIBEs to `<prefix>:ends` on a connection of its own, from the first call until the
    /// store is dropped.
    fn key_ends(&self) -> Option<tokio::sync::broadcast::Receiver<crate::store::KeyEnd>> {
        let announcer = self.announcer.clone()?;
        let channel = self.ends_channel();
        Some(
            self.ends
                .subscribe(move |tx| listen(announcer, channel, tx)),
        )
    }
}

/// Where a store subscribes to the ends it announces.
#[derive(Clone)]
enum Announcer {
    /// One server, or one node of a cluster.
    Node(redis::Client),
    /// The primary the sentinels name, asked again at every (re)subscription.
    Sentinel(SentinelConnection),
}

impl Announcer {
    async fn client(&self) -> redis::RedisResult<redis::Client> {
        match self {
            Self::Node(c) => Ok(c.clone()),
            Self::Sentinel(s) => s.primary_client().await,
        }
    }
}

/// How long a waiters' mark stays on a key with no end (`announce_end.lua`).
const ANNOUNCE_MARK_TTL_MS: i64 = 24 * 3600 * 1000;

/// Forwards the ends published on `channel` to `tx` while anyone subscribes; a lost or failed
/// connection is a [`KeyEnd::Gap`](crate::store::KeyEnd::Gap) and is opened again after a pause.
async fn listen(
    announcer: Announcer,
    channel: String,
    tx: tokio::sync::broadcast::Sender<crate::store::KeyEnd>,
) {
    use crate::store::KeyEnd;
    use futures_util::StreamExt;
    while tx.receiver_count() > 0 {
        let subscribed = async {
            let mut pubsub = announcer.client().await?.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        }
        .await;
        let pubsub = match subscribed {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "idemflow: cannot SUBSCRIBE for key ends; waiters poll");
                let _ = tx.send(KeyEnd::Gap);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        // Anything published before the SUBSCRIBE took effect was missed.
        let _ = tx.send(KeyEnd::Gap);
        let mut messages = pubsub.into_on_message();
        while let Some(msg) = messages.next().await {
            let Ok(payload) = msg.get_payload::<String>() else {
                continue;
            };
            if let Some(id) = crate::store::ends::parse(&payload) {
                // No receiver left: nobody waits; the next subscriber starts again.
                if tx.send(KeyEnd::Ended(id)).is_err() {
                    return;
                }
            }
        }
        let _ = tx.send(KeyEnd::Gap);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[async_trait]
impl SweeperStore for RedisStore {
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        crate::store::spans::traced(crate::store::spans::take_stale(BACKEND, take), async move {
            let mut out = Vec::new();
            for bucket in self.bucket_order() {
                let left = take.limit as usize - out.len();
                if left == 0 {
                    break;
                }
                let mut inv = self.per_bucket(&SCRIPTS.take_stale, bucket);
                inv.arg(&take.owner)
                    .arg(ms(take.lease))
                    .arg(left)
                    .arg(take.scope.as_deref().map(scope_prefix).unwrap_or_default());
                out.extend(member_records(self.invoke(&inv).await?, "take_stale")?);
            }
            Ok(out)
        })
        .await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        crate::store::spans::traced(crate::store::spans::purge(BACKEND, batch), async move {
            let mut total = 0u64;
            for bucket in self.bucket_order() {
                let left = u64::from(batch) - total;
                if left == 0 {
                    break;
                }
                let mut inv = self.per_bucket(&SCRIPTS.purge, bucket);
                inv.arg(left);
                let n =
                    int(Some(&self.invoke(&inv).await?)).ok_or_else(|| corrupt("purge reply"))?;
                total += u64::try_from(n).map_err(|_| corrupt("purge reply"))?;
            }
            Ok(total)
        })
        .await
    }

    async fn count_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0u64;
        for bucket in 0..self.layout.buckets() {
            let inv = self.per_bucket(&SCRIPTS.count_expired, bucket);
            let n = int(Some(&self.invoke(&inv).await?))
                .ok_or_else(|| corrupt("count_expired reply"))?;
            total += u64::try_from(n).map_err(|_| corrupt("count_expired reply"))?;
        }
        Ok(total)
    }
}

#[async_trait]
impl OperatorStore for RedisStore {
    async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError> {
        let rec = self.record_key(id);
        let raw: Option<Vec<u8>> = self
            .read(|mut con| {
                let rec = rec.clone();
                async move { redis::cmd("GET").arg(rec).query_async(&mut con).await }
            })
            .await?;
        raw.map_or(Ok(Vec::new()), |raw| history_of(&raw))
    }

    /// Per bucket: the counts from the index bands, and the processing keys read page by page
    /// (`stale` and the oldest creation need each key's lease and creation time).
    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut st = Stats::default();
        let mut oldest: Option<i64> = None;
        let mut now = 0i64;
        for bucket in 0..self.layout.buckets() {
            let scan = self.scan_all(bucket).await?;
            st.processing += scan.counts[0];
            st.done += scan.counts[1];
            st.failed_retryable += scan.counts[2];
            st.failed_permanent += scan.counts[3];
            for &(_, lex, cat) in &scan.keys {
                if lex <= scan.now {
                    st.stale += 1;
                }
                oldest = Some(oldest.map_or(cat, |o| o.min(cat)));
            }
            now = now.max(scan.now);
        }
        st.oldest_processing_created_at = oldest.map(|ms| ms_to_time(BACKEND, ms)).transpose()?;
        st.now = ms_to_time(BACKEND, now)?;
        Ok(st)
    }

    /// Per bucket: the processing keys read page by page; the oldest `limit` of those old
    /// enough are then read whole (those finished meanwhile are left out).
    async fn stuck(&self, older_than: Duration, limit: u32) -> Result<Stuck, StoreError> {
        let mut count = 0i64;
        let mut found: Vec<(i64, String, u32)> = Vec::new();
        for bucket in 0..self.layout.buckets() {
            let scan = self.scan_all(bucket).await?;
            let cutoff = scan.now - ms(older_than);
            for (m, _, cat) in scan.keys {
                if cat <= cutoff {
                    count += 1;
                    found.push((cat, m, bucket));
                }
            }
        }
        found.sort();
        let mut oldest = Vec::new();
        for (_, m, bucket) in found.into_iter().take(limit as usize) {
            let (scope, key) =
                unmember(&m).ok_or_else(|| corrupt(format!("index member {m:?}")))?;
            let rec = self.layout.record_prefix(bucket) + &m;
            let raw: Option<Vec<u8>> = self
                .read(|mut con| {
                    let rec = rec.clone();
                    async move { redis::cmd("GET").arg(rec).query_async(&mut con).await }
                })
                .await?;
            if let Some(r) = raw
                .map(|raw| record_of(&scope, &key, &raw))
                .transpose()?
                .flatten()
                && r.state == KeyState::Processing
            {
                oldest.push(r);
            }
        }
        oldest.sort_by(|a: &KeyRecord, b: &KeyRecord| {
            (a.created_at, a.scope.as_str(), a.key.as_str()).cmp(&(
                b.created_at,
                b.scope.as_str(),
                b.key.as_str(),
            ))
        });
        Ok(Stuck { count, oldest })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_claim_has_a_reason_that_parses_back() {
        for t in CLAIMS {
            let reason = t.claim_reason().unwrap();
            assert!(!reason.is_empty());
            assert_eq!(Transition::from_claim_reason(reason), Some(t));
        }
    }

    /// Needs no server: a refused connection and URLs the client refuses, for one server, a
    /// cluster and Sentinel, never show a password in the error's `Display` or `Debug`.
    #[tokio::test]
    async fn connection_errors_never_show_a_password() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        for config in [
            RedisConfig::new(format!("redis://:s3cret@127.0.0.1:{closed}/")),
            RedisConfig::new("redis://:s3cret@127.0.0.1:notaport/"),
            RedisConfig::new("redis://u:s3cret@127.0.0.1:1/?wait_timeout_ms=5"),
            RedisConfig::new(format!(
                "redis://:s3cret@127.0.0.1:{closed}/,redis://:s3cret@127.0.0.1:{closed}/"
            ))
            .cluster(true),
            RedisConfig::new("redis://:s3cret@h:notaport/,redis://:s3cret@h2/").cluster(true),
            RedisConfig::new(format!(
                "redis+sentinel://:s3cret@127.0.0.1:{closed}/m?sentinel_password=s3cret"
            )),
            RedisConfig::new("redis+sentinel://:s3cret@h/?sentinel_password=s3cret"),
        ] {
            let shown = format!("{config:?}");
            let Err(e) = RedisStore::connect_with(config).await else {
                panic!("{shown} connected");
            };
            for text in [e.to_string(), format!("{e:?}"), shown] {
                assert!(!text.contains("s3cret"), "{text}");
            }
        }
    }
}
