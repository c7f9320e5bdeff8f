-- limits_put.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- ARGV[5] `1` on the first call of a rewrite (the old copy is dropped
-- first), ARGV[6] the version the rewrite's last call writes (empty in the
-- calls before it), ARGV[7] the default limit, ARGV[8] the prefix lengths
-- (byte n `1` when some prefix is n bytes long), then field and limit
-- pairs, `=<key>` or `^<prefix>` (at most LIMITS_BATCH_MAX pairs a call).
-- Writes the shard's copy of the run limits (`limits`, see keys.rs), which
-- claim.lua reads per key. Until the last call writes the version, a claim
-- finds no version and answers LIMITS, so a half-written copy is never
-- used. Replies {'OK'}.
if not owns() then return {'NOTOWNER'} end
-- UNLINK frees a large hash off the script's thread.
if ARGV[5] == '1' then redis.call('UNLINK', K_LIMITS) end
if #ARGV >= 10 then redis.call('HSET', K_LIMITS, unpack(ARGV, 9, #ARGV)) end
if ARGV[6] ~= '' then
  redis.call('HSET', K_LIMITS, LIM_DEFAULT, ARGV[7], LIM_LENGTHS, ARGV[8], LIM_VERSION, ARGV[6])
end
return {'OK'}
