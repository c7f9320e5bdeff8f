// A running job cancelled through the API (`DELETE /v1/jobs/{id}`) frees
// its key as soon as its handler is gone: the worker asks the server which
// runs are no longer current about once a second (`POST /v1/stale`), aborts
// the cancelled run's signal, and once the handler returned sends a fail,
// which the server refuses (409) but which ends the run. With the default
// job lease of 30 s the key's next job starts within about a second of the
// cancel, never while the cancelled handler still runs (before, it waited
// for the next extend, 10 s, and then for the lease to lapse, 30 s).

import assert from "node:assert/strict";
import { test } from "node:test";

import { Client, Worker } from "../src/index.js";
import { cluster, collectingLogger, until } from "../test-support/cluster.js";

test("a cancelled running job's key starts its next job within about a second, once the handler returned", { timeout: 90_000 }, async () => {
  const c = await cluster(2, 1);
  try {
    const s = c.servers[0]!;
    const client = new Client([s.url]);
    const long = await client.enqueue("tenant-c", "long");
    await client.enqueue("tenant-c", "next");
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    const stamps = new Map<string, number>();
    const ran = worker.run(
      async (job, { signal }) => {
        const body = job.payload.toString();
        if (body !== "long") {
          stamps.set("next started", performance.now());
          return;
        }
        stamps.set("long started", performance.now());
        // Far longer than every lease and timeout, unless its signal is aborted.
        await new Promise<void>((resolve) => {
          const t = setTimeout(resolve, 120_000);
          signal.addEventListener("abort", () => {
            clearTimeout(t);
            resolve();
          });
        });
        stamps.set("long aborted", performance.now());
        // Cleans up for a moment after it is told to stop.
        await new Promise((r) => setTimeout(r, 300));
        stamps.set("long ended", performance.now());
        throw new Error("stopped");
      },
      { concurrency: 2, handleSignals: false },
    );
    try {
      await until(() => stamps.has("long started"), 15_000, `the long job's start:\n${log.lines.join("\n")}`);
      await new Promise((r) => setTimeout(r, 200));
      assert.equal(await client.cancel(String(long.id)), true);
      const cancelled = performance.now();
      await until(() => stamps.has("next started"), 40_000, `the key's next job:\n${log.lines.join("\n")}`);
      const took = stamps.get("next started")! - cancelled;
      const ended = stamps.get("long ended");
      assert.ok(ended !== undefined && ended <= stamps.get("next started")!, "the next job started while the cancelled handler still ran");
      assert.ok(took < 3_000, `the key's next job started ${Math.round(took)} ms after the cancel (the extend comes every 10 s, the lease lapses after 30 s)`);
      console.log(`cancel to the key's next start: ${Math.round(took)} ms (handler aborted after ${Math.round(stamps.get("long aborted")! - cancelled)} ms)`);
      assert.equal((await client.finished(String(long.id)))?.outcome, "cancelled");
    } finally {
      worker.stop();
    }
    const stats = await ran;
    const lines = log.lines.join("\n");
    assert.deepEqual(
      { acked: stats.acked, failed: stats.failed, lost: stats.lost, unreported: stats.unreported },
      { acked: 1, failed: 0, lost: 1, unreported: 0 },
      lines,
    );
    await s.settle({ ready: 0, delayed: 0, in_flight: 0, dead: 0 });
  } finally {
    await c.close();
  }
});
