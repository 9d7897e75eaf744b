//! The command line's arguments (clap): global options, subcommands and their options.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Args, Parser, Subcommand};
use idemflow::store::connect_error::redact_url;

/// Idempotency-key operations: migrate, reconcile stale keys, purge, inspect and decide keys.
#[derive(Parser)]
#[command(name = "idemflow", version, about, long_about = None)]
pub struct Cli {
    /// Database URL: sqlite://path/to/file.db, postgres://..., mysql://..., redis://..., redis+sentinel://host1,host2/mymaster
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// Configuration file (TOML) naming the providers ([[providers]]) and sweeper settings
    /// ([sweeper]).
    #[arg(long, env = "IDEMFLOW_CONFIG", global = true, hide_env_values = true)]
    pub config: Option<PathBuf>,
    /// Print machine-readable JSON on stdout.
    #[arg(long, global = true)]
    pub json: bool,
    /// More logging on stderr (-v info, -vv debug). IDEMFLOW_LOG (a tracing filter) overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The database URL shows as `redact_url` shows it (its password masked).
impl std::fmt::Debug for Cli {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            database_url,
            config,
            json,
            verbose,
            command,
        } = self;
        f.debug_struct("Cli")
            .field("database_url", &database_url.as_deref().map(redact_url))
            .field("config", config)
            .field("json", json)
            .field("verbose", verbose)
            .field("command", command)
            .finish()
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or update idemflow's tables.
    Migrate,
    /// Settle stale processing keys by asking their providers (the recovery sweeper).
    Reconcile(ReconcileArgs),
    /// Delete finished keys whose retention has expired.
    Purge(PurgeArgs),
    /// Counts per state, the oldest processing key, keys stuck past an alert age.
    Stats(StatsArgs),
    /// Show one key and its whole history.
    Inspect {
        /// The key's scope.
        scope: String,
        /// The key.
        key: String,
    },
    /// Decide a key by hand (audited operator override).
    Resolve(ResolveArgs),
}

/// `reconcile` options.
#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// Sweep once and exit (the default).
    #[arg(long, conflicts_with = "every")]
    pub once: bool,
    /// Sweep repeatedly at this interval (e.g. 1m, 30s) until SIGINT/SIGTERM.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub every: Option<Duration>,
    /// Keys per batch (overrides [sweeper] batch_size).
    #[arg(long)]
    pub batch: Option<u32>,
    /// Most keys per sweep (overrides [sweeper] max_keys_per_run).
    #[arg(long)]
    pub max_keys: Option<u64>,
    /// Lease owner name (overrides [sweeper] owner).
    #[arg(long)]
    pub owner: Option<String>,
    /// Serve the metrics in Prometheus text format at http://ADDR/metrics while reconciling
    /// (e.g. 127.0.0.1:9464; docs/operations.md lists them).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// `purge` options.
#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Only count what would be deleted.
    #[arg(long)]
    pub dry_run: bool,
    /// Keys deleted per statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,
}

/// `stats` options.
#[derive(Debug, Args)]
pub struct StatsArgs {
    /// Processing keys first claimed longer ago than this are stuck (exit 3 when any).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "15m")]
    pub alert_age: Duration,
    /// How many stuck keys to list.
    #[arg(long, default_value_t = 20)]
    pub list: u32,
}

/// `resolve` options.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("outcome").required(true).args(["done", "failed"])))]
pub struct ResolveArgs {
    /// The key's scope.
    pub scope: String,
    /// The key.
    pub key: String,
    /// The operation happened: the key becomes done.
    #[arg(long)]
    pub done: bool,
    /// The operation did not succeed: the key becomes failed (permanent unless --retryable).
    #[arg(long)]
    pub failed: bool,
    /// With --failed: the provider surely did nothing, so the client's next retry runs it.
    #[arg(long, conflicts_with = "done")]
    pub retryable: bool,
    /// Why (recorded in the key's history).
    #[arg(long)]
    pub reason: String,
    /// Status code of the response the client's retry will replay.
    #[arg(long, value_parser = clap::value_parser!(u16).range(100..=599))]
    pub status: Option<u16>,
    /// Body of that response.
    #[arg(long, requires = "status")]
    pub body: Option<String>,
    /// Content type of that response.
    #[arg(long, requires = "status", default_value = "application/json")]
    pub content_type: String,
    /// Override a key that is already finished.
    #[arg(long)]
    pub force: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_masks_the_database_password() {
        let cli = Cli::try_parse_from([
            "idemflow",
            "--database-url",
            "postgres://app:s3cret@db/app?sslpassword=s3cret",
            "migrate",
        ])
        .unwrap();
        let shown = format!("{cli:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("postgres://app:***@db/app"), "{shown}");
    }
}
