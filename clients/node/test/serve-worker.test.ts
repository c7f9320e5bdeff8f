// Worker against real `shardq serve` processes: every URL is polled however
// few the slots (two servers over one data dir, work on one of them only),
// a refused token rejects `run`, a drain timeout cancels and never reports
// the runs it leaves, prefetched jobs are extended while they wait, acks
// are batched, and a stop cancels the long polls at once. Job timeouts:
// a handler hung for 30 s with `timeoutMs: 500` is a dead letter with the
// server's timeout reason within seconds, and its slot runs the key's next
// job; a failed attempt's reason is its stack, bounded, naming the function
// that threw.

import assert from "node:assert/strict";
import { test } from "node:test";

import { Client, FAIL_REASON_BYTES_MAX, JobTimeout, Unauthorized, Worker, type ClaimedJob } from "../src/index.js";
import { cluster, collectingLogger, TOKEN, until } from "../test-support/cluster.js";
import { PRODUCE_ONLY_TOKEN } from "../test-support/shardq-bin.js";

test("a quiet queue starves no server: concurrency 1 over two URLs claims the work of either one", { timeout: 60_000 }, async () => {
  const c = await cluster(4, 2);
  try {
    const [a, b] = c.servers as [NonNullable<(typeof c.servers)[0]>, NonNullable<(typeof c.servers)[1]>];
    const client = new Client([a.url]);
    for (const prefetch of [0, undefined]) {
      const log = collectingLogger();
      const worker = new Worker([a.url, b.url], { logger: log });
      const done: ClaimedJob[] = [];
      // Long polls far longer than the wait below: a job only on the other
      // server is claimed while the first server's poll still waits.
      const ran = worker.run(async (job) => void done.push(job), { concurrency: 1, prefetch, waitMs: 20_000, handleSignals: false });
      try {
        // The queue is quiet for a while before any work comes.
        await new Promise((r) => setTimeout(r, 300));
        for (const [server, other] of [
          [b, a],
          [a, b],
        ] as const) {
          const keys = await c.keysOn(server, 5, `only-${server.url.slice(-5)}-${String(prefetch)}`);
          const before = done.length;
          const started = Date.now();
          await client.enqueueMany(keys.map((key) => ({ key, payload: "x" })));
          await until(() => done.length === before + keys.length, 8_000, `the jobs only ${server.url} has (${other.url} idle)`);
          assert.ok(Date.now() - started < 8_000);
          assert.ok(done.slice(before).every((j) => j.server === server.url));
        }
      } finally {
        worker.stop();
      }
      const stats = await ran;
      assert.equal(stats.acked, 10, log.lines.join("\n"));
      assert.equal(stats.lost, 0);
    }
    await a.settle({ ready: 0, delayed: 0, in_flight: 0, dead: 0 });
  } finally {
    await c.close();
  }
});

test("a refused token rejects run with Unauthorized (401 without a token or with a wrong one, 403 without the work role)", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1, { tokens: true });
  try {
    const url = c.servers[0]!.url;
    for (const [token, status] of [
      [undefined, 401],
      ["wrong-token-0123456789abcdef", 401],
      [PRODUCE_ONLY_TOKEN, 403],
    ] as const) {
      const log = collectingLogger();
      const worker = new Worker([url], { token, logger: log });
      const started = Date.now();
      await assert.rejects(worker.run(async () => {}, { waitMs: 1000, handleSignals: false }), (err: unknown) => {
        assert.ok(err instanceof Unauthorized, String(err));
        assert.equal(err.status, status);
        return true;
      });
      assert.ok(Date.now() - started < 5_000, "stops at once, not after retries");
      assert.ok(log.lines.some((l) => l.startsWith("error claim on") && l.includes("stopping")), log.lines.join("\n"));
      if (token !== PRODUCE_ONLY_TOKEN) await assert.rejects(new Client([url], { token }).enqueue("k", "x"), Unauthorized);
    }
    // The right token works.
    await new Client([url], { token: TOKEN }).enqueue("k", "x");
    const worker = new Worker([url], { token: TOKEN, logger: collectingLogger() });
    const ran = worker.run(async () => worker.stop(), { waitMs: 1000, handleSignals: false });
    assert.equal((await ran).acked, 1);
  } finally {
    await c.close();
  }
});

