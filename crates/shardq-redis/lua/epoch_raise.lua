-- epoch_raise.lua
-- KEYS: the shard's keys in SHARD_PARTS order (docs/redis-protocol.md).
-- ARGV[1..4]: now ms (empty: the server's TIME), the caller's lease
-- token, `1` when a dead job halts its key, the deployment id.
-- Raises the shard's rebalance epoch (the prelude does it, given `@N`).
return {'OK'}
