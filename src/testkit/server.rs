//! A tiny HTTP/1 server for the fakes: axum routes served with hyper, one task per connection,
//! and a per-connection kill switch so a handler can close its connection without answering
//! (a "lost response"), and the start-up and public handle every fake shares.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, Uri};
use axum::response::IntoResponse;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

use super::{Common, Delivery};

/// Lets a handler close the connection it is serving.
#[derive(Debug, Clone)]
pub(crate) struct KillSwitch(Arc<Notify>);

impl KillSwitch {
    pub(crate) fn kill(&self) {
        self.0.notify_one();
    }
}

/// A running server; dropping it stops the accept loop and every connection.
#[derive(Debug)]
pub(crate) struct Server {
    base_url: String,
    _stop: watch::Sender<bool>,
}

impl Server {
    pub(crate) fn base_url(&self) -> &str {
        &self.base_url
    }
}

pub(crate) async fn serve(router: Router) -> std::io::Result<Server> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(async move {
        loop {
            let mut stop_accept = stopped.clone();
            let stream = tokio::select! {
                r = listener.accept() => match r {
                    Ok((s, _)) => s,
                    Err(_) => {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    }
                },
                _ = stop_accept.changed() => break,
            };
            let notify = Arc::new(Notify::new());
            let svc = router
                .clone()
                .layer(axum::Extension(KillSwitch(notify.clone())));
            let mut stop_conn = stopped.clone();
            tokio::spawn(async move {
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc));
                tokio::select! {
                    _ = conn => {}
                    _ = notify.notified() => {}
                    _ = stop_conn.changed() => {}
                }
            });
        }
    });
    Ok(Server {
        base_url: format!("http://{addr}"),
        _stop: stop,
    })
}

/// What a fake's handlers see: the [`Common`] part every fake has, and the fake's own state
/// (reached through `Deref`).
#[derive(Debug, Default)]
pub(crate) struct Shared<S> {
    pub(crate) common: Common,
    fake: S,
}

impl<S> std::ops::Deref for Shared<S> {
    type Target = S;

    fn deref(&self) -> &S {
        &self.fake
    }
}

impl<S: Send + Sync + 'static> Shared<S> {
    /// Executes an effect in a task of its own (like the real thing, it completes even if the
    /// client disconnects), after the configured latency: `work` gets the state and a fresh
    /// sequence number for ids. `None` if the task failed.
    pub(crate) async fn execute<T: Send + 'static>(
        self: &Arc<Self>,
        work: impl FnOnce(&Self, u64) -> T + Send + 'static,
    ) -> Option<T> {
        let s = self.clone();
        let task = tokio::spawn(async move {
            tokio::time::sleep(s.common.faults.latency()).await;
            let n = s.common.next_id();
            work(&s, n)
        });
        task.await.ok()
    }
}

/// A fake's routes, served with its shared state.
pub(crate) type Routes<S> = Router<Arc<Shared<S>>>;

/// The start-up every fake shares: a fresh state, its routes served on `127.0.0.1`, port 0.
pub(crate) async fn start<S: Default + Send + Sync + 'static>(
    routes: Routes<S>,
) -> std::io::Result<(Server, Arc<Shared<S>>)> {
    let state = Arc::new(Shared::<S>::default());
    let server = serve(routes.with_state(state.clone())).await?;
    Ok((server, state))
}

/// What a fake answers in its own error shapes: a request without its credential, and the
/// faults injected before anything runs.
pub(crate) trait FakeApi {
    /// The fake's answer to a request whose headers lack its credential (`None`: it has it).
    fn refusal(headers: &HeaderMap) -> Option<axum::response::Response>;

    /// The fake's answer to an injected [`Fault::ServerError`](super::Fault::ServerError).
    fn server_error(status: u16) -> axum::response::Response;

    /// The body of the fake's answer to an injected
    /// [`Fault::RateLimited`](super::Fault::RateLimited) (sent as a 429 with `Retry-After`).
    fn rate_limited() -> serde_json::Value;
}

/// A request as one of a fake's endpoints received it, already recorded in [`Common::record`]
/// and carrying the fake's credential (a request without it is answered with the fake's
/// [`FakeApi::refusal`], after being recorded): the extractor every handler starts with.
pub(crate) struct Received {
    pub(crate) uri: Uri,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    /// Closes the request's connection (a lost response).
    pub(crate) kill: KillSwitch,
}

impl<S: FakeApi + Send + Sync> FromRequest<Arc<Shared<S>>> for Received {
    type Rejection = axum::response::Response;

    async fn from_request(req: Request, state: &Arc<Shared<S>>) -> Result<Self, Self::Rejection> {
        let method = req.method().clone();
        let uri = req.uri().clone();
        let headers = req.headers().clone();
        let kill = req.extensions().get::<KillSwitch>().cloned();
        let body = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        state.common.record(&method, &uri, &headers, &body);
        if let Some(refusal) = S::refusal(&headers) {
            return Err(refusal);
        }
        let Some(kill) = kill else {
            let status = axum::http::StatusCode::INTERNAL_SERVER_ERROR;
            return Err((status, "the fake's server set no kill switch").into_response());
        };
        Ok(Self {
            uri,
            headers,
            body,
            kill,
        })
    }
}

/// A request to one of a fake's effect endpoints: [`Received`], with the fault queued for it
/// taken ([`Delivery::take`]): an injected 5xx or 429 is answered before the handler runs.
pub(crate) struct EffectRequest {
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) delivery: Delivery,
}

impl<S: FakeApi + Send + Sync> FromRequest<Arc<Shared<S>>> for EffectRequest {
    type Rejection = axum::response::Response;

    async fn from_request(req: Request, state: &Arc<Shared<S>>) -> Result<Self, Self::Rejection> {
        let received = Received::from_request(req, state).await?;
        let delivery = Delivery::take::<S>(&state.common.faults, received.kill).await?;
        Ok(Self {
            headers: received.headers,
            body: received.body,
            delivery,
        })
    }
}

/// Declares a fake's public handle (`start`, `base_url`, `ledger`, `faults`, `requests`) over its
/// state type and routes.
macro_rules! fake_handle {
    (
        $(#[$doc:meta])*
        pub struct $fake:ident($state:ty);
        routes: $routes:expr,
        ledger: $ledger_doc:literal,
        faults: $faults_doc:literal $(,)?
    ) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $fake {
            server: $crate::testkit::server::Server,
            state: std::sync::Arc<$crate::testkit::server::Shared<$state>>,
        }

        impl $fake {
            /// Starts the fake on `127.0.0.1`, port 0. It stops when dropped.
            pub async fn start() -> std::io::Result<Self> {
                let (server, state) = $crate::testkit::server::start::<$state>($routes).await?;
                Ok(Self { server, state })
            }

            /// `http://127.0.0.1:<port>`, to give an adapter as its base URL.
            pub fn base_url(&self) -> &str {
                self.server.base_url()
            }

            #[doc = $ledger_doc]
            pub fn ledger(&self) -> $crate::testkit::Ledger {
                self.state.common.ledger.clone()
            }

            #[doc = $faults_doc]
            pub fn faults(&self) -> $crate::testkit::Faults {
                self.state.common.faults.clone()
            }

            /// Every request received, oldest first (faulted ones included).
            pub fn requests(&self) -> Vec<$crate::testkit::RecordedRequest> {
                self.state.common.requests()
            }
        }
    };
}

pub(crate) use fake_handle;
