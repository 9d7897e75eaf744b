//! The store conformance suite: every store-level promise, written once against
//! `Arc<dyn Store>` and run unchanged on every backend through
//! [`conformance_tests!`](crate::conformance_tests).
//!
//! Each function takes a migrated, **isolated** store (its own database, schema or key prefix:
//! `take_stale` and `purge` are table-wide) and panics when the store breaks the promise its
//! name states.

// Each suite function's name is the promise it checks.
#![allow(missing_docs)]

use crate::store::FinishMode;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::{claim_for, claimed, done, fail, id, taken, unique};
use crate::state::Transition;
use crate::store::{ClaimOutcome, Finish, Lease, Release, TakeStale};
use crate::{
    KeyId, KeyState, Store, StoreError, StoredResponse, fingerprint::Fingerprint, record::Actor,
    record::KeyRecord, record::LeaseToken,
};

const LEASE: Duration = Duration::from_secs(30);

/// Finishes `id` under `token` as `done` with a 201 (panics on a store error).
async fn finished(store: &Arc<dyn Store>, id: &KeyId, token: LeaseToken) -> KeyRecord {
    store
        .finish(id, token, &done(StoredResponse::new(201)))
        .await
        .unwrap()
}

/// An operator's finish into retryable `failed`: the provider shows no charge.
fn no_charge_found() -> Finish {
    Finish {
        to: KeyState::Failed { retryable: true },
        response: None,
        error: Some("operator: provider shows no charge".into()),
        actor: Actor::Operator,
        reason: "checked the dashboard".into(),
    }
}

/// A worker's release for `reason`, with no error and no time set for the next check.
fn worker_release(reason: &str) -> Release {
    Release {
        actor: Actor::Worker,
        reason: reason.into(),
        error: None,
        recheck_after: None,
    }
}

/// Asserts that `write` was refused with `LeaseLost` because the key is `done`.
fn refused_as_done(write: Result<KeyRecord, StoreError>) {
    expect_match!(
        write,
        Err(StoreError::LeaseLost {
            state: KeyState::Done,
            ..
        })
    );
}

/// Claims key `k1` in a new scope named after `prefix`, with an empty body and `lease` (panics
/// unless the claim wins).
async fn claimed_key(store: &Arc<dyn Store>, prefix: &str, lease: Duration) -> (KeyId, Lease) {
    let id = id(&unique(prefix), "k1");
    let lease = claimed(store, &claim_for(&id, "{}", lease)).await;
    (id, lease)
}

pub async fn claim_new_key_grants_first_token_and_history(store: Arc<dyn Store>) {
    let id = id(&unique("claim"), "k1");
    let before = store.now().await.unwrap();
    let lease = claimed(&store, &claim_for(&id, "{}", LEASE)).await;
    // A new row's first token is the database clock in µs: tokens only grow across purge.
    assert!(
        lease.token.0 >= before.timestamp_millis() * 1000,
        "{lease:?}"
    );
    assert_eq!(lease.attempts, 1);
    assert_eq!(lease.transition, Transition::Claim);
    assert_eq!(lease.provider_key, "pk-k1");
    let r = store.get(&id).await.unwrap().expect("row");
    assert_eq!(r.state, KeyState::Processing);
    assert_eq!(r.request.as_deref(), Some("{}"));
    assert_eq!(r.provider.as_deref(), Some("fake"));
    let h = store.history(&id).await.unwrap();
    assert_eq!(h.len(), 1);
    assert_eq!((h[0].from, h[0].to), (None, Some(KeyState::Processing)));
    assert_eq!(h[0].actor, Actor::Worker);
}

pub async fn second_claim_sees_the_key_in_flight(store: Arc<dyn Store>) {
    let (id, first) = claimed_key(&store, "inflight", LEASE).await;
    match store.claim(&claim_for(&id, "{}", LEASE)).await.unwrap() {
        ClaimOutcome::Existing { record, now } => {
            assert_eq!(record.state, KeyState::Processing);
            assert!(record.lease_expires_at.unwrap() > now);
            assert_eq!(record.lease_token, first.token);
        }
        other => panic!("second claim must not win: {other:?}"),
    }
    assert_eq!(store.history(&id).await.unwrap().len(), 1);
}

pub async fn finish_stores_the_response_and_get_returns_it_exactly(store: Arc<dyn Store>) {
    let (id, lease) = claimed_key(&store, "finish", LEASE).await;
    let body: Vec<u8> = (0..=255u8)
        .chain(b"\r\n{\"a\":1}".iter().copied())
        .collect();
    let resp = StoredResponse::new(201)
        .with_header("content-type", "application/json")
        .with_header("X-Weird", "v\"al;ue=1, 2")
        .with_body(body.clone());
    let rec = store
        .finish(&id, lease.token, &done(resp.clone()))
        .await
        .unwrap();
    assert_eq!(rec.state, KeyState::Done);
    assert_eq!(rec.response.as_ref(), Some(&resp));
    assert!(rec.expires_at.unwrap() > rec.updated_at);
    assert!(rec.lease_expires_at.is_none());
    let again = store.get(&id).await.unwrap().unwrap();
    assert_eq!(again.response.unwrap().body(), &body[..]);
    let h = store.history(&id).await.unwrap();
    assert_eq!(h.len(), 2);
    assert_eq!(
        (h[1].from, h[1].to),
        (Some(KeyState::Processing), Some(KeyState::Done))
    );
    // A second finish with the same token is refused: the key is no longer processing.
    refused_as_done(
        store
            .finish(&id, lease.token, &done(StoredResponse::new(200)))
            .await,
    );
    assert_eq!(
        store
            .get(&id)
            .await
            .unwrap()
            .unwrap()
            .response
            .unwrap()
            .status(),
        201
    );
}

