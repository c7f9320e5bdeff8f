/**
 * The HTTP layer shared by `Client` and `Worker`: JSON over keep-alive
 * `node:http`/`node:https` connections (one agent per server), bearer
 * tokens, errors that name the method, the URL and the server's message,
 * which failures are worth retrying, and cancellation of a request that
 * has not been answered yet (a long poll at a stop).
 *
 * Internal: only the error classes are exported from the package.
 */

import { Agent as HttpAgent, request as httpRequest, type IncomingMessage } from "node:http";
import { Agent as HttpsAgent, request as httpsRequest } from "node:https";

/** Base class of every error a request to `shardq serve` ends with. */
export class ShardqError extends Error {
  override name = "ShardqError";
  constructor(
    message: string,
    /** HTTP status, or undefined when no response came (connection refused, timeout). */
    readonly status: number | undefined,
    /** The full URL of the request. */
    readonly url: string,
    /** The server's `error` field, when it sent one. */
    readonly serverError?: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }

  /** 409: the receipt no longer names the current run (the lease lapsed, another run started). */
  get isStaleReceipt(): boolean {
    return this.status === 409;
  }

  /** True for failures another try may fix: no response, 408, 425, 429 and 5xx. */
  get retryable(): boolean {
    return retryableStatus(this.status);
  }
}

/** `Client.result`: the job had not finished when the wait ended; `state` is its state then (`queued`, `delayed`, `running`). */
export class ResultTimeout extends ShardqError {
  override name = "ResultTimeout";
  constructor(
    readonly id: string,
    readonly state: string,
    url: string,
  ) {
    super(`job ${id} did not finish within the wait (it is ${state})`, 200, url);
  }
}

/**
 * `Client.result`: the job ran out of attempts and is a dead letter
 * (`reason` its last failure's); it has no result. For a dependent (`@N`)
 * that will never run, `dependentState` says why: `"failed"` (a dependency
 * did not complete, under the policy `"fail"`: `reason` names it) or
 * `"cancelled"`.
 */
export class JobDied extends ShardqError {
  override name = "JobDied";
  constructor(
    readonly id: string,
    readonly reason: string | undefined,
    url: string,
    readonly dependentState?: string,
  ) {
    super(`job ${id} is dead: ${reason ?? "its attempts failed"}`, 200, url);
  }
}

/** 400, 413, 415 and other 4xx without a class of their own: the server refused the request's content (never retried). */
export class BadRequest extends ShardqError {
  override name = "BadRequest";
}

/** 401 or 403: a missing or wrong token, or a role the token lacks (never retried). */
export class Unauthorized extends ShardqError {
  override name = "Unauthorized";
}

/**
 * 409 on ack, extend or fail: the run a receipt names is no longer current
 * (its lease lapsed, the job runs again). With several receipts the valid
 * ones took effect; `stale` and `notOwned` list the others.
 */
export class StaleReceipt extends ShardqError {
  override name = "StaleReceipt";
  constructor(
    message: string,
    status: number,
    url: string,
    serverError: string | undefined,
    readonly stale: readonly string[],
    readonly notOwned: readonly string[],
  ) {
    super(message, status, url, serverError);
  }
}

/**
 * 409 on a cancel: the job's key is moving to another shard (`state`
 * `"moving"`: cancel it there once the move is done), or a server that cannot
 * stop runs found it running (`"running"`). Nothing changed.
 */
export class JobNotCancelled extends ShardqError {
  override name = "JobNotCancelled";
  constructor(
    message: string,
    status: number,
    url: string,
    serverError: string | undefined,
    readonly state: string,
  ) {
    super(message, status, url, serverError);
  }
}

/**
 * 409 on a key resume (`client.resumeKey`): the key is moving to another
 * shard now (`state` `"moving"`; `shard` the shard it is leaving, when the
 * server said). Nothing changed. The move carries the key's jobs with
 * their waits, and the new shard keeps a back-off's wait as a plain delay,
 * which a resume does not lift there.
 */
