//! The `idemflow` command line (feature `cli`): parse, log to stderr, run, exit.
//! See `idemflow --help` and docs/operations.md.
//!
//! The CLI is not part of the library's API: it uses only the library's public items.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

mod args;
mod commands;
mod config;

use args::Cli;
use commands::{error_message, run};

fn main() -> ExitCode {
    let cli = Cli::parse(); // usage errors exit 2
    let default = match cli.verbose {
        0 => "error",
        1 => "idemflow=info,warn",
        _ => "idemflow=debug,info",
    };
    let filter =
        EnvFilter::try_from_env("IDEMFLOW_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemflow: error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let json = cli.json;
    match runtime.block_on(run(cli)) {
        Ok(exit) => ExitCode::from(exit.code()),
        Err(e) => {
            let message = error_message(&e);
            eprintln!("idemflow: error: {message}");
            if json {
                println!("{}", serde_json::json!({"error": message}));
            }
            ExitCode::from(1)
        }
    }
}
