"""Client and Worker against the real ``shardq serve`` (the debug binary,
built with ``cargo build -p shardq`` when missing or stale; a failed build
fails the tests). Each test makes its own data dir (``shardq init --shards
4``), starts the server on a free loopback port and stops it.

Invariants checked: per-key order (a key's jobs start in enqueue order,
a re-run only repeats the job that was running), nothing lost (every
enqueued job runs and the status totals end at zero), no duplicate stored
(one job id per enqueued job, even when a request was retried), one run
per key at a time, each job acked once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Tuple

from shardq import AsyncClient, ClaimedJob, Client, Moved, NewJob, Worker

from support import WAIT_S, check_order_and_completeness, jobs_for, read_lines, shardq, stop_process, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))


class Recorder:
    """An in-process handler: records ``(key, seq, id, attempt)`` per start
    and fails the test's invariant if two runs of one key overlap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: List[Dict[str, Any]] = []
        self.running_keys: set = set()
        self.overlaps: List[str] = []

    def __call__(self, job: ClaimedJob) -> None:
        seq = json.loads(job.payload)["seq"]
        with self.lock:
            if job.key in self.running_keys:
                self.overlaps.append(f"{job.key} seq {seq}")
            self.running_keys.add(job.key)
            self.records.append({"key": job.key, "seq": seq, "id": job.id, "attempt": job.attempt})
        time.sleep(0.0005)
        with self.lock:
            self.running_keys.discard(job.key)

    def count(self) -> int:
        with self.lock:
            return len(self.records)


def run_worker_until(url: str, rec: Recorder, done, concurrency: int = 8) -> Worker:
    w = Worker([url], worker_id="e2e-in-process")
    t = threading.Thread(target=w.run, args=(rec,),
                         kwargs=dict(concurrency=concurrency, lease_ms=5000, wait_ms=200, install_signal_handlers=False),
                         daemon=True)
    t.start()
    try:
        wait_until("the worker to finish the jobs", lambda: done(w), timeout_s=WAIT_S)
    finally:
        w.stop()
        t.join(WAIT_S)
    assert not t.is_alive(), "Worker.run did not return after stop()"
    return w


def test_round_trip_per_key_order_each_job_acked_once(serve):
    keys, per_key = 40, 25
    n = keys * per_key
    c = Client([serve.url])
    jobs = jobs_for("rt", keys, per_key)
    placed = c.enqueue_many(jobs)
    assert len(placed) == n and not any(p.duplicate for p in placed)
    assert all(p.id.startswith(p.shard + ":") for p in placed), placed[:3]
    assert len({p.id for p in placed}) == n
    # The same dedup ids again: nothing new is stored, the original ids come back.
    again = c.enqueue_many(jobs[:100])
    assert all(a.duplicate for a in again) and [a.id for a in again] == [p.id for p in placed[:100]]
    assert serve.totals() == {"ready": n, "delayed": 0, "in_flight": 0, "dead": 0}

    rec = Recorder()
    w = run_worker_until(serve.url, rec, lambda w: w.stats.acked >= n)
    assert not rec.overlaps, f"two runs of one key at once: {rec.overlaps[:5]}"
    check_order_and_completeness(rec.records, keys, per_key)
    # Each job ran and was acked exactly once.
    assert len(rec.records) == n and {r["id"] for r in rec.records} == {p.id for p in placed}
    assert all(r["attempt"] == 1 for r in rec.records)
    assert (w.stats.acked, w.stats.lost, w.stats.failed, w.stats.unreported) == (n, 0, 0, 0)
    assert serve.totals() == {"ready": 0, "delayed": 0, "in_flight": 0, "dead": 0}


