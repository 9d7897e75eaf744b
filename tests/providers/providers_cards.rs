//! The Adyen, Square and PayPal adapters against their fakes (and wiremock for the status
//! tables): the same key on every attempt, a lost response then a retry is one effect, every
//! error class mapped, and each one's recovery path (Adyen: replay inside the window; Square:
//! void by key; PayPal: a same-id re-send returns the order's current state).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use idemflow::provider::http::HttpConfig;
use idemflow::provider::{Adyen, PayPal, Provider, Square, VoidReply};
use idemflow::testkit::{FakeAdyen, FakePayPal, FakeSquare};
use idemflow::{
    Outcome, key::IdempotencyKey, key::Scope, provider::Attempts, provider::CallReply,
    provider::Lookup,
};
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

fn adyen(base: &str, attempts: u32) -> Adyen {
    Adyen::with_base_url(base, FakeAdyen::API_KEY)
        .unwrap()
        .http_config(fast(attempts))
        .unwrap()
}

fn square(base: &str, attempts: u32) -> Square {
    Square::with_base_url(base, FakeSquare::API_KEY)
        .unwrap()
        .http_config(fast(attempts))
        .unwrap()
        // The sweeps here run at least a lease after the last attempt.
        .processing_window(Duration::from_millis(20))
}

fn paypal(base: &str, attempts: u32) -> PayPal {
    PayPal::with_base_url(base, FakePayPal::API_KEY)
        .unwrap()
        .http_config(fast(attempts))
        .unwrap()
}

fn adyen_payment() -> Value {
    json!({
        "amount": {"currency": "EUR", "value": 1500},
        "reference": "order-7",
        "merchantAccount": "ShopECOM",
        "paymentMethod": {"type": "scheme", "number": "4111111111111111"}
    })
}

fn square_payment() -> Value {
    json!({"source_id": "cnon:card-nonce-ok", "amount_money": {"amount": 1500, "currency": "USD"}})
}

fn paypal_order() -> Value {
    json!({
        "intent": "CAPTURE",
        "purchase_units": [{"reference_id": "order-7", "amount": {"currency_code": "USD", "value": "15.00"}}]
    })
}

fn kind(out: &CallReply) -> &'static str {
    match out {
        CallReply::Succeeded { .. } => "succeeded",
        CallReply::Rejected { .. } => "rejected",
        CallReply::Retryable { .. } => "retryable",
        CallReply::InFlight { .. } => "in_flight",
        CallReply::KeyConflict { .. } => "conflict",
        CallReply::Unknown { .. } => "unknown",
    }
}

/// Answers every POST with `status` and `body`, and gives the adapter's outcome.
async fn mapped(status: u16, body: Value, call: impl AsyncFnOnce(&str) -> CallReply) -> CallReply {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(status)
                .set_body_json(body)
                .insert_header("retry-after", "1"),
        )
        .mount(&server)
        .await;
    call(&server.uri()).await
}

#[test]
fn derived_keys_fit_each_provider() {
    let scope = Scope::new("tenant-with-a-rather-long-name").unwrap();
    let key = IdempotencyKey::new("order-2026-11-30-000000000000000000000000007").unwrap();
    for (spec, max) in [
        (
            Adyen::with_base_url("http://127.0.0.1:1", "k")
                .unwrap()
                .key_spec(),
            64,
        ),
        (
            Square::with_base_url("http://127.0.0.1:1", "k")
                .unwrap()
                .key_spec(),
            45,
        ),
        (
            PayPal::with_base_url("http://127.0.0.1:1", "k")
                .unwrap()
                .key_spec(),
            108,
        ),
    ] {
        assert_eq!(spec.max_len, max);
        let k = spec.derive(&scope, &key, "payments.create");
        assert!(k.len() <= max, "{k}");
        assert_eq!(k, spec.derive(&scope, &key, "payments.create"));
    }
}

#[test]
fn adapters_hide_their_api_keys() {
    let secret = "sk_live_do_not_log_me";
    for shown in [
        format!(
            "{:?}",
            Adyen::with_base_url("http://127.0.0.1:1", secret).unwrap()
        ),
        format!(
            "{:?}",
            Square::with_base_url("http://127.0.0.1:1", secret).unwrap()
        ),
        format!(
            "{:?}",
            PayPal::with_base_url("http://127.0.0.1:1", secret).unwrap()
        ),
    ] {
        assert!(!shown.contains(secret), "{shown}");
    }
}

// ---- Adyen ----------------------------------------------------------------------------------

