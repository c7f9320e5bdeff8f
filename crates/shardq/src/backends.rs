//! Which backend a data dir's shards live on, and opening it.
//!
//! A data dir is one of two kinds:
//!
//! * **Embedded** (no `remote.json`): every shard is a log in the data dir
//!   (`url` absent or `file:`); the map is `shardmap.yaml`, the store
//!   [`FileMapStore`]. Commands on it run exactly as they always have.
//! * **Redis** (`remote.json` present): every shard lives on Redis
//!   (`redis://host:port/db` or `redis+cluster://host:port,...`). The map,
//!   its version, the rebalance target and lock, the fences (pauses) and the
//!   leases are all in Redis; `remote.json` only names where the map lives
//!   (`map_url`) and the queue, and `shardmap.yaml` is a cache of the last
//!   map this data dir saw (written when its version changes, never read as
//!   truth). So processes with different data dirs that name the same map
//!   cooperate.
//!
//! A map mixing embedded and Redis shards is refused with an error naming
//! the shard: one data dir drives one kind of storage. This module only
//! opens things; it must never route, enqueue or run jobs itself.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use shardq_core::reshard::{MapStore, ReshardBackend, ReshardError};
use shardq_core::{Coordinator, Ownership, QueueError};
use shardq_fs::map_store::FileMapStore;
use shardq_fs::{EngineOptions, FsBackend};
use shardq_redis::{
    is_redis_url, CoordinatorOptions, RedisBackend, RedisCoordinator, RedisMapStore, RedisOptions,
    SCHEME_CLUSTER, SCHEME_INSTANCE,
};
use shardq_route::ShardMap;

/// The file that makes a data dir a Redis one: where the map lives.
pub const REMOTE_FILE: &str = "remote.json";
/// The cached copy of the map in a Redis data dir.
pub const MAP_CACHE_FILE: &str = shardq_fs::layout::SHARD_MAP_FILE;
/// `format` field of [`REMOTE_FILE`].
pub const REMOTE_FORMAT: &str = "shardq-remote";
/// Version of the [`REMOTE_FILE`] format.
pub const REMOTE_VERSION: u32 = 1;
/// Longest `remote.json` read, in bytes: it holds two short strings.
const REMOTE_BYTES_MAX: u64 = 64 << 10;

/// Contents of `remote.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Remote {
    /// Always [`REMOTE_FORMAT`].
    pub format: String,
    /// Always [`REMOTE_VERSION`] for now.
    pub version: u32,
    /// The Redis instance or cluster holding the shard map.
    pub map_url: String,
    /// Queue name: the first half of every shard key's hashtag.
    pub queue: String,
}

impl Remote {
    /// A record for a map at `map_url`, default queue.
    pub fn new(map_url: &str) -> Remote {
        Remote {
            format: REMOTE_FORMAT.into(),
            version: REMOTE_VERSION,
            map_url: map_url.to_string(),
            queue: shardq_redis::keys::QUEUE_DEFAULT.to_string(),
        }
    }

    /// Reads `dir/remote.json`, `None` when absent (an embedded data dir).
    pub fn read(dir: &Path) -> anyhow::Result<Option<Remote>> {
        let path = dir.join(REMOTE_FILE);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        if meta.len() > REMOTE_BYTES_MAX {
            bail!(
                "{} is {} bytes, over {REMOTE_BYTES_MAX}: not a shardq remote file",
                path.display(),
                meta.len()
            );
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let r: Remote = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid remote file", path.display()))?;
        if r.format != REMOTE_FORMAT || r.version != REMOTE_VERSION {
            bail!(
                "{}: format {:?} version {} is not {REMOTE_FORMAT:?} version {REMOTE_VERSION}",
                path.display(),
                r.format,
                r.version
            );
        }
        if !is_redis_url(&r.map_url) {
            bail!(
                "{}: map_url {:?} is not a redis:// or redis+cluster:// URL",
                path.display(),
                r.map_url
            );
        }
        Ok(Some(r))
    }

    /// Writes `dir/remote.json` atomically.
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let path = dir.join(REMOTE_FILE);
        let text = serde_json::to_string_pretty(self)?;
        shardq_fs::layout::write_atomic(&path, text.as_bytes())
            .with_context(|| format!("writing {}", path.display()))
    }
}

/// Where a data dir's shards live.
pub enum Kind {
    /// The embedded engine: use the data dir as before.
    Embedded,
    /// Redis, with the map at `remote.map_url`.
    Redis(Remote),
}

