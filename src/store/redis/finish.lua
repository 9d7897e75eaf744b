-- finish: done / failed, fenced by the token (the key must be processing under it), or, with no
-- token, an operator override from any state that bumps the token to fence running workers
-- (with an expected token: only while the key is still processing under it).
-- KEYS: hash, history, then the bucket's six indexes.
-- ARGV[6..]: member, to_state, to_retryable, status?, headers?, body?, error?, token?, actor,
-- reason, expected token?
local idx = idx_from(3)
local h, hist = KEYS[1], KEYS[2]
local m, to_st, to_rt = ARGV[6], ARGV[7], ARGV[8]
local status, headers, body, err = opt(ARGV[9]), opt(ARGV[10]), opt(ARGV[11]), opt(ARGV[12])
local token, actor, reason = opt(ARGV[13]), ARGV[14], ARGV[15]
local expect = opt(ARGV[16])

local to_set = fin_set(idx, to_st, to_rt)
if not to_set then return redis.error_reply('idemflow: finish into ' .. to_st) end

local cur = redis.call('HMGET', h, 'st', 'rt', 'tok', 'ret', 'hs')
if not cur[1] then return {'notfound'} end
local st, rt, tok = cur[1], cur[2], tonumber(cur[3])
if expect and (st ~= 'processing' or tok ~= tonumber(expect)) then
  return {'lost', tok, st, rt}
end
if token then
  if st ~= 'processing' or tok ~= tonumber(token) then
    return {'lost', tok, st, rt}
  end
else
  tok = tok + 1
end

local now = now_ms()
local exp = now + tonumber(cur[4])
local seq = tonumber(cur[5]) + 1
-- One HSET of the fields that change, one HDEL of those that go.
local set = {'st', to_st, 'rt', to_rt, 'uat', s(now), 'exp', s(exp), 'hs', s(seq)}
if not token then set[#set + 1] = 'tok'; set[#set + 1] = s(tok) end
-- failed{retryable}: nothing that may have acted remains (the one rule decided so).
if to_rt == '1' then set[#set + 1] = 'mha'; set[#set + 1] = '0' end
local del = {'own', 'lex', 'nca'}
local function put(field, v)
  if v then
    set[#set + 1] = field; set[#set + 1] = v
  else
    del[#del + 1] = field
  end
end
put('rs', status)
put('rh', headers)
put('rb', body)
put('err', err)
redis.call('HSET', h, unpack(set))
redis.call('HDEL', h, unpack(del))
expire_finished(h, exp)
unindex(idx, m, st, rt)
redis.call('ZADD', to_set, s(exp), m)
record_event(hist, seq, st, rt, to_st, to_rt, tok, actor, reason, now)
redis.call('PEXPIREAT', hist, s(exp + HIST_TTL))
return {'ok', redis.call('HGETALL', h)}
