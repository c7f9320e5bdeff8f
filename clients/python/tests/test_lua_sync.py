"""The Python copies of the Redis scripts (the enqueue script, and the fence
read, map publish and rebalance-lock scripts of the orphaned-fence lift) must
be the Rust ones, byte for byte, and the lift's constants and lock key the
Rust producer's and map store's: this fails CI when
``crates/shardq-redis/src/scripts.rs`` (or those constants) change and
``clients/python/shardq`` does not follow."""

import hashlib
import os
import re

from shardq import _lua
from shardq.redis_producer import (
    ENQUEUE_BATCH_MAX,
    LAYOUT_VERSION,
    LAYOUT_VERSIONS_READ,
    ORPHAN_FENCE_AFTER_MS,
    REBALANCE_LOCK_MS,
    REBALANCE_LOCK_RENEWALS,
    SHARD_PARTS,
    rebalance_lock_key,
)

from support import REPO_ROOT

SCRIPTS_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "scripts.rs")
KEYS_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "keys.rs")
BACKEND_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "backend.rs")
MAPSTORE_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "mapstore.rs")
PRODUCER_RS = os.path.join(REPO_ROOT, "crates", "shardq-core", "src", "producer.rs")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def raw_const(src: str, name: str) -> str:
    m = re.search(r'const %s: &str = r#"(.*?)"#;' % re.escape(name), src, re.S)
    assert m, f"const {name} (a r#\"...\"# string) not found in {SCRIPTS_RS}"
    return m.group(1)


def test_prelude_and_enqueue_match_scripts_rs():
    src = read(SCRIPTS_RS)
    assert _lua.PRELUDE == raw_const(src, "PRELUDE"), (
        "shardq/_lua.py PRELUDE differs from scripts.rs: copy the raw string again"
    )
    assert _lua.ENQUEUE == raw_const(src, "ENQUEUE"), (
        "shardq/_lua.py ENQUEUE differs from scripts.rs: copy the raw string again"
    )


def test_script_is_assembled_like_lua_new():
    src = read(SCRIPTS_RS)
    # The enqueue script is built with the prelude and no flags ...
    assert "enqueue: Lua::new(ENQUEUE, true, Flags::Write)" in src
    assert 'Flags::Write => "#!lua"' in src
    # ... and Lua::new joins shebang, prelude and body with newlines.
    assert 'format!("{shebang}\\n{PRELUDE}\\n{body}")' in src
    assert _lua.ENQUEUE_SCRIPT == "#!lua\n" + raw_const(src, "PRELUDE") + "\n" + raw_const(src, "ENQUEUE")
    assert _lua.ENQUEUE_SHA1 == hashlib.sha1(_lua.ENQUEUE_SCRIPT.encode()).hexdigest()


def test_key_parts_layout_and_batch_limit_match_rust():
    keys = read(KEYS_RS)
    m = re.search(r"pub const SHARD_PARTS: \[&str; (\d+)\] = \[(.*?)\];", keys, re.S)
    assert m, f"SHARD_PARTS not found in {KEYS_RS}"
    assert int(m.group(1)) == len(SHARD_PARTS)
    assert tuple(re.findall(r'"([a-z]+)"', m.group(2))) == SHARD_PARTS
    assert f"pub const LAYOUT_VERSION: u32 = {LAYOUT_VERSION};" in keys
    read_versions = ", ".join(map(str, LAYOUT_VERSIONS_READ))
    assert f"pub const LAYOUT_VERSIONS_READ: [u32; {len(LAYOUT_VERSIONS_READ)}] = [{read_versions}];" in keys
    assert f"pub const ENQUEUE_BATCH_MAX: usize = {ENQUEUE_BATCH_MAX};" in read(BACKEND_RS)


# The scripts the orphaned-fence lift runs: the constant's name (the same in
# both files), how `Scripts::new` builds it, the shebang line of its flags,
# and whether the prelude goes before the body.
LIFT_SCRIPTS = [
    ("FENCE_GET", "fence_get: Lua::new(FENCE_GET, true, Flags::NoWrites)", "#!lua flags=no-writes", True),
    ("MAP_PUBLISH", "map_publish: Lua::new(MAP_PUBLISH, false, Flags::Write)", "#!lua", False),
    ("LOCK_RENEW", "lock_renew: Lua::new(LOCK_RENEW, false, Flags::AllowOom)", "#!lua flags=allow-oom", False),
    ("LOCK_RELEASE", "lock_release: Lua::new(LOCK_RELEASE, false, Flags::AllowOom)", "#!lua flags=allow-oom", False),
]


def test_lift_scripts_match_scripts_rs_and_are_assembled_like_lua_new():
    src = read(SCRIPTS_RS)
    assert 'Flags::AllowOom => "#!lua flags=allow-oom"' in src
    assert 'Flags::NoWrites => "#!lua flags=no-writes"' in src
    assert 'format!("{shebang}\\n{body}")' in src
    for name, built, shebang, prelude in LIFT_SCRIPTS:
        body = raw_const(src, name)
        assert getattr(_lua, name) == body, (
            f"shardq/_lua.py {name} differs from scripts.rs: copy the raw string again"
        )
        assert built in src, f"scripts.rs no longer builds {name} as `{built}`: follow it in shardq/_lua.py"
        want = shebang + "\n" + (raw_const(src, "PRELUDE") + "\n" if prelude else "") + body
        assert getattr(_lua, f"{name}_SCRIPT") == want, name
        assert getattr(_lua, f"{name}_SHA1") == hashlib.sha1(want.encode()).hexdigest(), name


def test_lift_constants_and_lock_key_match_rust():
    assert f"pub const ORPHAN_FENCE_AFTER_MS: u64 = {ORPHAN_FENCE_AFTER_MS:_};" in read(PRODUCER_RS)
    mapstore = read(MAPSTORE_RS)
    assert f"pub const REBALANCE_LOCK_MS: u64 = {REBALANCE_LOCK_MS:_};" in mapstore
    assert f"pub const REBALANCE_LOCK_RENEWALS: u64 = {REBALANCE_LOCK_RENEWALS};" in mapstore
    # The lock token is `host@pid#nonce`, as the Rust map store writes it.
    assert 'crate::coord::default_owner(),' in mapstore and '"{}#{}",' in mapstore
    assert 'format!("{NAMESPACE}:{{=map:{ns}}}:rebalance")' in read(KEYS_RS)
    assert rebalance_lock_key("ns-1") == "sq:{=map:ns-1}:rebalance"
