//! Group commit: one writer task owns the writes of a store and commits the writes of concurrent
//! callers together, in one transaction and one `fsync`.
//!
//! Callers send a [`Job`] (a closure that runs its statements on the writer connection) over a
//! channel and wait for the answer. The task takes the first job, then every job already queued
//! (up to [`MAX_BATCH`]), and runs them:
//!
//! - one job: in autocommit mode, as a caller without the writer would (no `BEGIN`/`COMMIT`
//!   round trips for a lone caller);
//! - several: `BEGIN IMMEDIATE`, every job in turn, `COMMIT`, and only then the answers. A job
//!   whose statement fails gets its own error; SQLite undoes a failed statement (constraint,
//!   `RAISE(ABORT)`, type or size errors) and keeps the transaction, so the other jobs of the
//!   batch commit. An error that may have ended the transaction (I/O, disk full, busy, out of
//!   memory, a trigger's `RAISE(ROLLBACK)`, a lost connection) rolls the batch back: that job gets
//!   its error and the others run again in the next batch (they were told nothing, and none of
//!   their work was committed). If `COMMIT` fails, every job of the batch gets the error: none
//!   was told it succeeded.
//!
//! A job writes with **one** statement (reads around it are free): in autocommit mode that
//! statement is its own transaction. A caller that stops waiting (a dropped future) does not
//! cancel its job once the task has started it, so no statement is ever cut halfway; a job whose
//! caller left before it started is skipped.
//!
//! The connection comes from the store's writer pool, so `writer_pool()` users (an application's
//! own tables in the same database) still take turns with the task. The task keeps it from one
//! batch to the next while writes keep coming: it gives it back once no write has come for
//! [`HOLD_IDLE`], after it has held it for [`HOLD_MAX`] (a `writer_pool()` user waiting for it then
//! gets its turn: the pool serves its waiters in order), and after any error that may have left
//! it unusable. Every connection given back to a sqlx pool is pinged first (a round trip to its
//! thread, which the next acquire waits for); kept, a lone caller's two writes per key pay no
//! such trip (`docs/performance.md`, "Why the gaps", "SQLite").
//!
//! **Phase jobs** ([`Writer::call_phase`]) run the application's statements (atomic phases).
//! Nothing they do may leave the connection in a state that loses or refuses later writes, or
//! tell a caller the opposite of what committed (`docs/reliability.md`, "Atomic phases on
//! SQLite"), so the task guards them:
//!
//! - a phase job always runs inside `BEGIN IMMEDIATE` .. `COMMIT`, even alone: the write lock is
//!   taken before its first statement (no `SQLITE_BUSY_SNAPSHOT` after a read), and the
//!   transaction it runs in is never the application's statements' to end (the `COMMIT` a job
//!   last in its batch sends comes after them: "Trips", below);
//! - while it runs, a commit hook refuses every commit and a rollback hook notes any rollback of
//!   the transaction: a statement that ends the transaction (`RAISE(ROLLBACK)`, `SQLITE_FULL`, an
//!   explicit `COMMIT`) is seen, and nothing the job writes after it commits on its own;
//! - a panic in it is caught, and it is cut off after the store's phase timeout; either way the
//!   batch is rolled back, the job gets [`JobAborted`], and the others run again. A statement
//!   of a cut-off job still running on the connection's thread is interrupted (a progress
//!   handler, [`PROGRESS_OPS`]), so the rollback and every later write wait for nothing longer;
//! - a write through the same store from inside it (which would wait for this very task) is
//!   refused at once with [`JobAborted::Reentrant`].
//!
//! **Trips.** Every statement sent to the connection's thread is a trip there and back, which
//! costs more than most statements (a thread's wake-up on each side; `docs/performance.md`).
//! A phase job's place in its batch ([`Turn`]) lets it carry the batch's own statements: first
//! in its batch, it sends the `BEGIN IMMEDIATE` ahead of its first statement, in the same trip;
//! last in its batch, its last statement ends with the `COMMIT`, once it has checked that no
//! statement of the application's ended the transaction and turned the guards off (only its own
//! statements follow); followed by another phase job, its last statement ends with that job's
//! savepoint and read ([`Ahead`]: nothing runs between them, so the row read is the row that job
//! would have read, its own key written a moment before by this job included). A new key alone is
//! then three trips, and in a batch of phases two: its read rides with the phase before it. The
//! job tells the task how those statements went, and the task answers as if it had sent them
//! itself: a `BEGIN` that failed fails the batch (nothing ran); a `COMMIT` that failed, or a job
//! cut off once it may have sent one, rolls the batch back and gives every job of it the batch's
//! error: their callers are told they may have committed.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Executor, Sqlite, SqliteConnection, SqlitePool};
use tokio::sync::{mpsc, oneshot};

