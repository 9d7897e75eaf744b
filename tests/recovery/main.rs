//! What a crash, a lost answer or a failed write leaves behind, and how the sweeper settles it:
//! crash points against the testkit's fake providers through the real HTTP adapters, for Stripe
//! and Postmark with the `idemflow reconcile --once` CLI (`recovery_testkit`) and for Adyen,
//! Square and PayPal (`recovery_cards`); the three-step checkout workflow killed before, during
//! and after each step (`workflow_crash_matrix`); these three need features `testkit` and
//! `sqlite`. And atomic phases (`atomic_phases`, any SQL backend): the application's rows and the
//! step's record committed together or not at all, on PostgreSQL, MariaDB and SQLite; its module
//! `crash` re-runs this binary as a child (`--exact atomic_phases::crash::child`) and SIGKILLs it
//! during phases (`IDEMFLOW_ATOMIC_CRASH_SEED=S` replays one run).
//!
//! A worker process SIGKILLed inside a Stripe capture and inside a refund, settled by the
//! sweeper with one effect each (`operations_kill`, features `testkit` and `sqlite`; it re-runs
//! this binary as a child, `--exact operations_kill::child_calls_until_killed`).
//!
//! SQLite always (file databases in temporary directories). PostgreSQL and MariaDB need
//! `IDEMFLOW_TEST_POSTGRES_URL` and `IDEMFLOW_TEST_MYSQL_URL`; each test on them is skipped (with
//! the reason printed) when its URL is unset, and fails when the URL is unset or unreachable
//! under `CI=true`.

#[path = "../support/mod.rs"]
mod support;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod atomic_phases;
#[cfg(all(feature = "testkit", feature = "sqlite"))]
mod operations_kill;
#[cfg(all(feature = "cli", feature = "testkit", feature = "sqlite"))]
mod reconcile_cli;
#[cfg(all(feature = "testkit", feature = "sqlite"))]
mod recovery_cards;
#[cfg(all(feature = "testkit", feature = "sqlite"))]
mod recovery_testkit;
#[cfg(all(feature = "testkit", feature = "sqlite"))]
mod workflow_crash_matrix;
