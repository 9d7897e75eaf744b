//! The subcommands: `migrate`, `reconcile`, `purge`, `stats`, `inspect` and `resolve`.
//!
//! Exit codes: 0 all good; 3 some stale keys remain unresolved (or, for `stats`, keys are stuck
//! past the alert age); 1 an error; 2 bad usage (from clap).

use idemflow::store::FinishMode;
use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use chrono::{DateTime, Utc};
use idemflow::record::{Actor, KeyEvent, KeyRecord};
use idemflow::store::connect_error::redact_url;
use idemflow::store::{Finish, Store};
use idemflow::sweeper::{SweepError, SweepReport, Sweeper};
use idemflow::{KeyId, KeyState, StoreError, StoredResponse, key::IdempotencyKey, key::Scope};
use serde_json::{Value, json};

use crate::args::{Cli, Command, PurgeArgs, ReconcileArgs, ResolveArgs, StatsArgs};
use crate::config::{self, SweeperSection, connect_store};

/// How a successful command ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Exit {
    /// Exit 0.
    Ok,
    /// Exit 3: keys remain unresolved (or stuck).
    Unresolved,
}

impl Exit {
    /// The process exit code.
    pub fn code(self) -> u8 {
        match self {
            Exit::Ok => 0,
            Exit::Unresolved => 3,
        }
    }
}

/// Runs a parsed command. Errors are for exit code 1; the caller prints them.
pub async fn run(cli: Cli) -> anyhow::Result<Exit> {
    let url = cli.database_url.clone().ok_or_else(|| {
        anyhow!(
            "no database given: pass --database-url or set DATABASE_URL (e.g. sqlite://idemflow.db)"
        )
    })?;
    match &cli.command {
        Command::Migrate => {
            let store = connect_store(&url, true).await?;
            store
                .migrate()
                .await
                .with_context(|| format!("migrating {}", redact_url(&url)))?;
            out(
                &cli,
                json!({"migrated": true, "backend": store.backend()}),
                || format!("migrated {} ({})", redact_url(&url), store.backend()),
            );
            Ok(Exit::Ok)
        }
        Command::Reconcile(args) => reconcile(&cli, &url, args).await,
        Command::Purge(args) => purge(&cli, &connect_store(&url, false).await?, args).await,
        Command::Stats(args) => stats(&cli, &connect_store(&url, false).await?, args).await,
        Command::Inspect { scope, key } => {
            let id = key_id(scope, key)?;
            inspect(&cli, &connect_store(&url, false).await?, &id).await
        }
        Command::Resolve(args) => resolve(&cli, &connect_store(&url, false).await?, args).await,
    }
}

/// An error and its causes on one line, leaving out causes whose text is already shown (driver
/// errors often repeat their source in their own message).
pub fn error_message(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if !text.contains(&c) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&c);
        }
    }
    text
}

fn key_id(scope: &str, key: &str) -> anyhow::Result<KeyId> {
    Ok(KeyId::new(
        Scope::new(scope).context("bad SCOPE")?,
        IdempotencyKey::new(key).context("bad KEY")?,
    ))
}

/// Prints JSON or the human text on stdout.
fn out(cli: &Cli, json: Value, human: impl FnOnce() -> String) {
    let mut stdout = std::io::stdout().lock();
    let _ = if cli.json {
        writeln!(stdout, "{json}")
    } else {
        writeln!(stdout, "{}", human())
    };
}

/// Adds a hint when the tables are missing.
fn store_err(e: StoreError) -> anyhow::Error {
    let text = e.to_string();
    let err = anyhow::Error::new(e);
    if text.contains("no such table") || text.contains("does not exist") {
        err.context("idemflow's tables are missing: run `idemflow migrate` first")
    } else {
        err
    }
}

