-- back_off.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] id, ARGV[6] run fence, ARGV[7] routing key (empty when the
-- caller does not know it), ARGV[8] back-off ms, ARGV[9] `1` when a
-- handler backed off (not flow control). Ends the run without using an
-- attempt (the handler backed off, or flow control gave the run back):
-- the job goes back to the head of its key with its attempt count and not
-- before now + back-off, and its run's start time goes with it. A
-- handler's back-off writes that not-before in the job's `id~` reason
-- field too, so `key resume` (key_resume.lua) knows the wait for one.
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
if ARGV[9] == '1' and nbf > now then
  redis.call('HSET', K_REASON, id .. '~', idstr(nbf))
else
  redis.call('HDEL', K_REASON, id .. '~')
end
redis.call('HSET', K_JOBS, id, rec_set(r, nbf, a))
push_head(q, tonumber(id))
if nbf > now then redis.call('ZADD', K_DELAYED, nbf, id) end
kstore(k, q)
kwake(k, q, was, nbf, now)
return {'OK', nbf}
