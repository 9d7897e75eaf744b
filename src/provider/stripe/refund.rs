//! [`StripeOperation::Refund`](super::StripeOperation::Refund): refunding a payment.
//!
//! The request names the payment, by `payment_intent` or by `charge` (exactly one), and
//! carries the refund's parameters:
//!
//! ```json
//! {"payment_intent": "pi_3Mtw...", "amount": 500, "reason": "requested_by_customer"}
//! ```
//!
//! It is sent as `POST /v1/refunds` with `Idempotency-Key: <provider key>` and
//! `metadata[idemflow_key]=<provider key>`, like a create.
//!
//! The lookup lists the payment's refunds (`GET /v1/refunds?payment_intent=..`, a consistent
//! read, not a search, on the connected account if the request names one; up to
//! [`MAX_PAGES`] pages of 100) and picks the one carrying the key: found, it is replayed as
//! the refund call's 200 with the Refund as Stripe holds it now (a refund that failed later
//! shows `status: failed`). None is authoritative once the latest attempt is `search_lag` old.
//! Without the stored request (`Null`) the lookup cannot tell which payment to list, and
//! answers [`Lookup::NeedsOperator`].

use serde_json::Value;

use super::{KeyLookup, METADATA_KEY, flatten, form_without, object_id, ok_json};
use crate::provider::Lookup;

/// How many pages of refunds a lookup reads before it hands the key to an operator.
pub(super) const MAX_PAGES: usize = 20;

/// The form fields of a refund request.
pub(super) fn form(
    provider_key: &str,
    request: &Value,
) -> Result<(String, Vec<(String, String)>), String> {
    payment(request)?;
    let mut fields = form_without(request, &[])?;
    let meta = format!("metadata[{METADATA_KEY}]");
    fields.retain(|(k, _)| *k != meta);
    flatten(meta, &Value::String(provider_key.to_owned()), &mut fields);
    Ok(("/v1/refunds".to_owned(), fields))
}

/// The payment refunded: `("payment_intent", pi_..)` or `("charge", ch_.. | py_..)`.
fn payment(request: &Value) -> Result<(&'static str, &str), String> {
    let pi = object_id(request, "payment_intent", &["pi_"])?;
    let charge = object_id(request, "charge", &["ch_", "py_"])?;
    match (pi, charge) {
        (Some(pi), None) => Ok(("payment_intent", pi)),
        (None, Some(ch)) => Ok(("charge", ch)),
        _ => Err(
            "a Stripe refund needs exactly one of `payment_intent` and `charge`, the payment to \
             refund"
                .to_owned(),
        ),
    }
}

pub(super) async fn lookup(key: &KeyLookup<'_>) -> Lookup {
    let (request, provider_key) = (key.request, key.provider_key);
    // Without the request the payment refunded is unknown, and refunds cannot be searched by
    // metadata: nothing proves the refund absent.
    if request.is_null() {
        return Lookup::NeedsOperator {
            reason: format!(
                "the request was not stored, so the payment it refunded is unknown; look for a \
                 refund with metadata {METADATA_KEY}={provider_key} in Stripe's dashboard"
            ),
        };
    }
    // A request the adapter refused to send did nothing.
    let Ok((by, id)) = payment(request) else {
        return Lookup::NotFound {
            authoritative: true,
        };
    };
    let mut after: Option<String> = None;
    for _ in 0..MAX_PAGES {
        let mut query = vec![(by, id), ("limit", "100")];
        if let Some(last) = &after {
            query.push(("starting_after", last.as_str()));
        }
        let page = match key.stripe.retrieve("/v1/refunds", &query, key.account).await {
            Ok(page) => page,
            Err(Lookup::NotFound { .. }) => {
                // No such payment: nothing could be refunded under the key.
                return Lookup::NotFound {
                    authoritative: true,
                };
            }
            Err(lookup) => return lookup,
        };
        let Some(refunds) = page.get("data").and_then(Value::as_array) else {
            return Lookup::Unknown { retry_after: None };
        };
        let ours = refunds.iter().find(|r| {
            r.pointer(&format!("/metadata/{METADATA_KEY}"))
                .and_then(Value::as_str)
                == Some(provider_key)
        });
        if let Some(refund) = ours {
            return Lookup::Found(ok_json(refund));
        }
        let more = page.get("has_more").and_then(Value::as_bool) == Some(true);
        match refunds.last().and_then(|r| r.get("id")).and_then(Value::as_str) {
            Some(last) if more => after = Some(last.to_owned()),
            _ => {
                return Lookup::NotFound {
                    authoritative: key.absence_is_authoritative(),
                };
            }
        }
    }
    Lookup::NeedsOperator {
        reason: format!(
            "{by} {id} has more than {} refunds; look for metadata {METADATA_KEY}={provider_key} by hand",
            MAX_PAGES * 100
        ),
    }
}
