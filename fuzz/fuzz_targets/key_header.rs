//! The `Idempotency-Key` header parser: no panic on any bytes; an accepted key is 1..=255
//! visible ASCII bytes, and its quoted (sf-string) form parses back to the same key.
#![no_main]

use idemflow::axum::parse_key_bytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(key) = parse_key_bytes(data) else {
        return;
    };
    let k = key.as_str();
    assert!((1..=255).contains(&k.len()), "{k:?}");
    assert!(k.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{k:?}");
    let mut quoted = String::from("\"");
    for c in k.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    assert_eq!(parse_key_bytes(quoted.as_bytes()).ok(), Some(key));
});
