//! The Stripe adapter against the fake Stripe and, where the exact request matters, wiremock.

use std::time::Duration;

use chrono::Utc;
use idemflow::provider::http::HttpConfig;
use idemflow::provider::{Provider, Stripe};
use idemflow::testkit::FakeStripe;
use idemflow::{Outcome, key::IdempotencyKey, key::Scope, provider::CallReply, provider::Lookup};
use serde_json::{Value, json};
use wiremock::matchers::{header, method, path};
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

fn stripe(base: &str, attempts: u32) -> Stripe {
    Stripe::with_base_url(base, FakeStripe::API_KEY)
        .unwrap()
        .http_config(fast(attempts))
        .unwrap()
}

fn charge() -> Value {
    json!({"amount": 500, "currency": "usd", "customer": "cus_1",
           "payment_method": "pm_card_visa", "metadata": {"order": "7"}})
}

fn form(body: &[u8]) -> Vec<(String, String)> {
    let text = String::from_utf8_lossy(body).into_owned();
    let mut out = Vec::new();
    for pair in text.split('&') {
        let (k, v) = pair.split_once('=').unwrap();
        let dec = |s: &str| {
            let s = s.replace('+', " ");
            let mut bytes = Vec::new();
            let mut it = s.bytes();
            while let Some(b) = it.next() {
                if b == b'%' {
                    let h = [it.next().unwrap(), it.next().unwrap()];
                    bytes.push(u8::from_str_radix(std::str::from_utf8(&h).unwrap(), 16).unwrap());
                } else {
                    bytes.push(b);
                }
            }
            String::from_utf8(bytes).unwrap()
        };
        out.push((dec(k), dec(v)));
    }
    out
}

#[tokio::test]
async fn stripe_sends_exact_form_fields_and_key_header() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/payment_intents"))
        .and(header("idempotency-key", "idf_k1"))
        .and(header("authorization", "Bearer sk_test_idemflow_fake"))
        .and(header("content-type", "application/x-www-form-urlencoded"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"id": "pi_1", "status": "succeeded"}))
                .insert_header("request-id", "req_1"),
        )
        .expect(1)
        .mount(&server)
        .await;
    let out = stripe(&server.uri(), 1).send("idf_k1", &charge()).await;
    let CallReply::Succeeded { response, replayed } = out else {
        panic!("{out:?}")
    };
    assert!(!replayed);
    assert_eq!(response.status(), 200);
    // Stripe's own headers are not part of the answer idemflow stores and replays.
    assert_eq!(
        response.headers(),
        [("content-type".to_owned(), "application/json".to_owned())]
    );
    let reqs = server.received_requests().await.unwrap();
    assert_eq!(
        form(&reqs[0].body),
        vec![
            ("amount".into(), "500".into()),
            ("currency".into(), "usd".into()),
            ("customer".into(), "cus_1".into()),
            ("metadata[order]".into(), "7".into()),
            ("payment_method".into(), "pm_card_visa".into()),
            ("confirm".into(), "true".into()),
            ("metadata[idemflow_key]".into(), "idf_k1".into()),
        ]
    );
}

#[tokio::test]
async fn stripe_retries_keep_the_same_key_and_params() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(500).set_body_json(json!({"error": {"type": "api_error"}})),
        )
        .up_to_n_times(2)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"id": "pi_1"}))
                .insert_header("idempotent-replayed", "true"),
        )
        .mount(&server)
        .await;
    let out = stripe(&server.uri(), 3).send("idf_same", &charge()).await;
    assert!(
        matches!(out, CallReply::Succeeded { replayed: true, .. }),
        "{out:?}"
    );
    let reqs = server.received_requests().await.unwrap();
    assert_eq!(reqs.len(), 3);
    for r in &reqs {
        assert_eq!(r.headers.get("idempotency-key").unwrap(), "idf_same");
        assert_eq!(r.body, reqs[0].body);
    }
}

