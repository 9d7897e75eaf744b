//! The one helper root of the test binaries, included by each as
//! `#[path = "../support/mod.rs"] mod support;`: an isolated store per test on each backend (a
//! fresh SQLite database, PostgreSQL schema, MariaDB database or Redis key prefix), its clean-up,
//! and the one rule for a backend that is not there: an unset URL skips the test with a printed
//! reason, and under `CI=true` an unset or unreachable backend is a failure; the fake card
//! processor of the executor-level tests ([`charger`]); and [`test_name`], the name a test
//! re-running its own binary as a child passes to `--exact`.

#![allow(dead_code)]

pub mod charger;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod proxy;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "sqlite")]
pub mod sqlite;

use std::sync::atomic::{AtomicU64, Ordering};

/// Reads the env var holding a backend's URL; `None` (skip, with a printed reason) when unset,
/// a panic when unset under `CI=true`.
pub fn backend_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            if under_ci() {
                panic!("{var} is not set and CI=true: this backend must be tested in CI");
            }
            eprintln!("skipping: {var} is not set");
            None
        }
    }
}

/// The backend at `var` did not answer: `None` (skip, with a printed reason), a panic under
/// `CI=true`.
pub fn unreachable<T>(backend: &str, var: &str, e: impl std::fmt::Display) -> Option<T> {
    if under_ci() {
        panic!("{backend} at {var} is unreachable and CI=true: {e}");
    }
    eprintln!("skipping: {backend} at {var} is unreachable: {e}");
    None
}

/// Whether this run is CI (`CI=true`): backends must answer, and soaks run their CI size.
pub fn under_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// The prefix of every schema or database the tests create.
pub const PREFIX: &str = "idemflow_t_";
static NAMES: AtomicU64 = AtomicU64::new(0);

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A schema or database name no other test (or process) uses: the prefix, the creation time,
/// the process and a counter.
pub fn fresh_name() -> String {
    format!(
        "{PREFIX}{}_{}_{}",
        now_secs(),
        std::process::id(),
        NAMES.fetch_add(1, Ordering::Relaxed)
    )
}

/// Whether `name` (from [`fresh_name`]) was created more than an hour ago: left behind by an
/// earlier run, safe to drop.
pub fn left_behind(name: &str) -> bool {
    let born: Option<u64> = name
        .strip_prefix(PREFIX)
        .and_then(|rest| rest.split('_').next())
        .and_then(|s| s.parse().ok());
    born.is_some_and(|b| b + 3600 < now_secs())
}

/// A child process, killed (if still running) and reaped when dropped: a failing test leaves
/// no child behind.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The name libtest gives test `name` in the module at `module_path` (pass `module_path!()`):
/// the module path without the crate's own name, then `name`. A test that re-runs its own binary
/// as a child passes it to `--exact`, so that the name follows the module wherever it moves.
pub fn test_name(module_path: &str, name: &str) -> String {
    match module_path.split_once("::") {
        Some((_crate, path)) => format!("{path}::{name}"),
        None => name.to_owned(),
    }
}

/// This test binary run again as a child process that runs only the ignored test `name` of the
/// module at `module_path` (pass `module_path!()`), on one test thread, its output not captured.
/// The caller adds the child's environment and its stdio.
pub fn child_test(module_path: &str, name: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        &test_name(module_path, name),
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd
}

/// The runtime a child process's body runs on: two workers, as the tests' own.
pub fn child_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
