#!/usr/bin/env python3
"""Recurring schedules on the user's path: how late a tick's job is
enqueued, whether every tick stores exactly one job, and what holding many
schedules costs a `shardq work` process in CPU. Everything goes through the
`shardq` command line and real `work` processes on embedded data dirs (see
docs/schedules.md).

    python3 benchmarks/schedules.py [--bin PATH] [--part many|accuracy|both]
                                    [--schedules N] [--minutes M] [--set-with apply|set]
                                    [--set-budget-s S]
                                    [--lead-s L] [--tail-s T] [--keep]
                                    [--accuracy-minutes A] [--out FILE] [--json]

Part "many" (--schedules, 10,000; at most 10,000, the deployment's bound):
  1. `shardq init --shards 4` twice: a data dir for the schedules and an
     empty one. `shardq retention set --finished-jobs 100000` on both, so
     the finished jobs of a run can be listed afterwards.
  2. With --set-with apply (the default): every schedule in one file, set
     by one `shardq schedule apply --file`, timed; T (below) is the first
     whole minute at least 2 minutes after it. With --set-with set:
     `shardq schedule set ID --key tenant-I --every 1m --overlap all
     --payload p --start T`, one CLI call per schedule, timed. Past
     --set-budget-s (900 s) no more are set and the run goes on with those
     set (the report says how many, and the time per call as the list
     grew). T is the first whole minute at least 90 s after the budget
     runs out: without it, the ticks that pass while the schedules are set
     would all fall due at the worker's start and be fired late, as
     catch-up, mixing a backlog into the figures.
  3. Three `shardq work --max-local-shards all` runs, one after the other,
     each started --lead-s (20 s) before a whole UTC minute and stopped
     (SIGTERM) --tail-s (30 s) after the --minutes-th (3) whole minute, so
     it crosses --minutes minute boundaries:
       empty: the empty data dir, `--handler-builtin append:FILE` (the
         worker's in-process test handler: one line per job appended to a
         file, then the job is acked); the baseline, run while waiting
         for the first tick when it fits there, else after the held run.
       acked: the schedules' data dir, the same worker and handler: every
         job runs and is acked (the user's path).
       held:  the schedules' data dir, the handler command `sleep 86400`
         with --concurrency 1: the first job claimed holds the only slot,
         so every other job stays queued, and its enqueue time
         (`created_ms`) can be read afterwards. A finished job's record
         keeps no `created_ms` (only its attempt starts), so the enqueue
         delay is measured on this run.
     The worker's CPU time (utime + stime of /proc/PID/stat) is sampled
     every 0.25 s; "CPU s per minute" is the mean over the whole minutes
     between its first and last boundary (each holds one tick's burst),
     the ratio is that of a schedules run over the empty run; the CPU of
     the 10 s after each tick (its burst of fires) is shown beside it.
  4. After each schedules run, `shardq serve --no-shards` (it fires no
     schedule) on a free loopback port answers `GET
     /v1/keys/tenant-I/jobs?limit=1000&recent=1000` for every key: the
     run's jobs, live ones with `created_ms`, finished ones with their
     attempt starts. `schedule list --json` before and after each run gives
     each schedule's cursor and its fired / missed counts.
  Ticks: the whole minutes after a schedule's cursor (its last decided tick,
  else when it was set, and not before its --start) up to the stop. Ticks
  older than the catch-up window (5 min) when the worker started are
  expected to be counted missed;
  the others up to the worker's start are fired at its start (catch-up);
  those after its start are "on time". Per key, the run's jobs in id order
  are paired with the expected ticks in order (a key's schedule enqueues in
  tick order, and nothing else enqueues on these keys); a key with more
  jobs than ticks counts as doubled, fewer as missing. delay = created_ms -
  tick (held), start = first attempt start - tick (acked). A pairing is
  checked: an on-time job whose created_ms floored to the minute is not its
  tick is counted.

Part "accuracy": one schedule `--every 1s --overlap all` on key
  `tenant-acc` of a fresh 4-shard data dir, one worker for
  --accuracy-minutes (10) with the handler command `sh -c` that appends
  `SHARD:ID`, the time (`date +%s%3N`) and `shardq job show SHARD:ID
  --json` (the live job, with its created_ms) to a file. Afterwards
  `shardq jobs --key tenant-acc --json` lists jobs still live and the
  finished ones. Ticks expected: every second after the schedule was set
  up to 1 s before the stop. Reported: ticks vs jobs (missing, doubled),
  delay = created_ms - tick and handler start - tick (p50, p99, max), and
  drift: the delay in the first and in the last minute, and a least-squares
  slope.

Percentiles are nearest-rank. Times are the machine's wall clock (the
clock the worker fires by). Loopback only; everything runs in a temporary
directory that is removed at the end (--keep keeps it). A markdown report
goes to stdout (and --out); --json prints the raw figures instead.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from bench_support import HOST, free_port, log, proc_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINUTE_MS = 60_000
CLK_TCK = os.sysconf("SC_CLK_TCK")
SCHEDULES_MAX = 10_000


def now_ms() -> int:
    return int(time.time() * 1000)


def pct(values: List[float], p: float) -> Optional[float]:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, math.ceil(p / 100.0 * len(s)) - 1)
    return s[k]


def dist(values: List[float]) -> Dict[str, Optional[float]]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p99": pct(values, 99),
        "max": max(values) if values else None,
        "min": min(values) if values else None,
    }


def fmt_ms(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f} ms" if abs(v) >= 10 else f"{v:.1f} ms"


def fmt_dist(d: Dict[str, Optional[float]]) -> str:
    return f"p50 {fmt_ms(d['p50'])}, p99 {fmt_ms(d['p99'])}, max {fmt_ms(d['max'])} (n = {d['n']:,})"


def cpu_seconds(pid: int) -> Optional[float]:
    """utime + stime of `pid` in seconds; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command: state is field 3, utime 14, stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class CpuSampler:
    """Samples a process's CPU seconds every `interval` s, against the wall
    clock, so that the CPU of any wall-time window can be read later."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: List[Tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        c = cpu_seconds(self.pid)
        if c is not None:
            self.samples.append((time.time(), c))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def at(self, t: float) -> float:
        """CPU seconds at wall time t (linear between samples)."""
        s = self.samples
        if not s:
            return 0.0
        if t <= s[0][0]:
            return s[0][1]
        for (t0, c0), (t1, c1) in zip(s, s[1:]):
            if t0 <= t <= t1:
                return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
        return s[-1][1]


def run_cli(binary: str, args: List[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([binary] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"shardq {' '.join(args[:2])} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def init_dir(binary: str, path: str, shards: int = 4, retention: bool = True) -> None:
    run_cli(binary, ["init", "--data", path, "--shards", str(shards)])
    if retention:
        run_cli(binary, ["retention", "set", "--data", path, "--finished-jobs", "100000"])


def schedule_list(binary: str, data: str) -> Dict[str, dict]:
    out = json.loads(run_cli(binary, ["schedule", "list", "--data", data, "--json"]).stdout)
    return {s["id"]: s for s in out["schedules"]}


def sleep_until(t_wall: float) -> None:
    while True:
        d = t_wall - time.time()
        if d <= 0:
            return
        time.sleep(min(d, 1.0))


def id_num(job_id: str) -> int:
    return int(job_id.rsplit(":", 1)[1])


def ticks_between(after_ms: int, upto_ms: int, every_ms: int) -> List[int]:
    """Ticks t of an epoch-anchored interval with after_ms < t <= upto_ms."""
    first = (after_ms // every_ms + 1) * every_ms
    return list(range(first, upto_ms + 1, every_ms))


# --------------------------------------------------------------------------
# Workers


class WorkerRun:
    """One `shardq work --max-local-shards all` run between two wall times."""

    def __init__(self, binary: str, data: str, workdir: str, label: str, handler: List[str]) -> None:
        self.binary = binary
        self.data = data
        self.label = label
        self.handler = handler
        self.log_path = os.path.join(workdir, f"work-{label}.log")
        self.result: dict = {}

    def run(self, start_at: float, stop_at: float) -> dict:
        sleep_until(start_at)
        cmd = [self.binary, "work", "--data", self.data, "--max-local-shards", "all", "--drain-timeout-ms", "2000"]
        cmd += self.handler
        with open(self.log_path, "wb") as lf:
            t_spawn = time.time()
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
            sampler = CpuSampler(proc.pid)
            log(f"{self.label}: worker {proc.pid} started; stops at {time.strftime('%H:%M:%S', time.gmtime(stop_at))} UTC")
            while time.time() < stop_at:
                if proc.poll() is not None:
                    sampler.stop()
                    raise RuntimeError(f"{self.label}: worker exited early ({proc.returncode}):\n{self.log_tail()}")
                time.sleep(min(1.0, max(0.0, stop_at - time.time())))
            sampler.sample()
            hwm = proc_memory(proc.pid).get("VmHWM", 0)
            t_stop = time.time()
            sampler.stop()
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        s = sampler
        start_ms, stop_ms = int(t_spawn * 1000), int(t_stop * 1000)
        bounds = [b / 1000.0 for b in ticks_between(start_ms, stop_ms, MINUTE_MS)]
        windows = [(a, b) for a, b in zip(bounds, bounds[1:])]
        per_min = [s.at(b) - s.at(a) for a, b in windows]
        # Where a minute's CPU goes: the first 10 s after its tick (the
        # tick's burst of fires) and the other 50 s.
        after_tick = [s.at(a + 10) - s.at(a) for a in bounds if a + 10 <= t_stop]
        rest = [s.at(b) - s.at(a + 10) for a, b in windows]
        cpu_total = s.at(t_stop)
        self.result = {
            "label": self.label,
            "start_ms": start_ms,
            "stop_ms": stop_ms,
            "boundaries": len(bounds),
            "wall_s": round(t_stop - t_spawn, 1),
            "cpu_s_total": round(cpu_total, 2),
            "cpu_s_before_first_boundary": round(s.at(bounds[0]) if bounds else cpu_total, 2),
            "cpu_s_full_minutes": [round(c, 2) for c in per_min],
            "cpu_s_per_minute": round(sum(per_min) / len(per_min), 3) if per_min else None,
            "cpu_s_10s_after_each_tick": [round(c, 2) for c in after_tick],
            "cpu_s_rest_of_each_full_minute": [round(c, 2) for c in rest],
            "cpu_s_per_minute_whole_run": round(cpu_total / ((t_stop - t_spawn) / 60.0), 3),
            "vm_hwm_mb": round(hwm / 1e6, 1),
            "exit": rc,
            "done_line": self.done_line(),
        }
        log(
            f"{self.label}: {self.result['wall_s']} s, CPU {self.result['cpu_s_total']} s, "
            f"per full minute {self.result['cpu_s_full_minutes']}; {self.result['done_line']}"
        )
        return self.result

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return ""

    def done_line(self) -> str:
        for line in reversed(self.log_tail(50).splitlines()):
            if "done:" in line:
                return line.split("done:", 1)[1].strip()
        return "(no done line)"

    def warnings(self) -> List[str]:
        return [l for l in self.log_tail(100000).splitlines() if "warning" in l or "error" in l]


# --------------------------------------------------------------------------
# Reading a data dir's jobs through `shardq serve --no-shards`


def read_keys(binary: str, data: str, keys: List[str], workdir: str) -> Dict[str, dict]:
    port = free_port()
    lp = os.path.join(workdir, "serve.log")
    with open(lp, "ab") as lf:
        proc = subprocess.Popen(
            [binary, "serve", "--data", data, "--listen", f"{HOST}:{port}", "--no-shards"],
            stdout=lf,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"shardq serve exited with {proc.returncode}")
            try:
                c = http.client.HTTPConnection(HOST, port, timeout=5)
                c.request("GET", "/readyz")
                r = c.getresponse()
                r.read()
                c.close()
                if r.status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("shardq serve not ready within 60 s")
            time.sleep(0.1)
        out: Dict[str, dict] = {}
        conn = http.client.HTTPConnection(HOST, port, timeout=30)
        t0 = time.monotonic()
        for k in keys:
            conn.request("GET", f"/v1/keys/{k}/jobs?limit=1000&recent=1000")
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise RuntimeError(f"GET jobs of {k}: {r.status} {body[:200]!r}")
            out[k] = json.loads(body)
        conn.close()
        log(f"read {len(keys)} keys' jobs in {time.monotonic() - t0:.1f} s")
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------
# Matching a run's jobs with the ticks it should have fired


def expected_ticks(sched: dict, start_ms: int, stop_ms: int) -> Tuple[List[int], List[int]]:
    """(ticks to fire, ticks expected missed) of an interval schedule over a
    worker run, from the schedule's state before the run."""
    every = sched["when"]["every"]["every_ms"]
    cursor = max(sched["state"]["decided_ms"] or 0, sched["since_ms"] or 0)
    start = sched.get("start_ms")
    if start:
        # No tick before --start, and the ticks are anchored there.
        if start % every:
            raise RuntimeError("--start must be a multiple of the interval here")
        cursor = max(cursor, start - 1)
    ticks = ticks_between(cursor, stop_ms, every)
    catch_up = sched["catch_up_ms"]
    fire = [t for t in ticks if t + catch_up >= start_ms]
    missed = [t for t in ticks if t + catch_up < start_ms]
    return fire, missed


