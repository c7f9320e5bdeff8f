-- fail.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] id, ARGV[6] run fence, ARGV[7] reason, ARGV[8] backoff base ms,
-- ARGV[9] backoff max ms, ARGV[10] retry delay ms (empty: the backoff),
-- ARGV[11] `exp` or `fixed`, ARGV[12] the share the jitter takes off the
-- backoff, in millionths (core's `Backoff::jitter_share`).
-- The retry goes back to the head of its key.
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
local id = ARGV[5]
local k = key_of(id, '')
local q = nil
if k ~= '' then q = kparse(redis.call('HGET', K_KEYS, k), k) end
local why = run_check(id, ARGV[6], k, q, now)
if why then
  -- The run a cancel stopped failed: its handler is over, so its job ends
  -- now rather than when its lease lapses.
  if why == CANCELLED_RUN and cancelled_run_is(id, ARGV[6]) then requeue(id, why, now) end
  return {'STALE', why}
end
local r = redis.call('HGET', K_JOBS, id)
local _, a, m = rec_parse(r)
a = a + 1
redis.call('ZREM', K_INF, id)
redis.call('HSET', K_REASON, id, ARGV[7])
settle_start(id, ARGV[6], now)
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
