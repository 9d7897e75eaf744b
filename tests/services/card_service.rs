//! The card service example over real sockets on 127.0.0.1, against the testkit fake Stripe:
//! concurrency on one key, scoping, declines, a client disconnect settled by the sweeper, and
//! (with feature `cli`) the example run as a process, killed with SIGKILL mid-load, restarted,
//! reconciled with `idemflow reconcile --once`, and every key retried.

#[path = "../../examples/card_service.rs"]
mod example;

use idemflow::store::OperatorStore;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idemflow::provider::Stripe;
use idemflow::store::sqlite::SqliteStore;
use idemflow::testkit::FakeStripe;
use idemflow::{KeyId, KeyState, Providers, Store, Sweeper};
use serde_json::{Value, json};

struct Service {
    base: String,
    idem: idemflow::Idempotency,
    store: Arc<dyn Store>,
    stripe: Arc<Stripe>,
    _dir: tempfile::TempDir,
}

async fn start(fake: &FakeStripe, lease: Duration) -> Service {
    start_with(fake, lease, None).await
}

async fn start_with(fake: &FakeStripe, lease: Duration, wait: Option<Duration>) -> Service {
    let dir = tempfile::tempdir().unwrap();
    let settings = example::Settings {
        database_url: format!("sqlite://{}", dir.path().join("cards.db").display()),
        listen_addr: "127.0.0.1:0".into(),
        stripe_base: fake.base_url().to_owned(),
        stripe_key: FakeStripe::API_KEY.into(),
        lease: Some(lease),
        wait_in_flight: wait,
    };
    let (idem, stripe) = example::connect(&settings).await.unwrap();
    let store = idem.store().clone();
    let app = example::router(idem.clone(), stripe.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Service {
        base,
        idem,
        store,
        stripe,
        _dir: dir,
    }
}

#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    retry_after: Option<u64>,
    body: Value,
}

async fn pay(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    account: &str,
    body: &Value,
) -> Result<Answer, reqwest::Error> {
    let resp = client
        .post(format!("{base}/payments"))
        .header("idempotency-key", key)
        .header("x-account-id", account)
        .json(body)
        .send()
        .await?;
    let status = resp.status().as_u16();
    let replayed = resp
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let body = resp.json().await.unwrap_or(Value::Null);
    Ok(Answer {
        status,
        replayed,
        retry_after,
        body,
    })
}

/// Retries 409 / 503 (and connection errors) until another answer comes, like a client would.
async fn pay_until_settled(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    account: &str,
    body: &Value,
    conflicts: &AtomicUsize,
) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match pay(client, base, key, account, body).await {
            Ok(a) if a.status == 409 || a.status == 503 => {
                conflicts.fetch_add(1, Ordering::SeqCst);
                let wait =
                    Duration::from_secs(a.retry_after.unwrap_or(1)).min(Duration::from_secs(2));
                tokio::time::sleep(wait).await;
            }
            Ok(a) => return a,
            Err(e) => {
                assert!(Instant::now() < deadline, "no answer for {key}: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        assert!(Instant::now() < deadline, "key {key} never settled");
    }
}

fn card(amount: u64) -> Value {
    json!({"amount": amount, "currency": "usd", "customer": "cus_test", "payment_method": "pm_card_visa"})
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_requests_ten_at_a_time_one_key_one_charge() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().set_latency(Duration::from_millis(300));
    let svc = start(&fake, Duration::from_secs(30)).await;
    let client = client();
    let sem = Arc::new(tokio::sync::Semaphore::new(10));
    let conflicts = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let (client, base, sem, conflicts) = (
            client.clone(),
            svc.base.clone(),
            sem.clone(),
            conflicts.clone(),
        );
        tasks.spawn(async move {
            let _permit = sem.acquire_owned().await.unwrap();
            pay_until_settled(&client, &base, "order-1", "acct_1", &card(1999), &conflicts).await
        });
    }
    let mut provider_ids = std::collections::BTreeSet::new();
    let mut replays = 0;
    while let Some(a) = tasks.join_next().await {
        let a = a.unwrap();
        assert_eq!(a.status, 201, "{a:?}");
        assert_eq!(a.body["status"], "succeeded");
        assert_eq!(a.body["amount"], 1999);
        provider_ids.insert(a.body["provider_id"].as_str().unwrap().to_owned());
        replays += usize::from(a.replayed);
    }
    assert_eq!(
        provider_ids.len(),
        1,
        "every 201 names the same charge: {provider_ids:?}"
    );
    assert_eq!(fake.ledger().len(), 1, "exactly one charge");
    assert_eq!(replays, 99);
    eprintln!(
        "100 requests: 1 charge, 99 replays, {} in-flight answers (409) retried",
        conflicts.load(Ordering::SeqCst)
    );
    assert!(
        conflicts.load(Ordering::SeqCst) > 0,
        "the duplicates really overlapped"
    );
}

