//! The Redis store through Sentinel: URLs and options refused with typed errors, `WAIT` that too
//! few replicas meet (the claim given back before anything is sent, the finish reported), and a
//! failover under load: the primary killed with SIGKILL, a replica promoted, the store on the
//! primary the sentinels name without a restart, the acknowledged claims and finishes lost
//! counted with and without `WAIT`, and a provider that dedupes by key acting once per key all
//! the same; and a failover away from a primary that stays up, which the store leaves as soon
//! as the sentinels name another.
//!
//! The failover tests use their own master of the set (`IDEMFLOW_TEST_REDIS_SENTINEL_FAILOVER_URL`,
//! `idemflow-failover` in `.ci/redis-sentinel`), so they never fail over the primary the conformance
//! suites (`IDEMFLOW_TEST_REDIS_SENTINEL_URL`, `idemflow-ci`) are using at the same time.

use idemflow::store::FinishMode;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemflow::conformance::{Delegate, claim_for, done, id, unique};
use idemflow::provider::Resend;
use idemflow::store::redis::{
    RedisConfig, RedisConnection, RedisStore, SentinelConfig, SentinelConnection,
};
use idemflow::store::{ClaimOutcome, Finish, NewClaim};
use idemflow::testkit::FakeResend;
use idemflow::{
    Error, Execution, Idempotency, IdempotentRequest, KeyId, KeyState, Outcome, Providers, Store,
    StoreError, StoredResponse, Sweeper, async_trait, error::ReplicatedWrite, record::KeyRecord,
};
use serde_json::json;
use tokio::time::Instant;

use crate::support::backend_url;
use crate::support::redis::{
    SENTINEL_AUTH_URL_VAR, SENTINEL_FAILOVER_URL_VAR, SENTINEL_URL_VAR, store_at,
};

fn is_config(r: Result<RedisStore, StoreError>) -> bool {
    matches!(r, Err(StoreError::Config(_)))
}

/// Needs no server: every bad Sentinel URL or option is a `StoreError::Config`, before any
/// connection is tried.
#[tokio::test]
async fn bad_sentinel_urls_and_options_are_typed_errors() {
    for url in [
        "redis+sentinel://127.0.0.1:26401",
        "redis+sentinel://127.0.0.1:26401/",
        "redis+sentinel:///mymaster",
        "redis+sentinel://,/mymaster",
        "redis+sentinel://127.0.0.1:0/mymaster",
        "redis+sentinel://127.0.0.1:notaport/mymaster",
        "redis+sentinel://127.0.0.1/mymaster/notadb",
        "redis+sentinel://127.0.0.1/mymaster/0/extra",
        "redis+sentinel://127.0.0.1/mymaster?bogus=1",
        "redis+sentinel://127.0.0.1/mymaster?wait_replicas=x",
        "redis+sentinel://127.0.0.1/mymaster?wait_timeout_ms=5",
        "redis+sentinel://127.0.0.1/mymaster?wait_replicas=1&wait_timeout_ms=0",
        "redis+sentinel://:%zz@127.0.0.1/mymaster",
        "redis+sentinel://127.0.0.1/mymaster?sentinel_password=%zz",
        "redis+sentinel://127.0.0.1/mymaster?sentinel_pass=x",
        "redis://127.0.0.1:1/?wait_timeout_ms=5",
    ] {
        let r = RedisStore::connect(url).await;
        assert!(is_config(r), "{url}: not a configuration error");
        assert!(
            matches!(
                idemflow::store::connect(url).await,
                Err(StoreError::Config(_))
            ),
            "{url} through store::connect"
        );
    }
    let no_master = RedisConfig::new("shown").sentinel(SentinelConfig::new("", [("h", 1)]));
    assert!(is_config(RedisStore::connect_with(no_master).await));
    let nowhere = RedisConfig::new("shown")
        .sentinel(SentinelConfig::new("mymaster", Vec::<(String, u16)>::new()));
    assert!(is_config(RedisStore::connect_with(nowhere).await));
    let forever = RedisConfig::new("redis://127.0.0.1:1/").wait(1, Duration::ZERO);
    assert!(is_config(RedisStore::connect_with(forever).await));
    let both = RedisConfig::new("shown")
        .cluster(true)
        .sentinel(SentinelConfig::new("m", [("h", 1)]));
    assert!(is_config(RedisStore::connect_with(both).await));
    // A password never shows in the error, the sentinels' neither.
    let Err(e) = RedisStore::connect("redis+sentinel://:s3cret@h/").await else {
        panic!("a URL without a master name connected");
    };
    assert!(!e.to_string().contains("s3cret"), "{e}");
    let Err(e) = RedisStore::connect("redis+sentinel://h/?sentinel_password=s3cret").await else {
        panic!("a URL without a master name connected");
    };
    assert!(!e.to_string().contains("s3cret"), "{e}");
    // Parsed into the sentinels' own credentials, apart from the data nodes'.
    let (parsed, _) = SentinelConfig::parse_url(
        "redis+sentinel://app:data%40pw@h/m?sentinel_username=sent&sentinel_password=s%2Fpw",
    )
    .unwrap();
    assert_eq!(
        (
            parsed.username.as_deref(),
            parsed.password.as_deref(),
            parsed.sentinel_username.as_deref(),
            parsed.sentinel_password.as_deref()
        ),
        (Some("app"), Some("data@pw"), Some("sent"), Some("s/pw"))
    );
    let shown = format!("{parsed:?}");
    assert!(
        !shown.contains("data@pw") && !shown.contains("s/pw"),
        "{shown}"
    );
}

