// lnCorrectlyRounded against an independent 200-bit fixed-point logarithm in
// BigInt: on every input of the weighted-rendezvous form its answer must be
// the double nearest the true value (Math.log is not always).

import assert from "node:assert/strict";
import { test } from "node:test";

import { lnCorrectlyRounded } from "../src/index.js";

const P = 200n;
const ONE = 1n << P;

/** atanh(num / den) * 2^P for 0 <= num < den. */
function atanhFixed(num: bigint, den: bigint): bigint {
  let term = (num * ONE) / den;
  const n2 = num * num;
  const d2 = den * den;
  let sum = 0n;
  for (let j = 0n; term !== 0n; j++) {
    sum += term / (2n * j + 1n);
    term = (term * n2) / d2;
  }
  return sum;
}

const LN2_FIXED = 2n * atanhFixed(1n, 3n);

/** ln(n / 2^shift) * 2^P for a positive integer n. */
function lnFixed(n: bigint, shift: bigint): bigint {
  const e = BigInt(n.toString(2).length - 1); // n = m * 2^e, m in [1, 2)
  const pow = 1n << e;
  return BigInt(e - shift) * LN2_FIXED + 2n * atanhFixed(n - pow, n + pow);
}

const view = new DataView(new ArrayBuffer(8));

/** A finite double times 2^P, exactly (for doubles whose ulp is at least 2^-P). */
function toFixed(d: number): bigint {
  view.setFloat64(0, d);
  const bits = view.getBigUint64(0);
  const negative = bits >> 63n === 1n;
  const exp = Number((bits >> 52n) & 0x7ffn);
  const mant = (bits & ((1n << 52n) - 1n)) | (exp === 0 ? 0n : 1n << 52n);
  const shift = BigInt(exp === 0 ? 1 : exp) - 1075n + P;
  assert.ok(shift >= 0n, `double ${d} is too small for ${P} fractional bits`);
  const v = mant << shift;
  return negative ? -v : v;
}

function neighbour(d: number, up: boolean): number {
  view.setFloat64(0, d);
  const bits = view.getBigUint64(0);
  // d < 0 here: a larger magnitude is one step down.
  view.setBigUint64(0, up ? bits - 1n : bits + 1n);
  return view.getFloat64(0);
}

function abs(x: bigint): bigint {
  return x < 0n ? -x : x;
}

test("ln is the nearest double on inputs of the weighted-rendezvous form", (t) => {
  let state = 0x243f6a8885a308d3n;
  let differsFromMathLog = 0;
  const xs: bigint[] = [0n, 1n, 4095n, 4096n, (1n << 64n) - 1n, (1n << 63n) - 1n, 1n << 63n, 16652013371433147967n];
  for (let i = 0; i < 1500; i++) {
    state = BigInt.asUintN(64, state * 6364136223846793005n + 1442695040888963407n);
    xs.push(i % 3 === 0 ? state >> BigInt(i % 64) : i % 3 === 1 ? (1n << 64n) - 1n - (state >> BigInt(i % 64)) : state);
  }
  for (const x of xs) {
    const n = 2n * (x >> 12n) + 1n; // u = ((x >> 12) + 0.5) / 2^52 = n / 2^53
    const u = Number(n) / 2 ** 53;
    assert.equal(BigInt(u * 2 ** 53), n, "u is exact");
    const got = lnCorrectlyRounded(u);
    const exact = lnFixed(n, 53n);
    const err = abs(exact - toFixed(got));
    for (const other of [neighbour(got, true), neighbour(got, false)]) {
      assert.ok(err < abs(exact - toFixed(other)), `ln(${u}) for x=${x}: ${got} is farther from the true value than ${other}`);
    }
    if (got !== Math.log(u)) differsFromMathLog++;
  }
  t.diagnostic(`Math.log differs from the nearest double on ${differsFromMathLog} of ${xs.length} inputs`);
});

test("ln refuses values outside (0, 1]", () => {
  assert.equal(lnCorrectlyRounded(1), 0);
  for (const bad of [0, -1, 1.5, Number.NaN, 5e-324]) {
    assert.throws(() => lnCorrectlyRounded(bad), /expected a normal double in \(0, 1\], got/);
  }
});
