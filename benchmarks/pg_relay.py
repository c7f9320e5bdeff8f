#!/usr/bin/env python3
"""The Postgres outbox relay's throughput, against `shardq enqueue --stdin`
of the same jobs, and (with --soak-s) a soak of one relay behind a steady
producer. See docs/postgres.md for the outbox.

    python3 benchmarks/pg_relay.py [--bin PATH] [--jobs N] [--keys K]
        [--payload-bytes B] [--batches 2000,5000,10000] [--backends embedded,redis]
        [--repeat R] [--load-txns T] [--soak-s S] [--soak-rate R]
        [--soak-rows-per-tx N] [--soak-only] [--pg-set NAME=VALUE] [--json]

Part 1 (throughput). One PostgreSQL 15 server (initdb into a temporary
directory, loopback only, fsync and synchronous_commit left on; other
server settings with --pg-set) for the whole run. Per backend (embedded, 4 shards; Redis, 4 shards on one
redis-server started on a free loopback port, fresh per run) and per
repeat, the configurations run in turn, the order reversed on odd repeats:

  - enqueue: a fresh deployment (`shardq init --shards 4`), N lines
    `key-(i % K)<TAB>x * B` through one `shardq enqueue --data D --stdin`,
    timed wall clock.
  - relay --batch X: the outbox schema dropped and `shardq pg install`ed
    on a fresh deployment; N rows loaded with
    `SELECT count(shardq.enqueue('key-' || (i % K), repeat('x', B)))
    FROM generate_series(...)` in T transactions (timed: the producer side
    inside Postgres); CHECKPOINT; then `shardq pg relay --exit-when-empty
    --batch X --json` timed from start to exit.

Every run is checked: the deployment holds N ready jobs and the outbox is
empty. jobs/s = N / seconds; each row names the 1-minute load average
before it. Summary: per configuration the median and range of jobs/s, and
relay / enqueue of the medians (and per repeat).

Part 2 (--soak-s S). A fresh embedded deployment and outbox; one relay
(`shardq pg relay`, no --exit-when-empty) runs while a producer thread
commits --soak-rate rows/s (2,000) in transactions of --soak-rows-per-tx
rows (10, random keys of K, sorted), paced to a schedule. Every 30 s:
`shardq pg status --json` (depth, oldest_age_ms, dead_tuples), the table's
pg_total_relation_size and the autovacuum / vacuum counts of
pg_stat_user_tables. At the end the producer stops, the relay drains the
outbox and stops, and the deployment must hold every committed row.

Every server started is stopped and the temporary directory removed. A
markdown report goes to stdout; --json prints the raw figures instead.
Needs: the PostgreSQL server binaries (--pg-bin, default `pg_config --bindir`), redis-server on PATH,
python psycopg 3. Run as root, the Postgres server runs as user postgres.
"""

import argparse
import json
import os
import pwd
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_support import HOST, free_port, log  # noqa: E402

