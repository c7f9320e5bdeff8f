//! The Lua scripts: every state change of a shard is one script, so each
//! transition is atomic on the server.
//!
//! Scripts are sent as `EVALSHA` and fall back to `EVAL` (which also caches
//! the script) on `NOSCRIPT`, so a restarted server or a node that joined a
//! cluster later needs no separate loading step. Shard scripts receive the
//! shard's keys in [`crate::keys::SHARD_PARTS`] order and declare every key
//! they touch. `ARGV[1]` is the time in ms (empty: the server's `TIME`, one
//! clock for every host), `ARGV[2]` the caller's fencing token, `ARGV[3]`
//! `1` when a dead job halts its key. Replies are arrays led by a status
//! word, never Lua errors, so refusals keep their detail. Scripts must stay
//! bounded: every loop runs over a batch whose size the caller limits.

use redis::{Cmd, ConnectionLike, ErrorKind, RedisResult, Value};

/// Helpers shared by the shard scripts.
const PRELUDE: &str = r#"
local K_META, K_JOBS, K_KEYS, K_NEXT, K_READY, K_LATER, K_INF = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local K_DEAD, K_DEADN, K_DELAYED, K_PAUSED, K_LEASE, K_REASON = KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local HALT = ARGV[3] == '1'
local function now_ms()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function owns() return redis.call('HGET', K_LEASE, 'token') == ARGV[2] end
local function idstr(n) return string.format('%d', n) end
-- A job record: not_before|attempts|max_attempts|created|key length|key payload.
local function rec_parse(r)
  local n, a, m, c, kl, p = string.match(r, '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|()')
  kl = tonumber(kl)
  return tonumber(n), tonumber(a), tonumber(m), tonumber(c), string.sub(r, p, p + kl - 1)
end
local function rec_nbf(r) return tonumber(string.match(r, '^(%d+)')) end
-- The record with a new not-before and attempt count; key and payload kept.
local function rec_set(r, n, a)
  local p = string.match(r, '^%d+|%d+|()')
  return idstr(n) .. '|' .. idstr(a) .. '|' .. string.sub(r, p)
end
-- A key's queue: head, tail, depth, job in flight (ids; 0 for none).
local function kparse(s)
  if not s then return {h = 0, t = 0, d = 0, f = 0} end
  local h, t, d, f = string.match(s, '^(%d+) (%d+) (%d+) (%d+)$')
  return {h = tonumber(h), t = tonumber(t), d = tonumber(d), f = tonumber(f)}
end
local function kfmt(q) return idstr(q.h) .. ' ' .. idstr(q.t) .. ' ' .. idstr(q.d) .. ' ' .. idstr(q.f) end
-- A key with nothing waiting and nothing in flight has no entry at all.
local function kstore(k, q)
  if q.d == 0 and q.f == 0 then redis.call('HDEL', K_KEYS, k) else redis.call('HSET', K_KEYS, k, kfmt(q)) end
end
local function halted(k)
  return HALT and tonumber(redis.call('HGET', K_DEADN, k) or '0') > 0
end
-- Call only for a key that is in neither ready nor later (it was in flight
-- or had nothing waiting): restores "a key is in ready or later iff it has
-- a waiting job, nothing in flight and no halt". With no start time given
-- the key goes to ready and claim moves it to later if its head must wait.
local function kready(k, q, nbf, now)
  if q.d == 0 or q.f ~= 0 or halted(k) then return end
  if nbf and nbf > now then
    redis.call('ZADD', K_LATER, nbf, k)
  else
    redis.call('RPUSH', K_READY, k)
  end
end
-- Back to the head of its key: a failed or reclaimed job runs before the
-- key's later jobs.
local function push_head(q, id)
  if q.h ~= 0 then redis.call('HSET', K_NEXT, idstr(id), idstr(q.h)) else q.t = id end
  q.h = id
  q.d = q.d + 1
  redis.call('HINCRBY', K_META, 'pend', 1)
end
local function bury(ids, k, why)
  redis.call('ZADD', K_DEAD, tonumber(ids), ids)
  redis.call('HINCRBY', K_DEADN, k, 1)
  redis.call('HSET', K_REASON, ids, why)
end
-- Out of flight without an ack: the attempt counts; back to the head of its
-- key, or dead when out of attempts.
local function requeue(ids, why, now)
  redis.call('ZREM', K_INF, ids)
  local r = redis.call('HGET', K_JOBS, ids)
  if not r then return end
  local n, a, m, _, k = rec_parse(r)
  a = a + 1
  redis.call('HSET', K_JOBS, ids, rec_set(r, n, a))
  local q = kparse(redis.call('HGET', K_KEYS, k))
  local was_flying = q.f == tonumber(ids)
  if was_flying then q.f = 0 end
  if a >= m then bury(ids, k, why) else push_head(q, tonumber(ids)) end
  kstore(k, q)
  if was_flying then kready(k, q, nil, now) end
