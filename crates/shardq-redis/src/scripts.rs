//! The Lua scripts: every state change of a shard is one script, so each
//! transition is atomic on the server.
//!
//! Scripts are sent as `EVALSHA` and fall back to `EVAL` (which also caches
//! the script) on `NOSCRIPT`, so a restarted server or a node that joined a
//! cluster later needs no separate loading step. Shard scripts receive the
//! shard's keys in [`crate::keys::SHARD_PARTS`] order and declare every key
//! they touch. The common ARGV: `ARGV[1]` the time in ms (empty: the
//! server's `TIME`, one clock for every host), `ARGV[2]` the caller's lease
//! token, `ARGV[3]` `1` when a dead job halts its key, `ARGV[4]` the
//! deployment id the caller opened; each script's own arguments follow from
//! `ARGV[5]`. Every shard script first checks the shard's deployment record
//! (`meta.dep`) and answers `LOST` when it is missing or another, so a
//! flushed or replaced store is never written as if it were new.
//!
//! Every script starts with a `#!lua` line (Redis 7 script flags). The
//! scripts that let a worker drain a full store (claim, ack, fail, extend,
//! adopt, the lease, dead-letter moves, the fence) carry `allow-oom`: they
//! write a few bytes (an in-flight entry, a list push) but free far more
//! over a job's life. So does `limits_put`, without which a claim cannot
//! run after a policy change: it replaces the shard's copy of the run
//! limits, at most `FLOW_RULES_MAX` entries. Enqueue and init carry no
//! flag, so a server at `maxmemory` refuses them before they run (`OOM`,
//! reported as `QueueError::StoreFull`). Read-only scripts carry
//! `no-writes`.
//!
//! Replies are arrays led by a status word, never Lua errors, so refusals
//! keep their detail. Scripts must stay bounded: every loop runs over a
//! batch whose size the caller limits.

use redis::{Cmd, ConnectionLike, ErrorKind, RedisResult, Value};

/// `lua/prelude.lua`.
const PRELUDE: &str = include_str!("../lua/prelude.lua");

/// `lua/enqueue.lua`.
const ENQUEUE: &str = include_str!("../lua/enqueue.lua");

/// `lua/dedup_export.lua`.
const DEDUP_EXPORT: &str = include_str!("../lua/dedup_export.lua");

/// `lua/dedup_import.lua`.
const DEDUP_IMPORT: &str = include_str!("../lua/dedup_import.lua");

/// `lua/claim.lua`.
const CLAIM: &str = include_str!("../lua/claim.lua");

/// `lua/ack.lua`.
const ACK: &str = include_str!("../lua/ack.lua");

/// `lua/fail.lua`.
const FAIL: &str = include_str!("../lua/fail.lua");

/// `lua/back_off.lua`.
const BACK_OFF: &str = include_str!("../lua/back_off.lua");

/// `lua/group_bucket.lua`.
pub(crate) const GROUP_BUCKET: &str = include_str!("../lua/group_bucket.lua");

/// `lua/extend.lua`.
const EXTEND: &str = include_str!("../lua/extend.lua");

/// `lua/runs_stale.lua`.
const RUNS_STALE: &str = include_str!("../lua/runs_stale.lua");

/// `lua/relimit.lua`.
const RELIMIT: &str = include_str!("../lua/relimit.lua");

/// `lua/limits_put.lua`.
const LIMITS_PUT: &str = include_str!("../lua/limits_put.lua");

/// `lua/adopt.lua`.
const ADOPT: &str = include_str!("../lua/adopt.lua");

/// `lua/peek_ready.lua`.
const PEEK_READY: &str = include_str!("../lua/peek_ready.lua");

/// `lua/next_due.lua`.
const NEXT_DUE: &str = include_str!("../lua/next_due.lua");

/// `lua/key_counts.lua`.
const KEY_COUNTS: &str = include_str!("../lua/key_counts.lua");

/// `lua/stats.lua`.
const STATS: &str = include_str!("../lua/stats.lua");

/// `lua/fence_set.lua`.
const FENCE_SET: &str = include_str!("../lua/fence_set.lua");

/// `lua/epoch_raise.lua`.
const EPOCH_RAISE: &str = include_str!("../lua/epoch_raise.lua");

