//! Crash points settled by the sweeper against the testkit's fake providers, through the real
//! HTTP adapters, and the `idemflow reconcile --once` CLI doing the same from a config file.
//! Every story ends with exactly one effect in the fake's ledger and the key `done` with it, or
//! no effect and the key retryable; the client's retry then gets the right final answer. Runs on
//! SQLite (a file database) and on PostgreSQL (a fresh schema) when `IDEMFLOW_TEST_POSTGRES_URL`
//! is set.

use std::sync::Arc;
use std::time::Duration;

use idemflow::conformance::sweeper::{cut_when, hang_after};
use idemflow::provider::http::HttpConfig;
use idemflow::provider::stripe::StripeOperation;
use idemflow::provider::{Postmark, Provider, Stripe};
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::{FakePostmark, FakeStripe};
use idemflow::{
    Error, Execution, Idempotency, IdempotentRequest, KeyState, Outcome, Providers, Store, Sweeper,
};
use serde_json::{Value, json};

fn once() -> HttpConfig {
    HttpConfig {
        request_timeout: Duration::from_secs(2),
        max_attempts: 1,
        ..HttpConfig::default()
    }
}

#[cfg(feature = "postgres")]
use crate::support;

type Backend = (Arc<dyn Store>, String);

async fn sqlite_store() -> Option<Backend> {
    let dir = tempfile::tempdir().unwrap().keep();
    let url = format!("sqlite://{}", dir.join("recovery.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    Some((Arc::new(store), url))
}

#[cfg(feature = "postgres")]
async fn postgres_store() -> Option<Backend> {
    let (url, schema) = support::postgres::fresh_schema().await?;
    let store = idemflow::store::postgres::PostgresStore::from_pool(
        support::postgres::pool_in(&url, &schema, 5).await,
    );
    store.migrate().await.unwrap();
    Some((Arc::new(store), support::postgres::url_in(&url, &schema)))
}

macro_rules! recovery_tests {
    ($factory:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some((store, url)) = $factory().await else { return };
                super::$name(store, url).await;
            }
        )*
    };
    ($factory:path) => {
        recovery_tests!($factory;
            crash_after_claim_before_the_call_is_redriven_to_one_charge,
            lost_response_is_settled_by_the_sweeper_with_one_charge,
            process_died_after_the_provider_answered_is_settled_with_one_charge,
            crash_before_the_call_to_a_keyless_provider_turns_retryable_and_sends_once,
            failed_completion_is_settled_with_one_charge,
            a_connected_accounts_lost_response_is_settled_on_that_account,
            lost_captures_and_refunds_are_settled_with_one_each,
            lost_captures_and_refunds_sent_without_their_request_need_an_operator,
        );
        #[cfg(feature = "cli")]
        recovery_tests!($factory;
            cli_reconcile_once_settles_lost_responses_from_a_config_file,
            cli_reconcile_once_settles_captures_and_refunds_by_their_kinds,
        );
    };
}

mod sqlite {
    recovery_tests!(super::sqlite_store);
}

#[cfg(feature = "postgres")]
mod postgres {
    recovery_tests!(super::postgres_store);
}

