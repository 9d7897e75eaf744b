//! Announcing the end of a key's attempt across processes, for the duplicates waiting on it
//! ([`Idempotency::wait_in_flight`](crate::Idempotency::wait_in_flight)).
//!
//! A duplicate about to wait asks the store to announce the key's end
//! ([`Store::announce_end`](super::Store::announce_end)): the store marks the key, and the write
//! that ends the attempt (a finish, a failure, a worker's release; by a worker, a sweeper or an
//! operator, in any process) publishes the key on the store's channel, because it was marked.
//! Keys nobody waits on are never published, so the write path pays nothing for the feature but
//! the check of the mark. Every process that waits subscribes once per store
//! ([`Store::key_ends`](super::Store::key_ends)): the store keeps one listening connection of its
//! own and fans what it hears out to the waiters of that process.
//!
//! An announcement can be lost (the listening connection dropped and came back): a [`KeyEnd::Gap`]
//! then tells every waiter to read its key again, and the waiters still read their keys on a slow
//! backoff, so a lost announcement delays an answer and never loses it.

#[cfg(any(feature = "postgres", feature = "redis"))]
use std::sync::Mutex;

#[cfg(any(feature = "postgres", feature = "redis"))]
use tokio::sync::broadcast;

use crate::KeyId;

/// What a store's feed of ended keys says ([`Store::key_ends`](super::Store::key_ends)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyEnd {
    /// The attempt on this key ended (finished, failed or released): read it again.
    Ended(KeyId),
    /// Announcements may have been missed (the listening connection was lost, or has just
    /// started listening: a listener sends one `Gap` each time it starts listening): read again.
    Gap,
}

// The feed and the payload format: only the stores that announce ends (PostgreSQL's `NOTIFY`,
// Redis's `PUBLISH`) use them.

/// How many announcements a slow subscriber may fall behind before it is told of a gap.
#[cfg(any(feature = "postgres", feature = "redis"))]
const CAPACITY: usize = 1024;

/// A store's feed of ended keys: started by its first subscriber, stopped when the store (all its
/// clones) is dropped.
#[cfg(any(feature = "postgres", feature = "redis"))]
#[derive(Debug, Default)]
pub(crate) struct EndFeed {
    running: Mutex<Option<(broadcast::Sender<KeyEnd>, tokio::task::AbortHandle)>>,
}

#[cfg(any(feature = "postgres", feature = "redis"))]
impl EndFeed {
    /// A subscription; the first starts `listen`, which sends what it hears until the feed is
    /// dropped (a listener that ended is started again by the next subscriber).
    pub(crate) fn subscribe<F>(
        &self,
        listen: impl FnOnce(broadcast::Sender<KeyEnd>) -> F,
    ) -> broadcast::Receiver<KeyEnd>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let mut running = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((tx, task)) = running.as_ref()
            && !task.is_finished()
        {
            return tx.subscribe();
        }
        let (tx, rx) = broadcast::channel(CAPACITY);
        let task = tokio::spawn(listen(tx.clone())).abort_handle();
        *running = Some((tx, task));
        rx
    }
}

#[cfg(any(feature = "postgres", feature = "redis"))]
impl Drop for EndFeed {
    fn drop(&mut self) {
        let running = self
            .running
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, task)) = running.take() {
            task.abort();
        }
    }
}

#[cfg(feature = "redis")]
/// The payload announcing `id`: the scope's length in bytes, `:`, the scope, then the key (no
/// separator can be confused with the scope's own characters).
pub(crate) fn payload(id: &KeyId) -> String {
    format!(
        "{}:{}{}",
        id.scope.as_str().len(),
        id.scope.as_str(),
        id.key.as_str()
    )
}

#[cfg(any(feature = "postgres", feature = "redis"))]
/// The key a payload names, if it is one.
pub(crate) fn parse(payload: &str) -> Option<KeyId> {
    let (len, rest) = payload.split_once(':')?;
    let len: usize = len.parse().ok()?;
    if !rest.is_char_boundary(len.min(rest.len())) || rest.len() < len {
        return None;
    }
    let (scope, key) = rest.split_at(len);
    Some(KeyId::new(
        crate::key::Scope::new(scope).ok()?,
        crate::key::IdempotencyKey::new(key).ok()?,
    ))
}

#[cfg(all(test, feature = "redis"))]
mod tests {
    use super::*;

    #[test]
    fn payloads_name_their_key_and_nothing_else_parses() {
        for (scope, key) in [("shop", "k1"), ("a:b", "c:d"), ("7:x", "12:y")] {
            let id = KeyId::new(
                crate::key::Scope::new(scope).unwrap(),
                crate::key::IdempotencyKey::new(key).unwrap(),
            );
            assert_eq!(parse(&payload(&id)), Some(id));
        }
        for bad in ["", "x", "4:ab", "99:abc", "-1:a", "1:é"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
