//! Connections kept warm between back-to-back calls of a store (PostgreSQL, MariaDB): a replay
//! is then one round trip, as a hand-written primary-key read is, and a write skips the round
//! trip sqlx adds after it.
//!
//! sqlx pings a connection when a call takes it from the pool and again when the call gives it
//! back (in a task of its own, that the next take of that connection waits for): two round
//! trips around a one-statement read. A call that ran to its end gives its connection to
//! [`Warm`] instead ([`WarmConn::keep`]) and the next call takes it from there.
//!
//! **Reads skip the ping, writes do not.** A kept connection is not pinged by the pool, so one
//! the server or the network closed since its last call fails its next statement while the
//! store is up. A read has no effect, so [`Warm::read`] runs a read that failed once more, on a
//! connection from the pool (which sqlx pings, and replaces when it is dead), whatever the
//! failure and wherever the first connection came from; the caller sees the second attempt's
//! result. A write may not be run twice that way (a connection that died while the statement
//! ran leaves its fate unknown), so claims, finishes, atomic phases and every other write run
//! on a pinged connection ([`Warm::for_write`]): a kept one pinged first, as sqlx pings the
//! connections its pool hands out, or one from the pool. A PostgreSQL write that ran to its end
//! keeps its connection too; MariaDB's give theirs back ([`Warm::new`]; `docs/performance.md`,
//! "Connections and pings").
//!
//! Kept connections go back to the pool after [`HOLD_IDLE`] without a call, and a connection
//! goes back after [`HOLD_MAX`] out of the pool however busy the store is, so that callers
//! waiting in the pool (an application using `pool()`, the operator commands) get their turn:
//! the pool serves its waiters in order. While one of this store's calls waits in the pool, no
//! read takes a kept connection and none is kept. `Pool::close` therefore waits at most about
//! [`HOLD_IDLE`] for the kept ones. The same rule as the SQLite writer's held connection
//! (`store::sqlite::writer`).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Encode, Executor, IntoArguments, Pool, Type};

use crate::KeyId;

/// A kept connection goes back to the pool after this long without a call.
pub(crate) const HOLD_IDLE: Duration = Duration::from_millis(1);

/// A connection goes back to the pool after this long out of it, busy or not.
pub(crate) const HOLD_MAX: Duration = Duration::from_millis(20);

/// The pool and the connections kept out of it (shared by a store's clones).
pub(crate) struct Warm<DB: Database> {
    inner: Arc<Inner<DB>>,
}

impl<DB: Database> Clone for Warm<DB> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<DB: Database> std::fmt::Debug for Warm<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Warm({} kept)", self.inner.held().conns.len())
    }
}

struct Inner<DB: Database> {
    pool: Pool<DB>,
    held: Mutex<Held<DB>>,
    /// This store's reads and writes waiting in `pool.acquire()`.
    waiting: AtomicUsize,
    /// Whether a write that ran to its end keeps its connection ([`WarmConn::keep_write`]).
    keeps_writes: bool,
}

impl<DB: Database> Inner<DB> {
    fn held(&self) -> MutexGuard<'_, Held<DB>> {
        // Nothing panics while holding it; a poisoned lock still holds consistent data.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Held<DB: Database> {
    conns: Vec<Kept<DB>>,
    /// Whether a task is giving idle connections back (it ends when none is kept).
    reaper: bool,
}

struct Kept<DB: Database> {
    conn: PoolConnection<DB>,
    out_since: Instant,
    idle_since: Instant,
}

/// A connection taken for one call: [`WarmConn::keep`] once the call ran to its end; dropped,
/// it goes back to the pool.
pub(crate) struct WarmConn<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    out_since: Instant,
    home: Arc<Inner<DB>>,
}

/// Whether a call about to wait in the pool looks for a kept connection first (a read: as it
/// is; a write: pinged).
#[derive(Clone, Copy)]
enum Look {
    No,
    Kept,
    Pinged,
}

/// Counts a call waiting in the pool, until it got a connection or was dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One run of a read on a connection.
type ReadFuture<'c, T> =
    std::pin::Pin<Box<dyn Future<Output = Result<T, sqlx::Error>> + Send + 'c>>;

