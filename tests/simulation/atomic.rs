//! Atomic phases as an actor, on the three SQL backends: a workflow step run with
//! `Context::atomic_step`, or a key run with `Idempotency::execute_atomic`, whose writes are the
//! application's row in `sim_orders`. Faults on every backend: a trigger that refuses the row
//! (its error returned, or swallowed by the application; on PostgreSQL the swallowed error has
//! aborted the transaction), a panicking writes closure, the application's refusal (`Refusal`:
//! its row undone, its answer kept). On SQLite also a trigger's `RAISE(ABORT)`, which fails the
//! statement and leaves the transaction open. On SQLite (`docs/reliability.md`,
//! "Atomic phases on SQLite"): a second connection (another process) holding or taking the write
//! lock during the phase (`SQLITE_BUSY`, `SQLITE_BUSY_SNAPSHOT`; file databases only), and a
//! phase sharing its writer batch with other callers' writes (`sim_notes`), first, in the middle
//! or last, each of them a plain write or a phase of its own (phases next to each other hand on
//! their savepoint and read: `writer.rs`, "Trips"). On PostgreSQL and
//! MariaDB/MySQL: the phase's connection killed by the server in the middle of the writes, or
//! after them, before the key's record and the commit (`pg_terminate_backend`, `KILL`). What
//! each caller was told is recorded, and checked against what committed
//! (`World::check_atomic`, at every step and, for a SQLite file, after reopening it).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemflow::store::NewClaim;
use idemflow::store::phase::{
    AtomicPhase, OneCommit, PhaseError, Prepare, Refusal, StoreId, WritesFuture,
};
use idemflow::store::sqlite::SqliteStore;
use idemflow::{KeyId, Store, StoredResponse, async_trait};
use sqlx::SqlitePool;

use crate::gate::{SharedRef, park};
use crate::rng::Rng;

/// The application's tables, made in every SQLite store of the simulation.
pub const SQLITE_SCHEMA: &[&str] = &[
    "CREATE TABLE sim_orders (step TEXT NOT NULL, token INTEGER NOT NULL, \
     PRIMARY KEY (step, token))",
    "CREATE TRIGGER sim_orders_refused BEFORE INSERT ON sim_orders WHEN NEW.step LIKE 'boom%' \
     BEGIN SELECT RAISE(ROLLBACK, 'order refused by a trigger'); END",
    "CREATE TRIGGER sim_orders_aborted BEFORE INSERT ON sim_orders WHEN NEW.step LIKE 'abort%' \
     BEGIN SELECT RAISE(ABORT, 'order refused by a constraint'); END",
    "CREATE TABLE sim_notes (id TEXT PRIMARY KEY)",
    "CREATE TABLE sim_other (id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT)",
];

/// The application's tables on PostgreSQL (in the slot's schema; emptied with the store's).
#[cfg(feature = "postgres")]
pub const PG_SCHEMA: &[&str] = &[
    "CREATE TABLE sim_orders (step TEXT NOT NULL, token BIGINT NOT NULL, \
     PRIMARY KEY (step, token))",
    "CREATE FUNCTION sim_orders_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ \
     BEGIN IF NEW.step LIKE 'boom%' THEN RAISE EXCEPTION 'order refused by a trigger'; END IF; \
     RETURN NEW; END $$",
    "CREATE TRIGGER sim_orders_refused BEFORE INSERT ON sim_orders FOR EACH ROW \
     EXECUTE FUNCTION sim_orders_refuse()",
    "CREATE TABLE sim_notes (id TEXT PRIMARY KEY)",
    "CREATE TABLE sim_other (id BIGSERIAL PRIMARY KEY, at TEXT)",
];

/// The application's tables on MariaDB/MySQL (binary steps, as the store's scopes and keys).
#[cfg(feature = "mysql")]
pub const MYSQL_SCHEMA: &[&str] = &[
    "CREATE TABLE sim_orders (step VARBINARY(600) NOT NULL, token BIGINT NOT NULL, \
     PRIMARY KEY (step, token))",
    "CREATE TRIGGER sim_orders_refused BEFORE INSERT ON sim_orders FOR EACH ROW \
     BEGIN IF NEW.step LIKE 'boom%' THEN \
     SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'order refused by a trigger'; END IF; END",
    "CREATE TABLE sim_notes (id VARCHAR(64) PRIMARY KEY)",
    "CREATE TABLE sim_other (id BIGINT AUTO_INCREMENT PRIMARY KEY, at TEXT)",
];

