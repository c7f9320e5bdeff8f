-- export.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] key, ARGV[6] export only ids above this (0: from the first),
-- ARGV[7] at most this many, ARGV[8] and no more once their records hold
-- this many bytes (at least one job). Reply: `OK`, then `id, record,
-- reason` per job. Read-only.
local out = export_key(ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]))
table.insert(out, 1, 'OK')
return out
