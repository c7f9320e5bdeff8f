-- export_many.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] number of keys, ARGV[6] at most this many jobs in all, ARGV[7]
-- a byte budget for the whole reply, then `key, after` per key. Reply:
-- `OK`, then per key exported (in the order given, until the jobs or the
-- budget are spent): the key, its job count n, `1` if it may have more (n
-- reached what was left of the jobs, or the budget ran out on it) else
-- `0`, then `id, record, reason` n times. A key reads at most what is
-- left of the jobs from its dead jobs and as many from its waiting ones,
-- and every key but the last returns all it read: one call reads at most
-- 2 * ARGV[6] jobs in all, however many keys it names. Read-only.
local n, left, budget = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local out = {'OK'}
for i = 0, n - 1 do
  if budget <= 0 or left <= 0 then break end
  local k = ARGV[8 + 2 * i]
  local jobs, bytes = export_key(k, tonumber(ARGV[9 + 2 * i]), left, budget)
  local got = #jobs / 3
  local more = 0
  if got >= left or bytes >= budget then more = 1 end
  budget = budget - bytes
  left = left - got
  out[#out + 1] = k
  out[#out + 1] = got
  out[#out + 1] = more
  for _, v in ipairs(jobs) do out[#out + 1] = v end
end
return out
