//! [`RedisConfig`]: the options of [`RedisStore::connect_with`](super::RedisStore::connect_with).

use std::fmt;
use std::time::Duration;

use crate::error::StoreError;
use crate::setters::setters;
use crate::store::connect_error::{RedactedUrl, masked};

/// The scheme of a URL that names a primary through Redis Sentinel (see [`SentinelConfig::parse_url`]).
pub const SENTINEL_SCHEME: &str = "redis+sentinel";

/// The port of a sentinel address given without one.
pub const DEFAULT_SENTINEL_PORT: u16 = 26379;

/// Where the store finds its primary when it connects through Redis Sentinel
/// ([`RedisConfig::sentinel`]): the master name the sentinels monitor, the sentinels' addresses,
/// and the database and credentials of the data nodes. The store asks the sentinels for the
/// primary when it connects and again whenever its connection to the primary breaks, the node
/// it reaches is no longer a primary, or the sentinels name another primary (it asks them every
/// half second), so a failover needs no restart.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelConfig {
    /// The master name the sentinels monitor (`sentinel monitor <name> ...`).
    pub master: String,
    /// The sentinels' addresses, `(host, port)`; asked in this order.
    pub sentinels: Vec<(String, u16)>,
    /// The database number on the data nodes (default 0).
    pub db: i64,
    /// The user name on the data nodes (ACL), if any. The sentinels are asked without
    /// credentials.
    pub username: Option<String>,
    /// The password on the data nodes, if any.
    pub password: Option<String>,
    /// The user name on the sentinels (ACL), if any.
    pub sentinel_username: Option<String>,
    /// The password on the sentinels (their `requirepass`), if any.
    pub sentinel_password: Option<String>,
}

/// The passwords (the data nodes' and the sentinels') show as `***`.
impl fmt::Debug for SentinelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            master,
            sentinels,
            db,
            username,
            password,
            sentinel_username,
            sentinel_password,
        } = self;
        f.debug_struct("SentinelConfig")
            .field("master", master)
            .field("sentinels", sentinels)
            .field("db", db)
            .field("username", username)
            .field("password", &masked(password))
            .field("sentinel_username", sentinel_username)
            .field("sentinel_password", &masked(sentinel_password))
            .finish()
    }
}

impl SentinelConfig {
    /// The primary named `master`, found through the sentinels at `sentinels` (`(host, port)`),
    /// database 0, no credentials. An empty name or an empty list is refused when the store
    /// connects ([`StoreError::Config`]).
    pub fn new<H: Into<String>>(
        master: impl Into<String>,
        sentinels: impl IntoIterator<Item = (H, u16)>,
    ) -> Self {
        Self {
            master: master.into(),
            sentinels: sentinels.into_iter().map(|(h, p)| (h.into(), p)).collect(),
            db: 0,
            username: None,
            password: None,
            sentinel_username: None,
            sentinel_password: None,
        }
    }

    setters! {
        /// Sets the database number on the data nodes.
        db(db: i64);

        /// Sets the user name on the data nodes.
        username(username: Option<String>);

        /// Sets the password on the data nodes.
        password(password: Option<String>);

        /// Sets the user name on the sentinels.
        sentinel_username(sentinel_username: Option<String>);

        /// Sets the password on the sentinels (a sentinel with `requirepass`).
        sentinel_password(sentinel_password: Option<String>);
    }

