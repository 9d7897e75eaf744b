//! The simulated provider: an in-process [`Provider`] with a ledger of effects, a dedup window by
//! provider key (a re-send inside it replays the first result), search lag on lookups, and faults
//! drawn from the schedule's seed: 429 / connect errors (nothing done), 5xx before acting, lost
//! responses and 5xx after acting (the effect happened, the caller hears "unknown"), declines
//! (by amount), hangs (the scheduler leaves the caller parked inside the call), and lookups that
//! cannot answer. A keyless provider has no dedup at all and is looked up by metadata only.

use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemflow::{
    Outcome, Provider, StoredResponse, async_trait, provider::Attempts, provider::CallReply,
    provider::KeySpec, provider::Lookup,
};

use crate::checks::Check;
use crate::gate::{Effect, SharedRef, current_actor, park};
use crate::rng::Rng;

/// Fault rates, per mille.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    pub retryable: u64,
    pub error_before: u64,
    pub lost: u64,
    pub error_after: u64,
    pub lookup_unknown: u64,
}

impl Faults {
    pub fn draw(rng: &mut Rng) -> Self {
        // A quarter of the schedules have a healthy provider.
        if rng.chance(250) {
            return Self::default();
        }
        Self {
            retryable: rng.range(0, 250),
            error_before: rng.range(0, 120),
            lost: rng.range(0, 300),
            error_after: rng.range(0, 120),
            lookup_unknown: rng.range(0, 250),
        }
    }
}

#[derive(Debug)]
pub struct SimProvider {
    pub name: &'static str,
    /// The lookup needs the key's stored request to find the effect (as a Stripe refund's:
    /// which payment to list): without it (`Null`), it answers "needs an operator", as the
    /// adapters do, never an authoritative "not found".
    pub lookup_needs_request: bool,
    /// `Some(window)`: keys, and a same-key re-send inside the window replays the first result.
    pub window: Option<Duration>,
    pub search_lag: Duration,
    pub faults: Faults,
    pub rng: Mutex<Rng>,
    pub shared: SharedRef,
}

/// Removes the caller from the live set (and the provider's in-flight set) however the call
/// ends, crash included.
struct LiveGuard<'a> {
    shared: &'a SharedRef,
    pk: String,
    actor: Option<usize>,
    processing: bool,
}

impl Drop for LiveGuard<'_> {
    fn drop(&mut self) {
        let mut sh = self.shared.lock().unwrap();
        if let Some(a) = self.actor
            && let Some(set) = sh.live.get_mut(&self.pk)
        {
            set.remove(&a);
        }
        if self.processing
            && let Some(n) = sh.processing.get_mut(&self.pk)
        {
            *n = n.saturating_sub(1);
        }
    }
}

