"""RedisProducer against real redis-server processes and the Rust binary:
jobs enqueued from Python are run by ``shardq work`` in per-key order, and a
live rebalance (add-shard + rebalance in another process) while Python keeps
producing loses nothing, reorders nothing and moves keys to the new shard.
Fence, pause, lost-store, full-store and eviction refusals are exercised on
the server directly, and so is the fence a rebalance leaves when it dies
between fencing and publishing: lifted by republishing the same map, unless
a rebalance holds the lock."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from typing import Dict, List, Tuple

import pytest
import redis

from shardq import (
    ConfigError,
    FencedTooLong,
    Job,
    Placed,
    PausedTooLong,
    RedisProducer,
    StoreFull,
    StoreLost,
)
from shardq.redis_producer import (
    ORPHAN_FENCE_AFTER_MS,
    _map_yaml_at_version,
    map_key,
    rebalance_lock_key,
    shard_key,
)
from shardq.routing import Router

from support import RedisServer, read_lines, shardq, shardq_binary, stop_process, wait_until


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="shardq-py-test-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def servers():
    started: List[RedisServer] = []

    def start(n: int) -> List[RedisServer]:
        for _ in range(n):
            started.append(RedisServer())
        return started[-n:]

    yield start
    for s in started:
        s.stop()


def init(data: str, shards: int, url: str) -> None:
    shardq("init", "--data", data, "--shards", str(shards), "--redis", url)


# A handler command that records key, payload, attempt and shard, one
# write per line on an O_APPEND file.
def recording_handler(out: str) -> List[str]:
    return ["sh", "-c", 'p=$(cat); printf "%s|%s|%s|%s\\n" "$SHARDQ_KEY" "$p" "$SHARDQ_ATTEMPT" "$SHARDQ_SHARD" >> "$0"', out]


def test_jobs_from_python_run_on_the_rust_worker_in_per_key_order(tmp, servers):
    (srv,) = servers(1)
    data = os.path.join(tmp, "D")
    init(data, 4, srv.url)
    producer = RedisProducer.from_data_dir(data)
    keys, per_key = 24, 12
    placed: List[Placed] = []
    # Interleaved keys, several calls, one key with a multibyte name.
    for seq in range(per_key):
        batch = [Job(f"tenant-{k}" if k else "租户-é", f"{seq}") for k in range(keys)]
        placed += producer.enqueue_many(batch)
    assert len(placed) == keys * per_key
    # Routing is the reference router's on the published map.
    router = Router.from_yaml(redis.Redis.from_url(srv.url).hget(map_key("default"), "yaml").decode())
    assert all(p.shard == router.route(p.key) and p.map_version == 1 for p in placed)
    assert len({p.shard for p in placed}) > 1, "24 keys over 4 shards should use more than one"
    # Ids grow per shard in enqueue order.
    by_shard: Dict[str, List[int]] = defaultdict(list)
    for p in placed:
        by_shard[p.shard].append(p.id)
    for shard, ids in by_shard.items():
        assert ids == sorted(ids) and len(set(ids)) == len(ids), shard
    producer.close()

    out = os.path.join(tmp, "runs.txt")
    w = subprocess.run(
        [shardq_binary(), "work", "--data", data, "--exit-when-idle", "--max-local-shards", "all",
         "--concurrency", "4", "--", *recording_handler(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert w.returncode == 0, w.stderr
    seen: Dict[str, List[int]] = defaultdict(list)
    for line in read_lines(out):
        key, payload, attempt, shard = line.split("|")
        assert attempt == "1", line
        assert shard == router.route(key), line
        seen[key].append(int(payload))
    assert set(seen) == {p.key for p in placed}
    for key, seqs in seen.items():
        assert seqs == list(range(per_key)), f"key {key!r} ran {seqs}"


def test_live_rebalance_while_python_produces(tmp, servers):
    a, b = servers(2)
    data = os.path.join(tmp, "D")
    init(data, 4, a.url)
    runs_file = os.path.join(tmp, "runs.txt")
    log = open(os.path.join(tmp, "worker.log"), "w")
    worker_cmd = [shardq_binary(), "work", "--data", data, "--max-local-shards", "all", "--concurrency", "4",
                  "--lease-ms", "1000", "--handler-builtin", f"append:{runs_file}"]
    worker = None
    tenants = 100
    placed: List[Tuple[int, Placed]] = []  # (round, placement)
    errors: List[BaseException] = []
    rebalanced = threading.Event()
    stop_after = [0]

    def produce() -> None:
        try:
            p = RedisProducer.from_data_dir(data)
            rounds, after = 0, 0
            while after < 5:
                got = p.enqueue_many([Job(f"tenant-{t}", str(rounds)) for t in range(tenants)])
                placed.extend((rounds, x) for x in got)
                rounds += 1
                if rebalanced.is_set():
                    after += 1
                time.sleep(0.1)
            stop_after[0] = rounds
            p.close()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    feeder = threading.Thread(target=produce)
    feeder.start()
    try:
        # A backlog on every key first, so the rebalance has keys with work
        # to pin, drain and switch while the producer keeps sending.
        wait_until("a backlog of 1000 jobs", lambda: len(placed) >= 1000 or bool(errors))
        assert not errors, errors
        worker = subprocess.Popen(worker_cmd, stdout=subprocess.DEVNULL, stderr=log)
        wait_until("the worker to run jobs before the change", lambda: len(read_lines(runs_file)) > 100)
        before = Router.from_yaml(open(os.path.join(data, "shardmap.yaml")).read())
        added = shardq("add-shard", "--data", data, "shard-4", "--url", b.url)
        assert "warming" in added.stdout, added.stdout
        rb = shardq("rebalance", "--data", data, "--json", "--batch", "16", "--drain-timeout-ms", "30000", check=False, timeout=120)
        assert rb.returncode == 0, f"rebalance failed:\n{rb.stderr}\nworker log:\n{open(log.name).read()[-3000:]}"
        report = json.loads(rb.stdout)
        assert report["keys_moved"] > 0, f"no key with work was moved live: {report}"
        assert all(set(tos) == {"shard-4"} for tos in report["moves"].values()), report
        rebalanced.set()
        feeder.join(120)
        assert not feeder.is_alive(), "the producer did not finish"
        assert not errors, errors
        total = len(placed)
        assert total == stop_after[0] * tenants

        assert len({(x.shard, x.id) for _, x in placed}) == total, "two placements share a (shard, id)"
        # A job is named by its key and its round (the payload): one that
        # moved with its key has a new id on its new shard.
        job_of = {(x.key, r): r for r, x in placed}
        assert len(job_of) == total

        def runs() -> List[Tuple[str, int, int, str]]:
            out = []
            for line in read_lines(runs_file):
                # KEY ID ATTEMPT SHARD PAYLOAD (the payload escaped, last)
                k, _, att, s, payload = line.split(" ", 4)
                out.append((k, int(payload), int(att), s))
            return out

        wait_until("every job to run", lambda: len({(k, r) for k, r, _, _ in runs()}) >= total, timeout_s=120)
    finally:
        if worker is not None:
            stop_process(worker, "shardq work")
        log.close()
        rebalanced.set()
        feeder.join(30)

    # Per key, first runs follow the rounds with no gap; nothing lost; a
    # second run of a job only as a retry (never attempt 1 twice).
    last: Dict[str, int] = {}
    ran = set()
    for key, rnd, attempt, shard in runs():
        job = (key, rnd)
        assert job in job_of, f"run of a job never enqueued: {key} round {rnd} on {shard}"
        r = job_of[job]
        if job in ran:
            assert attempt > 1, f"job {job} of {key} ran twice at attempt 1"
            continue
        ran.add(job)
        assert r == last.get(key, -1) + 1, f"key {key!r}: round {r} ran after round {last.get(key)}"
        last[key] = r
    assert len(ran) == total, f"{total - len(ran)} job(s) never ran"

    after = Router.from_yaml(open(os.path.join(data, "shardmap.yaml")).read())
    assert [s.name for s in after.map.shards][-1] == "shard-4" and not after.map.overrides
    moved = [f"tenant-{t}" for t in range(tenants) if before.route(f"tenant-{t}") != after.route(f"tenant-{t}")]
    assert moved, "no tenant moved to shard-4"
    assert all(after.route(k) == "shard-4" for k in moved)
    last_shard = {x.key: x.shard for _, x in placed}
    assert all(last_shard[k] == "shard-4" for k in moved), "jobs after the switch should go to shard-4"
    assert any(s == "shard-4" for _, _, _, s in runs()), "no job ran on shard-4"


# --- refusals, on the server directly -----------------------------------------


def _deployment(tmp: str, srv: RedisServer, shards: int = 2) -> Tuple[str, redis.Redis]:
    data = os.path.join(tmp, "D")
    init(data, shards, srv.url)
    return data, redis.Redis.from_url(srv.url)


def test_fenced_until_a_newer_map_is_published(tmp, servers):
    (srv,) = servers(1)
    data, r = _deployment(tmp, srv)
    p = RedisProducer.from_data_dir(data, fence_wait_ms=300)
    shard = p.router.route("k")
    meta = shard_key("default", "default", shard, "meta")
    r.hset(meta, "fmin", 2)
    t0 = time.monotonic()
    with pytest.raises(FencedTooLong) as e:
        p.enqueue("k", "x")
    assert e.value.shard == shard and e.value.map_version == 1
    assert time.monotonic() - t0 < 5
    # A newer map published while the producer waits lets the job in, stamped 2.
    yaml = r.hget(map_key("default"), "yaml").decode().replace("version: 1", "version: 2", 1)
    p2 = RedisProducer.from_data_dir(data, fence_wait_ms=10_000)
    threading.Timer(0.2, lambda: r.hset(map_key("default"), mapping={"version": 2, "yaml": yaml})).start()
    got = p2.enqueue("k", "y")
    assert got.map_version == 2 and got.shard == shard
    assert r.hget(meta, "seq") == b"1", "the fenced attempts stored nothing"


def test_paused_key_waits_then_gives_up_without_holding_back_others(tmp, servers):
    (srv,) = servers(1)
    data, r = _deployment(tmp, srv, shards=1)
    p = RedisProducer.from_data_dir(data, pause_wait_ms=300)
    paused = shard_key("default", "default", "shard-0", "paused")
    r.sadd(paused, "slow")
    with pytest.raises(PausedTooLong) as e:
        p.enqueue_many([Job("a", "1"), Job("slow", "1"), Job("b", "1"), Job("a", "2")])
    assert e.value.keys == ["slow"] and e.value.shard == "shard-0"
    assert [(x.key, x.index) for x in e.value.placed] == [("a", 0), ("b", 2), ("a", 3)]
    # Unpaused while waiting: it goes in.
    threading.Timer(0.2, lambda: r.srem(paused, "slow")).start()
    p2 = RedisProducer.from_data_dir(data, pause_wait_ms=10_000)
    assert p2.enqueue("slow", "2").key == "slow"


def test_a_frozen_key_sends_its_jobs_to_the_shard_that_holds_it_at_once(tmp, servers):
    # A rebalance froze "k" on its old shard (sealed for shard D and
    # paused): its jobs go to D straight away, in order, with no wait, and
    # the other keys of the call stay where they route.
    (srv,) = servers(1)
    data, r = _deployment(tmp, srv)
    p = RedisProducer.from_data_dir(data, pause_wait_ms=0)
    old = p.router.route("k")
    new = next(s.name for s in p.router.map.shards if s.name != old)
    other = next(k for k in (f"o{i}" for i in range(1000)) if p.router.route(k) == old)
    paused, sealed, meta = (shard_key("default", "default", old, part) for part in ("paused", "sealed", "meta"))
    r.hset(sealed, "k", new)
    r.sadd(paused, "k")
    t0 = time.monotonic()
    got = p.enqueue_many([Job("k", "1"), Job(other, "x"), Job("k", "2")])
    assert time.monotonic() - t0 < 2
    assert [(g.key, g.shard) for g in got] == [("k", new), (other, old), ("k", new)]
    assert got[0].id < got[2].id, "the key's jobs kept their order on its new shard"
    # Its old shard stored nothing of it; a later call goes to D directly.
    assert r.hget(meta, "seq") == b"1", "only the other key's job went to the old shard"
    assert p.enqueue("k", "3").shard == new
    # A key only paused (not sealed) still waits, and gives up at its bound.
    r.hdel(sealed, "k")
    p2 = RedisProducer.from_data_dir(data, pause_wait_ms=100)
    with pytest.raises(PausedTooLong):
        p2.enqueue("k", "4")


def test_lost_store_full_store_and_evicting_server_are_refused(tmp, servers):
    (srv,) = servers(1)
    data, r = _deployment(tmp, srv)
    p = RedisProducer.from_data_dir(data)
    r.config_set("maxmemory", 1)
    with pytest.raises(StoreFull, match="OOM"):
        p.enqueue("k", "x")
    r.config_set("maxmemory", 0)
    meta = shard_key("default", "default", p.router.route("k"), "meta")
    r.hdel(meta, "dep")
    with pytest.raises(StoreLost, match="deployment record"):
        p.enqueue("k", "x")
    r.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(ConfigError, match="allkeys-lru"):
        RedisProducer.from_data_dir(data)


# --- an orphaned fence: a rebalance killed between its fence and its publish --


def _fence_every_shard(r: redis.Redis, router: Router, version: int) -> None:
    """What phase 1 of a rebalance leaves when it is killed right after its
    fence write: every shard's fence (``map_version_min``, the ``fmin``
    field of the shard's ``meta`` hash) at the next version, no map
    published at it and no rebalance lock held."""
    for s in router.map.shards:
        r.hset(shard_key("default", "default", s.name, "meta"), "fmin", version)


def _set_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_set", {}).get("calls", 0))


def test_an_orphaned_fence_is_lifted_by_republishing_the_same_map(tmp, servers):
    (srv,) = servers(1)
    data, r = _deployment(tmp, srv, shards=3)
    p = RedisProducer.from_data_dir(data)
    assert p.fence_wait_ms == 30_000
    before_yaml = r.hget(map_key("default"), "yaml").decode()
    before = Router.from_yaml(before_yaml)
    v = before.map.version
    _fence_every_shard(r, before, v + 1)
    assert not r.exists(rebalance_lock_key("default"))

    t0 = time.monotonic()
    got = p.enqueue("k", "x")
    took = time.monotonic() - t0
    # Refused for the Rust producer's interval, then lifted: far inside
    # fence_wait_ms.
    assert ORPHAN_FENCE_AFTER_MS / 1000 <= took < 10, f"took {took:.1f} s"
    assert got.map_version == v + 1 and got.shard == before.route("k")
    assert r.hget(shard_key("default", "default", got.shard, "meta"), "seq") == b"1"

    # The published map is the same map at the fence's version: only its
    # version line changed, and every key routes as before.
    version, yaml = r.hmget(map_key("default"), "version", "yaml")
    assert int(version) == v + 1
    assert yaml.decode() == before_yaml.replace(f"version: {v}\n", f"version: {v + 1}\n", 1)
    after = Router.from_yaml(yaml.decode())
    assert after.map.version == v + 1
    assert dataclasses.replace(after.map, version=v) == before.map
    keys = [f"tenant-{i}" for i in range(500)]
    assert [after.route(k) for k in keys] == [before.route(k) for k in keys]
    # The lift gave its lock back.
    assert not r.exists(rebalance_lock_key("default"))

    # The Rust side loads the republished map and goes in with it, and its
    # router agrees with Python's.
    out = shardq("enqueue", "--data", data, "--key", "k", "--payload", "y")
    assert out.stdout.strip() == f"{got.shard}:2", out.stdout
    lifted = os.path.join(tmp, "lifted.yaml")
    with open(lifted, "w", encoding="utf-8") as f:
        f.write(yaml.decode())
    routed = shardq("route", "--map", lifted, *keys[:50]).stdout.splitlines()
    assert routed == [f"{k}\t{before.route(k)}" for k in keys[:50]]


def test_an_orphaned_fence_is_not_lifted_while_a_rebalance_holds_the_lock(tmp, servers):
    (srv,) = servers(1)
    data, r = _deployment(tmp, srv)
    before_yaml = r.hget(map_key("default"), "yaml").decode()
    before = Router.from_yaml(before_yaml)
    v = before.map.version
    _fence_every_shard(r, before, v + 1)
    lock = rebalance_lock_key("default")
    holder = b"rebalancer-host@4242#0"
    r.set(lock, holder, px=60_000)

    wait_ms = ORPHAN_FENCE_AFTER_MS + 1_500
    p = RedisProducer.from_data_dir(data, fence_wait_ms=wait_ms)
    sets = _set_calls(r)
    t0 = time.monotonic()
    with pytest.raises(FencedTooLong) as e:
        p.enqueue("k", "x")
    assert e.value.map_version == v
    assert wait_ms / 1000 <= time.monotonic() - t0 < 10
    # It tried the lock (SET NX) once the interval had passed, found it
    # held, and published nothing; the holder's lock is untouched.
    assert _set_calls(r) > sets, "the producer never tried the rebalance lock"
    assert r.hmget(map_key("default"), "version", "yaml") == [str(v).encode(), before_yaml.encode()]
    assert r.get(lock) == holder and r.pttl(lock) > 0
    for s in before.map.shards:
        assert r.hget(shard_key("default", "default", s.name, "meta"), "seq") in (None, b"0")

    # Once the rebalance is gone (its lock lapsed), the same wait lifts it.
    r.delete(lock)
    got = RedisProducer.from_data_dir(data).enqueue("k", "x")
    assert got.map_version == v + 1 and got.shard == before.route("k")


def _dead_local_token() -> str:
    """A rebalance lock token naming a process of this host that is gone,
    as a SIGKILLed ``shardq rebalance`` leaves it."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    with open("/proc/sys/kernel/hostname", encoding="utf-8") as f:
        host = f.read().strip()
    return f"{host}@{dead.pid}#0"


