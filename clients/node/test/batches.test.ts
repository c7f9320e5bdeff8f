// Batches (jobs on any keys under one id, with callbacks run once) through
// the Client and a Worker, against a real `shardq serve` that owns every
// shard (so it runs the resolver that releases the batch's jobs and fires
// its callbacks): jobs over several keys sent twice with their dedup ids
// (stored once), run while the batch is open without a callback, then the
// batch closed and its complete and success callbacks claimed once each; a
// handler adding to its own closed batch; dead jobs firing the death
// callback once and never the success one; bad input refused naming the
// field, the client's own checks before any request; an open retried on
// another server with the same dedup id; the README's batches block.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { BadRequest, Client, Worker, type BatchInfo, type ClaimedJob, type JobSpec } from "../src/index.js";
import { cluster, collectingLogger, until } from "../test-support/cluster.js";
import { FakeServer } from "../test-support/fake-server.js";

const WAIT_MS = 30_000;

/** A handler recording every job it runs: `boom` throws, `fan` first adds a job to its own batch, any other returns `r-PAYLOAD`. */
function recorder(client: Client) {
  const jobs: ClaimedJob[] = [];
  const handler = async (job: ClaimedJob): Promise<string> => {
    jobs.push(job);
    const text = job.payload.toString();
    if (text === "boom") throw new Error("the export broke");
    if (text === "fan" && job.batch !== undefined) {
      const added = await client.enqueue("fan-child", "child", { batch: job.batch, dedupId: `child-of-${String(job.id)}` });
      assert.ok(added.batch === job.batch && added.waiting, JSON.stringify(added));
    }
    return `r-${text}`;
  };
  return {
    jobs,
    handler,
    callbacks: (batch: string) => jobs.filter((j) => j.batch === batch && j.batchCallback !== undefined),
    ran: (batch: string) => jobs.filter((j) => j.batch === batch && j.batchCallback === undefined),
  };
}
type Recorder = ReturnType<typeof recorder>;

/** Runs `handler` on a Worker while `body` runs. */
async function withWorker<T>(url: string, handler: (job: ClaimedJob) => Promise<unknown>, body: () => Promise<T>): Promise<T> {
  const worker = new Worker([url], { logger: collectingLogger() });
  const running = worker.run(handler, { concurrency: 4, waitMs: 100, handleSignals: false });
  try {
    return await body();
  } finally {
    worker.stop();
    await running;
  }
}

async function shown(client: Client, batch: string): Promise<BatchInfo> {
  const info = await client.batch(batch);
  assert.ok(info !== undefined, `batch ${batch} unknown`);
  return info;
}

/** Resolves once `batch` is complete and `kinds` of its callbacks ran. */
async function completeWith(client: Client, rec: Recorder, batch: string, kinds: number): Promise<void> {
  await until(async () => (await shown(client, batch)).state === "complete" && rec.callbacks(batch).length >= kinds, WAIT_MS, `${batch} to complete with ${kinds} callbacks run`);
}

/**
 * Resolves once a resolver pass that started after this call released a
 * job: a probe batch's job, run by `rec`'s worker. A callback due twice
 * would have been enqueued by then (and any later pass finds the batch
 * complete).
 */
async function afterAResolverPass(client: Client, rec: Recorder, tag: string): Promise<void> {
  const probe = await client.openBatch(`probe-cb-${tag}`, { onComplete: "probe-done" });
  await client.enqueue(`probe-${tag}`, "probe", { batch: probe });
  await until(() => rec.ran(probe).length === 1, WAIT_MS, `the probe job of ${probe} to run`);
}

