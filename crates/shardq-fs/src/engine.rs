//! [`Engine`]: the library front door. Opens a data dir, routes enqueues
//! through the shard map, runs the shared worker pool, reports status.
//!
//! Glue only: storage is in the backend, leases in the coordinator; this
//! module must never write a log record itself.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};

use serde::Serialize;
use shardq_core::producer::{ProduceError, Producer, ProducerOptions};
use shardq_core::reshard::MapStore;
use shardq_core::{
    Handler, InspectJobs, JobId, NewJob, PoolOptions, PoolReport, QueueBackend, QueueError,
    ShardStats, WorkerPool,
};
use shardq_route::{Router, ShardMap};

use crate::backend::{EngineOptions, FsBackend};
use crate::error::FsError;
use crate::layout;
use crate::map_store::FileMapStore;
use crate::membership::{FsCoordinator, MemberOptions};

/// Longest an enqueue waits, retrying, for a paused key.
pub const PAUSE_WAIT_MS_MAX: u64 = shardq_core::producer::PAUSE_WAIT_MS_DEFAULT;

/// A shard's line in [`Status`].
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ShardStatus {
    /// Shard name.
    pub name: String,
    /// Jobs ready to run.
    pub ready: u64,
    /// Jobs waiting for their start time (delays and retries).
    pub delayed: u64,
    /// Jobs running.
    pub in_flight: u64,
    /// Dead-lettered jobs.
    pub dead: u64,
    /// Owner (`host@pid`), if any.
    pub owner: Option<String>,
    /// When the owner's lease ends (ms since the epoch), if owned.
    pub lease_expires_ms: Option<u64>,
}

/// Totals over all shards.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct StatusTotals {
    /// Sum of ready.
    pub ready: u64,
    /// Sum of delayed.
    pub delayed: u64,
    /// Sum of in flight.
    pub in_flight: u64,
    /// Sum of dead.
    pub dead: u64,
}

/// Output of [`Engine::status`].
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Status {
    /// Per shard, in map order.
    pub shards: Vec<ShardStatus>,
    /// Totals.
    pub totals: StatusTotals,
}

/// An open data directory. See the crate docs for an example.
pub struct Engine {
    dir: PathBuf,
    backend: Arc<FsBackend>,
    router: RwLock<Arc<Router>>,
    /// Routes enqueues and follows map changes (fences, pauses); see
    /// `shardq_core::producer`.
    producer: Mutex<Producer<FsBackend>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("dir", &self.dir).finish()
    }
}

impl Engine {
    /// Creates a data dir with `shards` shards named `shard-0`.. and a
    /// version-1 rendezvous map.
    pub fn init(dir: &Path, map: &ShardMap) -> Result<(), FsError> {
        layout::init(dir, map)
    }

