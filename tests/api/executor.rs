//! The executor's promises, end to end on SQLite.

use idemflow::store::FinishMode;
use idemflow::store::{OperatorStore, SweeperStore};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::charger::{Charger, body};
use crate::support::sqlite::{file, memory};
use idemflow::store::TakeStale;
use idemflow::{
    Error, Execution, Idempotency, IdempotentRequest, KeyState, Outcome, Store, StoredResponse,
    record::Actor,
};

fn req(scope: &str, key: &str, amount: u64) -> IdempotentRequest {
    IdempotentRequest::new(scope, key, "payments.create", &body(amount)).unwrap()
}

#[tokio::test]
async fn same_key_same_body_runs_once_and_replays_byte_identical() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone());
    let charger = Arc::new(Charger::default());
    let c = charger.clone();
    let first = idem
        .execute(req("acct", "k1", 500), |ctx| c.charge(ctx, 500))
        .await
        .unwrap();
    let mut replays = Vec::new();
    for _ in 0..3 {
        let c = charger.clone();
        replays.push(
            idem.execute(req("acct", "k1", 500), |ctx| c.charge(ctx, 500))
                .await
                .unwrap(),
        );
    }
    assert_eq!(charger.count(), 1);
    assert!(matches!(first, Execution::Executed(_)));
    for r in &replays {
        assert!(r.is_replay());
        assert_eq!(r.response(), first.response());
        assert_eq!(r.response().body(), first.response().body());
    }
    // Only the chosen headers are stored, and the first answer is the stored one.
    let names: Vec<&str> = first
        .response()
        .headers()
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(names, ["content-type", "Location"]);
}

#[tokio::test]
async fn same_key_other_body_is_refused_without_running() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone());
    let charger = Arc::new(Charger::default());
    let c = charger.clone();
    idem.execute(req("acct", "k1", 500), |ctx| c.charge(ctx, 500))
        .await
        .unwrap();
    let c = charger.clone();
    let err = idem
        .execute(req("acct", "k1", 900), |ctx| c.charge(ctx, 900))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::FingerprintMismatch { .. }), "{err}");
    assert_eq!(err.http_status(), 422);
    // Another operation name with the same key and body is also another request.
    let other_op = IdempotentRequest::new("acct", "k1", "refunds.create", &body(500)).unwrap();
    let c = charger.clone();
    assert!(matches!(
        idem.execute(other_op, |ctx| c.charge(ctx, 500)).await,
        Err(Error::FingerprintMismatch { .. })
    ));
    assert_eq!(charger.count(), 1);
}

