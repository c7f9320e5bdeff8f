/**
 * The producer side of the HTTP API of `shardq serve`: `POST /v1/jobs`.
 *
 * Every job carries a dedup id (a random UUID when the caller gives none),
 * chosen once before the first try, so a retry after a lost reply cannot
 * enqueue the job twice (a dedup id belongs to its key: the same id under
 * two keys is two jobs). Long lists go in several requests, split by count
 * and by bytes under the server's limits. Failures with no response, 408,
 * 425, 429 and 5xx are retried a bounded number of times with backoff, each try on the next URL;
 * anything else (400, 401, 403, 413, ...) fails at once.
 *
 * Jobs with `after` are dependents: they run once every job they name has
 * ended. A call where any job has `after` goes in one request (its indexes
 * name jobs of the same request), where every job is a dependent and none
 * carries a dedup id; so it is tried again only when a try surely stored
 * nothing (a refused connection, 425, 429).
 *
 * Jobs with `batch` join a batch (`openBatch`): every job of the call names
 * the same one, and each keeps its dedup id, so a resend joins nothing twice.
 */

import { randomUUID } from "node:crypto";

import { backoffMs, ENQUEUE_SERVER_WAIT_MS, JobDied, JobNotCancelled, normaliseUrls, NotFoundReply, ResultTimeout, ServerUnavailable, ShardqError, sleep, Transport, type HttpOptions } from "./http.js";

export type Payload = string | Uint8Array;

export interface EnqueueOptions {
  /** Run no earlier than this many milliseconds from now. */
  delayMs?: number;
  /** Attempts before the job becomes a dead letter. */
  maxAttempts?: number;
  /** Idempotency key; generated when absent (none for a unique or debounced job). */
  dedupId?: string;
  /** A unique job: nothing is stored while the key's job with this id waits (or, with `uniqueWhile: "running"`, waits or runs); the answer is that job (`duplicate`). */
  uniqueId?: string;
  uniqueWhile?: "queued" | "running";
  /** A debounced job: the key's waiting job with this id takes this payload and starts `debounceMs` later, at most `debounceMaxMs` after the burst's first. */
  debounceId?: string;
  debounceMs?: number;
  debounceMaxMs?: number;
  /**
   * Makes it a dependent: it runs once every job named has ended. Job ids
   * (`"SHARD:ID"`, a dependent's `"@N"`) or, in `enqueueMany` and
   * `enqueueGraph`, indexes of other jobs of the same call; at most 1000.
   * A call where any job has `after` goes in one request, where every job
   * is a dependent (one without `after` is released at the next resolver
   * pass, about 100 ms) and none takes a dedup, unique or debounce id.
   */
  after?: readonly (string | number)[];
  /** With `after` only: what a dependency that did not complete does (default `"fail"`). */
  onDependencyFailure?: DependencyFailurePolicy;
  /**
   * Joins the batch with this id (`"@N"`, as `openBatch` gives it): the job
   * is stored with the batch (answered `@M` and `waiting`) and enqueued on
   * its key at the next resolver pass. Every job of a call with `batch`
   * names the same batch; none takes `after`, a unique or a debounce id;
   * each keeps its dedup id (given or generated), so a resend joins nothing
   * twice.
   */
  batch?: string;
}

/**
 * What a dependent does when a dependency did not complete: `"fail"` (it
 * fails and never runs; its reason names the dependency), `"ignore"` (it
 * runs without that result) or `"run"` (it runs with every outcome).
 */
export type DependencyFailurePolicy = "fail" | "ignore" | "run";

const DEPENDENCY_FAILURE_POLICIES: readonly string[] = ["fail", "ignore", "run"];
/** Most dependencies of one dependent (the server's bound). */
export const DEPENDENCIES_MAX = 1000;

export interface JobSpec extends EnqueueOptions {
  key: string;
  payload: Payload;
}

export interface EnqueueResult {
  id: number | string;
  shard: string;
  key: string;
  /** True when the server already had a job with this dedup id. */
  duplicate: boolean;
  /** The dedup id sent (the generated one when none was given; empty for a dependent). */
  dedupId: string;
  /** A dependent (a job of a request with `after`): its id is `"@N"` and its shard empty until it is released. */
  waiting: boolean;
  /** A job of a batch (also `waiting`, its id `"@M"`): the batch's id, `"@N"`. */
  batch?: string;
}

/** One dependency of a dependent, as `client.dependent(id)` shows it. */
export interface DependencyOutcome {
  /** The id as named in `after` (`SHARD:ID` or `@N`; an index shows as that job's `@N`). */
  id: string;
  /**
   * How it ended: `completed`, `cancelled`, `dead`, `failed` (a dependent
   * that failed or was cancelled) or `forgotten` (gone before it was seen
   * to end); absent while it has not ended.
   */
  outcome?: "completed" | "cancelled" | "dead" | "failed" | "forgotten";
  /** Where it ended, when that is another id (it moved with its key, or it is a dependent's released job). */
  at?: string;
  /** What its handler returned (a completed one); `resultText` decodes it. */
  result?: Buffer;
  resultText?: string;
  /** Its result was dropped: past the dependent's bound on the results it collects (1 MiB). */
  resultDropped: boolean;
  /** Why it did not complete. */
  reason?: string;
}

/** A dependent (a job enqueued with `after`), as `client.dependent(id)` shows it. */
export interface DependentInfo {
  /** `@N`. */
  id: string;
  key: string;
  /**
   * `waiting` (on no shard: some dependency has not ended), `released`
   * (enqueued as the job `released`), `failed` (a dependency did not
   * complete under the policy `fail`; `reason` names it; it never runs) or
   * `cancelled`.
   */
  state: "waiting" | "released" | "failed" | "cancelled";
  /** The job it was released as, `SHARD:ID` (`job`, `finished` and `result` of either id follow it). */
  released?: string;
  reason?: string;
  /** Each dependency's outcome, in the order named. */
  after: DependencyOutcome[];
  onDependencyFailure: DependencyFailurePolicy;
  /** Ms since the epoch. */
  createdMs: number;
  /** When it stopped waiting, ms since the epoch; absent while it waits. */
  endedMs?: number;
  maxAttempts?: number;
  delayMs: number;
  payload: Buffer;
}

/** The kinds of a batch's callbacks: every job of the closed batch ended (`complete`), was acked (`success`), the batch's first dead job (`death`). */
export type BatchCallbackKind = "complete" | "success" | "death";

/** What `openBatch` opens: the callbacks' payloads (at least one; a `Uint8Array` must be UTF-8 text) and more. */
export interface OpenBatchOptions {
  /** Payload of the callback run once the closed batch's jobs have all ended, however. */
  onComplete?: Payload;
  /** Payload of the callback run once the closed batch's jobs were all acked. */
  onSuccess?: Payload;
  /** Payload of the callback run at the batch's first dead job. */
  onDeath?: Payload;
  /** Attempts of each callback (default: the key's retry policy). */
  maxAttempts?: number;
  /** Names the batch under its key: opening again with it gives the batch already opened. Generated when absent, so a retry opens no second batch. */
  dedupId?: string;
}

/** A batch's jobs by how far they got. */
export interface BatchCounts {
  jobs: number;
  /** Not ended yet. */
  pending: number;
  completed: number;
  /** Out of attempts. */
  dead: number;
  /** Cancelled or forgotten. */
  other: number;
}

/** One callback of a batch, as `client.batch(id)` shows it. */
export interface BatchCallback {
  kind: BatchCallbackKind;
  payload: Buffer;
  /** The job it was enqueued as (`SHARD:ID`); absent until it fires. */
  fired?: string;
}

/** A batch, as `client.batch(id)` shows it. */
export interface BatchInfo {
  /** `@N`. */
  id: string;
  /** The callbacks' key. */
  key: string;
  /**
   * `open` (it takes jobs), `closed` (only its own jobs add to it, until
   * every job ended) or `complete` (every job ended and every callback due
   * fired).
   */
  state: "open" | "closed" | "complete";
  counts: BatchCounts;
  /** By kind: only the kinds it was opened with. */
  callbacks: Partial<Record<BatchCallbackKind, BatchCallback>>;
  /** Each job (`@M`), in the order they joined: its outcome, where it ran (`at`), its result or reason. */
  jobs: DependencyOutcome[];
  /** Attempts of each callback. */
  maxAttempts?: number;
  /** Ms since the epoch. */
  createdMs: number;
  closedMs?: number;
  endedMs?: number;
}

export interface ClientOptions extends HttpOptions {
  /** Retries after the first try (default 4). */
  retries?: number;
  /** First backoff in milliseconds (default 50), doubling per retry. */
  backoffMs?: number;
  /** Largest backoff in milliseconds (default 2000). */
  maxBackoffMs?: number;
  /** Most jobs per request: the server's `--jobs-per-request-max` (default 1000). */
  batchJobsMax?: number;
  /** Largest request body in bytes: the server's `--body-bytes-max` (default 16 MiB). */
  batchBytesMax?: number;
}

/** Default most jobs in one `POST /v1/jobs` (the server's default `--jobs-per-request-max`). */
export const ENQUEUE_BATCH_MAX = 1000;
/** Default largest `POST /v1/jobs` body in bytes (the server's default `--body-bytes-max`, 16 MiB). */
export const ENQUEUE_BATCH_BYTES_MAX = 16 << 20;
/** Bytes of `{"jobs":[` and `]}` around the jobs of a request. */
const ENVELOPE_BYTES = Buffer.byteLength('{"jobs":[]}');

/** One job's JSON text and its size in bytes. */
interface Encoded {
  body: Record<string, unknown>;
  json: string;
  bytes: number;
}

/**
 * Splits `jobs` into requests of at most `maxJobs` jobs and `maxBytes` body
 * bytes, in order; a job larger than `maxBytes` alone goes in a request of
 * its own (the server says what it refuses).
 */
export function splitBatches<T extends { bytes: number }>(jobs: readonly T[], maxJobs: number, maxBytes: number): T[][] {
  const out: T[][] = [];
  let batch: T[] = [];
  let bytes = ENVELOPE_BYTES;
  for (const job of jobs) {
    const add = job.bytes + (batch.length > 0 ? 1 : 0);
    if (batch.length > 0 && (batch.length >= maxJobs || bytes + add > maxBytes)) {
      out.push(batch);
      batch = [];
      bytes = ENVELOPE_BYTES;
    }
    bytes += job.bytes + (batch.length > 0 ? 1 : 0);
    batch.push(job);
  }
  if (batch.length > 0) out.push(batch);
  return out;
}

