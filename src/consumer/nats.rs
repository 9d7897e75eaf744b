//! The NATS JetStream loop (feature `nats`, through `async-nats`): [`consume`] pulls a
//! consumer's messages, hands each to [`Consumer::handle`], and acknowledges, naks or
//! terminates it as its [`Disposition`] says.
//!
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
//! - A message without a usable key is terminated (`Term`): never redelivered.
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
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{Consumer, ConsumerError, Disposition, Message};

const BROKER: &str = "nats";

/// The `Progress` period when the consumer's `ack_wait` is unknown (zero): a third of
/// JetStream's default of 30 s.
const DEFAULT_PROGRESS: Duration = Duration::from_secs(10);

/// Consumes `pull`'s messages until `shutdown` completes, handling up to
/// [`Consumer::concurrency`] at once (also the pull batch). On shutdown it stops pulling, waits
/// for the runs under way, and returns; messages pulled and not yet handled are redelivered by
/// the server after `ack_wait`.
///
/// A missed heartbeat or a failed pull is logged and the loop pulls on; any other error of the
/// message stream (the consumer was deleted, the pull refused) ends the loop with [`ConsumerError::Broker`], after the runs under way have finished.
pub async fn consume(
    consumer: &Consumer,
    pull: &PullConsumer,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConsumerError> {
    let broker = |e: async_nats::Error| ConsumerError::broker(BROKER, e);
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
                    runs.spawn(async move {
                        settle(consumer, message, progress).await;
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
    ended
}

/// Handles one message (sending `Progress` while it runs) and acks, naks or terminates it.
async fn settle(consumer: Consumer, message: jetstream::Message, progress: Duration) {
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
        Disposition::Reject(_) => message.ack_with(AckKind::Term).await,
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
