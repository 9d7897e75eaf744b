//! The per-key decision of the sweeper, as pure functions: which action to take for a stale key
//! ([`plan`]), and what the provider's answer means for the key ([`after_call`],
//! [`after_lookup`]). No I/O here, so every row of the decision table is unit-tested.
//!
//! | situation | action | result |
//! |---|---|---|
//! | no provider recorded, or provider not registered | none | needs an operator (long recheck) |
//! | provider dedupes by key, inside its window (with margin), request stored | re-drive (`call`) | see [`after_call`] |
//! | anything else (outside the window, no keys, no documented window, request missing) | `void_by_key`, then `lookup` | see [`after_void`]: a void confirmed past the provider's processing window since the latest attempt settles the key retryable, one confirmed sooner defers it; otherwise [`after_lookup`] (`Lookup::NeedsOperator`: needs an operator) |

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::provider::{CallReply, KeySpec, Lookup, VoidReply};
use crate::state::{RetryEvidence, may_become_retryable};
use crate::{KeyState, Outcome, StoredResponse, record::KeyRecord};

/// The sweeper's plan for a stale key, before it asks the provider anything.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum SweeperPlan {
    /// No provider can settle it: an operator must decide.
    NeedsOperator {
        /// Why.
        reason: String,
    },
    /// Re-send the stored request with the stored provider key (safe: the provider replays the
    /// first result inside its dedup window).
    Redrive {
        /// The stored request.
        request: serde_json::Value,
    },
    /// Ask the provider what happened.
    Lookup {
        /// The stored request, or `Null` when it was not stored.
        request: serde_json::Value,
        /// Why a lookup rather than a re-drive (for history).
        why: String,
    },
}

/// The sweeper's decision for a key, once it has heard from the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SweeperDecision {
    /// Finish the key (`done`, `failed{permanent}` or `failed{retryable}`).
    Finish {
        /// The final state.
        to: KeyState,
        /// The provider's answer to store and replay.
        response: Option<StoredResponse>,
        /// An error description for the row.
        error: Option<String>,
        /// Why (history).
        reason: String,
    },
    /// Keep the key processing and look again later.
    Defer {
        /// Why (history and report).
        reason: String,
        /// The provider's `Retry-After`, honoured as a lower bound of the backoff.
        retry_after: Option<Duration>,
    },
    /// Keep the key processing, recheck rarely, and report it for an operator.
    NeedsOperator {
        /// Why (history and report).
        reason: String,
    },
}

/// Chooses the action for `record` whose provider has `spec` (`None`: not registered), judged at
/// `now` (database clock) keeping `margin` before the end of the provider's dedup window.
pub(crate) fn plan(
    record: &KeyRecord,
    provider: Option<(&str, &KeySpec)>,
    now: DateTime<Utc>,
    margin: Duration,
) -> SweeperPlan {
    let Some(name) = record.provider.as_deref() else {
        return SweeperPlan::NeedsOperator {
            reason: format!(
                "operation {:?} recorded no provider, so nothing can tell whether it ran; an operator must decide (idemflow resolve)",
                record.operation
            ),
        };
    };
    let Some((_, spec)) = provider else {
        return SweeperPlan::NeedsOperator {
            reason: format!(
                "provider {name:?} is not registered with this sweeper; an operator must configure it or decide the key (idemflow resolve)"
            ),
        };
    };
    let stored: Option<serde_json::Value> = record
        .request
        .as_deref()
        .and_then(|r| serde_json::from_str(r).ok());
    let request_missing = stored.is_none();
    let request = stored.unwrap_or(serde_json::Value::Null);
    if request_missing {
        return SweeperPlan::Lookup {
            request,
            why: "the request was not stored, so it can only be looked up".to_owned(),
        };
    }
    if !spec.replays_same_key {
        return SweeperPlan::Lookup {
            request,
            why: format!("{name} does not dedupe by key, so it is never re-driven"),
        };
    }
    if spec.retention.is_none() {
        return SweeperPlan::Lookup {
            request,
            why: format!(
                "{name} documents no key window, so a re-send is never known to be deduped; it is never re-driven"
            ),
        };
    }
    if spec.may_redrive(record.created_at, now, margin) {
        SweeperPlan::Redrive { request }
    } else {
        SweeperPlan::Lookup {
            request,
            why: format!(
                "first sent at {} which is past {name}'s dedup window less a margin of {margin:?}; re-driving could act twice",
                record.created_at.to_rfc3339()
            ),
        }
    }
}