test("the drain timeout cancels the runs it leaves through their signals, reports none of them, and the server runs them again", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  try {
    const s = c.servers[0]!;
    await new Client([s.url]).enqueueMany([
      { key: "slow-1", payload: "1" },
      { key: "slow-2", payload: "2" },
    ]);
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    let aborted = 0;
    let started = 0;
    let finished!: () => void;
    const handlerDone = new Promise<void>((r) => (finished = r));
    const ran = worker.run(
      async (_job, { signal }) => {
        started++;
        signal.addEventListener("abort", () => aborted++);
        // Ignores its signal for a while, as a careless handler would.
        await new Promise((r) => setTimeout(r, 1000));
        finished();
      },
      { concurrency: 1, prefetch: 1, leaseMs: 1000, waitMs: 100, drainTimeoutMs: 200, handleSignals: false },
    );
    await until(() => started === 1 && worker.stats.claimed === 2, 10_000, "one job running, one claimed ahead");
    worker.stop();
    const stats = await ran;
    assert.equal(aborted, 1, "the running handler's signal was aborted");
    assert.deepEqual({ ...stats, claimRequests: 0, ackRequests: 0 }, { claimed: 2, acked: 0, failed: 0, lost: 0, unreported: 0, abandoned: 2, claimRequests: 0, ackRequests: 0, backedOff: 0, timedOut: 0 });
    assert.ok(
      log.lines.some((l) => /drain timeout \(200 ms\): 1 running handler\(s\) cancelled through their signals and 1 claimed job\(s\) not started; none of them is acked/.test(l)),
      log.lines.join("\n"),
    );
    // The handler ends after run resolved: no ack follows it.
    await handlerDone;
    await new Promise((r) => setImmediate(r));
    assert.equal(started, 1, "the job claimed ahead was not started");
    assert.deepEqual((await s.status()).totals, { ready: 0, delayed: 0, in_flight: 2, dead: 0 });
    assert.equal(worker.stats.acked, 0);
    // Their leases lapse and they run again.
    const again: ClaimedJob[] = [];
    const second = new Worker([s.url], { logger: collectingLogger() });
    const ran2 = second.run(async (job) => void again.push(job), { waitMs: 200, handleSignals: false });
    await until(() => second.stats.acked === 2, 15_000, "the left jobs to run again");
    second.stop();
    await ran2;
    assert.deepEqual(again.map((j) => j.attempt), [2, 2]);
  } finally {
    await c.close();
  }
});

test("jobs claimed ahead are extended while they wait, and acks are batched", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  try {
    const s = c.servers[0]!;
    // A slow job, then one claimed ahead of a free handler whose lease (300 ms) would pass while it waits.
    await new Client([s.url]).enqueueMany([
      { key: "first", payload: "slow" },
      { key: "second", payload: "quick" },
    ]);
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    const runs: string[] = [];
    const ran = worker.run(
      async (job) => {
        runs.push(`${job.key}#${job.attempt}`);
        if (job.payload.toString() === "slow") await new Promise((r) => setTimeout(r, 1200));
      },
      { concurrency: 1, prefetch: 1, leaseMs: 300, waitMs: 100, handleSignals: false },
    );
    await until(() => worker.stats.acked === 2, 15_000, "both jobs acked");
    worker.stop();
    const stats = await ran;
    assert.deepEqual(runs.sort(), ["first#1", "second#1"], log.lines.join("\n"));
    assert.equal(stats.lost, 0, log.lines.join("\n"));
    assert.equal(stats.claimRequests >= 1 && stats.claimed, 2);

    // Many quick jobs: one ack request carries many receipts, one claim many jobs.
    const n = 2000;
    await new Client([s.url]).enqueueMany(Array.from({ length: n }, (_, i) => ({ key: `k-${i % 500}`, payload: String(i) })));
    const fast = new Worker([s.url], { logger: collectingLogger() });
    const ran2 = fast.run(async () => {}, { concurrency: 16, waitMs: 100, handleSignals: false });
    await until(() => fast.stats.acked === n, 30_000, "every quick job acked");
    fast.stop();
    const st = await ran2;
    assert.ok(st.ackRequests * 4 <= st.acked, `receipts per ack ${st.acked / st.ackRequests} (${st.ackRequests} requests)`);
    assert.ok(st.claimed / st.claimRequests > 16, `jobs per claim ${st.claimed / st.claimRequests}: more than the handlers, so some were claimed ahead`);
    await s.settle({ ready: 0, delayed: 0, in_flight: 0, dead: 0 });
  } finally {
    await c.close();
  }
});

