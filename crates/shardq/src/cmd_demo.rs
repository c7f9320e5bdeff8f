//! `shardq demo`: argument parsing and the backends the demo can run on:
//! the embedded engine, local redis-server processes it starts and stops
//! itself (loopback only), or memory.

use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;

use anyhow::{bail, Context};
use shardq_core::memory::{MemoryBackend, MemoryCoordinator, MemoryMapStore};
use shardq_core::reshard::{MapStore, ReshardBackend};
use shardq_core::{Clock, Coordinator, SystemClock};
use shardq_fs::map_store::{deploy_shard, FileMapStore};
use shardq_fs::{Durability, EngineOptions, FsBackend, FsCoordinator, MemberOptions};
use shardq_redis::testing::RedisServer;
use shardq_redis::{RedisMapStore, RedisOptions};
use shardq_route::{Algorithm, ShardMap};

use crate::backends;
use crate::demo::{self, DemoEnv, DemoParams};

/// Where the demo's shards live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoBackend {
    /// The embedded on-disk engine (the default).
    Fs,
    /// Local redis-server instances the demo starts itself.
    Redis,
    /// In memory, no durability: shows the resharding logic alone.
    Memory,
}

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Tenants (keys) the producers enqueue for.
    #[arg(long, default_value_t = 10_000)]
    tenants: usize,
    /// Shards before the new one is added.
    #[arg(long, default_value_t = 4)]
    shards: usize,
    /// Seconds of load before the rebalance, and again after it.
    #[arg(long, default_value_t = 3.0)]
    phase_s: f64,
    /// Jobs per second enqueued over all producers.
    #[arg(long, default_value_t = 20_000)]
    rate: u64,
    /// Jobs enqueued back to back per tenant visit (gives tenants a backlog to drain).
    #[arg(long, default_value_t = 5)]
    burst: u64,
    /// Simulated work per job, in microseconds.
    #[arg(long, default_value_t = 1000)]
    work_us: u64,
    /// Producer threads.
    #[arg(long, default_value_t = 2)]
    producers: usize,
    /// Worker pool concurrency.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Keys per drain-then-switch batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = DemoBackend::Fs)]
    backend: DemoBackend,
    /// Keep the data directory here instead of a temporary one.
    #[arg(long, value_name = "DIR")]
    keep: Option<PathBuf>,
    /// Print the final report as one JSON object.
    #[arg(long)]
    json: bool,
}

struct MemoryEnv {
    backend: MemoryBackend,
    store: MemoryMapStore,
}

impl DemoEnv for MemoryEnv {
    fn backend(&self) -> Arc<dyn ReshardBackend> {
        Arc::new(self.backend.clone())
    }
    fn store(&self) -> Arc<dyn MapStore> {
        Arc::new(self.store.clone())
    }
    fn coordinator(&self) -> anyhow::Result<Box<dyn Coordinator>> {
        Ok(Box::new(MemoryCoordinator::new(self.backend.clone())))
    }
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(SystemClock)
    }
    fn deploy_shard(&self, name: &str) -> anyhow::Result<()> {
        self.backend.add_shard(name);
        Ok(())
    }
    fn location(&self) -> String {
        "memory (no durability)".into()
    }
}

/// Lease of the demo's worker pool; it ticks every third of it.
const DEMO_LEASE_MS: u64 = 1_500;

/// The embedded engine in a data directory (temporary unless `--keep`).
struct FsEnv {
    dir: PathBuf,
    backend: Arc<FsBackend>,
    store: FileMapStore,
    /// Removed on drop when the data is not kept.
    temp: bool,
}

impl FsEnv {
    fn create(keep: Option<PathBuf>, names: &[String]) -> anyhow::Result<FsEnv> {
        let (dir, temp) = match keep {
            Some(d) => (d, false),
            None => {
                let d = std::env::temp_dir().join(format!(
                    "shardq-demo-{}-{}",
                    std::process::id(),
                    SystemClock.now_ms()
                ));
                (d, true)
            }
        };
        let map = ShardMap::with_shards(Algorithm::Rendezvous, names.iter().cloned())?;
        shardq_fs::Engine::init(&dir, &map)
            .with_context(|| format!("creating data dir {}", dir.display()))?;
        // Group commit: producers' appends are fsynced in shared batches.
        let opts = EngineOptions {
            durability: Durability::Fsync,
            ..EngineOptions::default()
        };
        let backend = Arc::new(FsBackend::new(&dir, opts)?);
        let store = FileMapStore::open(&dir)?;
        Ok(FsEnv {
            dir,
            backend,
            store,
            temp,
        })
    }
}