/// The kind of data dir `dir` is. An embedded data dir whose map names a
/// Redis shard is refused (mixed maps are not supported).
pub fn kind(dir: &Path) -> anyhow::Result<Kind> {
    if let Some(r) = Remote::read(dir)? {
        return Ok(Kind::Redis(r));
    }
    // Errors reading the local map are left to the embedded engine, which
    // reports them as it always has.
    if let Ok(map) = shardq_fs::layout::read_map(dir) {
        check_all(&map, false)?;
    }
    Ok(Kind::Embedded)
}

/// Checks that every shard of `map` is on Redis (`redis`) or every one is
/// embedded; names the first that is not.
pub fn check_all(map: &ShardMap, redis: bool) -> anyhow::Result<()> {
    for s in &map.shards {
        let url = s.url.as_deref().unwrap_or("");
        if is_redis_url(url) != redis {
            let (want, got) = if redis {
                ("on Redis", "embedded")
            } else {
                ("embedded", "on Redis")
            };
            bail!(
                "shard {:?} (url {:?}) is {got} while the other shards are {want}: a map mixing the embedded engine and Redis is not supported; give every shard the same kind of url",
                s.name,
                s.url.as_deref().unwrap_or("none")
            );
        }
        if !redis && !url.is_empty() && !url.starts_with("file:") {
            bail!(
                "shard {:?} has url {url:?}: expected none, file:, redis://host:port/db or redis+cluster://host:port,...",
                s.name
            );
        }
    }
    Ok(())
}

/// The shard map in Redis, seen through one data dir: loading a newer
/// version registers its new shards with the backend (so producers and
/// workers reach shards added while they run) and refreshes the local cache.
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
            .map_err(|e| ReshardError::Store(e.to_string()))?;
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
    fn store_target(&self, target: Option<&ShardMap>) -> Result<(), ReshardError> {
        let target = target.map(|t| self.with_urls(t));
        self.store.store_target(target.as_ref())
    }
    fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, ReshardError> {
        self.store.try_lock_rebalance()
    }
}

/// An open Redis data dir.
pub struct RedisEnv {
    /// The backend over every Redis shard of the map.
    pub backend: RedisBackend,
    /// The map in Redis.
    pub maps: Arc<RedisMaps>,
}

/// Opens the Redis shards and map named by `remote` for data dir `dir`.
pub fn open_redis(dir: &Path, remote: &Remote, opts: RedisOptions) -> anyhow::Result<RedisEnv> {
    let opts = RedisOptions {
        queue: remote.queue.clone(),
        ..opts
    };
    let store =
        RedisMapStore::open_with(&remote.map_url, opts.retry_attempts).with_context(|| {
            format!(
                "opening the shard map in Redis at {} (named by {})",
                remote.map_url,
                dir.join(REMOTE_FILE).display()
            )
        })?;
    let map = store.load()?;
    check_all(&map, true)?;
    let backend = RedisBackend::open(&map, opts)?;
    let maps = Arc::new(RedisMaps {
        store,
        backend: backend.clone(),
        cache: dir.join(MAP_CACHE_FILE),
        cached_version: AtomicU64::new(0),
        default_urls: Mutex::new(HashMap::new()),
    });
    maps.seen(&map)?;
    Ok(RedisEnv { backend, maps })
}

/// A map store and backend for resharding, of either kind.
pub struct ReshardEnv {
    /// Where the map lives.
    pub store: Arc<dyn MapStore>,
    /// The queue backend with its key inventory.
    pub backend: Arc<dyn ReshardBackend>,
    /// True for a Redis data dir.
    pub redis: bool,
}

/// Opens data dir `dir` for resharding.
pub fn open_reshard(dir: &Path) -> anyhow::Result<ReshardEnv> {
    match kind(dir)? {
        Kind::Embedded => {
            let store =
                FileMapStore::open(dir).with_context(|| format!("data dir {}", dir.display()))?;
            let backend = FsBackend::new(dir, EngineOptions::default())?;
            Ok(ReshardEnv {
                store: Arc::new(store),
                backend: Arc::new(backend),
                redis: false,
            })
        }
        Kind::Redis(remote) => {
            let env = open_redis(dir, &remote, RedisOptions::default())?;
            Ok(ReshardEnv {
                store: env.maps,
                backend: Arc::new(env.backend),
                redis: true,
            })
        }
    }
}

