// A small in-process stand-in for `shardq serve` (node:http on a free
// loopback port) that checks every request's shape against the HTTP
// contract, keeps per-key queues with one run per key, receipts, leases and
// dedup ids, and can be told to answer a path with given statuses.

import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

export interface Recorded {
  path: string;
  body: Record<string, unknown>;
  authorization: string | undefined;
  status: number;
}

interface StoredJob {
  id: number;
  key: string;
  payload?: string;
  payloadB64?: string;
  attempt: number;
  maxAttempts: number;
  readyAt: number;
}

interface Run {
  job: StoredJob;
  leaseUntil: number;
  fence: number;
}

export class FakeServer {
  url = "";
  readonly requests: Recorded[] = [];
  /** Statuses to answer the next requests of a path with (before doing anything). */
  readonly inject = new Map<string, number[]>();
  /** Milliseconds to wait before answering the next requests of a path (a server waiting on a paused key). */
  readonly delay = new Map<string, number[]>();
  /** Fixed answers to paths outside the worker's contract (the admin routes), by path as sent. */
  readonly answers = new Map<string, { status: number; body: unknown }>();
  /** Statuses to answer *after* doing the work (a lost reply). */
  readonly injectAfter = new Map<string, number[]>();
  readonly queues = new Map<string, StoredJob[]>();
  readonly runs = new Map<string, Run>();
  readonly inFlight = new Set<string>();
  readonly acked: StoredJob[] = [];
  readonly dead: StoredJob[] = [];
  readonly staleReplies: string[] = [];
  private readonly dedup = new Map<string, { id: number; shard: string; key: string }>();
  private nextId = 1;
  private fence = 100;
  private server: Server | undefined;

  constructor(
    readonly shard: string,
    readonly token?: string,
  ) {}

  async start(): Promise<this> {
    this.server = createServer((req, res) => {
      this.handle(req, res).catch((err: unknown) => this.reply(res, "?", {}, req, 500, { error: String(err) }));
    });
    await new Promise<void>((resolve) => this.server!.listen(0, "127.0.0.1", resolve));
    const { port } = this.server.address() as AddressInfo;
    this.url = `http://127.0.0.1:${port}`;
    return this;
  }

  async close(): Promise<void> {
    this.server?.closeAllConnections();
    await new Promise<void>((resolve) => this.server?.close(() => resolve()));
  }

  count(path: string): number {
    return this.requests.filter((r) => r.path === path).length;
  }

  private reply(res: ServerResponse, path: string, body: Record<string, unknown>, req: IncomingMessage, status: number, out: unknown): void {
    this.requests.push({ path, body, authorization: req.headers.authorization, status });
    res.writeHead(status, { "content-type": "application/json" });
    res.end(JSON.stringify(out));
  }

  private async handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const chunks: Buffer[] = [];
    for await (const c of req) chunks.push(c as Buffer);
    const path = req.url ?? "";
    let body: Record<string, unknown>;
    try {
      body = JSON.parse(Buffer.concat(chunks).toString("utf8"));
    } catch {
      return this.reply(res, path, {}, req, 400, { error: "body is not JSON" });
    }
    const send = (status: number, out: unknown) => this.reply(res, path, body, req, status, out);
    if (req.method !== "POST") return send(405, { error: `method ${req.method}` });
    if (req.headers["content-type"] !== "application/json") return send(400, { error: "content-type must be application/json" });
    if (this.token !== undefined) {
      const auth = req.headers.authorization;
      if (auth === undefined) return send(401, { error: "missing bearer token" });
      if (auth !== `Bearer ${this.token}`) return send(403, { error: "wrong token" });
    }
    const fixed = this.answers.get(path);
    if (fixed !== undefined) return send(fixed.status, fixed.body);
    const wait = this.delay.get(path)?.shift();
    if (wait !== undefined) await new Promise((r) => setTimeout(r, wait));
    const injected = this.inject.get(path)?.shift();
    if (injected !== undefined) return send(injected, { error: `injected ${injected}` });
    const after = (status: number, out: unknown) => {
      const late = this.injectAfter.get(path)?.shift();
      if (late !== undefined) return send(late, { error: `injected ${late} after the work` });
      send(status, out);
    };
    const problem = (msg: string) => send(400, { error: msg });
    const isInt = (v: unknown, min: number) => typeof v === "number" && Number.isInteger(v) && v >= min;
    const keysOnly = (o: Record<string, unknown>, allowed: string[]) => Object.keys(o).filter((k) => !allowed.includes(k));

