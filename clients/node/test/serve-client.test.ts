// Client against real `shardq serve` processes: batches split by bytes and
// by count under the server's limits, the error classes, and an operator's
// reads and cancels of jobs by id.

import assert from "node:assert/strict";
import { test } from "node:test";

import { BadRequest, Client, JobDied, ResultTimeout, ShardqError, Worker } from "../src/index.js";
import { cluster, collectingLogger, until } from "../test-support/cluster.js";
import { shardq } from "../test-support/shardq-bin.js";

test("enqueueMany splits by bytes: twenty valid ~1 MiB jobs go in under the 16 MiB body limit", { timeout: 120_000 }, async () => {
  const c = await cluster(2, 1);
  try {
    const s = c.servers[0]!;
    const client = new Client([s.url]);
    const big = (i: number) => `${i}:`.padEnd(1_000_000, "x");
    const placed = await client.enqueueMany(Array.from({ length: 20 }, (_, i) => ({ key: `big-${i % 3}`, payload: big(i) })));
    assert.equal(placed.length, 20);
    assert.equal(new Set(placed.map((p) => p.id)).size, 20);
    assert.deepEqual((await s.status()).totals, { ready: 20, delayed: 0, in_flight: 0, dead: 0 });
    const seen = new Set<number>();
    const worker = new Worker([s.url], { logger: collectingLogger() });
    const ran = worker.run(
      async (job) => {
        const text = job.payload.toString();
        const i = Number(text.slice(0, text.indexOf(":")));
        assert.equal(text, big(i));
        seen.add(i);
      },
      { concurrency: 4, waitMs: 100, handleSignals: false },
    );
    await until(() => worker.stats.acked === 20, 60_000, "the big jobs to run");
    worker.stop();
    await ran;
    assert.equal(seen.size, 20);
  } finally {
    await c.close();
  }
});

test("batchJobsMax and batchBytesMax follow a server's --jobs-per-request-max and --body-bytes-max", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1, { args: ["--jobs-per-request-max", "10", "--body-bytes-max", "20000"] });
  try {
    const s = c.servers[0]!;
    const jobs = Array.from({ length: 45 }, (_, i) => ({ key: `k-${i}`, payload: "y".repeat(i % 2 === 0 ? 50 : 3000) }));
    // The defaults are over this server's limits: refused, not retried.
    await assert.rejects(new Client([s.url]).enqueueMany(jobs), (err: unknown) => err instanceof BadRequest && (err.status === 400 || err.status === 413));
    const placed = await new Client([s.url], { batchJobsMax: 10, batchBytesMax: 20000 }).enqueueMany(jobs);
    assert.equal(placed.length, 45);
    assert.ok(placed.every((p, i) => p.key === `k-${i}` && !p.duplicate));
    assert.equal((await s.status()).totals["ready"], 45);
    // One job over the byte limit goes alone and the server says why.
    await assert.rejects(
      new Client([s.url], { batchJobsMax: 10, batchBytesMax: 20000 }).enqueue("huge", "z".repeat(30_000)),
      (err: unknown) => err instanceof ShardqError && err.status === 413,
    );
  } finally {
    await c.close();
  }
});

test("an id from before a move finds its copy", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  try {
    const s = c.servers[0]!;
    const client = new Client([s.url]);
    const placed = await client.enqueueMany(["p0", "p1", "p2"].map((p) => ({ key: "mv-k", payload: p })));
    const ids = placed.map((p) => String(p.id));
    const old = ids[0]!.split(":")[0]!;
    const to = old === "shard-0" ? "shard-1" : "shard-0";
    assert.equal(await client.moved(ids[0]!), undefined, "a live job did not move");
    shardq(["pin", "--data", c.data, "mv-k", to]);
    shardq(["rebalance", "--data", c.data]);
    const copy = await client.job(ids[1]!);
    assert.ok(copy && copy.shard === to && copy.payload.toString() === "p1", "the old id finds its copy");
    assert.notEqual(String(copy.id), ids[1], "the copy has its own id");
    assert.deepEqual(await client.moved(ids[1]!), { key: "mv-k", shard: to });
    const now = await client.keyJobs("mv-k");
    assert.deepEqual(now.map((j) => j.payload.toString()), ["p0", "p1", "p2"]);
    assert.ok(now.every((j) => j.shard === to));
    assert.equal(await client.moved(`${old}:999999999`), undefined, "an id never handed out");
  } finally {
    await c.close();
  }
});

