//! Background jobs: an apalis job queue on PostgreSQL (`IDEMFLOW_TEST_POSTGRES_URL`) whose job
//! charges a card through idemflow (`examples/background_jobs.rs`, included here). The card
//! processor is [`Card`]: one row per charge in a table of the test's schema, with no
//! idempotency of its own (a second call would be a second charge), looked up by provider key.
//!
//! - a job whose first attempt charges and then fails before it completes is retried, and the
//!   retry replays the stored answer: one charge;
//! - a worker process killed with SIGKILL in the middle of a job (in the charge, after the
//!   processor acted; or after the charge was recorded), then a worker restarted: apalis gives
//!   the dead worker's job to the new one, the key is settled (by the sweeper, from the
//!   processor's records, when the charge's answer died with the worker), every job completes
//!   and each charge is made once;
//! - many jobs, duplicates among them (enqueued together, and again after the first ones
//!   completed): one charge per charge id.
//!
//! The jobs live in apalis's own schema (`apalis`), one queue per test (the test's schema name),
//! deleted at the end; the keys and the charges in the test's fresh schema.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemflow::provider::{Attempts, CallReply, KeySpec, Lookup};
use idemflow::store::postgres::PostgresStore;
use idemflow::{
    Idempotency, KeyId, KeyState, Outcome, Provider, Providers, Store, StoredResponse, Sweeper,
    key::IdempotencyKey, key::Scope, record::Actor,
};
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;

use crate::scenarios::eventually;
use crate::support::KillOnDrop;
use crate::support::postgres::{drop_schema, fresh_schema, pool_in};

#[path = "../../examples/background_jobs.rs"]
mod example;

use example::{AfterCharge, ChargeJob, Charger, enqueue, jobs_of, storage, work_until};

/// The account of the tests' charges (the keys' scope).
const ACCOUNT: &str = "acct_jobs";
/// The name of the card processor in key rows.
const CARD: &str = "card";
/// Where the kill test's child finds its database and queue: `<mode> <url> <schema>`.
const CHILD_SPEC: &str = "IDEMFLOW_JOBS_KILL";
/// The lease of the keys: short, so that a dead worker's key is free soon.
const LEASE: Duration = Duration::from_millis(1000);
/// The apalis heartbeat: the poll interval, and a worker missing three is dead.
const HEARTBEAT: Duration = Duration::from_secs(1);
const MISSED: usize = 3;
/// Attempts per job: a job waiting for a key in flight or being settled fails an attempt per
/// wait (in-flight and unknown waits of 200 / 500 ms), so the bound is generous.
const MAX_ATTEMPTS: usize = 1000;

/// The card processor: one row per call in `card_charges`, no idempotency of its own. A
/// `hang`ing one records the charge and never answers (the process is killed meanwhile).
#[derive(Clone)]
struct Card {
    pool: PgPool,
    hang: bool,
}

impl std::fmt::Debug for Card {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Card")
    }
}

fn card_answer(n: i64, charge_id: &str, amount: i64) -> StoredResponse {
    StoredResponse::json(
        200,
        &json!({"id": format!("ch_{n}"), "charge_id": charge_id, "amount": amount}),
    )
    .unwrap()
}

#[idemflow::async_trait]
impl Provider for Card {
    fn name(&self) -> &str {
        CARD
    }

    fn key_spec(&self) -> KeySpec {
        KeySpec::no_keys()
    }

    async fn send(&self, provider_key: &str, request: &serde_json::Value) -> CallReply {
        let charge_id = request["metadata"]["charge_id"]
            .as_str()
            .unwrap_or_default();
        let amount = request["amount"].as_i64().unwrap_or_default();
        let inserted: Result<i64, sqlx::Error> = sqlx::query_scalar(
            "INSERT INTO card_charges (provider_key, charge_id, amount) VALUES ($1, $2, $3) \
             RETURNING n",
        )
        .bind(provider_key)
        .bind(charge_id)
        .bind(amount)
        .fetch_one(&self.pool)
        .await;
        let n = match inserted {
            Ok(n) => n,
            Err(e) => {
                return CallReply::Unknown {
                    reason: e.to_string(),
                };
            }
        };
        if self.hang {
            // Killed here: the charge is made, its answer never reaches idemflow.
            std::future::pending::<()>().await;
        }
        CallReply::Succeeded {
            response: card_answer(n, charge_id, amount),
            replayed: false,
        }
    }

