#!/usr/bin/env python3
"""What unauthenticated or slow clients cost `shardq serve` in memory: the
server's resident size (VmRSS) before, at the peak during, and after two
attacks, each on a fresh server (see BENCHMARKS.md, "Memory and the server
under attack").

    python3 benchmarks/serve_memory.py [--bin [NAME=]PATH ...] [--attack headers|bodies|both]
                                       [--repeat N] [--json]

headers: --connections sockets (1,000) each send --header-bytes bytes
  (390,000) of a request whose header never ends: a request line, a Host
  and one header line that never gets its end of line. No token is sent
  (a header that never ends is never authenticated). Each socket stops when
  it has sent everything or the server answered or closed it; the sockets
  stay open --hold-s seconds more, then the client closes them all.
bodies: --bodies sockets (32) each send `POST /v1/jobs` with a valid
  produce token, `Content-Length: --body-bytes` (16 MiB) and all of the body
  but its last byte, which is never sent. The client then waits (at most
  --answer-wait-s, 45 s) until every socket is answered or closed by the
  server: a held body is answered when --body-read-timeout-ms (30 s by
  default) runs out. Then it closes them.

For each attack the server is started on a fresh data dir (`shardq init
--shards 2`, embedded), on a free loopback port, with a tokens file (so the
server authenticates), its default limits and no other flag; it must
answer /readyz first. RSS is read from /proc/PID/status every 20 ms:
"before" just before the attack (1 s after /readyz), "peak" the largest
sample from the attack's start to the "after" sample, "held" when every
socket has sent what it will send, "after" --settle-s seconds after the
client closed every socket. VmHWM (the kernel's own high-water mark of
the server's life) is reported beside the sampled peak. MB are 10^6 bytes.

Answers are counted per socket by the status code of the first answer
read from it; "closed" is a socket the server closed without an answer
the client could read, "none" one still open without an answer when the
client closed it.

With several --bin, every repeat runs each binary in turn (NAME=PATH names
it; the default is $SHARDQ_BIN or target/release/shardq). --json prints
one JSON line per run on stdout; otherwise a table. A summary line per run
goes to stderr either way. Loopback only: the server listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import errno
import http.client
import json
import os
import resource
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from bench_support import free_port, log, proc_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
MB = 1_000_000
CHUNK = 256 * 1024








class Sampler:
    """Reads a process's VmRSS every `interval` s in a thread and keeps the
    largest sample since the last `reset_peak`."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = proc_memory(self.pid)["VmRSS"]
            except (OSError, KeyError):
                return
            with self._lock:
                self.peak = max(self.peak, rss)
                self.samples += 1
            self._stop.wait(self.interval)

    def now(self) -> int:
        rss = proc_memory(self.pid)["VmRSS"]
        with self._lock:
            self.peak = max(self.peak, rss)
        return rss

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = 0
            self.samples = 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Server:
    """`shardq serve` on a fresh embedded data dir of 2 shards, with a tokens
    file holding one produce token."""

    def __init__(self, binary: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="shardq-serve-memory-")
        self.data = os.path.join(self.dir, "data")
        subprocess.run(
            [binary, "init", "--data", self.data, "--shards", "2"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.token = secrets.token_hex(16)
        tokens = os.path.join(self.dir, "tokens")
        fd = os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.token} produce\n")
        self.port = free_port()
        self.log_path = os.path.join(self.dir, "serve.log")
        self.log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "serve", "--data", self.data, "--listen", f"{HOST}:{self.port}", "--tokens", tokens],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shardq serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                c = http.client.HTTPConnection(HOST, self.port, timeout=2)
                c.request("GET", "/readyz")
                status = c.getresponse().status
                c.close()
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"shardq serve not ready within {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Conn:
    __slots__ = ("sock", "sent", "total", "answer", "state", "closed_by_server")

    def __init__(self, sock: socket.socket, total: int) -> None:
        self.sock = sock
        self.sent = 0
        self.total = total
        self.answer = b""
        self.state = "sending"  # sending -> waiting -> done
        self.closed_by_server = False

    def status(self) -> Optional[str]:
        line = self.answer.split(b"\r\n", 1)[0]
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and b"\r\n" in self.answer:
            return parts[1].decode("ascii", "replace")
        return None


def raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            raise SystemExit(f"need {need} open files, the hard limit is {hard}")


