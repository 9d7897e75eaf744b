//! [`RedisStore`]: the [`Store`] impl, one Lua script call per transition.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, ScriptInvocation, Value};
use tracing::instrument;

use super::decode::{array, event, int, maybe_record, member_records, record, refusal, text};
use super::hint::KnownKeys;
use super::layout::{Keys, Layout, member, validate_prefix};
use super::{BACKEND, FORMAT_VERSION, RedisConfig, corrupt, db};
use crate::KeyId;
use crate::error::StoreError;
use crate::record::{KeyEvent, KeyRecord, LeaseToken};
use crate::state::Transition;
use crate::store::rows::ms_to_time;
use crate::store::{
    ClaimOutcome, Finish, Lease, NewClaim, Release, Stats, Store, Stuck, TakeStale, check_finish,
    claimable, millis,
};

/// The claims a claim script makes, in the order it takes their history reasons as arguments.
const CLAIMS: [Transition; 3] = [Transition::Claim, Transition::Reclaim, Transition::Takeover];

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(include_str!("common.lua"), include_str!($file)))
    };
}

struct Scripts {
    claim: Script,
    finish: Script,
    release: Script,
    extend: Script,
    mark_attempt: Script,
    take_stale: Script,
    purge: Script,
    stats: Script,
    stuck: Script,
    count_expired: Script,
}

impl Scripts {
    fn all(&self) -> [&Script; 10] {
        [
            &self.claim,
            &self.finish,
            &self.release,
            &self.extend,
            &self.mark_attempt,
            &self.take_stale,
            &self.purge,
            &self.stats,
            &self.stuck,
            &self.count_expired,
        ]
    }
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: script!("claim.lua"),
    finish: script!("finish.lua"),
    release: script!("release.lua"),
    extend: script!("extend.lua"),
    mark_attempt: script!("mark_attempt.lua"),
    take_stale: script!("take_stale.lua"),
    purge: script!("purge.lua"),
    stats: script!("stats.lua"),
    stuck: script!("stuck.lua"),
    count_expired: script!("count_expired.lua"),
});

/// `'0'` for an absent optional argument, `'1' + value` for a present one.
fn opt(v: Option<&[u8]>) -> Vec<u8> {
    match v {
        None => b"0".to_vec(),
        Some(v) => {
            let mut out = Vec::with_capacity(v.len() + 1);
            out.push(b'1');
            out.extend_from_slice(v);
            out
        }
    }
}

fn ms(d: Duration) -> i64 {
    millis(d)
}

