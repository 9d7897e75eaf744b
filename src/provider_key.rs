//! Deriving the key forwarded to a provider.
//!
//! The provider key is a pure function of (scope, key, operation), computed once at claim and
//! stored in the key row, so every attempt, every process and the sweeper send the very same
//! value. A key re-created after its earlier row was purged gets a key of its own
//! ([`renewed_base`], [`renewed`]), chosen at the new row's insert and stored the same way. The
//! client's raw key is never forwarded: two tenants that both pick `order-1` must not collide
//! in the provider's single key space, and a derived key reveals nothing of the scope.

use sha2::{Digest, Sha256};

use crate::fingerprint::hex;

/// The length limit used when no provider names one (a provider's own limit is
/// [`KeySpec::max_len`](crate::provider::KeySpec::max_len)): the full 44-character default key.
pub const DEFAULT_LEN: usize = 44;

/// The prefix of derived provider keys.
pub const PREFIX: &str = "idf_";

/// The default derived key: `idf_` + 40 hex digits (160 bits of SHA-256), 44 characters of
/// `[a-z0-9_]`, which fits every provider limit we know of from 45 characters up.
///
/// ```
/// use idemflow::{provider_key::derive, key::IdempotencyKey, key::Scope};
/// let s = Scope::new("acct_1").unwrap();
/// let k = IdempotencyKey::new("order-7").unwrap();
/// let a = derive(&s, &k, "payments.create", 44);
/// assert_eq!(a, derive(&s, &k, "payments.create", 44));
/// assert_eq!(a.len(), 44);
/// assert!(a.starts_with("idf_"));
/// ```
pub fn derive(
    scope: &crate::key::Scope,
    key: &crate::key::IdempotencyKey,
    operation: &str,
    max_len: usize,
) -> String {
    shaped(&[scope.as_str(), key.as_str(), operation], max_len)
}

/// The digits [`renewed`] appends to a [`renewed_base`]: the life number as 8 lowercase hex
/// digits.
pub const RENEWED_DIGITS: usize = 8;

/// The base of the provider key of a key **re-created** after an earlier row of it was purged,
/// or moved to a provider with a tighter limit: a derivation of its own (never equal to
/// [`derive()`]'s), [`RENEWED_DIGITS`] characters shorter than `max_len` (at least 24 hex
/// digits of SHA-256, so the full key is at least 32 characters, as [`derive()`]'s is). The
/// store appends the key's life number with [`renewed`] at the claim that chooses it, and
/// stores the result, so every attempt of that row sends it (`docs/design.md`, "Provider
/// keys").
///
/// A provider that keeps keys longer than we keep rows (Adyen: 31 days; Square: not
/// documented) would answer the earlier row's key with the earlier effect; the new row's key
/// is one no earlier life sent. And it is a function of the store's state before the claim,
/// not drawn at random: a re-creation that a failover loses (a Redis replica promoted before
/// it copied the claim) is made again with the same key, which the provider deduplicates
/// (`docs/reliability.md`).
///
/// ```
/// use idemflow::{provider_key::{derive, renewed, renewed_base}, key::IdempotencyKey, key::Scope};
/// let s = Scope::new("acct_1").unwrap();
/// let k = IdempotencyKey::new("order-7").unwrap();
/// let base = renewed_base(&s, &k, "payments.create", 44);
/// assert_eq!(base, renewed_base(&s, &k, "payments.create", 44));
/// let second_life = renewed(&base, 4);
/// assert_eq!(second_life.len(), 44);
/// assert!(second_life.ends_with("00000004"));
/// assert_ne!(second_life, derive(&s, &k, "payments.create", 44));
/// assert_ne!(second_life, renewed(&base, 9));
/// ```
pub fn renewed_base(
    scope: &crate::key::Scope,
    key: &crate::key::IdempotencyKey,
    operation: &str,
    max_len: usize,
) -> String {
    let room = max_len.max(32) - RENEWED_DIGITS;
    let digest = digest_hex(&[scope.as_str(), key.as_str(), operation, "renewed"]);
    if room >= PREFIX.len() + 40 {
        format!("{PREFIX}{}", &digest[..40])
    } else if room >= PREFIX.len() + 32 {
        format!("{PREFIX}{}", &digest[..room - PREFIX.len()])
    } else {
        digest[..room].to_owned()
    }
}

/// The provider key of the claim whose history event is the key's `life`-th (its position in
/// the key's history, 1-based, across purges): `base` ([`renewed_base`]) and `life` modulo
/// 2^32 as [`RENEWED_DIGITS`] lowercase hex digits. Every store computes the same: SQLite
/// `printf('%08x', ..)`, PostgreSQL `lpad(to_hex(..), 8, '0')`, MariaDB `LPAD(LOWER(HEX(..)), 8,
/// '0')`, Redis `string.format('%08x', ..)`.
///
/// ```
/// assert_eq!(idemflow::provider_key::renewed("idf_ab", 255), "idf_ab000000ff");
/// ```
pub fn renewed(base: &str, life: u64) -> String {
    format!("{base}{:08x}", life & 0xffff_ffff)
}

fn digest_hex(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for part in parts {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex(&h.finalize())
}

fn shaped(parts: &[&str], max_len: usize) -> String {
    let digest = digest_hex(parts);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{key::IdempotencyKey, key::Scope};

    #[test]
    fn a_renewed_key_fits_the_limit_its_base_was_derived_for() {
        let (s, k) = (
            Scope::new("acct_1").unwrap(),
            IdempotencyKey::new("k").unwrap(),
        );
        for (max_len, len) in [(20, 32), (32, 32), (40, 40), (44, 44), (45, 45), (64, 52)] {
            let key = renewed(&renewed_base(&s, &k, "op", max_len), u64::MAX);
            assert_eq!(key.len(), len, "max_len {max_len}: {key}");
            assert!(key.ends_with("ffffffff"), "the life modulo 2^32: {key}");
            assert_ne!(
                key[..len - RENEWED_DIGITS],
                derive(&s, &k, "op", max_len)[..len - 8]
            );
        }
    }
}
