//! [`Idempotency::call`]: the executor wired to a [`Provider`].

use crate::error::Error;
use crate::provider::Provider;

use super::{Execution, Idempotency, IdempotentRequest};

impl Idempotency {
    /// Runs `request` through `provider` at most once: records the provider's name in the key row
    /// (so the sweeper knows whom to ask), derives the provider key within the provider's limits
    /// unless the request sets one, sends the canonical request with it, and stores the
    /// classified answer. The stored response is the provider's answer.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use idemflow::provider::{Attempts, CallReply, KeySpec, Lookup};
    /// use idemflow::store::sqlite::SqliteStore;
    /// use idemflow::{Idempotency, IdempotentRequest, Provider, Store, StoredResponse, async_trait};
    ///
    /// /// A provider without idempotency keys that answers every request with 201.
    /// #[derive(Debug)]
    /// struct Ledger;
    ///
    /// #[async_trait]
    /// impl Provider for Ledger {
    ///     fn name(&self) -> &str {
    ///         "ledger"
    ///     }
    ///     fn key_spec(&self) -> KeySpec {
    ///         KeySpec::no_keys()
    ///     }
    ///     async fn send(&self, provider_key: &str, _request: &serde_json::Value) -> CallReply {
    ///         let body = serde_json::json!({"entry": provider_key});
    ///         let response = StoredResponse::json(201, &body).expect("JSON");
    ///         CallReply::Succeeded { response, replayed: false }
    ///     }
    ///     // What the sweeper asks about a key whose outcome is unknown.
    ///     async fn lookup(
    ///         &self,
    ///         _provider_key: &str,
    ///         _request: &serde_json::Value,
    ///         _attempts: Attempts,
    ///         _now: chrono::DateTime<chrono::Utc>,
    ///     ) -> Lookup {
    ///         Lookup::Unknown { retry_after: None }
    ///     }
    /// }
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let idem = Idempotency::new(Arc::new(store));
    /// let body = serde_json::json!({"amount": 500});
    /// let request = IdempotentRequest::new("acct_1", "k1", "entries.create", &body)?;
    /// let done = idem.call(request, &Ledger).await?;
    /// assert_eq!(done.response().status(), 201);
    /// # Ok(()) }
    /// ```
    pub async fn call(
        &self,
        request: IdempotentRequest,
        provider: &dyn Provider,
    ) -> Result<Execution, Error> {
        // The provider key within the provider's limit (`KeySpec::derive` for the key's first
        // row; see `provider_key::renewed`), takeovers within its dedup window.
        let request = request.sent_through(provider.name(), &provider.key_spec());
        self.execute(request, |ctx| async move { send(&ctx, provider).await.0 })
            .await
    }
}

impl super::Context {
    /// Sends `body` to `provider` under this attempt's provider key and classifies the answer
    /// as [`Idempotency::call`] does, for an operation that acts through one provider call but
    /// does not send the key's stored request as it is: a queue consumer's handler
    /// ([`Consumer`](crate::consumer::Consumer), which sends what it makes of the message), or
    /// an [`execute`](Idempotency::execute) whose request is not the provider's.
    ///
    /// * Nothing is sent when the attempt may no longer send ([`may_send`](Self::may_send): its
    ///   lease is lost or ran out, or a takeover's window closed): the outcome is then
    ///   retryable.
    /// * After an earlier attempt of the key that may have acted (a takeover), a refusal is the
    ///   key's answer only when the provider says it is about this request
    ///   ([`Provider::definitive_refusal`]); any other may answer this re-send alone while the
    ///   first still runs, so the outcome is unknown and the sweeper settles the key from the
    ///   provider's records.
    /// * The provider's secret fields ([`Provider::secret_fields`]) are masked in what is stored.
    ///
    /// Calling `provider.send(ctx.provider_key(), ..)` directly skips all three.
    ///
    /// The sweeper re-drives a crashed key by re-sending its *stored* request: an executor whose
    /// operation sends something else must not store it ([`Idempotency::store_request`] off, as
    /// the consumer's executor is), so that the sweeper looks the key up instead.
    pub async fn send(&self, provider: &dyn Provider, body: &serde_json::Value) -> crate::Outcome {
        send_body(self, provider, body).await.0
    }
}

/// Sends the attempt's stored request to `provider` with its provider key, and classifies the
/// answer as an [`Outcome`](crate::Outcome), the provider's secret fields masked, with the
/// provider's `Retry-After` when it refused without acting: what
/// [`Idempotency::call`] stores, and what the axum layer's
/// [`IdempotencyContext::call`](crate::axum::IdempotencyContext::call) answers with. Nothing is
/// sent when the attempt may no longer send ([`Context::may_send`](super::Context::may_send)).
pub(crate) async fn send(
    ctx: &super::Context,
    provider: &dyn Provider,
) -> (crate::Outcome, Option<std::time::Duration>) {
    let body: serde_json::Value = match serde_json::from_str(ctx.request()) {
        Ok(v) => v,
        // The canonical request was produced from JSON by IdempotentRequest; this cannot fail
        // unless memory is corrupt, and then nothing was sent.
        Err(e) => {
            return (
                crate::Outcome::retryable(format!("request is not JSON: {e}")),
                None,
            );
        }
    };
    send_body(ctx, provider, &body).await
}

/// [`send`] with the body given: [`Context::send`](super::Context::send), with the provider's
/// `Retry-After`.
async fn send_body(
    ctx: &super::Context,
    provider: &dyn Provider,
    body: &serde_json::Value,
) -> (crate::Outcome, Option<std::time::Duration>) {
    // The last check before the request leaves: a paused process, a lost lease or a closed
    // takeover window sends nothing (see Context::may_send).
    if let Some(why) = ctx.send_refusal() {
        return (crate::Outcome::retryable(format!("not sent: {why}")), None);
    }
    let reply = provider.send(ctx.provider_key(), body).await;
    let retry_after = match &reply {
        crate::provider::CallReply::Retryable { retry_after, .. } => *retry_after,
        _ => None,
    };
    let outcome = match reply.into_outcome() {
        // After an earlier attempt of the key that may have acted (a takeover), only a refusal
        // the provider reports about the key's own request (`Provider::definitive_refusal`) ends
        // the key; any other refusal may answer this re-send alone while the first still runs,
        // so the sweeper settles the key.
        crate::Outcome::Rejected(resp)
            if ctx.may_have_acted && !provider.definitive_refusal(&resp) =>
        {
            crate::Outcome::unknown(format!(
                "an earlier attempt may have acted; this one was refused with status {}, which \
                 does not say what the earlier one did",
                resp.status()
            ))
        }
        other => other,
    };
    (
        crate::provider::secrets::mask_outcome(outcome, provider.secret_fields()),
        retry_after,
    )
}
