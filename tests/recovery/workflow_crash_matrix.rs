//! The workflow crash matrix (issue 13): a checkout workflow of three steps, each through a real
//! HTTP adapter against the testkit's fakes: `charge` (Stripe, keyed), `email` (Resend, keyed)
//! and `notify` (Postmark, keyless: settled by metadata search). The process dies before,
//! during (the provider acted, its answer never came) and after each step. Then, with no
//! further crash:
//!
//! * **client retries and the operator's sweeper** (no resumer: it settles the steps from the
//!   providers and reports the workflow as waiting; the client's retry continues it), and
//! * **the application's sweeper with a resumer** (no client retry at all until the end).
//!
//! Before the three steps, an atomic phase inserts the order row (`Context::atomic_step`).
//! Every story ends with exactly one order row, one charge, one email and one notification, the
//! workflow `done`, and the same final answer on every retry. Runs on SQLite (a file database)
//! and on PostgreSQL (a fresh schema) when `IDEMFLOW_TEST_POSTGRES_URL` is set.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemflow::provider::http::HttpConfig;
use idemflow::provider::{Postmark, Resend, Stripe};
use idemflow::store::phase::AtomicPhase;
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::{FakePostmark, FakeResend, FakeStripe};
use idemflow::{
    Context, Error, Idempotency, IdempotentRequest, KeyState, Outcome, Providers, Store,
    StoredResponse, Sweeper, workflow::Step,
};
use serde_json::json;

#[cfg(feature = "postgres")]
use crate::support;

const LEASE: Duration = Duration::from_millis(400);

/// The store, an atomic phase inserting the order row, and a count of an order's rows.
#[derive(Clone)]
struct Db {
    store: Arc<dyn Store>,
    insert_order: Arc<dyn Fn(String) -> Box<dyn AtomicPhase> + Send + Sync>,
    orders: Arc<dyn Fn(String) -> Count + Send + Sync>,
}

type Count = std::pin::Pin<Box<dyn std::future::Future<Output = i64> + Send>>;

