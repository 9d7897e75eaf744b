-- release: the lease holder gives the lease back; the key stays processing, due for the sweeper
-- at once or after recheck_ms (next_check_at).
-- KEYS: hash, history, then the bucket's six indexes.
-- ARGV[6..]: member, token, recheck_ms?, error?, actor, reason
local idx = idx_from(3)
local h, hist = KEYS[1], KEYS[2]
local m, token, recheck, err = ARGV[6], tonumber(ARGV[7]), opt(ARGV[8]), opt(ARGV[9])
local actor, reason = ARGV[10], ARGV[11]

local cur = redis.call('HMGET', h, 'st', 'rt', 'tok', 'lex')
if not cur[1] then return {'notfound'} end
local tok = tonumber(cur[3])
if cur[1] ~= 'processing' or tok ~= token then return {'lost', tok, cur[1], cur[2]} end

local now = now_ms()
local lex = tonumber(cur[4])
if lex > now then lex = now end
local nca = nil
if recheck then nca = now + tonumber(recheck) end
redis.call('HSET', h, 'lex', s(lex), 'uat', s(now))
-- A worker's release: its attempt may have reached the provider until now.
if actor == 'worker' then redis.call('HSET', h, 'lat', s(now), 'mha', '1') end
redis.call('HDEL', h, 'own')
if nca then redis.call('HSET', h, 'nca', s(nca)) else redis.call('HDEL', h, 'nca') end
if err then redis.call('HSET', h, 'err', err) end
index_processing(idx, m, lex, nca, nil)
local seq = redis.call('HINCRBY', h, 'hs', 1)
record_event(hist, seq, 'processing', '0', 'processing', '0', tok, actor, reason, now)
return {'ok'}
