-- announce_end: a duplicate will wait for this key's attempt. While the key is processing, its
-- marker `<record>:w` (same hash slot) holds `<channel> <payload>`; the finish (which deletes
-- it) and the release (which keeps it) PUBLISH the payload on the channel (`publish_end` in
-- common.lua). Nothing is published for a key without a marker.
-- KEYS: record, bucket index.
-- ARGV[5..]: channel, payload, marker ttl (ms).
local k = KEYS[1]
local r = unpack_record(redis.call('GET', k))
if not r or r[F_ST] ~= 0 then return 0 end
redis.call('SET', k .. ':w', ARGV[5] .. ' ' .. ARGV[6], 'PX', tonumber(ARGV[7]))
return 1