/// A [`Store`] on Redis (feature `redis`).
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemflow::StoreError> {
/// use idemflow::{Store, store::redis::RedisStore};
/// let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
/// store.migrate().await?;
/// assert_eq!(store.backend(), "redis");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    con: ConnectionManager,
    layout: Layout,
    /// The first three common script arguments (history cap, history TTL, grace).
    cap: i64,
    history_ttl: i64,
    grace: i64,
    /// Keys known to exist (see [`RedisConfig::known_keys`]).
    known: KnownKeys,
    /// Where the next bucket-wide operation starts, so no bucket starves.
    cursor: Arc<AtomicU32>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.layout.prefix())
            .field("buckets", &self.layout.buckets())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects to `url` with the default prefix `idemflow` and the defaults of [`RedisConfig`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(RedisConfig::new(url)).await
    }

    /// Connects to `url` with the key prefix `prefix`.
    pub async fn connect_with_prefix(url: &str, prefix: &str) -> Result<Self, StoreError> {
        Self::connect_with(RedisConfig::new(url).prefix(prefix)).await
    }

    /// Connects with explicit options. The connection manager reconnects on its own; a command
    /// that failed with the connection is not retried (a script may or may not have run).
    pub async fn connect_with(config: RedisConfig) -> Result<Self, StoreError> {
        validate_prefix(&config.prefix)?;
        let client = redis::Client::open(config.url.as_str())
            .map_err(|e| StoreError::Config(format!("bad Redis URL: {e}")))?;
        let cm = ConnectionManagerConfig::new()
            .set_response_timeout(Some(config.response_timeout))
            .set_connection_timeout(Some(config.connection_timeout))
            .set_number_of_retries(2);
        let con = ConnectionManager::new_with_config(client, cm)
            .await
            .map_err(db)?;
        Ok(Self::from_manager(con, config))
    }

    /// Uses a connection manager you built; the URL in `config` is ignored.
    pub fn from_manager(con: ConnectionManager, config: RedisConfig) -> Self {
        Self {
            con,
            layout: Layout::new(config.prefix, config.buckets),
            cap: i64::from(config.history_cap),
            history_ttl: ms(config.history_ttl),
            grace: config.expiry_grace.map_or(-1, ms),
            known: KnownKeys::new(config.known_keys),
            cursor: Arc::new(AtomicU32::new(0)),
        }
    }

    /// The connection manager (for tests and tools that need raw access).
    pub fn connection(&self) -> ConnectionManager {
        self.con.clone()
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        self.layout.prefix()
    }

    /// The Redis key of the hash holding `id`'s row (for inspection, e.g. `MEMORY USAGE`).
    pub fn record_key(&self, id: &KeyId) -> String {
        self.layout.keys(&member(id)).hash
    }

    /// The Redis key of the list holding `id`'s history.
    pub fn history_key(&self, id: &KeyId) -> String {
        self.layout.keys(&member(id)).hist
    }

    /// Sets the five common arguments (see `common.lua`); the last two, the key-name prefixes
    /// of the bucket, only bucket scripts use.
    fn common_args(&self, inv: &mut ScriptInvocation<'_>, prefixes: (String, String)) {
        inv.arg(self.cap)
            .arg(self.history_ttl)
            .arg(self.grace)
            .arg(prefixes.0)
            .arg(prefixes.1);
    }

    /// A per-key script invocation with KEYS and the common ARGV filled in.
    fn per_key<'a>(&self, script: &'a Script, k: &Keys) -> ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        inv.key(&k.hash).key(&k.hist);
        for i in &k.idx {
            inv.key(i);
        }
        self.common_args(&mut inv, (String::new(), String::new()));
        inv
    }

    /// A bucket-wide script invocation.
    fn per_bucket<'a>(&self, script: &'a Script, bucket: u32) -> ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        for i in self.layout.bucket_indexes(bucket) {
            inv.key(i);
        }
        self.common_args(&mut inv, self.layout.member_prefixes(bucket));
        inv
    }

    /// Buckets in the order a bucket-wide operation should visit them.
    fn bucket_order(&self) -> impl Iterator<Item = u32> + use<> {
        let n = self.layout.buckets();
        let start = self.cursor.fetch_add(1, Ordering::Relaxed) % n;
        (0..n).map(move |i| (start + i) % n)
    }

    async fn invoke(&self, inv: &ScriptInvocation<'_>) -> Result<Value, StoreError> {
        let mut con = self.con.clone();
        inv.invoke_async(&mut con).await.map_err(db)
    }

    /// The key's row and the Redis clock, read atomically (`MULTI TIME HGETALL EXEC`: one round
    /// trip, no script).
    async fn snapshot(
        &self,
        id: &KeyId,
        hash: &str,
    ) -> Result<(Option<KeyRecord>, DateTime<Utc>), StoreError> {
        let mut con = self.con.clone();
        let (time, row): (Vec<i64>, Value) = redis::pipe()
            .atomic()
            .cmd("TIME")
            .cmd("HGETALL")
            .arg(hash)
            .query_async(&mut con)
            .await
            .map_err(db)?;
        let [sec, usec] = time[..] else {
            return Err(corrupt("TIME reply"));
        };
        let now = ms_to_time(BACKEND, sec * 1000 + usec / 1000)?;
        Ok((maybe_record(id, row)?, now))
    }

    /// The lease of a `{'claimed', tok, lex, att, pk, reason, may_have_acted, created_at}` claim
    /// reply.
    fn lease(reply: &[Value]) -> Result<Lease, StoreError> {
        let reason = text(reply.get(5));
        let transition = reason
            .as_deref()
            .and_then(Transition::from_claim_reason)
            .ok_or_else(|| corrupt(format!("claim returned reason {reason:?}")))?;
        let get = |i: usize| int(reply.get(i)).ok_or_else(|| corrupt("claim reply"));
        tracing::debug!(?transition, "key claimed");
        Ok(Lease {
            token: LeaseToken(get(1)?),
            expires_at: ms_to_time(BACKEND, get(2)?)?,
            attempts: i32::try_from(get(3)?).map_err(|_| corrupt("attempts"))?,
            provider_key: text(reply.get(4)).ok_or_else(|| corrupt("claim reply"))?,
            transition,
            may_have_acted: text(reply.get(6)).as_deref() == Some("1"),
            created_at: ms_to_time(BACKEND, get(7)?)?,
        })
    }
}

