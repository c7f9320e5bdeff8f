//! The hash ring with virtual nodes.
//!
//! Shard `name` with weight `w` owns the points `h("{name}#{i}")` for
//! `i in 0..vnodes*w`. A key belongs to the owner of the first point strictly
//! greater than `h(key)`, wrapping to the first point: Python's
//! `bisect.bisect(points, h(key)) % len(points)`.
//!
//! Tie rule: when several points share one value, the point belongs to the
//! shard that comes *last* in map order (among active shards). This is what
//! the specification's Python reference does, since its `owner` dict is
//! overwritten in insertion order.
//!
//! Lookup is a sorted `u64` array plus a table on the top bits of the hash,
//! about two buckets per point. A bucket with no point or one point stores
//! its whole answer (the point, the owner below it, the owner above it) in
//! 16 bytes, so most lookups cost one hash and one load; a bucket with
//! several points falls back to a short scan of the sorted array.

use crate::hash::HashFn;

/// Target points per index bucket (about one), bounded by [`INDEX_BITS_MAX`].
const INDEX_BITS_MAX: u32 = 22;

/// An immutable, built ring.
#[derive(Debug, Clone)]
pub struct Ring {
    points: Vec<u64>,
    /// `owners[i]` is the position (in the router's active list) of `points[i]`'s shard.
    owners: Vec<u32>,
    index: Vec<u32>,
    /// One entry per index bucket that answers the lookup with one load
    /// when the bucket holds at most one point (most do).
    table: Vec<Bucket>,
    shift: u32,
    /// Number of index buckets (`index.len() - 1`).
    buckets: u64,
}

/// A bucket's answer: keys below `point` go to `below`, others to `above`.
/// `above == CROWDED` marks a bucket with several points, answered by a
/// scan of `points` from `index[b]`.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
struct Bucket {
    point: u64,
    below: u32,
    above: u32,
}

const CROWDED: u32 = u32::MAX;

impl Ring {
    /// Builds the ring over `(name, weight)` pairs in map order.
    pub fn build<'a>(
        hash: HashFn,
        vnodes: u32,
        shards: impl Iterator<Item = (&'a str, u32)>,
    ) -> Ring {
        let mut pairs: Vec<(u64, u32)> = Vec::new();
        let mut buf: Vec<u8> = Vec::with_capacity(96);
        let mut digits = itoa_buf();
        for (pos, (name, weight)) in shards.enumerate() {
            let count = u64::from(vnodes) * u64::from(weight);
            pairs.reserve(count as usize);
            buf.clear();
            buf.extend_from_slice(name.as_bytes());
            buf.push(b'#');
            let prefix_len = buf.len();
            for i in 0..count {
                buf.truncate(prefix_len);
                buf.extend_from_slice(format_u64(&mut digits, i));
                pairs.push((hash.hash(&buf), pos as u32));
            }
        }
        // Sort by value then by shard position, and keep the last of equal
        // values: the later shard in map order wins a tie.
        pairs.sort_unstable();
        let mut points = Vec::with_capacity(pairs.len());
        let mut owners = Vec::with_capacity(pairs.len());
        for (i, &(p, o)) in pairs.iter().enumerate() {
            if pairs.get(i + 1).is_some_and(|next| next.0 == p) {
                continue;
            }
            points.push(p);
            owners.push(o);
        }
        // About two buckets per point: most buckets then hold at most one
        // point and are answered from the table alone.
        let bits = (usize::BITS - points.len().max(2).leading_zeros() + 1).clamp(1, INDEX_BITS_MAX);
        let span_bits = 64 - points.last().copied().unwrap_or(0).leading_zeros();
        let shift = span_bits.saturating_sub(bits);
        let buckets = 1usize << bits;
        let mut index = vec![0u32; buckets + 1];
        let mut i = 0usize;
        for (b, slot) in index.iter_mut().enumerate().take(buckets) {
            while i < points.len() && ((points[i] >> shift) as usize) < b {
                i += 1;
            }
            *slot = i as u32;
        }
        index[buckets] = points.len() as u32;
        let n = points.len();
        let owner_at = |i: usize| owners[if i >= n { 0 } else { i }];
        let table = (0..buckets)
            .map(|b| {
                let (s, e) = (index[b] as usize, index[b + 1] as usize);
                match e - s {
                    // Every key of the bucket goes to the next point after it.
                    0 => Bucket {
                        point: 0,
                        below: owner_at(e),
                        above: owner_at(e),
                    },
                    1 => Bucket {
                        point: points[s],
                        below: owner_at(s),
                        above: owner_at(s + 1),
                    },
                    _ => Bucket {
                        point: 0,
                        below: s as u32,
                        above: CROWDED,
                    },
                }
            })
            .collect();
        Ring {
            points,
            owners,
            index,
            table,
            shift,
            buckets: buckets as u64,
        }
    }

