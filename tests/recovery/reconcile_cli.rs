//! `idemflow reconcile --once` as the recovery tests run it: a configuration file of their own,
//! the store's URL, the fakes' API keys in the environment, and the JSON report read back.

use serde_json::Value;

/// Runs `idemflow --json reconcile --once` against the store at `url` with the configuration
/// `config` (TOML) and the variables `env`; asserts it exits 0 and returns its report.
pub async fn reconcile_once(url: &str, config: &str, env: &[(&str, &str)]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemflow.toml");
    std::fs::write(&path, config).unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args(["--json", "reconcile", "--once"])
        .env("DATABASE_URL", url)
        .env("IDEMFLOW_CONFIG", &path)
        .envs(env.iter().copied())
        .env_remove("IDEMFLOW_LOG")
        .env_remove("RUST_LOG")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap()
}