def analyse_many(
    kind: str,
    before: Dict[str, dict],
    after: Dict[str, dict],
    jobs: Dict[str, dict],
    run: dict,
    handled_lines: Optional[Dict[str, int]] = None,
) -> dict:
    start, stop = run["start_ms"], run["stop_ms"]
    on_time_delay: List[float] = []
    catch_up_delay_from_start: List[float] = []
    per_tick: Dict[int, List[float]] = {}
    start_delay: List[float] = []
    exp_on_time = exp_catch_up = exp_missed = 0
    paired_on_time = paired_catch_up = 0
    missing = doubled = mismatched_keys = 0
    floor_mismatch = 0
    stored = finished = live_at_stop = 0
    for sid, s in before.items():
        key = s["key"]
        fire, missed = expected_ticks(s, start, stop)
        exp_missed += len(missed)
        exp_on_time += sum(1 for t in fire if t > start)
        exp_catch_up += sum(1 for t in fire if t <= start)
        doc = jobs.get(key, {"jobs": [], "recent": []})
        mine = []
        for j in doc.get("jobs", []):
            if kind == "held" and j["created_ms"] < start:
                continue  # left queued by an earlier run
            if kind == "acked" and not (start <= j["created_ms"] <= stop):
                continue
            mine.append({"id": j["id"], "created": j["created_ms"], "start": (j["attempt_starts_ms"] or [None])[0]})
            live_at_stop += 1
        for j in doc.get("recent", []):
            st = (j["attempt_starts_ms"] or [None])[0]
            if st is None or not (start <= st <= stop + 5000):
                continue
            mine.append({"id": j["id"], "created": None, "start": st})
            finished += 1
        stored += len(mine)
        mine.sort(key=lambda j: id_num(j["id"]))
        if len(mine) != len(fire):
            mismatched_keys += 1
            missing += max(0, len(fire) - len(mine))
            doubled += max(0, len(mine) - len(fire))
            continue
        for t, j in zip(fire, mine):
            if t > start:
                paired_on_time += 1
                if j["created"] is not None:
                    d = j["created"] - t
                    on_time_delay.append(d)
                    per_tick.setdefault(t, []).append(d)
                    if j["created"] - j["created"] % MINUTE_MS != t:
                        floor_mismatch += 1
                if j["start"] is not None and kind == "acked":
                    start_delay.append(j["start"] - t)
            else:
                paired_catch_up += 1
                if j["created"] is not None:
                    catch_up_delay_from_start.append(j["created"] - start)
    fired_delta = sum((after[i]["state"]["fired"] - before[i]["state"]["fired"]) for i in before if i in after)
    missed_delta = sum((after[i]["state"]["missed"] - before[i]["state"]["missed"]) for i in before if i in after)
    skipped_delta = sum((after[i]["state"]["skipped"] - before[i]["state"]["skipped"]) for i in before if i in after)
    res = {
        "kind": kind,
        "expected_on_time": exp_on_time,
        "expected_catch_up": exp_catch_up,
        "expected_missed": exp_missed,
        "jobs_stored": stored,
        "jobs_finished": finished,
        "jobs_live_at_stop": live_at_stop,
        "paired_on_time": paired_on_time,
        "paired_catch_up": paired_catch_up,
        "keys_mismatched": mismatched_keys,
        "missing": missing,
        "doubled": doubled,
        "on_time_floor_mismatch": floor_mismatch,
        "counter_fired": fired_delta,
        "counter_missed": missed_delta,
        "counter_skipped": skipped_delta,
        "enqueue_delay": dist(on_time_delay),
        "per_tick": [
            {"tick": time.strftime("%H:%M", time.gmtime(t / 1000)), "n": len(v), "p50": pct(v, 50), "last": max(v)}
            for t, v in sorted(per_tick.items())
        ],
        "catch_up_created_after_start": dist(catch_up_delay_from_start),
        "start_delay": dist(start_delay),
    }
    if handled_lines is not None:
        res["handler_lines"] = sum(handled_lines.values())
    return res