test("a batch over keys: resent jobs stored once, no callback while open, complete and success claimed once each after close", { timeout: 90_000 }, async () => {
  const c = await cluster(4, 1);
  try {
    const url = c.servers[0]!.url;
    const client = new Client([url]);
    const b = await client.openBatch("b-cb", { onComplete: "done", onSuccess: new TextEncoder().encode("all-ok"), onDeath: "died", dedupId: "nightly" });
    assert.match(b, /^@\d+$/);
    assert.equal(await client.openBatch("b-cb", { onComplete: "done", dedupId: "nightly" }), b);

    const jobs = (): JobSpec[] => Array.from({ length: 6 }, (_, i) => ({ key: `b-k${i % 3}`, payload: `p${i}`, dedupId: `d${i}`, batch: b }));
    const placed = await client.enqueueMany(jobs());
    assert.deepEqual(placed.map((p) => p.key), Array.from({ length: 6 }, (_, i) => `b-k${i % 3}`));
    assert.ok(placed.every((p) => /^@\d+$/.test(String(p.id)) && p.shard === "" && p.waiting && p.batch === b && !p.duplicate), JSON.stringify(placed));
    assert.equal(new Set(placed.map((p) => p.id)).size, 6);
    const again = await client.enqueueMany(jobs());
    assert.deepEqual(again.map((p) => [p.id, p.duplicate]), placed.map((p) => [p.id, true]));
    // Without a dedup id of its own: the generated one is in the result; sent again with it, a duplicate.
    const first = await client.enqueue("b-k9", "p6", { batch: b });
    assert.ok(first.dedupId !== "" && !first.duplicate);
    const resent = await client.enqueue("b-k9", "p6", { batch: b, dedupId: first.dedupId });
    assert.deepEqual([resent.id, resent.duplicate], [first.id, true]);

    const info = await shown(client, b);
    assert.equal(info.id, b);
    assert.equal(info.key, "b-cb");
    assert.equal(info.state, "open");
    assert.deepEqual(info.counts, { jobs: 7, pending: 7, completed: 0, dead: 0, other: 0 });
    assert.deepEqual(info.jobs.map((j) => j.id), [...placed.map((p) => String(p.id)), String(first.id)]);
    assert.deepEqual(
      Object.entries(info.callbacks).map(([k, cb]) => [k, cb.kind, cb.payload.toString(), cb.fired]).sort(),
      [["complete", "complete", "done", undefined], ["death", "death", "died", undefined], ["success", "success", "all-ok", undefined]],
    );
    assert.ok(info.closedMs === undefined && info.endedMs === undefined && info.createdMs > 0);

    const rec = recorder(client);
    const cbs = await withWorker(url, rec.handler, async () => {
      // Open: every job runs (on its own key), no callback fires.
      await until(async () => (await shown(client, b)).counts.completed === 7, WAIT_MS, `the 7 jobs of ${b} to complete`);
      await afterAResolverPass(client, rec, "open");
      assert.deepEqual(rec.callbacks(b), []);
      const ran = rec.ran(b);
      assert.deepEqual(ran.map((j) => j.payload.toString()).sort(), Array.from({ length: 7 }, (_, i) => `p${i}`).sort());
      assert.deepEqual(new Set(ran.map((j) => j.dependent)), new Set(info.jobs.map((j) => j.id)), "a job of a batch is its @M's job");
      assert.equal((await shown(client, b)).state, "open");

      assert.equal(await client.closeBatch(b), true);
      assert.equal(await client.closeBatch(b), false, "closed already");
      await completeWith(client, rec, b, 2);
      await afterAResolverPass(client, rec, "closed");
      await afterAResolverPass(client, rec, "again");
      return rec.callbacks(b);
    });
    assert.deepEqual(cbs.map((j) => [j.batchCallback, j.payload.toString(), j.key, j.batch]).sort(), [
      ["complete", "done", "b-cb", b],
      ["success", "all-ok", "b-cb", b],
    ]);
    const done = await shown(client, b);
    assert.equal(done.state, "complete");
    assert.deepEqual(done.counts, { jobs: 7, pending: 0, completed: 7, dead: 0, other: 0 });
    assert.equal(done.callbacks.complete?.fired, String(cbs.find((j) => j.batchCallback === "complete")!.id));
    assert.equal(done.callbacks.success?.fired, String(cbs.find((j) => j.batchCallback === "success")!.id));
    assert.equal(done.callbacks.death?.fired, undefined);
    assert.deepEqual(done.jobs.map((j) => [j.outcome, j.resultText]), Array.from({ length: 7 }, (_, i) => ["completed", `r-p${i}`]));
    assert.ok(done.jobs.every((j) => j.at !== undefined && !j.at.startsWith("@")));
    assert.ok(done.closedMs !== undefined && done.endedMs !== undefined && done.endedMs >= done.closedMs);
    // A complete batch takes no job.
    await assert.rejects(client.enqueue("b-k0", "late", { batch: b }), (err: unknown) => err instanceof BadRequest && err.message.includes(b));
    client.close();
  } finally {
    await c.close();
  }
});

