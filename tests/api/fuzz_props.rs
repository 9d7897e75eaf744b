//! The fuzz targets in `fuzz/` as seeded property tests, so CI exercises them without the
//! fuzzer: the `Idempotency-Key` header parser, canonical-JSON fingerprinting, the providers'
//! TOML config and the Redis decoders never panic, and their stated properties hold.
//! `IDEMFLOW_FUZZ_CASES=N` runs more cases (default 2,000 per property).

use idemflow::fingerprint::Fingerprint;
use idemflow::fingerprint::{canonical_json, parse_json};

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % (n as u64)).unwrap()
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// `seed` mutated: bytes replaced, inserted, deleted, or spliced from `alphabet`.
    fn mutate(&mut self, seed: &[u8], alphabet: &[u8]) -> Vec<u8> {
        let mut out = seed.to_vec();
        for _ in 0..=self.below(4) {
            let at = if out.is_empty() {
                0
            } else {
                self.below(out.len() + 1)
            };
            match self.below(4) {
                0 if at < out.len() => out[at] = *self.pick(alphabet),
                1 => out.insert(at, *self.pick(alphabet)),
                2 if at < out.len() => {
                    out.remove(at);
                }
                _ => out.insert(at, u8::try_from(self.next() & 0xFF).unwrap()),
            }
        }
        out
    }
}

fn cases() -> usize {
    std::env::var("IDEMFLOW_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// The property of `fuzz/fuzz_targets/canonical_json.rs`.
fn canonical_is_stable(data: &[u8]) {
    let Ok(value) = parse_json(data) else {
        return;
    };
    let canonical = canonical_json(&value);
    let again = parse_json(canonical.as_bytes())
        .unwrap_or_else(|e| panic!("canonical form of {data:?} is not JSON: {e}"));
    let canonical_again = canonical_json(&again);
    assert_eq!(canonical, canonical_again, "input {data:?}");
    assert_eq!(
        Fingerprint::compute("op", &canonical),
        Fingerprint::compute("op", &canonical_again)
    );
}

#[test]
fn canonical_json_is_stable_and_never_panics() {
    let seeds: &[&[u8]] = &[
        br#"{"amount": 500, "currency": "usd", "meta": {"x": [1, 2.5, -0, 1e21]}}"#,
        br#"[1.0, 1e0, -0.0, 5e-324, 1.7976931348623157e308, 18446744073709551615, -9223372036854775808]"#,
        br#"{"\u00e9": "\ud83d\ude00", "a\u0000b": "\t\n\"\\", "": null}"#,
        br#"{"a": {"b": {"c": [true, false, null, "", {}]}}}"#,
        br#""plain string""#,
        b"123456789012345678901234567890",
    ];
    let alphabet = br#"{}[]:,"\ 0123456789.eE+-ntrufalsu"#;
    let mut rng = Rng(0x5eed_0001);
    for seed in seeds {
        canonical_is_stable(seed);
    }
    for _ in 0..cases() {
        let input = {
            let seed = rng_pick_seed(&mut rng, seeds);
            rng.mutate(seed, alphabet)
        };
        canonical_is_stable(&input);
    }
    // Deep nesting is refused (serde_json's recursion limit), not a stack overflow.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(parse_json(deep.as_bytes()).is_err());
    let deep = "{\"a\":".repeat(50_000);
    assert!(parse_json(deep.as_bytes()).is_err());
}

fn rng_pick_seed<'a>(rng: &mut Rng, seeds: &[&'a [u8]]) -> &'a [u8] {
    seeds[rng.below(seeds.len())]
}

#[cfg(feature = "axum")]
#[test]
fn key_header_parser_never_panics_and_round_trips() {
    use idemflow::axum::parse_key_bytes;

    let seeds: &[&[u8]] = &[
        b"8e03978e-40d5-43e8-bc93-6894a57f9324",
        br#""8e03978e-40d5""#,
        br#""a\"b\\c""#,
        b"  k  ",
        br#""""#,
        b"",
        b"\"open",
    ];
    let alphabet = b"\"\\ \t\x7f\x00azAZ09-_~";
    let mut rng = Rng(0x5eed_0002);
    let long = vec![b'k'; 300];
    for i in 0..cases() {
        let input = if i % 50 == 0 {
            rng.mutate(&long, alphabet)
        } else {
            {
                let seed = rng_pick_seed(&mut rng, seeds);
                rng.mutate(seed, alphabet)
            }
        };
        let Ok(key) = parse_key_bytes(&input) else {
            continue;
        };
        let k = key.as_str();
        assert!((1..=255).contains(&k.len()), "{input:?} -> {k:?}");
        assert!(k.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{k:?}");
        let mut quoted = String::from("\"");
        for c in k.chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        assert_eq!(
            parse_key_bytes(quoted.as_bytes()).ok(),
            Some(key),
            "{input:?}"
        );
    }
}

#[cfg(feature = "cli")]
#[test]
fn provider_config_never_panics() {
    use idemflow::provider::config::{ProviderConfig, build_with_env};

    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        providers: Vec<ProviderConfig>,
    }
    let seeds: &[&[u8]] = &[
        b"[[providers]]\nkind = \"stripe\"\napi_key_env = \"K\"\n",
        b"[[providers]]\nname = \"pm\"\nkind = \"postmark\"\napi_key_env = \"K\"\nsearch_lag = 18446744073709551615\nbase_url = \"http://[::1]:99999/\"\n",
        b"[[providers]]\nkind = \"resend\"\napi_key_env = \"\"\nbase_url = \"not a url\"\n",
        b"providers = []\n",
    ];
    let alphabet = b"[]=\"\n .:/0123456789abcdefghijklmnopqrstuvwxyz_";
    let mut rng = Rng(0x5eed_0003);
    for _ in 0..cases() {
        let input = {
            let seed = rng_pick_seed(&mut rng, seeds);
            rng.mutate(seed, alphabet)
        };
        let Ok(text) = std::str::from_utf8(&input) else {
            continue;
        };
        let Ok(file) = toml::from_str::<File>(text) else {
            continue;
        };
        for p in &file.providers {
            let _ = build_with_env(p, |var| (!var.is_empty()).then(|| "sk_test".to_owned()));
        }
    }
}

