//! Atomic phases as an actor (SQLite only): a workflow step run with `Context::atomic_step` whose
//! writes are the application's row in `sim_orders`, with the faults of
//! `docs/reliability.md` ("Atomic phases on SQLite"): a second connection (another process)
//! holding or taking the write lock during the phase (`SQLITE_BUSY`, `SQLITE_BUSY_SNAPSHOT`; file
//! databases only), a trigger's `RAISE(ROLLBACK)` (its error returned, or swallowed by the
//! application), a panicking writes closure, and a phase sharing its writer batch with other
//! callers' writes (`sim_notes`). What each caller was told is recorded, and checked against
//! what committed (`World::check_atomic`, at every step and after reopening the file).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemflow::store::NewClaim;
use idemflow::store::phase::{AtomicPhase, OneCommit, PhaseError, Prepare, StoreId};
use idemflow::store::sqlite::SqliteStore;
use idemflow::{KeyId, Store, StoredResponse, async_trait};
use sqlx::SqlitePool;

use crate::gate::{SharedRef, park};
use crate::rng::Rng;

/// The application's tables, made in every SQLite store of the simulation.
pub const SCHEMA: &[&str] = &[
    "CREATE TABLE sim_orders (step TEXT NOT NULL, token INTEGER NOT NULL, \
     PRIMARY KEY (step, token))",
    "CREATE TRIGGER sim_orders_refused BEFORE INSERT ON sim_orders WHEN NEW.step LIKE 'boom%' \
     BEGIN SELECT RAISE(ROLLBACK, 'order refused by a trigger'); END",
    "CREATE TABLE sim_notes (id TEXT PRIMARY KEY)",
    "CREATE TABLE sim_other (id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT)",
];

/// How an injected panic's message starts.
pub const INJECTED: &str = "injected: ";

/// The SQLite database of a schedule, for its atomic phases.
#[derive(Clone)]
pub struct Db {
    pub store: SqliteStore,
    /// The file's URL (`None`: in memory, no second connection possible).
    pub url: Option<String>,
    /// Another connection to the file: a second process (short busy timeout).
    pub other: Option<SqlitePool>,
    /// A pool the scheduler reads the app's rows with.
    pub read: SqlitePool,
}

const INJECTED_PANIC: &str = "injected: a bug in the application's phase";

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
}

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
    pub shared: SharedRef,
    /// Every phase's answer to its caller.
    pub told: Mutex<Vec<Told>>,
    /// Every batched other caller's write: note id and whether it was told it committed.
    pub notes: Mutex<Vec<(String, bool)>>,
    /// (step label, token) of the phases that wrote no app row (read-only runs).
    pub read_only: Mutex<std::collections::BTreeSet<(String, i64)>>,
    /// Writes still running (batched notes): awaited at quiescence.
    pub pending: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    next_note: std::sync::atomic::AtomicU64,
}