/// The application's tables, emptied between the schedules of a reused PostgreSQL or MariaDB
/// slot.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub const APP_TABLES: [&str; 3] = ["sim_orders", "sim_notes", "sim_other"];

/// How an injected panic's message starts.
pub const INJECTED: &str = "injected: ";

/// The store the phases of a schedule write through.
#[derive(Clone)]
pub enum PhaseStore {
    Sqlite(SqliteStore),
    #[cfg(feature = "postgres")]
    Postgres(idemflow::store::postgres::PostgresStore),
    #[cfg(feature = "mysql")]
    MySql(idemflow::store::mysql::MySqlStore),
}

/// A pool on the phases' database, beside the store's own.
#[derive(Clone)]
pub enum AppPool {
    Sqlite(SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

impl AppPool {
    pub async fn close(&self) {
        match self {
            AppPool::Sqlite(p) => p.close().await,
            #[cfg(feature = "postgres")]
            AppPool::Postgres(p) => p.close().await,
            #[cfg(feature = "mysql")]
            AppPool::MySql(p) => p.close().await,
        }
    }
}

/// The database of a schedule, for its atomic phases.
#[derive(Clone)]
pub struct Db {
    pub store: PhaseStore,
    /// A SQLite file's URL (`None`: in memory, or a server).
    pub url: Option<String>,
    /// Another connection: on a SQLite file a second process (short busy timeout), on a server
    /// the one that kills the phase's connection. `None`: SQLite in memory.
    pub other: Option<AppPool>,
    /// A pool the scheduler reads the app's rows with.
    pub read: AppPool,
}

impl Db {
    fn store_id(&self) -> StoreId {
        let id = match &self.store {
            PhaseStore::Sqlite(s) => Store::phase_store(s),
            #[cfg(feature = "postgres")]
            PhaseStore::Postgres(s) => Store::phase_store(s),
            #[cfg(feature = "mysql")]
            PhaseStore::MySql(s) => Store::phase_store(s),
        };
        id.expect("a SQL store shares its transactions")
    }

    /// Whether the store is SQLite's (one writer, batches, a lock a second process can take).
    fn sqlite(&self) -> Option<&SqliteStore> {
        match &self.store {
            PhaseStore::Sqlite(s) => Some(s),
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            _ => None,
        }
    }
}

const INJECTED_PANIC: &str = "injected: a bug in the application's phase";

/// How many phases in a thousand without another fault get stuck in a statement
/// ([`Fault::Stuck`]).
const STUCK_PER_MILLE: u64 = 150;

/// What happens during one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// A row the trigger refuses with `RAISE(ROLLBACK)`, its error returned.
    Trigger,
    /// The same, its error swallowed by the application, which writes its row after it.
    TriggerSwallowed,
    /// The closure panics after writing its row.
    Panic,
    /// The other process takes the write lock after the phase's first read and holds it until
    /// the phase has answered (`SQLITE_BUSY` for the phase's writes, if it can).
    HoldLock,
    /// The other process commits a write after the phase's first read (`SQLITE_BUSY_SNAPSHOT`
    /// for the phase's writes, if it can).
    Snapshot,
    /// The server kills the phase's connection after its first read: the writes fail
    /// (PostgreSQL, MariaDB/MySQL).
    Kill,
    /// The server kills the phase's connection after the application's row is written, before
    /// the key's record and the commit: the phase ends with a store error, nothing committed
    /// (PostgreSQL, MariaDB/MySQL).
    KillLate,
    /// The application refuses after writing its row (`Refusal`, a 409 naming the writes'
    /// token): the row is undone, the key stores the refusal.
    Refuse,
    /// A row refused by a `RAISE(ABORT)` trigger (a statement error that leaves the
    /// transaction open, as a constraint's), its error returned: everything rolled back
    /// (SQLite; on PostgreSQL and MariaDB/MySQL [`Fault::Trigger`] is that already).
    Abort,
    /// After writing its row, the phase runs a statement that never ends on its own (a
    /// recursive query without a bound): the store's phase timeout cuts the phase off and
    /// interrupts the statement, and everything is rolled back while the writer goes on
    /// (SQLite, [`Mode::StuckStatements`](crate::world::Mode::StuckStatements)).
    Stuck,
}

/// [`Fault::Stuck`]'s statement.
const NEVER_ENDS: &str =
    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n";

/// What a phase's caller was told.
#[derive(Debug, Clone)]
pub struct Told {
    pub label: String,
    pub token: i64,
    /// `Some(true)`: committed; `Some(false)`: rolled back (writes failed, answer too large);
    /// `None`: a store error, which may or may not have committed.
    pub committed: Option<bool>,
    pub what: String,
}

/// The atomic phases of one schedule.
pub struct AtomicSim {
    pub db: Db,
    pub rng: Mutex<Rng>,
    /// The draws of the faults added after the others (`Fault::Refuse`, `Fault::Abort`): a
    /// stream of their own, so the other draws, and the regression seeds' schedules up to the
    /// first such fault, are as before.
    more: Mutex<Rng>,
    /// Where a batched phase stands in its batch (how many of the others' writes come before
    /// it): a stream of its own too.
    order: Mutex<Rng>,
    /// The draws of [`Fault::Stuck`], on SQLite in
    /// [`Mode::StuckStatements`](crate::world::Mode::StuckStatements): a stream of its own.
    stuck: Option<Mutex<Rng>>,
    pub shared: SharedRef,
    /// Every phase's answer to its caller.
    pub told: Mutex<Vec<Told>>,
    /// Every batched other caller's write: note id and whether it was told it committed.
    pub notes: Mutex<Vec<(String, bool)>>,
    /// (step label, token) of the phases that kept no app row (read-only runs, refusals).
    pub read_only: Mutex<std::collections::BTreeSet<(String, i64)>>,
    /// Writes still running (batched notes): awaited at quiescence.
    pub pending: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// The steps whose phase had its connection killed after its writes at least once (a store
    /// error its caller may get: [`Fault::KillLate`]).
    late_kills: Mutex<std::collections::BTreeSet<String>>,
    next_note: std::sync::atomic::AtomicU64,
    next_token: std::sync::atomic::AtomicU64,
}

impl AtomicSim {
    /// The phases of a schedule on `db`; `stuck`: some phases' statements never end
    /// ([`Fault::Stuck`], on SQLite only).
    pub fn new(db: Db, rng: Rng, shared: SharedRef, stuck: bool) -> Self {
        let more = Rng::new(rng.clone().next_u64() ^ 0x0A7E_5EED);
        let order = Rng::new(rng.clone().next_u64() ^ 0x0BA7_C4ED);
        let stuck = (stuck && db.sqlite().is_some())
            .then(|| Mutex::new(Rng::new(rng.clone().next_u64() ^ 0x057C_C4ED)));
        Self {
            db,
            rng: Mutex::new(rng),
            more: Mutex::new(more),
            order: Mutex::new(order),
            stuck,
            shared,
            told: Mutex::default(),
            notes: Mutex::default(),
            read_only: Mutex::default(),
            pending: Mutex::default(),
            late_kills: Mutex::default(),
            next_note: Default::default(),
            next_token: Default::default(),
        }
    }

