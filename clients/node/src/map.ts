/**
 * The versioned shard map in YAML, parsed and validated with the same rules
 * and bounds as the Rust crate `shardq-route` (`src/map.rs`). Both read
 * YAML 1.2 (so `yes`/`no` are strings and `0755` a decimal number, unlike
 * PyYAML). Parsing does no I/O: callers hand it text.
 */

import { parseDocument } from "yaml";

import { HASH_NAMES, type HashName } from "./hashes.js";

/** Number of Redis Cluster hash slots. */
export const SLOT_COUNT = 16384;
/** Longest shard name, in bytes. */
export const SHARD_NAME_BYTES_MAX = 64;
/** Largest shard weight. */
export const WEIGHT_MAX = 1000;
/** Largest number of shards in one map. */
export const SHARDS_MAX = 4096;
/** Default ring points per unit of weight. */
export const VNODES_DEFAULT = 256;
/** Largest `vnodes` value. */
export const VNODES_MAX = 4096;
/** Largest number of points a ring may hold (`vnodes * total active weight`). */
export const RING_POINTS_MAX = 1 << 24;

export type Algorithm = "modulo" | "ring" | "rendezvous" | "jump" | "slots";
export const ALGORITHMS: readonly Algorithm[] = ["modulo", "ring", "rendezvous", "jump", "slots"];

export type ShardState = "active" | "warming" | "draining";
export const SHARD_STATES: readonly ShardState[] = ["active", "warming", "draining"];

/** An inclusive range of slots. */
export interface SlotRange {
  start: number;
  end: number;
}

export interface Shard {
  name: string;
  url?: string;
  weight: number;
  state: ShardState;
  /** Explicit slot ranges (the `slots` algorithm only). */
  slots: SlotRange[];
}

export interface ShardMap {
  /** Monotonic map version (a u64, hence a bigint). */
  version: bigint;
  algorithm: Algorithm;
  hash: HashName;
  vnodes: number;
  /** Shards in map order. */
  shards: Shard[];
  /** Key -> shard name; wins over the algorithm in every state. */
  overrides: Map<string, string>;
}

/** A shard map that cannot be used; the message names the field and the value. */
export class MapError extends Error {
  override name = "MapError";
}

function invalid(field: string, value: string, reason: string): MapError {
  return new MapError(`shard map: field \`${field}\` has invalid value ${value}: ${reason}`);
}

function missing(field: string): MapError {
  return new MapError(`shard map: missing field \`${field}\``);
}

/** A parsed YAML value for an error message: strings quoted, others as JSON. */
function render(value: unknown): string {
  if (typeof value === "string") return JSON.stringify(value);
  if (typeof value === "bigint") return value.toString();
  if (value instanceof Map) {
    const parts = [...value].map(([k, v]) => `${render(k)}: ${render(v)}`);
    return `{${parts.join(", ")}}`;
  }
  if (Array.isArray(value)) return `[${value.map(render).join(", ")}]`;
  if (value === undefined) return "null";
  return JSON.stringify(value) ?? String(value);
}

const U64_MAX = (1n << 64n) - 1n;

/** An integer in u64. The YAML is read with integers as bigints, so `1.0` (a float) is refused as Rust does. */
function asU64(value: unknown, field: string, reason: string): bigint {
  if (typeof value === "bigint" && value >= 0n && value <= U64_MAX) return value;
  throw invalid(field, render(value), reason);
}

function asString(value: unknown, field: string, reason: string): string {
  if (typeof value === "string") return value;
  throw invalid(field, render(value), reason);
}

function isAbsent(value: unknown): boolean {
  return value === undefined || value === null;
}

/** Rust's `str::parse::<u64>` after `trim`: ASCII digits with an optional leading `+`. */
function parseU64Text(text: string): bigint | undefined {
  const t = text.trim();
  if (!/^\+?[0-9]+$/.test(t)) return undefined;
  return BigInt(t);
}

function parseSlotRange(value: unknown, field: string): SlotRange {
  const bad = () =>
    invalid(field, render(value), 'expected a slot (0-16383) or an inclusive range such as "0-5460"');
  let start: bigint | undefined;
  let end: bigint | undefined;
  if (typeof value === "bigint") {
    if (value < 0n) throw bad();
    start = end = value;
  } else if (typeof value === "string") {
    const dash = value.indexOf("-");
    if (dash >= 0) {
      start = parseU64Text(value.slice(0, dash));
      end = parseU64Text(value.slice(dash + 1));
    } else {
      start = end = parseU64Text(value);
    }
  } else {
    throw bad();
  }
  if (start === undefined || end === undefined || start > end || end >= BigInt(SLOT_COUNT)) throw bad();
  return { start: Number(start), end: Number(end) };
}