def attack(
    port: int,
    count: int,
    payload: bytes,
    send_bytes: int,
    sampler: Sampler,
    hold_s: float,
    answer_wait_s: float,
    wait_for_answers: bool,
) -> Tuple[List[Conn], Dict[str, float]]:
    """Opens `count` sockets, each sending `payload[:send_bytes]` (the same
    bytes for all), reading whatever the server answers meanwhile. Returns
    the sockets (still open, for the caller to close) and timings."""
    raise_nofile(count + 256)
    sel = selectors.DefaultSelector()
    conns: List[Conn] = []
    view = memoryview(payload)
    t0 = time.monotonic()
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex((HOST, port))
        if err not in (0, errno.EINPROGRESS):
            raise OSError(err, os.strerror(err))
        c = Conn(s, send_bytes)
        conns.append(c)
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, c)

    def finish_sending(c: Conn) -> None:
        if c.state == "sending":
            c.state = "waiting"
            try:
                sel.modify(c.sock, selectors.EVENT_READ, c)
            except (KeyError, ValueError):
                pass

    def server_closed(c: Conn) -> None:
        c.closed_by_server = True
        c.state = "done"
        try:
            sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass

    sent_at: Optional[float] = None
    held_rss = 0
    deadline: Optional[float] = None
    while True:
        now = time.monotonic()
        sending = sum(1 for c in conns if c.state == "sending")
        if sending == 0 and sent_at is None:
            sent_at = now
            held_rss = sampler.now()
            limit = answer_wait_s if wait_for_answers else hold_s
            deadline = now + limit
        if deadline is not None:
            if now >= deadline:
                break
            if wait_for_answers and all(c.state == "done" or c.status() for c in conns):
                break
        if not sel.get_map():
            if deadline is None:
                continue
            time.sleep(min(0.05, max(0.0, deadline - now)))
            continue
        for key, events in sel.select(timeout=0.05):
            c = key.data
            if events & selectors.EVENT_READ:
                try:
                    data = c.sock.recv(65536)
                except (ConnectionResetError, BrokenPipeError):
                    server_closed(c)
                    continue
                except BlockingIOError:
                    data = None
                if data == b"":
                    server_closed(c)
                    continue
                if data:
                    if len(c.answer) < 4096:
                        c.answer += data[: 4096 - len(c.answer)]
                    if c.status() is not None:
                        # Answered: an attacker learns nothing more by
                        # sending; the socket stays open until the end.
                        finish_sending(c)
            if events & selectors.EVENT_WRITE and c.state == "sending":
                try:
                    end = min(c.total, c.sent + CHUNK)
                    n = c.sock.send(view[c.sent : end])
                    c.sent += n
                except BlockingIOError:
                    pass
                except (ConnectionResetError, BrokenPipeError):
                    # Read what the server may have answered before it closed.
                    try:
                        data = c.sock.recv(65536)
                        c.answer += data[:4096]
                    except OSError:
                        pass
                    server_closed(c)
                    continue
                except OSError as e:
                    if e.errno in (errno.ENOTCONN, errno.EINPROGRESS):
                        continue
                    raise
                if c.sent >= c.total:
                    finish_sending(c)
    sel.close()
    times = {
        "send_s": round((sent_at or time.monotonic()) - t0, 2),
        "total_s": round(time.monotonic() - t0, 2),
        "held_rss": held_rss,
    }
    return conns, times


