//! The claim times of runs handed to remote workers, so that the run time
//! histogram can be fed when the ack or fail arrives (possibly at another
//! request, much later).
//!
//! Bounded: at most [`RUNS_TRACKED_MAX`] runs are kept. When full, the run
//! claimed first is dropped to make room (its worker most likely let the
//! lease lapse; its run time is then not observed, its counters still
//! are). Starting and finishing a run cost O(1) amortised whatever the
//! table holds: runs lapsed by the ten thousand never make each claim walk
//! the table. It must never grow without bound, whatever the workers do.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use ahash::RandomState;

use shardq_core::Receipt;

/// Most runs whose claim time is kept.
pub const RUNS_TRACKED_MAX: usize = 65_536;

/// A tracked run: (shard number, job id, fence).
type RunKey = (u32, u64, u64);

/// Claim times by (shard, job id, fence); see the module docs. Shard names
/// are numbered once (there are few), so tracking a run allocates nothing.
#[derive(Debug, Default)]
pub struct RunTracker {
    shards: HashMap<Arc<str>, u32, RandomState>,
    started: HashMap<RunKey, u64, RandomState>,
    /// Runs in the order they started; finished ones stay until they reach
    /// the front or the queue is compacted (at twice the table's size).
    order: VecDeque<RunKey>,
}

impl RunTracker {
    /// Runs tracked now.
    pub fn len(&self) -> usize {
        self.started.len()
    }

    /// True when no run is tracked.
    pub fn is_empty(&self) -> bool {
        self.started.is_empty()
    }

    /// Run `r` of shard `shard` was claimed at `now_ms`.
    pub fn started(&mut self, shard: &str, r: Receipt, now_ms: u64) {
        while self.started.len() >= RUNS_TRACKED_MAX {
            match self.order.pop_front() {
                Some(oldest) => {
                    self.started.remove(&oldest);
                }
                None => break,
            }
        }
        if self.order.len() >= 2 * RUNS_TRACKED_MAX {
            let started = &self.started;
            self.order.retain(|k| started.contains_key(k));
        }
        let n = match self.shards.get(shard) {
            Some(&n) => n,
            None => {
                let n = self.shards.len() as u32;
                self.shards.insert(Arc::from(shard), n);
                n
            }
        };
        let k = (n, r.id.0, r.fence);
        if self.started.insert(k, now_ms).is_none() {
            self.order.push_back(k);
        }
    }

    /// Entries of the start-order queue (live and finished), for tests of
    /// the bound.
    pub fn queued(&self) -> usize {
        self.order.len()
    }

    /// Run `r` ended: its claim time, if it was tracked.
    pub fn finished(&mut self, shard: &str, r: Receipt) -> Option<u64> {
        let n = *self.shards.get(shard)?;
        self.started.remove(&(n, r.id.0, r.fence))
    }
}

#[cfg(test)]
mod tests {
    use shardq_core::JobId;

    use super::*;

    fn receipt(id: u64) -> Receipt {
        Receipt {
            id: JobId(id),
            fence: 7,
        }
    }

    #[test]
    fn a_run_is_found_once_by_shard_id_and_fence() {
        let mut t = RunTracker::default();
        t.started("s0", receipt(1), 100);
        assert_eq!(t.finished("s1", receipt(1)), None);
        let other_fence = Receipt {
            id: JobId(1),
            fence: 8,
        };
        assert_eq!(t.finished("s0", other_fence), None);
        assert_eq!(t.finished("s0", receipt(1)), Some(100));
        assert_eq!(t.finished("s0", receipt(1)), None);
    }

    #[test]
    fn it_stays_bounded_and_drops_the_oldest_run_first() {
        let mut t = RunTracker::default();
        // 100,000 runs lapse without an ack, then new runs keep coming.
        for i in 0..100_000u64 {
            t.started("s0", receipt(i), i);
        }
        assert_eq!(t.len(), RUNS_TRACKED_MAX);
        // The newest runs are tracked and their time observed; the oldest
        // made room.
        t.started("s0", receipt(u64::MAX), 200_000);
        assert_eq!(t.finished("s0", receipt(u64::MAX)), Some(200_000));
        assert_eq!(t.finished("s0", receipt(99_999)), Some(99_999));
        assert_eq!(t.finished("s0", receipt(0)), None, "the oldest was dropped");
        assert!(t.len() <= RUNS_TRACKED_MAX);
        // Finished runs leave the queue too: it stays within twice the bound.
        for i in 0..300_000u64 {
            t.started("s1", receipt(i), i);
            assert_eq!(t.finished("s1", receipt(i)), Some(i));
        }
        assert!(t.queued() <= 2 * RUNS_TRACKED_MAX, "{}", t.queued());
    }
}
