//! The CLI's configuration: the TOML file (`[[providers]]`, `[sweeper]`) and the database URL.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use serde::{Deserialize, Deserializer};

use idemflow::provider::Providers;
use idemflow::provider::config::{ProviderConfig, build_with_env};
use idemflow::store::Store;
use idemflow::store::connect_error::redact_url;
use idemflow::sweeper::Sweeper;

/// The configuration file.
///
/// ```toml
/// [[providers]]
/// name = "stripe"
/// kind = "stripe"
/// api_key_env = "STRIPE_API_KEY"
///
/// [sweeper]
/// batch_size = 100
/// lease = "6s"
/// backoff_base = "30s"
/// backoff_cap = "1h"
/// redrive_margin = "1h"
/// ```
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// The providers the sweeper may ask.
    #[serde(default)]
    pub providers: Vec<ProviderConfig>,
    /// Sweeper settings.
    #[serde(default)]
    pub sweeper: SweeperSection,
}

/// The `[sweeper]` section; durations are written like `30s`, `5m`, `1h 30m`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SweeperSection {
    /// Keys per batch.
    pub batch_size: Option<u32>,
    /// Lease of taken keys.
    #[serde(default, deserialize_with = "human")]
    pub lease: Option<Duration>,
    /// Lease owner name.
    pub owner: Option<String>,
    /// First recheck delay.
    #[serde(default, deserialize_with = "human")]
    pub backoff_base: Option<Duration>,
    /// Longest recheck delay.
    #[serde(default, deserialize_with = "human")]
    pub backoff_cap: Option<Duration>,
    /// Recheck delay of keys that need an operator.
    #[serde(default, deserialize_with = "human")]
    pub operator_recheck: Option<Duration>,
    /// Margin kept before the end of a provider's dedup window.
    #[serde(default, deserialize_with = "human")]
    pub redrive_margin: Option<Duration>,
    /// Most keys per run.
    pub max_keys_per_run: Option<u64>,
    /// Longest wait for one provider call or lookup.
    #[serde(default, deserialize_with = "human")]
    pub call_timeout: Option<Duration>,
}

fn human<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let s = Option::<String>::deserialize(d)?;
    s.map(|s| {
        humantime::parse_duration(&s)
            .map_err(|e| serde::de::Error::custom(format!("bad duration {s:?}: {e}")))
    })
    .transpose()
}

impl SweeperSection {
    /// Applies the section to a sweeper (over its defaults).
    pub fn apply(&self, mut s: Sweeper) -> Sweeper {
        if let Some(v) = self.batch_size {
            s = s.batch_size(v);
        }
        if let Some(v) = self.lease {
            s = s.lease(v);
        }
        if let Some(v) = &self.owner {
            s = s.owner(v.clone());
        }
        let base = self.backoff_base.unwrap_or(s.config().backoff_base);
        let cap = self.backoff_cap.unwrap_or(s.config().backoff_cap);
        s = s.backoff(base, cap);
        if let Some(v) = self.operator_recheck {
            s = s.operator_recheck(v);
        }
        if let Some(v) = self.redrive_margin {
            s = s.redrive_margin(v);
        }
        if let Some(v) = self.max_keys_per_run {
            s = s.max_keys_per_run(v);
        }
        if let Some(v) = self.call_timeout {
            s = s.call_timeout(v);
        }
        s
    }
}

/// Reads and checks the configuration file (`None`: no file, empty configuration).
pub fn load(path: Option<&Path>) -> anyhow::Result<FileConfig> {
    let Some(path) = path else {
        return Ok(FileConfig::default());
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow!("config file {} is not valid: {e}", path.display()))
}

/// Builds the providers the file names, refusing duplicates and unknown kinds.
pub fn providers(config: &FileConfig, path: Option<&PathBuf>) -> anyhow::Result<Providers> {
    providers_with_env(config, path, |var| std::env::var(var).ok())
}

