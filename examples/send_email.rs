//! An email sent exactly once although the first answer is lost and the client retries.
//!
//! Runs against the in-process fake Resend from the `testkit` feature (no network):
//!
//! ```text
//! cargo run --example send_email --features testkit
//! ```

use std::sync::Arc;
use std::time::Duration;

use idemflow::provider::Resend;
use idemflow::provider::http::HttpConfig;
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::FakeResend;
use idemflow::{Error, Idempotency, IdempotentRequest, Store};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A fake Resend on 127.0.0.1 that keeps a ledger of the emails it really sent.
    let fake = FakeResend::start().await?;
    // One attempt per call, so the lost answer reaches the application and the retry is ours.
    let resend =
        Resend::with_base_url(fake.base_url(), FakeResend::API_KEY)?.http_config(HttpConfig {
            max_attempts: 1,
            ..HttpConfig::default()
        })?;

    let store = SqliteStore::connect("sqlite::memory:").await?;
    store.migrate().await?;
    // A retry may take over a key whose outcome is unknown, because Resend replays a same-key
    // request for 24 h: the retry cannot send a second email.
    let idem =
        Idempotency::new(Arc::new(store)).retry_takeover_window(Some(Duration::from_secs(3600)));

    let email = serde_json::json!({
        "from": "shop@example.test",
        "to": ["ada@example.test"],
        "subject": "Your receipt",
        "text": "Thank you for your order #1042.",
    });
    let request = || IdempotentRequest::new("shop", "receipt-1042", "email.receipt", &email);

    println!("1. sending the receipt; the fake will send it and then drop the connection");
    fake.faults().lose_next_response();
    match idem.call(request()?, &resend).await {
        Err(Error::OutcomeUnknown { reason, .. }) => {
            println!("   -> outcome unknown ({reason})");
        }
        other => println!("   -> unexpected: {other:?}"),
    }
    println!("   emails really sent so far: {}", fake.ledger().len());

    println!("2. the client retries with the same idempotency key");
    let retry = idem.call(request()?, &resend).await?;
    println!(
        "   -> {} {}",
        retry.response().status(),
        String::from_utf8_lossy(retry.response().body())
    );

    println!("3. and once more");
    let again = idem.call(request()?, &resend).await?;
    println!(
        "   -> replayed by idemflow: {}, same answer: {}",
        again.is_replay(),
        again.response() == retry.response()
    );

    let keys: Vec<String> = fake
        .requests()
        .iter()
        .filter_map(|r| r.header("idempotency-key").map(str::to_owned))
        .collect();
    let same = keys.windows(2).all(|w| w[0] == w[1]);
    println!(
        "requests to Resend: {}, Idempotency-Key the same on each: {same} ({})",
        keys.len(),
        keys.first().map(String::as_str).unwrap_or("-")
    );
    println!("emails really sent: {}", fake.ledger().len());
    assert_eq!(fake.ledger().len(), 1);
    Ok(())
}
