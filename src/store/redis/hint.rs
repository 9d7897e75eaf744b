//! The known-keys hint (see [`RedisConfig::known_keys`](super::RedisConfig::known_keys)): a
//! direct-mapped table of member hashes, shared by a store's clones. It only says which claims
//! may skip the claim script; it is never trusted for a decision.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::layout::fnv1a;

#[derive(Clone)]
pub(super) struct KnownKeys {
    slots: Arc<[AtomicU64]>,
}

impl KnownKeys {
    /// A hint of `slots` slots (0: a hint that knows nothing).
    pub(super) fn new(slots: usize) -> Self {
        Self {
            slots: (0..slots).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The slot of a member and the value it holds when the member is known (never 0).
    fn slot(&self, member: &str) -> Option<(&AtomicU64, u64)> {
        if self.slots.is_empty() {
            return None;
        }
        let h = fnv1a(member).max(1);
        // FNV-1a's low bits depend only on the low bits of the state: index by the high bits
        // of a multiplicative mix instead. The remainder is below `slots.len()`, a usize.
        let mixed = h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let slot = &self.slots[(mixed % self.slots.len() as u64) as usize];
        Some((slot, h))
    }

    pub(super) fn contains(&self, member: &str) -> bool {
        self.slot(member)
            .is_some_and(|(slot, h)| slot.load(Ordering::Relaxed) == h)
    }

    pub(super) fn insert(&self, member: &str) {
        if let Some((slot, h)) = self.slot(member) {
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
        assert!(!hint.contains("a:b"));
        hint.insert("a:b");
        assert!(hint.contains("a:b"));
        assert!(hint.clone().contains("a:b"), "clones share the table");
        let none = KnownKeys::new(0);
        none.insert("a:b");
        assert!(!none.contains("a:b"));
    }
}
