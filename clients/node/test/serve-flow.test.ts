// Flow control against a real `shardq serve`: groups and policies set, read
// back with where they come from, refused with a message naming the bad
// value, a used group kept; a handler's `BackOff` runs its job again after
// the wait on the same attempt (never a dead letter), and holds its whole
// group when asked, while a key's rate limit spaces its starts.

import assert from "node:assert/strict";
import { test } from "node:test";

import { BackOff, BadRequest, Client, Worker, type FlowPolicy } from "../src/index.js";
import { cluster, collectingLogger, until } from "../test-support/cluster.js";

/** How long a changed setting may take to reach the server's claims (its FLOW_RECHECK_MS, 1 s), with a margin. */
const SETTINGS_REACH_MS = 1_200;
const NONE: FlowPolicy = { concurrency: 1, weight: 1, priority: 0 };

test("groups and policies are set, read back with their source, refused naming the bad value, and cleared", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  const client = new Client([c.servers[0]!.url]);
  try {
    assert.deepEqual(await client.policies(), { default: NONE, prefixes: {}, keys: {}, groups: {} });
    assert.equal(await client.group("api"), undefined);

    assert.deepEqual(await client.setGroup("api", { rate: "20/s", burst: 3 }), { rate: "20/s", burst: 3 });
    assert.deepEqual(await client.setGroup("bulk", { rate: "600/m" }), { rate: "600/m", burst: 10 }, "the burst defaults to a second of the rate");
    assert.deepEqual(await client.setGroup("db", { concurrency: 4 }), { concurrency: 4 }, "runs at once, no rate");
    assert.deepEqual(await client.setGroup("db", { rate: "5/s", concurrency: 2 }), { rate: "5/s", burst: 5, concurrency: 2 });
    assert.equal(await client.clearGroup("db"), true);
    await assert.rejects(client.setGroup("db", {}), TypeError, "a group needs a rate or a concurrency");
    const stored = await client.setPolicy({ prefix: "free:", rate: "10/s", group: "api", weight: 2 });
    assert.deepEqual(stored, { concurrency: 1, rate: "10/s", burst: 10, weight: 2, priority: 0, group: "api" });
    // A key that needs percent-encoding in the path.
    const odd = "vip/1 ü?x";
    assert.deepEqual(await client.setPolicy({ key: odd, priority: 5 }), { ...NONE, priority: 5 });

    assert.deepEqual(await client.policy("free:42"), { key: "free:42", policy: stored, source: "prefix", prefix: "free:" });
    assert.deepEqual(await client.policy(odd), { key: odd, policy: { ...NONE, priority: 5 }, source: "key" });
    assert.equal((await client.policy("other"))?.source, "default");
    assert.deepEqual((await client.policy("free:", { scope: "prefix" }))?.policy, stored);
    assert.equal(await client.policy("paid:", { scope: "prefix" }), undefined, "a prefix without a policy");
    assert.deepEqual((await client.policy(undefined, { scope: "default" }))?.policy, NONE);
    const all = await client.policies();
    assert.deepEqual(all.prefixes, { "free:": stored });
    assert.deepEqual(Object.keys(all.keys), [odd]);
    assert.deepEqual(await client.groups(), { api: { rate: "20/s", burst: 3 }, bulk: { rate: "600/m", burst: 10 } });

    // Bad values: 400, the message names the value; nothing is stored.
    for (const [call, named] of [
      [() => client.setPolicy({ key: "k", rate: "0/s" }), "0/s"],
      [() => client.setPolicy({ key: "k", rate: "5/fortnight" }), "fortnight"],
      [() => client.setPolicy({ key: "k", group: "no-such-group" }), "no-such-group"],
      [() => client.setGroup("g", { rate: "0/s" }), "0/s"],
      [() => client.setGroup("g", { concurrency: 0 }), "concurrency"],
      [() => client.setGroup("g", { concurrency: 10_001 }), "10001"],
    ] as const) {
      await assert.rejects(call(), (err: unknown) => err instanceof BadRequest && err.status === 400 && (err.serverError ?? "").includes(named));
    }
    assert.equal((await client.policy("k"))?.source, "default");
    assert.equal(await client.group("g"), undefined);
    // A group a policy names stays; the refusal names the policy.
    await assert.rejects(client.clearGroup("api"), (err: unknown) => err instanceof BadRequest && (err.serverError ?? "").includes("free:"));
    assert.deepEqual(await client.group("api"), { rate: "20/s", burst: 3 });

    assert.equal((await client.setPolicy({ default: true, weight: 3 })).weight, 3);
    assert.deepEqual(await client.policy("other"), { key: "other", policy: { ...NONE, weight: 3 }, source: "default" });
    assert.equal(await client.clearPolicy({ default: true }), true);

    assert.equal(await client.clearPolicy({ prefix: "free:" }), true);
    assert.equal(await client.clearPolicy({ prefix: "free:" }), false);
    assert.equal(await client.clearPolicy({ key: odd }), true);
    assert.equal(await client.clearGroup("api"), true);
    assert.equal(await client.clearGroup("api"), false);
    assert.deepEqual(await client.policies(), { default: NONE, prefixes: {}, keys: {}, groups: { bulk: { rate: "600/m", burst: 10 } } });

    // Exactly one target, checked before any request.
    await assert.rejects(client.setPolicy({}), TypeError);
    await assert.rejects(client.setPolicy({ key: "k", prefix: "p" }), TypeError);
    await assert.rejects(client.clearPolicy({ prefix: "" }), TypeError);
    assert.throws(() => new BackOff(86_400_001), TypeError);
    assert.throws(() => new BackOff(1.5), TypeError);
  } finally {
    client.close();
    await c.close();
  }
});

