//! One provider's HTTP endpoint (feature `http`): the name stored in key rows, the base URL, the
//! credentials and how they travel, and the [`HttpClient`] with its settings. Each built-in
//! adapter holds one and keeps only what is specific to its provider (request shape,
//! classification table, lookup).
//!
//! An adapter for another provider can hold an [`Endpoint`] too: build it with
//! [`Endpoint::new`], send the effect with [`Endpoint::send`] and, for a search-based lookup,
//! use [`MetadataSearch`](super::search::MetadataSearch).

use std::fmt;
use std::future::Future;

use super::CallReply;
use super::spans;
use super::http::{ApiKey, Classified, HttpClient, HttpConfig, HttpError, HttpReply, RetryUnknown};
use crate::store::connect_error::RedactedUrl;

/// How the credentials travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Auth {
    /// `Authorization: Bearer <key>` (Stripe, Resend).
    Bearer,
    /// The key as the value of a header of its own (Postmark's `X-Postmark-Server-Token`).
    Header(&'static str),
}

/// A provider's name, base URL, credentials and HTTP client. Its `Debug` never shows the key,
/// shows the base URL as [`redact_url`](crate::store::connect_error::redact_url) does, and names
/// the headers set at run time without their values.
#[derive(Clone)]
pub struct Endpoint {
    name: String,
    base_url: String,
    auth: Auth,
    key: ApiKey,
    headers: &'static [(&'static str, &'static str)],
    /// Headers set at run time ([`Endpoint::set_header`]); each replaces a fixed one of its name.
    set: Vec<(&'static str, reqwest::header::HeaderValue)>,
    http: HttpClient,
}

crate::debug_fields::debug_fields!(Endpoint {
    name,
    base_url => RedactedUrl(base_url),
    auth,
    key,
    headers,
    set => set.iter().map(|(name, _)| *name).collect::<Vec<&str>>(),
    http,
});

/// A call's answer in a log line: its kind and status, never the provider's body or headers,
/// which may hold a secret the adapter masks only when the answer is stored (Stripe's
/// `client_secret`, [`Provider::secret_fields`](super::Provider::secret_fields)).
struct Logged<'a>(&'a CallReply);

impl fmt::Display for Logged<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            CallReply::Succeeded { response, replayed } => write!(
                f,
                "succeeded, status {} (replayed: {replayed})",
                response.status()
            ),
            CallReply::Rejected { response } => {
                write!(f, "rejected, status {}", response.status())
            }
            other => write!(f, "{other:?}"),
        }
    }
}

impl Endpoint {
    /// Runs `work`, the adapter's `method` for `provider_key`, inside the method's span under
    /// this endpoint's name ([`spans`](super::spans)).
    pub(crate) async fn traced<T>(
        &self,
        method: spans::Method,
        provider_key: &str,
        work: impl Future<Output = T>,
    ) -> T {
        spans::traced(method, &self.name, provider_key, work).await
    }

    /// An endpoint named `name` at `base_url` (checked and normalised by
    /// [`base_url`](super::http::base_url)), with the key `key` sent as `auth` says and the
    /// default [`HttpConfig`].
    pub fn new(
        name: impl Into<String>,
        base_url: &str,
        auth: Auth,
        key: impl Into<String>,
    ) -> Result<Self, HttpError> {
        Ok(Self {
            name: name.into(),
            base_url: super::http::base_url(base_url)?,
            auth,
            key: ApiKey::new(key)?,
            headers: &[],
            set: Vec::new(),
            http: HttpClient::new(HttpConfig::default())?,
        })
    }

    /// Headers sent with every request (e.g. `Accept: application/json`).
    pub fn with_headers(mut self, headers: &'static [(&'static str, &'static str)]) -> Self {
        self.headers = headers;
        self
    }

    /// Sends `name: value` with every request from now on, instead of a fixed header of that
    /// name (case-insensitive) and of an earlier value set here. A value that cannot travel in
    /// HTTP is refused.
    pub fn set_header(&mut self, name: &'static str, value: &str) -> Result<(), HttpError> {
        let value = reqwest::header::HeaderValue::from_str(value).map_err(|e| {
            HttpError::InvalidHeader {
                name,
                reason: e.to_string(),
            }
        })?;
        self.set.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        self.set.push((name, value));
        Ok(())
    }

