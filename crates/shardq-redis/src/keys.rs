//! The key grammar: every Redis key shardq writes, and the names allowed in it.
//!
//! ```text
//! sq:{<ns>:<queue>:<shard>}:<part>   one shard of one queue of deployment <ns> (parts below)
//! sq:{=dep:<ns>}:info                the deployment record (hash: id, layout, created_ms)
//! sq:{=map:<ns>}:current             the published shard map (hash: version, yaml)
//! sq:{=map:<ns>}:target              the pending rebalance target (string: yaml)
//! sq:{=map:<ns>}:rebalance           the rebalance lock (string: holder token, TTL)
//! sq:{=map:<ns>}:settings            deployment settings (hash: name -> JSON, e.g. retry)
//! ```
//!
//! `<ns>` is the deployment's namespace, chosen at init
//! ([`crate::init_deployment`]): two deployments sharing a server never
//! share a key. The braces are the Redis Cluster hashtag: all keys of one
//! shard hash to one slot, so one Lua script can move a job between them
//! atomically, in cluster mode as on a single instance. Namespace, queue and
//! shard names use only ASCII letters, digits, `-`, `_` and `.`, so the
//! hashtag splits one way; a hashtag starting with `=` is reserved for
//! shardq's own keys, and no name can start with `=`.
//!
//! A shard uses a fixed set of keys ([`SHARD_PARTS`]), never one key per job
//! or per routing key: every script declares every key it touches, which is
//! what keeps scripts correct while Redis Cluster migrates the slot (a
//! script either sees all of the shard's keys on one node or gets
//! `TRYAGAIN`/`ASK` before it runs). This module builds names only; it must
//! never talk to Redis.

/// Prefix of every shardq key.
pub const NAMESPACE: &str = "sq";
/// Longest queue (or namespace) name, in bytes.
pub const QUEUE_NAME_BYTES_MAX: usize = 64;
/// Queue used when none is configured.
pub const QUEUE_DEFAULT: &str = "default";
/// Namespace used when the caller names none (tests and single-deployment
/// servers); [`crate::init_deployment`] derives a fresh one from the
/// deployment id unless told otherwise.
pub const NAMESPACE_DEFAULT: &str = "default";
/// Version of the key layout, stored in the deployment record and in every
/// shard's `meta` (`layout`), the grammar of docs/redis-protocol.md. This
/// build reads and writes exactly this version and refuses any other at
/// open, naming both. shardq has had no release: from the first one on, a
/// change of layout is a numbered migration (`docs/design.md`, "Format
/// versions"), never a branch in the scripts.
pub const LAYOUT_VERSION: u32 = 7;

/// Key of a namespace's deployment record (hash: `id`, `layout`, `created_ms`).
pub fn deployment_key(ns: &str) -> String {
    format!("{NAMESPACE}:{{=dep:{ns}}}:info")
}
/// Key of the published shard map (a hash with `version` and `yaml`).
pub fn map_key(ns: &str) -> String {
    format!("{NAMESPACE}:{{=map:{ns}}}:current")
}
/// Key of the pending rebalance target (a string: the map's YAML).
pub fn target_key(ns: &str) -> String {
    format!("{NAMESPACE}:{{=map:{ns}}}:target")
}
/// Key of the deployment's settings (a hash: setting name -> JSON).
pub fn settings_key(ns: &str) -> String {
    format!("{NAMESPACE}:{{=map:{ns}}}:settings")
}
/// Key of a flow-control group's bucket (a hash: `u` units held, `at` when
/// counted, `held` a back-off's end, `c` and `p` the rate it was counted
/// in; it expires a day after its last use, and a new one starts full).
pub fn group_bucket_key(ns: &str, group: &str) -> String {
    format!("{}:flow:{group}", settings_key(ns))
}
/// Key of a flow-control group's run slots (a sorted set: the key whose
/// run holds a slot, scored by when the slot lapses, its run's lease).
pub fn group_slots_key(ns: &str, group: &str) -> String {
    format!("{}:flowslots:{group}", settings_key(ns))
}
/// Key of the rebalance lock (a string: the holder's token, with a TTL).
pub fn rebalance_lock_key(ns: &str) -> String {
    format!("{NAMESPACE}:{{=map:{ns}}}:rebalance")
}

