//! The email service example over a real socket, against the testkit fake Resend: an email is
//! sent once despite a lost response and client retries, replays are marked, another account's
//! same key is another email, and invalid input is refused without being stored.

#[path = "../../examples/email_service.rs"]
mod example;

use std::sync::Arc;
use std::time::Duration;

use idemflow::Idempotency;
use idemflow::provider::Resend;
use idemflow::provider::http::HttpConfig;
use idemflow::testkit::FakeResend;
use serde_json::{Value, json};

async fn start(fake: &FakeResend) -> String {
    let store = idemflow::store::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let resend = Resend::with_base_url(fake.base_url(), FakeResend::API_KEY)
        .unwrap()
        .http_config(HttpConfig {
            request_timeout: Duration::from_secs(2),
            ..HttpConfig::default()
        })
        .unwrap();
    let app = example::router(Idempotency::new(store), Arc::new(resend));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    base
}

async fn send(base: &str, key: &str, account: &str, body: &Value) -> (u16, bool, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{base}/emails"))
        .header("idempotency-key", key)
        .header("x-account-id", account)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let replayed = resp.headers().get("idempotent-replayed").is_some();
    let body = resp.json().await.unwrap_or(Value::Null);
    (status, replayed, body)
}

fn welcome() -> Value {
    json!({"from": "shop@example.com", "to": ["ana@example.org"], "subject": "Hi", "text": "Welcome"})
}

#[tokio::test]
async fn an_email_is_sent_once_despite_a_lost_response_and_retries() {
    let fake = FakeResend::start().await.unwrap();
    let base = start(&fake).await;
    fake.faults().lose_next_response();
    let (status, replayed, first) = send(&base, "\"welcome-1\"", "acct_1", &welcome()).await;
    assert_eq!(status, 201, "{first}");
    assert!(!replayed);
    for _ in 0..3 {
        let (status, replayed, again) = send(&base, "welcome-1", "acct_1", &welcome()).await;
        assert_eq!((status, replayed), (201, true), "{again}");
        assert_eq!(again, first, "the replay is the first answer");
    }
    assert_eq!(
        fake.ledger().len(),
        1,
        "one email, despite the lost response and 3 retries"
    );

    // The same key under another account is another email.
    let (status, _, other) = send(&base, "welcome-1", "acct_2", &welcome()).await;
    assert_eq!(status, 201);
    assert_ne!(other["provider_id"], first["provider_id"]);
    assert_eq!(fake.ledger().len(), 2);

    // The same key with another body is refused.
    let mut changed = welcome();
    changed["subject"] = json!("Hello");
    let (status, _, problem) = send(&base, "welcome-1", "acct_1", &changed).await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(fake.ledger().len(), 2);
}

#[tokio::test]
async fn invalid_input_names_the_field_and_is_not_stored() {
    let fake = FakeResend::start().await.unwrap();
    let base = start(&fake).await;
    let (status, _, problem) = send(
        &base,
        "bad-1",
        "acct_1",
        &json!({"from": "shop@example.com", "subject": "x"}),
    )
    .await;
    assert_eq!(status, 400, "{problem}");
    assert!(problem.to_string().contains("to"), "{problem}");
    // Fixed, the same key is accepted: the refusal was not stored.
    let (status, replayed, _) = send(&base, "bad-1", "acct_1", &welcome()).await;
    assert_eq!((status, replayed), (201, false));
    assert_eq!(fake.ledger().len(), 1);
}
