// BullMQ 5 on the same pipeline as benchmarks/bench.py http: one producer
// (this process, addBulk in batches of 1000, 1000 keys interleaved, payload
// {key, seq, t}) and one worker process (concurrency 100) that completes
// each job. Prints {"jobs", "seconds", "jobs_per_s", "out_of_key_order"}.
//
//   node bench.mjs redis://127.0.0.1:PORT/0 JOBS [CONCURRENCY]
//
// Talks only to a loopback redis-server (anything else is refused).

import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { Queue, Worker } from "bullmq";

const [mode] = process.argv.slice(2);
const QUEUE = "shardq-bench";

function connection(url) {
  const u = new URL(url);
  if (u.protocol !== "redis:" || !["127.0.0.1", "localhost", "[::1]"].includes(u.hostname)) {
    throw new Error(`refusing ${url}: this benchmark only talks to a loopback redis-server`);
  }
  return { host: u.hostname, port: Number(u.port || 6379), db: Number(u.pathname.slice(1) || 0), maxRetriesPerRequest: null };
}

if (mode === "--worker") {
  const [, url, jobsArg, concArg] = process.argv.slice(2);
  const jobs = Number(jobsArg);
  let done = 0;
  let outOfOrder = 0;
  const last = new Map();
  const worker = new Worker(
    QUEUE,
    async (job) => {
      const { key, seq } = job.data;
      if (seq < (last.get(key) ?? -1)) outOfOrder++;
      last.set(key, seq);
    },
    { connection: connection(url), concurrency: Number(concArg), removeOnComplete: { count: 0 }, removeOnFail: { count: 0 } },
  );
  worker.on("completed", async () => {
    if (++done === jobs) {
      process.stdout.write(JSON.stringify({ done, outOfOrder }) + "\n");
      await worker.close();
      process.exit(0);
    }
  });
  await worker.waitUntilReady();
  process.stdout.write("ready\n");
} else {
  const [url, jobsArg, concArg = "100"] = process.argv.slice(2);
  const jobs = Number(jobsArg);
  const keys = 1000;
  const queue = new Queue(QUEUE, { connection: connection(url) });
  await queue.obliterate({ force: true });
  const child = spawn(process.execPath, [fileURLToPath(import.meta.url), "--worker", url, String(jobs), concArg], {
    stdio: ["ignore", "pipe", "inherit"],
  });
  const lines = createInterface({ input: child.stdout })[Symbol.asyncIterator]();
  if ((await lines.next()).value !== "ready") throw new Error("the BullMQ worker did not start");
  const t0 = performance.now();
  for (let i = 0; i < jobs; i += 1000) {
    const batch = [];
    const now = Date.now();
    for (let j = i; j < Math.min(jobs, i + 1000); j++) {
      const key = `k-${j % keys}`;
      batch.push({ name: key, data: { key, seq: Math.floor(j / keys), t: now } });
    }
    await queue.addBulk(batch);
  }
  const tEnqueued = performance.now();
  const result = JSON.parse((await lines.next()).value);
  const seconds = (performance.now() - t0) / 1000;
  await queue.close();
  process.stdout.write(
    JSON.stringify({
      jobs: result.done,
      seconds: Math.round(seconds * 100) / 100,
      enqueue_seconds: Math.round((tEnqueued - t0) / 10) / 100,
      jobs_per_s: Math.round(result.done / seconds),
      out_of_key_order: result.outOfOrder,
      bullmq: (await import("bullmq/package.json", { with: { type: "json" } })).default.version,
    }) + "\n",
  );
}
