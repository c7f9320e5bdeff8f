"""asyncio clients of ``shardq serve``: :class:`AsyncClient` enqueues,
:class:`AsyncWorker` claims, runs ``async def`` handlers as tasks on one
event loop, heartbeats and acks.

The same contract, dedup ids, retries, batched acks and at-least-once
semantics as :mod:`shardq.http`, over `aiohttp`_ (``pip install
"./clients/python[asyncio]"``). A worker's concurrency is tasks, not
threads: for handlers that mostly wait (on other services), thousands of
them cost no thread each. For short handlers the threaded
:class:`shardq.Worker` used less CPU per job in our benchmarks (see
BENCHMARKS.md).

A handler is ``async def handler(job: ClaimedJob) -> None``: returning acks
the job, raising :class:`shardq.Retry` fails it with that retry delay, any
other exception fails the attempt. A blocking handler stalls the loop: run
blocking work with ``asyncio.to_thread`` (or use :class:`shardq.Worker`).

.. _aiohttp: https://docs.aiohttp.org/
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from .errors import HttpError, ServerUnavailable, Unauthorized
from .http import (
    ACK_BATCH_MAX,
    CLAIM_MAX,
    CLAIM_WAIT_MS_DEFAULT,
    ENQUEUE_BATCH_MAX,
    REQUEST_TIMEOUT_S,
    RESULT_ATTEMPTS,
    RETRY_ROUNDS_DEFAULT,
    ClaimedJob,
    Enqueued,
    NewJob,
    Payload,
    WorkerStats,
    _backoff_ms,
    _claimed_of,
    _dumps,
    _enqueued_of,
    _error_of,
    _job_bodies,
    _loads,
    _extend_refused,
    _mark_lost,
    _normalise_urls,
    _outcome_of,
    _raise_for,
    _retryable,
    _settle_acks,
)

try:
    import aiohttp
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shardq.aio needs aiohttp: pip install \"./clients/python[asyncio]\" (or pip install aiohttp)"
    ) from e

log = logging.getLogger("shardq")

AsyncHandler = Callable[[ClaimedJob], Awaitable[None]]

#: Transport failures: the request may or may not have been handled.
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class _Session:
    """One aiohttp session (a keep-alive connection pool) for all servers."""

    def __init__(self, token: Optional[str]) -> None:
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._session: Optional[aiohttp.ClientSession] = None

    def _get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers)
        return self._session

    async def post(self, url: str, path: str, body: Mapping[str, Any], timeout: float) -> Tuple[int, Any]:
        """(status, decoded JSON body or None); raises the transport errors."""
        data = _dumps(body)
        async with self._get().post(url + path, data=data, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
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
    the URLs, retries and dedup ids. Use ``async with`` or :meth:`close`."""

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
        self._http = _Session(token)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def enqueue(
        self,
        key: str,
        payload: Payload = b"",
        delay_ms: int = 0,
        max_attempts: Optional[int] = None,
        dedup_id: Optional[str] = None,
    ) -> Enqueued:
        """Enqueues one job."""
        return (await self.enqueue_many([NewJob(key, payload, delay_ms, max_attempts, dedup_id)]))[0]

    async def enqueue_many(self, jobs: Iterable[Union[NewJob, Mapping[str, Any]]]) -> List[Enqueued]:
        """Enqueues ``jobs`` in order, ``ENQUEUE_BATCH_MAX`` per request."""
        bodies = _job_bodies(jobs)
        out: List[Enqueued] = []
        for start in range(0, len(bodies), ENQUEUE_BATCH_MAX):
            chunk = bodies[start:start + ENQUEUE_BATCH_MAX]
            out.extend(_enqueued_of(self.urls[0], chunk, await self._post_any("/v1/jobs", {"jobs": chunk})))
        return out

    async def _post_any(self, path: str, body: Mapping[str, Any]) -> Any:
        causes: Dict[str, str] = {}
        last: Optional[BaseException] = None
        for round_no in range(self.retry_rounds):
            for url in self.urls:
                try:
                    status, doc = await self._http.post(url, path, body, self.timeout_s)
                except _TRANSPORT_ERRORS as e:
                    causes[url] = f"{url}: {type(e).__name__}: {e}"
                    last = e
                    continue
                if status == 200:
                    return doc
                # 409 on an enqueue: another request holds one of the dedup ids.
                if not _retryable(status) and not (status == 409 and path == "/v1/jobs"):
                    _raise_for(url, status, doc)
                causes[url] = f"{url}: {status} {_error_of(doc)}"
            if round_no + 1 < self.retry_rounds:
                await asyncio.sleep(_backoff_ms(round_no) / 1000)
        raise ServerUnavailable(f"POST {path} ({self.retry_rounds} rounds)", list(causes.values()), last)

    async def close(self) -> None:
        await self._http.close()


