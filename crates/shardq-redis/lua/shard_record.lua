-- shard_record.lua
-- KEYS[1] meta of a shard: its deployment id and layout version.
return redis.call('HMGET', KEYS[1], 'dep', 'layout')
