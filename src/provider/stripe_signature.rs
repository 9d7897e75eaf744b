//! Stripe's webhook signatures (features `axum` or `testkit`): the `Stripe-Signature` header as
//! Stripe documents it (<https://docs.stripe.com/webhooks#verify-manually>) and as its own
//! libraries check it (stripe-go `webhook/client.go`, stripe-node `Webhooks.ts`).
//!
//! * The header is `t=<unix seconds>,v1=<hex>,v1=<hex>,v0=<hex>`: one timestamp and one or more
//!   signatures. Several `v1` come while an endpoint's secret is being rolled (one per secret
//!   still valid); `v0` and unknown schemes are ignored, and so is a `v1` that is not hex.
//! * A `v1` is the lowercase hex HMAC-SHA256 of `"{t}.{raw body}"`, keyed with the endpoint's
//!   signing secret taken as the bytes of the whole string (`whsec_...` included, not decoded).
//! * A delivery is accepted when **any** `v1` matches under **any** of the configured secrets
//!   (so a receiver configured with the old and the new secret accepts both during a rotation),
//!   compared in constant time, and its timestamp is within the tolerance of now, in either
//!   direction (default [`DEFAULT_TOLERANCE`], 300 s, Stripe's default): an old delivery is a
//!   replay, one from the future a forged clock.
//!
//! Nothing here does I/O; the receiver (`idemflow::axum::webhook`) and the testkit's sender use
//! it.

use std::fmt;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header carrying the signature (`Stripe-Signature`), lowercase as `http` spells names.
pub const SIGNATURE_HEADER: &str = "stripe-signature";

/// How far a delivery's timestamp may be from now, either way: 300 s, Stripe's default.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

/// The scheme Stripe signs with today.
const SCHEME: &str = "v1";

type HmacSha256 = Hmac<Sha256>;

/// Why a delivery's signature was refused. Every one of them is answered 400 and records
/// nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SignatureError {
    /// The request has no `Stripe-Signature` header.
    #[error("no Stripe-Signature header")]
    Missing,
    /// The header cannot be read (not visible ASCII, an item without `=`, no timestamp, a
    /// timestamp that is not a number, sent twice).
    #[error("Stripe-Signature header malformed: {reason}")]
    Malformed {
        /// What is wrong with it.
        reason: String,
    },
    /// The header carries no `v1` signature in hex.
    #[error("Stripe-Signature header carries no v1 signature")]
    NoSignature,
    /// No `v1` signature matches the body under any configured secret.
    #[error("no v1 signature matches the body under any configured secret")]
    Mismatch,
    /// The signature matches, but its timestamp is further from now than the tolerance (a
    /// replayed or forged delivery).
    #[error(
        "signature timestamp {timestamp} is {off_by}s from now ({now}), beyond the tolerance of {tolerance}s"
    )]
    OutsideTolerance {
        /// The header's `t`.
        timestamp: i64,
        /// Now, as the receiver read it (Unix seconds).
        now: i64,
        /// How far apart the two are, in seconds.
        off_by: u64,
        /// The tolerance, in seconds.
        tolerance: u64,
    },
}

/// The signature scheme of one Stripe endpoint: its signing secrets and the tolerance.
///
/// ```
/// use idemflow::provider::stripe_signature::{StripeSignature, sign, signature_header};
///
/// let body = br#"{"id":"evt_1","type":"payment_intent.succeeded"}"#;
/// let header = signature_header(1_700_000_000, &[sign("whsec_new", 1_700_000_000, body)]);
/// // During a rotation the endpoint accepts the old secret and the new one.
/// let scheme = StripeSignature::new("whsec_old").with_secret("whsec_new");
/// assert_eq!(scheme.verify(Some(header.as_bytes()), body, 1_700_000_010), Ok(1_700_000_000));
/// assert!(scheme.verify(Some(header.as_bytes()), b"{}", 1_700_000_010).is_err());
/// ```
#[derive(Clone)]
pub struct StripeSignature {
    secrets: Vec<String>,
    tolerance: Duration,
}