fn stripe(fake: &FakeStripe) -> Arc<Stripe> {
    Arc::new(
        Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
            .unwrap()
            .http_config(once())
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

fn sweeper(store: Arc<dyn Store>, provider: Arc<dyn Provider>) -> Sweeper {
    Sweeper::new(store, Providers::new().with(provider))
}

async fn crash_after_claim_before_the_call_is_redriven_to_one_charge(
    store: Arc<dyn Store>,
    _url: String,
) {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = stripe(&fake);
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(100));
    // Claimed with Stripe's derived key, then the worker dies before sending anything.
    let req = charge("before-1");
    let pk = stripe
        .key_spec()
        .derive(&req.id().scope, &req.id().key, req.operation());
    let (at, reached) = tokio::sync::oneshot::channel();
    cut_when(
        idem.execute(req.provider("stripe").provider_key(pk), hang_after(at)),
        reached,
    )
    .await;
    assert!(fake.ledger().is_empty());
    tokio::time::sleep(Duration::from_millis(150)).await;

    let report = sweeper(store.clone(), stripe.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!((report.done, report.redrives), (1, 1), "{report:?}");
    assert_eq!(
        fake.ledger().len(),
        1,
        "re-driven once, with the stored key"
    );
    let retry = idem
        .call(charge("before-1"), stripe.as_ref())
        .await
        .unwrap();
    assert!(retry.is_replay());
    assert_eq!(fake.ledger().len(), 1);
}

async fn failed_completion_is_settled_with_one_charge(store: Arc<dyn Store>, _url: String) {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = stripe(&fake);
    // The charge succeeds, then storing the answer fails (the database connection drops).
    let flaky: Arc<dyn Store> =
        Arc::new(idemflow::conformance::FaultyStore::new(store.clone()).fail_worker_finishes(1));
    // A lease a loaded database's claim cannot outlast: `call` sends only while it is surely held.
    let err = Idempotency::new(flaky)
        .lease(Duration::from_millis(400))
        .call(charge("complete-1"), stripe.as_ref())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert_eq!(fake.ledger().len(), 1);
    let row = store.get(charge("complete-1").id()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Processing, "nothing half-written");
    tokio::time::sleep(Duration::from_millis(450)).await;

    let report = sweeper(store.clone(), stripe.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.done, 1, "{report:?}");
    assert_eq!(
        fake.ledger().len(),
        1,
        "Stripe replayed the charge for the re-drive"
    );
    let retry = Idempotency::new(store.clone())
        .call(charge("complete-1"), stripe.as_ref())
        .await
        .unwrap();
    assert!(retry.is_replay());
    let pi: Value = retry.response().body_json().unwrap();
    assert_eq!(pi["id"], fake.ledger().entries()[0].id.as_str());
}

async fn lost_response_is_settled_by_the_sweeper_with_one_charge(
    store: Arc<dyn Store>,
    _url: String,
) {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = stripe(&fake);
    let idem = Idempotency::new(store.clone());

    fake.faults().lose_next_response();
    let err = idem
        .call(charge("lost-1"), stripe.as_ref())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    assert_eq!(
        fake.ledger().len(),
        1,
        "the charge happened, its answer was lost"
    );

    // The client's retry before the sweeper ran is told to come back, and charges nothing.
    let early = idem
        .call(charge("lost-1"), stripe.as_ref())
        .await
        .unwrap_err();
    assert!(matches!(early, Error::OutcomeUnknown { .. }), "{early}");

    let report = sweeper(store.clone(), stripe.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!(
        (report.taken, report.done, report.redrives),
        (1, 1, 1),
        "{report:?}"
    );
    assert!(report.is_clean());
    assert_eq!(
        fake.ledger().len(),
        1,
        "the re-drive was replayed by the provider"
    );

    let row = store.get(charge("lost-1").id()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Done);
    let stored: Value = row.response.as_ref().unwrap().body_json().unwrap();
    assert_eq!(stored["id"], fake.ledger().entries()[0].id.as_str());

    let retry = idem.call(charge("lost-1"), stripe.as_ref()).await.unwrap();
    assert!(retry.is_replay());
    assert_eq!(retry.response(), row.response.as_ref().unwrap());
    assert_eq!(fake.ledger().len(), 1);
    let history = store.history(charge("lost-1").id()).await.unwrap();
    assert_eq!(
        history.last().unwrap().actor,
        idemflow::record::Actor::Sweeper
    );
}

async fn process_died_after_the_provider_answered_is_settled_with_one_charge(
    store: Arc<dyn Store>,
    _url: String,
) {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = stripe(&fake);
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(200));

    // The worker sends the charge, gets the answer, and dies before storing it.
    let s = stripe.clone();
    let (at, reached) = tokio::sync::oneshot::channel();
    let died = idem.execute(charge("died-1").provider("stripe"), |ctx| async move {
        let body: Value = serde_json::from_str(ctx.request()).unwrap();
        let answer = s.send(ctx.provider_key(), &body).await;
        assert!(matches!(
            answer,
            idemflow::provider::CallReply::Succeeded { .. }
        ));
        let _ = at.send(());
        std::future::pending::<Outcome>().await
    });
    cut_when(died, reached).await;
    assert_eq!(fake.ledger().len(), 1);
    tokio::time::sleep(Duration::from_millis(250)).await; // the lease runs out

    let report = sweeper(store.clone(), stripe.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!((report.done, report.redrives), (1, 1), "{report:?}");
    assert_eq!(fake.ledger().len(), 1);
    let retry = idem.call(charge("died-1"), stripe.as_ref()).await.unwrap();
    assert!(matches!(retry, Execution::Replayed(_)));
    let pi: Value = retry.response().body_json().unwrap();
    assert_eq!(pi["status"], "succeeded");
    assert_eq!(fake.ledger().len(), 1);
}

async fn crash_before_the_call_to_a_keyless_provider_turns_retryable_and_sends_once(
    store: Arc<dyn Store>,
    _url: String,
) {
    let fake = FakePostmark::start().await.unwrap();
    let postmark = Arc::new(
        Postmark::with_base_url(fake.base_url(), FakePostmark::API_KEY)
            .unwrap()
            .http_config(once())
            .unwrap()
            .search_lag(Duration::ZERO),
    );
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(400));
    let email = json!({"From": "shop@x.test", "To": "ana@y.test", "Subject": "Receipt", "TextBody": "Thanks"});
    let req = || IdempotentRequest::new("shop-1", "mail-1", "email.send", &email).unwrap();

    // Claimed, then the worker dies before sending anything.
    let (at, reached) = tokio::sync::oneshot::channel();
    cut_when(
        idem.execute(req().provider(postmark.name()), hang_after(at)),
        reached,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(450)).await;

    let report = sweeper(store.clone(), postmark.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!(
        (report.retryable, report.redrives, report.lookups),
        (1, 0, 1),
        "{report:?}"
    );
    assert!(
        fake.ledger().is_empty(),
        "a keyless provider is never re-driven"
    );
    let row = store.get(req().id()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Failed { retryable: true });

    // The client's retry now sends it, once.
    let sent = idem.call(req(), postmark.as_ref()).await.unwrap();
    assert!(!sent.is_replay());
    assert_eq!(sent.response().status(), 200);
    let again = idem.call(req(), postmark.as_ref()).await.unwrap();
    assert!(again.is_replay());
    assert_eq!(fake.ledger().len(), 1);
}

#[cfg(feature = "cli")]
async fn cli_reconcile_once_settles_lost_responses_from_a_config_file(
    store: Arc<dyn Store>,
    url: String,
) {
    let fake = FakeStripe::start().await.unwrap();
    let stripe = stripe(&fake);
    let idem = Idempotency::new(store.clone());
    for i in 0..5 {
        fake.faults().lose_next_response();
        let key = format!("cli-{i}");
        assert!(idem.call(charge(&key), stripe.as_ref()).await.is_err());
    }
    assert_eq!(fake.ledger().len(), 5);
    let config = format!(
        "[[providers]]\nkind = \"stripe\"\nbase_url = \"{}\"\napi_key_env = \"FAKE_STRIPE_KEY\"\n",
        fake.base_url()
    );
    let report = crate::reconcile_cli::reconcile_once(
        &url,
        &config,
        &[("FAKE_STRIPE_KEY", FakeStripe::API_KEY)],
    )
    .await;
    assert_eq!(report["report"]["done"], 5, "{report}");
    assert_eq!(report["clean"], true);
    assert_eq!(fake.ledger().len(), 5, "no key charged twice");
    for i in 0..5 {
        let retry = idem
            .call(charge(&format!("cli-{i}")), stripe.as_ref())
            .await
            .unwrap();
        assert!(retry.is_replay());
    }
    assert_eq!(fake.ledger().len(), 5);
}

/// Connect (`stripe_account`, sent as `Stripe-Account`): a lost answer on a connected account is
/// settled on that account, by a re-drive inside Stripe's window (Stripe replays the account's
/// key: a re-send without the header would charge the platform a second time) and by a search
/// outside it (the platform's own search finds nothing).
async fn a_connected_accounts_lost_response_is_settled_on_that_account(
    store: Arc<dyn Store>,
    _url: String,
) {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().set_search_lag(Duration::ZERO);
    let stripe = stripe(&fake);
    let idem = Idempotency::new(store.clone());
    let connected = |key: &str| {
        IdempotentRequest::new(
            "shop-1",
            key,
            "payments.create",
            &json!({"amount": 1500, "currency": "usd", "payment_method": "pm_card_visa",
                    "stripe_account": "acct_1Connected"}),
        )
        .unwrap()
    };
    for (key, redrive) in [("connect-redrive", true), ("connect-lookup", false)] {
        fake.ledger().clear();
        fake.faults().lose_next_response();
        let err = idem
            .call(connected(key), stripe.as_ref())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::OutcomeUnknown { .. }), "{key}: {err}");
        assert_eq!(fake.ledger().len(), 1, "{key}: charged, the answer lost");
        // A margin past Stripe's 24 h window leaves only the search.
        let margin = if redrive {
            Duration::from_secs(3600)
        } else {
            Duration::from_secs(25 * 3600)
        };
        let report = sweeper(store.clone(), stripe.clone())
            .redrive_margin(margin)
            .run_once()
            .await
            .unwrap();
        assert_eq!(report.done, 1, "{key}: {report:?}");
        assert_eq!(report.redrives, u64::from(redrive), "{key}: {report:?}");
        assert_eq!(fake.ledger().len(), 1, "{key}: one charge");
        let effect = &fake.ledger().entries()[0];
        assert_eq!(effect.request["Stripe-Account"], "acct_1Connected", "{key}");
        let row = store.get(connected(key).id()).await.unwrap().unwrap();
        assert_eq!(row.state, KeyState::Done, "{key}");
        let stored: Value = row.response.as_ref().unwrap().body_json().unwrap();
        assert_eq!(stored["id"], effect.id.as_str(), "{key}");
        let retry = idem.call(connected(key), stripe.as_ref()).await.unwrap();
        assert!(retry.is_replay(), "{key}");
        assert_eq!(fake.ledger().len(), 1, "{key}");
    }
}

fn stripe_doing(fake: &FakeStripe, operation: StripeOperation) -> Arc<Stripe> {
    Arc::new(
        Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
            .unwrap()
            .http_config(once())
            .unwrap()
            .operation(operation),
    )
}

/// A payment authorised through idemflow (`capture_method: manual`) under client key `key`:
/// its PaymentIntent id.
async fn authorised(idem: &Idempotency, fake: &FakeStripe, key: &str) -> String {
    let create = stripe_doing(fake, StripeOperation::CreatePayment);
    let req = IdempotentRequest::new(
        "shop-1",
        key,
        "payments.create",
        &json!({"amount": 2000, "currency": "usd", "payment_method": "pm_card_visa",
                "capture_method": "manual"}),
    )
    .unwrap();
    let pi: Value = idem
        .call(req, create.as_ref())
        .await
        .unwrap()
        .response()
        .body_json()
        .unwrap();
    assert_eq!(pi["status"], "requires_capture");
    pi["id"].as_str().unwrap().to_owned()
}

fn effects(fake: &FakeStripe, kind: &str) -> usize {
    fake.ledger()
        .entries()
        .iter()
        .filter(|e| e.kind == kind)
        .count()
}

/// A capture and a refund whose answers were lost are each settled by the sweeper with one
/// effect: by a same-key re-drive inside Stripe's 24 h window (Stripe replays the key), and
/// outside it by the capture's PaymentIntent and the refund in the payment's refund list. The
/// client's retry then replays the settled answer.
async fn lost_captures_and_refunds_are_settled_with_one_each(store: Arc<dyn Store>, _url: String) {
    let fake = FakeStripe::start().await.unwrap();
    let (capture, refund) = (
        stripe_doing(&fake, StripeOperation::Capture),
        stripe_doing(&fake, StripeOperation::Refund),
    );
    let idem = Idempotency::new(store.clone());
    let sweeper = |margin| {
        Sweeper::new(
            store.clone(),
            Providers::new().with(capture.clone()).with(refund.clone()),
        )
        .redrive_margin(margin)
    };
    for (name, redrive) in [("in-window", true), ("past-window", false)] {
        let pi = authorised(&idem, &fake, &format!("order-{name}")).await;
        let steps = [
            (
                capture.clone(),
                "capture",
                IdempotentRequest::new(
                    "shop-1",
                    &format!("capture-{name}"),
                    "payments.capture",
                    &json!({"payment_intent": pi}),
                ),
            ),
            (
                refund.clone(),
                "refund",
                IdempotentRequest::new(
                    "shop-1",
                    &format!("refund-{name}"),
                    "payments.refund",
                    &json!({"payment_intent": pi, "amount": 500}),
                ),
            ),
        ];
        for (adapter, kind, req) in steps {
            let req = req.unwrap();
            let before = effects(&fake, kind);
            fake.faults().lose_next_response();
            let err = idem.call(req.clone(), adapter.as_ref()).await.unwrap_err();
            assert!(
                matches!(err, Error::OutcomeUnknown { .. }),
                "{name} {kind}: {err}"
            );
            assert_eq!(
                effects(&fake, kind),
                before + 1,
                "{name} {kind}: done, the answer lost"
            );
            let margin = if redrive {
                Duration::from_secs(3600)
            } else {
                Duration::from_secs(25 * 3600)
            };
            let report = sweeper(margin).run_once().await.unwrap();
            assert_eq!(report.done, 1, "{name} {kind}: {report:?}");
            assert_eq!(
                report.redrives,
                u64::from(redrive),
                "{name} {kind}: {report:?}"
            );
            assert_eq!(effects(&fake, kind), before + 1, "{name} {kind}: once");
            let row = store.get(req.id()).await.unwrap().unwrap();
            assert_eq!(row.state, KeyState::Done, "{name} {kind}");
            let stored: Value = row.response.as_ref().unwrap().body_json().unwrap();
            assert_eq!(
                stored["object"],
                if kind == "capture" {
                    "payment_intent"
                } else {
                    "refund"
                }
            );
            if kind == "capture" {
                // The PaymentIntent's client_secret is never stored, found by lookup or not.
                assert_eq!(
                    stored["client_secret"],
                    idemflow::provider::secrets::REDACTED,
                    "{name}: {stored}"
                );
            }
            let retry = idem.call(req.clone(), adapter.as_ref()).await.unwrap();
            assert!(retry.is_replay(), "{name} {kind}");
            assert_eq!(effects(&fake, kind), before + 1, "{name} {kind}");
        }
    }
}

/// `idemflow reconcile --once` settles a lost capture and a lost refund from a configuration
/// naming the kinds `stripe_capture` and `stripe_refund`, past Stripe's window (by lookup).
#[cfg(feature = "cli")]
async fn cli_reconcile_once_settles_captures_and_refunds_by_their_kinds(
    store: Arc<dyn Store>,
    url: String,
) {
    let fake = FakeStripe::start().await.unwrap();
    let (capture, refund) = (
        stripe_doing(&fake, StripeOperation::Capture),
        stripe_doing(&fake, StripeOperation::Refund),
    );
    let idem = Idempotency::new(store.clone());
    let pi = authorised(&idem, &fake, "order-cli").await;
    let cap = IdempotentRequest::new(
        "shop-1",
        "capture-cli",
        "payments.capture",
        &json!({"payment_intent": pi}),
    )
    .unwrap();
    let re = IdempotentRequest::new(
        "shop-1",
        "refund-cli",
        "payments.refund",
        &json!({"payment_intent": pi, "amount": 700}),
    )
    .unwrap();
    fake.faults().lose_next_response();
    assert!(idem.call(cap.clone(), capture.as_ref()).await.is_err());
    // The capture's answer is lost but the capture stands: the refund runs.
    fake.faults().lose_next_response();
    assert!(idem.call(re.clone(), refund.as_ref()).await.is_err());
    assert_eq!(
        (effects(&fake, "capture"), effects(&fake, "refund")),
        (1, 1)
    );

    let base = fake.base_url();
    let config = format!(
        "[sweeper]\nredrive_margin = \"{}s\"\n\n[[providers]]\nkind = \"stripe_capture\"\nbase_url = \"{base}\"\napi_key_env = \"FAKE_STRIPE_KEY\"\nsearch_lag = 0\n\n[[providers]]\nkind = \"stripe_refund\"\nbase_url = \"{base}\"\napi_key_env = \"FAKE_STRIPE_KEY\"\nsearch_lag = 0\n",
        25 * 3600
    );
    let report = crate::reconcile_cli::reconcile_once(
        &url,
        &config,
        &[("FAKE_STRIPE_KEY", FakeStripe::API_KEY)],
    )
    .await;
    assert_eq!(report["report"]["done"], 2, "{report}");
    assert_eq!(
        report["report"]["redrives"], 0,
        "past the window: looked up, {report}"
    );
    assert_eq!(
        (effects(&fake, "capture"), effects(&fake, "refund")),
        (1, 1)
    );
    for (req, adapter) in [(cap, capture), (re, refund)] {
        let retry = idem.call(req, adapter.as_ref()).await.unwrap();
        assert!(retry.is_replay());
    }
    assert_eq!(
        (effects(&fake, "capture"), effects(&fake, "refund")),
        (1, 1)
    );
}

/// A capture and a refund sent with `Context::send` by an executor that stores no request (as
/// a queue consumer's does), their answers lost after Stripe acted: without the request the
/// lookup cannot tell which payment to read, so the sweeper hands each key to an operator. It
/// never calls the effect "never ran" (`failed{retryable}`), which would let a retry refund or
/// capture again once Stripe's key window has closed.
async fn lost_captures_and_refunds_sent_without_their_request_need_an_operator(
    store: Arc<dyn Store>,
    _url: String,
) {
    let fake = FakeStripe::start().await.unwrap();
    let (capture, refund) = (
        stripe_doing(&fake, StripeOperation::Capture),
        stripe_doing(&fake, StripeOperation::Refund),
    );
    let idem = Idempotency::new(store.clone());
    let pi = authorised(&idem, &fake, "order-unstored").await;
    let unstored = Idempotency::new(store.clone()).store_request(false);
    let steps = [
        (capture.clone(), "capture", json!({"payment_intent": pi})),
        (
            refund.clone(),
            "refund",
            json!({"payment_intent": pi, "amount": 500}),
        ),
    ];
    for (adapter, kind, body) in steps {
        let req = IdempotentRequest::new("shop-1", &format!("{kind}-unstored"), kind, &body)
            .unwrap()
            .provider(adapter.name());
        let before = effects(&fake, kind);
        fake.faults().lose_next_response();
        let sent = adapter.clone();
        let err = unstored
            .execute(req.clone(), move |ctx| async move {
                ctx.send(sent.as_ref(), &body).await
            })
            .await
            .unwrap_err();
        assert!(matches!(err, Error::OutcomeUnknown { .. }), "{kind}: {err}");
        assert_eq!(
            effects(&fake, kind),
            before + 1,
            "{kind}: done, the answer lost"
        );
        let row = store.get(req.id()).await.unwrap().unwrap();
        assert!(row.request.is_none(), "{kind}: the request was not stored");
        // Inside and past Stripe's key window: with no request a lookup is all the sweeper can
        // do, and the lookup cannot prove the effect absent.
        for margin in [Duration::from_secs(3600), Duration::from_secs(25 * 3600)] {
            let report = Sweeper::new(
                store.clone(),
                Providers::new().with(capture.clone()).with(refund.clone()),
            )
            .redrive_margin(margin)
            // Take the key again at once (no recheck delay) for the second sweep.
            .backoff(Duration::ZERO, Duration::ZERO)
            .operator_recheck(Duration::ZERO)
            .run_once()
            .await
            .unwrap();
            assert_eq!(report.retryable, 0, "{kind}: {report:?}");
            assert!(
                report
                    .unresolved
                    .iter()
                    .any(|u| u.key == req.id().key.as_str()
                        && u.kind == idemflow::sweeper::Unresolved::NeedsOperator),
                "{kind}: {report:?}"
            );
            let row = store.get(req.id()).await.unwrap().unwrap();
            assert_eq!(row.state, KeyState::Processing, "{kind}: {row:?}");
        }
        assert_eq!(effects(&fake, kind), before + 1, "{kind}: once");
    }
}
