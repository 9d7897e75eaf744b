//! Queue deliveries ([`Mode::Queues`](crate::world::Mode::Queues)): a client of such a key is a
//! broker delivering the key's message to a queue consumer (`idemflow::consumer::Consumer`)
//! declared with the key's provider, whose handler sends the message's body to it with
//! `Context::send`. The consumer's key is the message id in the key's scope, under the
//! consumer's operation, so every check of a single call holds for it; a delivery left for
//! redelivery is tried again, as the broker would, and an acknowledged one counts as told an
//! answer (its key must be decided).
//!
//! Each delivery is a message `{"order": <the key's body>, "note": .., "trace": ..}`, its members
//! in an order and spacing of its own, fingerprinted by `/order` and `/note` (a
//! `FingerprintSource::JsonPointers` consumer): every copy is the same message, whatever its
//! encoding and trace, except a corrected copy (about one delivery in ten), whose note differs.
//! The handler sends `order`; half the keys' consumers are `Consumer::sending` (the request
//! built from the message and stored, so the sweeper re-sends it), the rest a handler that
//! calls `Context::send`. A refused delivery is dead-lettered, never redelivered; it must be a
//! message reusing the key ([`Check::RefusedOnlyAnotherMessage`]), and a key's acknowledged
//! deliveries must all be one message ([`Check::AckedOnlyOneMessage`]).
//!
//! In [`Mode::OwnEffects`](crate::world::Mode::OwnEffects), half the messages go to a consumer
//! without a provider instead: its handler records the message's own effect (keyed by the
//! message, in `Shared::own_effects`) after a point where its actor may crash, and an `Ack`
//! must come after such a record (`acked_after_its_own_effect`).
//!
//! The consumer runs each delivery's handler in tasks of its own, where the actor's task-local
//! context does not follow, and which the scheduler's crash of the actor (an abort of its task)
//! does not stop. So its executor's store and the handler's provider calls run as the
//! delivering actor ([`AsActor`]): they park where the actor's own calls would, and when the
//! scheduler crashes that actor, the call each run is in is dropped (as the abort drops a
//! client's) and no call of those runs returns or starts again, as a killed consumer process
//! makes no more calls, its lease renewals included.

use idemflow::store::FinishMode;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use idemflow::consumer::{Consumer, ConsumerError, Disposition, FingerprintSource, Message};
use idemflow::store::{ClaimOutcome, Finish, NewClaim, Release};
use idemflow::{
    Context, Idempotency, KeyId, Outcome, Store, StoreError, StoredResponse, async_trait,
    conformance::Delegate, key::Scope, record::KeyRecord, record::LeaseToken,
};

use tokio::sync::watch;

use crate::checks::Check;
use crate::gate::{ACTOR, ActorCtx, SharedRef, park};
use crate::provider::SimProvider;
use crate::world::KeyDef;

/// A store whose every call the consumer's executor makes runs as the delivering actor, and is
/// dropped, never to return, once that actor crashed.
pub struct AsActor {
    inner: Arc<dyn Store>,
    actor: ActorCtx,
    killed: watch::Receiver<bool>,
}

impl std::fmt::Debug for AsActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AsActor(a{})", self.actor.id)
    }
}

impl AsActor {
    async fn run<T>(&self, call: impl Future<Output = T>) -> T {
        as_actor(&self.actor, self.killed.clone(), call).await
    }
}

/// Runs `call` as `actor` until the actor is killed; then drops it and waits for good.
async fn as_actor<T>(
    actor: &ActorCtx,
    mut killed: watch::Receiver<bool>,
    call: impl Future<Output = T>,
) -> T {
    tokio::select! {
        biased;
        // Thrown, or its sender gone with the schedule.
        _ = killed.wait_for(|k| *k) => {}
        out = ACTOR.scope(actor.clone(), call) => return out,
    }
    std::future::pending().await
}