#[async_trait]
impl Store for RedisStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// Nothing to create: records the data format under `P:format` (refusing another one) and
    /// loads the scripts.
    #[instrument(skip(self), fields(backend = BACKEND, prefix = %self.layout.prefix()), err)]
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut con = self.con.clone();
        let key = self.layout.format_key();
        let _: Value = redis::cmd("SET")
            .arg(&key)
            .arg(FORMAT_VERSION)
            .arg("NX")
            .query_async(&mut con)
            .await
            .map_err(db)?;
        let found: Option<String> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut con)
            .await
            .map_err(db)?;
        if found.as_deref() != Some(FORMAT_VERSION) {
            return Err(StoreError::Config(format!(
                "Redis prefix {:?} holds data format {found:?}, this version writes {FORMAT_VERSION}",
                self.layout.prefix()
            )));
        }
        for script in SCRIPTS.all() {
            script.load_async(&mut con).await.map_err(db)?;
        }
        Ok(())
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        let mut con = self.con.clone();
        let (sec, usec): (i64, i64) = redis::cmd("TIME").query_async(&mut con).await.map_err(db)?;
        ms_to_time(BACKEND, sec * 1000 + usec / 1000)
    }

    #[instrument(name = "idemflow.claim", skip_all, fields(backend = BACKEND, scope = %claim.id.scope, key = %claim.id.key, operation = %claim.operation), err)]
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome, StoreError> {
        let m = member(&claim.id);
        let k = self.layout.keys(&m);
        if self.known.contains(&m) {
            // The script decides again, atomically; this read only spares it for keys that
            // exist and are not claimable (replays, in-flight keys, other requests).
            if let (Some(record), now) = self.snapshot(&claim.id, &k.hash).await?
                && !claimable(claim, &record, now)
            {
                return Ok(ClaimOutcome::Existing {
                    record: Box::new(record),
                    now,
                });
            }
        }
        let window = claim.takeover_window.map(|w| ms(w).to_string());
        let mut inv = self.per_key(&SCRIPTS.claim, &k);
        inv.arg(&m)
            .arg(&claim.operation)
            .arg(opt(claim.provider.as_deref().map(str::as_bytes)))
            .arg(&claim.provider_key)
            .arg(claim.fingerprint.as_str())
            .arg(opt(claim.request.as_deref().map(str::as_bytes)))
            .arg(&claim.owner)
            .arg(ms(claim.lease))
            .arg(ms(claim.retention))
            .arg(opt(window.as_deref().map(str::as_bytes)));
        for t in CLAIMS {
            inv.arg(t.claim_reason().unwrap_or_default());
        }
        let reply = array(self.invoke(&inv).await?)?;
        self.known.insert(&m);
        match text(reply.first()).as_deref() {
            Some("claimed") => Ok(ClaimOutcome::Claimed(Self::lease(&reply)?)),
            Some("existing") => {
                let now = ms_to_time(
                    BACKEND,
                    int(reply.get(1)).ok_or_else(|| corrupt("claim reply"))?,
                )?;
                let hash = reply
                    .into_iter()
                    .nth(2)
                    .ok_or_else(|| corrupt("claim reply"))?;
                Ok(ClaimOutcome::Existing {
                    record: Box::new(record(&claim.id, hash)?),
                    now,
                })
            }
            other => Err(corrupt(format!("claim reply {other:?}"))),
        }
    }

    #[instrument(name = "idemflow.finish", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key, to = %finish.to, actor = finish.actor.as_str()), err)]
    async fn finish(
        &self,
        id: &KeyId,
        token: Option<LeaseToken>,
        finish: &Finish,
    ) -> Result<KeyRecord, StoreError> {
        check_finish(token, finish.to)?;
        let m = member(id);
        let k = self.layout.keys(&m);
        let (status, headers) = match &finish.response {
            Some(r) => (Some(r.status().to_string()), Some(r.headers_json())),
            None => (None, None),
        };
        let token_arg = token.map(|t| t.0.to_string());
        let expect_arg = finish.expect_token.map(|t| t.0.to_string());
        let mut inv = self.per_key(&SCRIPTS.finish, &k);
        inv.arg(&m)
            .arg(finish.to.as_str())
            .arg(if finish.to.is_retryable() { "1" } else { "0" })
            .arg(opt(status.as_deref().map(str::as_bytes)))
            .arg(opt(headers.as_deref().map(str::as_bytes)))
            .arg(opt(finish.response.as_ref().map(|r| r.body())))
            .arg(opt(finish.error.as_deref().map(str::as_bytes)))
            .arg(opt(token_arg.as_deref().map(str::as_bytes)))
            .arg(finish.actor.as_str())
            .arg(&finish.reason)
            .arg(opt(expect_arg.as_deref().map(str::as_bytes)));
        let mut reply = array(self.invoke(&inv).await?)?;
        if text(reply.first()).as_deref() == Some("ok") && reply.len() == 2 {
            return record(id, reply.swap_remove(1));
        }
        Err(refusal(id, token.or(finish.expect_token), &reply))
    }

    #[instrument(name = "idemflow.release", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key, actor = release.actor.as_str()), err)]
    async fn release(
        &self,
        id: &KeyId,
        token: LeaseToken,
        release: &Release,
    ) -> Result<(), StoreError> {
        let m = member(id);
        let k = self.layout.keys(&m);
        let recheck = release.recheck_after.map(|d| ms(d).to_string());
        let mut inv = self.per_key(&SCRIPTS.release, &k);
        inv.arg(&m)
            .arg(token.0)
            .arg(opt(recheck.as_deref().map(str::as_bytes)))
            .arg(opt(release.error.as_deref().map(str::as_bytes)))
            .arg(release.actor.as_str())
            .arg(&release.reason);
        let reply = array(self.invoke(&inv).await?)?;
        if text(reply.first()).as_deref() == Some("ok") {
            return Ok(());
        }
        Err(refusal(id, Some(token), &reply))
    }

    #[instrument(name = "idemflow.mark_attempt", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key), err)]
    async fn mark_attempt(&self, id: &KeyId, token: LeaseToken) -> Result<(), StoreError> {
        let m = member(id);
        let k = self.layout.keys(&m);
        let mut inv = self.per_key(&SCRIPTS.mark_attempt, &k);
        inv.arg(&m).arg(token.0);
        let reply = array(self.invoke(&inv).await?)?;
        if text(reply.first()).as_deref() == Some("ok") {
            return Ok(());
        }
        Err(refusal(id, Some(token), &reply))
    }

    #[instrument(name = "idemflow.extend", skip_all, fields(backend = BACKEND, scope = %id.scope, key = %id.key), err)]
    async fn extend(
        &self,
        id: &KeyId,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        let m = member(id);
        let k = self.layout.keys(&m);
        let mut inv = self.per_key(&SCRIPTS.extend, &k);
        inv.arg(&m).arg(token.0).arg(ms(lease));
        let reply = array(self.invoke(&inv).await?)?;
        if text(reply.first()).as_deref() == Some("ok") {
            let at = int(reply.get(1)).ok_or_else(|| corrupt("extend reply"))?;
            return ms_to_time(BACKEND, at);
        }
        Err(refusal(id, Some(token), &reply))
    }

    async fn get(&self, id: &KeyId) -> Result<Option<KeyRecord>, StoreError> {
        let mut con = self.con.clone();
        let hash: Value = redis::cmd("HGETALL")
            .arg(self.record_key(id))
            .query_async(&mut con)
            .await
            .map_err(db)?;
        maybe_record(id, hash)
    }

    async fn history(&self, id: &KeyId) -> Result<Vec<KeyEvent>, StoreError> {
        let mut con = self.con.clone();
        let entries: Vec<String> = redis::cmd("LRANGE")
            .arg(self.history_key(id))
            .arg(0)
            .arg(-1)
            .query_async(&mut con)
            .await
            .map_err(db)?;
        entries.iter().map(|e| event(e)).collect()
    }

    #[instrument(name = "idemflow.take_stale", skip_all, fields(backend = BACKEND, owner = %take.owner, limit = take.limit), err)]
    async fn take_stale(&self, take: &TakeStale) -> Result<Vec<KeyRecord>, StoreError> {
        let mut out = Vec::new();
        for bucket in self.bucket_order() {
            let left = take.limit as usize - out.len();
            if left == 0 {
                break;
            }
            let mut inv = self.per_bucket(&SCRIPTS.take_stale, bucket);
            inv.arg(&take.owner).arg(ms(take.lease)).arg(left);
            out.extend(member_records(self.invoke(&inv).await?, "take_stale")?);
        }
        Ok(out)
    }

    #[instrument(name = "idemflow.purge", skip(self), fields(backend = BACKEND), err)]
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let mut total = 0u64;
        for bucket in self.bucket_order() {
            let left = u64::from(batch) - total;
            if left == 0 {
                break;
            }
            let mut inv = self.per_bucket(&SCRIPTS.purge, bucket);
            inv.arg(left);
            let n = int(Some(&self.invoke(&inv).await?)).ok_or_else(|| corrupt("purge reply"))?;
            total += u64::try_from(n).map_err(|_| corrupt("purge reply"))?;
        }
        Ok(total)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut st = Stats::default();
        let mut oldest: Option<i64> = None;
        let mut now = 0i64;
        for bucket in 0..self.layout.buckets() {
            let inv = self.per_bucket(&SCRIPTS.stats, bucket);
            let r = array(self.invoke(&inv).await?)?;
            let get = |i: usize| int(r.get(i)).ok_or_else(|| corrupt("stats reply"));
            st.processing += get(0)?;
            st.stale += get(1)?;
            st.done += get(2)?;
            st.failed_retryable += get(3)?;
            st.failed_permanent += get(4)?;
            let o = get(5)?;
            if o >= 0 {
                oldest = Some(oldest.map_or(o, |x| x.min(o)));
            }
            now = now.max(get(6)?);
        }
        st.oldest_processing_created_at = oldest.map(|ms| ms_to_time(BACKEND, ms)).transpose()?;
        st.now = ms_to_time(BACKEND, now)?;
        Ok(st)
    }

    /// Per bucket: the count from the `created` index and its oldest `limit` members; the
    /// buckets' lists are merged by creation time.
    async fn stuck(&self, older_than: Duration, limit: u32) -> Result<Stuck, StoreError> {
        let mut count = 0i64;
        let mut oldest = Vec::new();
        for bucket in 0..self.layout.buckets() {
            let mut inv = self.per_bucket(&SCRIPTS.stuck, bucket);
            inv.arg(ms(older_than)).arg(limit);
            let mut reply = array(self.invoke(&inv).await?)?.into_iter();
            let (Some(n), Some(list)) = (reply.next(), reply.next()) else {
                return Err(corrupt("stuck reply"));
            };
            count += int(Some(&n)).ok_or_else(|| corrupt("stuck reply"))?;
            oldest.extend(member_records(list, "stuck")?);
        }
        oldest.sort_by(|a: &KeyRecord, b: &KeyRecord| {
            (a.created_at, a.scope.as_str(), a.key.as_str()).cmp(&(
                b.created_at,
                b.scope.as_str(),
                b.key.as_str(),
            ))
        });
        oldest.truncate(limit as usize);
        Ok(Stuck { count, oldest })
    }

    async fn count_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0u64;
        for bucket in 0..self.layout.buckets() {
            let inv = self.per_bucket(&SCRIPTS.count_expired, bucket);
            let n = int(Some(&self.invoke(&inv).await?))
                .ok_or_else(|| corrupt("count_expired reply"))?;
            total += u64::try_from(n).map_err(|_| corrupt("count_expired reply"))?;
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_claim_has_a_reason_that_parses_back() {
        for t in CLAIMS {
            let reason = t.claim_reason().unwrap();
            assert!(!reason.is_empty());
            assert_eq!(Transition::from_claim_reason(reason), Some(t));
        }
    }
}
