-- lock_epoch.lua
-- KEYS[1] the rebalance lock, KEYS[2] the epoch counter, ARGV[1] the
-- holder's token: the next rebalance epoch, only while the caller still
-- holds the lock (a holder that stalled past its lease gets none).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'LOCKLOST'} end
return {'OK', redis.call('INCR', KEYS[2])}
