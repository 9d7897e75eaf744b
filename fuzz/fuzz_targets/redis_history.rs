//! The Redis decoders: no panic on any history entry or key hash (corrupt data is
//! `StoreError::Corrupt`).
#![no_main]

use std::collections::HashMap;

use idemflow::store::redis::fuzzing::{decode_history_entry, decode_key_hash};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (&str, Vec<(String, Vec<u8>)>)| {
    let (entry, fields) = input;
    let _ = decode_history_entry(entry);
    let fields: HashMap<String, Vec<u8>> = fields.into_iter().collect();
    let _ = decode_key_hash("scope", "key", fields);
});