#[tokio::test]
async fn stripe_should_retry_header_is_honoured() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(503)
                .insert_header("stripe-should-retry", "true")
                .set_body_json(json!({"error": {"type": "api_error"}})),
        )
        .mount(&server)
        .await;
    let out = stripe(&server.uri(), 1).send("idf_sr", &charge()).await;
    assert!(matches!(out, CallReply::Retryable { .. }), "{out:?}");

    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(500)
                .insert_header("stripe-should-retry", "false")
                .set_body_json(json!({"error": {"type": "api_error"}})),
        )
        .mount(&server)
        .await;
    let out = stripe(&server.uri(), 3).send("idf_sr", &charge()).await;
    assert!(matches!(out, CallReply::Unknown { .. }), "{out:?}");
    assert_eq!(
        server.received_requests().await.unwrap().len(),
        1,
        "no retry after should-retry: false"
    );
}

#[tokio::test]
async fn stripe_status_mapping_from_wiremock() {
    let cases: Vec<(u16, Value, &str)> = vec![
        (
            401,
            json!({"error": {"type": "invalid_request_error"}}),
            "retryable",
        ),
        (
            400,
            json!({"error": {"type": "invalid_request_error", "code": "parameter_missing"}}),
            "rejected",
        ),
        (
            404,
            json!({"error": {"type": "invalid_request_error", "code": "resource_missing"}}),
            "rejected",
        ),
        (
            400,
            json!({"error": {"type": "idempotency_error", "message": "other params"}}),
            "conflict",
        ),
        (
            409,
            json!({"error": {"type": "invalid_request_error", "code": "idempotency_key_in_use"}}),
            "in_flight",
        ),
        (
            429,
            json!({"error": {"type": "invalid_request_error", "code": "lock_timeout"}}),
            "retryable",
        ),
        (502, json!({}), "unknown"),
    ];
    for (status, body, want) in cases {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .respond_with(
                ResponseTemplate::new(status)
                    .set_body_json(body)
                    .insert_header("retry-after", "1"),
            )
            .mount(&server)
            .await;
        let out = stripe(&server.uri(), 1).send("idf_map", &charge()).await;
        let got = match &out {
            CallReply::Retryable { .. } => "retryable",
            CallReply::Rejected { response } => {
                assert_eq!(response.status(), status);
                "rejected"
            }
            CallReply::KeyConflict { detail } => {
                assert_eq!(detail, "other params");
                "conflict"
            }
            CallReply::InFlight { retry_after } => {
                assert_eq!(*retry_after, Some(Duration::from_secs(1)));
                "in_flight"
            }
            CallReply::Unknown { .. } => "unknown",
            CallReply::Succeeded { .. } => "succeeded",
        };
        assert_eq!(got, want, "status {status}: {out:?}");
    }
}

#[tokio::test]
async fn stripe_lost_response_then_retry_charges_once() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().lose_next_response();
    let out = stripe(fake.base_url(), 3).send("idf_lost", &charge()).await;
    assert!(
        matches!(out, CallReply::Succeeded { replayed: true, .. }),
        "{out:?}"
    );
    assert_eq!(fake.ledger().len(), 1);
    assert_eq!(fake.ledger().count_for_key("idf_lost"), 1);
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    assert!(
        reqs.iter()
            .all(|r| r.header("idempotency-key") == Some("idf_lost"))
    );
    assert!(reqs.iter().all(|r| r.body == reqs[0].body));
    // The metadata carries the same key, so search finds the charge.
    assert_eq!(
        fake.ledger().entries()[0].metadata_key.as_deref(),
        Some("idf_lost")
    );
}

