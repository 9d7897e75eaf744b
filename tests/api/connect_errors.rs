//! Connection failures are fast and name their cause: a closed port is "connection refused"
//! within 6 s, bad credentials are "authentication failed", a missing database "database
//! missing", for PostgreSQL, MariaDB and Redis, in the library and in the CLI; the URL in the
//! message has its password masked.

use crate::support;

use std::time::{Duration, Instant};

use idemflow::StoreError;
use idemflow::error::ConnectCause;

/// A port on 127.0.0.1 nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Connects `url` through `idemflow::store::connect` and returns the error, its cause, and how
/// long it took.
async fn failure(url: &str) -> (StoreError, ConnectCause, Duration) {
    let t = Instant::now();
    let e = match idemflow::store::connect(url).await {
        Ok(_) => panic!("{url} connected"),
        Err(e) => e,
    };
    let took = t.elapsed();
    let cause = match &e {
        StoreError::Connect { cause, .. } => *cause,
        other => panic!("{url}: expected StoreError::Connect, got {other:?}"),
    };
    (e, cause, took)
}

#[tokio::test]
async fn a_closed_port_is_refused_within_six_seconds_on_every_server_backend() {
    for (scheme, path) in [
        ("postgres://postgres:pw@", "test"),
        ("mysql://root:pw@", "test"),
        ("redis://:pw@", "0"),
    ] {
        let url = format!("{scheme}127.0.0.1:{}/{path}", closed_port());
        let (e, cause, took) = failure(&url).await;
        assert_eq!(cause, ConnectCause::Refused, "{url}: {e}");
        assert!(took < Duration::from_secs(6), "{url}: took {took:?}");
        let message = e.to_string();
        assert!(message.contains("connection refused"), "{message}");
        assert!(
            message.contains(":***@127.0.0.1"),
            "the URL is redacted: {message}"
        );
        assert!(!message.contains(":pw@"), "the password leaked: {message}");
    }
}

/// `host:port` of a backend URL.
fn authority(url: &str) -> String {
    let rest = url.split_once("://").unwrap().1;
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split(['/', '?']).next().unwrap().to_owned()
}

#[tokio::test]
async fn bad_credentials_and_missing_databases_are_named() {
    let mut cases = Vec::new();
    if let Some(url) = support::backend_url("IDEMFLOW_TEST_POSTGRES_URL") {
        let at = authority(&url);
        cases.push((
            format!("postgres://no_such_role_idemflow:x@{at}/test"),
            ConnectCause::AuthenticationFailed,
        ));
        cases.push((
            format!("postgres://postgres@{at}/no_such_db_idemflow"),
            ConnectCause::DatabaseMissing,
        ));
    }
    if let Some(url) = support::backend_url("IDEMFLOW_TEST_MYSQL_URL") {
        let at = authority(&url);
        cases.push((
            format!("mysql://root:wrong_password@{at}/test"),
            ConnectCause::AuthenticationFailed,
        ));
        cases.push((
            format!("mysql://root@{at}/no_such_db_idemflow"),
            ConnectCause::DatabaseMissing,
        ));
    }
    if let Some(url) = support::backend_url("IDEMFLOW_TEST_REDIS_URL") {
        let at = authority(&url);
        cases.push((
            format!("redis://no_such_user:wrong@{at}/"),
            ConnectCause::AuthenticationFailed,
        ));
    }
    for (url, want) in cases {
        let (e, cause, took) = failure(&url).await;
        assert_eq!(cause, want, "{url}: {e}");
        assert!(took < Duration::from_secs(6), "{url}: took {took:?}");
        assert!(e.to_string().contains(&want.to_string()), "{e}");
    }
}

#[cfg(all(feature = "cli", feature = "postgres"))]
#[test]
fn the_cli_names_a_refused_connection_within_six_seconds() {
    let url = format!("postgres://app:secret@127.0.0.1:{}/x", closed_port());
    let t = Instant::now();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["--database-url", &url, "stats"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let took = t.elapsed();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(took < Duration::from_secs(6), "took {took:?}");
    assert!(stderr.contains("connection refused"), "{stderr}");
    assert!(!stderr.contains("secret"), "{stderr}");
}
