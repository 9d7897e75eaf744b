//! Decoding what Redis returns: script replies, key hashes (-> [`KeyRecord`]) and history
//! entries (-> [`KeyEvent`]).

use chrono::{DateTime, Utc};
use redis::Value;

use super::layout::unmember;
use super::{BACKEND, corrupt};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::{KeyEvent, KeyRecord, LeaseToken};
use crate::state::KeyState;
use crate::store::kit::RawRecord;
use crate::store::rows::ms_to_time;

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

/// One MessagePack value, as `cmsgpack` writes a record (see `common.lua`): nil and booleans,
/// integers, strings (kept as bytes) and arrays. Floats and maps are never written.
#[derive(Debug, Clone, PartialEq)]
enum Mp<'a> {
    Nil,
    Bool(bool),
    Int(i64),
    Bytes(&'a [u8]),
    Array(Vec<Mp<'a>>),
}

/// Nesting deeper than a record's (record, history) is corrupt.
const MAX_DEPTH: usize = 4;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let out = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(out)
    }

    fn be(&mut self, n: usize) -> Option<u64> {
        Some(
            self.take(n)?
                .iter()
                .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)),
        )
    }

    fn len(&mut self, n: usize) -> Option<usize> {
        usize::try_from(self.be(n)?).ok()
    }

    fn value(&mut self, depth: usize) -> Option<Mp<'a>> {
        let tag = *self.take(1)?.first()?;
        Some(match tag {
            0x00..=0x7f => Mp::Int(i64::from(tag)),
            0xe0..=0xff => Mp::Int(i64::from(tag as i8)),
            0xc0 => Mp::Nil,
            0xc2 => Mp::Bool(false),
            0xc3 => Mp::Bool(true),
            0xcc => Mp::Int(self.be(1)? as i64),
            0xcd => Mp::Int(self.be(2)? as i64),
            0xce => Mp::Int(self.be(4)? as i64),
            0xcf => Mp::Int(i64::try_from(self.be(8)?).ok()?),
            0xd0 => Mp::Int(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => Mp::Int(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => Mp::Int(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => Mp::Int(self.be(8)? as i64),
            0xa0..=0xbf => Mp::Bytes(self.take(usize::from(tag & 0x1f))?),
            0xd9 | 0xc4 => {
                let n = self.len(1)?;
                Mp::Bytes(self.take(n)?)
            }
            0xda | 0xc5 => {
                let n = self.len(2)?;
                Mp::Bytes(self.take(n)?)
            }
            0xdb | 0xc6 => {
                let n = self.len(4)?;
                Mp::Bytes(self.take(n)?)
            }
            // An empty Lua table may be written as an empty map.
            0x80 => Mp::Array(Vec::new()),
            0x90..=0x9f => self.array(usize::from(tag & 0x0f), depth)?,
            0xdc => {
                let n = self.len(2)?;
                self.array(n, depth)?
            }
            0xdd => {
                let n = self.len(4)?;
                self.array(n, depth)?
            }
            _ => return None,
        })
    }

    fn array(&mut self, n: usize, depth: usize) -> Option<Mp<'a>> {
        if depth >= MAX_DEPTH || n > self.buf.len() - self.pos {
            // Every element takes at least one byte.
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.value(depth + 1)?);
        }
        Some(Mp::Array(out))
    }
}

/// A stored record's fields, from its MessagePack array (positions as `F_*` in `common.lua`).
struct Fields<'a>(Vec<Mp<'a>>);

const F_ST: usize = 0;
const F_TOK: usize = 1;
const F_HS: usize = 2;
const F_HIST: usize = 3;

impl<'a> Fields<'a> {
    fn parse(raw: &'a [u8]) -> Result<Self, StoreError> {
        let mut r = Reader { buf: raw, pos: 0 };
        match r.value(0) {
            Some(Mp::Array(a)) if r.pos == raw.len() && a.len() >= 4 => Ok(Self(a)),
            _ => Err(corrupt(
                "record is not a MessagePack array of 4 or more values",
            )),
        }
    }