#[async_trait]
impl Delegate for AsActor {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        self.run(self.inner.now()).await
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        self.run(self.inner.claim(claim)).await
    }

    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        self.run(self.inner.finish_as(id, mode, finish)).await
    }

    async fn release(&self, id: &KeyId, token: LeaseToken, r: &Release) -> Result<(), StoreError> {
        self.run(self.inner.release(id, token, r)).await
    }

    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        self.run(self.inner.mark_attempt(id, token)).await
    }

    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: std::time::Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        self.run(self.inner.extend(id, token, lease)).await
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        self.run(self.inner.get(id)).await
    }

    async fn announce_end(&self, id: &KeyId) -> Result<bool, StoreError> {
        self.run(self.inner.announce_end(id)).await
    }
}

/// Delivers `key`'s message once to a consumer over `exec`'s settings and `store`, declared with
/// `provider`. Returns what the delivery came to and whether the broker delivers it again.
pub async fn client(
    exec: Idempotency,
    key: KeyDef,
    provider: Arc<SimProvider>,
    store: Arc<dyn Store>,
    shared: SharedRef,
) -> (String, bool) {
    // Outside an actor (the scheduler's last retries) the calls pass straight through.
    let actor = ACTOR.try_with(Clone::clone).ok().map(|actor| {
        let killed = shared
            .lock()
            .unwrap()
            .kill_switches
            .entry(actor.id)
            .or_insert_with(|| watch::channel(false).0)
            .subscribe();
        (actor, killed)
    });
    let store: Arc<dyn Store> = match &actor {
        Some((actor, killed)) => Arc::new(AsActor {
            inner: store,
            actor: actor.clone(),
            killed: killed.clone(),
        }),
        None => store,
    };
    let c = exec.config();
    let idem = Idempotency::new(store)
        .lease(c.lease)
        .retention(c.retention)
        .retry_takeover_window(c.retry_takeover_window)
        .owner(c.owner.clone());
    let scope = match Scope::new(key.id.scope.as_str()) {
        Ok(s) => s,
        Err(e) => return (format!("bad scope: {e}"), false),
    };
    let handler = {
        let (provider, actor) = (provider.clone(), actor.clone());
        move |message: Message, ctx: Context| {
            let provider = provider.clone();
            let actor = actor.clone();
            async move {
                let body = order_of(&message).unwrap_or_default();
                let send = async move { ctx.send(provider.as_ref(), &body).await };
                match actor {
                    Some((actor, killed)) => as_actor(&actor, killed, send).await,
                    None => send.await,
                }
            }
        }
    };
    // The key's generation when the delivery starts: one that spans a purge is not judged by
    // `acked_only_one_message` (its ack may be of the key's earlier life).
    let (delivery, started_in) = {
        let mut sh = shared.lock().unwrap();
        let started_in = sh.generation(&key.label);
        let n = sh.deliveries.entry(key.label.clone()).or_default();
        *n += 1;
        (*n, started_in)
    };
    let roll = mix(&key.label, delivery);
    let note = if roll.is_multiple_of(10) {
        "corrected"
    } else {
        "first"
    };
    shared
        .lock()
        .unwrap()
        .notes
        .entry(key.label.clone())
        .or_default()
        .insert(note.to_owned());
    let message = Message::new(encoded(&key.body, note, roll)).with_message_id(key.id.key.as_str());
    let sends = mix(&key.label, 0).is_multiple_of(2);
    let disposition = if key.own_effect {
        // The application's own effect, keyed by the message: recorded by the run as the
        // delivering actor, after a point where the actor may crash.
        let own = {
            let (shared, label) = (shared.clone(), key.label.clone());
            move |_message: Message, _ctx: Context| {
                let (shared, label, actor) = (shared.clone(), label.clone(), actor.clone());
                async move {
                    let effect = async move {
                        park("consumer.effect", "before", &label).await;
                        *shared.lock().unwrap().own_effects.entry(label).or_default() += 1;
                        Outcome::Succeeded(
                            StoredResponse::new(200).with_body("{\"recorded\":true}"),
                        )
                    };
                    match actor {
                        Some((actor, killed)) => as_actor(&actor, killed, effect).await,
                        None => effect.await,
                    }
                }
            }
        };
        fingerprinted(Consumer::new(idem, scope, own))
            .handle(message)
            .await
    } else if sends {
        let provider: Arc<dyn idemflow::Provider> = provider.clone();
        fingerprinted(Consumer::sending(idem, scope, provider, order_of))
            .handle(message)
            .await
    } else {
        fingerprinted(Consumer::new(idem, scope, handler).provider(provider.clone()))
            .handle(message)
            .await
    };
    match disposition {
        Disposition::Ack { ran } => {
            let mut sh = shared.lock().unwrap();
            if key.own_effect && !sh.own_effects.contains_key(&key.label) {
                sh.violate(
                    Check::AckedAfterItsOwnEffect,
                    &key.label,
                    format!("acked (ran: {ran}) with no run of its handler recorded"),
                );
            }
            let generation = sh.generation(&key.label);
            if generation == started_in {
                let acked = sh
                    .acked_notes
                    .entry((key.label.clone(), generation))
                    .or_default();
                acked.insert(note.to_owned());
                if acked.len() > 1 {
                    let detail = format!("acked copies of two messages: {acked:?}");
                    sh.violate(Check::AckedOnlyOneMessage, &key.label, detail);
                }
            }
            sh.told_settled(&key.label);
            drop(sh);
            let how = if ran { "ran" } else { "settled before" };
            (format!("acked ({how})"), false)
        }
        Disposition::Redeliver { reason, after } => (
            format!("left for redelivery ({reason:?}, after {after:?})"),
            true,
        ),
        Disposition::Reject(e) => {
            // Dead-lettered: never delivered again.
            let said = format!("dead-lettered ({note}): {e}");
            let mut sh = shared.lock().unwrap();
            *sh.dead_lettered.entry(key.label.clone()).or_default() += 1;
            let another = sh.notes.get(&key.label).is_some_and(|n| n.len() > 1);
            if !matches!(e, ConsumerError::KeyReused { .. }) {
                sh.violate(Check::ScopesIsolated, &key.label, said.clone());
            } else if !another {
                let detail = format!("refused with only one message delivered: {said}");
                sh.violate(Check::RefusedOnlyAnotherMessage, &key.label, detail);
            }
            (said, false)
        }
        other => (format!("{other:?}"), false),
    }
}

