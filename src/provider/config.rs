//! Building providers from configuration (the CLI's TOML file).

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::Provider;

/// One `[[providers]]` entry of the configuration file. It holds no key (only the name of the
/// variable that does); its `Debug` shows the base URL as
/// [`redact_url`](crate::store::connect_error::redact_url) does.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// The name stored in key rows (defaults to the kind).
    pub name: Option<String>,
    /// `stripe` (PaymentIntents), `stripe_capture`, `stripe_refund`, `adyen`, `square`,
    /// `paypal`, `resend` or `postmark`.
    pub kind: String,
    /// The API base URL (defaults to the provider's real one).
    pub base_url: Option<String>,
    /// The environment variable holding the API key.
    pub api_key_env: String,
    /// For search-based lookups: how long an empty search result is not trusted.
    #[serde(default, with = "opt_secs")]
    pub search_lag: Option<Duration>,
    /// For resend, adyen and paypal (whose lookup is a same-key re-send): the margin kept before
    /// the end of their key window. Keep it at least the sweeper's `redrive_margin`; the CLI
    /// sets it to `[sweeper] redrive_margin` when it is not given.
    #[serde(default, with = "opt_secs")]
    pub redrive_margin: Option<Duration>,
    /// For paypal: how long PayPal keeps a `PayPal-Request-Id` for this account, in seconds
    /// (default 6 h; 72 h only when PayPal raised it for the account).
    #[serde(default, with = "opt_secs")]
    pub retention: Option<Duration>,
    /// For square: how long after a CreatePayment was sent Square may still make the payment,
    /// in seconds (default 300): a void by key confirmed sooner after the key's latest attempt
    /// leaves the key for a later check (`provider::Square::processing_window`, feature `http`).
    #[serde(default, with = "opt_secs")]
    pub processing_window: Option<Duration>,
    /// For stripe: the `Stripe-Version` sent on every request (default
    /// `provider::stripe::API_VERSION`, feature `http`); give the reconciler the version
    /// your service pins.
    pub api_version: Option<String>,
}

crate::debug_fields::debug_fields!(ProviderConfig {
    name,
    kind,
    base_url => base_url.as_deref().map(crate::store::connect_error::RedactedUrl),
    api_key_env,
    search_lag,
    redrive_margin,
    retention,
    processing_window,
    api_version,
});

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
    /// The HTTP client could not be built (an invalid base URL or API key, TLS set-up).
    #[cfg(feature = "http")]
    #[error("provider {provider:?}: {source}")]
    Http {
        /// The provider name.
        provider: String,
        /// What failed.
        #[source]
        source: super::http::HttpError,
    },
}

/// The provider kinds this build can construct (the `http` feature brings `adyen`, `paypal`,
/// `postmark`, `resend`, `square`, `stripe`, `stripe_capture` and `stripe_refund`).
pub fn known_kinds() -> &'static [&'static str] {
    #[cfg(feature = "http")]
    {
        &[
            "adyen",
            "paypal",
            "postmark",
            "resend",
            "square",
            "stripe",
            "stripe_capture",
            "stripe_refund",
        ]
    }
    #[cfg(not(feature = "http"))]
    {
        &[]
    }
}

/// Builds the provider an entry describes, reading the API key from the environment variable
/// `api_key_env`.
pub fn build(config: &ProviderConfig) -> Result<Arc<dyn Provider>, ProviderConfigError> {
    build_with_env(config, |var| std::env::var(var).ok())
}

