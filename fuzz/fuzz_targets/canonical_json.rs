//! Canonical-JSON fingerprinting: no panic on any bytes; a document's canonical form parses
//! (no duplicate members) and canonicalises to itself, so its fingerprint is stable.
#![no_main]

use idemflow::fingerprint::Fingerprint;
use idemflow::fingerprint::{canonical_json, parse_json};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = parse_json(data) else {
        return;
    };
    let canonical = canonical_json(&value);
    let again = parse_json(canonical.as_bytes()).expect("the canonical form is JSON");
    let canonical_again = canonical_json(&again);
    assert_eq!(canonical, canonical_again);
    assert_eq!(
        Fingerprint::compute("op", &canonical),
        Fingerprint::compute("op", &canonical_again)
    );
});
