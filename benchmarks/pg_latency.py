#!/usr/bin/env python3
"""The Postgres outbox's commit-to-start latency against `shardq enqueue
--stdin` of the same jobs, and the application's cost of calling
`shardq.enqueue` in its transaction. See docs/postgres.md for the outbox;
the servers and helpers are those of benchmarks/pg_relay.py.

    python3 benchmarks/pg_latency.py [--bin PATH] [--pg-bin DIR] [--rates 1000,5000]
        [--seconds 60] [--warmup-s 10] [--rows-per-tx 10] [--producers 4] [--keys 1000]
        [--app-seconds 20] [--app-clients 4] [--app-repeat 2] [--app-notify]
        [--wake notify|poll] [--relay-poll-ms MS]
        [--skip-latency] [--skip-app-cost] [--pg-set NAME=VALUE] [--json]

One PostgreSQL 15 server (pg_relay.py's: initdb into a temporary directory,
loopback only, fsync and synchronous_commit on) for the whole run.

Part 1 (latency). Per rate (jobs/s, all producers together), two modes in
turn (the order reversed on the second rate), each on a fresh embedded
deployment (`shardq init --shards 4`) with one worker
`shardq work --max-local-shards all --stdio -- python3 HANDLER` (one
handler process, 4 jobs written ahead); the handler logs, per job, its
payload and the wall-clock time (µs) it read the job's line, and acks it.

  - outbox: `shardq pg install` (the schema dropped first) and one
    `shardq pg relay` (defaults: `--poll-ms` 1000, woken by NOTIFY). Each of
    --producers processes has its own connection and commits, on a fixed
    schedule (open loop, rate / producers / rows-per-tx transactions/s,
    the producers' schedules staggered), transactions of
    `SELECT shardq.enqueue(k, p) FROM unnest(keys, ids)` (--rows-per-tx
    rows, keys random of --keys, sorted; payload = a unique id), and notes
    the wall clock right after COMMIT returned.
  - enqueue: the same producers, each with its own `shardq enqueue --data D
    --stdin` process: it writes the transaction's rows as KEY<TAB>ID lines
    and notes the wall clock once the process has printed all of them
    (printed = stored and synced).

The producers are processes, not threads: in one interpreter they noted
commits late and fell behind. A producer behind its schedule sends the
transactions due at once, and stops at the end of the window all the same
(the achieved rate says what was sent); the schedule lag (send time -
scheduled time) is reported.

Latency = handler start - commit (enqueue) returned, over the rows produced
in --seconds after a --warmup-s warm-up (warm-up rows are only checked).
Also reported: "from send" = handler start - transaction (enqueue) begun,
and "call" = commit (enqueue) returned - begun. A latency can be negative:
the worker can start a job before the call that stored it has returned
(an `enqueue --stdin` batch is stored shard by shard, each visible before
the batch's last fsync; a commit is visible before the client hears of it);
how many are is reported. After the producers stop, the run waits until
every row has started, then checks that every produced row started exactly
once and nothing else did, that the outbox is empty (outbox), and that the
worker and relay reported no failure. Reported: count, achieved rate,
p50/p95/p99/p99.9/max/min in ms, the load averages at start and end.

Part 2 (app cost). A table `app_orders` (bigserial id, text key, text
note, timestamptz); two pgbench scripts, each a transaction
(BEGIN ... END) inserting one row with a random key of 1,000, the second
also calling `shardq.enqueue(key, 'order')` (with --app-notify, a third
calling only `pg_notify` on the outbox's channel, which enqueue does);
`pgbench -n -c C -j 2 -T S` per script, alternated --app-repeat times
(order reversed on odd repeats), with one `shardq pg relay` into a fresh
deployment running throughout (the outbox drained as in production).
Checked: the deployment holds one job per committed insert+enqueue
transaction, app_orders one row per committed transaction, no failures.
Reported: transactions/s and average latency of each run, medians, and
the ratios.

Every server started is stopped and the temporary directory removed. A
markdown report goes to stdout; --json prints the raw figures instead.
Needs: the PostgreSQL server binaries and pgbench (--pg-bin, default
`pg_config --bindir`), python psycopg 3. Run as root, the Postgres server
runs as user postgres.
"""

