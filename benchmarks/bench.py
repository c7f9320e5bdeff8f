#!/usr/bin/env python3
"""shardq from any language: the benchmark driver (see benchmarks/README.md).

    python3 benchmarks/bench.py stdio   [--jobs 200000] [--proc-jobs 4000] [--pipelines 1,4,8] [--repeat 3]
    python3 benchmarks/bench.py http    [--backend embedded|redis] [--jobs 100000] [--bullmq] [--repeat 3]
    python3 benchmarks/bench.py latency [--rate 5000] [--seconds 10] [--repeat 3]
    python3 benchmarks/bench.py move    [--jobs 2000000] [--keys 1000] [--workers 1] [--baseline-bin OLD]
    python3 benchmarks/bench.py move-latency [--jobs 1000000] [--before-s 4] [--baseline-bin OLD] [--repeat 5]

Everything runs on loopback: data dirs in a temporary directory, the
release binary (``cargo build --release -p shardq`` when it is missing),
a redis-server it starts on a free port for ``--backend redis``. Each
result is printed as one JSON line (and a summary line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from typing import Any, Dict, List, Optional

from bench_support import free_port, log

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY_HANDLER = os.path.join(ROOT, "examples", "handlers", "python", "stdio_handler.py")
WAIT_S = 600




def emit(row: Dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def binary() -> str:
    if os.environ.get("SHARDQ_BIN"):
        return os.environ["SHARDQ_BIN"]
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    path = os.path.join(target, "release", "shardq")
    if not os.access(path, os.X_OK):
        subprocess.run(["cargo", "build", "--release", "-p", "shardq"], cwd=ROOT, check=True)
    return path


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a live process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ctx_switches(pid: int) -> int:
    """Context switches of every thread of a live process (Linux /proc)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        n += int(line.split()[1])
        except OSError:
            pass
    return n


def children_cpu_s() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime




def sh(*args: str, stdin: Optional[bytes] = None) -> bytes:
    out = subprocess.run(list(args), input=stdin, capture_output=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {out.returncode}: {out.stderr.decode()[-2000:]}")
    return out.stdout


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait_for(what: str, cond, timeout_s: float = 60, every_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if cond():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(every_s)


def stop(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class RedisServer:
    def __init__(self, dir: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not on PATH")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", dir, "--maxmemory-policy", "noeviction", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def up() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), 0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        wait_for("redis-server", up, 20)

    def stop(self) -> None:
        stop(self.proc)


class Serve:
    def __init__(self, data: str, shards: int, logf: str, exe: Optional[str] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(logf, "ab") as lf:
            self.proc = subprocess.Popen([exe or binary(), "serve", "--data", data, "--listen", f"127.0.0.1:{self.port}"],
                                         stdout=lf, stderr=subprocess.STDOUT)

        def ready() -> bool:
            doc = get_json(self.url + "/readyz")
            return bool(doc.get("ready")) and len(doc.get("owned", [])) == shards
        wait_for("shardq serve /readyz", ready, 60)

    def totals(self) -> Dict[str, int]:
        return get_json(self.url + "/v1/status")["totals"]

    def stop(self) -> None:
        stop(self.proc)


def init_data(tmp: str, name: str, shards: int, redis_url: Optional[str] = None) -> str:
    data = os.path.join(tmp, name)
    args = [binary(), "init", "--data", data, "--shards", str(shards)]
    if redis_url:
        args += ["--redis", redis_url, "--namespace", name]
    sh(*args)
    return data


# ---------------------------------------------------------------- stdio

def bench_stdio(a: argparse.Namespace) -> None:
    keys = 1000
    for rep in range(a.repeat):
        with tempfile.TemporaryDirectory(prefix="shardq-bench-stdio-") as tmp:
            data = init_data(tmp, "q", 4)

            def enqueue(n: int) -> None:
                lines = "".join(f"k-{i % keys}\t{{\"seq\":{i // keys}}}\n" for i in range(n)).encode()
                sh(binary(), "enqueue", "--data", data, "--durability", "interval", "--stdin", stdin=lines)

            def work(n: int, extra: List[str], cmd: List[str]) -> float:
                enqueue(n)
                t0 = time.monotonic()
                sh(binary(), "work", "--data", data, "--concurrency", str(a.concurrency), "--max-local-shards", "all",
                   "--exit-when-idle", "--durability", "interval", *extra, "--", *cmd)
                dt = time.monotonic() - t0
                totals = json.loads(sh(binary(), "status", "--data", data, "--json"))["totals"]
                if totals != {"ready": 0, "delayed": 0, "in_flight": 0, "dead": 0}:
                    raise SystemExit(f"work left jobs behind: {totals}")
                return n / dt

            base = work(a.proc_jobs, [], ["true"])
            row: Dict[str, Any] = {"bench": "stdio", "repeat": rep, "concurrency": a.concurrency,
                                   "process_per_job_jobs_per_s": round(base)}
            for p in a.pipelines:
                r = work(a.jobs, ["--stdio", "--stdio-pipeline", str(p)], [sys.executable, PY_HANDLER])
                row[f"stdio_pipeline_{p}_jobs_per_s"] = round(r)
                row[f"stdio_pipeline_{p}_ratio"] = round(r / base, 1)
            emit(row)
            log(f"stdio rep {rep}: process per job {base:.0f} jobs/s; " + ", ".join(
                f"pipeline {p}: {row[f'stdio_pipeline_{p}_jobs_per_s']} jobs/s ({row[f'stdio_pipeline_{p}_ratio']}x)"
                for p in a.pipelines))


# ---------------------------------------------------------------- http pipeline

def check_records(paths: List[str], keys: int, per_key: int) -> Dict[str, Any]:
    """Merges the workers' records by start time: per key the seqs never go
    back, and every (key, seq) ran. Returns the latencies and counts."""
    recs = []
    stats = defaultdict(int)
    disorder = 0
    for p in paths:
        with open(p) as f:
            head = json.loads(f.readline())
            for k, v in head["stats"].items():
                stats[k] += v
            disorder += head["disorder_count"]
            for line in f:
                key, seq, t, lat = line.split()
                recs.append((int(t), key, int(seq), int(lat)))
    recs.sort()
    last: Dict[str, int] = {}
    seen = set()
    for _, key, seq, _ in recs:
        if seq < last.get(key, -1):
            disorder += 1
        last[key] = seq
        seen.add((key, seq))
    missing = keys * per_key - len(seen)
    if disorder or missing:
        raise SystemExit(f"order or completeness broken: {disorder} out of order, {missing} missing")
    return {"runs": len(recs), "reruns": len(recs) - len(seen), "stats": dict(stats),
            "latencies_ns": [r[3] for r in recs], "starts_ns": [r[0] for r in recs]}


def run_pipeline(tmp: str, serve_url: str, serve: Serve, keys: int, per_key: int, producers: int, workers: int,
                 concurrency: int, batch: int, rate: float = 0.0, redis: Optional["RedisServer"] = None,
                 worker_kind: str = "thread") -> Dict[str, Any]:
    outs = [os.path.join(tmp, f"worker-{i}.txt") for i in range(workers)]
    wprocs = [subprocess.Popen([sys.executable, os.path.join(HERE, "http_worker.py"), serve_url, o, str(concurrency),
                                worker_kind])
              for o in outs]
    time.sleep(0.5)  # let the workers start polling
    cs0 = ctx_switches(serve.proc.pid)
    wcs0 = sum(ctx_switches(p.pid) for p in wprocs)
    cpu0 = {"serve": cpu_s(serve.proc.pid), "workers": sum(cpu_s(p.pid) for p in wprocs),
            "redis": cpu_s(redis.proc.pid) if redis else 0.0, "producers": children_cpu_s()}
    t0 = time.monotonic()
    pprocs = [subprocess.Popen([sys.executable, os.path.join(HERE, "http_producer.py"), serve_url, str(i), str(producers),
                                str(keys), str(per_key), str(batch), str(rate / producers if rate else 0)],
                               stdout=subprocess.PIPE, text=True) for i in range(producers)]
    prod = [json.loads(p.communicate(timeout=WAIT_S)[0]) for p in pprocs]
    t_prod = time.monotonic() - t0
    cpu_producers = children_cpu_s() - cpu0["producers"]

    def idle() -> bool:
        t = serve.totals()
        return t["ready"] + t["delayed"] + t["in_flight"] == 0
    # Every 20 ms: the poll must not take the CPU the pipeline is measured on
    # (it can only make the measured time longer, by up to one interval).
    wait_for("the workers to drain the queue", idle, WAIT_S, 0.02)
    t_all = time.monotonic() - t0
    # Where the CPU went during the timed part (the machine has 2 cores).
    cpu = {"serve": cpu_s(serve.proc.pid) - cpu0["serve"],
           "workers": sum(cpu_s(p.pid) for p in wprocs) - cpu0["workers"],
           "producers": cpu_producers}
    if redis:
        cpu["redis"] = cpu_s(redis.proc.pid) - cpu0["redis"]
        if os.environ.get("SHARDQ_BENCH_REDIS_STATS"):
            log(sh("redis-cli", "-p", str(redis.port), "INFO", "commandstats").decode())
    cpu = {k: round(v, 2) for k, v in cpu.items()}
    cpu["serve_context_switches"] = ctx_switches(serve.proc.pid) - cs0
    cpu["workers_context_switches"] = sum(ctx_switches(p.pid) for p in wprocs) - wcs0
    for p in wprocs:
        stop(p)
    n = keys * per_key
    if sum(p["jobs"] for p in prod) != n or any(p["duplicates"] for p in prod):
        raise SystemExit(f"producers stored {prod}")
    checked = check_records(outs, keys, per_key)
    return {"jobs": n, "seconds": t_all, "jobs_per_s": n / t_all, "enqueue_seconds": t_prod, "cpu_s": cpu, **checked}


def bench_http(a: argparse.Namespace) -> None:
    keys = 1000
    per_key = a.jobs // keys
    for rep in range(a.repeat):
        with tempfile.TemporaryDirectory(prefix="shardq-bench-http-") as tmp:
            redis = RedisServer(tmp) if a.backend == "redis" else None
            try:
                data = init_data(tmp, f"q{rep}", 4, redis.url if redis else None)
                serve = Serve(data, 4, os.path.join(tmp, "serve.log"))
                try:
                    r = run_pipeline(tmp, serve.url, serve, keys, per_key, a.producers, a.workers, a.concurrency, a.batch,
                                     redis=redis, worker_kind=a.worker)
                finally:
                    serve.stop()
                row: Dict[str, Any] = {
                    "bench": "http", "backend": a.backend, "repeat": rep, "jobs": r["jobs"],
                    "producers": a.producers, "workers": a.workers, "worker_kind": a.worker, "prefetch": a.prefetch,
                    "worker_concurrency": a.concurrency, "batch": a.batch,
                    "jobs_per_s": round(r["jobs_per_s"]), "seconds": round(r["seconds"], 2),
                    "enqueue_seconds": round(r["enqueue_seconds"], 2), "reruns": r["reruns"], "worker_stats": r["stats"],
                    "cpu_s": r["cpu_s"],
                }
                msg = f"http {a.backend} rep {rep}: {row['jobs_per_s']} jobs/s end to end ({r['jobs']} jobs in {row['seconds']} s; CPU s {r['cpu_s']})"
                if redis and a.bullmq:
                    # The peer runs on a redis-server of its own, started
                    # empty: on the one shardq used it would find shardq's
                    # finished-job history and dedup records there (and an
                    # older build's 200,000 dedup keys), which slowed it by
                    # up to a tenth.
                    peer_dir = os.path.join(tmp, "peer-redis")
                    os.makedirs(peer_dir, exist_ok=True)
                    peer_redis = RedisServer(peer_dir)
                    try:
                        b = bullmq(peer_redis.url, r["jobs"], a.bullmq_concurrency)
                    finally:
                        peer_redis.stop()
                    row["bullmq"] = b
                    row["ratio_vs_bullmq"] = round(r["jobs_per_s"] / b["jobs_per_s"], 2)
                    msg += f"; BullMQ {b['jobs_per_s']} jobs/s; ratio {row['ratio_vs_bullmq']}x"
                emit(row)
                log(msg)
            finally:
                if redis:
                    redis.stop()


def bullmq(redis_url: str, jobs: int, concurrency: int) -> Dict[str, Any]:
    peer = os.path.join(HERE, "peers", "bullmq")
    if not os.path.isdir(os.path.join(peer, "node_modules")):
        subprocess.run(["npm", "ci" if os.path.exists(os.path.join(peer, "package-lock.json")) else "install", "--silent"],
                       cwd=peer, check=True)
    out = sh("node", os.path.join(peer, "bench.mjs"), redis_url, str(jobs), str(concurrency))
    return json.loads(out.decode().strip().splitlines()[-1])


# ---------------------------------------------------------------- latency

def pct(xs: List[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def bench_latency(a: argparse.Namespace) -> None:
    keys = 1000
    per_key = int(a.rate * a.seconds) // keys
    for rep in range(a.repeat):
        with tempfile.TemporaryDirectory(prefix="shardq-bench-lat-") as tmp:
            data = init_data(tmp, "q", 4)
            serve = Serve(data, 4, os.path.join(tmp, "serve.log"))
            try:
                r = run_pipeline(tmp, serve.url, serve, keys, per_key, 1, a.workers, a.concurrency, a.batch, a.rate,
                                 worker_kind=a.worker)
            finally:
                serve.stop()
            # Drop the first second (connections and threads warming up).
            t_first = min(r["starts_ns"])
            lat = [l / 1e6 for l, s in zip(r["latencies_ns"], r["starts_ns"]) if s - t_first > 1e9]
            row = {"bench": "latency", "repeat": rep, "rate": a.rate, "batch": a.batch, "jobs": r["jobs"],
                   "achieved_jobs_per_s": round(r["jobs"] / r["enqueue_seconds"]),
                   "p50_ms": round(pct(lat, 50), 2), "p99_ms": round(pct(lat, 99), 2), "max_ms": round(max(lat), 2),
                   "mean_ms": round(statistics.fmean(lat), 2)}
            emit(row)
            log(f"latency rep {rep}: {row['achieved_jobs_per_s']} jobs/s offered; p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms")


# ---------------------------------------------------------------- move

def bench_move(a: argparse.Namespace) -> None:
    """`remove-shard` of a shard holding a backlog, with --workers worker
    processes running (the builtin handler, so each worker is as fast as it
    gets) or none: the wall time of the CLI command and the jobs it moved
    (the workers' runs are not checked), and the CPU seconds each
    redis-server, the workers and the command used meanwhile. With
    --baseline-bin, the same data on that binary right after (a build that
    drains instead of moving)."""
    bins = [("this", binary())] + ([("baseline", a.baseline_bin)] if a.baseline_bin else [])
    for rep in range(a.repeat):
        for label, exe in bins:
            with tempfile.TemporaryDirectory(prefix="shardq-bench-move-") as tmp:
                data = os.path.join(tmp, "d")
                redis = [RedisServer(tmp) for _ in range(2)] if a.backend == "redis" else []
                try:
                    bench_move_one(a, exe, label, rep, tmp, data, redis)
                finally:
                    for r in redis:
                        r.stop()


def bench_move_one(a: argparse.Namespace, exe: str, label: str, rep: int, tmp: str, data: str,
                   redis: List["RedisServer"]) -> None:
    """One run of `bench_move` in `tmp`, on `redis` when it names servers."""
    if redis:
        sh(exe, "init", "--data", data, "--shards", "2", "--redis", ",".join(r.url for r in redis))
        durability: List[str] = []
    else:
        sh(exe, "init", "--data", data, "--shards", "2")
        durability = ["--durability", "none"]
    lines = "".join(f"t-{i % a.keys}\t{i // a.keys}\n" for i in range(a.jobs)).encode()
    t0 = time.monotonic()
    sh(exe, "enqueue", "--data", data, "--stdin", *durability, stdin=lines)
    enqueue_s = time.monotonic() - t0
    status = json.loads(sh(exe, "status", "--data", data, "--json"))
    held = {r["name"]: r["ready"] + r["delayed"] for r in status["shards"]}
    workers = [subprocess.Popen([exe, "work", "--data", data, "--max-local-shards", "all",
                                 "--concurrency", "8", *durability,
                                 "--handler-builtin", f"append:{os.path.join(tmp, f'runs-{i}.txt')}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for i in range(a.workers)]
    if workers:
        time.sleep(0.5)
    # CPU seconds of each redis-server, the workers and remove-shard (a
    # child reaped by `sh`; the workers are reaped only after) while it runs.
    cpu0 = ([cpu_s(r.proc.pid) for r in redis], sum(cpu_s(w.pid) for w in workers), children_cpu_s())
    t0 = time.monotonic()
    out = sh(exe, "remove-shard", "--data", data, "shard-1", "--json")
    move_s = time.monotonic() - t0
    cpu = {"remove_shard": children_cpu_s() - cpu0[2], "workers": sum(cpu_s(w.pid) for w in workers) - cpu0[1]}
    for i, r in enumerate(redis):
        cpu[f"redis_shard_{i}"] = cpu_s(r.proc.pid) - cpu0[0][i]
    report = json.loads(out.decode().strip().splitlines()[-1])
    for w in workers:
        stop(w)
    moved = report.get("jobs_moved", 0)
    row = {"bench": "move", "backend": a.backend, "binary": label, "repeat": rep, "jobs": a.jobs,
           "keys": a.keys,
           "on_removed_shard": held.get("shard-1", 0), "workers": a.workers,
           "remove_shard_s": round(move_s, 2), "jobs_moved": moved,
           "moved_per_s": round(moved / move_s) if moved else None,
           "pause_ms_p99": report.get("pause_ms_p99"), "enqueue_s": round(enqueue_s, 2),
           "cpu_s": {k: round(v, 2) for k, v in cpu.items()}, "load1": round(os.getloadavg()[0], 2)}
    emit(row)
    log(f"move {label} rep {rep}: remove-shard of {row['on_removed_shard']} queued jobs took "
        f"{row['remove_shard_s']} s ({moved} moved; CPU s {row['cpu_s']}; load {row['load1']})")


def bench_move_latency(a: argparse.Namespace) -> None:
    """A producer enqueueing one job at a time through `shardq serve` to a
    hot key with a deep backlog, while `remove-shard` moves the key (a
    worker runs jobs meanwhile): the producer's enqueue latency before the
    move and during it, and its refused enqueues. With --repeat, the builds
    alternate, and a last row gives each build's median p99 ratio (during
    over before): one run's p99 is a few dozen calls on a noisy machine."""
    bins = [("this", binary())] + ([("baseline", a.baseline_bin)] if a.baseline_bin else [])
    ratios: Dict[str, List[float]] = {label: [] for label, _ in bins}
    for rep in range(a.repeat):
        for label, exe in bins:
            row = move_latency_once(a, label, exe, rep)
            if row["p99_ms_during"] is not None and row["p99_ms_before"]:
                ratios[label].append(row["p99_ms_during"] / row["p99_ms_before"])
    if a.repeat > 1:
        summary = {"bench": "move-latency-summary", "repeat": a.repeat,
                   "p99_ratio_median": {k: round(statistics.median(v), 2) for k, v in ratios.items() if v},
                   "p99_ratios": {k: [round(x, 2) for x in v] for k, v in ratios.items()}}
        emit(summary)
        log(f"move-latency: median p99 during/before {summary['p99_ratio_median']}")


def move_latency_once(a: argparse.Namespace, label: str, exe: str, rep: int) -> Dict[str, Any]:
    """One run of the move-latency bench on `exe`; returns its row."""
    sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
    import threading

    from shardq import Client

    with tempfile.TemporaryDirectory(prefix="shardq-bench-movelat-") as tmp:
        data = os.path.join(tmp, "d")
        sh(exe, "init", "--data", data, "--shards", "2")
        key = next(k for k in (f"hot-{i}" for i in range(1000))
                   if sh(exe, "route", "--map", os.path.join(data, "shardmap.yaml"), k).decode().split()[1] == "shard-1")
        lines = "".join(f"{key}\t{i}\n" for i in range(a.jobs)).encode()
        sh(exe, "enqueue", "--data", data, "--stdin", "--durability", "none", stdin=lines)
        # The backlog reaches the disk before the run: else the server's
        # first syncs write it back, inside the window measured "before".
        os.sync()
        serve = Serve(data, 2, os.path.join(tmp, "serve.log"), exe)
        runs = os.path.join(tmp, "runs.txt")
        worker = subprocess.Popen([exe, "work", "--data", data, "--max-local-shards", "all", "--concurrency", "8",
                                   "--durability", "none", "--handler-builtin", f"append:{runs}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples: List[tuple] = []
        errors: List[str] = []
        done = threading.Event()

        def produce() -> None:
            c = Client(serve.url, timeout_s=120)
            n = 0
            while not done.is_set():
                t = time.monotonic()
                try:
                    c.enqueue(key, f"live-{n}".encode())
                except Exception as e:  # a refused enqueue counts, and is named
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                samples.append((t, time.monotonic() - t))
                n += 1

        th = threading.Thread(target=produce)
        th.start()
        time.sleep(a.before_s)
        t0 = time.monotonic()
        sh(exe, "remove-shard", "--data", data, "shard-1", "--json")
        t1 = time.monotonic()
        time.sleep(0.5)
        done.set()
        th.join()
        stop(worker)
        serve.stop()
    # The first half second is the server's and the client's warm-up.
    before = [d * 1000 for t, d in samples if samples[0][0] + 0.5 <= t < t0]
    during = [d * 1000 for t, d in samples if t0 <= t <= t1]
    row = {"bench": "move-latency", "binary": label, "repeat": rep, "jobs": a.jobs,
           "remove_shard_s": round(t1 - t0, 2),
           "enqueues_before": len(before), "enqueues_during": len(during),
           "p50_ms_before": round(pct(before, 50), 2), "p99_ms_before": round(pct(before, 99), 2),
           "p50_ms_during": round(pct(during, 50), 2) if during else None,
           "p99_ms_during": round(pct(during, 99), 2) if during else None,
           "max_ms_during": round(max(during), 1) if during else None,
           "refused": len(errors), "first_refusal": errors[0] if errors else None}
    emit(row)
    log(f"move-latency {label} rep {rep}: enqueue p99 {row['p99_ms_before']} ms before, {row['p99_ms_during']} ms "
        f"during a {row['remove_shard_s']} s move ({row['refused']} refused)")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stdio")
    s.add_argument("--jobs", type=int, default=200_000)
    s.add_argument("--proc-jobs", type=int, default=4_000)
    s.add_argument("--concurrency", type=int, default=8)
    s.add_argument("--pipelines", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 8])
    s.add_argument("--repeat", type=int, default=3)
    h = sub.add_parser("http")
    h.add_argument("--backend", choices=["embedded", "redis"], default="embedded")
    h.add_argument("--jobs", type=int, default=100_000)
    h.add_argument("--producers", type=int, default=1)
    h.add_argument("--workers", type=int, default=2)
    # 2 x 500 slots: as many as the 1,000 keys can keep in flight (one run per key).
    h.add_argument("--concurrency", type=int, default=500)
    h.add_argument("--batch", type=int, default=1000)
    h.add_argument("--worker", choices=["thread", "aio"], default="thread",
                   help="shardq.Worker (threads) or shardq.aio.AsyncWorker (asyncio tasks)")
    h.add_argument("--prefetch", type=int, default=None,
                   help="shardq.Worker's prefetch (default: the client's, as many as --concurrency)")
    h.add_argument("--bullmq", action="store_true", help="with --backend redis: BullMQ 5 on the same redis-server")
    h.add_argument("--bullmq-concurrency", type=int, default=100)
    h.add_argument("--repeat", type=int, default=3)
    l = sub.add_parser("latency")
    l.add_argument("--rate", type=float, default=5000)
    l.add_argument("--seconds", type=float, default=10)
    l.add_argument("--batch", type=int, default=50)
    l.add_argument("--workers", type=int, default=2)
    l.add_argument("--concurrency", type=int, default=32)
    l.add_argument("--worker", choices=["thread", "aio"], default="thread")
    l.add_argument("--prefetch", type=int, default=None)
    l.add_argument("--repeat", type=int, default=3)
    m = sub.add_parser("move")
    m.add_argument("--jobs", type=int, default=2_000_000, help="jobs over 2 shards; about half on the removed one")
    m.add_argument("--keys", type=int, default=1000)
    m.add_argument("--workers", type=int, default=1, help="N: N worker processes run jobs during the move; 0: none")
    m.add_argument("--backend", choices=["embedded", "redis"], default="embedded",
                   help="redis: the two shards on two local redis-server processes")
    m.add_argument("--baseline-bin", default=None, help="another shardq binary to run the same on")
    m.add_argument("--repeat", type=int, default=1)
    ml = sub.add_parser("move-latency")
    ml.add_argument("--jobs", type=int, default=1_000_000, help="the hot key's backlog")
    ml.add_argument("--before-s", type=float, default=4.0)
    ml.add_argument("--baseline-bin", default=None)
    ml.add_argument("--repeat", type=int, default=1, help="runs per build, the builds alternating")
    a = ap.parse_args()
    if getattr(a, "prefetch", None) is not None:
        os.environ["SHARDQ_BENCH_PREFETCH"] = str(a.prefetch)  # read by http_worker.py
    {"stdio": bench_stdio, "http": bench_http, "latency": bench_latency, "move": bench_move,
     "move-latency": bench_move_latency}[a.cmd](a)


if __name__ == "__main__":
    main()