function checkNonNegativeInt(value: number | undefined, field: string, index: number): void {
  if (value !== undefined && (!Number.isSafeInteger(value) || value < 0)) {
    throw new TypeError(`jobs[${index}].${field} must be a non-negative integer, got ${String(value)}`);
  }
}

function encodeJob(job: JobSpec, index: number, graph?: { count: number; edges: number[][] }): Record<string, unknown> {
  if (typeof job.key !== "string") throw new TypeError(`jobs[${index}].key must be a string, got ${typeof job.key}`);
  const out: Record<string, unknown> = { key: job.key };
  if (typeof job.payload === "string") out["payload"] = job.payload;
  else if (job.payload instanceof Uint8Array) out["payload_b64"] = Buffer.from(job.payload.buffer, job.payload.byteOffset, job.payload.byteLength).toString("base64");
  else throw new TypeError(`jobs[${index}].payload must be a string or a Uint8Array, got ${typeof job.payload}`);
  checkNonNegativeInt(job.delayMs, "delayMs", index);
  checkNonNegativeInt(job.maxAttempts, "maxAttempts", index);
  if (job.maxAttempts === 0) throw new TypeError(`jobs[${index}].maxAttempts must be at least 1, got 0`);
  if (job.delayMs !== undefined) out["delay_ms"] = job.delayMs;
  if (job.maxAttempts !== undefined) out["max_attempts"] = job.maxAttempts;
  if (job.dedupId !== undefined && (typeof job.dedupId !== "string" || job.dedupId.length === 0)) {
    throw new TypeError(`jobs[${index}].dedupId must be a non-empty string, got ${JSON.stringify(job.dedupId)}`);
  }
  if (graph !== undefined) return encodeDependent(job, index, graph, out);
  const keyed = job.uniqueId !== undefined || job.uniqueWhile !== undefined || job.debounceId !== undefined || job.debounceMs !== undefined || job.debounceMaxMs !== undefined;
  if (!keyed) {
    out["dedup_id"] = job.dedupId ?? randomUUID();
    if (job.batch !== undefined) out["batch"] = job.batch;
    return out;
  }
  // A keyed job's id is its dedup id: a retry of a unique job is answered as its duplicate, one of a debounced job gives the waiting job the same payload again.
  if (job.dedupId !== undefined) throw new TypeError(`jobs[${index}]: a unique or debounced job has no dedupId of its own (got ${JSON.stringify(job.dedupId)})`);
  for (const [field, name] of [["uniqueId", "unique_id"], ["uniqueWhile", "unique_while"], ["debounceId", "debounce_id"]] as const) {
    const v = job[field];
    if (v === undefined) continue;
    if (typeof v !== "string") throw new TypeError(`jobs[${index}].${field} must be a string, got ${JSON.stringify(v)}`);
    out[name] = v;
  }
  checkNonNegativeInt(job.debounceMs, "debounceMs", index);
  checkNonNegativeInt(job.debounceMaxMs, "debounceMaxMs", index);
  if (job.debounceMs !== undefined) out["debounce_ms"] = job.debounceMs;
  if (job.debounceMaxMs !== undefined) out["debounce_max_ms"] = job.debounceMaxMs;
  return out;
}

/**
 * The batch every job of `jobs` joins, checked before anything is sent
 * (each throwing a `TypeError` that names the job): every job names the
 * same `"@N"`, and none has `after`, `onDependencyFailure`, a unique or a
 * debounce id; `undefined` when no job names a batch.
 */
function batchOf(jobs: readonly JobSpec[]): string | undefined {
  const at = jobs.findIndex((job) => job !== null && typeof job === "object" && job.batch !== undefined);
  if (at < 0) return undefined;
  const batch = jobs[at]!.batch;
  if (typeof batch !== "string" || !DEPENDENT_ID.test(batch)) {
    throw new TypeError(`jobs[${at}].batch must be a batch's id "@N", as openBatch gives it, got ${JSON.stringify(batch)}`);
  }
  jobs.forEach((job, i) => {
    const where = `jobs[${i}] (key ${JSON.stringify(job?.key)})`;
    if (job?.batch !== batch) {
      throw new TypeError(`${where}: batch ${JSON.stringify(job?.batch)} where the jobs of this call join ${JSON.stringify(batch)}: every job of a call with batch names the same batch (enqueue the others in a call of their own)`);
    }
    const named = (["after", "onDependencyFailure", "uniqueId", "uniqueWhile", "debounceId", "debounceMs", "debounceMaxMs"] as const)
      .filter((f) => job[f] !== undefined)
      .map((f) => `${f} ${JSON.stringify(job[f])}`);
    if (named.length > 0) throw new TypeError(`${where}: a job of a batch takes no ${named.join(", ")} (its dedupId makes it safe to send again)`);
  });
  return batch;
}

/** Whether `job` makes its request a graph's (it has `after` or `onDependencyFailure`). */
function isDependent(job: JobSpec): boolean {
  return job !== null && typeof job === "object" && (job.after !== undefined || job.onDependencyFailure !== undefined);
}

/**
 * The rest of job `index` of a request with `after` into `out`: no dedup id
 * (the server refuses one), `after` checked (ids, or indexes of the
 * request's other jobs, each once; the indexes go in `graph.edges`).
 */
function encodeDependent(job: JobSpec, index: number, graph: { count: number; edges: number[][] }, out: Record<string, unknown>): Record<string, unknown> {
  const where = `jobs[${index}] (key ${JSON.stringify(job.key)})`;
  const named = (["dedupId", "uniqueId", "debounceId"] as const).filter((f) => job[f] !== undefined).map((f) => `${f} ${JSON.stringify(job[f])}`);
  if (named.length > 0) {
    throw new TypeError(`${where}: a job of a request with after takes no ${named.join(", ")}: every job of such a request is a dependent, released once under its own id (enqueue it in a request of its own, without after)`);
  }
  const indexes: number[] = [];
  if (job.after !== undefined) {
    const after: unknown = job.after;
    if (!Array.isArray(after)) {
      throw new TypeError(`${where}.after must be an array of job ids ("SHARD:ID", "@N") and indexes of this request's jobs, got ${JSON.stringify(after)}${typeof after === "string" ? ` (one id goes in an array: [${JSON.stringify(after)}])` : ""}`);
    }
    const seen = new Set<string | number>();
    after.forEach((item: unknown, i: number) => {
      if (typeof item === "number") {
        if (item === index) throw new TypeError(`${where}.after[${i}]: ${item} is its own index; a job cannot wait for itself`);
        if (!Number.isSafeInteger(item) || item < 0 || item >= graph.count) {
          throw new TypeError(`${where}.after[${i}]: ${item} is not an index of this request's jobs (0 to ${graph.count - 1})`);
        }
        indexes.push(item);
      } else if (typeof item !== "string" || item === "") {
        throw new TypeError(`${where}.after[${i}] must be a job id ("SHARD:ID", "@N") or the index of another job of this request, got ${JSON.stringify(item)}`);
      }
      if (seen.has(item)) throw new TypeError(`${where}.after[${i}]: ${JSON.stringify(item)} is named twice; name each dependency once`);
      seen.add(item);
    });
    if (after.length > DEPENDENCIES_MAX) throw new TypeError(`${where}.after: ${after.length} dependencies, over the bound of ${DEPENDENCIES_MAX} per job`);
    out["after"] = [...after];
  }
  if (job.onDependencyFailure !== undefined) {
    if (job.after === undefined) {
      throw new TypeError(`${where}: onDependencyFailure ${JSON.stringify(job.onDependencyFailure)} without after: it applies to a job with dependencies`);
    }
    if (!DEPENDENCY_FAILURE_POLICIES.includes(job.onDependencyFailure)) {
      throw new TypeError(`${where}.onDependencyFailure must be fail, ignore or run, got ${JSON.stringify(job.onDependencyFailure)}`);
    }
    out["on_dependency_failure"] = job.onDependencyFailure;
  }
  graph.edges.push(indexes);
  return out;
}

/**
 * A cycle of the graph whose node `n` waits for `edges[n]`, as its nodes
 * from the first one again to itself (`[0, 2, 0]`); empty without one.
 * Iterative, so a long chain is no recursion.
 */
function cycleOf(edges: readonly (readonly number[])[]): number[] {
  const state = new Array<number>(edges.length).fill(0); // 0: not seen, 1: on the current path, 2: done
  for (let start = 0; start < edges.length; start++) {
    if (state[start] !== 0) continue;
    const path = [start];
    const nexts = [0];
    state[start] = 1;
    while (path.length > 0) {
      const node = path[path.length - 1]!;
      const out = edges[node]!;
      const k = nexts[nexts.length - 1]!;
      if (k < out.length) {
        const to = out[k]!;
        nexts[nexts.length - 1] = k + 1;
        if (state[to] === 1) return [...path.slice(path.indexOf(to)), to];
        if (state[to] === 0) {
          state[to] = 1;
          path.push(to);
          nexts.push(0);
        }
      } else {
        state[node] = 2;
        path.pop();
        nexts.pop();
      }
    }
  }
  return [];
}

function dependencyOutcome(doc: unknown, url: string): DependencyOutcome {
  const d = record(doc, url, "a dependency");
  const out: DependencyOutcome = { id: String(d["id"]), resultDropped: d["result_dropped"] === true };
  if (typeof d["outcome"] === "string") out.outcome = d["outcome"] as DependencyOutcome["outcome"];
  if (typeof d["at"] === "string") out.at = d["at"];
  if (typeof d["result"] === "string") out.result = Buffer.from(d["result"], "utf8");
  else if (typeof d["result_b64"] === "string") out.result = Buffer.from(d["result_b64"], "base64");
  if (out.result !== undefined) out.resultText = out.result.toString("utf8");
  if (typeof d["reason"] === "string") out.reason = d["reason"];
  return out;
}

