/**
 * The producer side of the HTTP API of `shardq serve`: `POST /v1/jobs`.
 *
 * Every job carries a dedup id (a random UUID when the caller gives none),
 * chosen once before the first try, so a retry after a lost reply cannot
 * enqueue the job twice. Failures with no response, 408, 429 and 5xx are
 * retried a bounded number of times with backoff, each try on the next URL;
 * anything else (400, 401, 403, ...) fails at once.
 */

import { randomUUID } from "node:crypto";

import { backoffMs, normaliseUrls, postJson, ShardqError, sleep, type HttpOptions } from "./http.js";

export type Payload = string | Uint8Array;

export interface EnqueueOptions {
  /** Run no earlier than this many milliseconds from now. */
  delayMs?: number;
  /** Attempts before the job becomes a dead letter. */
  maxAttempts?: number;
  /** Idempotency key; generated when absent. */
  dedupId?: string;
}

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
  /** The dedup id sent (the generated one when none was given). */
  dedupId: string;
}

export interface ClientOptions extends HttpOptions {
  /** Retries after the first try (default 4). */
  retries?: number;
  /** First backoff in milliseconds (default 50), doubling per retry. */
  backoffMs?: number;
  /** Largest backoff in milliseconds (default 2000). */
  maxBackoffMs?: number;
}

/** Largest number of jobs in one `POST /v1/jobs`; longer lists go in several requests. */
export const ENQUEUE_BATCH_MAX = 1000;

function checkNonNegativeInt(value: number | undefined, field: string, index: number): void {
  if (value !== undefined && (!Number.isSafeInteger(value) || value < 0)) {
    throw new TypeError(`jobs[${index}].${field} must be a non-negative integer, got ${String(value)}`);
  }
}

function encodeJob(job: JobSpec, index: number): Record<string, unknown> {
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
  out["dedup_id"] = job.dedupId ?? randomUUID();
  return out;
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
      dedupId: sent[i]!["dedup_id"] as string,
    };
  });
}

export class Client {
  readonly urls: readonly string[];
  private readonly opts: ClientOptions;
  private next = 0;

  constructor(urls: string | readonly string[], opts: ClientOptions = {}) {
    this.urls = normaliseUrls(urls, "Client");
    const retries = opts.retries ?? 4;
    if (!Number.isSafeInteger(retries) || retries < 0) throw new TypeError(`Client: retries must be a non-negative integer, got ${retries}`);
    this.opts = { ...opts, retries };
  }

  /** Enqueues one job. */
  async enqueue(key: string, payload: Payload, opts: EnqueueOptions = {}): Promise<EnqueueResult> {
    const [result] = await this.enqueueMany([{ ...opts, key, payload }]);
    return result!;
  }

  /** Enqueues jobs in order (one request per `ENQUEUE_BATCH_MAX`); results in the same order. */
  async enqueueMany(jobs: readonly JobSpec[]): Promise<EnqueueResult[]> {
    const encoded = jobs.map(encodeJob);
    const results: EnqueueResult[] = [];
    for (let start = 0; start < encoded.length; start += ENQUEUE_BATCH_MAX) {
      const batch = encoded.slice(start, start + ENQUEUE_BATCH_MAX);
      results.push(...(await this.post(batch)));
    }
    return results;
  }

  private async post(batch: Record<string, unknown>[]): Promise<EnqueueResult[]> {
    const retries = this.opts.retries ?? 4;
    let last: ShardqError | undefined;
    for (let attempt = 0; attempt <= retries; attempt++) {
      const base = this.urls[this.next % this.urls.length]!;
      try {
        const reply = await postJson(base, "/v1/jobs", { jobs: batch }, this.opts);
        return parseResults(reply, batch, base);
      } catch (err) {
        // 409: another request holds one of the dedup ids at this moment (an
        // earlier try of this batch, say); trying again is safe.
        if (!(err instanceof ShardqError) || !(err.retryable || err.status === 409)) throw err;
        last = err;
        // The next try goes to the next server.
        this.next++;
        if (attempt < retries) await sleep(backoffMs(attempt, this.opts.backoffMs ?? 50, this.opts.maxBackoffMs ?? 2000));
      }
    }
    throw new ShardqError(
      `enqueue failed after ${retries + 1} tries over ${this.urls.length} server(s); last: ${last?.message ?? "?"}`,
      last?.status,
      last?.url ?? "",
      last?.serverError,
      { cause: last },
    );
  }
}
