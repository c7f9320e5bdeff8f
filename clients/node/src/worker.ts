/**
 * The worker side of the HTTP API of `shardq serve`.
 *
 * `Worker.run` keeps a long poll (`POST /v1/claim`) open on every URL while
 * it has room, runs the async handler for each job under one concurrency
 * limit shared by all URLs, holds up to `prefetch` more jobs claimed ahead,
 * extends the leases of running and claimed-ahead jobs with one
 * `POST /v1/extend` per server every lease/3, and acks the jobs that
 * finished meanwhile with one `POST /v1/ack` per server (a failure is one
 * `POST /v1/fail`; a handler's `BackOff` is one too, with `backoff_ms`). A
 * 409 on extend, ack or fail means the run is no longer current (its lease
 * lapsed and the job went to another run): it is logged, the handler's
 * `signal` is aborted, and nothing is retried.
 *
 * While jobs are held, the worker also asks every server about once a
 * second (`STALE_CHECK_MS`) which of its runs are no longer current
 * (`POST /v1/stale`, one read per server for all its runs, extending
 * nothing): a run cancelled by `DELETE /v1/jobs/{id}` has its handler's
 * `signal` aborted within about a second, and once the handler has
 * returned the worker sends `POST /v1/fail` for it (as after an extend
 * found the run over). The server refuses it (409) but it ends a cancelled
 * run at once, so the key's next job may start then, instead of when the
 * run's job lease lapses. A job claimed ahead whose run is found over is
 * dropped and failed the same way at once.
 *
 * `timeoutMs` (or the server's `serve --job-timeout-ms`) is each run's job
 * timeout, sent with every claim: past it the server fails the run itself
 * (an attempt used, with the reason `timed out: ...`), whatever the
 * extends. At that moment the worker aborts the handler's `signal` (its
 * reason a `JobTimeout`), frees its slot, sends nothing for it (a late
 * result is dropped) and counts it in `stats.timedOut`.
 *
 * A handler that throws fails the attempt: the failure is logged (`warn`,
 * with the stack) and its reason is the error's stack, at most
 * `FAIL_REASON_BYTES_MAX` bytes of UTF-8 (see `failureReason`).
 *
 * SIGTERM and SIGINT (or `stop()`) drain: the long polls are cancelled at
 * once, every claimed job runs and is reported, then `run` resolves. A
 * second signal (or `stop({ drain: false })`), or the drain timeout, stops
 * without draining: the handlers still running are cancelled through their
 * signals, jobs claimed ahead are not started, and none of them is acked
 * (the server runs them again after their leases).
 */

import { hostname } from "node:os";

import {
  backoffMs,
  Cancelled,
  normaliseUrls,
  REPORT_SERVER_WAIT_MS,
  ShardqError,
  sleep,
  StaleReceipt,
  BadRequest,
  Transport,
  Unauthorized,
  type HttpOptions,
} from "./http.js";
import { scheduleTickOf, type BatchCallbackKind, type ScheduleTick } from "./client.js";

export interface ClaimedJob {
  id: number | string;
  shard: string;
  key: string;
  /** The payload bytes (from `payload` as UTF-8, or from `payload_b64`). */
  payload: Buffer;
  attempt: number;
  /** Attempts before the job becomes a dead letter (undefined when the server did not say). */
  maxAttempts: number | undefined;
  receipt: string;
  fence: number | string;
  leaseExpiresMs: number | undefined;
  /**
   * When the server fails the run if it has not ended (its job timeout: the
   * run's `timeoutMs` or the server's default), in ms since the epoch on the
   * server's clock; undefined without one.
   */
  timeoutExpiresMs: number | undefined;
  /** The dedup id the job was enqueued with (undefined: none): a handler's own idempotency key. */
  dedupId: string | undefined;
  /** A schedule's job: its schedule and tick (undefined for other jobs). */
  schedule: ScheduleTick | undefined;
  /** A released dependent's job: the dependent's id (`"@N"`); `client.dependent(id)` gives its dependencies' outcomes and results. */
  dependent: string | undefined;
  /**
   * A job of a batch, or a batch's callback: the batch's id (`"@N"`);
   * `client.batch(id)` shows the batch, and a job of a batch may add more
   * jobs to it (`enqueue(key, payload, { batch: job.batch })`) while it runs.
   */
  batch: string | undefined;
  /** A batch's callback: its kind (`"complete"`, `"success"` or `"death"`); undefined for any other job. */
  batchCallback: BatchCallbackKind | undefined;
  /** The server (base URL) that gave the job; its ack goes there. */
  server: string;
}

