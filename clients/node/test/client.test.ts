// Client against the fake server: request shapes, generated dedup ids,
// retries across URLs with the same dedup ids, and errors that are not retried.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { BadRequest, Client, KeyNotResumed, ServerUnavailable, ShardqError, StaleReceipt, Unauthorized } from "../src/index.js";
import { FakeServer } from "../test-support/fake-server.js";

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;
let a: FakeServer;
let b: FakeServer;

before(async () => {
  a = await new FakeServer("shard-a", "s3cret").start();
  b = await new FakeServer("shard-b", "s3cret").start();
});
after(async () => {
  await a.close();
  await b.close();
});

test("enqueue sends the contract's body with a bearer token and a generated dedup id", async () => {
  const client = new Client(a.url + "/", { token: "s3cret" });
  const r = await client.enqueue("t-1", "hello", { delayMs: 0, maxAttempts: 5 });
  assert.equal(r.shard, "shard-a");
  assert.equal(r.key, "t-1");
  assert.equal(r.duplicate, false);
  assert.equal(typeof r.id, "number");
  const req = a.requests.at(-1)!;
  assert.equal(req.path, "/v1/jobs");
  assert.equal(req.authorization, "Bearer s3cret");
  const sent = (req.body["jobs"] as Record<string, unknown>[])[0]!;
  assert.deepEqual(Object.keys(sent).sort(), ["dedup_id", "delay_ms", "key", "max_attempts", "payload"]);
  assert.equal(sent["payload"], "hello");
  assert.equal(sent["max_attempts"], 5);
  assert.match(sent["dedup_id"] as string, UUID);
  assert.equal(r.dedupId, sent["dedup_id"]);
});

test("enqueueMany: bytes go as payload_b64, each job gets its own dedup id, a given one is kept", async () => {
  const client = new Client([a.url], { token: "s3cret" });
  const bytes = Uint8Array.from([0, 255, 10, 13]);
  const results = await client.enqueueMany([
    { key: "k", payload: bytes },
    { key: "k", payload: "two" },
    { key: "k", payload: "three", dedupId: "mine-1" },
  ]);
  const sent = a.requests.at(-1)!.body["jobs"] as Record<string, unknown>[];
  assert.equal(sent[0]!["payload_b64"], Buffer.from(bytes).toString("base64"));
  assert.equal("payload" in sent[0]!, false);
  assert.notEqual(sent[0]!["dedup_id"], sent[1]!["dedup_id"]);
  assert.equal(sent[2]!["dedup_id"], "mine-1");
  assert.deepEqual(results.map((r) => r.duplicate), [false, false, false]);
  const again = await client.enqueue("k", "three", { dedupId: "mine-1" });
  assert.equal(again.duplicate, true);
  assert.equal(again.id, results[2]!.id);
});

test("a 5xx is retried on the next URL with the same dedup ids", async () => {
  a.inject.set("/v1/jobs", [503]);
  const before = b.count("/v1/jobs");
  const client = new Client([a.url, b.url], { token: "s3cret", backoffMs: 1 });
  const r = await client.enqueue("t-2", "x");
  assert.equal(r.shard, "shard-b");
  assert.equal(b.count("/v1/jobs"), before + 1);
  const failed = a.requests.at(-1)!;
  assert.equal(failed.status, 503);
  const firstTry = (failed.body["jobs"] as Record<string, unknown>[])[0]!["dedup_id"];
  const secondTry = (b.requests.at(-1)!.body["jobs"] as Record<string, unknown>[])[0]!["dedup_id"];
  assert.equal(firstTry, secondTry);
});

test("a lost reply is retried and the server's dedup answers duplicate", async () => {
  a.injectAfter.set("/v1/jobs", [502]);
  const client = new Client([a.url], { token: "s3cret", backoffMs: 1 });
  const queued = a.queues.get("t-lost")?.length ?? 0;
  const r = await client.enqueue("t-lost", "once");
  assert.equal(r.duplicate, true);
  assert.equal(a.queues.get("t-lost")!.length, queued + 1, "the job is stored once");
});

test("retries are bounded and the error names the tries and the last failure", async () => {
  a.inject.set("/v1/jobs", [500, 500, 500, 500]);
  const before = a.count("/v1/jobs");
  const client = new Client([a.url], { token: "s3cret", retries: 2, backoffMs: 1 });
  await assert.rejects(client.enqueue("t-3", "x"), (err: unknown) => {
    assert.ok(err instanceof ShardqError);
    assert.match(err.message, /after 3 tries over 1 server\(s\).*500/);
    return true;
  });
  assert.equal(a.count("/v1/jobs"), before + 3);
  a.inject.delete("/v1/jobs");
});

test("no server answering is retried, then reported with the URL", async () => {
  const client = new Client(["http://127.0.0.1:9"], { retries: 1, backoffMs: 1 });
  await assert.rejects(client.enqueue("t", "x"), /after 2 tries.*127\.0\.0\.1:9\/v1\/jobs: no response/);
});

test("400, 401 and 403 are not retried and carry the server's error", async () => {
  a.inject.set("/v1/jobs", [400]);
  const before = a.count("/v1/jobs");
  const client = new Client([a.url, b.url], { token: "s3cret", backoffMs: 1 });
  await assert.rejects(client.enqueue("t", "x"), (err: unknown) => {
    assert.ok(err instanceof ShardqError);
    assert.equal(err.status, 400);
    assert.equal(err.serverError, "injected 400");
    assert.ok(err.message.includes(`${a.url}/v1/jobs`), err.message);
    return true;
  });
  assert.equal(a.count("/v1/jobs"), before + 1);
  await assert.rejects(new Client([a.url]).enqueue("t", "x"), (e: unknown) => e instanceof ShardqError && e.status === 401 && /missing bearer token/.test(e.message));
  await assert.rejects(new Client([a.url], { token: "nope" }).enqueue("t", "x"), (e: unknown) => e instanceof ShardqError && e.status === 403);
});