export class KeyNotResumed extends ShardqError {
  override name = "KeyNotResumed";
  constructor(
    message: string,
    status: number,
    url: string,
    serverError: string | undefined,
    readonly state: string,
    readonly shard: string | undefined,
  ) {
    super(message, status, url, serverError);
  }
}

/** Whether `url` ends with `/v1/keys/{key}/resume` (the key one percent-encoded segment). */
function isKeyResume(url: string): boolean {
  return /\/v1\/keys\/[^/?]+\/resume$/.test(url);
}

/** Whether `url` ends with one of the `/v1/schedules...` paths. */
function isSchedule(url: string): boolean {
  return /\/v1\/schedules(\/[^/?]+(\/[a-z]+)?)?$/.test(url);
}

/**
 * No usable answer: no response, a timeout, 408, 425, 429 or 5xx; after the
 * retries, `causes` holds the last failure of each server.
 */
export class ServerUnavailable extends ShardqError {
  override name = "ServerUnavailable";
  causes: readonly string[] = [];
}

export function retryableStatus(status: number | undefined): boolean {
  return status === undefined || status === 408 || status === 425 || status === 429 || status >= 500;
}

export interface HttpOptions {
  token?: string;
  /**
   * How long to wait for an answer beyond the longest the server may
   * itself wait on that request (a claim's long poll, an enqueue's wait on
   * a paused key), in milliseconds (default 10000).
   */
  timeoutMs?: number;
}

/** Time allowed beyond the server's own wait (`HttpOptions.timeoutMs`). */
export const TIMEOUT_MARGIN_MS_DEFAULT = 10_000;

/**
 * The longest `POST /v1/jobs` may wait inside the server before it answers:
 * a paused key (mid-migration) is retried for up to 30 s (the engine's
 * `PAUSE_WAIT_MS_MAX`) and the dedup lock is waited for up to 5 s.
 */
export const ENQUEUE_SERVER_WAIT_MS = 30_000 + 5_000;

/**
 * The longest an ack, fail or extend may wait inside the server: the store's
 * locks are taken with bounded waits of at most 5 s.
 */
export const REPORT_SERVER_WAIT_MS = 5_000;

/** Base URLs without a trailing slash; refuses an empty list and anything that is not http(s). */
export function normaliseUrls(urls: string | readonly string[], what: string): string[] {
  const list = typeof urls === "string" ? urls.split(",").map((u) => u.trim()).filter((u) => u !== "") : [...urls];
  if (list.length === 0) throw new TypeError(`${what}: at least one server URL is required`);
  return list.map((u) => {
    let parsed: URL;
    try {
      parsed = new URL(u);
    } catch {
      throw new TypeError(`${what}: server URL ${JSON.stringify(u)} is not a valid URL`);
    }
    if (parsed.protocol !== "http:" && parsed.protocol !== "https:") {
      throw new TypeError(`${what}: server URL ${JSON.stringify(u)} must use http or https`);
    }
    return u.replace(/\/+$/, "");
  });
}

/** Thrown (as the rejection) when a request is cancelled through its signal before an answer began. */
export class Cancelled extends Error {
  override name = "Cancelled";
}

export interface PostOptions {
  /** The longest the server may wait on this request before answering, in ms. */
  serverWaitMs: number;
  /** Cancels the request unless its answer has begun (then it completes). */
  signal?: AbortSignal;
  /** Overrides the whole timeout (server wait plus margin), in ms. */
  timeoutMs?: number;
}

const RESET_CODES = new Set(["ECONNRESET", "EPIPE", "ECONNABORTED"]);

/** POSTs JSON to one server over keep-alive connections. */
export class Transport {
  readonly base: string;
  private readonly url: URL;
  private readonly agent: HttpAgent;
  private readonly request: typeof httpRequest;
  private readonly headers: Record<string, string>;
  private readonly marginMs: number;

