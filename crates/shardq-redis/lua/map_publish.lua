-- map_publish.lua
-- KEYS[1] the map key, KEYS[2] (optional) the rebalance lock. ARGV[1]
-- expected version (0: none stored), ARGV[2] new version, ARGV[3] YAML,
-- ARGV[4] (optional, non-empty) the caller's lock token: then the map is
-- published only while the caller still holds the lock, so a rebalance
-- stalled past its lease publishes nothing. Compare-and-set.
if ARGV[4] and ARGV[4] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[4] then
  return {'LOCKLOST'}
end
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if cur ~= tonumber(ARGV[1]) then return {'CONFLICT', cur} end
if tonumber(ARGV[2]) <= cur then return {'STALE', cur} end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'yaml', ARGV[3])
return {'OK'}