#[tokio::test]
async fn adyen_sends_the_same_key_header_and_body_on_every_attempt() {
    let fake = FakeAdyen::start().await.unwrap();
    fake.faults().server_error_next(503).server_error_next(500);
    let out = adyen(fake.base_url(), 3)
        .send("idf_adyen_1", &adyen_payment())
        .await;
    assert_eq!(kind(&out), "succeeded", "{out:?}");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 3);
    for r in &reqs {
        assert_eq!(r.path, "/v71/payments");
        assert_eq!(r.header("idempotency-key"), Some("idf_adyen_1"));
        assert_eq!(r.header("x-api-key"), Some(FakeAdyen::API_KEY));
        assert_eq!(
            serde_json::from_slice::<Value>(&r.body).unwrap(),
            adyen_payment()
        );
    }
    let entries = fake.ledger().entries();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].idempotency_key.as_deref(), Some("idf_adyen_1"));
}

#[tokio::test]
async fn adyen_lost_response_then_retry_is_one_payment() {
    let fake = FakeAdyen::start().await.unwrap();
    fake.faults().lose_next_response();
    let out = adyen(fake.base_url(), 3)
        .send("idf_adyen_lost", &adyen_payment())
        .await;
    let CallReply::Succeeded { response, .. } = out else {
        panic!("{out:?}")
    };
    let body: Value = response.body_json().unwrap();
    assert_eq!(body["resultCode"], "Authorised");
    assert_eq!(body["pspReference"], fake.ledger().entries()[0].id.as_str());
    // Adyen echoes the key header on every answer; it is not part of the answer kept.
    assert_eq!(response.header("idempotency-key"), None, "{response:?}");
    assert_eq!(fake.ledger().len(), 1);
    assert_eq!(fake.requests().len(), 2);
}

#[tokio::test]
async fn adyen_answers_map_to_outcomes() {
    let cases: Vec<(u16, Value, &str)> = vec![
        (
            200,
            json!({"pspReference": "P1", "resultCode": "Authorised"}),
            "succeeded",
        ),
        (
            200,
            json!({"pspReference": "P1", "resultCode": "Pending"}),
            "succeeded",
        ),
        (
            200,
            json!({"pspReference": "P1", "resultCode": "Refused", "refusalReason": "Refused"}),
            "rejected",
        ),
        (
            200,
            json!({"pspReference": "P1", "resultCode": "Error"}),
            "rejected",
        ),
        (
            401,
            json!({"status": 401, "errorCode": "000", "errorType": "security"}),
            "retryable",
        ),
        (
            403,
            json!({"status": 403, "errorCode": "010", "errorType": "security"}),
            "retryable",
        ),
        (
            422,
            json!({"status": 422, "errorCode": "14_0", "errorType": "validation"}),
            "rejected",
        ),
        (
            400,
            json!({"status": 400, "errorCode": "702", "errorType": "validation"}),
            "rejected",
        ),
        (
            409,
            json!({"status": 409, "errorCode": "000", "errorType": "validation"}),
            "in_flight",
        ),
        (
            429,
            json!({"status": 429, "errorCode": "000", "errorType": "validation"}),
            "retryable",
        ),
        (
            500,
            json!({"status": 500, "errorCode": "905", "errorType": "internal"}),
            "unknown",
        ),
        (
            503,
            json!({"status": 503, "errorCode": "905", "errorType": "internal"}),
            "unknown",
        ),
    ];
    for (status, body, want) in cases {
        let out = mapped(status, body, async |base| {
            adyen(base, 1).send("idf_map", &adyen_payment()).await
        })
        .await;
        assert_eq!(kind(&out), want, "status {status}: {out:?}");
    }
}

#[tokio::test]
async fn adyen_fake_refusals_and_key_reuse() {
    let fake = FakeAdyen::start().await.unwrap();
    let a = adyen(fake.base_url(), 1);
    let mut refused = adyen_payment();
    refused["paymentMethod"]["number"] = json!(FakeAdyen::REFUSED_CARD);
    let out = a.send("idf_refused", &refused).await;
    let CallReply::Rejected { response } = &out else {
        panic!("{out:?}")
    };
    assert_eq!(
        response.body_json::<Value>().unwrap()["resultCode"],
        "Refused"
    );
    // The refusal is replayed for the same key, not run again.
    assert_eq!(kind(&a.send("idf_refused", &refused).await), "rejected");
    assert_eq!(fake.ledger().len(), 1);
    // Missing fields: 422, nothing saved.
    let out = a.send("idf_invalid", &json!({"reference": "x"})).await;
    assert!(
        matches!(&out, CallReply::Rejected { response } if response.status() == 422),
        "{out:?}"
    );
    // A key over 64 characters: 400.
    let out = a.send(&"k".repeat(65), &adyen_payment()).await;
    assert!(
        matches!(&out, CallReply::Rejected { response } if response.status() == 400),
        "{out:?}"
    );
    // Wrong API key: nothing done.
    let wrong = Adyen::with_base_url(fake.base_url(), "AQE_wrong")
        .unwrap()
        .http_config(fast(1))
        .unwrap();
    assert_eq!(
        kind(&wrong.send("idf_auth", &adyen_payment()).await),
        "retryable"
    );
    // 429 before anything: retryable with its Retry-After.
    fake.faults().rate_limit_next(Duration::from_secs(1));
    let out = a.send("idf_429", &adyen_payment()).await;
    assert!(
        matches!(out, CallReply::Retryable { retry_after: Some(d), .. } if d == Duration::from_secs(1)),
        "{out:?}"
    );
    assert_eq!(fake.ledger().len(), 1, "only the refused payment was made");
}