use super::BACKEND;
use crate::KeyId;
use crate::error::StoreError;

/// At most this many jobs per transaction.
pub(super) const MAX_BATCH: usize = 256;

/// How many times a job runs at most when batches around it are rolled back.
const MAX_RUNS: u8 = 3;

/// How long the task keeps its connection, after a batch, for a next write (module docs).
const HOLD_IDLE: Duration = Duration::from_millis(1);

/// How long the task keeps its connection at most while writes keep coming (module docs).
const HOLD_MAX: Duration = Duration::from_millis(20);

/// A boxed future borrowing the writer connection.
pub type BoxFut<'c, T> = Pin<Box<dyn Future<Output = T> + Send + 'c>>;

/// Why the writer ended a job without its own answer: its work was rolled back, nothing of it
/// was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JobAborted {
    /// The job's code panicked; the panic's message.
    #[error("the atomic phase panicked and was rolled back: {0}")]
    Panicked(String),
    /// The job ran longer than the store's phase timeout.
    #[error("the atomic phase ran longer than {0:?} and was rolled back")]
    TimedOut(std::time::Duration),
    /// A statement of the job ended the transaction it ran in (a trigger's `RAISE(ROLLBACK)`,
    /// a full disk, an explicit `COMMIT` or `ROLLBACK`): nothing of it was kept.
    #[error("a statement of the atomic phase ended its transaction; nothing of it was written")]
    TransactionEnded,
    /// A write through the same store from inside an atomic phase: it would wait for the
    /// writer the phase runs on. Write through the phase's connection instead.
    #[error(
        "a write through the store from inside an atomic phase of the same store; use the \
         phase's connection"
    )]
    Reentrant,
}

impl JobAborted {
    /// Whether `e` is the writer's word that a job was aborted and rolled back.
    pub fn of(e: &StoreError) -> Option<&JobAborted> {
        match e {
            StoreError::Database { source, .. } => source.downcast_ref::<JobAborted>(),
            _ => None,
        }
    }
}

tokio::task_local! {
    // Which writer task the current task is (set for the task's whole life), to refuse a
    // write from inside one of its own jobs.
    static WRITER_TASK: usize;
}

/// Whether a failed job left the transaction usable for the rest of its batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Succeeded, or failed with an error that undid only its own statement.
    Kept,
    /// Failed with an error that may have rolled the whole transaction back.
    Broken,
}

/// One caller's work, as the writer task sees it.
trait Job: Send {
    /// Whether the caller still waits for the answer.
    fn wanted(&self) -> bool;
    /// Runs the statements and keeps the result; `turn` is the job's place in its batch (only
    /// a phase job's statements act on it).
    fn run<'c>(
        &'c mut self,
        conn: &'c mut SqliteConnection,
        turn: &'c mut Turn,
    ) -> BoxFut<'c, Verdict>;
    /// Sends the kept result (`Ok`), or the batch's error instead.
    fn answer(self: Box<Self>, batch: Result<(), &Arc<sqlx::Error>>);
    /// Counts a run; `false` once the job has run [`MAX_RUNS`] times.
    fn may_run_again(&mut self) -> bool;
    /// Whether this is a phase job (the application's statements, guarded: module docs).
    fn is_phase(&self) -> bool;
    /// The key a phase job reads first, which the phase before it in its batch may read for it
    /// ([`Turn::take_next`]).
    fn key(&self) -> Option<&Arc<KeyId>>;
    /// Replaces the job's result with an error: the writer rolled its work back.
    fn abort(&mut self, why: JobAborted);
}

struct Call<T, F> {
    f: F,
    result: Option<Result<T, StoreError>>,
    tx: oneshot::Sender<Result<T, StoreError>>,
    runs: u8,
    /// A phase job's key (`None`: not a phase job), shared with the [`Turn`] of the phase job
    /// before it.
    key: Option<Arc<KeyId>>,
}

/// The statements of a job, run on the writer connection: the higher-ranked closure type,
/// named once.
pub(super) trait JobFn<T>:
    for<'c> Fn(&'c mut SqliteConnection) -> BoxFut<'c, Result<T, StoreError>> + Send + 'static
{
}

