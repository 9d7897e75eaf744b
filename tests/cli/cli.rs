//! Runs the built `idemflow` binary against a temporary SQLite file: every subcommand, `--json`
//! output, exit codes (0 ok, 1 error, 2 usage, 3 unresolved) and configuration errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idemflow::store::sqlite::SqliteStore;
use idemflow::{Error, Idempotency, IdempotentRequest, Outcome, Store, StoredResponse};
use serde_json::Value;

struct Db {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Db {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idemflow.db");
        Self { _dir: dir, path }
    }

    fn url(&self) -> String {
        format!("sqlite://{}", self.path.display())
    }

    fn dir(&self) -> &Path {
        self._dir.path()
    }

    /// Runs the binary with this database.
    fn run(&self, args: &[&str]) -> Output {
        run_with_env(args, &[("DATABASE_URL", &self.url())])
    }

    async fn store(&self) -> Arc<dyn Store> {
        Arc::new(SqliteStore::connect(&self.url()).await.unwrap())
    }
}

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_idemflow"));
    c.env_remove("DATABASE_URL")
        .env_remove("IDEMFLOW_CONFIG")
        .env_remove("IDEMFLOW_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    c
}

fn run_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = bin();
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exit code")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", stdout(o)))
}

#[track_caller]
fn expect(o: &Output, want: i32) {
    assert_eq!(
        code(o),
        want,
        "stdout: {}\nstderr: {}",
        stdout(o),
        stderr(o)
    );
}

async fn migrated() -> Db {
    let db = Db::new();
    let o = db.run(&["migrate"]);
    expect(&o, 0);
    db
}

/// A key left processing (released, so stale at once) naming `provider`.
async fn stuck_key(store: &Arc<dyn Store>, scope: &str, key: &str, provider: Option<&str>) {
    let mut req = IdempotentRequest::new(
        scope,
        key,
        "payments.create",
        &serde_json::json!({"amount": 5}),
    )
    .unwrap();
    if let Some(p) = provider {
        req = req.provider(p);
    }
    let err = Idempotency::new(store.clone())
        .execute(req, |_ctx| async {
            Outcome::unknown("timed out after sending")
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }));
}

#[tokio::test]
async fn migrate_is_idempotent_and_stats_json_parses() {
    let db = migrated().await;
    expect(&db.run(&["migrate"]), 0);
    let o = db.run(&["--json", "migrate"]);
    expect(&o, 0);
    assert_eq!(json(&o)["migrated"], true);

    let o = db.run(&["stats"]);
    expect(&o, 0);
    assert!(stdout(&o).contains("processing"), "{}", stdout(&o));
    let o = db.run(&["stats", "--json"]);
    expect(&o, 0);
    let j = json(&o);
    assert_eq!(j["processing"], 0);
    assert_eq!(j["stuck_past_alert_age"], 0);
}

