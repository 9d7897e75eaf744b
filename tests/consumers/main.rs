//! The queue consumers (`idemflow::consumer`) against real brokers: RabbitMQ
//! (`IDEMFLOW_TEST_AMQP_URL`, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`) and NATS with
//! JetStream (`IDEMFLOW_TEST_NATS_URL`, e.g. `nats://127.0.0.1:4222`). An unset URL skips a
//! broker's tests with a printed reason; under `CI=true` an unset or unreachable broker fails
//! them. Each test declares a queue (or stream) of its own and deletes it at the end.
//!
//! The scenarios (`scenarios.rs`) are written once over the [`scenarios::Broker`] trait and run
//! on each broker (`amqp.rs`, `nats.rs`):
//!
//! - 1,000 messages and 200 duplicates (some interleaved, some published after the original was
//!   acknowledged): one effect per id, and every delivery acknowledged;
//! - a duplicate delivered while the first is being handled: left for redelivery, acknowledged
//!   without running once the first is done;
//! - a handler whose outcome is `Unknown`: the message stays unacknowledged until the sweeper
//!   settles the key from the provider's records, then is acknowledged without running again;
//! - a message without a message id: rejected for good; a handler that panics: its message
//!   redelivered and handled;
//! - the kill test: a child process (this binary, re-run as
//!   `scenarios::child_consumes_until_killed`) records a message's effect and hangs; it is
//!   killed with SIGKILL; the broker redelivers to a consumer in the test, the sweeper settles
//!   the key from the effect's records, and the effect stays single.
//!
//! The keys and the effects live in SQLite files in a temporary directory (both processes open
//! them). The target requires features `rabbitmq`, `nats` and `sqlite`.
//!
//! `receipts.rs` (with features `http` and `testkit`) runs `examples/receipts_worker.rs`: three
//! worker processes on one queue, one killed with SIGKILL while the fake Resend holds its
//! answer; the peers' in-process sweepers settle its key, one email per order.
//!
//! `jobs.rs` (with features `postgres` and `testkit`) is the background-job counterpart: an
//! apalis job queue on PostgreSQL (`IDEMFLOW_TEST_POSTGRES_URL`), its job charging through
//! idemflow (`examples/background_jobs.rs`): a retry after the charge, a worker killed with
//! SIGKILL in the charge and after it, and duplicate jobs; one charge per charge id.

#[path = "../support/mod.rs"]
mod support;

mod amqp;
#[cfg(all(feature = "postgres", feature = "testkit"))]
mod jobs;
mod nats;
#[cfg(all(feature = "http", feature = "testkit"))]
mod receipts;
mod scenarios;
