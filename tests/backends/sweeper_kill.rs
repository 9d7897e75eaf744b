//! A sweeper killed mid-batch strands nothing, on every backend: a child process (this test
//! binary, re-run as [`child_sweeps_until_killed`]) takes a batch of stale keys with the
//! sweeper's default settings: eight payments whose answers were lost, and a checkout workflow
//! whose charge happened and whose receipt did not (the child has its resumer). The first call
//! it makes to the testkit's fake Stripe (a payment's re-drive, or the resumed workflow's
//! receipt, in whatever order the store returned the batch) acts and never answers. While the
//! child is inside that call, every key of its batch is held under its lease; the test then
//! kills it with SIGKILL, as a crash, a deploy or the OOM killer would. A second sweeper (default settings, a sweep every 500 ms) must give every key of
//! the dead sweeper's batch its final answer within [`BOUND`] of the kill, with one charge per key
//! in the fake's ledger (`docs/reliability.md`, "A sweeper that dies").

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use idemflow::provider::Stripe;
use idemflow::testkit::FakeStripe;
use idemflow::{
    Context, Error, Idempotency, IdempotentRequest, KeyState, Outcome, Providers, Store,
    StoredResponse, Sweeper, workflow::Step,
};
use serde_json::json;
use tokio::time::Instant;

use crate::support::KillOnDrop;

/// Every key of the dead sweeper's batch has its final answer this soon after the kill.
const BOUND: Duration = Duration::from_secs(15);
/// The keys of the batch.
const KEYS: u64 = 8;
/// Where the child finds the store: see [`StoreSpec`].
const CHILD_STORE: &str = "IDEMFLOW_SWEEPER_KILL_STORE";
/// The fake Stripe's base URL, for the child.
const CHILD_STRIPE: &str = "IDEMFLOW_SWEEPER_KILL_STRIPE";
/// The lease owner the child records on the keys it takes.
const DOOMED: &str = "doomed-sweeper";

/// A store both processes can open: `url <DATABASE_URL>` (SQLite file, PostgreSQL, MariaDB), or
/// `redis <url> <prefix>` / `cluster <url> <prefix>`.
#[derive(Debug, Clone)]
struct StoreSpec(String);

impl StoreSpec {
    async fn open(&self) -> Arc<dyn Store> {
        let parts: Vec<&str> = self.0.split(' ').collect();
        match parts.as_slice() {
            ["url", url] => idemflow::store::connect(url).await.unwrap(),
            #[cfg(feature = "redis")]
            [kind @ ("redis" | "cluster"), url, prefix] => {
                use idemflow::store::redis::{RedisConfig, RedisStore};
                let mut config = RedisConfig::new(*url).prefix(*prefix);
                if *kind == "cluster" {
                    config = config
                        .cluster(true)
                        .buckets(crate::support::redis::CLUSTER_BUCKETS);
                }
                Arc::new(RedisStore::connect_with(config).await.unwrap())
            }
            _ => panic!("not a store spec: {:?}", self.0),
        }
    }
}

fn stripe(fake_url: &str) -> Arc<Stripe> {
    Arc::new(Stripe::with_base_url(fake_url, FakeStripe::API_KEY).unwrap())
}

fn payment(scope: &str, i: u64) -> IdempotentRequest {
    IdempotentRequest::new(
        scope,
        &format!("pay-{i}"),
        "payments.create",
        &json!({"amount": 1000 + i, "currency": "usd", "payment_method": "pm_card_visa"}),
    )
    .unwrap()
    .provider("stripe")
}

/// A checkout workflow: the charge (through Stripe), then the receipt (local). `die` makes it
/// stop after the charge with an unknown outcome, as a process that died between the two.
fn checkout(scope: &str) -> IdempotentRequest {
    IdempotentRequest::new(scope, "order-1", "checkout", &json!({"order": 1}))
        .unwrap()
        .workflow()
}

type Checkout = Arc<dyn Fn(Context) -> BoxedOutcome + Send + Sync>;
type BoxedOutcome = std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send>>;

