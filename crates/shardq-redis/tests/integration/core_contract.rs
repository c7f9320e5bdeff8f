//! The backend contract (`shardq_core::contract`), written once in core, run
//! on one redis-server with a manual clock.

use std::sync::atomic::{AtomicUsize, Ordering};

use shardq_core::contract::{self, ContractHarness};
use shardq_core::{ManualClock, QueueBackend};
use shardq_redis::testing::RedisServer;
use shardq_redis::{RedisBackend, RedisCoordinator};

use crate::common::{init, map_of, opts_manual, owner};

const SHARDS: usize = 16;

struct Redis {
    backend: RedisBackend,
    clock: ManualClock,
    next: AtomicUsize,
    _owner: RedisCoordinator,
}

impl ContractHarness for Redis {
    fn backend(&self) -> &dyn QueueBackend {
        &self.backend
    }
    fn fresh_shard(&self) -> String {
        let i = self.next.fetch_add(1, Ordering::SeqCst);
        assert!(i < SHARDS, "the harness has {SHARDS} shards");
        format!("c-{i}")
    }
    fn pass_ms(&self, ms: u64) {
        self.clock.advance(ms);
    }
}

#[test]
fn redis_keeps_the_backend_contract() {
    let server = RedisServer::start();
    let names: Vec<(String, String)> = (0..SHARDS)
        .map(|i| (format!("c-{i}"), server.url()))
        .collect();
    let refs: Vec<(&str, String)> = names.iter().map(|(n, u)| (n.as_str(), u.clone())).collect();
    let map = map_of(&refs);
    init(&map);
    let clock = ManualClock::new(1_700_000_000_000);
    let backend = RedisBackend::open(&map, opts_manual(&clock)).expect("open");
    let coordinator = owner(&backend, "contract", 600_000);
    contract::run_all(&Redis {
        backend,
        clock,
        next: AtomicUsize::new(0),
        _owner: coordinator,
    });
}
