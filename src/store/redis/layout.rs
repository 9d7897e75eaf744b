//! Key layout: the member of a (scope, key) pair, its bucket, and the Redis key names of a key
//! and of a bucket (see the module docs).

use crate::KeyId;
use crate::error::StoreError;

/// The escaped `scope:key` member of an id.
pub(super) fn member(id: &KeyId) -> String {
    let mut out = String::with_capacity(id.scope.as_str().len() + id.key.as_str().len() + 8);
    escape(id.scope.as_str(), &mut out);
    out.push(':');
    escape(id.key.as_str(), &mut out);
    out
}

/// The escaped `scope:` prefix of every member of `scope`.
pub(super) fn scope_prefix(scope: &str) -> String {
    let mut out = String::with_capacity(scope.len() + 4);
    escape(scope, &mut out);
    out.push(':');
    out
}

fn escape(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            ':' => out.push_str("%3A"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
}

fn unescape(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut it = s.split('%');
    out.push_str(it.next()?);
    for part in it {
        let (code, rest) = (part.get(..2)?, part.get(2..)?);
        out.push(match code {
            "25" => '%',
            "3A" => ':',
            "7B" => '{',
            "7D" => '}',
            _ => return None,
        });
        out.push_str(rest);
    }
    Some(out)
}

/// Splits a member back into (scope, key).
pub(super) fn unmember(m: &str) -> Option<(String, String)> {
    let (s, k) = m.split_once(':')?;
    Some((unescape(s)?, unescape(k)?))
}

/// FNV-1a, 64 bits, of a member: its bucket and its known-keys hint slot.
pub(super) fn fnv1a(s: &str) -> u64 {
    crate::store::known_keys::fnv1a(s.as_bytes())
}

pub(super) fn validate_prefix(prefix: &str) -> Result<(), StoreError> {
    if prefix.is_empty()
        || !prefix.bytes().all(|b| b.is_ascii_graphic())
        || prefix.contains(['{', '}'])
    {
        return Err(StoreError::Config(format!(
            "bad Redis key prefix {prefix:?}: visible ASCII without braces, not empty"
        )));
    }
    Ok(())
}

/// The Redis keys of one member: its record and its bucket's index.
pub(super) struct Keys {
    pub(super) rec: String,
    pub(super) idx: String,
}

/// The key names of one prefix split into `buckets` hash-tag buckets.
#[derive(Debug, Clone)]
pub(super) struct Layout {
    prefix: String,
    buckets: u32,
}

impl Layout {
    /// At least one bucket.
    pub(super) fn new(prefix: String, buckets: u32) -> Self {
        Self {
            prefix,
            buckets: buckets.max(1),
        }
    }

    pub(super) fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(super) fn buckets(&self) -> u32 {
        self.buckets
    }

    /// `P:format`: the data format version of the prefix.
    pub(super) fn format_key(&self) -> String {
        format!("{}:format", self.prefix)
    }

    fn bucket_of(&self, member: &str) -> u32 {
        // The remainder is below `buckets`, a u32.
        (fnv1a(member) % u64::from(self.buckets)) as u32
    }

    /// `P:{b}`: the hash tag every key of bucket `b` starts with.
    fn tag(&self, bucket: u32) -> String {
        format!("{}:{{{bucket}}}", self.prefix)
    }

    /// `P:{b}:idx`: the bucket's index (one sorted set, see `common.lua`).
    pub(super) fn bucket_index(&self, bucket: u32) -> String {
        format!("{}:idx", self.tag(bucket))
    }

    /// `P:{b}:k:`: the prefix of the records in `bucket`; a member appended to it gives its
    /// record (the bucket scripts build them so from an index member).
    pub(super) fn record_prefix(&self, bucket: u32) -> String {
        format!("{}:k:", self.tag(bucket))
    }

    pub(super) fn keys(&self, member: &str) -> Keys {
        let b = self.bucket_of(member);
        Keys {
            rec: self.record_prefix(b) + member,
            idx: self.bucket_index(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_round_trip_and_never_hold_braces() {
        for (s, k) in [
            ("a", "b"),
            ("a:b", "c"),
            ("a", "b:c"),
            ("%3A", "{x}"),
            ("}{%", ":::"),
        ] {
            let id = KeyId::new(
                crate::key::Scope::new(s).unwrap(),
                crate::key::IdempotencyKey::new(k).unwrap(),
            );
            let m = member(&id);
            assert!(!m.contains(['{', '}']));
            assert_eq!(unmember(&m), Some((s.to_owned(), k.to_owned())));
        }
        assert_eq!(unescape("%zz"), None);
        assert_eq!(unescape("%2"), None);
    }

    #[test]
    fn prefixes_are_checked() {
        assert!(validate_prefix("idemflow").is_ok());
        for bad in ["", "a{b", "a}b", "a b", "é"] {
            assert!(validate_prefix(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_member_and_its_bucket_share_one_hash_tag() {
        let layout = Layout::new("p".into(), 4);
        let k = layout.keys("s:k");
        let tag = &k.rec[..k.rec.find('}').unwrap() + 1];
        assert!(tag.starts_with("p:{"));
        assert_eq!(k.rec, format!("{tag}:k:s:k"));
        assert_eq!(k.idx, format!("{tag}:idx"));
    }
}
