#!/usr/bin/env python3
"""Debounced enqueues on the user's path: a burst of enqueues per key runs
once, with its last payload, and what debouncing costs an enqueue. Every
step is the `shardq` command line on embedded data dirs (see docs/jobs.md).

    python3 benchmarks/debounce.py [--bin PATH] [--keys K] [--enqueues N]
                                   [--bursts B] [--debounce-ms D]
                                   [--repeat R] [--out FILE] [--json]

A run sends N enqueues (100,000) over K keys (1,000) in B bursts per key
(5): burst b sends N / (K x B) lines per key, every key's lines
interleaved, payload `b-i` (i counts per key), through one `shardq enqueue
--stdin` call. With debounce the call has `--debounce-id burst --debounce
D` (D = 1 s); without (the baseline), it is the same call without them.
Between bursts a `shardq work --max-local-shards all --concurrency 8
--handler-builtin append:FILE` runs until the burst's jobs ran (the next
burst must find no waiting job, else it would join the previous burst).
Checked from the handler's file: with debounce, jobs run = K x B, each
key's runs are its bursts' last payloads, in order, once each; without,
every enqueue runs once.

Timed: each burst's `enqueue --stdin` call (wall clock), so enqueues per
second = lines / seconds, per mode. The two modes alternate, --repeat
times (3), on fresh data dirs, so both see the same machine state; the
ratio debounce / plain is per repeat and its median.

Loopback only; a temporary directory, removed at the end. A markdown
report goes to stdout (and --out); --json prints the raw figures.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_support import log  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def binary(given: str) -> str:
    if given:
        return given
    path = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "shardq")
    subprocess.run(["cargo", "build", "--release", "-p", "shardq"], cwd=ROOT, check=True)
    return path


def sh(*args: str, stdin: bytes = b"") -> bytes:
    out = subprocess.run(list(args), input=stdin, capture_output=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {out.returncode}: {out.stderr.decode()[-2000:]}")
    return out.stdout


def run_mode(exe: str, tmp: str, a: argparse.Namespace, debounce: bool) -> Dict[str, object]:
    """One run of one mode on a fresh data dir: per-burst enqueue times,
    the jobs that ran, and whether they are the expected ones."""
    data = os.path.join(tmp, "debounce" if debounce else "plain")
    sh(exe, "init", "--data", data, "--shards", "4")
    per_key = a.enqueues // (a.keys * a.bursts)
    ran_file = os.path.join(tmp, ("debounce" if debounce else "plain") + ".ran")
    flags = ["--debounce-id", "burst", "--debounce", f"{a.debounce_ms}ms"] if debounce else []
    times: List[float] = []
    lines_sent = 0
    expected: Dict[str, List[str]] = {}
    for b in range(a.bursts):
        lines = []
        for i in range(per_key):
            for k in range(a.keys):
                lines.append(f"t-{k}\t{b}-{i}\n")
        body = "".join(lines).encode()
        t0 = time.monotonic()
        out = sh(exe, "enqueue", "--data", data, "--stdin", *flags, stdin=body)
        times.append(time.monotonic() - t0)
        lines_sent += len(lines)
        assert len(out.splitlines()) == len(lines), "every line answered"
        for k in range(a.keys):
            want = [f"{b}-{per_key - 1}"] if debounce else [f"{b}-{i}" for i in range(per_key)]
            expected.setdefault(f"t-{k}", []).extend(want)
        # The burst's jobs run (due debounce_ms after its last enqueue).
        sh(exe, "work", "--data", data, "--max-local-shards", "all", "--concurrency", "8",
           "--exit-when-idle", "--handler-builtin", f"append:{ran_file}")
    runs: Dict[str, List[str]] = {}
    with open(ran_file) as f:
        for line in f:
            key, _job, _attempt, _shard, payload = line.rstrip("\n").split(" ", 4)
            runs.setdefault(key, []).append(payload)
    ran = sum(len(v) for v in runs.values())
    exact = all(runs.get(k) == v for k, v in expected.items())
    seconds = sum(times)
    return {"mode": "debounce" if debounce else "plain", "enqueues": lines_sent, "enqueue_s": round(seconds, 3),
            "enqueues_per_s": round(lines_sent / seconds), "bursts": a.keys * a.bursts, "jobs_ran": ran,
            "runs_as_expected": exact}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.environ.get("SHARDQ_BIN", ""))
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--enqueues", type=int, default=100_000)
    p.add_argument("--bursts", type=int, default=5)
    p.add_argument("--debounce-ms", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.enqueues % (a.keys * a.bursts):
        raise SystemExit("--enqueues must be a multiple of --keys x --bursts")
    exe = binary(a.bin)
    rows = []
    for rep in range(a.repeat):
        for debounce in ((False, True) if rep % 2 == 0 else (True, False)):
            with tempfile.TemporaryDirectory(prefix="shardq-bench-debounce-") as tmp:
                row = run_mode(exe, tmp, a, debounce)
                row["repeat"] = rep
                rows.append(row)
                log(f"rep {rep} {row['mode']}: {row['enqueues_per_s']} enqueues/s, "
                    f"{row['jobs_ran']} jobs ran for {row['bursts']} bursts, as expected: {row['runs_as_expected']}")
    ratios = []
    for rep in range(a.repeat):
        by = {r["mode"]: r for r in rows if r["repeat"] == rep}
        ratios.append(by["debounce"]["enqueues_per_s"] / by["plain"]["enqueues_per_s"])
    if a.json:
        print(json.dumps({"rows": rows, "ratios": ratios}))
        return
    out = ["| repeat | mode | enqueues | enqueue s | enqueues/s | bursts | jobs ran | runs as expected |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['repeat']} | {r['mode']} | {r['enqueues']:,} | {r['enqueue_s']} | "
                   f"{r['enqueues_per_s']:,} | {r['bursts']:,} | {r['jobs_ran']:,} | {r['runs_as_expected']} |")
    out.append("")
    out.append(f"debounce / plain enqueues per second, per repeat: {', '.join(f'{x:.2f}' for x in ratios)}; "
               f"median {statistics.median(ratios):.2f}")
    text = "\n".join(out)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