#[tokio::test]
async fn reconcile_exits_3_for_an_unregistered_provider_then_0_once_resolved() {
    let db = migrated().await;
    expect(&db.run(&["reconcile", "--once"]), 0);

    let store = db.store().await;
    stuck_key(&store, "acct_1", "order-1", Some("ghost-pay")).await;

    let o = db.run(&["reconcile", "--once"]);
    expect(&o, 3);
    assert!(stderr(&o).contains("acct_1/order-1"), "{}", stderr(&o));
    assert!(stderr(&o).contains("ghost-pay"), "{}", stderr(&o));

    // Still unresolved on the next run (the key waits for its operator recheck).
    let o = db.run(&["--json", "reconcile"]);
    expect(&o, 3);
    let j = json(&o);
    assert_eq!(j["report"]["taken"], 0);
    assert_eq!(j["still_waiting"], 1);

    // stats shows it stale and, with a tiny alert age, stuck.
    let o = db.run(&["stats", "--json", "--alert-age", "1ms"]);
    expect(&o, 3);
    let j = json(&o);
    assert_eq!(j["processing"], 1);
    assert_eq!(j["stale"], 1);
    assert_eq!(j["stuck_past_alert_age"], 1);
    assert_eq!(j["stuck"][0]["key"], "order-1");
    expect(&db.run(&["stats", "--alert-age", "1h"]), 0);

    // An operator decides it; the decision is in history; the client's retry replays it.
    let o = db.run(&[
        "resolve",
        "acct_1",
        "order-1",
        "--done",
        "--status",
        "201",
        "--body",
        r#"{"charge":"ch_9"}"#,
        "--reason",
        "found ch_9 in the ghost-pay dashboard",
    ]);
    expect(&o, 0);
    assert!(stdout(&o).contains("processing -> done"), "{}", stdout(&o));

    let o = db.run(&["--json", "inspect", "acct_1", "order-1"]);
    expect(&o, 0);
    let j = json(&o);
    assert_eq!(j["key"]["state"], "done");
    assert_eq!(j["key"]["response"]["body"], r#"{"charge":"ch_9"}"#);
    let history = j["history"].as_array().unwrap();
    let last = history.last().unwrap();
    assert_eq!(last["actor"], "operator");
    assert!(last["reason"].as_str().unwrap().contains("ch_9"));
    assert!(history.iter().any(|e| e["actor"] == "sweeper"));

    let o = db.run(&["inspect", "acct_1", "order-1"]);
    expect(&o, 0);
    assert!(stdout(&o).contains("history:"));
    assert!(stdout(&o).contains("operator"));

    let retry = Idempotency::new(store.clone())
        .execute(
            IdempotentRequest::new(
                "acct_1",
                "order-1",
                "payments.create",
                &serde_json::json!({"amount": 5}),
            )
            .unwrap()
            .provider("ghost-pay"),
            |_ctx| async { panic!("must not run again") },
        )
        .await
        .unwrap();
    assert!(retry.is_replay());
    assert_eq!(retry.response().body(), br#"{"charge":"ch_9"}"#);

    expect(&db.run(&["reconcile"]), 0);

    // Overriding a finished key needs --force.
    let again = [
        "resolve", "acct_1", "order-1", "--failed", "--reason", "oops",
    ];
    let o = db.run(&again);
    expect(&o, 1);
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    let mut forced = again.to_vec();
    forced.push("--force");
    expect(&db.run(&forced), 0);
}

#[tokio::test]
async fn keys_without_a_provider_need_an_operator_and_can_be_made_retryable() {
    let db = migrated().await;
    let store = db.store().await;
    stuck_key(&store, "acct_2", "k", None).await;
    let o = db.run(&["--json", "reconcile", "--batch", "10"]);
    expect(&o, 3);
    let j = json(&o);
    assert_eq!(j["report"]["needs_operator"], 1);
    assert_eq!(j["report"]["unresolved"][0]["kind"], "needs_operator");
    assert_eq!(j["clean"], false);

    let o = db.run(&[
        "--json",
        "resolve",
        "acct_2",
        "k",
        "--failed",
        "--retryable",
        "--reason",
        "provider confirms nothing happened",
    ]);
    expect(&o, 0);
    assert_eq!(
        json(&o)["key"]["state"],
        serde_json::json!({"failed": {"retryable": true}})
    );
    expect(&db.run(&["reconcile"]), 0);
}

#[tokio::test]
async fn purge_dry_run_counts_and_purge_deletes() {
    let db = migrated().await;
    let store = db.store().await;
    let idem = Idempotency::new(store.clone()).retention(Duration::from_millis(10));
    idem.execute(
        IdempotentRequest::new("acct_3", "k", "op", &serde_json::json!({})).unwrap(),
        |_ctx| async { Outcome::Succeeded(StoredResponse::new(200)) },
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;

    let o = db.run(&["--json", "purge", "--dry-run"]);
    expect(&o, 0);
    assert_eq!(json(&o)["would_purge"], 1);
    let o = db.run(&["purge", "--batch", "1"]);
    expect(&o, 0);
    assert!(stdout(&o).contains("1 finished keys"), "{}", stdout(&o));
    let o = db.run(&["--json", "purge"]);
    expect(&o, 0);
    assert_eq!(json(&o)["purged"], 0);

    // The row is gone, its history stays.
    let o = db.run(&["--json", "inspect", "acct_3", "k"]);
    expect(&o, 0);
    let j = json(&o);
    assert!(j["key"].is_null());
    assert_eq!(
        j["history"].as_array().unwrap().last().unwrap()["actor"],
        "purge"
    );
    expect(&db.run(&["inspect", "acct_3", "nope"]), 1);
}

#[tokio::test]
async fn usage_errors_exit_2() {
    let db = migrated().await;
    for args in [
        &["resolve", "s", "k", "--reason", "x"][..],
        &["resolve", "s", "k", "--done", "--failed", "--reason", "x"],
        &[
            "resolve",
            "s",
            "k",
            "--done",
            "--retryable",
            "--reason",
            "x",
        ],
        &[
            "resolve", "s", "k", "--done", "--reason", "x", "--status", "42",
        ],
        &["reconcile", "--once", "--every", "1m"],
        &["reconcile", "--every", "soon"],
        &["purge", "--batch", "0"],
        &["frobnicate"],
        &[],
    ] {
        let o = db.run(args);
        expect(&o, 2);
    }
    // Bad input that clap cannot see is an error naming the rule, not a panic.
    let o = db.run(&["inspect", "has space", "k"]);
    expect(&o, 1);
    assert!(stderr(&o).contains("SCOPE"), "{}", stderr(&o));
}

#[tokio::test]
async fn reconcile_config_accepts_the_card_processor_kinds() {
    let db = migrated().await;
    let path = db.dir().join("cards.toml");
    std::fs::write(
        &path,
        "[[providers]]\nkind = \"adyen\"\napi_key_env = \"ADYEN_KEY\"\nredrive_margin = 7200\n\n\
         [[providers]]\nkind = \"square\"\napi_key_env = \"SQUARE_KEY\"\n\n\
         [[providers]]\nkind = \"paypal\"\napi_key_env = \"PAYPAL_TOKEN\"\nretention = 259200\n\n\
         [sweeper]\nredrive_margin = \"2h\"\n",
    )
    .unwrap();
    let keys = [
        ("ADYEN_KEY", "AQE_k"),
        ("SQUARE_KEY", "EAAA_k"),
        ("PAYPAL_TOKEN", "A21AA_k"),
    ];
    let mut env = vec![("DATABASE_URL", db.url())];
    env.extend(keys.iter().map(|(k, v)| (*k, (*v).to_owned())));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let o = run_with_env(
        &["reconcile", "--config", path.to_str().unwrap(), "--once"],
        &env,
    );
    expect(&o, 0);

    // Settings that do not apply to a kind are refused, naming the entry.
    let cases = [
        (
            "square-margin.toml",
            "[[providers]]\nkind = \"square\"\napi_key_env = \"SQUARE_KEY\"\nredrive_margin = 7200\n",
            "redrive_margin applies to",
        ),
        (
            "adyen-retention.toml",
            "[[providers]]\nkind = \"adyen\"\napi_key_env = \"ADYEN_KEY\"\nretention = 60\n",
            "retention applies to paypal only",
        ),
        (
            "paypal-small-margin.toml",
            "[[providers]]\nkind = \"paypal\"\napi_key_env = \"PAYPAL_TOKEN\"\nredrive_margin = 60\n",
            "smaller than the sweeper's",
        ),
        (
            "adyen-no-key.toml",
            "[[providers]]\nkind = \"adyen\"\napi_key_env = \"UNSET_ADYEN_KEY\"\n",
            "UNSET_ADYEN_KEY",
        ),
    ];
    for (name, text, needle) in cases {
        let path = db.dir().join(name);
        std::fs::write(&path, text).unwrap();
        let o = run_with_env(
            &["reconcile", "--config", path.to_str().unwrap(), "--once"],
            &env,
        );
        expect(&o, 1);
        assert!(stderr(&o).contains(needle), "{name}: {}", stderr(&o));
    }
}

#[tokio::test]
async fn bad_configuration_exits_1_naming_the_problem() {
    let db = migrated().await;
    let missing = db.dir().join("missing.toml");
    let o = db.run(&["reconcile", "--config", missing.to_str().unwrap()]);
    expect(&o, 1);
    assert!(stderr(&o).contains("missing.toml"), "{}", stderr(&o));

    let cases = [
        (
            "unknown-kind.toml",
            "[[providers]]\nkind = \"carrier-pigeon\"\napi_key_env = \"X\"\n",
            "unknown provider kind \"carrier-pigeon\"",
        ),
        ("bad-toml.toml", "[[providers]\n", "is not valid"),
        (
            "bad-field.toml",
            "[sweeper]\nbatch = 5\n",
            "unknown field `batch`",
        ),
        (
            "bad-duration.toml",
            "[sweeper]\nlease = \"soon\"\n",
            "bad duration \"soon\"",
        ),
    ];
    for (name, text, needle) in cases {
        let path = db.dir().join(name);
        std::fs::write(&path, text).unwrap();
        // Through the flag and through IDEMFLOW_CONFIG.
        let o = db.run(&["reconcile", "--config", path.to_str().unwrap()]);
        expect(&o, 1);
        assert!(stderr(&o).contains(needle), "{name}: {}", stderr(&o));
        assert!(stderr(&o).contains(name), "{name}: {}", stderr(&o));
        let o = run_with_env(
            &["--json", "reconcile"],
            &[
                ("DATABASE_URL", &db.url()),
                ("IDEMFLOW_CONFIG", path.to_str().unwrap()),
            ],
        );
        expect(&o, 1);
        assert!(json(&o)["error"].as_str().unwrap().contains(needle));
    }

    // A good file with sweeper settings and no providers works.
    let good = db.dir().join("good.toml");
    std::fs::write(
        &good,
        "providers = []\n[sweeper]\nbatch_size = 5\nlease = \"2m\"\nbackoff_base = \"10s\"\n",
    )
    .unwrap();
    expect(
        &db.run(&["reconcile", "--config", good.to_str().unwrap()]),
        0,
    );
}

#[tokio::test]
async fn database_problems_exit_1_naming_the_problem() {
    let o = run_with_env(&["stats"], &[]);
    expect(&o, 1);
    assert!(stderr(&o).contains("DATABASE_URL"), "{}", stderr(&o));

    let o = run_with_env(
        &[
            "stats",
            "--database-url",
            "sqlite:///nonexistent-dir/x/y.db",
        ],
        &[],
    );
    expect(&o, 1);
    assert!(stderr(&o).contains("does not exist"), "{}", stderr(&o));

    let o = run_with_env(
        &[
            "migrate",
            "--database-url",
            "sqlite:///nonexistent-dir/x/y.db",
        ],
        &[],
    );
    expect(&o, 1);
    assert!(
        stderr(&o).contains("cannot open database"),
        "{}",
        stderr(&o)
    );

    let o = run_with_env(&["stats", "--database-url", "oracle://db"], &[]);
    expect(&o, 1);
    assert!(
        stderr(&o).contains("unsupported database URL scheme"),
        "{}",
        stderr(&o)
    );

    // A file that is not migrated: the hint says what to do.
    let db = Db::new();
    std::fs::write(&db.path, b"").unwrap();
    let o = db.run(&["stats"]);
    expect(&o, 1);
    assert!(stderr(&o).contains("idemflow migrate"), "{}", stderr(&o));
}

/// `--features cli` brings the backends named beside it: a URL of one this binary was built
/// without is refused (exit 1) with the features to install with, and the URL masked; a URL of
/// one it has is opened (nothing listens on port 1, so the connection is refused).
#[tokio::test]
async fn a_backend_left_out_of_the_build_names_its_feature() {
    let backends = [
        ("postgres", "PostgreSQL", cfg!(feature = "postgres")),
        ("mysql", "MariaDB/MySQL", cfg!(feature = "mysql")),
        ("redis", "Redis", cfg!(feature = "redis")),
    ];
    for (url, feature) in [
        ("postgres://app:hunter2@127.0.0.1:1/x", "postgres"),
        ("mysql://root:hunter2@127.0.0.1:1/x", "mysql"),
        ("redis://:hunter2@127.0.0.1:1/", "redis"),
    ] {
        let o = run_with_env(&["stats", "--database-url", url], &[]);
        expect(&o, 1);
        let err = stderr(&o);
        assert!(!err.contains("hunter2"), "{err}");
        let (_, name, built_in) = backends.iter().find(|b| b.0 == feature).unwrap();
        if *built_in {
            assert!(!err.contains("built without"), "{url}: {err}");
            assert!(err.contains("cannot connect"), "{url}: {err}");
        } else {
            // `cli`, the backends this binary has (SQLite is a default feature) and this one.
            let mut features = vec!["cli"];
            features.extend(
                backends
                    .iter()
                    .filter(|b| b.2 || b.0 == feature)
                    .map(|b| b.0),
            );
            let want = format!(
                "this idemflow was built without {name}: install it with `--features {}`",
                features.join(",")
            );
            assert!(err.contains(&want), "{url}: {err}\nwanted: {want}");
            assert!(err.contains(":***@127.0.0.1:1"), "{url}: {err}");
        }
    }
}

/// Every message naming a database URL masks its password, in the user info and in a
/// `password=` query parameter alike (the CLI once had its own, weaker copy of the masking).
#[tokio::test]
async fn database_urls_never_show_a_password() {
    for (args, url) in [
        // Nothing listens on port 1: the connection is refused.
        (
            vec!["stats"],
            "postgres://app@127.0.0.1:1/x?sslmode=disable&password=hunter2",
        ),
        (vec!["stats"], "mysql://root:hunter2@127.0.0.1:1/x"),
        (vec!["stats"], "oracle://db/x?user=u&PASSWORD=hunter2"),
        (
            vec!["migrate"],
            "sqlite:///nonexistent-dir/x/y.db?password=hunter2",
        ),
    ] {
        let mut all = args.clone();
        all.extend(["--database-url", url]);
        let o = run_with_env(&all, &[]);
        expect(&o, 1);
        let err = stderr(&o);
        assert!(!err.contains("hunter2"), "{url}: {err}");
        assert!(
            err.contains("***"),
            "{url}: the URL is named, masked: {err}"
        );
    }
}

#[cfg(unix)]
#[tokio::test]
async fn reconcile_every_sweeps_until_sigterm() {
    let db = migrated().await;
    let store = db.store().await;
    stuck_key(&store, "acct_4", "k", Some("ghost-pay")).await;
    let child = bin()
        .args(["--json", "reconcile", "--every", "100ms"])
        .env("DATABASE_URL", db.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let o = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    // The key stayed unresolved: exit 3; one JSON line per sweep.
    expect(&o, 3);
    let lines: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lines.len() >= 2, "{}", stdout(&o));
    assert_eq!(lines[0]["report"]["needs_operator"], 1);
    assert!(stderr(&o).contains("reconcile stopped"), "{}", stderr(&o));
}

/// The binary against PostgreSQL (`IDEMFLOW_TEST_POSTGRES_URL`), in a fresh schema picked through
/// `DATABASE_URL`'s `options=-c search_path=..`: `migrate`, `stats --json` and `reconcile --once`
/// exit codes, with the stuck-key listing and the purge dry run answered by PostgreSQL. Skipped
/// (with the reason printed) when the URL is unset or unreachable; a failure under `CI=true`.
#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use idemflow::store::postgres::PostgresStore;
    use sqlx::postgres::PgConnection;
    use sqlx::{AssertSqlSafe, Connection, Executor};

    /// A fresh schema: the admin URL, the schema's name and a `DATABASE_URL` that selects it.
    async fn fresh_schema() -> Option<(String, String, String)> {
        let (url, schema) = crate::support::postgres::fresh_schema().await?;
        let in_schema = crate::support::postgres::url_in(&url, &schema);
        Some((url, schema, in_schema))
    }

    #[tokio::test]
    async fn migrate_stats_and_reconcile_exit_codes_on_postgres() {
        let Some((admin_url, schema, url)) = fresh_schema().await else {
            return;
        };
        let run = |args: &[&str]| run_with_env(args, &[("DATABASE_URL", &url)]);

        let o = run(&["--json", "migrate"]);
        expect(&o, 0);
        assert_eq!(json(&o)["backend"], "postgres");
        expect(&run(&["migrate"]), 0);
        // The tables went into the fresh schema, not into `public`.
        let mut admin = PgConnection::connect(&admin_url).await.unwrap();
        let tables: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.tables \
             WHERE table_schema = $1 AND table_name = 'idempotency_keys'",
        )
        .bind(&schema)
        .fetch_one(&mut admin)
        .await
        .unwrap();
        assert_eq!(tables, 1);

        let o = run(&["stats", "--json"]);
        expect(&o, 0);
        let j = json(&o);
        assert_eq!(j["processing"], 0);
        assert_eq!(j["stuck_past_alert_age"], 0);
        expect(&run(&["reconcile", "--once"]), 0);

        // A key left processing for a provider nobody registered: unresolved.
        let store: Arc<dyn Store> = Arc::new(PostgresStore::connect(&url).await.unwrap());
        stuck_key(&store, "acct_pg", "order-1", Some("ghost-pay")).await;
        let o = run(&["reconcile", "--once"]);
        expect(&o, 3);
        assert!(stderr(&o).contains("acct_pg/order-1"), "{}", stderr(&o));

        let o = run(&["stats", "--json", "--alert-age", "1ms"]);
        expect(&o, 3);
        let j = json(&o);
        assert_eq!(j["processing"], 1);
        assert_eq!(j["stuck_past_alert_age"], 1);
        assert_eq!(j["stuck"][0]["key"], "order-1");
        expect(&run(&["stats", "--alert-age", "1h"]), 0);
        let o = run(&["--json", "purge", "--dry-run"]);
        expect(&o, 0);
        assert_eq!(json(&o)["would_purge"], 0);

        // Decided by an operator: nothing left for the sweeper.
        expect(
            &run(&[
                "resolve",
                "acct_pg",
                "order-1",
                "--done",
                "--reason",
                "checked the dashboard",
            ]),
            0,
        );
        expect(&run(&["reconcile", "--once"]), 0);

        admin
            .execute(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .await
            .unwrap();
    }
}

/// A workflow left unfinished after its first step: `reconcile` (which cannot run application
/// code) reports it as waiting for a resumer, and `inspect` lists its steps, their provider keys
/// and the recovery point.
#[tokio::test]
async fn reconcile_reports_waiting_workflows_and_inspect_shows_their_steps() {
    let db = migrated().await;
    let store = db.store().await;
    let req = IdempotentRequest::new(
        "acct_1",
        "order-9",
        "checkout",
        &serde_json::json!({"n": 9}),
    )
    .unwrap()
    .workflow();
    let err = Idempotency::new(store.clone())
        .execute(req, |ctx| async move {
            let charge =
                idemflow::workflow::Step::new("charge", &serde_json::json!({"amount": 5})).unwrap();
            let paid = ctx
                .step(charge, |_| async {
                    Outcome::Succeeded(
                        StoredResponse::json(201, &serde_json::json!({"charge": "ch_1"})).unwrap(),
                    )
                })
                .await;
            assert!(paid.is_ok(), "{paid:?}");
            let email = idemflow::workflow::Step::new("email", &serde_json::json!({"to": "a@b.c"}))
                .unwrap();
            match ctx
                .step(email, |_| async {
                    Outcome::unknown("connection reset after sending")
                })
                .await
            {
                Ok(_) => Outcome::unknown("unexpected"),
                Err(e) => Outcome::from_step_error(&e),
            }
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err:?}");

    let o = db.run(&["--json", "inspect", "acct_1", "order-9"]);
    expect(&o, 0);
    let j = json(&o);
    assert_eq!(j["key"]["provider"], "idemflow.workflow");
    assert_eq!(j["recovery_point"]["position"], 0);
    assert_eq!(j["recovery_point"]["name"], "charge");
    let steps = j["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    assert_eq!(
        (steps[0]["name"].as_str(), steps[0]["state"].as_str()),
        (Some("charge"), Some("done"))
    );
    assert_eq!(
        (steps[1]["name"].as_str(), steps[1]["state"].as_str()),
        (Some("email"), Some("processing"))
    );
    assert_ne!(steps[0]["provider_key"], steps[1]["provider_key"]);
    // Each step's transitions are listed with it.
    let charge_history = steps[0]["history"].as_array().unwrap();
    assert_eq!(charge_history.last().unwrap()["to"], "done");
    let o = db.run(&["inspect", "acct_1", "order-9"]);
    expect(&o, 0);
    assert!(
        stdout(&o).contains("recovery point step 0 (charge)"),
        "{}",
        stdout(&o)
    );

    // Its email step is unsettled: the workflow is stale but waits for that step, not yet for
    // a resumer.
    let o = db.run(&["stats", "--json"]);
    expect(&o, 0);
    let j = json(&o);
    assert_eq!(
        (
            j["stale"].as_i64(),
            j["workflows_waiting_for_resumer"].as_i64()
        ),
        (Some(2), Some(0)),
        "{j}"
    );

    // The email step has no provider: it needs an operator; once it is resolved, the
    // workflow itself waits for a resumer (or the client's retry).
    let config = db.dir().join("idemflow.toml");
    std::fs::write(
        &config,
        "[sweeper]\nbackoff_base = \"0s\"\nbackoff_cap = \"0s\"\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let o = db.run(&["--json", "reconcile", "--once", "--config", config]);
    expect(&o, 3);
    let o = db.run(&[
        "resolve",
        "acct_1",
        "order-9#step:1",
        "--done",
        "--status",
        "202",
        "--body",
        "{}",
        "--reason",
        "the email went out (seen in the provider's log)",
    ]);
    expect(&o, 0);
    let mut waiting = 0;
    for _ in 0..3 {
        let o = db.run(&["--json", "reconcile", "--once", "--config", config]);
        let j = json(&o);
        waiting += j["report"]["waiting_for_resumer"].as_u64().unwrap_or(0);
        if waiting > 0 {
            assert!(
                stderr(&o).contains("order-9") || stdout(&o).contains("order-9"),
                "{}",
                stderr(&o)
            );
            break;
        }
    }
    assert_eq!(waiting, 1);
    // `stats` counts it.
    let o = db.run(&["stats", "--json"]);
    expect(&o, 0);
    assert_eq!(json(&o)["workflows_waiting_for_resumer"], 1);
    let o = db.run(&["stats"]);
    expect(&o, 0);
    assert!(
        stdout(&o).contains("of which 1 workflows waiting for a resumer"),
        "{}",
        stdout(&o)
    );
}

/// `GET /metrics` of `addr` (plain HTTP/1.0), or `None` while nothing answers.
fn scrape(addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

/// The value of the sample `name{labels}` (labels written as Prometheus prints them).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// `reconcile --every .. --metrics-addr` serves the metrics in Prometheus text format: after
/// two keys stuck without a provider, the sweeper's decisions, the key gauges and the store
/// latency histogram read what happened.
#[tokio::test]
async fn reconcile_serves_prometheus_metrics() {
    let db = migrated().await;
    let store = db.store().await;
    stuck_key(&store, "acct_5", "k1", None).await;
    stuck_key(&store, "acct_5", "k2", None).await;
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let child = bin()
        .args(["reconcile", "--every", "100ms", "--metrics-addr", &addr])
        .env("DATABASE_URL", db.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for a scrape after the first pass has decided both keys and set the gauges: a scrape
    // in the middle of that pass (a loaded machine) shows one decision and no gauges yet.
    let mut text = String::new();
    for _ in 0..300 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Some(t) = scrape(&addr)
            && sample(
                &t,
                r#"idemflow_sweeper_decisions_total{decision="needs_operator"}"#,
            )
            .is_some_and(|n| n >= 2.0)
            && sample(&t, "idemflow_stale_keys").is_some()
        {
            text = t;
            break;
        }
    }
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let o = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        stderr(&o).contains(&format!("metrics at http://{addr}/metrics")),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        sample(
            &text,
            r#"idemflow_sweeper_decisions_total{decision="needs_operator"}"#
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "idemflow_processing_keys"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(sample(&text, "idemflow_stale_keys"), Some(2.0), "{text}");
    assert!(
        sample(&text, "idemflow_oldest_processing_age_seconds").is_some_and(|a| a >= 0.0),
        "{text}"
    );
    assert!(
        text.contains(
            r#"idemflow_store_duration_seconds_count{backend="sqlite",call="take_stale"}"#
        ) || text.contains(r#"idemflow_store_duration_seconds{backend="sqlite",call="take_stale""#),
        "{text}"
    );
    assert!(
        text.contains("# HELP idemflow_sweeper_decisions_total"),
        "{text}"
    );
}

/// `docs/operations.md` names every provider kind the reconciler knows, in its prose and in the
/// configuration example's `kind` comment: a kind added to the code and not to the docs fails.
#[test]
fn the_operations_docs_name_every_provider_kind() {
    let ops = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let kinds = idemflow::provider::config::known_kinds();
    assert_eq!(
        kinds.len(),
        8,
        "feature cli brings every adapter: {kinds:?}"
    );
    let comment = ops
        .lines()
        .find(|l| l.starts_with("kind = ") && l.contains('#'))
        .expect("the configuration example's `kind = ... # a | b` line");
    for kind in kinds {
        assert!(
            ops.contains(&format!("\"{kind}\"")),
            "docs/operations.md never names the provider kind \"{kind}\""
        );
        assert!(
            comment
                .split('#')
                .nth(1)
                .unwrap()
                .split('|')
                .any(|k| k.trim() == *kind),
            "the `kind` comment of docs/operations.md lacks {kind}: {comment}"
        );
    }
}

/// The help names each environment variable a flag reads, and never a value: not the value of
/// a variable that is set (a database URL may hold a password), nor an empty `NAME=` for one
/// that is not.
#[test]
fn help_names_the_environment_variables_without_values() {
    let help = stdout(&run_with_env(
        &["--help"],
        &[("DATABASE_URL", "postgres://app:s3cret@db/app")],
    ));
    // As one line: clap may wrap a long help line anywhere.
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for var in ["DATABASE_URL", "IDEMFLOW_CONFIG"] {
        assert!(help.contains(&format!("[env: {var}]")), "{var} in:\n{help}");
        assert!(
            !help.contains(&format!("{var}=")),
            "{var}'s value in:\n{help}"
        );
    }
    assert!(!help.contains("s3cret"), "{help}");
}
