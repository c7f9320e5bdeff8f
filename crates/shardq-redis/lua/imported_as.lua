-- imported_as.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] the shard a job was copied from, ARGV[6] its id there: the id
-- of the copy this shard stored, if the `movedin` list (written by the
-- import) still holds it. Reply `OK` and the id, or `NONE`. Read-only;
-- reads the list a page at a time, newest first.
local K_MOVEDIN = KEYS[23]
local from = ARGV[5]
local id = tonumber(ARGV[6])
local head = '|' .. #from .. '|' .. from .. ','
local needle = ',' .. ARGV[6] .. ':'
local copy = history_find(K_MOVEDIN, function(e)
  local first, last, p = string.match(e, '^%d+|(%d+)|(%d+)()')
  if first and id >= tonumber(first) and id <= tonumber(last)
    and string.sub(e, p, p + #head - 1) == head then
    local at = string.find(e, needle, p + #head - 1, true)
    if at then return string.match(e, '^(%d+),', at + #needle) end
  end
  return nil
end)
if copy then return {'OK', copy} end
return {'NONE'}
