//! Crash points settled by the sweeper for the card processors added with issue 14 (Adyen,
//! Square, PayPal), through the real HTTP adapters and the testkit's fakes, as
//! `recovery_testkit.rs` does for Stripe: a crash after the claim before the call, a lost
//! response, and a process that died after the provider answered. Every story ends with exactly
//! one payment in the fake's ledger and the key `done` with it, or no payment and the key
//! retryable (Square's void by key); the client's retry then gets the right final answer. Runs on
//! SQLite (a file database) and on PostgreSQL (a fresh schema) when `IDEMFLOW_TEST_POSTGRES_URL`
//! is set.

use std::sync::Arc;
use std::time::Duration;

use idemflow::conformance::sweeper::{cut_when, hang_after};
use idemflow::provider::http::HttpConfig;
use idemflow::provider::{Adyen, PayPal, Provider, Square};
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::{FakeAdyen, FakePayPal, FakeSquare, Faults, Ledger};
use idemflow::{
    Error, Execution, Idempotency, IdempotentRequest, KeyState, Outcome, Providers, Store, Sweeper,
};
use serde_json::{Value, json};

#[cfg(feature = "postgres")]
use crate::support;

type Backend = Arc<dyn Store>;

async fn sqlite_store() -> Option<(Backend, String)> {
    let dir = tempfile::tempdir().unwrap().keep();
    let url = format!("sqlite://{}", dir.join("recovery_cards.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    Some((Arc::new(store), url))
}

#[cfg(feature = "postgres")]
async fn postgres_store() -> Option<(Backend, String)> {
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
            adyen_crash_after_claim_before_the_call_is_redriven_to_one_payment,
            adyen_lost_response_is_replayed_by_the_sweeper,
            adyen_died_after_the_answer_is_settled_with_one_payment,
            square_crash_after_claim_before_the_call_is_voided_then_charged_once,
            square_lost_response_is_looked_up_after_the_void_is_refused,
            square_lost_delayed_capture_is_looked_up_not_voided,
            square_died_after_the_answer_is_settled_with_one_payment,
            square_void_racing_a_delayed_create_waits_out_the_processing_window,
            adyen_key_reused_after_our_retention_charges_anew,
            square_key_reused_after_our_retention_charges_anew,
            paypal_crash_after_claim_before_the_call_is_redriven_to_one_order,
            paypal_lost_response_is_settled_with_the_orders_current_state,
            paypal_died_after_the_answer_is_settled_with_one_order,
        );
        #[cfg(feature = "cli")]
        recovery_tests!($factory; cli_reconcile_once_settles_each_card_processor_from_a_config_file);
    };
}

mod sqlite {
    recovery_tests!(super::sqlite_store);
}

#[cfg(feature = "postgres")]
mod postgres {
    recovery_tests!(super::postgres_store);
}

fn once() -> HttpConfig {
    HttpConfig {
        request_timeout: Duration::from_secs(2),
        max_attempts: 1,
        ..HttpConfig::default()
    }
}

/// A card processor's fake, its adapter and a payment request for it.
struct Card {
    provider: Arc<dyn Provider>,
    ledger: Ledger,
    faults: Faults,
    body: Value,
    /// Read by the reconciler's config (feature `cli`).
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    base_url: String,
    _fake: Box<dyn std::any::Any + Send>,
}

impl Card {
    async fn adyen() -> Self {
        let fake = FakeAdyen::start().await.unwrap();
        let provider = Adyen::with_base_url(fake.base_url(), FakeAdyen::API_KEY)
            .unwrap()
            .http_config(once())
            .unwrap();
        Self {
            provider: Arc::new(provider),
            ledger: fake.ledger(),
            faults: fake.faults(),
            base_url: fake.base_url().to_owned(),
            body: json!({
                "amount": {"currency": "EUR", "value": 1500},
                "reference": "order-7",
                "merchantAccount": "ShopECOM",
                "paymentMethod": {"type": "scheme", "number": "4111111111111111"}
            }),
            _fake: Box::new(fake),
        }
    }

    async fn square(body: Value) -> Self {
        let fake = FakeSquare::start().await.unwrap();
        let provider = Square::with_base_url(fake.base_url(), FakeSquare::API_KEY)
            .unwrap()
            .http_config(once())
            .unwrap()
            // Each story's sweep runs at least a lease after the last attempt.
            .processing_window(Duration::from_millis(20));
        Self {
            provider: Arc::new(provider),
            ledger: fake.ledger(),
            faults: fake.faults(),
            base_url: fake.base_url().to_owned(),
            body,
            _fake: Box::new(fake),
        }
    }

