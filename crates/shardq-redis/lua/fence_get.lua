-- fence_get.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
return {tonumber(redis.call('HGET', K_META, 'fmin') or '0'), redis.call('SMEMBERS', K_PAUSED), redis.call('HGET', K_META, 'ffloor') or '0', redis.call('HGETALL', K_SEALED)}
