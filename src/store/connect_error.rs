//! Connection failures that name their cause: a first connection is tried with a short timeout
//! when a store connects, and its error is classified ([`ConnectCause`]) and reported with the
//! URL, its password masked ([`redact_url`]), instead of a pool timeout after 30 s.
//!
//! [`redact_url`] is also the crate's one way of showing a URL that may carry a secret: every
//! error, log line and `Debug` output that shows a configured URL (a database URL, a provider's
//! base URL, a webhook endpoint) shows it through it, and a password, API key, token or signing
//! secret held on its own shows as `***` in `Debug`.

use std::fmt;
use std::time::Duration;

use crate::error::ConnectCause;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
use crate::error::StoreError;

/// How long a store's first connection may take by default before `connect` gives up.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What a masked secret shows as, in URLs ([`redact_url`]) and in `Debug` output.
pub(crate) const MASK: &str = "***";

/// `url` with its secrets replaced by `***`: the password of the user info
/// (`scheme://user:password@host`) of every URL it holds (a comma-separated list of seed URLs
/// has several), and the value of every query parameter whose name says it is a secret (it
/// contains `pass`, `pwd`, `secret`, `token` or `key`, in any case: `password`,
/// `sentinel_password`, `sslpassword`, `api_key`, `access_token`, ...). The user name stays.
///
/// ```
/// use idemflow::store::connect_error::redact_url;
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/x"), "postgres://app:***@db:5432/x");
/// assert_eq!(redact_url("redis://:pw@cache/0"), "redis://:***@cache/0");
/// assert_eq!(redact_url("mysql://root@db/x?password=pw&ssl=1"), "mysql://root@db/x?password=***&ssl=1");
/// assert_eq!(
///     redact_url("redis+sentinel://:pw@h1,h2/m?sentinel_password=sp"),
///     "redis+sentinel://:***@h1,h2/m?sentinel_password=***"
/// );
/// assert_eq!(redact_url("redis://:a@h1:7000,redis://:b@h2:7000"), "redis://:***@h1:7000,redis://:***@h2:7000");
/// assert_eq!(redact_url("sqlite://app.db"), "sqlite://app.db");
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut rest = url;
    // Each `scheme://` opens an authority, up to the path, query or fragment, or up to the
    // scheme of the next URL of a list.
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let mut end = tail.find(['/', '?', '#']).unwrap_or(tail.len());
        if let Some(next) = tail.find("://") {
            let scheme = tail[..next]
                .trim_end_matches(|c: char| c.is_ascii_alphanumeric() || "+-.".contains(c));
            end = end.min(scheme.len());
        }
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..=colon]);
                        out.push_str(MASK);
                    }
                    None => out.push_str(userinfo),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let query: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _)) if secret_param(k) => format!("{k}={MASK}"),
                _ => pair.to_owned(),
            })
            .collect();
        out = format!("{head}{}", query.join("&"));
    }
    out
}

/// Whether a query parameter named `name` holds a secret (see [`redact_url`]).
fn secret_param(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["pass", "pwd", "secret", "token", "key"]
        .iter()
        .any(|s| name.contains(s))
}

/// Shows a URL in `Debug` output as [`redact_url`] does, for the types that hold one.
pub(crate) struct RedactedUrl<'a>(pub(crate) &'a str);

impl fmt::Debug for RedactedUrl<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&redact_url(self.0), f)
    }
}

/// Shows an optional secret in `Debug` output: `Some("***")` or `None`.
#[cfg(feature = "redis")]
pub(crate) fn masked<T>(secret: &Option<T>) -> Option<&'static str> {
    secret.as_ref().map(|_| MASK)
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
            (
                "redis://:a@h1:7000/,redis://u:b@h2:7000/",
                "redis://:***@h1:7000/,redis://u:***@h2:7000/",
            ),
            (
                "redis+sentinel://app:pw@h1:26379,h2/m/0?wait_replicas=1&sentinel_password=sp",
                "redis+sentinel://app:***@h1:26379,h2/m/0?wait_replicas=1&sentinel_password=***",
            ),
            (
                "postgres://h/db?sslpassword=x&sslkey=/k.pem&sslmode=verify-full",
                "postgres://h/db?sslpassword=***&sslkey=***&sslmode=verify-full",
            ),
            (
                "https://api.example/v1?api_key=k&access_token=t&Client_Secret=c",
                "https://api.example/v1?api_key=***&access_token=***&Client_Secret=***",
            ),
            ("https://u:p@proxy.example", "https://u:***@proxy.example"),
            ("redis://:p@ss@h/", "redis://:***@h/"),
        ] {
            assert_eq!(redact_url(url), want, "{url}");
        }
    }

    #[test]
    fn debug_helpers_mask() {
        assert_eq!(
            format!("{:?}", RedactedUrl("redis://:pw@h/")),
            "\"redis://:***@h/\""
        );
        #[cfg(feature = "redis")]
        {
            assert_eq!(masked(&Some("pw")), Some("***"));
            assert_eq!(masked::<String>(&None), None);
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
