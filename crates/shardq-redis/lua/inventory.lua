-- inventory.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] HSCAN cursor: `k<n>` walks `keys` (every key with a waiting job
-- or one in flight), then `d<n>` walks `deadn` for keys whose only jobs
-- are dead letters (they tie the key to this shard as much as live work
-- does). ARGV[6] COUNT hint. Replies {next cursor ('0' when done), key,
-- depth, in flight, dead, ...}.
local phase, cur = string.sub(ARGV[5], 1, 1), string.sub(ARGV[5], 2)
local out = {}
if phase == 'k' then
  local r = redis.call('HSCAN', K_KEYS, cur, 'COUNT', tonumber(ARGV[6]))
  if r[1] == '0' then out[1] = 'd0' else out[1] = 'k' .. r[1] end
  local kv = r[2]
  for i = 1, #kv, 2 do
    local k = kv[i]
    if k ~= KEYS_PIN then
      local q = kparse(kv[i + 1], k)
      out[#out + 1] = k
      out[#out + 1] = q.d
      out[#out + 1] = q.n
      out[#out + 1] = tonumber(redis.call('HGET', K_DEADN, k) or '0')
    end
  end
else
  local r = redis.call('HSCAN', K_DEADN, cur, 'COUNT', tonumber(ARGV[6]))
  if r[1] == '0' then out[1] = '0' else out[1] = 'd' .. r[1] end
  local kv = r[2]
  for i = 1, #kv, 2 do
    local k, n = kv[i], tonumber(kv[i + 1])
    if n > 0 and redis.call('HEXISTS', K_KEYS, k) == 0 then
      out[#out + 1] = k
      out[#out + 1] = 0
      out[#out + 1] = 0
      out[#out + 1] = n
    end
  end
end
return out
