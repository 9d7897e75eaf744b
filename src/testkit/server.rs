//! A tiny HTTP/1 server for the fakes: axum routes served with hyper, one task per connection,
//! and a per-connection kill switch so a handler can close its connection without answering
//! (a "lost response").

use std::sync::Arc;

use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

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
