//! The backend contract (`shardq_testkit::contract`) on the memory backend
//! with a manual clock: one test per check, each on a backend of its own
//! (`cargo test -p shardq-core --test contract one_run_per_key` runs one).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use shardq_core::flow::{FlowControl, FlowSettings, LocalGroupBuckets};
use shardq_core::memory::{MemoryBackend, MemoryCheckpoint};
use shardq_core::{ManualClock, QueueBackend};
use shardq_testkit::contract::{self, ContractHarness, RewindHarness};

struct Memory {
    backend: MemoryBackend,
    clock: ManualClock,
    next: AtomicUsize,
    saved: Mutex<Option<MemoryCheckpoint>>,
    flow: Arc<FlowControl>,
}

impl RewindHarness for Memory {
    fn checkpoint(&self, shard: &str) {
        *self.saved.lock().unwrap() = self.backend.checkpoint(shard);
    }
    fn rewind(&self, shard: &str) {
        let saved = self.saved.lock().unwrap().take().expect("a checkpoint");
        self.backend.rewind(shard, &saved);
    }
}

impl ContractHarness for Memory {
    fn backend(&self) -> &dyn QueueBackend {
        &self.backend
    }
    fn fresh_shard(&self) -> String {
        let name = format!("c-{}", self.next.fetch_add(1, Ordering::SeqCst));
        self.backend.add_shard(&name);
        name
    }
    fn pass_ms(&self, ms: u64) {
        self.clock.advance(ms);
    }
    fn flow(&self) -> Option<&FlowControl> {
        Some(&self.flow)
    }
}

/// A memory backend with no shards (each check adds its own), the
/// contract's retry rules and flow settings.
fn memory() -> Memory {
    let clock = ManualClock::new(1_700_000_000_000);
    let flow = Arc::new(FlowControl::new(
        contract::flow_settings(),
        Arc::new(LocalGroupBuckets::default()),
    ));
    Memory {
        backend: MemoryBackend::new(&[], Arc::new(clock.clone()))
            .with_retry_rules(contract::retry_rules())
            .with_flow(Arc::clone(&flow)),
        clock,
        next: AtomicUsize::new(0),
        saved: Mutex::default(),
        flow,
    }
}

shardq_testkit::contract_tests!(memory(), rewind);

/// The rules a store resolves by itself give every key the concurrency
/// its policy gives, and leave out the key entries that change nothing
/// (on the contract's settings that resolve concurrency every way there
/// is; the Redis claim script is checked against the same settings).
#[test]
fn concurrency_rules_agree_with_the_policies() {
    let plain = FlowSettings::default();
    assert_eq!(
        plain.concurrency_rules(),
        None,
        "one run per key needs no rules"
    );
    let s = contract::mixed_concurrency_settings();
    let r = s.concurrency_rules().expect("rules");
    let mut listed: Vec<&str> = r.keys.iter().map(|(k, _)| k.as_str()).collect();
    listed.sort();
    assert_eq!(listed, ["ab", "abcd", "x"], "{r:?}");
    assert_eq!(r.prefixes[0].0, "abc", "longest first: {r:?}");
    let alphabet = ["a", "b", "c", "d", "x", "z", "é"];
    let mut keys = vec![String::new()];
    for _ in 0..4 {
        let longer: Vec<String> = (keys.iter())
            .flat_map(|k| alphabet.iter().map(move |c| format!("{k}{c}")))
            .collect();
        keys.extend(longer);
    }
    keys.dedup();
    for k in keys.iter().filter(|k| !k.is_empty()) {
        assert_eq!(r.of(k), s.for_key(k).concurrency, "key {k:?}");
    }
}
