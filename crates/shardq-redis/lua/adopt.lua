-- adopt.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- Puts every in-flight job back (a previous owner's), under the new token.
-- ARGV[5] and ARGV[6] the finished jobs kept (count, age ms), ARGV[7] the
-- `keys` hash's pin (`keys_pin_value`), written when missing.
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
redis.call('HSET', K_META, 'finishedmax', ARGV[5], 'finishedage', ARGV[6])
if ARGV[5] == '0' then redis.call('DEL', KEYS[19]) end
-- A `keys` hash without its pin (lost with the hash) gets it back.
if redis.call('HGET', K_KEYS, KEYS_PIN) ~= ARGV[7] then redis.call('HSET', K_KEYS, KEYS_PIN, ARGV[7]) end
local ids = redis.call('ZRANGE', K_INF, 0, -1)
-- A corrupt record parks its run: the next claims report it.
for _, id in ipairs(ids) do requeue_or_park(id, 'owner lost', now) end
return {'OK', #ids}
