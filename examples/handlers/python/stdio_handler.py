#!/usr/bin/env python3
"""A `shardq work --stdio` handler in Python.

shardq starts this once per worker slot and writes one JSON job per line
on stdin; we answer one JSON result line per job on stdout, in order, and
exit when stdin closes. Run it with:

    shardq work --data ./q --concurrency 8 --stdio -- python3 examples/handlers/python/stdio_handler.py

Put your work in `handle`. Raise to fail the attempt (it is retried, then
dead-lettered); `job["fence"]` grows for every new run of a key, so writes
can be made conditional on it (see docs/fencing.md).
"""

import base64
import json
import sys


def handle(job: dict) -> None:
    payload = job.get("payload")
    if payload is None:
        payload = base64.b64decode(job["payload_b64"])
    # Real work goes here; `payload` is a str (UTF-8) or bytes.


def main() -> None:
    out = sys.stdout
    for line in sys.stdin:
        job = json.loads(line)
        try:
            handle(job)
            result = {"receipt": job["receipt"], "ok": True}
        except Exception as e:  # the attempt fails; the next job still runs
            result = {"receipt": job["receipt"], "ok": False, "reason": repr(e)[:500]}
        out.write(json.dumps(result))
        out.write("\n")
        out.flush()


if __name__ == "__main__":
    main()