    async fn lookup(
        &self,
        provider_key: &str,
        _request: &serde_json::Value,
        _attempts: Attempts,
        _now: DateTime<Utc>,
    ) -> Lookup {
        let row: Result<Option<(i64, String, i64)>, sqlx::Error> = sqlx::query_as(
            "SELECT n, charge_id, amount FROM card_charges WHERE provider_key = $1 \
             ORDER BY n LIMIT 1",
        )
        .bind(provider_key)
        .fetch_optional(&self.pool)
        .await;
        match row {
            Ok(Some((n, charge_id, amount))) => {
                Lookup::Found(Outcome::Succeeded(card_answer(n, &charge_id, amount)))
            }
            Ok(None) => Lookup::NotFound {
                authoritative: true,
            },
            Err(_) => Lookup::Unknown { retry_after: None },
        }
    }
}

/// One test's database: the key store and `card_charges` in a fresh schema, apalis's pool on
/// the default search path (apalis's tables are in `apalis`, its `hstore` in `public`), and the
/// test's queue.
struct Db {
    url: String,
    schema: String,
    store: Arc<dyn Store>,
    app: PgPool,
    jobs: PgPool,
    queue: String,
}

/// apalis's migrations, once per process (concurrent `CREATE SCHEMA` would race).
static APALIS: OnceCell<()> = OnceCell::const_new();

