"""Recurring schedules through both clients against a real ``shardq serve``:
a 1 s schedule fires on its own (the server runs every shard), is listed,
paused (no next fire), triggered by hand and resumed; a cron schedule in a
zone with a summer-time change is backfilled over a past range, and a
backfill repeated stores nothing; a bad cron is refused naming it, both or
neither of cron and every before any request; an unknown id is a 404;
deleted schedules are gone."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from shardq import (
    BadRequest,
    Client,
    ConfigError,
    HttpError,
    InvalidJob,
    NewJob,
    Schedule,
    ScheduleBackfilled,
    ScheduleInfo,
    SchedulesApplied,
    ScheduleTick,
    ScheduleTriggered,
)

from support import wait_until
from test_flow_serve import _Blocking

#: Bound on waiting for a 1 s schedule's fires (they need the server's
#: scheduler pass, once a second).
FIRES_WAIT_S = 30.0


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_a_schedule_fires_is_listed_paused_triggered_backfilled_refused_and_deleted(serve, kind):
    c: Any = Client([serve.url]) if kind == "sync" else _Blocking(serve.url)
    try:
        assert c.schedules() == []

        beat = c.set_schedule("beat", "tenant-beat", every="1s", overlap="all", payload='{"tick": true}')
        assert isinstance(beat, Schedule)
        assert (beat.key, beat.cron, beat.tz, beat.every_ms, beat.overlap, beat.payload, beat.paused) == (
            "tenant-beat", None, None, 1000, "all", '{"tick": true}', False), beat
        assert (beat.catch_up_ms, beat.jitter_ms, beat.start_ms, beat.end_ms, beat.max_attempts) == (
            300_000, 0, None, None, 5), "the server's defaults"

        # The server runs every shard, so it fires the schedule itself.
        wait_until("the 1 s schedule to fire twice", lambda: c.schedule("beat").state.fired >= 2, FIRES_WAIT_S, 0.1)
        shown = c.schedule("beat")
        assert isinstance(shown, ScheduleInfo) and shown.id == "beat" and shown.next_fire_ms is not None
        assert shown.state.last is not None and shown.state.last.job.startswith(shown.state.last.shard + ":")
        assert shown.state.decided_ms >= shown.state.last.tick_ms
        last_job = c.job(shown.state.last.job)
        assert last_job is not None, "the last fire's job id is one the client reads"
        assert last_job.schedule == ScheduleTick("beat", shown.state.last.tick_ms, False), last_job
        assert last_job.dedup_id == f"schedule:beat@{shown.state.last.tick_ms}", last_job
        assert [s.id for s in c.schedules()] == ["beat"]

        paused = c.pause_schedule("beat")
        assert paused.paused is True and paused.every_ms == 1000
        shown = c.schedule("beat")
        assert shown.paused is True and shown.next_fire_ms is None, shown

        # A trigger fires while paused: one job now, outside the ticks.
        t = c.trigger_schedule("beat")
        assert isinstance(t, ScheduleTriggered) and t.id == "beat"
        assert t.job.startswith(t.shard + ":"), t
        job = c.job(t.job)
        assert job is not None and job.key == "tenant-beat" and job.payload == b'{"tick": true}'
        assert job.schedule is not None and job.schedule.id == "beat" and job.schedule.triggered, job

        resumed = c.resume_schedule("beat")
        assert resumed.paused is False and resumed.since_ms >= beat.since_ms
        assert c.schedule("beat").next_fire_ms is not None

        # 02:30 in Berlin on 28, 29 March 2026 (summer time starts on the
        # 29th at 02:00, so that day's 02:30 is skipped forward to 03:30):
        # two ticks either way, and a repeat stores none of them again.
        nightly = c.set_schedule("nightly", "reports", cron="30 2 * * *", tz="Europe/Berlin",
                                 payload='{"report": "daily"}', catch_up="10m", jitter="0s", max_attempts=3)
        assert (nightly.cron, nightly.tz, nightly.every_ms, nightly.overlap, nightly.catch_up_ms,
                nightly.max_attempts) == ("30 2 * * *", "Europe/Berlin", None, "skip", 600_000, 3), nightly
        first = c.backfill_schedule("nightly", "2026-03-28T00:00:00Z", "2026-03-30T00:00:00Z")
        assert first == ScheduleBackfilled(id="nightly", ticks=2, stored=2, already_stored=0), first
        again = c.backfill_schedule("nightly", "2026-03-28T00:00:00Z", "2026-03-30T00:00:00Z")
        assert (again.ticks, again.stored, again.already_stored) == (2, 0, 2), again
        # The same range as an aware datetime and as ms since the epoch.
        since = datetime(2026, 3, 28, tzinfo=timezone.utc)
        until_ms = int((since + timedelta(days=2)).timestamp() * 1000)
        assert c.backfill_schedule("nightly", since, until_ms).stored == 0
        assert {j.payload for j in c.key_jobs("reports")} == {b'{"report": "daily"}'}
        assert len(c.key_jobs("reports")) == 2
        with pytest.raises(BadRequest, match="after"):
            c.backfill_schedule("nightly", "2026-03-30T00:00:00Z", "2026-03-28T00:00:00Z")
        with pytest.raises(ConfigError, match="timezone"):
            c.backfill_schedule("nightly", datetime(2026, 3, 28), datetime(2026, 3, 30))

        # A start and an end bound its ticks; both come back as ms.
        bounded = c.set_schedule("bounded", "reports", every="5m", start="2026-01-01T00:00:00Z",
                                 end=datetime(2036, 1, 1, tzinfo=timezone.utc))
        assert (bounded.start_ms, bounded.end_ms) == (1_767_225_600_000, 2_082_758_400_000), bounded
        assert sorted(s.id for s in c.schedules()) == ["beat", "bounded", "nightly"]

        # Bad values: refused by the server, naming them; nothing stored.
        with pytest.raises(BadRequest, match="invalid cron") as bad:
            c.set_schedule("bad", "k", cron="0 25 * * *")
        assert bad.value.status == 400 and "0 25 * * *" in bad.value.error
        with pytest.raises(BadRequest, match="Nowhere/City"):
            c.set_schedule("bad", "k", cron="0 2 * * *", tz="Nowhere/City")
        with pytest.raises(BadRequest, match="every"):
            c.set_schedule("bad", "k", every="10ms")
        with pytest.raises(BadRequest, match="schedule id"):
            c.set_schedule("bad id", "k", every="1m")
        # Both or neither of cron and every, a zone without a cron, a bad
        # overlap: refused before any request.
        for kwargs in ({}, {"cron": "* * * * *", "every": "1m"}, {"every": "1m", "tz": "UTC"},
                       {"every": "1m", "overlap": "never"}):
            with pytest.raises(ConfigError):
                c.set_schedule("bad", "k", **kwargs)
        with pytest.raises(ConfigError):
            c.schedule("")

        # An unknown id: a 404, whatever the call.
        for call in (lambda: c.schedule("bad"), lambda: c.pause_schedule("bad"), lambda: c.resume_schedule("bad"),
                     lambda: c.trigger_schedule("bad"),
                     lambda: c.backfill_schedule("bad", 0, 1)):
            with pytest.raises(HttpError) as missing:
                call()
            assert missing.value.status == 404 and not isinstance(missing.value, BadRequest), missing.value
            assert "no schedule" in missing.value.error

        assert c.delete_schedule("beat") is True
        assert c.delete_schedule("beat") is False
        with pytest.raises(HttpError) as gone:
            c.schedule("beat")
        assert gone.value.status == 404
        assert c.delete_schedule("nightly") is True and c.delete_schedule("bounded") is True
        assert c.schedules() == []
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_apply_schedules_sets_many_in_one_change_prunes_and_refuses_a_bad_one_whole(serve, kind):
    c: Any = Client([serve.url]) if kind == "sync" else _Blocking(serve.url)
    try:
        c.set_schedule("manual", "k0", every="1m")
        file = {"nightly": {"key": "t-1", "cron": "30 2 * * *", "tz": "Europe/Berlin", "payload": "bill"},
                "poll": {"key": "feeds", "every": "5m", "overlap": "one"}}
        dry = c.apply_schedules(file, prune=True, dry_run=True)
        assert dry == SchedulesApplied(dry_run=True, added=("nightly", "poll"), changed=(), unchanged=(),
                                       removed=("manual",)), dry
        assert [s.id for s in c.schedules()] == ["manual"], "a dry run stored nothing"
        done = c.apply_schedules(file)
        assert (done.dry_run, done.added, done.removed) == (False, ("nightly", "poll"), ()), done
        c.pause_schedule("poll")
        again = c.apply_schedules(file, prune=True)
        assert (again.unchanged, again.removed) == (("nightly", "poll"), ("manual",)), again
        assert c.schedule("poll").paused is True, "an applied schedule keeps its pause"
        # A bad schedule among good ones: refused naming it, nothing stored.
        with pytest.raises(BadRequest, match='"broken"'):
            c.apply_schedules({"fine": {"key": "k", "every": "1m"}, "broken": {"key": "k", "cron": "61 * * * *"}})
        # Refused before any request: an unknown field, both cron and every.
        with pytest.raises(ConfigError, match="colour"):
            c.apply_schedules({"x": {"key": "k", "every": "1m", "colour": "red"}})
        with pytest.raises(ConfigError, match="'y'"):
            c.apply_schedules({"y": {"key": "k", "every": "1m", "cron": "* * * * *"}})
        assert sorted(s.id for s in c.schedules()) == ["nightly", "poll"]
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_unique_and_debounced_jobs_through_the_client(serve, kind):
    c: Any = Client([serve.url]) if kind == "sync" else _Blocking(serve.url)
    try:
        first = c.enqueue("tenant-u", "a", unique_id=f"sync-{kind}", delay_ms=60_000)
        again = c.enqueue("tenant-u", "b", unique_id=f"sync-{kind}")
        assert not first.duplicate and again.duplicate and again.id == first.id, (first, again)
        burst = c.enqueue_many([NewJob(f"tenant-d-{kind}", f"v{i}", debounce_id="recalc", debounce_ms=60_000)
                                for i in range(5)])
        assert {e.id for e in burst} == {burst[0].id} and not any(e.duplicate for e in burst), burst
        job = c.job(burst[0].id)
        assert job is not None and job.payload == b"v4" and job.dedup_id == "debounce:recalc", job
        with pytest.raises(BadRequest, match="not both"):
            c.enqueue("k", "x", unique_id="a", debounce_id="b", debounce_ms=5)
        with pytest.raises(InvalidJob, match="dedup_id"):
            c.enqueue("k", "x", dedup_id="mine", unique_id="a")
    finally:
        c.close()
