//! SQLite group commit (issue 12): the single writer task batches the writes of concurrent
//! callers into one transaction. These tests check what batching must not change: a caller told
//! its write succeeded finds it after a crash (the process killed mid-run), one caller's failing
//! statement neither fails nor loses the others of its batch, and 1,000 concurrent duplicates of
//! one key still run the body once.

use idemflow::store::OperatorStore;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemflow::conformance::{claim_for, done, id, unique};
use idemflow::store::sqlite::{SqliteStore, WriterStats};
use idemflow::store::{ClaimOutcome, NewClaim};
use idemflow::{
    Error, Execution, Idempotency, IdempotentRequest, KeyId, KeyState, Outcome, Store, StoreError,
    StoredResponse,
};
use tokio::sync::Notify;

const LEASE: Duration = Duration::from_secs(30);

/// The environment variable that makes [`child_writes_and_acknowledges`] write to a given file.
const CHILD_DB: &str = "IDEMFLOW_GROUP_COMMIT_CHILD_DB";

async fn file_store(path: &Path) -> SqliteStore {
    let s = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    s.migrate().await.unwrap();
    s
}

fn scope() -> &'static str {
    "group-commit"
}

/// The child of [`acknowledged_writes_survive_a_kill_mid_batch`]: 64 concurrent callers claim and
/// finish new keys on the file named by [`CHILD_DB`] and print `claimed <key>` / `done <key>`
/// once each call has returned `Ok`, until killed. Run alone (no variable), it writes 20 keys per
/// caller to a temporary file and checks them itself.
#[test]
#[ignore = "the child process of acknowledged_writes_survive_a_kill_mid_batch"]
fn child_writes_and_acknowledges() {
    let (path, limit) = match std::env::var(CHILD_DB) {
        Ok(p) => (std::path::PathBuf::from(p), usize::MAX),
        Err(_) => (tempfile::tempdir().unwrap().keep().join("alone.db"), 20),
    };
    let rt = crate::support::child_runtime();
    let acked = rt.block_on(async move {
        let store = Arc::new(file_store(&path).await);
        let mut tasks = Vec::new();
        for caller in 0..64 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0..limit {
                    let k = id(scope(), &format!("c{caller}-{i}"));
                    let ClaimOutcome::Claimed(lease) =
                        store.claim(&claim_for(&k, "{}", LEASE)).await.unwrap()
                    else {
                        panic!("{k}: a new key was not claimed");
                    };
                    println!("claimed {}", k.key);
                    store
                        .finish(&k, lease.token, &done(StoredResponse::new(201)))
                        .await
                        .unwrap();
                    println!("done {}", k.key);
                    acked.push(k);
                }
                acked
            }));
        }
        let mut acked = Vec::new();
        for t in tasks {
            acked.extend(t.await.unwrap());
        }
        for k in &acked {
            let r = store.get(k).await.unwrap().expect("an acknowledged key");
            assert_eq!(r.state, KeyState::Done);
        }
        acked
    });
    assert_eq!(acked.len(), 64 * 20);
}

/// Kills (SIGKILL) a child process that writes with 64 concurrent callers once it has
/// acknowledged 600 finished keys, mid-run (batches in flight), reopens the database and checks
/// that every key the child acknowledged is there: claimed keys exist, finished keys are done.
#[test]
fn acknowledged_writes_survive_a_kill_mid_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("crash.db");
    let (mut claimed, mut finished) = (BTreeSet::new(), BTreeSet::new());
    kill_after(
        "child_writes_and_acknowledges",
        (CHILD_DB, &path),
        600,
        |line| {
            if let Some(k) = line.strip_prefix("claimed ") {
                claimed.insert(k.to_owned());
            } else if let Some(k) = line.strip_prefix("done ") {
                finished.insert(k.to_owned());
            }
            finished.len()
        },
    );
    let in_flight = claimed.difference(&finished).count();

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = file_store(&path).await;
        for k in &claimed {
            let r = store
                .get(&id(scope(), k))
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{k}: claim acknowledged, row missing after the kill"));
            if finished.contains(k) {
                assert_eq!(r.state, KeyState::Done, "{k}: finish acknowledged");
            }
        }
    });
    println!(
        "{} claims and {} finishes acknowledged before the kill ({in_flight} keys in flight), all there",
        claimed.len(),
        finished.len()
    );
}