function batchInfo(doc: unknown, url: string): BatchInfo {
  const d = record(doc, url, "a batch");
  const c = (d["counts"] ?? {}) as Record<string, unknown>;
  const count = (name: string): number => (typeof c[name] === "number" ? c[name] : 0);
  const callbacks: Partial<Record<BatchCallbackKind, BatchCallback>> = {};
  for (const [kind, v] of Object.entries((d["callbacks"] ?? {}) as Record<string, unknown>)) {
    const cb = (v ?? {}) as Record<string, unknown>;
    const out: BatchCallback = {
      kind: kind as BatchCallbackKind,
      payload: typeof cb["payload_b64"] === "string" ? Buffer.from(cb["payload_b64"], "base64") : Buffer.from(String(cb["payload"] ?? ""), "utf8"),
    };
    if (typeof cb["fired"] === "string") out.fired = cb["fired"];
    callbacks[kind as BatchCallbackKind] = out;
  }
  const info: BatchInfo = {
    id: String(d["id"]),
    key: String(d["key"]),
    state: String(d["state"]) as BatchInfo["state"],
    counts: { jobs: count("jobs"), pending: count("pending"), completed: count("completed"), dead: count("dead"), other: count("other") },
    callbacks,
    jobs: Array.isArray(d["jobs"]) ? d["jobs"].map((j) => dependencyOutcome(j, url)) : [],
    createdMs: typeof d["created_ms"] === "number" ? d["created_ms"] : 0,
  };
  if (typeof d["max_attempts"] === "number") info.maxAttempts = d["max_attempts"];
  if (typeof d["closed_ms"] === "number") info.closedMs = d["closed_ms"];
  if (typeof d["ended_ms"] === "number") info.endedMs = d["ended_ms"];
  return info;
}

/** The `POST /v1/batches` body of `openBatch`, checked (each problem a `TypeError` naming the field). */
function openBatchBody(key: string, opts: OpenBatchOptions): Record<string, unknown> {
  if (typeof key !== "string" || key === "") throw new TypeError(`openBatch: key must be a non-empty string (the callbacks' key), got ${JSON.stringify(key)}`);
  if (opts === null || typeof opts !== "object") throw new TypeError(`openBatch: options must be an object with onComplete, onSuccess or onDeath, got ${JSON.stringify(opts)}`);
  const body: Record<string, unknown> = { key };
  for (const [field, name] of [["onComplete", "on_complete"], ["onSuccess", "on_success"], ["onDeath", "on_death"]] as const) {
    const v: unknown = opts[field];
    if (v === undefined) continue;
    if (typeof v === "string") body[name] = v;
    else if (v instanceof Uint8Array) {
      try {
        body[name] = new TextDecoder("utf-8", { fatal: true }).decode(v);
      } catch {
        throw new TypeError(`openBatch: ${field} must be UTF-8 text (a callback's payload is a JSON string on the wire)`);
      }
    } else throw new TypeError(`openBatch: ${field} must be a string or a Uint8Array, got ${typeof v}`);
  }
  if (Object.keys(body).length === 1) throw new TypeError("openBatch: no callbacks: at least one of onComplete, onSuccess, onDeath is needed");
  if (opts.maxAttempts !== undefined) {
    if (!Number.isSafeInteger(opts.maxAttempts) || opts.maxAttempts < 1) throw new TypeError(`openBatch: maxAttempts must be a positive integer, got ${String(opts.maxAttempts)}`);
    body["max_attempts"] = opts.maxAttempts;
  }
  if (opts.dedupId !== undefined && (typeof opts.dedupId !== "string" || opts.dedupId === "")) {
    throw new TypeError(`openBatch: dedupId must be a non-empty string, got ${JSON.stringify(opts.dedupId)}`);
  }
  body["dedup_id"] = opts.dedupId ?? `batch-${randomUUID()}`;
  return body;
}

/** `/v1/batches/@N[/action]` of a batch's id, checked. */
function batchPath(id: string, call: string, action = ""): string {
  if (typeof id !== "string" || !DEPENDENT_ID.test(id)) {
    throw new TypeError(`${call}: id must be a batch's id "@N", as openBatch gives it (and ClaimedJob.batch carries it), got ${JSON.stringify(id)}`);
  }
  return `/v1/batches/${id}${action ? `/${action}` : ""}`;
}

function dependentInfo(doc: unknown, url: string): DependentInfo {
  const d = record(doc, url, "a dependent");
  const info: DependentInfo = {
    id: String(d["id"]),
    key: String(d["key"]),
    state: String(d["state"]) as DependentInfo["state"],
    after: Array.isArray(d["after"]) ? d["after"].map((a) => dependencyOutcome(a, url)) : [],
    onDependencyFailure: (typeof d["on_dependency_failure"] === "string" ? d["on_dependency_failure"] : "fail") as DependencyFailurePolicy,
    createdMs: typeof d["created_ms"] === "number" ? d["created_ms"] : 0,
    delayMs: typeof d["delay_ms"] === "number" ? d["delay_ms"] : 0,
    payload: typeof d["payload_b64"] === "string" ? Buffer.from(d["payload_b64"], "base64") : Buffer.from(String(d["payload"] ?? ""), "utf8"),
  };
  if (typeof d["released"] === "string") info.released = d["released"];
  if (typeof d["reason"] === "string") info.reason = d["reason"];
  if (typeof d["ended_ms"] === "number") info.endedMs = d["ended_ms"];
  if (typeof d["max_attempts"] === "number") info.maxAttempts = d["max_attempts"];
  return info;
}

const DEPENDENT_ID = /^@[0-9]+$/;
/** The states a 409 on cancelling a dependent names when it had ended (its job `finished`, or it `failed` or was `cancelled` while waiting). */
const DEPENDENT_ENDED: readonly string[] = ["finished", "failed", "cancelled"];

/** Whether a try that failed with `err` surely did not reach the server (a refused connection, a name not resolved) or was refused unread (425, 429). */
function surelyNotStored(err: ShardqError): boolean {
  if (err.status !== undefined) return err.status === 425 || err.status === 429;
  const code = (err.cause as { code?: unknown } | undefined)?.code;
  return code === "ECONNREFUSED" || code === "ENOTFOUND" || code === "EAI_AGAIN";
}

function parseResults(reply: unknown, sent: Record<string, unknown>[], url: string): EnqueueResult[] {
  const jobs = (reply as { jobs?: unknown } | null)?.jobs;
  if (!Array.isArray(jobs) || jobs.length !== sent.length) {
    throw new ShardqError(
      `POST ${url}/v1/jobs: expected {"jobs": [...]} with ${sent.length} entries, got ${JSON.stringify(reply).slice(0, 200)}`,
      200,
      url,
    );
  }
  return jobs.map((j: unknown, i) => {
    const r = j as { id?: unknown; shard?: unknown; key?: unknown; duplicate?: unknown };
    if ((typeof r.id !== "number" && typeof r.id !== "string") || typeof r.shard !== "string") {
      throw new ShardqError(`POST ${url}/v1/jobs: reply jobs[${i}] lacks an id or a shard: ${JSON.stringify(j)}`, 200, url);
    }
    return {
      id: r.id,
      shard: r.shard,
      key: typeof r.key === "string" ? r.key : (sent[i]!["key"] as string),
      duplicate: r.duplicate === true,
      dedupId: (sent[i]!["dedup_id"] as string | undefined) ?? "",
      waiting: (r as { waiting?: unknown }).waiting === true,
      ...(typeof (r as { batch?: unknown }).batch === "string" ? { batch: (r as { batch: string }).batch } : {}),
    };
  });
}

function positive(value: number, name: string, min: number): number {
  if (!Number.isSafeInteger(value) || value < min) throw new TypeError(`Client: ${name} must be an integer of at least ${min}, got ${value}`);
  return value;
}

/** A job that left its shard with its key in a rebalance: the key, and the shard it is on now. */
export interface Moved {
  key: string;
  shard: string;
}

/** The schedule and tick a schedule's job was enqueued for (`tickMs`: ms since the epoch, or the time of a trigger). */
export interface ScheduleTick {
  id: string;
  tickMs: number;
  /** An operator's trigger rather than a tick. */
  triggered: boolean;
}

/** The `schedule` field of a job or a claim, if it is a schedule's. */
export function scheduleTickOf(v: unknown): ScheduleTick | undefined {
  if (v === null || typeof v !== "object") return undefined;
  const t = v as Record<string, unknown>;
  if (typeof t["id"] !== "string" || typeof t["tick_ms"] !== "number") return undefined;
  return { id: t["id"], tickMs: t["tick_ms"], triggered: t["triggered"] === true };
}

/** A live job as `GET /v1/jobs/{id}` shows it. */
export interface JobInfo {
  /** `SHARD:ID`. */
  id: string;
  shard: string;
  key: string;
  state: "queued" | "delayed" | "running" | "dead";
  /** Attempts made and finished (a running job is on attempt `attempts + 1`). */
  attempts: number;
  maxAttempts: number;
  /** Enqueue time, ms since the epoch. */
  createdMs: number;
  /** Earliest start of its next attempt, ms since the epoch. */
  notBeforeMs: number;
  /** The run in flight (`leaseExpiresMs` 0 when the server does not time it). */
  run?: { fence: number; leaseExpiresMs: number };
  /** The last failure's reason. */
  reason?: string;
  /** When each attempt started, ms since the epoch, oldest first (empty for a job not started yet; a job moved with its key keeps its count of attempts, not their times). */
  attemptStartsMs: number[];
  payload: Buffer;
  /** The dedup id it was enqueued with. */
  dedupId?: string;
  /** A schedule's job: its schedule and tick. */
  schedule?: ScheduleTick;
}

/** A job that finished, as `finished` of `GET /v1/keys/{key}/jobs` shows it (kept for the deployment's retention, `shardq retention`). */
export interface FinishedInfo {
  /** `SHARD:ID`. */
  id: string;
  shard: string;
  key: string;
  outcome: "completed" | "cancelled";
  /** Attempts started. */
  attempts: number;
  /** When it finished, ms since the epoch. */
  finishedMs: number;
  /** When each attempt started, ms since the epoch, oldest first. */
  attemptStartsMs: number[];
  /** The last failed attempt's reason, if one failed. */
  reason?: string;
  /** What the handler returned with its ack (absent: nothing), as bytes; `resultText` decodes it. */
  result?: Buffer;
  /** The result as UTF-8 text (absent without one). */
  resultText?: string;
}

/** Whether a `GET /v1/jobs/{id}` answer is a finished job (it has an `outcome`). */
function isFinished(doc: unknown): boolean {
  return typeof doc === "object" && doc !== null && "outcome" in doc;
}

function finishedInfo(doc: unknown, url: string): FinishedInfo {
  const j = (doc ?? {}) as Record<string, unknown>;
  const num = (name: string): number => {
    const v = j[name];
    if (typeof v !== "number") throw new ShardqError(`${url}: a finished job's ${name} is not a number: ${JSON.stringify(v)}`, 200, url);
    return v;
  };
  const info: FinishedInfo = {
    id: String(j["id"]),
    shard: String(j["shard"]),
    key: String(j["key"]),
    outcome: String(j["outcome"]) as FinishedInfo["outcome"],
    attempts: num("attempts"),
    finishedMs: num("finished_ms"),
    attemptStartsMs: Array.isArray(j["attempt_starts_ms"]) ? (j["attempt_starts_ms"] as unknown[]).map(Number) : [],
  };
  if (typeof j["reason"] === "string") info.reason = j["reason"];
  if (typeof j["result"] === "string") info.result = Buffer.from(j["result"], "utf8");
  else if (typeof j["result_b64"] === "string") info.result = Buffer.from(j["result_b64"], "base64");
  if (info.result !== undefined) info.resultText = info.result.toString("utf8");
  return info;
}

