#!/usr/bin/env python3
"""What keeping job results costs: `shardq work --stdio` draining the same
jobs with a handler that returns a 1 KiB result per job, against one that
returns none, alternated in one run, on the embedded engine and on Redis.

    python3 benchmarks/results.py [--bin PATH] [--jobs 100000] [--keys 1000]
        [--result-bytes 1024] [--repeat 3] [--backends embedded,redis] [--json]

Per backend, per repeat, per mode (`none`, then `result`; the order is
reversed on odd repeats): a fresh deployment of 4 shards (`shardq init`,
with `--redis URL` on one local `redis-server` of its own for Redis),
`enqueue --stdin` of --jobs jobs over --keys keys, then the timed
`work --max-local-shards all --exit-when-idle --concurrency 8 --stdio --
python3 HANDLER`. The handler answers each job `ok`, with `"result"`: a
string of --result-bytes bytes in `result` mode. After each run: the
status totals are zero (every job acked), and the newest finished job of
the first key has a result of the asked size (none in `none` mode). The
deployment's default retention keeps the finished jobs and their results.

Reported: jobs/s per run, the medians per mode and their ratio
(result / none). The time includes the worker's start and its idle check,
as the user's `work --exit-when-idle` does. Every server started is
stopped and the temporary directory removed.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_support import HOST, free_port, log  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HANDLER = r"""
import json, os, sys
size = int(os.environ["RESULT_BYTES"])
result = "r" * size
out = sys.stdout
for line in sys.stdin:
    job = json.loads(line)
    reply = {"receipt": job["receipt"], "ok": True}
    if size:
        reply["result"] = result
    out.write(json.dumps(reply) + "\n")
    out.flush()
"""


def sh(*args: str, stdin: str = "") -> str:
    p = subprocess.run(list(args), input=stdin, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} ... exited {p.returncode}: {p.stderr[-2000:]}")
    return p.stdout


class Redis:
    """One redis-server on a free loopback port, no persistence."""

    def __init__(self, tmp: str) -> None:
        self.port = free_port()
        self.dir = os.path.join(tmp, f"redis-{self.port}")
        os.makedirs(self.dir)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline:
            p = subprocess.run(["redis-cli", "-h", HOST, "-p", str(self.port), "PING"], capture_output=True, text=True)
            if p.stdout.strip() == "PONG":
                return
            time.sleep(0.05)
        raise SystemExit("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def flush(self) -> None:
        sh("redis-cli", "-h", HOST, "-p", str(self.port), "FLUSHALL")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one_run(a: argparse.Namespace, tmp: str, n: int, backend: str, mode: str, redis: "Redis | None",
            handler: str) -> Dict:
    data = os.path.join(tmp, f"d{n}")
    init = [a.bin, "init", "--data", data, "--shards", "4"]
    if backend == "redis":
        assert redis is not None
        redis.flush()
        init += ["--redis", redis.url]
    sh(*init)
    lines = "".join(f"k{i % a.keys}\tp{i}\n" for i in range(a.jobs))
    sh(a.bin, "enqueue", "--data", data, "--stdin", stdin=lines)
    size = a.result_bytes if mode == "result" else 0
    env = dict(os.environ, RESULT_BYTES=str(size))
    t0 = time.perf_counter()
    p = subprocess.run([a.bin, "work", "--data", data, "--max-local-shards", "all", "--exit-when-idle",
                        "--concurrency", "8", "--stdio", "--", sys.executable, handler],
                       capture_output=True, text=True, env=env)
    secs = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"work exited {p.returncode}: {p.stderr[-2000:]}")
    totals = json.loads(sh(a.bin, "status", "--data", data, "--json"))["totals"]
    left = sum(totals.get(k, 0) for k in ("ready", "delayed", "in_flight", "dead"))
    if left:
        raise SystemExit(f"{backend} {mode}: {left} jobs left after the worker: {totals}")
    # The newest finished job of the first key (the retention keeps the
    # newest finished jobs, not necessarily the first one enqueued).
    shown = json.loads(sh(a.bin, "jobs", "--data", data, "--key", "k0", "--finished", "1", "--json"))
    newest = (shown.get("finished") or [{}])[0]
    got = len(newest.get("result") or "")
    if got != size:
        raise SystemExit(f"{backend} {mode}: the newest finished job of k0 has a result of {got} bytes, not {size}: "
                         f"{newest}")
    shutil.rmtree(data, ignore_errors=True)
    rate = a.jobs / secs
    log(f"{backend} {mode}: {a.jobs} jobs in {secs:.2f} s, {rate:,.0f} jobs/s")
    return {"backend": backend, "mode": mode, "seconds": round(secs, 3), "jobs_per_s": round(rate)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.environ.get("SHARDQ_BIN") or os.path.join(ROOT, "target", "release", "shardq"))
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--result-bytes", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--backends", default="embedded,redis")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if not os.path.exists(a.bin):
        raise SystemExit(f"{a.bin}: no such binary (cargo build --release -p shardq)")
    tmp = tempfile.mkdtemp(prefix="results-bench-")
    redis = None
    runs: List[Dict] = []
    try:
        handler = os.path.join(tmp, "handler.py")
        with open(handler, "w") as f:
            f.write(HANDLER)
        n = 0
        for backend in a.backends.split(","):
            if backend == "redis" and redis is None:
                redis = Redis(tmp)
            for rep in range(a.repeat):
                modes = ["none", "result"] if rep % 2 == 0 else ["result", "none"]
                for mode in modes:
                    n += 1
                    runs.append(one_run(a, tmp, n, backend, mode, redis, handler) | {"repeat": rep})
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {}
    for backend in a.backends.split(","):
        med = {m: statistics.median(r["jobs_per_s"] for r in runs if r["backend"] == backend and r["mode"] == m)
               for m in ("none", "result")}
        summary[backend] = {"none_median": round(med["none"]), "result_median": round(med["result"]),
                            "ratio": round(med["result"] / med["none"], 3)}
    if a.json:
        print(json.dumps({"runs": runs, "summary": summary, "jobs": a.jobs, "result_bytes": a.result_bytes}))
        return
    print(f"{a.jobs} jobs over {a.keys} keys, `work --stdio --concurrency 8`, result {a.result_bytes} bytes; "
          f"nproc {os.cpu_count()}\n")
    print("| backend | repeat | none, jobs/s | result, jobs/s |")
    print("| --- | --- | --- | --- |")
    for backend in a.backends.split(","):
        for rep in range(a.repeat):
            r = {x["mode"]: x["jobs_per_s"] for x in runs if x["backend"] == backend and x["repeat"] == rep}
            print(f"| {backend} | {rep + 1} | {r['none']:,} | {r['result']:,} |")
    print()
    for backend, s in summary.items():
        print(f"- {backend}: median {s['result_median']:,} jobs/s with results against {s['none_median']:,} "
              f"without (ratio {s['ratio']})")


if __name__ == "__main__":
    main()
