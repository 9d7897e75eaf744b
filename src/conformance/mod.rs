//! The conformance suites, exported so that a store written outside this crate can prove it
//! keeps every promise the built-in stores keep (feature `conformance`).
//!
//! The suites, each written once against `Arc<dyn Store>`:
//! - [`store`]: every store-level promise (claims, fencing, leases, stale keys, purge, history,
//!   limits, stats), and [`waiting`]: duplicates waiting for the first answer through the
//!   executor, both run through [`conformance_tests!`](crate::conformance_tests);
//! - [`sweeper`]: every recovery promise (the crash points settled by the sweeper against a
//!   [`FakeProvider`]), and [`workflow`]: every promise of workflow steps, both run through
//!   [`sweeper_tests!`](crate::sweeper_tests).
//!
//! Each macro takes the path of an async factory `fn() -> Option<Arc<dyn Store>>` and expands to
//! one `#[test]` per suite function, run on a two-worker multi-thread tokio runtime (see
//! [`run`]). The factory returns a migrated, **isolated** store (its own database, schema or key
//! prefix: `take_stale` and `purge` are table-wide, and the tests run in parallel), or `None`
//! to skip the test (say why; under CI, panic instead of skipping).
//!
//! ```
//! use std::sync::Arc;
//!
//! use idemflow::Store;
//! use idemflow::store::sqlite::SqliteStore;
//!
//! /// A migrated store of its own for every test; `None` would skip the test.
//! async fn my_store() -> Option<Arc<dyn Store>> {
//!     let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
//!     store.migrate().await.unwrap();
//!     Some(Arc::new(store))
//! }
//!
//! mod store_suite {
//!     use super::*;
//!     idemflow::conformance_tests!(my_store);
//! }
//!
//! mod sweeper_suite {
//!     use super::*;
//!     idemflow::sweeper_tests!(my_store);
//! }
//! # fn main() {}
//! ```
//!
//! The suite functions are public too, for a store that needs its own test harness:
//! `idemflow::conformance::store::scopes_are_isolated(store).await`.

/// Asserts that `$value` matches `$pattern`, showing the value when it does not: how the suites
/// check which error a call gave.
macro_rules! expect_match {
    ($value:expr, $pattern:pat) => {
        match &$value {
            value => assert!(matches!(value, $pattern), "{value:?}"),
        }
    };
}

mod delegate;
pub mod fake;
mod faulty;
pub mod store;
pub mod sweeper;
pub mod waiting;
pub mod workflow;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use delegate::Delegate;
pub use fake::FakeProvider;
pub use faulty::FaultyStore;
pub use store::{race_claims_across, sweepers_take_each_key_once_across};
pub use waiting::waiting_across_stores;

use crate::store::{ClaimOutcome, Finish, Lease, NewClaim, TakeStale};
use crate::{
    KeyId, KeyState, Store, StoredResponse, fingerprint::Fingerprint, key::IdempotencyKey,
    key::Scope, record::Actor, record::KeyRecord,
};

/// Runs one suite test to completion on a fresh two-worker multi-thread runtime, as the macros
/// do (so the caller's crate needs no tokio features of its own).
pub fn run(test: impl Future<Output = ()>) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime for the conformance test")
        .block_on(test);
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A scope no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{t}-{n}", std::process::id())
}

/// A key id from a scope and a key (panics on invalid ones: test input).
pub fn id(scope: &str, key: &str) -> KeyId {
    KeyId::new(
        Scope::new(scope).unwrap(),
        IdempotencyKey::new(key).unwrap(),
    )
}

/// A claim of `id` for a `payments.create` with `body`, provider `fake`, provider key
/// `pk-<key>`, the given lease and an hour of retention.
pub fn claim_for(id: &KeyId, body: &str, lease: Duration) -> NewClaim {
    NewClaim {
        id: id.clone(),
        operation: "payments.create".into(),
        provider: Some("fake".into()),
        provider_key: format!("pk-{}", id.key),
        fingerprint: Fingerprint::compute("payments.create", body),
        request: Some(body.to_owned()),
        owner: "test-worker".into(),
        lease,
        retention: Duration::from_secs(3600),
        takeover_window: None,
        renewed_key_base: None,
    }
}

/// Claims, and panics unless the claim won.
pub async fn claimed(store: &Arc<dyn Store>, c: &NewClaim) -> Lease {
    match store.claim(c).await.unwrap() {
        ClaimOutcome::Claimed(l) => l,
        ClaimOutcome::Existing { record, .. } => panic!("expected a claim, found {record:?}"),
    }
}

/// Takes up to `limit` stale keys for `owner` with `lease` (panics on a store error).
pub async fn taken(
    store: &Arc<dyn Store>,
    owner: &str,
    lease: Duration,
    limit: u32,
) -> Vec<KeyRecord> {
    store
        .take_stale(&TakeStale {
            owner: owner.into(),
            lease,
            limit,
            scope: None,
        })
        .await
        .expect("take_stale")
}

/// A worker's finish into `done` with `response`.
pub fn done(response: StoredResponse) -> Finish {
    Finish {
        to: KeyState::Done,
        response: Some(response),
        error: None,
        actor: Actor::Worker,
        reason: "ok".into(),
    }
}