    /// Parses a Sentinel URL, the form of the Python `redis-sentinel-url` package (also
    /// accepted by Prefect and docket):
    ///
    /// `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db][?wait_replicas=N[&wait_timeout_ms=T][&sentinel_username=U][&sentinel_password=P]]`
    ///
    /// A sentinel without a port is on 26379. The credentials before `@` (percent-encoded) are
    /// the data nodes'; `sentinel_username` and `sentinel_password` (percent-encoded) are the
    /// sentinels' own, for sentinels with `requirepass` or ACL users (both are hidden in error
    /// messages and in `Debug`). `wait_replicas` and `wait_timeout_ms` set
    /// [`RedisConfig::wait`] (returned beside). Anything missing or malformed (no sentinel, no master name, a bad port or
    /// database, an unknown parameter) is a [`StoreError::Config`] that says what.
    ///
    /// ```
    /// use idemflow::store::redis::SentinelConfig;
    /// let (s, wait) = SentinelConfig::parse_url(
    ///     "redis+sentinel://:pw@10.0.0.1,10.0.0.2:26380/mymaster/2?wait_replicas=1",
    /// )?;
    /// assert_eq!(s.master, "mymaster");
    /// assert_eq!(s.sentinels, [("10.0.0.1".to_owned(), 26379), ("10.0.0.2".to_owned(), 26380)]);
    /// assert_eq!((s.db, s.password.as_deref()), (2, Some("pw")));
    /// assert_eq!(wait.map(|w| w.replicas), Some(1));
    /// assert!(SentinelConfig::parse_url("redis+sentinel://10.0.0.1/").is_err());
    /// # Ok::<(), idemflow::StoreError>(())
    /// ```
    pub fn parse_url(url: &str) -> Result<(Self, Option<WaitReplicas>), StoreError> {
        let bad = |why: &str| {
            StoreError::Config(format!(
                "bad Redis Sentinel URL {}: {why} (expected {SENTINEL_SCHEME}://[[user]:password@]host[:port][,host[:port]...]/master[/db])",
                crate::store::connect_error::redact_url(url)
            ))
        };
        let rest = url
            .strip_prefix(SENTINEL_SCHEME)
            .and_then(|r| r.strip_prefix("://"))
            .ok_or_else(|| bad(&format!("the scheme is not {SENTINEL_SCHEME}://")))?;
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (mut username, mut password) = (None, None);
        if let Some(u) = userinfo {
            let (user, pass) = match u.split_once(':') {
                Some((user, pass)) => (user, Some(pass)),
                None => (u, None),
            };
            let decode = |s: &str| percent_decode(s).ok_or_else(|| bad("bad percent-encoding"));
            if !user.is_empty() {
                username = Some(decode(user)?);
            }
            if let Some(p) = pass.filter(|p| !p.is_empty()) {
                password = Some(decode(p)?);
            }
        }
        let mut sentinels = Vec::new();
        for host in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
            sentinels.push(
                host_port(host).ok_or_else(|| bad(&format!("bad sentinel address {host:?}")))?,
            );
        }
        if sentinels.is_empty() {
            return Err(bad("no sentinel address"));
        }
        let mut parts = path.split('/');
        let master = parts.next().unwrap_or_default();
        if master.is_empty() {
            return Err(bad("no master name"));
        }
        let master = percent_decode(master).ok_or_else(|| bad("bad percent-encoding"))?;
        let db = match parts.next() {
            None | Some("") => 0,
            Some(db) => db
                .parse::<i64>()
                .ok()
                .filter(|d| *d >= 0)
                .ok_or_else(|| bad(&format!("bad database number {db:?}")))?,
        };
        if parts.any(|p| !p.is_empty()) {
            return Err(bad("more path segments than master and database"));
        }
        let (mut sentinel_username, mut sentinel_password) = (None, None);
        let wait = match query {
            None => None,
            Some(q) => {
                let (wait, rest) = take_wait_params(q).map_err(|why| bad(&why))?;
                for pair in rest {
                    let decode =
                        |s: &str| percent_decode(s).ok_or_else(|| bad("bad percent-encoding"));
                    match pair.split_once('=') {
                        Some(("sentinel_username", v)) if !v.is_empty() => {
                            sentinel_username = Some(decode(v)?);
                        }
                        Some(("sentinel_password", v)) if !v.is_empty() => {
                            sentinel_password = Some(decode(v)?);
                        }
                        _ => {
                            let name = pair.split_once('=').map_or(pair, |(k, _)| k);
                            return Err(bad(&format!("unknown parameter {name:?}")));
                        }
                    }
                }
                wait
            }
        };
        Ok((
            Self {
                master,
                sentinels,
                db,
                username,
                password,
                sentinel_username,
                sentinel_password,
            },
            wait,
        ))
    }
}

/// `host[:port]` or `[v6]:port`; the port defaults to [`DEFAULT_SENTINEL_PORT`].
fn host_port(s: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(v6) = s.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        match after {
            "" => (host, None),
            p => (host, Some(p.strip_prefix(':')?)),
        }
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    if host.is_empty() || host.contains(['/', '@', ' ']) {
        return None;
    }
    let port = match port {
        None => DEFAULT_SENTINEL_PORT,
        Some(p) => p.parse().ok().filter(|p| *p != 0)?,
    };
    Some((host.to_owned(), port))
}

