//! `KeyInventory` on Redis: the keys with work on a shard, read in pages.

use super::*;

/// `HSCAN` count hint of one inventory script call (routing keys looked at).
pub const INVENTORY_KEYS_PER_CALL: usize = 1024;
/// Most keys with work one inventory reports per shard; a shard with more
/// is refused with an error rather than scanned without end.
pub const INVENTORY_KEYS_MAX: usize = 4_000_000;

impl RedisBackend {
    /// Who holds `shard`'s lease and until when (ms, server clock), if
    /// anyone does and it has not lapsed.
    pub fn lease_holder(&self, shard: &str) -> Result<Option<(String, u64)>, QueueError> {
        let s = self.shard(shard)?;
        let key = &s.keys[keys::LEASE_PART];
        let (owner, until): (Option<String>, Option<u64>) = s.node.run(&s.name, |con, _| {
            redis::cmd("HMGET")
                .arg(key)
                .arg("owner")
                .arg("until")
                .query(con)
        })?;
        Ok(match (owner, until) {
            (Some(o), Some(u)) if !o.is_empty() && u > 0 => Some((o, u)),
            _ => None,
        })
    }

    pub(super) fn too_many_keys(s: &ShardRef) -> QueueError {
        QueueError::InventoryTooLarge {
            shard: format!("{} at {}", s.name, s.url),
            max: INVENTORY_KEYS_MAX,
        }
    }
}

impl shardq_core::reshard::KeyInventory for RedisBackend {
    /// One bounded walk of the shard's `keys` hash by `HSCAN` (a field per
    /// key with a waiting job or one in flight), then of `deadn` for keys
    /// whose only jobs are dead letters: those tie the key to this shard
    /// too, so a rebalance keeps them pinned like the embedded engine does.
    /// Concurrent writes never make it loop. Not one atomic snapshot: a
    /// rebalance scans again after fencing, which catches what raced.
    fn keys_with_work(&self, shard: &str) -> Result<Vec<(String, KeyCounts)>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut found: std::collections::BTreeMap<String, KeyCounts> = Default::default();
        let mut cursor = "k0".to_string();
        loop {
            let v = self.script(s, &self.inner.scripts.inventory, "", &|c, _| {
                c.arg(&cursor).arg(INVENTORY_KEYS_PER_CALL);
            })?;
            let it = reply::items(&v);
            let bad = || self.protocol(s, "inventory reply is malformed");
            let next = it.first().and_then(reply::string).ok_or_else(bad)?;
            for k in it[1..].chunks(4) {
                if k.len() != 4 {
                    return Err(bad());
                }
                let n = |i: usize| reply::u64(&k[i]).ok_or_else(bad);
                // HSCAN may return a key twice; the later look is fresher.
                found.insert(
                    reply::string(&k[0]).ok_or_else(bad)?,
                    KeyCounts {
                        depth: n(1)?,
                        in_flight: n(2)?,
                        dead: n(3)?,
                    },
                );
            }
            if found.len() > INVENTORY_KEYS_MAX {
                return Err(Self::too_many_keys(s));
            }
            if next == "0" {
                break;
            }
            cursor = next;
        }
        Ok(found.into_iter().collect())
    }
}
