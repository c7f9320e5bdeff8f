// The real shardq binary for end-to-end tests: $SHARDQ_BIN when it is set
// (used as is, never built), else target/debug/shardq, built with `cargo
// build -p shardq` from the repository root when it is missing (a failed
// build fails the test, it never skips); data dirs made with `shardq init`,
// and `shardq serve` on a free loopback port.

import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { accessSync, constants, existsSync, mkdtempSync, openSync, closeSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

/** The repository root (this file runs from clients/node/dist/test-support/). */
export const REPO_ROOT = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..");

let binary: string | undefined;

/** `$SHARDQ_BIN` when set (it must be an executable file), else the debug binary, built once when it is missing. */
export function shardqBinary(): string {
  if (binary !== undefined) return binary;
  const given = process.env["SHARDQ_BIN"];
  if (given !== undefined && given !== "") {
    binary = checkedExecutable(given);
    return binary;
  }
  const target = process.env["CARGO_TARGET_DIR"] ?? join(REPO_ROOT, "target");
  const path = join(target, "debug", "shardq");
  if (!existsSync(path)) {
    const out = spawnSync("cargo", ["build", "-q", "-p", "shardq"], { cwd: REPO_ROOT, encoding: "utf8" });
    if (out.error !== undefined) throw new Error(`cargo build -p shardq could not start (is cargo on PATH?): ${out.error.message}`);
    if (out.status !== 0) throw new Error(`cargo build -p shardq failed in ${REPO_ROOT}:\n${out.stderr}`);
    if (!existsSync(path)) throw new Error(`cargo build -p shardq succeeded but ${path} does not exist`);
  }
  binary = path;
  return path;
}

function checkedExecutable(path: string): string {
  let isFile: boolean;
  try {
    isFile = statSync(path).isFile();
  } catch (err) {
    throw new Error(`SHARDQ_BIN=${path}: no such file (${(err as Error).message}); unset it to build target/debug/shardq`);
  }
  if (!isFile) throw new Error(`SHARDQ_BIN=${path} is not a regular file`);
  try {
    accessSync(path, constants.X_OK);
  } catch {
    throw new Error(`SHARDQ_BIN=${path} is not executable`);
  }
  return path;
}

/** Runs the binary to completion; throws with its stderr when it fails. */
export function shardq(args: string[], input?: string): string {
  const out = spawnSync(shardqBinary(), args, { encoding: "utf8", input, timeout: 60_000 });
  if (out.status !== 0) throw new Error(`shardq ${args.join(" ")} exited ${out.status ?? out.signal}:\n${out.stderr}`);
  return out.stdout;
}

/** A temporary directory holding a data dir `q` made by `shardq init`. */
export function initDataDir(shards: number): { dir: string; data: string; cleanup: () => void } {
  const dir = mkdtempSync(join(tmpdir(), "shardq-node-e2e-"));
  const data = join(dir, "q");
  shardq(["init", "--data", data, "--shards", String(shards)]);
  return { dir, data, cleanup: () => rmSync(dir, { recursive: true, force: true }) };
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const addr = s.address();
      const port = typeof addr === "object" && addr !== null ? addr.port : 0;
      s.close(() => resolve(port));
    });
  });
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

export interface ServeOptions {
  /** A tokens file (`--tokens`); `status()` then sends `readToken`. */
  tokens?: string;
  readToken?: string;
  /** `--max-shards`: start() waits until this server owns that many shards. */
  maxShards?: number;
  /** Further flags. */
  args?: string[];
}

/** A produce-only token of the tokens file `writeTokens` writes. */
export const PRODUCE_ONLY_TOKEN = "produce-only-0123456789abcdef";

/** A tokens file in `dir` granting `token` every role (and `PRODUCE_ONLY_TOKEN` only produce). */
export function writeTokens(dir: string, token: string): string {
  const path = join(dir, "tokens");
  writeFileSync(path, `# test tokens\n${token} produce,work,read,admin\n${PRODUCE_ONLY_TOKEN} produce\n`);
  return path;
}