/// What a re-drive's answer means. Only a success or a permanent refusal settles the key: a
/// `Retryable` answer to the *re-send* says nothing about the first send (a 429 comes before the
/// provider's key lookup), so the key is kept and re-driven later, or looked up once the window
/// closes.
pub(crate) fn after_call(provider: &str, reply: CallReply) -> SweeperDecision {
    match reply {
        CallReply::Succeeded { response, replayed } => {
            let reason = format!(
                "sweeper re-drove the stored request to {provider} with the same provider key; it answered {}{}",
                response.status(),
                if replayed {
                    " (a replay of its first result)"
                } else {
                    ""
                }
            );
            settled(provider, response, false, reason)
        }
        CallReply::Rejected { response } => {
            let reason = format!(
                "sweeper re-drove the stored request to {provider} with the same provider key; it refused permanently ({})",
                response.status()
            );
            settled(provider, response, true, reason)
        }
        CallReply::Retryable {
            reason,
            retry_after,
        } => SweeperDecision::Defer {
            reason: format!(
                "re-drive to {provider} answered retryable ({reason}); that says nothing about the first send, trying again later"
            ),
            retry_after,
        },
        CallReply::InFlight { retry_after } => SweeperDecision::Defer {
            reason: format!("{provider} reports a request with this key still in flight"),
            retry_after,
        },
        CallReply::Unknown { reason } => SweeperDecision::Defer {
            reason: format!("re-drive to {provider} has an unknown outcome: {reason}"),
            retry_after: None,
        },
        CallReply::KeyConflict { detail } => SweeperDecision::NeedsOperator {
            reason: format!(
                "{provider} holds this provider key for another request ({detail}); an operator must decide"
            ),
        },
    }
}

/// The finish of a key the provider settled: `done` with its answer, or `failed{permanent}`
/// when it `refused`; `reason` says how the sweeper learnt it.
fn settled(
    provider: &str,
    response: StoredResponse,
    refused: bool,
    reason: String,
) -> SweeperDecision {
    let (to, error) = if refused {
        let error = format!("{provider} refused the request");
        (KeyState::Failed { retryable: false }, Some(error))
    } else {
        (KeyState::Done, None)
    };
    SweeperDecision::Finish {
        to,
        response: Some(response),
        error,
        reason,
    }
}

/// What a lookup's answer means. Only an authoritative absence turns a key retryable.
pub(crate) fn after_lookup(provider: &str, why: &str, lookup: Lookup) -> SweeperDecision {
    match lookup {
        Lookup::Found(Outcome::Succeeded(response)) => {
            let reason = format!(
                "sweeper looked the key up at {provider} ({why}): it acted and answered {}",
                response.status()
            );
            settled(provider, response, false, reason)
        }
        Lookup::Found(Outcome::Rejected(response)) => {
            let reason = format!(
                "sweeper looked the key up at {provider} ({why}): it refused permanently ({})",
                response.status()
            );
            settled(provider, response, true, reason)
        }
        Lookup::Found(Outcome::Retryable { reason } | Outcome::Unknown { reason }) => {
            SweeperDecision::Defer {
                reason: format!(
                    "lookup at {provider} found the request but not a final answer: {reason}"
                ),
                retry_after: None,
            }
        }
        // The lookup adapter judged the search lag from the key's latest attempt, so an
        // authoritative absence holds whatever earlier attempts did: the one rule allows it even
        // when an attempt may have acted.
        Lookup::NotFound {
            authoritative: true,
        } if may_become_retryable(true, RetryEvidence::AuthoritativeNotFound) => {
            SweeperDecision::Finish {
                to: KeyState::Failed { retryable: true },
                response: None,
                error: Some(format!("{provider} has no record of this request")),
                reason: format!(
                    "sweeper looked the key up at {provider} ({why}): authoritatively not found, so it never ran; the client's next retry runs it"
                ),
            }
        }
        Lookup::NotFound { .. } => SweeperDecision::Defer {
            reason: format!(
                "lookup at {provider} found nothing yet, but its search may lag; looking again later"
            ),
            retry_after: None,
        },
        Lookup::Unknown { retry_after } => SweeperDecision::Defer {
            reason: format!("{provider} could not say what happened"),
            retry_after,
        },
        Lookup::NeedsOperator { reason } => SweeperDecision::NeedsOperator {
            reason: format!(
                "{provider} cannot settle the key ({why}): {reason}; an operator must decide (idemflow resolve)"
            ),
        },
    }
}

