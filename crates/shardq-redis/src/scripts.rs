//! The Lua scripts: every state change of a shard is one script, so each
//! transition is atomic on the server.
//!
//! Scripts are sent as `EVALSHA` and fall back to `EVAL` (which also caches
//! the script) on `NOSCRIPT`, so a restarted server or a node that joined a
//! cluster later needs no separate loading step. Shard scripts receive the
//! shard's keys in [`crate::keys::SHARD_PARTS`] order and declare every key
//! they touch. The common ARGV: `ARGV[1]` the time in ms (empty: the
//! server's `TIME`, one clock for every host), `ARGV[2]` the caller's lease
//! token, `ARGV[3]` `1` when a dead job halts its key, `ARGV[4]` the
//! deployment id the caller opened; each script's own arguments follow from
//! `ARGV[5]`. Every shard script first checks the shard's deployment record
//! (`meta.dep`) and answers `LOST` when it is missing or another, so a
//! flushed or replaced store is never written as if it were new.
//!
//! Every script starts with a `#!lua` line (Redis 7 script flags). The
//! scripts that let a worker drain a full store (claim, ack, fail, extend,
//! adopt, the lease, dead-letter moves, the fence) carry `allow-oom`: they
//! write a few bytes (an in-flight entry, a list push) but free far more
//! over a job's life. Enqueue and init carry no flag, so a server at
//! `maxmemory` refuses them before they run (`OOM`, reported as
//! `QueueError::StoreFull`). Read-only scripts carry `no-writes`.
//!
//! Replies are arrays led by a status word, never Lua errors, so refusals
//! keep their detail. Scripts must stay bounded: every loop runs over a
//! batch whose size the caller limits.

use redis::{Cmd, ConnectionLike, ErrorKind, RedisResult, Value};

/// Helpers shared by the shard scripts.
const PRELUDE: &str = r#"
local K_META, K_JOBS, K_KEYS, K_NEXT, K_READY, K_LATER, K_INF = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local K_DEAD, K_DEADN, K_DELAYED, K_PAUSED, K_LEASE, K_REASON = KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local K_DEDUP, K_DEDUPX, K_SEALED, K_IMPORTED = KEYS[14], KEYS[15], KEYS[16], KEYS[17]
-- Expired dedup records forgotten per enqueue, at most: one by one from
-- `dedupx`, and whole enqueue batches from `dedupm` (two, so the index
-- shrinks faster than one enqueue a call grows it).
local DEDUP_PRUNE = 64
local DEDUP_PRUNE_BATCHES = 2
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
-- A rebalance's writes carry its epoch as the token, `@N`: refused once
-- this shard has seen a newer rebalance's (which took over the lock while
-- this one stalled); the newest seen is meta `repoch`.
if string.sub(ARGV[2], 1, 1) == '@' then
  local e = tonumber(string.sub(ARGV[2], 2)) or 0
  local seen = tonumber(redis.call('HGET', K_META, 'repoch') or '0')
  if e < seen then return {'SUPERSEDED', idstr(seen)} end
  if e > seen then redis.call('HSET', K_META, 'repoch', idstr(e)) end
end
-- A job record: not_before|attempts|max_attempts|created|key length|key payload.
local function rec_parse(r)
  local n, a, m, c, kl, p = string.match(r, '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|()')
  if not n then corrupt('a job record', r) end
  kl = tonumber(kl)
  if p + kl - 1 > #r then corrupt('a job record', r) end
  return tonumber(n), tonumber(a), tonumber(m), tonumber(c), string.sub(r, p, p + kl - 1)
end
local function rec_nbf(r)
  local n = string.match(r, '^(%d+)|')
  if not n then corrupt('a job record', r) end
  return tonumber(n)
end
-- The whole grammar of a job record (its numbers and that its key fits),
-- before a claim hands it out: the worker refuses a malformed one.
local function rec_check(r)
  local kl, p = string.match(r, '^%d+|%d+|%d+|%d+|(%d+)|()')
  if not kl or p + tonumber(kl) - 1 > #r then corrupt('a job record', r) end
end
-- The record with a new not-before and attempt count; key and payload kept.
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
-- claim and an ack on the common path write no start time.
-- All leave with the job (`forget`); a hash with no field is no key, and
-- the common path then reads nothing either.
local function forget(list, i, j)
  i = i or 1
  j = j or #list
  if j < i or redis.call('EXISTS', K_REASON) == 0 then return end
  redis.call('HDEL', K_REASON, unpack(list, i, j))
  for _, sfx in ipairs({'@', '^'}) do
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
-- The run of job ids ended as an attempt (`a` attempts ended before it):
-- its start joins the ended ones. A run an older build claimed is in
-- `id@` already (which then holds more than `a` starts).
local function settle_start(ids, fence, now, a)
  local at = ids .. '@'
  local had = redis.call('HGET', K_REASON, at) or ''
  local n = 0
  if had ~= '' then n = select(2, string.gsub(had, ',', ',')) + 1 end
  if n <= a then
    local s = run_start(ids, fence, now)
    if s then redis.call('HSET', K_REASON, at, with_start(had, s)) end
  end
  redis.call('HDEL', K_REASON, ids .. '^')