/// `lua/fence_get.lua`.
const FENCE_GET: &str = include_str!("../lua/fence_get.lua");

/// `lua/export_key_fn.lua`.
const EXPORT_KEY_FN: &str = include_str!("../lua/export_key_fn.lua");

/// `lua/export.lua`.
const EXPORT: &str = include_str!("../lua/export.lua");

/// `lua/freeze.lua`.
const FREEZE: &str = include_str!("../lua/freeze.lua");

/// `lua/export_many.lua`.
const EXPORT_MANY: &str = include_str!("../lua/export_many.lua");

/// `lua/import.lua`.
const IMPORT: &str = include_str!("../lua/import.lua");

/// `lua/imported_up_to.lua`.
const IMPORTED_UP_TO: &str = include_str!("../lua/imported_up_to.lua");

/// `lua/purge_key.lua`.
const PURGE_KEY: &str = include_str!("../lua/purge_key.lua");

/// `lua/moved_away.lua`.
const MOVED_AWAY: &str = include_str!("../lua/moved_away.lua");
/// `lua/imported_as.lua`.
const IMPORTED_AS: &str = include_str!("../lua/imported_as.lua");

/// `lua/job_get.lua`.
const JOB_GET: &str = include_str!("../lua/job_get.lua");

/// `lua/job_show.lua`.
const JOB_SHOW: &str = include_str!("../lua/job_show.lua");

/// `lua/key_jobs.lua`.
const KEY_JOBS: &str = include_str!("../lua/key_jobs.lua");

/// `lua/cancel.lua`.
const CANCEL: &str = include_str!("../lua/cancel.lua");

/// `lua/key_resume.lua`.
const KEY_RESUME: &str = include_str!("../lua/key_resume.lua");

/// `lua/finished.lua`.
const FINISHED: &str = include_str!("../lua/finished.lua");

/// `lua/dead_list.lua`.
const DEAD_LIST: &str = include_str!("../lua/dead_list.lua");

/// `lua/dead_move.lua`.
const DEAD_MOVE: &str = include_str!("../lua/dead_move.lua");

/// `lua/inventory.lua`.
const INVENTORY: &str = include_str!("../lua/inventory.lua");

/// `lua/init_shard.lua`.
const INIT_SHARD: &str = include_str!("../lua/init_shard.lua");

/// `lua/shard_record.lua`.
const SHARD_RECORD: &str = include_str!("../lua/shard_record.lua");

/// `lua/lease.lua`.
const LEASE: &str = include_str!("../lua/lease.lua");

/// `lua/lease_release.lua`.
const LEASE_RELEASE: &str = include_str!("../lua/lease_release.lua");

/// `lua/map_publish.lua`.
const MAP_PUBLISH: &str = include_str!("../lua/map_publish.lua");

/// `lua/lock_renew.lua`.
const LOCK_RENEW: &str = include_str!("../lua/lock_renew.lua");

/// `lua/lock_release.lua`.
const LOCK_RELEASE: &str = include_str!("../lua/lock_release.lua");

/// `lua/lock_epoch.lua`.
const LOCK_EPOCH: &str = include_str!("../lua/lock_epoch.lua");

/// `lua/target_set.lua`.
const TARGET_SET: &str = include_str!("../lua/target_set.lua");

/// `lua/target_clear.lua`.
const TARGET_CLEAR: &str = include_str!("../lua/target_clear.lua");

/// `lua/setting_swap.lua`.
const SETTING_SWAP: &str = include_str!("../lua/setting_swap.lua");

/// One script: its source and SHA1.
pub(crate) struct Lua {
    src: String,
    sha: String,
    /// Whether the script may write (then `--redis-wait-replicas` waits for
    /// the replicas after it).
    pub(crate) writes: bool,
}

/// Redis 7 script flags of a script's `#!lua` line.
#[derive(Clone, Copy)]
enum Flags {
    /// Writes; refused when the server is at `maxmemory`.
    Write,
    /// Writes, also when the server is at `maxmemory` (drains it).
    AllowOom,
    /// Reads only.
    NoWrites,
}