/// A MessagePack string, integer or array, as `cmsgpack` writes them in a Redis record.
#[cfg(feature = "redis")]
enum Mp {
    F,
    T,
    I(i64),
    S(&'static str),
    A(Vec<Mp>),
}

#[cfg(feature = "redis")]
fn msgpack(v: &Mp, out: &mut Vec<u8>) {
    match v {
        Mp::F => out.push(0xc2),
        Mp::T => out.push(0xc3),
        Mp::I(n) if (0..128).contains(n) => out.push(u8::try_from(*n).unwrap()),
        Mp::I(n) => {
            out.push(0xd3);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Mp::S(s) if s.len() < 32 => {
            out.push(0xa0 | u8::try_from(s.len()).unwrap());
            out.extend_from_slice(s.as_bytes());
        }
        Mp::S(s) => {
            out.push(0xd9);
            out.push(u8::try_from(s.len()).unwrap());
            out.extend_from_slice(s.as_bytes());
        }
        Mp::A(a) if a.len() < 16 => {
            out.push(0x90 | u8::try_from(a.len()).unwrap());
            a.iter().for_each(|v| msgpack(v, out));
        }
        Mp::A(a) => {
            out.push(0xdc);
            out.extend_from_slice(&u16::try_from(a.len()).unwrap().to_be_bytes());
            a.iter().for_each(|v| msgpack(v, out));
        }
    }
}

#[cfg(feature = "redis")]
#[test]
fn redis_decoders_never_panic() {
    use Mp::*;
    use idemflow::store::redis::fuzzing::{decode_history, decode_history_entry, decode_record};

    let seeds: &[&[u8]] = &[
        b"1|||processing|0|1|1700000000000|6|worker|claimed",
        b"2|processing|0|done|0|1|1700000000001|8|sweeper:",
        b"3|done|0|||2|9223372036854775807|0|",
        "4|||processing|0|1|1700000000000|2|\u{e9}|x".as_bytes(),
    ];
    let alphabet = b"|0123456789-processingdonefailedunknown";
    let t = 1_700_000_000_000;
    let history = || {
        A(vec![
            S("1|||processing|0|1|1700000000000|6|worker|claimed"),
            S("2|processing|0|done|0|1|1700000000001|6|worker|ok"),
        ])
    };
    let done = A(vec![
        I(1),
        I(1),
        I(2),
        history(),
        S("payments.create"),
        F,
        S("pk"),
        S("v1:00"),
        S("{}"),
        I(201),
        S("[]"),
        S("{\"id\":1}"),
        F,
        F,
        F,
        I(1),
        I(t),
        I(t + 1),
        I(t + 86_400_000),
        F,
        I(86_400_000),
        I(t),
        T,
    ]);
    let tombstone = A(vec![F, I(1), I(3), history()]);
    let mut records = Vec::new();
    for r in [&done, &tombstone] {
        let mut out = Vec::new();
        msgpack(r, &mut out);
        records.push(out);
    }
    // The seeds decode: the mutations start from real records.
    assert!(
        decode_record("scope", "key", &records[0])
            .unwrap()
            .is_some()
    );
    assert!(
        decode_record("scope", "key", &records[1])
            .unwrap()
            .is_none()
    );
    assert_eq!(decode_history(&records[1]).unwrap().len(), 2);
    // MessagePack tags (nil, booleans, integers, strings, arrays, maps) and small values.
    let tags = [
        0xc0, 0xc2, 0xc3, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd3, 0xd9, 0xda, 0xdb, 0xdc, 0xdd, 0x90,
        0x9f, 0xa0, 0xbf, 0x80, 0xde, 0xff, 0x00, 0x7f, 0x03,
    ];
    let mut rng = Rng(0x5eed_0004);
    for _ in 0..cases() {
        let entry = {
            let seed = rng_pick_seed(&mut rng, seeds);
            rng.mutate(seed, alphabet)
        };
        if let Ok(entry) = std::str::from_utf8(&entry) {
            let _ = decode_history_entry(entry);
        }
        let record = {
            let seed = rng.pick(&records).clone();
            rng.mutate(&seed, &tags)
        };
        let _ = decode_record("scope", "key", &record);
        let _ = decode_history(&record);
    }
}

/// Found by `canonical_json_is_stable_and_never_panics`: serde_json's default float parser is
/// not correctly rounded, so `1.2345678901234567e30` (the shortest form of the number parsed
/// from these digits) parsed back as `1.2345678901234568e30`, and the canonical form of a
/// request did not canonicalise to itself. Fixed by serde_json's `float_roundtrip`.
#[test]
fn canonical_form_of_a_long_number_canonicalises_to_itself() {
    for input in [
        &b"1234567890123456789012345063890"[..],
        b"1.2345678901234567e30",
        b"{\"amount\": 0.30000000000000004, \"big\": 123456789012345678901234567890}",
    ] {
        canonical_is_stable(input);
    }
}