export interface JobContext {
  /**
   * Aborted when the run is over for this worker and its result will not be
   * taken: the run is lost (a 409 on extend), passed its job timeout
   * (`timeoutMs`; `signal.reason` is then a `JobTimeout`), or is left behind
   * (drain timeout, a stop without draining). Pass it to `fetch()` and
   * friends, or check `signal.aborted`, to return early.
   */
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

/** Longest back-off a handler may ask for, in ms (one day: the server's `BACKOFF_MS_MAX`). */
export const BACKOFF_MS_MAX = 86_400_000;

/**
 * Throw this from a handler when its downstream limits it (a 429, a spent
 * quota): the run ends without using an attempt, the job goes back to the
 * head of its key, and the key starts nothing for `backoffMs` (0 to one day)
 * while other keys run on. With `{ group: true }` every key of the key's
 * flow-control group waits too, in every process. (Any error with a numeric
 * `backoffMs` does the same, and `backoffGroup: true` holds the group.)
 */
export class BackOff extends Error {
  override name = "BackOff";
  readonly backoffMs: number;
  /** Whether the key's whole flow-control group waits too. */
  readonly backoffGroup: boolean;
  constructor(backoffMs: number, opts: { group?: boolean } = {}) {
    if (!Number.isSafeInteger(backoffMs) || backoffMs < 0 || backoffMs > BACKOFF_MS_MAX) {
      throw new TypeError(`BackOff: backoffMs must be an integer from 0 to ${BACKOFF_MS_MAX} (one day), got ${String(backoffMs)}`);
    }
    const group = opts.group === true;
    super(`back off ${backoffMs} ms${group ? " (the key's whole group)" : ""}`);
    this.backoffMs = backoffMs;
    this.backoffGroup = group;
  }
}

/** Shortest job timeout a claim may ask for, in ms (the server's `JOB_TIMEOUT_MS_MIN`). */
export const JOB_TIMEOUT_MS_MIN = 1;
/** Longest job timeout a claim may ask for, in ms: 7 days (the server's `JOB_TIMEOUT_MS_MAX`). */
export const JOB_TIMEOUT_MS_MAX = 604_800_000;

/**
 * The reason a handler's `signal` is aborted with when its run passes its
 * job timeout: the server has failed the run (an attempt used), and the
 * handler's result, whenever it comes, is not sent.
 */
export class JobTimeout extends Error {
  override name = "JobTimeout";
  constructor(
    /** The run's job timeout, in ms. */
    readonly timeoutMs: number,
  ) {
    super(`the run passed its job timeout of ${timeoutMs} ms`);
  }
}

/**
 * Longest reason a worker sends with a failed attempt, in bytes of UTF-8:
 * what the server's store keeps of one (`FAIL_REASON_BYTES_MAX` of
 * shardq-core, 1 KiB).
 */
export const FAIL_REASON_BYTES_MAX = 1024;

/** Most bytes of a job's result (the server's bound): a handler that returns more fails its attempt, saying so. */
export const RESULT_BYTES_MAX = 64 * 1024;

/**
 * The wire form of a handler's return value in `POST /v1/ack`: undefined (and null) for none, a string as text, a
 * `Uint8Array` (a `Buffer`) in base64, anything else as its JSON text. Throws (the attempt fails) for a value JSON
 * cannot write or a result over `RESULT_BYTES_MAX`.
 */
export function resultField(value: unknown): Record<string, string> | undefined {
  if (value === undefined || value === null) return undefined;
  let field: Record<string, string>;
  let bytes: number;
  if (value instanceof Uint8Array) {
    const b = Buffer.from(value.buffer, value.byteOffset, value.byteLength);
    field = { result_b64: b.toString("base64") };
    bytes = b.byteLength;
  } else {
    const text = typeof value === "string" ? value : JSON.stringify(value);
    if (typeof text !== "string") throw new TypeError(`the handler returned a ${typeof value}, which JSON cannot write; return undefined for no result`);
    field = { result: text };
    bytes = Buffer.byteLength(text, "utf8");
  }
  if (bytes > RESULT_BYTES_MAX) throw new RangeError(`the handler's result is ${bytes} bytes, over the ${RESULT_BYTES_MAX}-byte bound on results`);
  return field;
}

/** What stands for the part of a stack cut from a failure's reason. */
const REASON_CUT_MARK = "\n[... stack cut ...]";
/** Causes (`error.cause`) a reason follows, at most. */
const CAUSES_MAX = 4;

function utf8Bytes(text: string): number {
  return Buffer.byteLength(text, "utf8");
}

/**
 * The longest prefix of `text` of at most `most` bytes of UTF-8 that ends on
 * a character boundary (a lone surrogate counts as U+FFFD, as it is sent).
 */
export function utf8Prefix(text: string, most: number): string {
  if (most <= 0) return "";
  const bytes = Buffer.from(text, "utf8");
  if (bytes.length <= most) return bytes.toString("utf8");
  let end = most;
  // Back off to the first byte of the character cut (never a continuation byte 10xxxxxx).
  while (end > 0 && (bytes[end]! & 0xc0) === 0x80) end--;
  return bytes.subarray(0, end).toString("utf8");
}

/** `Type: message` of a thrown value, never throwing itself. */
function headOf(err: unknown): string {
  try {
    if (err instanceof Error) return String(err);
    if (typeof err === "object" && err !== null) {
      const { name, message } = err as { name?: unknown; message?: unknown };
      if (typeof message === "string") {
        const n = typeof name === "string" && name !== "" ? name : "Error";
        return message === "" ? n : `${n}: ${message}`;
      }
      const json = JSON.stringify(err);
      return `thrown ${json ?? String(err)}`;
    }
    return typeof err === "string" ? err : `thrown ${String(err)}`;
  } catch {
    return `thrown ${typeof err} (its text could not be read)`;
  }
}

/** The frames of `err.stack` (the lines after its header, innermost first), empty without a stack. */
function framesOf(err: unknown, head: string): string {
  let stack: unknown;
  try {
    stack = (err as { stack?: unknown } | null | undefined)?.stack;
  } catch {
    return "";
  }
  if (typeof stack !== "string") return "";
  let frames: string;
  if (stack.startsWith(head)) frames = stack.slice(head.length);
  else {
    // A header that differs from `head` (a message changed after the stack was taken): the frames start at the first `at` line.
    const at = /\n\s+at /.exec(stack);
    frames = at === null ? "" : stack.slice(at.index);
  }
  return frames.replace(/^\n+/, "").trimEnd();
}

/** Head line and frames of `err`, then of each of its causes. */
function traceOf(err: unknown): { head: string; trace: string } {
  const head = headOf(err) || "handler failed";
  const parts = [framesOf(err, head)];
  const seen = new Set<unknown>([err]);
  let at: unknown = err;
  for (let i = 0; i < CAUSES_MAX; i++) {
    let cause: unknown;
    try {
      cause = (at as { cause?: unknown } | null | undefined)?.cause;
    } catch {
      break;
    }
    if (cause === undefined || seen.has(cause)) break;
    seen.add(cause);
    const h = headOf(cause);
    const f = framesOf(cause, h);
    parts.push(`Caused by: ${h}${f === "" ? "" : `\n${f}`}`);
    at = cause;
  }
  return { head, trace: parts.filter((p) => p !== "").join("\n") };
}

/**
 * The reason a worker sends for an attempt whose handler threw `err`: its
 * `Type: message` line, then its stack's frames (innermost first, where
 * the failing function is) and its causes', at most `bytesMax` bytes of
 * UTF-8. A longer one keeps its head line (cut to half of `bytesMax`,
 * ending `...`, when longer), then the frames: all of them when they fit,
 * else as many of the first ones as fit (whole lines when one ends near
 * the cut) and `[... stack cut ...]`; every cut falls on a character
 * boundary. A thrown non-error is its text (`thrown 42` for a primitive).
 */
export function failureReason(err: unknown, bytesMax: number = FAIL_REASON_BYTES_MAX): string {
  let { head, trace } = traceOf(err);
  const whole = trace === "" ? head : `${head}\n${trace}`;
  if (utf8Bytes(whole) <= bytesMax) return whole;
  if (trace === "") return utf8Prefix(head, bytesMax);
  const half = Math.floor(bytesMax / 2);
  if (utf8Bytes(head) > half) head = `${utf8Prefix(head, half - 3)}...`;
  // The head alone was too long: the whole stack may fit after the cut head.
  if (utf8Bytes(head) + 1 + utf8Bytes(trace) <= bytesMax) return `${head}\n${trace}`;
  const room = bytesMax - utf8Bytes(head) - 1 - utf8Bytes(REASON_CUT_MARK);
  if (room <= 0) return utf8Prefix(head, bytesMax);
  let kept = utf8Prefix(trace, room);
  const line = kept.lastIndexOf("\n");
  if (line > (kept.length * 3) / 4) kept = kept.slice(0, line);
  return `${head}\n${kept}${REASON_CUT_MARK}`;
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
  /** Jobs claimed ahead of a free handler, over all URLs (default: `concurrency`; 0 claims only for idle handlers). */
  prefetch?: number;
  /** Job lease asked for with each claim and extend (default 30000). */
  leaseMs?: number;
  /** Long-poll wait of a claim (default 5000, at most the server's 30000). */
  waitMs?: number;
  /** After a stop, how long to wait for the claimed jobs to run and be reported before leaving the rest behind (default 30000). */
  drainTimeoutMs?: number;
  /** Drain on SIGTERM and SIGINT, stop without draining on a second one (default true). */
  handleSignals?: boolean;
  /** Tries of an ack or fail that got no answer or a 5xx (default 5). */
  reportTries?: number;
  /**
   * Each run's job timeout in ms, sent as `timeout_ms` with every claim
   * (`JOB_TIMEOUT_MS_MIN` to `JOB_TIMEOUT_MS_MAX`, 1 ms to 7 days; default:
   * the server's `serve --job-timeout-ms`, if any). Past it the server fails
   * the run (an attempt used), and the worker aborts the handler's `signal`
   * with a `JobTimeout`, frees its slot and sends nothing for it.
   */
  timeoutMs?: number;
}

export interface StopOptions {
  /** False: stop without draining (cancel running handlers, start no claimed job). Default true. */
  drain?: boolean;
}

export interface WorkerStats {
  /** Jobs claimed. */
  claimed: number;
  /** Jobs whose ack the server confirmed. */
  acked: number;
  /** Jobs whose failure the server confirmed. */
  failed: number;
  /** Runs found over: a 409 on extend, ack or fail, or a claimed-ahead job whose lease passed before it started. */
  lost: number;
  /** Results given up on after their tries (no answer, 5xx, or cut off by the stop): the leases decide. */
  unreported: number;
  /** Jobs left behind by a stop without draining or the drain timeout (handlers cancelled, claimed-ahead jobs not started); never reported. */
  abandoned: number;
  /** Answered `/v1/claim` requests. */
  claimRequests: number;
  /** Answered `/v1/ack` requests. */
  ackRequests: number;
  /** Runs ended by a handler's `BackOff` (the server confirmed them; no attempt was used). */
  backedOff: number;
  /**
   * Runs that passed their job timeout (`timeoutMs`, or the server's
   * default): the server failed them (an attempt used); the worker aborted
   * their handlers' signals and sent nothing for them (or the server refused
   * a result sent just before the worker saw the deadline pass). Not counted
   * in `lost` nor `failed`.
   */
  timedOut: number;
}

function emptyStats(): WorkerStats {
  return { claimed: 0, acked: 0, failed: 0, lost: 0, unreported: 0, abandoned: 0, claimRequests: 0, ackRequests: 0, backedOff: 0, timedOut: 0 };
}
/** Most jobs one claim may ask for (the server's `CLAIM_MAX_LIMIT`). */
export const CLAIM_MAX = 1000;
/** Most receipts in one ack or extend (the server's `RECEIPTS_PER_REQUEST_MAX`). */
export const RECEIPTS_MAX = 1000;
/** Longest long poll the server accepts (its `WAIT_MS_MAX`). */
export const WAIT_MS_MAX = 30_000;
/**
 * A claim still unanswered this long after it was sent is waiting in its
 * long poll (a claim that finds jobs is answered within milliseconds): a
 * stop cancels it then, and lets a younger one be answered, since cancelling
 * a claim the server is answering leaves its jobs leased to nobody until
 * their leases pass.
 */
const CLAIM_ANSWER_MS = 100;
/**
 * How often the worker asks each server which of its held runs are no
 * longer current (`POST /v1/stale`), while it holds any.
 */
export const STALE_CHECK_MS = 1_000;
/** The reason sent with the fail that ends a run found over once its handler returned. */
const STALE_FAIL_REASON = "the run is no longer current (cancelled, or ended elsewhere); its handler has returned";
/** Timeout of the last acks sent when a stop leaves jobs behind. */
const LAST_ACKS_TIMEOUT_MS = 2_000;

function checkInt(value: number, name: string, min: number, max = Number.MAX_SAFE_INTEGER): number {
  if (!Number.isSafeInteger(value) || value < min || value > max) {
    throw new TypeError(`Worker.run: ${name} must be an integer from ${min} to ${max}, got ${value}`);
  }
  return value;
}

/** A printable form of a bad option value: strings quoted, others as `String()` shows them. */
function shown(value: unknown): string {
  if (typeof value === "string") return JSON.stringify(value);
  try {
    return String(value);
  } catch {
    return typeof value;
  }
}

/** A run's `timeoutMs`: undefined (the server's default, if any) or a whole number of ms the server takes. */
function checkTimeoutMs(value: unknown): number | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== "number" || !Number.isSafeInteger(value) || value < JOB_TIMEOUT_MS_MIN || value > JOB_TIMEOUT_MS_MAX) {
    throw new TypeError(
      `Worker.run: invalid timeoutMs ${shown(value)}: a whole number of ms from ${JOB_TIMEOUT_MS_MIN} to ${JOB_TIMEOUT_MS_MAX} (7 days), or undefined for the server's default`,
    );
  }
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
    maxAttempts: typeof j["max_attempts"] === "number" ? j["max_attempts"] : undefined,
    receipt: j["receipt"],
    fence: j["fence"] as number | string,
    leaseExpiresMs: typeof j["lease_expires_ms"] === "number" ? j["lease_expires_ms"] : undefined,
    timeoutExpiresMs: typeof j["timeout_expires_ms"] === "number" ? j["timeout_expires_ms"] : undefined,
    dedupId: typeof j["dedup_id"] === "string" ? j["dedup_id"] : undefined,
    schedule: scheduleTickOf(j["schedule"]),
    dependent: typeof j["dependent"] === "string" ? j["dependent"] : undefined,
    batch: typeof j["batch"] === "string" ? j["batch"] : undefined,
    batchCallback: typeof j["batch_callback"] === "string" ? (j["batch_callback"] as BatchCallbackKind) : undefined,
    server,
  };
}