/// `sq:{=map:<ns>}:repoch`: the last rebalance epoch handed out (a counter,
/// `INCR`ed by each rebalance under the lock; see
/// `MapStore::rebalance_epoch`).
pub fn rebalance_epoch_key(ns: &str) -> String {
    format!("{NAMESPACE}:{{=map:{ns}}}:repoch")
}

/// The parts of one shard, in the order scripts receive them as `KEYS`.
///
/// * `meta` hash: `dep` (deployment id), `layout` ([`LAYOUT_VERSION`]),
///   `seq` (last job id), `fmin` (fence: oldest map version), `ffloor`
///   (fence: smallest run fence to issue), `flast` (last run fence issued),
///   `pend` (jobs waiting to start or to be retried, for counts). Every
///   script checks `dep` first: a shard whose record is gone (FLUSHALL, a
///   server restarted empty) is reported lost, never re-created.
/// * `jobs` hash: job id -> one record,
///   `<not_before_ms>|<attempts>|<max_attempts>|<created_ms>|<key len>|<key><payload>`.
///   `attempts` counts finished attempts: claim does not rewrite the record,
///   the attempt in flight is `attempts + 1` until a fail or reclaim writes
///   it back.
/// * `keys` hash: routing key -> `<head> <tail> <depth>`, the key's queue
///   of waiting jobs (ids, 0 for none), then its runs in flight as `<job>
///   <fence>` pairs in job order (`0 0` for none; fence 0: cancelled while
///   it ran), the receipt check of ack, fail and extend, then the most
///   runs it may have at once when above 1 (its policy's concurrency as a
///   claim last read it; a record without it means 1, so a record of one
///   run per key, `<head> <tail> <depth> <job> <fence>`, reads the same).
///   Present iff the key has a waiting job or one in flight. One more
///   field, named by a NUL byte (no routing key holds one), is the hash's
///   pin (`scripts::keys_pin_value`): a value too long for a listpack keeps
///   the hash in its hash-table encoding. Counts and inventories skip it.
/// * `next` hash: job id -> id of the job after it in its key's queue.
/// * `ready` list: routing keys that may start now, oldest first.
/// * `later` zset: routing key -> not-before (ms) of its head, for heads
///   that must wait (a delay or a retry backoff).
///
///   A key that has a waiting job, nothing in flight, no halt and no seal
///   is in `ready` or `later`. `ready` may also hold a key that no longer
///   qualifies (sealed since it was pushed) or hold one twice (unsealed
///   while still there): claim takes each key once and drops the others.
/// * `inflight` zset: job id -> job lease deadline (ms).
/// * `dead` zset: dead job id -> id (oldest first).
/// * `deadn` hash: routing key -> number of its dead jobs.
/// * `deadk` zset (the 21st part): the dead jobs again,
///   by key: `<key>` NUL `<id>`, the id zero-padded to 16 digits
///   (`DEADK_ID_DIGITS` in the scripts; ids stay below 2^53), every member
///   at score 0, so a `ZRANGEBYLEX` from `(<key>\0<id>` to `(<key>\1` reads
///   one key's dead jobs above an id in id order, no other key's. A key
///   holds no NUL byte (the enqueue script refuses one), so no other key's
///   member falls in that range. A move's export, freeze and purge and a
///   key's job list read a key's dead jobs only there, at most the call's
///   bound of them; every script that adds or removes a dead job writes
///   `dead`, `deadn` and `deadk` together.
/// * `keyed` hash (the 22nd part): unique and debounced
///   jobs, `<key len>|<key><keyed id>` (`unique:ID` or `debounce:ID`, the
///   job's dedup id) -> the newest job stored with that id on this shard,
///   by enqueue or by a move's import. A keyed enqueue meets that job
///   while it lives (its record exists and it is not dead); ack and cancel
///   remove the entry of a job that ends, other ends leave a stale entry
///   that the check ignores and the next job with the id overwrites.
/// * `delayed` zset: job id -> not-before, for jobs enqueued or retried with
///   a delay (counts only; stale entries are harmless).
/// * `paused` set: routing keys whose enqueues are paused (the fence).
/// * `lease` hash: `owner` (`host@pid`), `token` (`<owner>#<epoch>#<n>`, the
///   holder's random epoch makes it unique across store restarts), `until`
///   (ms).
/// * `reason` hash: job id -> last failure reason; `<id>@` -> the start
///   times (ms, comma-separated) of the job's ended attempts; `<id>^` -> its
///   running attempt's start when the run fence does not tell it (see
///   `run_start` in the scripts). Usually absent: a run that starts and is
///   acked writes nothing here.
/// * `dedup` hash: `<key len>|<key><dedup id>` -> `<job>|<expires_ms>|<shard>`,
///   the job that `(key, id)` was enqueued as (shard empty: this shard; set
///   by a move's import otherwise). Live until `expires_ms`; checked and
///   written by the enqueue script.
/// * `dedupm` zset: the expiry index of `dedup`, one entry (a *mark*) per
///   group of records written together with one expiry, scored by it: per
///   enqueue batch that stored records, `#<first job id>`, and per expiry
///   among the records one import call stored, `@<expires_ms>`; then the
///   group's fields, one a line. Each enqueue and each dedup import
///   forgets at most `DEDUP_FORGET_MARKS` (2) expired marks, so at most
///   2 x [`crate::backend::ENQUEUE_BATCH_MAX`] records per call, deleting
///   only the records that expired (a field stored again since keeps its
///   new record, which a later mark names). One entry per group instead of
///   one per record: a sorted-set entry per record was the enqueue
///   script's largest single cost.
/// * `sealed` hash: routing key -> the shard its backlog moves to. A
///   sealed key starts no run here (the fence's `sealed_keys`); enqueues
///   still append to it, and a move copies them.
/// * `imported` hash: `<from len>|<from><key>` -> the largest job id of
///   shard `from` copied into this shard for that key (a move's cursor:
///   an import skips what it already took); and `#<from len>|<from><source
///   id>` -> the copy's id here, for each copy the `movedin` list names
///   (dropped with its list entry): how an old id finds its copy.
///
/// * `moved` list: per purge of a key moved away, `<count>|<lowest
///   id>|<highest id>|<key length>|<key>,<id>,...,` (the ids it deleted; a
///   lookup reads only the entries whose range holds the id), oldest first, within
///   `MOVED_KEYS_KEPT` entries and `MOVED_IDS_KEPT` ids (`movedn` in
///   `meta` counts them), so an id from before a move answers where its
///   job went.
/// * `movedin` list (the 23rd part): per import call of a move, `<count>|<lowest
///   source id>|<highest source id>|<from length>|<from>,<source id>:<new
///   id>,...,`, oldest first, within the same bounds (`movedinn` in
///   `meta`), so an id from before a move finds its copy here
///   (`imported_as.lua`).
///
/// * `finished` list: jobs that finished here (acked or cancelled), newest
///   first, `<id>|<c or x>|<attempts>|<finished ms>|<starts>|<key
///   length>|<key><last failure reason>`, at most `finishedmax` of `meta` (the
///   retention's count, written by each owner when it adopts the shard);
///   readers drop those past the retention's age.
///
/// * `limits` hash (the 20th part): the shard's copy of
///   the flow settings' run limits (`shardq_core::flow::ConcurrencyRules`),
///   which the claim script reads per key instead of receiving every rule
///   with every claim. `=<key>` -> a key's own limit (only where it differs
///   from what its prefix or the default gives), `^<prefix>` -> a prefix
///   policy's limit, and three fields named by a NUL byte and a letter (no
///   routing key holds a NUL): `\0v` the version of the rules it holds (a
///   digest of them), `\0d` the default limit, `\0l` the prefix lengths,
///   one byte per length (byte `n` is `1` when some prefix is `n` bytes
///   long, else `0`; as long as the longest prefix). A claim passes the
///   version it expects and is answered `LIMITS` when the copy is another
///   (or half written: no `\0v`); the owner then rewrites it, at most
///   `LIMITS_BATCH_MAX` entries per call, the first call dropping the old
///   copy and the last writing `\0v`. Unread while every key runs one
///   job at a time (a copy written before stays until the next rewrite).
///   At most `FLOW_RULES_MAX` entries.
pub const SHARD_PARTS: [&str; 23] = [
    "meta", "jobs", "keys", "next", "ready", "later", "inflight", "dead", "deadn", "delayed",
    "paused", "lease", "reason", "dedup", "dedupm", "sealed", "imported", "moved", "finished",
    "limits", "deadk", "keyed", "movedin",
];

