-- target_clear.lua
-- KEYS[1] the pending target, KEYS[2] the rebalance lock. ARGV[1] the
-- YAML the caller read and found to be the target it reached (empty:
-- none was pending), ARGV[2] the caller's lock token (empty: no lock).
-- Compare-and-delete: a target recorded since stays pending.
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return {'LOCKLOST'}
end
local cur = redis.call('GET', KEYS[1])
if not cur then return {'OK'} end
if cur ~= ARGV[1] then return {'CHANGED'} end
redis.call('DEL', KEYS[1])
return {'OK'}
