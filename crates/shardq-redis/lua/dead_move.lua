-- dead_move.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] `retry` or `purge`, ARGV[6] `1` for the oldest ARGV[7] dead jobs,
-- else the ids in ARGV[8..]. Returns {moved, looked at}. A retried job goes
-- back to its place in key order (by id): the walk to it passes only the
-- key's waiting jobs with smaller ids, which are earlier retried dead jobs
-- or one reclaimed job, since every other waiting job was enqueued later.
local now = now_ms()
local ids
if ARGV[6] == '1' then
  local skip = tonumber(ARGV[8] or '0')
  ids = redis.call('ZRANGE', K_DEAD, skip, skip + tonumber(ARGV[7]) - 1)
else
  ids = {}
  for i = 8, #ARGV do ids[#ids + 1] = ARGV[i] end
end
local moved, touched, qs, startable = 0, {}, {}, {}
for _, id in ipairs(ids) do
  -- A dead job of a key sealed for a move stays as it is: its copy goes (or
  -- went) with the key, and a retry or purge here would be lost with the
  -- copies left behind.
  local r = redis.call('HGET', K_JOBS, id)
  if not r then
    -- No record (a foreign write): its key is unknown, it only leaves `dead`.
    redis.call('ZREM', K_DEAD, id)
  else
    local _, _, _, _, k = rec_parse(r)
    if redis.call('HEXISTS', K_SEALED, k) == 0 and redis.call('ZSCORE', K_DEAD, id) then
      local q = qs[k]
      if not q then
        -- Whether it may start is read before its dead count falls.
        q = kparse(redis.call('HGET', K_KEYS, k), k)
        qs[k] = q
        startable[k] = kqueued(k, q)
        touched[#touched + 1] = k
      end
      unbury(id, k)
      if ARGV[5] == 'retry' then
        redis.call('HSET', K_JOBS, id, rec_set(r, now, 0))
        local n = tonumber(id)
        local prev, at = 0, q.h
        while at ~= 0 and at < n do
          prev = at
          at = tonumber(redis.call('HGET', K_NEXT, idstr(at)) or '0')
        end
        if at ~= 0 then redis.call('HSET', K_NEXT, id, idstr(at)) else q.t = n end
        if prev ~= 0 then redis.call('HSET', K_NEXT, idstr(prev), id) else q.h = n end
        q.d = q.d + 1
        redis.call('HINCRBY', K_META, 'pend', 1)
      else
        redis.call('HDEL', K_JOBS, id)
      end
      forget({id})
      moved = moved + 1
    end
  end
end
for _, k in ipairs(touched) do
  local q = qs[k]
  kstore(k, q)
  if startable[k] then
    -- Already in ready or later; a retried head may start now.
    if redis.call('ZREM', K_LATER, k) == 1 then redis.call('RPUSH', K_READY, k) end
  else
    kready(k, q, nil, now)
  end
end
return {moved, #ids}