test("an operator reads a job by id, lists its key's jobs and cancels one, and a running one's run ends", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  try {
    const s = c.servers[0]!;
    const client = new Client([s.url]);
    const placed = await client.enqueueMany(["p0", "p1", "p2"].map((p) => ({ key: "op-k", payload: p })));
    const ids = placed.map((p) => String(p.id));
    const one = await client.job(ids[1]!);
    assert.equal(one?.state, "queued");
    assert.equal(one?.payload.toString(), "p1");
    assert.equal(one?.attempts, 0);
    assert.deepEqual(one?.attemptStartsMs, [], "a job not started yet has no attempt times");
    assert.deepEqual((await client.keyJobs("op-k")).map((j) => j.id), ids);
    assert.equal((await client.keyJobs("op-k", 2)).length, 2);
    assert.equal(await client.cancel(ids[1]!), true);
    assert.equal(await client.cancel(ids[1]!), false, "a second cancel finds nothing");
    assert.equal(await client.job(ids[1]!), undefined);
    assert.equal((await client.finished(ids[1]!))?.outcome, "cancelled");
    await assert.rejects(client.keyJobs("op-k", 0), TypeError);

    const ran: string[] = [];
    let release: () => void = () => {};
    const gate = new Promise<void>((r) => (release = r));
    const worker = new Worker([s.url], { logger: collectingLogger() });
    const running = worker.run(
      async (job) => {
        ran.push(job.payload.toString());
        if (ran.length === 1) await gate;
      },
      { concurrency: 1, waitMs: 100, leaseMs: 1500, handleSignals: false },
    );
    await until(() => ran.length === 1, 30_000, "the first job to start");
    const first = await client.job(ids[0]!);
    assert.equal(first?.state, "running");
    assert.ok(first?.run !== undefined && first.run.fence > 0);
    // The running job's run is asked to stop; the job goes with it and the
    // key's last job runs after it, never beside it.
    assert.equal(await client.cancel(ids[0]!), true);
    release();
    await until(() => ran.length === 2, 30_000, "the other job to run");
    await until(() => worker.stats.acked === 1, 30_000, "its ack");
    worker.stop();
    await running;
    assert.deepEqual(ran, ["p0", "p2"]);
    assert.equal(await client.job(ids[0]!), undefined);
    // What became of each job stays readable, newest first.
    const finished = await client.keyFinished("op-k");
    assert.deepEqual(
      finished.map((f) => [f.id, f.outcome]),
      [
        [ids[2], "completed"],
        [ids[0], "cancelled"],
        [ids[1], "cancelled"],
      ],
    );
    assert.equal(finished[0]!.attempts, 1);
    assert.equal((await client.keyFinished("op-k", 1)).length, 1);
    await assert.rejects(client.keyFinished("op-k", 0), TypeError);
    client.close();
  } finally {
    await c.close();
  }
});

test("a handler's return value is its job's result, and result() waits for it", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  try {
    const s = c.servers[0]!;
    const client = new Client([s.url]);
    const placed = await client.enqueueMany([
      { key: "res-t", payload: "a" },
      { key: "res-b", payload: "b" },
      { key: "res-j", payload: "c" },
      { key: "res-n", payload: "d" },
      { key: "res-x", payload: "e", maxAttempts: 1 },
      { key: "res-big", payload: "f", maxAttempts: 1 },
    ]);
    const ids = placed.map((p) => String(p.id));
    // Not run yet: the wait ends without it.
    await assert.rejects(client.result(ids[0]!, 300), (err: unknown) => err instanceof ResultTimeout && err.state === "queued");
    const waiting = client.result(ids[0]!, 30_000);
    const worker = new Worker([s.url], { logger: collectingLogger() });
    const ran = worker.run(
      async (job) => {
        const p = job.payload.toString();
        if (job.key === "res-t") return `text:${p}`;
        if (job.key === "res-b") return Buffer.concat([Buffer.from([0xff, 0x00]), job.payload]);
        if (job.key === "res-j") return { n: 3, ok: true };
        if (job.key === "res-x") throw new Error("broken on purpose");
        if (job.key === "res-big") return "z".repeat(70_000);
        return undefined;
      },
      { concurrency: 2, waitMs: 100, handleSignals: false },
    );
    const t = await waiting;
    assert.equal(t.outcome, "completed");
    assert.equal(t.resultText, "text:a");
    assert.deepEqual((await client.result(ids[1]!)).result, Buffer.from([0xff, 0x00, 0x62]));
    assert.deepEqual(JSON.parse((await client.result(ids[2]!)).resultText ?? ""), { n: 3, ok: true });
    const none = await client.result(ids[3]!);
    assert.equal(none.outcome, "completed");
    assert.equal(none.result, undefined);
    await assert.rejects(client.result(ids[4]!), (err: unknown) => err instanceof JobDied && (err.reason ?? "").includes("broken on purpose"));
    await assert.rejects(client.result(ids[5]!), (err: unknown) => err instanceof JobDied && (err.reason ?? "").includes("over the 65536-byte bound"));
    worker.stop();
    await ran;
  } finally {
    await c.close();
  }
});
