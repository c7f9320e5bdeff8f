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
* dependents: a job of ``/v1/jobs`` may carry ``"after"`` (job ids
  ``SHARD:ID``, dependents' ids ``@N``, or indexes of the request's own
  jobs) and ``"on_dependency_failure"`` (``fail``, ``ignore``, ``run``);
  a request where any job has ``after`` stores every one of its jobs as a
  dependent in one write, none with a dedup id, each answered ``{"id":
  "@N", "shard": "", "key", "duplicate": false, "waiting": true}``.
  ``GET /v1/jobs/@N`` -> ``{"id", "key", "state", "on_dependency_failure",
  "after": [{"id", "outcome", "at"?, "result" | "result_b64"?,
  "result_dropped"?, "reason"?}], "created_ms", "released", "reason",
  "ended_ms", ...}``; ``GET /v1/jobs/@N/result`` answers the released
  job's result (a failed or cancelled dependent as a dead job),
  ``DELETE /v1/jobs/@N`` cancels it (409 once it ended); a claimed job
  that is a released dependent carries ``"dependent": "@N"``
* batches: ``/v1/batches`` ``{"key", "on_complete"?, "on_success"?,
  "on_death"?, "max_attempts"?, "dedup_id"?}`` (at least one callback) ->
  ``{"id": "@N", "duplicate"}``; a job of ``/v1/jobs`` may carry
  ``"batch": "@N"`` (then every job of the request names that batch, and
  each joins it in one write, answered ``{"id": "@M", "shard": "", "key",
  "duplicate", "waiting": true, "batch": "@N"}``; dedup ids allowed);
  ``/v1/batches/{id}/close`` -> ``{"id", "closed"}``; ``GET
  /v1/batches/{id}`` -> ``{"id", "key", "state", "counts", "callbacks",
  "jobs", "max_attempts", "created_ms", "closed_ms", "ended_ms"}`` (404 for
  an unknown one); a claimed job of a batch, or a batch's callback, carries
  ``"batch": "@N"``, a callback ``"batch_callback"`` (``complete``,
  ``success``, ``death``)
* ``/v1/claim`` ``{"worker", "max", "wait_ms", "lease_ms", "timeout_ms"?}``
  -> ``{"jobs": [{"id", "shard", "key", "payload" | "payload_b64",
  "attempt", "max_attempts", "receipt", "fence", "lease_expires_ms",
  "timeout_expires_ms"?}]}``; a receipt is the string ``SHARD:ID.FENCE``;
  past a run's ``timeout_ms`` (or ``serve --job-timeout-ms``) the server
  fails the run itself, whatever its extends, and answers its late ack or
  extend 409
* ``/v1/ack`` ``{"receipts": [...]}`` -> ``{"acked": n}``, ``/v1/fail``
  ``{"receipt", "reason", "retry_in_ms"?}`` (or, to back off without using
  an attempt, ``{"receipt", "reason", "backoff_ms", "backoff_group"}``),
  ``/v1/extend`` ``{"receipts": [...], "lease_ms"}`` -> ``{"extended": n}``,
  ``/v1/stale`` ``{"receipts": [...]}`` -> ``{"stale": [...], "not_owned":
  [...]}`` (read-only: the runs no longer current, a cancelled one among
  them; a fail of such a receipt once its handler returned is refused with
  409 but ends a cancelled run and frees its key)
* flow control (``read`` to look, ``admin`` to change; ``GET``, ``PUT``,
  ``DELETE``): ``/v1/policies`` -> ``{"default", "prefixes", "keys",
  "groups"}``; ``/v1/policies/{key}[?scope=prefix|default]`` -> ``{"key",
  "policy", "from", "prefix"}``, ``PUT`` a whole policy ``{"rate", "burst",
  "weight", "priority", "group", "concurrency"}`` (all optional) ->
  ``{"target", "policy"}``, ``DELETE`` -> ``{"removed"}``;
  ``/v1/groups`` -> ``{NAME: {"rate", "burst"}}``, ``/v1/groups/{name}``
  (``PUT`` ``{"rate", "burst"?}`` -> ``{"name", "group"}``, ``DELETE`` ->
  ``{"removed"}``, 400 while a policy names the group)
* lifting a handler's back-off (``admin``; ``POST``, no body needed):
  ``/v1/groups/{name}/resume`` -> ``{"name", "resumed": true}`` (the hold
  a group back-off put on the group); ``/v1/keys/{key}/resume`` ->
  ``{"key", "shard", "resumed", "back_off": {"until_ms", "jobs"} | null}``
  (the key's back-off; ``"resumed": false`` and a null ``back_off`` when
  none held it), 409 ``{"state": "moving"}`` while the key moves
* recurring schedules (``read`` to look, ``admin`` to change):
  ``GET /v1/schedules`` -> ``{"schedules": [view]}``; ``GET``, ``PUT``,
  ``DELETE`` ``/v1/schedules/{id}`` (a view, 404 for an unknown id; ``PUT``
  ``{"key", "cron" | "every", "tz", "payload", "overlap", "catch_up",
  "jitter", "start", "end", "max_attempts"}`` -> ``{"id", "schedule"}``;
  ``DELETE`` -> ``{"id", "deleted"}``); ``POST`` ``.../pause`` and
  ``.../resume`` -> ``{"id", "schedule"}``, ``.../trigger`` -> ``{"id",
  "shard", "job"}``, ``.../backfill`` ``{"from", "to"}`` -> ``{"id",
  "ticks", "stored", "already_stored"}``. A view is the schedule (``when``:
  ``{"cron": {"expr", "tz"}}`` or ``{"every": {"every_ms"}}``) with its
  ``id``, ``state`` ``{"decided_ms", "last", "fired", "skipped",
  "missed"}`` and ``next_fire_ms``
* 409 for a stale receipt; with several receipts the valid ones take effect
  and the body lists the others: ``{"error", "acked" | "extended", "stale":
  [...], "not_owned": [...]}``. 409 on ``/v1/jobs``: a job's dedup id is
  being enqueued by another request at this moment (retried). 400
  ``{"error": ...}`` for bad input, 401/403 for a missing or wrong token.
"""

from __future__ import annotations

import base64
import http.client
import inspect
import json
import logging
import os
import random
import re
import signal
import socket
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple, Union
from urllib.parse import quote, urlparse

from .errors import (
    BadRequest,
    ConfigError,
    HttpError,
    InvalidJob,
    JobDied,
    JobNotCancelled,
    KeyNotResumed,
    PartialEnqueue,
    ResultTimeout,
    ServerUnavailable,
    ShardqError,
    StaleReceipt,
    TooLarge,
    Unauthorized,
)

log = logging.getLogger("shardq")

#: The longest ``shardq serve`` may take over a request before it answers,
#: in seconds: its ``REQUEST_TIMEOUT_MS`` (crates/shardq-server/src/limits.rs:
#: the longest long poll, 30 s, plus 60 s for the store's own bounds, such
#: as an enqueue's wait on a paused key, 30 s),
#: after which it answers 408 itself.
SERVER_WAIT_MAX_S = 90.0
#: Margin of a request's timeout over the server's longest wait (the
#: network, the reply).
TIMEOUT_MARGIN_S = 5.0
#: Default timeout of every request, claims included, in seconds: never
#: shorter than the server's longest wait, so that a request the server is
#: still working on (and may yet store) is not given up and sent elsewhere.
REQUEST_TIMEOUT_S = SERVER_WAIT_MAX_S + TIMEOUT_MARGIN_S
#: Rounds over every URL before an enqueue gives up.
RETRY_ROUNDS_DEFAULT = 5
#: Backoff between rounds, in ms: doubles from the first to the cap, with jitter.
BACKOFF_FIRST_MS = 50
BACKOFF_MAX_MS = 2_000
#: Most jobs per ``/v1/jobs`` request (the server's default
#: ``--jobs-per-request-max``).
ENQUEUE_BATCH_MAX = 1000
#: Largest ``/v1/jobs`` body, in bytes (the server's default
#: ``--body-bytes-max``, 16 MiB); a batch is split to stay within it, and
#: halved again when a server with a lower limit answers 413.
ENQUEUE_BATCH_BYTES_MAX = 16 << 20
#: Most dependencies of one dependent (``after``; the server's bound).
DEPENDENCIES_MAX = 1000
#: What a dependent does when a dependency did not complete (``fail``: it
#: fails and never runs; ``ignore``: it runs without that result; ``run``:
#: it runs with every outcome).
DEPENDENCY_FAILURE_POLICIES = ("fail", "ignore", "run")
#: Most jobs asked for by one claim (the server's ``CLAIM_MAX_LIMIT``).
CLAIM_MAX = 1000
#: Default long-poll wait of a claim, in ms.
CLAIM_WAIT_MS_DEFAULT = 5_000
#: Bounds of a claim's ``timeout_ms`` (a run's job timeout), in ms: the
#: server's ``JOB_TIMEOUT_MS_MIN``..=``JOB_TIMEOUT_MS_MAX`` (1 ms to 7 days).
JOB_TIMEOUT_MS_MIN = 1
JOB_TIMEOUT_MS_MAX = 604_800_000
#: Longest reason a worker sends with a failed attempt, in bytes of UTF-8:
#: what the server's store keeps of one (``FAIL_REASON_BYTES_MAX`` of
#: shardq-core, 1 KiB; the store cuts a longer one at its end, which is
#: where a traceback's failing frame is). A longer reason keeps its head line
#: (``Type: message``, at most half of it) and the end of the traceback,
#: cut on a character boundary; the log record has the whole traceback.
FAIL_REASON_BYTES_MAX = 1024
#: Attempts at an ack or fail before leaving the run to its lease.
RESULT_ATTEMPTS = 5
#: Most receipts one batched ``/v1/ack`` carries (the server's bound).
ACK_BATCH_MAX = 1000
#: After a worker is stopped without draining, how long it still tries to
#: send the acks of the jobs that had finished, in seconds.
ABANDON_ACK_FLUSH_S = 2.0
#: While a worker holds runs, how often it asks each server which of them
#: are no longer current (``POST /v1/stale``, one read for all of them), in
#: seconds: a run cancelled through the API (``DELETE /v1/jobs/{id}``) has
#: ``job.lost`` set within about this long, instead of at the next extend.
STALE_CHECK_S = 1.0
#: The reason sent with the fail that ends a run the server said is over,
#: once its handler returned.
STALE_FAIL_REASON = "the run is no longer current (cancelled, or ended elsewhere); its handler has returned"

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
            raise ConfigError(f"invalid server URL {u!r}: expected http://HOST:PORT or https://HOST:PORT")
        out.append(u)
    if not out:
        raise ConfigError("no server URL given")
    return out


def _check_timeout(timeout_s: float) -> float:
    """A request timeout no shorter than the server's longest wait."""
    if not timeout_s >= SERVER_WAIT_MAX_S:
        raise ConfigError(
            f"invalid timeout_s {timeout_s!r}: at least {SERVER_WAIT_MAX_S:.0f} s, the longest a server may "
            f"take over a request (a shorter one gives up on requests the server may still carry out)"
        )
    return float(timeout_s)


def _check_job_timeout(timeout_ms: Optional[int]) -> Optional[int]:
    """A worker's ``timeout_ms``: ``None`` (the server's default, if any)
    or a whole number of ms the server takes."""
    if timeout_ms is None:
        return None
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) \
            or not JOB_TIMEOUT_MS_MIN <= timeout_ms <= JOB_TIMEOUT_MS_MAX:
        raise ConfigError(
            f"invalid timeout_ms {timeout_ms!r}: a whole number of ms from {JOB_TIMEOUT_MS_MIN} to "
            f"{JOB_TIMEOUT_MS_MAX} (7 days), or None for the server's default"
        )
    return timeout_ms


#: Errors of a request on a kept-alive connection that the server had
#: closed before the request reached it.
_STALE_ERRORS = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class _Transport:
    """POSTs JSON to one server over keep-alive connections, one per thread."""

    def __init__(self, url: str, token: Optional[str]):
        self.url = url
        p = urlparse(url)
        self.https = p.scheme == "https"
        self.host = p.hostname or ""
        self.port = p.port or (443 if self.https else 80)
        self.prefix = p.path
        # Content-Type on every POST: the server refuses other bodies (415).
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.local = threading.local()

    def conn(self, timeout: float) -> http.client.HTTPConnection:
        """This thread's connection, with ``timeout``."""
        c: Optional[http.client.HTTPConnection] = getattr(self.local, "conn", None)
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

    def post(self, path: str, body: Union[Mapping[str, Any], bytes], timeout: float = REQUEST_TIMEOUT_S,
             resend_stale: bool = True) -> Tuple[int, Any]:
        """Sends one POST (``body`` a JSON object, or its encoding):
        (status, decoded JSON body or None). Raises
        ``OSError``/``http.client.HTTPException`` for transport failures."""
        return self.request("POST", path, body, timeout, resend_stale)

    def request(self, method: str, path: str, body: Union[Mapping[str, Any], bytes, None],
                timeout: float = REQUEST_TIMEOUT_S, resend_stale: bool = True) -> Tuple[int, Any]:
        """:meth:`post` for any method; ``body`` ``None`` sends none."""
        data = None if body is None else body if isinstance(body, bytes) else _dumps(body)
        for fresh_only in (not resend_stale, True):
            c = self.conn(timeout)
            reused = c.sock is not None
            try:
                try:
                    c.request(method, self.prefix + path, body=data, headers=self.headers)
                except (BrokenPipeError, ConnectionResetError):
                    # The server may have answered before taking the whole
                    # body (a 413 for a body over its limit) and closed:
                    # its answer, if there is one, says why.
                    resp = c.getresponse()
                else:
                    resp = c.getresponse()
                raw = resp.read()
                break
            except _STALE_ERRORS:
                # A kept-alive connection the server closed while it was
                # idle (it closes idle ones): sent again once on a new one.
                self._drop()
                if not reused or fresh_only:
                    raise
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
    if status == 413:
        raise TooLarge(url, status, msg)
    if status == 400:
        raise BadRequest(url, status, msg)
    if status in (401, 403):
        raise Unauthorized(url, status, msg)
    if status == 409:
        raise StaleReceipt(url, status, msg)
    raise HttpError(url, status, msg)


def _is_key_resume(path: str) -> bool:
    """Whether ``path`` is ``/v1/keys/{key}/resume`` (the key one segment,
    percent-encoded)."""
    parts = path.split("?", 1)[0].split("/")
    return len(parts) == 5 and parts[:3] == ["", "v1", "keys"] and parts[3] != "" and parts[4] == "resume"


def _is_schedule_path(path: str) -> bool:
    """Whether ``path`` is one of ``/v1/schedules...``."""
    return path == "/v1/schedules" or path.startswith("/v1/schedules/")


def _is_answer(url: str, method: str, status: int, doc: Any, causes: List[str], path: str = "") -> bool:
    """For the reads, cancels, flow-control and schedule calls of both
    clients: whether ``status`` is an answer (200, or 404: no live job);
    a status worth another URL is noted in ``causes``; any other raises (a
    409 of a cancel as :class:`JobNotCancelled`, of a key resume as
    :class:`KeyNotResumed`, of a schedule call as :class:`HttpError`)."""
    if status in (200, 404):
        return True
    if _retryable(status):
        causes.append(f"{url} answered {status}: {_error_of(doc)}")
        return False
    if status == 409 and _is_schedule_path(path):
        raise HttpError(url, status, _error_of(doc))
    if status == 409:
        state = doc.get("state", "") if isinstance(doc, dict) else ""
        if method == "DELETE":
            raise JobNotCancelled(url, status, _error_of(doc), state)
        if method == "POST" and _is_key_resume(path):
            shard = doc.get("shard") if isinstance(doc, dict) else None
            raise KeyNotResumed(url, status, _error_of(doc), state, None if shard is None else str(shard))
    _raise_for(url, status, doc)
    return False


def _refuses_worker(e: HttpError) -> bool:
    """A claim refused for good: the token (401, 403) or the request (400,
    415, 421: this client or its configuration is wrong), which no retry
    changes: the worker stops with the error."""
    return 400 <= e.status < 500 and not _retryable(e.status) and e.status != 409


def _retryable(status: int) -> bool:
    return status in (408, 425, 429) or status >= 500


def _backoff_ms(round_no: int) -> float:
    cap = float(min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * (2 ** round_no)))
    return cap / 2 + random.random() * cap / 2


def _encode_payload(payload: Payload, out: Dict[str, Any], key: str) -> None:
    if isinstance(payload, str):
        out["payload"] = payload
        return
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidJob(f"payload of key {key!r}: bytes or str, got {type(payload).__name__}")
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


class _Bodies(List[Dict[str, Any]]):
    """The ``/v1/jobs`` objects of one enqueue call, with the prefix of the
    dedup ids it generated (``{prefix}-{index}``): an id with it was made
    by this call, so its duplicate after an unanswered attempt is the
    call's own earlier attempt. ``graph``: some job has ``after``, so the
    jobs go in one request, all of them dependents, with no dedup ids."""

    prefix: str = ""
    graph: bool = False
    #: Every job joins this batch (``@N``; empty: none).
    batch: str = ""


class _Batch(List[Dict[str, Any]]):
    """The jobs of one request, with the request's body once encoded (a
    retry sends the same bytes, so the same ids), its call's prefix, and
    whether an earlier attempt at these jobs may have stored them (one
    unanswered at one URL before another answered 413, say)."""

    encoded: Optional[bytes] = None
    prefix: str = ""
    maybe_stored: bool = False


