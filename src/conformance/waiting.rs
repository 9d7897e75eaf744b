//! The waiting suite: duplicates that wait for their first request's answer
//! ([`Idempotency::wait_in_flight`]), through the executor, on any store.
//!
//! The first request's body is held open by a gate the test opens once every duplicate is seen
//! waiting ([`Idempotency::in_flight_waiters`]), so no check depends on how fast the machine
//! is. [`waiting_across_stores`] runs the duplicates through a second store object (another
//! connection or pool), which nothing in this process wakes: what another process sees.

// Each suite function's name is the promise it checks.
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::unique;
use crate::{Error, Execution, Idempotency, IdempotentRequest, Outcome, Store, StoredResponse};

/// Long enough never to be reached by a duplicate that is woken or polls.
const BOUND: Duration = Duration::from_secs(60);
/// How long the suite waits for a condition it expects (generous: loaded machines).
const PATIENCE: Duration = Duration::from_secs(60);

fn request(scope: &str) -> IdempotentRequest {
    IdempotentRequest::new(
        scope,
        "pay-1",
        "payments.create",
        &serde_json::json!({"amount": 4200}),
    )
    .expect("a valid request")
}

fn answer() -> StoredResponse {
    StoredResponse::json(201, &serde_json::json!({"payment": "p-1"})).expect("json")
}

/// The first request, running until `open` is sent; `started` fires when its body runs.
struct Gated {
    first: JoinHandle<Result<Execution, Error>>,
    open: oneshot::Sender<Outcome>,
}

impl Gated {
    /// Lets the first request succeed with [`answer`]; its execution.
    async fn succeed(self) -> Execution {
        self.open.send(Outcome::Succeeded(answer())).unwrap();
        self.first.await.unwrap().unwrap()
    }
}

/// An executor whose duplicates wait for the first answer (up to [`BOUND`]), a new scope
/// `unique(name)` and the count of request bodies run.
fn waiting(store: Arc<dyn Store>, name: &str) -> (Idempotency, String, Arc<AtomicUsize>) {
    let idem = Idempotency::new(store).wait_in_flight(Some(BOUND));
    (idem, unique(name), Arc::new(AtomicUsize::new(0)))
}

async fn gated_first(idem: &Idempotency, scope: &str, runs: &Arc<AtomicUsize>) -> Gated {
    let (open, gate) = oneshot::channel::<Outcome>();
    let (started_tx, started) = oneshot::channel();
    let (idem, req, runs) = (idem.clone(), request(scope), runs.clone());
    let first = tokio::spawn(async move {
        idem.execute(req, |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let _ = started_tx.send(());
            gate.await
                .unwrap_or_else(|_| Outcome::unknown("the test dropped the gate"))
        })
        .await
    });
    started.await.expect("the first request's body started");
    Gated { first, open }
}

fn duplicate(
    idem: &Idempotency,
    scope: &str,
    runs: &Arc<AtomicUsize>,
) -> JoinHandle<Result<Execution, Error>> {
    let (idem, req, runs) = (idem.clone(), request(scope), runs.clone());
    tokio::spawn(async move {
        idem.execute(req, |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Outcome::Succeeded(answer())
        })
        .await
    })
}

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn replayed(result: Result<Execution, Error>) -> StoredResponse {
    match result {
        Ok(Execution::Replayed(r)) => r,
        other => panic!("expected a replay, got {other:?}"),
    }
}

