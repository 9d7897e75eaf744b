//! Await points the scheduler controls, and what the simulation observes at them.
//!
//! Every actor (client, sweeper, operator, purge) runs in its own task, inside [`ACTOR`]. Each
//! store call and each provider call parks the actor before and after it ([`park`]) and waits for
//! the scheduler: only one actor runs at a time, so a seed fixes the order of every store and
//! provider call. Dropping a parked actor's task is a crash at that point: before a store write
//! (the write never happens) or after it (it happened, the answer is lost). Calls made outside
//! an actor (the scheduler's own reads, the final sweeps) pass straight through.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use idemflow::{KeyState, StoredResponse};
use tokio::sync::{mpsc, oneshot};

use crate::checks::{Check, Violation};

/// Where an actor stopped.
#[derive(Debug, Clone)]
pub struct Point {
    /// `store.claim`, `provider.call`, ...
    pub what: &'static str,
    /// `before`, `after`, `in_flight` (the provider has the request but has not acted), `acted`.
    pub phase: &'static str,
    /// The key label or provider key concerned, if one.
    pub on: String,
}

impl std::fmt::Display for Point {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}({})", self.what, self.phase, self.on)
    }
}

/// What an actor tells the scheduler.
pub enum Event {
    Parked {
        point: Point,
        resume: oneshot::Sender<()>,
    },
    Done(String),
}

#[derive(Clone)]
pub struct ActorCtx {
    pub id: usize,
    pub events: mpsc::UnboundedSender<Event>,
}

tokio::task_local! {
    pub static ACTOR: ActorCtx;
}

/// How often an actor's stall probe wakes its task.
pub const PROBE_TICK: std::time::Duration = std::time::Duration::from_millis(10);

/// Runs an actor's `body` beside a probe in the same task: a timer of [`PROBE_TICK`], and how
/// late it fires. The task's other timers (the heartbeat renewing its lease) fire as late, on
/// whichever worker thread runs it, so a takeover after such a stall is told apart from one the
/// code caused (`Shared::renewals_starved`).
pub async fn with_stall_probe<F: Future>(actor: usize, shared: SharedRef, body: F) -> F::Output {
    let probe = async {
        loop {
            let t = std::time::Instant::now();
            shared.lock().unwrap().ticked.insert(actor, t);
            tokio::time::sleep(PROBE_TICK).await;
            let late = t.elapsed().saturating_sub(PROBE_TICK);
            if late >= std::time::Duration::from_millis(10) {
                let mut sh = shared.lock().unwrap();
                sh.actor_stalls
                    .push((actor, std::time::Instant::now(), late));
            }
        }
    };
    tokio::pin!(body);
    tokio::pin!(probe);
    tokio::select! {
        biased;
        out = &mut body => out,
        () = &mut probe => unreachable!("the probe never ends"),
    }
}

/// The running actor's id (`None` for the scheduler itself).
pub fn current_actor() -> Option<usize> {
    ACTOR.try_with(|a| a.id).ok()
}

/// Parks the running actor at `point` until the scheduler resumes it; never returns if the
/// scheduler crashes it instead. Outside an actor: returns at once.
pub async fn park(what: &'static str, phase: &'static str, on: impl Into<String>) {
    let Ok(ctx) = ACTOR.try_with(Clone::clone) else {
        return;
    };
    let (tx, rx) = oneshot::channel();
    let point = Point {
        what,
        phase,
        on: on.into(),
    };
    if ctx
        .events
        .send(Event::Parked { point, resume: tx })
        .is_err()
        || rx.await.is_err()
    {
        std::future::pending::<()>().await;
    }
}

/// One time the provider acted.
#[derive(Debug, Clone)]
pub struct Effect {
    pub n: u64,
    pub provider: String,
    pub provider_key: String,
    /// The key label (`scope/key`) and its generation when the provider acted.
    pub label: String,
    pub generation: u32,
    pub response: StoredResponse,
    /// System clock (the databases under test run on this machine).
    pub at: chrono::DateTime<chrono::Utc>,
}

