//! The NATS JetStream loop (feature `nats`, through `async-nats`, re-exported as
//! [`async_nats`] in the build the crate uses): [`consume`] pulls a consumer's messages, hands
//! each to [`Consumer::handle`], and acknowledges, naks or dead-letters it as its
//! [`Disposition`] says.
//!
//! ```no_run
//! # async fn example(consumer: idemflow::consumer::Consumer) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use idemflow::consumer::nats::{self, async_nats};
//!
//! let jetstream = async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
//! let stream = jetstream.get_stream("RECEIPTS").await?;
//! let pull = stream.get_consumer("receipts-worker").await?;
//! // A subject another stream captures (here `RECEIPTS_DEAD`, with subjects `receipts-dead.>`).
//! let consumer = consumer.dead_letter("receipts-dead.refused");
//! nats::consume(&consumer, &jetstream, &pull, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```
//!
//! - A refused message is published to the subject [`Consumer::dead_letter`] names, with its
//!   headers and the refusal's reason in [`REFUSED_HEADER`] (and the
//!   stream's name in `x-idemflow-stream`); once the dead-letter stream has acknowledged the
//!   publish, the message is terminated (`Term`), never redelivered. A failed publish leaves it
//!   for redelivery (`Nak`), logged at `ERROR`. At start the loop checks that a stream captures
//!   the subject, and that it is not the consumed stream (which would deliver the dead letters
//!   back), and does not start otherwise ([`ConsumerError::NoDeadLetter`]). With
//!   [`Consumer::drop_refused`], a refused message is terminated without a copy.
//! - An acknowledgement is a double ack (`AckAck`: the server confirms it), so a message
//!   reported handled is not delivered again for want of an ack lost on the way.
//! - A message to be redelivered is `Nak`ed with the delay its disposition gives; the server
//!   holds it that long, so a key in flight or unknown is not retried in a hot loop. A message
//!   that always fails is redelivered up to the consumer's `max_deliver` (unlimited by default):
//!   set it to bound the attempts.
//! - While a handler runs, the loop sends `Progress` every third of the consumer's `ack_wait`,
//!   so a long run is not redelivered under it; if the process dies, the server redelivers the
//!   message once `ack_wait` has passed, and the key of the run waits out its lease (see the
//!   module [`consumer`](super)).
//! - The loop runs the consumer's in-process sweeper ([`Consumer::sweeper`]) until it stops.
//!
//! JetStream also drops a duplicate *publish* with the same `Nats-Msg-Id` inside the stream's
//! `duplicate_window` (2 minutes by default); the consumer's key covers what that window does
//! not: redeliveries, and duplicates published later.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::MessagesErrorKind;
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

/// The `async-nats` crate the loop is built on (with JetStream and ring).
pub use async_nats;

use super::{Consumer, ConsumerError, Disposition, Message, REFUSED_HEADER};

const BROKER: &str = "nats";

/// The header a dead-lettered message names its stream in.
pub const STREAM_HEADER: &str = "x-idemflow-stream";

/// What [`ConsumerError::NoDeadLetter`] advises on NATS.
const HOW: &str = "Create a stream that captures a dead-letter subject (not the consumed \
                   stream) and name the subject with Consumer::dead_letter(\"<subject>\"), or \
                   accept losing refused messages with Consumer::drop_refused()";

/// The `Progress` period when the consumer's `ack_wait` is unknown (zero): a third of
/// JetStream's default of 30 s.
const DEFAULT_PROGRESS: Duration = Duration::from_secs(10);

/// Consumes `pull`'s messages until `shutdown` completes, handling up to
/// [`Consumer::concurrency`] at once (also the pull batch), and runs the consumer's in-process
/// sweeper meanwhile; `jetstream` publishes the dead letters. On shutdown it stops pulling,
/// waits for the runs under way and the sweeper, and returns; messages pulled and not yet
/// handled are redelivered by the server after `ack_wait`.
///
/// It does not start ([`ConsumerError::NoDeadLetter`]) without [`Consumer::dead_letter`]
/// naming a subject another stream captures, or [`Consumer::drop_refused`]. A missed heartbeat
/// or a failed pull is logged and the loop pulls on; any other error of the message stream (the
/// consumer was deleted, the pull refused) ends the loop with [`ConsumerError::Broker`], after
/// the runs under way have finished.
pub async fn consume(
    consumer: &Consumer,
    jetstream: &jetstream::Context,
    pull: &PullConsumer,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConsumerError> {
    let broker = |e: async_nats::Error| ConsumerError::broker(BROKER, e);
    let stream = pull.cached_info().stream_name.clone();
    let dead_letters = match consumer.refusal_target(BROKER, HOW)? {
        Some(subject) => Some(DeadLetters::check(jetstream, subject, &stream).await?),
        None => None,
    };
    let limit = consumer.concurrency_limit();
    let ack_wait = pull.cached_info().config.ack_wait;
    let progress = match ack_wait / 3 {
        Duration::ZERO => DEFAULT_PROGRESS,
        period => period,
    };
    let mut messages = pull
        .stream()
        .max_messages_per_batch(limit)
        .messages()
        .await
        .map_err(|e| broker(e.into()))?;
    let (stop, stopping) = watch::channel(false);
    let sweeping = super::spawn_sweeper(consumer, stopping);
    let slots = Arc::new(Semaphore::new(limit));
    let mut runs = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let ended = loop {
        // A slot first, so that no message waits for one with its `ack_wait` running.
        let slot = tokio::select! {
            () = &mut shutdown => break Ok(()),
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break Ok(()),
            },
        };
        tokio::select! {
            () = &mut shutdown => break Ok(()),
            next = messages.next() => match next {
                Some(Ok(message)) => {
                    let consumer = consumer.clone();
                    let dead_letters = dead_letters.clone();
                    runs.spawn(async move {
                        settle(consumer, message, progress, dead_letters).await;
                        drop(slot);
                    });
                }
                // The stream goes on after a missed heartbeat or a failed pull (a blip of the
                // connection); not after the consumer is gone or refuses the pull.
                Some(Err(e)) if matches!(
                    e.kind(),
                    MessagesErrorKind::MissingHeartbeat
                        | MessagesErrorKind::Pull
                        | MessagesErrorKind::NoResponders
                ) => {
                    tracing::warn!(error = %e, "pulling NATS messages failed; pulling on");
                }
                Some(Err(e)) => break Err(broker(e.into())),
                None => break Ok(()),
            },
        }
        while runs.try_join_next().is_some() {}
    };
    while runs.join_next().await.is_some() {}
    let _ = stop.send(true);
    if let Some(sweeping) = sweeping {
        let _ = sweeping.await;
    }
    ended
}

