"""asyncio clients of ``shardq serve``: :class:`AsyncClient` enqueues,
:class:`AsyncWorker` claims, runs ``async def`` handlers as tasks on one
event loop, heartbeats and acks.

The same contract, dedup ids, retries, batch limits, batched acks, slot
sharing between URLs, stops and at-least-once semantics as
:mod:`shardq.http`, over `aiohttp`_ (``pip install "shardq[asyncio]"``). A
worker's concurrency is tasks, not threads: for handlers that mostly wait
(on other services), thousands of them cost no thread each. For short
handlers the threaded :class:`shardq.Worker` used less CPU per job in our
benchmarks (see BENCHMARKS.md).

A handler is ``async def handler(job: ClaimedJob) -> None``: returning acks
the job, raising :class:`shardq.Retry` fails it with that retry delay,
raising :class:`shardq.BackOff` ends the run without using an attempt and
holds its key (or its whole group) for the time asked, any other exception
fails the attempt (logged with its traceback, which the reason sent
carries, bounded as by :class:`shardq.Worker`). A stop without draining
cancels it (``asyncio.CancelledError`` in the handler; ``job.lost`` is set
too), and so does its run's job timeout (``run(..., timeout_ms=...)``, or
the server's default): the server fails the run at it. A blocking handler
stalls the loop (and no timeout can cancel it): run blocking work with
``asyncio.to_thread`` (or use :class:`shardq.Worker`).

.. _aiohttp: https://docs.aiohttp.org/
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import socket
import time
import uuid
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union
from urllib.parse import quote

from .errors import (
    ConfigError,
    HttpError,
    InvalidJob,
    JobNotCancelled,
    PartialEnqueue,
    ServerUnavailable,
    ShardqError,
    TooLarge,
)
from .http import (
    ABANDON_ACK_FLUSH_S,
    ACK_BATCH_MAX,
    CLAIM_MAX,
    CLAIM_WAIT_MS_DEFAULT,
    ENQUEUE_BATCH_BYTES_MAX,
    ENQUEUE_BATCH_MAX,
    REQUEST_TIMEOUT_S,
    RESULT_ATTEMPTS,
    RETRY_ROUNDS_DEFAULT,
    STALE_CHECK_S,
    BatchInfo,
    ClaimedJob,
    DependentInfo,
    Enqueued,
    FinishedInfo,
    FlowPolicy,
    FlowSettings,
    GroupInfo,
    JobInfo,
    JobLike,
    KeyHold,
    Moved,
    NewJob,
    Payload,
    PolicyInfo,
    Schedule,
    ScheduleBackfilled,
    ScheduleInfo,
    SchedulesApplied,
    ScheduleTime,
    ScheduleTriggered,
    WorkerStats,
    _DEPENDENT_ENDED,
    _Attempts,
    _Bodies,
    _ack_body,
    _apply_body,
    _backfill_body,
    _backoff_ms,
    _Batch,
    _batch_id_of,
    _batch_path,
    _batch_body,
    _batches,
    _check_batch_limits,
    _check_job_timeout,
    _result_field,
    _result_of,
    _check_timeout,
    _claimed_of,
    _dependent_path,
    _graph_request,
    _graph_too_large,
    _is_dependent_id,
    _dumps,
    _enqueued_of,
    _error_of,
    _extend_refused,
    _group_body,
    _group_resume_path,
    _groups_of,
    _halves,
    _is_answer,
    _key_resume_path,
    _job_bodies,
    _loads,
    _mark_lost,
    _stale_named,
    _stale_outcome,
    _normalise_urls,
    _open_batch_body,
    _outcome_of,
    _policy_body,
    _policy_shown,
    _policy_target,
    _raise_for,
    _refused,
    _refuses_worker,
    _retryable,
    _schedule_body,
    _schedule_path,
    _schedules_of,
    _segment,
    _set_deadlines,
    _settle_acks,
    _SignalStops,
    _SlotBook,
    _too_large,
)

try:
    import aiohttp
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shardq.aio needs aiohttp: pip install \"shardq[asyncio]\" (or pip install aiohttp)"
    ) from e

log = logging.getLogger("shardq")

AsyncHandler = Callable[[ClaimedJob], Awaitable[object]]

#: Transport failures: the request may or may not have been handled.
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class _Session:
    """One aiohttp session (a keep-alive connection pool) for all servers."""

    def __init__(self, token: Optional[str]) -> None:
        # Content-Type on every POST: the server refuses other bodies (415).
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._session: Optional[aiohttp.ClientSession] = None

    def _get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers)
        return self._session

    async def post(self, url: str, path: str, body: Union[Dict[str, Any], bytes], timeout: float) -> Tuple[int, Any]:
        """(status, decoded JSON body or None); raises the transport errors."""
        return await self.request("POST", url, path, body, timeout)

    async def request(self, method: str, url: str, path: str, body: Union[Dict[str, Any], bytes, None],
                      timeout: float) -> Tuple[int, Any]:
        """:meth:`post` for any method; ``body`` ``None`` sends none."""
        data = None if body is None else body if isinstance(body, bytes) else _dumps(body)
        async with self._get().request(method, url + path, data=data,
                                       timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            raw = await resp.read()
            status = resp.status
        try:
            doc = _loads(raw) if raw else None
        except ValueError:
            doc = raw.decode("utf-8", "replace")
        return status, doc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class AsyncClient:
    """Enqueues over HTTP from asyncio code; see :class:`shardq.Client` for
    the URLs, retries, timeouts, batch limits and dedup ids. Use ``async
    with`` or :meth:`close`."""

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
        self._http = _Session(token)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def enqueue(
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
        """Enqueues one job (the fields are :class:`shardq.NewJob`'s), as
        :meth:`shardq.Client.enqueue`."""
        job = NewJob(key, payload, delay_ms, max_attempts, dedup_id, unique_id, unique_while, debounce_id,
                     debounce_ms, debounce_max_ms, after, on_dependency_failure, batch)
        return (await self.enqueue_many([job]))[0]

    async def enqueue_many(self, jobs: Iterable[JobLike]) -> List[Enqueued]:
        """Enqueues ``jobs`` in order, as :meth:`shardq.Client.enqueue_many`
        (with ``after``: in one request, as :meth:`enqueue_graph`; with
        ``batch``: every job joining that one batch)."""
        bodies = _job_bodies(jobs)
        if bodies.graph:
            return await self._send_graph(bodies)
        out: List[Enqueued] = []
        for batch in _batches(bodies, self.batch_max, self.batch_bytes_max):
            try:
                out.extend(await self._send(batch))
            except ShardqError as e:
                if out:
                    raise PartialEnqueue(out, e) from e
                raise
        return out

    async def enqueue_graph(self, jobs: Sequence[JobLike]) -> List[Enqueued]:
        """:meth:`shardq.Client.enqueue_graph` from asyncio code: a graph of
        dependents (``after`` naming other jobs of ``jobs`` by index) in
        one atomic request, a cycle refused before anything is sent."""
        bodies = _job_bodies(jobs)
        if not bodies.graph:
            raise InvalidJob(f"enqueue_graph: none of the {len(bodies)} jobs has after; enqueue_many enqueues jobs "
                             f"without dependencies")
        return await self._send_graph(bodies)

    async def _send_graph(self, bodies: _Bodies) -> List[Enqueued]:
        batch = _graph_request(bodies, self.batch_max, self.batch_bytes_max)
        att = _Attempts("/v1/jobs", self.retry_rounds, once=True)
        body = _batch_body(batch)
        while True:
            for url in self.urls:
                try:
                    status, doc = await self._http.post(url, att.path, body, self.timeout_s)
                except _TRANSPORT_ERRORS as e:
                    att.failed(url, e)
                    continue
                if status == 200:
                    return _enqueued_of(self.urls[0], batch, doc, False)
                try:
                    att.refused(url, status, doc)
                except TooLarge as e:
                    raise _graph_too_large(batch, e) from e
            pause = att.pause()
            if pause is None:
                raise att.error()
            await asyncio.sleep(pause)

    async def dependent(self, id: str) -> Optional[DependentInfo]:
        """:meth:`shardq.Client.dependent` from asyncio code."""
        status, doc = await self._call("GET", _dependent_path(id), None, "reading a dependent")
        return None if status == 404 else DependentInfo._of(doc)

    async def open_batch(self, key: str, on_complete: Optional[Payload] = None, on_success: Optional[Payload] = None,
                         on_death: Optional[Payload] = None, max_attempts: Optional[int] = None,
                         dedup_id: Optional[str] = None) -> str:
        """:meth:`shardq.Client.open_batch` from asyncio code: the batch's id (``"@N"``)."""
        body = _open_batch_body(key, {"on_complete": on_complete, "on_success": on_success, "on_death": on_death},
                                max_attempts, dedup_id)
        doc = await self._post_retried(_Attempts("/v1/batches", self.retry_rounds, [body["dedup_id"]]), _dumps(body))
        return _batch_id_of(self.urls[0], doc)

    async def close_batch(self, id: str) -> bool:
        """:meth:`shardq.Client.close_batch` from asyncio code."""
        path = _batch_path(id, "close")
        doc = await self._post_retried(_Attempts(path, self.retry_rounds), b"{}")
        return bool(doc.get("closed")) if isinstance(doc, dict) else False

    async def batch(self, id: str) -> Optional[BatchInfo]:
        """:meth:`shardq.Client.batch` from asyncio code."""
        status, doc = await self._call("GET", _batch_path(id), None, "reading a batch")
        return None if status == 404 else BatchInfo._of(doc)

    async def _post_retried(self, att: _Attempts, body: bytes) -> Any:
        """A POST safe to send again (it carries a dedup id, or changes
        nothing twice), to the first URL that answers 200, in rounds."""
        while True:
            for url in self.urls:
                try:
                    status, doc = await self._http.post(url, att.path, body, self.timeout_s)
                except _TRANSPORT_ERRORS as e:
                    att.failed(url, e)
                    continue
                if status == 200:
                    return doc
                att.refused(url, status, doc)
            pause = att.pause()
            if pause is None:
                raise att.error()
            await asyncio.sleep(pause)

    async def _send(self, batch: _Batch) -> List[Enqueued]:
        try:
            return await self._post_jobs(batch)
        except TooLarge as e:  # a server with a lower body limit: halve
            if len(batch) == 1:
                raise _too_large(batch[0], e) from e
        first, second = _halves(batch)
        return await self._send(first) + await self._send(second)

    async def _post_jobs(self, batch: _Batch) -> List[Enqueued]:
        att = _Attempts("/v1/jobs", self.retry_rounds, [j.get("dedup_id", "") for j in batch], batch.maybe_stored)
        body = _batch_body(batch)
        while True:
            for url in self.urls:
                try:
                    status, doc = await self._http.post(url, att.path, body, self.timeout_s)
                except _TRANSPORT_ERRORS as e:
                    att.failed(url, e)
                    continue
                if status == 200:
                    return _enqueued_of(self.urls[0], batch, doc, att.maybe_done)
                try:
                    att.refused(url, status, doc)
                except TooLarge:
                    batch.maybe_stored = att.maybe_done
                    raise
            pause = att.pause()
            if pause is None:
                raise att.error()
            await asyncio.sleep(pause)

    async def job(self, id: str) -> Optional[JobInfo]:
        """:meth:`shardq.Client.job` from asyncio code."""
        status, doc = await self._call("GET", f"/v1/jobs/{quote(id, safe=':')}", None, "reading a job")
        return None if status == 404 or "outcome" in doc else JobInfo._of(doc)

    async def finished(self, id: str) -> Optional[FinishedInfo]:
        """:meth:`shardq.Client.finished` from asyncio code."""
        status, doc = await self._call("GET", f"/v1/jobs/{quote(id, safe=':')}", None, "reading a job")
        return FinishedInfo._of(doc) if status != 404 and "outcome" in doc else None

    async def result(self, id: str, timeout: float = 30.0) -> FinishedInfo:
        """:meth:`shardq.Client.result` from asyncio code."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            wait_ms = int(max(0.0, min(deadline - time.monotonic(), 30.0)) * 1000)
            _, doc = await self._call("GET", f"/v1/jobs/{quote(id, safe=':')}/result?wait_ms={wait_ms}", None,
                                      "waiting for a job's result")
            done = _result_of(id, timeout, doc, time.monotonic() >= deadline)
            if done is not None:
                return done

    async def moved(self, id: str) -> Optional[Moved]:
        """:meth:`shardq.Client.moved` from asyncio code."""
        status, doc = await self._call("GET", f"/v1/jobs/{quote(id, safe=':')}", None, "reading a job")
        return Moved._of(doc) if status in (200, 404) else None

    async def key_jobs(self, key: str, limit: int = 100) -> List[JobInfo]:
        """:meth:`shardq.Client.key_jobs` from asyncio code."""
        if not 1 <= limit <= 1000:
            raise ConfigError(f"invalid limit {limit!r}: 1 to 1000")
        _, doc = await self._call("GET", f"/v1/keys/{quote(key, safe='')}/jobs?limit={limit}", None,
                                  "listing a key's jobs")
        return [JobInfo._of(j) for j in doc["jobs"]]

    async def key_finished(self, key: str, limit: int = 20) -> List[FinishedInfo]:
        """:meth:`shardq.Client.key_finished` from asyncio code."""
        if not 1 <= limit <= 1000:
            raise ConfigError(f"invalid limit {limit!r}: 1 to 1000")
        _, doc = await self._call("GET", f"/v1/keys/{quote(key, safe='')}/jobs?limit=1&finished={limit}", None,
                                  "listing a key's finished jobs")
        return [FinishedInfo._of(j) for j in doc["finished"]]

    async def cancel(self, id: str) -> bool:
        """:meth:`shardq.Client.cancel` from asyncio code."""
        try:
            status, _ = await self._call("DELETE", f"/v1/jobs/{quote(id, safe=':')}", {}, "cancelling a job")
        except JobNotCancelled as e:
            if _is_dependent_id(id) and e.state in _DEPENDENT_ENDED:
                return False
            raise
        return status != 404

    # --- flow control ---------------------------------------------------

    async def policies(self) -> FlowSettings:
        """:meth:`shardq.Client.policies` from asyncio code."""
        return FlowSettings._of(await self._flow("GET", "/v1/policies", None, "reading the policies"))

    async def policy(self, key: Optional[str] = None, scope: str = "key") -> Optional[PolicyInfo]:
        """:meth:`shardq.Client.policy` from asyncio code."""
        doc = await self._flow("GET", _policy_shown(key, scope), None, "reading a policy", missing_ok=True)
        return None if doc is None else PolicyInfo._of(doc)

    async def set_policy(self, key: Optional[str] = None, *, prefix: Optional[str] = None, default: bool = False,
                         rate: Optional[str] = None, burst: Optional[int] = None, weight: Optional[int] = None,
                         priority: Optional[int] = None, group: Optional[str] = None,
                         concurrency: Optional[int] = None) -> FlowPolicy:
        """:meth:`shardq.Client.set_policy` from asyncio code."""
        path = _policy_target(key, prefix, default)
        body = _policy_body(rate=rate, burst=burst, weight=weight, priority=priority, group=group,
                            concurrency=concurrency)
        return FlowPolicy._of((await self._flow("PUT", path, body, "setting a policy"))["policy"])

    async def clear_policy(self, key: Optional[str] = None, *, prefix: Optional[str] = None,
                           default: bool = False) -> bool:
        """:meth:`shardq.Client.clear_policy` from asyncio code."""
        doc = await self._flow("DELETE", _policy_target(key, prefix, default), {}, "removing a policy")
        return bool(doc["removed"])

    async def groups(self) -> Dict[str, GroupInfo]:
        """:meth:`shardq.Client.groups` from asyncio code."""
        return _groups_of(await self._flow("GET", "/v1/groups", None, "reading the groups"))

    async def group(self, name: str) -> Optional[GroupInfo]:
        """:meth:`shardq.Client.group` from asyncio code."""
        doc = await self._flow("GET", f"/v1/groups/{_segment(name, 'group name')}", None, "reading a group",
                               missing_ok=True)
        return None if doc is None else GroupInfo._of(doc)

    async def set_group(self, name: str, rate: Optional[str] = None, burst: Optional[int] = None,
                        concurrency: Optional[int] = None) -> GroupInfo:
        """:meth:`shardq.Client.set_group` from asyncio code."""
        doc = await self._flow("PUT", f"/v1/groups/{_segment(name, 'group name')}",
                               _group_body(rate, burst, concurrency), "setting a group")
        return GroupInfo._of(doc["group"])

    async def clear_group(self, name: str) -> bool:
        """:meth:`shardq.Client.clear_group` from asyncio code."""
        doc = await self._flow("DELETE", f"/v1/groups/{_segment(name, 'group name')}", {}, "removing a group")
        return bool(doc["removed"])

    async def resume_group(self, name: str) -> bool:
        """:meth:`shardq.Client.resume_group` from asyncio code."""
        doc = await self._flow("POST", _group_resume_path(name), {}, "resuming a group")
        return bool(doc["resumed"])

    async def resume_key(self, key: str) -> Optional[KeyHold]:
        """:meth:`shardq.Client.resume_key` from asyncio code."""
        return KeyHold._of(await self._flow("POST", _key_resume_path(key), {}, "resuming a key"))

    # --- recurring schedules --------------------------------------------

    async def schedules(self) -> List[ScheduleInfo]:
        """:meth:`shardq.Client.schedules` from asyncio code."""
        return _schedules_of(await self._flow("GET", "/v1/schedules", None, "reading the schedules"))

    async def schedule(self, id: str) -> ScheduleInfo:
        """:meth:`shardq.Client.schedule` from asyncio code."""
        return ScheduleInfo._of(await self._flow("GET", _schedule_path(id), None, "reading a schedule"))

    async def set_schedule(self, id: str, key: str, *, cron: Optional[str] = None, tz: Optional[str] = None,
                           every: Optional[str] = None, payload: Optional[Payload] = None,
                           overlap: Optional[str] = None, catch_up: Optional[str] = None,
                           jitter: Optional[str] = None, start: Optional[ScheduleTime] = None,
                           end: Optional[ScheduleTime] = None, max_attempts: Optional[int] = None) -> Schedule:
        """:meth:`shardq.Client.set_schedule` from asyncio code."""
        body = _schedule_body(key, cron, tz, every, payload, overlap, catch_up, jitter, start, end, max_attempts)
        return Schedule._of((await self._flow("PUT", _schedule_path(id), body, "setting a schedule"))["schedule"])

    async def apply_schedules(self, schedules: Mapping[str, Mapping[str, Any]], *, prune: bool = False,
                              dry_run: bool = False) -> SchedulesApplied:
        """:meth:`shardq.Client.apply_schedules` from asyncio code."""
        body = _apply_body(schedules, prune, dry_run)
        return SchedulesApplied._of(await self._flow("PUT", "/v1/schedules", body, "applying schedules"))

    async def delete_schedule(self, id: str) -> bool:
        """:meth:`shardq.Client.delete_schedule` from asyncio code."""
        return bool((await self._flow("DELETE", _schedule_path(id), {}, "deleting a schedule"))["deleted"])

    async def pause_schedule(self, id: str) -> Schedule:
        """:meth:`shardq.Client.pause_schedule` from asyncio code."""
        doc = await self._flow("POST", _schedule_path(id, "pause"), {}, "pausing a schedule")
        return Schedule._of(doc["schedule"])

    async def resume_schedule(self, id: str) -> Schedule:
        """:meth:`shardq.Client.resume_schedule` from asyncio code."""
        doc = await self._flow("POST", _schedule_path(id, "resume"), {}, "resuming a schedule")
        return Schedule._of(doc["schedule"])

    async def trigger_schedule(self, id: str) -> ScheduleTriggered:
        """:meth:`shardq.Client.trigger_schedule` from asyncio code."""
        return ScheduleTriggered._of(await self._flow("POST", _schedule_path(id, "trigger"), {},
                                                      "triggering a schedule"))

    async def backfill_schedule(self, id: str, start: ScheduleTime, end: ScheduleTime) -> ScheduleBackfilled:
        """:meth:`shardq.Client.backfill_schedule` from asyncio code."""
        return ScheduleBackfilled._of(await self._flow("POST", _schedule_path(id, "backfill"),
                                                       _backfill_body(start, end), "backfilling a schedule"))

    async def _flow(self, method: str, path: str, body: Optional[Dict[str, Any]], what: str,
                    missing_ok: bool = False) -> Any:
        status, doc, url = await self._call_at(method, path, body, what)
        if status == 404:
            if missing_ok:
                return None
            raise HttpError(url, status, _error_of(doc))
        return doc

    async def _call(self, method: str, path: str, body: Optional[Dict[str, Any]], what: str) -> Tuple[int, Any]:
        status, doc, _ = await self._call_at(method, path, body, what)
        return status, doc

    async def _call_at(self, method: str, path: str, body: Optional[Dict[str, Any]],
                       what: str) -> Tuple[int, Any, str]:
        causes: List[str] = []
        last: Optional[BaseException] = None
        for url in self.urls:
            try:
                status, doc = await self._http.request(method, url, path, body, self.timeout_s)
            except _TRANSPORT_ERRORS as e:
                causes.append(f"{url}: {e}")
                last = e
                continue
            if _is_answer(url, method, status, doc, causes, path):
                return status, doc, url + path
        raise ServerUnavailable(what, causes, last)

    async def close(self) -> None:
        await self._http.close()


class AsyncWorker(_SignalStops):
    """Claims jobs from every URL with long polls and runs ``handler`` as up
    to ``concurrency`` tasks; extends the job leases of running handlers
    every lease/3 and acks (batched) or fails on the server that gave the
    job. :meth:`run` returns after :meth:`stop` or SIGTERM/SIGINT once every
    running handler has finished and its result has been sent; a second
    signal stops without waiting for the handlers (they are cancelled)."""

    def __init__(
        self,
        urls: Union[str, Sequence[str]],
        token: Optional[str] = None,
        *,
        worker_id: Optional[str] = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.urls = _normalise_urls(urls)
        self.worker_id = worker_id or f"{socket.gethostname()}@{os.getpid()}-pyaio-{uuid.uuid4().hex[:6]}"
        self.timeout_s = _check_timeout(timeout_s)
        self._http = _Session(token)
        self._stopping: Optional[asyncio.Event] = None
        self._abandoned: Optional[asyncio.Event] = None
        self._running: Dict[int, ClaimedJob] = {}
        self._tasks: Set["asyncio.Task[None]"] = set()
        self._polls: Set["asyncio.Future[Tuple[int, Any]]"] = set()
        self._acks: Dict[str, List[ClaimedJob]] = {}
        self._ack_ready: Dict[str, asyncio.Event] = {}
        self._book = _SlotBook(self.urls, 1)
        self._slot_free: Optional[asyncio.Event] = None
        self._fatal: Optional[BaseException] = None
        self._signals = 0
        self.stats = WorkerStats()

    def stop(self, drain: bool = True) -> None:
        """Stops claiming, cutting the claims in flight at once (jobs one
        was being given stay leased to this worker until their lease
        passes); :meth:`run` returns once running jobs finish, or with
        ``drain=False`` at once: running handlers are cancelled (and
        ``job.lost`` set), their results not sent, their jobs run again
        after their leases. Call it from the worker's event loop (signal
        handlers do)."""
        if self._stopping is None:
            return
        self._stopping.set()
        for p in list(self._polls):
            p.cancel()
        if not drain and self._abandoned is not None and not self._abandoned.is_set():
            self._abandoned.set()
            for j in list(self._running.values()):
                j.lost.set()
            for t in list(self._tasks):
                t.cancel()

    async def run(
        self,
        handler: AsyncHandler,
        concurrency: int = 100,
        lease_ms: int = 30_000,
        wait_ms: int = CLAIM_WAIT_MS_DEFAULT,
        install_signal_handlers: bool = True,
        drain_timeout_s: Optional[float] = None,
        timeout_ms: Optional[int] = None,
    ) -> WorkerStats:
        """Runs ``handler`` until stopped; after a stop the handlers get
        ``drain_timeout_s`` (default: no limit) to finish before they are
        cancelled as by ``stop(drain=False)``.

        ``timeout_ms`` (1 ms to 7 days; default: the server's ``serve
        --job-timeout-ms``, if any) is each run's job timeout, sent with
        every claim: past it the server fails the run itself (an attempt
        used: the job runs again, or dies on its last attempt), whatever the
        extends, and this worker cancels the handler's task
        (``asyncio.CancelledError`` in the handler, ``job.lost`` set), sends
        nothing for it and counts it in ``stats.timed_out``; a handler that
        swallows the cancellation keeps its slot until it returns. Raises
        the error that stopped it, if any: :class:`shardq.Unauthorized` for
        a refused token."""
        if concurrency < 1:
            raise ConfigError(f"invalid concurrency {concurrency}: at least 1")
        if lease_ms < 100:
            raise ConfigError(f"invalid lease_ms {lease_ms}: at least 100")
        if drain_timeout_s is not None and drain_timeout_s < 0:
            raise ConfigError(f"invalid drain_timeout_s {drain_timeout_s}: at least 0")
        timeout_ms = _check_job_timeout(timeout_ms)
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._abandoned = asyncio.Event()
        self._fatal = None
        self._signals = 0
        self._book = _SlotBook(self.urls, concurrency)
        self._slot_free = asyncio.Event()
        self._acks = {u: [] for u in self.urls}
        self._ack_ready = {u: asyncio.Event() for u in self.urls}
        signals: List[int] = []
        if install_signal_handlers:
            for sig in (int(signal.SIGTERM), int(signal.SIGINT)):
                try:
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    signals.append(sig)
                except (NotImplementedError, RuntimeError, ValueError):
                    log.warning("shardq worker: cannot handle signal %s here (call stop())", sig)
        acks_done = asyncio.Event()
        ackers = [asyncio.ensure_future(self._ack_loop(u, acks_done)) for u in self.urls]
        beat = asyncio.ensure_future(self._heartbeat(lease_ms))
        most = min(concurrency, CLAIM_MAX)
        try:
            claimers = [
                asyncio.ensure_future(self._claim_loop(u, handler, most, lease_ms, wait_ms, timeout_ms))
                for u in self.urls
            ]
            await asyncio.gather(*claimers)
        finally:
            self.stop()
            await self._drain(drain_timeout_s)
            acks_done.set()
            for e in self._ack_ready.values():
                e.set()
            flush = ABANDON_ACK_FLUSH_S if self._abandoned.is_set() else None
            _, late = await asyncio.wait(ackers, timeout=flush)
            for a in late:
                a.cancel()
            beat.cancel()
            await asyncio.gather(beat, *late, return_exceptions=True)
            if self._abandoned.is_set():
                self.stats.abandoned += len(self._running)
            for sig in signals:
                loop.remove_signal_handler(sig)
            await self._http.close()
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def _drain(self, timeout_s: Optional[float]) -> None:
        """Waits for the running handlers: to the end, or until the drain
        timeout or a stop without draining, which cancels them."""
        assert self._abandoned is not None
        if not self._tasks:
            return
        everything = asyncio.ensure_future(asyncio.wait(list(self._tasks)))
        abandoned = asyncio.ensure_future(self._abandoned.wait())
        await asyncio.wait({everything, abandoned}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        abandoned.cancel()
        if not everything.done():
            if not self._abandoned.is_set():
                log.warning("shardq worker: drain timeout (%.1f s): cancelling the running handlers", timeout_s)
                self.stop(drain=False)
            # A handler that swallows its cancellation is left behind.
            await asyncio.wait({everything}, timeout=ABANDON_ACK_FLUSH_S)
            everything.cancel()

    def _give_back(self, settle: Callable[[], None]) -> None:
        assert self._slot_free is not None
        settle()
        self._slot_free.set()

    async def _until_stopped(self, aw: Awaitable[Any]) -> None:
        """Waits for ``aw`` or the stop, whichever comes first."""
        assert self._stopping is not None
        f = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({f, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            f.cancel()
            stop.cancel()

    async def _claim_loop(self, url: str, handler: AsyncHandler, most: int, lease_ms: int, wait_ms: int,
                          timeout_ms: Optional[int]) -> None:
        assert self._stopping is not None and self._slot_free is not None
        failures = 0
        body: Dict[str, Any] = {"worker": self.worker_id, "max": 1, "wait_ms": wait_ms, "lease_ms": lease_ms}
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        while not self._stopping.is_set():
            want, own = self._book.take(url, most)
            if not want:
                self._slot_free.clear()
                await self._until_stopped(self._slot_free.wait())
                continue
            body["max"] = want
            poll = asyncio.ensure_future(self._http.post(url, "/v1/claim", dict(body), self.timeout_s))
            self._polls.add(poll)
            jobs: List[ClaimedJob] = []
            try:
                status, doc = await poll
                if status != 200:
                    _raise_for(url, status, doc)
                jobs = _claimed_of(url, doc)
                _set_deadlines(jobs, lease_ms, timeout_ms, time.monotonic())
                failures = 0
            except asyncio.CancelledError:
                self._give_back(lambda: self._book.claimed(url, want, own, []))
                if poll.cancelled() and self._stopping.is_set():
                    return  # the stop cut the poll
                raise
            except (*_TRANSPORT_ERRORS, HttpError, ValueError, KeyError) as e:
                self._give_back(lambda: self._book.claimed(url, want, own, []))
                if isinstance(e, HttpError) and _refuses_worker(e):
                    log.error("shardq worker: %s refused the claim, stopping: %s", url, e)
                    if self._fatal is None:
                        self._fatal = e
                    self.stop()
                    return
                failures += 1
                log.warning("shardq worker: claim from %s failed (%s): %s", url, type(e).__name__, e)
                await self._until_stopped(asyncio.sleep(_backoff_ms(min(failures, 6)) / 1000))
                continue
            finally:
                self._polls.discard(poll)
            self._give_back(lambda: self._book.claimed(url, want, own, jobs))
            self.stats.claimed += len(jobs)
            self.stats.claim_requests += 1
            for j in jobs:
                self._running[id(j)] = j
                t = asyncio.ensure_future(self._run_one(handler, j))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    async def _run_one(self, handler: AsyncHandler, job: ClaimedJob) -> None:
        assert self._abandoned is not None
        error: Optional[BaseException] = None
        try:
            result: Any = handler(job)
            if not inspect.isawaitable(result):
                job._result = _result_field(result)
            elif job._timeout_until is None:
                job._result = _result_field(await result)
            else:
                if await self._cancelled_at_timeout(result, job):
                    self._running.pop(id(job), None)
                    self._give_back(lambda: self._book.release(job))
                    if not self._abandoned.is_set():
                        self.stats.timed_out += 1
                    return  # the server failed the run: nothing to send
        except asyncio.CancelledError as e:
            if self._abandoned.is_set():
                self._give_back(lambda: self._book.release(job))
                return  # abandoned: not reported, its lease decides
            error = e
        except Exception as e:  # the attempt fails; the server retries it
            error = e
        if self._abandoned.is_set():
            self._give_back(lambda: self._book.release(job))
            return
        self._running.pop(id(job), None)
        self._give_back(lambda: self._book.release(job))
        # A run the server said is over (a cancel, say): its fail ends a
        # cancelled run (refused with 409) and frees its key now.
        outcome = _stale_outcome(job) if job._stale else _outcome_of(job, error)
        if outcome is None:
            self._acks[job.url].append(job)
            self._ack_ready[job.url].set()
        else:
            await self._report(job, *outcome)

    async def _cancelled_at_timeout(self, aw: Awaitable[Any], job: ClaimedJob) -> bool:
        """Awaits the handler's ``aw`` as a task of its own until the run's
        job timeout: ``False`` when it ended before (what it raised is
        raised), ``True`` when the timeout passed first: its task was
        cancelled (``job.lost`` set first) and has ended."""
        assert job._timeout_until is not None
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait({task}, timeout=max(0.0, job._timeout_until - time.monotonic()))
            if task.done():
                job._result = _result_field(task.result())
                return False
            job._timed_out = True
            job.lost.set()
            task.cancel()
            log.warning("shardq worker: job %s (key %r, shard %s) at %s: the run passed its job timeout of %s ms: "
                        "its handler is cancelled (the server fails the run)", job.id, job.key, job.shard, job.url,
                        job._timeout_ms)
            # A handler that swallows its cancellation holds its slot until
            # it returns, as a running one does.
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: its result no longer counts
            return True
        except asyncio.CancelledError:
            task.cancel()  # a stop without draining: the handler too
            raise

    async def _report(self, job: ClaimedJob, path: str, body: Dict[str, Any]) -> None:
        for attempt in range(RESULT_ATTEMPTS):
            try:
                status, doc = await self._http.post(job.url, path, body, self.timeout_s)
            except _TRANSPORT_ERRORS as e:
                log.warning("shardq worker: %s of job %s (key %r) to %s failed: %s", path, job.id, job.key, job.url, e)
                await asyncio.sleep(_backoff_ms(attempt) / 1000)
                continue
            if status == 200:
                if "backoff_ms" in body:
                    self.stats.backed_off += 1
                else:
                    self.stats.failed += 1
                return
            if status == 409 and job._stale:
                log.info("shardq worker: job %s (key %r) at %s: the fail of its run, found over, was refused as "
                         "expected (%s)", job.id, job.key, job.url, _error_of(doc))
                self.stats.lost += 1
                return
            if status == 409:
                if _refused(job, path, doc):
                    self.stats.timed_out += 1
                else:
                    self.stats.lost += 1
                return
            if not _retryable(status):
                log.error("shardq worker: %s of job %s at %s refused with %s: %s", path, job.id, job.url, status, _error_of(doc))
                break
            await asyncio.sleep(_backoff_ms(attempt) / 1000)
        self.stats.unreported += 1
        log.error("shardq worker: gave up reporting job %s (key %r) to %s; its lease decides", job.id, job.key, job.url)

    async def _ack_loop(self, url: str, done: asyncio.Event) -> None:
        """Sends the acks queued for ``url``: everything that finished since
        the last request, at most ACK_BATCH_MAX per request; returns once
        ``done`` is set and nothing is left."""
        ready = self._ack_ready[url]
        while True:
            await ready.wait()
            ready.clear()
            while self._acks[url]:
                batch = self._acks[url][:ACK_BATCH_MAX]
                del self._acks[url][:ACK_BATCH_MAX]
                await self._send_acks(url, batch)
            if done.is_set() and not self._acks[url]:
                return

    async def _send_acks(self, url: str, jobs: List[ClaimedJob]) -> None:
        body = _ack_body(jobs)
        for attempt in range(RESULT_ATTEMPTS):
            try:
                status, doc = await self._http.post(url, "/v1/ack", body, self.timeout_s)
            except _TRANSPORT_ERRORS as e:
                log.warning("shardq worker: ack of %d jobs to %s failed: %s", len(jobs), url, e)
                await asyncio.sleep(_backoff_ms(attempt) / 1000)
                continue
            refused = _settle_acks(url, jobs, status, doc)
            if refused is not None:
                lost, timed_out = refused
                self.stats.lost += lost
                self.stats.timed_out += timed_out
                self.stats.acked += len(jobs) - lost - timed_out
                self.stats.ack_requests += 1
                return
            if not _retryable(status):
                log.error("shardq worker: ack of %d jobs at %s refused with %s: %s", len(jobs), url, status, _error_of(doc))
                break
            await asyncio.sleep(_backoff_ms(attempt) / 1000)
        self.stats.unreported += len(jobs)
        log.error("shardq worker: gave up acking %d jobs at %s; their leases decide", len(jobs), url)

    async def _heartbeat(self, lease_ms: int) -> None:
        """Extends the leases of the running handlers every lease/3; between
        extends, while handlers run, asks each server every
        :data:`shardq.http.STALE_CHECK_S` which runs are no longer current
        (``/v1/stale``): ``job.lost`` is set on those (a run cancelled
        through the API, say) and their fail is sent once they returned."""
        every = lease_ms / 3 / 1000
        next_beat = time.monotonic() + every
        while True:
            await asyncio.sleep(max(0.0, min(STALE_CHECK_S, next_beat - time.monotonic())))
            now = time.monotonic()
            beat = now >= next_beat
            if beat:
                next_beat = now + every
            by_url: Dict[str, List[ClaimedJob]] = {}
            for j in list(self._running.values()):
                if j._timed_out:  # the server refuses its extend
                    continue
                if beat or not j._stale:
                    by_url.setdefault(j.url, []).append(j)
            for url, jobs in by_url.items():
                for i in range(0, len(jobs), ACK_BATCH_MAX):
                    if beat:
                        await self._extend(url, jobs[i:i + ACK_BATCH_MAX], lease_ms)
                    else:
                        await self._check_stale(url, jobs[i:i + ACK_BATCH_MAX])

    async def _check_stale(self, url: str, jobs: List[ClaimedJob]) -> None:
        """Asks ``url`` which of ``jobs``' runs are no longer current and sets
        ``job.lost`` on those still running."""
        try:
            status, doc = await self._http.post(url, "/v1/stale", {"receipts": [j.receipt for j in jobs]},
                                                self.timeout_s)
        except _TRANSPORT_ERRORS as e:
            log.warning("shardq worker: stale check at %s failed: %s", url, e)
            return
        named = _stale_named(url, status, doc)
        if named:
            _mark_lost(url, jobs, named, lambda j: id(j) in self._running, "a stale check named it")

    async def _extend(self, url: str, jobs: List[ClaimedJob], lease_ms: int) -> None:
        body = {"receipts": [j.receipt for j in jobs], "lease_ms": lease_ms}
        try:
            status, doc = await self._http.post(url, "/v1/extend", body, self.timeout_s)
        except _TRANSPORT_ERRORS as e:
            log.warning("shardq worker: extend at %s failed: %s", url, e)
            return
        stale = _extend_refused(url, jobs, status, doc)
        if stale is None:
            for j in jobs:
                await self._extend(url, [j], lease_ms)
            return
        _mark_lost(url, jobs, stale, lambda j: id(j) in self._running)
