//! Atomic phases: a workflow step whose effect is the application's own rows, claimed and
//! committed in one transaction with the step's record (`docs/one-commit.md`). On PostgreSQL,
//! MariaDB and SQLite: the writes and the record are there together; a write failing after the
//! insert leaves neither, not even the step's row. On PostgreSQL and MariaDB also: nobody sees
//! the step while its transaction is open, and a caller gone before the commit leaves neither;
//! the workflow's retry writes the row exactly once. (On SQLite the phase runs inside the single
//! writer's job, so nothing else can write in between, and a dropped caller does not stop a
//! started job.) Module `crash`: a process SIGKILLed during phases on all three, with a second
//! process writing.

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::support;

use std::sync::Arc;
use std::time::Duration;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use idemflow::conformance::sweeper::cut_when;
use idemflow::store::phase::AtomicPhase;
use idemflow::workflow::step_key;
use idemflow::{
    Context, Error, Idempotency, IdempotentRequest, KeyState, Outcome, Providers, Store,
    StoredResponse, Sweeper, workflow::Step,
};
use serde_json::json;

const LEASE: Duration = Duration::from_millis(400);

/// One backend's handles: the store, a phase maker writing one order row, and a row counter.
struct Backend {
    store: Arc<dyn Store>,
    /// An atomic phase inserting the order `id`; `hook` runs between the insert and the record;
    /// then the writes fail if `fail` says so.
    phase: Arc<dyn Fn(String, Hook, bool) -> Box<dyn AtomicPhase> + Send + Sync>,
    orders: Arc<dyn Fn(String) -> futures_count::CountFuture + Send + Sync>,
}

type Hook =
    Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

mod futures_count {
    pub type CountFuture = std::pin::Pin<Box<dyn std::future::Future<Output = i64> + Send>>;
}

/// A future that gives up on `inner` once it has returned `Pending` `waits` times: a caller that
/// goes away at a chosen point.
#[cfg(feature = "mysql")]
struct CutAfter<F> {
    inner: std::pin::Pin<Box<F>>,
    waits: u32,
}

#[cfg(feature = "mysql")]
impl<F: std::future::Future> CutAfter<F> {
    fn new(waits: u32, inner: F) -> Self {
        Self {
            inner: Box::pin(inner),
            waits,
        }
    }
}

#[cfg(feature = "mysql")]
impl<F: std::future::Future> std::future::Future for CutAfter<F> {
    type Output = Option<F::Output>;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.inner.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => std::task::Poll::Ready(Some(v)),
            std::task::Poll::Pending if self.waits == 0 => std::task::Poll::Ready(None),
            std::task::Poll::Pending => {
                self.waits -= 1;
                std::task::Poll::Pending
            }
        }
    }
}

fn no_hook() -> Hook {
    Arc::new(|| Box::pin(async {}))
}

fn checkout(order: &str) -> IdempotentRequest {
    IdempotentRequest::new("shop", order, "checkout", &json!({"order": order}))
        .unwrap()
        .workflow()
}

/// The workflow: create the order (the atomic phase), then a step standing for the charge.
async fn run(
    b: &Backend,
    idem: &Idempotency,
    order: &str,
    hook: Hook,
) -> Result<idemflow::Execution, Error> {
    run_failing(b, idem, order, hook, false).await
}

async fn run_failing(
    b: &Backend,
    idem: &Idempotency,
    order: &str,
    hook: Hook,
    fail: bool,
) -> Result<idemflow::Execution, Error> {
    let phase = (b.phase)(order.to_owned(), hook, fail);
    let phase = std::sync::Mutex::new(Some(phase));
    idem.execute(checkout(order), |ctx: Context| async move {
        let Some(phase) = phase.lock().unwrap().take() else {
            return Outcome::unknown("phase already used");
        };
        let step = Step::new("create_order", &json!({"order": ctx.request()})).unwrap();
        if let Err(e) = ctx.atomic_step(step, phase).await {
            return Outcome::from_step_error(&e);
        }
        let charge = Step::new("charge", &json!({"amount": 1500})).unwrap();
        match ctx
            .step(charge, |_| async {
                Outcome::Succeeded(StoredResponse::json(201, &json!({"charged": 1500})).unwrap())
            })
            .await
        {
            Ok(_) => Outcome::Succeeded(StoredResponse::json(201, &json!({"ok": true})).unwrap()),
            Err(e) => Outcome::from_step_error(&e),
        }
    })
    .await
}

async fn writes_and_record_commit_together(b: Backend) {
    let idem = Idempotency::new(b.store.clone()).lease(LEASE);
    let first = run(&b, &idem, "o-1", no_hook()).await.unwrap();
    assert!(!first.is_replay());
    assert_eq!((b.orders)("o-1".into()).await, 1);
    let step = b
        .store
        .get(&step_key(checkout("o-1").id(), 0))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(step.state, KeyState::Done);
    assert_eq!(step.kind(), idemflow::record::KeyKind::AtomicStep);
    let history = b
        .store
        .history(&step_key(checkout("o-1").id(), 0))
        .await
        .unwrap();
    assert_eq!(history.last().unwrap().to, Some(KeyState::Done));
    let again = run(&b, &idem, "o-1", no_hook()).await.unwrap();
    assert!(again.is_replay());
    assert_eq!(
        (b.orders)("o-1".into()).await,
        1,
        "the order row is written once"
    );
}

/// The writes fail after the insert: the transaction (or the phase's savepoint) rolls back, the
/// step's claim with it, the workflow becomes retryable, and its retry writes the order once.
async fn a_write_failing_after_the_insert_leaves_neither(b: Backend) {
    let idem = Idempotency::new(b.store.clone()).lease(LEASE);
    let r = run_failing(&b, &idem, "o-4", no_hook(), true).await;
    assert!(matches!(r, Err(Error::FailedRetryable { .. })), "{r:?}");
    assert_eq!((b.orders)("o-4".into()).await, 0, "the insert rolled back");
    let step = step_key(checkout("o-4").id(), 0);
    assert!(
        b.store.get(&step).await.unwrap().is_none(),
        "the step's claim rolled back with the writes"
    );
    let done = run(&b, &idem, "o-4", no_hook()).await.unwrap();
    assert!(!done.is_replay());
    assert_eq!((b.orders)("o-4".into()).await, 1, "written once");
    let again = run(&b, &idem, "o-4", no_hook()).await.unwrap();
    assert!(again.is_replay());
    assert_eq!((b.orders)("o-4".into()).await, 1);
}

/// Nobody sees the step while its transaction is open: between the order's insert and the
/// commit, another connection finds neither the step's row nor the order; after it, both.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn the_step_is_invisible_until_its_commit(b: Backend) {
    let idem = Idempotency::new(b.store.clone()).lease(LEASE);
    let (store, orders) = (b.store.clone(), b.orders.clone());
    let step = step_key(checkout("o-2").id(), 0);
    let seen = Arc::new(std::sync::Mutex::new(None));
    let hook: Hook = {
        let seen = seen.clone();
        Arc::new(move || {
            let (store, step, orders, seen) =
                (store.clone(), step.clone(), orders.clone(), seen.clone());
            Box::pin(async move {
                let row = store.get(&step).await.unwrap().map(|r| r.state);
                let rows = orders("o-2".into()).await;
                *seen.lock().unwrap() = Some((row, rows));
            })
        })
    };
    let done = run(&b, &idem, "o-2", hook).await.unwrap();
    assert!(!done.is_replay());
    assert_eq!(
        *seen.lock().unwrap(),
        Some((None, 0)),
        "(the step's row, the order rows) seen from outside the open transaction"
    );
    assert_eq!(
        b.store
            .get(&step_key(checkout("o-2").id(), 0))
            .await
            .unwrap()
            .map(|r| r.state),
        Some(KeyState::Done)
    );
    assert_eq!((b.orders)("o-2".into()).await, 1);
}

