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
