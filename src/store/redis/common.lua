-- idemflow: helpers prepended to every script.
--
-- ARGV[1..4] are the same for every script: history cap, history TTL (ms), native-expiry grace
-- (ms, negative: none), and the key-name prefix of the records in this bucket (used by the
-- bucket scripts, which find members in the index). Script arguments start at ARGV[5].
--
-- Times are Redis `TIME` in integer milliseconds; every number written into a command is
-- formatted with %d so that it is never rendered in exponent form.
--
-- A key's record is ONE string value, a MessagePack array (cmsgpack, built into Redis) at fixed
-- positions (F_* below; `false` stands for an absent value, so the table stays an array). Its
-- history is the array at F_HIST, one compact entry per transition (see record_event). A purged
-- key leaves a tombstone: {false, last token, last seq, history}, which only history() and the
-- next claim read.
--
-- The bucket's index is ONE sorted set of members, one entry per key, whose score carries the
-- state in its band (Q = 2^50 ms, far beyond any time this crate stores):
--   processing        max(lease_expires_at, next_check_at) - Q   (negative)
--   done              expires_at
--   failed{retryable} expires_at + Q
--   failed{permanent} expires_at + 2Q
-- Every transition is one ZADD of the member (its state and time change together).

local CAP = tonumber(ARGV[1])
local HIST_TTL = tonumber(ARGV[2])
local GRACE = tonumber(ARGV[3])
local KEY_PREFIX = ARGV[4]

local Q = 1125899906842624

local F_ST, F_TOK, F_HS, F_HIST = 1, 2, 3, 4
local F_OP, F_PROV, F_PK, F_FP, F_REQ = 5, 6, 7, 8, 9
local F_RS, F_RH, F_RB, F_ERR = 10, 11, 12, 13
local F_OWN, F_LEX, F_ATT, F_CAT, F_UAT = 14, 15, 16, 17, 18
local F_EXP, F_NCA, F_RET, F_LAT, F_MHA = 19, 20, 21, 22, 23

-- State codes (F_ST): 0 processing, 1 done, 2 failed{retryable}, 3 failed{permanent}.
local ST_NAME = {[0] = 'processing', [1] = 'done', [2] = 'failed', [3] = 'failed'}
local ST_RT = {[0] = '0', [1] = '0', [2] = '1', [3] = '0'}
local BAND = {[0] = -Q, [1] = 0, [2] = Q, [3] = 2 * Q}

local function s(n)
  return string.format('%d', n)
end

-- The Redis clock in µs and in ms.
local function clock()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return us, math.floor(us / 1000)
end

-- Optional arguments come as '0' (absent) or '1' followed by the value.
local function opt(a)
  if string.sub(a, 1, 1) == '1' then
    return string.sub(a, 2)
  end
  return nil
end

-- The record (a table) behind a raw value, or nil.
local function unpack_record(raw)
  if not raw then return nil end
  return cmsgpack.unpack(raw)
end

-- The {'lost', token, state, retryable} refusal for a record.
local function lost(r)
  return {'lost', r[F_TOK], ST_NAME[r[F_ST]], ST_RT[r[F_ST]]}
end

-- When the sweeper may look at a processing key: max(lease expiry, next check).
local function due_of(r)
  local d = r[F_LEX]
  if r[F_NCA] and r[F_NCA] > d then d = r[F_NCA] end
  return d
end

-- Puts the member at its state's band: `at` is the due time (processing) or expires_at.
local function index(idx, m, code, at)
  redis.call('ZADD', idx, s(at + BAND[code]), m)
end

-- Appends one history entry to the record (and caps the history). The entry is a fixed-field
-- string:
--   seq|from_state|from_retryable|to_state|to_retryable|token|at|#actor|actor[|reason]
-- nil fields are empty; the actor is length-prefixed and the reason, last, is the rest of the
-- entry, so neither needs escaping. A missing reason leaves out its '|'. `from` / `to` are state
-- codes or nil.
local function record_event(r, from, to, tok, actor, reason, at)
  local seq = r[F_HS] + 1
  r[F_HS] = seq
  local e = s(seq) .. '|' .. (from and ST_NAME[from] or '') .. '|' .. (from and ST_RT[from] or '')
    .. '|' .. (to and ST_NAME[to] or '') .. '|' .. (to and ST_RT[to] or '') .. '|'
    .. (tok and s(tok) or '') .. '|' .. s(at) .. '|' .. #actor .. '|' .. actor
  if reason then e = e .. '|' .. reason end
  local h = r[F_HIST]
  h[#h + 1] = e
  if CAP > 0 and #h > CAP then
    local kept = {}
    for i = #h - CAP + 1, #h do kept[#kept + 1] = h[i] end
    r[F_HIST] = kept
  end
end

-- Writes the record; `pxat` (ms) sets its native expiry, nil clears any.
local function save(k, r, pxat)
  local raw = cmsgpack.pack(r)
  if pxat then
    redis.call('SET', k, raw, 'PXAT', s(pxat))
  else
    redis.call('SET', k, raw)
  end
  return raw
end

-- A finished record: Redis deletes it GRACE after expires_at unless purge_expired did first.
local function save_finished(k, r)
  if GRACE >= 0 then return save(k, r, r[F_EXP] + GRACE) end
  return save(k, r, nil)
end

-- Publishes the end of the attempt on record `k` when a duplicate waits for it (its marker,
-- set by announce_end.lua: `<channel> <payload>`); `keep` leaves the marker for a later end (a
-- release: the key stays processing).
local function publish_end(k, keep)
  local w = redis.call('GET', k .. ':w')
  if not w then return end
  local sep = string.find(w, ' ', 1, true)
  if not sep then return end
  if not keep then redis.call('DEL', k .. ':w') end
  redis.call('PUBLISH', string.sub(w, 1, sep - 1), string.sub(w, sep + 1))
end
