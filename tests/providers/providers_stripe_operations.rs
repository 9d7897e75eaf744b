//! Stripe captures and refunds ([`StripeOperation`]) against the fake Stripe: each acts once
//! under its own key, carries `Stripe-Version` and `Stripe-Account` on every request, is refused
//! unsent when it names no payment, and is looked up from Stripe's consistent reads (the
//! PaymentIntent for a capture, the payment's refunds for a refund).

use std::time::Duration;

use chrono::Utc;
use idemflow::provider::stripe::StripeOperation;
use idemflow::provider::{Attempts, Provider, Stripe};
use idemflow::testkit::FakeStripe;
use idemflow::{Outcome, provider::CallReply, provider::Lookup};
use serde_json::{Value, json};

fn adapter(fake: &FakeStripe, operation: StripeOperation) -> Stripe {
    Stripe::with_base_url(fake.base_url(), FakeStripe::API_KEY)
        .unwrap()
        .http_config(idemflow::provider::http::HttpConfig {
            request_timeout: Duration::from_secs(2),
            max_attempts: 1,
            ..Default::default()
        })
        .unwrap()
        .operation(operation)
}

/// An authorised, not yet captured PaymentIntent of `amount` (on `account`, if any): its id.
async fn authorised(fake: &FakeStripe, amount: u64, account: Option<&str>) -> String {
    let mut request = json!({"amount": amount, "currency": "usd",
                             "payment_method": "pm_card_visa", "capture_method": "manual"});
    if let Some(acct) = account {
        request["stripe_account"] = json!(acct);
    }
    let key = format!("idf_auth_{}", fake.ledger().len());
    match adapter(fake, StripeOperation::CreatePayment)
        .send(&key, &request)
        .await
    {
        CallReply::Succeeded { response, .. } => {
            let pi: Value = response.body_json().unwrap();
            assert_eq!(pi["status"], "requires_capture", "{pi}");
            pi["id"].as_str().unwrap().to_owned()
        }
        other => panic!("{other:?}"),
    }
}

fn body(reply: &CallReply) -> Value {
    match reply {
        CallReply::Succeeded { response, .. } | CallReply::Rejected { response } => {
            response.body_json().unwrap()
        }
        other => panic!("{other:?}"),
    }
}

fn count(fake: &FakeStripe, kind: &str) -> usize {
    fake.ledger()
        .entries()
        .iter()
        .filter(|e| e.kind == kind)
        .count()
}

#[test]
fn each_operation_has_its_own_name_and_keys() {
    let s = |op| Stripe::new("sk_test_1").unwrap().operation(op);
    let names: Vec<_> = [
        StripeOperation::CreatePayment,
        StripeOperation::Capture,
        StripeOperation::Refund,
    ]
    .into_iter()
    .map(|op| (s(op).name().to_owned(), s(op).performs()))
    .collect();
    assert_eq!(
        names,
        [
            ("stripe".to_owned(), StripeOperation::CreatePayment),
            ("stripe_capture".to_owned(), StripeOperation::Capture),
            ("stripe_refund".to_owned(), StripeOperation::Refund),
        ]
    );
    // A name chosen before the operation is kept.
    let named = Stripe::new("sk_test_1")
        .unwrap()
        .with_name("eu")
        .operation(StripeOperation::Refund);
    assert_eq!(named.name(), "eu");
    // Stripe's key rules hold for every operation.
    assert_eq!(
        s(StripeOperation::Refund).key_spec(),
        s(StripeOperation::CreatePayment).key_spec()
    );
}