impl<T, F> JobFn<T> for F where
    F: for<'c> Fn(&'c mut SqliteConnection) -> BoxFut<'c, Result<T, StoreError>> + Send + 'static
{
}

/// The statements of a phase job: a [`JobFn`] that also gets its [`Turn`].
pub(super) trait PhaseFn<T>:
    for<'c> Fn(&'c mut SqliteConnection, &'c mut Turn) -> BoxFut<'c, Result<T, StoreError>>
    + Send
    + 'static
{
}

impl<T, F> PhaseFn<T> for F where
    F: for<'c> Fn(&'c mut SqliteConnection, &'c mut Turn) -> BoxFut<'c, Result<T, StoreError>>
        + Send
        + 'static
{
}

/// A phase job's place in its batch, and what its own statements did to the batch's
/// transaction (module docs, "Trips").
pub(super) struct Turn {
    /// The job is first in its batch: the batch's `BEGIN IMMEDIATE` is its to send, ahead of its
    /// first statement.
    begins: bool,
    /// The job is last in its batch: the guards' hooks, which [`Turn::take_commit`] disarms.
    last: Option<PhaseHooks>,
    /// [`Turn::take_commit`] said yes: a statement ending with `COMMIT` may have been sent.
    commit_taken: bool,
    ended: Ended,
    /// The key of the phase job next in the batch, for [`Turn::hand`].
    next: Option<Arc<KeyId>>,
    /// What the phase before this job sent for it ([`Turn::take_ahead`]).
    ahead: Option<Ahead>,
    /// What this job sent for the next ([`Turn::hand`]).
    handed: Option<Ahead>,
}

/// What a phase job sent for the phase job next in its batch, with its own last statement (module
/// docs, "Trips").
pub(super) enum Ahead {
    /// The next phase's savepoint, and its key's row as it was then (no row: the key is not
    /// there).
    Read(Vec<sqlx::sqlite::SqliteRow>),
    /// The next phase's savepoint only: its read failed.
    Savepoint,
}

/// What a phase job's own statements did to the batch's transaction.
enum Ended {
    /// Nothing: the writer ends it.
    Open,
    /// The job's `BEGIN IMMEDIATE` failed: nothing began.
    BeginFailed(sqlx::Error),
    /// The job's last statement committed it.
    Committed,
    /// The job's `COMMIT` failed, or was cut off: it may have committed or not.
    CommitFailed(sqlx::Error),
}

impl Turn {
    /// A turn of a job the writer begins and commits around.
    fn plain() -> Self {
        Self {
            begins: false,
            last: None,
            commit_taken: false,
            ended: Ended::Open,
            next: None,
            ahead: None,
            handed: None,
        }
    }

    /// The key of the phase job next in the batch, when there is one: the job may end its last
    /// statement with that phase's savepoint and read (after this job's own savepoint is
    /// released), and tell so with [`hand`](Self::hand). Taken once.
    pub(super) fn take_next(&mut self) -> Option<Arc<KeyId>> {
        self.next.take()
    }

    /// The job sent `ahead` for the next phase job.
    pub(super) fn hand(&mut self, ahead: Ahead) {
        self.handed = Some(ahead);
    }

    /// What the phase before this job sent for it: its savepoint is then set, and, with
    /// [`Ahead::Read`], its key's row read. Taken once.
    pub(super) fn take_ahead(&mut self) -> Option<Ahead> {
        self.ahead.take()
    }

    /// Whether the job must send the batch's `BEGIN IMMEDIATE` ahead of its first statement,
    /// in the same trip; if that `BEGIN` fails, the job reports it with
    /// [`begin_failed`](Self::begin_failed).
    pub(super) fn begins(&self) -> bool {
        self.begins
    }

    /// Whether the job may end its last statement with `COMMIT`: it is last in its batch and
    /// no statement of the application's ended the transaction. Once it says yes the phase
    /// guards are off: the job runs only its own statements after it, and reports how the
    /// commit went ([`committed`](Self::committed), [`commit_failed`](Self::commit_failed)).
    pub(super) fn take_commit(&mut self) -> bool {
        let Some(hooks) = &self.last else {
            return false;
        };
        if hooks.ended.load(Ordering::SeqCst) {
            return false;
        }
        hooks.active.store(false, Ordering::SeqCst);
        self.commit_taken = true;
        true
    }

