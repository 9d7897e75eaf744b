//! Waiting for the in-flight answer ([`Idempotency::wait_in_flight`]): a duplicate that finds
//! its key's first attempt still running waits, bounded, for that attempt's answer instead of
//! taking a 409 at once.
//!
//! - **Woken, not spinning.** Every finish, failure or release this process writes through an
//!   executor wakes the duplicates waiting on that key in this process at once (the
//!   [`Watchers`] registry). For a first attempt in another process (or settled by a sweeper),
//!   one waiter per key and process (the poller) stands watch; the others wait for its signal.
//!   On a store that announces ends ([`Store::key_ends`]: PostgreSQL `LISTEN/NOTIFY`, Redis
//!   pub/sub) the poller subscribes, asks the store to announce the key's end
//!   ([`Store::announce_end`]), reads the key once more (an end between its last read and the
//!   announcement is then seen), and from then on is woken by the announcement; it still reads
//!   the key every second or so, doubling up to 5 s, in case an announcement was lost. On any
//!   other store (SQLite across processes, MariaDB) the poller reads the key after a backoff that
//!   starts at 10 ms and doubles up to 250 ms. Both backoffs have up to a quarter of jitter.
//!   When the poller leaves (it read the answer, reached its bound, or its caller went away) it
//!   signals the others: they read the key, and one of them stands watch from then on. So a key
//!   costs at most about four reads a second per process however many wait on it, and less than
//!   one where the store announces ends.
//! - **Holding nothing.** A waiter holds no database connection and no lease between its reads;
//!   each read is the claim a retry would send (so a first attempt that failed retryable is
//!   re-run by the waiter that claims it, exactly as a client's retry would).
//! - **Bounded.** At most [`ExecutorConfig::max_in_flight_waiters`] waiters per executor (its
//!   clones included); the excess get the 409 at once. A waiter whose caller goes away (its
//!   future dropped) leaves at once.
//!
//! [`Idempotency::wait_in_flight`]: super::Idempotency::wait_in_flight
//! [`ExecutorConfig::max_in_flight_waiters`]: super::ExecutorConfig::max_in_flight_waiters

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::ExecutorConfig;
use crate::KeyId;
use crate::error::Error;
use crate::store::{KeyEnd, Store};

/// The first backoff between two reads of a key a waiter cannot be woken for.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
/// The longest backoff.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// The first backoff of a poller the store wakes by announcement (a safety net for a lost one).
const ANNOUNCED_FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Its longest backoff.
const ANNOUNCED_MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Which store a key lives in, as the registry tells stores apart: the address of the shared
/// store object (every clone of an executor, and every executor made from the same
/// `Arc<dyn Store>`, shares it).
fn store_identity(store: &Arc<dyn Store>) -> usize {
    Arc::as_ptr(store).cast::<()>() as usize
}

type WatchKey = (usize, KeyId);

/// What a key's finish signals to the duplicates waiting on it: a count of finishes (so a
/// waiter sees one that came while it was reading) and the [`Notify`] that wakes them.
#[derive(Default)]
struct KeySignal {
    finishes: AtomicU64,
    notify: Notify,
    /// Whether one of the waiters on the key reads it on a backoff (the others wait for a
    /// signal: at most one poller per key and process).
    polling: AtomicBool,
}

impl KeySignal {
    /// Wakes every waiter on the key to read it now.
    fn signal(&self) {
        self.finishes.fetch_add(1, Ordering::AcqRel);
        self.notify.notify_waiters();
    }
}

/// Each watched key's signal, with the number of [`Watch`]es on it (changed only under the map's
/// lock, so the last one to leave removes the entry: a count of `Arc` references would also
/// count references not yet released by a waiter leaving at the same moment).
type WatchMap = HashMap<WatchKey, (usize, Arc<KeySignal>)>;

/// The keys duplicates wait on in this process.
#[derive(Default)]
struct Watchers {
    /// Number of entries, read without the lock by [`wake`] (most finishes have no waiter).
    len: AtomicUsize,
    map: Mutex<WatchMap>,
}

static WATCHERS: LazyLock<Watchers> = LazyLock::new(Watchers::default);

