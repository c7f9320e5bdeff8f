-- peek_ready.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] how many, ARGV[6] reclaim batch. For a claim that ranks keys
-- itself: first puts back runs whose lease ended (as a claim does, so a
-- key they free is seen), then replies {'OK', now, the first keys of the
-- ready list, the keys whose wait is over}, each list at most that many.
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local bad = nil
for _, ids in ipairs(redis.call('ZRANGEBYSCORE', K_INF, '-inf', now, 'LIMIT', 0, tonumber(ARGV[6]))) do
  local e = requeue_or_park(ids, 'job lease expired', now)
  bad = bad or e
end
if bad then error(bad) end
local n = tonumber(ARGV[5])
return {'OK', now, redis.call('LRANGE', K_READY, 0, n - 1), redis.call('ZRANGEBYSCORE', K_LATER, '-inf', now, 'LIMIT', 0, n)}
