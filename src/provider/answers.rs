//! The part of answer classification the built-in adapters share (feature `http`): a 2xx is
//! `Succeeded`, 401 and 403 are a refused credential (`Retryable`: nothing was done), a 409 is a
//! request with the key still running (`InFlight`), the provider's validation statuses are
//! `Rejected`, and anything else goes to [`classify_status`]. Each adapter matches its own
//! special answers first (key conflicts, refused payments, replay markers) and hands the rest to
//! its [`Answers`].

use super::CallReply;
use super::http::{Classified, HttpReply, classify_status};
use crate::StoredResponse;

/// A request the adapter cannot shape into the provider's request (not a JSON object, ...),
/// refused before anything is sent: `Rejected`, with `body` (in the provider's own error shape)
/// stored as the answer with `status`.
pub(crate) fn refused_unsent(status: u16, body: &serde_json::Value) -> CallReply {
    CallReply::Rejected {
        response: StoredResponse::json(status, body)
            .unwrap_or_else(|_| StoredResponse::new(status)),
    }
}

/// How one provider's ordinary answers read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Answers {
    /// The provider's name in messages (`"Stripe"`).
    pub(crate) provider: &'static str,
    /// What its credential is called in messages (`"API key"`, `"access token"`).
    pub(crate) credential: &'static str,
    /// What a refused credential did not do: `"done"` (a payment) or `"sent"` (an email).
    pub(crate) effect: &'static str,
    /// The answer's headers kept in a stored answer (besides `content-type`).
    pub(crate) kept_headers: &'static [&'static str],
    /// Whether a 409 means "a request with this key is running" (`InFlight`); otherwise it is
    /// left to [`classify_status`].
    pub(crate) in_flight_on_409: bool,
    /// The statuses that refuse the request itself (validation, unknown resource).
    pub(crate) rejects: fn(u16) -> bool,
}

impl Answers {
    /// The answer, as stored, as a success (`replayed` when the provider marked it a replay).
    pub(crate) fn succeeded(&self, reply: &HttpReply, replayed: bool) -> CallReply {
        CallReply::Succeeded {
            response: reply.to_response(self.kept_headers),
            replayed,
        }
    }

    /// The answer, as stored, as a refusal.
    pub(crate) fn rejected(&self, reply: &HttpReply) -> CallReply {
        CallReply::Rejected {
            response: reply.to_response(self.kept_headers),
        }
    }

    /// A 2xx reporting the payment made under the key: `Succeeded`, or, when the provider
    /// reports it `refused`, a [`Classified::definitive`] refusal (the answer about the key's
    /// payment itself).
    pub(crate) fn payment(&self, reply: &HttpReply, refused: bool) -> Classified {
        if refused {
            Classified::definitive(self.rejected(reply))
        } else {
            Classified::new(self.succeeded(reply, false))
        }
    }

    /// Classifies an ordinary answer; `code` (the provider's error name, if it has one) and
    /// `message` go into the reason of a refused credential.
    pub(crate) fn classify(
        &self,
        reply: &HttpReply,
        code: Option<&str>,
        message: &str,
    ) -> CallReply {
        self.classify_or(reply, code, message, || classify_status(reply))
    }

    /// Like [`classify`](Self::classify), with `otherwise` reading what the table does not
    /// cover (instead of [`classify_status`]).
    pub(crate) fn classify_or(
        &self,
        reply: &HttpReply,
        code: Option<&str>,
        message: &str,
        otherwise: impl FnOnce() -> CallReply,
    ) -> CallReply {
        let status = reply.status;
        match status {
            200..=299 => self.succeeded(reply, false),
            401 | 403 => {
                let answered = match code {
                    Some(code) => format!("{status} {code}"),
                    None => status.to_string(),
                };
                CallReply::Retryable {
                    reason: format!(
                        "{} refused the {} ({answered}), nothing was {}: {message}",
                        self.provider, self.credential, self.effect
                    ),
                    retry_after: None,
                }
            }
            409 if self.in_flight_on_409 => CallReply::InFlight {
                retry_after: reply.retry_after(),
            },
            s if (self.rejects)(s) => self.rejected(reply),
            _ => otherwise(),
        }
    }
}