def test_a_killed_worker_job_runs_again_after_its_lease(serve, tmp_path):
    keys, per_key = 8, 30
    n = keys * per_key
    hang = ("k-2", 5)
    placed = Client([serve.url]).enqueue_many(jobs_for("kill", keys, per_key))
    assert len({p.id for p in placed}) == n
    records = str(tmp_path / "records.jsonl")
    lease_ms = 600

    def start_worker(*extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, os.path.join(HERE, "serve_worker_proc.py"), serve.url, records, str(lease_ms), "8", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def recs() -> List[Dict[str, Any]]:
        return [json.loads(l) for l in read_lines(records)]

    first = start_worker(hang[0], str(hang[1]))
    try:
        wait_until("the first worker to start the hanging job",
                   lambda: any((r["key"], r["seq"]) == hang for r in recs()), timeout_s=WAIT_S)
        first.send_signal(signal.SIGKILL)
        first.wait(WAIT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    killed_at = len(recs())
    first_pid = first.pid

    second = start_worker()
    try:
        def finished() -> bool:
            seen = {(r["key"], r["seq"]) for r in recs()}
            if len(seen) < n:
                return False
            t = serve.totals()
            return t["ready"] + t["delayed"] + t["in_flight"] == 0
        wait_until("the second worker to run every job", finished, timeout_s=WAIT_S)
        assert stop_process(second, "the second worker", signal.SIGTERM, WAIT_S) == 0, second.stderr.read()
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    stats = json.loads(second.stdout.read().strip().splitlines()[-1])

    all_recs = recs()
    runs = [r for r in all_recs if (r["key"], r["seq"]) == hang]
    assert runs[0]["pid"] == first_pid and runs[0]["attempt"] == 1, runs
    again = [r for r in runs[1:] if r["pid"] == second.pid]
    assert again and again[0]["attempt"] >= 2, f"the killed job did not run again in the new worker: {runs}"
    # While the first worker hung on k-2 seq 5, none of k-2's later jobs ran.
    assert not [r for r in all_recs[:killed_at] if r["key"] == hang[0] and r["seq"] > hang[1]]
    check_order_and_completeness(all_recs, keys, per_key)
    assert {r["id"] for r in all_recs} == {p.id for p in placed}
    # The second worker acked every job the first had not (re-runs included).
    assert stats["lost"] == 0 and stats["failed"] == 0 and stats["acked"] >= n - killed_at + 1
    assert serve.totals() == {"ready": 0, "delayed": 0, "in_flight": 0, "dead": 0}


class Producer:
    """Enqueues ``jobs`` in batches from a thread, pausing between them;
    ``placed`` grows as replies arrive, ``errors`` holds what ended it."""

    def __init__(self, c: Client, jobs: List[Any], batch: int, pause_s: float) -> None:
        self.placed: List[Any] = []
        self.errors: List[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(c, jobs, batch, pause_s), daemon=True)
        self.thread.start()

    def _run(self, c: Client, jobs: List[Any], batch: int, pause_s: float) -> None:
        try:
            for i in range(0, len(jobs), batch):
                self.placed.extend(c.enqueue_many(jobs[i:i + batch]))
                time.sleep(pause_s)
        except BaseException as e:  # reported by the test's thread
            self.errors.append(e)

    def wait_for_progress(self, jobs: int) -> None:
        before = len(self.placed)
        wait_until("the producer to make progress",
                   lambda: len(self.placed) >= before + jobs or not self.thread.is_alive(), timeout_s=WAIT_S)

    def join(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the producer did not finish"
        assert not self.errors, self.errors


def test_server_restart_under_load_loses_nothing_and_stores_no_duplicate(serve):
    keys, per_key, batch = 50, 60, 25
    n = keys * per_key
    jobs = jobs_for("restart", keys, per_key)
    # Enough retry rounds (backoff capped at 2 s) to outlast a restart.
    c = Client([serve.url], retry_rounds=40)
    producer = Producer(c, jobs, batch, 0.002)
    placed = producer.placed
    restarts: List[Tuple[int, int]] = []
    for _ in range(2):
        producer.wait_for_progress(n // 5)
        at_stop = len(placed)
        assert serve.stop(signal.SIGTERM) == 0, serve.log()
        serve.start()
        restarts.append((at_stop, len(placed)))
    producer.join()
    # The restarts happened with the producer mid-way.
    assert all(0 < at < n for at, _ in restarts), restarts
    assert serve.starts == 3

    # Nothing lost, nothing stored twice: exactly n jobs, one id each.
    assert len(placed) == n
    assert len({p.id for p in placed}) == n, "a retried request stored a job twice"
    assert serve.totals() == {"ready": n, "delayed": 0, "in_flight": 0, "dead": 0}

    rec = Recorder()
    w = run_worker_until(serve.url, rec, lambda w: w.stats.acked >= n)
    assert not rec.overlaps, rec.overlaps[:5]
    check_order_and_completeness(rec.records, keys, per_key)
    assert len(rec.records) == n and {r["id"] for r in rec.records} == {p.id for p in placed}
    assert (w.stats.acked, w.stats.lost) == (n, 0)
    assert serve.totals() == {"ready": 0, "delayed": 0, "in_flight": 0, "dead": 0}


def test_a_sigkilled_server_remembers_every_dedup_id_it_acknowledged(serve):
    # SIGKILL twice while a producer sends batches with dedup ids. A batch
    # whose reply arrived was committed to the dedup file before the reply:
    # after the restarts (each server keys its in-memory hashes afresh) the
    # whole list sent again is answered as duplicates with the same ids.
    # Only a request in flight at a kill may store a copy (its jobs were
    # stored, its dedup records not): at-least-once, bounded by one batch.
    keys, per_key, batch = 40, 300, 20
    n = keys * per_key
    jobs = jobs_for("kill9", keys, per_key)
    # Short shard leases: a killed server's shards are taken after them.
    assert serve.stop(signal.SIGTERM) == 0, serve.log()
    serve.args = ["--lease-ms", "2000"]
    serve.start()
    c = Client([serve.url], retry_rounds=40)
    producer = Producer(c, jobs, batch, 0.005)
    placed = producer.placed
    kills = 0
    for _ in range(2):
        # A restart takes a lease (2 s), while the producer goes on through
        # the new process: kill again soon after.
        producer.wait_for_progress(n // 8)
        if not producer.thread.is_alive():
            break
        serve.stop(signal.SIGKILL)
        kills += 1
        serve.start()
    producer.join()
    assert kills == 2, "the producer finished before both kills"
    assert len(placed) == n and len({p.id for p in placed}) == n
    assert not any(p.duplicate for p in placed[:batch]), "the first batch was new"

    again = c.enqueue_many(jobs)
    assert all(g.duplicate for g in again), [g for g in again if not g.duplicate][:5]
    assert [g.id for g in again] == [p.id for p in placed]
    stored = serve.totals()["ready"]
    assert n <= stored <= n + kills * batch, (stored, n)


def test_an_id_from_before_a_move_finds_its_copy(serve):
    """A key's jobs moved to another shard by a rebalance: their old ids
    find the copies (``job``), and ``moved`` names the key and the shard it
    is on now, where ``key_jobs`` lists the jobs (sync and async clients
    alike); a live job's id and an unknown one answer ``None``."""
    import asyncio

    with Client([serve.url]) as c:
        ids = [c.enqueue("mv-k", f"p{i}".encode()).id for i in range(3)]
        old = ids[0].split(":")[0]
        new = next(f"shard-{i}" for i in range(4) if f"shard-{i}" != old)
        assert c.moved(ids[0]) is None, "a live job did not move"
        shardq("pin", "--data", serve.data, "mv-k", new)
        shardq("rebalance", "--data", serve.data)
        copy = c.job(ids[1])
        assert copy is not None and (copy.shard, copy.payload) == (new, b"p1"), copy
        assert copy.id != ids[1], "the copy has its own id"
        assert c.moved(ids[1]) == Moved(key="mv-k", shard=new)
        assert [j.payload for j in c.key_jobs("mv-k")] == [b"p0", b"p1", b"p2"]
        assert all(j.shard == new for j in c.key_jobs("mv-k"))
        assert c.moved(f"{old}:999999999") is None, "an id never handed out"

    async def via_async() -> Any:
        async with AsyncClient([serve.url]) as ac:
            return await ac.moved(ids[2])

    assert asyncio.run(via_async()) == Moved(key="mv-k", shard=new)


def test_an_operator_reads_lists_and_cancels_jobs_by_id(serve):
    """A job read by the id enqueue gave, the key's jobs in order, a cancel
    that the worker honours (the cancelled job never runs), and a running
    job's cancel that ends its run."""

    with Client([serve.url]) as c:
        ids = [c.enqueue("op-k", f"p{i}".encode()).id for i in range(3)]
        j = c.job(ids[1])
        assert j is not None and (j.state, j.payload, j.attempts, j.key) == ("queued", b"p1", 0, "op-k")
        assert [x.id for x in c.key_jobs("op-k")] == ids
        assert len(c.key_jobs("op-k", limit=2)) == 2
        assert c.cancel(ids[1]) is True
        assert c.cancel(ids[1]) is False, "a second cancel finds nothing"
        assert c.job(ids[1]) is None
        done = c.finished(ids[1])
        assert done is not None and done.outcome == "cancelled", done
        assert c.finished(ids[0]) is None, "a live job is not finished"

        gate = threading.Event()
        started = threading.Event()
        ran: List[bytes] = []

        def handler(job: ClaimedJob) -> None:
            ran.append(job.payload)
            started.set()
            gate.wait(WAIT_S)

        w = Worker([serve.url], worker_id="op-worker")
        t = threading.Thread(target=w.run, args=(handler,),
                             kwargs=dict(concurrency=1, lease_ms=1500, wait_ms=200,
                                         install_signal_handlers=False), daemon=True)
        t.start()
        assert started.wait(WAIT_S)
        running = c.job(ids[0])
        assert running is not None and running.state == "running" and running.run is not None
        # The run in flight is its first attempt, started after the job was made.
        assert len(running.attempt_starts_ms) == 1 and running.attempt_starts_ms[0] >= running.created_ms, running
        assert c.job(ids[2]).attempt_starts_ms == ()
        # A running job's run is asked to stop: the worker's extend is
        # refused, the job goes when its lease lapses, and the key's last
        # job runs after it, never beside it.
        assert c.cancel(ids[0]) is True
        wait_until("the worker to learn its run is over", lambda: w.stats.lost >= 1)
        gate.set()
        wait_until("the last job ran", lambda: len(ran) == 2)
        w.stop()
        t.join(WAIT_S)
        assert ran == [b"p0", b"p2"], ran
        assert c.job(ids[0]) is None
        # What became of each job stays readable: newest first, the
        # cancelled ones and the one that ran.
        finished = c.key_finished("op-k")
        assert [(f.id, f.outcome) for f in finished] == [
            (ids[2], "completed"), (ids[0], "cancelled"), (ids[1], "cancelled")
        ], finished
        assert finished[0].attempts == 1 and len(finished[0].attempt_starts_ms) == 1, finished[0]
        assert len(c.key_finished("op-k", limit=1)) == 1


def test_the_async_client_reads_and_cancels_jobs_too(serve):
    import asyncio

    from shardq.aio import AsyncClient

    async def go() -> None:
        async with AsyncClient([serve.url]) as c:
            placed = await c.enqueue_many([NewJob("aio-k", b"a"), NewJob("aio-k", b"b")])
            j = await c.job(placed[1].id)
            assert j is not None and (j.state, j.payload) == ("queued", b"b")
            assert [x.id for x in await c.key_jobs("aio-k")] == [p.id for p in placed]
            assert await c.cancel(placed[1].id) is True
            assert [(f.id, f.outcome) for f in await c.key_finished("aio-k")] == [(placed[1].id, "cancelled")]
            assert await c.cancel(placed[1].id) is False
            assert await c.job(placed[1].id) is None
            assert await c.job("shard-0:999999999") is None

    asyncio.run(go())


def test_a_handlers_return_value_is_its_jobs_result(serve):
    """What a handler returns is kept with its finished job: text as text,
    bytes as bytes, other values as JSON; ``result`` waits for it (woken
    by the ack), a dead letter raises JobDied, and a job still queued at
    the end of the wait raises ResultTimeout."""
    from shardq import JobDied, ResultTimeout

    with Client([serve.url]) as c:
        placed = c.enqueue_many([NewJob("res-t", b"a"), NewJob("res-b", b"b"), NewJob("res-j", b"c"),
                                 NewJob("res-n", b"d"), NewJob("res-x", b"e", max_attempts=1),
                                 NewJob("res-big", b"f", max_attempts=1)])
        ids = [p.id for p in placed]
        # Not run yet: the wait ends without it.
        try:
            c.result(ids[0], timeout=0.3)
            raise AssertionError("a queued job has no result")
        except ResultTimeout as e:
            assert e.state == "queued", e

        def handler(job: ClaimedJob) -> Any:
            if job.key == "res-t":
                return "text:" + job.payload.decode()
            if job.key == "res-b":
                return b"\xff\x00" + job.payload
            if job.key == "res-j":
                return {"n": 3, "ok": True}
            if job.key == "res-x":
                raise RuntimeError("broken on purpose")
            if job.key == "res-big":
                return "z" * 70_000
            return None

        got: Dict[str, Any] = {}
        reader = threading.Thread(target=lambda: got.update(r=c.result(ids[0], timeout=WAIT_S)), daemon=True)
        reader.start()
        w = Worker([serve.url], worker_id="res-worker")
        t = threading.Thread(target=w.run, args=(handler,),
                             kwargs=dict(concurrency=2, lease_ms=5000, wait_ms=200,
                                         install_signal_handlers=False), daemon=True)
        t.start()
        reader.join(WAIT_S)
        assert got["r"].outcome == "completed" and got["r"].result_text == "text:a", got
        assert c.result(ids[1]).result == b"\xff\x00b"
        assert json.loads(c.result(ids[2]).result_text or "") == {"n": 3, "ok": True}
        none = c.result(ids[3])
        assert none.outcome == "completed" and none.result is None, none
        try:
            c.result(ids[4], timeout=WAIT_S)
            raise AssertionError("a dead letter has no result")
        except JobDied as e:
            assert "broken on purpose" in (e.reason or ""), e
        try:
            c.result(ids[5], timeout=WAIT_S)
            raise AssertionError("an oversized result fails its attempt")
        except JobDied as e:
            assert "over the 65536-byte bound" in (e.reason or ""), e
        w.stop()
        t.join(WAIT_S)


def test_an_async_handlers_return_value_is_its_jobs_result(serve):
    import asyncio

    from shardq.aio import AsyncClient, AsyncWorker

    async def go() -> None:
        async with AsyncClient([serve.url]) as c:
            placed = await c.enqueue_many([NewJob("ares", b"q")])

            async def handler(job: ClaimedJob) -> str:
                return "async:" + job.payload.decode()

            w = AsyncWorker([serve.url], worker_id="ares-worker")
            task = asyncio.ensure_future(w.run(handler, concurrency=1, lease_ms=5000, wait_ms=200,
                                               install_signal_handlers=False))
            r = await c.result(placed[0].id, timeout=WAIT_S)
            assert (r.outcome, r.result_text) == ("completed", "async:q"), r
            w.stop()
            await asyncio.wait_for(task, WAIT_S)

    asyncio.run(go())
