//! shardq-fs: the embedded engine. Each shard is an append-only log of
//! checksummed records in a data directory; processes coordinate through
//! `membership.json` (leases) and flocks, and any process may enqueue while
//! only a shard's owner runs its jobs.
//!
//! This crate must never route keys on its own terms (routing is
//! `shardq-route`'s) nor skip a record it cannot read.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::AtomicBool;
//! use shardq_core::{NewJob, PoolOptions};
//! use shardq_fs::{Engine, EngineOptions, MemberOptions};
//! use shardq_route::{Algorithm, ShardMap};
//!
//! let dir = std::env::temp_dir().join(format!("shardq-doc-{}", std::process::id()));
//! let _ = std::fs::remove_dir_all(&dir);
//! let map = ShardMap::with_shards(Algorithm::Rendezvous, ["shard-0", "shard-1"]).unwrap();
//! Engine::init(&dir, &map).unwrap();
//!
//! let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
//! engine.enqueue(NewJob::new("tenant-1", "hello")).unwrap();
//! engine.enqueue(NewJob::new("tenant-2", "world")).unwrap();
//! assert_eq!(engine.status().unwrap().totals.ready, 2);
//!
//! let done = Arc::new(std::sync::Mutex::new(Vec::new()));
//! let seen = Arc::clone(&done);
//! let report = engine
//!     .run_workers(
//!         MemberOptions { max_local_shards: usize::MAX, ..MemberOptions::default() },
//!         PoolOptions { concurrency: 2, exit_when_idle: true, ..PoolOptions::default() },
//!         Arc::new(move |job| {
//!             seen.lock().unwrap().push(String::from_utf8_lossy(&job.payload).into_owned());
//!             Ok(())
//!         }),
//!         &AtomicBool::new(false),
//!     )
//!     .unwrap();
//! assert_eq!(report.acked, 2);
//! assert_eq!(engine.status().unwrap().totals.ready, 0);
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```

pub mod backend;
pub mod engine;
pub mod error;
pub mod flow_groups;
mod id_index;
pub mod layout;
mod log;
pub mod map_store;
pub mod membership;
pub mod reclaim;
pub mod record;
pub mod repair;
pub mod stalled;
mod state;
pub mod storage;

pub use backend::{Durability, EngineOptions, FsBackend, FINISHED_FILE, MOVED_FILE};
pub use engine::{Engine, ShardStatus, Status, StatusTotals};
pub use error::FsError;
pub use flow_groups::{FileGroupBuckets, GROUP_BUCKETS_FILE};
pub use membership::{FsCoordinator, MemberOptions};