/// The caller goes away after the insert, and the phase hangs before its record: nothing was
/// committed and nothing is seen (no step row, no order); the hung phase is cut off after the
/// phase timeout, and the workflow's retry (once it has waited for the hung transaction's row
/// lock, or been told to retry while it was held) writes the order once. (A killed process: the
/// crash tests.)
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn a_crash_before_the_commit_leaves_neither(b: Backend) {
    let idem = Idempotency::new(b.store.clone()).lease(LEASE);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let tx = Arc::new(std::sync::Mutex::new(Some(tx)));
    let hook: Hook = Arc::new(move || {
        let tx = tx.clone();
        Box::pin(async move {
            if let Some(tx) = tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            std::future::pending::<()>().await;
        })
    });
    cut_when(run(&b, &idem, "o-3", hook), rx).await;
    assert_eq!((b.orders)("o-3".into()).await, 0);
    let step = step_key(checkout("o-3").id(), 0);
    assert!(b.store.get(&step).await.unwrap().is_none(), "no step row");
    // Nothing for the sweeper to settle: the step never committed `processing`.
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let report = Sweeper::new(b.store.clone(), Providers::new())
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.retryable, 0, "{report:?}");
    // The retry may meet the hung transaction still holding the step's row lock (up to the
    // phase timeout): then it is told to retry, and the next retry writes the order.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let done = loop {
        match run(&b, &idem, "o-3", no_hook()).await {
            Ok(done) => break done,
            Err(e) if tokio::time::Instant::now() < deadline => {
                assert_eq!((b.orders)("o-3".into()).await, 0, "{e}");
                tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the retry never went through: {e}"),
        }
    };
    assert!(!done.is_replay());
    assert_eq!((b.orders)("o-3".into()).await, 1);
    let again = run(&b, &idem, "o-3", no_hook()).await.unwrap();
    assert!(again.is_replay());
    assert_eq!((b.orders)("o-3".into()).await, 1);
}

macro_rules! atomic_tests {
    ($factory:path; always) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn writes_and_record_commit_together() {
            let Some(b) = $factory().await else { return };
            super::writes_and_record_commit_together(b).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_write_failing_after_the_insert_leaves_neither() {
            let Some(b) = $factory().await else { return };
            super::a_write_failing_after_the_insert_leaves_neither(b).await;
        }
    };
    ($factory:path) => {
        atomic_tests!($factory; always);
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_step_is_invisible_until_its_commit() {
            let Some(b) = $factory().await else { return };
            super::the_step_is_invisible_until_its_commit(b).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_crash_before_the_commit_leaves_neither() {
            let Some(b) = $factory().await else { return };
            super::a_crash_before_the_commit_leaves_neither(b).await;
        }
    };
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use idemflow::store::postgres::PostgresStore;

    async fn backend() -> Option<Backend> {
        let (url, schema) = support::postgres::fresh_schema().await?;
        let pool = support::postgres::pool_in(&url, &schema, 8).await;
        sqlx::query("CREATE TABLE orders (id text PRIMARY KEY, amount bigint NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let store = PostgresStore::from_pool(pool.clone());
        store.migrate().await.unwrap();
        let phase_store = store.clone();
        let count_pool = pool.clone();
        Some(Backend {
            store: Arc::new(store),
            phase: Arc::new(move |id: String, hook: Hook, fail: bool| {
                Box::new(phase_store.atomic_phase(move |tx| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, 1500)")
                            .bind(&id)
                            .execute(&mut *tx)
                            .await?;
                        hook().await;
                        if fail {
                            return Err("injected: the write after the insert failed".into());
                        }
                        Ok(StoredResponse::json(201, &json!({"order": id}))?)
                    })
                })) as Box<dyn AtomicPhase>
            }),
            orders: Arc::new(move |id: String| {
                let pool = count_pool.clone();
                Box::pin(async move {
                    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE id = $1")
                        .bind(id)
                        .fetch_one(&pool)
                        .await
                        .unwrap()
                })
            }),
        })
    }

    atomic_tests!(backend);
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use idemflow::store::mysql::MySqlStore;

    async fn backend() -> Option<Backend> {
        let (options, _name) = support::mysql::fresh_database().await?;
        let pool = support::mysql::pool_for(&options, 8).await;
        sqlx::query("CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY, amount BIGINT NOT NULL) ENGINE=InnoDB")
            .execute(&pool)
            .await
            .unwrap();
        let store = MySqlStore::from_pool(pool.clone());
        store.migrate().await.unwrap();
        let phase_store = store.clone();
        let count_pool = pool.clone();
        Some(Backend {
            store: Arc::new(store),
            phase: Arc::new(move |id: String, hook: Hook, fail: bool| {
                Box::new(phase_store.atomic_phase(move |tx| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO orders (id, amount) VALUES (?, 1500)")
                            .bind(&id)
                            .execute(&mut *tx)
                            .await?;
                        hook().await;
                        if fail {
                            return Err("injected: the write after the insert failed".into());
                        }
                        Ok(StoredResponse::json(201, &json!({"order": id}))?)
                    })
                })) as Box<dyn AtomicPhase>
            }),
            orders: Arc::new(move |id: String| {
                let pool = count_pool.clone();
                Box::pin(async move {
                    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE id = ?")
                        .bind(id)
                        .fetch_one(&pool)
                        .await
                        .unwrap()
                })
            }),
        })
    }

    atomic_tests!(backend);

    /// A caller that stops waiting at any point of a phase (its `BEGIN` on the wire included)
    /// leaves no pooled connection inside a transaction: an autocommit write on the same pool
    /// right after is visible to another connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_phase_cut_off_anywhere_leaves_no_connection_in_a_transaction() {
        use idemflow::store::NewClaim;
        use idemflow::store::phase::Prepare;
        let Some((options, _name)) = support::mysql::fresh_database().await else {
            return;
        };
        // One connection, so every cut lands on the connection the next write uses.
        let pool = support::mysql::pool_for(&options, 1).await;
        let probe = support::mysql::pool_for(&options, 1).await;
        for ddl in [
            "CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY, amount BIGINT NOT NULL) ENGINE=InnoDB",
            "CREATE TABLE notes (id VARCHAR(64) PRIMARY KEY) ENGINE=InnoDB",
        ] {
            sqlx::query(ddl).execute(&pool).await.unwrap();
        }
        let store = MySqlStore::from_pool(pool.clone());
        store.migrate().await.unwrap();
        for i in 0..160u64 {
            let id = idemflow::KeyId::new(
                idemflow::key::Scope::new("shop").unwrap(),
                idemflow::key::IdempotencyKey::new(format!("cut-{i}")).unwrap(),
            );
            let claim = NewClaim {
                id: id.clone(),
                operation: "create_order".into(),
                provider: idemflow::record::KeyKind::AtomicStep
                    .marker()
                    .map(Into::into),
                provider_key: format!("pk-cut-{i}"),
                renewed_key_base: None,
                fingerprint: idemflow::fingerprint::Fingerprint::compute("create_order", "{}"),
                request: None,
                owner: "test".into(),
                lease: Duration::from_secs(60),
                retention: Duration::from_secs(3600),
                takeover_window: None,
            };
            let order = format!("o-cut-{i}");
            let phase = store.atomic_phase(move |tx| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO orders (id, amount) VALUES (?, 1)")
                        .bind(&order)
                        .execute(&mut *tx)
                        .await?;
                    Ok(StoredResponse::new(201))
                })
            });
            let prepare: Prepare = Arc::new(Ok);
            // Cut after the phase has waited `cut` times (for the pool, `BEGIN`'s reply, the
            // insert's, ...): some cuts land while `BEGIN` is on the wire.
            let cut = (i % 8) as u32;
            let _ = CutAfter::new(cut, Box::new(phase).claim_and_commit(&claim, prepare)).await;
            let note = format!("n-{i}");
            if let Err(e) = sqlx::query("INSERT INTO notes (id) VALUES (?)")
                .bind(&note)
                .execute(&pool)
                .await
            {
                panic!("cut after {cut} waits: the pool's next write failed: {e}");
            }
            let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM notes WHERE id = ?")
                .bind(&note)
                .fetch_one(&probe)
                .await
                .unwrap();
            assert_eq!(
                seen, 1,
                "cut after {cut} waits: an autocommit write stayed inside a transaction left open"
            );
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use idemflow::store::sqlite::SqliteStore;

    async fn backend() -> Option<Backend> {
        let dir = tempfile::tempdir().unwrap().keep();
        let url = format!("sqlite://{}", dir.join("shop.db").display());
        let store = SqliteStore::connect(&url).await.unwrap();
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL)")
            .execute(store.writer_pool())
            .await
            .unwrap();
        let phase_store = store.clone();
        let count_pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        Some(Backend {
            store: Arc::new(store),
            phase: Arc::new(move |id: String, _hook: Hook, fail: bool| {
                Box::new(phase_store.atomic_phase(move |tx| {
                    let id = id.clone();
                    Box::pin(async move {
                        sqlx::query("INSERT INTO orders (id, amount) VALUES (?, 1500)")
                            .bind(&id)
                            .execute(&mut *tx)
                            .await?;
                        if fail {
                            return Err("injected: the write after the insert failed".into());
                        }
                        Ok(StoredResponse::json(201, &json!({"order": id}))?)
                    })
                })) as Box<dyn AtomicPhase>
            }),
            orders: Arc::new(move |id: String| {
                let pool = count_pool.clone();
                Box::pin(async move {
                    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE id = ?")
                        .bind(id)
                        .fetch_one(&pool)
                        .await
                        .unwrap()
                })
            }),
        })
    }

    atomic_tests!(backend; always);
}

