-- import.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] the shard the jobs come from, ARGV[6] number of keys, then per
-- key: the key, its job count c, then c times `source id, not_before,
-- attempts, max_attempts, created, payload, reason, dedup id` (reason
-- empty: a waiting job, else a dead one; dedup id empty: none). Appends each key's jobs at its tail with
-- new ids, skipping source ids at or below the key's import cursor
-- (`imported` field `<from len>|<from><key>`), so a rerun stores nothing
-- twice. Each call's stored jobs go to the `movedin` list as one entry,
-- `<count>|<lowest source id>|<highest source id>|<from byte length>|<from>,<source id>:<new id>,...,`,
-- within MOVED_KEYS_KEPT entries and MOVED_IDS_KEPT ids (`movedinn` in
-- `meta` counts them), and each pair to the `imported` hash as
-- `#<from byte length>|<from><source id>` -> new id (dropped with its list
-- entry), so an id from before a move finds its copy in one read
-- (imported_as.lua). Reply: `OK`, then `key, source id, new id` per job
-- stored.
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
    local src = tonumber(ARGV[p + 2 + 8 * j])
    if src > top then
      top = src
      n = n + 1
    end
  end
  plan[#plan + 1] = {k = k, c = c, p = p + 2, cf = cf, done = done, top = top}
  fresh_n = fresh_n + n
  p = p + 2 + 8 * c
end
local out = {'OK'}
if fresh_n == 0 then return out end
local id = redis.call('HINCRBY', K_META, 'seq', fresh_n) - fresh_n
local jobs, nxt, dly, cur, kk = {}, {}, {}, {}, {}
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
      local b = pl.p + 8 * j
      local src = tonumber(ARGV[b])
      if src > top then
        top = src
        id = id + 1
        local ids = idstr(id)
        local nbf, why = ARGV[b + 1], ARGV[b + 6]
        jobs[#jobs + 1] = ids
        local did = ARGV[b + 7]
        jobs[#jobs + 1] = nbf .. '|' .. ARGV[b + 2] .. '|' .. ARGV[b + 3] .. '|' .. ARGV[b + 4] .. '|' .. #k .. '|' .. #did .. '|' .. k .. did .. ARGV[b + 5]
        if why ~= '' then
          bury(ids, k, why)
        else
          -- A keyed job copied here holds its id here.
          if string.sub(did, 1, 7) == 'unique:' or string.sub(did, 1, 9) == 'debounce:' then
            kk[#kk + 1] = dfield(k, did)
            kk[#kk + 1] = ids
          end
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
flush(kk, 'HSET', K_KEYED)
if stored > 0 then redis.call('HINCRBY', K_META, 'pend', stored) end
-- The copies' ids, by source id.
local K_MOVEDIN = KEYS[23]
local pairs_, index, lo, hi = {}, {}, nil, nil
local ix = '#' .. #from .. '|' .. from
for i = 2, #out, 3 do
  local src = tonumber(out[i + 1])
  pairs_[#pairs_ + 1] = out[i + 1] .. ':' .. out[i + 2]
  index[#index + 1] = ix .. out[i + 1]
  index[#index + 1] = out[i + 2]
  if not lo or src < lo then lo = src end
  if not hi or src > hi then hi = src end
end
if #pairs_ > 0 then
  flush(index, 'HSET', K_IMPORTED)
  local entry = #pairs_ .. '|' .. idstr(lo) .. '|' .. idstr(hi) .. '|' .. #from .. '|' .. from .. ',' .. table.concat(pairs_, ',') .. ','
  -- An entry dropped from the list takes its pairs out of the index.
  local function unindex(old)
    local len, rest = string.match(old, '^%d+|%d+|%d+|(%d+)|()')
    if not len then return end
    local src_shard = string.sub(old, rest, rest + tonumber(len) - 1)
    local gone = {}
    for src in string.gmatch(string.sub(old, rest + tonumber(len)), ',(%d+):') do
      gone[#gone + 1] = '#' .. len .. '|' .. src_shard .. src
    end
    for i = 1, #gone, 4000 do
      redis.call('HDEL', K_IMPORTED, unpack(gone, i, math.min(i + 3999, #gone)))
    end
  end
  history_push(K_MOVEDIN, 'movedinn', entry, #pairs_, MOVED_KEYS_KEPT, MOVED_IDS_KEPT, unindex)
end
return out
