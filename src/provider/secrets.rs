//! Secrets kept out of storage: a provider names the fields of its answers that are secret
//! ([`Provider::secret_fields`](super::Provider::secret_fields), e.g. Stripe's `client_secret`),
//! and they are masked before an answer is stored, by the executor and by the sweeper alike.
//! The application masks its own fields with
//! [`Idempotency::redact_with`](crate::Idempotency::redact_with).

use serde_json::Value;

use crate::StoredResponse;

/// What a masked value becomes.
pub const REDACTED: &str = "[redacted]";

/// Masks every member named in `fields`, at any depth, of a JSON body: its value becomes
/// [`REDACTED`]. A body that is not JSON, or names none of them, is returned byte for byte.
///
/// ```
/// use idemflow::StoredResponse;
/// use idemflow::provider::secrets::mask_fields;
/// let pi = StoredResponse::json(200, &serde_json::json!(
///     {"id": "pi_1", "client_secret": "pi_1_secret_abc", "charges": [{"client_secret": "x"}]})).unwrap();
/// let masked = mask_fields(pi, &["client_secret"]);
/// let body = String::from_utf8(masked.body().to_vec()).unwrap();
/// assert!(!body.contains("secret_abc") && body.contains("[redacted]") && body.contains("pi_1"));
/// ```
pub fn mask_fields(response: StoredResponse, fields: &[&str]) -> StoredResponse {
    if fields.is_empty() {
        return response;
    }
    let Ok(mut value) = serde_json::from_slice::<Value>(response.body()) else {
        return response;
    };
    if !mask(&mut value, fields) {
        return response;
    }
    let Ok(body) = serde_json::to_vec(&value) else {
        return response;
    };
    let (status, headers, _) = response.into_parts();
    StoredResponse::from_parts(status, headers, body)
}

/// Masks in place; whether anything was masked.
fn mask(value: &mut Value, fields: &[&str]) -> bool {
    match value {
        Value::Object(map) => {
            let mut any = false;
            for (name, v) in map.iter_mut() {
                if fields.contains(&name.as_str()) {
                    if v != &Value::String(REDACTED.to_owned()) && !v.is_null() {
                        *v = Value::String(REDACTED.to_owned());
                        any = true;
                    }
                } else {
                    any |= mask(v, fields);
                }
            }
            any
        }
        Value::Array(items) => items.iter_mut().fold(false, |any, v| mask(v, fields) | any),
        _ => false,
    }
}

/// `outcome` with the provider's secret fields masked in its answer.
pub(crate) fn mask_outcome(outcome: crate::Outcome, fields: &[&str]) -> crate::Outcome {
    match outcome {
        crate::Outcome::Succeeded(r) => crate::Outcome::Succeeded(mask_fields(r, fields)),
        crate::Outcome::Rejected(r) => crate::Outcome::Rejected(mask_fields(r, fields)),
        other => other,
    }
}
