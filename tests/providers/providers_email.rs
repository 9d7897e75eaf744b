//! The Resend and Postmark adapters against their fakes (and wiremock for exact requests).

use std::time::Duration;

use chrono::Utc;
use idemflow::provider::http::HttpConfig;
use idemflow::provider::{Postmark, Provider, Resend};
use idemflow::testkit::{FakePostmark, FakeResend};
use idemflow::{
    Outcome, key::IdempotencyKey, key::Scope, provider::CallReply, provider::KeySpec,
    provider::Lookup,
};
use serde_json::{Value, json};
use wiremock::matchers::{header, method, path, query_param};
use wiremock::{Mock, MockServer, ResponseTemplate};

fn fast(max_attempts: u32) -> HttpConfig {
    HttpConfig {
        request_timeout: Duration::from_secs(2),
        max_attempts,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        max_retry_after: Duration::from_secs(2),
        ..HttpConfig::default()
    }
}

fn resend(base: &str, attempts: u32) -> Resend {
    Resend::with_base_url(base, FakeResend::API_KEY)
        .unwrap()
        .http_config(fast(attempts))
        .unwrap()
}

fn postmark(base: &str, attempts: u32) -> Postmark {
    Postmark::with_base_url(base, FakePostmark::API_KEY)
        .unwrap()
        .http_config(fast(attempts))
        .unwrap()
}

fn email() -> Value {
    json!({"from": "shop@example.test", "to": ["ada@example.test"], "subject": "Receipt", "text": "Thanks"})
}

fn pm_email() -> Value {
    json!({"From": "shop@example.test", "To": "ada@example.test", "Subject": "Receipt", "TextBody": "Thanks"})
}

// ---- Resend ---------------------------------------------------------------------------------

#[tokio::test]
async fn resend_sends_json_body_with_key_header() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/emails"))
        .and(header("idempotency-key", "idf_r1"))
        .and(header("authorization", "Bearer re_test_idemflow_fake"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"id": "e1"})))
        .expect(1)
        .mount(&server)
        .await;
    let out = resend(&server.uri(), 1).send("idf_r1", &email()).await;
    assert!(
        matches!(
            out,
            CallReply::Succeeded {
                replayed: false,
                ..
            }
        ),
        "{out:?}"
    );
    let reqs = server.received_requests().await.unwrap();
    let sent: Value = serde_json::from_slice(&reqs[0].body).unwrap();
    assert_eq!(sent, email());
}

#[tokio::test]
async fn resend_lost_response_then_retry_sends_once_with_the_same_key() {
    let fake = FakeResend::start().await.unwrap();
    fake.faults().lose_next_response();
    let out = resend(fake.base_url(), 3).send("idf_lost", &email()).await;
    let CallReply::Succeeded { response, .. } = out else {
        panic!("{out:?}")
    };
    assert_eq!(fake.ledger().len(), 1);
    let id = response.body_json::<Value>().unwrap()["id"].clone();
    assert_eq!(id, fake.ledger().entries()[0].id.as_str());
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    assert!(
        reqs.iter()
            .all(|r| r.header("idempotency-key") == Some("idf_lost"))
    );
}

#[tokio::test]
async fn resend_errors_map_to_outcomes() {
    let fake = FakeResend::start().await.unwrap();
    let r = resend(fake.base_url(), 1);
    assert!(matches!(
        r.send("idf_a", &email()).await,
        CallReply::Succeeded { .. }
    ));
    // Same key, other payload: 409 invalid_idempotent_request.
    let other = json!({"from": "shop@example.test", "to": ["bob@example.test"], "subject": "Hi", "text": "x"});
    assert!(matches!(
        r.send("idf_a", &other).await,
        CallReply::KeyConflict { .. }
    ));
    // Malformed key: 400 invalid_idempotency_key -> Rejected (nothing sent).
    let long = "k".repeat(300);
    let out = r.send(&long, &email()).await;
    assert!(
        matches!(out, CallReply::Rejected { ref response } if response.status() == 400),
        "{out:?}"
    );
    // Validation: 422 -> Rejected.
    let out = r.send("idf_v", &json!({"from": "a@x.test"})).await;
    assert!(
        matches!(out, CallReply::Rejected { ref response } if response.status() == 422),
        "{out:?}"
    );
    // 429 -> Retryable with Retry-After.
    fake.faults().rate_limit_next(Duration::from_secs(1));
    let out = r.send("idf_429", &email()).await;
    assert!(
        matches!(out, CallReply::Retryable { retry_after: Some(d), .. } if d == Duration::from_secs(1)),
        "{out:?}"
    );
    // 5xx -> Unknown.
    fake.faults().server_error_next(500);
    assert!(matches!(
        r.send("idf_500", &email()).await,
        CallReply::Unknown { .. }
    ));
    // Wrong API key -> Retryable.
    let wrong = Resend::with_base_url(fake.base_url(), "re_wrong")
        .unwrap()
        .http_config(fast(1))
        .unwrap();
    assert!(matches!(
        wrong.send("idf_auth", &email()).await,
        CallReply::Retryable { .. }
    ));
    assert_eq!(fake.ledger().len(), 1, "only the first email was sent");
}