/**
 * A flow-control policy as the server shows it (every field spelt out).
 * Starts are counted over every worker of the deployment.
 */
export interface FlowPolicy {
  /** Runs of a key at once (1: a key runs its jobs one at a time, in order). */
  concurrency: number;
  /** Starts per unit of time: `"50/s"`, `"600/m"`, `"1000/h"`; absent: unlimited. */
  rate?: string;
  /** Tokens the key's bucket holds (one second of the rate unless set); absent without a rate. */
  burst?: number;
  /** Share of slots among ready keys of one priority (default 1). */
  weight: number;
  /** Priority class, higher first (default 0). */
  priority: number;
  /** The group whose shared rate the key's starts also count against. */
  group?: string;
}

/** Where a key's policy comes from: its own, its longest prefix's, or the default. */
export type PolicyScope = "key" | "prefix" | "default";

/** The answer of `client.policy(key)`: the policy the key gets and where it comes from. */
export interface PolicyInfo {
  key: string;
  policy: FlowPolicy;
  /** `"key"` (its own), `"prefix"` (`prefix` says which) or `"default"`; for a prefix's or the default's own policy, the scope. */
  source: PolicyScope;
  /** The prefix whose policy it is. */
  prefix?: string;
}

/** A flow-control group, shared by every key whose policy names it, over every worker: a rate, a number of runs at once, or both. */
export interface GroupInfo {
  /** `"20/s"`, `"600/m"`, `"1000/h"`; absent: no rate limit. */
  rate?: string;
  /** Tokens its bucket holds (one second of the rate unless set); only with a rate. */
  burst?: number;
  /** Runs of its keys at once; absent: no limit. */
  concurrency?: number;
}

/** Every flow-control setting of the deployment (`client.policies()`). */
export interface FlowSettings {
  default: FlowPolicy;
  prefixes: Record<string, FlowPolicy>;
  keys: Record<string, FlowPolicy>;
  groups: Record<string, GroupInfo>;
}

/**
 * A handler's back-off of a key, as `client.resumeKey(key)` lifted it: the
 * jobs it held are due now.
 */
export interface KeyHold {
  key: string;
  /** The shard the key routes to. */
  shard: string;
  /** When the back-off would have ended, ms since the epoch on the server's clock. */
  untilMs: number;
  /** The jobs it held (`SHARD:ID`), in key order. */
  jobs: string[];
}

/** The hold a `/v1/keys/{key}/resume` answer lifted; `undefined` when it lifted none (`"resumed": false`, `back_off` null). */
function keyHold(doc: unknown, url: string): KeyHold | undefined {
  const d = record(doc, url, "the answer");
  if (typeof d["resumed"] !== "boolean") throw new ShardqError(`${url}: the answer has no resumed flag: ${JSON.stringify(doc)}`, 200, url);
  const hold = d["back_off"];
  if (!d["resumed"] || hold === null || hold === undefined) return undefined;
  const h = record(hold, url, "back_off");
  if (typeof h["until_ms"] !== "number" || !Array.isArray(h["jobs"])) throw new ShardqError(`${url}: back_off is not {until_ms, jobs}: ${JSON.stringify(hold)}`, 200, url);
  return { key: String(d["key"]), shard: String(d["shard"]), untilMs: h["until_ms"], jobs: h["jobs"].map(String) };
}

/** Exactly one of a key, a prefix (every key starting with it) or the deployment's default. */
export interface PolicyTarget {
  key?: string;
  prefix?: string;
  default?: boolean;
}

/** A whole policy for `setPolicy`: the fields given, the others at their defaults. */
export interface PolicySpec extends PolicyTarget {
  /** `"N/s"`, `"N/m"` or `"N/h"`. */
  rate?: string;
  /** Only with a rate. */
  burst?: number;
  weight?: number;
  priority?: number;
  /** A group that exists (`setGroup`). */
  group?: string;
  concurrency?: number;
}

/** A group's limit for `setGroup`: a rate, a concurrency or both. */
export interface GroupSpec {
  rate?: string;
  /** Only with a rate. */
  burst?: number;
  /** Runs of its keys at once, 1 to 10000. */
  concurrency?: number;
}

function segment(value: unknown, what: string): string {
  if (typeof value !== "string" || value === "") throw new TypeError(`${what} must be a non-empty string, got ${JSON.stringify(value)}`);
  return encodeURIComponent(value);
}

/** The `/v1/policies/...` path of exactly one of a key, a prefix or the default. */
function policyPath(t: PolicyTarget, what: string): string {
  const named = [t.key !== undefined && "key", t.prefix !== undefined && "prefix", t.default === true && "default"].filter((x) => x !== false);
  if (named.length !== 1) throw new TypeError(`${what}: name exactly one of key, prefix or default: true (got ${named.join(", ") || "none"})`);
  if (t.default === true) return "/v1/policies/default?scope=default";
  if (t.key !== undefined) return `/v1/policies/${segment(t.key, `${what}: key`)}`;
  return `/v1/policies/${segment(t.prefix, `${what}: prefix`)}?scope=prefix`;
}

function record(doc: unknown, url: string, what: string): Record<string, unknown> {
  if (doc === null || typeof doc !== "object" || Array.isArray(doc)) throw new ShardqError(`${url}: ${what} is not an object: ${JSON.stringify(doc)}`, 200, url);
  return doc as Record<string, unknown>;
}

function flowPolicy(doc: unknown, url: string): FlowPolicy {
  const p = record(doc, url, "a policy");
  const out: FlowPolicy = {
    concurrency: typeof p["concurrency"] === "number" ? p["concurrency"] : 1,
    weight: typeof p["weight"] === "number" ? p["weight"] : 1,
    priority: typeof p["priority"] === "number" ? p["priority"] : 0,
  };
  if (typeof p["rate"] === "string") out.rate = p["rate"];
  if (typeof p["burst"] === "number") out.burst = p["burst"];
  if (typeof p["group"] === "string") out.group = p["group"];
  return out;
}

function groupInfo(doc: unknown, url: string): GroupInfo {
  const g = record(doc, url, "a group");
  const out: GroupInfo = {};
  if (typeof g["rate"] === "string") out.rate = g["rate"];
  if (typeof g["burst"] === "number") out.burst = g["burst"];
  if (typeof g["concurrency"] === "number") out.concurrency = g["concurrency"];
  if (out.rate === undefined && out.concurrency === undefined) throw new ShardqError(`${url}: a group has neither a rate nor a concurrency: ${JSON.stringify(doc)}`, 200, url);
  return out;
}

function mapOf<T>(doc: unknown, url: string, what: string, each: (v: unknown, url: string) => T): Record<string, T> {
  return Object.fromEntries(Object.entries(doc === undefined || doc === null ? {} : record(doc, url, what)).map(([k, v]) => [k, each(v, url)]));
}

function removed(doc: unknown, url: string): boolean {
  const r = record(doc, url, "the answer")["removed"];
  if (typeof r !== "boolean") throw new ShardqError(`${url}: the answer has no removed flag: ${JSON.stringify(doc)}`, 200, url);
  return r;
}

/** What a schedule's tick does while the previous tick's job is live: no job (`"skip"`), at most one waiting (`"one"`), or a job every tick (`"all"`). */
export type ScheduleOverlap = "skip" | "one" | "all";

/** A time for the schedule calls: ms since the epoch, RFC 3339 text (`"2026-03-28T00:00:00Z"`) or a `Date`. */
export type ScheduleTime = number | string | Date;

/** A schedule for `setSchedule`: its key, exactly one of `cron` and `every`, and the fields given (the others at their defaults). */
export interface ScheduleSpec {
  /** The key whose jobs it enqueues (and whose shard's server fires it). */
  key: string;
  /** A cron expression: 5 fields, or 6 with seconds first. */
  cron?: string;
  /** The cron expression's IANA zone (default `UTC`); only with `cron`. */
  tz?: string;
  /** A fixed interval such as `"30s"` or `"5m"` (at least 1 s), anchored at `start`, else the epoch. */
  every?: string;
  /** Every job's payload (text; bytes must be UTF-8). */
  payload?: Payload;
  /** Default `"skip"`. */
  overlap?: ScheduleOverlap;
  /** How late a tick may still fire (default `"5m"`, at most `"1d"`). */
  catchUp?: string;
  /** Largest delay added to a fire (default none, at most `"1h"`). */
  jitter?: string;
  /** No tick before this. */
  start?: ScheduleTime;
  /** No tick after this. */
  end?: ScheduleTime;
  /** Attempts of each job (default 5). */
  maxAttempts?: number;
}

/** A recurring schedule as the server stores it (times in ms since the epoch). */
export interface Schedule {
  key: string;
  /** Its cron expression and zone, or its interval (`everyMs`). */
  cron?: string;
  tz?: string;
  everyMs?: number;
  payload: string;
  overlap: ScheduleOverlap;
  catchUpMs: number;
  jitterMs: number;
  startMs?: number;
  endMs?: number;
  maxAttempts: number;
  paused: boolean;
  /** When it was set or last resumed: no earlier tick fires. */
  sinceMs: number;
}

/** A schedule's latest fire. */
export interface ScheduleFire {
  /** The tick it was for (or the time of a trigger). */
  tickMs: number;
  /** When its job was stored. */
  atMs: number;
  shard: string;
  /** The job's id, `SHARD:ID` (as `client.job(id)` takes it). */
  job: string;
}

/** What the servers and workers recorded of a schedule's ticks. */
export interface ScheduleState {
  /** Every tick at or before this was decided for good: fired, skipped or missed. */
  decidedMs: number;
  /** The latest fire; absent before the first. */
  last?: ScheduleFire;
  /** Ticks that stored a job. */
  fired: number;
  /** Ticks not fired by the overlap policy (the previous job was live). */
  skipped: number;
  /** Ticks past their catch-up window (nothing ran the key's shard). */
  missed: number;
}

/** A schedule as `client.schedule(id)` and `client.schedules()` show it: the schedule, its id, its state and next fire. */
export interface ScheduleInfo extends Schedule {
  id: string;
  state: ScheduleState;
  /** When its next tick is due (in the past while overdue); absent while paused or past its end. */
  nextFireMs?: number;
}