fn amount(request: &serde_json::Value) -> u64 {
    request
        .get("amount")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

impl SimProvider {
    fn roll(&self, per_mille: u64) -> bool {
        let healthy = self.shared.lock().unwrap().healthy;
        let hit = self.rng.lock().unwrap().chance(per_mille);
        hit && !healthy
    }

    /// The first effect for `pk` still inside the dedup window, if any.
    fn remembered(&self, pk: &str) -> Option<Effect> {
        let window = self.window?;
        let now = Utc::now();
        let sh = self.shared.lock().unwrap();
        sh.ledger
            .iter()
            .find(|e| {
                e.provider == self.name
                    && e.provider_key == pk
                    && (now - e.at).to_std().unwrap_or_default() < window
            })
            .cloned()
    }

    fn outcome_of(response: StoredResponse, replayed: bool) -> CallReply {
        if response.status() < 300 {
            CallReply::Succeeded { response, replayed }
        } else {
            CallReply::Rejected { response }
        }
    }
}

#[async_trait]
impl Provider for SimProvider {
    fn name(&self) -> &str {
        self.name
    }

    fn key_spec(&self) -> KeySpec {
        match self.window {
            Some(w) => KeySpec {
                max_len: 255,
                retention: Some(w),
                replays_same_key: true,
            },
            None => KeySpec::no_keys(),
        }
    }

    async fn send(&self, provider_key: &str, request: &serde_json::Value) -> CallReply {
        let actor = current_actor();
        {
            let mut sh = self.shared.lock().unwrap();
            if let Some(a) = actor {
                sh.live
                    .entry(provider_key.to_owned())
                    .or_default()
                    .insert(a);
            }
        }
        {
            let label = {
                let sh = self.shared.lock().unwrap();
                sh.labels.get(provider_key).cloned()
            };
            if let Some(label) = label {
                self.shared.lock().unwrap().check_sending_lease(&label);
            }
        }
        let mut guard = LiveGuard {
            shared: &self.shared,
            pk: provider_key.to_owned(),
            actor,
            processing: false,
        };
        park("provider.call", "before", provider_key).await;
        if self.roll(self.faults.retryable) {
            return CallReply::Retryable {
                reason: "429 Too Many Requests".into(),
                retry_after: Some(Duration::from_millis(5)),
            };
        }
        if self.roll(self.faults.error_before) {
            return CallReply::Unknown {
                reason: "503 before acting".into(),
            };
        }
        if let Some(first) = self.remembered(provider_key) {
            return Self::outcome_of(first.response, true);
        }
        if self.window.is_some() {
            let mut sh = self.shared.lock().unwrap();
            let n = sh.processing.entry(provider_key.to_owned()).or_default();
            if *n > 0 {
                return CallReply::InFlight {
                    retry_after: Some(Duration::from_millis(5)),
                };
            }
            *n += 1;
            guard.processing = true;
        }
        park("provider.call", "in_flight", provider_key).await;
        let response = {
            let mut sh = self.shared.lock().unwrap();
            let n = sh.ledger.len() as u64 + 1;
            let label = sh
                .labels
                .get(provider_key)
                .cloned()
                .unwrap_or_else(|| "?".into());
            let generation = sh.generation(&label);
            sh.check_acting_lease(&label);
            if let Some(expected) = sh.requests.get(provider_key)
                && expected != request
            {
                let detail = format!("acted on {request} where its client sends {expected}");
                sh.violate(Check::ActsOnTheClientsRequest, &label, detail);
            }
            let amt = amount(request);
            let response = if amt.is_multiple_of(5) {
                StoredResponse::json(
                    402,
                    &serde_json::json!({"error": "declined", "effect": n, "pk": provider_key}),
                )
            } else {
                StoredResponse::json(
                    201,
                    &serde_json::json!({"id": format!("eff_{n}"), "pk": provider_key, "amount": amt}),
                )
            }
            .expect("json");
            sh.trace.push(format!(
                "  effect #{n} by {} for {label} (gen {generation}): {}",
                self.name,
                response.status()
            ));
            if guard.processing
                && let Some(n) = sh.processing.get_mut(provider_key)
            {
                *n = n.saturating_sub(1);
            }
            sh.ledger.push(Effect {
                n,
                provider: self.name.to_owned(),
                provider_key: provider_key.to_owned(),
                label,
                generation,
                response: response.clone(),
                at: Utc::now(),
            });
            response
        };
        guard.processing = false;
        park("provider.call", "acted", provider_key).await;
        if self.roll(self.faults.lost) {
            return CallReply::Unknown {
                reason: "timeout after sending (response lost)".into(),
            };
        }
        if self.roll(self.faults.error_after) {
            return CallReply::Unknown {
                reason: "502 after acting".into(),
            };
        }
        Self::outcome_of(response, false)
    }

    async fn lookup(
        &self,
        provider_key: &str,
        request: &serde_json::Value,
        attempts: Attempts,
        now: DateTime<Utc>,
    ) -> Lookup {
        park("provider.lookup", "before", provider_key).await;
        if self.lookup_needs_request && request.is_null() {
            return Lookup::NeedsOperator {
                reason: format!(
                    "{} is searched by the request, which was not stored",
                    self.name
                ),
            };
        }
        if self.roll(self.faults.lookup_unknown) {
            return Lookup::Unknown {
                retry_after: Some(Duration::from_millis(5)),
            };
        }
        let searched_at = Utc::now();
        let found = {
            let sh = self.shared.lock().unwrap();
            sh.ledger
                .iter()
                .find(|e| {
                    e.provider == self.name
                        && e.provider_key == provider_key
                        && (searched_at - e.at).to_std().unwrap_or_default() >= self.search_lag
                })
                .cloned()
        };
        match found {
            Some(e) if e.response.status() < 300 => Lookup::Found(Outcome::Succeeded(e.response)),
            Some(e) => Lookup::Found(Outcome::Rejected(e.response)),
            // As the adapters do: the absence is trusted once the age the caller gives is past
            // the search lag.
            None => Lookup::NotFound {
                authoritative: (now - attempts.last_attempt_at)
                    .to_std()
                    .unwrap_or_default()
                    >= self.search_lag,
            },
        }
    }
}
