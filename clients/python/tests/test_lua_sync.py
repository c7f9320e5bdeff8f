"""The Python copy of the enqueue script must be the Rust one, byte for byte:
this fails CI when ``crates/shardq-redis/src/scripts.rs`` changes and
``clients/python/shardq/_lua.py`` does not follow."""

import hashlib
import os
import re

from shardq import _lua
from shardq.redis_producer import ENQUEUE_BATCH_MAX, LAYOUT_VERSION, SHARD_PARTS

from support import REPO_ROOT

SCRIPTS_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "scripts.rs")
KEYS_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "keys.rs")
BACKEND_RS = os.path.join(REPO_ROOT, "crates", "shardq-redis", "src", "backend.rs")


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
    assert f"pub const ENQUEUE_BATCH_MAX: usize = {ENQUEUE_BATCH_MAX};" in read(BACKEND_RS)