/** The job a `triggerSchedule(id)` enqueued. */
export interface ScheduleTriggered {
  /** The schedule's id. */
  id: string;
  shard: string;
  /** `SHARD:ID`. */
  job: string;
}

/** What a `backfillSchedule` did: the ticks in its range, the jobs it stored, and the ticks whose job was stored already. */
export interface ScheduleBackfilled {
  /** The schedule's id. */
  id: string;
  ticks: number;
  stored: number;
  alreadyStored: number;
}

/** What an `applySchedules` did (or, with `dryRun`, would do), by schedule id. */
export interface SchedulesApplied {
  dryRun: boolean;
  added: string[];
  changed: string[];
  unchanged: string[];
  /** Deleted by `prune`. */
  removed: string[];
}

const OVERLAPS: readonly string[] = ["skip", "one", "all"];

function schedulePath(id: unknown, what: string, action = ""): string {
  const path = `/v1/schedules/${segment(id, `${what}: id`)}`;
  return action === "" ? path : `${path}/${action}`;
}

/** `value` as the server reads a time: ms (a number) or RFC 3339 text. */
function scheduleTime(value: unknown, what: string): number | string {
  if (value instanceof Date) {
    const ms = value.getTime();
    if (!Number.isFinite(ms)) throw new TypeError(`${what} is an invalid Date`);
    return ms;
  }
  if (typeof value === "string") return value;
  if (typeof value !== "number" || !Number.isSafeInteger(value) || value < 0) {
    throw new TypeError(`${what} must be ms since the epoch (a non-negative integer), RFC 3339 text or a Date, got ${JSON.stringify(value)}`);
  }
  return value;
}

/** The `PUT /v1/schedules/{id}` body of `spec`; what only the server can check (cron fields, zones, durations), it checks, naming the field and the value. */
function scheduleBody(spec: ScheduleSpec): Record<string, unknown> {
  if (spec === null || typeof spec !== "object") throw new TypeError(`setSchedule: the spec must be an object, got ${JSON.stringify(spec)}`);
  if (typeof spec.key !== "string" || spec.key === "") throw new TypeError(`setSchedule: key must be a non-empty string, got ${JSON.stringify(spec.key)}`);
  if ((spec.cron === undefined) === (spec.every === undefined)) {
    throw new TypeError(`setSchedule: give exactly one of cron and every (got cron ${JSON.stringify(spec.cron)}, every ${JSON.stringify(spec.every)})`);
  }
  if (spec.tz !== undefined && spec.cron === undefined) throw new TypeError(`setSchedule: tz ${JSON.stringify(spec.tz)} goes with a cron expression, not with every`);
  if (spec.overlap !== undefined && !OVERLAPS.includes(spec.overlap)) throw new TypeError(`setSchedule: overlap must be skip, one or all, got ${JSON.stringify(spec.overlap)}`);
  const body: Record<string, unknown> = { key: spec.key };
  for (const [field, name] of [
    ["cron", "cron"],
    ["tz", "tz"],
    ["every", "every"],
    ["overlap", "overlap"],
    ["catchUp", "catch_up"],
    ["jitter", "jitter"],
    ["maxAttempts", "max_attempts"],
  ] as const) {
    if (spec[field] !== undefined) body[name] = spec[field];
  }
  if (spec.payload !== undefined) {
    if (typeof spec.payload === "string") body["payload"] = spec.payload;
    else if (spec.payload instanceof Uint8Array) {
      try {
        body["payload"] = new TextDecoder("utf-8", { fatal: true }).decode(spec.payload);
      } catch {
        throw new TypeError("setSchedule: the server keeps a schedule's payload as text, so a Uint8Array payload must be UTF-8");
      }
    } else throw new TypeError(`setSchedule: payload must be a string or a Uint8Array, got ${typeof spec.payload}`);
  }
  if (spec.start !== undefined) body["start"] = scheduleTime(spec.start, "setSchedule: start");
  if (spec.end !== undefined) body["end"] = scheduleTime(spec.end, "setSchedule: end");
  return body;
}

function fieldNumber(d: Record<string, unknown>, name: string, url: string, what: string): number {
  const v = d[name];
  if (typeof v !== "number") throw new ShardqError(`${url}: ${what}'s ${name} is not a number: ${JSON.stringify(v)}`, 200, url);
  return v;
}

function scheduleOf(doc: unknown, url: string): Schedule {
  const d = record(doc, url, "a schedule");
  const when = record(d["when"], url, "a schedule's when");
  const out: Schedule = {
    key: String(d["key"]),
    payload: typeof d["payload"] === "string" ? d["payload"] : "",
    overlap: (typeof d["overlap"] === "string" ? d["overlap"] : "skip") as ScheduleOverlap,
    catchUpMs: fieldNumber(d, "catch_up_ms", url, "a schedule"),
    jitterMs: typeof d["jitter_ms"] === "number" ? d["jitter_ms"] : 0,
    maxAttempts: fieldNumber(d, "max_attempts", url, "a schedule"),
    paused: d["paused"] === true,
    sinceMs: fieldNumber(d, "since_ms", url, "a schedule"),
  };
  if (when["cron"] !== undefined) {
    const c = record(when["cron"], url, "a schedule's cron");
    out.cron = String(c["expr"]);
    out.tz = String(c["tz"]);
  } else if (when["every"] !== undefined) {
    out.everyMs = fieldNumber(record(when["every"], url, "a schedule's every"), "every_ms", url, "a schedule");
  } else {
    throw new ShardqError(`${url}: a schedule's when is neither cron nor every: ${JSON.stringify(d["when"])}`, 200, url);
  }
  if (typeof d["start_ms"] === "number") out.startMs = d["start_ms"];
  if (typeof d["end_ms"] === "number") out.endMs = d["end_ms"];
  return out;
}

function scheduleInfoOf(doc: unknown, url: string): ScheduleInfo {
  const d = record(doc, url, "a schedule");
  const s = d["state"] === undefined || d["state"] === null ? {} : record(d["state"], url, "a schedule's state");
  const count = (name: string): number => (typeof s[name] === "number" ? (s[name] as number) : 0);
  const state: ScheduleState = { decidedMs: count("decided_ms"), fired: count("fired"), skipped: count("skipped"), missed: count("missed") };
  if (s["last"] !== undefined && s["last"] !== null) {
    const l = record(s["last"], url, "a schedule's last fire");
    const shard = String(l["shard"]);
    state.last = { tickMs: fieldNumber(l, "tick_ms", url, "a fire"), atMs: fieldNumber(l, "at_ms", url, "a fire"), shard, job: `${shard}:${String(l["job"])}` };
  }
  const info: ScheduleInfo = { ...scheduleOf(d, url), id: String(d["id"]), state };
  if (typeof d["next_fire_ms"] === "number") info.nextFireMs = d["next_fire_ms"];
  return info;
}

/** Most jobs one `keyJobs` call returns. */
export const KEY_JOBS_MAX = 1000;
const READ_SERVER_WAIT_MS = 30_000;

function jobInfo(doc: unknown, url: string): JobInfo {
  const j = (doc ?? {}) as Record<string, unknown>;
  const num = (name: string): number => {
    const v = j[name];
    if (typeof v !== "number") throw new ShardqError(`${url}: a job's ${name} is not a number: ${JSON.stringify(v)}`, 200, url);
    return v;
  };
  const run = j["run"] as Record<string, unknown> | null | undefined;
  const payload =
    typeof j["payload_b64"] === "string" ? Buffer.from(j["payload_b64"], "base64") : Buffer.from(String(j["payload"] ?? ""), "utf8");
  const info: JobInfo = {
    id: String(j["id"]),
    shard: String(j["shard"]),
    key: String(j["key"]),
    state: String(j["state"]) as JobInfo["state"],
    attempts: num("attempts"),
    maxAttempts: num("max_attempts"),
    createdMs: num("created_ms"),
    notBeforeMs: num("not_before_ms"),
    attemptStartsMs: Array.isArray(j["attempt_starts_ms"]) ? (j["attempt_starts_ms"] as unknown[]).map(Number) : [],
    payload,
  };
  if (run) info.run = { fence: Number(run["fence"]), leaseExpiresMs: Number(run["lease_expires_ms"]) };
  if (typeof j["reason"] === "string") info.reason = j["reason"];
  if (typeof j["dedup_id"] === "string") info.dedupId = j["dedup_id"];
  const tick = scheduleTickOf(j["schedule"]);
  if (tick) info.schedule = tick;
  return info;
}

export class Client {
  readonly urls: readonly string[];
  private readonly opts: ClientOptions;
  private readonly transports: Transport[];
  private readonly retries: number;
  private readonly batchJobsMax: number;
  private readonly batchBytesMax: number;
  private next = 0;

  constructor(urls: string | readonly string[], opts: ClientOptions = {}) {
    this.urls = normaliseUrls(urls, "Client");
    this.retries = positive(opts.retries ?? 4, "retries", 0);
    this.batchJobsMax = positive(opts.batchJobsMax ?? ENQUEUE_BATCH_MAX, "batchJobsMax", 1);
    this.batchBytesMax = positive(opts.batchBytesMax ?? ENQUEUE_BATCH_BYTES_MAX, "batchBytesMax", 1);
    this.opts = opts;
    this.transports = this.urls.map((u) => new Transport(u, opts));
  }

  /** Closes the keep-alive connections; a later request opens new ones. */
  close(): void {
    for (const t of this.transports) t.close();
  }

  /**
   * Enqueues one job. With `after` (ids: `"SHARD:ID"`, `"@N"`) it is a
   * dependent: it runs once every job named has ended, and its result has
   * the id `"@N"` (for `dependent`, `result`, `cancel`), no shard, and
   * `waiting`. With `batch` (`"@N"` from `openBatch`) it joins that batch:
   * its result has the id `"@M"`, no shard, `waiting` and `batch`.
   */
  async enqueue(key: string, payload: Payload, opts: EnqueueOptions = {}): Promise<EnqueueResult> {
    const [result] = await this.enqueueMany([{ ...opts, key, payload }]);
    return result!;
  }

