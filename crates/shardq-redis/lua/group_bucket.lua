-- group_bucket.lua
-- KEYS[1] a flow-control group's bucket (a hash), KEYS[2] its run slots
-- (a sorted set); ARGV[1] now ms, ARGV[2] the rate's count, ARGV[3] its
-- unit in ms, ARGV[4] the burst, ARGV[5] `take`, `hold` or `resume`
-- (lifts a hold); for `hold` ARGV[6] the hold's end; for `take` ARGV[6] the group's concurrency (0:
-- none), ARGV[7] when the slots taken lapse, ARGV[8] the longest wait for
-- a slot, ARGV[9] how many starts N, then (with a concurrency) the N runs
-- asking for a slot. The recipe of `shardq_core::flow::take_group_many`
-- in integer units (a token is `per` units, every ms adds `count`; lapsed
-- slots are dropped, a run keeps its own; the first start refused stops
-- the rest): replies {'OK', how many were taken, when to ask again (0
-- when all were)}. A bucket unused for a day expires (a new one starts
-- full); the slots a day past their latest lapse.
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
elseif ARGV[5] == 'resume' then
  held = 0
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