pub async fn duplicates_wait_for_the_first_answer(store: Arc<dyn Store>) {
    let (idem, scope, runs) = waiting(store, "wait");
    let gated = gated_first(&idem, &scope, &runs).await;
    let dups: Vec<_> = (0..20).map(|_| duplicate(&idem, &scope, &runs)).collect();
    until("20 duplicates waiting", || idem.in_flight_waiters() == 20).await;
    let first = match gated.succeed().await {
        Execution::Executed(r) => r,
        other => panic!("the first request ran: {other:?}"),
    };
    for d in dups {
        assert_eq!(
            replayed(d.await.unwrap()),
            first,
            "the first answer, replayed"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    assert_eq!(idem.in_flight_waiters(), 0);
}

pub async fn a_waiter_runs_the_request_when_the_first_did_nothing(store: Arc<dyn Store>) {
    let (idem, scope, runs) = waiting(store, "wait-retry");
    let gated = gated_first(&idem, &scope, &runs).await;
    let dup = duplicate(&idem, &scope, &runs);
    until("the duplicate waiting", || idem.in_flight_waiters() == 1).await;
    // The first attempt surely did nothing: the key is failed{retryable}, and the waiter claims
    // and runs it, as a client's retry would.
    gated
        .open
        .send(Outcome::retryable("the card network was down"))
        .unwrap();
    let first = gated.first.await.unwrap();
    assert!(
        matches!(first, Err(Error::FailedRetryable { .. })),
        "{first:?}"
    );
    match dup.await.unwrap() {
        Ok(Execution::Executed(r)) => assert_eq!(r, answer()),
        other => panic!("the waiter ran the request: {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

pub async fn waiting_ends_at_its_bound_with_in_flight(store: Arc<dyn Store>) {
    let (idem, scope, runs) = waiting(store, "wait-bound");
    let gated = gated_first(&idem, &scope, &runs).await;
    let short = idem
        .clone()
        .wait_in_flight(Some(Duration::from_millis(300)));
    let started = tokio::time::Instant::now();
    let dup = duplicate(&short, &scope, &runs).await.unwrap();
    assert!(matches!(dup, Err(Error::InFlight { .. })), "{dup:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "it waited its bound first: {:?}",
        started.elapsed()
    );
    // Without waiting, the 409 is at once (the same as before the option existed).
    let off = idem.clone().wait_in_flight(None);
    let dup = duplicate(&off, &scope, &runs).await.unwrap();
    assert!(matches!(dup, Err(Error::InFlight { .. })), "{dup:?}");
    gated.succeed().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(idem.in_flight_waiters(), 0);
}

pub async fn waiters_over_the_limit_are_refused_at_once(store: Arc<dyn Store>) {
    let (idem, scope, runs) = waiting(store, "wait-limit");
    let idem = idem.max_in_flight_waiters(3);
    let gated = gated_first(&idem, &scope, &runs).await;
    let dups: Vec<_> = (0..3).map(|_| duplicate(&idem, &scope, &runs)).collect();
    until("3 duplicates waiting", || idem.in_flight_waiters() == 3).await;
    // The gate stays shut until the fourth has its answer: had it waited, it would not have one.
    let fourth = tokio::time::timeout(PATIENCE, duplicate(&idem, &scope, &runs))
        .await
        .expect("the fourth is answered without waiting")
        .unwrap();
    assert!(matches!(fourth, Err(Error::InFlight { .. })), "{fourth:?}");
    gated.succeed().await;
    for d in dups {
        replayed(d.await.unwrap());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

pub async fn a_waiter_whose_caller_leaves_frees_its_place(store: Arc<dyn Store>) {
    let (idem, scope, runs) = waiting(store, "wait-leave");
    let idem = idem.max_in_flight_waiters(1);
    let gated = gated_first(&idem, &scope, &runs).await;
    let leaving = duplicate(&idem, &scope, &runs);
    until("the duplicate waiting", || idem.in_flight_waiters() == 1).await;
    // The client goes away: its request's future is dropped.
    leaving.abort();
    assert!(leaving.await.unwrap_err().is_cancelled());
    until("its place given back", || idem.in_flight_waiters() == 0).await;
    // The one place is free again: the next duplicate waits (it is not refused) and replays.
    let next = duplicate(&idem, &scope, &runs);
    until("the next duplicate waiting", || {
        idem.in_flight_waiters() == 1
    })
    .await;
    gated.succeed().await;
    replayed(next.await.unwrap());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

pub async fn thousand_waiting_duplicates_run_the_body_once(store: Arc<dyn Store>) {
    let (idem, scope, runs) = waiting(store, "wait-1000");
    let idem = idem.max_in_flight_waiters(2000);
    let all: Vec<_> = (0..1000)
        .map(|_| {
            let (idem, req, runs) = (idem.clone(), request(&scope), runs.clone());
            tokio::spawn(async move {
                idem.execute(req, |_| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Outcome::Succeeded(answer())
                })
                .await
            })
        })
        .collect();
    let (mut executed, mut replays, mut in_flight) = (0, 0, 0);
    for t in all {
        match t.await.unwrap() {
            Ok(Execution::Executed(r)) => {
                assert_eq!(r, answer());
                executed += 1;
            }
            Ok(Execution::Replayed(r)) => {
                assert_eq!(r, answer());
                replays += 1;
            }
            // Past the bound: the 409, the only other answer allowed.
            Err(Error::InFlight { .. }) => in_flight += 1,
            Err(e) => panic!("a duplicate got {e}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    assert_eq!(executed, 1);
    assert_eq!(replays + in_flight, 999);
    assert_eq!(idem.in_flight_waiters(), 0);
}

/// Counts the claims (the reads a waiter makes) through a store.
#[derive(Debug)]
struct CountingClaims {
    inner: Arc<dyn Store>,
    claims: AtomicUsize,
}

#[async_trait::async_trait]
impl super::Delegate for CountingClaims {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }

    async fn claim(
        &self,
        claim: &crate::store::NewClaim,
    ) -> Result<crate::store::ClaimOutcome, crate::StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(claim).await
    }
}

/// The first request through `stores[0]`, 10 duplicates through `stores[1]` (another store
/// object: its own connections, and no wake-up from the first's finish in this process), each
/// waiting until it reads the answer. While they wait, one of them reads the key on its backoff
/// and the others wait for it. On a store that announces ends ([`Store::key_ends`]), the first's
/// finish is announced to `stores[1]`'s subscribers, and the one reading the key reads it about
/// once a second at most (a safety net), not on the 10 ms to 250 ms backoff.
pub async fn waiting_across_stores(stores: &[Arc<dyn Store>]) {
    let first_idem = Idempotency::new(stores[0].clone());
    let counted = Arc::new(CountingClaims {
        inner: stores[1].clone(),
        claims: AtomicUsize::new(0),
    });
    let other = Idempotency::new(counted.clone()).wait_in_flight(Some(BOUND));
    let (scope, runs) = (unique("wait-across"), Arc::new(AtomicUsize::new(0)));
    // What `stores[1]` announces, heard as any process would hear it, once its listener
    // listens (it says so with a first `Gap`).
    let mut ends = stores[1].key_ends();
    if let Some(ends) = ends.as_mut() {
        let listening = tokio::time::timeout(PATIENCE, ends.recv()).await;
        assert!(
            matches!(listening, Ok(Ok(crate::store::KeyEnd::Gap))),
            "the store's listener listens: {listening:?}"
        );
    }
    let gated = gated_first(&first_idem, &scope, &runs).await;
    let dups: Vec<_> = (0..10).map(|_| duplicate(&other, &scope, &runs)).collect();
    until("10 duplicates waiting", || other.in_flight_waiters() == 10).await;
    let before = counted.claims.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let reads = counted.claims.load(Ordering::SeqCst) - before;
    if ends.is_some() {
        // One poller woken by the announcement: its safety-net reads (1 s, then 2 s, ...) and
        // the read right after it asked for the announcement allow at most 3 in any 2 s.
        assert!(
            reads <= 3,
            "{reads} reads in 2 s by 10 waiters on one key, ends announced"
        );
    } else {
        // One poller: its backoff (10 ms doubling to 250 ms) allows at most 13 reads in any 2 s
        // (fewer on a slow machine, never more); 10 waiters each polling would make over 80.
        assert!(reads <= 13, "{reads} reads in 2 s by 10 waiters on one key");
    }
    let opened = tokio::time::Instant::now();
    gated.open.send(Outcome::Succeeded(answer())).unwrap();
    if let Some(ends) = ends.as_mut() {
        let id = request(&scope).id().clone();
        let heard = tokio::time::timeout(PATIENCE, async {
            loop {
                match ends.recv().await {
                    Ok(crate::store::KeyEnd::Ended(ended)) if ended == id => return true,
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return false,
                }
            }
        })
        .await;
        assert_eq!(
            heard,
            Ok(true),
            "the first's finish was announced to the other store"
        );
    }
    let first = gated.first.await.unwrap().unwrap();
    for d in dups {
        assert_eq!(&replayed(d.await.unwrap()), first.response());
    }
    tracing::info!(
        backend = stores[1].backend(),
        announced = ends.is_some(),
        after = ?opened.elapsed(),
        "every waiter across stores answered"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(other.in_flight_waiters(), 0);
}

/// A key's first attempt, held open until `open` is sent; returns once its body runs.
async fn held(
    idem: &Idempotency,
    req: IdempotentRequest,
) -> (
    JoinHandle<Result<Execution, Error>>,
    oneshot::Sender<Outcome>,
) {
    let (open, gate) = oneshot::channel::<Outcome>();
    let (started_tx, started) = oneshot::channel();
    let idem = idem.clone();
    let run = tokio::spawn(async move {
        idem.execute(req, |_| async move {
            let _ = started_tx.send(());
            gate.await
                .unwrap_or_else(|_| Outcome::unknown("the test dropped the gate"))
        })
        .await
    });
    started.await.expect("the attempt's body started");
    (run, open)
}

/// A store that announces ends ([`Store::key_ends`]) announces those of the keys a duplicate
/// asked about ([`Store::announce_end`]), on a finish and on a worker's release, and never
/// those of the keys nobody waits on (the write path pays nothing for waiting it does not
/// serve). A store that cannot announce says so when asked.
pub async fn ends_are_announced_for_the_keys_waited_on_only(store: Arc<dyn Store>) {
    use crate::store::KeyEnd;
    let idem = Idempotency::new(store.clone());
    let scope = unique("ends");
    let req = |key: &str| {
        IdempotentRequest::new(
            &scope,
            key,
            "payments.create",
            &serde_json::json!({"n": key}),
        )
        .expect("a valid request")
    };
    let Some(mut ends) = store.key_ends() else {
        let asked = store.announce_end(req("any").id()).await.expect("asked");
        assert!(!asked, "a store without an end feed cannot announce");
        return;
    };
    let listening = tokio::time::timeout(PATIENCE, ends.recv()).await;
    assert!(
        matches!(listening, Ok(Ok(KeyEnd::Gap))),
        "the store's listener listens: {listening:?}"
    );
    // Nobody waits on these: finished, and one released with its outcome unknown.
    for i in 0..5 {
        idem.execute(req(&format!("plain-{i}")), |_| async {
            Outcome::Succeeded(answer())
        })
        .await
        .expect("finished");
    }
    let unknown = idem
        .execute(req("plain-unknown"), |_| async { Outcome::unknown("lost") })
        .await;
    assert!(
        matches!(unknown, Err(Error::OutcomeUnknown { .. })),
        "{unknown:?}"
    );
    // Waited on: one finished, one released.
    let mut marked = Vec::new();
    for (key, outcome) in [
        ("waited-done", Outcome::Succeeded(answer())),
        ("waited-released", Outcome::unknown("lost")),
    ] {
        let (run, open) = held(&idem, req(key)).await;
        assert!(store.announce_end(req(key).id()).await.expect("asked"));
        open.send(outcome).expect("the attempt waits for its gate");
        let _ = run.await.expect("the attempt ran");
        marked.push(req(key).id().clone());
    }
    let mut heard = Vec::new();
    let all = tokio::time::timeout(PATIENCE, async {
        while !marked.iter().all(|id| heard.contains(id)) {
            match ends.recv().await {
                Ok(KeyEnd::Ended(id)) if id.scope.as_str() == scope => heard.push(id),
                Ok(_) => {}
                Err(e) => panic!("the end feed failed: {e}"),
            }
        }
    })
    .await;
    assert!(all.is_ok(), "announced: {heard:?}, expected {marked:?}");
    // Announced in the order the writes happened, so every unmarked key's end, had it been
    // announced, would have been heard by now.
    assert_eq!(heard, marked, "only the keys waited on are announced");
}
