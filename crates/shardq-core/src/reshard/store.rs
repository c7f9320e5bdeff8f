//! The map store (`MapStore`): where the shard map, the pending target, the
//! rebalance lock and the deployment settings live, and `update_setting`, the
//! one way a setting changes.

use super::*;

/// Where the shard map lives: a file in a data directory, a key in Redis.
pub trait MapStore: Send + Sync {
    /// The published map.
    fn load(&self) -> Result<ShardMap, ReshardError>;
    /// Publishes `map` if the published version is still `expected_version`
    /// (compare-and-set); `map.version` must be greater.
    fn publish(&self, map: &ShardMap, expected_version: u64) -> Result<(), ReshardError>;
    /// The map a rebalance should reach, if one is pending.
    fn load_target(&self) -> Result<Option<ShardMap>, ReshardError>;
    /// Records `target` as the pending target (under the rebalance lock:
    /// every operation that changes the target holds it).
    fn store_target(&self, target: &ShardMap) -> Result<(), ReshardError>;
    /// Clears the pending target if it is still `reached` (the target a
    /// finished rebalance published; versions aside): compare-and-delete,
    /// so a target recorded while the rebalance ran (its lock lapsed and
    /// an operator's change took it) is never erased. `Ok(true)` when
    /// cleared or none is pending; `Ok(false)` when another target is
    /// pending, and it stays.
    fn clear_target(&self, reached: &ShardMap) -> Result<bool, ReshardError>;
    /// Under the lock: fails ([`ReshardError::LockLost`]) once the store knows
    /// the lock was lost (a renewal found another holder or none). A
    /// rebalance asks between its steps and stops; a store whose lock
    /// lasts exactly as long as its holder never loses it (the default).
    fn check_lock(&self) -> Result<(), ReshardError> {
        Ok(())
    }
    /// Takes the rebalance lock; the guard releases it on drop. A second
    /// holder gets [`ReshardError::Busy`].
    fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, ReshardError>;
    /// Under the lock: a number larger than every earlier rebalance's
    /// (its *epoch*), which its writes to the shards carry
    /// ([`MoveKeys::enter_rebalance`]). A store whose lock can lapse
    /// while its holder lives (a lease, as on Redis) must give one; 0
    /// (the default) means the lock lasts exactly as long as its holder.
    fn rebalance_epoch(&self) -> Result<u64, ReshardError> {
        Ok(0)
    }
    /// A deployment setting by name ([`SETTING_RETRY`]): the JSON document
    /// stored beside the map, if one is.
    fn load_setting(&self, name: &str) -> Result<Option<String>, ReshardError> {
        let _ = name;
        Ok(None)
    }
    /// Compare-and-set of a deployment setting: replaces it with `value`
    /// (`None` clears it) only if it still holds `expected` (`None`: it is
    /// unset). `Ok(true)` once stored, for every process of the deployment
    /// to read; `Ok(false)` when another writer changed it first, and
    /// nothing was stored. The one primitive every settings change goes
    /// through ([`update_setting`]), so no acknowledged change is lost to
    /// a concurrent writer in this process, another process or another
    /// server.
    fn swap_setting(
        &self,
        name: &str,
        expected: Option<&str>,
        value: Option<&str>,
    ) -> Result<bool, ReshardError> {
        let _ = (name, expected, value);
        Err(ReshardError::Invalid(
            "this map store keeps no deployment settings".into(),
        ))
    }
    /// Stores (or, with `None`, clears) a deployment setting whatever it
    /// holds: for a writer that owns the whole setting (a rebalance's
    /// progress). Changes that read the setting first use
    /// [`update_setting`].
    fn store_setting(&self, name: &str, value: Option<&str>) -> Result<(), ReshardError> {
        update_setting(self, name, |_| {
            Ok::<_, ReshardError>((value.map(str::to_string), ()))
        })
    }
}

/// Compare-and-set rounds [`update_setting`] tries before it reports the
/// setting as too busy: each lost round means another writer's change was
/// stored, so this bounds only a writer that keeps losing.
pub const SETTING_SWAP_TRIES: u32 = 200;

/// Changes deployment setting `name` atomically against every other
/// writer: reads it, asks `change` for the new text (given the current
/// one) and stores it with [`MapStore::swap_setting`]; when another
/// writer got there first, reads again and asks again. `change` returns
/// the new text (`None` clears the setting) and a result for the caller;
/// a new text equal to the current one writes nothing. An `Ok` means
/// the change is stored.
pub fn update_setting<S, R, E>(
    store: &S,
    name: &str,
    mut change: impl FnMut(Option<&str>) -> Result<(Option<String>, R), E>,
) -> Result<R, E>
where
    S: MapStore + ?Sized,
    E: From<ReshardError>,
{
    for round in 0..SETTING_SWAP_TRIES {
        let current = store.load_setting(name)?;
        let (next, out) = change(current.as_deref())?;
        if next == current {
            return Ok(out);
        }
        if store.swap_setting(name, current.as_deref(), next.as_deref())? {
            return Ok(out);
        }
        // Lost to another writer: a short, growing pause spreads the
        // retries of many writers racing on one setting.
        std::thread::sleep(std::time::Duration::from_micros(
            50 * u64::from(round.min(40) + 1),
        ));
    }
    Err(ReshardError::Unavailable(format!(
        "the deployment setting {name:?} changed under this change {SETTING_SWAP_TRIES} times in          a row (other writers keep changing it); nothing was stored: try again"
    ))
    .into())
}

/// The deployment setting holding the retry backoff (a `Backoff` as JSON).
pub const SETTING_RETRY: &str = "retry";
/// The deployment setting holding how long finished jobs are kept (a
/// `Retention` as JSON).
pub const SETTING_RETENTION: &str = "retention";
/// The deployment setting holding flow control (a `FlowSettings` as JSON:
/// policies by key and prefix, and groups).
pub const SETTING_FLOW: &str = "flow";

/// Checks a setting's name: 1 to 32 lowercase ASCII letters and `-`.
pub fn validate_setting_name(name: &str) -> Result<(), ReshardError> {
    if name.is_empty()
        || name.len() > 32
        || !name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
    {
        return Err(ReshardError::Invalid(format!(
            "setting name {name:?}: 1 to 32 lowercase letters and `-`"
        )));
    }
    Ok(())
}