    /// Position (in the active list) of the owner of hash `h`.
    #[inline]
    pub fn lookup(&self, h: u64) -> u32 {
        let b = h >> self.shift;
        if b >= self.buckets {
            // Above the last point: wrap to the first.
            return self.owners[0];
        }
        let b = b as usize;
        let e = self.table[b];
        if e.above != CROWDED {
            return if h < e.point { e.below } else { e.above };
        }
        let mut i = e.below as usize;
        let end = self.index[b + 1] as usize;
        while i < end && self.points[i] <= h {
            i += 1;
        }
        if i == self.points.len() {
            i = 0;
        }
        self.owners[i]
    }

    /// Renames every owner through `f` (the router turns active-list
    /// positions into map indexes, saving a load per lookup).
    pub fn map_owners(&mut self, f: impl Fn(u32) -> u32) {
        for o in &mut self.owners {
            *o = f(*o);
        }
        for b in &mut self.table {
            if b.above != CROWDED {
                b.below = f(b.below);
                b.above = f(b.above);
            }
        }
    }

    /// Number of distinct points.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// True when the ring has no points (never for a built map).
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The same answer by plain binary search: the reference the fast path is tested against.
    pub fn lookup_bisect(&self, h: u64) -> u32 {
        let i = self.points.partition_point(|&p| p <= h);
        self.owners[if i == self.points.len() { 0 } else { i }]
    }
}

type DigitBuf = [u8; 20];

fn itoa_buf() -> DigitBuf {
    [0u8; 20]
}

/// Decimal digits of `n` without allocating.
fn format_u64(buf: &mut DigitBuf, mut n: u64) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_lookup_matches_bisect() {
        let names = ["a", "b", "c"];
        let ring = Ring::build(HashFn::Xxh3, 64, names.iter().map(|n| (*n, 1)));
        let mut h = 0u64;
        for i in 0..100_000u64 {
            h = h.wrapping_add(0x9E37_79B9_7F4A_7C15 ^ i);
            assert_eq!(ring.lookup(h), ring.lookup_bisect(h));
        }
        for p in [0, u64::MAX, ring.points[0], ring.points[ring.len() - 1]] {
            assert_eq!(ring.lookup(p), ring.lookup_bisect(p));
        }
    }

    #[test]
    fn narrow_hash_index_matches_bisect() {
        // crc16 points all sit below 2^16: the index must still agree with
        // bisect everywhere, including above the last point.
        let ring = Ring::build(HashFn::Crc16, 256, [("a", 1), ("bb", 2)].into_iter());
        assert!(
            ring.shift < 16,
            "the index must span the points, not all of u64"
        );
        for h in (0..70_000u64).chain([u64::MAX, 1 << 40]) {
            assert_eq!(ring.lookup(h), ring.lookup_bisect(h), "h={h}");
        }
    }

    #[test]
    fn ties_go_to_the_later_shard() {
        // crc16 collides easily: find two names whose first points collide.
        let ring = Ring::build(HashFn::Crc16, 4096, [("x", 1), ("y", 1)].into_iter());
        // 8192 points in a 65536 space collide often; the distinct count proves dedup ran.
        assert!(ring.len() < 8192);
    }

    #[test]
    fn formats_numbers() {
        let mut b = itoa_buf();
        assert_eq!(format_u64(&mut b, 0), b"0");
        assert_eq!(format_u64(&mut b, 1234567), b"1234567");
        assert_eq!(
            format_u64(&mut b, u64::MAX),
            u64::MAX.to_string().as_bytes()
        );
    }
}
