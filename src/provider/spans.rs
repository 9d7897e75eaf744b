//! The spans of the provider adapters' calls: one name and one set of fields each.

use tracing::{Span, info_span};

pub(crate) fn call(provider: &str, provider_key: &str) -> Span {
    info_span!("idemflow.provider.call", provider, provider_key)
}

pub(crate) fn lookup(provider: &str, provider_key: &str) -> Span {
    info_span!("idemflow.provider.lookup", provider, provider_key)
}

pub(crate) fn void_by_key(provider: &str, provider_key: &str) -> Span {
    info_span!("idemflow.provider.void_by_key", provider, provider_key)
}