/** A claimed job as the worker tracks it. */
interface Held {
  job: ClaimedJob;
  /** The handler's result in its `POST /v1/ack` form (see `resultField`). */
  result?: Record<string, string>;
  /** `performance.now()` past which the lease may have lapsed (claim answer or last extend's send, plus the lease). */
  leaseUntil: number;
  /** Set when the server said the run is over (an extend refused, or `POST /v1/stale` named it). */
  lost: boolean;
  /**
   * Set with `lost` when the server said so (not at a job timeout): once the
   * handler has returned (or at once for a job claimed ahead) a fail of the
   * receipt is sent, which ends a cancelled run (refused, 409) and frees its key.
   */
  stale: boolean;
  /** Set while the handler runs. */
  abort: AbortController | undefined;
  /** The run's job timeout in ms, undefined without one. */
  timeoutMs: number | undefined;
  /** `performance.now()` at which the run passes its job timeout (the claim's answer plus the timeout: for a `timeoutMs` of the run, never before the server's deadline). */
  timeoutUntil: number | undefined;
  /** Fires at `timeoutUntil`. */
  timer: NodeJS.Timeout | undefined;
  /** Set when the worker saw the run pass its job timeout. */
  timedOut: boolean;
}

/** Whether `held`'s run has passed its job timeout as this process knows it. */
function pastTimeout(held: Held, now = performance.now()): boolean {
  return held.timedOut || (held.timeoutUntil !== undefined && now >= held.timeoutUntil);
}

