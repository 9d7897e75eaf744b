//! A background job on PostgreSQL whose card charge happens once across the job's retries.
//!
//! The queue is apalis (`apalis-postgres` 1.0, on the same sqlx 0.9 as idemflow); the job charges
//! a card through idemflow's Stripe adapter, here pointed at the in-process fake Stripe of the
//! `testkit` feature, which counts the requests it received and the PaymentIntents it made.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run --example background_jobs --features postgres,testkit
//! ```
//!
//! The key is the job's own identity, the charge id in its input (`ChargeJob::charge_id`), never
//! the queue's per-attempt task id: every attempt, and every duplicate job for the same charge,
//! runs under the same key, so the charge is made once and the later ones replay its answer.
//!
//! What it shows: three jobs (`order-1`, and `order-2` enqueued twice, as a double click would).
//! The first attempt of `order-1` charges the card and then fails in the step after the charge
//! (the receipt), before the job is marked complete; apalis retries the job, and the retry gets
//! the stored answer of the charge without Stripe being asked again. The duplicate of `order-2`
//! replays too. The summary says how many requests the fake Stripe received and how many
//! PaymentIntents it made; the example exits with 1 if any charge was made twice or any job did
//! not complete.
//!
//! On the database, apalis keeps its jobs in the schema `apalis` (creating it and the extensions
//! `pgcrypto` and `hstore` on first use) and idemflow its keys in its own tables. Each run uses a
//! queue and charge ids of its own and deletes its jobs at the end; its keys stay for the
//! retention (24 h). The crash of a worker mid-job (SIGKILL) is tested in
//! `tests/consumers/jobs.rs`; `docs/consumers.md` ("Background jobs") says what holds and what
//! does not.

// This file is also compiled into tests/consumers/jobs.rs, which uses only part of it.
#![allow(dead_code)]

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use apalis_core::backend::TaskSink;
use apalis_core::error::{AbortError, BoxDynError, WorkerError};
use apalis_core::task::attempt::Attempt;
use apalis_core::task::builder::TaskBuilder;
use apalis_core::task::data::Data;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_postgres::{Config, PostgresStorage};
use idemflow::provider::{Provider, Stripe};
use idemflow::store::postgres::PostgresStore;
use idemflow::{Error, Idempotency, IdempotentRequest, Store};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgPool;

/// The operation name of the charge in idemflow's key rows.
pub const OPERATION: &str = "jobs.charge";

/// A job's input: everything the charge needs, and the charge's own id, which is the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChargeJob {
    /// The application's id for this charge (an order's payment): the idempotency key. Two jobs
    /// with the same id are the same charge.
    pub charge_id: String,
    /// The account charged: the key's scope.
    pub account: String,
    /// In minor units.
    pub amount: u64,
    /// ISO code, lower case.
    pub currency: String,
    /// The Stripe customer (`cus_...`).
    pub customer: String,
    /// The customer's saved card (`pm_...`).
    pub payment_method: String,
}

impl ChargeJob {
    /// The idempotent request of the charge: scope the account, key the charge id, and the
    /// PaymentIntent parameters as the body (stored with the key, and what the sweeper would
    /// re-send or look up).
    pub fn request(&self) -> Result<IdempotentRequest, idemflow::error::RequestError> {
        let params = json!({
            "amount": self.amount,
            "currency": self.currency,
            "customer": self.customer,
            "payment_method": self.payment_method,
            "metadata": { "charge_id": self.charge_id },
        });
        IdempotentRequest::new(&self.account, &self.charge_id, OPERATION, &params)
    }
}

/// What an attempt of a job got from the charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charged {
    /// The charge id.
    pub charge_id: String,
    /// The queue's attempt number (1 for the first).
    pub attempt: usize,
    /// Whether the answer was replayed from idemflow's record (the provider was not asked).
    pub replayed: bool,
    /// The provider's answer: status and body, byte for byte as stored.
    pub status: u16,
    /// The body.
    pub body: Vec<u8>,
}

/// A step the job runs after the charge (mark the order paid, email the receipt); an error
/// fails the attempt, and the queue retries the job.
pub type AfterCharge = Arc<
    dyn Fn(&ChargeJob, &Charged) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>>
        + Send
        + Sync,
