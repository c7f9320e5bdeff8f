// Worker against fake servers: claims on every URL under one concurrency
// limit, per-key order, acks to the server that gave the job, heartbeats,
// failures with a retry delay, 409 as a lost run, drain on stop and SIGTERM;
// `timeoutMs` in every claim, a bad one refused naming it; failure reasons
// cut to their bound on character boundaries; the bounds equal the server's.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { readFileSync } from "node:fs";

import { Client, FAIL_REASON_BYTES_MAX, JOB_TIMEOUT_MS_MAX, JOB_TIMEOUT_MS_MIN, JobTimeout, RetryLater, Worker, type ClaimedJob, type Logger } from "../src/index.js";
import { failureReason, utf8Prefix } from "../src/worker.js";
import { FakeServer } from "../test-support/fake-server.js";
import { REPO_ROOT } from "../test-support/shardq-bin.js";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function collectingLogger(): Logger & { lines: string[] } {
  const lines: string[] = [];
  return { lines, info: (m) => lines.push(`info ${m}`), warn: (m) => lines.push(`warn ${m}`), error: (m) => lines.push(`error ${m}`) };
}

/** Stops `worker` once `done()` holds, polling; fails the test after `ms`. */
async function stopWhen(worker: Worker, done: () => boolean, ms = 10_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!done()) {
    if (Date.now() > deadline) {
      worker.stop();
      throw new Error("timed out waiting for the worker");
    }
    await sleep(10);
  }
  worker.stop();
}

test("runs every job of two servers with the concurrency limit, in per-key order, acking to the origin", async () => {
  const servers = [await new FakeServer("s0", "tok").start(), await new FakeServer("s1", "tok").start()];
  try {
    const keys = Array.from({ length: 8 }, (_, i) => `tenant-${i}`);
    const perKey = 5;
    for (const [i, key] of keys.entries()) {
      const client = new Client([servers[i % 2]!.url], { token: "tok" });
      await client.enqueueMany(Array.from({ length: perKey }, (_, n) => ({ key, payload: String(n) })));
    }
    const seen = new Map<string, number[]>();
    let runningNow = 0;
    let maxRunning = 0;
    const worker = new Worker(servers.map((s) => s.url), { token: "tok", logger: collectingLogger() });
    const ran = worker.run(
      async (job: ClaimedJob) => {
        runningNow++;
        maxRunning = Math.max(maxRunning, runningNow);
        await sleep(5 + (job.id as number) % 7);
        const list = seen.get(job.key) ?? [];
        list.push(Number(job.payload.toString("utf8")));
        seen.set(job.key, list);
        runningNow--;
      },
      { concurrency: 3, leaseMs: 5000, waitMs: 50, handleSignals: false },
    );
    await stopWhen(worker, () => servers[0]!.acked.length + servers[1]!.acked.length === keys.length * perKey);
    const stats = await ran;
    assert.ok(maxRunning <= 3, `at most 3 handlers at once, saw ${maxRunning}`);
    assert.ok(maxRunning >= 2, `handlers ran concurrently (saw ${maxRunning})`);
    for (const key of keys) assert.deepEqual(seen.get(key), [0, 1, 2, 3, 4], `order of ${key}`);
    assert.equal(stats.acked, keys.length * perKey);
    assert.equal(stats.lost, 0);
    for (const s of servers) {
      assert.deepEqual(s.staleReplies, [], `${s.shard} saw no stale receipt (every ack went to its origin)`);
      assert.equal(s.acked.length, (keys.length / 2) * perKey);
      const claim = s.requests.find((r) => r.path === "/v1/claim")!;
      assert.deepEqual(Object.keys(claim.body).sort(), ["lease_ms", "max", "wait_ms", "worker"]);
      assert.ok((claim.body["max"] as number) <= 3);
    }
  } finally {
    for (const s of servers) await s.close();
  }
});

test("a long job is extended every lease/3 and keeps its run", async () => {
  const s = await new FakeServer("s").start();
  try {
    await new Client([s.url]).enqueue("slow", "x");
    const worker = new Worker([s.url], { logger: collectingLogger() });
    const ran = worker.run(async () => sleep(800), { concurrency: 1, leaseMs: 300, waitMs: 20, handleSignals: false });
    await stopWhen(worker, () => s.acked.length === 1);
    const stats = await ran;
    const extends_ = s.requests.filter((r) => r.path === "/v1/extend");
    assert.ok(extends_.length >= 4, `about 800/100 extends, got ${extends_.length}`);
    assert.deepEqual(Object.keys(extends_[0]!.body).sort(), ["lease_ms", "receipts"]);
    assert.equal(extends_[0]!.body["lease_ms"], 300);
    assert.equal(stats.lost, 0);
    assert.deepEqual(s.staleReplies, []);
  } finally {
    await s.close();
  }
});

