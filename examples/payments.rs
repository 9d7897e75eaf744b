//! The seed article's payment demo, on idemflow, done the way the article says: the payment row
//! and the key's answer are written in **one transaction** (`Idempotency::execute_atomic`), and
//! the card is charged after the commit, from an outbox row written in that same transaction.
//! SQLite in memory and an in-process fake card processor. Run with
//! `cargo run --example payments`.
//!
//! A crash between the payment's `INSERT` and the commit (here a panic inside the transaction,
//! the in-process stand-in for a killed process; `tests/backends/one_commit_kill.rs` kills a real
//! one) leaves neither the payment nor the key, so the client's retry writes exactly one payment.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemflow::store::sqlite::SqliteStore;
use idemflow::{
    Context, Error, Execution, Idempotency, IdempotentRequest, Outcome, Store, StoredResponse,
};
use serde_json::{Value, json};

/// A card processor that, like Stripe, dedupes by the idempotency key it is sent.
#[derive(Default)]
struct FakeProcessor {
    charges: Mutex<Vec<i64>>,
    by_key: Mutex<HashMap<String, usize>>,
}

impl FakeProcessor {
    async fn charge(&self, idempotency_key: &str, amount: i64) -> String {
        tokio::time::sleep(Duration::from_millis(5)).await; // the network
        if let Some(&n) = self.by_key.lock().unwrap().get(idempotency_key) {
            return format!("ch_{n}");
        }
        let mut charges = self.charges.lock().unwrap();
        charges.push(amount);
        let n = charges.len();
        self.by_key
            .lock()
            .unwrap()
            .insert(idempotency_key.to_owned(), n);
        format!("ch_{n}")
    }

    fn count(&self) -> usize {
        self.charges.lock().unwrap().len()
    }
}

struct App {
    store: SqliteStore,
    processor: FakeProcessor,
    idem: Idempotency,
    /// Makes the next payment's transaction die after its `INSERT` (the demo's crash).
    crash_next: AtomicBool,
}

const SCHEMA: &[&str] = &[
    "CREATE TABLE payments (id INTEGER PRIMARY KEY, user TEXT NOT NULL, amount INTEGER NOT NULL)",
    // What the card processor is still to be asked, written with the payment.
    "CREATE TABLE outbox (id INTEGER PRIMARY KEY, payment_id INTEGER NOT NULL, \
     amount INTEGER NOT NULL, charge TEXT)",
];

impl App {
    /// The endpoint: `POST /payments` with an optional `Idempotency-Key`.
    async fn post_payments(&self, body: Value, key: Option<&str>) -> (u16, String, &'static str) {
        let amount = body["amount"].as_i64().unwrap_or(0);
        let user = body["user"].as_str().unwrap_or("?").to_owned();
        let Some(key) = key else {
            // No key, no protection: each call is a new payment.
            let mut conn = self
                .store
                .writer_pool()
                .acquire()
                .await
                .expect("connection");
            let id = insert_payment(&mut conn, &user, amount)
                .await
                .expect("insert");
            let answer = json!({"payment_id": id, "amount": amount});
            return (201, answer.to_string(), "no protection");
        };
        let crash = self.crash_next.swap(false, Ordering::SeqCst);
        // The payment row and its outbox row, in the key's transaction.
        let phase = self.store.atomic_phase(move |conn| {
            let user = user.clone();
            Box::pin(async move {
                let id = insert_payment(conn, &user, amount).await?;
                if crash {
                    panic!("the process died between the payment's INSERT and the commit");
                }
                Ok(StoredResponse::json(
                    201,
                    &json!({"payment_id": id, "amount": amount}),
                )?)
            })
        });
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
        match self.idem.execute_atomic(request, phase).await {
            Ok(Execution::Executed(r)) => (r.status(), text(&r), "executed"),
            Ok(Execution::Replayed(r)) => (r.status(), text(&r), "replay"),
            Err(e @ Error::FingerprintMismatch { .. }) => (
                e.http_status(),
                json!({"error": "Idempotency key reused with a different request"}).to_string(),
                "refused",
            ),
            Err(e @ Error::RolledBack { .. }) => (
                e.http_status(),
                json!({"error": "nothing was written; retry with the same key"}).to_string(),
                "rolled back",
            ),
            Err(e) => (
                e.http_status(),
                json!({"error": e.to_string()}).to_string(),
                "retry later",
            ),
        }
    }