/// Stripe's `Idempotent-Replayed` and `Request-Id` headers never reach an answer idemflow keeps:
/// not the adapter's own retry after a lost response (Stripe replayed, but that is not
/// idemflow's replay), and not the answer the sweeper records after a same-key re-drive.
#[tokio::test]
async fn stripe_answers_carry_none_of_stripes_own_headers() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().lose_next_response();
    let out = stripe(fake.base_url(), 3).send("idf_hdr", &charge()).await;
    let CallReply::Succeeded { response, replayed } = out else {
        panic!("{out:?}")
    };
    assert!(replayed, "Stripe replayed its answer to the retry");
    let only_content_type = [("content-type".to_owned(), "application/json".to_owned())];
    assert_eq!(response.headers(), only_content_type);

    #[cfg(feature = "sqlite")]
    {
        use std::sync::Arc;

        use idemflow::store::sqlite::SqliteStore;
        use idemflow::{Idempotency, IdempotentRequest, KeyState, Providers, Store, Sweeper};

        let sqlite = SqliteStore::connect("sqlite::memory:").await.unwrap();
        sqlite.migrate().await.unwrap();
        let store: Arc<dyn Store> = Arc::new(sqlite);
        // Keeping every header the operation answers shows what the adapter itself keeps.
        let idem = Idempotency::new(store.clone())
            .lease(Duration::from_millis(300))
            .stored_headers(None);
        let s = Arc::new(stripe(fake.base_url(), 1));
        let req = || IdempotentRequest::new("shop", "k-hdr", "payments.create", &charge()).unwrap();
        fake.faults().lose_next_response();
        assert!(idem.call(req(), s.as_ref()).await.is_err());
        tokio::time::sleep(Duration::from_millis(350)).await;
        let report = Sweeper::new(store.clone(), Providers::new().with(s.clone()))
            .run_once()
            .await
            .unwrap();
        assert_eq!(report.done, 1, "{report:?}");
        let row = store.get(req().id()).await.unwrap().unwrap();
        assert_eq!(row.state, KeyState::Done);
        assert_eq!(row.response.unwrap().headers(), only_content_type);
        let again = idem.call(req(), s.as_ref()).await.unwrap();
        assert!(again.is_replay());
        assert_eq!(again.response().headers(), only_content_type);
    }
}

#[tokio::test]
async fn stripe_lost_response_without_retry_is_unknown_then_retry_replays() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().lose_next_response();
    let s = stripe(fake.base_url(), 1);
    let first = s.send("idf_u", &charge()).await;
    assert!(matches!(first, CallReply::Unknown { .. }), "{first:?}");
    let again = s.send("idf_u", &charge()).await;
    assert!(
        matches!(again, CallReply::Succeeded { replayed: true, .. }),
        "{again:?}"
    );
    assert_eq!(fake.ledger().count_for_key("idf_u"), 1);
}

/// A decline whose answer was lost: the re-send gets Stripe's saved 402, which is the key's own
/// answer (Stripe saves the first run's result and answers 409 while it runs), so it ends the
/// call and, across a takeover, the key, as a permanent refusal.
#[tokio::test]
async fn a_stripe_decline_after_a_lost_answer_is_definitive() {
    let fake = FakeStripe::start().await.unwrap();
    let declined =
        json!({"amount": 500, "currency": "usd", "payment_method": FakeStripe::DECLINED_CARD});
    // Within one call: the retry loop's second attempt gets the saved decline.
    fake.faults().lose_next_response();
    let out = stripe(fake.base_url(), 3)
        .send("idf_lost_decline", &declined)
        .await;
    assert!(
        matches!(&out, CallReply::Rejected { response } if response.status() == 402),
        "{out:?}"
    );
    assert_eq!(fake.ledger().count_for_key("idf_lost_decline"), 1);

    #[cfg(feature = "sqlite")]
    {
        use std::sync::Arc;

        use idemflow::store::sqlite::SqliteStore;
        use idemflow::{Error, Idempotency, IdempotentRequest, KeyState, Store};

        // Across attempts: the first call's answer is lost, the client's retry takes the key
        // over and gets the saved decline.
        let sqlite = SqliteStore::connect("sqlite::memory:").await.unwrap();
        sqlite.migrate().await.unwrap();
        let store: Arc<dyn Store> = Arc::new(sqlite);
        let idem =
            Idempotency::new(store.clone()).retry_takeover_window(Some(Duration::from_secs(3600)));
        let s = stripe(fake.base_url(), 1);
        let req =
            || IdempotentRequest::new("shop", "k-decl", "payments.create", &declined).unwrap();
        fake.faults().lose_next_response();
        let first = idem.call(req(), &s).await;
        assert!(
            matches!(first, Err(Error::OutcomeUnknown { .. })),
            "{first:?}"
        );
        let again = idem.call(req(), &s).await;
        assert!(
            matches!(&again, Ok(e) if e.response().status() == 402),
            "the saved decline ends the key: {again:?}"
        );
        let row = store.get(req().id()).await.unwrap().unwrap();
        assert_eq!(row.state, KeyState::Failed { retryable: false });
    }
}