  constructor(base: string, opts: HttpOptions) {
    this.base = base;
    this.url = new URL(base);
    const https = this.url.protocol === "https:";
    this.agent = https ? new HttpsAgent({ keepAlive: true, scheduling: "lifo" }) : new HttpAgent({ keepAlive: true, scheduling: "lifo" });
    this.request = https ? (httpsRequest as typeof httpRequest) : httpRequest;
    this.headers = { "content-type": "application/json", accept: "application/json" };
    if (opts.token !== undefined) this.headers["authorization"] = `Bearer ${opts.token}`;
    const margin = opts.timeoutMs ?? TIMEOUT_MARGIN_MS_DEFAULT;
    if (!Number.isFinite(margin) || margin < 0) throw new TypeError(`timeoutMs must be a non-negative number of milliseconds, got ${margin}`);
    this.marginMs = margin;
  }

  /** POSTs `body` (a value, or JSON text already made) and returns the parsed JSON reply (or `{}` for an empty one). */
  async post(path: string, body: unknown, opts: PostOptions): Promise<unknown> {
    return this.send("POST", path, body, opts);
  }

  /**
   * `method` `path` with `body` (a value, or JSON text; `undefined` sends
   * none): the parsed JSON reply, or `undefined` for a 404 when `notFound`
   * says one is an answer.
   */
  /**
   * One request. `notFound`: `true` answers a 404 with `undefined`,
   * `"body"` with a `NotFoundReply` holding the server's JSON, `false`
   * throws it like any other status.
   */
  async send(method: string, path: string, body: unknown, opts: PostOptions, notFound: boolean | "body" = false): Promise<unknown> {
    const text = body === undefined ? "" : typeof body === "string" ? body : JSON.stringify(body);
    const payload = Buffer.from(text, "utf8");
    const timeoutMs = opts.timeoutMs ?? opts.serverWaitMs + this.marginMs;
    const url = this.base + path;
    let res: { status: number; statusText: string; text: string };
    try {
      res = await this.once(method, path, payload, timeoutMs, opts.signal);
    } catch (err) {
      if (!(err instanceof ResetOnReuse)) throw this.noResponse(method, url, err);
      // The server closed an idle keep-alive connection as this request went
      // out on it: the request was never read. Once more on a new connection.
      try {
        res = await this.once(method, path, payload, timeoutMs, opts.signal);
      } catch (again) {
        throw this.noResponse(method, url, again instanceof ResetOnReuse ? again.cause : again);
      }
    }
    if (notFound === "body" && res.status === 404) {
      let doc: unknown = undefined;
      try {
        doc = JSON.parse(res.text);
      } catch {
        // Not JSON: the reply says nothing more.
      }
      return new NotFoundReply(doc !== null && typeof doc === "object" ? (doc as Record<string, unknown>) : {});
    }
    if (notFound && res.status === 404) return undefined;
    return parseReply(method, url, res.status, res.statusText, res.text);
  }

  private noResponse(method: string, url: string, err: unknown): unknown {
    if (err instanceof Cancelled) return err;
    const reason = err instanceof Error ? err.message : String(err);
    return new ServerUnavailable(`${method} ${url}: no response: ${reason}`, undefined, url, undefined, { cause: err });
  }