pub async fn stale_token_is_lease_lost_and_changes_nothing(store: Arc<dyn Store>) {
    let (id, first) = claimed_key(&store, "fence", Duration::ZERO).await;
    let swept = taken(&store, "sweeper-1", LEASE, 10).await;
    assert_eq!(swept.len(), 1);
    let second = LeaseToken(first.token.0 + 1);
    assert_eq!(swept[0].lease_token, second);
    let before = store.get(&id).await.unwrap().unwrap();
    let err = store
        .finish(&id, first.token, &done(StoredResponse::new(201)))
        .await
        .unwrap_err();
    match err {
        StoreError::LeaseLost {
            presented,
            current,
            state,
            ..
        } => {
            assert_eq!(
                (presented, current, state),
                (first.token, second, KeyState::Processing)
            );
        }
        other => panic!("expected LeaseLost, got {other}"),
    }
    let after = store.get(&id).await.unwrap().unwrap();
    assert_eq!(before, after, "a fenced write must change nothing");
    assert_eq!(store.history(&id).await.unwrap().len(), 2);
    // The new holder can finish.
    finished(&store, &id, second).await;
}

pub async fn scopes_are_isolated(store: Arc<dyn Store>) {
    let (a, b) = (unique("tenant-a"), unique("tenant-b"));
    let ia = id(&a, "same-key");
    let ib = id(&b, "same-key");
    let la = claimed(&store, &claim_for(&ia, "{\"x\":1}", LEASE)).await;
    // Another scope with the same key and even another body is an independent key.
    let lb = claimed(&store, &claim_for(&ib, "{\"x\":2}", LEASE)).await;
    assert_eq!(
        (la.transition, lb.transition),
        (Transition::Claim, Transition::Claim)
    );
    store
        .finish(
            &ia,
            la.token,
            &done(StoredResponse::new(201).with_body(&b"A"[..])),
        )
        .await
        .unwrap();
    assert_eq!(
        store.get(&ib).await.unwrap().unwrap().state,
        KeyState::Processing
    );
    assert!(store.get(&ib).await.unwrap().unwrap().response.is_none());
    assert_eq!(store.history(&ib).await.unwrap().len(), 1);
}

pub async fn other_fingerprint_never_reclaims(store: Arc<dyn Store>) {
    let id = id(&unique("fp"), "k1");
    let l = claimed(&store, &claim_for(&id, "{\"a\":1}", LEASE)).await;
    store.finish(&id, l.token, &fail(true)).await.unwrap();
    match store
        .claim(&claim_for(&id, "{\"a\":2}", LEASE))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing { record, .. } => {
            assert_eq!(record.state, KeyState::Failed { retryable: true });
            assert_eq!(
                record.fingerprint,
                Fingerprint::compute("payments.create", "{\"a\":1}")
            );
        }
        other => panic!("another request must not reclaim: {other:?}"),
    }
}

pub async fn retryable_failure_is_reclaimed_by_the_same_request(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "reclaim", LEASE).await;
    store.finish(&id, l.token, &fail(true)).await.unwrap();
    let mut again = claim_for(&id, "{}", LEASE);
    again.provider_key = "something-else".into();
    let l2 = claimed(&store, &again).await;
    assert_eq!(l2.transition, Transition::Reclaim);
    assert_eq!(l2.token, LeaseToken(l.token.0 + 1));
    assert_eq!(l2.attempts, 2);
    assert_eq!(l2.provider_key, "pk-k1", "the stored provider key is kept");
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(r.state, KeyState::Processing);
    assert!(r.error.is_none() && r.response.is_none() && r.expires_at.is_none());
    let h = store.history(&id).await.unwrap();
    assert_eq!(h.len(), 3);
    assert_eq!(h[2].from, Some(KeyState::Failed { retryable: true }));
}

pub async fn permanent_failure_is_never_reclaimed(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "perm", LEASE).await;
    store.finish(&id, l.token, &fail(false)).await.unwrap();
    match store.claim(&claim_for(&id, "{}", LEASE)).await.unwrap() {
        ClaimOutcome::Existing { record, .. } => {
            assert_eq!(record.state, KeyState::Failed { retryable: false });
            assert_eq!(record.response.unwrap().status(), 402);
        }
        other => panic!("a permanent failure is replayed, not re-run: {other:?}"),
    }
}

pub async fn release_leaves_processing_for_the_sweeper(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "release", LEASE).await;
    let rel = Release {
        actor: Actor::Worker,
        reason: "timeout after send".into(),
        error: Some("read timed out".into()),
        recheck_after: None,
    };
    store.release(&id, l.token, &rel).await.unwrap();
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(r.state, KeyState::Processing);
    assert_eq!(r.error.as_deref(), Some("read timed out"));
    let swept = taken(&store, "sweeper", LEASE, 10).await;
    assert_eq!(swept.len(), 1);
    assert_eq!(swept[0].key.as_str(), "k1");
    assert_eq!(swept[0].lease_owner.as_deref(), Some("sweeper"));
    // A release with a stale token is refused.
    assert!(matches!(
        store.release(&id, l.token, &rel).await,
        Err(StoreError::LeaseLost { .. })
    ));
    let h = store.history(&id).await.unwrap();
    assert_eq!(h.len(), 3);
    assert_eq!(h[2].actor, Actor::Sweeper);
}

