-- cancel.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- Cancels one job that is not running: ARGV[5] its id. A dead job leaves
-- the dead letters; a waiting one is unlinked from its key's queue (a walk
-- from the head of at most ARGV[6] steps), and when it was the head the key
-- is scheduled by its new head; a running one has its run fence cleared
-- (`STOPPING`: see `requeue`). Reply `CANCELLED`, `STOPPING`, `MOVING` (its
-- key is sealed for a move), `NOTFOUND`, or `TOOFAR` with the bound.
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
  unbury(ids, k)
  local _, a = rec_parse(r)
  keep_finished({finished_entry(ids, r, 'x', a, now)})
  unkey(ids, r)
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
keep_finished({finished_entry(ids, r, 'x', a, now)})
unkey(ids, r)
redis.call('HDEL', K_JOBS, ids)
forget({ids})
redis.call('ZREM', K_DELAYED, ids)
kstore(k, q)
-- A key waiting in `later` for the head it lost waits for its new head;
-- one in `ready` is checked by the next claim.
if prev == 0 and redis.call('ZREM', K_LATER, k) == 1 then kready(k, q, head_nbf(), now) end
return {'CANCELLED'}
