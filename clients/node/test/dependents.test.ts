// Dependents (jobs enqueued with `after`) through the Client and a Worker,
// against a real `shardq serve` that owns every shard (so it runs the
// resolver that releases them): a fan-in whose handler reads its
// dependencies' results with `client.dependent`, a graph by indexes in one
// request, the policies under a dead dependency (`result("@N")` rejects
// with `JobDied`), cancels, the checks made before anything is sent (a
// cycle, a request over the client's batch limit) and the server's refusal
// of an unknown id. Stand-in servers show that a request with `after`, which
// carries no dedup ids, is not sent again once a try may have stored it.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createServer } from "node:net";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { BadRequest, Client, JobDied, ResultTimeout, ServerUnavailable, Worker, type ClaimedJob, type DependentInfo, type JobSpec } from "../src/index.js";
import { cluster, collectingLogger } from "../test-support/cluster.js";
import { FakeServer } from "../test-support/fake-server.js";

/**
 * A handler: a plain job, or a graph's root (a dependent with no
 * dependencies), returns `r-KEY`; a released dependent reads its
 * dependencies with `client.dependent(job.dependent)` and returns their
 * results joined in the order named (`<OUTCOME>` for one without).
 */
function fanIn(client: Client, seen: Map<string, DependentInfo>, ran: string[] = []) {
  return async (job: ClaimedJob): Promise<string> => {
    ran.push(job.key);
    if (job.payload.toString() === "boom") throw new Error("the export broke");
    if (job.dependent === undefined) return `r-${job.key}`;
    const info = await client.dependent(job.dependent);
    assert.ok(info !== undefined && info.state === "released" && info.released === String(job.id), JSON.stringify(info));
    seen.set(job.dependent, info);
    if (info.after.length === 0) return `r-${job.key}`;
    return info.after.map((d) => d.resultText || `<${d.outcome}>`).join("+");
  };
}

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

test("a fan-in over job ids runs after its dependencies, and its handler reads their results with dependent()", { timeout: 60_000 }, async () => {
  const c = await cluster(4, 1);
  try {
    const url = c.servers[0]!.url;
    const client = new Client([url]);
    const children = await client.enqueueMany(["tenant-a", "tenant-b", "tenant-c"].map((key) => ({ key, payload: JSON.stringify({ key }) })));
    assert.ok(children.every((p) => !p.waiting && p.shard !== ""));
    const fan = await client.enqueue("reports", "merge", { after: children.map((p) => String(p.id)) });
    assert.match(String(fan.id), /^@\d+$/);
    assert.equal(fan.shard, "");
    assert.equal(fan.waiting, true);
    assert.equal(fan.dedupId, "");
    const waiting = await client.dependent(String(fan.id));
    assert.equal(waiting?.state, "waiting");
    assert.equal(waiting?.released, undefined);
    assert.deepEqual(waiting?.after.map((d) => [d.id, d.outcome]), children.map((p) => [String(p.id), undefined]));
    assert.equal(waiting?.payload.toString(), "merge");
    assert.equal(waiting?.onDependencyFailure, "fail");
    await assert.rejects(client.result(String(fan.id), 300), (err: unknown) => err instanceof ResultTimeout && err.state === "waiting");

    const seen = new Map<string, DependentInfo>();
    const done = await withWorker(url, fanIn(client, seen), () => client.result(String(fan.id), 30_000));
    assert.equal(done.outcome, "completed");
    assert.equal(done.resultText, "r-tenant-a+r-tenant-b+r-tenant-c");
    assert.deepEqual(
      seen.get(String(fan.id))!.after.map((d) => [d.id, d.outcome, d.resultText]),
      children.map((p) => [String(p.id), "completed", `r-${p.key}`]),
    );
    const after = await client.dependent(String(fan.id));
    assert.equal(after?.state, "released");
    assert.equal(after?.released, done.id);
    assert.ok(after?.endedMs !== undefined && after.endedMs >= after.createdMs);
    client.close();
  } finally {
    await c.close();
  }
});

