//! The known-keys hint: a table of key hashes, shared by a store's clones, that says which keys
//! this store has seen exist. A claim of a known key reads first (a replay or an in-flight
//! duplicate is then one plain read); any other claim writes first. It only chooses the order of
//! the statements; it is never trusted for a decision (the claim's write decides, atomically,
//! whenever the read does not settle it). Used by the SQLite, PostgreSQL, MariaDB/MySQL and Redis
//! stores.
//!
//! The table is set-associative: a hash may sit in any of the [`WAYS`] slots of its bucket, and a
//! bucket that is full drops its oldest hash. (It was direct-mapped: two keys of one slot pushed
//! each other out, so 5,000 keys in 65,536 slots lost about 7 % of them, and each lost key's
//! replay went the write path: the claim statement, after waiting for a connection; 2.5 ms
//! against 0.1 ms for the read in the benchmark; `docs/performance.md`, "Connections and
//! pings".)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The most slots a hint holds: 16,777,216 (128 MiB); a larger number asked for is taken as
/// this (a hint is only a hint: more slots remember more keys, never change an answer).
pub(crate) const MAX_SLOTS: usize = 1 << 24;

/// Slots the SQL stores use (8 bytes each).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) const DEFAULT_SLOTS: usize = 65_536;

/// FNV-1a, 64 bits.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The hash of a key id (scope and key, kept apart).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) fn of(id: &crate::KeyId) -> u64 {
    let mut bytes = Vec::with_capacity(id.scope.as_str().len() + id.key.as_str().len() + 1);
    bytes.extend_from_slice(id.scope.as_str().as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(id.key.as_str().as_bytes());
    fnv1a(&bytes)
}

#[derive(Clone)]
pub(crate) struct KnownKeys {
    slots: Arc<[AtomicU64]>,
}

impl std::fmt::Debug for KnownKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KnownKeys({} slots)", self.slots.len())
    }
}

impl KnownKeys {
    /// The address of the slots, shared by the clones of one store: that store's identity
    /// (`store::phase::StoreId`).
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    pub(crate) fn identity(&self) -> usize {
        self.slots.as_ptr() as usize
    }

    /// A hint of `slots` slots (0: a hint that knows nothing), at most [`MAX_SLOTS`].
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            slots: (0..slots.min(MAX_SLOTS))
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    /// The bucket of a hash (its slots, newest first) and the value a slot holds when the key
    /// is known (never 0).
    fn bucket(&self, hash: u64) -> Option<(&[AtomicU64], u64)> {
        let ways = WAYS.min(self.slots.len());
        if ways == 0 {
            return None;
        }
        let buckets = self.slots.len() / ways;
        let h = hash.max(1);
        // FNV-1a's low bits depend only on the low bits of the state: index by the high bits
        // of a multiplicative mix instead, scaled to the bucket count (multiply and keep the
        // high word: below `buckets`, a usize). (Bits 32-63 of the mix taken modulo the count
        // spread the benchmark's keys worse than chance: 4,672 of 5,000 kept direct-mapped,
        // against 4,822 this way.)
        let mixed = h.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let first = ((u128::from(mixed) * buckets as u128) >> 64) as usize * ways;
        Some((&self.slots[first..first + ways], h))
    }

    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.bucket(hash)
            .is_some_and(|(slots, h)| slots.iter().any(|s| s.load(Ordering::Relaxed) == h))
    }

    /// Notes a hash as known: first in its bucket, the others moved one slot down (the oldest
    /// drops out). Concurrent inserts into one bucket may lose a hash or keep one twice: a
    /// wrong hint costs one statement, never an answer.
    pub(crate) fn insert(&self, hash: u64) {
        let Some((slots, h)) = self.bucket(hash) else {
            return;
        };
        if slots.iter().any(|s| s.load(Ordering::Relaxed) == h) {
            return;
        }
        for i in (1..slots.len()).rev() {
            slots[i].store(slots[i - 1].load(Ordering::Relaxed), Ordering::Relaxed);
        }
        slots[0].store(h, Ordering::Relaxed);
    }
}

/// Slots per bucket of the table (module docs): four hashes, 32 bytes, one cache line.
const WAYS: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knows_what_was_inserted_and_nothing_without_slots() {
        let hint = KnownKeys::new(64);
        let a = fnv1a(b"a:b");
        assert!(!hint.contains(a));
        hint.insert(a);
        assert!(hint.contains(a));
        assert!(hint.clone().contains(a), "clones share the table");
        let none = KnownKeys::new(0);
        none.insert(a);
        assert!(!none.contains(a));
        // Fewer slots than a bucket holds: one bucket of them.
        let three = KnownKeys::new(3);
        let hashes: Vec<u64> = (0..3).map(|i| fnv1a(format!("k{i}").as_bytes())).collect();
        hashes.iter().for_each(|&h| three.insert(h));
        assert!(hashes.iter().all(|&h| three.contains(h)));
    }

    /// The benchmark's case: 5,000 keys in the stores' 65,536 slots. The direct-mapped table
    /// knew 4,672 of them afterwards (keys that shared a slot pushed each other out).
    #[test]
    fn keeps_five_thousand_keys_in_the_default_table() {
        let hint = KnownKeys::new(65_536);
        let ids: Vec<u64> = (0..5_000)
            .map(|i| fnv1a(format!("bench\0c1-{i}").as_bytes()))
            .collect();
        ids.iter().for_each(|&h| hint.insert(h));
        let known = ids.iter().filter(|&&h| hint.contains(h)).count();
        assert_eq!(known, 5_000, "{known} of 5,000 keys known");
    }

    /// A full bucket drops its oldest hash, and keeps the newest four.
    #[test]
    fn a_full_bucket_drops_its_oldest() {
        let hint = KnownKeys::new(64);
        let first = fnv1a(b"0");
        let same_bucket =
            |h: u64| std::ptr::eq(hint.bucket(h).unwrap().0, hint.bucket(first).unwrap().0);
        let mut five = vec![first];
        five.extend(
            (1..)
                .map(|i: u32| fnv1a(i.to_string().as_bytes()))
                .filter(|&h| same_bucket(h))
                .take(4),
        );
        five.iter().for_each(|&h| hint.insert(h));
        assert!(!hint.contains(five[0]), "the oldest dropped out");
        assert!(
            five[1..].iter().all(|&h| hint.contains(h)),
            "the newest four kept"
        );
        // Noting a known hash again changes nothing.
        hint.insert(five[1]);
        assert!(five[1..].iter().all(|&h| hint.contains(h)));
    }
}