async fn reconcile(cli: &Cli, url: &str, args: &ReconcileArgs) -> anyhow::Result<Exit> {
    let file = config::load(cli.config.as_deref())?;
    let providers = config::providers(&file, cli.config.as_ref())?;
    if cli.config.is_none() {
        eprintln!(
            "idemflow: no --config given: no providers are registered, so every key that names a provider is left for an operator"
        );
    }
    if let Some(addr) = args.metrics_addr {
        serve_metrics(addr)?;
    }
    let store = connect_store(url, false).await?;
    // The flags override the file's [sweeper] section.
    let section = SweeperSection {
        batch_size: args.batch.or(file.sweeper.batch_size),
        max_keys_per_run: args.max_keys.or(file.sweeper.max_keys_per_run),
        owner: args.owner.clone().or(file.sweeper.owner),
        ..file.sweeper
    };
    let sweeper = section.apply(Sweeper::new(store.clone(), providers));
    match args.every {
        None => {
            let started = Instant::now();
            let mut last = Instant::now();
            let result = sweeper
                .run_once_with(|r| {
                    if last.elapsed() >= Duration::from_secs(1) {
                        last = Instant::now();
                        eprintln!(
                            "idemflow: reconcile in progress after {:.0?}: {}",
                            started.elapsed(),
                            r.summary()
                        );
                    }
                })
                .await;
            finish_sweep(cli, &store, result).await
        }
        Some(every) => {
            let mut last_failed = None;
            let summary = sweeper
                .run_with(every, shutdown_signal(), |result| {
                    last_failed = print_sweep(cli, result.as_ref(), None).err();
                })
                .await;
            eprintln!(
                "idemflow: reconcile stopped after {} sweeps ({} failed)",
                summary.runs, summary.errors
            );
            if let Some(e) = last_failed {
                return Err(e);
            }
            // The exit code tells whether stale keys remain, as for --once.
            let clean = summary.last.as_ref().is_none_or(SweepReport::is_clean);
            let waiting = store.stats().await.map_err(store_err)?.stale;
            Ok(if clean && waiting == 0 {
                Exit::Ok
            } else {
                eprintln!("idemflow: {waiting} stale keys remain unresolved");
                Exit::Unresolved
            })
        }
    }
}

/// Installs the Prometheus exporter, serving `GET /metrics` on `addr` (the library only
/// records through the `metrics` facade).
fn serve_metrics(addr: std::net::SocketAddr) -> anyhow::Result<()> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .with_context(|| format!("cannot serve metrics on {addr}"))?;
    idemflow::telemetry::describe();
    eprintln!("idemflow: metrics at http://{addr}/metrics");
    Ok(())
}

async fn finish_sweep(
    cli: &Cli,
    store: &Arc<dyn Store>,
    result: Result<SweepReport, SweepError>,
) -> anyhow::Result<Exit> {
    if let Err(e) = &result {
        return print_sweep(cli, Err(e), None);
    }
    // Keys deferred by earlier sweeps are not due yet but are still unresolved.
    let waiting = match store.stats().await {
        Ok(s) => Some(s.stale),
        Err(e) => {
            eprintln!("idemflow: could not count the keys still waiting: {e}");
            None
        }
    };
    print_sweep(cli, result.as_ref(), waiting)
}

fn print_sweep(
    cli: &Cli,
    result: Result<&SweepReport, &SweepError>,
    waiting: Option<i64>,
) -> anyhow::Result<Exit> {
    let report = match result {
        Ok(r) => r,
        Err(e) => bail!("reconcile failed: {e}"),
    };
    let waiting_n = waiting.unwrap_or(0);
    // Keys this sweep left unresolved are counted by `waiting` too.
    let others = (waiting_n - report.unresolved.len() as i64).max(0);
    out(
        cli,
        json!({"report": report, "clean": report.is_clean(), "still_waiting": waiting}),
        || format!("reconcile: {}", report.summary()),
    );
    for u in &report.unresolved {
        eprintln!(
            "idemflow: unresolved {}/{} ({:?}, provider {}, attempt {}): {}",
            u.scope,
            u.key,
            u.kind,
            u.provider.as_deref().unwrap_or("-"),
            u.attempts,
            u.reason
        );
    }
    for l in &report.lost {
        eprintln!(
            "idemflow: {}/{} was decided by someone else: {}",
            l.scope, l.key, l.detail
        );
    }
    if others > 0 {
        eprintln!(
            "idemflow: {others} more stale keys wait for a later check (see `idemflow stats`)"
        );
    }
    if report.hit_key_limit {
        eprintln!("idemflow: stopped at the per-run key limit; more keys may be due");
    }
    Ok(if report.is_clean() && others == 0 {
        Exit::Ok
    } else {
        Exit::Unresolved
    })
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    eprintln!("idemflow: shutting down after the key at hand");
}