/// Decodes `%XX` escapes; `None` for a malformed escape or a result that is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Splits `wait_replicas` and `wait_timeout_ms` out of a query string; returns the
/// [`WaitReplicas`] they set and the other parameters, in order.
pub(crate) fn take_wait_params(query: &str) -> Result<(Option<WaitReplicas>, Vec<&str>), String> {
    let (mut replicas, mut timeout, mut rest) = (None, None, Vec::new());
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("wait_replicas", v)) => {
                replicas = Some(
                    v.parse::<u32>()
                        .map_err(|_| format!("wait_replicas={v:?} is not a number of replicas"))?,
                );
            }
            Some(("wait_timeout_ms", v)) => {
                timeout = Some(
                    v.parse::<u64>()
                        .ok()
                        .filter(|t| *t > 0)
                        .map(Duration::from_millis)
                        .ok_or_else(|| {
                            format!(
                                "wait_timeout_ms={v:?} is not a positive number of milliseconds"
                            )
                        })?,
                );
            }
            _ => rest.push(pair),
        }
    }
    match (replicas, timeout) {
        (None, None) => Ok((None, rest)),
        (None, Some(_)) => Err("wait_timeout_ms without wait_replicas".to_owned()),
        (Some(replicas), t) => Ok((
            Some(WaitReplicas {
                replicas,
                timeout: t.unwrap_or(WaitReplicas::DEFAULT_TIMEOUT),
            }),
            rest,
        )),
    }
}

/// `WAIT numreplicas timeout` after every claim and finish ([`RedisConfig::wait`]): the store
/// asks the primary to confirm that at least `replicas` replicas hold the write, waiting at most
/// `timeout`. A claim confirmed by fewer fails with
/// [`StoreError::NotReplicated`] before the caller sends anything to a provider; a finish
/// confirmed by fewer is reported with the same error (the answer is on the primary, and may
/// be lost with it). `WAIT` makes a loss less likely, not impossible: Sentinel may promote a
/// replica that had not acknowledged (see `docs/backends.md`, "Redis Sentinel").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitReplicas {
    /// How many replicas must acknowledge the write.
    pub replicas: u32,
    /// How long the primary waits for them (never zero: `WAIT` with 0 would wait forever).
    pub timeout: Duration,
}

impl WaitReplicas {
    /// The timeout when a URL gives `wait_replicas` alone: 1 s.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
}

