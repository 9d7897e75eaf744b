#![cfg_attr(
    feature = "conformance",
    doc = include_str!("../../docs/writing-a-store.md")
)]
#![cfg_attr(
    not(feature = "conformance"),
    doc = "Helpers for writing a store: what every backend in this crate uses to keep the \
           contract of [`Store`] the same way; nothing here is needed to *use* a \
           store. Its guide, `docs/writing-a-store.md`, is rendered here when the feature \
           `conformance` is on, as on docs.rs."
)]

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{FinishMode, NewClaim, Store};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::{KeyRecord, LeaseToken};
use crate::state::{KeyState, Transition};

pub use super::rows::{RawEvent, RawRecord};

/// The result of a fenced write that should have changed exactly one row: `Ok` when it did,
/// else the [`refused_write`] error for the row as it is now.
pub async fn fenced_write<S: Store + ?Sized>(
    store: &S,
    id: &KeyId,
    token: LeaseToken,
    rows_affected: u64,
) -> Result<(), StoreError> {
    if rows_affected == 1 {
        Ok(())
    } else {
        Err(refused_write(store, id, Some(token)).await)
    }
}

/// The error for a fenced write that changed nothing, from the row as it is now: the key is
/// gone ([`StoreError::NotFound`]) or someone else holds it ([`StoreError::LeaseLost`]). An
/// unconditional override (`presented: None`) is refused only when the key is gone, so the row
/// is not read.
pub async fn refused_write<S: Store + ?Sized>(
    store: &S,
    id: &KeyId,
    presented: Option<LeaseToken>,
) -> StoreError {
    let not_found = || StoreError::NotFound { key: id.clone() };
    let Some(presented) = presented else {
        return not_found();
    };
    match store.get(id).await {
        Ok(Some(r)) => StoreError::LeaseLost {
            key: id.clone(),
            presented,
            current: r.lease_token,
            state: r.state,
        },
        Ok(None) => not_found(),
        Err(e) => e,
    }
}

/// The longest duration any store keeps, in ms: about 100 years, so that `now + d` stays a valid
/// timestamp on every backend and exact in Lua's doubles (and never turns SQLite's integer
/// arithmetic into floating point).
pub const MAX_DURATION_MS: i64 = 100 * 366 * 24 * 3600 * 1000;

/// Milliseconds of a duration, capped at [`MAX_DURATION_MS`]: the one place every store caps
/// durations (leases, retention, windows, recheck delays).
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis())
        .unwrap_or(i64::MAX)
        .min(MAX_DURATION_MS)
}

/// A duration capped as [`millis`] caps it: what a store actually grants for `d`. Local clocks
/// must use it too (`Instant + Duration::MAX` would panic, and a lease the store capped must not
/// be believed longer locally).
pub fn capped(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(millis(d)).unwrap_or(0))
}

/// How long a lease of `lease` is surely held, counted on the caller's clock from when it was
/// asked for: [`capped`], less a millisecond, the grain of the coarsest store clock (SQLite and
/// Redis read milliseconds, so a lease granted at `t` may end up to 1 ms before `t + lease`).
pub fn surely_held_for(lease: Duration) -> Duration {
    capped(lease).saturating_sub(Duration::from_millis(1))
}

/// Checks a finish into `to` against the state machine: a holder's write completes, rejects or
/// fails retryably; an override may go to any final state. Finishing into processing is never
/// legal.
pub fn check_finish(mode: FinishMode, to: KeyState) -> Result<Transition, StoreError> {
    let t = match (mode, to) {
        (FinishMode::Holder(_), KeyState::Done) => Transition::Complete,
        (FinishMode::Holder(_), KeyState::Failed { retryable: false }) => Transition::Reject,
        (FinishMode::Holder(_), KeyState::Failed { retryable: true }) => Transition::FailRetryable,
        // Finishing into processing is never legal; the state machine refuses it below.
        (FinishMode::Override | FinishMode::OverrideIf(_), to)
        | (FinishMode::Holder(_), to @ KeyState::Processing) => Transition::Override(to),
    };
    let from = match t {
        Transition::Override(_) => Some(KeyState::Done),
        _ => Some(KeyState::Processing),
    };
    crate::state::transition(from, t)?;
    Ok(t)
}

/// The provider key a reclaim through another provider stores (see [`claimable`]), given the
/// key the row stored and `life`, the position the reclaim's history event takes (1-based,
/// across purges): an explicit key (`renewed_key_base` unset) as the claim gives it; otherwise
/// the row's own key, which nothing may have acted on anywhere and no earlier life of the key
/// sent, so a change that a failover loses sends the same key again (`docs/reliability.md`);
/// unless it is longer than the claim's `provider_key` (the new provider's limit is tighter):
/// then the renewed key of `life`. Every backend's claim applies this rule (SQL `RECLAIM`, the
/// MariaDB procedure, `claim.lua`).
pub fn provider_key_on_change(claim: &NewClaim, stored: &str, life: u64) -> String {
    match &claim.renewed_key_base {
        None => claim.provider_key.clone(),
        Some(_) if stored.chars().count() <= claim.provider_key.chars().count() => {
            stored.to_owned()
        }
        Some(base) => crate::provider_key::renewed(base, life),
    }
}

/// The provider key a claim that inserts the key's row stores, given `life`, the position of
/// its history event (1-based, across purges): the renewed key of `life` when the key had an
/// earlier life (`life > 1`) and the claim's key is derived, else the claim's `provider_key`.
pub fn provider_key_on_insert(claim: &NewClaim, life: u64) -> String {
    match &claim.renewed_key_base {
        Some(base) if life > 1 => crate::provider_key::renewed(base, life),
        _ => claim.provider_key.clone(),
    }
}

/// Whether a claim could change the existing row `r` (so a write is worth trying): a
/// `failed{retryable}` row with the same fingerprint, or an expired processing row inside the
/// claim's takeover window, provided the claim names the provider the row recorded. A
/// `failed{retryable}` row on which no attempt may have acted may also be reclaimed through
/// another provider; the reclaim then records the claim's provider and the key
/// [`provider_key_on_change`] picks, so the sweeper asks the provider that may act. A takeover
/// never changes the provider: the earlier attempt may have acted at the recorded one
/// (`docs/design.md`, "One provider per attempt that may have acted").
pub fn claimable(claim: &NewClaim, r: &KeyRecord, now: DateTime<Utc>) -> bool {
    if r.fingerprint != claim.fingerprint {
        return false;
    }
    let same_provider = r.provider == claim.provider;
    match r.state {
        KeyState::Failed { retryable: true } => same_provider || !r.may_have_acted,
        KeyState::Processing => match (claim.takeover_window, r.lease_expires_at) {
            (Some(window), Some(exp)) => {
                same_provider
                    && exp <= now
                    && r.created_at + chrono::Duration::milliseconds(millis(window)) > now
            }
            _ => false,
        },
        _ => false,
    }
}