/// A worker's finish into `failed` (a permanent failure stores a 402 response).
pub fn fail(retryable: bool) -> Finish {
    Finish {
        to: KeyState::Failed { retryable },
        response: (!retryable).then(|| StoredResponse::new(402).with_body(&b"declined"[..])),
        error: Some("card declined".into()),
        actor: Actor::Worker,
        reason: "failed".into(),
    }
}

/// Expands to one test per [`store`] suite function, each calling `$factory` for its store.
/// See the [module docs](crate::conformance) for the factory and an example.
#[macro_export]
macro_rules! conformance_tests {
    ($factory:path) => {
        $crate::conformance_tests!(@each $factory, store;
            claim_new_key_grants_first_token_and_history,
            second_claim_sees_the_key_in_flight,
            finish_stores_the_response_and_get_returns_it_exactly,
            stale_token_is_lease_lost_and_changes_nothing,
            scopes_are_isolated,
            other_fingerprint_never_reclaims,
            retryable_failure_is_reclaimed_by_the_same_request,
            permanent_failure_is_never_reclaimed,
            release_leaves_processing_for_the_sweeper,
            take_stale_respects_next_check_at,
            take_stale_fences_the_old_holder,
            take_stale_skips_live_leases_and_finished_keys,
            take_stale_in_a_scope_takes_only_its_keys,
            extend_moves_the_lease_and_is_fenced,
            a_released_lease_is_not_renewed,
            purge_deletes_only_expired_finished_keys_and_records_it,
            operator_override_fences_running_workers,
            finishing_into_processing_is_refused,
            concurrent_claims_have_one_winner,
            concurrent_sweepers_take_each_key_once,
            limits_round_trip_exactly,
            retry_takeover_only_inside_the_window,
            leases_use_the_database_clock,
            stats_count_every_state,
            history_survives_purge_and_is_ordered,
            huge_durations_are_capped_and_read_back_sane,
            operator_write_is_a_compare_and_set_on_the_token_read,
            tokens_only_grow_across_purge,
            cancelled_calls_leave_the_store_usable,
            provider_changes_only_while_no_attempt_may_have_acted,
            a_re_created_key_gets_its_own_provider_key,
            attempt_history_follows_every_write
        );
        $crate::conformance_tests!(@each $factory, waiting;
            duplicates_wait_for_the_first_answer,
            a_waiter_runs_the_request_when_the_first_did_nothing,
            waiting_ends_at_its_bound_with_in_flight,
            waiters_over_the_limit_are_refused_at_once,
            a_waiter_whose_caller_leaves_frees_its_place,
            thousand_waiting_duplicates_run_the_body_once,
            ends_are_announced_for_the_keys_waited_on_only
        );
    };
    (@each $factory:path, $suite:ident; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::conformance::run(async {
                    let Some(store) = $factory().await else { return };
                    $crate::conformance::$suite::$name(store).await;
                });
            }
        )*
    };
}

/// Expands to one test per [`sweeper`] suite function, each calling `$factory` for its store.
/// See the [module docs](crate::conformance) for the factory and an example.
#[macro_export]
macro_rules! sweeper_tests {
    ($factory:path) => {
        $crate::conformance_tests!(@each $factory, sweeper;
            crash_after_claim_before_call_is_redriven_once,
            crash_after_claim_before_call_without_keys_turns_retryable,
            lost_response_is_redriven_to_the_same_charge,
            lost_response_without_keys_is_found_by_lookup,
            died_before_storing_is_redriven_to_the_same_charge,
            failed_completion_is_settled_by_the_sweeper,
            zombie_worker_gets_lease_lost_and_changes_nothing,
            never_redrives_past_the_retention_window,
            declined_charge_settles_as_permanent_failure,
            lagging_search_defers_then_settles,
            unknown_lookup_backs_off_honouring_retry_after,
            unregistered_or_missing_provider_needs_an_operator,
            missing_request_is_only_looked_up,
            run_loop_sweeps_until_shutdown,
            hanging_provider_is_deferred_after_the_call_timeout,
            stuck_keys_and_expired_counts_for_operators,
            two_sweepers_handle_each_of_1000_keys_once,
            search_lag_counts_from_the_latest_attempt,
            a_late_clock_read_never_trusts_a_search_early,
            retryable_after_an_attempt_that_may_have_acted_is_unknown,
            retryable_after_attempts_that_did_nothing_stays_retryable,
            sweeper_renews_its_whole_batch,
            paused_past_the_lease_after_claim_sends_nothing,
            takeover_answered_after_its_window_sends_nothing,
            sweeper_paused_past_its_lease_renews_before_redriving,
            redrive_window_closing_before_the_send_sends_nothing
        );
        $crate::conformance_tests!(@each $factory, workflow;
            finished_steps_never_run_again,
            steps_have_distinct_stable_provider_keys,
            a_crash_after_a_step_resumes_from_the_next,
            renamed_or_removed_steps_are_refused,
            steps_outside_a_workflow_are_refused,
            sweeper_settles_steps_then_resumes_the_workflow,
            keyless_steps_are_never_taken_over,
            cut_off_follows_the_stored_retention
        );
    };
}
