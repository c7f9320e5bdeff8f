-- freeze.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] number of keys, then `key, after` per key (`after` 0: none
-- taken yet). Freezes each key sealed here with no job above `after` that
-- is not running: adds it to the paused set, which for a sealed key means
-- frozen (enqueues answer `MOVED`). Reply: `OK`, then the keys frozen.
local n = tonumber(ARGV[5])
local out = {'OK'}
for i = 0, n - 1 do
  local k = ARGV[6 + 2 * i]
  if redis.call('HEXISTS', K_SEALED, k) == 1 then
    local jobs = export_key(k, tonumber(ARGV[7 + 2 * i]), 1, 1)
    if #jobs == 0 then
      redis.call('SADD', K_PAUSED, k)
      out[#out + 1] = k
    end
  end
end
return out
