//! Parsing the `Idempotency-Key` header value.
//!
//! draft-ietf-httpapi-idempotency-key-header makes the value an RFC 8941 Structured Field
//! String: `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`, in double quotes, with `\"`
//! and `\\` as the only escapes. Stripe-style clients send the key bare:
//! `Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`. Both are accepted and name the same
//! key. Anything else is malformed: bad quoting (no closing quote, an escape other than `\"` or
//! `\\`, anything after the closing quote, a quote or backslash inside a bare key), an empty key,
//! more than 255 bytes, or a byte outside visible ASCII (so no spaces, even quoted).

use axum::http::HeaderValue;

use crate::key::{IdempotencyKey, KeyError, MAX_LEN};

/// Why an `Idempotency-Key` header value was refused (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHeaderError {
    /// The request carried the header more than once.
    #[error("the idempotency key header appears more than once; send exactly one")]
    Repeated,
    /// The value is an opened but broken Structured Field String.
    #[error("the idempotency key is not a valid quoted string (RFC 8941 sf-string): {reason}")]
    BadQuoting {
        /// What is wrong with the quoting.
        reason: &'static str,
    },
    /// A bare (unquoted) key held a quote or a backslash.
    #[error(
        "a bare idempotency key must not contain '\"' or '\\' (byte {offset}); send it quoted with escapes, or without them"
    )]
    BareQuoteChar {
        /// Offset of the character in the header value.
        offset: usize,
    },
    /// The key itself breaks a rule (empty, too long, a byte outside visible ASCII).
    #[error(transparent)]
    Key(#[from] KeyError),
}

/// Parses one `Idempotency-Key` header value, quoted (RFC 8941 sf-string) or bare.
///
/// ```
/// use axum::http::HeaderValue;
/// use idemflow::axum::parse_key_header;
///
/// let quoted = parse_key_header(&HeaderValue::from_static(r#""8e03-40d5""#)).unwrap();
/// let bare = parse_key_header(&HeaderValue::from_static("8e03-40d5")).unwrap();
/// assert_eq!(quoted, bare);
/// assert_eq!(parse_key_header(&HeaderValue::from_static(r#""a\"b""#)).unwrap().as_str(), "a\"b");
/// assert!(parse_key_header(&HeaderValue::from_static(r#""open"#)).is_err());
/// assert!(parse_key_header(&HeaderValue::from_static(r#""""#)).is_err());
/// assert!(parse_key_header(&HeaderValue::from_static(r#""has space""#)).is_err());
/// ```
pub fn parse_key_header(value: &HeaderValue) -> Result<IdempotencyKey, KeyHeaderError> {
    parse_key_bytes(value.as_bytes())
}

/// Like [`parse_key_header`], over raw header bytes.
pub fn parse_key_bytes(raw: &[u8]) -> Result<IdempotencyKey, KeyHeaderError> {
    // RFC 8941 parsing discards leading and trailing spaces (HTTP parsers usually already have).
    let start = raw.iter().position(|b| *b != b' ').unwrap_or(raw.len());
    let end = raw
        .iter()
        .rposition(|b| *b != b' ')
        .map_or(start, |e| e + 1);
    let raw = &raw[start..end];
    let key: Vec<u8> = if raw.first() == Some(&b'"') {
        unquote(raw)?
    } else {
        if let Some(offset) = raw.iter().position(|b| matches!(b, b'"' | b'\\')) {
            return Err(KeyHeaderError::BareQuoteChar { offset });
        }
        raw.to_vec()
    };
    if key.len() > MAX_LEN {
        return Err(KeyError::TooLong {
            what: "idempotency key",
            len: key.len(),
        }
        .into());
    }
    match String::from_utf8(key) {
        Ok(s) => {
            let key = IdempotencyKey::new(s)?;
            crate::key::check_client_key(&key)?;
            Ok(key)
        }
        Err(e) => {
            let offset = e.utf8_error().valid_up_to();
            let byte = e.as_bytes().get(offset).copied().unwrap_or(0);
            Err(KeyError::ForbiddenByte {
                what: "idempotency key",
                byte,
                offset,
            }
            .into())
        }
    }
}

