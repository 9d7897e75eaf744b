-- purge (one bucket): deletes up to `batch` finished keys whose expires_at has passed, earliest
-- first, and records each deletion in the key's history: the record is replaced by a tombstone
-- holding its history and last token, which expires HIST_TTL after the purge. A key that Redis
-- already expired natively (the backstop, which takes its history along) is recorded here too,
-- in a new history.
-- KEYS: the bucket's index. ARGV[5..]: batch
local idx = KEYS[1]
local batch = tonumber(ARGV[5])

local _, now = clock()
local cands = {}
for code = 1, 3 do
  local b = BAND[code]
  local r = redis.call('ZRANGEBYSCORE', idx, s(b), s(b + now), 'WITHSCORES', 'LIMIT', 0, batch)
  for i = 1, #r, 2 do
    cands[#cands + 1] = {m = r[i], at = tonumber(r[i + 1]) - b, code = code}
  end
end
table.sort(cands, function(a, b) return a.at < b.at end)

local n = 0
for i = 1, math.min(batch, #cands) do
  local c = cands[i]
  local k = KEY_PREFIX .. c.m
  local r = unpack_record(redis.call('GET', k))
  if not r or not r[F_ST] then
    redis.call('ZREM', idx, c.m)
    local t = r or {false, 0, 0, {}}
    record_event(t, c.code, nil, nil, 'purge', 'expired by Redis before purge', now)
    save(k, t, now + HIST_TTL)
    n = n + 1
  elseif r[F_ST] ~= 0 and r[F_EXP] <= now then
    redis.call('ZREM', idx, c.m)
    local t = {false, r[F_TOK], r[F_HS], r[F_HIST]}
    record_event(t, r[F_ST], nil, r[F_TOK], 'purge', 'retention expired', now)
    save(k, t, now + HIST_TTL)
    n = n + 1
  elseif r[F_ST] == 0 then
    -- A wrong score (should not happen): put it right.
    index(idx, c.m, 0, due_of(r))
  else
    index(idx, c.m, r[F_ST], r[F_EXP])
  end
end
return n
