/**
 * The six stable 64-bit hashes a shard map may name, over a key's UTF-8
 * bytes, bit for bit equal to the Rust crate `shardq-route` (`src/hash.rs`).
 *
 * BLAKE2b-64, xxh64, xxh3 and murmur3 come from npm packages; FNV-1a 64 and
 * CRC16-XMODEM are small and exactly specified, so they are written out
 * here. Every value is a `bigint` in `[0, 2^64)`.
 */

import { blake2b } from "@noble/hashes/blake2.js";
import xxhash from "@node-rs/xxhash";
import murmurHash3 from "murmurhash3js-revisited";

export const U64_MASK = (1n << 64n) - 1n;

export type HashName = "blake2b64" | "xxh64" | "xxh3" | "murmur3" | "fnv1a64" | "crc16";

/** Every hash name, in the Rust crate's documentation order. */
export const HASH_NAMES: readonly HashName[] = ["blake2b64", "xxh64", "xxh3", "murmur3", "fnv1a64", "crc16"];

export type HashFn = (bytes: Uint8Array) => bigint;

const encoder = new TextEncoder();

/** The UTF-8 bytes of `s`. */
export function utf8(s: string): Uint8Array {
  return encoder.encode(s);
}

function readBigEndian(bytes: Uint8Array): bigint {
  let x = 0n;
  for (const b of bytes) {
    x = (x << 8n) | BigInt(b);
  }
  return x;
}

/** BLAKE2b with an 8-byte digest *parameter* (not a truncated 64-byte digest), read big-endian. */
export function blake2b64(bytes: Uint8Array): bigint {
  return readBigEndian(blake2b(bytes, { dkLen: 8 }));
}

/** XXH64, seed 0. */
export function xxh64(bytes: Uint8Array): bigint {
  return xxhash.xxh64(bytes, 0n);
}

/** XXH3 64-bit, seed 0, default secret. */
export function xxh3(bytes: Uint8Array): bigint {
  return xxhash.xxh3.xxh64(bytes, 0n);
}

/** MurmurHash3 x64_128, seed 0, first 64-bit half `h1` (Python's `mmh3.hash64(b, 0, signed=False)[0]`). */
export function murmur3(bytes: Uint8Array): bigint {
  const hex = murmurHash3.x64.hash128(bytes, 0);
  if (hex.length !== 32) {
    throw new Error(`murmur3: expected 32 hex digits from murmurhash3js-revisited, got ${JSON.stringify(hex)}`);
  }
  return BigInt("0x" + hex.slice(0, 16));
}

const FNV_OFFSET_BASIS = 0xcbf29ce484222325n;
const FNV_PRIME = 0x100000001b3n;

/** FNV-1a 64-bit: for each byte, xor it in, then multiply by the prime mod 2^64. */
export function fnv1a64(bytes: Uint8Array): bigint {
  let h = FNV_OFFSET_BASIS;
  for (const b of bytes) {
    h = ((h ^ BigInt(b)) * FNV_PRIME) & U64_MASK;
  }
  return h;
}

const CRC16_TABLE: Uint16Array = (() => {
  const table = new Uint16Array(256);
  for (let i = 0; i < 256; i++) {
    let crc = i << 8;
    for (let bit = 0; bit < 8; bit++) {
      crc = crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1;
      crc &= 0xffff;
    }
    table[i] = crc;
  }
  return table;
})();

/** CRC16-XMODEM (poly 0x1021, init 0, no reflection, no final xor): the Redis Cluster CRC, as a number. */
export function crc16Number(bytes: Uint8Array): number {
  let crc = 0;
  for (const b of bytes) {
    crc = ((crc << 8) & 0xffff) ^ (CRC16_TABLE[((crc >> 8) ^ b) & 0xff] as number);
  }
  return crc;
}

/** CRC16-XMODEM widened to 64 bits. */
export function crc16(bytes: Uint8Array): bigint {
  return BigInt(crc16Number(bytes));
}

/** Hash functions by the name a shard map uses in its `hash` field. */
export const HASHES: Readonly<Record<HashName, HashFn>> = Object.freeze({
  blake2b64,
  xxh64,
  xxh3,
  murmur3,
  fnv1a64,
  crc16,
});

/** The hash named `name`, or an error naming it and the known names. */
export function hashByName(name: string): HashFn {
  if (!(HASH_NAMES as readonly string[]).includes(name)) {
    throw new Error(`unknown hash ${JSON.stringify(name)}; expected one of ${HASH_NAMES.join(", ")}`);
  }
  return HASHES[name as HashName];
}
