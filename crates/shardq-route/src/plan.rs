//! Move plans: which keys change shard between two map versions.
//!
//! A plan is computed over a concrete list of keys (the tenants an operator
//! knows about, or a generated pattern); it does no I/O.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::router::Router;

/// Where keys go when a map changes.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Plan {
    /// Keys examined.
    pub keys: u64,
    /// Keys whose shard differs between the maps.
    pub moved: u64,
    /// `moved / keys` (0 when there are no keys).
    pub moved_fraction: f64,
    /// from -> to -> count, for moved keys only.
    pub moves: BTreeMap<String, BTreeMap<String, u64>>,
    /// shard -> keys under the old map (every shard of the map, zero included).
    pub before: BTreeMap<String, u64>,
    /// shard -> keys under the new map (every shard of the map, zero included).
    pub after: BTreeMap<String, u64>,
    /// max/min keys per routable shard under the old map.
    pub before_max_min: f64,
    /// max/min keys per routable shard under the new map.
    pub after_max_min: f64,
}

impl Plan {
    /// Computes the plan for `keys` going from `from` to `to`.
    pub fn compute<'k>(
        from: &Router,
        to: &Router,
        keys: impl IntoIterator<Item = &'k str>,
    ) -> Plan {
        let fm = from.map();
        let tm = to.map();
        let mut before_n = vec![0u64; fm.shards.len()];
        let mut after_n = vec![0u64; tm.shards.len()];
        let mut moves_n: BTreeMap<(usize, usize), u64> = BTreeMap::new();
        let mut plan = Plan::default();
        for key in keys {
            let a = from.route_index(key.as_bytes());
            let b = to.route_index(key.as_bytes());
            before_n[a] += 1;
            after_n[b] += 1;
            plan.keys += 1;
            if fm.shards[a].name != tm.shards[b].name {
                plan.moved += 1;
                *moves_n.entry((a, b)).or_default() += 1;
            }
        }
        for ((a, b), n) in moves_n {
            plan.moves
                .entry(fm.shards[a].name.clone())
                .or_default()
                .insert(tm.shards[b].name.clone(), n);
        }
        plan.before = fm
            .shards
            .iter()
            .zip(&before_n)
            .map(|(s, &n)| (s.name.clone(), n))
            .collect();
        plan.after = tm
            .shards
            .iter()
            .zip(&after_n)
            .map(|(s, &n)| (s.name.clone(), n))
            .collect();
        plan.moved_fraction = if plan.keys == 0 {
            0.0
        } else {
            plan.moved as f64 / plan.keys as f64
        };
        plan.before_max_min = max_min(routable_counts(from, &before_n));
        plan.after_max_min = max_min(routable_counts(to, &after_n));
        plan
    }

    /// Fraction of moved keys that went to `shard`.
    pub fn moved_to_fraction(&self, shard: &str) -> f64 {
        if self.moved == 0 {
            return 0.0;
        }
        let to: u64 = self.moves.values().filter_map(|m| m.get(shard)).sum();
        to as f64 / self.moved as f64
    }
}

/// Counts of shards that are active or hold an override.
fn routable_counts<'a>(router: &'a Router, counts: &'a [u64]) -> impl Iterator<Item = u64> + 'a {
    router
        .map()
        .shards
        .iter()
        .zip(counts)
        .filter(|(s, &n)| s.state == crate::ShardState::Active || n > 0)
        .map(|(_, &n)| n)
}

/// max/min of the counts; infinity if some count is zero, 1 if empty.
pub fn max_min(counts: impl Iterator<Item = u64>) -> f64 {
    let mut lo = u64::MAX;
    let mut hi = 0u64;
    let mut any = false;
    for n in counts {
        any = true;
        lo = lo.min(n);
        hi = hi.max(n);
    }
    if !any {
        1.0
    } else if lo == 0 {
        f64::INFINITY
    } else {
        hi as f64 / lo as f64
    }
}