impl Drop for FsEnv {
    fn drop(&mut self) {
        if self.temp {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl DemoEnv for FsEnv {
    fn backend(&self) -> Arc<dyn ReshardBackend> {
        self.backend.clone()
    }
    fn store(&self) -> Arc<dyn MapStore> {
        Arc::new(self.store.clone())
    }
    fn coordinator(&self) -> anyhow::Result<Box<dyn Coordinator>> {
        let opts = MemberOptions {
            max_local_shards: usize::MAX,
            // A short lease makes the pool look at membership often, so it
            // starts running the new shard within half a second.
            lease_ms: DEMO_LEASE_MS,
            ..MemberOptions::default()
        };
        Ok(Box::new(FsCoordinator::new(
            &self.dir,
            opts,
            Arc::new(SystemClock),
        )?))
    }
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(SystemClock)
    }
    fn deploy_shard(&self, name: &str) -> anyhow::Result<()> {
        deploy_shard(&self.dir, name)?;
        Ok(())
    }
    fn location(&self) -> String {
        if self.temp {
            "the embedded engine (temporary data dir, fsync durability)".into()
        } else {
            format!(
                "the embedded engine in {} (fsync durability)",
                self.dir.display()
            )
        }
    }
}

/// Local `redis-server` processes the demo starts (one per shard plus one
/// for the added shard) on free loopback ports, stopped when dropped, with a
/// temporary data dir holding `remote.json` and the map cache.
struct RedisDemoEnv {
    env: backends::RedisEnv,
    dir: PathBuf,
    temp: bool,
    /// Kept alive for the demo; dropping one stops its server.
    servers: Vec<RedisServer>,
}

impl RedisDemoEnv {
    fn create(keep: Option<PathBuf>, names: &[String]) -> anyhow::Result<RedisDemoEnv> {
        // The harness panics when the binary is missing; say it as an error.
        Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .context("--backend redis starts local redis-server processes, but redis-server was not found on PATH (Debian package redis-server)")?;
        let servers: Vec<RedisServer> = (0..=names.len()).map(|_| RedisServer::start()).collect();
        let (dir, temp) = match keep {
            Some(d) => (d, false),
            None => (
                std::env::temp_dir().join(format!(
                    "shardq-demo-redis-{}-{}",
                    std::process::id(),
                    SystemClock.now_ms()
                )),
                true,
            ),
        };
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut map = ShardMap::with_shards(Algorithm::Rendezvous, names.iter().cloned())?;
        for (s, server) in map.shards.iter_mut().zip(&servers) {
            s.url = Some(server.url());
        }
        let remote = backends::Remote::new(&servers[0].url());
        RedisMapStore::open(&remote.map_url)?.publish_map(&map, 0)?;
        remote.write(&dir)?;
        let env = backends::open_redis(&dir, &remote, RedisOptions::default())?;
        Ok(RedisDemoEnv {
            env,
            dir,
            temp,
            servers,
        })
    }
}

impl Drop for RedisDemoEnv {
    fn drop(&mut self) {
        if self.temp {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl DemoEnv for RedisDemoEnv {
    fn backend(&self) -> Arc<dyn ReshardBackend> {
        Arc::new(self.env.backend.clone())
    }
    fn store(&self) -> Arc<dyn MapStore> {
        self.env.maps.clone()
    }
    fn coordinator(&self) -> anyhow::Result<Box<dyn Coordinator>> {
        Ok(Box::new(backends::FollowMap::new(
            &self.env,
            DEMO_LEASE_MS,
            0,
        )?))
    }
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(SystemClock)
    }
    fn deploy_shard(&self, name: &str) -> anyhow::Result<()> {
        // The demo adds the shard by name; it lives on the spare server.
        let spare = self.servers.last().context("no spare server")?;
        backends::check_reachable(name, &spare.url())?;
        self.env.maps.assign_url(name, &spare.url());
        Ok(())
    }
    fn location(&self) -> String {
        format!(
            "{} local redis-server instances (one per shard, one for the added shard; no persistence)",
            self.servers.len()
        )
    }
}

fn shard_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("shard-{i}")).collect()
}

pub fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    if args.shards == 0 || args.shards > 256 {
        bail!("--shards {}: must be 1..=256", args.shards);
    }
    if args.concurrency == 0 {
        bail!("--concurrency 0: must be at least 1");
    }
    let params = DemoParams {
        tenants: args.tenants,
        burst: args.burst,
        work_us: args.work_us,
        phase_s: args.phase_s,
        rate: args.rate,
        producers: args.producers,
        concurrency: args.concurrency,
        batch: args.batch,
        progress: !args.json,
    };
    let names = shard_names(args.shards);
    let env: Arc<dyn DemoEnv> = match args.backend {
        DemoBackend::Memory => {
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            Arc::new(MemoryEnv {
                backend: MemoryBackend::new(&refs, Arc::new(SystemClock)),
                store: MemoryMapStore::new(ShardMap::with_shards(
                    Algorithm::Rendezvous,
                    names.clone(),
                )?),
            })
        }
        DemoBackend::Fs => Arc::new(FsEnv::create(args.keep.clone(), &names)?),
        DemoBackend::Redis => Arc::new(RedisDemoEnv::create(args.keep.clone(), &names)?),
    };
    let report = demo::run(env, &params)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        demo::print(&report);
    }
    let healthy = report.order_violations == 0 && report.lost_jobs == 0;
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
