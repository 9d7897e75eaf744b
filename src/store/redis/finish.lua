-- finish: done / failed, fenced by the token (the key must be processing under it), or, with no
-- token, an operator override from any state that bumps the token to fence running workers
-- (with an expected token: only while the key is still processing under it).
-- KEYS: record, bucket index.
-- ARGV[5..]: member, to (state code 1..3), status?, headers?, body?, error?, token?, actor,
-- reason, expected token?
-- Costs 5 commands: GET, TIME, SET (with its native expiry), ZADD, and the GET of the waiters'
-- marker (with a marker, a DEL and a PUBLISH more: publish_end). Returns {'ok', record}.
local k, idx = KEYS[1], KEYS[2]
local m, to = ARGV[5], tonumber(ARGV[6])
local status, headers, body, err = opt(ARGV[7]), opt(ARGV[8]), opt(ARGV[9]), opt(ARGV[10])
local token, actor, reason = opt(ARGV[11]), ARGV[12], ARGV[13]
local expect = opt(ARGV[14])

if to ~= 1 and to ~= 2 and to ~= 3 then
  return redis.error_reply('idemflow: finish into state ' .. ARGV[6])
end

local r = unpack_record(redis.call('GET', k))
if not r or not r[F_ST] then return {'notfound'} end
local code, tok = r[F_ST], r[F_TOK]
if expect and (code ~= 0 or tok ~= tonumber(expect)) then return lost(r) end
if token then
  if code ~= 0 or tok ~= tonumber(token) then return lost(r) end
else
  tok = tok + 1
end

local _, now = clock()
local exp = now + r[F_RET]
r[F_ST], r[F_TOK], r[F_UAT], r[F_EXP] = to, tok, now, exp
-- failed{retryable}: nothing that may have acted remains (the one rule decided so).
if to == 2 then r[F_MHA] = false end
r[F_OWN], r[F_LEX], r[F_NCA] = false, false, false
r[F_RS] = status and tonumber(status) or false
r[F_RH] = headers or false
r[F_RB] = body or false
r[F_ERR] = err or false
record_event(r, code, to, tok, actor, reason, now)
local raw = save_finished(k, r)
index(idx, m, to, exp)
publish_end(k, false)
return {'ok', raw}
