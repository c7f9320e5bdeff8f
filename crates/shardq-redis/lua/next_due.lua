-- next_due.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- The earliest time work may start: now when a key is ready, else the
-- earlier of the first waiting head's not-before and the first job lease
-- to end (a run in flight lapses back into work unless acked or failed);
-- nil when nothing waits and nothing is in flight.
if redis.call('LLEN', K_READY) > 0 then return now_ms() end
local due = false
local r = redis.call('ZRANGE', K_LATER, 0, 0, 'WITHSCORES')
if r[1] then due = tonumber(r[2]) end
local f = redis.call('ZRANGE', K_INF, 0, 0, 'WITHSCORES')
if f[1] and (not due or tonumber(f[2]) < due) then due = tonumber(f[2]) end
return due
