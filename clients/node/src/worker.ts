/**
 * The worker side of the HTTP API of `shardq serve`.
 *
 * `Worker.run` long-polls `POST /v1/claim` on every URL, runs the async
 * handler for each job under one concurrency limit shared by all URLs,
 * heartbeats each running job with `POST /v1/extend` every lease/3, and then
 * acks (`/v1/ack`) or fails (`/v1/fail`) it on the server that gave it.
 * A 409 on extend, ack or fail means the run is no longer current (its
 * lease lapsed and the job went to another run): it is logged, the
 * handler's `signal` is aborted, and nothing is retried. SIGTERM and SIGINT
 * (or `stop()`) drain: no new claims, running handlers finish and are acked,
 * then `run` resolves.
 */

import { hostname } from "node:os";

import { backoffMs, normaliseUrls, postJson, ShardqError, sleep, type HttpOptions } from "./http.js";

export interface ClaimedJob {
  id: number | string;
  shard: string;
  key: string;
  /** The payload bytes (from `payload` as UTF-8, or from `payload_b64`). */
  payload: Buffer;
  attempt: number;
  receipt: string;
  fence: number | string;
  leaseExpiresMs: number | undefined;
  /** The server (base URL) that gave the job; its ack goes there. */
  server: string;
}

export interface JobContext {
  /** Aborted when the run is lost (a 409 on extend) or the drain timeout passes. */
  signal: AbortSignal;
}

export type Handler = (job: ClaimedJob, ctx: JobContext) => Promise<unknown> | unknown;

/** Throw this (or any error with a numeric `retryInMs`) from a handler to ask for a retry after a delay. */
export class RetryLater extends Error {
  override name = "RetryLater";
  constructor(
    message: string,
    readonly retryInMs: number,
  ) {
    super(message);
  }
}

export interface Logger {
  info(message: string): void;
  warn(message: string): void;
  error(message: string): void;
}

const stderrLogger: Logger = {
  info: (m) => process.stderr.write(`shardq worker: ${m}\n`),
  warn: (m) => process.stderr.write(`shardq worker: warning: ${m}\n`),
  error: (m) => process.stderr.write(`shardq worker: error: ${m}\n`),
};

export interface WorkerOptions extends HttpOptions {
  /** The worker name sent with claims (default `node-{host}-{pid}`). */
  worker?: string;
  logger?: Logger;
}

export interface RunOptions {
  /** Handlers running at once, over all URLs (default 4). */
  concurrency?: number;
  /** Job lease asked for with each claim and extend (default 30000). */
  leaseMs?: number;
  /** Long-poll wait of a claim (default 5000). */
  waitMs?: number;
  /** After a stop, how long to wait for running handlers before aborting them and returning (default 30000). */
  drainTimeoutMs?: number;
  /** Drain on SIGTERM and SIGINT (default true). */
  handleSignals?: boolean;
  /** Tries of an ack or fail that got no answer or a 5xx (default 5). */
  reportTries?: number;
}

export interface WorkerStats {
  claimed: number;
  acked: number;
  failed: number;
  /** Runs found stale (409) on extend, ack or fail. */
  lost: number;
}

const REASON_BYTES_MAX = 1000;
/** Most jobs one claim may ask for (the server's `CLAIM_MAX_LIMIT`). */
export const CLAIM_MAX = 1000;

function positiveInt(value: number, name: string): number {
  if (!Number.isSafeInteger(value) || value < 1) throw new TypeError(`Worker.run: ${name} must be a positive integer, got ${value}`);
  return value;
}

function parseJob(raw: unknown, server: string): ClaimedJob {
  const j = raw as Record<string, unknown>;
  const bad = (what: string) =>
    new ShardqError(`POST ${server}/v1/claim: a claimed job ${what}: ${JSON.stringify(raw).slice(0, 200)}`, 200, server);
  if (j === null || typeof j !== "object") throw bad("is not an object");
  if (typeof j["receipt"] !== "string") throw bad("has no string receipt");
  if (typeof j["key"] !== "string") throw bad("has no string key");
  let payload: Buffer;
  if (typeof j["payload_b64"] === "string") payload = Buffer.from(j["payload_b64"], "base64");
  else if (typeof j["payload"] === "string") payload = Buffer.from(j["payload"], "utf8");
  else throw bad("has neither payload nor payload_b64");
  return {
    id: j["id"] as number | string,
    shard: String(j["shard"]),
    key: j["key"],
    payload,
    attempt: Number(j["attempt"]),
    receipt: j["receipt"],
    fence: j["fence"] as number | string,
    leaseExpiresMs: typeof j["lease_expires_ms"] === "number" ? j["lease_expires_ms"] : undefined,
    server,
  };
}

