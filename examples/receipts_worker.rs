//! A RabbitMQ receipts worker: each message `{"order_id": .., "email": ..}` sends one receipt
//! email through Resend, however often it is published or delivered, with its keys on
//! `DATABASE_URL`. Run several against one queue and one database; kill any of them mid-send.
//!
//! ```text
//! AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f   # default
//! QUEUE=receipts                                   # default
//! DEAD_LETTER_EXCHANGE=receipts.dead               # default: <QUEUE>.dead
//! RESEND_API_KEY=re_...                            # required
//! RESEND_API_BASE=https://api.resend.com           # default
//! RECEIPT_FROM=receipts@example.com                # default
//! DATABASE_URL=sqlite://receipts_worker.db         # default; or postgres://, mysql://, redis://
//! cargo run --example receipts_worker --features rabbitmq,http
//! ```
//!
//! - **One email per order.** A message's key is its `order_id`, and its fingerprint covers
//!   `/order_id` and `/email` only, in canonical JSON: a copy its publisher encoded again is
//!   the same message, acknowledged without sending. The email goes through
//!   `Consumer::sending`, under a provider key derived from the order, which Resend dedupes
//!   for 24 h.
//! - **Nothing dropped.** A message without `order_id`, or reusing one with another email, is
//!   published to the dead-letter exchange with the reason in its `x-idemflow-refused` header,
//!   then acknowledged. A queue that does not exist is declared with a dead-letter exchange
//!   and queue of its own (`<QUEUE>.dead`, fanout, durable). A queue that exists is used as it
//!   is declared (a passive declare): name its dead-letter exchange in
//!   `DEAD_LETTER_EXCHANGE`; the worker does not start if that exchange does not exist.
//! - **A worker killed mid-send** leaves its key `processing`. RabbitMQ gives the message to a
//!   peer, which holds it while the key is in flight; the peers' in-process sweepers re-send the
//!   stored email under the same key once the dead worker's lease (6 s) has run out, Resend
//!   replays its first answer, and the message is acknowledged. No cron job is needed.
//! - **SIGTERM or Ctrl-C drains**: the worker stops taking messages, finishes those under
//!   way, and exits.
//!
//! `tests/consumers/receipts.rs` runs three of these against RabbitMQ and the testkit's fake
//! Resend, and kills one mid-send.

// The tests include this file as a module (`tests/consumers/receipts.rs`), where `main` is
// unused.
#![allow(dead_code)]

use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;

use idemflow::consumer::amqp::{self, lapin};
use idemflow::consumer::{Consumer, ConsumerStats, FingerprintSource, KeySource, Message};
use idemflow::error::BoxError;
use idemflow::provider::Resend;
use idemflow::{Idempotency, Provider, key::Scope};
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use serde_json::{Value, json};

/// The worker's settings (see the module docs for their environment variables).
#[derive(Clone)]
pub struct Config {
    /// `AMQP_URL`.
    pub amqp_url: String,
    /// `QUEUE`.
    pub queue: String,
    /// `DEAD_LETTER_EXCHANGE`.
    pub dead_letter_exchange: String,
    /// `RESEND_API_BASE`.
    pub resend_api_base: String,
    /// `RESEND_API_KEY`.
    pub resend_api_key: String,
    /// `RECEIPT_FROM`.
    pub from: String,
    /// `DATABASE_URL`.
    pub database_url: String,
}