pub async fn take_stale_respects_next_check_at(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "defer", Duration::ZERO).await;
    let swept = taken(&store, "s", Duration::ZERO, 10).await;
    assert_eq!(swept.len(), 1);
    let token = swept[0].lease_token;
    assert!(token > l.token);
    store
        .release(
            &id,
            token,
            &Release {
                actor: Actor::Sweeper,
                reason: "provider answer unknown; backing off".into(),
                error: None,
                recheck_after: Some(Duration::from_secs(3600)),
            },
        )
        .await
        .unwrap();
    let r = store.get(&id).await.unwrap().unwrap();
    assert!(r.next_check_at.unwrap() > r.updated_at);
    let again = taken(&store, "s", LEASE, 10).await;
    assert!(again.is_empty(), "a deferred key is not due: {again:?}");
}

pub async fn take_stale_fences_the_old_holder(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "zombie", Duration::ZERO).await;
    let swept = taken(&store, "s", LEASE, 10).await;
    assert_eq!(swept.len(), 1);
    assert!(matches!(
        store.extend(&id, l.token, LEASE).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert!(matches!(
        store.finish(&id, l.token, &fail(true)).await,
        Err(StoreError::LeaseLost { .. })
    ));
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.lease_token),
        (KeyState::Processing, swept[0].lease_token)
    );
}

pub async fn take_stale_skips_live_leases_and_finished_keys(store: Arc<dyn Store>) {
    let scope = unique("skip");
    let live = id(&scope, "live");
    claimed(&store, &claim_for(&live, "{}", LEASE)).await;
    let fin = id(&scope, "finished");
    let l = claimed(&store, &claim_for(&fin, "{}", Duration::ZERO)).await;
    store
        .finish(&fin, l.token, &done(StoredResponse::new(200)))
        .await
        .unwrap();
    let mut all = Vec::new();
    for i in 0..5 {
        let s = id(&scope, &format!("stale-{i}"));
        claimed(&store, &claim_for(&s, "{}", Duration::ZERO)).await;
        all.push(s);
    }
    let first = taken(&store, "s", LEASE, 3).await;
    let second = taken(&store, "s", LEASE, 10).await;
    assert_eq!(first.len(), 3, "the batch limit holds");
    assert_eq!(second.len(), 2);
    let keys: HashSet<String> = first
        .iter()
        .chain(&second)
        .map(|r| r.key.to_string())
        .collect();
    assert_eq!(keys.len(), 5);
    assert!(keys.iter().all(|k| k.starts_with("stale-")));
}

/// A take limited to a scope (a queue consumer's in-process sweeper) takes that scope's stale
/// keys and no other: another scope's stale key stays as it was, for the sweeper that knows its
/// provider.
pub async fn take_stale_in_a_scope_takes_only_its_keys(store: Arc<dyn Store>) {
    let (mine, theirs) = (unique("own-scope"), unique("other-scope"));
    let other = id(&theirs, "stale");
    let before = claimed(&store, &claim_for(&other, "{}", Duration::ZERO)).await;
    let own: Vec<crate::KeyId> = (0..3).map(|i| id(&mine, &format!("stale-{i}"))).collect();
    for k in &own {
        claimed(&store, &claim_for(k, "{}", Duration::ZERO)).await;
    }
    let take = |limit| TakeStale {
        owner: "scoped".into(),
        lease: LEASE,
        limit,
        scope: Some(mine.clone()),
    };
    let first = store.take_stale(&take(2)).await.expect("take_stale");
    let second = store.take_stale(&take(10)).await.expect("take_stale");
    assert_eq!(
        (first.len(), second.len()),
        (2, 1),
        "the batch limit holds in a scope"
    );
    assert!(
        first
            .iter()
            .chain(&second)
            .all(|r| r.scope.as_str() == mine),
        "a key of another scope was taken: {first:?} {second:?}"
    );
    let left = store.get(&other).await.unwrap().unwrap();
    assert_eq!(
        (left.lease_token, left.attempts),
        (before.token, 1),
        "the other scope's stale key was touched: {left:?}"
    );
}

pub async fn extend_moves_the_lease_and_is_fenced(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "extend", Duration::from_secs(1)).await;
    let new_exp = store
        .extend(&id, l.token, Duration::from_secs(600))
        .await
        .unwrap();
    assert!(new_exp > l.expires_at + chrono::Duration::seconds(500));
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().lease_expires_at,
        Some(new_exp)
    );
    assert!(matches!(
        store.extend(&id, LeaseToken(99), LEASE).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert_eq!(
        store.history(&id).await.unwrap().len(),
        1,
        "extending is not a transition"
    );
    let missing = crate::conformance::id(&unique("extend"), "none");
    assert!(matches!(
        store.extend(&missing, LeaseToken(1), LEASE).await,
        Err(StoreError::NotFound { .. })
    ));
}

/// A lease given back cannot be renewed: a heartbeat's renewal that lands after the holder's own
/// release (the sweeper renews its batch beside the key in hand; a renewal sent while the release
/// was on the wire) must not hold the released key for another lease, away from every sweeper.
pub async fn a_released_lease_is_not_renewed(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "released", LEASE).await;
    let rel = worker_release("outcome unknown");
    store.release(&id, l.token, &rel).await.unwrap();
    assert!(
        matches!(
            store.extend(&id, l.token, Duration::from_secs(600)).await,
            Err(StoreError::LeaseLost { .. })
        ),
        "a renewal after the release was accepted"
    );
    let r = store.get(&id).await.unwrap().unwrap();
    let now = store.now().await.unwrap();
    assert!(
        r.lease_expires_at.is_some_and(|exp| exp <= now),
        "the released lease runs until {:?} (now {now})",
        r.lease_expires_at
    );
    let swept = taken(&store, "sweeper", LEASE, 10).await;
    assert_eq!(swept.len(), 1, "the released key is free for the sweeper");
    // The sweeper's own lease is renewed as before.
    store
        .extend(&id, swept[0].lease_token, LEASE)
        .await
        .unwrap();
}

