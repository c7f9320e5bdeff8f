-- dedup_import.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] record count n (at most ENQUEUE_BATCH_MAX), then per record:
-- field, job, expires_ms, shard. Stores each record unless its field holds
-- a live one (so a rerun changes nothing); an expired one is skipped. The
-- records stored are indexed in `dedupm`, one mark per expiry among them
-- (records of one enqueue batch share theirs), after forgetting a bounded
-- number of expired marks as an enqueue does.
local now = now_ms()
dedup_forget(now)
local n = tonumber(ARGV[5])
local groups, exps = {}, {}
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
      local es = idstr(exp)
      redis.call('HSET', K_DEDUP, f, job .. '|' .. es .. '|' .. sh)
      if not groups[es] then
        groups[es] = {}
        exps[#exps + 1] = es
      end
      local g = groups[es]
      g[#g + 1] = f
    end
  end
end
for _, es in ipairs(exps) do dedup_mark('@' .. es, es, groups[es]) end
return {'OK'}
