-- enqueue.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] map version, ARGV[6] job count n, ARGV[7] dedup window in ms
-- (0 when no job has a dedup id), then per job: key, payload, delay_ms,
-- max_attempts, dedup id (empty for none), keyed mode (empty: none; `u` a
-- unique job while its id waits, `U` while it waits or runs, `d<max_ms>`
-- a debounced one). Fence check, dedup check and append in one step. The
-- reply after `OK` has one item per job: its new id, `D<job>|<shard>` for
-- a duplicate (shard empty: this shard), or `B<job>` for the waiting job a
-- debounce gave its payload. A keyed job meets the key's newest job with
-- its id (`keyed`) while that job lives, not a dedup record.
local now = now_ms()
local n = tonumber(ARGV[6])
local window = tonumber(ARGV[7])
local A = 8
-- Fields per job.
local S = 6
-- A routing key holds no NUL byte: the keys hash's pin is named by one,
-- and `deadk` separates a key from its ids with one (producers refuse
-- control characters; this guards the store from one that does not).
for i = 0, n - 1 do
  if string.find(ARGV[A + S * i], KEYS_PIN, 1, true) then return redis.error_reply('shardq: a routing key holds no NUL byte') end
end
local fmin = tonumber(redis.call('HGET', K_META, 'fmin') or '0')
if tonumber(ARGV[5]) < fmin then return {'FENCED', ARGV[A], fmin} end
if redis.call('SCARD', K_PAUSED) > 0 then
  for i = 0, n - 1 do
    local k = ARGV[A + S * i]
    if redis.call('SISMEMBER', K_PAUSED, k) == 1 then
      -- Paused and sealed: frozen, its backlog is on the shard it moves to.
      local to = redis.call('HGET', K_SEALED, k)
      if to then return {'MOVED', k, to} end
      return {'PAUSED', k}
    end
  end