/// The second seed article's own check, `hey -n 100 -c 10 -m POST -H 'Idempotency-Key:
/// "same-uuid"' ...`, against a card processor taking ~200 ms: 100 requests, 10 at a time, no
/// client retries. Every answer is `(status, payment id)`.
async fn seed_check(svc: &Service, key_header: &str) -> Vec<(u16, Option<String>)> {
    let client = client();
    let sem = Arc::new(tokio::sync::Semaphore::new(10));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let (client, base, sem, key) = (
            client.clone(),
            svc.base.clone(),
            sem.clone(),
            key_header.to_owned(),
        );
        tasks.spawn(async move {
            let _permit = sem.acquire_owned().await.unwrap();
            let a = pay(&client, &base, &key, "acct_seed", &card(4200))
                .await
                .unwrap();
            let id = a.body["payment_id"].as_str().map(str::to_owned);
            (a.status, id)
        });
    }
    let mut answers = Vec::new();
    while let Some(a) = tasks.join_next().await {
        answers.push(a.unwrap());
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_check_with_waiting_every_answer_is_201_with_one_payment_id() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().set_latency(Duration::from_millis(200));
    // The bound is generous: on a loaded machine the first charge may take seconds.
    let svc = start_with(
        &fake,
        Duration::from_secs(30),
        Some(Duration::from_secs(20)),
    )
    .await;
    let answers = seed_check(&svc, r#""same-uuid""#).await;
    let statuses: std::collections::BTreeMap<u16, usize> =
        answers.iter().fold(Default::default(), |mut m, (s, _)| {
            *m.entry(*s).or_default() += 1;
            m
        });
    eprintln!("with waiting: {statuses:?}");
    assert_eq!(statuses.get(&201), Some(&100), "{statuses:?}");
    let ids: std::collections::BTreeSet<_> = answers.iter().map(|(_, id)| id.clone()).collect();
    assert_eq!(ids.len(), 1, "one payment id: {ids:?}");
    assert!(ids.iter().all(Option::is_some), "{ids:?}");
    assert_eq!(fake.ledger().len(), 1, "exactly one charge");
    assert_eq!(svc_waiters(&svc), 0, "no waiter left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_check_without_waiting_gives_201s_with_one_payment_id_and_409s() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().set_latency(Duration::from_millis(200));
    let svc = start(&fake, Duration::from_secs(30)).await;
    // The seed's own bare key: accepted as the quoted one is.
    let answers = seed_check(&svc, "same-uuid").await;
    let ok: Vec<_> = answers.iter().filter(|(s, _)| *s == 201).collect();
    let conflicts = answers.iter().filter(|(s, _)| *s == 409).count();
    eprintln!("without waiting: {} x 201, {conflicts} x 409", ok.len());
    assert_eq!(ok.len() + conflicts, 100, "only 201 and 409: {answers:?}");
    assert!(conflicts > 0, "the duplicates overlapped the 200 ms charge");
    let ids: std::collections::BTreeSet<_> = ok.iter().map(|(_, id)| id.clone()).collect();
    assert_eq!(ids.len(), 1, "one payment id: {ids:?}");
    assert_eq!(fake.ledger().len(), 1, "exactly one charge");
}

/// The seed's check as the seed runs it, with Debian's `hey`: `hey -n 100 -c 10 -m POST -H
/// 'Idempotency-Key: "same-uuid"' ...`, with waiting on and off. Skips (with a printed reason)
/// where `hey` is not installed, fails under `CI=true` (`.ci/run` installs it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_check_with_hey() {
    if std::process::Command::new("hey")
        .arg("-h")
        .output()
        .is_err()
    {
        assert!(
            !crate::support::under_ci(),
            "hey is not installed and CI=true (apt-get install hey)"
        );
        eprintln!("skipping: hey is not installed (apt-get install hey)");
        return;
    }
    for (wait, key) in [
        (Some(Duration::from_secs(20)), "same-uuid"),
        (None, "same-uuid-2"),
    ] {
        let fake = FakeStripe::start().await.unwrap();
        fake.faults().set_latency(Duration::from_millis(200));
        let svc = start_with(&fake, Duration::from_secs(30), wait).await;
        let body = card(4200).to_string();
        let url = format!("{}/payments", svc.base);
        let header = format!("Idempotency-Key: \"{key}\"");
        let out = tokio::process::Command::new("hey")
            .args([
                "-n",
                "100",
                "-c",
                "10",
                "-m",
                "POST",
                "-T",
                "application/json",
            ])
            .args([
                "-H",
                &header,
                "-H",
                "X-Account-Id: acct_hey",
                "-d",
                &body,
                &url,
            ])
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        eprintln!("hey, wait_in_flight {wait:?}:\n{}", text.trim_end());
        // `  [201]\t100 responses`
        let mut statuses = std::collections::BTreeMap::new();
        for line in text.lines() {
            let line = line.trim();
            if let Some((code, rest)) = line.strip_prefix('[').and_then(|l| l.split_once(']'))
                && let Some(n) = rest.trim().strip_suffix(" responses")
            {
                statuses.insert(
                    code.parse::<u16>().unwrap(),
                    n.trim().parse::<usize>().unwrap(),
                );
            }
        }
        assert_eq!(statuses.values().sum::<usize>(), 100, "{text}");
        if wait.is_some() {
            assert_eq!(statuses.get(&201), Some(&100), "{statuses:?}");
        } else {
            assert!(
                statuses.keys().all(|s| *s == 201 || *s == 409),
                "{statuses:?}"
            );
            assert!(statuses.contains_key(&409), "{statuses:?}");
        }
        // One charge, and the one answer every 201 replays names its payment id.
        assert_eq!(fake.ledger().len(), 1, "one charge");
        let again = pay(
            &client(),
            &svc.base,
            &format!("\"{key}\""),
            "acct_hey",
            &card(4200),
        )
        .await
        .unwrap();
        assert!(again.replayed && again.status == 201, "{again:?}");
    }
}

fn svc_waiters(svc: &Service) -> usize {
    svc.idem.in_flight_waiters()
}

#[tokio::test]
async fn same_key_under_another_account_is_another_payment() {
    let fake = FakeStripe::start().await.unwrap();
    let svc = start(&fake, Duration::from_secs(30)).await;
    let c = client();
    let a = pay(&c, &svc.base, "k-shared", "acct_a", &card(500))
        .await
        .unwrap();
    let b = pay(&c, &svc.base, "k-shared", "acct_b", &card(500))
        .await
        .unwrap();
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.replayed, "acct_b never sees acct_a's answer");
    assert_ne!(a.body["provider_id"], b.body["provider_id"]);
    assert_ne!(a.body["payment_id"], b.body["payment_id"]);
    // A different body under the other account is not a mismatch either.
    let b2 = pay(&c, &svc.base, "k-other", "acct_b", &card(700))
        .await
        .unwrap();
    let a2 = pay(&c, &svc.base, "k-other", "acct_a", &card(900))
        .await
        .unwrap();
    assert_eq!((b2.status, a2.status), (201, 201));
    // Each account's retry replays its own answer.
    let a_again = pay(&c, &svc.base, "k-shared", "acct_a", &card(500))
        .await
        .unwrap();
    let b_again = pay(&c, &svc.base, "k-shared", "acct_b", &card(500))
        .await
        .unwrap();
    assert!(a_again.replayed && b_again.replayed);
    assert_eq!(a_again.body, a.body);
    assert_eq!(b_again.body, b.body);
    assert_eq!(fake.ledger().len(), 4);
}