    /// The job's `BEGIN IMMEDIATE` failed with `e` (nothing of the batch ran).
    pub(super) fn begin_failed(&mut self, e: sqlx::Error) {
        self.ended = Ended::BeginFailed(e);
    }

    /// The job's last statement committed the batch's transaction.
    pub(super) fn committed(&mut self) {
        self.ended = Ended::Committed;
    }

    /// The job's `COMMIT` failed with `e`.
    pub(super) fn commit_failed(&mut self, e: sqlx::Error) {
        self.ended = Ended::CommitFailed(e);
    }

    /// Whether the batch's transaction is the writer's to end (and, if the job's statements
    /// failed, the job's own savepoint still there to undo).
    pub(super) fn left_open(&self) -> bool {
        matches!(self.ended, Ended::Open)
    }
}

impl<T: Send + 'static, F: PhaseFn<T>> Job for Call<T, F> {
    fn wanted(&self) -> bool {
        !self.tx.is_closed()
    }

    fn run<'c>(
        &'c mut self,
        conn: &'c mut SqliteConnection,
        turn: &'c mut Turn,
    ) -> BoxFut<'c, Verdict> {
        Box::pin(async move {
            let result = (self.f)(conn, turn).await;
            let verdict = match &result {
                Err(e) if may_end_transaction(e) => Verdict::Broken,
                _ => Verdict::Kept,
            };
            self.result = Some(result);
            verdict
        })
    }

    fn answer(self: Box<Self>, batch: Result<(), &Arc<sqlx::Error>>) {
        let answer = match batch {
            Ok(()) => self.result.unwrap_or_else(|| {
                Err(StoreError::Corrupt {
                    backend: BACKEND,
                    detail: "the writer answered a job it did not run".into(),
                })
            }),
            Err(e) => Err(StoreError::database(BACKEND, BatchFailed(e.clone()))),
        };
        // The caller may have stopped waiting; its answer is then dropped.
        let _ = self.tx.send(answer);
    }

    fn may_run_again(&mut self) -> bool {
        self.runs += 1;
        self.runs < MAX_RUNS
    }

    fn is_phase(&self) -> bool {
        self.key.is_some()
    }

    fn key(&self) -> Option<&Arc<KeyId>> {
        self.key.as_ref()
    }

    fn abort(&mut self, why: JobAborted) {
        self.result = Some(Err(StoreError::database(BACKEND, why)));
    }
}

/// The error every job of a batch gets when the batch could not begin or commit.
#[derive(Debug, thiserror::Error)]
#[error("the batch of writes this write was part of failed: {0}")]
pub struct BatchFailed(#[source] pub Arc<sqlx::Error>);

/// Whether `e` may have ended the transaction it happened in (SQLite rolls a transaction back by
/// itself on some errors; see "Response To Errors Within A Transaction" in SQLite's docs). Errors
/// that undo only their own statement: `SQLITE_ERROR` (1: SQL error), `SQLITE_TOOBIG` (18),
/// `SQLITE_CONSTRAINT` (19) except `SQLITE_CONSTRAINT_TRIGGER` (1811, which `RAISE(ROLLBACK)`
/// also gives), `SQLITE_MISMATCH` (20), `SQLITE_RANGE` (25); and errors raised in Rust after the
/// statement ran (decoding, fencing). Everything else counts as having ended it.
fn may_end_transaction(e: &StoreError) -> bool {
    let StoreError::Database { source, .. } = e else {
        return false;
    };
    let Some(e) = source.downcast_ref::<sqlx::Error>() else {
        return true;
    };
    match e {
        sqlx::Error::Database(d) => {
            let code = d.code().and_then(|c| c.parse::<i32>().ok());
            !matches!(code, Some(c) if c != 1811 && matches!(c & 0xff, 1 | 18 | 19 | 20 | 25))
        }
        sqlx::Error::RowNotFound
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::Encode(_)
        | sqlx::Error::TypeNotFound { .. } => false,
        _ => true,
    }
}

/// Counts kept by a store's writer task, from [`SqliteStore::writer_stats`](super::SqliteStore::writer_stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriterStats {
    /// Transactions the writer committed (a lone write in autocommit mode counts as one).
    pub commits: u64,
    /// Writes (jobs) those transactions carried: `writes / commits` is the mean batch size.
    pub writes: u64,
    /// Batches rolled back because one write's error may have ended their transaction (the
    /// other writes of such a batch run again in the next one).
    pub rolled_back: u64,
    /// Writes sent and not yet taken into a batch.
    pub queued: usize,
}