test("a job of a closed batch adds to it, and the complete callback waits for the new job", { timeout: 60_000 }, async () => {
  const c = await cluster(4, 1);
  try {
    const url = c.servers[0]!.url;
    const client = new Client([url]);
    const b = await client.openBatch("fan-cb", { onComplete: "fan-done", onSuccess: "fan-ok" });
    await client.enqueue("fan-parent", "fan", { batch: b });
    assert.equal(await client.closeBatch(b), true);
    const rec = recorder(client);
    const cbs = await withWorker(url, rec.handler, async () => {
      await completeWith(client, rec, b, 2);
      await afterAResolverPass(client, rec, "fan");
      return rec.callbacks(b);
    });
    assert.deepEqual(cbs.map((j) => j.batchCallback).sort(), ["complete", "success"]);
    const info = await shown(client, b);
    assert.equal(info.counts.jobs, 2);
    assert.equal(info.counts.completed, 2);
    assert.deepEqual(info.jobs.map((j) => j.resultText), ["r-fan", "r-child"]);
    const order = rec.jobs.filter((j) => j.batch === b).map((j) => j.batchCallback ?? j.key);
    assert.ok(order.indexOf("fan-child") < order.indexOf("complete"), order.join(","));
    client.close();
  } finally {
    await c.close();
  }
});

test("dead jobs fire the death callback once and never the success one", { timeout: 60_000 }, async () => {
  const c = await cluster(4, 1);
  try {
    const url = c.servers[0]!.url;
    const client = new Client([url]);
    const b = await client.openBatch("d-cb", { onComplete: "d-done", onSuccess: "d-ok", onDeath: "d-died", maxAttempts: 2 });
    const placed = await client.enqueueMany([
      { key: "d-a", payload: "fine", batch: b },
      { key: "d-x", payload: "boom", maxAttempts: 1, batch: b },
      { key: "d-b", payload: "fine", batch: b },
      { key: "d-y", payload: "boom", maxAttempts: 1, batch: b },
    ]);
    assert.equal(await client.closeBatch(b), true);
    const rec = recorder(client);
    const cbs = await withWorker(url, rec.handler, async () => {
      await completeWith(client, rec, b, 2);
      await afterAResolverPass(client, rec, "dead");
      await afterAResolverPass(client, rec, "dead-again");
      return rec.callbacks(b);
    });
    assert.deepEqual(cbs.map((j) => [j.batchCallback, j.payload.toString(), j.maxAttempts]).sort(), [
      ["complete", "d-done", 2],
      ["death", "d-died", 2],
    ]);
    const info = await shown(client, b);
    assert.equal(info.state, "complete");
    assert.equal(info.callbacks.success?.fired, undefined);
    assert.deepEqual(info.counts, { jobs: 4, pending: 0, completed: 2, dead: 2, other: 0 });
    const byId = new Map(info.jobs.map((j) => [j.id, j]));
    for (const p of placed) {
      const j = byId.get(String(p.id))!;
      if (p.key === "d-x" || p.key === "d-y") {
        assert.equal(j.outcome, "dead");
        assert.equal(j.result, undefined);
        assert.ok((j.reason ?? "").includes("the export broke"), j.reason);
      } else {
        assert.deepEqual([j.outcome, j.resultText], ["completed", "r-fine"]);
      }
    }
    client.close();
  } finally {
    await c.close();
  }
});