/// What a void by key's answer means, before any lookup: `Some` settles or defers the key,
/// `None` goes on to the lookup (the provider has no void by key, or refused it because a
/// payment stands under the key). A confirmed void is the authoritative evidence that makes even
/// a key that may have acted retryable: nothing stands charged under its provider key, provided
/// the key's latest attempt is at least the provider's `processing_window` old
/// (`since_last_attempt`, database clock). A void confirmed sooner may precede a payment the
/// provider is still making (a create queued or running after the client gave up), so the key
/// is deferred until the window has passed, and the void (or the lookup it then leads to)
/// decides.
pub(crate) fn after_void(
    provider: &str,
    void: VoidReply,
    since_last_attempt: Duration,
    processing_window: Duration,
) -> Option<SweeperDecision> {
    match void {
        VoidReply::Voided { detail } if since_last_attempt < processing_window => {
            let left = processing_window - since_last_attempt;
            Some(SweeperDecision::Defer {
                reason: format!(
                    "{provider} confirmed the void by key ({detail}), but the latest attempt was \
                     sent {}ms ago, inside {provider}'s processing window of {}ms: a payment \
                     still being made could land after the void; checking again after the window",
                    since_last_attempt.as_millis(),
                    processing_window.as_millis()
                ),
                retry_after: Some(left),
            })
        }
        VoidReply::Voided { detail }
            if may_become_retryable(true, RetryEvidence::ConfirmedVoid) =>
        {
            Some(SweeperDecision::Finish {
                to: KeyState::Failed { retryable: true },
                response: None,
                error: Some(format!(
                    "{provider} voided the request by key: nothing charged"
                )),
                reason: format!(
                    "sweeper voided the key at {provider} ({detail}), past its processing window \
                     since the latest attempt; nothing stands charged, so the client's next retry \
                     runs it"
                ),
            })
        }
        VoidReply::Unknown {
            reason,
            retry_after,
        } => Some(SweeperDecision::Defer {
            reason: format!("void by key at {provider} has an unknown outcome: {reason}"),
            retry_after,
        }),
        VoidReply::Voided { .. } | VoidReply::Refused { .. } | VoidReply::Unsupported => None,
    }
}