/** Forgets `held`'s job timeout timer. */
function clearTimer(held: Held): void {
  if (held.timer !== undefined) clearTimeout(held.timer);
  held.timer = undefined;
}

/** One `run`'s state. */
class Run {
  readonly stats: WorkerStats = emptyStats();
  /** Claimed, not finished: running or waiting for a handler. */
  readonly held = new Map<string, Held>();
  readonly waiting: Held[] = [];
  running = 0;
  /** Sum of the `max` of the claims under way. */
  reserved = 0;
  /** Receipts of finished jobs to ack, per server. */
  readonly acks = new Map<string, Held[]>();
  readonly acking = new Set<string>();
  /** Reports (ack and fail requests) under way. */
  readonly reports = new Set<Promise<void>>();
  /** Extends under way: the heartbeat does not wait for them, the end of the run does. */
  readonly extends = new Set<Promise<void>>();
  /** Aborted at the stop: ends the backoff sleeps of the pollers. */
  readonly claims = new AbortController();
  /** The claims under way: when each was sent, and how to cancel it. */
  readonly polls = new Set<{ sent: number; cancel: AbortController }>();
  /** Aborted when jobs are left behind, and at the end of the run: cuts the reports and extends off. */
  readonly cutoff = new AbortController();
  draining = false;
  abandoned = false;
  fatal: unknown;
  /** Called for a held run the server said is over (set by `Worker.run`). */
  found: (held: Held, what: string, err: ShardqError | undefined) => void = () => undefined;
  private waiters: (() => void)[] = [];

  /** Resolves at the next change of the counts above. */
  changed(): Promise<void> {
    return new Promise((r) => this.waiters.push(r));
  }

  notify(): void {
    for (const w of this.waiters.splice(0)) w();
  }

  get idle(): boolean {
    return this.held.size === 0 && this.reports.size === 0 && this.acking.size === 0 && [...this.acks.values()].every((q) => q.length === 0);
  }
}

export class Worker {
  readonly urls: readonly string[];
  readonly name: string;
  private readonly log: Logger;
  private readonly transports: Map<string, Transport>;
  private current: Run | undefined;
  private stopRequest: StopOptions | undefined;
  private lastStats: WorkerStats | undefined;

  constructor(urls: string | readonly string[], opts: WorkerOptions = {}) {
    this.urls = normaliseUrls(urls, "Worker");
    this.name = opts.worker ?? `node-${hostname()}-${process.pid}`;
    this.log = opts.logger ?? stderrLogger;
    this.transports = new Map(this.urls.map((u) => [u, new Transport(u, opts)]));
  }

  /** The counts of the run under way, or of the last one. */
  get stats(): WorkerStats {
    return { ...(this.current?.stats ?? this.lastStats ?? emptyStats()) };
  }

  /**
   * Stops `run`. By default it drains: the long polls are cancelled, every
   * claimed job runs and is reported, then `run` resolves. `{ drain: false }`
   * stops at once: running handlers are cancelled through their signals,
   * claimed jobs not started are left, and none of them is reported.
   */
  stop(opts: StopOptions = {}): void {
    const run = this.current;
    if (run === undefined) {
      // Before `run` started (or between runs): the next run stops at once.
      this.stopRequest = opts;
      return;
    }
    if (opts.drain === false) this.leaveBehind(run, "stopped without draining");
    else this.beginDrain(run);
  }

  /**
   * Closes the keep-alive connections; a later request opens new ones.
   * `run` does this itself when it ends, so nothing is left open after it.
   */
  close(): void {
    for (const t of this.transports.values()) t.close();
  }

