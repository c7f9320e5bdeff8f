// The README's examples run as written: the servers are started as its
// `sh` block says (data dir, tokens file, `--max-shards`), and every `ts`
// block is type-checked against the package's declarations and run, in
// order, as a program of its own; a block that runs a worker runs until the
// jobs the others enqueued are done, then gets SIGTERM and must drain.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdirSync, readFileSync, symlinkSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import ts from "typescript";

import { Serve, initDataDir } from "../test-support/shardq-bin.js";
import { until } from "../test-support/cluster.js";

const PACKAGE = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const README = readFileSync(join(PACKAGE, "README.md"), "utf8");

function blocks(lang: string): string[] {
  return [...README.matchAll(new RegExp("^```" + lang + "\\n([\\s\\S]*?)^```", "gm"))].map((m) => m[1]!);
}

test("the README's ts examples type-check and run against two servers started as it says", { timeout: 120_000 }, async () => {
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
    // The app: its own package.json, and the package installed as a link.
    mkdirSync(join(d.dir, "node_modules"));
    symlinkSync(PACKAGE, join(d.dir, "node_modules", "shardq"), "dir");
    writeFileSync(join(d.dir, "package.json"), JSON.stringify({ type: "module" }));
    const examples = blocks("ts");
    assert.ok(examples.length >= 3, "the README has its examples");
    const files = examples.map((code, i) => {
      const path = join(d.dir, `example-${i}.ts`);
      writeFileSync(path, code);
      return path;
    });
    const options: ts.CompilerOptions = {
      module: ts.ModuleKind.NodeNext,
      moduleResolution: ts.ModuleResolutionKind.NodeNext,
      target: ts.ScriptTarget.ES2022,
      strict: true,
      noEmit: true,
      skipLibCheck: true,
      types: ["node"],
      typeRoots: [join(PACKAGE, "node_modules", "@types")],
    };
    const program = ts.createProgram(files, options);
    const problems = ts.getPreEmitDiagnostics(program).map((x) => ts.flattenDiagnosticMessageText(x.messageText, "\n"));
    assert.deepEqual(problems, [], "the examples type-check");

    const env = { ...process.env, SHARDQ_URLS: servers.map((s) => s.url).join(","), SHARDQ_TOKEN: token };
    const workers: { out: () => string; exited: Promise<number | null>; kill: () => void }[] = [];
    for (const [i, code] of examples.entries()) {
      const js = ts.transpileModule(code, { compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 } }).outputText;
      const path = join(d.dir, `example-${i}.mjs`);
      writeFileSync(path, js);
      const child = spawn(process.execPath, [path], { cwd: d.dir, env, stdio: ["ignore", "pipe", "pipe"] });
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
    w.kill();
    assert.equal(await w.exited, 0, w.out());
    assert.match(w.out(), /drained: 3 acked, 0 failed/);
    assert.match(w.out(), /attempt=1\/5/, "maxAttempts reaches the handler");
  } finally {
    for (const s of servers) await s.stop();
    d.cleanup();
  }
});