fn checkout_op(fake_url: &str, die: bool) -> Checkout {
    let stripe = stripe(fake_url);
    Arc::new(move |ctx: Context| {
        let stripe = stripe.clone();
        Box::pin(async move {
            let body = json!({"amount": 5000, "currency": "usd", "payment_method": "pm_card_visa"});
            let charge = Step::new("charge", &body).unwrap();
            if let Err(e) = ctx.call_step(charge, &*stripe).await {
                return Outcome::from_step_error(&e);
            }
            if die {
                return Outcome::unknown("the process died between the charge and the receipt");
            }
            // The receipt goes out through the fake too, so that whichever the child sweeper
            // handles first, a payment's re-drive or this workflow's resume, hangs there.
            let body = json!({"amount": 1, "currency": "usd", "payment_method": "pm_card_visa"});
            let receipt = Step::new("receipt", &body).unwrap();
            match ctx.call_step(receipt, &*stripe).await {
                Ok(_) => Outcome::Succeeded(StoredResponse::new(201)),
                Err(e) => Outcome::from_step_error(&e),
            }
        })
    })
}

/// A sweeper over `store` with default settings that resumes checkouts.
fn sweeper(store: Arc<dyn Store>, fake_url: &str, owner: &str) -> Sweeper {
    let op = checkout_op(fake_url, false);
    Sweeper::new(store.clone(), Providers::new().with(stripe(fake_url)))
        .owner(owner)
        .resumer("checkout", Idempotency::new(store), move |ctx| op(ctx))
}

/// The child of the tests below: one sweep with default settings over the store named by
/// [`CHILD_STORE`], against the fake Stripe at [`CHILD_STRIPE`]; the test kills it mid-sweep.
/// Run alone (no variables) it has nothing to sweep and says so.
#[test]
#[ignore = "the child process of the sweeper_kill tests"]
fn child_sweeps_until_killed() {
    let (Ok(spec), Ok(fake)) = (std::env::var(CHILD_STORE), std::env::var(CHILD_STRIPE)) else {
        eprintln!("skipping: run by the sweeper_kill tests as their child process");
        return;
    };
    let rt = crate::support::child_runtime();
    rt.block_on(async move {
        let store = StoreSpec(spec).open().await;
        let sweeper = sweeper(store, &fake, DOOMED);
        // The test kills this process while the first re-drive hangs; a sweep that ends on its
        // own (the adapter gave up first) is reported to the test by the exit status.
        let report = sweeper.run_once().await;
        eprintln!("child sweep ended before the kill: {report:?}");
    });
}

