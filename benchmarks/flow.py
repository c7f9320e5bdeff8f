#!/usr/bin/env python3
"""Flow control measured on the path a user takes: `shardq policy`/`group`,
`shardq work --stdio` processes, real starts (see BENCHMARKS.md).

    python3 benchmarks/flow.py accuracy [--backend embedded|redis] [--seconds 60] [--workers 4]
    python3 benchmarks/flow.py weights  [--backend embedded|redis] [--seconds 20] [--shards 1]
    python3 benchmarks/flow.py noisy    [--backend embedded|redis] [--seconds 30] [--quiet 1000] [--noisy-jobs 1000000] [--noisy-concurrency 64]
    python3 benchmarks/flow.py policies [--jobs 10000] [--keys 1000] [--shards 4] [--repeat 3] [--baseline-bin OLD]

accuracy: a key limited to 50/s and a group limited to 200/s over 64 keys
on 8 shards, run by N worker processes (2 shards each), every job a
handler that records when it started. Reports each limit's measured rate
over the window (after the first 5 s), its error, and the most starts in
any 1 s window against rate + burst.

weights: three backlogged keys of weights 1, 2 and 4 on one shard (with
--shards N, on three different shards of N), one worker with one slot;
reports each key's share of the starts.

noisy: 1,000 quiet keys each enqueueing one job a second, with and without
one noisy key holding a backlog of 1,000,000 jobs at concurrency 64 (its
policy lets 64 of its jobs run at once); reports the quiet keys'
enqueue-to-start p50 and p99 both ways.

policies (Redis only): what the number of policies costs a claim. For
each case a fresh redis-server and deployment, --jobs jobs over --keys
keys (`k-0`, `k-1`, ...), then one timed `shardq work --stdio
--exit-when-idle` (a Python handler) draining them. Cases: no policy; one
prefix policy `k-` at concurrency 2 (every key with jobs at 2, the cost of
running two at once by itself); 1,000 and 10,000 key policies at
concurrency 2 (the first 1,000 name the keys with jobs); 10,000 prefix
policies at concurrency 2 that match no key with jobs. The 10,000 are
written straight into the settings hash as one document (`shardq policy
set` per policy would rewrite the whole document each time), and `shardq
policy show` must read them back. Cases alternate, --repeat rounds (with
--baseline-bin, the other build's run follows each), and each case is
reported as its median jobs/s and its ratio to no policy of the same
build.

Everything runs on loopback in a temporary directory, with the release
binary; one JSON line per result on stdout, a summary on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import PY_HANDLER, RedisServer, binary, emit, init_data, log, sh  # noqa: E402

HANDLER = r'''
import json, sys, time
log = open(sys.argv[1], "a", buffering=1)
for line in sys.stdin:
    job = json.loads(line)
    log.write("%s %d %s\n" % (job["key"], time.time_ns() // 1000000, job.get("payload", "")))
    sys.stdout.write(json.dumps({"receipt": job["receipt"], "ok": True}) + "\n")
    sys.stdout.flush()
'''


def start_workers(data: str, tmp: str, n: int, shards_each: str, concurrency: int) -> List[Tuple[subprocess.Popen, str]]:
    handler = os.path.join(tmp, "handler.py")
    with open(handler, "w") as f:
        f.write(HANDLER)
    out = []
    for i in range(n):
        logf = os.path.join(tmp, f"starts-{i}.log")
        errf = open(os.path.join(tmp, f"worker-{i}.err"), "wb")
        p = subprocess.Popen([binary(), "work", "--data", data, "--max-local-shards", shards_each,
                              "--concurrency", str(concurrency), "--stdio", "--stdio-pipeline", "1",
                              "--", sys.executable, handler, logf], stderr=errf)
        out.append((p, logf))
    return out


def stop_workers(ws: List[Tuple[subprocess.Popen, str]]) -> List[Tuple[str, int, str]]:
    for p, _ in ws:
        p.send_signal(signal.SIGTERM)
    for p, _ in ws:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    starts = []
    for _, logf in ws:
        if not os.path.exists(logf):
            continue
        with open(logf) as f:
            for line in f:
                parts = line.rstrip("\n").split(" ", 2)
                if len(parts) >= 2:
                    starts.append((parts[0], int(parts[1]), parts[2] if len(parts) > 2 else ""))
    return starts


def most_in_window(ts: List[int], window_ms: int) -> Tuple[int, int]:
    """The most starts in any window of `window_ms`, and where that window
    begins (ms after the first start)."""
    ts = sorted(ts)
    best, at, j = 0, 0, 0
    for i in range(len(ts)):
        while ts[i] - ts[j] >= window_ms:
            j += 1
        if i - j + 1 > best:
            best, at = i - j + 1, ts[j] - ts[0]
    return best, at


def enqueue_lines(data: str, lines: List[str]) -> None:
    for i in range(0, len(lines), 200_000):
        sh(binary(), "enqueue", "--data", data, "--durability", "interval", "--stdin",
           stdin="".join(lines[i:i + 200_000]).encode())


def bench_accuracy(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="shardq-bench-flow-") as tmp:
        redis = RedisServer(tmp) if a.backend == "redis" else None
        try:
            data = init_data(tmp, "q", 8, redis.url if redis else None)
            # Every finished job kept, with its start time as the store
            # recorded it (what the bound is checked on).
            sh(binary(), "retention", "set", "--data", data, "--finished-jobs", "100000")
            sh(binary(), "group", "set", "--data", data, "api", "--rate", "200/s")
            sh(binary(), "policy", "set", "--data", data, "--prefix", "grp:", "--group", "api")
            sh(binary(), "policy", "set", "--data", data, "lim:one", "--rate", "50/s")
            horizon = a.seconds + 15
            lines = [f"lim:one\t{i}\n" for i in range(50 * horizon + 100)]
            per_key = (200 * horizon) // 64 + 50
            lines += [f"grp:{k}\t{i}\n" for i in range(per_key) for k in range(64)]
            enqueue_lines(data, lines)
            log(f"accuracy ({a.backend}): {len(lines)} jobs enqueued; {a.workers} workers for {a.seconds + 8} s")
            ws = start_workers(data, tmp, a.workers, "2", 16)
            time.sleep(a.seconds + 8)
            starts = stop_workers(ws)
            recorded: Dict[str, List[int]] = {}
            for key in ["lim:one"] + [f"grp:{k}" for k in range(64)]:
                doc = json.loads(sh(binary(), "jobs", "--data", data, "--key", key, "--recent", "1000", "--json"))
                recorded[key] = [f["attempt_starts_ms"][-1] for f in doc["recent"] if f.get("attempt_starts_ms")]
        finally:
            if redis:
                redis.stop()
    for name, prefix, rate, burst in [("key lim:one at 50/s", "lim:", 50, 50), ("group api at 200/s", "grp:", 200, 200)]:
        ts = sorted(t for k, t, _ in starts if k.startswith(prefix))
        if not ts:
            raise SystemExit(f"no starts of {prefix}: see the worker logs")
        t0 = ts[0] + 5_000
        window = [t for t in ts if t0 <= t < t0 + a.seconds * 1000]
        measured = len(window) / a.seconds
        row = {"bench": "flow-accuracy", "backend": a.backend, "workers": a.workers, "limit": name,
               "rate_limit": rate, "measured_per_s": round(measured, 2),
               "error_pct": round(100 * (measured - rate) / rate, 2), "window_s": a.seconds,
               "bound_1s": rate + burst, "starts": len(ts)}
        # The bound on the start times the store recorded (a handler's own
        # stamp comes later, by its start-up and the pipes, and bunches).
        rec = sorted(t for k, v in recorded.items() if k.startswith(prefix) for t in v)
        row["recorded_starts"] = len(rec)
        row["max_in_1s"], row["max_window_at_ms"] = most_in_window(rec, 1000)
        row["max_in_1s_handler_stamps"], _ = most_in_window(ts, 1000)
        emit(row)
        log(f"  {name}: {row['measured_per_s']}/s over {a.seconds} s ({row['error_pct']:+}%), "
            f"most in any 1 s {row['max_in_1s']} of {len(rec)} recorded starts (bound {rate + burst}; "
            f"{row['max_in_1s_handler_stamps']} by the handlers' stamps)")


def weight_keys(data: str, shards: int) -> Dict[str, str]:
    """A key per weight prefix (w1:, w2:, w4:), each on its own shard when
    there are several (found with `shardq route`)."""
    if shards == 1:
        return {p: p + "a" for p in ("w1:", "w2:", "w4:")}
    cands = [f"{p}{i}" for p in ("w1:", "w2:", "w4:") for i in range(64)]
    routed = dict(line.split("\t") for line in sh(binary(), "route", "--map", os.path.join(data, "shardmap.yaml"),
                                                   *cands).decode().split("\n") if line)
    keys: Dict[str, str] = {}
    for p in ("w1:", "w2:", "w4:"):
        taken = {routed[k] for k in keys.values()}
        keys[p] = next(k for k in cands if k.startswith(p) and routed[k] not in taken)
    log("weights keys: " + ", ".join(f"{k} on {routed[k]}" for k in keys.values()))
    return keys


def bench_weights(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="shardq-bench-weights-") as tmp:
        redis = RedisServer(tmp) if a.backend == "redis" else None
        try:
            data = init_data(tmp, "q", a.shards, redis.url if redis else None)
            for p, w in [("w1:", 1), ("w2:", 2), ("w4:", 4)]:
                sh(binary(), "policy", "set", "--data", data, "--prefix", p, "--weight", str(w))
            keys = weight_keys(data, a.shards)
            n = 3_000 * a.seconds
            enqueue_lines(data, [f"{k}\t{i}\n" for i in range(n) for k in keys.values()])
            ws = start_workers(data, tmp, 1, "all", 1)
            time.sleep(a.seconds)
            starts = stop_workers(ws)
        finally:
            if redis:
                redis.stop()
    total = len(starts)
    share = {k: sum(1 for s in starts if s[0] == k) / total for k in keys.values()}
    want = {keys["w1:"]: 1 / 7, keys["w2:"]: 2 / 7, keys["w4:"]: 4 / 7}
    row = {"bench": "flow-weights", "backend": a.backend, "shards": a.shards, "starts": total,
           **{f"share_{k}": round(v, 4) for k, v in share.items()},
           **{f"error_pct_{k}": round(100 * (share[k] - want[k]) / want[k], 2) for k in share}}
    emit(row)
    log(f"weights 1:2:4 ({a.backend}) over {total} starts: "
        + ", ".join(f"{k} {share[k]:.4f} (want {want[k]:.4f})" for k in share))


def bench_noisy(a: argparse.Namespace) -> None:
    def run(noisy: bool) -> Dict[str, float]:
        with tempfile.TemporaryDirectory(prefix="shardq-bench-noisy-") as tmp:
            redis = RedisServer(tmp) if a.backend == "redis" else None
            try:
                return measure(tmp, noisy, redis.url if redis else None)
            finally:
                if redis:
                    redis.stop()

    def measure(tmp: str, noisy: bool, redis_url: "str | None") -> Dict[str, float]:
        data = init_data(tmp, "q", 4, redis_url)
        if noisy:
            enqueue_lines(data, [f"noisy\t0\n" for _ in range(a.noisy_jobs)])
            sh(binary(), "policy", "set", "--data", data, "noisy",
               "--concurrency", str(a.noisy_concurrency))
        ws = start_workers(data, tmp, 1, "all", 64)
        t_end = time.time() + a.seconds
        while time.time() < t_end:
            # One job per quiet key per second, the enqueue time as payload.
            now = time.time_ns() // 1_000_000
            lines = "".join(f"quiet-{k}\t{now}\n" for k in range(a.quiet)).encode()
            sh(binary(), "enqueue", "--data", data, "--durability", "interval", "--stdin", stdin=lines)
            time.sleep(max(0.0, 1.0 - (time.time_ns() // 1_000_000 - now) / 1000))
        time.sleep(2)
        starts = stop_workers(ws)
        lat = sorted(t - int(p) for k, t, p in starts if k.startswith("quiet-") and p.isdigit())
        pct = lambda q: lat[min(len(lat) - 1, int(q / 100 * len(lat)))]
        return {"p50_ms": pct(50), "p99_ms": pct(99), "quiet_starts": len(lat),
                "noisy_starts": sum(1 for s in starts if s[0] == "noisy")}

    alone = run(False)
    beside = run(True)
    row = {"bench": "flow-noisy", "backend": a.backend, "quiet_keys": a.quiet, "noisy_jobs": a.noisy_jobs,
           "noisy_concurrency": a.noisy_concurrency,
           "p50_ms_alone": alone["p50_ms"], "p99_ms_alone": alone["p99_ms"],
           "p50_ms_beside_noisy": beside["p50_ms"], "p99_ms_beside_noisy": beside["p99_ms"],
           "p99_ratio": round(beside["p99_ms"] / max(alone["p99_ms"], 1), 2),
           "noisy_starts": beside["noisy_starts"], "quiet_starts": beside["quiet_starts"]}
    emit(row)
    log(f"noisy neighbour: quiet p99 {alone['p99_ms']} ms alone, {beside['p99_ms']} ms beside a "
        f"{a.noisy_jobs}-job key ({row['p99_ratio']}x)")


POLICY_CASES = ["none", "prefix-all", "keys-1000", "keys-10000", "prefixes-10000-unmatched"]


def redis_cmd(port: int, *args: str) -> bytes:
    """One command to the redis-server on loopback `port` (RESP by hand, so
    no client package is needed); a bulk or simple reply's bytes."""
    import socket
    msg = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(x.encode()), x.encode()) for x in args)
    with socket.create_connection(("127.0.0.1", port), 10) as c:
        c.sendall(msg)
        buf = b""
        while b"\r\n" not in buf:
            buf += c.recv(65536)
        head, rest = buf.split(b"\r\n", 1)
        if head[:1] == b"$":
            n = int(head[1:])
            if n < 0:
                return b""
            while len(rest) < n + 2:
                rest += c.recv(65536)
            return rest[:n]
        if head[:1] == b"-":
            raise SystemExit(f"redis {args[0]}: {head.decode()}")
        return head[1:]