test("timeoutMs is a margin over the server's own wait: an enqueue the server holds (a paused key) is waited for", async () => {
  a.delay.set("/v1/jobs", [700]);
  const before = a.count("/v1/jobs");
  const client = new Client([a.url], { token: "s3cret", timeoutMs: 50, retries: 0 });
  const r = await client.enqueue("t-paused", "x");
  assert.equal(r.duplicate, false);
  assert.equal(a.count("/v1/jobs"), before + 1, "one try, not timed out");
});

test("errors are classes under ShardqError; the retries' failure is ServerUnavailable with a cause per server", async () => {
  a.inject.set("/v1/jobs", [503]);
  b.inject.set("/v1/jobs", [502]);
  const client = new Client([a.url, b.url], { token: "s3cret", retries: 1, backoffMs: 1 });
  await assert.rejects(client.enqueue("t", "x"), (err: unknown) => {
    assert.ok(err instanceof ServerUnavailable && err instanceof ShardqError);
    assert.equal(err.causes.length, 2);
    assert.match(err.causes.join("\n"), /503[\s\S]*502/);
    return true;
  });
  a.inject.set("/v1/jobs", [400]);
  await assert.rejects(client.enqueue("t", "x"), (err: unknown) => err instanceof BadRequest && err instanceof ShardqError && err.status === 400);
  await assert.rejects(new Client([a.url], { token: "bad" }).enqueue("t", "x"), (err: unknown) => err instanceof Unauthorized && err.status === 403);
  client.close();
});

test("bad arguments name the field and the value", async () => {
  assert.throws(() => new Client([]), /at least one server URL/);
  assert.throws(() => new Client(["ftp://x"]), /"ftp:\/\/x" must use http/);
  const client = new Client([a.url], { token: "s3cret" });
  await assert.rejects(client.enqueueMany([{ key: "k", payload: "x", delayMs: -1 }]), /jobs\[0\]\.delayMs must be a non-negative integer, got -1/);
  await assert.rejects(client.enqueueMany([{ key: "k", payload: 5 as unknown as string }]), /jobs\[0\]\.payload must be a string or a Uint8Array, got number/);
  await assert.rejects(client.enqueueMany([{ key: "k", payload: "x", maxAttempts: 0 }]), /maxAttempts must be at least 1/);
});

test("a schedule call answered 503 goes to the next server, and one answered 409 is a plain ShardqError", async () => {
  const trigger = "/v1/schedules/beat/trigger";
  const backfill = "/v1/schedules/beat/backfill";
  a.answers.set(trigger, { status: 503, body: { error: "the store is unavailable", kind: "retryable" } });
  b.answers.set(trigger, { status: 200, body: { id: "beat", shard: "shard-b", job: "shard-b:7" } });
  a.answers.set(backfill, { status: 409, body: { error: "busy", kind: "conflict" } });
  const client = new Client([a.url, b.url], { token: "s3cret" });
  const [seenA, seenB] = [a.requests.length, b.requests.length];
  try {
    assert.deepEqual(await client.triggerSchedule("beat"), { id: "beat", shard: "shard-b", job: "shard-b:7" });
    await assert.rejects(client.backfillSchedule("beat", 1000, "2026-03-30T00:00:00Z"), (err: unknown) => {
      assert.ok(err instanceof ShardqError && err.constructor === ShardqError, String(err));
      assert.equal(err.status, 409);
      return true;
    });
    assert.deepEqual(
      a.requests.slice(seenA).map((r) => [r.path, r.body]),
      [
        [trigger, {}],
        [backfill, { from: 1000, to: "2026-03-30T00:00:00Z" }],
      ],
    );
    assert.deepEqual(
      b.requests.slice(seenB).map((r) => r.path),
      [trigger],
      "a 409 is an answer: no other server is asked",
    );
  } finally {
    for (const p of [trigger, backfill]) {
      a.answers.delete(p);
      b.answers.delete(p);
    }
    client.close();
  }
});

test("a key resume while the key moves rejects with KeyNotResumed and asks no other server", async () => {
  // The real server answers so while a rebalance has sealed the key
  // (crates/shardq-server/tests/api.rs seals one by hand); nothing changed.
  const path = "/v1/keys/k%2F1/resume";
  a.answers.set(path, {
    status: 409,
    body: { error: 'key: "k/1" is moving to another shard now; nothing changed', kind: "conflict", state: "moving", shard: "shard-a" },
  });
  b.answers.set(path, { status: 200, body: { key: "k/1", shard: "shard-b", resumed: true, back_off: { until_ms: 1, jobs: ["shard-b:1"] } } });
  const client = new Client([a.url, b.url], { token: "s3cret" });
  const [seenA, seenB] = [a.requests.length, b.requests.length];
  try {
    await assert.rejects(client.resumeKey("k/1"), (err: unknown) => {
      assert.ok(err instanceof KeyNotResumed && err instanceof ShardqError, String(err));
      assert.ok(!(err instanceof StaleReceipt), "not a receipt's refusal");
      assert.deepEqual([err.status, err.state, err.shard], [409, "moving", "shard-a"]);
      assert.match(err.serverError ?? "", /moving/);
      return true;
    });
    assert.deepEqual(
      a.requests.slice(seenA).map((r) => [r.path, r.body]),
      [[path, {}]],
    );
    assert.equal(b.requests.length, seenB, "a 409 is an answer: no other server is asked");
  } finally {
    a.answers.delete(path);
    b.answers.delete(path);
    client.close();
  }
});
