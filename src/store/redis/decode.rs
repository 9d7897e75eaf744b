//! Decoding what Redis returns: script replies, key hashes (-> [`KeyRecord`]) and history
//! entries (-> [`KeyEvent`]).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use redis::Value;

use super::layout::unmember;
use super::{BACKEND, corrupt};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::{KeyEvent, KeyRecord, LeaseToken};
use crate::state::KeyState;
use crate::store::rows::ms_to_time;
use crate::store::{RawEvent, RawRecord};

pub(super) fn text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

pub(super) fn int(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

pub(super) fn array(v: Value) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(a) => Ok(a),
        Value::Set(a) => Ok(a),
        other => Err(corrupt(format!("expected an array, got {other:?}"))),
    }
}

/// A flat `HGETALL` reply to field -> bytes.
fn fields(v: Value) -> Result<HashMap<String, Vec<u8>>, StoreError> {
    let pairs: Vec<(Value, Value)> = match v {
        Value::Map(m) => m,
        v => {
            let a = array(v)?;
            if a.len() % 2 != 0 {
                return Err(corrupt("odd HGETALL reply"));
            }
            let mut it = a.into_iter();
            let mut out = Vec::new();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                out.push((k, v));
            }
            out
        }
    };
    pairs
        .into_iter()
        .map(|(k, v)| {
            let k = text(Some(&k)).ok_or_else(|| corrupt("hash field name"))?;
            let v = match v {
                Value::BulkString(b) => b,
                Value::SimpleString(s) => s.into_bytes(),
                Value::Int(i) => i.to_string().into_bytes(),
                other => return Err(corrupt(format!("hash value {other:?}"))),
            };
            Ok((k, v))
        })
        .collect()
}

/// The key `id` from an `HGETALL` reply of its hash.
pub(super) fn record(id: &KeyId, hash: Value) -> Result<KeyRecord, StoreError> {
    record_of(id.scope.as_str(), id.key.as_str(), fields(hash)?)
}

/// The key `id` from an `HGETALL` reply of its hash that may be empty (no such key).
pub(super) fn maybe_record(id: &KeyId, hash: Value) -> Result<Option<KeyRecord>, StoreError> {
    let fields = fields(hash)?;
    if fields.is_empty() {
        return Ok(None);
    }
    record_of(id.scope.as_str(), id.key.as_str(), fields).map(Some)
}

/// The keys of a bucket script's `{{member, hash fields}, ..}` reply; `what` names the script
/// in errors.
pub(super) fn member_records(list: Value, what: &str) -> Result<Vec<KeyRecord>, StoreError> {
    array(list)?
        .into_iter()
        .map(|entry| {
            let mut pair = array(entry)?.into_iter();
            let (Some(m), Some(hash)) = (pair.next(), pair.next()) else {
                return Err(corrupt(format!("{what} reply")));
            };
            let m = text(Some(&m)).ok_or_else(|| corrupt(format!("{what} member")))?;
            let (scope, key) =
                unmember(&m).ok_or_else(|| corrupt(format!("index member {m:?}")))?;
            record_of(&scope, &key, fields(hash)?)
        })
        .collect()
}

/// Turns a `{'notfound'}` / `{'lost', tok, st, rt}` script reply into the error.
pub(super) fn refusal(id: &KeyId, presented: Option<LeaseToken>, reply: &[Value]) -> StoreError {
    match (text(reply.first()).as_deref(), presented) {
        (Some("lost"), Some(presented)) => {
            let current = int(reply.get(1)).unwrap_or(0);
            let st = text(reply.get(2)).unwrap_or_default();
            let rt = text(reply.get(3)).as_deref() == Some("1");
            match KeyState::from_columns(&st, rt) {
                Ok(state) => StoreError::LeaseLost {
                    key: id.to_string(),
                    presented,
                    current: LeaseToken(current),
                    state,
                },
                Err(e) => corrupt(e.to_string()),
            }
        }
        (Some("notfound"), _) => StoreError::NotFound {
            key: id.to_string(),
        },
        (other, _) => corrupt(format!("unexpected script reply {other:?}")),
    }
}

