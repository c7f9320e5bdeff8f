"""A worker process for ``test_two_servers_e2e.py``:

    python3 e2e_worker_proc.py KIND URLS RECORDS

KIND ``thread`` (:class:`shardq.Worker`) or ``aio``
(:class:`shardq.AsyncWorker`) on the comma-separated URLS, on the main
thread (SIGTERM drains). The handler appends one JSON line per event to
RECORDS: ``{"ev": "start" | "fail" | "done", "key", "seq", "id",
"attempt", "pid"}``; a job whose payload has ``"flaky": true`` fails its
first attempt (retried 20 ms later). Prints ``stats {json}`` at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shardq import AsyncWorker, ClaimedJob, Retry, Worker  # noqa: E402


def main() -> None:
    kind, urls, records = sys.argv[1], sys.argv[2], sys.argv[3]
    fd = os.open(records, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def record(ev: str, job: ClaimedJob, doc: dict) -> None:
        line = {"ev": ev, "key": job.key, "seq": doc["seq"], "id": job.id, "attempt": job.attempt, "pid": pid}
        # One write per line: O_APPEND keeps lines whole across processes.
        os.write(fd, (json.dumps(line) + "\n").encode())

    def handle(job: ClaimedJob) -> None:
        doc = json.loads(job.payload)
        record("start", job, doc)
        if doc.get("flaky") and job.attempt == 1:
            record("fail", job, doc)
            raise Retry("flaky on its first attempt", retry_in_ms=20)
        record("done", job, doc)

    if kind == "thread":
        stats = Worker(urls).run(handle, concurrency=8, lease_ms=3000, wait_ms=1000)
    else:
        async def ahandle(job: ClaimedJob) -> None:
            handle(job)
            await asyncio.sleep(0)

        stats = asyncio.run(AsyncWorker(urls).run(ahandle, concurrency=16, lease_ms=3000, wait_ms=1000))
    sys.stdout.write("stats " + json.dumps(stats.__dict__) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
