//! The spans of the store calls, for every backend: one name and one set of fields each. A
//! backend runs each method's body through [`traced`] in the method's span.

use std::future::Future;

use tracing::{Instrument, Span, info_span};

use super::{Finish, NewClaim, Release, TakeStale};
use crate::KeyId;
use crate::error::StoreError;

/// Runs `call` in `span`, and records its error there at `ERROR`.
pub(crate) async fn traced<T>(
    span: Span,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    async move {
        let out = call.await;
        if let Err(error) = &out {
            tracing::error!(%error);
        }
        out
    }
    .instrument(span)
    .await
}

pub(crate) fn claim(backend: &'static str, claim: &NewClaim) -> Span {
    info_span!("idemflow.claim", backend, scope = %claim.id.scope, key = %claim.id.key, operation = %claim.operation)
}

pub(crate) fn finish(backend: &'static str, id: &KeyId, finish: &Finish) -> Span {
    info_span!("idemflow.finish", backend, scope = %id.scope, key = %id.key, to = %finish.to, actor = finish.actor.as_str())
}

pub(crate) fn release(backend: &'static str, id: &KeyId, release: &Release) -> Span {
    info_span!("idemflow.release", backend, scope = %id.scope, key = %id.key, actor = release.actor.as_str())
}

pub(crate) fn mark_attempt(backend: &'static str, id: &KeyId) -> Span {
    info_span!("idemflow.mark_attempt", backend, scope = %id.scope, key = %id.key)
}

pub(crate) fn extend(backend: &'static str, id: &KeyId) -> Span {
    info_span!("idemflow.extend", backend, scope = %id.scope, key = %id.key)
}

pub(crate) fn take_stale(backend: &'static str, take: &TakeStale) -> Span {
    info_span!("idemflow.take_stale", backend, owner = %take.owner, limit = take.limit, scope = take.scope.as_deref())
}

pub(crate) fn purge(backend: &'static str, batch: u32) -> Span {
    info_span!("idemflow.purge", backend, batch)
}