#[tokio::test]
async fn a_capture_acts_once_under_its_key_and_a_second_is_refused() {
    let fake = FakeStripe::start().await.unwrap();
    let pi = authorised(&fake, 1500, None).await;
    let capture = adapter(&fake, StripeOperation::Capture);
    let request = json!({"payment_intent": pi, "amount_to_capture": 1200});

    let first = capture.send("idf_cap_1", &request).await;
    assert!(
        matches!(
            first,
            CallReply::Succeeded {
                replayed: false,
                ..
            }
        ),
        "{first:?}"
    );
    let captured = body(&first);
    assert_eq!(
        (
            captured["status"].as_str(),
            captured["amount_received"].as_u64()
        ),
        (Some("succeeded"), Some(1200))
    );
    // The request went to the PaymentIntent's capture path, its id not a form field.
    let sent = fake.requests().last().unwrap().clone();
    assert_eq!(sent.path, format!("/v1/payment_intents/{pi}/capture"));
    assert_eq!(sent.header("idempotency-key"), Some("idf_cap_1"));
    assert_eq!(sent.body_text(), "amount_to_capture=1200");

    // The same key again: Stripe's replay, no second capture.
    let again = capture.send("idf_cap_1", &request).await;
    assert!(
        matches!(again, CallReply::Succeeded { replayed: true, .. }),
        "{again:?}"
    );
    assert_eq!(count(&fake, "capture"), 1);

    // Another key for the same PaymentIntent: Stripe refuses, nothing is captured twice.
    let other = capture.send("idf_cap_2", &request).await;
    let CallReply::Rejected { response } = &other else {
        panic!("{other:?}")
    };
    assert_eq!(response.status(), 400);
    assert_eq!(
        body(&other)["error"]["code"],
        "payment_intent_unexpected_state"
    );
    assert_eq!(count(&fake, "capture"), 1);
    // Nothing Stripe masks away is missing: the answer is the PaymentIntent.
    assert_eq!(capture.secret_fields(), ["client_secret"]);
}

#[tokio::test]
async fn refunds_act_once_per_key_and_never_past_what_was_received() {
    let fake = FakeStripe::start().await.unwrap();
    let pi = authorised(&fake, 1000, None).await;
    let captured = adapter(&fake, StripeOperation::Capture)
        .send("idf_cap", &json!({"payment_intent": pi}))
        .await;
    let charge = body(&captured)["latest_charge"]
        .as_str()
        .unwrap()
        .to_owned();
    let refund = adapter(&fake, StripeOperation::Refund);

    let part = json!({"payment_intent": pi, "amount": 600, "reason": "requested_by_customer"});
    let first = refund.send("idf_ref_1", &part).await;
    let made = body(&first);
    assert_eq!(
        (made["object"].as_str(), made["amount"].as_u64()),
        (Some("refund"), Some(600))
    );
    assert_eq!(made["metadata"]["idemflow_key"], "idf_ref_1");
    let sent = fake.requests().last().unwrap().clone();
    assert_eq!(sent.path, "/v1/refunds");
    assert_eq!(sent.header("idempotency-key"), Some("idf_ref_1"));
    let again = refund.send("idf_ref_1", &part).await;
    assert!(
        matches!(again, CallReply::Succeeded { replayed: true, .. }),
        "{again:?}"
    );
    assert_eq!(count(&fake, "refund"), 1);

    // By charge, the rest; then nothing is left to refund.
    let rest = refund.send("idf_ref_2", &json!({"charge": charge})).await;
    assert_eq!(body(&rest)["amount"], 400);
    let more = refund
        .send("idf_ref_3", &json!({"payment_intent": pi, "amount": 1}))
        .await;
    let CallReply::Rejected { response } = &more else {
        panic!("{more:?}")
    };
    assert_eq!(response.status(), 400);
    assert_eq!(body(&more)["error"]["code"], "charge_already_refunded");
    assert_eq!(count(&fake, "refund"), 2);
    // The ledger counts refunds by their keys, as it counts charges.
    assert_eq!(fake.ledger().count_for_key("idf_ref_1"), 1);
    assert_eq!(fake.ledger().count_for_key("idf_ref_3"), 0);
}

