-- init_shard.lua
-- Writes a new shard's deployment record (ARGV[4] the deployment id,
-- ARGV[5] the layout version) and the `keys` hash's pin (ARGV[6],
-- `keys_pin_value`), refusing a shard any of whose keys exist:
-- init never writes over another deployment's (or a lost) shard.
local K_META = KEYS[1]
for _, k in ipairs(KEYS) do
  if redis.call('EXISTS', k) == 1 then
    return {'EXISTS', k, redis.call('HGET', K_META, 'dep') or '', redis.call('HGET', K_META, 'layout') or ''}
  end
end
redis.call('HSET', K_META, 'dep', ARGV[4], 'layout', ARGV[5], 'seq', '0', 'pend', '0', 'flast', '0')
redis.call('HSET', KEYS[3], string.char(0), ARGV[6])
return {'OK'}
