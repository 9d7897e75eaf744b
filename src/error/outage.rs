//! Whether a store error means the store cannot be reached or cannot write right now (an
//! outage: the server down or restarting, the connection lost, the pool exhausted, a SQLite file
//! that cannot be written), as opposed to a refusal or a bug. Read by
//! [`StoreError::is_unavailable`](crate::StoreError::is_unavailable); the HTTP layer answers an
//! outage 503 + `Retry-After` (`docs/http.md`, "When the store is down").
//!
//! The driver's error is found anywhere in the source chain (the SQLite writer wraps it in a
//! batch error; an exhausted pool's `PoolExhausted` has sqlx's pool timeout as its source).

/// Whether `e`, or an error it was caused by, is an outage.
pub(crate) fn is_outage(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(verdict) = classify(err) {
            return verdict;
        }
        next = err.source();
    }
    false
}

/// The verdict on one error of the chain, when it is one the drivers give.
fn classify(err: &(dyn std::error::Error + 'static)) -> Option<bool> {
    if let Some(io) = err.downcast_ref::<std::io::Error>() {
        return Some(io_outage(io));
    }
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    {
        if let Some(e) = err.downcast_ref::<sqlx::Error>() {
            return Some(sqlx_outage(e));
        }
        if let Some(e) = err.downcast_ref::<std::sync::Arc<sqlx::Error>>() {
            return Some(sqlx_outage(e));
        }
    }
    #[cfg(feature = "redis")]
    if let Some(e) = err.downcast_ref::<redis::RedisError>() {
        return Some(redis_outage(e));
    }
    None
}

fn io_outage(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        e.kind(),
        K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::NotConnected
            | K::BrokenPipe
            | K::TimedOut
            | K::UnexpectedEof
            | K::HostUnreachable
            | K::NetworkUnreachable
            | K::NetworkDown
            | K::PermissionDenied
            | K::ReadOnlyFilesystem
            | K::StorageFull
            | K::Interrupted
    )
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn sqlx_outage(e: &sqlx::Error) -> bool {
    match e {
        // Any I/O error on a database connection: the connection is gone or going.
        sqlx::Error::Io(_) => true,
        // (A closed pool is not an outage: the application closed it, and it stays closed.)
        sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => db_outage(db.as_ref()),
        _ => false,
    }
}

/// Database errors that mean "not now" rather than "no". SQLite: the primary result codes (the
/// low byte of the extended code sqlx reports) BUSY 5, LOCKED 6, NOMEM 7, READONLY 8, IOERR 10,
/// FULL 13, CANTOPEN 14, PROTOCOL 15. MariaDB / MySQL: too many connections (1040), shutdown in
/// progress (1053), lock wait timeout (1205), read-only (1290, 1836). PostgreSQL: SQLSTATE
/// classes 08 (connection exception), 53 (insufficient resources) and 57P (the server shutting
/// down or restarting).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn db_outage(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return db
            .code()
            .and_then(|c| c.parse::<u32>().ok())
            .is_some_and(|n| matches!(n & 0xff, 5 | 6 | 7 | 8 | 10 | 13 | 14 | 15));
    }
    #[cfg(feature = "mysql")]
    if let Some(e) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return matches!(e.number(), 1040 | 1053 | 1205 | 1290 | 1836);
    }
    db.code()
        .is_some_and(|c| c.starts_with("08") || c.starts_with("53") || c.starts_with("57P"))
}

#[cfg(feature = "redis")]
fn redis_outage(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.kind(),
            K::ClusterConnectionNotFound
                | K::MasterNameNotFoundBySentinel
                | K::Server(
                    S::BusyLoading | S::TryAgain | S::ClusterDown | S::MasterDown | S::ReadOnly
                )
        )
}

#[cfg(test)]
mod tests {
    use super::is_outage;
    use crate::StoreError;

    fn io(kind: std::io::ErrorKind) -> std::io::Error {
        std::io::Error::new(kind, "test")
    }

    #[test]
    fn lost_connections_are_outages_and_refusals_are_not() {
        use std::io::ErrorKind as K;
        assert!(is_outage(&io(K::ConnectionRefused)));
        assert!(is_outage(&io(K::TimedOut)));
        assert!(!is_outage(&io(K::InvalidData)));
        let store = |e: std::io::Error| StoreError::database("test", e);
        assert!(store(io(K::ConnectionReset)).is_unavailable());
        assert!(!store(io(K::InvalidInput)).is_unavailable());
        assert!(
            !StoreError::Corrupt {
                backend: "test",
                detail: "x".into()
            }
            .is_unavailable()
        );
    }

    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    #[test]
    fn sqlx_pool_timeouts_are_outages_and_a_closed_pool_is_not() {
        assert!(StoreError::database("test", sqlx::Error::PoolTimedOut).is_unavailable());
        assert!(!StoreError::database("test", sqlx::Error::PoolClosed).is_unavailable());
        assert!(!StoreError::database("test", sqlx::Error::RowNotFound).is_unavailable());
        // Found through the source chain, as the SQLite writer wraps its batch errors.
        let wrapped = super::tests::Wrapped(sqlx::Error::PoolTimedOut);
        assert!(StoreError::database("test", wrapped).is_unavailable());
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn an_exhausted_pool_is_an_outage() {
        let e = crate::store::PoolExhausted {
            max_connections: 16,
            open: 0,
            waited: std::time::Duration::from_secs(5),
        };
        assert!(StoreError::database("postgres", e).is_unavailable());
    }

    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    #[derive(Debug, thiserror::Error)]
    #[error("wrapped")]
    struct Wrapped(#[source] sqlx::Error);

    #[cfg(feature = "redis")]
    #[test]
    fn redis_connection_errors_are_outages() {
        let e = redis::RedisError::from(io(std::io::ErrorKind::ConnectionRefused));
        assert!(StoreError::database("redis", e).is_unavailable());
        let e = redis::RedisError::from((redis::ErrorKind::Parse, "bad reply"));
        assert!(!StoreError::database("redis", e).is_unavailable());
    }
}