def _batch_of(jobs: Iterable[Dict[str, Any]], prefix: str, maybe_stored: bool = False) -> _Batch:
    b = _Batch(jobs)
    b.prefix = prefix
    b.maybe_stored = maybe_stored
    return b


def _halves(batch: List[Dict[str, Any]]) -> Tuple[_Batch, _Batch]:
    """``batch`` cut in two requests (a server with a lower body limit);
    each half remembers that an attempt at the whole may have stored it."""
    prefix = getattr(batch, "prefix", "")
    stored = bool(getattr(batch, "maybe_stored", False))
    half = len(batch) // 2
    return _batch_of(batch[:half], prefix, stored), _batch_of(batch[half:], prefix, stored)


def _job_bodies(jobs: Iterable[Union["NewJob", Mapping[str, Any]]]) -> _Bodies:
    """The ``/v1/jobs`` objects of ``jobs``, each with a dedup id. Generated ids are
    a random 96-bit prefix per call and the job's index (unique without a
    uuid per job, and safe across fork()); a :class:`NewJob` without an id
    keeps the generated one, so sending it again after an error re-sends
    that id."""
    items = jobs if isinstance(jobs, list) else list(jobs)
    if any(_is_dependent(j) or _in_batch(j) for j in items):
        # One pass for the common case (neither); a batch's checks refuse after.
        if any(_in_batch(j) for j in items):
            return _batch_job_bodies(items)
        return _graph_bodies(items)
    out = _Bodies()
    prefix = out.prefix = os.urandom(12).hex()
    append = out.append
    for n, j in enumerate(items):
        if not isinstance(j, NewJob):
            try:
                j = NewJob(**dict(j))
            except TypeError as e:
                raise InvalidJob(f"job {n}: {e}") from None
        key = j.key
        if not isinstance(key, str) or not key:
            raise InvalidJob(f"invalid job key {key!r}: a non-empty str is needed")
        payload = j.payload
        if isinstance(payload, str):
            b: Dict[str, Any] = {"key": key, "payload": payload}
        else:
            b = {"key": key}
            _encode_payload(payload, b, key)
        if j.delay_ms:
            b["delay_ms"] = int(j.delay_ms)
        if j.max_attempts is not None:
            b["max_attempts"] = int(j.max_attempts)
        if (j.unique_id, j.unique_while, j.debounce_id, j.debounce_ms, j.debounce_max_ms) != _NOT_KEYED:
            _keyed_fields(j, b, n)
            append(b)
            continue
        d = j.dedup_id
        if d is None:
            d = j.dedup_id = f"{prefix}-{n}"
        b["dedup_id"] = d
        append(b)
    return out


_NOT_KEYED = (None, None, None, None, None)


def _is_dependent(j: Any) -> bool:
    """Whether job ``j`` (a :class:`NewJob` or a mapping) has ``after`` or
    ``on_dependency_failure`` (then its request is a graph's)."""
    if isinstance(j, NewJob):
        return j.after is not None or j.on_dependency_failure is not None
    if isinstance(j, Mapping):
        return j.get("after") is not None or j.get("on_dependency_failure") is not None
    return False


def _in_batch(j: Any) -> bool:
    """Whether job ``j`` (a :class:`NewJob` or a mapping) names a batch."""
    if isinstance(j, NewJob):
        return j.batch is not None
    if isinstance(j, Mapping):
        return j.get("batch") is not None
    return False


def _batch_job_bodies(items: Sequence[Union["NewJob", Mapping[str, Any]]]) -> _Bodies:
    """The ``/v1/jobs`` objects of a call whose jobs join a batch: every
    job names the same batch (``@N``), none has ``after``,
    ``on_dependency_failure``, a unique or a debounce id; each carries a
    dedup id (generated as for any job when not given, so a resend joins
    nothing twice). Checked before anything is sent."""
    out = _Bodies()
    prefix = out.prefix = os.urandom(12).hex()
    jobs: List[NewJob] = []
    for n, j in enumerate(items):
        if not isinstance(j, NewJob):
            try:
                j = NewJob(**dict(j))
            except TypeError as e:
                raise InvalidJob(f"job {n}: {e}") from None
        jobs.append(j)
    at, first = next((n, j.batch) for n, j in enumerate(jobs) if j.batch is not None)
    if not isinstance(first, str) or not _DEPENDENT_ID.fullmatch(first):
        raise InvalidJob(f"job {at} (key {jobs[at].key!r}): invalid batch {first!r}: a batch's id \"@N\" is needed, "
                         f"as open_batch returns it")
    out.batch = first
    for n, j in enumerate(jobs):
        key = j.key
        if not isinstance(key, str) or not key:
            raise InvalidJob(f"invalid job key {key!r}: a non-empty str is needed")
        where = f"job {n} (key {key!r})"
        if j.batch != first:
            raise InvalidJob(f"{where}: batch {j.batch!r} where the jobs of this call join {first!r}: every job of "
                             f"a call with batch names the same batch (enqueue the others in a call of their own)")
        named = [f"{name} {getattr(j, name)!r}" for name in ("after", "on_dependency_failure", "unique_id",
                                                             "unique_while", "debounce_id", "debounce_ms",
                                                             "debounce_max_ms")
                 if getattr(j, name) is not None]
        if named:
            raise InvalidJob(f"{where}: a job of a batch takes no {', '.join(named)} (its dedup_id makes it safe "
                             f"to send again)")
        b: Dict[str, Any] = {"key": key}
        _encode_payload(j.payload, b, key)
        if j.delay_ms:
            b["delay_ms"] = int(j.delay_ms)
        if j.max_attempts is not None:
            b["max_attempts"] = int(j.max_attempts)
        d = j.dedup_id
        if d is None:
            d = j.dedup_id = f"{prefix}-{n}"
        b["dedup_id"] = d
        b["batch"] = first
        out.append(b)
    return out


def _graph_bodies(items: Sequence[Union["NewJob", Mapping[str, Any]]]) -> _Bodies:
    """The ``/v1/jobs`` objects of a request with ``after``: every job a
    dependent (one without ``after`` is a root, released at the server's
    next resolver pass), none with a dedup id (the server refuses one),
    ``after`` checked here: its items are ids (``str``) or indexes of other
    jobs of ``items``, each once, at most :data:`DEPENDENCIES_MAX`, and the
    indexes form no cycle (one raises :class:`InvalidJob` naming the jobs
    of the cycle before anything is sent)."""
    out = _Bodies()
    out.graph = True
    jobs: List[NewJob] = []
    for n, j in enumerate(items):
        if not isinstance(j, NewJob):
            try:
                j = NewJob(**dict(j))
            except TypeError as e:
                raise InvalidJob(f"job {n}: {e}") from None
        jobs.append(j)
    edges: List[List[int]] = []
    for n, j in enumerate(jobs):
        key = j.key
        if not isinstance(key, str) or not key:
            raise InvalidJob(f"invalid job key {key!r}: a non-empty str is needed")
        b: Dict[str, Any] = {"key": key}
        _encode_payload(j.payload, b, key)
        if j.delay_ms:
            b["delay_ms"] = int(j.delay_ms)
        if j.max_attempts is not None:
            b["max_attempts"] = int(j.max_attempts)
        named = [f"{name} {getattr(j, name)!r}" for name in ("dedup_id", "unique_id", "debounce_id")
                 if getattr(j, name) is not None]
        if named:
            raise InvalidJob(f"job {n} (key {key!r}): a job of a request with after takes no {', '.join(named)}: "
                             f"every job of such a request is a dependent, released once under its own id "
                             f"(enqueue it in a request of its own, without after)")
        indexes: List[int] = []
        if j.after is not None:
            b["after"] = _after_items(j.after, n, key, len(jobs), indexes)
        policy = j.on_dependency_failure
        if policy is not None:
            if j.after is None:
                raise InvalidJob(f"job {n} (key {key!r}): on_dependency_failure {policy!r} without after: it applies "
                                 f"to a job with dependencies")
            if policy not in DEPENDENCY_FAILURE_POLICIES:
                raise InvalidJob(f"job {n} (key {key!r}): invalid on_dependency_failure {policy!r}: one of "
                                 f"{', '.join(DEPENDENCY_FAILURE_POLICIES)}")
            b["on_dependency_failure"] = policy
        edges.append(indexes)
        out.append(b)
    cycle = _cycle_of(edges)
    if cycle:
        path = " -> ".join(f"{i} (key {jobs[i].key!r})" for i in cycle)
        raise InvalidJob(f"invalid after: jobs {path} form a cycle (each waits for the next): a job cannot wait "
                         f"for itself, even through others; nothing was sent")
    return out


def _after_items(after: Any, n: int, key: str, count: int, indexes: List[int]) -> List[Union[str, int]]:
    """Job ``n``'s ``after`` as sent: ids (non-empty ``str``: ``SHARD:ID``
    or ``@N``, which the server checks) and indexes of the other ``count``
    jobs of its request (appended to ``indexes``), each once."""
    where = f"job {n} (key {key!r})"
    if isinstance(after, (str, bytes)) or not isinstance(after, Iterable):
        raise InvalidJob(f"{where}: invalid after {after!r}: a list of job ids (\"SHARD:ID\", \"@N\") and indexes "
                         f"of this request's jobs is needed (one id goes in a list: after=[{after!r}])")
    out: List[Union[str, int]] = []
    seen: set[Union[str, int]] = set()
    for i, item in enumerate(after):
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise InvalidJob(f"{where}: invalid after[{i}] {item!r}: a job id (\"SHARD:ID\", \"@N\") or the index "
                             f"of another job of this request is needed")
        if isinstance(item, int):
            if item == n:
                raise InvalidJob(f"{where}: invalid after[{i}] {item}: its own index; a job cannot wait for itself")
            if not 0 <= item < count:
                raise InvalidJob(f"{where}: invalid after[{i}] {item}: not an index of this request's jobs "
                                 f"(0 to {count - 1})")
            indexes.append(item)
        elif not item:
            raise InvalidJob(f"{where}: invalid after[{i}] '': a job id (\"SHARD:ID\", \"@N\") is needed")
        if item in seen:
            raise InvalidJob(f"{where}: invalid after[{i}] {item!r}: named twice; name each dependency once")
        seen.add(item)
        out.append(item)
    if len(out) > DEPENDENCIES_MAX:
        raise InvalidJob(f"{where}: {len(out)} dependencies in after, over the bound of {DEPENDENCIES_MAX} per job")
    return out


def _cycle_of(edges: Sequence[Sequence[int]]) -> List[int]:
    """A cycle of the graph whose node ``n`` points at ``edges[n]``, as
    its nodes from the first one again to itself (``[0, 2, 0]``); empty
    when there is none. Iterative, so a long chain is no recursion."""
    state = [0] * len(edges)  # 0: not seen, 1: on the current path, 2: done
    for start in range(len(edges)):
        if state[start]:
            continue
        path = [start]
        nexts = [0]
        state[start] = 1
        while path:
            node = path[-1]
            if nexts[-1] < len(edges[node]):
                to = edges[node][nexts[-1]]
                nexts[-1] += 1
                if state[to] == 1:
                    return path[path.index(to):] + [to]
                if state[to] == 0:
                    state[to] = 1
                    path.append(to)
                    nexts.append(0)
            else:
                state[node] = 2
                path.pop()
                nexts.pop()
    return []


def _graph_request(bodies: _Bodies, count_max: int, bytes_max: int) -> _Batch:
    """The one request of a graph's ``bodies``, encoded: its indexes name
    jobs of the same request, so it is never split; over the client's batch
    limits it raises :class:`InvalidJob` naming the count."""
    if len(bodies) > count_max:
        raise InvalidJob(f"a request with after has {len(bodies)} jobs, over this client's batch_max of {count_max}: "
                         f"its indexes name jobs of the same request, so it is not split; send at most {count_max} "
                         f"(later ones may name earlier ones by their @N ids), or raise batch_max up to the "
                         f"server's --jobs-per-request-max")
    batch = _batch_of(bodies, "")
    batch.encoded = _batch_body(batch)
    if len(batch.encoded) > bytes_max:
        raise InvalidJob(f"a request with after of {len(bodies)} jobs is {len(batch.encoded)} bytes of JSON, over "
                         f"this client's batch_bytes_max of {bytes_max}: its indexes name jobs of the same request, "
                         f"so it is not split")
    return batch


def _graph_too_large(batch: _Batch, e: HttpError) -> InvalidJob:
    return InvalidJob(f"a request with after of {len(batch)} jobs ({len(batch.encoded or b'')} bytes of JSON) is over "
                      f"the body limit of {e.url}: {e.error}; it is not split (its indexes name jobs of the same "
                      f"request)")


