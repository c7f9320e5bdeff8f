"""The Python Redis producer speaks the Rust backend's protocol: it runs the
very script files the Rust backend runs (``crates/shardq-redis/lua/``, read
by ``shardq/_lua.py``), composed as ``Lua::new`` composes them, with the
Rust side's shard parts, layout version, batch bound, lift constants and
lock key. This fails CI when the Rust side changes and
``clients/python/shardq`` does not follow."""

import hashlib
import os
import re

from shardq import _lua
from shardq.redis_producer import (
    ENQUEUE_BATCH_MAX,
    LAYOUT_VERSION,
    REMOTE_VERSION,
    ORPHAN_FENCE_AFTER_MS,
    REBALANCE_LOCK_MS,
    REBALANCE_LOCK_RENEWALS,
    SHARD_PARTS,
    rebalance_lock_key,
)

from support import REPO_ROOT

SCRIPTS_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "scripts.rs")
KEYS_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "keys.rs")
BACKEND_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "backend", "mod.rs")
MAPSTORE_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "mapstore.rs")
PRODUCER_RS = os.path.join(REPO_ROOT, "crates", "shardq-core", "src", "producer.rs")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


LUA_DIR = os.path.join(REPO_ROOT, "crates", "shardq-redis", "lua")


def lua_file(name: str) -> str:
    return read(os.path.join(LUA_DIR, name.lower() + ".lua"))


def test_the_client_reads_the_backends_own_script_files():
    assert _lua.PRELUDE == lua_file("PRELUDE")
    assert _lua.ENQUEUE == lua_file("ENQUEUE")
    src = read(SCRIPTS_RS)
    for name in ("PRELUDE", "ENQUEUE", "FENCE_GET", "MAP_PUBLISH", "LOCK_RENEW", "LOCK_RELEASE"):
        assert f'const {name}: &str = include_str!("../lua/{name.lower()}.lua");' in src, name


def test_script_is_assembled_like_lua_new():
    src = read(SCRIPTS_RS)
    # The enqueue script is built with the prelude and no flags ...
    assert "enqueue: Lua::new(ENQUEUE, true, Flags::Write)" in src
    assert 'Flags::Write => "#!lua"' in src
    # ... and Lua::new joins shebang, prelude and body with newlines.
    assert 'format!("{shebang}\\n{PRELUDE}\\n{body}")' in src
    assert _lua.ENQUEUE_SCRIPT == "#!lua\n" + lua_file("PRELUDE") + "\n" + lua_file("ENQUEUE")
    assert _lua.ENQUEUE_SHA1 == hashlib.sha1(_lua.ENQUEUE_SCRIPT.encode()).hexdigest()


def test_key_parts_layout_and_batch_limit_match_rust():
    keys = read(KEYS_RS)
    m = re.search(r"pub const SHARD_PARTS: \[&str; (\d+)\] = \[(.*?)\];", keys, re.S)
    assert m, f"SHARD_PARTS not found in {KEYS_RS}"
    assert int(m.group(1)) == len(SHARD_PARTS)
    assert tuple(re.findall(r'"([a-z]+)"', m.group(2))) == SHARD_PARTS
    assert f"pub const LAYOUT_VERSION: u32 = {LAYOUT_VERSION};" in keys
    assert f"pub const ENQUEUE_BATCH_MAX: usize = {ENQUEUE_BATCH_MAX};" in read(BACKEND_RS)
    remote_rs = os.path.join(REPO_ROOT, "crates", "shardq-deploy", "src", "remote.rs")
    assert f"pub const REMOTE_VERSION: u32 = {REMOTE_VERSION};" in read(remote_rs)


# The scripts the orphaned-fence lift runs: the constant's name (the same in
# both files), how `Scripts::new` builds it, the shebang line of its flags,
# and whether the prelude goes before the body.
LIFT_SCRIPTS = [
    ("FENCE_GET", "fence_get: Lua::new(FENCE_GET, true, Flags::NoWrites)", "#!lua flags=no-writes", True),
    ("MAP_PUBLISH", "map_publish: Lua::new(MAP_PUBLISH, false, Flags::Write)", "#!lua", False),
    ("LOCK_RENEW", "lock_renew: Lua::new(LOCK_RENEW, false, Flags::AllowOom)", "#!lua flags=allow-oom", False),
    ("LOCK_RELEASE", "lock_release: Lua::new(LOCK_RELEASE, false, Flags::AllowOom)", "#!lua flags=allow-oom", False),
]


def test_lift_scripts_are_assembled_like_lua_new():
    src = read(SCRIPTS_RS)
    assert 'Flags::AllowOom => "#!lua flags=allow-oom"' in src
    assert 'Flags::NoWrites => "#!lua flags=no-writes"' in src
    assert 'format!("{shebang}\\n{body}")' in src
    for name, built, shebang, prelude in LIFT_SCRIPTS:
        body = lua_file(name)
        assert built in src, f"scripts.rs no longer builds {name} as `{built}`: follow it in shardq/_lua.py"
        want = shebang + "\n" + (lua_file("PRELUDE") + "\n" if prelude else "") + body
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
