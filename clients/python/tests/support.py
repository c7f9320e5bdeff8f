"""Test support: the Rust binary (built once per session), redis-server
processes on free loopback ports, bounded waits. Nothing here skips: a
missing tool fails the test with a message saying what to install."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import json
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

from shardq import NewJob

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
#: Bound on every wait in these tests, in seconds.
WAIT_MAX_S = 90.0
#: Bound of the waits on a ``shardq serve`` (each test is meant to take a few seconds).
WAIT_S = 30.0

_build_lock = threading.Lock()
_binary: Optional[str] = None


#: Environment variable naming a prebuilt ``shardq`` binary: when set, the
#: tests use it and run no cargo.
BIN_ENV = "SHARDQ_BIN"


def shardq_binary() -> str:
    """``$SHARDQ_BIN`` when set (an executable; no cargo is run), else
    ``target/debug/shardq``, built with ``cargo build -p shardq`` once per
    session (cargo makes it a no-op when it is fresh)."""
    global _binary
    with _build_lock:
        if _binary is not None:
            return _binary
        given = os.environ.get(BIN_ENV)
        if given:
            path = os.path.abspath(given)
            if not os.path.isfile(path) or not os.access(path, os.X_OK):
                raise AssertionError(
                    f"{BIN_ENV}={given!r} is not an executable file: point it at a built shardq binary "
                    f"(cargo build -p shardq makes target/debug/shardq), or unset it to build one"
                )
            _binary = path
            return path
        cargo = shutil.which("cargo")
        if cargo is None:
            raise AssertionError(
                "cargo is not on PATH: these tests need the Rust binary (cargo build -p shardq "
                "from the repository root); install Rust (https://rustup.rs)"
            )
        out = subprocess.run(
            [cargo, "build", "-q", "-p", "shardq"], cwd=REPO_ROOT, capture_output=True, text=True
        )
        if out.returncode != 0:
            raise AssertionError(f"cargo build -p shardq failed in {REPO_ROOT}:\n{out.stderr}")
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO_ROOT, "target"))
        path = os.path.join(target, "debug", "shardq")
        if not os.access(path, os.X_OK):
            raise AssertionError(f"cargo build -p shardq succeeded but {path} is not an executable")
        _binary = path
        return path


def shardq(*args: str, check: bool = True, timeout: float = WAIT_MAX_S) -> subprocess.CompletedProcess:
    out = subprocess.run([shardq_binary(), *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"shardq {' '.join(args)} exited {out.returncode}:\n{out.stderr}")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, done: Callable[[], bool], timeout_s: float = WAIT_MAX_S, every_s: float = 0.02) -> None:
    """Polls ``done`` until it is true; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


class RedisServer:
    """A redis-server on a free loopback port with no persistence, in its own
    temporary directory; :meth:`stop` ends it."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise AssertionError(
                "redis-server is not on PATH: install it (Debian/Ubuntu: apt-get install redis-server)"
            )
        self.dir = tempfile.mkdtemp(prefix="shardq-py-redis-")
        last = ""
        for _ in range(5):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
                 "--appendonly", "no", "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            self.proc.kill()
            self.proc.wait()
            last = self.log()
        raise AssertionError(f"redis-server did not start on a free port; its log:\n{last}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "redis.log")) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def stop_process(proc: subprocess.Popen, what: str, sig: int = signal.SIGTERM, timeout_s: float = WAIT_MAX_S) -> int:
    """Sends ``sig`` and waits (bounded) for the process to exit."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{what} (pid {proc.pid}) did not exit within {timeout_s:.0f} s of signal {sig}")


def read_lines(path: str) -> List[str]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return [l for l in f.read().split("\n") if l]
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------- shardq serve

def http_get(url: str, timeout: float = 2.0, token: Optional[str] = None) -> Tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None