#[tokio::test]
async fn stripe_fake_errors_map_to_outcomes() {
    let fake = FakeStripe::start().await.unwrap();
    let s = stripe(fake.base_url(), 1);

    // Declined card: 402 card_error -> Rejected, and a same-key retry replays the decline.
    let declined =
        json!({"amount": 500, "currency": "usd", "payment_method": FakeStripe::DECLINED_CARD});
    let out = s.send("idf_decline", &declined).await;
    let CallReply::Rejected { response } = out else {
        panic!("{out:?}")
    };
    assert_eq!(response.status(), 402);
    let body: Value = response.body_json().unwrap();
    assert_eq!(body["error"]["type"], "card_error");
    assert!(matches!(
        s.send("idf_decline", &declined).await,
        CallReply::Rejected { .. }
    ));
    assert_eq!(fake.ledger().count_for_key("idf_decline"), 1);

    // Same key, other parameters -> KeyConflict.
    assert!(matches!(
        s.send("idf_decline", &charge()).await,
        CallReply::KeyConflict { .. }
    ));

    // 429 before anything -> Retryable with Retry-After.
    fake.faults().rate_limit_next(Duration::from_secs(2));
    let out = s.send("idf_429", &charge()).await;
    assert_eq!(
        out,
        CallReply::Retryable {
            reason: out_reason(&out),
            retry_after: Some(Duration::from_secs(2))
        }
    );
    // 5xx before executing -> Unknown (Stripe may have run it); nothing in the ledger.
    fake.faults().server_error_next(500);
    assert!(matches!(
        s.send("idf_500", &charge()).await,
        CallReply::Unknown { .. }
    ));
    assert_eq!(fake.ledger().count_for_key("idf_500"), 0);

    // Missing amount -> Rejected (validation; not saved, so a fixed retry could pass).
    let out = s.send("idf_bad", &json!({"currency": "usd"})).await;
    assert!(
        matches!(out, CallReply::Rejected { ref response } if response.status() == 400),
        "{out:?}"
    );

    // A wrong API key -> Retryable (nothing was done).
    let wrong = Stripe::with_base_url(fake.base_url(), "sk_wrong")
        .unwrap()
        .http_config(fast(1))
        .unwrap();
    assert!(matches!(
        wrong.send("idf_auth", &charge()).await,
        CallReply::Retryable { .. }
    ));
}

fn out_reason(o: &CallReply) -> String {
    match o {
        CallReply::Retryable { reason, .. } | CallReply::Unknown { reason } => reason.clone(),
        _ => String::new(),
    }
}

#[tokio::test]
async fn stripe_concurrent_same_key_is_in_flight() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().set_latency(Duration::from_millis(400));
    let s = stripe(fake.base_url(), 1);
    let s2 = s.clone();
    let first = tokio::spawn(async move { s2.send("idf_conc", &charge()).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = s.send("idf_conc", &charge()).await;
    assert!(matches!(second, CallReply::InFlight { .. }), "{second:?}");
    assert!(matches!(
        first.await.unwrap(),
        CallReply::Succeeded {
            replayed: false,
            ..
        }
    ));
    assert_eq!(fake.ledger().len(), 1);
}

#[tokio::test]
async fn stripe_timeout_after_send_is_unknown_and_connection_refused_is_retryable() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().hang_next_response();
    let s = Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
        .unwrap()
        .http_config(HttpConfig {
            request_timeout: Duration::from_millis(300),
            ..fast(1)
        })
        .unwrap();
    assert!(matches!(
        s.send("idf_hang", &charge()).await,
        CallReply::Unknown { .. }
    ));
    assert_eq!(
        fake.ledger().count_for_key("idf_hang"),
        1,
        "executed although unanswered"
    );

    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let closed = stripe(&format!("http://127.0.0.1:{port}"), 2);
    let out = closed.send("idf_refused", &charge()).await;
    assert!(matches!(out, CallReply::Retryable { .. }), "{out:?}");
}

