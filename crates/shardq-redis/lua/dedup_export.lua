-- dedup_export.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] key (empty: every key, for the key list only): the live dedup
-- records of the shard, as `field, record` pairs, at most ARGV[6] of them
-- from HSCAN cursor ARGV[7]; the reply is `OK`, the next cursor, then the
-- pairs. Read-only.
local now = now_ms()
local want = ARGV[5]
local r = redis.call('HSCAN', K_DEDUP, ARGV[7], 'COUNT', tonumber(ARGV[6]))
local out = {'OK', r[1]}
local items = r[2]
for i = 1, #items, 2 do
  local f, v = items[i], items[i + 1]
  local kl, p = string.match(f, '^(%d+)|()')
  local k = string.sub(f, p, p + tonumber(kl) - 1)
  local _, exp = string.match(v, '^(%d+)|(%d+)|')
  if tonumber(exp) > now and (want == '' or want == k) then
    out[#out + 1] = f
    out[#out + 1] = v
  end
end
return out