#[tokio::test]
async fn scopes_with_the_same_key_are_independent() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone());
    let charger = Arc::new(Charger::default());
    let c = charger.clone();
    let a = idem
        .execute(req("acct_a", "k1", 500), |ctx| c.charge(ctx, 500))
        .await
        .unwrap();
    let c = charger.clone();
    let b = idem
        .execute(req("acct_b", "k1", 500), |ctx| c.charge(ctx, 500))
        .await
        .unwrap();
    assert!(!a.is_replay() && !b.is_replay());
    assert_ne!(a.response().body(), b.response().body());
    assert_eq!(charger.count(), 2);
    // The provider keys differ too, so the provider never conflates the two.
    let keys = charger.keys.lock().unwrap().clone();
    assert_ne!(keys[0], keys[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_duplicates_run_the_closure_once() {
    let store = file().await;
    let idem = Idempotency::new(store.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let idem = idem.clone();
        let runs = runs.clone();
        tasks.push(tokio::spawn(async move {
            idem.execute(req("acct", "hot", 500), |_ctx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                Outcome::Succeeded(StoredResponse::new(201).with_body(&b"charged once"[..]))
            })
            .await
        }));
    }
    let (mut executed, mut replayed, mut in_flight) = (0, 0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(Execution::Executed(_)) => executed += 1,
            Ok(Execution::Replayed(r)) => {
                assert_eq!(r.body(), b"charged once");
                replayed += 1;
            }
            Err(Error::InFlight { retry_after, .. }) => {
                assert!(retry_after > Duration::ZERO);
                in_flight += 1;
            }
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(executed, 1);
    assert_eq!(executed + replayed + in_flight, 200);
    let id = req("acct", "hot", 500).id().clone();
    assert_eq!(store.history(&id).await.unwrap().len(), 2);
}

#[tokio::test]
async fn completion_after_takeover_is_lease_lost_and_changes_nothing() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone()).lease(Duration::ZERO);
    let id = req("acct", "zombie", 500).id().clone();
    let s = store.clone();
    let err = idem
        .execute(req("acct", "zombie", 500), |_ctx| async move {
            // While this worker is "stuck", a sweeper takes the expired lease over.
            let taken = s
                .take_stale(&TakeStale {
                    owner: "sweeper".into(),
                    lease: Duration::from_secs(60),
                    limit: 10,
                    scope: None,
                })
                .await
                .unwrap();
            assert_eq!(taken.len(), 1);
            Outcome::Succeeded(StoredResponse::new(201).with_body(&b"late"[..]))
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::LeaseLost(_)), "{err}");
    let row = store.get(&id).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Processing);
    assert_eq!(row.lease_owner.as_deref(), Some("sweeper"));
    assert!(
        row.response.is_none(),
        "the zombie's late result is not written"
    );
}

#[tokio::test]
async fn failure_inside_the_finish_statement_keeps_the_old_state_and_history() {
    let store = memory().await;
    // Inject a failure into the completion's statement, which writes the row and its history
    // entry together.
    sqlx::query(
        "CREATE TRIGGER inject_failure BEFORE UPDATE ON idempotency_keys \
         WHEN NEW.state = 'done' BEGIN SELECT RAISE(ABORT, 'injected history failure'); END",
    )
    .execute(store.writer_pool())
    .await
    .unwrap();
    let idem = Idempotency::new(store.clone());
    let id = req("acct", "atomic", 500).id().clone();
    let err = idem
        .execute(req("acct", "atomic", 500), |_ctx| async {
            Outcome::Succeeded(StoredResponse::new(201).with_body(&b"ok"[..]))
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert!(
        err.to_string().contains("injected history failure"),
        "{err}"
    );
    let row = store.get(&id).await.unwrap().unwrap();
    assert_eq!(
        row.state,
        KeyState::Processing,
        "the row update was rolled back"
    );
    assert!(row.response.is_none());
    assert_eq!(store.history(&id).await.unwrap().len(), 1);
}

#[tokio::test]
async fn retryable_failure_runs_again_permanent_failure_is_replayed() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let err = idem
        .execute(req("acct", "flaky", 500), |_ctx| async move {
            r.fetch_add(1, Ordering::SeqCst);
            Outcome::retryable("connection refused before sending")
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::FailedRetryable { .. }));
    let r = runs.clone();
    let ok = idem
        .execute(req("acct", "flaky", 500), |ctx| async move {
            r.fetch_add(1, Ordering::SeqCst);
            assert_eq!(ctx.attempt(), 2);
            Outcome::Succeeded(StoredResponse::new(201))
        })
        .await
        .unwrap();
    assert!(!ok.is_replay());
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    let r = runs.clone();
    let declined = idem
        .execute(req("acct", "declined", 500), |_ctx| async move {
            r.fetch_add(1, Ordering::SeqCst);
            Outcome::Rejected(
                StoredResponse::json(402, &serde_json::json!({"error": "card_declined"})).unwrap(),
            )
        })
        .await
        .unwrap();
    let r = runs.clone();
    let again = idem
        .execute(req("acct", "declined", 500), |_ctx| async move {
            r.fetch_add(1, Ordering::SeqCst);
            Outcome::Succeeded(StoredResponse::new(201))
        })
        .await
        .unwrap();
    assert!(again.is_replay());
    assert_eq!(again.response().status(), 402);
    assert_eq!(again.response(), declined.response());
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    let id = req("acct", "declined", 500).id().clone();
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().state,
        KeyState::Failed { retryable: false }
    );
}

