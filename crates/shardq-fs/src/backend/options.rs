//! The engine's options (`EngineOptions`, `Durability`) and their defaults.

use super::*;

/// Default `interval` durability period.
pub const SYNC_INTERVAL_MS_DEFAULT: u64 = 100;
/// Shortest `interval` period the flusher wakes at (a period of 0 would spin).
pub const SYNC_INTERVAL_MS_MIN: u64 = 1;

/// When appended records are made durable, and what a crash can lose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// fsync before an enqueue (or claim/ack batch) returns; concurrent
    /// appenders of one process share fsyncs (group commit). A power loss
    /// loses nothing that returned success.
    Fsync,
    /// fsync when `ms` have passed since the last one, checked on each
    /// append, plus a background flusher that wakes every `ms` and fsyncs
    /// what an idle shard left unsynced, and on close. A power loss can lose
    /// about the last `ms` of appends (plus the time an fsync takes); a
    /// process crash loses nothing written.
    Interval {
        /// Period (at least [`SYNC_INTERVAL_MS_MIN`]).
        ms: u64,
    },
    /// Never fsync; the OS writes back when it likes. A process crash loses
    /// nothing written; a power loss can lose anything not yet written back.
    None,
}

/// Options of the engine.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Largest payload accepted (default 1 MiB, at most 64 MiB).
    pub payload_bytes_max: usize,
    /// See [`Durability`].
    pub durability: Durability,
    /// Segment size before rolling (default 64 MiB).
    pub segment_bytes_max: u64,
    /// What a key does after a dead job.
    pub dead_policy: DeadPolicy,
    /// Retry backoff of keys without a rule.
    pub backoff: Backoff,
    /// Per-key and per-prefix retry policies: a failed run of a key with a
    /// rule waits its rule's backoff instead.
    pub retry_rules: Arc<RetryRules>,
    /// How many finished jobs each shard keeps, and how long
    /// ([`FINISHED_FILE`]).
    pub retention: Retention,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// Disk access.
    pub storage: Arc<dyn Storage>,
    /// Longest wait for a shard's append lock before the shard is reported
    /// [`QueueError::Unavailable`] (default
    /// [`APPEND_LOCK_WAIT_MS_DEFAULT`], 1 s).
    pub append_lock_wait_ms: u64,
    /// Under [`Durability::Fsync`], how long a claim, ack or fail record may
    /// stay written but not yet fsynced (default
    /// [`RUN_RECORD_SYNC_MS_DEFAULT`], 50 ms). Enqueues are fsynced before
    /// they return; run records need not be: delivery is at-least-once, so
    /// a power loss that drops the last acks only runs those jobs again, and
    /// a dropped claim or fail only lowers an attempt count. A later fsync
    /// (an enqueue's, the background flusher's) covers every earlier record.
    pub run_record_sync_ms: u64,
    /// Flow control: which keys may start a run now (rate limits of keys
    /// and groups). None: every key may.
    pub flow: Option<Arc<FlowControl>>,
}

/// Default for [`EngineOptions::run_record_sync_ms`].
pub const RUN_RECORD_SYNC_MS_DEFAULT: u64 = 50;

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            payload_bytes_max: PAYLOAD_BYTES_MAX_DEFAULT,
            durability: Durability::Fsync,
            segment_bytes_max: SEGMENT_BYTES_DEFAULT,
            dead_policy: DeadPolicy::Continue,
            backoff: Backoff::default(),
            retry_rules: Arc::default(),
            retention: Retention::default(),
            clock: Arc::new(SystemClock),
            storage: Arc::new(OsStorage),
            append_lock_wait_ms: APPEND_LOCK_WAIT_MS_DEFAULT,
            run_record_sync_ms: RUN_RECORD_SYNC_MS_DEFAULT,
            flow: None,
        }
    }
}