    /// A new token for a run of a phase's writes ([`TokenOf`]).
    fn next_token(&self) -> i64 {
        self.next_token
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .cast_signed()
            + 1
    }

    /// The phase for the step `label` (faults drawn when it commits).
    pub fn phase(self: &Arc<Self>, label: &str) -> SimPhase {
        SimPhase {
            sim: self.clone(),
            label: label.to_owned(),
        }
    }

    /// Whether the phase of (`label`, `token`) wrote no app row.
    pub fn read_only(&self, label: &str, token: i64) -> bool {
        self.read_only
            .lock()
            .unwrap()
            .contains(&(label.to_owned(), token))
    }

    /// Whether a store error of the phase of `label` may come from the server killing its
    /// connection ([`Fault::KillLate`]).
    pub fn killed_late(&self, label: &str) -> bool {
        self.late_kills.lock().unwrap().contains(label)
    }

    /// The phase's fault, whether it is batched (SQLite), and whether it writes no app row (a
    /// phase that only reads: then the step's record is its first write, which meets the other
    /// process's lock or newer snapshot).
    fn draw(&self) -> (Fault, bool, bool) {
        let mut rng = self.rng.lock().unwrap();
        let sqlite = self.db.sqlite().is_some();
        let file = sqlite && self.db.other.is_some();
        // Zero weights at the end draw as before: SQLite's schedules are unchanged.
        let w = [
            40,
            10,
            10,
            8,
            if file { 16 } else { 0 },
            if file { 16 } else { 0 },
            if sqlite { 0 } else { 12 },
            if sqlite { 0 } else { 12 },
        ];
        let fault = [
            Fault::None,
            Fault::Trigger,
            Fault::TriggerSwallowed,
            Fault::Panic,
            Fault::HoldLock,
            Fault::Snapshot,
            Fault::Kill,
            Fault::KillLate,
        ][rng.weighted(&w)];
        let read_only = matches!(fault, Fault::HoldLock | Fault::Snapshot) && rng.chance(500);
        let batched = rng.chance(350) && sqlite;
        let fault = match (fault, self.more.lock().unwrap().range(0, 9)) {
            (Fault::None, 0..=2) => Fault::Refuse,
            (Fault::None, 3 | 4) if sqlite => Fault::Abort,
            (fault, _) => fault,
        };
        let fault = match (fault, &self.stuck) {
            (Fault::None, Some(stuck)) if stuck.lock().unwrap().chance(STUCK_PER_MILLE) => {
                Fault::Stuck
            }
            (fault, _) => fault,
        };
        (fault, batched, read_only)
    }