impl Lua {
    fn new(body: &str, prelude: bool, flags: Flags) -> Lua {
        let shebang = match flags {
            Flags::Write => "#!lua",
            Flags::AllowOom => "#!lua flags=allow-oom",
            Flags::NoWrites => "#!lua flags=no-writes",
        };
        let src = if prelude {
            format!("{shebang}\n{PRELUDE}\n{body}")
        } else {
            format!("{shebang}\n{body}")
        };
        let sha = redis::Script::new(&src).get_hash().to_string();
        let writes = !matches!(flags, Flags::NoWrites);
        Lua { src, sha, writes }
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

/// How many bytes the `keys` hash's pin holds ([`keys_pin_value`]).
pub(crate) const KEYS_PIN_BYTES: usize = 1024;

/// The value of the `keys` hash's pin: one field (named by a NUL byte, which
/// no routing key holds) whose value is longer than Redis's bound for a
/// listpack hash (`hash-max-listpack-value`, 64 bytes by default), so the
/// hash keeps its hash-table encoding. A small hash is otherwise a listpack
/// (up to `hash-max-listpack-entries` fields, 512 by default), searched
/// field by field: a shard of a few hundred keys then spent about a fifth of
/// redis-server's time in that search. The value is a well-formed key
/// record with nothing waiting and nothing in flight (`0 0 0 0 ` then
/// zeros), so a read that does not skip it still parses it as an empty key
/// rather than failing. Written at init and at adopt; the scripts that list
/// or count keys skip it, and the enqueue script refuses it as a key.
pub(crate) fn keys_pin_value() -> String {
    let mut v = String::from("0 0 0 0 ");
    v.push_str(&"0".repeat(KEYS_PIN_BYTES - v.len()));
    v
}

/// Declares every script once: the struct of built scripts, its
/// constructor and [`Scripts::all`] (each script by name, for the lint
/// test), from one list of `field: Lua::new(source, prelude, flags)`.
macro_rules! scripts {
    ($($field:ident: $build:expr,)*) => {
        /// Every script, built once per backend.
        pub(crate) struct Scripts {
            $(pub(crate) $field: Lua,)*
        }

        impl Scripts {
            pub(crate) fn new() -> Scripts {
                Scripts { $($field: $build,)* }
            }

            /// Every script with its field's name, as sent to Redis.
            #[allow(dead_code)]
            pub(crate) fn all(&self) -> Vec<(&'static str, &Lua)> {
                vec![$((stringify!($field), &self.$field),)*]
            }
        }
    };
}

scripts! {
    enqueue: Lua::new(ENQUEUE, true, Flags::Write),
    dedup_export: Lua::new(DEDUP_EXPORT, true, Flags::NoWrites),
    dedup_import: Lua::new(DEDUP_IMPORT, true, Flags::Write),
    claim: Lua::new(CLAIM, true, Flags::AllowOom),
    peek_ready: Lua::new(PEEK_READY, true, Flags::AllowOom),
    ack: Lua::new(ACK, true, Flags::AllowOom),
    fail: Lua::new(FAIL, true, Flags::AllowOom),
    back_off: Lua::new(BACK_OFF, true, Flags::AllowOom),
    group_bucket: Lua::new(GROUP_BUCKET, false, Flags::AllowOom),
    extend: Lua::new(EXTEND, true, Flags::AllowOom),
    runs_stale: Lua::new(RUNS_STALE, true, Flags::NoWrites),
    relimit: Lua::new(RELIMIT, true, Flags::AllowOom),
    limits_put: Lua::new(LIMITS_PUT, true, Flags::AllowOom),
    adopt: Lua::new(ADOPT, true, Flags::AllowOom),
    init_shard: Lua::new(INIT_SHARD, false, Flags::Write),
    shard_record: Lua::new(SHARD_RECORD, false, Flags::NoWrites),
    key_counts: Lua::new(KEY_COUNTS, true, Flags::NoWrites),
    stats: Lua::new(STATS, true, Flags::NoWrites),
    fence_set: Lua::new(FENCE_SET, true, Flags::AllowOom),
    fence_get: Lua::new(FENCE_GET, true, Flags::NoWrites),
    epoch_raise: Lua::new(EPOCH_RAISE, true, Flags::AllowOom),
    export: Lua::new(&format!("{EXPORT_KEY_FN}{EXPORT}"), true, Flags::NoWrites),
    export_many: Lua::new( &format!("{EXPORT_KEY_FN}{EXPORT_MANY}"), true, Flags::NoWrites, ),
    freeze: Lua::new(&format!("{EXPORT_KEY_FN}{FREEZE}"), true, Flags::AllowOom),
    import: Lua::new( &format!( "local MOVED_KEYS_KEPT, MOVED_IDS_KEPT = {}, {}\n{IMPORT}", shardq_core::MOVED_KEYS_KEPT, shardq_core::MOVED_IDS_KEPT ), true, Flags::Write, ),
    imported_up_to: Lua::new(IMPORTED_UP_TO, true, Flags::NoWrites),
    purge_key: Lua::new( &format!( "local MOVED_KEYS_KEPT, MOVED_IDS_KEPT = {}, {}\n{PURGE_KEY}", shardq_core::MOVED_KEYS_KEPT, shardq_core::MOVED_IDS_KEPT ), true, Flags::AllowOom, ),
    moved_away: Lua::new(MOVED_AWAY, true, Flags::NoWrites),
    imported_as: Lua::new(IMPORTED_AS, true, Flags::NoWrites),
    finished: Lua::new(FINISHED, true, Flags::NoWrites),
    dead_list: Lua::new(DEAD_LIST, true, Flags::NoWrites),
    job_show: Lua::new(&format!("{JOB_GET}{JOB_SHOW}"), true, Flags::NoWrites),
    key_jobs: Lua::new( &format!("{JOB_GET}{EXPORT_KEY_FN}{KEY_JOBS}"), true, Flags::NoWrites, ),
    cancel: Lua::new(CANCEL, true, Flags::AllowOom),
    key_hold: Lua::new(&format!("local LIFT = false\n{KEY_RESUME}"), true, Flags::NoWrites),
    key_resume: Lua::new(&format!("local LIFT = true\n{KEY_RESUME}"), true, Flags::AllowOom),
    dead_move: Lua::new(DEAD_MOVE, true, Flags::AllowOom),
    lease: Lua::new(LEASE, false, Flags::AllowOom),
    lease_release: Lua::new(LEASE_RELEASE, false, Flags::AllowOom),
    map_publish: Lua::new(MAP_PUBLISH, false, Flags::Write),
    inventory: Lua::new(INVENTORY, true, Flags::NoWrites),
    next_due: Lua::new(NEXT_DUE, true, Flags::NoWrites),
    lock_renew: Lua::new(LOCK_RENEW, false, Flags::AllowOom),
    lock_release: Lua::new(LOCK_RELEASE, false, Flags::AllowOom),
    lock_epoch: Lua::new(LOCK_EPOCH, false, Flags::AllowOom),
    setting_swap: Lua::new(SETTING_SWAP, false, Flags::Write),
    target_set: Lua::new(TARGET_SET, false, Flags::Write),
    target_clear: Lua::new(TARGET_CLEAR, false, Flags::AllowOom),
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

#[cfg(test)]
mod lint {
    use super::Scripts;

    /// Every script as Redis gets it (its `#!lua` line, the libraries it
    /// uses, its body) passes luacheck with `lua/.luacheckrc`: no global
    /// but Redis's own, no shadowed local, no unreachable code. luacheck
    /// is Debian's `lua-check`, which `.ci/run` installs.
    #[test]
    fn every_script_passes_luacheck() {
        let dir = std::env::temp_dir().join(format!("shardq-luacheck-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let scripts = Scripts::new();
        let mut files = Vec::new();
        for (name, lua) in scripts.all() {
            let path = dir.join(format!("{name}.lua"));
            std::fs::write(&path, &lua.src).unwrap();
            files.push(path);
        }
        let config = concat!(env!("CARGO_MANIFEST_DIR"), "/lua/.luacheckrc");
        let out = std::process::Command::new("luacheck")
            .args(["--config", config, "--formatter", "plain", "--codes"])
            .args(&files)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "running luacheck: {e}; install Debian's lua-check (apt-get install lua-check)"
                )
            });
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            out.status.success(),
            "luacheck found problems in the scripts:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(files.len() >= 40, "{} scripts", files.len());
    }
}
