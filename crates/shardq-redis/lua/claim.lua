-- claim.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] max jobs, ARGV[6] job lease ms, ARGV[7] reclaim batch, ARGV[8]
-- the version of the run limits the caller uses (empty: one run per key;
-- else they are read from the shard's `limits` copy, see `LIMITS` below),
-- ARGV[9] `-` to take keys in the shard's own order, else the number P of
-- keys the caller ranked (flow control's weights and priorities), which
-- follow in ARGV[10..9+P] and are the only ones taken (each only while
-- ready or due); then `1` when an earlier attempt's reply was lost, then
-- the ids the caller holds: in-flight jobs it does not know are put back.
-- Replies {'LIMITS', the version found} and changes nothing when the
-- shard's copy of the limits is not that version (the caller writes it,
-- `limits_put.lua`, and claims again); else 'OK', the lease deadline, the
-- shard's job-id sequence (`meta.seq`),
-- then id, record, fence per job (a key's jobs in job order, keys
-- interleaved as their turns came); the attempt
-- being made is the record's count + 1. Each run's fence is
-- `next_fence(now_us, last, floor)` (`shardq_core::next_fence`), the last
-- kept in `meta.flast`. A key below its limit starts one job per turn:
-- every key taken gets a turn before any gets a second, and a key still
-- below its limit with work waiting goes back to the end of `ready` (or
-- to `later` when its head must wait).
if not owns() then return {'NOTOWNER'} end
-- One reading of the server's clock for the time and the fences.
local us = now_us()
local now = math.floor(us / 1000)
if ARGV[1] ~= '' then now = tonumber(ARGV[1]) end
-- The job-id sequence, for the caller's check that the store did not go
-- back in time (a lagging replica promoted, an older snapshot restored).
local seq = redis.call('HGET', K_META, 'seq') or '0'
-- LIMITS: a key's run limit is its own entry `=<key>` in `limits`, else
-- that of its longest prefix with an entry `^<prefix>`, else the default
-- (`\0d`). Only the prefix lengths some prefix has (byte n of `\0l` is `1`)
-- are looked up, so a key taken costs at most 1 + its length in fields
-- (keys are at most KEY_BYTES_MAX = 1024 bytes), whatever the number of
-- policies, and a key no policy names reads one field per prefix length in
-- use. The copy must be the caller's version: the first reads of the
-- claim, before any write.
local several = ARGV[8] ~= ''
local lim_default, lim_lens = 1, ''
if several then
  local m = redis.call('HMGET', K_LIMITS, LIM_VERSION, LIM_DEFAULT, LIM_LENGTHS)
  if m[1] ~= ARGV[8] then return {'LIMITS', m[1] or ''} end
  lim_default = tonumber(m[2]) or 1
  lim_lens = m[3] or ''
end
-- The run limits of keys ks, in order (HMGET in calls of at most
-- LIM_FIELDS_PER_CALL fields: unpack's bound).
local LIM_FIELDS_PER_CALL = 4096
local function limits_of(ks)
  local out = {}
  if not several then
    for i = 1, #ks do out[i] = 1 end
    return out
  end
  local fields, first = {}, {}
  for i, k in ipairs(ks) do
    first[i] = #fields + 1
    fields[#fields + 1] = '=' .. k
    for n = math.min(#k, #lim_lens), 1, -1 do
      if string.byte(lim_lens, n) == 49 then fields[#fields + 1] = '^' .. string.sub(k, 1, n) end
    end
  end
  first[#ks + 1] = #fields + 1
  local got = {}
  for i = 1, #fields, LIM_FIELDS_PER_CALL do
    local part = redis.call('HMGET', K_LIMITS, unpack(fields, i, math.min(i + LIM_FIELDS_PER_CALL - 1, #fields)))
    for j = 1, #part do got[i + j - 1] = part[j] end
  end
  for i = 1, #ks do
    local lim = lim_default
    for j = first[i], first[i + 1] - 1 do
      if got[j] then
        lim = tonumber(got[j]) or lim_default
        break
      end
    end
    out[i] = lim
  end
  return out
end
local ranked = ARGV[9] ~= '-'
local bad = nil
local lost_at = 10
if ranked then lost_at = 10 + tonumber(ARGV[9]) end
if ARGV[lost_at] == '1' then
  local known = {}
  for i = lost_at + 1, #ARGV do known[ARGV[i]] = true end
  for _, ids in ipairs(redis.call('ZRANGE', K_INF, 0, -1)) do
    if not known[ids] then
      local e = requeue_or_park(ids, 'claim reply lost', now)
      bad = bad or e
    end
  end
end
for _, ids in ipairs(redis.call('ZRANGEBYSCORE', K_INF, '-inf', now, 'LIMIT', 0, tonumber(ARGV[7]))) do
  local e = requeue_or_park(ids, 'job lease expired', now)
  bad = bad or e
end
-- A corrupt record among them refuses this claim by name (the others went
-- back; it is parked, so the next claims go on).
if bad then error(bad) end
local max = tonumber(ARGV[5])
local deadline = now + tonumber(ARGV[6])
-- Keys whose wait is over first, then keys in the order they became ready;
-- while keys are ready, waited-out keys take at most half the claim (a key
-- over its flow-control limit comes back here when its token is due, and
-- many of them must not crowd out the ready keys; with one to claim, the
-- clock's parity decides).
local keys = {}
if ranked then
  -- The caller's choice, in its order: each key only if it is ready (out
  -- of the ready list) or its wait is over (out of later).
  for i = 10, lost_at - 1 do
    local k = ARGV[i]
    if #keys < max then
      if redis.call('LREM', K_READY, 1, k) > 0 then
        keys[#keys + 1] = k
      else
        local at = redis.call('ZSCORE', K_LATER, k)
        if at and tonumber(at) <= now then
          redis.call('ZREM', K_LATER, k)
          keys[#keys + 1] = k
        end
      end
    end
  end
else
  local later_max = max
  if redis.call('LLEN', K_READY) > 0 then
    later_max = math.floor(max / 2)
    if max % 2 == 1 and now % 2 == 0 then later_max = later_max + 1 end
  end
  if later_max > 0 then
    keys = redis.call('ZRANGEBYSCORE', K_LATER, '-inf', now, 'LIMIT', 0, later_max)
  end
  if #keys > 0 then redis.call('ZREM', K_LATER, unpack(keys)) end
  if #keys < max then
    local more = redis.call('LPOP', K_READY, max - #keys)
    if more then
      for _, k in ipairs(more) do keys[#keys + 1] = k end
    end
  end
end
-- Each key once (an unsealed key may still sit in ready from before its
-- seal), and no sealed key: it is dropped here and its unseal puts it back.
local sealed_any = redis.call('HLEN', K_SEALED) > 0
local seen, uniq = {}, {}
for _, k in ipairs(keys) do
  if not seen[k] then
    seen[k] = true
    if not (sealed_any and redis.call('HEXISTS', K_SEALED, k) == 1) then uniq[#uniq + 1] = k end
  end
end
keys = uniq
if #keys == 0 then return {'OK', deadline, seq} end
local cur = redis.call('HMGET', K_KEYS, unpack(keys))
-- A corrupt record refuses the claim, and the keys it took go back to
-- ready first (a script's writes before an error stay).
local function refuse(e, k)
  local back = {}
  for _, x in ipairs(keys) do
    if x ~= k then back[#back + 1] = x end
  end
  if #back > 0 then redis.call('RPUSH', K_READY, unpack(back)) end
  -- The corrupt one is parked, so the shard's other keys run meanwhile.
  redis.call('ZADD', K_LATER, now + CORRUPT_PARK_MS, k)
  error(e)
end
-- A key taken is a candidate while a job waits, its runs are below its
-- limit (read afresh from its policy) and no dead job halts it; the others
-- were stale entries. A changed limit is written back either way, so the
-- scripts that end runs judge by it.
local cand, qs, heads, kq = {}, {}, {}, {}
local lims = limits_of(keys)
for i, k in ipairs(keys) do
  local ok, q = pcall(kparse, cur[i], k)
  if not ok then refuse(q, k) end
  local lim = lims[i]
  if cur[i] and lim ~= q.lim then
    q.lim = lim
    kq[k] = q
  end
  if q.d > 0 and q.h ~= 0 and q.n < lim and not halted(k) then
    cand[#cand + 1] = k
    qs[#qs + 1] = q
    heads[#heads + 1] = idstr(q.h)
  end
end
local out, inf, unlink, later, ids = {'OK', deadline, seq}, {}, {}, {}, {}
local deadlines = idstr(deadline)
local rs, nx = {}, {}
if #cand > 0 then
  rs = redis.call('HMGET', K_JOBS, unpack(heads))
  nx = redis.call('HMGET', K_NEXT, unpack(heads))
  for i, r in ipairs(rs) do
    if r then
      local ok, e = pcall(rec_check, r)
      if ok and nx[i] and not string.match(nx[i], '^%d+$') then
        ok, e = pcall(corrupt, 'the next job after ' .. heads[i], nx[i])
      end
      if not ok then refuse(e, cand[i]) end
    end
  end
end
local last = tonumber(redis.call('HGET', K_META, 'flast') or '0')
local floor = tonumber(redis.call('HGET', K_META, 'ffloor') or '0')
-- Starts the head of candidate i (record r, next id nx): false when the
-- head must wait (the key goes to later) or is gone (the key is dropped, as
-- a key whose record is missing always was).
local gone, starts = {}, {}
local function start(i, r, nxs, id)
  local k, q = cand[i], qs[i]
  if not r then
    gone[k] = true
    return false
  end
  local nbf = rec_nbf(r)
  if nbf > now then
    later[#later + 1] = nbf
    later[#later + 1] = k
    return false
  end
  local n = q.h
  id = id or idstr(n)
  if nxs then
    q.h = tonumber(nxs)
    if not q.h then corrupt('the next job after ' .. id, nxs) end
    unlink[#unlink + 1] = id
  else
    q.h, q.t = 0, 0
  end
  q.d = q.d - 1
  last = math.max(us, last + 1, floor)
  krun_add(q, n, last)
  kq[k] = q
  inf[#inf + 1] = deadlines
  inf[#inf + 1] = id
  ids[#ids + 1] = id
  if ARGV[1] ~= '' or last >= us + 1000 then
    -- The fence does not tell the start time (see `run_start`).
    starts[#starts + 1] = id .. '^'
    starts[#starts + 1] = idstr(last) .. ':' .. idstr(now)
  end
  out[#out + 1] = id
  out[#out + 1] = r
  -- A number replies as an integer (exact: fences stay below 2^53).
  out[#out + 1] = last
  return true
end
-- Turns: every candidate's head first (read in one call), then, when some
-- key may run more than one job, one more job of each key still below its
-- limit per round, until the claim is full.
local live = {}
for i = 1, #cand do
  if #ids < max and start(i, rs[i], nx[i], heads[i]) and several then live[#live + 1] = i end
end
while #ids < max and #live > 0 do
  local next_live = {}
  for _, i in ipairs(live) do
    local q = qs[i]
    if #ids < max and q.h ~= 0 and q.n < q.lim then
      local id = idstr(q.h)
      local ok, started = pcall(start, i, redis.call('HGET', K_JOBS, id), redis.call('HGET', K_NEXT, id), id)
      if not ok then refuse(started, cand[i]) end
      if started then next_live[#next_live + 1] = i end
    end
  end
  live = next_live
end
-- A candidate whose head did not go to later and that may start more goes
-- back to the end of ready (with one run per key, none may).
local again = {}
if several then
  local waits = {}
  for x = 2, #later, 2 do waits[later[x]] = true end
  for i, k in ipairs(cand) do
    local q = qs[i]
    if not waits[k] and not gone[k] and q.d > 0 and q.n < q.lim then again[#again + 1] = k end
  end
end
if #later > 0 then redis.call('ZADD', K_LATER, unpack(later)) end
if #again > 0 then redis.call('RPUSH', K_READY, unpack(again)) end
local kw = {}
for k, q in pairs(kq) do
  kw[#kw + 1] = k
  kw[#kw + 1] = kfmt(q)
end
if #kw > 0 then redis.call('HSET', K_KEYS, unpack(kw)) end
if #ids == 0 then return out end
redis.call('HSET', K_META, 'flast', idstr(last))
if #unlink > 0 then redis.call('HDEL', K_NEXT, unpack(unlink)) end
if #starts > 0 then redis.call('HSET', K_REASON, unpack(starts)) end
redis.call('ZADD', K_INF, unpack(inf))
redis.call('HINCRBY', K_META, 'pend', -#ids)
if redis.call('EXISTS', K_DELAYED) == 1 then redis.call('ZREM', K_DELAYED, unpack(ids)) end
return out