    /// The outbox dispatcher: charges every payment not yet charged, each under a key of its
    /// outbox row, so a dispatcher that dies mid-way and runs again charges nobody twice (the
    /// processor dedupes by the key idemflow forwards).
    async fn dispatch_outbox(&self) -> Result<usize, Box<dyn std::error::Error>> {
        let pending: Vec<(i64, i64)> =
            sqlx::query_as("SELECT id, amount FROM outbox WHERE charge IS NULL ORDER BY id")
                .fetch_all(self.store.writer_pool())
                .await?;
        for (id, amount) in &pending {
            let request = IdempotentRequest::new(
                "outbox",
                &format!("charge-{id}"),
                "charges.create",
                &json!({"outbox": id, "amount": amount}),
            )?;
            let charged = self
                .idem
                .execute(request, |ctx: Context| async move {
                    let charge = self.processor.charge(ctx.provider_key(), *amount).await;
                    Outcome::Succeeded(
                        StoredResponse::json(200, &json!({"charge": charge})).expect("json"),
                    )
                })
                .await?;
            let charge: Value = serde_json::from_slice(charged.response().body())?;
            sqlx::query("UPDATE outbox SET charge = ? WHERE id = ?")
                .bind(charge["charge"].as_str())
                .bind(id)
                .execute(self.store.writer_pool())
                .await?;
        }
        Ok(pending.len())
    }

    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(self.store.writer_pool())
            .await
            .expect("count")
    }
}

/// The payment's rows: the payment, and what the card processor is still to be asked.
async fn insert_payment(
    conn: &mut sqlx::SqliteConnection,
    user: &str,
    amount: i64,
) -> Result<i64, sqlx::Error> {
    let id: i64 =
        sqlx::query_scalar("INSERT INTO payments (user, amount) VALUES (?, ?) RETURNING id")
            .bind(user)
            .bind(amount)
            .fetch_one(&mut *conn)
            .await?;
    sqlx::query("INSERT INTO outbox (payment_id, amount) VALUES (?, ?)")
        .bind(id)
        .bind(amount)
        .execute(&mut *conn)
        .await?;
    Ok(id)
}

fn text(r: &StoredResponse) -> String {
    String::from_utf8_lossy(r.body()).into_owned()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect("sqlite::memory:").await?;
    store.migrate().await?;
    for statement in SCHEMA {
        // The app's tables live in the same database as the keys: one transaction for both.
        sqlx::query(*statement).execute(store.writer_pool()).await?;
    }
    let app = Arc::new(App {
        idem: Idempotency::new(Arc::new(store.clone())),
        store,
        processor: FakeProcessor::default(),
        crash_next: AtomicBool::new(false),
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

    // The process dies between the payment's INSERT and the commit; the client retries.
    let before = app.count("SELECT count(*) FROM payments").await;
    app.crash_next.store(true, Ordering::SeqCst);
    // The demo's crash is a panic: keep its message off the screen.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let crashed = app.post_payments(body.clone(), Some("crash")).await;
    std::panic::set_hook(default_hook);
    show("crash after INSERT", crashed);
    show(
        "retry after the crash",
        app.post_payments(body.clone(), Some("crash")).await,
    );
    let written = app.count("SELECT count(*) FROM payments").await - before;
    println!("payments for key crash: {written} (the crashed transaction left nothing)");
    if written != 1 {
        return Err("the crash left a duplicate payment".into());
    }

    // 50 impatient clients retry the same new payment at once.
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let app = app.clone();
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            app.post_payments(body, Some("xyz")).await
        }));
    }
    let (mut executed, mut replayed) = (0, 0);
    let mut answers = std::collections::BTreeSet::new();
    for t in tasks {
        let (status, body, how) = t.await?;
        match (status, how) {
            (201, "executed") => executed += 1,
            (201, "replay") => replayed += 1,
            other => println!("unexpected: {other:?} {body}"),
        }
        answers.insert(body);
    }
    println!(
        "50 concurrent, key xyz: {executed} executed, {replayed} replayed; distinct answers: {}",
        answers.len()
    );

    // After the commits: the outbox dispatcher charges each payment once. Run it twice, as a
    // cron job that died and ran again would: the second run finds nothing left to charge.
    let sent = app.dispatch_outbox().await?;
    let again = app.dispatch_outbox().await?;
    println!("outbox dispatched     : {sent} charges, then {again} on a second run");

    let payments = app.count("SELECT count(*) FROM payments").await;
    println!("payments in database  : {payments}");
    println!("processor charges     : {}", app.processor.count());
    if payments as usize != app.processor.count() || answers.len() != 1 || executed != 1 {
        return Err("payments and charges disagree".into());
    }
    Ok(())
}
