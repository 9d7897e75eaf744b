//! The HTTP side: the axum `Idempotency-Key` layer driven with `tower::ServiceExt::oneshot`
//! (`http_layer`), and the three example services (`examples/{card,checkout,email}_service.rs`,
//! included as modules) over real sockets on 127.0.0.1 against the testkit's fake Stripe and
//! Resend (`card_service`, `checkout_service`, `email_service`, features `http` and `testkit`).
//! `checkout_service`'s black-box judge re-runs this binary as a child (`--exact
//! checkout_service::child_serves_the_checkout_example`) serving the example, and kills it
//! mid-load (`IDEMFLOW_CHECKOUT_JUDGE_SEED=S` replays one fault schedule). With feature `cli`,
//! `card_service` also builds the example with `cargo build --example card_service`, runs it as a
//! process, kills it mid-load and reconciles with the `idemflow` binary.
//!
//! `webhooks` drives the Stripe webhook receiver and `examples/webhook_service.rs` with the
//! testkit's signed `WebhookSender` (features `http` and `testkit`; on PostgreSQL too when
//! `IDEMFLOW_TEST_POSTGRES_URL` is set, feature `postgres`); `webhook_kill` re-runs this binary
//! as a one-commit receiver (`--exact webhook_kill::child_serves_a_one_commit_receiver`) and
//! kills it with SIGKILL inside an effect's transaction. `stripe_atomic` drives
//! `examples/stripe_atomic.rs`, the one-commit receiver, the same way (features `http` and
//! `testkit`).
//!
//! `store_down` takes the store away under the layer (a TCP proxy in front of PostgreSQL, MariaDB
//! and Redis, stopped and started; a SQLite file's write lock held by another connection) and
//! checks the 503, the opt-in pass-through and the recovery.
//!
//! The target requires features `axum` and `sqlite`. Needs no environment and no server: SQLite
//! files in temporary directories.

#[path = "../support/mod.rs"]
mod support;

// Features `axum` and `sqlite` are the target's `required-features` (Cargo.toml).
#[cfg(all(feature = "http", feature = "testkit"))]
mod card_service;
#[cfg(all(feature = "http", feature = "testkit"))]
mod checkout_service;
#[cfg(all(feature = "http", feature = "testkit"))]
mod context_call;
#[cfg(all(feature = "http", feature = "testkit"))]
mod email_service;
mod http_layer;
mod store_down;
#[cfg(all(feature = "http", feature = "testkit"))]
mod stripe_atomic;
#[cfg(all(feature = "http", feature = "testkit"))]
mod webhook_kill;
#[cfg(all(feature = "http", feature = "testkit"))]
mod webhooks;
