-- extend: moves the lease of a processing key held under the token (and not given back). Not a transition: no history.
-- KEYS: record, bucket index.
-- ARGV[5..]: member, token, lease_ms
local k, idx = KEYS[1], KEYS[2]
local m, token, lease = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])

local r = unpack_record(redis.call('GET', k))
if not r or not r[F_ST] then return {'notfound'} end
if r[F_ST] ~= 0 or r[F_TOK] ~= token then return lost(r) end
-- A lease given back (release) is not renewed: a late heartbeat must not hold the key again.
if not r[F_OWN] then return lost(r) end

local _, now = clock()
r[F_LEX] = now + lease
save(k, r, nil)
index(idx, m, 0, due_of(r))
return {'ok', r[F_LEX]}
