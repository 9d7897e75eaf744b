//! The scenarios on RabbitMQ (`IDEMFLOW_TEST_AMQP_URL`): a classic queue per test, publisher
//! confirms on, the message id in the `message-id` property; its dead-letter exchange
//! (`<queue>.dead`, fanout) and the queue bound to it (`<queue>.dead`).

use idemflow::consumer::amqp::lapin;
use idemflow::consumer::{Consumer, REFUSED_HEADER, amqp};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use crate::scenarios::{self, Broker, Running, connect_within};
use crate::support::fresh_name;

const VAR: &str = "IDEMFLOW_TEST_AMQP_URL";

pub struct Amqp {
    url: String,
    queue: String,
    connection: std::sync::Arc<Connection>,
    channel: Channel,
}

async fn connect(url: String) -> lapin::Result<Connection> {
    Connection::connect(&url, ConnectionProperties::default()).await
}

impl Amqp {
    /// A fresh queue on the broker at [`VAR`]; `None` (skipped) without one.
    async fn fresh() -> Option<Self> {
        let (url, connection) = scenarios::reach("RabbitMQ", VAR, connect).await?;
        let broker = Self::on(connection, &url, &fresh_name()).await;
        let declare = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let channel = &broker.channel;
        let dead = broker.dead_letter_target();
        channel
            .queue_declare(broker.queue.as_str().into(), declare, FieldTable::default())
            .await
            .unwrap();
        channel
            .exchange_declare(
                dead.as_str().into(),
                ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_declare(dead.as_str().into(), declare, FieldTable::default())
            .await
            .unwrap();
        channel
            .queue_bind(
                dead.as_str().into(),
                dead.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        Some(broker)
    }

    /// The queue `queue` of the broker at `url` (the kill test's child).
    pub async fn attach(url: &str, queue: &str) -> Self {
        let connection = connect_within(connect(url.to_owned())).await.unwrap();
        Self::on(connection, url, queue).await
    }

    async fn on(connection: Connection, url: &str, queue: &str) -> Self {
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        Self {
            url: url.to_owned(),
            queue: queue.to_owned(),
            connection: std::sync::Arc::new(connection),
            channel,
        }
    }
}

impl Broker for Amqp {
    async fn publish(&self, id: &str, body: &[u8]) -> bool {
        let mut props = BasicProperties::default();
        if !id.is_empty() {
            props = props.with_message_id(id.into());
        }
        self.channel
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        true
    }

    async fn start_as_is(&self, consumer: Consumer) -> Running {
        // The loop's channel closes when it ends, which requeues what it left unacked.
        let connection = self.connection.clone();
        let queue = self.queue.clone();
        Running::spawn(move |shutdown| async move {
            amqp::consume(&consumer, &connection, &queue, shutdown).await
        })
    }

    fn dead_letter_target(&self) -> String {
        format!("{}.dead", self.queue)
    }

    async fn dead_letters(&self) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        let queue = self.dead_letter_target();
        while let Some(message) = self
            .channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let reason = message
                .delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(REFUSED_HEADER).cloned());
            let reason = match reason {
                Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into(),
                other => format!("no reason header: {other:?}"),
            };
            out.push((reason, message.delivery.data.clone()));
        }
        out
    }

    async fn unacked(&self) -> u64 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let queue = self
            .channel
            .queue_declare(self.queue.as_str().into(), passive, FieldTable::default())
            .await
            .unwrap();
        // Every loop has stopped and closed its channel: nothing is delivered and unacked.
        u64::from(queue.message_count())
    }

    fn spec(&self) -> String {
        format!("amqp {} {}", self.url, self.queue)
    }

    async fn delete(self) {
        let dead = self.dead_letter_target();
        for queue in [self.queue.as_str(), dead.as_str()] {
            self.channel
                .queue_delete(queue.into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
        self.channel
            .exchange_delete(dead.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
        let _ = self.connection.close(200, "done".into()).await;
    }
}

scenarios::scenario_tests!(Amqp);
