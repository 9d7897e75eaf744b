-- idemflow: helpers prepended to every script.
--
-- ARGV[1..5] are the same for every script: history cap, history TTL (ms), native-expiry grace
-- (ms, negative: none), and the key-name prefixes of key hashes and histories in this bucket
-- (used by the bucket scripts, which find members in an index). Script arguments start at ARGV[6].
--
-- Times are Redis `TIME` in integer milliseconds; every number written is formatted with %d so
-- that it is never rendered in exponent form.

local CAP = tonumber(ARGV[1])
local HIST_TTL = tonumber(ARGV[2])
local GRACE = tonumber(ARGV[3])
local HASH_PREFIX = ARGV[4]
local HIST_PREFIX = ARGV[5]

local function s(n)
  return string.format('%d', n)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Optional arguments come as '0' (absent) or '1' followed by the value.
local function opt(a)
  if string.sub(a, 1, 1) == '1' then
    return string.sub(a, 2)
  end
  return nil
end

-- The bucket's indexes, from KEYS[base .. base+5].
local function idx_from(base)
  return {
    due = KEYS[base],          -- processing keys by max(lease expiry, next check): the sweeper's
    lease = KEYS[base + 1],    -- processing keys by lease expiry (stats: stale)
    created = KEYS[base + 2],  -- processing keys by creation (stats: oldest)
    done = KEYS[base + 3],     -- done keys by expires_at (purge)
    fr = KEYS[base + 4],       -- failed{retryable} keys by expires_at
    fp = KEYS[base + 5],       -- failed{permanent} keys by expires_at
  }
end

local function fin_set(idx, st, rt)
  if st == 'done' then
    return idx.done
  elseif st == 'failed' then
    if rt == '1' then return idx.fr end
    return idx.fp
  end
  return nil
end

local function unindex(idx, m, st, rt)
  if st == 'processing' then
    redis.call('ZREM', idx.due, m)
    redis.call('ZREM', idx.lease, m)
    redis.call('ZREM', idx.created, m)
  else
    local z = fin_set(idx, st, rt)
    if z then redis.call('ZREM', z, m) end
  end
end

local function index_processing(idx, m, lex, nca, created)
  local due = lex
  if nca and nca > due then due = nca end
  redis.call('ZADD', idx.due, s(due), m)
  redis.call('ZADD', idx.lease, s(lex), m)
  if created then redis.call('ZADD', idx.created, s(created), m) end
end

-- The last history sequence number of a key (0 when it has none) and whether it has a history.
-- The sequence number leads each entry (see record_event); should the last entry not start with
-- one (never written so), the list's length stands in for it.
local function last_seq(hist)
  local last = redis.call('LINDEX', hist, -1)
  if not last then return 0, false end
  return tonumber(string.match(last, '^(%d+)|')) or redis.call('LLEN', hist), true
end

-- Appends one history entry (and caps the list). The entry is a fixed-field string:
--   seq|from_state|from_retryable|to_state|to_retryable|token|at|#actor|actor[|reason]
-- nil fields are empty; the actor is length-prefixed and the reason, last, is the rest of the
-- entry, so neither needs escaping. A missing reason leaves out its '|'.
local function record_event(hist, seq, from_st, from_rt, to_st, to_rt, tok, actor, reason, at)
  local e = s(seq) .. '|' .. (from_st or '') .. '|' .. (from_rt or '') .. '|' .. (to_st or '')
    .. '|' .. (to_rt or '') .. '|' .. (tok and s(tok) or '') .. '|' .. s(at) .. '|' .. #actor
    .. '|' .. actor
  if reason then e = e .. '|' .. reason end
  local len = redis.call('RPUSH', hist, e)
  if CAP > 0 and len > CAP then redis.call('LTRIM', hist, -CAP, -1) end
end

-- A finished key's hash: Redis deletes it GRACE after expires_at unless purge_expired did first.
local function expire_finished(h, exp)
  if GRACE >= 0 then
    redis.call('PEXPIREAT', h, s(exp + GRACE))
  else
    redis.call('PERSIST', h)
  end
end