  /**
   * Enqueues jobs in order, in as many requests as the server's limits need
   * (`batchJobsMax` jobs, `batchBytesMax` bytes); results in the same order.
   * A failed request stops there: the earlier requests' jobs are stored.
   * When any job has `after`, the jobs go as `enqueueGraph` sends them: in
   * one request, all dependents. When any job has `batch`, every job must
   * name that same batch (checked before anything is sent): each request
   * joins its jobs to it in one write, and their dedup ids make a resend
   * join nothing twice.
   */
  async enqueueMany(jobs: readonly JobSpec[]): Promise<EnqueueResult[]> {
    if (batchOf(jobs) === undefined && jobs.some(isDependent)) return this.sendGraph(jobs);
    const encoded: Encoded[] = jobs.map((job, i) => {
      const body = encodeJob(job, i);
      const json = JSON.stringify(body);
      return { body, json, bytes: Buffer.byteLength(json) };
    });
    const results: EnqueueResult[] = [];
    for (const batch of splitBatches(encoded, this.batchJobsMax, this.batchBytesMax)) {
      results.push(...(await this.post(batch)));
    }
    return results;
  }

  /**
   * Enqueues a graph of dependents in one request, atomically (all of it is
   * stored or nothing): `after` names other jobs of `jobs` by their index,
   * and jobs stored before by their ids (`"SHARD:ID"`, `"@N"`). Every job is
   * a dependent, answered `@N` and `waiting`; one without `after` (a root)
   * is released at the next resolver pass (about 100 ms, by a worker or a
   * `shardq serve` that owns shards), each other once every job it names
   * has ended. Checked before anything is sent, each throwing a `TypeError`
   * that names the jobs: a cycle, a bad `after` item, a dedup, unique or
   * debounce id (dependents carry none), more jobs than `batchJobsMax` or
   * bytes than `batchBytesMax` (the request is never split: its indexes
   * name jobs of the same request). At least one job must have `after`.
   *
   * With no dedup ids, the request is tried again only when a try surely
   * stored nothing (a refused connection, 425, 429); after one that may
   * have (no answer, a timeout, 408, 5xx) it rejects with
   * `ServerUnavailable` saying so.
   */
  async enqueueGraph(jobs: readonly JobSpec[]): Promise<EnqueueResult[]> {
    if (!Array.isArray(jobs)) throw new TypeError(`enqueueGraph: jobs must be an array, got ${JSON.stringify(jobs)}`);
    if (!jobs.some(isDependent)) throw new TypeError(`enqueueGraph: none of the ${jobs.length} jobs has after; enqueueMany enqueues jobs without dependencies`);
    return this.sendGraph(jobs);
  }

  /**
   * The dependent `id` (`"@N"`, as an enqueue with `after` gives it and
   * `ClaimedJob.dependent` carries it): its state, the job it was released
   * as, and each dependency's outcome and result; `undefined` when no
   * dependent has the id (it ended longer ago than dependents are kept, a
   * day, or never existed). A handler of a released dependent reads its
   * dependencies' results here. An id not of the form `@N` throws a
   * `TypeError` before any request.
   */
  async dependent(id: string): Promise<DependentInfo | undefined> {
    if (typeof id !== "string" || !DEPENDENT_ID.test(id)) {
      throw new TypeError(`dependent: id must be "@N", as an enqueue with after gives it (and ClaimedJob.dependent carries it), got ${JSON.stringify(id)}`);
    }
    const [doc, url] = await this.read("GET", `/v1/jobs/${encodeURIComponent(id)}`, undefined);
    return doc === undefined ? undefined : dependentInfo(doc, url);
  }

  /**
   * Opens a batch and resolves to its id (`"@N"`): jobs enqueued with
   * `batch` set to it join it, on any keys, until it is closed (and, after
   * `closeBatch`, from its own jobs while one of them has not ended). Its
   * callbacks are jobs on `key` with the payloads given (UTF-8 text; at
   * least one), each enqueued once: `onComplete` once the closed batch's
   * jobs have all ended, however; `onSuccess` once they were all acked;
   * `onDeath` at its first dead job. `dedupId` names the batch under `key`
   * (opening again with it gives the batch already opened); without one a
   * random one is sent, so a retry after a lost answer opens no second
   * batch. A bad option throws a `TypeError` before any request; the
   * server's refusal rejects with `BadRequest` naming the field.
   */
  async openBatch(key: string, opts: OpenBatchOptions): Promise<string> {
    const body = openBatchBody(key, opts);
    const [reply, url] = await this.postRetried("/v1/batches", JSON.stringify(body), "opening a batch");
    const id = (reply as { id?: unknown } | null)?.id;
    if (typeof id !== "string" || !DEPENDENT_ID.test(id)) throw new ShardqError(`${url}: /v1/batches answered no batch id: ${JSON.stringify(reply).slice(0, 200)}`, 200, url);
    return id;
  }

  /**
   * Closes the batch `id` (`"@N"`): no job joins it from outside any more,
   * and its complete and success callbacks fire once its jobs have all
   * ended. `true` when this call closed it, `false` when it was closed
   * already (by another call, or by an earlier try of this one whose answer
   * was lost). An id not of the form `@N` throws a `TypeError` before any
   * request; a batch the server does not know rejects with `BadRequest` (status 404)
   * naming it.
   */
  async closeBatch(id: string): Promise<boolean> {
    const [reply] = await this.postRetried(batchPath(id, "closeBatch", "close"), "{}", "closing a batch");
    return (reply as { closed?: unknown } | null)?.closed === true;
  }

  /**
   * The batch `id` (`"@N"`, as `openBatch` gives it and `ClaimedJob.batch`
   * carries it): its state, counts, callbacks and each job's outcome and
   * result; `undefined` when no batch has the id (it completed longer ago
   * than batches are kept, a day, or never existed). An id not of the form
   * `@N` throws a `TypeError` before any request.
   */
  async batch(id: string): Promise<BatchInfo | undefined> {
    const [doc, url] = await this.read("GET", batchPath(id, "batch"), undefined);
    return doc === undefined ? undefined : batchInfo(doc, url);
  }

  /** The live job `id` (`SHARD:ID`); `undefined` when no live job has it (finished, cancelled, moved away with its key, or never existed). */
  async job(id: string): Promise<JobInfo | undefined> {
    const path = `/v1/jobs/${encodeURIComponent(id)}`;
    const [doc, url] = await this.read("GET", path, undefined);
    return doc === undefined || isFinished(doc) ? undefined : jobInfo(doc, url);
  }

  /**
   * Waits up to `timeoutMs` for job `id` to finish and resolves to it (`outcome`, and `result`: what its handler
   * returned, absent for nothing or a cancelled job). The server answers as soon as the job is acked (long polls of
   * `GET /v1/jobs/{id}/result`, at most 30 s each), not by polling from here. Rejects with `ResultTimeout` when it has
   * not finished by then, `JobDied` for a dead letter, and a 404 `ShardqError` for an id with no job.
   */
  async result(id: string, timeoutMs = 30_000): Promise<FinishedInfo> {
    const deadline = Date.now() + Math.max(0, timeoutMs);
    for (;;) {
      const waitMs = Math.max(0, Math.min(deadline - Date.now(), 30_000));
      const path = `/v1/jobs/${encodeURIComponent(id)}/result?wait_ms=${Math.floor(waitMs)}`;
      const [doc, url] = await this.read("GET", path, undefined, false);
      if (isFinished(doc)) return finishedInfo(doc, url);
      const d = (doc ?? {}) as Record<string, unknown>;
      if (d["state"] === "dead") {
        throw new JobDied(id, typeof d["reason"] === "string" ? d["reason"] : undefined, url, typeof d["dependent_state"] === "string" ? d["dependent_state"] : undefined);
      }
      if (Date.now() >= deadline) throw new ResultTimeout(id, String(d["state"]), url);
    }
  }

  async finished(id: string): Promise<FinishedInfo | undefined> {
    const path = `/v1/jobs/${encodeURIComponent(id)}`;
    const [doc, url] = await this.read("GET", path, undefined);
    return doc !== undefined && isFinished(doc) ? finishedInfo(doc, url) : undefined;
  }

  /**
   * Where job `id` went when it left its shard with its key in a rebalance:
   * the key and the shard it is on now. Its copy has a new id there, where
   * `keyJobs` lists it and `job` and `result` of the old id find it (while
   * the shards remember the move). `undefined` for a job that did not move,
   * finished, was cancelled, or never existed.
   */
  async moved(id: string): Promise<Moved | undefined> {
    const [doc] = await this.read("GET", `/v1/jobs/${encodeURIComponent(id)}`, undefined, "body");
    // The copy found under its new id, or a 404 that names the key's shard.
    const body = doc instanceof NotFoundReply ? doc.doc : (doc as Record<string, unknown> | undefined);
    const m = body?.["moved"];
    if (m === null || typeof m !== "object") return undefined;
    const { key, shard } = m as Record<string, unknown>;
    return typeof key === "string" && typeof shard === "string" ? { key, shard } : undefined;
  }

  /** `key`'s live jobs in key order: its run in flight, queued, delayed and dead jobs; at most `limit` (1 to 1000). */
  async keyJobs(key: string, limit = 100): Promise<JobInfo[]> {
    if (!Number.isSafeInteger(limit) || limit < 1 || limit > KEY_JOBS_MAX) {
      throw new TypeError(`keyJobs: limit must be an integer from 1 to ${KEY_JOBS_MAX}, got ${limit}`);
    }
    const [doc, url] = await this.read("GET", `/v1/keys/${encodeURIComponent(key)}/jobs?limit=${limit}`, undefined);
    const jobs = (doc as Record<string, unknown> | undefined)?.["jobs"];
    if (!Array.isArray(jobs)) throw new ShardqError(`${url}: the reply has no jobs list`, 200, url);
    return jobs.map((j) => jobInfo(j, url));
  }

  /** `key`'s newest finished jobs (acked or cancelled), newest first, at most `limit` (1 to 1000), as far as the deployment's retention keeps them. */
  async keyFinished(key: string, limit = 20): Promise<FinishedInfo[]> {
    if (!Number.isSafeInteger(limit) || limit < 1 || limit > KEY_JOBS_MAX) {
      throw new TypeError(`keyFinished: limit must be an integer from 1 to ${KEY_JOBS_MAX}, got ${limit}`);
    }
    const [doc, url] = await this.read("GET", `/v1/keys/${encodeURIComponent(key)}/jobs?limit=1&finished=${limit}`, undefined);
    const finished = (doc as Record<string, unknown> | undefined)?.["finished"];
    if (!Array.isArray(finished)) throw new ShardqError(`${url}: the reply has no finished list`, 200, url);
    return finished.map((j) => finishedInfo(j, url));
  }

