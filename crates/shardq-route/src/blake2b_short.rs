//! BLAKE2b with an 8-byte digest for inputs of at most one block (128
//! bytes), written out for speed: routing hashes short keys and
//! `"{shard}:{key}"` strings millions of times, and the general `blake2`
//! crate spends much of a short hash in its buffering layers.
//!
//! Longer inputs go to the `blake2` crate. `tests::matches_the_blake2_crate`
//! pins this function to the crate's output for every length up to the
//! block size; `shardq-bench route` measures the gain. It must never be used
//! for anything but the 8-byte, unkeyed digest.

/// One BLAKE2b block, in bytes.
pub(crate) const BLOCK_BYTES: usize = 128;

const IV: [u64; 8] = [
    0x6a09e667f3bcc908,
    0xbb67ae8584caa73b,
    0x3c6ef372fe94f82b,
    0xa54ff53a5f1d36f1,
    0x510e527fade682d1,
    0x9b05688c2b3e6c1f,
    0x1f83d9abfb41bd6b,
    0x5be0cd19137e2179,
];

const SIGMA: [[usize; 16]; 10] = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
    [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
    [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
    [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
    [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
    [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
    [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
    [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
];

#[inline(always)]
fn g(v: &mut [u64; 16], a: usize, b: usize, c: usize, d: usize, x: u64, y: u64) {
    v[a] = v[a].wrapping_add(v[b]).wrapping_add(x);
    v[d] = (v[d] ^ v[a]).rotate_right(32);
    v[c] = v[c].wrapping_add(v[d]);
    v[b] = (v[b] ^ v[c]).rotate_right(24);
    v[a] = v[a].wrapping_add(v[b]).wrapping_add(y);
    v[d] = (v[d] ^ v[a]).rotate_right(16);
    v[c] = v[c].wrapping_add(v[d]);
    v[b] = (v[b] ^ v[c]).rotate_right(63);
}

#[inline(always)]
fn round(v: &mut [u64; 16], m: &[u64; 16], s: &[usize; 16]) {
    g(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    g(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    g(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    g(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    g(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    g(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    g(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    g(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
}

/// BLAKE2b-64 of `bytes` (at most [`BLOCK_BYTES`]), big-endian, as
/// `crate::hash::blake2b64` defines it.
#[inline]
pub(crate) fn blake2b64_one_block(bytes: &[u8]) -> u64 {
    debug_assert!(bytes.len() <= BLOCK_BYTES);
    let mut block = [0u8; BLOCK_BYTES];
    block[..bytes.len()].copy_from_slice(bytes);
    let mut m = [0u64; 16];
    for (w, chunk) in m.iter_mut().zip(block.chunks_exact(8)) {
        *w = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
    }
    // Parameter block: digest length 8, no key, fanout 1, depth 1.
    let h0 = IV[0] ^ 0x0101_0008;
    let mut v = [0u64; 16];
    v[0] = h0;
    v[1..8].copy_from_slice(&IV[1..8]);
    v[8..16].copy_from_slice(&IV);
    v[12] ^= bytes.len() as u64; // byte counter (the high word stays 0)
    v[14] = !v[14]; // last block
                    // Twelve rounds written out, so every message index is a constant and
                    // the whole state stays in registers.
    round(&mut v, &m, &SIGMA[0]);
    round(&mut v, &m, &SIGMA[1]);
    round(&mut v, &m, &SIGMA[2]);
    round(&mut v, &m, &SIGMA[3]);
    round(&mut v, &m, &SIGMA[4]);
    round(&mut v, &m, &SIGMA[5]);
    round(&mut v, &m, &SIGMA[6]);
    round(&mut v, &m, &SIGMA[7]);
    round(&mut v, &m, &SIGMA[8]);
    round(&mut v, &m, &SIGMA[9]);
    round(&mut v, &m, &SIGMA[0]);
    round(&mut v, &m, &SIGMA[1]);
    // Only the first output word is needed; its little-endian bytes read
    // big-endian are the byte-swapped word.
    (h0 ^ v[0] ^ v[8]).swap_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use blake2::digest::consts::U8;
    use blake2::{Blake2b, Digest};

    fn reference(bytes: &[u8]) -> u64 {
        u64::from_be_bytes(Blake2b::<U8>::digest(bytes).into())
    }

    #[test]
    fn matches_the_blake2_crate() {
        let mut data = [0u8; BLOCK_BYTES];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for (i, b) in data.iter_mut().enumerate() {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(i as u64);
            *b = (x >> 56) as u8;
        }
        for len in 0..=BLOCK_BYTES {
            assert_eq!(
                blake2b64_one_block(&data[..len]),
                reference(&data[..len]),
                "len {len}"
            );
        }
        assert_eq!(blake2b64_one_block(b"t-1"), reference(b"t-1"));
    }
}
