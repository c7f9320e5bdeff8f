// Client and Worker against the real `shardq serve`, and the Node stdio
// handler under the real `shardq work --stdio` ($SHARDQ_BIN or the debug binary, built
// with `cargo build -p shardq` when it is missing). Invariants: per-key order,
// one run per key at a time, each job acked once, nothing lost, no job
// stored twice.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { join } from "node:path";
import { test } from "node:test";

import { Client, Worker, type ClaimedJob, type Logger } from "../src/index.js";
import { initDataDir, REPO_ROOT, Serve, shardq, shardqBinary } from "../test-support/shardq-bin.js";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

const quietLogger: Logger & { lines: string[] } = {
  lines: [],
  info(m) {
    this.lines.push(`info ${m}`);
  },
  warn(m) {
    this.lines.push(`warn ${m}`);
  },
  error(m) {
    this.lines.push(`error ${m}`);
  },
};

test("round trip through shardq serve: per-key order, one run per key, each job acked once", { timeout: 60_000 }, async () => {
  const dir = initDataDir(4);
  const serve = new Serve(dir.data, 4);
  try {
    await serve.start();
    const keys = 30;
    const perKey = 20;
    const n = keys * perKey;
    const jobs = [];
    for (let s = 0; s < perKey; s++) {
      for (let k = 0; k < keys; k++) jobs.push({ key: `k-${k}`, payload: JSON.stringify({ seq: s }), dedupId: `node-rt-${k}-${s}` });
    }
    const client = new Client([serve.url]);
    const placed = await client.enqueueMany(jobs);
    assert.equal(placed.length, n);
    assert.ok(placed.every((p) => !p.duplicate && typeof p.id === "string" && p.id.startsWith(`${p.shard}:`)), JSON.stringify(placed[0]));
    assert.equal(new Set(placed.map((p) => p.id)).size, n);
    // The same dedup ids again store nothing and return the first ids.
    const again = await client.enqueueMany(jobs.slice(0, 50));
    assert.ok(again.every((a) => a.duplicate));
    assert.deepEqual(
      again.map((a) => a.id),
      placed.slice(0, 50).map((p) => p.id),
    );
    assert.deepEqual((await serve.status()).totals, { ready: n, delayed: 0, in_flight: 0, dead: 0 });

    const seen = new Map<string, number[]>();
    const ids: string[] = [];
    const running = new Set<string>();
    const overlaps: string[] = [];
    const worker = new Worker([serve.url], { worker: "node-e2e", logger: quietLogger });
    const ran = worker.run(
      async (job: ClaimedJob) => {
        if (running.has(job.key)) overlaps.push(job.key);
        running.add(job.key);
        const { seq } = JSON.parse(job.payload.toString("utf8")) as { seq: number };
        const list = seen.get(job.key) ?? [];
        list.push(seq);
        seen.set(job.key, list);
        ids.push(String(job.id));
        assert.equal(job.attempt, 1);
        await sleep(1);
        running.delete(job.key);
      },
      { concurrency: 8, leaseMs: 5000, waitMs: 200, handleSignals: false },
    );
    const deadline = Date.now() + 30_000;
    while (worker.stats.acked < n && Date.now() < deadline) await sleep(20);
    worker.stop();
    const stats = await ran;

    assert.deepEqual(overlaps, [], "two runs of one key at once");
    for (let k = 0; k < keys; k++) {
      assert.deepEqual(seen.get(`k-${k}`), Array.from({ length: perKey }, (_, s) => s), `key k-${k} out of order, lost or repeated`);
    }
    assert.equal(ids.length, n);
    assert.deepEqual(new Set(ids), new Set(placed.map((p) => p.id)));
    assert.deepEqual(
      { claimed: stats.claimed, acked: stats.acked, failed: stats.failed, lost: stats.lost, unreported: stats.unreported, abandoned: stats.abandoned },
      { claimed: n, acked: n, failed: 0, lost: 0, unreported: 0, abandoned: 0 },
      quietLogger.lines.join("\n"),
    );
    assert.ok(stats.ackRequests < n / 2, `acks are batched (${stats.ackRequests} requests for ${n})`);
    assert.deepEqual((await serve.status()).totals, { ready: 0, delayed: 0, in_flight: 0, dead: 0 });
  } finally {
    await serve.stop();
    dir.cleanup();
  }
});

test("examples/handlers/node/handler.mjs under shardq work --stdio acks every job", { timeout: 60_000 }, async () => {
  const dir = initDataDir(4);
  try {
    const keys = 12;
    const perKey = 15;
    const lines: string[] = [];
    for (let s = 0; s < perKey; s++) {
      for (let k = 0; k < keys; k++) {
        // A few jobs make the handler wait, so several run at once on different keys.
        const payload = s % 5 === 0 ? JSON.stringify({ sleep_ms: 10, seq: s }) : JSON.stringify({ seq: s });
        lines.push(`k-${k}\t${payload}`);
      }
    }
    // KEY<TAB>SHARD:ID per stored job: the job id the protocol uses.
    const stored = shardq(["enqueue", "--data", dir.data, "--stdin"], lines.join("\n") + "\n")
      .trim()
      .split("\n")
      .map((l) => l.split("\t"))
      .map(([key, id]) => [key!, id!.slice(0, id!.lastIndexOf(":")), id!] as const);
    assert.equal(stored.length, keys * perKey);
    const storedIds = stored.map(([, , id]) => id);
    assert.equal(new Set(storedIds).size, stored.length);

    const handler = join(REPO_ROOT, "examples", "handlers", "node", "handler.mjs");
    const child = spawn(
      shardqBinary(),
      ["work", "--data", dir.data, "--concurrency", "4", "--max-local-shards", "all", "--exit-when-idle", "--stdio", "--", process.execPath, handler],
      { stdio: ["ignore", "pipe", "pipe"] },
    );
    let err = "";
    child.stderr.on("data", (d) => (err += d));
    child.stdout.resume();
    const exited = new Promise<number | string | null>((r) => child.on("exit", (code, sig) => r(code ?? sig)));
    const timer = setTimeout(() => child.kill("SIGKILL"), 45_000);
    const code = await exited;
    clearTimeout(timer);
    assert.equal(code, 0, err.slice(-3000));

    // The handler logs `handled ID key=... attempt=N bytes=...` per job it ran.
    const handled = [...err.matchAll(/^handled (\S+) key=("[^"]*") attempt=(\d+)/gm)].map((m) => ({ id: m[1]!, key: JSON.parse(m[2]!) as string, attempt: Number(m[3]) }));
    assert.equal(handled.length, stored.length, `every job handled once:\n${err.slice(-2000)}`);
    assert.deepEqual(new Set(handled.map((h) => h.id)), new Set(storedIds));
    assert.ok(handled.every((h) => h.attempt === 1));
    // Per key, in enqueue order (the handlers inherit the worker's stderr, and
    // a key's next job starts only after its previous result came back).
    const order = (rows: { key: string; id: string }[]) => {
      const m = new Map<string, string[]>();
      for (const r of rows) m.set(r.key, [...(m.get(r.key) ?? []), r.id]);
      return m;
    };
    assert.deepEqual(order(handled), order(stored.map(([key, , id]) => ({ key, id }))));
    const status = JSON.parse(shardq(["status", "--data", dir.data, "--json"])) as { totals: Record<string, number>; failed: string[] };
    assert.deepEqual(status.failed, []);
    assert.deepEqual(status.totals, { ready: 0, delayed: 0, in_flight: 0, dead: 0 });
  } finally {
    dir.cleanup();
  }
});