impl fmt::Debug for StripeSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The secrets are never printed.
        f.debug_struct("StripeSignature")
            .field("secrets", &self.secrets.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl StripeSignature {
    /// The scheme of an endpoint signing with `secret` (`whsec_...`), with the default
    /// tolerance.
    pub fn new(secret: impl Into<String>) -> Self {
        Self {
            secrets: vec![secret.into()],
            tolerance: DEFAULT_TOLERANCE,
        }
    }

    /// Also accepts signatures made with `secret`: keep the old secret and the new one while
    /// Stripe rolls the endpoint's secret.
    pub fn with_secret(mut self, secret: impl Into<String>) -> Self {
        self.secrets.push(secret.into());
        self
    }

    /// Sets how far a delivery's timestamp may be from now, either way (default 300 s).
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The tolerance in use.
    pub fn tolerance_in_use(&self) -> Duration {
        self.tolerance
    }

    /// Checks a delivery: `header` is the raw `Stripe-Signature` value (`None` when absent),
    /// `body` the raw request body, `now` the receiver's clock in Unix seconds. Returns the
    /// signed timestamp.
    pub fn verify(
        &self,
        header: Option<&[u8]>,
        body: &[u8],
        now: i64,
    ) -> Result<i64, SignatureError> {
        let header = header.ok_or(SignatureError::Missing)?;
        let (timestamp, signatures) = parse_header(header)?;
        let matched = self.secrets.iter().any(|secret| {
            let mac = signed_mac(secret, timestamp, body);
            // `verify_slice` compares in constant time.
            signatures
                .iter()
                .any(|sig| mac.clone().verify_slice(sig).is_ok())
        });
        if !matched {
            return Err(SignatureError::Mismatch);
        }
        let off_by = now.abs_diff(timestamp);
        let tolerance = self.tolerance.as_secs();
        if off_by > tolerance {
            return Err(SignatureError::OutsideTolerance {
                timestamp,
                now,
                off_by,
                tolerance,
            });
        }
        Ok(timestamp)
    }
}

/// The HMAC of `"{timestamp}.{body}"` keyed with the whole secret string, ready to finalise or
/// verify.
fn signed_mac(secret: &str, timestamp: i64, body: &[u8]) -> HmacSha256 {
    // HMAC takes a key of any length: this cannot fail.
    let mut mac = match HmacSha256::new_from_slice(secret.as_bytes()) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    };
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The `v1` signature of `body` signed at `timestamp` with `secret`, in lowercase hex: what
/// Stripe sends.
pub fn sign(secret: &str, timestamp: i64, body: &[u8]) -> String {
    crate::fingerprint::hex(&signed_mac(secret, timestamp, body).finalize().into_bytes())
}

/// A `Stripe-Signature` header value: `t=<timestamp>` and one `v1=` per signature.
pub fn signature_header(timestamp: i64, signatures: &[String]) -> String {
    let mut out = format!("t={timestamp}");
    for sig in signatures {
        out.push_str(&format!(",{SCHEME}={sig}"));
    }
    out
}

/// Reads the header: its timestamp and its `v1` signatures, decoded (the ones that are not hex
/// are skipped, as Stripe's libraries skip them).
fn parse_header(header: &[u8]) -> Result<(i64, Vec<Vec<u8>>), SignatureError> {
    let malformed = |reason: &str| SignatureError::Malformed {
        reason: reason.to_owned(),
    };
    let header = std::str::from_utf8(header)
        .ok()
        .filter(|h| h.bytes().all(|b| b.is_ascii_graphic() || b == b' '))
        .ok_or_else(|| malformed("not visible ASCII"))?;
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for item in header.split(',').map(str::trim) {
        let (name, value) = item
            .split_once('=')
            .ok_or_else(|| malformed("an item has no '='"))?;
        match name {
            "t" if timestamp.is_some() => return Err(malformed("two timestamps")),
            "t" => {
                let t = value
                    .parse::<i64>()
                    .map_err(|_| malformed("the timestamp is not a whole number"))?;
                timestamp = Some(t);
            }
            SCHEME => {
                if let Some(sig) = decode_hex(value) {
                    signatures.push(sig);
                }
            }
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or_else(|| malformed("no timestamp (t=)"))?;
    if signatures.is_empty() {
        return Err(SignatureError::NoSignature);
    }
    Ok((timestamp, signatures))
}

/// Decodes hex (either case); `None` when it is not an even number of hex digits.
fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if s.is_empty() || !s.len().is_multiple_of(2) {
        return None;
    }
    s.as_bytes()
        .chunks(2)
        .map(|pair| {
            let digit = |c: u8| (c as char).to_digit(16);
            Some((digit(pair[0])? * 16 + digit(pair[1])?) as u8)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = br#"{"id":"evt_test_1","type":"payment_intent.succeeded"}"#;
    const T: i64 = 1_700_000_000;
    // Computed outside this code, with the algorithm Stripe documents:
    //   printf '%s' '1700000000.{"id":"evt_test_1","type":"payment_intent.succeeded"}' \
    //     | openssl dgst -sha256 -hmac 'whsec_test_secret'
    // (Python's `hmac.new(b'whsec_test_secret', b'1700000000.{...}', hashlib.sha256)` agrees.)
    const SIG_TEST: &str = "510a6b23c205185db14dd02988bce5939164d8e977341d096cb9c4305b367fb8";
    // The same payload, `-hmac 'whsec_rotated_new'`.
    const SIG_NEW: &str = "edd1a9facc9971e9298d8dba67d2a3212f16e5c383e44cfab2ecb7548762c661";

    #[test]
    fn debug_never_shows_a_secret() {
        let scheme = StripeSignature::new("whsec_old_value").with_secret("whsec_new_value");
        let shown = format!("{scheme:?}");
        assert!(!shown.contains("whsec_"), "{shown}");
        assert!(shown.contains("secrets: 2"), "{shown}");
    }

    fn header(sigs: &[&str]) -> String {
        let sigs: Vec<String> = sigs.iter().map(|s| (*s).to_owned()).collect();
        signature_header(T, &sigs)
    }

    fn check(scheme: &StripeSignature, header: &str, now: i64) -> Result<i64, SignatureError> {
        scheme.verify(Some(header.as_bytes()), BODY, now)
    }

    #[test]
    fn signing_matches_the_independently_computed_vectors() {
        assert_eq!(sign("whsec_test_secret", T, BODY), SIG_TEST);
        assert_eq!(sign("whsec_rotated_new", T, BODY), SIG_NEW);
    }

    #[test]
    fn a_good_signature_is_accepted_within_the_tolerance() {
        let scheme = StripeSignature::new("whsec_test_secret");
        assert_eq!(check(&scheme, &header(&[SIG_TEST]), T), Ok(T));
        assert_eq!(check(&scheme, &header(&[SIG_TEST]), T + 300), Ok(T));
        assert_eq!(check(&scheme, &header(&[SIG_TEST]), T - 300), Ok(T));
        // Upper-case hex and spaces after commas are read too.
        let loose = format!("t={T}, v1={}", SIG_TEST.to_uppercase());
        assert_eq!(check(&scheme, &loose, T), Ok(T));
    }

    #[test]
    fn a_bad_signature_or_another_body_is_refused() {
        let scheme = StripeSignature::new("whsec_test_secret");
        assert_eq!(
            check(&scheme, &header(&[SIG_NEW]), T),
            Err(SignatureError::Mismatch)
        );
        let other_body = scheme.verify(Some(header(&[SIG_TEST]).as_bytes()), b"{}", T);
        assert_eq!(other_body, Err(SignatureError::Mismatch));
        // The timestamp is signed: moving it breaks the signature.
        let moved = format!("t={},v1={SIG_TEST}", T + 1);
        assert_eq!(check(&scheme, &moved, T), Err(SignatureError::Mismatch));
    }

    #[test]
    fn a_stale_or_future_timestamp_is_refused_both_ways() {
        let scheme = StripeSignature::new("whsec_test_secret");
        let stale = check(&scheme, &header(&[SIG_TEST]), T + 301);
        assert!(
            matches!(
                stale,
                Err(SignatureError::OutsideTolerance { off_by: 301, .. })
            ),
            "{stale:?}"
        );
        let ahead = check(&scheme, &header(&[SIG_TEST]), T - 301);
        assert!(
            matches!(
                ahead,
                Err(SignatureError::OutsideTolerance { off_by: 301, .. })
            ),
            "{ahead:?}"
        );
        let wide = scheme.clone().tolerance(Duration::from_secs(3600));
        assert_eq!(check(&wide, &header(&[SIG_TEST]), T + 3000), Ok(T));
    }

    #[test]
    fn rotated_secrets_and_several_v1_signatures_match_any_with_any() {
        // The receiver knows both secrets; Stripe signs with the new one only.
        let both = StripeSignature::new("whsec_test_secret").with_secret("whsec_rotated_new");
        assert_eq!(check(&both, &header(&[SIG_NEW]), T), Ok(T));
        assert_eq!(check(&both, &header(&[SIG_TEST]), T), Ok(T));
        // Stripe signs with both; the receiver knows either one.
        let two = header(&["00ff", SIG_TEST, SIG_NEW]);
        let new_only = StripeSignature::new("whsec_rotated_new");
        assert_eq!(check(&new_only, &two, T), Ok(T));
        let old_only = StripeSignature::new("whsec_test_secret");
        assert_eq!(check(&old_only, &two, T), Ok(T));
        // A secret nobody signed with.
        let stranger = StripeSignature::new("whsec_other");
        assert_eq!(check(&stranger, &two, T), Err(SignatureError::Mismatch));
    }

    #[test]
    fn malformed_headers_are_typed_errors_not_panics() {
        let scheme = StripeSignature::new("whsec_test_secret");
        assert_eq!(scheme.verify(None, BODY, T), Err(SignatureError::Missing));
        let v0_only = format!("t={T},v0={SIG_TEST}");
        let not_hex = format!("t={T},v1=zz{}", &SIG_TEST[2..]);
        let odd_hex = format!("t={T},v1=abc");
        for h in [v0_only.as_str(), not_hex.as_str(), odd_hex.as_str(), "t=1"] {
            assert_eq!(
                check(&scheme, h, T),
                Err(SignatureError::NoSignature),
                "{h}"
            );
        }
        let cases = [
            "",
            "garbage",
            "v1=00",
            "t=,v1=00",
            "t=abc,v1=00",
            "t=99999999999999999999999,v1=00",
            "t=1,t=2,v1=00",
            "t=1,v1=00\u{7f}",
        ];
        for h in cases {
            assert!(
                matches!(check(&scheme, h, T), Err(SignatureError::Malformed { .. })),
                "{h:?}"
            );
        }
        assert!(matches!(
            scheme.verify(Some(&[0xff, 0xfe]), BODY, T),
            Err(SignatureError::Malformed { .. })
        ));
        // Extreme timestamps do not overflow the tolerance check.
        let far = format!(
            "t={},v1={}",
            i64::MIN,
            sign("whsec_test_secret", i64::MIN, BODY)
        );
        assert!(matches!(
            check(&scheme, &far, i64::MAX),
            Err(SignatureError::OutsideTolerance { .. })
        ));
    }
}