test("a handler's BackOff runs its job again after the wait on the same attempt, never dead", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  const s = c.servers[0]!;
  try {
    const client = new Client([s.url]);
    const placed = await client.enqueue("bo", "x", { maxAttempts: 1 });
    const runs: { attempt: number; at: number }[] = [];
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    const ran = worker.run(
      async (job) => {
        runs.push({ attempt: job.attempt, at: performance.now() });
        if (runs.length === 1) throw new BackOff(600);
      },
      { waitMs: 200, leaseMs: 5000, handleSignals: false },
    );
    try {
      await until(() => runs.length === 2 && worker.stats.acked === 1, 15_000, "the job to run again and be acked");
    } finally {
      worker.stop();
    }
    const stats = await ran;
    assert.deepEqual(
      runs.map((r) => r.attempt),
      [1, 1],
      "a back-off uses no attempt",
    );
    assert.ok(runs[1]!.at - runs[0]!.at >= 580, `ran again ${runs[1]!.at - runs[0]!.at} ms later, before the 600 ms back-off`);
    assert.deepEqual([stats.backedOff, stats.failed, stats.acked], [1, 0, 1], log.lines.join("\n"));
    await s.settle({ ready: 0, delayed: 0, in_flight: 0, dead: 0 });
    assert.deepEqual((await client.keyFinished("bo")).map((f) => f.id), [placed.id]);
    client.close();
  } finally {
    await c.close();
  }
});

