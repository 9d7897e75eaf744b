//! The answers of finished keys, kept in memory so that a replay needs no store round trip.
//!
//! A key that is `done` or `failed{permanent}` keeps its answer until its retention ends: no
//! claim changes it (`store::kit::claimable`). Only an operator's forced resolve does, and only
//! a purge after the retention removes it. So an answer this process stored or read is the
//! key's answer until the key expires, and the cache may give it back without asking the store.
//!
//! - An entry lives until the key's expiry, measured on this host's monotonic clock from a
//!   point before the store wrote or read the answer (so it never outlives the database's
//!   `expires_at`), and at most [`ExecutorConfig::replay_cache_max_age`]: that bounds how long
//!   an operator's forced resolve in another process goes unseen here.
//! - Only a request with the same fingerprint and operation is answered from the cache; any
//!   other goes to the store, which gives its precise error (`FingerprintMismatch`,
//!   `StepChanged`).
//! - The cache holds at most [`ExecutorConfig::replay_cache_bytes`] of answers (their stored
//!   size plus the key); the oldest entries go first. Zero turns it off.
//!
//! [`ExecutorConfig::replay_cache_max_age`]: super::ExecutorConfig::replay_cache_max_age
//! [`ExecutorConfig::replay_cache_bytes`]: super::ExecutorConfig::replay_cache_bytes

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::fingerprint::Fingerprint;
use crate::record::KeyRecord;
use crate::state::KeyState;
use crate::{KeyId, StoredResponse};

/// What one entry costs beyond its answer and key: the map's and the queue's bookkeeping.
const ENTRY_OVERHEAD: usize = 128;

/// One finished key's answer.
#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    operation: String,
    response: StoredResponse,
    until: Instant,
    bytes: usize,
    /// Which insertion of this key the queue's element is (an entry replaced later leaves a
    /// stale element behind; eviction skips it).
    generation: u64,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<KeyId, Entry>,
    /// Keys in insertion order, for eviction: (key, generation).
    order: VecDeque<(KeyId, u64)>,
    bytes: usize,
    next_generation: u64,
}

/// The finished keys' answers of one executor, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct ReplayCache {
    inner: Mutex<Inner>,
}

