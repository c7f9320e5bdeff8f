/**
 * A correctly rounded natural logarithm for doubles in (0, 1].
 *
 * The weighted-rendezvous score is `weight / -ln(u)`. Rust takes `ln` from
 * the platform's libm (glibc's `log` is correctly rounded in all but
 * vanishingly rare cases), while V8's `Math.log` is an fdlibm port that is
 * sometimes one ulp away, which the shared vectors catch and which can flip
 * a near tie. So the router computes `ln` itself: in double-double
 * arithmetic (about 104 bits) and then rounds once to the nearest double.
 *
 * Method: `u = m * 2^k` with `m` in `[sqrt(1/2), sqrt(2))`, then
 * `ln(u) = k*ln(2) + 2*atanh(s)` with `s = (m - 1) / (m + 1)`, the series
 * `atanh(s) = s * sum s^(2j) / (2j + 1)` summed by Horner's rule.
 */

/** A double-double: the unevaluated sum `hi + lo` with `|lo| <= ulp(hi) / 2`. */
type DD = readonly [number, number];

function twoSum(a: number, b: number): DD {
  const s = a + b;
  const bb = s - a;
  return [s, a - (s - bb) + (b - bb)];
}

/** Like `twoSum` when `|a| >= |b|`; `hi` is then `a + b` rounded to nearest. */
function quickTwoSum(a: number, b: number): DD {
  const s = a + b;
  return [s, b - (s - a)];
}

const SPLITTER = 134217729; // 2^27 + 1 (Dekker's split)

function split(a: number): DD {
  const t = SPLITTER * a;
  const hi = t - (t - a);
  return [hi, a - hi];
}

/** The exact product `a * b` as a double-double. */
function twoProd(a: number, b: number): DD {
  const p = a * b;
  const [ah, al] = split(a);
  const [bh, bl] = split(b);
  return [p, ah * bh - p + ah * bl + al * bh + al * bl];
}

function ddAdd(a: DD, b: DD): DD {
  let [s, e] = twoSum(a[0], b[0]);
  const [t, f] = twoSum(a[1], b[1]);
  e += t;
  [s, e] = quickTwoSum(s, e);
  e += f;
  return quickTwoSum(s, e);
}

function ddMul(a: DD, b: DD): DD {
  const [p, e] = twoProd(a[0], b[0]);
  return quickTwoSum(p, e + (a[0] * b[1] + a[1] * b[0]));
}

function ddMulNumber(a: DD, b: number): DD {
  const [p, e] = twoProd(a[0], b);
  return quickTwoSum(p, e + a[1] * b);
}

function ddDiv(a: DD, b: DD): DD {
  const q1 = a[0] / b[0];
  let r = ddAdd(a, ddMulNumber(b, -q1));
  const q2 = r[0] / b[0];
  r = ddAdd(r, ddMulNumber(b, -q2));
  const q3 = r[0] / b[0];
  return ddAdd(quickTwoSum(q1, q2), [q3, 0]);
}

/** ln(2) as a double-double. */
const LN2: DD = [0.6931471805599453, 2.3190468138462996e-17];

/**
 * Terms of the atanh series: |s| <= (sqrt(2) - 1) / (sqrt(2) + 1) < 0.1716,
 * so s^2 < 0.0295 < 2^-5 and 23 terms leave a remainder below 2^-110.
 */
const SERIES_TERMS = 23;
const RECIPROCAL_ODDS: DD[] = Array.from({ length: SERIES_TERMS }, (_, j) => ddDiv([1, 0], [2 * j + 1, 0]));

const SQRT2 = Math.SQRT2;
const scratch = new DataView(new ArrayBuffer(8));

/** `u = m * 2^k` with `m` in [1, 2), for a positive normal double. */
function frexp(u: number): [number, number] {
  scratch.setFloat64(0, u);
  const hiWord = scratch.getUint32(0);
  const k = ((hiWord >>> 20) & 0x7ff) - 1023;
  scratch.setUint32(0, (hiWord & 0x800fffff) | (1023 << 20));
  return [scratch.getFloat64(0), k];
}

/**
 * ln(u) correctly rounded to the nearest double, for a normal `u` in
 * (0, 1] (the domain of the weighted-rendezvous recipe, where `u >= 2^-53`).
 */
export function lnCorrectlyRounded(u: number): number {
  if (!(u > 0 && u <= 1) || u < 2.2250738585072014e-308) {
    throw new RangeError(`lnCorrectlyRounded: expected a normal double in (0, 1], got ${u}`);
  }
  if (u === 1) return 0;
  let [m, k] = frexp(u);
  if (m > SQRT2) {
    m /= 2;
    k += 1;
  }
  // m - 1 is exact (Sterbenz: m is within a factor of 2 of 1); m + 1 may not be.
  const s = ddDiv([m - 1, 0], twoSum(m, 1));
  const s2 = ddMul(s, s);
  let acc: DD = RECIPROCAL_ODDS[SERIES_TERMS - 1] as DD;
  for (let j = SERIES_TERMS - 2; j >= 0; j--) {
    acc = ddAdd(ddMul(acc, s2), RECIPROCAL_ODDS[j] as DD);
  }
  const lnM = ddMulNumber(ddMul(s, acc), 2);
  if (k === 0) return lnM[0] + lnM[1];
  // k * ln2: k is a small integer, so k * LN2[0] is exact as a twoProd.
  const kLn2 = ddAdd(twoProd(k, LN2[0]), [k * LN2[1], 0]);
  const sum = ddAdd(kLn2, lnM);
  return sum[0] + sum[1];
}
