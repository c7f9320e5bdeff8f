-- stats.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- Ready, delayed, in flight, dead, distinct keys, the last run fence.
local now = now_ms()
local pending = tonumber(redis.call('HGET', K_META, 'pend') or '0')
local delayed = redis.call('ZCOUNT', K_DELAYED, '(' .. idstr(now), '+inf')
local keys = redis.call('HLEN', K_KEYS) - redis.call('HEXISTS', K_KEYS, KEYS_PIN)
for _, k in ipairs(redis.call('HKEYS', K_DEADN)) do
  if redis.call('HEXISTS', K_KEYS, k) == 0 then keys = keys + 1 end
end
return {math.max(pending - delayed, 0), delayed, redis.call('ZCARD', K_INF), redis.call('ZCARD', K_DEAD), keys, redis.call('HGET', K_META, 'flast') or '0'}
