//! When the store is down (issue 24): the layer's default answer (503 `store-unavailable` +
//! `Retry-After`, the handler not run), the opt-in pass-through (`StoreDown::RunUnprotected`:
//! the handler runs, marked and counted), a connection lost mid-request (the handler never runs
//! twice), and recovery without a restart once the store is back, on every backend.
//!
//! PostgreSQL, MariaDB and Redis are reached through a TCP proxy this test stops and starts
//! (`support::proxy`): the server goes away for this test's connections only, so the tests
//! running beside it keep theirs. A SQLite file is made unwritable by another connection holding
//! its write lock (the tests run as root, whom file permissions do not stop).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;
use idemflow::axum::{
    IdempotencyContext, IdempotencyLayer, ScopeSource, StoreDown, UNPROTECTED_HEADER,
};
use idemflow::{Idempotency, Store, key::Scope};
use serde_json::Value;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::support::proxy::{self, Proxy};

/// How the store goes away and comes back.
#[idemflow::async_trait]
trait Outage: Send + Sync {
    async fn stop(&self);
    async fn restart(&self);
}

#[idemflow::async_trait]
impl Outage for Proxy {
    async fn stop(&self) {
        Proxy::stop(self).await
    }
    async fn restart(&self) {
        Proxy::restart(self).await
    }
}

#[derive(Default)]
struct Handler {
    runs: AtomicUsize,
    /// Permits the handler takes before answering (none: it answers at once).
    gate: Option<Arc<Semaphore>>,
    started: tokio::sync::Notify,
}

async fn pay(State(h): State<Arc<Handler>>, ctx: Option<IdempotencyContext>) -> Response {
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    h.started.notify_one();
    if let Some(gate) = &h.gate {
        gate.acquire().await.unwrap().forget();
    }
    let protected = ctx.is_some();
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        serde_json::json!({"run": n, "protected": protected}).to_string(),
    )
        .into_response()
}

fn app(idem: &Idempotency, h: &Arc<Handler>, policy: StoreDown) -> Router {
    let layer = IdempotencyLayer::new(
        idem.clone(),
        ScopeSource::fixed(Scope::new("acct").unwrap()),
    )
    .when_store_down(policy);
    Router::new()
        .route("/pay", post(pay))
        .layer(layer)
        .with_state(h.clone())
}

struct Answer {
    status: StatusCode,
    slug: Option<String>,
    retry_after: bool,
    unprotected: bool,
    replayed: bool,
}

async fn send(app: &Router, key: &str) -> Answer {
    let req = Request::post("/pay")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount":100}"#))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let h = resp.headers();
    let retry_after = h.contains_key("retry-after");
    let unprotected = h
        .get(UNPROTECTED_HEADER)
        .is_some_and(|v| v == "store-unavailable");
    let replayed = h.get("idempotent-replayed").is_some_and(|v| v == "true");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let slug = v["type"]
        .as_str()
        .and_then(|t| t.strip_prefix("urn:idemflow:problem:"))
        .map(str::to_owned);
    Answer {
        status,
        slug,
        retry_after,
        unprotected,
        replayed,
    }
}

