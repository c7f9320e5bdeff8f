-- map_publish.lua
-- KEYS[1] the map key. ARGV[1] expected version (0: none stored), ARGV[2]
-- new version, ARGV[3] YAML. Compare-and-set.
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if cur ~= tonumber(ARGV[1]) then return {'CONFLICT', cur} end
if tonumber(ARGV[2]) <= cur then return {'STALE', cur} end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'yaml', ARGV[3])
return {'OK'}
