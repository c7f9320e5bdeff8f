/**
 * Every routing algorithm and the compiled router, reproducing the Rust
 * crate `shardq-route` (`ring.rs`, `rendezvous.rs`, `jump.rs`, `slots.rs`,
 * `router.rs`) key for key.
 *
 * Routing rule: an override wins whatever the shard's state; otherwise the
 * map's algorithm picks among the `active` shards only, in map order. A
 * router is immutable and built from one map version.
 */

import { crc16Number, hashByName, utf8, type HashFn } from "./hashes.js";
import { lnCorrectlyRounded } from "./ln.js";
import { parseMap, SLOT_COUNT, type ShardMap, validateMap } from "./map.js";

function concat(a: Uint8Array, b: Uint8Array): Uint8Array {
  const out = new Uint8Array(a.length + b.length);
  out.set(a, 0);
  out.set(b, a.length);
  return out;
}

/**
 * The hash ring. Shard `name` of weight `w` owns the points
 * `h("{name}#{i}")` for `i < vnodes * w`; a key goes to the owner of the
 * first point strictly greater than `h(key)`, wrapping to the first point.
 * Equal points belong to the shard *last* in map order (among the shards
 * given).
 */
export class Ring {
  /** Distinct points, ascending. */
  readonly points: BigUint64Array;
  /** `owners[i]`: position (in the list given) of the shard owning `points[i]`. */
  readonly owners: Uint32Array;

  constructor(hash: HashFn, vnodes: number, shards: ReadonlyArray<readonly [string, number]>) {
    const owner = new Map<bigint, number>();
    shards.forEach(([name, weight], pos) => {
      const count = vnodes * weight;
      for (let i = 0; i < count; i++) {
        // A later shard overwrites an equal point: the tie rule.
        owner.set(hash(utf8(`${name}#${i}`)), pos);
      }
    });
    this.points = BigUint64Array.from(owner.keys()).sort();
    this.owners = Uint32Array.from(this.points, (p) => owner.get(p) as number);
  }

  /** Position of the owner of hash `h`. */
  lookup(h: bigint): number {
    // First index whose point is > h (Python's bisect.bisect), wrapping.
    let lo = 0;
    let hi = this.points.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if ((this.points[mid] as bigint) <= h) lo = mid + 1;
      else hi = mid;
    }
    return this.owners[lo === this.points.length ? 0 : lo] as number;
  }
}

const TWO_POW_52 = 4503599627370496; // 2^52, exact in a double

/**
 * The weighted-rendezvous score of a shard of `weight` whose hash is `x`:
 * `weight / -ln(((x >> 12) + 0.5) / 2^52)`. `x >> 12` has 52 bits, so the
 * conversion, the `+ 0.5` and the division by 2^52 are exact; then `ln`,
 * the negation and the division are IEEE double operations. `ln` is
 * correctly rounded here (see `ln.ts`), not `Math.log`.
 */
export function weightedScore(weight: number, x: bigint): number {
  const u = (Number(x >> 12n) + 0.5) / TWO_POW_52;
  return weight / -lnCorrectlyRounded(u);
}

/**
 * Rendezvous (highest random weight) over `h("{name}:{key}")`, ties to the
 * earliest shard. Weighted (logarithmic method) only when the weights given
 * differ, so equal weights give exactly the unweighted answer.
 */
export class Rendezvous {
  private readonly prefixes: Uint8Array[];
  private readonly weights: number[];
  readonly weighted: boolean;

  constructor(
    private readonly hash: HashFn,
    shards: ReadonlyArray<readonly [string, number]>,
  ) {
    this.prefixes = shards.map(([name]) => utf8(`${name}:`));
    this.weights = shards.map(([, w]) => w);
    this.weighted = new Set(this.weights).size > 1;
  }

  /** Position of the owner of `key` (its UTF-8 bytes). */
  lookup(key: Uint8Array): number {
    let best = 0;
    if (this.weighted) {
      let bestScore = Number.NEGATIVE_INFINITY;
      this.prefixes.forEach((prefix, i) => {
        const score = weightedScore(this.weights[i] as number, this.hash(concat(prefix, key)));
        if (score > bestScore) {
          bestScore = score;
          best = i;
        }
      });
    } else {
      let bestX = -1n;
      this.prefixes.forEach((prefix, i) => {
        const x = this.hash(concat(prefix, key));
        if (x > bestX) {
          bestX = x;
          best = i;
        }
      });
    }
    return best;
  }
}

const JUMP_LCG_MULTIPLIER = 2862933555777941757n;
const U64 = (1n << 64n) - 1n;
const TWO_POW_31 = 2147483648;