test("a stop cancels the long polls at once; stop({ drain: false }) cancels running handlers", { timeout: 60_000 }, async () => {
  const c = await cluster(4, 2);
  try {
    const urls = c.servers.map((s) => s.url);
    const idle = new Worker(urls, { logger: collectingLogger() });
    const ran = idle.run(async () => {}, { waitMs: 30_000, handleSignals: false });
    await new Promise((r) => setTimeout(r, 200)); // both long polls out
    const t0 = Date.now();
    idle.stop();
    await ran;
    assert.ok(Date.now() - t0 < 500, `stopped in ${Date.now() - t0} ms with 30 s long polls out`);
    // The cancelled polls claim nothing more: a job enqueued now goes to the next worker at its first attempt.
    await new Client(urls).enqueue("after-stop", "x");
    const next = new Worker(urls, { logger: collectingLogger() });
    const attempts: number[] = [];
    const ranNext = next.run(async (job) => void attempts.push(job.attempt), { waitMs: 200, handleSignals: false });
    await until(() => next.stats.acked === 1, 10_000, "the job enqueued after the stop");
    next.stop();
    await ranNext;
    assert.deepEqual(attempts, [1]);

    await new Client(urls).enqueue("busy", "x");
    const busy = new Worker(urls, { logger: collectingLogger() });
    let cancelled = false;
    const ran2 = busy.run(
      async (_job, { signal }) =>
        new Promise<void>((resolve, reject) => {
          const t = setTimeout(resolve, 20_000);
          signal.addEventListener("abort", () => {
            clearTimeout(t);
            cancelled = true;
            reject(signal.reason);
          });
        }),
      { waitMs: 30_000, handleSignals: false },
    );
    await until(() => busy.stats.claimed === 1, 10_000, "the job to start");
    busy.stop();
    busy.stop({ drain: false });
    const t1 = Date.now();
    const stats = await ran2;
    assert.ok(Date.now() - t1 < 1000);
    assert.ok(cancelled);
    assert.equal(stats.abandoned, 1);
    assert.equal(stats.failed + stats.acked, 0, "a cancelled run is not reported");
  } finally {
    await c.close();
  }
});

const TIMEOUT_REASON = "timed out: the run passed its job timeout of 500 ms";

test("timeoutMs: a handler hung for 30 s is a dead letter with the server's timeout reason within seconds, its signal aborted with a JobTimeout, and its freed slot runs the key's next job", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  const releases: (() => void)[] = [];
  try {
    const s = c.servers[0]!;
    const client = new Client([s.url]);
    const hung = await client.enqueue("tenant-h", "hang", { maxAttempts: 1 });
    const next = await client.enqueue("tenant-h", "next");
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    const started = new Map<string, number>();
    const ended: string[] = [];
    let abortedWith: unknown;
    // One slot, nothing claimed ahead, leases of 5 s extended every 1.7 s:
    // only the job timeout ends the hung run, and only a freed slot lets
    // this worker run the key's next job.
    const ran = worker.run(
      async (job, { signal }) => {
        const body = job.payload.toString();
        if (!started.has(body)) started.set(body, Date.now());
        if (body === "hang") {
          signal.addEventListener("abort", () => (abortedWith = signal.reason));
          // Hangs for 30 s, ignoring its signal (until the test lets it go).
          await new Promise<void>((resolve) => {
            const t = setTimeout(resolve, 30_000);
            releases.push(() => {
              clearTimeout(t);
              resolve();
            });
          });
        }
        ended.push(body);
      },
      { concurrency: 1, prefetch: 0, leaseMs: 5000, waitMs: 200, timeoutMs: 500, handleSignals: false },
    );
    try {
      await until(() => ended.includes("next"), 15_000, `the key's next job to run:\n${log.lines.join("\n")}`);
      const took = started.get("next")! - started.get("hang")!;
      assert.ok(took < 5_000, `the key's next job started ${took} ms after the hung one`);
      const dead = await client.job(String(hung.id));
      assert.equal(dead?.state, "dead", JSON.stringify(dead));
      assert.ok(dead.reason?.startsWith(TIMEOUT_REASON), dead.reason);
      assert.equal(dead.attempts, 1);
      // The handler returned before its ack reached the server: wait for
      // the ack rather than read the job in between.
      await until(async () => (await client.job(String(next.id))) === undefined, 10_000, "the next job to be acked");
      assert.ok(abortedWith instanceof JobTimeout, `the hung handler's signal was aborted with ${String(abortedWith)}`);
      assert.equal(abortedWith.timeoutMs, 500);
      assert.deepEqual(ended, ["next"], "the hung handler is still running");
      // Let it go: its late result is not sent (the server would refuse it).
      for (const r of releases) r();
      await until(() => ended.includes("hang"), 5_000, "the hung handler to return");
      const later = await client.enqueue("tenant-h", "later");
      await until(() => ended.includes("later") && worker.stats.acked === 2, 15_000, "a job of the key after the timeout to run");
      assert.equal(await client.job(String(later.id)), undefined);
    } finally {
      worker.stop();
    }
    const stats = await ran;
    const lines = log.lines.join("\n");
    assert.deepEqual(
      { acked: stats.acked, failed: stats.failed, lost: stats.lost, timedOut: stats.timedOut, unreported: stats.unreported },
      { acked: 2, failed: 0, lost: 0, timedOut: 1, unreported: 0 },
      lines,
    );
    assert.ok(log.lines.some((l) => l.startsWith("warn ") && l.includes(`job ${hung.id} `) && l.includes("passed its job timeout of 500 ms")), lines);
    assert.ok(log.lines.some((l) => l.startsWith("info ") && l.includes(`job ${hung.id} `) && l.includes("nothing is sent")), lines);
    await s.settle({ ready: 0, delayed: 0, in_flight: 0, dead: 1 });
  } finally {
    for (const r of releases) r();
    await c.close();
  }
});

