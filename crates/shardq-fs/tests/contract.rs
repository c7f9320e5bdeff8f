//! The backend contract (`shardq_core::contract`), written once in core, run
//! on the embedded engine with a manual clock.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use shardq_core::contract::{self, ContractHarness};
use shardq_core::{ManualClock, QueueBackend};
use shardq_fs::{Engine, EngineOptions, FsBackend};
use shardq_route::{Algorithm, ShardMap};

const SHARDS: usize = 16;

struct Fs {
    backend: Arc<FsBackend>,
    clock: ManualClock,
    next: AtomicUsize,
}

impl ContractHarness for Fs {
    fn backend(&self) -> &dyn QueueBackend {
        &*self.backend
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
fn the_embedded_engine_keeps_the_backend_contract() {
    let dir = std::env::temp_dir().join(format!("shardq-fs-contract-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let names: Vec<String> = (0..SHARDS).map(|i| format!("c-{i}")).collect();
    let map =
        ShardMap::with_shards(Algorithm::Rendezvous, names.iter().map(String::as_str)).unwrap();
    Engine::init(&dir, &map).unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let engine = Engine::open(
        &dir,
        EngineOptions {
            clock: Arc::new(clock.clone()),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let backend = engine.backend();
    for n in &names {
        backend.adopt(n).unwrap();
    }
    contract::run_all(&Fs {
        backend,
        clock,
        next: AtomicUsize::new(0),
    });
    let _ = std::fs::remove_dir_all(&dir);
}