/// Index of part `name` in [`SHARD_PARTS`]: how code and tests name a
/// part, never by its number.
pub fn part_index(name: &str) -> Option<usize> {
    SHARD_PARTS.iter().position(|p| *p == name)
}

/// Index of the `lease` part in [`SHARD_PARTS`].
pub const LEASE_PART: usize = 11;
/// Index of the `limits` part in [`SHARD_PARTS`].
pub const LIMITS_PART: usize = 19;
/// Index of the `deadk` part in [`SHARD_PARTS`].
pub const DEADK_PART: usize = 20;

/// Checks a queue name: 1 to [`QUEUE_NAME_BYTES_MAX`] bytes of ASCII
/// letters, digits, `-`, `_` and `.`. `{`, `}` and `:` are excluded so the
/// hashtag `{queue:shard}` splits one way only, and `=` so no queue can
/// reach the reserved namespace.
pub fn validate_queue_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("it must not be empty".into());
    }
    if name.len() > QUEUE_NAME_BYTES_MAX {
        return Err(format!(
            "it is at most {QUEUE_NAME_BYTES_MAX} bytes, this one has {}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "it contains {c:?}; only ASCII letters, digits, `-`, `_` and `.` are allowed"
        ));
    }
    Ok(())
}

/// The hashtag of a shard's keys: `<ns>:<queue>:<shard>`.
pub fn shard_tag(ns: &str, queue: &str, shard: &str) -> String {
    format!("{ns}:{queue}:{shard}")
}