/// SQLite: the application's phase code runs on the store's single writer connection, so
/// nothing it does (a lock held by another process, a trigger ending the transaction, a panic,
/// a write through the same store, a hang) may leave that connection in a state that loses or
/// refuses later writes, or tell a caller the opposite of what committed
/// (`docs/reliability.md`, "Atomic phases on SQLite").
#[cfg(feature = "sqlite")]
mod sqlite_writer {
    use super::*;
    use idemflow::store::NewClaim;
    use idemflow::store::phase::Prepare;
    use idemflow::store::sqlite::{SqliteConfig, SqliteStore};
    use idemflow::{KeyId, fingerprint::Fingerprint};
    use sqlx::SqliteConnection;
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;

    struct Db {
        url: String,
        store: SqliteStore,
        /// Another connection to the same file: a second process.
        other: sqlx::SqlitePool,
    }

    async fn db(config: impl FnOnce(SqliteConfig) -> SqliteConfig) -> Db {
        let dir = tempfile::tempdir().unwrap().keep();
        let url = format!("sqlite://{}", dir.join("shop.db").display());
        let store = SqliteStore::connect_with(config(
            SqliteConfig::new(&url).busy_timeout(Duration::from_millis(300)),
        ))
        .await
        .unwrap();
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL)")
            .execute(store.writer_pool())
            .await
            .unwrap();
        sqlx::query(
            "CREATE TRIGGER orders_refused BEFORE INSERT ON orders WHEN NEW.id LIKE 'boom%' \
             BEGIN SELECT RAISE(ROLLBACK, 'order refused by a trigger'); END",
        )
        .execute(store.writer_pool())
        .await
        .unwrap();
        sqlx::query("CREATE TABLE notes (id TEXT PRIMARY KEY)")
            .execute(store.writer_pool())
            .await
            .unwrap();
        let other = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                SqliteConnectOptions::from_str(&url)
                    .unwrap()
                    .busy_timeout(Duration::from_millis(50)),
            )
            .await
            .unwrap();
        Db { url, store, other }
    }

    async fn count(pool: &sqlx::SqlitePool, table: &str, id: &str) -> i64 {
        let sql = match table {
            "orders" => "SELECT count(*) FROM orders WHERE id = ?",
            _ => "SELECT count(*) FROM notes WHERE id = ?",
        };
        sqlx::query_scalar::<_, i64>(sql)
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    /// A phase inserting the order `id`, after running `during` on the writer's connection.
    fn phase<D>(store: &SqliteStore, id: &str, during: D) -> Box<dyn AtomicPhase>
    where
        D: for<'c> Fn(&'c mut SqliteConnection) -> idemflow::store::phase::WritesFuture<'c>
            + Send
            + Sync
            + 'static,
    {
        let id = id.to_owned();
        let during = Arc::new(during);
        Box::new(store.atomic_phase(move |conn| {
            let (id, during) = (id.clone(), during.clone());
            Box::pin(async move {
                during(&mut *conn).await?;
                if id.is_empty() {
                    // Reads only: the step's record is the phase's first write.
                    return Ok(StoredResponse::new(200));
                }
                sqlx::query("INSERT INTO orders (id, amount) VALUES (?, 1500)")
                    .bind(&id)
                    .execute(&mut *conn)
                    .await?;
                Ok(StoredResponse::json(201, &json!({"order": id}))?)
            })
        }))
    }

    fn nothing(_: &mut SqliteConnection) -> idemflow::store::phase::WritesFuture<'_> {
        Box::pin(async { Ok(StoredResponse::new(200)) })
    }

    /// Runs a workflow whose one step is `phase`.
    async fn run_phase(
        idem: &Idempotency,
        order: &str,
        phase: Box<dyn AtomicPhase>,
    ) -> Result<idemflow::Execution, Error> {
        let phase = std::sync::Mutex::new(Some(phase));
        idem.execute(checkout(order), |ctx: Context| async move {
            let Some(phase) = phase.lock().unwrap().take() else {
                return Outcome::unknown("phase already used");
            };
            let step = Step::new("create_order", &json!({"order": ctx.request()})).unwrap();
            match ctx.atomic_step(step, phase).await {
                Ok(e) => Outcome::Succeeded(e.into_response()),
                Err(e) => Outcome::from_step_error(&e),
            }
        })
        .await
    }

    /// A plain key, executed and acknowledged.
    async fn plain(idem: &Idempotency, key: &str) -> Result<idemflow::Execution, Error> {
        idem.execute(
            IdempotentRequest::new("shop", key, "note", &json!({"k": key})).unwrap(),
            |_| async { Outcome::Succeeded(StoredResponse::new(204)) },
        )
        .await
    }

    /// Reopens the database (a restart) and reads `key`.
    async fn after_restart(url: &str, key: &str) -> Option<KeyState> {
        let reopened = SqliteStore::connect(url).await.unwrap();
        reopened
            .get(&KeyId::new(
                idemflow::key::Scope::new("shop").unwrap(),
                idemflow::key::IdempotencyKey::new(key).unwrap(),
            ))
            .await
            .unwrap()
            .map(|r| r.state)
    }

    /// A second process holds the write lock while a lone phase runs: the phase's record write
    /// cannot take the lock. No transaction may stay open on the writer's connection: later
    /// acknowledged writes must be in the file after a restart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_phase_meeting_another_writer_leaves_no_transaction_open() {
        let d = db(|c| c).await;
        let idem = Idempotency::new(Arc::new(d.store.clone())).lease(LEASE);
        // The other process takes the write lock (if it can) from inside the phase, and keeps
        // it until told to let go.
        let (go, mut go_rx) = tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>(1);
        let (release, release_rx) = tokio::sync::oneshot::channel::<()>();
        let other = d.other.clone();
        let holder = tokio::spawn(async move {
            let mut conn = other.acquire().await.unwrap();
            let ack = go_rx.recv().await.unwrap();
            let took = sqlx::query("BEGIN IMMEDIATE")
                .execute(&mut *conn)
                .await
                .is_ok();
            let _ = ack.send(());
            let _ = release_rx.await;
            if took {
                sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
            }
        });
        let go = Arc::new(go);
        let p = phase(&d.store, "", move |conn| {
            let go = go.clone();
            Box::pin(async move {
                sqlx::query("SELECT count(*) FROM orders")
                    .execute(&mut *conn)
                    .await?;
                let (ack, acked) = tokio::sync::oneshot::channel();
                if go.send(ack).await.is_ok() {
                    let _ = acked.await;
                }
                Ok(StoredResponse::new(200))
            })
        });
        let first = run_phase(&idem, "o-busy", p).await;
        let _ = release.send(());
        holder.await.unwrap();
        // Whatever the phase was told, the store's next writes must commit.
        let later = plain(&idem, "after-busy").await;
        assert!(later.is_ok(), "phase: {first:?}; later write: {later:?}");
        assert_eq!(
            after_restart(&d.url, "after-busy").await,
            Some(KeyState::Done),
            "an acknowledged key is gone after a restart (phase: {first:?})"
        );
    }

    /// The phase reads, then another process commits a write: the phase's snapshot is stale, so
    /// its record write would get `SQLITE_BUSY_SNAPSHOT`. No later write of the store may fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_phase_overtaken_by_another_process_breaks_no_later_write() {
        let d = db(|c| c).await;
        let idem = Idempotency::new(Arc::new(d.store.clone())).lease(LEASE);
        let other = d.other.clone();
        let p = phase(&d.store, "", move |conn| {
            let other = other.clone();
            Box::pin(async move {
                sqlx::query("SELECT count(*) FROM orders")
                    .execute(&mut *conn)
                    .await?;
                // The other process's write: it commits unless the phase holds the lock.
                let _ = sqlx::query("INSERT INTO notes (id) VALUES ('from-other')")
                    .execute(&other)
                    .await;
                Ok(StoredResponse::new(200))
            })
        });
        let first = run_phase(&idem, "o-snap", p).await;
        for i in 0..3 {
            let key = format!("after-snap-{i}");
            let later = plain(&idem, &key).await;
            assert!(later.is_ok(), "phase: {first:?}; write {i}: {later:?}");
            assert_eq!(after_restart(&d.url, &key).await, Some(KeyState::Done));
        }
    }

    /// A panic in the application's writes fails that step only: the writer lives on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_phase_fails_its_step_and_the_store_lives() {
        let d = db(|c| c).await;
        let idem = Idempotency::new(Arc::new(d.store.clone())).lease(LEASE);
        let p = phase(&d.store, "o-panic", |_conn| {
            Box::pin(async { panic!("injected: a bug in the application's phase") })
        });
        let first = run_phase(&idem, "o-panic", p).await;
        assert!(
            matches!(first, Err(Error::FailedRetryable { .. })),
            "{first:?}"
        );
        assert_eq!(count(d.store.writer_pool(), "orders", "o-panic").await, 0);
        let later = plain(&idem, "after-panic").await;
        assert!(later.is_ok(), "{later:?}");
        // The step may run again, and then writes its order once.
        let again = run_phase(&idem, "o-panic", phase(&d.store, "o-panic", nothing)).await;
        assert!(again.is_ok(), "{again:?}");
        assert_eq!(count(d.store.writer_pool(), "orders", "o-panic").await, 1);
    }

    /// A phase that writes through its own store would wait for the writer it runs on: it gets
    /// a clear error at once instead of a deadlock of every write.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_phase_writing_through_its_own_store_gets_an_error_not_a_deadlock() {
        let d = db(|c| c).await;
        let store: Arc<dyn Store> = Arc::new(d.store.clone());
        let idem = Idempotency::new(store.clone()).lease(LEASE);
        let inner = store.clone();
        let p = phase(&d.store, "o-reenter", move |_conn| {
            let inner = inner.clone();
            Box::pin(async move {
                inner.purge_expired(10).await?;
                Ok(StoredResponse::new(200))
            })
        });
        let first = tokio::time::timeout(Duration::from_secs(60), run_phase(&idem, "o-reenter", p))
            .await
            .expect("a phase writing through its own store deadlocked the writer");
        let Err(Error::FailedRetryable { reason, .. }) = &first else {
            panic!("{first:?}");
        };
        assert!(reason.contains("inside an atomic phase"), "{reason}");
        let later = plain(&idem, "after-reenter").await;
        assert!(later.is_ok(), "{later:?}");
    }

    /// A phase that hangs is cut off after the store's phase timeout and rolled back; every
    /// other write goes on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hanging_phase_is_cut_off_and_the_store_lives() {
        let d = db(|c| c.phase_timeout(Duration::from_millis(300))).await;
        let idem = Idempotency::new(Arc::new(d.store.clone())).lease(LEASE);
        let p = phase(&d.store, "o-hang", |_conn| {
            Box::pin(async {
                std::future::pending::<()>().await;
                Ok(StoredResponse::new(200))
            })
        });
        let first = tokio::time::timeout(Duration::from_secs(60), run_phase(&idem, "o-hang", p))
            .await
            .expect("a hanging phase held the writer");
        assert!(
            matches!(first, Err(Error::FailedRetryable { .. })),
            "{first:?}"
        );
        let later = plain(&idem, "after-hang").await;
        assert!(later.is_ok(), "{later:?}");
        assert_eq!(count(d.store.writer_pool(), "orders", "o-hang").await, 0);
    }

    /// A phase stuck in one statement that never ends (a recursive query without a bound): the
    /// phase timeout interrupts the statement on the connection's thread, so the writer rolls
    /// the phase back at once and every other write goes on; the statement is not left running
    /// with the write lock held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_phase_stuck_in_a_statement_is_interrupted_and_the_store_lives() {
        let d = db(|c| c.phase_timeout(Duration::from_millis(300))).await;
        let idem = Idempotency::new(Arc::new(d.store.clone())).lease(LEASE);
        let p = phase(&d.store, "o-stuck", |conn| {
            Box::pin(async move {
                sqlx::query(
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) \
                     SELECT count(*) FROM n",
                )
                .execute(&mut *conn)
                .await?;
                Ok(StoredResponse::new(200))
            })
        });
        let first = tokio::time::timeout(Duration::from_secs(60), run_phase(&idem, "o-stuck", p))
            .await
            .expect("a phase stuck in a statement held the writer");
        assert!(
            matches!(first, Err(Error::FailedRetryable { .. })),
            "{first:?}"
        );
        // Without the interrupt, this write queues behind the statement for good.
        let later = tokio::time::timeout(Duration::from_secs(30), plain(&idem, "after-stuck"))
            .await
            .expect("a write after the cut-off phase waited behind its statement");
        assert!(later.is_ok(), "{later:?}");
        assert_eq!(count(d.store.writer_pool(), "orders", "o-stuck").await, 0);
        // The interrupt was for the cut-off statement only: a long statement of a later phase
        // (here well inside the timeout) runs to its end.
        let p = phase(&d.store, "o-long", |conn| {
            Box::pin(async move {
                sqlx::query(
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n \
                     WHERE i < 20000) SELECT count(*) FROM n",
                )
                .execute(&mut *conn)
                .await?;
                Ok(StoredResponse::new(200))
            })
        });
        let long = run_phase(&idem, "o-long", p).await;
        assert!(long.is_ok(), "{long:?}");
    }

    /// An atomic step's answer over the executor's response cap: refused, and its writes rolled
    /// back with the step's claim, as `Idempotency::execute_atomic` refuses an oversized answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_atomic_step_answer_over_the_cap_is_refused_and_rolled_back() {
        let d = db(|c| c).await;
        let idem = Idempotency::new(Arc::new(d.store.clone()))
            .lease(LEASE)
            .max_response_bytes(64);
        let id = "o-big".to_owned();
        let p: Box<dyn AtomicPhase> = Box::new(d.store.atomic_phase(move |conn| {
            let id = id.clone();
            Box::pin(async move {
                sqlx::query("INSERT INTO orders (id, amount) VALUES (?, 1500)")
                    .bind(&id)
                    .execute(&mut *conn)
                    .await?;
                Ok(StoredResponse::json(
                    201,
                    &json!({"order": id, "pad": "x".repeat(500)}),
                )?)
            })
        }));
        let r = run_phase(&idem, "o-big", p).await;
        let Err(e) = &r else { panic!("{r:?}") };
        assert!(e.to_string().contains("exceeds the cap of 64 bytes"), "{e}");
        assert_eq!(count(d.store.writer_pool(), "orders", "o-big").await, 0);
        let step = d
            .store
            .get(&step_key(checkout("o-big").id(), 0))
            .await
            .unwrap();
        assert!(step.is_none(), "rolled back with its claim: {step:?}");
    }

    /// The claim of a step-like key, for driving `AtomicPhase::claim_and_commit` by hand.
    fn claim_of(key: &str) -> NewClaim {
        let id = KeyId::new(
            idemflow::key::Scope::new("shop").unwrap(),
            idemflow::key::IdempotencyKey::new(key).unwrap(),
        );
        NewClaim {
            id,
            operation: "create_order".into(),
            provider: idemflow::record::KeyKind::AtomicStep
                .marker()
                .map(Into::into),
            provider_key: format!("pk-{key}"),
            renewed_key_base: None,
            fingerprint: Fingerprint::compute("create_order", key),
            request: None,
            owner: "test".into(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(3600),
            takeover_window: None,
        }
    }

    /// A phase in a batch of writes whose statements end the whole transaction (a trigger's
    /// `RAISE(ROLLBACK)`): the other writes of the batch are told the truth (success only for
    /// what committed, failure only for what did not), and the phase's rows exist exactly when
    /// its step is `done`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_phase_ending_its_batch_transaction_misleads_no_caller() {
        for swallow in [false, true] {
            let d = db(|c| c).await;
            let store = d.store.clone();
            let claim = claim_of("boom-step");
            let step = claim.id.clone();
            // Hold the writer (a job that waits) so the phase and the inserts after it queue
            // up and share the next batch.
            let gate = Arc::new(tokio::sync::Notify::new());
            let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
            let started_tx = Arc::new(std::sync::Mutex::new(Some(started_tx)));
            let held = {
                let (store, gate) = (store.clone(), gate.clone());
                tokio::spawn(async move {
                    store
                        .write_job(move |_conn| {
                            let (gate, started_tx) = (gate.clone(), started_tx.clone());
                            Box::pin(async move {
                                if let Some(tx) = started_tx.lock().unwrap().take() {
                                    let _ = tx.send(());
                                }
                                gate.notified().await;
                                Ok(())
                            })
                        })
                        .await
                })
            };
            started.await.unwrap();
            let phase_task = {
                let store = store.clone();
                tokio::spawn(async move {
                    let p = store.atomic_phase(move |conn| {
                        Box::pin(async move {
                            let refused =
                                sqlx::query("INSERT INTO orders (id, amount) VALUES ('boom-1', 1)")
                                    .execute(&mut *conn)
                                    .await;
                            if !swallow {
                                refused?;
                            }
                            sqlx::query("INSERT INTO orders (id, amount) VALUES ('after-boom', 1)")
                                .execute(&mut *conn)
                                .await?;
                            Ok(StoredResponse::new(201))
                        })
                    });
                    let prepare: Prepare = Arc::new(Ok);
                    Box::new(p).claim_and_commit(&claim, prepare).await
                })
            };
            while store.writer_stats().queued < 1 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let mut inserts = Vec::new();
            for i in 0..10 {
                let store = store.clone();
                inserts.push(tokio::spawn(async move {
                    let id = format!("n-{i}");
                    let r = store
                        .write_job(move |conn| {
                            let id = id.clone();
                            Box::pin(async move {
                                sqlx::query("INSERT INTO notes (id) VALUES (?)")
                                    .bind(&id)
                                    .execute(&mut *conn)
                                    .await
                                    .map_err(|e| idemflow::StoreError::database("sqlite", e))?;
                                Ok(())
                            })
                        })
                        .await;
                    (i, r)
                }));
            }
            while store.writer_stats().queued < 11 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            gate.notify_one();
            held.await.unwrap().unwrap();
            let phase_result = phase_task.await.unwrap();
            let reopened = sqlx::SqlitePool::connect(&d.url).await.unwrap();
            for task in inserts {
                let (i, r) = task.await.unwrap();
                let there = count(&reopened, "notes", &format!("n-{i}")).await == 1;
                assert_eq!(
                    r.is_ok(),
                    there,
                    "swallow={swallow}: insert {i} was told {r:?} but its row is {}",
                    if there { "there" } else { "absent" }
                );
            }
            let step_done =
                store.get(&step).await.unwrap().map(|r| r.state) == Some(KeyState::Done);
            let rows = count(&reopened, "orders", "after-boom").await;
            assert_eq!(
                rows == 1,
                step_done,
                "swallow={swallow}: phase {phase_result:?}: rows {rows}, step done {step_done}"
            );
            assert!(phase_result.is_err(), "swallow={swallow}: {phase_result:?}");
            // Told that nothing of it was written: nothing of it may have committed.
            assert_eq!(
                (rows, step_done),
                (0, false),
                "swallow={swallow}: the phase was told {phase_result:?}"
            );
        }
    }
}