fn lock(m: &Mutex<WatchMap>) -> std::sync::MutexGuard<'_, WatchMap> {
    // A panic while holding this lock leaves the map consistent (single inserts and removes).
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One waiter's registration on a key: it is woken by [`wake`] for that key until dropped.
struct Watch {
    key: WatchKey,
    signal: Arc<KeySignal>,
}

impl Watch {
    fn new(store: &Arc<dyn Store>, id: &KeyId) -> Self {
        Self::on((store_identity(store), id.clone()))
    }

    fn on(key: WatchKey) -> Self {
        let mut map = lock(&WATCHERS.map);
        let (watches, signal) = map.entry(key.clone()).or_insert_with(|| {
            WATCHERS.len.fetch_add(1, Ordering::Relaxed);
            (0, Arc::new(KeySignal::default()))
        });
        *watches += 1;
        let signal = Arc::clone(signal);
        Self { key, signal }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut map = lock(&WATCHERS.map);
        if let Some((watches, _)) = map.get_mut(&self.key) {
            *watches -= 1;
            if *watches == 0 {
                // The last waiter on the key is leaving.
                map.remove(&self.key);
                WATCHERS.len.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// Wakes the duplicates of this process waiting on `id` in `store`: its first attempt has just
/// written a finish, a failure or a release. Cheap when nobody waits (one atomic read).
pub(crate) fn wake(store: &Arc<dyn Store>, id: &KeyId) {
    if WATCHERS.len.load(Ordering::Relaxed) == 0 {
        return;
    }
    let key = (store_identity(store), id.clone());
    if let Some((_, signal)) = lock(&WATCHERS.map).get(&key) {
        signal.signal();
    }
}

/// How a wait ended, as counted in [`crate::telemetry::IN_FLIGHT_WAITS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitEnd {
    /// The stored answer, replayed.
    Replayed,
    /// The first attempt ended without an answer (failed retryable) and this waiter claimed the
    /// key and ran the operation itself.
    Ran,
    /// The bound passed with the first attempt still running: the 409.
    TimedOut,
    /// Too many waiters already: the 409 at once.
    Refused,
    /// Any other answer after waiting (the outcome unknown, a store error, a refusal).
    Other,
    /// The caller went away while waiting.
    Cancelled,
}

impl WaitEnd {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Replayed => "replayed",
            Self::Ran => "ran",
            Self::TimedOut => "timed_out",
            Self::Refused => "refused",
            Self::Other => "other",
            Self::Cancelled => "cancelled",
        }
    }
}

/// The number of duplicates waiting in an executor and its clones.
#[derive(Debug, Default)]
pub(crate) struct WaiterCount(AtomicUsize);

/// A waiter's place among [`WaiterCount`]; given back when dropped.
struct Slot<'a>(&'a WaiterCount);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl WaiterCount {
    fn try_take(&self, max: usize) -> Option<Slot<'_>> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(self))
    }

    /// Duplicates waiting now.
    pub(crate) fn now(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

/// One duplicate's wait: started by the first in-flight answer, asked again after each
/// in-flight answer whether to read the key once more.
pub(crate) struct InFlightWait<'a> {
    store: &'a Arc<dyn Store>,
    id: &'a KeyId,
    operation: &'a str,
    /// The executor's settings: `wait_in_flight` bounds the wait, `max_in_flight_waiters` the
    /// waiters.
    config: &'a ExecutorConfig,
    count: &'a WaiterCount,
    /// Set once waiting has begun.
    state: Option<Waiting<'a>>,
}

struct Waiting<'a> {
    _slot: Slot<'a>,
    watch: Watch,
    deadline: Instant,
    backoff: Duration,
    /// The key's finish count when this waiter last read the key.
    seen: u64,
    /// Whether this waiter is the key's poller (see [`KeySignal::polling`]).
    poller: bool,
    /// The poller's subscription to the store's announced ends, once the store announces this
    /// key's end (see the module docs).
    ends: Option<tokio::sync::broadcast::Receiver<KeyEnd>>,
    /// Whether the end was counted (else dropping counts a cancellation).
    counted: bool,
    operation: String,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.counted {
            crate::telemetry::in_flight_wait(&self.operation, WaitEnd::Cancelled.label());
        }
        if self.poller {
            // Leaving (with an answer, past its bound, or cancelled): the others read now, and
            // one of them polls from here on if the key is still in flight.
            self.watch.signal.polling.store(false, Ordering::Release);
            self.watch.signal.signal();
        }
    }
}

