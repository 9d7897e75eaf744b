#![doc = include_str!("../../docs/providers.md")]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::{Outcome, StoredResponse, key::IdempotencyKey, key::Scope, provider_key};

pub mod config;
pub mod secrets;
#[cfg(any(feature = "axum", feature = "testkit"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "axum", feature = "testkit"))))]
pub mod stripe_signature;

/// Declares the modules of the HTTP adapters, all behind the feature `http`.
macro_rules! http_modules {
    ($($(#[$doc:meta])* pub mod $name:ident;)*) => {
        $(
            $(#[$doc])*
            #[cfg(feature = "http")]
            #[cfg_attr(docsrs, doc(cfg(feature = "http")))]
            pub mod $name;
        )*
    };
}

http_modules! {
    pub mod endpoint;
    pub mod http;
    pub mod adyen;
    pub mod paypal;
    pub mod postmark;
    pub mod replay;
    pub mod resend;
    pub mod search;
    pub mod square;
    pub mod stripe;
}

#[cfg(feature = "http")]
mod answers;
#[cfg(feature = "http")]
mod spans;

#[cfg(feature = "http")]
pub use adyen::Adyen;
#[cfg(feature = "http")]
pub use paypal::PayPal;
#[cfg(feature = "http")]
pub use postmark::Postmark;
#[cfg(feature = "http")]
pub use resend::Resend;
#[cfg(feature = "http")]
pub use square::Square;
#[cfg(feature = "http")]
pub use stripe::Stripe;

/// The margin kept before the end of a provider's dedup window: past `window - margin` nothing
/// re-sends a stored request (the sweeper's default `redrive_margin`, and the default of the
/// adapters whose lookup is a re-send).
pub const DEFAULT_REDRIVE_MARGIN: Duration = Duration::from_secs(3600);

/// How a provider handles idempotency keys, as data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec {
    /// The longest key the provider accepts.
    pub max_len: usize,
    /// How long the provider remembers a key (its dedup window); `None` when it has no keys.
    pub retention: Option<Duration>,
    /// Whether a re-send with the same key inside `retention` returns the first result instead
    /// of acting again. Only then may the sweeper re-drive a request.
    pub replays_same_key: bool,
}

impl KeySpec {
    /// A spec for a provider without idempotency keys (never re-driven).
    pub fn no_keys() -> Self {
        Self {
            max_len: 255,
            retention: None,
            replays_same_key: false,
        }
    }

    /// Derives the provider key for (scope, key, operation) within this provider's limits: the
    /// key of the key's first row. A row re-created after an earlier one was purged stores a key
    /// of its own instead ([`provider_key::renewed`]); read a row's key from the row.
    pub fn derive(&self, scope: &Scope, key: &IdempotencyKey, operation: &str) -> String {
        provider_key::derive(scope, key, operation, self.max_len)
    }

    /// Whether re-sending the stored request is safe for a key first sent at `first_sent_at`,
    /// judged at `now` (both from the database clock), keeping `margin` in hand.
    pub fn may_redrive(
        &self,
        first_sent_at: DateTime<Utc>,
        now: DateTime<Utc>,
        margin: Duration,
    ) -> bool {
        match (self.replays_same_key, self.retention) {
            (true, Some(window)) => {
                let age = (now - first_sent_at).to_std().unwrap_or_default();
                age.saturating_add(margin) < window
            }
            _ => false,
        }
    }
}

/// What a provider replied to one [`Provider::send`], classified. This is the provider's reply;
/// the operation's own [`Outcome`] is made from it by [`into_outcome`](Self::into_outcome).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallReply {
    /// It worked; `replayed` when the provider says it answered from its own key cache.
    Succeeded {
        /// The provider's answer, as stored and replayed.
        response: StoredResponse,
        /// The provider marked it a replay (e.g. `Idempotent-Replayed: true`).
        replayed: bool,
    },
    /// A permanent refusal (card declined, invalid recipient).
    Rejected {
        /// The provider's answer.
        response: StoredResponse,
    },
    /// The provider surely did nothing (refused connection, 429, should-retry before executing).
    Retryable {
        /// Why.
        reason: String,
        /// The provider's `Retry-After`, if any.
        retry_after: Option<Duration>,
    },
    /// The provider says a request with this key is still running (its own 409).
    InFlight {
        /// The provider's `Retry-After`, if any.
        retry_after: Option<Duration>,
    },
    /// The provider holds this key for a different request: never retried automatically.
    KeyConflict {
        /// The provider's message.
        detail: String,
    },
    /// It may or may not have happened (timeout after send, reset, a 5xx that may have run).
    Unknown {
        /// Why.
        reason: String,
    },
}

impl CallReply {
    /// The executor's classification: success and refusal are stored; a provider-side in-flight
    /// answer, a key conflict and anything unknown leave the key processing for the sweeper.
    pub fn into_outcome(self) -> Outcome {
        match self {
            CallReply::Succeeded { response, .. } => Outcome::Succeeded(response),
            CallReply::Rejected { response } => Outcome::Rejected(response),
            CallReply::Retryable { reason, .. } => Outcome::Retryable { reason },
            CallReply::InFlight { .. } => Outcome::Unknown {
                reason: "the provider reports a request with this key still in flight".to_owned(),
            },
            CallReply::KeyConflict { detail } => Outcome::Unknown {
                reason: format!("the provider holds this key for another request: {detail}"),
            },
            CallReply::Unknown { reason } => Outcome::Unknown { reason },
        }
    }
}

/// What the provider's own records say about a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The provider acted: [`Outcome::Succeeded`] or [`Outcome::Rejected`] with its answer.
    Found(Outcome),
    /// No trace. Only an `authoritative` answer (a consistent read past any lag) may turn a key
    /// retryable.
    NotFound {
        /// Whether the absence is certain.
        authoritative: bool,
    },
    /// The provider could not say now.
    Unknown {
        /// When to ask again, if the provider said.
        retry_after: Option<Duration>,
    },
    /// The provider cannot be asked about this key now or later (its window is closing or
    /// closed, the request to re-send was not stored): an operator must decide.
    NeedsOperator {
        /// Why.
        reason: String,
    },
}

