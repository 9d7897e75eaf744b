//! A TCP proxy on 127.0.0.1 in front of a database server, that a test stops and starts: a
//! server that goes away for this test's connections alone (the real server stays up for every
//! other test running beside it). Stopping closes the listening socket and every proxied
//! connection, as a server that stops or crashes does; starting listens on the same port again.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct Proxy {
    addr: SocketAddr,
    target: String,
    running: Mutex<Option<Running>>,
}

struct Running {
    accept: JoinHandle<()>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    /// A proxy on a free port of 127.0.0.1 to `target` (`host:port`), started.
    pub async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let proxy = Proxy {
            addr,
            target: target.to_owned(),
            running: Mutex::new(None),
        };
        proxy.serve(listener);
        proxy
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn serve(&self, listener: TcpListener) {
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (target, all) = (self.target.clone(), conns.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let target = target.clone();
                let conn = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                all.lock().unwrap().push(conn);
            }
        });
        *self.running.lock().unwrap() = Some(Running { accept, conns });
    }

    /// The server goes away: no new connection is accepted, and every open one is closed.
    pub async fn stop(&self) {
        let running = self.running.lock().unwrap().take();
        if let Some(r) = running {
            r.accept.abort();
            let _ = r.accept.await;
            let conns: Vec<_> = std::mem::take(&mut *r.conns.lock().unwrap());
            for c in conns {
                c.abort();
                let _ = c.await;
            }
        }
    }

    /// The server is back, on the same port.
    pub async fn restart(&self) {
        if self.running.lock().unwrap().is_some() {
            return;
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e) => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "cannot listen on {} again: {e}",
                        self.addr
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        };
        self.serve(listener);
    }
}

/// The `host:port` of a `scheme://[user[:password]@]host:port/...` URL.
pub fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    hostport.to_owned()
}

/// `url` with its `host:port` replaced by `addr`.
pub fn via(url: &str, addr: SocketAddr) -> String {
    url.replacen(&host_port(url), &addr.to_string(), 1)
}
