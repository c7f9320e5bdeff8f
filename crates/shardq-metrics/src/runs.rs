//! The claim times of runs handed to remote workers, so that the run time
//! histogram can be fed when the ack or fail arrives (possibly at another
//! request, much later).
//!
//! Bounded: at most [`RUNS_TRACKED_MAX`] runs are kept. When full, runs
//! claimed more than [`RUN_FORGET_MS`] ago (whose worker most likely let the
//! lease lapse) are dropped; if it is still full the new run is not tracked
//! and its run time is not observed (its counters still are). It must never
//! grow without bound, whatever the workers do.

use std::collections::HashMap;
use std::sync::Arc;

use ahash::RandomState;

use shardq_core::Receipt;

/// Most runs whose claim time is kept.
pub const RUNS_TRACKED_MAX: usize = 65_536;
/// Age past which a tracked run may be dropped to make room (1 h).
pub const RUN_FORGET_MS: u64 = 3_600_000;

/// Claim times by (shard, job id, fence); see the module docs. Shard names
/// are numbered once (there are few), so tracking a run allocates nothing.
#[derive(Debug, Default)]
pub struct RunTracker {
    shards: HashMap<Arc<str>, u32, RandomState>,
    started: HashMap<(u32, u64, u64), u64, RandomState>,
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
        if self.started.len() >= RUNS_TRACKED_MAX {
            let cutoff = now_ms.saturating_sub(RUN_FORGET_MS);
            self.started.retain(|_, &mut t| t >= cutoff);
            if self.started.len() >= RUNS_TRACKED_MAX {
                return;
            }
        }
        let n = match self.shards.get(shard) {
            Some(&n) => n,
            None => {
                let n = self.shards.len() as u32;
                self.shards.insert(Arc::from(shard), n);
                n
            }
        };
        self.started.insert((n, r.id.0, r.fence), now_ms);
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
    fn it_stays_bounded_and_forgets_old_runs_first() {
        let mut t = RunTracker::default();
        for i in 0..RUNS_TRACKED_MAX as u64 {
            t.started("s0", receipt(i), 0);
        }
        // Full of recent runs: a new one is not tracked.
        t.started("s0", receipt(u64::MAX), 10);
        assert_eq!(t.len(), RUNS_TRACKED_MAX);
        assert_eq!(t.finished("s0", receipt(u64::MAX)), None);
        // An hour later the old ones make room.
        t.started("s0", receipt(u64::MAX), RUN_FORGET_MS + 1);
        assert_eq!(t.len(), 1);
        assert_eq!(t.finished("s0", receipt(u64::MAX)), Some(RUN_FORGET_MS + 1));
    }
}
