//! The checkout service example (a two-step workflow behind the layer) over real sockets on
//! 127.0.0.1, against the testkit's fake Stripe and Resend: an order, its replay, a declined
//! card, and a lost receipt answer settled and resumed by the service's own sweeper; and a
//! black-box judge that runs the example as a process, kills it mid-load and injects faults.

#[path = "../../examples/checkout_service.rs"]
mod example;

use std::sync::Arc;
use std::time::Duration;

use idemflow::testkit::{FakeResend, FakeStripe};
use idemflow::{Idempotency, KeyState};
use serde_json::{Value, json};

const LEASE: Duration = Duration::from_millis(400);

struct Service {
    base: String,
    idem: Idempotency,
    shop: Arc<example::Shop>,
    stripe: FakeStripe,
    resend: FakeResend,
    _dir: tempfile::TempDir,
}

async fn start() -> Service {
    let stripe = FakeStripe::start().await.unwrap();
    let resend = FakeResend::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let settings = example::Settings {
        database_url: format!("sqlite://{}", dir.path().join("shop.db").display()),
        listen_addr: "127.0.0.1:0".into(),
        stripe: (stripe.base_url().to_owned(), FakeStripe::API_KEY.into()),
        resend: (resend.base_url().to_owned(), FakeResend::API_KEY.into()),
        receipt_from: "shop@example.com".into(),
        lease: Some(LEASE),
    };
    let (idem, shop) = example::connect(&settings).await.unwrap();
    let app = example::router(idem.clone(), shop.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Service {
        base,
        idem,
        shop,
        stripe,
        resend,
        _dir: dir,
    }
}

async fn order(s: &Service, key: &str, pm: &str) -> (u16, bool, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{}/orders", s.base))
        .header("idempotency-key", format!("\"{key}\""))
        .header("x-account-id", "acct_1")
        .json(
            &json!({"amount": 1500, "currency": "usd", "payment_method": pm,
                      "email": "ana@example.org"}),
        )
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let replayed = resp.headers().get("idempotent-replayed").is_some();
    (status, replayed, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_charges_once_emails_once_and_replays() {
    let s = start().await;
    let (status, replayed, body) = order(&s, "order-1", "pm_card_visa").await;
    assert_eq!((status, replayed), (201, false), "{body}");
    assert!(
        body["payment"].as_str().unwrap().starts_with("pi_"),
        "{body}"
    );
    assert_eq!(body["order"], "order-1");
    let (status, replayed, again) = order(&s, "order-1", "pm_card_visa").await;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(again, body);
    assert_eq!((s.stripe.ledger().len(), s.resend.ledger().len()), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_card_is_stored_and_sends_no_receipt() {
    let s = start().await;
    let (status, _, body) = order(&s, "order-2", FakeStripe::DECLINED_CARD).await;
    assert_eq!(status, 402, "{body}");
    let (status, replayed, _) = order(&s, "order-2", FakeStripe::DECLINED_CARD).await;
    assert_eq!((status, replayed), (402, true));
    assert_eq!(s.resend.ledger().len(), 0);
}

/// The receipt is sent but every answer to it is lost: the order answers 503 and stays unfinished. The
/// service's sweeper settles the receipt step from Resend (a same-key re-send inside Resend's
/// window replays it) and resumes the order; the client's retry gets the finished order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_receipt_answer_is_settled_and_the_order_resumed() {
    let s = start().await;
    // Every try of the adapter's call (3 by default) loses its answer.
    for _ in 0..3 {
        s.resend.faults().lose_next_response();
    }
    let (status, _, body) = order(&s, "order-3", "pm_card_visa").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        (s.stripe.ledger().len(), s.resend.ledger().len()),
        (1, 1),
        "Resend deduplicated the adapter's tries"
    );
    let (status, _, _) = order(&s, "order-3", "pm_card_visa").await;
    assert_eq!(status, 503, "the receipt's outcome is still unknown");

    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let sweeper = example::sweeper(&s.idem, s.shop.clone()).backoff(Duration::ZERO, Duration::ZERO);
    let id = idemflow::KeyId::new(
        idemflow::key::Scope::new("acct_1").unwrap(),
        idemflow::key::IdempotencyKey::new("order-3").unwrap(),
    );
    for _ in 0..5 {
        sweeper.run_once().await.unwrap();
        if s.idem.store().get(&id).await.unwrap().unwrap().state == KeyState::Done {
            break;
        }
    }
    assert_eq!(
        s.idem.store().get(&id).await.unwrap().unwrap().state,
        KeyState::Done
    );
    let (status, replayed, body) = order(&s, "order-3", "pm_card_visa").await;
    assert_eq!((status, replayed), (201, true), "{body}");
    assert_eq!(body["order"], "order-3");
    assert_eq!(
        (s.stripe.ledger().len(), s.resend.ledger().len()),
        (1, 1),
        "one charge, one receipt"
    );
}

// ---------------------------------------------------------------------------------------------
// A black-box judge: the example as a real process (this test binary re-run as
// [`child_serves_the_checkout_example`], which runs the example's own `serve` from its
// environment variables, sweeper included), SIGKILLed and restarted on the same SQLite file
// mid-load, against fake Stripe and Resend in this process that answer 5xx, 429, lose answers
// and take their time. Clients retry every order with its Idempotency-Key until it has a final
// answer (201 or 402), and keep retrying after it.

/// Set (to anything) in the child's environment: serve the example.
const JUDGE_CHILD: &str = "IDEMFLOW_CHECKOUT_JUDGE_CHILD";
/// Optional: the fault schedule's seed (printed by the judge).
const JUDGE_SEED: &str = "IDEMFLOW_CHECKOUT_JUDGE_SEED";
/// Every order has its final answer this soon after the load starts (a busy 2-core machine).
const JUDGE_BOUND: Duration = Duration::from_secs(60);
const ORDERS: usize = 40;
/// The service is killed when Stripe has seen this many PaymentIntents (mid-load).
const KILL_AT: [usize; 3] = [8, 18, 28];
/// The fakes keep injecting faults this long after the load starts.
const FAULTS_FOR: Duration = Duration::from_secs(6);

/// The child process of [`a_judge_sees_one_charge_one_receipt_and_one_answer_per_order`]: the
/// example's `serve`, configured from the environment exactly as its `main` is.
#[test]
#[ignore = "the child process of the checkout judge"]
fn child_serves_the_checkout_example() {
    if std::env::var_os(JUDGE_CHILD).is_none() {
        eprintln!("skipping: run by the checkout judge as its child process");
        return;
    }
    let settings = example::Settings::from_env().unwrap();
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(example::serve(settings))
        .unwrap();
}

/// A running child; dropped (the test failed or finished), it is killed.
struct ServiceProcess(std::process::Child);

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the example as a process and waits for the address it prints.
async fn spawn_service(env: &[(&str, String)]) -> (ServiceProcess, String) {
    use std::io::BufRead;
    let mut cmd = crate::support::child_test(module_path!(), "child_serves_the_checkout_example");
    cmd.env(JUDGE_CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = ServiceProcess(cmd.spawn().unwrap());
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        // Keeps reading until the child dies, so it never blocks on a full pipe.
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest prints `test NAME ... ` on the same line first.
            if let Some((_, addr)) = line.split_once("checkout_service listening on ")
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(addr.trim().to_owned());
            }
        }
    });
    let base = tokio::time::timeout(Duration::from_secs(30), rx)
        .await
        .expect("the service printed its address within 30 s")
        .expect("the service printed its address before exiting");
    (child, base)
}