#[tokio::test]
async fn stripe_lookup_respects_search_lag() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().set_search_lag(Duration::from_millis(300));
    let s = stripe(fake.base_url(), 1).search_lag(Duration::from_secs(60));
    let sent_at = Utc::now();
    assert!(matches!(
        s.send("idf_look", &charge()).await,
        CallReply::Succeeded { .. }
    ));
    // Not yet visible, and too early to trust an empty result.
    assert_eq!(
        s.lookup(
            "idf_look",
            &charge(),
            idemflow::provider::Attempts::once(sent_at),
            chrono::Utc::now()
        )
        .await,
        Lookup::NotFound {
            authoritative: false
        }
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let Lookup::Found(Outcome::Succeeded(resp)) = s
        .lookup(
            "idf_look",
            &charge(),
            idemflow::provider::Attempts::once(sent_at),
            chrono::Utc::now(),
        )
        .await
    else {
        panic!("not found")
    };
    let pi: Value = resp.body_json().unwrap();
    assert_eq!(pi["metadata"]["idemflow_key"], "idf_look");
    // Never sent, long ago: an authoritative absence.
    let long_ago = Utc::now() - chrono::Duration::minutes(5);
    assert_eq!(
        s.lookup(
            "idf_never",
            &charge(),
            idemflow::provider::Attempts::once(long_ago),
            chrono::Utc::now()
        )
        .await,
        Lookup::NotFound {
            authoritative: true
        }
    );
    // A decline is found as Rejected.
    let declined =
        json!({"amount": 500, "currency": "usd", "payment_method": FakeStripe::DECLINED_CARD});
    s.send("idf_look_d", &declined).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let found = s
        .lookup(
            "idf_look_d",
            &declined,
            idemflow::provider::Attempts::once(sent_at),
            chrono::Utc::now(),
        )
        .await;
    assert!(
        matches!(found, Lookup::Found(Outcome::Rejected(ref r)) if r.status() == 402),
        "{found:?}"
    );
    // Search unreachable (the fake has no search faults; a closed port stands in).
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let down = stripe(&format!("http://127.0.0.1:{port}"), 1);
    assert!(matches!(
        down.lookup(
            "idf_look",
            &charge(),
            idemflow::provider::Attempts::once(long_ago),
            chrono::Utc::now()
        )
        .await,
        Lookup::Unknown { .. }
    ));
}

#[tokio::test]
async fn stripe_long_keys_are_derived_to_fit_and_stay_stable() {
    let fake = FakeStripe::start().await.unwrap();
    let s = stripe(fake.base_url(), 1);
    let spec = s.key_spec();
    let scope = Scope::new("acct_1").unwrap();
    let long = IdempotencyKey::new("k".repeat(255)).unwrap();
    let a = spec.derive(&scope, &long, "payments.create");
    let b = spec.derive(&scope, &long, "payments.create");
    assert_eq!(a, b);
    assert!(a.len() <= spec.max_len);
    assert_ne!(
        a,
        spec.derive(
            &scope,
            &IdempotencyKey::new("k".repeat(254)).unwrap(),
            "payments.create"
        )
    );
    assert!(matches!(
        s.send(&a, &charge()).await,
        CallReply::Succeeded { .. }
    ));
    assert_eq!(
        fake.requests()[0].header("idempotency-key"),
        Some(a.as_str())
    );
    // Tighter limits still fit, deterministically.
    for max in [32, 36, 45, 64] {
        let k = idemflow::provider_key::derive(&scope, &long, "payments.create", max);
        assert!(k.len() <= max, "{max}: {k}");
        assert_eq!(
            k,
            idemflow::provider_key::derive(&scope, &long, "payments.create", max)
        );
    }
}