/// Everything the actors share with the scheduler. Locked only briefly, never across an await.
#[derive(Debug, Default)]
pub struct Shared {
    pub step: usize,
    pub ledger: Vec<Effect>,
    /// Provider key -> key label.
    pub labels: BTreeMap<String, String>,
    /// Key label -> generation (bumped when the key is purged).
    pub generations: BTreeMap<String, u32>,
    /// Provider key -> actors inside a provider call for it.
    pub live: BTreeMap<String, BTreeSet<usize>>,
    /// Provider key -> requests the provider is processing (its own "in flight").
    pub processing: BTreeMap<String, u32>,
    /// Key label -> (generation, token) of every lease granted, in order.
    pub grants: BTreeMap<String, Vec<(u32, i64)>>,
    /// (actor, key label) -> the lease that actor holds: token and expiry (database clock).
    pub holding: BTreeMap<(usize, String), (i64, chrono::DateTime<chrono::Utc>)>,
    /// (actor, key label) -> when a renewal of its lease was sent that has not answered yet.
    pub renewing: BTreeMap<(usize, String), std::time::Instant>,
    /// When this process's runtime ran a 5 ms timer late, and by how much (only lateness of
    /// 10 ms or more is kept): the CPU the heartbeats need was not there.
    pub stalls: Vec<(std::time::Instant, std::time::Duration)>,
    /// Actor -> when its task's stall probe last started waiting (`with_stall_probe`).
    pub ticked: BTreeMap<usize, std::time::Instant>,
    /// (actor, when, how late) each time an actor's own probe ran 10 ms or more late: that
    /// task's timers (its heartbeat) ran as late, whatever the rest of the runtime did.
    pub actor_stalls: Vec<(usize, std::time::Instant, std::time::Duration)>,
    /// The shortest lease of the schedule (request or sweeper).
    pub shortest_lease: std::time::Duration,
    /// Takeovers during a live call, and effects after the holder's lease ran out, whose
    /// holder's renewals could not get through (the store was down, its renewal was still on
    /// the wire, or the runtime stalled for a third of a lease): outside what the guarantee
    /// assumes (docs/reliability.md, "What the guarantee assumes"), so counted, not
    /// failed; the core checks still judge what followed.
    pub starved: Vec<String>,
    /// Key labels taken over while starved: what follows on them is outside the guarantee, so
    /// their later violations are kept in `excused`, not failed.
    pub tainted: BTreeSet<String>,
    /// Violations on tainted keys (check name, key, detail).
    pub excused: Vec<String>,
    /// Key labels purged since their last grant.
    pub purged_since_grant: BTreeSet<String>,
    /// Actor -> the generation of the key when its latest claim was answered: a client's
    /// response belongs to the row it claimed or found, even if a purge is seen before the
    /// client returns.
    pub claimed_in: BTreeMap<(usize, String), u32>,
    /// (key label, generation) -> the first response a client got.
    pub responses: BTreeMap<(String, u32), StoredResponse>,
    /// Key label -> the generation in which a client was last told an answer.
    pub acked: BTreeMap<String, u32>,
    /// Faults are off (final sweeps).
    pub healthy: bool,
    /// Since when the store is down ([`Mode::Outages`](crate::world::Mode::Outages)): every
    /// store call of an actor is refused unrun, its lease renewals included.
    pub store_down: Option<std::time::Instant>,
    /// The store's outages so far: (start, end; `None` while it lasts).
    pub outages: Vec<(std::time::Instant, Option<std::time::Instant>)>,
    /// (actor, key label) -> when its lease on the key was last granted or renewed.
    pub renewed: BTreeMap<(usize, String), std::time::Instant>,
    /// The last crash of an actor or dropped store connection (the liveness check counts from
    /// it).
    pub last_disruption: Option<std::time::Instant>,
    /// Failovers that lost writes so far ([`Mode::Failover`](crate::world::Mode::Failover)).
    pub failovers: usize,
    /// Key label -> its provider's dedup window (`None`: keyless, or a workflow holding a
    /// keyless step), for every key a failover rolled back.
    pub rolled_back: BTreeMap<String, Option<std::time::Duration>>,
    /// Key label -> its generation when a failover last rolled it back: a purge after that
    /// starts a new life, whose new provider key is by design.
    pub rolled_back_in: BTreeMap<String, u32>,
    /// Provider name -> its dedup window (`None`: keyless).
    pub provider_windows: BTreeMap<&'static str, Option<std::time::Duration>>,
    /// Violations on rolled-back keys that the lost writes explain (check, key, detail, why).
    pub lost_writes_excused: Vec<String>,
    /// Actor -> the switch that kills the runs a queue consumer started for it, which go on in
    /// tasks of their own (`crate::queue::AsActor`): thrown when the actor crashes, and for
    /// every actor left when the schedule ends.
    pub kill_switches: BTreeMap<usize, tokio::sync::watch::Sender<bool>>,
    /// Provider key -> the request its key's client sends, where the key's stored request is
    /// not it (the queue deliveries): the provider must act on that request only.
    pub requests: BTreeMap<String, serde_json::Value>,
    /// Key label -> the runs of its queue handler that recorded its own effect (a message
    /// whose consumer has no provider): keyed by the message, so the effect is there once
    /// however many runs record it.
    pub own_effects: BTreeMap<String, u32>,
    /// Key label -> the deliveries of its queue message so far.
    pub deliveries: BTreeMap<String, u64>,
    /// Key label -> the notes its deliveries carried (`crate::queue`: a corrected copy's
    /// differs).
    pub notes: BTreeMap<String, std::collections::BTreeSet<String>>,
    /// (key label, generation) -> the notes of its acknowledged deliveries.
    pub acked_notes: BTreeMap<(String, u32), std::collections::BTreeSet<String>>,
    /// Key label -> its deliveries refused and dead-lettered.
    pub dead_lettered: BTreeMap<String, u32>,
    pub violations: Vec<Violation>,
    pub trace: Vec<String>,
}

