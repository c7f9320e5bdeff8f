-- layout_raise.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] a layout version: the shard's `layout` becomes it unless it is
-- already that or newer.
local now = tonumber(redis.call('HGET', K_META, 'layout') or '0')
if now < tonumber(ARGV[5]) then redis.call('HSET', K_META, 'layout', ARGV[5]) end
return {'OK'}
