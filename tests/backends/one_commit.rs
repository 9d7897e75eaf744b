//! Issue 23's one commit for local work (`Idempotency::execute_atomic`), on SQLite (a WAL file),
//! PostgreSQL and MariaDB: a new key is one commit (counted by the database: on PostgreSQL the
//! transactions that wrote a row of the test's own schema, noted by a trigger; on MariaDB the
//! store's one session's `COMMIT`s), a replay and
//! concurrent duplicates run the writes once, the application's own constraint violation is its
//! answer and never the key's, a failure keeps neither the key nor the rows, and a phase of the
//! wrong store or a store without transactions is refused. The crash test is
//! `one_commit_kill.rs`.

use std::sync::Arc;
use std::time::Duration;

use idemflow::store::phase::{AtomicPhase, Refusal, WritesError, WritesFuture};
use idemflow::{
    Error, Execution, Idempotency, IdempotentRequest, KeyId, KeyState, Outcome, Store,
    StoredResponse, async_trait, key::IdempotencyKey, key::Scope, record::Actor,
};
use serde_json::json;

/// What the application's writes do: insert one order for `cart`, and then...
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// answer 201; a cart that already has an order is refused with 409 (the app's answer).
    Answer,
    /// fail (an error of the application after its insert).
    Fail,
    /// answer 201, and pass a violated constraint on as an error (not turned into an answer).
    Unhandled,
}

/// The orders table, the same on the three backends.
pub const ORDERS: &str =
    "CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY, cart VARCHAR(64) NOT NULL UNIQUE)";

/// The outcome of the application's insert, as an answer (or an error).
pub fn answer(
    order: &str,
    then: Then,
    inserted: Result<(), sqlx::Error>,
) -> Result<StoredResponse, WritesError> {
    match (then, inserted) {
        (Then::Fail, Ok(())) => Err("the application failed after its insert".into()),
        (_, Ok(())) => Ok(StoredResponse::json(201, &json!({ "order": order }))?),
        (Then::Answer, Err(e))
            if e.as_database_error()
                .is_some_and(|d| d.is_unique_violation()) =>
        {
            Err(Refusal::new(StoredResponse::json(
                409,
                &json!({ "error": "this cart already has an order" }),
            )?)
            .into())
        }
        (_, Err(e)) => Err(e.into()),
    }
}

/// Writes closures for each backend's connection type: insert the order, then `then`.
macro_rules! writes {
    ($conn:ty, $insert:expr, $order:expr, $cart:expr, $then:expr) => {{
        let (order, cart, then): (String, String, Then) = ($order, $cart, $then);
        move |conn: &mut $conn| -> WritesFuture<'_> {
            let (order, cart) = (order.clone(), cart.clone());
            Box::pin(async move {
                let inserted = sqlx::query($insert)
                    .bind(order.clone())
                    .bind(cart)
                    .execute(&mut *conn)
                    .await
                    .map(|_| ());
                answer(&order, then, inserted)
            })
        }
    }};
}

