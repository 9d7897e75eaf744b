//! The Stripe adapters against localstripe (a third-party Stripe emulator, `pip install
//! localstripe`), started here on a free port: the requests the adapters build are accepted by
//! an implementation of Stripe's API that is not ours, and the answers it gives are read as
//! Stripe's. It covers the create (unconfirmed: localstripe refuses `confirm` on a create), the
//! capture, the refund (by PaymentIntent and by charge), and the capture's and refund's lookups
//! (retrieve, refund list). It does not cover what localstripe does not implement: idempotency
//! keys (a same-key re-send acts again there), the search (the create's lookup), `Stripe-Account`
//! and `Stripe-Version` (both ignored). Those are covered against the testkit's `FakeStripe`
//! (`docs/providers.md`, "Stripe", "What localstripe checks").
//!
//! Skips, saying why, when `localstripe` is not on `PATH` (or `IDEMFLOW_LOCALSTRIPE` does not
//! name it); `.ci/run` installs it and sets `IDEMFLOW_TEST_LOCALSTRIPE=required`, which turns a
//! missing emulator into a failure.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use chrono::Utc;
use idemflow::provider::stripe::StripeOperation;
use idemflow::provider::{Attempts, Provider, Stripe};
use idemflow::{Outcome, provider::CallReply, provider::Lookup};
use serde_json::{Value, json};

use crate::support::KillOnDrop;

const KEY: &str = "sk_test_idemflow_localstripe";

/// localstripe on a free port, or `None` (with the reason printed) when it is not installed.
async fn start() -> Option<(KillOnDrop, String)> {
    let program = std::env::var("IDEMFLOW_LOCALSTRIPE").unwrap_or_else(|_| "localstripe".into());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = match Command::new(&program)
        .args(["--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(child) => KillOnDrop(child),
        Err(e) => {
            let why = format!(
                "localstripe could not be started ({program}: {e}); install it with \
                 `pip install localstripe`"
            );
            assert!(
                std::env::var("IDEMFLOW_TEST_LOCALSTRIPE").as_deref() != Ok("required"),
                "{why}"
            );
            eprintln!("skipping: {why}");
            return None;
        }
    };
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let started = Instant::now();
    loop {
        let up = client
            .get(format!("{base}/v1/customers"))
            .basic_auth(KEY, Some(""))
            .send()
            .await;
        if up.is_ok_and(|r| r.status().is_success()) {
            return Some((child, base));
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "localstripe did not answer on {base} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn adapter(base: &str, operation: StripeOperation) -> Stripe {
    Stripe::with_base_url(base, KEY)
        .unwrap()
        .http_config(idemflow::provider::http::HttpConfig {
            request_timeout: Duration::from_secs(10),
            max_attempts: 1,
            ..Default::default()
        })
        .unwrap()
        .operation(operation)
}

fn answer(reply: CallReply) -> Value {
    match reply {
        CallReply::Succeeded { response, .. } => response.body_json().unwrap(),
        other => panic!("{other:?}"),
    }
}

fn found(lookup: Lookup) -> Value {
    match lookup {
        Lookup::Found(Outcome::Succeeded(r)) => r.body_json().unwrap(),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn the_stripe_adapters_speak_to_localstripe() {
    let Some((_server, base)) = start().await else {
        return;
    };
    let long_ago = Attempts::once(Utc::now() - chrono::Duration::minutes(5));

    // The create, unconfirmed (`confirm: null` sends no `confirm`), with nested metadata.
    let create = adapter(&base, StripeOperation::CreatePayment);
    let pi = answer(
        create
            .send(
                "idf_ls_create",
                &json!({"amount": 1500, "currency": "usd", "payment_method": "pm_card_visa",
                        "capture_method": "manual", "confirm": null,
                        "metadata": {"order": "7"}}),
            )
            .await,
    );
    assert_eq!(
        pi["metadata"],
        json!({"order": "7", "idemflow_key": "idf_ls_create"})
    );
    let id = pi["id"].as_str().unwrap().to_owned();
    // Confirmed by hand: the adapter confirms in the create, which localstripe does not take.
    let confirmed: Value = reqwest::Client::new()
        .post(format!("{base}/v1/payment_intents/{id}/confirm"))
        .basic_auth(KEY, Some(""))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(confirmed["status"], "requires_capture");

    // Before the capture, its lookup finds nothing captured.
    let capture = adapter(&base, StripeOperation::Capture);
    let cap = json!({"payment_intent": id, "amount_to_capture": 1000});
    assert_eq!(
        capture
            .lookup("idf_ls_capture", &cap, long_ago, Utc::now())
            .await,
        Lookup::NotFound {
            authoritative: true
        }
    );
    let captured = answer(capture.send("idf_ls_capture", &cap).await);
    assert_eq!(
        (captured["id"].as_str(), captured["status"].as_str()),
        (Some(id.as_str()), Some("succeeded"))
    );
    let looked_up = found(
        capture
            .lookup("idf_ls_capture", &cap, long_ago, Utc::now())
            .await,
    );
    assert_eq!(looked_up["status"], "succeeded");
    // A second capture of the same PaymentIntent is refused.
    let again = capture.send("idf_ls_capture_2", &cap).await;
    assert!(matches!(again, CallReply::Rejected { .. }), "{again:?}");

    // Refunds, by PaymentIntent and by charge, each found again by its key.
    let refund = adapter(&base, StripeOperation::Refund);
    let by_pi = json!({"payment_intent": id, "amount": 300});
    let made = answer(refund.send("idf_ls_refund_1", &by_pi).await);
    assert_eq!(made["metadata"]["idemflow_key"], "idf_ls_refund_1");
    let charge = made["charge"].as_str().unwrap().to_owned();
    let by_charge = json!({"charge": charge, "amount": 200});
    let second = answer(refund.send("idf_ls_refund_2", &by_charge).await);
    for (key, request, expected) in [
        ("idf_ls_refund_1", &by_pi, &made),
        ("idf_ls_refund_2", &by_charge, &second),
    ] {
        let refund_found = found(refund.lookup(key, request, long_ago, Utc::now()).await);
        assert_eq!(refund_found["id"], expected["id"], "{key}");
        assert_eq!(refund_found["amount"], expected["amount"], "{key}");
    }
    // No refund carries this key (localstripe's own refund of the uncaptured rest neither).
    assert_eq!(
        refund
            .lookup("idf_ls_refund_none", &by_pi, long_ago, Utc::now())
            .await,
        Lookup::NotFound {
            authoritative: true
        }
    );
    // No such PaymentIntent: nothing was captured.
    assert_eq!(
        capture
            .lookup(
                "idf_ls_x",
                &json!({"payment_intent": "pi_nope"}),
                long_ago,
                Utc::now()
            )
            .await,
        Lookup::NotFound {
            authoritative: true
        }
    );
    // The create's lookup is a search, which localstripe lacks: unknown, never a guess.
    let searched = create
        .lookup(
            "idf_ls_create",
            &json!({"amount": 1500}),
            long_ago,
            Utc::now(),
        )
        .await;
    assert!(matches!(searched, Lookup::Unknown { .. }), "{searched:?}");
}
