"""The workers and the client against real ``shardq serve`` processes:
every URL polled when only one server has work, a refused token, an
``async def`` handler given to the threaded worker, stops (Ctrl-C on an
idle worker, a second signal, the drain timeout, ``job.lost``), batches
split by bytes, and the request timeout's derivation from the server's
longest wait."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import pytest

from shardq import AsyncClient, AsyncWorker, ClaimedJob, Client, ConfigError, NewJob, ShardqError, Unauthorized, Worker
from shardq import http as h

from support import REPO_ROOT, WAIT_S, all_done, read_lines, stop_process, totals_of, wait_until, write_tokens

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ["thread", "aio"]


class Running:
    """A :class:`Worker` (``thread``) or :class:`AsyncWorker` (``aio``, on
    its own event loop) running ``on_job`` in a thread of this process."""

    def __init__(self, kind: str, urls: List[str], on_job: Callable[[ClaimedJob], Any],
                 token: Optional[str] = None, **kw: Any) -> None:
        self.kind = kind
        self.error: Optional[BaseException] = None
        self.stats: Any = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.w: Any
        if kind == "thread":
            self.w = Worker(urls, token=token)
            target: Callable[[], Any] = lambda: self.w.run(on_job, install_signal_handlers=False, **kw)
        else:
            self.w = AsyncWorker(urls, token=token)
            kw.pop("prefetch", None)

            async def handler(job: ClaimedJob) -> None:
                r = on_job(job)
                if asyncio.iscoroutine(r):
                    await r

            async def main() -> Any:
                self.loop = asyncio.get_running_loop()
                return await self.w.run(handler, install_signal_handlers=False, **kw)

            target = lambda: asyncio.run(main())
        self.t = threading.Thread(target=self._run, args=(target,), daemon=True)
        self.t.start()

    def _run(self, target: Callable[[], Any]) -> None:
        try:
            self.stats = target()
        except BaseException as e:  # checked by the test
            self.error = e

    def stop(self, drain: bool = True) -> None:
        if self.kind == "thread":
            self.w.stop(drain)
        else:
            wait_until("the event loop", lambda: self.loop is not None or not self.t.is_alive())
            if self.loop is not None and self.t.is_alive():
                self.loop.call_soon_threadsafe(self.w.stop, drain)

    def join(self) -> None:
        self.t.join(WAIT_S)
        assert not self.t.is_alive(), f"{self.kind} worker did not return"


# --------------------------------------------------------------- 1. every URL polled

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("concurrency", [1, 4])
def test_every_url_is_polled_when_only_the_second_server_has_work(make_serve, kind, concurrency):
    a = make_serve("a", 2)
    b = make_serve("b", 2)
    ran: List[str] = []
    r = Running(kind, [a.url, b.url], lambda job: ran.append(job.url), concurrency=concurrency,
                lease_ms=5000, wait_ms=500, prefetch=0 if concurrency == 1 else None)
    try:
        # A quiet queue first: several long polls come back empty.
        wait_until("idle claims", lambda: r.w.stats.claim_requests >= 6, timeout_s=15)
        Client([b.url]).enqueue_many([NewJob(f"t-{i}", "x") for i in range(12)])
        wait_until("the second server's jobs to run", lambda: len(ran) == 12 and all_done(b.url), timeout_s=15)
    finally:
        r.stop()
        r.join()
    assert r.error is None, r.error
    assert set(ran) == {b.url}


# --------------------------------------------------------------- 2. async handler, threaded worker

def test_an_async_handler_given_to_the_threaded_worker_is_refused_and_never_acked(serve):
    Client([serve.url]).enqueue("k", "x")
    ran: List[str] = []

    async def handle(job: ClaimedJob) -> None:
        ran.append(job.key)

    class Handler:
        async def __call__(self, job: ClaimedJob) -> None:
            ran.append(job.key)

    # A plain callable returning a coroutine is seen only when it returns:
    # the coroutine never ran, so the job is not acked and the worker stops.
    for bad in (handle, Handler(), lambda job: handle(job)):
        r = Running("thread", [serve.url], bad, wait_ms=200)
        wait_until("the worker to refuse the handler", lambda: not r.t.is_alive(), timeout_s=10)
        assert isinstance(r.error, ConfigError) and "AsyncWorker" in str(r.error), r.error
        t = serve.totals()
        assert ran == [] and t["ready"] + t["delayed"] + t["in_flight"] == 1, t


# --------------------------------------------------------------- 3. refused token

@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_token_stops_the_worker_with_the_error(make_serve, tmp_path, kind, caplog):
    tokens = write_tokens(str(tmp_path / "tokens.txt"))
    s = make_serve("q", 2, args=["--tokens", tokens])
    with caplog.at_level(logging.WARNING, logger="shardq"):
        r = Running(kind, [s.url], lambda job: None, token="not-the-token-0123456789", wait_ms=200)
        wait_until("the worker to stop", lambda: not r.t.is_alive(), timeout_s=10)
    assert isinstance(r.error, Unauthorized) and r.error.status in (401, 403), r.error
    refusals = [rec for rec in caplog.records if "refused" in rec.getMessage()]
    assert len(refusals) == 1, [rec.getMessage() for rec in refusals]


# --------------------------------------------------------------- 5. batches split by bytes

def test_twenty_one_mib_jobs_go_in_requests_under_the_body_limit(make_serve):
    payload = "x" * 1_000_000
    s = make_serve("q", 2)
    got = Client([s.url]).enqueue_many([NewJob(f"big-{i}", payload) for i in range(20)])
    assert len({g.id for g in got}) == 20 and not any(g.duplicate for g in got)
    assert s.totals()["ready"] == 20
    # A server with a lower body limit answers 413: the batch is halved
    # until every request fits.
    small = make_serve("small", 2, args=["--body-bytes-max", "2500000"])
    got = Client([small.url]).enqueue_many([NewJob(f"big-{i}", payload) for i in range(7)])
    assert len({g.id for g in got}) == 7 and small.totals()["ready"] == 7


def test_batches_are_cut_by_count_and_bytes():
    jobs = h._job_bodies([NewJob(f"k{i}", "p" * 100) for i in range(10)])
    one = len(h._dumps(jobs[0]))
    cut = list(h._batches(jobs, 4, 3 * one + 2 + len(h._BATCH_HEAD) + len(h._BATCH_TAIL)))
    # Cut by count first (4, 4, 2), then a request over the byte bound by
    # bytes (3 + 1 each), in order.
    assert [len(b) for b in cut] == [3, 1, 3, 1, 2]
    assert [j["key"] for b in cut for j in b] == [f"k{i}" for i in range(10)]
    assert all(len(h._batch_body(b)) <= 3 * one + 2 + 11 for b in cut)
    assert [len(b) for b in h._batches(jobs, 4, 1 << 20)] == [4, 4, 2]
    assert json.loads(h._batch_body(cut[0]))["jobs"][0]["key"] == "k0"
    # Every request, and each half of one a server found too large, knows
    # which ids its call generated.
    halves = h._halves(cut[0])
    assert {b.prefix for b in cut + list(halves)} == {jobs.prefix} and len(jobs.prefix) == 24
    assert [len(b) for b in halves] == [1, 2]


def test_a_duplicate_is_the_calls_own_only_for_ids_it_generated():
    given = NewJob("k", "p", dedup_id="invoice-1")
    jobs = h._job_bodies([NewJob("k", "p"), given, NewJob("k", "q", dedup_id=None)])
    batch = next(h._batches(jobs, 10, 1 << 20))
    reply = {"jobs": [{"id": f"s:{i}", "shard": "s", "key": "k", "duplicate": True} for i in range(3)]}
    # Answered at once: every duplicate is one.
    assert [e.duplicate for e in h._enqueued_of("u", batch, reply, False)] == [True, True, True]
    # After an attempt that may have stored them: a generated id's duplicate
    # is this call's earlier attempt, a given id's is a real duplicate.
    assert [e.duplicate for e in h._enqueued_of("u", batch, reply, True)] == [False, True, False]
    # A job sent again keeps its generated id, which this call did not make.
    again = next(h._batches(h._job_bodies([given, NewJob("k", "p", dedup_id=jobs[0]["dedup_id"])]), 10, 1 << 20))
    assert [e.duplicate for e in h._enqueued_of("u", again, {"jobs": reply["jobs"][:2]}, True)] == [True, True]


# --------------------------------------------------------------- 9. stops

def start_proc(tmp_path: Any, kind: str, url: str, mode: str, drain: Optional[float] = None) -> Any:
    out, err = tmp_path / f"{kind}-{mode}.out", tmp_path / f"{kind}-{mode}.err"
    args = [sys.executable, os.path.join(HERE, "stop_worker_proc.py"), kind, url, mode]
    if drain is not None:
        args.append(str(drain))
    with open(out, "wb") as o, open(err, "wb") as e:
        p = subprocess.Popen(args, stdout=o, stderr=e, env={**os.environ, "SHARDQ_TEST_LOG": "info"})
    return p, str(out), str(err)


def stats_of(out: str) -> Dict[str, int]:
    lines = [l for l in read_lines(out) if l.startswith("stats ")]
    assert lines, read_lines(out)
    return json.loads(lines[-1][len("stats "):])


def signal_and_time(p: Any, sig: int) -> Any:
    """Sends ``sig``; (exit status, seconds until the exit)."""
    t0 = time.monotonic()
    p.send_signal(sig)
    rc = p.wait(WAIT_S)
    return rc, time.monotonic() - t0


def one_job_started(serve: Any, tmp_path: Any, kind: str, mode: str) -> Any:
    """Enqueues ``k-1`` and starts a worker process that has run (quick)
    or started (block) it: (process, stdout file, stderr file)."""
    Client([serve.url]).enqueue("k-1", "x")
    p, out, err = start_proc(tmp_path, kind, serve.url, mode)
    line = "ran k-1" if mode == "quick" else "started k-1"
    try:
        wait_until(f"the worker's {line!r}", lambda: line in read_lines(out), timeout_s=WAIT_S)
    except BaseException:
        stop_process(p, "worker", signal.SIGKILL)
        raise
    return p, out, err


@pytest.mark.parametrize("kind", KINDS)
def test_ctrl_c_on_an_idle_worker_returns_at_once(serve, tmp_path, kind):
    p, out, _ = one_job_started(serve, tmp_path, kind, "quick")
    try:
        # Acked: the worker is back in a long poll (5 s by default), idle.
        wait_until("the ack", lambda: all_done(serve.url), timeout_s=WAIT_S)
        rc, took = signal_and_time(p, signal.SIGINT)
    finally:
        stop_process(p, "worker", signal.SIGKILL)
    assert rc == 0 and took < 1.0, (rc, took)
    assert stats_of(out)["acked"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_signal_stops_without_draining(serve, tmp_path, kind):
    p, out, err = one_job_started(serve, tmp_path, kind, "block")
    try:
        p.send_signal(signal.SIGTERM)
        wait_until("the first signal to be taken", lambda: any("a second one" in l for l in read_lines(err)))
        assert p.poll() is None, "the first signal drains: the handler still runs"
        rc, took = signal_and_time(p, signal.SIGTERM)
    finally:
        stop_process(p, "worker", signal.SIGKILL)
    assert rc == 0 and took < 3.0, (rc, took)
    stats = stats_of(out)
    assert (stats["acked"], stats["failed"], stats["abandoned"]) == (0, 0, 1), stats
    if kind == "aio":
        assert "cancelled k-1 lost=True" in read_lines(out)
    t = serve.totals()
    assert t["in_flight"] + t["ready"] == 1, "an abandoned job is neither acked nor failed"


@pytest.mark.parametrize("kind", KINDS)
def test_the_drain_timeout_abandons_a_running_handler_and_sets_job_lost(serve, kind):
    Client([serve.url]).enqueue("k-1", "x")
    started, saw_lost = threading.Event(), threading.Event()

    def thread_handler(job: ClaimedJob) -> None:
        started.set()
        if job.lost.wait(WAIT_S):
            saw_lost.set()

    async def aio_handler(job: ClaimedJob) -> None:
        started.set()
        try:
            await asyncio.sleep(WAIT_S)
        except asyncio.CancelledError:
            if job.lost.is_set():
                saw_lost.set()
            raise

    r = Running(kind, [serve.url], thread_handler if kind == "thread" else aio_handler,
                concurrency=1, lease_ms=2000, wait_ms=200, drain_timeout_s=0.3)
    assert started.wait(WAIT_S)
    t0 = time.monotonic()
    r.stop()
    r.join()
    took = time.monotonic() - t0
    assert r.error is None, r.error
    assert saw_lost.wait(5), "the handler was not told its run was lost"
    assert took < 3.0 and r.stats.abandoned == 1 and r.stats.acked == 0, (took, r.stats)


# --------------------------------------------------------------- timeouts and dedup ids

def _rust_const(path: str, name: str) -> str:
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        m = re.search(rf"pub const {name}: \w+ = ([^;]+);", f.read())
    assert m, f"{name} not found in {path}"
    return m.group(1).replace("_", "")


def test_the_request_timeout_covers_the_longest_wait_of_the_server():
    limits = "crates/shardq-server/src/limits.rs"
    wait_max = int(_rust_const(limits, "WAIT_MS_MAX"))
    expr = _rust_const(limits, "REQUEST_TIMEOUT_MS")
    server_ms = eval(expr, {"WAITMSMAX": wait_max, "WAIT_MS_MAX": wait_max})  # e.g. "WAIT_MS_MAX + 60000"
    pause_ms = int(_rust_const("crates/shardq-core/src/producer.rs", "PAUSE_WAIT_MS_DEFAULT"))
    assert h.SERVER_WAIT_MAX_S * 1000 == server_ms >= pause_ms and server_ms >= wait_max
    assert h.REQUEST_TIMEOUT_S >= h.SERVER_WAIT_MAX_S + 1
    for make in (lambda: Client("http://127.0.0.1:1", timeout_s=10), lambda: Worker("http://127.0.0.1:1", timeout_s=10),
                 lambda: AsyncClient("http://127.0.0.1:1", timeout_s=10)):
        with pytest.raises(ConfigError, match="at least 90 s"):
            make()


def test_a_timed_out_enqueue_is_sent_again_with_the_same_ids_and_reported_stored(fakes):
    f = fakes("a")
    first = threading.Event()

    def slow_first(path: str, doc: Any) -> Any:
        # Stored, but the reply comes after the client stopped waiting.
        if path == "/v1/jobs" and not first.is_set():
            first.set()
            reply = f.enqueue(doc["jobs"])
            time.sleep(1.0)
            return reply
        return None

    f.intercept = slow_first
    c = Client([f.url, f.url], retry_rounds=3)
    c.timeout_s = 0.3  # as if the server took longer than the client's timeout
    jobs = [NewJob("k", "1"), NewJob("k", "2", dedup_id="order-2")]
    got = c.enqueue_many(jobs)
    bodies = [b for p, b in f.requests if p == "/v1/jobs"]
    assert len(bodies) == 2 and bodies[0] == bodies[1], "the retry must send the same dedup ids"
    assert len(f.jobs) == 2, "stored once"
    # The generated id found this call's own job: stored, not a duplicate.
    # A given id is the caller's: the server's word stands.
    assert [g.duplicate for g in got] == [False, True]
    assert jobs[0].dedup_id == bodies[0]["jobs"][0]["dedup_id"], "the generated id is kept on the job"
    again = c.enqueue_many(jobs)
    assert all(g.duplicate for g in again) and [g.id for g in again] == [g.id for g in got]
    assert len(f.jobs) == 2


def test_an_enqueue_answered_409_is_not_retried(fakes):
    # The server checks dedup ids in the backend, atomically with the
    # append: a 409 on an enqueue is a conflict retrying cannot cure.
    f = fakes("a")

    def conflict(path: str, doc: Any) -> Any:
        if path == "/v1/jobs":
            return 409, {"error": "conflict", "kind": "conflict"}
        return None

    f.intercept = conflict
    with pytest.raises(ShardqError):
        Client([f.url], retry_rounds=3).enqueue("k", "x")
    assert f.count("/v1/jobs") == 1, "refused at once"


# --------------------------------------------------------------- job timeouts and failure reasons

TIMEOUT_REASON = "timed out: the run passed its job timeout of 500 ms"


@pytest.mark.parametrize("kind", KINDS)
def test_a_hung_handler_is_failed_at_timeout_ms_and_its_keys_next_job_runs(serve, kind, caplog):
    # A handler that hangs (30 s, not watching job.lost) on a job with one
    # attempt, leases of 5 s extended every 1.7 s: only the job timeout
    # ends the run, at 500 ms, and the key's next job runs meanwhile.
    c = Client([serve.url])
    hung = c.enqueue("tenant-h", "hang", max_attempts=1)
    nxt = c.enqueue("tenant-h", "next")
    started: Dict[str, float] = {}
    ran: List[str] = []
    hung_job: List[ClaimedJob] = []
    release = threading.Event()
    cancelled: List[bool] = []

    def thread_handler(job: ClaimedJob) -> None:
        started.setdefault(job.payload.decode(), time.monotonic())
        if job.payload == b"hang":
            hung_job.append(job)
            release.wait(30)  # a thread cannot be stopped: it runs on
        ran.append(job.payload.decode())

    async def aio_handler(job: ClaimedJob) -> None:
        started.setdefault(job.payload.decode(), time.monotonic())
        if job.payload == b"hang":
            hung_job.append(job)
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(job.lost.is_set())
                raise
        ran.append(job.payload.decode())

    with caplog.at_level(logging.WARNING, logger="shardq"):
        r = Running(kind, [serve.url], thread_handler if kind == "thread" else aio_handler,
                    concurrency=2, lease_ms=5000, wait_ms=200, timeout_ms=500)
        try:
            wait_until("the key's next job to run", lambda: "next" in ran, timeout_s=15)
            took = time.monotonic() - started["hang"]
            assert took < 5.0, f"the key's next job started {took:.1f} s after the hung one"
            dead = c.job(hung.id)
            assert dead is not None and dead.state == "dead", dead
            assert dead.reason is not None and dead.reason.startswith(TIMEOUT_REASON), dead.reason
            assert dead.attempts == 1
            # The handler returned before its ack reached the server: wait
            # for the ack rather than read the job in between.
            wait_until("the key's next job to be acked", lambda: c.job(nxt.id) is None, timeout_s=10)
            if kind == "thread":
                # The run's job.lost was set at the timeout; the handler,
                # released, returns: its ack is refused, counted, logged,
                # and the worker runs on.
                assert hung_job[0].lost.wait(5), "job.lost was not set at the job timeout"
                assert ran == ["next"]
                release.set()
                wait_until("the late ack to be refused", lambda: r.w.stats.timed_out == 1, timeout_s=10)
            else:
                wait_until("the handler to be cancelled", lambda: bool(cancelled), timeout_s=5)
                assert cancelled == [True], "job.lost is set before the cancellation"
                assert ran == ["next"] and r.w.stats.timed_out == 1
            later = c.enqueue("tenant-h", "later")
            wait_until("a job after the timeout to run", lambda: "later" in ran and all_done(serve.url), timeout_s=15)
            assert c.job(later.id) is None
        finally:
            release.set()
            r.stop()
            r.join()
    assert r.error is None, r.error
    s = r.stats
    assert (s.acked, s.failed, s.lost, s.timed_out, s.unreported) == (2, 0, 0, 1, 0), s
    said = [rec.getMessage() for rec in caplog.records if "job timeout of 500 ms" in rec.getMessage()]
    assert said and all(hung.id in m for m in said), said
    assert serve.totals()["dead"] == 1


def _parse_invoice_total(payload: bytes, long: bool) -> int:
    text = payload.decode()
    if "total" not in text:
        why = "x" * 3000 if long else "the payload says nothing of it"
        raise ValueError(f"no total in invoice {text!r}: {why}")
    return 0


def _invoice_step(payload: bytes, depth: int, long: bool) -> int:
    if depth:
        return _invoice_step(payload, depth - 1, long)
    return _parse_invoice_total(payload, long)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_attempt_is_logged_with_its_traceback_which_its_reason_carries_bounded(serve, kind, caplog):
    # Two jobs of one attempt whose handler raises ValueError three helper
    # calls deep; the second's message (3 kB) makes the reason longer than
    # the bound: its head and the traceback's end are kept.
    c = Client([serve.url])
    short = c.enqueue("inv-1", "invoice 1", max_attempts=1)
    longer = c.enqueue("inv-2", "invoice 2", max_attempts=1)

    def handle(job: ClaimedJob) -> None:
        _invoice_step(job.payload, 3, job.key == "inv-2")

    with caplog.at_level(logging.WARNING, logger="shardq"):
        r = Running(kind, [serve.url], handle, concurrency=2, lease_ms=5000, wait_ms=200)
        try:
            wait_until("both dead letters", lambda: serve.totals()["dead"] == 2, timeout_s=15)
        finally:
            r.stop()
            r.join()
    assert r.error is None, r.error
    assert (r.stats.failed, r.stats.acked) == (2, 0), r.stats
    for enq, head in ((short, "ValueError: no total in invoice 'invoice 1': the payload says nothing of it\n"),
                      (longer, "ValueError: no total in invoice 'invoice 2': xxxx")):
        dead = c.job(enq.id)
        assert dead is not None and dead.state == "dead" and dead.reason is not None, dead
        reason = dead.reason
        assert reason.startswith(head), reason[:200]
        assert len(reason.encode("utf-8")) <= h.FAIL_REASON_BYTES_MAX, len(reason.encode("utf-8"))
        # The traceback's end, where the failing frame is, is kept.
        assert "in _parse_invoice_total\n" in reason and "in _invoice_step\n" in reason, reason
        assert reason.rstrip().endswith('raise ValueError(f"no total in invoice {text!r}: {why}")'), reason[-300:]
    long_reason = c.job(longer.id).reason  # type: ignore[union-attr]
    assert h.REASON_CUT_MARK in long_reason and len(long_reason.encode("utf-8")) > 900, long_reason
    logged = [rec for rec in caplog.records if rec.levelno == logging.WARNING and rec.exc_info
              and rec.exc_info[0] is ValueError]
    assert sorted(next(j for j in (short.id, longer.id) if j in rec.getMessage()) for rec in logged) \
        == sorted([short.id, longer.id]), [rec.getMessage() for rec in caplog.records]
    assert all("_parse_invoice_total" in logging.Formatter().format(rec) for rec in logged)


def test_a_failure_reason_is_cut_to_its_bound_on_a_character_boundary():
    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        raise RuntimeError("é€😀 " * 400)

    try:
        deep(5)
    except RuntimeError as e:
        error = e
    whole = h._failure_reason(error, 1 << 20)
    assert whole.startswith("RuntimeError: é€😀") and "in deep\n" in whole
    for bound in range(60, 1200, 7):
        got = h._failure_reason(error, bound)
        assert len(got.encode("utf-8")) <= bound, bound
        assert got.startswith("RuntimeError: é") and h.REASON_CUT_MARK in got, (bound, got)
        # The end of the traceback is kept: the failing frame's source line.
        assert whole.endswith(got.split(h.REASON_CUT_MARK, 1)[1]), bound
    # An error never raised has no traceback: its head line alone, cut.
    assert h._failure_reason(ValueError("ü" * 1000), 101).encode("utf-8") == ("ValueError: " + "ü" * 44).encode()
    assert h._failure_reason(ValueError("short")) == "ValueError: short"


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_timeout_ms_is_refused_naming_it(kind):
    url = "http://127.0.0.1:1"  # never reached: refused before any request
    for bad in (0, -1, h.JOB_TIMEOUT_MS_MAX + 1, 1.5, True, "500"):
        with pytest.raises(ConfigError, match=re.escape(f"invalid timeout_ms {bad!r}")):
            if kind == "thread":
                Worker(url).run(lambda job: None, install_signal_handlers=False, timeout_ms=bad)  # type: ignore[arg-type]
            else:
                asyncio.run(AsyncWorker(url).run(_noop, install_signal_handlers=False, timeout_ms=bad))  # type: ignore[arg-type]


async def _noop(job: ClaimedJob) -> None:
    return None


def test_the_job_timeout_and_reason_bounds_are_the_servers():
    job_rs = "crates/shardq-core/src/job.rs"
    assert h.JOB_TIMEOUT_MS_MIN == int(_rust_const(job_rs, "JOB_TIMEOUT_MS_MIN"))
    assert h.JOB_TIMEOUT_MS_MAX == eval(_rust_const(job_rs, "JOB_TIMEOUT_MS_MAX"), {})  # "7 * 24 * 3600 * 1000"
    # What the store keeps of a reason: sending more would lose the end.
    assert h.FAIL_REASON_BYTES_MAX == int(_rust_const(job_rs, "FAIL_REASON_BYTES_MAX"))