#[tokio::test]
async fn decline_is_stored_and_invalid_input_is_not() {
    let fake = FakeStripe::start().await.unwrap();
    let svc = start(&fake, Duration::from_secs(30)).await;
    let c = client();
    let mut declined = card(500);
    declined["payment_method"] = FakeStripe::DECLINED_CARD.into();
    let first = pay(&c, &svc.base, "k-dec", "acct_1", &declined)
        .await
        .unwrap();
    assert_eq!(first.status, 402, "{first:?}");
    assert_eq!(first.body["error"], "card_declined");
    assert_eq!(first.body["decline_code"], "generic_decline");
    let again = pay(&c, &svc.base, "k-dec", "acct_1", &declined)
        .await
        .unwrap();
    assert_eq!((again.status, again.replayed), (402, true));
    assert_eq!(again.body, first.body);
    assert_eq!(fake.ledger().len(), 1);

    for (body, field) in [
        (
            json!({"amount": -5, "currency": "usd", "customer": "cus_1"}),
            "amount",
        ),
        (
            json!({"amount": "5", "currency": "usd", "customer": "cus_1"}),
            "amount",
        ),
        (
            json!({"amount": 5, "currency": "dollars", "customer": "cus_1"}),
            "currency",
        ),
        (json!({"amount": 5, "currency": "usd"}), "customer"),
        (
            json!({"amount": 5, "currency": "usd", "customer": "cus_1", "tip": 1}),
            "tip",
        ),
    ] {
        let a = pay(&c, &svc.base, "k-bad", "acct_1", &body).await.unwrap();
        assert_eq!(a.status, 400, "{body}");
        assert_eq!(a.body["title"], format!("Invalid {field}"), "{body}");
    }
    let raw = c
        .post(format!("{}/payments", svc.base))
        .header("idempotency-key", "k-bad")
        .header("x-account-id", "acct_1")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    assert!(raw.text().await.unwrap().contains("not valid JSON"));
    // Nothing was stored for k-bad: the corrected request uses the key normally.
    let ok = pay(&c, &svc.base, "k-bad", "acct_1", &card(5))
        .await
        .unwrap();
    assert_eq!((ok.status, ok.replayed), (201, false));
    // Missing key, missing account, reuse with another amount.
    let no_key = c
        .post(format!("{}/payments", svc.base))
        .header("x-account-id", "acct_1")
        .json(&card(5))
        .send()
        .await
        .unwrap();
    assert_eq!(no_key.status(), 400);
    let reuse = pay(&c, &svc.base, "k-bad", "acct_1", &card(6))
        .await
        .unwrap();
    assert_eq!(reuse.status, 422);
    assert_eq!(fake.ledger().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_charge_is_settled_by_the_sweeper() {
    let fake = FakeStripe::start().await.unwrap();
    fake.faults().set_latency(Duration::from_millis(1500));
    let svc = start(&fake, Duration::from_secs(1)).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let gone = pay(&impatient, &svc.base, "k-disc", "acct_1", &card(4200)).await;
    assert!(gone.is_err(), "the client hung up: {gone:?}");
    let id = KeyId::new("acct_1".parse().unwrap(), "k-disc".parse().unwrap());
    // The charge goes through at the provider anyway.
    let deadline = Instant::now() + Duration::from_secs(10);
    while fake.ledger().is_empty() {
        assert!(Instant::now() < deadline, "the charge never happened");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await; // past the lease
    let rec = svc.store.get(&id).await.unwrap().unwrap();
    assert_eq!(
        rec.state,
        KeyState::Processing,
        "the handler was dropped with the connection: the key waits for the sweeper"
    );
    assert_eq!(rec.provider.as_deref(), Some("stripe"));
    // Meanwhile a retry is told to come back, and does not charge again.
    let c = client();
    let early = pay(&c, &svc.base, "k-disc", "acct_1", &card(4200))
        .await
        .unwrap();
    assert_eq!(early.status, 503, "{early:?}");
    assert!(early.retry_after.is_some());

    let sweeper = Sweeper::new(
        svc.store.clone(),
        Providers::new().with(svc.stripe.clone() as Arc<dyn idemflow::Provider>),
    );
    let report = sweeper.run_once().await.unwrap();
    assert_eq!(report.taken, 1, "{report:?}");
    let rec = svc.store.get(&id).await.unwrap().unwrap();
    assert_eq!(rec.state, KeyState::Done);

    let after = pay(&c, &svc.base, "k-disc", "acct_1", &card(4200))
        .await
        .unwrap();
    assert_eq!((after.status, after.replayed), (201, true), "{after:?}");
    let charge = &fake.ledger().entries()[0];
    assert_eq!(after.body["provider_id"], charge.id.as_str());
    assert_eq!(after.body["amount"], 4200);
    assert_eq!(fake.ledger().len(), 1, "charged once");
    assert_eq!(fake.ledger().count_for_key(&rec.provider_key), 1);
}

/// The card service example's binary, built (normally a no-op: `cargo test` builds examples)
/// with this test's features.
#[cfg(all(unix, feature = "cli"))]
fn example_bin() -> std::path::PathBuf {
    let manifest = env!("CARGO_MANIFEST_DIR");
    let mut features = vec!["axum", "http", "testkit", "cli"];
    if cfg!(feature = "postgres") {
        features.push("postgres");
    }
    if cfg!(feature = "mysql") {
        features.push("mysql");
    }
    if cfg!(feature = "redis") {
        features.push("redis");
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = std::process::Command::new(cargo)
        .current_dir(manifest)
        .args([
            "build",
            "--example",
            "card_service",
            "--features",
            &features.join(","),
        ])
        .status()
        .unwrap();
    assert!(built.success());
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().unwrap().parent().unwrap();
    let service_bin = target.join("examples").join("card_service");
    assert!(service_bin.exists(), "{}", service_bin.display());
    service_bin
}

/// Starts the example as a process on `db` against `fake`, with `env` on top; returns it and
/// its base URL (from its first line).
#[cfg(all(unix, feature = "cli"))]
fn spawn_example(
    bin: &std::path::Path,
    fake: &FakeStripe,
    db: &str,
    env: &[(&str, &str)],
) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(bin)
        .env("STRIPE_API_KEY", FakeStripe::API_KEY)
        .env("STRIPE_API_BASE", fake.base_url())
        .env("DATABASE_URL", db)
        .env("LISTEN_ADDR", "127.0.0.1:0")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .trim()
        .strip_prefix("card_service listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    (child, base)
}

/// Two processes of the example on one database, waiting on: duplicates sent to the second
/// wait (reading the key, as nothing in their process can wake them) while the first process
/// charges; the first is killed with SIGKILL mid-charge. The waiters are told the outcome is
/// unknown once its lease runs out (never a second charge, never a hang to their bound); after
/// `idemflow reconcile --once`, a retry replays the one charge. On a SQLite file, and on
/// PostgreSQL (a fresh schema), MariaDB (a fresh database) and Redis when their URLs are set.
#[cfg(all(unix, feature = "cli"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_in_a_second_process_outlive_the_first_killed_mid_charge() {
    let bin = example_bin();
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite://{}", dir.path().join("cards.db").display());
    waiters_across_processes(&bin, "sqlite", &sqlite, true).await;
    #[cfg(feature = "postgres")]
    if let Some((url, schema)) = crate::support::postgres::fresh_schema().await {
        let db = crate::support::postgres::url_in(&url, &schema);
        waiters_across_processes(&bin, "postgres", &db, true).await;
        crate::support::postgres::drop_schema(&url, &schema).await;
    }
    #[cfg(feature = "mysql")]
    if let Some((options, name)) = crate::support::mysql::fresh_database().await {
        let url = std::env::var(crate::support::mysql::URL_VAR).unwrap();
        let base = url.rsplit_once('/').map_or(url.as_str(), |(b, _)| b);
        waiters_across_processes(&bin, "mariadb", &format!("{base}/{name}"), true).await;
        crate::support::mysql::drop_database(&options, &name).await;
    }
    // Redis: the example's default key prefix is shared with other tests, so no reconcile
    // (it would sweep their keys too); the key is this run's own.
    #[cfg(feature = "redis")]
    if let Some(url) = crate::support::backend_url(crate::support::redis::URL_VAR) {
        waiters_across_processes(&bin, "redis", &url, false).await;
    }
}

#[cfg(all(unix, feature = "cli"))]
async fn waiters_across_processes(bin: &std::path::Path, name: &str, db: &str, reconcile: bool) {
    use std::process::Command;
    let fake = FakeStripe::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("IDEMFLOW_LEASE_SECS", "1"),
        ("IDEMFLOW_WAIT_IN_FLIGHT_MS", "60000"),
    ];
    let key = idemflow::conformance::unique("order-w");
    let (mut first, first_base) = spawn_example(bin, &fake, db, &env);
    let (mut second, second_base) = spawn_example(bin, &fake, db, &env);
    // The charge hangs at the processor until the process dies.
    fake.faults().hang_next_response();
    let c = client();
    let charge = tokio::spawn({
        let (c, base, key) = (c.clone(), first_base.clone(), key.clone());
        async move { pay(&c, &base, &key, "acct_w", &card(700)).await }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while fake.ledger().is_empty() {
        assert!(
            Instant::now() < deadline,
            "{name}: the first charge never reached Stripe"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let waiters: Vec<_> = (0..5)
        .map(|_| {
            let (c, base, key) = (c.clone(), second_base.clone(), key.clone());
            tokio::spawn(async move { pay(&c, &base, &key, "acct_w", &card(700)).await })
        })
        .collect();
    // Let them start waiting (if one starts after the kill, it is answered the same), then kill
    // the charging process.
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    assert!(
        charge.await.unwrap().is_err(),
        "{name}: the killed process answered nothing"
    );
    for w in waiters {
        let a = w.await.unwrap().unwrap();
        // Past the first's lease the key's outcome is unknown: 503, to come back later.
        assert_eq!(a.status, 503, "{name}: {a:?}");
        assert_eq!(
            a.body["type"], "urn:idemflow:problem:outcome-unknown",
            "{name}: {a:?}"
        );
    }
    assert_eq!(fake.ledger().len(), 1, "{name}: one charge");
    if reconcile {
        let config = dir.path().join("idemflow.toml");
        std::fs::write(
            &config,
            format!(
                "[[providers]]\nkind = \"stripe\"\nbase_url = \"{}\"\napi_key_env = \"STRIPE_API_KEY\"\n",
                fake.base_url()
            ),
        )
        .unwrap();
        let reconcile = Command::new(env!("CARGO_BIN_EXE_idemflow"))
            .args(["reconcile", "--once", "--config"])
            .arg(&config)
            .env("DATABASE_URL", db)
            .env("STRIPE_API_KEY", FakeStripe::API_KEY)
            .output()
            .unwrap();
        assert_eq!(reconcile.status.code(), Some(0), "{name}: {reconcile:?}");
        let a = pay(&c, &second_base, &key, "acct_w", &card(700))
            .await
            .unwrap();
        assert!(a.status == 201 && a.replayed, "{name}: {a:?}");
    }
    assert_eq!(fake.ledger().len(), 1, "{name}: still one charge");
    second.kill().unwrap();
    second.wait().unwrap();
    eprintln!("{name}: 5 waiters in a second process, the first killed mid-charge: one charge");
}

/// The example as a process: SIGKILL mid-load, restart, `idemflow reconcile --once`, retry all.
#[cfg(all(unix, feature = "cli"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_process_then_reconcile_charges_every_key_once() {
    use std::process::Command;

    let service_bin = example_bin();
    let cli_bin = env!("CARGO_BIN_EXE_idemflow");

    let fake = FakeStripe::start().await.unwrap();
    fake.faults().set_latency(Duration::from_millis(250));
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("cards.db").display());

    let spawn = || spawn_example(&service_bin, &fake, &db, &[("IDEMFLOW_LEASE_SECS", "1")]);

    // Lost responses and 5xx before execution, spread over the load; three 500s in a row make
    // one call exhaust the adapter's attempts (an unknown outcome: 503, left for the sweeper).
    let f = fake.faults();
    for i in 0..12 {
        match i % 4 {
            0 => f.lose_next_response(),
            1 => f.server_error_next(500),
            2 => f.server_error_next(503),
            _ => f.lose_next_response(),
        };
    }
    f.server_error_next(500)
        .server_error_next(500)
        .server_error_next(500);

    const KEYS: usize = 40;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("order-{i:03}")).collect();
    let (mut child, base) = spawn();
    let c = client();
    let answered = Arc::new(AtomicUsize::new(0));
    let sem = Arc::new(tokio::sync::Semaphore::new(8));
    let mut load = tokio::task::JoinSet::new();
    for (i, key) in keys.iter().enumerate() {
        let (c, base, key, sem, answered) = (
            c.clone(),
            base.clone(),
            key.clone(),
            sem.clone(),
            answered.clone(),
        );
        load.spawn(async move {
            let _p = sem.acquire_owned().await.unwrap();
            let r = pay(&c, &base, &key, "acct_load", &card(1000 + i as u64)).await;
            if r.is_ok() {
                answered.fetch_add(1, Ordering::SeqCst);
            }
            r.map(|a| a.status).ok()
        });
    }
    // Kill it mid-load.
    let deadline = Instant::now() + Duration::from_secs(30);
    while answered.load(Ordering::SeqCst) < 12 {
        assert!(Instant::now() < deadline, "the service never answered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let mut first_pass = std::collections::BTreeMap::<String, usize>::new();
    while let Some(r) = load.join_next().await {
        let label = r.unwrap().map_or("no answer".to_owned(), |s| s.to_string());
        *first_pass.entry(label).or_default() += 1;
    }
    let charges_at_kill = fake.ledger().len();

    // What the kill left behind.
    let store = SqliteStore::connect(&db).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await; // leases run out
    let stuck = store.stats().await.unwrap().processing;

    let (mut child, base) = spawn();
    let config = dir.path().join("idemflow.toml");
    std::fs::write(
        &config,
        format!(
            "[[providers]]\nkind = \"stripe\"\nbase_url = \"{}\"\napi_key_env = \"STRIPE_API_KEY\"\n",
            fake.base_url()
        ),
    )
    .unwrap();
    let reconcile = Command::new(cli_bin)
        .args(["reconcile", "--once", "--config"])
        .arg(&config)
        .env("DATABASE_URL", &db)
        .env("STRIPE_API_KEY", FakeStripe::API_KEY)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&reconcile.stdout);
    let err = String::from_utf8_lossy(&reconcile.stderr);
    assert_eq!(reconcile.status.code(), Some(0), "reconcile: {out}\n{err}");
    let left = store.stats().await.unwrap().processing;
    assert_eq!(left, 0, "reconcile settled every stuck key: {out}");

    // Every key retried until it has its answer.
    let conflicts = AtomicUsize::new(0);
    let mut provider_ids = std::collections::BTreeSet::new();
    for (i, key) in keys.iter().enumerate() {
        let a = pay_until_settled(
            &c,
            &base,
            key,
            "acct_load",
            &card(1000 + i as u64),
            &conflicts,
        )
        .await;
        assert_eq!(a.status, 201, "{key}: {a:?}");
        assert_eq!(a.body["amount"], 1000 + i as u64);
        provider_ids.insert(a.body["provider_id"].as_str().unwrap().to_owned());
    }
    child.kill().unwrap();
    child.wait().unwrap();

    let ledger = fake.ledger().entries();
    let mut per_key = std::collections::BTreeMap::<String, usize>::new();
    for e in &ledger {
        *per_key
            .entry(e.idempotency_key.clone().unwrap_or_default())
            .or_default() += 1;
    }
    for key in &keys {
        let id = KeyId::new("acct_load".parse().unwrap(), key.parse().unwrap());
        let rec = store.get(&id).await.unwrap().unwrap();
        assert_eq!(rec.state, KeyState::Done, "{key}");
        assert_eq!(
            per_key.get(&rec.provider_key),
            Some(&1),
            "{key} charged exactly once"
        );
    }
    assert_eq!(ledger.len(), KEYS, "no key charged twice, none lost");
    assert_eq!(provider_ids.len(), KEYS);
    assert!(ledger.iter().all(|e| provider_ids.contains(&e.id)));
    eprintln!(
        "process test: {KEYS} keys; first pass {first_pass:?}; {charges_at_kill} charges when killed; \
         {stuck} keys processing after the kill, recovered by reconcile; {} charges in the end; \
         {} retries answered 409/503",
        ledger.len(),
        conflicts.load(Ordering::SeqCst)
    );
}
