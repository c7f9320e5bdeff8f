"""Batches (jobs on any keys under one id, with callbacks run once) through
the clients, against a real ``shardq serve`` that owns every shard (so it
runs the resolver that releases the batch's jobs and fires its callbacks)
and an in-process worker: jobs over several keys sent twice with their
dedup ids (stored once), run while the batch is open without a callback,
then the batch closed and its complete and success callbacks claimed once
each; a handler adding to its own closed batch; dead jobs firing the death
callback once and never the success one; bad input refused naming the
field, the client's own checks before any request; an open retried on
another server with the same dedup id; the README's batches block."""

from __future__ import annotations

import asyncio
import os
import re
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from shardq import (
    AsyncClient,
    BadRequest,
    BatchInfo,
    ClaimedJob,
    Client,
    ConfigError,
    HttpError,
    InvalidJob,
    NewJob,
    Worker,
)

from support import WAIT_S, wait_until

Handler = Callable[[ClaimedJob], Any]


@contextmanager
def worker(url: str, handler: Handler) -> Iterator[Worker]:
    """A threaded :class:`Worker` running ``handler`` until the block ends."""
    w = Worker([url], worker_id="batches-test")
    t = threading.Thread(target=w.run, args=(handler,),
                         kwargs=dict(concurrency=4, lease_ms=5000, wait_ms=200, install_signal_handlers=False),
                         daemon=True)
    t.start()
    try:
        yield w
    finally:
        w.stop()
        t.join(WAIT_S)
    assert not t.is_alive(), "Worker.run did not return after stop()"