  /**
   * Cancels the job `id`: a queued, delayed or dead one is deleted and never
   * runs; a running one's run is asked to stop (its results are refused) and
   * the job goes when the run ends, never retried. `true` when this call
   * cancelled it; `false` when no live job had the id (it finished, or an
   * earlier try on another server cancelled it). A job whose key is moving
   * rejects with `JobNotCancelled` (`state` says why).
   *
   * A dependent (`"@N"`) that waits is cancelled (it never runs; its own
   * dependents see it as `failed`); once released, its job is. `false`
   * when it had ended: its job finished, or it failed or was cancelled
   * while it waited.
   */
  async cancel(id: string): Promise<boolean> {
    try {
      const [doc] = await this.read("DELETE", `/v1/jobs/${encodeURIComponent(id)}`, {});
      return doc !== undefined;
    } catch (err) {
      if (err instanceof JobNotCancelled && DEPENDENT_ID.test(id) && DEPENDENT_ENDED.includes(err.state)) return false;
      throw err;
    }
  }

  /** Every flow-control setting of the deployment: the default policy, the policies by prefix and by key, and the groups (role `read`). */
  async policies(): Promise<FlowSettings> {
    const [doc, url] = await this.read("GET", "/v1/policies", undefined, false);
    const s = record(doc, url, "the flow settings");
    return {
      default: flowPolicy(s["default"] ?? {}, url),
      prefixes: mapOf(s["prefixes"], url, "prefixes", flowPolicy),
      keys: mapOf(s["keys"], url, "keys", flowPolicy),
      groups: mapOf(s["groups"], url, "groups", groupInfo),
    };
  }

  /**
   * The policy `key` gets and where it comes from (its own, its longest
   * prefix's, or the default). With `{ scope: "prefix" }` the policy of the
   * prefix `key` (`undefined` when it has none); with `{ scope: "default" }`
   * the default's (`key` is not used).
   */
  async policy(key?: string, opts: { scope?: PolicyScope } = {}): Promise<PolicyInfo | undefined> {
    const scope = opts.scope ?? "key";
    if (scope !== "key" && scope !== "prefix" && scope !== "default") throw new TypeError(`policy: scope must be key, prefix or default, got ${JSON.stringify(scope)}`);
    const path = policyPath(scope === "key" ? { key: key ?? "" } : scope === "prefix" ? { prefix: key ?? "" } : { default: true }, "policy");
    const [doc, url] = await this.read("GET", path, undefined);
    if (doc === undefined) return undefined;
    const p = record(doc, url, "the policy");
    const info: PolicyInfo = { key: String(p["key"]), policy: flowPolicy(p["policy"], url), source: String(p["from"]) as PolicyScope };
    if (typeof p["prefix"] === "string") info.prefix = p["prefix"];
    return info;
  }

  /**
   * Sets the whole policy of exactly one of `key`, `prefix` (every key
   * starting with it) or the `default` (role `admin`): the fields given, the
   * others at their defaults (no rate, no group, weight 1, priority 0).
   * Resolves to the policy stored; a bad value rejects with `BadRequest`
   * naming it. Every server and worker uses it within a second.
   */
  async setPolicy(spec: PolicySpec): Promise<FlowPolicy> {
    const path = policyPath(spec, "setPolicy");
    const body: Record<string, unknown> = {};
    for (const field of ["rate", "burst", "weight", "priority", "group", "concurrency"] as const) {
      if (spec[field] !== undefined) body[field] = spec[field];
    }
    const [doc, url] = await this.read("PUT", path, body, false);
    return flowPolicy(record(doc, url, "the answer")["policy"], url);
  }

  /** Removes the policy of `key` or `prefix` (the `default` goes back to no limits) (role `admin`); whether there was one. */
  async clearPolicy(target: PolicyTarget): Promise<boolean> {
    const [doc, url] = await this.read("DELETE", policyPath(target, "clearPolicy"), {}, false);
    return removed(doc, url);
  }

  /** Every flow-control group, by name (role `read`). */
  async groups(): Promise<Record<string, GroupInfo>> {
    const [doc, url] = await this.read("GET", "/v1/groups", undefined, false);
    return mapOf(doc, url, "groups", groupInfo);
  }

  /** The group `name`; `undefined` when there is none. */
  async group(name: string): Promise<GroupInfo | undefined> {
    const [doc, url] = await this.read("GET", `/v1/groups/${segment(name, "group: name")}`, undefined);
    return doc === undefined ? undefined : groupInfo(doc, url);
  }

  /** Sets the group `name` (role `admin`), replacing what it had: `rate` starts shared by every key whose policy names it, over every worker, with `burst` tokens (default: one second of the rate); `concurrency` runs of its keys at once. At least one of `rate` and `concurrency`. Resolves to the group stored. */
  async setGroup(name: string, spec: GroupSpec): Promise<GroupInfo> {
    const path = `/v1/groups/${segment(name, "setGroup: name")}`;
    if (spec?.rate !== undefined && (typeof spec.rate !== "string" || spec.rate === "")) throw new TypeError(`setGroup: rate must be a string such as "20/s", got ${JSON.stringify(spec.rate)}`);
    if (spec?.concurrency !== undefined && !Number.isInteger(spec.concurrency)) throw new TypeError(`setGroup: concurrency must be a whole number from 1 to 10000, got ${JSON.stringify(spec.concurrency)}`);
    if (spec?.rate === undefined && spec?.concurrency === undefined) throw new TypeError("setGroup: give a rate, a concurrency or both");
    const body: Record<string, unknown> = {};
    if (spec.rate !== undefined) body["rate"] = spec.rate;
    if (spec.burst !== undefined) body["burst"] = spec.burst;
    if (spec.concurrency !== undefined) body["concurrency"] = spec.concurrency;
    const [doc, url] = await this.read("PUT", path, body, false);
    return groupInfo(record(doc, url, "the answer")["group"], url);
  }

  /** Removes the group `name` (role `admin`); whether there was one. A group a policy still names rejects with `BadRequest`. */
  async clearGroup(name: string): Promise<boolean> {
    const [doc, url] = await this.read("DELETE", `/v1/groups/${segment(name, "clearGroup: name")}`, {}, false);
    return removed(doc, url);
  }

  /**
   * Lifts the hold a handler's group back-off (`new BackOff(ms, { group:
   * true })`) put on the group `name` (role `admin`): every worker and
   * server starts the group's keys again within a second. The key whose
   * handler backed off keeps its own wait (`resumeKey` lifts that).
   * Resolves to `true`, as the server answers whether a hold was there or
   * not (lifting none changes nothing). A bad name (`"none"`, over 128
   * bytes) rejects with `BadRequest`, an empty one with a `TypeError`
   * before any request.
   */
  async resumeGroup(name: string): Promise<boolean> {
    const [doc, url] = await this.read("POST", `/v1/groups/${segment(name, "resumeGroup: name")}/resume`, {}, false);
    const r = record(doc, url, "the answer")["resumed"];
    if (typeof r !== "boolean") throw new ShardqError(`${url}: the answer has no resumed flag: ${JSON.stringify(doc)}`, 200, url);
    return r;
  }

  /**
   * Lifts the back-off a handler (`new BackOff(ms)`) put on `key` (role
   * `admin`), whichever process runs the key's shard: the jobs it held are
   * due now, keep their place and their attempt counts, and the key starts
   * at its shard owner's next claim. Resolves to the hold it lifted
   * (`KeyHold`: `untilMs`, the held `jobs`), or `undefined` when no
   * back-off held the key (its wait was over, it was resumed already, by an
   * earlier try on another server too, or it never backed off), and
   * nothing changed. Only a back-off is lifted: a producer's delay, a
   * retry's wait and the hold of the key's group (`resumeGroup`) stay. A
   * key moving to another shard rejects with `KeyNotResumed` (`state`
   * `"moving"`); a bad key (over 1024 bytes, say) with `BadRequest`, an
   * empty one with a `TypeError` before any request.
   */
  async resumeKey(key: string): Promise<KeyHold | undefined> {
    const [doc, url] = await this.read("POST", `/v1/keys/${segment(key, "resumeKey: key")}/resume`, {}, false);
    return keyHold(doc, url);
  }

  /** Every recurring schedule of the deployment, by id, with its state and next fire (role `read`). */
  async schedules(): Promise<ScheduleInfo[]> {
    const [doc, url] = await this.read("GET", "/v1/schedules", undefined, false);
    const list = record(doc, url, "the answer")["schedules"];
    if (!Array.isArray(list)) throw new ShardqError(`${url}: the answer has no schedules list: ${JSON.stringify(doc)}`, 200, url);
    return list.map((v) => scheduleInfoOf(v, url));
  }

  /**
   * The schedule `id` with its state (`state.fired`, `state.last`, ...) and
   * next fire (role `read`). An unknown id rejects with a `BadRequest`
   * whose `status` is 404.
   */
  async schedule(id: string): Promise<ScheduleInfo> {
    const [doc, url] = await this.read("GET", schedulePath(id, "schedule"), undefined, false);
    return scheduleInfoOf(doc, url);
  }

  /**
   * Creates the schedule `id` (1 to 128 ASCII letters, digits and `-_.:`),
   * or replaces it whole (role `admin`; a replaced one keeps its state and
   * whether it is paused): every tick enqueues one job of `spec.key`. It
   * ticks on exactly one of `cron` (in the zone `tz`, default UTC) and
   * `every` (`"30s"`, `"5m"`); naming both or neither throws a `TypeError`
   * before any request. Resolves to the schedule stored; a bad value
   * rejects with `BadRequest` whose `serverError` names the field and the
   * value (`invalid cron "0 25 * * *": ...`). Every server fires it within a
   * second, the one that runs its key's shard.
   */
  async setSchedule(id: string, spec: ScheduleSpec): Promise<Schedule> {
    const path = schedulePath(id, "setSchedule");
    const [doc, url] = await this.read("PUT", path, scheduleBody(spec), false);
    return scheduleOf(record(doc, url, "the answer")["schedule"], url);
  }