impl Db {
    /// A fresh database, or `None` (the test is skipped) without `IDEMFLOW_TEST_POSTGRES_URL`.
    async fn fresh() -> Option<Self> {
        let (url, schema) = fresh_schema().await?;
        let db = Self::attach(&url, &schema).await;
        APALIS
            .get_or_init(|| async {
                apalis_postgres::PostgresStorage::setup(&db.jobs)
                    .await
                    .unwrap();
            })
            .await;
        // The queues an earlier run left behind (its schema is dropped by `fresh_schema`).
        let queues: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT job_type FROM apalis.jobs WHERE starts_with(job_type, $1)",
        )
        .bind(crate::support::PREFIX)
        .fetch_all(&db.jobs)
        .await
        .unwrap();
        for queue in queues.iter().filter(|q| crate::support::left_behind(q)) {
            example::delete_queue(&db.jobs, queue).await.unwrap();
        }
        sqlx::query(
            "CREATE TABLE card_charges (n BIGSERIAL PRIMARY KEY, provider_key TEXT NOT NULL, \
             charge_id TEXT NOT NULL, amount BIGINT NOT NULL)",
        )
        .execute(&db.app)
        .await
        .unwrap();
        db.store.migrate().await.unwrap();
        Some(db)
    }

    /// The database of `schema`, already set up (the child's).
    async fn attach(url: &str, schema: &str) -> Self {
        let app = pool_in(url, schema, 5).await;
        let jobs = example::worker_pool(url, 5).await.unwrap();
        Self {
            url: url.to_owned(),
            schema: schema.to_owned(),
            store: Arc::new(PostgresStore::from_pool(app.clone())),
            app,
            jobs,
            queue: schema.to_owned(),
        }
    }

    fn card(&self, hang: bool) -> Arc<dyn Provider> {
        Arc::new(Card {
            pool: self.app.clone(),
            hang,
        })
    }

    /// The executor the workers use.
    fn idem(&self) -> Idempotency {
        Idempotency::new(self.store.clone())
            .lease(LEASE)
            .in_flight_retry_after(Duration::from_millis(200))
            .unknown_retry_after(Duration::from_millis(500))
    }

    async fn enqueue(&self, charge_ids: &[&str]) {
        let mut jobs = storage(&self.jobs, &self.queue, HEARTBEAT, MISSED);
        for id in charge_ids {
            enqueue(&mut jobs, job(id), MAX_ATTEMPTS).await.unwrap();
        }
    }

    /// Runs a worker named `name` until every job of the queue (`want` of them) is `Done`;
    /// fails after `within`.
    async fn work(&self, name: &str, charger: Charger, want: usize, within: Duration) {
        let (pool, queue) = (self.jobs.clone(), self.queue.clone());
        let all_done = move || {
            let (pool, queue) = (pool.clone(), queue.clone());
            async move {
                let jobs = jobs_of(&pool, &queue).await.unwrap();
                jobs.len() == want && jobs.iter().all(|(status, _)| status == "Done")
            }
        };
        let storage = storage(&self.jobs, &self.queue, HEARTBEAT, MISSED);
        let finished = work_until(
            &format!("{}-{name}", self.queue),
            storage,
            charger,
            within,
            all_done,
        )
        .await
        .unwrap();
        let jobs = jobs_of(&self.jobs, &self.queue).await.unwrap();
        assert!(finished, "not every job done within {within:?}: {jobs:?}");
    }

    /// Charges made per charge id, by charge id.
    async fn charges(&self) -> Vec<(String, i64)> {
        sqlx::query_as(
            "SELECT charge_id, COUNT(*) FROM card_charges GROUP BY charge_id ORDER BY charge_id",
        )
        .fetch_all(&self.app)
        .await
        .unwrap()
    }

    fn key(charge_id: &str) -> KeyId {
        KeyId::new(
            Scope::new(ACCOUNT).unwrap(),
            IdempotencyKey::new(charge_id).unwrap(),
        )
    }

    async fn state(&self, charge_id: &str) -> Option<KeyState> {
        self.store
            .get(&Self::key(charge_id))
            .await
            .unwrap()
            .map(|r| r.state)
    }

    async fn drop(self) {
        example::delete_queue(&self.jobs, &self.queue)
            .await
            .unwrap();
        self.app.close().await;
        self.jobs.close().await;
        drop_schema(&self.url, &self.schema).await;
    }
}

fn job(charge_id: &str) -> ChargeJob {
    ChargeJob {
        charge_id: charge_id.to_owned(),
        account: ACCOUNT.to_owned(),
        amount: 500,
        currency: "usd".to_owned(),
        customer: "cus_jobs".to_owned(),
        payment_method: "pm_card_visa".to_owned(),
    }
}

/// `n` charge ids, each made once.
fn each_once(ids: &[&str]) -> Vec<(String, i64)> {
    let mut want: Vec<(String, i64)> = ids.iter().map(|id| ((*id).to_owned(), 1)).collect();
    want.sort();
    want
}

/// The step after the charge: fails the first time for `charge_id`.
fn fails_once_for(charge_id: &str) -> AfterCharge {
    let doomed = charge_id.to_owned();
    let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    Arc::new(move |job, _| {
        let fail =
            job.charge_id == doomed && !failed.swap(true, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            if fail {
                Err("the step after the charge failed".to_owned())
            } else {
                Ok(())
            }
        })
    })
}

/// A job whose first attempt charges and then fails (the step after the charge) is retried by
/// apalis; the retry gets the charge's stored answer, byte for byte, without the processor
/// being asked: one charge, and the job completes on its second attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_failing_after_its_charge_is_retried_and_replays_it() {
    let Some(db) = Db::fresh().await else {
        return;
    };
    let charger = Charger::new(db.idem(), db.card(false)).after(fails_once_for("order-a"));
    db.enqueue(&["order-a"]).await;
    db.work("worker", charger.clone(), 1, Duration::from_secs(60))
        .await;

    let charges = charger.charges();
    assert_eq!(charges.len(), 2, "{charges:?}");
    let (first, retry) = (&charges[0], &charges[1]);
    assert_eq!((first.attempt, first.replayed), (1, false), "{charges:?}");
    assert_eq!((retry.attempt, retry.replayed), (2, true), "{charges:?}");
    assert_eq!((retry.status, &retry.body), (first.status, &first.body));
    assert_eq!(db.charges().await, each_once(&["order-a"]));
    assert_eq!(db.state("order-a").await, Some(KeyState::Done));
    let jobs = jobs_of(&db.jobs, &db.queue).await.unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].0, "Done", "{jobs:?}");
    db.drop().await;
}

