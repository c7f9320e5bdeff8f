-- runs_stale.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5..] triples of id, fence, routing key (empty: read from the job).
-- Which of these runs are no longer current: ended, followed by another
-- run, or asked to stop by a cancel (their fence cleared, cancel.lua).
-- Replies {'OK', id, fence, ...} for those. Read-only: a lapsed run is
-- still current here (the claim or extend that meets it requeues it).
local out = {'OK'}
for i = 5, #ARGV - 2, 3 do
  local ids, fence = ARGV[i], ARGV[i + 1]
  local k = key_of(ids, ARGV[i + 2])
  local run, cur = nil, nil
  if k ~= '' then
    local q = kparse(redis.call('HGET', K_KEYS, k), k)
    run = krun(q, tonumber(ids))
    if run then cur = q.runs[run + 1] end
  end
  if not run or cur == 0 or cur ~= tonumber(fence) then
    out[#out + 1] = ids
    out[#out + 1] = fence
  end
end
return out