#[tokio::test]
async fn resend_concurrent_same_key_is_in_flight() {
    let fake = FakeResend::start().await.unwrap();
    fake.faults().set_latency(Duration::from_millis(400));
    let r = resend(fake.base_url(), 1);
    let r2 = r.clone();
    let first = tokio::spawn(async move { r2.send("idf_c", &email()).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(matches!(
        r.send("idf_c", &email()).await,
        CallReply::InFlight { .. }
    ));
    assert!(matches!(first.await.unwrap(), CallReply::Succeeded { .. }));
    assert_eq!(fake.ledger().len(), 1);
}

#[tokio::test]
async fn resend_lookup_is_a_same_key_resend_inside_the_window() {
    let fake = FakeResend::start().await.unwrap();
    fake.faults().lose_next_response();
    let r = resend(fake.base_url(), 1);
    assert!(matches!(
        r.send("idf_l", &email()).await,
        CallReply::Unknown { .. }
    ));
    let Lookup::Found(Outcome::Succeeded(resp)) = r
        .lookup(
            "idf_l",
            &email(),
            idemflow::provider::Attempts::once(Utc::now()),
            Utc::now(),
        )
        .await
    else {
        panic!("not found")
    };
    assert_eq!(
        resp.body_json::<Value>().unwrap()["id"],
        fake.ledger().entries()[0].id.as_str()
    );
    assert_eq!(fake.ledger().len(), 1);
    // Past Resend's 24 h window a re-send could send twice, and Resend cannot be searched by
    // our key: nothing sent, the key needs an operator (it deferred forever as `Unknown`).
    let old = Utc::now() - chrono::Duration::hours(24);
    let past = r
        .lookup(
            "idf_l",
            &email(),
            idemflow::provider::Attempts::once(old),
            chrono::Utc::now(),
        )
        .await;
    assert!(matches!(past, Lookup::NeedsOperator { .. }), "{past:?}");
    assert_eq!(fake.requests().len(), 2);
}

#[tokio::test]
async fn resend_lookup_judges_the_window_from_the_first_send_not_the_latest_attempt() {
    // First sent 25 h ago, past Resend's 24 h key window; a takeover attempted again 10 min
    // ago. The window counts from the first send: Resend may have forgotten the key, so a
    // re-send could send a second email. Judged from the latest attempt, it re-sent.
    let fake = FakeResend::start().await.unwrap();
    let r = resend(fake.base_url(), 1);
    let now = Utc::now();
    let attempts = idemflow::provider::Attempts::new(
        now - chrono::Duration::hours(25),
        now - chrono::Duration::minutes(10),
    );
    let found = r.lookup("idf_w", &email(), attempts, now).await;
    assert_eq!(fake.requests().len(), 0, "{found:?}");
    assert!(matches!(found, Lookup::NeedsOperator { .. }), "{found:?}");
}

#[tokio::test]
async fn resend_lookup_keeps_the_sweepers_redrive_margin() {
    // 23 h 30 min after the first send: inside Resend's 24 h window, but within the sweeper's
    // default re-drive margin (1 h) of its end. The sweeper chose a lookup because a re-send is
    // no longer safe; the lookup must not re-send either (it did, keeping only 15 min).
    let fake = FakeResend::start().await.unwrap();
    let r = resend(fake.base_url(), 1);
    let sent_at = Utc::now() - chrono::Duration::minutes(23 * 60 + 30);
    let found = r
        .lookup(
            "idf_m",
            &email(),
            idemflow::provider::Attempts::once(sent_at),
            Utc::now(),
        )
        .await;
    assert_eq!(fake.requests().len(), 0, "{found:?}");
    assert!(matches!(found, Lookup::NeedsOperator { .. }), "{found:?}");
    // The adapter's margin is the sweeper's default, and still its own setting.
    assert_eq!(
        idemflow::provider::resend::DEFAULT_REDRIVE_MARGIN,
        idemflow::provider::DEFAULT_REDRIVE_MARGIN
    );
    let found = r
        .redrive_margin(Duration::from_secs(15 * 60))
        .lookup(
            "idf_m",
            &email(),
            idemflow::provider::Attempts::once(sent_at),
            Utc::now(),
        )
        .await;
    assert!(matches!(found, Lookup::Found(_)), "{found:?}");
    assert_eq!(fake.ledger().len(), 1);
}

#[tokio::test]
async fn resend_lookup_of_a_key_held_for_another_payload_needs_an_operator() {
    // Waiting does not change a key conflict: an operator, not a deferral forever.
    let fake = FakeResend::start().await.unwrap();
    let r = resend(fake.base_url(), 1);
    assert!(matches!(
        r.send("idf_c", &email()).await,
        CallReply::Succeeded { .. }
    ));
    let other = json!({"from": "shop@example.test", "to": ["bob@example.test"], "subject": "Receipt", "text": "Thanks"});
    let found = r
        .lookup(
            "idf_c",
            &other,
            idemflow::provider::Attempts::once(Utc::now()),
            Utc::now(),
        )
        .await;
    assert!(matches!(found, Lookup::NeedsOperator { .. }), "{found:?}");
    assert_eq!(fake.ledger().len(), 1);
}

#[tokio::test]
async fn resend_lookup_without_the_stored_request_sends_nothing() {
    // The sweeper passes `Null` when the request was not stored: re-sending `null` drew a 400
    // that was read as a permanent refusal of the email.
    let fake = FakeResend::start().await.unwrap();
    let r = resend(fake.base_url(), 1);
    let found = r
        .lookup(
            "idf_n",
            &Value::Null,
            idemflow::provider::Attempts::once(Utc::now()),
            Utc::now(),
        )
        .await;
    assert_eq!(fake.requests().len(), 0, "{found:?}");
    assert!(matches!(found, Lookup::NeedsOperator { .. }), "{found:?}");
}

// ---- Postmark -------------------------------------------------------------------------------

#[tokio::test]
async fn postmark_puts_our_key_in_metadata_and_searches_by_it() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/email"))
        .and(header("x-postmark-server-token", "pm_test_idemflow_fake"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"MessageID": "m1", "ErrorCode": 0, "Message": "OK"})),
        )
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("GET"))
        .and(path("/messages/outbound"))
        .and(query_param("metadata_idemflow_key", "idf_p1"))
        .and(query_param("offset", "0"))
        .respond_with(
            ResponseTemplate::new(200).set_body_json(json!({"TotalCount": 0, "Messages": []})),
        )
        .expect(1)
        .mount(&server)
        .await;
    let p = postmark(&server.uri(), 1);
    assert!(matches!(
        p.send("idf_p1", &pm_email()).await,
        CallReply::Succeeded { .. }
    ));
    let reqs = server.received_requests().await.unwrap();
    let sent: Value = serde_json::from_slice(&reqs[0].body).unwrap();
    assert_eq!(sent["Metadata"]["idemflow_key"], "idf_p1");
    assert_eq!(sent["Subject"], "Receipt");
    assert!(reqs[0].headers.get("idempotency-key").is_none());
    let recent = p
        .lookup(
            "idf_p1",
            &pm_email(),
            idemflow::provider::Attempts::once(Utc::now()),
            Utc::now(),
        )
        .await;
    assert_eq!(
        recent,
        Lookup::NotFound {
            authoritative: false
        }
    );
}