def _keyed_fields(j: "NewJob", b: Dict[str, Any], n: int) -> None:
    """The unique or debounce fields of job ``n`` into its body ``b``
    (the server checks their values, naming them); a keyed job sends no
    dedup id: a retry of a unique job is answered as its duplicate, one of
    a debounced job gives the waiting job the same payload again."""
    if j.dedup_id is not None:
        raise InvalidJob(f"job {n}: a unique or debounced job has no dedup_id of its own (got {j.dedup_id!r})")
    for name in ("unique_id", "unique_while", "debounce_id"):
        v = getattr(j, name)
        if v is not None:
            if not isinstance(v, str):
                raise InvalidJob(f"job {n}: invalid {name} {v!r}: a str is needed")
            b[name] = v
    for name in ("debounce_ms", "debounce_max_ms"):
        v = getattr(j, name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidJob(f"job {n}: invalid {name} {v!r}: a non-negative int (ms) is needed")
            b[name] = v


def _batches(jobs: List[Dict[str, Any]], count_max: int, bytes_max: int) -> Iterator[_Batch]:
    """``jobs`` in order, cut into requests of at most ``count_max`` jobs
    and ``bytes_max`` bytes of body (a job larger than that alone goes in a
    request of its own: the server says whether it takes it). A request of
    ``count_max`` jobs under the byte bound, the common case, is encoded in
    one call; only one over it is measured job by job."""
    prefix = getattr(jobs, "prefix", "")
    for start in range(0, len(jobs), count_max):
        chunk = _batch_of(jobs[start:start + count_max], prefix)
        body = _dumps({"jobs": chunk})
        if len(body) <= bytes_max:
            chunk.encoded = body
            yield chunk
        else:
            yield from _split_by_bytes(chunk, bytes_max)


def _split_by_bytes(jobs: _Batch, bytes_max: int) -> Iterator[_Batch]:
    batch = _batch_of((), jobs.prefix)
    parts: List[bytes] = []
    size = len(_BATCH_HEAD) + len(_BATCH_TAIL)
    for j in jobs:
        data = _dumps(j)
        extra = len(data) + (1 if batch else 0)
        if batch and size + extra > bytes_max:
            batch.encoded = _BATCH_HEAD + b",".join(parts) + _BATCH_TAIL
            yield batch
            batch, parts, size = _batch_of((), jobs.prefix), [], len(_BATCH_HEAD) + len(_BATCH_TAIL)
            extra = len(data)
        batch.append(j)
        parts.append(data)
        size += extra
    if batch:
        batch.encoded = _BATCH_HEAD + b",".join(parts) + _BATCH_TAIL
        yield batch


_BATCH_HEAD = b'{"jobs":['
_BATCH_TAIL = b"]}"


def _batch_body(batch: List[Dict[str, Any]]) -> bytes:
    encoded = batch.encoded if isinstance(batch, _Batch) else None
    if encoded is not None:
        return encoded
    return _BATCH_HEAD + b",".join(_dumps(j) for j in batch) + _BATCH_TAIL


def _too_large(job: Dict[str, Any], e: HttpError) -> InvalidJob:
    return InvalidJob(f"job of key {job['key']!r} ({len(_dumps(job))} bytes of JSON) is over the body limit "
                      f"of {e.url}: {e.error}")


def _enqueued_of(url: str, chunk: List[Dict[str, Any]], doc: Any, maybe_stored: bool) -> List["Enqueued"]:
    """The :class:`Enqueued` values of a ``/v1/jobs`` reply to ``chunk``.
    After an attempt that may have stored the jobs (no answer, or a 5xx),
    a duplicate of an id this call generated is the call's own earlier
    attempt: not a duplicate to the caller."""
    got = doc.get("jobs") if isinstance(doc, dict) else None
    if not isinstance(got, list) or len(got) != len(chunk):
        raise HttpError(url, 200, f"/v1/jobs answered {len(got) if isinstance(got, list) else got!r} jobs for {len(chunk)}")
    own = (getattr(chunk, "prefix", "") + "-") if maybe_stored else "-"
    if own == "-":
        # No earlier attempt could have stored them: every duplicate is one.
        return [Enqueued(str(g["id"]), str(g["shard"]), str(g.get("key", b["key"])),
                         bool(g.get("duplicate", False)), b.get("dedup_id", ""), bool(g.get("waiting", False)),
                         g.get("batch"))
                for b, g in zip(chunk, got)]
    out: List[Enqueued] = []
    append = out.append
    for b, g in zip(chunk, got):
        d = b.get("dedup_id", "")
        dup = bool(g.get("duplicate", False))
        if dup and d and d.startswith(own):
            dup = False
        append(Enqueued(str(g["id"]), str(g["shard"]), str(g.get("key", b["key"])), dup, d,
                        bool(g.get("waiting", False)), g.get("batch")))
    return out


class _Attempts:
    """The retry rule of a request sent to any URL, the same for both
    clients: rounds over every URL, with backoff between rounds, at most
    ``rounds`` of them. A status that retrying cannot change (409 among
    them) raises at once."""

    def __init__(self, path: str, rounds: int, dedup_ids: Sequence[str] = (), maybe_done: bool = False,
                 once: bool = False) -> None:
        self.path = path
        self.rounds = rounds
        self.round = 0
        self.dedup_ids = dedup_ids
        self.causes: Dict[str, str] = {}
        self.last: Optional[BaseException] = None
        #: Whether an attempt may have been carried out unanswered (a
        #: transport error, a timeout, a 5xx), here or at the request this
        #: one is half of.
        self.maybe_done = maybe_done
        #: A request that carries no dedup ids (dependents): not sent again
        #: once an attempt may have been carried out (only after a refused
        #: connection, a name not resolved or a 4xx worth retrying).
        self.once = once

    def failed(self, url: str, e: BaseException) -> None:
        self.causes[url] = f"{url}: {type(e).__name__}: {e}"
        self.last = e
        if self.once and _never_sent(e):
            return
        self.maybe_done = True
        if self.once:
            raise self.error()

    def refused(self, url: str, status: int, doc: Any) -> None:
        if not _retryable(status):
            _raise_for(url, status, doc)
        if status >= 500 or status == 408:
            self.maybe_done = True
        self.causes[url] = f"{url}: {status} {_error_of(doc)}"
        if self.once and self.maybe_done:
            raise self.error()

    def pause(self) -> Optional[float]:
        """Seconds to wait before the next round, or ``None``: give up."""
        self.round += 1
        if self.round >= self.rounds:
            return None
        return _backoff_ms(min(self.round - 1, 10)) / 1000

    def error(self) -> ServerUnavailable:
        if self.once and self.maybe_done:
            return ServerUnavailable(
                f"POST {self.path} with after (not sent again: the attempt may have stored its dependents, which "
                f"carry no dedup id, so a second send could store them twice; `shardq jobs --key KEY` lists a "
                f"key's waiting dependents)",
                list(self.causes.values()), self.last)
        return ServerUnavailable(f"POST {self.path} ({self.round} rounds)", list(self.causes.values()), self.last,
                                 self.dedup_ids)


def _never_sent(e: BaseException) -> bool:
    """Whether transport error ``e`` shows the request never reached the
    server (a refused connection, a name not resolved): aiohttp's connect
    errors carry the cause as ``os_error``."""
    cause = getattr(e, "os_error", e)
    return isinstance(cause, (ConnectionRefusedError, socket.gaierror))


def _claimed_of(url: str, doc: Any) -> List["ClaimedJob"]:
    """The jobs of a ``/v1/claim`` reply from ``url``."""
    return [
        ClaimedJob(
            str(j["id"]), str(j["shard"]), str(j["key"]), _decode_payload(j), int(j.get("attempt", 1)),
            str(j["receipt"]), j.get("fence"), j.get("lease_expires_ms"), url, j.get("max_attempts"),
            j.get("timeout_expires_ms"), j.get("dedup_id"), ScheduleTick._of(j.get("schedule")),
            j.get("dependent"), j.get("batch"), j.get("batch_callback"),
        )
        for j in (doc or {}).get("jobs", [])
    ]


def _set_deadlines(jobs: Sequence["ClaimedJob"], lease_ms: int, timeout_ms: Optional[int], answered: float) -> None:
    """Sets when the leases of ``jobs``, claimed by a request answered at
    ``answered`` (``time.monotonic()``), end here, and when their runs pass
    their job timeout: the worker's ``timeout_ms``, else the server's
    default, which the claim's answer shows (``timeout_expires_ms`` and
    ``lease_expires_ms`` are of one clock, the server's). The server
    started both just before it answered, so these are never early."""
    until = answered + lease_ms / 1000
    for j in jobs:
        j._lease_until = until
        ms: Optional[int] = timeout_ms
        if ms is None and j.timeout_expires_ms is not None and j.lease_expires_ms is not None:
            ms = max(1, int(j.timeout_expires_ms) - int(j.lease_expires_ms) + lease_ms)
        if ms is not None:
            j._timeout_ms = ms
            j._timeout_until = answered + ms / 1000


def _past_timeout(job: "ClaimedJob", now: Optional[float] = None) -> bool:
    """Whether ``job``'s run has passed its job timeout (then the server
    fails it, and refuses its late result)."""
    until = job._timeout_until
    return until is not None and (time.monotonic() if now is None else now) >= until


def _utf8(text: str) -> bytes:
    # A lone surrogate (from a bytes path, say) cannot go in JSON as is.
    return text.encode("utf-8", "backslashreplace")


def _head_of(data: bytes, most: int) -> str:
    """The longest prefix of ``data`` (UTF-8) of at most ``most`` bytes
    that ends on a character boundary."""
    return data[:max(0, most)].decode("utf-8", "ignore")


def _tail_of(data: bytes, most: int) -> str:
    """The longest suffix of ``data`` (UTF-8) of at most ``most`` bytes
    that starts on a character boundary, from the start of a line when one
    starts in its first quarter."""
    if most <= 0:
        return ""
    tail = data[-most:]
    line = tail.find(b"\n", 0, len(tail) // 4)
    if line != -1:
        tail = tail[line + 1:]
    return tail.decode("utf-8", "ignore")


#: What stands for the part of a traceback cut from a failure's reason.
REASON_CUT_MARK = "\n[... traceback cut ...]\n"


def _str_of(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # a broken __str__ is no reason to lose the failure
        return f"<{type(error).__name__}: str() failed>"


def _traceback_of(error: BaseException) -> str:
    """The traceback of ``error`` as Python prints it (its causes and
    context first), without the closing ``Type: message`` lines, which
    the reason's head line already says; empty for an error never raised."""
    if error.__traceback__ is None:
        return ""
    te = traceback.TracebackException.from_exception(error)
    lines = list(te.format())
    last = list(te.format_exception_only())
    if last and lines[-len(last):] == last:
        del lines[-len(last):]
    return "".join(lines)


def _failure_reason(error: BaseException, bytes_max: int = FAIL_REASON_BYTES_MAX) -> str:
    """The reason a worker sends for an attempt whose handler raised
    ``error``: ``"{Type}: {message}"``, then the traceback (the failing
    frame last), at most ``bytes_max`` bytes of UTF-8. When it is longer,
    the head line is kept (cut at half of ``bytes_max``), then
    :data:`REASON_CUT_MARK`, then as much of the traceback's end as fits,
    cut on a character boundary."""
    head = f"{type(error).__name__}: {_str_of(error)}"
    trace = _traceback_of(error)
    whole = _utf8(f"{head}\n{trace}".rstrip("\n") if trace else head)
    if len(whole) <= bytes_max:
        return whole.decode("utf-8")
    head_bytes = _utf8(head)
    if not trace:
        return _head_of(head_bytes, bytes_max)
    if len(head_bytes) > bytes_max // 2:
        head = _head_of(head_bytes, bytes_max // 2 - 3) + "..."
        head_bytes = _utf8(head)
    room = bytes_max - len(head_bytes) - len(_utf8(REASON_CUT_MARK))
    return head + REASON_CUT_MARK + _tail_of(_utf8(trace.rstrip("\n")), room)


#: Most bytes of a job's result (the server's bound): a handler that
#: returns more fails its attempt, saying so.
RESULT_BYTES_MAX = 64 * 1024


def _result_field(value: Any) -> Optional[Dict[str, str]]:
    """The wire form of a handler's return value in ``POST /v1/ack``:
    ``None`` for none, ``str`` as text, ``bytes`` in base64, anything else
    as its JSON text. Raises ``ValueError`` (the attempt fails) for a value
    that is none of these or is over :data:`RESULT_BYTES_MAX`."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        field = {"result_b64": base64.b64encode(raw).decode("ascii")}
    else:
        if isinstance(value, str):
            text = value
        else:
            try:
                text = json.dumps(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"the handler returned a {type(value).__name__}, which is not str, bytes or "
                                 f"JSON ({e}); return None for no result") from e
        raw = text.encode("utf-8", "surrogatepass")
        field = {"result": text}
    if len(raw) > RESULT_BYTES_MAX:
        raise ValueError(f"the handler's result is {len(raw)} bytes, over the {RESULT_BYTES_MAX}-byte bound on results")
    return field


def _result_of(id: str, timeout: float, doc: Any, past: bool) -> Optional["FinishedInfo"]:
    """What :meth:`Client.result` makes of one answer: the finished job,
    ``None`` to wait on, or the error it raises."""
    if "outcome" in doc:
        return FinishedInfo._of(doc)
    if doc.get("state") == "dead":
        raise JobDied(id, doc.get("reason"), doc.get("dependent_state"))
    if past:
        raise ResultTimeout(id, timeout, str(doc.get("state")))
    return None


def _ack_body(jobs: List["ClaimedJob"]) -> Dict[str, Any]:
    """``POST /v1/ack`` of ``jobs``, with their results when any has one."""
    body: Dict[str, Any] = {"receipts": [j.receipt for j in jobs]}
    if any(j._result is not None for j in jobs):
        body["results"] = [j._result for j in jobs]
    return body


def _outcome_of(job: "ClaimedJob", error: Optional[BaseException]) -> Optional[Tuple[str, Dict[str, Any]]]:
    """``None`` for a handler that returned (an ack), else the fail request
    (logged: a failed attempt with its traceback, at WARNING)."""
    if error is None:
        return None
    if isinstance(error, Retry):
        log.info("shardq worker: job %s (key %r, attempt %d) at %s: the handler asked for a retry in %d ms: %s",
                    job.id, job.key, job.attempt, job.url, error.retry_in_ms, error)
        return ("/v1/fail", {"receipt": job.receipt, "reason": _head_of(_utf8(_str_of(error)), FAIL_REASON_BYTES_MAX),
                             "retry_in_ms": int(error.retry_in_ms)})
    if isinstance(error, BackOff):
        log.info("shardq worker: job %s (key %r) at %s: the handler backs off: %s", job.id, job.key, job.url, error)
        return ("/v1/fail", {"receipt": job.receipt, "reason": _head_of(_utf8(str(error)), FAIL_REASON_BYTES_MAX),
                             "backoff_ms": error.ms, "backoff_group": error.group})
    log.warning("shardq worker: job %s (key %r, shard %s, attempt %d of %s) at %s failed: %s: %s",
                job.id, job.key, job.shard, job.attempt, job.max_attempts if job.max_attempts is not None else "?",
                job.url, type(error).__name__, _str_of(error), exc_info=error)
    return ("/v1/fail", {"receipt": job.receipt, "reason": _failure_reason(error)})


def _lost_of(jobs: List["ClaimedJob"], doc: Any) -> List["ClaimedJob"]:
    """The jobs of a batched ack answered 409 whose runs were lost (the valid
    receipts were acked; without the lists, all of them)."""
    refused = set(_stale_of(doc))
    return [j for j in jobs if j.receipt in refused] if refused else list(jobs)


class Enqueued(NamedTuple):
    """A stored job: its id, shard and key; ``duplicate`` when the server
    already had a job with its dedup id under its key before this call
    (this call stored nothing new; a retry of this call finding its own
    earlier attempt's job is not a duplicate when the id was generated).
    A dependent (a job of a request with ``after``) is ``waiting``: its id
    is ``@N``, its ``shard`` empty (it is on no shard until released) and
    its ``dedup_id`` empty. A job of a batch is ``waiting`` too, with the
    id ``@M`` and its ``dedup_id``, and ``batch`` names its batch
    (``@N``; ``None`` for other jobs). Immutable; a named tuple (a frozen
    dataclass cost more to make than the rest of an enqueue per job)."""

    id: str
    shard: str
    key: str
    duplicate: bool
    dedup_id: str
    waiting: bool = False
    batch: Optional[str] = None


@dataclass
class NewJob:
    """A job for :meth:`Client.enqueue_many`. ``dedup_id`` names the job
    under its key (the same id under another key is another job); when
    ``None``, the enqueue generates one and sets it here. ``unique_id``
    makes it a unique job (nothing stored while the key's job with that id
    waits, or with ``unique_while="running"`` waits or runs: the answer is
    that job, ``duplicate``); ``debounce_id`` with ``debounce_ms`` a
    debounced one (the key's waiting job with that id takes this payload
    and starts ``debounce_ms`` later, at most ``debounce_max_ms`` after the
    burst's first). A keyed job has no dedup id of its own.

    ``after`` makes it a dependent: it runs once every job it names has
    ended. Its items are job ids (``"SHARD:ID"`` as :meth:`Client.enqueue`
    gives them, or dependents' ids ``"@N"``) or ``int`` indexes of other
    jobs of the same :meth:`Client.enqueue_many` call (or
    :meth:`Client.enqueue_graph`). ``on_dependency_failure`` (with
    ``after`` only) says what a dependency that did not complete does:
    ``"fail"`` (the default: the dependent fails and never runs),
    ``"ignore"`` (it runs without that result) or ``"run"`` (it runs with
    every outcome). Both are sent only when set. A call with any job with
    ``after`` goes in one request, where every job is a dependent (one
    without ``after`` is released at the next resolver pass, about 100
    ms) and none takes a dedup, unique or debounce id.

    ``batch`` (``"@N"``, as :meth:`Client.open_batch` returns it) makes it
    a job of that batch: it is stored with the batch (answered ``@M`` and
    ``waiting``) and enqueued on its key at the next resolver pass. Every
    job of a call with ``batch`` names the same batch; none takes
    ``after``, a unique or a debounce id; each keeps its dedup id (given or
    generated), so sending the same jobs again joins nothing twice."""

    key: str
    payload: Payload = b""
    delay_ms: int = 0
    max_attempts: Optional[int] = None
    dedup_id: Optional[str] = None
    unique_id: Optional[str] = None
    unique_while: Optional[str] = None
    debounce_id: Optional[str] = None
    debounce_ms: Optional[int] = None
    debounce_max_ms: Optional[int] = None
    after: Optional[Sequence[Union[str, int]]] = None
    on_dependency_failure: Optional[str] = None
    batch: Optional[str] = None


JobLike = Union[NewJob, Mapping[str, Any]]


def _check_batch_limits(batch_max: int, batch_bytes_max: int) -> None:
    if not 1 <= batch_max:
        raise ConfigError(f"invalid batch_max {batch_max!r}: at least 1")
    if not 1 <= batch_bytes_max:
        raise ConfigError(f"invalid batch_bytes_max {batch_bytes_max!r}: at least 1")


class Moved(NamedTuple):
    """A job that left its shard with its key in a rebalance: the key, and
    the shard the key is on now (``GET /v1/jobs/{id}`` of its old id
    answers its copy with a ``moved`` object, or 404 with one when the
    copy is no longer remembered)."""

    key: str
    shard: str

    @staticmethod
    def _of(doc: Any) -> "Optional[Moved]":
        m = doc.get("moved") if isinstance(doc, Mapping) else None
        if not isinstance(m, Mapping):
            return None
        return Moved(key=str(m["key"]), shard=str(m["shard"]))


@dataclass(frozen=True)
class FinishedInfo:
    """A job that finished, as ``finished`` of ``GET /v1/keys/{key}/jobs``
    shows it, kept for the deployment's retention (``shardq retention``):
    ``outcome`` is ``completed`` or ``cancelled``; ``attempts`` those
    started; ``finished_ms`` and ``attempt_starts_ms`` ms since the epoch;
    ``reason`` the last failed attempt's, if one failed."""

    id: str
    shard: str
    key: str
    outcome: str
    attempts: int
    finished_ms: int
    reason: Optional[str]
    attempt_starts_ms: Tuple[int, ...] = ()
    #: What the handler returned with its ack (``None``: nothing), as bytes;
    #: :attr:`result_text` decodes it.
    result: Optional[bytes] = None

    @property
    def result_text(self) -> Optional[str]:
        """The result as UTF-8 text (``None`` without one)."""
        return None if self.result is None else self.result.decode("utf-8", "replace")

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "FinishedInfo":
        result = _result_bytes(doc)
        return FinishedInfo(
            id=str(doc["id"]), shard=str(doc["shard"]), key=str(doc["key"]),
            outcome=str(doc["outcome"]), attempts=int(doc["attempts"]),
            finished_ms=int(doc["finished_ms"]), reason=doc.get("reason"),
            attempt_starts_ms=tuple(int(t) for t in doc.get("attempt_starts_ms") or ()),
            result=result,
        )


def _result_bytes(doc: Mapping[str, Any]) -> Optional[bytes]:
    """A ``result`` (text) or ``result_b64`` (bytes) field as bytes."""
    if doc.get("result") is not None:
        return str(doc["result"]).encode("utf-8", "surrogatepass")
    if doc.get("result_b64") is not None:
        return base64.b64decode(str(doc["result_b64"]))
    return None


@dataclass(frozen=True)
class DependencyOutcome:
    """One dependency of a dependent, as :meth:`Client.dependent` shows it:
    its ``id`` as named in ``after`` (``SHARD:ID`` or ``@N``; an index of
    the enqueue's request shows as that job's ``@N``); its ``outcome``
    once it ended (``"completed"``, ``"cancelled"``, ``"dead"``,
    ``"failed"``: a dependent that failed or was cancelled, or
    ``"forgotten"``: gone before it was seen to end), ``None`` while it
    has not; ``at`` the job where it ended when that is another id (it
    moved with its key, or it is a dependent's released job); ``result``
    what its handler returned (a completed one; ``None`` for nothing, and
    when it was dropped: ``result_dropped``, past the dependent's bound on
    results); ``reason`` why it did not complete."""

    id: str
    outcome: Optional[str]
    at: Optional[str] = None
    result: Optional[bytes] = None
    reason: Optional[str] = None
    result_dropped: bool = False

    @property
    def result_text(self) -> Optional[str]:
        """The result as UTF-8 text (``None`` without one)."""
        return None if self.result is None else self.result.decode("utf-8", "replace")

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "DependencyOutcome":
        outcome = doc.get("outcome")
        at = doc.get("at")
        reason = doc.get("reason")
        return DependencyOutcome(
            id=str(doc["id"]), outcome=None if outcome is None else str(outcome), at=None if at is None else str(at),
            result=_result_bytes(doc), reason=None if reason is None else str(reason),
            result_dropped=bool(doc.get("result_dropped", False)),
        )


@dataclass(frozen=True)
class DependentInfo:
    """A dependent (a job enqueued with ``after``) as :meth:`Client.dependent`
    shows it: its ``id`` (``@N``) and ``key``; its ``state``:
    ``"waiting"`` (on no shard yet: some dependency has not ended),
    ``"released"`` (enqueued on its key as the job ``released``,
    ``SHARD:ID``: :meth:`Client.job`, :meth:`Client.finished` and
    :meth:`Client.result` of either id follow it), ``"failed"`` (a
    dependency did not complete under the policy ``"fail"``; ``reason``
    names it; it never runs) or ``"cancelled"``; ``after`` each
    dependency's :class:`DependencyOutcome`, in the order named;
    ``on_dependency_failure`` its policy; the job's ``payload``,
    ``max_attempts`` and ``delay_ms`` as enqueued; ``created_ms`` and
    ``ended_ms`` (when it stopped waiting; ``None`` while it waits), ms
    since the epoch."""

    id: str
    key: str
    state: str
    released: Optional[str]
    reason: Optional[str]
    after: Tuple[DependencyOutcome, ...]
    on_dependency_failure: str = "fail"
    created_ms: int = 0
    ended_ms: Optional[int] = None
    max_attempts: Optional[int] = None
    delay_ms: int = 0
    payload: bytes = b""

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "DependentInfo":
        def opt_int(name: str) -> Optional[int]:
            v = doc.get(name)
            return None if v is None else int(v)

        released = doc.get("released")
        reason = doc.get("reason")
        return DependentInfo(
            id=str(doc["id"]), key=str(doc["key"]), state=str(doc["state"]),
            released=None if released is None else str(released), reason=None if reason is None else str(reason),
            after=tuple(DependencyOutcome._of(d) for d in doc.get("after") or ()),
            on_dependency_failure=str(doc.get("on_dependency_failure") or "fail"),
            created_ms=int(doc.get("created_ms") or 0), ended_ms=opt_int("ended_ms"),
            max_attempts=opt_int("max_attempts"), delay_ms=int(doc.get("delay_ms") or 0),
            payload=_decode_payload(doc),
        )


_DEPENDENT_ID = re.compile(r"@[0-9]+")
#: The states a 409 on cancelling a dependent names when it had ended (its
#: job ``finished``, or it ``failed`` or was ``cancelled`` while waiting).
_DEPENDENT_ENDED = ("finished", "failed", "cancelled")


def _dependent_path(id: Any) -> str:
    """``/v1/jobs/@N`` of a dependent's id, checked."""
    if not isinstance(id, str) or not _DEPENDENT_ID.fullmatch(id):
        raise ConfigError(f"invalid dependent id {id!r}: \"@N\" is needed, as an enqueue with after gives it "
                          f"(Enqueued.id) and a claimed job carries it (ClaimedJob.dependent)")
    return f"/v1/jobs/{quote(id, safe=':')}"


def _is_dependent_id(id: str) -> bool:
    return isinstance(id, str) and _DEPENDENT_ID.fullmatch(id) is not None


#: The kinds of a batch's callbacks: ``complete`` (every job of the closed
#: batch ended, however), ``success`` (every job of the closed batch was
#: acked) and ``death`` (the batch's first dead job).
BATCH_CALLBACK_KINDS = ("complete", "success", "death")


@dataclass(frozen=True)
class BatchCounts:
    """A batch's jobs by how far they got: ``jobs`` in all, ``pending``
    (not ended), ``completed``, ``dead`` (out of attempts) and ``other``
    (cancelled or forgotten)."""

    jobs: int
    pending: int
    completed: int
    dead: int
    other: int

    @staticmethod
    def _of(doc: Any) -> "BatchCounts":
        d = doc if isinstance(doc, Mapping) else {}
        return BatchCounts(*(int(d.get(name) or 0) for name in ("jobs", "pending", "completed", "dead", "other")))


@dataclass(frozen=True)
class BatchCallback:
    """One callback of a batch, as :meth:`Client.batch` shows it: its
    ``kind`` (``"complete"``, ``"success"``, ``"death"``), its ``payload``
    as given to :meth:`Client.open_batch`, and ``fired``: the job it was
    enqueued as (``SHARD:ID``), ``None`` until it fires."""

    kind: str
    payload: bytes
    fired: Optional[str] = None

    @property
    def payload_text(self) -> str:
        """The payload as UTF-8 text."""
        return self.payload.decode("utf-8", "replace")


@dataclass(frozen=True)
class BatchInfo:
    """A batch as :meth:`Client.batch` shows it: its ``id`` (``@N``) and
    ``key`` (its callbacks' key); its ``state``: ``"open"`` (it takes
    jobs), ``"closed"`` (only its own jobs add to it, until every job
    ended) or ``"complete"`` (every job ended and every callback due
    fired); ``counts`` (:class:`BatchCounts`); ``callbacks`` by kind
    (:class:`BatchCallback`, only the kinds it was opened with); ``jobs``
    each job's :class:`DependencyOutcome` (its ``@M``, outcome, where it
    ran, its result), in the order they joined; ``max_attempts`` of each
    callback; ``created_ms``, ``closed_ms`` and ``ended_ms`` (``None``
    until then), ms since the epoch."""

    id: str
    key: str
    state: str
    counts: BatchCounts
    callbacks: Mapping[str, BatchCallback]
    jobs: Tuple[DependencyOutcome, ...]
    max_attempts: Optional[int] = None
    created_ms: int = 0
    closed_ms: Optional[int] = None
    ended_ms: Optional[int] = None

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "BatchInfo":
        def opt_int(name: str) -> Optional[int]:
            v = doc.get(name)
            return None if v is None else int(v)

        callbacks: Dict[str, BatchCallback] = {}
        for kind, cb in (doc.get("callbacks") or {}).items():
            c = cb if isinstance(cb, Mapping) else {}
            fired = c.get("fired")
            callbacks[str(kind)] = BatchCallback(str(kind), _decode_payload(c), None if fired is None else str(fired))
        return BatchInfo(
            id=str(doc["id"]), key=str(doc["key"]), state=str(doc["state"]), counts=BatchCounts._of(doc.get("counts")),
            callbacks=callbacks, jobs=tuple(DependencyOutcome._of(j) for j in doc.get("jobs") or ()),
            max_attempts=opt_int("max_attempts"), created_ms=int(doc.get("created_ms") or 0),
            closed_ms=opt_int("closed_ms"), ended_ms=opt_int("ended_ms"),
        )


def _batch_path(id: Any, action: str = "") -> str:
    """``/v1/batches/@N[/action]`` of a batch's id, checked."""
    if not isinstance(id, str) or not _DEPENDENT_ID.fullmatch(id):
        raise ConfigError(f"invalid batch id {id!r}: \"@N\" is needed, as open_batch returns it and a claimed job "
                          f"carries it (ClaimedJob.batch)")
    return f"/v1/batches/{id}" + (f"/{action}" if action else "")


def _open_batch_body(key: Any, callbacks: Mapping[str, Optional[Payload]], max_attempts: Optional[int],
                     dedup_id: Optional[str]) -> Dict[str, Any]:
    """The ``POST /v1/batches`` body, checked: a key, at least one callback
    (each payload UTF-8 text: the server takes no bytes for them), and a
    dedup id (generated when none is given, so a resend opens no second
    batch)."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"open_batch: invalid key {key!r}: a non-empty str is needed (the callbacks' key)")
    body: Dict[str, Any] = {"key": key}
    for name, payload in callbacks.items():
        if payload is None:
            continue
        if isinstance(payload, (bytes, bytearray, memoryview)):
            try:
                payload = bytes(payload).decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"open_batch: invalid {name}: its payload must be UTF-8 text (a callback's "
                                  f"payload is a JSON string on the wire)") from None
        if not isinstance(payload, str):
            raise ConfigError(f"open_batch: invalid {name} {payload!r}: str or bytes is needed")
        body[name] = payload
    if len(body) == 1:
        raise ConfigError(f"open_batch: no callbacks: at least one of {', '.join(callbacks)} is needed")
    if max_attempts is not None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigError(f"open_batch: invalid max_attempts {max_attempts!r}: a positive int is needed")
        body["max_attempts"] = max_attempts
    if dedup_id is not None and (not isinstance(dedup_id, str) or not dedup_id):
        raise ConfigError(f"open_batch: invalid dedup_id {dedup_id!r}: a non-empty str is needed")
    body["dedup_id"] = dedup_id if dedup_id is not None else f"batch-{os.urandom(12).hex()}"
    return body


def _batch_id_of(url: str, doc: Any) -> str:
    """The id ``@N`` of a ``POST /v1/batches`` answer."""
    id = doc.get("id") if isinstance(doc, dict) else None
    if not isinstance(id, str) or not _DEPENDENT_ID.fullmatch(id):
        raise HttpError(url, 200, f"/v1/batches answered no batch id: {str(doc)[:200]}")
    return id


@dataclass(frozen=True)
class ScheduleTick:
    """The schedule and tick a schedule's job was enqueued for: the
    schedule's ``id``, the tick (``tick_ms``, ms since the epoch, or the
    time of a trigger) and whether an operator ``triggered`` it."""

    id: str
    tick_ms: int
    triggered: bool = False

    @staticmethod
    def _of(doc: Any) -> "Optional[ScheduleTick]":
        if not doc:
            return None
        return ScheduleTick(id=str(doc["id"]), tick_ms=int(doc["tick_ms"]), triggered=bool(doc.get("triggered")))


@dataclass(frozen=True)
class JobInfo:
    """A live job as ``GET /v1/jobs/{id}`` shows it: ``state`` is
    ``queued``, ``delayed``, ``running`` or ``dead``; ``attempts`` counts
    the finished ones (a running job is on attempt ``attempts + 1``); times
    are ms since the epoch; ``run`` is ``(fence, lease_expires_ms)`` for a
    running job; ``reason`` the last failure's; ``attempt_starts_ms`` when
    each attempt started, oldest first (empty for a job not started yet;
    a job moved with its key keeps its count of attempts, not their times)."""

    id: str
    shard: str
    key: str
    state: str
    attempts: int
    max_attempts: int
    created_ms: int
    not_before_ms: int
    run: Optional[Tuple[int, int]]
    reason: Optional[str]
    payload: bytes
    attempt_starts_ms: Tuple[int, ...] = ()
    #: The dedup id it was enqueued with (``None``: none).
    dedup_id: Optional[str] = None
    #: A schedule's job: its schedule and tick.
    schedule: Optional[ScheduleTick] = None

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "JobInfo":
        run = doc.get("run")
        return JobInfo(
            id=str(doc["id"]), shard=str(doc["shard"]), key=str(doc["key"]), state=str(doc["state"]),
            attempts=int(doc["attempts"]), max_attempts=int(doc["max_attempts"]),
            created_ms=int(doc["created_ms"]), not_before_ms=int(doc["not_before_ms"]),
            run=(int(run["fence"]), int(run["lease_expires_ms"])) if run else None,
            reason=doc.get("reason"), payload=_decode_payload(doc),
            attempt_starts_ms=tuple(int(t) for t in doc.get("attempt_starts_ms") or ()),
            dedup_id=doc.get("dedup_id"), schedule=ScheduleTick._of(doc.get("schedule")),
        )


@dataclass(frozen=True)
class FlowPolicy:
    """A flow-control policy as the server shows it (every field spelt
    out): ``concurrency`` runs of a key at once (1: a key runs its jobs one
    at a time, in order); ``rate`` its starts per unit of time (``"50/s"``,
    ``"600/m"``, ``"1000/h"``; ``None``: unlimited) and ``burst`` the tokens
    its bucket holds (one second of the rate unless set; ``None`` without a
    rate); ``weight`` its share of slots among ready keys of one
    ``priority`` (higher first); ``group`` the group whose shared rate its
    starts also count against. Starts are counted over every worker of the
    deployment."""

    concurrency: int = 1
    rate: Optional[str] = None
    burst: Optional[int] = None
    weight: int = 1
    priority: int = 0
    group: Optional[str] = None

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "FlowPolicy":
        burst = doc.get("burst")
        return FlowPolicy(
            concurrency=int(doc.get("concurrency", 1)), rate=doc.get("rate"),
            burst=None if burst is None else int(burst), weight=int(doc.get("weight", 1)),
            priority=int(doc.get("priority", 0)), group=doc.get("group"),
        )


@dataclass(frozen=True)
class PolicyInfo:
    """The answer of :meth:`Client.policy`: the ``policy`` that ``key``
    gets and its ``source``: ``"key"`` (its own), ``"prefix"`` (then
    ``prefix`` names the longest prefix with a policy) or ``"default"``
    (the deployment's default). For a prefix's or the default's own policy
    (``scope``), ``source`` is the scope."""

    key: str
    policy: FlowPolicy
    source: str
    prefix: Optional[str]

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "PolicyInfo":
        return PolicyInfo(key=str(doc["key"]), policy=FlowPolicy._of(doc["policy"]), source=str(doc["from"]),
                          prefix=doc.get("prefix"))


@dataclass(frozen=True)
class GroupInfo:
    """A flow-control group, shared by every key whose policy names it,
    over every worker: a ``rate`` (``"20/s"``) with its bucket's ``burst``
    (one second of the rate unless set), a ``concurrency`` (runs of its
    keys at once), or both; what it lacks is ``None``."""

    rate: Optional[str]
    burst: Optional[int]
    concurrency: Optional[int] = None

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "GroupInfo":
        def opt(v: Any, kind: Any) -> Any:
            return None if v is None else kind(v)

        return GroupInfo(rate=opt(doc.get("rate"), str), burst=opt(doc.get("burst"), int),
                         concurrency=opt(doc.get("concurrency"), int))


@dataclass(frozen=True)
class FlowSettings:
    """Every flow-control setting of the deployment (:meth:`Client.policies`):
    the ``default`` policy, the policies by ``prefixes`` and by ``keys``,
    and the ``groups`` by name. A key follows its own policy, else its
    longest prefix's, else the default."""

    default: FlowPolicy
    prefixes: Dict[str, FlowPolicy]
    keys: Dict[str, FlowPolicy]
    groups: Dict[str, GroupInfo]

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "FlowSettings":
        return FlowSettings(
            default=FlowPolicy._of(doc.get("default") or {}),
            prefixes={str(k): FlowPolicy._of(v) for k, v in (doc.get("prefixes") or {}).items()},
            keys={str(k): FlowPolicy._of(v) for k, v in (doc.get("keys") or {}).items()},
            groups=_groups_of(doc.get("groups")),
        )


def _groups_of(doc: Any) -> Dict[str, GroupInfo]:
    return {str(n): GroupInfo._of(g) for n, g in (doc or {}).items()}


@dataclass(frozen=True)
class KeyHold:
    """A handler's back-off of a key, as :meth:`Client.resume_key` lifted
    it: the ``key``, the ``shard`` it routes to, when the back-off would
    have ended (``until_ms``, ms since the epoch on the server's clock) and
    the jobs it held (``jobs``: ``SHARD:ID`` ids, in key order), which are
    due now."""

    key: str
    shard: str
    until_ms: int
    jobs: Tuple[str, ...]

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "Optional[KeyHold]":
        """The hold a ``/v1/keys/{key}/resume`` answer lifted; ``None`` when
        it lifted none (``"resumed": false``, ``back_off`` null)."""
        hold = doc.get("back_off")
        if not doc.get("resumed") or not isinstance(hold, Mapping):
            return None
        return KeyHold(key=str(doc["key"]), shard=str(doc["shard"]), until_ms=int(hold["until_ms"]),
                       jobs=tuple(str(j) for j in hold.get("jobs") or ()))


def _group_resume_path(name: str) -> str:
    return f"/v1/groups/{_segment(name, 'group name')}/resume"


def _key_resume_path(key: str) -> str:
    return f"/v1/keys/{_segment(key, 'key')}/resume"


_POLICY_SCOPES = ("key", "prefix", "default")


def _segment(value: Any, what: str) -> str:
    """``value`` as one path segment, percent-encoded as keys are for
    ``/v1/keys/{key}``."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"invalid {what} {value!r}: a non-empty str is needed")
    return quote(value, safe="")


def _policy_target(key: Optional[str], prefix: Optional[str], default: bool) -> str:
    """The ``/v1/policies/...`` path of exactly one of a key, a prefix or
    the default."""
    named = [n for n, v in (("key", key), ("prefix", prefix)) if v is not None] + (["default"] if default else [])
    if len(named) != 1:
        raise ConfigError(f"name exactly one of key, prefix or default=True (got {', '.join(named) or 'none'})")
    if default:
        return "/v1/policies/default?scope=default"
    if key is not None:
        return f"/v1/policies/{_segment(key, 'key')}"
    return f"/v1/policies/{_segment(prefix, 'prefix')}?scope=prefix"


def _policy_shown(key: Optional[str], scope: str) -> str:
    if scope not in _POLICY_SCOPES:
        raise ConfigError(f"invalid scope {scope!r}: one of {', '.join(_POLICY_SCOPES)}")
    return _policy_target(key if scope == "key" else None, key if scope == "prefix" else None, scope == "default")


def _policy_body(**fields: Any) -> Dict[str, Any]:
    """A whole policy with only the fields given (the others take their
    defaults on the server)."""
    return {k: v for k, v in fields.items() if v is not None}


def _group_body(rate: Optional[str], burst: Optional[int], concurrency: Optional[int]) -> Dict[str, Any]:
    if rate is not None and (not isinstance(rate, str) or not rate):
        raise ConfigError(f"invalid group rate {rate!r}: a str such as '20/s', '600/m' or '1000/h', or None")
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)):
        raise ConfigError(f"invalid group concurrency {concurrency!r}: an int from 1 to 10000, or None")
    if rate is None and concurrency is None:
        raise ConfigError("a group needs a rate, a concurrency or both")
    body: Dict[str, Any] = {}
    if rate is not None:
        body["rate"] = rate
    if burst is not None:
        body["burst"] = burst
    if concurrency is not None:
        body["concurrency"] = concurrency
    return body


@dataclass(frozen=True)
class Schedule:
    """A recurring schedule as the server stores it: every tick enqueues one
    job of ``key`` with ``payload`` (its dedup id ``schedule:ID@TICK_MS``,
    so a tick stores one job wherever it is fired from). It ticks on a
    ``cron`` expression in the IANA zone ``tz``, or every ``every_ms``
    (the other two are ``None``). ``overlap`` says what a tick does while
    the previous tick's job is live: ``"skip"`` (no job), ``"one"`` (at
    most one waiting) or ``"all"``; ``catch_up_ms`` how late a tick may
    still fire; ``jitter_ms`` the largest delay added to a fire;
    ``start_ms`` and ``end_ms`` (``None``: unbounded) the range of its
    ticks; ``max_attempts`` each job's attempts; ``since_ms`` when it was
    set or last resumed (no earlier tick fires). Times are ms since the
    epoch."""

    key: str
    cron: Optional[str]
    tz: Optional[str]
    every_ms: Optional[int]
    payload: str
    overlap: str
    catch_up_ms: int
    jitter_ms: int
    start_ms: Optional[int]
    end_ms: Optional[int]
    max_attempts: int
    paused: bool
    since_ms: int

    @staticmethod
    def _fields(doc: Mapping[str, Any]) -> Dict[str, Any]:
        when = doc.get("when")
        if not isinstance(when, Mapping):
            raise ValueError(f"a schedule without its when: {doc!r}")
        cron = when.get("cron")
        every = when.get("every")
        if isinstance(cron, Mapping):
            c: Tuple[Optional[str], Optional[str], Optional[int]] = (str(cron["expr"]), str(cron["tz"]), None)
        elif isinstance(every, Mapping):
            c = (None, None, int(every["every_ms"]))
        else:
            raise ValueError(f"a schedule's when is neither cron nor every: {when!r}")

        def opt_int(name: str) -> Optional[int]:
            v = doc.get(name)
            return None if v is None else int(v)

        return dict(
            key=str(doc["key"]), cron=c[0], tz=c[1], every_ms=c[2], payload=str(doc.get("payload") or ""),
            overlap=str(doc.get("overlap", "skip")), catch_up_ms=int(doc["catch_up_ms"]),
            jitter_ms=int(doc.get("jitter_ms", 0)), start_ms=opt_int("start_ms"), end_ms=opt_int("end_ms"),
            max_attempts=int(doc["max_attempts"]), paused=bool(doc.get("paused", False)),
            since_ms=int(doc["since_ms"]),
        )

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "Schedule":
        return Schedule(**Schedule._fields(doc))


@dataclass(frozen=True)
class ScheduleFire:
    """A schedule's latest fire: the tick it was for (``tick_ms``, or the
    time of a trigger), when its job was stored (``at_ms``), the ``shard``
    and the ``job`` (``SHARD:ID``, as :meth:`Client.job` takes it)."""

    tick_ms: int
    at_ms: int
    shard: str
    job: str


@dataclass(frozen=True)
class ScheduleState:
    """What the servers and workers recorded of a schedule's ticks: every
    tick at or before ``decided_ms`` was decided for good, as ``fired``
    (stored a job), ``skipped`` (the overlap policy: the previous job was
    live) or ``missed`` (past its catch-up window: nothing ran the key's
    shard); ``last`` is the latest fire (``None`` before the first)."""

    decided_ms: int
    last: Optional[ScheduleFire]
    fired: int
    skipped: int
    missed: int

    @staticmethod
    def _of(doc: Any) -> "ScheduleState":
        doc = doc if isinstance(doc, Mapping) else {}
        last = doc.get("last")
        fire = None
        if isinstance(last, Mapping):
            shard = str(last["shard"])
            fire = ScheduleFire(tick_ms=int(last["tick_ms"]), at_ms=int(last["at_ms"]), shard=shard,
                                job=f"{shard}:{last['job']}")
        return ScheduleState(decided_ms=int(doc.get("decided_ms", 0)), last=fire, fired=int(doc.get("fired", 0)),
                             skipped=int(doc.get("skipped", 0)), missed=int(doc.get("missed", 0)))


@dataclass(frozen=True)
class ScheduleInfo(Schedule):
    """A schedule as :meth:`Client.schedule` and :meth:`Client.schedules`
    show it: the :class:`Schedule`'s fields, its ``id``, its ``state``
    (:class:`ScheduleState`) and when its next tick is due
    (``next_fire_ms``, ms since the epoch, in the past while overdue;
    ``None`` while paused or past its end)."""

    id: str
    state: ScheduleState
    next_fire_ms: Optional[int]

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "ScheduleInfo":
        nxt = doc.get("next_fire_ms")
        return ScheduleInfo(**Schedule._fields(doc), id=str(doc["id"]), state=ScheduleState._of(doc.get("state")),
                            next_fire_ms=None if nxt is None else int(nxt))


@dataclass(frozen=True)
class ScheduleTriggered:
    """The job a :meth:`Client.trigger_schedule` enqueued for the schedule
    ``id``: its ``shard`` and ``job`` id (``SHARD:ID``)."""

    id: str
    shard: str
    job: str

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "ScheduleTriggered":
        return ScheduleTriggered(id=str(doc["id"]), shard=str(doc["shard"]), job=str(doc["job"]))


@dataclass(frozen=True)
class ScheduleBackfilled:
    """What a :meth:`Client.backfill_schedule` did: the ``ticks`` in its
    range, the jobs it ``stored``, and the ticks whose job was stored
    already (``already_stored``: fired or backfilled before, within the
    dedup window of the schedule: its catch-up, its jitter and 10
    minutes)."""

    id: str
    ticks: int
    stored: int
    already_stored: int

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "ScheduleBackfilled":
        return ScheduleBackfilled(id=str(doc["id"]), ticks=int(doc["ticks"]), stored=int(doc["stored"]),
                                  already_stored=int(doc["already_stored"]))


@dataclass(frozen=True)
class SchedulesApplied:
    """What a :meth:`Client.apply_schedules` did (or, with ``dry_run``,
    would do), by schedule id: ``added``, ``changed``, ``unchanged`` and
    ``removed`` (deleted by ``prune``)."""

    dry_run: bool
    added: Tuple[str, ...]
    changed: Tuple[str, ...]
    unchanged: Tuple[str, ...]
    removed: Tuple[str, ...]

    @staticmethod
    def _of(doc: Mapping[str, Any]) -> "SchedulesApplied":
        a = doc["applied"]
        return SchedulesApplied(dry_run=bool(doc["dry_run"]), added=tuple(a["added"]), changed=tuple(a["changed"]),
                                unchanged=tuple(a["unchanged"]), removed=tuple(a["removed"]))


#: A time as the schedule calls take it: ms since the epoch, RFC 3339 text
#: (``"2026-03-28T00:00:00Z"``) or a timezone-aware ``datetime``.
ScheduleTime = Union[int, str, datetime]

_OVERLAPS = ("skip", "one", "all")


def _schedule_path(id: str, action: str = "") -> str:
    path = f"/v1/schedules/{_segment(id, 'schedule id')}"
    return f"{path}/{action}" if action else path


def _schedule_time(value: Any, what: str) -> Union[int, str]:
    """``value`` as the server reads a time: ms (an int) or RFC 3339 text."""
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ConfigError(f"invalid {what} {value!r}: a datetime with its timezone is needed "
                              f"(datetime.now(timezone.utc), say), a naive one names no instant")
        return int(value.timestamp() * 1000)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"invalid {what} {value!r}: ms since the epoch (an int), RFC 3339 text or an aware datetime")
    return value


def _schedule_body(key: str, cron: Optional[str], tz: Optional[str], every: Optional[str], payload: Optional[Payload],
                   overlap: Optional[str], catch_up: Optional[str], jitter: Optional[str],
                   start: Optional[ScheduleTime], end: Optional[ScheduleTime],
                   max_attempts: Optional[int]) -> Dict[str, Any]:
    """The ``PUT /v1/schedules/{id}`` body of the fields given; what the
    server alone can check (the cron fields, the zone, the durations) it
    checks, naming the field and the value."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"invalid schedule key {key!r}: a non-empty str is needed")
    if (cron is None) == (every is None):
        raise ConfigError(f"a schedule needs exactly one of cron and every (got cron {cron!r}, every {every!r})")
    if tz is not None and cron is None:
        raise ConfigError(f"invalid tz {tz!r}: a zone goes with a cron expression, not with every")
    if overlap is not None and overlap not in _OVERLAPS:
        raise ConfigError(f"invalid overlap {overlap!r}: one of {', '.join(_OVERLAPS)}")
    body: Dict[str, Any] = {"key": key}
    if isinstance(payload, (bytes, bytearray, memoryview)):
        try:
            payload = bytes(payload).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("invalid schedule payload: the server keeps it as text, so bytes must be UTF-8") from None
    for name, value in (("cron", cron), ("tz", tz), ("every", every), ("payload", payload), ("overlap", overlap),
                        ("catch_up", catch_up), ("jitter", jitter), ("max_attempts", max_attempts)):
        if value is not None:
            body[name] = value
    if start is not None:
        body["start"] = _schedule_time(start, "start")
    if end is not None:
        body["end"] = _schedule_time(end, "end")
    return body


_SCHEDULE_FIELDS = ("key", "cron", "tz", "every", "payload", "overlap", "catch_up", "jitter", "start", "end",
                    "max_attempts")


def _apply_body(schedules: Mapping[str, Mapping[str, Any]], prune: bool, dry_run: bool) -> Dict[str, Any]:
    """The ``PUT /v1/schedules`` body: each schedule's fields checked as
    :meth:`Client.set_schedule` checks them, an unknown one named."""
    if not isinstance(schedules, Mapping):
        raise ConfigError(f"invalid schedules {type(schedules).__name__}: a mapping of id to fields is needed")
    out: Dict[str, Any] = {}
    for id, fields in schedules.items():
        _segment(id, "schedule id")
        if not isinstance(fields, Mapping):
            raise ConfigError(f"invalid schedule {id!r}: a mapping of fields is needed")
        unknown = sorted(set(fields) - set(_SCHEDULE_FIELDS))
        if unknown:
            raise ConfigError(f"invalid schedule {id!r}: unknown field {unknown[0]!r} "
                              f"(fields: {', '.join(_SCHEDULE_FIELDS)})")
        g = fields.get
        try:
            out[id] = _schedule_body(fields.get("key", ""), g("cron"), g("tz"), g("every"), g("payload"), g("overlap"),
                                     g("catch_up"), g("jitter"), g("start"), g("end"), g("max_attempts"))
        except ConfigError as e:
            raise ConfigError(f"schedule {id!r}: {e}") from None
    return {"schedules": out, "prune": bool(prune), "dry_run": bool(dry_run)}


def _backfill_body(start: ScheduleTime, end: ScheduleTime) -> Dict[str, Any]:
    return {"from": _schedule_time(start, "start"), "to": _schedule_time(end, "end")}


def _schedules_of(doc: Any) -> List[ScheduleInfo]:
    return [ScheduleInfo._of(v) for v in (doc or {}).get("schedules") or ()]


class Client:
    """Enqueues over HTTP. ``urls``: one or more server URLs (a list or a
    comma-separated string); each request goes to the first that answers,
    retried with backoff over all of them (``retry_rounds`` rounds). Every
    job carries a dedup id (generated when not given), so a retry after a
    lost reply never stores a job twice. A request waits up to
    ``timeout_s`` (default ``REQUEST_TIMEOUT_S``, 95 s: the server's own
    bound on a request, 90 s, plus a margin; shorter is refused). Batches
    are split at ``batch_max`` jobs and ``batch_bytes_max`` bytes (the
    server's defaults). A context manager: ``with Client(...) as c:``."""

    def __init__(
        self,
        urls: Union[str, Sequence[str]],
        token: Optional[str] = None,
        *,
        timeout_s: float = REQUEST_TIMEOUT_S,
        retry_rounds: int = RETRY_ROUNDS_DEFAULT,
        batch_max: int = ENQUEUE_BATCH_MAX,
        batch_bytes_max: int = ENQUEUE_BATCH_BYTES_MAX,
    ) -> None:
        self.urls = _normalise_urls(urls)
        self.timeout_s = _check_timeout(timeout_s)
        self.retry_rounds = retry_rounds
        _check_batch_limits(batch_max, batch_bytes_max)
        self.batch_max = batch_max
        self.batch_bytes_max = batch_bytes_max
        self._transports = [_Transport(u, token) for u in self.urls]

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def enqueue(
        self,
        key: str,
        payload: Payload = b"",
        delay_ms: int = 0,
        max_attempts: Optional[int] = None,
        dedup_id: Optional[str] = None,
        *,
        unique_id: Optional[str] = None,
        unique_while: Optional[str] = None,
        debounce_id: Optional[str] = None,
        debounce_ms: Optional[int] = None,
        debounce_max_ms: Optional[int] = None,
        after: Optional[Sequence[Union[str, int]]] = None,
        on_dependency_failure: Optional[str] = None,
        batch: Optional[str] = None,
    ) -> Enqueued:
        """Enqueues one job (the fields are :class:`NewJob`'s). With
        ``after`` (ids: ``"SHARD:ID"``, ``"@N"``) it is a dependent: it runs
        once every job named has ended, and its :class:`Enqueued` has the
        id ``"@N"`` (for :meth:`dependent`, :meth:`result`,
        :meth:`cancel`), no shard, and ``waiting``. With ``batch`` (``"@N"``
        from :meth:`open_batch`) it joins that batch: its :class:`Enqueued`
        has the id ``"@M"``, no shard, ``waiting`` and ``batch``."""
        return self.enqueue_many([NewJob(key, payload, delay_ms, max_attempts, dedup_id, unique_id, unique_while,
                                         debounce_id, debounce_ms, debounce_max_ms, after,
                                         on_dependency_failure, batch)])[0]

    def enqueue_many(self, jobs: Iterable[JobLike]) -> List[Enqueued]:
        """Enqueues ``jobs`` (``NewJob`` values or dicts with the same
        fields) in order, in requests within the batch limits; returns one
        :class:`Enqueued` per job. An error after some requests were stored
        raises :class:`PartialEnqueue` (``placed``: those jobs). When any
        job has ``after``, the jobs go as :meth:`enqueue_graph` sends them:
        in one request, all dependents. When any job has ``batch``, every
        job must name that same batch: each request joins its jobs to it in
        one write (more than ``batch_max`` jobs go in several requests, as
        for any jobs), and their dedup ids make a resend join nothing
        twice."""
        bodies = _job_bodies(jobs)
        if bodies.graph:
            return self._send_graph(bodies)
        out: List[Enqueued] = []
        for batch in _batches(bodies, self.batch_max, self.batch_bytes_max):
            try:
                out.extend(self._send(batch))
            except ShardqError as e:
                if out:
                    raise PartialEnqueue(out, e) from e
                raise
        return out

    def enqueue_graph(self, jobs: Sequence[JobLike]) -> List[Enqueued]:
        """Enqueues a graph of dependents in one request, atomically (all
        of it is stored or nothing): ``jobs`` are ``NewJob`` values (or
        dicts with the same fields) whose ``after`` names other jobs of
        ``jobs`` by their index (``int``), and jobs stored before by their
        ids (``"SHARD:ID"``, ``"@N"``). Every job is a dependent, answered
        ``@N`` and ``waiting``; one without ``after`` (a root) is released
        at the next resolver pass (about 100 ms, by a worker or a ``shardq
        serve`` that owns shards), each other once every job it names has
        ended. ``after`` is checked before anything is sent: a cycle
        raises :class:`InvalidJob` naming its jobs, as do a bad item, a
        dedup, unique or debounce id (dependents carry none), and more
        jobs than ``batch_max`` (or bytes than ``batch_bytes_max``): the
        request is never split, its indexes name jobs of the same request.
        At least one job must have ``after``.

        With no dedup id, such a request is not sent again once an attempt
        may have stored it (no answer, a timeout, a 5xx): that raises
        :class:`ServerUnavailable` saying so, as only a send that surely
        stored nothing is retried (a refused connection, a 429)."""
        bodies = _job_bodies(jobs)
        if not bodies.graph:
            raise InvalidJob(f"enqueue_graph: none of the {len(bodies)} jobs has after; enqueue_many enqueues jobs "
                             f"without dependencies")
        return self._send_graph(bodies)

    def _send_graph(self, bodies: _Bodies) -> List[Enqueued]:
        batch = _graph_request(bodies, self.batch_max, self.batch_bytes_max)
        att = _Attempts("/v1/jobs", self.retry_rounds, once=True)
        try:
            doc = self._post_any(att, _batch_body(batch))
        except TooLarge as e:
            raise _graph_too_large(batch, e) from e
        return _enqueued_of(self.urls[0], batch, doc, False)

    def dependent(self, id: str) -> Optional[DependentInfo]:
        """The dependent ``id`` (``"@N"``, as an enqueue with ``after``
        gives it and :attr:`ClaimedJob.dependent` carries it): its state,
        the job it was released as, and each dependency's outcome and
        result (:class:`DependentInfo`); ``None`` when no dependent has the
        id (it ended longer ago than dependents are kept, a day, or never
        existed). A handler of a released dependent reads its
        dependencies' results here. An id not of the form ``@N`` raises
        :class:`ConfigError` before any request."""
        status, doc = self._call("GET", _dependent_path(id), None, "reading a dependent")
        return None if status == 404 else DependentInfo._of(doc)

    def open_batch(self, key: str, on_complete: Optional[Payload] = None, on_success: Optional[Payload] = None,
                   on_death: Optional[Payload] = None, max_attempts: Optional[int] = None,
                   dedup_id: Optional[str] = None) -> str:
        """Opens a batch and returns its id (``"@N"``): jobs enqueued with
        ``batch=`` that id join it, on any keys, until it is closed (and,
        after :meth:`close_batch`, from its own jobs while one of them has
        not ended). Its callbacks are jobs on ``key`` with the payloads
        given (UTF-8 text; at least one), each enqueued once:
        ``on_complete`` once the closed batch's jobs have all ended,
        however; ``on_success`` once they were all acked; ``on_death`` at
        its first dead job. ``max_attempts`` is each callback's (default:
        the key's retry policy). ``dedup_id`` names the batch under
        ``key``: opening again with it returns the batch already opened;
        without one a random id is sent, so a retry after a lost answer
        opens no second batch. A bad argument raises :class:`ConfigError`
        before any request; the server's refusal :class:`BadRequest`
        naming the field."""
        body = _open_batch_body(key, {"on_complete": on_complete, "on_success": on_success, "on_death": on_death},
                                max_attempts, dedup_id)
        doc = self._post_any(_Attempts("/v1/batches", self.retry_rounds, [body["dedup_id"]]), _dumps(body))
        return _batch_id_of(self.urls[0], doc)

    def close_batch(self, id: str) -> bool:
        """Closes the batch ``id`` (``"@N"``): no job joins it from outside
        any more, and its complete and success callbacks fire once its jobs
        have all ended. ``True`` when this call closed it, ``False`` when
        it was closed already (by another call, or by an earlier try of
        this one whose answer was lost). An id not of the form ``@N``
        raises :class:`ConfigError` before any request; a batch the server
        does not know, :class:`HttpError` (404) naming it."""
        path = _batch_path(id, "close")
        doc = self._post_any(_Attempts(path, self.retry_rounds), b"{}")
        return bool(doc.get("closed")) if isinstance(doc, dict) else False

    def batch(self, id: str) -> Optional[BatchInfo]:
        """The batch ``id`` (``"@N"``, as :meth:`open_batch` returns it and
        :attr:`ClaimedJob.batch` carries it): its state, counts, callbacks
        and each job's outcome and result (:class:`BatchInfo`); ``None``
        when no batch has the id (it completed longer ago than batches are
        kept, a day, or never existed). An id not of the form ``@N`` raises
        :class:`ConfigError` before any request."""
        status, doc = self._call("GET", _batch_path(id), None, "reading a batch")
        return None if status == 404 else BatchInfo._of(doc)

    def _send(self, batch: _Batch) -> List[Enqueued]:
        try:
            return self._post_jobs(batch)
        except TooLarge as e:  # a server with a lower body limit: halve
            if len(batch) == 1:
                raise _too_large(batch[0], e) from e
        first, second = _halves(batch)
        return self._send(first) + self._send(second)

    def _post_jobs(self, batch: _Batch) -> List[Enqueued]:
        att = _Attempts("/v1/jobs", self.retry_rounds, [j.get("dedup_id", "") for j in batch], batch.maybe_stored)
        try:
            doc = self._post_any(att, _batch_body(batch))
        except TooLarge:
            batch.maybe_stored = att.maybe_done
            raise
        return _enqueued_of(self.urls[0], batch, doc, att.maybe_done)

    def _post_any(self, att: _Attempts, body: bytes) -> Any:
        while True:
            for t in self._transports:
                try:
                    status, doc = t.post(att.path, body, self.timeout_s)
                except (OSError, http.client.HTTPException) as e:
                    att.failed(t.url, e)
                    continue
                if status == 200:
                    return doc
                att.refused(t.url, status, doc)
            pause = att.pause()
            if pause is None:
                raise att.error()
            time.sleep(pause)

    def job(self, id: str) -> Optional[JobInfo]:
        """The live job ``id`` (``SHARD:ID``, as :meth:`enqueue` gives it);
        ``None`` when no live job has the id (it finished, was cancelled,
        moved away with its key, or never existed)."""
        status, doc = self._call("GET", f"/v1/jobs/{quote(id, safe=':')}", None, "reading a job")
        return None if status == 404 or "outcome" in doc else JobInfo._of(doc)

    def finished(self, id: str) -> Optional[FinishedInfo]:
        """Job ``id`` once it finished or was cancelled, while the
        deployment's retention keeps it; ``None`` for a live job, and for
        one the retention no longer keeps, that moved away, or never
        existed."""
        status, doc = self._call("GET", f"/v1/jobs/{quote(id, safe=':')}", None, "reading a job")
        return FinishedInfo._of(doc) if status != 404 and "outcome" in doc else None

    def result(self, id: str, timeout: float = 30.0) -> FinishedInfo:
        """Waits up to ``timeout`` seconds for job ``id`` to finish and
        returns it (``outcome`` and ``result``: what its handler returned,
        ``None`` for nothing or a cancelled job). The server answers as soon
        as the job is acked (long polls of ``GET /v1/jobs/{id}/result``, at
        most 30 s each), not by polling from here. Raises
        :class:`ResultTimeout` when it has not finished by then,
        :class:`JobDied` for a dead letter, and :class:`HttpError` (404) for
        an id with no job (finished longer ago than the retention keeps,
        moved away with its key, or never existed)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            wait_ms = int(max(0.0, min(deadline - time.monotonic(), 30.0)) * 1000)
            _, doc = self._call("GET", f"/v1/jobs/{quote(id, safe=':')}/result?wait_ms={wait_ms}", None,
                                "waiting for a job's result")
            done = _result_of(id, timeout, doc, time.monotonic() >= deadline)
            if done is not None:
                return done

    def moved(self, id: str) -> Optional[Moved]:
        """Where job ``id`` went when it left its shard with its key in a
        rebalance: its copy has a new id on the key's new shard, where
        :meth:`key_jobs` lists it and :meth:`job` and :meth:`result` of the
        old id find it (while the shards remember the move); ``None`` for a
        job that did not move, finished, was cancelled, or never existed."""
        status, doc = self._call("GET", f"/v1/jobs/{quote(id, safe=':')}", None, "reading a job")
        return Moved._of(doc) if status in (200, 404) else None

    def key_jobs(self, key: str, limit: int = 100) -> List[JobInfo]:
        """``key``'s live jobs in key order (its run in flight, queued,
        delayed and dead jobs), at most ``limit`` (1 to 1000)."""
        if not 1 <= limit <= 1000:
            raise ConfigError(f"invalid limit {limit!r}: 1 to 1000")
        _, doc = self._call("GET", f"/v1/keys/{quote(key, safe='')}/jobs?limit={limit}", None,
                            "listing a key's jobs")
        return [JobInfo._of(j) for j in doc["jobs"]]

    def key_finished(self, key: str, limit: int = 20) -> List[FinishedInfo]:
        """``key``'s newest finished jobs (acked or cancelled), newest
        first, at most ``limit`` (1 to 1000), as far as the deployment's
        retention keeps them."""
        if not 1 <= limit <= 1000:
            raise ConfigError(f"invalid limit {limit!r}: 1 to 1000")
        _, doc = self._call("GET", f"/v1/keys/{quote(key, safe='')}/jobs?limit=1&finished={limit}", None,
                            "listing a key's finished jobs")
        return [FinishedInfo._of(j) for j in doc["finished"]]

    def cancel(self, id: str) -> bool:
        """Cancels the job ``id``: a queued, delayed or dead one is deleted
        and never runs; a running one's run is asked to stop (its results
        are refused) and the job goes when the run ends, never retried.
        ``True`` when this call cancelled it, ``False`` when no live job had
        the id (it finished, or an earlier try of this call on another URL
        cancelled it). A job whose key is moving raises
        :class:`JobNotCancelled` (``state`` says why).

        A dependent (``"@N"``) that waits is cancelled (it never runs; its
        own dependents see it as ``failed``); once released, its job is.
        ``False`` when it had ended: its job finished, or it failed or was
        cancelled while it waited."""
        try:
            status, _ = self._call("DELETE", f"/v1/jobs/{quote(id, safe=':')}", {}, "cancelling a job")
        except JobNotCancelled as e:
            if _is_dependent_id(id) and e.state in _DEPENDENT_ENDED:
                return False
            raise
        return status != 404

    # --- flow control ---------------------------------------------------

    def policies(self) -> FlowSettings:
        """Every flow-control setting of the deployment: the default policy,
        the policies by prefix and by key, and the groups (role ``read``)."""
        return FlowSettings._of(self._flow("GET", "/v1/policies", None, "reading the policies"))

    def policy(self, key: Optional[str] = None, scope: str = "key") -> Optional[PolicyInfo]:
        """The policy ``key`` gets and where it comes from (its own, its
        longest prefix's or the default); with ``scope="prefix"`` the policy
        of the prefix ``key`` (``None`` when it has none), with
        ``scope="default"`` the default's (``key`` is not needed)."""
        doc = self._flow("GET", _policy_shown(key, scope), None, "reading a policy", missing_ok=True)
        return None if doc is None else PolicyInfo._of(doc)

    def set_policy(self, key: Optional[str] = None, *, prefix: Optional[str] = None, default: bool = False,
                   rate: Optional[str] = None, burst: Optional[int] = None, weight: Optional[int] = None,
                   priority: Optional[int] = None, group: Optional[str] = None,
                   concurrency: Optional[int] = None) -> FlowPolicy:
        """Sets the whole policy of exactly one of ``key``, ``prefix`` (every
        key starting with it) or the ``default`` (role ``admin``): the
        fields given, the others at their defaults (no rate, no group,
        weight 1, priority 0). ``rate`` is ``"N/s"``, ``"N/m"`` or ``"N/h"``;
        a ``group`` must exist (:meth:`set_group`). Returns the policy
        stored; a bad value raises :class:`BadRequest` naming it. Every
        server and worker uses it within a second."""
        path = _policy_target(key, prefix, default)
        body = _policy_body(rate=rate, burst=burst, weight=weight, priority=priority, group=group,
                            concurrency=concurrency)
        return FlowPolicy._of(self._flow("PUT", path, body, "setting a policy")["policy"])

    def clear_policy(self, key: Optional[str] = None, *, prefix: Optional[str] = None, default: bool = False) -> bool:
        """Removes the policy of ``key`` or ``prefix`` (the default goes
        back to no limits) (role ``admin``); whether there was one."""
        doc = self._flow("DELETE", _policy_target(key, prefix, default), {}, "removing a policy")
        return bool(doc["removed"])

    def groups(self) -> Dict[str, GroupInfo]:
        """Every flow-control group, by name (role ``read``)."""
        return _groups_of(self._flow("GET", "/v1/groups", None, "reading the groups"))

    def group(self, name: str) -> Optional[GroupInfo]:
        """The group ``name``, or ``None`` when there is none."""
        doc = self._flow("GET", f"/v1/groups/{_segment(name, 'group name')}", None, "reading a group",
                         missing_ok=True)
        return None if doc is None else GroupInfo._of(doc)

    def set_group(self, name: str, rate: Optional[str] = None, burst: Optional[int] = None,
                  concurrency: Optional[int] = None) -> GroupInfo:
        """Sets the group ``name`` (role ``admin``), replacing what it had:
        ``rate`` starts (``"20/s"``) shared by every key whose policy names
        it, over every worker, with ``burst`` tokens (default: one second of
        the rate); ``concurrency`` runs of its keys at once. At least one of
        ``rate`` and ``concurrency``. Returns the group stored."""
        doc = self._flow("PUT", f"/v1/groups/{_segment(name, 'group name')}",
                         _group_body(rate, burst, concurrency), "setting a group")
        return GroupInfo._of(doc["group"])

    def clear_group(self, name: str) -> bool:
        """Removes the group ``name`` (role ``admin``); whether there was
        one. A group a policy still names raises :class:`BadRequest`."""
        doc = self._flow("DELETE", f"/v1/groups/{_segment(name, 'group name')}", {}, "removing a group")
        return bool(doc["removed"])

    def resume_group(self, name: str) -> bool:
        """Lifts the hold a handler's group back-off (``BackOff(ms,
        group=True)``) put on the group ``name`` (role ``admin``): every
        worker and server starts the group's keys again within a second.
        The key whose handler backed off keeps its own wait
        (:meth:`resume_key` lifts that). Returns ``True``, as the server
        answers whether a hold was there or not (lifting none changes
        nothing). A bad name (``"none"``, over 128 bytes) raises
        :class:`BadRequest`, an empty one :class:`ConfigError` before any
        request."""
        doc = self._flow("POST", _group_resume_path(name), {}, "resuming a group")
        return bool(doc["resumed"])

    def resume_key(self, key: str) -> Optional[KeyHold]:
        """Lifts the back-off a handler (``BackOff(ms)``) put on ``key``
        (role ``admin``), whichever process runs the key's shard: the jobs
        it held are due now, keep their place and their attempt counts, and
        the key starts at its shard owner's next claim. Returns the hold it
        lifted (:class:`KeyHold`: ``until_ms``, the held ``jobs``), or
        ``None`` when no back-off held the key (its wait was over, it was
        resumed already, by an earlier try of this call on another URL
        too, or it never backed off), and nothing changed. Only a
        back-off is lifted: a producer's delay, a retry's wait and the
        hold of the key's group (:meth:`resume_group`) stay. A key moving
        to another shard raises :class:`KeyNotResumed` (``state``
        ``"moving"``); a bad key (over 1024 bytes, say)
        :class:`BadRequest`, an empty one :class:`ConfigError` before any
        request."""
        return KeyHold._of(self._flow("POST", _key_resume_path(key), {}, "resuming a key"))

    # --- recurring schedules --------------------------------------------

    def schedules(self) -> List[ScheduleInfo]:
        """Every recurring schedule of the deployment, by id, with its state
        and next fire (role ``read``)."""
        return _schedules_of(self._flow("GET", "/v1/schedules", None, "reading the schedules"))

    def schedule(self, id: str) -> ScheduleInfo:
        """The schedule ``id`` with its state (``state.fired``,
        ``state.last``, ...) and next fire (role ``read``). An unknown id
        raises :class:`HttpError` with ``status`` 404."""
        return ScheduleInfo._of(self._flow("GET", _schedule_path(id), None, "reading a schedule"))

    def set_schedule(self, id: str, key: str, *, cron: Optional[str] = None, tz: Optional[str] = None,
                     every: Optional[str] = None, payload: Optional[Payload] = None, overlap: Optional[str] = None,
                     catch_up: Optional[str] = None, jitter: Optional[str] = None, start: Optional[ScheduleTime] = None,
                     end: Optional[ScheduleTime] = None, max_attempts: Optional[int] = None) -> Schedule:
        """Creates the schedule ``id`` (1 to 128 ASCII letters, digits and
        ``-_.:``), or replaces it whole (role ``admin``): every tick
        enqueues one job of ``key`` with ``payload`` (text; bytes must be
        UTF-8). It ticks on exactly one of ``cron`` (5 fields, or 6 with
        seconds first, in the IANA zone ``tz``, default UTC) and ``every``
        (an interval such as ``"30s"`` or ``"5m"``, at least 1 s, anchored
        at ``start``, else the epoch). ``overlap``: ``"skip"`` (default:
        no tick while the previous tick's job is live), ``"one"`` or
        ``"all"``; ``catch_up`` (default ``"5m"``) how late a tick may
        still fire; ``jitter`` (default none) the largest delay added to a
        fire; ``start`` and ``end`` (ms since the epoch, RFC 3339 text or
        an aware ``datetime``) bound its ticks; ``max_attempts`` (default
        5) each job's attempts. A schedule replaced keeps its state and
        whether it is paused. Returns the :class:`Schedule` stored; a bad
        value raises :class:`BadRequest` naming the field and the value
        (``invalid cron "0 25 * * *": ...``), giving both or neither of
        ``cron`` and ``every`` :class:`ConfigError` before any request.
        Every server and worker fires it within a second, the ones that
        run its key's shard."""
        body = _schedule_body(key, cron, tz, every, payload, overlap, catch_up, jitter, start, end, max_attempts)
        return Schedule._of(self._flow("PUT", _schedule_path(id), body, "setting a schedule")["schedule"])

    def apply_schedules(self, schedules: Mapping[str, Mapping[str, Any]], *, prune: bool = False,
                        dry_run: bool = False) -> "SchedulesApplied":
        """Sets many schedules in one change (role ``admin``):
        ``schedules`` maps each id to the keyword arguments of
        :meth:`set_schedule` (``{"nightly": {"key": "t-1", "cron": "0 2 * *
        *"}}``). A schedule already there keeps its state and its pause.
        ``prune`` also deletes every schedule not named; ``dry_run`` stores
        nothing and answers what would change. All of it is stored or
        nothing: a bad schedule raises :class:`BadRequest` naming it."""
        body = _apply_body(schedules, prune, dry_run)
        return SchedulesApplied._of(self._flow("PUT", "/v1/schedules", body, "applying schedules"))

    def delete_schedule(self, id: str) -> bool:
        """Deletes the schedule ``id`` (role ``admin``); whether there was
        one. The jobs it enqueued stay."""
        return bool(self._flow("DELETE", _schedule_path(id), {}, "deleting a schedule")["deleted"])

    def pause_schedule(self, id: str) -> Schedule:
        """Pauses the schedule ``id`` (role ``admin``): no tick fires until
        :meth:`resume_schedule`. Returns the schedule stored; an unknown id
        raises :class:`HttpError` with ``status`` 404."""
        return Schedule._of(self._flow("POST", _schedule_path(id, "pause"), {}, "pausing a schedule")["schedule"])

    def resume_schedule(self, id: str) -> Schedule:
        """Resumes the schedule ``id`` (role ``admin``); the ticks of its
        pause never fire. Returns the schedule stored; an unknown id raises
        :class:`HttpError` with ``status`` 404."""
        return Schedule._of(self._flow("POST", _schedule_path(id, "resume"), {}, "resuming a schedule")["schedule"])

    def trigger_schedule(self, id: str) -> ScheduleTriggered:
        """Enqueues one job of the schedule ``id`` now, outside its ticks
        and its overlap policy (role ``admin``). Returns where it went
        (:class:`ScheduleTriggered`: ``shard``, ``job``); an unknown id
        raises :class:`HttpError` with ``status`` 404. Each call is a job
        of its own: a call retried on another URL after an answer was lost
        may have enqueued one there too."""
        return ScheduleTriggered._of(self._flow("POST", _schedule_path(id, "trigger"), {}, "triggering a schedule"))

    def backfill_schedule(self, id: str, start: ScheduleTime, end: ScheduleTime) -> ScheduleBackfilled:
        """Enqueues the job of every tick of the schedule ``id`` from
        ``start`` to ``end`` (both included; ms since the epoch, RFC 3339
        text or an aware ``datetime``), in order, at most 10,000 ticks
        (role ``admin``). A tick whose job is stored already (fired or
        backfilled within the schedule's dedup window: its catch-up, its
        jitter and 10 minutes) is not stored again, so a backfill may be
        repeated at once. Returns the counts (:class:`ScheduleBackfilled`); an
        unknown id raises :class:`HttpError` with ``status`` 404, a bad
        range :class:`BadRequest`."""
        return ScheduleBackfilled._of(self._flow("POST", _schedule_path(id, "backfill"), _backfill_body(start, end),
                                                 "backfilling a schedule"))

    def _flow(self, method: str, path: str, body: Optional[Mapping[str, Any]], what: str,
              missing_ok: bool = False) -> Any:
        """The answer of one flow-control or schedule request; a 404 is
        ``None`` when ``missing_ok`` (no such prefix policy or group), else
        an :class:`HttpError` (no such schedule, or a server without these
        routes)."""
        status, doc, url = self._call_at(method, path, body, what)
        if status == 404:
            if missing_ok:
                return None
            raise HttpError(url, status, _error_of(doc))
        return doc

    def _call(self, method: str, path: str, body: Optional[Mapping[str, Any]], what: str) -> Tuple[int, Any]:
        """One request to the first URL that answers (200 or 404); an
        answer that no retry changes raises at once."""
        status, doc, _ = self._call_at(method, path, body, what)
        return status, doc

    def _call_at(self, method: str, path: str, body: Optional[Mapping[str, Any]], what: str) -> Tuple[int, Any, str]:
        """:meth:`_call`, with the URL of the request that was answered."""
        causes: List[str] = []
        last: Optional[BaseException] = None
        for t in self._transports:
            try:
                status, doc = t.request(method, path, body, self.timeout_s)
            except (OSError, http.client.HTTPException) as e:
                causes.append(f"{t.url}: {e}")
                last = e
                continue
            if _is_answer(t.url, method, status, doc, causes, path):
                return status, doc, t.url + path
        raise ServerUnavailable(what, causes, last)

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
    #: When the server fails the run if it has not ended (its job timeout:
    #: the worker's ``timeout_ms`` or the server's default), in ms since the
    #: epoch on the server's clock; ``None`` without one.
    timeout_expires_ms: Optional[int] = None
    #: The dedup id the job was enqueued with (``None``: none): a handler's
    #: own idempotency key.
    dedup_id: Optional[str] = None
    #: A schedule's job: its schedule and tick (:class:`ScheduleTick`).
    schedule: Optional[ScheduleTick] = None
    #: A released dependent's job: the dependent's id (``"@N"``);
    #: :meth:`Client.dependent` of it gives its dependencies' outcomes and
    #: results.
    dependent: Optional[str] = None
    #: A job of a batch, or a batch's callback: the batch's id (``"@N"``);
    #: :meth:`Client.batch` of it shows the batch. A job of a batch may add
    #: more jobs to it (``enqueue(..., batch=job.batch)``) while it runs.
    batch: Optional[str] = None
    #: A batch's callback: its kind (``"complete"``, ``"success"`` or
    #: ``"death"``); ``None`` for any other job.
    batch_callback: Optional[str] = None
    _lost: Optional[threading.Event] = field(default=None, repr=False, compare=False)
    #: The run's job timeout in ms, and when it passes as this process
    #: knows it (``time.monotonic()``); ``None`` without one.
    _timeout_ms: Optional[int] = field(default=None, repr=False, compare=False)
    _timeout_until: Optional[float] = field(default=None, repr=False, compare=False)
    #: Whether the worker saw the run pass its job timeout.
    _timed_out: bool = field(default=False, repr=False, compare=False)
    #: When the lease ends as this process knows it (``time.monotonic()``:
    #: the claim's answer, or the last extend's send, plus the lease). A
    #: prefetched job not started by then is not run.
    _lease_until: float = field(default=float("inf"), repr=False, compare=False)
    #: Whether the job holds its server's own slot of the worker (see _SlotBook).
    _own_slot: bool = field(default=False, repr=False, compare=False)
    #: Whether its slot went back to the worker's book.
    _released: bool = field(default=False, repr=False, compare=False)
    #: The handler's result in its ``/v1/ack`` form (see ``_result_field``).
    _result: Optional[Dict[str, str]] = field(default=None, repr=False, compare=False)
    #: Whether the server said the run is over (an extend refused it, or
    #: ``/v1/stale`` named it): once its handler returned, a fail of the
    #: receipt is sent instead of its result (refused with 409, it ends a
    #: cancelled run and frees the key).
    _stale: bool = field(default=False, repr=False, compare=False)

    @property
    def lost(self) -> threading.Event:
        """Set when this run is over for this worker and its result will not
        be taken: the server no longer counts it (a cancel through the API,
        found within about a second, :data:`STALE_CHECK_S`; or an extend was
        refused: the lease lapsed, the job runs again), the run
        passed its job timeout (``timeout_ms``: the server failed it), or the
        worker stopped without draining (a second signal, ``stop(drain=False)``
        or the drain timeout). A long handler checks ``job.lost.is_set()``
        (or waits on it) and returns early. Made on first use: most jobs
        never need one."""
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


#: Longest back-off a handler may ask for, in ms (one day: the server's
#: ``BACKOFF_MS_MAX``).
BACKOFF_MS_MAX = 86_400_000


class BackOff(Exception):
    """Raise from a handler when its downstream limits it (a 429, a quota):
    the run ends without using an attempt, the job goes back to the head of
    its key, and the key starts nothing for ``ms`` milliseconds (0 to one
    day) while other keys run on. With ``group=True`` every key of the
    key's flow-control group waits too, in every process (a key without a
    group holds only itself). A bad ``ms`` raises :class:`ConfigError`."""

    def __init__(self, ms: int, group: bool = False):
        if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= BACKOFF_MS_MAX:
            raise ConfigError(f"invalid back-off ms {ms!r}: a whole number of ms from 0 to {BACKOFF_MS_MAX} (one day)")
        super().__init__(f"back off {ms} ms" + (" (the key's whole group)" if group else ""))
        self.ms = ms
        self.group = bool(group)


@dataclass
class WorkerStats:
    claimed: int = 0
    acked: int = 0
    failed: int = 0
    #: Results the server refused (409): the run had been lost.
    lost: int = 0
    #: Results given up on after transport errors (the lease decides).
    unreported: int = 0
    #: Claimed jobs left unfinished by a stop without draining (their
    #: leases lapse and they run again).
    abandoned: int = 0
    #: Answered ``/v1/claim`` requests (claimed / this = jobs per claim).
    claim_requests: int = 0
    #: Answered ``/v1/ack`` requests (acked / this = receipts per ack).
    ack_requests: int = 0
    #: Runs ended by a handler's :class:`BackOff` (the server confirmed
    #: them; no attempt was used).
    backed_off: int = 0
    #: Runs that passed their job timeout (``timeout_ms``, or the server's
    #: ``--job-timeout-ms``): the server failed them (an attempt used) and
    #: refused their late result (:class:`Worker`), or the handler was
    #: cancelled at it and nothing was sent (:class:`shardq.AsyncWorker`).
    #: Not counted in ``lost`` nor ``failed``.
    timed_out: int = 0


Handler = Callable[[ClaimedJob], object]


class _SlotBook:
    """The free slots of a worker (a slot: a job running, or claimed ahead
    and waiting), shared by the claim loops of its URLs so that none is
    starved. Each URL has one slot of its own, which only its claims use:
    every URL is polled whatever the others hold, however quiet. The rest
    are shared: a URL whose last claim found nothing polls with its own
    slot only (or one shared slot while a job of its own holds it), leaving
    the shared ones to the URLs that have work. With fewer slots than URLs
    each still has its own, so a worker may hold one job per URL beyond its
    slots. Holds no lock: its callers do."""

    def __init__(self, urls: Sequence[str], slots: int) -> None:
        self.own = {u: True for u in urls}
        self.shared = max(0, slots - len(urls))
        self.idle = {u: False for u in urls}

    def take(self, url: str, most: int) -> Tuple[int, bool]:
        """Reserves slots for a claim from ``url``: (how many, whether one
        is the URL's own); (0, False) when none is free."""
        own = self.own[url]
        cap = 1 if self.idle[url] else most
        extra = max(0, min(self.shared, cap - own))
        self.own[url] = False
        self.shared -= extra
        return extra + own, own

    def claimed(self, url: str, want: int, own: bool, jobs: Sequence["ClaimedJob"]) -> None:
        """Settles a claim that reserved ``want`` slots and got ``jobs``
        (none when it failed): unused slots come back, the first job holds
        the own slot when the claim had it."""
        self.idle[url] = not jobs
        unused = want - len(jobs)
        if own and jobs:
            jobs[0]._own_slot = True
        elif own:
            self.own[url] = True
            unused -= 1
        self.shared += unused

    def release(self, job: "ClaimedJob") -> None:
        if job._own_slot:
            self.own[job.url] = True
        else:
            self.shared += 1


def _is_async_callable(f: Any) -> bool:
    return inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(getattr(f, "__call__", None))


class _Stopped(Exception):
    """The worker stopped before a claim was sent."""


#: How long a claim's connect may take, in seconds (a stop cannot cut a
#: connect under way).
CONNECT_TIMEOUT_S = 10.0


class _SignalStops:
    """SIGTERM or SIGINT stops a worker: the first one draining (claimed
    jobs run and report), a second one without."""

    _signals = 0

    def stop(self, drain: bool = True) -> None:
        raise NotImplementedError

    def _on_signal(self, signum: int, frame: Any = None) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("shardq worker: signal %d: stopping (a second one stops without draining)", signum)
            self.stop()
        else:
            log.warning("shardq worker: signal %d again: stopping without draining", signum)
            self.stop(drain=False)


class Worker(_SignalStops):
    """Claims jobs from every URL with long polls, runs ``handler`` in a
    thread pool, extends the job leases of running and prefetched jobs every
    lease/3, and acks (or fails, when the handler raises) on the server that
    gave the job: :class:`Retry` picks the retry's wait, :class:`BackOff`
    ends the run without using an attempt and holds the key (or its group)
    for the time asked. Each failed attempt is logged (``shardq`` logger,
    WARNING, with its traceback) and its reason sent is the error and its
    traceback, at most :data:`FAIL_REASON_BYTES_MAX` bytes. :meth:`run`
    returns after :meth:`stop` or SIGTERM/SIGINT once every claimed job has
    run and its result has been sent; a second signal stops without waiting
    for the handlers."""

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
        self.timeout_s = _check_timeout(timeout_s)
        self._transports = {u: _Transport(u, token) for u in self.urls}
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._lock = threading.Lock()
        # The slot book shares the worker's lock: a job that ends gives its
        # slot back in the same hold that takes it off the running ones.
        self._slot_cond = threading.Condition(self._lock)
        # Claim loops waiting on _slot_cond: a release notifies only when
        # one waits (a notify costs more than the rest of a job's bookkeeping).
        self._slot_waiters = 0
        self._book = _SlotBook(self.urls, 1)
        # The claims in flight, by URL: a stop cuts them (re-entrant: a
        # second signal may arrive while the first one's handler holds it).
        self._poll_lock = threading.RLock()
        self._polls: Dict[str, http.client.HTTPConnection] = {}
        self._running: Dict[int, ClaimedJob] = {}
        self._acks: Dict[str, "queue.SimpleQueue[Optional[ClaimedJob]]"] = {}
        self._fatal: Optional[BaseException] = None
        self._signals = 0
        self.stats = WorkerStats()

    def stop(self, drain: bool = True) -> None:
        """Stops claiming; a claim in flight is cut at once (jobs it was
        being given stay leased to this worker until their lease passes).
        :meth:`run` returns once the claimed jobs have run and reported;
        with ``drain=False`` at once: the running handlers are abandoned
        (``job.lost`` is set, their results are not sent, their jobs run
        again after their leases)."""
        with self._poll_lock:
            self._stop.set()
            for c in self._polls.values():
                if c.sock is not None:
                    try:
                        c.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        if not drain and not self._abandon.is_set():
            self._abandon.set()
            for j in list(self._running.values()):
                j.lost.set()

    def run(
        self,
        handler: Handler,
        concurrency: int = 8,
        lease_ms: int = 30_000,
        wait_ms: int = CLAIM_WAIT_MS_DEFAULT,
        install_signal_handlers: bool = True,
        prefetch: Optional[int] = None,
        drain_timeout_s: Optional[float] = None,
        timeout_ms: Optional[int] = None,
    ) -> WorkerStats:
        """Runs ``handler`` (a plain ``def``; an ``async def`` one is
        refused: use :class:`shardq.AsyncWorker`) on ``concurrency``
        threads. ``prefetch`` (default: ``concurrency``) more jobs may be
        claimed ahead and wait here, so that a handler that finishes does
        not wait for a claim's round trip and claims carry several jobs;
        their leases are extended like those of running jobs.
        ``prefetch=0`` claims only for idle threads (for long jobs that
        another worker could start sooner). After a stop, the handlers get
        ``drain_timeout_s`` (default: no limit) to finish before they are
        abandoned as by ``stop(drain=False)``.

        ``timeout_ms`` (1 ms to 7 days; default: the server's ``serve
        --job-timeout-ms``, if any) is each run's job timeout, sent with
        every claim: past it the server fails the run itself (an attempt
        used: the job runs again, or dies on its last attempt), whatever the
        heartbeat's extends, and refuses its late result (counted in
        ``stats.timed_out`` and logged). A thread cannot be stopped: the
        handler runs on to its end, holding its thread, while the key's next
        run may already start elsewhere; ``job.lost`` is set at the timeout,
        so a handler that checks it can return early. A prefetched job whose
        timeout passes before a thread is free is not run. Raises the error
        that stopped it, if any: :class:`Unauthorized` for a refused token."""
        if _is_async_callable(handler):
            raise ConfigError(
                f"handler {getattr(handler, '__name__', handler)!r} is an async def function: the threaded "
                f"Worker would never await it; run it with shardq.AsyncWorker (asyncio) or pass a plain def"
            )
        if concurrency < 1:
            raise ConfigError(f"invalid concurrency {concurrency}: at least 1")
        if prefetch is None:
            prefetch = concurrency
        if prefetch < 0:
            raise ConfigError(f"invalid prefetch {prefetch}: at least 0")
        if lease_ms < 100:
            raise ConfigError(f"invalid lease_ms {lease_ms}: at least 100")
        if drain_timeout_s is not None and drain_timeout_s < 0:
            raise ConfigError(f"invalid drain_timeout_s {drain_timeout_s}: at least 0")
        timeout_ms = _check_job_timeout(timeout_ms)
        self._stop.clear()
        self._abandon.clear()
        self._fatal = None
        self._signals = 0
        restore = self._install_signals() if install_signal_handlers else {}
        slots = concurrency + prefetch
        self._book = _SlotBook(self.urls, slots)
        work: "queue.SimpleQueue[Optional[ClaimedJob]]" = queue.SimpleQueue()
        runners = [
            threading.Thread(target=self._runner, args=(handler, work), name=f"shardq-job-{i}", daemon=True)
            for i in range(concurrency)
        ]
        for r in runners:
            r.start()
        beat_stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(lease_ms, beat_stop, timeout_ms), name="shardq-extend",
                                daemon=True)
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
        most = max(1, min(slots, CLAIM_MAX))
        claimers = [
            threading.Thread(
                target=self._claim_loop, args=(url, most, work, lease_ms, wait_ms, timeout_ms),
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
            self.stop()
            for c in claimers:
                c.join()
            # Drain: every claimed job runs to its end and reports (the
            # stop markers queue up behind the claimed jobs), unless the
            # run is abandoned (a second signal, the drain timeout).
            for _ in runners:
                work.put(None)
            deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
            while any(r.is_alive() for r in runners) and not self._abandon.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    log.warning("shardq worker: drain timeout (%.1f s): abandoning the running handlers",
                                drain_timeout_s)
                    self.stop(drain=False)
                    break
                self._abandon.wait(0.05)
            flush_until = time.monotonic() + ABANDON_ACK_FLUSH_S
            for u in self.urls:
                self._acks[u].put(None)
            for a in ackers:
                a.join(max(0.0, flush_until - time.monotonic()) if self._abandon.is_set() else None)
            beat_stop.set()
            beat.join()
            if self._abandon.is_set():
                with self._lock:
                    self.stats.abandoned += len(self._running)
            for sig, old in restore.items():
                signal.signal(sig, old)
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    def _install_signals(self) -> Dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            log.warning("shardq worker: not on the main thread, SIGTERM is not handled (call stop())")
            return {}
        old: Dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    def _fail_run(self, e: BaseException) -> None:
        """Stops the worker for an error that every further claim would
        meet; :meth:`run` raises it."""
        if self._fatal is None:
            self._fatal = e
        self.stop()

    def _take_slots(self, url: str, most: int) -> Optional[Tuple[int, bool]]:
        with self._slot_cond:
            while not self._stop.is_set():
                want, own = self._book.take(url, most)
                if want:
                    return want, own
                self._slot_waiters += 1
                try:
                    self._slot_cond.wait(0.2)
                finally:
                    self._slot_waiters -= 1
        return None

    def _settle(self, url: str, want: int, own: bool, jobs: Sequence[ClaimedJob]) -> None:
        with self._slot_cond:
            self._book.claimed(url, want, own, jobs)
            if self._slot_waiters:
                self._slot_cond.notify_all()

    def _release(self, job: ClaimedJob) -> None:
        if not job._released:
            with self._lock:
                self._free_slot(job)

    def _free_slot(self, job: ClaimedJob) -> None:
        """Gives ``job``'s slot back (once); the caller holds ``_lock``."""
        if job._released:
            return
        job._released = True
        self._book.release(job)
        if self._slot_waiters:
            self._slot_cond.notify_all()

    def _poll(self, t: _Transport, body: Mapping[str, Any], timeout: float) -> Tuple[int, Any]:
        """Sends a claim on a connection that :meth:`stop` can cut."""
        for again in (False, True):
            c = t.conn(timeout)
            reused = c.sock is not None
            if not reused:
                c.timeout = CONNECT_TIMEOUT_S
                c.connect()
                c.timeout = timeout
                c.sock.settimeout(timeout)
            with self._poll_lock:
                if self._stop.is_set():
                    raise _Stopped()
                self._polls[t.url] = c
            try:
                return t.post("/v1/claim", body, timeout, resend_stale=False)
            except _STALE_ERRORS:
                # Not the stop's cut: a kept-alive connection the server
                # closed while idle; once more on a new one.
                if again or not reused or self._stop.is_set():
                    raise
            finally:
                with self._poll_lock:
                    self._polls.pop(t.url, None)
        raise AssertionError("unreachable")

    def _claim_loop(self, url: str, most: int, work: "queue.SimpleQueue[Optional[ClaimedJob]]",
                    lease_ms: int, wait_ms: int, timeout_ms: Optional[int]) -> None:
        t = self._transports[url]
        failures = 0
        body: Dict[str, Any] = {"worker": self.worker_id, "max": 1, "wait_ms": wait_ms, "lease_ms": lease_ms}
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        while True:
            # Reserve the free slots (at least one) and ask for that many.
            got = self._take_slots(url, most)
            if got is None:
                return
            want, own = got
            jobs: List[ClaimedJob] = []
            try:
                body["max"] = want
                status, doc = self._poll(t, body, self.timeout_s)
                if status != 200:
                    _raise_for(url, status, doc)
                jobs = _claimed_of(url, doc)
                # The server started the leases (and job timeouts) just
                # before it answered (a long poll may answer late in its
                # wait, so not at the send).
                _set_deadlines(jobs, lease_ms, timeout_ms, time.monotonic())
                failures = 0
            except _Stopped:
                self._settle(url, want, own, [])
                return
            except (OSError, http.client.HTTPException, HttpError, ValueError, KeyError) as e:
                self._settle(url, want, own, [])
                if isinstance(e, HttpError) and _refuses_worker(e):
                    log.error("shardq worker: %s refused the claim, stopping: %s", url, e)
                    self._fail_run(e)
                    return
                if self._stop.is_set():  # the stop cut the poll
                    return
                failures += 1
                log.warning("shardq worker: claim from %s failed (%s): %s", url, type(e).__name__, e)
                self._stop.wait(_backoff_ms(min(failures, 6)) / 1000)
                continue
            with self._lock:
                self.stats.claimed += len(jobs)
                self.stats.claim_requests += 1
                for j in jobs:
                    self._running[id(j)] = j
            self._settle(url, want, own, jobs)
            for j in jobs:
                work.put(j)

    def _runner(self, handler: Handler, work: "queue.SimpleQueue[Optional[ClaimedJob]]") -> None:
        while True:
            job = work.get()
            if job is None:
                return
            try:
                if self._abandon.is_set() or self._expired_while_waiting(job):
                    continue
                self._run_one(handler, job)
            except BaseException as e:  # SystemExit and the like, raised by a handler
                with self._lock:
                    self._running.pop(id(job), None)
                log.error("shardq worker: job %s (key %r): the handler raised %s; its lease decides",
                          job.id, job.key, type(e).__name__)
            finally:
                self._release(job)

    def _expired_while_waiting(self, job: ClaimedJob) -> bool:
        """A prefetched job whose run was lost (an extend was refused) or
        whose lease has passed while it waited for a thread is not run: the
        server gives it out again, and running it now could overlap the
        next run of its key."""
        lost = job._lost is not None and job._lost.is_set()
        now = time.monotonic()
        timed_out = job._timed_out or _past_timeout(job, now)
        if not lost and not timed_out and now < job._lease_until:
            return False
        if job._stale:
            # The server said the run is over (a cancel, say): its fail ends
            # a cancelled run now (refused, counted in ``lost``).
            with self._lock:
                self._running.pop(id(job), None)
            log.warning("shardq worker: job %s (key %r, shard %s) at %s: its run was over before a thread was free; "
                        "not run", job.id, job.key, job.shard, job.url)
            self._report(job, *_stale_outcome(job))
            return True
        with self._lock:
            self._running.pop(id(job), None)
            if timed_out:
                self.stats.timed_out += 1
            else:
                self.stats.lost += 1
        if timed_out:
            log.warning("shardq worker: job %s (key %r, shard %s) at %s: its job timeout of %s ms passed before a "
                        "thread was free; not run (the server failed the run)", job.id, job.key, job.shard, job.url,
                        job._timeout_ms)
        else:
            log.warning("shardq worker: job %s (key %r, shard %s) at %s: %s before a thread was free; not run "
                        "(the server runs it again)", job.id, job.key, job.shard, job.url,
                        "its run was lost" if lost else "its lease passed")
        return True

    def _run_one(self, handler: Handler, job: ClaimedJob) -> None:
        error: Optional[Exception] = None
        try:
            result: Any = handler(job)
            if result is not None and inspect.isawaitable(result):
                # An async handler in disguise (a lambda, a partial): it did
                # not run. Never acked; the worker stops.
                close = getattr(result, "close", None)
                if close is not None:
                    close()
                error = ConfigError(f"the handler returned an awaitable ({type(result).__name__}) without running "
                                    f"it: async handlers run with shardq.AsyncWorker")
                self._fail_run(error)
            else:
                job._result = _result_field(result)
        except Exception as e:  # the attempt fails; the server retries it
            error = e
        if self._abandon.is_set():
            return  # abandoned: the run stays counted in _running; its lease decides
        outcome = None if job._stale else _outcome_of(job, error)
        with self._lock:
            self._running.pop(id(job), None)
            # Looked at in the hold that ends the run here: a stale check
            # marks only the runs still in ``_running``.
            if job._stale:
                outcome = _stale_outcome(job)
            if outcome is None:
                self._free_slot(job)
        if outcome is None:
            self._acks[job.url].put(job)
        else:
            # Its slot goes once the failure is reported (the runner's
            # release), so claims never run past the prefetch bound.
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
                    elif "backoff_ms" in body:
                        self.stats.backed_off += 1
                    else:
                        self.stats.failed += 1
                return
            if status == 409 and job._stale:
                # Expected: the fail of a run the server said is over ends a
                # cancelled one, freeing its key.
                log.info("shardq worker: job %s (key %r) at %s: the fail of its run, found over, was refused as "
                         "expected (%s)", job.id, job.key, job.url, _error_of(doc))
                with self._lock:
                    self.stats.lost += 1
                return
            if status == 409:
                # Not retried: another run of the job is current (or was),
                # or the run passed its job timeout and the server failed it.
                timed_out = _refused(job, path, doc)
                with self._lock:
                    if timed_out:
                        self.stats.timed_out += 1
                    else:
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
        body = _ack_body(jobs)
        for attempt in range(RESULT_ATTEMPTS):
            try:
                status, doc = t.post("/v1/ack", body, self.timeout_s)
            except (OSError, http.client.HTTPException) as e:
                log.warning("shardq worker: ack of %d jobs to %s failed: %s", len(jobs), url, e)
                time.sleep(_backoff_ms(attempt) / 1000)
                continue
            refused = _settle_acks(url, jobs, status, doc)
            if refused is not None:
                lost, timed_out = refused
                with self._lock:
                    self.stats.lost += lost
                    self.stats.timed_out += timed_out
                    self.stats.acked += len(jobs) - lost - timed_out
                    self.stats.ack_requests += 1
                return
            if not _retryable(status):
                log.error("shardq worker: ack of %d jobs at %s refused with %s: %s", len(jobs), url, status, _error_of(doc))
                break
            time.sleep(_backoff_ms(attempt) / 1000)
        with self._lock:
            self.stats.unreported += len(jobs)
        log.error("shardq worker: gave up acking %d jobs at %s; their leases decide", len(jobs), url)

    def _heartbeat(self, lease_ms: int, stop: threading.Event, timeout_ms: Optional[int]) -> None:
        """Extends the leases of the running and prefetched jobs every
        lease/3 (not those past their job timeout: the server refuses
        them), and sets ``job.lost`` on the runs past it: looked for every
        tenth of ``timeout_ms`` (50 ms to lease/3), else at each extend.
        Between extends, while it holds runs, asks each server every
        :data:`STALE_CHECK_S` which are no longer current (``/v1/stale``)."""
        every = lease_ms / 3 / 1000
        tick = min(every, STALE_CHECK_S) if timeout_ms is None else min(every, STALE_CHECK_S,
                                                                         max(0.05, timeout_ms / 10_000))
        next_beat = time.monotonic() + every
        next_check = time.monotonic() + STALE_CHECK_S
        while not stop.wait(max(0.0, min(tick, next_beat - time.monotonic(), next_check - time.monotonic()))):
            now = time.monotonic()
            beat = now >= next_beat
            if beat:
                next_beat = now + every
            check = not beat and now >= next_check
            if beat or check:
                next_check = now + STALE_CHECK_S
            by_url: Dict[str, List[ClaimedJob]] = {}
            timed_out: List[ClaimedJob] = []
            with self._lock:
                for j in self._running.values():
                    if j._timed_out:
                        continue
                    if j._timeout_until is not None and now >= j._timeout_until:
                        j._timed_out = True
                        timed_out.append(j)
                    elif beat or (check and not j._stale):
                        by_url.setdefault(j.url, []).append(j)
            for j in timed_out:
                j.lost.set()
                log.warning("shardq worker: job %s (key %r, shard %s) at %s: the run passed its job timeout of %s ms: "
                            "the server fails it (job.lost is set; a thread running its handler runs on, and its "
                            "result will be refused)", j.id, j.key, j.shard, j.url, j._timeout_ms)
            for url, jobs in by_url.items():
                for i in range(0, len(jobs), ACK_BATCH_MAX):
                    if beat:
                        self._extend(url, jobs[i:i + ACK_BATCH_MAX], lease_ms)
                    else:
                        self._check_stale(url, jobs[i:i + ACK_BATCH_MAX])

    def _check_stale(self, url: str, jobs: List[ClaimedJob]) -> None:
        """Asks ``url`` which of ``jobs``' runs are no longer current and
        sets ``job.lost`` on those still running here (their fail is sent
        once their handlers returned)."""
        try:
            status, doc = self._transports[url].post("/v1/stale", {"receipts": [j.receipt for j in jobs]},
                                                     self.timeout_s)
        except (OSError, http.client.HTTPException) as e:
            log.warning("shardq worker: stale check at %s failed: %s", url, e)
            return
        named = _stale_named(url, status, doc)
        if named:
            with self._lock:
                _mark_lost(url, jobs, named, lambda j: id(j) in self._running, "a stale check named it")

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
        with self._lock:
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


def _settle_acks(url: str, jobs: List["ClaimedJob"], status: int, doc: Any) -> Optional[Tuple[int, int]]:
    """For an answered batched ack (200, or 409: the valid receipts were
    acked, the others' runs were over): logs the refused runs and returns
    how many were lost and how many had passed their job timeout; ``None``
    for any other status."""
    if status == 200:
        return 0, 0
    if status != 409:
        return None
    lost = timed_out = 0
    for j in _lost_of(jobs, doc):
        if _refused(j, "/v1/ack", doc):
            timed_out += 1
        else:
            lost += 1
    return lost, timed_out


def _refused(job: "ClaimedJob", path: str, doc: Any) -> bool:
    """Logs a result of ``job`` that the server refused (409); whether its
    run had passed its job timeout (the server failed it: counted in
    ``timed_out``), rather than been lost otherwise (``lost``)."""
    if _past_timeout(job):
        log.warning("shardq worker: job %s (key %r, shard %s) at %s: the run passed its job timeout of %s ms: "
                    "the server failed it and refused its result (%s: %s)",
                    job.id, job.key, job.shard, job.url, job._timeout_ms, path, _error_of(doc))
        return True
    log.warning("shardq worker: job %s (key %r, shard %s) at %s: the run was lost (%s refused: %s)",
                job.id, job.key, job.shard, job.url, path, _error_of(doc))
    return False


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


def _mark_lost(url: str, jobs: List["ClaimedJob"], stale: List[str], running: Callable[["ClaimedJob"], bool],
               what: str = "extend refused") -> None:
    """Sets ``lost`` on the still running jobs whose receipts an extend
    refused or ``/v1/stale`` named (a job that finished meanwhile was acked
    or failed with that receipt: its run is over, not lost), and marks them
    for the fail that ends a cancelled run once their handlers returned."""
    for j in jobs:
        if j.receipt in stale and running(j) and not j.lost.is_set():
            j._stale = True
            j.lost.set()
            log.warning("shardq worker: job %s (key %r) at %s: the run is over (%s: cancelled, or its lease "
                        "lapsed); job.lost is set", j.id, j.key, url, what)


def _stale_named(url: str, status: int, doc: Any) -> List[str]:
    """The receipts a ``/v1/stale`` answer names (none when it failed: the
    next check, or the next extend, asks again)."""
    if status != 200 or not isinstance(doc, dict) or not isinstance(doc.get("stale"), list):
        log.warning("shardq worker: stale check at %s answered %s: %s", url, status, _error_of(doc))
        return []
    return [str(x) for x in doc["stale"]]


def _stale_outcome(job: "ClaimedJob") -> Tuple[str, Dict[str, Any]]:
    """The fail sent for a run the server said is over, once its handler
    returned (whatever it returned or raised)."""
    return ("/v1/fail", {"receipt": job.receipt, "reason": STALE_FAIL_REASON})
