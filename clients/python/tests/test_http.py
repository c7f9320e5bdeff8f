"""Client and Worker against the in-test stand-in for ``shardq serve``
(``fake_serve.py``; the real server is not on main yet). The stand-in checks
every request's shape, so these also pin what the clients send."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any, Dict, List, Set, Tuple

import pytest

from shardq import (
    BadRequest,
    ClaimedJob,
    Client,
    HttpError,
    KeyNotResumed,
    NewJob,
    ScheduleTriggered,
    ServerUnavailable,
    StaleReceipt,
    Unauthorized,
    Worker,
)

from support import check_two_server_round_trip, free_port, read_lines, wait_until
from test_flow_serve import _Blocking

HERE = os.path.dirname(os.path.abspath(__file__))


def run_worker(w: Worker, handler, **kw) -> threading.Thread:
    t = threading.Thread(target=w.run, args=(handler,), kwargs=dict(install_signal_handlers=False, **kw), daemon=True)
    t.start()
    return t


def test_enqueue_sends_the_contract_and_a_dedup_id_per_job(fakes):
    f = fakes("a", token="sekret")
    c = Client([f.url], token="sekret")
    got = c.enqueue_many([
        NewJob("k1", "text é"),
        NewJob("k1", b"\xff\x00bin", delay_ms=5, max_attempts=3),
        {"key": "k2", "payload": b"x", "dedup_id": "mine-1"},
    ])
    assert not f.shape_errors, f.shape_errors
    (_, body), = [r for r in f.requests if r[0] == "/v1/jobs"]
    jobs = body["jobs"]
    assert jobs[0] == {"key": "k1", "payload": "text é", "dedup_id": jobs[0]["dedup_id"]}
    assert jobs[1]["payload_b64"] == "/wBiaW4=" and "payload" not in jobs[1]
    assert (jobs[1]["delay_ms"], jobs[1]["max_attempts"]) == (5, 3)
    assert jobs[2]["dedup_id"] == "mine-1"
    generated = [jobs[0]["dedup_id"], jobs[1]["dedup_id"]]
    # A random 96-bit prefix per call and the job's index.
    assert all(re.fullmatch(r"[0-9a-f]{24}-[0-9]+", d) for d in generated) and len(set(generated)) == 2
    assert [(e.id, e.key, e.duplicate) for e in got] == [("a:1", "k1", False), ("a:2", "k1", False), ("a:3", "k2", False)]
    assert f.jobs[2]["payload"] == b"\xff\x00bin"
    assert c.enqueue("k3", "p").shard == "a"
    # Another call draws another prefix: its ids never meet the first call's.
    later = [j["dedup_id"] for path, body in f.requests if path == "/v1/jobs" for j in body["jobs"]][-1]
    assert later.split("-")[0] != generated[0].split("-")[0]


def test_retries_go_to_the_next_url_and_keep_the_dedup_ids(fakes):
    f = fakes("a")
    calls = {"n": 0}

    def lose_first_reply(path, doc):
        # The first request is stored but its reply is lost (a 502 from a proxy).
        if path == "/v1/jobs" and calls["n"] == 0:
            calls["n"] += 1
            f.enqueue(doc["jobs"])
            return 502, {"error": "bad gateway"}
        return None

    f.intercept = lose_first_reply
    dead = f"http://127.0.0.1:{free_port()}"
    c = Client([dead, f.url], retry_rounds=3)
    got = c.enqueue_many([NewJob("k", "1"), NewJob("k", "2")])
    bodies = [b for p, b in f.requests if p == "/v1/jobs"]
    assert len(bodies) == 2 and bodies[0] == bodies[1], "the retry must resend the same dedup ids"
    # The server answered "duplicate" to the retry, but the job it found is
    # this call's own (the ids were generated for it): stored, not a duplicate.
    assert [e.duplicate for e in got] == [False, False]
    assert len(f.jobs) == 2, "a retried batch must not be stored twice"


def test_halves_sent_after_a_413_remember_that_the_whole_may_be_stored(fakes):
    # The whole batch is stored but its reply lost (502); the retry meets a
    # lower body limit (413), so the batch goes again in halves. The server
    # answers "duplicate" to each half's jobs: they are this call's own,
    # stored once, not duplicates.
    f = fakes("a")
    calls = {"n": 0}

    def lose_then_refuse(path, doc):
        if path != "/v1/jobs":
            return None
        calls["n"] += 1
        if calls["n"] == 1:
            f.enqueue(doc["jobs"])
            return 502, {"error": "bad gateway"}
        if len(doc["jobs"]) > 2:
            return 413, {"error": "body: over the limit"}
        return None

    f.intercept = lose_then_refuse
    c = Client([f.url], retry_rounds=3)
    got = c.enqueue_many([NewJob("k", str(i)) for i in range(4)])
    assert calls["n"] == 4, "one lost attempt, one 413, two halves"
    assert [e.duplicate for e in got] == [False] * 4
    assert len(f.jobs) == 4, "the halves stored nothing twice"


def test_refusals_are_not_retried_and_name_the_cause(fakes):
    f = fakes("a", token="right")
    with pytest.raises(Unauthorized) as e:
        Client([f.url]).enqueue("k", "x")
    assert e.value.status == 401
    with pytest.raises(Unauthorized) as e:
        Client([f.url], token="wrong").enqueue("k", "x")
    assert e.value.status == 403 and "wrong token" in str(e.value)
    f.intercept = lambda path, doc: (400, {"error": "key is longer than 1024 bytes"})
    with pytest.raises(BadRequest, match="longer than 1024"):
        Client([f.url], token="right").enqueue("k", "x")
    assert f.count("/v1/jobs") == 3
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable) as e:
        Client(dead, retry_rounds=2).enqueue("k", "x")
    assert all(u in str(e.value) for u in dead) and time.monotonic() - t0 < 10


def test_worker_runs_every_job_once_in_per_key_order_over_two_servers(fakes):
    a, b = fakes("a"), fakes("b")
    keys, per_key = 16, 12
    for seq in range(per_key):
        Client([a.url]).enqueue_many([NewJob(f"a-{k}", str(seq)) for k in range(keys)])
        Client([b.url]).enqueue_many([NewJob(f"b-{k}", str(seq)) for k in range(keys)])
    seen: Dict[str, List[int]] = defaultdict(list)
    running: Set[str] = set()
    overlaps: List[str] = []
    lock = threading.Lock()

    def handler(job: ClaimedJob) -> None:
        with lock:
            if job.key in running:
                overlaps.append(job.key)
            running.add(job.key)
        time.sleep(0.002 * (hash(job.key) % 3))
        with lock:
            running.discard(job.key)
            seen[job.key].append(int(job.payload))
            assert job.url == (a.url if job.key.startswith("a-") else b.url)

    w = Worker([a.url, b.url])
    t = run_worker(w, handler, concurrency=6, lease_ms=5000, wait_ms=200)
    wait_until("every job to be acked", lambda: a.pending() == 0 and b.pending() == 0, timeout_s=60)
    w.stop()
    t.join(30)
    assert not t.is_alive(), "Worker.run did not return after stop()"
    check_two_server_round_trip(a, b, overlaps, seen, keys, per_key)
    assert w.stats.acked == 2 * keys * per_key and w.stats.lost == 0 and w.stats.failed == 0


def test_a_long_job_is_extended_and_a_failing_one_retried(fakes):
    f = fakes("a")
    Client([f.url]).enqueue_many([NewJob("slow", "0"), NewJob("flaky", "0"), NewJob("flaky", "1")])
    runs: List[Tuple[str, int, int]] = []

    def handler(job: ClaimedJob) -> None:
        runs.append((job.key, int(job.payload), job.attempt))
        if job.key == "slow":
            time.sleep(1.2)  # four leases of 300 ms
        if job.key == "flaky" and job.attempt == 1 and job.payload == b"0":
            raise RuntimeError("boom")

    w = Worker([f.url])
    t = run_worker(w, handler, concurrency=2, lease_ms=300, wait_ms=100)
    wait_until("the three jobs to finish", lambda: f.pending() == 0, timeout_s=30)
    w.stop()
    t.join(30)
    assert not f.shape_errors, f.shape_errors
    assert [r for r in runs if r[0] == "slow"] == [("slow", 0, 1)], "the extended job ran again"
    assert f.count("/v1/extend") >= 2
    assert [r for r in runs if r[0] == "flaky"] == [("flaky", 0, 1), ("flaky", 0, 2), ("flaky", 1, 1)]
    fails = [b for p, b in f.requests if p == "/v1/fail"]
    assert len(fails) == 1 and "RuntimeError: boom" in fails[0]["reason"]
    assert w.stats.acked == 3 and w.stats.failed == 1


@pytest.mark.parametrize("prefetch", [0, 2])
def test_prefetched_jobs_wait_with_extended_leases_and_each_runs_once(fakes, prefetch):
    f = fakes("a")
    Client([f.url]).enqueue_many([NewJob(f"k{i}", str(i)) for i in range(6)])
    release = threading.Event()
    runs: List[Tuple[str, int]] = []

    def handler(job: ClaimedJob) -> None:
        runs.append((job.key, job.attempt))
        if len(runs) == 1:
            release.wait(30)

    def in_flight() -> int:
        with f.lock:
            return len(f.flying)

    w = Worker([f.url])
    t = run_worker(w, handler, concurrency=1, lease_ms=300, wait_ms=100, prefetch=prefetch)
    wait_until("the first job to start and the prefetch to fill", lambda: len(runs) == 1 and in_flight() == 1 + prefetch)
    # Four leases of 300 ms with one thread busy: the waiting jobs are
    # extended like the running one, and no more are claimed.
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        assert in_flight() == 1 + prefetch and len(runs) == 1
        time.sleep(0.05)
    release.set()
    wait_until("every job to be acked", lambda: f.pending() == 0, timeout_s=30)
    w.stop()
    t.join(30)
    assert not f.shape_errors, f.shape_errors
    assert sorted(runs) == [(f"k{i}", 1) for i in range(6)], "a waiting job's lease lapsed and it ran again"
    assert (w.stats.acked, w.stats.lost) == (6, 0)


@pytest.mark.parametrize("how", ["refused", "unanswered"])
def test_a_prefetched_job_whose_run_ended_while_it_waited_is_not_run(fakes, how):
    # One thread, one job prefetched behind a long one. The waiting job's
    # run ends meanwhile: its extend is refused (409), or no extend is
    # answered for longer than its lease. The worker must not start it late
    # (the server may have given the key's next run out): it is run again
    # only as the server's new run of it, attempt 2.
    f = fakes("a")
    Client([f.url]).enqueue_many([NewJob("long", "0"), NewJob("waits", "0")])
    release = threading.Event()
    runs: List[Tuple[str, int]] = []
    first: List[str] = []

    def handler(job: ClaimedJob) -> None:
        runs.append((job.key, job.attempt))
        if not first:
            first.append(job.receipt)
            release.wait(30)

    def refuse_the_waiting_one(path, doc):
        if path != "/v1/extend" or not first:
            return None
        if how == "unanswered":
            return 503, {"error": "not now"}
        others = [r for r in doc["receipts"] if r != first[0]]
        f.extend({"receipts": [r for r in doc["receipts"] if r == first[0]], "lease_ms": doc["lease_ms"]})
        return (409, {"error": "stale", "extended": len(doc["receipts"]) - len(others), "stale": others,
                      "not_owned": []}) if others else None

    f.intercept = refuse_the_waiting_one
    w = Worker([f.url])
    t = run_worker(w, handler, concurrency=1, lease_ms=600, wait_ms=100, prefetch=1)
    wait_until("the long job to start with one behind it", lambda: len(runs) == 1 and len(f.flying) == 2)
    time.sleep(1.0)  # past the waiting job's lease (and the long one's, when unanswered)
    f.intercept = None
    release.set()
    wait_until("every job to be acked", lambda: f.pending() == 0, timeout_s=30)
    w.stop()
    t.join(30)
    assert not f.shape_errors, f.shape_errors
    waited = [r for r in runs if r[0] == "waits"]
    assert waited == [("waits", 2)], f"the waiting job ran late or twice: {runs}"
    assert w.stats.lost >= 1


def test_409_on_ack_means_the_run_was_lost_and_is_not_retried(fakes, caplog):
    f = fakes("a")
    Client([f.url]).enqueue("k", "x")
    f.intercept = lambda path, doc: (409, {"error": "stale receipt"}) if path == "/v1/ack" else None
    done = threading.Event()
    w = Worker([f.url])
    with caplog.at_level(logging.WARNING, logger="shardq"):
        t = run_worker(w, lambda job: done.set(), concurrency=1, lease_ms=5000, wait_ms=100)
        wait_until("the ack", lambda: f.count("/v1/ack") >= 1)
        time.sleep(0.3)  # room for a (wrong) retry to show up
        w.stop()
        t.join(30)
    assert f.count("/v1/ack") == 1
    assert w.stats.lost == 1 and w.stats.acked == 0
    assert any("the run was lost" in r.getMessage() for r in caplog.records)


WORKER_SCRIPT = r"""
import sys, time
sys.path.insert(0, sys.argv[3])
from shardq import Worker
out = open(sys.argv[2], "a", buffering=1)
def handler(job):
    out.write(f"start {job.key} {job.payload.decode()}\n")
    time.sleep(1.0)
    out.write(f"done {job.key} {job.payload.decode()}\n")