  /**
   * Claims and runs jobs until `stop()` (or SIGTERM/SIGINT). Resolves with
   * the stats after the drain; rejects with the error when a claim is
   * refused in a way no retry can fix (`Unauthorized` for 401/403,
   * `BadRequest` for 400), after draining what it had claimed.
   */
  async run(handler: Handler, runOpts: RunOptions = {}): Promise<WorkerStats> {
    if (this.current !== undefined) throw new Error("Worker.run: already running");
    const concurrency = checkInt(runOpts.concurrency ?? 4, "concurrency", 1);
    const prefetch = checkInt(runOpts.prefetch ?? concurrency, "prefetch", 0);
    const leaseMs = checkInt(runOpts.leaseMs ?? 30_000, "leaseMs", 100);
    const waitMs = checkInt(runOpts.waitMs ?? 5_000, "waitMs", 0, WAIT_MS_MAX);
    const drainTimeoutMs = checkInt(runOpts.drainTimeoutMs ?? 30_000, "drainTimeoutMs", 0);
    const reportTries = checkInt(runOpts.reportTries ?? 5, "reportTries", 1);
    const timeoutMs = checkTimeoutMs(runOpts.timeoutMs);
    const handleSignals = runOpts.handleSignals ?? true;
    const capacity = concurrency + prefetch;

    const run = new Run();
    this.current = run;
    const log = this.log;
    const stats = run.stats;

    let signals = 0;
    const onSignal = (sig: string) => {
      signals++;
      if (signals === 1) {
        log.info(`${sig}: draining (${run.running} job(s) running, ${run.waiting.length} claimed ahead); ${sig} again stops without draining`);
        this.stop();
      } else {
        log.warn(`${sig} again: stopping without draining`);
        this.stop({ drain: false });
      }
    };
    const onTerm = () => onSignal("SIGTERM");
    const onInt = () => onSignal("SIGINT");
    if (handleSignals) {
      process.on("SIGTERM", onTerm);
      process.on("SIGINT", onInt);
    }

    const sendReport = (held: Held, path: "/v1/fail", body: Record<string, unknown>): void => {
      const p = this.report(run, held, path, body, reportTries).finally(() => {
        run.reports.delete(p);
        run.notify();
      });
      run.reports.add(p);
    };

    /** `job ... (key, shard, attempt a of m) at server`, for the log. */
    const about = (job: ClaimedJob): string =>
      `job ${job.id} (key ${JSON.stringify(job.key)}, shard ${job.shard}, attempt ${job.attempt} of ${job.maxAttempts ?? "?"}) at ${job.server}`;

    /**
     * What to send for a handler that threw `err` (logged here): a
     * `BackOff` or `RetryLater` sends its own message (at `info`), any other
     * error its stack, bounded (at `warn`, with the whole stack).
     */
    const failureOf = (job: ClaimedJob, err: unknown): Record<string, unknown> => {
      const { retryInMs: retry, backoffMs: backoff, backoffGroup } = (typeof err === "object" && err !== null ? err : {}) as {
        retryInMs?: unknown;
        backoffMs?: unknown;
        backoffGroup?: unknown;
      };
      const body: Record<string, unknown> = { receipt: job.receipt };
      const message = () => {
        const m = (err as { message?: unknown } | null | undefined)?.message;
        return (typeof m === "string" ? m : headOf(err)) || "handler failed";
      };
      if (typeof backoff === "number" && Number.isFinite(backoff) && backoff >= 0) {
        body["reason"] = utf8Prefix(message(), FAIL_REASON_BYTES_MAX);
        body["backoff_ms"] = Math.round(backoff);
        body["backoff_group"] = backoffGroup === true;
        log.info(`${about(job)}: the handler backs off ${body["backoff_ms"]} ms: ${message()}`);
      } else if (typeof retry === "number" && Number.isFinite(retry) && retry >= 0) {
        body["reason"] = utf8Prefix(message(), FAIL_REASON_BYTES_MAX);
        body["retry_in_ms"] = Math.round(retry);
        log.info(`${about(job)}: the handler asked for a retry in ${body["retry_in_ms"]} ms: ${message()}`);
      } else {
        body["reason"] = failureReason(err);
        log.warn(`${about(job)} failed: ${failureReason(err, Number.POSITIVE_INFINITY)}`);
      }
      return body;
    };

    const runJob = async (held: Held): Promise<void> => {
      const { job } = held;
      const abort = new AbortController();
      held.abort = abort;
      let failed = false;
      let error: unknown;
      try {
        const value = await handler(job, { signal: abort.signal });
        const result = resultField(value);
        if (result !== undefined) held.result = result;
      } catch (err) {
        failed = true;
        error = err;
      }
      held.abort = undefined;
      clearTimer(held);
      if (held.timedOut) {
        // The timeout freed the slot and counted the run: the server failed it, and would refuse this result.
        log.info(
          `${about(job)}: the handler ended after the run's job timeout of ${held.timeoutMs} ms (${failed ? `it threw ${headOf(error)}` : "it returned"}); nothing is sent`,
        );
        return;
      }
      // Left behind (drain timeout, a stop without draining): counted then, never reported.
      if (!run.held.delete(job.receipt)) return;
      run.running--;
      if (held.lost) {
        // The extend or stale check that found the run over logged and
        // counted it; the fail ends a cancelled run (refused with 409) and
        // so frees its key now rather than when its lease lapses.
        if (held.stale) sendReport(held, "/v1/fail", { receipt: job.receipt, reason: STALE_FAIL_REASON });
      } else if (pastTimeout(held)) {
        // Ended as its deadline passed, before the timer ran: the server failed the run.
        held.timedOut = true;
        stats.timedOut++;
        log.warn(`${about(job)}: the run passed its job timeout of ${held.timeoutMs} ms as its handler ended; nothing is sent (the server fails the run)`);
      } else if (!failed) {
        this.queueAck(run, held, reportTries);
      } else {
        sendReport(held, "/v1/fail", failureOf(job, error));
      }
      dispatch();
      run.notify();
    };

    /**
     * `held`'s run passed its job timeout: the server fails it. A running
     * handler's signal is aborted with a `JobTimeout` and its slot freed (a
     * handler that ignores its signal runs on, its result dropped); a job
     * claimed ahead is not run.
     */
    const timeUp = (held: Held): void => {
      held.timer = undefined;
      // Finished, left behind, or found lost by an extend (counted there).
      if (run.held.get(held.job.receipt) !== held || held.lost) return;
      held.timedOut = true;
      stats.timedOut++;
      run.held.delete(held.job.receipt);
      const what = `${about(held.job)}: the run passed its job timeout of ${held.timeoutMs} ms`;
      const abort = held.abort;
      if (abort !== undefined) {
        run.running--;
        log.warn(`${what}: its handler's signal is aborted, its slot freed, and its result will not be sent (the server fails the run)`);
        abort.abort(new JobTimeout(held.timeoutMs!));
      } else {
        const i = run.waiting.indexOf(held);
        if (i >= 0) run.waiting.splice(i, 1);
        log.warn(`${what} before a handler was free; not run (the server fails the run)`);
      }
      // A timer may run a little before `performance.now()` reaches its
      // deadline (the loop's clock is cached and whole milliseconds): the
      // deadline it ran for has passed, so a job claimed ahead with the same
      // deadline must not take the slot it freed.
      dispatch(Math.max(performance.now(), held.timeoutUntil ?? 0));
      run.notify();
    };

    /** Starts jobs claimed ahead while slots are free; `now` is the time their deadlines are judged at. */
    const dispatch = (now?: number): void => {
      while (run.running < concurrency && run.waiting.length > 0 && !run.abandoned) {
        const held = run.waiting.shift()!;
        if (!held.lost && pastTimeout(held, Math.max(now ?? 0, performance.now()))) {
          // Its timer has not run yet.
          clearTimer(held);
          run.held.delete(held.job.receipt);
          held.timedOut = true;
          stats.timedOut++;
          log.warn(`${about(held.job)}: the run passed its job timeout of ${held.timeoutMs} ms before a handler was free; not run (the server fails the run)`);
          run.notify();
          continue;
        }
        if (held.lost || performance.now() >= held.leaseUntil) {
          // Running it now could overlap the key's next run elsewhere.
          clearTimer(held);
          run.held.delete(held.job.receipt);
          stats.lost++;
          if (held.stale) sendReport(held, "/v1/fail", { receipt: held.job.receipt, reason: STALE_FAIL_REASON });
          log.warn(
            `job ${held.job.id} (key ${JSON.stringify(held.job.key)}, shard ${held.job.shard}) at ${held.job.server}: ${held.lost ? "its run was lost" : "its lease passed"} before a handler was free; not run (the server runs it again)`,
          );
          run.notify();
          continue;
        }
        run.running++;
        runJob(held).catch((err: unknown) => log.error(`job ${held.job.id}: ${String(err)}`));
      }
    };

    const poll = async (server: string): Promise<void> => {
      const transport = this.transports.get(server)!;
      const share = Math.max(1, Math.ceil(capacity / this.urls.length));
      let failures = 0;
      while (!run.draining) {
        // Wait for room; then every URL polls, each for at least one job,
        // even when the others' polls hold every free slot (so a quiet
        // server cannot keep the others' jobs waiting).
        while (run.held.size >= capacity && !run.draining) await run.changed();
        if (run.draining) return;
        const want = Math.min(CLAIM_MAX, Math.max(1, Math.min(share, capacity - run.held.size - run.reserved)));
        run.reserved += want;
        let jobs: ClaimedJob[];
        const pending = { sent: performance.now(), cancel: new AbortController() };
        run.polls.add(pending);
        try {
          const claim: Record<string, unknown> = { worker: this.name, max: want, wait_ms: waitMs, lease_ms: leaseMs };
          if (timeoutMs !== undefined) claim["timeout_ms"] = timeoutMs;
          const reply = await transport.post("/v1/claim", claim, { serverWaitMs: waitMs, signal: pending.cancel.signal },
          ).finally(() => run.polls.delete(pending));
          const raw = (reply as { jobs?: unknown } | null)?.jobs;
          if (!Array.isArray(raw)) {
            throw new ShardqError(`POST ${server}/v1/claim: expected {"jobs": [...]}, got ${JSON.stringify(reply).slice(0, 200)}`, 200, server);
          }
          jobs = raw.map((j) => parseJob(j, server));
          failures = 0;
        } catch (err) {
          run.reserved -= want;
          if (err instanceof Cancelled) return;
          if (err instanceof Unauthorized || err instanceof BadRequest) {
            if (run.fatal === undefined) run.fatal = err;
            log.error(`claim on ${server} refused; stopping: ${err.message}`);
            this.beginDrain(run);
            return;
          }
          log.warn(`claim on ${server} failed: ${String(err)}`);
          await sleep(backoffMs(failures++, 100, 5000), run.claims.signal);
          continue;
        }
        run.reserved -= want;
        stats.claimRequests++;
        stats.claimed += jobs.length;
        // The server started the leases, and the job timeouts, just before it answered.
        const answered = performance.now();
        const leaseUntil = answered + leaseMs;
        for (const job of jobs) {
          // The run's job timeout: ours, else the server's default, which the answer shows
          // (`timeout_expires_ms` and `lease_expires_ms` are of one clock, the server's).
          let ms = timeoutMs;
          if (ms === undefined && job.timeoutExpiresMs !== undefined && job.leaseExpiresMs !== undefined) {
            ms = Math.max(1, job.timeoutExpiresMs - job.leaseExpiresMs + leaseMs);
          }
          const held: Held = { job, leaseUntil, lost: false, stale: false, abort: undefined, timeoutMs: ms, timeoutUntil: undefined, timer: undefined, timedOut: false };
          run.held.set(job.receipt, held);
          if (run.abandoned) {
            // A claim answered after the stop left everything behind.
            run.held.delete(job.receipt);
            stats.abandoned++;
            continue;
          }
          if (ms !== undefined) {
            held.timeoutUntil = answered + ms;
            held.timer = setTimeout(() => timeUp(held), ms);
          }
          run.waiting.push(held);
        }
        dispatch();
        run.notify();
      }
    };

    /**
     * The server said `held`'s run is over (an extend refused it, or the
     * stale check named it): a running handler's signal is aborted (its
     * fail is sent once it returns); a job claimed ahead is dropped and
     * failed at once. Either frees a cancelled run's key.
     */
    run.found = (held: Held, what: string, err: ShardqError | undefined): void => {
      // Finished meanwhile (acked or failed with that receipt: over, not lost), or already found.
      if (held.lost || run.held.get(held.job.receipt) !== held) return;
      // Refused as its job timeout passed: its timer ends the run (counted in `timedOut`).
      if (pastTimeout(held)) return;
      held.lost = true;
      held.stale = true;
      stats.lost++;
      if (err !== undefined) this.logLost(held.job, what, err);
      else log.warn(`${about(held.job)}: the run is no longer current (${what}: cancelled, or ended elsewhere); ${held.abort !== undefined ? "its handler's signal is aborted" : "not run"}`);
      if (held.abort !== undefined) {
        held.abort.abort(err ?? new Error("the run is no longer current: cancelled, or ended elsewhere"));
        return;
      }
      const i = run.waiting.indexOf(held);
      if (i >= 0) run.waiting.splice(i, 1);
      clearTimer(held);
      run.held.delete(held.job.receipt);
      sendReport(held, "/v1/fail", { receipt: held.job.receipt, reason: STALE_FAIL_REASON });
      run.notify();
    };

    const beat = setInterval(() => this.extendAll(run, leaseMs), Math.max(1, Math.floor(leaseMs / 3)));
    const check = setInterval(() => this.checkStale(run), STALE_CHECK_MS);

    try {
      if (this.stopRequest !== undefined) {
        const req = this.stopRequest;
        this.stopRequest = undefined;
        this.stop(req);
      }
      await Promise.all(this.urls.map((u) => poll(u)));
      // Drain: every claimed job runs and is reported, within the timeout.
      let timer: NodeJS.Timeout | undefined;
      const timedOut = new Promise<void>((r) => {
        timer = setTimeout(r, drainTimeoutMs);
      });
      let late = false;
      void timedOut.then(() => {
        late = true;
        run.notify();
      });
      while (!run.idle && !late && !run.abandoned) await run.changed();
      clearTimeout(timer);
      if (!run.idle && !run.abandoned) this.leaveBehind(run, `drain timeout (${drainTimeoutMs} ms)`);
      // What a stop left behind: the reports under way are cut off; the acks of finished jobs go once.
      while (run.reports.size > 0 || run.acking.size > 0) await run.changed();
      await this.lastAcks(run);
    } finally {
      clearInterval(beat);
      clearInterval(check);
      if (handleSignals) {
        process.off("SIGTERM", onTerm);
        process.off("SIGINT", onInt);
      }
      // Every job is reported or left behind: an extend still waiting for
      // its answer (up to lease/3) serves nothing now, and would keep the
      // process alive after `run` resolved. Cut it off and wait for it, then
      // close the connections, so a program whose last work was `run` exits.
      run.cutoff.abort();
      for (const h of run.held.values()) clearTimer(h);
      await Promise.allSettled(run.extends);
      this.close();
      this.current = undefined;
      this.lastStats = stats;
    }
    if (run.fatal !== undefined) throw run.fatal;
    return { ...stats };
  }