    switch (path) {
      case "/v1/jobs": {
        if (keysOnly(body, ["jobs"]).length > 0 || !Array.isArray(body["jobs"]) || body["jobs"].length === 0) {
          return problem("expected {jobs: [...]}");
        }
        const out: unknown[] = [];
        for (const [i, j] of (body["jobs"] as Record<string, unknown>[]).entries()) {
          const extra = keysOnly(j, ["key", "payload", "payload_b64", "delay_ms", "max_attempts", "dedup_id"]);
          if (extra.length > 0) return problem(`jobs[${i}]: unknown field ${extra[0]}`);
          if (typeof j["key"] !== "string") return problem(`jobs[${i}].key must be a string`);
          if (("payload" in j) === ("payload_b64" in j)) return problem(`jobs[${i}]: exactly one of payload, payload_b64`);
          if ("payload" in j && typeof j["payload"] !== "string") return problem(`jobs[${i}].payload must be a string`);
          if ("payload_b64" in j && (typeof j["payload_b64"] !== "string" || !/^[A-Za-z0-9+/]*={0,2}$/.test(j["payload_b64"] as string))) {
            return problem(`jobs[${i}].payload_b64 must be base64`);
          }
          if ("delay_ms" in j && !isInt(j["delay_ms"], 0)) return problem(`jobs[${i}].delay_ms`);
          if ("max_attempts" in j && !isInt(j["max_attempts"], 1)) return problem(`jobs[${i}].max_attempts`);
          if ("dedup_id" in j && typeof j["dedup_id"] !== "string") return problem(`jobs[${i}].dedup_id`);
          const dedupId = j["dedup_id"] as string | undefined;
          const seen = dedupId === undefined ? undefined : this.dedup.get(dedupId);
          if (seen) {
            out.push({ ...seen, duplicate: true });
            continue;
          }
          const job: StoredJob = {
            id: this.nextId++,
            key: j["key"] as string,
            attempt: 0,
            maxAttempts: (j["max_attempts"] as number | undefined) ?? 3,
            readyAt: Date.now() + ((j["delay_ms"] as number | undefined) ?? 0),
          };
          if ("payload" in j) job.payload = j["payload"] as string;
          else job.payloadB64 = j["payload_b64"] as string;
          const q = this.queues.get(job.key) ?? [];
          q.push(job);
          this.queues.set(job.key, q);
          const result = { id: job.id, shard: this.shard, key: job.key };
          if (dedupId !== undefined) this.dedup.set(dedupId, result);
          out.push({ ...result, duplicate: false });
        }
        return after(200, { jobs: out });
      }
      case "/v1/claim": {
        if (keysOnly(body, ["worker", "max", "wait_ms", "lease_ms", "timeout_ms"]).length > 0) return problem("unknown field in claim");
        if (typeof body["worker"] !== "string" || !isInt(body["max"], 1) || !isInt(body["wait_ms"], 0) || !isInt(body["lease_ms"], 1)) {
          return problem("claim needs worker, max >= 1, wait_ms, lease_ms");
        }
        if (body["timeout_ms"] !== undefined && (!isInt(body["timeout_ms"], 1) || (body["timeout_ms"] as number) > 604_800_000)) {
          return problem("timeout_ms: 1 to 604800000 ms");
        }
        const deadline = Date.now() + (body["wait_ms"] as number);
        // As the real server: a poll whose client went away claims nothing more.
        let gone = false;
        res.on("close", () => (gone = true));
        for (;;) {
          if (gone) return;
          const jobs = this.claim(body["max"] as number, body["lease_ms"] as number);
          if (jobs.length > 0 || Date.now() >= deadline) return after(200, { jobs });
          await new Promise((r) => setTimeout(r, 5));
        }
      }
      case "/v1/ack": {
        if (keysOnly(body, ["receipts"]).length > 0 || !Array.isArray(body["receipts"]) || body["receipts"].some((r) => typeof r !== "string")) {
          return problem("ack needs receipts: [string]");
        }
        const receipts = body["receipts"] as string[];
        // As the real server: the valid receipts take effect, a 409 lists the others.
        const stale: string[] = [];
        for (const r of receipts) {
          if (!this.current(r)) {
            this.staleReplies.push(`ack ${r}`);
            stale.push(r);
            continue;
          }
          const run = this.runs.get(r)!;
          this.runs.delete(r);
          this.inFlight.delete(run.job.key);
          this.queues.get(run.job.key)!.shift();
          this.acked.push(run.job);
        }
        const acked = receipts.length - stale.length;
        if (stale.length > 0) return send(409, { error: `${stale.length} stale receipts`, acked, stale, not_owned: [] });
        return after(200, { acked });
      }
      case "/v1/fail": {
        if (keysOnly(body, ["receipt", "reason", "retry_in_ms"]).length > 0 || typeof body["receipt"] !== "string" || typeof body["reason"] !== "string") {
          return problem("fail needs receipt and reason");
        }
        if ("retry_in_ms" in body && !isInt(body["retry_in_ms"], 0)) return problem("retry_in_ms");
        const r = body["receipt"] as string;
        if (!this.current(r)) {
          this.staleReplies.push(`fail ${r}`);
          return send(409, { error: `stale receipt ${r}` });
        }
        const run = this.runs.get(r)!;
        this.runs.delete(r);
        this.inFlight.delete(run.job.key);
        if (run.job.attempt >= run.job.maxAttempts) {
          this.queues.get(run.job.key)!.shift();
          this.dead.push(run.job);
        } else {
          run.job.readyAt = Date.now() + ((body["retry_in_ms"] as number | undefined) ?? 0);
        }
        return after(200, {});
      }
      case "/v1/extend": {
        if (keysOnly(body, ["receipts", "lease_ms"]).length > 0 || !Array.isArray(body["receipts"]) || !isInt(body["lease_ms"], 1)) {
          return problem("extend needs receipts and lease_ms");
        }
        const stale: string[] = [];
        for (const r of body["receipts"] as string[]) {
          if (!this.current(r)) {
            this.staleReplies.push(`extend ${r}`);
            stale.push(r);
            continue;
          }
          this.runs.get(r)!.leaseUntil = Date.now() + (body["lease_ms"] as number);
        }
        const extended = (body["receipts"] as string[]).length - stale.length;
        if (stale.length > 0) return send(409, { error: `${stale.length} stale receipts`, extended, stale, not_owned: [] });
        return after(200, { extended });
      }
      case "/v1/stale": {
        if (keysOnly(body, ["receipts"]).length > 0 || !Array.isArray(body["receipts"])) return problem("stale needs receipts");
        // Read-only: a lapsed run still counts until a claim or extend ends it, as on the server.
        const stale = (body["receipts"] as string[]).filter((r) => !this.runs.has(r));
        return after(200, { stale, not_owned: [] });
      }
      default:
        return send(404, { error: `no route ${path}` });
    }
  }

  /** True when `receipt` names a current run whose lease has not lapsed; a lapsed run is ended. */
  private current(receipt: string): boolean {
    const run = this.runs.get(receipt);
    if (run === undefined) return false;
    if (Date.now() > run.leaseUntil) {
      this.runs.delete(receipt);
      this.inFlight.delete(run.job.key);
      return false;
    }
    return true;
  }

  private claim(max: number, leaseMs: number): unknown[] {
    for (const r of [...this.runs.keys()]) this.current(r);
    const out: unknown[] = [];
    const now = Date.now();
    for (const [key, q] of this.queues) {
      if (out.length >= max) break;
      const head = q[0];
      if (head === undefined || this.inFlight.has(key) || head.readyAt > now) continue;
      head.attempt++;
      const fence = ++this.fence;
      const receipt = `${this.shard}:${head.id}:${fence}`;
      this.runs.set(receipt, { job: head, leaseUntil: now + leaseMs, fence });
      this.inFlight.add(key);
      const job: Record<string, unknown> = {
        id: head.id,
        shard: this.shard,
        key,
        attempt: head.attempt,
        max_attempts: head.maxAttempts,
        receipt,
        fence,
        lease_expires_ms: now + leaseMs,
      };
      if (head.payload !== undefined) job["payload"] = head.payload;
      else job["payload_b64"] = head.payloadB64;
      out.push(job);
    }
    return out;
  }
}