#[tokio::test]
async fn adyen_concurrent_same_key_is_in_flight() {
    let fake = FakeAdyen::start().await.unwrap();
    fake.faults().set_latency(Duration::from_millis(400));
    let a = adyen(fake.base_url(), 1);
    let a2 = a.clone();
    let first = tokio::spawn(async move { a2.send("idf_c", &adyen_payment()).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(kind(&a.send("idf_c", &adyen_payment()).await), "in_flight");
    assert_eq!(kind(&first.await.unwrap()), "succeeded");
    assert_eq!(fake.ledger().len(), 1);
}

#[tokio::test]
async fn adyen_lookup_replays_inside_the_window_only() {
    let fake = FakeAdyen::start().await.unwrap();
    fake.faults().lose_next_response();
    let a = adyen(fake.base_url(), 1);
    assert_eq!(kind(&a.send("idf_l", &adyen_payment()).await), "unknown");
    let now = Utc::now();
    let found = a
        .lookup("idf_l", &adyen_payment(), Attempts::once(now), now)
        .await;
    let Lookup::Found(Outcome::Succeeded(resp)) = found else {
        panic!("{found:?}")
    };
    assert_eq!(
        resp.body_json::<Value>().unwrap()["pspReference"],
        fake.ledger().entries()[0].id.as_str()
    );
    assert_eq!(fake.ledger().len(), 1);
    let sent = fake.requests().len();
    // Thirty days later, within the default 1 h margin of the 31-day window: nothing is sent.
    let old = now - chrono::Duration::days(31) + chrono::Duration::minutes(30);
    let late = a
        .lookup("idf_l", &adyen_payment(), Attempts::once(old), now)
        .await;
    assert!(matches!(late, Lookup::NeedsOperator { .. }), "{late:?}");
    let missing = a
        .lookup("idf_l", &Value::Null, Attempts::once(now), now)
        .await;
    assert!(
        matches!(missing, Lookup::NeedsOperator { .. }),
        "{missing:?}"
    );
    assert_eq!(fake.requests().len(), sent);
}

// ---- Square ---------------------------------------------------------------------------------

#[tokio::test]
async fn square_sends_the_key_in_the_body_on_every_attempt() {
    let fake = FakeSquare::start().await.unwrap();
    fake.faults().server_error_next(500);
    let key = "idf_0123456789abcdef0123456789abcdef01234";
    let out = square(fake.base_url(), 3)
        .send(key, &square_payment())
        .await;
    assert_eq!(kind(&out), "succeeded", "{out:?}");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    for r in &reqs {
        assert_eq!(r.path, "/v2/payments");
        assert!(r.header("square-version").is_some());
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["idempotency_key"], key);
        assert_eq!(body["amount_money"], square_payment()["amount_money"]);
    }
    assert_eq!(fake.ledger().count_for_key(key), 1);
}

#[tokio::test]
async fn square_lost_response_then_retry_is_one_payment() {
    let fake = FakeSquare::start().await.unwrap();
    fake.faults().lose_next_response();
    let out = square(fake.base_url(), 3)
        .send("idf_sq_lost", &square_payment())
        .await;
    let CallReply::Succeeded { response, .. } = out else {
        panic!("{out:?}")
    };
    let body: Value = response.body_json().unwrap();
    assert_eq!(body["payment"]["status"], "COMPLETED");
    assert_eq!(
        body["payment"]["id"],
        fake.ledger().entries()[0].id.as_str()
    );
    assert_eq!(fake.ledger().len(), 1);
}

fn square_error(category: &str, code: &str) -> Value {
    json!({"errors": [{"category": category, "code": code, "detail": "d"}]})
}

#[tokio::test]
async fn square_answers_map_to_outcomes() {
    let cases: Vec<(u16, Value, &str)> = vec![
        (
            200,
            json!({"payment": {"id": "p", "status": "COMPLETED"}}),
            "succeeded",
        ),
        (
            200,
            json!({"payment": {"id": "p", "status": "APPROVED"}}),
            "succeeded",
        ),
        (
            200,
            json!({"payment": {"id": "p", "status": "CANCELED"}}),
            "rejected",
        ),
        (
            402,
            square_error("PAYMENT_METHOD_ERROR", "GENERIC_DECLINE"),
            "rejected",
        ),
        (
            400,
            square_error("PAYMENT_METHOD_ERROR", "CVV_FAILURE"),
            "rejected",
        ),
        (
            400,
            square_error("INVALID_REQUEST_ERROR", "IDEMPOTENCY_KEY_REUSED"),
            "conflict",
        ),
        (
            400,
            square_error("INVALID_REQUEST_ERROR", "MISSING_REQUIRED_PARAMETER"),
            "rejected",
        ),
        (
            401,
            square_error("AUTHENTICATION_ERROR", "UNAUTHORIZED"),
            "retryable",
        ),
        (
            403,
            square_error("AUTHENTICATION_ERROR", "INSUFFICIENT_SCOPES"),
            "retryable",
        ),
        (
            409,
            square_error("INVALID_REQUEST_ERROR", "CONFLICT"),
            "in_flight",
        ),
        (
            429,
            square_error("RATE_LIMIT_ERROR", "RATE_LIMITED"),
            "retryable",
        ),
        (500, square_error("API_ERROR", "TEMPORARY_ERROR"), "unknown"),
        (
            500,
            square_error("API_ERROR", "INTERNAL_SERVER_ERROR"),
            "unknown",
        ),
        (
            503,
            square_error("API_ERROR", "SERVICE_UNAVAILABLE"),
            "unknown",
        ),
    ];
    for (status, body, want) in cases {
        let out = mapped(status, body, async |base| {
            square(base, 1).send("idf_map", &square_payment()).await
        })
        .await;
        assert_eq!(kind(&out), want, "status {status}: {out:?}");
    }
}

#[tokio::test]
async fn square_fake_declines_and_key_reuse() {
    let fake = FakeSquare::start().await.unwrap();
    let s = square(fake.base_url(), 1);
    let declined = json!({"source_id": FakeSquare::DECLINED_CARD, "amount_money": {"amount": 1, "currency": "USD"}});
    let out = s.send("idf_declined", &declined).await;
    assert!(
        matches!(&out, CallReply::Rejected { response } if response.status() == 402),
        "{out:?}"
    );
    assert_eq!(kind(&s.send("idf_a", &square_payment()).await), "succeeded");
    let other = json!({"source_id": "cnon:card-nonce-ok", "amount_money": {"amount": 99, "currency": "USD"}});
    assert_eq!(kind(&s.send("idf_a", &other).await), "conflict");
    let out = s.send(&"k".repeat(46), &square_payment()).await;
    assert!(
        matches!(&out, CallReply::Rejected { response } if response.status() == 400),
        "{out:?}"
    );
    let wrong = Square::with_base_url(fake.base_url(), "EAAA_wrong")
        .unwrap()
        .http_config(fast(1))
        .unwrap();
    assert_eq!(
        kind(&wrong.send("idf_auth", &square_payment()).await),
        "retryable"
    );
    assert_eq!(fake.ledger().len(), 2, "the decline and one payment");
}

#[tokio::test]
async fn square_void_by_key_covers_every_case() {
    let fake = FakeSquare::start().await.unwrap();
    let s = square(fake.base_url(), 1);
    // No payment with the key: Square answers success, nothing stands charged.
    let v = s.void_by_key("idf_none", &square_payment()).await;
    assert!(matches!(v, VoidReply::Voided { .. }), "{v:?}");
    // A completed payment cannot be voided: refused, so the sweeper looks it up.
    assert_eq!(
        kind(&s.send("idf_done", &square_payment()).await),
        "succeeded"
    );
    let v = s.void_by_key("idf_done", &square_payment()).await;
    assert!(matches!(v, VoidReply::Refused { .. }), "{v:?}");
    assert_eq!(fake.ledger().entries()[0].status, "COMPLETED");
    // A delayed capture is never voided by the adapter (it would burn the key).
    let mut delayed = square_payment();
    delayed["autocomplete"] = json!(false);
    assert_eq!(kind(&s.send("idf_auth", &delayed).await), "succeeded");
    assert_eq!(
        s.void_by_key("idf_auth", &delayed).await,
        VoidReply::Unsupported
    );
    // Voided at Square anyway (by hand): a same-key re-send gets the CANCELED payment, which is
    // stored as a refusal, never as a charge.
    let v = s.void_by_key("idf_auth", &json!({})).await;
    assert!(matches!(v, VoidReply::Voided { .. }), "{v:?}");
    assert_eq!(fake.ledger().entries()[1].status, "CANCELED");
    let out = s.send("idf_auth", &delayed).await;
    let CallReply::Rejected { response } = &out else {
        panic!("{out:?}")
    };
    assert_eq!(
        response.body_json::<Value>().unwrap()["payment"]["status"],
        "CANCELED"
    );
    assert_eq!(fake.ledger().len(), 2);
    // Every void carried only the key.
    let voids: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.path == "/v2/payments/cancel")
        .collect();
    assert_eq!(voids.len(), 3);
    assert_eq!(
        serde_json::from_slice::<Value>(&voids[0].body).unwrap(),
        json!({"idempotency_key": "idf_none"})
    );
}

