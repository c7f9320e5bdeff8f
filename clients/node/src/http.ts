/**
 * The HTTP layer shared by `Client` and `Worker`: JSON over `fetch`, bearer
 * tokens, errors that name the method, the URL and the server's message,
 * and which failures are worth retrying.
 */

/** A request to `shardq serve` that failed. */
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

  /** True for failures another try may fix: no response, 408, 429 and 5xx. */
  get retryable(): boolean {
    return this.status === undefined || this.status === 408 || this.status === 429 || this.status >= 500;
  }
}

export interface HttpOptions {
  token?: string;
  /** Per-request timeout in milliseconds (default 30000). */
  timeoutMs?: number;
  /** A `fetch` to use instead of the global one. */
  fetch?: typeof fetch;
}

export const DEFAULT_TIMEOUT_MS = 30_000;

/** Base URLs without a trailing slash; refuses an empty list and anything that is not http(s). */
export function normaliseUrls(urls: string | readonly string[], what: string): string[] {
  const list = typeof urls === "string" ? [urls] : [...urls];
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

/** POSTs `body` as JSON to `base + path` and returns the parsed JSON reply (or `{}` for an empty one). */
export async function postJson(base: string, path: string, body: unknown, opts: HttpOptions, timeoutMs?: number): Promise<unknown> {
  const url = base + path;
  const headers: Record<string, string> = { "content-type": "application/json", accept: "application/json" };
  if (opts.token !== undefined) headers["authorization"] = `Bearer ${opts.token}`;
  const doFetch = opts.fetch ?? fetch;
  let res: Response;
  let text: string;
  try {
    res = await doFetch(url, {
      method: "POST",
      headers,
      body: JSON.stringify(body),
      signal: AbortSignal.timeout(timeoutMs ?? opts.timeoutMs ?? DEFAULT_TIMEOUT_MS),
    });
    text = await res.text();
  } catch (err) {
    const reason = err instanceof Error ? (err.cause instanceof Error ? `${err.message}: ${err.cause.message}` : err.message) : String(err);
    throw new ShardqError(`POST ${url}: no response: ${reason}`, undefined, url, undefined, { cause: err });
  }
  let parsed: unknown = {};
  if (text.length > 0) {
    try {
      parsed = JSON.parse(text);
    } catch {
      if (res.ok) {
        throw new ShardqError(`POST ${url}: ${res.status} with a body that is not JSON: ${text.slice(0, 200)}`, res.status, url);
      }
      parsed = undefined;
    }
  }
  if (!res.ok) {
    const serverError =
      parsed !== null && typeof parsed === "object" && typeof (parsed as { error?: unknown }).error === "string"
        ? (parsed as { error: string }).error
        : undefined;
    const detail = serverError ?? (text.length > 0 ? text.slice(0, 200) : res.statusText);
    throw new ShardqError(`POST ${url}: ${res.status} ${res.statusText}: ${detail}`, res.status, url, serverError);
  }
  return parsed;
}

/** Delay before retry `attempt` (0-based): exponential with full jitter, capped. */
export function backoffMs(attempt: number, baseMs: number, maxMs: number): number {
  const ceiling = Math.min(maxMs, baseMs * 2 ** attempt);
  return Math.round(ceiling / 2 + (Math.random() * ceiling) / 2);
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