/// A Sentinel set whose sentinels and data nodes want passwords (`.ci/redis-sentinel-auth`):
/// with both passwords the store connects, claims and finishes, and its connection's watch asks
/// the sentinel which primary it names; without the sentinels' password it is a connection
/// error that says so, and with a wrong data password too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_with_passwords_are_reached_with_theirs() {
    let Some(url) = backend_url(SENTINEL_AUTH_URL_VAR) else {
        return;
    };
    let store = RedisStore::connect_with(RedisConfig::new(url.clone()).prefix(unique("auth")))
        .await
        .unwrap_or_else(|e| panic!("through a password-protected Sentinel: {e}"));
    store.migrate().await.unwrap();
    let idem = Idempotency::new(Arc::new(store));
    let request = || IdempotentRequest::new("acct", "k-auth", "send", &json!({"n": 1})).unwrap();
    let first = idem
        .execute(request(), |_| async {
            Outcome::Succeeded(StoredResponse::new(201).with_body("sent"))
        })
        .await
        .unwrap();
    assert!(!first.is_replay());
    let again = idem
        .execute(request(), |_| async { panic!("a replay runs nothing") })
        .await
        .unwrap();
    assert!(again.is_replay());
    // The connection's watch asks the sentinel which primary it names, with its password too.
    let (parsed, _) = SentinelConfig::parse_url(&url).unwrap();
    let (_, sentinel_port) = parsed.sentinels[0];
    let sentinel_pw = parsed.sentinel_password.clone().unwrap();
    until(
        "the watch asking the sentinel",
        Duration::from_secs(5),
        || {
            let sentinel_pw = sentinel_pw.clone();
            async move {
                let mut con = redis::Client::open(format!(
                    "redis://:{sentinel_pw}@127.0.0.1:{sentinel_port}/"
                ))
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
                let clients: String = redis::cmd("CLIENT")
                    .arg("LIST")
                    .query_async(&mut con)
                    .await
                    .unwrap();
                clients.contains("cmd=sentinel|master ")
            }
        },
    )
    .await;

    // Without the sentinels' password, the sentinels refuse: a connection error, no hang.
    let (mut no_sentinel_pw, _) = SentinelConfig::parse_url(&url).unwrap();
    assert!(
        no_sentinel_pw.sentinel_password.is_some(),
        "the URL carries it"
    );
    no_sentinel_pw.sentinel_password = None;
    let refused = RedisStore::connect_with(
        RedisConfig::new("redis+sentinel://(without the sentinels' password)")
            .sentinel(no_sentinel_pw),
    )
    .await;
    match &refused {
        Err(e @ StoreError::Connect { .. }) => {
            assert!(
                e.to_string().to_lowercase().contains("auth"),
                "the error names authentication: {e}"
            );
        }
        other => panic!("{other:?}"),
    }
    // With a wrong password on the data node: refused too.
    let (mut wrong_data_pw, _) = SentinelConfig::parse_url(&url).unwrap();
    wrong_data_pw.password = Some("not-the-password".to_owned());
    let refused = RedisStore::connect_with(
        RedisConfig::new("redis+sentinel://(a wrong data password)").sentinel(wrong_data_pw),
    )
    .await;
    assert!(
        matches!(refused, Err(StoreError::Connect { .. })),
        "{refused:?}"
    );
}