end
-- Dedup: forget a bounded number of expired records (`dedup_forget`), then
-- look each id up. A record `<job>|<expires_ms>|<shard>` counts only before
-- it expires.
local out, keep = {'OK'}, {}
local dd, dx = {}, {}
-- The batch's dedup records in one read: fs[i] is job i's field.
local fs, rs = {}, {}
if window > 0 then
  dedup_forget(now)
  local list, at = {}, {}
  for i = 0, n - 1 do
    local d = ARGV[A + 4 + S * i]
    if d ~= '' and ARGV[A + 5 + S * i] == '' then
      fs[i] = dfield(ARGV[A + S * i], d)
      list[#list + 1] = fs[i]
      at[#list] = i
    end
  end
  if #list > 0 then
    for x, r in ipairs(redis.call('HMGET', K_DEDUP, unpack(list))) do rs[at[x]] = r end
  end
end
local batch, inb = {}, {}
-- Keyed jobs: kb[field] is the batch's job stored for the id (a later one
-- of the batch meets it: `same`, and a debounce's payload and delay in
-- `over`); `reb` the waiting jobs a debounce gives its payload, written
-- once every job of the batch was checked.
local kb, same, over, reb = {}, {}, {}, {}
for i = 0, n - 1 do
  local f = fs[i]
  local mode = ARGV[A + 5 + S * i]
  if mode ~= '' then
    local k, d = ARGV[A + S * i], ARGV[A + 4 + S * i]
    local kf = dfield(k, d)
    local debounce = string.sub(mode, 1, 1) == 'd'
    local j = kb[kf]
    if j then
      same[i] = j
      if debounce then over[j] = i end
    else
      local e, running = keyed_live(kf)
      if e and not debounce and (mode == 'U' or not running) then
        out[i + 2] = 'D' .. e .. '|'
      elseif e and debounce and not running then
        -- Its copy on the shard it moves to would miss the payload: the
        -- producer waits for the move and finds the copy there.
        if redis.call('HEXISTS', K_SEALED, k) == 1 then return {'PAUSED', k} end
        reb[#reb + 1] = {e, i, tonumber(string.sub(mode, 2))}
        out[i + 2] = 'B' .. e
      else
        kb[kf] = i
        keep[#keep + 1] = i
      end
    end
  elseif f then
    local r = rs[i]
    local dup = nil
    if r then
      local job, exp, sh = string.match(r, '^(%d+)|(%d+)|(.*)$')
      if tonumber(exp) > now then dup = 'D' .. job .. '|' .. sh end
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
-- A debounce met a waiting job: it takes the payload and starts `delay`
-- from now, never past its first enqueue + max; it keeps its id and place
-- (a head waiting in `later` waits for its new start).
for _, x in ipairs(reb) do
  local e, i, max = x[1], x[2], x[3]
  local r = redis.call('HGET', K_JOBS, e)
  local _, a, mx, c, k, d = rec_parse(r)
  local nbf = math.min(now + tonumber(ARGV[A + 2 + S * i]), c + max)
  redis.call('HSET', K_JOBS, e, idstr(nbf) .. '|' .. idstr(a) .. '|' .. idstr(mx) .. '|' .. idstr(c) .. '|' .. nstr(#k) .. '|' .. nstr(#d) .. '|' .. k .. d .. ARGV[A + 1 + S * i])
  if nbf > now then redis.call('ZADD', K_DELAYED, nbf, e) else redis.call('ZREM', K_DELAYED, e) end
  redis.call('HDEL', K_REASON, e .. '~')
  local q = kparse(redis.call('HGET', K_KEYS, k), k)
  if q.h == tonumber(e) and redis.call('ZSCORE', K_LATER, k) then redis.call('ZADD', K_LATER, nbf, k) end
end
local m = #keep
if m == 0 then
  for i, j in pairs(inb) do out[i + 2] = out[j + 2] end
  return out
end
local cand, qs = {}, {}
for _, i in ipairs(keep) do
  local k = ARGV[A + S * i]
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
local jobs, nxt, dly, kk = {}, {}, {}, {}
for j, i in ipairs(keep) do
  local k, d = ARGV[A + S * i], tonumber(ARGV[A + 2 + S * i])
  local id = first + j - 1
  local ids = idstr(id)
  out[i + 2] = ids
  local mode = ARGV[A + 5 + S * i]
  -- A debounce later in the batch: its payload and delay.
  local pi = over[i] or i
  if mode ~= '' then
    kk[#kk + 1] = dfield(k, ARGV[A + 4 + S * i])
    kk[#kk + 1] = ids
    if string.sub(mode, 1, 1) == 'd' then
      d = math.min(tonumber(ARGV[A + 2 + S * pi]), tonumber(string.sub(mode, 2)))
    end
  end
  local nbf, nbfs = now, nows
  if d > 0 then
    nbf = now + d
    nbfs = idstr(nbf)
    dly[#dly + 1] = nbfs
    dly[#dly + 1] = ids
  end
  jobs[#jobs + 1] = ids
  local did = ARGV[A + 4 + S * i]
  jobs[#jobs + 1] = nbfs .. '|0|' .. ARGV[A + 3 + S * i] .. '|' .. nows .. '|' .. nstr(#k) .. '|' .. nstr(#did) .. '|' .. k .. did .. ARGV[A + 1 + S * pi]
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
-- A duplicate within the batch names the job stored for the first of it;
-- a keyed job of the batch met by a later one, likewise (a unique one as
-- a duplicate, a debounce by the id it gave its payload).
for i, j in pairs(inb) do out[i + 2] = 'D' .. out[j + 2] .. '|' end
for i, j in pairs(same) do
  if string.sub(ARGV[A + 5 + S * i], 1, 1) == 'd' then out[i + 2] = 'B' .. out[j + 2] else out[i + 2] = 'D' .. out[j + 2] .. '|' end
end
redis.call('HSET', K_JOBS, unpack(jobs))
if #kk > 0 then redis.call('HSET', K_KEYED, unpack(kk)) end
if #nxt > 0 then redis.call('HSET', K_NEXT, unpack(nxt)) end
if #dd > 0 then
  redis.call('HSET', K_DEDUP, unpack(dd))
  dedup_mark('#' .. idstr(first), exps, dx)
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
