//! Phase 1 of a rebalance: the keys with work that move (`plan_moves`), the
//! intermediate map that pins them, and the lift of a fence a killed
//! rebalance left (`lift_orphaned_fence`).

use super::*;

/// A key with work whose owner changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedMove {
    /// The key.
    pub key: String,
    /// Shard it is on now.
    pub from: String,
    /// Shard it will be on.
    pub to: String,
    /// Its queued plus in-flight jobs on `from` when scanned.
    pub jobs: u64,
}

/// Ends the fence of a rebalance that died between fencing every shard at
/// the next map version and publishing that version (phase 1): its shards
/// refuse every producer until a map at least that new is published. When
/// no rebalance holds the lock and some shard's fence is ahead of the
/// published map, the published map is published again, unchanged but for
/// a version that reaches every fence, so producers route as before and go
/// in. A rebalance that only stalled (its lock lapsed) then fails its own
/// publish (the version moved on) and publishes nothing of what it
/// planned. Returns whether it published; `Ok(false)` when a rebalance is
/// running (it will publish) or no fence is ahead.
pub fn lift_orphaned_fence<B: QueueBackend + ?Sized>(
    backend: &B,
    store: &dyn MapStore,
) -> Result<bool, ReshardError> {
    let _lock = match store.try_lock_rebalance() {
        Ok(lock) => lock,
        Err(ReshardError::Busy { .. }) => return Ok(false),
        Err(e) => return Err(e),
    };
    let cur = store.load()?;
    // A shard that cannot be read is passed by: the routing does not
    // change, so the version the readable fences ask for is safe to publish.
    let mut ahead = cur.version;
    for shard in &cur.shards {
        if let Ok(fence) = backend.fence(&shard.name) {
            ahead = ahead.max(fence.map_version_min);
        }
    }
    if ahead <= cur.version {
        return Ok(false);
    }
    publish_next(store, &cur, &with_version(&cur, ahead))?;
    Ok(true)
}

/// Every key with work whose owner differs between `cur` and `target`.
pub fn plan_moves<B: QueueBackend + KeyInventory + ?Sized>(
    backend: &B,
    cur: &ShardMap,
    target: &ShardMap,
) -> Result<Vec<PlannedMove>, ReshardError> {
    let to = Router::new(with_version(target, cur.version))?;
    let now = Router::new(cur.clone())?;
    let mut moves = Vec::new();
    for shard in &cur.shards {
        let with_work: Vec<(String, KeyCounts)> = backend
            .keys_with_work(&shard.name)?
            .into_iter()
            .filter(|(_, c)| has_work(c) > 0)
            .collect();
        // A key with live dedup records and no jobs moves too (with
        // drain-then-switch, which copies its records): its next enqueue
        // must find them where it lands.
        let known: std::collections::BTreeSet<&str> =
            with_work.iter().map(|(k, _)| k.as_str()).collect();
        let dedup_only: Vec<(String, KeyCounts)> = backend
            .dedup_keys(&shard.name)?
            .into_iter()
            // An old shard keeps the copies of a key that moved away.
            .filter(|k| !known.contains(k.as_str()) && now.route(k) == shard.name)
            .map(|k| (k, KeyCounts::default()))
            .collect();
        for (key, counts) in with_work.into_iter().chain(dedup_only) {
            // The key moves from where its work is to where the target routes it.
            let to_shard = to.route(&key);
            if to_shard != shard.name {
                moves.push(PlannedMove {
                    key,
                    from: shard.name.clone(),
                    to: to_shard.to_string(),
                    jobs: has_work(&counts),
                });
            }
        }
    }
    moves.sort_by(|x, y| x.key.cmp(&y.key));
    Ok(moves)
}

/// Jobs that tie a key to its shard: queued, delayed, in flight, and dead
/// letters (a dead job retried later runs on the shard that holds it, so a
/// key with one must not move until it is retried or purged).
pub(super) fn has_work(c: &KeyCounts) -> u64 {
    c.depth + c.in_flight + c.dead
}

pub(super) fn with_version(map: &ShardMap, version: u64) -> ShardMap {
    let mut m = map.clone();
    m.version = version;
    m
}

/// The intermediate map: the target's shards, removed shards as draining,
/// and `pins` (key -> current shard) on top of the target's overrides.
pub(super) fn intermediate(
    cur: &ShardMap,
    target: &ShardMap,
    pins: &BTreeMap<String, String>,
) -> ShardMap {
    let mut next = target.clone();
    next.version = cur.version + 1;
    for s in &cur.shards {
        if next.shard(&s.name).is_none() {
            next.shards.push(Shard {
                state: ShardState::Draining,
                ..s.clone()
            });
        }
    }
    for (k, shard) in pins {
        next.overrides.insert(k.clone(), shard.clone());
    }
    next
}

/// True when `cur` already has the target's routing shape (phase 1 done).
pub(super) fn is_intermediate(cur: &ShardMap, target: &ShardMap) -> bool {
    let same_shape =
        cur.algorithm == target.algorithm && cur.hash == target.hash && cur.vnodes == target.vnodes;
    let targets_present = target.shards.iter().all(|t| {
        cur.shard(&t.name)
            .is_some_and(|c| c.weight == t.weight && c.state == t.state && c.slots == t.slots)
    });
    let extras_draining = cur
        .shards
        .iter()
        .all(|c| target.shard(&c.name).is_some() || c.state == ShardState::Draining);
    // A pin the published map does not hold yet changes that key's route:
    // phase 1 must pin it where its work is first (a pin already published,
    // to any shard, is either in place or a pending switch of phase 2).
    let pins_present = target
        .overrides
        .keys()
        .all(|k| cur.overrides.contains_key(k));
    same_shape && targets_present && extras_draining && pins_present
}

/// Keys pinned in `cur` away from where the target routes them.
pub(super) fn pending_switches(
    cur: &ShardMap,
    target_router: &Router,
) -> Vec<(String, String, String)> {
    cur.overrides
        .iter()
        .filter_map(|(k, shard)| {
            let to = target_router.route(k);
            (to != shard).then(|| (k.clone(), shard.clone(), to.to_string()))
        })
        .collect()
}

pub(super) fn publish_next(
    store: &dyn MapStore,
    cur: &ShardMap,
    next: &ShardMap,
) -> Result<(), ReshardError> {
    next.validate()?;
    store.publish(next, cur.version)
}

impl fmt::Display for PlannedMove {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}\t{} -> {}\t{} jobs",
            self.key, self.from, self.to, self.jobs
        )
    }
}