/** `shardq serve` over `data` on a free loopback port. */
export class Serve {
  url = "";
  private child: ChildProcess | undefined;
  private logPath = "";

  constructor(
    readonly data: string,
    readonly shards: number,
    readonly opts: ServeOptions = {},
  ) {}

  async start(timeoutMs = 30_000): Promise<this> {
    const port = await freePort();
    this.url = `http://127.0.0.1:${port}`;
    this.logPath = `${this.data}.serve-${port}.log`;
    const log = openSync(this.logPath, "a");
    const args = ["serve", "--data", this.data, "--listen", `127.0.0.1:${port}`];
    if (this.opts.tokens !== undefined) args.push("--tokens", this.opts.tokens);
    if (this.opts.maxShards !== undefined) args.push("--max-shards", String(this.opts.maxShards));
    args.push(...(this.opts.args ?? []));
    this.child = spawn(shardqBinary(), args, { stdio: ["ignore", log, log] });
    closeSync(log);
    const owns = this.opts.maxShards ?? this.shards;
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      if (this.child.exitCode !== null) throw new Error(`shardq serve exited ${this.child.exitCode}:\n${this.log()}`);
      const owned = await this.owned().catch(() => undefined);
      if (owned !== undefined && owned.length === owns) return this;
      if (Date.now() > deadline) throw new Error(`shardq serve on ${this.url} not ready (owning ${owns} shards) after ${timeoutMs} ms:\n${this.log()}`);
      await sleep(20);
    }
  }

  /** The shards this server runs (`GET /readyz`), undefined until it is ready. */
  async owned(): Promise<string[] | undefined> {
    const r = await fetch(`${this.url}/readyz`, { signal: AbortSignal.timeout(1000) });
    const doc = (await r.json()) as { ready?: boolean; owned?: string[] };
    return r.status === 200 && doc.ready === true ? (doc.owned ?? []) : undefined;
  }

  async status(): Promise<{ totals: Record<string, number>; failed: string[] }> {
    const headers: Record<string, string> = {};
    if (this.opts.readToken !== undefined) headers["authorization"] = `Bearer ${this.opts.readToken}`;
    const r = await fetch(`${this.url}/v1/status`, { headers, signal: AbortSignal.timeout(5000) });
    if (r.status !== 200) throw new Error(`GET /v1/status: ${r.status} ${await r.text()}`);
    return (await r.json()) as { totals: Record<string, number>; failed: string[] };
  }

  /** Resolves once `status().totals` equals `totals`, polling; throws with the last totals after `ms`. */
  async settle(totals: Record<string, number>, ms = 20_000): Promise<void> {
    const deadline = Date.now() + ms;
    let last: Record<string, number> = {};
    while (Date.now() < deadline) {
      last = (await this.status()).totals;
      if (Object.keys({ ...last, ...totals }).every((k) => last[k] === totals[k])) return;
      await sleep(25);
    }
    throw new Error(`status totals ${JSON.stringify(last)}, wanted ${JSON.stringify(totals)} within ${ms} ms`);
  }

  log(): string {
    try {
      return readFileSync(this.logPath, "utf8").slice(-4000);
    } catch {
      return "";
    }
  }

  /** SIGTERM, then SIGKILL after `timeoutMs`; resolves with the exit code or signal. */
  async stop(timeoutMs = 20_000): Promise<number | string | null> {
    const child = this.child;
    if (child === undefined || child.exitCode !== null || child.signalCode !== null) return child?.exitCode ?? null;
    const exited = new Promise<number | string | null>((r) => child.once("exit", (code, sig) => r(code ?? sig)));
    child.kill("SIGTERM");
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    try {
      return await exited;
    } finally {
      clearTimeout(timer);
    }
  }
}
