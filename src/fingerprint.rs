//! Request fingerprints: canonical JSON hashed with SHA-256, stored with an algorithm version.
//!
//! Canonical form (RFC 8785 style): object members sorted by their names' UTF-16 code units, no
//! insignificant whitespace, strings with the minimal JSON escapes, and numbers normalised so that
//! `1`, `1.0` and `1e0` are the same value. Two documents that differ only in member order,
//! whitespace or number spelling have the same fingerprint; any change of a value changes it.
//! A document that names one member twice in an object is refused ([`parse_json`]), never
//! read last-wins: `{"amount":1,"amount":900}` is not the request `{"amount":900}`.
//!
//! The stored form is `v1:<64 hex digits>`. The version lets a later algorithm live beside keys
//! already in flight: a fingerprint is only ever compared with one of the same version.

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The prefix of the current fingerprint algorithm.
pub const VERSION: &str = "v1";

/// A versioned request fingerprint, e.g. `v1:9f86d0...`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(String);

impl Fingerprint {
    /// Fingerprints an operation name and its canonical request.
    ///
    /// The operation is part of the hash, so the same key reused for another operation is a
    /// mismatch, never a replay.
    pub fn compute(operation: &str, canonical_request: &str) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(operation.as_bytes());
        hasher.update([0u8]);
        hasher.update(canonical_request.as_bytes());
        Self(format!("{VERSION}:{}", hex(&hasher.finalize())))
    }

    /// Wraps a fingerprint read back from a store.
    pub fn from_stored(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The stored form, `v1:<hex>`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0F)]));
    }
    out
}

/// Why bytes are not a JSON document that can be fingerprinted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JsonError {
    /// Not JSON (syntax, trailing data, nesting deeper than 128, a number out of range).
    #[error(transparent)]
    Syntax(#[from] serde_json::Error),
    /// An object names the member `name` more than once (after unescaping).
    #[error("the JSON object member {name:?} appears more than once")]
    DuplicateKey {
        /// The repeated member name.
        name: String,
    },
}

/// Parses a JSON document, refusing any object that names a member twice.
///
/// ```
/// use idemflow::fingerprint::{JsonError, parse_json};
/// assert!(parse_json(br#"{"a":1,"b":{"a":2}}"#).is_ok());
/// assert!(matches!(parse_json(br#"{"a":1,"a":2}"#), Err(JsonError::DuplicateKey { name }) if name == "a"));
/// assert!(matches!(parse_json(b"{"), Err(JsonError::Syntax(_))));
/// ```
pub fn parse_json(bytes: &[u8]) -> Result<Value, JsonError> {
    let value: Value = serde_json::from_slice(bytes)?;
    let repeated = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    if let Err(e) = Unique(&repeated).deserialize(&mut de) {
        return Err(match repeated.into_inner() {
            Some(name) => JsonError::DuplicateKey { name },
            None => JsonError::Syntax(e),
        });
    }
    Ok(value)
}

/// Walks a document and fails at the first object member named twice (its name is left in
/// the cell). serde_json's recursion limit applies, as for [`Value`].
struct Unique<'a>(&'a RefCell<Option<String>>);

impl<'de> DeserializeSeed<'de> for Unique<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// A scalar holds no object member: each `visit_*` of one accepts it.
macro_rules! accept_scalars {
    ($($visit:ident: $ty:ty),* $(,)?) => {
        $(
            fn $visit<E>(self, _: $ty) -> Result<(), E> {
                Ok(())
            }
        )*
    };
}

impl<'de> Visitor<'de> for Unique<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    accept_scalars! {
        visit_bool: bool,
        visit_i64: i64,
        visit_u64: u64,
        visit_i128: i128,
        visit_u128: u128,
        visit_f64: f64,
        visit_str: &str,
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Unique(self.0))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            if seen.contains(&name) {
                let msg = format!("duplicate object member {name:?}");
                *self.0.borrow_mut() = Some(name);
                return Err(de::Error::custom(msg));
            }
            map.next_value_seed(Unique(self.0))?;
            seen.insert(name);
        }
        Ok(())
    }
}

/// Writes `value` in canonical form.
///
/// ```
/// use idemflow::fingerprint::canonical_json;
/// let a: serde_json::Value = serde_json::from_str(r#"{ "b": 1.0, "a": [true, null] }"#).unwrap();
/// assert_eq!(canonical_json(&a), r#"{"a":[true,null],"b":1}"#);
/// ```
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_value(value, &mut out);
    out
}

fn write_value(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, (name, item)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(name, out);
                out.push(':');
                write_value(item, out);
            }
            out.push('}');
        }
    }
}

fn write_number(n: &serde_json::Number, out: &mut String) {
    if let Some(i) = n.as_i64() {
        out.push_str(&i.to_string());
    } else if let Some(u) = n.as_u64() {
        out.push_str(&u.to_string());
    } else if let Some(f) = n.as_f64() {
        // Integral floats within the exactly representable range print as integers, so 1.0,
        // 1e0 and 1 agree; others use the shortest round-trip form.
        if f == f.trunc() && f.abs() < 9_007_199_254_740_992.0 {
            // The guard above keeps the value inside i64's range without loss.
            #[allow(clippy::cast_possible_truncation)]
            out.push_str(&(f as i64).to_string());
        } else {
            out.push_str(&format!("{f:?}"));
        }
    }
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(json: &str) -> Fingerprint {
        let v: Value = serde_json::from_str(json).unwrap();
        Fingerprint::compute("op", &canonical_json(&v))
    }

    #[test]
    fn order_whitespace_and_number_spelling_do_not_matter() {
        let a = fp(r#"{"amount": 500, "user": "alice", "meta": {"x": 1, "y": [1, 2]}}"#);
        let b = fp("{\"meta\":{\"y\":[1,2.0],\"x\":1e0},\n \"user\":\"alice\",\"amount\":5.00e2}");
        assert_eq!(a, b);
        assert!(a.as_str().starts_with("v1:"));
        assert_eq!(a.as_str().len(), 3 + 64);
    }

    #[test]
    fn any_value_change_changes_it() {
        let base = fp(r#"{"amount":500,"user":"alice"}"#);
        for other in [
            r#"{"amount":900,"user":"alice"}"#,
            r#"{"amount":500,"user":"alicf"}"#,
            r#"{"amount":"500","user":"alice"}"#,
            r#"{"amount":500,"user":"alice","x":null}"#,
            r#"{"amount":500.5,"user":"alice"}"#,
            r#"[{"amount":500,"user":"alice"}]"#,
        ] {
            assert_ne!(base, fp(other), "{other}");
        }
        let v: Value = serde_json::from_str(r#"{"a":1}"#).unwrap();
        assert_ne!(
            Fingerprint::compute("payments.create", &canonical_json(&v)),
            Fingerprint::compute("refunds.create", &canonical_json(&v))
        );
    }

    #[test]
    fn canonical_form_is_exact() {
        let v: Value =
            serde_json::from_str("{\"\u{e9}\":1,\"b\":\"tab\\tq\\\"\",\"a\":[-0.5,1e21,-3]}")
                .unwrap();
        assert_eq!(
            canonical_json(&v),
            "{\"a\":[-0.5,1e21,-3],\"b\":\"tab\\tq\\\"\",\"\u{e9}\":1}"
        );
    }
}
