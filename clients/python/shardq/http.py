"""Clients of the HTTP API of ``shardq serve``: :class:`Client` enqueues,
:class:`Worker` claims, runs, heartbeats and acks.

Only the standard library (``http.client``): no dependency to install next
to a worker, keep-alive connections (one per thread and server), and the
timeouts are ours to set per request (a long poll needs a longer one).

Contract (``POST``, JSON bodies, ``Authorization: Bearer TOKEN`` when a
token is given):

* ``/v1/jobs`` ``{"jobs": [{"key", "payload" | "payload_b64", "delay_ms",
  "max_attempts", "dedup_id"}]}`` -> ``{"jobs": [{"id", "shard", "key",
  "duplicate"}]}``; a job id is the string ``SHARD:ID``
* ``/v1/claim`` ``{"worker", "max", "wait_ms", "lease_ms"}`` -> ``{"jobs":
  [{"id", "shard", "key", "payload" | "payload_b64", "attempt",
  "max_attempts", "receipt", "fence", "lease_expires_ms"}]}``; a receipt is
  the string ``SHARD:ID.FENCE``
* ``/v1/ack`` ``{"receipts": [...]}`` -> ``{"acked": n}``, ``/v1/fail``
  ``{"receipt", "reason", "retry_in_ms"?}``, ``/v1/extend`` ``{"receipts":
  [...], "lease_ms"}`` -> ``{"extended": n}``
* 409 for a stale receipt; with several receipts the valid ones take effect
  and the body lists the others: ``{"error", "acked" | "extended", "stale":
  [...], "not_owned": [...]}``. 409 on ``/v1/jobs``: a job's dedup id is
  being enqueued by another request at this moment (retried). 400
  ``{"error": ...}`` for bad input, 401/403 for a missing or wrong token.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import random
import signal
import socket
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union
from urllib.parse import urlparse

from .errors import BadRequest, HttpError, ServerUnavailable, StaleReceipt, Unauthorized

log = logging.getLogger("shardq")

#: Timeout of a request other than a claim, in seconds.
REQUEST_TIMEOUT_S = 10.0
#: Rounds over every URL before an enqueue gives up.
RETRY_ROUNDS_DEFAULT = 5
#: Backoff between rounds, in ms: doubles from the first to the cap, with jitter.
BACKOFF_FIRST_MS = 50
BACKOFF_MAX_MS = 2_000
#: Most jobs per ``/v1/jobs`` request (the server's default
#: ``--jobs-per-request-max``).
ENQUEUE_BATCH_MAX = 1000
#: Most jobs asked for by one claim (the server's ``CLAIM_MAX_LIMIT``).
CLAIM_MAX = 1000
#: Default long-poll wait of a claim, in ms.
CLAIM_WAIT_MS_DEFAULT = 5_000
#: Attempts at an ack or fail before leaving the run to its lease.
RESULT_ATTEMPTS = 5
#: Most receipts one batched ``/v1/ack`` carries (the server's bound).
ACK_BATCH_MAX = 1000

Payload = Union[bytes, str]


def _std_dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


try:  # orjson (the "fast" extra) when installed: a third of the cost per job
    import orjson as _orjson

    _dumps: Callable[[Any], bytes] = _orjson.dumps
    _loads: Callable[[Union[bytes, str]], Any] = _orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _dumps = _std_dumps
    _loads = json.loads

_LOST_LOCK = threading.Lock()


def _normalise_urls(urls: Union[str, Sequence[str]]) -> List[str]:
    if isinstance(urls, str):
        urls = [u for u in urls.split(",") if u.strip()]
    out = []
    for u in urls:
        u = u.strip().rstrip("/")
        p = urlparse(u)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise ValueError(f"invalid server URL {u!r}: expected http://HOST:PORT or https://HOST:PORT")
        out.append(u)
    if not out:
        raise ValueError("no server URL given")
    return out


class _Transport:
    """POSTs JSON to one server over keep-alive connections, one per thread."""

    def __init__(self, url: str, token: Optional[str]):
        self.url = url
        p = urlparse(url)
        self.https = p.scheme == "https"
        self.host = p.hostname or ""
        self.port = p.port or (443 if self.https else 80)
        self.prefix = p.path
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.local = threading.local()

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        c = getattr(self.local, "conn", None)
        if c is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            c = cls(self.host, self.port, timeout=timeout)
            self.local.conn = c
        c.timeout = timeout
        if c.sock is not None:
            c.sock.settimeout(timeout)
        return c

    def _drop(self) -> None:
        c = getattr(self.local, "conn", None)
        if c is not None:
            c.close()
        self.local.conn = None

    def post(self, path: str, body: Mapping[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> Tuple[int, Any]:
        """Sends one request: (status, decoded JSON body or None). Raises
        ``OSError``/``http.client.HTTPException`` for transport failures."""
        data = _dumps(body)
        c = self._conn(timeout)
        try:
            c.request("POST", self.prefix + path, body=data, headers=self.headers)
            resp = c.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException):
            self._drop()
            raise
        if resp.getheader("Connection", "").lower() == "close":
            self._drop()
        try:
            doc = _loads(raw) if raw else None
        except ValueError:
            doc = raw.decode("utf-8", "replace")
        return resp.status, doc

    def close(self) -> None:
        self._drop()


def _error_of(doc: Any) -> str:
    if isinstance(doc, dict) and "error" in doc:
        return str(doc["error"])
    return str(doc)[:500] if doc is not None else ""


def _raise_for(url: str, status: int, doc: Any) -> None:
    msg = _error_of(doc)
    if status == 400:
        raise BadRequest(url, status, msg)
    if status in (401, 403):
        raise Unauthorized(url, status, msg)
    if status == 409:
        raise StaleReceipt(url, status, msg)
    raise HttpError(url, status, msg)


def _retryable(status: int) -> bool:
    return status in (408, 425, 429) or status >= 500


def _backoff_ms(round_no: int) -> float:
    cap = min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * (2 ** round_no))
    return cap / 2 + random.random() * cap / 2


def _encode_payload(payload: Payload, out: Dict[str, Any]) -> None:
    if isinstance(payload, str):
        out["payload"] = payload
        return
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"a payload must be bytes or str, got {type(payload).__name__}")
    b = bytes(payload)
    try:
        out["payload"] = b.decode("utf-8")
    except UnicodeDecodeError:
        out["payload_b64"] = base64.b64encode(b).decode("ascii")


def _decode_payload(doc: Mapping[str, Any]) -> bytes:
    if doc.get("payload_b64") is not None:
        return base64.b64decode(doc["payload_b64"])
    p = doc.get("payload")
    return p.encode("utf-8") if isinstance(p, str) else b""


def _job_bodies(jobs: Iterable[Union["NewJob", Mapping[str, Any]]]) -> List[Dict[str, Any]]:
    """The ``/v1/jobs`` objects of ``jobs``, each with a dedup id.
    Generated ids are a random 96-bit prefix per call and the job's index
    (unique without a uuid per job, and safe across fork())."""
    bodies: List[Dict[str, Any]] = []
    prefix = os.urandom(12).hex()
    for n, j in enumerate(jobs):
        if not isinstance(j, NewJob):
            j = NewJob(**dict(j))
        key = j.key
        if not isinstance(key, str) or not key:
            raise ValueError(f"invalid job key {key!r}: a non-empty str is needed")
        payload = j.payload
        if isinstance(payload, str):
            b: Dict[str, Any] = {"key": key, "payload": payload}
        else:
            b = {"key": key}
            _encode_payload(payload, b)
        if j.delay_ms:
            b["delay_ms"] = int(j.delay_ms)
        if j.max_attempts is not None:
            b["max_attempts"] = int(j.max_attempts)
        b["dedup_id"] = j.dedup_id if j.dedup_id is not None else f"{prefix}-{n}"
        bodies.append(b)
    return bodies


def _enqueued_of(url: str, chunk: List[Dict[str, Any]], doc: Any) -> List["Enqueued"]:
    """The :class:`Enqueued` values of a ``/v1/jobs`` reply to ``chunk``."""
    got = doc.get("jobs") if isinstance(doc, dict) else None
    if not isinstance(got, list) or len(got) != len(chunk):
        raise HttpError(url, 200, f"/v1/jobs answered {len(got) if isinstance(got, list) else got!r} jobs for {len(chunk)}")
    return [
        Enqueued(str(g["id"]), str(g["shard"]), str(g.get("key", b["key"])), bool(g.get("duplicate", False)), b["dedup_id"])
        for b, g in zip(chunk, got)
    ]


def _claimed_of(url: str, doc: Any) -> List["ClaimedJob"]:
    """The jobs of a ``/v1/claim`` reply from ``url``."""
    return [
        ClaimedJob(
            str(j["id"]), str(j["shard"]), str(j["key"]), _decode_payload(j), int(j.get("attempt", 1)),
            str(j["receipt"]), j.get("fence"), j.get("lease_expires_ms"), url, j.get("max_attempts"),
        )
        for j in (doc or {}).get("jobs", [])
    ]


def _outcome_of(job: "ClaimedJob", error: Optional[BaseException]) -> Optional[Tuple[str, Dict[str, Any]]]:
    """``None`` for a handler that returned (an ack), else the fail request."""
    if error is None:
        return None
    if isinstance(error, Retry):
        return ("/v1/fail", {"receipt": job.receipt, "reason": str(error), "retry_in_ms": int(error.retry_in_ms)})
    return ("/v1/fail", {"receipt": job.receipt, "reason": f"{type(error).__name__}: {error}"[:1024]})


def _lost_of(jobs: List["ClaimedJob"], doc: Any) -> List["ClaimedJob"]:
    """The jobs of a batched ack answered 409 whose runs were lost (the valid
    receipts were acked; without the lists, all of them)."""
    refused = set(_stale_of(doc))
    return [j for j in jobs if j.receipt in refused] if refused else list(jobs)


class Enqueued(NamedTuple):
    """A stored job: its id, shard and key; ``duplicate`` when the server
    already had a job with its dedup id (this call stored nothing new).
    Immutable; a named tuple (a frozen dataclass cost more to make than the
    rest of an enqueue per job)."""

    id: str
    shard: str
    key: str
    duplicate: bool
    dedup_id: str


@dataclass
class NewJob:
    """A job for :meth:`Client.enqueue_many`."""

    key: str
    payload: Payload = b""
    delay_ms: int = 0
    max_attempts: Optional[int] = None
    dedup_id: Optional[str] = None


class Client:
    """Enqueues over HTTP. ``urls``: one or more server URLs (a list or a
    comma-separated string); each request goes to the first that answers,
    retried with backoff over all of them (``retry_rounds`` rounds). Every
    job carries a dedup id (generated when not given), so a retry after a
    lost reply never stores a job twice."""

    def __init__(
        self,
        urls: Union[str, Sequence[str]],
        token: Optional[str] = None,
        *,
        timeout_s: float = REQUEST_TIMEOUT_S,
        retry_rounds: int = RETRY_ROUNDS_DEFAULT,
    ) -> None:
        self.urls = _normalise_urls(urls)
        self.timeout_s = timeout_s
        self.retry_rounds = retry_rounds
        self._transports = [_Transport(u, token) for u in self.urls]

    def enqueue(
        self,
        key: str,
        payload: Payload = b"",
        delay_ms: int = 0,
        max_attempts: Optional[int] = None,
        dedup_id: Optional[str] = None,
    ) -> Enqueued:
        """Enqueues one job."""
        return self.enqueue_many([NewJob(key, payload, delay_ms, max_attempts, dedup_id)])[0]

    def enqueue_many(self, jobs: Iterable[Union[NewJob, Mapping[str, Any]]]) -> List[Enqueued]:
        """Enqueues ``jobs`` (``NewJob`` values or dicts with the same
        fields), ``ENQUEUE_BATCH_MAX`` per request, in order; returns one
        :class:`Enqueued` per job."""
        bodies = _job_bodies(jobs)
        out: List[Enqueued] = []
        for start in range(0, len(bodies), ENQUEUE_BATCH_MAX):
            chunk = bodies[start:start + ENQUEUE_BATCH_MAX]
            out.extend(_enqueued_of(self.urls[0], chunk, self._post_any("/v1/jobs", {"jobs": chunk})))
        return out

    def _post_any(self, path: str, body: Mapping[str, Any]) -> Any:
        causes: Dict[str, str] = {}
        last: Optional[BaseException] = None
        for round_no in range(self.retry_rounds):
            for t in self._transports:
                try:
                    status, doc = t.post(path, body, self.timeout_s)
                except (OSError, http.client.HTTPException) as e:
                    causes[t.url] = f"{t.url}: {type(e).__name__}: {e}"
                    last = e
                    continue
                if status == 200:
                    return doc
                # 409 on an enqueue: another request holds one of the dedup
                # ids at this moment (an earlier try of this one, say): retry.
                if not _retryable(status) and not (status == 409 and path == "/v1/jobs"):
                    _raise_for(t.url, status, doc)
                causes[t.url] = f"{t.url}: {status} {_error_of(doc)}"
            if round_no + 1 < self.retry_rounds:
                time.sleep(_backoff_ms(round_no) / 1000)
        raise ServerUnavailable(f"POST {path} ({self.retry_rounds} rounds)", list(causes.values()), last)

    def close(self) -> None:
        for t in self._transports:
            t.close()


@dataclass
class ClaimedJob:
    """A job handed to a handler. ``url`` is the server that gave it: its
    ack, fail and extend go there."""

    id: str
    shard: str
    key: str
    payload: bytes
    attempt: int
    receipt: str
    fence: Optional[int]
    lease_expires_ms: Optional[int]
    url: str
    max_attempts: Optional[int] = None
    _lost: Optional[threading.Event] = field(default=None, repr=False, compare=False)
    #: When the lease ends as this process knows it (``time.monotonic()``:
    #: the claim's answer, or the last extend's send, plus the lease). A
    #: prefetched job not started by then is not run.
    _lease_until: float = field(default=float("inf"), repr=False, compare=False)

    @property
    def lost(self) -> threading.Event:
        """Set when a heartbeat learned the run is no longer current (made
        on first use: most jobs never need one)."""
        ev = self._lost
        if ev is None:
            with _LOST_LOCK:
                if self._lost is None:
                    self._lost = threading.Event()
                ev = self._lost
        return ev


class Retry(Exception):
    """Raise from a handler to fail the attempt with a given retry delay."""

    def __init__(self, reason: str, retry_in_ms: int):
        super().__init__(reason)
        self.retry_in_ms = retry_in_ms


@dataclass
class WorkerStats:
    claimed: int = 0
    acked: int = 0
    failed: int = 0
    #: Results the server refused (409): the run had been lost.
    lost: int = 0
    #: Results given up on after transport errors (the lease decides).
    unreported: int = 0
    #: Answered ``/v1/claim`` requests (claimed / this = jobs per claim).
    claim_requests: int = 0
    #: Answered ``/v1/ack`` requests (acked / this = receipts per ack).
    ack_requests: int = 0


Handler = Callable[[ClaimedJob], None]


class Worker:
    """Claims jobs from every URL with long polls, runs ``handler`` in a
    thread pool, extends the job leases of running and prefetched jobs every
    lease/3, and acks (or fails, when the handler raises) on the server that
    gave the job. :meth:`run` returns after :meth:`stop` or SIGTERM/SIGINT
    once every claimed job has run and its result has been sent."""

    def __init__(
        self,
        urls: Union[str, Sequence[str]],
        token: Optional[str] = None,
        *,
        worker_id: Optional[str] = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.urls = _normalise_urls(urls)
        self.worker_id = worker_id or f"{socket.gethostname()}@{os.getpid()}-py-{uuid.uuid4().hex[:6]}"
        self.timeout_s = timeout_s
        self._transports = {u: _Transport(u, token) for u in self.urls}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._running: Dict[int, ClaimedJob] = {}
        self._acks: Dict[str, "queue.SimpleQueue[Optional[ClaimedJob]]"] = {}
        self.stats = WorkerStats()

    def stop(self) -> None:
        """Stops claiming; :meth:`run` returns once running jobs finish."""
        self._stop.set()

    def run(
        self,
        handler: Handler,
        concurrency: int = 8,
        lease_ms: int = 30_000,
        wait_ms: int = CLAIM_WAIT_MS_DEFAULT,
        install_signal_handlers: bool = True,
        prefetch: Optional[int] = None,
    ) -> WorkerStats:
        """Runs ``handler`` on ``concurrency`` threads. ``prefetch`` (default:
        ``concurrency``) more jobs may be claimed ahead and wait here, so
        that a handler that finishes does not wait for a claim's round trip
        and claims carry several jobs; their leases are extended like those
        of running jobs. ``prefetch=0`` claims only for idle threads (for
        long jobs that another worker could start sooner)."""
        if concurrency < 1:
            raise ValueError(f"invalid concurrency {concurrency}: at least 1")
        if prefetch is None:
            prefetch = concurrency
        if prefetch < 0:
            raise ValueError(f"invalid prefetch {prefetch}: at least 0")
        if lease_ms < 100:
            raise ValueError(f"invalid lease_ms {lease_ms}: at least 100")
        self._stop.clear()
        restore = self._install_signals() if install_signal_handlers else {}
        # A token per free slot (running or prefetched): a claimer takes the
        # free ones and asks for that many jobs; a runner gives its token
        # back when its job is done. SimpleQueue rather than
        # Semaphore/ThreadPoolExecutor: no Python-level condition variables
        # or futures on the path of every job.
        slots = concurrency + prefetch
        free: "queue.SimpleQueue[int]" = queue.SimpleQueue()
        for _ in range(slots):
            free.put(1)
        work: "queue.SimpleQueue[Optional[ClaimedJob]]" = queue.SimpleQueue()
        runners = [
            threading.Thread(target=self._runner, args=(handler, work, free), name=f"shardq-job-{i}", daemon=True)
            for i in range(concurrency)
        ]
        for r in runners:
            r.start()
        beat_stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(lease_ms, beat_stop), name="shardq-extend", daemon=True)
        beat.start()
        # One acker per server: acks of jobs that finished meanwhile go in
        # one request, instead of one request per job.
        self._acks = {u: queue.SimpleQueue() for u in self.urls}
        ackers = [
            threading.Thread(target=self._ack_loop, args=(u,), name=f"shardq-ack-{i}", daemon=True)
            for i, u in enumerate(self.urls)
        ]
        for a in ackers:
            a.start()
        claimers = [
            threading.Thread(
                target=self._claim_loop, args=(url, free, slots, work, lease_ms, wait_ms),
                name=f"shardq-claim-{i}", daemon=True,
            )
            for i, url in enumerate(self.urls)
        ]
        try:
            for c in claimers:
                c.start()
            while any(c.is_alive() for c in claimers):
                for c in claimers:
                    c.join(0.1)
        finally:
            self._stop.set()
            for c in claimers:
                c.join()
            # Drain: every claimed job runs to its end and reports (the
            # stop markers queue up behind the claimed jobs).
            for _ in runners:
                work.put(None)
            for r in runners:
                r.join()
            for u in self.urls:
                self._acks[u].put(None)
            for a in ackers:
                a.join()
            beat_stop.set()
            beat.join()
            for sig, old in restore.items():
                signal.signal(sig, old)
        return self.stats

    def _install_signals(self) -> Dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            log.warning("shardq worker: not on the main thread, SIGTERM is not handled (call stop())")
            return {}
        old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, lambda *_: self.stop())
        return old

    def _claim_loop(self, url: str, free: "queue.SimpleQueue[int]", slots: int,
                    work: "queue.SimpleQueue[Optional[ClaimedJob]]", lease_ms: int, wait_ms: int) -> None:
        t = self._transports[url]
        failures = 0
        most = min(slots, CLAIM_MAX)
        while not self._stop.is_set():
            # Reserve the free slots (at least one) and ask for that many.
            try:
                free.get(timeout=0.2)
            except queue.Empty:
                continue
            want = 1
            while want < most:
                try:
                    free.get_nowait()
                except queue.Empty:
                    break
                want += 1
            jobs: List[ClaimedJob] = []
            try:
                body = {"worker": self.worker_id, "max": want, "wait_ms": wait_ms, "lease_ms": lease_ms}
                status, doc = t.post("/v1/claim", body, timeout=self.timeout_s + wait_ms / 1000)
                if status != 200:
                    _raise_for(url, status, doc)
                jobs = _claimed_of(url, doc)
                # The server started the leases just before it answered (a
                # long poll may answer late in its wait, so not at the send).
                until = time.monotonic() + lease_ms / 1000
                for j in jobs:
                    j._lease_until = until
                failures = 0
            except (OSError, http.client.HTTPException, HttpError, ValueError, KeyError) as e:
                failures += 1
                if isinstance(e, Unauthorized):
                    log.error("shardq worker: %s refused the token: %s", url, e)
                else:
                    log.warning("shardq worker: claim from %s failed (%s): %s", url, type(e).__name__, e)
                for _ in range(want):
                    free.put(1)
                self._stop.wait(_backoff_ms(min(failures, 6)) / 1000)
                continue
            for _ in range(want - len(jobs)):
                free.put(1)
            with self._lock:
                self.stats.claimed += len(jobs)
                self.stats.claim_requests += 1
                for j in jobs:
                    self._running[id(j)] = j
            for j in jobs:
                work.put(j)

    def _runner(self, handler: Handler, work: "queue.SimpleQueue[Optional[ClaimedJob]]",
                free: "queue.SimpleQueue[int]") -> None:
        while True:
            job = work.get()
            if job is None:
                return
            try:
                if self._expired_while_waiting(job):
                    continue
                self._run_one(handler, job)
            except BaseException as e:  # SystemExit and the like, raised by a handler
                with self._lock:
                    self._running.pop(id(job), None)
                log.error("shardq worker: job %s (key %r): the handler raised %s; its lease decides",
                          job.id, job.key, type(e).__name__)
            finally:
                free.put(1)

    def _expired_while_waiting(self, job: ClaimedJob) -> bool:
        """A prefetched job whose run was lost (an extend was refused) or
        whose lease has passed while it waited for a thread is not run: the
        server gives it out again, and running it now could overlap the
        next run of its key."""
        lost = job._lost is not None and job._lost.is_set()
        if not lost and time.monotonic() < job._lease_until:
            return False
        with self._lock:
            self._running.pop(id(job), None)
            self.stats.lost += 1
        log.warning("shardq worker: job %s (key %r, shard %s) at %s: %s before a thread was free; not run "
                    "(the server runs it again)", job.id, job.key, job.shard, job.url,
                    "its run was lost" if lost else "its lease passed")
        return True

    def _run_one(self, handler: Handler, job: ClaimedJob) -> None:
        error: Optional[Exception] = None
        try:
            handler(job)
        except Exception as e:  # the attempt fails; the server retries it
            error = e
        outcome = _outcome_of(job, error)
        with self._lock:
            self._running.pop(id(job), None)
        if outcome is None:
            self._acks[job.url].put(job)
        else:
            self._report(job, *outcome)

    def _report(self, job: ClaimedJob, path: str, body: Dict[str, Any]) -> None:
        t = self._transports[job.url]
        for attempt in range(RESULT_ATTEMPTS):
            try:
                status, doc = t.post(path, body, self.timeout_s)
            except (OSError, http.client.HTTPException) as e:
                log.warning("shardq worker: %s of job %s (key %r) to %s failed: %s", path, job.id, job.key, job.url, e)
                time.sleep(_backoff_ms(attempt) / 1000)
                continue
            if status == 200:
                with self._lock:
                    if path == "/v1/ack":
                        self.stats.acked += 1
                    else:
                        self.stats.failed += 1
                return
            if status == 409:
                # Not retried: another run of the job is current (or was).
                log.warning("shardq worker: job %s (key %r, shard %s) at %s: the run was lost (%s refused: %s)",
                            job.id, job.key, job.shard, job.url, path, _error_of(doc))
                with self._lock:
                    self.stats.lost += 1
                return
            if not _retryable(status):
                log.error("shardq worker: %s of job %s at %s refused with %s: %s", path, job.id, job.url, status, _error_of(doc))
                break
            time.sleep(_backoff_ms(attempt) / 1000)
        with self._lock:
            self.stats.unreported += 1
        log.error("shardq worker: gave up reporting job %s (key %r) to %s; its lease decides", job.id, job.key, job.url)

    def _ack_loop(self, url: str) -> None:
        """Sends the acks queued for ``url``, as many per request as have
        queued up (at most ACK_BATCH_MAX); ``None`` ends the loop once
        everything before it was sent."""
        q = self._acks[url]
        done = False
        while not done:
            first = q.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < ACK_BATCH_MAX:
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    done = True
                    break
                batch.append(nxt)
            self._send_acks(url, batch)

    def _send_acks(self, url: str, jobs: List[ClaimedJob]) -> None:
        t = self._transports[url]
        body = {"receipts": [j.receipt for j in jobs]}
        for attempt in range(RESULT_ATTEMPTS):
            try:
                status, doc = t.post("/v1/ack", body, self.timeout_s)
            except (OSError, http.client.HTTPException) as e:
                log.warning("shardq worker: ack of %d jobs to %s failed: %s", len(jobs), url, e)
                time.sleep(_backoff_ms(attempt) / 1000)
                continue
            lost = _settle_acks(url, jobs, status, doc)
            if lost is not None:
                with self._lock:
                    self.stats.lost += lost
                    self.stats.acked += len(jobs) - lost
                    self.stats.ack_requests += 1
                return
            if not _retryable(status):
                log.error("shardq worker: ack of %d jobs at %s refused with %s: %s", len(jobs), url, status, _error_of(doc))
                break
            time.sleep(_backoff_ms(attempt) / 1000)
        with self._lock:
            self.stats.unreported += len(jobs)
        log.error("shardq worker: gave up acking %d jobs at %s; their leases decide", len(jobs), url)

    def _heartbeat(self, lease_ms: int, stop: threading.Event) -> None:
        every = lease_ms / 3 / 1000
        while not stop.wait(every):
            with self._lock:
                by_url: Dict[str, List[ClaimedJob]] = {}
                for j in self._running.values():
                    by_url.setdefault(j.url, []).append(j)
            for url, jobs in by_url.items():
                self._extend(url, jobs, lease_ms)

    def _extend(self, url: str, jobs: List[ClaimedJob], lease_ms: int) -> None:
        body = {"receipts": [j.receipt for j in jobs], "lease_ms": lease_ms}
        sent = time.monotonic()
        try:
            status, doc = self._transports[url].post("/v1/extend", body, self.timeout_s)
        except (OSError, http.client.HTTPException) as e:
            log.warning("shardq worker: extend at %s failed: %s", url, e)
            return
        stale = _extend_refused(url, jobs, status, doc)
        if stale is None:
            for j in jobs:
                self._extend(url, [j], lease_ms)
            return
        if status in (200, 409):  # the receipts not refused were extended
            refused = set(stale)
            for j in jobs:
                if j.receipt not in refused:
                    j._lease_until = sent + lease_ms / 1000
        _mark_lost(url, jobs, stale, lambda j: id(j) in self._running)


def _stale_of(doc: Any) -> List[str]:
    """The receipts a 409 on ack or extend refused: its ``stale`` and
    ``not_owned`` lists (either way the run is over here)."""
    out: List[str] = []
    if isinstance(doc, dict):
        for field_name in ("stale", "not_owned"):
            s = doc.get(field_name)
            if isinstance(s, list):
                out.extend(str(x) for x in s)
    return out


def _settle_acks(url: str, jobs: List["ClaimedJob"], status: int, doc: Any) -> Optional[int]:
    """For an answered batched ack (200, or 409: the valid receipts were
    acked, the others' runs were lost): logs the lost runs and returns how
    many; ``None`` for any other status."""
    if status == 200:
        return 0
    if status != 409:
        return None
    lost = _lost_of(jobs, doc)
    for j in lost:
        log.warning("shardq worker: job %s (key %r, shard %s) at %s: the run was lost (ack refused: %s)",
                    j.id, j.key, j.shard, url, _error_of(doc))
    return len(lost)


def _extend_refused(url: str, jobs: List["ClaimedJob"], status: int, doc: Any) -> Optional[List[str]]:
    """The receipts an extend reply refused (stale, or of a shard the server
    no longer owns; the others were extended). ``None`` for a 409 without
    the lists for several receipts: which one? Ask one by one."""
    if status == 409:
        stale = _stale_of(doc)
        if stale:
            return stale
        return None if len(jobs) > 1 else [jobs[0].receipt]
    if status != 200:
        log.warning("shardq worker: extend at %s answered %s: %s", url, status, _error_of(doc))
    return []


def _mark_lost(url: str, jobs: List["ClaimedJob"], stale: List[str], running: Callable[["ClaimedJob"], bool]) -> None:
    """Sets ``lost`` on the still running jobs whose receipts an extend
    refused (a job that finished meanwhile was acked or failed with that
    receipt: its run is over, not lost)."""
    for j in jobs:
        if j.receipt in stale and running(j) and not j.lost.is_set():
            j.lost.set()
            log.warning("shardq worker: job %s (key %r) at %s: the run was lost (extend refused)", j.id, j.key, url)
