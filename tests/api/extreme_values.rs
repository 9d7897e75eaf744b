//! Every public builder with the extreme values a user can pass (zero, one nanosecond,
//! `Duration::MAX`, `0`, `usize::MAX`, empty strings), then used: each setting is either
//! capped or refused with a typed error, and nothing panics or hangs. A panic fails the test
//! where it happens; a hang fails it at its bound.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idemflow::conformance::fake::FakeProvider;
use idemflow::consumer::{Consumer, Disposition, Message};
use idemflow::store::sqlite::{SqliteConfig, SqliteStore};
use idemflow::{
    Error, Idempotency, IdempotentRequest, Outcome, Providers, Store, StoredResponse, Sweeper,
    key::Scope,
};
use serde_json::json;

const DURATIONS: [Duration; 3] = [Duration::ZERO, Duration::from_nanos(1), Duration::MAX];
const SIZES: [usize; 3] = [0, 1, usize::MAX];

/// Runs `f`, failing the test if it takes longer than a minute (a hang).
async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within a minute"))
}

async fn store() -> Arc<dyn Store> {
    let dir = tempfile::tempdir().unwrap().keep();
    let url = format!("sqlite://{}", dir.join("extreme.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    Arc::new(store)
}

fn request(key: &str) -> IdempotentRequest {
    IdempotentRequest::new("extreme", key, "op", &json!({ "key": key })).unwrap()
}

fn ok() -> Outcome {
    Outcome::Succeeded(StoredResponse::json(200, &json!({"ok": true})).unwrap())
}

/// The executor's paths with `idem`: a new key, its replay, a duplicate while the first runs,
/// an unknown outcome and a retryable one. Each answers (an execution or a typed error).
async fn exercise(what: &str, idem: &Idempotency) {
    let key = |k: &str| {
        format!(
            "{k}-{}",
            what.replace(|c: char| !c.is_ascii_alphanumeric(), "")
        )
    };
    let first = bounded(what, idem.execute(request(&key("new")), |_| async { ok() })).await;
    let again = bounded(what, idem.execute(request(&key("new")), |_| async { ok() })).await;
    if let (Ok(_), Err(e)) = (&first, &again) {
        // Only an expired answer (retention zero) or a lost lease may turn a replay away.
        assert!(
            !matches!(e, Error::FingerprintMismatch { .. }),
            "{what}: {e}"
        );
    }
    let slow = {
        let idem = idem.clone();
        let k = key("dup");
        tokio::spawn(async move {
            idem.execute(request(&k), |_| async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                ok()
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let _ = bounded(what, idem.execute(request(&key("dup")), |_| async { ok() })).await;
    let _ = bounded(what, slow).await.expect("the first run panicked");
    let unknown = bounded(
        what,
        idem.execute(request(&key("unknown")), |_| async {
            Outcome::unknown("timed out")
        }),
    )
    .await;
    assert!(unknown.is_err(), "{what}: {unknown:?}");
    let retry = bounded(
        what,
        idem.execute(request(&key("retry")), |_| async {
            Outcome::retryable("429")
        }),
    )
    .await;
    assert!(retry.is_err(), "{what}: {retry:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executor_settings_at_their_extremes() {
    let store = store().await;
    let idem = || Idempotency::new(store.clone());
    for d in DURATIONS {
        exercise(&format!("lease {d:?}"), &idem().lease(d)).await;
        exercise(&format!("retention {d:?}"), &idem().retention(d)).await;
        exercise(
            &format!("takeover window {d:?}"),
            &idem().retry_takeover_window(Some(d)),
        )
        .await;
        exercise(
            &format!("in-flight retry-after {d:?}"),
            &idem().in_flight_retry_after(d),
        )
        .await;
        exercise(&format!("wait {d:?}"), &idem().wait_in_flight(Some(d))).await;
        exercise(
            &format!("unknown retry-after {d:?}"),
            &idem().unknown_retry_after(d),
        )
        .await;
    }
    for n in SIZES {
        exercise(&format!("request bytes {n}"), &idem().max_request_bytes(n)).await;
        exercise(
            &format!("response bytes {n}"),
            &idem().max_response_bytes(n),
        )
        .await;
        exercise(
            &format!("waiters {n}"),
            &idem()
                .wait_in_flight(Some(Duration::MAX))
                .max_in_flight_waiters(n),
        )
        .await;
    }
    exercise("owner empty", &idem().owner("")).await;
    exercise(
        "stored headers empty",
        &idem().stored_headers(Some(vec![String::new()])),
    )
    .await;
}

#[tokio::test]
async fn requests_with_empty_or_huge_parts_are_refused_by_name() {
    let body = json!({});
    assert!(IdempotentRequest::new("", "k", "op", &body).is_err());
    assert!(IdempotentRequest::new("s", "", "op", &body).is_err());
    assert!(IdempotentRequest::new("s", &"k".repeat(100_000), "op", &body).is_err());
    // An empty operation or provider name is a name like any other.
    let _ = IdempotentRequest::new("s", "k", "", &body);
    let _ = IdempotentRequest::new("s", "k", "op", &body).map(|r| r.provider("").provider_key(""));
}

/// A key the sweeper can take: claimed for `provider`, its worker cut off mid-call, its lease
/// run out.
async fn stuck_key(store: &Arc<dyn Store>, provider: &FakeProvider, key: &str) {
    use idemflow::Provider;
    use idemflow::conformance::sweeper::{cut_when, hang_after};
    let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(1));
    let req = request(key);
    let pk = provider
        .key_spec()
        .derive(&req.id().scope, &req.id().key, req.operation());
    let (at, reached) = tokio::sync::oneshot::channel();
    cut_when(
        idem.execute(
            req.provider(provider.name()).provider_key(pk),
            hang_after(at),
        ),
        reached,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeper_settings_at_their_extremes() {
    let store = store().await;
    let provider = FakeProvider::keyed("fake", Duration::from_secs(3600));
    let sweeper = || {
        Sweeper::new(
            store.clone(),
            Providers::new().with(provider.clone() as Arc<dyn idemflow::Provider>),
        )
    };
    let mut runs: Vec<(String, Sweeper)> = Vec::new();
    for d in DURATIONS {
        runs.push((format!("lease {d:?}"), sweeper().lease(d)));
        runs.push((format!("backoff {d:?}"), sweeper().backoff(d, d)));
        runs.push((
            format!("operator recheck {d:?}"),
            sweeper().operator_recheck(d),
        ));
        runs.push((
            format!("re-drive margin {d:?}"),
            sweeper().redrive_margin(d),
        ));
        runs.push((format!("call timeout {d:?}"), sweeper().call_timeout(d)));
    }
    for n in [0, 1, u32::MAX] {
        runs.push((format!("batch {n}"), sweeper().batch_size(n)));
    }
    for n in [0, 1, u64::MAX] {
        runs.push((format!("keys per run {n}"), sweeper().max_keys_per_run(n)));
    }
    runs.push(("owner empty".into(), sweeper().owner("")));
    for (i, (what, sweeper)) in runs.into_iter().enumerate() {
        stuck_key(&store, &provider, &format!("stuck-{i}")).await;
        let report = bounded(&what, sweeper.run_once()).await;
        let Ok(report) = report else {
            panic!("{what}: {report:?}");
        };
        assert!(
            report.taken >= 1,
            "{what}: the stuck key was not taken: {report:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_settings_at_their_extremes() {
    let dir = tempfile::tempdir().unwrap();
    let mut configs: Vec<(String, SqliteConfig)> = Vec::new();
    for (i, d) in DURATIONS.into_iter().enumerate() {
        let url = |n: &str| {
            format!(
                "sqlite://{}",
                dir.path().join(format!("{n}-{i}.db")).display()
            )
        };
        configs.push((
            format!("phase timeout {d:?}"),
            SqliteConfig::new(url("phase")).phase_timeout(d),
        ));
        configs.push((
            format!("busy timeout {d:?}"),
            SqliteConfig::new(url("busy")).busy_timeout(d),
        ));
    }
    for n in [0, 1, u32::MAX] {
        let url = format!(
            "sqlite://{}",
            dir.path().join(format!("readers-{n}.db")).display()
        );
        configs.push((format!("readers {n}"), SqliteConfig::new(url).readers(n)));
    }
    for (what, config) in configs {
        let store = match bounded(&what, SqliteStore::connect_with(config)).await {
            Ok(store) => store,
            // Refused by name, before anything else runs: nothing else to use.
            Err(e) => {
                assert!(matches!(e, idemflow::StoreError::Config(_)), "{what}: {e}");
                continue;
            }
        };
        bounded(&what, store.migrate()).await.unwrap();
        let phase = store.atomic_phase(|_conn| Box::pin(async { Ok(StoredResponse::new(201)) }));
        let idem = Idempotency::new(Arc::new(store));
        let atomic = bounded(&what, idem.execute_atomic(request("atomic"), phase)).await;
        let _ = atomic;
        exercise(&what, &idem).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_settings_at_their_extremes() {
    let store = store().await;
    let idem = Idempotency::new(store);
    let mut consumers = Vec::new();
    for n in SIZES {
        consumers.push((format!("concurrency {n}"), n, Duration::from_secs(1)));
    }
    for d in DURATIONS {
        consumers.push((format!("retry after {d:?}"), 16, d));
    }
    for (i, (what, n, after)) in consumers.into_iter().enumerate() {
        let consumer = Consumer::new(idem.clone(), Scope::new("queue").unwrap(), |_, _| async {
            Outcome::retryable("try again")
        })
        .concurrency(n)
        .retry_after(after);
        let message = Message::new(b"{}".to_vec()).with_message_id(format!("m-{i}"));
        let disposition = bounded(&what, consumer.handle(message)).await;
        assert!(
            matches!(disposition, Disposition::Redeliver { .. }),
            "{what}: {disposition:?}"
        );
        // A message without a key, and one with an empty id.
        let _ = bounded(&what, consumer.handle(Message::new(Vec::new()))).await;
        let _ = bounded(
            &what,
            consumer.handle(Message::new(Vec::new()).with_message_id("")),
        )
        .await;
    }
}

#[cfg(feature = "axum")]
mod axum_settings {
    use super::*;
    use ::axum::Router;
    use ::axum::body::Body;
    use ::axum::http::Request;
    use ::axum::routing::post;
    use idemflow::axum::{IdempotencyLayer, ScopeSource};
    use idemflow::provider::stripe_signature::StripeSignature;
    use tower::ServiceExt;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn layer_settings_at_their_extremes() {
        let store = store().await;
        let mut layers = Vec::new();
        for n in SIZES {
            layers.push((
                format!("body bytes {n}"),
                IdempotencyLayer::new(
                    Idempotency::new(store.clone()),
                    ScopeSource::fixed(Scope::new("s").unwrap()),
                )
                .max_body_bytes(n),
            ));
        }
        for d in DURATIONS {
            layers.push((
                format!("wait {d:?}"),
                IdempotencyLayer::new(
                    Idempotency::new(store.clone()),
                    ScopeSource::fixed(Scope::new("s").unwrap()),
                )
                .wait_in_flight(Some(d)),
            ));
        }
        for (i, (what, layer)) in layers.into_iter().enumerate() {
            let app = Router::new()
                .route("/pay", post(|| async { "paid" }))
                .layer(layer);
            for key in [format!("k-{i}"), String::new()] {
                let req = Request::post("/pay")
                    .header("Idempotency-Key", key)
                    .header("content-type", "application/json")
                    .body(Body::from("{}"))
                    .unwrap();
                let res = bounded(&what, app.clone().oneshot(req)).await.unwrap();
                assert!(res.status().as_u16() < 600, "{what}");
            }
        }
    }

    #[test]
    fn signature_settings_at_their_extremes() {
        for d in DURATIONS {
            for secret in ["", "whsec_x"] {
                let scheme = StripeSignature::new(secret).tolerance(d);
                for header in [&b""[..], b"t=1,v1=00", b"t=99999999999999999999,v1=ab"] {
                    let _ = scheme.verify(Some(header), b"{}", i64::MAX);
                    let _ = scheme.verify(Some(header), b"{}", i64::MIN);
                }
            }
        }
    }

    #[test]
    fn a_problem_retry_after_of_any_length_is_a_header() {
        for d in DURATIONS {
            let value = idemflow::axum::retry_after_value(d);
            assert!(!value.is_empty(), "{d:?}");
        }
    }
}

#[cfg(feature = "http")]
mod provider_settings {
    use super::*;
    use chrono::Utc;
    use idemflow::provider::http::HttpConfig;
    use idemflow::provider::{Attempts, Provider, Stripe};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn adapter_settings_at_their_extremes() {
        let mut configs = Vec::new();
        for d in DURATIONS {
            configs.push(HttpConfig {
                connect_timeout: d,
                request_timeout: d,
                max_attempts: 2,
                ..HttpConfig::default()
            });
            configs.push(HttpConfig {
                initial_backoff: d,
                max_backoff: d,
                max_retry_after: d,
                max_attempts: 2,
                connect_timeout: Duration::from_millis(200),
                ..HttpConfig::default()
            });
        }
        for n in [0, 1, u32::MAX] {
            configs.push(HttpConfig {
                max_attempts: n,
                connect_timeout: Duration::from_millis(200),
                initial_backoff: Duration::ZERO,
                max_backoff: Duration::ZERO,
                ..HttpConfig::default()
            });
        }
        configs.push(HttpConfig {
            user_agent: String::new(),
            ..HttpConfig::default()
        });
        // Nothing listens on port 1: every send is refused before anything is sent.
        for config in configs {
            let what = format!("{config:?}");
            let stripe = match Stripe::with_base_url("http://127.0.0.1:1", "sk_test_x")
                .unwrap()
                .http_config(config)
            {
                Ok(stripe) => stripe,
                Err(e) => {
                    assert!(
                        matches!(e, idemflow::provider::http::HttpError::InvalidConfig { .. }),
                        "{what}: {e}"
                    );
                    continue;
                }
            };
            for d in DURATIONS {
                let stripe = stripe.clone().search_lag(d);
                let _ = bounded(&what, stripe.send("k", &json!({"amount": 1}))).await;
                let _ = bounded(
                    &what,
                    stripe.lookup("k", &json!({}), Attempts::once(Utc::now()), Utc::now()),
                )
                .await;
            }
        }
        // Every other adapter's durations, through a lookup and a sweep of a key of each.
        use idemflow::provider::{Adyen, PayPal, Postmark, Resend, Square};
        for d in DURATIONS {
            let base = "http://127.0.0.1:1";
            let adapters: Vec<Arc<dyn Provider>> = vec![
                Arc::new(Adyen::with_base_url(base, "k").unwrap().redrive_margin(d)),
                Arc::new(
                    PayPal::with_base_url(base, "k")
                        .unwrap()
                        .retention(d)
                        .redrive_margin(d),
                ),
                Arc::new(
                    Resend::with_base_url(base, "re_k")
                        .unwrap()
                        .redrive_margin(d),
                ),
                Arc::new(Postmark::with_base_url(base, "k").unwrap().search_lag(d)),
                Arc::new(
                    Square::with_base_url(base, "k")
                        .unwrap()
                        .processing_window(d),
                ),
                Arc::new(
                    Stripe::with_base_url(base, "sk_test_x")
                        .unwrap()
                        .search_lag(d),
                ),
            ];
            let store = store().await;
            for adapter in adapters {
                let what = format!("{} {d:?}", adapter.name());
                let long_ago = Attempts::once(Utc::now() - chrono::Duration::days(400));
                for attempts in [Attempts::once(Utc::now()), long_ago] {
                    let _ = bounded(
                        &what,
                        adapter.lookup("k", &json!({"amount": 1}), attempts, Utc::now()),
                    )
                    .await;
                }
                let _ = adapter.key_spec().derive(
                    &Scope::new("s").unwrap(),
                    &idemflow::key::IdempotencyKey::new("k").unwrap(),
                    "op",
                );
                let req = request(&format!("adapter-{}", adapter.name())).provider(adapter.name());
                let idem = Idempotency::new(store.clone()).lease(Duration::from_millis(1));
                let _ = bounded(&what, idem.call(req, adapter.as_ref())).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
                let sweep = Sweeper::new(store.clone(), Providers::new().with(adapter.clone()))
                    .redrive_margin(d)
                    .call_timeout(Duration::from_secs(5));
                let report = bounded(&what, sweep.run_once()).await;
                assert!(report.is_ok(), "{what}: {report:?}");
            }
        }
        assert!(Stripe::with_base_url("http://127.0.0.1:1", "").is_err());
        assert!(Stripe::with_base_url("", "sk_test_x").is_err());
    }
}

#[cfg(feature = "redis")]
mod redis_settings {
    use super::*;
    use idemflow::store::redis::{RedisConfig, RedisStore};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_settings_at_their_extremes() {
        let Some(url) = crate::support::backend_url("IDEMFLOW_TEST_REDIS_URL") else {
            return;
        };
        let base =
            || RedisConfig::new(url.clone()).prefix(idemflow::conformance::unique("extreme"));
        let mut configs: Vec<(String, RedisConfig)> = Vec::new();
        for d in DURATIONS {
            configs.push((format!("history ttl {d:?}"), base().history_ttl(d)));
            configs.push((format!("expiry grace {d:?}"), base().expiry_grace(Some(d))));
            configs.push((
                format!("response timeout {d:?}"),
                base().response_timeout(d),
            ));
            configs.push((format!("wait 0 replicas {d:?}"), base().wait(0, d)));
        }
        for n in [0, 1, u32::MAX] {
            configs.push((format!("buckets {n}"), base().buckets(n)));
            configs.push((format!("history cap {n}"), base().history_cap(n)));
        }
        for n in SIZES {
            configs.push((format!("known keys {n}"), base().known_keys(n)));
        }
        configs.push(("empty prefix".into(), base().prefix("")));
        for (what, config) in configs {
            let store = match bounded(&what, RedisStore::connect_with(config)).await {
                Ok(store) => store,
                Err(e) => {
                    println!("{what}: refused: {e}");
                    continue;
                }
            };
            if let Err(e) = bounded(&what, store.migrate()).await {
                println!("{what}: migrate refused: {e}");
                continue;
            }
            exercise(&what, &Idempotency::new(Arc::new(store))).await;
        }
    }
}

#[cfg(feature = "postgres")]
mod pool_settings {
    use super::*;
    use idemflow::store::PoolOptions;
    use idemflow::store::postgres::PostgresStore;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pool_settings_at_their_extremes() {
        let Some(url) = crate::support::backend_url("IDEMFLOW_TEST_POSTGRES_URL") else {
            return;
        };
        for n in [0, u32::MAX] {
            let refused =
                PostgresStore::connect_with(&url, PoolOptions::default().max_connections(n)).await;
            assert!(
                matches!(refused, Err(idemflow::StoreError::Config(_))),
                "max_connections {n}: {refused:?}"
            );
        }
        let mut options = Vec::new();
        for d in DURATIONS {
            options.push((
                format!("acquire {d:?}"),
                PoolOptions::default().acquire_timeout(d),
            ));
        }
        for n in [0, 1, u32::MAX] {
            options.push((
                format!("min {n}"),
                PoolOptions::default().min_connections(n),
            ));
        }
        for (what, options) in options {
            // Answered, connected or refused by name.
            let _ = bounded(&what, PostgresStore::connect_with(&url, options)).await;
        }
    }
}