/// The set has two replicas: a store that asks three of them sees every claim and finish
/// acknowledged by fewer. The claim is given back (`failed{retryable}`) before the operation
/// runs, and a retry with a store that asks for no more than the set has runs it; a finish
/// stands on the primary and is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_too_few_replicas_acknowledge_are_typed_errors() {
    let Some(plain) = store_at(SENTINEL_URL_VAR, |c| c).await else {
        return;
    };
    let url = backend_url(SENTINEL_URL_VAR).unwrap();
    let strict = RedisStore::connect_with(
        RedisConfig::new(url)
            .prefix(plain.prefix())
            .wait(3, Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let not_replicated = |e: &StoreError, write: ReplicatedWrite| matches!(e, StoreError::NotReplicated { write: w, acknowledged, wanted: 3, .. } if *w == write && *acknowledged < 3);

    // Through the executor: the operation never runs.
    let runs = Arc::new(AtomicU64::new(0));
    let op = |runs: Arc<AtomicU64>| {
        move |_ctx| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Outcome::Succeeded(StoredResponse::new(201).with_body("sent"))
        }
    };
    let request = || IdempotentRequest::new("acct", "k-claim", "send", &json!({"n": 1})).unwrap();
    let e = Idempotency::new(Arc::new(strict.clone()))
        .execute(request(), op(runs.clone()))
        .await
        .unwrap_err();
    let Error::Store(inner) = &e else {
        panic!("not a store error: {e}")
    };
    assert!(not_replicated(inner, ReplicatedWrite::Claim), "{e}");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the operation ran");
    let answer = e.http_answer();
    assert_eq!((answer.status, answer.slug), (503, "store-not-replicated"));
    let key = id("acct", "k-claim");
    let given_back = plain.get(&key).await.unwrap().unwrap();
    assert_eq!(given_back.state, KeyState::Failed { retryable: true });
    // The retry runs it, once.
    let again = Idempotency::new(Arc::new(plain.clone()))
        .execute(request(), op(runs.clone()))
        .await
        .unwrap();
    assert!(matches!(again, Execution::Executed(_)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A finish: claimed without WAIT, finished with it.
    let fid = id(&unique("scope"), "k-finish");
    let ClaimOutcome::Claimed(lease) = plain
        .claim(&claim_for(&fid, "{}", Duration::from_secs(30)))
        .await
        .unwrap()
    else {
        panic!("a fresh key was not claimed")
    };
    let e = strict
        .finish(&fid, lease.token, &done(StoredResponse::new(200)))
        .await
        .unwrap_err();
    assert!(not_replicated(&e, ReplicatedWrite::Finish), "{e}");
    assert_eq!(
        plain.get(&fid).await.unwrap().unwrap().state,
        KeyState::Done
    );
}

// ---- the failover -------------------------------------------------------------------------

/// Records the claims and finishes the store acknowledged (returned as done).
#[derive(Debug)]
struct Acknowledged {
    inner: Arc<dyn Store>,
    claims: Mutex<HashSet<KeyId>>,
    finishes: Mutex<HashSet<KeyId>>,
}

#[async_trait]
impl Delegate for Acknowledged {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        let r = self.inner.claim(claim).await;
        if let Ok(ClaimOutcome::Claimed(_)) = &r {
            self.claims.lock().unwrap().insert(claim.id.clone());
        }
        r
    }

    async fn finish_as(
        &self,
        id: &KeyId,
        mode: FinishMode,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        let r = self.inner.finish_as(id, mode, finish).await;
        if r.is_ok() {
            self.finishes.lock().unwrap().insert(id.clone());
        }
        r
    }
}

/// One store under load: its name, its `WAIT`, the recorder, and what its calls answered.
struct Lane {
    name: &'static str,
    redis: RedisStore,
    recorded: Arc<Acknowledged>,
    idem: Idempotency,
    answers: Mutex<BTreeMap<&'static str, u64>>,
    next: AtomicU64,
}

impl Lane {
    fn count(&self, what: &'static str) {
        *self.answers.lock().unwrap().entry(what).or_default() += 1;
    }

    fn answered(&self, what: &'static str) -> u64 {
        self.answers.lock().unwrap().get(what).copied().unwrap_or(0)
    }
}

fn sentinel_of(con: &RedisConnection) -> SentinelConnection {
    match con {
        RedisConnection::Sentinel(c) => c.clone(),
        _ => panic!("not connected through Sentinel"),
    }
}

const BODY_TO: &str = "b@y.test";

fn email(key: &str) -> IdempotentRequest {
    let body = json!({"from": "a@x.test", "to": [BODY_TO], "subject": "Hi", "text": key});
    IdempotentRequest::new("failover", key, "email", &body).unwrap()
}

/// Sends one email for `key` through the lane; counts what it answered.
async fn send(lane: &Lane, resend: &Resend, key: &str) -> Result<Execution, Error> {
    let r = lane.idem.call(email(key), resend).await;
    lane.count(match &r {
        Ok(Execution::Executed(_)) => "executed",
        Ok(Execution::Replayed(_)) => "replayed",
        Err(Error::Store(StoreError::NotReplicated {
            write: ReplicatedWrite::Claim,
            ..
        })) => "claim not replicated",
        Err(Error::Store(StoreError::NotReplicated { .. })) => "finish not replicated",
        Err(Error::Store(_)) => "store error",
        Err(Error::InFlight { .. }) => "in flight",
        Err(Error::OutcomeUnknown { .. }) => "outcome unknown",
        Err(Error::FailedRetryable { .. }) => "failed retryable",
        Err(_) => "other error",
    });
    r
}

/// Waits until `check` holds, at most `bound`.
async fn until<F, Fut>(what: &str, bound: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + bound;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {bound:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A plain connection to one node or sentinel.
async fn node(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The primary's port the sentinels name for `master` (the first that answers).
async fn named_primary(sentinels: &[(String, u16)], master: &str) -> Option<u16> {
    for (_, port) in sentinels {
        let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}/")) else {
            continue;
        };
        let Ok(mut con) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        let addr: redis::RedisResult<Option<(String, u16)>> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(master)
            .query_async(&mut con)
            .await;
        if let Ok(Some((_, p))) = addr {
            return Some(p);
        }
    }
    None
}

/// One field of `INFO <section>` of the node on `port`.
async fn info_field(port: u16, section: &str, field: &str) -> Option<String> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let mut con = client.get_multiplexed_async_connection().await.ok()?;
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query_async(&mut con)
        .await
        .ok()?;
    info.lines().find_map(|l| {
        l.strip_prefix(field)
            .and_then(|r| r.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
    })
}

/// `CONFIG GET name` on the node on `port`.
async fn config_get(port: u16, name: &str) -> String {
    let (_, v): (String, String) = redis::cmd("CONFIG")
        .arg("GET")
        .arg(name)
        .query_async(&mut node(port).await)
        .await
        .unwrap();
    v
}

/// The failover tests share the `idemflow-failover` master: one at a time.
static FAILOVER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Kills the primary with SIGKILL mid-load (see [`failover`]), the replicas keeping up as they
/// do on loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_under_load_loses_no_write_acknowledged_by_every_replica() {
    failover(None).await;
}

/// The same with the replicas cut off: both stopped (SIGSTOP), their links dropped by the
/// primary, which keeps answering for 300 ms (less than the sentinels'
/// `down-after-milliseconds`), then the primary killed and the replicas resumed. What the
/// primary acknowledged in those 300 ms is on no replica: without `WAIT` it is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_after_replication_lag_loses_no_write_acknowledged_by_every_replica() {
    failover(Some(Duration::from_millis(300))).await;
}