#[derive(Debug, Default)]
struct Counters {
    commits: AtomicU64,
    writes: AtomicU64,
    rolled_back: AtomicU64,
    queued: AtomicUsize,
}

/// The sending side of a store's writer task (cloned with the store).
#[derive(Clone)]
pub(super) struct Writer {
    tx: mpsc::UnboundedSender<Box<dyn Job>>,
    counters: Arc<Counters>,
    /// How long a phase job may run.
    phase_timeout: Duration,
    /// The task's inputs until the first write starts it.
    start: Arc<OnceLock<()>>,
    unstarted: Arc<Mutex<Option<Inputs>>>,
}

/// What the writer task runs on: the writer pool and the receiving end of the jobs.
type Inputs = (SqlitePool, mpsc::UnboundedReceiver<Box<dyn Job>>);

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Writer")
    }
}

impl Writer {
    /// A writer for `pool`; its task starts with the first write, on that write's tokio
    /// runtime, and ends when the last clone of the returned handle is dropped.
    pub(super) fn new(pool: SqlitePool, phase_timeout: Duration) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            tx,
            counters: Arc::new(Counters::default()),
            phase_timeout,
            start: Arc::new(OnceLock::new()),
            unstarted: Arc::new(Mutex::new(Some((pool, rx)))),
        }
    }

    /// Starts the task on the tokio runtime of the first write (so that building a store needs
    /// no runtime: `SqliteStore::from_pools` is not async).
    fn ensure_started(&self) {
        self.start.get_or_init(|| {
            let inputs = self.unstarted.lock().ok().and_then(|mut u| u.take());
            if let Some((pool, rx)) = inputs {
                let task = run(pool, rx, self.counters.clone(), self.phase_timeout);
                tokio::spawn(WRITER_TASK.scope(self.id(), task));
            }
        });
    }

    /// This writer's identity (the address of its counters, shared by its clones).
    fn id(&self) -> usize {
        Arc::as_ptr(&self.counters) as usize
    }

    pub(super) fn stats(&self) -> WriterStats {
        WriterStats {
            commits: self.counters.commits.load(Ordering::Relaxed),
            writes: self.counters.writes.load(Ordering::Relaxed),
            rolled_back: self.counters.rolled_back.load(Ordering::Relaxed),
            queued: self.counters.queued.load(Ordering::Relaxed),
        }
    }

    /// Runs `f` on the writer connection, batched with other callers' jobs; returns its result
    /// once it is committed (durable as `synchronous` says).
    pub(super) async fn call<T: Send + 'static>(&self, f: impl JobFn<T>) -> Result<T, StoreError> {
        self.send(phase_job(move |conn, _| f(conn)), None).await
    }

    /// Runs `f`, the application's statements with the store's, as a guarded phase job (module
    /// docs): inside a transaction of the task's, cut off after the phase timeout, its panics
    /// caught. An abort is a [`JobAborted`] error; nothing of the job was then written.
    /// `key` is the key the phase reads first ([`Turn::take_next`]).
    pub(super) async fn call_phase<T: Send + 'static>(
        &self,
        key: Arc<KeyId>,
        f: impl PhaseFn<T>,
    ) -> Result<T, StoreError> {
        self.send(f, Some(key)).await
    }

    /// Sends `f` as a job; with `Some(key)`, a phase job reading `key` first.
    async fn send<T: Send + 'static>(
        &self,
        f: impl PhaseFn<T>,
        key: Option<Arc<KeyId>>,
    ) -> Result<T, StoreError> {
        if WRITER_TASK.try_with(|id| *id == self.id()).unwrap_or(false) {
            return Err(StoreError::database(BACKEND, JobAborted::Reentrant));
        }
        let (tx, rx) = oneshot::channel();
        let job = Box::new(Call {
            f,
            result: None,
            tx,
            runs: 0,
            key,
        });
        self.ensure_started();
        self.counters.queued.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(job).is_err() {
            self.counters.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(stopped());
        }
        rx.await.map_err(|_| stopped())?
    }
}

fn stopped() -> StoreError {
    StoreError::database(
        BACKEND,
        "the SQLite writer task has stopped (its tokio runtime was shut down)",
    )
}

/// The writer connection while the task keeps it between batches (module docs), with the phase
/// guards' hooks once a batch has set them on it.
struct Held {
    conn: PoolConnection<Sqlite>,
    since: Instant,
    /// `None` until a batch with a phase job sets them (each setting is a round trip to the
    /// connection's thread); `Some(None)` when that failed (the connection's thread is gone).
    hooks: Option<Option<PhaseHooks>>,
}

