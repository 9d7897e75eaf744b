-- extend: moves the lease of a processing key held under the token. Not a transition: no history.
-- KEYS: hash, history, then the bucket's six indexes.
-- ARGV[6..]: member, token, lease_ms
local idx = idx_from(3)
local h = KEYS[1]
local m, token, lease = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])

local cur = redis.call('HMGET', h, 'st', 'rt', 'tok', 'nca')
if not cur[1] then return {'notfound'} end
local tok = tonumber(cur[3])
if cur[1] ~= 'processing' or tok ~= token then return {'lost', tok, cur[1], cur[2]} end

local lex = now_ms() + lease
redis.call('HSET', h, 'lex', s(lex))
index_processing(idx, m, lex, tonumber(cur[4]), nil)
return {'ok', lex}
