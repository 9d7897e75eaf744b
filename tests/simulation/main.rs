//! The deterministic simulation of issue 11: seeded schedules of clients
//! ([`Idempotency::call`](idemflow::Idempotency::call)), sweepers, an operator and purge against
//! one store and a simulated provider, with crashes at every await point, lease expiry, search
//! lag, lost responses, faults, hangs and purge, checking after every step and at quiescence that
//! the provider acts at most once per key and that no effect is lost (see `docs/reliability.md`).
//! Half the schedules also hold a workflow of two steps (a keyed charge, then a keyless email,
//! through `Context::call_step`), whose steps are checked as keys of their own. On the SQL
//! backends, some hold an atomic phase (`Context::atomic_step`, [`atomic`]) and a one-commit key
//! (`Idempotency::execute_atomic`): on SQLite a few of them on a file with a second connection
//! contending for its write lock, on PostgreSQL and MariaDB/MySQL with the phase's connection
//! killed by the server; and a client's try may go through the other provider (a failover
//! between attempts). By default a third of the single calls are served through the axum
//! layer ([`http`]), and three in ten of the others are a queue's messages delivered to a consumer
//! ([`queue`]).
//!
//! The PRNG is our own SplitMix64 ([`rng`]), not proptest: the store under test is real (SQLite,
//! PostgreSQL, MariaDB, Redis) and leases run on the database clock, so a schedule is a sequence
//! of async steps against live I/O, which proptest's strategies and shrinking do not drive; one
//! `u64` seed reproduces the whole schedule, and a failing seed prints its trace.
//!
//! * `IDEMFLOW_SIM_CASES=N`: schedules per backend (default 2,000 on SQLite in memory, 300 on
//!   each of PostgreSQL, MariaDB/MySQL and Redis when their `IDEMFLOW_TEST_*_URL` is set).
//! * `IDEMFLOW_SIM_SEED=S`: run only schedule `S` and print its trace.
//! * `IDEMFLOW_SIM_FIRST_SEED=S`: the first seed (default 1); seeds are `S..S+N`.
//! * `IDEMFLOW_SIM_PARALLEL=P`: schedules run at once (default 48 on SQLite, 16 elsewhere).
//! * `IDEMFLOW_SIM_DUMP=1`: write the trace of every schedule that broke any check (known
//!   findings included) to `$TMPDIR/idemflow-sim-<backend>-failures.txt`.
//! * `IDEMFLOW_SIM_KNOWN_FINDINGS=0`: also fail on the checks tied to open findings (see
//!   [`checks::OPEN_FINDINGS`]).

mod atomic;
mod backends;
mod checks;
mod failover;
mod gate;
mod http;
mod provider;
mod queue;
mod rng;
mod store;
#[path = "../support/mod.rs"]
mod support;
mod world;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use backends::{Backend, StorePool};
use checks::{Check, OPEN_FINDINGS, Verdict, judge, known_findings_skipped};
use world::{CaseResult, Mode, run_case};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn replay_command(backend: &str, seed: u64) -> String {
    format!(
        "IDEMFLOW_SIM_SEED={seed} cargo test --all-features --test simulation {backend} -- --nocapture"
    )
}

/// Schedules that once broke a check, each with what it showed (seeds found on SQLite in memory;
/// see docs/reliability.md). They run on every `cargo test` (in `regression_seeds`, whatever
/// `IDEMFLOW_SIM_FIRST_SEED` says) and must pass.
const REGRESSION_SEEDS: &[(u64, &str)] = &[
    (289, "finding 1: search lag judged from the key's creation"),
    (
        937,
        "finding 2: retryable after an attempt that may have acted",
    ),
    (27, "finding 4: tokens restarted after a purge"),
    (205, "finding 5: resolve overwrote a decision"),
    (
        999,
        "finding 5: resolve made a key that had acted retryable",
    ),
    (
        5,
        "finding 10: a fixed lease ran out during a provider call",
    ),
    (
        13,
        "a client paused past its lease after its claim, then sent",
    ),
    (
        1477,
        "a takeover's re-send landed past the provider's dedup window",
    ),
    (
        246,
        "a sweeper paused past its lease re-drove under the expired lease",
    ),
    (
        1826,
        "an in-memory SQLite database lost its tables to a cancelled renewal",
    ),
    (
        369,
        "a replay counted in the generation after a purge (a simulation bug)",
    ),
];

