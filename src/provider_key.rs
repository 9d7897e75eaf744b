//! Deriving the key forwarded to a provider.
//!
//! The provider key is a pure function of (scope, key, operation), computed once at claim and
//! stored in the key row, so every attempt, every process and the sweeper send the very same
//! value. The client's raw key is never forwarded: two tenants that both pick `order-1` must not
//! collide in the provider's single key space, and a derived key reveals nothing of the scope.

use sha2::{Digest, Sha256};

use crate::fingerprint::hex;

/// The length limit used when no provider names one (a provider's own limit is
/// [`KeySpec::max_len`](crate::KeySpec::max_len)): the full 44-character default key.
pub const DEFAULT_LEN: usize = 44;

/// The prefix of derived provider keys.
pub const PREFIX: &str = "idf_";

/// The default derived key: `idf_` + 40 hex digits (160 bits of SHA-256), 44 characters of
/// `[a-z0-9_]`, which fits every provider limit we know of from 45 characters up.
///
/// ```
/// use idemflow::{provider_key::derive, IdempotencyKey, Scope};
/// let s = Scope::new("acct_1").unwrap();
/// let k = IdempotencyKey::new("order-7").unwrap();
/// let a = derive(&s, &k, "payments.create", 44);
/// assert_eq!(a, derive(&s, &k, "payments.create", 44));
/// assert_eq!(a.len(), 44);
/// assert!(a.starts_with("idf_"));
/// ```
pub fn derive(
    scope: &crate::Scope,
    key: &crate::IdempotencyKey,
    operation: &str,
    max_len: usize,
) -> String {
    let mut h = Sha256::new();
    for part in [scope.as_str(), key.as_str(), operation] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = hex(&h.finalize());
    let full = format!("{PREFIX}{digest}");
    // At least 32 hex digits (128 bits) are always kept; shorter limits drop the prefix first.
    let max_len = max_len.max(32);
    if max_len >= PREFIX.len() + 40 {
        full[..PREFIX.len() + 40].to_owned()
    } else if max_len >= PREFIX.len() + 32 {
        full[..max_len].to_owned()
    } else {
        digest[..max_len.min(64)].to_owned()
    }
}
