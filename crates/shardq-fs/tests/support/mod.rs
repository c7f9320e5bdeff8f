//! Helpers shared by the engine's tests: fresh data dirs, engine options
//! on a manual clock, jobs, member options, and a bounded wait.
//!
//! Each test file compiles this module on its own and uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardq_core::{Backoff, ManualClock, NewJob};
use shardq_fs::{Engine, EngineOptions, MemberOptions};
use shardq_route::{Algorithm, ShardMap};

/// A fresh data dir (in the temp dir, named after the test and this
/// process) initialised with `shards`, routed by rendezvous.
pub fn data_dir_with(name: &str, shards: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardq-fs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let map = ShardMap::with_shards(Algorithm::Rendezvous, shards.iter().copied()).unwrap();
    Engine::init(&dir, &map).unwrap();
    dir
}

/// [`data_dir_with`] one shard, `shard-0`.
pub fn data_dir(name: &str) -> PathBuf {
    data_dir_with(name, &["shard-0"])
}

/// [`data_dir_with`] `shard-0` .. `shard-{n-1}`.
pub fn data_dir_n(name: &str, shards: usize) -> PathBuf {
    let names: Vec<String> = (0..shards).map(|i| format!("shard-{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    data_dir_with(name, &refs)
}

/// Engine options on `clock`, with retry backoff of 100 ms doubling to 1 s,
/// no jitter.
pub fn opts(clock: &ManualClock) -> EngineOptions {
    EngineOptions {
        clock: Arc::new(clock.clone()),
        backoff: Backoff {
            base_ms: 100,
            max_ms: 1000,
            jitter_pct: 0,
            ..Backoff::default()
        },
        ..EngineOptions::default()
    }
}

pub fn job(key: &str, payload: &str, max_attempts: u32) -> NewJob {
    NewJob {
        max_attempts,
        ..NewJob::new(key, payload)
    }
}

/// A member holding at most one shard, 30 s leases.
pub fn member(id: &str) -> MemberOptions {
    MemberOptions {
        member_id: id.into(),
        lease_ms: 30_000,
        clock_skew_ms: 1_000,
        max_local_shards: 1,
    }
}

/// Polls `cond` every 2 ms up to `limit`: how long it took, or `None`.
pub fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}
