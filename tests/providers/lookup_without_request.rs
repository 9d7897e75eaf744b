//! Every adapter's lookup of a key whose request was not stored (`Null`: an executor with
//! `store_request(false)`, as `Context::send` and the queue consumers use): an adapter that
//! needs the request to prove the effect absent never answers an authoritative "not found",
//! however old the attempt; one whose search needs only our key may.

use std::time::Duration;

use chrono::Utc;
use idemflow::provider::Lookup;
use idemflow::provider::stripe::StripeOperation;
use idemflow::provider::{Adyen, Attempts, PayPal, Postmark, Provider, Resend, Square, Stripe};
use idemflow::testkit::{FakeAdyen, FakePayPal, FakePostmark, FakeResend, FakeSquare, FakeStripe};
use serde_json::Value;

/// Sent (if at all) a day ago: past every search lag, inside every key window but Resend's,
/// PayPal's and Stripe's.
fn a_day_ago() -> Attempts {
    Attempts::once(Utc::now() - chrono::Duration::hours(23))
}

/// Sent ten minutes ago: past every search lag, inside every key window.
fn minutes_ago() -> Attempts {
    Attempts::once(Utc::now() - chrono::Duration::minutes(10))
}

async fn lookups_without_request(provider: &dyn Provider) -> Vec<Lookup> {
    let mut answers = Vec::new();
    for attempts in [minutes_ago(), a_day_ago()] {
        answers.push(
            provider
                .lookup("idf_never_sent", &Value::Null, attempts, Utc::now())
                .await,
        );
    }
    answers
}

fn proves_nothing_absent(name: &str, answers: &[Lookup]) {
    for answer in answers {
        assert!(
            !matches!(
                answer,
                Lookup::NotFound {
                    authoritative: true
                }
            ),
            "{name}: an authoritative not-found without the request: {answer:?}"
        );
    }
}

#[tokio::test]
async fn lookups_that_need_the_request_never_prove_absence_without_it() {
    let stripe = FakeStripe::start().await.unwrap();
    for operation in [
        StripeOperation::CreatePayment,
        StripeOperation::Capture,
        StripeOperation::Refund,
    ] {
        let adapter = Stripe::with_base_url(stripe.base_url(), FakeStripe::API_KEY)
            .unwrap()
            .operation(operation);
        let name = adapter.name().to_owned();
        proves_nothing_absent(&name, &lookups_without_request(&adapter).await);
    }
    let adyen = FakeAdyen::start().await.unwrap();
    let adapter = Adyen::with_base_url(adyen.base_url(), FakeAdyen::API_KEY).unwrap();
    proves_nothing_absent("adyen", &lookups_without_request(&adapter).await);
    let square = FakeSquare::start().await.unwrap();
    let adapter = Square::with_base_url(square.base_url(), FakeSquare::API_KEY).unwrap();
    proves_nothing_absent("square", &lookups_without_request(&adapter).await);
    let paypal = FakePayPal::start().await.unwrap();
    let adapter = PayPal::with_base_url(paypal.base_url(), FakePayPal::API_KEY).unwrap();
    proves_nothing_absent("paypal", &lookups_without_request(&adapter).await);
    let resend = FakeResend::start().await.unwrap();
    let adapter = Resend::with_base_url(resend.base_url(), FakeResend::API_KEY).unwrap();
    proves_nothing_absent("resend", &lookups_without_request(&adapter).await);
    // Nothing was sent anywhere: no lookup acted.
    assert!(stripe.ledger().is_empty());
    assert!(adyen.ledger().is_empty());
    assert!(square.ledger().is_empty());
    assert!(paypal.ledger().is_empty());
    assert!(resend.ledger().is_empty());
}

/// Postmark is searched by our key alone (the message's metadata), across every message of
/// the server token: an empty search past the search lag proves absence with or without the
/// request, and a message that was sent is found without it.
#[tokio::test]
async fn postmark_is_searched_by_the_key_alone() {
    let fake = FakePostmark::start().await.unwrap();
    let adapter = Postmark::with_base_url(fake.base_url(), FakePostmark::API_KEY)
        .unwrap()
        .search_lag(Duration::from_secs(60));
    let answers = lookups_without_request(&adapter).await;
    assert!(
        answers.iter().all(|a| *a
            == Lookup::NotFound {
                authoritative: true
            }),
        "{answers:?}"
    );
    let email = serde_json::json!({"From": "shop@example.com", "To": "a@example.com",
                                   "Subject": "Receipt", "TextBody": "Paid."});
    let sent = adapter.send("idf_sent", &email).await;
    assert!(
        matches!(sent, idemflow::provider::CallReply::Succeeded { .. }),
        "{sent:?}"
    );
    let found = adapter
        .lookup("idf_sent", &Value::Null, minutes_ago(), Utc::now())
        .await;
    assert!(matches!(found, Lookup::Found(_)), "{found:?}");
}