/// One backend under test.
#[async_trait]
pub trait Db: Send + Sync {
    fn store(&self) -> Arc<dyn Store>;
    /// A phase of this store inserting order `order` for `cart`.
    fn phase(&self, order: &str, cart: &str, then: Then) -> Box<dyn AtomicPhase>;
    /// Runs a statement on the application's side.
    async fn exec(&self, sql: &'static str);
    /// How many orders there are.
    async fn orders(&self) -> i64;
    /// A counter of the commits that wrote the store's or the application's rows.
    async fn commits(&self) -> u64;
}

fn id(key: &str) -> KeyId {
    KeyId::new(
        Scope::new("shop").unwrap(),
        IdempotencyKey::new(key).unwrap(),
    )
}

fn request(key: &str, cart: &str) -> IdempotentRequest {
    IdempotentRequest::new("shop", key, "create_order", &json!({ "cart": cart })).unwrap()
}

fn workflow(key: &str) -> IdempotentRequest {
    IdempotentRequest::new("shop", key, "checkout", &json!({ "order": key }))
        .unwrap()
        .workflow()
}

/// A workflow's body: one atomic step running `phase`, its answer the workflow's.
async fn one_atomic_step(ctx: idemflow::Context, phase: Box<dyn AtomicPhase>) -> idemflow::Outcome {
    let step = idemflow::workflow::Step::new("create_order", &json!({})).unwrap();
    match ctx.atomic_step(step, phase).await {
        Ok(done) => idemflow::Outcome::Succeeded(done.into_response()),
        Err(e) => idemflow::Outcome::from_step_error(&e),
    }
}

/// The commits `run` makes. Each backend's counter counts its own test's store and tables only
/// (`Db::commits`), whatever the other tests do on the server, so one run reads exactly what
/// `run` cost.
async fn commits_of(db: &dyn Db, run: impl std::future::Future<Output = ()>) -> u64 {
    let before = db.commits().await;
    run.await;
    db.commits().await - before
}

/// Every check of this file, on one backend.
pub async fn suite(db: &dyn Db, tag: &str) {
    db.exec(ORDERS).await;
    let idem = Idempotency::new(db.store());

    // A new key: one commit. (`execute` with a claim and a finish: two.)
    let one = commits_of(db, async {
        let phase = db.phase("o-one-0", "c-one-0", Then::Answer);
        let done = idem
            .execute_atomic(request("one-0", "c-one-0"), phase)
            .await
            .unwrap();
        assert!(matches!(done, Execution::Executed(_)));
    })
    .await;
    let two = commits_of(db, async {
        idem.execute(request("two-0", "c"), |_| async {
            idemflow::Outcome::Succeeded(StoredResponse::new(200))
        })
        .await
        .unwrap();
    })
    .await;
    println!("{tag}: a new key through execute_atomic: {one} commit(s); through execute: {two}");
    assert_eq!(one, 1, "{tag}: execute_atomic must be one commit");
    if tag != "mysql" {
        // MariaDB's session counter counts `COMMIT` statements only, and `execute`'s
        // autocommit statements are not among them: there it reads fewer.
        assert!(two >= 2, "{tag}: the counter must tell one commit from two");
    }
    assert_eq!(db.orders().await, 1);

    // A workflow whose one step is atomic: its own claim and finish (what `execute` costs),
    // plus the step's one commit (claim, writes and answer). The step claimed in a
    // transaction of its own cost one more.
    let wf = commits_of(db, async {
        let phase = db.phase("o-wf-0", "c-wf-0", Then::Answer);
        let done = idem
            .execute(workflow("wf-0"), |ctx| one_atomic_step(ctx, phase))
            .await
            .unwrap();
        assert_eq!(done.response().status(), 201);
    })
    .await;
    println!("{tag}: a workflow with one atomic step: {wf} commit(s)");
    assert_eq!(
        wf,
        two + 1,
        "{tag}: the workflow's claim and finish, and the step's one commit"
    );
    // The orders so far: one for each of the two counts above.
    let base = 2;
    assert_eq!(db.orders().await, base);
    // Run again: the step replays, its writes do not run.
    let again = idem
        .execute(workflow("wf-0"), |ctx| {
            one_atomic_step(ctx, db.phase("o-wf-x", "c-wf-x", Then::Answer))
        })
        .await
        .unwrap();
    assert!(again.is_replay());
    assert_eq!(db.orders().await, base);
    let step = db
        .store()
        .get(&idemflow::workflow::step_key(&id("wf-0"), 0))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(step.state, idemflow::KeyState::Done);
    assert_eq!(step.kind(), idemflow::record::KeyKind::AtomicStep);

    // A replay: the writes do not run again.
    let again = idem
        .execute_atomic(
            request("one-0", "c-one-0"),
            db.phase("o-x", "c-x", Then::Answer),
        )
        .await
        .unwrap();
    assert!(matches!(&again, Execution::Replayed(r) if r.status() == 201));
    assert_eq!(again.response().body(), br#"{"order":"o-one-0"}"#);
    assert_eq!(db.orders().await, base);

    // Concurrent duplicates: one runs, the others replay its answer.
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let (idem, phase) = (
                idem.clone(),
                db.phase(&format!("o-dup-{i}"), "c-dup", Then::Answer),
            );
            tokio::spawn(async move { idem.execute_atomic(request("dup", "c-dup"), phase).await })
        })
        .collect();
    let mut executed = 0;
    let mut bodies = std::collections::BTreeSet::new();
    for t in tasks {
        let done = t.await.unwrap().unwrap();
        executed += usize::from(matches!(done, Execution::Executed(_)));
        assert_eq!(done.response().status(), 201);
        bodies.insert(done.response().body().to_vec());
    }
    assert_eq!(executed, 1, "{tag}: one duplicate runs");
    assert_eq!(bodies.len(), 1, "{tag}: the others replay its answer");
    assert_eq!(db.orders().await, base + 1);

    // The application's own constraint (one order per cart) is its answer, stored and
    // replayed; its writes are undone. Never mistaken for the key's constraint.
    let refused = idem
        .execute_atomic(
            request("other-key", "c-dup"),
            db.phase("o-2", "c-dup", Then::Answer),
        )
        .await
        .unwrap();
    assert!(matches!(&refused, Execution::Executed(r) if r.status() == 409));
    let replayed = idem
        .execute_atomic(
            request("other-key", "c-dup"),
            db.phase("o-3", "c-dup", Then::Answer),
        )
        .await
        .unwrap();
    assert!(matches!(&replayed, Execution::Replayed(r) if r.status() == 409));
    let record = db.store().get(&id("other-key")).await.unwrap().unwrap();
    assert_eq!(record.state, idemflow::KeyState::Done);
    assert_eq!(db.orders().await, base + 1);

