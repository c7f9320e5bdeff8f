-- dedup_import.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] record count n, then per record: field, job, expires_ms, shard.
-- Stores each record unless its field holds a live one (so a rerun
-- changes nothing); an expired one is skipped.
local now = now_ms()
local n = tonumber(ARGV[5])
for i = 0, n - 1 do
  local f, job, exp, sh = ARGV[6 + 4 * i], ARGV[7 + 4 * i], tonumber(ARGV[8 + 4 * i]), ARGV[9 + 4 * i]
  if exp > now then
    local r = redis.call('HGET', K_DEDUP, f)
    local live = false
    if r then
      local _, e = string.match(r, '^(%d+)|(%d+)|')
      live = tonumber(e) > now
    end
    if not live then
      redis.call('HSET', K_DEDUP, f, job .. '|' .. idstr(exp) .. '|' .. sh)
      redis.call('ZADD', K_DEDUPX, exp, f)
    end
  end
end
return {'OK'}
