-- lock_renew.lua
-- KEYS[1] the rebalance lock, ARGV[1] the holder's token, ARGV[2] ms:
-- extends the lock only while the caller still holds it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