#[tokio::test]
async fn square_void_answers_map() {
    let cases: Vec<(u16, Value, &str)> = vec![
        (200, json!({}), "voided"),
        (
            200,
            square_error("INVALID_REQUEST_ERROR", "BAD_REQUEST"),
            "unknown",
        ),
        (
            400,
            square_error("INVALID_REQUEST_ERROR", "BAD_REQUEST"),
            "refused",
        ),
        (
            404,
            square_error("INVALID_REQUEST_ERROR", "NOT_FOUND"),
            "refused",
        ),
        (
            401,
            square_error("AUTHENTICATION_ERROR", "UNAUTHORIZED"),
            "unknown",
        ),
        (
            429,
            square_error("RATE_LIMIT_ERROR", "RATE_LIMITED"),
            "unknown",
        ),
        (
            500,
            square_error("API_ERROR", "INTERNAL_SERVER_ERROR"),
            "unknown",
        ),
    ];
    for (status, body, want) in cases {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .and(path("/v2/payments/cancel"))
            .and(header("authorization", "Bearer EAAA_test_idemflow_fake"))
            .respond_with(
                ResponseTemplate::new(status)
                    .set_body_json(body)
                    .insert_header("retry-after", "2"),
            )
            .expect(1)
            .mount(&server)
            .await;
        let v = square(&server.uri(), 1)
            .void_by_key("idf_v", &square_payment())
            .await;
        let got = match &v {
            VoidReply::Voided { .. } => "voided",
            VoidReply::Refused { .. } => "refused",
            VoidReply::Unknown { retry_after, .. } => {
                assert_eq!(*retry_after, Some(Duration::from_secs(2)), "{status}");
                "unknown"
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(got, want, "status {status}: {v:?}");
    }
    // Nothing listening: unknown.
    let v = square("http://127.0.0.1:1", 1)
        .void_by_key("idf_v", &square_payment())
        .await;
    assert!(matches!(v, VoidReply::Unknown { .. }), "{v:?}");
}

#[tokio::test]
async fn square_lookup_is_a_same_key_resend() {
    let fake = FakeSquare::start().await.unwrap();
    fake.faults().lose_next_response();
    let s = square(fake.base_url(), 1);
    assert_eq!(kind(&s.send("idf_l", &square_payment()).await), "unknown");
    let now = Utc::now();
    let found = s
        .lookup("idf_l", &square_payment(), Attempts::once(now), now)
        .await;
    let Lookup::Found(Outcome::Succeeded(resp)) = found else {
        panic!("{found:?}")
    };
    assert_eq!(
        resp.body_json::<Value>().unwrap()["payment"]["id"],
        fake.ledger().entries()[0].id.as_str()
    );
    assert_eq!(fake.ledger().len(), 1);
    let missing = s
        .lookup("idf_l", &Value::Null, Attempts::once(now), now)
        .await;
    assert!(
        matches!(missing, Lookup::NeedsOperator { .. }),
        "{missing:?}"
    );
}

// ---- PayPal ---------------------------------------------------------------------------------

#[tokio::test]
async fn paypal_sends_the_same_request_id_on_every_attempt() {
    let fake = FakePayPal::start().await.unwrap();
    fake.faults().server_error_next(502).server_error_next(500);
    let out = paypal(fake.base_url(), 3)
        .send("idf_pp_1", &paypal_order())
        .await;
    assert_eq!(kind(&out), "succeeded", "{out:?}");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 3);
    for r in &reqs {
        assert_eq!(r.path, "/v2/checkout/orders");
        assert_eq!(r.header("paypal-request-id"), Some("idf_pp_1"));
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {}", FakePayPal::API_KEY).as_str())
        );
        assert_eq!(
            serde_json::from_slice::<Value>(&r.body).unwrap(),
            paypal_order()
        );
    }
    assert_eq!(fake.ledger().count_for_key("idf_pp_1"), 1);
}

