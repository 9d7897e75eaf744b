//! Issue 23's crash test for the webhook receiver: a child process (this test binary, re-run as
//! [`child_serves_a_one_commit_receiver`]) serves a one-commit Stripe receiver
//! (`WebhookReceiver::stripe_atomic`) on a SQLite file. A signed delivery reaches it; its effect's
//! row is inserted inside the event key's transaction, the child says so and waits before the
//! commit, and the test kills it there with SIGKILL. Nothing of the delivery may be kept (no key,
//! no row); Stripe's redelivery to the restarted receiver makes the effect once, and every later
//! redelivery is answered 200 as a replay without a second effect.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use axum::Router;
use idemflow::axum::webhook::{
    OPERATION, STRIPE_SCOPE, WebhookEvent, WebhookReceiver, acknowledgement,
};
use idemflow::provider::stripe_signature::StripeSignature;
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::{WebhookSender, stripe_event};
use idemflow::{Idempotency, IdempotentRequest, KeyState, Store};
use serde_json::json;
use tokio::time::Instant;

use crate::support::KillOnDrop;

const SECRET: &str = "whsec_kill_secret";
/// The SQLite file's URL, for the child.
const CHILD_URL: &str = "IDEMFLOW_WEBHOOK_KILL_URL";
/// Where the child writes the address it serves on.
const CHILD_ADDR: &str = "IDEMFLOW_WEBHOOK_KILL_ADDR";
/// Set: the file the child creates once the effect's row is inserted (inside the open
/// transaction), after which it waits for the kill. Unset: the child commits at once.
const CHILD_MARK: &str = "IDEMFLOW_WEBHOOK_KILL_MARK";
/// The application's table: no unique constraint, so a second effect would show.
const EFFECTS: &str =
    "CREATE TABLE IF NOT EXISTS kill_effects (event TEXT NOT NULL, pid INTEGER NOT NULL)";

/// The child: serves the one-commit receiver until killed. Run alone (no variables) it says so
/// and ends.
#[test]
#[ignore = "the child process of the webhook_kill test"]
fn child_serves_a_one_commit_receiver() {
    let (Ok(url), Ok(addr_file)) = (std::env::var(CHILD_URL), std::env::var(CHILD_ADDR)) else {
        eprintln!("skipping: run by the webhook_kill test as its child process");
        return;
    };
    let mark = std::env::var(CHILD_MARK).ok();
    let rt = crate::support::child_runtime();
    rt.block_on(async move {
        let store = SqliteStore::connect(&url).await.unwrap();
        let phases = store.clone();
        let receiver = WebhookReceiver::stripe_atomic(
            Idempotency::new(std::sync::Arc::new(store)),
            StripeSignature::new(SECRET),
            move |event: WebhookEvent| {
                let (id, mark) = (event.id().to_owned(), mark.clone());
                phases.atomic_phase(move |conn| {
                    let (id, mark) = (id.clone(), mark.clone());
                    Box::pin(async move {
                        sqlx::query("INSERT INTO kill_effects (event, pid) VALUES (?, ?)")
                            .bind(&id)
                            .bind(i64::from(std::process::id()))
                            .execute(&mut *conn)
                            .await?;
                        if let Some(mark) = mark {
                            // The row is in, the transaction open: tell the test, then wait for
                            // the kill (well inside the phase's 5 s timeout).
                            std::fs::write(&mark, b"inserted")?;
                            tokio::time::sleep(Duration::from_secs(4)).await;
                        }
                        Ok(acknowledgement(&id))
                    })
                })
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let tmp = format!("{addr_file}.tmp");
        std::fs::write(&tmp, addr.to_string()).unwrap();
        std::fs::rename(&tmp, &addr_file).unwrap();
        let app = Router::new().route_service("/webhooks/stripe", receiver);
        axum::serve(listener, app).await.unwrap();
    });
}

/// Starts the child on `url`, waits for its address; with `mark`, its first effect waits for
/// the kill.
async fn start(url: &str, dir: &Path, run: u32, mark: Option<&PathBuf>) -> (KillOnDrop, String) {
    let addr_file = dir.join(format!("addr-{run}"));
    let mut cmd = crate::support::child_test(module_path!(), "child_serves_a_one_commit_receiver");
    cmd.env(CHILD_URL, url)
        .env(CHILD_ADDR, &addr_file)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(mark) = mark {
        cmd.env(CHILD_MARK, mark);
    }
    let mut child = KillOnDrop(cmd.spawn().unwrap());
    let asked = Instant::now();
    let addr = loop {
        if let Ok(addr) = std::fs::read_to_string(&addr_file) {
            break addr;
        }
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("the child exited ({status}) before serving");
        }
        assert!(
            asked.elapsed() < Duration::from_secs(60),
            "the child never served"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    (child, format!("http://{addr}/webhooks/stripe"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_killed_inside_the_effects_transaction_makes_it_once() {
    let dir = tempfile::tempdir().unwrap().keep();
    let url = format!("sqlite://{}", dir.join("hooks.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query(EFFECTS)
        .execute(store.writer_pool())
        .await
        .unwrap();
    let event = stripe_event("invoice.paid", json!({"id": "in_kill"}));
    let id = event["id"].as_str().unwrap().to_owned();
    let key = IdempotentRequest::new(STRIPE_SCOPE, &id, OPERATION, &json!({}))
        .unwrap()
        .id()
        .clone();
    let effects = || {
        let (pool, id) = (store.writer_pool().clone(), id.clone());
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM kill_effects WHERE event = ?")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    // The first delivery: killed inside its transaction.
    let mark = dir.join("inserted");
    let (mut child, endpoint) = start(&url, &dir, 1, Some(&mark)).await;
    let sender = WebhookSender::new(endpoint, SECRET);
    let first = {
        let event = event.clone();
        tokio::spawn(async move { sender.send(&event).await })
    };
    let asked = Instant::now();
    while !mark.exists() {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("the child exited ({status}) before its insert");
        }
        assert!(
            asked.elapsed() < Duration::from_secs(60),
            "the child never inserted its effect"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    child.0.kill().unwrap();
    let status = child.0.wait().unwrap();
    assert!(!status.success(), "the child was killed: {status}");
    let first = first.await.unwrap();
    assert_ne!(
        first.status / 100,
        2,
        "no 2xx from a killed receiver: {first:?}"
    );
    assert!(
        store.get(&key).await.unwrap().is_none(),
        "nothing of the killed delivery is kept: no key"
    );
    assert_eq!(
        effects().await,
        0,
        "nothing of the killed delivery is kept: no row"
    );

    // Stripe redelivers (until a 2xx) to the restarted receiver: the effect is made once.
    let (_child, endpoint) = start(&url, &dir, 2, None).await;
    let sender = WebhookSender::new(endpoint, SECRET);
    let answers = sender.deliver(&event, 20, Duration::from_millis(200)).await;
    let last = answers.last().unwrap();
    assert_eq!(last.status, 200, "{answers:?}");
    assert!(!last.replayed, "{answers:?}");
    let again = sender.send(&event).await;
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
    assert_eq!(effects().await, 1, "exactly one effect for the event");
    assert_eq!(
        store.get(&key).await.unwrap().unwrap().state,
        KeyState::Done
    );
    println!("webhook receiver killed inside its transaction: the redelivery made the one effect");
}
