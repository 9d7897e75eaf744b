//! A worker process killed inside a Stripe capture or refund: the child (this test binary, re-run
//! as [`child_calls_until_killed`]) calls `Idempotency::call` with the capture or the refund
//! adapter; the fake Stripe performs the effect and never answers, and the test SIGKILLs the
//! child while it waits. The key is left `processing` under the dead worker's lease; once the
//! lease runs out, a sweeper settles it by a same-key re-drive (Stripe replays the saved answer),
//! and the client's retry replays that answer: one capture and one refund in the fake's ledger.
//! On SQLite (a file database) always, and on PostgreSQL when `IDEMFLOW_TEST_POSTGRES_URL` is set.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use idemflow::provider::Stripe;
use idemflow::provider::stripe::StripeOperation;
use idemflow::testkit::FakeStripe;
use idemflow::{Idempotency, IdempotentRequest, KeyState, Providers, Store, Sweeper};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::KillOnDrop;

/// The child's store (a database URL), the fake's base URL, and what to call:
/// `capture <pi>` or `refund <pi>`.
const CHILD_URL: &str = "IDEMFLOW_OPERATIONS_KILL_URL";
const CHILD_STRIPE: &str = "IDEMFLOW_OPERATIONS_KILL_STRIPE";
const CHILD_CALL: &str = "IDEMFLOW_OPERATIONS_KILL_CALL";
/// The worker's lease: short, so that the sweeper may take the key soon after the kill.
const LEASE: Duration = Duration::from_secs(1);

fn adapter(base: &str, operation: StripeOperation) -> Arc<Stripe> {
    Arc::new(
        Stripe::with_base_url(base, FakeStripe::API_KEY)
            .unwrap()
            .http_config(idemflow::provider::http::HttpConfig {
                request_timeout: Duration::from_secs(60),
                max_attempts: 1,
                ..Default::default()
            })
            .unwrap()
            .operation(operation),
    )
}

/// The client's request for `op` (`capture` or `refund`) of PaymentIntent `pi`.
fn request(op: &str, pi: &str) -> IdempotentRequest {
    let body = match op {
        "capture" => json!({"payment_intent": pi}),
        _ => json!({"payment_intent": pi, "amount": 250}),
    };
    IdempotentRequest::new(
        "shop-kill",
        &format!("{op}-{pi}"),
        &format!("payments.{op}"),
        &body,
    )
    .unwrap()
}

fn operation(op: &str) -> StripeOperation {
    if op == "capture" {
        StripeOperation::Capture
    } else {
        StripeOperation::Refund
    }
}

/// The child of the tests below: one `Idempotency::call` of the operation [`CHILD_CALL`] names;
/// the test kills it while the fake holds the answer back. Run alone (no variables) it does
/// nothing and says so.
#[test]
#[ignore = "the child process of the operations_kill tests"]
fn child_calls_until_killed() {
    let (Ok(url), Ok(base), Ok(call)) = (
        std::env::var(CHILD_URL),
        std::env::var(CHILD_STRIPE),
        std::env::var(CHILD_CALL),
    ) else {
        eprintln!("skipping: run by the operations_kill tests as their child process");
        return;
    };
    let rt = crate::support::child_runtime();
    rt.block_on(async move {
        let store = idemflow::store::connect(&url).await.unwrap();
        let idem = Idempotency::new(store).lease(LEASE);
        let (op, pi) = call.split_once(' ').unwrap();
        let answer = idem
            .call(request(op, pi), adapter(&base, operation(op)).as_ref())
            .await;
        eprintln!("child call ended before the kill: {answer:?}");
    });
}

async fn killed_inside_a_capture_and_a_refund(store: Arc<dyn Store>, url: String) {
    store.migrate().await.unwrap();
    let fake = FakeStripe::start().await.unwrap();
    let base = fake.base_url().to_owned();
    let idem = Idempotency::new(store.clone());
    // A payment authorised through idemflow, to capture and then refund.
    let create = adapter(&base, StripeOperation::CreatePayment);
    let auth = IdempotentRequest::new(
        "shop-kill",
        "order-kill",
        "payments.create",
        &json!({"amount": 1000, "currency": "usd", "payment_method": "pm_card_visa",
                "capture_method": "manual"}),
    )
    .unwrap();
    let pi: Value = idem
        .call(auth, create.as_ref())
        .await
        .unwrap()
        .response()
        .body_json()
        .unwrap();
    let pi = pi["id"].as_str().unwrap().to_owned();
    let sweeper = Sweeper::new(
        store.clone(),
        Providers::new()
            .with(adapter(&base, StripeOperation::Capture))
            .with(adapter(&base, StripeOperation::Refund)),
    );

    for op in ["capture", "refund"] {
        let effects = || {
            fake.ledger()
                .entries()
                .iter()
                .filter(|e| e.kind == op)
                .count()
        };
        fake.faults().hang_next_response();
        let child = crate::support::child_test(module_path!(), "child_calls_until_killed")
            .env(CHILD_URL, &url)
            .env(CHILD_STRIPE, &base)
            .env(CHILD_CALL, format!("{op} {pi}"))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut child = KillOnDrop(child);
        let child = &mut child.0;
        // Inside the provider call: the fake performed the effect and holds the answer back.
        let asked = Instant::now();
        while effects() == 0 {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("{op}: the child exited ({status}) before the fake acted");
            }
            assert!(
                asked.elapsed() < Duration::from_secs(60),
                "{op}: the child never called"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let req = request(op, &pi);
        let row = store.get(req.id()).await.unwrap().unwrap();
        assert_eq!(
            row.state,
            KeyState::Processing,
            "{op}: killed inside the call"
        );
        child.kill().unwrap();
        assert!(!child.wait().unwrap().success(), "{op}: killed");

        // The dead worker's lease runs out; the sweeper re-drives the key and Stripe replays.
        let killed = Instant::now();
        loop {
            let report = sweeper.run_once().await.unwrap();
            let row = store.get(req.id()).await.unwrap().unwrap();
            if row.state == KeyState::Done {
                eprintln!(
                    "{op}: settled {:?} after the kill, {report:?}",
                    killed.elapsed()
                );
                break;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(30),
                "{op}: not settled: {} {report:?}",
                row.state
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(effects(), 1, "{op}: one effect");
        let retry = idem
            .call(req, adapter(&base, operation(op)).as_ref())
            .await
            .unwrap();
        assert!(retry.is_replay(), "{op}");
        let answer: Value = retry.response().body_json().unwrap();
        let expected = if op == "capture" {
            "payment_intent"
        } else {
            "refund"
        };
        assert_eq!(answer["object"], expected, "{op}: {answer}");
        assert_eq!(effects(), 1, "{op}: one effect after the retry");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_worker_killed_inside_a_capture_and_a_refund() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("kill.db").display());
    let store = idemflow::store::connect(&url).await.unwrap();
    killed_inside_a_capture_and_a_refund(store, url).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_worker_killed_inside_a_capture_and_a_refund() {
    let Some((url, schema)) = crate::support::postgres::fresh_schema().await else {
        return;
    };
    let url = crate::support::postgres::url_in(&url, &schema);
    let store = idemflow::store::connect(&url).await.unwrap();
    killed_inside_a_capture_and_a_refund(store, url).await;
}