    /// Opens an existing data dir.
    pub fn open(dir: &Path, opts: EngineOptions) -> Result<Engine, FsError> {
        layout::check(dir)?;
        layout::read_membership(dir)?;
        let map = layout::read_map(dir)?;
        let router = Router::new(map).map_err(|e| FsError::MapInvalid {
            path: dir.join(layout::SHARD_MAP_FILE),
            reason: e.to_string(),
        })?;
        let storage = Arc::clone(&opts.storage);
        let backend = Arc::new(FsBackend::new(dir, opts)?);
        let store: Arc<dyn MapStore> = Arc::new(FileMapStore::open(dir)?.with_storage(storage));
        let producer = Producer::new(Arc::clone(&backend), store, ProducerOptions::default())
            .map_err(|e| FsError::MapInvalid {
                path: dir.join(layout::SHARD_MAP_FILE),
                reason: e.to_string(),
            })?;
        Ok(Engine {
            dir: dir.to_path_buf(),
            backend,
            router: RwLock::new(Arc::new(router)),
            producer: Mutex::new(producer),
        })
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The backend, for direct use of [`QueueBackend`].
    pub fn backend(&self) -> Arc<FsBackend> {
        Arc::clone(&self.backend)
    }

    /// The router in use.
    pub fn router(&self) -> Arc<Router> {
        Arc::clone(&self.router.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Re-reads shardmap.yaml (after a fence refused an enqueue).
    pub fn reload_map(&self) -> Result<(), FsError> {
        let map = layout::read_map(&self.dir)?;
        let router = Router::new(map).map_err(|e| FsError::MapInvalid {
            path: self.dir.join(layout::SHARD_MAP_FILE),
            reason: e.to_string(),
        })?;
        *self.router.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(router);
        Ok(())
    }

    /// Enqueues one job; returns its shard and id.
    pub fn enqueue(&self, job: NewJob) -> Result<(String, JobId), FsError> {
        let mut out = self.enqueue_batch(vec![job])?;
        Ok(out.pop().expect("one job in, one id out"))
    }

    /// Changes how long enqueues wait for a paused key or a newer map.
    pub fn set_producer_options(&self, options: ProducerOptions) -> Result<(), FsError> {
        let store: Arc<dyn MapStore> = Arc::new(
            FileMapStore::open(&self.dir)?
                .with_storage(Arc::clone(&self.backend.options().storage)),
        );
        let producer = Producer::new(Arc::clone(&self.backend), store, options)
            .map_err(|e| FsError::Queue(QueueError::store(e.kind(), e)))?;
        *self.producer.lock().unwrap_or_else(|e| e.into_inner()) = producer;
        Ok(())
    }

    /// Enqueues jobs in order (each key's jobs keep their order); returns
    /// shard and id per job, in input order. Routing follows the published
    /// map: a fenced shard makes the map reload and the refused jobs route
    /// again (waiting, bounded, for a newer version); a paused key is
    /// retried for up to [`PAUSE_WAIT_MS_MAX`] while the other keys go in.
    pub fn enqueue_batch(&self, jobs: Vec<NewJob>) -> Result<Vec<(String, JobId)>, FsError> {
        for job in &jobs {
            job.validate(self.backend.options().payload_bytes_max)?;
        }
        let mut producer = self.producer.lock().unwrap_or_else(|e| e.into_inner());
        let placed = producer.enqueue_batch(&jobs).map_err(|e| match e {
            ProduceError::Queue(q) => FsError::Queue(q),
            other => FsError::Queue(QueueError::store(other.kind(), other)),
        })?;
        Ok(placed.into_iter().map(|p| (p.shard, p.id)).collect())
    }

    /// Per-shard counts, owners and leases.
    pub fn status(&self) -> Result<Status, FsError> {
        let m = layout::read_membership(&self.dir)?;
        let names: Vec<String> = self
            .router()
            .map()
            .shards
            .iter()
            .map(|s| s.name.clone())
            .collect();
        let mut shards = Vec::new();
        let mut totals = StatusTotals::default();
        for name in names {
            let s: ShardStats = self.backend.shard_stats(&name)?;
            let entry = m.shards.get(&name);
            let owner = entry.and_then(|e| e.owner.clone());
            totals.ready += s.ready;
            totals.delayed += s.delayed;
            totals.in_flight += s.in_flight;
            totals.dead += s.dead;
            shards.push(ShardStatus {
                name,
                ready: s.ready,
                delayed: s.delayed,
                in_flight: s.in_flight,
                dead: s.dead,
                lease_expires_ms: owner.as_ref().and(entry.map(|e| e.lease_expires_ms)),
                owner,
            });
        }
        Ok(Status { shards, totals })
    }

    /// Why `shard` is or is not being run, in words, from membership.json
    /// and the published map (for `status` and standby messages): not in
    /// the map, unowned, owned with a lease that ends when, or owned with a
    /// lease that lapsed (a takeover waits for the clock-skew margin and for
    /// the owner's `.lock` flock, held while the owner lives on this host).
    /// Reads only; `now_ms` is the caller's clock.
    pub fn run_reason(&self, shard: &str, now_ms: u64) -> Result<String, FsError> {
        let map = layout::read_map(&self.dir)?;
        if !map.shards.iter().any(|s| s.name == shard) {
            return Ok(format!(
                "{shard} is not in the published map (version {}): no worker runs it",
                map.version
            ));
        }
        let m = layout::read_membership(&self.dir)?;
        Ok(match m.shards.get(shard) {
            None => format!(
                "{shard} has no membership entry yet: the next worker tick adds and claims it"
            ),
            Some(e) => match &e.owner {
                None => format!(
                    "{shard} is unowned: a worker with room under max_local_shards claims it at its next tick"
                ),
                Some(o) if e.lease_expires_ms > now_ms => format!(
                    "{shard} is run by {o} (epoch {}, lease ends in {} ms)",
                    e.epoch,
                    e.lease_expires_ms - now_ms
                ),
                Some(o) => format!(
                    "{shard} is listed as run by {o} but its lease lapsed {} ms ago (epoch {}): \
                     another worker takes it over after the clock-skew margin, unless {o} is \
                     alive on this host and still holds the shard's .lock",
                    now_ms - e.lease_expires_ms,
                    e.epoch
                ),
            },
        })
    }

    /// Runs the shared worker pool: claims shards per `member`, runs
    /// `handler` for each job, until `stop` is set (then drains and releases)
    /// or, with `exit_when_idle`, until idle.
    pub fn run_workers(
        &self,
        member: MemberOptions,
        pool: PoolOptions,
        handler: Arc<Handler>,
        stop: &AtomicBool,
    ) -> Result<PoolReport, FsError> {
        let clock = Arc::clone(&self.backend.options().clock);
        let mut coordinator = FsCoordinator::new(&self.dir, member, Arc::clone(&clock))?
            .with_storage(Arc::clone(&self.backend.options().storage));
        let backend: Arc<dyn QueueBackend> = self.backend.clone();
        let report = WorkerPool::run(backend, &mut coordinator, handler, clock, pool, stop)?;
        self.backend.flush()?;
        Ok(report)
    }
}