/// Like [`providers`], with the environment given as a function.
fn providers_with_env(
    config: &FileConfig,
    path: Option<&PathBuf>,
    env: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<Providers> {
    let file = path.map_or_else(|| "(none)".to_owned(), |p| p.display().to_string());
    let mut reg = Providers::new();
    for (i, pc) in config.providers.iter().enumerate() {
        let name = pc.name.clone().unwrap_or_else(|| pc.kind.clone());
        if reg.get(&name).is_some() {
            bail!("config file {file}: provider {name:?} is configured twice");
        }
        // Resend's, Adyen's and PayPal's lookups re-send: they keep at least the sweeper's
        // margin.
        let sweeper_margin = config
            .sweeper
            .redrive_margin
            .unwrap_or(idemflow::provider::DEFAULT_REDRIVE_MARGIN);
        let mut pc = pc.clone();
        if matches!(pc.kind.as_str(), "resend" | "adyen" | "paypal") {
            match pc.redrive_margin {
                None => pc.redrive_margin = Some(sweeper_margin),
                Some(m) if m < sweeper_margin => bail!(
                    "config file {file}: [[providers]] entry {} ({name:?}): redrive_margin ({}s) is smaller than the sweeper's ({}s); its lookup could re-send after the sweeper judged a re-send unsafe",
                    i + 1,
                    m.as_secs(),
                    sweeper_margin.as_secs()
                ),
                Some(_) => {}
            }
        }
        let p = build_with_env(&pc, &env).map_err(|e| {
            anyhow!(
                "config file {file}: [[providers]] entry {} ({name:?}): {e}",
                i + 1
            )
        })?;
        reg.insert(p);
    }
    Ok(reg)
}

/// The file path of a SQLite URL (`None` for in-memory databases).
fn sqlite_path(url: &str) -> Option<PathBuf> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let rest = rest.split('?').next().unwrap_or(rest);
    if rest.is_empty() || rest.contains(":memory:") || url.contains("mode=memory") {
        return None;
    }
    Some(PathBuf::from(rest))
}

/// A backend this binary may be built with: its name, its cargo feature, its URL schemes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backend {
    /// The name users know it by.
    pub name: &'static str,
    /// Its cargo feature.
    pub feature: &'static str,
    schemes: &'static [&'static str],
    /// Whether this binary was built with it.
    pub built_in: bool,
}

/// The backends, in the order the install command names them.
pub const BACKENDS: [Backend; 4] = [
    Backend {
        name: "SQLite",
        feature: "sqlite",
        schemes: &["sqlite"],
        built_in: cfg!(feature = "sqlite"),
    },
    Backend {
        name: "PostgreSQL",
        feature: "postgres",
        schemes: &["postgres", "postgresql"],
        built_in: cfg!(feature = "postgres"),
    },
    Backend {
        name: "MariaDB/MySQL",
        feature: "mysql",
        schemes: &["mysql", "mariadb"],
        built_in: cfg!(feature = "mysql"),
    },
    Backend {
        name: "Redis",
        feature: "redis",
        schemes: &["redis", "rediss", "redis+sentinel"],
        built_in: cfg!(feature = "redis"),
    },
];

impl Backend {
    /// The backend of a URL scheme.
    pub fn of_scheme(scheme: &str) -> Option<Backend> {
        BACKENDS.into_iter().find(|b| b.schemes.contains(&scheme))
    }
}

/// A database URL names a backend this binary was built without. Its message names the
/// features to install with: `cli`, the backends this binary has (SQLite comes with the default
/// features, so it is named only when missing) and the one asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("this idemflow was built without {}: install it with `--features {features}`", backend.name)]
pub struct BackendMissing {
    /// The backend the URL names.
    pub backend: Backend,
    /// The features to install with, comma-separated (`cli,postgres`).
    pub features: String,
}

impl BackendMissing {
    /// The error for `backend` in a binary built with the backends of `backends` marked
    /// `built_in`.
    fn new(backend: Backend, backends: &[Backend]) -> Self {
        let mut features = vec!["cli"];
        features.extend(
            backends
                .iter()
                .filter(|b| b.feature == backend.feature || (b.built_in && b.feature != "sqlite"))
                .map(|b| b.feature),
        );
        Self {
            backend,
            features: features.join(","),
        }
    }
}

/// Refuses a URL scheme whose backend this binary was built without.
fn require_backend(scheme: &str) -> Result<(), BackendMissing> {
    match Backend::of_scheme(scheme) {
        Some(backend) if !backend.built_in => Err(BackendMissing::new(backend, &BACKENDS)),
        _ => Ok(()),
    }
}