    fn square_payment() -> Value {
        json!({"source_id": "cnon:card-nonce-ok", "amount_money": {"amount": 1500, "currency": "USD"}})
    }

    async fn paypal() -> (Self, Arc<FakePayPal>) {
        let fake = Arc::new(FakePayPal::start().await.unwrap());
        let provider = PayPal::with_base_url(fake.base_url(), FakePayPal::API_KEY)
            .unwrap()
            .http_config(once())
            .unwrap();
        let card = Self {
            provider: Arc::new(provider),
            ledger: fake.ledger(),
            faults: fake.faults(),
            base_url: fake.base_url().to_owned(),
            body: json!({
                "intent": "CAPTURE",
                "purchase_units": [{"reference_id": "order-7",
                                    "amount": {"currency_code": "USD", "value": "15.00"}}]
            }),
            _fake: Box::new(fake.clone()),
        };
        (card, fake)
    }

    fn request(&self, key: &str) -> IdempotentRequest {
        IdempotentRequest::new("shop-1", key, "payments.create", &self.body).unwrap()
    }

    fn sweeper(&self, store: &Backend) -> Sweeper {
        Sweeper::new(store.clone(), Providers::new().with(self.provider.clone()))
    }

    /// Claims `key` with the provider's derived key, then dies before sending anything.
    async fn crash_before_the_call(&self, idem: &Idempotency, key: &str) {
        let req = self.request(key);
        let pk = self
            .provider
            .key_spec()
            .derive(&req.id().scope, &req.id().key, req.operation());
        let (at, reached) = tokio::sync::oneshot::channel();
        cut_when(
            idem.execute(
                req.provider(self.provider.name()).provider_key(pk.clone()),
                hang_after(at),
            ),
            reached,
        )
        .await;
        assert_eq!(self.ledger.count_for_key(&pk), 0, "nothing was sent");
    }

    /// Sends `key`'s payment, gets the answer, and dies before storing it.
    async fn die_after_the_answer(&self, idem: &Idempotency, key: &str) {
        let p = self.provider.clone();
        let (at, reached) = tokio::sync::oneshot::channel();
        let died = idem.execute(
            self.request(key).provider(self.provider.name()),
            |ctx| async move {
                let body: Value = serde_json::from_str(ctx.request()).unwrap();
                let answer = p.send(ctx.provider_key(), &body).await;
                assert!(
                    matches!(answer, idemflow::provider::CallReply::Succeeded { .. }),
                    "{answer:?}"
                );
                let _ = at.send(());
                std::future::pending::<Outcome>().await
            },
        );
        cut_when(died, reached).await;
        assert_eq!(self.ledger.len(), 1);
    }

    /// The client's call whose answer is lost (the payment is made).
    async fn lose_the_answer(&self, idem: &Idempotency, key: &str) {
        self.faults.lose_next_response();
        let err = idem
            .call(self.request(key), self.provider.as_ref())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
        assert_eq!(
            self.ledger.len(),
            1,
            "the payment happened, its answer was lost"
        );
        // The client's retry before the sweeper ran is told to come back, and pays nothing.
        let early = idem
            .call(self.request(key), self.provider.as_ref())
            .await
            .unwrap_err();
        assert!(matches!(early, Error::OutcomeUnknown { .. }), "{early}");
    }

    /// The key is done with the one payment; the client's retry replays it.
    async fn assert_done_once(&self, store: &Backend, idem: &Idempotency, key: &str) -> Value {
        let row = store.get(self.request(key).id()).await.unwrap().unwrap();
        assert_eq!(row.state, KeyState::Done, "{row:?}");
        let retry = idem
            .call(self.request(key), self.provider.as_ref())
            .await
            .unwrap();
        assert!(matches!(retry, Execution::Replayed(_)));
        assert_eq!(Some(retry.response()), row.response.as_ref());
        assert_eq!(self.ledger.len(), 1, "one payment, never two");
        let history = store.history(self.request(key).id()).await.unwrap();
        assert_eq!(
            history.last().unwrap().actor,
            idemflow::record::Actor::Sweeper
        );
        retry.response().body_json().unwrap()
    }
}

async fn stale(lease: Duration) {
    tokio::time::sleep(lease + Duration::from_millis(60)).await;
}

const LEASE: Duration = Duration::from_millis(400);

// ---- Adyen: replay inside the 31-day window ---------------------------------------------------

async fn adyen_crash_after_claim_before_the_call_is_redriven_to_one_payment(
    store: Backend,
    _url: String,
) {
    let card = Card::adyen().await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.crash_before_the_call(&idem, "before-1").await;
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!((report.done, report.redrives), (1, 1), "{report:?}");
    let body = card.assert_done_once(&store, &idem, "before-1").await;
    assert_eq!(body["resultCode"], "Authorised");
}