test("a handler that throws fails the run with its reason and retry delay; the retry comes before the key's next job", async () => {
  const s = await new FakeServer("s").start();
  try {
    await new Client([s.url]).enqueueMany([
      { key: "k", payload: "first" },
      { key: "k", payload: "second" },
    ]);
    const order: string[] = [];
    const worker = new Worker([s.url], { logger: collectingLogger() });
    const ran = worker.run(
      async (job) => {
        order.push(`${job.payload.toString()}#${job.attempt}`);
        if (job.attempt === 1 && job.payload.toString() === "first") throw new RetryLater("boom: upstream down", 30);
      },
      { concurrency: 2, leaseMs: 5000, waitMs: 20, handleSignals: false },
    );
    await stopWhen(worker, () => s.acked.length === 2);
    const stats = await ran;
    assert.deepEqual(order, ["first#1", "first#2", "second#1"]);
    const fail = s.requests.find((r) => r.path === "/v1/fail")!;
    assert.equal(fail.body["reason"], "boom: upstream down");
    assert.equal(fail.body["retry_in_ms"], 30);
    assert.equal(stats.failed, 1);
    assert.equal(stats.acked, 2);
  } finally {
    await s.close();
  }
});

test("409 on ack is a lost run: logged, not retried; a 5xx on ack is retried", async () => {
  const s = await new FakeServer("s").start();
  try {
    await new Client([s.url]).enqueueMany([
      { key: "a", payload: "1" },
      { key: "b", payload: "2" },
    ]);
    s.inject.set("/v1/ack", [409, 503]);
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    const ran = worker.run(async () => {}, { concurrency: 1, prefetch: 0, leaseMs: 300, waitMs: 20, handleSignals: false });
    // The first job's ack got 409 (left to its lease, it runs again later); the second's got 503 then 200.
    await stopWhen(worker, () => s.acked.length === 2);
    const stats = await ran;
    assert.equal(stats.lost, 1);
    assert.ok(log.lines.some((l) => /warn job \d+ .* lost its run on ack: .*409/.test(l)), log.lines.join("\n"));
    const acks = s.requests.filter((r) => r.path === "/v1/ack").map((r) => r.status);
    assert.deepEqual(acks.slice(0, 3), [409, 503, 200], "409 not retried, 503 retried");
  } finally {
    await s.close();
  }
});

test("409 on extend aborts the handler's signal and skips the ack: a fail of the receipt follows once the handler returned", async () => {
  const s = await new FakeServer("s").start();
  try {
    await new Client([s.url]).enqueue("k", "x");
    s.inject.set("/v1/extend", [409]);
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    let aborted = false;
    let lostReceipt: string | undefined;
    const ran = worker.run(
      async (job, { signal }) => {
        if (aborted) return; // the job's next run (the fake ended the first with the fail)
        await new Promise<void>((resolve) => {
          signal.addEventListener("abort", () => {
            aborted = true;
            lostReceipt = job.receipt;
            resolve();
          });
          setTimeout(resolve, 2000);
        });
      },
      { concurrency: 1, leaseMs: 150, waitMs: 20, handleSignals: false },
    );
    await stopWhen(worker, () => aborted && s.count("/v1/fail") > 0);
    const stats = await ran;
    assert.equal(stats.lost, 1);
    const acked = s.requests.filter((r) => r.path === "/v1/ack").flatMap((r) => (r.body as { receipts: string[] }).receipts);
    assert.ok(!acked.includes(lostReceipt!), `the lost run was acked: ${JSON.stringify(acked)}`);
    const failed = s.requests.filter((r) => r.path === "/v1/fail").map((r) => (r.body as { receipt: string }).receipt);
    assert.deepEqual(failed, [lostReceipt]);
  } finally {
    await s.close();
  }
});

test("stop drains without prefetch: the running job finishes and is acked before run resolves, and no claim follows", async () => {
  const s = await new FakeServer("s").start();
  try {
    await new Client([s.url]).enqueueMany([{ key: "k1", payload: "x" }, { key: "k2", payload: "y" }]);
    let started = 0;
    const worker = new Worker([s.url], { logger: collectingLogger() });
    const ran = worker.run(
      async () => {
        started++;
        await sleep(300);
      },
      { concurrency: 1, prefetch: 0, leaseMs: 5000, waitMs: 20, handleSignals: false },
    );
    await stopWhen(worker, () => started === 1);
    const claimsAtStop = s.count("/v1/claim");
    await ran;
    assert.equal(s.acked.length, 1, "the running job was acked");
    assert.equal(started, 1, "the second job was not started");
    assert.ok(s.count("/v1/claim") <= claimsAtStop + 1);
  } finally {
    await s.close();
  }
});

