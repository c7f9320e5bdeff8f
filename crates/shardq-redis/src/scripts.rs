//! The Lua scripts: every state change of a shard is one script, so each
//! transition is atomic on the server.
//!
//! Scripts are sent as `EVALSHA` and fall back to `EVAL` (which also caches
//! the script) on `NOSCRIPT`, so a restarted server or a node that joined a
//! cluster later needs no separate loading step. Shard scripts receive the
//! shard's keys in [`crate::keys::SHARD_PARTS`] order and declare every key
//! they touch. `ARGV[1]` is the time in ms (empty: the server's `TIME`, one
//! clock for every host), `ARGV[2]` the caller's fencing token, `ARGV[3]`
//! `1` when a dead job halts its key. Replies are arrays led by a status
//! word, never Lua errors, so refusals keep their detail. Scripts must stay
//! bounded: every loop runs over a batch whose size the caller limits.

use redis::{Cmd, ConnectionLike, ErrorKind, RedisResult, Value};

/// Helpers shared by the shard scripts.
const PRELUDE: &str = r#"
local K_META, K_PEND, K_READY, K_INF, K_HDR, K_PAY, K_BUSY = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local K_DEAD, K_DEADN, K_DELAYED, K_PAUSED, K_LEASE, K_REASON = KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local HALT = ARGV[3] == '1'
local function now_ms()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function owns() return redis.call('HGET', K_LEASE, 'token') == ARGV[2] end
local function idstr(n) return string.format('%d', n) end
local function kprefix(k) return string.format('%04x', #k) .. k end
local function member(k, id) return kprefix(k) .. string.format('%016x', id) end
local function member_id(mem) return tonumber(string.sub(mem, -16), 16) end
local function parse(h)
  local a, m, c, n, k = string.match(h, '^(%d+)|(%d+)|(%d+)|(%d+)|(.*)$')
  return tonumber(a), tonumber(m), tonumber(c), tonumber(n), k
end
local function header(a, m, c, n, k)
  return idstr(a) .. '|' .. idstr(m) .. '|' .. idstr(c) .. '|' .. idstr(n) .. '|' .. k
end
local function head(k)
  local p = kprefix(k)
  local r = redis.call('ZRANGEBYLEX', K_PEND, '[' .. p, '(' .. p .. 'g', 'LIMIT', 0, 1)
  return r[1]
end
local function halted(k)
  return HALT and tonumber(redis.call('HGET', K_DEADN, k) or '0') > 0
end
-- The one place that restores "a key is in ready iff it has pending jobs,
-- nothing in flight and is not halted", with its head's start time.
local function refresh(k, free)
  if (not free and redis.call('HEXISTS', K_BUSY, k) == 1) or halted(k) then
    redis.call('ZREM', K_READY, k)
    return
  end
  local mem = head(k)
  if not mem then
    redis.call('ZREM', K_READY, k)
    return
  end
  local _, _, _, n = parse(redis.call('HGET', K_HDR, idstr(member_id(mem))))
  redis.call('ZADD', K_READY, n, k)
end
local function bury(ids, k, why)
  redis.call('ZADD', K_DEAD, tonumber(ids), ids)
  redis.call('HINCRBY', K_DEADN, k, 1)
  redis.call('HSET', K_REASON, ids, why)
end
-- Out of flight without an ack: back to the head of its key (its id is the
-- key's smallest), or dead when out of attempts.
local function requeue(ids, why)
  redis.call('ZREM', K_INF, ids)
  local h = redis.call('HGET', K_HDR, ids)
  if not h then return end
  local a, m, _, _, k = parse(h)
  if redis.call('HGET', K_BUSY, k) == ids then redis.call('HDEL', K_BUSY, k) end
  if a >= m then
    bury(ids, k, why)
  else
    redis.call('ZADD', K_PEND, 0, member(k, tonumber(ids)))
  end
  refresh(k, false)
end
"#;

/// ARGV[4] map version, ARGV[5] job count n, then per job: key, payload,
/// delay_ms, max_attempts. Fence check and append in one step.
const ENQUEUE: &str = r#"
local now = now_ms()
local n = tonumber(ARGV[5])
local fmin = tonumber(redis.call('HGET', K_META, 'fmin') or '0')
if tonumber(ARGV[4]) < fmin then return {'FENCED', ARGV[6], fmin} end
if redis.call('SCARD', K_PAUSED) > 0 then
  for i = 0, n - 1 do
    if redis.call('SISMEMBER', K_PAUSED, ARGV[6 + 4 * i]) == 1 then return {'PAUSED', ARGV[6 + 4 * i]} end
  end
end
local first = redis.call('HINCRBY', K_META, 'seq', n) - n + 1
local hdr, pay, pend, dly, cand, cnbf = {}, {}, {}, {}, {}, {}
local nows = idstr(now)
for i = 0, n - 1 do
  local k, d = ARGV[6 + 4 * i], tonumber(ARGV[8 + 4 * i])
  local id = first + i
  local ids = idstr(id)
  local nbf = now + d
  hdr[#hdr + 1] = ids
  hdr[#hdr + 1] = '0|' .. ARGV[9 + 4 * i] .. '|' .. nows .. '|' .. idstr(nbf) .. '|' .. k
  pay[#pay + 1] = ids
  pay[#pay + 1] = ARGV[7 + 4 * i]
  pend[#pend + 1] = 0
  pend[#pend + 1] = member(k, id)
  if d > 0 then
    dly[#dly + 1] = nbf
    dly[#dly + 1] = ids
  end
  if not cnbf[k] then
    cnbf[k] = nbf
    cand[#cand + 1] = k
  end
end
redis.call('HSET', K_HDR, unpack(hdr))
redis.call('HSET', K_PAY, unpack(pay))
redis.call('ZADD', K_PEND, unpack(pend))
if #dly > 0 then redis.call('ZADD', K_DELAYED, unpack(dly)) end
-- A key that is not busy and not in ready had no pending job, so this
-- batch's first job of it is its head; NX keeps an existing head's time.
local busy = redis.call('HMGET', K_BUSY, unpack(cand))
local rz = {}
for i, k in ipairs(cand) do
  if not busy[i] and not halted(k) then
    rz[#rz + 1] = cnbf[k]
    rz[#rz + 1] = k
  end
end
if #rz > 0 then redis.call('ZADD', K_READY, 'NX', unpack(rz)) end
return {'OK', first}
"#;

/// ARGV[4] max jobs, ARGV[5] job lease ms, ARGV[6] reclaim batch, ARGV[7]
/// `1` when an earlier attempt's reply was lost, then the ids the caller
/// holds: in-flight jobs it does not know are put back.
const CLAIM: &str = r#"
if not owns() then return {'NOTOWNER'} end
local now = now_ms()
if ARGV[7] == '1' then
  local known = {}
  for i = 8, #ARGV do known[ARGV[i]] = true end
  for _, ids in ipairs(redis.call('ZRANGE', K_INF, 0, -1)) do
    if not known[ids] then requeue(ids, 'claim reply lost') end
  end
end
for _, ids in ipairs(redis.call('ZRANGEBYSCORE', K_INF, '-inf', now, 'LIMIT', 0, tonumber(ARGV[6]))) do
  requeue(ids, 'job lease expired')
end
local keys = redis.call('ZRANGEBYSCORE', K_READY, '-inf', now, 'LIMIT', 0, tonumber(ARGV[4]))
if #keys == 0 then return {'OK'} end
redis.call('ZREM', K_READY, unpack(keys))
local deadline = now + tonumber(ARGV[5])
-- A key in ready may have no head left (ack marks keys lazily) or a head
-- whose start time has not come: the first is dropped, the second waits.
local cand, cmem = {}, {}
for _, k in ipairs(keys) do
  local mem = head(k)
  if mem then
    cand[#cand + 1] = k
    cmem[#cmem + 1] = mem
  end
end
if #cand == 0 then return {'OK'} end
local cids = {}
for i, mem in ipairs(cmem) do cids[i] = idstr(member_id(mem)) end
local chs = redis.call('HMGET', K_HDR, unpack(cids))
local mems, ids, hs, inf, busy, later = {}, {}, {}, {}, {}, {}
for i, k in ipairs(cand) do
  local _, _, _, n = parse(chs[i])
  if n > now then
    later[#later + 1] = n
    later[#later + 1] = k
  else
    local id = cids[i]
    mems[#mems + 1] = cmem[i]
    ids[#ids + 1] = id
    hs[#hs + 1] = chs[i]
    inf[#inf + 1] = deadline
    inf[#inf + 1] = id
    busy[#busy + 1] = k
    busy[#busy + 1] = id
  end
end
if #later > 0 then redis.call('ZADD', K_READY, unpack(later)) end
if #ids == 0 then return {'OK'} end
redis.call('ZREM', K_PEND, unpack(mems))
redis.call('ZADD', K_INF, unpack(inf))
redis.call('HSET', K_BUSY, unpack(busy))
if redis.call('EXISTS', K_DELAYED) == 1 then redis.call('ZREM', K_DELAYED, unpack(ids)) end
local ps = redis.call('HMGET', K_PAY, unpack(ids))
local nh, out = {}, {'OK'}
for i, id in ipairs(ids) do
  local a, m, c, n, k = parse(hs[i])
  a = a + 1
  nh[#nh + 1] = id
  nh[#nh + 1] = header(a, m, c, n, k)
  out[#out + 1] = id
  out[#out + 1] = a
  out[#out + 1] = m
  out[#out + 1] = c
  out[#out + 1] = n
  out[#out + 1] = k
  out[#out + 1] = ps[i] or ''
end
redis.call('HSET', K_HDR, unpack(nh))
return out
"#;

/// ARGV[4..] job ids. Acks those in flight; names the first that is not.
const ACK: &str = r#"
if not owns() then return {'NOTOWNER'} end
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
local sc = redis.call('ZMSCORE', K_INF, unpack(ids))
local hs = redis.call('HMGET', K_HDR, unpack(ids))
local done, keys, missing = {}, {}, nil
for i, id in ipairs(ids) do
  if sc[i] and hs[i] then
    done[#done + 1] = id
    local _, _, _, _, k = parse(hs[i])
    keys[#keys + 1] = k
  elseif not missing then
    missing = id
  end
end
if #done > 0 then
  redis.call('ZREM', K_INF, unpack(done))
  redis.call('HDEL', K_HDR, unpack(done))
  redis.call('HDEL', K_PAY, unpack(done))
  redis.call('HDEL', K_BUSY, unpack(keys))
  if redis.call('EXISTS', K_REASON) == 1 then redis.call('HDEL', K_REASON, unpack(done)) end
  -- Freed keys go back to ready lazily, stamped now (fair among keys);
  -- claim finds their next head, or drops them if none is left.
  local rz, now = {}, now_ms()
  for _, k in ipairs(keys) do
    if not halted(k) then
      rz[#rz + 1] = now
      rz[#rz + 1] = k
    end
  end
  if #rz > 0 then redis.call('ZADD', K_READY, unpack(rz)) end
end
if missing then return {'NOTINFLIGHT', missing} end
return {'OK'}
"#;

/// ARGV[4] id, ARGV[5] reason, ARGV[6] backoff base ms, ARGV[7] backoff max
/// ms. The retry keeps its id, so it goes back to the head of its key.
const FAIL: &str = r#"
if not owns() then return {'NOTOWNER'} end
local id = ARGV[4]
local h = redis.call('HGET', K_HDR, id)
if not h or not redis.call('ZSCORE', K_INF, id) then return {'NOTINFLIGHT', id} end
local now = now_ms()
local a, m, c, _, k = parse(h)
redis.call('ZREM', K_INF, id)
redis.call('HDEL', K_BUSY, k)
redis.call('HSET', K_REASON, id, ARGV[5])
if a >= m then
  bury(id, k, ARGV[5])
  refresh(k, true)
  return {'DEAD'}
end
local delay = math.min(tonumber(ARGV[6]) * (2 ^ math.min(a - 1, 40)), tonumber(ARGV[7]))
local nbf = now + delay
redis.call('HSET', K_HDR, id, header(a, m, c, nbf, k))
redis.call('ZADD', K_PEND, 0, member(k, tonumber(id)))
if delay > 0 then redis.call('ZADD', K_DELAYED, nbf, id) end
refresh(k, true)
return {'RETRY', nbf}
"#;

/// Puts every in-flight job back (a previous owner's), under the new token.
const ADOPT: &str = r#"
if not owns() then return {'NOTOWNER'} end
local ids = redis.call('ZRANGE', K_INF, 0, -1)
for _, id in ipairs(ids) do requeue(id, 'owner lost') end
return {'OK', #ids}
"#;

/// ARGV[4] routing key: depth, in flight (0/1), dead.
const KEY_COUNTS: &str = r#"
local k = ARGV[4]
local p = kprefix(k)
return {
  redis.call('ZLEXCOUNT', K_PEND, '[' .. p, '(' .. p .. 'g'),
  redis.call('HEXISTS', K_BUSY, k),
  tonumber(redis.call('HGET', K_DEADN, k) or '0'),
}
"#;

/// Ready, delayed, in flight, dead, distinct keys.
const STATS: &str = r#"
local now = now_ms()
local pending = redis.call('ZCARD', K_PEND)
local delayed = redis.call('ZCOUNT', K_DELAYED, '(' .. idstr(now), '+inf')
local keys = redis.call('ZCARD', K_READY) + redis.call('HLEN', K_BUSY)
for _, k in ipairs(redis.call('HKEYS', K_DEADN)) do
  if not redis.call('ZSCORE', K_READY, k) and redis.call('HEXISTS', K_BUSY, k) == 0 then keys = keys + 1 end
end
return {pending - delayed, delayed, redis.call('ZCARD', K_INF), redis.call('ZCARD', K_DEAD), keys}
"#;

/// ARGV[4] oldest map version accepted, ARGV[5..] paused keys.
const FENCE_SET: &str = r#"
redis.call('HSET', K_META, 'fmin', ARGV[4])
redis.call('DEL', K_PAUSED)
local keys = {}
for i = 5, #ARGV do keys[#keys + 1] = ARGV[i] end
if #keys > 0 then redis.call('SADD', K_PAUSED, unpack(keys)) end
return {'OK'}
"#;

const FENCE_GET: &str = r#"
return {tonumber(redis.call('HGET', K_META, 'fmin') or '0'), redis.call('SMEMBERS', K_PAUSED)}
"#;

/// ARGV[4] limit: id, attempts, key, reason per dead job, oldest first.
const DEAD_LIST: &str = r#"
local out = {}
for _, id in ipairs(redis.call('ZRANGE', K_DEAD, 0, tonumber(ARGV[4]) - 1)) do
  local h = redis.call('HGET', K_HDR, id)
  if h then
    local a, _, _, _, k = parse(h)
    out[#out + 1] = id
    out[#out + 1] = a
    out[#out + 1] = k
    out[#out + 1] = redis.call('HGET', K_REASON, id) or ''
  end
end
return out
"#;

/// ARGV[4] `retry` or `purge`, ARGV[5] `1` for the oldest ARGV[6] dead jobs,
/// else the ids in ARGV[7..]. Returns {moved, looked at}.
const DEAD_MOVE: &str = r#"
local now = now_ms()
local ids
if ARGV[5] == '1' then
  ids = redis.call('ZRANGE', K_DEAD, 0, tonumber(ARGV[6]) - 1)
else
  ids = {}
  for i = 7, #ARGV do ids[#ids + 1] = ARGV[i] end
end
local moved, touched, seen = 0, {}, {}
for _, id in ipairs(ids) do
  if redis.call('ZREM', K_DEAD, id) == 1 then
    local h = redis.call('HGET', K_HDR, id)
    if h then
      local _, m, c, _, k = parse(h)
      if redis.call('HINCRBY', K_DEADN, k, -1) <= 0 then redis.call('HDEL', K_DEADN, k) end
      if ARGV[4] == 'retry' then
        redis.call('HSET', K_HDR, id, header(0, m, c, now, k))
        redis.call('ZADD', K_PEND, 0, member(k, tonumber(id)))
      else
        redis.call('HDEL', K_HDR, id)
        redis.call('HDEL', K_PAY, id)
      end
      redis.call('HDEL', K_REASON, id)
      if not seen[k] then
        seen[k] = true
        touched[#touched + 1] = k
      end
      moved = moved + 1
    end
  end
end
for _, k in ipairs(touched) do refresh(k, false) end
return {moved, #ids}
"#;

/// KEYS[1] the shard's lease. ARGV[2] owner, ARGV[3] the caller's token (0
/// for none), ARGV[4] lease ms, ARGV[5] `1` to take a free or lapsed lease.
/// Taking over raises the token, which fences the previous owner's writes.
const LEASE: &str = r#"
local now = now_ms()
local l = redis.call('HMGET', KEYS[1], 'owner', 'token', 'until')
local owner, token, untl = l[1], l[2], tonumber(l[3] or '0')
if ARGV[3] ~= '0' and token == ARGV[3] then
  redis.call('HSET', KEYS[1], 'until', idstr(now + tonumber(ARGV[4])))
  return {'HELD', token}
end
if owner and owner ~= '' and untl >= now then return {'OTHER', owner, untl} end
if ARGV[5] == '1' then
  local t = redis.call('HINCRBY', KEYS[1], 'token', 1)
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'until', idstr(now + tonumber(ARGV[4])))
  return {'GAINED', idstr(t)}
end
return {'FREE'}
"#;

/// KEYS[1] the lease, ARGV[2] the caller's token: gives the lease up.
const LEASE_RELEASE: &str = r#"
if redis.call('HGET', KEYS[1], 'token') == ARGV[2] then
  redis.call('HSET', KEYS[1], 'owner', '', 'until', '0')
  return 1
end
return 0
"#;

/// KEYS[1] the map key. ARGV[1] expected version (0: none stored), ARGV[2]
/// new version, ARGV[3] YAML. Compare-and-set.
const MAP_PUBLISH: &str = r#"
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if cur ~= tonumber(ARGV[1]) then return {'CONFLICT', cur} end
if tonumber(ARGV[2]) <= cur then return {'STALE', cur} end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'yaml', ARGV[3])
return {'OK'}
"#;

/// ARGV[4] lex cursor (`-` to start, else `(member`), ARGV[5] most keys.
/// Walks `pending` one routing key at a time (a key's members are one lex
/// range, so each key costs two lookups however deep its backlog): returns
/// {next cursor or '', key, depth, busy, dead, ...}.
const INVENTORY_PENDING: &str = r#"
local cursor, limit = ARGV[4], tonumber(ARGV[5])
local out = {''}
for _ = 1, limit do
  local r = redis.call('ZRANGEBYLEX', K_PEND, cursor, '+', 'LIMIT', 0, 1)
  local mem = r[1]
  if not mem then return out end
  local len = tonumber(string.sub(mem, 1, 4), 16)
  local k = string.sub(mem, 5, 4 + len)
  local p = kprefix(k)
  out[#out + 1] = k
  out[#out + 1] = redis.call('ZLEXCOUNT', K_PEND, '[' .. p, '(' .. p .. 'g')
  out[#out + 1] = redis.call('HEXISTS', K_BUSY, k)
  out[#out + 1] = tonumber(redis.call('HGET', K_DEADN, k) or '0')
  -- Every member of this key sorts below p .. 'g' (ids are hex digits).
  cursor = '[' .. p .. 'g'
end
out[1] = cursor
return out
"#;

/// ARGV[4] HSCAN cursor, ARGV[5] COUNT hint. Keys with a job in flight:
/// {next cursor ('0' when done), key, depth, dead, ...}.
const INVENTORY_BUSY: &str = r#"
local r = redis.call('HSCAN', K_BUSY, ARGV[4], 'COUNT', tonumber(ARGV[5]))
local out = {r[1]}
local kv = r[2]
for i = 1, #kv, 2 do
  local k = kv[i]
  local p = kprefix(k)
  out[#out + 1] = k
  out[#out + 1] = redis.call('ZLEXCOUNT', K_PEND, '[' .. p, '(' .. p .. 'g')
  out[#out + 1] = tonumber(redis.call('HGET', K_DEADN, k) or '0')
end
return out
"#;

/// KEYS[1] the rebalance lock, ARGV[1] the holder's token, ARGV[2] ms:
/// extends the lock only while the caller still holds it.
const LOCK_RENEW: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#;

/// KEYS[1] the rebalance lock, ARGV[1] the holder's token: releases it only
/// if the caller still holds it (never a successor's lock).
const LOCK_RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"#;

/// One script: its source and SHA1.
pub(crate) struct Lua {
    src: String,
    sha: String,
}

impl Lua {
    fn new(body: &str, prelude: bool) -> Lua {
        let src = if prelude {
            format!("{PRELUDE}\n{body}")
        } else {
            body.to_string()
        };
        let sha = redis::Script::new(&src).get_hash().to_string();
        Lua { src, sha }
    }

    /// Runs the script by SHA; on `NOSCRIPT` sends the source once (which
    /// caches it on that server). `args` fills in ARGV.
    pub(crate) fn call(
        &self,
        con: &mut dyn ConnectionLike,
        keys: &[String],
        args: &dyn Fn(&mut Cmd),
    ) -> RedisResult<Value> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.sha).arg(keys.len()).arg(keys);
        args(&mut cmd);
        match cmd.query::<Value>(con) {
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(&self.src).arg(keys.len()).arg(keys);
                args(&mut cmd);
                cmd.query(con)
            }
            other => other,
        }
    }
}

/// Every script, built once per backend.
pub(crate) struct Scripts {
    pub(crate) enqueue: Lua,
    pub(crate) claim: Lua,
    pub(crate) ack: Lua,
    pub(crate) fail: Lua,
    pub(crate) adopt: Lua,
    pub(crate) key_counts: Lua,
    pub(crate) stats: Lua,
    pub(crate) fence_set: Lua,
    pub(crate) fence_get: Lua,
    pub(crate) dead_list: Lua,
    pub(crate) dead_move: Lua,
    pub(crate) lease: Lua,
    pub(crate) lease_release: Lua,
    pub(crate) map_publish: Lua,
    pub(crate) inventory_pending: Lua,
    pub(crate) inventory_busy: Lua,
    pub(crate) lock_renew: Lua,
    pub(crate) lock_release: Lua,
}

impl Scripts {
    pub(crate) fn new() -> Scripts {
        Scripts {
            enqueue: Lua::new(ENQUEUE, true),
            claim: Lua::new(CLAIM, true),
            ack: Lua::new(ACK, true),
            fail: Lua::new(FAIL, true),
            adopt: Lua::new(ADOPT, true),
            key_counts: Lua::new(KEY_COUNTS, true),
            stats: Lua::new(STATS, true),
            fence_set: Lua::new(FENCE_SET, true),
            fence_get: Lua::new(FENCE_GET, true),
            dead_list: Lua::new(DEAD_LIST, true),
            dead_move: Lua::new(DEAD_MOVE, true),
            lease: Lua::new(LEASE, true),
            lease_release: Lua::new(LEASE_RELEASE, false),
            map_publish: Lua::new(MAP_PUBLISH, false),
            inventory_pending: Lua::new(INVENTORY_PENDING, true),
            inventory_busy: Lua::new(INVENTORY_BUSY, true),
            lock_renew: Lua::new(LOCK_RENEW, false),
            lock_release: Lua::new(LOCK_RELEASE, false),
        }
    }
}

/// Reads replies of the scripts above.
pub(crate) mod reply {
    use redis::Value;

    /// The elements of an array reply (empty for anything else).
    pub(crate) fn items(v: &Value) -> &[Value] {
        match v {
            Value::Array(items) => items,
            _ => &[],
        }
    }

    pub(crate) fn bytes(v: &Value) -> Option<&[u8]> {
        match v {
            Value::BulkString(b) => Some(b),
            Value::SimpleString(s) => Some(s.as_bytes()),
            _ => None,
        }
    }

    pub(crate) fn string(v: &Value) -> Option<String> {
        bytes(v).map(|b| String::from_utf8_lossy(b).into_owned())
    }

    pub(crate) fn u64(v: &Value) -> Option<u64> {
        match v {
            Value::Int(i) => u64::try_from(*i).ok(),
            Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
            Value::SimpleString(s) => s.parse().ok(),
            Value::Double(d) if *d >= 0.0 => Some(*d as u64),
            _ => None,
        }
    }

    /// The status word leading a reply.
    pub(crate) fn status(v: &Value) -> String {
        items(v).first().and_then(string).unwrap_or_default()
    }
}