/// Schedules with the actors added with workflows (atomic phases on SQLite, provider changes)
/// that once broke a check, found on the code before its fixes (docs/reliability.md, "Atomic
/// phases"). They run, with workflows, in `regression_seeds` too.
const REGRESSION_SEEDS_WITH_WORKFLOWS: &[(u64, &str)] = &[
    (
        44,
        "a trigger's RAISE(ROLLBACK) in a batched phase misled the batch's other callers",
    ),
    (
        61,
        "a panicking phase: its app row stayed while its step was processing",
    ),
    (252, "a panicking phase killed the writer task"),
    (
        397,
        "a lone read-only phase met another process's lock: acknowledged writes gone after reopening",
    ),
    (
        635,
        "a read-only phase met another process's newer snapshot: later writes failed (517)",
    ),
    (
        18,
        "a phase that swallowed a RAISE(ROLLBACK) and wrote on was told rolled back, its row committed",
    ),
    (
        7285,
        "a retry took over a key sent through the keyless provider and sent a second email",
    ),
];

/// Schedules with the actors and faults of `Mode::Full` (resumers, the sweeper lease on the
/// defaults' ratio, dropped store connections, the liveness check) that once broke a check, found
/// on the code before its fix (docs/reliability.md). They run, in that mode, in
/// `regression_seeds` too.
const REGRESSION_SEEDS_FULL: &[(u64, &str)] = &[
    (
        2,
        "issue 20, item 2: a failover's email went unseen by a lookup at the first provider; retried, a second email",
    ),
    (
        17,
        "issue 20, item 10: a sweeper killed after take_stale held its keys for its 5-minute lease",
    ),
    (
        3,
        "a sweeper's batch renewal landed after its own release and held the key for another lease",
    ),
];

/// Schedules with queue deliveries ([`Mode::Queues`]) that once broke a check, found on the code
/// before its fix (docs/reliability.md, "In `Mode::Queues`"). They run, in that mode, in
/// `regression_seeds` too.
const REGRESSION_SEEDS_QUEUES: &[(u64, &str)] = &[(
    59,
    "the sweeper re-drove a consumer's stored digest: the provider declined it, the charge never ran",
)];

/// Schedules with queue messages whose effect is the application's own ([`Mode::OwnEffects`])
/// that once broke a check, found on the code before its fix (docs/reliability.md, "In
/// `Mode::OwnEffects`"). They run, in that mode, in `regression_seeds` too.
const REGRESSION_SEEDS_OWN_EFFECTS: &[(u64, &str)] = &[
    (
        20,
        "a provider-less consumer's crashed run, delivered again after the retention, was never taken over",
    ),
    (
        30385,
        "a batched phase read its key through the insert of another caller's phase before it: \
         the read's `?17` went unbound, the key read as absent",
    ),
];

/// Runs the simulation on `backend`; panics when a check not tied to an open finding fails.
async fn simulate(backend: Backend, ci_cases: u64, default_parallel: u64) {
    let single = env_u64("IDEMFLOW_SIM_SEED");
    let seeds: Vec<u64> = match single {
        Some(s) => vec![s],
        None => {
            let first = env_u64("IDEMFLOW_SIM_FIRST_SEED").unwrap_or(1);
            let cases = env_u64("IDEMFLOW_SIM_CASES").unwrap_or_else(|| {
                if support::under_ci() {
                    ci_cases
                } else {
                    let quick = ci_cases / 10;
                    eprintln!(
                        "[sim {}] {quick} schedules (CI runs {ci_cases}; IDEMFLOW_SIM_CASES=N runs N)",
                        backend.name()
                    );
                    quick
                }
            });
            (first..first + cases).collect()
        }
    };
    let mode = match std::env::var("IDEMFLOW_SIM_MODE").as_deref() {
        Ok("classic") => Mode::Classic,
        Ok("workflows") => Mode::Workflows,
        Ok("full") => Mode::Full,
        Ok("one-commit") => Mode::OneCommit,
        Ok("webhooks") => Mode::Webhooks,
        Ok("waiting") => Mode::Waiting,
        Ok("outages") => Mode::Outages,
        Ok("failover") => Mode::Failover,
        Ok("http") => Mode::Http,
        Ok("queues") => Mode::Queues,
        Ok("own-effects") => Mode::OwnEffects,
        Ok("request-lookups") => Mode::RequestLookups,
        Ok("stuck-statements") | Err(_) => Mode::StuckStatements,
        Ok(other) => {
            panic!(
                "IDEMFLOW_SIM_MODE={other:?}: expected classic, workflows, full, one-commit, webhooks, waiting, outages, failover, http, queues, own-effects, request-lookups or stuck-statements"
            )
        }
    };
    simulate_seeds(backend, seeds, single.is_some(), default_parallel, mode).await;
}

