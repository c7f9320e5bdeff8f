// Recurring schedules against a real `shardq serve`: a 1 s schedule fires
// on its own (the server runs every shard), is listed, paused (no next
// fire), triggered by hand and resumed; a cron schedule in a zone with a
// summer-time change is backfilled over a past range, and a backfill
// repeated stores nothing; a bad cron is refused naming it, both or neither
// of cron and every before any request; an unknown id is a 404; deleted
// schedules are gone.

import assert from "node:assert/strict";
import { test } from "node:test";

import { BadRequest, Client, ShardqError } from "../src/index.js";
import { cluster, until } from "../test-support/cluster.js";

test("a schedule fires, is listed, paused, triggered, backfilled, refused when bad, a 404 when unknown, and deleted", { timeout: 90_000 }, async () => {
  const c = await cluster(2, 1);
  const client = new Client([c.servers[0]!.url]);
  try {
    assert.deepEqual(await client.schedules(), []);

    const beat = await client.setSchedule("beat", { key: "tenant-beat", every: "1s", overlap: "all", payload: '{"tick":true}' });
    assert.deepEqual({ ...beat, sinceMs: 0 }, {
      key: "tenant-beat",
      everyMs: 1000,
      payload: '{"tick":true}',
      overlap: "all",
      catchUpMs: 300_000,
      jitterMs: 0,
      maxAttempts: 5,
      paused: false,
      sinceMs: 0,
    });

    // The server runs every shard, so it fires the schedule itself.
    await until(async () => (await client.schedule("beat")).state.fired >= 2, 30_000, "the 1 s schedule to fire twice");
    const shown = await client.schedule("beat");
    assert.equal(shown.id, "beat");
    assert.equal(typeof shown.nextFireMs, "number");
    assert.ok(shown.state.last !== undefined && shown.state.last.job.startsWith(`${shown.state.last.shard}:`), JSON.stringify(shown));
    assert.ok(shown.state.decidedMs >= shown.state.last.tickMs);
    const lastJob = await client.job(shown.state.last.job);
    assert.notEqual(lastJob, undefined, "the last fire's job id is one the client reads");
    assert.deepEqual(lastJob && "schedule" in lastJob ? lastJob.schedule : undefined, { id: "beat", tickMs: shown.state.last.tickMs, triggered: false });
    assert.equal(lastJob && "dedupId" in lastJob ? lastJob.dedupId : undefined, `schedule:beat@${shown.state.last.tickMs}`);
    assert.deepEqual(
      (await client.schedules()).map((s) => s.id),
      ["beat"],
    );

    const paused = await client.pauseSchedule("beat");
    assert.equal(paused.paused, true);
    const pausedView = await client.schedule("beat");
    assert.equal(pausedView.paused, true);
    assert.equal(pausedView.nextFireMs, undefined, "no next fire while paused");

    // A trigger fires while paused: one job now, outside the ticks.
    const t = await client.triggerSchedule("beat");
    assert.equal(t.id, "beat");
    assert.ok(t.job.startsWith(`${t.shard}:`), JSON.stringify(t));
    const job = await client.job(t.job);
    assert.equal(job?.key, "tenant-beat");
    assert.equal(job?.payload.toString("utf8"), '{"tick":true}');
    assert.equal(job && "schedule" in job ? job.schedule?.triggered : undefined, true, "a trigger's job says so");

    const resumed = await client.resumeSchedule("beat");
    assert.equal(resumed.paused, false);
    assert.ok(resumed.sinceMs >= beat.sinceMs);
    assert.equal(typeof (await client.schedule("beat")).nextFireMs, "number");

    // 02:30 in Berlin on 28 and 29 March 2026 (summer time starts on the
    // 29th at 02:00, so that day's 02:30 is moved to 03:30): two ticks, and
    // a repeat stores none of them again.
    const nightly = await client.setSchedule("nightly", {
      key: "reports",
      cron: "30 2 * * *",
      tz: "Europe/Berlin",
      payload: new TextEncoder().encode('{"report":"daily"}'),
      catchUp: "10m",
      jitter: "0s",
      maxAttempts: 3,
    });
    assert.deepEqual([nightly.cron, nightly.tz, nightly.everyMs, nightly.overlap, nightly.catchUpMs, nightly.maxAttempts, nightly.payload], [
      "30 2 * * *",
      "Europe/Berlin",
      undefined,
      "skip",
      600_000,
      3,
      '{"report":"daily"}',
    ]);
    assert.deepEqual(await client.backfillSchedule("nightly", "2026-03-28T00:00:00Z", "2026-03-30T00:00:00Z"), {
      id: "nightly",
      ticks: 2,
      stored: 2,
      alreadyStored: 0,
    });
    assert.deepEqual(await client.backfillSchedule("nightly", "2026-03-28T00:00:00Z", "2026-03-30T00:00:00Z"), {
      id: "nightly",
      ticks: 2,
      stored: 0,
      alreadyStored: 2,
    });
    // The same range as a Date and as ms since the epoch.
    const since = new Date("2026-03-28T00:00:00Z");
    assert.equal((await client.backfillSchedule("nightly", since, since.getTime() + 2 * 86_400_000)).stored, 0);
    assert.equal((await client.keyJobs("reports")).length, 2);
    await assert.rejects(client.backfillSchedule("nightly", "2026-03-30T00:00:00Z", "2026-03-28T00:00:00Z"), (err: unknown) => err instanceof BadRequest && err.status === 400 && /after/.test(err.serverError ?? ""));
    await assert.rejects(client.backfillSchedule("nightly", new Date(Number.NaN), 0), TypeError);

    // A start and an end bound its ticks; both come back as ms.
    const bounded = await client.setSchedule("bounded", { key: "reports", every: "5m", start: "2026-01-01T00:00:00Z", end: new Date("2036-01-01T00:00:00Z") });
    assert.deepEqual([bounded.startMs, bounded.endMs], [1_767_225_600_000, 2_082_758_400_000]);
    assert.deepEqual((await client.schedules()).map((s) => s.id).sort(), ["beat", "bounded", "nightly"]);

    // Bad values: refused by the server, naming them; nothing stored.
    for (const [spec, id, named] of [
      [{ key: "k", cron: "0 25 * * *" }, "bad", 'invalid cron "0 25 * * *"'],
      [{ key: "k", cron: "0 2 * * *", tz: "Nowhere/City" }, "bad", "Nowhere/City"],
      [{ key: "k", every: "10ms" }, "bad", "every"],
      [{ key: "k", every: "1m" }, "bad id", "schedule id"],
    ] as const) {
      await assert.rejects(client.setSchedule(id, spec), (err: unknown) => err instanceof BadRequest && err.status === 400 && (err.serverError ?? "").includes(named));
    }
    // Both or neither of cron and every, a zone without a cron, a bad overlap: refused before any request.
    for (const spec of [{ key: "k" }, { key: "k", cron: "* * * * *", every: "1m" }, { key: "k", every: "1m", tz: "UTC" }, { key: "k", every: "1m", overlap: "never" }]) {
      await assert.rejects(client.setSchedule("bad", spec as never), TypeError);
    }
    await assert.rejects(client.schedule(""), TypeError);

    // An unknown id: a 404, whatever the call.
    for (const call of [
      () => client.schedule("bad"),
      () => client.pauseSchedule("bad"),
      () => client.resumeSchedule("bad"),
      () => client.triggerSchedule("bad"),
      () => client.backfillSchedule("bad", 0, 1),
    ]) {
      await assert.rejects(call(), (err: unknown) => err instanceof ShardqError && err.status === 404 && /no schedule/.test(err.serverError ?? ""));
    }

    assert.equal(await client.deleteSchedule("beat"), true);
    assert.equal(await client.deleteSchedule("beat"), false);
    await assert.rejects(client.schedule("beat"), (err: unknown) => err instanceof ShardqError && err.status === 404);
    assert.equal(await client.deleteSchedule("nightly"), true);
    assert.equal(await client.deleteSchedule("bounded"), true);
    assert.deepEqual(await client.schedules(), []);
  } finally {
    client.close();
    await c.close();
  }
});