  /**
   * Sets many schedules in one change (role `admin`): `schedules` maps each
   * id to a `ScheduleSpec`, checked as `setSchedule` checks it. A schedule
   * already there keeps its state and its pause. `prune` also deletes every
   * schedule not named; `dryRun` stores nothing and resolves to what would
   * change. All of it is stored or nothing: a bad schedule rejects with
   * `BadRequest` naming it.
   */
  async applySchedules(schedules: Record<string, ScheduleSpec>, options: { prune?: boolean; dryRun?: boolean } = {}): Promise<SchedulesApplied> {
    if (schedules === null || typeof schedules !== "object" || Array.isArray(schedules)) {
      throw new TypeError(`applySchedules: schedules must be an object of id to spec, got ${JSON.stringify(schedules)}`);
    }
    const body: Record<string, unknown> = {};
    for (const [id, spec] of Object.entries(schedules)) {
      segment(id, "applySchedules: id");
      try {
        body[id] = scheduleBody(spec);
      } catch (e) {
        throw new TypeError(`applySchedules: schedule ${JSON.stringify(id)}: ${(e as Error).message}`);
      }
    }
    const prune = options.prune === true;
    const dryRun = options.dryRun === true;
    const [doc, url] = await this.read("PUT", "/v1/schedules", { schedules: body, prune, dry_run: dryRun }, false);
    const a = record(record(doc, url, "the answer")["applied"], url, "applied");
    const ids = (name: string): string[] => {
      const v = a[name];
      if (!Array.isArray(v) || !v.every((x) => typeof x === "string")) {
        throw new ShardqError(`${url}: the answer's applied.${name} is not a list of ids: ${JSON.stringify(doc)}`, 200, url);
      }
      return v as string[];
    };
    return { dryRun, added: ids("added"), changed: ids("changed"), unchanged: ids("unchanged"), removed: ids("removed") };
  }

  /** Deletes the schedule `id` (role `admin`); whether there was one. The jobs it enqueued stay. */
  async deleteSchedule(id: string): Promise<boolean> {
    const [doc, url] = await this.read("DELETE", schedulePath(id, "deleteSchedule"), {}, false);
    const r = record(doc, url, "the answer")["deleted"];
    if (typeof r !== "boolean") throw new ShardqError(`${url}: the answer has no deleted flag: ${JSON.stringify(doc)}`, 200, url);
    return r;
  }

  /** Pauses the schedule `id` (role `admin`): no tick fires until `resumeSchedule`. Resolves to the schedule stored; an unknown id rejects with a 404. */
  async pauseSchedule(id: string): Promise<Schedule> {
    const [doc, url] = await this.read("POST", schedulePath(id, "pauseSchedule", "pause"), {}, false);
    return scheduleOf(record(doc, url, "the answer")["schedule"], url);
  }

  /** Resumes the schedule `id` (role `admin`); the ticks of its pause never fire. Resolves to the schedule stored; an unknown id rejects with a 404. */
  async resumeSchedule(id: string): Promise<Schedule> {
    const [doc, url] = await this.read("POST", schedulePath(id, "resumeSchedule", "resume"), {}, false);
    return scheduleOf(record(doc, url, "the answer")["schedule"], url);
  }

  /**
   * Enqueues one job of the schedule `id` now, outside its ticks and its
   * overlap policy (role `admin`); resolves to where it went. An unknown id
   * rejects with a 404. Each call is a job of its own: a call retried on
   * another server after an answer was lost may have enqueued one there too.
   */
  async triggerSchedule(id: string): Promise<ScheduleTriggered> {
    const [doc, url] = await this.read("POST", schedulePath(id, "triggerSchedule", "trigger"), {}, false);
    const d = record(doc, url, "the answer");
    if (typeof d["shard"] !== "string" || typeof d["job"] !== "string") throw new ShardqError(`${url}: the answer lacks a shard or a job: ${JSON.stringify(doc)}`, 200, url);
    return { id: String(d["id"]), shard: d["shard"], job: d["job"] };
  }

  /**
   * Enqueues the job of every tick of the schedule `id` from `from` to `to`
   * (both included; ms since the epoch, RFC 3339 text or a `Date`), in
   * order, at most 10,000 ticks (role `admin`). A tick whose job is stored
   * already (fired or backfilled within the schedule's dedup window: its
   * catch-up, its jitter and 10 minutes) is not stored again, so a
   * backfill may be repeated at once. An unknown id rejects with a 404, a bad range
   * with `BadRequest`.
   */
  async backfillSchedule(id: string, from: ScheduleTime, to: ScheduleTime): Promise<ScheduleBackfilled> {
    const path = schedulePath(id, "backfillSchedule", "backfill");
    const body = { from: scheduleTime(from, "backfillSchedule: from"), to: scheduleTime(to, "backfillSchedule: to") };
    const [doc, url] = await this.read("POST", path, body, false);
    const d = record(doc, url, "the answer");
    return {
      id: String(d["id"]),
      ticks: fieldNumber(d, "ticks", url, "a backfill"),
      stored: fieldNumber(d, "stored", url, "a backfill"),
      alreadyStored: fieldNumber(d, "already_stored", url, "a backfill"),
    };
  }

  /** One read or change at the first server that answers (a 404 is an answer, `undefined`, unless `notFound` is false). */
  private async read(method: string, path: string, body: unknown, notFound: boolean | "body" = true): Promise<[unknown, string]> {
    const causes: string[] = [];
    let last: ShardqError | undefined;
    for (const transport of this.transports) {
      try {
        const doc = await transport.send(method, path, body, { serverWaitMs: READ_SERVER_WAIT_MS }, notFound);
        return [doc, transport.base + path];
      } catch (err) {
        if (!(err instanceof ShardqError) || !err.retryable) throw err;
        last = err;
        causes.push(err.message);
      }
    }
    const error = new ServerUnavailable(`${method} ${path} failed on every server; last: ${last?.message ?? "?"}`, last?.status, last?.url ?? "", last?.serverError, {
      cause: last,
    });
    error.causes = causes;
    throw error;
  }

  /** The jobs of a request with `after`, checked and sent as one request (see `enqueueGraph`). */
  private async sendGraph(jobs: readonly JobSpec[]): Promise<EnqueueResult[]> {
    const graph = { count: jobs.length, edges: [] as number[][] };
    const sent = jobs.map((job, i) => encodeJob(job, i, graph));
    const cycle = cycleOf(graph.edges);
    if (cycle.length > 0) {
      const path = cycle.map((i) => `${i} (key ${JSON.stringify(jobs[i]!.key)})`).join(" -> ");
      throw new TypeError(`invalid after: jobs ${path} form a cycle (each waits for the next): a job cannot wait for itself, even through others; nothing was sent`);
    }
    if (sent.length > this.batchJobsMax) {
      throw new TypeError(
        `a request with after has ${sent.length} jobs, over this client's batchJobsMax of ${this.batchJobsMax}: its indexes name jobs of the same request, so it is not split; send at most ${this.batchJobsMax} (later ones may name earlier ones by their @N ids), or raise batchJobsMax up to the server's --jobs-per-request-max`,
      );
    }
    const text = JSON.stringify({ jobs: sent });
    const bytes = Buffer.byteLength(text);
    if (bytes > this.batchBytesMax) {
      throw new TypeError(`a request with after of ${sent.length} jobs is ${bytes} bytes of JSON, over this client's batchBytesMax of ${this.batchBytesMax}: its indexes name jobs of the same request, so it is not split`);
    }
    const causes = new Map<string, string>();
    let last: ShardqError | undefined;
    for (let attempt = 0; attempt <= this.retries; attempt++) {
      const transport = this.transports[this.next % this.transports.length]!;
      try {
        const reply = await transport.post("/v1/jobs", text, { serverWaitMs: ENQUEUE_SERVER_WAIT_MS });
        return parseResults(reply, sent, transport.base);
      } catch (err) {
        if (!(err instanceof ShardqError) || !err.retryable) throw err;
        last = err;
        causes.set(transport.base, err.message);
        this.next++;
        if (!surelyNotStored(err)) {
          const error = new ServerUnavailable(
            `enqueue with after not sent again: the try may have stored its dependents, which carry no dedup id, so a second send could store them twice (\`shardq jobs --key KEY\` lists a key's waiting dependents); ${err.message}`,
            err.status,
            err.url,
            err.serverError,
            { cause: err },
          );
          error.causes = [...causes.values()];
          throw error;
        }
        if (attempt < this.retries) await sleep(backoffMs(attempt, this.opts.backoffMs ?? 50, this.opts.maxBackoffMs ?? 2000));
      }
    }
    const error = new ServerUnavailable(
      `enqueue with after failed after ${this.retries + 1} tries over ${this.urls.length} server(s); last: ${last?.message ?? "?"}`,
      last?.status,
      last?.url ?? "",
      last?.serverError,
      { cause: last },
    );
    error.causes = [...causes.values()];
    throw error;
  }

  /** A POST safe to send again (it carries a dedup id, or changes nothing twice), retried as an enqueue is: the reply and the server's base URL. */
  private async postRetried(path: string, text: string, what: string): Promise<[unknown, string]> {
    const causes = new Map<string, string>();
    let last: ShardqError | undefined;
    for (let attempt = 0; attempt <= this.retries; attempt++) {
      const transport = this.transports[this.next % this.transports.length]!;
      try {
        return [await transport.post(path, text, { serverWaitMs: ENQUEUE_SERVER_WAIT_MS }), transport.base];
      } catch (err) {
        if (!(err instanceof ShardqError) || !err.retryable) throw err;
        last = err;
        causes.set(transport.base, err.message);
        this.next++;
        if (attempt < this.retries) await sleep(backoffMs(attempt, this.opts.backoffMs ?? 50, this.opts.maxBackoffMs ?? 2000));
      }
    }
    const error = new ServerUnavailable(
      `${what} failed after ${this.retries + 1} tries over ${this.urls.length} server(s); last: ${last?.message ?? "?"}`,
      last?.status,
      last?.url ?? "",
      last?.serverError,
      { cause: last },
    );
    error.causes = [...causes.values()];
    throw error;
  }

  private async post(batch: Encoded[]): Promise<EnqueueResult[]> {
    // The same text (and so the same dedup ids) on every try.
    const text = `{"jobs":[${batch.map((e) => e.json).join(",")}]}`;
    const sent = batch.map((e) => e.body);
    const causes = new Map<string, string>();
    let last: ShardqError | undefined;
    for (let attempt = 0; attempt <= this.retries; attempt++) {
      const transport = this.transports[this.next % this.transports.length]!;
      try {
        const reply = await transport.post("/v1/jobs", text, { serverWaitMs: ENQUEUE_SERVER_WAIT_MS });
        return parseResults(reply, sent, transport.base);
      } catch (err) {
        if (!(err instanceof ShardqError) || !err.retryable) throw err;
        last = err;
        causes.set(transport.base, err.message);
        // The next try goes to the next server.
        this.next++;
        if (attempt < this.retries) await sleep(backoffMs(attempt, this.opts.backoffMs ?? 50, this.opts.maxBackoffMs ?? 2000));
      }
    }
    const error = new ServerUnavailable(
      `enqueue failed after ${this.retries + 1} tries over ${this.urls.length} server(s); last: ${last?.message ?? "?"}`,
      last?.status,
      last?.url ?? "",
      last?.serverError,
      { cause: last },
    );
    error.causes = [...causes.values()];
    throw error;
  }
}