class Recorder:
    """A handler that records every job it runs (thread-safe): ``boom``
    raises, any other payload returns ``r-PAYLOAD``; ``fan`` first adds a
    job to its own batch."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.lock = threading.Lock()
        self.jobs: List[ClaimedJob] = []

    def __call__(self, job: ClaimedJob) -> Any:
        with self.lock:
            self.jobs.append(job)
        text = job.payload.decode()
        if text == "boom":
            raise RuntimeError("the export broke")
        if text == "fan" and job.batch is not None:
            added = self.client.enqueue("fan-child", "child", batch=job.batch, dedup_id=f"child-of-{job.id}")
            assert added.batch == job.batch and added.waiting, added
        return f"r-{text}"

    def callbacks(self, batch: str) -> List[ClaimedJob]:
        with self.lock:
            return [j for j in self.jobs if j.batch == batch and j.batch_callback is not None]

    def ran(self, batch: str) -> List[ClaimedJob]:
        with self.lock:
            return [j for j in self.jobs if j.batch == batch and j.batch_callback is None]


def shown(c: Client, batch: str) -> BatchInfo:
    info = c.batch(batch)
    assert info is not None, f"batch {batch} unknown"
    return info


def complete_with(c: Client, rec: Recorder, batch: str, kinds: int) -> Callable[[], bool]:
    """Whether ``batch`` is complete and ``kinds`` callbacks of it ran."""
    return lambda: shown(c, batch).state == "complete" and len(rec.callbacks(batch)) >= kinds


def after_a_resolver_pass(c: Client, rec: Recorder, tag: str) -> None:
    """Returns once a resolver pass that started after this call released a
    job: a probe batch's job, run by ``rec``'s worker. A callback due
    twice would have been enqueued by then (and any later pass finds the
    batch complete)."""
    probe = c.open_batch(f"probe-cb-{tag}", on_complete="probe-done")
    c.enqueue(f"probe-{tag}", "probe", batch=probe)
    wait_until(f"the probe job of {probe} to run", lambda: len(rec.ran(probe)) == 1, timeout_s=WAIT_S)


def test_a_batch_over_keys_fires_complete_and_success_once_each(serve):
    c = Client([serve.url])
    b = c.open_batch("b-cb", on_complete="done", on_success=b"all-ok", on_death="died", dedup_id="nightly")
    assert re.fullmatch(r"@\d+", b), b
    assert c.open_batch("b-cb", on_complete="done", on_success="all-ok", dedup_id="nightly") == b

    def jobs() -> List[NewJob]:
        return [NewJob(f"b-k{i % 3}", f"p{i}", dedup_id=f"d{i}", batch=b) for i in range(6)]

    placed = c.enqueue_many(jobs())
    assert [p.key for p in placed] == [f"b-k{i % 3}" for i in range(6)]
    assert all(re.fullmatch(r"@\d+", p.id) and p.shard == "" and p.waiting and p.batch == b and not p.duplicate
               for p in placed), placed
    assert len({p.id for p in placed}) == 6 and b not in {p.id for p in placed}
    again = c.enqueue_many(jobs())
    assert [(p.id, p.duplicate) for p in again] == [(p.id, True) for p in placed]
    # One more without a dedup id of its own: the generated one, kept on the
    # NewJob, makes the resend a duplicate too.
    one = NewJob("b-k9", "p6", batch=b)
    first = c.enqueue_many([one])[0]
    assert one.dedup_id and first.dedup_id == one.dedup_id and not first.duplicate
    resent = c.enqueue_many([one])[0]
    assert (resent.id, resent.duplicate) == (first.id, True)
    assert c.enqueue("b-k9", "p6", batch=b, dedup_id=one.dedup_id).id == first.id

    info = shown(c, b)
    assert info.id == b and info.key == "b-cb" and info.state == "open", info
    assert info.counts.jobs == 7 and info.counts.pending == 7, info.counts
    assert [j.id for j in info.jobs] == [p.id for p in placed] + [first.id]
    assert set(info.callbacks) == {"complete", "success", "death"}
    assert {k: (cb.kind, cb.payload, cb.fired) for k, cb in info.callbacks.items()} == {
        "complete": ("complete", b"done", None), "success": ("success", b"all-ok", None),
        "death": ("death", b"died", None)}
    assert info.closed_ms is None and info.ended_ms is None and info.created_ms > 0

    rec = Recorder(c)
    with worker(serve.url, rec):
        # Open: every job runs (on its own key), no callback fires.
        wait_until(f"the 7 jobs of {b} to complete", lambda: shown(c, b).counts.completed == 7, timeout_s=WAIT_S)
        after_a_resolver_pass(c, rec, "open")
        assert rec.callbacks(b) == [], rec.callbacks(b)
        ran = rec.ran(b)
        assert sorted(j.payload for j in ran) == sorted(f"p{i}".encode() for i in range(7)), ran
        assert {j.dependent for j in ran} == {j.id for j in info.jobs}  # a job of a batch is its @M's job
        assert shown(c, b).state == "open"

        assert c.close_batch(b) is True
        assert c.close_batch(b) is False  # closed already
        wait_until(f"{b} to complete with 2 callbacks run", complete_with(c, rec, b, 2), timeout_s=WAIT_S)
        after_a_resolver_pass(c, rec, "closed")
        after_a_resolver_pass(c, rec, "again")
        cbs = rec.callbacks(b)
    assert sorted((j.batch_callback, j.payload, j.key, j.batch) for j in cbs) == [
        ("complete", b"done", "b-cb", b), ("success", b"all-ok", "b-cb", b)], cbs
    done = shown(c, b)
    assert done.state == "complete", done
    assert (done.counts.jobs, done.counts.pending, done.counts.completed, done.counts.dead, done.counts.other) == \
        (7, 0, 7, 0, 0)
    fired = {k: cb.fired for k, cb in done.callbacks.items()}
    assert fired == {"complete": next(j.id for j in cbs if j.batch_callback == "complete"),
                     "success": next(j.id for j in cbs if j.batch_callback == "success"), "death": None}, fired
    assert [(j.outcome, j.result_text) for j in done.jobs] == [("completed", f"r-p{i}") for i in range(7)]
    assert all(j.at and not j.at.startswith("@") for j in done.jobs), done.jobs
    assert done.closed_ms is not None and done.ended_ms is not None and done.ended_ms >= done.closed_ms
    assert c.finished(fired["complete"] or "") is not None
    # A complete batch takes no job.
    with pytest.raises(BadRequest) as late:
        c.enqueue("b-k0", "late", batch=b)
    assert b in str(late.value), late.value


def test_a_job_of_a_closed_batch_adds_to_it_and_holds_back_complete(serve):
    c = Client([serve.url])
    b = c.open_batch("fan-cb", on_complete="fan-done", on_success="fan-ok")
    c.enqueue("fan-parent", "fan", batch=b)
    assert c.close_batch(b) is True
    rec = Recorder(c)
    with worker(serve.url, rec):
        wait_until(f"{b} to complete with 2 callbacks run", complete_with(c, rec, b, 2), timeout_s=WAIT_S)
        after_a_resolver_pass(c, rec, "fan")
        cbs = rec.callbacks(b)
    assert sorted(j.batch_callback or "" for j in cbs) == ["complete", "success"], cbs
    info = shown(c, b)
    assert info.counts.jobs == 2 and info.counts.completed == 2, info.counts
    assert [j.result_text for j in info.jobs] == ["r-fan", "r-child"]
    # The child ran before the callbacks: complete waited for it.
    order = [j.batch_callback or j.key for j in rec.jobs if j.batch == b]
    assert order.index("fan-child") < order.index("complete"), order


def test_dead_jobs_fire_death_once_and_never_success(serve):
    c = Client([serve.url])
    b = c.open_batch("d-cb", on_complete="d-done", on_success="d-ok", on_death="d-died", max_attempts=2)
    placed = c.enqueue_many([NewJob("d-a", "fine", batch=b), NewJob("d-x", "boom", max_attempts=1, batch=b),
                             NewJob("d-b", "fine", batch=b), NewJob("d-y", "boom", max_attempts=1, batch=b)])
    assert c.close_batch(b) is True
    rec = Recorder(c)
    with worker(serve.url, rec):
        wait_until(f"{b} to complete with 2 callbacks run", complete_with(c, rec, b, 2), timeout_s=WAIT_S)
        after_a_resolver_pass(c, rec, "dead")
        after_a_resolver_pass(c, rec, "dead-again")
        cbs = rec.callbacks(b)
    assert sorted((j.batch_callback, j.payload, j.max_attempts) for j in cbs) == [
        ("complete", b"d-done", 2), ("death", b"d-died", 2)], cbs
    info = shown(c, b)
    assert info.state == "complete" and info.callbacks["success"].fired is None, info
    assert (info.counts.completed, info.counts.dead, info.counts.other, info.counts.pending) == (2, 2, 0, 0)
    by_id = {j.id: j for j in info.jobs}
    for p in placed:
        j = by_id[p.id]
        if p.key in ("d-x", "d-y"):
            assert j.outcome == "dead" and j.result is None and "the export broke" in (j.reason or ""), j
        else:
            assert j.outcome == "completed" and j.result_text == "r-fine", j


def test_bad_input_is_refused_naming_it(serve, fakes):
    c = Client([serve.url])
    b = c.open_batch("x-cb", on_death="x")
    # The server's refusals name the field and the value.
    with pytest.raises(BadRequest, match="dedup_id"):
        c.open_batch("x-cb", on_complete="x", dedup_id="bad\x01id")
    with pytest.raises(BadRequest, match="key"):
        c.open_batch("k" * 2000, on_complete="x")
    with pytest.raises(BadRequest, match="max attempts 5000"):
        c.open_batch("x-cb", on_complete="x", max_attempts=5000)
    for unknown in ("@987654",):
        assert c.batch(unknown) is None
        with pytest.raises(HttpError, match=unknown) as closed:
            c.close_batch(unknown)
        assert closed.value.status == 404, closed.value
        with pytest.raises(BadRequest, match=unknown):
            c.enqueue("x-k", "x", batch=unknown)
    with pytest.raises(BadRequest, match="dedup_id"):
        c.enqueue("x-k", "x", batch=b, dedup_id=f"batch:{b}:death")
    with pytest.raises(BadRequest, match="payload"):
        c.enqueue("x-k", b"x" * (64 * 1024 + 1), batch=b)
    assert shown(c, b).counts.jobs == 0

    # Refused before anything is sent: a stand-in server sees no request.
    f = fakes("nothing-sent")
    local = Client([f.url])
    for call, says in [
        (lambda: local.open_batch("cb"), "no callbacks: at least one of on_complete, on_success, on_death"),
        (lambda: local.open_batch("", on_complete="x"), "invalid key ''"),
        (lambda: local.open_batch("cb", on_complete=b"\xff"), "invalid on_complete"),
        (lambda: local.open_batch("cb", on_death="x", max_attempts=0), "invalid max_attempts 0"),
        (lambda: local.open_batch("cb", on_death="x", dedup_id=""), "invalid dedup_id ''"),
        (lambda: local.batch("7"), "invalid batch id '7'"),
        (lambda: local.batch("shard-0:1"), "invalid batch id 'shard-0:1'"),
        (lambda: local.close_batch("@"), "invalid batch id '@'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            call()
    for jobs, says in [
        ([NewJob("s", "x", batch="7")], "invalid batch '7'"),
        ([NewJob("s", "x", batch="@1"), NewJob("t", "y")], "job 1 (key 't'): batch None where the jobs of this "
                                                           "call join '@1'"),
        ([NewJob("s", "x", batch="@1"), {"key": "t", "payload": "y", "batch": "@2"}], "batch '@2' where"),
        ([NewJob("s", "x"), NewJob("t", "y", batch="@1")], "job 0 (key 's'): batch None where the jobs of this "
                                                           "call join '@1'"),
        ([NewJob("s", "x", batch="@1", after=["@2"])], "takes no after ['@2']"),
        ([NewJob("s", "x", batch="@1", unique_id="u")], "takes no unique_id 'u'"),
        ([NewJob("s", "x", batch="@1", debounce_id="d", debounce_ms=5)], "takes no debounce_id 'd', debounce_ms 5"),
    ]:
        with pytest.raises(InvalidJob, match=re.escape(says)):
            local.enqueue_many(jobs)
    assert f.requests == []


def test_an_open_is_retried_elsewhere_with_the_same_dedup_id(fakes):
    broken, spare = fakes("broken"), fakes("spare")
    broken.answers["/v1/batches"] = (503, {"error": "the store is unavailable"})
    spare.answers["/v1/batches"] = (200, {"id": "@5", "duplicate": True})
    c = Client([broken.url, spare.url])
    assert c.open_batch("cb", on_complete="done") == "@5"
    (_, sent), = broken.requests
    (_, resent), = spare.requests
    assert sent == resent and sent["key"] == "cb" and sent["on_complete"] == "done", (sent, resent)
    assert sent["dedup_id"].startswith("batch-"), sent
    # A close changes nothing twice: retried the same way.
    broken.answers["/v1/batches/@5/close"] = (503, {"error": "the store is unavailable"})
    spare.answers["/v1/batches/@5/close"] = (200, {"id": "@5", "closed": False})
    assert c.close_batch("@5") is False
    assert [p for p, _ in spare.requests] == ["/v1/batches", "/v1/batches/@5/close"]


def test_async_client_opens_adds_closes_and_shows(serve):
    rec = Recorder(Client([serve.url]))

    async def main() -> Optional[BatchInfo]:
        async with AsyncClient([serve.url]) as c:
            b = await c.open_batch("as-cb", on_complete="as-done", dedup_id="as-1")
            assert await c.open_batch("as-cb", on_complete="as-done", dedup_id="as-1") == b
            jobs = [NewJob(f"as-{i}", f"a{i}", dedup_id=f"a{i}", batch=b) for i in range(3)]
            placed = await c.enqueue_many(jobs)
            assert all(p.batch == b and p.waiting for p in placed)
            again = await c.enqueue("as-0", "a0", dedup_id="a0", batch=b)
            assert again.duplicate and again.id == placed[0].id
            with pytest.raises(ConfigError):
                await c.batch("nope")
            assert await c.batch("@987654") is None
            info = await c.batch(b)
            assert info is not None and info.state == "open" and info.counts.jobs == 3
            assert await c.close_batch(b) is True
            assert await c.close_batch(b) is False

            async def complete() -> BatchInfo:
                while True:
                    got = await c.batch(b)
                    assert got is not None
                    if got.state == "complete" and rec.callbacks(b):
                        return got
                    await asyncio.sleep(0.02)

            return await asyncio.wait_for(complete(), WAIT_S)

    with worker(serve.url, rec):
        info = asyncio.run(main())
    assert info is not None and info.counts.completed == 3, info
    assert [j.batch_callback for j in rec.callbacks(info.id)] == ["complete"]
    assert info.callbacks["complete"].fired == rec.callbacks(info.id)[0].id


def test_the_readme_example_runs(serve):
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
    with open(readme, encoding="utf-8") as f:
        section = f.read().split("## Batches", 1)[1]
    block = re.search(r"^```py\n(.*?)^```", section, re.M | re.S)
    assert block is not None, "the README's batches section has a py block"
    c = Client([serve.url])
    ns: Dict[str, Any] = {"client": c}
    # Its handler is defined by the block before it enqueues anything.
    with worker(serve.url, lambda job: ns["handler"](job)):
        exec(compile(block.group(1), "README.md (batches)", "exec"), ns)
        batch = ns["batch"]

        def summarised() -> bool:
            fired = shown(c, batch).callbacks["complete"].fired
            return fired is not None and c.finished(fired) is not None

        wait_until(f"the complete callback of {batch} to run", summarised, timeout_s=WAIT_S)
    info = shown(c, batch)
    assert info.state == "complete" and info.counts.completed == 2, info
    assert info.callbacks["death"].fired is None
    summary = c.finished(info.callbacks["complete"].fired or "")
    assert summary is not None and summary.result_text == "2 of 2 exported", summary
