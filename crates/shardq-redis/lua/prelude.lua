-- prelude.lua: a library, put before the scripts that use it.
-- Helpers shared by the shard scripts.
local K_META, K_JOBS, K_KEYS, K_NEXT, K_READY, K_LATER, K_INF = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local K_DEAD, K_DEADN, K_DELAYED, K_PAUSED, K_LEASE, K_REASON = KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local K_DEDUP, K_DEDUPM, K_SEALED, K_IMPORTED = KEYS[14], KEYS[15], KEYS[16], KEYS[17]
-- The shard's copy of the flow settings' run limits (`limits`, see keys.rs):
-- `=<key>` and `^<prefix>` entries, and its version, default limit and
-- prefix lengths under fields no routing key can name.
local K_LIMITS = KEYS[20]
local LIM_VERSION, LIM_DEFAULT, LIM_LENGTHS = string.char(0) .. 'v', string.char(0) .. 'd', string.char(0) .. 'l'
-- The dead jobs by key (`deadk`, see keys.rs): `<key>` NUL `<id>` with the
-- id zero-padded to DEADK_ID_DIGITS digits, all at score 0, so one key's
-- dead jobs above an id are one ZRANGEBYLEX, in id order. A routing key
-- holds no NUL byte (enqueue.lua refuses one), so the range of key k holds
-- k's members only. `dead`, `deadn` and `deadk` change together: through
-- `bury` and `unbury` below, and in purge_key.lua.
local K_DEADK = KEYS[21]
-- Keyed jobs (unique, debounced; see keys.rs): `<key len>|<key><id>` ->
-- the newest job stored with that id, met by a keyed enqueue while it
-- lives (checked there: an entry may outlive its job).
local K_KEYED = KEYS[22]
local DEADK_ID_DIGITS = 16
local DEADK_SEP, DEADK_END = string.char(0), string.char(1)
-- Expired marks of `dedupm` forgotten per enqueue and per dedup import, at
-- most: two, so the index shrinks faster than one enqueue grows it (a mark
-- names at most one call's records, ENQUEUE_BATCH_MAX).
local DEDUP_FORGET_MARKS = 2
-- The `keys` hash's one field that names no routing key (keys hold no
-- control characters); see `keys_pin_value` in scripts.rs.
local KEYS_PIN = string.char(0)
local HALT = ARGV[3] == '1'
local DEP = redis.call('HGET', K_META, 'dep')
if DEP ~= ARGV[4] then return {'LOST', DEP or ''} end
local function now_ms()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Server time in microseconds: below 2^53, exact in a Lua number.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function owns() return redis.call('HGET', K_LEASE, 'token') == ARGV[2] end
local function idstr(n) return string.format('%d', n) end
-- The text of small numbers (key lengths, attempt counts), each formatted
-- once per call: a script formats them for every job it writes.
local NSTR = {}
local function nstr(n)
  local s = NSTR[n]
  if not s then
    s = idstr(n)
    NSTR[n] = s
  end
  return s
