-- take_stale (one bucket): pops up to `limit` processing keys that are due (lease expired and
-- next check due: the `due` index score is max(lease_expires_at, next_check_at)), earliest first,
-- and gives each a new fencing token and lease, all in one atomic script: two sweepers never get
-- the same key. The per-key names are built from ARGV[4]/ARGV[5] and the index member; they are
-- in this bucket's hash slot.
-- KEYS: the bucket's six indexes. ARGV[6..]: owner, lease_ms, limit
local idx = idx_from(1)
local owner, lease, limit = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])

local now = now_ms()
local out = {}
local members = redis.call('ZRANGEBYSCORE', idx.due, '-inf', s(now), 'LIMIT', 0, limit)
for _, m in ipairs(members) do
  local h, hist = HASH_PREFIX .. m, HIST_PREFIX .. m
  local cur = redis.call('HMGET', h, 'st', 'lex', 'nca', 'own', 'lat', 'cat')
  if cur[1] ~= 'processing' then
    -- An index entry without a processing key behind it: drop it.
    redis.call('ZREM', idx.due, m)
    redis.call('ZREM', idx.lease, m)
    redis.call('ZREM', idx.created, m)
  elseif tonumber(cur[2]) <= now and (not cur[3] or tonumber(cur[3]) <= now) then
    local tok = redis.call('HINCRBY', h, 'tok', 1)
    redis.call('HINCRBY', h, 'att', 1)
    local lex = now + lease
    -- The previous holder (unless it released the key) may have sent until its lease ended.
    local lat = tonumber(cur[5] or cur[6])
    if cur[4] and tonumber(cur[2]) > lat then lat = tonumber(cur[2]) end
    redis.call('HSET', h, 'own', owner, 'lex', s(lex), 'uat', s(now), 'lat', s(lat), 'mha', '1')
    index_processing(idx, m, lex, tonumber(cur[3]), nil)
    local seq = redis.call('HINCRBY', h, 'hs', 1)
    record_event(hist, seq, 'processing', '0', 'processing', '0', tok, 'sweeper',
      'sweeper took over an expired lease', now)
    out[#out + 1] = {m, redis.call('HGETALL', h)}
  else
    -- A wrong score (should not happen): put it right, leave the key alone.
    index_processing(idx, m, tonumber(cur[2]), tonumber(cur[3]), nil)
  end
end
return out
