#!/usr/bin/env python3
"""Batches, measured on the user's path (`batch open`, `enqueue --stdin
--batch`, `batch close`, `work --stdio`): the time from a batch's last
job's ack to its complete callback's start, and what the batch costs
against the same jobs enqueued without it.

    python3 benchmarks/batches.py [--bin PATH] [--jobs 10000] [--keys 1000]
        [--repeat 3] [--backends embedded,redis] [--json]

Per backend (a fresh deployment of 4 shards each run; one local
`redis-server` of its own for Redis), alternated per repeat:

- batch: a batch with a complete callback on key `cb`; --jobs jobs over
  --keys keys added with one `enqueue --stdin --batch` (10,000 is the
  bound of jobs per batch), then `batch close`; the retention set to keep
  every job's finished record (docs/workflows.md). One `work --stdio
  --concurrency 8 --max-local-shards all --exit-when-idle` runs them and
  the callback; its handler logs when each job arrived and when it
  answered. Measured: the worker's wall time, and the time from the last
  job's answer to the callback's arrival.
- plain: the same jobs with `enqueue --stdin`, the same worker.

Every run checks that each job arrives once, the callback once, after
every job answered. Every server started is stopped and the directory
removed.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_support import log  # noqa: E402
from results import Redis, sh  # noqa: E402
from workflows import HANDLER, deployment, pct, read_log, work  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(a: argparse.Namespace, tmp: str, n: int, redis: "Redis | None", handler: str, batched: bool) -> Dict:
    data = deployment(a, tmp, f"b{n}", redis)
    sh(a.bin, "retention", "set", "--data", data, "--finished-jobs", str(max(1000, a.jobs)))
    lines = "".join(f"k{i % a.keys}\tj{i}\n" for i in range(a.jobs))
    if batched:
        bid = sh(a.bin, "batch", "open", "--data", data, "--key", "cb", "--on-complete", "callback").strip()
        sh(a.bin, "enqueue", "--data", data, "--stdin", "--batch", bid, stdin=lines)
        sh(a.bin, "batch", "close", "--data", data, bid)
    else:
        sh(a.bin, "enqueue", "--data", data, "--stdin", stdin=lines)
    job_log = os.path.join(tmp, f"b{n}.log")
    secs = work(a, data, handler, job_log)
    seen = read_log(job_log)
    missing = [i for i in range(a.jobs) if f"j{i}" not in seen]
    if missing:
        raise SystemExit(f"{len(missing)} jobs never arrived")
    out: Dict = {"mode": "batch" if batched else "plain", "seconds": round(secs, 3)}
    if batched:
        if "callback" not in seen:
            raise SystemExit(f"the callback never ran: {sh(a.bin, 'batch', 'show', '--data', data, bid)[:2000]}")
        last = max(seen[f"j{i}"][1] for i in range(a.jobs))
        got = seen["callback"][0]
        if got <= last:
            raise SystemExit("the callback arrived before the last job answered")
        out["last_job_to_callback_ms"] = round((got - last) / 1e6, 2)
    shutil.rmtree(data, ignore_errors=True)
    log(f"{out['mode']}: {secs:.2f} s" + (f", last job -> callback {out['last_job_to_callback_ms']} ms" if batched else ""))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.environ.get("SHARDQ_BIN") or os.path.join(ROOT, "target", "release", "shardq"))
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--backends", default="embedded,redis")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if not os.path.exists(a.bin):
        raise SystemExit(f"{a.bin}: no such binary (cargo build --release -p shardq)")
    tmp = tempfile.mkdtemp(prefix="batches-bench-")
    redis = None
    result: Dict[str, Dict] = {}
    try:
        handler = os.path.join(tmp, "handler.py")
        with open(handler, "w") as f:
            f.write(HANDLER)
        n = 0
        for backend in a.backends.split(","):
            if backend == "redis" and redis is None:
                redis = Redis(tmp)
            r = redis if backend == "redis" else None
            runs: List[Dict] = []
            for rep in range(a.repeat):
                for batched in ([True, False] if rep % 2 == 0 else [False, True]):
                    n += 1
                    runs.append(one(a, tmp, n, r, handler, batched) | {"repeat": rep})
            med = {m: statistics.median(x["seconds"] for x in runs if x["mode"] == m) for m in ("batch", "plain")}
            lat = [x["last_job_to_callback_ms"] for x in runs if x["mode"] == "batch"]
            result[backend] = {
                "runs": runs,
                "last_job_to_callback_ms": lat,
                "batch_seconds_median": med["batch"],
                "plain_seconds_median": med["plain"],
                "ratio": round(med["plain"] / med["batch"], 3),
            }
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(result))
        return
    print(f"{a.jobs} jobs over {a.keys} keys in one batch with a complete callback, against the same jobs "
          f"without it; 4 shards, `work --stdio --concurrency 8`; nproc {os.cpu_count()}\n")
    print("| backend | last job -> callback (each run) | batch / plain (median s; throughput ratio) |")
    print("| --- | --- | --- |")
    for b, s in result.items():
        lat = s["last_job_to_callback_ms"]
        print(f"| {b} | {', '.join(f'{x} ms' for x in lat)} (p50 {pct(lat, 50)}) | "
              f"{s['batch_seconds_median']} / {s['plain_seconds_median']} (x{s['ratio']}) |")


if __name__ == "__main__":
    main()
