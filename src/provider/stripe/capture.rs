//! [`StripeOperation::Capture`](super::StripeOperation::Capture): capturing an authorised
//! PaymentIntent.
//!
//! The request names the PaymentIntent and carries the capture's parameters:
//!
//! ```json
//! {"payment_intent": "pi_3Mtw...", "amount_to_capture": 1500}
//! ```
//!
//! It is sent as `POST /v1/payment_intents/{payment_intent}/capture` with the other members as
//! form fields and `Idempotency-Key: <provider key>`. No metadata is added: the capture's
//! `metadata` would be merged into the PaymentIntent's and replace the create's `idemflow_key`.
//!
//! The lookup retrieves the PaymentIntent (a consistent read, on the connected account if the
//! request names one): a `manual`-capture PaymentIntent that `succeeded` was captured, and is
//! replayed as the capture's 200; one still `processing` is unknown; any other (still
//! `requires_capture`, canceled, not a manual capture, no such PaymentIntent) was not captured,
//! which is authoritative once the latest attempt is `search_lag` old. Without the stored request
//! (`Null`) the lookup cannot tell which PaymentIntent to read, and answers
//! [`Lookup::NeedsOperator`].

use serde_json::Value;

use super::{KeyLookup, form_without, object_id, ok_json};
use crate::provider::Lookup;

/// The request's member naming the PaymentIntent to capture.
const PAYMENT_INTENT: &str = "payment_intent";

/// The path and the form fields of a capture request.
pub(super) fn form(request: &Value) -> Result<(String, Vec<(String, String)>), String> {
    let id = payment_intent(request)?;
    let fields = form_without(request, &[PAYMENT_INTENT])?;
    Ok((format!("/v1/payment_intents/{id}/capture"), fields))
}

fn payment_intent(request: &Value) -> Result<&str, String> {
    object_id(request, PAYMENT_INTENT, &["pi_"])?.ok_or_else(|| {
        "a Stripe capture needs `payment_intent`, the id of the PaymentIntent to capture"
            .to_owned()
    })
}

pub(super) async fn lookup(key: &KeyLookup<'_>) -> Lookup {
    let request = key.request;
    // Without the request the PaymentIntent captured is unknown: nothing proves the capture
    // absent.
    if request.is_null() {
        return Lookup::NeedsOperator {
            reason: "the request was not stored, so the PaymentIntent it captured is unknown; \
                     an operator must check it in Stripe's dashboard"
                .to_owned(),
        };
    }
    // A request the adapter refused to send did nothing.
    let Ok(id) = payment_intent(request) else {
        return Lookup::NotFound {
            authoritative: true,
        };
    };
    let pi = match key
        .stripe
        .retrieve(&format!("/v1/payment_intents/{id}"), &[], key.account)
        .await
    {
        Ok(pi) => pi,
        Err(lookup) => return lookup,
    };
    let status = pi.get("status").and_then(Value::as_str).unwrap_or_default();
    let manual = pi.get("capture_method").and_then(Value::as_str) == Some("manual");
    match status {
        "succeeded" if manual => Lookup::Found(ok_json(&pi)),
        "processing" => Lookup::Unknown { retry_after: None },
        _ => Lookup::NotFound {
            authoritative: key.absence_is_authoritative(),
        },
    }
}