end
"#;

/// ARGV[4] map version, ARGV[5] job count n, then per job: key, payload,
/// delay_ms, max_attempts. Fence check and append in one step.
const ENQUEUE: &str = r#"
local now = now_ms()
local n = tonumber(ARGV[5])
local fmin = tonumber(redis.call('HGET', K_META, 'fmin') or '0')
if tonumber(ARGV[4]) < fmin then return {'FENCED', ARGV[6], fmin} end
if redis.call('SCARD', K_PAUSED) > 0 then
  for i = 0, n - 1 do
    if redis.call('SISMEMBER', K_PAUSED, ARGV[6 + 4 * i]) == 1 then return {'PAUSED', ARGV[6 + 4 * i]} end
  end
end
local first = redis.call('HINCRBY', K_META, 'seq', n) - n + 1
redis.call('HINCRBY', K_META, 'pend', n)
local cand, qs = {}, {}
for i = 0, n - 1 do
  local k = ARGV[6 + 4 * i]
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
  local q = kparse(cur[i])
  qs[k] = q
  fresh[k] = q.d == 0 and q.f == 0
end
local nows = idstr(now)
local jobs, nxt, dly = {}, {}, {}
for i = 0, n - 1 do
  local k, d = ARGV[6 + 4 * i], tonumber(ARGV[8 + 4 * i])
  local id = first + i
  local ids = idstr(id)
  local nbf, nbfs = now, nows
  if d > 0 then
    nbf = now + d
    nbfs = idstr(nbf)
    dly[#dly + 1] = nbf
    dly[#dly + 1] = ids
  end
  jobs[#jobs + 1] = ids
  jobs[#jobs + 1] = nbfs .. '|0|' .. ARGV[9 + 4 * i] .. '|' .. nows .. '|' .. #k .. '|' .. k .. ARGV[7 + 4 * i]
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
redis.call('HSET', K_JOBS, unpack(jobs))
if #nxt > 0 then redis.call('HSET', K_NEXT, unpack(nxt)) end
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
return {'OK', first}
"#;

/// ARGV[4] max jobs, ARGV[5] job lease ms, ARGV[6] reclaim batch, ARGV[7]
/// `1` when an earlier attempt's reply was lost, then the ids the caller
/// holds: in-flight jobs it does not know are put back. Replies id, record
/// per job; the attempt being made is the record's count + 1.
const CLAIM: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
if ARGV[7] == '1' then
  local known = {}
  for i = 8, #ARGV do known[ARGV[i]] = true end
  for _, ids in ipairs(redis.call('ZRANGE', K_INF, 0, -1)) do
    if not known[ids] then requeue(ids, 'claim reply lost', now) end
  end
end
for _, ids in ipairs(redis.call('ZRANGEBYSCORE', K_INF, '-inf', now, 'LIMIT', 0, tonumber(ARGV[6]))) do
  requeue(ids, 'job lease expired', now)
end
local max = tonumber(ARGV[4])
-- Keys whose wait is over first, then keys in the order they became ready.
local keys = redis.call('ZRANGEBYSCORE', K_LATER, '-inf', now, 'LIMIT', 0, max)
if #keys > 0 then redis.call('ZREM', K_LATER, unpack(keys)) end
if #keys < max then
  local more = redis.call('LPOP', K_READY, max - #keys)
  if more then
    for _, k in ipairs(more) do keys[#keys + 1] = k end
  end
end
if #keys == 0 then return {'OK'} end
local cur = redis.call('HMGET', K_KEYS, unpack(keys))
local cand, qs, heads = {}, {}, {}
for i, k in ipairs(keys) do
  local q = kparse(cur[i])
  if q.d > 0 and q.f == 0 and q.h ~= 0 then
    cand[#cand + 1] = k
    qs[#qs + 1] = q
    heads[#heads + 1] = idstr(q.h)
  end
end
if #cand == 0 then return {'OK'} end
local rs = redis.call('HMGET', K_JOBS, unpack(heads))
local nx = redis.call('HMGET', K_NEXT, unpack(heads))
local deadline = now + tonumber(ARGV[5])
local out, kq, inf, unlink, later, ids = {'OK'}, {}, {}, {}, {}, {}
for i, k in ipairs(cand) do
  local r, q = rs[i], qs[i]
  if r then
    local nbf = rec_nbf(r)
    if nbf > now then
      later[#later + 1] = nbf
      later[#later + 1] = k
    else
      local id = heads[i]
      if nx[i] then
        q.h = tonumber(nx[i])
        unlink[#unlink + 1] = id
      else
        q.h, q.t = 0, 0
      end
      q.d = q.d - 1
      q.f = tonumber(id)
      kq[#kq + 1] = k
      kq[#kq + 1] = kfmt(q)
      inf[#inf + 1] = deadline
      inf[#inf + 1] = id
      ids[#ids + 1] = id
      out[#out + 1] = id
      out[#out + 1] = r
    end
  end
end
if #later > 0 then redis.call('ZADD', K_LATER, unpack(later)) end
if #ids == 0 then return out end
redis.call('HSET', K_KEYS, unpack(kq))
if #unlink > 0 then redis.call('HDEL', K_NEXT, unpack(unlink)) end
redis.call('ZADD', K_INF, unpack(inf))
redis.call('HINCRBY', K_META, 'pend', -#ids)
if redis.call('EXISTS', K_DELAYED) == 1 then redis.call('ZREM', K_DELAYED, unpack(ids)) end
return out
"#;

/// ARGV[4..] pairs of job id and its routing key (empty when the caller
/// does not know it). Acks those in flight; names the first that is not.
const ACK: &str = r#"
if not owns() then return {'NOTOWNER'} end
local ids, ks = {}, {}
for i = 4, #ARGV - 1, 2 do
  ids[#ids + 1] = ARGV[i]
  ks[#ks + 1] = ARGV[i + 1]
end
local order, qs = {}, {}
for i, k in ipairs(ks) do
  if k == '' then
    local r = redis.call('HGET', K_JOBS, ids[i])
    if r then
      local _, _, _, _, rk = rec_parse(r)
      k = rk
      ks[i] = k
    end
  end
  if k ~= '' and not qs[k] then
    qs[k] = true
    order[#order + 1] = k
  end
end
if #order > 0 then
  local cur = redis.call('HMGET', K_KEYS, unpack(order))
  for i, k in ipairs(order) do qs[k] = kparse(cur[i]) end
end
-- A key's in-flight id is the proof: it names at most one job per key.
local done, freed, missing = {}, {}, nil
for i, id in ipairs(ids) do
  local q = qs[ks[i]]
  if q and q.f ~= 0 and q.f == tonumber(id) then
    q.f = 0
    done[#done + 1] = id
    freed[#freed + 1] = ks[i]
  elseif not missing then
    missing = id
  end
end
if #done > 0 then
  redis.call('ZREM', K_INF, unpack(done))
  redis.call('HDEL', K_JOBS, unpack(done))
  if redis.call('EXISTS', K_REASON) == 1 then redis.call('HDEL', K_REASON, unpack(done)) end
  local kq, gone, rl = {}, {}, {}
  for _, k in ipairs(freed) do
    local q = qs[k]
    if q.d == 0 then
      gone[#gone + 1] = k
    else
      kq[#kq + 1] = k
      kq[#kq + 1] = kfmt(q)
      -- Claim checks the next head's start time.
      if not halted(k) then rl[#rl + 1] = k end
    end
  end
  if #gone > 0 then redis.call('HDEL', K_KEYS, unpack(gone)) end
  if #kq > 0 then redis.call('HSET', K_KEYS, unpack(kq)) end
  if #rl > 0 then redis.call('RPUSH', K_READY, unpack(rl)) end
end
if missing then return {'NOTINFLIGHT', missing} end
return {'OK'}
"#;

/// ARGV[4] id, ARGV[5] reason, ARGV[6] backoff base ms, ARGV[7] backoff max
/// ms. The retry goes back to the head of its key.
const FAIL: &str = r#"
if not owns() then return {'NOTOWNER'} end
local id = ARGV[4]
local r = redis.call('HGET', K_JOBS, id)
if not r or not redis.call('ZSCORE', K_INF, id) then return {'NOTINFLIGHT', id} end
local now = now_ms()
local _, a, m, _, k = rec_parse(r)
a = a + 1
redis.call('ZREM', K_INF, id)
redis.call('HSET', K_REASON, id, ARGV[5])
local q = kparse(redis.call('HGET', K_KEYS, k))
local was_flying = q.f == tonumber(id)
if was_flying then q.f = 0 end
if a >= m then
  redis.call('HSET', K_JOBS, id, rec_set(r, now, a))
  bury(id, k, ARGV[5])
  kstore(k, q)
  if was_flying then kready(k, q, nil, now) end
  return {'DEAD'}
end
local delay = math.min(tonumber(ARGV[6]) * (2 ^ math.min(a - 1, 40)), tonumber(ARGV[7]))
local nbf = now + delay
redis.call('HSET', K_JOBS, id, rec_set(r, nbf, a))
push_head(q, tonumber(id))
if delay > 0 then redis.call('ZADD', K_DELAYED, nbf, id) end
kstore(k, q)
if was_flying then kready(k, q, nbf, now) end
return {'RETRY', nbf}
"#;

/// Puts every in-flight job back (a previous owner's), under the new token.
const ADOPT: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local ids = redis.call('ZRANGE', K_INF, 0, -1)
for _, id in ipairs(ids) do requeue(id, 'owner lost', now) end
return {'OK', #ids}
"#;

/// The earliest start time of a waiting head: now when a key is ready, its
/// not-before when every waiting key must wait, nil when none waits.
const NEXT_DUE: &str = r#"
if redis.call('LLEN', K_READY) > 0 then return now_ms() end
local r = redis.call('ZRANGE', K_LATER, 0, 0, 'WITHSCORES')
if r[1] then return tonumber(r[2]) end
return false
"#;

/// ARGV[4] routing key: depth, in flight (0/1), dead.
const KEY_COUNTS: &str = r#"
local k = ARGV[4]
local q = kparse(redis.call('HGET', K_KEYS, k))
local f = 0
if q.f ~= 0 then f = 1 end
return {q.d, f, tonumber(redis.call('HGET', K_DEADN, k) or '0')}
"#;

/// Ready, delayed, in flight, dead, distinct keys.
const STATS: &str = r#"
local now = now_ms()
local pending = tonumber(redis.call('HGET', K_META, 'pend') or '0')
local delayed = redis.call('ZCOUNT', K_DELAYED, '(' .. idstr(now), '+inf')
local keys = redis.call('HLEN', K_KEYS)
for _, k in ipairs(redis.call('HKEYS', K_DEADN)) do
  if redis.call('HEXISTS', K_KEYS, k) == 0 then keys = keys + 1 end
end
return {math.max(pending - delayed, 0), delayed, redis.call('ZCARD', K_INF), redis.call('ZCARD', K_DEAD), keys}
"#;

/// ARGV[4] oldest map version accepted, ARGV[5..] paused keys.
const FENCE_SET: &str = r#"
redis.call('HSET', K_META, 'fmin', ARGV[4])
redis.call('DEL', K_PAUSED)
local keys = {}
for i = 5, #ARGV do keys[#keys + 1] = ARGV[i] end
if #keys > 0 then redis.call('SADD', K_PAUSED, unpack(keys)) end
return {'OK'}
"#;

const FENCE_GET: &str = r#"
return {tonumber(redis.call('HGET', K_META, 'fmin') or '0'), redis.call('SMEMBERS', K_PAUSED)}
"#;

/// ARGV[4] limit: id, attempts, key, reason per dead job, oldest first.
const DEAD_LIST: &str = r#"
local out = {}
for _, id in ipairs(redis.call('ZRANGE', K_DEAD, 0, tonumber(ARGV[4]) - 1)) do
  local r = redis.call('HGET', K_JOBS, id)
  if r then
    local _, a, _, _, k = rec_parse(r)
    out[#out + 1] = id
    out[#out + 1] = a
    out[#out + 1] = k
    out[#out + 1] = redis.call('HGET', K_REASON, id) or ''
  end
end
return out
"#;

/// ARGV[4] `retry` or `purge`, ARGV[5] `1` for the oldest ARGV[6] dead jobs,
/// else the ids in ARGV[7..]. Returns {moved, looked at}. A retried job goes
/// back to its place in key order (by id): the walk to it passes only the
/// key's waiting jobs with smaller ids, which are earlier retried dead jobs
/// or one reclaimed job, since every other waiting job was enqueued later.
const DEAD_MOVE: &str = r#"
local now = now_ms()
local ids
if ARGV[5] == '1' then
  ids = redis.call('ZRANGE', K_DEAD, 0, tonumber(ARGV[6]) - 1)
else
  ids = {}
  for i = 7, #ARGV do ids[#ids + 1] = ARGV[i] end
end
local moved, touched, qs, startable = 0, {}, {}, {}
for _, id in ipairs(ids) do
  if redis.call('ZREM', K_DEAD, id) == 1 then
    local r = redis.call('HGET', K_JOBS, id)
    if r then
      local _, _, _, _, k = rec_parse(r)
      local q = qs[k]
      if not q then
        q = kparse(redis.call('HGET', K_KEYS, k))
        qs[k] = q
        startable[k] = q.d > 0 and q.f == 0 and not halted(k)
        touched[#touched + 1] = k
      end
      if redis.call('HINCRBY', K_DEADN, k, -1) <= 0 then redis.call('HDEL', K_DEADN, k) end
      if ARGV[4] == 'retry' then
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
      redis.call('HDEL', K_REASON, id)
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

/// KEYS[1] the shard's lease. ARGV[2] owner, ARGV[3] the caller's token (0
/// for none), ARGV[4] lease ms, ARGV[5] `1` to take a free or lapsed lease.
/// Taking over raises the token, which fences the previous owner's writes.
const LEASE: &str = r#"
local now = now_ms()
local l = redis.call('HMGET', KEYS[1], 'owner', 'token', 'until')
local owner, token, untl = l[1], l[2], tonumber(l[3] or '0')
if ARGV[3] ~= '0' and token == ARGV[3] then
  redis.call('HSET', KEYS[1], 'until', idstr(now + tonumber(ARGV[4])))
  return {'HELD', token}
end
if owner and owner ~= '' and untl >= now then return {'OTHER', owner, untl} end
if ARGV[5] == '1' then
  local t = redis.call('HINCRBY', KEYS[1], 'token', 1)
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'until', idstr(now + tonumber(ARGV[4])))
  return {'GAINED', idstr(t)}
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

/// ARGV[4] HSCAN cursor, ARGV[5] COUNT hint. Walks `keys` (every key with
/// a waiting job or one in flight, one field each however deep its
/// backlog): {next cursor ('0' when done), key, depth, in flight, dead, ...}.
const INVENTORY: &str = r#"
local r = redis.call('HSCAN', K_KEYS, ARGV[4], 'COUNT', tonumber(ARGV[5]))
local out = {r[1]}
local kv = r[2]
for i = 1, #kv, 2 do
  local k = kv[i]
  local q = kparse(kv[i + 1])
  local f = 0
  if q.f ~= 0 then f = 1 end
  out[#out + 1] = k
  out[#out + 1] = q.d
  out[#out + 1] = f
  out[#out + 1] = tonumber(redis.call('HGET', K_DEADN, k) or '0')
end
return out
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

/// One script: its source and SHA1.
pub(crate) struct Lua {
    src: String,
    sha: String,
}

impl Lua {
    fn new(body: &str, prelude: bool) -> Lua {
        let src = if prelude {
            format!("{PRELUDE}\n{body}")
        } else {
            body.to_string()
        };
        let sha = redis::Script::new(&src).get_hash().to_string();
        Lua { src, sha }
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

/// Every script, built once per backend.
pub(crate) struct Scripts {
    pub(crate) enqueue: Lua,
    pub(crate) claim: Lua,
    pub(crate) ack: Lua,
    pub(crate) fail: Lua,
    pub(crate) adopt: Lua,
    pub(crate) key_counts: Lua,
    pub(crate) stats: Lua,
    pub(crate) fence_set: Lua,
    pub(crate) fence_get: Lua,
    pub(crate) dead_list: Lua,
    pub(crate) dead_move: Lua,
    pub(crate) lease: Lua,
    pub(crate) lease_release: Lua,
    pub(crate) map_publish: Lua,
    pub(crate) inventory: Lua,
    pub(crate) next_due: Lua,
    pub(crate) lock_renew: Lua,
    pub(crate) lock_release: Lua,
}

impl Scripts {
    pub(crate) fn new() -> Scripts {
        Scripts {
            enqueue: Lua::new(ENQUEUE, true),
            claim: Lua::new(CLAIM, true),
            ack: Lua::new(ACK, true),
            fail: Lua::new(FAIL, true),
            adopt: Lua::new(ADOPT, true),
            key_counts: Lua::new(KEY_COUNTS, true),
            stats: Lua::new(STATS, true),
            fence_set: Lua::new(FENCE_SET, true),
            fence_get: Lua::new(FENCE_GET, true),
            dead_list: Lua::new(DEAD_LIST, true),
            dead_move: Lua::new(DEAD_MOVE, true),
            lease: Lua::new(LEASE, true),
            lease_release: Lua::new(LEASE_RELEASE, false),
            map_publish: Lua::new(MAP_PUBLISH, false),
            inventory: Lua::new(INVENTORY, true),
            next_due: Lua::new(NEXT_DUE, true),
            lock_renew: Lua::new(LOCK_RENEW, false),
            lock_release: Lua::new(LOCK_RELEASE, false),
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