    /// The value sent in header `name` on every request, if one is (a fixed header, or one set
    /// with [`set_header`](Self::set_header)).
    pub fn header(&self, name: &str) -> Option<&str> {
        match self.set.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)) {
            Some((_, v)) => v.to_str().ok(),
            None => self
                .headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| *v),
        }
    }

    /// The name stored in key rows.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Renames the endpoint (the name stored in key rows).
    pub fn set_name(&mut self, name: impl Into<String>) {
        self.name = name.into();
    }

    /// The base URL in use, without a trailing slash.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Replaces the timeouts and retry settings.
    pub fn set_http_config(&mut self, config: HttpConfig) -> Result<(), HttpError> {
        self.http = HttpClient::new(config)?;
        Ok(())
    }

    /// The HTTP client.
    pub fn http(&self) -> &HttpClient {
        &self.http
    }

    /// A request to `base_url + path` carrying the credentials and the fixed headers.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let url = format!("{}{path}", self.base_url);
        let mut req = self.http.inner().request(method, url);
        req = match self.auth {
            Auth::Bearer => req.bearer_auth(self.key.expose()),
            Auth::Header(name) => req.header(name, self.key.expose()),
        };
        for (name, value) in self.headers {
            if !self.set.iter().any(|(n, _)| n.eq_ignore_ascii_case(name)) {
                req = req.header(*name, *value);
            }
        }
        for (name, value) in &self.set {
            req = req.header(*name, value.clone());
        }
        req
    }

    /// Sends the effect: `POST path`, completed by `body` (the provider key, the payload) on
    /// every attempt of [`HttpClient::send`]'s retry loop, each answer read by `classify`.
    pub async fn send<B, C>(
        &self,
        retry_unknown: RetryUnknown,
        path: &str,
        body: B,
        classify: C,
    ) -> CallReply
    where
        B: Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
        C: Fn(&HttpReply) -> Classified,
    {
        let outcome = self
            .http
            .send(
                retry_unknown,
                |_| body(self.request(reqwest::Method::POST, path)),
                classify,
            )
            .await;
        tracing::debug!(provider = %self.name, outcome = %Logged(&outcome), "provider call");
        outcome
    }
}

/// Generates what every HTTP adapter shares around its `endpoint` field: the constructors
/// `new` (the provider's `DEFAULT_BASE_URL`) and `with_base_url`, and the builder methods
/// `with_name`, `http_config` and `base_url`. Each of `settings` is another field of the
/// adapter: its default, and a builder method of its name that sets it (documented by the
/// setting's doc comment). Each of `fields` (optional) is a field with its initial value and no
/// generated setter (the adapter writes its own).
macro_rules! http_adapter {
    (
        $adapter:ident {
            name: $name:literal,
            key: $key_doc:literal,
            auth: $auth:expr,
            headers: $headers:expr,
            settings: {
                $( $(#[$setting_doc:meta])* $field:ident: $ty:ty = $value:expr ),* $(,)?
            }
            $(, fields: { $( $fixed:ident: $fixed_value:expr ),* $(,)? })? $(,)?
        }
    ) => {
        impl $adapter {
            #[doc = concat!("`", stringify!($adapter), "` at its real API base, with ", $key_doc, ".")]
            pub fn new(
                api_key: impl Into<String>,
            ) -> Result<Self, $crate::provider::http::HttpError> {
                Self::with_base_url(DEFAULT_BASE_URL, api_key)
            }

            #[doc = concat!("`", stringify!($adapter), "` at another base URL (a fake server, a proxy), e.g. `http://127.0.0.1:4242`.")]
            pub fn with_base_url(
                base_url: &str,
                api_key: impl Into<String>,
            ) -> Result<Self, $crate::provider::http::HttpError> {
                let endpoint =
                    $crate::provider::endpoint::Endpoint::new($name, base_url, $auth, api_key)?
                        .with_headers($headers);
                Ok(Self {
                    endpoint,
                    $($field: $value,)*
                    $($($fixed: $fixed_value,)*)?
                })
            }

            #[doc = concat!("Sets the name stored in key rows (default `", $name, "`).")]
            pub fn with_name(mut self, name: impl Into<String>) -> Self {
                self.endpoint.set_name(name);
                self
            }

            /// Replaces the timeouts and retry settings.
            pub fn http_config(
                mut self,
                config: $crate::provider::http::HttpConfig,
            ) -> Result<Self, $crate::provider::http::HttpError> {
                self.endpoint.set_http_config(config)?;
                Ok(self)
            }

            /// The base URL in use.
            pub fn base_url(&self) -> &str {
                self.endpoint.base_url()
            }

            $(
                $(#[$setting_doc])*
                pub fn $field(mut self, $field: $ty) -> Self {
                    self.$field = $field;
                    self
                }
            )*
        }
    };
}

pub(crate) use http_adapter;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_key_a_header_value_or_the_base_url_password() {
        let mut endpoint = Endpoint::new(
            "acme",
            "https://user:url-s3cret@api.acme.test",
            Auth::Bearer,
            "sk_live_key",
        )
        .unwrap();
        endpoint
            .set_header("X-Acme-Signature", "header-s3cret")
            .unwrap();
        let shown = format!("{endpoint:?} {endpoint:#?}");
        for secret in ["url-s3cret", "sk_live_key", "header-s3cret"] {
            assert!(!shown.contains(secret), "{secret}: {shown}");
        }
        assert!(shown.contains("X-Acme-Signature"), "{shown}");
        let e = Endpoint::new(
            "acme",
            "https://api.acme.test/?api_key=query-s3cret",
            Auth::Bearer,
            "k",
        )
        .unwrap_err();
        let shown = format!("{e} {e:?}");
        assert!(!shown.contains("query-s3cret"), "{shown}");
    }

    #[test]
    fn a_logged_answer_has_no_body() {
        let response = crate::StoredResponse::new(200).with_body(r#"{"client_secret":"pi_1_secret_x"}"#);
        let shown = Logged(&CallReply::Succeeded {
            response,
            replayed: false,
        })
        .to_string();
        assert_eq!(shown, "succeeded, status 200 (replayed: false)");
    }
}
