//! Single calls served through the axum layer ([`Mode::Http`](crate::world::Mode::Http)): a
//! client of such a key posts its body with `Idempotency-Key` to a router whose
//! `IdempotencyLayer` is declared with the key's provider, and whose handler calls it with
//! `IdempotencyContext::call`, as `docs/http.md` shows. The key is the same key a direct client
//! would claim (its scope fixed by the layer, its operation named), so every check of a single
//! call holds for it; what the client is told is read from the HTTP answer: the provider's
//! answer (executed or replayed) is acknowledged like `Idempotency::call`'s, and the layer's
//! problems are mapped to what a client does next.

use std::sync::Arc;

use idemflow::Idempotency;

use crate::gate::SharedRef;
use crate::provider::SimProvider;
use crate::world::KeyDef;

/// Runs one HTTP request for `key` through the layer over `exec` and `provider`. Returns what
/// the client got and whether it would try again.
#[cfg(feature = "axum")]
pub async fn client(
    exec: Idempotency,
    key: KeyDef,
    provider: Arc<SimProvider>,
    shared: SharedRef,
) -> (String, bool) {
    use axum::Router;
    use axum::body::Body;
    use axum::extract::State;
    use axum::http::{Request, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use idemflow::axum::{IdempotencyContext, IdempotencyLayer, ScopeSource};
    use tower::ServiceExt;

    use crate::checks::Check;

    async fn handler(State(p): State<Arc<SimProvider>>, ctx: IdempotencyContext) -> Response {
        match ctx.call(p.as_ref()).await {
            Ok(answer) => answer.into_response(),
            Err(no_answer_yet) => no_answer_yet,
        }
    }

    let layer = IdempotencyLayer::new(exec, ScopeSource::fixed(key.id.scope.clone()))
        .operation(key.operation)
        .provider(provider.as_ref());
    let app = Router::new()
        .route("/op", post(handler))
        .layer(layer)
        .with_state(provider);
    let body = match serde_json::to_vec(&key.body) {
        Ok(b) => b,
        Err(e) => return (format!("bad body: {e}"), false),
    };
    let req = match Request::post("/op")
        .header("content-type", "application/json")
        .header("idempotency-key", key.id.key.as_str())
        .body(Body::from(body))
    {
        Ok(r) => r,
        Err(e) => return (format!("bad request: {e}"), false),
    };
    let resp = match app.oneshot(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    let status = resp.status();
    let replayed = resp
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let bytes = match axum::body::to_bytes(resp.into_body(), 1 << 20).await {
        Ok(b) => b,
        Err(e) => return (format!("http {status}: unreadable body: {e}"), true),
    };
    let doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let mut sh = shared.lock().unwrap();
    // The provider's answer (its body names the provider key): executed or replayed.
    if let Some(pk) = doc.get("pk").and_then(|p| p.as_str()) {
        if pk != key.pk && sh.labels.get(pk) != Some(&key.label) {
            sh.violate(
                Check::ScopesIsolated,
                &key.label,
                format!("got a response for provider key {pk:?}"),
            );
        }
        // Status and body: what a replay repeats byte for byte (the headers differ by the
        // replay marker).
        let answer = idemflow::StoredResponse::new(status.as_u16()).with_body(bytes.to_vec());
        sh.acknowledged(&key.label, &answer);
        let how = if replayed { "replayed" } else { "executed" };
        return (format!("http {how} {}", status.as_u16()), false);
    }
    let kind = doc
        .get("type")
        .and_then(|t| t.as_str())
        .unwrap_or("?")
        .rsplit(':')
        .next()
        .unwrap_or("?")
        .to_owned();
    let detail = doc
        .get("detail")
        .and_then(|d| d.as_str())
        .unwrap_or_default()
        .to_owned();
    let said = format!("http {} {kind}: {detail}", status.as_u16());
    match (status, kind.as_str()) {
        // In flight, unknown, retryable, the store down, the lease lost: try again later.
        (StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE, _) => (said, true),
        (StatusCode::UNPROCESSABLE_ENTITY, _) => {
            sh.violate(Check::ScopesIsolated, &key.label, said.clone());
            (said, false)
        }
        // What a direct client excuses (`world::expected`): a connection the simulation dropped
        // (`store::injected`), or a key whose row is gone (purged, or lost to a failover).
        (StatusCode::INTERNAL_SERVER_ERROR, "store-error")
            if detail.contains("sim store error")
                || detail.starts_with("store: no idempotency key") =>
        {
            (said, false)
        }
        (StatusCode::INTERNAL_SERVER_ERROR, "store-error") => {
            sh.violate(Check::NoStoreErrors, &key.label, said.clone());
            (said, false)
        }
        _ => (said, false),
    }
}

/// Without the `axum` feature no key is served through the layer ([`Mode::Http`] draws none).
///
/// [`Mode::Http`]: crate::world::Mode::Http
#[cfg(not(feature = "axum"))]
pub async fn client(
    _exec: Idempotency,
    key: KeyDef,
    _provider: Arc<SimProvider>,
    _shared: SharedRef,
) -> (String, bool) {
    (format!("{}: no HTTP layer in this build", key.label), false)
}