/// Issue 11, finding 6: a PaymentIntent found by search is replayed as a decline only when
/// Stripe recorded a payment error; one still waiting for a payment method ("confirm later in
/// the browser") or canceled after authorisation was created by the call and is replayed as
/// what Stripe holds (200 with the PaymentIntent), never as a synthetic card decline.
#[tokio::test]
async fn stripe_lookup_replays_a_decline_only_when_stripe_recorded_one() {
    let server = MockServer::start().await;
    let pi = |key: &str, status: &str, error: Value| {
        json!({"id": format!("pi_{key}"), "object": "payment_intent", "amount": 500,
               "currency": "usd", "status": status, "last_payment_error": error,
               "metadata": {"idemflow_key": key}})
    };
    let decline = json!({"type": "card_error", "code": "card_declined",
                         "message": "Your card was declined."});
    let cases = [
        (
            "idf_later",
            pi("idf_later", "requires_payment_method", Value::Null),
        ),
        ("idf_canceled", pi("idf_canceled", "canceled", Value::Null)),
        (
            "idf_declined",
            pi("idf_declined", "requires_payment_method", decline.clone()),
        ),
    ];
    for (key, intent) in &cases {
        Mock::given(method("GET"))
            .and(path("/v1/payment_intents/search"))
            .and(wiremock::matchers::query_param(
                "query",
                format!("metadata['idemflow_key']:'{key}'"),
            ))
            .respond_with(ResponseTemplate::new(200).set_body_json(
                json!({"object": "search_result", "has_more": false, "data": [intent]}),
            ))
            .mount(&server)
            .await;
    }
    let s = stripe(&server.uri(), 1);
    let long_ago = Utc::now() - chrono::Duration::minutes(5);
    for (key, intent) in &cases[..2] {
        let found = s
            .lookup(
                key,
                &charge(),
                idemflow::provider::Attempts::once(long_ago),
                Utc::now(),
            )
            .await;
        let Lookup::Found(Outcome::Succeeded(resp)) = &found else {
            panic!("{key}: replayed as {found:?}");
        };
        assert_eq!(resp.status(), 200, "{key}");
        assert_eq!(&resp.body_json::<Value>().unwrap(), intent, "{key}");
    }
    let found = s
        .lookup(
            "idf_declined",
            &charge(),
            idemflow::provider::Attempts::once(long_ago),
            Utc::now(),
        )
        .await;
    let Lookup::Found(Outcome::Rejected(resp)) = &found else {
        panic!("a recorded decline replayed as {found:?}");
    };
    assert_eq!(resp.status(), 402);
    let body: Value = resp.body_json().unwrap();
    assert_eq!(body["error"]["code"], "card_declined");
    assert_eq!(body["error"]["payment_intent"], cases[2].1);
}

/// Issue 11, finding 2: a 409 "request in progress" means a request with this key may be acting
/// (an earlier try of this very call, whose answer we lost); a later 429 cannot undo that. The
/// call's final outcome is `Unknown`, never `Retryable`.
#[tokio::test]
async fn stripe_409_then_429_is_unknown_not_retryable() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(409).set_body_json(
            json!({"error": {"type": "invalid_request_error", "code": "idempotency_key_in_use"}}),
        ))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(429).set_body_json(
            json!({"error": {"type": "invalid_request_error", "code": "rate_limit"}}),
        ))
        .mount(&server)
        .await;
    let out = stripe(&server.uri(), 2)
        .send("idf_409_429", &charge())
        .await;
    assert!(matches!(out, CallReply::Unknown { .. }), "{out:?}");
    assert_eq!(server.received_requests().await.unwrap().len(), 2);
}

/// `Stripe-Version` goes with every request the adapter makes, the call and the lookup's search
/// alike: the pinned default, or the version the adapter was built with.
#[tokio::test]
async fn stripe_version_is_pinned_on_every_request() {
    use idemflow::provider::stripe::API_VERSION;
    let fake = FakeStripe::start().await.unwrap();
    let long_ago = Utc::now() - chrono::Duration::minutes(5);
    for (adapter, expected) in [
        (stripe(fake.base_url(), 1), API_VERSION),
        (
            stripe(fake.base_url(), 1)
                .api_version("2024-06-20")
                .unwrap(),
            "2024-06-20",
        ),
    ] {
        let before = fake.requests().len();
        assert!(matches!(
            adapter.send(&format!("idf_v_{expected}"), &charge()).await,
            CallReply::Succeeded { .. }
        ));
        let found = adapter
            .lookup(
                &format!("idf_v_{expected}"),
                &charge(),
                idemflow::provider::Attempts::once(long_ago),
                Utc::now(),
            )
            .await;
        assert!(
            matches!(found, Lookup::Found(_) | Lookup::NotFound { .. }),
            "{found:?}"
        );
        let sent = &fake.requests()[before..];
        assert!(sent.len() >= 2, "a call and a search: {}", sent.len());
        for r in sent {
            let versions: Vec<_> = r
                .headers
                .iter()
                .filter(|(n, _)| n == "stripe-version")
                .map(|(_, v)| v.as_str())
                .collect();
            assert_eq!(versions, [expected], "{} {}", r.method, r.path);
        }
    }
    // A version that cannot travel in a header is refused when the adapter is built.
    let bad = stripe(fake.base_url(), 1).api_version("2024\n06");
    assert!(matches!(
        bad,
        Err(idemflow::provider::http::HttpError::InvalidHeader { .. })
    ));
}