pub async fn purge_deletes_only_expired_finished_keys_and_records_it(store: Arc<dyn Store>) {
    let scope = unique("purge");
    let mut expired = Vec::new();
    for i in 0..5 {
        let id = id(&scope, &format!("old-{i}"));
        let mut c = claim_for(&id, "{}", LEASE);
        c.retention = Duration::ZERO;
        let l = claimed(&store, &c).await;
        finished(&store, &id, l.token).await;
        expired.push(id);
    }
    let kept = id(&scope, "fresh");
    let l = claimed(&store, &claim_for(&kept, "{}", LEASE)).await;
    finished(&store, &kept, l.token).await;
    let running = id(&scope, "running");
    let mut c = claim_for(&running, "{}", Duration::ZERO);
    c.retention = Duration::ZERO;
    claimed(&store, &c).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.purge_expired(2).await.unwrap(), 2, "bounded batches");
    let mut total = 2;
    loop {
        let n = store.purge_expired(2).await.unwrap();
        if n == 0 {
            break;
        }
        total += n;
    }
    assert_eq!(total, 5);
    for id in &expired {
        assert!(store.get(id).await.unwrap().is_none());
        let h = store.history(id).await.unwrap();
        let last = h.last().unwrap();
        assert_eq!(
            (last.from, last.to, last.actor),
            (Some(KeyState::Done), None, Actor::Purge)
        );
    }
    assert!(store.get(&kept).await.unwrap().is_some());
    assert!(
        store.get(&running).await.unwrap().is_some(),
        "processing keys are never purged"
    );
}

pub async fn operator_override_fences_running_workers(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "override", LEASE).await;
    let decision = no_charge_found();
    let r = store
        .finish_as(&id, FinishMode::Override, &decision)
        .await
        .unwrap();
    assert_eq!(r.state, KeyState::Failed { retryable: true });
    assert!(r.lease_token > l.token);
    assert!(matches!(
        store
            .finish(&id, l.token, &done(StoredResponse::new(201)))
            .await,
        Err(StoreError::LeaseLost { .. })
    ));
    let h = store.history(&id).await.unwrap();
    assert_eq!(h.last().unwrap().actor, Actor::Operator);
    assert_eq!(
        h.last().unwrap().reason.as_deref(),
        Some("checked the dashboard")
    );
    let missing = crate::conformance::id(&unique("override"), "none");
    assert!(matches!(
        store
            .finish_as(&missing, FinishMode::Override, &decision)
            .await,
        Err(StoreError::NotFound { .. })
    ));
}

pub async fn finishing_into_processing_is_refused(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "invalid", LEASE).await;
    let bad = Finish {
        to: KeyState::Processing,
        response: None,
        error: None,
        actor: Actor::Worker,
        reason: "x".into(),
    };
    assert!(matches!(
        store.finish(&id, l.token, &bad).await,
        Err(StoreError::InvalidTransition(_))
    ));
    assert_eq!(store.history(&id).await.unwrap().len(), 1);
}

pub async fn concurrent_claims_have_one_winner(store: Arc<dyn Store>) {
    let id = id(&unique("race"), "k1");
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let store = store.clone();
        let c = claim_for(&id, "{}", LEASE);
        tasks.push(tokio::spawn(async move { store.claim(&c).await }));
    }
    let mut winners = 0;
    for t in tasks {
        if let ClaimOutcome::Claimed(_) = t.await.unwrap().unwrap() {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
    assert_eq!(store.history(&id).await.unwrap().len(), 1);
}

pub async fn limits_round_trip_exactly(store: Arc<dyn Store>) {
    let punct: String = (0x21u8..=0x7E)
        .map(char::from)
        .filter(|c| !c.is_ascii_alphanumeric())
        .collect();
    let mut scope = format!("{}{}", unique("lim"), punct);
    scope.push_str(&"s".repeat(255 - scope.len()));
    let mut key = punct.clone();
    key.push_str(&"k".repeat(255 - key.len()));
    let id = id(&scope, &key);
    let big_request: String = format!("{{\"blob\":\"{}\"}}", "x".repeat(64 * 1024 - 12));
    let l = claimed(&store, &claim_for(&id, &big_request, LEASE)).await;
    let body: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8).collect();
    store
        .finish(
            &id,
            l.token,
            &done(StoredResponse::new(200).with_body(body.clone())),
        )
        .await
        .unwrap();
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(r.scope.as_str(), scope);
    assert_eq!(r.key.as_str(), key);
    assert_eq!(r.request.as_deref(), Some(big_request.as_str()));
    assert_eq!(r.response.unwrap().body(), &body[..]);
}

pub async fn retry_takeover_only_inside_the_window(store: Arc<dyn Store>) {
    let (id, first) = claimed_key(&store, "takeover", Duration::ZERO).await;
    // Without a window: the retry sees the key, it does not take it.
    assert!(matches!(
        store.claim(&claim_for(&id, "{}", LEASE)).await.unwrap(),
        ClaimOutcome::Existing { .. }
    ));
    // With a window but another request: refused.
    let mut other = claim_for(&id, "{\"other\":1}", LEASE);
    other.takeover_window = Some(Duration::from_secs(3600));
    assert!(matches!(
        store.claim(&other).await.unwrap(),
        ClaimOutcome::Existing { .. }
    ));
    // With a window that already passed: refused.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut late = claim_for(&id, "{}", LEASE);
    late.takeover_window = Some(Duration::from_millis(1));
    assert!(matches!(
        store.claim(&late).await.unwrap(),
        ClaimOutcome::Existing { .. }
    ));
    // Inside the window, same request: a fenced takeover.
    let mut ok = claim_for(&id, "{}", LEASE);
    ok.takeover_window = Some(Duration::from_secs(3600));
    let l = claimed(&store, &ok).await;
    assert_eq!(
        (l.transition, l.token, l.attempts),
        (Transition::Takeover, LeaseToken(first.token.0 + 1), 2)
    );
    // A live lease is never taken over.
    assert!(matches!(
        store.claim(&ok).await.unwrap(),
        ClaimOutcome::Existing { .. }
    ));
}

