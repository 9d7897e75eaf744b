//! What the layer gives the handler ([`IdempotencyContext`]) and what the handler may give back
//! ([`NothingHappened`]).

use std::sync::Arc;

use axum::Extension;
use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::Problem;
use crate::record::LeaseToken;
use crate::{Error, KeyId, Outcome, StoredResponse, key::IdempotencyKey, key::Scope};

/// The claimed key, as the handler sees it: the provider key to forward, the stored request and
/// the attempt. Inserted into the request extensions by the layer when it runs the handler; take
/// it as an extractor (`ctx: IdempotencyContext`, or `Option<IdempotencyContext>` where the key
/// is optional) or as `Extension<IdempotencyContext>`.
///
/// Forward [`provider_key`](Self::provider_key) to the provider as its idempotency key, and send
/// it [`request`](Self::request) unchanged: that is what the sweeper re-sends if this process
/// dies mid-call, and a provider only recognises the re-send when both are identical.
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    pub(crate) operation: String,
    pub(crate) request: Arc<Value>,
    /// The executor's view of this attempt (its key, provider key, token and lease, renewed
    /// while the handler runs).
    pub(crate) attempt_ctx: crate::Context,
    /// The provider the layer records for its keys ([`IdempotencyLayer::provider`]), which
    /// [`call`](Self::call) must be given.
    ///
    /// [`IdempotencyLayer::provider`]: super::IdempotencyLayer::provider
    pub(crate) provider: Option<String>,
    /// The executor's [`unknown_retry_after`](crate::executor::ExecutorConfig::unknown_retry_after).
    pub(crate) unknown_retry_after: std::time::Duration,
}

impl IdempotencyContext {
    /// The key to forward to the provider: the same on every attempt, in every process, and for
    /// the sweeper.
    pub fn provider_key(&self) -> &str {
        self.attempt_ctx.provider_key()
    }