impl<'a> InFlightWait<'a> {
    pub(crate) fn new(
        store: &'a Arc<dyn Store>,
        id: &'a KeyId,
        operation: &'a str,
        config: &'a ExecutorConfig,
        count: &'a WaiterCount,
    ) -> Self {
        Self {
            store,
            id,
            operation,
            config,
            count,
            state: None,
        }
    }

    /// After an in-flight answer (`in_flight`): `Ok(())` once this waiter should read the key
    /// again (woken by the key's finish in this process, or after its backoff), or
    /// `Err(in_flight)` to give the caller the 409 now (waiting off, too many waiters, or the
    /// bound passed).
    pub(crate) async fn again(&mut self, in_flight: Error) -> Result<(), Error> {
        let Some(bound) = self.config.wait_in_flight.filter(|b| !b.is_zero()) else {
            return Err(in_flight);
        };
        if self.state.is_none() {
            let Some(slot) = self.count.try_take(self.config.max_in_flight_waiters) else {
                crate::telemetry::in_flight_wait(self.operation, WaitEnd::Refused.label());
                return Err(in_flight);
            };
            let watch = Watch::new(self.store, self.id);
            // A finish between the read that answered "in flight" and this registration is
            // not signalled to this waiter: the key's poller reads it within its backoff (this
            // waiter, if it becomes the poller: its first backoff is 10 ms), and signals the
            // others when it leaves.
            let seen = watch.signal.finishes.load(Ordering::Acquire);
            self.state = Some(Waiting {
                _slot: slot,
                watch,
                // `bound` capped as every duration the crate keeps (`Instant + Duration::MAX`
                // panics).
                deadline: Instant::now() + crate::store::kit::capped(bound),
                backoff: FIRST_BACKOFF,
                seen,
                poller: false,
                ends: None,
                counted: false,
                operation: self.operation.to_owned(),
            });
        }
        let Some(w) = self.state.as_mut() else {
            return Err(in_flight);
        };
        let now = Instant::now();
        if now >= w.deadline {
            w.counted = true;
            crate::telemetry::in_flight_wait(self.operation, WaitEnd::TimedOut.label());
            self.state = None;
            return Err(in_flight);
        }
        let signal = Arc::clone(&w.watch.signal);
        if !w.poller {
            w.poller = signal
                .polling
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if w.poller
                && let Some(ends) = announced(self.store, self.id).await
            {
                // Subscribed, then announced: read once more now, and the end is either seen
                // by that read or announced after it.
                w.ends = Some(ends);
                w.backoff = ANNOUNCED_FIRST_BACKOFF;
                return Ok(());
            }
        }
        // The poller reads again after its backoff; the others only when signalled (a finish
        // in this process, or the poller's leaving) or at their bound.
        let max_backoff = if w.ends.is_some() {
            ANNOUNCED_MAX_BACKOFF
        } else {
            MAX_BACKOFF
        };
        let pause = if w.poller {
            let pause = jittered(w.backoff);
            w.backoff = (w.backoff * 2).min(max_backoff);
            pause.min(w.deadline - now)
        } else {
            w.deadline - now
        };
        // Enabled before the count is compared: a finish after the comparison wakes it, one
        // before it (during the last read) is seen in the count.
        let notified = signal.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if signal.finishes.load(Ordering::Acquire) == w.seen {
            let announcement = async {
                match w.ends.as_mut() {
                    Some(ends) => ended(ends, self.id).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = notified => {}
                () = announcement => {}
            }
        }
        // Read before the next read of the key, so a finish during it is seen next time.
        w.seen = signal.finishes.load(Ordering::Acquire);
        Ok(())
    }

    /// Counts how the wait ended with `result` (nothing when it never waited).
    /// Ends the wait: counts how it ended with `result` (`claimed`: the waiter claimed the key
    /// and runs the request itself) and gives back its place; nothing when it never waited.
    pub(crate) fn finish<T>(&mut self, result: &Result<T, Error>, claimed: bool) {
        let Some(mut w) = self.state.take() else {
            return;
        };
        if !w.counted {
            w.counted = true;
            let end = match result {
                Ok(_) if claimed => WaitEnd::Ran,
                Ok(_) => WaitEnd::Replayed,
                Err(_) => WaitEnd::Other,
            };
            crate::telemetry::in_flight_wait(self.operation, end.label());
        }
    }
}

/// The store's feed of announced ends, subscribed before this key's end was announced; `None`
/// when the store does not announce ends, or the announcement could not be asked for (the
/// poller then polls).
async fn announced(
    store: &Arc<dyn Store>,
    id: &KeyId,
) -> Option<tokio::sync::broadcast::Receiver<KeyEnd>> {
    let ends = store.key_ends()?;
    match store.announce_end(id).await {
        Ok(true) => Some(ends),
        Ok(false) => None,
        Err(e) => {
            tracing::debug!(error = %e, "idemflow: could not ask for the key's end to be announced; polling");
            None
        }
    }
}

/// Returns once `ends` says `id`'s attempt ended, or that announcements may have been missed
/// (the feed lagged or closed): the caller reads the key then.
async fn ended(ends: &mut tokio::sync::broadcast::Receiver<KeyEnd>, id: &KeyId) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        match ends.recv().await {
            Ok(KeyEnd::Ended(ended)) if &ended == id => return,
            Ok(KeyEnd::Ended(_)) => {}
            Ok(KeyEnd::Gap) | Err(RecvError::Lagged(_)) => return,
            // The store's listener stopped: nothing more will be announced; the backoff reads.
            Err(RecvError::Closed) => std::future::pending().await,
        }
    }
}