test("applySchedules sets many in one change, prunes, keeps a pause, and refuses a bad one whole", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  const client = new Client([c.servers[0]!.url]);
  try {
    await client.setSchedule("manual", { key: "k0", every: "1m" });
    const file = {
      nightly: { key: "t-1", cron: "30 2 * * *", tz: "Europe/Berlin", payload: "bill" },
      poll: { key: "feeds", every: "5m", overlap: "one" as const },
    };
    const dry = await client.applySchedules(file, { prune: true, dryRun: true });
    assert.deepEqual(dry, { dryRun: true, added: ["nightly", "poll"], changed: [], unchanged: [], removed: ["manual"] });
    assert.deepEqual((await client.schedules()).map((s) => s.id), ["manual"], "a dry run stored nothing");
    const done = await client.applySchedules(file);
    assert.deepEqual([done.added, done.removed], [["nightly", "poll"], []]);
    await client.pauseSchedule("poll");
    const again = await client.applySchedules(file, { prune: true });
    assert.deepEqual([again.unchanged, again.removed], [["nightly", "poll"], ["manual"]]);
    assert.equal((await client.schedule("poll")).paused, true, "an applied schedule keeps its pause");
    await assert.rejects(
      client.applySchedules({ fine: { key: "k", every: "1m" }, broken: { key: "k", cron: "61 * * * *" } }),
      (err: unknown) => err instanceof BadRequest && /"broken"/.test(err.message),
    );
    await assert.rejects(client.applySchedules({ y: { key: "k", every: "1m", cron: "* * * * *" } }), TypeError);
    assert.deepEqual((await client.schedules()).map((s) => s.id).sort(), ["nightly", "poll"]);
  } finally {
    client.close();
    await c.close();
  }
});

test("unique and debounced jobs through the client", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  const client = new Client([c.servers[0]!.url]);
  try {
    const first = await client.enqueue("tenant-u", "a", { uniqueId: "sync", delayMs: 60_000 });
    const again = await client.enqueue("tenant-u", "b", { uniqueId: "sync" });
    assert.equal(first.duplicate, false);
    assert.deepEqual([again.duplicate, again.id], [true, first.id]);
    const burst = await client.enqueueMany([0, 1, 2, 3].map((i) => ({ key: "tenant-d", payload: `v${i}`, debounceId: "recalc", debounceMs: 60_000 })));
    assert.deepEqual(new Set(burst.map((b) => b.id)).size, 1, JSON.stringify(burst));
    const job = await client.job(String(burst[0]!.id));
    assert.equal(job && "payload" in job ? job.payload.toString("utf8") : undefined, "v3");
    await assert.rejects(client.enqueue("k", "x", { uniqueId: "a", debounceId: "b", debounceMs: 5 }), (e: unknown) => e instanceof BadRequest && /not both/.test(e.message));
    await assert.rejects(client.enqueue("k", "x", { uniqueId: "a", dedupId: "mine" }), TypeError);
  } finally {
    client.close();
    await c.close();
  }
});
