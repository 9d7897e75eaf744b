//! Settling one key from a provider's own event (a webhook) instead of a lookup:
//! [`Sweeper::settle_from_event`].
//!
//! A provider that reports what it did (Stripe's `payment_intent.succeeded`, ...) tells the
//! answer a lost response would have carried, usually seconds after the call. The key it
//! belongs to is settled at once, through the sweeper's own path: the event's answer is read as
//! a lookup that found it ([`Lookup::Found`], `decide::after_lookup`, so the same attempt rule
//! applies), the provider's secret fields are masked, and the write is the sweeper's fenced
//! finish under the token read with the key (`Sweeper::apply`): if anyone (a sweep, a retry's
//! takeover, the worker) moved the key on since, the write is refused and nothing changes.
//!
//! Only a key that waits for recovery is settled: `processing`, its provider and provider key
//! those of the event, and its lease run out or given back (the state in which a client retry
//! is told "outcome unknown"). A key whose lease is live is left to the attempt holding it.

use std::time::Duration;

use tracing::{Instrument, info_span};

use super::{KeyResult, Sweeper, decide, masked};
use crate::error::StoreError;
use crate::provider::Lookup;
use crate::{KeyId, KeyState, Outcome, record::KeyRecord};

/// What a provider's event says about one request idemflow sent through it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProviderEvent {
    /// The provider's registered name (`"stripe"`).
    pub provider: String,
    /// The provider key the request carried (Stripe: `metadata.idemflow_key`).
    pub provider_key: String,
    /// The answer the request got, as a lookup would rebuild it.
    pub outcome: Outcome,
    /// The event's id, for the key's history (`evt_...`).
    pub event: String,
}

impl ProviderEvent {
    /// An event of `provider` saying the request sent with `provider_key` got `outcome`.
    pub fn new(
        provider: impl Into<String>,
        provider_key: impl Into<String>,
        outcome: Outcome,
        event: impl Into<String>,
    ) -> Self {
        Self {
            provider: provider.into(),
            provider_key: provider_key.into(),
            outcome,
            event: event.into(),
        }
    }
}

/// Where the key of an event is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventTarget<'a> {
    /// The application knows the key (from metadata of its own, say): it is read and settled
    /// if its provider key is the event's.
    Key(&'a KeyId),
    /// Search the processing keys for the event's provider key: one read of up to `limit`
    /// processing keys, oldest first
    /// ([`OperatorStore::stuck`](crate::store::OperatorStore::stuck)). A key beyond the limit
    /// is not found, and is left to the sweeper.
    ScanProcessing {
        /// How many processing keys one event reads at most.
        limit: u32,
    },
}

/// What [`Sweeper::settle_from_event`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventSettlement {
    /// The key was settled into this state.
    Settled(KeyState),
    /// The key is already settled (by its worker, a sweep or an earlier event).
    AlreadyFinal(KeyState),
    /// The key's lease is live: the attempt holding it settles it.
    Running,
    /// No key of this provider with this provider key (not idemflow's, purged, or beyond a
    /// scan's limit).
    NotFound,
    /// The event's provider is not registered with this sweeper (its secret fields could not
    /// be masked): nothing is done.
    ProviderNotRegistered,
    /// The event's answer is not final ([`Outcome::Retryable`] or [`Outcome::Unknown`]; Stripe's
    /// settling events never are): the key is left for the sweeper, checked again later.
    Deferred {
        /// Why.
        reason: String,
    },
    /// Someone else moved the key on between its read and the write: nothing changed.
    Lost,
}

impl Sweeper {
    /// Settles the key a provider's event belongs to, at once, through the sweeper's own
    /// decision and fenced write: the event's outcome is read as a lookup that found it (the
    /// same attempt rule), the provider's secret fields are masked, and the finish carries the
    /// token read with the key, so a key moved on meanwhile is left alone. Only a key still
    /// `processing`, of the event's provider and provider key, whose lease has run out or was
    /// given back, is settled; `target` says how to find it. The history records the actor
    /// `sweeper` and the event's id (`docs/consumers.md`).
    ///
    /// Store errors are returned; a write refused because the key moved on is
    /// [`EventSettlement::Lost`].
    pub async fn settle_from_event(
        &self,
        target: EventTarget<'_>,
        event: &ProviderEvent,
    ) -> Result<EventSettlement, StoreError> {
        let span = info_span!(
            "idemflow.settle_from_event",
            provider = %event.provider,
            event = %event.event,
            provider_key = %event.provider_key,
            result = tracing::field::Empty,
        );
        let result = self
            .settle_event(target, event)
            .instrument(span.clone())
            .await;
        if let Ok(r) = &result {
            span.record("result", tracing::field::debug(r));
        }
        result
    }

    async fn settle_event(
        &self,
        target: EventTarget<'_>,
        event: &ProviderEvent,
    ) -> Result<EventSettlement, StoreError> {
        let Some(provider) = self.providers.get(&event.provider).cloned() else {
            return Ok(EventSettlement::ProviderNotRegistered);
        };
        let ours = |r: &KeyRecord| {
            r.provider.as_deref() == Some(event.provider.as_str())
                && r.provider_key == event.provider_key
        };
        let record = match target {
            EventTarget::Key(id) => self.store.get(id).await?.filter(ours),
            EventTarget::ScanProcessing { limit } => {
                let processing = self.store.stuck(Duration::ZERO, limit).await?;
                let found = processing.oldest.into_iter().find(ours);
                if found.is_none() && processing.count > i64::from(limit) {
                    tracing::info!(
                        processing = processing.count,
                        limit,
                        "provider key not among the processing keys read; left to the sweeper"
                    );
                }
                found
            }
        };
        let Some(record) = record else {
            return Ok(EventSettlement::NotFound);
        };
        if record.state != KeyState::Processing {
            return Ok(EventSettlement::AlreadyFinal(record.state));
        }
        let now = self.store.now().await?;
        if record.lease_expires_at.is_some_and(|exp| exp > now) {
            return Ok(EventSettlement::Running);
        }
        let why = format!(
            "from its event {} instead of a search",
            event.event.escape_debug()
        );
        let found = Lookup::Found(event.outcome.clone());
        let decision = masked(
            decide::after_lookup(&event.provider, &why, found),
            Some(&*provider),
        );
        let id = KeyId::new(record.scope.clone(), record.key.clone());
        Ok(match self.apply(&id, &record, decision).await? {
            KeyResult::Finished(to) => EventSettlement::Settled(to),
            KeyResult::Unresolved(u) => EventSettlement::Deferred { reason: u.reason },
            KeyResult::Lost(_) => EventSettlement::Lost,
        })
    }
}
