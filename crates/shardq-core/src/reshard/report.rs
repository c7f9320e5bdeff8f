//! What a rebalance tells its caller: events as it goes (`RebalanceEvent`)
//! and a report at the end (`RebalanceReport`, `MovedKey`).

use super::*;

/// A key that moved with drain-then-switch.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MovedKey {
    /// The key.
    pub key: String,
    /// Old shard.
    pub from: String,
    /// New shard.
    pub to: String,
    /// How long its enqueues were paused, in ms.
    pub pause_ms: f64,
    /// Jobs (queued, delayed and dead) copied to its new shard with it.
    #[serde(default)]
    pub jobs_moved: u64,
    /// How long the move waited for the key's run in flight on its old
    /// shard to end, in ms.
    #[serde(default)]
    pub run_wait_ms: f64,
}

/// Something a rebalance reports while it runs.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum RebalanceEvent {
    /// Phase 1 done: `pinned` keys with work will move, map published at `version`.
    Pinned {
        /// Keys to move.
        pinned: usize,
        /// Version of the intermediate map.
        version: u64,
    },
    /// A batch was sealed on its old shards and its move began.
    Moving {
        /// Keys of this batch.
        keys: usize,
    },
    /// A batch still waits, `waited_ms` in, for `keys` of its keys: their
    /// runs on their old shards.
    /// Sent every [`WAIT_EVENT_EVERY_MS`] of the wait, so a long one is
    /// seen as alive.
    Waiting {
        /// Keys still waited for.
        keys: usize,
        /// How long the batch has waited, in ms.
        waited_ms: u64,
    },
    /// A batch switched; `done` of `total` keys moved.
    Switched {
        /// Keys moved so far.
        done: usize,
        /// Keys to move in all.
        total: usize,
        /// Keys of this batch.
        keys: usize,
        /// How long this batch's keys were paused, in ms.
        pause_ms: f64,
        /// Jobs copied with this batch's keys.
        jobs: u64,
    },
    /// The target map is published at `version`.
    Finished {
        /// Final version.
        version: u64,
    },
}

/// What a rebalance did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RebalanceReport {
    /// Published version before.
    pub from_version: u64,
    /// Published version after.
    pub to_version: u64,
    /// Keys with work that moved, with their backlogs.
    pub moved: Vec<MovedKey>,
    /// Wall time, in ms.
    pub elapsed_ms: f64,
    /// Jobs copied to new shards with their keys.
    #[serde(default)]
    pub jobs_moved: u64,
    /// True when there was nothing to do.
    pub nothing_to_do: bool,
}

impl RebalanceReport {
    /// Pause percentile `p` (0..=100) over moved keys, in ms.
    pub fn pause_percentile_ms(&self, p: f64) -> f64 {
        let mut v: Vec<f64> = self.moved.iter().map(|m| m.pause_ms).collect();
        percentile(&mut v, p)
    }
}

/// Nearest-rank percentile of `values` (sorted in place); 0 when empty.
pub fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}