    /// Waits for every batched write still running.
    pub async fn settle(&self) {
        let pending: Vec<_> = std::mem::take(&mut *self.pending.lock().unwrap());
        for p in pending {
            let _ = p.await;
        }
    }
}

/// The phase of a workflow's atomic step (`Context::atomic_step`) or of a one-commit key
/// (`Idempotency::execute_atomic`), the key claimed inside the phase's transaction either way:
/// parks before and after it (crash points), draws its fault, runs the store's phase and
/// records what its caller was told.
pub struct SimPhase {
    sim: Arc<AtomicSim>,
    label: String,
}

type Ack = tokio::sync::oneshot::Sender<()>;

/// The token of a phase's writes: drawn anew by each run (on SQLite the writes may run more
/// than once, after a batch is rolled back: the last run's is kept), carried by the app row
/// and by the answer the key stores, which ties the row to the key's answer. (Not the key's
/// lease token: on SQLite a new key's row is written after the writes, `docs/one-commit.md`.)
#[derive(Clone)]
struct TokenOf {
    seen: Arc<Mutex<Option<i64>>>,
}

/// What a phase leaves to do once it has answered: let the other process go.
struct Guard {
    /// Batched, after this many of the others' writes.
    batched: Option<(usize, [Other; NOTES])>,
    release_tx: tokio::sync::oneshot::Sender<()>,
    holder: Option<tokio::task::JoinHandle<()>>,
}

impl Guard {
    async fn end(self) {
        let _ = self.release_tx.send(());
        if let Some(h) = self.holder {
            let _ = h.await;
        }
    }
}

/// The statements of a phase's writes, per backend.
struct Sql {
    /// A read of the app's table (the phase's first read: its snapshot on SQLite).
    count: &'static str,
    /// The app row.
    insert: &'static str,
    /// The phase's connection id on the server (unused on SQLite).
    pid: &'static str,
}

const SQLITE_SQL: Sql = Sql {
    count: "SELECT count(*) FROM sim_orders",
    insert: "INSERT INTO sim_orders (step, token) VALUES (?, ?)",
    pid: "SELECT 0",
};

#[cfg(feature = "postgres")]
const PG_SQL: Sql = Sql {
    count: "SELECT count(*) FROM sim_orders",
    insert: "INSERT INTO sim_orders (step, token) VALUES ($1, $2)",
    pid: "SELECT pg_backend_pid()::bigint",
};

#[cfg(feature = "mysql")]
const MYSQL_SQL: Sql = Sql {
    count: "SELECT count(*) FROM sim_orders",
    insert: "INSERT INTO sim_orders (step, token) VALUES (?, ?)",
    pid: "SELECT CAST(CONNECTION_ID() AS SIGNED)",
};

/// What a phase's writes need besides their connection (cloned for each run: on SQLite the
/// writes run again after their batch is rolled back).
#[derive(Clone)]
struct Writes {
    fault: Fault,
    read_only: bool,
    row_label: String,
    token: TokenOf,
    sim: Arc<AtomicSim>,
    /// Tells the other process to take the lock ([`Fault::HoldLock`]).
    go: Arc<Mutex<Option<tokio::sync::oneshot::Sender<Ack>>>>,
    other: Option<AppPool>,
}

impl Writes {
    /// [`Fault::HoldLock`]: the other process takes the write lock; returns once it has (or
    /// could not).
    async fn hold_lock(&self) {
        let go = self.go.lock().unwrap().take();
        if let Some(go) = go {
            let (ack, acked) = tokio::sync::oneshot::channel();
            if go.send(ack).is_ok() {
                let _ = acked.await;
            }
        }
    }

    /// [`Fault::Snapshot`]: the other process commits a write.
    async fn other_commits(&self) {
        if let Some(AppPool::Sqlite(other)) = &self.other {
            let _ = sqlx::query("INSERT INTO sim_other (at) VALUES (?)")
                .bind(&self.row_label)
                .execute(other)
                .await;
        }
    }