class Serve:
    """One ``shardq serve`` process over ``data`` on a fixed loopback port
    (kept across restarts); its output goes to ``log_path``."""

    def __init__(self, data: str, shards: int) -> None:
        self.data = data
        self.shards = shards
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(os.path.dirname(data), f"serve-{self.port}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0
        #: More ``serve`` options, for the next start.
        self.args: List[str] = []

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [shardq_binary(), "serve", "--data", self.data, "--listen", f"127.0.0.1:{self.port}", *self.args],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        self.starts += 1
        wait_until(f"shardq serve on {self.url} to be ready with all {self.shards} shards (log {self.log_path})",
                   self._ready, timeout_s=WAIT_S, every_s=0.02)

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"shardq serve exited with {self.proc.returncode}:\n{self.log()}")
        try:
            status, doc = http_get(self.url + "/readyz", 0.5)
        except OSError:
            return False
        return status == 200 and bool(doc.get("ready")) and len(doc.get("owned", [])) == self.shards

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        return stop_process(self.proc, "shardq serve", sig, WAIT_S)

    def status(self, token: Optional[str] = None) -> Dict[str, Any]:
        code, doc = http_get(self.url + "/v1/status", token=token)
        assert code == 200, (code, doc)
        assert doc["failed"] == [], doc
        return doc

    def totals(self, token: Optional[str] = None) -> Dict[str, int]:
        return self.status(token)["totals"]

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-4000:]
        except FileNotFoundError:
            return ""


def jobs_for(tag: str, keys: int, per_key: int) -> List[NewJob]:
    """``per_key`` jobs for each of ``keys`` keys, interleaved across keys,
    payload ``{"seq": n}``, dedup id ``TAG-KEY-SEQ``."""
    return [
        NewJob(f"k-{k}", json.dumps({"seq": s}), dedup_id=f"{tag}-k-{k}-{s}")
        for s in range(per_key) for k in range(keys)
    ]


def check_order_and_completeness(records: List[Dict[str, Any]], keys: int, per_key: int) -> None:
    """Records are handler starts in time order. Per key, the seqs started
    never go back (a re-run repeats the job that was running, never an
    earlier one), every seq ran, and every run of a seq is the same job id
    (a job stored twice would show two ids)."""
    by_key: Dict[str, List[int]] = defaultdict(list)
    ids: Dict[Tuple[str, int], set] = defaultdict(set)
    for r in records:
        by_key[r["key"]].append(r["seq"])
        ids[(r["key"], r["seq"])].add(r["id"])
    assert sorted(by_key) == sorted(f"k-{k}" for k in range(keys)), "a key's jobs never ran"
    for key, seqs in by_key.items():
        assert all(a <= b for a, b in zip(seqs, seqs[1:])), f"key {key} ran out of order: {seqs}"
        assert sorted(set(seqs)) == list(range(per_key)), f"key {key} lost jobs: {sorted(set(seqs))}"
    two = {k: v for k, v in ids.items() if len(v) != 1}
    assert not two, f"jobs stored twice (several ids for one enqueued job): {dict(list(two.items())[:5])}"


def check_two_server_round_trip(a: Any, b: Any, overlaps: List[str], seen: Dict[str, List[int]],
                                keys: int, per_key: int) -> None:
    """After a worker ran the jobs of stand-in servers ``a`` (keys ``a-*``)
    and ``b`` (``b-*``): no two runs of a key overlapped, each key's seqs
    ran once in order, every job was acked on its own server."""
    assert not a.shape_errors and not b.shape_errors, a.shape_errors + b.shape_errors
    assert not overlaps, f"two runs of one key overlapped: {overlaps}"
    assert len(seen) == 2 * keys
    for key, seqs in seen.items():
        assert seqs == list(range(per_key)), f"{key}: {seqs}"
    assert (len(a.acked), len(b.acked)) == (keys * per_key, keys * per_key)


def totals_of(url: str, token: Optional[str] = None) -> Dict[str, int]:
    """``GET /v1/status`` totals of the server at ``url``."""
    code, doc = http_get(url + "/v1/status", token=token)
    assert code == 200, (code, doc)
    return doc["totals"]


def all_done(url: str, token: Optional[str] = None) -> bool:
    """Nothing ready, delayed or in flight at ``url`` (dead letters aside)."""
    t = totals_of(url, token)
    return t["ready"] == 0 and t["delayed"] == 0 and t["in_flight"] == 0


TOKEN = "test-token-0123456789abcdef"


def write_tokens(path: str, token: str = TOKEN, roles: str = "produce,work,read,admin") -> str:
    with open(path, "w") as f:
        f.write(f"{token} {roles}\n")
    return path
