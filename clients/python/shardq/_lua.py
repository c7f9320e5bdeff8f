"""The Redis backend's scripts this client runs, read from the one copy the
Rust backend also runs: ``crates/shardq-redis/lua/`` in the repository,
shipped in the wheel as ``shardq/lua/``. Nothing here is Lua: this module
only reads the files and composes them the way ``Lua::new`` in
``crates/shardq-redis/src/scripts.rs`` does (the ``#!lua`` line with the
script's flags, the shared ``prelude.lua`` for a shard script, then the
script), so both languages send the same text under the same SHA1.

The scripts: ``enqueue.lua``, and the ones a producer needs to lift an
orphaned fence the way the Rust producer does (``fence_get.lua``,
``map_publish.lua``, ``lock_renew.lua``, ``lock_release.lua``). Each file's
header says its KEYS and ARGV; the key grammar is docs/redis-protocol.md.
"""

import hashlib
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
#: Where the scripts are looked for: the wheel's package data, then the
#: repository's copy beside this source tree.
_PLACES = (
    os.path.join(_HERE, "lua"),
    os.path.normpath(os.path.join(_HERE, "..", "..", "..", "crates", "shardq-redis", "lua")),
)


def _scripts_dir() -> str:
    for d in _PLACES:
        if os.path.isfile(os.path.join(d, "prelude.lua")):
            return d
    raise ImportError(
        "shardq's Redis scripts were not found (looked in " + ", ".join(_PLACES) + "); "
        "install the package from a wheel, or use it from a checkout of the repository"
    )


def _read(name: str) -> str:
    with open(os.path.join(_scripts_dir(), name + ".lua"), encoding="utf-8") as f:
        return f.read()


def _sha1(script: str) -> str:
    return hashlib.sha1(script.encode("utf-8")).hexdigest()


def compose(name: str, flags: str, prelude: bool) -> str:
    """Script ``name`` as the server receives it: ``#!lua`` with ``flags``
    (``""``, ``"allow-oom"`` or ``"no-writes"``), then ``prelude.lua`` for
    a shard script, then the script (``Lua::new``'s recipe)."""
    shebang = "#!lua" + (" flags=" + flags if flags else "")
    if prelude:
        return shebang + "\n" + PRELUDE + "\n" + _read(name)
    return shebang + "\n" + _read(name)


#: Shared helpers of every shard script.
PRELUDE = _read("prelude")
#: The body of the enqueue script.
ENQUEUE = _read("enqueue")

#: As ``Lua::new(ENQUEUE, true, Flags::Write)`` builds it: no flags, so a
#: server at ``maxmemory`` refuses it with ``OOM``.
ENQUEUE_SCRIPT = compose("enqueue", "", True)
#: SHA1 of :data:`ENQUEUE_SCRIPT`, the name ``EVALSHA`` runs it by.
ENQUEUE_SHA1 = _sha1(ENQUEUE_SCRIPT)
#: As ``Lua::new(FENCE_GET, true, Flags::NoWrites)`` builds it.
FENCE_GET_SCRIPT = compose("fence_get", "no-writes", True)
FENCE_GET_SHA1 = _sha1(FENCE_GET_SCRIPT)
#: As ``Lua::new(MAP_PUBLISH, false, Flags::Write)`` builds it.
MAP_PUBLISH_SCRIPT = compose("map_publish", "", False)
MAP_PUBLISH_SHA1 = _sha1(MAP_PUBLISH_SCRIPT)
#: As ``Lua::new(LOCK_RENEW, false, Flags::AllowOom)`` builds it.
LOCK_RENEW_SCRIPT = compose("lock_renew", "allow-oom", False)
LOCK_RENEW_SHA1 = _sha1(LOCK_RENEW_SCRIPT)
#: As ``Lua::new(LOCK_RELEASE, false, Flags::AllowOom)`` builds it.
LOCK_RELEASE_SCRIPT = compose("lock_release", "allow-oom", False)
LOCK_RELEASE_SHA1 = _sha1(LOCK_RELEASE_SCRIPT)