/** Checks a shard name against the allowed alphabet and length; returns the reason it is refused, if any. */
export function shardNameProblem(name: string): string | undefined {
  if (name.length === 0) return "shard name must not be empty";
  const bytes = Buffer.byteLength(name, "utf8");
  if (bytes > SHARD_NAME_BYTES_MAX) {
    return `shard name is ${bytes} bytes; at most ${SHARD_NAME_BYTES_MAX} allowed`;
  }
  if (name === "." || name === "..") return "shard name must not be `.` or `..`";
  for (const c of name) {
    if (!/^[A-Za-z0-9._-]$/.test(c)) {
      return `shard name contains ${JSON.stringify(c)}; only ASCII letters, digits, \`-\`, \`_\` and \`.\` are allowed`;
    }
  }
  return undefined;
}

function mapGet(m: Map<unknown, unknown>, key: string): unknown {
  return m.get(key);
}

function parseShard(i: number, value: unknown): Shard {
  const at = (f: string) => `shards[${i}].${f}`;
  if (!(value instanceof Map)) {
    throw invalid(`shards[${i}]`, render(value), "each shard must be a mapping with at least a name");
  }
  for (const k of value.keys()) {
    if (typeof k !== "string" || !["name", "url", "weight", "state", "slots"].includes(k)) {
      throw invalid(
        `shards[${i}].${render(k)}`,
        "(field name)",
        "unknown field; expected name, url, weight, state or slots",
      );
    }
  }
  const rawName = mapGet(value, "name");
  if (isAbsent(rawName)) throw missing(at("name"));
  const name = asString(rawName, at("name"), "a shard name must be a string");
  const rawUrl = mapGet(value, "url");
  const url = isAbsent(rawUrl) ? undefined : asString(rawUrl, at("url"), "a url must be a string");
  const rawWeight = mapGet(value, "weight");
  let weight = 1;
  if (!isAbsent(rawWeight)) {
    const reason = `weight must be an integer from 1 to ${WEIGHT_MAX}`;
    const w = asU64(rawWeight, at("weight"), reason);
    if (w === 0n || w > BigInt(WEIGHT_MAX)) throw invalid(at("weight"), render(rawWeight), reason);
    weight = Number(w);
  }
  const rawState = mapGet(value, "state");
  let state: ShardState = "active";
  if (!isAbsent(rawState)) {
    const s = asString(rawState, at("state"), "expected a string");
    if (!(SHARD_STATES as readonly string[]).includes(s)) {
      throw invalid(at("state"), render(rawState), `unknown state ${JSON.stringify(s)}; expected active, warming or draining`);
    }
    state = s as ShardState;
  }
  const rawSlots = mapGet(value, "slots");
  let slots: SlotRange[] = [];
  if (Array.isArray(rawSlots)) {
    slots = rawSlots.map((v, j) => parseSlotRange(v, `shards[${i}].slots[${j}]`));
  } else if (!isAbsent(rawSlots)) {
    slots = [parseSlotRange(rawSlots, at("slots"))];
  }
  const shard: Shard = { name, weight, state, slots };
  if (url !== undefined) shard.url = url;
  return shard;
}

/** Parses and validates a YAML shard map; throws a `MapError` naming the field and value of the first problem. */
export function parseMap(text: string): ShardMap {
  const doc = parseDocument(text, { version: "1.2", intAsBigInt: true, uniqueKeys: true });
  if (doc.errors.length > 0) {
    throw new MapError(`shard map is not valid YAML: ${doc.errors[0]?.message ?? "parse error"}`);
  }
  const top: unknown = doc.toJS({ mapAsMap: true });
  if (!(top instanceof Map)) {
    throw invalid("(document)", render(top), "the shard map must be a YAML mapping");
  }
  const known = ["version", "algorithm", "hash", "vnodes", "shards", "overrides"];
  for (const k of top.keys()) {
    if (typeof k !== "string" || !known.includes(k)) {
      throw invalid(render(k), "(field name)", `unknown field; expected one of ${known.join(", ")}`);
    }
  }
  const rawVersion = mapGet(top, "version");
  if (isAbsent(rawVersion)) throw missing("version");
  const version = asU64(rawVersion, "version", "version must be a non-negative integer");

  const rawAlgorithm = mapGet(top, "algorithm");
  let algorithm: Algorithm = "rendezvous";
  if (!isAbsent(rawAlgorithm)) {
    const s = asString(rawAlgorithm, "algorithm", "expected a string");
    if (!(ALGORITHMS as readonly string[]).includes(s)) {
      throw invalid(
        "algorithm",
        render(rawAlgorithm),
        `unknown algorithm ${JSON.stringify(s)}; expected one of ${ALGORITHMS.join(", ")}`,
      );
    }
    algorithm = s as Algorithm;
  }

  const rawHash = mapGet(top, "hash");
  let hash: HashName = "blake2b64";
  if (!isAbsent(rawHash)) {
    const s = asString(rawHash, "hash", "expected a string");
    if (!(HASH_NAMES as readonly string[]).includes(s)) {
      throw invalid("hash", render(rawHash), `unknown hash ${JSON.stringify(s)}; expected one of ${HASH_NAMES.join(", ")}`);
    }
    hash = s as HashName;
  }

  const rawVnodes = mapGet(top, "vnodes");
  let vnodes = VNODES_DEFAULT;
  if (!isAbsent(rawVnodes)) {
    const reason = `vnodes must be an integer from 1 to ${VNODES_MAX}`;
    const n = asU64(rawVnodes, "vnodes", reason);
    if (n === 0n || n > BigInt(VNODES_MAX)) throw invalid("vnodes", render(rawVnodes), reason);
    vnodes = Number(n);
  }

  const rawShards = mapGet(top, "shards");
  if (isAbsent(rawShards)) throw missing("shards");
  if (!Array.isArray(rawShards)) throw invalid("shards", render(rawShards), "shards must be a list");
  const shards = rawShards.map((s, i) => parseShard(i, s));

  const overrides = new Map<string, string>();
  const rawOverrides = mapGet(top, "overrides");
  if (rawOverrides instanceof Map) {
    for (const [k, v] of rawOverrides) {
      let key: string;
      if (typeof k === "string") key = k;
      // YAML reads `123: shard-0` as a number; keys are strings.
      else if (typeof k === "bigint" || typeof k === "number") key = String(k);
      else throw invalid("overrides", render(k), "override keys must be strings");
      overrides.set(key, asString(v, `overrides.${key}`, "an override must name a shard"));
    }
  } else if (!isAbsent(rawOverrides)) {
    throw invalid("overrides", render(rawOverrides), "overrides must be a mapping of key: shard");
  }

  const map: ShardMap = { version, algorithm, hash, vnodes, shards, overrides };
  validateMap(map);
  return map;
}

