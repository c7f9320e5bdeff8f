"""The realistic program, end to end: two ``shardq serve`` processes over
one data dir (``--max-shards``: each runs half the shards), a producer
sending jobs of 200 tenants through both URLs with dedup ids and re-sends
of every batch, 1% of the jobs failing their first attempt (retried), a
threaded and an asyncio worker process each on both URLs, the threaded one
stopped with SIGTERM half-way and replaced, and SIGTERM for every worker at
the end. Every job completes exactly once, in per-tenant order, and both
servers end empty. (Scaled down from 20,000 jobs to keep it to seconds.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from typing import Any, Dict, List

from shardq import Client, NewJob

from support import WAIT_S, all_done, check_order_and_completeness, read_lines, shardq, stop_process, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
TENANTS, PER_TENANT, BATCH = 200, 25, 250


def worker(kind: str, urls: str, records: str, out: str) -> subprocess.Popen:
    with open(out, "ab") as o:
        return subprocess.Popen([sys.executable, os.path.join(HERE, "e2e_worker_proc.py"), kind, urls, records],
                                stdout=o, stderr=subprocess.STDOUT)


def stats_of(out: str) -> List[Dict[str, int]]:
    return [json.loads(l[len("stats "):]) for l in read_lines(out) if l.startswith("stats ")]


def test_two_servers_one_data_dir_every_job_once_in_tenant_order(make_serve, tmp_path):
    data = str(tmp_path / "q")
    shardq("init", "--data", data, "--shards", "4")
    a = make_serve("a", data=data, owned=2, args=["--max-shards", "2", "--lease-ms", "2000"])
    b = make_serve("b", data=data, owned=2, args=["--max-shards", "2", "--lease-ms", "2000"])
    urls = f"{a.url},{b.url}"
    records = str(tmp_path / "records.jsonl")
    outs = [str(tmp_path / f"w{i}.out") for i in range(3)]
    flaky = {(f"k-{t}", s) for t in range(TENANTS) for s in range(PER_TENANT) if (t * PER_TENANT + s) % 100 == 7}
    jobs = [
        NewJob(f"k-{t}", json.dumps({"seq": s, "flaky": (f"k-{t}", s) in flaky}))
        for s in range(PER_TENANT) for t in range(TENANTS)
    ]
    n = len(jobs)
    procs = [worker("thread", urls, records, outs[0]), worker("aio", urls, records, outs[1])]
    try:
        placed: List[Any] = []
        with Client(urls) as c:
            for i in range(0, n, BATCH):
                batch = jobs[i:i + BATCH]
                got = c.enqueue_many(batch)
                assert not any(g.duplicate for g in got)
                placed.extend(got)
                # The batch again, as a producer unsure of its last send: the
                # same jobs (they kept their dedup ids), stored once.
                again = c.enqueue_many(batch)
                assert all(g.duplicate for g in again) and [g.id for g in again] == [g.id for g in got]
                if i == n // 2 // BATCH * BATCH:
                    # Half-way: the threaded worker drains on SIGTERM; another takes over.
                    pid = f'"pid": {procs[0].pid}'
                    wait_until("the threaded worker to run jobs", lambda: any(pid in l for l in read_lines(records)))
                    assert stop_process(procs[0], "threaded worker", signal.SIGTERM, WAIT_S) == 0
                    procs[0] = worker("thread", urls, records, outs[2])
        assert len({p.id for p in placed}) == n
        assert {p.shard for p in placed} == {f"shard-{i}" for i in range(4)}

        def done() -> int:
            return sum(1 for l in read_lines(records) if '"ev": "done"' in l)

        wait_until("every job to complete", lambda: done() >= n and all_done(a.url) and all_done(b.url),
                   timeout_s=60)
        lines = read_lines(records)
        assert all(any(f'"pid": {p.pid}' in l for l in lines) for p in procs), "a worker ran no job"
        for p in procs:
            assert stop_process(p, "worker", signal.SIGTERM, WAIT_S) == 0
    finally:
        for p in procs:
            stop_process(p, "worker", signal.SIGKILL)

    recs = [json.loads(l) for l in read_lines(records)]
    completed = Counter((r["key"], r["seq"]) for r in recs if r["ev"] == "done")
    assert len(completed) == n and set(completed.values()) == {1}, completed.most_common(3)
    failed = {(r["key"], r["seq"]) for r in recs if r["ev"] == "fail"}
    assert failed <= flaky and len(flaky) == n // 100
    # A flaky job fails its first attempt. One whose first run ended before
    # its handler did (its shard changed owner under a loaded machine) ran
    # first at a later attempt: it never completes at attempt 1.
    first_done = {(r["key"], r["seq"]) for r in recs if r["ev"] == "done" and r["attempt"] == 1}
    assert not (flaky & first_done), sorted(flaky & first_done)[:5]
    assert len(failed) >= len(flaky) * 9 // 10, (len(failed), len(flaky))
    check_order_and_completeness([r for r in recs if r["ev"] == "start"], TENANTS, PER_TENANT)
    assert {r["id"] for r in recs} == {p.id for p in placed}
    stats = [s for o in outs for s in stats_of(o)]
    assert len(stats) == 3 and sum(s["acked"] for s in stats) == n, stats
    assert sum(s["failed"] for s in stats) == len(failed) and sum(s["lost"] + s["abandoned"] for s in stats) == 0, stats
    # Both servers ran jobs: each one's shards were claimed through it.
    assert all(s["claimed"] > 0 for s in stats[:2]), stats
    for s in (a, b):
        assert s.totals() == {"ready": 0, "delayed": 0, "in_flight": 0, "dead": 0}