#[tokio::test]
async fn postmark_lost_response_is_never_resent_and_lookup_finds_it() {
    let fake = FakePostmark::start().await.unwrap();
    fake.faults().lose_next_response();
    let p = postmark(fake.base_url(), 3);
    let sent_at = Utc::now();
    let out = p.send("idf_pl", &pm_email()).await;
    assert!(matches!(out, CallReply::Unknown { .. }), "{out:?}");
    assert_eq!(
        fake.requests().len(),
        1,
        "no key: an unknown outcome is never re-sent"
    );
    let Lookup::Found(Outcome::Succeeded(resp)) = p
        .lookup(
            "idf_pl",
            &pm_email(),
            idemflow::provider::Attempts::once(sent_at),
            chrono::Utc::now(),
        )
        .await
    else {
        panic!("not found")
    };
    let body: Value = resp.body_json().unwrap();
    assert_eq!(body["MessageID"], fake.ledger().entries()[0].id.as_str());
    assert_eq!(fake.ledger().count_for_key("idf_pl"), 1);
    // The spec forbids re-driving.
    let spec = p.key_spec();
    assert!(!spec.may_redrive(sent_at, Utc::now(), Duration::ZERO));
}

#[tokio::test]
async fn postmark_errors_map_to_outcomes() {
    let fake = FakePostmark::start().await.unwrap();
    let p = postmark(fake.base_url(), 1);
    let out = p.send("idf_300", &json!({"To": "ada@example.test"})).await;
    let CallReply::Rejected { response } = out else {
        panic!("{out:?}")
    };
    assert_eq!(response.body_json::<Value>().unwrap()["ErrorCode"], 300);
    let inactive = json!({"From": "shop@example.test", "To": "inactive@example.test", "Subject": "x", "TextBody": "x"});
    let CallReply::Rejected { response } = p.send("idf_406", &inactive).await else {
        panic!()
    };
    assert_eq!(response.body_json::<Value>().unwrap()["ErrorCode"], 406);
    fake.faults().rate_limit_next(Duration::from_secs(1));
    assert!(matches!(
        p.send("idf_429", &pm_email()).await,
        CallReply::Retryable {
            retry_after: Some(_),
            ..
        }
    ));
    fake.faults().server_error_next(500);
    assert!(matches!(
        p.send("idf_500", &pm_email()).await,
        CallReply::Unknown { .. }
    ));
    let wrong = Postmark::with_base_url(fake.base_url(), "nope")
        .unwrap()
        .http_config(fast(1))
        .unwrap();
    assert!(matches!(
        wrong.send("idf_401", &pm_email()).await,
        CallReply::Retryable { .. }
    ));
    assert!(fake.ledger().is_empty());
}