/// 40 charges in 84 jobs (30 duplicates next to their original, 14 at the end of the queue),
/// then 10 more duplicates after every job completed: every job completes, each charge id is
/// charged once, every job but one per id got a replay, and the late ones replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_jobs_charge_once_per_charge_id() {
    let Some(db) = Db::fresh().await else {
        return;
    };
    let ids: Vec<String> = (0..40).map(|i| format!("dup-{i:02}")).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let mut queue: Vec<&str> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        queue.push(id);
        if i % 4 != 3 {
            queue.push(id);
        }
    }
    queue.extend(ids.iter().step_by(3));
    let charger = Charger::new(db.idem(), db.card(false));
    db.enqueue(&queue).await;
    db.work(
        "worker-1",
        charger.clone(),
        queue.len(),
        Duration::from_secs(120),
    )
    .await;
    let late: Vec<&str> = ids.iter().copied().step_by(4).collect();
    db.enqueue(&late).await;
    let total = queue.len() + late.len();
    db.work("worker-2", charger.clone(), total, Duration::from_secs(60))
        .await;

    assert_eq!(db.charges().await, each_once(&ids));
    let charges = charger.charges();
    assert_eq!(charges.len(), total, "one answer per job");
    for id in &ids {
        let of: Vec<_> = charges.iter().filter(|c| c.charge_id == *id).collect();
        assert_eq!(
            of.iter().filter(|c| !c.replayed).count(),
            1,
            "{id} charged once: {of:?}"
        );
        assert!(
            of.iter().all(|c| c.body == of[0].body),
            "{id}: the replays are the first answer: {of:?}"
        );
    }
    for id in &late {
        let last = charges.iter().rev().find(|c| c.charge_id == *id).unwrap();
        assert!(last.replayed, "a late duplicate replays: {last:?}");
    }
    db.drop().await;
}

/// Where the kill test's child is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hang {
    /// In the charge: the processor acted, its answer is lost with the worker (the key stays
    /// `processing`).
    InCharge,
    /// After the charge: its answer is recorded (the key `done`), the job not complete.
    AfterCharge,
}

impl Hang {
    fn name(self) -> &'static str {
        match self {
            Hang::InCharge => "in-charge",
            Hang::AfterCharge => "after-charge",
        }
    }
}

/// The child of the kill tests: a worker on the queue named by [`CHILD_SPEC`] whose jobs hang
/// where the spec says; the test kills it. Run alone (no variable) it says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of the job kill tests"]
async fn child_works_until_killed() {
    let Ok(spec) = std::env::var(CHILD_SPEC) else {
        eprintln!("skipping: run by the job kill tests as their child process");
        return;
    };
    let [mode, url, schema] = spec.split(' ').collect::<Vec<_>>()[..] else {
        panic!("not a child spec: {spec:?}");
    };
    let hang = if mode == Hang::InCharge.name() {
        Hang::InCharge
    } else {
        Hang::AfterCharge
    };
    let db = Db::attach(url, schema).await;
    let after: AfterCharge = Arc::new(move |_, _| {
        Box::pin(async move {
            if hang == Hang::AfterCharge {
                // Killed here: the charge is recorded, the job not complete.
                std::future::pending::<()>().await;
            }
            Ok(())
        })
    });
    let charger = Charger::new(
        db.idem().owner("doomed-worker"),
        db.card(hang == Hang::InCharge),
    )
    .after(after);
    let storage = storage(&db.jobs, &db.queue, HEARTBEAT, MISSED);
    let ended = work_until(
        &format!("{}-doomed", db.queue),
        storage,
        charger,
        Duration::from_secs(3600),
        std::future::pending::<bool>,
    )
    .await;
    eprintln!("the child's worker ended before the kill: {ended:?}");
}

