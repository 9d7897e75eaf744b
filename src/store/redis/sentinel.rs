//! [`SentinelConnection`]: a connection to the primary Redis Sentinel names, found again
//! through the sentinels when it breaks.
//!
//! The redis crate's `ConnectionManager` reconnects to the address its `Client` was built with,
//! so after a failover it would keep knocking on the old primary (or reach it again once it is
//! back as a replica, and fail every write with `READONLY`). This connection keeps the crate's
//! `SentinelClient` instead: when a command fails with the connection (dropped, refused, timed
//! out) or the node answers that it is not a primary (`READONLY`, `MASTERDOWN`), the connection
//! is marked broken, and the next command first asks the sentinels for the primary again (the
//! crate checks the node's `ROLE` before handing it out) and connects to it. The failed command
//! itself is not sent again here: [`RedisStore`](super::RedisStore) decides what is safe to
//! repeat.
//!
//! A failover away from a primary that is still up (`SENTINEL FAILOVER`, or the sentinels
//! failing over a second time from a node that was slow rather than dead) breaks nothing at
//! once: Sentinel leaves the old node a primary, answering every write, until it turns it into a
//! replica about ten seconds later (four publish periods after it sees it report itself a
//! primary) and drops its clients; what was written there in between is lost when it
//! resynchronises. So the connection also asks the sentinels every [`CHECK_INTERVAL`] which
//! primary they name (a task that ends with the last clone), and marks itself broken as soon as
//! they name another than the one it reaches.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ErrorKind, IntoConnectionInfo, Pipeline,
    RedisConnectionInfo, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value,
};

use super::config::SentinelConfig;

/// After a failed lookup, commands within this long fail with its error instead of asking the
/// sentinels again (a failover takes seconds; many callers must not queue up lookups).
const LOOKUP_BACKOFF: Duration = Duration::from_millis(100);

/// How often a connection asks the sentinels which primary they name (see the module docs):
/// the longest a store keeps writing to a primary the sentinels no longer name, while that
/// primary still answers.
pub(crate) const CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// A connection to the primary a Redis Sentinel set names, re-resolved after a failover (see
/// the module docs). Cheap to clone: the clones share one multiplexed connection.
#[derive(Clone)]
pub struct SentinelConnection {
    inner: Arc<Inner>,
}

struct Inner {
    master: String,
    db: i64,
    config: AsyncConnectionConfig,
    /// Bounds one lookup and connection.
    connect_timeout: Duration,
    /// The sentinels; one lookup at a time.
    resolver: tokio::sync::Mutex<Resolver>,
    current: Mutex<Current>,
}

struct Resolver {
    client: SentinelClient,
    /// The last failed lookup: when, and its error.
    failed: Option<(Instant, RedisError)>,
}

struct Current {
    /// Bumped at every new connection.
    generation: u64,
    con: Option<MultiplexedConnection>,
    /// The primary's address, for logs.
    addr: String,
    broken: bool,
}

/// Whether `e` means the connection is gone or the node is no longer the primary.
fn breaks(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
}

impl SentinelConnection {
    /// Asks the sentinels of `sentinel` for the primary and connects to it (at most
    /// `connection_timeout` for each lookup and connection); commands time out after
    /// `response_timeout`.
    pub(crate) async fn connect(
        sentinel: &SentinelConfig,
        response_timeout: Duration,
        connection_timeout: Duration,
    ) -> RedisResult<Self> {
        let addrs = sentinel
            .sentinels
            .iter()
            .map(|(h, p)| ConnectionAddr::Tcp(h.clone(), *p));
        let mut builder =
            SentinelClientBuilder::new(addrs, &sentinel.master, SentinelServerType::Master)?
                .set_client_to_redis_db(sentinel.db);
        if let Some(u) = &sentinel.username {
            builder = builder.set_client_to_redis_username(u);
        }
        if let Some(p) = &sentinel.password {
            builder = builder.set_client_to_redis_password(p);
        }
        if let Some(u) = &sentinel.sentinel_username {
            builder = builder.set_client_to_sentinel_username(u);
        }
        if let Some(p) = &sentinel.sentinel_password {
            builder = builder.set_client_to_sentinel_password(p);
        }
        let client = builder.build()?;
        let con = Self {
            inner: Arc::new(Inner {
                master: sentinel.master.clone(),
                db: sentinel.db,
                config: AsyncConnectionConfig::new()
                    .set_response_timeout(Some(response_timeout))
                    .set_connection_timeout(Some(connection_timeout)),
                connect_timeout: connection_timeout,
                resolver: tokio::sync::Mutex::new(Resolver {
                    client,
                    failed: None,
                }),
                current: Mutex::new(Current {
                    generation: 0,
                    con: None,
                    addr: String::new(),
                    broken: true,
                }),
            }),
        };
        con.resolve(0, false).await?;
        let watch = Watch::new(sentinel, connection_timeout)?;
        tokio::spawn(watch.run(Arc::downgrade(&con.inner)));
        Ok(con)
    }

