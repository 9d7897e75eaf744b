//! The Redis decoders: no panic on any history entry or stored record (corrupt data is
//! `StoreError::Corrupt`). A record is a MessagePack array holding the row and its history.
#![no_main]

use idemflow::store::redis::fuzzing::{decode_history, decode_history_entry, decode_record};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (&str, &[u8])| {
    let (entry, record) = input;
    let _ = decode_history_entry(entry);
    let _ = decode_record("scope", "key", record);
    let _ = decode_history(record);
});
