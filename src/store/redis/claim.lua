-- claim: insert a new key, or reclaim failed{retryable} with the same fingerprint, or (inside
-- the takeover window) take over an expired processing key with the same fingerprint; otherwise
-- return the key as it is. The same rules as `claimable()` and the SQLite CLAIM statement.
-- KEYS: hash, history, then the bucket's six indexes.
-- ARGV[6..]: member, operation, provider?, provider_key, fingerprint, request?, owner, lease_ms,
-- retention_ms, window_ms?, then the history reasons of a claim, a reclaim and a takeover (from
-- `Transition::CLAIM_REASONS`; the reply returns the one recorded, the Rust side parses it back).
local idx = idx_from(3)
local h, hist = KEYS[1], KEYS[2]
local m = ARGV[6]
local op, provider, pk, fp = ARGV[7], opt(ARGV[8]), ARGV[9], ARGV[10]
local request, owner = opt(ARGV[11]), ARGV[12]
local lease, retention = tonumber(ARGV[13]), tonumber(ARGV[14])
local window = opt(ARGV[15])
if window then window = tonumber(window) end
local CLAIMED, RECLAIMED, TAKEN_OVER = ARGV[16], ARGV[17], ARGV[18]

local now = now_ms()
local cur = redis.call('HMGET', h, 'st', 'rt', 'fp', 'lex', 'cat', 'pk', 'tok', 'att', 'hs', 'mha')

if not cur[1] then
  -- A new key's first token is the clock in µs: tokens only grow across purge and expiry.
  local t = redis.call('TIME')
  local tok = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local lex = now + lease
  local seq, had_history = last_seq(hist)
  seq = seq + 1
  local f = {'op', op, 'pk', pk, 'st', 'processing', 'rt', '0', 'fp', fp, 'tok', s(tok),
    'own', owner, 'lex', s(lex), 'att', '1', 'cat', s(now), 'uat', s(now),
    'ret', s(retention), 'hs', s(seq), 'lat', s(now), 'mha', '0'}
  if provider then f[#f + 1] = 'prov'; f[#f + 1] = provider end
  if request then f[#f + 1] = 'req'; f[#f + 1] = request end
  redis.call('HSET', h, unpack(f))
  -- A key that Redis expired natively may still sit in a finished index.
  redis.call('ZREM', idx.done, m)
  redis.call('ZREM', idx.fr, m)
  redis.call('ZREM', idx.fp, m)
  index_processing(idx, m, lex, nil, now)
  record_event(hist, seq, nil, nil, 'processing', '0', tok, 'worker', CLAIMED, now)
  -- A history left by a purged or expired key has a TTL; a new one has none.
  if had_history then redis.call('PERSIST', hist) end
  return {'claimed', tok, lex, 1, pk, CLAIMED, '0', now}
end

local st, rt, cfp, clex, ccat, cpk = cur[1], cur[2], cur[3], cur[4], cur[5], cur[6]
local reason = nil
if cfp == fp then
  if st == 'failed' and rt == '1' then
    reason = RECLAIMED
  elseif st == 'processing' and window and clex and tonumber(clex) <= now
      and tonumber(ccat) > now - window then
    reason = TAKEN_OVER
  end
end
if not reason then
  return {'existing', now, redis.call('HGETALL', h)}
end

local tok = tonumber(cur[7]) + 1
local att = tonumber(cur[8]) + 1
local seq = tonumber(cur[9]) + 1
local lex = now + lease
-- A reclaim keeps what the key knew (a failed{retryable} key has nothing that may have acted);
-- a takeover's previous holder never recorded its outcome.
local mha = '1'
if st == 'failed' then mha = cur[10] or '0' end
local f = {'st', 'processing', 'rt', '0', 'own', owner, 'lex', s(lex), 'uat', s(now),
  'ret', s(retention), 'tok', s(tok), 'att', s(att), 'hs', s(seq), 'lat', s(now), 'mha', mha}
if request then f[#f + 1] = 'req'; f[#f + 1] = request end
redis.call('HSET', h, unpack(f))
redis.call('HDEL', h, 'exp', 'nca', 'err', 'rs', 'rh', 'rb')
redis.call('PERSIST', h)
unindex(idx, m, st, rt)
index_processing(idx, m, lex, nil, tonumber(ccat))
record_event(hist, seq, st, rt, 'processing', '0', tok, 'worker', reason, now)
redis.call('PERSIST', hist)
return {'claimed', tok, lex, att, cpk, reason, mha, tonumber(ccat)}