stats = Worker([sys.argv[1]]).run(handler, concurrency=3, lease_ms=10000, wait_ms=200)
out.write(f"exit acked={stats.acked}\n")
"""


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_a_key_resume_while_the_key_moves_raises_key_not_resumed_and_is_not_retried(fakes, kind):
    # The real server answers so while a rebalance has sealed the key
    # (crates/shardq-server/tests/api.rs seals one by hand); nothing changed.
    a, b = fakes("a"), fakes("b")
    path = "/v1/keys/k%2F1/resume"
    a.answers[path] = (409, {"error": 'key: "k/1" is moving to another shard now; nothing changed',
                             "kind": "conflict", "state": "moving", "shard": "a"})
    b.answers[path] = (200, {"key": "k/1", "shard": "b", "resumed": True,
                             "back_off": {"until_ms": 1, "jobs": ["b:1"]}})
    c: Any = Client([a.url, b.url]) if kind == "sync" else _Blocking([a.url, b.url])
    try:
        with pytest.raises(KeyNotResumed) as e:
            c.resume_key("k/1")
    finally:
        c.close()
    assert (e.value.status, e.value.state, e.value.shard) == (409, "moving", "a"), e.value
    assert "moving" in e.value.error and not isinstance(e.value, StaleReceipt)
    assert a.requests == [(path, {})] and b.requests == [], "a 409 is an answer: no other URL is asked"


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_schedule_calls_go_to_the_next_url_on_a_503_and_a_409_is_a_plain_http_error(fakes, kind):
    a, b = fakes("a"), fakes("b")
    trigger, backfill = "/v1/schedules/beat/trigger", "/v1/schedules/beat/backfill"
    a.answers[trigger] = (503, {"error": "the store is unavailable", "kind": "retryable"})
    b.answers[trigger] = (200, {"id": "beat", "shard": "shard-1", "job": "shard-1:7"})
    a.answers[backfill] = (409, {"error": "busy", "kind": "conflict"})
    c: Any = Client([a.url, b.url]) if kind == "sync" else _Blocking([a.url, b.url])
    try:
        assert c.trigger_schedule("beat") == ScheduleTriggered(id="beat", shard="shard-1", job="shard-1:7")
        with pytest.raises(HttpError) as e:
            c.backfill_schedule("beat", 1_000, "2026-03-30T00:00:00Z")
    finally:
        c.close()
    assert e.value.status == 409 and type(e.value) is HttpError, e.value
    assert a.requests == [(trigger, {}), (backfill, {"from": 1_000, "to": "2026-03-30T00:00:00Z"})]
    assert b.requests == [(trigger, {})], "a 409 is an answer: no other URL is asked"


def test_sigterm_stops_claiming_and_finishes_running_jobs(fakes, tmp_path):
    f = fakes("a")
    Client([f.url]).enqueue_many([NewJob(f"k{i}", str(i)) for i in range(10)])
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    out = tmp_path / "out.txt"
    p = subprocess.Popen([sys.executable, str(script), f.url, str(out), os.path.dirname(HERE)])
    try:
        wait_until("three jobs to start", lambda: sum(l.startswith("start") for l in read_lines(str(out))) >= 3)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0
    lines = read_lines(str(out))
    started = {l.split(" ", 1)[1] for l in lines if l.startswith("start")}
    finished = {l.split(" ", 1)[1] for l in lines if l.startswith("done")}
    assert started == finished, "a running job was cut short"
    assert lines[-1] == f"exit acked={len(started)}"
    assert len(f.acked) == len(started) and f.pending() == 10 - len(started)
    assert len(started) <= 6, "the worker kept claiming after SIGTERM"


def test_both_json_codecs_send_and_read_the_same_documents():
    # orjson when installed, the standard library otherwise: same documents.
    import json

    from shardq import http as h

    body = {"jobs": [{"key": "k é\u2028", "payload": "{\"a\":1}", "dedup_id": "x-1", "max_attempts": 3}],
            "receipts": ["shard-1:7.1733000000123456"], "fence": 2 ** 53 - 1}
    assert json.loads(h._dumps(body)) == json.loads(h._std_dumps(body)) == body
    assert h._loads(h._std_dumps(body)) == body and h._loads(h._dumps(body).decode()) == body


def test_the_http_client_loads_without_the_redis_producer():
    # `import shardq` for an HTTP client or worker must not pay for redis-py
    # and the reference router; the Redis producer still loads on first use.
    code = """