/// The consumer's fingerprint: the message's `/order` and `/note`, not its trace or encoding.
fn fingerprinted(consumer: Consumer) -> Consumer {
    consumer.fingerprint(FingerprintSource::JsonPointers(vec![
        "/order".into(),
        "/note".into(),
    ]))
}

/// The provider's request a message carries: its `order`.
fn order_of(message: &Message) -> Result<serde_json::Value, idemflow::error::BoxError> {
    let body: serde_json::Value = message.json()?;
    body.get("order").cloned().ok_or_else(|| "no order".into())
}

/// A number from `label` and `n` (FNV-1a), the same in every run of a seed.
fn mix(label: &str, n: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in label.bytes().chain(n.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The message of `order` with `note`, encoded as `roll` picks: its members in one order or
/// the other, compact or spaced, with a trace of its own.
fn encoded(order: &serde_json::Value, note: &str, roll: u64) -> Vec<u8> {
    let order = serde_json::to_string(order).unwrap_or_default();
    let note = serde_json::to_string(note).unwrap_or_default();
    let trace = roll % 1000;
    let text = match (roll / 10) % 3 {
        0 => format!(r#"{{"order":{order},"note":{note},"trace":{trace}}}"#),
        1 => format!(r#"{{ "trace": {trace}, "note": {note}, "order": {order} }}"#),
        _ => format!("{{\n  \"note\" : {note},\n  \"order\" : {order}\n}}"),
    };
    text.into_bytes()
}
