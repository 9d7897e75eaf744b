-- claim: insert a new key, or reclaim failed{retryable} with the same fingerprint, or (inside
-- the takeover window) take over an expired processing key with the same fingerprint; otherwise
-- return the key as it is. The same rules as `claimable()` and the SQLite CLAIM statement.
-- KEYS: record, bucket index.
-- ARGV[5..]: member, operation, provider?, provider_key, fingerprint, request?, owner, lease_ms,
-- retention_ms, window_ms?, then the history reasons of a claim, a reclaim and a takeover (from
-- `Transition::CLAIM_REASONS`; the reply returns the one recorded, the Rust side parses it back),
-- then renewed_key_base? (the base of the key a re-created key sends: a tombstone shows an earlier
-- life; `renewed()` appends the life number, the claim's event's position in the key's history).
-- A takeover needs the recorded provider; a reclaim through another provider needs a key on
-- which no attempt may have acted, and records the new provider and key (`claimable()`).
-- A new key costs 4 commands: TIME, GET, SET, ZADD.
local k, idx = KEYS[1], KEYS[2]
local m = ARGV[5]
local op, provider, pk, fp = ARGV[6], opt(ARGV[7]), ARGV[8], ARGV[9]
local request, owner = opt(ARGV[10]), ARGV[11]
local lease, retention = tonumber(ARGV[12]), tonumber(ARGV[13])
local window = opt(ARGV[14])
if window then window = tonumber(window) end
local CLAIMED, RECLAIMED, TAKEN_OVER = ARGV[15], ARGV[16], ARGV[17]
local renewed_base = opt(ARGV[18])

-- `provider_key::renewed`: the base and the life number modulo 2^32 as 8 lowercase hex digits.
local function renewed(life)
  return renewed_base .. string.format('%08x', life % 4294967296)
end

local us, now = clock()
local raw = redis.call('GET', k)
local r = unpack_record(raw)

if not r or not r[F_ST] then
  -- A new key's first token is the clock in µs: tokens only grow across purge and native
  -- expiry. A purged key's tombstone brings its history (and last token) into the new life.
  local tok, hs, hist = us, 0, {}
  if r then
    hs, hist = r[F_HS], r[F_HIST]
    if r[F_TOK] >= tok then tok = r[F_TOK] + 1 end
    -- An earlier life of this key: its provider may still hold the earlier provider key. The
    -- new one is a function of the tombstone, so a re-creation a failover loses is made again
    -- under the same key.
    if renewed_base then pk = renewed(hs + 1) end
  end
  local lex = now + lease
  local n = {0, tok, hs, hist, op, provider or false, pk, fp, request or false,
    false, false, false, false, owner, lex, 1, now, now, false, false, retention, now, false}
  record_event(n, nil, 0, tok, 'worker', CLAIMED, now)
  save(k, n, nil)
  index(idx, m, 0, lex)
  return {'claimed', tok, lex, 1, pk, CLAIMED, '0', now}
end

local code = r[F_ST]
local reason = nil
local same_provider = (r[F_PROV] or false) == (provider or false)
if r[F_FP] == fp then
  if code == 2 and (same_provider or not r[F_MHA]) then
    reason = RECLAIMED
  elseif code == 0 and same_provider and window and r[F_LEX] <= now
      and r[F_CAT] > now - window then
    reason = TAKEN_OVER
  end
end
if not reason then
  return {'existing', now, raw}
end

local tok = r[F_TOK] + 1
local att = r[F_ATT] + 1
local lex = now + lease
-- A reclaim keeps what the key knew (a failed{retryable} key has nothing that may have acted);
-- a takeover's previous holder never recorded its outcome.
local mha = true
if code == 2 then mha = r[F_MHA] end
r[F_ST], r[F_TOK], r[F_ATT], r[F_OWN], r[F_LEX] = 0, tok, att, owner, lex
r[F_UAT], r[F_RET], r[F_LAT], r[F_MHA] = now, retention, now, mha
if request then r[F_REQ] = request end
if code == 2 and not same_provider then
  -- Nothing may have acted at the recorded provider: the one that may act now is recorded,
  -- with the key this life already has (no earlier life sent it, and a change lost in a
  -- failover sends it again), unless it is longer than the new provider's own; an explicit key
  -- (no renewed one) is sent as given.
  r[F_PROV] = provider or false
  if not renewed_base then
    r[F_PK] = pk
  elseif #r[F_PK] > #pk then
    r[F_PK] = renewed(r[F_HS] + 1)
  end
end
r[F_EXP], r[F_NCA], r[F_ERR], r[F_RS], r[F_RH], r[F_RB] = false, false, false, false, false, false
record_event(r, code, 0, tok, 'worker', reason, now)
-- A plain SET: no native expiry while processing.
save(k, r, nil)
index(idx, m, 0, lex)
local mha_s = '0'
if mha then mha_s = '1' end
return {'claimed', tok, lex, att, r[F_PK], reason, mha_s, r[F_CAT]}