import argparse
import collections
import json
import multiprocessing as mp
import os
import pickle
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_support import HOST, log  # noqa: E402
from pg_relay import ROOT, Postgres, sh, stop_proc, wait_for  # noqa: E402

import psycopg  # noqa: E402

HANDLER = r'''
import json, os, sys, time
log = open(os.environ["LAT_LOG"] + "." + os.environ.get("SHARDQ_SLOT", "0"), "a")
out = sys.stdout
for line in sys.stdin:
    t = time.time_ns() // 1000
    job = json.loads(line)
    log.write(job.get("payload", "") + " " + str(t) + "\n")
    log.flush()
    out.write(json.dumps({"receipt": job["receipt"], "ok": True}) + "\n")
    out.flush()
'''


def unusual(text: str) -> List[str]:
    """The lines of the worker's and relay's output that say something
    failed: not the worker's shard claims, drain and final count with
    nothing retried or dead, nor the relay's --json "active" event and
    final report."""
    ok = ("shardq: claimed shard-", "shardq: draining", '{"event":"active"}', '{"relayed":')
    clean = re.compile(r"shardq: done: \d+ acked, 0 retried, 0 dead, 0 stopped at the drain timeout, 0 timed out, "
                       r"0 stale results refused$")
    return [x for x in text.splitlines() if x.strip() and not x.startswith(ok) and not clean.match(x)]