#[tokio::test]
async fn paypal_lost_response_then_retry_is_one_order() {
    let fake = FakePayPal::start().await.unwrap();
    fake.faults().lose_next_response();
    let out = paypal(fake.base_url(), 3)
        .send("idf_pp_lost", &paypal_order())
        .await;
    let CallReply::Succeeded { response, .. } = out else {
        panic!("{out:?}")
    };
    assert_eq!(
        response.body_json::<Value>().unwrap()["id"],
        fake.ledger().entries()[0].id.as_str()
    );
    assert_eq!(fake.ledger().len(), 1);
}

fn paypal_error(name: &str, issue: &str) -> Value {
    json!({"name": name, "message": "m", "details": [{"issue": issue}]})
}

#[tokio::test]
async fn paypal_answers_map_to_outcomes() {
    let cases: Vec<(u16, Value, &str)> = vec![
        (201, json!({"id": "O1", "status": "CREATED"}), "succeeded"),
        (200, json!({"id": "O1", "status": "COMPLETED"}), "succeeded"),
        (
            422,
            paypal_error("UNPROCESSABLE_ENTITY", "INSTRUMENT_DECLINED"),
            "rejected",
        ),
        (
            422,
            paypal_error("UNPROCESSABLE_ENTITY", "PAYPAL_REQUEST_ID_PREVIOUSLY_USED"),
            "conflict",
        ),
        (
            400,
            paypal_error("INVALID_REQUEST", "MISSING_REQUIRED_PARAMETER"),
            "rejected",
        ),
        (
            401,
            json!({"name": "AUTHENTICATION_FAILURE", "message": "m"}),
            "retryable",
        ),
        (
            403,
            json!({"name": "NOT_AUTHORIZED", "message": "m"}),
            "retryable",
        ),
        (
            409,
            json!({"name": "RESOURCE_CONFLICT", "message": "m"}),
            "in_flight",
        ),
        (
            429,
            json!({"name": "RATE_LIMIT_REACHED", "message": "m"}),
            "retryable",
        ),
        (
            500,
            json!({"name": "INTERNAL_SERVER_ERROR", "message": "m"}),
            "unknown",
        ),
        (
            503,
            json!({"name": "SERVICE_UNAVAILABLE", "message": "m"}),
            "unknown",
        ),
    ];
    for (status, body, want) in cases {
        let out = mapped(status, body, async |base| {
            paypal(base, 1).send("idf_map", &paypal_order()).await
        })
        .await;
        assert_eq!(kind(&out), want, "status {status}: {out:?}");
    }
}