/// Runs the given schedules on `backend`; `verbose` prints every trace.
/// One backend's simulation at a time in this binary. The schedules run leases of 120-250 ms,
/// renewed every third of that by the real heartbeat: four simulations at once on two cores
/// starved those renewals of CPU until leases lapsed under live provider calls (a takeover during
/// a live call, seen under a load average of 8), which is the machine failing the model, not the
/// code. Each backend still runs its schedules many at once.
static ONE_BACKEND_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The atomic phases' injected panics (`atomic::Fault::Panic`) are caught by the store's writer;
/// their messages are left out of the test's output. Every other panic is printed as usual.
fn quiet_injected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let injected = info
                .payload()
                .downcast_ref::<&str>()
                .is_some_and(|m| m.starts_with(atomic::INJECTED));
            if !injected {
                default(info);
            }
        }));
    });
}

/// `mode`: the actors and faults the schedules may hold (see `world::run_case`).
async fn simulate_seeds(
    backend: Backend,
    seeds: Vec<u64>,
    verbose: bool,
    default_parallel: u64,
    mode: Mode,
) {
    let _turn = ONE_BACKEND_AT_A_TIME.lock().await;
    quiet_injected_panics();
    let name = backend.name();
    let single = verbose.then_some(());
    let parallel = env_u64("IDEMFLOW_SIM_PARALLEL")
        .unwrap_or(default_parallel)
        .max(1);
    let skip = known_findings_skipped();
    let dump_all = std::env::var_os("IDEMFLOW_SIM_DUMP").is_some();
    if skip && !OPEN_FINDINGS.is_empty() {
        let skipped: Vec<String> = Check::ALL
            .iter()
            .filter_map(|c| {
                let f = c.finding()?;
                OPEN_FINDINGS
                    .contains(&f)
                    .then(|| format!("{} (finding {f}: {})", c.name(), Check::finding_title(f)))
            })
            .collect();
        eprintln!(
            "[sim {name}] KNOWN_FINDINGS on: not failing on these checks (nor on their consequences for the same key): {}",
            skipped.join("; ")
        );
    }
    let started = Instant::now();
    let pool = Arc::new(StorePool::new(backend));
    let sem = Arc::new(tokio::sync::Semaphore::new(parallel as usize));
    let mut set = tokio::task::JoinSet::new();
    for seed in seeds {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let pool = pool.clone();
        set.spawn(async move {
            let _permit = permit;
            let t0 = Instant::now();
            let file = mode.workflows() && world::on_file(seed);
            let slot = match pool.take(file).await {
                Ok(s) => s,
                Err(e) => panic!("{}: cannot open a store: {e}", pool.name()),
            };
            let setup = t0.elapsed();
            let r = run_case(
                seed,
                slot.store.clone(),
                slot.app.clone(),
                slot.replica.clone(),
                mode,
            )
            .await;
            let t1 = Instant::now();
            if let Err(e) = pool.give_back(slot).await {
                panic!("{}: cannot empty a store: {e}", pool.name());
            }
            (r, setup + t1.elapsed())
        });
    }
    let mut results: Vec<CaseResult> = Vec::new();
    let mut setup = std::time::Duration::ZERO;
    while let Some(r) = set.join_next().await {
        let (r, s) = r.expect("a schedule panicked");
        setup += s;
        results.push(r);
    }
    pool.close().await;
    results.sort_by_key(|r| r.seed);
    let elapsed = started.elapsed();
    let mut failing: Vec<(&CaseResult, Verdict)> = Vec::new();
    let mut known: BTreeMap<&'static str, (u64, u64, u8)> = BTreeMap::new();
    let mut consequences: BTreeMap<(&'static str, u8), (u64, u64)> = BTreeMap::new();
    let (mut effects, mut steps, mut starved) = (0usize, 0usize, Vec::new());
    let mut dead_lettered = 0u32;
    for r in &results {
        effects += r.effects;
        dead_lettered += r.dead_lettered;
        steps += r.steps;
        if r.starved > 0 {
            starved.push((r.seed, r.excused.len()));
        }
        let v = judge(&r.violations, skip);
        for x in &v.known {
            let e =
                known
                    .entry(x.check.name())
                    .or_insert((0, r.seed, x.check.finding().unwrap_or(0)));
            e.0 += 1;
        }
        for (x, f) in &v.consequences {
            consequences
                .entry((x.check.name(), *f))
                .or_insert((0, r.seed))
                .0 += 1;
        }
        if !v.failing.is_empty() || single.is_some() || (dump_all && !r.violations.is_empty()) {
            failing.push((r, v));
        }
    }
    eprintln!(
        "[sim {name}] {} schedules ({steps} steps, {effects} provider effects, {dead_lettered} queue deliveries dead-lettered) in {:.1}s: {:.1} schedules/s (parallel {parallel}; {} stores opened; opening or emptying a store took {:.0} ms per schedule on average)",
        results.len(),
        elapsed.as_secs_f64(),
        results.len() as f64 / elapsed.as_secs_f64(),
        pool.created(),
        setup.as_secs_f64() * 1000.0 / results.len().max(1) as f64
    );
    if !starved.is_empty() {
        eprintln!(
            "[sim {name}] {} schedules saw a takeover during a live call, or an effect after its holder's lease ran out, whose holder's renewals could not get through (the store down, a renewal unanswered, or the runtime stalled for a third of a lease): outside the guarantee's assumptions, so that key's later violations are printed, not failed ({} of them; (seed, violations excused): {:?})",
            starved.len(),
            starved.iter().map(|(_, n)| n).sum::<usize>(),
            &starved[..starved.len().min(20)]
        );
        for r in results.iter().filter(|r| !r.excused.is_empty()).take(5) {
            for x in &r.excused {
                eprintln!(
                    "[sim {name}]   seed {} (after a starved takeover): {x}",
                    r.seed
                );
            }
        }
    }
    let failed_over: Vec<&CaseResult> = results.iter().filter(|r| r.failovers > 0).collect();
    if !failed_over.is_empty() {
        // (check, why) -> violations: the text is "check on key: detail (why)".
        let mut by_check: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        for x in failed_over.iter().flat_map(|r| &r.lost_writes_excused) {
            let check = x.split(" on ").next().unwrap_or("?");
            let why = x
                .rsplit_once(" (")
                .map_or("?", |(_, w)| w.trim_end_matches(')'));
            *by_check.entry((check, why)).or_default() += 1;
        }
        eprintln!(
            "[sim {name}] {} schedules had failovers that lost acknowledged writes ({} failovers, {} keys rolled back); what that explains on those keys was printed, not failed: {by_check:?}",
            failed_over.len(),
            failed_over.iter().map(|r| r.failovers).sum::<usize>(),
            failed_over.iter().map(|r| r.rolled_back).sum::<usize>(),
        );
        for r in failed_over
            .iter()
            .filter(|r| !r.lost_writes_excused.is_empty())
            .take(3)
        {
            for x in r.lost_writes_excused.iter().take(4) {
                eprintln!(
                    "[sim {name}]   seed {} (after a lossy failover): {x}",
                    r.seed
                );
            }
        }
    }
    for (check, (n, seed, f)) in &known {
        eprintln!(
            "[sim {name}] known finding {f} ({}): check {check} broken in {n} violations; first seed {seed}: {}",
            Check::finding_title(*f),
            replay_command(name, *seed)
        );
    }
    for ((check, f), (n, seed)) in &consequences {
        eprintln!(
            "[sim {name}] {n} violations of {check} followed finding {f} on the same key (first seed {seed})"
        );
    }
    for r in &results {
        // The atomic phases' seeds are SQLite schedules with workflows.
        let atomic: &[(u64, &str)] = match mode {
            Mode::Workflows if name == "sqlite" => REGRESSION_SEEDS_WITH_WORKFLOWS,
            Mode::Full => REGRESSION_SEEDS_FULL,
            Mode::Queues if name == "sqlite" => REGRESSION_SEEDS_QUEUES,
            Mode::OwnEffects if name == "sqlite" => REGRESSION_SEEDS_OWN_EFFECTS,
            _ => &[],
        };
        let classic: &[(u64, &str)] = if mode == Mode::Classic {
            REGRESSION_SEEDS
        } else {
            &[]
        };
        if let Some((_, what)) = classic.iter().chain(atomic).find(|(s, _)| *s == r.seed) {
            eprintln!(
                "[sim {name}] regression seed {} ({what}): {}",
                r.seed,
                if r.violations.is_empty() {
                    "every check held".to_owned()
                } else {
                    format!("{} violations", r.violations.len())
                }
            );
        }
    }
    let dump = std::env::temp_dir().join(format!("idemflow-sim-{name}-failures.txt"));
    let mut all = String::new();
    for (r, v) in &failing {
        all.push_str(&format!("===== seed {} =====\n", r.seed));
        for line in &r.trace {
            all.push_str(line);
            all.push('\n');
        }
        for x in v.failing.iter().chain(&v.known) {
            all.push_str(&format!(
                "{} on {} at step {}: {}\n",
                x.check.name(),
                x.key,
                x.step,
                x.detail
            ));
        }
    }
    if !all.is_empty() && std::fs::write(&dump, all).is_ok() {
        eprintln!(
            "[sim {name}] traces of the reported schedules: {}",
            dump.display()
        );
    }
    let mut bad = 0;
    for (r, v) in &failing {
        if v.failing.is_empty() && single.is_none() {
            continue;
        }
        bad += 1;
        if bad > 3 && single.is_none() {
            continue;
        }
        eprintln!("\n[sim {name}] ===== seed {} =====", r.seed);
        for line in &r.trace {
            eprintln!("{line}");
        }
        for x in &v.failing {
            eprintln!(
                "[sim {name}] FAILED {} on {} at step {}: {}",
                x.check.name(),
                x.key,
                x.step,
                x.detail
            );
        }
        for x in &v.known {
            eprintln!(
                "[sim {name}] known (finding {}) {} on {} at step {}: {}",
                x.check.finding().unwrap_or(0),
                x.check.name(),
                x.key,
                x.step,
                x.detail
            );
        }
        eprintln!("[sim {name}] replay: {}", replay_command(name, r.seed));
    }
    let failed_seeds: Vec<u64> = failing
        .iter()
        .filter(|(_, v)| !v.failing.is_empty())
        .map(|(r, _)| r.seed)
        .collect();
    assert!(
        failed_seeds.is_empty(),
        "[sim {name}] {} schedules broke an invariant (seeds {:?}); replay one with: {}",
        failed_seeds.len(),
        &failed_seeds[..failed_seeds.len().min(20)],
        replay_command(name, failed_seeds[0])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_seeds() {
    let seeds = REGRESSION_SEEDS.iter().map(|(s, _)| *s).collect();
    simulate_seeds(Backend::SqliteMemory, seeds, false, 8, Mode::Classic).await;
    let seeds = REGRESSION_SEEDS_WITH_WORKFLOWS
        .iter()
        .map(|(s, _)| *s)
        .collect();
    simulate_seeds(Backend::SqliteMemory, seeds, false, 8, Mode::Workflows).await;
    let seeds = REGRESSION_SEEDS_FULL.iter().map(|(s, _)| *s).collect();
    simulate_seeds(Backend::SqliteMemory, seeds, false, 8, Mode::Full).await;
    let seeds = REGRESSION_SEEDS_QUEUES.iter().map(|(s, _)| *s).collect();
    simulate_seeds(Backend::SqliteMemory, seeds, false, 8, Mode::Queues).await;
    let seeds = REGRESSION_SEEDS_OWN_EFFECTS
        .iter()
        .map(|(s, _)| *s)
        .collect();
    simulate_seeds(Backend::SqliteMemory, seeds, false, 8, Mode::OwnEffects).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_memory() {
    simulate(Backend::SqliteMemory, 2000, 48).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    let Some(url) = support::backend_url("IDEMFLOW_TEST_POSTGRES_URL") else {
        return;
    };
    simulate(Backend::Postgres(url), 300, 16).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    let Some(url) = support::backend_url("IDEMFLOW_TEST_MYSQL_URL") else {
        return;
    };
    simulate(Backend::MySql(url), 300, 16).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    let Some(url) = support::backend_url("IDEMFLOW_TEST_REDIS_URL") else {
        return;
    };
    simulate(Backend::Redis(url), 300, 16).await;
}