/// Decodes a key hash. Fields: op, prov, pk, st, rt, fp, req, rs (status), rh (headers JSON),
/// rb (body), err, tok, own, lex (lease expiry), att, cat, uat, exp, nca (next check), ret
/// (retention ms), hs (last history sequence), lat (last attempt), mha (may have acted: `1`).
/// Times are ms since the epoch.
pub(super) fn record_of(
    scope: &str,
    key: &str,
    mut f: HashMap<String, Vec<u8>>,
) -> Result<KeyRecord, StoreError> {
    fn s(f: &mut HashMap<String, Vec<u8>>, k: &str) -> Result<Option<String>, StoreError> {
        f.remove(k)
            .map(|v| String::from_utf8(v).map_err(|_| corrupt(format!("field {k} is not UTF-8"))))
            .transpose()
    }
    fn req(f: &mut HashMap<String, Vec<u8>>, k: &str) -> Result<String, StoreError> {
        s(f, k)?.ok_or_else(|| corrupt(format!("field {k} missing")))
    }
    fn n(f: &mut HashMap<String, Vec<u8>>, k: &str) -> Result<Option<i64>, StoreError> {
        s(f, k)?
            .map(|v| {
                v.parse::<i64>()
                    .map_err(|_| corrupt(format!("field {k} = {v:?}")))
            })
            .transpose()
    }
    fn t(f: &mut HashMap<String, Vec<u8>>, k: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        n(f, k)?.map(|ms| ms_to_time(BACKEND, ms)).transpose()
    }
    fn need<T>(v: Option<T>, k: &str) -> Result<T, StoreError> {
        v.ok_or_else(|| corrupt(format!("field {k} missing")))
    }
    let status = n(&mut f, "rs")?
        .map(|v| i32::try_from(v).map_err(|_| corrupt(format!("status {v}"))))
        .transpose()?;
    RawRecord {
        scope: scope.to_owned(),
        key: key.to_owned(),
        operation: req(&mut f, "op")?,
        provider: s(&mut f, "prov")?,
        provider_key: req(&mut f, "pk")?,
        state: req(&mut f, "st")?,
        retryable: req(&mut f, "rt")? == "1",
        fingerprint: req(&mut f, "fp")?,
        request: s(&mut f, "req")?,
        response_status: status,
        response_headers: s(&mut f, "rh")?,
        response_body: f.remove("rb"),
        error: s(&mut f, "err")?,
        lease_token: need(n(&mut f, "tok")?, "tok")?,
        lease_owner: s(&mut f, "own")?,
        lease_expires_at: t(&mut f, "lex")?,
        attempts: i32::try_from(need(n(&mut f, "att")?, "att")?)
            .map_err(|_| corrupt("attempts"))?,
        created_at: need(t(&mut f, "cat")?, "cat")?,
        updated_at: need(t(&mut f, "uat")?, "uat")?,
        expires_at: t(&mut f, "exp")?,
        next_check_at: t(&mut f, "nca")?,
        retention_ms: need(n(&mut f, "ret")?, "ret")?,
        last_attempt_at: t(&mut f, "lat")?,
        may_have_acted: s(&mut f, "mha")?.as_deref() == Some("1"),
    }
    .into_record(BACKEND)
}