/// Connect: `stripe_account` in the request is sent as `Stripe-Account` on the create (never as a
/// form field) and on the search; the same key on two accounts is two PaymentIntents, and each
/// account's search finds only its own.
#[tokio::test]
async fn stripe_account_is_a_header_on_the_create_and_the_search() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().set_search_lag(Duration::ZERO);
    let s = stripe(fake.base_url(), 1);
    let on = |acct: &str| {
        let mut r = charge();
        r["stripe_account"] = json!(acct);
        r
    };
    let (a, b) = (on("acct_1A"), on("acct_2B"));
    let first = s.send("idf_connect", &a).await;
    assert!(matches!(first, CallReply::Succeeded { .. }), "{first:?}");
    let sent = &fake.requests()[0];
    assert_eq!(sent.header("stripe-account"), Some("acct_1A"));
    assert!(
        !form(sent.body_text().as_bytes())
            .iter()
            .any(|(k, _)| k.contains("stripe_account")),
        "not a form field: {}",
        sent.body_text()
    );
    // Stripe keeps a connected account's keys apart: the same key elsewhere is a new payment.
    assert!(matches!(
        s.send("idf_connect", &b).await,
        CallReply::Succeeded {
            replayed: false,
            ..
        }
    ));
    let again = s.send("idf_connect", &a).await;
    assert!(
        matches!(again, CallReply::Succeeded { replayed: true, .. }),
        "{again:?}"
    );
    let effects = fake.ledger().entries();
    assert_eq!(effects.len(), 2);
    assert_eq!(effects[0].request["Stripe-Account"], "acct_1A");
    assert_eq!(effects[1].request["Stripe-Account"], "acct_2B");
    let now = Utc::now() + chrono::Duration::seconds(120);
    let attempts = idemflow::provider::Attempts::once(Utc::now());
    let found = |l: Lookup| match l {
        Lookup::Found(Outcome::Succeeded(r)) => {
            serde_json::from_slice::<Value>(r.body()).unwrap()["id"].clone()
        }
        other => panic!("{other:?}"),
    };
    let in_a = found(s.lookup("idf_connect", &a, attempts, now).await);
    let in_b = found(s.lookup("idf_connect", &b, attempts, now).await);
    assert_eq!(in_a, effects[0].id.as_str());
    assert_eq!(in_b, effects[1].id.as_str());
    // The platform's own search does not see the connected accounts' PaymentIntents.
    assert!(matches!(
        s.lookup("idf_connect", &charge(), attempts, now).await,
        Lookup::NotFound { .. }
    ));
}

/// A `stripe_account` that is not an account id is refused before anything is sent.
#[tokio::test]
async fn a_bad_stripe_account_is_refused_unsent() {
    let fake = FakeStripe::start().await.unwrap();
    let s = stripe(fake.base_url(), 1);
    for bad in [
        json!("cus_123"),
        json!("acct_"),
        json!("acct_1\nX"),
        json!(7),
    ] {
        let mut r = charge();
        r["stripe_account"] = bad.clone();
        let out = s.send("idf_bad_acct", &r).await;
        let CallReply::Rejected { response } = &out else {
            panic!("{bad}: {out:?}")
        };
        assert_eq!(response.status(), 400, "{bad}");
        assert!(
            String::from_utf8_lossy(response.body()).contains("stripe_account"),
            "{bad}: the answer names the member"
        );
    }
    assert!(fake.requests().is_empty(), "nothing was sent");
}