#[tokio::test]
async fn unknown_outcome_is_never_rerun_by_a_retry() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    for _ in 0..2 {
        let r = runs.clone();
        let err = idem
            .execute(req("acct", "unknown", 500), |_ctx| async move {
                r.fetch_add(1, Ordering::SeqCst);
                Outcome::unknown("read timed out after sending")
            })
            .await
            .unwrap_err();
        assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
        assert_eq!(err.http_status(), 503);
        assert!(err.retry_after().is_some());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let id = req("acct", "unknown", 500).id().clone();
    let row = store.get(&id).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Processing);
    assert_eq!(row.error.as_deref(), Some("read timed out after sending"));
    // Released early: the sweeper can take it at once.
    let taken = store
        .take_stale(&TakeStale {
            owner: "sweeper".into(),
            lease: Duration::from_secs(60),
            limit: 10,
            scope: None,
        })
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);
}

#[tokio::test]
async fn dropping_execute_mid_call_leaves_the_key_processing_under_its_lease() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(300));
    let fut = idem.execute(req("acct", "cancel", 500), |_ctx| async {
        tokio::time::sleep(Duration::from_secs(60)).await;
        Outcome::Succeeded(StoredResponse::new(201))
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(50), fut)
            .await
            .is_err()
    );
    let id = req("acct", "cancel", 500).id().clone();
    let row = store.get(&id).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Processing);
    assert_eq!(
        store.history(&id).await.unwrap().len(),
        1,
        "nothing half-written"
    );
    // A retry while the lease holds is told to wait, and nothing runs.
    let err = idem
        .execute(req("acct", "cancel", 500), |_ctx| async {
            panic!("must not run")
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InFlight { .. }), "{err}");
    // After the lease expires the sweeper can take the key.
    tokio::time::sleep(Duration::from_millis(350)).await;
    let taken = store
        .take_stale(&TakeStale {
            owner: "sweeper".into(),
            lease: Duration::from_secs(60),
            limit: 10,
            scope: None,
        })
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);
}

#[tokio::test]
async fn retry_takes_over_an_expired_lease_only_when_allowed() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone())
        .lease(Duration::ZERO)
        .retry_takeover_window(Some(Duration::from_secs(3600)));
    let keys = Arc::new(std::sync::Mutex::new(Vec::new()));
    let k = keys.clone();
    let fut = idem.execute(req("acct", "redrive", 500), |ctx| async move {
        k.lock().unwrap().push(ctx.provider_key().to_owned());
        std::future::pending::<Outcome>().await
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(20), fut)
            .await
            .is_err()
    );
    let k = keys.clone();
    let done = idem
        .execute(req("acct", "redrive", 500), |ctx| async move {
            assert_eq!(ctx.attempt(), 2);
            k.lock().unwrap().push(ctx.provider_key().to_owned());
            Outcome::Succeeded(StoredResponse::new(201))
        })
        .await
        .unwrap();
    assert!(!done.is_replay());
    let keys = keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1], "the same provider key on every attempt");
}

#[tokio::test]
async fn expired_keys_are_purged_and_history_says_so() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone()).retention(Duration::ZERO);
    idem.execute(req("acct", "old", 500), |_ctx| async {
        Outcome::Succeeded(StoredResponse::new(201))
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.purge_expired(100).await.unwrap(), 1);
    let id = req("acct", "old", 500).id().clone();
    assert!(store.get(&id).await.unwrap().is_none());
    let h = store.history(&id).await.unwrap();
    let states: Vec<_> = h.iter().map(|e| (e.from, e.to, e.actor)).collect();
    assert_eq!(
        states,
        [
            (None, Some(KeyState::Processing), Actor::Worker),
            (
                Some(KeyState::Processing),
                Some(KeyState::Done),
                Actor::Worker
            ),
            (Some(KeyState::Done), None, Actor::Purge),
        ]
    );
}