    // The same violation passed on as an error: everything rolled back, no key row; a
    // retry runs again (and is refused the same way).
    let err = idem
        .execute_atomic(
            request("unhandled", "c-dup"),
            db.phase("o-4", "c-dup", Then::Unhandled),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::RolledBack { .. }), "{tag}: {err:?}");
    assert!(db.store().get(&id("unhandled")).await.unwrap().is_none());

    // A failure after the insert: neither the key nor the order is kept; the retry runs.
    let err = idem
        .execute_atomic(request("fails", "c-f"), db.phase("o-f", "c-f", Then::Fail))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::RolledBack { .. }), "{tag}: {err:?}");
    assert!(db.store().get(&id("fails")).await.unwrap().is_none());
    assert_eq!(db.orders().await, base + 1);
    let retried = idem
        .execute_atomic(
            request("fails", "c-f"),
            db.phase("o-f", "c-f", Then::Answer),
        )
        .await
        .unwrap();
    assert!(matches!(retried, Execution::Executed(_)));
    assert_eq!(db.orders().await, base + 2);

    // The same key with another request: refused as ever, nothing runs.
    let err = idem
        .execute_atomic(
            request("fails", "c-other"),
            db.phase("o-g", "c-g", Then::Answer),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::FingerprintMismatch { .. }), "{err:?}");

    // Refused before anything runs: a request that names a provider.
    let err = idem
        .execute_atomic(
            request("prov", "c-p").provider("stripe"),
            db.phase("o-p", "c-p", Then::Answer),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NoSharedTransaction { .. }), "{err:?}");
    assert_eq!(db.orders().await, base + 2);

    // History shows the claim and the answer.
    let history = db.store().history(&id("one-0")).await.unwrap();
    let reasons: Vec<_> = history
        .iter()
        .map(|e| e.reason.clone().unwrap_or_default())
        .collect();
    assert_eq!(reasons.len(), 2, "{tag}: {reasons:?}");
    assert!(reasons[1].starts_with("one commit"), "{tag}: {reasons:?}");

    // The committed row is the claim's, finished by its holder (SQLite writes it once, already
    // `done`: `docs/one-commit.md`): one attempt, no lease, the claim's token in both entries.
    let record = db.store().get(&id("one-0")).await.unwrap().unwrap();
    assert_eq!(record.state, KeyState::Done, "{tag}");
    assert_eq!(record.response.as_ref().map(|r| r.status()), Some(201));
    assert_eq!(record.provider.as_deref(), Some("idemflow.local"), "{tag}");
    assert_eq!(record.attempts, 1, "{tag}");
    assert!(record.lease_owner.is_none() && record.lease_expires_at.is_none());
    assert!(!record.may_have_acted, "{tag}");
    assert!(record.request.is_some(), "{tag}: the request is stored");
    assert_eq!(
        record.expires_at,
        Some(record.updated_at + chrono::Duration::hours(24)),
        "{tag}: kept for the executor's retention"
    );
    let shape: Vec<_> = history
        .iter()
        .map(|e| (e.seq, e.from, e.to, e.lease_token, e.actor))
        .collect();
    let token = Some(record.lease_token);
    assert_eq!(
        shape,
        [
            (1, None, Some(KeyState::Processing), token, Actor::Worker),
            (
                2,
                Some(KeyState::Processing),
                Some(KeyState::Done),
                token,
                Actor::Worker
            ),
        ],
        "{tag}"
    );
    assert_eq!(reasons[0], "claimed", "{tag}");

    // A key re-created after its purge is a new life: its history numbered on after the
    // purge's entry, and a provider key of its own (`NewClaim::renewed_key_base`).
    let short = Idempotency::new(db.store()).retention(Duration::from_millis(1));
    let life = |cart: &str| {
        short.execute_atomic(
            request("life", cart),
            db.phase(&format!("o-{cart}"), cart, Then::Answer),
        )
    };
    assert!(matches!(
        life("c-life-1").await.unwrap(),
        Execution::Executed(_)
    ));
    let first = db.store().get(&id("life")).await.unwrap().unwrap();
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        db.store().purge_expired(100).await.unwrap();
        if db.store().get(&id("life")).await.unwrap().is_none() {
            break;
        }
    }
    assert!(
        db.store().get(&id("life")).await.unwrap().is_none(),
        "{tag}: purged"
    );
    assert!(matches!(
        life("c-life-2").await.unwrap(),
        Execution::Executed(_)
    ));
    let second = db.store().get(&id("life")).await.unwrap().unwrap();
    assert_eq!(second.state, KeyState::Done, "{tag}");
    assert_ne!(
        second.provider_key, first.provider_key,
        "{tag}: a renewed key"
    );
    let lives: Vec<_> = db
        .store()
        .history(&id("life"))
        .await
        .unwrap()
        .iter()
        .map(|e| (e.seq, e.to, e.actor))
        .collect();
    // MariaDB numbers history entries across keys: there only their order is checked.
    let first_seq = if tag == "mysql" { lives[0].0 } else { 1 };
    let lives: Vec<_> = lives
        .into_iter()
        .map(|(seq, to, actor)| (seq - first_seq + 1, to, actor))
        .collect();
    assert_eq!(
        lives,
        [
            (1, Some(KeyState::Processing), Actor::Worker),
            (2, Some(KeyState::Done), Actor::Worker),
            (3, None, Actor::Purge),
            (4, Some(KeyState::Processing), Actor::Worker),
            (5, Some(KeyState::Done), Actor::Worker),
        ],
        "{tag}"
    );
    assert_eq!(db.orders().await, base + 4);

    // A key that `execute` left `failed{retryable}`, nothing having acted: the phase claims
    // it again (a reclaim, not a new row) and commits its writes with the answer.
    let failed = idem
        .execute(request("mixed", "c-mixed"), |_| async {
            Outcome::retryable("the provider said later")
        })
        .await;
    assert!(failed.is_err(), "{tag}: {failed:?}");
    let before = db.store().get(&id("mixed")).await.unwrap().unwrap();
    assert_eq!(before.state, KeyState::Failed { retryable: true }, "{tag}");
    let done = idem
        .execute_atomic(
            request("mixed", "c-mixed"),
            db.phase("o-mixed", "c-mixed", Then::Answer),
        )
        .await
        .unwrap();
    assert!(
        matches!(&done, Execution::Executed(r) if r.status() == 201),
        "{tag}"
    );
    let after = db.store().get(&id("mixed")).await.unwrap().unwrap();
    assert_eq!(after.state, KeyState::Done, "{tag}");
    assert_eq!(
        after.attempts, 2,
        "{tag}: the second attempt of the same row"
    );
    assert_eq!(db.orders().await, base + 5);
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use idemflow::store::sqlite::SqliteStore;
    use sqlx::SqliteConnection;

    struct Sqlite(Arc<SqliteStore>);

    #[async_trait]
    impl Db for Sqlite {
        fn store(&self) -> Arc<dyn Store> {
            self.0.clone()
        }
        fn phase(&self, order: &str, cart: &str, then: Then) -> Box<dyn AtomicPhase> {
            Box::new(self.0.atomic_phase(writes!(
                SqliteConnection,
                "INSERT INTO orders (id, cart) VALUES (?, ?)",
                order.to_owned(),
                cart.to_owned(),
                then
            )))
        }
        async fn exec(&self, sql: &'static str) {
            sqlx::query(sql)
                .execute(self.0.writer_pool())
                .await
                .unwrap();
        }
        async fn orders(&self) -> i64 {
            sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                .fetch_one(self.0.writer_pool())
                .await
                .unwrap()
        }
        /// The writer's transactions: every write of the store goes through it.
        async fn commits(&self) -> u64 {
            self.0.writer_stats().commits
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_file() {
        suite(&Sqlite(crate::support::sqlite::file().await), "sqlite").await;
    }

    /// A phase of another store, and a store without transactions, are refused.
    #[tokio::test]
    async fn refused_before_anything_runs() {
        let (a, b) = (
            crate::support::sqlite::memory().await,
            crate::support::sqlite::memory().await,
        );
        Sqlite(b.clone()).exec(ORDERS).await;
        let idem = Idempotency::new(a.clone());
        let err = idem
            .execute_atomic(
                request("k", "c"),
                Sqlite(b.clone()).phase("o", "c", Then::Answer),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, Error::NoSharedTransaction { .. }), "{err:?}");
        let memory: Arc<dyn Store> = Arc::new(crate::memory_store::MemoryStore::default());
        let err = Idempotency::new(memory)
            .execute_atomic(
                request("k", "c"),
                Sqlite(b.clone()).phase("o", "c", Then::Answer),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, Error::NoSharedTransaction { .. }), "{err:?}");
        // A workflow's atomic step with a phase of another store: refused, nothing claimed
        // (the step's key would be claimed where the workflow never reads).
        let step_err = Arc::new(std::sync::Mutex::new(None));
        let seen = step_err.clone();
        let phase = Sqlite(b.clone()).phase("o", "c", Then::Answer);
        let r = idem
            .execute(workflow("wf"), |ctx| async move {
                let step = idemflow::workflow::Step::new("create_order", &json!({})).unwrap();
                let e = ctx.atomic_step(step, phase).await.unwrap_err();
                let outcome = idemflow::Outcome::from_step_error(&e);
                *seen.lock().unwrap() = Some(e);
                outcome
            })
            .await;
        assert!(r.is_err(), "{r:?}");
        let e = step_err.lock().unwrap().take();
        assert!(
            matches!(e, Some(Error::NoSharedTransaction { .. })),
            "{e:?}"
        );
        let step = idemflow::workflow::step_key(&id("wf"), 0);
        assert!(a.get(&step).await.unwrap().is_none());
        assert!(b.get(&step).await.unwrap().is_none());
        assert_eq!(Sqlite(b).orders().await, 0);
        assert!(a.get(&id("k")).await.unwrap().is_none());
    }
    /// A phase writing order `order` and then idemflow's row of its own key `key` (the
    /// application writing idemflow's table through the phase's connection): moving its lease
    /// token when the key is there (its record then finds the phase's claim gone), inserting a
    /// row of its own when it is not (the one-commit insert then finds the key taken).
    fn writes_its_own_key(
        store: &SqliteStore,
        order: &'static str,
        key: &'static str,
    ) -> impl AtomicPhase + 'static {
        store.atomic_phase(move |conn: &mut SqliteConnection| -> WritesFuture<'_> {
            Box::pin(async move {
                sqlx::query("INSERT INTO orders (id, cart) VALUES (?1, ?1)")
                    .bind(order)
                    .execute(&mut *conn)
                    .await?;
                let moved = sqlx::query(
                    "UPDATE idempotency_keys SET lease_token = lease_token + 1 \
                     WHERE scope = 'shop' AND key = ?1",
                )
                .bind(key)
                .execute(&mut *conn)
                .await?;
                if moved.rows_affected() == 0 {
                    sqlx::query(
                        "INSERT INTO idempotency_keys (scope, key, operation, provider_key, \
                         state, fingerprint, lease_token, lease_expires_at, attempts, \
                         created_at, updated_at, retention_ms, version) \
                         VALUES ('shop', ?1, 'x', 'x', 'processing', 'x', 1, 0, 1, 0, 0, 0, 1)",
                    )
                    .bind(key)
                    .execute(&mut *conn)
                    .await?;
                }
                Ok(StoredResponse::new(201))
            })
        })
    }

    /// Leaves `key` `failed{retryable}` through `execute` (nothing acted): a phase then
    /// claims it again and finishes it with a record, as on the pooled stores.
    async fn left_retryable(store: &Arc<SqliteStore>, key: &str, cart: &str) {
        let r = Idempotency::new(store.clone())
            .execute(request(key, cart), |_| async {
                Outcome::retryable("the provider said later")
            })
            .await;
        assert!(r.is_err(), "{r:?}");
    }

    /// What a phase whose writes wrote its own key's row must leave: the key as it was
    /// (`before`: absent, or `failed{retryable}`), and a store error saying what happened.
    async fn kept_nothing(store: &SqliteStore, key: &str, err: &Error, before: Option<KeyState>) {
        let said = if before.is_some() {
            "found its own claim gone"
        } else {
            "found the key written during the phase"
        };
        assert!(
            err.to_string().contains(said),
            "a store error about the key: {err}"
        );
        let state = store.get(&id(key)).await.unwrap().map(|r| r.state);
        assert_eq!(state, before, "the key as it was");
    }

    /// Writes that write their own key's row: the phase keeps nothing, its caller gets a store
    /// error, and the writer goes on. For a key that is there and claimed again, the record
    /// finds the phase's claim gone, and it releases the phase's savepoint in the same trip,
    /// so nothing of the phase can be undone alone: the writer must roll the transaction back.
    /// For a new key, the one-commit insert (no `ON CONFLICT`) finds the key taken.
    async fn writes_its_own_key_alone(reclaimed: bool) {
        let store = crate::support::sqlite::file().await;
        let db = Sqlite(store.clone());
        db.exec(ORDERS).await;
        if reclaimed {
            left_retryable(&store, "k-gone", "c-gone").await;
        }
        let before = store.get(&id("k-gone")).await.unwrap().map(|r| r.state);
        let phase = writes_its_own_key(&store, "o-gone", "k-gone");
        let err = Idempotency::new(store.clone())
            .execute_atomic(request("k-gone", "c-gone"), phase)
            .await
            .unwrap_err();
        kept_nothing(&store, "k-gone", &err, before).await;
        assert_eq!(db.orders().await, 0, "the phase's order was kept");
        the_writer_goes_on(&db, 1).await;
    }

    /// The writer goes on after a failure: a new key's phase commits, its order the
    /// `orders`th.
    async fn the_writer_goes_on(db: &Sqlite, orders: i64) {
        let done = Idempotency::new(db.0.clone())
            .execute_atomic(
                request("k-next", "c-next"),
                db.phase("o-next", "c-next", Then::Answer),
            )
            .await
            .unwrap();
        assert!(matches!(done, Execution::Executed(_)), "{done:?}");
        assert_eq!(db.orders().await, orders);
    }

    #[tokio::test]
    async fn a_record_that_finds_its_claim_gone_keeps_nothing() {
        writes_its_own_key_alone(true).await;
    }

    #[tokio::test]
    async fn a_new_key_written_by_its_own_writes_keeps_nothing() {
        writes_its_own_key_alone(false).await;
    }

    /// Runs `calls` (key, cart, phase) as one batch of the writer, in this order: the writer is
    /// held while they queue. Their answers, and the writer's counts before the batch.
    async fn in_one_batch(
        store: &Arc<SqliteStore>,
        calls: Vec<(&'static str, &'static str, Box<dyn AtomicPhase>)>,
    ) -> (
        Vec<Result<Execution, Error>>,
        idemflow::store::sqlite::WriterStats,
    ) {
        let (gate, held) = crate::sqlite::group_commit::hold_writer(store).await;
        let mut running = Vec::new();
        for (i, (key, cart, phase)) in calls.into_iter().enumerate() {
            let idem = Idempotency::new(store.clone());
            running.push(tokio::spawn(async move {
                idem.execute_atomic(request(key, cart), phase).await
            }));
            crate::sqlite::group_commit::wait_queued(store, i + 1).await;
        }
        let before = store.writer_stats();
        gate.notify_one();
        held.await.unwrap();
        let mut answers = Vec::new();
        for call in running {
            answers.push(call.await.unwrap());
        }
        (answers, before)
    }

    /// The same inside a batch: the writer is held while three phases queue, so they run in
    /// one transaction in the order sent, the one whose writes write its own key in the
    /// middle (a phase of the batch runs after it) or last (the batch's `COMMIT` follows it).
    /// The error is that phase's alone: it gets it and keeps nothing, the batch is rolled back,
    /// and the other two run again and commit.
    async fn writes_its_own_key_in_a_batch(gone_at: usize, reclaimed: bool) {
        let store = crate::support::sqlite::file().await;
        let db = Sqlite(store.clone());
        db.exec(ORDERS).await;
        let keys = ["k-0", "k-1", "k-2"];
        if reclaimed {
            left_retryable(&store, keys[gone_at], keys[gone_at]).await;
        }
        let before_state = store
            .get(&id(keys[gone_at]))
            .await
            .unwrap()
            .map(|r| r.state);
        let mut calls = Vec::new();
        for (i, key) in keys.into_iter().enumerate() {
            let phase: Box<dyn AtomicPhase> = if i == gone_at {
                Box::new(writes_its_own_key(&store, "o-gone", key))
            } else {
                db.phase(&format!("o-{i}"), &format!("c-{i}"), Then::Answer)
            };
            calls.push((key, key, phase));
        }
        let (answers, before) = in_one_batch(&store, calls).await;
        for (i, r) in answers.into_iter().enumerate() {
            if i == gone_at {
                kept_nothing(&store, keys[i], &r.unwrap_err(), before_state).await;
            } else {
                assert!(matches!(r, Ok(Execution::Executed(_))), "phase {i}: {r:?}");
            }
        }
        assert_eq!(db.orders().await, 2, "only the two other phases' orders");
        let after = store.writer_stats();
        assert!(
            after.rolled_back > before.rolled_back,
            "the batch was rolled back: {before:?} -> {after:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_in_the_middle_of_a_batch_that_finds_its_claim_gone_fails_only_its_own() {
        writes_its_own_key_in_a_batch(1, true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_last_in_a_batch_that_finds_its_claim_gone_fails_only_its_own() {
        writes_its_own_key_in_a_batch(2, true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_key_written_by_its_own_writes_in_a_batch_fails_only_its_own() {
        writes_its_own_key_in_a_batch(1, false).await;
    }

    /// Phases next to each other in a batch: each sends the next one's savepoint and read with
    /// its own insert (`writer.rs`, "Trips"). A key twice in the batch: the second finds the
    /// first's row (its read runs after the first's insert) and replays its answer; a key that
    /// was there before is answered from; the writes run once per key, and the batch is one
    /// commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn phases_next_to_each_other_in_a_batch_read_the_rows_before_them() {
        let store = crate::support::sqlite::file().await;
        let db = Sqlite(store.clone());
        db.exec(ORDERS).await;
        let idem = Idempotency::new(store.clone());
        idem.execute_atomic(
            request("k-old", "c-old"),
            db.phase("o-old", "c-old", Then::Answer),
        )
        .await
        .unwrap();
        let calls = [
            ("k-1", "k-1", "o-1"),
            ("k-1", "k-1", "o-1-again"),
            ("k-old", "c-old", "o-old-again"),
            ("k-2", "k-2", "o-2"),
        ];
        let calls = calls
            .into_iter()
            .map(|(key, cart, order)| (key, cart, db.phase(order, order, Then::Answer)))
            .collect();
        let (answers, before) = in_one_batch(&store, calls).await;
        let answers: Vec<Execution> = answers.into_iter().map(Result::unwrap).collect();
        let body = |e: &Execution| String::from_utf8_lossy(e.response().body()).into_owned();
        assert!(matches!(answers[0], Execution::Executed(_)), "{answers:?}");
        assert!(body(&answers[0]).contains("\"o-1\""), "{answers:?}");
        assert!(matches!(answers[1], Execution::Replayed(_)), "{answers:?}");
        assert_eq!(body(&answers[1]), body(&answers[0]));
        assert!(matches!(answers[2], Execution::Replayed(_)), "{answers:?}");
        assert!(body(&answers[2]).contains("\"o-old\""), "{answers:?}");
        assert!(matches!(answers[3], Execution::Executed(_)), "{answers:?}");
        assert!(body(&answers[3]).contains("\"o-2\""), "{answers:?}");
        assert_eq!(db.orders().await, 3, "o-old, o-1 and o-2");
        let after = store.writer_stats();
        assert_eq!(
            (after.commits, after.writes),
            (before.commits + 2, before.writes + 5),
            "the holding job's commit, and one for the four phases: {before:?} -> {after:?}"
        );
    }

    /// The application's tables for a `COMMIT` that fails: `lines` points at `carts` with a
    /// deferred foreign key, checked only at the commit.
    async fn deferred_lines(db: &Sqlite) {
        db.exec("CREATE TABLE carts (id TEXT PRIMARY KEY)").await;
        db.exec(
            "CREATE TABLE lines (id TEXT PRIMARY KEY, cart TEXT REFERENCES carts (id) \
             DEFERRABLE INITIALLY DEFERRED)",
        )
        .await;
    }

    /// A phase whose row breaks [`deferred_lines`]' foreign key: accepted until the commit.
    fn breaks_the_commit(store: &SqliteStore) -> impl AtomicPhase + 'static {
        store.atomic_phase(|conn: &mut SqliteConnection| -> WritesFuture<'_> {
            Box::pin(async move {
                sqlx::query("INSERT INTO lines (id, cart) VALUES ('l-1', 'no-such-cart')")
                    .execute(&mut *conn)
                    .await?;
                Ok(StoredResponse::new(201))
            })
        })
    }

    /// Checks that `err` is the writer's batch error (a store error: the caller may not
    /// assume either way), caused by SQLite's error saying `cause`.
    fn batch_error(err: &Error, cause: &str) {
        assert!(matches!(err, Error::Store(_)), "{err:?}");
        let said = std::iter::successors(Some(err as &dyn std::error::Error), |e| e.source())
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(": ");
        assert!(
            said.contains("the batch of writes") && said.contains(cause),
            "the batch's error, from SQLite's {cause:?}: {said}"
        );
    }

    /// Nothing of the failed commit is there: no key in `keys`, no line.
    async fn nothing_of(store: &SqliteStore, keys: &[&str]) {
        for key in keys {
            assert!(
                store.get(&id(key)).await.unwrap().is_none(),
                "{key} was kept"
            );
        }
        let (lines,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM lines")
            .fetch_one(store.writer_pool())
            .await
            .unwrap();
        assert_eq!(lines, 0, "the application's row was kept");
    }

    /// A phase last in its batch ends its last statement with the batch's `COMMIT` (alone, it
    /// also sent the `BEGIN IMMEDIATE` with its first: `writer.rs`, "Trips"). That `COMMIT`
    /// failing (a deferred foreign key the application's row breaks): the caller gets the
    /// batch's store error (it may have committed, as after any failed `COMMIT`), nothing is
    /// kept (the writer rolls back the transaction, which SQLite leaves open after such a
    /// failure), and the writer goes on, committing nothing of it later.
    #[tokio::test]
    async fn a_lone_phase_whose_commit_fails_keeps_nothing() {
        let store = crate::support::sqlite::file().await;
        let db = Sqlite(store.clone());
        db.exec(ORDERS).await;
        deferred_lines(&db).await;
        let idem = Idempotency::new(store.clone());
        let err = idem
            .execute_atomic(request("k-fk", "c-fk"), breaks_the_commit(&store))
            .await
            .unwrap_err();
        batch_error(&err, "FOREIGN KEY");
        nothing_of(&store, &["k-fk"]).await;
        the_writer_goes_on(&db, 1).await;
        nothing_of(&store, &["k-fk"]).await;
    }

    /// The same last in a batch of two phases: both callers get the batch's error (the first
    /// phase's work was in the transaction that did not commit), nothing of either is kept, and
    /// the writer goes on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_whose_last_phase_fails_its_commit_keeps_nothing() {
        let store = crate::support::sqlite::file().await;
        let db = Sqlite(store.clone());
        db.exec(ORDERS).await;
        deferred_lines(&db).await;
        let calls: Vec<(_, _, Box<dyn AtomicPhase>)> = vec![
            ("k-a", "k-a", db.phase("o-a", "c-a", Then::Answer)),
            ("k-fk", "k-fk", Box::new(breaks_the_commit(&store))),
        ];
        let (answers, before) = in_one_batch(&store, calls).await;
        for answer in answers {
            let err = answer.unwrap_err();
            batch_error(&err, "FOREIGN KEY");
        }
        let after = store.writer_stats();
        assert_eq!(
            (after.commits, after.writes),
            (before.commits + 1, before.writes + 1),
            "the holding job's commit alone: {before:?} -> {after:?}"
        );
        nothing_of(&store, &["k-a", "k-fk"]).await;
        assert_eq!(db.orders().await, 0, "the first phase's order was kept");
        let done = Idempotency::new(store.clone())
            .execute_atomic(request("k-a", "k-a"), db.phase("o-a", "c-a", Then::Answer))
            .await
            .unwrap();
        assert!(matches!(done, Execution::Executed(_)), "{done:?}");
        assert_eq!(db.orders().await, 1);
        nothing_of(&store, &["k-fk"]).await;
    }

    /// A phase first in its batch sends the batch's `BEGIN IMMEDIATE` with its first statement.
    /// That `BEGIN` failing (another process holds the write lock past the busy timeout):
    /// the caller gets a store error, nothing ran or was kept, and a retry once the lock is
    /// free runs the writes once.
    #[tokio::test]
    async fn a_phase_whose_begin_fails_keeps_nothing() {
        use idemflow::store::sqlite::SqliteConfig;
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("t.db").display());
        let store = Arc::new(
            SqliteStore::connect_with(
                SqliteConfig::new(url.clone()).busy_timeout(Duration::from_millis(100)),
            )
            .await
            .unwrap(),
        );
        store.migrate().await.unwrap();
        let db = Sqlite(store.clone());
        db.exec(ORDERS).await;
        // Another process's connection, holding the write lock.
        let mut other = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url)
            .await
            .unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap();
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let phase = |ran: Arc<std::sync::atomic::AtomicUsize>| {
            store.atomic_phase(move |conn: &mut SqliteConnection| -> WritesFuture<'_> {
                let ran = ran.clone();
                Box::pin(async move {
                    ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    sqlx::query("INSERT INTO orders (id, cart) VALUES ('o-b', 'c-b')")
                        .execute(&mut *conn)
                        .await?;
                    Ok(StoredResponse::new(201))
                })
            })
        };
        let idem = Idempotency::new(store.clone());
        let err = idem
            .execute_atomic(request("k-b", "c-b"), phase(ran.clone()))
            .await
            .unwrap_err();
        batch_error(&err, "locked");
        assert_eq!(
            ran.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "the writes ran"
        );
        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
        assert!(store.get(&id("k-b")).await.unwrap().is_none());
        assert_eq!(db.orders().await, 0);
        let done = idem
            .execute_atomic(request("k-b", "c-b"), phase(ran.clone()))
            .await
            .unwrap();
        assert!(matches!(done, Execution::Executed(_)), "{done:?}");
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(db.orders().await, 1);
    }
}

