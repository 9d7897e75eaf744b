//! The RabbitMQ loop (feature `rabbitmq`, through `lapin`): [`consume`] takes a queue's
//! deliveries on a channel, hands each to [`Consumer::handle`], and acknowledges, requeues or
//! rejects it as its [`Disposition`] says.
//!
//! AMQP has no delayed requeue, so a delivery to be redelivered after a delay is held (unacked)
//! for that delay and then `basic.nack`ed with requeue: the broker puts it back and delivers it
//! at once. Holding it keeps the loop from spinning on a key that is in flight or unknown; it
//! also takes one prefetch slot ([`Consumer::concurrency`]) for the delay. A message that
//! always fails is redelivered for ever, one attempt per [`Consumer::retry_after`]: bound it
//! with the queue's own delivery limit (a quorum queue's `x-delivery-limit`, with a dead-letter
//! exchange).
//!
//! If the process dies, its channel closes and RabbitMQ requeues every delivery it had not
//! acknowledged; the key of a run it had started waits out its lease (see the module
//! [`consumer`](super)).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, message::Delivery};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::{Consumer, ConsumerError, Disposition, Message};

const BROKER: &str = "rabbitmq";

static TAGS: AtomicU64 = AtomicU64::new(0);

/// Consumes `queue` on `channel` until `shutdown` completes (or the broker cancels the
/// consumer), handling up to [`Consumer::concurrency`] deliveries at once (the channel's
/// prefetch count is set to it). On shutdown it stops taking deliveries, cuts short the delays
/// of those it holds for redelivery (they are requeued at once), waits for the runs under way,
/// and returns; deliveries prefetched and not yet taken are requeued by the broker when the
/// channel closes.
///
/// An error of the channel (it closed, the queue is gone) ends the loop with
/// [`ConsumerError::Broker`], after the runs under way have finished.
pub async fn consume(
    consumer: &Consumer,
    channel: &Channel,
    queue: &str,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConsumerError> {
    let broker = |e: lapin::Error| ConsumerError::broker(BROKER, e);
    // At most `MAX_CONCURRENCY`, which is `u16::MAX`.
    let prefetch = u16::try_from(consumer.concurrency_limit()).unwrap_or(u16::MAX);
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .map_err(broker)?;
    let tag = format!(
        "idemflow-{}-{}",
        std::process::id(),
        TAGS.fetch_add(1, Ordering::Relaxed)
    );
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(broker)?;
    let (stop, stopping) = watch::channel(false);
    let mut runs = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let ended = loop {
        tokio::select! {
            () = &mut shutdown => break Ok(()),
            next = deliveries.next() => match next {
                Some(Ok(delivery)) => {
                    runs.spawn(settle(consumer.clone(), delivery, stopping.clone()));
                }
                Some(Err(e)) => break Err(broker(e)),
                None => break Ok(()),
            },
            Some(_) = runs.join_next(), if !runs.is_empty() => {}
        }
    };
    if let Err(e) = channel
        .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
        .await
    {
        tracing::debug!(error = %e, "cancelling the AMQP consumer failed (the channel is closing)");
    }
    let _ = stop.send(true);
    while runs.join_next().await.is_some() {}
    ended
}

/// Handles one delivery and acknowledges, requeues or rejects it.
async fn settle(consumer: Consumer, mut delivery: Delivery, mut stopping: watch::Receiver<bool>) {
    let message = message_of(&mut delivery);
    let answered = match consumer.handle(message).await {
        Disposition::Ack { .. } => delivery.acker.ack(BasicAckOptions::default()).await,
        Disposition::Redeliver { after, .. } => {
            // Held for the delay (cut short on shutdown), then requeued.
            let _ = tokio::time::timeout(after, stopping.wait_for(|stop| *stop)).await;
            let requeue = BasicNackOptions {
                multiple: false,
                requeue: true,
            };
            delivery.acker.nack(requeue).await
        }
        Disposition::Reject(_) => {
            let reject = BasicRejectOptions { requeue: false };
            delivery.acker.reject(reject).await
        }
    };
    if let Err(e) = answered {
        // The channel is gone: the broker requeues the delivery itself.
        tracing::warn!(error = %e, "answering an AMQP delivery failed; the broker will redeliver it");
    }
}

/// The message of a delivery: its `message-id`, its string and integer headers, and its body
/// (moved out of the delivery).
fn message_of(delivery: &mut Delivery) -> Message {
    let props = &delivery.properties;
    let mut message =
        Message::new(std::mem::take(&mut delivery.data)).redelivered(delivery.redelivered);
    if let Some(id) = props.message_id() {
        message = message.with_message_id(id.as_str());
    }
    if let Some(headers) = props.headers() {
        for (name, value) in headers.inner() {
            if let Some(value) = header_text(value) {
                message = message.with_header(name.as_str(), value);
            }
        }
    }
    message
}

/// A header's value as text: strings (valid UTF-8) and integers; other kinds are left out.
fn header_text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::ShortShortInt(n) => Some(n.to_string()),
        AMQPValue::ShortShortUInt(n) => Some(n.to_string()),
        AMQPValue::ShortInt(n) => Some(n.to_string()),
        AMQPValue::ShortUInt(n) => Some(n.to_string()),
        AMQPValue::LongInt(n) => Some(n.to_string()),
        AMQPValue::LongUInt(n) => Some(n.to_string()),
        AMQPValue::LongLongInt(n) => Some(n.to_string()),
        _ => None,
    }
}