#[tokio::test]
async fn paypal_fake_declines_and_bad_ids() {
    let fake = FakePayPal::start().await.unwrap();
    let p = paypal(fake.base_url(), 1);
    let mut declined = paypal_order();
    declined["payment_source"] =
        json!({"card": {"number": FakePayPal::DECLINED_CARD, "expiry": "2030-01"}});
    let out = p.send("idf_declined", &declined).await;
    assert!(
        matches!(&out, CallReply::Rejected { response } if response.status() == 422),
        "{out:?}"
    );
    let out = p.send(&"k".repeat(109), &paypal_order()).await;
    assert!(
        matches!(&out, CallReply::Rejected { response } if response.status() == 400),
        "{out:?}"
    );
    let wrong = PayPal::with_base_url(fake.base_url(), "A21AA_wrong")
        .unwrap()
        .http_config(fast(1))
        .unwrap();
    assert_eq!(
        kind(&wrong.send("idf_auth", &paypal_order()).await),
        "retryable"
    );
    // A card order with intent CAPTURE completes at once.
    let mut card = paypal_order();
    card["payment_source"] = json!({"card": {"number": "4111111111111111", "expiry": "2030-01"}});
    let out = p.send("idf_card", &card).await;
    let CallReply::Succeeded { response, .. } = &out else {
        panic!("{out:?}")
    };
    assert_eq!(
        response.body_json::<Value>().unwrap()["status"],
        "COMPLETED"
    );
    assert_eq!(fake.ledger().len(), 1);
}