/// The dead-letter subject, and where to publish it.
#[derive(Clone)]
struct DeadLetters {
    jetstream: jetstream::Context,
    subject: Arc<str>,
    stream: Arc<str>,
}

impl DeadLetters {
    /// Checks that a stream other than `consumed` captures `subject`.
    async fn check(
        jetstream: &jetstream::Context,
        subject: &str,
        consumed: &str,
    ) -> Result<Self, ConsumerError> {
        let missing = |problem: String| ConsumerError::NoDeadLetter {
            broker: BROKER,
            problem,
            how: HOW,
        };
        match jetstream.stream_by_subject(subject).await {
            Ok(stream) if stream == consumed => Err(missing(format!(
                "the dead-letter subject {subject:?} is captured by the consumed stream {consumed:?}, which would deliver the dead letters back"
            ))),
            Ok(_) => Ok(Self {
                jetstream: jetstream.clone(),
                subject: Arc::from(subject),
                stream: Arc::from(consumed),
            }),
            Err(e) => Err(missing(format!(
                "no stream captures the dead-letter subject {subject:?} ({e})"
            ))),
        }
    }

    /// Publishes `message` with the refusal's `reason` and waits for the stream's ack.
    async fn publish(&self, message: &jetstream::Message, reason: &str) -> Result<(), String> {
        let mut headers = message.headers.clone().unwrap_or_default();
        headers.insert(REFUSED_HEADER, reason);
        headers.insert(STREAM_HEADER, &*self.stream);
        self.jetstream
            .publish_with_headers(self.subject.to_string(), headers, message.payload.clone())
            .await
            .map_err(|e| e.to_string())?
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// Handles one message (sending `Progress` while it runs) and acks, naks or dead-letters it.
async fn settle(
    consumer: Consumer,
    message: jetstream::Message,
    progress: Duration,
    dead_letters: Option<DeadLetters>,
) {
    let mut handled = std::pin::pin!(consumer.handle(message_of(&message)));
    let disposition = loop {
        match tokio::time::timeout(progress, &mut handled).await {
            Ok(disposition) => break disposition,
            Err(_) => {
                if let Err(e) = message.ack_with(AckKind::Progress).await {
                    tracing::debug!(error = %e, "sending Progress for a NATS message failed");
                }
            }
        }
    };
    let answered = match disposition {
        Disposition::Ack { .. } => message.double_ack().await,
        Disposition::Redeliver { after, .. } => message.ack_with(AckKind::Nak(Some(after))).await,
        Disposition::Reject(error) => match &dead_letters {
            Some(dead_letters) => match dead_letters.publish(&message, &error.to_string()).await {
                Ok(()) => {
                    consumer.refused(true, &error);
                    message.ack_with(AckKind::Term).await
                }
                Err(e) => {
                    consumer.dead_letter_failed(&dead_letters.subject, &e);
                    message
                        .ack_with(AckKind::Nak(Some(consumer.retry_delay())))
                        .await
                }
            },
            None => {
                consumer.refused(false, &error);
                message.ack_with(AckKind::Term).await
            }
        },
    };
    if let Err(e) = answered {
        tracing::warn!(error = %e, "answering a NATS message failed; the server will redeliver it after ack_wait");
    }
}

/// The message of a JetStream delivery: `Nats-Msg-Id` as its id, its headers (first value of
/// each), its payload; redelivered when delivered more than once.
fn message_of(delivered: &jetstream::Message) -> Message {
    let redelivered = delivered.info().is_ok_and(|info| info.delivered > 1);
    let mut message = Message::new(delivered.payload.to_vec()).redelivered(redelivered);
    if let Some(headers) = &delivered.headers {
        if let Some(id) = headers.get(async_nats::header::NATS_MESSAGE_ID) {
            message = message.with_message_id(id.as_str());
        }
        for (name, values) in headers.iter() {
            if let Some(value) = values.first() {
                message = message.with_header(name.as_ref() as &str, value.as_str());
            }
        }
    }
    message
}