test("a refused token stops run with the 401", async () => {
  const s = await new FakeServer("s", "tok").start();
  try {
    const worker = new Worker([s.url], { logger: collectingLogger() });
    await assert.rejects(worker.run(async () => {}, { waitMs: 20, handleSignals: false }), /401.*missing bearer token/);
  } finally {
    await s.close();
  }
});

test("SIGTERM drains a worker process: the running job is acked and the process exits 0", async () => {
  const s = await new FakeServer("s").start();
  try {
    await new Client([s.url]).enqueue("k", "x");
    const index = join(dirname(fileURLToPath(import.meta.url)), "..", "src", "index.js");
    const script = `
      import { Worker } from ${JSON.stringify(index)};
      const w = new Worker([process.env.URL]);
      await w.run(async () => { process.stdout.write("started\\n"); await new Promise(r => setTimeout(r, 400)); }, { leaseMs: 5000, waitMs: 50 });
      process.stdout.write("drained\\n");`;
    const child = spawn(process.execPath, ["--input-type=module", "-e", script], { env: { ...process.env, URL: s.url }, stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    let err = "";
    let sent = false;
    child.stderr.on("data", (d) => (err += d));
    await new Promise<void>((resolve, reject) => {
      const t = setTimeout(() => reject(new Error(`no start: ${out} ${err}`)), 10_000);
      child.stdout.on("data", (d) => {
        out += d;
        if (out.includes("started") && child.signalCode === null && !sent) {
          sent = true;
          clearTimeout(t);
          child.kill("SIGTERM");
          resolve();
        }
      });
    });
    const code = await new Promise<number | string | null>((resolve) => child.on("exit", (c, sig) => resolve(c ?? sig)));
    assert.equal(code, 0, `${err}\n${out}`);
    assert.match(out, /drained/);
    assert.match(err, /SIGTERM: draining \(1 job\(s\) running, 0 claimed ahead\)/);
    assert.equal(s.acked.length, 1);
  } finally {
    await s.close();
  }
});

test("nothing holds a drained worker process: an extend the server has not answered is cut off when run resolves", { timeout: 30_000 }, async () => {
  const s = await new FakeServer("s").start();
  try {
    await new Client([s.url]).enqueue("k", "x");
    // A lease of 9 s: the first extend goes out at 3 s and may wait 3 s
    // (lease/3) for its answer; the server sits on it for 3.5 s, so only
    // the cut-off at the end of run can release it sooner.
    s.delay.set("/v1/extend", [3_500]);
    const index = join(dirname(fileURLToPath(import.meta.url)), "..", "src", "index.js");
    const script = `
      import { Worker } from ${JSON.stringify(index)};
      const w = new Worker([process.env.URL]);
      await w.run(async () => { process.stdout.write("started\\n"); await new Promise(r => setTimeout(r, 3300)); }, { leaseMs: 9000, waitMs: 50 });
      process.stdout.write("drained\\n");`;
    const child = spawn(process.execPath, ["--input-type=module", "-e", script], { env: { ...process.env, URL: s.url }, stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    let err = "";
    let drainedAt = 0;
    child.stdout.on("data", (d) => {
      out += d;
      if (drainedAt === 0 && out.includes("drained")) drainedAt = Date.now();
    });
    child.stderr.on("data", (d) => (err += d));
    const exited = new Promise<number | string | null>((resolve) => child.on("exit", (c, sig) => resolve(c ?? sig)));
    const deadline = Date.now() + 15_000;
    // SIGTERM once the extend is waiting on the server, while the handler still runs.
    while (!(out.includes("started") && s.delay.get("/v1/extend")!.length === 0)) {
      if (Date.now() > deadline) throw new Error(`no extend: ${out} ${err}`);
      await sleep(10);
    }
    child.kill("SIGTERM");
    const code = await exited;
    const lingered = Date.now() - drainedAt;
    assert.equal(code, 0, `${err}\n${out}`);
    assert.ok(drainedAt > 0, out);
    assert.equal(s.acked.length, 1);
    assert.ok(lingered < 1000, `the process lived ${lingered} ms after run resolved`);
  } finally {
    await s.close();
  }
});

test("a claim's timeout is its long poll plus timeoutMs; a job carries maxAttempts", async () => {
  const s = await new FakeServer("s").start();
  try {
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log, timeoutMs: 50 });
    let got: ClaimedJob | undefined;
    const ran = worker.run(async (job) => void (got = job), { concurrency: 1, waitMs: 600, handleSignals: false });
    // Idle long polls of 600 ms with a 50 ms margin: answered, never timed out.
    await stopWhen(worker, () => worker.stats.claimRequests >= 2, 5_000);
    await ran;
    assert.deepEqual(log.lines.filter((l) => l.includes("claim")), []);
    await new Client([s.url]).enqueue("k", "x", { maxAttempts: 7 });
    const ran2 = worker.run(async (job) => void (got = job), { concurrency: 1, waitMs: 50, handleSignals: false });
    await stopWhen(worker, () => got !== undefined);
    await ran2;
    assert.equal(got?.maxAttempts, 7);
  } finally {
    await s.close();
  }
});

test("timeoutMs goes with every claim; at the deadline the handler's signal aborts with a JobTimeout and nothing is sent; a job claimed ahead past it is not run", async () => {
  const s = await new FakeServer("s").start();
  try {
    await new Client([s.url]).enqueueMany([
      { key: "a", payload: "slow" },
      { key: "b", payload: "quick" },
    ]);
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    const started: string[] = [];
    const reasons: unknown[] = [];
    // One handler, one job claimed ahead: both claimed at once, so both pass their 300 ms then.
    const ran = worker.run(
      async (job, { signal }) => {
        started.push(job.key);
        if (job.payload.toString() === "slow") {
          await new Promise<void>((resolve) => signal.addEventListener("abort", () => (reasons.push(signal.reason), resolve())));
        }
      },
      { concurrency: 1, prefetch: 1, leaseMs: 5000, waitMs: 20, timeoutMs: 300, handleSignals: false },
    );
    await stopWhen(worker, () => worker.stats.timedOut === 2);
    const stats = await ran;
    const lines = log.lines.join("\n");
    assert.deepEqual(started, ["a"], lines);
    assert.equal(reasons.length, 1);
    assert.ok(reasons[0] instanceof JobTimeout && reasons[0].timeoutMs === 300, String(reasons[0]));
    assert.deepEqual([stats.claimed, stats.timedOut, stats.acked, stats.failed, stats.lost], [2, 2, 0, 0, 0], lines);
    assert.equal(s.count("/v1/ack") + s.count("/v1/fail"), 0, "nothing sent for a run past its timeout");
    const claims = s.requests.filter((r) => r.path === "/v1/claim");
    assert.ok(claims.length >= 1 && claims.every((r) => r.body["timeout_ms"] === 300), JSON.stringify(claims.map((r) => r.body)));
    assert.ok(log.lines.some((l) => l.startsWith("warn job ") && l.includes("key \"b\"") && l.includes("before a handler was free; not run")), lines);

    // Without timeoutMs, no timeout_ms; the longest one is sent as is, and a job that ends in time is acked.
    for (const timeoutMs of [undefined, JOB_TIMEOUT_MS_MAX]) {
      const t = await new FakeServer("t").start();
      try {
        await new Client([t.url]).enqueue("c", "x");
        const w = new Worker([t.url], { logger: collectingLogger() });
        const r = w.run(async () => {}, { waitMs: 20, timeoutMs, handleSignals: false });
        await stopWhen(w, () => t.acked.length === 1);
        assert.equal((await r).timedOut, 0);
        const bodies = t.requests.filter((q) => q.path === "/v1/claim").map((q) => q.body);
        assert.ok(bodies.length >= 1 && bodies.every((b) => b["timeout_ms"] === timeoutMs && ("timeout_ms" in b) === (timeoutMs !== undefined)), JSON.stringify(bodies));
      } finally {
        await t.close();
      }
    }
  } finally {
    await s.close();
  }
});

test("a bad timeoutMs is refused naming it and the value, before any request", async () => {
  const s = await new FakeServer("s").start();
  try {
    for (const [bad, shown] of [
      [0, "0"],
      [-1, "-1"],
      [JOB_TIMEOUT_MS_MAX + 1, "604800001"],
      [1.5, "1.5"],
      [Number.NaN, "NaN"],
      [Number.POSITIVE_INFINITY, "Infinity"],
      ["500", '"500"'],
      [null, "null"],
      [true, "true"],
    ] as const) {
      const worker = new Worker([s.url], { logger: collectingLogger() });
      await assert.rejects(worker.run(async () => {}, { timeoutMs: bad as unknown as number, handleSignals: false }), (err: unknown) => {
        assert.ok(err instanceof TypeError, String(err));
        assert.ok(err.message.includes(`invalid timeoutMs ${shown}:`), err.message);
        assert.ok(err.message.includes(`from ${JOB_TIMEOUT_MS_MIN} to ${JOB_TIMEOUT_MS_MAX}`), err.message);
        return true;
      });
    }
    assert.equal(s.requests.length, 0);
  } finally {
    await s.close();
  }
});

function deep(n: number): never {
  if (n > 0) return deep(n - 1);
  throw new RangeError("é€😀 ".repeat(400));
}

test("a failure reason is its stack, cut to its bound on a character boundary: the head line and the first frames", () => {
  let error: unknown;
  try {
    deep(5);
  } catch (err) {
    error = err;
  }
  const MARK = "\n[... stack cut ...]";
  const whole = failureReason(error, 1 << 20);
  assert.ok(failureReason(error, 200).endsWith(MARK), "a stack longer than its room is cut");
  assert.ok(whole.startsWith("RangeError: é€😀 ") && whole.includes("\n    at deep ("), whole);
  const trace = whole.slice(whole.indexOf("\n    at ") + 1);
  for (let bound = 60; bound < 1200; bound += 7) {
    const got = failureReason(error, bound);
    const bytes = Buffer.from(got, "utf8");
    assert.ok(bytes.length <= bound, `${bytes.length} bytes for a bound of ${bound}`);
    // Nothing cut in two: no U+FFFD, no lone surrogate (which UTF-8 would turn into U+FFFD).
    assert.ok(!got.includes("\uFFFD") && bytes.toString("utf8") === got, `bound ${bound}: ${JSON.stringify(got.slice(-8))}`);
    assert.ok(got.startsWith("RangeError: é"), `bound ${bound}: ${got}`);
    // The head line is cut to half the bound; what follows is the start of the stack, where the failing frame is:
    // all of it when it fits, else its first frames and the mark.
    const head = got.slice(0, got.indexOf("\n"));
    assert.ok(Buffer.byteLength(head) <= Math.floor(bound / 2) && head.endsWith("..."), `bound ${bound}: ${head}`);
    const kept = got.endsWith(MARK) ? got.slice(head.length + 1, got.length - MARK.length) : got.slice(head.length + 1);
    assert.ok(got.endsWith(MARK) ? trace.startsWith(kept) : kept === trace, `bound ${bound}: ${kept}`);
    if (bound >= 400) assert.ok(kept.startsWith("    at deep ("), `bound ${bound}: ${kept}`);
  }
  // A whole reason within the bound is sent as is.
  const ok = failureReason(new Error("short"));
  assert.ok(ok.startsWith("Error: short\n    at ") && Buffer.byteLength(ok) <= FAIL_REASON_BYTES_MAX, ok);
  // A thrown non-error is its text, cut alone.
  assert.equal(failureReason("ü".repeat(1000), 101), "ü".repeat(50));
  assert.equal(failureReason("😀".repeat(100), 10), "😀😀");
  assert.equal(utf8Prefix("a😀", 4), "a");
  assert.equal(utf8Prefix("€é", 4), "€");
  // Causes follow the error's own frames.
  const caused = failureReason(new Error("outer", { cause: new TypeError("inner") }), 1 << 20);
  assert.match(caused, /^Error: outer\n {4}at [\s\S]*\nCaused by: TypeError: inner\n {4}at /);
});

test("the job timeout and reason bounds are the server's", () => {
  const job = readFileSync(`${REPO_ROOT}/crates/shardq-core/src/job.rs`, "utf8");
  const constant = (name: string): number => {
    const m = new RegExp(`pub const ${name}: \\w+ = ([^;]+);`).exec(job);
    assert.ok(m !== null, `${name} in job.rs`);
    // "7 * 24 * 3600 * 1000" or a number.
    return m[1]!.split("*").reduce((p, f) => p * Number(f.trim().replace(/_/g, "")), 1);
  };
  assert.equal(JOB_TIMEOUT_MS_MIN, constant("JOB_TIMEOUT_MS_MIN"));
  assert.equal(JOB_TIMEOUT_MS_MAX, constant("JOB_TIMEOUT_MS_MAX"));
  // What the store keeps of a reason: sending more would lose its end.
  assert.equal(FAIL_REASON_BYTES_MAX, constant("FAIL_REASON_BYTES_MAX"));
});