#[tokio::test]
async fn captures_and_refunds_carry_the_version_and_the_account_on_every_request() {
    let fake = FakeStripe::start().await.unwrap();
    let acct = "acct_1Connected";
    let pi = authorised(&fake, 800, Some(acct)).await;
    let capture = adapter(&fake, StripeOperation::Capture)
        .api_version("2024-06-20")
        .unwrap();
    let refund = adapter(&fake, StripeOperation::Refund)
        .api_version("2024-06-20")
        .unwrap();
    let first = fake.requests().len();

    let cap = json!({"payment_intent": pi, "stripe_account": acct});
    assert!(matches!(
        capture.send("idf_c", &cap).await,
        CallReply::Succeeded { .. }
    ));
    let re = json!({"payment_intent": pi, "amount": 300, "stripe_account": acct});
    assert!(matches!(
        refund.send("idf_r", &re).await,
        CallReply::Succeeded { .. }
    ));
    let long_ago = Attempts::once(Utc::now() - chrono::Duration::minutes(5));
    assert!(matches!(
        capture.lookup("idf_c", &cap, long_ago, Utc::now()).await,
        Lookup::Found(_)
    ));
    assert!(matches!(
        refund.lookup("idf_r", &re, long_ago, Utc::now()).await,
        Lookup::Found(_)
    ));

    let sent = &fake.requests()[first..];
    assert_eq!(sent.len(), 4, "a capture, a refund, a retrieve and a list");
    for r in sent {
        assert_eq!(
            r.header("stripe-version"),
            Some("2024-06-20"),
            "{} {}",
            r.method,
            r.path
        );
        assert_eq!(
            r.header("stripe-account"),
            Some(acct),
            "{} {}",
            r.method,
            r.path
        );
        assert!(
            !r.body_text().contains("stripe_account"),
            "{}",
            r.body_text()
        );
    }
    // The connected account's payment is not the platform's: without the account, the capture
    // finds no such PaymentIntent, and the lookup says nothing was captured there.
    let platform = json!({"payment_intent": pi});
    let out = capture.send("idf_c_platform", &platform).await;
    let CallReply::Rejected { response } = &out else {
        panic!("{out:?}")
    };
    assert_eq!(response.status(), 404);
    assert_eq!(
        capture
            .lookup("idf_c_platform", &platform, long_ago, Utc::now())
            .await,
        Lookup::NotFound {
            authoritative: true
        }
    );
    for e in fake.ledger().entries() {
        assert_eq!(e.request["Stripe-Account"], acct, "{e:?}");
    }
}

#[tokio::test]
async fn requests_that_name_no_payment_are_refused_unsent() {
    let fake = FakeStripe::start().await.unwrap();
    let capture = adapter(&fake, StripeOperation::Capture);
    let refund = adapter(&fake, StripeOperation::Refund);
    let cases = [
        (&capture, json!({"amount_to_capture": 5})),
        (&capture, json!({"payment_intent": "pi_1/../../v1/refunds"})),
        (&capture, json!({"payment_intent": "ch_123"})),
        (&capture, json!({"payment_intent": 12})),
        (&capture, json!("pi_123")),
        (&refund, json!({"amount": 5})),
        (&refund, json!({"payment_intent": "pi_1", "charge": "ch_1"})),
        (&refund, json!({"charge": "pi_1"})),
        (
            &refund,
            json!({"payment_intent": "pi_1", "stripe_account": "cus_1"}),
        ),
    ];
    for (adapter, request) in cases {
        let out = adapter.send("idf_bad", &request).await;
        let CallReply::Rejected { response } = &out else {
            panic!("{request}: {out:?}")
        };
        assert_eq!(response.status(), 400, "{request}");
        assert_eq!(
            body(&out)["error"]["type"],
            "idemflow_invalid_request",
            "{request}"
        );
        // Never sent, so the lookup knows for certain that nothing happened.
        assert_eq!(
            adapter
                .lookup("idf_bad", &request, Attempts::once(Utc::now()), Utc::now())
                .await,
            Lookup::NotFound {
                authoritative: true
            },
            "{request}"
        );
    }
    assert!(fake.requests().is_empty(), "nothing was sent");
}

#[tokio::test]
async fn a_capture_lookup_reads_the_payment_intent() {
    let fake = FakeStripe::start().await.unwrap();
    let capture = adapter(&fake, StripeOperation::Capture);
    let long_ago = Attempts::once(Utc::now() - chrono::Duration::minutes(5));
    let just_now = Attempts::once(Utc::now());
    let lookup = |request: Value, attempts| {
        let capture = capture.clone();
        async move {
            capture
                .lookup("idf_look", &request, attempts, Utc::now())
                .await
        }
    };

    // Authorised, not captured: nothing happened, certain once Stripe cannot still be running
    // the capture.
    let waiting = authorised(&fake, 900, None).await;
    let req = json!({"payment_intent": waiting});
    assert_eq!(
        lookup(req.clone(), long_ago).await,
        Lookup::NotFound {
            authoritative: true
        }
    );
    assert_eq!(
        lookup(req.clone(), just_now).await,
        Lookup::NotFound {
            authoritative: false
        }
    );

    // Captured: found, replayed as the capture's 200 with the PaymentIntent.
    assert!(matches!(
        capture.send("idf_look", &req).await,
        CallReply::Succeeded { .. }
    ));
    let Lookup::Found(Outcome::Succeeded(r)) = lookup(req.clone(), long_ago).await else {
        panic!("captured")
    };
    assert_eq!(r.status(), 200);
    let pi: Value = r.body_json().unwrap();
    assert_eq!(
        (pi["id"].as_str(), pi["status"].as_str()),
        (Some(waiting.as_str()), Some("succeeded"))
    );

    // A PaymentIntent paid at once was never captured by a capture call; one that does not
    // exist neither.
    let auto = adapter(&fake, StripeOperation::CreatePayment)
        .send(
            "idf_auto",
            &json!({"amount": 5, "currency": "usd", "payment_method": "pm_card_visa"}),
        )
        .await;
    let auto = body(&auto)["id"].as_str().unwrap().to_owned();
    assert_eq!(
        lookup(json!({"payment_intent": auto}), long_ago).await,
        Lookup::NotFound {
            authoritative: true
        }
    );
    assert_eq!(
        lookup(json!({"payment_intent": "pi_nope"}), just_now).await,
        Lookup::NotFound {
            authoritative: true
        }
    );
}

