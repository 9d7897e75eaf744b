//! The spans of the provider adapters' calls: one name and one set of fields each.

use std::future::Future;

use tracing::{Instrument, info_span};

/// The adapter method a span is of.
#[derive(Clone, Copy)]
pub(crate) enum Method {
    Call,
    Lookup,
    VoidByKey,
}

/// Runs `work` (the adapter's `method` for `provider_key`) inside the method's span.
pub(crate) async fn traced<T>(
    method: Method,
    provider: &str,
    provider_key: &str,
    work: impl Future<Output = T>,
) -> T {
    let span = match method {
        Method::Call => info_span!("idemflow.provider.call", provider, provider_key),
        Method::Lookup => info_span!("idemflow.provider.lookup", provider, provider_key),
        Method::VoidByKey => {
            info_span!("idemflow.provider.void_by_key", provider, provider_key)
        }
    };
    work.instrument(span).await
}