impl Config {
    /// The settings from the environment; an error names a missing one.
    pub fn from_env() -> Result<Self, String> {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
        let queue = var("QUEUE", "receipts");
        Ok(Self {
            amqp_url: var("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
            dead_letter_exchange: var("DEAD_LETTER_EXCHANGE", &format!("{queue}.dead")),
            queue,
            resend_api_base: var(
                "RESEND_API_BASE",
                idemflow::provider::resend::DEFAULT_BASE_URL,
            ),
            resend_api_key: std::env::var("RESEND_API_KEY")
                .map_err(|_| "RESEND_API_KEY is not set".to_owned())?,
            from: var("RECEIPT_FROM", "receipts@example.com"),
            database_url: var("DATABASE_URL", "sqlite://receipts_worker.db"),
        })
    }
}

/// The receipt email of `message`: Resend's request body. A message without a numeric or
/// string `order_id`, or without an `email`, has none (it is dead-lettered).
pub fn receipt_email(from: &str, message: &Message) -> Result<Value, BoxError> {
    let receipt: Value = message.json()?;
    let order = match &receipt["order_id"] {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        _ => return Err("no order_id".into()),
    };
    let to = receipt["email"].as_str().ok_or("no email")?;
    tracing::info!(order_id = %order, to, "sending a receipt");
    Ok(json!({
        "from": from,
        "to": [to],
        "subject": format!("Your receipt for order {order}"),
        "text": format!("Thank you for your order {order}."),
    }))
}

/// The queue's consumer: keyed by `order_id`, fingerprinted by `/order_id` and `/email`,
/// sending each receipt through `resend`, refusals to `config.dead_letter_exchange`.
pub fn receipts_consumer(
    idem: Idempotency,
    resend: Arc<dyn Provider>,
    config: &Config,
) -> Result<Consumer, BoxError> {
    let from = config.from.clone();
    let scope = Scope::new(format!("queue:{}", config.queue))?;
    Ok(Consumer::sending(idem, scope, resend, move |m: &Message| {
        receipt_email(&from, m)
    })
    .key(KeySource::JsonField("order_id".into()))
    .fingerprint(FingerprintSource::JsonPointers(vec![
        "/order_id".into(),
        "/email".into(),
    ]))
    .dead_letter(config.dead_letter_exchange.clone()))
}

/// Uses `queue` as it is declared when it exists; otherwise declares it durable, with a
/// dead-letter exchange `dead` (fanout) and a queue `dead` bound to it.
pub async fn declare(connection: &Connection, queue: &str, dead: &str) -> lapin::Result<()> {
    let channel = connection.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    if channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .is_ok()
    {
        let _ = channel.close(200, "declared".into()).await;
        return Ok(());
    }
    // The passive declare of a missing queue closed its channel.
    let channel = connection.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let exchange = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            dead.into(),
            ExchangeKind::Fanout,
            exchange,
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_declare(dead.into(), durable, FieldTable::default())
        .await?;
    channel
        .queue_bind(
            dead.into(),
            dead.into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from(dead.to_owned())),
    );
    channel
        .queue_declare(queue.into(), durable, arguments)
        .await?;
    let _ = channel.close(200, "declared".into()).await;
    Ok(())
}

/// Runs the worker until `shutdown` completes, then drains; the deliveries it disposed of.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<ConsumerStats, BoxError> {
    let store = idemflow::store::connect(&config.database_url).await?;
    store.migrate().await?;
    let idem = Idempotency::new(store);
    let resend = Arc::new(Resend::with_base_url(
        &config.resend_api_base,
        config.resend_api_key.clone(),
    )?);
    let connection = Connection::connect(&config.amqp_url, ConnectionProperties::default()).await?;
    declare(&connection, &config.queue, &config.dead_letter_exchange).await?;
    let consumer = receipts_consumer(idem, resend, &config)?;
    tracing::info!(queue = %config.queue, "consuming");
    amqp::consume(&consumer, &connection, &config.queue, shutdown).await?;
    let _ = connection.close(200, "worker stopped".into()).await;
    Ok(consumer.stats())
}

/// Completes on SIGTERM or Ctrl-C.
pub async fn terminated() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().with_target(false).init();
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("receipts_worker: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(config, terminated()).await {
        Ok(stats) => {
            eprintln!("receipts_worker: drained: {stats:?}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("receipts_worker: {e}");
            ExitCode::FAILURE
        }
    }
}
