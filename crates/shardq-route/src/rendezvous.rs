//! Rendezvous (highest random weight) hashing.
//!
//! Unweighted: owner = argmax over active shards of `h("{name}:{key}")`,
//! ties to the earliest shard in map order (Python's `max`).
//!
//! Weighted (used only when the active shards' weights differ; equal weights
//! take the unweighted path, so they give exactly its answer): the
//! logarithmic method. For each shard, with `x = h("{name}:{key}")`:
//!
//! ```text
//! u     = ((x >> 12) + 0.5) / 2^52        # IEEE-754 double, exactly, in (0, 1)
//! score = weight / -ln(u)                 # ln is the natural logarithm
//! ```
//!
//! `x >> 12` keeps 52 bits so that `(x >> 12) + 0.5` is exact in a double
//! and `u` never rounds up to 1 (where `ln` would be 0 and the score infinite).
//! owner = argmax of score, ties to the earliest shard in map order. Every
//! step is a correctly rounded IEEE operation except `ln`, which comes from
//! the platform's libm; across platforms a one-ulp difference could flip a
//! near-exact tie, which the shared vectors would reveal.

use crate::hash::HashFn;
use crate::keybuf::{with_key, KeyBuf};

/// Rendezvous over a list of `(prefix, weight)` where prefix is `"{name}:"`.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    prefixes: Vec<Box<[u8]>>,
    weights: Vec<f64>,
    weighted: bool,
    /// Longest prefix: the room left before the key in the join buffer.
    prefix_max: usize,
}

impl Rendezvous {
    /// Builds the scorer over `(name, weight)` pairs in map order.
    pub fn build<'a>(shards: impl Iterator<Item = (&'a str, u32)>) -> Rendezvous {
        let mut prefixes = Vec::new();
        let mut weights = Vec::new();
        for (name, weight) in shards {
            let mut p = name.as_bytes().to_vec();
            p.push(b':');
            prefixes.push(p.into_boxed_slice());
            weights.push(f64::from(weight));
        }
        let weighted = weights.windows(2).any(|w| w[0] != w[1]);
        let prefix_max = prefixes.iter().map(|p| p.len()).max().unwrap_or(0);
        Rendezvous {
            prefixes,
            weights,
            weighted,
            prefix_max,
        }
    }

    /// Position (in the active list) of the owner of `key`.
    #[inline]
    pub fn lookup(&self, hash: HashFn, key: &[u8]) -> u32 {
        // Dispatch on the hash once per lookup rather than once per shard,
        // so each loop below is compiled with its hash inlined.
        with_key(self.prefix_max, key, |kb| match hash {
            HashFn::Blake2b64 => self.best(kb, |b| HashFn::Blake2b64.hash(b)),
            HashFn::Xxh64 => self.best(kb, |b| HashFn::Xxh64.hash(b)),
            HashFn::Xxh3 => self.best(kb, |b| HashFn::Xxh3.hash(b)),
            HashFn::Murmur3 => self.best(kb, |b| HashFn::Murmur3.hash(b)),
            HashFn::Fnv1a64 => self.best(kb, |b| HashFn::Fnv1a64.hash(b)),
            HashFn::Crc16 => self.best(kb, |b| HashFn::Crc16.hash(b)),
        })
    }

    #[inline(always)]
    fn best(&self, kb: &mut KeyBuf<'_>, h: impl Fn(&[u8]) -> u64) -> u32 {
        let mut best = 0u32;
        if self.weighted {
            let mut best_score = f64::NEG_INFINITY;
            for (i, (prefix, &weight)) in self.prefixes.iter().zip(&self.weights).enumerate() {
                let score = weighted_score(weight, h(kb.joined(prefix)));
                if score > best_score {
                    best_score = score;
                    best = i as u32;
                }
            }
        } else {
            let mut best_x = 0u64;
            for (i, prefix) in self.prefixes.iter().enumerate() {
                let x = h(kb.joined(prefix));
                // Selects rather than a branch: which shard wins is random,
                // so a branch here would be mispredicted often.
                let better = (i == 0) | (x > best_x);
                best_x = if better { x } else { best_x };
                best = if better { i as u32 } else { best };
            }
        }
        best
    }
}

/// The logarithmic-method score of a shard of `weight` whose hash is `x`.
#[inline]
pub fn weighted_score(weight: f64, x: u64) -> f64 {
    const TWO_POW_52: f64 = 4_503_599_627_370_496.0;
    let u = ((x >> 12) as f64 + 0.5) / TWO_POW_52;
    weight / -u.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_is_finite_at_extremes() {
        for x in [0, 1, u64::MAX, u64::MAX >> 1] {
            let s = weighted_score(1.0, x);
            assert!(s.is_finite() && s > 0.0, "x={x} score={s}");
        }
        assert!(weighted_score(1.0, u64::MAX) > weighted_score(1.0, 0));
    }
}