/// All keys of one shard, in [`SHARD_PARTS`] order.
pub fn shard_keys(ns: &str, queue: &str, shard: &str) -> Vec<String> {
    let tag = shard_tag(ns, queue, shard);
    SHARD_PARTS
        .iter()
        .map(|part| format!("{NAMESPACE}:{{{tag}}}:{part}"))
        .collect()
}

/// The Redis Cluster slot of every key of the shard, computed here (the
/// same CRC16 the server uses) so callers can place shards on nodes.
pub fn shard_slot(ns: &str, queue: &str, shard: &str) -> u16 {
    shardq_route::slot(shard_tag(ns, queue, shard).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, ok: bool) {
        assert_eq!(validate_queue_name(name).is_ok(), ok, "{name:?}");
    }

    #[test]
    fn a_bad_namespace_is_named_as_a_namespace() {
        let reason = validate_queue_name("bad name").unwrap_err();
        let e = crate::RedisError::InvalidName {
            what: "namespace",
            name: "bad name".into(),
            reason,
        }
        .to_string();
        assert!(e.starts_with("invalid namespace name \"bad name\""), "{e}");
        assert!(!e.contains("queue"), "{e}");
    }

    #[test]
    fn queue_names() {
        check("default", true);
        check("orders.v2-eu_1", true);
        check("", false);
        check("=map", false);
        check("a:b", false);
        check("a{b}", false);
        check(&"q".repeat(65), false);
    }

    #[test]
    fn keys_share_one_slot() {
        let keys = shard_keys("d1", "default", "redis-0");
        assert_eq!(keys[0], "sq:{d1:default:redis-0}:meta");
        assert_ne!(keys[0], shard_keys("d2", "default", "redis-0")[0]);
        let slot = shard_slot("d1", "default", "redis-0");
        for k in &keys {
            assert_eq!(shardq_route::slot(k.as_bytes()), slot, "{k}");
        }
        assert_eq!(SHARD_PARTS[LEASE_PART], "lease");
        assert_eq!(SHARD_PARTS[LIMITS_PART], "limits");
        assert_eq!(SHARD_PARTS[DEADK_PART], "deadk");
    }
}
