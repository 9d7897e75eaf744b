//! An in-test fake [`Provider`]: a ledger of effects keyed by provider key, dedup by key within a
//! window (when configured), lost responses and a lagging search on demand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{
    Outcome, Provider, StoredResponse, async_trait, provider::Attempts, provider::CallReply,
    provider::KeySpec, provider::Lookup,
};
use chrono::{DateTime, Utc};

/// One thing the provider did (a charge, or a declined attempt).
#[derive(Debug, Clone)]
pub struct Effect {
    /// The provider key the call carried.
    pub provider_key: String,
    /// The charge id the provider answered with.
    pub charge: String,
    /// When the provider acted.
    pub at: Instant,
    /// The answer the provider gave (or would have given, when it was lost).
    pub response: StoredResponse,
    /// Whether the attempt was declined instead of charged.
    pub declined: bool,
}

/// What the fake provider did and was asked, and the faults it is told to inject.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Every effect, in order.
    pub effects: Vec<Effect>,
    /// Calls per provider key.
    pub calls: HashMap<String, u64>,
    /// Lookups per provider key.
    pub lookups: HashMap<String, u64>,
    lose_responses: u32,
    lookup_lag: Duration,
    lookup_unknown: Option<Duration>,
    hang: bool,
}

/// A fake provider for the sweeper suite; see the module docs.
#[derive(Debug)]
pub struct FakeProvider {
    name: String,
    spec: KeySpec,
    ledger: Mutex<Ledger>,
}

impl FakeProvider {
    /// A card processor that dedupes by key for `window` and replays the first answer.
    pub fn keyed(name: &str, window: Duration) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            spec: KeySpec {
                max_len: 255,
                retention: Some(window),
                replays_same_key: true,
            },
            ledger: Mutex::default(),
        })
    }

    /// A provider without keys: every call acts, only metadata search can tell.
    pub fn no_keys(name: &str) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            spec: KeySpec::no_keys(),
            ledger: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap()
    }

    /// The next `n` answers are lost after the provider acted (the caller sees `Unknown`).
    pub fn lose_next(&self, n: u32) {
        self.lock().lose_responses = n;
    }

    /// Search results appear only `lag` after the effect; an empty result is authoritative only
    /// `lag` after the `last_attempt_at` the caller passes (as a real search adapter judges).
    pub fn lookup_lag(&self, lag: Duration) {
        self.lock().lookup_lag = lag;
    }

    /// Lookups answer `Unknown { retry_after }`.
    pub fn lookup_unknown(&self, retry_after: Option<Duration>) {
        self.lock().lookup_unknown = retry_after;
    }

    /// Calls and lookups never answer (a provider that hangs).
    pub fn hang(&self, hang: bool) {
        self.lock().hang = hang;
    }

    fn hangs(&self) -> bool {
        self.lock().hang
    }

    /// Every effect so far.
    pub fn effects(&self) -> Vec<Effect> {
        self.lock().effects.clone()
    }

    /// The effects of one provider key.
    pub fn effects_for(&self, pk: &str) -> Vec<Effect> {
        self.lock()
            .effects
            .iter()
            .filter(|e| e.provider_key == pk)
            .cloned()
            .collect()
    }

    /// How many calls reached the provider.
    pub fn calls(&self) -> u64 {
        self.lock().calls.values().sum()
    }

    /// How many lookups reached the provider.
    pub fn lookups(&self) -> u64 {
        self.lock().lookups.values().sum()
    }

    /// Calls per provider key.
    pub fn calls_by_key(&self) -> HashMap<String, u64> {
        self.lock().calls.clone()
    }

    /// Lookups per provider key.
    pub fn lookups_by_key(&self) -> HashMap<String, u64> {
        self.lock().lookups.clone()
    }

    fn answer(e: &Effect, replayed: bool) -> CallReply {
        if e.declined {
            CallReply::Rejected {
                response: e.response.clone(),
            }
        } else {
            CallReply::Succeeded {
                response: e.response.clone(),
                replayed,
            }
        }
    }
}

#[async_trait]
impl Provider for FakeProvider {
    fn name(&self) -> &str {
        &self.name
    }

    fn key_spec(&self) -> KeySpec {
        self.spec.clone()
    }

    async fn send(&self, provider_key: &str, request: &serde_json::Value) -> CallReply {
        if self.hangs() {
            std::future::pending::<()>().await;
        }
        let mut l = self.lock();
        *l.calls.entry(provider_key.to_owned()).or_default() += 1;
        let answer = match (self.spec.replays_same_key, self.spec.retention) {
            (true, Some(window)) => l
                .effects
                .iter()
                .find(|e| e.provider_key == provider_key && e.at.elapsed() < window)
                .map(|e| Self::answer(e, true)),
            _ => None,
        };
        let answer = match answer {
            Some(a) => a,
            None => {
                let n = l.effects.len() + 1;
                let amount = request.get("amount").and_then(|a| a.as_u64()).unwrap_or(0);
                let declined = amount == 0;
                let charge = format!("ch_{n}");
                let response = if declined {
                    StoredResponse::json(
                        402,
                        &serde_json::json!({"error": "card_declined", "charge": charge}),
                    )
                } else {
                    StoredResponse::json(
                        201,
                        &serde_json::json!({"charge": charge, "amount": amount}),
                    )
                }
                .unwrap();
                let e = Effect {
                    provider_key: provider_key.to_owned(),
                    charge,
                    at: Instant::now(),
                    response,
                    declined,
                };
                let a = Self::answer(&e, false);
                l.effects.push(e);
                a
            }
        };
        if l.lose_responses > 0 {
            l.lose_responses -= 1;
            return CallReply::Unknown {
                reason: "timed out after sending (response lost)".into(),
            };
        }
        answer
    }

    async fn lookup(
        &self,
        provider_key: &str,
        _request: &serde_json::Value,
        attempts: Attempts,
        now: DateTime<Utc>,
    ) -> Lookup {
        if self.hangs() {
            std::future::pending::<()>().await;
        }
        let mut l = self.lock();
        *l.lookups.entry(provider_key.to_owned()).or_default() += 1;
        if let Some(retry_after) = l.lookup_unknown {
            return Lookup::Unknown {
                retry_after: Some(retry_after),
            };
        }
        let lag = l.lookup_lag;
        match l.effects.iter().find(|e| e.provider_key == provider_key) {
            Some(e) if e.at.elapsed() >= lag => Lookup::Found(if e.declined {
                Outcome::Rejected(e.response.clone())
            } else {
                Outcome::Succeeded(e.response.clone())
            }),
            // As a real search: an effect the index has not caught up with is invisible, and the
            // empty result's authority is judged from the key's latest attempt alone.
            _ => {
                let age = (now - attempts.last_attempt_at)
                    .to_std()
                    .unwrap_or_default();
                Lookup::NotFound {
                    authoritative: age >= lag,
                }
            }
        }
    }
}