#[tokio::test]
async fn a_refund_lookup_finds_its_refund_by_key_past_the_first_page() {
    let fake = FakeStripe::start().await.unwrap();
    let pi = authorised(&fake, 500, None).await;
    adapter(&fake, StripeOperation::Capture)
        .send("idf_cap", &json!({"payment_intent": pi}))
        .await;
    let refund = adapter(&fake, StripeOperation::Refund);
    let request = |i: usize| json!({"payment_intent": pi, "amount": 1, "metadata": {"n": i}});
    // 105 refunds: the oldest is on the list's second page (Stripe lists newest first).
    let mut ids = Vec::new();
    for i in 0..105 {
        let made = refund.send(&format!("idf_ref_{i}"), &request(i)).await;
        ids.push(body(&made)["id"].as_str().unwrap().to_owned());
    }
    let long_ago = Attempts::once(Utc::now() - chrono::Duration::minutes(5));
    for i in [0, 50, 104] {
        let found = refund
            .lookup(&format!("idf_ref_{i}"), &request(i), long_ago, Utc::now())
            .await;
        let Lookup::Found(Outcome::Succeeded(r)) = found else {
            panic!("{i}: {found:?}")
        };
        let made: Value = r.body_json().unwrap();
        assert_eq!(made["id"], ids[i].as_str(), "{i}");
    }
    let lists = fake
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path == "/v1/refunds")
        .count();
    assert_eq!(
        lists, 4,
        "two pages for the oldest, one each for the others"
    );
    // A key no refund carries: nothing was refunded under it.
    assert_eq!(
        refund
            .lookup("idf_ref_none", &request(0), long_ago, Utc::now())
            .await,
        Lookup::NotFound {
            authoritative: true
        }
    );
    assert_eq!(
        refund
            .lookup(
                "idf_ref_none",
                &request(0),
                Attempts::once(Utc::now()),
                Utc::now()
            )
            .await,
        Lookup::NotFound {
            authoritative: false
        }
    );
    // No such payment: nothing could be refunded.
    assert_eq!(
        refund
            .lookup(
                "idf_x",
                &json!({"payment_intent": "pi_nope"}),
                long_ago,
                Utc::now()
            )
            .await,
        Lookup::NotFound {
            authoritative: true
        }
    );
}

/// A lookup that cannot read Stripe says so, and never guesses.
#[tokio::test]
async fn a_lookup_stripe_cannot_answer_is_unknown() {
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer, ResponseTemplate};
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .respond_with(ResponseTemplate::new(500).insert_header("retry-after", "7"))
        .mount(&server)
        .await;
    let long_ago = Attempts::once(Utc::now() - chrono::Duration::minutes(5));
    for op in [StripeOperation::Capture, StripeOperation::Refund] {
        let s = Stripe::with_base_url(&server.uri(), "sk_test_1")
            .unwrap()
            .operation(op);
        let found = s
            .lookup(
                "idf_k",
                &json!({"payment_intent": "pi_1"}),
                long_ago,
                Utc::now(),
            )
            .await;
        assert_eq!(
            found,
            Lookup::Unknown {
                retry_after: Some(Duration::from_secs(7))
            },
            "{op:?}"
        );
    }
    // A 200 that is not a list is not an empty list.
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"object": "list"})))
        .mount(&server)
        .await;
    let s = Stripe::with_base_url(&server.uri(), "sk_test_1")
        .unwrap()
        .operation(StripeOperation::Refund);
    assert_eq!(
        s.lookup(
            "idf_k",
            &json!({"payment_intent": "pi_1"}),
            long_ago,
            Utc::now()
        )
        .await,
        Lookup::Unknown { retry_after: None }
    );
}