    /// [`Fault::Kill`], [`Fault::KillLate`]: the server ends the connection `pid` (waiting, on
    /// PostgreSQL, until it has ended).
    async fn kill(&self, pid: i64) {
        let killed: Result<String, sqlx::Error> = match &self.other {
            #[cfg(feature = "postgres")]
            Some(AppPool::Postgres(other)) => {
                sqlx::query_scalar::<_, bool>("SELECT pg_terminate_backend($1::int, 5000)")
                    .bind(pid)
                    .fetch_one(other)
                    .await
                    .map(|ended| ended.to_string())
            }
            #[cfg(feature = "mysql")]
            Some(AppPool::MySql(other)) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {pid}")))
                    .execute(other)
                    .await
                    .map(|_| "true".to_owned())
            }
            _ => Ok("no server".to_owned()),
        };
        self.sim.shared.lock().unwrap().trace.push(format!(
            "    phase of {}: its connection {pid} killed: {killed:?}",
            self.row_label
        ));
    }
}

/// A phase's writes on `$conn` with the backend's statements `$sql`, making `$w`'s fault (one
/// body for the three connection types).
macro_rules! writes {
    ($conn:ident, $sql:expr, $w:ident) => {{
        let w = $w;
        let sql: &Sql = &$sql;
        let tok = w.sim.next_token();
        *w.token.seen.lock().unwrap() = Some(tok);
        if w.read_only {
            w.sim
                .read_only
                .lock()
                .unwrap()
                .insert((w.row_label.clone(), tok));
        }
        sqlx::query(sql.count).execute(&mut *$conn).await?;
        match w.fault {
            Fault::HoldLock => w.hold_lock().await,
            Fault::Snapshot => w.other_commits().await,
            Fault::Kill => {
                let pid: i64 = sqlx::query_scalar(sql.pid).fetch_one(&mut *$conn).await?;
                w.kill(pid).await;
            }
            Fault::Trigger | Fault::TriggerSwallowed => {
                let refused = sqlx::query(sql.insert)
                    .bind(format!("boom/{}", w.row_label))
                    .bind(tok)
                    .execute(&mut *$conn)
                    .await;
                if w.fault == Fault::Trigger {
                    refused?;
                }
            }
            Fault::Abort => {
                sqlx::query(sql.insert)
                    .bind(format!("abort/{}", w.row_label))
                    .bind(tok)
                    .execute(&mut *$conn)
                    .await?;
            }
            Fault::None | Fault::Panic | Fault::KillLate | Fault::Refuse | Fault::Stuck => {}
        }
        if w.read_only {
            return Ok(StoredResponse::json(
                200,
                &serde_json::json!({"order": w.row_label, "token": tok, "rows": 0}),
            )?);
        }
        sqlx::query(sql.insert)
            .bind(&w.row_label)
            .bind(tok)
            .execute(&mut *$conn)
            .await?;
        if w.fault == Fault::Panic {
            std::panic::panic_any(INJECTED_PANIC);
        }
        if w.fault == Fault::Stuck {
            sqlx::query(NEVER_ENDS).execute(&mut *$conn).await?;
        }
        if w.fault == Fault::KillLate {
            let pid: i64 = sqlx::query_scalar(sql.pid).fetch_one(&mut *$conn).await?;
            w.kill(pid).await;
        }
        if w.fault == Fault::Refuse {
            // The row is undone: the key's answer names a token with no row.
            w.sim
                .read_only
                .lock()
                .unwrap()
                .insert((w.row_label.clone(), tok));
            return Err(Refusal::new(StoredResponse::json(
                409,
                &serde_json::json!({"order": w.row_label, "token": tok, "refused": true}),
            )?)
            .into());
        }
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({"order": w.row_label, "token": tok}),
        )?)
    }};
}

