// A worker process for the signal and end-to-end tests: `Worker.run` over
// $URLS (comma-separated) with the real signal handling. The handler
// writes `start KEY SEQ ATTEMPT` and `done KEY SEQ ATTEMPT WALL_MS` lines to
// stdout (the payload is JSON `{"seq": N}`), fails the first attempt of the
// jobs whose payload has `"fail": true`, and with $HOLD_MS waits that long
// (or until its signal aborts). At the end it writes `stats JSON`.

import { writeSync } from "node:fs";

import { RetryLater, Worker } from "../src/index.js";

const env = (name: string, fallback: string) => process.env[name] ?? fallback;
const out = (line: string) => writeSync(1, line + "\n");

const worker = new Worker(env("URLS", "").split(","), { worker: `node-test-${process.pid}` });
const holdMs = Number(env("HOLD_MS", "0"));
const stats = await worker.run(
  async (job, { signal }) => {
    const doc = JSON.parse(job.payload.toString("utf8")) as { seq: number; fail?: boolean };
    out(`start ${job.key} ${doc.seq} ${job.attempt}`);
    if (holdMs > 0) {
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, holdMs);
        signal.addEventListener("abort", () => {
          clearTimeout(t);
          resolve();
        });
      });
      if (signal.aborted) throw new Error("cancelled");
    }
    if (doc.fail === true && job.attempt === 1) throw new RetryLater("planted failure", 10);
    out(`done ${job.key} ${doc.seq} ${job.attempt} ${(performance.timeOrigin + performance.now()).toFixed(3)}`);
  },
  {
    concurrency: Number(env("CONCURRENCY", "4")),
    waitMs: Number(env("WAIT_MS", "5000")),
    leaseMs: Number(env("LEASE_MS", "30000")),
  },
);
out(`stats ${JSON.stringify(stats)}`);