pub type SharedRef = Arc<Mutex<Shared>>;

impl Shared {
    /// Kills the runs a queue consumer started for `actor`, if it started any.
    pub fn kill(&mut self, actor: usize) {
        if let Some(switch) = self.kill_switches.remove(&actor) {
            let _ = switch.send(true);
        }
    }

    pub fn violate(&mut self, check: Check, key: &str, detail: String) {
        // Printed and kept apart, not failed: what a lossy failover explains, then what
        // follows a starved takeover.
        let (context, kept) = if let Some(why) = self.lost_writes_explain(check, key) {
            (
                format!("after a failover lost writes: {why}"),
                Some((&mut self.lost_writes_excused, format!(" ({why})"))),
            )
        } else if self.tainted.contains(key) {
            (
                "after a starved takeover".to_owned(),
                Some((&mut self.excused, String::new())),
            )
        } else {
            (String::new(), None)
        };
        if let Some((list, why)) = kept {
            list.push(format!("{} on {key}: {detail}{why}", check.name()));
            self.trace
                .push(format!("  ({context}) {} on {key}: {detail}", check.name()));
            return;
        }
        let step = self.step;
        self.trace
            .push(format!("  !! {} on {key}: {detail}", check.name()));
        self.violations.push(Violation {
            check,
            key: key.to_owned(),
            step,
            detail,
        });
    }

