-- ack.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5..] quintuples of job id, run fence, routing key, the attempt the
-- run is (the claim's record count + 1; key and attempt empty when the
-- caller does not know them: the job's record tells) and the handler's
-- result (empty: none; else `+` and its bytes, kept in the finished entry). Acks the receipts
-- that name their job's current run; replies {'OK', id, fence, why, ...}
-- for the others.
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local out = {'OK'}
local acked, fences, dkeys, datt, dres, freed = {}, {}, {}, {}, {}, {}
-- One read for every receipt's job lease and one for their keys' queues.
-- The queues change in memory (a repeated receipt finds its run gone, so it
-- is stale) and are written once at the end, or before a lapsed run goes
-- back to its key (requeue reads and writes the key itself).
local rids, rkeys, klist, qs, dirty = {}, {}, {}, {}, {}
for i = 5, #ARGV - 4, 5 do
  local ids = ARGV[i]
  local k = key_of(ids, ARGV[i + 2])
  rids[#rids + 1] = ids
  rkeys[#rkeys + 1] = k
  if k ~= '' and not qs[k] then
    qs[k] = true
    klist[#klist + 1] = k
  end
end
local leases = {}
if #rids > 0 then leases = redis.call('ZMSCORE', K_INF, unpack(rids)) end
if #klist > 0 then
  for x, r in ipairs(redis.call('HMGET', K_KEYS, unpack(klist))) do qs[klist[x]] = kparse(r or nil, klist[x]) end
end
for x, ids in ipairs(rids) do
  local i = 5 * x
  local fence, k = ARGV[i + 1], rkeys[x]
  local q = nil
  if k ~= '' then
    q = qs[k]
    if not q then
      q = kparse(redis.call('HGET', K_KEYS, k), k)
      qs[k] = q
    end
  end
  local lapsed = q and tonumber(leases[x] or '0') <= now
  if lapsed and dirty[k] then
    kstore(k, q)
    dirty[k] = nil
  end
  local why = run_check(ids, fence, k, q, now, leases[x])
  if why then
    -- A lapsed run was put back: the key's queue changed under us.
    if lapsed then qs[k] = nil end
    out[#out + 1] = ids
    out[#out + 1] = fence
    out[#out + 1] = why
  else
    local was = kqueued(k, q)
    krun_end(q, krun(q, tonumber(ids)))
    acked[#acked + 1] = ids
    fences[#acked] = fence
    dkeys[#acked] = k
    if ARGV[i + 3] ~= '' then datt[#acked] = ARGV[i + 3] end
    if ARGV[i + 4] ~= '' then dres[#acked] = string.sub(ARGV[i + 4], 2) end
    dirty[k] = true
    -- Claim checks the next head's start time.
    if not was and kqueued(k, q) then freed[#freed + 1] = k end
  end
end
local put, del = {}, {}
for k in pairs(dirty) do
  local q = qs[k]
  if q.d == 0 and q.n == 0 then
    del[#del + 1] = k
  else
    put[#put + 1] = k
    put[#put + 1] = kfmt(q)
  end
end
if #put > 0 then redis.call('HSET', K_KEYS, unpack(put)) end
if #del > 0 then redis.call('HDEL', K_KEYS, unpack(del)) end
-- The acked jobs leave in one call per structure (the batch is bounded).
if #acked > 0 then
  if finished_max() > 0 then
    -- Two reads for the whole batch at most: the records of runs whose
    -- attempt the caller did not know, then reasons and start times when
    -- any job has one (see `forget`).
    local unknown = {}
    for x = 1, #acked do
      if not datt[x] then unknown[#unknown + 1] = x end
    end
    if #unknown > 0 then
      local want = {}
      for y, x in ipairs(unknown) do want[y] = acked[x] end
      for y, r in ipairs(redis.call('HMGET', K_JOBS, unpack(want))) do
        local _, a = rec_parse(r)
        datt[unknown[y]] = a + 1
      end
    end
    local rs = nil
    if redis.call('EXISTS', K_REASON) == 1 then
      local f = {}
      for x = 1, #acked do
        f[#f + 1] = acked[x]
        f[#f + 1] = acked[x] .. '@'
        f[#f + 1] = acked[x] .. '^'
      end
      rs = redis.call('HMGET', K_REASON, unpack(f))
    end
    local entries = {}
    local nows = idstr(now)
    -- Pushed in ack order: the last one acked ends at the head.
    for x = 1, #acked do
      local why, starts, explicit = nil, '', false
      if rs then why, starts, explicit = rs[3 * x - 2], rs[3 * x - 1] or '', rs[3 * x] end
      starts = with_start(starts, run_start(acked[x], fences[x], now, explicit))
      entries[#entries + 1] = finished_line(acked[x], dkeys[x], 'c', datt[x], nows, starts, why, dres[x])
    end
    keep_finished(entries)
  end
  redis.call('ZREM', K_INF, unpack(acked))
  -- Keyed jobs leave `keyed` (read only on a shard that holds any).
  if redis.call('EXISTS', K_KEYED) == 1 then
    for x, r in ipairs(redis.call('HMGET', K_JOBS, unpack(acked))) do
      if r then unkey(acked[x], r) end
    end
  end
  redis.call('HDEL', K_JOBS, unpack(acked))
  forget(acked)
end
if #freed > 0 then redis.call('RPUSH', K_READY, unpack(freed)) end
return out