impl ReplayCache {
    /// The answer of `id` for a request with `fingerprint` and `operation`, if this process
    /// knows it and the key has not expired.
    pub(crate) fn get(
        &self,
        id: &KeyId,
        fingerprint: &Fingerprint,
        operation: &str,
    ) -> Option<StoredResponse> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let entry = inner.entries.get(id)?;
        if entry.until <= Instant::now() {
            let bytes = entry.bytes;
            inner.entries.remove(id);
            inner.bytes -= bytes;
            return None;
        }
        (entry.fingerprint == *fingerprint && entry.operation == operation)
            .then(|| entry.response.clone())
    }

    /// Keeps `record`'s answer if it is final, for as long as the key lasts from `since` (a
    /// point on this host's clock before the store wrote or read the record) given `now`, the
    /// database's time of that write or read, and at most `max_age`. Keeps nothing when `limit`
    /// (bytes) is zero or the answer alone is larger.
    pub(crate) fn keep(
        &self,
        record: &KeyRecord,
        since: Instant,
        now: chrono::DateTime<chrono::Utc>,
        max_age: Duration,
        limit: usize,
    ) {
        if limit == 0 {
            return;
        }
        let (Some(response), Some(expires_at)) = (&record.response, record.expires_at) else {
            return;
        };
        if !matches!(
            record.state,
            KeyState::Done | KeyState::Failed { retryable: false }
        ) {
            return;
        }
        let Ok(left) = (expires_at - now).to_std() else {
            return;
        };
        let id = KeyId::new(record.scope.clone(), record.key.clone());
        let bytes = response.stored_size()
            + id.scope.as_str().len()
            + id.key.as_str().len()
            + record.operation.len()
            + ENTRY_OVERHEAD;
        if bytes > limit {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let generation = inner.next_generation;
        inner.next_generation += 1;
        let entry = Entry {
            fingerprint: record.fingerprint.clone(),
            operation: record.operation.clone(),
            response: response.clone(),
            until: since + left.min(max_age),
            bytes,
            generation,
        };
        if let Some(old) = inner.entries.insert(id.clone(), entry) {
            inner.bytes -= old.bytes;
        }
        inner.bytes += bytes;
        inner.order.push_back((id, generation));
        while inner.bytes > limit {
            let Some((oldest, generation)) = inner.order.pop_front() else {
                break;
            };
            if inner
                .entries
                .get(&oldest)
                .is_some_and(|e| e.generation == generation)
                && let Some(gone) = inner.entries.remove(&oldest)
            {
                inner.bytes -= gone.bytes;
            }
        }
        // Elements of replaced entries pile up only until the queue is twice the map.
        if inner.order.len() > 2 * inner.entries.len() + 64 {
            let Inner { entries, order, .. } = &mut *inner;
            order.retain(|(id, generation)| {
                entries.get(id).is_some_and(|e| e.generation == *generation)
            });
        }
    }

    /// The bytes the entries count for.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.inner.lock().unwrap().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{IdempotencyKey, Scope};
    use crate::record::LeaseToken;
    use chrono::{TimeZone, Utc};

    fn record(
        key: &str,
        state: KeyState,
        body: &[u8],
        ttl_secs: i64,
    ) -> (KeyRecord, chrono::DateTime<Utc>) {
        let now = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
        let record = KeyRecord {
            scope: Scope::new("s").unwrap(),
            key: IdempotencyKey::new(key).unwrap(),
            operation: "op".to_owned(),
            provider: None,
            provider_key: String::new(),
            state,
            fingerprint: Fingerprint::compute("op", "{}"),
            request: None,
            response: Some(StoredResponse::new(201).with_body(body.to_vec())),
            error: None,
            lease_token: LeaseToken(1),
            lease_owner: None,
            lease_expires_at: None,
            attempts: 1,
            created_at: now,
            updated_at: now,
            expires_at: Some(now + chrono::Duration::seconds(ttl_secs)),
            next_check_at: None,
            retention_ms: ttl_secs * 1000,
            last_attempt_at: now,
            may_have_acted: false,
        };
        (record, now)
    }

    fn id(r: &KeyRecord) -> KeyId {
        KeyId::new(r.scope.clone(), r.key.clone())
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[tokio::test(start_paused = true)]
    async fn an_answer_is_kept_until_the_key_expires_and_no_longer() {
        let cache = ReplayCache::default();
        let (r, now) = record("k", KeyState::Done, b"ok", 10);
        cache.keep(&r, Instant::now(), now, HOUR, 1 << 20);
        let fp = r.fingerprint.clone();
        assert_eq!(cache.get(&id(&r), &fp, "op").unwrap().body(), b"ok");
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(cache.get(&id(&r), &fp, "op").is_some());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            cache.get(&id(&r), &fp, "op").is_none(),
            "kept past its expiry"
        );
        assert_eq!(cache.bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn max_age_bounds_an_entry_shorter_than_its_key() {
        let cache = ReplayCache::default();
        let (r, now) = record("k", KeyState::Done, b"ok", 3600);
        cache.keep(&r, Instant::now(), now, Duration::from_secs(5), 1 << 20);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(cache.get(&id(&r), &r.fingerprint, "op").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_same_request_is_answered() {
        let cache = ReplayCache::default();
        let (r, now) = record("k", KeyState::Done, b"ok", 10);
        cache.keep(&r, Instant::now(), now, HOUR, 1 << 20);
        assert!(
            cache
                .get(&id(&r), &Fingerprint::compute("op", "[]"), "op")
                .is_none()
        );
        assert!(cache.get(&id(&r), &r.fingerprint, "other").is_none());
        assert!(cache.get(&id(&r), &r.fingerprint, "op").is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn only_final_answers_are_kept() {
        let cache = ReplayCache::default();
        for state in [KeyState::Processing, KeyState::Failed { retryable: true }] {
            let (r, now) = record("k", state, b"x", 10);
            cache.keep(&r, Instant::now(), now, HOUR, 1 << 20);
            assert!(
                cache.get(&id(&r), &r.fingerprint, "op").is_none(),
                "{state}"
            );
        }
        let (r, now) = record("k", KeyState::Failed { retryable: false }, b"no", 10);
        cache.keep(&r, Instant::now(), now, HOUR, 1 << 20);
        assert!(cache.get(&id(&r), &r.fingerprint, "op").is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn the_oldest_entries_go_first_past_the_byte_limit() {
        let cache = ReplayCache::default();
        let body = vec![b'x'; 1000];
        let limit = 3 * (1000 + 200);
        let keys: Vec<KeyRecord> = (0..5)
            .map(|i| {
                let (r, now) = record(&format!("k{i}"), KeyState::Done, &body, 10);
                cache.keep(&r, Instant::now(), now, HOUR, limit);
                r
            })
            .collect();
        assert!(cache.bytes() <= limit);
        let kept: Vec<bool> = keys
            .iter()
            .map(|r| cache.get(&id(r), &r.fingerprint, "op").is_some())
            .collect();
        assert_eq!(kept, [false, false, true, true, true]);
        // A key replaced keeps one entry's bytes.
        let (r, now) = record("k4", KeyState::Done, &body, 10);
        cache.keep(&r, Instant::now(), now, HOUR, limit);
        assert!(cache.bytes() <= limit);
        assert!(cache.get(&id(&r), &r.fingerprint, "op").is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_limit_keeps_nothing() {
        let cache = ReplayCache::default();
        let (r, now) = record("k", KeyState::Done, b"ok", 10);
        cache.keep(&r, Instant::now(), now, HOUR, 0);
        assert!(cache.get(&id(&r), &r.fingerprint, "op").is_none());
        assert_eq!(cache.bytes(), 0);
    }
}
