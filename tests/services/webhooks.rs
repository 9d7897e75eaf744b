//! The Stripe webhook receiver over real sockets on 127.0.0.1, fed by the testkit's
//! `WebhookSender`: signatures (good, bad, missing, stale, from the future, rotated secrets,
//! several `v1`), duplicates, concurrent duplicates, a handler that fails, panics or whose run
//! crashed, a lost Stripe response settled by the `payment_intent.*` event before any sweep, and
//! `examples/webhook_service.rs` counting one effect per event. The duplicate and crash tests run
//! on SQLite, and on PostgreSQL when `IDEMFLOW_TEST_POSTGRES_URL` is set (feature `postgres`).

#[path = "../../examples/webhook_service.rs"]
mod example;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use idemflow::axum::webhook::{OPERATION, STRIPE_SCOPE, SettleKeys, WebhookEvent, WebhookReceiver};
use idemflow::provider::Stripe;
use idemflow::provider::http::HttpConfig;
use idemflow::provider::stripe_signature::StripeSignature;
use idemflow::testkit::{Delivered, FakeStripe, WebhookSender, stripe_event};
use idemflow::{
    Error, Idempotency, IdempotentRequest, KeyId, KeyState, Providers, Store, Sweeper,
    record::Actor,
};
use serde_json::{Value, json};

const OLD: &str = "whsec_old_secret";
const NEW: &str = "whsec_new_secret";

/// Serves `router` on 127.0.0.1 (port 0); returns its base URL.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    base
}

/// A Stripe receiver accepting `OLD` and `NEW`, whose handler counts its runs (after `delay`).
async fn counting(store: Arc<dyn Store>, delay: Duration) -> (String, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let receiver = WebhookReceiver::stripe(
        Idempotency::new(store),
        StripeSignature::new(OLD).with_secret(NEW),
        move |_event: WebhookEvent| {
            let runs = counted.clone();
            async move {
                tokio::time::sleep(delay).await;
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<(), String>(())
            }
        },
    );
    let base = serve(Router::new().route_service("/webhooks/stripe", receiver)).await;
    (format!("{base}/webhooks/stripe"), runs)
}

fn event_key(event: &Value) -> KeyId {
    let id = event["id"].as_str().unwrap();
    IdempotentRequest::new(STRIPE_SCOPE, id, OPERATION, &json!({}))
        .unwrap()
        .id()
        .clone()
}

fn statuses(answers: &[Delivered]) -> Vec<u16> {
    answers.iter().map(|a| a.status).collect()
}

