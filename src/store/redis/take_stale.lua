-- take_stale (one bucket): takes up to `limit` processing keys that are due (lease expired and
-- next check due: the processing band's score is max(lease_expires_at, next_check_at) - Q),
-- earliest first, and gives each a new fencing token and lease, all in one atomic script: two
-- sweepers never get the same key. The record names are built from ARGV[4] and the index
-- member; they are in this bucket's hash slot.
-- With a scope (its members' escaped prefix `scope:` in ARGV[8]), only that scope's keys are
-- taken, from the earliest `SCOPED_WINDOW` due members of the bucket.
-- KEYS: the bucket's index. ARGV[5..]: owner, lease_ms, limit, scope prefix ('' for any)
local idx = KEYS[1]
local owner, lease, limit = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local prefix = ARGV[8] or ''
local SCOPED_WINDOW = 1000

local _, now = clock()
local out = {}
local window = limit
if prefix ~= '' then window = math.max(limit, SCOPED_WINDOW) end
local members = redis.call('ZRANGEBYSCORE', idx, '-inf', s(now - Q), 'LIMIT', 0, window)
for _, m in ipairs(members) do
  if #out >= limit then break end
  if prefix == '' or string.sub(m, 1, #prefix) == prefix then
    local k = KEY_PREFIX .. m
    local r = unpack_record(redis.call('GET', k))
    if not r or not r[F_ST] then
      -- An index entry without a key behind it: drop it.
      redis.call('ZREM', idx, m)
    elseif r[F_ST] ~= 0 then
      -- A finished key in the processing band (should not happen): put it right.
      index(idx, m, r[F_ST], r[F_EXP])
    elseif r[F_LEX] <= now and (not r[F_NCA] or r[F_NCA] <= now) then
      local tok = r[F_TOK] + 1
      -- The previous holder (unless it released the key) may have sent until its lease ended.
      local lat = r[F_LAT] or r[F_CAT]
      if r[F_OWN] and r[F_LEX] > lat then lat = r[F_LEX] end
      r[F_TOK], r[F_ATT], r[F_OWN], r[F_LEX] = tok, r[F_ATT] + 1, owner, now + lease
      r[F_UAT], r[F_LAT], r[F_MHA] = now, lat, true
      record_event(r, 0, 0, tok, 'sweeper', 'sweeper took over an expired lease', now)
      out[#out + 1] = {m, save(k, r, nil)}
      index(idx, m, 0, due_of(r))
    else
      -- A wrong score (should not happen): put it right, leave the key alone.
      index(idx, m, 0, due_of(r))
    end
  end
end
return out
