-- job_show.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] id: job_get.lua's `live` of one job.
local row = live(ARGV[5])
if not row then return {'NONE'} end
return row