/// Resumes stopped processes (SIGCONT) when dropped, also when the test fails.
struct Stopped(Vec<String>);

impl Drop for Stopped {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = Command::new("kill").args(["-CONT", pid]).status();
        }
    }
}

/// The ports of the replicas the primary on `port` lists.
async fn replica_ports(port: u16) -> Vec<u16> {
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut node(port).await)
        .await
        .unwrap();
    info.lines()
        .filter(|l| l.starts_with("slave"))
        .filter_map(|l| {
            l.split(',')
                .find_map(|f| f.strip_prefix("port="))
                .and_then(|p| p.parse().ok())
        })
        .collect()
}

/// How many replicas the primary on `port` lists as online (0 if it does not answer).
async fn online_replicas(port: u16) -> usize {
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}/")) else {
        return 0;
    };
    let Ok(mut con) = client.get_multiplexed_async_connection().await else {
        return 0;
    };
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut con)
        .await
        .unwrap_or_default();
    info.lines()
        .filter(|l| l.starts_with("slave") && l.contains("state=online"))
        .count()
}

/// The port of the primary every sentinel names for `master`, if they all answer, agree, and
/// the node says it is a primary; `None` while they disagree (a failover under way).
async fn agreed_primary(sentinels: &[(String, u16)], master: &str) -> Option<u16> {
    let mut agreed = None;
    for (host, port) in sentinels {
        let named = named_primary(&[(host.clone(), *port)], master).await?;
        if *agreed.get_or_insert(named) != named {
            return None;
        }
    }
    let primary = agreed?;
    (info_field(primary, "replication", "role").await.as_deref() == Some("master"))
        .then_some(primary)
}