#[tokio::test]
async fn postmark_retries_only_what_surely_did_nothing() {
    let fake = FakePostmark::start().await.unwrap();
    fake.faults().rate_limit_next(Duration::from_millis(10));
    let p = postmark(fake.base_url(), 3);
    assert!(matches!(
        p.send("idf_rl", &pm_email()).await,
        CallReply::Succeeded { .. }
    ));
    assert_eq!(fake.requests().len(), 2);
    assert_eq!(fake.ledger().count_for_key("idf_rl"), 1);
}

#[tokio::test]
async fn postmark_search_lag_and_authority() {
    let fake = FakePostmark::start().await.unwrap();
    fake.faults().set_search_lag(Duration::from_millis(300));
    let p = postmark(fake.base_url(), 1).search_lag(Duration::from_secs(60));
    let now = Utc::now();
    assert!(matches!(
        p.send("idf_s", &pm_email()).await,
        CallReply::Succeeded { .. }
    ));
    assert_eq!(
        p.lookup(
            "idf_s",
            &pm_email(),
            idemflow::provider::Attempts::once(now),
            chrono::Utc::now()
        )
        .await,
        Lookup::NotFound {
            authoritative: false
        }
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(matches!(
        p.lookup(
            "idf_s",
            &pm_email(),
            idemflow::provider::Attempts::once(now),
            chrono::Utc::now()
        )
        .await,
        Lookup::Found(_)
    ));
    let old = Utc::now() - chrono::Duration::minutes(10);
    assert_eq!(
        p.lookup(
            "idf_none",
            &pm_email(),
            idemflow::provider::Attempts::once(old),
            chrono::Utc::now()
        )
        .await,
        Lookup::NotFound {
            authoritative: true
        }
    );
    // Beyond Postmark's 45-day retention an absence proves nothing.
    let ancient = Utc::now() - chrono::Duration::days(46);
    assert_eq!(
        p.lookup(
            "idf_none",
            &pm_email(),
            idemflow::provider::Attempts::once(ancient),
            chrono::Utc::now()
        )
        .await,
        Lookup::NotFound {
            authoritative: false
        }
    );
}

#[tokio::test]
async fn email_long_keys_are_derived_to_fit_and_stay_stable() {
    let fake = FakePostmark::start().await.unwrap();
    let p = postmark(fake.base_url(), 1);
    let scope = Scope::new("tenant-9").unwrap();
    let long = IdempotencyKey::new("x".repeat(255)).unwrap();
    let spec: KeySpec = p.key_spec();
    let k = spec.derive(&scope, &long, "email.send");
    assert!(
        k.len() <= 80,
        "Postmark metadata values are at most 80 characters"
    );
    assert_eq!(k, spec.derive(&scope, &long, "email.send"));
    p.send(&k, &pm_email()).await;
    assert_eq!(
        fake.ledger().entries()[0].metadata_key.as_deref(),
        Some(k.as_str())
    );
    let rs = resend("http://127.0.0.1:9", 1).key_spec();
    let rk = rs.derive(&scope, &long, "email.send");
    assert!(rk.len() <= 256);
    assert_eq!(rk, rs.derive(&scope, &long, "email.send"));
}