/// The environment variable that makes [`child_runs_phases_and_acknowledges`] write to a given
/// file.
const PHASE_CHILD_DB: &str = "IDEMFLOW_GROUP_COMMIT_PHASE_CHILD_DB";

/// The application's table of the one-commit crash test: no unique constraint, so a second row
/// for a key would show.
const KILL_ORDERS: &str = "CREATE TABLE IF NOT EXISTS kill_orders (k TEXT NOT NULL)";

/// The child of [`acknowledged_phases_survive_a_kill_mid_batch`]: 64 concurrent callers run
/// new keys through `execute_atomic` (each phase inserting its key's order row) on the file named
/// by [`PHASE_CHILD_DB`], every fifth key sent a second time at once (a duplicate, which replays),
/// and print `done <key>` once a call has returned, until killed. Batched phases hand each other
/// their savepoints and reads, the first sends the batch's `BEGIN`, the last its `COMMIT`
/// (`writer.rs`, "Trips"). Run alone (no variable), it writes 20 keys per caller to a temporary
/// file and checks them itself.
#[test]
#[ignore = "the child process of acknowledged_phases_survive_a_kill_mid_batch"]
fn child_runs_phases_and_acknowledges() {
    let (path, limit) = match std::env::var(PHASE_CHILD_DB) {
        Ok(p) => (std::path::PathBuf::from(p), usize::MAX),
        Err(_) => (tempfile::tempdir().unwrap().keep().join("alone.db"), 20),
    };
    let rt = crate::support::child_runtime();
    let db = path.clone();
    let acked = rt.block_on(async move {
        let store = file_store(&db).await;
        sqlx::query(KILL_ORDERS)
            .execute(store.writer_pool())
            .await
            .unwrap();
        let idem = Idempotency::new(Arc::new(store.clone()));
        let run = move |key: String| {
            let (idem, store) = (idem.clone(), store.clone());
            async move {
                let request =
                    IdempotentRequest::new(scope(), &key, "order", &serde_json::json!({})).unwrap();
                let order = key.clone();
                let phase = store.atomic_phase(
                    move |conn: &mut sqlx::SqliteConnection| -> idemflow::store::phase::WritesFuture<'_> {
                        let order = order.clone();
                        Box::pin(async move {
                            sqlx::query("INSERT INTO kill_orders (k) VALUES (?)")
                                .bind(&order)
                                .execute(&mut *conn)
                                .await?;
                            Ok(StoredResponse::new(201))
                        })
                    },
                );
                idem.execute_atomic(request, phase).await.unwrap()
            }
        };
        let mut tasks = Vec::new();
        for caller in 0..64 {
            let run = run.clone();
            tasks.push(tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0..limit {
                    let key = format!("p{caller}-{i}");
                    if i % 5 == 0 {
                        let (a, b) = tokio::join!(run(key.clone()), run(key.clone()));
                        assert_eq!(a.response(), b.response(), "{key}: a duplicate's answer");
                    } else {
                        run(key.clone()).await;
                    }
                    println!("done {key}");
                    acked.push(key);
                }
                acked
            }));
        }
        let mut acked = Vec::new();
        for t in tasks {
            acked.extend(t.await.unwrap());
        }
        acked
    });
    assert_eq!(acked.len(), 64 * 20);
    rt.block_on(check_phases(&path, acked.iter().cloned().collect()));
}

