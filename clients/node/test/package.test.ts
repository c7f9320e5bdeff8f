// Packaging: `npm pack` of a checkout without dist/ builds the code and
// packs it (prepare), the exports map serves `import` and `require()`
// (require(esm) on the supported Node versions), and internal helpers
// stay internal.

import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import { cpSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const PACKAGE = join(dirname(fileURLToPath(import.meta.url)), "..", "..");

test("npm pack of a checkout builds and packs the code, and no tests", { timeout: 120_000 }, () => {
  const dir = mkdtempSync(join(tmpdir(), "shardq-node-pack-"));
  try {
    const copy = join(dir, "pkg");
    mkdirSync(copy);
    for (const f of ["package.json", "package-lock.json", "tsconfig.json", "README.md", "src", "test", "test-support"]) cpSync(join(PACKAGE, f), join(copy, f), { recursive: true });
    symlinkSync(join(PACKAGE, "node_modules"), join(copy, "node_modules"), "dir");
    const out = execFileSync("npm", ["pack", "--json", "--loglevel=error", "--pack-destination", dir], { cwd: copy, encoding: "utf8" });
    const files = (JSON.parse(out.slice(out.indexOf("["))) as { files: { path: string }[] }[])[0]!.files.map((f) => f.path);
    for (const f of ["dist/src/index.js", "dist/src/index.d.ts", "dist/src/worker.js", "dist/src/client.d.ts", "package.json", "README.md"]) {
      assert.ok(files.includes(f), `${f} packed: ${files.join(" ")}`);
    }
    assert.deepEqual(files.filter((f) => f.startsWith("dist/test") || f.includes("fake-server")), []);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("require() and import load the package through its exports map; helpers are not exported", () => {
  const dir = mkdtempSync(join(tmpdir(), "shardq-node-require-"));
  try {
    mkdirSync(join(dir, "node_modules"));
    symlinkSync(PACKAGE, join(dir, "node_modules", "shardq"), "dir");
    const check = `
      const ok = typeof q.Client === "function" && typeof q.Worker === "function" && typeof q.Router === "function"
        && q.postJson === undefined && q.sleep === undefined && q.backoffMs === undefined && q.Transport === undefined
        && ["BadRequest", "Unauthorized", "ServerUnavailable", "StaleReceipt"].every((n) => new q[n]("m", 400, "u", undefined, [], []) instanceof q.ShardqError);
      if (!ok) throw new Error("unexpected exports: " + Object.keys(q).join(" "));
      process.stdout.write("ok\\n");`;
    writeFileSync(join(dir, "use.cjs"), `const q = require("shardq");${check}`);
    writeFileSync(join(dir, "use.mjs"), `import * as q from "shardq";${check}`);
    writeFileSync(join(dir, "deep.cjs"), `require("shardq/dist/src/http.js");`);
    for (const f of ["use.cjs", "use.mjs"]) {
      const r = spawnSync(process.execPath, [f], { cwd: dir, encoding: "utf8" });
      assert.equal(r.status, 0, `${f} on Node ${process.version}: ${r.stderr}`);
      assert.equal(r.stdout, "ok\n");
      assert.doesNotMatch(r.stderr, /ExperimentalWarning.*require/i, "require(esm) without a warning flag");
    }
    const deep = spawnSync(process.execPath, ["deep.cjs"], { cwd: dir, encoding: "utf8" });
    assert.notEqual(deep.status, 0);
    assert.match(deep.stderr, /ERR_PACKAGE_PATH_NOT_EXPORTED/);
    const pkg = JSON.parse(readFileSync(join(PACKAGE, "package.json"), "utf8")) as { engines: { node: string }; scripts: Record<string, string> };
    assert.equal(pkg.engines.node, "^20.19.0 || >=22.12.0");
    assert.match(pkg.scripts["prepare"] ?? "", /build/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
