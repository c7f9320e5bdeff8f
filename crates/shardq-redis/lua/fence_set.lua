-- fence_set.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] oldest map version accepted, ARGV[6] smallest run fence,
-- ARGV[7..] paused keys.
-- ARGV[5] map version floor, ARGV[6] run fence floor, ARGV[7] number of
-- paused keys, the paused keys, then `key, to` per sealed key. A key
-- sealed now leaves `later` (claim drops it from `ready`); a key unsealed
-- now with work waiting goes back to `ready` (claim takes each key once,
-- so one still there is harmless).
local now = now_ms()
redis.call('HSET', K_META, 'fmin', ARGV[5], 'ffloor', ARGV[6])
redis.call('DEL', K_PAUSED)
local np = tonumber(ARGV[7])
local keys = {}
for i = 8, 7 + np do keys[#keys + 1] = ARGV[i] end
if #keys > 0 then redis.call('SADD', K_PAUSED, unpack(keys)) end
local want = {}
for i = 8 + np, #ARGV, 2 do want[ARGV[i]] = ARGV[i + 1] end
local had = redis.call('HGETALL', K_SEALED)
for i = 1, #had, 2 do
  local k = had[i]
  if not want[k] then
    redis.call('HDEL', K_SEALED, k)
    kready(k, kparse(redis.call('HGET', K_KEYS, k), k), nil, now)
  end
end
for k, to in pairs(want) do
  redis.call('HSET', K_SEALED, k, to)
  redis.call('ZREM', K_LATER, k)
end
return {'OK'}
