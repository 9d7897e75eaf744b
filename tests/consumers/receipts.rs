//! `examples/receipts_worker.rs` against RabbitMQ (`IDEMFLOW_TEST_AMQP_URL`) and the testkit's
//! fake Resend: three worker processes (this binary, re-run as `child_runs_the_receipts_worker`)
//! on one queue, which none of them finds declared, and one SQLite database. The first send is
//! held by the fake (it sends the email and never answers), the worker that sent it is killed
//! with SIGKILL, and the rest of the messages are published: a re-encoded copy, a message
//! without `order_id`. The peers' in-process sweepers settle the dead worker's key; no cron
//! job runs. Once the survivors drain, a last worker takes what they put back (a delivery held
//! for redelivery when they stopped): every key is settled, so it acknowledges without sending.

#[path = "../../examples/receipts_worker.rs"]
mod receipts_worker;

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemflow::consumer::REFUSED_HEADER;
use idemflow::consumer::amqp::lapin;
use idemflow::testkit::FakeResend;
use idemflow::{KeyId, KeyState, key::IdempotencyKey, key::Scope, record::Actor};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};

use crate::scenarios::eventually;
use crate::support::{KillOnDrop, fresh_name};

const VAR: &str = "IDEMFLOW_TEST_AMQP_URL";
/// Set for the child: it runs the worker with the example's own environment variables.
const CHILD: &str = "IDEMFLOW_RECEIPTS_CHILD";
const WORKERS: usize = 3;
const ORDERS: u64 = 20;

/// The child: the example's worker, with its logs on stderr, until SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of receipts::three_workers_one_killed_mid_send_send_one_email_per_order"]
async fn child_runs_the_receipts_worker() {
    if std::env::var(CHILD).is_err() {
        eprintln!("skipping: run by the receipts test as its child process");
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let config = receipts_worker::Config::from_env().unwrap();
    let stats = receipts_worker::run(config, receipts_worker::terminated())
        .await
        .unwrap();
    eprintln!("drained: {stats:?}");
}

/// A worker process, its stderr lines collected.
struct Worker {
    child: KillOnDrop,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Worker {
    fn start(env: &[(&str, String)]) -> Self {
        let mut command =
            crate::support::child_test(module_path!(), "child_runs_the_receipts_worker");
        command
            .env(CHILD, "1")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = command.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let collected = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                collected.lock().unwrap().push(line);
            }
        });
        Self {
            child: KillOnDrop(child),
            lines,
        }
    }

    fn said(&self, what: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|l| l.contains(what))
    }

    fn log(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// SIGTERM, then waits for it to drain and exit.
    fn terminate(mut self) -> (std::process::ExitStatus, String) {
        let pid = self.child.0.id().to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        let status = wait_within(&mut self.child.0, Duration::from_secs(30));
        (status, self.log())
    }
}