end
-- Finished jobs are kept newest first in the `done` list (KEYS[19]), at
-- most `donemax` of meta (the owner's retention, set at adopt) entries:
-- `<id>|<c: completed, x: cancelled>|<attempts>|<finished ms>|<starts>|<key
-- length>|<key><last failure reason>`. Read before `forget`.
local function done_line(ids, k, outcome, attempts, now, starts, why)
  starts = starts or ''
  if #starts > 200 then
    -- Only the last 16 start times are kept (core's FINISHED_STARTS_KEPT).
    local t = {}
    for x in string.gmatch(starts, '[^,]+') do t[#t + 1] = x end
    if #t > 16 then starts = table.concat(t, ',', #t - 15, #t) end
  end
  return ids .. '|' .. outcome .. '|' .. nstr(attempts) .. '|' .. now .. '|' ..
    starts .. '|' .. nstr(#k) .. '|' .. k .. (why or '')
end
-- fence: the job's run that ends with it (nil: none ran).
local function done_entry(ids, r, outcome, attempts, now, fence)
  local _, _, _, _, k = rec_parse(r)
  local starts = starts_of(ids)
  if fence then starts = with_start(starts, run_start(ids, fence, now)) end
  return done_line(ids, k, outcome, attempts, idstr(now), starts, redis.call('HGET', K_REASON, ids))
end
local function done_max() return tonumber(redis.call('HGET', K_META, 'donemax') or '0') end
local function keep_done(entries)
  local max = done_max()
  if max <= 0 or #entries == 0 then return end
  redis.call('LPUSH', KEYS[19], unpack(entries))
  redis.call('LTRIM', KEYS[19], 0, max - 1)
  -- Entries past the retention's age leave from the tail, a few per call.
  local age = tonumber(redis.call('HGET', K_META, 'doneage') or '0')
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
local function bury(ids, k, why)
  redis.call('ZADD', K_DEAD, tonumber(ids), ids)
  redis.call('HINCRBY', K_DEADN, k, 1)
  redis.call('HSET', K_REASON, ids, why)
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
    if done_max() > 0 then keep_done({done_entry(ids, r, 'x', a + 1, now, 0)}) end
    redis.call('HDEL', K_JOBS, ids)
    forget({ids})
    kstore(k, q)
    kwake(k, q, was, nil, now)
    return
  end
  a = a + 1
  redis.call('HSET', K_JOBS, ids, rec_set(r, n, a))
  if run then
    settle_start(ids, q.runs[run + 1], now, a - 1)
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
  if cur == 0 then return 'the job was cancelled while it ran' end
  if cur ~= tonumber(fence) then return 'run ' .. idstr(cur) .. ' is current' end
  if until_ms == nil then until_ms = redis.call('ZSCORE', K_INF, ids) end
  until_ms = tonumber(until_ms or '0')
  if until_ms <= now then
    requeue(ids, 'job lease expired', now)
    return 'job lease lapsed'
  end
  return nil
end
"#;

/// ARGV[5] map version, ARGV[6] job count n, ARGV[7] dedup window in ms
/// (0 when no job has a dedup id), then per job: key, payload, delay_ms,
/// max_attempts, dedup id (empty for none). Fence check, dedup check and
/// append in one step. The reply after `OK` has one item per job: its new
/// id, or `D<job>|<shard>` for a duplicate (shard empty: this shard).
const ENQUEUE: &str = r#"
local now = now_ms()
local n = tonumber(ARGV[6])
local window = tonumber(ARGV[7])
local A = 8
-- The keys hash's pin is no routing key (producers refuse control
-- characters; this guards the store from one that does not).
for i = 0, n - 1 do
  if ARGV[A + 5 * i] == KEYS_PIN then return redis.error_reply('shardq: a routing key holds no NUL byte') end
end
local fmin = tonumber(redis.call('HGET', K_META, 'fmin') or '0')
if tonumber(ARGV[5]) < fmin then return {'FENCED', ARGV[A], fmin} end
if redis.call('SCARD', K_PAUSED) > 0 then
  for i = 0, n - 1 do
    local k = ARGV[A + 5 * i]
    if redis.call('SISMEMBER', K_PAUSED, k) == 1 then
      -- Paused and sealed: frozen, its backlog is on the shard it moves to.
      local to = K_SEALED and redis.call('HGET', K_SEALED, k)
      if to then return {'MOVED', k, to} end
      return {'PAUSED', k}
    end
  end
end
-- Dedup: forget a bounded number of expired records, then look each id up.
-- A record `<job>|<expires_ms>|<shard>` counts only before it expires.
-- Records expire through two indexes: `dedupx` has one entry per record
-- (written by a move's import and by older builds), `dedupm` (KEYS[20])
-- one per enqueue batch, `#<first job id>` then the batch's fields, a line
-- each, scored by their common expiry.
local K_DEDUPM = KEYS[20]
local NL = string.char(10)
local out, keep = {'OK'}, {}
local dd, dx = {}, {}
if window > 0 then
  -- Each index forgets a record only when the record itself expired: the
  -- other index (or an older build) may have stored it again since.
  local function forget_expired(fl)
    local gone = {}
    if #fl > 0 then
      for x, r in ipairs(redis.call('HMGET', K_DEDUP, unpack(fl))) do
        if r and tonumber(string.match(r, '^%d+|(%d+)|') or '0') <= now then gone[#gone + 1] = fl[x] end
      end
    end
    if #gone > 0 then redis.call('HDEL', K_DEDUP, unpack(gone)) end
    return gone
  end
  local old = redis.call('ZRANGEBYSCORE', K_DEDUPX, '-inf', now, 'LIMIT', 0, DEDUP_PRUNE)
  if #old > 0 then
    forget_expired(old)
    redis.call('ZREM', K_DEDUPX, unpack(old))
  end
  local marks = {}
  if K_DEDUPM then marks = redis.call('ZRANGEBYSCORE', K_DEDUPM, '-inf', now, 'LIMIT', 0, DEDUP_PRUNE_BATCHES) end
  for _, mark in ipairs(marks) do
    local fl = {}
    for f in string.gmatch(mark, '[^' .. NL .. ']+') do fl[#fl + 1] = f end
    table.remove(fl, 1)
    -- A record forgotten here leaves `dedupx` too (a move may have put an
    -- entry there), so no entry outlives its record.
    local gone = forget_expired(fl)
    if #gone > 0 then redis.call('ZREM', K_DEDUPX, unpack(gone)) end
    redis.call('ZREM', K_DEDUPM, mark)
  end
end
-- The batch's dedup records in one read: fs[i] is job i's field.
local fs, rs = {}, {}
if window > 0 then
  local list, at = {}, {}
  for i = 0, n - 1 do
    local d = ARGV[A + 4 + 5 * i]
    if d ~= '' then
      fs[i] = dfield(ARGV[A + 5 * i], d)
      list[#list + 1] = fs[i]
      at[#list] = i
    end
  end
  if #list > 0 then
    for x, r in ipairs(redis.call('HMGET', K_DEDUP, unpack(list))) do rs[at[x]] = r end
  end
end
local batch, inb, expired = {}, {}, {}
for i = 0, n - 1 do
  local f = fs[i]
  if f then
    local r = rs[i]
    local dup = nil
    if r then
      local job, exp, sh = string.match(r, '^(%d+)|(%d+)|(.*)$')
      if tonumber(exp) > now then
        dup = 'D' .. job .. '|' .. sh
      else
        -- Stored again below: its old `dedupx` entry must not forget it.
        expired[#expired + 1] = f
      end
    end
    if dup then
      out[i + 2] = dup
    elseif batch[f] then
      inb[i] = batch[f]
    else
      batch[f] = i
      keep[#keep + 1] = i
    end
  else
    keep[#keep + 1] = i
  end
end
local m = #keep
if m == 0 then
  for i, j in pairs(inb) do out[i + 2] = out[j + 2] end
  return out
end
local cand, qs = {}, {}
for _, i in ipairs(keep) do
  local k = ARGV[A + 5 * i]
  if not qs[k] then
    qs[k] = true
    cand[#cand + 1] = k
  end
end
-- A key with nothing waiting and nothing in flight was in neither ready nor
-- later: its first job in this batch becomes its head.
local cur = redis.call('HMGET', K_KEYS, unpack(cand))
local fresh, hnbf = {}, {}
for i, k in ipairs(cand) do
  local q = kparse(cur[i], k)
  qs[k] = q
  fresh[k] = q.d == 0 and q.n < q.lim
end
-- Ids and counts only once every key's record read well.
local first = redis.call('HINCRBY', K_META, 'seq', m) - m + 1
redis.call('HINCRBY', K_META, 'pend', m)
local nows = idstr(now)
local exps = idstr(now + window)
local jobs, nxt, dly = {}, {}, {}
for j, i in ipairs(keep) do
  local k, d = ARGV[A + 5 * i], tonumber(ARGV[A + 2 + 5 * i])
  local id = first + j - 1
  local ids = idstr(id)
  out[i + 2] = ids
  local nbf, nbfs = now, nows
  if d > 0 then
    nbf = now + d
    nbfs = idstr(nbf)
    dly[#dly + 1] = nbfs
    dly[#dly + 1] = ids
  end
  jobs[#jobs + 1] = ids
  jobs[#jobs + 1] = nbfs .. '|0|' .. ARGV[A + 3 + 5 * i] .. '|' .. nows .. '|' .. nstr(#k) .. '|' .. k .. ARGV[A + 1 + 5 * i]
  local f = fs[i]
  if f then
    dd[#dd + 1] = f
    dd[#dd + 1] = ids .. '|' .. exps .. '|'
    dx[#dx + 1] = f
  end
  local q = qs[k]
  if q.t ~= 0 then
    nxt[#nxt + 1] = idstr(q.t)
    nxt[#nxt + 1] = ids
  else
    q.h = id
    hnbf[k] = nbf
  end
  q.t = id
  q.d = q.d + 1
end
-- A duplicate within the batch names the job stored for the first of it.
for i, j in pairs(inb) do out[i + 2] = 'D' .. out[j + 2] .. '|' end
redis.call('HSET', K_JOBS, unpack(jobs))
if #nxt > 0 then redis.call('HSET', K_NEXT, unpack(nxt)) end
-- Stored again over an expired record: its old `dedupx` entry goes first.
if #expired > 0 then redis.call('ZREM', K_DEDUPX, unpack(expired)) end
if #dd > 0 then
  redis.call('HSET', K_DEDUP, unpack(dd))
  if K_DEDUPM then
    redis.call('ZADD', K_DEDUPM, exps, '#' .. idstr(first) .. NL .. table.concat(dx, NL))
  else
    -- A caller that passed the first 19 parts only: one entry per record.
    local px = {}
    for _, f in ipairs(dx) do
      px[#px + 1] = exps
      px[#px + 1] = f
    end
    redis.call('ZADD', K_DEDUPX, unpack(px))
  end
end
local kq, rl, lz = {}, {}, {}
for _, k in ipairs(cand) do
  kq[#kq + 1] = k
  kq[#kq + 1] = kfmt(qs[k])
  if fresh[k] and not halted(k) then
    if hnbf[k] > now then
      lz[#lz + 1] = hnbf[k]
      lz[#lz + 1] = k
    else
      rl[#rl + 1] = k
    end
  end
end
redis.call('HSET', K_KEYS, unpack(kq))
if #dly > 0 then redis.call('ZADD', K_DELAYED, unpack(dly)) end
if #rl > 0 then redis.call('RPUSH', K_READY, unpack(rl)) end
if #lz > 0 then redis.call('ZADD', K_LATER, unpack(lz)) end
return out
"#;

/// ARGV[5] key (empty: every key, for the key list only): the live dedup
/// records of the shard, as `field, record` pairs, at most ARGV[6] of them
/// from HSCAN cursor ARGV[7]; the reply is `OK`, the next cursor, then the
/// pairs. Read-only.
const DEDUP_EXPORT: &str = r#"
local now = now_ms()
local want = ARGV[5]
local r = redis.call('HSCAN', K_DEDUP, ARGV[7], 'COUNT', tonumber(ARGV[6]))
local out = {'OK', r[1]}
local items = r[2]
for i = 1, #items, 2 do
  local f, v = items[i], items[i + 1]
  local kl, p = string.match(f, '^(%d+)|()')
  local k = string.sub(f, p, p + tonumber(kl) - 1)
  local _, exp = string.match(v, '^(%d+)|(%d+)|')
  if tonumber(exp) > now and (want == '' or want == k) then
    out[#out + 1] = f
    out[#out + 1] = v
  end
end
return out
"#;

/// ARGV[5] record count n, then per record: field, job, expires_ms, shard.
/// Stores each record unless its field holds a live one (so a rerun
/// changes nothing); an expired one is skipped.
const DEDUP_IMPORT: &str = r#"
local now = now_ms()
local n = tonumber(ARGV[5])
for i = 0, n - 1 do
  local f, job, exp, sh = ARGV[6 + 4 * i], ARGV[7 + 4 * i], tonumber(ARGV[8 + 4 * i]), ARGV[9 + 4 * i]
  if exp > now then
    local r = redis.call('HGET', K_DEDUP, f)
    local live = false
    if r then
      local _, e = string.match(r, '^(%d+)|(%d+)|')
      live = tonumber(e) > now
    end
    if not live then
      redis.call('HSET', K_DEDUP, f, job .. '|' .. idstr(exp) .. '|' .. sh)
      redis.call('ZADD', K_DEDUPX, exp, f)
    end
  end
end
return {'OK'}
"#;

/// ARGV[5] max jobs, ARGV[6] job lease ms, ARGV[7] reclaim batch, ARGV[8]
/// the keys' run limits (empty: one run per key; else see `LIMITS` below),
/// ARGV[9] `-` to take keys in the shard's own order, else the number P of
/// keys the caller ranked (flow control's weights and priorities), which
/// follow in ARGV[10..9+P] and are the only ones taken (each only while
/// ready or due); then `1` when an earlier attempt's reply was lost, then
/// the ids the caller holds: in-flight jobs it does not know are put back.
/// Replies the lease deadline, the shard's job-id sequence (`meta.seq`),
/// then id, record, fence per job (a key's jobs in job order, keys
/// interleaved as their turns came); the attempt
/// being made is the record's count + 1. Each run's fence is
/// `next_fence(now_us, last, floor)` (`shardq_core::next_fence`), the last
/// kept in `meta.flast`. A key below its limit starts one job per turn:
/// every key taken gets a turn before any gets a second, and a key still
/// below its limit with work waiting goes back to the end of `ready` (or
/// to `later` when its head must wait).
const CLAIM: &str = r#"
if not owns() then return {'NOTOWNER'} end
-- One reading of the server's clock for the time and the fences.
local us = now_us()
local now = math.floor(us / 1000)
if ARGV[1] ~= '' then now = tonumber(ARGV[1]) end
-- The job-id sequence, for the caller's check that the store did not go
-- back in time (a lagging replica promoted, an older snapshot restored).
local seq = redis.call('HGET', K_META, 'seq') or '0'
-- LIMITS: the deployment's default limit, then `\n=<n>\t<key>` per key
-- whose own policy sets another limit than its prefix or the default
-- would, then `\n^<n>\t<prefix>` per prefix policy, longest first (keys
-- hold no control characters, so the separators are unambiguous).
local lim_default, lim_keys, lim_prefixes = 1, nil, {}
if ARGV[8] ~= '' then
  lim_keys = {}
  for line in string.gmatch(ARGV[8], '[^\n]+') do
    local kind, n, text = string.match(line, '^([=^])(%d+)\t(.*)$')
    if kind == '=' then
      lim_keys[text] = tonumber(n)
    elseif kind == '^' then
      lim_prefixes[#lim_prefixes + 1] = {text, tonumber(n)}
    else
      lim_default = tonumber(line) or 1
    end
  end
end
local function limit_of(k)
  if not lim_keys then return 1 end
  local n = lim_keys[k]
  if n then return n end
  for _, p in ipairs(lim_prefixes) do
    if string.sub(k, 1, #p[1]) == p[1] then return p[2] end
  end
  return lim_default
end
-- A record with several runs or a limit is key layout 3 (keys.rs
-- LAYOUT_VERSION): a shard still at 2 is raised before it holds one, so
-- processes that read only 2 refuse it.
if lim_keys and redis.call('HGET', K_META, 'layout') == '2' then
  redis.call('HSET', K_META, 'layout', '3')
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
for i, k in ipairs(keys) do
  local ok, q = pcall(kparse, cur[i], k)
  if not ok then refuse(q, k) end
  local lim = limit_of(k)
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
local several = lim_keys ~= nil
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
"#;

/// ARGV[5..] quadruples of job id, run fence, routing key and the attempt
/// the run is (the claim's record count + 1; key and attempt empty when the
/// caller does not know them: the job's record tells). Acks the receipts
/// that name their job's current run; replies {'OK', id, fence, why, ...}
/// for the others.
const ACK: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local out = {'OK'}
local done, fences, dkeys, datt, freed = {}, {}, {}, {}, {}
-- One read for every receipt's job lease and one for their keys' queues.
-- The queues change in memory (a repeated receipt finds its run gone, so it
-- is stale) and are written once at the end, or before a lapsed run goes
-- back to its key (requeue reads and writes the key itself).
local rids, rkeys, klist, qs, dirty = {}, {}, {}, {}, {}
for i = 5, #ARGV - 3, 4 do
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
  local i = 1 + 4 * x
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
    done[#done + 1] = ids
    fences[#done] = fence
    dkeys[#done] = k
    if ARGV[i + 3] ~= '' then datt[#done] = ARGV[i + 3] end
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
if #done > 0 then
  if done_max() > 0 then
    -- Two reads for the whole batch at most: the records of runs whose
    -- attempt the caller did not know, then reasons and start times when
    -- any job has one (see `forget`).
    local unknown = {}
    for x = 1, #done do
      if not datt[x] then unknown[#unknown + 1] = x end
    end
    if #unknown > 0 then
      local want = {}
      for y, x in ipairs(unknown) do want[y] = done[x] end
      for y, r in ipairs(redis.call('HMGET', K_JOBS, unpack(want))) do
        local _, a = rec_parse(r)
        datt[unknown[y]] = a + 1
      end
    end
    local rs = nil
    if redis.call('EXISTS', K_REASON) == 1 then
      local f = {}
      for x = 1, #done do
        f[#f + 1] = done[x]
        f[#f + 1] = done[x] .. '@'
        f[#f + 1] = done[x] .. '^'
      end
      rs = redis.call('HMGET', K_REASON, unpack(f))
    end
    local entries = {}
    local nows = idstr(now)
    -- Pushed in ack order: the last one acked ends at the head.
    for x = 1, #done do
      local why, starts, explicit = nil, '', false
      if rs then why, starts, explicit = rs[3 * x - 2], rs[3 * x - 1] or '', rs[3 * x] end
      starts = with_start(starts, run_start(done[x], fences[x], now, explicit))
      entries[#entries + 1] = done_line(done[x], dkeys[x], 'c', datt[x], nows, starts, why)
    end
    keep_done(entries)
  end
  redis.call('ZREM', K_INF, unpack(done))
  redis.call('HDEL', K_JOBS, unpack(done))
  forget(done)
end
if #freed > 0 then redis.call('RPUSH', K_READY, unpack(freed)) end
return out
"#;

/// ARGV[5] id, ARGV[6] run fence, ARGV[7] reason, ARGV[8] backoff base ms,
/// ARGV[9] backoff max ms, ARGV[10] retry delay ms (empty: the backoff),
/// ARGV[11] `exp` or `fixed`, ARGV[12] the share the jitter takes off the
/// backoff, in millionths (core's `Backoff::jitter_share`).
/// The retry goes back to the head of its key.
const FAIL: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local id = ARGV[5]
local k = key_of(id, '')
local q = nil
if k ~= '' then q = kparse(redis.call('HGET', K_KEYS, k), k) end
local why = run_check(id, ARGV[6], k, q, now)
if why then return {'STALE', why} end
local r = redis.call('HGET', K_JOBS, id)
local _, a, m = rec_parse(r)
a = a + 1
redis.call('ZREM', K_INF, id)
redis.call('HSET', K_REASON, id, ARGV[7])
settle_start(id, ARGV[6], now, a - 1)
local was = kqueued(k, q)
krun_end(q, krun(q, tonumber(id)))
if a >= m then
  redis.call('HSET', K_JOBS, id, rec_set(r, now, a))
  bury(id, k, ARGV[7])
  kstore(k, q)
  kwake(k, q, was, nil, now)
  return {'DEAD'}
end
local delay
if ARGV[10] ~= '' then
  delay = tonumber(ARGV[10])
else
  local base, most = tonumber(ARGV[8]), tonumber(ARGV[9])
  if ARGV[11] == 'fixed' then
    delay = math.min(base, most)
  else
    delay = math.min(base * (2 ^ math.min(a - 1, 40)), most)
  end
  delay = delay - math.floor(delay * tonumber(ARGV[12] or '0') / 1000000)
end
local nbf = now + delay
redis.call('HSET', K_JOBS, id, rec_set(r, nbf, a))
push_head(q, tonumber(id))
if delay > 0 then redis.call('ZADD', K_DELAYED, nbf, id) end
kstore(k, q)
kwake(k, q, was, nbf, now)
return {'RETRY', nbf}
"#;

/// ARGV[5] id, ARGV[6] run fence, ARGV[7] routing key (empty when the
/// caller does not know it), ARGV[8] back-off ms. Ends the run without
/// using an attempt (the handler backed off, or flow control gave the run
/// back): the job goes back to the head of its key with its attempt count
/// and not before now + back-off, and its run's start time goes with it.
const BACK_OFF: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local id = ARGV[5]
local k = key_of(id, ARGV[7])
local q = nil
if k ~= '' then q = kparse(redis.call('HGET', K_KEYS, k), k) end
local why = run_check(id, ARGV[6], k, q, now)
if why then return {'STALE', why} end
local r = redis.call('HGET', K_JOBS, id)
local _, a = rec_parse(r)
redis.call('ZREM', K_INF, id)
local was = kqueued(k, q)
krun_end(q, krun(q, tonumber(id)))
redis.call('HDEL', K_REASON, id .. '^')
local nbf = now + tonumber(ARGV[8])
redis.call('HSET', K_JOBS, id, rec_set(r, nbf, a))
push_head(q, tonumber(id))
if nbf > now then redis.call('ZADD', K_DELAYED, nbf, id) end
kstore(k, q)
kwake(k, q, was, nbf, now)
return {'OK', nbf}
"#;

/// KEYS[1] a flow-control group's bucket (a hash), KEYS[2] its run slots
/// (a sorted set); ARGV[1] now ms, ARGV[2] the rate's count, ARGV[3] its
/// unit in ms, ARGV[4] the burst, ARGV[5] `take` or `hold`; for `hold`
/// ARGV[6] the hold's end; for `take` ARGV[6] the group's concurrency (0:
/// none), ARGV[7] when the slots taken lapse, ARGV[8] the longest wait for
/// a slot, ARGV[9] how many starts N, then (with a concurrency) the N runs
/// asking for a slot. The recipe of `shardq_core::flow::take_group_many`
/// in integer units (a token is `per` units, every ms adds `count`; lapsed
/// slots are dropped, a run keeps its own; the first start refused stops
/// the rest): replies {'OK', how many were taken, when to ask again (0
/// when all were)}. A bucket unused for a day expires (a new one starts
/// full); the slots a day past their latest lapse.
pub(crate) const GROUP_BUCKET: &str = r#"
local now, count, per, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local f = function(x) return string.format('%d', x) end
local v = redis.call('HMGET', KEYS[1], 'u', 'at', 'held', 'c', 'p')
local cap = burst * per
local u, at, held = tonumber(v[1]), tonumber(v[2]), tonumber(v[3] or '0')
if not u or not at then u, at = cap, now end
local c0, p0 = tonumber(v[4] or ARGV[2]), tonumber(v[5] or ARGV[3])
if c0 ~= count or p0 ~= per then u = math.floor(u * per / p0) end
if now > at then
  u = u + (now - at) * count
  at = now
end
if u > cap then u = cap end
local taken, wait = 0, 0
if ARGV[5] == 'hold' then
  held = math.max(held, tonumber(ARGV[6]))
else
  local conc, n, lapse = tonumber(ARGV[6]), tonumber(ARGV[9]), ARGV[7]
  local used = 0
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
    used = redis.call('ZCARD', KEYS[2])
  end
  while taken < n do
    local h = ARGV[10 + taken]
    local own = conc > 0 and redis.call('ZSCORE', KEYS[2], h)
    if conc > 0 and not own and used >= conc then
      local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
      wait = math.max(math.min(tonumber(first[2]), now + tonumber(ARGV[8])), now + 1)
      break
    end
    if now < held then
      wait = held
      break
    end
    if u < per then
      wait = now + math.ceil((per - u) / count)
      break
    end
    u = u - per
    if conc > 0 then
      if not own then used = used + 1 end
      redis.call('ZADD', KEYS[2], lapse, h)
    end
    taken = taken + 1
  end
  if conc > 0 and taken > 0 then
    -- Kept a day past its latest slot's lapse (renewals do the same).
    redis.call('PEXPIRE', KEYS[2], math.max(0, tonumber(lapse) - now) + 86400000)
  end
end
redis.call('HSET', KEYS[1], 'u', f(u), 'at', f(at), 'held', f(held), 'c', f(count), 'p', f(per))
redis.call('PEXPIRE', KEYS[1], 86400000)
return {'OK', f(taken), f(wait)}
"#;

/// ARGV[5] job lease ms, ARGV[6..] triples of id, fence, routing key.
/// Moves the lease deadline of live runs to now + lease; replies
/// {'OK', deadline, id, fence, why, ...} for the stale ones.
const EXTEND: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local deadline = now + tonumber(ARGV[5])
local out = {'OK', deadline}
for i = 6, #ARGV - 2, 3 do
  local ids, fence = ARGV[i], ARGV[i + 1]
  local k = key_of(ids, ARGV[i + 2])
  local q = nil
  if k ~= '' then q = kparse(redis.call('HGET', K_KEYS, k), k) end
  local why = run_check(ids, fence, k, q, now)
  if why then
    out[#out + 1] = ids
    out[#out + 1] = fence
    out[#out + 1] = why
  else
    redis.call('ZADD', K_INF, 'XX', deadline, ids)
  end
end
return out
"#;

/// ARGV[5..] pairs of routing key and the most runs it may have at once
/// (its policy's concurrency, after a change of policies). Writes each limit
/// into its key's queue and schedules a key that may now start more. A key
/// with no queue (nothing waiting, nothing in flight) is left alone: a claim
/// reads its limit afresh.
const RELIMIT: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local n = 0
for i = 5, #ARGV - 1, 2 do
  local k, lim = ARGV[i], tonumber(ARGV[i + 1])
  local s = redis.call('HGET', K_KEYS, k)
  if s then
    local q = kparse(s, k)
    if q.lim ~= lim then
      local was = kqueued(k, q)
      q.lim = lim
      kstore(k, q)
      if not was and not (redis.call('HEXISTS', K_SEALED, k) == 1) then kready(k, q, nil, now) end
      n = n + 1
    end
  end
end
return {'OK', n}
"#;

/// ARGV[5] a layout version: the shard's `layout` becomes it unless it is
/// already that or newer.
const LAYOUT_RAISE: &str = r#"
local now = tonumber(redis.call('HGET', K_META, 'layout') or '0')
if now < tonumber(ARGV[5]) then redis.call('HSET', K_META, 'layout', ARGV[5]) end
return {'OK'}
"#;

/// Puts every in-flight job back (a previous owner's), under the new token.
/// ARGV[5] and ARGV[6] the finished jobs kept (count, age ms), ARGV[7] the
/// `keys` hash's pin ([`keys_pin_value`]), written when missing.
const ADOPT: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
redis.call('HSET', K_META, 'donemax', ARGV[5], 'doneage', ARGV[6])
if ARGV[5] == '0' then redis.call('DEL', KEYS[19]) end
-- A shard written before the `keys` hash had its pin gets it now.
if redis.call('HGET', K_KEYS, KEYS_PIN) ~= ARGV[7] then redis.call('HSET', K_KEYS, KEYS_PIN, ARGV[7]) end
local ids = redis.call('ZRANGE', K_INF, 0, -1)
-- A corrupt record parks its run: the next claims report it.
for _, id in ipairs(ids) do requeue_or_park(id, 'owner lost', now) end
return {'OK', #ids}
"#;

/// ARGV[5] how many, ARGV[6] reclaim batch. For a claim that ranks keys
/// itself: first puts back runs whose lease ended (as a claim does, so a
/// key they free is seen), then replies {'OK', now, the first keys of the
/// ready list, the keys whose wait is over}, each list at most that many.
const PEEK_READY: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local bad = nil
for _, ids in ipairs(redis.call('ZRANGEBYSCORE', K_INF, '-inf', now, 'LIMIT', 0, tonumber(ARGV[6]))) do
  local e = requeue_or_park(ids, 'job lease expired', now)
  bad = bad or e
end
if bad then error(bad) end
local n = tonumber(ARGV[5])
return {'OK', now, redis.call('LRANGE', K_READY, 0, n - 1), redis.call('ZRANGEBYSCORE', K_LATER, '-inf', now, 'LIMIT', 0, n)}
"#;

/// The earliest time work may start: now when a key is ready, else the
/// earlier of the first waiting head's not-before and the first job lease
/// to end (a run in flight lapses back into work unless acked or failed);
/// nil when nothing waits and nothing is in flight.
const NEXT_DUE: &str = r#"
if redis.call('LLEN', K_READY) > 0 then return now_ms() end
local due = false
local r = redis.call('ZRANGE', K_LATER, 0, 0, 'WITHSCORES')
if r[1] then due = tonumber(r[2]) end
local f = redis.call('ZRANGE', K_INF, 0, 0, 'WITHSCORES')
if f[1] and (not due or tonumber(f[2]) < due) then due = tonumber(f[2]) end
return due
"#;

/// ARGV[5] routing key: depth, runs in flight, dead.
const KEY_COUNTS: &str = r#"
local k = ARGV[5]
local q = kparse(redis.call('HGET', K_KEYS, k), k)
return {q.d, q.n, tonumber(redis.call('HGET', K_DEADN, k) or '0')}
"#;

/// Ready, delayed, in flight, dead, distinct keys, the last run fence.
const STATS: &str = r#"
local now = now_ms()
local pending = tonumber(redis.call('HGET', K_META, 'pend') or '0')
local delayed = redis.call('ZCOUNT', K_DELAYED, '(' .. idstr(now), '+inf')
local keys = redis.call('HLEN', K_KEYS) - redis.call('HEXISTS', K_KEYS, KEYS_PIN)
for _, k in ipairs(redis.call('HKEYS', K_DEADN)) do
  if redis.call('HEXISTS', K_KEYS, k) == 0 then keys = keys + 1 end
end
return {math.max(pending - delayed, 0), delayed, redis.call('ZCARD', K_INF), redis.call('ZCARD', K_DEAD), keys, redis.call('HGET', K_META, 'flast') or '0'}
"#;

/// ARGV[5] oldest map version accepted, ARGV[6] smallest run fence,
/// ARGV[7..] paused keys.
/// ARGV[5] map version floor, ARGV[6] run fence floor, ARGV[7] number of
/// paused keys, the paused keys, then `key, to` per sealed key. A key
/// sealed now leaves `later` (claim drops it from `ready`); a key unsealed
/// now with work waiting goes back to `ready` (claim takes each key once,
/// so one still there is harmless).
const FENCE_SET: &str = r#"
local now = now_ms()
redis.call('HSET', K_META, 'fmin', ARGV[5], 'ffloor', ARGV[6])
redis.call('DEL', K_PAUSED)
local np = tonumber(ARGV[7])
local keys = {}
for i = 8, 7 + np do keys[#keys + 1] = ARGV[i] end
if #keys > 0 then redis.call('SADD', K_PAUSED, unpack(keys)) end
local want = {}
for i = 8 + np, #ARGV, 2 do want[ARGV[i]] = ARGV[i + 1] end
local had = redis.call('HGETALL', K_SEALED)
for i = 1, #had, 2 do
  local k = had[i]
  if not want[k] then
    redis.call('HDEL', K_SEALED, k)
    kready(k, kparse(redis.call('HGET', K_KEYS, k), k), nil, now)
  end
end
for k, to in pairs(want) do
  redis.call('HSET', K_SEALED, k, to)
  redis.call('ZREM', K_LATER, k)
end
return {'OK'}
"#;

/// Raises the shard's rebalance epoch (the prelude does it, given `@N`).
const EPOCH_RAISE: &str = r#"
return {'OK'}
"#;

const FENCE_GET: &str = r#"
return {tonumber(redis.call('HGET', K_META, 'fmin') or '0'), redis.call('SMEMBERS', K_PAUSED), redis.call('HGET', K_META, 'ffloor') or '0', redis.call('HGETALL', K_SEALED)}
"#;

/// The export of one key, shared by [`EXPORT`] and [`EXPORT_MANY`]: the
/// key's jobs that are not running, dead or waiting, in id order (reason
/// empty for a waiting job). Only for a sealed key, whose list then only
/// grows at its tail (its ids ascend along it): the walk goes on from the
/// last id exported when that one still waits.
const EXPORT_KEY_FN: &str = r#"
-- Up to max of key k's jobs above id after, dead or waiting, in id order,
-- stopping once their records hold budget bytes: a flat list of
-- `id, record, reason`, and the bytes it holds.
local function export_key(k, after, max, budget)
  local dead = {}
  if tonumber(redis.call('HGET', K_DEADN, k) or '0') > 0 then
    for _, ids in ipairs(redis.call('ZRANGEBYSCORE', K_DEAD, '(' .. idstr(after), '+inf')) do
      if #dead >= max then break end
      local r = redis.call('HGET', K_JOBS, ids)
      if r then
        local _, _, _, _, rk = rec_parse(r)
        if rk == k then dead[#dead + 1] = {tonumber(ids), r, redis.call('HGET', K_REASON, ids) or 'dead'} end
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
"#;

/// ARGV[5] key, ARGV[6] export only ids above this (0: from the first),
/// ARGV[7] at most this many, ARGV[8] and no more once their records hold
/// this many bytes (at least one job). Reply: `OK`, then `id, record,
/// reason` per job. Read-only.
const EXPORT: &str = r#"
local out = export_key(ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]))
table.insert(out, 1, 'OK')
return out
"#;

/// ARGV[5] number of keys, then `key, after` per key (`after` 0: none
/// taken yet). Freezes each key sealed here with no job above `after` that
/// is not running: adds it to the paused set, which for a sealed key means
/// frozen (enqueues answer `MOVED`). Reply: `OK`, then the keys frozen.
const FREEZE: &str = r#"
local n = tonumber(ARGV[5])
local out = {'OK'}
for i = 0, n - 1 do
  local k = ARGV[6 + 2 * i]
  if redis.call('HEXISTS', K_SEALED, k) == 1 then
    local jobs = export_key(k, tonumber(ARGV[7 + 2 * i]), 1, 1)
    if #jobs == 0 then
      redis.call('SADD', K_PAUSED, k)
      out[#out + 1] = k
    end
  end
end
return out
"#;

/// ARGV[5] number of keys, ARGV[6] at most this many jobs per key, ARGV[7]
/// a byte budget for the whole reply, then `key, after` per key. Reply:
/// `OK`, then per key exported (in the order given, until the budget is
/// spent): the key, its job count n, `1` if it may have more (n reached the
/// limit, or the budget ran out on it) else `0`, then `id, record, reason`
/// n times. Read-only.
const EXPORT_MANY: &str = r#"
local n, max, budget = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local out = {'OK'}
for i = 0, n - 1 do
  if budget <= 0 then break end
  local k = ARGV[8 + 2 * i]
  local jobs, bytes = export_key(k, tonumber(ARGV[9 + 2 * i]), max, budget)
  local more = 0
  if #jobs / 3 >= max or bytes >= budget then more = 1 end
  budget = budget - bytes
  out[#out + 1] = k
  out[#out + 1] = #jobs / 3
  out[#out + 1] = more
  for _, v in ipairs(jobs) do out[#out + 1] = v end
end
return out
"#;

/// ARGV[5] the shard the jobs come from, ARGV[6] number of keys, then per
/// key: the key, its job count c, then c times `source id, not_before,
/// attempts, max_attempts, created, payload, reason` (reason empty: a
/// waiting job, else a dead one). Appends each key's jobs at its tail with
/// new ids, skipping source ids at or below the key's import cursor
/// (`imported` field `<from len>|<from><key>`), so a rerun stores nothing
/// twice. Reply: `OK`, then `key, source id, new id` per job stored.
const IMPORT: &str = r#"
local now = now_ms()
local from = ARGV[5]
local nk = tonumber(ARGV[6])
-- First pass: each key's cursor and how many of its jobs are new, so the
-- ids come from one HINCRBY and the writes go in a few bulk calls.
local p = 7
local plan, fresh_n = {}, 0
for _ = 1, nk do
  local k, c = ARGV[p], tonumber(ARGV[p + 1])
  local cf = #from .. '|' .. from .. k
  local done = tonumber(redis.call('HGET', K_IMPORTED, cf) or '0')
  local top, n = done, 0
  for j = 0, c - 1 do
    local src = tonumber(ARGV[p + 2 + 7 * j])
    if src > top then
      top = src
      n = n + 1
    end
  end
  plan[#plan + 1] = {k = k, c = c, p = p + 2, cf = cf, done = done, top = top}
  fresh_n = fresh_n + n
  p = p + 2 + 7 * c
end
local out = {'OK'}
if fresh_n == 0 then return out end
local id = redis.call('HINCRBY', K_META, 'seq', fresh_n) - fresh_n
local jobs, nxt, dly, cur = {}, {}, {}, {}
local stored = 0
local function flush(t, cmd, key)
  for i = 1, #t, 4000 do
    redis.call(cmd, key, unpack(t, i, math.min(i + 3999, #t)))
  end
end
for _, pl in ipairs(plan) do
  if pl.top > pl.done then
    local k = pl.k
    local q = kparse(redis.call('HGET', K_KEYS, k), k)
    local was = kqueued(k, q)
    local head_nbf = nil
    local top = pl.done
    for j = 0, pl.c - 1 do
      local b = pl.p + 7 * j
      local src = tonumber(ARGV[b])
      if src > top then
        top = src
        id = id + 1
        local ids = idstr(id)
        local nbf, why = ARGV[b + 1], ARGV[b + 6]
        jobs[#jobs + 1] = ids
        jobs[#jobs + 1] = nbf .. '|' .. ARGV[b + 2] .. '|' .. ARGV[b + 3] .. '|' .. ARGV[b + 4] .. '|' .. #k .. '|' .. k .. ARGV[b + 5]
        if why ~= '' then
          bury(ids, k, why)
        else
          if q.t ~= 0 then
            nxt[#nxt + 1] = idstr(q.t)
            nxt[#nxt + 1] = ids
          else
            q.h = id
            head_nbf = tonumber(nbf)
          end
          q.t = id
          q.d = q.d + 1
          stored = stored + 1
          if tonumber(nbf) > now then
            dly[#dly + 1] = tonumber(nbf)
            dly[#dly + 1] = ids
          end
        end
        out[#out + 1] = k
        out[#out + 1] = ARGV[b]
        out[#out + 1] = ids
      end
    end
    cur[#cur + 1] = pl.cf
    cur[#cur + 1] = idstr(top)
    kstore(k, q)
    if not was and head_nbf then kready(k, q, head_nbf, now) end
  end
end
flush(jobs, 'HSET', K_JOBS)
flush(nxt, 'HSET', K_NEXT)
flush(dly, 'ZADD', K_DELAYED)
flush(cur, 'HSET', K_IMPORTED)
if stored > 0 then redis.call('HINCRBY', K_META, 'pend', stored) end
return out
"#;

/// ARGV[5] from, ARGV[6] key: the key's import cursor from that shard
/// (`OK`, the largest source id taken, 0 for none). Read-only.
const IMPORTED_UP_TO: &str = r#"
return {'OK', redis.call('HGET', K_IMPORTED, #ARGV[5] .. '|' .. ARGV[5] .. ARGV[6]) or '0'}
"#;

/// ARGV[5] key, ARGV[6] at most this many jobs per call: deletes the key's
/// jobs that are not running, waiting ones from the head, then (once none
/// waits) dead ones. Reply: `OK`, how many were deleted, `1` if some are
/// left (call again). What a move left behind on the old shard of a sealed
/// key, whose list no longer changes.
const PURGE_KEY: &str = r#"
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
local dead = tonumber(redis.call('HGET', K_DEADN, k) or '0')
if q.h == 0 and dead > 0 and n < max then
  for _, ids in ipairs(redis.call('ZRANGE', K_DEAD, 0, -1)) do
    if n >= max or dead == 0 then break end
    local r = redis.call('HGET', K_JOBS, ids)
    local rk = ''
    if r then
      local _, _, _, _, x = rec_parse(r)
      rk = x
    end
    if rk == k then
      redis.call('ZREM', K_DEAD, ids)
      redis.call('HDEL', K_JOBS, ids)
      forget({ids})
      gone[#gone + 1] = ids
      dead = dead - 1
      n = n + 1
    end
  end
  if dead > 0 then redis.call('HSET', K_DEADN, k, dead) else redis.call('HDEL', K_DEADN, k) end
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
  redis.call('RPUSH', K_MOVED, n .. '|' .. idstr(lo) .. '|' .. idstr(hi) .. '|' .. #k .. '|' .. k .. ',' .. table.concat(gone, ',') .. ',')
  local total = redis.call('HINCRBY', K_META, 'movedn', n)
  local len = redis.call('LLEN', K_MOVED)
  while len > 1 and (len > MOVED_KEYS_KEPT or total > MOVED_IDS_KEPT) do
    local old = redis.call('LPOP', K_MOVED)
    total = redis.call('HINCRBY', K_META, 'movedn', -(tonumber(string.match(old, '^(%d+)|')) or 0))
    len = len - 1
  end
  -- A count out of step with the list (the list lost by hand) is set
  -- right once the list is down to this call's entry.
  if len == 1 and total ~= n then redis.call('HSET', K_META, 'movedn', n) end
end
local more = 0
if q.h ~= 0 or dead > 0 then more = 1 end
return {'OK', n, more}
"#;

/// ARGV[5] a job id: the key it moved away with, if the `moved` list
/// (written by the purge after a move) still holds it. Reply `OK` and the
/// key, or `NONE`. Read-only; reads the list a page at a time, newest first.
const MOVED_AWAY: &str = r#"
local K_MOVED = KEYS[18]
local needle = ',' .. ARGV[5] .. ','
local id = tonumber(ARGV[5])
local n = redis.call('LLEN', K_MOVED)
local hi = n - 1
while hi >= 0 do
  local lo = math.max(0, hi - 63)
  local page = redis.call('LRANGE', K_MOVED, lo, hi)
  for i = #page, 1, -1 do
    local e = page[i]
    local lo, hi, len, p = string.match(e, '^%d+|(%d+)|(%d+)|(%d+)|()')
    if len and id >= tonumber(lo) and id <= tonumber(hi) then
      local keyend = p + tonumber(len) - 1
      if string.find(e, needle, keyend + 1, true) then
        return {'OK', string.sub(e, p, keyend)}
      end
    end
  end
  hi = lo - 1
end
return {'NONE'}
"#;

/// One live job, as an operator reads it: ARGV[5] its id. Reply `NONE`
/// when no live job has the id, else the state (`RUN`, `DEAD`, `DELAYED`,
/// `QUEUED`), the record, the last failure reason (empty for none), and for
/// a run its fence and job lease deadline (`0` otherwise). Read-only.
const JOB_GET: &str = r#"
local now = now_ms()
local function live(ids)
  local r = redis.call('HGET', K_JOBS, ids)
  if not r then return nil end
  local nbf, _, _, _, k = rec_parse(r)
  local reason = redis.call('HGET', K_REASON, ids) or ''
  local lease = redis.call('ZSCORE', K_INF, ids)
  if lease then
    local q = kparse(redis.call('HGET', K_KEYS, k), k)
    local fence = 0
    local run = krun(q, tonumber(ids))
    if run then fence = q.runs[run + 1] end
    return {'RUN', r, reason, idstr(fence), lease, with_start(starts_of(ids), run_start(ids, fence, now))}
  end
  if redis.call('ZSCORE', K_DEAD, ids) then return {'DEAD', r, reason, '0', '0', starts_of(ids)} end
  if nbf > now then return {'DELAYED', r, reason, '0', '0', starts_of(ids)} end
  return {'QUEUED', r, reason, '0', '0', starts_of(ids)}
end
"#;

/// ARGV[5] id: [`JOB_GET`]'s `live` of one job.
const JOB_SHOW: &str = r#"
local row = live(ARGV[5])
if not row then return {'NONE'} end
return row
"#;

/// ARGV[5] key, ARGV[6] at most this many: the key's runs in flight, then its
/// waiting and dead jobs in id order (the export's walk), stopping once
/// their records hold ARGV[7] bytes. Reply `OK`, then per job its id and
/// [`JOB_GET`]'s six fields. Read-only.
const KEY_JOBS: &str = r#"
local k, max = ARGV[5], tonumber(ARGV[6])
local out = {'OK'}
local function add(ids)
  local row = live(ids)
  if row then
    out[#out + 1] = ids
    for _, v in ipairs(row) do out[#out + 1] = v end
  end
end
local q = kparse(redis.call('HGET', K_KEYS, k), k)
for i = 1, 2 * q.n, 2 do add(idstr(q.runs[i])) end
local rows = export_key(k, 0, max, tonumber(ARGV[7]))
for i = 1, #rows, 3 do add(rows[i]) end
return out
"#;

/// Cancels one job that is not running: ARGV[5] its id. A dead job leaves
/// the dead letters; a waiting one is unlinked from its key's queue (a walk
/// from the head of at most ARGV[6] steps), and when it was the head the key
/// is scheduled by its new head; a running one has its run fence cleared
/// (`STOPPING`: see `requeue`). Reply `CANCELLED`, `STOPPING`, `MOVING` (its
/// key is sealed for a move), `NOTFOUND`, or `TOOFAR` with the bound.
const CANCEL: &str = r#"
local now = now_ms()
local ids = ARGV[5]
local n = tonumber(ids)
local r = redis.call('HGET', K_JOBS, ids)
if not r then return {'NOTFOUND'} end
local _, _, _, _, k = rec_parse(r)
if redis.call('ZSCORE', K_INF, ids) then
  -- Asked to stop: its run fence cleared, its results are refused, and the
  -- job ends with the run (requeue deletes it when its job lease lapses).
  local q = kparse(redis.call('HGET', K_KEYS, k), k)
  local run = krun(q, n)
  if run and q.runs[run + 1] ~= 0 then
    -- The run's start outlives its fence (see `run_start`).
    local f = q.runs[run + 1]
    redis.call('HSETNX', K_REASON, ids .. '^', idstr(f) .. ':' .. idstr(math.min(math.floor(f / 1000), now)))
    q.runs[run + 1] = 0
    kstore(k, q)
  end
  return {'STOPPING'}
end
if redis.call('HEXISTS', K_SEALED, k) == 1 then return {'MOVING'} end
local q = kparse(redis.call('HGET', K_KEYS, k), k)
local function head_nbf()
  if q.h == 0 then return nil end
  return rec_nbf(redis.call('HGET', K_JOBS, idstr(q.h)))
end
if redis.call('ZSCORE', K_DEAD, ids) then
  local startable = kqueued(k, q)
  redis.call('ZREM', K_DEAD, ids)
  if redis.call('HINCRBY', K_DEADN, k, -1) <= 0 then redis.call('HDEL', K_DEADN, k) end
  local _, a = rec_parse(r)
  keep_done({done_entry(ids, r, 'x', a, now)})
  redis.call('HDEL', K_JOBS, ids)
  forget({ids})
  -- A key halted by its dead letters may start again.
  if not startable then kready(k, q, head_nbf(), now) end
  return {'CANCELLED'}
end
local prev, at, steps = 0, q.h, 0
while at ~= 0 and at ~= n do
  steps = steps + 1
  if steps > tonumber(ARGV[6]) then return {'TOOFAR', ARGV[6]} end
  prev = at
  at = tonumber(redis.call('HGET', K_NEXT, idstr(at)) or '0')
end
if at == 0 then return {'NOTFOUND'} end
local nx = tonumber(redis.call('HGET', K_NEXT, ids) or '0')
redis.call('HDEL', K_NEXT, ids)
if prev == 0 then
  q.h = nx
elseif nx ~= 0 then
  redis.call('HSET', K_NEXT, idstr(prev), idstr(nx))
else
  redis.call('HDEL', K_NEXT, idstr(prev))
end
if q.t == n then q.t = prev end
if q.d == 1 then q.h, q.t = 0, 0 end
q.d = q.d - 1
redis.call('HINCRBY', K_META, 'pend', -1)
local _, a = rec_parse(r)
keep_done({done_entry(ids, r, 'x', a, now)})
redis.call('HDEL', K_JOBS, ids)
forget({ids})
redis.call('ZREM', K_DELAYED, ids)
kstore(k, q)
-- A key waiting in `later` for the head it lost waits for its new head;
-- one in `ready` is checked by the next claim.
if prev == 0 and redis.call('ZREM', K_LATER, k) == 1 then kready(k, q, head_nbf(), now) end
return {'CANCELLED'}
"#;

/// ARGV[5] first, ARGV[6] last (from 0, newest first): the time now, then
/// those entries of the `done` list (see `keep_done`). The caller reads in
/// pages, so one call never copies the whole list.
const FINISHED: &str = r#"
local out = {now_ms()}
for _, e in ipairs(redis.call('LRANGE', KEYS[19], tonumber(ARGV[5]), tonumber(ARGV[6]))) do
  out[#out + 1] = e
end
return out
"#;

/// ARGV[5] limit: id, attempts, key, reason per dead job, oldest first.
const DEAD_LIST: &str = r#"
local out = {}
for _, id in ipairs(redis.call('ZRANGE', K_DEAD, 0, tonumber(ARGV[5]) - 1)) do
  local r = redis.call('HGET', K_JOBS, id)
  if r then
    local _, a, _, _, k = rec_parse(r)
    out[#out + 1] = id
    out[#out + 1] = a
    out[#out + 1] = k
    out[#out + 1] = redis.call('HGET', K_REASON, id) or ''
    out[#out + 1] = starts_of(id)
  end
end
return out
"#;

/// ARGV[5] `retry` or `purge`, ARGV[6] `1` for the oldest ARGV[7] dead jobs,
/// else the ids in ARGV[8..]. Returns {moved, looked at}. A retried job goes
/// back to its place in key order (by id): the walk to it passes only the
/// key's waiting jobs with smaller ids, which are earlier retried dead jobs
/// or one reclaimed job, since every other waiting job was enqueued later.
const DEAD_MOVE: &str = r#"
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
  local r0 = redis.call('HGET', K_JOBS, id)
  local sealed = false
  if r0 then
    local _, _, _, _, k0 = rec_parse(r0)
    sealed = redis.call('HEXISTS', K_SEALED, k0) == 1
  end
  if not sealed and redis.call('ZREM', K_DEAD, id) == 1 then
    local r = redis.call('HGET', K_JOBS, id)
    if r then
      local _, _, _, _, k = rec_parse(r)
      local q = qs[k]
      if not q then
        q = kparse(redis.call('HGET', K_KEYS, k), k)
        qs[k] = q
        startable[k] = kqueued(k, q)
        touched[#touched + 1] = k
      end
      if redis.call('HINCRBY', K_DEADN, k, -1) <= 0 then redis.call('HDEL', K_DEADN, k) end
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
"#;

/// ARGV[5] HSCAN cursor: `k<n>` walks `keys` (every key with a waiting job
/// or one in flight), then `d<n>` walks `deadn` for keys whose only jobs
/// are dead letters (they tie the key to this shard as much as live work
/// does). ARGV[6] COUNT hint. Replies {next cursor ('0' when done), key,
/// depth, in flight, dead, ...}.
const INVENTORY: &str = r#"
local phase, cur = string.sub(ARGV[5], 1, 1), string.sub(ARGV[5], 2)
local out = {}
if phase == 'k' then
  local r = redis.call('HSCAN', K_KEYS, cur, 'COUNT', tonumber(ARGV[6]))
  if r[1] == '0' then out[1] = 'd0' else out[1] = 'k' .. r[1] end
  local kv = r[2]
  for i = 1, #kv, 2 do
    local k = kv[i]
    if k ~= KEYS_PIN then
      local q = kparse(kv[i + 1], k)
      out[#out + 1] = k
      out[#out + 1] = q.d
      out[#out + 1] = q.n
      out[#out + 1] = tonumber(redis.call('HGET', K_DEADN, k) or '0')
    end
  end
else
  local r = redis.call('HSCAN', K_DEADN, cur, 'COUNT', tonumber(ARGV[6]))
  if r[1] == '0' then out[1] = '0' else out[1] = 'd' .. r[1] end
  local kv = r[2]
  for i = 1, #kv, 2 do
    local k, n = kv[i], tonumber(kv[i + 1])
    if n > 0 and redis.call('HEXISTS', K_KEYS, k) == 0 then
      out[#out + 1] = k
      out[#out + 1] = 0
      out[#out + 1] = 0
      out[#out + 1] = n
    end
  end
end
return out
"#;

/// Writes a new shard's deployment record (ARGV[4] the deployment id,
/// ARGV[5] the layout version) and the `keys` hash's pin (ARGV[6],
/// [`keys_pin_value`]), refusing a shard any of whose keys exist:
/// init never writes over another deployment's (or a lost) shard.
const INIT_SHARD: &str = r#"
local K_META = KEYS[1]
for _, k in ipairs(KEYS) do
  if redis.call('EXISTS', k) == 1 then
    return {'EXISTS', k, redis.call('HGET', K_META, 'dep') or '', redis.call('HGET', K_META, 'layout') or ''}
  end
end
redis.call('HSET', K_META, 'dep', ARGV[4], 'layout', ARGV[5], 'seq', '0', 'pend', '0', 'flast', '0')
redis.call('HSET', KEYS[3], string.char(0), ARGV[6])
return {'OK'}
"#;

/// KEYS[1] meta of a shard: its deployment id and layout version.
const SHARD_RECORD: &str = r#"
return redis.call('HMGET', KEYS[1], 'dep', 'layout')
"#;

/// KEYS[1] the shard's lease, KEYS[2] its meta. ARGV[2] owner, ARGV[3] the
/// caller's token ('' for none), ARGV[4] lease ms, ARGV[5] `1` to take a
/// free or lapsed lease, ARGV[6] the deployment id, ARGV[7] the token to
/// write when taking it. Tokens are `<owner>#<epoch>#<n>` with a random
/// epoch per coordinator: a store that lost or rewound the lease can never
/// hand a second worker the token the first still holds. A caller whose
/// token is not the stored one gets STALE (it lost the shard) and takes
/// nothing in that call.
const LEASE: &str = r#"
local d = redis.call('HGET', KEYS[2], 'dep')
if d ~= ARGV[6] then return {'LOST', d or ''} end
local now = tonumber(ARGV[1])
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local l = redis.call('HMGET', KEYS[1], 'owner', 'token', 'until')
local owner, token, untl = l[1], l[2], tonumber(l[3] or '0')
local function idstr(n) return string.format('%d', n) end
if ARGV[3] ~= '' then
  if token == ARGV[3] then
    redis.call('HSET', KEYS[1], 'until', idstr(now + tonumber(ARGV[4])))
    return {'HELD', token}
  end
  return {'STALE', owner or '', untl}
end
-- A retry after a lost GAINED reply finds its own new token.
if ARGV[7] ~= '' and token == ARGV[7] then
  redis.call('HSET', KEYS[1], 'until', idstr(now + tonumber(ARGV[4])))
  return {'GAINED', token}
end
if owner and owner ~= '' and untl >= now then return {'OTHER', owner, untl} end
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'token', ARGV[7], 'until', idstr(now + tonumber(ARGV[4])))
  return {'GAINED', ARGV[7]}
end
return {'FREE'}
"#;

/// KEYS[1] the lease, ARGV[2] the caller's token: gives the lease up.
const LEASE_RELEASE: &str = r#"
if redis.call('HGET', KEYS[1], 'token') == ARGV[2] then
  redis.call('HSET', KEYS[1], 'owner', '', 'until', '0')
  return 1
end
return 0
"#;

/// KEYS[1] the map key. ARGV[1] expected version (0: none stored), ARGV[2]
/// new version, ARGV[3] YAML. Compare-and-set.
const MAP_PUBLISH: &str = r#"
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if cur ~= tonumber(ARGV[1]) then return {'CONFLICT', cur} end
if tonumber(ARGV[2]) <= cur then return {'STALE', cur} end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'yaml', ARGV[3])
return {'OK'}
"#;

/// KEYS[1] the rebalance lock, ARGV[1] the holder's token, ARGV[2] ms:
/// extends the lock only while the caller still holds it.
const LOCK_RENEW: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#;

/// KEYS[1] the rebalance lock, ARGV[1] the holder's token: releases it only
/// if the caller still holds it (never a successor's lock).
const LOCK_RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"#;

/// KEYS[1] the rebalance lock, KEYS[2] the epoch counter, ARGV[1] the
/// holder's token: the next rebalance epoch, only while the caller still
/// holds the lock (a holder that stalled past its lease gets none).
const LOCK_EPOCH: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'LOCKLOST'} end
return {'OK', redis.call('INCR', KEYS[2])}
"#;

/// Compare-and-set of one deployment setting (a field of the settings
/// hash). KEYS: the settings hash. ARGV: name, `1` when a current text is
/// expected (else the field must be absent), that text, `1` to store
/// (else clear), the new text. Replies 1 once changed, 0 when the field
/// holds something else (nothing written).
const SETTING_SWAP: &str = r#"
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == '1' then
  if cur ~= ARGV[3] then return 0 end
elseif cur then
  return 0
end
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[5])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 1
"#;

/// One script: its source and SHA1.
pub(crate) struct Lua {
    src: String,
    sha: String,
    /// Whether the script may write (then `--redis-wait-replicas` waits for
    /// the replicas after it).
    pub(crate) writes: bool,
}

/// Redis 7 script flags of a script's `#!lua` line.
#[derive(Clone, Copy)]
enum Flags {
    /// Writes; refused when the server is at `maxmemory`.
    Write,
    /// Writes, also when the server is at `maxmemory` (drains it).
    AllowOom,
    /// Reads only.
    NoWrites,
}

impl Lua {
    fn new(body: &str, prelude: bool, flags: Flags) -> Lua {
        let shebang = match flags {
            Flags::Write => "#!lua",
            Flags::AllowOom => "#!lua flags=allow-oom",
            Flags::NoWrites => "#!lua flags=no-writes",
        };
        let src = if prelude {
            format!("{shebang}\n{PRELUDE}\n{body}")
        } else {
            format!("{shebang}\n{body}")
        };
        let sha = redis::Script::new(&src).get_hash().to_string();
        let writes = !matches!(flags, Flags::NoWrites);
        Lua { src, sha, writes }
    }

    /// Runs the script by SHA; on `NOSCRIPT` sends the source once (which
    /// caches it on that server). `args` fills in ARGV.
    pub(crate) fn call(
        &self,
        con: &mut dyn ConnectionLike,
        keys: &[String],
        args: &dyn Fn(&mut Cmd),
    ) -> RedisResult<Value> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.sha).arg(keys.len()).arg(keys);
        args(&mut cmd);
        match cmd.query::<Value>(con) {
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(&self.src).arg(keys.len()).arg(keys);
                args(&mut cmd);
                cmd.query(con)
            }
            other => other,
        }
    }
}

/// How many bytes the `keys` hash's pin holds ([`keys_pin_value`]).
pub(crate) const KEYS_PIN_BYTES: usize = 1024;

/// The value of the `keys` hash's pin: one field (named by a NUL byte, which
/// no routing key holds) whose value is longer than Redis's bound for a
/// listpack hash (`hash-max-listpack-value`, 64 bytes by default), so the
/// hash keeps its hash-table encoding. A small hash is otherwise a listpack
/// (up to `hash-max-listpack-entries` fields, 512 by default), searched
/// field by field: a shard of a few hundred keys then spent about a fifth of
/// redis-server's time in that search. The value reads as a key with
/// nothing waiting and nothing in flight (`0 0 0 0 ` then zeros: five
/// numbers, every one 0, for the strict parser of builds that read key
/// layout 2 only as for the later ones), so a process built before the pin
/// lists it as a key with nothing in it (one more key in its counts) and its
/// replies stay well formed. Written at init and at adopt; the scripts that
/// list or count keys skip it, and the enqueue script refuses it as a key.
pub(crate) fn keys_pin_value() -> String {
    let mut v = String::from("0 0 0 0 ");
    v.push_str(&"0".repeat(KEYS_PIN_BYTES - v.len()));
    v
}

/// Every script, built once per backend.
pub(crate) struct Scripts {
    pub(crate) enqueue: Lua,
    pub(crate) dedup_export: Lua,
    pub(crate) dedup_import: Lua,
    pub(crate) claim: Lua,
    pub(crate) peek_ready: Lua,
    pub(crate) ack: Lua,
    pub(crate) fail: Lua,
    pub(crate) back_off: Lua,
    pub(crate) group_bucket: Lua,
    pub(crate) extend: Lua,
    pub(crate) relimit: Lua,
    pub(crate) layout_raise: Lua,
    pub(crate) adopt: Lua,
    pub(crate) init_shard: Lua,
    pub(crate) shard_record: Lua,
    pub(crate) key_counts: Lua,
    pub(crate) stats: Lua,
    pub(crate) fence_set: Lua,
    pub(crate) fence_get: Lua,
    pub(crate) epoch_raise: Lua,
    pub(crate) export: Lua,
    pub(crate) export_many: Lua,
    pub(crate) import: Lua,
    pub(crate) imported_up_to: Lua,
    pub(crate) purge_key: Lua,
    pub(crate) moved_away: Lua,
    pub(crate) finished: Lua,
    pub(crate) freeze: Lua,
    pub(crate) dead_list: Lua,
    pub(crate) job_show: Lua,
    pub(crate) key_jobs: Lua,
    pub(crate) cancel: Lua,
    pub(crate) dead_move: Lua,
    pub(crate) lease: Lua,
    pub(crate) lease_release: Lua,
    pub(crate) map_publish: Lua,
    pub(crate) inventory: Lua,
    pub(crate) next_due: Lua,
    pub(crate) lock_renew: Lua,
    pub(crate) lock_release: Lua,
    pub(crate) lock_epoch: Lua,
    pub(crate) setting_swap: Lua,
}

impl Scripts {
    pub(crate) fn new() -> Scripts {
        Scripts {
            enqueue: Lua::new(ENQUEUE, true, Flags::Write),
            dedup_export: Lua::new(DEDUP_EXPORT, true, Flags::NoWrites),
            dedup_import: Lua::new(DEDUP_IMPORT, true, Flags::Write),
            claim: Lua::new(CLAIM, true, Flags::AllowOom),
            peek_ready: Lua::new(PEEK_READY, true, Flags::AllowOom),
            ack: Lua::new(ACK, true, Flags::AllowOom),
            fail: Lua::new(FAIL, true, Flags::AllowOom),
            back_off: Lua::new(BACK_OFF, true, Flags::AllowOom),
            group_bucket: Lua::new(GROUP_BUCKET, false, Flags::AllowOom),
            extend: Lua::new(EXTEND, true, Flags::AllowOom),
            relimit: Lua::new(RELIMIT, true, Flags::AllowOom),
            layout_raise: Lua::new(LAYOUT_RAISE, true, Flags::AllowOom),
            adopt: Lua::new(ADOPT, true, Flags::AllowOom),
            init_shard: Lua::new(INIT_SHARD, false, Flags::Write),
            shard_record: Lua::new(SHARD_RECORD, false, Flags::NoWrites),
            key_counts: Lua::new(KEY_COUNTS, true, Flags::NoWrites),
            stats: Lua::new(STATS, true, Flags::NoWrites),
            fence_set: Lua::new(FENCE_SET, true, Flags::AllowOom),
            fence_get: Lua::new(FENCE_GET, true, Flags::NoWrites),
            epoch_raise: Lua::new(EPOCH_RAISE, true, Flags::AllowOom),
            export: Lua::new(&format!("{EXPORT_KEY_FN}{EXPORT}"), true, Flags::NoWrites),
            export_many: Lua::new(
                &format!("{EXPORT_KEY_FN}{EXPORT_MANY}"),
                true,
                Flags::NoWrites,
            ),
            freeze: Lua::new(&format!("{EXPORT_KEY_FN}{FREEZE}"), true, Flags::AllowOom),
            import: Lua::new(IMPORT, true, Flags::Write),
            imported_up_to: Lua::new(IMPORTED_UP_TO, true, Flags::NoWrites),
            purge_key: Lua::new(
                &format!(
                    "local MOVED_KEYS_KEPT, MOVED_IDS_KEPT = {}, {}\n{PURGE_KEY}",
                    shardq_core::MOVED_KEYS_KEPT,
                    shardq_core::MOVED_IDS_KEPT
                ),
                true,
                Flags::AllowOom,
            ),
            moved_away: Lua::new(MOVED_AWAY, true, Flags::NoWrites),
            finished: Lua::new(FINISHED, true, Flags::NoWrites),
            dead_list: Lua::new(DEAD_LIST, true, Flags::NoWrites),
            job_show: Lua::new(&format!("{JOB_GET}{JOB_SHOW}"), true, Flags::NoWrites),
            key_jobs: Lua::new(
                &format!("{JOB_GET}{EXPORT_KEY_FN}{KEY_JOBS}"),
                true,
                Flags::NoWrites,
            ),
            cancel: Lua::new(CANCEL, true, Flags::AllowOom),
            dead_move: Lua::new(DEAD_MOVE, true, Flags::AllowOom),
            lease: Lua::new(LEASE, false, Flags::AllowOom),
            lease_release: Lua::new(LEASE_RELEASE, false, Flags::AllowOom),
            map_publish: Lua::new(MAP_PUBLISH, false, Flags::Write),
            inventory: Lua::new(INVENTORY, true, Flags::NoWrites),
            next_due: Lua::new(NEXT_DUE, true, Flags::NoWrites),
            lock_renew: Lua::new(LOCK_RENEW, false, Flags::AllowOom),
            lock_release: Lua::new(LOCK_RELEASE, false, Flags::AllowOom),
            lock_epoch: Lua::new(LOCK_EPOCH, false, Flags::AllowOom),
            setting_swap: Lua::new(SETTING_SWAP, false, Flags::Write),
        }
    }
}

/// Reads replies of the scripts above.
pub(crate) mod reply {
    use redis::Value;

    /// The elements of an array reply (empty for anything else).
    pub(crate) fn items(v: &Value) -> &[Value] {
        match v {
            Value::Array(items) => items,
            _ => &[],
        }
    }

    pub(crate) fn bytes(v: &Value) -> Option<&[u8]> {
        match v {
            Value::BulkString(b) => Some(b),
            Value::SimpleString(s) => Some(s.as_bytes()),
            _ => None,
        }
    }

    pub(crate) fn string(v: &Value) -> Option<String> {
        bytes(v).map(|b| String::from_utf8_lossy(b).into_owned())
    }

    pub(crate) fn u64(v: &Value) -> Option<u64> {
        match v {
            Value::Int(i) => u64::try_from(*i).ok(),
            Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
            Value::SimpleString(s) => s.parse().ok(),
            Value::Double(d) if *d >= 0.0 => Some(*d as u64),
            _ => None,
        }
    }

    /// The status word leading a reply.
    pub(crate) fn status(v: &Value) -> String {
        items(v).first().and_then(string).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    /// The claim script raises a shard's layout by number: it must be the
    /// one this build writes, raised from the one before.
    #[test]
    fn the_claims_layout_raise_names_this_builds_layouts() {
        use crate::keys::{LAYOUT_VERSION, LAYOUT_VERSIONS_READ};
        let raise = format!(
            "if lim_keys and redis.call('HGET', K_META, 'layout') == '{}' then\n  redis.call('HSET', K_META, 'layout', '{}')",
            LAYOUT_VERSIONS_READ[0], LAYOUT_VERSION
        );
        assert!(super::CLAIM.contains(&raise), "{raise}");
        assert_eq!(LAYOUT_VERSIONS_READ, [LAYOUT_VERSION - 1, LAYOUT_VERSION]);
    }
}
