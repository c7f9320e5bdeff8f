-- lock_release.lua
-- KEYS[1] the rebalance lock, ARGV[1] the holder's token: releases it only
-- if the caller still holds it (never a successor's lock).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
