//! Whether a store error means the store cannot be reached or cannot write right now (an
//! outage: the server down or restarting, the connection lost, the pool exhausted, a SQLite file
//! that cannot be written), as opposed to a refusal or a bug. Read by
//! [`StoreError::is_unavailable`](crate::StoreError::is_unavailable); the HTTP layer answers an
//! outage 503 + `Retry-After` (`docs/http.md`, "When the store is down").
//!
//! The driver's error is found anywhere in the source chain (the SQLite writer wraps it in a
//! batch error, for example).

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
    // No pool connection in time: every one busy, or the server not accepting new ones.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    if err.is::<super::pool::PoolExhausted>() {
        return Some(true);
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
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_) => true,
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