/// Decodes one history entry as `record_event` in `common.lua` writes it:
/// `seq|from|from_rt|to|to_rt|token|at|#actor|actor[|reason]`.
pub(super) fn event(raw: &str) -> Result<KeyEvent, StoreError> {
    let bad = || corrupt(format!("history entry {raw:?}"));
    let mut it = raw.splitn(8, '|');
    let mut next = || it.next().ok_or_else(bad);
    let seq: i64 = next()?.parse().map_err(|_| bad())?;
    let opt = |v: &str| (!v.is_empty()).then(|| v.to_owned());
    let from_state = opt(next()?);
    let from_retryable = opt(next()?).map(|v| v == "1");
    let to_state = opt(next()?);
    let to_retryable = opt(next()?).map(|v| v == "1");
    let lease_token = opt(next()?)
        .map(|v| v.parse::<i64>().map_err(|_| bad()))
        .transpose()?;
    let at: i64 = next()?.parse().map_err(|_| bad())?;
    let rest = next()?;
    let (len, rest) = rest.split_once('|').ok_or_else(bad)?;
    let len: usize = len.parse().map_err(|_| bad())?;
    let actor = rest.get(..len).ok_or_else(bad)?.to_owned();
    let reason = match rest.get(len..).ok_or_else(bad)? {
        "" => None,
        r => Some(r.strip_prefix('|').ok_or_else(bad)?.to_owned()),
    };
    RawEvent {
        seq,
        from_state,
        from_retryable,
        to_state,
        to_retryable,
        lease_token,
        actor,
        reason,
        at: ms_to_time(BACKEND, at)?,
    }
    .into_event(BACKEND)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_entries_decode() {
        let e = event("1|||processing|0|1|1700000000000|6|worker|claimed").unwrap();
        assert_eq!(e.seq, 1);
        assert_eq!(e.from, None);
        assert_eq!(e.to, Some(KeyState::Processing));
        assert_eq!(e.lease_token, Some(LeaseToken(1)));
        assert_eq!(e.actor, crate::Actor::Worker);
        assert_eq!(e.reason.as_deref(), Some("claimed"));
        assert_eq!(e.at.timestamp_millis(), 1_700_000_000_000);
        // A reason may hold the separator; an empty reason differs from none.
        let e = event("3|processing|0|failed|1|2|5|8|operator|a|b|c").unwrap();
        assert_eq!(e.from, Some(KeyState::Processing));
        assert_eq!(e.to, Some(KeyState::Failed { retryable: true }));
        assert_eq!(e.actor, crate::Actor::Operator);
        assert_eq!(e.reason.as_deref(), Some("a|b|c"));
        assert_eq!(
            event("4|done|0|||2|5|5|purge|").unwrap().reason.as_deref(),
            Some("")
        );
        let e = event("5|done|0||||5|5|purge").unwrap();
        assert_eq!((e.to, e.lease_token, e.reason), (None, None, None));
        for bad in [
            "",
            "x|",
            "1|||done|0|1|5|9|worker",
            "1|||done|0|1|5|6|workerX",
            // JSON entries were never written by a released version: not a format.
            r#"{"q":2,"f":"processing","fr":"0","t":"done","tr":"0","k":1,"a":"worker","r":"ok","at":1700000000000}"#,
        ] {
            assert!(event(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bucket_replies_decode_members_and_refusals() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let hash = Value::Array(
            [
                ("op", "charge"),
                ("pk", "pk1"),
                ("st", "processing"),
                ("rt", "0"),
                ("fp", "f"),
                ("tok", "2"),
                ("att", "1"),
                ("cat", "1700000000000"),
                ("uat", "1700000000000"),
                ("ret", "1000"),
            ]
            .into_iter()
            .flat_map(|(k, v)| [bulk(k), bulk(v)])
            .collect(),
        );
        let list = Value::Array(vec![Value::Array(vec![bulk("a%3Ab:k"), hash])]);
        let rs = member_records(list, "stuck").unwrap();
        assert_eq!((rs[0].scope.as_str(), rs[0].key.as_str()), ("a:b", "k"));
        assert_eq!(rs[0].lease_token, LeaseToken(2));
        let odd = Value::Array(vec![Value::Array(vec![bulk("a:k")])]);
        assert!(matches!(
            member_records(odd, "stuck"),
            Err(StoreError::Corrupt { .. })
        ));
        let id = KeyId::new(
            crate::Scope::new("s").unwrap(),
            crate::IdempotencyKey::new("k").unwrap(),
        );
        let lost = [bulk("lost"), Value::Int(3), bulk("failed"), bulk("1")];
        assert!(matches!(
            refusal(&id, Some(LeaseToken(2)), &lost),
            StoreError::LeaseLost {
                presented: LeaseToken(2),
                current: LeaseToken(3),
                state: KeyState::Failed { retryable: true },
                ..
            }
        ));
        assert!(matches!(
            refusal(&id, None, &[bulk("notfound")]),
            StoreError::NotFound { .. }
        ));
        assert!(matches!(
            refusal(&id, None, &[bulk("what")]),
            StoreError::Corrupt { .. }
        ));
    }
}
