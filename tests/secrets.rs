//! Secrets stay out of storage and output: Stripe's `client_secret` (a field the adapter
//! declares secret) is masked before any answer is stored, whether the worker or the sweeper
//! stores it; the application's own fields are masked by `redact_with`; and neither `inspect`
//! nor `reconcile --json` prints the client secret or the API key.

#![cfg(all(feature = "testkit", feature = "sqlite"))]

use std::sync::Arc;
use std::time::Duration;

use idemflow::provider::Stripe;
use idemflow::provider::http::HttpConfig;
use idemflow::provider::secrets::{REDACTED, mask_fields};
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::FakeStripe;
use idemflow::{
    Idempotency, IdempotentRequest, KeyState, Outcome, Providers, Store, StoredResponse, Sweeper,
};
use serde_json::{Value, json};

const SECRET_MARK: &str = "_secret_";

fn stripe(fake: &FakeStripe) -> Arc<Stripe> {
    Arc::new(
        Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
            .unwrap()
            .http_config(HttpConfig {
                request_timeout: Duration::from_secs(2),
                max_attempts: 1,
                ..HttpConfig::default()
            })
            .unwrap(),
    )
}

fn charge(key: &str) -> IdempotentRequest {
    IdempotentRequest::new(
        "shop-1",
        key,
        "payments.create",
        &json!({"amount": 1500, "currency": "usd", "payment_method": "pm_card_visa"}),
    )
    .unwrap()
}

async fn file_store(dir: &tempfile::TempDir) -> (Arc<dyn Store>, String) {
    let url = format!("sqlite://{}", dir.path().join("secrets.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    (Arc::new(store), url)
}

fn text(r: &StoredResponse) -> String {
    String::from_utf8_lossy(r.body()).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_secret_is_never_stored_nor_printed() {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = stripe(&fake);
    let dir = tempfile::tempdir().unwrap();
    let (store, url) = file_store(&dir).await;
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(400));

    // The worker stores Stripe's answer.
    let paid = idem.call(charge("order-1"), stripe.as_ref()).await.unwrap();
    let body: Value = paid.response().body_json().unwrap();
    assert_eq!(body["client_secret"], REDACTED, "{body}");
    assert_eq!(body["object"], "payment_intent");
    // Stripe did send one: the fake's ledger has it.
    assert!(fake.requests().len() == 1);

    // The sweeper stores Stripe's answer after a lost response (a same-key re-drive).
    fake.faults().lose_next_response();
    let lost = idem.call(charge("order-2"), stripe.as_ref()).await;
    assert!(lost.is_err(), "{lost:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = Sweeper::new(store.clone(), Providers::new().with(stripe.clone()))
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.done, 1, "{report:?}");

    for key in ["order-1", "order-2"] {
        let row = store.get(charge(key).id()).await.unwrap().unwrap();
        assert_eq!(row.state, KeyState::Done);
        let stored = text(row.response.as_ref().unwrap());
        assert!(!stored.contains(SECRET_MARK), "{key}: {stored}");
        assert!(stored.contains(REDACTED), "{key}: {stored}");
    }

    #[cfg(feature = "cli")]
    {
        let config = dir.path().join("idemflow.toml");
        std::fs::write(
            &config,
            "[[providers]]\nname = \"stripe\"\nkind = \"stripe\"\napi_key_env = \"TEST_STRIPE_KEY\"\n",
        )
        .unwrap();
        let run = |args: &[&str]| {
            std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
                .args(args)
                .env("DATABASE_URL", &url)
                .env("TEST_STRIPE_KEY", FakeStripe::API_KEY)
                .env_remove("IDEMFLOW_CONFIG")
                .output()
                .unwrap()
        };
        for args in [
            vec!["inspect", "shop-1", "order-1"],
            vec!["--json", "inspect", "shop-1", "order-2"],
            vec![
                "-vv",
                "--json",
                "reconcile",
                "--once",
                "--config",
                config.to_str().unwrap(),
            ],
            vec!["--json", "stats"],
        ] {
            let o = run(&args);
            let out = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            assert!(o.status.success(), "{args:?}: {out}");
            assert!(
                !out.contains(SECRET_MARK),
                "{args:?} printed a client secret: {out}"
            );
            assert!(
                !out.contains(FakeStripe::API_KEY),
                "{args:?} printed the API key: {out}"
            );
        }
    }
}

/// The application's own fields are masked by `redact_with` before storing, for the first
/// caller and every replay alike.
#[tokio::test]
async fn redact_with_masks_the_applications_fields() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    let idem = Idempotency::new(store.clone())
        .redact_with(|resp| mask_fields(resp, &["card_number", "token"]));
    let answer = || async {
        Outcome::Succeeded(
            StoredResponse::json(
                201,
                &json!({"id": "u1", "card_number": "4242424242424242", "nested": {"token": "tok_9"}}),
            )
            .unwrap(),
        )
    };
    let first = idem.execute(charge("u1"), |_| answer()).await.unwrap();
    let again = idem.execute(charge("u1"), |_| answer()).await.unwrap();
    assert!(again.is_replay());
    assert_eq!(first.response(), again.response());
    let stored = text(
        store
            .get(charge("u1").id())
            .await
            .unwrap()
            .unwrap()
            .response
            .as_ref()
            .unwrap(),
    );
    for secret in ["4242424242424242", "tok_9"] {
        assert!(!stored.contains(secret), "{stored}");
        assert!(!text(first.response()).contains(secret));
    }
    assert!(stored.contains("\"id\":\"u1\""), "{stored}");
}