import sys, shardq
assert 'redis' not in sys.modules, 'redis imported'
assert 'shardq.routing' not in sys.modules, 'shardq.routing imported'
from shardq import RedisProducer
assert 'redis' in sys.modules and shardq.Placed.__name__ == 'Placed'
try:
    shardq.NoSuchThing
except AttributeError as e:
    assert 'NoSuchThing' in str(e)
else:
    raise SystemExit('no AttributeError')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
    assert r.returncode == 0, r.stderr


def test_a_claimed_job_carries_its_dedup_id_and_a_schedules_tick():
    from shardq.http import _claimed_of
    from shardq import ScheduleTick
    doc = {"jobs": [
        {"id": "s:1", "shard": "s", "key": "k", "payload": "p", "attempt": 1, "receipt": "s:1.5", "fence": 5,
         "lease_expires_ms": 9, "dedup_id": "schedule:nightly@1800000000000",
         "schedule": {"id": "nightly", "tick_ms": 1800000000000, "triggered": False}},
        {"id": "s:2", "shard": "s", "key": "k", "payload": "p", "attempt": 1, "receipt": "s:2.6", "fence": 6,
         "lease_expires_ms": 9},
    ]}
    tick, plain = _claimed_of("http://x", doc)
    assert tick.dedup_id == "schedule:nightly@1800000000000"
    assert tick.schedule == ScheduleTick("nightly", 1800000000000, False)
    assert plain.dedup_id is None and plain.schedule is None
