"""AsyncClient and AsyncWorker (``shardq.aio``): against the stand-in server
(which checks every request's shape) and against a real ``shardq serve``.

Invariants: one run per key at a time, per-key order, each job acked once,
a long job kept alive by extends, a failing attempt retried, a 409 taken as
a lost run (not retried), and stop() draining the running jobs."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import defaultdict
from typing import Dict, List, Set, Tuple

from shardq import ClaimedJob, NewJob, Retry
from shardq.aio import AsyncClient, AsyncWorker

from support import check_order_and_completeness, check_two_server_round_trip, jobs_for


def run(coro):
    return asyncio.run(coro)


async def until(what: str, done, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


def test_async_enqueue_sends_the_contract_and_a_dedup_id_per_job(fakes):
    f = fakes("a", token="sekret")

    async def go():
        async with AsyncClient([f.url], token="sekret") as c:
            got = await c.enqueue_many([
                NewJob("k1", "text é"),
                NewJob("k1", b"\xff\x00bin", delay_ms=5, max_attempts=3),
                {"key": "k2", "payload": b"x", "dedup_id": "mine-1"},
            ])
            one = await c.enqueue("k3", "p")
        return got, one

    got, one = run(go())
    assert not f.shape_errors, f.shape_errors
    bodies = [b for p, b in f.requests if p == "/v1/jobs"]
    jobs = bodies[0]["jobs"]
    assert jobs[0]["payload"] == "text é" and jobs[1]["payload_b64"] == "/wBiaW4="
    assert (jobs[1]["delay_ms"], jobs[1]["max_attempts"], jobs[2]["dedup_id"]) == (5, 3, "mine-1")
    assert all(re.fullmatch(r"[0-9a-f]{24}-[0-9]+", j["dedup_id"]) for j in jobs[:2])
    assert [(e.id, e.key, e.duplicate) for e in got] == [("a:1", "k1", False), ("a:2", "k1", False), ("a:3", "k2", False)]
    assert one.shard == "a" and f.jobs[2]["payload"] == b"\xff\x00bin"


def test_async_worker_runs_every_job_once_in_per_key_order_over_two_servers(fakes):
    a, b = fakes("a"), fakes("b")
    keys, per_key = 16, 12
    seen: Dict[str, List[int]] = defaultdict(list)
    running: Set[str] = set()
    overlaps: List[str] = []

    async def handler(job: ClaimedJob) -> None:
        if job.key in running:
            overlaps.append(job.key)
        running.add(job.key)
        await asyncio.sleep(0.002 * (sum(job.key.encode()) % 3))
        running.discard(job.key)
        seen[job.key].append(int(job.payload))
        assert job.url == (a.url if job.key.startswith("a-") else b.url)

    async def go():
        async with AsyncClient([a.url]) as ca, AsyncClient([b.url]) as cb:
            for seq in range(per_key):
                await ca.enqueue_many([NewJob(f"a-{k}", str(seq)) for k in range(keys)])
                await cb.enqueue_many([NewJob(f"b-{k}", str(seq)) for k in range(keys)])
        w = AsyncWorker([a.url, b.url])
        task = asyncio.ensure_future(w.run(handler, concurrency=6, lease_ms=5000, wait_ms=200,
                                           install_signal_handlers=False))
        await until("every job to be acked", lambda: a.pending() == 0 and b.pending() == 0)
        w.stop()
        return await asyncio.wait_for(task, 30)

    stats = run(go())
    check_two_server_round_trip(a, b, overlaps, seen, keys, per_key)
    assert (stats.acked, stats.lost, stats.failed) == (2 * keys * per_key, 0, 0)
    assert stats.ack_requests < stats.acked, "acks were not batched"


def test_async_long_job_is_extended_failing_one_retried_and_retry_delay_sent(fakes):
    f = fakes("a")
    runs: List[Tuple[str, int, int]] = []

    async def handler(job: ClaimedJob) -> None:
        runs.append((job.key, int(job.payload), job.attempt))
        if job.key == "slow":
            await asyncio.sleep(1.2)  # four leases of 300 ms
        if job.key == "flaky" and job.attempt == 1 and job.payload == b"0":
            raise RuntimeError("boom")
        if job.key == "later" and job.attempt == 1:
            raise Retry("not yet", 50)

    async def go():
        async with AsyncClient([f.url]) as c:
            await c.enqueue_many([NewJob("slow", "0"), NewJob("flaky", "0"), NewJob("flaky", "1"), NewJob("later", "0")])
        w = AsyncWorker([f.url])
        task = asyncio.ensure_future(w.run(handler, concurrency=3, lease_ms=300, wait_ms=100,
                                           install_signal_handlers=False))
        await until("the jobs to finish", lambda: f.pending() == 0)
        w.stop()
        return await asyncio.wait_for(task, 30)

    stats = run(go())
    assert not f.shape_errors, f.shape_errors
    assert [r for r in runs if r[0] == "slow"] == [("slow", 0, 1)], "the extended job ran again"
    assert f.count("/v1/extend") >= 2
    assert [r for r in runs if r[0] == "flaky"] == [("flaky", 0, 1), ("flaky", 0, 2), ("flaky", 1, 1)]
    fails = [b for p, b in f.requests if p == "/v1/fail"]
    assert any("RuntimeError: boom" in x["reason"] for x in fails)
    assert any(x.get("retry_in_ms") == 50 and x["reason"] == "not yet" for x in fails)
    assert stats.acked == 4 and stats.failed == 2


def test_async_409_on_ack_means_the_run_was_lost_and_is_not_retried(fakes, caplog):
    f = fakes("a")
    f.intercept = lambda path, doc: (409, {"error": "stale receipt"}) if path == "/v1/ack" else None
    done = []

    async def handler(job: ClaimedJob) -> None:
        done.append(job.id)

    async def go():
        async with AsyncClient([f.url]) as c:
            await c.enqueue("k", "x")
        w = AsyncWorker([f.url])
        task = asyncio.ensure_future(w.run(handler, concurrency=1, lease_ms=5000, wait_ms=100,
                                           install_signal_handlers=False))
        await until("the ack", lambda: f.count("/v1/ack") >= 1)
        await asyncio.sleep(0.3)  # room for a (wrong) retry to show up
        w.stop()
        return await asyncio.wait_for(task, 30)

    with caplog.at_level(logging.WARNING, logger="shardq"):
        stats = run(go())
    assert f.count("/v1/ack") == 1 and done
    assert stats.lost == 1 and stats.acked == 0
    assert any("the run was lost" in r.getMessage() for r in caplog.records)


def test_async_round_trip_through_a_real_server_keeps_order_and_acks_each_job_once(serve):
    keys, per_key = 40, 25
    n = keys * per_key
    records: List[Dict] = []
    running: Set[str] = set()
    overlaps: List[str] = []

    async def handler(job: ClaimedJob) -> None:
        seq = json.loads(job.payload)["seq"]
        if job.key in running:
            overlaps.append(job.key)
        running.add(job.key)
        records.append({"key": job.key, "seq": seq, "id": job.id, "attempt": job.attempt})
        await asyncio.sleep(0.0005)
        running.discard(job.key)

    async def go():
        async with AsyncClient([serve.url]) as c:
            placed = await c.enqueue_many(jobs_for("aio", keys, per_key))
            again = await c.enqueue_many(jobs_for("aio", keys, per_key)[:50])
        w = AsyncWorker([serve.url], worker_id="e2e-aio")
        # Stopped while jobs still run: stop() drains them.
        task = asyncio.ensure_future(w.run(handler, concurrency=32, lease_ms=5000, wait_ms=200,
                                           install_signal_handlers=False))
        await until("every job to run", lambda: len(records) >= n)
        w.stop()
        return placed, again, await asyncio.wait_for(task, 30)

    placed, again, stats = run(go())
    assert len({p.id for p in placed}) == n
    assert all(a.duplicate for a in again) and [a.id for a in again] == [p.id for p in placed[:50]]
    assert not overlaps, f"two runs of one key at once: {overlaps[:5]}"
    check_order_and_completeness(records, keys, per_key)
    assert len(records) == n and {r["id"] for r in records} == {p.id for p in placed}
    assert (stats.acked, stats.lost, stats.failed, stats.unreported) == (n, 0, 0, 0)
    assert serve.totals() == {"ready": 0, "delayed": 0, "in_flight": 0, "dead": 0}
