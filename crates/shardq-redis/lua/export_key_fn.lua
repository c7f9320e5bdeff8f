-- export_key_fn.lua: a library, put before the scripts that use it.
-- The export of one key, shared by export.lua and export_many.lua: the
-- key's jobs that are not running, dead or waiting, in id order (reason
-- empty for a waiting job). Only for a sealed key, whose list then only
-- grows at its tail (its ids ascend along it): the walk goes on from the
-- last id exported when that one still waits.
-- Up to max of key k's jobs above id after, dead or waiting, in id order,
-- stopping once their records hold budget bytes: a flat list of
-- `id, record, reason`, and the bytes it holds. The dead ones come from
-- the key's own range of `deadk` (at most max entries read, whatever the
-- shard's other keys hold), the waiting ones from its list (at most max).
local function export_key(k, after, max, budget)
  local dead = {}
  if tonumber(redis.call('HGET', K_DEADN, k) or '0') > 0 then
    local ids = dead_of(k, after, max)
    if #ids > 0 then
      local recs = redis.call('HMGET', K_JOBS, unpack(ids))
      local whys = redis.call('HMGET', K_REASON, unpack(ids))
      for x, ids_x in ipairs(ids) do
        if recs[x] then dead[#dead + 1] = {tonumber(ids_x), recs[x], whys[x] or 'dead'} end
      end
    end
  end
  local waiting = {}
  local q = kparse(redis.call('HGET', K_KEYS, k), k)
  local id = q.h
  if after > 0 and q.h ~= 0 and after >= q.h then
    local nx = redis.call('HGET', K_NEXT, idstr(after))
    if nx then
      id = tonumber(nx)
    elseif after == q.t then
      id = 0
    end
  end
  local wids = {}
  while id ~= 0 and #wids < max do
    local ids = idstr(id)
    if id > after then wids[#wids + 1] = ids end
    id = tonumber(redis.call('HGET', K_NEXT, ids) or '0')
  end
  if #wids > 0 then
    local recs = redis.call('HMGET', K_JOBS, unpack(wids))
    for i, ids in ipairs(wids) do waiting[i] = {tonumber(ids), recs[i] or '', ''} end
  end
  local out = {}
  local i, j = 1, 1
  local bytes = 0
  while (i <= #dead or j <= #waiting) and #out / 3 < max and bytes < budget do
    local d, w = dead[i], waiting[j]
    local pick
    if d and (not w or d[1] < w[1]) then pick = d; i = i + 1 else pick = w; j = j + 1 end
    out[#out + 1] = idstr(pick[1])
    out[#out + 1] = pick[2]
    out[#out + 1] = pick[3]
    bytes = bytes + #pick[2]
  end
  return out, bytes
end
