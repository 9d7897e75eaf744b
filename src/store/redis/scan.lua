-- scan (one bucket, read-only): counts per state from the index bands, and one page of the
-- processing keys with their lease expiry and creation time, for stats and stuck (processing
-- keys are the in-flight ones: few, so they are read rather than kept in more indexes).
-- KEYS: the bucket's index. ARGV[5..]: offset, count (of the page of processing keys)
-- Returns {now, processing, done, failed_retryable, failed_permanent, {member, lex, cat, ...}}.
local idx = KEYS[1]
local offset, count = tonumber(ARGV[5]), tonumber(ARGV[6])
local _, now = clock()
local counts = {}
for code = 0, 3 do
  counts[code] = redis.call('ZCOUNT', idx, s(BAND[code]), '(' .. s(BAND[code] + Q))
end
local page = {}
if count > 0 then
  local members = redis.call('ZRANGEBYSCORE', idx, s(-Q), '(0', 'LIMIT', offset, count)
  for _, m in ipairs(members) do
    local r = unpack_record(redis.call('GET', KEY_PREFIX .. m))
    if r and r[F_ST] == 0 then
      page[#page + 1] = m
      page[#page + 1] = r[F_LEX]
      page[#page + 1] = r[F_CAT]
    end
  end
end
return {now, counts[0], counts[1], counts[2], counts[3], page}
