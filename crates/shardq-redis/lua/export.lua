-- export.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] key, ARGV[6] export only ids above this (0: from the first),
-- ARGV[7] at most this many, ARGV[8] and no more once their records hold
-- this many bytes (at least one job). Reply: `OK`, `1` if the key may
-- have more (ARGV[7] jobs came back, or the byte budget ran out) else `0`
-- (none left above the last one: the caller needs no call to learn it),
-- then `id, record, reason` per job. Read-only.
local max, budget = tonumber(ARGV[7]), tonumber(ARGV[8])
local out, bytes = export_key(ARGV[5], tonumber(ARGV[6]), max, budget)
local more = 0
if #out / 3 >= max or bytes >= budget then more = 1 end
table.insert(out, 1, more)
table.insert(out, 1, 'OK')
return out
