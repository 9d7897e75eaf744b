//! Connections kept warm between back-to-back store calls (PostgreSQL).
//!
//! sqlx pings every connection given back to its pool (a round trip to the server, in a task of
//! its own, that the next acquire of that connection waits for), to clean up after a call that
//! was cut off mid-statement. A store call that ran to its end leaves nothing to clean up, so
//! the hot paths (the claim, the read of a key, the finish) give their connection to [`Warm`]
//! instead ([`WarmConn::keep`]) and the next call takes it from there without that round trip.
//! A call that failed, or whose future was dropped, gives its connection back to the pool as
//! before (sqlx then pings and, if needed, replaces it).
//!
//! Kept connections go back to the pool after [`HOLD_IDLE`] without a call, and a connection
//! goes back after [`HOLD_MAX`] out of the pool however busy the store is, so that callers
//! waiting in the pool (the sweeper's transactions, an application using `pool()`) get their
//! turn: the pool serves its waiters in order. While one of this store's own calls waits in the
//! pool, no call takes a kept connection and none is kept: the pool's order decides.
//! `Pool::close` therefore waits at most about [`HOLD_IDLE`] for the kept ones.
//!
//! The same rule as the SQLite writer's held connection (`store::sqlite::writer`), measured in
//! `docs/performance.md`, "Connections kept between calls".

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

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
    /// This store's calls waiting in `pool.acquire()`.
    waiting: AtomicUsize,
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

/// A connection taken for one store call: [`WarmConn::keep`] once the call ran to its end;
/// dropped, it goes back to the pool.
pub(crate) struct WarmConn<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    out_since: Instant,
    home: Arc<Inner<DB>>,
}

/// Counts a call waiting in the pool, until it got a connection or was dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<DB: Database> Warm<DB> {
    pub(crate) fn new(pool: Pool<DB>) -> Self {
        Self {
            inner: Arc::new(Inner {
                pool,
                held: Mutex::new(Held {
                    conns: Vec::new(),
                    reaper: false,
                }),
                waiting: AtomicUsize::new(0),
            }),
        }
    }

    /// A kept connection, or one from the pool (with the pool's errors: an exhausted pool's
    /// timeout, a closed pool).
    pub(crate) async fn take(&self) -> Result<WarmConn<DB>, sqlx::Error> {
        let inner = &self.inner;
        if inner.waiting.load(Ordering::SeqCst) == 0
            && let Some(conn) = self.kept()
        {
            return Ok(conn);
        }
        inner.waiting.fetch_add(1, Ordering::SeqCst);
        let waiting = Waiting(&inner.waiting);
        // A `keep` that looked before this call counted itself may have kept its connection
        // meanwhile: take it rather than wait in the pool beside it.
        if let Some(conn) = self.kept() {
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
}

impl<DB: Database> Warm<DB> {
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
    pub(crate) fn keep(mut self) {
        let Some(conn) = self.conn.take() else { return };
        let home = &self.home;
        let runtime = tokio::runtime::Handle::try_current();
        let back_now = home.waiting.load(Ordering::SeqCst) > 0
            || self.out_since.elapsed() >= HOLD_MAX
            || home.pool.is_closed();
        let Ok(runtime) = runtime else {
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
