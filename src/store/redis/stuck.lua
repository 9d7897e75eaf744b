-- stuck (one bucket): processing keys first claimed at least `age_ms` ago, read from the
-- `created` index (processing keys by creation time); no key is scanned. Read-only.
-- KEYS: the bucket's six indexes. ARGV[6..]: age_ms, limit
-- Returns {count, {{member, hash fields}, ..}} with the oldest `limit` keys, oldest first.
local idx = idx_from(1)
local age, limit = tonumber(ARGV[6]), tonumber(ARGV[7])

local cutoff = s(now_ms() - age)
local count = redis.call('ZCOUNT', idx.created, '-inf', cutoff)
local out = {}
if limit > 0 and count > 0 then
  local members = redis.call('ZRANGEBYSCORE', idx.created, '-inf', cutoff, 'LIMIT', 0, limit)
  for _, m in ipairs(members) do
    local h = HASH_PREFIX .. m
    -- An index entry without a processing key behind it (should not happen) is left out of the
    -- list; take_stale drops such entries.
    if redis.call('HGET', h, 'st') == 'processing' then
      out[#out + 1] = {m, redis.call('HGETALL', h)}
    end
  end
end
return {count, out}
