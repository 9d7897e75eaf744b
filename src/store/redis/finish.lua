-- finish: done / failed, fenced by the token (the key must be processing under it), or, with no
-- token, an operator override from any state that bumps the token to fence running workers.
-- KEYS: hash, history, then the bucket's six indexes.
-- ARGV[6..]: member, to_state, to_retryable, status?, headers?, body?, error?, token?, actor,
-- reason
local idx = idx_from(3)
local h, hist = KEYS[1], KEYS[2]
local m, to_st, to_rt = ARGV[6], ARGV[7], ARGV[8]
local status, headers, body, err = opt(ARGV[9]), opt(ARGV[10]), opt(ARGV[11]), opt(ARGV[12])
local token, actor, reason = opt(ARGV[13]), ARGV[14], ARGV[15]

local to_set = fin_set(idx, to_st, to_rt)
if not to_set then return redis.error_reply('idemflow: finish into ' .. to_st) end

local cur = redis.call('HMGET', h, 'st', 'rt', 'tok', 'ret')
if not cur[1] then return {'notfound'} end
local st, rt, tok = cur[1], cur[2], tonumber(cur[3])
if token then
  if st ~= 'processing' or tok ~= tonumber(token) then
    return {'lost', tok, st, rt}
  end
else
  tok = redis.call('HINCRBY', h, 'tok', 1)
end

local now = now_ms()
local exp = now + tonumber(cur[4])
redis.call('HSET', h, 'st', to_st, 'rt', to_rt, 'uat', s(now), 'exp', s(exp))
local function put(field, v)
  if v then redis.call('HSET', h, field, v) else redis.call('HDEL', h, field) end
end
put('rs', status)
put('rh', headers)
put('rb', body)
put('err', err)
redis.call('HDEL', h, 'own', 'lex', 'nca')
expire_finished(h, exp)
unindex(idx, m, st, rt)
redis.call('ZADD', to_set, s(exp), m)
local seq = redis.call('HINCRBY', h, 'hs', 1)
record_event(hist, seq, st, rt, to_st, to_rt, tok, actor, reason, now)
redis.call('PEXPIREAT', hist, s(exp + HIST_TTL))
return {'ok', redis.call('HGETALL', h)}