    /// Scope and key.
    pub fn id(&self) -> &KeyId {
        self.attempt_ctx.id()
    }

    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.id().scope
    }

    /// The client's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.id().key
    }

    /// The operation name recorded with the key.
    pub fn operation(&self) -> &str {
        &self.operation
    }

    /// 1 on the first attempt, more after a retryable failure.
    pub fn attempt(&self) -> i32 {
        self.attempt_ctx.attempt()
    }

    /// The fencing token of this attempt.
    pub fn lease_token(&self) -> LeaseToken {
        self.attempt_ctx.lease_token()
    }

    /// Whether this attempt may still send the request that acts: its lease is surely held and,
    /// after a takeover, the provider's window is still open (see [`crate::Context::may_send`]).
    /// The layer checks it before running the handler; a handler that waits before calling the
    /// provider (a queue, a slow lock) should check it again right before the call, and answer
    /// with [`NothingHappened`](super::NothingHappened) when it is `false`.
    pub fn may_send(&self) -> bool {
        self.attempt_ctx.may_send()
    }

    /// Whether this attempt has lost its lease (see [`crate::Context::lease_lost`]).
    pub fn lease_lost(&self) -> bool {
        self.attempt_ctx.lease_lost()
    }

    /// The executor's context of this attempt: what a workflow's operation takes, so the same
    /// function can serve the handler and the sweeper's resumer
    /// ([`Sweeper::resumer`](crate::Sweeper::resumer)).
    pub fn context(&self) -> &crate::Context {
        &self.attempt_ctx
    }

    /// Runs the next step of this request's workflow at most once (see
    /// [`crate::Context::step`]; the layer must be declared with
    /// [`IdempotencyLayer::workflow`](super::IdempotencyLayer::workflow)).
    pub async fn step<F, Fut>(
        &self,
        step: crate::workflow::Step,
        op: F,
    ) -> Result<crate::Execution, crate::Error>
    where
        F: FnOnce(crate::Context) -> Fut,
        Fut: std::future::Future<Output = crate::Outcome>,
    {
        self.attempt_ctx.step(step, op).await
    }

    /// Runs the next step of this request's workflow through `provider` at most once (see
    /// [`crate::Context::call_step`]).
    pub async fn call_step(
        &self,
        step: crate::workflow::Step,
        provider: &dyn crate::Provider,
    ) -> Result<crate::Execution, crate::Error> {
        self.attempt_ctx.call_step(step, provider).await
    }

    /// Sends [`request`](Self::request) to `provider` with [`provider_key`](Self::provider_key),
    /// and returns the provider's answer for the handler to return, or the answer that says
    /// there is none yet. The same steps as [`Idempotency::call`](crate::Idempotency::call):
    /// nothing is sent once the attempt [may no longer send](Self::may_send), a refusal after
    /// an earlier attempt that may have acted does not end the key, and the provider's
    /// [secret fields](crate::Provider::secret_fields) are masked for this caller too.
    ///
    /// - `Ok(answer)`: the provider acted (a 2xx) or refused for good (a 4xx). Return it, or
    ///   your rendering of it: the layer stores and replays what the handler returns.
    /// - `Err(response)`, nothing to store: 503 `retryable` with [`NothingHappened`] when the
    ///   provider surely did nothing (the provider's `Retry-After`, if it gave one; the client's
    ///   retry runs the handler again); 503 `outcome-unknown` when it may have acted (the key
    ///   stays for the sweeper, which asks the provider); 500 `provider-not-declared`, nothing
    ///   sent, when `provider` is not the one the layer was declared with
    ///   ([`IdempotencyLayer::provider`](super::IdempotencyLayer::provider)), since the sweeper
    ///   would ask that one.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use axum::{extract::State, response::{IntoResponse, Response}};
    /// use idemflow::axum::IdempotencyContext;
    /// use idemflow::provider::Stripe;
    ///
    /// async fn create_payment(State(stripe): State<Arc<Stripe>>, ctx: IdempotencyContext) -> Response {
    ///     match ctx.call(stripe.as_ref()).await {
    ///         Ok(answer) => answer.into_response(),
    ///         Err(no_answer_yet) => no_answer_yet,
    ///     }
    /// }
    /// ```
    pub async fn call(&self, provider: &dyn crate::Provider) -> Result<StoredResponse, Response> {
        if self.provider.as_deref() != Some(provider.name()) {
            let declared = self.provider.as_deref().unwrap_or("none");
            let problem = Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "provider-not-declared",
                "The handler called a provider the layer was not declared with",
            )
            .detail(format!(
                "the handler called provider {:?}, the layer records {declared:?} for its keys \
                 (IdempotencyLayer::provider); nothing was sent",
                provider.name()
            ));
            return Err((Extension(NothingHappened), problem).into_response());
        }
        let (outcome, retry_after) =
            crate::executor::send_to_provider(&self.attempt_ctx, provider).await;
        let key = self.id().clone();
        match outcome {
            Outcome::Succeeded(answer) | Outcome::Rejected(answer) => Ok(answer),
            Outcome::Retryable { reason } => {
                let mut problem = Problem::from(&Error::FailedRetryable { key, reason });
                if let Some(after) = retry_after {
                    problem = problem.retry_after(after);
                }
                Err((Extension(NothingHappened), problem).into_response())
            }
            Outcome::Unknown { reason } => {
                let e = Error::OutcomeUnknown {
                    key,
                    reason,
                    retry_after: self.unknown_retry_after,
                };
                Err(Problem::from(&e).into_response())
            }
        }
    }

    /// The stored request (see
    /// [`IdempotencyLayer::stored_request`](super::IdempotencyLayer::stored_request)): what to
    /// send the provider.
    pub fn request(&self) -> &Value {
        &self.request
    }
}

fn missing() -> Response {
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "no-idempotency-context",
        "No idempotency context",
    )
    .detail("this route is not covered by an IdempotencyLayer for this method, or the request carried no key")
    .into_response()
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or_else(missing)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyContext {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Self>().cloned())
    }
}

/// A response extension marking the answer as "nothing was done, run it again": the key becomes
/// `failed{retryable}` instead of being stored (any status) or left for the sweeper (5xx), and
/// the client's retry with the same key runs the handler again.
///
/// Use it only when the effect surely did not happen (the provider refused before acting, a
/// rate limit, a validation step that failed before calling anyone).
///
/// ```
/// use axum::{Extension, http::StatusCode, response::IntoResponse};
/// use idemflow::axum::NothingHappened;
///
/// let resp = (StatusCode::SERVICE_UNAVAILABLE, Extension(NothingHappened), "try again").into_response();
/// assert!(resp.extensions().get::<NothingHappened>().is_some());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NothingHappened;
