// Properties of the router that the vectors do not spell out: the tie rule,
// overrides against states, the hashes' published values, and map errors
// that name the field and the value.

import assert from "node:assert/strict";
import { test } from "node:test";

import { MapError, Rendezvous, Ring, Router, crc16, fnv1a64, jump, murmur3, parseMap, slot, utf8, weightedScore, xxh3, xxh64 } from "../src/index.js";

test("ring ties go to the later shard", () => {
  const ring = new Ring(() => 7n, 4, [["a", 1], ["b", 1], ["c", 1]]);
  assert.deepEqual([...ring.points], [7n]);
  for (const h of [0n, 7n, (1n << 64n) - 1n]) assert.equal(ring.lookup(h), 2);
});

test("ring lookup takes the first point strictly above the hash, wrapping", () => {
  let n = 0n;
  const values = [10n, 20n, 30n];
  const ring = new Ring(() => values[Number(n++)]!, 1, [["a", 1], ["b", 1], ["c", 1]]);
  assert.equal(ring.lookup(9n), 0);
  assert.equal(ring.lookup(10n), 1);
  assert.equal(ring.lookup(29n), 2);
  assert.equal(ring.lookup(30n), 0);
});

test("unweighted rendezvous ties go to the earliest shard", () => {
  const hrw = new Rendezvous(() => 5n, [["a", 1], ["b", 1]]);
  assert.equal(hrw.weighted, false);
  assert.equal(hrw.lookup(utf8("k")), 0);
  assert.equal(new Rendezvous(() => 5n, [["a", 1], ["b", 2]]).weighted, true);
});

test("published hash values", () => {
  assert.equal(xxh64(utf8("")), 0xef46db3751d8e999n);
  assert.equal(xxh3(utf8("")), 0x2d06800538d394c2n);
  assert.equal(fnv1a64(utf8("")), 0xcbf29ce484222325n);
  assert.equal(fnv1a64(utf8("a")), 0xaf63dc4c8601ec8cn);
  assert.equal(murmur3(utf8("")), 0n);
  assert.equal(crc16(utf8("123456789")), 0x31c3n);
  assert.equal(slot("{user1000}.following"), slot("{user1000}.followers"));
  assert.equal(slot("foo{hash_tag}"), 2515);
});

test("jump: Guava's golden values and bad bucket counts", () => {
  assert.deepEqual([0n, 1n, 2n, 3n, 4n].map((k) => jump(k, 100)), [0, 55, 62, 8, 45]);
  assert.equal(jump(10863919174838991n, 11), 6);
  assert.equal(jump(2n, 100001), 80343);
  assert.throws(() => jump(1n, 0), /buckets must be an integer from 1.*got 0/);
});

test("weighted scores are finite at the extremes", () => {
  for (const x of [0n, 1n, (1n << 64n) - 1n, (1n << 63n) - 1n]) {
    const s = weightedScore(1, x);
    assert.ok(Number.isFinite(s) && s > 0, `x=${x} score=${s}`);
  }
  assert.ok(weightedScore(1, (1n << 64n) - 1n) > weightedScore(1, 0n));
});

test("overrides win in every state; the algorithm picks only active shards", () => {
  const router = Router.fromYaml(
    "version: 3\nalgorithm: modulo\nshards:\n  - { name: a }\n  - { name: w, state: warming }\n  - { name: d, state: draining }\noverrides: { k-w: w, k-d: d, '42': d }\n",
  );
  assert.equal(router.route("k-w"), "w");
  assert.equal(router.route("k-d"), "d");
  assert.equal(router.route("42"), "d");
  assert.equal(router.computed("k-w"), "a");
  for (let i = 0; i < 50; i++) assert.equal(router.route(`t-${i}`), "a");
  assert.equal(router.version, 3n);
});

test("numeric override keys are read as strings", () => {
  const map = parseMap("version: 1\nshards: [{name: a}, {name: b}]\noverrides: {123: b}\n");
  assert.equal(map.overrides.get("123"), "b");
});

test("YAML 1.2: yes and no are strings, as in the Rust parser", () => {
  const map = parseMap("version: 1\nshards: [{name: a}, {name: b}]\noverrides: {yes: b, no: a}\n");
  assert.equal(map.overrides.get("yes"), "b");
  assert.equal(map.overrides.get("no"), "a");
});

test("bad maps name the field and the value", () => {
  const cases: [string, string][] = [
    ["version: [", "not valid YAML"],
    ["- 1", "must be a YAML mapping"],
    ["shards: [{name: a}]", "missing field `version`"],
    ["version: x\nshards: [{name: a}]", '`version` has invalid value "x"'],
    ["version: 1.5\nshards: [{name: a}]", "`version` has invalid value 1.5"],
    ["version: -1\nshards: [{name: a}]", "`version` has invalid value -1"],
    ["version: 1", "missing field `shards`"],
    ["version: 1\nshards: []", "at least one shard"],
    ['version: 1\nshards: [{name: ""}]', "must not be empty"],
    ["version: 1\nshards: [{name: ../x}]", '`shards[0].name` has invalid value "../x"'],
    ["version: 1\nshards: [{name: ..}]", "must not be `.` or `..`"],
    [`version: 1\nshards: [{name: ${"a".repeat(65)}}]`, "65 bytes"],
    ["version: 1\nshards: [{name: a}, {name: a}]", 'duplicate shard name "a"'],
    ["version: 1\nshards: [{name: a, weight: 0}]", "`shards[0].weight` has invalid value 0"],
    ["version: 1\nshards: [{name: a, weight: -2}]", "`shards[0].weight` has invalid value -2"],
    ["version: 1\nshards: [{name: a, weight: 1.5}]", "`shards[0].weight` has invalid value 1.5"],
    ["version: 1\nshards: [{name: a, weight: heavy}]", 'invalid value "heavy"'],
    ["version: 1\nalgorithm: maglev\nshards: [{name: a}]", 'unknown algorithm "maglev"'],
    ["version: 1\nhash: sha1\nshards: [{name: a}]", 'unknown hash "sha1"'],
    ["version: 1\nshards: [{name: a, state: asleep}]", 'unknown state "asleep"'],
    ["version: 1\nshards: [{name: a}]\noverrides: {t: b}", 'names unknown shard "b"'],
    ["version: 1\nshards: [{name: a, state: warming}]", "no shard is active"],
    ["version: 1\nshards: [{name: a, colour: red}]", "unknown field"],
    ["version: 1\nshard: [{name: a}]", "unknown field"],
    ["version: 1\nvnodes: 0\nshards: [{name: a}]", "`vnodes` has invalid value 0"],
    ['version: 1\nshards: [{name: a, slots: ["0-16384"]}]', '"0-16384"'],
    ['version: 1\nshards: [{name: a, slots: ["0-10"]}, {name: b, slots: [5]}]', "slot 5 is assigned to both"],
    ["version: 1\nalgorithm: ring\nvnodes: 4096\nshards: [{name: a, weight: 1000}, {name: b, weight: 1000}, {name: c, weight: 1000}, {name: d, weight: 1000}, {name: e, weight: 1000}]", "exceeds the ring bound"],
  ];
  for (const [yaml, want] of cases) {
    assert.throws(
      () => parseMap(yaml),
      (err: unknown) => {
        assert.ok(err instanceof MapError, `map ${JSON.stringify(yaml)}: not a MapError: ${String(err)}`);
        assert.ok(err.message.includes(want), `map ${JSON.stringify(yaml)}: error ${JSON.stringify(err.message)} lacks ${JSON.stringify(want)}`);
        return true;
      },
    );
  }
});
