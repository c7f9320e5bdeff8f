//! [`Engine`]: the library front door. Opens a data dir, routes enqueues
//! through the shard map, runs the shared worker pool, reports status.
//!
//! Glue only: storage is in the backend, leases in the coordinator; this
//! module must never write a log record itself.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Serialize;
use shardq_core::{
    Handler, JobId, NewJob, PoolOptions, PoolReport, QueueBackend, QueueError, ShardStats,
    WorkerPool,
};
use shardq_route::{Router, ShardMap};

use crate::backend::{EngineOptions, FsBackend};
use crate::error::FsError;
use crate::layout;
use crate::membership::{FsCoordinator, MemberOptions};

/// Times an enqueue reloads the map and retries after [`QueueError::Fenced`].
pub const FENCE_RETRIES_MAX: u32 = 8;
/// Longest an enqueue waits, retrying, for a paused key (10 s).
pub const PAUSE_WAIT_MS_MAX: u64 = 10_000;
/// Pause between retries of a paused key.
const PAUSE_RETRY_MS: u64 = 20;

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
        let backend = FsBackend::new(dir, opts)?;
        Ok(Engine {
            dir: dir.to_path_buf(),
            backend: Arc::new(backend),
            router: RwLock::new(Arc::new(router)),
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

    /// Enqueues jobs in order (each key's jobs keep their order); returns
    /// shard and id per job, in input order. A fenced shard makes the map
    /// reload and the refused jobs route again; a paused key is retried for
    /// up to [`PAUSE_WAIT_MS_MAX`].
    pub fn enqueue_batch(&self, jobs: Vec<NewJob>) -> Result<Vec<(String, JobId)>, FsError> {
        for job in &jobs {
            job.validate(self.backend.options().payload_bytes_max)?;
        }
        let mut fence_retries = 0;
        let mut paused_waited_ms = 0;
        loop {
            let router = self.router();
            let map = router.map();
            let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for (i, job) in jobs.iter().enumerate() {
                groups
                    .entry(router.route_index(job.key.as_bytes()))
                    .or_default()
                    .push(i);
            }
            let mut out: Vec<Option<(String, JobId)>> = vec![None; jobs.len()];
            let mut retry = None;
            // Shards are independent: a refusal of one group leaves the
            // others appended, and only the refused group is sent again.
            let mut remaining: Vec<NewJob> = Vec::new();
            for (idx, members) in &groups {
                let shard = &map.shards[*idx].name;
                let batch: Vec<NewJob> = members.iter().map(|&i| jobs[i].clone()).collect();
                match self.backend.enqueue(shard, router.version(), &batch) {
                    Ok(ids) => {
                        for (&i, id) in members.iter().zip(ids) {
                            out[i] = Some((shard.clone(), id));
                        }
                    }
                    Err(e @ (QueueError::Fenced { .. } | QueueError::Paused { .. })) => {
                        retry = Some(e);
                        remaining.extend(batch);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            match retry {
                None => return Ok(out.into_iter().map(|o| o.expect("all placed")).collect()),
                Some(QueueError::Fenced { .. }) if fence_retries < FENCE_RETRIES_MAX => {
                    fence_retries += 1;
                    self.reload_map()?;
                }
                Some(QueueError::Paused { .. }) if paused_waited_ms < PAUSE_WAIT_MS_MAX => {
                    std::thread::sleep(Duration::from_millis(PAUSE_RETRY_MS));
                    paused_waited_ms += PAUSE_RETRY_MS;
                }
                Some(e) => return Err(e.into()),
            }
            if out.iter().any(|o| o.is_some()) {
                // Partial success: report it rather than re-append what landed.
                let placed: Vec<(String, JobId)> = out.into_iter().flatten().collect();
                let mut rest = self.enqueue_batch(remaining)?;
                let mut all = placed;
                all.append(&mut rest);
                return Ok(all);
            }
        }
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
        let mut coordinator = FsCoordinator::new(&self.dir, member, Arc::clone(&clock))?;
        let backend: Arc<dyn QueueBackend> = self.backend.clone();
        let report = WorkerPool::run(backend, &mut coordinator, handler, clock, pool, stop)?;
        self.backend.flush()?;
        Ok(report)
    }
}
