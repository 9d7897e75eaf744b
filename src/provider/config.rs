//! Building providers from configuration (the CLI's TOML file).

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::Provider;

/// One `[[providers]]` entry of the configuration file.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// The name stored in key rows (defaults to the kind).
    pub name: Option<String>,
    /// `stripe`, `resend` or `postmark`.
    pub kind: String,
    /// The API base URL (defaults to the provider's real one).
    pub base_url: Option<String>,
    /// The environment variable holding the API key.
    pub api_key_env: String,
    /// For search-based lookups: how long an empty search result is not trusted.
    #[serde(default, with = "opt_secs")]
    pub search_lag: Option<Duration>,
}

mod opt_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_secs))
    }
}

/// Why a provider could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderConfigError {
    /// The kind is not one this build knows.
    #[error("unknown provider kind {kind:?} (this build knows: {known})")]
    UnknownKind {
        /// The kind given.
        kind: String,
        /// The kinds available.
        known: String,
    },
    /// The API key variable is unset or empty.
    #[error("environment variable {var} (the API key for provider {provider:?}) is not set")]
    MissingApiKey {
        /// The variable.
        var: String,
        /// The provider name.
        provider: String,
    },
    /// A value is invalid.
    #[error("provider {provider:?}: {detail}")]
    Invalid {
        /// The provider name.
        provider: String,
        /// What is wrong.
        detail: String,
    },
}

/// The provider kinds this build can construct.
pub fn known_kinds() -> &'static [&'static str] {
    &[]
}

/// Builds the provider an entry describes.
pub fn build(config: &ProviderConfig) -> Result<Arc<dyn Provider>, ProviderConfigError> {
    Err(ProviderConfigError::UnknownKind {
        kind: config.kind.clone(),
        known: known_kinds().join(", "),
    })
}
