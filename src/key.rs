//! Validated identifiers: [`IdempotencyKey`] and [`Scope`].
//!
//! Both follow promise 4 of `docs/design.md` ("Misuse is refused") and the IETF draft's advice to
//! validate keys: 1 to 255 bytes of visible ASCII (`0x21..=0x7E`). Anything else is refused with a
//! [`KeyError`] that names the rule that was broken, before anything touches the store.

use std::fmt;

/// The longest key or scope accepted, in bytes.
pub const MAX_LEN: usize = 255;

/// Why a key or scope was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The value was empty.
    #[error("{what} is empty; it must be 1 to 255 bytes of visible ASCII")]
    Empty {
        /// `"idempotency key"` or `"scope"`.
        what: &'static str,
    },
    /// The value was longer than [`MAX_LEN`] bytes.
    #[error("{what} is {len} bytes long; at most 255 bytes are allowed")]
    TooLong {
        /// `"idempotency key"` or `"scope"`.
        what: &'static str,
        /// The length seen, in bytes.
        len: usize,
    },
    /// The value held a byte outside visible ASCII (a space, a control character or non-ASCII).
    #[error(
        "{what} has a forbidden byte 0x{byte:02X} at offset {offset}; only visible ASCII (0x21..=0x7E) is allowed, so no spaces, control characters or non-ASCII"
    )]
    ForbiddenByte {
        /// `"idempotency key"` or `"scope"`.
        what: &'static str,
        /// The first offending byte.
        byte: u8,
        /// Its offset in bytes.
        offset: usize,
    },
    /// The value contains a sequence idemflow reserves (a workflow step's key is the
    /// workflow's key + `#step:` + the step's position, so no client key may contain `#step:`).
    #[error("{what} contains {reserved:?}, which idemflow reserves for the keys of workflow steps")]
    Reserved {
        /// `"idempotency key"`.
        what: &'static str,
        /// The reserved sequence.
        reserved: &'static str,
    },
}

fn validate(what: &'static str, value: &str) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty { what });
    }
    if value.len() > MAX_LEN {
        return Err(KeyError::TooLong {
            what,
            len: value.len(),
        });
    }
    if let Some((offset, &byte)) = value
        .as_bytes()
        .iter()
        .enumerate()
        .find(|(_, b)| !(0x21..=0x7E).contains(*b))
    {
        return Err(KeyError::ForbiddenByte { what, byte, offset });
    }
    Ok(())
}

macro_rules! validated_string {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            /// Validates `value`: 1 to 255 bytes of visible ASCII.
            pub fn new(value: impl Into<String>) -> Result<Self, KeyError> {
                let value = value.into();
                validate($what, &value)?;
                Ok(Self(value))
            }

            /// The value as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::new(s).map_err(serde::de::Error::custom)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl std::str::FromStr for $name {
            type Err = KeyError;
            fn from_str(s: &str) -> Result<Self, KeyError> {
                Self::new(s)
            }
        }

        impl TryFrom<&str> for $name {
            type Error = KeyError;
            fn try_from(s: &str) -> Result<Self, KeyError> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = KeyError;
            fn try_from(s: String) -> Result<Self, KeyError> {
                Self::new(s)
            }
        }
    };
}

validated_string!(
    /// A client-chosen idempotency key, e.g. the value of an `Idempotency-Key` header.
    ///
    /// ```
    /// use idemflow::key::IdempotencyKey;
    /// assert!(IdempotencyKey::new("8e03978e-40d5-43e8-bc93-6894a57f9324").is_ok());
    /// assert!(IdempotencyKey::new("has space").is_err());
    /// ```
    IdempotencyKey,
    "idempotency key"
);

validated_string!(
    /// The namespace a key lives in: a tenant, an account, an API client. Every lookup includes it,
    /// so one scope never sees, blocks or replays another scope's key.
    ///
    /// ```
    /// use idemflow::key::Scope;
    /// let scope = Scope::new("acct_42").unwrap();
    /// assert_eq!(scope.as_str(), "acct_42");
    /// assert!(Scope::new("").is_err());
    /// ```
    Scope,
    "scope"
);

/// The full identity of a key row: its scope and the key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyId {
    /// The scope (tenant, account, ...).
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
}

impl KeyId {
    /// Pairs a scope and a key.
    pub fn new(scope: Scope, key: IdempotencyKey) -> Self {
        Self { scope, key }
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.scope, self.key)
    }
}

/// The marker between a workflow's key and a step's position in the step's key. Client keys
/// that contain it are refused ([`KeyError::Reserved`]), so no client key is ever a step's key.
pub const STEP_MARK: &str = "#step:";

/// Refuses a client key that contains [`STEP_MARK`].
pub(crate) fn check_client_key(key: &IdempotencyKey) -> Result<(), KeyError> {
    if key.as_str().contains(STEP_MARK) {
        return Err(KeyError::Reserved {
            what: "idempotency key",
            reserved: STEP_MARK,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_every_visible_ascii_byte() {
        let all: String = (0x21u8..=0x7E).map(char::from).collect();
        assert_eq!(IdempotencyKey::new(all.clone()).unwrap().as_str(), all);
        let max = "k".repeat(MAX_LEN);
        assert_eq!(Scope::new(max.clone()).unwrap().as_str().len(), 255);
    }

    #[test]
    fn names_the_rule_broken() {
        assert_eq!(
            IdempotencyKey::new(""),
            Err(KeyError::Empty {
                what: "idempotency key"
            })
        );
        assert_eq!(
            IdempotencyKey::new("k".repeat(256)),
            Err(KeyError::TooLong {
                what: "idempotency key",
                len: 256
            })
        );
        assert_eq!(
            IdempotencyKey::new("a b"),
            Err(KeyError::ForbiddenByte {
                what: "idempotency key",
                byte: b' ',
                offset: 1
            })
        );
        assert!(matches!(
            IdempotencyKey::new("ab\n"),
            Err(KeyError::ForbiddenByte {
                byte: b'\n',
                offset: 2,
                ..
            })
        ));
        assert!(matches!(
            IdempotencyKey::new("caf\u{e9}"),
            Err(KeyError::ForbiddenByte {
                byte: 0xC3,
                offset: 3,
                ..
            })
        ));
        assert_eq!(Scope::new(""), Err(KeyError::Empty { what: "scope" }));
        let msg = IdempotencyKey::new("a\tb").unwrap_err().to_string();
        assert!(
            msg.contains("0x09") && msg.contains("visible ASCII"),
            "{msg}"
        );
    }
}
