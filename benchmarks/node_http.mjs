// Node worker against the Python worker on the same run: for each worker
// kind, a fresh data dir of 4 shards, one `shardq serve`, WORKERS worker
// processes over it at CONCURRENCY each (the Python one is
// benchmarks/http_worker.py, shardq.Worker with threads; the Node one is
// clients/node's Worker with its default prefetch), then one Node producer
// (Client, batches of 1,000, 1,000 keys, a dedup id per job) enqueues JOBS
// jobs; the time runs from the first enqueue until GET /v1/status shows
// nothing ready, delayed or in flight. One JSON line per run on stdout.
//
//   (cd clients/node && npm ci) && SHARDQ_BIN=target/release/shardq node benchmarks/node_http.mjs [JOBS] [CONCURRENCY] [WORKERS] [REPEAT]

import { spawn, spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const HERE = dirname(fileURLToPath(import.meta.url));
const ROOT = join(HERE, "..");
const { Client, Worker } = await import(join(ROOT, "clients", "node", "dist", "src", "index.js"));

const [jobs = 50_000, concurrency = 16, workers = 2, repeat = 3] = process.argv.slice(2).map(Number);
const BIN = process.env.SHARDQ_BIN ?? join(ROOT, "target", "release", "shardq");
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

if (process.argv[2] === "--worker") {
  // A Node worker process: URL CONCURRENCY; drains on SIGTERM and prints its stats.
  const worker = new Worker([process.argv[3]], { worker: `bench-node-${process.pid}` });
  const last = new Map();
  let disorder = 0;
  const stats = await worker.run(
    (job) => {
      const { seq } = JSON.parse(job.payload.toString("utf8"));
      if (seq < (last.get(job.key) ?? -1)) disorder++;
      last.set(job.key, seq);
    },
    { concurrency: Number(process.argv[4]), leaseMs: 30_000, waitMs: 1000 },
  );
  process.stdout.write(JSON.stringify({ stats, disorder }) + "\n");
  process.exit(0);
}

function freePort() {
  return new Promise((resolve) => {
    const s = createServer();
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

function cpuSeconds(pid) {
  const r = spawnSync("cat", [`/proc/${pid}/stat`], { encoding: "utf8" });
  const f = r.stdout.slice(r.stdout.lastIndexOf(")") + 2).split(" ");
  return (Number(f[11]) + Number(f[12])) / 100;
}

async function once(kind) {
  const dir = mkdtempSync(join(tmpdir(), "shardq-bench-node-"));
  const data = join(dir, "q");
  spawnSync(BIN, ["init", "--data", data, "--shards", "4"], { stdio: "ignore" });
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const serve = spawn(BIN, ["serve", "--data", data, "--listen", `127.0.0.1:${port}`], { stdio: "ignore" });
  const status = async () => (await (await fetch(`${url}/v1/status`)).json()).totals;
  for (;;) {
    try {
      if ((await (await fetch(`${url}/readyz`)).json()).owned?.length === 4) break;
    } catch {}
    await sleep(20);
  }
  const procs = Array.from({ length: workers }, () =>
    kind === "python"
      ? spawn("python3", [join(HERE, "http_worker.py"), url, join(dir, `out-${Math.random()}`), String(concurrency)], { stdio: ["ignore", "pipe", "inherit"] })
      : spawn(process.execPath, [fileURLToPath(import.meta.url), "--worker", url, String(concurrency)], { stdio: ["ignore", "pipe", "inherit"] }),
  );
  const outs = procs.map((p) => {
    let o = "";
    p.stdout.on("data", (d) => (o += d));
    return () => o;
  });
  await sleep(1000); // the workers' start is not timed
  const cpu0 = [serve.pid, ...procs.map((p) => p.pid)].map(cpuSeconds);
  const t0 = performance.now();
  const client = new Client([url]);
  const batch = [];
  for (let i = 0; i < jobs; i++) {
    batch.push({ key: `k-${i % 1000}`, payload: JSON.stringify({ seq: Math.floor(i / 1000), t: Date.now() * 1e6 }) });
    if (batch.length === 1000 || i === jobs - 1) await client.enqueueMany(batch.splice(0));
  }
  for (;;) {
    const t = await status();
    if (t.ready + t.delayed + t.in_flight === 0) break;
    await sleep(5);
  }
  const seconds = (performance.now() - t0) / 1000;
  const cpu = [serve.pid, ...procs.map((p) => p.pid)].map(cpuSeconds).reduce((n, c, i) => n + c - cpu0[i], 0);
  const exits = procs.map((p) => new Promise((r) => p.on("exit", r)));
  for (const p of procs) p.kill("SIGTERM");
  await Promise.all(exits);
  serve.kill("SIGTERM");
  await new Promise((r) => serve.on("exit", r));
  client.close();
  rmSync(dir, { recursive: true, force: true });
  const stats = kind === "node" ? outs.map((o) => JSON.parse(o()).stats) : undefined;
  return { kind, jobs, workers, concurrency, seconds: +seconds.toFixed(3), jobs_per_s: Math.round(jobs / seconds), cpu_us_per_job_server_workers: Math.round((cpu * 1e6) / jobs), node_worker_stats: stats };
}

for (let r = 0; r < repeat; r++) {
  for (const kind of ["python", "node"]) process.stdout.write(JSON.stringify({ repeat: r, ...(await once(kind)) }) + "\n");
}
