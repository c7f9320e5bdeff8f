// SIGINT and SIGTERM on worker processes against a real `shardq serve`: an
// idle worker stops at once (its long polls are cancelled), a busy one
// drains, and a second signal stops without draining.

import assert from "node:assert/strict";
import { test } from "node:test";

import { Client } from "../src/index.js";
import { cluster, until, workerProcess } from "../test-support/cluster.js";

test("SIGINT on an idle worker stops it at once; on a busy one a second SIGTERM stops without draining", { timeout: 60_000 }, async () => {
  const c = await cluster(4, 2);
  try {
    const urls = c.servers.map((s) => s.url).join(",");
    const idle = workerProcess({ URLS: urls, WAIT_MS: "30000" });
    // Idle for a while: its 30 s long polls are out.
    await new Promise((r) => setTimeout(r, 500));
    const t0 = Date.now();
    idle.child.kill("SIGINT");
    assert.equal(await idle.exited, 0, idle.err());
    const took = Date.now() - t0;
    assert.ok(took < 1000, `an idle worker took ${took} ms to stop on SIGINT`);
    assert.match(idle.err(), /SIGINT: draining \(0 job\(s\) running, 0 claimed ahead\)/);
    assert.deepEqual(idle.stats(), { claimed: 0, acked: 0, failed: 0, lost: 0, unreported: 0, abandoned: 0, claimRequests: 0, ackRequests: 0, backedOff: 0, timedOut: 0 });

    await new Client(urls).enqueueMany([
      { key: "long-1", payload: JSON.stringify({ seq: 0 }) },
      { key: "long-2", payload: JSON.stringify({ seq: 0 }) },
    ]);
    const busy = workerProcess({ URLS: urls, WAIT_MS: "30000", HOLD_MS: "20000", CONCURRENCY: "2" });
    await until(() => (busy.out().match(/^start /gm) ?? []).length === 2, 15_000, "both jobs to start");
    busy.child.kill("SIGTERM");
    await until(() => /SIGTERM: draining \(2 job\(s\) running/.test(busy.err()), 5_000, "the drain to begin");
    const t1 = Date.now();
    busy.child.kill("SIGTERM");
    assert.equal(await busy.exited, 0, busy.err());
    assert.ok(Date.now() - t1 < 1000, `the second SIGTERM took ${Date.now() - t1} ms`);
    assert.match(busy.err(), /SIGTERM again: stopping without draining/);
    assert.match(busy.err(), /2 running handler\(s\) cancelled through their signals/);
    assert.equal(busy.stats()?.abandoned, 2);
    assert.equal(busy.stats()?.acked, 0);
    assert.equal(busy.stats()?.failed, 0, "a cancelled run is not reported");
    assert.doesNotMatch(busy.out(), /^done /m);
  } finally {
    await c.close();
  }
});