impl<DB: Database> Warm<DB> {
    /// `keeps_writes`: whether a write that ran to its end keeps its connection for the next
    /// call (PostgreSQL), or gives it back to the pool (MariaDB/MySQL: no gain measured, and a
    /// CI run under load failed a `take_stale` with `BeginFailed` while they kept it).
    pub(crate) fn new(pool: Pool<DB>, keeps_writes: bool) -> Self {
        Self {
            inner: Arc::new(Inner {
                pool,
                held: Mutex::new(Held {
                    conns: Vec::new(),
                    reaper: false,
                }),
                waiting: AtomicUsize::new(0),
                keeps_writes,
            }),
        }
    }

    /// Runs the read `run` on a kept connection, or one from the pool, and keeps the connection
    /// when the read succeeds. A read that fails runs once more, on a connection from the pool
    /// (module docs); the second attempt's result is the caller's. Errors of the pool itself (an
    /// exhausted pool's timeout, a closed pool) are returned at once.
    async fn read<T, F>(&self, run: F) -> Result<T, sqlx::Error>
    where
        F: for<'c> Fn(&'c mut DB::Connection) -> ReadFuture<'c, T>,
    {
        let mut conn = self.take().await?;
        if let Ok(v) = run(&mut conn).await {
            conn.keep();
            return Ok(v);
        }
        // Back to the pool, which pings it and closes it when it is dead.
        drop(conn);
        let mut conn = self.wait_in_pool(Look::No).await?;
        let v = run(&mut conn).await?;
        conn.keep();
        Ok(v)
    }

    /// The row of key `id` read by `sql` (its two parameters: scope and key), through
    /// [`Self::read`].
    pub(crate) async fn read_key(
        &self,
        sql: &'static str,
        id: &KeyId,
    ) -> Result<Option<DB::Row>, sqlx::Error>
    where
        DB::Arguments: IntoArguments<DB>,
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
        for<'c> &'c str: Encode<'c, DB> + Type<DB>,
    {
        self.read(|conn| {
            Box::pin(
                sqlx::query(sql)
                    .bind(id.scope.as_str())
                    .bind(id.key.as_str())
                    .fetch_optional(conn),
            )
        })
        .await
    }

    /// A connection for a write: a kept one, pinged first (as the pool pings every connection
    /// it hands out, so a write never runs on a connection that died while kept), or one from
    /// the pool. A kept one that fails its ping goes back to the pool, which closes it, and the
    /// write takes the pool's next. Without this, a write that found the pool empty while a
    /// read kept a connection waited until the connection went back after [`HOLD_IDLE`]: 2.1-2.4
    /// ms with a one-connection pool (`docs/performance.md`, "Connections and pings"). The ping
    /// is bounded by the pool's acquire timeout, as the pool's own ping is.
    ///
    /// A PostgreSQL write that ran to its end keeps its connection ([`WarmConn::keep_write`]) for
    /// the next call, as a read does, which saves the ping sqlx makes on every connection given
    /// back to its pool; the next write pings it again here (`docs/performance.md`, "Connections
    /// and pings"). While it waits in the pool it counts as waiting, so no connection is kept
    /// idle beside it.
    pub(crate) async fn for_write(&self) -> Result<WarmConn<DB>, sqlx::Error> {
        if self.inner.waiting.load(Ordering::SeqCst) == 0
            && let Some(conn) = self.pinged_kept().await
        {
            return Ok(conn);
        }
        self.wait_in_pool(Look::Pinged).await
    }

    /// The most recently kept connection, if there is one and it answers a ping within the
    /// pool's acquire timeout; one that does not goes back to the pool (which closes it).
    async fn pinged_kept(&self) -> Option<WarmConn<DB>> {
        let mut conn = self.kept()?;
        let timeout = self.inner.pool.options().get_acquire_timeout();
        match tokio::time::timeout(timeout, sqlx::Connection::ping(&mut *conn)).await {
            Ok(Ok(())) => Some(conn),
            _ => None,
        }
    }

    /// A kept connection, or one from the pool.
    async fn take(&self) -> Result<WarmConn<DB>, sqlx::Error> {
        if self.inner.waiting.load(Ordering::SeqCst) == 0
            && let Some(conn) = self.kept()
        {
            return Ok(conn);
        }
        self.wait_in_pool(Look::Kept).await
    }

    /// A connection from the pool (pinged), counted as waiting while it waits. First, as `look`
    /// says, a connection that a call kept between the caller's first look and this one counting
    /// itself as waiting (rather than this call waiting in the pool beside it).
    async fn wait_in_pool(&self, look: Look) -> Result<WarmConn<DB>, sqlx::Error> {
        let inner = &self.inner;
        inner.waiting.fetch_add(1, Ordering::SeqCst);
        let waiting = Waiting(&inner.waiting);
        let kept = match look {
            Look::No => None,
            Look::Kept => self.kept(),
            Look::Pinged => self.pinged_kept().await,
        };
        if let Some(conn) = kept {
            return Ok(conn);
        }
        let conn = inner.pool.acquire().await;
        drop(waiting);
        Ok(WarmConn {
            conn: Some(conn?),
            out_since: Instant::now(),
            home: inner.clone(),
        })
    }

    /// The most recently kept connection, unless the pool is closed.
    fn kept(&self) -> Option<WarmConn<DB>> {
        if self.inner.pool.is_closed() {
            return None;
        }
        let k = self.inner.held().conns.pop()?;
        Some(WarmConn {
            conn: Some(k.conn),
            out_since: k.out_since,
            home: self.inner.clone(),
        })
    }
}

