-- imported_as.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] the shard a job was copied from, ARGV[6] its id there: the id
-- of the copy this shard stored, while the `movedin` list (written by the
-- import) still holds it: its index in `imported`. Reply `OK` and the
-- id, or `NONE`. Read-only.
-- One read of the index import.lua keeps beside the `movedin` list.
local copy = redis.call('HGET', K_IMPORTED, '#' .. #ARGV[5] .. '|' .. ARGV[5] .. ARGV[6])
if copy then return {'OK', copy} end
return {'NONE'}