pub async fn leases_use_the_database_clock(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "clock", Duration::from_secs(30)).await;
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(l.expires_at - r.created_at, chrono::Duration::seconds(30));
    let now = store.now().await.unwrap();
    assert!(now >= r.created_at && now < l.expires_at);
}

pub async fn stats_count_every_state(store: Arc<dyn Store>) {
    let scope = unique("stats");
    let before = store.stats().await.unwrap();
    let a = id(&scope, "a");
    claimed(&store, &claim_for(&a, "{}", LEASE)).await;
    let b = id(&scope, "b");
    claimed(&store, &claim_for(&b, "{}", Duration::ZERO)).await;
    let c = id(&scope, "c");
    let l = claimed(&store, &claim_for(&c, "{}", LEASE)).await;
    store
        .finish(&c, l.token, &done(StoredResponse::new(200)))
        .await
        .unwrap();
    let d = id(&scope, "d");
    let l = claimed(&store, &claim_for(&d, "{}", LEASE)).await;
    store.finish(&d, l.token, &fail(true)).await.unwrap();
    let e = id(&scope, "e");
    let l = claimed(&store, &claim_for(&e, "{}", LEASE)).await;
    store.finish(&e, l.token, &fail(false)).await.unwrap();
    let s = store.stats().await.unwrap();
    assert_eq!(s.processing - before.processing, 2);
    assert_eq!(s.stale - before.stale, 1);
    assert_eq!(s.done - before.done, 1);
    assert_eq!(s.failed_retryable - before.failed_retryable, 1);
    assert_eq!(s.failed_permanent - before.failed_permanent, 1);
    assert!(s.oldest_processing_created_at.unwrap() <= s.now);
}

pub async fn history_survives_purge_and_is_ordered(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "hist", Duration::ZERO).await;
    store
        .release(&id, l.token, &worker_release("unknown"))
        .await
        .unwrap();
    let swept = taken(&store, "s", LEASE, 100).await;
    let t = swept.iter().find(|r| r.key == id.key).unwrap().lease_token;
    let mut f = done(StoredResponse::new(201));
    f.actor = Actor::Sweeper;
    store.finish(&id, t, &f).await.unwrap();
    let h = store.history(&id).await.unwrap();
    let seqs: Vec<i64> = h.iter().map(|e| e.seq).collect();
    let mut sorted = seqs.clone();
    sorted.sort();
    assert_eq!(seqs, sorted);
    let actors: Vec<Actor> = h.iter().map(|e| e.actor).collect();
    assert_eq!(
        actors,
        [Actor::Worker, Actor::Worker, Actor::Sweeper, Actor::Sweeper]
    );
    assert_eq!(h[3].to, Some(KeyState::Done));
    assert_eq!(h[3].lease_token, Some(t));
}

/// `n` claims of one key spread over `stores` (separate pools or connections: separate app
/// instances): exactly one wins, every loser sees the winner's row, one history row.
pub async fn race_claims_across(stores: &[Arc<dyn Store>], n: usize) {
    let id = id(&unique("race"), "one-key");
    let mut tasks = Vec::new();
    for i in 0..n {
        let store = stores[i % stores.len()].clone();
        let c = claim_for(&id, "{}", LEASE);
        tasks.push(tokio::spawn(async move { store.claim(&c).await }));
    }
    let mut winners = 0;
    let mut tokens = HashSet::new();
    for t in tasks {
        match t.await.unwrap().unwrap() {
            ClaimOutcome::Claimed(l) => {
                tokens.insert(l.token);
                winners += 1;
            }
            ClaimOutcome::Existing { record, .. } => {
                assert_eq!(record.state, KeyState::Processing);
                tokens.insert(record.lease_token);
            }
        }
    }
    assert_eq!(
        tokens.len(),
        1,
        "every loser sees the winner's token: {tokens:?}"
    );
    assert_eq!(winners, 1, "exactly one of {n} claims wins");
    for store in stores {
        assert_eq!(store.history(&id).await.unwrap().len(), 1);
    }
}

