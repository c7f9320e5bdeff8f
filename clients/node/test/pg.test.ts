// enqueuePg against a recording client: the SQL names the schema's
// function with one cast per payload form, the values go as parameters
// (never spliced into the text), and a bad schema is refused before any
// query. The function itself is tested against a real PostgreSQL by the
// Rust and Python suites.

import assert from "node:assert/strict";
import { test } from "node:test";

import { enqueuePg, type PgQueryable } from "../src/index.js";

function recorder(): PgQueryable & { calls: Array<[string, unknown[]]> } {
  const calls: Array<[string, unknown[]]> = [];
  return {
    calls,
    async query(text: string, values: unknown[]) {
      calls.push([text, values]);
      return { rows: [{ id: String(calls.length) }] };
    },
  };
}

test("enqueuePg sends each payload form with its cast, as parameters", async () => {
  const c = recorder();
  assert.equal(await enqueuePg(c, "tenant-42", "text payload"), "1");
  assert.equal(await enqueuePg(c, "k'; drop table t; --", new Uint8Array([0xff, 0]), { dedupId: "order-7", maxAttempts: 2 }), "2");
  assert.equal(await enqueuePg(c, "k", { n: 1 }, { delayMs: 5, schema: "app_q" }), "3");
  assert.match(c.calls[0]![0], /^SELECT shardq\.enqueue\(\$1::text, \$2::text, /);
  assert.deepEqual(c.calls[0]![1], ["tenant-42", "text payload", null, null, null]);
  assert.match(c.calls[1]![0], /\$2::bytea/);
  assert.deepEqual(c.calls[1]![1], ["k'; drop table t; --", Buffer.from([0xff, 0]), "order-7", null, 2]);
  assert.match(c.calls[2]![0], /^SELECT app_q\.enqueue\(\$1::text, \$2::jsonb/);
  assert.deepEqual(c.calls[2]![1], ["k", '{"n":1}', null, 5, null]);
});

test("enqueuePg refuses a schema that is not a plain identifier before any query", async () => {
  const c = recorder();
  await assert.rejects(enqueuePg(c, "k", "p", { schema: "x; drop table t" }), TypeError);
  assert.equal(c.calls.length, 0);
});
