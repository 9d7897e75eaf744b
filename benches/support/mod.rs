//! What the benchmarks share (each bench includes it as `mod support`).

/// Deletes every Redis key matching `pattern` (`SCAN` + `UNLINK`): a run's keys, after it.
#[cfg(feature = "redis")]
pub async fn unlink_matching<C: redis::aio::ConnectionLike>(c: &mut C, pattern: &str) {
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(c)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: i64 = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(c)
                .await
                .unwrap();
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}

/// The SQLite floor's lean table and its statements (the seed's design): the throughput,
/// one-commit and layer benchmarks run the same ones.
#[cfg(feature = "sqlite")]
#[allow(dead_code)] // the HTTP benchmark runs no SQLite floor
pub mod sqlite_floor {
    /// The lean table: key, state, fingerprint, response, expiry.
    pub const LEAN: &str = "CREATE TABLE IF NOT EXISTS raw_keys (scope TEXT NOT NULL, \
        key TEXT NOT NULL, state TEXT NOT NULL, fingerprint TEXT NOT NULL, response BLOB, \
        expires_at INTEGER NOT NULL, PRIMARY KEY (scope, key))";
    /// The claim: insert ignoring duplicates (`?1` the key).
    pub const CLAIM: &str = "INSERT INTO raw_keys (scope, key, state, fingerprint, expires_at) \
        VALUES ('raw', ?1, 'processing', 'v1:x', 4102444800000) ON CONFLICT DO NOTHING";
    /// The answer: mark done with the response (`?1` the key, `?2` the response).
    pub const DONE: &str =
        "UPDATE raw_keys SET state = 'done', response = ?2 WHERE scope = 'raw' AND key = ?1";
}
