//! The provider adapters through their real HTTP clients, against the testkit's fake providers
//! (and wiremock where the exact request matters), all in-process on 127.0.0.1: Stripe
//! (`providers_stripe`), Adyen, Square and PayPal (`providers_cards`), Resend and Postmark
//! (`providers_email`), `Idempotency::call` end to end on SQLite (`providers_e2e`), and secrets
//! kept out of storage and output (`secrets`; its `inspect` / `reconcile --json` checks need
//! feature `cli`). The target requires feature `testkit`; `providers_e2e` and `secrets` also
//! need `sqlite`.
//!
//! Needs no environment and no server, except `localstripe` (the Stripe adapters against the
//! third-party emulator), which skips with the reason printed when it is not installed.

#[path = "../support/mod.rs"]
mod support;

// Feature `testkit` is the target's `required-features` (Cargo.toml).
mod localstripe;
mod lookup_without_request;
mod providers_cards;
#[cfg(feature = "sqlite")]
mod providers_e2e;
mod providers_email;
mod providers_stripe;
mod providers_stripe_operations;
#[cfg(feature = "sqlite")]
mod secrets;
