-- target_set.lua
-- KEYS[1] the pending target, KEYS[2] the rebalance lock. ARGV[1] the
-- target's YAML, ARGV[2] the caller's lock token (empty: the caller holds
-- no lock). Records the target only while the caller holds the lock.
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return {'LOCKLOST'}
end
redis.call('SET', KEYS[1], ARGV[1])
return {'OK'}