/// The test: keys left by a worker that lost Stripe's answers, a child sweeper killed inside
/// its first re-drive, and a second sweeper that must settle the whole batch within [`BOUND`].
async fn killed_sweeper_strands_nothing(name: &str, spec: StoreSpec) {
    let store = spec.open().await;
    store.migrate().await.unwrap();
    let fake = FakeStripe::start().await.unwrap();
    let scope = idemflow::conformance::unique("sweeper-kill");
    // A worker with the default lease lost every answer: the keys are released, stale at once.
    let idem = Idempotency::new(store.clone());
    for i in 0..KEYS {
        let lost = idem
            .execute(payment(&scope, i), |_| async {
                Outcome::unknown("the worker lost Stripe's answer")
            })
            .await;
        assert!(
            matches!(lost, Err(Error::OutcomeUnknown { .. })),
            "{lost:?}"
        );
    }
    // Then a checkout whose charge happened and whose receipt did not: the workflow waits for
    // a resumer (a sweeper that has one).
    let lost = idem
        .execute(checkout(&scope), {
            let op = checkout_op(fake.base_url(), true);
            move |ctx| op(ctx)
        })
        .await;
    assert!(
        matches!(lost, Err(Error::OutcomeUnknown { .. })),
        "{lost:?}"
    );
    assert_eq!(fake.ledger().len(), 1, "the checkout's charge");
    let mut ids: Vec<_> = (0..KEYS).map(|i| payment(&scope, i).id().clone()).collect();
    ids.push(checkout(&scope).id().clone());
    // The child's first re-drive charges and never gets an answer.
    fake.faults().hang_next_response();
    let child = crate::support::child_test(module_path!(), "child_sweeps_until_killed")
        .env(CHILD_STORE, &spec.0)
        .env(CHILD_STRIPE, fake.base_url())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let child = &mut child.0;
    // Inside the provider call: the fake has the first re-drive.
    let asked = Instant::now();
    while fake
        .requests()
        .iter()
        .filter(|r| r.method == "POST")
        .count()
        < 2
    {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("[{name}] the child sweeper exited ({status}) before its re-drive");
        }
        assert!(
            asked.elapsed() < Duration::from_secs(60),
            "[{name}] the child sweeper never re-drove"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for id in &ids {
        let r = store.get(id).await.unwrap().unwrap();
        assert_eq!(
            (r.state, r.lease_owner.as_deref()),
            (KeyState::Processing, Some(DOOMED)),
            "[{name}] {id}: every key of the batch is held by the child when it is killed"
        );
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    let killed = Instant::now();
    assert!(!status.success(), "[{name}] the child was killed: {status}");

    let rescuer = sweeper(store.clone(), fake.base_url(), "rescuer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        rescuer
            .run(Duration::from_millis(500), async {
                let _ = stopped.await;
            })
            .await
    });
    let mut settled: Vec<Option<Duration>> = vec![None; ids.len()];
    while settled.iter().any(Option::is_none) && killed.elapsed() < BOUND {
        for (n, id) in ids.iter().enumerate() {
            if settled[n].is_none() && store.get(id).await.unwrap().unwrap().state == KeyState::Done
            {
                settled[n] = Some(killed.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    let summary = running.await.unwrap();
    let mut missing = Vec::new();
    for (id, at) in ids.iter().zip(&settled) {
        let r = store.get(id).await.unwrap().unwrap();
        eprintln!(
            "[{name}] {id}: {} after {at:?} (owner {:?})",
            r.state, r.lease_owner
        );
        // A workflow acts through its steps: the charge and the receipt.
        let mut acted = vec![r.provider_key.clone()];
        if r.kind() == idemflow::record::KeyKind::Workflow {
            acted.clear();
            for position in 0..2 {
                let step = idemflow::workflow::step_key(id, position);
                acted.push(store.get(&step).await.unwrap().unwrap().provider_key);
            }
        }
        match at {
            Some(_) => {
                for key in &acted {
                    assert_eq!(
                        fake.ledger().count_for_key(key),
                        1,
                        "[{name}] {id}: one effect for {key}"
                    );
                }
            }
            None => missing.push(format!(
                "{id}: {} (lease owner {:?}, expires {:?})",
                r.state, r.lease_owner, r.lease_expires_at
            )),
        }
    }
    assert!(
        missing.is_empty(),
        "[{name}] keys of the killed sweeper's batch without a final answer {BOUND:?} after \
         the kill: {missing:?} (rescuer: {summary:?})"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_file() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("sweeper-kill.db").display());
    killed_sweeper_strands_nothing("sqlite", StoreSpec(format!("url {url}"))).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    use crate::support::postgres::{drop_schema, fresh_schema, url_in};
    let Some((admin, schema)) = fresh_schema().await else {
        return;
    };
    let url = url_in(&admin, &schema);
    killed_sweeper_strands_nothing("postgres", StoreSpec(format!("url {url}"))).await;
    drop_schema(&admin, &schema).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    use crate::support::mysql::{URL_VAR, drop_database, fresh_database};
    let Some((options, name)) = fresh_database().await else {
        return;
    };
    let mut url = reqwest::Url::parse(&std::env::var(URL_VAR).unwrap()).unwrap();
    url.set_path(&format!("/{name}"));
    killed_sweeper_strands_nothing("mysql", StoreSpec(format!("url {url}"))).await;
    drop_database(&options, &name).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    use crate::support::{backend_url, redis::URL_VAR};
    let Some(url) = backend_url(URL_VAR) else {
        return;
    };
    let prefix = idemflow::conformance::unique("idemflow-sweeper-kill");
    killed_sweeper_strands_nothing("redis", StoreSpec(format!("redis {url} {prefix}"))).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster() {
    use crate::support::{backend_url, redis::CLUSTER_URL_VAR};
    let Some(url) = backend_url(CLUSTER_URL_VAR) else {
        return;
    };
    let prefix = idemflow::conformance::unique("idemflow-sweeper-kill");
    killed_sweeper_strands_nothing("cluster", StoreSpec(format!("cluster {url} {prefix}"))).await;
}