/// What a one-commit crash must leave on the file at `path`: every key in `acked` done, and
/// for every key of the scope, done or not there, exactly as many order rows as key rows (the
/// key and the application's row commit together or not at all).
async fn check_phases(path: &Path, acked: BTreeSet<String>) {
    let store = file_store(path).await;
    sqlx::query(KILL_ORDERS)
        .execute(store.writer_pool())
        .await
        .unwrap();
    for k in &acked {
        let r = store
            .get(&id(scope(), k))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{k}: answered, row missing after the kill"));
        assert_eq!(r.state, KeyState::Done, "{k}: answered");
    }
    let mismatched: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT k, SUM(o), SUM(r) FROM ( \
           SELECT k, 1 AS o, 0 AS r FROM kill_orders \
           UNION ALL SELECT key, 0, 1 FROM idempotency_keys WHERE scope = ?1) \
         GROUP BY k HAVING SUM(o) <> 1 OR SUM(r) <> 1",
    )
    .bind(scope())
    .fetch_all(store.writer_pool())
    .await
    .unwrap();
    assert!(
        mismatched.is_empty(),
        "keys whose order rows and key row disagree (key, orders, key rows): {mismatched:?}"
    );
}

/// Kills (SIGKILL) a child process running one-commit phases with 64 concurrent callers
/// ([`child_runs_phases_and_acknowledges`]) once it has answered 600 keys, mid-run (batches of
/// phases in flight), reopens the database and checks that every answered key is done and that
/// every key there has exactly one order row, and every order row its key.
#[test]
fn acknowledged_phases_survive_a_kill_mid_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("crash.db");
    let mut acked = BTreeSet::new();
    kill_after(
        "child_runs_phases_and_acknowledges",
        (PHASE_CHILD_DB, &path),
        600,
        |line| {
            if let Some(k) = line.strip_prefix("done ") {
                acked.insert(k.to_owned());
            }
            acked.len()
        },
    );
    let n = acked.len();
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(check_phases(&path, acked));
    println!("{n} one-commit keys answered before the kill, all there, one order row each");
}

/// Runs the child test `child` of this module with `env` set, hands each line it prints to
/// `record` (which answers how many writes it has seen acknowledged), kills it (SIGKILL) once
/// that reaches `n`, hands on what it printed before it died (still in the pipe: acknowledged
/// too), and checks that it was killed, not finished.
fn kill_after(child: &str, env: (&str, &Path), n: usize, mut record: impl FnMut(&str) -> usize) {
    let mut child = crate::support::child_test(module_path!(), child)
        .env(env.0, env.1)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = 0;
    for line in lines.by_ref() {
        seen = record(&line.unwrap());
        if seen >= n {
            break;
        }
    }
    assert!(seen >= n, "the child stopped before {n} writes");
    child.kill().unwrap();
    for line in lines {
        match line {
            Ok(line) => {
                record(&line);
            }
            Err(_) => break,
        }
    }
    let status = child.wait().unwrap();
    assert!(!status.success(), "the child was killed, not finished");
}

/// Holds the writer task in a job of its own until released, so that the jobs sent meanwhile
/// make up the next batch.
pub(crate) async fn hold_writer(store: &SqliteStore) -> (Arc<Notify>, tokio::task::JoinHandle<()>) {
    let gate = Arc::new(Notify::new());
    let entered = Arc::new(Notify::new());
    let (g, e) = (gate.clone(), entered.clone());
    let s = store.clone();
    let held = tokio::spawn(async move {
        s.write_job(move |_conn| {
            let (g, e) = (g.clone(), e.clone());
            Box::pin(async move {
                e.notify_one();
                g.notified().await;
                Ok(())
            })
        })
        .await
        .unwrap();
    });
    entered.notified().await;
    (gate, held)
}

pub(crate) async fn wait_queued(store: &SqliteStore, n: usize) {
    while store.writer_stats().queued < n {
        tokio::task::yield_now().await;
    }
}

/// How the poisoned claim of [`one_failing_statement`] fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Poison {
    /// A CHECK constraint fails inside the statement: SQLite undoes that statement only.
    Check,
    /// A trigger's `RAISE(ROLLBACK)`: SQLite rolls the whole transaction back.
    Rollback,
}