/// The sweeper over `store`, asking the card processor, every 100 ms until dropped.
fn sweeping(store: Arc<dyn Store>, card: Arc<dyn Provider>) -> AbortOnDrop {
    let sweeper = Sweeper::new(store, Providers::new().with(card))
        .backoff(Duration::from_millis(100), Duration::from_millis(500));
    AbortOnDrop(tokio::spawn(async move {
        loop {
            let _ = sweeper.run_once().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }))
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The kill test: a child worker takes job `kill-1`, the processor charges, and the child
/// hangs (`hang`); SIGKILL. Two more jobs are enqueued and a worker restarted here (with the
/// sweeper running): apalis hands the dead worker's job over once its heartbeat is missed, and
/// the retry finds the key done (after the charge) or `processing` under a dead lease (in the
/// charge: failed attempts until the sweeper, asking the processor, settles it `done`); then it
/// replays. Every job completes, each charge is made once.
async fn killed_worker(hang: Hang) {
    let Some(db) = Db::fresh().await else {
        return;
    };
    db.enqueue(&["kill-1"]).await;
    let child = crate::support::child_test(module_path!(), "child_works_until_killed")
        .env(
            CHILD_SPEC,
            format!("{} {} {}", hang.name(), db.url, db.schema),
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    eventually(
        Duration::from_secs(60),
        "the child charged kill-1",
        || async {
            let charged = !db.charges().await.is_empty();
            let key = db.state("kill-1").await;
            charged
                && match hang {
                    Hang::InCharge => key == Some(KeyState::Processing),
                    Hang::AfterCharge => key == Some(KeyState::Done),
                }
        },
    )
    .await;
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the child ended on its own"
    );
    child.0.kill().unwrap(); // SIGKILL
    child.0.wait().unwrap();
    assert_eq!(db.charges().await, each_once(&["kill-1"]));

    db.enqueue(&["kill-2", "kill-3"]).await;
    let card = db.card(false);
    let _sweeper = sweeping(db.store.clone(), card.clone());
    let charger = Charger::new(db.idem(), card);
    db.work("restarted", charger.clone(), 3, Duration::from_secs(120))
        .await;

    assert_eq!(
        db.charges().await,
        each_once(&["kill-1", "kill-2", "kill-3"])
    );
    let charges = charger.charges();
    let answered = |id: &str| -> Vec<bool> {
        charges
            .iter()
            .filter(|c| c.charge_id == id)
            .map(|c| c.replayed)
            .collect()
    };
    assert_eq!(answered("kill-1"), [true], "{charges:?}");
    assert_eq!(answered("kill-2"), [false], "{charges:?}");
    assert_eq!(answered("kill-3"), [false], "{charges:?}");
    for id in ["kill-1", "kill-2", "kill-3"] {
        assert_eq!(db.state(id).await, Some(KeyState::Done), "{id}");
    }
    let history = db.store.history(&Db::key("kill-1")).await.unwrap();
    let by_sweeper = history.iter().any(|e| e.actor == Actor::Sweeper);
    assert_eq!(by_sweeper, hang == Hang::InCharge, "{history:?}");
    let jobs = jobs_of(&db.jobs, &db.queue).await.unwrap();
    assert!(jobs.iter().all(|(s, _)| s == "Done"), "{jobs:?}");
    db.drop().await;
}

/// [`killed_worker`], killed in the charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_in_the_charge_leaves_one_charge() {
    killed_worker(Hang::InCharge).await;
}

/// [`killed_worker`], killed after the charge was recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_the_charge_leaves_one_charge() {
    killed_worker(Hang::AfterCharge).await;
}
