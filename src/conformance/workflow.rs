//! The workflow suite: steps inside one key, written once against `Arc<dyn Store>` and run on
//! every backend through [`sweeper_tests!`](crate::sweeper_tests).

// Each suite function's name is the promise it checks.
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sweeper::{SweepReport, Unresolved};
use crate::workflow::step_key;
use crate::{
    Error, Execution, Idempotency, IdempotentRequest, KeyState, Outcome, Providers, Store,
    StoredResponse, Sweeper, error::RequestError, key::KeyError, workflow::Step,
};

use super::FaultyStore;
use super::fake::FakeProvider;
use super::sweeper::{LEASE, cut_when, live_worker, row, wait_stale, worker};
use super::unique;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// Runs the checkout `o1` in `scope` again with `op`: it is replayed with `earlier`'s answer.
async fn replays<F, Fut>(idem: &Idempotency, scope: &str, op: F, earlier: &Execution)
where
    F: FnOnce(crate::Context) -> Fut,
    Fut: std::future::Future<Output = Outcome>,
{
    let again = idem.execute(checkout(scope, "o1"), op).await.unwrap();
    assert!(again.is_replay());
    assert_eq!(again.response(), earlier.response());
}

/// How many times the charge step and the email step have run.
fn counts(charges: &AtomicU32, emails: &AtomicU32) -> (u32, u32) {
    (
        charges.load(Ordering::SeqCst),
        emails.load(Ordering::SeqCst),
    )
}

