-- purge_key.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] key, ARGV[6] at most this many jobs per call: deletes the key's
-- jobs that are not running, waiting ones from the head, then (once none
-- waits) dead ones, read from the key's range of `deadk` (so a call reads
-- at most ARGV[6] of them, however many the shard's other keys hold).
-- Reply: `OK`, how many were deleted, `1` if some may be left (call
-- again). What a move left behind on the old shard of a sealed key, whose
-- list no longer changes.
local K_MOVED = KEYS[18]
local k, max = ARGV[5], tonumber(ARGV[6])
local q = kparse(redis.call('HGET', K_KEYS, k), k)
local gone = {}
while q.h ~= 0 and #gone < max do
  local ids = idstr(q.h)
  gone[#gone + 1] = ids
  q.h = tonumber(redis.call('HGET', K_NEXT, ids) or '0')
  q.d = q.d - 1
end
local n = #gone
for i = 1, n, 4000 do
  local j = math.min(i + 3999, n)
  redis.call('HDEL', K_JOBS, unpack(gone, i, j))
  redis.call('HDEL', K_NEXT, unpack(gone, i, j))
  forget(gone, i, j)
  redis.call('ZREM', K_DELAYED, unpack(gone, i, j))
end
if n > 0 then redis.call('HINCRBY', K_META, 'pend', -n) end
if q.h == 0 then
  q.t, q.d = 0, 0
  redis.call('ZREM', K_LATER, k)
end
kstore(k, q)
-- A full page of dead jobs may have more behind it.
local more_dead = false
if q.h == 0 and n < max then
  local want = max - n
  local dead = dead_of(k, 0, want)
  local m = #dead
  for i = 1, m, 4000 do
    local j = math.min(i + 3999, m)
    local members = {}
    for x = i, j do members[#members + 1] = deadk_of(k, dead[x]) end
    redis.call('ZREM', K_DEAD, unpack(dead, i, j))
    redis.call('ZREM', K_DEADK, unpack(members))
    redis.call('HDEL', K_JOBS, unpack(dead, i, j))
    forget(dead, i, j)
    for x = i, j do gone[#gone + 1] = dead[x] end
  end
  n = n + m
  more_dead = m == want
  -- The count follows the index: none left once a page comes back short.
  local left = 0
  if more_dead then left = math.max(tonumber(redis.call('HGET', K_DEADN, k) or '0') - m, 0) end
  if left > 0 then redis.call('HSET', K_DEADN, k, left) else redis.call('HDEL', K_DEADN, k) end
end
-- The ids deleted are remembered as moved away with the key (`moved`:
-- `<count>|<lowest id>|<highest id>|<key length>|<key>,<id>,...,` per
-- call), the oldest entries dropped past MOVED_KEYS_KEPT entries or
-- MOVED_IDS_KEPT ids (`movedn` in meta counts them).
if n > 0 then
  local lo, hi = math.huge, 0
  for _, ids in ipairs(gone) do
    local x = tonumber(ids)
    if x < lo then lo = x end
    if x > hi then hi = x end
  end
  local entry = n .. '|' .. idstr(lo) .. '|' .. idstr(hi) .. '|' .. #k .. '|' .. k .. ',' .. table.concat(gone, ',') .. ','
  history_push(K_MOVED, 'movedn', entry, n, MOVED_KEYS_KEPT, MOVED_IDS_KEPT)
end
local more = 0
if q.h ~= 0 or more_dead then more = 1 end
return {'OK', n, more}