impl AtomicSim {
    pub fn new(db: Db, rng: Rng, shared: SharedRef) -> Self {
        Self {
            db,
            rng: Mutex::new(rng),
            shared,
            told: Mutex::default(),
            notes: Mutex::default(),
            read_only: Mutex::default(),
            pending: Mutex::default(),
            next_note: Default::default(),
        }
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

    /// The phase's fault, whether it is batched, and whether it writes no app row (a phase that
    /// only reads: then the step's record is its first write, which meets the other process's
    /// lock or newer snapshot).
    fn draw(&self) -> (Fault, bool, bool) {
        let mut rng = self.rng.lock().unwrap();
        let file = self.db.other.is_some();
        let w = [
            40,
            10,
            10,
            8,
            if file { 16 } else { 0 },
            if file { 16 } else { 0 },
        ];
        let fault = [
            Fault::None,
            Fault::Trigger,
            Fault::TriggerSwallowed,
            Fault::Panic,
            Fault::HoldLock,
            Fault::Snapshot,
        ][rng.weighted(&w)];
        let read_only = matches!(fault, Fault::HoldLock | Fault::Snapshot) && rng.chance(500);
        (fault, rng.chance(350), read_only)
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

/// Where a phase's writes get the token of their key's lease (the app row carries it): the
/// key is claimed inside the phase's own transaction, so from its row there (the writes may run
/// more than once, after a batch is rolled back: the last run's token is kept).
#[derive(Clone)]
struct TokenOf {
    scope: String,
    key: String,
    seen: Arc<Mutex<Option<i64>>>,
}

/// What a phase leaves to do once it has answered: let the other process go.
struct Guard {
    batched: bool,
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

impl SimPhase {
    /// Draws the phase's fault and builds the store's phase with the writes that fault makes.
    fn build(&self, token: TokenOf) -> (impl AtomicPhase + 'static + use<>, Guard) {
        let (sim, label) = (self.sim.clone(), self.label.clone());
        let (fault, batched, read_only) = sim.draw();
        sim.shared.lock().unwrap().trace.push(format!(
            "    phase of {label}: {fault:?}{}{}",
            if read_only { ", reads only" } else { "" },
            if batched {
                ", batched with others' writes"
            } else {
                ""
            }
        ));
        // The other process, for HoldLock: takes the lock when the phase says, holds it until
        // the phase has answered.
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<Ack>();
        let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
        let holder = match (&sim.db.other, fault) {
            (Some(other), Fault::HoldLock) => {
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
        let go = Arc::new(Mutex::new(Some(go_tx)));
        let other = sim.db.other.clone();
        let row_label = label.clone();
        let sim2 = sim.clone();
        let inner = sim.db.store.atomic_phase(move |conn| {
            let (go, other, row_label) = (go.clone(), other.clone(), row_label.clone());
            let (token, sim) = (token.clone(), sim2.clone());
            Box::pin(async move {
                let tok: i64 = sqlx::query_scalar(
                    "SELECT lease_token FROM idempotency_keys WHERE scope = ? AND key = ?",
                )
                .bind(&token.scope)
                .bind(&token.key)
                .fetch_one(&mut *conn)
                .await?;
                *token.seen.lock().unwrap() = Some(tok);
                if read_only {
                    sim.read_only
                        .lock()
                        .unwrap()
                        .insert((row_label.clone(), tok));
                }
                sqlx::query("SELECT count(*) FROM sim_orders")
                    .execute(&mut *conn)
                    .await?;
                match fault {
                    Fault::HoldLock => {
                        let go = go.lock().unwrap().take();
                        if let Some(go) = go {
                            let (ack, acked) = tokio::sync::oneshot::channel();
                            if go.send(ack).is_ok() {
                                let _ = acked.await;
                            }
                        }
                    }
                    Fault::Snapshot => {
                        if let Some(other) = &other {
                            let _ = sqlx::query("INSERT INTO sim_other (at) VALUES (?)")
                                .bind(&row_label)
                                .execute(other)
                                .await;
                        }
                    }
                    Fault::Trigger | Fault::TriggerSwallowed => {
                        let refused =
                            sqlx::query("INSERT INTO sim_orders (step, token) VALUES (?, ?)")
                                .bind(format!("boom/{row_label}"))
                                .bind(tok)
                                .execute(&mut *conn)
                                .await;
                        if fault == Fault::Trigger {
                            refused?;
                        }
                    }
                    Fault::None | Fault::Panic => {}
                }
                if read_only {
                    return Ok(StoredResponse::json(
                        200,
                        &serde_json::json!({"order": row_label, "token": tok, "rows": 0}),
                    )?);
                }
                sqlx::query("INSERT INTO sim_orders (step, token) VALUES (?, ?)")
                    .bind(&row_label)
                    .bind(tok)
                    .execute(&mut *conn)
                    .await?;
                if fault == Fault::Panic {
                    std::panic::panic_any(INJECTED_PANIC);
                }
                Ok(StoredResponse::json(
                    201,
                    &serde_json::json!({"order": row_label, "token": tok}),
                )?)
            })
        });
        (
            inner,
            Guard {
                batched,
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
        Store::phase_store(&self.sim.db.store).expect("a SQLite store shares its transactions")
    }

    async fn claim_and_commit(
        self: Box<Self>,
        claim: &NewClaim,
        prepare: Prepare,
    ) -> Result<OneCommit, PhaseError> {
        park("phase.one_commit", "before", &self.label).await;
        let seen = Arc::new(Mutex::new(None));
        let (inner, guard) = self.build(TokenOf {
            scope: claim.id.scope.as_str().to_owned(),
            key: claim.id.key.as_str().to_owned(),
            seen: seen.clone(),
        });
        let claim = claim.clone();
        let run = async move { Box::new(inner).claim_and_commit(&claim, prepare).await };
        let r = if guard.batched {
            batch(&self.sim, run).await
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

/// Runs `phase` in one writer batch with three other callers' writes: the writer is held by a
/// job that waits until the phase and the writes are queued behind it.
async fn batch<T: Send + 'static>(
    sim: &Arc<AtomicSim>,
    phase: impl std::future::Future<Output = Result<T, PhaseError>> + Send + 'static,
) -> Result<T, PhaseError> {
    let store = sim.db.store.clone();
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
    let phase_task = tokio::spawn(phase);
    wait_queued(&store, base + 1).await;
    for _ in 0..3 {
        let n = sim
            .next_note
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("note-{n}");
        let (store, sim2) = (store.clone(), sim.clone());
        let h = tokio::spawn(async move {
            let note = id.clone();
            let r = store
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
                .await;
            sim2.notes.lock().unwrap().push((id, r.is_ok()));
        });
        sim.pending.lock().unwrap().push(h);
    }
    wait_queued(&store, base + 4).await;
    gate.notify_one();
    let _ = held.await;
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

/// The step's state, token and app rows under that token, read in one statement (one snapshot).
pub async fn step_rows(
    pool: &SqlitePool,
    id: &KeyId,
) -> Result<Option<(String, i64, i64)>, sqlx::Error> {
    sqlx::query_as::<_, (String, i64, i64)>(
        "SELECT k.state, k.lease_token, (SELECT count(*) FROM sim_orders o \
         WHERE o.step = k.scope || '/' || k.key AND o.token = k.lease_token) \
         FROM idempotency_keys k WHERE k.scope = ? AND k.key = ?",
    )
    .bind(id.scope.as_str())
    .bind(id.key.as_str())
    .fetch_optional(pool)
    .await
}

/// Whether the app row of (`label`, `token`) is there.
pub async fn row_there(pool: &SqlitePool, label: &str, token: i64) -> Result<bool, sqlx::Error> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM sim_orders WHERE step = ? AND token = ?")
        .bind(label)
        .bind(token)
        .fetch_one(pool)
        .await?;
    Ok(n == 1)
}

/// Whether the note `id` is there.
pub async fn note_there(pool: &SqlitePool, id: &str) -> Result<bool, sqlx::Error> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM sim_notes WHERE id = ?")
        .bind(id)
        .fetch_one(pool)
        .await?;
    Ok(n == 1)
}