/// Finding 10 of issue 11: the lease was fixed, so an operation that outlived it was taken over
/// while still running. With default settings, an operation longer than the lease keeps its key.
#[tokio::test]
async fn a_live_operation_longer_than_the_default_lease_is_not_taken_over() {
    let store = file().await;
    let idem = Idempotency::new(store.clone());
    let lease = idem.config().lease;
    let s = store.clone();
    let done = idem
        .execute(req("acct", "long", 500), |ctx| async move {
            tokio::time::sleep(lease + Duration::from_secs(2)).await;
            // Past the first lease, still alive: no sweeper may take the key.
            let taken = s
                .take_stale(&TakeStale {
                    owner: "sweeper".into(),
                    lease: Duration::from_secs(60),
                    limit: 10,
                    scope: None,
                })
                .await
                .unwrap();
            assert!(taken.is_empty(), "a live operation was taken over");
            assert!(!ctx.lease_lost());
            assert!(ctx.lease_expires_at() > chrono::Utc::now());
            Outcome::Succeeded(StoredResponse::new(201))
        })
        .await
        .unwrap();
    assert!(!done.is_replay());
    let id = req("acct", "long", 500).id().clone();
    assert_eq!(store.get(&id).await.unwrap().unwrap().state, KeyState::Done);
}

/// The same with a short lease, so that it runs fast: renewed every third of the lease, the key
/// is never stale while the operation runs.
#[tokio::test]
async fn the_lease_is_renewed_while_the_operation_runs() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(300));
    let s = store.clone();
    let done = idem
        .execute(req("acct", "renewed", 500), |_ctx| async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let taken = s
                    .take_stale(&TakeStale {
                        owner: "sweeper".into(),
                        lease: Duration::from_secs(60),
                        limit: 10,
                        scope: None,
                    })
                    .await
                    .unwrap();
                assert!(taken.is_empty(), "a live operation was taken over");
            }
            Outcome::Succeeded(StoredResponse::new(201))
        })
        .await
        .unwrap();
    assert!(!done.is_replay());
}

/// When another process takes the key over (here an operator override), the next renewal is
/// refused: the operation sees it, and its result is not stored over the new owner's.
#[tokio::test]
async fn a_lost_lease_is_visible_to_the_operation_and_its_result_is_not_stored() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(300));
    let id = req("acct", "overridden", 500).id().clone();
    let (s, oid) = (store.clone(), id.clone());
    let err = idem
        .execute(req("acct", "overridden", 500), |ctx| async move {
            assert!(!ctx.lease_lost());
            let finish = idemflow::store::Finish {
                to: KeyState::Failed { retryable: false },
                response: Some(StoredResponse::new(409).with_body(&b"operator"[..])),
                error: None,
                actor: Actor::Operator,
                reason: "operator settled it".to_owned(),
            };
            s.finish_as(&oid, FinishMode::Override, &finish)
                .await
                .unwrap();
            tokio::time::timeout(Duration::from_secs(5), ctx.lost())
                .await
                .expect("the lost lease is signalled");
            assert!(ctx.lease_lost());
            Outcome::Succeeded(StoredResponse::new(201).with_body(&b"late"[..]))
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::LeaseLost(_)), "{err}");
    assert!(err.to_string().contains("not stored"), "{err}");
    let row = store.get(&id).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Failed { retryable: false });
    assert_eq!(row.response.unwrap().body(), b"operator");
}