class AsyncWorker:
    """Claims jobs from every URL with long polls and runs ``handler`` as up
    to ``concurrency`` tasks; extends the job leases of running handlers
    every lease/3 and acks (batched) or fails on the server that gave the
    job. :meth:`run` returns after :meth:`stop` or SIGTERM/SIGINT once every
    running handler has finished and its result has been sent."""

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
        self.timeout_s = timeout_s
        self._http = _Session(token)
        self._stopping: Optional[asyncio.Event] = None
        self._running: Dict[int, ClaimedJob] = {}
        self._acks: Dict[str, List[ClaimedJob]] = {}
        self._ack_ready: Dict[str, asyncio.Event] = {}
        self._free = 0
        self._slot_free: Optional[asyncio.Event] = None
        self.stats = WorkerStats()

    def stop(self) -> None:
        """Stops claiming; :meth:`run` returns once running jobs finish.
        Call it from the worker's event loop (signal handlers do)."""
        if self._stopping is not None:
            self._stopping.set()

    async def run(
        self,
        handler: AsyncHandler,
        concurrency: int = 100,
        lease_ms: int = 30_000,
        wait_ms: int = CLAIM_WAIT_MS_DEFAULT,
        install_signal_handlers: bool = True,
    ) -> WorkerStats:
        if concurrency < 1:
            raise ValueError(f"invalid concurrency {concurrency}: at least 1")
        if lease_ms < 100:
            raise ValueError(f"invalid lease_ms {lease_ms}: at least 100")
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._free = concurrency
        self._slot_free = asyncio.Event()
        self._slot_free.set()
        self._acks = {u: [] for u in self.urls}
        self._ack_ready = {u: asyncio.Event() for u in self.urls}
        signals: List[int] = []
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    loop.add_signal_handler(sig, self.stop)
                    signals.append(sig)
                except (NotImplementedError, RuntimeError, ValueError):
                    log.warning("shardq worker: cannot handle signal %s here (call stop())", sig)
        tasks: Set["asyncio.Task[None]"] = set()
        acks_done = asyncio.Event()
        ackers = [asyncio.ensure_future(self._ack_loop(u, acks_done)) for u in self.urls]
        beat = asyncio.ensure_future(self._heartbeat(lease_ms))
        try:
            claimers = [
                asyncio.ensure_future(self._claim_loop(u, handler, concurrency, lease_ms, wait_ms, tasks))
                for u in self.urls
            ]
            await asyncio.gather(*claimers)
        finally:
            self._stopping.set()
            # Drain: every claimed job runs to its end and reports.
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            acks_done.set()
            for e in self._ack_ready.values():
                e.set()
            await asyncio.gather(*ackers, return_exceptions=True)
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
            for sig in signals:
                loop.remove_signal_handler(sig)
            await self._http.close()
        return self.stats

    def _give_back(self, n: int) -> None:
        assert self._slot_free is not None
        self._free += n
        if self._free > 0:
            self._slot_free.set()

    async def _claim_loop(self, url: str, handler: AsyncHandler, concurrency: int, lease_ms: int, wait_ms: int,
                          tasks: Set["asyncio.Task[None]"]) -> None:
        assert self._stopping is not None and self._slot_free is not None
        failures = 0
        most = min(concurrency, CLAIM_MAX)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while not self._stopping.is_set():
                if self._free <= 0:
                    self._slot_free.clear()
                    free = asyncio.ensure_future(self._slot_free.wait())
                    await asyncio.wait({free, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    free.cancel()
                    continue
                # Reserve the free slots and ask for that many.
                want = min(self._free, most)
                self._free -= want
                body = {"worker": self.worker_id, "max": want, "wait_ms": wait_ms, "lease_ms": lease_ms}
                try:
                    # Not cancelled on stop: a claim answered after we left
                    # would strand its jobs until their leases lapse.
                    status, doc = await self._http.post(url, "/v1/claim", body, self.timeout_s + wait_ms / 1000)
                    if status != 200:
                        _raise_for(url, status, doc)
                    jobs = _claimed_of(url, doc)
                    failures = 0
                except (*_TRANSPORT_ERRORS, HttpError, ValueError, KeyError) as e:
                    failures += 1
                    if isinstance(e, Unauthorized):
                        log.error("shardq worker: %s refused the token: %s", url, e)
                    else:
                        log.warning("shardq worker: claim from %s failed (%s): %s", url, type(e).__name__, e)
                    self._give_back(want)
                    pause = asyncio.ensure_future(asyncio.sleep(_backoff_ms(min(failures, 6)) / 1000))
                    await asyncio.wait({pause, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    pause.cancel()
                    continue
                self._give_back(want - len(jobs))
                self.stats.claimed += len(jobs)
                self.stats.claim_requests += 1
                for j in jobs:
                    self._running[id(j)] = j
                    t = asyncio.ensure_future(self._run_one(handler, j))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
        finally:
            stopping.cancel()

    async def _run_one(self, handler: AsyncHandler, job: ClaimedJob) -> None:
        error: Optional[BaseException] = None
        try:
            await handler(job)
        except asyncio.CancelledError as e:
            error = e
        except Exception as e:  # the attempt fails; the server retries it
            error = e
        finally:
            self._running.pop(id(job), None)
            self._give_back(1)
        outcome = _outcome_of(job, error)
        if outcome is None:
            self._acks[job.url].append(job)
            self._ack_ready[job.url].set()
        else:
            await self._report(job, *outcome)

    async def _report(self, job: ClaimedJob, path: str, body: Dict[str, Any]) -> None:
        for attempt in range(RESULT_ATTEMPTS):
            try:
                status, doc = await self._http.post(job.url, path, body, self.timeout_s)
            except _TRANSPORT_ERRORS as e:
                log.warning("shardq worker: %s of job %s (key %r) to %s failed: %s", path, job.id, job.key, job.url, e)
                await asyncio.sleep(_backoff_ms(attempt) / 1000)
                continue
            if status == 200:
                self.stats.failed += 1
                return
            if status == 409:
                log.warning("shardq worker: job %s (key %r, shard %s) at %s: the run was lost (%s refused: %s)",
                            job.id, job.key, job.shard, job.url, path, _error_of(doc))
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
        body = {"receipts": [j.receipt for j in jobs]}
        for attempt in range(RESULT_ATTEMPTS):
            try:
                status, doc = await self._http.post(url, "/v1/ack", body, self.timeout_s)
            except _TRANSPORT_ERRORS as e:
                log.warning("shardq worker: ack of %d jobs to %s failed: %s", len(jobs), url, e)
                await asyncio.sleep(_backoff_ms(attempt) / 1000)
                continue
            lost = _settle_acks(url, jobs, status, doc)
            if lost is not None:
                self.stats.lost += lost
                self.stats.acked += len(jobs) - lost
                self.stats.ack_requests += 1
                return
            if not _retryable(status):
                log.error("shardq worker: ack of %d jobs at %s refused with %s: %s", len(jobs), url, status, _error_of(doc))
                break
            await asyncio.sleep(_backoff_ms(attempt) / 1000)
        self.stats.unreported += len(jobs)
        log.error("shardq worker: gave up acking %d jobs at %s; their leases decide", len(jobs), url)

    async def _heartbeat(self, lease_ms: int) -> None:
        every = lease_ms / 3 / 1000
        while True:
            await asyncio.sleep(every)
            by_url: Dict[str, List[ClaimedJob]] = {}
            for j in list(self._running.values()):
                by_url.setdefault(j.url, []).append(j)
            for url, jobs in by_url.items():
                await self._extend(url, jobs, lease_ms)

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