/// A small deterministic generator for the fault schedule (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// One order as the judge sees it.
struct Seen {
    /// The first final answer: status and body bytes.
    first: Option<(u16, Vec<u8>)>,
    /// When it arrived, after the load started.
    first_at: Option<Duration>,
    /// Requests sent, and those that got a final answer.
    sent: usize,
    finals: usize,
    /// Retries after the first final answer whose answer differs (status or bytes).
    different: Vec<String>,
    /// Answers neither final nor a documented "retry later".
    unexpected: Vec<String>,
    /// The last non-final answer or transport error (for the report of an unfinished order).
    last: String,
    /// The last of them before the first final answer.
    before_final: String,
    started: tokio::time::Instant,
}

impl Seen {
    fn new(started: tokio::time::Instant) -> Self {
        Self {
            first: None,
            first_at: None,
            sent: 0,
            finals: 0,
            different: Vec::new(),
            unexpected: Vec::new(),
            last: String::new(),
            before_final: String::new(),
            started,
        }
    }

    /// Records one answer; `after_final`: the request was sent after the first final answer
    /// arrived (not alongside the request that got it).
    fn record(&mut self, answer: Result<(u16, Vec<u8>), String>, after_final: bool) {
        self.sent += 1;
        let (status, body) = match answer {
            Ok(a) => a,
            Err(e) => {
                self.last = format!("transport: {e}");
                return;
            }
        };
        let text = String::from_utf8_lossy(&body).into_owned();
        match status {
            201 | 402 => {
                self.finals += 1;
                match &self.first {
                    None => {
                        self.first = Some((status, body));
                        self.first_at = Some(self.started.elapsed());
                        self.before_final = self.last.clone();
                    }
                    Some(first) if *first != (status, body.clone()) => {
                        self.different.push(format!(
                            "{status} {text} (first: {} {})",
                            first.0,
                            String::from_utf8_lossy(&first.1)
                        ))
                    }
                    Some(_) => {}
                }
            }
            // In progress (409), not finished yet / retry (503): retry later.
            409 | 503 => {
                if after_final {
                    self.different
                        .push(format!("{status} {text} after a final answer"));
                }
                self.last = format!("{status} {text}");
            }
            _ => {
                let answer = format!("{status} {text}");
                if !self.unexpected.contains(&answer) {
                    self.unexpected.push(answer);
                }
                self.last = format!("{status} {text}");
            }
        }
    }
}