/// RFC 8941 section 4.2.5, "Parsing a String", for a value that starts with `"`.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyHeaderError> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 1;
    loop {
        let Some(&c) = raw.get(i) else {
            return Err(KeyHeaderError::BadQuoting {
                reason: "no closing double quote",
            });
        };
        i += 1;
        match c {
            b'\\' => match raw.get(i) {
                Some(&e @ (b'"' | b'\\')) => {
                    out.push(e);
                    i += 1;
                }
                Some(_) => {
                    return Err(KeyHeaderError::BadQuoting {
                        reason: "only \\\" and \\\\ are valid escapes",
                    });
                }
                None => {
                    return Err(KeyHeaderError::BadQuoting {
                        reason: "the value ends inside an escape",
                    });
                }
            },
            b'"' => {
                if i != raw.len() {
                    return Err(KeyHeaderError::BadQuoting {
                        reason: "characters follow the closing double quote",
                    });
                }
                return Ok(out);
            }
            0x20..=0x7E => out.push(c),
            _ => {
                return Err(KeyHeaderError::BadQuoting {
                    reason: "a quoted string holds only printable ASCII (0x20..=0x7E)",
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(v: &str) -> String {
        parse_key_bytes(v.as_bytes()).unwrap().as_str().to_owned()
    }

    fn err(v: &[u8]) -> KeyHeaderError {
        parse_key_bytes(v).unwrap_err()
    }

    #[test]
    fn quoted_and_bare_are_the_same_key() {
        assert_eq!(ok("\"8e03978e\""), "8e03978e");
        assert_eq!(ok("8e03978e"), "8e03978e");
        assert_eq!(ok(" \"k\" "), "k");
        assert_eq!(ok(r#""a\\b\"c""#), r#"a\b"c"#);
    }

    #[test]
    fn malformed_values_name_the_problem() {
        assert!(matches!(
            err(b""),
            KeyHeaderError::Key(KeyError::Empty { .. })
        ));
        assert!(matches!(
            err(b"\"\""),
            KeyHeaderError::Key(KeyError::Empty { .. })
        ));
        assert!(matches!(err(b"\"abc"), KeyHeaderError::BadQuoting { .. }));
        assert!(matches!(
            err(b"\"a\\nb\""),
            KeyHeaderError::BadQuoting { .. }
        ));
        assert!(matches!(err(b"\"a\\"), KeyHeaderError::BadQuoting { .. }));
        assert!(matches!(
            err(b"\"a\";x=1"),
            KeyHeaderError::BadQuoting { .. }
        ));
        assert!(matches!(
            err(b"\"a\"b\""),
            KeyHeaderError::BadQuoting { .. }
        ));
        assert!(matches!(
            err(b"\"a\tb\""),
            KeyHeaderError::BadQuoting { .. }
        ));
        assert!(matches!(
            err(b"ab\"c"),
            KeyHeaderError::BareQuoteChar { offset: 2 }
        ));
        assert!(matches!(
            err(b"\"a b\""),
            KeyHeaderError::Key(KeyError::ForbiddenByte { byte: b' ', .. })
        ));
        assert!(matches!(
            err(b"a b"),
            KeyHeaderError::Key(KeyError::ForbiddenByte { byte: b' ', .. })
        ));
        assert!(matches!(
            err("caf\u{e9}".as_bytes()),
            KeyHeaderError::Key(KeyError::ForbiddenByte { .. })
        ));
        assert!(matches!(
            err(&[b'a', 0xff]),
            KeyHeaderError::Key(KeyError::ForbiddenByte { byte: 0xff, .. })
        ));
        let long = "k".repeat(256);
        assert!(matches!(
            err(long.as_bytes()),
            KeyHeaderError::Key(KeyError::TooLong { len: 256, .. })
        ));
        assert!(matches!(
            err(format!("\"{long}\"").as_bytes()),
            KeyHeaderError::Key(KeyError::TooLong { len: 256, .. })
        ));
        assert_eq!(ok(&"k".repeat(255)).len(), 255);
    }
}