    fn name(i: usize) -> &'static str {
        const NAMES: [&str; 23] = [
            "st", "tok", "hs", "hist", "op", "prov", "pk", "fp", "req", "rs", "rh", "rb", "err",
            "own", "lex", "att", "cat", "uat", "exp", "nca", "ret", "lat", "mha",
        ];
        NAMES.get(i).copied().unwrap_or("?")
    }

    /// Field `i` (1-based as in Lua); `None` when absent (`false`, nil or past the end).
    fn get(&self, i: usize) -> Option<&Mp<'a>> {
        match self.0.get(i - 1)? {
            Mp::Nil | Mp::Bool(false) => None,
            v => Some(v),
        }
    }

    fn int(&self, i: usize) -> Result<Option<i64>, StoreError> {
        match self.get(i) {
            None => Ok(None),
            Some(Mp::Int(n)) => Ok(Some(*n)),
            Some(v) => Err(corrupt(format!("field {} = {v:?}", Self::name(i - 1)))),
        }
    }

    fn bytes(&self, i: usize) -> Result<Option<&'a [u8]>, StoreError> {
        match self.get(i) {
            None => Ok(None),
            Some(Mp::Bytes(b)) => Ok(Some(b)),
            Some(v) => Err(corrupt(format!("field {} = {v:?}", Self::name(i - 1)))),
        }
    }

    fn text(&self, i: usize) -> Result<Option<String>, StoreError> {
        self.bytes(i)?
            .map(|b| {
                String::from_utf8(b.to_vec())
                    .map_err(|_| corrupt(format!("field {} is not UTF-8", Self::name(i - 1))))
            })
            .transpose()
    }

    fn time(&self, i: usize) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.int(i)?.map(|ms| ms_to_time(BACKEND, ms)).transpose()
    }

    fn need<T>(&self, v: Option<T>, i: usize) -> Result<T, StoreError> {
        v.ok_or_else(|| corrupt(format!("field {} missing", Self::name(i - 1))))
    }

    fn history(&self) -> Result<Vec<KeyEvent>, StoreError> {
        let Some(Mp::Array(entries)) = self.0.get(F_HIST) else {
            return Err(corrupt("history is not an array"));
        };
        entries
            .iter()
            .map(|e| match e {
                Mp::Bytes(b) => std::str::from_utf8(b)
                    .map_err(|_| corrupt("history entry is not UTF-8"))
                    .and_then(event),
                other => Err(corrupt(format!("history entry {other:?}"))),
            })
            .collect()
    }
}

/// Decodes a stored record: `None` for a purged key's tombstone (history only). Fields, 1-based:
/// st (state code: 0 processing, 1 done, 2 failed{retryable}, 3 failed{permanent}; absent in a
/// tombstone), tok, hs (last history sequence), hist (history entries), op, prov, pk, fp, req, rs
/// (status), rh (headers JSON), rb (body), err, own, lex (lease expiry), att, cat, uat, exp, nca
/// (next check), ret (retention ms), lat (last attempt), mha (may have acted). Times are ms since
/// the epoch.
pub(super) fn record_of(
    scope: &str,
    key: &str,
    raw: &[u8],
) -> Result<Option<KeyRecord>, StoreError> {
    let f = Fields::parse(raw)?;
    let Some(code) = f.int(F_ST + 1)? else {
        return Ok(None);
    };
    let (state, retryable) = match code {
        0 => ("processing", false),
        1 => ("done", false),
        2 => ("failed", true),
        3 => ("failed", false),
        c => return Err(corrupt(format!("state code {c}"))),
    };
    let status = f
        .int(10)?
        .map(|v| i32::try_from(v).map_err(|_| corrupt(format!("status {v}"))))
        .transpose()?;
    let mha = match f.0.get(22) {
        None | Some(Mp::Nil | Mp::Bool(false)) => false,
        Some(Mp::Bool(true)) => true,
        Some(v) => return Err(corrupt(format!("field mha = {v:?}"))),
    };
    RawRecord {
        scope: scope.to_owned(),
        key: key.to_owned(),
        operation: f.need(f.text(5)?, 5)?,
        provider: f.text(6)?,
        provider_key: f.need(f.text(7)?, 7)?,
        state: state.to_owned(),
        retryable,
        fingerprint: f.need(f.text(8)?, 8)?,
        request: f.text(9)?,
        response_status: status,
        response_headers: f.text(11)?,
        response_body: f.bytes(12)?.map(<[u8]>::to_vec),
        error: f.text(13)?,
        lease_token: f.need(f.int(F_TOK + 1)?, F_TOK + 1)?,
        lease_owner: f.text(14)?,
        lease_expires_at: f.time(15)?,
        attempts: i32::try_from(f.need(f.int(16)?, 16)?).map_err(|_| corrupt("attempts"))?,
        created_at: f.need(f.time(17)?, 17)?,
        updated_at: f.need(f.time(18)?, 18)?,
        expires_at: f.time(19)?,
        next_check_at: f.time(20)?,
        retention_ms: f.need(f.int(21)?, 21)?,
        last_attempt_at: f.time(22)?,
        may_have_acted: mha,
    }
    .into_record(BACKEND)
    .map(Some)
}