  private beginDrain(run: Run): void {
    if (run.draining) return;
    run.draining = true;
    run.claims.abort();
    // Cancel the long polls: at once those waiting, the others once they are.
    const now = performance.now();
    for (const p of run.polls) {
      const age = now - p.sent;
      if (age >= CLAIM_ANSWER_MS) p.cancel.abort();
      else setTimeout(() => p.cancel.abort(), CLAIM_ANSWER_MS - age).unref();
    }
    run.notify();
  }

  /** Stops without draining: cancels the running handlers, drops the jobs claimed ahead, cuts the reports off. */
  private leaveBehind(run: Run, why: string): void {
    this.beginDrain(run);
    if (run.abandoned) return;
    run.abandoned = true;
    const running = [...run.held.values()].filter((h) => h.abort !== undefined);
    const ahead = run.waiting.length;
    for (const h of run.held.values()) {
      clearTimer(h);
      h.abort?.abort(new Error(why));
    }
    run.stats.abandoned += run.held.size;
    run.held.clear();
    run.waiting.length = 0;
    run.running = 0;
    run.cutoff.abort();
    if (running.length + ahead > 0) {
      this.log.warn(
        `${why}: ${running.length} running handler(s) cancelled through their signals and ${ahead} claimed job(s) not started; none of them is acked, the server runs them again after their leases`,
      );
    }
    run.notify();
  }

