-- moved_away.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] a job id: the key it moved away with, if the `moved` list
-- (written by the purge after a move) still holds it. Reply `OK` and the
-- key, or `NONE`. Read-only; reads the list a page at a time, newest first.
local K_MOVED = KEYS[18]
local needle = ',' .. ARGV[5] .. ','
local id = tonumber(ARGV[5])
local key = history_find(K_MOVED, function(e)
  local first, last, len, p = string.match(e, '^%d+|(%d+)|(%d+)|(%d+)|()')
  if len and id >= tonumber(first) and id <= tonumber(last) then
    local keyend = p + tonumber(len) - 1
    if string.find(e, needle, keyend + 1, true) then
      return string.sub(e, p, keyend)
    end
  end
  return nil
end)
if key then return {'OK', key} end
return {'NONE'}