/// A real crash test of atomic phases: a child process (this test binary, selected by
/// [`crash::CHILD`]) runs 16 checkout workflows at a time (an atomic phase inserting the order's
/// row and bumping a shared tally row, then a plain step standing for the charge), with a
/// sweeper and resumer of its own, while this process writes other keys and the same tally row
/// through a store handle of its own on the same database. The child is SIGKILLed at a random
/// moment after it has acknowledged some phases, three times, each restart retrying every order
/// with the same key. After each kill the database is reopened and every order is checked: its
/// row exists exactly once when its `create_order` step is `done` and not at all otherwise, every
/// acknowledged phase or workflow is `done`, and the step's history ends in the step's state with
/// nothing after `done`. Then a sweeper and client retries here finish every order, once.
/// The orders table has no key, so a phase committed twice would show as two rows.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod crash {
    use super::*;
    use std::collections::{BTreeSet, VecDeque};
    use std::io::{BufRead, BufReader};
    use std::path::PathBuf;
    use std::process::Stdio;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// The environment variable naming the child's database ([`Target::encode`]).
    pub const CHILD: &str = "IDEMFLOW_ATOMIC_CRASH_CHILD";
    /// The child's shuffle seed.
    const CHILD_SEED: &str = "IDEMFLOW_ATOMIC_CRASH_CHILD_SEED";
    /// Set to replay a run: the seed of the kill points and the child's order shuffles.
    const SEED: &str = "IDEMFLOW_ATOMIC_CRASH_SEED";
    const ORDERS: usize = 96;
    const CONCURRENCY: usize = 16;
    const KILLS: usize = 3;
    const CRASH_LEASE: Duration = Duration::from_millis(1500);

    type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;
    type PhaseMaker = Arc<dyn Fn(String) -> Box<dyn AtomicPhase> + Send + Sync>;

    /// SplitMix64: the seeded choices of a run.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    #[derive(Clone, Debug)]
    pub enum Target {
        Sqlite(PathBuf),
        /// URL and schema.
        Postgres(String, String),
        /// Server URL and database name.
        Mysql(String, String),
    }

    impl Target {
        fn encode(&self) -> String {
            match self {
                Target::Sqlite(p) => format!("sqlite\t{}", p.display()),
                Target::Postgres(u, s) => format!("postgres\t{s}\t{u}"),
                Target::Mysql(u, d) => format!("mysql\t{d}\t{u}"),
            }
        }
        fn decode(s: &str) -> Target {
            let parts: Vec<&str> = s.splitn(3, '\t').collect();
            match parts.as_slice() {
                ["sqlite", p] => Target::Sqlite(PathBuf::from(p)),
                ["postgres", s, u] => Target::Postgres((*u).into(), (*s).into()),
                ["mysql", d, u] => Target::Mysql((*u).into(), (*d).into()),
                _ => panic!("{CHILD}={s:?} names no database"),
            }
        }
    }

    /// One process's handles on the database.
    struct Db {
        store: Arc<dyn Store>,
        phase: PhaseMaker,
        /// The number of rows of an order.
        rows: Arc<dyn Fn(String) -> BoxFuture<i64> + Send + Sync>,
        /// An application write outside any phase on the tally row every phase updates.
        bump: Arc<dyn Fn() -> BoxFuture<Result<(), String>> + Send + Sync>,
        /// How many of these server sessions (printed by a child as `conn <id>`) are still open.
        alive: Arc<dyn Fn(Vec<u64>) -> BoxFuture<usize> + Send + Sync>,
    }

    fn order_name(i: usize) -> String {
        format!("crash-{i:03}")
    }

    /// Creates the application's tables next to idemflow's.
    async fn set_up(target: &Target) {
        let ddl: [&'static str; 3] = match target {
            Target::Mysql(..) => [
                "CREATE TABLE orders (id VARCHAR(64) NOT NULL, amount BIGINT NOT NULL, KEY (id)) ENGINE=InnoDB",
                "CREATE TABLE tally (id INT PRIMARY KEY, n BIGINT NOT NULL) ENGINE=InnoDB",
                "INSERT INTO tally (id, n) VALUES (1, 0)",
            ],
            _ => [
                "CREATE TABLE orders (id TEXT NOT NULL, amount BIGINT NOT NULL)",
                "CREATE TABLE tally (id INTEGER PRIMARY KEY, n BIGINT NOT NULL)",
                "INSERT INTO tally (id, n) VALUES (1, 0)",
            ],
        };
        match target {
            #[cfg(feature = "sqlite")]
            Target::Sqlite(path) => {
                let store = idemflow::store::sqlite::SqliteStore::connect(&sqlite_url(path))
                    .await
                    .unwrap();
                store.migrate().await.unwrap();
                for q in ddl {
                    sqlx::query(q).execute(store.writer_pool()).await.unwrap();
                }
            }
            #[cfg(feature = "postgres")]
            Target::Postgres(url, schema) => {
                let pool = support::postgres::pool_in(url, schema, 2).await;
                idemflow::store::postgres::PostgresStore::from_pool(pool.clone())
                    .migrate()
                    .await
                    .unwrap();
                for q in ddl {
                    sqlx::query(q).execute(&pool).await.unwrap();
                }
            }
            #[cfg(feature = "mysql")]
            Target::Mysql(url, name) => {
                use std::str::FromStr;
                let options = sqlx::mysql::MySqlConnectOptions::from_str(url)
                    .unwrap()
                    .database(name);
                let pool = support::mysql::pool_for(&options, 2).await;
                idemflow::store::mysql::MySqlStore::from_pool(pool.clone())
                    .migrate()
                    .await
                    .unwrap();
                for q in ddl {
                    sqlx::query(q).execute(&pool).await.unwrap();
                }
            }
            #[allow(unreachable_patterns)]
            other => panic!("{other:?}: backend not compiled in"),
        }
    }

    #[cfg(feature = "sqlite")]
    fn sqlite_url(path: &std::path::Path) -> String {
        format!("sqlite://{}", path.display())
    }

    /// Opens the database; `child` prints each server session it opens (`conn <id>`), so the
    /// parent can wait until the killed child's sessions are gone before it reads.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        allow(unused_variables)
    )]
    async fn open(target: &Target, child: bool) -> Db {
        match target {
            #[cfg(feature = "sqlite")]
            Target::Sqlite(path) => {
                use idemflow::store::sqlite::SqliteStore;
                let url = sqlite_url(path);
                let store = SqliteStore::connect(&url).await.unwrap();
                let app = {
                    use std::str::FromStr;
                    sqlx::sqlite::SqlitePoolOptions::new()
                        .max_connections(2)
                        .connect_with(
                            sqlx::sqlite::SqliteConnectOptions::from_str(&url)
                                .unwrap()
                                .busy_timeout(Duration::from_secs(5)),
                        )
                        .await
                        .unwrap()
                };
                let phase_store = store.clone();
                let (rows_pool, bump_pool) = (app.clone(), app);
                Db {
                    store: Arc::new(store),
                    phase: Arc::new(move |id: String| {
                        Box::new(phase_store.atomic_phase(move |conn| {
                            let id = id.clone();
                            Box::pin(async move {
                                sqlx::query("INSERT INTO orders (id, amount) VALUES (?, 1500)")
                                    .bind(&id)
                                    .execute(&mut *conn)
                                    .await?;
                                sqlx::query("UPDATE tally SET n = n + 1 WHERE id = 1")
                                    .execute(&mut *conn)
                                    .await?;
                                Ok(StoredResponse::json(201, &json!({"order": id}))?)
                            })
                        })) as Box<dyn AtomicPhase>
                    }),
                    rows: Arc::new(move |id| {
                        let pool = rows_pool.clone();
                        Box::pin(async move {
                            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE id = ?")
                                .bind(id)
                                .fetch_one(&pool)
                                .await
                                .unwrap()
                        })
                    }),
                    bump: Arc::new(move || {
                        let pool = bump_pool.clone();
                        Box::pin(async move {
                            sqlx::query("UPDATE tally SET n = n + 1 WHERE id = 1")
                                .execute(&pool)
                                .await
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        })
                    }),
                    // A killed process holds no SQLite lock: nothing to wait for.
                    alive: Arc::new(|_| Box::pin(async { 0 })),
                }
            }
            #[cfg(feature = "postgres")]
            Target::Postgres(url, schema) => {
                use idemflow::store::postgres::PostgresStore;
                use std::str::FromStr;
                let options = sqlx::postgres::PgConnectOptions::from_str(url)
                    .unwrap()
                    .options([("search_path", schema.as_str())]);
                let mut pool = sqlx::postgres::PgPoolOptions::new().max_connections(24);
                if child {
                    pool = pool.after_connect(|conn, _| {
                        Box::pin(async move {
                            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                                .fetch_one(&mut *conn)
                                .await?;
                            println!("conn {pid}");
                            Ok(())
                        })
                    });
                }
                let pool = pool.connect_with(options).await.unwrap();
                let store = PostgresStore::from_pool(pool.clone());
                let phase_store = store.clone();
                let (rows_pool, bump_pool, alive_pool) = (pool.clone(), pool.clone(), pool);
                Db {
                    store: Arc::new(store),
                    phase: Arc::new(move |id: String| {
                        Box::new(phase_store.atomic_phase(move |tx| {
                            Box::pin(async move {
                                sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, 1500)")
                                    .bind(&id)
                                    .execute(&mut *tx)
                                    .await?;
                                sqlx::query("UPDATE tally SET n = n + 1 WHERE id = 1")
                                    .execute(&mut *tx)
                                    .await?;
                                Ok(StoredResponse::json(201, &json!({"order": id}))?)
                            })
                        })) as Box<dyn AtomicPhase>
                    }),
                    rows: Arc::new(move |id| {
                        let pool = rows_pool.clone();
                        Box::pin(async move {
                            sqlx::query_scalar::<_, i64>(
                                "SELECT count(*) FROM orders WHERE id = $1",
                            )
                            .bind(id)
                            .fetch_one(&pool)
                            .await
                            .unwrap()
                        })
                    }),
                    bump: Arc::new(move || {
                        let pool = bump_pool.clone();
                        Box::pin(async move {
                            sqlx::query("UPDATE tally SET n = n + 1 WHERE id = 1")
                                .execute(&pool)
                                .await
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        })
                    }),
                    alive: Arc::new(move |ids| {
                        let pool = alive_pool.clone();
                        Box::pin(async move {
                            let ids: Vec<i32> = ids.into_iter().map(|i| i as i32).collect();
                            sqlx::query_scalar::<_, i64>(
                                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)",
                            )
                            .bind(ids)
                            .fetch_one(&pool)
                            .await
                            .unwrap() as usize
                        })
                    }),
                }
            }
            #[cfg(feature = "mysql")]
            Target::Mysql(url, name) => {
                use idemflow::store::mysql::MySqlStore;
                use std::str::FromStr;
                let options = sqlx::mysql::MySqlConnectOptions::from_str(url)
                    .unwrap()
                    .database(name);
                let mut pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(24);
                if child {
                    pool = pool.after_connect(|conn, _| {
                        Box::pin(async move {
                            let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                                .fetch_one(&mut *conn)
                                .await?;
                            println!("conn {id}");
                            Ok(())
                        })
                    });
                }
                let pool = pool.connect_with(options).await.unwrap();
                let store = MySqlStore::from_pool(pool.clone());
                let phase_store = store.clone();
                let (rows_pool, bump_pool, alive_pool) = (pool.clone(), pool.clone(), pool);
                Db {
                    store: Arc::new(store),
                    phase: Arc::new(move |id: String| {
                        Box::new(phase_store.atomic_phase(move |tx| {
                            Box::pin(async move {
                                sqlx::query("INSERT INTO orders (id, amount) VALUES (?, 1500)")
                                    .bind(&id)
                                    .execute(&mut *tx)
                                    .await?;
                                sqlx::query("UPDATE tally SET n = n + 1 WHERE id = 1")
                                    .execute(&mut *tx)
                                    .await?;
                                Ok(StoredResponse::json(201, &json!({"order": id}))?)
                            })
                        })) as Box<dyn AtomicPhase>
                    }),
                    rows: Arc::new(move |id| {
                        let pool = rows_pool.clone();
                        Box::pin(async move {
                            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE id = ?")
                                .bind(id)
                                .fetch_one(&pool)
                                .await
                                .unwrap()
                        })
                    }),
                    bump: Arc::new(move || {
                        let pool = bump_pool.clone();
                        Box::pin(async move {
                            sqlx::query("UPDATE tally SET n = n + 1 WHERE id = 1")
                                .execute(&pool)
                                .await
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        })
                    }),
                    alive: Arc::new(move |ids| {
                        let pool = alive_pool.clone();
                        Box::pin(async move {
                            if ids.is_empty() {
                                return 0;
                            }
                            let list: Vec<String> = ids.iter().map(u64::to_string).collect();
                            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                                "SELECT count(*) FROM information_schema.processlist WHERE id IN ({})",
                                list.join(",")
                            )))
                            .fetch_one(&pool)
                            .await
                            .unwrap() as usize
                        })
                    }),
                }
            }
            #[allow(unreachable_patterns)]
            other => panic!("{other:?}: backend not compiled in"),
        }
    }

    fn executor(db: &Db) -> Idempotency {
        // The charge step stands for a provider call that dedupes same-key re-sends, so a retry
        // may take it over; the atomic step is never taken over (its lease guards a transaction).
        Idempotency::new(db.store.clone())
            .lease(CRASH_LEASE)
            .retry_takeover_window(Some(Duration::from_secs(3600)))
    }

    /// The checkout workflow of every order (the order is the workflow's key): the atomic phase,
    /// printed `phase <order> new|replay` once it is acknowledged (when `print`, in the child),
    /// then the charge.
    fn checkout_op(
        phase: PhaseMaker,
        print: bool,
    ) -> impl Fn(Context) -> BoxFuture<Outcome> + Clone + Send + Sync + 'static {
        move |ctx: Context| {
            let phase = phase.clone();
            Box::pin(async move {
                let order = ctx.id().key.as_str().to_owned();
                let step = Step::new("create_order", &json!({"order": order})).unwrap();
                match ctx.atomic_step(step, phase(order.clone())).await {
                    Ok(e) if print => {
                        let how = if e.is_replay() { "replay" } else { "new" };
                        println!("phase {order} {how}");
                    }
                    Ok(_) => {}
                    Err(e) => return Outcome::from_step_error(&e),
                }
                let charge = Step::new("charge", &json!({"amount": 1500})).unwrap();
                match ctx
                    .step(charge, |_| async {
                        Outcome::Succeeded(
                            StoredResponse::json(201, &json!({"charged": 1500})).unwrap(),
                        )
                    })
                    .await
                {
                    Ok(_) => {
                        Outcome::Succeeded(StoredResponse::json(201, &json!({"ok": true})).unwrap())
                    }
                    Err(e) => Outcome::from_step_error(&e),
                }
            })
        }
    }

    /// The child: every order, 16 at a time, retried (same key) until its workflow answers;
    /// `done <order>` once it has. A sweeper with the workflow's resumer runs beside.
    async fn child_run(target: &Target, seed: u64) {
        let db = open(target, true).await;
        let idem = executor(&db);
        let op = checkout_op(db.phase.clone(), true);
        let sweeper = Sweeper::new(db.store.clone(), Providers::new())
            .lease(CRASH_LEASE)
            .resumer("checkout", idem.clone(), op.clone());
        tokio::spawn(async move {
            sweeper
                .run(Duration::from_millis(200), std::future::pending())
                .await
        });
        let mut rng = Rng(seed);
        let mut orders: Vec<String> = (0..ORDERS).map(order_name).collect();
        for i in (1..orders.len()).rev() {
            orders.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let queue = Arc::new(std::sync::Mutex::new(VecDeque::from(orders)));
        let mut workers = Vec::new();
        for _ in 0..CONCURRENCY {
            let (queue, idem, op) = (queue.clone(), idem.clone(), op.clone());
            workers.push(tokio::spawn(async move {
                loop {
                    let Some(order) = queue.lock().unwrap().pop_front() else {
                        return;
                    };
                    match idem.execute(checkout(&order), op.clone()).await {
                        Ok(_) => println!("done {order}"),
                        Err(_) => {
                            queue.lock().unwrap().push_back(order);
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            }));
        }
        for w in workers {
            w.await.unwrap();
        }
    }

    /// The child of the crash tests, selected by [`CHILD`]. Run alone, it runs every order to its
    /// end on a temporary SQLite file and checks them.
    #[test]
    #[ignore = "the child process of the atomic-phase crash tests"]
    fn child() {
        let rt = crate::support::child_runtime();
        match std::env::var(CHILD) {
            Ok(spec) => {
                let seed = std::env::var(CHILD_SEED)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(1);
                rt.block_on(child_run(&Target::decode(&spec), seed));
            }
            Err(_) => rt.block_on(async {
                #[cfg(feature = "sqlite")]
                {
                    let path = tempfile::tempdir().unwrap().keep().join("alone.db");
                    let target = Target::Sqlite(path);
                    set_up(&target).await;
                    child_run(&target, 7).await;
                    let db = open(&target, false).await;
                    check(&db, &BTreeSet::new(), &BTreeSet::new(), true).await;
                }
            }),
        }
    }

    /// Checks every order against its rows and its step's history; `all_done`: every order must
    /// have finished. Returns how many `create_order` steps are done.
    async fn check(
        db: &Db,
        phases: &BTreeSet<String>,
        done: &BTreeSet<String>,
        all_done: bool,
    ) -> usize {
        let mut steps_done = 0;
        for i in 0..ORDERS {
            let order = order_name(i);
            let wf = checkout(&order).id().clone();
            let step = step_key(&wf, 0);
            let record = db.store.get(&step).await.unwrap();
            let state = record.as_ref().map(|r| r.state);
            let rows = (db.rows)(order.clone()).await;
            let is_done = state == Some(KeyState::Done);
            steps_done += usize::from(is_done);
            assert_eq!(
                rows,
                i64::from(is_done),
                "{order}: its create_order step is {state:?} but it has {rows} order rows"
            );
            if phases.contains(&order) {
                assert!(is_done, "{order}: phase acknowledged, step {state:?}");
            }
            let history = db.store.history(&step).await.unwrap();
            assert_eq!(
                history.last().and_then(|e| e.to),
                state,
                "{order}: the step's history does not end in its state: {history:?}"
            );
            if let Some(p) = history.iter().position(|e| e.to == Some(KeyState::Done)) {
                assert_eq!(
                    p,
                    history.len() - 1,
                    "{order}: a transition after done: {history:?}"
                );
            }
            let workflow = db.store.get(&wf).await.unwrap().map(|r| r.state);
            let charge = db
                .store
                .get(&step_key(&wf, 1))
                .await
                .unwrap()
                .map(|r| r.state);
            if done.contains(&order) || all_done {
                assert_eq!(workflow, Some(KeyState::Done), "{order}: workflow answered");
                assert!(is_done, "{order}: workflow answered, step {state:?}");
                assert_eq!(charge, Some(KeyState::Done), "{order}: workflow answered");
            }
            if charge.is_some() {
                assert!(is_done, "{order}: charged before its order committed");
            }
        }
        steps_done
    }

    /// The second process: plain keys through a store handle of its own, each bumping the tally
    /// row the phases update; returns the keys it was told are done.
    async fn second_writer(target: Target, stop: Arc<AtomicBool>) -> (Vec<String>, usize) {
        let db = open(&target, false).await;
        let idem = Idempotency::new(db.store.clone()).lease(CRASH_LEASE);
        let (mut acked, mut refused) = (Vec::new(), 0);
        let mut i = 0;
        while !stop.load(Ordering::Relaxed) {
            let key = format!("w-{i}");
            i += 1;
            let bump = db.bump.clone();
            let r = idem
                .execute(
                    IdempotentRequest::new("shop", &key, "note", &json!({"k": key})).unwrap(),
                    |_| async move {
                        match bump().await {
                            Ok(()) => Outcome::Succeeded(StoredResponse::new(204)),
                            Err(e) => Outcome::retryable(e),
                        }
                    },
                )
                .await;
            match r {
                Ok(_) => acked.push(key),
                Err(_) => refused += 1,
            }
        }
        (acked, refused)
    }

    fn record(
        line: &str,
        phases: &mut BTreeSet<String>,
        done: &mut BTreeSet<String>,
        conns: &mut Vec<u64>,
    ) -> bool {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("phase"), Some(o), how) => {
                phases.insert(o.to_owned());
                return how == Some("new");
            }
            (Some("done"), Some(o), None) => {
                done.insert(o.to_owned());
            }
            (Some("conn"), Some(id), None) => conns.push(id.parse().unwrap()),
            _ => {}
        }
        false
    }

    pub fn kill_during_phases(target: Target) {
        let seed = std::env::var(SEED)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        println!("{target:?}: {SEED}={seed}");
        let mut rng = Rng(seed);
        let started = std::time::Instant::now();
        let rt = crate::support::child_runtime();
        rt.block_on(set_up(&target));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = rt.spawn(second_writer(target.clone(), stop.clone()));
        let logs = tempfile::tempdir().unwrap();
        let (mut phases, mut done) = (BTreeSet::new(), BTreeSet::new());
        for kill in 0..KILLS {
            let threshold = 4 + rng.below(12) as usize;
            let stderr = logs.path().join(format!("child-{kill}.err"));
            let mut child = crate::support::child_test(module_path!(), "child")
                .env(CHILD, target.encode())
                .env(CHILD_SEED, rng.next().to_string())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(&stderr).unwrap())
                .spawn()
                .unwrap();
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            let (mut new, mut conns) = (0, Vec::new());
            for line in lines.by_ref() {
                let Ok(line) = line else { break };
                if record(&line, &mut phases, &mut done, &mut conns) {
                    new += 1;
                    if new >= threshold {
                        break;
                    }
                }
            }
            assert!(
                new >= threshold,
                "seed {seed}, kill {kill}: the child stopped after {new} new phases: {}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(rng.below(30)));
            child.kill().unwrap();
            // What the child printed before it died is still in the pipe: acknowledged too.
            for line in lines {
                let Ok(line) = line else { break };
                record(&line, &mut phases, &mut done, &mut conns);
            }
            let status = child.wait().unwrap();
            assert!(
                !status.success(),
                "seed {seed}: the child was killed, not finished"
            );
            rt.block_on(async {
                let db = open(&target, false).await;
                // A killed child's server sessions may still be finishing a COMMIT they received:
                // read once they are gone.
                let deadline = std::time::Instant::now() + Duration::from_secs(120);
                while (db.alive)(conns.clone()).await > 0 {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "seed {seed}: the killed child's sessions stay open"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let steps = check(&db, &phases, &done, false).await;
                println!(
                    "{:?}: kill {kill} after {new} new phases; {} phases and {} workflows acknowledged, {steps} steps done",
                    started.elapsed(),
                    phases.len(),
                    done.len()
                );
            });
        }
        stop.store(true, Ordering::Relaxed);
        let (written, refused) = rt.block_on(writer).unwrap();
        rt.block_on(async {
            let db = open(&target, false).await;
            let idem = executor(&db);
            let op = checkout_op(db.phase.clone(), false);
            let sweeper = Sweeper::new(db.store.clone(), Providers::new()).lease(CRASH_LEASE);
            let mut pending: BTreeSet<String> = (0..ORDERS).map(order_name).collect();
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while !pending.is_empty() {
                sweeper.run_once().await.unwrap();
                // The client retries, 16 at a time.
                let queue = Arc::new(std::sync::Mutex::new(
                    pending.iter().cloned().collect::<Vec<_>>(),
                ));
                let mut retries = Vec::new();
                for _ in 0..CONCURRENCY {
                    let (queue, idem, op) = (queue.clone(), idem.clone(), op.clone());
                    retries.push(tokio::spawn(async move {
                        let mut finished = Vec::new();
                        loop {
                            let next = queue.lock().unwrap().pop();
                            let Some(order) = next else { break };
                            if idem.execute(checkout(&order), op.clone()).await.is_ok() {
                                finished.push(order);
                            }
                        }
                        finished
                    }));
                }
                for r in retries {
                    for order in r.await.unwrap() {
                        pending.remove(&order);
                    }
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "seed {seed}: orders never finished: {pending:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert_eq!(check(&db, &phases, &done, true).await, ORDERS);
            for key in &written {
                let id = IdempotentRequest::new("shop", key, "note", &json!({"k": key}))
                    .unwrap()
                    .id()
                    .clone();
                assert_eq!(
                    db.store.get(&id).await.unwrap().map(|r| r.state),
                    Some(KeyState::Done),
                    "seed {seed}: the second process's acknowledged {key}"
                );
            }
            println!(
                "{:?}: {ORDERS} orders done once; the second process wrote {} keys ({refused} refused)",
                started.elapsed(),
                written.len()
            );
        });
    }
}

/// SIGKILL during atomic phases on a SQLite file, with a second process writing.
#[cfg(feature = "sqlite")]
#[test]
fn sqlite_file_phases_survive_kills() {
    let dir = tempfile::tempdir().unwrap().keep();
    crash::kill_during_phases(crash::Target::Sqlite(dir.join("crash.db")));
}

/// SIGKILL during atomic phases on PostgreSQL, with a second process writing.
#[cfg(feature = "postgres")]
#[test]
fn postgres_phases_survive_kills() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((url, schema)) = rt.block_on(support::postgres::fresh_schema()) else {
        return;
    };
    drop(rt);
    crash::kill_during_phases(crash::Target::Postgres(url, schema));
}

/// SIGKILL during atomic phases on MariaDB, with a second process writing.
#[cfg(feature = "mysql")]
#[test]
fn mysql_phases_survive_kills() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((_, name)) = rt.block_on(support::mysql::fresh_database()) else {
        return;
    };
    drop(rt);
    let url = std::env::var(support::mysql::URL_VAR).unwrap();
    crash::kill_during_phases(crash::Target::Mysql(url, name));
}
