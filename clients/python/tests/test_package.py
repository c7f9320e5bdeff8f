"""The package as its users get it: a wheel built from the source that
needs nothing but the standard library (the rest are extras), ships
``py.typed`` and writes nothing into the source tree; ``mypy --strict``
clean; one error hierarchy; the asyncio clients at the top level."""

from __future__ import annotations

import asyncio
import glob
import os
import subprocess
import sys
import zipfile

import pytest

import shardq
from shardq import AsyncClient, AsyncWorker, Client, ConfigError, InvalidJob, NewJob, ShardqError, Worker

PKG = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _tree(root: str) -> set:
    out = set()
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", ".pytest_cache", ".mypy_cache")]
        out.update(os.path.relpath(os.path.join(d, f), root) for f in files if not f.endswith(".pyc"))
        out.update(os.path.relpath(os.path.join(d, x), root) + "/" for x in dirs)
    return out


def test_a_wheel_from_the_source_needs_only_the_standard_library_and_leaves_the_tree_clean(tmp_path):
    before = _tree(PKG)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
                        "-w", str(tmp_path), PKG], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _tree(PKG) == before, f"the build wrote into the source tree: {sorted(_tree(PKG) ^ before)}"
    assert not any(p.startswith("build/") or ".egg-info" in p for p in _tree(PKG))
    (wheel,) = glob.glob(str(tmp_path / "shardq-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
    assert {"shardq/py.typed", "shardq/http.py", "shardq/aio.py", "shardq/routing/router.py"} <= names
    assert {n.split("/")[0] for n in names if not n.startswith("shardq-")} == {"shardq"}, "one top-level package"
    requires = [l for l in meta.splitlines() if l.startswith("Requires-Dist:")]
    assert requires and all("extra ==" in l for l in requires), requires
    extras = {l.split(":", 1)[1].strip() for l in meta.splitlines() if l.startswith("Provides-Extra:")}
    assert {"asyncio", "redis", "fast"} <= extras
    assert any(("redis" in l and ("extra == \"redis\"" in l or "extra == 'redis'" in l)) for l in requires)
    # The Redis scripts ship as package data: the one copy the Rust backend runs.
    lua = sorted(n for n in names if n.startswith("shardq/lua/") and n.endswith(".lua"))
    repo_lua = sorted(f for f in os.listdir(os.path.join(PKG, "..", "..", "crates", "shardq-redis", "lua")) if f.endswith(".lua"))
    assert lua == ["shardq/lua/" + f for f in repo_lua], lua
    assert "Requires-Python: >=3.11" in meta


def test_the_package_passes_mypy_strict(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file", os.path.join(PKG, "pyproject.toml"),
                        "--cache-dir", str(tmp_path / "cache"), os.path.join(PKG, "shardq")],
                       capture_output=True, text=True, timeout=300, cwd=PKG)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("key", ["", None, 7])
def test_a_bad_key_is_invalid_job_from_every_client(key):
    from shardq.redis_producer import Job, _as_job

    url = "http://127.0.0.1:1"  # never reached: refused before any request
    with pytest.raises(InvalidJob):
        Client(url).enqueue(key, "x")  # type: ignore[arg-type]
    with pytest.raises(InvalidJob):
        Client(url).enqueue_many([{"key": key, "payload": "x"}])

    async def aio() -> None:
        async with AsyncClient(url) as c:
            await c.enqueue(key, "x")  # type: ignore[arg-type]

    with pytest.raises(InvalidJob):
        asyncio.run(aio())
    with pytest.raises(InvalidJob):
        _as_job(Job(key, b"x"), 1 << 20)  # type: ignore[arg-type]


@pytest.mark.parametrize("key, shown", [("\0", "U+0000"), ("a\nb", "U+000A"), ("t\x1b[2J", "U+001B"),
                                        ("x\u202ey", "U+202E"), ("\x85", "U+0085")])
def test_the_redis_producer_refuses_the_keys_the_server_refuses(key, shown):
    # The Redis producer writes to the store itself: it holds keys to the
    # grammar the server and the Rust producer check (and a NUL key would
    # be the store's own pin field of the keys hash).
    from shardq.redis_producer import Job, _as_job

    with pytest.raises(InvalidJob) as e:
        _as_job(Job(key, b"x"), 1 << 20)
    assert shown in str(e.value)
    assert _as_job(Job("tenant-\u00e9", b"x"), 1 << 20)[0] == "tenant-\u00e9"


def test_one_error_hierarchy_and_the_asyncio_clients_at_the_top_level():
    assert issubclass(InvalidJob, ShardqError) and issubclass(ConfigError, ShardqError)
    for bad in (lambda: Client("ftp://x"), lambda: Client([]), lambda: Worker("nope"),
                lambda: Client("http://127.0.0.1:1").enqueue("k", 5),  # type: ignore[arg-type]
                lambda: Client("http://127.0.0.1:1").enqueue_many([{"key": "k", "colour": "red"}]),
                lambda: Worker("http://127.0.0.1:1").run(lambda j: None, concurrency=0)):
        with pytest.raises(ShardqError):
            bad()
    assert shardq.AsyncClient is AsyncClient and shardq.AsyncWorker is AsyncWorker
    with Client("http://127.0.0.1:1") as c:
        assert isinstance(c, Client)
    job = NewJob("k")
    assert job.dedup_id is None
