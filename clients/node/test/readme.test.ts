// The README's examples run as written: the servers are started as its
// `sh` block says (data dir, tokens file, `--max-shards`); every `ts` block
// is written to the file the README names it by, in an app that has only
// what the README's install lines put there (the package, and the dev
// packages its `npm install -D` line names), compiled with the README's own
// `tsc` line (so `--strict`, and no type from anywhere the README does not
// mention), and run, in order, as a program of its own. The block that runs
// a worker runs until the jobs the others enqueued are done, then gets
// SIGTERM: it must drain and its process exit at once, since nothing may
// hold the event loop once `run` resolved.

import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { mkdirSync, readFileSync, symlinkSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { Serve, initDataDir } from "../test-support/shardq-bin.js";
import { until } from "../test-support/cluster.js";

const PACKAGE = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const README = readFileSync(join(PACKAGE, "README.md"), "utf8");

function blocks(lang: string): string[] {
  return [...README.matchAll(new RegExp("^```" + lang + "\\n([\\s\\S]*?)^```", "gm"))].map((m) => m[1]!);
}

/** The `ts` blocks with the file name the text before each gives it (`` (`work.ts` ``). */
function tsExamples(): { name: string; code: string }[] {
  const out: { name: string; code: string }[] = [];
  let from = 0;
  for (const m of README.matchAll(/^```ts\n([\s\S]*?)^```/gm)) {
    const names = [...README.slice(from, m.index).matchAll(/\(`([\w-]+\.ts)`/g)].map((n) => n[1]!);
    assert.ok(names.length > 0, `the text before the ts block at offset ${m.index} names its file`);
    out.push({ name: names[names.length - 1]!, code: m[1]! });
    from = m.index + m[0].length;
  }
  return out;
}

/** A worker gets this long from SIGTERM to its exit: well under the drain timeout, a claim's timeout (15 s) and an extend's (10 s). */
const EXIT_AFTER_SIGTERM_MS = 5_000;

test("the README's ts examples compile with its tsc --strict line, run against two servers started as it says, and its worker exits within 5 s of SIGTERM", { timeout: 120_000 }, async () => {
  const setup = blocks("sh").find((b) => b.includes("shardq serve"))!;
  const shards = Number(/shardq init --data \.\/q --shards (\d+)/.exec(setup)![1]);
  const tokensLine = /printf '([^']*)\\n' > tokens/.exec(setup)![1]!;
  const maxShards = [...setup.matchAll(/--max-shards (\d+)/g)].map((m) => Number(m[1]));
  const token = /SHARDQ_TOKEN=(\S+)/.exec(setup)![1]!;
  assert.equal(maxShards.length, 2);
  assert.ok(Buffer.byteLength(token) >= 16);

  const d = initDataDir(shards);
  writeFileSync(join(d.dir, "tokens"), tokensLine + "\n");
  const servers = maxShards.map((m) => new Serve(d.data, shards, { tokens: join(d.dir, "tokens"), readToken: token, maxShards: m }));
  try {
    for (const s of servers) await s.start();
    // The app: its own package.json, the package installed as a link, and
    // the dev packages of the README's `npm install -D` line (linked from
    // this package's own): no other type is in reach of its compiler.
    const shell = blocks("sh").join("\n");
    const devPackages = /^npm install -D ([^#\n]+)/m.exec(shell)![1]!.trim().split(/\s+/);
    assert.ok(devPackages.includes("typescript"), "the README installs typescript for TypeScript users");
    mkdirSync(join(d.dir, "node_modules"));
    symlinkSync(PACKAGE, join(d.dir, "node_modules", "shardq"), "dir");
    for (const name of devPackages) {
      mkdirSync(dirname(join(d.dir, "node_modules", name)), { recursive: true });
      symlinkSync(join(PACKAGE, "node_modules", name), join(d.dir, "node_modules", name), "dir");
    }
    writeFileSync(join(d.dir, "package.json"), JSON.stringify({ type: "module" }));
    const examples = tsExamples();
    assert.ok(examples.length >= 3, "the README has its examples");
    for (const { name, code } of examples) writeFileSync(join(d.dir, name), code);

    // The README's type-check line, run as written but for `--noEmit`: the
    // same check, and the JavaScript that `node` then runs.
    const tscLine = /^npx tsc (.+)$/m.exec(shell)![1]!.trim().split(/\s+/);
    assert.ok(tscLine.includes("--strict") && tscLine.includes("--noEmit"), tscLine.join(" "));
    assert.deepEqual(tscLine.filter((a) => a.endsWith(".ts")).sort(), examples.map((e) => e.name).sort(), "the tsc line checks every example");
    const tsc = spawnSync(process.execPath, [join(d.dir, "node_modules", "typescript", "bin", "tsc"), ...tscLine.filter((a) => a !== "--noEmit")], {
      cwd: d.dir,
      encoding: "utf8",
    });
    assert.equal(tsc.status, 0, `the examples type-check with tsc ${tscLine.join(" ")}:\n${tsc.stdout}${tsc.stderr}`);

    const env = { ...process.env, SHARDQ_URLS: servers.map((s) => s.url).join(","), SHARDQ_TOKEN: token };
    const workers: { out: () => string; exited: Promise<number | null>; kill: () => void }[] = [];
    for (const [i, { name, code }] of examples.entries()) {
      const child = spawn(process.execPath, [name.replace(/\.ts$/, ".js")], { cwd: d.dir, env, stdio: ["ignore", "pipe", "pipe"] });
      let out = "";
      let err = "";
      child.stdout.on("data", (x) => (out += x));
      child.stderr.on("data", (x) => (err += x));
      const exited = new Promise<number | null>((r) => child.on("exit", (c) => r(c)));
      if (code.includes(".run(")) {
        workers.push({ out: () => out + err, exited, kill: () => child.kill("SIGTERM") });
        continue;
      }
      assert.equal(await exited, 0, `example ${i}:\n${code}\n${err}`);
      assert.notEqual(out.trim(), "", `example ${i} printed its result`);
      if (code.includes("enqueueMany")) assert.equal(out.trim(), "true 2", "the re-sent job is a duplicate");
      if (code.includes("Router")) assert.match(out.trim(), /^shard-\d+ shard-\d+$/);
    }
    assert.equal(workers.length, 1);
    const w = workers[0]!;
    await until(() => (w.out().match(/^ran /gm) ?? []).length === 3, 30_000, `the worker example to run the 3 jobs:\n${w.out()}`);
    await servers[0]!.settle({ ready: 0, delayed: 0, in_flight: 0, dead: 0 });
    // Idle now, its long polls out on both servers.
    const t0 = Date.now();
    w.kill();
    assert.equal(await w.exited, 0, w.out());
    const took = Date.now() - t0;
    assert.ok(took < EXIT_AFTER_SIGTERM_MS, `the worker example exited ${took} ms after SIGTERM:\n${w.out()}`);
    assert.match(w.out(), /drained: 3 acked, 0 failed/);
    assert.match(w.out(), /attempt=1\/5/, "maxAttempts reaches the handler");
  } finally {
    for (const s of servers) await s.stop();
    d.cleanup();
  }
});