  /** Queues a finished job's ack to its server; one request carries every ack queued meanwhile. */
  private queueAck(run: Run, held: Held, tries: number): void {
    const server = held.job.server;
    let q = run.acks.get(server);
    if (q === undefined) run.acks.set(server, (q = []));
    q.push(held);
    if (run.acking.has(server)) return;
    run.acking.add(server);
    // Acks of the jobs that finish in this turn of the event loop go together.
    setImmediate(() => {
      this.ackLoop(run, server, tries)
        .catch((err: unknown) => this.log.error(`acks to ${server}: ${String(err)}`))
        .finally(() => {
          run.acking.delete(server);
          run.notify();
        });
    });
  }

  private async ackLoop(run: Run, server: string, tries: number): Promise<void> {
    const q = run.acks.get(server)!;
    while (q.length > 0 && !run.abandoned) {
      const batch = q.splice(0, RECEIPTS_MAX);
      await this.sendAcks(run, server, batch, tries, undefined);
    }
  }

  /** The acks queued when a stop left jobs behind: one try each, briefly. */
  private async lastAcks(run: Run): Promise<void> {
    const sends: Promise<void>[] = [];
    for (const [server, q] of run.acks) {
      while (q.length > 0) sends.push(this.sendAcks(run, server, q.splice(0, RECEIPTS_MAX), 1, LAST_ACKS_TIMEOUT_MS));
    }
    await Promise.all(sends);
  }

  private async sendAcks(run: Run, server: string, batch: Held[], tries: number, timeoutMs: number | undefined): Promise<void> {
    const transport = this.transports.get(server)!;
    const body: Record<string, unknown> = { receipts: batch.map((h) => h.job.receipt) };
    if (batch.some((h) => h.result !== undefined)) body["results"] = batch.map((h) => h.result ?? null);
    const stats = run.stats;
    for (let attempt = 0; attempt < tries; attempt++) {
      try {
        await transport.post("/v1/ack", body, { serverWaitMs: REPORT_SERVER_WAIT_MS, timeoutMs, signal: timeoutMs === undefined ? run.cutoff.signal : undefined });
        stats.acked += batch.length;
        stats.ackRequests++;
        return;
      } catch (err) {
        if (err instanceof StaleReceipt) {
          // The valid receipts were acked; the listed ones' runs were over.
          const refused = new Set([...err.stale, ...err.notOwned]);
          const refusedOnes = refused.size > 0 ? batch.filter((h) => refused.has(h.job.receipt)) : batch;
          let timedOut = 0;
          for (const h of refusedOnes) {
            if (this.refusedPastTimeout(h, "ack", err)) timedOut++;
            else this.logLost(h.job, `ack${attempt > 0 ? " (retried: an earlier try may have acked it)" : ""}`, err);
          }
          stats.timedOut += timedOut;
          stats.lost += refusedOnes.length - timedOut;
          stats.acked += batch.length - refusedOnes.length;
          stats.ackRequests++;
          return;
        }
        if (err instanceof Cancelled) break;
        const retryable = err instanceof ShardqError && err.retryable;
        if (!retryable || attempt === tries - 1) {
          this.log.error(`ack of ${batch.length} job(s) on ${server} failed; their leases decide: ${String(err)}`);
          break;
        }
        await sleep(backoffMs(attempt, 50, 2000), run.cutoff.signal);
      }
    }
    stats.unreported += batch.length;
  }