/** A counting semaphore whose waiters are woken in order. */
class Slots {
  private waiters: (() => void)[] = [];
  constructor(private free: number) {}
  get available(): number {
    return this.free;
  }
  /** Takes up to `want` slots (at least one), waiting for one if none is free. */
  async take(want: number): Promise<number> {
    while (this.free <= 0) await new Promise<void>((r) => this.waiters.push(r));
    const n = Math.min(want, this.free);
    this.free -= n;
    return n;
  }
  /** Counts `n` more slots in use than were taken (jobs a server sent beyond `max`). */
  borrow(n: number): void {
    this.free -= n;
  }
  give(n: number): void {
    this.free += n;
    for (const w of this.waiters.splice(0)) w();
  }
}

export class Worker {
  readonly urls: readonly string[];
  readonly name: string;
  private readonly opts: WorkerOptions;
  private readonly log: Logger;
  private stopping = false;
  private wake: (() => void) | undefined;
  readonly stats: WorkerStats = { claimed: 0, acked: 0, failed: 0, lost: 0 };

  constructor(urls: string | readonly string[], opts: WorkerOptions = {}) {
    this.urls = normaliseUrls(urls, "Worker");
    this.opts = opts;
    this.name = opts.worker ?? `node-${hostname()}-${process.pid}`;
    this.log = opts.logger ?? stderrLogger;
  }

  /** Asks `run` to drain: no new claims; running handlers finish and are reported. */
  stop(): void {
    this.stopping = true;
    this.wake?.();
  }