/// The stores the backend-generic tests run on: a SQLite file, and PostgreSQL when set.
async fn stores() -> Vec<(&'static str, Arc<dyn Store>)> {
    let mut out: Vec<(&'static str, Arc<dyn Store>)> =
        vec![("sqlite", super::support::sqlite::file().await)];
    #[cfg(feature = "postgres")]
    if let Some(pg) = super::support::postgres::store().await {
        out.push(("postgres", pg));
    }
    out
}

#[tokio::test]
async fn signatures_good_bad_stale_and_rotated() {
    let store: Arc<dyn Store> = super::support::sqlite::memory().await;
    let (url, runs) = counting(store.clone(), Duration::ZERO).await;
    let nothing_recorded = |event: Value| {
        let store = store.clone();
        async move { store.get(&event_key(&event)).await.unwrap().is_none() }
    };
    let event = || stripe_event("payment_intent.succeeded", json!({"id": "pi_1"}));

    // Bad: a secret the endpoint does not know; missing; stale; from the future; a body
    // other than the one signed; a malformed header.
    let e = event();
    let wrong = WebhookSender::new(&url, "whsec_wrong").send(&e).await;
    assert_eq!(wrong.status, 400, "{wrong:?}");
    assert!(wrong.body.contains("signature-invalid"), "{wrong:?}");
    let sender = WebhookSender::new(&url, NEW);
    let body = serde_json::to_vec(&e).unwrap();
    assert_eq!(sender.send_raw(body.clone(), None).await.status, 400);
    assert_eq!(
        WebhookSender::new(&url, NEW)
            .clock_offset(-301)
            .send(&e)
            .await
            .status,
        400
    );
    assert_eq!(
        WebhookSender::new(&url, NEW)
            .clock_offset(301)
            .send(&e)
            .await
            .status,
        400
    );
    let signed_other = sender.signature(b"{}");
    assert_eq!(
        sender
            .send_raw(body.clone(), Some(signed_other))
            .await
            .status,
        400
    );
    let garbage = sender
        .send_raw(body.clone(), Some("t=x,v1=zz".into()))
        .await;
    assert_eq!(garbage.status, 400, "{garbage:?}");
    assert!(nothing_recorded(e.clone()).await);
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // Signed right but not an event: 400, nothing recorded, no panic.
    for bad in [
        b"not json".to_vec(),
        b"{\"type\":\"x\"}".to_vec(),
        b"[]".to_vec(),
    ] {
        let sig = sender.signature(&bad);
        let answer = sender.send_raw(bad, Some(sig)).await;
        assert_eq!(answer.status, 400, "{answer:?}");
        assert!(answer.body.contains("event-invalid"), "{answer:?}");
    }
    let mut unusable_id = stripe_event("x", json!({}));
    unusable_id["id"] = json!("evt with spaces\u{1}");
    assert_eq!(sender.send(&unusable_id).await.status, 400);

    // Good, within the tolerance (a few seconds off either way).
    let good = WebhookSender::new(&url, NEW)
        .clock_offset(-200)
        .send(&e)
        .await;
    assert_eq!(good.status, 200, "{good:?}");
    assert!(!good.replayed);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Rotated: the old secret is still accepted while configured...
    let old = WebhookSender::new(&url, OLD).send(&event()).await;
    assert_eq!(old.status, 200, "{old:?}");
    // ... and Stripe's several v1 (one per secret) match when any one does.
    let several = WebhookSender::new(&url, "whsec_unknown")
        .with_secret(NEW)
        .send(&event())
        .await;
    assert_eq!(several.status, 200, "{several:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // Only POST.
    let get = reqwest::get(&url).await.unwrap();
    assert_eq!(get.status(), 405);
    assert_eq!(get.headers()["allow"], "POST");
}

#[tokio::test]
async fn duplicates_run_the_handler_once() {
    for (backend, store) in stores().await {
        let (url, runs) = counting(store.clone(), Duration::ZERO).await;
        let sender = WebhookSender::new(&url, NEW);
        let event = stripe_event("invoice.paid", json!({"id": "in_1"}));
        let answers: Vec<Delivered> = vec![
            sender.send(&event).await,
            sender.send(&event).await,
            sender.send(&event).await,
        ];
        assert_eq!(
            statuses(&answers),
            [200, 200, 200],
            "{backend}: {answers:?}"
        );
        assert_eq!(
            answers.iter().map(|a| a.replayed).collect::<Vec<_>>(),
            [false, true, true],
            "{backend}"
        );
        assert_eq!(answers[0].body, answers[2].body, "{backend}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{backend}");
        let row = store.get(&event_key(&event)).await.unwrap().unwrap();
        assert_eq!(row.state, KeyState::Done, "{backend}");
        // The body may differ between deliveries (re-rendered): the same id and type is the
        // same event.
        let mut rerendered = event.clone();
        rerendered["pending_webhooks"] = json!(7);
        let again = sender.send(&rerendered).await;
        assert!(again.is_success() && again.replayed, "{backend}: {again:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{backend}");
    }
}

#[tokio::test]
async fn concurrent_duplicates_run_the_handler_once() {
    for (backend, store) in stores().await {
        let (url, runs) = counting(store.clone(), Duration::from_millis(300)).await;
        let sender = WebhookSender::new(&url, NEW);
        let event = stripe_event("payment_intent.succeeded", json!({"id": "pi_c"}));
        let answers = sender.send_concurrently(&event, 50).await;
        let codes = statuses(&answers);
        assert!(
            codes.iter().all(|c| *c == 200 || *c == 409),
            "{backend}: {codes:?}"
        );
        assert!(codes.contains(&200), "{backend}: {codes:?}");
        assert!(
            codes.contains(&409),
            "{backend}: the first still ran: {codes:?}"
        );
        // A 409 carries Retry-After semantics in its problem; Stripe delivers again later.
        let retried = sender.deliver(&event, 10, Duration::from_millis(100)).await;
        assert!(
            retried.last().unwrap().is_success(),
            "{backend}: {retried:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{backend}");
    }
}

#[tokio::test]
async fn a_failing_or_panicking_handler_is_retried_and_takes_effect_once() {
    for (backend, store) in stores().await {
        let runs = Arc::new(AtomicUsize::new(0));
        let effects = Arc::new(AtomicUsize::new(0));
        let (r, e) = (runs.clone(), effects.clone());
        let receiver = WebhookReceiver::stripe(
            Idempotency::new(store.clone()),
            StripeSignature::new(NEW),
            move |_event: WebhookEvent| {
                let (runs, effects) = (r.clone(), e.clone());
                async move {
                    match runs.fetch_add(1, Ordering::SeqCst) {
                        0 => Err("the database was down".to_owned()),
                        1 => panic!("the handler crashed"),
                        _ => {
                            effects.fetch_add(1, Ordering::SeqCst);
                            Ok(())
                        }
                    }
                }
            },
        );
        let base = serve(Router::new().route_service("/hook", receiver)).await;
        let sender = WebhookSender::new(format!("{base}/hook"), NEW);
        let event = stripe_event("charge.refunded", json!({"id": "ch_1"}));
        let answers = sender.deliver(&event, 5, Duration::from_millis(20)).await;
        assert_eq!(
            statuses(&answers),
            [503, 503, 200],
            "{backend}: {answers:?}"
        );
        assert!(
            answers[1].body.contains("panicked"),
            "{backend}: {answers:?}"
        );
        let again = sender.deliver(&event, 5, Duration::from_millis(20)).await;
        assert_eq!(statuses(&again), [200], "{backend}");
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{backend}");
        assert_eq!(effects.load(Ordering::SeqCst), 1, "{backend}");
    }
}

/// A run whose process died (here: its future dropped mid-handler, which leaves the key as a
/// killed process does) holds the event until its lease runs out (409 meanwhile); the next
/// delivery then takes the key over and runs the handler, also when it comes after the
/// retention (a takeover was once allowed only within it: the event then stayed unprocessed at
/// every delivery).
#[tokio::test]
async fn a_crashed_run_is_taken_over_by_a_later_delivery() {
    let lease = Duration::from_millis(400);
    // The default retention, and one that has passed when the next delivery comes.
    for retention in [None, Some(Duration::from_millis(300))] {
        crashed_run_taken_over(lease, retention).await;
    }
}

async fn crashed_run_taken_over(lease: Duration, retention: Option<Duration>) {
    for (backend, store) in stores().await {
        let backend = format!("{backend}, retention {retention:?}");
        let mut idem = Idempotency::new(store.clone()).lease(lease);
        if let Some(retention) = retention {
            idem = idem.retention(retention);
        }
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let receiver =
            WebhookReceiver::stripe(idem.clone(), StripeSignature::new(NEW), move |_| {
                let runs = counted.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<(), String>(())
                }
            });
        let base = serve(Router::new().route_service("/hook", receiver)).await;
        let sender = WebhookSender::new(format!("{base}/hook"), NEW);
        let event = stripe_event("customer.created", json!({"id": "cus_1"}));
        // The crashed process: claimed the event's key, then vanished mid-handler.
        let id = event["id"].as_str().unwrap();
        let fingerprinted = json!({"id": id, "type": "customer.created"});
        let request = IdempotentRequest::new(STRIPE_SCOPE, id, OPERATION, &fingerprinted).unwrap();
        let crashed = tokio::time::timeout(
            Duration::from_millis(50),
            idem.execute(request, |_| std::future::pending::<idemflow::Outcome>()),
        )
        .await;
        assert!(crashed.is_err(), "{backend}");
        let during = sender.send(&event).await;
        assert_eq!(during.status, 409, "{backend}: {during:?}");
        tokio::time::sleep(lease + Duration::from_millis(100)).await;
        let after = sender.send(&event).await;
        assert_eq!(after.status, 200, "{backend}: {after:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{backend}");
    }
}

fn fast_stripe(fake: &FakeStripe) -> Arc<Stripe> {
    let config = HttpConfig {
        request_timeout: Duration::from_secs(2),
        max_attempts: 1,
        ..HttpConfig::default()
    };
    Arc::new(
        Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
            .unwrap()
            .http_config(config)
            .unwrap(),
    )
}

/// A lost Stripe response leaves the key `processing` (the client's retry is told 503, outcome
/// unknown); Stripe's `payment_intent.*` event then settles it through the receiver, and the
/// client's next retry gets the final answer, before any sweeper has run.
#[tokio::test]
async fn a_lost_response_is_settled_by_the_event_before_any_sweep() {
    for (card, kind, state, status) in [
        (
            "pm_card_visa",
            "payment_intent.succeeded",
            KeyState::Done,
            200,
        ),
        (
            FakeStripe::DECLINED_CARD,
            "payment_intent.payment_failed",
            KeyState::Failed { retryable: false },
            402,
        ),
    ] {
        let fake = FakeStripe::start().await.unwrap();
        let stripe = fast_stripe(&fake);
        let store: Arc<dyn Store> = super::support::sqlite::memory().await;
        let idem = Idempotency::new(store.clone());
        let body = json!({"amount": 500, "currency": "usd", "payment_method": card});
        let pay = || IdempotentRequest::new("shop", "order-1", "payments.create", &body).unwrap();

        fake.faults().lose_next_response();
        let lost = idem.call(pay(), stripe.as_ref()).await;
        assert!(
            matches!(lost, Err(Error::OutcomeUnknown { .. })),
            "{lost:?}"
        );
        let retry = idem.call(pay(), stripe.as_ref()).await;
        assert!(
            matches!(retry, Err(Error::OutcomeUnknown { .. })),
            "{retry:?}"
        );

        let sweeper = Sweeper::new(store.clone(), Providers::new().with(stripe.clone()));
        let receiver =
            WebhookReceiver::stripe(idem.clone(), StripeSignature::new(NEW), |_| async {
                Ok::<(), String>(())
            })
            .settle_keys(SettleKeys::new(sweeper));
        let base = serve(Router::new().route_service("/hook", receiver)).await;
        let pi = fake.ledger().entries()[0].id.clone();
        let event = fake.payment_intent_event(&pi).unwrap();
        assert_eq!(event["type"], kind);
        let answer = WebhookSender::new(format!("{base}/hook"), NEW)
            .send(&event)
            .await;
        assert_eq!(answer.status, 200, "{answer:?}");

        let row = store.get(pay().id()).await.unwrap().unwrap();
        assert_eq!(row.state, state);
        let last = store.history(pay().id()).await.unwrap().pop().unwrap();
        assert_eq!(last.actor, Actor::Sweeper);
        assert!(
            last.reason
                .as_deref()
                .unwrap_or("")
                .contains(event["id"].as_str().unwrap()),
            "{last:?}"
        );
        let settled = idem.call(pay(), stripe.as_ref()).await.unwrap();
        assert!(settled.is_replay());
        assert_eq!(settled.response().status(), status);
        let pi_json: Value = serde_json::from_slice(settled.response().body()).unwrap();
        let client_secret = if status == 200 {
            &pi_json["client_secret"]
        } else {
            &pi_json["error"]["payment_intent"]["client_secret"]
        };
        assert_ne!(
            client_secret,
            &fake.payment_intent_event(&pi).unwrap()["data"]["object"]["client_secret"]
        );
        assert_eq!(fake.ledger().len(), 1, "charged once");
    }
}

/// An event for a key whose attempt still holds its lease leaves it to that attempt, and an
/// event for a key idemflow does not know changes nothing; both are acknowledged.
#[tokio::test]
async fn events_for_running_or_unknown_keys_change_nothing() {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = fast_stripe(&fake);
    let store: Arc<dyn Store> = super::support::sqlite::memory().await;
    let sweeper = Sweeper::new(store.clone(), Providers::new().with(stripe.clone()));
    let settle = SettleKeys::new(sweeper.clone());
    let receiver = WebhookReceiver::stripe(
        Idempotency::new(store.clone()),
        StripeSignature::new(NEW),
        |_| async { Ok::<(), String>(()) },
    )
    .settle_keys(settle);
    let base = serve(Router::new().route_service("/hook", receiver)).await;
    let sender = WebhookSender::new(format!("{base}/hook"), NEW);
    let stranger = stripe_event(
        "payment_intent.succeeded",
        json!({"id": "pi_x", "object": "payment_intent", "status": "succeeded",
               "metadata": {"idemflow_key": "idf_not_ours"}}),
    );
    assert_eq!(sender.send(&stranger).await.status, 200);
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.done, stats.processing),
        (1, 0),
        "only the event's own key"
    );

    // A key held by a live attempt: the event leaves it alone.
    let idem = Idempotency::new(store.clone()).lease(Duration::from_secs(30));
    let request = IdempotentRequest::new("shop", "k-live", "payments.create", &json!({}))
        .unwrap()
        .provider("stripe");
    let held = tokio::time::timeout(
        Duration::from_millis(50),
        idem.execute(request.clone(), |_| {
            std::future::pending::<idemflow::Outcome>()
        }),
    )
    .await;
    assert!(held.is_err());
    let row = store.get(request.id()).await.unwrap().unwrap();
    let live = stripe_event(
        "payment_intent.succeeded",
        json!({"id": "pi_l", "object": "payment_intent", "status": "succeeded",
               "metadata": {"idemflow_key": row.provider_key}}),
    );
    assert_eq!(sender.send(&live).await.status, 200);
    let row = store.get(request.id()).await.unwrap().unwrap();
    assert_eq!(
        row.state,
        KeyState::Processing,
        "left to the attempt holding it"
    );
}