test("a graph by indexes goes in one request; a dead dependency fails its dependent under fail, not under run or ignore", { timeout: 60_000 }, async () => {
  const c = await cluster(4, 1);
  try {
    const url = c.servers[0]!.url;
    const client = new Client([url]);
    const placed = await client.enqueueGraph([
      { key: "g-a", payload: "a" },
      { key: "g-b", payload: "b" },
      { key: "g-c", payload: "c", after: [0, 1] },
      { key: "g-d", payload: "d", after: [2] },
      { key: "g-x", payload: "boom", maxAttempts: 1 },
      { key: "g-fail", payload: "never", after: [4] },
      { key: "g-run", payload: "anyway", after: [4], onDependencyFailure: "run" },
      { key: "g-ignore", payload: "without", after: [4, 1], onDependencyFailure: "ignore" },
    ]);
    assert.deepEqual(placed.map((p) => p.key), ["g-a", "g-b", "g-c", "g-d", "g-x", "g-fail", "g-run", "g-ignore"]);
    assert.ok(placed.every((p) => /^@\d+$/.test(String(p.id)) && p.shard === "" && p.waiting && p.dedupId === ""));
    const ids = placed.map((p) => String(p.id));
    const seen = new Map<string, DependentInfo>();
    const ran: string[] = [];
    await withWorker(url, fanIn(client, seen, ran), async () => {
      assert.equal((await client.result(ids[3]!, 30_000)).resultText, "r-g-a+r-g-b");
      await assert.rejects(client.result(ids[5]!, 30_000), (err: unknown) => {
        assert.ok(err instanceof JobDied, String(err));
        assert.equal(err.id, ids[5]);
        assert.equal(err.dependentState, "failed");
        assert.ok((err.reason ?? "").includes(ids[4]!), err.reason);
        return true;
      });
      assert.equal((await client.result(ids[6]!, 30_000)).resultText, "<dead>");
      assert.equal((await client.result(ids[7]!, 30_000)).outcome, "completed");
    });
    assert.ok(!ran.includes("g-fail"), ran.join(","));
    // An index names the other job's @N; where it ran is its released job.
    const cInfo = seen.get(ids[2]!)!;
    assert.deepEqual(cInfo.after.map((d) => d.id), ids.slice(0, 2));
    assert.ok(cInfo.after.every((d) => d.at !== undefined && !d.at.startsWith("@")));
    await assert.rejects(client.result(ids[4]!, 1000), JobDied);
    const failed = await client.dependent(ids[5]!);
    assert.equal(failed?.state, "failed");
    assert.equal(failed?.released, undefined);
    assert.equal(failed?.after.length, 1);
    assert.equal(failed?.after[0]?.outcome, "dead");
    assert.ok((failed?.after[0]?.reason ?? "").includes("the export broke"));
    assert.equal(seen.get(ids[6]!)?.after[0]?.outcome, "dead");
    client.close();
  } finally {
    await c.close();
  }
});

test("cancel of a waiting dependent, then again; an unknown dependency is refused naming it", { timeout: 60_000 }, async () => {
  const c = await cluster(4, 1);
  try {
    const client = new Client([c.servers[0]!.url]);
    const hold = await client.enqueue("c-hold", "later", { delayMs: 600_000 });
    const dep = await client.enqueue("c-dep", "never", { after: [String(hold.id)] });
    assert.equal(await client.cancel(String(dep.id)), true);
    assert.equal(await client.cancel(String(dep.id)), false, "an ended dependent is not cancelled again");
    await assert.rejects(client.result(String(dep.id), 1000), (err: unknown) => err instanceof JobDied && err.dependentState === "cancelled");
    assert.equal((await client.dependent(String(dep.id)))?.state, "cancelled");

    for (const missing of ["shard-0:987654", "@987654"]) {
      await assert.rejects(client.enqueue("b-key", "x", { after: [missing] }), (err: unknown) => {
        assert.ok(err instanceof BadRequest, String(err));
        assert.equal(err.status, 400);
        assert.ok(err.message.includes(missing), err.message);
        return true;
      });
    }
    assert.equal(await client.dependent("@987654"), undefined);
    await assert.rejects(client.dependent("shard-0:1"), /id must be "@N".*"shard-0:1"/);
    client.close();
  } finally {
    await c.close();
  }
});