async fn one_failing_statement(poison: Poison) {
    let store = file_store(&tempfile::tempdir().unwrap().keep().join("fail.db")).await;
    let scope = unique("poison");
    // A statement that fails for one key only: its claim's INSERT.
    let (body, message) = match poison {
        Poison::Check => (
            "INSERT INTO gc_poison (v) VALUES (1);",
            "CHECK constraint failed",
        ),
        Poison::Rollback => ("SELECT RAISE(ROLLBACK, 'poisoned key');", "poisoned key"),
    };
    sqlx::query("CREATE TABLE gc_poison (v INTEGER CHECK (v = 0))")
        .execute(store.writer_pool())
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TRIGGER poison BEFORE INSERT ON idempotency_keys WHEN NEW.key = 'poison' \
         BEGIN {body} END"
    )))
    .execute(store.writer_pool())
    .await
    .unwrap();
    let (gate, held) = hold_writer(&store).await;
    let keys: Vec<KeyId> = ["a", "b", "poison", "c", "d"]
        .iter()
        .map(|k| id(&scope, k))
        .collect();
    let mut calls = Vec::new();
    for k in &keys {
        let (s, c) = (store.clone(), claim_for(k, "{}", LEASE));
        calls.push(tokio::spawn(async move { s.claim(&c).await }));
    }
    wait_queued(&store, keys.len()).await;
    let before = store.writer_stats();
    gate.notify_one();
    held.await.unwrap();
    let mut results = Vec::new();
    for c in calls {
        results.push(c.await.unwrap());
    }
    let after = store.writer_stats();
    for (k, r) in keys.iter().zip(results) {
        if k.key.as_str() == "poison" {
            let err = r.expect_err("the poisoned claim fails");
            let text = format!("{err} {:?}", std::error::Error::source(&err));
            assert!(
                matches!(err, StoreError::Database { .. }) && text.contains(message),
                "{text}"
            );
            assert!(
                store.get(k).await.unwrap().is_none(),
                "no row for the failed claim"
            );
            assert!(
                store.history(k).await.unwrap().is_empty(),
                "no history for it"
            );
        } else {
            assert!(matches!(r, Ok(ClaimOutcome::Claimed(_))), "{k}: {r:?}");
            let row = store.get(k).await.unwrap().expect("committed");
            assert_eq!(row.state, KeyState::Processing);
            assert_eq!(store.history(k).await.unwrap().len(), 1, "{k}");
        }
    }
    // Two commits: the held job's, then one transaction for the four good claims; the
    // rolled-back batch (RAISE(ROLLBACK)) is not a commit.
    assert_eq!(after.commits - before.commits, 2, "{before:?} -> {after:?}");
    let rolled_back = after.rolled_back - before.rolled_back;
    match poison {
        // The failed statement stayed inside the one transaction of the five claims.
        Poison::Check => assert_eq!(rolled_back, 0, "{before:?} -> {after:?}"),
        // The batch was rolled back and the four others ran again, once.
        Poison::Rollback => assert_eq!(rolled_back, 1, "{before:?} -> {after:?}"),
    }
    // The store goes on writing.
    let k = id(&scope, "after");
    assert!(matches!(
        store.claim(&claim_for(&k, "{}", LEASE)).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
}

/// Five claims in one batch, one of whose INSERT fails (a CHECK constraint, which undoes that
/// statement only): that caller gets the error and no row, the four others commit in the same
/// transaction and succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failing_statement_in_a_batch_fails_only_its_caller() {
    one_failing_statement(Poison::Check).await;
}

/// The same with `RAISE(ROLLBACK)`, which rolls the whole transaction back: the writer rolls back,
/// the failing caller gets its error, and the four others run again and succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_that_rolls_its_batch_back_fails_only_its_caller() {
    one_failing_statement(Poison::Rollback).await;
}

