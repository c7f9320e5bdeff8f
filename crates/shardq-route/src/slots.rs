//! Redis Cluster hash slots: the hashtag rule and CRC16 mod 16384, and the
//! table that deals slots to shards.
//!
//! Hashtag: the bytes between the first `{` and the next `}` after it, when
//! that span is non-empty; otherwise the whole key.
//!
//! Dealing: a slot listed in an active shard's `slots` ranges belongs to that
//! shard. Every other slot is dealt by unweighted or weighted rendezvous (see
//! [`crate::rendezvous`]) over the active shards, with the slot number in
//! decimal as the key (`h("{name}:{slot}")`), so adding a shard moves only
//! about 1/(N+1) of the slots.

use crate::hash::{crc16, HashFn};
use crate::rendezvous::Rendezvous;

/// Number of Redis Cluster hash slots.
pub const SLOT_COUNT: usize = 16384;

/// The part of `key` Redis Cluster hashes.
pub fn hashtag(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{') {
        let rest = &key[open + 1..];
        if let Some(close) = rest.iter().position(|&b| b == b'}') {
            if close > 0 {
                return &rest[..close];
            }
        }
    }
    key
}

/// The Redis Cluster slot of `key`.
#[inline]
pub fn slot(key: &[u8]) -> u16 {
    crc16(hashtag(key)) % SLOT_COUNT as u16
}

/// Slot -> active position table.
#[derive(Debug, Clone)]
pub struct SlotTable {
    owners: Box<[u32]>,
}

impl SlotTable {
    /// Builds the table. `explicit[slot]` is the active position that lists
    /// the slot in its ranges, if any.
    pub fn build<'a>(
        hash: HashFn,
        shards: impl Iterator<Item = (&'a str, u32)> + Clone,
        explicit: &[Option<u32>],
    ) -> SlotTable {
        let hrw = Rendezvous::build(shards);
        let mut owners = vec![0u32; SLOT_COUNT].into_boxed_slice();
        for (s, owner) in owners.iter_mut().enumerate() {
            *owner = match explicit.get(s).copied().flatten() {
                Some(pos) => pos,
                None => hrw.lookup(hash, s.to_string().as_bytes()),
            };
        }
        SlotTable { owners }
    }

    /// Renames every owner through `f` (the router stores map indexes).
    pub fn map_owners(&mut self, f: impl Fn(u32) -> u32) {
        for o in self.owners.iter_mut() {
            *o = f(*o);
        }
    }

    /// Owner of `slot` (an active position, or what `map_owners` made it).
    #[inline]
    pub fn owner(&self, slot: u16) -> u32 {
        self.owners[slot as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_cluster_vectors() {
        let cases: &[(&str, u16)] = &[
            ("123456789", 12739),
            ("somekey", 11058),
            ("foo{hash_tag}", 2515),
            ("{user1000}.following", 3443),
            ("{user1000}.followers", 3443),
        ];
        for (key, want) in cases {
            assert_eq!(slot(key.as_bytes()), *want, "slot({key:?})");
        }
    }

    #[test]
    fn hashtag_rules() {
        let cases: &[(&str, &str)] = &[
            ("{user1000}.following", "user1000"),
            ("foo{}{bar}", "foo{}{bar}"),
            ("foo{{bar}}zap", "{bar"),
            ("foo{bar}{zap}", "bar"),
            ("no-braces", "no-braces"),
            ("open{only", "open{only"),
            ("", ""),
        ];
        for (key, want) in cases {
            assert_eq!(hashtag(key.as_bytes()), want.as_bytes(), "hashtag({key:?})");
        }
    }
}
