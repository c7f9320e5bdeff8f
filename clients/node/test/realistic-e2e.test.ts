// The realistic program, scaled down: two `shardq serve` processes over one
// data dir (each running half the shards), 5,000 jobs over 200 tenants
// with dedup ids, a quarter of the batches sent twice, 1% of the jobs
// failing once and retried, two worker processes over both URLs, SIGTERM to
// one of them halfway and to the other at the end. Every job completes
// exactly once, in per-tenant order, and nothing is left.

import assert from "node:assert/strict";
import { test } from "node:test";

import { Client, type JobSpec } from "../src/index.js";
import { cluster, until, workerProcess } from "../test-support/cluster.js";

test("two servers, 200 tenants, dedup re-sends, 1% failures retried, SIGTERM: every job exactly once in per-tenant order", { timeout: 120_000 }, async () => {
  const c = await cluster(4, 2);
  try {
    const urls = c.servers.map((s) => s.url);
    const tenants = 200;
    const perTenant = 25;
    const total = tenants * perTenant;
    const failing = (t: number, seq: number) => (t * 31 + seq * 17) % 100 === 3;
    const planted = Array.from({ length: tenants }, (_, t) => Array.from({ length: perTenant }, (_, s) => failing(t, s))).flat().filter(Boolean).length;
    assert.ok(planted >= 25 && planted <= 75, `about 1% of the jobs fail once (${planted})`);

    const env = { URLS: urls.join(","), WAIT_MS: "1000", LEASE_MS: "10000", CONCURRENCY: "16" };
    const workers = [workerProcess(env), workerProcess(env)];
    const client = new Client(urls);
    const jobs: JobSpec[] = [];
    for (let seq = 0; seq < perTenant; seq++) {
      for (let t = 0; t < tenants; t++) {
        jobs.push({ key: `tenant-${t}`, payload: JSON.stringify({ seq, fail: failing(t, seq) || undefined }), dedupId: `order-${t}-${seq}` });
      }
    }
    let duplicates = 0;
    for (let i = 0, batch = 0; i < jobs.length; i += 250, batch++) {
      const slice = jobs.slice(i, i + 250);
      const placed = await client.enqueueMany(slice);
      assert.ok(placed.every((p) => !p.duplicate));
      if (batch % 4 === 1) {
        // A producer that lost its answer sends the batch again: nothing is stored twice.
        const again = await client.enqueueMany(slice);
        assert.deepEqual(again.map((a) => a.id), placed.map((p) => p.id));
        duplicates += again.filter((a) => a.duplicate).length;
      }
    }
    assert.equal(duplicates, 5 * 250);

    const done = () => workers.reduce((n, w) => n + (w.out().match(/^done /gm) ?? []).length, 0);
    await until(() => done() >= total / 2, 60_000, "half the jobs to complete");
    workers[0]!.child.kill("SIGTERM");
    assert.equal(await workers[0]!.exited, 0, workers[0]!.err());
    await until(() => done() === total, 60_000, `every job to complete (${done()} of ${total})`);
    await c.servers[0]!.settle({ ready: 0, delayed: 0, in_flight: 0, dead: 0 });
    workers[1]!.child.kill("SIGTERM");
    assert.equal(await workers[1]!.exited, 0, workers[1]!.err());

    const records = workers.flatMap((w) =>
      [...w.out().matchAll(/^done (\S+) (\d+) (\d+) (\S+)$/gm)].map((m) => ({ key: m[1]!, seq: Number(m[2]), attempt: Number(m[3]), at: Number(m[4]) })),
    );
    const seen = new Map<string, number>();
    for (const r of records) seen.set(`${r.key}/${r.seq}`, (seen.get(`${r.key}/${r.seq}`) ?? 0) + 1);
    assert.equal(seen.size, total, "every job completed");
    assert.deepEqual([...seen.entries()].filter(([, n]) => n !== 1), [], "no job completed twice");
    const byTenant = new Map<string, typeof records>();
    for (const r of records) byTenant.set(r.key, [...(byTenant.get(r.key) ?? []), r]);
    for (const [key, rs] of byTenant) {
      rs.sort((x, y) => x.at - y.at);
      assert.deepEqual(rs.map((r) => r.seq), Array.from({ length: perTenant }, (_, s) => s), `order of ${key}`);
    }
    assert.equal(records.filter((r) => r.attempt === 2).length, planted, "each planted failure ran again once");
    const stats = workers.map((w) => w.stats()!);
    assert.equal(stats.reduce((n, s) => n + s.acked, 0), total);
    assert.equal(stats.reduce((n, s) => n + s.failed, 0), planted);
    assert.deepEqual(stats.map((s) => [s.lost, s.unreported, s.abandoned]), [[0, 0, 0], [0, 0, 0]]);
    assert.ok(stats[0]!.acked > 0 && stats[1]!.acked > 0, "both workers took part");
  } finally {
    await c.close();
  }
});
