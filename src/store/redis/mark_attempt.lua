-- mark_attempt: the holder of the token is about to send to the provider (again): the latest
-- attempt starts now and may act. Not a transition: no history.
-- KEYS: record, bucket index.
-- ARGV[5..]: member, token
local k = KEYS[1]
local token = tonumber(ARGV[6])

local r = unpack_record(redis.call('GET', k))
if not r or not r[F_ST] then return {'notfound'} end
if r[F_ST] ~= 0 or r[F_TOK] ~= token then return lost(r) end

local _, now = clock()
r[F_LAT], r[F_MHA], r[F_UAT] = now, true, now
save(k, r, nil)
return {'ok'}