async fn run(
    pool: SqlitePool,
    mut rx: mpsc::UnboundedReceiver<Box<dyn Job>>,
    counters: Arc<Counters>,
    phase_timeout: Duration,
) {
    let take = |job| {
        counters.queued.fetch_sub(1, Ordering::Relaxed);
        job
    };
    let mut pending: VecDeque<Box<dyn Job>> = VecDeque::new();
    let mut held: Option<Held> = None;
    loop {
        if pending.is_empty() {
            let next = if held.is_some() {
                match tokio::time::timeout(HOLD_IDLE, rx.recv()).await {
                    Ok(next) => next,
                    Err(_) => {
                        // Idle: the connection goes back to the pool until the next write.
                        held = None;
                        rx.recv().await
                    }
                }
            } else {
                rx.recv().await
            };
            match next {
                Some(job) => pending.push_back(take(job)),
                None => return,
            }
        }
        while pending.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => pending.push_back(take(job)),
                Err(_) => break,
            }
        }
        let n = pending.len().min(MAX_BATCH);
        let batch: Vec<Box<dyn Job>> = pending.drain(..n).filter(|j| j.wanted()).collect();
        if batch.is_empty() {
            continue;
        }
        if held.as_ref().is_some_and(|h| h.since.elapsed() >= HOLD_MAX) {
            // A `writer_pool()` user waiting for the connection gets it first.
            held = None;
        }
        let h = match held.take() {
            Some(h) => held.insert(h),
            None => match pool.acquire().await {
                Ok(conn) => held.insert(Held {
                    conn,
                    since: Instant::now(),
                    hooks: None,
                }),
                Err(e) => {
                    fail_all(batch, e);
                    continue;
                }
            },
        };
        if run_batch(batch, h, &mut pending, &counters, phase_timeout).await == Verdict::Broken {
            // The connection may be unusable: back to the pool, which pings it and replaces
            // it if it is.
            held = None;
        }
    }
}

/// Runs one batch on the held connection (module docs); `Broken` when it ended with an error
/// that may have left the connection unusable.
async fn run_batch(
    batch: Vec<Box<dyn Job>>,
    held: &mut Held,
    pending: &mut VecDeque<Box<dyn Job>>,
    counters: &Counters,
    phase_timeout: Duration,
) -> Verdict {
    let conn = &mut *held.conn;
    if batch.len() == 1 && !batch[0].is_phase() {
        let mut verdict = Verdict::Kept;
        for mut job in batch {
            verdict = job.run(conn, &mut Turn::plain()).await;
            counters.commits.fetch_add(1, Ordering::Relaxed);
            counters.writes.fetch_add(1, Ordering::Relaxed);
            job.answer(Ok(()));
        }
        return verdict;
    }
    // The phase guards' hooks, set once on the held connection, by the first batch that holds
    // a phase; they act only while a phase job runs.
    if held.hooks.is_none() && batch.iter().any(|j| j.is_phase()) {
        held.hooks = Some(PhaseHooks::install(conn).await);
    }
    let hooks = held.hooks.as_ref().and_then(|h| h.as_ref());
    // A phase job first in its batch sends the `BEGIN IMMEDIATE` with its first statement; one
    // last in it may send the `COMMIT` with its last (module docs, "Trips").
    let phase_begins = batch[0].is_phase();
    if !phase_begins && let Err(e) = conn.execute("BEGIN IMMEDIATE").await {
        fail_all(batch, e);
        return Verdict::Broken;
    }
    let mut done: Vec<Box<dyn Job>> = Vec::with_capacity(batch.len());
    let mut rest = batch.into_iter();
    let mut broken = false;
    let mut first = true;
    // What the last phase job sent for this one (module docs, "Trips").
    let mut ahead = None;
    while let Some(mut job) = rest.next() {
        let verdict = if job.is_phase() {
            let next = rest.as_slice().first().and_then(|j| j.key()).cloned();
            let mut turn = Turn {
                begins: first,
                last: if rest.len() == 0 {
                    hooks.cloned()
                } else {
                    None
                },
                commit_taken: false,
                ended: Ended::Open,
                next,
                ahead: ahead.take(),
                handed: None,
            };
            let verdict = run_phase(&mut *job, conn, hooks, phase_timeout, &mut turn).await;
            ahead = turn.handed.take();
            match turn.ended {
                Ended::Open => verdict,
                Ended::BeginFailed(e) => {
                    // As a failed `BEGIN IMMEDIATE` of the writer's own: nothing ran.
                    fail_all(std::iter::once(job).chain(rest).collect(), e);
                    return Verdict::Broken;
                }
                // Last in its batch: as a `COMMIT` of the writer's own (below).
                Ended::Committed => {
                    done.push(job);
                    return ended(conn, done, Ok(()), counters).await;
                }
                Ended::CommitFailed(e) => {
                    done.push(job);
                    let verdict = ended(conn, done, Err(e), counters).await;
                    PhaseHooks::disarm(hooks);
                    return verdict;
                }
            }
        } else {
            job.run(conn, &mut Turn::plain()).await
        };
        first = false;
        if verdict == Verdict::Broken {
            // Roll back whatever is left of the transaction; this job keeps its own error,
            // the others run again.
            let _ = conn.execute("ROLLBACK").await;
            PhaseHooks::disarm(hooks);
            counters.rolled_back.fetch_add(1, Ordering::Relaxed);
            job.answer(Ok(()));
            broken = true;
            break;
        }
        done.push(job);
    }
    if broken {
        let again: Vec<Box<dyn Job>> = done.into_iter().chain(rest).collect();
        for mut job in again.into_iter().rev() {
            if job.may_run_again() {
                pending.push_front(job);
            } else {
                job.answer(Err(&Arc::new(sqlx::Error::Protocol(
                    "rolled back with its batch too many times".into(),
                ))));
            }
        }
        return Verdict::Broken;
    }
    let commit = conn.execute("COMMIT").await.map(|_| ());
    ended(conn, done, commit, counters).await
}

