//! The RabbitMQ loop (feature `rabbitmq`, through `lapin`, re-exported as [`lapin`] in the
//! rustls build the crate uses): [`consume`] takes a queue's deliveries on a channel of its own,
//! hands each to [`Consumer::handle`], and acknowledges, requeues or dead-letters it as its
//! [`Disposition`] says.
//!
//! ```no_run
//! # async fn example(consumer: idemflow::consumer::Consumer) -> Result<(), Box<dyn std::error::Error>> {
//! use idemflow::consumer::amqp::{self, lapin};
//!
//! let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
//! let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
//! let consumer = consumer.dead_letter("receipts.dead"); // an exchange that exists
//! amqp::consume(&consumer, &connection, "receipts", async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```
//!
//! - **Refused messages** go to the exchange [`Consumer::dead_letter`] names (the queue's own
//!   `x-dead-letter-exchange`, typically): the loop publishes the message there with its
//!   properties and headers, its routing key, and the refusal's reason in
//!   [`REFUSED_HEADER`] (and the queue's name in `x-idemflow-queue`),
//!   waits for the broker's confirm, and only then acknowledges it. An exchange that routes it
//!   nowhere (no queue bound) or a failed publish leaves the message for redelivery, logged at
//!   `ERROR`: it is never acknowledged without a copy somewhere. At start the loop checks with
//!   a passive declare that the exchange exists, and does not start otherwise
//!   ([`ConsumerError::NoDeadLetter`]). With [`Consumer::drop_refused`], a refused message is
//!   rejected without requeue instead (the queue's own dead-letter exchange, if any, gets it
//!   without the reason).
//! - **Delays.** AMQP has no delayed requeue, so a delivery to be redelivered after a delay is
//!   held (unacked) for that delay and then `basic.nack`ed with requeue: the broker puts it back
//!   and delivers it at once. Holding it keeps the loop from spinning on a key that is in flight
//!   or unknown; it also takes one prefetch slot ([`Consumer::concurrency`]) for the delay. A
//!   message that always fails is redelivered for ever, one attempt per
//!   [`Consumer::retry_after`]: bound it with the queue's own delivery limit (a quorum queue's
//!   `x-delivery-limit`, with a dead-letter exchange).
//! - **Recovery.** The loop runs the consumer's in-process sweeper ([`Consumer::sweeper`]) until
//!   it stops. If the process dies, its channel closes and RabbitMQ requeues every delivery it
//!   had not acknowledged; the key of a run it had started waits out its lease, and a peer's
//!   sweeper settles it (see the module [`consumer`](super)).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Confirmation, Connection, ExchangeKind, message::Delivery};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// The `lapin` crate the loop is built on (rustls with ring: no OpenSSL, no cmake).
pub use lapin;

use super::{Consumer, ConsumerError, Disposition, Message, REFUSED_HEADER};

const BROKER: &str = "rabbitmq";

/// The header a dead-lettered message names its queue in.
pub const QUEUE_HEADER: &str = "x-idemflow-queue";

/// What [`ConsumerError::NoDeadLetter`] advises on RabbitMQ.
const HOW: &str = "Declare a dead-letter exchange with a queue bound to it (the queue's own \
                   x-dead-letter-exchange is the usual one) and name it with \
                   Consumer::dead_letter(\"<exchange>\"), or accept losing refused messages \
                   with Consumer::drop_refused()";

static TAGS: AtomicU64 = AtomicU64::new(0);