async fn adyen_lost_response_is_replayed_by_the_sweeper(store: Backend, _url: String) {
    let card = Card::adyen().await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.lose_the_answer(&idem, "lost-1").await;
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!((report.done, report.redrives), (1, 1), "{report:?}");
    assert!(report.is_clean());
    let body = card.assert_done_once(&store, &idem, "lost-1").await;
    assert_eq!(body["pspReference"], card.ledger.entries()[0].id.as_str());
}

async fn adyen_died_after_the_answer_is_settled_with_one_payment(store: Backend, _url: String) {
    let card = Card::adyen().await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.die_after_the_answer(&idem, "died-1").await;
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!((report.done, report.redrives), (1, 1), "{report:?}");
    card.assert_done_once(&store, &idem, "died-1").await;
}

// ---- A key reused after our retention: the provider still holds the earlier provider key ------

/// Finishes `key` with our retention at zero, purges it, and gives the purged row's provider key.
async fn purged_after_retention(store: &Backend, id: &idemflow::KeyId) -> String {
    let pk = store.get(id).await.unwrap().unwrap().provider_key;
    tokio::time::sleep(Duration::from_millis(5)).await;
    while store.get(id).await.unwrap().is_some() {
        assert!(store.purge_expired(100).await.unwrap() > 0, "purged");
    }
    pk
}

/// Adyen keeps keys for 31 days, we for less: on "day 2" the same key and body must make a new
/// payment, not get day 0's answer back (which would be stored as the new request's success).
async fn adyen_key_reused_after_our_retention_charges_anew(store: Backend, _url: String) {
    let card = Card::adyen().await;
    let idem = Idempotency::new(store.clone())
        .lease(LEASE)
        .retention(Duration::ZERO);
    let day0 = idem
        .call(card.request("reused-1"), card.provider.as_ref())
        .await
        .unwrap();
    let old_pk = purged_after_retention(&store, card.request("reused-1").id()).await;
    let day2 = idem
        .call(card.request("reused-1"), card.provider.as_ref())
        .await
        .unwrap();
    assert!(!day2.is_replay());
    let new_pk = store
        .get(card.request("reused-1").id())
        .await
        .unwrap()
        .unwrap()
        .provider_key;
    assert_ne!(new_pk, old_pk, "a re-created row sends a key of its own");
    assert_eq!(card.ledger.len(), 2, "day 2 made its own payment");
    let psp = |e: &Execution| e.response().body_json::<Value>().unwrap()["pspReference"].clone();
    assert_ne!(psp(&day0), psp(&day2), "not day 0's answer");
    // Every attempt of the new row sends the new key: a retry replays it.
    let again = idem
        .call(card.request("reused-1"), card.provider.as_ref())
        .await
        .unwrap();
    assert!(again.is_replay());
    assert_eq!(card.ledger.count_for_key(&new_pk), 1);
}

/// Square does not document how long it keeps keys: a key reused after our retention with
/// another body must not meet `IDEMPOTENCY_KEY_REUSED` (left processing, then voided by key by
/// the sweeper, which would aim at the old payment): it makes its own payment.
async fn square_key_reused_after_our_retention_charges_anew(store: Backend, _url: String) {
    let card = Card::square(Card::square_payment()).await;
    let idem = Idempotency::new(store.clone())
        .lease(LEASE)
        .retention(Duration::ZERO);
    idem.call(card.request("reused-1"), card.provider.as_ref())
        .await
        .unwrap();
    let old_pk = purged_after_retention(&store, card.request("reused-1").id()).await;
    let other = json!({"source_id": "cnon:card-nonce-ok",
                       "amount_money": {"amount": 2500, "currency": "USD"}});
    let day2 = IdempotentRequest::new("shop-1", "reused-1", "payments.create", &other).unwrap();
    let out = idem.call(day2.clone(), card.provider.as_ref()).await;
    let charged = out.unwrap_or_else(|e| panic!("the reused key must charge anew: {e}"));
    assert!(!charged.is_replay());
    let body: Value = charged.response().body_json().unwrap();
    assert_eq!(body["payment"]["amount_money"]["amount"], 2500);
    assert_eq!(card.ledger.len(), 2);
    assert_eq!(
        card.ledger.count_for_key(&old_pk),
        1,
        "the old payment stands untouched"
    );
    assert_eq!(card.ledger.entries()[0].status, "COMPLETED");
    assert!(card.sweeper(&store).run_once().await.unwrap().is_clean());
}

