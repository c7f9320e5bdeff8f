-- lease.lua
-- KEYS[1] the shard's lease, KEYS[2] its meta. ARGV[2] owner, ARGV[3] the
-- caller's token ('' for none), ARGV[4] lease ms, ARGV[5] `1` to take a
-- free or lapsed lease, ARGV[6] the deployment id, ARGV[7] the token to
-- write when taking it. Tokens are `<owner>#<epoch>#<n>` with a random
-- epoch per coordinator: a store that lost or rewound the lease can never
-- hand a second worker the token the first still holds. A caller whose
-- token is not the stored one gets STALE (it lost the shard) and takes
-- nothing in that call.
local d = redis.call('HGET', KEYS[2], 'dep')
if d ~= ARGV[6] then return {'LOST', d or ''} end
local now = tonumber(ARGV[1])
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local l = redis.call('HMGET', KEYS[1], 'owner', 'token', 'until')
local owner, token, untl = l[1], l[2], tonumber(l[3] or '0')
local function idstr(n) return string.format('%d', n) end
if ARGV[3] ~= '' then
  if token == ARGV[3] then
    redis.call('HSET', KEYS[1], 'until', idstr(now + tonumber(ARGV[4])))
    return {'HELD', token}
  end
  return {'STALE', owner or '', untl}
end
-- A retry after a lost GAINED reply finds its own new token.
if ARGV[7] ~= '' and token == ARGV[7] then
  redis.call('HSET', KEYS[1], 'until', idstr(now + tonumber(ARGV[4])))
  return {'GAINED', token}
end
if owner and owner ~= '' and untl >= now then return {'OTHER', owner, untl} end
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'token', ARGV[7], 'until', idstr(now + tonumber(ARGV[4])))
  return {'GAINED', ARGV[7]}
end
return {'FREE'}