/// Settings are user input: the largest lease a `Duration` can hold is capped as the stores cap
/// it (100 years), not added to a local `Instant` as is (which panics on overflow).
#[tokio::test]
async fn a_huge_lease_is_capped_not_a_panic() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone())
        .lease(Duration::MAX)
        .retry_takeover_window(Some(Duration::MAX));
    let out = idem
        .execute(req("s", "huge-lease", 100), |ctx| async move {
            assert!(ctx.may_send(), "a 100-year lease is held");
            Outcome::Succeeded(StoredResponse::json(201, &serde_json::json!({"ok": true})).unwrap())
        })
        .await
        .unwrap();
    assert_eq!(out.response().status(), 201);
}

/// The same for the sweeper: a huge lease does not panic (its batch renewal caps it as well).
#[tokio::test]
async fn a_huge_sweeper_lease_is_capped_not_a_panic() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone()).lease(Duration::ZERO);
    let _ = idem
        .execute(req("s", "orphan", 100), |_ctx| async {
            Outcome::unknown("lost")
        })
        .await;
    let report = idemflow::Sweeper::new(store.clone(), idemflow::Providers::new())
        .lease(Duration::MAX)
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.taken, 1, "{report:?}");
}

/// An email service that always answers 429: it surely did nothing.
#[derive(Debug)]
struct RateLimited(&'static str);

#[idemflow::async_trait]
impl idemflow::Provider for RateLimited {
    fn name(&self) -> &str {
        self.0
    }

    fn key_spec(&self) -> idemflow::provider::KeySpec {
        idemflow::provider::KeySpec::no_keys()
    }

    async fn send(&self, _pk: &str, _request: &serde_json::Value) -> idemflow::provider::CallReply {
        idemflow::provider::CallReply::Retryable {
            reason: "429".into(),
            retry_after: None,
        }
    }

    async fn lookup(
        &self,
        _pk: &str,
        _request: &serde_json::Value,
        _attempts: idemflow::provider::Attempts,
        _now: chrono::DateTime<chrono::Utc>,
    ) -> idemflow::provider::Lookup {
        // Never sent anything: an authoritative "not found", as a consistent search would say.
        idemflow::provider::Lookup::NotFound {
            authoritative: true,
        }
    }
}

#[tokio::test]
async fn a_retry_through_another_provider_is_refused_once_an_attempt_may_have_acted() {
    use idemflow::conformance::fake::FakeProvider;
    use idemflow::{Providers, Sweeper};
    let store = memory().await;
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(200));
    let mail_a = Arc::new(RateLimited("mail_a"));
    let mail_b = FakeProvider::no_keys("mail_b");
    let email = || {
        IdempotentRequest::new(
            "app",
            "welcome-1",
            "email.send",
            &serde_json::json!({"to": "a@example.test", "amount": 1}),
        )
        .unwrap()
    };
    // mail_a answers 429: nothing happened, the key is retryable.
    let err = idem.call(email(), mail_a.as_ref()).await.unwrap_err();
    assert!(matches!(err, Error::FailedRetryable { .. }), "{err}");
    // The app falls back to mail_b: it sends, and its answer is lost.
    mail_b.lose_next(1);
    let err = idem.call(email(), mail_b.as_ref()).await.unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    assert_eq!(mail_b.effects().len(), 1);
    let row = store.get(email().id()).await.unwrap().unwrap();
    assert_eq!(
        row.provider.as_deref(),
        Some("mail_b"),
        "the row must name the provider that may have acted, for the sweeper"
    );
    // Back to mail_a while mail_b may have acted: refused, nothing sent.
    let err = idem.call(email(), mail_a.as_ref()).await.unwrap_err();
    assert!(
        matches!(&err, Error::ProviderChanged { recorded, requested, .. }
            if recorded.as_deref() == Some("mail_b") && requested.as_deref() == Some("mail_a")),
        "{err}"
    );
    assert_eq!(err.http_answer().status, 422);
    // The sweeper asks mail_b, finds the email: done with it; a retry through mail_b replays.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let sweeper = Sweeper::new(
        store.clone(),
        Providers::new().with(mail_a.clone()).with(mail_b.clone()),
    );
    let report = sweeper.run_once().await.unwrap();
    assert_eq!(report.done, 1, "{report:?}");
    let again = idem.call(email(), mail_b.as_ref()).await.unwrap();
    assert!(again.is_replay());
    assert_eq!(mail_b.effects().len(), 1, "one email, never two");
}