/// The provider's reply to [`Provider::void_by_key`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VoidReply {
    /// The provider confirmed that nothing stands charged under the key: no payment was made
    /// with it, or the one made is now voided. The key may become retryable.
    Voided {
        /// What the provider said.
        detail: String,
    },
    /// A payment stands under the key and cannot be voided (it completed, or failed): the
    /// provider holds the key, so ask it with [`Provider::lookup`].
    Refused {
        /// What the provider said.
        reason: String,
    },
    /// The provider could not say now (timeout, 5xx, rate limit, credentials).
    Unknown {
        /// Why.
        reason: String,
        /// When to ask again, if the provider said.
        retry_after: Option<Duration>,
    },
    /// The provider offers no void by key (the default).
    Unsupported,
}

/// An external service, used as `Arc<dyn Provider>`.
#[async_trait]
pub trait Provider: Debug + Send + Sync + 'static {
    /// The name stored in key rows (`"stripe"`, `"resend"`, ...). The sweeper finds the provider
    /// of a key by it.
    fn name(&self) -> &str;

    /// How the provider handles idempotency keys.
    fn key_spec(&self) -> KeySpec;

    /// Names of the members of this provider's JSON answers that are secret (Stripe's
    /// `client_secret`): masked at any depth before an answer is stored
    /// ([`secrets::mask_fields`]). Default: none.
    fn secret_fields(&self) -> &[&str] {
        &[]
    }

    /// Whether a refusal (`CallReply::Rejected`) answering a re-send of the key is the
    /// provider's answer about the key's own request, so it ends the key even after an earlier
    /// attempt that may have acted (`docs/providers.md`, "Error → outcome", "Cards"). Default: a
    /// 2xx reporting the key's payment refused or failed (Adyen, Square); any other refusal may
    /// answer the re-send alone while the first attempt still runs.
    fn definitive_refusal(&self, response: &StoredResponse) -> bool {
        (200..300).contains(&response.status())
    }

    /// Sends `request` (the canonical JSON stored in the key row) with `provider_key`.
    async fn send(&self, provider_key: &str, request: &serde_json::Value) -> CallReply;

    /// Voids whatever the request sent with `provider_key` did, identified by that key alone
    /// (Square's `CancelPaymentByIdempotencyKey`). The sweeper tries it before
    /// [`lookup`](Provider::lookup): a [`VoidReply::Voided`] turns an unknown outcome into
    /// "surely not charged" and the key retryable. Default: [`VoidReply::Unsupported`].
    /// `request` is the stored request (`Null` when it was not stored): an adapter may decline
    /// to void a request whose effect a void would destroy rather than undo (Square: a delayed
    /// capture), answering [`VoidReply::Unsupported`] so the sweeper looks it up instead.
    async fn void_by_key(&self, provider_key: &str, request: &serde_json::Value) -> VoidReply {
        let _ = (provider_key, request);
        VoidReply::Unsupported
    }

    /// How long after a request was sent the provider may still be acting on it (a create
    /// queued or running on its side, after the client gave up waiting). A
    /// [`VoidReply::Voided`] counts as "nothing stands charged" only once the key's latest
    /// attempt is at least this old (database clock): a void answered sooner can precede a
    /// payment that lands after it, so the sweeper checks the key again once the window has
    /// passed (the sweeper's `after_void`, `src/sweeper/decide.rs`). Default: zero.
    fn processing_window(&self) -> Duration {
        Duration::ZERO
    }

    /// Asks the provider what happened to the request sent with `provider_key`. `attempts` says
    /// when it was first sent (`KeyRecord::created_at`) and when its latest attempt may have
    /// reached the provider (`KeyRecord::last_attempt_at`: a reclaim or a takeover sends again
    /// later). `now` is the database clock when the caller took the key: adapters judge ages as
    /// `now - ..`, never by the application's clock. Search lag counts from
    /// `attempts.last_attempt_at` (an empty search is authoritative only once it has passed);
    /// the provider's retention and key windows count from `attempts.first_sent_at`.
    ///
    /// `request` is `Null` when the key's request was not stored
    /// ([`Idempotency::store_request`](crate::Idempotency::store_request) off, as for
    /// [`Context::send`](crate::Context::send)). An adapter whose lookup needs the request to
    /// prove the effect absent (which payment a refund or a capture named, which account a
    /// payment was made on) answers [`Lookup::NeedsOperator`] or [`Lookup::Unknown`] then,
    /// never an authoritative [`Lookup::NotFound`].
    async fn lookup(
        &self,
        provider_key: &str,
        request: &serde_json::Value,
        attempts: Attempts,
        now: DateTime<Utc>,
    ) -> Lookup;
}

