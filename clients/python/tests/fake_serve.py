"""A tiny stand-in for ``shardq serve`` (http.server on a loopback port):
the HTTP contract over an in-memory queue with per-key order, one run per
key, job leases, receipts with fences, dedup ids and a bearer token. Every
request body is checked against the contract's shape (a wrong field name or
type answers 400 and is recorded in ``shape_errors``), so client tests fail
on a request the real server would refuse."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

SHAPES: Dict[str, Dict[str, Tuple[type, ...]]] = {
    "/v1/claim": {"worker": (str,), "max": (int,), "wait_ms": (int,), "lease_ms": (int,), "timeout_ms": (int,)},
    "/v1/ack": {"receipts": (list,)},
    "/v1/fail": {"receipt": (str,), "reason": (str,), "retry_in_ms": (int,)},
    "/v1/extend": {"receipts": (list,), "lease_ms": (int,)},
    "/v1/stale": {"receipts": (list,)},
}
REQUIRED = {
    "/v1/claim": {"worker", "max", "wait_ms", "lease_ms"},
    "/v1/ack": {"receipts"},
    "/v1/fail": {"receipt", "reason"},
    "/v1/extend": {"receipts", "lease_ms"},
    "/v1/stale": {"receipts"},
}
JOB_FIELDS = {"key": (str,), "payload": (str,), "payload_b64": (str,), "delay_ms": (int,),
              "max_attempts": (int,), "dedup_id": (str,)}


def now_ms() -> int:
    return int(time.monotonic() * 1000)


class FakeServe:
    def __init__(self, name: str, token: Optional[str] = None):
        self.name = name
        self.token = token
        self.lock = threading.Condition()
        self.requests: List[Tuple[str, Any]] = []
        self.shape_errors: List[str] = []
        self.next_id = 1
        self.fence = 0
        self.jobs: Dict[int, Dict[str, Any]] = {}
        self.queues: Dict[str, Deque[int]] = {}
        self.flying: Dict[str, Tuple[int, int, int]] = {}  # key -> (id, fence, lease deadline)
        self.dedup: Dict[str, int] = {}
        self.acked: List[int] = []
        #: Hook: (path, body) -> optional (status, body) to answer instead.
        self.intercept: Optional[Callable[[str, Any], Optional[Tuple[int, Any]]]] = None
        #: Fixed answers (status, body) to POSTs of paths outside the
        #: worker's contract (the admin routes), by path as sent.
        self.answers: Dict[str, Tuple[int, Any]] = {}
        server = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                status, body = server.handle(self.path, self.headers.get("Authorization"), raw)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- the contract ---------------------------------------------------------

    def _shape(self, path: str, doc: Any) -> Optional[str]:
        if not isinstance(doc, dict):
            return "the body must be a JSON object"
        if path == "/v1/jobs":
            jobs = doc.get("jobs")
            if set(doc) != {"jobs"} or not isinstance(jobs, list) or not jobs:
                return "expected {\"jobs\": [...]} with at least one job"
            for i, j in enumerate(jobs):
                if not isinstance(j, dict) or "key" not in j:
                    return f"jobs[{i}]: a job needs a key"
                for k, v in j.items():
                    if k not in JOB_FIELDS or not isinstance(v, JOB_FIELDS[k]) or isinstance(v, bool):
                        return f"jobs[{i}].{k}: unknown field or wrong type {type(v).__name__}"
                if "payload" in j and "payload_b64" in j:
                    return f"jobs[{i}]: payload and payload_b64 both given"
            return None
        if path not in SHAPES:
            return f"unknown path {path}"
        for k, v in doc.items():
            if k not in SHAPES[path] or not isinstance(v, SHAPES[path][k]) or isinstance(v, bool):
                return f"{k}: unknown field or wrong type {type(v).__name__}"
        missing = REQUIRED[path] - set(doc)
        if missing:
            return f"missing field(s) {sorted(missing)}"
        return None

    def handle(self, path: str, auth: Optional[str], raw: bytes) -> Tuple[int, Any]:
        try:
            doc = json.loads(raw)
        except ValueError:
            return 400, {"error": "body is not JSON"}
        with self.lock:
            self.requests.append((path, doc))
        if self.token is not None:
            if auth is None:
                return 401, {"error": "missing bearer token"}
            if auth != f"Bearer {self.token}":
                return 403, {"error": "wrong token"}
        if path in self.answers:
            return self.answers[path]
        bad = self._shape(path, doc)
        if bad:
            with self.lock:
                self.shape_errors.append(f"{path}: {bad}")
            return 400, {"error": bad}
        if self.intercept is not None:
            got = self.intercept(path, doc)
            if got is not None:
                return got
        if path == "/v1/jobs":
            return self.enqueue(doc["jobs"])
        if path == "/v1/claim":
            return self.claim(doc)
        if path == "/v1/ack":
            return self.ack(doc["receipts"])
        if path == "/v1/fail":
            return self.fail(doc)
        if path == "/v1/stale":
            return self.stale(doc)
        return self.extend(doc)

    def enqueue(self, jobs: List[Dict[str, Any]]) -> Tuple[int, Any]:
        out = []
        with self.lock:
            for j in jobs:
                d = j.get("dedup_id")
                if d is not None and d in self.dedup:
                    jid = self.dedup[d]
                    out.append({"id": f"{self.name}:{jid}", "shard": self.name, "key": j["key"], "duplicate": True})
                    continue
                payload = base64.b64decode(j["payload_b64"]) if "payload_b64" in j else j.get("payload", "").encode()
                jid = self.next_id
                self.next_id += 1
                self.jobs[jid] = {"key": j["key"], "payload": payload, "attempt": 0,
                                  "max_attempts": j.get("max_attempts", 5), "not_before": now_ms() + j.get("delay_ms", 0)}
                self.queues.setdefault(j["key"], deque()).append(jid)
                if d is not None:
                    self.dedup[d] = jid
                out.append({"id": f"{self.name}:{jid}", "shard": self.name, "key": j["key"], "duplicate": False})
            self.lock.notify_all()
        return 200, {"jobs": out}

    def _expire(self) -> None:
        t = now_ms()
        for key, (jid, _, until) in list(self.flying.items()):
            if until <= t:
                del self.flying[key]
                self.queues.setdefault(key, deque()).appendleft(jid)

    def claim(self, doc: Dict[str, Any]) -> Tuple[int, Any]:
        deadline = time.monotonic() + doc["wait_ms"] / 1000
        with self.lock:
            while True:
                self._expire()
                got = []
                for key, q in self.queues.items():
                    if len(got) >= doc["max"]:
                        break
                    if q and key not in self.flying and self.jobs[q[0]]["not_before"] <= now_ms():
                        jid = q.popleft()
                        self.fence += 1
                        job = self.jobs[jid]
                        job["attempt"] += 1
                        until = now_ms() + doc["lease_ms"]
                        self.flying[key] = (jid, self.fence, until)
                        got.append({"id": f"{self.name}:{jid}", "shard": self.name, "key": key,
                                    "payload_b64": base64.b64encode(job["payload"]).decode(),
                                    "attempt": job["attempt"], "max_attempts": job["max_attempts"],
                                    "receipt": f"{self.name}:{jid}.{self.fence}",
                                    "fence": self.fence, "lease_expires_ms": until})
                left = deadline - time.monotonic()
                if got or left <= 0:
                    return 200, {"jobs": got}
                self.lock.wait(min(left, 0.05))

    def _current(self, receipt: Any) -> Optional[str]:
        """The key whose current run ``receipt`` names, else None."""
        try:
            name, rest = str(receipt).split(":", 1)
            jid, fence = (int(x) for x in rest.split("."))
        except ValueError:
            return None
        if name != self.name or jid not in self.jobs:
            return None
        key = self.jobs[jid]["key"]
        f = self.flying.get(key)
        if f is None or f[0] != jid or f[1] != fence or f[2] <= now_ms():
            return None
        return key

    def ack(self, receipts: List[Any]) -> Tuple[int, Any]:
        # As shardq serve: the current runs are acked, the others listed in a 409.
        stale = []
        with self.lock:
            self._expire()
            for r in receipts:
                key = self._current(r)
                if key is None:
                    stale.append(r)
                    continue
                jid = self.flying.pop(key)[0]
                del self.jobs[jid]
                self.acked.append(jid)
            self.lock.notify_all()
        n = len(receipts) - len(stale)
        if stale:
            return 409, {"error": f"ack: {len(stale)} stale receipts", "acked": n, "stale": stale, "not_owned": []}
        return 200, {"acked": n}

    def fail(self, doc: Dict[str, Any]) -> Tuple[int, Any]:
        with self.lock:
            self._expire()
            key = self._current(doc["receipt"])
            if key is None:
                return 409, {"error": f"fail: receipt {doc['receipt']} is stale"}
            jid = self.flying.pop(key)[0]
            job = self.jobs[jid]
            job["reason"] = doc["reason"]
            job["not_before"] = now_ms() + doc.get("retry_in_ms", 0)
            retry = job["attempt"] < job["max_attempts"]
            if retry:
                self.queues.setdefault(key, deque()).appendleft(jid)
            self.lock.notify_all()
        if retry:
            return 200, {"outcome": "retry", "retry_at_ms": job["not_before"]}
        return 200, {"outcome": "dead"}

    def stale(self, doc: Dict[str, Any]) -> Tuple[int, Any]:
        """Read-only: the receipts that name no current run (a lapsed run
        still counts until a claim or extend ends it, as on the server)."""
        def over(r: Any) -> bool:
            try:
                name, rest = str(r).split(":", 1)
                jid, fence = (int(x) for x in rest.split("."))
            except ValueError:
                return True
            f = self.flying.get(self.jobs[jid]["key"]) if name == self.name and jid in self.jobs else None
            return f is None or (f[0], f[1]) != (jid, fence)

        with self.lock:
            return 200, {"stale": [r for r in doc["receipts"] if over(r)], "not_owned": []}

    def extend(self, doc: Dict[str, Any]) -> Tuple[int, Any]:
        stale = []
        with self.lock:
            self._expire()
            for r in doc["receipts"]:
                key = self._current(r)
                if key is None:
                    stale.append(r)
                    continue
                jid, fence, _ = self.flying[key]
                self.flying[key] = (jid, fence, now_ms() + doc["lease_ms"])
        n = len(doc["receipts"]) - len(stale)
        if stale:
            return 409, {"error": f"extend: {len(stale)} stale receipts", "extended": n, "stale": stale, "not_owned": []}
        return 200, {"extended": n}

    def count(self, path: str) -> int:
        with self.lock:
            return sum(1 for p, _ in self.requests if p == path)

    def pending(self) -> int:
        with self.lock:
            return len(self.jobs)