/// Runs a phase whose statement never ends on its own (`stuck`), through `store`, and waits
/// until the server no longer runs it (`running`: how many sessions run a statement holding
/// `marker`): the phase timeout bounds each statement of a phase on the server too, so a
/// cut-off phase's statement does not hold its connection and locks until it ends by itself.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub async fn stuck_statement_ends<R, F>(
    store: Arc<dyn Store>,
    phase: Box<dyn AtomicPhase>,
    marker: &str,
    running: R,
) where
    R: Fn(String) -> F,
    F: std::future::Future<Output = i64>,
{
    let idem = Idempotency::new(store);
    let started = std::time::Instant::now();
    let r = idem
        .execute_atomic(request("stuck", "c-stuck"), phase)
        .await;
    assert!(r.is_err(), "a phase stuck in a statement answered: {r:?}");
    // The phase's own timeout plus the server's (from the statement's start), with room for a
    // loaded machine: an hour's statement left running fails this.
    let deadline = started + Duration::from_secs(40);
    loop {
        let n = running(marker.to_owned()).await;
        if n == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cut-off phase's statement still runs on the server after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use idemflow::store::postgres::PostgresStore;
    use sqlx::PgConnection;

    /// The store, in a schema of its own.
    struct Pg(PostgresStore);

    /// Notes every transaction that writes a row of a table it is attached to (`AFTER .. FOR
    /// EACH ROW`, in that transaction), by its id: the schema's writing transactions, counted
    /// whatever the other tests do on the server. (Transaction ids are server-wide: counting
    /// them failed under load, when every try's window held another test's commit.)
    const NOTE_WRITING_XACTS: [&str; 3] = [
        "CREATE TABLE writing_xacts (xid xid8 PRIMARY KEY)",
        "CREATE FUNCTION note_writing_xact() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO writing_xacts VALUES (pg_current_xact_id()) ON CONFLICT DO NOTHING; \
           RETURN NULL; END $$",
        "CREATE TRIGGER note_writing_xact AFTER INSERT OR UPDATE OR DELETE ON idempotency_keys \
           FOR EACH ROW EXECUTE FUNCTION note_writing_xact()",
    ];

    #[async_trait]
    impl Db for Pg {
        fn store(&self) -> Arc<dyn Store> {
            Arc::new(self.0.clone())
        }
        fn phase(&self, order: &str, cart: &str, then: Then) -> Box<dyn AtomicPhase> {
            Box::new(self.0.atomic_phase(writes!(
                PgConnection,
                "INSERT INTO orders (id, cart) VALUES ($1, $2)",
                order.to_owned(),
                cart.to_owned(),
                then
            )))
        }
        async fn exec(&self, sql: &'static str) {
            sqlx::query(sql).execute(self.0.pool()).await.unwrap();
            if sql == ORDERS {
                // The application's rows count too: a phase that committed them apart from
                // the key's would read two.
                sqlx::query(
                    "CREATE TRIGGER note_writing_xact AFTER INSERT OR UPDATE OR DELETE ON orders \
                     FOR EACH ROW EXECUTE FUNCTION note_writing_xact()",
                )
                .execute(self.0.pool())
                .await
                .unwrap();
            }
        }
        async fn orders(&self) -> i64 {
            sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                .fetch_one(self.0.pool())
                .await
                .unwrap()
        }
        /// The transactions that wrote the schema's keys or orders (`NOTE_WRITING_XACTS`).
        async fn commits(&self) -> u64 {
            let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM writing_xacts")
                .fetch_one(self.0.pool())
                .await
                .unwrap();
            n as u64
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        let Some((url, schema)) = crate::support::postgres::fresh_schema().await else {
            return;
        };
        let store =
            PostgresStore::from_pool(crate::support::postgres::pool_in(&url, &schema, 8).await);
        store.migrate().await.unwrap();
        for sql in NOTE_WRITING_XACTS {
            sqlx::query(sql).execute(store.pool()).await.unwrap();
        }
        suite(&Pg(store), "postgres").await;
        crate::support::postgres::drop_schema(&url, &schema).await;
    }

    /// A phase stuck in one statement: cut off by its timeout, and its statement cancelled by
    /// the server (`statement_timeout`) rather than left running for an hour.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cut_off_phase_statement_does_not_run_on() {
        let Some((url, schema)) = crate::support::postgres::fresh_schema().await else {
            return;
        };
        let store =
            PostgresStore::from_pool(crate::support::postgres::pool_in(&url, &schema, 4).await);
        store.migrate().await.unwrap();
        let marker = format!("idemflow-stuck-{schema}");
        let sql = format!("SELECT pg_sleep(3600) /* {marker} */");
        let phase = store.atomic_phase(move |conn| {
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&mut *conn)
                    .await?;
                Ok(StoredResponse::new(200))
            })
        });
        let pool = store.pool().clone();
        super::stuck_statement_ends(Arc::new(store), Box::new(phase), &marker, |marker| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar(
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE state = 'active' \
                     AND pid <> pg_backend_pid() AND query LIKE '%' || $1 || '%'",
                )
                .bind(marker)
                .fetch_one(&pool)
                .await
                .unwrap()
            }
        })
        .await;
        crate::support::postgres::drop_schema(&url, &schema).await;
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use idemflow::store::mysql::MySqlStore;
    use sqlx::MySqlConnection;

    struct My(MySqlStore);

    #[async_trait]
    impl Db for My {
        fn store(&self) -> Arc<dyn Store> {
            Arc::new(self.0.clone())
        }
        fn phase(&self, order: &str, cart: &str, then: Then) -> Box<dyn AtomicPhase> {
            Box::new(self.0.atomic_phase(writes!(
                MySqlConnection,
                "INSERT INTO orders (id, cart) VALUES (?, ?)",
                order.to_owned(),
                cart.to_owned(),
                then
            )))
        }
        async fn exec(&self, sql: &'static str) {
            sqlx::query(sql).execute(self.0.pool()).await.unwrap();
        }
        async fn orders(&self) -> i64 {
            sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                .fetch_one(self.0.pool())
                .await
                .unwrap()
        }
        /// The session's `COMMIT`s (`Com_commit`): the store's pool has one connection, so
        /// this is every transaction the store committed explicitly, whatever other tests do
        /// on the server. (Its autocommit statements are not counted: see `suite`.)
        async fn commits(&self) -> u64 {
            let (_, n): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Com_commit'")
                .fetch_one(self.0.pool())
                .await
                .unwrap();
            n.parse().unwrap()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql() {
        let Some((options, name)) = crate::support::mysql::fresh_database().await else {
            return;
        };
        // One connection: the commit counter is that session's (the server-wide counters move
        // with every other test on the server); concurrent duplicates then take turns on it.
        let store = MySqlStore::from_pool(crate::support::mysql::pool_for(&options, 1).await);
        store.migrate().await.unwrap();
        suite(&My(store), "mysql").await;
        crate::support::mysql::drop_database(&options, &name).await;
    }

    /// A phase stuck in one statement: cut off by its timeout, and its statement cut off by
    /// the server (`max_statement_time`) rather than left running for an hour.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cut_off_phase_statement_does_not_run_on() {
        let Some((options, name)) = crate::support::mysql::fresh_database().await else {
            return;
        };
        let store = MySqlStore::from_pool(crate::support::mysql::pool_for(&options, 4).await);
        store.migrate().await.unwrap();
        let marker = format!("idemflow-stuck-{name}");
        let sql = format!("SELECT SLEEP(3600) /* {marker} */");
        let phase = store.atomic_phase(move |conn| {
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&mut *conn)
                    .await?;
                Ok(StoredResponse::new(200))
            })
        });
        let pool = store.pool().clone();
        super::stuck_statement_ends(Arc::new(store), Box::new(phase), &marker, |marker| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                     WHERE ID <> CONNECTION_ID() AND COMMAND = 'Query' \
                     AND INFO LIKE CONCAT('%', ?, '%')",
                )
                .bind(marker)
                .fetch_one(&pool)
                .await
                .unwrap()
            }
        })
        .await;
        crate::support::mysql::drop_database(&options, &name).await;
    }
}