/// Waits until the set of `master` is whole (the sentinels agree on a primary that lists two
/// replicas online) and returns the primary's port.
async fn whole_set(sentinels: &[(String, u16)], master: &str) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(p) = agreed_primary(sentinels, master).await
            && online_replicas(p).await == 2
        {
            return p;
        }
        assert!(
            Instant::now() < deadline,
            "the set of {master} not whole within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A failover away from a primary that stays up (`SENTINEL FAILOVER`; under load the sentinels
/// also fail over a second time from a freshly promoted node that was slow, not dead): Sentinel
/// leaves the old node a primary, answering writes, for about ten seconds before it turns it
/// into a replica and drops its clients, and what is written there meanwhile is lost when it
/// does. The store leaves it as soon as the sentinels name another primary, while it still
/// answers as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_leaves_a_primary_the_sentinels_no_longer_name() {
    let _one_at_a_time = FAILOVER.lock().await;
    let Some(url) = backend_url(SENTINEL_FAILOVER_URL_VAR) else {
        return;
    };
    let (sentinel, _) = SentinelConfig::parse_url(&url).unwrap();
    let master = sentinel.master.clone();
    let old = whole_set(&sentinel.sentinels, &master).await;
    let Some(store) = store_at(SENTINEL_FAILOVER_URL_VAR, |c| c).await else {
        return;
    };
    let con = sentinel_of(&store.connection());
    let scope = unique("leave");
    let claim = |n: u32| {
        claim_for(
            &id(&scope, &format!("k-{n}")),
            "{}",
            Duration::from_secs(30),
        )
    };
    assert!(matches!(
        store.claim(&claim(0)).await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    assert_eq!(con.primary(), format!("127.0.0.1:{old}"));

    // The first sentinel promotes a replica, without asking the others.
    let (_, first) = &sentinel.sentinels[0];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r: redis::RedisResult<String> = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(&master)
            .query_async(&mut node(*first).await)
            .await;
        match r {
            Ok(_) => break,
            // INPROG, NOGOODSLAVE: a failover or a resynchronisation still under way.
            Err(e) => {
                assert!(Instant::now() < deadline, "SENTINEL FAILOVER: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    let new = loop {
        match agreed_primary(&sentinel.sentinels, &master).await {
            Some(p) if p != old => break p,
            _ => {
                assert!(Instant::now() < deadline, "no replica promoted within 30 s");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let switched = Instant::now();

    // The old primary still answers as one for about ten seconds; the store's next writes go to
    // the new primary well before.
    let mut n = 0;
    until(
        "the store on the primary the sentinels name",
        Duration::from_secs(6),
        || {
            n += 1;
            let (store, claim) = (store.clone(), claim(n));
            let con = con.clone();
            async move {
                let _ = store.claim(&claim).await;
                con.primary() == format!("127.0.0.1:{new}")
            }
        },
    )
    .await;
    let left_after = switched.elapsed();
    assert_eq!(
        info_field(old, "replication", "role").await.as_deref(),
        Some("master"),
        "Sentinel turned the old primary into a replica before the store left it ({left_after:?} after the switch): this run shows nothing"
    );
    let fresh = id(&scope, "after");
    assert!(matches!(
        store
            .claim(&claim_for(&fresh, "{}", Duration::from_secs(30)))
            .await
            .unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    let on_new: bool = redis::cmd("EXISTS")
        .arg(store.record_key(&fresh))
        .query_async(&mut node(new).await)
        .await
        .unwrap();
    assert!(on_new, "a claim after the switch is not on the new primary");
    eprintln!(
        "failover away from a live primary: 127.0.0.1:{old} -> 127.0.0.1:{new}; the store left it {left_after:?} after the sentinels agreed"
    );

    // Sentinel turns the old primary into a replica: the set is whole again for the next test.
    assert_eq!(whole_set(&sentinel.sentinels, &master).await, new);
}

/// Kills the primary of the `idemflow-failover` master with SIGKILL under load from three stores
/// (no `WAIT`, `WAIT 1`, `WAIT 2`), after stopping its replicas for `lag` if given, restarts it
/// as a replica of the promoted one, then counts, per store, the claims and finishes it had
/// acknowledged that the new primary does not hold, and retries every key: a provider that
/// dedupes by key (the fake Resend) has sent each email once.
async fn failover(lag: Option<Duration>) {
    let _one_at_a_time = FAILOVER.lock().await;
    let Some(url) = backend_url(SENTINEL_FAILOVER_URL_VAR) else {
        return;
    };
    let started = Instant::now();
    let (sentinel, _) = SentinelConfig::parse_url(&url).unwrap();
    let master = sentinel.master.clone();
    let mut lanes = Vec::new();
    for (name, wait) in [("no WAIT", None), ("WAIT 1", Some(1)), ("WAIT 2", Some(2))] {
        let Some(redis) = store_at(SENTINEL_FAILOVER_URL_VAR, |c| {
            let c = c.response_timeout(Duration::from_secs(2));
            match wait {
                Some(n) => c.wait(n, Duration::from_millis(500)),
                None => c,
            }
        })
        .await
        else {
            return;
        };
        let recorded = Arc::new(Acknowledged {
            inner: Arc::new(redis.clone()),
            claims: Mutex::new(HashSet::new()),
            finishes: Mutex::new(HashSet::new()),
        });
        // The replay cache off: a retry must reach the store, so that a record the failover
        // lost is seen lost and run again (a process that cached the answer gives it back
        // instead, `docs/design.md`, "Replays from memory").
        let idem = Idempotency::new(recorded.clone())
            .lease(Duration::from_secs(3))
            .replay_cache_bytes(0);
        lanes.push(Arc::new(Lane {
            name,
            redis,
            recorded,
            idem,
            answers: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
        }));
    }
    let fake = FakeResend::start().await.unwrap();
    let resend = Arc::new(Resend::with_base_url(fake.base_url(), FakeResend::API_KEY).unwrap());

    // The load: four workers per store, each sending emails on fresh keys until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for lane in &lanes {
        for w in 0..4 {
            let (lane, resend, stop) = (lane.clone(), resend.clone(), stop.clone());
            workers.push(tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let n = lane.next.fetch_add(1, Ordering::SeqCst);
                    let key = format!("{}-{w}-{n}", lane.name.replace(' ', "_"));
                    if send(&lane, &resend, &key).await.is_err() {
                        // The store is failing over: do not spin.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }));
        }
    }
    let executed = |lanes: &[Arc<Lane>]| -> Vec<u64> {
        lanes.iter().map(|l| l.answered("executed")).collect()
    };
    until("load before the kill", Duration::from_secs(20), || {
        let done = executed(&lanes);
        async move { done.iter().all(|n| *n >= 30) }
    })
    .await;

    // Kill the primary (SIGKILL, its pid from INFO server), remembering how to start it again.
    let old = named_primary(&sentinel.sentinels, &master).await.unwrap();
    let (dir, logfile, pidfile) = (
        config_get(old, "dir").await,
        config_get(old, "logfile").await,
        config_get(old, "pidfile").await,
    );
    let pid = info_field(old, "server", "process_id").await.unwrap();
    let before_kill = executed(&lanes);
    let connections: Vec<u64> = lanes
        .iter()
        .map(|l| sentinel_of(&l.redis.connection()).connections())
        .collect();
    let mut stopped = Stopped(Vec::new());
    if let Some(lag) = lag {
        for replica in replica_ports(old).await {
            let pid = info_field(replica, "server", "process_id").await.unwrap();
            assert!(
                Command::new("kill")
                    .args(["-STOP", &pid])
                    .status()
                    .unwrap()
                    .success()
            );
            stopped.0.push(pid);
        }
        assert_eq!(stopped.0.len(), 2, "the primary does not list two replicas");
        // The primary drops its links to the stopped replicas (which cannot reconnect while
        // stopped): what it acknowledges from now on reaches no replica, not even a socket
        // buffer a resumed replica would still read.
        let dropped: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("replica")
            .query_async(&mut node(old).await)
            .await
            .unwrap();
        assert_eq!(dropped, 2, "replica links dropped");
        tokio::time::sleep(lag).await;
    }
    let killed = Instant::now();
    assert!(
        Command::new("kill")
            .args(["-KILL", &pid])
            .status()
            .unwrap()
            .success()
    );
    drop(stopped);

    // The sentinels promote a replica; start the killed node again as its replica, so that
    // `WAIT 2` can be met again and the set is whole for the next run.
    let deadline = Instant::now() + Duration::from_secs(30);
    let new = loop {
        match named_primary(&sentinel.sentinels, &master).await {
            Some(p) if p != old => break p,
            _ => {
                assert!(Instant::now() < deadline, "no replica promoted within 30 s");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let promoted_after = killed.elapsed();
    let port = old.to_string();
    let new_port = new.to_string();
    let status = Command::new("redis-server")
        .args([
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--dir", &dir, "--logfile", &logfile, "--pidfile", &pidfile])
        .args(["--daemonize", "yes", "--repl-diskless-sync", "yes"])
        .args(["--repl-diskless-sync-delay", "0"])
        .args(["--replicaof", "127.0.0.1", &new_port])
        .status()
        .unwrap();
    assert!(status.success(), "redis-server did not start again");

    // Every store works again, without a restart: 30 more executions each.
    until("load after the kill", Duration::from_secs(30), || {
        let done = executed(&lanes);
        let before = before_kill.clone();
        async move { done.iter().zip(&before).all(|(n, b)| *n >= b + 30) }
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }
    for (lane, before) in lanes.iter().zip(&connections) {
        let con = sentinel_of(&lane.redis.connection());
        assert!(
            con.connections() > *before,
            "{}: never reconnected",
            lane.name
        );
    }

    // The set is whole again: the sentinels agree on a primary that lists two replicas online,
    // so the killed node is back (so `WAIT 2` can be met, and the set is whole for the next
    // run). It need not be `new`: under load the sentinels may fail over again, from a freshly
    // promoted node that answered its first pings late, and may even promote the restarted one.
    let now = whole_set(&sentinel.sentinels, &master).await;
    // Every store is on the primary the sentinels name now, by its next command at the latest.
    for lane in &lanes {
        let con = sentinel_of(&lane.redis.connection());
        let probe = id("failover", "probe");
        until(
            &format!("{} on the primary the sentinels name", lane.name),
            Duration::from_secs(10),
            || {
                let (redis, con, probe) = (lane.redis.clone(), con.clone(), probe.clone());
                let sentinels = sentinel.sentinels.clone();
                let master = master.clone();
                async move {
                    let _ = redis.get(&probe).await;
                    agreed_primary(&sentinels, &master)
                        .await
                        .is_some_and(|p| con.primary() == format!("127.0.0.1:{p}"))
                }
            },
        )
        .await;
    }

    // What the new primary lost of what each store had acknowledged.
    let mut figures = Vec::new();
    for lane in &lanes {
        let claims: Vec<KeyId> = lane
            .recorded
            .claims
            .lock()
            .unwrap()
            .iter()
            .cloned()
            .collect();
        let finishes: HashSet<KeyId> = lane.recorded.finishes.lock().unwrap().clone();
        let (mut lost_claims, mut lost_finishes) = (0, 0);
        for id in &claims {
            let now = lane.redis.get(id).await.unwrap();
            match now {
                None => {
                    lost_claims += 1;
                    if finishes.contains(id) {
                        lost_finishes += 1;
                    }
                }
                Some(r) if finishes.contains(id) && r.state == KeyState::Processing => {
                    lost_finishes += 1
                }
                Some(_) => {}
            }
        }
        figures.push((
            lane.name,
            claims.len(),
            finishes.len(),
            lost_claims,
            lost_finishes,
        ));
    }

    // Every key again, until each has its answer: replayed where the record survived, run
    // again with the same provider key where it was lost, settled by the sweeper (a re-drive
    // with the same provider key) where it was left processing.
    let mut provider_keys = vec![Vec::new(); lanes.len()];
    for (i, lane) in lanes.iter().enumerate() {
        let sweeper = Sweeper::new(lane.recorded.clone(), Providers::new().with(resend.clone()));
        let keys: Vec<KeyId> = lane
            .recorded
            .claims
            .lock()
            .unwrap()
            .iter()
            .cloned()
            .collect();
        for id in keys {
            let key = id.key.as_str().to_owned();
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match send(lane, &resend, &key).await {
                    Ok(_) => break,
                    Err(e) => {
                        assert!(Instant::now() < deadline, "{key}: no answer: {e}");
                        if matches!(e, Error::OutcomeUnknown { .. })
                            && let Err(e) = sweeper.run_once().await
                        {
                            eprintln!("sweep failed, retrying: {e}");
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            let record = lane.redis.get(&id).await.unwrap().unwrap();
            assert_eq!(record.state, KeyState::Done, "{key}");
            assert_eq!(
                fake.ledger().count_for_key(&record.provider_key),
                1,
                "{key}: the provider acted more than once"
            );
            provider_keys[i].push(record.provider_key);
        }
    }
    // How often each provider key was sent: what a provider without keys would have done.
    let mut sends: HashMap<String, u64> = HashMap::new();
    for r in fake.requests() {
        if r.method == "POST"
            && let Some(k) = r.header("idempotency-key")
        {
            *sends.entry(k.to_owned()).or_default() += 1;
        }
    }
    let resent: Vec<(usize, u64)> = provider_keys
        .iter()
        .map(|keys| {
            let again: Vec<u64> = keys
                .iter()
                .map(|k| sends.get(k).copied().unwrap_or(0))
                .filter(|n| *n > 1)
                .collect();
            (again.len(), again.iter().map(|n| n - 1).sum())
        })
        .collect();

    eprintln!(
        "failover (replicas stopped before the kill: {lag:?}): primary 127.0.0.1:{old} killed, 127.0.0.1:{new} named after {promoted_after:?}, 127.0.0.1:{now} named at the end; test took {:?}",
        started.elapsed()
    );
    for ((name, claims, finishes, lost_claims, lost_finishes), (lane, (keys, extra))) in
        figures.iter().zip(lanes.iter().zip(&resent))
    {
        eprintln!(
            "failover [{name}]: acknowledged {claims} claims, {finishes} finishes; lost {lost_claims} claims, {lost_finishes} finishes; {keys} keys sent to the provider more than once ({extra} extra sends, each deduped by its provider key; the sweeper never re-sends to a provider without keys, but a retry of a lost record would); answers {:?}",
            lane.answers.lock().unwrap()
        );
    }
    // WAIT 2 asks every replica of the set: the promoted one holds every write it acknowledged.
    let (_, claims, finishes, lost_claims, lost_finishes) = figures[2];
    assert!(claims > 0 && finishes > 0);
    assert_eq!(
        (lost_claims, lost_finishes),
        (0, 0),
        "WAIT 2 lost acknowledged writes"
    );
}