import psycopg  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(*args: str, stdin: Optional[bytes] = None) -> bytes:
    out = subprocess.run(list(args), input=stdin, capture_output=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {out.returncode}: {out.stderr.decode()[-2000:]}")
    return out.stdout


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def wait_for(what: str, cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if cond():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def stop_proc(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Postgres:
    """A PostgreSQL server of our own on a free loopback port."""

    def __init__(self, tmp: str, pg_bin: str, sets: List[str]) -> None:
        self.dir = os.path.join(tmp, "pg")
        os.makedirs(self.dir)
        user = None
        if os.geteuid() == 0:
            user = "postgres"
            pw = pwd.getpwnam(user)
            os.chmod(tmp, 0o755)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.port = free_port()
        self.url = f"postgres://postgres@{HOST}:{self.port}/postgres"
        subprocess.run([os.path.join(pg_bin, "initdb"), "-D", self.dir, "-A", "trust", "-U", "postgres",
                        "--locale=C", "-E", "UTF8"], check=True, capture_output=True, user=user)
        self.logf = open(os.path.join(tmp, "pg.log"), "ab")
        self.proc = subprocess.Popen(
            [os.path.join(pg_bin, "postgres"), "-D", self.dir, "-p", str(self.port), "-k", self.dir,
             "-c", f"listen_addresses={HOST}"] + [x for kv in sets for x in ("-c", kv)],
            stdout=self.logf, stderr=subprocess.STDOUT, user=user)
        wait_for("postgres", lambda: psycopg.connect(self.url).close() is None, 30)
        self.conn = psycopg.connect(self.url, autocommit=True)

    def q(self, sql: str, *args):
        cur = self.conn.execute(sql, args or None)
        return cur.fetchall() if cur.description else []

    def settings(self) -> Dict[str, str]:
        names = ["server_version", "fsync", "synchronous_commit", "shared_buffers", "max_wal_size",
                 "autovacuum_naptime", "autovacuum_vacuum_cost_delay", "autovacuum_vacuum_cost_limit"]
        return {n: self.q(f"SHOW {n}")[0][0] for n in names}

    def stop(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass
        stop_proc(self.proc, signal.SIGINT)  # fast shutdown
        self.logf.close()


class Redis:
    def __init__(self, dir: str) -> None:
        self.port = free_port()
        self.url = f"redis://{HOST}:{self.port}/0"
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not on PATH")
        os.makedirs(dir, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", dir, "--maxmemory-policy", "noeviction", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            with socket.create_connection((HOST, self.port), 0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        wait_for("redis-server", up, 20)

    def stop(self) -> None:
        stop_proc(self.proc)


class Bench:
    def __init__(self, a: argparse.Namespace, tmp: str, pg: Postgres) -> None:
        self.a, self.tmp, self.pg = a, tmp, pg
        self.exe = a.bin
        self.n = 0
        self.lines = os.path.join(tmp, "lines.txt")
        pad = "x" * a.payload_bytes
        with open(self.lines, "w") as f:
            for i in range(1, a.jobs + 1):
                f.write(f"key-{i % a.keys}\t{pad}\n")

    def fresh(self, backend: str):
        """A fresh deployment (and redis-server): (data dir, redis or None)."""
        self.n += 1
        data = os.path.join(self.tmp, f"d{self.n}")
        redis = None
        args = [self.exe, "init", "--data", data, "--shards", "4"]
        if backend == "redis":
            redis = Redis(os.path.join(self.tmp, f"r{self.n}"))
            args += ["--redis", redis.url]
        sh(*args)
        return data, redis

    def ready(self, data: str) -> int:
        return json.loads(sh(self.exe, "status", "--data", data, "--json"))["totals"]["ready"]

    def install(self, data: str) -> None:
        self.pg.q("DROP SCHEMA IF EXISTS shardq CASCADE")
        sh(self.exe, "pg", "install", "--data", data, "--postgres", self.pg.url)

    def load(self, rows: int, txns: int) -> float:
        """Commits `rows` outbox rows in `txns` transactions; seconds taken."""
        a = self.a
        per = -(-rows // txns)
        t0 = time.monotonic()
        with psycopg.connect(self.pg.url) as c:
            lo = 1
            while lo <= rows:
                hi = min(rows, lo + per - 1)
                with c.transaction():
                    c.execute("SELECT count(shardq.enqueue('key-' || (i %% %s::int), repeat('x', %s::int))) "
                              "FROM generate_series(%s::int, %s::int) i", (a.keys, a.payload_bytes, lo, hi))
                lo = hi + 1
        return time.monotonic() - t0

    def run_enqueue(self, backend: str) -> Dict:
        data, redis = self.fresh(backend)
        try:
            load = load1()
            with open(self.lines, "rb") as f:
                t0 = time.monotonic()
                p = subprocess.run([self.exe, "enqueue", "--data", data, "--stdin"], stdin=f,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                s = time.monotonic() - t0
            if p.returncode != 0:
                raise SystemExit(f"enqueue --stdin exited {p.returncode}: {p.stderr.decode()[-2000:]}")
            ok = self.ready(data) == self.a.jobs
        finally:
            if redis:
                redis.stop()
            shutil.rmtree(data, ignore_errors=True)
        return {"backend": backend, "mode": "enqueue", "batch": None, "seconds": round(s, 3),
                "jobs_s": round(self.a.jobs / s), "load1": load, "checked": ok}

    def run_relay(self, backend: str, batch: int) -> Dict:
        data, redis = self.fresh(backend)
        try:
            self.install(data)
            load_s = self.load(self.a.jobs, self.a.load_txns)
            self.pg.q("CHECKPOINT")
            load = load1()
            t0 = time.monotonic()
            p = subprocess.run([self.exe, "pg", "relay", "--data", data, "--postgres", self.pg.url,
                                "--batch", str(batch), "--exit-when-empty", "--json"], capture_output=True)
            s = time.monotonic() - t0
            if p.returncode != 0:
                raise SystemExit(f"pg relay exited {p.returncode}: {p.stderr.decode()[-2000:]}")
            report = json.loads(p.stdout.decode().strip().splitlines()[-1])
            depth = self.pg.q("SELECT count(*) FROM shardq.outbox")[0][0]
            ok = report.get("relayed") == self.a.jobs and depth == 0 and self.ready(data) == self.a.jobs
        finally:
            if redis:
                redis.stop()
            shutil.rmtree(data, ignore_errors=True)
        return {"backend": backend, "mode": f"relay --batch {batch}", "batch": batch, "seconds": round(s, 3),
                "jobs_s": round(self.a.jobs / s), "load1": load, "checked": ok,
                "sql_load_s": round(load_s, 3), "sql_load_rows_s": round(self.a.jobs / load_s),
                "retries": report.get("retries"), "already_stored": report.get("already_stored")}


def throughput(b: Bench) -> Dict:
    a = b.a
    runs: List[Dict] = []
    for rep in range(a.repeat):
        for backend in a.backends:
            configs = [None] + a.batches
            if rep % 2:
                configs.reverse()
            for batch in configs:
                r = b.run_enqueue(backend) if batch is None else b.run_relay(backend, batch)
                r["repeat"] = rep
                runs.append(r)
                extra = f", SQL load {r['sql_load_s']} s" if batch else ""
                log(f"repeat {rep} {backend} {r['mode']}: {r['jobs_s']:,} jobs/s ({r['seconds']} s{extra}), "
                    f"load {r['load1']}, checked {r['checked']}")
    summary = []
    for backend in a.backends:
        enq = [r["jobs_s"] for r in runs if r["backend"] == backend and r["batch"] is None]
        for batch in [None] + a.batches:
            xs = [r for r in runs if r["backend"] == backend and r["batch"] == batch]
            v = [r["jobs_s"] for r in xs]
            row = {"backend": backend, "mode": xs[0]["mode"], "median": statistics.median(v),
                   "min": min(v), "max": max(v), "runs": v}
            if batch is not None:
                row["ratio_median"] = round(statistics.median(v) / statistics.median(enq), 3)
                row["ratio_per_repeat"] = [round(r["jobs_s"] / e["jobs_s"], 3) for r, e in
                                           zip(xs, [r for r in runs if r["backend"] == backend and r["batch"] is None])]
                sql = [r["sql_load_rows_s"] for r in xs]
                row["sql_load_rows_s_median"] = statistics.median(sql)
            summary.append(row)
    return {"runs": runs, "summary": summary}


def soak(b: Bench) -> Dict:
    a = b.a
    data, _ = b.fresh("embedded")
    b.install(data)
    relay_log = open(os.path.join(b.tmp, "relay-soak.jsonl"), "wb")
    relay = subprocess.Popen([b.exe, "pg", "relay", "--data", data, "--postgres", b.pg.url, "--json"],
                             stdout=relay_log, stderr=subprocess.STDOUT)
    stop = threading.Event()
    committed = [0]
    errors: List[str] = []

    def producer() -> None:
        rng = random.Random(7)
        pad = b"x" * a.payload_bytes
        per_tx = a.soak_rows_per_tx
        every = per_tx / a.soak_rate
        with psycopg.connect(b.pg.url) as c:
            nxt = time.monotonic()
            while not stop.is_set():
                keys = sorted(rng.randrange(a.keys) for _ in range(per_tx))
                try:
                    with c.transaction():
                        with c.cursor() as cur:
                            cur.executemany("SELECT shardq.enqueue(%s, %s::bytea)",
                                            [(f"key-{k}", pad) for k in keys])
                    committed[0] += per_tx
                except Exception as e:  # counted, not fatal
                    errors.append(str(e))
                nxt += every
                d = nxt - time.monotonic()
                if d > 0:
                    time.sleep(d)

    def sample(t: float) -> Dict:
        st = json.loads(sh(b.exe, "pg", "status", "--postgres", b.pg.url, "--json"))
        size, n_dead, av, v, n_live = b.pg.q(
            "SELECT pg_total_relation_size('shardq.outbox'), n_dead_tup, autovacuum_count, vacuum_count, n_live_tup "
            "FROM pg_stat_user_tables WHERE relid = 'shardq.outbox'::regclass")[0]
        return {"t_s": round(t), "committed": committed[0], "depth": st["depth"],
                "oldest_age_ms": st["oldest_age_ms"], "dead_tuples": st["dead_tuples"],
                "relay_active": st["relay_active"], "size_bytes": size, "n_dead_tup": n_dead,
                "n_live_tup": n_live, "autovacuum_count": av, "vacuum_count": v, "load1": load1()}

    th = threading.Thread(target=producer, daemon=True)
    series: List[Dict] = []
    t0 = time.monotonic()
    th.start()
    try:
        nxt = 30.0
        while True:
            now = time.monotonic() - t0
            if now >= nxt:
                s = sample(now)
                series.append(s)
                log(f"soak {s['t_s']} s: committed {s['committed']:,}, depth {s['depth']}, oldest "
                    f"{s['oldest_age_ms']} ms, dead {s['dead_tuples']}, size {s['size_bytes']:,} B, "
                    f"autovacuums {s['autovacuum_count']}, load {s['load1']}")
                nxt += 30.0
                if nxt > a.soak_s + 0.5:
                    break
            time.sleep(min(1.0, max(0.0, nxt - now)))
    finally:
        stop.set()
        th.join()
    produced_s = time.monotonic() - t0
    wait_for("the outbox to drain", lambda: b.pg.q("SELECT count(*) FROM shardq.outbox")[0][0] == 0, 120)
    stop_proc(relay)
    relay_log.close()
    final = sample(time.monotonic() - t0)
    stored = b.ready(data)
    shutil.rmtree(data, ignore_errors=True)
    return {"seconds": round(produced_s, 1), "committed": committed[0],
            "rows_s": round(committed[0] / produced_s), "producer_errors": len(errors),
            "first_errors": errors[:3], "stored": stored, "checked": stored == committed[0],
            "series": series, "after_drain": final}


def fmt(n) -> str:
    return f"{n:,}" if isinstance(n, int) else str(n)


def report(res: Dict) -> str:
    out = [f"PostgreSQL {res['pg']['server_version']}, fsync {res['pg']['fsync']}, synchronous_commit "
           f"{res['pg']['synchronous_commit']}, autovacuum_naptime {res['pg']['autovacuum_naptime']}; {res['jobs']:,} jobs over {res['keys']:,} keys, "
           f"{res['payload_bytes']}-byte payloads; outbox loaded in {res['load_txns']} transaction(s)", ""]
    if "throughput" in res:
        t = res["throughput"]
        out += ["| repeat | backend | mode | seconds | jobs/s | SQL load s (rows/s) | load avg 1m | checked |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in t["runs"]:
            sql = f"{r['sql_load_s']} ({r['sql_load_rows_s']:,})" if r["batch"] else ""
            out.append(f"| {r['repeat']} | {r['backend']} | {r['mode']} | {r['seconds']} | {r['jobs_s']:,} | "
                       f"{sql} | {r['load1']} | {r['checked']} |")
        out += ["", "| backend | mode | median jobs/s | range | relay / enqueue (medians) | per repeat |",
                "| --- | --- | --- | --- | --- | --- |"]
        for s in t["summary"]:
            out.append(f"| {s['backend']} | {s['mode']} | {fmt(int(s['median']))} | {s['min']:,}-{s['max']:,} | "
                       f"{s.get('ratio_median', '')} | {', '.join(map(str, s.get('ratio_per_repeat', [])))} |")
        out.append("")
    if "soak" in res:
        s = res["soak"]
        out += [f"Soak: {s['seconds']} s, {s['committed']:,} rows committed ({s['rows_s']:,} rows/s), "
                f"producer errors {s['producer_errors']}, jobs stored {s['stored']:,}, checked {s['checked']}", "",
                "| t s | committed | depth | oldest_age_ms | dead_tuples | table size | autovacuum_count | vacuum_count | load avg 1m |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in s["series"] + [dict(s["after_drain"], t_s=f"{s['after_drain']['t_s']} (drained)")]:
            out.append(f"| {r['t_s']} | {r['committed']:,} | {r['depth']} | {r['oldest_age_ms']} | {r['dead_tuples']} | "
                       f"{r['size_bytes']:,} | {r['autovacuum_count']} | {r['vacuum_count']} | {r['load1']} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.environ.get("SHARDQ_BIN") or os.path.join(ROOT, "target", "release", "shardq"))
    p.add_argument("--pg-bin", default=os.environ.get("PG_BIN"),
                   help="directory of initdb and postgres (default $PG_BIN, else `pg_config --bindir`)")
    p.add_argument("--pg-set", action="append", default=[], metavar="NAME=VALUE",
                   help="a server setting for postgres -c (repeatable), e.g. autovacuum_naptime=10s")
    p.add_argument("--jobs", type=int, default=200_000)
    p.add_argument("--keys", type=int, default=1_000)
    p.add_argument("--payload-bytes", type=int, default=100)
    p.add_argument("--batches", default="2000,5000,10000")
    p.add_argument("--backends", default="embedded,redis")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--load-txns", type=int, default=1, help="transactions the SQL bulk load is split into")
    p.add_argument("--soak-s", type=float, default=0, help="run the soak for this long (0: no soak)")
    p.add_argument("--soak-rate", type=float, default=2000, help="rows/s the soak's producer commits")
    p.add_argument("--soak-rows-per-tx", type=int, default=10)
    p.add_argument("--soak-only", action="store_true", help="skip the throughput part")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    a.batches = [int(x) for x in a.batches.split(",") if x]
    a.backends = [x for x in a.backends.split(",") if x]
    if not a.pg_bin:
        try:
            a.pg_bin = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                                      check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            raise SystemExit("no PostgreSQL server binaries: give --pg-bin DIR (initdb, postgres)")
    if not os.path.exists(a.bin):
        raise SystemExit(f"{a.bin}: no such binary (cargo build --release -p shardq)")
    tmp = tempfile.mkdtemp(prefix="pg-relay-")
    pg = None
    try:
        pg = Postgres(tmp, a.pg_bin, a.pg_set)
        b = Bench(a, tmp, pg)
        res: Dict = {"pg": pg.settings(), "jobs": a.jobs, "keys": a.keys, "payload_bytes": a.payload_bytes,
                     "load_txns": a.load_txns, "nproc": os.cpu_count()}
        log(f"postgres {res['pg']}")
        if not a.soak_only:
            res["throughput"] = throughput(b)
        if a.soak_s > 0:
            res["soak"] = soak(b)
    finally:
        if pg:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(res, indent=1) if a.json else report(res))


if __name__ == "__main__":
    main()