async fn purge(cli: &Cli, store: &Arc<dyn Store>, args: &PurgeArgs) -> anyhow::Result<Exit> {
    if args.dry_run {
        let n = store.count_expired().await.map_err(store_err)?;
        out(cli, json!({"dry_run": true, "would_purge": n}), || {
            format!("purge (dry run): {n} finished keys past their retention would be deleted")
        });
        return Ok(Exit::Ok);
    }
    let started = Instant::now();
    let mut total = 0u64;
    loop {
        let n = store.purge_expired(args.batch).await.map_err(store_err)?;
        total += n;
        if n < u64::from(args.batch) {
            break;
        }
        if started.elapsed() > Duration::from_secs(2) {
            eprintln!("idemflow: purge in progress: {total} keys deleted");
        }
    }
    out(cli, json!({"dry_run": false, "purged": total}), || {
        format!("purge: {total} finished keys past their retention deleted")
    });
    Ok(Exit::Ok)
}

fn age(now: DateTime<Utc>, t: DateTime<Utc>) -> Duration {
    (now - t).to_std().unwrap_or_default()
}

fn short(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

async fn stats(cli: &Cli, store: &Arc<dyn Store>, args: &StatsArgs) -> anyhow::Result<Exit> {
    let s = store.stats().await.map_err(store_err)?;
    let oldest_age = s.oldest_processing_created_at.map(|t| age(s.now, t));
    let stuck = store
        .stuck(args.alert_age, args.list)
        .await
        .map_err(store_err)?;
    let stuck_count = stuck.count;
    let waiting = idemflow::workflow::waiting_for_resumer(&**store)
        .await
        .map_err(store_err)?
        .len();
    let listed: Vec<Value> = stuck
        .oldest
        .iter()
        .map(|r| {
            json!({
                "scope": r.scope, "key": r.key, "operation": r.operation, "provider": r.provider,
                "attempts": r.attempts, "age_secs": age(s.now, r.created_at).as_secs(),
                "next_check_at": r.next_check_at, "error": r.error,
            })
        })
        .collect();
    let j = json!({
        "processing": s.processing, "stale": s.stale, "done": s.done,
        "failed_retryable": s.failed_retryable, "failed_permanent": s.failed_permanent,
        "oldest_processing_created_at": s.oldest_processing_created_at,
        "oldest_processing_age_secs": oldest_age.map(|a| a.as_secs()),
        "alert_age_secs": args.alert_age.as_secs(),
        "stuck_past_alert_age": stuck_count,
        "workflows_waiting_for_resumer": waiting,
        "stuck": listed,
        "now": s.now,
    });
    out(cli, j, || {
        let mut t = String::new();
        t.push_str(&format!(
            "processing        {} ({} stale: lease expired, waiting for the sweeper)\n",
            s.processing, s.stale
        ));
        t.push_str(&format!(
            "  of which {waiting} workflows waiting for a resumer or a client retry\n"
        ));
        t.push_str(&format!("done              {}\n", s.done));
        t.push_str(&format!("failed(retryable) {}\n", s.failed_retryable));
        t.push_str(&format!("failed(permanent) {}\n", s.failed_permanent));
        t.push_str(&format!(
            "oldest processing {}\n",
            oldest_age.map_or_else(|| "-".to_owned(), |a| format!("{} old", short(a)))
        ));
        t.push_str(&format!(
            "{:<18}{}",
            format!("stuck past {}", short(args.alert_age)),
            stuck_count
        ));
        for r in &stuck.oldest {
            t.push_str(&format!(
                "\n  {}/{}  {}  provider {}  attempt {}  {} old  {}",
                r.scope,
                r.key,
                r.operation,
                r.provider.as_deref().unwrap_or("-"),
                r.attempts,
                short(age(s.now, r.created_at)),
                r.error.as_deref().unwrap_or("")
            ));
        }
        t
    });
    Ok(if stuck_count > 0 {
        Exit::Unresolved
    } else {
        Exit::Ok
    })
}

/// A key row as JSON, with the response body as text when it is UTF-8.
fn record_json(r: &KeyRecord) -> Value {
    let mut v = serde_json::to_value(r).unwrap_or(Value::Null);
    if let (Some(resp), Some(obj)) = (&r.response, v.as_object_mut()) {
        obj.insert("response".into(), response_json(resp));
    }
    v
}

fn response_json(resp: &StoredResponse) -> Value {
    let body = match std::str::from_utf8(resp.body()) {
        Ok(s) => json!(s),
        Err(_) => json!(resp.body()),
    };
    json!({"status": resp.status(), "headers": resp.headers(), "body": body})
}

fn state_name(s: Option<KeyState>) -> String {
    s.map_or_else(|| "(none)".to_owned(), |s| s.to_string())
}

async fn inspect(cli: &Cli, store: &Arc<dyn Store>, id: &KeyId) -> anyhow::Result<Exit> {
    let record = store.get(id).await.map_err(store_err)?;
    let history = store.history(id).await.map_err(store_err)?;
    if record.is_none() && history.is_empty() {
        bail!("no idempotency key {id} (and no history for it)");
    }
    let is_workflow = record
        .as_ref()
        .is_some_and(|r| r.kind() == idemflow::record::KeyKind::Workflow);
    let steps = if is_workflow {
        idemflow::workflow::steps(&**store, id)
            .await
            .map_err(store_err)?
    } else {
        Vec::new()
    };
    let recovery = idemflow::workflow::recovery_point(&steps);
    let mut step_histories = Vec::with_capacity(steps.len());
    for s in &steps {
        let step_id = KeyId::new(s.scope.clone(), s.key.clone());
        step_histories.push(store.history(&step_id).await.map_err(store_err)?);
    }
    let mut j = json!({
        "key": record.as_ref().map(record_json),
        "history": history,
    });
    if is_workflow {
        j["steps"] = steps
            .iter()
            .zip(&step_histories)
            .enumerate()
            .map(|(position, (s, history))| {
                json!({
                    "position": position, "name": s.operation, "key": s.key, "state": s.state,
                    "provider": s.provider, "provider_key": s.provider_key,
                    "attempts": s.attempts, "error": s.error,
                    "response": s.response.as_ref().map(response_json),
                    "history": history,
                })
            })
            .collect();
        j["recovery_point"] =
            recovery.map_or(Value::Null, |(p, n)| json!({"position": p, "name": n}));
    }
    out(cli, j, || {
        let mut t = human_record(id, record.as_ref(), &history);
        if is_workflow {
            t.push_str(&format!(
                "\nrecovery point {}",
                recovery.map_or_else(
                    || "none (no step finished yet)".to_owned(),
                    |(p, n)| format!("step {p} ({n})")
                )
            ));
            t.push_str("\nsteps:");
            for (position, (s, history)) in steps.iter().zip(&step_histories).enumerate() {
                t.push_str(&format!(
                    "\n  {position:<3} {:<16} {:<20} provider {} (provider key {})  attempts {}  {}",
                    s.operation,
                    s.state.to_string(),
                    s.provider.as_deref().unwrap_or("-"),
                    s.provider_key,
                    s.attempts,
                    s.error.as_deref().unwrap_or("")
                ));
                for e in history {
                    t.push_str(&history_line("        ", e, false));
                }
            }
        }
        t
    });
    Ok(Exit::Ok)
}

fn human_record(id: &KeyId, r: Option<&KeyRecord>, history: &[KeyEvent]) -> String {
    let mut t = String::new();
    match r {
        None => t.push_str(&format!("key          {id} (purged; history kept)\n")),
        Some(r) => {
            t.push_str(&format!("key          {id}\n"));
            t.push_str(&format!("state        {}\n", r.state));
            t.push_str(&format!("operation    {}\n", r.operation));
            t.push_str(&format!(
                "provider     {} (provider key {})\n",
                r.provider.as_deref().unwrap_or("-"),
                r.provider_key
            ));
            t.push_str(&format!("attempts     {}\n", r.attempts));
            t.push_str(&format!(
                "lease        token {}, owner {}, expires {}\n",
                r.lease_token,
                r.lease_owner.as_deref().unwrap_or("-"),
                r.lease_expires_at
                    .map_or_else(|| "-".to_owned(), |t| t.to_rfc3339())
            ));
            t.push_str(&format!("created      {}\n", r.created_at.to_rfc3339()));
            t.push_str(&format!("updated      {}\n", r.updated_at.to_rfc3339()));
            if let Some(n) = r.next_check_at {
                t.push_str(&format!("next check   {}\n", n.to_rfc3339()));
            }
            if let Some(e) = r.expires_at {
                t.push_str(&format!("expires      {}\n", e.to_rfc3339()));
            }
            if let Some(e) = &r.error {
                t.push_str(&format!("error        {e}\n"));
            }
            if let Some(req) = &r.request {
                t.push_str(&format!("request      {req}\n"));
            }
            if let Some(resp) = &r.response {
                t.push_str(&format!(
                    "response     {} {}\n",
                    resp.status(),
                    String::from_utf8_lossy(resp.body())
                ));
            }
        }
    }
    t.push_str("history:");
    for e in history {
        t.push_str(&history_line("  ", e, true));
    }
    t
}

/// One history event on a line of its own, after `indent`, with its fencing token when
/// `with_token`.
fn history_line(indent: &str, e: &KeyEvent, with_token: bool) -> String {
    let token = if with_token {
        let token = e
            .lease_token
            .map_or_else(|| "-".to_owned(), |t| t.to_string());
        format!("  token {token}")
    } else {
        String::new()
    };
    format!(
        "\n{indent}#{:<4} {}  {:<8} {} -> {}{token}  {}",
        e.seq,
        e.at.to_rfc3339(),
        e.actor.as_str(),
        state_name(e.from),
        state_name(e.to),
        e.reason.as_deref().unwrap_or("")
    )
}

async fn resolve(cli: &Cli, store: &Arc<dyn Store>, args: &ResolveArgs) -> anyhow::Result<Exit> {
    let id = key_id(&args.scope, &args.key)?;
    if args.reason.trim().is_empty() {
        bail!("--reason must say why (it is recorded in the key's history)");
    }
    let current = store
        .get(&id)
        .await
        .map_err(store_err)?
        .ok_or_else(|| anyhow!("no idempotency key {id}"))?;
    if current.state != KeyState::Processing && !args.force {
        bail!(
            "key {id} is already {}; pass --force to override a finished key",
            current.state
        );
    }
    let to = if args.done {
        KeyState::Done
    } else {
        KeyState::Failed {
            retryable: args.retryable,
        }
    };
    let response = args.status.map(|status| {
        StoredResponse::new(status)
            .with_header("content-type", args.content_type.clone())
            .with_body(args.body.clone().unwrap_or_default().into_bytes())
    });
    if response.is_none() && to.is_terminal() {
        eprintln!(
            "idemflow: no --status given: the client's retry gets an error naming the reason instead of a replayed response"
        );
    }
    let finish = Finish {
        to,
        response,
        error: Some(format!("resolved by an operator: {}", args.reason)),
        actor: Actor::Operator,
        reason: format!("operator: {}", args.reason),
    };
    let written = if args.force {
        store.finish_as(&id, FinishMode::Override, &finish).await
    } else {
        store
            .finish_as(&id, FinishMode::OverrideIf(current.lease_token), &finish)
            .await
    };
    let record = written.map_err(store_err)?;
    out(
        cli,
        json!({"resolved": true, "from": current.state, "key": record_json(&record)}),
        || format!("resolved {id}: {} -> {}", current.state, record.state),
    );
    Ok(Exit::Ok)
}