/** Lamping-Veach jump consistent hash with the paper's (and Guava's) 64-bit LCG. `buckets` >= 1. */
export function jump(key: bigint, buckets: number): number {
  if (!Number.isInteger(buckets) || buckets < 1 || buckets > 0xffffffff) {
    throw new RangeError(`jump: buckets must be an integer from 1 to 2^32-1, got ${buckets}`);
  }
  let k = BigInt.asUintN(64, key);
  let b = -1;
  let j = 0;
  while (j < buckets) {
    b = j;
    k = (k * JUMP_LCG_MULTIPLIER + 1n) & U64;
    j = Math.trunc((b + 1) * (TWO_POW_31 / (Number(k >> 33n) + 1)));
  }
  return b;
}

const OPEN_BRACE = 0x7b;
const CLOSE_BRACE = 0x7d;

/** The bytes Redis Cluster hashes: between the first `{` and the next `}` when non-empty, else the whole key. */
export function hashtag(key: Uint8Array): Uint8Array {
  const open = key.indexOf(OPEN_BRACE);
  if (open >= 0) {
    const close = key.indexOf(CLOSE_BRACE, open + 1);
    if (close > open + 1) return key.subarray(open + 1, close);
  }
  return key;
}

/** The Redis Cluster slot of `key`: CRC16-XMODEM of its hashtag mod 16384. */
export function slot(key: Uint8Array | string): number {
  const bytes = typeof key === "string" ? utf8(key) : key;
  return crc16Number(hashtag(bytes)) % SLOT_COUNT;
}

/** A shard map compiled for lookups; immutable, one per map version. */
export class Router {
  readonly map: ShardMap;
  private readonly hash: HashFn;
  /** Map indexes of the active shards, in map order. */
  private readonly active: number[];
  readonly ring: Ring | undefined;
  private readonly hrw: Rendezvous | undefined;
  /** Slot -> map index (the `slots` algorithm only). */
  private readonly slotOwners: Uint32Array | undefined;

  constructor(map: ShardMap) {
    validateMap(map);
    this.map = map;
    this.hash = hashByName(map.hash);
    this.active = [];
    map.shards.forEach((s, i) => {
      if (s.state === "active") this.active.push(i);
    });
    const pairs = this.active.map((i) => {
      const s = map.shards[i]!;
      return [s.name, s.weight] as const;
    });
    this.ring = map.algorithm === "ring" ? new Ring(this.hash, map.vnodes, pairs) : undefined;
    this.hrw =
      map.algorithm === "rendezvous" || map.algorithm === "slots" ? new Rendezvous(this.hash, pairs) : undefined;
    if (map.algorithm === "slots") {
      const explicit = new Int32Array(SLOT_COUNT).fill(-1);
      // Only active shards' ranges count; a warming shard's wait for it to go active.
      this.active.forEach((mapIndex, pos) => {
        for (const r of map.shards[mapIndex]!.slots) {
          explicit.fill(pos, r.start, r.end + 1);
        }
      });
      const owners = new Uint32Array(SLOT_COUNT);
      for (let s = 0; s < SLOT_COUNT; s++) {
        const pos = explicit[s]! >= 0 ? explicit[s]! : this.hrw!.lookup(utf8(String(s)));
        owners[s] = this.active[pos]!;
      }
      this.slotOwners = owners;
    }
  }

  /** Parses, validates and compiles a YAML shard map. */
  static fromYaml(text: string): Router {
    return new Router(parseMap(text));
  }

  /** The map version. */
  get version(): bigint {
    return this.map.version;
  }

  /** Map index of the shard the algorithm picks for `key`, ignoring overrides. */
  computedIndex(key: string): number {
    const data = utf8(key);
    switch (this.map.algorithm) {
      case "modulo":
        return this.active[Number(this.hash(data) % BigInt(this.active.length))]!;
      case "ring":
        return this.active[this.ring!.lookup(this.hash(data))]!;
      case "rendezvous":
        return this.active[this.hrw!.lookup(data)]!;
      case "jump":
        return this.active[jump(this.hash(data), this.active.length)]!;
      case "slots":
        return this.slotOwners![slot(data)]!;
    }
  }

  /** Map index of the shard owning `key` (overrides first). */
  routeIndex(key: string): number {
    const override = this.map.overrides.get(key);
    if (override !== undefined) {
      const i = this.map.shards.findIndex((s) => s.name === override);
      if (i >= 0) return i;
    }
    return this.computedIndex(key);
  }

  /** Name of the shard the algorithm picks for `key`, ignoring overrides. */
  computed(key: string): string {
    return this.map.shards[this.computedIndex(key)]!.name;
  }

  /** Name of the shard owning `key`: its override if any, else the computed shard. */
  route(key: string): string {
    return this.map.shards[this.routeIndex(key)]!.name;
  }
}