    /// Why a violation of `check` on `key` is what a failover that lost acknowledged writes
    /// does, if it is (`docs/reliability.md`, "A failover that loses acknowledged writes"). On a
    /// rolled-back key the lease history is gone (tokens repeat, a lease is granted again while
    /// its lost holder still runs) and so is what the clients were told; what still holds is
    /// that a keyed provider acts once and answers alike for a re-run inside its dedup window
    /// (when the re-run sends the same provider key: finding 11), that a stored answer is one
    /// the provider gave, that scopes stay apart, and that every key settles within a lease of
    /// the failover. A key whose record of an attempt that acted was lost may settle without
    /// that effect (failed and retryable, say): nothing is left that says the provider acted.
    fn lost_writes_explain(&self, check: Check, key: &str) -> Option<&'static str> {
        let window = *self.rolled_back.get(key)?;
        match check {
            Check::AtMostOneEffect | Check::ReplaysIdentical => {
                let mut providers: BTreeSet<&str> = BTreeSet::new();
                providers.extend(
                    self.ledger
                        .iter()
                        .filter(|e| e.label == key)
                        .map(|e| e.provider.as_str()),
                );
                let window = match providers.len() {
                    // A workflow's own label: its steps acted, under their own labels.
                    0 => window,
                    1 => self
                        .provider_windows
                        .get(providers.first().copied().unwrap_or_default())
                        .copied()
                        .flatten(),
                    _ => {
                        return Some(
                            "the lost record was the one that kept the key on its first \
                             provider: the re-run went to the other, and each acted once",
                        );
                    }
                };
                match window {
                    None => Some("keyless: the re-run of a lost key acts again"),
                    Some(w) if self.effects_spread(key) >= w => {
                        Some("the re-run reached the provider after its dedup window")
                    }
                    Some(_) => None,
                }
            }
            Check::TokensStrictlyGrow
            | Check::TokensGrowAcrossPurge
            | Check::NoTakeoverDuringLiveCall
            | Check::NoEffectOutsideLease
            | Check::SweeperNeverRetryableAfterEffect
            | Check::WorkerNeverRetryableAfterEffect
            | Check::OperatorNeverRetryableAfterEffect
            | Check::ResolveNeverOverwritesADecision
            | Check::AckedWriteSurvivesReopen => Some("the lease and answer history was lost"),
            Check::AckedOnlyOneMessage => Some(
                "the lost record held the first message's fingerprint: another message claimed \
                 the key anew",
            ),
            Check::RefusedOnlyAnotherMessage => None,
            Check::EffectSettlesAtQuiescence => Some(
                "the record of the attempt that acted was lost: the store no longer knows the \
                 provider may have acted, so no sweep looks it up",
            ),
            // A key purged since its rollback lives anew, under a provider key of its own by
            // design: an attempt whose claim the failover lost may still land after that purge.
            Check::ProviderKeyKeptAcrossLostWrites
                if self
                    .rolled_back_in
                    .get(key)
                    .is_some_and(|&g| self.generation(key) > g) =>
            {
                Some("the key was purged since its rollback: a new life, a provider key of its own")
            }
            Check::DoneMatchesAnEffect
            | Check::ScopesIsolated
            | Check::NoStoreErrors
            | Check::AtomicRowsIffDone
            | Check::ToldWhatCommitted
            | Check::SettlesWithinALeaseOfTheLastCrash
            | Check::ProviderKeyKeptAcrossLostWrites
            | Check::ActsOnTheClientsRequest
            | Check::AckedAfterItsOwnEffect => None,
        }
    }

    /// The time between the first and the last effect of `label` (any generation).
    fn effects_spread(&self, label: &str) -> std::time::Duration {
        let ats = self
            .ledger
            .iter()
            .filter(|e| e.label == label)
            .map(|e| e.at);
        let (Some(first), Some(last)) = (ats.clone().min(), ats.max()) else {
            return std::time::Duration::ZERO;
        };
        (last - first).to_std().unwrap_or_default()
    }

    pub fn generation(&self, label: &str) -> u32 {
        self.generations.get(label).copied().unwrap_or(0)
    }

    /// Records a lease granted on `label` (whose provider key is `pk`) with `token` by `how`,
    /// checking the token order and that no other actor is inside a provider call for the key.
    pub fn granted(
        &mut self,
        label: &str,
        pk: &str,
        token: i64,
        expires: Option<chrono::DateTime<chrono::Utc>>,
        how: &str,
    ) {
        let generation = self.generation(label);
        // A key re-created after a purge sends a provider key of its own
        // (`provider_key::renewed`): learnt here, from the lease that carries it.
        self.labels.insert(pk.to_owned(), label.to_owned());
        let me = current_actor();
        if let (Some(a), Some(exp)) = (me, expires) {
            self.holding.insert((a, label.to_owned()), (token, exp));
            self.renewed
                .insert((a, label.to_owned()), std::time::Instant::now());
        }
        self.trace
            .push(format!("    {label}: {how} granted token {token}"));
        let across_purge = self.purged_since_grant.remove(label);
        let last = self.grants.get(label).and_then(|g| g.last().copied());
        if let Some((_, prev)) = last
            && token <= prev
        {
            let check = if across_purge {
                Check::TokensGrowAcrossPurge
            } else {
                Check::TokensStrictlyGrow
            };
            self.violate(
                check,
                label,
                format!("{how} granted token {token} after token {prev} was granted"),
            );
        }
        self.grants
            .entry(label.to_owned())
            .or_default()
            .push((generation, token));
        let others: Vec<usize> = self
            .live
            .get(pk)
            .map(|s| s.iter().copied().filter(|a| Some(*a) != me).collect())
            .unwrap_or_default();
        if !others.is_empty()
            && let Some(why) = others.iter().find_map(|o| self.renewals_starved(*o, label))
        {
            self.mark_starved(
                label,
                format!(
                    "{how} granted token {token} on {label} while actor(s) {others:?} still run a provider call for it: {why}"
                ),
            );
        } else if !others.is_empty() {
            self.violate(
                Check::NoTakeoverDuringLiveCall,
                label,
                format!(
                    "{how} granted token {token} while actor(s) {others:?} still run a provider call for it"
                ),
            );
        }
    }

    /// Why actor `holder`'s renewals of `label` could not get through, if they could not: a
    /// renewal sent before its lease ran out is still unanswered (the store was too slow), or
    /// the runtime ran a timer a third of a lease late within the last lease (no CPU for the
    /// heartbeat). `None`: the renewals had what they need, so a takeover is the code's fault.
    fn renewals_starved(&self, holder: usize, label: &str) -> Option<String> {
        let lease = self.shortest_lease;
        // The store refused every renewal while it was down: a lease can lapse under a live
        // call, and the store cannot know its holder lives (`docs/reliability.md`, "The
        // simulation"). An outage that lasted past the holder's last grant or renewal may have
        // let its lease run out, however long ago it ended.
        let now = std::time::Instant::now();
        let last_ok = self.renewed.get(&(holder, label.to_owned())).copied();
        if let Some((start, end)) = self.outages.iter().rev().find(|(_, end)| match last_ok {
            Some(ok) => end.is_none_or(|e| e > ok),
            None => end.is_none_or(|e| now.duration_since(e) < lease),
        }) {
            return Some(format!(
                "the store was down from {:?} ago{} (a{holder}'s renewals were refused)",
                start.elapsed(),
                end.map_or(String::new(), |e| format!(" to {:?} ago", e.elapsed()))
            ));
        }
        if let Some(sent) = self.renewing.get(&(holder, label.to_owned())) {
            return Some(format!(
                "a{holder}'s renewal sent {:?} ago has not been answered",
                sent.elapsed()
            ));
        }
        // The holder's own task (its heartbeat shares it): not run for a third of a lease by
        // now, or run that late within the last lease. A multi-threaded runtime can stall one
        // worker thread (the OS gave it no CPU) while the runtime-wide probe below runs on time.
        if let Some(t) = self.ticked.get(&holder)
            && t.elapsed() >= lease / 3 + PROBE_TICK
        {
            return Some(format!(
                "a{holder}'s task has not run for {:?} (a third of the {lease:?} lease)",
                t.elapsed()
            ));
        }
        let since = std::time::Instant::now().checked_sub(lease)?;
        if let Some((_, at, late)) = self
            .actor_stalls
            .iter()
            .rev()
            .take_while(|(_, at, _)| *at >= since)
            .find(|(a, _, late)| *a == holder && *late >= lease / 3)
        {
            return Some(format!(
                "a{holder}'s task ran a timer {late:?} late {:?} ago (a third of the {lease:?} lease)",
                at.elapsed()
            ));
        }
        self.stalls
            .iter()
            .rev()
            .take_while(|(at, _)| *at >= since)
            .find(|(_, late)| *late >= lease / 3)
            .map(|(at, late)| {
                format!(
                    "the runtime ran a timer {late:?} late {:?} ago (a third of the {lease:?} lease)",
                    at.elapsed()
                )
            })
    }

    /// Called when the provider acts for `label` on behalf of the running actor: that actor's
    /// lease must still be current (finding 10: a call may outlive a fixed lease, and then
    /// someone else took the key over).
    pub fn check_acting_lease(&mut self, label: &str) {
        self.check_lease(label, false);
    }

    /// Checks, as the request leaves the actor, that it holds the key's lease: unexpired on the
    /// database clock and current. (Once sent, a request may be acted on after the lease ran
    /// out, if the store was too slow to renew it; what must never happen then is that someone
    /// else holds the key, which `check_acting_lease` and `no_takeover_during_live_call` see.)
    pub fn check_sending_lease(&mut self, label: &str) {
        self.check_lease(label, true);
    }

    fn check_lease(&mut self, label: &str, sending: bool) {
        let Some(a) = current_actor() else { return };
        let Some((token, exp)) = self.holding.get(&(a, label.to_owned())).copied() else {
            return;
        };
        let now = chrono::Utc::now();
        let latest = self
            .grants
            .get(label)
            .and_then(|g| g.last())
            .map(|(_, t)| *t);
        if sending && exp < now {
            let late = (now - exp).num_milliseconds();
            self.violate(
                Check::NoEffectOutsideLease,
                label,
                format!("a{a} sent its request {late} ms after its lease (token {token}) expired"),
            );
        } else if latest != Some(token) {
            let what = if sending {
                "sent a request"
            } else {
                "the provider acted"
            };
            self.violate(
                Check::NoEffectOutsideLease,
                label,
                format!("{what} for a{a} holding token {token} after token {latest:?} was granted"),
            );
        } else if !sending
            && exp < now
            && let Some(why) = self.renewals_starved(a, label)
        {
            // The provider acted after the holder's lease ran out, its renewals refused or
            // starved (a hung call through a store outage). Nobody holds the key yet, but the
            // store may now hand it to a sweeper whose lookup cannot see so late an effect:
            // outside what the guarantee assumes ("Renewals get through"), as a takeover
            // during the call would be.
            let late = (now - exp).num_milliseconds();
            self.mark_starved(
                label,
                format!(
                    "the provider acted for a{a} {late} ms after its lease (token {token}) ran out on {label}: {why}"
                ),
            );
        }
    }

    /// Notes that `label` went outside the guarantee's assumptions (its holder's renewals could
    /// not get through): `line` is traced and printed, and the key's later violations are
    /// excused.
    fn mark_starved(&mut self, label: &str, line: String) {
        self.trace.push(format!("  (starved) {line}"));
        self.starved.push(line);
        self.tainted.insert(label.to_owned());
    }

    /// The effects on `pk` in generation `generation`.
    /// The effects made for a key's `generation` (under whichever provider key it sent).
    pub fn effects(&self, label: &str, generation: u32) -> Vec<&Effect> {
        self.ledger
            .iter()
            .filter(|e| e.label == label && e.generation == generation)
            .collect()
    }
}

/// Whether a state holds a final answer.
pub fn decided(state: KeyState) -> bool {
    matches!(
        state,
        KeyState::Done | KeyState::Failed { retryable: false }
    )
}