fn wait_within(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no exit within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn receipt(order: u64) -> Vec<u8> {
    format!(r#"{{"order_id": {order}, "email": "buyer{order}@example.com"}}"#).into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_one_killed_mid_send_send_one_email_per_order() {
    let Some((url, connection)) =
        crate::scenarios::reach("RabbitMQ", VAR, |url: String| async move {
            Connection::connect(&url, ConnectionProperties::default()).await
        })
        .await
    else {
        return;
    };
    let fake = FakeResend::start().await.unwrap();
    let queue = fresh_name();
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("keys.db").display());
    let env = [
        ("AMQP_URL", url.clone()),
        ("QUEUE", queue.clone()),
        ("RESEND_API_BASE", fake.base_url().to_owned()),
        ("RESEND_API_KEY", FakeResend::API_KEY.to_owned()),
        ("DATABASE_URL", database.clone()),
    ];
    let mut workers: Vec<Worker> = (0..WORKERS).map(|_| Worker::start(&env)).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !workers.iter().all(|w| w.said("consuming")) {
        let logs: Vec<String> = workers.iter().map(Worker::log).collect();
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every worker is consuming:\n{}",
            logs.join("\n---\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let publish = |body: Vec<u8>| {
        let channel = channel.clone();
        let queue = queue.clone();
        async move {
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };

    // The first receipt: Resend sends it and never answers; its worker is killed.
    fake.faults().hang_next_response();
    publish(receipt(1)).await;
    eventually(Duration::from_secs(30), "the first email sent", || {
        std::future::ready(fake.ledger().len() == 1)
    })
    .await;
    let sender = workers
        .iter()
        .position(|w| w.said("order_id=1 "))
        .unwrap_or_else(|| panic!("no worker logged order 1"));
    let mut killed = workers.remove(sender);
    killed.child.0.kill().unwrap(); // SIGKILL
    killed.child.0.wait().unwrap();

    for order in 2..=ORDERS {
        publish(receipt(order)).await;
    }
    // The same message encoded again, and a message without a key.
    publish(br#"{ "email" : "buyer5@example.com", "order_id" : 5 }"#.to_vec()).await;
    publish(br#"{"email": "nobody@example.com"}"#.to_vec()).await;

    let store = idemflow::store::connect(&database).await.unwrap();
    let scope = Scope::new(format!("queue:{queue}")).unwrap();
    let first = KeyId::new(scope.clone(), IdempotencyKey::new("1").unwrap());
    eventually(
        Duration::from_secs(90),
        "every order's email sent and the dead worker's key settled",
        || {
            let (store, first, fake) = (store.clone(), first.clone(), &fake);
            async move {
                let settled =
                    matches!(store.get(&first).await, Ok(Some(r)) if r.state == KeyState::Done);
                settled && fake.ledger().len() == ORDERS as usize
            }
        },
    )
    .await;
    // Drained with SIGTERM: every delivery acknowledged (an unacknowledged one would be back
    // on the queue once its channel closed).
    let mut logs = Vec::new();
    for worker in workers {
        let (status, log) = worker.terminate();
        assert!(status.success(), "a worker did not drain: {status}\n{log}");
        logs.push(log);
    }
    // A survivor stopped while it held a delivery for redelivery (the dead worker's message, or
    // a copy of a key in flight) puts it back on the queue: a fresh worker takes what is left,
    // every key of which is settled, and acknowledges it without sending.
    let ready = || {
        let (channel, queue) = (channel.clone(), queue.clone());
        async move {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            channel
                .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                .await
                .unwrap()
                .message_count()
        }
    };
    let config = receipts_worker::Config {
        amqp_url: url.clone(),
        dead_letter_exchange: format!("{queue}.dead"),
        queue: queue.clone(),
        resend_api_base: fake.base_url().to_owned(),
        resend_api_key: FakeResend::API_KEY.to_owned(),
        from: "receipts@example.com".to_owned(),
        database_url: database.clone(),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let last = tokio::spawn(receipts_worker::run(config, async move {
        let _ = stopped.await;
    }));
    eventually(Duration::from_secs(30), "the queue drained", || async {
        ready().await == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop.send(());
    let drained = last.await.unwrap().unwrap();
    assert_eq!(
        (drained.ran, drained.rejected),
        (0, 0),
        "the last worker found only settled keys: {drained:?}"
    );
    assert_eq!(ready().await, 0, "messages left on the queue");

    let emails = fake.ledger().entries();
    for order in 1..=ORDERS {
        let to = format!("buyer{order}@example.com");
        let sent = emails
            .iter()
            .filter(|e| e.request["to"][0].as_str() == Some(to.as_str()))
            .count();
        assert_eq!(sent, 1, "order {order}: {sent} emails\n{}", logs.join("\n"));
    }
    let history = store.history(&first).await.unwrap();
    assert!(
        history.iter().any(|e| e.actor == Actor::Sweeper),
        "the dead worker's key was not settled by a peer's sweeper: {history:?}"
    );
    let dead = channel
        .basic_get(
            format!("{queue}.dead").as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the keyless message on the dead-letter queue");
    assert_eq!(dead.delivery.data, br#"{"email": "nobody@example.com"}"#);
    let reason = dead
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(REFUSED_HEADER).cloned());
    assert!(
        matches!(&reason, Some(AMQPValue::LongString(s)) if String::from_utf8_lossy(s.as_bytes()).contains("no key")),
        "{reason:?}"
    );
    eprintln!("the dead worker's key: {history:?}");
    for name in [queue.clone(), format!("{queue}.dead")] {
        channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    channel
        .exchange_delete(
            format!("{queue}.dead").as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await
        .unwrap();
    let _ = connection.close(200, "done".into()).await;
}
