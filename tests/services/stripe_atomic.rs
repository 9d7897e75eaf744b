//! `examples/stripe_atomic.rs`, the one-commit Stripe receiver, fed by the testkit's signed
//! `WebhookSender` on a SQLite file: a bad signature is refused with nothing kept; duplicates,
//! concurrent ones included, and Stripe's redeliveries record each payment once; a write that
//! fails rolls the key back with the row, so the redelivery records the payment once.

#[path = "../../examples/stripe_atomic.rs"]
mod example;

use std::time::Duration;

use axum::Router;
use idemflow::axum::webhook::{OPERATION, STRIPE_SCOPE};
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::{WebhookSender, stripe_event};
use idemflow::{IdempotentRequest, KeyId, KeyState, Store};
use serde_json::{Value, json};

const SECRET: &str = "whsec_atomic_secret";

/// Serves `router` on 127.0.0.1 (port 0); returns its base URL.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    base
}

/// `payment_intent.succeeded` for `order`, as Stripe sends it (the fields the example reads).
fn paid(order: &str, intent: &str, amount: i64) -> Value {
    stripe_event(
        "payment_intent.succeeded",
        json!({
            "id": intent,
            "object": "payment_intent",
            "amount": amount,
            "amount_received": amount,
            "currency": "eur",
            "status": "succeeded",
            "metadata": {"order_id": order},
        }),
    )
}

fn key(event: &Value) -> KeyId {
    IdempotentRequest::new(
        STRIPE_SCOPE,
        event["id"].as_str().unwrap(),
        OPERATION,
        &json!({}),
    )
    .unwrap()
    .id()
    .clone()
}

async fn key_state(store: &SqliteStore, event: &Value) -> Option<KeyState> {
    store.get(&key(event)).await.unwrap().map(|r| r.state)
}

async fn orders(base: &str) -> Value {
    reqwest::get(format!("{base}/orders"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn the_example_records_each_payment_once_with_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let settings = example::Settings {
        secrets: vec![SECRET.to_owned()],
        database_url: format!("sqlite://{}", dir.path().join("atomic.db").display()),
        listen_addr: "127.0.0.1:0".to_owned(),
    };
    let (store, reads) = example::connect(&settings).await.unwrap();
    let base = serve(example::router(store.clone(), reads, &settings.secrets)).await;
    let url = format!("{base}/webhooks/stripe");
    let sender = WebhookSender::new(&url, SECRET);

    // A bad signature: 400, no key, no row.
    let first = paid("ord_1", "pi_1", 4200);
    let forged = WebhookSender::new(&url, "whsec_forged").send(&first).await;
    assert_eq!(forged.status, 400, "{forged:?}");
    assert!(forged.body.contains("signature-invalid"), "{forged:?}");
    assert_eq!(key_state(&store, &first).await, None);
    assert_eq!(orders(&base).await, json!([]));

    // Sent three times: recorded by the first, replayed to the others.
    let answers = [
        sender.send(&first).await,
        sender.send(&first).await,
        sender.send(&first).await,
    ];
    assert!(answers.iter().all(|a| a.is_success()), "{answers:?}");
    assert_eq!(
        answers.iter().map(|a| a.replayed).collect::<Vec<_>>(),
        [false, true, true]
    );
    assert_eq!(key_state(&store, &first).await, Some(KeyState::Done));

    // Twenty copies at once, then Stripe's retries until one is acknowledged.
    let second = paid("ord_2", "pi_2", 1500);
    let burst = sender.send_concurrently(&second, 20).await;
    assert!(
        burst.iter().all(|a| a.status == 200 || a.status == 409),
        "{burst:?}"
    );
    let retried = sender.deliver(&second, 10, Duration::from_millis(50)).await;
    assert!(retried.last().unwrap().is_success(), "{retried:?}");

    // An event the service does not record: acknowledged, its key committed, no row.
    let refund = stripe_event("charge.refunded", json!({"id": "ch_1"}));
    assert!(sender.send(&refund).await.is_success());
    assert!(sender.send(&refund).await.replayed);
    assert_eq!(key_state(&store, &refund).await, Some(KeyState::Done));

    // A write that fails (the table gone for a moment): 503, and neither the row nor the key is
    // kept, so Stripe's redelivery records the payment.
    let third = paid("ord_3", "pi_3", 990);
    sqlx::query("ALTER TABLE paid_orders RENAME TO paid_orders_away")
        .execute(store.writer_pool())
        .await
        .unwrap();
    let failed = sender.send(&third).await;
    assert_eq!(failed.status, 503, "{failed:?}");
    assert_eq!(key_state(&store, &third).await, None);
    sqlx::query("ALTER TABLE paid_orders_away RENAME TO paid_orders")
        .execute(store.writer_pool())
        .await
        .unwrap();
    let redelivered = sender.send(&third).await;
    assert!(redelivered.is_success(), "{redelivered:?}");
    assert!(!redelivered.replayed, "{redelivered:?}");
    assert!(sender.send(&third).await.replayed);
    assert_eq!(key_state(&store, &third).await, Some(KeyState::Done));

    assert_eq!(
        orders(&base).await,
        json!([
            {"order": "ord_1", "payments": 1, "amount": 4200},
            {"order": "ord_2", "payments": 1, "amount": 1500},
            {"order": "ord_3", "payments": 1, "amount": 990},
        ])
    );
}