// Three functions deep, as a handler's own code would be.
function readInvoice(text: string, long: boolean): number {
  return parseLines(text.split("\n"), long);
}

function parseLines(lines: string[], long: boolean): number {
  return parseInvoiceTotal(lines.join(" "), long);
}

function parseInvoiceTotal(text: string, long: boolean): number {
  if (!text.includes("total")) {
    const why = long ? "é€😀 ".repeat(300) : "the payload says nothing of it";
    throw new Error(`no total in invoice ${JSON.stringify(text)}: ${why}`);
  }
  return 0;
}

test("a failed attempt is logged with its stack, which its reason carries within FAIL_REASON_BYTES_MAX, naming the function that threw", { timeout: 60_000 }, async () => {
  const c = await cluster(2, 1);
  try {
    const s = c.servers[0]!;
    const client = new Client([s.url]);
    // The second one's message (3 kB of multi-byte characters) makes the reason longer than the bound.
    const short = await client.enqueue("inv-1", "invoice 1", { maxAttempts: 1 });
    const longer = await client.enqueue("inv-2", "invoice 2", { maxAttempts: 1 });
    const log = collectingLogger();
    const worker = new Worker([s.url], { logger: log });
    const ran = worker.run(async (job) => void readInvoice(job.payload.toString(), job.key === "inv-2"), {
      concurrency: 2,
      leaseMs: 5000,
      waitMs: 200,
      handleSignals: false,
    });
    try {
      await until(async () => (await s.status()).totals["dead"] === 2, 15_000, "both dead letters");
    } finally {
      worker.stop();
    }
    const stats = await ran;
    const lines = log.lines.join("\n");
    assert.deepEqual([stats.failed, stats.acked], [2, 0], lines);
    for (const [enq, head] of [
      [short, 'Error: no total in invoice "invoice 1": the payload says nothing of it\n    at parseInvoiceTotal ('],
      [longer, 'Error: no total in invoice "invoice 2": é€😀 é€😀 '],
    ] as const) {
      const dead = await client.job(String(enq.id));
      assert.equal(dead?.state, "dead", JSON.stringify(dead));
      const reason = dead.reason ?? "";
      assert.ok(reason.startsWith(head), reason);
      assert.ok(Buffer.byteLength(reason) <= FAIL_REASON_BYTES_MAX, `${Buffer.byteLength(reason)} bytes`);
      assert.ok(!reason.includes("\uFFFD"), `no character cut in two: ${reason}`);
      // The stack's first frames, where the failing function is, are kept.
      assert.match(reason, /\n {4}at parseInvoiceTotal \(.*\n {4}at parseLines \(.*\n {4}at readInvoice \(/, reason);
      // Logged with its whole stack.
      assert.ok(
        log.lines.some((l) => l.startsWith(`warn job ${enq.id} `) && l.includes("failed: Error: no total in invoice") && l.includes("at parseInvoiceTotal (")),
        lines,
      );
    }
    const cut = (await client.job(String(longer.id)))!.reason!;
    assert.ok(cut.includes("...\n    at parseInvoiceTotal (") && cut.endsWith("\n[... stack cut ...]"), cut);
    assert.ok(Buffer.byteLength(cut) > 880, `${Buffer.byteLength(cut)} bytes: the bound is used`);
    // The log has the whole message, which the reason had to cut.
    assert.ok(log.lines.some((l) => l.includes("é€😀 ".repeat(300))), "the whole message logged");
  } finally {
    await c.close();
  }
});
