//! A Redis failover that loses acknowledged writes ([`Mode::Failover`](crate::world::Mode)):
//! the primary acknowledges writes a replica has not received yet, dies, and the sentinels
//! promote that replica. What the clients were told since the replica's last sync is gone.
//!
//! Modelled on the schedule's own keys (its store prefix): at one step the replica's copy is
//! taken (every key of the prefix, `DUMP` with its absolute expiry, in one script, so it is one
//! point of the primary's history, as a replica's copy is), and at a later step the promotion
//! puts it back (every key of the prefix deleted and the copy restored, in one script). Every
//! write between the two is lost; actors parked in the middle of a call keep their leases and
//! answers, as clients of a real failover do. `WAIT` (`RedisConfig::wait`) is what
//! narrows this window in production; the simulation takes the window as given and checks what
//! must still hold (`docs/reliability.md`, "A failover that loses acknowledged writes").

/// The replica's copy: (key, `DUMP` payload, absolute expiry in ms or -1).
pub type Copy = Vec<(Vec<u8>, Vec<u8>, i64)>;

#[cfg(feature = "redis")]
pub use on_redis::Replica;

/// Without Redis there is no replica to promote.
#[cfg(not(feature = "redis"))]
#[derive(Debug, Clone)]
pub enum Replica {}

#[cfg(not(feature = "redis"))]
impl Replica {
    pub async fn sync(&self) -> Result<Copy, String> {
        match *self {}
    }
    pub async fn promote(&self, _: &Copy) -> Result<u64, String> {
        match *self {}
    }
}

#[cfg(feature = "redis")]
mod on_redis {
    use super::Copy;
    use redis::aio::MultiplexedConnection;

    const TAKE: &str = r"
local out = {}
for _, k in ipairs(redis.call('KEYS', ARGV[1])) do
    local dump = redis.call('DUMP', k)
    if dump then
        table.insert(out, {k, dump, redis.call('PEXPIRETIME', k)})
    end
end
return out
";

    const PROMOTE: &str = r"
for _, k in ipairs(redis.call('KEYS', ARGV[1])) do
    redis.call('DEL', k)
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local n = 0
for i = 2, #ARGV, 3 do
    local at = tonumber(ARGV[i + 2])
    if at < 0 then
        redis.call('RESTORE', ARGV[i], 0, ARGV[i + 1], 'REPLACE')
        n = n + 1
    elseif at > now_ms then
        redis.call('RESTORE', ARGV[i], at, ARGV[i + 1], 'REPLACE', 'ABSTTL')
        n = n + 1
    end
end
return n
";

    /// The schedule's Redis keys, seen as a primary and the replica that will replace it.
    #[derive(Clone)]
    pub struct Replica {
        con: MultiplexedConnection,
        pattern: String,
    }

    impl std::fmt::Debug for Replica {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Replica")
                .field("pattern", &self.pattern)
                .finish()
        }
    }

    impl Replica {
        /// The keys of `prefix` on the server at `url` (the prefix holds no glob characters:
        /// `conformance::unique` makes it).
        pub async fn connect(url: &str, prefix: &str) -> Result<Self, String> {
            if prefix.contains(['*', '?', '[', ']', '\\']) {
                return Err(format!("prefix {prefix:?} holds a glob character"));
            }
            let client = redis::Client::open(url).map_err(|e| e.to_string())?;
            let con = client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| e.to_string())?;
            Ok(Self {
                con,
                pattern: format!("{prefix}*"),
            })
        }

        /// The replica's copy as of now (one script: one point of the primary's history).
        pub async fn sync(&self) -> Result<Copy, String> {
            let mut con = self.con.clone();
            redis::cmd("EVAL")
                .arg(TAKE)
                .arg(0)
                .arg(&self.pattern)
                .query_async(&mut con)
                .await
                .map_err(|e| format!("replica sync: {e}"))
        }

        /// The promotion: the primary's keys are replaced by the replica's copy (keys whose expiry
        /// has passed stay gone). Returns how many keys the copy put back.
        pub async fn promote(&self, copy: &Copy) -> Result<u64, String> {
            let mut con = self.con.clone();
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(PROMOTE).arg(0).arg(&self.pattern);
            for (k, dump, at) in copy {
                cmd.arg(k.as_slice()).arg(dump.as_slice()).arg(*at);
            }
            cmd.query_async(&mut con)
                .await
                .map_err(|e| format!("promotion: {e}"))
        }
    }
}