/// A batch whose writes are all fine but whose `COMMIT` fails: no caller is told it succeeded.
/// The commit is made to fail by a deferred foreign key that one write leaves broken (checked at
/// `COMMIT`, not at the statement).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_fails_every_write_of_its_batch() {
    let store = file_store(&tempfile::tempdir().unwrap().keep().join("commit.db")).await;
    let scope = unique("commit");
    sqlx::query(
        "CREATE TABLE gc_parent (id INTEGER PRIMARY KEY); \
         CREATE TABLE gc_child (id INTEGER PRIMARY KEY, parent INTEGER \
           REFERENCES gc_parent (id) DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(store.writer_pool())
    .await
    .unwrap();
    let (gate, held) = hold_writer(&store).await;
    let keys: Vec<KeyId> = ["x", "y"].iter().map(|k| id(&scope, k)).collect();
    let mut calls = Vec::new();
    for k in &keys {
        let (s, c) = (store.clone(), claim_for(k, "{}", LEASE));
        calls.push(tokio::spawn(async move { s.claim(&c).await }));
    }
    let s = store.clone();
    let orphan = tokio::spawn(async move {
        s.write_job(|conn| {
            Box::pin(async move {
                sqlx::query("INSERT INTO gc_child (id, parent) VALUES (1, 42)")
                    .execute(&mut *conn)
                    .await
                    .map(|_| ())
                    .map_err(|e| StoreError::database("sqlite", e))
            })
        })
        .await
    });
    wait_queued(&store, 3).await;
    gate.notify_one();
    held.await.unwrap();
    assert!(
        orphan.await.unwrap().is_err(),
        "the orphan write was not committed"
    );
    for (k, c) in keys.iter().zip(calls) {
        let r = c.await.unwrap();
        assert!(
            r.is_err(),
            "{k}: told {r:?} although its batch did not commit"
        );
        assert!(store.get(k).await.unwrap().is_none(), "{k}: rolled back");
    }
    let k = id(&scope, "after");
    assert!(matches!(
        store.claim(&claim_for(&k, "{}", LEASE)).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
}

fn request(key: &str) -> IdempotentRequest {
    IdempotentRequest::new(
        "group-commit",
        key,
        "payments.create",
        &serde_json::json!({"amount": 1999, "currency": "eur"}),
    )
    .unwrap()
}

/// 1,000 concurrent `execute` calls with one key, through the batching writer (file database):
/// the body runs once and exactly one caller gets `Executed`; every other caller gets the
/// replay or an in-flight answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_duplicates_run_the_body_once() {
    let store = file_store(&tempfile::tempdir().unwrap().keep().join("dup.db")).await;
    let idem = Idempotency::new(Arc::new(store.clone())).lease(Duration::from_secs(30));
    let runs = Arc::new(AtomicUsize::new(0));
    let mut calls = Vec::new();
    for _ in 0..1000 {
        let (idem, runs) = (idem.clone(), runs.clone());
        calls.push(tokio::spawn(async move {
            idem.execute(request("storm"), |_ctx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                Outcome::Succeeded(StoredResponse::new(201).with_body("{\"id\":1}"))
            })
            .await
        }));
    }
    let (mut executed, mut other) = (0, 0);
    for c in calls {
        match c.await.unwrap() {
            Ok(Execution::Executed(_)) => executed += 1,
            Ok(_) | Err(Error::InFlight { .. }) => other += 1,
            Err(e) => panic!("unexpected answer: {e}"),
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the body ran more than once"
    );
    assert_eq!((executed, other), (1, 999));
    let stats: WriterStats = store.writer_stats();
    assert!(stats.writes >= 2, "{stats:?}");
}

/// A claim whose caller stops waiting while the writer holds its batch neither breaks the writer
/// nor leaves half a row: the others of the batch commit, and the abandoned claim either
/// committed whole (row and history) or not at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_leaves_mid_batch_breaks_nothing() {
    let store = file_store(&tempfile::tempdir().unwrap().keep().join("cancel.db")).await;
    let scope = unique("cancel");
    let (gate, held) = hold_writer(&store).await;
    let keys: Vec<KeyId> = (0..6).map(|i| id(&scope, &format!("k{i}"))).collect();
    let mut calls = Vec::new();
    for k in &keys {
        let (s, c): (SqliteStore, NewClaim) = (store.clone(), claim_for(k, "{}", LEASE));
        calls.push(tokio::spawn(async move { s.claim(&c).await }));
    }
    wait_queued(&store, keys.len()).await;
    calls[2].abort();
    calls[4].abort();
    gate.notify_one();
    held.await.unwrap();
    for (i, (k, c)) in keys.iter().zip(calls).enumerate() {
        let r = c.await;
        let row = store.get(k).await.unwrap();
        let history = store.history(k).await.unwrap();
        if i == 2 || i == 4 {
            assert!(r.is_err(), "aborted");
            assert_eq!(
                row.is_some(),
                !history.is_empty(),
                "{k}: row and history agree"
            );
        } else {
            assert!(matches!(r.unwrap(), Ok(ClaimOutcome::Claimed(_))));
            assert_eq!(row.unwrap().state, KeyState::Processing);
            assert_eq!(history.len(), 1);
        }
    }
}