impl SimPhase {
    /// Draws the phase's fault and builds the store's phase with the writes that fault makes.
    fn build(&self, token: TokenOf) -> (Box<dyn AtomicPhase>, Guard) {
        let (sim, label) = (self.sim.clone(), self.label.clone());
        let (fault, batched, read_only) = sim.draw();
        // Batched: first in its batch (it sends the `BEGIN`), in the middle, or last (it sends
        // the `COMMIT`; `writer.rs`, "Trips").
        // Each of the others' writes a plain write or another caller's phase (whose row is its
        // note): phases next to each other in a batch hand each other their savepoint and read.
        let (before, others) = if batched {
            let mut order = sim.order.lock().unwrap();
            let before = order.range(0, NOTES as u64) as usize;
            let mut others = [Other::Write; NOTES];
            for o in &mut others {
                if order.chance(500) {
                    *o = Other::Phase;
                }
            }
            (before, others)
        } else {
            (0, [Other::Write; NOTES])
        };
        if fault == Fault::KillLate {
            sim.late_kills.lock().unwrap().insert(label.clone());
        }
        sim.shared.lock().unwrap().trace.push(format!(
            "    phase of {label}: {fault:?}{}{}",
            if read_only { ", reads only" } else { "" },
            if batched {
                format!(", batched after {before} of the others' writes {others:?}")
            } else {
                String::new()
            }
        ));
        // The other process, for HoldLock: takes the lock when the phase says, holds it until
        // the phase has answered.
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<Ack>();
        let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
        let holder = match (&sim.db.other, fault) {
            (Some(AppPool::Sqlite(other)), Fault::HoldLock) => {
                let other = other.clone();
                Some(tokio::spawn(async move {
                    let Ok(mut conn) = other.acquire().await else {
                        return;
                    };
                    let Ok(ack) = go_rx.await else { return };
                    let took = sqlx::query("BEGIN IMMEDIATE")
                        .execute(&mut *conn)
                        .await
                        .is_ok();
                    let _ = ack.send(());
                    let _ = release_rx.await;
                    if took {
                        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                    }
                }))
            }
            _ => None,
        };
        let w = Writes {
            fault,
            read_only,
            row_label: label.clone(),
            token,
            sim: sim.clone(),
            go: Arc::new(Mutex::new(Some(go_tx))),
            other: sim.db.other.clone(),
        };
        let inner: Box<dyn AtomicPhase> = match &sim.db.store {
            PhaseStore::Sqlite(s) => Box::new(s.atomic_phase(move |conn| {
                let w = w.clone();
                Box::pin(async move { writes!(conn, SQLITE_SQL, w) })
            })),
            #[cfg(feature = "postgres")]
            PhaseStore::Postgres(s) => Box::new(s.atomic_phase(move |conn| {
                let w = w.clone();
                Box::pin(async move { writes!(conn, PG_SQL, w) })
            })),
            #[cfg(feature = "mysql")]
            PhaseStore::MySql(s) => Box::new(s.atomic_phase(move |conn| {
                let w = w.clone();
                Box::pin(async move { writes!(conn, MYSQL_SQL, w) })
            })),
        };
        (
            inner,
            Guard {
                batched: batched.then_some((before, others)),
                release_tx,
                holder,
            },
        )
    }

    /// Records what the phase's caller was told (when its token is known).
    fn told(&self, token: Option<i64>, committed: Option<bool>, what: String) {
        let label = &self.label;
        let shown = token.map_or_else(|| "no claim".to_owned(), |t| format!("token {t}"));
        self.sim
            .shared
            .lock()
            .unwrap()
            .trace
            .push(format!("    phase of {label} ({shown}) told: {what}"));
        if let Some(token) = token {
            self.sim.told.lock().unwrap().push(Told {
                label: label.clone(),
                token,
                committed,
                what,
            });
        }
    }
}

/// Whether a phase that answered `r` committed: `None` for a store error (it may have).
fn committed<T>(r: &Result<T, PhaseError>) -> Option<bool> {
    match r {
        Ok(_) => Some(true),
        Err(PhaseError::Store(_)) => None,
        Err(_) => Some(false),
    }
}

#[async_trait]
impl AtomicPhase for SimPhase {
    fn store_id(&self) -> StoreId {
        self.sim.db.store_id()
    }

    async fn claim_and_commit(
        self: Box<Self>,
        claim: &NewClaim,
        prepare: Prepare,
    ) -> Result<OneCommit, PhaseError> {
        park("phase.one_commit", "before", &self.label).await;
        let seen = Arc::new(Mutex::new(None));
        let (inner, guard) = self.build(TokenOf { seen: seen.clone() });
        let claim = claim.clone();
        let run = async move { inner.claim_and_commit(&claim, prepare).await };
        let r = if let Some((before, others)) = guard.batched {
            batch(&self.sim, run, before, others).await
        } else {
            run.await
        };
        guard.end().await;
        let (committed, what) = match &r {
            Ok(OneCommit::Committed(resp)) => (Some(true), format!("committed {}", resp.status())),
            Ok(OneCommit::Refused(resp)) => (Some(true), format!("refused {}", resp.status())),
            // The writes did not run: no row to account for.
            Ok(OneCommit::Existing { record, .. }) => (None, format!("found it {}", record.state)),
            Ok(_) => (None, "an answer this simulation does not know".to_owned()),
            Err(e) => (committed(&r), e.to_string()),
        };
        let token = match &r {
            Ok(OneCommit::Existing { .. }) => None,
            _ => *seen.lock().unwrap(),
        };
        // The key's generation when the phase claimed or read it (as the gated store notes a
        // claim's): the answer belongs to it, however late its caller takes it.
        if let Some(a) = crate::gate::current_actor() {
            let mut sh = self.sim.shared.lock().unwrap();
            let g = sh.generation(&self.label);
            sh.claimed_in.insert((a, self.label.clone()), g);
        }
        self.told(token, committed, what);
        park("phase.one_commit", "after", &self.label).await;
        r
    }
}