/// The history stored in a record or tombstone.
pub(super) fn history_of(raw: &[u8]) -> Result<Vec<KeyEvent>, StoreError> {
    let f = Fields::parse(raw)?;
    f.int(F_HS + 1)?;
    f.history()
}

fn bytes(v: Value) -> Result<Vec<u8>, StoreError> {
    match v {
        Value::BulkString(b) => Ok(b),
        other => Err(corrupt(format!("expected a record, got {other:?}"))),
    }
}

/// The key `id` from a script reply holding its record (never a tombstone).
pub(super) fn record(id: &KeyId, raw: Value) -> Result<KeyRecord, StoreError> {
    record_of(id.scope.as_str(), id.key.as_str(), &bytes(raw)?)?
        .ok_or_else(|| corrupt("a purged key where a record was expected"))
}

/// The key `id` from a `GET` of its record (`Nil`: no such key; a tombstone: purged).
pub(super) fn maybe_record(id: &KeyId, raw: Value) -> Result<Option<KeyRecord>, StoreError> {
    match raw {
        Value::Nil => Ok(None),
        v => record_of(id.scope.as_str(), id.key.as_str(), &bytes(v)?),
    }
}

/// The keys of a bucket script's `{{member, record}, ..}` reply; `what` names the script in
/// errors.
pub(super) fn member_records(list: Value, what: &str) -> Result<Vec<KeyRecord>, StoreError> {
    array(list)?
        .into_iter()
        .map(|entry| {
            let mut pair = array(entry)?.into_iter();
            let (Some(m), Some(raw)) = (pair.next(), pair.next()) else {
                return Err(corrupt(format!("{what} reply")));
            };
            let m = text(Some(&m)).ok_or_else(|| corrupt(format!("{what} member")))?;
            let (scope, key) =
                unmember(&m).ok_or_else(|| corrupt(format!("index member {m:?}")))?;
            record_of(&scope, &key, &bytes(raw)?)?
                .ok_or_else(|| corrupt(format!("{what}: a purged key")))
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
                    key: id.clone(),
                    presented,
                    current: LeaseToken(current),
                    state,
                },
                Err(e) => corrupt(e.to_string()),
            }
        }
        (Some("notfound"), _) => StoreError::NotFound { key: id.clone() },
        (other, _) => corrupt(format!("unexpected script reply {other:?}")),
    }
}