/// `SqliteStore::from_pools` is not async and may be called outside a tokio runtime (the writer
/// task starts with the first write, on that write's runtime): it must not panic, and the store
/// must then write and read through the task.
#[test]
fn from_pools_outside_a_runtime_starts_the_writer_on_first_write() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let path = tempfile::tempdir().unwrap().keep().join("pools.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let (writer, reader) = rt.block_on(async {
        let w = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .unwrap();
        let r = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap();
        (w, r)
    });
    // No runtime is entered here.
    let store = SqliteStore::from_pools(writer, reader);
    rt.block_on(async {
        store.migrate().await.unwrap();
        let k = id(scope(), "from-pools");
        let ClaimOutcome::Claimed(lease) = store.claim(&claim_for(&k, "{}", LEASE)).await.unwrap()
        else {
            panic!("a new key was not claimed");
        };
        store
            .finish(&k, lease.token, &done(StoredResponse::new(201)))
            .await
            .unwrap();
        assert_eq!(store.get(&k).await.unwrap().unwrap().state, KeyState::Done);
        assert_eq!(store.writer_stats().commits, 2);
    });
}

/// The writer task keeps its connection from one batch to the next while writes keep coming
/// (`writer.rs`); a `writer_pool()` user must still get it while the store is busy, after at most
/// the task's hold of 20 ms: here 8 callers claim new keys without a pause while another task
/// takes the writer pool's connection and writes its own row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_pool_user_gets_the_connection_while_the_store_is_busy() {
    let store = file_store(&tempfile::tempdir().unwrap().keep().join("busy.db")).await;
    sqlx::query("CREATE TABLE gc_app (id INTEGER PRIMARY KEY)")
        .execute(store.writer_pool())
        .await
        .unwrap();
    let scope = unique("busy");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let claimed = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::new();
    for caller in 0..8 {
        let (store, scope, stop, claimed) =
            (store.clone(), scope.clone(), stop.clone(), claimed.clone());
        callers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let k = id(&scope, &format!("c{caller}-{i}"));
                store.claim(&claim_for(&k, "{}", LEASE)).await.unwrap();
                claimed.fetch_add(1, Ordering::SeqCst);
                i += 1;
            }
        }));
    }
    // The store is busy: its writer has taken its connection and runs batch after batch.
    while claimed.load(Ordering::SeqCst) < 200 {
        tokio::task::yield_now().await;
    }
    let before = claimed.load(Ordering::SeqCst);
    let user = tokio::time::timeout(Duration::from_secs(10), async {
        let mut conn = store.writer_pool().acquire().await.unwrap();
        sqlx::query("INSERT INTO gc_app (id) VALUES (1)")
            .execute(&mut *conn)
            .await
            .unwrap();
    })
    .await;
    let during = claimed.load(Ordering::SeqCst) - before;
    stop.store(true, Ordering::SeqCst);
    for c in callers {
        c.await.unwrap();
    }
    assert!(
        user.is_ok(),
        "the writer pool's connection was not given to its user within 10 s while the store \
         wrote ({during} claims meanwhile)"
    );
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM gc_app")
        .fetch_one(store.writer_pool())
        .await
        .unwrap();
    assert_eq!(rows, 1);
}
