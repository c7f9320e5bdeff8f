"""Flow control through both clients against a real ``shardq serve``: groups
and policies set, read back with where they come from, refused with a
message naming the bad value, a used group kept; and a handler's
:class:`shardq.BackOff`, which runs its job again after the wait on the
same attempt (never a dead letter), holds its whole group when asked, while
a key's rate limit spaces its starts; and an operator's resume of a key's or
a group's back-off, after which the held jobs run at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Dict, List, Tuple, Union

import pytest

from shardq import (
    AsyncClient,
    BackOff,
    BadRequest,
    ClaimedJob,
    Client,
    ConfigError,
    FlowPolicy,
    GroupInfo,
    KeyHold,
    NewJob,
    PolicyInfo,
)

from support import all_done, totals_of, wait_until
from test_worker_serve import KINDS, Running

#: How long a changed setting may take to reach the server's claims (its
#: FLOW_RECHECK_MS, 1 s), with a margin.
SETTINGS_REACH_S = 1.2


class _Blocking:
    """An :class:`AsyncClient` called like a :class:`Client`, each call
    run to its end on one event loop of its own."""

    def __init__(self, urls: Union[str, List[str]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.c = AsyncClient(urls)

    def __getattr__(self, name: str) -> Any:
        f = getattr(self.c, name)
        return lambda *a, **kw: self.loop.run_until_complete(f(*a, **kw))

    def close(self) -> None:
        self.loop.run_until_complete(self.c.close())
        self.loop.close()


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_groups_and_policies_are_set_read_back_with_their_source_refused_and_cleared(serve, kind):
    c: Any = Client([serve.url]) if kind == "sync" else _Blocking(serve.url)
    try:
        s = c.policies()
        assert (s.default, s.prefixes, s.keys, s.groups) == (FlowPolicy(), {}, {}, {}), s
        assert c.group("api") is None and c.groups() == {}

        assert c.set_group("api", "20/s", burst=3) == GroupInfo("20/s", 3)
        assert c.set_group("bulk", "600/m") == GroupInfo("600/m", 10), "the burst defaults to a second of the rate"
        assert c.set_group("db", concurrency=4) == GroupInfo(None, None, 4), "runs at once, no rate"
        assert c.set_group("db", "5/s", concurrency=2) == GroupInfo("5/s", 5, 2)
        assert c.clear_group("db") is True
        stored = c.set_policy(prefix="free:", rate="10/s", group="api", weight=2)
        assert stored == FlowPolicy(rate="10/s", burst=10, weight=2, group="api"), stored
        # A key that needs percent-encoding in the path.
        odd = "vip/1 ü?x"
        assert c.set_policy(odd, priority=5) == FlowPolicy(priority=5)

        assert c.policy("free:42") == PolicyInfo(key="free:42", policy=stored, source="prefix", prefix="free:")
        assert c.policy(odd) == PolicyInfo(key=odd, policy=FlowPolicy(priority=5), source="key", prefix=None)
        assert c.policy("other").source == "default"
        assert c.policy("free:", scope="prefix") == PolicyInfo(key="free:", policy=stored, source="prefix",
                                                              prefix="free:")
        assert c.policy("paid:", scope="prefix") is None, "a prefix without a policy"
        assert c.policy(scope="default").policy == FlowPolicy()
        s = c.policies()
        assert s.prefixes == {"free:": stored} and s.keys == {odd: FlowPolicy(priority=5)}
        assert s.groups == {"api": GroupInfo("20/s", 3), "bulk": GroupInfo("600/m", 10)}
        assert c.group("api") == GroupInfo("20/s", 3)

        # Bad values: 400, the message names the value; nothing is stored.
        for call, named in [
            (lambda: c.set_policy("k", rate="0/s"), "0/s"),
            (lambda: c.set_policy("k", rate="5/fortnight"), "fortnight"),
            (lambda: c.set_policy("k", group="no-such-group"), "no-such-group"),
            (lambda: c.set_policy("k", weight=0), "weight"),
            (lambda: c.set_group("g", "0/s"), "0/s"),
            (lambda: c.set_group("g", concurrency=0), "concurrency"),
            (lambda: c.set_group("g", concurrency=10_001), "10001"),
        ]:
            with pytest.raises(BadRequest) as e:
                call()
            assert e.value.status == 400 and named in e.value.error, e.value
        assert c.policy("k").source == "default" and c.group("g") is None
        # A group a policy names stays; the refusal names the policy.
        with pytest.raises(BadRequest) as e:
            c.clear_group("api")
        assert "free:" in e.value.error, e.value
        assert c.group("api") == GroupInfo("20/s", 3)

        # The default, set and put back.
        assert c.set_policy(default=True, weight=3).weight == 3
        assert c.policy("other") == PolicyInfo(key="other", policy=FlowPolicy(weight=3), source="default",
                                               prefix=None)
        assert c.clear_policy(default=True) is True
        assert c.policy(scope="default").policy == FlowPolicy()

        assert c.clear_policy(prefix="free:") is True and c.clear_policy(prefix="free:") is False
        assert c.clear_policy(odd) is True
        assert c.clear_group("api") is True and c.clear_group("api") is False
        assert c.policies().groups == {"bulk": GroupInfo("600/m", 10)}
        assert c.policy("free:42").source == "default"

        # Exactly one target, checked before any request.
        for bad in (lambda: c.set_policy(), lambda: c.set_policy("k", prefix="p"),
                    lambda: c.clear_policy(prefix="p", default=True), lambda: c.policy("k", scope="everything"),
                    lambda: c.set_group("", "1/s"), lambda: c.set_group("g"),
                    lambda: c.set_group("g", concurrency="2")):
            with pytest.raises(ConfigError):
                bad()
    finally:
        c.close()


def test_back_off_checks_its_wait():
    assert (BackOff(0).ms, BackOff(86_400_000, group=True).group) == (0, True)
    for bad in (-1, 86_400_001, 1.5, True, "600"):
        with pytest.raises(ConfigError):
            BackOff(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", KINDS)
def test_a_handler_backing_off_runs_its_job_again_after_the_wait_on_the_same_attempt(serve, kind):
    placed = Client([serve.url]).enqueue("bo", "x", max_attempts=1)
    runs: List[Tuple[int, float]] = []

    def on_job(job: ClaimedJob) -> None:
        runs.append((job.attempt, time.monotonic()))
        if len(runs) == 1:
            raise BackOff(600)

    r = Running(kind, [serve.url], on_job, lease_ms=5000, wait_ms=200)
    try:
        wait_until("the job to run again and be acked", lambda: len(runs) == 2 and all_done(serve.url), timeout_s=15)
    finally:
        r.stop()
        r.join()
    assert r.error is None, r.error
    (first, t1), (second, t2) = runs
    assert first == second == 1, "a back-off uses no attempt"
    assert t2 - t1 >= 0.58, f"ran again {t2 - t1:.3f} s later, before the 600 ms back-off"
    stats = r.stats
    assert (stats.backed_off, stats.failed, stats.acked) == (1, 0, 1), stats
    assert totals_of(serve.url)["dead"] == 0
    assert [f.id for f in Client([serve.url]).key_finished("bo")] == [placed.id]


def test_a_group_back_off_holds_every_key_of_the_group_and_a_rate_spaces_a_key(serve):
    c = Client([serve.url])
    c.set_group("partner", "1000/s")
    c.set_policy(prefix="p:", group="partner")
    c.set_policy("slow", rate="2/s", burst=1)
    time.sleep(SETTINGS_REACH_S)
    # p:b is enqueued once p:a's back-off is recorded: a run claimed before
    # the hold (the worker claims as soon as its slot is free, while the
    # back-off is on its way) is not held back.
    c.enqueue_many([NewJob("p:a", "x")] + [NewJob("slow", str(i)) for i in range(3)])
    starts: Dict[str, List[float]] = {}

    def on_job(job: ClaimedJob) -> None:
        now = time.monotonic()
        group_runs = sum(len(v) for k, v in starts.items() if k.startswith("p:"))
        starts.setdefault(job.key, []).append(now)
        if job.key.startswith("p:") and group_runs == 0:
            raise BackOff(600, group=True)

    # One job at a time.
    r = Running("thread", [serve.url], on_job, concurrency=1, prefetch=0, lease_ms=5000, wait_ms=200)
    try:
        wait_until("the group's back-off", lambda: r.w.stats.backed_off == 1, timeout_s=20)
        c.enqueue_many([NewJob("p:b", "x")])
        wait_until("every job to run", lambda: r.w.stats.acked == 5 and all_done(serve.url), timeout_s=20)
    finally:
        r.stop()
        r.join()
    assert r.error is None, r.error
    partner = sorted(t for k, v in starts.items() if k.startswith("p:") for t in v)
    assert len(partner) == 3, starts
    assert partner[1] - partner[0] >= 0.58, f"the group's other key started {partner[1] - partner[0]:.3f} s later"
    slow = starts["slow"]
    assert len(slow) == 3 and slow[2] - slow[0] >= 0.9, f"2/s with a burst of 1: {[t - slow[0] for t in slow]}"
    assert r.stats.backed_off == 1 and r.stats.acked == 5, r.stats


#: How soon a resumed key's or group's job must start: the server's claims
#: wake at once for a key (its jobs are due now), within a second for a
#: group (FLOW_RECHECK_MS); the rest is the worker's claim and the margin.
RESUMED_START_S = 2.5
#: A handler's back-off the tests lift: far longer than any of them runs.
LONG_BACK_OFF_MS = 60_000


def _pair(kind: str, url: str) -> Tuple[Any, str]:
    """A client of ``kind`` (``sync``: :class:`Client`, ``aio``:
    :class:`AsyncClient` called blocking) and the worker kind to go with it."""
    return (Client([url]), "thread") if kind == "sync" else (_Blocking(url), "aio")


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_resume_key_lifts_a_handlers_back_off_and_the_job_runs_at_once(serve, kind):
    c, worker_kind = _pair(kind, serve.url)
    placed = Client([serve.url]).enqueue("held", "x", max_attempts=1)
    runs: List[Tuple[int, float]] = []

    def on_job(job: ClaimedJob) -> None:
        runs.append((job.attempt, time.monotonic()))
        if len(runs) == 1:
            raise BackOff(LONG_BACK_OFF_MS)

    r = Running(worker_kind, [serve.url], on_job, lease_ms=5000, wait_ms=200)
    try:
        wait_until("the handler's back-off", lambda: r.w.stats.backed_off == 1, timeout_s=15)
        time.sleep(0.5)
        assert len(runs) == 1, "the key is held by its back-off"
        now_ms = int(time.time() * 1000)
        hold = c.resume_key("held")
        resumed = time.monotonic()
        assert isinstance(hold, KeyHold), hold
        assert (hold.key, hold.shard, hold.jobs) == ("held", placed.shard, (placed.id,)), hold
        assert now_ms + LONG_BACK_OFF_MS - 10_000 <= hold.until_ms <= now_ms + LONG_BACK_OFF_MS + 1_000, \
            (hold.until_ms - now_ms)
        wait_until("the resumed job to run and be acked", lambda: len(runs) == 2 and all_done(serve.url),
                   timeout_s=10)
        # Nothing holds the key now: nothing is lifted, and it says so.
        assert c.resume_key("held") is None
        assert c.resume_key("never-seen") is None
        assert c.resume_key("vip/1 ü?x") is None, "a key that needs percent-encoding"
        # A bad key: 400, the message names the key; an empty one is refused before any request.
        with pytest.raises(BadRequest) as e:
            c.resume_key("k" * 1025)
        assert e.value.status == 400 and "key" in e.value.error, e.value
        with pytest.raises(ConfigError):
            c.resume_key("")
    finally:
        r.stop()
        r.join()
        c.close()
    assert r.error is None, r.error
    (first, _), (second, t2) = runs
    assert first == second == 1, "a back-off uses no attempt, and a resume none either"
    assert t2 - resumed < RESUMED_START_S, f"the resumed job started {t2 - resumed:.3f} s after the resume"
    assert (r.stats.backed_off, r.stats.failed, r.stats.acked) == (1, 0, 1), r.stats
    assert totals_of(serve.url)["dead"] == 0


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_resume_group_lifts_a_group_back_off_and_the_key_keeps_its_own_until_resumed(serve, kind):
    c, worker_kind = _pair(kind, serve.url)
    producer = Client([serve.url])
    c.set_group("partner", "1000/s")
    c.set_policy(prefix="p:", group="partner")
    time.sleep(SETTINGS_REACH_S)
    first = producer.enqueue("p:a", "x")
    starts: Dict[str, List[float]] = {}

    def on_job(job: ClaimedJob) -> None:
        starts.setdefault(job.key, []).append(time.monotonic())
        if job.key == "p:a" and len(starts["p:a"]) == 1:
            raise BackOff(LONG_BACK_OFF_MS, group=True)

    r = Running(worker_kind, [serve.url], on_job, concurrency=2, prefetch=0, lease_ms=5000, wait_ms=200)
    try:
        wait_until("the group's back-off", lambda: r.w.stats.backed_off == 1, timeout_s=15)
        # The group's other key waits; a key of no group runs.
        producer.enqueue_many([NewJob("p:b", "x"), NewJob("free", "x")])
        wait_until("the key of no group to run", lambda: "free" in starts, timeout_s=10)
        time.sleep(1.0)
        assert "p:b" not in starts, "the group's hold lets none of its keys start"
        assert c.resume_group("partner") is True
        resumed = time.monotonic()
        wait_until("the group's other key to run", lambda: "p:b" in starts, timeout_s=10)
        assert starts["p:b"][0] - resumed < RESUMED_START_S, \
            f"the group's other key started {starts['p:b'][0] - resumed:.3f} s after the resume"
        # The key that backed off keeps its own wait, which resume_key lifts.
        time.sleep(0.5)
        assert len(starts["p:a"]) == 1, "the group's resume leaves the key's own back-off"
        hold = c.resume_key("p:a")
        resumed = time.monotonic()
        assert hold is not None and hold.jobs == (first.id,), hold
        wait_until("every job to run", lambda: r.w.stats.acked == 3 and all_done(serve.url), timeout_s=10)
        assert starts["p:a"][1] - resumed < RESUMED_START_S, starts
        # A group with no hold, or none at all: nothing to lift, answered the same.
        assert c.resume_group("partner") is True and c.resume_group("no-such-group") is True
        for bad in ("none", "g" * 129):
            with pytest.raises(BadRequest) as e:
                c.resume_group(bad)
            assert e.value.status == 400 and "group" in e.value.error, e.value
        with pytest.raises(ConfigError):
            c.resume_group("")
    finally:
        r.stop()
        r.join()
        c.close()
    assert r.error is None, r.error
    assert (r.stats.backed_off, r.stats.failed, r.stats.acked) == (1, 0, 3), r.stats
