"""Dependents (jobs enqueued with ``after``) through the clients, against a
real ``shardq serve`` that owns every shard (so it runs the resolver that
releases them) and an in-process worker: a fan-in whose handler reads its
dependencies' results with ``Client.dependent``, a graph by indexes in one
request, the policies under a dead dependency (``result("@N")`` raises
``JobDied``), cancels, the checks made before anything is sent (a cycle,
a batch over the client's limit) and the server's refusal of an unknown
id. Stand-in servers show that a request with ``after``, which carries no
dedup ids, is not sent again once an attempt may have stored it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List

import pytest

from shardq import (
    AsyncClient,
    BadRequest,
    ClaimedJob,
    Client,
    ConfigError,
    InvalidJob,
    JobDied,
    NewJob,
    ResultTimeout,
    ServerUnavailable,
    Worker,
)

from support import WAIT_S

Handler = Callable[[ClaimedJob], Any]


@contextmanager
def worker(url: str, handler: Handler) -> Iterator[Worker]:
    """A threaded :class:`Worker` running ``handler`` until the block ends."""
    w = Worker([url], worker_id="dependents-test")
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


class FanIn:
    """A handler: a plain job, or a graph's root (a dependent with no
    dependencies), returns ``r-KEY``; a released dependent reads its
    dependencies with ``client.dependent(job.dependent)`` and returns their
    results, joined in the order named (``<OUTCOME>`` for one without)."""

    def __init__(self, url: str) -> None:
        self.client = Client([url])
        self.lock = threading.Lock()
        self.seen: Dict[str, Any] = {}

    def __call__(self, job: ClaimedJob) -> Any:
        if job.dependent is None:
            return f"r-{job.key}"
        info = self.client.dependent(job.dependent)
        assert info is not None and info.state == "released" and info.released == job.id, info
        with self.lock:
            self.seen[job.dependent] = info
        if not info.after:
            return f"r-{job.key}"
        return "+".join(d.result_text or f"<{d.outcome}>" for d in info.after)


def test_fan_in_over_ids_gets_every_result_through_dependent(serve):
    c = Client([serve.url])
    keys = ["tenant-a", "tenant-b", "tenant-c"]
    children = c.enqueue_many([NewJob(k, json.dumps({"k": k})) for k in keys])
    assert all(not p.waiting and p.shard for p in children)
    fan = c.enqueue("reports", b"merge", after=[p.id for p in children])
    assert fan.id.startswith("@") and fan.shard == "" and fan.waiting and fan.key == "reports", fan
    info = c.dependent(fan.id)
    assert info is not None and info.state == "waiting" and info.released is None, info
    assert [d.id for d in info.after] == [p.id for p in children]
    assert all(d.outcome is None for d in info.after)
    assert info.payload == b"merge" and info.on_dependency_failure == "fail"
    # Nothing runs it while its dependencies wait.
    with pytest.raises(ResultTimeout) as waited:
        c.result(fan.id, timeout=0.3)
    assert waited.value.state == "waiting"

    handler = FanIn(serve.url)
    with worker(serve.url, handler):
        done = c.result(fan.id, timeout=WAIT_S)
    assert done.outcome == "completed" and done.result_text == "r-tenant-a+r-tenant-b+r-tenant-c", done
    seen = handler.seen[fan.id]
    assert [(d.id, d.outcome, d.result) for d in seen.after] == [
        (p.id, "completed", f"r-{p.key}".encode()) for p in children
    ]
    after = c.dependent(fan.id)
    assert after is not None and after.state == "released" and after.released == done.id
    assert after.ended_ms is not None and after.ended_ms >= after.created_ms
    assert c.finished(after.released or "") is not None


def test_a_graph_by_indexes_goes_in_one_request_and_runs_in_order(serve):
    c = Client([serve.url])
    placed = c.enqueue_graph([
        NewJob("g-a", "a"),
        NewJob("g-b", "b"),
        NewJob("g-c", "c", after=[0, 1]),
        {"key": "g-d", "payload": "d", "after": [2]},
    ])
    assert [p.key for p in placed] == ["g-a", "g-b", "g-c", "g-d"]
    assert all(p.id.startswith("@") and p.shard == "" and p.waiting and p.dedup_id == "" for p in placed), placed
    ids = [p.id for p in placed]
    handler = FanIn(serve.url)
    with worker(serve.url, handler):
        last = c.result(ids[3], timeout=WAIT_S)
    assert last.result_text == "r-g-a+r-g-b", last
    c_info = handler.seen[ids[2]]
    # An index names the other job's @N; where it ran is its released job.
    assert [d.id for d in c_info.after] == ids[:2]
    assert all(d.at and not d.at.startswith("@") for d in c_info.after), c_info.after
    assert c.dependent(ids[0]).state == "released"  # type: ignore[union-attr]


def test_a_dead_dependency_fails_its_dependent_under_fail_and_not_under_run(serve):
    c = Client([serve.url])
    placed = c.enqueue_graph([
        NewJob("d-x", "boom", max_attempts=1),
        NewJob("d-fail", "never", after=[0]),
        NewJob("d-run", "anyway", after=[0], on_dependency_failure="run"),
        NewJob("d-ignore", "without", after=[0], on_dependency_failure="ignore"),
    ])
    x, failing, running, ignoring = (p.id for p in placed)
    ran: List[str] = []

    def handler(job: ClaimedJob) -> Any:
        ran.append(job.key)
        if job.payload == b"boom":
            raise RuntimeError("the export broke")
        return fan(job)

    fan = FanIn(serve.url)
    with worker(serve.url, handler):
        with pytest.raises(JobDied) as died:
            c.result(failing, timeout=WAIT_S)
        assert c.result(running, timeout=WAIT_S).result_text == "<dead>"
        assert c.result(ignoring, timeout=WAIT_S).outcome == "completed"
    assert died.value.id == failing and died.value.dependent_state == "failed"
    assert x in (died.value.reason or ""), died.value.reason
    assert "d-fail" not in ran, ran
    with pytest.raises(JobDied):
        c.result(x, timeout=1)
    info = c.dependent(failing)
    assert info is not None and info.state == "failed" and info.released is None and x in (info.reason or "")
    (dep,) = info.after
    assert dep.id == x and dep.outcome == "dead" and dep.result is None and "the export broke" in (dep.reason or "")
    assert fan.seen[running].after[0].outcome == "dead"


def test_cancel_a_waiting_dependent_then_again(serve):
    c = Client([serve.url])
    hold = c.enqueue("c-hold", "later", delay_ms=600_000)
    dep = c.enqueue("c-dep", "never", after=[hold.id])
    assert c.cancel(dep.id) is True
    assert c.cancel(dep.id) is False  # ended (cancelled): not cancelled again
    with pytest.raises(JobDied) as died:
        c.result(dep.id, timeout=1)
    assert died.value.dependent_state == "cancelled"
    info = c.dependent(dep.id)
    assert info is not None and info.state == "cancelled"


def test_bad_input_is_refused_naming_it(serve, fakes):
    c = Client([serve.url])
    missing = "shard-0:987654"
    with pytest.raises(BadRequest) as refused:
        c.enqueue("b-key", "x", after=[missing])
    assert refused.value.status == 400 and missing in str(refused.value), refused.value
    with pytest.raises(BadRequest) as refused:
        c.enqueue("b-key", "x", after=["@987654"])
    assert "@987654" in str(refused.value)
    assert c.dependent("@987654") is None
    with pytest.raises(ConfigError, match="'shard-0:1'"):
        c.dependent("shard-0:1")

    # Refused before anything is sent: a stand-in server sees no request.
    f = fakes("nothing-sent")
    local = Client([f.url], batch_max=3)
    with pytest.raises(InvalidJob) as cycle:
        local.enqueue_graph([
            NewJob("n-0", "0"),
            NewJob("n-1", "1", after=[0, 3]),
            NewJob("n-2", "2", after=[1]),
            NewJob("n-3", "3", after=[2]),
        ])
    message = str(cycle.value)
    assert "cycle" in message and "1 (key 'n-1') -> 3 (key 'n-3') -> 2 (key 'n-2') -> 1 (key 'n-1')" in message, message
    with pytest.raises(InvalidJob, match=r"4 jobs, over this client's batch_max of 3"):
        local.enqueue_many([NewJob(f"m-{i}", "x", after=[i - 1] if i else None) for i in range(4)])
    for bad, says in [
        (NewJob("s", "x", after=[0]), "its own index"),
        (NewJob("s", "x", after=[5]), "not an index"),
        (NewJob("s", "x", after="shard-0:1"), "one id goes in a list"),
        (NewJob("s", "x", after=[True]), r"invalid after\[0\] True"),
        (NewJob("s", "x", after=["@1", "@1"]), "named twice"),
        (NewJob("s", "x", after=["@1"], on_dependency_failure="skip"), "invalid on_dependency_failure 'skip'"),
        (NewJob("s", "x", on_dependency_failure="run"), "without after"),
        (NewJob("s", "x", after=["@1"], dedup_id="d-1"), "takes no dedup_id 'd-1'"),
    ]:
        with pytest.raises(InvalidJob, match=says):
            local.enqueue_many([bad])
    with pytest.raises(InvalidJob, match="none of the 1 jobs has after"):
        local.enqueue_graph([NewJob("s", "x")])
    assert f.requests == []


def test_a_request_with_after_is_not_sent_again_once_it_may_have_been_stored(fakes):
    with socket.socket() as s:  # a port with nothing listening: the connection is refused
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"
    busy, broken, spare = fakes("busy"), fakes("broken"), fakes("spare")
    busy.answers["/v1/jobs"] = (429, {"error": "slow down"})
    broken.answers["/v1/jobs"] = (503, {"error": "the store is unavailable"})
    c = Client([refused, busy.url, broken.url, spare.url])
    with pytest.raises(ServerUnavailable, match="not sent again") as gave_up:
        c.enqueue_graph([NewJob("r-a", "a"), NewJob("r-b", "b", after=[0])])
    assert any("503" in cause for cause in gave_up.value.causes), gave_up.value.causes
    # Refused and 429: surely not stored, so tried on; the 503 may have stored it.
    assert [len(f.requests) for f in (busy, broken, spare)] == [1, 1, 0]
    (path, body), = broken.requests
    assert path == "/v1/jobs" and body == {"jobs": [{"key": "r-a", "payload": "a"},
                                                    {"key": "r-b", "payload": "b", "after": [0]}]}


def test_async_client_graph_dependent_and_result(serve):
    handler = FanIn(serve.url)

    async def main() -> None:
        async with AsyncClient([serve.url]) as c:
            placed = await c.enqueue_graph([NewJob("as-a", "a"), NewJob("as-b", "b", after=[0])])
            one = await c.enqueue("as-c", "c", after=[placed[1].id], on_dependency_failure="ignore")
            assert one.waiting and one.id.startswith("@")
            info = await c.dependent(one.id)
            assert info is not None and info.on_dependency_failure == "ignore" and info.state == "waiting"
            done = await c.result(one.id, timeout=WAIT_S)
            assert done.result_text == "r-as-a", done
            assert await c.cancel(one.id) is False  # its job finished

    with worker(serve.url, handler):
        asyncio.run(main())


def test_the_readme_example_runs(serve):
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
    with open(readme, encoding="utf-8") as f:
        section = f.read().split("## Dependents", 1)[1]
    block = re.search(r"^```py\n(.*?)^```", section, re.M | re.S)
    assert block is not None, "the README's dependents section has a py block"
    ns: Dict[str, Any] = {"client": Client([serve.url])}
    # Its handler is defined by the block before it enqueues anything.
    with worker(serve.url, lambda job: ns["handler"](job)):
        exec(compile(block.group(1), "README.md (dependents)", "exec"), ns)
        last = ns["client"].result(ns["placed"][3].id, timeout=WAIT_S)
    assert ns["done"].result_text == "exported+exported"
    assert last.outcome == "completed" and last.result_text == "exported+exported", last