/// A card processor whose first answer is lost (it may still be charging) and which refuses
/// every later same-key request with a 422 while the first runs (as PayPal documents: "might
/// fail the second").
#[derive(Debug, Default)]
struct SlowThenRefuses {
    calls: AtomicUsize,
}

#[idemflow::async_trait]
impl idemflow::Provider for SlowThenRefuses {
    fn name(&self) -> &str {
        "slow_cards"
    }

    fn key_spec(&self) -> idemflow::provider::KeySpec {
        idemflow::provider::KeySpec {
            max_len: 64,
            retention: Some(Duration::from_secs(3600)),
            replays_same_key: true,
        }
    }

    async fn send(&self, _pk: &str, _request: &serde_json::Value) -> idemflow::provider::CallReply {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            idemflow::provider::CallReply::Unknown {
                reason: "timed out after sending".into(),
            }
        } else {
            idemflow::provider::CallReply::Rejected {
                response: StoredResponse::json(422, &serde_json::json!({"name": "UNPROCESSABLE"}))
                    .unwrap(),
            }
        }
    }

    async fn lookup(
        &self,
        _pk: &str,
        _request: &serde_json::Value,
        _attempts: idemflow::provider::Attempts,
        _now: chrono::DateTime<chrono::Utc>,
    ) -> idemflow::provider::Lookup {
        idemflow::provider::Lookup::Unknown { retry_after: None }
    }
}

#[tokio::test]
async fn a_refusal_after_an_earlier_attempt_that_may_have_acted_does_not_end_the_key() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone())
        .lease(Duration::from_millis(200))
        .retry_takeover_window(Some(Duration::from_secs(600)));
    let cards = SlowThenRefuses::default();
    let err = idem
        .call(req("acct", "slow-1", 700), &cards)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    // The retry takes the key over (inside the window) and is refused while the first attempt
    // may still be charging: the refusal says nothing about the first attempt.
    let out = idem.call(req("acct", "slow-1", 700), &cards).await;
    assert_eq!(cards.calls.load(Ordering::SeqCst), 2, "the takeover sent");
    assert!(
        matches!(&out, Err(Error::OutcomeUnknown { .. })),
        "a 422 after an attempt that may have acted must not fail the key: {out:?}"
    );
    let row = store
        .get(req("acct", "slow-1", 700).id())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, KeyState::Processing, "left for the sweeper");
}

/// A retry takeover window set for keyed providers is no licence to re-send through a provider
/// that does not dedupe by key: after a keyless send whose answer was lost, the client's retry
/// must not take the key over and send again (found by the simulation's soak, seed 7285: a
/// second email).
#[tokio::test]
async fn a_retry_never_takes_over_a_key_sent_through_a_provider_without_keys() {
    use idemflow::conformance::fake::FakeProvider;
    let store = memory().await;
    let idem = Idempotency::new(store.clone())
        .lease(Duration::from_secs(30))
        .retry_takeover_window(Some(Duration::from_secs(3600)));
    let mail = FakeProvider::no_keys("mail");
    let email = || {
        IdempotentRequest::new(
            "app",
            "receipt-1",
            "email.send",
            &serde_json::json!({"to": "a@example.test", "amount": 1}),
        )
        .unwrap()
    };
    mail.lose_next(1);
    let err = idem.call(email(), mail.as_ref()).await.unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    assert_eq!(mail.effects().len(), 1);
    // The lost answer released the lease: the key is stale at once.
    let again = idem.call(email(), mail.as_ref()).await;
    assert!(again.is_err(), "{again:?}");
    assert_eq!(
        mail.effects().len(),
        1,
        "a retry sent the email a second time"
    );
}
