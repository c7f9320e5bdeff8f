//! Lamping-Veach jump consistent hash ("A Fast, Minimal Memory, Consistent
//! Hash Algorithm", 2014), with the 64-bit LCG of the paper and of Guava's
//! `Hashing.consistentHash`, so Guava's golden vectors hold.
//!
//! Jump has no weights and can only drop its last bucket without moving
//! other keys; the router applies it over the active shards in map order.

/// The bucket in `0..buckets` for a 64-bit key. `buckets` must be >= 1.
#[inline]
pub fn jump(mut key: u64, buckets: u32) -> u32 {
    let buckets = i64::from(buckets.max(1));
    let mut b: i64 = -1;
    let mut j: i64 = 0;
    while j < buckets {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
    }
    b as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guava_golden_vectors() {
        let want = [0, 55, 62, 8, 45];
        for (key, w) in want.iter().enumerate() {
            assert_eq!(jump(key as u64, 100), *w, "jump({key}, 100)");
        }
        assert_eq!(jump(10_863_919_174_838_991, 11), 6);
        assert_eq!(jump(2, 100_001), 80_343);
    }

    #[test]
    fn one_bucket_is_zero() {
        assert_eq!(jump(u64::MAX, 1), 0);
    }
}