def pct(xs: List[float], p: float) -> float:
    """Nearest-rank percentile of sorted xs."""
    if not xs:
        return float("nan")
    i = max(0, min(len(xs) - 1, int(-(-p * len(xs) // 100)) - 1))
    return xs[i]


def produce(i: int, cfg: Dict, ready, go, t0, out: str) -> None:
    """Producer i of Part 1, in a process of its own: sets up its connection
    (outbox) or its `shardq enqueue --stdin` process (enqueue), says it is
    ready, waits for the common start time t0, then sends a transaction of
    --rows-per-tx rows every producers * rows-per-tx / rate seconds, at
    t0 + period * (i / producers + n), whatever the previous sends took (a
    send that ends late is followed at once by the next due one). Each row's
    time is the wall clock (µs) right after the transaction's COMMIT
    returned (outbox) or its last line was printed (enqueue), and the wall
    clock right before its first statement (or line) was sent; a transaction
    sent at --warmup-s or later is measured, and none is sent once
    --warmup-s + --seconds have passed (a producer behind its schedule
    sends fewer: the achieved rate says so). Pickles
    {commits: id -> µs, sent: id -> µs, phase: id -> measured, errors,
    lag_ms} to `out`."""
    mode, per_tx, P = cfg["mode"], cfg["rows_per_tx"], cfg["producers"]
    rng = random.Random(1000 + i)
    period = per_tx * P / cfg["rate"]
    commits: Dict[int, int] = {}
    sent: Dict[int, int] = {}
    phase: Dict[int, bool] = {}
    errors: List[str] = []
    lag_ms: List[float] = []
    conn = proc = None
    said_ready = False
    try:
        if mode == "outbox":
            conn = psycopg.connect(cfg["url"])

            def send(keys: List[str], ids: List[str]) -> None:
                with conn.transaction():
                    conn.execute("SELECT shardq.enqueue(k, p) FROM unnest(%s::text[], %s::text[]) AS t(k, p)",
                                 (keys, ids))
        else:
            proc = subprocess.Popen([cfg["exe"], "enqueue", "--data", cfg["data"], "--stdin"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

            def send(keys: List[str], ids: List[str]) -> None:
                proc.stdin.write("".join(f"{k}\t{x}\n" for k, x in zip(keys, ids)).encode())
                proc.stdin.flush()
                for _ in ids:
                    if not proc.stdout.readline():
                        raise RuntimeError(f"enqueue --stdin ended: {proc.stderr.read().decode()[-500:]}")
        ready.put(i)
        said_ready = True
        go.wait(120)
        t_start = t0.value
        t_measure = t_start + cfg["warmup_s"]
        t_end = t_measure + cfg["seconds"]
        seq = 0
        nxt = t_start + period * i / P
        while True:
            d = nxt - time.monotonic()
            if d > 0:
                time.sleep(d)
            now = time.monotonic()
            if now >= t_end:
                break
            measured = now >= t_measure
            keys = [f"key-{k}" for k in sorted(rng.randrange(cfg["keys"]) for _ in range(per_tx))]
            ids = [i * 1_000_000_000 + seq + j for j in range(per_tx)]
            seq += per_tx
            try:
                t_sent = time.time_ns() // 1000
                send(keys, [str(x) for x in ids])
                t = time.time_ns() // 1000
                for x in ids:
                    commits[x] = t
                    sent[x] = t_sent
                    phase[x] = measured
                if measured:
                    lag_ms.append((now - nxt) * 1000)
            except Exception as e:  # counted, not fatal
                errors.append(f"producer {i}: {str(e)[:300]}")
                if mode != "outbox":
                    break
            nxt += period
    except Exception as e:
        errors.append(f"producer {i}: {e!r}"[:400])
        if not said_ready:
            ready.put(i)
    finally:
        if conn is not None:
            conn.close()
        if proc is not None:
            proc.stdin.close()
            proc.stdout.read()
            if proc.wait(60) != 0:
                errors.append(f"producer {i}: enqueue --stdin exited {proc.returncode}: "
                              f"{proc.stderr.read().decode()[-300:]}")
        with open(out, "wb") as f:
            pickle.dump({"commits": commits, "sent": sent, "phase": phase, "errors": errors, "lag_ms": lag_ms}, f)


class Latency:
    def __init__(self, a: argparse.Namespace, tmp: str, pg: Postgres) -> None:
        self.a, self.tmp, self.pg = a, tmp, pg
        self.exe = a.bin
        self.install_args, self.relay_args = install_args(a), relay_args(a)
        self.n = 0
        self.handler = os.path.join(tmp, "handler.py")
        with open(self.handler, "w") as f:
            f.write(HANDLER)

    def fresh(self) -> str:
        self.n += 1
        data = os.path.join(self.tmp, f"d{self.n}")
        sh(self.exe, "init", "--data", data, "--shards", "4")
        return data

    def run(self, mode: str, rate: int) -> Dict:
        data = self.fresh()
        hlog = os.path.join(self.tmp, f"h{self.n}.log")
        relay = None
        errf = open(os.path.join(self.tmp, f"errors{self.n}.log"), "wb")
        if mode == "outbox":
            self.pg.q("DROP SCHEMA IF EXISTS shardq CASCADE")
            sh(self.exe, "pg", "install", "--data", data, "--postgres", self.pg.url, *self.install_args)
            relay = subprocess.Popen([self.exe, "pg", "relay", "--data", data, "--postgres", self.pg.url, "--json",
                                      *self.relay_args], stdout=errf, stderr=errf)
        worker = subprocess.Popen([self.exe, "work", "--data", data, "--max-local-shards", "all", "--stdio",
                                   "--", sys.executable, self.handler],
                                  env=dict(os.environ, LAT_LOG=hlog), stdout=errf, stderr=errf)
        try:
            return self.measure(mode, rate, data, hlog, worker, relay, errf)
        finally:
            stop_proc(worker)
            if relay:
                stop_proc(relay)
            errf.close()
            shutil.rmtree(data, ignore_errors=True)

    def measure(self, mode: str, rate: int, data: str, hlog: str, worker: subprocess.Popen,
                relay, errf) -> Dict:
        a = self.a
        # The producers are processes, not threads: threads share one
        # interpreter lock, which let a producer note its commit tens of ms
        # late (handler starts before the commit returned) and fall behind
        # its schedule. Each sets up, says it is ready, and starts on the
        # common schedule.
        ctx = mp.get_context("spawn")
        ready, go = ctx.Queue(), ctx.Event()
        t0 = ctx.Value("d", 0.0)
        cfg = {"mode": mode, "exe": self.exe, "data": data, "url": self.pg.url, "rate": rate,
               "producers": a.producers, "rows_per_tx": a.rows_per_tx, "keys": a.keys,
               "warmup_s": a.warmup_s, "seconds": a.seconds}
        outs = [os.path.join(self.tmp, f"p{self.n}.{i}.pickle") for i in range(a.producers)]
        ps = [ctx.Process(target=produce, args=(i, cfg, ready, go, t0, outs[i]), daemon=True)
              for i in range(a.producers)]
        for p in ps:
            p.start()
        for _ in ps:
            ready.get(timeout=120)
        load_before = os.getloadavg()
        t0.value = time.monotonic() + 0.2
        go.set()
        for p in ps:
            p.join(a.warmup_s + a.seconds + 120)
            if p.exitcode is None:
                p.kill()
                p.join()
        load_end = os.getloadavg()
        commits: Dict[int, int] = {}  # id -> µs the commit (enqueue) returned
        sent: Dict[int, int] = {}  # id -> µs its transaction (enqueue) was begun
        phase: Dict[int, bool] = {}  # id -> measured (not warm-up)
        errors: List[str] = []
        lags: List[float] = []  # ms each measured transaction was sent behind its schedule
        for i, out in enumerate(outs):
            if not os.path.exists(out):
                errors.append(f"producer {i} left no result (exit code {ps[i].exitcode})")
                continue
            with open(out, "rb") as f:
                res = pickle.load(f)
            os.remove(out)
            commits.update(res["commits"])
            sent.update(res["sent"])
            phase.update(res["phase"])
            errors += res["errors"]
            lags += res["lag_ms"]
        lags.sort()
        total = len(commits)
        prefix = os.path.basename(hlog) + "."

        def logs() -> List[str]:
            return [os.path.join(self.tmp, f) for f in os.listdir(self.tmp) if f.startswith(prefix)]

        def logged() -> int:
            n = 0
            for f in logs():
                with open(f) as fh:
                    n += sum(1 for _ in fh)
            return n
        t_wait = time.monotonic()
        try:
            wait_for("every job to start", lambda: logged() >= total, 120)
        except SystemExit as e:
            errors.append(str(e))
        drain_s = time.monotonic() - t_wait
        time.sleep(1)  # a duplicate start would show up here
        stop_proc(worker)
        outbox_left = None
        if relay:
            stop_proc(relay)
            outbox_left = self.pg.q("SELECT count(*) FROM shardq.outbox")[0][0]
        errf.flush()
        with open(errf.name, "rb") as f:
            noise = unusual(f.read().decode(errors="replace"))
        starts: Dict[int, int] = {}
        seen: collections.Counter = collections.Counter()
        unknown = 0
        for f in logs():
            with open(f) as fh:
                for line in fh:
                    pid, t = line.split()
                    x = int(pid)
                    seen[x] += 1
                    if x not in commits:
                        unknown += 1
                    starts.setdefault(x, int(t))
            os.remove(f)
        missing = sum(1 for x in commits if x not in seen)
        dups = sum(1 for c in seen.values() if c > 1)
        lat = sorted((starts[x] - commits[x]) / 1000 for x in commits if phase[x] and x in starts)
        from_sent = sorted((starts[x] - sent[x]) / 1000 for x in commits if phase[x] and x in starts)
        call = sorted((commits[x] - sent[x]) / 1000 for x in commits if phase[x])
        measured = sum(1 for x in commits if phase[x])
        checked = (missing == 0 and dups == 0 and unknown == 0 and not errors and outbox_left in (None, 0)
                   and not noise)
        r = {"mode": mode, "rate": rate, "measured": measured, "achieved_rate": round(measured / a.seconds),
             "total_with_warmup": total, "p50_ms": round(pct(lat, 50), 2), "p95_ms": round(pct(lat, 95), 2),
             "p99_ms": round(pct(lat, 99), 2), "p999_ms": round(pct(lat, 99.9), 2),
             "max_ms": round(lat[-1], 2) if lat else None, "min_ms": round(lat[0], 2) if lat else None,
             "mean_ms": round(statistics.mean(lat), 2) if lat else None,
             "negative": sum(1 for x in lat if x < 0),
             "from_send_p50_ms": round(pct(from_sent, 50), 2), "from_send_p99_ms": round(pct(from_sent, 99), 2),
             "call_p50_ms": round(pct(call, 50), 2), "call_p99_ms": round(pct(call, 99), 2),
             "sched_lag_p99_ms": round(pct(lags, 99), 2), "sched_lag_max_ms": round(lags[-1], 2) if lags else None,
             "drain_s": round(drain_s, 2),
             "missing": missing, "duplicates": dups, "unknown": unknown, "outbox_left": outbox_left,
             "producer_errors": len(errors), "first_errors": errors[:3], "stderr_lines": noise[:5],
             "checked": checked, "load_before": [round(x, 2) for x in load_before],
             "load_end": [round(x, 2) for x in load_end]}
        log(f"{mode} at {rate}/s: {measured:,} rows ({r['achieved_rate']:,}/s), p50 {r['p50_ms']} p95 {r['p95_ms']} "
            f"p99 {r['p99_ms']} max {r['max_ms']} min {r['min_ms']} ms ({r['negative']} < 0), schedule lag p99 "
            f"{r['sched_lag_p99_ms']} max {r['sched_lag_max_ms']} ms, checked {checked}, load {r['load_before']} "
            f"-> {r['load_end']}{', errors: ' + str(errors[:3]) if errors else ''}"
            f"{', stderr: ' + str(noise[:3]) if noise else ''}")
        return r

def latency(b: Latency) -> List[Dict]:
    out = []
    for n, rate in enumerate(b.a.rates):
        modes = ["outbox", "enqueue"] if n % 2 == 0 else ["enqueue", "outbox"]
        for m in modes:
            out.append(b.run(m, rate))
    return out


INSERT = """\\set k random(1, 1000)
BEGIN;
INSERT INTO app_orders (k, note) VALUES ('key-' || :k, 'order');
END;
"""
INSERT_ENQUEUE = """\\set k random(1, 1000)
BEGIN;
INSERT INTO app_orders (k, note) VALUES ('key-' || :k, 'order');
SELECT shardq.enqueue('key-' || :k, 'order'::text);
END;
"""
INSERT_NOTIFY = """\\set k random(1, 1000)
BEGIN;
INSERT INTO app_orders (k, note) VALUES ('key-' || :k, 'order');
SELECT pg_notify('shardq_outbox', '');
END;
"""


def install_args(a: argparse.Namespace) -> List[str]:
    """`pg install`'s wake option."""
    return ["--wake", a.wake]


def relay_args(a: argparse.Namespace) -> List[str]:
    """`pg relay`'s poll interval, when given."""
    return ["--poll-ms", str(a.relay_poll_ms)] if a.relay_poll_ms else []


def app_cost(a: argparse.Namespace, tmp: str, pg: Postgres, b: Latency) -> Dict:
    data = b.fresh()
    pg.q("DROP SCHEMA IF EXISTS shardq CASCADE")
    sh(a.bin, "pg", "install", "--data", data, "--postgres", pg.url, *install_args(a))
    pg.q("DROP TABLE IF EXISTS app_orders")
    pg.q("CREATE TABLE app_orders (id bigserial PRIMARY KEY, k text NOT NULL, note text, "
         "created timestamptz NOT NULL DEFAULT now())")
    scripts = {}
    texts = [("insert", INSERT), ("insert+enqueue", INSERT_ENQUEUE)]
    if a.app_notify:
        texts.append(("insert+notify", INSERT_NOTIFY))
    for name, text in texts:
        path = os.path.join(tmp, name.replace("+", "_") + ".sql")
        with open(path, "w") as f:
            f.write(text)
        scripts[name] = path
    errf = open(os.path.join(tmp, "relay-app.log"), "wb")
    relay = subprocess.Popen([a.bin, "pg", "relay", "--data", data, "--postgres", pg.url, "--json",
                              *relay_args(a)], stdout=errf, stderr=errf)
    runs = []
    try:
        for rep in range(a.app_repeat):
            names = list(scripts) if rep % 2 == 0 else list(reversed(list(scripts)))
            for name in names:
                pg.q("CHECKPOINT")
                up = [round(x, 2) for x in os.getloadavg()]
                p = subprocess.run([os.path.join(a.pg_bin, "pgbench"), "-n", "-h", HOST, "-p", str(pg.port),
                                    "-U", "postgres", "-c", str(a.app_clients), "-j", "2", "-T",
                                    str(a.app_seconds), "-f", scripts[name], "postgres"],
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    raise SystemExit(f"pgbench exited {p.returncode}: {p.stderr[-2000:]}")
                tps = float(re.search(r"tps = ([0-9.]+) \(without initial", p.stdout).group(1))
                lat = float(re.search(r"latency average = ([0-9.]+) ms", p.stdout).group(1))
                failed = re.search(r"number of failed transactions: (\d+)", p.stdout)
                done = int(re.search(r"number of transactions actually processed: (\d+)", p.stdout).group(1))
                r = {"repeat": rep, "script": name, "tps": round(tps), "latency_avg_ms": lat, "transactions": done,
                     "failed": int(failed.group(1)) if failed else 0, "load_before": up}
                runs.append(r)
                log(f"app cost {name}: {r['tps']:,} tx/s, {lat} ms avg, failed {r['failed']}, load before {up}")
        wait_for("the outbox to drain", lambda: pg.q("SELECT count(*) FROM shardq.outbox")[0][0] == 0, 120)
        enq = pg.q("SELECT count(*) FROM app_orders")[0][0]
    finally:
        stop_proc(relay)
        errf.close()
    with open(errf.name) as f:
        noise = unusual(f.read())
    stored = json.loads(sh(a.bin, "status", "--data", data, "--json"))["totals"]["ready"]
    shutil.rmtree(data, ignore_errors=True)
    summary = {}
    for name in scripts:
        xs = [r for r in runs if r["script"] == name]
        summary[name] = {"tps_median": round(statistics.median(r["tps"] for r in xs)),
                         "latency_median_ms": round(statistics.median(r["latency_avg_ms"] for r in xs), 3)}
    summary["ratio_tps"] = round(summary["insert+enqueue"]["tps_median"] / summary["insert"]["tps_median"], 3)
    summary["ratio_latency"] = round(summary["insert+enqueue"]["latency_median_ms"] /
                                     summary["insert"]["latency_median_ms"], 3)
    if a.app_notify:
        summary["ratio_tps_notify"] = round(summary["insert+notify"]["tps_median"] / summary["insert"]["tps_median"], 3)
    enqueued = sum(r["transactions"] for r in runs if r["script"] == "insert+enqueue")
    rows = sum(r["transactions"] for r in runs)
    return {"runs": runs, "summary": summary, "app_rows": enq, "jobs_stored": stored,
            "clients": a.app_clients, "seconds": a.app_seconds, "relay_stderr": noise[:5],
            "checked": stored == enqueued and enq == rows and all(r["failed"] == 0 for r in runs) and not noise}


def report(res: Dict) -> str:
    wake = res["args"]["wake"]
    poll = res["args"]["relay_poll_ms"] or "the relay's default"
    out = [f"PostgreSQL {res['pg']['server_version']}, fsync {res['pg']['fsync']}, synchronous_commit "
           f"{res['pg']['synchronous_commit']}; nproc {res['nproc']}; pg install --wake {wake}, "
           f"relay --poll-ms {poll}", ""]

    def load(xs: List[float]) -> str:
        return " / ".join(str(x) for x in xs)
    if "latency" in res:
        out += ["Latency: handler start - commit (enqueue) returned; \"from send\": handler start - transaction "
                "(enqueue) begun; \"call\": commit (enqueue) returned - begun.", "",
                "| mode | target rows/s | measured rows | achieved rows/s | p50 ms | p95 ms | p99 ms | p99.9 ms | "
                "max ms | min ms (rows < 0) | from send p50 / p99 ms | call p50 / p99 ms | schedule lag p99 / max ms | "
                "checked (missing/dup/unknown) | load 1/5/15 at start | at end |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["latency"]:
            out.append(f"| {r['mode']} | {r['rate']:,} | {r['measured']:,} | {r['achieved_rate']:,} | {r['p50_ms']} | "
                       f"{r['p95_ms']} | {r['p99_ms']} | {r['p999_ms']} | {r['max_ms']} | {r['min_ms']} "
                       f"({r['negative']:,}) | {r['from_send_p50_ms']} / {r['from_send_p99_ms']} | {r['call_p50_ms']} / "
                       f"{r['call_p99_ms']} | {r['sched_lag_p99_ms']} / {r['sched_lag_max_ms']} | {r['checked']} "
                       f"({r['missing']}/{r['duplicates']}/{r['unknown']}) | {load(r['load_before'])} | "
                       f"{load(r['load_end'])} |")
        out.append("")
        for r in res["latency"]:
            noise = unusual("\n".join(r["stderr_lines"]))
            if r["first_errors"] or noise:
                out.append(f"- {r['mode']} at {r['rate']:,}/s: errors {r['first_errors']}, stderr {noise}")
    if "app_cost" in res:
        c = res["app_cost"]
        out += [f"App cost: pgbench -c {c['clients']} -j 2 -T {c['seconds']}; app rows {c['app_rows']:,}, "
                f"jobs stored by the relay {c['jobs_stored']:,}; checked {c['checked']} (jobs = committed "
                f"insert+enqueue transactions, rows = all committed transactions)", "",
                "| repeat | script | tx/s | latency avg ms | failed | load 1/5/15 before |",
                "| --- | --- | --- | --- | --- | --- |"]
        for r in c["runs"]:
            out.append(f"| {r['repeat']} | {r['script']} | {r['tps']:,} | {r['latency_avg_ms']} | {r['failed']} | "
                       f"{load(r['load_before'])} |")
        s = c["summary"]
        out += ["", f"Medians: insert {s['insert']['tps_median']:,} tx/s ({s['insert']['latency_median_ms']} ms), "
                f"insert+enqueue {s['insert+enqueue']['tps_median']:,} tx/s ({s['insert+enqueue']['latency_median_ms']} ms); "
                f"ratio tx/s {s['ratio_tps']}, latency {s['ratio_latency']}"]
        if "insert+notify" in s:
            out[-1] += (f"; insert+notify {s['insert+notify']['tps_median']:,} tx/s "
                        f"({s['insert+notify']['latency_median_ms']} ms), ratio tx/s {s['ratio_tps_notify']}")
        if c["relay_stderr"]:
            out.append(f"Relay stderr: {c['relay_stderr']}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.environ.get("SHARDQ_BIN") or os.path.join(ROOT, "target", "release", "shardq"))
    p.add_argument("--pg-bin", default=os.environ.get("PG_BIN"))
    p.add_argument("--pg-set", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--rates", default="1000,5000")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--warmup-s", type=float, default=10)
    p.add_argument("--rows-per-tx", type=int, default=10)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--app-seconds", type=int, default=20)
    p.add_argument("--app-clients", type=int, default=4)
    p.add_argument("--app-repeat", type=int, default=2)
    p.add_argument("--app-notify", action="store_true",
                   help="also a script that inserts the row and calls pg_notify on the outbox's channel")
    p.add_argument("--wake", choices=["notify", "poll"], default="notify",
                   help="pg install --wake: whether enqueue notifies the relay")
    p.add_argument("--relay-poll-ms", type=int, default=0,
                   help="pg relay --poll-ms (default: the relay's own)")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-app-cost", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    a.rates = [int(x) for x in a.rates.split(",") if x]
    if not a.pg_bin:
        a.pg_bin = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                                  check=True).stdout.strip()
    if not os.path.exists(a.bin):
        raise SystemExit(f"{a.bin}: no such binary (cargo build --release -p shardq)")
    tmp = tempfile.mkdtemp(prefix="pg-latency-")
    pg = None
    try:
        pg = Postgres(tmp, a.pg_bin, a.pg_set)
        b = Latency(a, tmp, pg)
        res: Dict = {"pg": pg.settings(), "nproc": os.cpu_count(), "args": {
            k: v for k, v in vars(a).items() if k not in ("bin", "pg_bin")}}
        log(f"postgres {res['pg']}")
        if not a.skip_latency:
            res["latency"] = latency(b)
        if not a.skip_app_cost:
            res["app_cost"] = app_cost(a, tmp, pg, b)
    finally:
        if pg:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(res, indent=1) if a.json else report(res))


if __name__ == "__main__":
    main()