// ---- Square: void by key ------------------------------------------------------------------------

/// The create times out at the client while Square still holds it (queued, nothing recorded
/// yet); the sweeper's void within seconds finds no payment and answers 200, then the payment
/// lands. The void inside Square's processing window must not make the key retryable: the key
/// stays processing, and once the window has passed the sweeper finds the payment (the void is
/// refused, the same-key re-send returns it) and the key ends done with it.
async fn square_void_racing_a_delayed_create_waits_out_the_processing_window(
    store: Backend,
    _url: String,
) {
    let fake = FakeSquare::start().await.unwrap();
    let square = Square::with_base_url(fake.base_url(), FakeSquare::API_KEY)
        .unwrap()
        .http_config(HttpConfig {
            request_timeout: Duration::from_millis(300),
            max_attempts: 1,
            ..HttpConfig::default()
        })
        .unwrap()
        .processing_window(Duration::from_secs(3));
    let square: Arc<dyn Provider> = Arc::new(square);
    let sweeper = Sweeper::new(store.clone(), Providers::new().with(square.clone()))
        .backoff(Duration::from_millis(100), Duration::from_millis(200));
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    let req = || {
        IdempotentRequest::new(
            "shop-1",
            "slow-1",
            "payments.create",
            &Card::square_payment(),
        )
        .unwrap()
    };
    fake.faults().delay_next(Duration::from_millis(1500));
    let err = idem.call(req(), square.as_ref()).await.unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    // The worker released the key: the sweeper takes it at once and voids by key.
    let report = sweeper.run_once().await.unwrap();
    assert_eq!(report.lookups, 1, "{report:?}");
    let row = store.get(req().id()).await.unwrap().unwrap();
    assert_eq!(
        row.state,
        KeyState::Processing,
        "a void inside the processing window proves nothing: {row:?}"
    );
    // The delayed create lands: one payment under the key.
    for _ in 0..200 {
        if fake.ledger().len() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(fake.ledger().len(), 1, "the delayed create charged");
    // Past the window the sweeper settles it from Square: done with that payment.
    let mut state = row.state;
    for _ in 0..200 {
        sweeper.run_once().await.unwrap();
        state = store.get(req().id()).await.unwrap().unwrap().state;
        if state != KeyState::Processing {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state, KeyState::Done);
    let row = store.get(req().id()).await.unwrap().unwrap();
    let body: Value = row.response.unwrap().body_json().unwrap();
    assert_eq!(
        body["payment"]["id"],
        fake.ledger().entries()[0].id.as_str()
    );
    assert_eq!(fake.ledger().entries()[0].status, "COMPLETED");
    let retry = idem.call(req(), square.as_ref()).await.unwrap();
    assert!(retry.is_replay());
    assert_eq!(fake.ledger().len(), 1, "one payment, never two");
}

async fn square_crash_after_claim_before_the_call_is_voided_then_charged_once(
    store: Backend,
    _url: String,
) {
    let card = Card::square(Card::square_payment()).await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.crash_before_the_call(&idem, "before-1").await;
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!(
        (report.retryable, report.redrives, report.lookups),
        (1, 0, 1),
        "{report:?}"
    );
    assert!(card.ledger.is_empty(), "nothing charged");
    let row = store
        .get(card.request("before-1").id())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, KeyState::Failed { retryable: true });
    // The client's retry now charges, once.
    let charged = idem
        .call(card.request("before-1"), card.provider.as_ref())
        .await
        .unwrap();
    assert!(!charged.is_replay());
    let again = idem
        .call(card.request("before-1"), card.provider.as_ref())
        .await
        .unwrap();
    assert!(again.is_replay());
    assert_eq!(card.ledger.len(), 1);
    assert_eq!(card.ledger.entries()[0].status, "COMPLETED");
}

async fn square_lost_response_is_looked_up_after_the_void_is_refused(store: Backend, _url: String) {
    let card = Card::square(Card::square_payment()).await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.lose_the_answer(&idem, "lost-1").await;
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!((report.done, report.lookups), (1, 1), "{report:?}");
    // The payment completed: the void was refused and left it alone.
    assert_eq!(card.ledger.entries()[0].status, "COMPLETED");
    let body = card.assert_done_once(&store, &idem, "lost-1").await;
    assert_eq!(body["payment"]["id"], card.ledger.entries()[0].id.as_str());
}

async fn square_lost_delayed_capture_is_looked_up_not_voided(store: Backend, _url: String) {
    let mut body = Card::square_payment();
    body["autocomplete"] = json!(false);
    let card = Card::square(body).await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.lose_the_answer(&idem, "auth-1").await;
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!((report.done, report.lookups), (1, 1), "{report:?}");
    assert_eq!(
        card.ledger.entries()[0].status,
        "APPROVED",
        "the authorisation was kept, not voided"
    );
    let body = card.assert_done_once(&store, &idem, "auth-1").await;
    assert_eq!(body["payment"]["status"], "APPROVED");
}

async fn square_died_after_the_answer_is_settled_with_one_payment(store: Backend, _url: String) {
    let card = Card::square(Card::square_payment()).await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.die_after_the_answer(&idem, "died-1").await;
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!((report.done, report.lookups), (1, 1), "{report:?}");
    card.assert_done_once(&store, &idem, "died-1").await;
}

// ---- PayPal: a same-id re-send returns the order's current state -----------------------------

async fn paypal_crash_after_claim_before_the_call_is_redriven_to_one_order(
    store: Backend,
    _url: String,
) {
    let (card, _fake) = Card::paypal().await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.crash_before_the_call(&idem, "before-1").await;
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!((report.done, report.redrives), (1, 1), "{report:?}");
    let body = card.assert_done_once(&store, &idem, "before-1").await;
    assert_eq!(body["status"], "CREATED");
}

async fn paypal_lost_response_is_settled_with_the_orders_current_state(
    store: Backend,
    _url: String,
) {
    let (card, fake) = Card::paypal().await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.lose_the_answer(&idem, "lost-1").await;
    // Meanwhile the buyer approved and the order was captured.
    fake.set_order_status(&card.ledger.entries()[0].id, "COMPLETED");
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!((report.done, report.redrives), (1, 1), "{report:?}");
    let body = card.assert_done_once(&store, &idem, "lost-1").await;
    assert_eq!(body["status"], "COMPLETED");
    assert_eq!(body["id"], card.ledger.entries()[0].id.as_str());
}

async fn paypal_died_after_the_answer_is_settled_with_one_order(store: Backend, _url: String) {
    let (card, _fake) = Card::paypal().await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    card.die_after_the_answer(&idem, "died-1").await;
    stale(LEASE).await;
    let report = card.sweeper(&store).run_once().await.unwrap();
    assert_eq!((report.done, report.redrives), (1, 1), "{report:?}");
    card.assert_done_once(&store, &idem, "died-1").await;
}

#[cfg(feature = "cli")]
async fn cli_reconcile_once_settles_each_card_processor_from_a_config_file(
    store: Backend,
    url: String,
) {
    let adyen = Card::adyen().await;
    let square = Card::square(Card::square_payment()).await;
    let (paypal, pp_fake) = Card::paypal().await;
    let idem = Idempotency::new(store.clone()).lease(LEASE);
    adyen.lose_the_answer(&idem, "cli-a").await;
    square.lose_the_answer(&idem, "cli-s").await;
    paypal.lose_the_answer(&idem, "cli-p").await;
    pp_fake.set_order_status(&paypal.ledger.entries()[0].id, "COMPLETED");
    // Crashed before its call: Square voids it by key.
    square.crash_before_the_call(&idem, "cli-s2").await;
    stale(LEASE).await;

    let config = format!(
        "[[providers]]\nkind = \"adyen\"\nbase_url = \"{}\"\napi_key_env = \"FAKE_ADYEN_KEY\"\n\n\
         [[providers]]\nkind = \"square\"\nbase_url = \"{}\"\napi_key_env = \"FAKE_SQUARE_KEY\"\nprocessing_window = 0\n\n\
         [[providers]]\nkind = \"paypal\"\nbase_url = \"{}\"\napi_key_env = \"FAKE_PAYPAL_TOKEN\"\n",
        adyen.base_url, square.base_url, paypal.base_url,
    );
    let report = crate::reconcile_cli::reconcile_once(
        &url,
        &config,
        &[
            ("FAKE_ADYEN_KEY", FakeAdyen::API_KEY),
            ("FAKE_SQUARE_KEY", FakeSquare::API_KEY),
            ("FAKE_PAYPAL_TOKEN", FakePayPal::API_KEY),
        ],
    )
    .await;
    assert_eq!(report["report"]["done"], 3, "{report}");
    assert_eq!(report["report"]["retryable"], 1, "{report}");
    adyen.assert_done_once(&store, &idem, "cli-a").await;
    square.assert_done_once(&store, &idem, "cli-s").await;
    let order = paypal.assert_done_once(&store, &idem, "cli-p").await;
    assert_eq!(order["status"], "COMPLETED");
    let row = store
        .get(square.request("cli-s2").id())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, KeyState::Failed { retryable: true });
    assert_eq!(square.ledger.len(), 1, "the voided key charged nothing");
}