/// Opens the store a URL names. `create` allows creating a new SQLite file (`migrate`);
/// otherwise a missing file is an error naming it.
///
/// `sqlite:`, `postgres://`, `mysql://` and `redis://` (and `redis+sentinel://`) map to the
/// stores behind the features `sqlite`, `postgres`, `mysql` and `redis`; a scheme whose feature
/// this binary was built without is a [`BackendMissing`].
pub async fn connect_store(url: &str, create: bool) -> anyhow::Result<Arc<dyn Store>> {
    // The library's one masking: user info passwords and secret-named query parameters.
    let shown = redact_url(url);
    let scheme = url.split(':').next().unwrap_or_default();
    require_backend(scheme).with_context(|| format!("cannot open database {shown}"))?;
    match scheme {
        "sqlite" => {
            if !create
                && let Some(path) = sqlite_path(url)
                && !path.exists()
            {
                bail!(
                    "database file {} does not exist (check DATABASE_URL, or run `idemflow migrate` to create it)",
                    path.display()
                );
            }
            connect_sqlite(url, &shown).await
        }
        "postgres" | "postgresql" | "mysql" | "mariadb" | "redis" | "rediss" | "redis+sentinel" => {
            idemflow::store::connect(url)
                .await
                .with_context(|| format!("cannot open database {shown}"))
        }
        "" => bail!("the database URL is empty (pass --database-url or set DATABASE_URL)"),
        other => bail!(
            "unsupported database URL scheme {other:?} in {shown} (expected sqlite:, postgres://, mysql://, redis:// or redis+sentinel://)"
        ),
    }
}

#[cfg(feature = "sqlite")]
async fn connect_sqlite(url: &str, shown: &str) -> anyhow::Result<Arc<dyn Store>> {
    let store = idemflow::store::sqlite::SqliteStore::connect(url)
        .await
        .with_context(|| format!("cannot open database {shown}"))?;
    // Opening a pool is lazy about some failures: ask the clock to be sure it answers.
    store
        .writer_pool()
        .acquire()
        .await
        .with_context(|| format!("cannot open database {shown}"))?;
    Ok(Arc::new(store))
}

