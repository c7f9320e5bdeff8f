-- extend.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] job lease ms, ARGV[6..] triples of id, fence, routing key.
-- Moves the lease deadline of live runs to now + lease; replies
-- {'OK', deadline, id, fence, why, ...} for the stale ones.
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local deadline = now + tonumber(ARGV[5])
local out = {'OK', deadline}
for i = 6, #ARGV - 2, 3 do
  local ids, fence = ARGV[i], ARGV[i + 1]
  local k = key_of(ids, ARGV[i + 2])
  local q = nil
  if k ~= '' then q = kparse(redis.call('HGET', K_KEYS, k), k) end
  local why = run_check(ids, fence, k, q, now)
  if why then
    out[#out + 1] = ids
    out[#out + 1] = fence
    out[#out + 1] = why
  else
    redis.call('ZADD', K_INF, 'XX', deadline, ids)
  end
end
return out