#[tokio::test]
async fn the_example_counts_one_effect_per_event() {
    let dir = tempfile::tempdir().unwrap();
    let settings = example::Settings {
        secrets: vec![NEW.to_owned(), OLD.to_owned()],
        database_url: format!("sqlite://{}", dir.path().join("hooks.db").display()),
        listen_addr: "127.0.0.1:0".to_owned(),
    };
    let (idem, pool) = example::connect(&settings).await.unwrap();
    let base = serve(example::router(idem, pool, &settings.secrets)).await;
    let sender = WebhookSender::new(format!("{base}/webhooks/stripe"), OLD);
    let first = stripe_event("payment_intent.succeeded", json!({"id": "pi_1"}));
    let second = stripe_event("charge.refunded", json!({"id": "ch_1"}));
    for _ in 0..3 {
        assert!(sender.send(&first).await.is_success());
    }
    let burst = sender.send_concurrently(&second, 20).await;
    assert!(
        burst.iter().all(|a| a.status == 200 || a.status == 409),
        "{burst:?}"
    );
    let last = sender.deliver(&second, 10, Duration::from_millis(50)).await;
    assert!(last.last().unwrap().is_success(), "{last:?}");
    let effects: Value = reqwest::get(format!("{base}/effects"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut want = vec![
        json!({"event": first["id"], "count": 1}),
        json!({"event": second["id"], "count": 1}),
    ];
    want.sort_by_key(|v| v["event"].as_str().unwrap().to_owned());
    assert_eq!(effects, Value::Array(want));
}

/// A one-commit receiver (`WebhookReceiver::stripe_atomic`): the effect (a row) commits with the
/// event's key. A write failing after the effect's insert rolls both back (503, no key, no row),
/// the next delivery makes the effect once, and duplicates, concurrent ones included, make none
/// more.
#[tokio::test]
async fn a_one_commit_receiver_makes_each_effect_once() {
    use idemflow::axum::webhook::acknowledgement;
    use std::sync::atomic::AtomicBool;

    let store = super::support::sqlite::file().await;
    sqlx::query("CREATE TABLE effects (event TEXT NOT NULL)")
        .execute(store.writer_pool())
        .await
        .unwrap();
    let fail_next = Arc::new(AtomicBool::new(true));
    let (phases, fail) = (store.clone(), fail_next.clone());
    let receiver = WebhookReceiver::stripe_atomic(
        Idempotency::new(store.clone()),
        StripeSignature::new(NEW),
        move |event: WebhookEvent| {
            let fail = fail.swap(false, Ordering::SeqCst);
            let id = event.id().to_owned();
            phases.atomic_phase(move |conn| {
                let id = id.clone();
                Box::pin(async move {
                    sqlx::query("INSERT INTO effects (event) VALUES (?)")
                        .bind(&id)
                        .execute(&mut *conn)
                        .await?;
                    if fail {
                        return Err("the effect's second write failed".into());
                    }
                    Ok(acknowledgement(&id))
                })
            })
        },
    );
    let base = serve(Router::new().route_service("/webhooks/stripe", receiver)).await;
    let sender = WebhookSender::new(format!("{base}/webhooks/stripe"), NEW);
    let effects = |event: &'static str| {
        let store = store.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects WHERE event = ?")
                .bind(event)
                .fetch_one(store.writer_pool())
                .await
                .unwrap()
        }
    };

    let event = stripe_event("invoice.paid", json!({"id": "in_oc"}));
    let id: &'static str = event["id"].as_str().unwrap().to_owned().leak();
    let failed = sender.send(&event).await;
    assert_eq!(failed.status, 503, "{failed:?}");
    assert_eq!(
        effects(id).await,
        0,
        "the failed run's insert was rolled back"
    );
    assert!(store.get(&event_key(&event)).await.unwrap().is_none());
    let answers = vec![
        sender.send(&event).await,
        sender.send(&event).await,
        sender.send(&event).await,
    ];
    assert_eq!(statuses(&answers), [200, 200, 200], "{answers:?}");
    assert_eq!(
        answers.iter().map(|a| a.replayed).collect::<Vec<_>>(),
        [false, true, true]
    );
    assert_eq!(effects(id).await, 1);
    assert_eq!(
        store.get(&event_key(&event)).await.unwrap().unwrap().state,
        KeyState::Done
    );

    let other = stripe_event("invoice.paid", json!({"id": "in_oc2"}));
    let other_id: &'static str = other["id"].as_str().unwrap().to_owned().leak();
    let answers = sender.send_concurrently(&other, 20).await;
    assert!(
        answers.iter().all(|a| a.status == 200),
        "{:?}",
        statuses(&answers)
    );
    assert_eq!(answers.iter().filter(|a| !a.replayed).count(), 1);
    assert_eq!(effects(other_id).await, 1);
}
