//! [`History`]: per-second counts of what a process saw (jobs enqueued,
//! runs claimed, acked and failed, and the wait of the claimed jobs from
//! due to start) for the last [`HISTORY_SECONDS`], for the dashboard's chart
//! of the last hour, and totals since the process started.
//!
//! A ring of one bucket per second, each stamped with its second: a bucket
//! whose stamp is old is reset before it counts (under a lock taken only
//! then, once per bucket per second), so a feeding call is atomics only.
//! Counts are as exact as the callers' clock: a bucket holds what was added
//! while its second was current.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Seconds the ring keeps: one hour.
pub const HISTORY_SECONDS: usize = 3600;

/// What a bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Jobs stored by enqueues.
    Enqueued = 0,
    /// Runs handed to workers.
    Claimed = 1,
    /// Runs acked.
    Acked = 2,
    /// Runs failed (retried or dead).
    Failed = 3,
}

/// The four flows, in [`Flow`] order.
pub const FLOWS: [Flow; 4] = [Flow::Enqueued, Flow::Claimed, Flow::Acked, Flow::Failed];

#[derive(Default)]
struct Bucket {
    /// The second (since the epoch) this bucket counts, plus one (0: none).
    stamp: AtomicU64,
    counts: [AtomicU64; 4],
    /// Of the runs claimed in this second: the sum and the largest of
    /// their waits from due to start, in ms.
    wait_sum_ms: AtomicU64,
    wait_max_ms: AtomicU64,
}

/// See the module docs.
pub struct History {
    buckets: Vec<Bucket>,
    totals: [AtomicU64; 4],
    roll: Mutex<()>,
}

impl Default for History {
    fn default() -> Self {
        History {
            buckets: (0..HISTORY_SECONDS).map(|_| Bucket::default()).collect(),
            totals: Default::default(),
            roll: Mutex::new(()),
        }
    }
}

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("History").finish_non_exhaustive()
    }
}

/// What [`History::window`] returns.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Window {
    /// The last second of the window (since the epoch).
    pub until_s: u64,
    /// Per flow (in [`FLOWS`] order: enqueued, claimed, acked, failed), the
    /// count of each second, oldest first.
    pub enqueued: Vec<u64>,
    /// Runs claimed per second.
    pub claimed: Vec<u64>,
    /// Runs acked per second.
    pub acked: Vec<u64>,
    /// Runs failed per second.
    pub failed: Vec<u64>,
    /// Per second, the mean wait of the runs claimed in it (from due to
    /// start, in ms; 0 for none).
    pub wait_mean_ms: Vec<u64>,
    /// Per second, the longest such wait, in ms.
    pub wait_max_ms: Vec<u64>,
    /// Totals since the process started: enqueued, claimed, acked, failed.
    pub totals: [u64; 4],
}