/// The whole story on one store, `outage` taking it away and back.
async fn ride_out(name: &str, store: Arc<dyn Store>, outage: &dyn Outage) {
    let idem = Idempotency::new(store);
    let h = Arc::new(Handler::default());
    let (refuse, open) = (
        app(&idem, &h, StoreDown::Refuse),
        app(&idem, &h, StoreDown::RunUnprotected),
    );
    let a = send(&refuse, "k1").await;
    assert_eq!(a.status, StatusCode::CREATED, "{name}: the store is up");
    assert_eq!(h.runs.load(Ordering::SeqCst), 1);

    outage.stop().await;
    // The default: 503 store-unavailable + Retry-After, and the handler does not run.
    let a = send(&refuse, "k2").await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{name}");
    assert_eq!(a.slug.as_deref(), Some("store-unavailable"), "{name}");
    assert!(a.retry_after, "{name}: Retry-After");
    assert_eq!(h.runs.load(Ordering::SeqCst), 1, "{name}: nothing ran");
    // The opt-in: the handler runs, without protection, and says so.
    let a = send(&open, "k3").await;
    assert_eq!(a.status, StatusCode::CREATED, "{name}");
    assert!(a.unprotected, "{name}: marked unprotected");
    assert_eq!(h.runs.load(Ordering::SeqCst), 2, "{name}: it ran, once");

    outage.restart().await;
    // Recovery without a restart of the app: the next requests work. A pool or connection
    // manager may need one failed call to notice its old connections are gone; count them.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut failed_after_restart = 0;
    loop {
        let a = send(&refuse, "k4").await;
        if a.status == StatusCode::CREATED {
            assert!(!a.unprotected);
            break;
        }
        assert_eq!(a.slug.as_deref(), Some("store-unavailable"), "{name}");
        failed_after_restart += 1;
        assert!(
            Instant::now() < deadline,
            "{name}: the store never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("{name}: {failed_after_restart} request(s) refused after the store came back");
    assert!(
        failed_after_restart <= 1,
        "{name}: {failed_after_restart} refusals after the restart"
    );
    let a = send(&refuse, "k1").await;
    assert!(
        a.replayed && a.status == StatusCode::CREATED,
        "{name}: k1 still replays"
    );
    // k3 ran unprotected: nothing was stored for it, so it runs (protected now) when retried.
    let a = send(&open, "k3").await;
    assert!(
        a.status == StatusCode::CREATED && !a.unprotected && !a.replayed,
        "{name}"
    );
    assert_eq!(h.runs.load(Ordering::SeqCst), 4, "{name}: k1, k3 twice, k4");
}

/// The store goes away while the handler runs: its answer cannot be stored, and the handler
/// does not run again, even with `RunUnprotected`.
async fn lost_mid_request(name: &str, store: Arc<dyn Store>, outage: &dyn Outage) {
    let idem = Idempotency::new(store).lease(Duration::from_secs(60));
    let gate = Arc::new(Semaphore::new(0));
    let h = Arc::new(Handler {
        gate: Some(gate.clone()),
        ..Handler::default()
    });
    let open = app(&idem, &h, StoreDown::RunUnprotected);
    let started = h.started.notified();
    let request = tokio::spawn({
        let open = open.clone();
        async move { send(&open, "mid").await }
    });
    started.await;
    outage.stop().await;
    gate.add_permits(1);
    let a = request.await.unwrap();
    assert!(
        a.status == StatusCode::SERVICE_UNAVAILABLE
            || a.status == StatusCode::INTERNAL_SERVER_ERROR,
        "{name}: the answer could not be stored: {}",
        a.status
    );
    assert!(!a.unprotected, "{name}: not run again unprotected");
    assert_eq!(
        h.runs.load(Ordering::SeqCst),
        1,
        "{name}: the handler ran once"
    );
    outage.restart().await;
    // The key was claimed and its answer lost: a retry is told the first is still in flight
    // (its lease runs) and the handler does not run again.
    let deadline = Instant::now() + Duration::from_secs(60);
    let a = loop {
        // A run of the handler here waits on its gate for good: fail at once, naming it.
        let again = h.started.notified();
        let a = tokio::select! {
            a = send(&open, "mid") => a,
            () = again => panic!(
                "{name}: the retry ran the handler again (run {}), with the store back",
                h.runs.load(Ordering::SeqCst)
            ),
        };
        if a.slug.as_deref() != Some("store-unavailable") || Instant::now() > deadline {
            break a;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(a.status, StatusCode::CONFLICT, "{name}: {:?}", a.slug);
    assert_eq!(h.runs.load(Ordering::SeqCst), 1, "{name}: still once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_file_made_unwritable_then_writable_again() {
    use idemflow::store::sqlite::{SqliteConfig, SqliteStore};
    use sqlx::Connection;

    struct Locked {
        url: String,
        holder: tokio::sync::Mutex<Option<sqlx::SqliteConnection>>,
    }
    #[idemflow::async_trait]
    impl Outage for Locked {
        async fn stop(&self) {
            // Another connection takes the file's write lock and keeps it: no write can go in.
            let mut c = sqlx::SqliteConnection::connect(&self.url).await.unwrap();
            sqlx::query("BEGIN IMMEDIATE")
                .execute(&mut c)
                .await
                .unwrap();
            *self.holder.lock().await = Some(c);
        }
        async fn restart(&self) {
            if let Some(mut c) = self.holder.lock().await.take() {
                sqlx::query("ROLLBACK").execute(&mut c).await.unwrap();
                c.close().await.unwrap();
            }
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("down.db").display());
    let store =
        SqliteStore::connect_with(SqliteConfig::new(&url).busy_timeout(Duration::from_millis(500)))
            .await
            .unwrap();
    store.migrate().await.unwrap();
    let outage = Locked {
        url: url.clone(),
        holder: Default::default(),
    };
    let store: Arc<dyn Store> = Arc::new(store);
    ride_out("sqlite", store.clone(), &outage).await;
    lost_mid_request("sqlite", store.clone(), &outage).await;

    // A workflow layer never passes through: its run reads the store after the claim.
    let h = Arc::new(Handler::default());
    let layer = IdempotencyLayer::new(
        Idempotency::new(store),
        ScopeSource::fixed(Scope::new("acct").unwrap()),
    )
    .workflow()
    .when_store_down(StoreDown::RunUnprotected);
    let flow = Router::new()
        .route("/pay", post(pay))
        .layer(layer)
        .with_state(h.clone());
    outage.stop().await;
    let a = send(&flow, "wf-1").await;
    outage.restart().await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!a.unprotected);
    assert_eq!(
        h.runs.load(Ordering::SeqCst),
        0,
        "the workflow handler did not run"
    );
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_then_restarted() {
    use idemflow::store::PoolOptions;
    use idemflow::store::postgres::PostgresStore;
    let Some((url, schema)) = crate::support::postgres::fresh_schema().await else {
        return;
    };
    let p = Proxy::start(&proxy::host_port(&url)).await;
    let via = crate::support::postgres::url_in(&proxy::via(&url, p.addr()), &schema);
    let options = PoolOptions::default().acquire_timeout(Duration::from_secs(2));
    let store = PostgresStore::connect_with(&via, options).await.unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    ride_out("postgres", store.clone(), &p).await;
    lost_mid_request("postgres", store, &p).await;
    crate::support::postgres::drop_schema(&url, &schema).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_stopped_then_restarted() {
    use idemflow::store::PoolOptions;
    use idemflow::store::mysql::MySqlStore;
    let Some((options, name)) = crate::support::mysql::fresh_database().await else {
        return;
    };
    let url = std::env::var(crate::support::mysql::URL_VAR).unwrap();
    let p = Proxy::start(&proxy::host_port(&url)).await;
    let base = proxy::via(&url, p.addr());
    let via = format!(
        "{}/{name}",
        base.rsplit_once('/').map_or(base.as_str(), |(b, _)| b)
    );
    let pool = PoolOptions::default().acquire_timeout(Duration::from_secs(2));
    let store = MySqlStore::connect_with(&via, pool).await.unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    ride_out("mariadb", store.clone(), &p).await;
    lost_mid_request("mariadb", store, &p).await;
    crate::support::mysql::drop_database(&options, &name).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_then_restarted() {
    use idemflow::store::redis::{RedisConfig, RedisStore};
    let Some(url) = crate::support::backend_url(crate::support::redis::URL_VAR) else {
        return;
    };
    let p = Proxy::start(&proxy::host_port(&url)).await;
    let mut config = RedisConfig::new(proxy::via(&url, p.addr()))
        .prefix(idemflow::conformance::unique("down"))
        .response_timeout(Duration::from_secs(2));
    config.connection_timeout = Duration::from_secs(1);
    let store = RedisStore::connect_with(config).await.unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    ride_out("redis", store.clone(), &p).await;
    lost_mid_request("redis", store, &p).await;
}

#[test]
fn urls_are_rewritten_to_the_proxy() {
    let a: std::net::SocketAddr = "127.0.0.1:4000".parse().unwrap();
    assert_eq!(
        proxy::host_port("postgres://postgres@127.0.0.1:5432/test"),
        "127.0.0.1:5432"
    );
    assert_eq!(
        proxy::via("mysql://root@127.0.0.1:3306/test", a),
        "mysql://root@127.0.0.1:4000/test"
    );
    assert_eq!(
        proxy::via("redis://127.0.0.1:6379/", a),
        "redis://127.0.0.1:4000/"
    );
    assert_eq!(
        proxy::via("redis://:pw@127.0.0.1:6379", a),
        "redis://:pw@127.0.0.1:4000"
    );
}