impl<DB: Database> WarmConn<DB> {
    /// The call on this connection ran to its end: keep the connection for the next call,
    /// unless it has been out of the pool for [`HOLD_MAX`], a call of this store waits in the
    /// pool, the pool is closed, or there is no tokio runtime to give it back later; then it
    /// goes back to the pool now.
    /// A write's connection once the write ran to its end: kept ([`keep`](Self::keep)) where
    /// the store keeps its writes' connections ([`Warm::new`]), else back to the pool.
    pub(crate) fn keep_write(self) {
        if self.home.keeps_writes {
            self.keep();
        }
    }

    pub(crate) fn keep(mut self) {
        let Some(conn) = self.conn.take() else { return };
        let home = &self.home;
        let back_now = home.waiting.load(Ordering::SeqCst) > 0
            || self.out_since.elapsed() >= HOLD_MAX
            || home.pool.is_closed();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return drop(conn);
        };
        if back_now {
            return drop(conn);
        }
        let mut held = home.held();
        held.conns.push(Kept {
            conn,
            out_since: self.out_since,
            idle_since: Instant::now(),
        });
        // A call that began to wait in the pool after the look above: a kept connection goes
        // back to the pool for it (the pool wakes its first waiter), none stays kept idle
        // beside it. (Either this sees its count, or its second look finds the connection.)
        if home.waiting.load(Ordering::SeqCst) > 0 {
            let back = held.conns.pop();
            drop(held);
            drop(back);
            return;
        }
        if !held.reaper {
            held.reaper = true;
            runtime.spawn(give_back(home.clone()));
        }
    }
}

impl<DB: Database> std::ops::Deref for WarmConn<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        // `conn` is taken only by `keep`, which consumes `self`.
        self.conn.as_ref().expect("a taken connection")
    }
}

impl<DB: Database> std::ops::DerefMut for WarmConn<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.conn.as_mut().expect("a taken connection")
    }
}

/// Gives kept connections back to the pool once idle for [`HOLD_IDLE`] or out for
/// [`HOLD_MAX`]; ends when none is kept.
async fn give_back<DB: Database>(inner: Arc<Inner<DB>>) {
    loop {
        tokio::time::sleep(HOLD_IDLE).await;
        let now = Instant::now();
        let closed = inner.pool.is_closed();
        let (back, done) = {
            let mut held = inner.held();
            let (back, kept): (Vec<_>, Vec<_>) = held.conns.drain(..).partition(|k| {
                closed
                    || now.duration_since(k.idle_since) >= HOLD_IDLE
                    || now.duration_since(k.out_since) >= HOLD_MAX
            });
            held.conns = kept;
            let done = held.conns.is_empty();
            if done {
                held.reaper = false;
            }
            (back, done)
        };
        // Back to the pool outside the lock (each drop hands the connection to sqlx's return
        // path, which pings it).
        drop(back);
        if done {
            return;
        }
    }
}