/// The recheck delay after the `attempts`-th claim/takeover: `base * 2^(takeovers - 1)`, capped
/// at `cap`, and never earlier than the provider's `retry_after`.
pub(crate) fn backoff(
    attempts: i32,
    base: Duration,
    cap: Duration,
    retry_after: Option<Duration>,
) -> Duration {
    // The first claim is attempt 1; every sweeper takeover adds one.
    let takeovers = u32::try_from(attempts.saturating_sub(1))
        .unwrap_or(0)
        .max(1);
    let factor = 2u32.saturating_pow((takeovers - 1).min(31));
    let exp = base.saturating_mul(factor).min(cap);
    match retry_after {
        Some(r) => exp.max(r),
        None => exp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{fingerprint::Fingerprint, key::IdempotencyKey, key::Scope, record::LeaseToken};

    fn record(provider: Option<&str>, request: Option<&str>, age_s: i64) -> KeyRecord {
        let now = Utc::now();
        KeyRecord {
            scope: Scope::new("s").unwrap(),
            key: IdempotencyKey::new("k").unwrap(),
            operation: "charge".into(),
            provider: provider.map(str::to_owned),
            provider_key: "pk".into(),
            state: KeyState::Processing,
            fingerprint: Fingerprint::compute("charge", "{}"),
            request: request.map(str::to_owned),
            response: None,
            error: None,
            lease_token: LeaseToken(2),
            lease_owner: None,
            lease_expires_at: Some(now),
            attempts: 2,
            created_at: now - chrono::Duration::seconds(age_s),
            last_attempt_at: now - chrono::Duration::seconds(age_s),
            may_have_acted: true,
            updated_at: now,
            expires_at: None,
            next_check_at: None,
            retention_ms: 1000,
        }
    }

    fn keyed(window_s: u64) -> KeySpec {
        KeySpec {
            max_len: 255,
            retention: Some(Duration::from_secs(window_s)),
            replays_same_key: true,
        }
    }

    const M: Duration = Duration::from_secs(60);

    #[test]
    fn plans_follow_the_table() {
        let now = Utc::now();
        let spec = keyed(3600);
        let r = record(None, Some("{}"), 10);
        assert!(matches!(
            plan(&r, None, now, M),
            SweeperPlan::NeedsOperator { .. }
        ));
        let r = record(Some("p"), Some("{}"), 10);
        assert!(matches!(
            plan(&r, None, now, M),
            SweeperPlan::NeedsOperator { .. }
        ));
        assert!(matches!(
            plan(&r, Some(("p", &spec)), now, M),
            SweeperPlan::Redrive { .. }
        ));
        // Past the window less the margin: lookup.
        let old = record(Some("p"), Some("{}"), 3600 - 30);
        assert!(matches!(
            plan(&old, Some(("p", &spec)), now, M),
            SweeperPlan::Lookup { .. }
        ));
        // No keys: lookup, however young.
        assert!(matches!(
            plan(&r, Some(("p", &KeySpec::no_keys())), now, M),
            SweeperPlan::Lookup { .. }
        ));
        // Keys but no replay: lookup.
        let no_replay = KeySpec {
            replays_same_key: false,
            ..keyed(3600)
        };
        assert!(matches!(
            plan(&r, Some(("p", &no_replay)), now, M),
            SweeperPlan::Lookup { .. }
        ));
        // Request missing: lookup with Null.
        let missing = record(Some("p"), None, 10);
        assert_eq!(
            plan(&missing, Some(("p", &spec)), now, M),
            SweeperPlan::Lookup {
                request: serde_json::Value::Null,
                why: "the request was not stored, so it can only be looked up".into()
            }
        );
    }

    #[test]
    fn answers_map_to_decisions() {
        let ok = StoredResponse::new(201);
        assert!(matches!(
            after_call(
                "p",
                CallReply::Succeeded {
                    response: ok.clone(),
                    replayed: true
                }
            ),
            SweeperDecision::Finish {
                to: KeyState::Done,
                ..
            }
        ));
        assert!(matches!(
            after_call(
                "p",
                CallReply::Rejected {
                    response: ok.clone()
                }
            ),
            SweeperDecision::Finish {
                to: KeyState::Failed { retryable: false },
                ..
            }
        ));
        for o in [
            CallReply::Retryable {
                reason: "429".into(),
                retry_after: None,
            },
            CallReply::InFlight { retry_after: None },
            CallReply::Unknown {
                reason: "timeout".into(),
            },
        ] {
            assert!(matches!(after_call("p", o), SweeperDecision::Defer { .. }));
        }
        assert!(matches!(
            after_call("p", CallReply::KeyConflict { detail: "x".into() }),
            SweeperDecision::NeedsOperator { .. }
        ));
        assert!(matches!(
            after_lookup("p", "", Lookup::Found(Outcome::Succeeded(ok.clone()))),
            SweeperDecision::Finish {
                to: KeyState::Done,
                ..
            }
        ));
        assert!(matches!(
            after_lookup("p", "", Lookup::Found(Outcome::Rejected(ok))),
            SweeperDecision::Finish {
                to: KeyState::Failed { retryable: false },
                ..
            }
        ));
        assert!(matches!(
            after_lookup(
                "p",
                "",
                Lookup::NotFound {
                    authoritative: true
                }
            ),
            SweeperDecision::Finish {
                to: KeyState::Failed { retryable: true },
                response: None,
                ..
            }
        ));
        assert!(matches!(
            after_lookup(
                "p",
                "",
                Lookup::NotFound {
                    authoritative: false
                }
            ),
            SweeperDecision::Defer { .. }
        ));
        assert_eq!(
            after_lookup(
                "p",
                "",
                Lookup::Unknown {
                    retry_after: Some(Duration::from_secs(9))
                }
            ),
            SweeperDecision::Defer {
                reason: "p could not say what happened".into(),
                retry_after: Some(Duration::from_secs(9))
            }
        );
        // A provider that cannot be asked (window closing, no stored request): an operator.
        let SweeperDecision::NeedsOperator { reason } = after_lookup(
            "p",
            "why",
            Lookup::NeedsOperator {
                reason: "closed".into(),
            },
        ) else {
            panic!("not for an operator")
        };
        assert!(
            reason.contains("why") && reason.contains("closed"),
            "{reason}"
        );
    }

    #[test]
    fn voids_settle_defer_or_go_on_to_the_lookup() {
        let past = Duration::from_secs(600);
        let window = Duration::from_secs(300);
        assert!(matches!(
            after_void(
                "p",
                VoidReply::Voided {
                    detail: "ok".into()
                },
                past,
                window
            ),
            Some(SweeperDecision::Finish {
                to: KeyState::Failed { retryable: true },
                response: None,
                ..
            })
        ));
        assert!(matches!(
            after_void(
                "p",
                VoidReply::Unknown {
                    reason: "503".into(),
                    retry_after: Some(Duration::from_secs(3))
                },
                past,
                window
            ),
            Some(SweeperDecision::Defer {
                retry_after: Some(_),
                ..
            })
        ));
        assert_eq!(
            after_void(
                "p",
                VoidReply::Refused {
                    reason: "completed".into()
                },
                past,
                window
            ),
            None
        );
        assert_eq!(after_void("p", VoidReply::Unsupported, past, window), None);
        // Confirmed inside the processing window: deferred until the window has passed.
        assert_eq!(
            after_void(
                "p",
                VoidReply::Voided {
                    detail: "ok".into()
                },
                Duration::from_secs(10),
                window
            )
            .map(|d| match d {
                SweeperDecision::Defer { retry_after, .. } => retry_after,
                other => panic!("{other:?}"),
            }),
            Some(Some(Duration::from_secs(290)))
        );
    }

    #[test]
    fn backoff_doubles_caps_and_honours_retry_after() {
        let b = Duration::from_secs(30);
        let cap = Duration::from_secs(3600);
        assert_eq!(backoff(2, b, cap, None), b);
        assert_eq!(backoff(3, b, cap, None), b * 2);
        assert_eq!(backoff(4, b, cap, None), b * 4);
        assert_eq!(backoff(100, b, cap, None), cap);
        assert_eq!(backoff(i32::MAX, b, cap, None), cap);
        assert_eq!(backoff(1, b, cap, None), b);
        assert_eq!(
            backoff(2, b, cap, Some(Duration::from_secs(90))),
            Duration::from_secs(90)
        );
        assert_eq!(backoff(2, b, cap, Some(Duration::from_secs(1))), b);
        // A provider asking for longer than the cap is honoured.
        assert_eq!(backoff(2, b, cap, Some(cap * 2)), cap * 2);
    }
}
