//! [`HookedMaps`]: a map store that passes every call to another, except
//! the ones a test takes over, so a test's faulty store (one whose publish
//! fails, whose settings are read-only, whose target changes under a run)
//! is a hook, not a hand-written copy of the whole trait. A map read can
//! be hooked too (to let time pass in the middle of a caller's work).

use shardq_core::reshard::{MapStore, ReshardError};
use shardq_route::ShardMap;

type PublishHook<S> = Box<dyn Fn(&S, &ShardMap, u64) -> Result<(), ReshardError> + Send + Sync>;
type LoadHook<S> = Box<dyn Fn(&S) -> Result<ShardMap, ReshardError> + Send + Sync>;
type SwapHook<S> =
    Box<dyn Fn(&S, &str, Option<&str>, Option<&str>) -> Result<bool, ReshardError> + Send + Sync>;

/// `inner` with hooks; see the module docs.
pub struct HookedMaps<S> {
    /// The store every call goes to, hooked or not.
    pub inner: S,
    load: Option<LoadHook<S>>,
    publish: Option<PublishHook<S>>,
    swap_setting: Option<SwapHook<S>>,
}

impl<S: MapStore> HookedMaps<S> {
    /// `inner` with no hook yet.
    pub fn new(inner: S) -> HookedMaps<S> {
        HookedMaps {
            inner,
            load: None,
            publish: None,
            swap_setting: None,
        }
    }

    /// Every read of the map goes to `f` (given the inner store) instead.
    pub fn on_load(
        mut self,
        f: impl Fn(&S) -> Result<ShardMap, ReshardError> + Send + Sync + 'static,
    ) -> Self {
        self.load = Some(Box::new(f));
        self
    }

    /// Every publish goes to `f` (given the inner store) instead.
    pub fn on_publish(
        mut self,
        f: impl Fn(&S, &ShardMap, u64) -> Result<(), ReshardError> + Send + Sync + 'static,
    ) -> Self {
        self.publish = Some(Box::new(f));
        self
    }

    /// Every settings compare-and-set goes to `f` (given the inner store)
    /// instead.
    pub fn on_swap_setting(
        mut self,
        f: impl Fn(&S, &str, Option<&str>, Option<&str>) -> Result<bool, ReshardError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        self.swap_setting = Some(Box::new(f));
        self
    }
}

impl<S: MapStore> MapStore for HookedMaps<S> {
    fn load(&self) -> Result<ShardMap, ReshardError> {
        match &self.load {
            Some(f) => f(&self.inner),
            None => self.inner.load(),
        }
    }
    fn publish(&self, map: &ShardMap, expected_version: u64) -> Result<(), ReshardError> {
        match &self.publish {
            Some(f) => f(&self.inner, map, expected_version),
            None => self.inner.publish(map, expected_version),
        }
    }
    fn load_target(&self) -> Result<Option<ShardMap>, ReshardError> {
        self.inner.load_target()
    }
    fn store_target(&self, target: &ShardMap) -> Result<(), ReshardError> {
        self.inner.store_target(target)
    }
    fn clear_target(&self, reached: &ShardMap) -> Result<bool, ReshardError> {
        self.inner.clear_target(reached)
    }
    fn check_lock(&self) -> Result<(), ReshardError> {
        self.inner.check_lock()
    }
    fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, ReshardError> {
        self.inner.try_lock_rebalance()
    }
    fn rebalance_epoch(&self) -> Result<u64, ReshardError> {
        self.inner.rebalance_epoch()
    }
    fn load_setting(&self, name: &str) -> Result<Option<String>, ReshardError> {
        self.inner.load_setting(name)
    }
    fn swap_setting(
        &self,
        name: &str,
        expected: Option<&str>,
        value: Option<&str>,
    ) -> Result<bool, ReshardError> {
        match &self.swap_setting {
            Some(f) => f(&self.inner, name, expected, value),
            None => self.inner.swap_setting(name, expected, value),
        }
    }
}