/// Not reached: `connect_store` refuses `sqlite:` first in a build without SQLite.
#[cfg(not(feature = "sqlite"))]
async fn connect_sqlite(_url: &str, shown: &str) -> anyhow::Result<Arc<dyn Store>> {
    require_backend("sqlite").with_context(|| format!("cannot open database {shown}"))?;
    bail!("cannot open database {shown}: this idemflow was built without SQLite")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_paths() {
        assert_eq!(
            sqlite_path("sqlite://a/b.db?mode=rwc"),
            Some("a/b.db".into())
        );
        assert_eq!(sqlite_path("sqlite:b.db"), Some("b.db".into()));
        assert_eq!(sqlite_path("sqlite::memory:"), None);
    }

    /// `BACKENDS` as a build with only the backends of `features` has them.
    fn built_with(features: &[&str]) -> Vec<Backend> {
        BACKENDS
            .into_iter()
            .map(|b| Backend {
                built_in: features.contains(&b.feature),
                ..b
            })
            .collect()
    }

    #[test]
    fn a_missing_backend_names_the_features_to_install_with() {
        let backend = |scheme| Backend::of_scheme(scheme).unwrap();
        // `--features cli` without the default features: no backend at all.
        let none = built_with(&[]);
        assert_eq!(
            BackendMissing::new(backend("postgresql"), &none).to_string(),
            "this idemflow was built without PostgreSQL: install it with `--features cli,postgres`"
        );
        assert_eq!(
            BackendMissing::new(backend("sqlite"), &none).features,
            "cli,sqlite"
        );
        // `--features cli,redis` (SQLite by default): the backends it has are kept.
        let redis = built_with(&["sqlite", "redis"]);
        assert_eq!(
            BackendMissing::new(backend("mariadb"), &redis).to_string(),
            "this idemflow was built without MariaDB/MySQL: install it with `--features cli,mysql,redis`"
        );
        assert_eq!(
            BackendMissing::new(backend("redis+sentinel"), &built_with(&["postgres"])).features,
            "cli,postgres,redis"
        );
        assert_eq!(Backend::of_scheme("oracle"), None);
    }

    /// This build refuses exactly the schemes of the backends it was built without.
    #[test]
    fn only_the_backends_left_out_are_refused() {
        for scheme in [
            "sqlite",
            "postgres",
            "postgresql",
            "mysql",
            "mariadb",
            "redis",
            "rediss",
            "redis+sentinel",
        ] {
            let built_in = match Backend::of_scheme(scheme).unwrap().feature {
                "sqlite" => cfg!(feature = "sqlite"),
                "postgres" => cfg!(feature = "postgres"),
                "mysql" => cfg!(feature = "mysql"),
                _ => cfg!(feature = "redis"),
            };
            assert_eq!(require_backend(scheme).is_ok(), built_in, "{scheme}");
        }
        assert!(require_backend("oracle").is_ok(), "left to connect_store");
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn sweeper_section_parses_durations_and_refuses_unknown_fields() {
        let c: FileConfig = toml::from_str(
            "[sweeper]\nbatch_size = 7\nlease = \"2m\"\nbackoff_base = \"10s\"\nbackoff_cap = \"1h 30m\"\n",
        )
        .unwrap();
        let store = idemflow::store::sqlite::SqliteStore::connect("sqlite::memory:")
            .await
            .unwrap();
        let s = c
            .sweeper
            .apply(Sweeper::new(Arc::new(store), Providers::new()));
        let s = s.config();
        assert_eq!(s.batch_size, 7);
        assert_eq!(s.lease, Duration::from_secs(120));
        assert_eq!(s.backoff_cap, Duration::from_secs(5400));
        assert!(toml::from_str::<FileConfig>("[sweeper]\nlease = \"soon\"\n").is_err());
        assert!(toml::from_str::<FileConfig>("[sweeper]\nbogus = 1\n").is_err());
    }

    /// The sweeper looks a Resend key up once its own margin says a re-send is unsafe: with
    /// `[sweeper] redrive_margin = "2h"`, Resend's lookup must not re-send at 22 h 30 min (it
    /// did, keeping its own 1 h default).
    #[cfg(feature = "testkit")]
    #[tokio::test]
    async fn resend_gets_the_sweepers_redrive_margin() {
        use idemflow::provider::Lookup;
        use idemflow::testkit::FakeResend;

        let fake = FakeResend::start().await.unwrap();
        let c: FileConfig = toml::from_str(&format!(
            "[[providers]]\nkind = \"resend\"\napi_key_env = \"RESEND_KEY\"\nbase_url = \"{}\"\n\n[sweeper]\nredrive_margin = \"2h\"\n",
            fake.base_url()
        ))
        .unwrap();
        let env = |var: &str| (var == "RESEND_KEY").then(|| FakeResend::API_KEY.to_owned());
        let reg = providers_with_env(&c, None, env).unwrap();
        let resend = reg.get("resend").unwrap();
        let now = chrono::Utc::now();
        let sent_at = now - chrono::Duration::minutes(22 * 60 + 30);
        let email = serde_json::json!({"from": "a@x.test", "to": ["b@y.test"], "subject": "s", "text": "t"});
        let found = resend
            .lookup(
                "idf_cli",
                &email,
                idemflow::provider::Attempts::once(sent_at),
                now,
            )
            .await;
        assert_eq!(fake.requests().len(), 0, "{found:?}");
        assert!(matches!(found, Lookup::NeedsOperator { .. }), "{found:?}");
        // Younger keys are still looked up by a same-key re-send.
        let found = resend
            .lookup(
                "idf_cli",
                &email,
                idemflow::provider::Attempts::once(now),
                now,
            )
            .await;
        assert!(matches!(found, Lookup::Found(_)), "{found:?}");
        // A resend margin smaller than the sweeper's is refused.
        let small: FileConfig = toml::from_str(
            "[[providers]]\nkind = \"resend\"\napi_key_env = \"RESEND_KEY\"\nredrive_margin = 600\n",
        )
        .unwrap();
        let e = providers_with_env(&small, None, env).unwrap_err();
        assert!(e.to_string().contains("smaller than the sweeper's"), "{e}");
    }
}
