#!/usr/bin/env python3
"""What reads of a big shard cost the enqueues of `shardq serve` on it: one
producer enqueues one job per request while reader loops read the shard,
and its latency is compared with the same producer alone (see
BENCHMARKS.md, "Memory and the server under attack", and the issue
"one read slows every enqueue on its shard").

    python3 benchmarks/serve_reads.py [--bin [NAME=]PATH ...] [--big-jobs N] [--other-keys M]
                                      [--seconds S] [--readers R] [--phases LIST] [--repeat K] [--json]

For each binary and repeat, on a fresh data dir (embedded, `shardq init
--shards 1`): `shardq enqueue --stdin --durability none` loads --big-jobs
jobs (1,000,000) on key `big`, then one job on each of --other-keys keys
(200,000; `k-000000` ...), with --payload-bytes (32) payloads. Then `shardq
serve` starts on a free loopback port with no tokens and its defaults
(durability as the engine's default); it must answer /readyz, and
/v1/status must count every loaded job, before anything is measured.

Each phase lasts --seconds (8): one producer (a connection kept alive)
sends `POST /v1/jobs` with one job at a time, on keys `enq-0` ..
`enq-99` in turn, and records each call's latency (request sent to answer
read). Before the first phase it enqueues for --warmup-s (1 s), unrecorded.
Phases (--phases, in order; default none,both,key,id):

  none: the producer alone;
  both: --readers (2) reader processes, each with its own kept-alive
        connection, each alternating `GET /v1/keys/big/jobs?limit=1` and
        `GET /v1/jobs/shard-0:9000000000000` (a well-formed id that names
        no job: ids are counted from 1 per shard);
  key:  the readers send only the first of those;
  id:   the readers send only the second;
  health: (not in the default) the readers send only `GET /healthz`,
        which takes no shard lock: a control for what reader loops cost
        the producer in CPU alone on a small machine.

The readers are processes, not threads, so that the producer's latency
does not include waits for the Python interpreter lock; they start before
the phase's clock and stop after it. Reported per phase: the producer's
enqueue count, p50, p99 and max in ms; the readers' request count and
latency p50 / p99 per request kind; the server's VmRSS at the phase's end
and its VmHWM (the high-water mark since it started). Every answer's
status is checked (200 for enqueues and key reads, 404 for the unknown
id); anything else fails the run.

With several --bin, every repeat runs each binary in turn, in the order
given (NAME=PATH names it; the default is $SHARDQ_BIN or
target/release/shardq). --json prints one JSON line per phase on stdout;
otherwise a table. Progress goes to stderr. Loopback only: the server
listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from bench_support import free_port, log, proc_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
BIG_KEY = "big"
UNKNOWN_ID = "shard-0:9000000000000"
KEY_PATH = "/v1/keys/%s/jobs?limit=1" % BIG_KEY
ID_PATH = "/v1/jobs/%s" % UNKNOWN_ID
ENQ_KEYS = 100
PHASES = ("none", "both", "key", "id", "health")






def pct(sorted_ms: List[float], p: float) -> Optional[float]:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_ms:
        return None
    rank = max(1, -(-len(sorted_ms) * p // 100))
    return sorted_ms[int(rank) - 1]


def r3(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)




# ---------------------------------------------------------------- readers


def reader_main(port: int, kinds: List[str], start_at: float, stop_at: float, conn_out) -> None:
    """One reader process: loop the given kinds of read until stop_at."""
    paths = {"key": (KEY_PATH, 200), "id": (ID_PATH, 404), "health": ("/healthz", 200)}
    lat: Dict[str, List[float]] = {k: [] for k in kinds}
    bad: Dict[str, int] = {}
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    while time.time() < start_at:
        time.sleep(0.001)
    i = 0
    while time.time() < stop_at:
        kind = kinds[i % len(kinds)]
        i += 1
        path, want = paths[kind]
        t0 = time.perf_counter()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as e:
            bad["%s:%s" % (kind, type(e).__name__)] = bad.get("%s:%s" % (kind, type(e).__name__), 0) + 1
            conn.close()
            conn = http.client.HTTPConnection(HOST, port, timeout=60)
            continue
        ms = (time.perf_counter() - t0) * 1000
        if resp.status != want:
            k = "%s:%d" % (kind, resp.status)
            bad[k] = bad.get(k, 0) + 1
            continue
        if kind == "key" and len(lat[kind]) == 0:
            jobs = json.loads(body).get("jobs", [])
            if len(jobs) != 1 or jobs[0].get("key") != BIG_KEY:
                bad["key:not one job of big"] = 1
        lat[kind].append(ms)
    conn.close()
    conn_out.send({"lat": lat, "bad": bad})
    conn_out.close()


# ---------------------------------------------------------------- server


class Server:
    def __init__(self, binary: str, data: str, port: int, log_path: str):
        self.binary = binary
        self.port = port
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "serve", "--data", data, "--listen", "%s:%d" % (HOST, port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def get(self, path: str, timeout: float = 30) -> Tuple[int, bytes]:
        c = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def wait_ready(self, limit_s: float = 120) -> None:
        deadline = time.time() + limit_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited with %s" % self.proc.returncode)
            try:
                st, body = self.get("/readyz", timeout=5)
                if st == 200 and json.loads(body).get("ready"):
                    return
            except (OSError, http.client.HTTPException, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError("server not ready within %.0f s" % limit_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def load(binary: str, data: str, big: int, others: int, payload_bytes: int) -> float:
    subprocess.run([binary, "init", "--data", data, "--shards", "1"], check=True,
                   stdout=subprocess.DEVNULL)
    payload = ("p" * payload_bytes).encode()
    t0 = time.time()
    p = subprocess.Popen(
        [binary, "enqueue", "--data", data, "--stdin", "--durability", "none"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    assert p.stdin is not None
    chunk = 10_000
    line = b"big\t" + payload + b"\n"
    for start in range(0, big, chunk):
        p.stdin.write(line * min(chunk, big - start))
    for start in range(0, others, chunk):
        p.stdin.write(b"".join(b"k-%06d\t%s\n" % (i, payload)
                               for i in range(start, min(others, start + chunk))))
    p.stdin.close()
    if p.wait() != 0:
        raise RuntimeError("shardq enqueue --stdin exited with %d" % p.returncode)
    return time.time() - t0


def queued_total(srv: Server) -> Optional[int]:
    st, body = srv.get("/v1/status", timeout=60)
    if st != 200:
        return None
    doc = json.loads(body)
    totals = doc.get("totals", {})
    for name in ("ready", "queued", "pending"):
        if isinstance(totals.get(name), int):
            return int(totals[name]) + int(totals.get("delayed", 0) or 0)
    return None


# ---------------------------------------------------------------- producer


class Producer:
    def __init__(self, port: int):
        self.port = port
        self.conn = http.client.HTTPConnection(HOST, port, timeout=60)
        self.n = 0
        self.payload = "x" * 32

    def one(self) -> float:
        body = json.dumps({"jobs": [{"key": "enq-%d" % (self.n % ENQ_KEYS),
                                     "payload": self.payload}]}).encode()
        self.n += 1
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/jobs", body=body,
                          headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        out = r.read()
        ms = (time.perf_counter() - t0) * 1000
        if r.status != 200:
            raise RuntimeError("enqueue answered %d: %r" % (r.status, out[:200]))
        return ms

    def run_until(self, stop_at: float) -> List[float]:
        lat = []
        while time.time() < stop_at:
            lat.append(self.one())
        return lat

    def close(self) -> None:
        self.conn.close()


def run_phase(srv: Server, prod: Producer, phase: str, seconds: float, readers: int) -> dict:
    kinds = {"none": [], "both": ["key", "id"], "key": ["key"], "id": ["id"],
             "health": ["health"]}[phase]
    procs = []
    pipes = []
    lead = 0.5
    start_at = time.time() + (lead if kinds else 0.0)
    stop_at = start_at + seconds
    if kinds:
        ctx = mp.get_context("fork")
        for r in range(readers):
            a, b = ctx.Pipe(duplex=False)
            # Readers alternate from different ends so both kinds run at once.
            order = kinds if r % 2 == 0 else list(reversed(kinds))
            p = ctx.Process(target=reader_main, args=(srv.port, order, start_at, stop_at, b))
            p.start()
            b.close()
            procs.append(p)
            pipes.append(a)
        # Keep the connection warm until the readers start.
        while time.time() < start_at:
            prod.one()
    lat = sorted(prod.run_until(stop_at))
    rlat: Dict[str, List[float]] = {}
    bad: Dict[str, int] = {}
    for a, p in zip(pipes, procs):
        got = a.recv()
        p.join()
        for k, v in got["lat"].items():
            rlat.setdefault(k, []).extend(v)
        for k, v in got["bad"].items():
            bad[k] = bad.get(k, 0) + v
    if bad:
        raise RuntimeError("readers got unexpected answers: %r" % bad)
    mem = {k: v / 1_000_000 for k, v in proc_memory(srv.proc.pid).items()}
    row = {
        "phase": phase,
        "readers": len(procs),
        "seconds": seconds,
        "enqueues": len(lat),
        "enqueue_p50_ms": r3(pct(lat, 50)),
        "enqueue_p99_ms": r3(pct(lat, 99)),
        "enqueue_max_ms": r3(lat[-1] if lat else None),
        "rss_mb": r3(mem.get("VmRSS")),
        "hwm_mb": r3(mem.get("VmHWM")),
    }
    for k in ("key", "id", "health"):
        v = sorted(rlat.get(k, []))
        row["reads_%s" % k] = len(v)
        row["read_%s_p50_ms" % k] = r3(pct(v, 50))
        row["read_%s_p99_ms" % k] = r3(pct(v, 99))
    return row


def run_one(name: str, binary: str, args, repeat: int) -> List[dict]:
    tmp = tempfile.mkdtemp(prefix="sq-reads-")
    data = os.path.join(tmp, "data")
    srv = None
    rows = []
    try:
        log("[%s run %d] loading %d jobs on %r + %d keys x 1 ..."
            % (name, repeat, args.big_jobs, BIG_KEY, args.other_keys))
        load_s = load(binary, data, args.big_jobs, args.other_keys, args.payload_bytes)
        srv = Server(binary, data, free_port(), os.path.join(tmp, "serve.log"))
        t0 = time.time()
        srv.wait_ready()
        ready_s = time.time() - t0
        total = queued_total(srv)
        want = args.big_jobs + args.other_keys
        if total is not None and total != want:
            raise RuntimeError("status counts %d queued jobs, expected %d" % (total, want))
        log("[%s run %d] loaded in %.1f s, ready in %.1f s, %s jobs queued"
            % (name, repeat, load_s, ready_s, total))
        prod = Producer(srv.port)
        prod.run_until(time.time() + args.warmup_s)
        for phase in args.phases:
            row = run_phase(srv, prod, phase, args.seconds, args.readers)
            row.update({"bench": "serve_reads", "binary": name, "run": repeat,
                        "big_jobs": args.big_jobs, "other_keys": args.other_keys,
                        "load_s": round(load_s, 2), "ready_s": round(ready_s, 2)})
            log("[%s run %d] %-4s enqueues %6d p50 %8.3f p99 %8.3f ms | key reads %5d p50 %s | id reads %5d p50 %s | healthz %5d p50 %s | RSS %s HWM %s MB"
                % (name, repeat, phase, row["enqueues"], row["enqueue_p50_ms"], row["enqueue_p99_ms"],
                   row["reads_key"], row["read_key_p50_ms"], row["reads_id"], row["read_id_p50_ms"],
                   row["reads_health"], row["read_health_p50_ms"], row["rss_mb"], row["hwm_mb"]))
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
        prod.close()
        if srv.proc.poll() is not None:
            raise RuntimeError("server died")
    finally:
        if srv is not None:
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def parse_bins(specs: List[str]) -> List[Tuple[str, str]]:
    if not specs:
        default = os.environ.get("SHARDQ_BIN") or os.path.join(ROOT, "target", "release", "shardq")
        specs = ["current=" + default]
    out = []
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.dirname(os.path.dirname(s))) or s, s
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise SystemExit("not an executable: %s" % path)
        out.append((name, path))
    return out


def table(rows: List[dict]) -> str:
    head = ["binary", "run", "phase", "enqueues", "p50 ms", "p99 ms", "max ms",
            "key reads", "key p50", "id reads", "id p50", "healthz reads", "healthz p50",
            "RSS MB", "HWM MB"]
    lines = [" | ".join(head)]
    for r in rows:
        lines.append(" | ".join(str(x) for x in [
            r["binary"], r["run"], r["phase"], r["enqueues"], r["enqueue_p50_ms"],
            r["enqueue_p99_ms"], r["enqueue_max_ms"], r["reads_key"], r["read_key_p50_ms"],
            r["reads_id"], r["read_id_p50_ms"], r["reads_health"], r["read_health_p50_ms"],
            r["rss_mb"], r["hwm_mb"]]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Enqueue latency of `shardq serve` with and without reader loops on a big shard.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", action="append", default=[], metavar="[NAME=]PATH",
                    help="a shardq binary; repeatable, run in turn each repeat")
    ap.add_argument("--big-jobs", type=int, default=1_000_000, help="jobs on key `big` (1,000,000)")
    ap.add_argument("--other-keys", type=int, default=200_000, help="other keys, one job each (200,000)")
    ap.add_argument("--payload-bytes", type=int, default=32, help="payload size of loaded jobs (32)")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each phase (8)")
    ap.add_argument("--warmup-s", type=float, default=1.0, help="unrecorded enqueues before the first phase (1)")
    ap.add_argument("--readers", type=int, default=2, help="reader processes in the reading phases (2)")
    ap.add_argument("--phases", default="none,both,key,id",
                    help="comma-separated, of none, both, key, id, health (default: none,both,key,id)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every binary (1)")
    ap.add_argument("--json", action="store_true", help="one JSON line per phase on stdout")
    args = ap.parse_args()
    args.phases = [p for p in args.phases.split(",") if p]
    for p in args.phases:
        if p not in PHASES:
            ap.error("unknown phase %r" % p)
    if args.big_jobs < 1 or args.other_keys < 0 or args.readers < 1:
        ap.error("--big-jobs >= 1, --other-keys >= 0, --readers >= 1")
    bins = parse_bins(args.bin)
    rows: List[dict] = []
    for rep in range(1, args.repeat + 1):
        for name, path in bins:
            rows.extend(run_one(name, path, args, rep))
    if not args.json:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