/// How many other callers' writes share a batched phase's batch.
const NOTES: usize = 3;

/// One of the other callers' writes in a batched phase's batch: its note row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Other {
    /// A plain write of the writer (`SqliteStore::write_job`).
    Write,
    /// An atomic phase of its own (`Idempotency::execute_atomic`, a new key in the scope
    /// `sim-notes`) whose writes insert the note.
    Phase,
}

/// Runs `phase` in one writer batch with [`NOTES`] other callers' writes, `before` of them
/// queued ahead of it: the writer is held by a job that waits until the phase and the writes
/// are queued behind it.
async fn batch<T: Send + 'static>(
    sim: &Arc<AtomicSim>,
    phase: impl std::future::Future<Output = Result<T, PhaseError>> + Send + 'static,
    before: usize,
    others: [Other; NOTES],
) -> Result<T, PhaseError> {
    let Some(store) = sim.db.sqlite().cloned() else {
        return phase.await;
    };
    let gate = Arc::new(tokio::sync::Notify::new());
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let started_tx = Arc::new(Mutex::new(Some(started_tx)));
    let held = {
        let (store, gate) = (store.clone(), gate.clone());
        tokio::spawn(async move {
            store
                .write_job(move |_conn| {
                    let (gate, started_tx) = (gate.clone(), started_tx.clone());
                    Box::pin(async move {
                        let tx = started_tx.lock().unwrap().take();
                        if let Some(tx) = tx {
                            let _ = tx.send(());
                            gate.notified().await;
                        }
                        Ok(())
                    })
                })
                .await
        })
    };
    // The writer may be busy with others' writes (renewals): wait for the holding job to run.
    if tokio::time::timeout(Duration::from_secs(10), started)
        .await
        .is_err()
    {
        gate.notify_one();
        return phase.await;
    }
    let base = store.writer_stats().queued;
    let mut phase = Some(phase);
    let mut phase_task = None;
    for i in 0..=NOTES {
        if i == before
            && let Some(phase) = phase.take()
        {
            phase_task = Some(tokio::spawn(phase));
            wait_queued(&store, base + i + 1).await;
        }
        let Some(&other) = others.get(i) else {
            break;
        };
        let n = sim
            .next_note
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("note-{n}");
        let (note_store, sim2) = (store.clone(), sim.clone());
        let h = tokio::spawn(async move {
            let note = id.clone();
            let ok = match other {
                Other::Write => note_store
                    .write_job(move |conn| {
                        let id = note.clone();
                        Box::pin(async move {
                            sqlx::query("INSERT INTO sim_notes (id) VALUES (?)")
                                .bind(&id)
                                .execute(&mut *conn)
                                .await
                                .map_err(|e| idemflow::StoreError::database("sqlite", e))?;
                            Ok(())
                        })
                    })
                    .await
                    .is_ok(),
                Other::Phase => {
                    let phase = note_store.atomic_phase(
                        move |conn: &mut sqlx::SqliteConnection| -> WritesFuture<'_> {
                            let id = note.clone();
                            Box::pin(async move {
                                sqlx::query("INSERT INTO sim_notes (id) VALUES (?)")
                                    .bind(&id)
                                    .execute(&mut *conn)
                                    .await?;
                                Ok(StoredResponse::new(201))
                            })
                        },
                    );
                    let request = idemflow::IdempotentRequest::new(
                        "sim-notes",
                        &id,
                        "note",
                        &serde_json::json!({}),
                    )
                    .expect("a valid request");
                    matches!(
                        idemflow::Idempotency::new(Arc::new(note_store))
                            .execute_atomic(request, phase)
                            .await,
                        Ok(idemflow::Execution::Executed(_))
                    )
                }
            };
            sim2.notes.lock().unwrap().push((id, ok));
        });
        sim.pending.lock().unwrap().push(h);
        // Queued in this order (the writer takes its jobs in the order sent).
        wait_queued(&store, base + i + 1 + usize::from(phase_task.is_some())).await;
    }
    gate.notify_one();
    let _ = held.await;
    let phase_task = phase_task.expect("spawned at its place: `before` is at most NOTES");
    match phase_task.await {
        Ok(r) => r,
        Err(e) => Err(PhaseError::Store(idemflow::StoreError::database(
            "sqlite",
            format!("the phase's task ended: {e}"),
        ))),
    }
}

