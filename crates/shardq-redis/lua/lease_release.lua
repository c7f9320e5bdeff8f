-- lease_release.lua
-- KEYS[1] the lease, ARGV[2] the caller's token: gives the lease up.
if redis.call('HGET', KEYS[1], 'token') == ARGV[2] then
  redis.call('HSET', KEYS[1], 'owner', '', 'until', '0')
  return 1
end
return 0
