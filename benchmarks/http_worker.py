"""A benchmark worker process: :class:`shardq.Worker` (threads) or
:class:`shardq.aio.AsyncWorker` (KIND ``aio``: tasks on one event loop)
against one or more ``shardq serve`` URLs, a handler that records ``(key,
seq, start)`` and checks per-key order as it goes (a key's seq never goes
back within this process). On SIGTERM it drains, then writes its records
to OUT:

    python3 http_worker.py URLS OUT CONCURRENCY [thread|aio]

Payloads are JSON ``{"seq": N, "t": CREATED_NS}`` (``t`` from
``time.time_ns()`` at enqueue); each record is ``KEY SEQ START_MONO_NS
LATENCY_NS`` (latency = handler start - created, wall clock; producer and
worker share the machine's clock). The payload is parsed with orjson when
it is installed, as the client parses its replies (the standard library's
``json.loads`` cost the handler more than the rest of its work).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))

from shardq import Worker  # noqa: E402

# The JSON codec the client itself uses when installed (the "fast" extra);
# SHARDQ_BENCH_PAYLOAD_JSON=std measures with the standard library's.
try:
    from orjson import loads as parse_payload
except ImportError:  # pragma: no cover - depends on the environment
    parse_payload = json.loads
if os.environ.get("SHARDQ_BENCH_PAYLOAD_JSON") == "std":
    parse_payload = json.loads


def main() -> None:
    urls, out, concurrency = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
    kind = sys.argv[4] if len(sys.argv) > 4 else "thread"
    lock = threading.Lock()
    records = []
    last = {}
    disorder = []

    def handle(job):
        now_wall = time.time_ns()
        now = time.monotonic_ns()
        doc = parse_payload(job.payload)
        seq = doc["seq"]
        with lock:
            prev = last.get(job.key, -1)
            # A re-run repeats seq; anything lower is out of order.
            if seq < prev:
                disorder.append((job.key, prev, seq))
            last[job.key] = seq
            records.append((job.key, seq, now, now_wall - doc.get("t", now_wall)))

    worker_id = f"bench-{kind}-{os.getpid()}"
    if kind == "aio":
        import asyncio

        from shardq.aio import AsyncWorker

        async def ahandle(job):
            handle(job)

        stats = asyncio.run(AsyncWorker(urls, worker_id=worker_id).run(
            ahandle, concurrency=concurrency, lease_ms=30_000, wait_ms=1000))
    else:
        prefetch = os.environ.get("SHARDQ_BENCH_PREFETCH")  # bench.py --prefetch
        stats = Worker(urls, worker_id=worker_id).run(handle, concurrency=concurrency, lease_ms=30_000, wait_ms=1000,
                                                      prefetch=int(prefetch) if prefetch is not None else None)
    with open(out, "w") as f:
        json.dump({"stats": stats.__dict__, "disorder": disorder[:20], "disorder_count": len(disorder)}, f)
        f.write("\n")
        for r in records:
            f.write(f"{r[0]} {r[1]} {r[2]} {r[3]}\n")


if __name__ == "__main__":
    main()
