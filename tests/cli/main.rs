//! The `idemflow` binary (features `cli` and `sqlite`; this test target requires them in
//! `Cargo.toml`), run as a process against a temporary SQLite file: every subcommand, `--json`
//! output, exit codes (0 ok, 1 error, 2 usage, 3 unresolved), configuration errors, the
//! metrics listener, and the error for a URL of a backend the binary was built without.
//!
//! Needs no environment; the same commands on PostgreSQL (feature `postgres`) use
//! `IDEMFLOW_TEST_POSTGRES_URL`, are skipped (with the reason printed) when it is unset, and
//! fail when it is unset or unreachable under `CI=true`.

#[path = "../support/mod.rs"]
mod support;

mod cli;