def handler_counts(path: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                k = line.split(b" ", 1)[0].decode()
                out[k] = out.get(k, 0) + 1
    except OSError:
        pass
    return out


# --------------------------------------------------------------------------
# Part "many"


def apply_schedules(binary: str, data: str, n: int, start_ms: int) -> dict:
    """All `n` schedules in one `shardq schedule apply --file`, timed."""
    path = os.path.join(os.path.dirname(data), "schedules.json")
    doc = {"schedules": {f"every-1m-{i}": {"key": f"tenant-{i}", "every": "1m", "overlap": "all",
                                            "payload": "p", "start": start_ms} for i in range(n)}}
    with open(path, "w") as f:
        json.dump(doc, f)
    t0 = time.monotonic()
    run_cli(binary, ["schedule", "apply", "--data", data, "--file", path])
    total = time.monotonic() - t0
    log(f"applied {n} schedules in one call: {total:.2f} s")
    return {"requested": n, "set": n, "how": "one `schedule apply`", "seconds": round(total, 2),
            "budget_hit": False}


def set_schedules(binary: str, data: str, n: int, budget_s: float, start_ms: int) -> dict:
    t0 = time.monotonic()
    marks: List[Tuple[int, float]] = []
    last_calls: List[float] = []
    done = 0
    for i in range(n):
        c0 = time.monotonic()
        run_cli(
            binary,
            ["schedule", "set", "--data", data, f"every-1m-{i}", "--key", f"tenant-{i}",
             "--every", "1m", "--overlap", "all", "--payload", "p", "--start", str(start_ms)],
        )
        last_calls.append(time.monotonic() - c0)
        last_calls = last_calls[-100:]
        done = i + 1
        if done % 1000 == 0:
            marks.append((done, time.monotonic() - t0))
            log(f"set {done} schedules in {marks[-1][1]:.0f} s")
        if time.monotonic() - t0 > budget_s:
            log(f"set budget of {budget_s:.0f} s reached after {done} schedules")
            break
    total = time.monotonic() - t0
    per_thousand: List[dict] = []
    prev_n, prev_t = 0, 0.0
    for m, t in marks:
        per_thousand.append({"from": prev_n, "to": m, "ms_per_call": round((t - prev_t) / (m - prev_n) * 1000, 1)})
        prev_n, prev_t = m, t
    # Past the budget: the time the rest would have taken if the cost per
    # call kept growing as it did per thousand (a least-squares line), an
    # extrapolation, not a measurement.
    projected = None
    if done < n and len(per_thousand) >= 2:
        xs = [p["to"] - 500 for p in per_thousand]
        ys = [p["ms_per_call"] for p in per_thousand]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
        projected = round(total + sum(max(0.0, a + b * i) for i in range(done, n)) / 1000, 0)
    return {
        "requested": n,
        "set": done,
        "projected_s_for_all": projected,
        "seconds": round(total, 1),
        "ms_per_call_mean": round(total / done * 1000, 1) if done else None,
        "ms_per_call_last_100": round(sum(last_calls) / len(last_calls) * 1000, 1) if last_calls else None,
        "per_thousand": per_thousand,
        "budget_s": budget_s,
        "budget_hit": done < n,
    }


def part_many(args: argparse.Namespace, binary: str, workdir: str) -> dict:
    sched = os.path.join(workdir, "sched")
    empty = os.path.join(workdir, "empty")
    init_dir(binary, sched)
    init_dir(binary, empty)
    lead, tail = args.lead_s, args.tail_s

    def window(first_boundary: Optional[float] = None) -> Tuple[float, float]:
        """(start, stop) of a run that starts `lead` s before a whole minute
        and crosses --minutes of them."""
        if first_boundary is None:
            first_boundary = math.ceil((time.time() + lead + 5) / 60.0) * 60
        if time.time() > first_boundary - lead:
            log(f"warning: the run starts late, after {time.strftime('%H:%M:%S', time.gmtime(first_boundary - lead))} UTC")
        return first_boundary - lead, first_boundary + (args.minutes - 1) * 60 + tail

    runs = {}
    analyses = {}
    order: List[str] = []

    def baseline() -> None:
        # The same worker and handler on a data dir with no schedule.
        w = WorkerRun(binary, empty, workdir, "empty",
                      ["--handler-builtin", "append:" + os.path.join(workdir, "empty.handled")])
        runs["empty"] = w.run(*window())
        runs["empty"]["warnings"] = w.warnings()[:5]
        order.append("empty")

    # The schedules' first tick: a whole minute at least 90 s after the
    # setting budget runs out, so that no tick falls due before the worker
    # starts (a tick due then would be fired late, as catch-up).
    budget = args.set_budget_s if args.set_with == "set" else 30
    first_tick = math.ceil((time.time() + budget + 90) / 60.0) * 60
    log(f"setting {args.schedules} schedules with `schedule {args.set_with}` (budget {budget:.0f} s), "
        f"first tick {time.strftime('%H:%M', time.gmtime(first_tick))} UTC")
    if args.set_with == "apply":
        setting = apply_schedules(binary, sched, args.schedules, int(first_tick * 1000))
    else:
        setting = set_schedules(binary, sched, args.schedules, args.set_budget_s, int(first_tick * 1000))
    setting["first_tick"] = time.strftime("%H:%M", time.gmtime(first_tick))
    setting["idle_s_before_first_run"] = round(max(0.0, first_tick - lead - time.time()), 1)
    n = setting["set"]
    # The baseline runs in the wait for the first tick when it fits there
    # (ending 15 s before the schedules run starts), else after the others.
    b_first = math.ceil((time.time() + lead + 5) / 60.0) * 60
    if b_first + (args.minutes - 1) * 60 + tail + 15 <= first_tick - lead:
        baseline()
    # acked: every job runs and is acked.
    order.append("acked")
    keys = [f"tenant-{i}" for i in range(n)]
    before = schedule_list(binary, sched)
    handled = os.path.join(workdir, "acked.handled")
    w = WorkerRun(binary, sched, workdir, "acked", ["--handler-builtin", "append:" + handled])
    runs["acked"] = w.run(*window(first_tick))
    runs["acked"]["warnings"] = w.warnings()[:5]
    after = schedule_list(binary, sched)
    jobs = read_keys(binary, sched, keys, workdir)
    analyses["acked"] = analyse_many("acked", before, after, jobs, runs["acked"], handler_counts(handled))
    log(f"acked: {json.dumps({k: v for k, v in analyses['acked'].items() if k != 'per_tick'})}")
    # held: jobs stay queued so that their created_ms can be read.
    order.append("held")
    before = after
    w = WorkerRun(binary, sched, workdir, "held", ["--concurrency", "1", "--", "sleep", "86400"])
    runs["held"] = w.run(*window())
    runs["held"]["warnings"] = w.warnings()[:5]
    after = schedule_list(binary, sched)
    jobs = read_keys(binary, sched, keys, workdir)
    analyses["held"] = analyse_many("held", before, after, jobs, runs["held"])
    log(f"held: {json.dumps({k: v for k, v in analyses['held'].items() if k != 'per_tick'})}")
    if "empty" not in runs:
        baseline()
    base = runs["empty"]["cpu_s_per_minute"]
    for k in ("acked", "held"):
        c = runs[k]["cpu_s_per_minute"]
        runs[k]["cpu_ratio_vs_empty"] = round(c / base, 1) if base and c is not None else None
    return {"part": "many", "setting": setting, "runs": runs, "analyses": analyses,
            "minutes": args.minutes, "tail_s": tail, "lead_s": lead, "order": order}


# --------------------------------------------------------------------------
# Part "accuracy"


HANDLER_SH = (
    't=$(date +%s%3N); id="$SHARDQ_SHARD:$SHARDQ_JOB_ID"; '
    'j=$("$1" job show --data "$2" "$id" --json 2>/dev/null | tr -d "\\n"); '
    'printf "%s %s %s\\n" "$id" "$t" "$j" >> "$3"'
)


def part_accuracy(args: argparse.Namespace, binary: str, workdir: str) -> dict:
    data = os.path.join(workdir, "accuracy")
    init_dir(binary, data)
    hlog = os.path.join(workdir, "accuracy.handled")
    run_cli(binary, ["schedule", "set", "--data", data, "every-1s", "--key", "tenant-acc",
                     "--every", "1s", "--overlap", "all", "--payload", "p"])
    before = schedule_list(binary, data)["every-1s"]
    start = time.time() + 0.2
    stop = start + args.accuracy_minutes * 60
    w = WorkerRun(binary, data, workdir, "accuracy",
                  ["--", "sh", "-c", HANDLER_SH, "sh", binary, data, hlog])
    run = w.run(start, stop)
    run["warnings"] = w.warnings()[:5]
    after = schedule_list(binary, data)["every-1s"]
    listing = json.loads(run_cli(binary, ["jobs", "--data", data, "--key", "tenant-acc", "--json",
                                          "--limit", "1000", "--recent", "1000"]).stdout)
    jobs: Dict[str, dict] = {}
    show_failed = 0
    with open(hlog) as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 2)
            jid, t = parts[0], int(parts[1])
            created = None
            if len(parts) > 2 and parts[2].startswith("{"):
                created = json.loads(parts[2])["created_ms"]
            else:
                show_failed += 1
            j = jobs.setdefault(jid, {"id": jid, "created": None, "runs": []})
            j["runs"].append(t)
            if created is not None:
                j["created"] = created
    for j in listing["jobs"]:
        jobs.setdefault(j["id"], {"id": j["id"], "created": j["created_ms"], "runs": []})
        jobs[j["id"]]["created"] = j["created_ms"]
    for j in listing["recent"]:
        jobs.setdefault(j["id"], {"id": j["id"], "created": None, "runs": []})
    every = 1000
    cursor = max(before["state"]["decided_ms"] or 0, before["since_ms"])
    # Ticks up to 1 s before the stop must have a job; the last second's
    # tick races the stop and may or may not.
    window_end = run["stop_ms"] - 1000
    required = ticks_between(cursor, window_end, every)
    optional = ticks_between(window_end, run["stop_ms"], every)
    mine = sorted(jobs.values(), key=lambda j: id_num(j["id"]))
    missing = doubled = 0
    pairs: List[Tuple[int, dict]] = []
    if len(required) <= len(mine) <= len(required) + len(optional):
        pairing = "by id"
        pairs = list(zip(required + optional, mine))
    else:
        # Counts do not fit: attribute each job to its created_ms floored to the second.
        pairing = "floor of created_ms"
        by_tick: Dict[int, List[dict]] = {}
        for j in mine:
            if j["created"] is not None:
                by_tick.setdefault(j["created"] - j["created"] % every, []).append(j)
        for t in required + optional:
            got = by_tick.get(t, [])
            if not got and t in required:
                missing += 1
            doubled += max(0, len(got) - 1)
            if got:
                pairs.append((t, got[0]))
        missing = max(missing, len(required) - len(mine))
        doubled = max(doubled, len(mine) - len(required) - len(optional))
    delays, run_delays, series = [], [], []
    floor_mismatch = 0
    no_created = 0
    for t, j in pairs:
        if t <= run["start_ms"]:
            continue  # due when the worker started (the schedule was set just before it)
        if j["created"] is None:
            no_created += 1
        else:
            d = j["created"] - t
            delays.append(d)
            series.append((t, d))
            if j["created"] - j["created"] % every != t:
                floor_mismatch += 1
        if j["runs"]:
            run_delays.append(j["runs"][0] - t)
    first = [d for t, d in series if t < run["start_ms"] + 60_000]
    last = [d for t, d in series if t >= run["stop_ms"] - 61_000]
    slope = None
    if len(series) > 2:
        xs = [(t - series[0][0]) / 60_000 for t, _ in series]
        ys = [d for _, d in series]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else None
    res = {
        "part": "accuracy",
        "run": run,
        "ticks_required": len(required),
        "ticks_optional": len(optional),
        "ticks_due_at_start": sum(1 for t in required if t <= run["start_ms"]),
        "jobs": len(mine),
        "pairing": pairing,
        "missing": missing,
        "doubled": doubled,
        "floor_mismatch": floor_mismatch,
        "jobs_without_created": no_created,
        "job_show_failed": show_failed,
        "counter_fired": after["state"]["fired"] - before["state"]["fired"],
        "counter_missed": after["state"]["missed"] - before["state"]["missed"],
        "live_at_stop": len(listing["jobs"]),
        "enqueue_delay": dist(delays),
        "handler_start_delay": dist(run_delays),
        "first_minute": dist(first),
        "last_minute": dist(last),
        "slope_ms_per_minute": round(slope, 3) if slope is not None else None,
        "minutes": args.accuracy_minutes,
    }
    return res


