//! The scenarios on RabbitMQ (`IDEMFLOW_TEST_AMQP_URL`): a classic queue per test, publisher
//! confirms on, the message id in the `message-id` property.

use idemflow::consumer::{Consumer, amqp};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::scenarios::{self, Broker, Running, connect_within};
use crate::support::fresh_name;

const VAR: &str = "IDEMFLOW_TEST_AMQP_URL";

pub struct Amqp {
    url: String,
    queue: String,
    connection: Connection,
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
        broker
            .channel
            .queue_declare(broker.queue.as_str().into(), declare, FieldTable::default())
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
            connection,
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

    async fn start(&self, consumer: Consumer) -> Running {
        // A channel per loop: closing it (when the loop ends) requeues what it left unacked.
        let channel = self.connection.create_channel().await.unwrap();
        let queue = self.queue.clone();
        Running::spawn(move |shutdown| async move {
            let ended = amqp::consume(&consumer, &channel, &queue, shutdown).await;
            let _ = channel.close(200, "done".into()).await;
            ended
        })
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
        self.channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        let _ = self.connection.close(200, "done".into()).await;
    }
}

scenarios::scenario_tests!(Amqp);
