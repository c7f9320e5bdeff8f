-- imported_up_to.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] from, ARGV[6] key: the key's import cursor from that shard
-- (`OK`, the largest source id taken, 0 for none). Read-only.
return {'OK', redis.call('HGET', K_IMPORTED, #ARGV[5] .. '|' .. ARGV[5] .. ARGV[6]) or '0'}