/// Like [`build`], with the environment given as a function (for tests and embedding).
pub fn build_with_env(
    config: &ProviderConfig,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Arc<dyn Provider>, ProviderConfigError> {
    let name = config.name.clone().unwrap_or_else(|| config.kind.clone());
    if name.is_empty() {
        return Err(ProviderConfigError::Invalid {
            provider: name,
            detail: "the name must not be empty".to_owned(),
        });
    }
    if !known_kinds().contains(&config.kind.as_str()) {
        return Err(ProviderConfigError::UnknownKind {
            kind: config.kind.clone(),
            known: if known_kinds().is_empty() {
                "none; build with the `http` feature for stripe, stripe_capture, stripe_refund, adyen, square, paypal, resend and postmark".to_owned()
            } else {
                known_kinds().join(", ")
            },
        });
    }
    let api_key = env(&config.api_key_env)
        .filter(|v| !v.trim().is_empty())
        .ok_or_else(|| ProviderConfigError::MissingApiKey {
            var: config.api_key_env.clone(),
            provider: name.clone(),
        })?;
    build_http(config, name, api_key)
}

#[cfg(not(feature = "http"))]
fn build_http(
    config: &ProviderConfig,
    _name: String,
    _api_key: String,
) -> Result<Arc<dyn Provider>, ProviderConfigError> {
    Err(ProviderConfigError::UnknownKind {
        kind: config.kind.clone(),
        known: known_kinds().join(", "),
    })
}

#[cfg(feature = "http")]
fn build_http(
    config: &ProviderConfig,
    name: String,
    api_key: String,
) -> Result<Arc<dyn Provider>, ProviderConfigError> {
    use super::{
        Adyen, PayPal, Postmark, Resend, Square, Stripe, adyen, paypal, postmark, resend, square,
        stripe,
    };

    let http = |source| ProviderConfigError::Http {
        provider: name.clone(),
        source,
    };
    let base = |default: &'static str| {
        config
            .base_url
            .clone()
            .unwrap_or_else(|| default.to_owned())
    };
    check_settings(config, &name)?;
    // One adapter, at the configured base URL (or its own), named, with the settings it takes.
    macro_rules! adapter {
        ($adapter:ident, $module:ident $(, $setting:ident)* $(; try $checked:ident)* $(; does $op:expr)?) => {{
            let mut p = $adapter::with_base_url(&base($module::DEFAULT_BASE_URL), api_key)
                .map_err(http)?
                $(.operation($op))?
                .with_name(name.clone());
            $(
                if let Some(value) = config.$setting {
                    p = p.$setting(value);
                }
            )*
            $(
                if let Some(value) = &config.$checked {
                    p = p.$checked(value).map_err(http)?;
                }
            )*
            Ok(Arc::new(p))
        }};
    }
    match config.kind.as_str() {
        "stripe" => adapter!(Stripe, stripe, search_lag; try api_version),
        "stripe_capture" => {
            adapter!(Stripe, stripe, search_lag; try api_version; does stripe::StripeOperation::Capture)
        }
        "stripe_refund" => {
            adapter!(Stripe, stripe, search_lag; try api_version; does stripe::StripeOperation::Refund)
        }
        "postmark" => adapter!(Postmark, postmark, search_lag),
        "adyen" => adapter!(Adyen, adyen, redrive_margin),
        "square" => adapter!(Square, square, processing_window),
        "paypal" => adapter!(PayPal, paypal, redrive_margin, retention),
        "resend" => adapter!(Resend, resend, redrive_margin),
        other => Err(ProviderConfigError::UnknownKind {
            kind: other.to_owned(),
            known: known_kinds().join(", "),
        }),
    }
}

/// Refuses a setting given for a kind it does not apply to.
#[cfg(feature = "http")]
fn check_settings(config: &ProviderConfig, name: &str) -> Result<(), ProviderConfigError> {
    let kind = config.kind.as_str();
    // (given, the kinds it applies to, why not here)
    let settings: [(bool, &[&str], String); 5] = [
        (
            config.redrive_margin.is_some(),
            &["resend", "adyen", "paypal"],
            "redrive_margin applies to resend, adyen and paypal only (their lookup is a re-send); the sweeper's [sweeper] redrive_margin governs re-drives".to_owned(),
        ),
        (
            config.search_lag.is_some(),
            &["stripe", "stripe_capture", "stripe_refund", "postmark"],
            format!(
                "search_lag does not apply to {kind} (its lookup is a same-key re-send, not a search)"
            ),
        ),
        (
            config.retention.is_some(),
            &["paypal"],
            "retention applies to paypal only (PayPal-Request-Id retention, 6 h unless PayPal raised it)".to_owned(),
        ),
        (
            config.api_version.is_some(),
            &["stripe", "stripe_capture", "stripe_refund"],
            "api_version applies to the stripe kinds only (the Stripe-Version header)".to_owned(),
        ),
        (
            config.processing_window.is_some(),
            &["square"],
            "processing_window applies to square only (how long a void by key waits after the latest attempt)".to_owned(),
        ),
    ];
    match settings
        .into_iter()
        .find(|(given, kinds, _)| *given && !kinds.contains(&kind))
    {
        Some((_, _, detail)) => Err(ProviderConfigError::Invalid {
            provider: name.to_owned(),
            detail,
        }),
        None => Ok(()),
    }
}

#[cfg(all(test, feature = "http"))]
mod tests {
    use super::*;

    fn cfg(kind: &str) -> ProviderConfig {
        ProviderConfig {
            name: None,
            kind: kind.to_owned(),
            base_url: None,
            api_key_env: "IDEMFLOW_TEST_KEY".to_owned(),
            search_lag: None,
            redrive_margin: None,
            retention: None,
            processing_window: None,
            api_version: None,
        }
    }

    #[test]
    fn debug_and_errors_never_show_a_base_url_password() {
        let mut c = cfg("resend");
        c.base_url = Some("https://user:url-s3cret@proxy.test/?token=query-s3cret".to_owned());
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        #[cfg(feature = "http")]
        {
            // A base URL with a query is refused: the error shows it redacted.
            let Err(e) = build_with_env(&c, env) else {
                panic!("a base URL with a query was accepted");
            };
            let shown = format!("{e} {e:?}");
            assert!(!shown.contains("s3cret"), "{shown}");
        }
    }

