//! # idemflow
//!
//! Idempotency keys done properly: make calls to external providers (card processors, email
//! services) safe to retry. A customer presses "Pay", the server charges the card, the response
//! is lost, the app retries: with idemflow the retry gets the first answer back instead of a
//! second charge.
//!
//! * Each (scope, key) is one row moving `processing -> done | failed`, claimed atomically
//!   through the primary key, guarded by a lease with a fencing token, and every transition is
//!   appended to a history table in the same statement.
//! * Requests are fingerprinted (canonical JSON, SHA-256, versioned): the same key with another
//!   request is refused ([`Error::FingerprintMismatch`], HTTP 422), never replayed.
//! * Responses are stored (status, chosen headers, body) and replayed byte for byte.
//! * The operation gets a stable provider key ([`Context::provider_key`]) to forward, so a
//!   provider that dedupes by key never acts twice.
//! * The database's clock decides leases and expiry.
//!
//! ## Quick start
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use idemflow::{Error, Idempotency, Outcome, IdempotentRequest, StoredResponse, Store, store::sqlite::SqliteStore};
//!
//! let store = SqliteStore::connect("sqlite::memory:").await?;
//! store.migrate().await?; // idemflow's tables, in idemflow's own migrations table
//! let idem = Idempotency::new(Arc::new(store));
//!
//! let pay = |amount: u32| {
//!     IdempotentRequest::new("acct_42", "8e03978e-40d5", "payments.create", &serde_json::json!({"amount": amount}))
//! };
//! let charge = |ctx: idemflow::Context| async move {
//!     // Call the provider with ctx.provider_key() as its idempotency key, then classify.
//!     Outcome::Succeeded(StoredResponse::json(201, &serde_json::json!({"payment_id": 1})).unwrap())
//! };
//!
//! let first = idem.execute(pay(500)?, charge).await?;
//! let retry = idem.execute(pay(500)?, charge).await?;
//! assert!(retry.is_replay());
//! assert_eq!(first.response(), retry.response()); // byte for byte
//!
//! let misuse = idem.execute(pay(900)?, charge).await;
//! assert!(matches!(misuse, Err(Error::FingerprintMismatch { .. })));
//! # Ok(())
//! # }
//! ```
//!
//! ## Outcomes
//!
//! The operation returns an [`Outcome`]: `Succeeded` (stored, replayed), `Rejected` (a permanent
//! refusal such as a declined card; stored, replayed), `Retryable` (the provider surely did
//! nothing; the next retry runs it again) or `Unknown` (it may have happened; the key stays
//! `processing` and the sweeper asks the provider). See `docs/design.md` for the guarantees and
//! their limits.
//!
//! ## Features
//!
//! | feature | what |
//! |---|---|
//! | `sqlite` (default) | [`store::sqlite::SqliteStore`], embedded |
//! | `postgres` | `store::postgres::PostgresStore`, for many app instances and sweepers |
//! | `mysql` | `store::mysql::MySqlStore` (MariaDB >= 10.6; MySQL untested, `docs/backends.md`) |
//! | `redis` | `store::redis::RedisStore` (one Lua script per transition) |
//! | `http` | `provider::http`, provider adapters: `provider::Stripe`, `provider::Resend`, `provider::Postmark` |
//! | `axum` | `axum::IdempotencyLayer`, IETF `Idempotency-Key` semantics for axum services; `axum::webhook`, webhook receivers |
//! | `rabbitmq` | `consumer::amqp`, a RabbitMQ queue consumer (through `lapin`) running its handler once per message key |
//! | `nats` | `consumer::nats`, a NATS JetStream consumer (through `async-nats`), the same |
//! | `testkit` | fake provider servers with a ledger and fault injection |
//! | `cli` | the `idemflow` reconciler binary |
//!
//! [`store::connect`] opens whichever backend a URL names. The recovery [`Sweeper`] settles keys
//! left `processing` by crashes and lost responses, from the provider's own records.
//!
//! The library never installs a tracing subscriber; every transition runs in a `tracing` span
//! (`idemflow.execute`, `idemflow.claim`, `idemflow.finish`, `idemflow.sweep_key`, ...).

#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod axum;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
pub mod consumer;
mod debug_fields;
pub mod error;
pub mod executor;
pub mod fingerprint;
pub mod key;
#[cfg(test)]
mod layers;
pub mod outcome;
pub mod provider;
pub mod provider_key;
pub mod record;
pub mod response;
mod setters;
pub mod state;
pub mod store;
pub mod sweeper;
pub mod telemetry;
#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub mod testkit;
pub mod workflow;

/// The composition root: the executor runs a workflow key through this hook, which the workflow
/// layer implements, so the executor imports nothing above it (`ARCHITECTURE.md`).
pub(crate) static WORKFLOW_RUNS: &dyn executor::hook::RunHook = &workflow::Runs;

/// The README's code blocks, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

// Each guide of `docs/` with Rust blocks is its module's rustdoc (`#![doc = include_str!(..)]`
// in the module, gated on the features its blocks use), so its blocks are doctests of that
// module: `.ci/run`'s `cargo test --all-features` runs them all. `tests/api/readme.rs` checks
// that every such page is included by a file of `src/`.

pub use async_trait::async_trait;
pub use error::{Error, StoreError};
pub use executor::{Context, Execution, Idempotency, IdempotentRequest};
pub use key::KeyId;
pub use outcome::Outcome;
pub use provider::{Provider, Providers};
pub use response::StoredResponse;
pub use state::KeyState;
pub use store::Store;
pub use sweeper::Sweeper;
