// Real servers for the tests: `shardq serve` processes over one data dir,
// each given its share of the shards with `--max-shards`, keys chosen by
// the data dir's own map so a test can put work on one server only, a
// collecting logger, and waits for a condition with a bound.

import { spawn, type ChildProcess } from "node:child_process";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { Router, type Logger, type WorkerStats } from "../src/index.js";
import { initDataDir, Serve, writeTokens } from "./shardq-bin.js";

export const TOKEN = "test-token-0123456789abcdef";

export interface Cluster {
  dir: string;
  data: string;
  servers: Serve[];
  router: Router;
  /** `n` keys (`prefix-i`) that route to shards `server` runs. */
  keysOn(server: Serve, n: number, prefix?: string): Promise<string[]>;
  close(): Promise<void>;
}

/** `count` servers over one data dir of `shards` shards, each running `shards / count` of them. */
export async function cluster(shards: number, count: number, opts: { tokens?: boolean; args?: string[] } = {}): Promise<Cluster> {
  const d = initDataDir(shards);
  const tokens = opts.tokens === true ? writeTokens(d.dir, TOKEN) : undefined;
  const servers: Serve[] = [];
  try {
    // One at a time: each takes its share before the next one starts.
    for (let i = 0; i < count; i++) {
      const s = new Serve(d.data, shards, { maxShards: shards / count, tokens, readToken: tokens && TOKEN, args: opts.args });
      servers.push(s);
      await s.start();
    }
  } catch (err) {
    for (const s of servers) await s.stop();
    d.cleanup();
    throw err;
  }
  const router = Router.fromYaml(readFileSync(join(d.data, "shardmap.yaml"), "utf8"));
  return {
    dir: d.dir,
    data: d.data,
    servers,
    router,
    async keysOn(server, n, prefix = "key") {
      const owned = new Set(await server.owned());
      const keys: string[] = [];
      for (let i = 0; keys.length < n; i++) {
        const key = `${prefix}-${i}`;
        if (owned.has(router.route(key))) keys.push(key);
      }
      return keys;
    },
    async close() {
      for (const s of servers) await s.stop();
      d.cleanup();
    },
  };
}

export function collectingLogger(): Logger & { lines: string[] } {
  const lines: string[] = [];
  return { lines, info: (m) => lines.push(`info ${m}`), warn: (m) => lines.push(`warn ${m}`), error: (m) => lines.push(`error ${m}`) };
}

/** Resolves once `done()` holds, checking every 10 ms; throws `what` after `ms`. */
export async function until(done: () => boolean | Promise<boolean>, ms: number, what: string): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await done())) {
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

const SCRIPT = join(dirname(fileURLToPath(import.meta.url)), "worker-process.js");

/** A running `worker-process.js`, its output so far, and its exit. */
export interface WorkerProcess {
  child: ChildProcess;
  out: () => string;
  err: () => string;
  exited: Promise<number | string | null>;
  stats: () => WorkerStats | undefined;
}

export function workerProcess(env: Record<string, string>): WorkerProcess {
  const child = spawn(process.execPath, [SCRIPT], { env: { ...process.env, ...env }, stdio: ["ignore", "pipe", "pipe"] });
  let out = "";
  let err = "";
  child.stdout!.on("data", (d) => (out += d));
  child.stderr!.on("data", (d) => (err += d));
  const exited = new Promise<number | string | null>((r) => child.on("exit", (code, sig) => r(code ?? sig)));
  const stats = () => {
    const m = /^stats (.*)$/m.exec(out);
    return m === null ? undefined : (JSON.parse(m[1]!) as WorkerStats);
  };
  return { child, out: () => out, err: () => err, exited, stats };
}

