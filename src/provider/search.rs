//! Lookups by metadata search (feature `http`): the provider stored our provider key in a
//! metadata field when it acted (Stripe's `metadata[idemflow_key]`, Postmark's
//! `Metadata.idemflow_key`), and a search for it says what happened.
//!
//! | The search answers                                 | [`Lookup`]                           |
//! |----------------------------------------------------|--------------------------------------|
//! | transport failure                                  | `Unknown`                            |
//! | any status but 200                                 | `Unknown { retry_after }`            |
//! | 200 without a list in the results field            | `Unknown`                            |
//! | 200 with a match                                   | `Found` (the adapter rebuilds the answer) |
//! | 200 with no match                                  | `NotFound { authoritative }`, see [`empty_result_is_authoritative`] |

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{Attempts, Lookup};
use super::endpoint::Endpoint;
use super::http::body_snippet;
use crate::Outcome;

/// One search for a provider key.
#[derive(Debug, Clone)]
pub struct MetadataSearch<'a> {
    /// The search path, e.g. `/v1/payment_intents/search`.
    pub path: &'a str,
    /// The query parameters (the provider key among them).
    pub query: &'a [(&'a str, &'a str)],
    /// The member of the JSON answer that lists the matches (`data`, `Messages`).
    pub results: &'a str,
    /// How long after the send an empty result is still not trusted (the search's lag).
    pub search_lag: Duration,
    /// How long the provider keeps what it searches; past it an empty result is never trusted.
    pub retention: Option<Duration>,
}

impl MetadataSearch<'_> {
    /// Runs the search on `endpoint` for a request sent at `attempts`, judged at `now` (all from
    /// the database clock); `found` rebuilds the provider's answer from the
    /// first match.
    pub async fn run(
        &self,
        endpoint: &Endpoint,
        attempts: Attempts,
        now: DateTime<Utc>,
        found: impl FnOnce(&Value) -> Outcome,
    ) -> Lookup {
        self.run_as(endpoint, None, attempts, now, found).await
    }

    /// [`run`](Self::run) with one more header on the search (Stripe's `Stripe-Account`: the
    /// search looks in that connected account).
    pub async fn run_as(
        &self,
        endpoint: &Endpoint,
        header: Option<(&str, &str)>,
        attempts: Attempts,
        now: DateTime<Utc>,
        found: impl FnOnce(&Value) -> Outcome,
    ) -> Lookup {
        let mut req = endpoint
            .request(reqwest::Method::GET, self.path)
            .query(self.query);
        if let Some((name, value)) = header {
            req = req.header(name, value);
        }
        let reply = match endpoint.http().send_once(req).await {
            Ok(r) => r,
            Err(outcome) => {
                tracing::warn!(provider = %endpoint.name(), ?outcome, "search failed");
                return Lookup::Unknown { retry_after: None };
            }
        };
        if reply.status != 200 {
            tracing::warn!(provider = %endpoint.name(), status = reply.status, body = %body_snippet(&reply.body), "search refused");
            return Lookup::Unknown {
                retry_after: reply.retry_after(),
            };
        }
        let matches = reply
            .json()
            .and_then(|mut b| b.get_mut(self.results).map(Value::take));
        let Some(Value::Array(matches)) = matches else {
            return Lookup::Unknown { retry_after: None };
        };
        match matches.first() {
            Some(m) => Lookup::Found(found(m)),
            None => Lookup::NotFound {
                authoritative: empty_result_is_authoritative(
                    attempts,
                    now,
                    self.search_lag,
                    self.retention,
                ),
            },
        }
    }
}

/// Whether an empty search result proves the provider never acted: the search has caught up
/// (`search_lag` has passed since the latest attempt) and the provider still keeps what it would
/// have found (`retention`, if any, has not passed since the first send).
pub fn empty_result_is_authoritative(
    attempts: Attempts,
    now: DateTime<Utc>,
    search_lag: Duration,
    retention: Option<Duration>,
) -> bool {
    let age = |at: DateTime<Utc>| (now - at).to_std().unwrap_or_default();
    age(attempts.last_attempt_at) >= search_lag
        && retention.is_none_or(|kept| age(attempts.first_sent_at) < kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authority_needs_the_lag_passed_and_the_retention_not() {
        let t0 = DateTime::<Utc>::UNIX_EPOCH;
        let at = |secs| t0 + chrono::Duration::seconds(secs);
        let once = Attempts::once(t0);
        let lag = Duration::from_secs(60);
        assert!(!empty_result_is_authoritative(once, at(59), lag, None));
        assert!(empty_result_is_authoritative(once, at(60), lag, None));
        assert!(!empty_result_is_authoritative(once, at(-5), lag, None));
        let kept = Some(Duration::from_secs(100));
        assert!(empty_result_is_authoritative(once, at(99), lag, kept));
        assert!(!empty_result_is_authoritative(once, at(100), lag, kept));
        // Lag counts from the latest attempt, retention from the first send.
        let twice = Attempts::new(t0, at(50));
        assert!(!empty_result_is_authoritative(twice, at(100), lag, None));
        assert!(empty_result_is_authoritative(twice, at(110), lag, None));
        assert!(!empty_result_is_authoritative(twice, at(110), lag, kept));
    }
}
