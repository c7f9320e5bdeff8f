//! The shard map in Redis seen through one data dir, and a coordinator that
//! follows it. Loading a newer map registers its new shards with the
//! backend (so producers and workers reach shards added while they run) and
//! refreshes the data dir's cached copy. This module must never publish a
//! map on its own initiative.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use shardq_core::reshard::{MapStore, ReshardError};
use shardq_core::{Coordinator, Ownership, QueueError};
use shardq_redis::{
    CoordinatorOptions, RedisBackend, RedisCoordinator, RedisMapStore, RedisOptions,
};
use shardq_route::ShardMap;

use crate::error::DeployError;
use crate::remote::{Remote, REMOTE_FILE};
use crate::{check_all, MAP_CACHE_FILE};

/// The shard map in Redis, seen through one data dir.
pub struct RedisMaps {
    store: RedisMapStore,
    backend: RedisBackend,
    cache: PathBuf,
    cached_version: AtomicU64,
    /// URLs for shards published without one (the demo adds a shard by
    /// name only; it decides where it lives when it deploys it).
    default_urls: Mutex<HashMap<String, String>>,
}

impl RedisMaps {
    /// Records that shard `name`, if published without a url, lives at `url`.
    pub fn assign_url(&self, name: &str, url: &str) {
        self.default_urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), url.to_string());
    }

    fn with_urls(&self, map: &ShardMap) -> ShardMap {
        let urls = self.default_urls.lock().unwrap_or_else(|e| e.into_inner());
        let mut m = map.clone();
        for s in &mut m.shards {
            if s.url.is_none() {
                s.url = urls.get(&s.name).cloned();
            }
        }
        m
    }

    fn seen(&self, map: &ShardMap) -> Result<(), ReshardError> {
        self.backend
            .sync_shards(map)
            .map_err(|e| ReshardError::store(e.kind(), e))?;
        if self.cached_version.swap(map.version, Ordering::SeqCst) != map.version {
            // The cache is only informative: a failed write is not an error.
            let _ = shardq_fs::layout::write_atomic(&self.cache, map.to_yaml().as_bytes());
        }
        Ok(())
    }
}

impl MapStore for RedisMaps {
    fn load(&self) -> Result<ShardMap, ReshardError> {
        let map = self.store.load()?;
        self.seen(&map)?;
        Ok(map)
    }
    fn publish(&self, map: &ShardMap, expected_version: u64) -> Result<(), ReshardError> {
        let map = self.with_urls(map);
        self.store.publish(&map, expected_version)?;
        self.seen(&map)
    }
    fn load_target(&self) -> Result<Option<ShardMap>, ReshardError> {
        self.store.load_target()
    }
    fn store_target(&self, target: &ShardMap) -> Result<(), ReshardError> {
        self.store.store_target(&self.with_urls(target))
    }
    fn clear_target(&self, reached: &ShardMap) -> Result<bool, ReshardError> {
        self.store.clear_target(&self.with_urls(reached))
    }
    fn check_lock(&self) -> Result<(), ReshardError> {
        self.store.check_lock()
    }
    fn load_setting(&self, name: &str) -> Result<Option<String>, ReshardError> {
        self.store.load_setting(name)
    }

    fn swap_setting(
        &self,
        name: &str,
        expected: Option<&str>,
        value: Option<&str>,
    ) -> Result<bool, ReshardError> {
        self.store.swap_setting(name, expected, value)
    }

    fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, ReshardError> {
        self.store.try_lock_rebalance()
    }

    fn rebalance_epoch(&self) -> Result<u64, ReshardError> {
        self.store.rebalance_epoch()
    }
}

/// Opens the Redis shards and map of the deployment `remote` names, for
/// data dir `dir`.
pub fn open(
    dir: &Path,
    remote: &Remote,
    opts: RedisOptions,
) -> Result<(RedisBackend, Arc<RedisMaps>), DeployError> {
    let store = RedisMapStore::open_in(&remote.map_url, &remote.namespace, &opts).map_err(|e| {
        DeployError::RemoteMap {
            url: shardq_core::secret::redacted(&remote.map_url),
            named_by: dir.join(REMOTE_FILE).display().to_string(),
            source: Box::new(e),
        }
    })?;
    let map = store.load()?;
    check_all(&map, true)?;
    let mut opts = opts;
    let retry = crate::retry_setting(&store)?;
    // Unset: the caller's options stand.
    if retry != shardq_core::RetrySettings::default() {
        opts.backoff = retry.default.backoff;
        opts.retry_rules = Arc::new(retry.rules);
    }
    opts.retention = crate::retention_setting(&store)?;
    // Given by the caller: it stands.
    if opts.flow.is_none() {
        let settings: Arc<dyn MapStore> = Arc::new(store.clone());
        opts.flow = Some(crate::flow_control(&settings, Arc::new(store.clone()))?);
    }
    let backend = RedisBackend::open(&map, opts)?;
    let maps = Arc::new(RedisMaps {
        store,
        backend: backend.clone(),
        cache: dir.join(MAP_CACHE_FILE),
        cached_version: AtomicU64::new(0),
        default_urls: Mutex::new(HashMap::new()),
    });
    maps.seen(&map)?;
    Ok((backend, maps))
}

/// A [`RedisCoordinator`] that first reloads the map, so a worker takes
/// part in shards added while it runs (the load registers them).
pub struct FollowMap {
    inner: RedisCoordinator,
    maps: Arc<RedisMaps>,
}

impl FollowMap {
    /// Leases of at most `max_shards` shards (0: no limit), `lease_ms` long.
    pub fn new(
        backend: &RedisBackend,
        maps: Arc<RedisMaps>,
        lease_ms: u64,
        max_shards: usize,
        owner: Option<String>,
    ) -> Result<FollowMap, DeployError> {
        let inner = RedisCoordinator::new(
            backend,
            CoordinatorOptions {
                owner,
                lease_ms,
                shards: None,
                max_shards,
            },
        )?;
        Ok(FollowMap { inner, maps })
    }
}

impl Coordinator for FollowMap {
    fn tick(&mut self) -> Result<Ownership, QueueError> {
        // A map that cannot be read now is read again next tick; the leases
        // are what must not wait.
        let _ = self.maps.load();
        self.inner.tick()
    }
    fn stop_claiming(&mut self) {
        self.inner.stop_claiming()
    }
    fn release_all(&mut self) -> Result<(), QueueError> {
        self.inner.release_all()
    }
    fn tick_interval_ms(&self) -> u64 {
        self.inner.tick_interval_ms()
    }
    fn max_shards(&self) -> usize {
        self.inner.max_shards()
    }

    fn standby_reason(&self) -> String {
        self.inner.standby_reason()
    }
}
