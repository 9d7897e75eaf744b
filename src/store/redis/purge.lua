-- purge (one bucket): deletes up to `batch` finished keys whose expires_at has passed, earliest
-- first, and records each deletion in the key's history (which outlives the key by the history
-- TTL). A key that Redis already expired natively (the backstop) is recorded here too.
-- KEYS: the bucket's six indexes. ARGV[6..]: batch
local idx = idx_from(1)
local batch = tonumber(ARGV[6])

local now = now_ms()
local cands = {}
for _, z in ipairs({{idx.done, 'done', '0'}, {idx.fr, 'failed', '1'}, {idx.fp, 'failed', '0'}}) do
  local r = redis.call('ZRANGEBYSCORE', z[1], '-inf', s(now), 'WITHSCORES', 'LIMIT', 0, batch)
  for i = 1, #r, 2 do
    cands[#cands + 1] = {m = r[i], score = tonumber(r[i + 1]), z = z}
  end
end
table.sort(cands, function(a, b) return a.score < b.score end)

local n = 0
for i = 1, math.min(batch, #cands) do
  local c = cands[i]
  local h, hist = HASH_PREFIX .. c.m, HIST_PREFIX .. c.m
  redis.call('ZREM', c.z[1], c.m)
  local cur = redis.call('HMGET', h, 'st', 'rt', 'tok', 'exp', 'hs')
  if not cur[1] then
    record_event(hist, last_seq(hist) + 1, c.z[2], c.z[3], nil, nil, nil, 'purge',
      'expired by Redis before purge', now)
    redis.call('PEXPIREAT', hist, s(now + HIST_TTL))
    n = n + 1
  elseif cur[1] ~= 'processing' and cur[4] and tonumber(cur[4]) <= now then
    redis.call('DEL', h)
    record_event(hist, tonumber(cur[5]) + 1, cur[1], cur[2], nil, nil, tonumber(cur[3]),
      'purge', 'retention expired', now)
    redis.call('PEXPIREAT', hist, s(now + HIST_TTL))
    n = n + 1
  end
end
return n