#[tokio::test]
async fn paypal_concurrent_same_id_is_in_flight() {
    let fake = FakePayPal::start().await.unwrap();
    fake.faults().set_latency(Duration::from_millis(400));
    let p = paypal(fake.base_url(), 1);
    let p2 = p.clone();
    let first = tokio::spawn(async move { p2.send("idf_c", &paypal_order()).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(kind(&p.send("idf_c", &paypal_order()).await), "in_flight");
    assert_eq!(kind(&first.await.unwrap()), "succeeded");
    assert_eq!(fake.ledger().len(), 1);
}

#[tokio::test]
async fn paypal_resend_returns_the_orders_current_state() {
    let fake = FakePayPal::start().await.unwrap();
    fake.faults().lose_next_response();
    let p = paypal(fake.base_url(), 1);
    assert_eq!(kind(&p.send("idf_cur", &paypal_order()).await), "unknown");
    let order_id = fake.ledger().entries()[0].id.clone();
    let now = Utc::now();
    // Created, still waiting for the buyer: the re-send answers with the order as it is.
    let found = p
        .lookup("idf_cur", &paypal_order(), Attempts::once(now), now)
        .await;
    let Lookup::Found(Outcome::Succeeded(resp)) = found else {
        panic!("{found:?}")
    };
    assert_eq!(resp.body_json::<Value>().unwrap()["status"], "CREATED");
    // The buyer approved and the order was captured: the same re-send now says COMPLETED (a
    // cached replay would still say CREATED).
    fake.set_order_status(&order_id, "COMPLETED");
    let found = p
        .lookup("idf_cur", &paypal_order(), Attempts::once(now), now)
        .await;
    let Lookup::Found(Outcome::Succeeded(resp)) = found else {
        panic!("{found:?}")
    };
    let body: Value = resp.body_json().unwrap();
    assert_eq!(
        (body["id"].as_str(), body["status"].as_str()),
        (Some(order_id.as_str()), Some("COMPLETED"))
    );
    assert_eq!(fake.ledger().len(), 1, "re-sends created nothing");
    // Orders v2 keeps the id 6 h: past 5 h (the 1 h margin) nothing is re-sent.
    let sent = fake.requests().len();
    let old = now - chrono::Duration::minutes(5 * 60 + 1);
    let late = p
        .lookup("idf_cur", &paypal_order(), Attempts::once(old), now)
        .await;
    assert!(matches!(late, Lookup::NeedsOperator { .. }), "{late:?}");
    assert_eq!(fake.requests().len(), sent);
    // A 72 h retention (raised by PayPal) keeps re-sending.
    let p72 = paypal(fake.base_url(), 1).retention(Duration::from_secs(72 * 3600));
    assert_eq!(
        p72.key_spec().retention,
        Some(Duration::from_secs(72 * 3600))
    );
    let found = p72
        .lookup("idf_cur", &paypal_order(), Attempts::once(old), now)
        .await;
    assert!(
        matches!(found, Lookup::Found(Outcome::Succeeded(_))),
        "{found:?}"
    );
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn the_sweeper_settles_each_card_provider_by_its_own_path() {
    use idemflow::store::sqlite::SqliteStore;
    use idemflow::{Error, Idempotency, IdempotentRequest, KeyState, Providers, Store, Sweeper};

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("cards.db").display());
    let sqlite = SqliteStore::connect(&url).await.unwrap();
    sqlite.migrate().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(sqlite);
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(400));
    let fa = FakeAdyen::start().await.unwrap();
    let fs = FakeSquare::start().await.unwrap();
    let fp = FakePayPal::start().await.unwrap();
    let a = Arc::new(adyen(fa.base_url(), 1));
    let s = Arc::new(square(fs.base_url(), 1));
    let p = Arc::new(paypal(fp.base_url(), 1));
    let req = |key: &str, body: &Value| {
        IdempotentRequest::new("shop", key, "payments.create", body).unwrap()
    };
    // Adyen and PayPal: the answer is lost; Square: a 5xx before anything ran.
    fa.faults().lose_next_response();
    fp.faults().lose_next_response();
    fs.faults().server_error_next(500);
    for (key, body, provider) in [
        ("a-1", adyen_payment(), a.clone() as Arc<dyn Provider>),
        ("p-1", paypal_order(), p.clone() as Arc<dyn Provider>),
        ("s-1", square_payment(), s.clone() as Arc<dyn Provider>),
    ] {
        let err = idem
            .call(req(key, &body), provider.as_ref())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::OutcomeUnknown { .. }), "{key}: {err}");
    }
    let order_id = fp.ledger().entries()[0].id.clone();
    fp.set_order_status(&order_id, "COMPLETED");
    tokio::time::sleep(Duration::from_millis(450)).await;
    let report = Sweeper::new(
        store.clone(),
        Providers::new()
            .with(a.clone())
            .with(s.clone())
            .with(p.clone()),
    )
    .run_once()
    .await
    .unwrap();
    assert_eq!(
        (
            report.done,
            report.retryable,
            report.redrives,
            report.lookups
        ),
        (2, 1, 2, 1),
        "{report:?}"
    );
    // Adyen: replayed inside its window, one payment.
    let row = store
        .get(req("a-1", &adyen_payment()).id())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, KeyState::Done);
    let headers = row.response.as_ref().unwrap().headers();
    assert!(
        headers.iter().all(|(n, _)| n != "idempotency-key"),
        "the sweeper stored Adyen's echoed key header: {headers:?}"
    );
    assert_eq!(fa.ledger().len(), 1);
    // PayPal: the re-drive returned the order's current state.
    let row = store
        .get(req("p-1", &paypal_order()).id())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, KeyState::Done);
    let stored: Value = row.response.unwrap().body_json().unwrap();
    assert_eq!(stored["status"], "COMPLETED");
    assert_eq!(fp.ledger().len(), 1);
    // Square: voided by key (nothing was charged), so retryable; the retry charges once.
    let row = store
        .get(req("s-1", &square_payment()).id())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, KeyState::Failed { retryable: true });
    assert!(fs.ledger().is_empty());
    assert!(
        fs.requests()
            .iter()
            .any(|r| r.path == "/v2/payments/cancel"),
        "the sweeper voided by key"
    );
    let history = store
        .history(req("s-1", &square_payment()).id())
        .await
        .unwrap();
    assert!(
        history
            .last()
            .unwrap()
            .reason
            .as_deref()
            .unwrap_or("")
            .contains("voided"),
        "{history:?}"
    );
    let charged = idem
        .call(req("s-1", &square_payment()), s.as_ref())
        .await
        .unwrap();
    assert!(!charged.is_replay());
    let again = idem
        .call(req("s-1", &square_payment()), s.as_ref())
        .await
        .unwrap();
    assert!(again.is_replay());
    assert_eq!(fs.ledger().len(), 1);
}

