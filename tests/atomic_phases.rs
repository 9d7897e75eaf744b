//! Atomic phases: a workflow step whose effect is the application's own rows, committed in one
//! transaction with the step's record. On PostgreSQL, MariaDB and SQLite: the writes and the
//! record are there together; a write failing after the insert leaves neither. On PostgreSQL and
//! MariaDB also: the step decided elsewhere between the insert and the record, or a crash before
//! the commit, leaves neither; the sweeper then makes the step retryable, and the workflow's retry
//! writes the row exactly once. (On SQLite the phase runs inside the single writer's job, so
//! nothing else can write in between, and a dropped caller does not stop a started job; the
//! group-commit tests cover a killed process.)

#![cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]

mod support;

use std::sync::Arc;
use std::time::Duration;

use idemflow::conformance::sweeper::cut_when;
use idemflow::store::Finish;
use idemflow::workflow::{AtomicPhase, step_key};
use idemflow::{
    Actor, Context, Error, Idempotency, IdempotentRequest, KeyState, Outcome, Providers, Step,
    Store, StoredResponse, Sweeper,
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
    assert_eq!(
        step.provider.as_deref(),
        Some(idemflow::workflow::LOCAL_PROVIDER)
    );
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
/// step becomes retryable, and the workflow's retry writes the order once.
async fn a_write_failing_after_the_insert_leaves_neither(b: Backend) {
    let idem = Idempotency::new(b.store.clone()).lease(LEASE);
    let r = run_failing(&b, &idem, "o-4", no_hook(), true).await;
    assert!(matches!(r, Err(Error::FailedRetryable { .. })), "{r:?}");
    assert_eq!((b.orders)("o-4".into()).await, 0, "the insert rolled back");
    let step = step_key(checkout("o-4").id(), 0);
    assert_eq!(
        b.store.get(&step).await.unwrap().unwrap().state,
        KeyState::Failed { retryable: true }
    );
    let done = run(&b, &idem, "o-4", no_hook()).await.unwrap();
    assert!(!done.is_replay());
    assert_eq!((b.orders)("o-4".into()).await, 1, "written once");
    let again = run(&b, &idem, "o-4", no_hook()).await.unwrap();
    assert!(again.is_replay());
    assert_eq!((b.orders)("o-4".into()).await, 1);
}

/// The step is decided by an operator between the order insert and the step's record: the
/// record's fenced write matches nothing, the transaction rolls back, neither is there.
async fn a_failure_between_the_writes_and_the_record_leaves_neither(b: Backend) {
    let idem = Idempotency::new(b.store.clone()).lease(LEASE);
    let store = b.store.clone();
    let step = step_key(checkout("o-2").id(), 0);
    let hook: Hook = Arc::new(move || {
        let (store, step) = (store.clone(), step.clone());
        Box::pin(async move {
            let token = store.get(&step).await.unwrap().unwrap().lease_token;
            let decided = Finish {
                to: KeyState::Failed { retryable: true },
                response: None,
                error: Some("operator: retry it".into()),
                actor: Actor::Operator,
                reason: "operator".into(),
                expect_token: Some(token),
            };
            store.finish(&step, None, &decided).await.unwrap();
        })
    });
    let r = run(&b, &idem, "o-2", hook).await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(
        (b.orders)("o-2".into()).await,
        0,
        "the order insert rolled back"
    );
    let step_row = b
        .store
        .get(&step_key(checkout("o-2").id(), 0))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(step_row.state, KeyState::Failed { retryable: true });
    // The workflow's retry writes the order once.
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let done = run(&b, &idem, "o-2", no_hook()).await.unwrap();
    assert!(!done.is_replay());
    assert_eq!((b.orders)("o-2".into()).await, 1);
}

/// The process dies after the insert, before the commit: nothing was written; the sweeper makes
/// the step retryable once its lease runs out; the retry writes the order once.
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
    assert_eq!(
        b.store.get(&step).await.unwrap().unwrap().state,
        KeyState::Processing
    );
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let report = Sweeper::new(b.store.clone(), Providers::new())
        .run_once()
        .await
        .unwrap();
    assert!(report.retryable >= 1, "{report:?}");
    assert_eq!(
        b.store.get(&step).await.unwrap().unwrap().state,
        KeyState::Failed { retryable: true }
    );
    let done = run(&b, &idem, "o-3", no_hook()).await.unwrap();
    assert!(!done.is_replay());
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
        async fn a_failure_between_the_writes_and_the_record_leaves_neither() {
            let Some(b) = $factory().await else { return };
            super::a_failure_between_the_writes_and_the_record_leaves_neither(b).await;
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