  private async report(run: Run, held: Held, path: string, body: Record<string, unknown>, tries: number): Promise<void> {
    const { job } = held;
    const transport = this.transports.get(job.server)!;
    for (let attempt = 0; attempt < tries; attempt++) {
      try {
        await transport.post(path, body, { serverWaitMs: REPORT_SERVER_WAIT_MS, signal: run.cutoff.signal });
        if (held.stale) return; // counted as lost when found
        if (body["backoff_ms"] !== undefined) run.stats.backedOff++;
        else run.stats.failed++;
        return;
      } catch (err) {
        if (err instanceof StaleReceipt) {
          // Expected for a run found over (counted then): it ended a cancelled run.
          if (held.stale) return;
          if (this.refusedPastTimeout(held, "fail", err)) run.stats.timedOut++;
          else {
            this.logLost(job, "fail", err);
            run.stats.lost++;
          }
          return;
        }
        if (err instanceof Cancelled) break;
        const retryable = err instanceof ShardqError && err.retryable;
        if (!retryable || attempt === tries - 1) {
          this.log.error(`${path} of job ${job.id} on ${job.server} failed; the job will run again after its lease: ${String(err)}`);
          break;
        }
        await sleep(backoffMs(attempt, 50, 2000), run.cutoff.signal);
      }
    }
    run.stats.unreported++;
  }

  /**
   * Whether a result of `held` that the server refused (409) came after its
   * run's job timeout (the server failed the run: counted in `timedOut`,
   * logged here) rather than after the run was lost otherwise.
   */
  private refusedPastTimeout(held: Held, what: string, err: ShardqError): boolean {
    if (!pastTimeout(held)) return false;
    const { job } = held;
    this.log.warn(
      `job ${job.id} (key ${JSON.stringify(job.key)}, shard ${job.shard}) at ${job.server}: the run passed its job timeout of ${held.timeoutMs} ms: the server failed it and refused its ${what} (${err.message})`,
    );
    return true;
  }

  private logLost(job: ClaimedJob, what: string, err: ShardqError): void {
    this.log.warn(`job ${job.id} (key ${JSON.stringify(job.key)}, shard ${job.shard}) lost its run on ${what}: ${err.message}`);
  }

  private readonly extending = new Set<string>();

  /** One extend per server for every held job (running or claimed ahead), at most RECEIPTS_MAX receipts each. */
  private extendAll(run: Run, leaseMs: number): void {
    const byServer = new Map<string, Held[]>();
    const now = performance.now();
    for (const h of run.held.values()) {
      if (h.lost) continue;
      // A lease that lasts past the job timeout needs no extend: the server ends the run first.
      if (h.timeoutUntil !== undefined && (h.leaseUntil >= h.timeoutUntil || now >= h.timeoutUntil)) continue;
      let list = byServer.get(h.job.server);
      if (list === undefined) byServer.set(h.job.server, (list = []));
      list.push(h);
    }
    for (const [server, list] of byServer) {
      // One extend under way per server: a slow answer is not piled on.
      if (this.extending.has(server)) continue;
      this.extending.add(server);
      const sends = [];
      for (let i = 0; i < list.length; i += RECEIPTS_MAX) sends.push(this.extend(run, server, list.slice(i, i + RECEIPTS_MAX), leaseMs));
      const p: Promise<void> = Promise.all(sends)
        .then(
          () => undefined,
          (err: unknown) => this.log.error(`extend on ${server}: ${String(err)}`),
        )
        .finally(() => {
          this.extending.delete(server);
          run.extends.delete(p);
        });
      run.extends.add(p);
    }
  }

  private async extend(run: Run, server: string, list: Held[], leaseMs: number): Promise<void> {
    const sent = performance.now();
    try {
      await this.transports.get(server)!.post(
        "/v1/extend",
        { receipts: list.map((h) => h.job.receipt), lease_ms: leaseMs },
        { serverWaitMs: 0, timeoutMs: Math.max(1000, leaseMs / 3), signal: run.cutoff.signal },
      );
      for (const h of list) h.leaseUntil = sent + leaseMs;
    } catch (err) {
      if (err instanceof Cancelled) return;
      if (!(err instanceof StaleReceipt)) {
        this.log.warn(`extend of ${list.length} job(s) on ${server} failed (will retry at the next beat): ${String(err)}`);
        return;
      }
      const refused = new Set([...err.stale, ...err.notOwned]);
      if (refused.size === 0 && list.length > 1) {
        // Which one? Ask one by one.
        await Promise.all(list.map((h) => this.extend(run, server, [h], leaseMs)));
        return;
      }
      for (const h of list) {
        if (refused.size > 0 && !refused.has(h.job.receipt)) {
          h.leaseUntil = sent + leaseMs;
          continue;
        }
        run.found(h, "extend", err);
      }
    }
  }

  private readonly checking = new Set<string>();

  /**
   * One `POST /v1/stale` per server for its held runs (not those already
   * found over), when it holds any and no extend or check of it is under
   * way: the runs it names are handled as an extend's refusal.
   */
  private checkStale(run: Run): void {
    if (run.abandoned) return;
    const byServer = new Map<string, Held[]>();
    for (const h of run.held.values()) {
      if (h.lost || h.timedOut) continue;
      let list = byServer.get(h.job.server);
      if (list === undefined) byServer.set(h.job.server, (list = []));
      list.push(h);
    }
    for (const [server, list] of byServer) {
      if (this.checking.has(server) || this.extending.has(server)) continue;
      this.checking.add(server);
      const p: Promise<void> = this.askStale(run, server, list.slice(0, RECEIPTS_MAX))
        .catch((err: unknown) => this.log.error(`stale check on ${server}: ${String(err)}`))
        .finally(() => {
          this.checking.delete(server);
          run.extends.delete(p);
        });
      run.extends.add(p);
    }
  }

  private async askStale(run: Run, server: string, list: Held[]): Promise<void> {
    let reply: unknown;
    try {
      reply = await this.transports.get(server)!.post(
        "/v1/stale",
        { receipts: list.map((h) => h.job.receipt) },
        { serverWaitMs: 0, timeoutMs: 5 * STALE_CHECK_MS, signal: run.cutoff.signal },
      );
    } catch (err) {
      if (err instanceof Cancelled) return;
      this.log.warn(`stale check on ${server} failed (will ask again): ${String(err)}`);
      return;
    }
    const stale = (reply as { stale?: unknown } | null)?.stale;
    if (!Array.isArray(stale) || stale.length === 0) return;
    const named = new Set(stale.map(String));
    for (const h of list) if (named.has(h.job.receipt)) run.found(h, "stale check", undefined);
  }
}