test("bad input is refused naming it; the client's own checks send nothing", { timeout: 60_000 }, async () => {
  const c = await cluster(4, 1);
  try {
    const client = new Client([c.servers[0]!.url]);
    const b = await client.openBatch("x-cb", { onDeath: "x" });
    const refused = (says: string) => (err: unknown) => {
      assert.ok(err instanceof BadRequest, String(err));
      assert.equal(err.status, 400);
      assert.ok(err.message.includes(says), err.message);
      return true;
    };
    await assert.rejects(client.openBatch("x-cb", { onComplete: "x", dedupId: "bad\u0001id" }), refused("dedup_id"));
    await assert.rejects(client.openBatch("k".repeat(2000), { onComplete: "x" }), refused("key"));
    await assert.rejects(client.openBatch("x-cb", { onComplete: "x", maxAttempts: 5000 }), refused("max attempts 5000"));
    assert.equal(await client.batch("@987654"), undefined);
    await assert.rejects(client.closeBatch("@987654"), (err: unknown) => {
      assert.ok(err instanceof BadRequest, String(err));
      assert.equal(err.status, 404);
      assert.ok(err.message.includes("@987654"), err.message);
      return true;
    });
    await assert.rejects(client.enqueue("x-k", "x", { batch: "@987654" }), refused("@987654"));
    await assert.rejects(client.enqueue("x-k", "x", { batch: b, dedupId: `batch:${b}:death` }), refused("dedup_id"));
    await assert.rejects(client.enqueue("x-k", "x".repeat(64 * 1024 + 1), { batch: b }), refused("payload"));
    assert.equal((await shown(client, b)).counts.jobs, 0);
    client.close();
  } finally {
    await c.close();
  }

  // Refused before anything is sent: a stand-in server sees no request.
  const fake = await new FakeServer("nothing-sent").start();
  try {
    const local = new Client([fake.url]);
    const before: [() => Promise<unknown>, RegExp][] = [
      [() => local.openBatch("cb", {}), /openBatch: no callbacks: at least one of onComplete, onSuccess, onDeath/],
      [() => local.openBatch("", { onComplete: "x" }), /openBatch: key must be a non-empty string/],
      [() => local.openBatch("cb", { onComplete: new Uint8Array([0xff]) }), /openBatch: onComplete must be UTF-8 text/],
      [() => local.openBatch("cb", { onDeath: "x", maxAttempts: 0 }), /openBatch: maxAttempts must be a positive integer, got 0/],
      [() => local.openBatch("cb", { onDeath: "x", dedupId: "" }), /openBatch: dedupId must be a non-empty string/],
      [() => local.batch("7"), /batch: id must be a batch's id "@N".*"7"/],
      [() => local.batch("shard-0:1"), /"shard-0:1"/],
      [() => local.closeBatch("@"), /closeBatch: id must be a batch's id "@N".*"@"/],
      [() => local.enqueue("s", "x", { batch: "7" }), /jobs\[0\]\.batch must be a batch's id "@N".*"7"/],
      [() => local.enqueueMany([{ key: "s", payload: "x", batch: "@1" }, { key: "t", payload: "y" }]), /jobs\[1\] \(key "t"\): batch undefined where the jobs of this call join "@1"/],
      [() => local.enqueueMany([{ key: "s", payload: "x", batch: "@1" }, { key: "t", payload: "y", batch: "@2" }]), /batch "@2" where/],
      [() => local.enqueueMany([{ key: "s", payload: "x" }, { key: "t", payload: "y", batch: "@1" }]), /jobs\[0\] \(key "s"\): batch undefined where/],
      [() => local.enqueue("s", "x", { batch: "@1", after: ["@2"] }), /takes no after \["@2"\]/],
      [() => local.enqueue("s", "x", { batch: "@1", onDependencyFailure: "run" }), /takes no onDependencyFailure "run"/],
      [() => local.enqueue("s", "x", { batch: "@1", uniqueId: "u" }), /takes no uniqueId "u"/],
      [() => local.enqueue("s", "x", { batch: "@1", debounceId: "d", debounceMs: 5 }), /takes no debounceId "d", debounceMs 5/],
    ];
    for (const [call, says] of before) await assert.rejects(call(), (err: unknown) => err instanceof TypeError && says.test(err.message));
    assert.equal(fake.requests.length, 0);
    local.close();
  } finally {
    await fake.close();
  }
});

test("an open is retried on another server with the same dedup id, and so is a close", async () => {
  const broken = await new FakeServer("broken").start();
  const spare = await new FakeServer("spare").start();
  try {
    broken.answers.set("/v1/batches", { status: 503, body: { error: "the store is unavailable" } });
    spare.answers.set("/v1/batches", { status: 200, body: { id: "@5", duplicate: true } });
    const client = new Client([broken.url, spare.url], { backoffMs: 1 });
    assert.equal(await client.openBatch("cb", { onComplete: "done" }), "@5");
    assert.equal(broken.requests.length, 1);
    assert.equal(spare.requests.length, 1);
    const sent = broken.requests[0]!.body as Record<string, unknown>;
    assert.deepEqual(spare.requests[0]!.body, sent);
    assert.equal(sent["key"], "cb");
    assert.equal(sent["on_complete"], "done");
    assert.match(String(sent["dedup_id"]), /^batch-/);
    broken.answers.set("/v1/batches/@5/close", { status: 503, body: { error: "the store is unavailable" } });
    spare.answers.set("/v1/batches/@5/close", { status: 200, body: { id: "@5", closed: false } });
    assert.equal(await client.closeBatch("@5"), false);
    assert.deepEqual(spare.requests.map((r) => r.path), ["/v1/batches", "/v1/batches/@5/close"]);
    client.close();
  } finally {
    await broken.close();
    await spare.close();
  }
});

test("the README's batches example runs as written", { timeout: 60_000 }, async () => {
  const readme = readFileSync(join(dirname(fileURLToPath(import.meta.url)), "..", "..", "README.md"), "utf8");
  const section = readme.split("### Batches")[1] ?? "";
  const block = /^```js\n([\s\S]*?)^```/m.exec(section);
  assert.ok(block !== null, "the README's batches section has a js block");
  const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor as new (...args: string[]) => (...args: unknown[]) => Promise<unknown>;
  const c = await cluster(4, 1);
  try {
    const url = c.servers[0]!.url;
    const client = new Client([url]);
    const worker = new Worker([url], { logger: collectingLogger() });
    const run = new AsyncFunction("client", "worker", "console", `${block[1]}\nreturn { batch, running };`);
    const logged: unknown[][] = [];
    const out = (await run(client, worker, { log: (...args: unknown[]) => logged.push(args) })) as { batch: string; running: Promise<unknown> };
    try {
      await until(async () => {
        const fired = (await shown(client, out.batch)).callbacks.complete?.fired;
        return fired !== undefined && (await client.finished(fired)) !== undefined;
      }, WAIT_MS, `the complete callback of ${out.batch} to run`);
    } finally {
      worker.stop();
      await out.running;
    }
    const info = await shown(client, out.batch);
    assert.equal(info.state, "complete");
    assert.equal(info.counts.completed, 2);
    assert.equal(info.callbacks.death?.fired, undefined);
    const summary = await client.finished(info.callbacks.complete!.fired!);
    assert.equal(summary?.resultText, "2 of 2 exported");
    assert.equal(logged.length, 1);
    assert.equal(logged[0]![0], out.batch);
    assert.ok(["closed", "complete"].includes(String(logged[0]![1])), String(logged[0]![1]));
    client.close();
  } finally {
    await c.close();
  }
});
