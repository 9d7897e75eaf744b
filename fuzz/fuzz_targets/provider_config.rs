//! The configuration file's `[[providers]]` entries: no panic parsing any TOML, nor building
//! the providers it names.
#![no_main]

use idemflow::provider::config::{ProviderConfig, build_with_env};
use libfuzzer_sys::fuzz_target;

#[derive(serde::Deserialize)]
struct File {
    #[serde(default)]
    providers: Vec<ProviderConfig>,
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(file) = toml::from_str::<File>(text) else {
        return;
    };
    for p in &file.providers {
        let _ = build_with_env(p, |var| (!var.is_empty()).then(|| "sk_test_fuzz".to_owned()));
    }
});
