//! The fencing token per run, used as documented in `docs/fencing.md`: a
//! handler makes its write conditional on its run's fence, so a runner that
//! stalled past its job lease and wakes up after the job ran again cannot
//! overwrite the newer run's result.

use shardq_core::RunJobs;
use std::collections::BTreeMap;
use std::sync::Arc;

use shardq_core::memory::MemoryBackend;
use shardq_core::{ManualClock, NewJob};

/// The handler's own database: one row per key, written only by a run
/// whose fence is newer than the one stored
/// (`UPDATE t SET v = $v, fence = $f WHERE key = $k AND fence < $f`).
#[derive(Default)]
struct Table {
    rows: BTreeMap<String, (String, u64)>,
}

impl Table {
    /// Returns whether the write took effect.
    fn write_if_newer(&mut self, key: &str, value: &str, fence: u64) -> bool {
        match self.rows.get(key) {
            Some((_, stored)) if *stored >= fence => false,
            _ => {
                self.rows
                    .insert(key.to_string(), (value.to_string(), fence));
                true
            }
        }
    }
}

#[test]
fn a_stale_runners_write_loses() {
    let clock = ManualClock::new(1_700_000_000_000);
    let backend = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    backend
        .enqueue("s0", 1, &[NewJob::new("acct-7", "set balance")])
        .unwrap();
    let mut table = Table::default();

    // Run A starts, then its process stalls past the job lease.
    let a = backend.claim("s0", 1, 1_000).unwrap().remove(0);
    clock.advance(5_000);
    // The lease lapsed: run B of the same job starts, with a larger fence,
    // and writes its result.
    let b = backend.claim("s0", 1, 1_000).unwrap().remove(0);
    assert_eq!(b.id, a.id);
    assert!(b.fence > a.fence);
    assert!(table.write_if_newer(&b.key, "from B", b.fence));
    backend.ack("s0", &[b.receipt()]).unwrap();

    // A wakes up and finishes its work: its write loses, its ack is refused.
    assert!(!table.write_if_newer(&a.key, "from A", a.fence));
    let out = backend.ack("s0", &[a.receipt()]).unwrap();
    assert_eq!((out.acked, out.stale.len()), (0, 1));
    assert_eq!(table.rows["acct-7"], ("from B".to_string(), b.fence));
}

#[test]
fn fences_outgrow_a_store_that_lost_its_counter() {
    // A store that restarts from an old snapshot forgets the fences it
    // issued; fences are at least the clock in microseconds, so the next
    // run after the restart still gets a larger one.
    let clock = ManualClock::new(1_700_000_000_000);
    let before = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    before.enqueue("s0", 1, &[NewJob::new("k", "1")]).unwrap();
    let old = before.claim("s0", 1, 1_000).unwrap().remove(0);
    clock.advance(1);
    let restarted = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    restarted
        .enqueue("s0", 1, &[NewJob::new("k", "1")])
        .unwrap();
    let new = restarted.claim("s0", 1, 1_000).unwrap().remove(0);
    assert!(new.fence > old.fence, "{} after {}", new.fence, old.fence);
}