/// Answers the jobs of a batch whose `COMMIT` (the writer's, or its last phase job's) came to
/// `commit`: each its own result once committed; every one the error otherwise, the
/// transaction rolled back (a failed `COMMIT` may leave it open).
async fn ended(
    conn: &mut SqliteConnection,
    done: Vec<Box<dyn Job>>,
    commit: Result<(), sqlx::Error>,
    counters: &Counters,
) -> Verdict {
    match commit {
        Ok(()) => {
            counters.commits.fetch_add(1, Ordering::Relaxed);
            counters
                .writes
                .fetch_add(done.len() as u64, Ordering::Relaxed);
            for job in done {
                job.answer(Ok(()));
            }
            Verdict::Kept
        }
        Err(e) => {
            let _ = conn.execute("ROLLBACK").await;
            fail_all(done, e);
            Verdict::Broken
        }
    }
}

/// How many SQLite virtual machine instructions run between two calls of the phase guards'
/// progress handler: a statement is interrupted within that many once it is asked to stop.
const PROGRESS_OPS: i32 = 1_000;

/// The commit, rollback and progress hooks that guard phase jobs (module docs), set on the
/// writer's connection for a batch: while `active`, every commit is refused (turned into a
/// rollback) and a rollback of the transaction is noted in `ended`; once `interrupt` is set (a
/// phase cut off by its timeout), the statement running on the connection is interrupted
/// (`SQLITE_INTERRUPT`) at its next progress call, and the flag is cleared. Otherwise they do
/// nothing, so they may stay on the connection after the batch.
#[derive(Clone)]
struct PhaseHooks {
    active: Arc<AtomicBool>,
    ended: Arc<AtomicBool>,
    interrupt: Arc<AtomicBool>,
}

impl PhaseHooks {
    /// Sets the hooks on `conn`; `None` when its thread is gone (nothing can run on it).
    async fn install(conn: &mut SqliteConnection) -> Option<Self> {
        let hooks = Self {
            active: Arc::new(AtomicBool::new(false)),
            ended: Arc::new(AtomicBool::new(false)),
            interrupt: Arc::new(AtomicBool::new(false)),
        };
        let mut handle = conn.lock_handle().await.ok()?;
        let (active, ended) = (hooks.active.clone(), hooks.ended.clone());
        handle.set_rollback_hook(move || {
            if active.load(Ordering::SeqCst) {
                ended.store(true, Ordering::SeqCst);
            }
        });
        let active = hooks.active.clone();
        // sqlx's hook returns whether to let the commit through (the inverse of SQLite's C
        // callback): `false` turns a commit into a rollback, so a statement of a phase job run
        // in autocommit mode, after one of its statements ended the transaction, keeps nothing.
        handle.set_commit_hook(move || !active.load(Ordering::SeqCst));
        // sqlx's handler returns whether to go on: `false` interrupts the statement. A cut-off
        // phase's statement would otherwise run on, on the connection's thread, after its future
        // was dropped, and every write of the store would queue behind it.
        let interrupt = hooks.interrupt.clone();
        handle.set_progress_handler(PROGRESS_OPS, move || {
            !interrupt.swap(false, Ordering::SeqCst)
        });
        Some(hooks)
    }

