#!/usr/bin/env python3
"""Dependents, measured on the user's path (`enqueue --after`, `work
--stdio`): the latency of a chain's links across shards, the time from a
fan-in's last child to the fan-in's start, and what the fan-in costs
against the same children without it.

    python3 benchmarks/workflows.py [--bin PATH] [--links 1000]
        [--children 1000] [--fan-ins 10] [--keys 100] [--repeat 3]
        [--backends embedded,redis] [--json]
    python3 benchmarks/workflows.py --tree-children 100000 --tree-width 1000
        --keys 1000 [--repeat 3] [--backends embedded,redis]

Per backend (a fresh deployment of 4 shards each run; `--redis URL` on one
local `redis-server` of its own for Redis):

- chain: a root job on key `chain-0`, then --links dependents, link i on
  key `chain-i` after link i-1 (`enqueue --after`): the keys spread over
  the shards, so most links cross shards. One `work --stdio
  --concurrency 8 --max-local-shards all --exit-when-idle`; its handler
  logs when each job arrived and when it answered. A link's latency is
  from the answer (the ack) of the link before it to its own arrival:
  release by the resolver, the claim, the stdio hand-off. p50 and p99
  over the links of every repeat.
- fan-in (the retention set to keep every child's finished job, as
  docs/workflows.md asks of a fan-in this fast): --fan-ins groups of --children jobs over --keys keys, and one
  dependent after each group (1,000 is the bound of dependencies per
  job), against the same children alone, alternated per repeat: the
  worker's wall time for each (its start and idle check included), and
  for each fan-in the time from its last child's answer to its arrival
  (p50 and p99 over every fan-in of every repeat).

- tree (`--tree-children N --tree-width W`, in place of the chain and
  the fan-ins): a fan-in of more children than one dependent may wait
  for, built as a user would: N children over --keys keys (`enqueue
  --stdin`), N / W intermediate dependents each after W children (key
  `mid-J`, `enqueue --after`), and one fan-in after the intermediates,
  against the same N children alone, alternated per repeat, the
  retention raised as for the fan-ins. Per fan-in run: the time from the
  last child's answer to the fan-in's arrival, split into the last
  child -> its intermediate's arrival and the last intermediate's answer
  -> the fan-in's arrival; the time the dependents' enqueues took; the
  worker's wall time against the children alone.

Every run checks the invariants it relies on: each job arrives once,
each link after the one before it answered, the fan-in after every child
answered, each intermediate after every one of its children answered. Every server started is stopped and the directory removed.
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
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_support import log  # noqa: E402
from results import Redis, sh  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Logs "ARRIVED_NS ANSWERED_NS PAYLOAD" per job, then acks it.
HANDLER = r"""
import json, os, sys, time
log = open(os.environ["JOB_LOG"], "a", buffering=1)
out = sys.stdout
for line in sys.stdin:
    t0 = time.time_ns()
    job = json.loads(line)
    out.write(json.dumps({"receipt": job["receipt"], "ok": True}) + "\n")
    out.flush()
    log.write(f"{t0} {time.time_ns()} {job.get('payload')}\n")
