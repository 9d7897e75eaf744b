//! The connection pool of the SQL server backends (PostgreSQL, MariaDB/MySQL): how it is sized
//! ([`PoolOptions`]), the first connection that names a failure at once, and the error of an
//! exhausted pool ([`PoolExhausted`]).

use std::str::FromStr;
use std::time::Duration;

use sqlx::pool::PoolOptions as SqlxPoolOptions;
use sqlx::{ConnectOptions, Connection, Database, Pool};

use super::connect_error::{sqlx_cause, within};
use crate::error::StoreError;
use crate::setters::setters;

/// How `PostgresStore::connect_with` and `MySqlStore::connect_with` size their pool.
///
/// Every store call holds one connection for one round trip (a claim, a finish, a read), so the
/// pool bounds how many calls run at once; calls beyond it queue inside the pool, in order, for
/// at most `acquire_timeout`, then fail with [`StoreError::Database`] whose source is
/// [`PoolExhausted`]. Size it to the number of calls you expect in flight per process (each
/// `execute` makes two store calls, not at the same time), and keep the sum over all processes
/// below the server's `max_connections` (less PostgreSQL's reserved slots).
///
/// ```
/// use std::time::Duration;
/// use idemflow::store::PoolOptions;
/// let options = PoolOptions::default()
///     .max_connections(64)
///     .acquire_timeout(Duration::from_secs(2));
/// assert_eq!((options.max_connections, options.min_connections), (64, 0));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolOptions {
    /// Connections at most (default [`Self::DEFAULT_MAX_CONNECTIONS`], 16).
    pub max_connections: u32,
    /// Connections kept open when idle (default 0).
    pub min_connections: u32,
    /// How long a call waits for a free connection before failing, and how long the first
    /// connection may take (default [`Self::DEFAULT_ACQUIRE_TIMEOUT`], 5 s).
    pub acquire_timeout: Duration,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
            min_connections: 0,
            acquire_timeout: Self::DEFAULT_ACQUIRE_TIMEOUT,
        }
    }
}

impl PoolOptions {
    /// Default [`PoolOptions::max_connections`]: 16 (was 32). On the 2-core benchmark machine,
    /// 64 concurrent callers on PostgreSQL got the same throughput from 16 connections as from
    /// 24 and 32, with a lower p99, and MariaDB's did no worse than with 32; 8 lost throughput
    /// (`docs/performance.md`, "Why the gaps", "PostgreSQL"). A server
    /// with more cores may do better with more: raise it with [`PoolOptions::max_connections`].
    pub const DEFAULT_MAX_CONNECTIONS: u32 = 16;

    /// The largest [`PoolOptions::max_connections`] a store accepts: 10,000 (a pool sets aside
    /// room for every connection it may open; PostgreSQL's and MariaDB's own limits are far
    /// below). A larger one is refused with [`StoreError::Config`].
    pub const MAX_CONNECTIONS: u32 = 10_000;

    /// Default [`PoolOptions::acquire_timeout`].
    pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

    setters! {
        /// Connections at most (1 to [`Self::MAX_CONNECTIONS`], checked when the store
        /// connects).
        max_connections(max_connections: u32);

        /// Connections kept open when idle (capped at `max_connections`).
        min_connections(min_connections: u32);

        /// How long a call waits for a free connection before failing.
        acquire_timeout(acquire_timeout: Duration);
    }
}

/// The source of the [`StoreError::Database`] returned when a call got no pool connection
/// within the acquire timeout: every connection stayed busy (`open == max_connections`), or the
/// pool was not full and opening one more did not finish in time (`open < max_connections`:
/// the server was slow to accept it). The message says which.
#[derive(Debug)]
pub struct PoolExhausted {
    /// The pool's size.
    pub max_connections: u32,
    /// How many connections the pool had open when the wait ended.
    pub open: u32,
    /// How long the call waited.
    pub waited: Duration,
}