impl History {
    /// Adds `n` of `flow` in second `now_s`.
    pub fn add(&self, flow: Flow, n: u64, now_s: u64) {
        if n == 0 {
            return;
        }
        self.totals[flow as usize].fetch_add(n, Ordering::Relaxed);
        if let Some(b) = self.bucket(now_s) {
            b.counts[flow as usize].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// A run claimed in second `now_s` that had waited `wait_ms` since it
    /// was due: counted as claimed, and its wait kept.
    pub fn claimed(&self, wait_ms: u64, now_s: u64) {
        self.totals[Flow::Claimed as usize].fetch_add(1, Ordering::Relaxed);
        if let Some(b) = self.bucket(now_s) {
            b.counts[Flow::Claimed as usize].fetch_add(1, Ordering::Relaxed);
            b.wait_sum_ms.fetch_add(wait_ms, Ordering::Relaxed);
            b.wait_max_ms.fetch_max(wait_ms, Ordering::Relaxed);
        }
    }

    /// The bucket of second `now_s`, reset first if it held an older
    /// second; `None` for a second an hour behind the bucket's.
    fn bucket(&self, now_s: u64) -> Option<&Bucket> {
        let b = &self.buckets[(now_s % HISTORY_SECONDS as u64) as usize];
        let stamp = now_s + 1;
        if b.stamp.load(Ordering::Acquire) != stamp {
            let _guard = self.roll.lock().unwrap_or_else(|e| e.into_inner());
            let seen = b.stamp.load(Ordering::Acquire);
            if seen < stamp {
                for c in &b.counts {
                    c.store(0, Ordering::Relaxed);
                }
                b.wait_sum_ms.store(0, Ordering::Relaxed);
                b.wait_max_ms.store(0, Ordering::Relaxed);
                b.stamp.store(stamp, Ordering::Release);
            } else if seen > stamp {
                // A caller whose clock is behind by an hour: not kept.
                return None;
            }
        }
        Some(b)
    }

    /// The last `seconds` (at most [`HISTORY_SECONDS`]) seconds up to
    /// `now_s`, zero where nothing was counted.
    pub fn window(&self, seconds: usize, now_s: u64) -> Window {
        let seconds = seconds.clamp(1, HISTORY_SECONDS);
        let mut series: [Vec<u64>; 4] = Default::default();
        let (mut wait_mean_ms, mut wait_max_ms) = (Vec::new(), Vec::new());
        for s in (0..seconds as u64).rev() {
            let sec = now_s.saturating_sub(s);
            let b = &self.buckets[(sec % HISTORY_SECONDS as u64) as usize];
            let live = b.stamp.load(Ordering::Acquire) == sec + 1;
            let read = |a: &AtomicU64| if live { a.load(Ordering::Relaxed) } else { 0 };
            for (i, out) in series.iter_mut().enumerate() {
                out.push(read(&b.counts[i]));
            }
            let claimed = read(&b.counts[Flow::Claimed as usize]);
            wait_mean_ms.push(read(&b.wait_sum_ms).checked_div(claimed).unwrap_or(0));
            wait_max_ms.push(read(&b.wait_max_ms));
        }
        let [enqueued, claimed, acked, failed] = series;
        Window {
            until_s: now_s,
            enqueued,
            claimed,
            acked,
            failed,
            wait_mean_ms,
            wait_max_ms,
            totals: std::array::from_fn(|i| self.totals[i].load(Ordering::Relaxed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_land_in_their_second_and_old_ones_are_forgotten() {
        let h = History::default();
        h.add(Flow::Acked, 3, 1000);
        h.add(Flow::Acked, 2, 1000);
        h.add(Flow::Failed, 1, 1001);
        h.add(Flow::Enqueued, 7, 1002);
        let w = h.window(3, 1002);
        assert_eq!(w.acked, [5, 0, 0]);
        assert_eq!(w.failed, [0, 1, 0]);
        assert_eq!(w.enqueued, [0, 0, 7]);
        assert_eq!(w.totals, [7, 0, 5, 1]);
        // An hour later the same bucket counts a new second.
        let later = 1000 + HISTORY_SECONDS as u64;
        h.add(Flow::Acked, 1, later);
        assert_eq!(h.window(1, later).acked, [1]);
        let w = h.window(HISTORY_SECONDS, later);
        assert_eq!(
            w.failed.iter().sum::<u64>(),
            1,
            "1001 is still within the hour"
        );
        assert_eq!(
            w.acked.iter().sum::<u64>(),
            1,
            "the old second 1000 is gone"
        );
        // A caller an hour behind does not count into a newer second.
        h.add(Flow::Acked, 9, 1000);
        assert_eq!(h.window(1, later).acked, [1]);
        assert_eq!(
            h.window(1, 5000).acked,
            [0],
            "a second never written is zero"
        );
    }

    #[test]
    fn threads_adding_at_once_lose_nothing() {
        let h = std::sync::Arc::new(History::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let h = std::sync::Arc::clone(&h);
                std::thread::spawn(move || {
                    for i in 0..10_000u64 {
                        h.add(Flow::Claimed, 1, 50 + i / 2500);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let w = h.window(4, 53);
        assert_eq!(w.claimed, [10_000; 4]);
        assert_eq!(w.totals[1], 40_000);
    }

    #[test]
    fn claim_waits_give_a_mean_and_a_max_per_second() {
        let h = History::default();
        for wait in [10, 20, 90] {
            h.claimed(wait, 7);
        }
        h.claimed(5, 8);
        let w = h.window(3, 8);
        assert_eq!(w.claimed, [0, 3, 1]);
        assert_eq!(w.wait_mean_ms, [0, 40, 5]);
        assert_eq!(w.wait_max_ms, [0, 90, 5]);
    }
}