async fn send_order(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    body: &Value,
) -> Result<(u16, Vec<u8>), String> {
    let resp = client
        .post(format!("{base}/orders"))
        .header("idempotency-key", format!("\"{key}\""))
        .header("x-account-id", "acct_judge")
        .json(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.map_err(|e| e.to_string())?;
    Ok((status, bytes.to_vec()))
}

fn judged_order(i: usize) -> (String, bool, Value) {
    let declined = i % 5 == 3;
    let pm = if declined {
        FakeStripe::DECLINED_CARD
    } else {
        "pm_card_visa"
    };
    (
        format!("order-{i:02}"),
        declined,
        json!({"amount": 1000 + i, "currency": "usd", "payment_method": pm,
               "email": format!("buyer{i}@example.org")}),
    )
}

/// Retries one order (every third one with two concurrent requests per try) until it has a
/// final answer, then keeps retrying; stops at `stop` (an order without a final answer by
/// then is reported by the judge).
async fn drive_order(
    i: usize,
    base: tokio::sync::watch::Receiver<String>,
    stop: tokio::sync::watch::Receiver<bool>,
    seen: Arc<std::sync::Mutex<Seen>>,
) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let (key, _, body) = judged_order(i);
    tokio::time::sleep(Duration::from_millis(150 * i as u64)).await;
    loop {
        if *stop.borrow() {
            return;
        }
        let done = seen.lock().unwrap().first.is_some();
        let url = base.borrow().clone();
        // Two concurrent requests of one try: the one still running when the other gets the
        // final answer rightly gets 409 / 503; `done` is what the client knew when it sent them.
        if i.is_multiple_of(3) {
            let (a, b) = tokio::join!(
                send_order(&client, &url, &key, &body),
                send_order(&client, &url, &key, &body)
            );
            let mut s = seen.lock().unwrap();
            s.record(a, done);
            s.record(b, done);
        } else {
            let a = send_order(&client, &url, &key, &body).await;
            seen.lock().unwrap().record(a, done);
        }
        let pause = if done { 700 } else { 250 + 50 * (i as u64 % 5) };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

/// The acceptance, black-box: 40 orders (every fifth with a declined card) against the
/// example run as a process that is SIGKILLed three times mid-load and restarted on the same
/// SQLite file, while Stripe and Resend answer 5xx, 429 and lose answers. Every order gets a
/// final answer; a paid order has exactly one charge and one receipt, a declined one neither;
/// every answer after an order's first final answer is byte-identical to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_judge_sees_one_charge_one_receipt_and_one_answer_per_order() {
    let seed = std::env::var(JUDGE_SEED)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("checkout judge: {JUDGE_SEED}={seed}");
    let stripe = FakeStripe::start().await.unwrap();
    let resend = FakeResend::start().await.unwrap();
    // Steps take a while, so the kills land between and inside them.
    stripe.faults().set_latency(Duration::from_millis(30));
    resend.faults().set_latency(Duration::from_millis(30));
    let dir = tempfile::tempdir().unwrap();
    let env = [
        (
            "DATABASE_URL",
            format!("sqlite://{}", dir.path().join("checkout.db").display()),
        ),
        ("LISTEN_ADDR", "127.0.0.1:0".to_owned()),
        ("STRIPE_API_BASE", stripe.base_url().to_owned()),
        ("STRIPE_API_KEY", FakeStripe::API_KEY.to_owned()),
        ("RESEND_API_BASE", resend.base_url().to_owned()),
        ("RESEND_API_KEY", FakeResend::API_KEY.to_owned()),
    ];
    let (mut service, first_base) = spawn_service(&env).await;
    let (base_tx, base_rx) = tokio::sync::watch::channel(first_base);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let started = tokio::time::Instant::now();

    // Faults: a few queued at each fake at all times until the kills are over.
    let (faults_stop, mut faults_stopped) = tokio::sync::watch::channel(false);
    let injector = {
        let (sf, rf) = (stripe.faults().clone(), resend.faults().clone());
        tokio::spawn(async move {
            let mut rng = Rng(seed);
            let mut injected = 0usize;
            while !*faults_stopped.borrow() {
                for f in [&sf, &rf] {
                    if f.pending() < 2 {
                        injected += 1;
                        match rng.below(10) {
                            0..=2 => f.server_error_next(if rng.below(2) == 0 { 500 } else { 503 }),
                            3..=4 => f.rate_limit_next(Duration::from_secs(1)),
                            5..=7 => f.lose_next_response(),
                            // Every try of one call loses its answer: the outcome is unknown.
                            8 => f
                                .lose_next_response()
                                .lose_next_response()
                                .lose_next_response(),
                            _ => f.delay_next(Duration::from_millis(300)),
                        };
                    }
                }
                let pause = Duration::from_millis(100 + rng.below(200));
                let _ = tokio::time::timeout(pause, faults_stopped.changed()).await;
            }
            injected
        })
    };

    let seen: Vec<_> = (0..ORDERS)
        .map(|_| Arc::new(std::sync::Mutex::new(Seen::new(started))))
        .collect();
    let drivers: Vec<_> = (0..ORDERS)
        .map(|i| {
            tokio::spawn(drive_order(
                i,
                base_rx.clone(),
                stop_rx.clone(),
                seen[i].clone(),
            ))
        })
        .collect();

    let mut kills = Vec::new();
    for at in KILL_AT {
        while stripe.ledger().len() < at && started.elapsed() < JUDGE_BOUND / 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let intents = stripe.ledger().len();
        let receipts = resend.ledger().len();
        drop(service); // SIGKILL, then reaped
        kills.push(format!(
            "killed at {:?} ({intents} PaymentIntents, {receipts} receipts)",
            started.elapsed()
        ));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (next, base) = spawn_service(&env).await;
        service = next;
        base_tx.send_replace(base);
    }
    // Faults go on a while after the last restart (the orders it resumes meet them too).
    let all_final = || seen.iter().all(|s| s.lock().unwrap().first.is_some());
    while started.elapsed() < FAULTS_FOR && !all_final() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = faults_stop.send(true);
    let injected = injector.await.unwrap();
    let unused = stripe.faults().pending() + resend.faults().pending();

    while started.elapsed() < JUDGE_BOUND && !all_final() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let finished_after = started.elapsed();
    // A last retry round after every order has answered, on the last process.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let _ = stop_tx.send(true);
    for d in drivers {
        d.await.unwrap();
    }
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let base = base_rx.borrow().clone();
    for (i, s) in seen.iter().enumerate() {
        let (key, _, body) = judged_order(i);
        let a = send_order(&client, &base, &key, &body).await;
        s.lock().unwrap().record(a, true);
    }

    // The verdict.
    let intents = stripe.ledger().entries();
    let emails = resend.ledger().entries();
    let mut problems = Vec::new();
    let mut sent = 0;
    for (i, s) in seen.iter().enumerate() {
        let (key, declined, _) = judged_order(i);
        let s = s.lock().unwrap();
        sent += s.sent;
        let charges: Vec<_> = intents
            .iter()
            .filter(|e| e.request["metadata[order]"] == key.as_str())
            .collect();
        let paid: Vec<_> = charges.iter().filter(|e| e.status == "succeeded").collect();
        let receipts: Vec<_> = emails
            .iter()
            .filter(|e| e.request["subject"] == format!("Receipt for order {key}").as_str())
            .collect();
        match &s.first {
            None => problems.push(format!("{key}: no final answer; last: {}", s.last)),
            Some((status, body)) => {
                let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
                let want = if declined { 402 } else { 201 };
                if *status != want {
                    problems.push(format!("{key}: final answer {status} {body}, want {want}"));
                }
                if !declined
                    && paid.len() == 1
                    && receipts.len() == 1
                    && (body["payment"] != paid[0].id.as_str()
                        || body["receipt"] != receipts[0].id.as_str())
                {
                    problems.push(format!(
                        "{key}: answer {body} names other effects than {} / {}",
                        paid[0].id, receipts[0].id
                    ));
                }
            }
        }
        let want = usize::from(!declined);
        if paid.len() != want || receipts.len() != want {
            problems.push(format!(
                "{key} (declined: {declined}): {} charges {:?}, {} receipts {:?}",
                paid.len(),
                paid.iter().map(|e| &e.id).collect::<Vec<_>>(),
                receipts.len(),
                receipts.iter().map(|e| &e.id).collect::<Vec<_>>()
            ));
        }
        for d in &s.different {
            problems.push(format!("{key}: a retry after the final answer got {d}"));
        }
        for u in &s.unexpected {
            problems.push(format!("{key}: unexpected answer {u}"));
        }
    }
    let mut slowest: Vec<_> = seen
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let s = s.lock().unwrap();
            s.first_at.map(|at| (at, i, s.before_final.clone()))
        })
        .collect();
    slowest.sort_by_key(|s| std::cmp::Reverse(s.0));
    let slowest: Vec<_> = slowest
        .iter()
        .take(3)
        .map(|(at, i, last)| format!("order-{i:02} final at {at:?} (before: {last})"))
        .collect();
    let summary = format!(
        "seed {seed}; {sent} requests; {} faults met; {}; waited \
         {finished_after:?} for the final answers; {} PaymentIntents, {} emails; slowest: {}",
        injected - unused,
        kills.join(", "),
        intents.len(),
        emails.len(),
        slowest.join("; ")
    );
    drop(service);
    assert!(
        problems.is_empty(),
        "{} problems:\n{}\n({summary})",
        problems.len(),
        problems.join("\n")
    );
    eprintln!("checkout judge: {summary}");
}