async fn sqlite_store() -> Option<Db> {
    let dir = tempfile::tempdir().unwrap().keep();
    let url = format!("sqlite://{}", dir.join("workflows.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE orders (id TEXT NOT NULL, amount INTEGER NOT NULL)")
        .execute(store.writer_pool())
        .await
        .unwrap();
    let reads = sqlx::SqlitePool::connect(&url).await.unwrap();
    let phases = store.clone();
    Some(Db {
        store: Arc::new(store),
        insert_order: Arc::new(move |order: String| {
            Box::new(phases.atomic_phase(move |tx| {
                let order = order.clone();
                Box::pin(async move {
                    sqlx::query("INSERT INTO orders (id, amount) VALUES (?, 1500)")
                        .bind(&order)
                        .execute(&mut *tx)
                        .await?;
                    Ok(StoredResponse::json(201, &json!({"order": order}))?)
                })
            })) as Box<dyn AtomicPhase>
        }),
        orders: Arc::new(move |order: String| {
            let reads = reads.clone();
            Box::pin(async move {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE id = ?")
                    .bind(order)
                    .fetch_one(&reads)
                    .await
                    .unwrap()
            })
        }),
    })
}

#[cfg(feature = "postgres")]
async fn postgres_store() -> Option<Db> {
    let (url, schema) = support::postgres::fresh_schema().await?;
    let pool = support::postgres::pool_in(&url, &schema, 8).await;
    // No unique constraint: a second insert of an order would show as a second row.
    sqlx::query("CREATE TABLE orders (id text NOT NULL, amount bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let store = idemflow::store::postgres::PostgresStore::from_pool(pool.clone());
    store.migrate().await.unwrap();
    let phases = store.clone();
    Some(Db {
        store: Arc::new(store),
        insert_order: Arc::new(move |order: String| {
            Box::new(phases.atomic_phase(move |tx| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, 1500)")
                        .bind(&order)
                        .execute(&mut *tx)
                        .await?;
                    Ok(StoredResponse::json(201, &json!({"order": order}))?)
                })
            })) as Box<dyn AtomicPhase>
        }),
        orders: Arc::new(move |order: String| {
            let pool = pool.clone();
            Box::pin(async move {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE id = $1")
                    .bind(order)
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            })
        }),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step3 {
    Charge,
    Email,
    Notify,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    Before,
    During,
    After,
}

#[derive(Debug, Clone, Copy)]
enum Recovery {
    ClientRetriesAndOperatorSweeper,
    ResumerOnly,
}

fn once() -> HttpConfig {
    HttpConfig {
        request_timeout: Duration::from_secs(5),
        max_attempts: 1,
        ..HttpConfig::default()
    }
}

/// The three fakes and their adapters, and where the next run of the workflow dies.
struct Shop {
    stripe_fake: FakeStripe,
    resend_fake: FakeResend,
    postmark_fake: FakePostmark,
    stripe: Arc<Stripe>,
    resend: Arc<Resend>,
    postmark: Arc<Postmark>,
    /// Die at this point of this step (taken by the run that dies).
    crash: Arc<Mutex<Option<(Step3, Point)>>>,
    /// Signalled when the dying run reached its crash point.
    reached: Arc<Mutex<Option<tokio::sync::oneshot::Sender<()>>>>,
}

impl Shop {
    async fn start() -> Arc<Self> {
        let stripe_fake = FakeStripe::start().await.unwrap();
        let resend_fake = FakeResend::start().await.unwrap();
        let postmark_fake = FakePostmark::start().await.unwrap();
        let stripe = Stripe::with_base_url(stripe_fake.base_url(), FakeStripe::API_KEY)
            .unwrap()
            .http_config(once())
            .unwrap();
        let resend = Resend::with_base_url(resend_fake.base_url(), FakeResend::API_KEY)
            .unwrap()
            .http_config(once())
            .unwrap();
        let postmark = Postmark::with_base_url(postmark_fake.base_url(), FakePostmark::API_KEY)
            .unwrap()
            .http_config(once())
            .unwrap()
            .search_lag(Duration::ZERO);
        Arc::new(Self {
            stripe: Arc::new(stripe),
            resend: Arc::new(resend),
            postmark: Arc::new(postmark),
            stripe_fake,
            resend_fake,
            postmark_fake,
            crash: Arc::default(),
            reached: Arc::default(),
        })
    }

    fn providers(&self) -> Providers {
        Providers::new()
            .with(self.stripe.clone())
            .with(self.resend.clone())
            .with(self.postmark.clone())
    }

    /// Effects so far: charges, emails, notifications (each story has fakes of its own).
    fn counts(&self) -> [usize; 3] {
        [
            self.stripe_fake.ledger().len(),
            self.resend_fake.ledger().len(),
            self.postmark_fake.ledger().len(),
        ]
    }

    /// The crash point of `step` at `point`, if the dying run is configured for it: signal and
    /// hang forever (the process is dead from here on).
    async fn maybe_die(&self, step: Step3, point: Point) {
        let due = {
            let mut crash = self.crash.lock().unwrap();
            if *crash == Some((step, point)) {
                *crash = None;
                true
            } else {
                false
            }
        };
        if due {
            if let Some(tx) = self.reached.lock().unwrap().take() {
                let _ = tx.send(());
            }
            std::future::pending::<()>().await;
        }
    }
}

fn checkout(order: &str) -> IdempotentRequest {
    IdempotentRequest::new(
        "shop-1",
        order,
        "checkout",
        &json!({"order": order, "amount": 1500, "email": "ana@example.org"}),
    )
    .unwrap()
    .workflow()
}

/// The checkout workflow: insert the order row, charge, email the receipt, notify the warehouse.
fn workflow(
    shop: Arc<Shop>,
    db: Db,
) -> impl Fn(Context) -> std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send>>
+ Clone
+ Send
+ Sync
+ 'static {
    move |ctx: Context| {
        let (shop, db) = (shop.clone(), db.clone());
        Box::pin(async move {
            let request: serde_json::Value = serde_json::from_str(ctx.request()).unwrap();
            let order = request["order"].as_str().unwrap().to_owned();
            let steps = async {
                let create = Step::new("create_order", &json!({"order": order}))?;
                ctx.atomic_step(create, (db.insert_order)(order.clone()))
                    .await?;
                shop.maybe_die(Step3::Charge, Point::Before).await;
                let charge = Step::new(
                    "charge",
                    &json!({"amount": 1500, "currency": "usd", "payment_method": "pm_card_visa",
                            "description": format!("order {order}")}),
                )?;
                let charged = ctx.call_step(charge, &*shop.stripe).await?;
                shop.maybe_die(Step3::Charge, Point::After).await;
                let pi: serde_json::Value = charged.response().body_json().unwrap();

                shop.maybe_die(Step3::Email, Point::Before).await;
                let email = Step::new(
                    "email",
                    &json!({"from": "shop@example.com", "to": ["ana@example.org"],
                            "subject": format!("Receipt for order {order}"),
                            "text": format!("Paid: {}", pi["id"])}),
                )?;
                ctx.call_step(email, &*shop.resend).await?;
                shop.maybe_die(Step3::Email, Point::After).await;

                shop.maybe_die(Step3::Notify, Point::Before).await;
                let notify = Step::new(
                    "notify",
                    &json!({"From": "shop@example.com", "To": "warehouse@example.com",
                            "Subject": format!("Ship order {order}"), "TextBody": "1 item"}),
                )?;
                ctx.call_step(notify, &*shop.postmark).await?;
                shop.maybe_die(Step3::Notify, Point::After).await;
                Ok::<_, Error>(json!({"order": order, "payment": pi["id"], "status": "confirmed"}))
            };
            match steps.await {
                Ok(body) => Outcome::Succeeded(StoredResponse::json(201, &body).unwrap()),
                Err(e) => Outcome::from_step_error(&e),
            }
        })
    }
}

