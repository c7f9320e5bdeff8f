//! Stable 64-bit hash functions over the UTF-8 bytes of a key.
//!
//! Every function here must give the same answer in every release and every
//! language, because producers written in different languages must agree on
//! where a key lives. That is why `std::hash::DefaultHasher` (whose output
//! changed between Rust releases) is never used, and why each function is
//! pinned by vectors in `testdata/routing-vectors.json`.
//!
//! This module does no I/O and never allocates.

use std::fmt;
use std::hash::Hasher;
use std::str::FromStr;

use blake2::digest::consts::U8;
use blake2::{Blake2b, Digest};
use crc::{Crc, CRC_16_XMODEM};

/// CRC16-XMODEM (poly 0x1021, init 0, no reflection), the Redis Cluster CRC.
const CRC16: Crc<u16> = Crc::<u16>::new(&CRC_16_XMODEM);

/// A stable hash function a shard map may name in its `hash` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum HashFn {
    /// BLAKE2b with an 8-byte digest *parameter* (not a truncated 64-byte
    /// digest), read big-endian: Python's
    /// `int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "big")`.
    #[default]
    Blake2b64,
    /// XXH64 with seed 0.
    Xxh64,
    /// XXH3 64-bit with seed 0 and the default secret.
    Xxh3,
    /// MurmurHash3 x64_128 with seed 0; the first 64-bit half (`h1`), which
    /// is the low 64 bits of the 128-bit value and Python's
    /// `mmh3.hash64(b, 0, signed=False)[0]`.
    Murmur3,
    /// FNV-1a 64-bit (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
    Fnv1a64,
    /// CRC16-XMODEM widened to 64 bits. Poorly spread: offered for Redis
    /// Cluster compatibility, not as a ring hash.
    Crc16,
}

impl HashFn {
    /// Every hash function, in documentation order.
    pub const ALL: [HashFn; 6] = [
        HashFn::Blake2b64,
        HashFn::Xxh64,
        HashFn::Xxh3,
        HashFn::Murmur3,
        HashFn::Fnv1a64,
        HashFn::Crc16,
    ];

    /// The name used in shard maps and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            HashFn::Blake2b64 => "blake2b64",
            HashFn::Xxh64 => "xxh64",
            HashFn::Xxh3 => "xxh3",
            HashFn::Murmur3 => "murmur3",
            HashFn::Fnv1a64 => "fnv1a64",
            HashFn::Crc16 => "crc16",
        }
    }

    /// Hashes `bytes` to 64 bits.
    #[inline]
    pub fn hash(self, bytes: &[u8]) -> u64 {
        match self {
            HashFn::Blake2b64 => blake2b64(bytes),
            HashFn::Xxh64 => xxhash_rust::xxh64::xxh64(bytes, 0),
            HashFn::Xxh3 => xxhash_rust::xxh3::xxh3_64(bytes),
            HashFn::Murmur3 => murmur3_h1(bytes),
            HashFn::Fnv1a64 => fnv1a64(bytes),
            HashFn::Crc16 => u64::from(crc16(bytes)),
        }
    }
}

impl fmt::Display for HashFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for HashFn {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HashFn::ALL
            .into_iter()
            .find(|h| h.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = HashFn::ALL.iter().map(|h| h.name()).collect();
                format!("unknown hash {s:?}; expected one of {}", names.join(", "))
            })
    }
}

/// BLAKE2b-64, big-endian. Inputs of one block take a written-out path
/// (pinned to the `blake2` crate by its tests); longer ones use the crate.
#[inline]
pub fn blake2b64(bytes: &[u8]) -> u64 {
    if bytes.len() <= crate::blake2b_short::BLOCK_BYTES {
        return crate::blake2b_short::blake2b64_one_block(bytes);
    }
    let digest = Blake2b::<U8>::digest(bytes);
    u64::from_be_bytes(digest.into())
}

/// FNV-1a 64 through the `fnv` crate (its `write` is plain FNV-1a over bytes).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(bytes);
    hasher.finish()
}

/// MurmurHash3 x64_128, seed 0, first half `h1` (the low 64 bits).
pub fn murmur3_h1(bytes: &[u8]) -> u64 {
    let mut reader = bytes;
    // Reading from a byte slice cannot fail.
    let full = murmur3::murmur3_x64_128(&mut reader, 0).unwrap_or_default();
    full as u64
}

/// CRC16-XMODEM of `bytes`.
pub fn crc16(bytes: &[u8]) -> u16 {
    CRC16.checksum(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_check_value() {
        // The XMODEM check value, and the Redis Cluster spec's example.
        assert_eq!(crc16(b"123456789"), 0x31C3);
    }

    #[test]
    fn names_round_trip() {
        for h in HashFn::ALL {
            assert_eq!(h.name().parse::<HashFn>().unwrap(), h);
        }
        assert!("sha1".parse::<HashFn>().unwrap_err().contains("sha1"));
    }

    #[test]
    fn known_values() {
        // Published reference values of each algorithm for the empty input.
        assert_eq!(HashFn::Xxh64.hash(b""), 0xEF46DB3751D8E999);
        assert_eq!(HashFn::Xxh3.hash(b""), 0x2D06800538D394C2);
        assert_eq!(HashFn::Fnv1a64.hash(b""), 0xcbf29ce484222325);
        assert_eq!(HashFn::Fnv1a64.hash(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(HashFn::Murmur3.hash(b""), 0);
    }
}
