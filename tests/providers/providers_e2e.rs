//! `Idempotency::call` end to end: SQLite in memory, the real adapters, the fake providers.

use std::sync::Arc;
use std::time::Duration;

use idemflow::provider::http::HttpConfig;
use idemflow::provider::{Postmark, Provider, Providers, Resend, Stripe};
use idemflow::store::sqlite::SqliteStore;
use idemflow::sweeper::{Sweeper, Unresolved};
use idemflow::testkit::{FakePostmark, FakeResend, FakeStripe};
use idemflow::{
    Error, Execution, Idempotency, IdempotentRequest, KeyState, Outcome, Store, provider::Lookup,
};
use serde_json::{Value, json};

fn once() -> HttpConfig {
    HttpConfig {
        request_timeout: Duration::from_secs(2),
        max_attempts: 1,
        ..HttpConfig::default()
    }
}

async fn idem() -> Idempotency {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    Idempotency::new(Arc::new(store)).retry_takeover_window(Some(Duration::from_secs(3600)))
}

#[tokio::test]
async fn stripe_lost_response_client_retry_charges_once() {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
        .unwrap()
        .http_config(once())
        .unwrap();
    let idem = idem().await;
    let body = json!({"amount": 1200, "currency": "eur", "payment_method": "pm_card_visa"});
    let req = || IdempotentRequest::new("shop-1", "order-77", "payments.create", &body).unwrap();

    fake.faults().lose_next_response();
    let first = idem.call(req(), &stripe).await;
    assert!(
        matches!(first, Err(Error::OutcomeUnknown { .. })),
        "{first:?}"
    );

    // The client retries: the key is taken over and re-sent with the same provider key; Stripe
    // replays the first charge.
    let second = idem.call(req(), &stripe).await.unwrap();
    assert!(matches!(second, Execution::Executed(_)));
    let pi: Value = second.response().body_json().unwrap();
    assert_eq!(pi["status"], "succeeded");

    let third = idem.call(req(), &stripe).await.unwrap();
    assert!(third.is_replay());
    assert_eq!(third.response(), second.response());

    assert_eq!(fake.ledger().len(), 1, "exactly one charge");
    let keys: Vec<_> = fake
        .requests()
        .iter()
        .map(|r| r.header("idempotency-key").unwrap().to_owned())
        .collect();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1]);
    let row = idem.store().get(req().id()).await.unwrap().expect("row");
    assert_eq!(row.provider_key, keys[0]);
    assert_eq!(row.provider.as_deref(), Some("stripe"));
    assert_eq!(row.state, KeyState::Done);
}

#[tokio::test]
async fn stripe_decline_is_stored_and_replayed() {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY).unwrap();
    let idem = idem().await;
    let body =
        json!({"amount": 1200, "currency": "eur", "payment_method": FakeStripe::DECLINED_CARD});
    let req = || IdempotentRequest::new("shop-1", "order-78", "payments.create", &body).unwrap();
    let first = idem.call(req(), &stripe).await.unwrap();
    assert_eq!(first.response().status(), 402);
    let again = idem.call(req(), &stripe).await.unwrap();
    assert!(again.is_replay());
    assert_eq!(again.response(), first.response());
    assert_eq!(
        fake.requests().len(),
        1,
        "the decline is replayed by idemflow, not re-sent"
    );
}

#[tokio::test]
async fn resend_email_once_despite_lost_response() {
    let fake = FakeResend::start().await.unwrap();
    let resend = Resend::with_base_url(fake.base_url(), FakeResend::API_KEY).unwrap();
    let idem = idem().await;
    let body = json!({"from": "a@x.test", "to": ["b@y.test"], "subject": "Welcome", "text": "Hi"});
    let req = || IdempotentRequest::new("app", "welcome-b@y.test", "email.welcome", &body).unwrap();
    fake.faults().lose_next_response();
    // The adapter's own retry (same key) recovers the lost answer inside one call.
    let first = idem.call(req(), &resend).await.unwrap();
    let again = idem.call(req(), &resend).await.unwrap();
    assert!(again.is_replay());
    assert_eq!(first.response(), again.response());
    assert_eq!(fake.ledger().len(), 1);
}

#[tokio::test]
async fn resend_key_without_stored_request_is_left_for_an_operator() {
    // The request is not stored; the send's answer is lost. The sweeper cannot re-send what it
    // does not have: the key must stay processing for an operator, never end failed{permanent}
    // (it did: Resend's lookup re-sent `null` and read the 400 as a refusal of the email).
    let fake = FakeResend::start().await.unwrap();
    let resend = Resend::with_base_url(fake.base_url(), FakeResend::API_KEY)
        .unwrap()
        .http_config(once())
        .unwrap();
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    let idem = Idempotency::new(store.clone())
        .store_request(false)
        .lease(Duration::from_millis(400));
    let body = json!({"from": "a@x.test", "to": ["b@y.test"], "subject": "Welcome", "text": "Hi"});
    let req = IdempotentRequest::new("app", "welcome-2", "email.welcome", &body).unwrap();
    let id = req.id().clone();
    fake.faults().lose_next_response();
    assert!(matches!(
        idem.call(req, &resend).await,
        Err(Error::OutcomeUnknown { .. })
    ));
    assert_eq!(fake.ledger().len(), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let sweeper = Sweeper::new(
        store.clone(),
        Providers::new().with(Arc::new(resend) as Arc<dyn Provider>),
    );
    let report = sweeper.run_once().await.unwrap();
    assert_eq!(report.taken, 1, "{report:?}");
    let row = store.get(&id).await.unwrap().expect("row");
    assert_eq!(row.state, KeyState::Processing, "{report:?}");
    assert_eq!(fake.requests().len(), 1, "nothing re-sent: {report:?}");
    assert_eq!(report.unresolved.len(), 1, "{report:?}");
    assert_eq!(
        report.unresolved[0].kind,
        Unresolved::NeedsOperator,
        "{report:?}"
    );
}

#[tokio::test]
async fn postmark_unknown_is_left_for_the_sweeper_and_lookup_settles_it() {
    let fake = FakePostmark::start().await.unwrap();
    let postmark = Postmark::with_base_url(fake.base_url(), FakePostmark::API_KEY).unwrap();
    // No takeover by retries: Postmark has no keys, a re-send would be a second email.
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let idem = Idempotency::new(Arc::new(store));
    let body = json!({"From": "a@x.test", "To": "b@y.test", "Subject": "Receipt", "TextBody": "x"});
    let req = || IdempotentRequest::new("app", "receipt-9", "email.receipt", &body).unwrap();
    fake.faults().lose_next_response();
    assert!(matches!(
        idem.call(req(), &postmark).await,
        Err(Error::OutcomeUnknown { .. })
    ));
    assert!(matches!(
        idem.call(req(), &postmark).await,
        Err(Error::OutcomeUnknown { .. })
    ));
    assert_eq!(fake.ledger().len(), 1);

    // What the sweeper will do: look the key up with the stored provider key and request.
    let row = idem.store().get(req().id()).await.unwrap().expect("row");
    assert_eq!(row.state, KeyState::Processing);
    let stored: Value = serde_json::from_str(row.request.as_deref().unwrap()).unwrap();
    let found = postmark
        .lookup(
            &row.provider_key,
            &stored,
            idemflow::provider::Attempts::new(row.created_at, row.last_attempt_at),
            chrono::Utc::now(),
        )
        .await;
    assert!(
        matches!(found, Lookup::Found(Outcome::Succeeded(_))),
        "{found:?}"
    );
}