/// One story: a run that dies at `point` of `step`, then recovery, then the checks.
async fn story(db: Db, step: Step3, point: Point, recovery: Recovery) {
    let store = db.store.clone();
    let shop = Shop::start().await;
    let order = format!("o-{step:?}-{point:?}-{recovery:?}").to_lowercase();
    let idem = Idempotency::new(store.clone())
        .lease(LEASE)
        .owner("checkout-worker");
    let op = workflow(shop.clone(), db.clone());

    // The run that dies.
    let (tx, rx) = tokio::sync::oneshot::channel();
    *shop.reached.lock().unwrap() = Some(tx);
    let dying = idem.execute(checkout(&order), op.clone());
    if point == Point::During {
        // The provider acts, then its answer never comes; the process dies while waiting.
        let faults = match step {
            Step3::Charge => shop.stripe_fake.faults(),
            Step3::Email => shop.resend_fake.faults(),
            Step3::Notify => shop.postmark_fake.faults(),
        };
        faults.hang_next_response();
        let index = step as usize;
        let before = shop.counts()[index];
        tokio::select! {
            _ = dying => panic!("the run must die mid-call"),
            () = async {
                while shop.counts()[index] == before {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            } => {}
        }
    } else {
        *shop.crash.lock().unwrap() = Some((step, point));
        tokio::select! {
            _ = dying => panic!("the run must die at its crash point"),
            r = tokio::time::timeout(Duration::from_secs(10), rx) => {
                r.expect("the run reaches its crash point").expect("signalled");
            }
        }
    }
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;

    let first_answer = match recovery {
        Recovery::ClientRetriesAndOperatorSweeper => {
            // The operator's cron sweeper settles what the providers know; it cannot resume.
            let cli = Sweeper::new(store.clone(), shop.providers())
                .owner("cron")
                .backoff(Duration::ZERO, Duration::ZERO);
            for _ in 0..4 {
                let report = cli.run_once().await.unwrap();
                assert_eq!(report.resumed, 0);
                if report.taken == 0 {
                    break;
                }
            }
            // The client retries until it gets an answer (a step may still be settling).
            let mut answer = None;
            for _ in 0..20 {
                match idem.execute(checkout(&order), op.clone()).await {
                    Ok(e) => {
                        answer = Some(e.into_response());
                        break;
                    }
                    Err(Error::InFlight { .. } | Error::OutcomeUnknown { .. }) => {
                        tokio::time::sleep(LEASE).await;
                        cli.run_once().await.unwrap();
                    }
                    Err(e) => panic!("{step:?}/{point:?}: unexpected {e:?}"),
                }
            }
            answer.expect("the client got its answer")
        }
        Recovery::ResumerOnly => {
            let app = Sweeper::new(store.clone(), shop.providers())
                .owner("app-sweeper")
                .backoff(Duration::ZERO, Duration::ZERO)
                .resumer("checkout", idem.clone(), op.clone());
            let id = checkout(&order).id().clone();
            for _ in 0..20 {
                app.run_once().await.unwrap();
                if store.get(&id).await.unwrap().unwrap().state == KeyState::Done {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let row = store.get(&id).await.unwrap().unwrap();
            assert_eq!(
                row.state,
                KeyState::Done,
                "{step:?}/{point:?}: the resumer finished the workflow"
            );
            let replay = idem.execute(checkout(&order), op.clone()).await.unwrap();
            assert!(replay.is_replay());
            replay.into_response()
        }
    };
    assert_eq!(
        shop.counts(),
        [1, 1, 1],
        "{step:?}/{point:?}/{recovery:?}: one charge, one email, one notification"
    );
    assert_eq!(first_answer.status(), 201);
    for _ in 0..2 {
        let again = idem.execute(checkout(&order), op.clone()).await.unwrap();
        assert!(again.is_replay());
        assert_eq!(
            again.response(),
            &first_answer,
            "the same answer on every retry"
        );
    }
    assert_eq!(shop.counts(), [1, 1, 1]);
    assert_eq!(
        (db.orders)(order.clone()).await,
        1,
        "the order row exists once"
    );
}

macro_rules! matrix {
    ($factory:path; $($name:ident: $step:ident $point:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                for recovery in [
                    super::Recovery::ClientRetriesAndOperatorSweeper,
                    super::Recovery::ResumerOnly,
                ] {
                    let Some(db) = $factory().await else { return };
                    super::story(db, super::Step3::$step, super::Point::$point, recovery).await;
                }
            }
        )*
    };
    ($factory:path) => {
        matrix!($factory;
            before_charge: Charge Before, during_charge: Charge During, after_charge: Charge After,
            before_email: Email Before, during_email: Email During, after_email: Email After,
            before_notify: Notify Before, during_notify: Notify During, after_notify: Notify After,
        );
    };
}

mod sqlite {
    matrix!(super::sqlite_store);
}

#[cfg(feature = "postgres")]
mod postgres {
    matrix!(super::postgres_store);
}