/// Four sweepers, spread over `stores`, drain 200 stale keys in small batches: every key is
/// taken exactly once.
pub async fn sweepers_take_each_key_once_across(stores: &[Arc<dyn Store>]) {
    let scope = unique("sweepers");
    for i in 0..200 {
        claimed(
            &stores[0],
            &claim_for(&id(&scope, &format!("k{i}")), "{}", Duration::ZERO),
        )
        .await;
    }
    let mut tasks = Vec::new();
    for s in 0..4 {
        let store = stores[s % stores.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let batch = store
                    .take_stale(&TakeStale {
                        owner: format!("sweeper-{s}"),
                        lease: LEASE,
                        limit: 7,
                        scope: None,
                    })
                    .await
                    .unwrap();
                if batch.is_empty() {
                    return mine;
                }
                mine.extend(batch.into_iter().map(|r| r.key.to_string()));
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let taken = all.len();
    let distinct: HashSet<String> = all.into_iter().collect();
    assert_eq!(
        (taken, distinct.len()),
        (200, 200),
        "each key taken exactly once"
    );
    let s = stores[0].stats().await.unwrap();
    assert_eq!((s.processing, s.stale), (200, 0));
}

pub async fn concurrent_sweepers_take_each_key_once(store: Arc<dyn Store>) {
    sweepers_take_each_key_once_across(&[store]).await;
}

/// Durations are capped (at about 100 years) on every backend: `Duration::MAX` as a lease,
/// retention or window is accepted and reads back as sane, far-future times.
pub async fn huge_durations_are_capped_and_read_back_sane(store: Arc<dyn Store>) {
    let id = id(&unique("huge"), "k1");
    let now = store.now().await.unwrap();
    let far = now + chrono::Duration::days(366 * 101);
    let mut c = claim_for(&id, "{}", Duration::MAX);
    c.retention = Duration::MAX;
    c.takeover_window = Some(Duration::MAX);
    let l = claimed(&store, &c).await;
    assert!(
        l.expires_at > now + chrono::Duration::days(365 * 99),
        "{l:?}"
    );
    assert!(l.expires_at < far, "{l:?}");
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(r.lease_expires_at, Some(l.expires_at));
    let extended = store.extend(&id, l.token, Duration::MAX).await.unwrap();
    assert!(extended >= l.expires_at && extended < far, "{extended}");
    let rec = finished(&store, &id, l.token).await;
    let exp = rec.expires_at.expect("expires_at");
    assert!(
        exp > now + chrono::Duration::days(365 * 99) && exp < far,
        "{exp}"
    );
    let again = store.get(&id).await.unwrap().unwrap();
    assert_eq!(again.expires_at, Some(exp));
    assert_eq!(store.count_expired().await.unwrap(), 0);
}

/// An operator's conditional write (`idemflow resolve` without `--force`): it reads the key,
/// then writes with [`FinishMode::OverrideIf`] on the token it read. A worker that finished in
/// between keeps its result: the write is `LeaseLost` and changes nothing. A takeover in between too.
pub async fn operator_write_is_a_compare_and_set_on_the_token_read(store: Arc<dyn Store>) {
    let (id, l) = claimed_key(&store, "cas", LEASE).await;
    let read = store.get(&id).await.unwrap().unwrap();
    assert_eq!(read.lease_token, l.token);
    // The worker finishes between the operator's read and write.
    finished(&store, &id, l.token).await;
    let decision = no_charge_found();
    refused_as_done(
        store
            .finish_as(&id, FinishMode::OverrideIf(read.lease_token), &decision)
            .await,
    );
    let after = store.get(&id).await.unwrap().unwrap();
    assert_eq!(after.state, KeyState::Done);
    assert_eq!(after.response.unwrap().status(), 201);
    assert_eq!(store.history(&id).await.unwrap().len(), 2);

    // A takeover between read and write moves the token: refused as well.
    let id2 = crate::conformance::id(&unique("cas"), "k2");
    let l2 = claimed(&store, &claim_for(&id2, "{}", Duration::ZERO)).await;
    let mut retry = claim_for(&id2, "{}", LEASE);
    retry.takeover_window = Some(Duration::from_secs(3600));
    let taken = claimed(&store, &retry).await;
    assert!(taken.token > l2.token);
    assert!(matches!(
        store
            .finish_as(&id2, FinishMode::OverrideIf(l2.token), &decision)
            .await,
        Err(StoreError::LeaseLost { .. })
    ));
    // With the token still current, the operator's write goes through and fences the worker.
    let r = store
        .finish_as(&id2, FinishMode::OverrideIf(taken.token), &decision)
        .await
        .unwrap();
    assert_eq!(r.state, KeyState::Failed { retryable: true });
    assert!(r.lease_token > taken.token);
}

/// Lease tokens only grow, across purge (and Redis expiry): a key re-created after its row was
/// purged gets a token greater than any its earlier life handed out, so a worker stalled past
/// lease + retention cannot finish the new row with its old token.
pub async fn tokens_only_grow_across_purge(store: Arc<dyn Store>) {
    let id = id(&unique("regrow"), "k1");
    let mut c = claim_for(&id, "{}", Duration::ZERO);
    c.retention = Duration::ZERO;
    let first = claimed(&store, &c).await;
    // A retry takes the expired lease over (+1), then finishes; the first worker stalls.
    let mut retry = c.clone();
    retry.takeover_window = Some(Duration::from_secs(3600));
    let second = claimed(&store, &retry).await;
    assert_eq!(second.token, LeaseToken(first.token.0 + 1));
    finished(&store, &id, second.token).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    while store.purge_expired(100).await.unwrap() > 0 {}
    assert!(store.get(&id).await.unwrap().is_none(), "purged");
    // The key is re-created by another request.
    let mut again = claim_for(&id, "{\"new\":1}", LEASE);
    again.retention = Duration::from_secs(3600);
    let third = claimed(&store, &again).await;
    assert_eq!(third.transition, Transition::Claim);
    assert!(
        third.token > second.token && third.token > first.token,
        "{third:?} after {second:?}"
    );
    // The stalled workers' finishes are fenced out of the new row.
    for stale in [first.token, second.token] {
        assert!(matches!(
            store
                .finish(&id, stale, &done(StoredResponse::new(299)))
                .await,
            Err(StoreError::LeaseLost { .. })
        ));
    }
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(r.state, KeyState::Processing);
    assert_eq!(r.lease_token, third.token);
    assert_eq!(r.request.as_deref(), Some("{\"new\":1}"));
}

/// Store calls dropped at every point of their execution (a client that disconnects drops its
/// request's future; a lease renewal is dropped when its operation ends) leave the store usable
/// and every row whole, its state and token matching its last history event. Found by the
/// simulation: an in-memory SQLite database lost its tables (its only connection was closed),
/// and a MariaDB connection came back from the pool inside a transaction that a dropped `BEGIN`
/// had opened, failing every later `take_stale`.
pub async fn cancelled_calls_leave_the_store_usable(store: Arc<dyn Store>) {
    let scope = unique("cancelled");
    let lease = Duration::from_millis(20);
    let take = TakeStale {
        owner: "cancel-sweeper".into(),
        lease,
        limit: 5,
        scope: None,
    };
    let mut ids = Vec::new();
    for i in 0..200u64 {
        // 0 to 2 ms: before, during and after a round trip to a local database.
        let cut = Duration::from_micros(i % 50 * 40);
        let k = id(&scope, &format!("k{i}"));
        let _ = tokio::time::timeout(cut, store.claim(&claim_for(&k, "{}", lease))).await;
        let _ = tokio::time::timeout(cut, store.take_stale(&take)).await;
        if let Some(prev) = ids.last() {
            let _ = tokio::time::timeout(cut, store.extend(prev, LeaseToken(1), lease)).await;
        }
        ids.push(k);
    }
    store
        .take_stale(&take)
        .await
        .expect("take_stale still works");
    let after = id(&scope, "after");
    claimed(&store, &claim_for(&after, "{}", lease)).await;
    for k in &ids {
        let Some(rec) = store.get(k).await.expect("get still works") else {
            assert!(
                store.history(k).await.unwrap().is_empty(),
                "{k}: history without a row"
            );
            continue;
        };
        let history = store.history(k).await.unwrap();
        let last = history
            .last()
            .unwrap_or_else(|| panic!("{k}: a row without history"));
        assert_eq!(last.to, Some(rec.state), "{k}: row and history disagree");
        assert_eq!(last.lease_token, Some(rec.lease_token), "{k}");
    }
}

/// The provider rule of the claim (`store::claimable`): a `failed{retryable}` key on which no
/// attempt may have acted is reclaimed through another provider, and the row then records that
/// provider and its provider key; an expired processing key (an attempt may have acted) is
/// taken over only through the provider it recorded.
pub async fn provider_changes_only_while_no_attempt_may_have_acted(store: Arc<dyn Store>) {
    let id = id(&unique("provider"), "k1");
    let mut via_a = claim_for(&id, "{}", LEASE);
    via_a.provider = Some("mail_a".into());
    via_a.provider_key = "pk-a".into();
    let l = claimed(&store, &via_a).await;
    // mail_a answered 429: surely nothing happened.
    store.finish(&id, l.token, &fail(true)).await.unwrap();
    let mut via_b = claim_for(&id, "{}", Duration::ZERO);
    via_b.provider = Some("mail_b".into());
    via_b.provider_key = "pk-b".into();
    via_b.takeover_window = Some(Duration::from_secs(3600));
    let l = claimed(&store, &via_b).await;
    assert_eq!(l.transition, Transition::Reclaim);
    assert_eq!(
        l.provider_key, "pk-b",
        "the provider that may act gets its key"
    );
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (r.provider.as_deref(), r.provider_key.as_str()),
        (Some("mail_b"), "pk-b"),
        "the sweeper must ask the provider that may act"
    );
    // mail_b may have acted (timeout after sending); its lease has run out.
    let rel = worker_release("timeout after send");
    store.release(&id, l.token, &rel).await.unwrap();
    let mut back_to_a = via_b.clone();
    back_to_a.provider = Some("mail_a".into());
    back_to_a.provider_key = "pk-a".into();
    match store.claim(&back_to_a).await.unwrap() {
        ClaimOutcome::Existing { record, .. } => {
            assert_eq!(record.state, KeyState::Processing);
            assert_eq!(record.provider.as_deref(), Some("mail_b"));
        }
        other => panic!("a takeover through another provider: {other:?}"),
    }
    let mut keyless = via_b.clone();
    keyless.provider = None;
    assert!(
        matches!(
            store.claim(&keyless).await.unwrap(),
            ClaimOutcome::Existing { .. }
        ),
        "no provider is another provider too"
    );
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (r.provider.as_deref(), r.provider_key.as_str(), r.attempts),
        (Some("mail_b"), "pk-b", 2),
        "a refused claim changes nothing"
    );
    // Through the recorded provider the takeover goes ahead, and keeps the recorded key.
    let mut again_b = via_b.clone();
    again_b.provider_key = "pk-other".into();
    let l = claimed(&store, &again_b).await;
    assert_eq!(
        (l.transition, l.provider_key.as_str()),
        (Transition::Takeover, "pk-b")
    );
}

