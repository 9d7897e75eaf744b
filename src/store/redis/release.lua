-- release: the lease holder gives the lease back; the key stays processing, due for the sweeper
-- at once or after recheck_ms (next_check_at).
-- KEYS: record, bucket index.
-- ARGV[5..]: member, token, recheck_ms?, error?, actor, reason
local k, idx = KEYS[1], KEYS[2]
local m, token, recheck, err = ARGV[5], tonumber(ARGV[6]), opt(ARGV[7]), opt(ARGV[8])
local actor, reason = ARGV[9], ARGV[10]

local r = unpack_record(redis.call('GET', k))
if not r or not r[F_ST] then return {'notfound'} end
if r[F_ST] ~= 0 or r[F_TOK] ~= token then return lost(r) end

local _, now = clock()
if r[F_LEX] > now then r[F_LEX] = now end
r[F_UAT], r[F_OWN] = now, false
-- A worker's release: its attempt may have reached the provider until now.
if actor == 'worker' then r[F_LAT], r[F_MHA] = now, true end
r[F_NCA] = false
if recheck then r[F_NCA] = now + tonumber(recheck) end
if err then r[F_ERR] = err end
record_event(r, 0, 0, r[F_TOK], actor, reason, now)
save(k, r, nil)
index(idx, m, 0, due_of(r))
publish_end(k, true)
return {'ok'}
