"""A worker process for ``test_serve_e2e.py``: runs :class:`shardq.Worker`
on the main thread (so SIGTERM drains) against one ``shardq serve`` URL and
appends one JSON line per handler start to a records file:
``{"key", "seq", "id", "attempt", "pid"}``.

    python3 serve_worker_proc.py URL RECORDS LEASE_MS CONCURRENCY [HANG_KEY HANG_SEQ]

With HANG_KEY/HANG_SEQ, the first attempt of that job records itself and
then blocks (for at most 120 s) instead of returning, so that the test can
kill this process in the middle of it.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shardq import Worker  # noqa: E402


def main() -> None:
    url, records, lease_ms, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    hang = (sys.argv[5], int(sys.argv[6])) if len(sys.argv) > 6 else None
    fd = os.open(records, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def handle(job):
        doc = json.loads(job.payload)
        line = {"key": job.key, "seq": doc["seq"], "id": job.id, "attempt": job.attempt, "pid": pid}
        # One write per line: O_APPEND keeps lines whole across processes.
        os.write(fd, (json.dumps(line) + "\n").encode())
        if hang is not None and (job.key, doc["seq"]) == hang and job.attempt == 1:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(0.001)

    stats = Worker([url], worker_id=f"e2e-{pid}").run(handle, concurrency=concurrency, lease_ms=lease_ms, wait_ms=500)
    sys.stdout.write(json.dumps(stats.__dict__) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