def policies_once(exe: str, case: str, a: argparse.Namespace) -> Dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="shardq-bench-policies-") as tmp:
        redis = RedisServer(tmp)
        try:
            data = os.path.join(tmp, "q")
            sh(exe, "init", "--data", data, "--shards", str(a.shards), "--redis", redis.url, "--namespace", "q")
            if case != "none":
                # One policy through the CLI gives the stored document's form.
                sh(exe, "policy", "set", "--data", data, "--prefix", "k-", "--concurrency", "2")
            if case in ("keys-1000", "keys-10000", "prefixes-10000-unmatched"):
                field = "sq:{=map:q}:settings"
                doc = json.loads(redis_cmd(redis.port, "HGET", field, "flow"))
                doc["prefixes"] = {}
                if case.startswith("keys-"):
                    doc["keys"] = {f"k-{i}": {"concurrency": 2} for i in range(int(case.split("-")[1]))}
                else:
                    doc["prefixes"] = {f"none-{i}:": {"concurrency": 2} for i in range(10_000)}
                redis_cmd(redis.port, "HSET", field, "flow", json.dumps(doc))
                shown = json.loads(sh(exe, "policy", "show", "--data", data, "--json"))
                n = len(shown.get("keys", {})) + len(shown.get("prefixes", {}))
                if n != (1000 if case == "keys-1000" else 10_000):
                    raise SystemExit(f"{case}: policy show reads back {n} policies")
            lines = "".join(f"k-{i % a.keys}\t{{\"seq\":{i // a.keys}}}\n" for i in range(a.jobs)).encode()
            sh(exe, "enqueue", "--data", data, "--stdin", stdin=lines)
            t0 = time.monotonic()
            sh(exe, "work", "--data", data, "--concurrency", str(a.concurrency), "--max-local-shards", "all",
               "--exit-when-idle", "--stdio", "--", sys.executable, PY_HANDLER)
            dt = time.monotonic() - t0
            totals = json.loads(sh(exe, "status", "--data", data, "--json"))["totals"]
            if totals != {"ready": 0, "delayed": 0, "in_flight": 0, "dead": 0}:
                raise SystemExit(f"{case}: work left jobs behind: {totals}")
            return {"jobs_per_s": a.jobs / dt, "seconds": dt}
        finally:
            redis.stop()


