//! The checkout service example (a two-step workflow behind the layer) over real sockets on
//! 127.0.0.1, against the testkit's fake Stripe and Resend: an order, its replay, a declined
//! card, and a lost receipt answer settled and resumed by the service's own sweeper.

#![cfg(all(
    feature = "axum",
    feature = "http",
    feature = "testkit",
    feature = "sqlite"
))]

#[path = "../examples/checkout_service.rs"]
mod checkout_service;

use std::sync::Arc;
use std::time::Duration;

use idemflow::testkit::{FakeResend, FakeStripe};
use idemflow::{Idempotency, KeyState};
use serde_json::{Value, json};

const LEASE: Duration = Duration::from_millis(400);

struct Service {
    base: String,
    idem: Idempotency,
    shop: Arc<checkout_service::Shop>,
    stripe: FakeStripe,
    resend: FakeResend,
    _dir: tempfile::TempDir,
}

async fn start() -> Service {
    let stripe = FakeStripe::start().await.unwrap();
    let resend = FakeResend::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let settings = checkout_service::Settings {
        database_url: format!("sqlite://{}", dir.path().join("shop.db").display()),
        listen_addr: "127.0.0.1:0".into(),
        stripe: (stripe.base_url().to_owned(), FakeStripe::API_KEY.into()),
        resend: (resend.base_url().to_owned(), FakeResend::API_KEY.into()),
        receipt_from: "shop@example.com".into(),
        lease: Some(LEASE),
    };
    let (idem, shop) = checkout_service::connect(&settings).await.unwrap();
    let app = checkout_service::router(idem.clone(), shop.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Service {
        base,
        idem,
        shop,
        stripe,
        resend,
        _dir: dir,
    }
}

async fn order(s: &Service, key: &str, pm: &str) -> (u16, bool, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{}/orders", s.base))
        .header("idempotency-key", format!("\"{key}\""))
        .header("x-account-id", "acct_1")
        .json(
            &json!({"amount": 1500, "currency": "usd", "payment_method": pm,
                      "email": "ana@example.org"}),
        )
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let replayed = resp.headers().get("idempotent-replayed").is_some();
    (status, replayed, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_charges_once_emails_once_and_replays() {
    let s = start().await;
    let (status, replayed, body) = order(&s, "order-1", "pm_card_visa").await;
    assert_eq!((status, replayed), (201, false), "{body}");
    assert!(
        body["payment"].as_str().unwrap().starts_with("pi_"),
        "{body}"
    );
    assert_eq!(body["order"], "order-1");
    let (status, replayed, again) = order(&s, "order-1", "pm_card_visa").await;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(again, body);
    assert_eq!((s.stripe.ledger().len(), s.resend.ledger().len()), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_card_is_stored_and_sends_no_receipt() {
    let s = start().await;
    let (status, _, body) = order(&s, "order-2", FakeStripe::DECLINED_CARD).await;
    assert_eq!(status, 402, "{body}");
    let (status, replayed, _) = order(&s, "order-2", FakeStripe::DECLINED_CARD).await;
    assert_eq!((status, replayed), (402, true));
    assert_eq!(s.resend.ledger().len(), 0);
}

/// The receipt is sent but every answer to it is lost: the order answers 503 and stays unfinished. The
/// service's sweeper settles the receipt step from Resend (a same-key re-send inside Resend's
/// window replays it) and resumes the order; the client's retry gets the finished order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_receipt_answer_is_settled_and_the_order_resumed() {
    let s = start().await;
    // Every try of the adapter's call (3 by default) loses its answer.
    for _ in 0..3 {
        s.resend.faults().lose_next_response();
    }
    let (status, _, body) = order(&s, "order-3", "pm_card_visa").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        (s.stripe.ledger().len(), s.resend.ledger().len()),
        (1, 1),
        "Resend deduplicated the adapter's tries"
    );
    let (status, _, _) = order(&s, "order-3", "pm_card_visa").await;
    assert_eq!(status, 503, "the receipt's outcome is still unknown");

    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let sweeper =
        checkout_service::sweeper(&s.idem, s.shop.clone()).backoff(Duration::ZERO, Duration::ZERO);
    let id = idemflow::KeyId::new(
        idemflow::Scope::new("acct_1").unwrap(),
        idemflow::IdempotencyKey::new("order-3").unwrap(),
    );
    for _ in 0..5 {
        sweeper.run_once().await.unwrap();
        if s.idem.store().get(&id).await.unwrap().unwrap().state == KeyState::Done {
            break;
        }
    }
    assert_eq!(
        s.idem.store().get(&id).await.unwrap().unwrap().state,
        KeyState::Done
    );
    let (status, replayed, body) = order(&s, "order-3", "pm_card_visa").await;
    assert_eq!((status, replayed), (201, true), "{body}");
    assert_eq!(body["order"], "order-3");
    assert_eq!(
        (s.stripe.ledger().len(), s.resend.ledger().len()),
        (1, 1),
        "one charge, one receipt"
    );
}