# --------------------------------------------------------------------------
# Report


def report_many(r: dict) -> List[str]:
    s = r["setting"]
    out = ["## Part many: schedules every 1m on 4 shards, one worker", ""]
    if s.get("how"):
        out.append(f"Setting: {s['set']:,} schedules set with {s['how']} in {s['seconds']:,} s.")
    else:
        out.append(
            f"Setting: {s['set']:,} of {s['requested']:,} schedules set with one `schedule set` call each in "
            f"{s['seconds']:,} s ({s['ms_per_call_mean']} ms per call on average, "
            f"{s['ms_per_call_last_100']} ms per call over the last 100)."
        )
    if s["budget_hit"]:
        proj = s.get("projected_s_for_all")
        out.append(
            f"The budget of {s['budget_s']:.0f} s ran out, so the runs below hold {s['set']:,} schedules"
            + (f" (extrapolating the cost per call, which grows with the list, {s['requested']:,} would "
               f"take about {proj:,.0f} s)." if proj else ".")
        )
    if s.get("per_thousand"):
        out.append("")
        out.append("ms per `schedule set` call, per thousand: " + ", ".join(
            f"{p['to']:,}: {p['ms_per_call']}" for p in s["per_thousand"]))
    out.append("")
    out.append(
        f"Each schedule was set with `--start` at the whole minute {s['first_tick']} UTC (after the setting "
        f"budget), so that no tick fell due before the first schedules run; {s['idle_s_before_first_run']} s "
        "between the last `set` and that run. Each worker run: "
        f"started {r['lead_s']:.0f} s before a whole minute, stopped (SIGTERM) {r['tail_s']:.0f} s after the "
        f"last of the {r['minutes']} whole minutes it crossed; the order of the runs: {', '.join(r['order'])}."
    )
    out.append("")
    out.append("| run | handler | wall s | boundaries crossed | CPU s whole run | CPU s in each full minute | of which the 10 s after the tick | CPU s per minute | ratio vs empty | VmHWM MB | worker's summary |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    handlers = {"empty": "builtin append (acks)", "acked": "builtin append (acks)", "held": "`sleep 86400`, concurrency 1"}
    for k in ("empty", "acked", "held"):
        w = r["runs"][k]
        out.append(
            f"| {k} | {handlers[k]} | {w['wall_s']} | {w['boundaries']} | {w['cpu_s_total']} | "
            f"{', '.join(str(c) for c in w['cpu_s_full_minutes'])} | "
            f"{', '.join(str(c) for c in w['cpu_s_10s_after_each_tick'][:len(w['cpu_s_full_minutes'])])} | {w['cpu_s_per_minute']} | "
            f"{w.get('cpu_ratio_vs_empty', '-') if k != 'empty' else '1'} | {w['vm_hwm_mb']} | {w['done_line']} |"
        )
    for k in ("acked", "held"):
        a = r["analyses"][k]
        w = r["runs"][k]
        out.append("")
        out.append(f"### {k}")
        out.append("")
        out.append(
            f"- ticks on time (after the worker's start): expected {a['expected_on_time']:,}, "
            f"paired with a job {a['paired_on_time']:,}"
        )
        out.append(
            f"- ticks due at the start (catch-up of ticks since the schedule was set or last decided): "
            f"expected {a['expected_catch_up']:,}, paired {a['paired_catch_up']:,}; expected missed "
            f"(older than the catch-up window) {a['expected_missed']:,}, counted missed {a['counter_missed']:,}"
        )
        out.append(
            f"- jobs of the run: {a['jobs_stored']:,} ({a['jobs_finished']:,} finished, "
            f"{a['jobs_live_at_stop']:,} live at the stop); `fired` counters rose by {a['counter_fired']:,}; "
            f"skipped {a['counter_skipped']:,}"
            + (f"; handler lines {a['handler_lines']:,}" if "handler_lines" in a else "")
        )
        out.append(
            f"- keys whose job count differs from their ticks: {a['keys_mismatched']:,} "
            f"(missing {a['missing']:,}, doubled {a['doubled']:,}); on-time jobs whose created_ms floored "
            f"to the minute is not their tick: {a['on_time_floor_mismatch']:,}"
        )
        if k == "held":
            out.append(f"- enqueue delay, created_ms - tick, on-time ticks: {fmt_dist(a['enqueue_delay'])}")
            for t in a["per_tick"]:
                out.append(
                    f"  - tick {t['tick']} UTC: {t['n']:,} jobs, p50 {fmt_ms(t['p50'])}, last job at +{fmt_ms(t['last'])}"
                )
            c = a["catch_up_created_after_start"]
            if c["n"]:
                out.append(
                    f"- catch-up jobs enqueued after the worker was spawned: p50 +{fmt_ms(c['p50'])}, "
                    f"last +{fmt_ms(c['max'])} (n = {c['n']:,})"
                )
        else:
            out.append(f"- tick to first attempt start, on-time ticks: {fmt_dist(a['start_delay'])}")
        if w.get("warnings"):
            out.append(f"- worker warnings (first): {w['warnings'][0][:200]}")
    return out


def report_accuracy(r: dict) -> List[str]:
    w = r["run"]
    out = [f"## Part accuracy: one schedule every 1s, {r['minutes']} min", ""]
    out.append(
        f"- ticks expected from the set to 1 s before the stop: {r['ticks_required']:,} "
        f"({r['ticks_due_at_start']} of them due when the worker started), plus {r['ticks_optional']} in the "
        f"last second (a job or none); jobs {r['jobs']:,} (paired {r['pairing']}): missing {r['missing']}, "
        f"doubled {r['doubled']}; `fired` counter +{r['counter_fired']:,}, missed +{r['counter_missed']:,}; "
        f"live at the stop {r['live_at_stop']}"
    )
    out.append(
        f"- jobs whose created_ms floored to the second is not their tick: {r['floor_mismatch']}; "
        f"without a created_ms: {r['jobs_without_created']}; `job show` failures in the handler: {r['job_show_failed']}"
    )
    out.append(f"- enqueue delay, created_ms - tick: {fmt_dist(r['enqueue_delay'])}")
    out.append(f"- handler start - tick: {fmt_dist(r['handler_start_delay'])}")
    out.append(
        f"- drift: first minute p50 {fmt_ms(r['first_minute']['p50'])} (max {fmt_ms(r['first_minute']['max'])}), "
        f"last minute p50 {fmt_ms(r['last_minute']['p50'])} (max {fmt_ms(r['last_minute']['max'])}); "
        f"least-squares slope {r['slope_ms_per_minute']} ms per minute"
    )
    out.append(
        f"- worker: {w['wall_s']} s, CPU {w['cpu_s_total']} s ({w['cpu_s_per_minute'] if w['cpu_s_per_minute'] is not None else '-'} s per full minute), "
        f"VmHWM {w['vm_hwm_mb']} MB; {w['done_line']}"
    )
    if w.get("warnings"):
        out.append(f"- worker warnings (first): {w['warnings'][0][:200]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring (head of this file) for what each figure means.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--bin", default=None, help="shardq binary (default $SHARDQ_BIN or target/release/shardq)")
    p.add_argument("--part", choices=["many", "accuracy", "both"], default="both",
                   help="which part to run; both runs them one after the other (default both)")
    p.add_argument("--schedules", type=int, default=10_000, help="many: schedules to set (default 10000, at most 10000)")
    p.add_argument("--minutes", type=int, default=3, help="many: minutes of each worker run (default 3, at least 2)")
    p.add_argument("--lead-s", type=float, default=20.0,
                   help="many: seconds each run starts before its first whole minute (default 20)")
    p.add_argument("--tail-s", type=float, default=30.0,
                   help="many: seconds each run goes on after its last whole minute (default 30)")
    p.add_argument("--set-with", choices=["apply", "set"], default="apply",
                   help="many: set the schedules in one `schedule apply` (default) or one `schedule set` each")
    p.add_argument("--set-budget-s", type=float, default=900.0,
                   help="many: stop setting schedules after this many seconds and use those set (default 900)")
    p.add_argument("--accuracy-minutes", type=float, default=10.0, help="accuracy: minutes of the run (default 10)")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--json", action="store_true", help="print the raw figures as JSON instead of markdown")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (its path goes to stderr)")
    args = p.parse_args()
    if not 1 <= args.schedules <= SCHEDULES_MAX:
        raise SystemExit(f"--schedules must be 1..{SCHEDULES_MAX}")
    if args.minutes < 2:
        raise SystemExit("--minutes must be at least 2")
    if args.accuracy_minutes < 1:
        raise SystemExit("--accuracy-minutes must be at least 1")
    binary = args.bin or os.environ.get("SHARDQ_BIN") or os.path.join(ROOT, "target", "release", "shardq")
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"not an executable: {binary} (build it: cargo build --release -p shardq)")
    workdir = tempfile.mkdtemp(prefix="shardq-schedules-")
    if args.keep:
        log(f"working in {workdir}")
    results = []
    lines = [f"Run at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; {os.cpu_count()} CPUs; "
             f"load average at start {os.getloadavg()[0]:.2f}.", ""]
    try:
        if args.part in ("many", "both"):
            r = part_many(args, binary, workdir)
            results.append(r)
            lines += report_many(r) + [""]
        if args.part in ("accuracy", "both"):
            r = part_accuracy(args, binary, workdir)
            results.append(r)
            lines += report_accuracy(r) + [""]
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    lines.append(f"Load average at the end {os.getloadavg()[0]:.2f}.")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        for r in results:
            print(json.dumps(r))
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
