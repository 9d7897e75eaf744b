-- count_expired (one bucket): finished keys whose expires_at has passed, which purge would
-- delete now (the same index ranges purge reads). Read-only.
-- KEYS: the bucket's index.
local idx = KEYS[1]
local _, now = clock()
local n = 0
for code = 1, 3 do
  n = n + redis.call('ZCOUNT', idx, s(BAND[code]), s(BAND[code] + now))
end
return n
