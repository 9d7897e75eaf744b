-- mark_attempt: the holder of the token is about to send to the provider (again): the latest
-- attempt starts now and may act. Not a transition: no history.
-- KEYS: hash, history, then the bucket's six indexes.
-- ARGV[6..]: member, token
local h = KEYS[1]
local token = tonumber(ARGV[7])

local cur = redis.call('HMGET', h, 'st', 'rt', 'tok')
if not cur[1] then return {'notfound'} end
local tok = tonumber(cur[3])
if cur[1] ~= 'processing' or tok ~= token then return {'lost', tok, cur[1], cur[2]} end

local now = now_ms()
redis.call('HSET', h, 'lat', s(now), 'mha', '1', 'uat', s(now))
return {'ok'}