  /**
   * Claims and runs jobs until `stop()` (or SIGTERM/SIGINT). Resolves after
   * the drain; rejects on an error no retry can fix (401, 403, 400 on claim).
   */
  async run(handler: Handler, runOpts: RunOptions = {}): Promise<WorkerStats> {
    const concurrency = positiveInt(runOpts.concurrency ?? 4, "concurrency");
    const leaseMs = positiveInt(runOpts.leaseMs ?? 30_000, "leaseMs");
    const waitMs = positiveInt(runOpts.waitMs ?? 5_000, "waitMs");
    const drainTimeoutMs = positiveInt(runOpts.drainTimeoutMs ?? 30_000, "drainTimeoutMs");
    const reportTries = positiveInt(runOpts.reportTries ?? 5, "reportTries");
    const handleSignals = runOpts.handleSignals ?? true;
    this.stopping = false;

    const slots = new Slots(concurrency);
    const running = new Map<string, { abort: AbortController; done: Promise<void> }>();
    let fatal: unknown;
    const stopped = new Promise<void>((resolve) => {
      this.wake = resolve;
      if (this.stopping) resolve();
    });
    const onSignal = (sig: string) => {
      this.log.info(`${sig}: draining (${running.size} job(s) running)`);
      this.stop();
    };
    const onTerm = () => onSignal("SIGTERM");
    const onInt = () => onSignal("SIGINT");
    if (handleSignals) {
      process.on("SIGTERM", onTerm);
      process.on("SIGINT", onInt);
    }

    const runJob = async (job: ClaimedJob, abort: AbortController): Promise<void> => {
      let lost = false;
      let finished = false;
      const markLost = (what: string, err: ShardqError) => {
        if (!lost) {
          lost = true;
          this.stats.lost++;
          this.log.warn(`job ${job.id} (key ${JSON.stringify(job.key)}, shard ${job.shard}) lost its run on ${what}: ${err.message}`);
        }
        abort.abort(err);
      };
      const beat = setInterval(() => {
        postJson(job.server, "/v1/extend", { receipts: [job.receipt], lease_ms: leaseMs }, this.opts, Math.max(1000, leaseMs / 3)).catch(
          (err: unknown) => {
            // An extend that crossed the job's own ack finds the run over: not a loss.
            if (finished) return;
            if (err instanceof ShardqError && err.isStaleReceipt) markLost("extend", err);
            else this.log.warn(`extend of job ${job.id} on ${job.server} failed (will retry at the next beat): ${String(err)}`);
          },
        );
      }, Math.max(1, Math.floor(leaseMs / 3)));
      // Past the drain timeout the run is left to its lease: stop extending it.
      abort.signal.addEventListener("abort", () => clearInterval(beat), { once: true });
      let outcome: { ok: true } | { ok: false; reason: string; retryInMs?: number };
      try {
        await handler(job, { signal: abort.signal });
        outcome = { ok: true };
      } catch (err) {
        const reason = (err instanceof Error ? err.message : String(err)) || "handler failed";
        const retry = (err as { retryInMs?: unknown } | null)?.retryInMs;
        outcome = { ok: false, reason: reason.slice(0, REASON_BYTES_MAX) };
        if (typeof retry === "number" && Number.isFinite(retry) && retry >= 0) outcome.retryInMs = Math.round(retry);
      } finally {
        finished = true;
        clearInterval(beat);
      }
      if (lost) return;
      const [path, body] = outcome.ok
        ? (["/v1/ack", { receipts: [job.receipt] }] as const)
        : ([
            "/v1/fail",
            outcome.retryInMs === undefined
              ? { receipt: job.receipt, reason: outcome.reason }
              : { receipt: job.receipt, reason: outcome.reason, retry_in_ms: outcome.retryInMs },
          ] as const);
      for (let attempt = 0; attempt < reportTries; attempt++) {
        try {
          await postJson(job.server, path, body, this.opts);
          if (outcome.ok) this.stats.acked++;
          else this.stats.failed++;
          return;
        } catch (err) {
          if (err instanceof ShardqError && err.isStaleReceipt) {
            markLost(outcome.ok ? "ack" : "fail", err);
            return;
          }
          const retryable = err instanceof ShardqError && err.retryable;
          if (!retryable || attempt === reportTries - 1) {
            this.log.error(`${path} of job ${job.id} on ${job.server} failed; the job will run again after its lease: ${String(err)}`);
            return;
          }
          await sleep(backoffMs(attempt, 50, 2000));
        }
      }
    };

    const start = (job: ClaimedJob) => {
      this.stats.claimed++;
      const abort = new AbortController();
      const done = runJob(job, abort)
        .catch((err: unknown) => this.log.error(`job ${job.id}: ${String(err)}`))
        .finally(() => {
          running.delete(job.receipt);
          slots.give(1);
        });
      running.set(job.receipt, { abort, done });
    };

    const poll = async (server: string): Promise<void> => {
      let failures = 0;
      while (!this.stopping && fatal === undefined) {
        const taken = await Promise.race([slots.take(concurrency), stopped.then(() => 0)]);
        if (taken === 0) return;
        if (this.stopping || fatal !== undefined) {
          slots.give(taken);
          return;
        }
        // Leave slots to the other servers' pollers: at most a fair share, at least one.
        // At most CLAIM_MAX per claim: the server refuses a larger `max` with 400.
        const share = Math.min(CLAIM_MAX, Math.max(1, Math.ceil(concurrency / this.urls.length)));
        const want = Math.min(taken, share);
        if (want < taken) slots.give(taken - want);
        let jobs: ClaimedJob[] = [];
        try {
          const reply = await postJson(
            server,
            "/v1/claim",
            { worker: this.name, max: want, wait_ms: waitMs, lease_ms: leaseMs },
            this.opts,
            waitMs + (this.opts.timeoutMs ?? 30_000),
          );
          const raw = (reply as { jobs?: unknown } | null)?.jobs;
          if (!Array.isArray(raw)) {
            throw new ShardqError(`POST ${server}/v1/claim: expected {"jobs": [...]}, got ${JSON.stringify(reply).slice(0, 200)}`, 200, server);
          }
          jobs = raw.map((j) => parseJob(j, server));
          failures = 0;
        } catch (err) {
          slots.give(want);
          if (err instanceof ShardqError && !err.retryable && err.status !== 200) {
            fatal = err;
            this.log.error(`claim on ${server} refused; stopping: ${err.message}`);
            this.stop();
            return;
          }
          this.log.warn(`claim on ${server} failed: ${String(err)}`);
          await Promise.race([sleep(backoffMs(failures++, 100, 5000)), stopped]);
          continue;
        }
        if (jobs.length > want) {
          // A server bug; the jobs are leased to us, so run them and count them against the limit.
          this.log.warn(`claim on ${server} returned ${jobs.length} jobs for max ${want}`);
          slots.borrow(jobs.length - want);
        }
        for (const job of jobs) start(job);
        // Slots asked for but not filled go back.
        if (jobs.length < want) slots.give(want - jobs.length);
      }
    };

    try {
      await Promise.all(this.urls.map((u) => poll(u)));
      // Drain: wait for running handlers, then abort those past the timeout.
      const all = Promise.all([...running.values()].map((r) => r.done));
      let timer: NodeJS.Timeout | undefined;
      const timedOut = await Promise.race([
        all.then(() => false),
        new Promise<boolean>((r) => {
          timer = setTimeout(() => r(true), drainTimeoutMs);
        }),
      ]);
      clearTimeout(timer);
      if (timedOut) {
        this.log.warn(`drain timeout: aborting ${running.size} job(s) still running; they are left to their leases`);
        for (const r of running.values()) r.abort.abort(new Error("drain timeout"));
      }
    } finally {
      if (handleSignals) {
        process.off("SIGTERM", onTerm);
        process.off("SIGINT", onInt);
      }
      this.wake = undefined;
    }
    if (fatal !== undefined) throw fatal;
    return { ...this.stats };
  }
}