/// Checks that a new shard's Redis server answers, before it joins the map:
/// the error names the shard and the URL.
pub fn check_reachable(name: &str, url: &str) -> anyhow::Result<()> {
    let mut map = ShardMap::with_shards(shardq_route::Algorithm::Rendezvous, [name])?;
    map.shards[0].url = Some(url.to_string());
    RedisBackend::open(&map, RedisOptions::default())?;
    Ok(())
}

/// A [`RedisCoordinator`] that first reloads the map, so a worker takes
/// part in shards added while it runs (the load registers them).
pub struct FollowMap {
    inner: RedisCoordinator,
    maps: Arc<RedisMaps>,
}

impl FollowMap {
    /// Leases of at most `max_shards` shards (0: no limit), `lease_ms` long.
    pub fn new(env: &RedisEnv, lease_ms: u64, max_shards: usize) -> anyhow::Result<FollowMap> {
        let inner = RedisCoordinator::new(
            &env.backend,
            CoordinatorOptions {
                owner: None,
                lease_ms,
                shards: None,
                max_shards,
            },
        )?;
        Ok(FollowMap {
            inner,
            maps: Arc::clone(&env.maps),
        })
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
    fn standby_reason(&self) -> String {
        self.inner.standby_reason()
    }
}

/// Turns `--redis` values into shard URLs: a comma-separated list of
/// `redis://host:port[/db]` (or `host:port`), each kept as one instance.
pub fn instance_urls(spec: &str) -> anyhow::Result<Vec<String>> {
    let urls: Vec<String> = spec
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            if s.starts_with(SCHEME_CLUSTER) {
                bail!("--redis {s:?}: a cluster URL; use --redis-cluster for a Redis Cluster");
            }
            let url = if s.starts_with(SCHEME_INSTANCE) {
                s.to_string()
            } else if s.contains("://") {
                bail!("--redis {s:?}: expected redis://host:port/db");
            } else {
                format!("{SCHEME_INSTANCE}{s}")
            };
            Ok(url)
        })
        .collect::<anyhow::Result<_>>()?;
    if urls.is_empty() {
        bail!("--redis {spec:?}: no URL given; expected redis://host:port/db,...");
    }
    Ok(urls)
}

/// Turns `--redis-cluster` seeds (`redis://h:p,h:p`, `h:p,...` or
/// `redis+cluster://h:p,...`) into one `redis+cluster://h:p,...` URL.
pub fn cluster_url(spec: &str) -> anyhow::Result<String> {
    let rest = spec.strip_prefix(SCHEME_CLUSTER).unwrap_or(spec);
    let seeds: Vec<String> = rest
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let s = s.strip_prefix(SCHEME_INSTANCE).unwrap_or(s);
            if s.contains("://") {
                bail!("--redis-cluster {spec:?}: seed {s:?} is not host:port");
            }
            // A cluster has one database: drop a `/0`.
            Ok(s.split('/').next().unwrap_or(s).to_string())
        })
        .collect::<anyhow::Result<_>>()?;
    if seeds.is_empty() {
        bail!("--redis-cluster {spec:?}: no seed node given; expected redis://host:port,...");
    }
    Ok(format!("{SCHEME_CLUSTER}{}", seeds.join(",")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_specs() {
        assert_eq!(
            instance_urls("redis://127.0.0.1:7001/0, 127.0.0.1:7002").unwrap(),
            ["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002"]
        );
        assert!(instance_urls("").is_err());
        assert!(instance_urls("redis+cluster://127.0.0.1:7000").is_err());
        assert!(instance_urls("http://x").is_err());
        assert_eq!(
            cluster_url("redis://127.0.0.1:7000/0,127.0.0.1:7001").unwrap(),
            "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"
        );
        assert_eq!(
            cluster_url("redis+cluster://127.0.0.1:7000").unwrap(),
            "redis+cluster://127.0.0.1:7000"
        );
        assert!(cluster_url(",").is_err());
    }

    #[test]
    fn mixed_maps_are_refused_naming_the_shard() {
        let mut map =
            ShardMap::with_shards(shardq_route::Algorithm::Rendezvous, ["a", "b"]).unwrap();
        check_all(&map, false).unwrap();
        map.shards[1].url = Some("redis://127.0.0.1:1/0".into());
        let e = check_all(&map, false).unwrap_err().to_string();
        assert!(e.contains("\"b\"") && e.contains("not supported"), "{e}");
        let e = check_all(&map, true).unwrap_err().to_string();
        assert!(e.contains("\"a\""), "{e}");
    }
}
