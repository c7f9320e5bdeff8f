//! The operations that record a target map (`add_shard`, `remove_shard`,
//! `set_weight`, `pin`, `unpin`), each under the rebalance lock; `rebalance`
//! then walks to it.

use super::*;

/// The pending target, or what the published map implies (warming shards
/// become active, draining shards leave).
pub fn current_target(store: &dyn MapStore) -> Result<ShardMap, ReshardError> {
    match store.load_target()? {
        Some(t) => Ok(t),
        None => Ok(implied_target(&store.load()?)),
    }
}

/// The map `map` is heading to when no target was recorded.
pub fn implied_target(map: &ShardMap) -> ShardMap {
    let mut t = map.clone();
    t.shards.retain(|s| s.state != ShardState::Draining);
    for s in &mut t.shards {
        s.state = ShardState::Active;
    }
    t.overrides
        .retain(|_, shard| t.shards.iter().any(|s| &s.name == shard));
    t
}

/// Whether two targets are the same map, their versions aside (a stored
/// target carries version 0): what [`MapStore::clear_target`] compares.
pub fn same_target(a: &ShardMap, b: &ShardMap) -> bool {
    with_version(a, 0) == with_version(b, 0)
}

pub(super) fn save_target(store: &dyn MapStore, target: &ShardMap) -> Result<(), ReshardError> {
    let mut checked = target.clone();
    // Validation needs an active shard; the version is irrelevant for a target.
    checked.validate()?;
    checked.version = 0;
    store.store_target(&checked)
}

/// Deploys shard `name` as `warming` (visible, receiving nothing) and makes
/// it active in the target. Returns the published version.
pub fn add_shard(
    store: &dyn MapStore,
    name: &str,
    weight: u32,
    url: Option<String>,
) -> Result<u64, ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let cur = store.load()?;
    let mut target = current_target(store)?;
    let mut shard = Shard::new(name);
    shard.weight = weight;
    shard.url = url;
    // An add stopped between recording the target and publishing the
    // warming map left the shard in the target only: the same add, run
    // again, finishes it.
    let half_done = cur.shard(name).is_none()
        && target
            .shard(name)
            .is_some_and(|s| s.weight == shard.weight && s.url == shard.url);
    if cur.shard(name).is_some() || (target.shard(name).is_some() && !half_done) {
        return Err(ReshardError::Invalid(format!(
            "shard {name:?} already exists in the map"
        )));
    }
    let mut next = cur.clone();
    next.version = cur.version + 1;
    next.shards.push(Shard {
        state: ShardState::Warming,
        ..shard.clone()
    });
    next.validate()?;
    if !half_done {
        target.shards.push(shard);
        save_target(store, &target)?;
    }
    store.publish(&next, cur.version)?;
    Ok(next.version)
}

/// Records that shard `name` leaves the map; [`rebalance`] drains it.
pub fn remove_shard(store: &dyn MapStore, name: &str) -> Result<(), ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let mut target = current_target(store)?;
    let before = target.shards.len();
    target.shards.retain(|s| s.name != name);
    if target.shards.len() == before {
        let shards: Vec<&str> = target.shards.iter().map(|s| s.name.as_str()).collect();
        return Err(ReshardError::Invalid(format!(
            "no shard {name:?} in the target map (its shards: {}); a shard whose `add-shard` was stopped before it published the map is not in it: rerun that `add-shard` to finish adding it",
            shards.join(", ")
        )));
    }
    if let Some((key, _)) = target.overrides.iter().find(|(_, s)| *s == name) {
        return Err(ReshardError::Invalid(format!(
            "key {key:?} is pinned to shard {name:?}; unpin it (or pin it elsewhere) before removing the shard"
        )));
    }
    save_target(store, &target)
}

/// Records a new weight for shard `name`; [`rebalance`] moves the keys.
pub fn set_weight(store: &dyn MapStore, name: &str, weight: u32) -> Result<(), ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let mut target = current_target(store)?;
    let shard = target
        .shards
        .iter_mut()
        .find(|s| s.name == name)
        .ok_or_else(|| ReshardError::Invalid(format!("no shard {name:?} in the target map")))?;
    shard.weight = weight;
    save_target(store, &target)
}

/// Records a pin of `key` to `shard`; [`rebalance`] moves it with its backlog.
pub fn pin(store: &dyn MapStore, key: &str, shard: &str) -> Result<(), ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let mut target = current_target(store)?;
    if target.shard(shard).is_none() {
        return Err(ReshardError::Invalid(format!(
            "no shard {shard:?} in the target map"
        )));
    }
    target.overrides.insert(key.to_string(), shard.to_string());
    save_target(store, &target)
}

/// Records the removal of `key`'s pin; [`rebalance`] moves it back. `false`:
/// the key was not pinned, and nothing changed.
pub fn unpin(store: &dyn MapStore, key: &str) -> Result<bool, ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let mut target = current_target(store)?;
    // Unpinning a key that is not pinned asks for what already holds.
    if target.overrides.remove(key).is_none() {
        return Ok(false);
    }
    save_target(store, &target)?;
    Ok(true)
}
