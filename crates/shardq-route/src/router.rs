//! The router: a shard map compiled for fast lookups.
//!
//! Routing rule: an override wins (whatever the shard's state); otherwise the
//! map's algorithm picks among the `active` shards only. A router is an
//! immutable value built from one map version, so routing is a pure function
//! of (map, key); to follow a new map version, build a new router.

use std::collections::HashMap;

use xxhash_rust::xxh3::Xxh3Builder;

use crate::error::MapError;
use crate::hash::HashFn;
use crate::jump::jump;
use crate::map::{Algorithm, ShardMap, ShardState};
use crate::rendezvous::Rendezvous;
use crate::ring::Ring;
use crate::slots::{slot, SlotTable, SLOT_COUNT};

#[derive(Debug, Clone)]
enum Compiled {
    Modulo,
    Ring(Ring),
    Rendezvous(Rendezvous),
    Jump,
    Slots(SlotTable),
}

/// A compiled shard map.
#[derive(Debug, Clone)]
pub struct Router {
    map: ShardMap,
    /// Map indexes of the active shards, in map order.
    active: Vec<u32>,
    compiled: Compiled,
    overrides: HashMap<Box<[u8]>, u32, Xxh3Builder>,
}

impl Router {
    /// Validates and compiles `map`.
    pub fn new(map: ShardMap) -> Result<Router, MapError> {
        map.validate()?;
        let active: Vec<u32> = map
            .shards
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state == ShardState::Active)
            .map(|(i, _)| i as u32)
            .collect();
        let pairs = || {
            active.iter().map(|&i| {
                let s = &map.shards[i as usize];
                (s.name.as_str(), s.weight)
            })
        };
        let compiled = match map.algorithm {
            Algorithm::Modulo => Compiled::Modulo,
            Algorithm::Jump => Compiled::Jump,
            Algorithm::Ring => {
                let mut ring = Ring::build(map.hash, map.vnodes, pairs());
                // Owners as map indexes: a lookup needs no active-list load.
                ring.map_owners(|pos| active[pos as usize]);
                Compiled::Ring(ring)
            }
            Algorithm::Rendezvous => Compiled::Rendezvous(Rendezvous::build(pairs())),
            Algorithm::Slots => {
                let mut explicit: Vec<Option<u32>> = vec![None; SLOT_COUNT];
                for (pos, &i) in active.iter().enumerate() {
                    for r in &map.shards[i as usize].slots {
                        for s in r.start..=r.end {
                            explicit[s as usize] = Some(pos as u32);
                        }
                    }
                }
                let mut table = SlotTable::build(map.hash, pairs(), &explicit);
                table.map_owners(|pos| active[pos as usize]);
                Compiled::Slots(table)
            }
        };
        let mut overrides =
            HashMap::with_capacity_and_hasher(map.overrides.len(), Xxh3Builder::new());
        for (key, shard) in &map.overrides {
            // validate() guarantees the shard exists.
            if let Some(i) = map.shard_index(shard) {
                overrides.insert(key.as_bytes().to_vec().into_boxed_slice(), i as u32);
            }
        }
        Ok(Router {
            map,
            active,
            compiled,
            overrides,
        })
    }

    /// Parses, validates and compiles a YAML shard map.
    pub fn from_yaml(text: &str) -> Result<Router, MapError> {
        Router::new(ShardMap::from_yaml(text)?)
    }

    /// The map this router was built from.
    pub fn map(&self) -> &ShardMap {
        &self.map
    }

    /// The map version.
    pub fn version(&self) -> u64 {
        self.map.version
    }

    /// Map index of the shard owning `key` (overrides first).
    #[inline]
    pub fn route_index(&self, key: &[u8]) -> usize {
        if !self.overrides.is_empty() {
            if let Some(&i) = self.overrides.get(key) {
                return i as usize;
            }
        }
        self.computed_index(key)
    }

    /// Map index of the shard the algorithm picks for `key`, ignoring overrides.
    #[inline]
    pub fn computed_index(&self, key: &[u8]) -> usize {
        let hash = self.map.hash;
        let pos = match &self.compiled {
            Compiled::Ring(ring) => return ring.lookup(hash.hash(key)) as usize,
            Compiled::Modulo => (hash.hash(key) % self.active.len() as u64) as u32,
            Compiled::Rendezvous(hrw) => hrw.lookup(hash, key),
            Compiled::Jump => jump(hash.hash(key), self.active.len() as u32),
            Compiled::Slots(table) => return table.owner(slot(key)) as usize,
        };
        self.active[pos as usize] as usize
    }

    /// Name of the shard owning `key`.
    #[inline]
    pub fn route(&self, key: &str) -> &str {
        &self.map.shards[self.route_index(key.as_bytes())].name
    }

    /// Name of the shard the algorithm picks for `key`, ignoring overrides.
    pub fn computed(&self, key: &str) -> &str {
        &self.map.shards[self.computed_index(key.as_bytes())].name
    }

    /// The hash function of the map.
    pub fn hash(&self) -> HashFn {
        self.map.hash
    }
}