test("bad after, a cycle and a graph over batchJobsMax are refused before anything is sent", async () => {
  const fake = await new FakeServer("shard-a").start();
  try {
    const client = new Client([fake.url], { batchJobsMax: 3 });
    await assert.rejects(
      client.enqueueGraph([
        { key: "n-0", payload: "0" },
        { key: "n-1", payload: "1", after: [0, 3] },
        { key: "n-2", payload: "2", after: [1] },
        { key: "n-3", payload: "3", after: [2] },
      ]),
      (err: unknown) => {
        assert.ok(err instanceof TypeError);
        assert.ok(err.message.includes('jobs 1 (key "n-1") -> 3 (key "n-3") -> 2 (key "n-2") -> 1 (key "n-1") form a cycle'), err.message);
        return true;
      },
    );
    await assert.rejects(
      client.enqueueMany(Array.from({ length: 4 }, (_, i): JobSpec => ({ key: `m-${i}`, payload: "x", ...(i > 0 ? { after: [i - 1] } : {}) }))),
      /4 jobs, over this client's batchJobsMax of 3/,
    );
    const bad: [JobSpec, RegExp][] = [
      [{ key: "s", payload: "x", after: [0] }, /its own index/],
      [{ key: "s", payload: "x", after: [5] }, /not an index of this request's jobs/],
      [{ key: "s", payload: "x", after: "shard-0:1" as unknown as string[] }, /one id goes in an array/],
      [{ key: "s", payload: "x", after: [true as unknown as number] }, /after\[0\] must be a job id/],
      [{ key: "s", payload: "x", after: ["@1", "@1"] }, /named twice/],
      [{ key: "s", payload: "x", after: ["@1"], onDependencyFailure: "skip" as "run" }, /onDependencyFailure must be fail, ignore or run, got "skip"/],
      [{ key: "s", payload: "x", onDependencyFailure: "run" }, /without after/],
      [{ key: "s", payload: "x", after: ["@1"], dedupId: "d-1" }, /takes no dedupId "d-1"/],
    ];
    for (const [job, says] of bad) await assert.rejects(client.enqueueMany([job]), says);
    await assert.rejects(client.enqueueGraph([{ key: "s", payload: "x" }]), /none of the 1 jobs has after/);
    assert.equal(fake.requests.length, 0);
  } finally {
    await fake.close();
  }
});

test("a request with after is tried again only while no try may have stored it", async () => {
  const port = await new Promise<number>((resolve) => {
    const s = createServer().listen(0, "127.0.0.1", () => {
      const p = (s.address() as { port: number }).port;
      s.close(() => resolve(p));
    });
  });
  const busy = await new FakeServer("busy").start();
  const broken = await new FakeServer("broken").start();
  const spare = await new FakeServer("spare").start();
  try {
    busy.inject.set("/v1/jobs", [429]);
    broken.inject.set("/v1/jobs", [503]);
    // A refused connection and a 429 stored nothing: tried on; the 503 may have.
    const client = new Client([`http://127.0.0.1:${port}`, busy.url, broken.url, spare.url], { backoffMs: 1 });
    await assert.rejects(
      client.enqueueGraph([
        { key: "r-a", payload: "a" },
        { key: "r-b", payload: "b", after: [0] },
      ]),
      (err: unknown) => {
        assert.ok(err instanceof ServerUnavailable, String(err));
        assert.match(err.message, /not sent again/);
        assert.equal(err.status, 503);
        assert.equal(err.causes.length, 3);
        return true;
      },
    );
    assert.deepEqual([busy, broken, spare].map((f) => f.requests.length), [1, 1, 0]);
    assert.deepEqual(broken.requests[0]!.body, { jobs: [{ key: "r-a", payload: "a" }, { key: "r-b", payload: "b", after: [0] }] });
    client.close();
  } finally {
    for (const f of [busy, broken, spare]) await f.close();
  }
});

test("the README's dependents example runs as written", { timeout: 60_000 }, async () => {
  const readme = readFileSync(join(dirname(fileURLToPath(import.meta.url)), "..", "..", "README.md"), "utf8");
  const section = readme.split("### Dependents")[1] ?? "";
  const block = /^```js\n([\s\S]*?)^```/m.exec(section);
  assert.ok(block !== null, "the README's dependents section has a js block");
  const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor as new (...args: string[]) => (...args: unknown[]) => Promise<unknown>;
  const c = await cluster(4, 1);
  try {
    const url = c.servers[0]!.url;
    const client = new Client([url]);
    const worker = new Worker([url], { logger: collectingLogger() });
    const run = new AsyncFunction("client", "worker", "console", `${block[1]}\nreturn { done, sent, merge };`);
    const logged: unknown[][] = [];
    const out = (await run(client, worker, { log: (...args: unknown[]) => logged.push(args) })) as Record<string, { resultText?: string; id: string }>;
    assert.equal(out["done"]!.resultText, "exported+exported");
    assert.equal(out["sent"]!.resultText, "exported+exported");
    assert.deepEqual(logged, [[out["merge"]!.id, true]]);
    client.close();
  } finally {
    await c.close();
  }
});
