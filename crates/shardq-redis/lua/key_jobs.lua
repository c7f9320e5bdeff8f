-- key_jobs.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] key, ARGV[6] at most this many: the key's runs in flight, then its
-- waiting and dead jobs in id order (the export's walk), stopping once
-- their records hold ARGV[7] bytes. Reply `OK`, then per job its id and
-- job_get.lua's six fields. Read-only.
local k, max = ARGV[5], tonumber(ARGV[6])
local out = {'OK'}
local function add(ids)
  local row = live(ids)
  if row then
    out[#out + 1] = ids
    for _, v in ipairs(row) do out[#out + 1] = v end
  end
end
local q = kparse(redis.call('HGET', K_KEYS, k), k)
for i = 1, 2 * q.n, 2 do add(idstr(q.runs[i])) end
local rows = export_key(k, 0, max, tonumber(ARGV[7]))
for i = 1, #rows, 3 do add(rows[i]) end
return out
