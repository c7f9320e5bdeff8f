-- key_counts.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] routing key: depth, runs in flight, dead.
local k = ARGV[5]
local q = kparse(redis.call('HGET', K_KEYS, k), k)
return {q.d, q.n, tonumber(redis.call('HGET', K_DEADN, k) or '0')}