>;

/// What the job needs, shared by the worker's tasks (apalis `Data`).
#[derive(Clone)]
pub struct Charger {
    /// The executor.
    pub idem: Idempotency,
    /// The provider the charge goes through (forwarding the provider key).
    pub provider: Arc<dyn Provider>,
    /// The step after the charge.
    pub after: AfterCharge,
    /// Every charge an attempt got, in order (for the summary and the tests).
    pub journal: Arc<Mutex<Vec<Charged>>>,
}

impl Charger {
    /// A charger whose step after the charge does nothing.
    pub fn new(idem: Idempotency, provider: Arc<dyn Provider>) -> Self {
        Self {
            idem,
            provider,
            after: Arc::new(|_, _| Box::pin(async { Ok(()) })),
            journal: Arc::default(),
        }
    }

    /// Sets the step after the charge.
    pub fn after(mut self, after: AfterCharge) -> Self {
        self.after = after;
        self
    }

    /// The journal's entries so far.
    pub fn charges(&self) -> Vec<Charged> {
        self.journal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// How an idemflow error ends a job's attempt: `Some(wait)` when a later attempt may succeed
/// (the key is in flight, its outcome not yet known, or the store failed): the attempt waits
/// that long and fails, and the queue retries the job. `None` when retrying cannot help (the
/// charge id reused with another amount, an invalid request, a key an operator must decide):
/// the job is aborted, not retried.
pub fn retry_after(error: &Error) -> Option<Duration> {
    match error {
        Error::Store(_) => Some(Duration::from_secs(1)),
        other => other.retry_after(),
    }
}

/// The job: the charge under the job's own key, then the step after it. apalis runs it with
/// the input, the shared [`Charger`] and the attempt number.
pub async fn charge_job(
    job: ChargeJob,
    charger: Data<Charger>,
    attempt: Attempt,
) -> Result<Value, BoxDynError> {
    let request = job
        .request()
        .map_err(|e| AbortError::new(format!("charge {}: {e}", job.charge_id)))?;
    let execution = match charger.idem.call(request, charger.provider.as_ref()).await {
        Ok(execution) => execution,
        Err(e) => match retry_after(&e) {
            Some(wait) => {
                // apalis 1.0 on PostgreSQL retries a failed job at its next poll, and does not
                // take a delay from the error: the attempt waits out the Retry-After itself.
                tokio::time::sleep(wait).await;
                return Err(format!("charge {}: {e}", job.charge_id).into());
            }
            None => return Err(AbortError::new(format!("charge {}: {e}", job.charge_id)).into()),
        },
    };
    let replayed = execution.is_replay();
    let response = execution.into_response();
    let charged = Charged {
        charge_id: job.charge_id.clone(),
        attempt: attempt.current(),
        replayed,
        status: response.status(),
        body: response.body().to_vec(),
    };
    charger
        .journal
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(charged.clone());
    (charger.after)(&job, &charged).await?;
    let body: Value = serde_json::from_slice(&charged.body).unwrap_or(Value::Null);
    Ok(
        json!({"charge_id": job.charge_id, "status": charged.status, "replayed": replayed,
              "provider_id": body["id"]}),
    )
}

/// The apalis storage of `queue`, polling (and sending its heartbeat) every `heartbeat`; a worker
/// missing `missed` heartbeats is dead and its jobs are given to the living.
pub fn storage(
    pool: &PgPool,
    queue: &str,
    heartbeat: Duration,
    missed: usize,
) -> PostgresStorage<ChargeJob> {
    PostgresStorage::new(pool).with_config(
        Config::default()
            .queue(queue)
            .batch_size(4)
            .heartbeat_interval(heartbeat)
            .missed_heartbeats(missed),
    )
}

/// Enqueues `job`, tried at most `max_attempts` times.
pub async fn enqueue(
    storage: &mut PostgresStorage<ChargeJob>,
    job: ChargeJob,
    max_attempts: usize,
) -> Result<(), BoxDynError> {
    let task = TaskBuilder::new(job).max_attempts(max_attempts).build();
    storage.push_task(task).await.map_err(|e| e.to_string())?;
    Ok(())
}

/// `(status, attempts)` of every job of `queue`, oldest first.
pub async fn jobs_of(pool: &PgPool, queue: &str) -> Result<Vec<(String, i32)>, sqlx::Error> {
    sqlx::query_as("SELECT status, attempts FROM apalis.jobs WHERE job_type = $1 ORDER BY id")
        .bind(queue)
        .fetch_all(pool)
        .await
}

/// Deletes the jobs and workers of `queue`.
pub async fn delete_queue(pool: &PgPool, queue: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM apalis.jobs WHERE job_type = $1")
        .bind(queue)
        .execute(pool)
        .await?;
    sqlx::query("DELETE FROM apalis.workers WHERE worker_type = $1")
        .bind(queue)
        .execute(pool)
        .await?;
    Ok(())
}

/// How long a worker is given to stop once told to, after which it is dropped (its jobs are
/// settled by then; a job it still held would go to another worker once its heartbeat is
/// missed, as after a crash).
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// The pool a worker's storage uses: every connection given back to it is sent a `ROLLBACK`
/// first. apalis 1.0's worker sometimes gives a connection back inside a transaction (seen in
/// about one run in five of the kill test, apparently a transaction whose `BEGIN` future was
/// dropped before its answer: sqlx then does not know to roll it back); that transaction kept
/// the worker's row locked, and the worker's next heartbeat, and anything deleting the row,
/// waited on it for ever. Outside a transaction the `ROLLBACK` only draws a warning.
pub async fn worker_pool(url: &str, max: u32) -> Result<PgPool, sqlx::Error> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .after_release(|conn, _| {
            Box::pin(async move {
                // A connection that cannot roll back is closed (`false`), not reused.
                Ok(sqlx::Executor::execute(&mut *conn, "ROLLBACK")
                    .await
                    .is_ok())
            })
        })
        .connect(url)
        .await
}

/// Runs a worker named `name` on `storage` until `done` says so (checked every 100 ms) or
/// `within` has passed; `false` on the deadline.
pub async fn work_until<F, Fut>(
    name: &str,
    storage: PostgresStorage<ChargeJob>,
    charger: Charger,
    within: Duration,
    mut done: F,
) -> Result<bool, BoxDynError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let worker = WorkerBuilder::new(name)
        .backend(storage)
        .data(charger)
        .build(charge_job);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut running = tokio::spawn(worker.run_until(async move {
        let _ = stopped.await;
        Ok::<(), WorkerError>(())
    }));
    let deadline = Instant::now() + within;
    let finished = loop {
        if done().await {
            break true;
        }
        if Instant::now() >= deadline || running.is_finished() {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = stop.send(());
    match tokio::time::timeout(STOP_GRACE, &mut running).await {
        Ok(Ok(result)) => result.map_err(|e| e.to_string())?,
        Ok(Err(e)) => return Err(format!("the worker's task failed: {e}").into()),
        Err(_) => {
            running.abort();
            eprintln!("worker {name} did not stop within {STOP_GRACE:?}: dropped");
        }
    }
    Ok(finished)
}

/// The demo's settings: `DATABASE_URL`, required.
fn database_url() -> Result<String, String> {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .ok_or_else(|| {
            "DATABASE_URL is not set: export a PostgreSQL URL, e.g. \
             DATABASE_URL=postgres://postgres@127.0.0.1:5432/test"
                .to_owned()
        })
}

async fn demo(url: &str) -> Result<bool, BoxDynError> {
    let fake = idemflow::testkit::FakeStripe::start().await?;
    let stripe = Stripe::with_base_url(fake.base_url(), idemflow::testkit::FakeStripe::API_KEY)?;

    let store = PostgresStore::connect(url).await?;
    store.migrate().await?;
    let idem = Idempotency::new(Arc::new(store));
    let pool = worker_pool(url, 5).await?;
    PostgresStorage::setup(&pool).await?;

    // A queue and charge ids of this run's own: the keys of an earlier run stay for 24 h.
    let run = chrono::Utc::now().timestamp_millis();
    let queue = format!("idemflow-example-charges-{run}");
    let job = |order: &str, amount: u64| ChargeJob {
        charge_id: format!("{order}-{run}"),
        account: "acct_42".into(),
        amount,
        currency: "usd".into(),
        customer: "cus_123".into(),
        payment_method: "pm_card_visa".into(),
    };
    let (first, second) = (job("order-1", 500), job("order-2", 1200));

    // The step after the charge fails once, for order-1: the charge was made and its answer
    // recorded, but the job is not marked complete.
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let doomed = first.charge_id.clone();
    let after: AfterCharge = Arc::new(move |job, charged| {
        let fail =
            job.charge_id == doomed && !failed_once.swap(true, std::sync::atomic::Ordering::SeqCst);
        let line = format!(
            "  {} attempt {}: {} {} ({})",
            job.charge_id,
            charged.attempt,
            if charged.replayed {
                "replayed"
            } else {
                "charged"
            },
            String::from_utf8_lossy(&charged.body)
                .split('"')
                .find(|s| s.starts_with("pi_"))
                .unwrap_or("?"),
            if charged.replayed {
                "Stripe not asked"
            } else {
                "sent to Stripe"
            },
        );
        Box::pin(async move {
            if fail {
                println!("{line}, then the receipt step fails: the job is not complete");
                Err("the receipt step failed after the charge".to_owned())
            } else {
                println!("{line}");
                Ok(())
            }
        })
    });
    let charger = Charger::new(idem, Arc::new(stripe)).after(after);

    let mut jobs = storage(&pool, &queue, Duration::from_secs(1), 5);
    for job in [first.clone(), second.clone(), second.clone()] {
        enqueue(&mut jobs, job, 5).await?;
    }
    println!(
        "enqueued 3 jobs on queue {queue}: {}, {} twice",
        first.charge_id, second.charge_id
    );

    let done = {
        let (pool, queue) = (pool.clone(), queue.clone());
        move || {
            let (pool, queue) = (pool.clone(), queue.clone());
            async move {
                jobs_of(&pool, &queue)
                    .await
                    .is_ok_and(|jobs| jobs.iter().all(|(status, _)| status == "Done"))
            }
        }
    };
    let worker = format!("{queue}-worker");
    let finished = work_until(
        &worker,
        jobs,
        charger.clone(),
        Duration::from_secs(60),
        done,
    )
    .await?;
    let jobs = jobs_of(&pool, &queue).await?;
    let by_charge: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT convert_from(job, 'UTF8')::jsonb ->> 'charge_id', status, attempts \
         FROM apalis.jobs WHERE job_type = $1 ORDER BY id",
    )
    .bind(&queue)
    .fetch_all(&pool)
    .await?;
    delete_queue(&pool, &queue).await?;

    let requests = fake
        .requests()
        .iter()
        .filter(|r| r.method == "POST")
        .count();
    let ledger = fake.ledger();
    let charges = charger.charges();
    println!("summary:");
    for (charge_id, status, attempts) in &by_charge {
        println!("  job charging {charge_id}: {status} after {attempts} attempt(s)");
    }
    let mut once = true;
    for job in [&first, &second] {
        let made = ledger
            .entries()
            .iter()
            .filter(|e| e.request["metadata[charge_id]"] == job.charge_id.as_str())
            .count();
        let attempts = charges.iter().filter(|c| c.charge_id == job.charge_id);
        let replays = attempts.clone().filter(|c| c.replayed).count();
        println!(
            "  {}: {} PaymentIntent(s) at Stripe, {} charge answer(s) to the jobs, {replays} of them replayed",
            job.charge_id,
            made,
            attempts.count(),
        );
        once &= made == 1;
    }
    println!(
        "  Stripe received {requests} charge request(s) and made {} PaymentIntent(s)",
        ledger.len()
    );
    let all_done = finished && jobs.len() == 3 && jobs.iter().all(|(s, _)| s == "Done");
    if !all_done {
        println!("  NOT every job completed within 60 s");
    }
    if !once {
        println!("  a charge was NOT made exactly once");
    }
    Ok(all_done && once)
}

#[tokio::main]
async fn main() -> ExitCode {
    let url = match database_url() {
        Ok(url) => url,
        Err(e) => {
            eprintln!("background_jobs: {e}");
            return ExitCode::from(2);
        }
    };
    match demo(&url).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("background_jobs: {e}");
            ExitCode::FAILURE
        }
    }
}