/// A key re-created after its earlier row was purged stores the renewed key of the claim's
/// `renewed_key_base` and its life number, the position of the claim's event in the key's
/// history (`provider_key::renewed`; the provider may still hold the earlier row's key); a
/// first row stores `provider_key`, and every later claim of a row keeps the key the row
/// stored, a provider change included (the simulation found each case: a change that stored a key
/// drawn by its own claim was sent again under another when a failover lost it; a change in a
/// re-created life that stored the plain key sent the first life's key; a re-creation lost in a
/// failover drew another key when made again, where a key read from the history is the same).
pub async fn a_re_created_key_gets_its_own_provider_key(store: Arc<dyn Store>) {
    use crate::provider_key::renewed;
    let id = id(&unique("reborn"), "k1");
    let life = |history: Vec<crate::record::KeyEvent>| history.len() as u64;
    let mut first = claim_for(&id, "{}", LEASE);
    first.retention = Duration::ZERO;
    first.renewed_key_base = Some("pk-renewed-".into());
    let l = claimed(&store, &first).await;
    assert_eq!(l.provider_key, "pk-k1", "a first row derives the plain key");
    // A provider change in the first life keeps the row's key.
    store.finish(&id, l.token, &fail(true)).await.unwrap();
    let mut moved = first.clone();
    moved.provider = Some("other".into());
    moved.renewed_key_base = Some("pk-fresh-".into());
    let l = claimed(&store, &moved).await;
    assert_eq!(
        (l.transition, l.provider_key.as_str()),
        (Transition::Reclaim, "pk-k1"),
        "a provider change keeps the key of the life"
    );
    finished(&store, &id, l.token).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    while store.get(&id).await.unwrap().is_some() {
        assert!(
            store.purge_expired(100).await.unwrap() > 0,
            "the expired key is purged"
        );
    }
    let mut reborn = claim_for(&id, "{\"day\":2}", LEASE);
    reborn.renewed_key_base = Some("pk-renewed-".into());
    let l = claimed(&store, &reborn).await;
    assert_eq!(l.transition, Transition::Claim);
    let n = life(store.history(&id).await.unwrap());
    assert!(n > 3, "the history of the first life is kept: {n} events");
    let reborn_key = renewed("pk-renewed-", n);
    assert_eq!(
        l.provider_key, reborn_key,
        "a re-created row sends a key of its own, numbered by its claim's place in the history"
    );
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().provider_key,
        reborn_key
    );
    // Its own reclaim keeps it.
    store.finish(&id, l.token, &fail(true)).await.unwrap();
    let mut retry = reborn.clone();
    retry.renewed_key_base = Some("pk-other-base-".into());
    let l = claimed(&store, &retry).await;
    assert_eq!(
        (l.transition, l.provider_key.as_str()),
        (Transition::Reclaim, reborn_key.as_str())
    );
    // So does a provider change in this life: neither the first life's key (the plain one, the
    // length of the life's own here) nor a renewed one of its own.
    store.finish(&id, l.token, &fail(true)).await.unwrap();
    let mut moved = retry.clone();
    moved.provider = Some("other".into());
    moved.provider_key = "pk-plain-k1-0123456".into();
    assert_eq!(moved.provider_key.len(), reborn_key.len());
    let l = claimed(&store, &moved).await;
    assert_eq!(
        (l.transition, l.provider_key.as_str()),
        (Transition::Reclaim, reborn_key.as_str()),
        "a provider change keeps the key of the re-created life"
    );
    // Unless the new provider's key is shorter (a tighter limit): then the renewed key of the
    // change's own place in the history.
    store.finish(&id, l.token, &fail(true)).await.unwrap();
    let mut tight = moved.clone();
    tight.provider = Some("fake".into());
    tight.provider_key = "pk-k1".into();
    tight.renewed_key_base = Some("pk-r-".into());
    let l = claimed(&store, &tight).await;
    let n = life(store.history(&id).await.unwrap());
    assert_eq!(
        (l.transition, l.provider_key.as_str()),
        (Transition::Reclaim, renewed("pk-r-", n).as_str()),
        "a key longer than the new provider's own is not kept"
    );
    // An explicit key (no renewed base) is stored as given, history or not.
    let other = super::id(&unique("reborn"), "k2");
    let l = claimed(&store, &claim_for(&other, "{}", LEASE)).await;
    assert_eq!(l.provider_key, "pk-k2");
}