end
-- A record that is not this grammar (a flipped byte, a foreign write) is
-- refused with an error `CORRUPT record: ...` naming the key and the
-- record (Redis may put the script's line before it).
local function corrupt(what, s)
  local shown = string.gsub(string.sub(s, 1, 64), '[^%w%p ]', '?')
  error({err = 'CORRUPT record: ' .. what .. ' is malformed: "' .. shown .. '"'})
end
-- The dedup field of (key, id): the key's length, then key and id.
local function dfield(k, d) return nstr(#k) .. '|' .. k .. d end
-- Dedup records expire through `dedupm` (keys.rs): one mark per group of
-- records written with one expiry, scored by it: `head` (`#<first job id>`
-- for an enqueue batch, `@<expiry>` for a group of one import call), then
-- the fields, one a line (no key or dedup id holds a control character).
local DEDUP_NL = string.char(10)
local function dedup_mark(head, exp, fields)
  redis.call('ZADD', K_DEDUPM, exp, head .. DEDUP_NL .. table.concat(fields, DEDUP_NL))
end
-- Forgets up to DEDUP_FORGET_MARKS marks expired at now, deleting each
-- record one names only when the record itself has expired: a field stored
-- again since keeps its new record, which a later mark names.
local function dedup_forget(now)
  for _, mark in ipairs(redis.call('ZRANGEBYSCORE', K_DEDUPM, '-inf', now, 'LIMIT', 0, DEDUP_FORGET_MARKS)) do
    local fl = {}
    for f in string.gmatch(mark, '[^' .. DEDUP_NL .. ']+') do fl[#fl + 1] = f end
    table.remove(fl, 1)
    if #fl > 0 then
      local gone = {}
      for x, r in ipairs(redis.call('HMGET', K_DEDUP, unpack(fl))) do
        if r and tonumber(string.match(r, '^%d+|(%d+)|') or '0') <= now then gone[#gone + 1] = fl[x] end
      end
      if #gone > 0 then redis.call('HDEL', K_DEDUP, unpack(gone)) end
    end
    redis.call('ZREM', K_DEDUPM, mark)
  end
end
-- A rebalance's writes carry its epoch as the token, `@N`: refused once
-- this shard has seen a newer rebalance's (which took over the lock while
-- this one stalled); the newest seen is meta `repoch`.
if string.sub(ARGV[2], 1, 1) == '@' then
  local e = tonumber(string.sub(ARGV[2], 2)) or 0
  local seen = tonumber(redis.call('HGET', K_META, 'repoch') or '0')
  if e < seen then return {'SUPERSEDED', idstr(seen)} end
  if e > seen then redis.call('HSET', K_META, 'repoch', idstr(e)) end
end
-- A job record: not_before|attempts|max_attempts|created|key length|dedup
-- id length|key dedup-id payload.
local function rec_parse(r)
  local n, a, m, c, kl, dl, p = string.match(r, '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|()')
  if not n then corrupt('a job record', r) end
  kl, dl = tonumber(kl), tonumber(dl)
  if p + kl + dl - 1 > #r then corrupt('a job record', r) end
  return tonumber(n), tonumber(a), tonumber(m), tonumber(c), string.sub(r, p, p + kl - 1),
    string.sub(r, p + kl, p + kl + dl - 1)
end
local function rec_nbf(r)
  local n = string.match(r, '^(%d+)|')
  if not n then corrupt('a job record', r) end
  return tonumber(n)
end
-- The whole grammar of a job record (its numbers and that its key fits),
-- before a claim hands it out: the worker refuses a malformed one.
local function rec_check(r)
  local kl, dl, p = string.match(r, '^%d+|%d+|%d+|%d+|(%d+)|(%d+)|()')
  if not kl or p + tonumber(kl) + tonumber(dl) - 1 > #r then corrupt('a job record', r) end
end
-- The live job a keyed enqueue meets for field kf (`dfield(key, id)`): its
-- id and whether it runs; nil when the entry names a job that ended or
-- died.
local function keyed_live(kf)
  local e = redis.call('HGET', K_KEYED, kf)
  if not e then return nil end
  if redis.call('HEXISTS', K_JOBS, e) == 0 or redis.call('ZSCORE', K_DEAD, e) then return nil end
  return e, redis.call('ZSCORE', K_INF, e) ~= false
end
-- Job ids (a job that ended, record r) leaves `keyed` when it is the
-- entry of its id.
local function unkey(ids, r)
  local _, _, _, _, k, d = rec_parse(r)
  if d == '' or not (string.sub(d, 1, 7) == 'unique:' or string.sub(d, 1, 9) == 'debounce:') then return end
  local f = dfield(k, d)
  if redis.call('HGET', K_KEYED, f) == ids then redis.call('HDEL', K_KEYED, f) end
end
-- The record with a new not-before and attempt count; the rest kept.
local function rec_set(r, n, a)
  local p = string.match(r, '^%d+|%d+|()')
  return idstr(n) .. '|' .. idstr(a) .. '|' .. string.sub(r, p)
end
-- A key's queue: `<head> <tail> <depth>`, then its runs in flight as
-- `<job> <fence>` pairs in job order (`0 0` for none; fence 0: cancelled
-- while it ran), then, when above 1, how many runs it may have at once (its
-- policy's concurrency when a claim last looked). In q: h, t, d, n (the
-- number of runs), runs (nil for none, else job, fence, job, fence, ...)
-- and lim.
local function kparse(s, k)
  if not s then return {h = 0, t = 0, d = 0, n = 0, lim = 1} end
  local h, t, d, f, r = string.match(s, '^(%d+) (%d+) (%d+) (%d+) (%d+)$')
  if h then
    if f == '0' then return {h = tonumber(h), t = tonumber(t), d = tonumber(d), n = 0, lim = 1} end
    return {h = tonumber(h), t = tonumber(t), d = tonumber(d), n = 1, runs = {tonumber(f), tonumber(r)}, lim = 1}
  end
  if not string.match(s, '^%d+ %d+ %d+ %d+ %d+[ %d]*$') or string.match(s, '  ') or string.match(s, ' $') then
    corrupt('the queue record of key "' .. string.gsub(k or '?', '[^%w%p ]', '?') .. '"', s)
  end
  local x = {}
  for v in string.gmatch(s, '%d+') do x[#x + 1] = tonumber(v) end
  local q = {h = x[1], t = x[2], d = x[3], n = 0, lim = 1}
  local last = #x
  if last % 2 == 0 then
    q.lim = x[last]
    last = last - 1
  end
  for i = 4, last - 1, 2 do
    if x[i] ~= 0 then
      q.runs = q.runs or {}
      q.runs[#q.runs + 1] = x[i]
      q.runs[#q.runs + 1] = x[i + 1]
      q.n = q.n + 1
    end
  end
  return q
end
local function kfmt(q)
  if q.lim <= 1 then
    if q.n == 0 then return string.format('%d %d %d 0 0', q.h, q.t, q.d) end
    if q.n == 1 then return string.format('%d %d %d %d %d', q.h, q.t, q.d, q.runs[1], q.runs[2]) end
  end
  local s = string.format('%d %d %d', q.h, q.t, q.d)
  if q.n == 0 then
    s = s .. ' 0 0'
  else
    for i = 1, 2 * q.n, 2 do s = s .. string.format(' %d %d', q.runs[i], q.runs[i + 1]) end
  end
  if q.lim > 1 then s = s .. string.format(' %d', q.lim) end
  return s
end
-- A key with nothing waiting and nothing in flight has no entry at all.
local function kstore(k, q)
  if q.d == 0 and q.n == 0 then redis.call('HDEL', K_KEYS, k) else redis.call('HSET', K_KEYS, k, kfmt(q)) end
end
-- Where job id's run is in q.runs (its fence is the next entry), or nil.
local function krun(q, id)
  if q.n == 0 then return nil end
  for i = 1, 2 * q.n, 2 do
    if q.runs[i] == id then return i end
  end
  return nil
end
-- Adds a run of job id, in job order.
local function krun_add(q, id, fence)
  if q.n == 0 then
    q.runs = {id, fence}
  else
    local i = 2 * q.n + 1
    while i > 1 and q.runs[i - 2] > id do i = i - 2 end
    table.insert(q.runs, i, fence)
    table.insert(q.runs, i, id)
  end
  q.n = q.n + 1
end
-- Ends the run at i (from krun).
local function krun_end(q, i)
  table.remove(q.runs, i + 1)
  table.remove(q.runs, i)
  q.n = q.n - 1
  if q.n == 0 then q.runs = nil end
end
local function halted(k)
  return HALT and tonumber(redis.call('HGET', K_DEADN, k) or '0') > 0
end
-- Whether key k (queue q) belongs in ready or later: a job waits, its runs
-- are below its limit and no dead job halts it.
local function kqueued(k, q)
  return q.d > 0 and q.n < q.lim and not halted(k)
end
-- Call only for a key that is in neither ready nor later (kqueued was false
-- before the change): restores "a key is in ready or later iff kqueued"
-- (ready may also hold stale entries, which claim drops). With no start
-- time given the key goes to ready and claim moves it to later if its head
-- must wait.
local function kready(k, q, nbf, now)
  if not kqueued(k, q) then return end
  if nbf and nbf > now then
    redis.call('ZADD', K_LATER, nbf, k)
  else
    redis.call('RPUSH', K_READY, k)
  end
end
-- After a run of key k ended and its queue changed: `was` is kqueued
-- before. A key not scheduled before is scheduled now if it may start; one
-- waiting in later may have a new, earlier head, so it goes to ready and
-- the next claim looks at that head.
local function kwake(k, q, was, nbf, now)
  if not was then
    kready(k, q, nbf, now)
  elseif redis.call('ZREM', K_LATER, k) == 1 then
    kready(k, q, nil, now)
  end
end
-- Back to the head of its key: a failed or reclaimed job runs before the
-- key's later jobs. Only an earlier job (a dead letter retried while this
-- one ran) stays before it: every key's list stays in id order, which an
-- export's walk from its cursor relies on.
local function push_head(q, id)
  if q.h ~= 0 and q.h < id then
    local prev = q.h
    local at = tonumber(redis.call('HGET', K_NEXT, idstr(prev)) or '0')
    while at ~= 0 and at < id do
      prev = at
      at = tonumber(redis.call('HGET', K_NEXT, idstr(at)) or '0')
    end
    if at ~= 0 then redis.call('HSET', K_NEXT, idstr(id), idstr(at)) else q.t = id end
    redis.call('HSET', K_NEXT, idstr(prev), idstr(id))
  else
    if q.h ~= 0 then redis.call('HSET', K_NEXT, idstr(id), idstr(q.h)) else q.t = id end
    q.h = id
  end
  q.d = q.d + 1
  redis.call('HINCRBY', K_META, 'pend', 1)
end
-- A job's last failure reason is the field `id` of the reason hash. Its
-- attempts' start times (ms): the field `id@` holds those of its ended
-- attempts, comma-separated; a running attempt started in its run fence's
-- millisecond unless the field `id^` names its start. A claim draws fences
-- from the server's microsecond clock (`next_fence`): the clock it read,
-- plus one per run it started before, so that millisecond is the claim's
-- time or the next. It writes `id^` when the fence is a millisecond or more
-- past its clock (a raised floor, a long claim) or the caller's clock
-- drives the scripts; a cancel writes it when it clears the fence. So a
-- claim and an ack on the common path write no start time. The field
-- `id~` holds the not-before a handler's back-off gave the job
-- (back_off.lua), for `key resume`.
-- All leave with the job (`forget`); a hash with no field is no key, and
-- the common path then reads nothing either.
local function forget(list, i, j)
  i = i or 1
  j = j or #list
  if j < i or redis.call('EXISTS', K_REASON) == 0 then return end
  redis.call('HDEL', K_REASON, unpack(list, i, j))
  for _, sfx in ipairs({'@', '^', '~'}) do
    local at = {}
    for x = i, j do at[#at + 1] = list[x] .. sfx end
    redis.call('HDEL', K_REASON, unpack(at))
  end
end
local function starts_of(ids) return redis.call('HGET', K_REASON, ids .. '@') or '' end
-- When the running attempt of job ids (run fence `fence`, a number or its
-- text) started, as read at `now`: its `id^` (`<fence>:<ms>`) when that
-- names this run (a cleared fence takes any: the cancel that cleared it
-- wrote it), else its fence's millisecond (the text without its last three
-- digits: fences are times in microseconds), but never later than now (a
-- claim's later fences may fall in the next millisecond); nil for a
-- cleared fence without one.
local function run_start(ids, fence, now, explicit)
  if explicit == nil then explicit = redis.call('HGET', K_REASON, ids .. '^') end
  local fs = fence
  if type(fs) ~= 'string' then fs = idstr(fs) end
  if explicit then
    local f, ms = string.match(explicit, '^(%d+):(%d+)$')
    if ms and (f == fs or fs == '0') then return ms end
  end
  if fs == '0' then return nil end
  if #fs <= 3 then return '0' end
  local ms = string.sub(fs, 1, -4)
  if tonumber(ms) > now then return idstr(now) end
  return ms
end
local function with_start(starts, s)
  if not s then return starts end
  if starts == '' then return s end
  return starts .. ',' .. s
end
-- The run of job ids ended as an attempt: its start joins the ended ones.
local function settle_start(ids, fence, now)
  local s = run_start(ids, fence, now)
  if s then
    local at = ids .. '@'
    redis.call('HSET', K_REASON, at, with_start(redis.call('HGET', K_REASON, at) or '', s))
  end
  redis.call('HDEL', K_REASON, ids .. '^')
end
-- Finished jobs are kept newest first in the `finished` list (KEYS[19]), at
-- most `finishedmax` of meta (the owner's retention, set at adopt) entries:
-- `<id>|<c: completed, x: cancelled>|<attempts>|<finished ms>|<starts>|<key
-- length>|<reason length>|<result length, empty for none>|<key><last
-- failure reason><result>`. Read before `forget`.
local function finished_line(ids, k, outcome, attempts, now, starts, why, result)
  starts = starts or ''
  if #starts > 200 then
    -- Only the last 16 start times are kept (core's FINISHED_STARTS_KEPT).
    local t = {}
    for x in string.gmatch(starts, '[^,]+') do t[#t + 1] = x end
    if #t > 16 then starts = table.concat(t, ',', #t - 15, #t) end
  end
  why = why or ''
  local rlen = ''
  if result then rlen = nstr(#result) end
  return ids .. '|' .. outcome .. '|' .. nstr(attempts) .. '|' .. now .. '|' ..
    starts .. '|' .. nstr(#k) .. '|' .. nstr(#why) .. '|' .. rlen .. '|' .. k .. why .. (result or '')
end
-- fence: the job's run that ends with it (nil: none ran).
local function finished_entry(ids, r, outcome, attempts, now, fence)
  local _, _, _, _, k = rec_parse(r)
  local starts = starts_of(ids)
  if fence then starts = with_start(starts, run_start(ids, fence, now)) end
  return finished_line(ids, k, outcome, attempts, idstr(now), starts, redis.call('HGET', K_REASON, ids))
end
local function finished_max() return tonumber(redis.call('HGET', K_META, 'finishedmax') or '0') end
local function keep_finished(entries)
  local max = finished_max()
  if max <= 0 or #entries == 0 then return end
  redis.call('LPUSH', KEYS[19], unpack(entries))
  redis.call('LTRIM', KEYS[19], 0, max - 1)
  -- Entries past the retention's age leave from the tail, a few per call.
  local age = tonumber(redis.call('HGET', K_META, 'finishedage') or '0')
  if age > 0 then
    local oldest = now_ms() - age
    for _ = 1, 16 do
      local e = redis.call('LINDEX', KEYS[19], -1)
      local at = e and tonumber(string.match(e, '^%d+|%a|%d+|(%d+)|'))
      if not at or at >= oldest then break end
      redis.call('RPOP', KEYS[19])
    end
  end
end
-- The `deadk` member of dead job id (a number or its text) of key k.
local function deadk_of(k, id)
  return k .. DEADK_SEP .. string.format('%0' .. DEADK_ID_DIGITS .. 'd', tonumber(id))
end
-- Up to max of key k's dead job ids above id after, in id order (texts,
-- as `dead` holds them): one range read of `deadk`, at most max entries.
local function dead_of(k, after, max)
  local out = {}
  if max <= 0 then return out end
  local w = #k + 2
  for x, m in ipairs(redis.call('ZRANGEBYLEX', K_DEADK, '(' .. deadk_of(k, after), '(' .. k .. DEADK_END, 'LIMIT', 0, max)) do
    out[x] = idstr(tonumber(string.sub(m, w)))
  end
  return out
end
local function bury(ids, k, why)
  redis.call('ZADD', K_DEAD, tonumber(ids), ids)
  redis.call('ZADD', K_DEADK, 0, deadk_of(k, ids))
  redis.call('HINCRBY', K_DEADN, k, 1)
  redis.call('HSET', K_REASON, ids, why)
end
-- Takes dead job ids of key k off the dead letters (`dead`, `deadk` and
-- its count in `deadn`); the job record stays. Returns whether it was dead.
local function unbury(ids, k)
  if redis.call('ZREM', K_DEAD, ids) == 0 then return false end
  redis.call('ZREM', K_DEADK, deadk_of(k, ids))
  if redis.call('HINCRBY', K_DEADN, k, -1) <= 0 then redis.call('HDEL', K_DEADN, k) end
  return true
end
-- Out of flight without an ack (the run ended): the attempt counts; back to
-- the head of its key, or dead when out of attempts.
local function requeue(ids, why, now)
  local r = redis.call('HGET', K_JOBS, ids)
  if not r then
    redis.call('ZREM', K_INF, ids)
    return
  end
  -- Read and parsed before the first write (a corrupt record stops here).
  local n, a, m, _, k = rec_parse(r)
  local q = kparse(redis.call('HGET', K_KEYS, k), k)
  redis.call('ZREM', K_INF, ids)
  local was = kqueued(k, q)
  local run = krun(q, tonumber(ids))
  if run and q.runs[run + 1] == 0 then
    -- Cancelled while it ran (its run fence cleared): the job ends with it.
    krun_end(q, run)
    if finished_max() > 0 then keep_finished({finished_entry(ids, r, 'x', a + 1, now, 0)}) end
    unkey(ids, r)
    redis.call('HDEL', K_JOBS, ids)
    forget({ids})
    kstore(k, q)
    kwake(k, q, was, nil, now)
    return
  end
  a = a + 1
  redis.call('HSET', K_JOBS, ids, rec_set(r, n, a))
  if run then
    settle_start(ids, q.runs[run + 1], now)
    krun_end(q, run)
  end
  if a >= m then bury(ids, k, why) else push_head(q, tonumber(ids)) end
  kstore(k, q)
  kwake(k, q, was, nil, now)
end
-- How long a run whose job record is corrupt, or a key whose queue record
-- is, is set aside before a claim tries it again (and reports it again).
local CORRUPT_PARK_MS = 60000
-- requeue, but a corrupt record parks the run (its job lease moved on by
-- CORRUPT_PARK_MS) so the shard's other work goes on; returns the error
-- (nil when the run went back).
local function requeue_or_park(ids, why, now)
  local ok, e = pcall(requeue, ids, why, now)
  if ok then return nil end
  -- Still in flight: it failed before its first write and waits aside.
  -- Otherwise it failed halfway, which must not pass unseen.
  if redis.call('ZADD', K_INF, 'XX', 'CH', now + CORRUPT_PARK_MS, ids) == 0 and
    not redis.call('ZSCORE', K_INF, ids) then error(e) end
  return e
end
-- The key of job ids: the caller's guess, else the job's record ('' if gone).
local function key_of(ids, k)
  if k ~= '' then return k end
  local r = redis.call('HGET', K_JOBS, ids)
  if not r then return '' end
  local _, _, _, _, rk = rec_parse(r)
  return rk
end
-- Why a result of a run a cancel stopped is refused.
local CANCELLED_RUN = 'the job was cancelled while it ran'
-- Whether (ids, fence) names the run a cancel stopped: the cancel cleared
-- its fence and kept it in `id^` (cancel.lua). Once its handler is over
-- the job ends (requeue deletes it) and the key's next job may start.
local function cancelled_run_is(ids, fence)
  local kept = redis.call('HGET', K_REASON, ids .. '^')
  return kept and string.match(kept, '^(%d+):') == fence
end
-- Whether receipt (ids, fence) names the current run of its job on key k,
-- whose queue is q: nil if it does, else why not. A run whose job lease
-- lapsed ends here (its job goes back to its key), so it is stale too.
-- until_ms: the job's lease deadline when the caller read it (nil: read
-- here; false: not in flight).
local function run_check(ids, fence, k, q, now, until_ms)
  -- A job in flight on its key exists (its record goes with its ack).
  local run = q and krun(q, tonumber(ids))
  if not run then
    if redis.call('HEXISTS', K_JOBS, ids) == 0 then return 'gone' end
    return 'not in flight'
  end
  local cur = q.runs[run + 1]
  if cur == 0 then return CANCELLED_RUN end
  if cur ~= tonumber(fence) then return 'run ' .. idstr(cur) .. ' is current' end
  if until_ms == nil then until_ms = redis.call('ZSCORE', K_INF, ids) end
  until_ms = tonumber(until_ms or '0')
  if until_ms <= now then
    requeue(ids, 'job lease expired', now)
    return 'job lease lapsed'
  end
  return nil
end
-- The move histories (`moved`, `movedin`: lists of entries that begin
-- `<count>|`, oldest first). history_push appends `entry`, which holds
-- `n` ids, and drops the oldest entries past `keys_max` entries or
-- `ids_max` ids in all, counted in `meta` field `countf`, calling
-- `dropped(entry)` (when given) for each entry it drops.
local function history_push(list, countf, entry, n, keys_max, ids_max, dropped)
  redis.call('RPUSH', list, entry)
  local total = redis.call('HINCRBY', K_META, countf, n)
  local len = redis.call('LLEN', list)
  while len > 1 and (len > keys_max or total > ids_max) do
    local old = redis.call('LPOP', list)
    if dropped then dropped(old) end
    total = redis.call('HINCRBY', K_META, countf, -(tonumber(string.match(old, '^(%d+)|')) or 0))
    len = len - 1
  end
  -- A count out of step with the list (the list lost by hand) is set
  -- right once the list is down to this call's entry.
  if len == 1 and total ~= n then redis.call('HSET', K_META, countf, n) end
end
-- history_find walks a history list newest first, a page of 64 entries
-- at a time, and returns the first answer `look(entry)` gives (nil: none).
local function history_find(list, look)
  local hi = redis.call('LLEN', list) - 1
  while hi >= 0 do
    local lo = math.max(0, hi - 63)
    local page = redis.call('LRANGE', list, lo, hi)
    for i = #page, 1, -1 do
      local found = look(page[i])
      if found then return found end
    end
    hi = lo - 1
  end
  return nil
end