/// Answers the first POST with a 500 (which may have acted), every later one with `status` and
/// `body`, and gives the adapter's outcome over two attempts.
async fn after_a_500(
    status: u16,
    body: Value,
    call: impl AsyncFnOnce(&str) -> CallReply,
) -> CallReply {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(500).set_body_json(json!({"errors": []})))
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(status).set_body_json(body))
        .with_priority(2)
        .mount(&server)
        .await;
    call(&server.uri()).await
}

#[tokio::test]
async fn a_refusal_after_an_attempt_that_may_have_acted_is_unknown_unless_definitive() {
    // The first attempt's 500 may have acted (the provider may still be working on it); a 4xx
    // to the second says nothing definitive about the first, so the call's outcome is unknown
    // and the key stays with the sweeper rather than failing permanently.
    let cases: Vec<(&str, u16, Value)> = vec![
        (
            "square",
            400,
            square_error("INVALID_REQUEST_ERROR", "INVALID_VALUE"),
        ),
        (
            "square",
            402,
            square_error("PAYMENT_METHOD_ERROR", "GENERIC_DECLINE"),
        ),
        (
            "square",
            422,
            square_error("INVALID_REQUEST_ERROR", "INVALID_VALUE"),
        ),
        (
            "paypal",
            422,
            json!({"name": "UNPROCESSABLE_ENTITY", "details": [{"issue": "INSTRUMENT_DECLINED"}]}),
        ),
        (
            "paypal",
            400,
            json!({"name": "INVALID_REQUEST", "details": [{"issue": "INVALID_PARAMETER_VALUE"}]}),
        ),
        ("adyen", 422, json!({"status": 422, "errorCode": "14_030"})),
    ];
    for (provider, status, body) in cases {
        let out = after_a_500(status, body, async |base| match provider {
            "square" => square(base, 2).send("idf_twice", &square_payment()).await,
            "paypal" => paypal(base, 2).send("idf_twice", &paypal_order()).await,
            _ => adyen(base, 2).send("idf_twice", &adyen_payment()).await,
        })
        .await;
        assert_eq!(
            kind(&out),
            "unknown",
            "{provider} 500 then {status}: {out:?}"
        );
    }
    // A payment the provider reports under the key (a 2xx) is definitive, whatever came before.
    let out = after_a_500(
        200,
        json!({"payment": {"id": "p", "status": "FAILED"}}),
        async |base| square(base, 2).send("idf_twice", &square_payment()).await,
    )
    .await;
    assert_eq!(kind(&out), "rejected", "{out:?}");
    let out = after_a_500(
        200,
        json!({"resultCode": "Refused", "pspReference": "x"}),
        async |base| adyen(base, 2).send("idf_twice", &adyen_payment()).await,
    )
    .await;
    assert_eq!(kind(&out), "rejected", "{out:?}");
    // Without an earlier attempt that may have acted, a refusal stays a refusal.
    let out = mapped(
        422,
        square_error("INVALID_REQUEST_ERROR", "INVALID_VALUE"),
        async |base| square(base, 2).send("idf_once", &square_payment()).await,
    )
    .await;
    assert_eq!(kind(&out), "rejected", "{out:?}");
}