/// Consumes `queue` on a channel of its own over `connection` until `shutdown` completes (or
/// the broker cancels the consumer), handling up to [`Consumer::concurrency`] deliveries at once
/// (the channel's prefetch count is set to it), and runs the consumer's in-process sweeper
/// meanwhile. On shutdown it stops taking deliveries, cuts short the delays of those it holds
/// for redelivery (they are requeued at once), waits for the runs under way and the sweeper,
/// closes its channels, and returns; deliveries prefetched and not yet taken are requeued by
/// the broker when the channel closes.
///
/// It does not start ([`ConsumerError::NoDeadLetter`]) without [`Consumer::dead_letter`]
/// naming an exchange that exists, or [`Consumer::drop_refused`]. An error of the channel (it
/// closed, the queue is gone) ends the loop with [`ConsumerError::Broker`], after the runs under
/// way have finished.
pub async fn consume(
    consumer: &Consumer,
    connection: &Connection,
    queue: &str,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConsumerError> {
    let broker = |e: lapin::Error| ConsumerError::broker(BROKER, e);
    let dead_letters = match consumer.refusal_target(BROKER, HOW)? {
        Some(exchange) => Some(Arc::new(
            DeadLetters::open(connection, exchange, queue).await?,
        )),
        None => None,
    };
    let channel = connection.create_channel().await.map_err(broker)?;
    let ended = consume_on(consumer, &channel, queue, dead_letters.clone(), shutdown).await;
    let _ = channel.close(200, "consumer stopped".into()).await;
    if let Some(dead_letters) = dead_letters {
        let _ = dead_letters
            .channel
            .close(200, "consumer stopped".into())
            .await;
    }
    ended
}

async fn consume_on(
    consumer: &Consumer,
    channel: &Channel,
    queue: &str,
    dead_letters: Option<Arc<DeadLetters>>,
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
    let sweeping = super::spawn_sweeper(consumer, stopping.clone());
    let mut runs = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let queue: Arc<str> = Arc::from(queue);
    let ended = loop {
        tokio::select! {
            () = &mut shutdown => break Ok(()),
            next = deliveries.next() => match next {
                Some(Ok(delivery)) => {
                    let refused = Refused {
                        dead_letters: dead_letters.clone(),
                        queue: queue.clone(),
                    };
                    runs.spawn(settle(consumer.clone(), delivery, stopping.clone(), refused));
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
    if let Some(sweeping) = sweeping {
        let _ = sweeping.await;
    }
    ended
}

/// Where a delivery's refusal goes: the dead-letter exchange (or none: dropped), and the queue
/// it came from.
struct Refused {
    dead_letters: Option<Arc<DeadLetters>>,
    queue: Arc<str>,
}

/// The dead-letter exchange, and a channel in confirm mode to publish to it.
struct DeadLetters {
    channel: Channel,
    exchange: String,
}

impl DeadLetters {
    /// Checks that `exchange` exists (a passive declare, on a channel of its own: a missing
    /// exchange closes the channel it was declared on) and opens the publishing channel.
    async fn open(
        connection: &Connection,
        exchange: &str,
        queue: &str,
    ) -> Result<Self, ConsumerError> {
        let broker = |e: lapin::Error| ConsumerError::broker(BROKER, e);
        let check = connection.create_channel().await.map_err(broker)?;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let declared = check
            .exchange_declare(
                exchange.into(),
                ExchangeKind::Fanout,
                passive,
                FieldTable::default(),
            )
            .await;
        if let Err(e) = declared {
            return Err(ConsumerError::NoDeadLetter {
                broker: BROKER,
                problem: format!(
                    "the dead-letter exchange {exchange:?} of queue {queue:?} does not exist ({e})"
                ),
                how: HOW,
            });
        }
        let _ = check.close(200, "checked".into()).await;
        let channel = connection.create_channel().await.map_err(broker)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker)?;
        Ok(Self {
            channel,
            exchange: exchange.to_owned(),
        })
    }

    /// Publishes `delivery` (its body `body`) to the exchange with the refusal's `reason`, and
    /// waits for the broker's confirm; an error says why it is not there.
    async fn publish(
        &self,
        delivery: &Delivery,
        body: &[u8],
        reason: &str,
        queue: &str,
    ) -> Result<(), String> {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(
            REFUSED_HEADER.into(),
            AMQPValue::LongString(LongString::from(reason.to_owned())),
        );
        headers.insert(
            QUEUE_HEADER.into(),
            AMQPValue::LongString(LongString::from(queue.to_owned())),
        );
        let properties = delivery.properties.clone().with_headers(headers);
        let mandatory = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let confirm = self
            .channel
            .basic_publish(
                self.exchange.as_str().into(),
                delivery.routing_key.clone(),
                mandatory,
                body,
                properties,
            )
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(format!(
                "the exchange {:?} routed it to no queue (routing key {:?})",
                self.exchange, delivery.routing_key
            )),
            Confirmation::Nack(_) => Err("the broker did not take it (nack)".to_owned()),
            Confirmation::NotRequested => Err("the broker did not confirm it".to_owned()),
        }
    }
}

/// Handles one delivery and acknowledges, requeues or dead-letters it.
async fn settle(
    consumer: Consumer,
    delivery: Delivery,
    mut stopping: watch::Receiver<bool>,
    refused: Refused,
) {
    let requeue = BasicNackOptions {
        multiple: false,
        requeue: true,
    };
    let answered = match consumer.handle(message_of(&delivery)).await {
        Disposition::Ack { .. } => delivery.acker.ack(BasicAckOptions::default()).await,
        Disposition::Redeliver { after, .. } => {
            // Held for the delay (cut short on shutdown), then requeued.
            let _ = tokio::time::timeout(after, stopping.wait_for(|stop| *stop)).await;
            delivery.acker.nack(requeue).await
        }
        Disposition::Reject(error) => match &refused.dead_letters {
            Some(dead_letters) => {
                let reason = error.to_string();
                match dead_letters
                    .publish(&delivery, &delivery.data, &reason, &refused.queue)
                    .await
                {
                    Ok(()) => {
                        consumer.refused(true, &error);
                        delivery.acker.ack(BasicAckOptions::default()).await
                    }
                    Err(e) => {
                        consumer.dead_letter_failed(&dead_letters.exchange, &e);
                        let after = consumer.retry_delay();
                        let _ = tokio::time::timeout(after, stopping.wait_for(|stop| *stop)).await;
                        delivery.acker.nack(requeue).await
                    }
                }
            }
            None => {
                consumer.refused(false, &error);
                let reject = BasicRejectOptions { requeue: false };
                delivery.acker.reject(reject).await
            }
        },
    };
    if let Err(e) = answered {
        // The channel is gone: the broker requeues the delivery itself.
        tracing::warn!(error = %e, "answering an AMQP delivery failed; the broker will redeliver it");
    }
}

/// The message of a delivery: its `message-id`, its string and integer headers, and its body.
fn message_of(delivery: &Delivery) -> Message {
    let props = &delivery.properties;
    let mut message = Message::new(delivery.data.clone()).redelivered(delivery.redelivered);
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