    #[test]
    fn stripe_takes_an_api_version_and_no_other_kind_does() {
        let mut c = cfg("stripe");
        c.api_version = Some("2024-06-20".to_owned());
        assert!(build_with_env(&c, env).is_ok());
        c.api_version = Some("2024\n06".to_owned());
        assert!(matches!(
            build_with_env(&c, env),
            Err(ProviderConfigError::Http { .. })
        ));
        let mut c = cfg("postmark");
        c.api_version = Some("2024-06-20".to_owned());
        assert!(matches!(
            build_with_env(&c, env),
            Err(ProviderConfigError::Invalid { .. })
        ));
    }

    fn env(var: &str) -> Option<String> {
        (var == "IDEMFLOW_TEST_KEY").then(|| "sk_test_1".to_owned())
    }

    #[test]
    fn builds_each_kind_with_its_name() {
        for kind in known_kinds() {
            let p = build_with_env(&cfg(kind), env).unwrap();
            assert_eq!(p.name(), *kind);
        }
        let mut c = cfg("stripe");
        c.name = Some("stripe-eu".to_owned());
        c.base_url = Some("http://127.0.0.1:1".to_owned());
        c.search_lag = Some(std::time::Duration::from_secs(5));
        assert_eq!(build_with_env(&c, env).unwrap().name(), "stripe-eu");
        // The name given wins over the operation's default, whatever it is.
        let mut c = cfg("stripe_refund");
        c.name = Some("stripe".to_owned());
        assert_eq!(build_with_env(&c, env).unwrap().name(), "stripe");
    }

    #[test]
    fn clear_errors() {
        let e = build_with_env(&cfg("worldpay"), env).unwrap_err();
        assert!(
            e.to_string()
                .contains("adyen, paypal, postmark, resend, square, stripe"),
            "{e}"
        );
        let e = build_with_env(&cfg("stripe"), |_| None).unwrap_err();
        assert!(
            matches!(e, ProviderConfigError::MissingApiKey { .. }),
            "{e}"
        );
        let mut c = cfg("resend");
        c.base_url = Some("ftp://x".to_owned());
        let e = build_with_env(&c, env).unwrap_err();
        assert!(matches!(e, ProviderConfigError::Http { .. }), "{e}");
        assert!(std::error::Error::source(&e).is_some());
        let mut c = cfg("stripe");
        c.redrive_margin = Some(std::time::Duration::from_secs(1));
        assert!(matches!(
            build_with_env(&c, env).unwrap_err(),
            ProviderConfigError::Invalid { .. }
        ));
        let mut c = cfg("resend");
        c.redrive_margin = Some(std::time::Duration::from_secs(7200));
        assert!(build_with_env(&c, env).is_ok());
        let mut c = cfg("resend");
        c.search_lag = Some(std::time::Duration::from_secs(1));
        assert!(matches!(
            build_with_env(&c, env).unwrap_err(),
            ProviderConfigError::Invalid { .. }
        ));
    }

    #[test]
    fn card_kinds_take_their_own_settings_only() {
        for kind in ["adyen", "paypal"] {
            let mut c = cfg(kind);
            c.redrive_margin = Some(std::time::Duration::from_secs(7200));
            assert!(build_with_env(&c, env).is_ok(), "{kind}");
        }
        let mut c = cfg("square");
        c.processing_window = Some(std::time::Duration::from_secs(60));
        let p = build_with_env(&c, env).unwrap();
        assert_eq!(p.processing_window(), std::time::Duration::from_secs(60));
        let mut c = cfg("paypal");
        c.retention = Some(std::time::Duration::from_secs(72 * 3600));
        let p = build_with_env(&c, env).unwrap();
        assert_eq!(
            p.key_spec().retention,
            Some(std::time::Duration::from_secs(72 * 3600))
        );
        for (kind, field) in [
            ("square", "redrive_margin"),
            ("adyen", "search_lag"),
            ("square", "search_lag"),
            ("paypal", "search_lag"),
            ("adyen", "retention"),
            ("adyen", "processing_window"),
        ] {
            let mut c = cfg(kind);
            let d = Some(std::time::Duration::from_secs(5));
            match field {
                "redrive_margin" => c.redrive_margin = d,
                "search_lag" => c.search_lag = d,
                "processing_window" => c.processing_window = d,
                _ => c.retention = d,
            }
            assert!(
                matches!(
                    build_with_env(&c, env).unwrap_err(),
                    ProviderConfigError::Invalid { .. }
                ),
                "{kind} {field}"
            );
        }
        // Keys within each provider's limit.
        let scope = crate::key::Scope::new("shop").unwrap();
        let key = crate::key::IdempotencyKey::new("order-1").unwrap();
        for (kind, max) in [("square", 45), ("adyen", 64), ("paypal", 108)] {
            let spec = build_with_env(&cfg(kind), env).unwrap().key_spec();
            assert_eq!(spec.max_len, max);
            assert!(spec.derive(&scope, &key, "payments.create").len() <= max);
        }
    }

    #[test]
    fn parses_toml_shape() {
        let c: ProviderConfig = serde_json::from_value(serde_json::json!({
            "kind": "stripe", "api_key_env": "K", "search_lag": 90
        }))
        .unwrap();
        assert_eq!(c.search_lag, Some(std::time::Duration::from_secs(90)));
    }
}
