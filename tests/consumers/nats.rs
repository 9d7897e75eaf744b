//! The scenarios on NATS JetStream (`IDEMFLOW_TEST_NATS_URL`): a stream per test (one subject,
//! the server's shortest duplicate window, [`DUPLICATE_WINDOW`], so that the duplicates the
//! tests publish later than that reach the consumer), and one durable pull consumer on it
//! (`ack_wait` 2 s), shared by every loop of the test; a dead-letter stream of its own
//! (`<stream>_dead`, capturing `<stream>.dead`).

use std::time::Duration;

use idemflow::consumer::nats::async_nats;
use idemflow::consumer::{Consumer, REFUSED_HEADER, nats};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, stream};

use crate::scenarios::{self, Broker, Running, connect_within};
use crate::support::fresh_name;

const VAR: &str = "IDEMFLOW_TEST_NATS_URL";
/// JetStream drops a publish whose `Nats-Msg-Id` it saw this recently; 100 ms is the least
/// the server accepts. The scenarios publish their duplicates later than
/// `scenarios::PUBLISH_GAP` after the original.
const DUPLICATE_WINDOW: Duration = Duration::from_millis(100);
/// The durable consumer's name.
const DURABLE: &str = "worker";

pub struct Nats {
    url: String,
    stream: String,
    js: jetstream::Context,
}

async fn connect(url: String) -> Result<async_nats::Client, async_nats::ConnectError> {
    async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .retry_on_initial_connect()
        .connect(url)
        .await
}

impl Nats {
    /// A fresh stream and durable consumer on the server at [`VAR`]; `None` (skipped) without
    /// one.
    async fn fresh() -> Option<Self> {
        let (url, client) = scenarios::reach("NATS", VAR, connect).await?;
        let name = fresh_name();
        let js = jetstream::new(client);
        let created = js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.in")],
                duplicate_window: DUPLICATE_WINDOW,
                ..stream::Config::default()
            })
            .await;
        created.unwrap();
        js.create_stream(stream::Config {
            name: format!("{name}_dead"),
            subjects: vec![format!("{name}.dead")],
            ..stream::Config::default()
        })
        .await
        .unwrap();
        js.create_consumer_on_stream(
            pull::Config {
                durable_name: Some(DURABLE.to_owned()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_secs(2),
                ..pull::Config::default()
            },
            &name,
        )
        .await
        .unwrap();
        Some(Self {
            url,
            stream: name,
            js,
        })
    }

    /// The stream `stream` of the server at `url` (the kill test's child).
    pub async fn attach(url: &str, stream: &str) -> Self {
        Self {
            url: url.to_owned(),
            stream: stream.to_owned(),
            js: jetstream::new(connect_within(connect(url.to_owned())).await.unwrap()),
        }
    }

    async fn durable(&self) -> jetstream::consumer::PullConsumer {
        self.js
            .get_consumer_from_stream(DURABLE, &self.stream)
            .await
            .unwrap()
    }
}

impl Broker for Nats {
    async fn publish(&self, id: &str, body: &[u8]) -> bool {
        let mut headers = HeaderMap::new();
        if !id.is_empty() {
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
        }
        let ack = self
            .js
            .publish_with_headers(format!("{}.in", self.stream), headers, body.to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
        !ack.duplicate
    }

    async fn start_as_is(&self, consumer: Consumer) -> Running {
        let pull = self.durable().await;
        let js = self.js.clone();
        Running::spawn(move |shutdown| async move {
            nats::consume(&consumer, &js, &pull, shutdown).await
        })
    }

    fn dead_letter_target(&self) -> String {
        format!("{}.dead", self.stream)
    }

    async fn dead_letters(&self) -> Vec<(String, Vec<u8>)> {
        let dead = self
            .js
            .get_stream(format!("{}_dead", self.stream))
            .await
            .unwrap();
        let mut out = Vec::new();
        for seq in 1.. {
            let Ok(message) = dead.get_raw_message(seq).await else {
                break;
            };
            let reason = message
                .headers
                .get(REFUSED_HEADER)
                .map_or_else(|| "no reason header".to_owned(), |v| v.to_string());
            out.push((reason, message.payload.to_vec()));
        }
        out
    }

    async fn unacked(&self) -> u64 {
        let mut pull = self.durable().await;
        let info = pull.info().await.unwrap();
        info.num_pending + info.num_ack_pending as u64
    }

    fn spec(&self) -> String {
        format!("nats {} {}", self.url, self.stream)
    }

    async fn delete(self) {
        self.js.delete_stream(&self.stream).await.unwrap();
        self.js
            .delete_stream(format!("{}_dead", self.stream))
            .await
            .unwrap();
    }
}

scenarios::scenario_tests!(Nats);
