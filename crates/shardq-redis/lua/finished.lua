-- finished.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] first, ARGV[6] last (from 0, newest first): the time now, then
-- those entries of the `finished` list (see `keep_finished`). The caller reads in
-- pages, so one call never copies the whole list.
local out = {now_ms()}
for _, e in ipairs(redis.call('LRANGE', KEYS[19], tonumber(ARGV[5]), tonumber(ARGV[6]))) do
  out[#out + 1] = e
end
return out
