-- count_expired (one bucket): finished keys whose expires_at has passed, which purge would
-- delete now (the same index ranges purge reads). Read-only.
-- KEYS: the bucket's six indexes.
local idx = idx_from(1)
local now = s(now_ms())
return redis.call('ZCOUNT', idx.done, '-inf', now)
  + redis.call('ZCOUNT', idx.fr, '-inf', now)
  + redis.call('ZCOUNT', idx.fp, '-inf', now)
