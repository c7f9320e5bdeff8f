//! The embedded on-disk queue (`shardq-fs`) as a harness target: real jobs
//! enqueued through [`Engine`] into a real data directory, with per-shard
//! depth read back from [`Engine::status`].
//!
//! Each `count` or `place` initialises a fresh data directory under the
//! system temp dir with the current queue list as a rendezvous shard map
//! (the engine's default algorithm), enqueues, reads depths, and deletes the
//! directory. B therefore compares two data directories built from the
//! before and after maps: the engine routes by the map alone, so this is
//! where a live add-shards would send each key, but it does not exercise
//! the engine's own resharding (that has its own tests). Durability is the
//! engine's default (fsync per batch).

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use shardq_core::NewJob;
use shardq_fs::{Engine, EngineOptions};
use shardq_route::{Algorithm, ShardMap};

use super::{Observer, Target};
use crate::error::ChxError;

/// Name of the system in every result file.
pub const SYSTEM: &str = "shardq-embedded";
/// Jobs per enqueue call: well under the engine's per-batch limits, large
/// enough that group commit amortises the fsyncs.
pub const ENQUEUE_CHUNK_JOBS: usize = 8192;

/// A temporary data directory per measurement.
#[derive(Debug, Default)]
pub struct EmbeddedTarget {
    experiment: String,
    queues: Vec<String>,
    runs: u64,
}

impl EmbeddedTarget {
    /// A target that creates its data directories under the system temp dir.
    pub fn new() -> EmbeddedTarget {
        EmbeddedTarget::default()
    }

    fn engine_err(&self, doing: &str, err: impl std::fmt::Display) -> ChxError {
        ChxError::Engine {
            doing: doing.into(),
            reason: err.to_string(),
        }
    }

    /// Initialises and opens a fresh data directory for the current queues.
    fn open(&mut self) -> Result<(Engine, DataDir), ChxError> {
        self.runs += 1;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = DataDir(std::env::temp_dir().join(format!(
            "shardq-chx-embedded-{}-{:x}-{}-{}",
            std::process::id(),
            nanos % (1 << 40),
            self.experiment,
            self.runs
        )));
        let map = ShardMap::with_shards(Algorithm::Rendezvous, self.queues.iter().cloned())?;
        Engine::init(&dir.0, &map).map_err(|e| self.engine_err("initialising the data dir", e))?;
        let engine = Engine::open(&dir.0, EngineOptions::default())
            .map_err(|e| self.engine_err("opening the data dir", e))?;
        Ok((engine, dir))
    }

    /// Enqueues `jobs` in chunks; returns each job's shard index.
    fn enqueue(
        &self,
        engine: &Engine,
        jobs: Vec<NewJob>,
        obs: &mut dyn Observer,
    ) -> Result<Vec<usize>, ChxError> {
        let mut placed = Vec::with_capacity(jobs.len());
        let mut jobs = jobs.into_iter().peekable();
        while jobs.peek().is_some() {
            let chunk: Vec<NewJob> = jobs.by_ref().take(ENQUEUE_CHUNK_JOBS).collect();
            let n = chunk.len() as u64;
            for (shard, _id) in engine
                .enqueue_batch(chunk)
                .map_err(|e| self.engine_err("enqueueing", e))?
            {
                let index = self
                    .queues
                    .iter()
                    .position(|q| *q == shard)
                    .ok_or_else(|| {
                        self.engine_err(
                            "enqueueing",
                            format!("job landed on unknown shard {shard:?}"),
                        )
                    })?;
                placed.push(index);
            }
            obs.advance(n);
        }
        Ok(placed)
    }

    /// Ready jobs per shard, in queue order, as the engine reports them.
    fn depths(&self, engine: &Engine) -> Result<Vec<u64>, ChxError> {
        let status = engine
            .status()
            .map_err(|e| self.engine_err("reading status", e))?;
        self.queues
            .iter()
            .map(|q| {
                status
                    .shards
                    .iter()
                    .find(|s| s.name == *q)
                    .map(|s| s.ready)
                    .ok_or_else(|| {
                        self.engine_err("reading status", format!("no shard {q:?} in status"))
                    })
            })
            .collect()
    }

    /// Checks the depths read back against where the engine said it put each job.
    fn check_depths(&self, depths: &[u64], placed: &[usize]) -> Result<(), ChxError> {
        let mut want = vec![0u64; self.queues.len()];
        for &q in placed {
            want[q] += 1;
        }
        if want != depths {
            return Err(self.engine_err(
                "reading status",
                format!("depths {depths:?} differ from the enqueue results {want:?}"),
            ));
        }
        Ok(())
    }
}

/// Removes the data directory when dropped, also on error paths.
struct DataDir(PathBuf);

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Target for EmbeddedTarget {
    fn system(&self) -> &str {
        SYSTEM
    }

    fn version(&self) -> String {
        format!("shardq-fs {} (rendezvous map)", env!("CARGO_PKG_VERSION"))
    }

    fn begin(&mut self, experiment: &str, queues: &[String]) -> Result<(), ChxError> {
        self.experiment = experiment.to_string();
        self.set_queues(queues)
    }

    fn set_queues(&mut self, queues: &[String]) -> Result<(), ChxError> {
        self.queues = queues.to_vec();
        Ok(())
    }

    fn count(
        &mut self,
        keys: &mut dyn Iterator<Item = String>,
        _total: u64,
        obs: &mut dyn Observer,
    ) -> Result<Vec<u64>, ChxError> {
        let (engine, _dir) = self.open()?;
        let jobs: Vec<NewJob> = keys.map(|k| NewJob::new(k, Vec::new())).collect();
        let placed = self.enqueue(&engine, jobs, obs)?;
        let depths = self.depths(&engine)?;
        self.check_depths(&depths, &placed)?;
        Ok(depths)
    }

    fn place(&mut self, keys: &[String], obs: &mut dyn Observer) -> Result<Vec<usize>, ChxError> {
        let (engine, _dir) = self.open()?;
        let jobs: Vec<NewJob> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| NewJob::new(k.clone(), i.to_string()))
            .collect();
        let placed = self.enqueue(&engine, jobs, obs)?;
        let depths = self.depths(&engine)?;
        self.check_depths(&depths, &placed)?;
        Ok(placed)
    }

    fn end(&mut self) -> Result<(), ChxError> {
        self.queues.clear();
        Ok(())
    }
}
