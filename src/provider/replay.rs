//! Lookups by same-key re-send (feature `http`): for providers that answer a re-send with the
//! same key inside their dedup window from their own records (Adyen, PayPal, Resend, Square)
//! and offer no way to find a request by our key, the lookup *is* the re-send, allowed only
//! while the key is surely still remembered.
//!
//! | Situation                                                   | [`Lookup`]                   |
//! |-------------------------------------------------------------|------------------------------|
//! | the request was not stored (`Null`)                         | `NeedsOperator`, nothing sent |
//! | first sent `window - margin` ago or earlier                 | `NeedsOperator`, nothing sent |
//! | re-send answered `Succeeded` / `Rejected`                   | `Found(..)`                  |
//! | re-send answered `Retryable` / `InFlight`                   | `Unknown { retry_after }`    |
//! | re-send answered `KeyConflict`                              | `NeedsOperator`              |
//! | re-send outcome unknown                                     | `Unknown`                    |

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{Attempts, CallReply, Lookup};
use crate::Outcome;

/// One lookup by re-send.
#[derive(Debug, Clone, Copy)]
pub struct ReplayLookup<'a> {
    /// The provider's name, for messages.
    pub provider: &'a str,
    /// How long the provider remembers a key, counted from the first send.
    pub window: Duration,
    /// The margin kept before the end of `window`.
    pub margin: Duration,
}

impl ReplayLookup<'_> {
    /// Whether a re-send of a request first sent at `attempts.first_sent_at` is still inside
    /// the window less the margin at `now` (database clock); `Err` holds the reason when not.
    pub fn check(
        &self,
        request: &Value,
        attempts: Attempts,
        now: DateTime<Utc>,
    ) -> Result<(), String> {
        if request.is_null() {
            return Err(format!(
                "the request was not stored, so it cannot be re-sent, and {} cannot be searched by our key",
                self.provider
            ));
        }
        let age = (now - attempts.first_sent_at).to_std().unwrap_or_default();
        if age.saturating_add(self.margin) >= self.window {
            return Err(format!(
                "first sent {}s ago, within {}s of the end of {}'s {}s key window or past it: a re-send could act twice, and {} cannot be searched by our key",
                age.as_secs(),
                self.margin.as_secs(),
                self.provider,
                self.window.as_secs(),
                self.provider
            ));
        }
        Ok(())
    }

    /// Runs the lookup: checks the window, then re-sends with `resend` and reads its answer.
    pub async fn run<F>(
        &self,
        request: &Value,
        attempts: Attempts,
        now: DateTime<Utc>,
        resend: F,
    ) -> Lookup
    where
        F: Future<Output = CallReply>,
    {
        if let Err(reason) = self.check(request, attempts, now) {
            return Lookup::NeedsOperator { reason };
        }
        answer_of_resend(self.provider, resend.await)
    }
}

/// What a same-key re-send's answer says about the first send.
pub fn answer_of_resend(provider: &str, outcome: CallReply) -> Lookup {
    match outcome {
        CallReply::Succeeded { response, .. } => Lookup::Found(Outcome::Succeeded(response)),
        CallReply::Rejected { response } => Lookup::Found(Outcome::Rejected(response)),
        CallReply::Retryable { retry_after, .. } | CallReply::InFlight { retry_after } => {
            Lookup::Unknown { retry_after }
        }
        CallReply::KeyConflict { detail } => Lookup::NeedsOperator {
            reason: format!("{provider} holds this key for another request: {detail}"),
        },
        CallReply::Unknown { reason } => {
            tracing::warn!(%provider, %reason, "re-send outcome unknown");
            Lookup::Unknown { retry_after: None }
        }
    }
}

/// Implements [`Provider`](super::Provider) for an adapter whose provider replays a same-key
/// re-send inside its key window and cannot be searched by our key (Adyen, PayPal, Resend): the
/// stored JSON request is the body, the provider key travels in `key_header`, `send` posts it to
/// `path` (re-sent with the same key after an unknown outcome) and reads each answer with the
/// adapter's `classify`, and `lookup` is a [`ReplayLookup`] over `key_window` (counted from the
/// first send) less the adapter's `redrive_margin`.
macro_rules! same_key_provider {
    (
        $adapter:ident {
            provider: $label:literal,
            path: $path:expr,
            key_header: $key_header:literal,
            max_len: $max_len:expr,
            key_window: $key_window:expr $(,)?
        }
    ) => {
        impl $adapter {
            fn key_window(&self) -> std::time::Duration {
                let window: fn(&Self) -> std::time::Duration = $key_window;
                window(self)
            }
        }

        #[async_trait::async_trait]
        impl $crate::provider::Provider for $adapter {
            fn name(&self) -> &str {
                self.endpoint.name()
            }

            fn key_spec(&self) -> $crate::provider::KeySpec {
                $crate::provider::KeySpec {
                    max_len: $max_len,
                    retention: Some(self.key_window()),
                    replays_same_key: true,
                }
            }

            async fn send(
                &self,
                provider_key: &str,
                request: &serde_json::Value,
            ) -> $crate::provider::CallReply {
                self.endpoint.traced($crate::provider::spans::Method::Call, provider_key, async move {
                    self.endpoint
                        .send(
                            $crate::provider::http::RetryUnknown::SameKeyReplays,
                            $path,
                            |req| req.header($key_header, provider_key).json(request),
                            Self::classify,
                        )
                        .await
                })
                .await
            }

            async fn lookup(
                &self,
                provider_key: &str,
                request: &serde_json::Value,
                attempts: $crate::provider::Attempts,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::provider::Lookup {
                self.endpoint.traced($crate::provider::spans::Method::Lookup, provider_key, async move {
                    $crate::provider::replay::ReplayLookup {
                        provider: $label,
                        window: self.key_window(),
                        margin: self.redrive_margin,
                    }
                    .run(request, attempts, now, self.send(provider_key, request))
                    .await
                })
                .await
            }
        }
    };
}

pub(crate) use same_key_provider;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_counts_from_the_first_send_and_keeps_the_margin() {
        let t0 = DateTime::<Utc>::UNIX_EPOCH;
        let r = ReplayLookup {
            provider: "p",
            window: Duration::from_secs(100),
            margin: Duration::from_secs(10),
        };
        let req = serde_json::json!({"a": 1});
        let at = |s| t0 + chrono::Duration::seconds(s);
        assert!(r.check(&req, Attempts::once(t0), at(89)).is_ok());
        assert!(r.check(&req, Attempts::once(t0), at(90)).is_err());
        // A later attempt does not reopen the window.
        assert!(r.check(&req, Attempts::new(t0, at(80)), at(95)).is_err());
        assert!(r.check(&Value::Null, Attempts::once(t0), at(1)).is_err());
    }
}
