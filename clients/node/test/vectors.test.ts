// The router against the shared routing vectors (testdata/routing-vectors.json,
// written by the Rust generator): every hash, hashtag, slot, jump bucket,
// weighted score (bit for bit) and routed key, in every map.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { HASH_NAMES, HASHES, Ring, Router, hashtag, jump, slot, utf8, weightedScore } from "../src/index.js";

// dist/test/ -> clients/node -> repository root
const here = dirname(fileURLToPath(import.meta.url));
const VECTORS_PATH = join(here, "..", "..", "..", "..", "testdata", "routing-vectors.json");

interface MapCase {
  name: string;
  algorithm: string;
  hash: string;
  yaml: string;
  owners: [string, string][];
  ring_distinct_points?: number;
}
interface Vectors {
  generated_by: string;
  format_version: number;
  hashes: Record<string, string>[];
  slots: { key: string; hashtag: string; slot: number }[];
  jump: { key: string; buckets: number; bucket: number }[];
  weighted_scores: { weight: number; x: string; score_bits: string }[];
  maps: MapCase[];
}

const V: Vectors = JSON.parse(readFileSync(VECTORS_PATH, "utf8"));

/** Collects every mismatch so one run reports them all. */
class Checks {
  failures: string[] = [];
  count = 0;
  check(what: string, got: unknown, want: unknown): void {
    this.count++;
    if (got !== want) this.failures.push(`${what}: got ${String(got)}, want ${String(want)}`);
  }
  done(): void {
    assert.equal(
      this.failures.length,
      0,
      `${this.failures.length} of ${this.count} checks failed:\n${this.failures.slice(0, 20).join("\n")}`,
    );
    assert.ok(this.count > 0, "no check ran");
  }
}

function doubleBitsHex(x: number): string {
  const buf = Buffer.alloc(8);
  buf.writeDoubleBE(x);
  return buf.toString("hex");
}

test("the vectors file says how it was made", () => {
  assert.match(V.generated_by, /^cargo run -p shardq-route --example gen_vectors/);
  assert.equal(V.format_version, 1);
});

for (const name of HASH_NAMES) {
  test(`hash ${name} of every key`, () => {
    const c = new Checks();
    assert.ok(V.hashes.length >= 40);
    for (const row of V.hashes) {
      const key = row["key"] as string;
      c.check(`${name}(${JSON.stringify(key).slice(0, 40)}, ${key.length} chars)`, HASHES[name](utf8(key)), BigInt(row[name] as string));
    }
    c.done();
  });
}

test("slots and hashtags", () => {
  const c = new Checks();
  assert.ok(V.slots.length >= 200);
  const dec = new TextDecoder();
  for (const row of V.slots) {
    c.check(`hashtag(${JSON.stringify(row.key)})`, dec.decode(hashtag(utf8(row.key))), row.hashtag);
    c.check(`slot(${JSON.stringify(row.key)})`, slot(row.key), row.slot);
  }
  c.done();
});

test("jump buckets, Guava's golden values first", () => {
  const c = new Checks();
  for (const row of V.jump) {
    c.check(`jump(${row.key}, ${row.buckets})`, jump(BigInt(row.key), row.buckets), row.bucket);
  }
  c.done();
});

test("weighted scores bit for bit", () => {
  const c = new Checks();
  for (const row of V.weighted_scores) {
    c.check(`weightedScore(${row.weight}, ${row.x})`, doubleBitsHex(weightedScore(row.weight, BigInt(row.x))), row.score_bits);
  }
  c.done();
});

for (const m of V.maps) {
  test(`map ${m.name} routes every key`, () => {
    const c = new Checks();
    const router = Router.fromYaml(m.yaml);
    c.check("algorithm", router.map.algorithm, m.algorithm);
    c.check("hash", router.map.hash, m.hash);
    if (m.ring_distinct_points !== undefined) {
      c.check("ring distinct points", router.ring?.points.length, m.ring_distinct_points);
    }
    assert.ok(m.owners.length >= 200, `${m.name} lists only ${m.owners.length} keys`);
    for (const [key, want] of m.owners) {
      c.check(`route(${JSON.stringify(key).slice(0, 40)})`, router.route(key), want);
    }
    c.done();
  });
}

test("every algorithm and hash is covered by the vectors", () => {
  assert.deepEqual(new Set(V.maps.map((m) => m.algorithm)), new Set(["modulo", "ring", "rendezvous", "jump", "slots"]));
  assert.deepEqual(new Set(V.maps.map((m) => m.hash)), new Set(HASH_NAMES));
  const ties = V.maps.find((m) => m.name === "ring-crc16-v2048-ties");
  assert.ok(ties?.ring_distinct_points !== undefined && ties.ring_distinct_points < 4 * 2048, "the crc16 ring must have ties");
});