test("a group BackOff holds every key of the group, and a rate of 2/s with a burst of 1 spaces a key's starts", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  const s = c.servers[0]!;
  try {
    const client = new Client([s.url]);
    await client.setGroup("partner", { rate: "1000/s" });
    await client.setPolicy({ prefix: "p:", group: "partner" });
    await client.setPolicy({ key: "slow", rate: "2/s", burst: 1 });
    await new Promise((r) => setTimeout(r, SETTINGS_REACH_MS));
    // p:b is enqueued once p:a's back-off is recorded: a run claimed
    // before the hold (the worker claims as soon as its slot is free, while
    // the back-off is on its way) is not held back.
    await client.enqueueMany([{ key: "p:a", payload: "x" }, ...[0, 1, 2].map((i) => ({ key: "slow", payload: String(i) }))]);
    const starts: { key: string; at: number }[] = [];
    const worker = new Worker([s.url], { logger: collectingLogger() });
    // One job at a time.
    const ran = worker.run(
      async (job) => {
        const first = !starts.some((x) => x.key.startsWith("p:"));
        starts.push({ key: job.key, at: performance.now() });
        if (job.key.startsWith("p:") && first) throw new BackOff(600, { group: true });
      },
      { concurrency: 1, prefetch: 0, waitMs: 200, leaseMs: 5000, handleSignals: false },
    );
    try {
      await until(() => worker.stats.backedOff === 1, 20_000, "the group's back-off");
      await client.enqueueMany([{ key: "p:b", payload: "x" }]);
      await until(() => worker.stats.acked === 5, 20_000, "every job to run");
    } finally {
      worker.stop();
    }
    const stats = await ran;
    const partner = starts.filter((x) => x.key.startsWith("p:")).map((x) => x.at);
    assert.equal(partner.length, 3);
    assert.ok(partner[1]! - partner[0]! >= 580, `the group's other key started ${partner[1]! - partner[0]!} ms later`);
    const slow = starts.filter((x) => x.key === "slow").map((x) => x.at);
    assert.equal(slow.length, 3);
    assert.ok(slow[2]! - slow[0]! >= 900, `2/s with a burst of 1: ${slow.map((t) => Math.round(t - slow[0]!)).join(", ")} ms`);
    assert.equal(stats.backedOff, 1);
    client.close();
  } finally {
    await c.close();
  }
});

/** How soon a resumed key's or group's job must start: the server's claims wake at once for a key (its jobs are due now), within a second for a group (FLOW_RECHECK_MS); the rest is the worker's claim and the margin. */
const RESUMED_START_MS = 2_500;
/** A handler's back-off the tests lift: far longer than any of them runs. */
const LONG_BACK_OFF_MS = 60_000;

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

test("resumeKey lifts a handler's back-off: it reports the hold and the job runs at once; a key none holds reports nothing", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  const s = c.servers[0]!;
  const client = new Client([s.url]);
  try {
    const placed = await client.enqueue("held", "x", { maxAttempts: 1 });
    const runs: { attempt: number; at: number }[] = [];
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    const ran = worker.run(
      async (job) => {
        runs.push({ attempt: job.attempt, at: performance.now() });
        if (runs.length === 1) throw new BackOff(LONG_BACK_OFF_MS);
      },
      { waitMs: 200, leaseMs: 5000, handleSignals: false },
    );
    let resumed = 0;
    try {
      await until(() => worker.stats.backedOff === 1, 15_000, "the handler's back-off");
      await sleep(500);
      assert.equal(runs.length, 1, "the key is held by its back-off");
      const now = Date.now();
      const hold = await client.resumeKey("held");
      resumed = performance.now();
      assert.ok(hold !== undefined, "the back-off was lifted");
      assert.deepEqual([hold.key, hold.shard, hold.jobs], ["held", placed.shard, [placed.id]]);
      assert.ok(
        hold.untilMs >= now + LONG_BACK_OFF_MS - 10_000 && hold.untilMs <= now + LONG_BACK_OFF_MS + 1_000,
        `untilMs ${hold.untilMs - now} ms from now`,
      );
      await until(() => runs.length === 2 && worker.stats.acked === 1, 10_000, "the resumed job to run and be acked");
      // Nothing holds the key now: nothing is lifted, and it says so.
      assert.equal(await client.resumeKey("held"), undefined);
      assert.equal(await client.resumeKey("never-seen"), undefined);
      assert.equal(await client.resumeKey("vip/1 ü?x"), undefined, "a key that needs percent-encoding");
      // A bad key: 400, the message names the key; an empty one is refused before any request.
      await assert.rejects(client.resumeKey("k".repeat(1025)), (err: unknown) => err instanceof BadRequest && err.status === 400 && (err.serverError ?? "").includes("key"));
      await assert.rejects(client.resumeKey(""), TypeError);
    } finally {
      worker.stop();
    }
    const stats = await ran;
    assert.deepEqual(runs.map((r) => r.attempt), [1, 1], "a back-off uses no attempt, and a resume none either");
    assert.ok(runs[1]!.at - resumed < RESUMED_START_MS, `the resumed job started ${Math.round(runs[1]!.at - resumed)} ms after the resume`);
    assert.deepEqual([stats.backedOff, stats.failed, stats.acked], [1, 0, 1], log.lines.join("\n"));
    await s.settle({ ready: 0, delayed: 0, in_flight: 0, dead: 0 });
  } finally {
    client.close();
    await c.close();
  }
});