def bench_policies(a: argparse.Namespace) -> None:
    builds = [("this build", binary())]
    if a.baseline_bin:
        builds.append(("baseline", a.baseline_bin))
    runs: Dict[Tuple[str, str], List[float]] = {}
    for rep in range(a.repeat):
        cases = POLICY_CASES if rep % 2 == 0 else list(reversed(POLICY_CASES))
        for case in cases:
            for label, exe in (builds if rep % 2 == 0 else list(reversed(builds))):
                r = policies_once(exe, case, a)
                runs.setdefault((label, case), []).append(r["jobs_per_s"])
                log(f"policies rep {rep} {label} {case}: {r['jobs_per_s']:.0f} jobs/s ({r['seconds']:.2f} s)")
    import statistics
    for label, _ in builds:
        base = statistics.median(runs[(label, "none")])
        for case in POLICY_CASES:
            xs = runs[(label, case)]
            med = statistics.median(xs)
            row = {"bench": "flow-policies", "build": label, "case": case, "jobs": a.jobs, "keys": a.keys,
                   "shards": a.shards, "concurrency": a.concurrency, "jobs_per_s_median": round(med),
                   "jobs_per_s": [round(x) for x in xs], "ratio_to_none": round(med / base, 3)}
            emit(row)
            log(f"  {label} {case}: median {med:.0f} jobs/s ({min(xs):.0f}-{max(xs):.0f}), {med / base:.2f} of none")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--backend", choices=["embedded", "redis"], default="embedded")
    acc.add_argument("--seconds", type=int, default=60)
    acc.add_argument("--workers", type=int, default=4)
    w = sub.add_parser("weights")
    w.add_argument("--backend", choices=["embedded", "redis"], default="embedded")
    w.add_argument("--seconds", type=int, default=20)
    w.add_argument("--shards", type=int, default=1, help="shards of the deployment; the three keys on different ones when > 1")
    n = sub.add_parser("noisy")
    n.add_argument("--backend", choices=["embedded", "redis"], default="embedded")
    n.add_argument("--seconds", type=int, default=30)
    n.add_argument("--quiet", type=int, default=1000)
    n.add_argument("--noisy-jobs", type=int, default=1_000_000)
    n.add_argument("--noisy-concurrency", type=int, default=64, help="the noisy key's runs at once (its policy)")
    pol = sub.add_parser("policies")
    pol.add_argument("--jobs", type=int, default=10_000)
    pol.add_argument("--keys", type=int, default=1000)
    pol.add_argument("--shards", type=int, default=4)
    pol.add_argument("--concurrency", type=int, default=8, help="the worker's --concurrency")
    pol.add_argument("--repeat", type=int, default=3)
    pol.add_argument("--baseline-bin", default=None, help="another shardq binary to run the same cases on")
    a = ap.parse_args()
    {"accuracy": bench_accuracy, "weights": bench_weights, "noisy": bench_noisy,
     "policies": bench_policies}[a.cmd](a)


if __name__ == "__main__":
    main()
