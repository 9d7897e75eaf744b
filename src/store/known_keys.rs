//! The known-keys hint: a direct-mapped table of key hashes, shared by a store's clones, that
//! says which keys this store has seen exist. A claim of a known key reads first (a replay or an
//! in-flight duplicate is then one plain read); any other claim writes first. It only chooses
//! the order of the statements; it is never trusted for a decision (the claim's write decides,
//! atomically, whenever the read does not settle it). Used by the SQLite, PostgreSQL, MariaDB/MySQL
//! and Redis stores.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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

    /// A hint of `slots` slots (0: a hint that knows nothing).
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            slots: (0..slots).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The slot of a hash and the value it holds when the key is known (never 0).
    fn slot(&self, hash: u64) -> Option<(&AtomicU64, u64)> {
        if self.slots.is_empty() {
            return None;
        }
        let h = hash.max(1);
        // FNV-1a's low bits depend only on the low bits of the state: index by the high bits
        // of a multiplicative mix instead. The remainder is below `slots.len()`, a usize.
        let mixed = h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let slot = &self.slots[(mixed % self.slots.len() as u64) as usize];
        Some((slot, h))
    }

    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.slot(hash)
            .is_some_and(|(slot, h)| slot.load(Ordering::Relaxed) == h)
    }

    pub(crate) fn insert(&self, hash: u64) {
        if let Some((slot, h)) = self.slot(hash) {
            slot.store(h, Ordering::Relaxed);
        }
    }
}

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
    }
}
