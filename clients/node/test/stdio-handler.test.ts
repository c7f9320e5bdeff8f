// examples/handlers/node/handler.mjs speaks the stdio protocol: one result
// line per job line, in order, only `receipt`, `ok` and `reason`, and it
// exits 0 when stdin closes.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const HANDLER = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..", "examples", "handlers", "node", "handler.mjs");

function job(n: number, extra: Record<string, unknown>) {
  return { id: `s0:${n}`, shard: "s0", key: `k-${n}`, attempt: 1, receipt: `s0:${n}.${1000 + n}`, fence: 1000 + n, lease_expires_ms: Date.now() + 30000, ...extra };
}

function run(input: string, closeStdin = true) {
  const child = spawn(process.execPath, [HANDLER], { stdio: ["pipe", "pipe", "pipe"], env: { ...process.env, SHARDQ_STDIO: "1", SHARDQ_SLOT: "0" } });
  let out = "";
  let err = "";
  child.stdout.on("data", (d) => (out += d));
  child.stderr.on("data", (d) => (err += d));
  child.stdin.write(input);
  if (closeStdin) child.stdin.end();
  const exited = new Promise<number | string | null>((resolve) => child.on("exit", (code, sig) => resolve(code ?? sig)));
  return { child, exited, out: () => out, err: () => err };
}

test("answers every job line in order and exits 0 when stdin closes", async () => {
  const jobs = [
    job(1, { payload: JSON.stringify({ sleep_ms: 60 }) }),
    job(2, { payload_b64: Buffer.from([0xff, 0x00, 0x0a]).toString("base64") }),
    job(3, { payload: JSON.stringify({ fail: "upstream said 503" }) }),
    job(4, { payload: "plain text" }),
  ];
  // All lines at once: the handler must still answer them one by one, in order.
  const h = run(jobs.map((j) => JSON.stringify(j) + "\n").join(""));
  assert.equal(await h.exited, 0, h.err());
  const results = h.out().trimEnd().split("\n").map((l) => JSON.parse(l));
  assert.deepEqual(results, [
    { receipt: "s0:1.1001", ok: true },
    { receipt: "s0:2.1002", ok: true },
    { receipt: "s0:3.1003", ok: false, reason: "upstream said 503" },
    { receipt: "s0:4.1004", ok: true },
  ]);
  assert.match(h.err(), /handled s0:2 key="k-2" attempt=1 bytes=3/);
});

test("each result is written before stdin closes (flushed per line)", async () => {
  const h = run(JSON.stringify(job(7, { payload: "x" })) + "\n", false);
  const deadline = Date.now() + 5000;
  while (!h.out().includes("\n") && Date.now() < deadline) await new Promise((r) => setTimeout(r, 10));
  assert.deepEqual(JSON.parse(h.out()), { receipt: "s0:7.1007", ok: true });
  h.child.stdin.end();
  assert.equal(await h.exited, 0);
});

test("a line that is not JSON ends the handler with an error on stderr", async () => {
  const h = run("not json\n");
  assert.equal(await h.exited, 1);
  assert.match(h.err(), /stdin line is not JSON/);
  assert.equal(h.out(), "");
});