test("resumeGroup lifts a group BackOff: the group's other key runs at once, the key that backed off waits until resumeKey", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  const s = c.servers[0]!;
  const client = new Client([s.url]);
  try {
    await client.setGroup("partner", { rate: "1000/s" });
    await client.setPolicy({ prefix: "p:", group: "partner" });
    await sleep(SETTINGS_REACH_MS);
    const first = await client.enqueue("p:a", "x");
    const starts = new Map<string, number[]>();
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    const ran = worker.run(
      async (job) => {
        const seen = starts.get(job.key) ?? [];
        seen.push(performance.now());
        starts.set(job.key, seen);
        if (job.key === "p:a" && seen.length === 1) throw new BackOff(LONG_BACK_OFF_MS, { group: true });
      },
      { concurrency: 2, prefetch: 0, waitMs: 200, leaseMs: 5000, handleSignals: false },
    );
    try {
      await until(() => worker.stats.backedOff === 1, 15_000, "the group's back-off");
      // The group's other key waits; a key of no group runs.
      await client.enqueueMany([
        { key: "p:b", payload: "x" },
        { key: "free", payload: "x" },
      ]);
      await until(() => starts.has("free"), 10_000, "the key of no group to run");
      await sleep(1_000);
      assert.equal(starts.has("p:b"), false, "the group's hold lets none of its keys start");
      assert.equal(await client.resumeGroup("partner"), true);
      let resumed = performance.now();
      await until(() => starts.has("p:b"), 10_000, "the group's other key to run");
      const pb = starts.get("p:b")![0]! - resumed;
      assert.ok(pb < RESUMED_START_MS, `the group's other key started ${Math.round(pb)} ms after the resume`);
      // The key that backed off keeps its own wait, which resumeKey lifts.
      await sleep(500);
      assert.equal(starts.get("p:a")!.length, 1, "the group's resume leaves the key's own back-off");
      const hold = await client.resumeKey("p:a");
      resumed = performance.now();
      assert.deepEqual(hold?.jobs, [first.id]);
      await until(() => worker.stats.acked === 3, 10_000, "every job to run");
      const pa = starts.get("p:a")![1]! - resumed;
      assert.ok(pa < RESUMED_START_MS, `the key started ${Math.round(pa)} ms after its resume`);
      // A group with no hold, or none at all: nothing to lift, answered the same.
      assert.equal(await client.resumeGroup("partner"), true);
      assert.equal(await client.resumeGroup("no-such-group"), true);
      for (const bad of ["none", "g".repeat(129)]) {
        await assert.rejects(client.resumeGroup(bad), (err: unknown) => err instanceof BadRequest && err.status === 400 && (err.serverError ?? "").includes("group"));
      }
      await assert.rejects(client.resumeGroup(""), TypeError);
    } finally {
      worker.stop();
    }
    const stats = await ran;
    assert.deepEqual([stats.backedOff, stats.failed, stats.acked], [1, 0, 3], log.lines.join("\n"));
    await s.settle({ ready: 0, delayed: 0, in_flight: 0, dead: 0 });
  } finally {
    client.close();
    await c.close();
  }
});