/** Checks every rule a map must satisfy (called by `parseMap`; call it again after editing a map in code). */
export function validateMap(map: ShardMap): void {
  if (!Number.isInteger(map.vnodes) || map.vnodes < 1 || map.vnodes > VNODES_MAX) {
    throw invalid("vnodes", String(map.vnodes), `vnodes must be an integer from 1 to ${VNODES_MAX}`);
  }
  if (!(ALGORITHMS as readonly string[]).includes(map.algorithm)) {
    throw invalid("algorithm", JSON.stringify(map.algorithm), `expected one of ${ALGORITHMS.join(", ")}`);
  }
  if (!(HASH_NAMES as readonly string[]).includes(map.hash)) {
    throw invalid("hash", JSON.stringify(map.hash), `expected one of ${HASH_NAMES.join(", ")}`);
  }
  if (map.shards.length === 0) throw invalid("shards", "[]", "the map must list at least one shard");
  if (map.shards.length > SHARDS_MAX) {
    throw invalid("shards", `(${map.shards.length} shards)`, `at most ${SHARDS_MAX} shards are allowed`);
  }
  const seen = new Map<string, number>();
  let totalWeight = 0;
  const slotOwner = new Map<number, number>();
  map.shards.forEach((s, i) => {
    const problem = shardNameProblem(s.name);
    if (problem !== undefined) throw invalid(`shards[${i}].name`, JSON.stringify(s.name), problem);
    const first = seen.get(s.name);
    if (first !== undefined) {
      throw new MapError(`shard map: duplicate shard name ${JSON.stringify(s.name)} (shards[${first}] and shards[${i}])`);
    }
    seen.set(s.name, i);
    if (!Number.isInteger(s.weight) || s.weight < 1 || s.weight > WEIGHT_MAX) {
      throw invalid(`shards[${i}].weight`, String(s.weight), `weight must be an integer from 1 to ${WEIGHT_MAX}`);
    }
    if (!(SHARD_STATES as readonly string[]).includes(s.state)) {
      throw invalid(`shards[${i}].state`, JSON.stringify(s.state), "expected active, warming or draining");
    }
    if (s.state === "active") totalWeight += s.weight;
    for (const r of s.slots) {
      if (!Number.isInteger(r.start) || !Number.isInteger(r.end) || r.start < 0 || r.start > r.end || r.end >= SLOT_COUNT) {
        throw invalid(`shards[${i}].slots`, `${r.start}-${r.end}`, "expected an inclusive range within 0-16383");
      }
      for (let slot = r.start; slot <= r.end; slot++) {
        const prev = slotOwner.get(slot);
        if (prev !== undefined && prev !== i) {
          const a = map.shards[prev]?.name ?? "";
          throw new MapError(`shard map: slot ${slot} is assigned to both ${JSON.stringify(a)} and ${JSON.stringify(s.name)}`);
        }
        slotOwner.set(slot, i);
      }
    }
  });
  if (totalWeight === 0) {
    throw new MapError(
      "shard map: no shard is active (every shard is warming or draining); at least one must be active",
    );
  }
  if (map.algorithm === "ring" && totalWeight * map.vnodes > RING_POINTS_MAX) {
    throw invalid(
      "vnodes",
      String(map.vnodes),
      `vnodes x total active weight (${totalWeight}) exceeds the ring bound of ${RING_POINTS_MAX} points`,
    );
  }
  for (const [key, shard] of map.overrides) {
    if (!seen.has(shard)) {
      throw new MapError(`shard map: override for key ${JSON.stringify(key)} names unknown shard ${JSON.stringify(shard)}`);
    }
  }
}
