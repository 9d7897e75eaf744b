//! The store-level tests on every backend, in one test binary: the exported conformance and
//! sweeper suites (`idemflow::conformance`) on SQLite (in memory and a WAL file), PostgreSQL,
//! MariaDB and Redis, the SQL fault suite on PostgreSQL and MariaDB, and each backend's own
//! tests.
//!
//! PostgreSQL, MariaDB and Redis need `IDEMFLOW_TEST_POSTGRES_URL`, `IDEMFLOW_TEST_MYSQL_URL` and
//! `IDEMFLOW_TEST_REDIS_URL` (the Redis Cluster and Sentinel tests also
//! `IDEMFLOW_TEST_REDIS_CLUSTER_URL`, `IDEMFLOW_TEST_REDIS_SENTINEL_URL` and
//! `IDEMFLOW_TEST_REDIS_SENTINEL_FAILOVER_URL`); each test on them is skipped (with the reason
//! printed) when its URL is unset, and fails when the URL is unset or unreachable under `CI=true`.

#[path = "../support/mod.rs"]
mod support;

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql_faults;

// Issue 11's fast-recovery test: the card service killed mid-request, restarted, reconciled.
#[cfg(all(feature = "axum", feature = "testkit", feature = "cli"))]
mod fast_recovery;

// A sweeper killed (SIGKILL) mid-batch: a second one settles its whole batch within 15 s.
#[cfg(feature = "testkit")]
mod sweeper_kill;

// Issue 22's history in the row: existing rows carried forward, the column's bound, escapes.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod history_in_row;

// Issue 23's one commit for local work on the SQL backends.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod one_commit;
// ... and its crash test: a child killed inside its transaction (needs the three SQL backends).
#[cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod one_commit_kill;

// Issue 24's announced ends: the feed listens again after its connection is killed.
#[cfg(all(feature = "conformance", any(feature = "postgres", feature = "redis")))]
mod ends_feed;

mod memory_store;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
// Issue 24's Redis Sentinel: typed errors, WAIT, and a failover under load.
#[cfg(all(
    feature = "redis",
    feature = "conformance",
    feature = "testkit",
    feature = "http"
))]
mod redis_sentinel;
#[cfg(feature = "sqlite")]
mod sqlite;