impl std::fmt::Display for PoolExhausted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (max, open, waited) = (self.max_connections, self.open, self.waited);
        if open >= max {
            write!(
                f,
                "all {max} pool connections stayed busy for {waited:?}; raise \
                 PoolOptions::max_connections (or the acquire timeout), or send fewer concurrent calls"
            )
        } else {
            write!(
                f,
                "no pool connection within {waited:?}: {open} of max_connections {max} were open, \
                 and opening another did not finish in time (the server was slow to accept it); \
                 raise PoolOptions::acquire_timeout, or look at the server's load"
            )
        }
    }
}

/// sqlx's own word for the wait that ran out, as the source of every [`PoolExhausted`] (so a
/// caller walking the source chain, as `StoreError::is_unavailable` does, finds the driver's
/// error).
static POOL_TIMED_OUT: sqlx::Error = sqlx::Error::PoolTimedOut;

impl std::error::Error for PoolExhausted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&POOL_TIMED_OUT)
    }
}

/// A database error of `backend`'s pool `pool`: an acquire that timed out is [`PoolExhausted`].
pub(crate) fn pool_error<DB: Database>(
    backend: &'static str,
    pool: &Pool<DB>,
    e: sqlx::Error,
) -> StoreError {
    let o = pool.options();
    let (max_connections, waited) = (o.get_max_connections(), o.get_acquire_timeout());
    exhausted_or(backend, max_connections, pool.size(), waited, e)
}

fn exhausted_or(
    backend: &'static str,
    max_connections: u32,
    open: u32,
    waited: Duration,
    e: sqlx::Error,
) -> StoreError {
    match e {
        sqlx::Error::PoolTimedOut => StoreError::database(
            backend,
            PoolExhausted {
                max_connections,
                open,
                waited,
            },
        ),
        e => StoreError::database(backend, e),
    }
}

/// Connects a pool sized by `options` to `url` (`database` names the server in errors).
///
/// One connection is made first, within the acquire timeout, so that a server that is down, a
/// wrong password or a missing database is named at once ([`StoreError::Connect`]): a pool would
/// retry until its timeout and report only that it timed out.
pub(crate) async fn connect<DB: Database>(
    backend: &'static str,
    database: &str,
    url: &str,
    options: &PoolOptions,
) -> Result<Pool<DB>, StoreError>
where
    <DB::Connection as Connection>::Options: FromStr<Err = sqlx::Error>,
{
    if options.max_connections == 0 || options.max_connections > PoolOptions::MAX_CONNECTIONS {
        return Err(StoreError::Config(format!(
            "PoolOptions::max_connections must be from 1 to {}, not {}",
            PoolOptions::MAX_CONNECTIONS,
            options.max_connections
        )));
    }
    // Capped as every duration the crate keeps (sqlx adds it to an `Instant`).
    let acquire_timeout = crate::store::kit::capped(options.acquire_timeout);
    let connect = <DB::Connection as Connection>::Options::from_str(url)
        .map_err(|e| StoreError::Config(format!("bad {database} URL: {e}")))?;
    let first = within(backend, url, acquire_timeout, connect.connect(), sqlx_cause).await?;
    let _ = first.close().await;
    SqlxPoolOptions::<DB>::new()
        .max_connections(options.max_connections)
        .min_connections(options.min_connections.min(options.max_connections))
        .acquire_timeout(acquire_timeout)
        .connect_with(connect)
        .await
        // The pool's first connection: none was open yet.
        .map_err(|e| exhausted_or(backend, options.max_connections, 0, acquire_timeout, e))
}

#[cfg(test)]
mod tests {
    use super::PoolExhausted;
    use std::time::Duration;

    #[test]
    fn the_message_tells_a_full_pool_from_a_slow_server() {
        let full = PoolExhausted {
            max_connections: 7,
            open: 7,
            waited: Duration::from_millis(1500),
        };
        assert!(
            full.to_string()
                .starts_with("all 7 pool connections stayed busy"),
            "{full}"
        );
        let slow = PoolExhausted {
            max_connections: 7,
            open: 0,
            waited: Duration::from_millis(1500),
        };
        let msg = slow.to_string();
        assert!(msg.contains("0 of max_connections 7 were open"), "{msg}");
        assert!(msg.contains("slow to accept"), "{msg}");
        assert!(!msg.contains("stayed busy"), "{msg}");
    }
}