/// `d` plus up to a quarter of it, at random.
fn jittered(d: Duration) -> Duration {
    use std::hash::BuildHasher;
    static N: AtomicUsize = AtomicUsize::new(0);
    let r = std::collections::hash_map::RandomState::new()
        .hash_one((N.fetch_add(1, Ordering::Relaxed), std::time::Instant::now()));
    let quarter = d.as_micros() as u64 / 4;
    d + Duration::from_micros(if quarter == 0 { 0 } else { r % quarter })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_a_quarter() {
        for _ in 0..1000 {
            let j = jittered(Duration::from_millis(100));
            assert!(
                j >= Duration::from_millis(100) && j < Duration::from_millis(125),
                "{j:?}"
            );
        }
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }

    /// Two waiters of one key leaving at the same moment: the last one out removes the key's
    /// entry, whichever order their drops interleave in.
    #[test]
    fn waiters_leaving_at_once_leave_no_entry_behind() {
        use std::sync::Barrier;
        // No store has this identity (an address): the key is this test's alone.
        let id = KeyId::new(
            crate::key::Scope::new("s").unwrap(),
            crate::key::IdempotencyKey::new("leaving").unwrap(),
        );
        let key: WatchKey = (usize::MAX, id);
        for _ in 0..2_000 {
            let watches: Vec<Watch> = (0..4).map(|_| Watch::on(key.clone())).collect();
            let barrier = Arc::new(Barrier::new(watches.len()));
            let threads: Vec<_> = watches
                .into_iter()
                .map(|w| {
                    let barrier = Arc::clone(&barrier);
                    std::thread::spawn(move || {
                        barrier.wait();
                        drop(w);
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert!(
                !lock(&WATCHERS.map).contains_key(&key),
                "the key's entry outlived its last waiter"
            );
        }
    }

    #[test]
    fn waiter_count_is_bounded_and_given_back() {
        let c = WaiterCount::default();
        let a = c.try_take(2).expect("first");
        let b = c.try_take(2).expect("second");
        assert!(c.try_take(2).is_none(), "a third is over the bound");
        drop(a);
        assert_eq!(c.now(), 1);
        let _c = c.try_take(2).expect("a slot came back");
        drop(b);
        assert_eq!(c.now(), 1);
    }
}