/// When a key's request was sent: first, and by the latest attempt that may have reached the
/// provider. [`Provider::lookup`] judges search lag from the latter, the provider's retention and
/// key windows from the former.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Attempts {
    /// When the request was first sent (`KeyRecord::created_at`).
    pub first_sent_at: DateTime<Utc>,
    /// When the latest attempt may have reached the provider (`KeyRecord::last_attempt_at`);
    /// never before `first_sent_at`.
    pub last_attempt_at: DateTime<Utc>,
}

impl Attempts {
    /// First sent at `first_sent_at`, last at `last_attempt_at` (taken as `first_sent_at` if
    /// earlier).
    pub fn new(first_sent_at: DateTime<Utc>, last_attempt_at: DateTime<Utc>) -> Self {
        Self {
            first_sent_at,
            last_attempt_at: last_attempt_at.max(first_sent_at),
        }
    }

    /// Sent once, at `at`.
    pub fn once(at: DateTime<Utc>) -> Self {
        Self::new(at, at)
    }
}

/// Providers by name, for the executor and the sweeper.
#[derive(Debug, Clone, Default)]
pub struct Providers {
    by_name: BTreeMap<String, Arc<dyn Provider>>,
}

impl Providers {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a provider under its [`Provider::name`] (replacing one of the same name).
    pub fn with(mut self, provider: Arc<dyn Provider>) -> Self {
        self.insert(provider);
        self
    }

    /// Registers a provider under its [`Provider::name`].
    pub fn insert(&mut self, provider: Arc<dyn Provider>) {
        self.by_name.insert(provider.name().to_owned(), provider);
    }

    /// The provider with this name.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Provider>> {
        self.by_name.get(name)
    }

    /// The registered names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }
}
