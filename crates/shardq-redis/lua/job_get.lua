-- job_get.lua: a library, put before the scripts that use it.
-- One live job, as an operator reads it: ARGV[5] its id. Reply `NONE`
-- when no live job has the id, else the state (`RUN`, `DEAD`, `DELAYED`,
-- `QUEUED`), the record, the last failure reason (empty for none), and for
-- a run its fence and job lease deadline (`0` otherwise). Read-only.
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
