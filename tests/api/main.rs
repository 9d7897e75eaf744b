//! The library's request path in one process, with no server: the executor's promises end to end
//! on SQLite (`executor`), bad input refused by name (`bad_input`), the fuzz targets as seeded
//! property tests (`fuzz_props`; `IDEMFLOW_FUZZ_CASES=N` runs more cases), the executor's
//! metrics read through the Prometheus recorder (`metrics`, features `cli` and `sqlite`), and
//! connection failures that are fast and name their cause in the library and the CLI
//! (`connect_errors`, features `postgres`, `mysql` and `redis`).
//!
//! Needs no environment; `connect_errors`' bad-credential and missing-database cases use
//! `IDEMFLOW_TEST_POSTGRES_URL`, `IDEMFLOW_TEST_MYSQL_URL` and `IDEMFLOW_TEST_REDIS_URL`, are
//! skipped (with the reason printed) when one is unset, and fail when it is unset or unreachable
//! under `CI=true`.

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "sqlite")]
mod bad_input;
#[cfg(all(feature = "postgres", feature = "mysql", feature = "redis"))]
mod connect_errors;
#[cfg(feature = "sqlite")]
mod executor;
#[cfg(feature = "sqlite")]
mod extreme_values;
mod fuzz_props;
#[cfg(all(feature = "cli", feature = "sqlite"))]
mod metrics;
mod readme;
#[cfg(feature = "sqlite")]
mod replay_cache;
#[cfg(feature = "sqlite")]
mod spans;
