//! What the demo runs on: the embedded engine in a (temporary) data dir,
//! Redis on local `redis-server` processes it starts on free loopback ports,
//! or memory. The first two are opened through `shardq_deploy`, the same
//! front door as the CLI and the server. This module sets up and tears down;
//! it must never run or check jobs.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;

use shardq_core::memory::{MemoryBackend, MemoryCoordinator, MemoryMapStore};
use shardq_core::reshard::{MapStore, ReshardBackend};
use shardq_core::{Clock, Coordinator, SystemClock};
use shardq_deploy::{Deployment, OpenOptions, WorkerOptions};
use shardq_fs::{Durability, EngineOptions};
use shardq_redis::local::{port_free, LocalOptions, LocalServer};
use shardq_route::{Algorithm, ShardMap};

use super::{DemoEnv, DemoError};

/// Lease of the demo's worker pool; it ticks every third of it, so it
/// starts running the new shard within half a second.
pub const DEMO_LEASE_MS: u64 = 1_500;

/// `shard-0`..`shard-(n-1)`.
pub fn shard_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("shard-{i}")).collect()
}

/// The in-memory backend: no durability, no processes.
pub struct MemoryEnv {
    backend: MemoryBackend,
    store: MemoryMapStore,
}

impl MemoryEnv {
    /// Shards `names`, rendezvous routing.
    pub fn new(names: &[String]) -> Result<MemoryEnv, DemoError> {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        Ok(MemoryEnv {
            backend: MemoryBackend::new(&refs, Arc::new(SystemClock)),
            store: MemoryMapStore::new(ShardMap::with_shards(
                Algorithm::Rendezvous,
                names.iter().cloned(),
            )?),
        })
    }
}

impl DemoEnv for MemoryEnv {
    fn backend(&self) -> Arc<dyn ReshardBackend> {
        Arc::new(self.backend.clone())
    }
    fn store(&self) -> Arc<dyn MapStore> {
        Arc::new(self.store.clone())
    }
    fn coordinator(&self) -> Result<Box<dyn Coordinator>, DemoError> {
        Ok(Box::new(MemoryCoordinator::new(self.backend.clone())))
    }
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(SystemClock)
    }
    fn deploy_shard(&self, name: &str) -> Result<(), DemoError> {
        self.backend.add_shard(name);
        Ok(())
    }
    fn location(&self) -> String {
        "memory (no durability)".into()
    }
}

/// A deployment the demo made: the embedded engine in a data dir, or Redis
/// on local servers (one per shard plus a spare for the added shard).
pub struct DeploymentEnv {
    deployment: Deployment,
    dir: PathBuf,
    /// Removed on drop when the data is not kept.
    temp: bool,
    /// Kept alive for the demo; dropping one stops its server.
    servers: Vec<LocalServer>,
}

fn demo_dir(keep: Option<PathBuf>, kind: &str) -> (PathBuf, bool) {
    match keep {
        Some(d) => (d, false),
        None => (
            std::env::temp_dir().join(format!(
                "shardq-demo-{kind}{}-{}",
                std::process::id(),
                SystemClock.now_ms()
            )),
            true,
        ),
    }
}

impl DeploymentEnv {
    /// The embedded engine with fsync durability (group commit) in `keep`
    /// or a temporary data dir.
    pub fn embedded(keep: Option<PathBuf>, names: &[String]) -> Result<DeploymentEnv, DemoError> {
        let (dir, temp) = demo_dir(keep, "");
        let map = ShardMap::with_shards(Algorithm::Rendezvous, names.iter().cloned())?;
        shardq_deploy::init_embedded(&dir, &map)?;
        let opts = OpenOptions {
            engine: EngineOptions {
                durability: Durability::Fsync,
                ..EngineOptions::default()
            },
            ..OpenOptions::default()
        };
        Ok(DeploymentEnv {
            deployment: Deployment::open(&dir, &opts)?,
            dir,
            temp,
            servers: Vec::new(),
        })
    }

    /// Redis: one local `redis-server` per shard and a spare, started on
    /// free loopback ports (the first free ones of `ports`, inclusive, when
    /// given) and stopped when this is dropped.
    pub fn redis(
        keep: Option<PathBuf>,
        names: &[String],
        ports: Option<(u16, u16)>,
    ) -> Result<DeploymentEnv, DemoError> {
        // A missing binary is said once, in the demo's words, before any
        // server starts.
        Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .map_err(|e| {
                DemoError::failed(
                    "--backend redis starts local redis-server processes, but redis-server was not found on PATH (Debian package redis-server)",
                    e,
                )
            })?;
        let wanted = names.len() + 1;
        let chosen: Vec<Option<u16>> = match ports {
            None => vec![None; wanted],
            Some((lo, hi)) => {
                let free: Vec<u16> = (lo..=hi).filter(|&p| port_free(p)).take(wanted).collect();
                if free.len() < wanted {
                    return Err(DemoError::Invalid(format!(
                        "--redis-ports {lo}-{hi}: {} free loopback ports in it, the demo needs {wanted} (one per shard and one for the added shard)",
                        free.len()
                    )));
                }
                free.into_iter().map(Some).collect()
            }
        };
        let servers = chosen
            .into_iter()
            .map(|port| {
                LocalServer::start(LocalOptions {
                    port,
                    ..LocalOptions::default()
                })
                .map_err(DemoError::Invalid)
            })
            .collect::<Result<Vec<LocalServer>, DemoError>>()?;
        let (dir, temp) = demo_dir(keep, "redis-");
        let map = ShardMap::with_shards(Algorithm::Rendezvous, names.iter().cloned())?;
        let urls: Vec<String> = servers[..names.len()]
            .iter()
            .map(LocalServer::url)
            .collect();
        shardq_deploy::init_redis(&dir, map, &urls, None, false, &crate::redis_options())?;
        Ok(DeploymentEnv {
            deployment: Deployment::open(&dir, &crate::open_options())?,
            dir,
            temp,
            servers,
        })
    }
}

impl DeploymentEnv {
    /// The data dir (a dashboard can serve it while the demo runs).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl Drop for DeploymentEnv {
    fn drop(&mut self) {
        if self.temp {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl DemoEnv for DeploymentEnv {
    fn backend(&self) -> Arc<dyn ReshardBackend> {
        self.deployment.backend()
    }
    fn store(&self) -> Arc<dyn MapStore> {
        self.deployment.maps()
    }
    fn coordinator(&self) -> Result<Box<dyn Coordinator>, DemoError> {
        Ok(self.deployment.coordinator(&WorkerOptions {
            lease_ms: DEMO_LEASE_MS,
            ..WorkerOptions::default()
        })?)
    }
    fn clock(&self) -> Arc<dyn Clock> {
        self.deployment.clock()
    }
    fn deploy_shard(&self, name: &str) -> Result<(), DemoError> {
        // On Redis the demo adds the shard by name; it lives on the spare.
        let url = self.servers.last().map(LocalServer::url);
        Ok(self.deployment.deploy_shard(name, url.as_deref())?)
    }
    fn location(&self) -> String {
        match (self.servers.len(), self.temp) {
            (0, true) => "the embedded engine (temporary data dir, fsync durability)".into(),
            (0, false) => format!(
                "the embedded engine in {} (fsync durability)",
                self.dir.display()
            ),
            (n, _) => format!(
                "{n} local redis-server instances on loopback ports {} (one per shard, one for the added shard; no persistence)",
                self.servers
                    .iter()
                    .map(|s| s.port().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}
