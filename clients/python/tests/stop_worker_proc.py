"""A worker process for the stop tests of ``test_worker_serve.py``:

    python3 stop_worker_proc.py KIND URL MODE [DRAIN_TIMEOUT_S]

KIND ``thread`` (:class:`shardq.Worker`) or ``aio``
(:class:`shardq.AsyncWorker`), on the main thread so that signals are
handled. MODE ``quick``: each handler prints ``ran KEY`` and returns;
``block``: it prints ``started KEY`` and runs until ``job.lost`` is set
(then prints ``lost KEY``) or, for ``aio``, until it is cancelled (prints
``cancelled KEY``). At the end: ``stats {json}``, or ``error NAME`` when
``run`` raised.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shardq import AsyncWorker, ClaimedJob, ShardqError, Worker  # noqa: E402


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    kind, url, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    drain = float(sys.argv[4]) if len(sys.argv) > 4 else None
    try:
        if kind == "thread":
            def handle(job: ClaimedJob) -> None:
                if mode == "quick":
                    say(f"ran {job.key}")
                    return
                say(f"started {job.key}")
                if job.lost.wait(60):
                    say(f"lost {job.key}")

            stats = Worker([url]).run(handle, concurrency=2, lease_ms=2000, drain_timeout_s=drain)
        else:
            async def ahandle(job: ClaimedJob) -> None:
                if mode == "quick":
                    say(f"ran {job.key}")
                    return
                say(f"started {job.key}")
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    say(f"cancelled {job.key} lost={job.lost.is_set()}")
                    raise

            stats = asyncio.run(AsyncWorker([url]).run(ahandle, concurrency=2, lease_ms=2000, drain_timeout_s=drain))
    except ShardqError as e:
        say(f"error {type(e).__name__}")
        return
    say("stats " + json.dumps(stats.__dict__))


if __name__ == "__main__":
    main()