/// Runs `sweeper` every 50 ms until `done` holds after a run, failing after 30 s; `done` sees
/// each run's report.
async fn sweep_until(
    sweeper: &Sweeper,
    what: &str,
    mut done: impl AsyncFnMut(&SweepReport) -> bool,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let report = sweeper.run_once().await.unwrap();
        if done(&report).await {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never {what}: {report:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn checkout(scope: &str, key: &str) -> IdempotentRequest {
    IdempotentRequest::new(
        scope,
        key,
        "checkout",
        &serde_json::json!({"order": key, "amount": 500}),
    )
    .unwrap()
    .workflow()
}

fn ok(body: serde_json::Value) -> Outcome {
    Outcome::Succeeded(StoredResponse::json(201, &body).unwrap())
}

fn step(name: &str) -> Step {
    Step::new(name, &serde_json::json!({"step": name})).unwrap()
}

/// A step operation that counts its runs (when it runs, not when it is built) and answers
/// `answer(run)`.
fn counted(
    runs: &Arc<AtomicU32>,
    answer: impl FnOnce(u32) -> Outcome,
) -> impl FnOnce(crate::Context) -> std::future::Ready<Outcome> {
    let runs = runs.clone();
    move |_ctx| {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        std::future::ready(answer(n))
    }
}

fn sweeper_with(store: &Arc<dyn Store>, providers: Providers) -> Sweeper {
    Sweeper::new(store.clone(), providers)
        .owner("test-sweeper")
        .backoff(Duration::ZERO, Duration::ZERO)
}

/// A step that finished is replayed, never run again, when the workflow runs again; the first
/// unfinished step runs; the workflow's final answer is replayed on every later retry.
pub async fn finished_steps_never_run_again(store: Arc<dyn Store>) {
    let scope = unique("wf-replay");
    let idem = worker(&store);
    let (charges, emails) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let run = |charges: Arc<AtomicU32>, emails: Arc<AtomicU32>| {
        move |ctx: crate::Context| async move {
            let charge = match ctx
                .step(
                    step("charge"),
                    counted(&charges, |n| ok(serde_json::json!({"charge": n}))),
                )
                .await
            {
                Ok(e) => e,
                Err(e) => return Outcome::from_step_error(&e),
            };
            // The email provider refuses the first time without acting: retryable.
            let email = ctx
                .step(
                    step("email"),
                    counted(&emails, |n| {
                        if n == 1 {
                            Outcome::retryable("rate limited")
                        } else {
                            ok(serde_json::json!({"email": n}))
                        }
                    }),
                )
                .await;
            match email {
                Ok(email) => ok(serde_json::json!({
                    "charge": charge.response().body_json::<serde_json::Value>().unwrap(),
                    "email": email.response().body_json::<serde_json::Value>().unwrap(),
                })),
                Err(e) => Outcome::from_step_error(&e),
            }
        }
    };
    let first = idem
        .execute(checkout(&scope, "o1"), run(charges.clone(), emails.clone()))
        .await;
    expect_match!(first, Err(Error::FailedRetryable { .. }));
    assert_eq!(counts(&charges, &emails), (1, 1));
    let second = idem
        .execute(checkout(&scope, "o1"), run(charges.clone(), emails.clone()))
        .await
        .unwrap();
    assert!(!second.is_replay());
    assert_eq!(
        counts(&charges, &emails),
        (1, 2),
        "the finished charge step replayed; the email step ran again"
    );
    let body: serde_json::Value = second.response().body_json().unwrap();
    assert_eq!(
        body,
        serde_json::json!({"charge": {"charge": 1}, "email": {"email": 2}})
    );
    replays(&idem, &scope, run(charges.clone(), emails.clone()), &second).await;
    assert_eq!(counts(&charges, &emails), (1, 2));
}

/// Each step has its own provider key: the same on every attempt of the step, distinct from
/// the other steps' and the workflow's; a provider sees one stable key per step.
pub async fn steps_have_distinct_stable_provider_keys(store: Arc<dyn Store>) {
    let cards = FakeProvider::keyed("cards", DAY);
    let scope = unique("wf-keys");
    let idem = worker(&store);
    let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let attempts = Arc::new(AtomicU32::new(0));
    let mut results = Vec::new();
    for _ in 0..2 {
        let (seen, attempts, cards) = (seen.clone(), attempts.clone(), cards.clone());
        let result = idem
            .execute(checkout(&scope, "o1"), move |ctx| async move {
                seen.lock()
                    .unwrap()
                    .push(("workflow".into(), ctx.provider_key().to_owned()));
                let charge = Step::new("charge", &serde_json::json!({"amount": 500})).unwrap();
                if let Err(e) = ctx.call_step(charge, &*cards).await {
                    return Outcome::from_step_error(&e);
                }
                let seen2 = seen.clone();
                let notify = ctx
                    .step(step("notify"), move |s| async move {
                        seen2
                            .lock()
                            .unwrap()
                            .push(("notify".into(), s.provider_key().to_owned()));
                        if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                            Outcome::retryable("warehouse busy")
                        } else {
                            ok(serde_json::json!({"notified": true}))
                        }
                    })
                    .await;
                match notify {
                    Ok(_) => ok(serde_json::json!({"ok": true})),
                    Err(e) => Outcome::from_step_error(&e),
                }
            })
            .await;
        results.push(result);
    }
    assert!(
        matches!(results[0], Err(Error::FailedRetryable { .. })),
        "{results:?}"
    );
    assert!(
        matches!(results[1], Ok(Execution::Executed(_))),
        "{results:?}"
    );
    let seen = seen.lock().unwrap().clone();
    let notify: Vec<_> = seen.iter().filter(|(s, _)| s == "notify").collect();
    assert_eq!(notify.len(), 2, "{seen:?}");
    assert_eq!(notify[0].1, notify[1].1, "the step's key is stable");
    let charges = cards.effects();
    assert_eq!(charges.len(), 1, "one charge");
    let workflow = &seen.iter().find(|(s, _)| s == "workflow").unwrap().1;
    let keys = [&charges[0].provider_key, &notify[0].1, workflow];
    for (i, a) in keys.iter().enumerate() {
        for b in &keys[i + 1..] {
            assert_ne!(a, b, "distinct provider keys per step: {keys:?}");
        }
    }
    // The step rows record the same keys.
    let id = checkout(&scope, "o1").id().clone();
    assert_eq!(
        &row(&store, &step_key(&id, 0)).await.provider_key,
        &charges[0].provider_key
    );
    assert_eq!(
        row(&store, &step_key(&id, 1)).await.provider_key,
        notify[0].1
    );
}

/// The recovery point is the finished step's own row: a process that dies right after a step
/// finished leaves that step `done` with its answer, and the retry continues from the next step.
pub async fn a_crash_after_a_step_resumes_from_the_next(store: Arc<dyn Store>) {
    let scope = unique("wf-crash");
    let idem = worker(&store);
    let (charges, emails) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (at, reached) = tokio::sync::oneshot::channel();
    let c = charges.clone();
    cut_when(
        idem.execute(checkout(&scope, "o1"), move |ctx| async move {
            let _ = ctx
                .step(
                    step("charge"),
                    counted(&c, |_| ok(serde_json::json!({"charge": 1}))),
                )
                .await;
            let _ = at.send(());
            std::future::pending::<Outcome>().await
        }),
        reached,
    )
    .await;
    let id = checkout(&scope, "o1").id().clone();
    let charge = row(&store, &step_key(&id, 0)).await;
    assert_eq!(charge.state, KeyState::Done);
    assert_eq!(charge.operation, "charge");
    assert!(charge.response.is_some());
    assert_eq!(row(&store, &id).await.state, KeyState::Processing);
    assert!(store.get(&step_key(&id, 1)).await.unwrap().is_none());

    // While the dead worker's lease runs, a retry is told it is in flight.
    let early = idem
        .execute(checkout(&scope, "o1"), |_ctx| async {
            ok(serde_json::json!({"unexpected": true}))
        })
        .await;
    expect_match!(early, Err(Error::InFlight { .. }));
    wait_stale().await;
    let run = |charges: Arc<AtomicU32>, emails: Arc<AtomicU32>| {
        move |ctx: crate::Context| async move {
            let steps = async {
                ctx.step(
                    step("charge"),
                    counted(&charges, |_| ok(serde_json::json!({"charge": 2}))),
                )
                .await?;
                ctx.step(
                    step("email"),
                    counted(&emails, |_| ok(serde_json::json!({"email": 1}))),
                )
                .await
            };
            match steps.await {
                Ok(_) => ok(serde_json::json!({"order": "o1"})),
                Err(e) => Outcome::from_step_error(&e),
            }
        }
    };
    let retry = idem
        .execute(checkout(&scope, "o1"), run(charges.clone(), emails.clone()))
        .await
        .unwrap();
    assert!(matches!(retry, Execution::Executed(_)));
    assert_eq!(
        counts(&charges, &emails),
        (1, 1),
        "the charge ran once, the email once"
    );
    replays(&idem, &scope, run(charges.clone(), emails.clone()), &retry).await;
}

/// A renamed or removed step is a typed error naming the workflow and the step; the renamed
/// step does not run, and the workflow is never finished past the change.
pub async fn renamed_or_removed_steps_are_refused(store: Arc<dyn Store>) {
    let scope = unique("wf-changed");
    let idem = worker(&store);
    let runs = Arc::new(AtomicU32::new(0));
    // Deploy 1: charge, email, then the workflow is retryable (a downstream check failed).
    let r = runs.clone();
    let first = idem
        .execute(checkout(&scope, "o1"), move |ctx| async move {
            for name in ["charge", "email"] {
                if let Err(e) = ctx
                    .step(
                        step(name),
                        counted(&r, |_| ok(serde_json::json!({"step": name}))),
                    )
                    .await
                {
                    return Outcome::from_step_error(&e);
                }
            }
            Outcome::retryable("inventory service unavailable")
        })
        .await;
    expect_match!(first, Err(Error::FailedRetryable { .. }));
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // Deploy 2 renamed "charge" to "payment": refused at position 0, nothing runs.
    let r = runs.clone();
    let renamed = idem
        .execute(checkout(&scope, "o1"), move |ctx| async move {
            match ctx
                .step(step("payment"), counted(&r, |_| ok(serde_json::json!({}))))
                .await
            {
                // The operation ignores the error and claims success: still refused.
                Ok(_) | Err(_) => ok(serde_json::json!({"done": true})),
            }
        })
        .await;
    match renamed {
        Err(Error::StepChanged {
            key,
            position,
            recorded,
            found,
        }) => {
            assert_eq!(key.key.as_str(), "o1", "{key}");
            assert_eq!(
                (position, recorded.as_str(), found.as_deref()),
                (0, "charge", Some("payment"))
            );
        }
        other => panic!("expected StepChanged, got {other:?}"),
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the renamed step did not run"
    );
    let id = checkout(&scope, "o1").id().clone();
    assert_eq!(row(&store, &id).await.state, KeyState::Processing);

    // Deploy 3 dropped "email": refused when the operation ends.
    wait_stale().await;
    let r = runs.clone();
    let dropped = idem
        .execute(checkout(&scope, "o1"), move |ctx| async move {
            match ctx
                .step(step("charge"), counted(&r, |_| ok(serde_json::json!({}))))
                .await
            {
                Ok(_) => ok(serde_json::json!({"done": true})),
                Err(e) => Outcome::from_step_error(&e),
            }
        })
        .await;
    match dropped {
        Err(Error::StepChanged {
            position,
            recorded,
            found,
            ..
        }) => assert_eq!((position, recorded.as_str(), found), (1, "email", None)),
        other => panic!("expected StepChanged, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(row(&store, &id).await.state, KeyState::Processing);
}

/// Steps need a workflow, and client keys cannot take a step's key.
pub async fn steps_outside_a_workflow_are_refused(store: Arc<dyn Store>) {
    let scope = unique("wf-refused");
    let idem = worker(&store);
    let runs = Arc::new(AtomicU32::new(0));
    let r = runs.clone();
    let plain = IdempotentRequest::new(&scope, "o1", "checkout", &1).unwrap();
    let seen: Arc<Mutex<Option<String>>> = Arc::default();
    let s = seen.clone();
    let result = idem
        .execute(plain, move |ctx| async move {
            let e = ctx
                .step(step("charge"), counted(&r, |_| ok(serde_json::json!({}))))
                .await
                .unwrap_err();
            *s.lock().unwrap() = Some(format!("{e:?}"));
            Outcome::from_step_error(&e)
        })
        .await;
    expect_match!(result, Err(Error::OutcomeUnknown { .. }));
    let seen = seen.lock().unwrap().clone().unwrap();
    assert!(seen.starts_with("NotAWorkflow"), "{seen}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    let reserved = IdempotentRequest::new(&scope, "o1#step:0", "checkout", &1);
    expect_match!(
        reserved,
        Err(RequestError::InvalidKey(KeyError::Reserved { .. }))
    );
}

/// A crashed workflow whose step's answer was lost: the sweeper settles the step from its
/// provider; the CLI-like sweeper (no resumer) then reports the workflow as waiting for a
/// resumer; the application's sweeper with a resumer drives it to the end without any client
/// retry; the client's later retry replays the resumer's answer. One charge, one email.
pub async fn sweeper_settles_steps_then_resumes_the_workflow(store: Arc<dyn Store>) {
    let cards = FakeProvider::keyed("cards", DAY);
    let mail = FakeProvider::keyed("mail", DAY);
    let scope = unique("wf-resume");
    // Every attempt here must complete (the first one loses its step's answer and releases the
    // keys: they are stale at once), so none may lose its lease to a slow store.
    let idem = live_worker(&store);
    let op = {
        let (cards, mail) = (cards.clone(), mail.clone());
        move |ctx: crate::Context| {
            let (cards, mail) = (cards.clone(), mail.clone());
            async move {
                let charge = Step::new("charge", &serde_json::json!({"amount": 500})).unwrap();
                if let Err(e) = ctx.call_step(charge, &*cards).await {
                    return Outcome::from_step_error(&e);
                }
                let email = Step::new("email", &serde_json::json!({"amount": 1})).unwrap();
                match ctx.call_step(email, &*mail).await {
                    Ok(_) => ok(serde_json::json!({"order": "o1", "paid": true})),
                    Err(e) => Outcome::from_step_error(&e),
                }
            }
        }
    };
    cards.lose_next(1);
    let first = idem.execute(checkout(&scope, "o1"), op.clone()).await;
    expect_match!(first, Err(Error::OutcomeUnknown { .. }));
    assert_eq!((cards.effects().len(), mail.effects().len()), (1, 0));
    wait_stale().await;
    let id = checkout(&scope, "o1").id().clone();
    assert!(
        !is_waiting_for_resumer(&store, &id).await,
        "its charge step is unsettled: it waits for the sweeper, not for a resumer"
    );

    // The operator's cron sweeper knows the providers but cannot run application code.
    let cli = sweeper_with(
        &store,
        Providers::new().with(cards.clone()).with(mail.clone()),
    );
    // Until it is reported (a key re-leased by a late renewal is simply waited for).
    let mut waiting = 0;
    sweep_until(&cli, "reported waiting", async |report| {
        waiting += report.waiting_for_resumer;
        report
            .unresolved
            .iter()
            .any(|u| u.kind == Unresolved::WaitingForResumer)
    })
    .await;
    assert_eq!(waiting, 1, "the workflow is reported waiting for a resumer");
    assert!(is_waiting_for_resumer(&store, &id).await, "and counted so");
    assert_eq!(row(&store, &step_key(&id, 0)).await.state, KeyState::Done);
    assert_eq!(row(&store, &id).await.state, KeyState::Processing);
    assert_eq!(cards.effects().len(), 1, "the re-drive was deduplicated");

    // The application's sweeper, with a resumer, finishes it: no client retry. Its store
    // answers every claim after more than the crashed worker's short lease, as a loaded machine
    // or database may: the resumer's step must still be sent, once.
    let slow: Arc<dyn Store> = Arc::new(
        FaultyStore::new(store.clone()).answer_claims_late(LEASE + Duration::from_millis(200)),
    );
    let app = sweeper_with(
        &store,
        Providers::new().with(cards.clone()).with(mail.clone()),
    )
    .resumer("checkout", live_worker(&slow), op.clone());
    let mut resumed = 0;
    sweep_until(&app, "finished", async |report| {
        resumed += report.resumed;
        row(&store, &id).await.state == KeyState::Done
    })
    .await;
    assert_eq!(resumed, 1, "the workflow is resumed once");
    let r = row(&store, &id).await;
    assert_eq!(r.state, KeyState::Done);
    assert!(!is_waiting_for_resumer(&store, &id).await);
    assert_eq!((cards.effects().len(), mail.effects().len()), (1, 1));

    let retry = idem.execute(checkout(&scope, "o1"), op).await.unwrap();
    assert!(retry.is_replay());
    assert_eq!(Some(retry.response()), r.response.as_ref());
    assert_eq!((cards.effects().len(), mail.effects().len()), (1, 1));
}

async fn is_waiting_for_resumer(store: &Arc<dyn Store>, id: &crate::KeyId) -> bool {
    crate::workflow::waiting_for_resumer(&**store)
        .await
        .unwrap()
        .iter()
        .any(|r| r.scope == id.scope && r.key == id.key)
}

/// An executor with a retry takeover window still never takes over a step whose provider does
/// not replay same-key re-sends: a retry of the workflow after the email step's answer was lost
/// does not send it again (the sweeper settles it by lookup). A keyed step is taken over only
/// inside the provider's window.
pub async fn keyless_steps_are_never_taken_over(store: Arc<dyn Store>) {
    let mail = FakeProvider::no_keys("mail");
    let scope = unique("wf-takeover");
    // Every attempt must reach the provider (each releases its keys): a live lease.
    let idem = live_worker(&store).retry_takeover_window(Some(Duration::from_secs(60)));
    let op = {
        let mail = mail.clone();
        move |ctx: crate::Context| {
            let mail = mail.clone();
            async move {
                let email = Step::new("email", &serde_json::json!({"amount": 1})).unwrap();
                match ctx.call_step(email, &*mail).await {
                    Ok(_) => ok(serde_json::json!({"sent": true})),
                    Err(e) => Outcome::from_step_error(&e),
                }
            }
        }
    };
    mail.lose_next(1);
    let first = idem.execute(checkout(&scope, "o1"), op.clone()).await;
    expect_match!(first, Err(Error::OutcomeUnknown { .. }));
    assert_eq!(mail.effects().len(), 1);
    wait_stale().await;
    let retry = idem.execute(checkout(&scope, "o1"), op).await;
    expect_match!(retry, Err(Error::OutcomeUnknown { .. }));
    assert_eq!(
        mail.effects().len(),
        1,
        "the keyless step was not sent again"
    );
    let id = checkout(&scope, "o1").id().clone();
    assert_eq!(
        row(&store, &step_key(&id, 0)).await.state,
        KeyState::Processing
    );
}

/// The workflow's cut-off (no step may start once a step's record may be purged) follows the
/// retention stored with the workflow and its steps, not the executor's current one: after a
/// deploy that raised the retention, neither a late client retry nor a sweeper's resumer runs
/// again a step whose record was purged under the old retention.
pub async fn cut_off_follows_the_stored_retention(store: Arc<dyn Store>) {
    const OLD: Duration = Duration::from_millis(1500);
    let scope = unique("wf-cutoff");
    let charges = Arc::new(AtomicU32::new(0));
    let op = {
        let charges = charges.clone();
        move |ctx: crate::Context| {
            let charges = charges.clone();
            async move {
                let charge = ctx
                    .step(
                        step("charge"),
                        counted(&charges, |n| ok(serde_json::json!({"charge": n}))),
                    )
                    .await;
                match charge {
                    Ok(_) => Outcome::unknown("the process died after the charge"),
                    Err(e) => Outcome::from_step_error(&e),
                }
            }
        }
    };
    // Deployed with a short retention: each workflow charges, then its outcome is lost.
    let before = worker(&store).retention(OLD);
    for key in ["o1", "o2"] {
        let first = before.execute(checkout(&scope, key), op.clone()).await;
        expect_match!(first, Err(Error::OutcomeUnknown { .. }));
    }
    assert_eq!(charges.load(Ordering::SeqCst), 2);
    // The charges' records expire under the old retention and are purged.
    tokio::time::sleep(OLD + Duration::from_millis(300)).await;
    store.purge_expired(1000).await.unwrap();
    let o1 = checkout(&scope, "o1").id().clone();
    assert!(store.get(&step_key(&o1, 0)).await.unwrap().is_none());

    // Redeployed with a day's retention.
    let after = worker(&store).retention(DAY);
    let retry = after.execute(checkout(&scope, "o1"), op.clone()).await;
    assert!(retry.is_err(), "{retry:?}");
    assert_eq!(
        charges.load(Ordering::SeqCst),
        2,
        "a retry re-ran a purged step: {retry:?}"
    );
    let app = sweeper_with(&store, Providers::new()).resumer("checkout", after, op.clone());
    let report = app.run_once().await.unwrap();
    assert_eq!(
        charges.load(Ordering::SeqCst),
        2,
        "a resumer re-ran a purged step: {report:?}"
    );
}
