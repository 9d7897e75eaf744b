//! Deriving the key forwarded to a provider.
//!
//! The provider key is a pure function of (scope, key, operation), computed once at claim and
//! stored in the key row, so every attempt, every process and the sweeper send the very same
//! value. A key re-created after its earlier row was purged gets a key of its own
//! ([`derive_renewed`]), chosen at the new row's insert and stored the same way. The client's raw key is never forwarded: two tenants that both pick `order-1` must not
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
    shaped(&[scope.as_str(), key.as_str(), operation], max_len)
}

/// The provider key of a key **re-created** after an earlier row of it was purged: the same
/// shape as [`derive()`], with `nonce` (fresh for the new row) mixed in. A provider that keeps
/// keys longer than we keep rows (Adyen: 31 days; Square: not documented) would answer the
/// earlier row's key with the earlier effect; the new row's key is one it has never seen. The
/// store chooses it at the row's insert when the key has kept history, and stores it, so every
/// attempt of that row sends it (`docs/design.md`, "Provider keys").
///
/// ```
/// use idemflow::{provider_key::{derive, derive_renewed}, IdempotencyKey, Scope};
/// let s = Scope::new("acct_1").unwrap();
/// let k = IdempotencyKey::new("order-7").unwrap();
/// let a = derive_renewed(&s, &k, "payments.create", "n1", 44);
/// assert_eq!(a.len(), 44);
/// assert_ne!(a, derive(&s, &k, "payments.create", 44));
/// assert_ne!(a, derive_renewed(&s, &k, "payments.create", "n2", 44));
/// ```
pub fn derive_renewed(
    scope: &crate::Scope,
    key: &crate::IdempotencyKey,
    operation: &str,
    nonce: &str,
    max_len: usize,
) -> String {
    shaped(&[scope.as_str(), key.as_str(), operation, nonce], max_len)
}

/// A fresh nonce for [`derive_renewed`]: 128 bits from the process's random hasher keys, a
/// counter, the time and the process id (unique, not secret).
pub(crate) fn fresh_nonce() -> String {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let seed = (
        N.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now(),
        std::process::id(),
    );
    let a = std::collections::hash_map::RandomState::new().hash_one(seed);
    let b = std::collections::hash_map::RandomState::new().hash_one(seed);
    format!("{a:016x}{b:016x}")
}

fn shaped(parts: &[&str], max_len: usize) -> String {
    let mut h = Sha256::new();
    for part in parts {
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
