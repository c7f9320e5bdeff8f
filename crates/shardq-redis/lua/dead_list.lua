-- dead_list.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] limit: id, attempts, key, reason per dead job, oldest first.
local out = {}
for _, id in ipairs(redis.call('ZRANGE', K_DEAD, 0, tonumber(ARGV[5]) - 1)) do
  local r = redis.call('HGET', K_JOBS, id)
  if r then
    local _, a, _, _, k = rec_parse(r)
    out[#out + 1] = id
    out[#out + 1] = a
    out[#out + 1] = k
    out[#out + 1] = redis.call('HGET', K_REASON, id) or ''
    out[#out + 1] = starts_of(id)
  end
end
return out