/// Waits (bounded) until at least `n` jobs are queued for the writer.
async fn wait_queued(store: &SqliteStore, n: usize) {
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while store.writer_stats().queued < n && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The step's state, the token of its stored answer ([`TokenOf`]; 0 without one) and the app
/// rows under that token, read in one statement (one snapshot).
pub async fn step_rows(
    pool: &AppPool,
    id: &KeyId,
) -> Result<Option<(String, i64, i64)>, sqlx::Error> {
    let (scope, key) = (id.scope.as_str(), id.key.as_str());
    match pool {
        AppPool::Sqlite(pool) => {
            sqlx::query_as(
                "SELECT state, ifnull(token, 0), (SELECT count(*) FROM sim_orders o \
                 WHERE o.step = k.step AND o.token = k.token) \
                 FROM (SELECT state, scope || '/' || key AS step, \
                   CASE WHEN json_valid(CAST(response_body AS TEXT)) \
                   THEN json_extract(CAST(response_body AS TEXT), '$.token') END AS token \
                 FROM idempotency_keys WHERE scope = ? AND key = ?) k",
            )
            .bind(scope)
            .bind(key)
            .fetch_optional(pool)
            .await
        }
        #[cfg(feature = "postgres")]
        AppPool::Postgres(pool) => {
            sqlx::query_as(
                "SELECT state, coalesce(token, 0), (SELECT count(*) FROM sim_orders o \
                 WHERE o.step = k.step AND o.token = k.token) \
                 FROM (SELECT state, scope || '/' || key AS step, \
                   substring(convert_from(response_body, 'UTF8') from '\"token\":([0-9]+)')::bigint \
                   AS token \
                 FROM idempotency_keys WHERE scope = $1 AND key = $2) k",
            )
            .bind(scope)
            .bind(key)
            .fetch_optional(pool)
            .await
        }
        #[cfg(feature = "mysql")]
        AppPool::MySql(pool) => {
            sqlx::query_as(
                "SELECT state, coalesce(token, 0), (SELECT count(*) FROM sim_orders o \
                 WHERE o.step = k.step AND o.token = k.token) \
                 FROM (SELECT state, CONCAT(scope, '/', `key`) AS step, \
                   CAST(JSON_VALUE(CAST(response_body AS CHAR), '$.token') AS SIGNED) AS token \
                 FROM idempotency_keys WHERE scope = ? AND `key` = ?) k",
            )
            .bind(scope)
            .bind(key)
            .fetch_optional(pool)
            .await
        }
    }
}

/// `SELECT count(*) FROM {table} WHERE {column} = ? [AND token = ?]` on any backend's pool.
async fn count_where(
    pool: &AppPool,
    table: &str,
    column: &str,
    value: &str,
    token: Option<i64>,
) -> Result<i64, sqlx::Error> {
    let q = |p1: &str, p2: &str| {
        let token = if token.is_some() {
            format!(" AND token = {p2}")
        } else {
            String::new()
        };
        sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE {column} = {p1}{token}"
        ))
    };
    macro_rules! count {
        ($pool:expr, $sql:expr) => {{
            let mut q = sqlx::query_scalar($sql).bind(value);
            if let Some(t) = token {
                q = q.bind(t);
            }
            q.fetch_one($pool).await
        }};
    }
    match pool {
        AppPool::Sqlite(pool) => count!(pool, q("?", "?")),
        #[cfg(feature = "postgres")]
        AppPool::Postgres(pool) => count!(pool, q("$1", "$2")),
        #[cfg(feature = "mysql")]
        AppPool::MySql(pool) => count!(pool, q("?", "?")),
    }
}

/// Whether the app row of (`label`, `token`) is there.
pub async fn row_there(pool: &AppPool, label: &str, token: i64) -> Result<bool, sqlx::Error> {
    Ok(count_where(pool, "sim_orders", "step", label, Some(token)).await? == 1)
}

/// Whether the note `id` is there.
pub async fn note_there(pool: &AppPool, id: &str) -> Result<bool, sqlx::Error> {
    Ok(count_where(pool, "sim_notes", "id", id, None).await? == 1)
}