"""


def pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def deployment(a: argparse.Namespace, tmp: str, name: str, redis: "Redis | None") -> str:
    data = os.path.join(tmp, name)
    init = [a.bin, "init", "--data", data, "--shards", "4"]
    if redis is not None:
        redis.flush()
        init += ["--redis", redis.url]
    sh(*init)
    return data


def work(a: argparse.Namespace, data: str, handler: str, job_log: str) -> float:
    env = dict(os.environ, JOB_LOG=job_log)
    t0 = time.perf_counter()
    p = subprocess.run([a.bin, "work", "--data", data, "--max-local-shards", "all", "--exit-when-idle",
                        "--concurrency", "8", "--stdio", "--", sys.executable, handler],
                       capture_output=True, text=True, env=env)
    secs = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"work exited {p.returncode}: {p.stderr[-2000:]}")
    return secs


def read_log(path: str) -> Dict[str, Tuple[int, int]]:
    seen: Dict[str, Tuple[int, int]] = {}
    with open(path) as f:
        for line in f:
            got, answered, payload = line.split()
            if payload in seen:
                raise SystemExit(f"job {payload} arrived twice")
            seen[payload] = (int(got), int(answered))
    return seen


def chain(a: argparse.Namespace, tmp: str, n: int, redis: "Redis | None", handler: str) -> List[float]:
    data = deployment(a, tmp, f"chain{n}", redis)
    prev = sh(a.bin, "enqueue", "--data", data, "--key", "chain-0", "--payload", "l0").strip()
    for i in range(1, a.links + 1):
        prev = sh(a.bin, "enqueue", "--data", data, "--key", f"chain-{i}", "--payload", f"l{i}",
                  "--after", prev).strip()
    job_log = os.path.join(tmp, f"chain{n}.log")
    secs = work(a, data, handler, job_log)
    seen = read_log(job_log)
    lat = []
    for i in range(1, a.links + 1):
        got, _ = seen[f"l{i}"]
        _, before = seen[f"l{i - 1}"]
        if got <= before:
            raise SystemExit(f"link {i} arrived before link {i - 1} answered")
        lat.append((got - before) / 1e6)
    shutil.rmtree(data, ignore_errors=True)
    log(f"chain: {a.links} links in {secs:.1f} s, p50 {pct(lat, 50):.1f} ms, p99 {pct(lat, 99):.1f} ms")
    return lat


def fan(a: argparse.Namespace, tmp: str, n: int, redis: "Redis | None", handler: str, with_fan_in: bool) -> Dict:
    data = deployment(a, tmp, f"fan{n}", redis)
    total = a.children * a.fan_ins
    # docs/workflows.md: a resolver sees a child end through its shard's
    # finished jobs, so the retention keeps more than a shard finishes
    # between two passes; every child here, in both modes.
    sh(a.bin, "retention", "set", "--data", data, "--finished-jobs", str(max(1000, total)))
    lines = "".join(f"k{i % a.keys}\tc{i}\n" for i in range(total))
    ids = [line.split("\t")[1] for line in sh(a.bin, "enqueue", "--data", data, "--stdin", stdin=lines).split("\n")
           if line]
    if with_fan_in:
        for j in range(a.fan_ins):
            group = ids[j * a.children:(j + 1) * a.children]
            sh(a.bin, "enqueue", "--data", data, "--key", f"fan-in-{j}", "--payload", f"fan{j}",
               "--after", ",".join(group))
    job_log = os.path.join(tmp, f"fan{n}.log")
    secs = work(a, data, handler, job_log)
    seen = read_log(job_log)
    missing = [i for i in range(total) if f"c{i}" not in seen]
    if missing:
        raise SystemExit(f"{len(missing)} children never arrived")
    out: Dict = {"mode": "fan-in" if with_fan_in else "children only", "seconds": round(secs, 3)}
    if with_fan_in:
        lat = []
        for j in range(a.fan_ins):
            last = max(seen[f"c{i}"][1] for i in range(j * a.children, (j + 1) * a.children))
            if f"fan{j}" not in seen:
                shown = sh(a.bin, "jobs", "--data", data, "--key", f"fan-in-{j}", "--json")
                raise SystemExit(f"fan-in {j} never ran: {shown[:2000]}")
            got = seen[f"fan{j}"][0]
            if got <= last:
                raise SystemExit(f"fan-in {j} arrived before its last child answered")
            lat.append(round((got - last) / 1e6, 2))
        out["last_child_to_fan_in_ms"] = lat
    shutil.rmtree(data, ignore_errors=True)
    log(f"fan: {out['mode']} {secs:.2f} s" + (f", last child -> fan-in {out.get('last_child_to_fan_in_ms')}" if with_fan_in else ""))
    return out


def tree(a: argparse.Namespace, tmp: str, n: int, redis: "Redis | None", handler: str, with_fan_in: bool) -> Dict:
    data = deployment(a, tmp, f"tree{n}", redis)
    total, width = a.tree_children, a.tree_width
    groups = (total + width - 1) // width
    # As for the fan-ins: the retention keeps every child's finished job
    # (FINISHED_JOBS_KEPT_MAX is 100,000 per shard).
    sh(a.bin, "retention", "set", "--data", data, "--finished-jobs", str(min(100_000, max(1000, total))))
    lines = "".join(f"k{i % a.keys}\tc{i}\n" for i in range(total))
    t0 = time.perf_counter()
    ids = [line.split("\t")[1] for line in sh(a.bin, "enqueue", "--data", data, "--stdin", stdin=lines).split("\n")
           if line]
    children_s = time.perf_counter() - t0
    if len(ids) != total:
        raise SystemExit(f"enqueue --stdin printed {len(ids)} ids for {total} children")
    deps_s = 0.0
    if with_fan_in:
        t0 = time.perf_counter()
        mids = []
        for j in range(groups):
            group = ids[j * width:(j + 1) * width]
            mids.append(sh(a.bin, "enqueue", "--data", data, "--key", f"mid-{j}", "--payload", f"mid{j}",
                           "--after", ",".join(group)).strip())
        sh(a.bin, "enqueue", "--data", data, "--key", "fan-in", "--payload", "fanin", "--after", ",".join(mids))
        deps_s = time.perf_counter() - t0
    job_log = os.path.join(tmp, f"tree{n}.log")
    secs = work(a, data, handler, job_log)
    seen = read_log(job_log)
    missing = [i for i in range(total) if f"c{i}" not in seen]
    if missing:
        raise SystemExit(f"{len(missing)} children never arrived")
    out: Dict = {"mode": "tree" if with_fan_in else "children only", "seconds": round(secs, 3),
                 "children_enqueue_s": round(children_s, 2)}
    if with_fan_in:
        mid_lat = []
        for j in range(groups):
            last = max(seen[f"c{i}"][1] for i in range(j * width, min(total, (j + 1) * width)))
            if f"mid{j}" not in seen:
                shown = sh(a.bin, "jobs", "--data", data, "--key", f"mid-{j}", "--json")
                raise SystemExit(f"intermediate {j} never ran: {shown[:2000]}")
            got = seen[f"mid{j}"][0]
            if got <= last:
                raise SystemExit(f"intermediate {j} arrived before its last child answered")
            mid_lat.append((got - last) / 1e6)
        if "fanin" not in seen:
            shown = sh(a.bin, "jobs", "--data", data, "--key", "fan-in", "--json")
            raise SystemExit(f"the fan-in never ran: {shown[:2000]}")
        got = seen["fanin"][0]
        last_child = max(seen[f"c{i}"][1] for i in range(total))
        last_mid = max(seen[f"mid{j}"][1] for j in range(groups))
        if got <= last_mid or got <= last_child:
            raise SystemExit("the fan-in arrived before every intermediate and child answered")
        out |= {"dependents_enqueue_s": round(deps_s, 2),
                "last_child_to_fan_in_ms": round((got - last_child) / 1e6, 2),
                "last_intermediate_to_fan_in_ms": round((got - last_mid) / 1e6, 2),
                "child_to_intermediate_ms_p50": round(pct(mid_lat, 50), 2),
                "child_to_intermediate_ms_max": round(max(mid_lat), 2)}
    shutil.rmtree(data, ignore_errors=True)
    log(f"tree: {json.dumps(out)}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.environ.get("SHARDQ_BIN") or os.path.join(ROOT, "target", "release", "shardq"))
    p.add_argument("--links", type=int, default=1000)
    p.add_argument("--children", type=int, default=1000)
    p.add_argument("--fan-ins", type=int, default=10)
    p.add_argument("--keys", type=int, default=100)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--backends", default="embedded,redis")
    p.add_argument("--tree-children", type=int, default=0,
                   help="measure one fan-in over this many children through intermediates instead")
    p.add_argument("--tree-width", type=int, default=1000, help="children per intermediate")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if not os.path.exists(a.bin):
        raise SystemExit(f"{a.bin}: no such binary (cargo build --release -p shardq)")
    tmp = tempfile.mkdtemp(prefix="workflows-bench-")
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
            if a.tree_children:
                runs: List[Dict] = []
                for rep in range(a.repeat):
                    for with_fan_in in ([True, False] if rep % 2 == 0 else [False, True]):
                        n += 1
                        runs.append(tree(a, tmp, n, r, handler, with_fan_in) | {"repeat": rep})
                med = {m: statistics.median(x["seconds"] for x in runs if x["mode"] == m)
                       for m in ("tree", "children only")}
                result[backend] = {"runs": runs, "tree_seconds_median": med["tree"],
                                   "children_only_seconds_median": med["children only"],
                                   "ratio": round(med["children only"] / med["tree"], 3)}
                continue
            lat: List[float] = []
            fans: List[Dict] = []
            for rep in range(a.repeat):
                n += 1
                lat += chain(a, tmp, n, r, handler)
                order = [True, False] if rep % 2 == 0 else [False, True]
                for with_fan_in in order:
                    n += 1
                    fans.append(fan(a, tmp, n, r, handler, with_fan_in) | {"repeat": rep})
            med = {m: statistics.median(f["seconds"] for f in fans if f["mode"] == m)
                   for m in ("fan-in", "children only")}
            result[backend] = {
                "chain_links": len(lat),
                "link_p50_ms": round(pct(lat, 50), 2),
                "link_p99_ms": round(pct(lat, 99), 2),
                "link_max_ms": round(max(lat), 2),
                "fan_runs": fans,
                "fan_in_after_last_child_ms": [x for f in fans if f["mode"] == "fan-in"
                                               for x in f["last_child_to_fan_in_ms"]],
                "fan_in_seconds_median": med["fan-in"],
                "children_only_seconds_median": med["children only"],
                "ratio": round(med["children only"] / med["fan-in"], 3),
            }
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(result))
        return
    if a.tree_children:
        print(f"one fan-in over {a.tree_children} children on {a.keys} keys through "
              f"{(a.tree_children + a.tree_width - 1) // a.tree_width} intermediates of {a.tree_width}; "
              f"4 shards, `work --stdio --concurrency 8`; nproc {os.cpu_count()}\n")
        print("| backend | last child -> fan-in (each run) | last intermediate -> fan-in | "
              "child -> intermediate p50 / max | dependents' enqueue s | tree runs / children only "
              "(median s; throughput ratio) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for b, s in result.items():
            t = [x for x in s["runs"] if x["mode"] == "tree"]
            mids = [f"{x['child_to_intermediate_ms_p50']} / {x['child_to_intermediate_ms_max']}" for x in t]
            print(f"| {b} | {', '.join(str(x['last_child_to_fan_in_ms']) for x in t)} ms | "
                  f"{', '.join(str(x['last_intermediate_to_fan_in_ms']) for x in t)} ms | "
                  f"{', '.join(mids)} ms | "
                  f"{', '.join(str(x['dependents_enqueue_s']) for x in t)} | "
                  f"{s['tree_seconds_median']} / {s['children_only_seconds_median']} (x{s['ratio']}) |")
        return
    print(f"chain of {a.links} links on {a.links + 1} keys; {a.fan_ins} fan-ins over {a.children} children each "
          f"on {a.keys} keys; "
          f"4 shards, `work --stdio --concurrency 8`; nproc {os.cpu_count()}\n")
    print("| backend | link p50 | link p99 | link max | last child -> fan-in p50 / p99 / max | "
          "fan-in runs / children only (median s; throughput ratio) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for b, s in result.items():
        f = s["fan_in_after_last_child_ms"]
        print(f"| {b} | {s['link_p50_ms']} ms | {s['link_p99_ms']} ms | {s['link_max_ms']} ms | "
              f"{pct(f, 50)} / {pct(f, 99)} / {max(f)} ms ({len(f)} fan-ins) | "
              f"{s['fan_in_seconds_median']} / {s['children_only_seconds_median']} (x{s['ratio']}) |")


if __name__ == "__main__":
    main()
