//! The seed article's payment demo, on idemflow: SQLite in memory and an in-process fake card
//! processor. Run with `cargo run --example payments`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemflow::store::sqlite::SqliteStore;
use idemflow::{
    Context, Error, Execution, Idempotency, IdempotentRequest, Outcome, Store, StoredResponse,
};
use serde_json::{Value, json};
use sqlx::SqlitePool;

/// A card processor that, like Stripe, dedupes by the idempotency key it is sent.
#[derive(Default)]
struct FakeProcessor {
    charges: Mutex<Vec<u64>>,
    by_key: Mutex<HashMap<String, usize>>,
}

impl FakeProcessor {
    async fn charge(&self, idempotency_key: Option<&str>, amount: u64) -> String {
        tokio::time::sleep(Duration::from_millis(20)).await; // the network
        if let Some(key) = idempotency_key
            && let Some(&n) = self.by_key.lock().unwrap().get(key)
        {
            return format!("ch_{n}");
        }
        let mut charges = self.charges.lock().unwrap();
        charges.push(amount);
        let n = charges.len();
        if let Some(key) = idempotency_key {
            self.by_key.lock().unwrap().insert(key.to_owned(), n);
        }
        format!("ch_{n}")
    }

    fn count(&self) -> usize {
        self.charges.lock().unwrap().len()
    }
}

struct App {
    db: SqlitePool,
    processor: FakeProcessor,
    idem: Idempotency,
}

impl App {
    /// Charges the card and records the payment: the operation idemflow makes safe to retry.
    async fn create_payment(&self, body: &Value, provider_key: Option<&str>) -> StoredResponse {
        let amount = body["amount"].as_u64().unwrap_or(0);
        let user = body["user"].as_str().unwrap_or("?");
        let charge = self.processor.charge(provider_key, amount).await;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO payments (user, amount, charge) VALUES (?, ?, ?) RETURNING id",
        )
        .bind(user)
        .bind(amount as i64)
        .bind(&charge)
        .fetch_one(&self.db)
        .await
        .expect("insert payment");
        StoredResponse::json(201, &json!({"payment_id": id, "amount": amount})).expect("json")
    }

    /// The endpoint: `POST /payments` with an optional `Idempotency-Key`.
    async fn post_payments(&self, body: Value, key: Option<&str>) -> (u16, String, &'static str) {
        let Some(key) = key else {
            let r = self.create_payment(&body, None).await;
            return (r.status(), text(&r), "no protection");
        };
        let request = match IdempotentRequest::new("user:alice", key, "payments.create", &body) {
            Ok(r) => r,
            Err(e) => {
                return (
                    e.http_status(),
                    json!({"error": e.to_string()}).to_string(),
                    "bad request",
                );
            }
        };
        let result = self
            .idem
            .execute(request, |ctx: Context| async move {
                Outcome::Succeeded(self.create_payment(&body, Some(ctx.provider_key())).await)
            })
            .await;
        match result {
            Ok(Execution::Executed(r)) => (r.status(), text(&r), "executed"),
            Ok(Execution::Replayed(r)) => (r.status(), text(&r), "replay"),
            Err(e @ Error::FingerprintMismatch { .. }) => (
                e.http_status(),
                json!({"error": "Idempotency key reused with a different request"}).to_string(),
                "refused",
            ),
            Err(e) => (
                e.http_status(),
                json!({"error": e.to_string()}).to_string(),
                "retry later",
            ),
        }
    }
}

fn text(r: &StoredResponse) -> String {
    String::from_utf8_lossy(r.body()).into_owned()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect("sqlite::memory:").await?;
    store.migrate().await?;
    let db = store.writer_pool().clone(); // the app's own table lives in the same database
    sqlx::query(
        "CREATE TABLE payments (id INTEGER PRIMARY KEY, user TEXT, amount INTEGER, charge TEXT)",
    )
    .execute(&db)
    .await?;
    let app = Arc::new(App {
        db,
        processor: FakeProcessor::default(),
        idem: Idempotency::new(Arc::new(store)),
    });

    println!("idemflow payments demo: SQLite in memory, a fake card processor\n");
    let body = json!({"user": "alice", "amount": 500});
    let show = |label: &str, (status, body, how): (u16, String, &str)| {
        println!("{label:<22}: {status} {body}  ({how})");
    };
    show(
        "1st request, key abc",
        app.post_payments(body.clone(), Some("abc")).await,
    );
    show(
        "retry, same key",
        app.post_payments(body.clone(), Some("abc")).await,
    );
    show(
        "same key, other body",
        app.post_payments(json!({"user": "alice", "amount": 900}), Some("abc"))
            .await,
    );
    show("no key", app.post_payments(body.clone(), None).await);
    show("no key, again", app.post_payments(body.clone(), None).await);

    // 50 impatient clients retry the same new payment at once.
    let before = app.processor.count();
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let app = app.clone();
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            app.post_payments(body, Some("xyz")).await
        }));
    }
    let (mut executed, mut replayed, mut waited) = (0, 0, 0);
    let mut answers = std::collections::BTreeSet::new();
    for t in tasks {
        let (status, body, how) = t.await?;
        match (status, how) {
            (201, "executed") => executed += 1,
            (201, "replay") => replayed += 1,
            (409, _) => waited += 1,
            other => println!("unexpected: {other:?} {body}"),
        }
        if status == 201 {
            answers.insert(body);
        }
    }
    // The ones told 409 (still in flight) retry after Retry-After and get the stored answer.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..waited {
        let (status, body, _) = app.post_payments(body.clone(), Some("xyz")).await;
        assert_eq!(status, 201);
        answers.insert(body);
    }
    println!(
        "50 concurrent, key xyz: {executed} executed, {replayed} replayed, {waited} told 409 and replayed on retry; \
         distinct answers: {}, charges: {}",
        answers.len(),
        app.processor.count() - before
    );

    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&app.db)
        .await?;
    println!("payments in database  : {payments}");
    println!("processor charges     : {}", app.processor.count());
    if payments as usize != app.processor.count() {
        return Err("payments and charges disagree".into());
    }
    Ok(())
}