def test_a_fence_left_by_a_killed_local_rebalance_is_lifted_without_waiting_for_its_lease(tmp, servers):
    # A rebalance SIGKILLed between its fence and its publish leaves the
    # shards fenced and its lock held for the rest of its lease. Producers
    # of the same host see the holder is gone and lift the fence at their
    # first check, the Rust CLI and the Python producer alike; nothing is
    # refused.
    (srv,) = servers(1)
    data, r = _deployment(tmp, srv, shards=3)
    lock = rebalance_lock_key("default")
    before = Router.from_yaml(r.hget(map_key("default"), "yaml").decode())
    v = before.map.version
    for round_, produce in enumerate(
        [
            lambda: shardq("enqueue", "--data", data, "--key", "k", "--payload", "rust"),
            lambda: RedisProducer.from_data_dir(data).enqueue("k", "python"),
        ]
    ):
        version = v + 1 + round_
        _fence_every_shard(r, before, version)
        r.set(lock, _dead_local_token(), px=60_000)
        t0 = time.monotonic()
        produce()
        took = time.monotonic() - t0
        assert took < ORPHAN_FENCE_AFTER_MS / 1000 + 3, f"round {round_}: took {took:.1f} s"
        assert int(r.hget(map_key("default"), "version")) == version
        assert not r.exists(lock), "the lift gave the lock back"
    assert r.hget(shard_key("default", "default", before.route("k"), "meta"), "seq") == b"2"


def test_a_lift_republishes_only_a_map_that_validates_with_only_its_version_changed():
    text = (
        "version: 4\nalgorithm: ring\nhash: xxh3\nvnodes: 64\nshards:\n"
        '  - { name: shard-0, url: "redis://127.0.0.1:1/0", weight: 1 }\n'
        '  - { name: shard-1, url: "redis://127.0.0.1:1/0", weight: 2, state: warming }\n'
        "overrides:\n  \"version: 4\": shard-0\n"
    )
    out = _map_yaml_at_version(text, 9)
    assert out == text.replace("version: 4\n", "version: 9\n", 1)
    assert Router.from_yaml(out).map == dataclasses.replace(Router.from_yaml(text).map, version=9)
    # No top-level version line to change, or a map that does not validate:
    # refused, never published.
    with pytest.raises(ConfigError, match="version"):
        _map_yaml_at_version("{version: 4, shards: [{name: a}]}", 5)
    with pytest.raises(ConfigError, match="does not validate"):
        _map_yaml_at_version("version: 4\nshards:\n  - { name: a, state: warming }\n", 5)
