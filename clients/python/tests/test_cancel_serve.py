"""A running job cancelled through the API (``DELETE /v1/jobs/{id}``) frees
its key as soon as its handler is gone, with both workers against a real
``shardq serve``: the worker asks the server about once a second which of
its runs are no longer current (``POST /v1/stale``), sets ``job.lost`` on
the cancelled one, and once the handler returned sends a fail, refused
(409) but ending the run. With the default job lease of 30 s the key's
next job starts within about a second of the cancel, never while the
cancelled handler still runs (before: at the lease's lapse, about 30 s
later, since an ack or nothing was sent for the lost run)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Dict

import pytest

from shardq import ClaimedJob, Client

from support import wait_until
from test_worker_serve import KINDS, Running

#: Far longer than every lease and timeout: only the cancel ends it.
LONG_S = 120.0


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancelled_running_jobs_key_starts_its_next_job_once_the_handler_returned(serve, kind):
    client = Client([serve.url])
    long = client.enqueue("tenant-c", "long")
    client.enqueue("tenant-c", "next")
    stamps: Dict[str, float] = {}
    lock = threading.Lock()

    def note(what: str) -> None:
        with lock:
            stamps[what] = time.monotonic()

    def thread_handler(job: ClaimedJob) -> None:
        if job.payload != b"long":
            note("next started")
            return
        note("long started")
        job.lost.wait(LONG_S)
        note("long told")
        time.sleep(0.3)  # cleans up for a moment after it is told to stop
        note("long ended")
        # Returns: the worker still sends the fail that ends the cancelled run.

    async def aio_handler(job: ClaimedJob) -> None:
        if job.payload != b"long":
            note("next started")
            return
        note("long started")
        deadline = time.monotonic() + LONG_S
        while not job.lost.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        note("long told")
        await asyncio.sleep(0.3)
        note("long ended")
        raise RuntimeError("stopped: the run was cancelled")

    r = Running(kind, [serve.url], thread_handler if kind == "thread" else aio_handler,
                concurrency=2, wait_ms=200)
    try:
        wait_until("the long job's start", lambda: "long started" in stamps, timeout_s=15)
        time.sleep(0.2)
        assert client.cancel(long.id)
        cancelled = time.monotonic()
        wait_until("the key's next job", lambda: "next started" in stamps, timeout_s=40)
        took = stamps["next started"] - cancelled
        assert "long ended" in stamps and stamps["long ended"] <= stamps["next started"], \
            f"the next job started while the cancelled handler still ran: {stamps}"
        assert took < 3.0, (f"the key's next job started {took:.1f} s after the cancel (the extend comes every 10 s, "
                            f"the lease lapses after 30 s)")
        print(f"{kind}: cancel to the key's next start {took * 1000:.0f} ms "
              f"(handler told after {(stamps['long told'] - cancelled) * 1000:.0f} ms)")
        finished = client.finished(long.id)
        assert finished is not None and finished.outcome == "cancelled", finished
        wait_until("the next job's ack", lambda: r.w.stats.acked == 1, timeout_s=10)
    finally:
        r.stop()
        r.join()
    assert r.error is None, r.error
    s = r.stats
    assert (s.acked, s.failed, s.lost, s.unreported) == (1, 0, 1, 0), s
