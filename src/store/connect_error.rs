//! Connection failures that name their cause: a first connection is tried with a short timeout
//! when a store connects, and its error is classified ([`ConnectCause`]) and reported with the
//! URL, its password masked ([`redact_url`]), instead of a pool timeout after 30 s.

use std::time::Duration;

use crate::error::ConnectCause;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
use crate::error::StoreError;

/// How long a store's first connection may take by default before `connect` gives up.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `url` with the password of its user info (`scheme://user:password@host`) and any
/// `password=` query parameter replaced by `***`.
///
/// ```
/// use idemflow::store::connect_error::redact_url;
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/x"), "postgres://app:***@db:5432/x");
/// assert_eq!(redact_url("redis://:pw@cache/0"), "redis://:***@cache/0");
/// assert_eq!(redact_url("mysql://root@db/x?password=pw&ssl=1"), "mysql://root@db/x?password=***&ssl=1");
/// assert_eq!(redact_url("sqlite://app.db"), "sqlite://app.db");
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest = scheme_end + 3;
        let authority_end = out[rest..]
            .find(['/', '?', '#'])
            .map_or(out.len(), |i| rest + i);
        if let Some(at) = out[rest..authority_end].rfind('@') {
            let userinfo = &out[rest..rest + at];
            if let Some(colon) = userinfo.find(':') {
                out.replace_range(rest + colon + 1..rest + at, "***");
            }
        }
    }
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let query: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _))
                    if k.eq_ignore_ascii_case("password")
                        || k.eq_ignore_ascii_case("sentinel_password") =>
                {
                    format!("{k}=***")
                }
                _ => pair.to_owned(),
            })
            .collect();
        out = format!("{head}{}", query.join("&"));
    }
    out
}

/// Runs a store's first connection `attempt` for at most `timeout`, turning its failure into
/// [`StoreError::Connect`] with the cause `cause` finds and the URL redacted.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
pub(crate) async fn within<T, E>(
    backend: &'static str,
    url: &str,
    timeout: Duration,
    attempt: impl std::future::Future<Output = Result<T, E>>,
    cause: impl Fn(&E) -> ConnectCause,
) -> Result<T, StoreError>
where
    E: std::error::Error + Send + Sync + 'static,
{
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(StoreError::Connect {
            backend,
            url: redact_url(url),
            cause: cause(&e),
            source: Box::new(e),
        }),
        Err(_) => Err(StoreError::Connect {
            backend,
            url: redact_url(url),
            cause: ConnectCause::TimedOut,
            source: format!("no connection within {timeout:?}").into(),
        }),
    }
}

/// The cause behind an I/O error of a connection attempt.
pub fn io_cause(e: &std::io::Error) -> ConnectCause {
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => ConnectCause::Refused,
        std::io::ErrorKind::TimedOut => ConnectCause::TimedOut,
        _ => {
            let text = e.to_string().to_ascii_lowercase();
            if text.contains("lookup address")
                || text.contains("name or service not known")
                || text.contains("no such host")
                || text.contains("nodename nor servname")
            {
                ConnectCause::UnknownHost
            } else {
                ConnectCause::Other
            }
        }
    }
}

/// The cause behind a sqlx error of a connection attempt.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn sqlx_cause(e: &sqlx::Error) -> ConnectCause {
    match e {
        sqlx::Error::Io(io) => io_cause(io),
        sqlx::Error::Tls(_) => ConnectCause::Tls,
        sqlx::Error::PoolTimedOut => ConnectCause::TimedOut,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // PostgreSQL: invalid_password, invalid_authorization_specification.
            Some("28P01" | "28000") => ConnectCause::AuthenticationFailed,
            // PostgreSQL: invalid_catalog_name.
            Some("3D000") => ConnectCause::DatabaseMissing,
            // MySQL / MariaDB report SQLSTATE 42000 for an unknown database (error 1049).
            Some("42000")
                if db
                    .message()
                    .to_ascii_lowercase()
                    .contains("unknown database") =>
            {
                ConnectCause::DatabaseMissing
            }
            _ if db.message().to_ascii_lowercase().contains("access denied") => {
                ConnectCause::AuthenticationFailed
            }
            _ => ConnectCause::Other,
        },
        _ => ConnectCause::Other,
    }
}

/// The cause behind a redis error of a connection attempt.
#[cfg(feature = "redis")]
pub(crate) fn redis_cause(e: &redis::RedisError) -> ConnectCause {
    if e.is_connection_refusal() {
        return ConnectCause::Refused;
    }
    if e.is_timeout() {
        return ConnectCause::TimedOut;
    }
    if e.kind() == redis::ErrorKind::AuthenticationFailed {
        return ConnectCause::AuthenticationFailed;
    }
    let text = e.to_string().to_ascii_lowercase();
    if text.contains("wrongpass") || text.contains("noauth") || text.contains("invalid password") {
        ConnectCause::AuthenticationFailed
    } else if text.contains("lookup address") || text.contains("name or service not known") {
        ConnectCause::UnknownHost
    } else if text.contains("tls") || text.contains("certificate") {
        ConnectCause::Tls
    } else {
        ConnectCause::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_survive_redaction() {
        for (url, want) in [
            ("postgres://u:p@h/db", "postgres://u:***@h/db"),
            ("postgres://u@h/db", "postgres://u@h/db"),
            (
                "postgres://u:p%40x@h:1/db?sslmode=require",
                "postgres://u:***@h:1/db?sslmode=require",
            ),
            ("mysql://u:pa:ss@h/db", "mysql://u:***@h/db"),
            ("rediss://default:tok@h:6380", "rediss://default:***@h:6380"),
            (
                "postgres://h/db?user=u&password=p",
                "postgres://h/db?user=u&password=***",
            ),
            ("sqlite::memory:", "sqlite::memory:"),
        ] {
            assert_eq!(redact_url(url), want, "{url}");
        }
    }

    #[test]
    fn io_errors_name_their_cause() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(io_cause(&refused), ConnectCause::Refused);
        let dns = std::io::Error::other(
            "failed to lookup address information: Name or service not known",
        );
        assert_eq!(io_cause(&dns), ConnectCause::UnknownHost);
        assert_eq!(ConnectCause::Refused.to_string(), "connection refused");
    }
}