def count_answers(conns: List[Conn]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for c in conns:
        status = c.status()
        name = status if status else ("closed" if c.closed_by_server else "none")
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def retry_after_seen(conns: List[Conn]) -> int:
    return sum(1 for c in conns if b"\r\nretry-after:" in c.answer.lower())


def run_one(binary: str, name: str, kind: str, args: argparse.Namespace, run: int) -> dict:
    server = Server(binary)
    sampler: Optional[Sampler] = None
    conns: List[Conn] = []
    try:
        pid = server.proc.pid
        sampler = Sampler(pid)
        time.sleep(1.0)
        before = sampler.now()
        sampler.reset_peak()
        if kind == "headers":
            head = f"GET /v1/status HTTP/1.1\r\nHost: {HOST}:{server.port}\r\nX-Filler: ".encode()
            payload = head + b"a" * (args.header_bytes - len(head))
            conns, times = attack(
                server.port,
                args.connections,
                payload,
                len(payload),
                sampler,
                args.hold_s,
                args.answer_wait_s,
                wait_for_answers=False,
            )
            size = {"connections": args.connections, "bytes_each": len(payload)}
        else:
            head = (
                f"POST /v1/jobs HTTP/1.1\r\nHost: {HOST}:{server.port}\r\n"
                f"Authorization: Bearer {server.token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {args.body_bytes}\r\n\r\n"
            ).encode()
            start = b'{"jobs":[{"key":"k","payload":"'
            body = start + b"x" * (args.body_bytes - len(start))
            payload = head + body
            conns, times = attack(
                server.port,
                args.bodies,
                payload,
                len(payload) - 1,
                sampler,
                args.hold_s,
                args.answer_wait_s,
                wait_for_answers=True,
            )
            size = {"connections": args.bodies, "content_length": args.body_bytes, "body_bytes_sent": args.body_bytes - 1}
        answers = count_answers(conns)
        retry_after = retry_after_seen(conns)
        for c in conns:
            try:
                c.sock.close()
            except OSError:
                pass
        time.sleep(args.settle_s)
        after = sampler.now()
        peak = sampler.peak
        hwm = proc_memory(pid)["VmHWM"]
        alive = server.proc.poll() is None
    finally:
        for c in conns:
            try:
                c.sock.close()
            except OSError:
                pass
        if sampler is not None:
            sampler.stop()
        server.stop()
    row = {
        "bench": "serve_memory",
        "binary": name,
        "attack": kind,
        "run": run,
        **size,
        "rss_mb_before": round(before / MB, 1),
        "rss_mb_held": round(times["held_rss"] / MB, 1),
        "rss_mb_peak": round(peak / MB, 1),
        "vm_hwm_mb": round(hwm / MB, 1),
        "rss_mb_after": round(after / MB, 1),
        "answers": answers,
        "retry_after_headers": retry_after,
        "send_s": times["send_s"],
        "attack_s": times["total_s"],
        "server_alive": alive,
    }
    return row


def parse_bins(values: List[str]) -> List[Tuple[str, str]]:
    if not values:
        default = os.environ.get("SHARDQ_BIN") or os.path.join(ROOT, "target", "release", "shardq")
        values = [default]
    out = []
    for i, v in enumerate(values):
        if "=" in v:
            name, path = v.split("=", 1)
        else:
            name, path = (f"bin{i}" if len(values) > 1 else "shardq"), v
        if not os.access(path, os.X_OK):
            raise SystemExit(f"not an executable: {path} (build it: cargo build --release -p shardq)")
        out.append((name, path))
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring (head of this file) for what each figure means.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--bin", action="append", default=[], metavar="[NAME=]PATH",
                   help="shardq binary to measure (repeatable; default $SHARDQ_BIN or target/release/shardq)")
    p.add_argument("--attack", choices=["headers", "bodies", "both"], default="both")
    p.add_argument("--repeat", type=int, default=1, help="rounds; each runs every binary in turn (default 1)")
    p.add_argument("--connections", type=int, default=1000, help="headers: sockets (default 1000)")
    p.add_argument("--header-bytes", type=int, default=390_000,
                   help="headers: bytes each socket sends of a header that never ends (default 390000)")
    p.add_argument("--bodies", type=int, default=32, help="bodies: sockets (default 32)")
    p.add_argument("--body-bytes", type=int, default=16 << 20,
                   help="bodies: announced Content-Length; one byte less is sent (default 16777216)")
    p.add_argument("--hold-s", type=float, default=3.0,
                   help="headers: seconds the sockets stay open after the last byte is sent (default 3)")
    p.add_argument("--answer-wait-s", type=float, default=45.0,
                   help="bodies: longest wait for every socket's answer after the last byte is sent (default 45)")
    p.add_argument("--settle-s", type=float, default=3.0,
                   help="seconds between closing the sockets and the 'after' sample (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON line per run on stdout instead of a table")
    args = p.parse_args()
    if args.header_bytes < 100 or args.body_bytes < 64:
        raise SystemExit("--header-bytes must be >= 100 and --body-bytes >= 64")
    bins = parse_bins(args.bin)
    kinds = ["headers", "bodies"] if args.attack == "both" else [args.attack]
    rows = []
    for run in range(1, args.repeat + 1):
        for name, path in bins:
            for kind in kinds:
                row = run_one(path, name, kind, args, run)
                rows.append(row)
                log(
                    f"{name} {kind} run {run}: RSS {row['rss_mb_before']} -> held {row['rss_mb_held']}, "
                    f"peak {row['rss_mb_peak']} (VmHWM {row['vm_hwm_mb']}) -> after {row['rss_mb_after']} MB; "
                    f"answers {row['answers']}; sent in {row['send_s']} s"
                )
                if args.json:
                    print(json.dumps(row), flush=True)
    if not args.json:
        print(f"{'binary':<12} {'attack':<8} {'run':>3} {'before':>8} {'held':>8} {'peak':>8} {'VmHWM':>8} {'after':>8}  answers (MB = 10^6 bytes)")
        for r in rows:
            print(
                f"{r['binary']:<12} {r['attack']:<8} {r['run']:>3} {r['rss_mb_before']:>8} {r['rss_mb_held']:>8} "
                f"{r['rss_mb_peak']:>8} {r['vm_hwm_mb']:>8} {r['rss_mb_after']:>8}  "
                + ", ".join(f"{k}: {v}" for k, v in r["answers"].items())
            )


if __name__ == "__main__":
    main()