/// Decodes one history entry as `record_event` in `common.lua` writes it:
/// `seq|from|from_rt|to|to_rt|token|at|#actor|actor[|reason]`, the format the SQL history
/// columns share (`rows::decode_history_entry`; a Redis entry is an array element, so its reason
/// is not escaped).
pub(super) fn event(raw: &str) -> Result<KeyEvent, StoreError> {
    crate::store::rows::decode_history_entry(BACKEND, raw, false)
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
        assert_eq!(e.actor, crate::record::Actor::Worker);
        assert_eq!(e.reason.as_deref(), Some("claimed"));
        assert_eq!(e.at.timestamp_millis(), 1_700_000_000_000);
        // A reason may hold the separator; an empty reason differs from none.
        let e = event("3|processing|0|failed|1|2|5|8|operator|a|b|c").unwrap();
        assert_eq!(e.from, Some(KeyState::Processing));
        assert_eq!(e.to, Some(KeyState::Failed { retryable: true }));
        assert_eq!(e.actor, crate::record::Actor::Operator);
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

    /// A test encoder of the MessagePack subset `cmsgpack` writes.
    enum E {
        F,
        T,
        I(i64),
        S(&'static str),
        A(Vec<E>),
    }

    fn enc(v: &E, out: &mut Vec<u8>) {
        match v {
            E::F => out.push(0xc2),
            E::T => out.push(0xc3),
            E::I(n) if (0..128).contains(n) => out.push(*n as u8),
            E::I(n) => {
                out.push(0xd3);
                out.extend_from_slice(&n.to_be_bytes());
            }
            E::S(s) => {
                out.push(0xd9);
                out.push(s.len() as u8);
                out.extend_from_slice(s.as_bytes());
            }
            E::A(a) => {
                out.push(0xdc);
                out.extend_from_slice(&(a.len() as u16).to_be_bytes());
                for v in a {
                    enc(v, out);
                }
            }
        }
    }

    fn encoded(v: &E) -> Vec<u8> {
        let mut out = Vec::new();
        enc(v, &mut out);
        out
    }

    /// A processing key as `claim.lua` writes it (token 2, one history entry).
    fn processing_record() -> Vec<u8> {
        use E::*;
        let t = 1_700_000_000_000;
        encoded(&A(vec![
            I(0),
            I(2),
            I(1),
            A(vec![S("1|||processing|0|2|1700000000000|6|worker|claimed")]),
            S("charge"),
            F,
            S("pk1"),
            S("f"),
            F,
            F,
            F,
            F,
            F,
            S("w"),
            I(t + 1000),
            I(1),
            I(t),
            I(t),
            F,
            F,
            I(1000),
            I(t),
            T,
        ]))
    }

    #[test]
    fn records_and_tombstones_decode() {
        let r = record_of("s", "k", &processing_record()).unwrap().unwrap();
        assert_eq!(r.state, KeyState::Processing);
        assert_eq!(r.lease_token, LeaseToken(2));
        assert_eq!(r.lease_owner.as_deref(), Some("w"));
        assert!(r.may_have_acted);
        assert_eq!(r.response, None);
        let h = history_of(&processing_record()).unwrap();
        assert_eq!((h.len(), h[0].seq), (1, 1));
        use E::*;
        let tomb = encoded(&A(vec![
            F,
            I(7),
            I(2),
            A(vec![
                S("1|||done|0|7|5|5|purge"),
                S("2|done|0||||5|5|purge"),
            ]),
        ]));
        assert_eq!(record_of("s", "k", &tomb).unwrap(), None);
        assert_eq!(history_of(&tomb).unwrap().len(), 2);
        for bad in [
            vec![],
            vec![0x93, 0x01, 0x02, 0x03],
            vec![0xdd, 0xff, 0xff, 0xff, 0xff],
            encoded(&A(vec![I(9), I(2), I(1), A(vec![])])),
            encoded(&A(vec![S("x"), I(2), I(1), A(vec![])])),
            encoded(&A(vec![F, I(2), I(1), A(vec![I(1)])])),
            // Nesting deeper than a record's.
            encoded(&A(vec![A(vec![A(vec![A(vec![A(vec![])])])])])),
            // Trailing bytes.
            [processing_record(), vec![0xc0]].concat(),
        ] {
            assert!(
                record_of("s", "k", &bad).is_err() || history_of(&bad).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn bucket_replies_decode_members_and_refusals() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let hash = Value::BulkString(processing_record());
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
            crate::key::Scope::new("s").unwrap(),
            crate::key::IdempotencyKey::new("k").unwrap(),
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
