-- key_resume.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] a routing key, ARGV[6] how many of its waiting jobs to look at
-- from its head. Built twice, after `local LIFT = false` (`key_hold`,
-- read-only) and `local LIFT = true` (`key_resume`). The key's jobs held
-- by a handler's back-off are its waiting jobs whose not-before is still
-- ahead and is the one back_off.lua wrote in their `id~` reason field (a
-- later claim, retry or delay gives the job another one). Reply `OK`,
-- then the latest of their not-befores and their ids (nothing after `OK`:
-- no back-off holds the key). With LIFT each is due now (its record's
-- not-before is now, its `id~` goes) and the key, when it waits in `later`
-- for its head, goes to `ready`; a key sealed for a move is answered
-- `MOVING` and nothing changes.
local now = now_ms()
local k = ARGV[5]
if LIFT and redis.call('HEXISTS', K_SEALED, k) == 1 then return {'MOVING'} end
local out = {'OK'}
if redis.call('EXISTS', K_REASON) == 0 then return out end
local q = kparse(redis.call('HGET', K_KEYS, k), k)
local held, latest = {}, 0
local at, steps, max = q.h, 0, tonumber(ARGV[6])
while at ~= 0 and steps < max do
  steps = steps + 1
  local ids = idstr(at)
  local mark = redis.call('HGET', K_REASON, ids .. '~')
  if mark then
    local r = redis.call('HGET', K_JOBS, ids)
    local nbf = r and rec_nbf(r)
    if nbf and nbf > now and idstr(nbf) == mark then
      held[#held + 1] = ids
      if nbf > latest then latest = nbf end
      if LIFT then
        local _, a = rec_parse(r)
        redis.call('HSET', K_JOBS, ids, rec_set(r, now, a))
        redis.call('HDEL', K_REASON, ids .. '~')
        redis.call('ZREM', K_DELAYED, ids)
      end
    end
  end
  at = tonumber(redis.call('HGET', K_NEXT, ids) or '0')
end
if #held == 0 then return out end
-- Waiting in `later` for a head that is due now: ready at the next claim.
if LIFT and redis.call('ZREM', K_LATER, k) == 1 then kready(k, q, nil, now) end
out[#out + 1] = idstr(latest)
for _, ids in ipairs(held) do out[#out + 1] = ids end
return out