    /// The master name this connection follows.
    pub fn master(&self) -> &str {
        &self.inner.master
    }

    /// The primary's address this connection reaches now (`host:port`), or the last one it
    /// reached if its connection is broken.
    pub fn primary(&self) -> String {
        self.current().addr.clone()
    }

    /// A client for the primary the sentinels name now (for a connection of another kind, such
    /// as a subscription).
    pub(crate) async fn primary_client(&self) -> RedisResult<redis::Client> {
        let mut resolver = self.inner.resolver.lock().await;
        tokio::time::timeout(
            self.inner.connect_timeout,
            resolver.client.async_get_client(),
        )
        .await
        .unwrap_or_else(|_| {
            Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no primary for {:?} found through Sentinel",
                    self.inner.master
                ),
            )))
        })
    }

    /// How many times this connection has connected to a primary (1 after `connect`; each
    /// reconnection after a break adds one).
    pub fn connections(&self) -> u64 {
        self.current().generation
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Current> {
        // A panic while holding this lock cannot leave `Current` half-written (every write is
        // one assignment), so a poisoned lock is still usable.
        self.inner
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The live connection and its generation; resolves the primary first when it is broken.
    async fn connection(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        let seen = {
            let cur = self.current();
            if !cur.broken
                && let Some(con) = &cur.con
            {
                return Ok((cur.generation, con.clone()));
            }
            cur.generation
        };
        self.resolve(seen, true).await
    }

    /// Asks the sentinels for the primary and connects to it, unless another caller already
    /// replaced generation `seen`, or (with `backoff`) a lookup failed moments ago.
    async fn resolve(&self, seen: u64, backoff: bool) -> RedisResult<(u64, MultiplexedConnection)> {
        let mut resolver = self.inner.resolver.lock().await;
        {
            let cur = self.current();
            if cur.generation != seen
                && !cur.broken
                && let Some(con) = &cur.con
            {
                return Ok((cur.generation, con.clone()));
            }
        }
        if backoff
            && let Some((at, e)) = &resolver.failed
            && at.elapsed() < LOOKUP_BACKOFF
        {
            return Err(e.clone());
        }
        let lookup = async {
            let client = resolver.client.async_get_client().await?;
            let addr = client.get_connection_info().addr().to_string();
            let con = client
                .get_multiplexed_async_connection_with_config(&self.inner.config)
                .await?;
            Ok::<_, RedisError>((addr, con))
        };
        let found = match tokio::time::timeout(self.inner.connect_timeout, lookup).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no primary for {:?} found through Sentinel within {:?}",
                    self.inner.master, self.inner.connect_timeout
                ),
            ))),
        };
        match found {
            Ok((addr, con)) => {
                resolver.failed = None;
                let mut cur = self.current();
                cur.generation += 1;
                cur.con = Some(con.clone());
                cur.broken = false;
                if cur.addr != addr {
                    tracing::info!(master = %self.inner.master, primary = %addr, previous = %cur.addr, "connected to the primary named by Redis Sentinel");
                }
                cur.addr = addr;
                Ok((cur.generation, con))
            }
            Err(e) => {
                tracing::warn!(master = %self.inner.master, error = %e, "no Redis primary found through Sentinel");
                resolver.failed = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Marks the connection broken if it reaches another primary than `named` (`host:port`),
    /// the one the sentinels name: the next command asks them again.
    fn follow(&self, named: &str) {
        let mut cur = self.current();
        if !cur.broken && cur.addr != named {
            tracing::warn!(master = %self.inner.master, primary = %cur.addr, named = %named, "the sentinels name another Redis primary; asking Sentinel again");
            cur.broken = true;
        }
    }

    /// Marks generation `generation` broken after `e`, if `e` says so.
    fn check(&self, generation: u64, e: &RedisError) {
        if breaks(e) {
            let mut cur = self.current();
            if cur.generation == generation && !cur.broken {
                tracing::warn!(master = %self.inner.master, primary = %cur.addr, error = %e, "connection to the Redis primary broke; asking Sentinel again");
                cur.broken = true;
            }
        }
    }
}

/// Asks the sentinels, every [`CHECK_INTERVAL`], which primary they name, and has the
/// connection follow it ([`SentinelConnection::follow`]).
struct Watch {
    master: String,
    /// The sentinels, in the configured order, with their credentials.
    sentinels: Vec<redis::Client>,
    /// A connection to each sentinel asked so far, kept while it works.
    cons: Vec<Option<MultiplexedConnection>>,
    config: AsyncConnectionConfig,
    /// Bounds one question to one sentinel.
    timeout: Duration,
}

impl Watch {
    fn new(sentinel: &SentinelConfig, timeout: Duration) -> RedisResult<Self> {
        let mut auth = RedisConnectionInfo::default();
        if let Some(u) = &sentinel.sentinel_username {
            auth = auth.set_username(u);
        }
        if let Some(p) = &sentinel.sentinel_password {
            auth = auth.set_password(p);
        }
        let sentinels = sentinel
            .sentinels
            .iter()
            .map(|(h, p)| {
                let info = ConnectionAddr::Tcp(h.clone(), *p)
                    .into_connection_info()?
                    .set_redis_settings(auth.clone());
                redis::Client::open(info)
            })
            .collect::<RedisResult<Vec<_>>>()?;
        Ok(Self {
            master: sentinel.master.clone(),
            cons: vec![None; sentinels.len()],
            sentinels,
            config: AsyncConnectionConfig::new()
                .set_response_timeout(Some(timeout))
                .set_connection_timeout(Some(timeout)),
            timeout,
        })
    }

    /// Runs until the connection is dropped.
    async fn run(mut self, con: Weak<Inner>) {
        let mut tick = tokio::time::interval(CHECK_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is at once: the connection was just resolved.
        tick.tick().await;
        loop {
            tick.tick().await;
            if con.strong_count() == 0 {
                return;
            }
            let named = self.named().await;
            let Some(inner) = con.upgrade() else {
                return;
            };
            if let Some(named) = named {
                SentinelConnection { inner }.follow(&named);
            }
        }
    }

    /// The primary (`host:port`) the first sentinel that answers names, as the crate chooses
    /// (asked in order; a sentinel that sees the primary down or knows no such master is
    /// passed over); `None` when no sentinel names one.
    async fn named(&mut self) -> Option<String> {
        for i in 0..self.sentinels.len() {
            let asked = tokio::time::timeout(self.timeout, self.ask(i)).await;
            match asked {
                Ok(Ok(Some(addr))) => return Some(addr),
                Ok(Ok(None)) => {}
                Ok(Err(e)) => {
                    tracing::debug!(master = %self.master, sentinel = i, error = %e, "a sentinel did not say which primary it names");
                    self.cons[i] = None;
                }
                Err(_) => self.cons[i] = None,
            }
        }
        None
    }

    /// What sentinel `i` names as the primary, if it sees one up.
    async fn ask(&mut self, i: usize) -> RedisResult<Option<String>> {
        let mut con = match &self.cons[i] {
            Some(con) => con.clone(),
            None => {
                let con = self.sentinels[i]
                    .get_multiplexed_async_connection_with_config(&self.config)
                    .await?;
                self.cons[i] = Some(con.clone());
                con
            }
        };
        let answer: RedisResult<HashMap<String, String>> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(&self.master)
            .query_async(&mut con)
            .await;
        match answer {
            Ok(fields) => Ok(primary_up(&fields)),
            // "No such master with that name": this sentinel does not monitor it (yet).
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// The primary's `host:port` in a sentinel's `SENTINEL MASTER` fields, if the sentinel sees it
/// up (the crate's test: flagged `master`, neither `s_down` nor `o_down`).
fn primary_up(fields: &HashMap<String, String>) -> Option<String> {
    let flags = fields.get("flags")?;
    if !flags.split(',').any(|f| f == "master")
        || flags.contains("s_down")
        || flags.contains("o_down")
    {
        return None;
    }
    let ip = fields.get("ip")?;
    let port: u16 = fields.get("port")?.parse().ok()?;
    Some(format!("{ip}:{port}"))
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut con) = self.connection().await?;
            let r = con.req_packed_command(cmd).await;
            if let Err(e) = &r {
                self.check(generation, e);
            }
            r
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut con) = self.connection().await?;
            let r = con.req_packed_commands(cmd, offset, count).await;
            match &r {
                Err(e) => self.check(generation, e),
                // With `ignore_errors`, a server error comes back as a value.
                Ok(values) => {
                    for v in values {
                        if let Value::ServerError(se) = v
                            && matches!(
                                se.kind(),
                                Some(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
                            )
                        {
                            self.check(generation, &RedisError::from(se.clone()));
                        }
                    }
                }
            }
            r
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.db
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(flags: &str) -> HashMap<String, String> {
        [("ip", "10.0.0.2"), ("port", "6380"), ("flags", flags)]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    #[test]
    fn only_a_primary_the_sentinel_sees_up_is_named() {
        assert_eq!(
            primary_up(&fields("master")).as_deref(),
            Some("10.0.0.2:6380")
        );
        assert_eq!(
            primary_up(&fields("master,failover_in_progress")).as_deref(),
            Some("10.0.0.2:6380")
        );
        for flags in [
            "master,s_down",
            "master,s_down,o_down",
            "slave",
            "disconnected",
        ] {
            assert_eq!(primary_up(&fields(flags)), None, "{flags}");
        }
        let mut no_port = fields("master");
        no_port.remove("port");
        assert_eq!(primary_up(&no_port), None);
    }
}
