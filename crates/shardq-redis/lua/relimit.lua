-- relimit.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5..] pairs of routing key and the most runs it may have at once
-- (its policy's concurrency, after a change of policies). Writes each limit
-- into its key's queue and schedules a key that may now start more. A key
-- with no queue (nothing waiting, nothing in flight) is left alone: a claim
-- reads its limit afresh.
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local n = 0
for i = 5, #ARGV - 1, 2 do
  local k, lim = ARGV[i], tonumber(ARGV[i + 1])
  local s = redis.call('HGET', K_KEYS, k)
  if s then
    local q = kparse(s, k)
    if q.lim ~= lim then
      local was = kqueued(k, q)
      q.lim = lim
      kstore(k, q)
      if not was and redis.call('HEXISTS', K_SEALED, k) ~= 1 then kready(k, q, nil, now) end
      n = n + 1
    end
  end
end
return {'OK', n}
