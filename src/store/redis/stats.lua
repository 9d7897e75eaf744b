-- stats (one bucket): counts from the indexes' cardinalities; no key is scanned.
-- KEYS: the bucket's six indexes.
-- Returns processing, stale, done, failed_retryable, failed_permanent, oldest created (-1: none),
-- now.
local idx = idx_from(1)
local now = now_ms()
local oldest = redis.call('ZRANGE', idx.created, 0, 0, 'WITHSCORES')
local o = -1
if oldest[2] then o = tonumber(oldest[2]) end
return {
  redis.call('ZCARD', idx.lease),
  redis.call('ZCOUNT', idx.lease, '-inf', s(now)),
  redis.call('ZCARD', idx.done),
  redis.call('ZCARD', idx.fr),
  redis.call('ZCARD', idx.fp),
  o,
  now,
}
