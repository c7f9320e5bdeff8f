-- setting_swap.lua
-- Compare-and-set of one deployment setting (a field of the settings
-- hash). KEYS: the settings hash. ARGV: name, `1` when a current text is
-- expected (else the field must be absent), that text, `1` to store
-- (else clear), the new text. Replies 1 once changed, 0 when the field
-- holds something else (nothing written). A field that already holds the
-- new text replies 1: a call retried after its reply was lost finds its
-- own write, and the caller must not apply its change a second time.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[4] == '1' and cur == ARGV[5] then return 1 end
if ARGV[4] ~= '1' and not cur and ARGV[2] == '1' then return 1 end
if ARGV[2] == '1' then
  if cur ~= ARGV[3] then return 0 end
elseif cur then
  return 0
end
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[5])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 1