    /// Clears a pending interrupt once the cut-off phase's transaction is rolled back: the
    /// phase may have been between statements when it was cut off, and the next statement on
    /// the connection is none of its.
    fn disarm(hooks: Option<&Self>) {
        if let Some(hooks) = hooks {
            hooks.interrupt.store(false, Ordering::SeqCst);
        }
    }
}

/// Runs a phase job inside the batch's transaction, guarded (module docs): the batch's hooks
/// refuse every commit while it runs and note the transaction ending, its panics are caught and
/// it is cut off after `timeout`. Any of those aborts it, and the batch is `Broken`.
async fn run_phase(
    job: &mut dyn Job,
    conn: &mut SqliteConnection,
    hooks: Option<&PhaseHooks>,
    timeout: Duration,
    turn: &mut Turn,
) -> Verdict {
    let Some(hooks) = hooks else {
        // The connection's thread is gone: nothing can run on it.
        job.abort(JobAborted::TransactionEnded);
        return Verdict::Broken;
    };
    hooks.ended.store(false, Ordering::SeqCst);
    hooks.active.store(true, Ordering::SeqCst);
    let ran = tokio::time::timeout(timeout, catch_unwind(job.run(conn, turn))).await;
    hooks.active.store(false, Ordering::SeqCst);
    if turn.commit_taken && !matches!(ran, Ok(Ok(_))) {
        if ran.is_err() {
            // Interrupted as below; an interrupted `COMMIT` leaves the transaction open, and
            // the batch's `ROLLBACK` ends it.
            hooks.interrupt.store(true, Ordering::SeqCst);
        }
        // Cut off (or panicked) once its statement with the `COMMIT` may have been sent: whether
        // it committed is not known, as after a failed `COMMIT`.
        turn.commit_failed(sqlx::Error::Protocol(format!(
            "the atomic phase was cut off (a timeout of {timeout:?}, or a panic) while \
             committing; it may have committed"
        )));
        return Verdict::Broken;
    }
    let aborted = match ran {
        Err(_) => {
            // Its statement may still run on the connection's thread: interrupt it, so the
            // batch's `ROLLBACK` (queued behind it) runs at once.
            hooks.interrupt.store(true, Ordering::SeqCst);
            Some(JobAborted::TimedOut(timeout))
        }
        Ok(Err(panic)) => Some(JobAborted::Panicked(crate::store::phase::panic_message(
            &*panic,
        ))),
        Ok(Ok(_)) if hooks.ended.load(Ordering::SeqCst) => Some(JobAborted::TransactionEnded),
        Ok(Ok(verdict)) => return verdict,
    };
    if let Some(why) = aborted {
        job.abort(why);
    }
    Verdict::Broken
}

/// Polls `fut`, catching a panic in it as `Err` with the panic's payload.
async fn catch_unwind<F: Future>(fut: F) -> Result<F::Output, Box<dyn std::any::Any + Send>> {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(move |cx| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(std::task::Poll::Ready(out)) => std::task::Poll::Ready(Ok(out)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    })
    .await
}

fn fail_all(batch: Vec<Box<dyn Job>>, e: sqlx::Error) {
    let e = Arc::new(e);
    for job in batch {
        job.answer(Err(&e));
    }
}

/// A job closure for [`Writer::call`]: `job(move |conn| Box::pin(async move { .. }))` with the
/// higher-ranked signature spelled out, which closures do not infer by themselves.
pub(super) fn job<T, F>(f: F) -> F
where
    F: for<'c> Fn(&'c mut SqliteConnection) -> BoxFut<'c, Result<T, StoreError>>,
{
    f
}

/// A phase job closure for [`Writer::call_phase`], as [`job`]:
/// `phase_job(move |conn, turn| Box::pin(async move { .. }))`.
pub(super) fn phase_job<T, F>(f: F) -> F
where
    F: for<'c> Fn(&'c mut SqliteConnection, &'c mut Turn) -> BoxFut<'c, Result<T, StoreError>>,
{
    f
}