/// The attempt history on the row, which the sweeper's search-lag and retry rules read
/// (`docs/design.md`, "Attempt history and the one rule"), through the writes that move it
/// without their history event telling: a sweeper's takeover of a lease that ran out (the
/// crashed holder may have sent until the lease's end, and may have acted), `mark_attempt` before
/// a re-drive, a finish into `failed{retryable}` (then nothing may have acted), and the reclaim
/// after it, which also takes the claim's retention.
pub async fn attempt_history_follows_every_write(store: Arc<dyn Store>) {
    let (id, first) = claimed_key(&store, "attempts", Duration::from_millis(50)).await;
    assert!(!first.may_have_acted);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The holder crashed; the sweeper takes the key over.
    let swept = taken(&store, "sweeper", LEASE, 10).await;
    assert_eq!(swept.len(), 1);
    let token = swept[0].lease_token;
    assert!(swept[0].may_have_acted, "the crashed holder may have acted");
    assert_eq!(
        swept[0].last_attempt_at, first.expires_at,
        "the crashed holder may have sent until its lease ended"
    );
    // The sweeper is about to re-drive.
    let before = store.now().await.unwrap();
    store.mark_attempt(&id, token).await.unwrap();
    let marked = store.get(&id).await.unwrap().unwrap();
    assert!(
        marked.last_attempt_at >= before && marked.may_have_acted,
        "mark_attempt at {before}: {marked:?}"
    );
    // The provider shows surely nothing: failed{retryable}, and nothing may have acted now.
    let failed = store.finish(&id, token, &fail(true)).await.unwrap();
    assert!(!failed.may_have_acted, "{failed:?}");
    // The retry reclaims it as a clean attempt, under the retention it asks for.
    let mut retry = claim_for(&id, "{}", LEASE);
    retry.retention = Duration::from_secs(7200);
    let again = claimed(&store, &retry).await;
    assert_eq!(again.transition, Transition::Reclaim);
    assert!(!again.may_have_acted);
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(r.retention_ms, 7_200_000);
    assert!(r.last_attempt_at >= marked.last_attempt_at, "{r:?}");
}