/// Options for [`RedisStore::connect_with`](super::RedisStore::connect_with).
///
/// Its `Debug` masks the passwords: the URL's (user info and `sentinel_password`, see
/// [`redact_url`](crate::store::connect_error::redact_url)) and those of
/// [`sentinel`](Self::sentinel).
#[derive(Clone)]
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
    /// extra round trip. At most 16,777,216 slots (128 MiB): a larger number is taken as that.
    pub known_keys: usize,
    /// Timeout of one connection attempt (default 2 s).
    pub connection_timeout: Duration,
    /// Connect through Redis Sentinel (default `None`; a `redis+sentinel://` [`url`](Self::url)
    /// sets it when the store connects). The `url` is then only shown in errors.
    pub sentinel: Option<SentinelConfig>,
    /// `WAIT` for replicas after every claim and finish (default `None`: no `WAIT`; a URL's
    /// `wait_replicas` / `wait_timeout_ms` parameters set it when this is `None`).
    pub wait: Option<WaitReplicas>,
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            url,
            cluster,
            prefix,
            buckets,
            history_cap,
            history_ttl,
            expiry_grace,
            response_timeout,
            known_keys,
            connection_timeout,
            sentinel,
            wait,
        } = self;
        f.debug_struct("RedisConfig")
            .field("url", &RedactedUrl(url))
            .field("cluster", cluster)
            .field("prefix", prefix)
            .field("buckets", buckets)
            .field("history_cap", history_cap)
            .field("history_ttl", history_ttl)
            .field("expiry_grace", expiry_grace)
            .field("response_timeout", response_timeout)
            .field("known_keys", known_keys)
            .field("connection_timeout", connection_timeout)
            .field("sentinel", sentinel)
            .field("wait", wait)
            .finish()
    }
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
            sentinel: None,
            wait: None,
        }
    }

    /// Connects through Redis Sentinel: the store asks `sentinel`'s sentinels for the primary,
    /// and asks again after a failover (see [`SentinelConfig`]).
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemflow::StoreError> {
    /// use std::time::Duration;
    /// use idemflow::store::redis::{RedisConfig, RedisStore, SentinelConfig};
    /// let sentinels = [("10.0.0.1", 26379), ("10.0.0.2", 26379), ("10.0.0.3", 26379)];
    /// let config = RedisConfig::new("redis+sentinel://10.0.0.1,10.0.0.2,10.0.0.3/mymaster")
    ///     .sentinel(SentinelConfig::new("mymaster", sentinels))
    ///     .wait(1, Duration::from_millis(500));
    /// let store = RedisStore::connect_with(config).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn sentinel(mut self, sentinel: SentinelConfig) -> Self {
        self.sentinel = Some(sentinel);
        self
    }

    /// `WAIT replicas timeout` after every claim and finish (see [`WaitReplicas`]). A zero
    /// `timeout` is refused when the store connects.
    pub fn wait(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = Some(WaitReplicas { replicas, timeout });
        self
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_parse_with_defaults_credentials_and_ipv6() {
        let (s, wait) =
            SentinelConfig::parse_url("redis+sentinel://app:p%40ss@[::1]:26380,h2/my%2Dmaster/3")
                .unwrap();
        assert_eq!(s.master, "my-master");
        assert_eq!(
            s.sentinels,
            [
                ("::1".to_owned(), 26380),
                ("h2".to_owned(), DEFAULT_SENTINEL_PORT)
            ]
        );
        assert_eq!(s.db, 3);
        assert_eq!(s.username.as_deref(), Some("app"));
        assert_eq!(s.password.as_deref(), Some("p@ss"));
        assert_eq!(wait, None);
        assert!(!format!("{s:?}").contains("p@ss"));
        let (_, wait) =
            SentinelConfig::parse_url("redis+sentinel://h/m?wait_replicas=2&wait_timeout_ms=250")
                .unwrap();
        assert_eq!(
            wait,
            Some(WaitReplicas {
                replicas: 2,
                timeout: Duration::from_millis(250)
            })
        );
    }

    #[test]
    fn debug_masks_every_password() {
        let url = "redis+sentinel://app:data-pw@h1,h2/m?sentinel_password=sentinel-pw";
        let (sentinel, _) = SentinelConfig::parse_url(url).unwrap();
        let config = RedisConfig::new(url).sentinel(sentinel);
        let shown = format!("{config:?}");
        assert!(!shown.contains("data-pw"), "{shown}");
        assert!(!shown.contains("sentinel-pw"), "{shown}");
        assert!(shown.contains("app:***@h1,h2"), "{shown}");
        let cluster =
            RedisConfig::new("redis://:pw-a@h1:7000/,redis://:pw-b@h2:7000/").cluster(true);
        let shown = format!("{cluster:?} {cluster:#?}");
        assert!(
            !shown.contains("pw-a") && !shown.contains("pw-b"),
            "{shown}"
        );
    }

    #[test]
    fn wait_parameters_are_split_from_the_others() {
        let (wait, rest) = take_wait_params("protocol=resp3&wait_replicas=1").unwrap();
        assert_eq!(
            wait,
            Some(WaitReplicas {
                replicas: 1,
                timeout: WaitReplicas::DEFAULT_TIMEOUT
            })
        );
        assert_eq!(rest, ["protocol=resp3"]);
        assert_eq!(take_wait_params("a=1").unwrap(), (None, vec!["a=1"]));
        assert!(take_wait_params("wait_timeout_ms=10").is_err());
        assert!(take_wait_params("wait_replicas=-1").is_err());
        assert!(take_wait_params("wait_replicas=1&wait_timeout_ms=0").is_err());
    }

    #[test]
    fn bad_addresses_are_refused() {
        for bad in ["", ":1", "[::1", "[::1]x", "h:0", "h:70000", "h:x", "a b"] {
            assert_eq!(host_port(bad), None, "{bad:?}");
        }
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%ff"), None);
    }
}