  private once(method: string, path: string, payload: Buffer, timeoutMs: number, signal: AbortSignal | undefined): Promise<{ status: number; statusText: string; text: string }> {
    return new Promise((resolve, reject) => {
      if (signal?.aborted) {
        reject(new Cancelled("cancelled before it was sent"));
        return;
      }
      let answered = false;
      let settled = false;
      const finish = (fn: () => void) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
        fn();
      };
      const req = this.request({
        protocol: this.url.protocol,
        hostname: this.url.hostname,
        port: this.url.port,
        path: this.url.pathname.replace(/\/+$/, "") + path,
        method,
        agent: this.agent,
        headers: { ...this.headers, "content-length": String(payload.length) },
      });
      const timer = setTimeout(() => {
        req.destroy(new Error(`timed out after ${timeoutMs} ms`));
      }, timeoutMs);
      const onAbort = () => {
        // An answer under way is read to its end: a claim's jobs are leased already.
        if (answered) return;
        finish(() => reject(new Cancelled("cancelled")));
        req.destroy();
      };
      signal?.addEventListener("abort", onAbort, { once: true });
      req.on("response", (res: IncomingMessage) => {
        answered = true;
        const chunks: Buffer[] = [];
        res.on("data", (c: Buffer) => chunks.push(c));
        res.on("end", () =>
          finish(() => resolve({ status: res.statusCode ?? 0, statusText: res.statusMessage ?? "", text: Buffer.concat(chunks).toString("utf8") })),
        );
        res.on("error", (err) => finish(() => reject(err)));
      });
      req.on("error", (err: NodeJS.ErrnoException) => {
        finish(() => reject(!answered && req.reusedSocket && RESET_CODES.has(err.code ?? "") ? new ResetOnReuse(err) : err));
      });
      req.end(payload);
    });
  }

  /** Closes the idle connections and refuses new requests' reuse of them. */
  close(): void {
    this.agent.destroy();
  }
}

class ResetOnReuse extends Error {
  constructor(override readonly cause: Error) {
    super(cause.message);
  }
}

/** A 404 answer and the JSON the server sent with it. */
export class NotFoundReply {
  constructor(readonly doc: Record<string, unknown>) {}
}

function parseReply(method: string, url: string, status: number, statusText: string, text: string): unknown {
  let parsed: unknown = {};
  if (text.length > 0) {
    try {
      parsed = JSON.parse(text);
    } catch {
      if (status >= 200 && status < 300) {
        throw new ShardqError(`${method} ${url}: ${status} with a body that is not JSON: ${text.slice(0, 200)}`, status, url);
      }
      parsed = undefined;
    }
  }
  if (status >= 200 && status < 300) return parsed;
  const doc = parsed !== null && typeof parsed === "object" ? (parsed as Record<string, unknown>) : {};
  const serverError = typeof doc["error"] === "string" ? doc["error"] : undefined;
  const detail = serverError ?? (text.length > 0 ? text.slice(0, 200) : statusText);
  const message = `${method} ${url}: ${status} ${statusText}: ${detail}`;
  if (status === 401 || status === 403) throw new Unauthorized(message, status, url, serverError);
  // A conflict of a schedule call is neither a cancel's nor a receipt's.
  if (status === 409 && isSchedule(url)) throw new ShardqError(message, status, url, serverError);
  if (status === 409 && method === "DELETE") {
    throw new JobNotCancelled(message, status, url, serverError, typeof doc["state"] === "string" ? doc["state"] : "");
  }
  if (status === 409 && method === "POST" && isKeyResume(url)) {
    const shard = typeof doc["shard"] === "string" ? doc["shard"] : undefined;
    throw new KeyNotResumed(message, status, url, serverError, typeof doc["state"] === "string" ? doc["state"] : "", shard);
  }
  if (status === 409 && !url.endsWith("/v1/jobs")) {
    const list = (v: unknown) => (Array.isArray(v) ? v.map(String) : []);
    throw new StaleReceipt(message, status, url, serverError, list(doc["stale"]), list(doc["not_owned"]));
  }
  if (retryableStatus(status)) throw new ServerUnavailable(message, status, url, serverError);
  if (status === 409) throw new ShardqError(message, status, url, serverError);
  throw new BadRequest(message, status, url, serverError);
}

/** Delay before retry `attempt` (0-based): exponential with full jitter, capped. */
export function backoffMs(attempt: number, baseMs: number, maxMs: number): number {
  const ceiling = Math.min(maxMs, baseMs * 2 ** attempt);
  return Math.round(ceiling / 2 + (Math.random() * ceiling) / 2);
}

/** Resolves after `ms`, or at once when `signal` aborts. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const done = () => {
      clearTimeout(t);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const t = setTimeout(done, ms);
    signal?.addEventListener("abort", done, { once: true });
  });
}
