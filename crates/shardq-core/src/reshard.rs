//! Live resharding: add, remove and reweight shards, and pin keys, without
//! ever breaking a key's order, on any backend.
//!
//! Routing changes only through [`rebalance`]. The operations
//! ([`add_shard`], [`remove_shard`], [`set_weight`], [`pin`], [`unpin`])
//! only record a *target* map in the [`MapStore`] (and, for a new shard,
//! publish it as `warming`, visible but receiving nothing); [`rebalance`]
//! then walks the published map to the target:
//!
//! 1. **Pin.** Scan every shard for keys with queued or in-flight work whose
//!    owner differs between the current map and the target. Fence every shard
//!    at the next version (from then on no enqueue routed with the current map
//!    lands anywhere; producers wait for the new map), scan again (catching
//!    enqueues that raced the first scan), and publish the *intermediate* map:
//!    the target's shards and weights, with each moving key pinned (an
//!    override) to its current shard and removed shards kept as `draining`.
//!    A key with live dedup records counts as a key with work here (it is
//!    pinned and moved by phase 2, so its records go with it).
//!    Keys without work follow the target at once: nothing of theirs is
//!    queued anywhere, so nothing can be overtaken; before the publish every
//!    target shard's run-fence floor is raised above every shard's highest
//!    fence, so their next runs get larger fences than their last ones.
//! 2. **Move each key with its backlog**, in batches (every backend moves
//!    backlogs: the embedded engine, Redis instances and Redis Cluster, the
//!    in-memory one): seal the batch on its old shards (no run starts there; enqueues
//!    still go in); a key with a run in flight there waits for it, sealed,
//!    on its own (bounded by `drain_timeout_ms`; a key still running then
//!    stays, unsealed, with nothing copied) while the others of its batch
//!    go on, and joins a later batch once its run ended. Then raise the
//!    new shards' run-fence floor, copy each key's
//!    queued, delayed and dead jobs in rounds while its producers keep
//!    writing ([`TRANSFER_ROUNDS_MAX`] rounds of [`TRANSFER_CHUNK_JOBS`]-job
//!    chunks; the new shard may run the copies at once; a backend may defer
//!    their durability to [`QueueBackend::sync_imports`], called on each new
//!    shard before any source is deleted), then a last round
//!    (with the key's dedup records; one read per old shard for the batch,
//!    from the cursors the rounds kept) and a *freeze*: one atomic step on
//!    the old shard ([`QueueBackend::freeze_caught_up`]) that checks no job
//!    of the key arrived since and marks it frozen, so its next enqueues
//!    there are sent to the new shard ([`QueueError::Moved`]) at once. No
//!    producer waits. A key that gets a job before every one of
//!    [`FREEZE_ATTEMPTS_MAX`] freezes is paused on its new shard for one
//!    more round instead (its producers wait for that round only). Then
//!    publish the switch, fence the old shards at it, delete the copies
//!    left behind and unseal (which unfreezes). A frozen key is never
//!    unsealed otherwise: it must finish its move. Every
//!    copy is idempotent: the new shard skips source ids at or below what it
//!    took from that shard for that key ([`QueueBackend::imported_up_to`]),
//!    and a rerun first finishes every transfer a killed run left sealed,
//!    to the shard the seal names (keeping the pauses of sealed keys, and
//!    pinning such a key where the published map sends its producers, even
//!    when the target changed since). `docs/design.md` ("Moving a key with its
//!    backlog") argues each step, killed anywhere. Dead letters move with
//!    their key, so no key is held back. A shard that fails mid-move (its
//!    read fails once a batch step failed) is set aside: its keys stay
//!    where they are, the others move, and the run ends with
//!    [`ReshardError::ShardsFailed`] naming it; the rerun finishes.
//!
//! 3. **Finish.** Publish the target itself (removed shards gone, the
//!    temporary pins gone, the operator's pins kept even where they equal the
//!    computed owner) and clear the stored target. A backstop first checks
//!    that the final map routes every key with work to the shard that holds it.
//!
//! "Work" is queued, delayed and in-flight jobs, and dead letters; a
//! backlog move takes a key's dead letters along.
//!
//! Every step is idempotent and the phase is derived from (published map,
//! target), never from memory, so a coordinator killed anywhere can be rerun
//! and finishes the work. One rebalance runs at a time
//! ([`MapStore::try_lock_rebalance`]). Where the lock is a lease that can
//! lapse while its holder lives (Redis: a holder stopped or paused past
//! it), each run also takes a larger *epoch* ([`MapStore::rebalance_epoch`])
//! and first raises every shard's to it ([`QueueBackend::enter_rebalance`]):
//! from then on the shards refuse the stalled holder's writes
//! ([`QueueError::Superseded`]), so it cannot unseal, purge, copy or freeze
//! behind the run that took over. Under the lock, each run keeps a
//! [`RebalanceProgress`] record in the map store ([`SETTING_REBALANCE`]):
//! who runs it, its phase, keys, jobs and times, for every dashboard and
//! `status` of the deployment. It is for the eyes only: no step reads it,
//! a failed write of it fails nothing, and a run whose record a later run
//! replaced writes no more.
//!
//! This module does no I/O of its own: maps and locks go through
//! [`MapStore`], queue state through [`QueueBackend`] and [`KeyInventory`].

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use shardq_route::{MapError, Router, Shard, ShardMap, ShardState};
use thiserror::Error;

use crate::backend::QueueBackend;
use crate::clock::{Clock, SystemClock};
use crate::error::{ErrorKind, QueueError};
use crate::job::{DedupRecord, JobId, KeyCounts, MovedJob};

/// Default keys moved per batch.
pub const BATCH_DEFAULT: usize = 64;
/// Largest batch.
pub const BATCH_MAX: usize = 4096;
/// Default longest wait for one batch to drain (5 minutes, as in the specification).
pub const DRAIN_TIMEOUT_MS_DEFAULT: u64 = 300_000;
/// Default interval between drain checks.
pub const DRAIN_POLL_MS_DEFAULT: u64 = 2;
/// Jobs per export and import call of a backlog transfer.
pub const TRANSFER_CHUNK_JOBS: usize = 4096;
/// How often a waiting batch says so ([`RebalanceEvent::Waiting`]), in ms.
pub const WAIT_EVENT_EVERY_MS: u64 = 1_000;
/// Last rounds (each followed by a try to freeze the key) before a key that
/// keeps getting jobs is paused on its new shard for one round instead.
pub const FREEZE_ATTEMPTS_MAX: usize = 4;
/// Copy rounds of a key's backlog before its last one: each round copies
/// what arrived during the one before, while producers still write to the
/// old shard; the last round, under a pause, copies what is left. A round
/// that found fewer than [`TRANSFER_CHUNK_JOBS`] jobs ends the rounds early.
pub const TRANSFER_ROUNDS_MAX: usize = 8;

/// Where the shard map lives: a file in a data directory, a key in Redis.
pub trait MapStore: Send + Sync {
    /// The published map.
    fn load(&self) -> Result<ShardMap, ReshardError>;
    /// Publishes `map` if the published version is still `expected_version`
    /// (compare-and-set); `map.version` must be greater.
    fn publish(&self, map: &ShardMap, expected_version: u64) -> Result<(), ReshardError>;
    /// The map a rebalance should reach, if one is pending.
    fn load_target(&self) -> Result<Option<ShardMap>, ReshardError>;
    /// Records `target` as the pending target (under the rebalance lock:
    /// every operation that changes the target holds it).
    fn store_target(&self, target: &ShardMap) -> Result<(), ReshardError>;
    /// Clears the pending target if it is still `reached` (the target a
    /// finished rebalance published; versions aside): compare-and-delete,
    /// so a target recorded while the rebalance ran (its lock lapsed and
    /// an operator's change took it) is never erased. `Ok(true)` when
    /// cleared or none is pending; `Ok(false)` when another target is
    /// pending, and it stays.
    fn clear_target(&self, reached: &ShardMap) -> Result<bool, ReshardError>;
    /// Under the lock: fails ([`ReshardError::LockLost`]) once the store knows
    /// the lock was lost (a renewal found another holder or none). A
    /// rebalance asks between its steps and stops; a store whose lock
    /// lasts exactly as long as its holder never loses it (the default).
    fn check_lock(&self) -> Result<(), ReshardError> {
        Ok(())
    }
    /// Takes the rebalance lock; the guard releases it on drop. A second
    /// holder gets [`ReshardError::Busy`].
    fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, ReshardError>;
    /// Under the lock: a number larger than every earlier rebalance's
    /// (its *epoch*), which its writes to the shards carry
    /// ([`QueueBackend::enter_rebalance`]). A store whose lock can lapse
    /// while its holder lives (a lease, as on Redis) must give one; 0
    /// (the default) means the lock lasts exactly as long as its holder.
    fn rebalance_epoch(&self) -> Result<u64, ReshardError> {
        Ok(0)
    }
    /// A deployment setting by name ([`SETTING_RETRY`]): the JSON document
    /// stored beside the map, if one is.
    fn load_setting(&self, name: &str) -> Result<Option<String>, ReshardError> {
        let _ = name;
        Ok(None)
    }
    /// Compare-and-set of a deployment setting: replaces it with `value`
    /// (`None` clears it) only if it still holds `expected` (`None`: it is
    /// unset). `Ok(true)` once stored, for every process of the deployment
    /// to read; `Ok(false)` when another writer changed it first, and
    /// nothing was stored. The one primitive every settings change goes
    /// through ([`update_setting`]), so no acknowledged change is lost to
    /// a concurrent writer in this process, another process or another
    /// server.
    fn swap_setting(
        &self,
        name: &str,
        expected: Option<&str>,
        value: Option<&str>,
    ) -> Result<bool, ReshardError> {
        let _ = (name, expected, value);
        Err(ReshardError::Invalid(
            "this map store keeps no deployment settings".into(),
        ))
    }
    /// Stores (or, with `None`, clears) a deployment setting whatever it
    /// holds: for a writer that owns the whole setting (a rebalance's
    /// progress). Changes that read the setting first use
    /// [`update_setting`].
    fn store_setting(&self, name: &str, value: Option<&str>) -> Result<(), ReshardError> {
        update_setting(self, name, |_| {
            Ok::<_, ReshardError>((value.map(str::to_string), ()))
        })
    }
}

/// Compare-and-set rounds [`update_setting`] tries before it reports the
/// setting as too busy: each lost round means another writer's change was
/// stored, so this bounds only a writer that keeps losing.
pub const SETTING_SWAP_TRIES: u32 = 200;

/// Changes deployment setting `name` atomically against every other
/// writer: reads it, asks `change` for the new text (given the current
/// one) and stores it with [`MapStore::swap_setting`]; when another
/// writer got there first, reads again and asks again. `change` returns
/// the new text (`None` clears the setting) and a result for the caller;
/// a new text equal to the current one writes nothing. An `Ok` means
/// the change is stored.
pub fn update_setting<S, R, E>(
    store: &S,
    name: &str,
    mut change: impl FnMut(Option<&str>) -> Result<(Option<String>, R), E>,
) -> Result<R, E>
where
    S: MapStore + ?Sized,
    E: From<ReshardError>,
{
    for round in 0..SETTING_SWAP_TRIES {
        let current = store.load_setting(name)?;
        let (next, out) = change(current.as_deref())?;
        if next == current {
            return Ok(out);
        }
        if store.swap_setting(name, current.as_deref(), next.as_deref())? {
            return Ok(out);
        }
        // Lost to another writer: a short, growing pause spreads the
        // retries of many writers racing on one setting.
        std::thread::sleep(std::time::Duration::from_micros(
            50 * u64::from(round.min(40) + 1),
        ));
    }
    Err(ReshardError::Unavailable(format!(
        "the deployment setting {name:?} changed under this change {SETTING_SWAP_TRIES} times in          a row (other writers keep changing it); nothing was stored: try again"
    ))
    .into())
}

/// The deployment setting holding the retry backoff (a `Backoff` as JSON).
pub const SETTING_RETRY: &str = "retry";
/// The deployment setting holding how long finished jobs are kept (a
/// `Retention` as JSON).
pub const SETTING_RETENTION: &str = "retention";
/// The deployment setting holding flow control (a `FlowSettings` as JSON:
/// policies by key and prefix, and groups).
pub const SETTING_FLOW: &str = "flow";

/// Checks a setting's name: 1 to 32 lowercase ASCII letters and `-`.
pub fn validate_setting_name(name: &str) -> Result<(), ReshardError> {
    if name.is_empty()
        || name.len() > 32
        || !name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
    {
        return Err(ReshardError::Invalid(format!(
            "setting name {name:?}: 1 to 32 lowercase letters and `-`"
        )));
    }
    Ok(())
}

/// Which keys have work on a shard: what a rebalance must drain.
pub trait KeyInventory {
    /// Every key with queued, delayed or in-flight jobs on `shard`, with its counts.
    fn keys_with_work(&self, shard: &str) -> Result<Vec<(String, KeyCounts)>, QueueError>;
}

/// Errors of resharding.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ReshardError {
    /// The queue backend failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// A map is invalid.
    #[error(transparent)]
    Map(#[from] MapError),
    /// Another rebalance holds the lock.
    #[error(
        "another rebalance is running ({holder}); wait for it to finish, or rerun after it dies"
    )]
    Busy {
        /// Who holds the lock, as far as known.
        holder: String,
    },
    /// This rebalance's lock lapsed while it ran (its holder stalled past
    /// the lease, or a renewal failed): it writes nothing more.
    #[error("this rebalance lost its lock: {reason}; it stopped and wrote nothing more: run rebalance again")]
    LockLost {
        /// What showed the loss.
        reason: String,
    },
    /// The published map changed under us.
    #[error("the shard map changed while rebalancing (expected version {expected}, found {found}); rerun the rebalance")]
    Conflict {
        /// Version we built on.
        expected: u64,
        /// Version found.
        found: u64,
    },
    /// Keys did not drain in time; they were un-paused and stay pinned to their old shard.
    #[error("keys {keys:?} still have work on their old shards after {waited_ms} ms; they stay pinned there, rerun `rebalance` once they drain (a key halted by a dead letter never drains: retry or purge it)")]
    DrainTimeout {
        /// Keys still busy (first few).
        keys: Vec<String>,
        /// How long we waited.
        waited_ms: u64,
    },
    /// Shards failed during the moves (unreadable, unreachable): the keys
    /// that move from or to them stay where they are; every other key moved.
    #[error("{}", shards_failed_text(*.count, .shards, .keys))]
    ShardsFailed {
        /// The kind of the first shard's failure.
        kind: ErrorKind,
        /// Each failed shard and its error.
        shards: Vec<String>,
        /// How many keys stay.
        count: usize,
        /// The first few of them.
        keys: Vec<String>,
    },
    /// An operation that makes no sense for this map.
    #[error("{0}")]
    Invalid(String),
    /// I/O on the map store's files failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, naming the file.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The map store's own error (a Redis reply, a map file that does not
    /// parse), kept whole with the kind the store gave it.
    #[error("{source}")]
    Store {
        /// What kind of failure it is.
        kind: ErrorKind,
        /// The store's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No shard map is published where the store looks.
    #[error("no shard map is published in {location}; create one with `shardq init`")]
    NoMap {
        /// Where it was looked for.
        location: String,
    },
    /// The stored target map does not parse.
    #[error("the target map in {location} does not parse: {reason}")]
    BadTarget {
        /// Where it is stored.
        location: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The map store did not answer within its bound (a lock held by a
    /// stalled process, an unreachable Redis): retry later.
    #[error("{0}")]
    Unavailable(String),
}

fn shards_failed_text(count: usize, shards: &[String], keys: &[String]) -> String {
    if count == 0 {
        format!(
            "every key moved, but clearing the moved keys' copies or seals on their old shards failed ({shards:?}); once those shards answer, rerun `rebalance` to finish"
        )
    } else {
        format!(
            "{count} keys stay where they are because a shard they move from or to failed ({shards:?}; first keys: {keys:?}); repair or restart those shards and rerun `rebalance`; every other key has moved"
        )
    }
}

impl ReshardError {
    /// The kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ReshardError::Queue(q) => q.kind(),
            ReshardError::Map(_) | ReshardError::Invalid(_) | ReshardError::NoMap { .. } => {
                ErrorKind::BadInput
            }
            ReshardError::BadTarget { .. } => ErrorKind::Corrupt,
            ReshardError::Store { kind, .. } | ReshardError::ShardsFailed { kind, .. } => *kind,
            ReshardError::Busy { .. }
            | ReshardError::LockLost { .. }
            | ReshardError::Conflict { .. }
            | ReshardError::DrainTimeout { .. } => ErrorKind::Conflict,
            ReshardError::Unavailable(_) => ErrorKind::Retryable,
            ReshardError::Io { .. } => ErrorKind::Internal,
        }
    }

    /// Wraps a map store's own error, keeping its kind and source.
    pub fn store<E: std::error::Error + Send + Sync + 'static>(
        kind: ErrorKind,
        source: E,
    ) -> ReshardError {
        ReshardError::Store {
            kind,
            source: Box::new(source),
        }
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> ReshardError {
        ReshardError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Options of [`rebalance`].
#[derive(Debug, Clone)]
pub struct RebalanceOptions {
    /// Keys per move batch (1..=[`BATCH_MAX`]).
    pub batch: usize,
    /// Longest wait for one batch to drain, in ms.
    pub drain_timeout_ms: u64,
    /// Interval between drain checks, in ms.
    pub poll_ms: u64,
    /// Time for the drain waits and the pause figures (a manual clock in
    /// simulations).
    pub clock: Arc<dyn Clock>,
    /// Who runs it, as the deployment's progress record names it (the
    /// dashboard shows it): a command and its process.
    pub runner: String,
}

impl Default for RebalanceOptions {
    fn default() -> Self {
        RebalanceOptions {
            batch: BATCH_DEFAULT,
            drain_timeout_ms: DRAIN_TIMEOUT_MS_DEFAULT,
            poll_ms: DRAIN_POLL_MS_DEFAULT,
            clock: Arc::new(SystemClock),
            runner: format!("pid {}", std::process::id()),
        }
    }
}

/// The deployment setting holding the progress of the running, or last,
/// rebalance (a [`RebalanceProgress`] as JSON): whoever runs it (`shardq
/// rebalance`, a server, the demo), every dashboard of the deployment
/// shows it, and it stays after the run ends until the next one starts.
pub const SETTING_REBALANCE: &str = "rebalance";

/// Least time between two progress writes while keys switch, in ms (a
/// phase change is written at once).
pub const PROGRESS_WRITE_EVERY_MS: u64 = 500;

/// The progress of a rebalance, as stored under [`SETTING_REBALANCE`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct RebalanceProgress {
    /// `pinning`, `moving`, `finished` or `failed`.
    pub phase: String,
    /// Keys with work to move (known after pinning).
    pub keys_to_move: usize,
    /// Keys switched so far.
    pub keys_moved: usize,
    /// Jobs (queued, delayed, dead) copied to new shards with their keys so far.
    pub jobs_moved: u64,
    /// Longest enqueue pause of a batch so far, in ms.
    pub pause_ms_max: f64,
    /// Published map version when it started.
    pub from_version: Option<u64>,
    /// Published map version when it finished.
    pub to_version: Option<u64>,
    /// True when there was nothing to do.
    pub nothing_to_do: bool,
    /// Why it failed, if it did.
    pub last_error: Option<String>,
    /// When it started (ms since the epoch).
    pub started_ms: Option<u64>,
    /// When it ended (ms since the epoch).
    pub finished_ms: Option<u64>,
    /// When this record was written (ms since the epoch): a running
    /// phase not updated for long is a run that may have died.
    #[serde(default)]
    pub updated_ms: Option<u64>,
    /// Who runs it ([`RebalanceOptions::runner`]).
    #[serde(default)]
    pub runner: String,
}

impl RebalanceProgress {
    /// A run that started at `now_ms`.
    pub fn started(now_ms: u64, runner: &str) -> RebalanceProgress {
        RebalanceProgress {
            phase: "pinning".into(),
            started_ms: Some(now_ms),
            updated_ms: Some(now_ms),
            runner: runner.to_string(),
            ..RebalanceProgress::default()
        }
    }

    /// Whether the run is in a running phase.
    pub fn is_running(&self) -> bool {
        matches!(self.phase.as_str(), "pinning" | "moving")
    }

    /// Takes in one event of the run.
    pub fn note(&mut self, ev: &RebalanceEvent) {
        match *ev {
            RebalanceEvent::Pinned { pinned, .. } => {
                self.phase = "moving".into();
                self.keys_to_move = pinned;
            }
            RebalanceEvent::Moving { .. } | RebalanceEvent::Waiting { .. } => {
                self.phase = "moving".into()
            }
            RebalanceEvent::Switched {
                done,
                total,
                jobs,
                pause_ms,
                ..
            } => {
                self.phase = "moving".into();
                self.keys_moved = done;
                self.keys_to_move = total;
                self.jobs_moved += jobs;
                self.pause_ms_max = self.pause_ms_max.max(pause_ms);
            }
            RebalanceEvent::Finished { version } => self.to_version = Some(version),
        }
    }

    /// Takes in the run's end at `now_ms`.
    pub fn ended(&mut self, result: &Result<RebalanceReport, ReshardError>, now_ms: u64) {
        self.finished_ms = Some(now_ms);
        self.updated_ms = Some(now_ms);
        match result {
            Ok(r) => {
                self.phase = "finished".into();
                self.from_version = Some(r.from_version);
                self.to_version = Some(r.to_version);
                self.keys_moved = r.moved.len();
                self.jobs_moved = r.jobs_moved;
                self.keys_to_move = self.keys_to_move.max(r.moved.len());
                self.nothing_to_do = r.nothing_to_do;
                self.pause_ms_max = self.pause_ms_max.max(r.pause_percentile_ms(100.0));
            }
            Err(e) => {
                self.phase = "failed".into();
                self.last_error = Some(e.to_string());
            }
        }
    }
}

/// The deployment's stored rebalance progress, if one was written and
/// parses (a record this build cannot read is reported as none).
pub fn stored_progress(store: &dyn MapStore) -> Result<Option<RebalanceProgress>, ReshardError> {
    Ok(store
        .load_setting(SETTING_REBALANCE)?
        .and_then(|doc| serde_json::from_str(&doc).ok()))
}

/// Writes a run's progress to the map store, at phase changes and at most
/// every [`PROGRESS_WRITE_EVERY_MS`] between them. A write that fails is
/// dropped: progress is for the eyes, and never fails the run it shows.
struct ProgressRecorder<'a> {
    store: &'a dyn MapStore,
    clock: &'a dyn Clock,
    progress: RebalanceProgress,
    written_ms: u64,
    written_phase: String,
    /// Another run's record replaced this one's (this run lost its lock
    /// while stalled, and a new run started): it writes no more.
    superseded: bool,
}

impl ProgressRecorder<'_> {
    fn write(&mut self, now_ms: u64) {
        if self.superseded {
            return;
        }
        if !self.written_phase.is_empty() {
            // Only over its own record: a run that stalled past its lock
            // must not overwrite the next run's.
            if let Ok(Some(cur)) = stored_progress(self.store) {
                if cur.started_ms != self.progress.started_ms || cur.runner != self.progress.runner
                {
                    self.superseded = true;
                    return;
                }
            }
        }
        self.progress.updated_ms = Some(now_ms);
        if let Ok(doc) = serde_json::to_string(&self.progress) {
            let _ = self.store.store_setting(SETTING_REBALANCE, Some(&doc));
        }
        self.written_ms = now_ms;
        self.written_phase.clone_from(&self.progress.phase);
    }

    fn note(&mut self, ev: &RebalanceEvent) {
        self.progress.note(ev);
        let now = self.clock.now_ms();
        let done = self.progress.keys_to_move > 0
            && self.progress.keys_moved >= self.progress.keys_to_move;
        if self.progress.phase != self.written_phase
            || done
            || now.saturating_sub(self.written_ms) >= PROGRESS_WRITE_EVERY_MS
        {
            self.write(now);
        }
    }
}

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

// ---------------------------------------------------------------------------
// Operations: they only record intent (and publish warming shards).
// ---------------------------------------------------------------------------

/// The pending target, or what the published map implies (warming shards
/// become active, draining shards leave).
pub fn current_target(store: &dyn MapStore) -> Result<ShardMap, ReshardError> {
    match store.load_target()? {
        Some(t) => Ok(t),
        None => Ok(implied_target(&store.load()?)),
    }
}

/// The map `map` is heading to when no target was recorded.
pub fn implied_target(map: &ShardMap) -> ShardMap {
    let mut t = map.clone();
    t.shards.retain(|s| s.state != ShardState::Draining);
    for s in &mut t.shards {
        s.state = ShardState::Active;
    }
    t.overrides
        .retain(|_, shard| t.shards.iter().any(|s| &s.name == shard));
    t
}

/// Whether two targets are the same map, their versions aside (a stored
/// target carries version 0): what [`MapStore::clear_target`] compares.
pub fn same_target(a: &ShardMap, b: &ShardMap) -> bool {
    with_version(a, 0) == with_version(b, 0)
}

fn save_target(store: &dyn MapStore, target: &ShardMap) -> Result<(), ReshardError> {
    let mut checked = target.clone();
    // Validation needs an active shard; the version is irrelevant for a target.
    checked.validate()?;
    checked.version = 0;
    store.store_target(&checked)
}

/// Deploys shard `name` as `warming` (visible, receiving nothing) and makes
/// it active in the target. Returns the published version.
pub fn add_shard(
    store: &dyn MapStore,
    name: &str,
    weight: u32,
    url: Option<String>,
) -> Result<u64, ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let cur = store.load()?;
    let mut target = current_target(store)?;
    let mut shard = Shard::new(name);
    shard.weight = weight;
    shard.url = url;
    // An add stopped between recording the target and publishing the
    // warming map left the shard in the target only: the same add, run
    // again, finishes it.
    let half_done = cur.shard(name).is_none()
        && target
            .shard(name)
            .is_some_and(|s| s.weight == shard.weight && s.url == shard.url);
    if cur.shard(name).is_some() || (target.shard(name).is_some() && !half_done) {
        return Err(ReshardError::Invalid(format!(
            "shard {name:?} already exists in the map"
        )));
    }
    let mut next = cur.clone();
    next.version = cur.version + 1;
    next.shards.push(Shard {
        state: ShardState::Warming,
        ..shard.clone()
    });
    next.validate()?;
    if !half_done {
        target.shards.push(shard);
        save_target(store, &target)?;
    }
    store.publish(&next, cur.version)?;
    Ok(next.version)
}

/// Records that shard `name` leaves the map; [`rebalance`] drains it.
pub fn remove_shard(store: &dyn MapStore, name: &str) -> Result<(), ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let mut target = current_target(store)?;
    let before = target.shards.len();
    target.shards.retain(|s| s.name != name);
    if target.shards.len() == before {
        let shards: Vec<&str> = target.shards.iter().map(|s| s.name.as_str()).collect();
        return Err(ReshardError::Invalid(format!(
            "no shard {name:?} in the target map (its shards: {}); a shard whose `add-shard` was stopped before it published the map is not in it: rerun that `add-shard` to finish adding it",
            shards.join(", ")
        )));
    }
    if let Some((key, _)) = target.overrides.iter().find(|(_, s)| *s == name) {
        return Err(ReshardError::Invalid(format!(
            "key {key:?} is pinned to shard {name:?}; unpin it (or pin it elsewhere) before removing the shard"
        )));
    }
    save_target(store, &target)
}

/// Records a new weight for shard `name`; [`rebalance`] moves the keys.
pub fn set_weight(store: &dyn MapStore, name: &str, weight: u32) -> Result<(), ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let mut target = current_target(store)?;
    let shard = target
        .shards
        .iter_mut()
        .find(|s| s.name == name)
        .ok_or_else(|| ReshardError::Invalid(format!("no shard {name:?} in the target map")))?;
    shard.weight = weight;
    save_target(store, &target)
}

/// Records a pin of `key` to `shard`; [`rebalance`] moves it with its backlog.
pub fn pin(store: &dyn MapStore, key: &str, shard: &str) -> Result<(), ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let mut target = current_target(store)?;
    if target.shard(shard).is_none() {
        return Err(ReshardError::Invalid(format!(
            "no shard {shard:?} in the target map"
        )));
    }
    target.overrides.insert(key.to_string(), shard.to_string());
    save_target(store, &target)
}

/// Records the removal of `key`'s pin; [`rebalance`] moves it back. `false`:
/// the key was not pinned, and nothing changed.
pub fn unpin(store: &dyn MapStore, key: &str) -> Result<bool, ReshardError> {
    let _lock = store.try_lock_rebalance()?;
    let mut target = current_target(store)?;
    // Unpinning a key that is not pinned asks for what already holds.
    if target.overrides.remove(key).is_none() {
        return Ok(false);
    }
    save_target(store, &target)?;
    Ok(true)
}

// ---------------------------------------------------------------------------
// The plan and the rebalance.
// ---------------------------------------------------------------------------

/// A key with work whose owner changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedMove {
    /// The key.
    pub key: String,
    /// Shard it is on now.
    pub from: String,
    /// Shard it will be on.
    pub to: String,
    /// Its queued plus in-flight jobs on `from` when scanned.
    pub jobs: u64,
}

/// Ends the fence of a rebalance that died between fencing every shard at
/// the next map version and publishing that version (phase 1): its shards
/// refuse every producer until a map at least that new is published. When
/// no rebalance holds the lock and some shard's fence is ahead of the
/// published map, the published map is published again, unchanged but for
/// a version that reaches every fence, so producers route as before and go
/// in. A rebalance that only stalled (its lock lapsed) then fails its own
/// publish (the version moved on) and publishes nothing of what it
/// planned. Returns whether it published; `Ok(false)` when a rebalance is
/// running (it will publish) or no fence is ahead.
pub fn lift_orphaned_fence<B: QueueBackend + ?Sized>(
    backend: &B,
    store: &dyn MapStore,
) -> Result<bool, ReshardError> {
    let _lock = match store.try_lock_rebalance() {
        Ok(lock) => lock,
        Err(ReshardError::Busy { .. }) => return Ok(false),
        Err(e) => return Err(e),
    };
    let cur = store.load()?;
    // A shard that cannot be read is passed by: the routing does not
    // change, so the version the readable fences ask for is safe to publish.
    let mut ahead = cur.version;
    for shard in &cur.shards {
        if let Ok(fence) = backend.fence(&shard.name) {
            ahead = ahead.max(fence.map_version_min);
        }
    }
    if ahead <= cur.version {
        return Ok(false);
    }
    publish_next(store, &cur, &with_version(&cur, ahead))?;
    Ok(true)
}

/// Every key with work whose owner differs between `cur` and `target`.
pub fn plan_moves<B: QueueBackend + KeyInventory + ?Sized>(
    backend: &B,
    cur: &ShardMap,
    target: &ShardMap,
) -> Result<Vec<PlannedMove>, ReshardError> {
    let to = Router::new(with_version(target, cur.version))?;
    let now = Router::new(cur.clone())?;
    let mut moves = Vec::new();
    for shard in &cur.shards {
        let with_work: Vec<(String, KeyCounts)> = backend
            .keys_with_work(&shard.name)?
            .into_iter()
            .filter(|(_, c)| has_work(c) > 0)
            .collect();
        // A key with live dedup records and no jobs moves too (with
        // drain-then-switch, which copies its records): its next enqueue
        // must find them where it lands.
        let known: std::collections::BTreeSet<&str> =
            with_work.iter().map(|(k, _)| k.as_str()).collect();
        let dedup_only: Vec<(String, KeyCounts)> = backend
            .dedup_keys(&shard.name)?
            .into_iter()
            // An old shard keeps the copies of a key that moved away.
            .filter(|k| !known.contains(k.as_str()) && now.route(k) == shard.name)
            .map(|k| (k, KeyCounts::default()))
            .collect();
        for (key, counts) in with_work.into_iter().chain(dedup_only) {
            // The key moves from where its work is to where the target routes it.
            let to_shard = to.route(&key);
            if to_shard != shard.name {
                moves.push(PlannedMove {
                    key,
                    from: shard.name.clone(),
                    to: to_shard.to_string(),
                    jobs: has_work(&counts),
                });
            }
        }
    }
    moves.sort_by(|x, y| x.key.cmp(&y.key));
    Ok(moves)
}

/// Jobs that tie a key to its shard: queued, delayed, in flight, and dead
/// letters (a dead job retried later runs on the shard that holds it, so a
/// key with one must not move until it is retried or purged).
fn has_work(c: &KeyCounts) -> u64 {
    c.depth + c.in_flight + c.dead
}

fn with_version(map: &ShardMap, version: u64) -> ShardMap {
    let mut m = map.clone();
    m.version = version;
    m
}

/// The intermediate map: the target's shards, removed shards as draining,
/// and `pins` (key -> current shard) on top of the target's overrides.
fn intermediate(cur: &ShardMap, target: &ShardMap, pins: &BTreeMap<String, String>) -> ShardMap {
    let mut next = target.clone();
    next.version = cur.version + 1;
    for s in &cur.shards {
        if next.shard(&s.name).is_none() {
            next.shards.push(Shard {
                state: ShardState::Draining,
                ..s.clone()
            });
        }
    }
    for (k, shard) in pins {
        next.overrides.insert(k.clone(), shard.clone());
    }
    next
}

/// True when `cur` already has the target's routing shape (phase 1 done).
fn is_intermediate(cur: &ShardMap, target: &ShardMap) -> bool {
    let same_shape =
        cur.algorithm == target.algorithm && cur.hash == target.hash && cur.vnodes == target.vnodes;
    let targets_present = target.shards.iter().all(|t| {
        cur.shard(&t.name)
            .is_some_and(|c| c.weight == t.weight && c.state == t.state && c.slots == t.slots)
    });
    let extras_draining = cur
        .shards
        .iter()
        .all(|c| target.shard(&c.name).is_some() || c.state == ShardState::Draining);
    // A pin the published map does not hold yet changes that key's route:
    // phase 1 must pin it where its work is first (a pin already published,
    // to any shard, is either in place or a pending switch of phase 2).
    let pins_present = target
        .overrides
        .keys()
        .all(|k| cur.overrides.contains_key(k));
    same_shape && targets_present && extras_draining && pins_present
}

/// Keys pinned in `cur` away from where the target routes them.
fn pending_switches(cur: &ShardMap, target_router: &Router) -> Vec<(String, String, String)> {
    cur.overrides
        .iter()
        .filter_map(|(k, shard)| {
            let to = target_router.route(k);
            (to != shard).then(|| (k.clone(), shard.clone(), to.to_string()))
        })
        .collect()
}

fn publish_next(store: &dyn MapStore, cur: &ShardMap, next: &ShardMap) -> Result<(), ReshardError> {
    next.validate()?;
    store.publish(next, cur.version)
}

/// Walks the published map to the target, moving keys with drain-then-switch.
/// Resumable: rerun after any failure or kill.
pub fn rebalance<B>(
    backend: &B,
    store: &dyn MapStore,
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
) -> Result<RebalanceReport, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    if options.batch == 0 || options.batch > BATCH_MAX {
        return Err(ReshardError::Invalid(format!(
            "batch {} is out of range: 1..={BATCH_MAX}",
            options.batch
        )));
    }
    let clock = &*options.clock;
    let _lock = store.try_lock_rebalance()?;
    // Under the lock, so a second run refused as busy never overwrites
    // the first one's record.
    let now = clock.now_ms();
    let mut rec = ProgressRecorder {
        store,
        clock,
        progress: RebalanceProgress::started(now, &options.runner),
        written_ms: now,
        written_phase: String::new(),
        superseded: false,
    };
    if let Ok(cur) = store.load() {
        rec.progress.from_version = Some(cur.version);
    }
    rec.write(now);
    let result = rebalance_locked(backend, store, options, &mut |ev| {
        rec.note(&ev);
        on_event(ev);
    });
    rec.progress.ended(&result, clock.now_ms());
    rec.write(clock.now_ms());
    result
}

/// [`rebalance`], under the rebalance lock.
fn rebalance_locked<B>(
    backend: &B,
    store: &dyn MapStore,
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
) -> Result<RebalanceReport, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    let clock = &*options.clock;
    let started_ms = clock.now_ms();
    // Taken first, while the lock is surely ours (the store checks): a run
    // stalled before this point gets no epoch once its lock lapsed.
    let epoch = store.rebalance_epoch()?;
    let mut cur = store.load()?;
    let mut report = RebalanceReport {
        from_version: cur.version,
        ..RebalanceReport::default()
    };
    let target = current_target(store)?;
    let target_router = Router::new(with_version(&target, cur.version))?;

    // A rebalance that stalled past its lock's lease (stopped, paused)
    // may wake and write again: every shard of either map refuses its
    // writes from here on. A shard that does not answer is passed by (its
    // moves fail below; this run's first write there raises it as well).
    if epoch > 0 {
        let names: BTreeSet<&str> = cur
            .shards
            .iter()
            .chain(&target.shards)
            .map(|s| s.name.as_str())
            .collect();
        for name in names {
            if let Err(e @ QueueError::Superseded { .. }) = backend.enter_rebalance(name, epoch) {
                return Err(e.into());
            }
        }
    }

    // Phase 1: pin the keys with work, fence, publish the intermediate map.
    if !is_intermediate(&cur, &target) {
        let next_version = cur.version + 1;
        let first = plan_moves(backend, &cur, &target)?;
        for shard in &cur.shards {
            let mut fence = backend.fence(&shard.name)?;
            fence.map_version_min = fence.map_version_min.max(next_version);
            backend.set_fence(&shard.name, &fence)?;
        }
        // Enqueues that landed between the scan and the fence.
        let second = plan_moves(backend, &cur, &target)?;
        let mut pins: BTreeMap<String, String> = first
            .into_iter()
            .chain(second)
            .map(|m| (m.key, m.from))
            .collect();
        // A transfer a killed run left sealed has work on both sides (the
        // new shard may run copies already): the key stays pinned where the
        // published map sends its producers, never where its copies are
        // while its old shard still holds the rest, or its new jobs would
        // overtake them. Phase 2 finishes the transfer first.
        let now = Router::new(cur.clone())?;
        for shard in &cur.shards {
            for (key, to) in backend.fence(&shard.name)?.sealed_keys {
                if let Some(pin) = pins.get_mut(&key) {
                    *pin = if now.route(&key) == to.as_str() {
                        to
                    } else {
                        shard.name.clone()
                    };
                }
            }
        }
        // Keys without work follow the target at once: their next run, on
        // any shard, must get a larger fence than every run so far.
        let mut high = 0u64;
        for shard in &cur.shards {
            high = high.max(backend.shard_stats(&shard.name)?.fence_high);
        }
        for shard in &target.shards {
            let mut fence = backend.fence(&shard.name)?;
            if fence.run_fence_min <= high {
                fence.run_fence_min = high.saturating_add(1);
                backend.set_fence(&shard.name, &fence)?;
            }
        }
        let next = intermediate(&cur, &target, &pins);
        publish_next(store, &cur, &next)?;
        cur = next;
    }
    // A run killed between a switch and its un-pause leaves keys paused and
    // old shards unfenced: fence every shard at the published version (stale
    // producers reload) and lift the pauses; the batches re-pause what they
    // move. Not the pauses of a transfer still under way: a key frozen on
    // its old shard stays frozen (its new shard holds its backlog and takes
    // its enqueues), and a key paused on its new shard by a killed forced
    // round stays paused there until its batch has copied the rest, or a
    // producer sent on there would overtake the jobs not copied yet.
    // A shard whose store fails here (unreachable, damaged, lost) is left
    // for the moves, which set it aside and move the other keys; with one
    // unread, no pause is lifted anywhere (its seals are unknown).
    let store_failure = |e: QueueError| match e.kind() {
        ErrorKind::Retryable | ErrorKind::Corrupt | ErrorKind::Lost => Ok(()),
        _ => Err(ReshardError::from(e)),
    };
    let mut fences = Vec::with_capacity(cur.shards.len());
    let mut unread = false;
    for shard in &cur.shards {
        match backend.fence(&shard.name) {
            Ok(f) => fences.push((shard.name.as_str(), f)),
            Err(e) => {
                store_failure(e)?;
                unread = true;
            }
        }
    }
    let moving: BTreeMap<String, String> = fences
        .iter()
        .flat_map(|(_, f)| f.sealed_keys.iter().map(|(k, to)| (k.clone(), to.clone())))
        .collect();
    for (shard, mut fence) in fences {
        let before = fence.paused_keys.len();
        fence.paused_keys.retain(|key| {
            unread
                || fence.sealed_keys.contains_key(key)
                || moving.get(key).is_some_and(|to| to == shard)
        });
        if fence.map_version_min < cur.version || fence.paused_keys.len() != before {
            fence.map_version_min = fence.map_version_min.max(cur.version);
            if let Err(e) = backend.set_fence(shard, &fence) {
                store_failure(e)?;
            }
        }
    }
    let switches = pending_switches(&cur, &target_router);
    on_event(RebalanceEvent::Pinned {
        pinned: switches.len(),
        version: cur.version,
    });
    // Phase 2, moving each key's backlog with it: no drain, no holdback.
    cur = move_with_backlogs(
        backend,
        store,
        cur,
        &target,
        switches,
        options,
        on_event,
        &mut report,
    )?;
    finish(
        backend, store, cur, &target, report, started_ms, clock, on_event,
    )
}

/// Phase 3: publishes the target itself and clears it.
#[allow(clippy::too_many_arguments)]
fn finish<B>(
    backend: &B,
    store: &dyn MapStore,
    mut cur: ShardMap,
    target: &ShardMap,
    mut report: RebalanceReport,
    started_ms: u64,
    clock: &dyn Clock,
    on_event: &mut dyn FnMut(RebalanceEvent),
) -> Result<RebalanceReport, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    let mut fin = target.clone();
    fin.version = cur.version + 1;
    // The target's overrides are the operator's pins (the temporary ones
    // live only in the published map); keep every one of them.
    let fin_router = Router::new(fin.clone())?;
    let leaving: Vec<&Shard> = cur
        .shards
        .iter()
        .filter(|s| fin.shard(&s.name).is_none())
        .collect();
    for s in &leaving {
        let mut fence = backend.fence(&s.name)?;
        fence.map_version_min = fence.map_version_min.max(fin.version);
        backend.set_fence(&s.name, &fence)?;
        let left = backend.keys_with_work(&s.name)?;
        if let Some((key, counts)) = left.into_iter().find(|(_, c)| has_work(c) > 0) {
            return Err(ReshardError::Invalid(format!(
                "shard {:?} still holds work for key {key:?} ({} queued, {} in flight, {} dead) after its keys moved; rerun rebalance",
                s.name, counts.depth, counts.in_flight, counts.dead
            )));
        }
    }
    // Backstop: the final map must route every key with work to the shard
    // that holds it, or publishing it would split that key across shards.
    for s in cur.shards.iter().filter(|s| fin.shard(&s.name).is_some()) {
        for (key, counts) in backend.keys_with_work(&s.name)? {
            if has_work(&counts) > 0 && fin_router.route(&key) != s.name {
                return Err(ReshardError::Invalid(format!(
                    "refusing to publish map version {}: key {key:?} has work on shard {:?} but would route to {:?}; rerun rebalance",
                    fin.version,
                    s.name,
                    fin_router.route(&key)
                )));
            }
        }
    }
    if fin.shards != cur.shards || fin.overrides != cur.overrides {
        publish_next(store, &cur, &fin)?;
        cur = fin;
    } else {
        report.nothing_to_do = report.moved.is_empty() && report.from_version == cur.version;
    }
    if !store.clear_target(target)? {
        return Err(ReshardError::LockLost {
            reason: format!(
                "another change recorded a new target while it ran; map version {} is published and the new target stays pending",
                cur.version
            ),
        });
    }
    on_event(RebalanceEvent::Finished {
        version: cur.version,
    });
    report.to_version = cur.version;
    report.elapsed_ms = clock.now_ms().saturating_sub(started_ms) as f64;
    Ok(report)
}

/// Phase 2 on a backend that moves backlogs: each batch of keys is sealed
/// on its old shards, waits for its runs in flight there, has its backlog
/// copied in rounds while its producers keep writing, then, under a pause
/// of one last short round, switches; the copies left behind are deleted.
/// Transfers a killed run left sealed are finished first, to the shard
/// their copies went to. Returns the published map.
#[allow(clippy::too_many_arguments)]
fn move_with_backlogs<B>(
    backend: &B,
    store: &dyn MapStore,
    mut cur: ShardMap,
    target: &ShardMap,
    switches: Vec<(String, String, String)>,
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
    report: &mut RebalanceReport,
) -> Result<ShardMap, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    // Shards that failed here (unreadable, unreachable), with their first
    // error: the keys that move from or to one stay where they are, and
    // the other keys move on.
    let mut failed = FailedShards::default();
    // Transfers a killed rebalance left sealed go on to where their copies
    // went, whatever the target says now (the next rebalance moves them on).
    let mut todo: BTreeMap<String, (String, String)> = switches
        .into_iter()
        .map(|(k, from, to)| (k, (from, to)))
        .collect();
    let router = Router::new(cur.clone())?;
    for shard in &cur.shards {
        let fence = match backend.fence(&shard.name) {
            Ok(f) => f,
            Err(e) => {
                failed.note_or_raise(backend, &[shard.name.as_str()], e.into())?;
                continue;
            }
        };
        for (key, to) in &fence.sealed_keys {
            if router.route(key) == to.as_str() {
                // Switched already: what a producer still routing with the
                // old map stored here before the fence is copied, then the
                // copies here are deleted.
                let finished = (|| -> Result<(), ReshardError> {
                    let mut ids = BTreeMap::new();
                    let mut touched = BTreeSet::new();
                    copy_backlog(
                        backend,
                        key,
                        &shard.name,
                        to,
                        &mut ids,
                        &mut None,
                        &mut touched,
                    )?;
                    // The copies durable before their sources go.
                    backend.sync_imports(to)?;
                    backend.purge_key(&shard.name, key)?;
                    let mut f = backend.fence(&shard.name)?;
                    // The floor is raised in the same write: unsealed
                    // under an older one, the key would take a stale
                    // producer's job here, where it no longer runs.
                    f.map_version_min = f.map_version_min.max(cur.version);
                    f.unseal(key);
                    backend.set_fence(&shard.name, &f)?;
                    Ok(())
                })();
                if let Err(e) = finished {
                    // Left sealed: a rerun finishes it.
                    failed.note_or_raise(backend, &[shard.name.as_str(), to.as_str()], e)?;
                    failed.keys.push(key.clone());
                }
                todo.remove(key);
            } else {
                todo.insert(key.clone(), (shard.name.clone(), to.clone()));
            }
        }
    }
    let all: Vec<(String, String, String)> = todo
        .into_iter()
        .map(|(k, (from, to))| (k, from, to))
        .collect();
    let total = all.len();
    let mut done = 0usize;
    let mut stuck: Vec<String> = Vec::new();
    let mut waited_most = 0u64;
    let clock = &*options.clock;
    // Keys not sealed yet, in order; and keys sealed whose runs on their
    // old shards had not ended, with when each was sealed. A key waits
    // only for its own runs: the next batch takes the keys whose runs
    // ended and fills up with new ones, so one long run holds up its own
    // key and no other.
    let mut pending: std::collections::VecDeque<Switch> = all.into_iter().collect();
    let mut waiting: Vec<(Switch, u64)> = Vec::new();
    let mut said_ms = clock.now_ms();
    loop {
        // A run whose lock lapsed (a renewal found it gone) stops here,
        // between batches, with nothing of the next batch sealed.
        store.check_lock()?;
        let now = clock.now_ms();
        let mut batch: Vec<Switch> = Vec::new();
        let mut sealed_at: BTreeMap<String, u64> = BTreeMap::new();
        if !waiting.is_empty() {
            let mut still = Vec::with_capacity(waiting.len());
            let mut late = Vec::new();
            for (sw, since) in std::mem::take(&mut waiting) {
                if failed.involves(&sw) {
                    failed.keys.push(sw.0);
                    continue;
                }
                match backend.key_counts(&sw.1, &sw.0) {
                    Ok(c) if c.in_flight == 0 && batch.len() < options.batch => {
                        sealed_at.insert(sw.0.clone(), since);
                        batch.push(sw);
                    }
                    Ok(c)
                        if c.in_flight > 0
                            && now.saturating_sub(since) >= options.drain_timeout_ms =>
                    {
                        waited_most = waited_most.max(now.saturating_sub(since));
                        late.push(sw);
                    }
                    Ok(_) => still.push((sw, since)),
                    Err(e) => {
                        failed.note_or_raise(backend, &[sw.1.as_str()], e.into())?;
                        failed.keys.push(sw.0);
                    }
                }
            }
            waiting = still;
            stuck.extend(leave_late(backend, &late)?);
        }
        while batch.len() < options.batch {
            let Some(sw) = pending.pop_front() else {
                break;
            };
            if failed.involves(&sw) {
                failed.keys.push(sw.0);
            } else {
                batch.push(sw);
            }
        }
        if batch.is_empty() {
            if waiting.is_empty() && pending.is_empty() {
                break;
            }
            let oldest = waiting.iter().map(|(_, at)| *at).min().unwrap_or(now);
            say_waiting(clock, oldest, &mut said_ms, waiting.len(), on_event);
            clock.sleep_ms(options.poll_ms.max(1));
            continue;
        }
        let batch_started = clock.now_ms();
        // Per key: the jobs copied, and whether an import of it was sent
        // (its new shard may then hold copies, whatever it answered).
        let mut copied: BTreeMap<String, u64> = BTreeMap::new();
        let mut touched: BTreeSet<String> = BTreeSet::new();
        // (key, source id) -> id on the new shard, of every copy this run
        // made: kept across a retry of the batch, whose dedup records must
        // still name the copies made before it.
        let mut ids: BTreeMap<(String, JobId), JobId> = BTreeMap::new();
        let moved = loop {
            if batch.is_empty() {
                break None;
            }
            let attempt = move_batch(
                backend,
                store,
                &cur,
                target,
                &batch,
                options,
                on_event,
                &mut copied,
                &mut touched,
                &mut ids,
            );
            match attempt {
                Ok(moved) => break Some(moved),
                Err(e) => {
                    // Pauses stay as they are: a frozen key's producers go
                    // to its new shard (no wait), and a key paused on its
                    // new shard mid forced round stays so until a rerun has
                    // copied the rest, or its order would break. The keys
                    // stay sealed.
                    let shards: BTreeSet<&str> = batch
                        .iter()
                        .flat_map(|(_, from, to)| [from.as_str(), to.as_str()])
                        .collect();
                    let shards: Vec<&str> = shards.into_iter().collect();
                    failed.note_or_raise(backend, &shards, e)?;
                    let (drop, keep): (Vec<_>, Vec<_>) =
                        batch.into_iter().partition(|sw| failed.involves(sw));
                    // The keys that stay where they are lose their seal too
                    // when no copy of them can exist: they run there again.
                    let clean: Vec<_> = drop
                        .iter()
                        .filter(|sw| {
                            !touched.contains(&sw.0)
                                && !may_hold_copies(backend, &sw.0, &sw.1, &sw.2)
                        })
                        .cloned()
                        .collect();
                    let _ = set_sealed_each(backend, &clean, false);
                    failed.keys.extend(drop.into_iter().map(|sw| sw.0));
                    batch = keep;
                }
            }
        };
        let Some(moved) = moved else {
            continue;
        };
        // Keys with runs in flight stay sealed and wait, each on its own.
        let sealed_now = clock.now_ms();
        waiting.extend(moved.busy.into_iter().map(|sw| {
            let since = sealed_at.get(&sw.0).copied().unwrap_or(sealed_now);
            (sw, since)
        }));
        let Some((next, pauses, batch)) = moved.switched else {
            continue;
        };
        // Published: the keys follow the new map. Their old shards' fences
        // now refuse producers still routing with the old one (they reload
        // and route to the new shards); the keys stay frozen there until
        // their copies are gone.
        let version = next.version;
        cur = next;
        let olds: Vec<String> = batch
            .iter()
            .map(|sw| sw.1.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let olds: Vec<&str> = olds.iter().map(String::as_str).collect();
        if let Err(e) = each_old_shard(&batch, |part| {
            update_old_fences(backend, part, &mut |fence, _, _| {
                fence.map_version_min = fence.map_version_min.max(version);
            })
        }) {
            failed.note_or_raise(backend, &olds, e)?;
        }
        let pause_ms = pauses.values().copied().max().unwrap_or(0) as f64;
        // 6. Delete the copies left on the old shards, then unseal. The
        //    switch is published: a key whose old shard fails here keeps its
        //    copies there sealed (and frozen), and a rerun deletes them
        //    (above). Not on an old shard whose fence could not be raised:
        //    unsealed there, the key would take a stale producer's job on
        //    the shard it no longer runs on.
        let mut cleaned = Vec::with_capacity(batch.len());
        // The copies are made durable before any source is deleted, once
        // per new shard for the whole batch: a new shard that fails that
        // keeps its keys' sources where they are, sealed, for the rerun.
        let mut synced: BTreeMap<&str, bool> = BTreeMap::new();
        for sw in &batch {
            if !synced.contains_key(sw.2.as_str()) {
                let ok = match backend.sync_imports(&sw.2) {
                    Ok(()) => true,
                    Err(e) => {
                        failed.note_or_raise(backend, &[sw.2.as_str()], e.into())?;
                        false
                    }
                };
                synced.insert(&sw.2, ok);
            }
        }
        for sw in &batch {
            if failed.shards.contains_key(&sw.1) || !synced[sw.2.as_str()] {
                failed.keys.push(sw.0.clone());
                continue;
            }
            match backend.purge_key(&sw.1, &sw.0) {
                Ok(_) => cleaned.push(sw.clone()),
                Err(e) => failed.note_or_raise(backend, &[sw.1.as_str()], e.into())?,
            }
        }
        if let Err(e) = each_old_shard(&cleaned, |part| {
            update_old_fences(backend, part, &mut |fence, key, _| {
                // Raised again in the same write, so no unseal is ever seen
                // under the old floor.
                fence.map_version_min = fence.map_version_min.max(version);
                fence.unseal(key);
            })
        }) {
            failed.note_or_raise(backend, &olds, e)?;
        }
        let mut jobs = 0u64;
        for (key, from, to) in &batch {
            let n = copied.get(key).copied().unwrap_or(0);
            jobs += n;
            report.moved.push(MovedKey {
                key: key.clone(),
                from: from.clone(),
                to: to.clone(),
                pause_ms: pauses.get(key).copied().unwrap_or(0) as f64,
                jobs_moved: n,
                run_wait_ms: sealed_at
                    .get(key)
                    .map_or(0, |at| batch_started.saturating_sub(*at))
                    as f64,
            });
        }
        report.jobs_moved += jobs;
        done += batch.len();
        on_event(RebalanceEvent::Switched {
            done,
            total,
            keys: batch.len(),
            pause_ms,
            jobs,
        });
    }
    if let Some(e) = failed.into_error() {
        return Err(e);
    }
    if !stuck.is_empty() {
        return Err(ReshardError::DrainTimeout {
            keys: stuck.into_iter().take(8).collect(),
            waited_ms: waited_most,
        });
    }
    Ok(cur)
}

/// Shards a rebalance found failing, and the keys left where they are
/// because they move from or to one.
#[derive(Default)]
struct FailedShards {
    shards: BTreeMap<String, ReshardError>,
    keys: Vec<String>,
}

impl FailedShards {
    fn involves(&self, sw: &(String, String, String)) -> bool {
        self.shards.contains_key(&sw.1) || self.shards.contains_key(&sw.2)
    }

    /// After `e`: when it is a store's failure (unreachable, damaged,
    /// lost), each of `shards` is read once to learn which fail; those are
    /// noted and `Ok` comes back. Any other error, or one no shard of
    /// `shards` explains, is returned: the rebalance stops as before.
    fn note_or_raise<B: QueueBackend + ?Sized>(
        &mut self,
        backend: &B,
        shards: &[&str],
        e: ReshardError,
    ) -> Result<(), ReshardError> {
        if !matches!(
            e.kind(),
            ErrorKind::Retryable | ErrorKind::Corrupt | ErrorKind::Lost
        ) {
            return Err(e);
        }
        let mut found = false;
        for &shard in shards {
            if self.shards.contains_key(shard) {
                found = true;
                continue;
            }
            if let Err(probe) = backend.shard_stats(shard) {
                self.shards.insert(shard.to_string(), probe.into());
                found = true;
            }
        }
        if found {
            Ok(())
        } else {
            Err(e)
        }
    }

    fn into_error(self) -> Option<ReshardError> {
        if self.shards.is_empty() {
            return None;
        }
        let kind = self
            .shards
            .values()
            .next()
            .map_or(ErrorKind::Retryable, ReshardError::kind);
        Some(ReshardError::ShardsFailed {
            kind,
            shards: self
                .shards
                .into_iter()
                .map(|(name, e)| format!("{name}: {e}"))
                .collect(),
            count: self.keys.len(),
            keys: self.keys.into_iter().take(8).collect(),
        })
    }
}

/// Whether `to` may hold copies of `key` from `from` (a killed run got that
/// far): true unless both shards answer that it holds none of the jobs
/// still on `from`.
fn may_hold_copies<B: QueueBackend + ?Sized>(backend: &B, key: &str, from: &str, to: &str) -> bool {
    let check = || -> Result<bool, QueueError> {
        Ok(match backend.imported_up_to(to, from, key)? {
            None => false,
            Some(up_to) => backend
                .export_jobs(from, key, None, 1)?
                .first()
                .is_none_or(|j| j.id <= up_to),
        })
    };
    check().unwrap_or(true)
}

/// `cur` at the next version with `batch`'s keys following `target`: its
/// pin where it has one, the computed owner otherwise.
fn switched_map(cur: &ShardMap, target: &ShardMap, batch: &[Switch]) -> ShardMap {
    let mut next = cur.clone();
    next.version = cur.version + 1;
    for (key, _, _) in batch {
        match target.overrides.get(key) {
            Some(shard) => next.overrides.insert(key.clone(), shard.clone()),
            None => next.overrides.remove(key),
        };
    }
    next
}

/// A key's move: the key, its old shard and its new one.
type Switch = (String, String, String);

/// What [`move_batch`] did with a batch.
struct BatchMoved {
    /// Keys with a run in flight on their old shard: left sealed, for the
    /// caller to move once their runs end.
    busy: Vec<Switch>,
    /// The published map, each forced key's producer pause (keys frozen
    /// without one are not listed), and the keys switched.
    switched: Option<(ShardMap, BTreeMap<String, u64>, Vec<Switch>)>,
}

/// Steps 1 to 5 of a batch: seal, wait for runs, raise floors, copy rounds,
/// the last round under a pause and the switch. Every step can be run again
/// after an error (a rerun does): sealing a sealed key changes nothing, the
/// copies skip what the new shard holds, and nothing is published until the
/// last round is complete. An error leaves the batch sealed and paused; the
/// caller lifts what it must. After the publish the caller lifts the pause.
#[allow(clippy::too_many_arguments)]
fn move_batch<B>(
    backend: &B,
    store: &dyn MapStore,
    cur: &ShardMap,
    target: &ShardMap,
    batch: &[(String, String, String)],
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
    copied: &mut BTreeMap<String, u64>,
    touched: &mut BTreeSet<String>,
    ids: &mut BTreeMap<(String, JobId), JobId>,
) -> Result<BatchMoved, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    let clock = &*options.clock;
    // 1. Seal: no run of these keys starts on their old shards from now.
    set_sealed(backend, batch, true)?;
    on_event(RebalanceEvent::Moving { keys: batch.len() });
    // 2. A key with a run in flight on its old shard goes back to the
    //    caller, sealed, to wait for it (bounded there: a stopped worker's
    //    run ends when its job lease lapses); the others go on at once.
    let mut busy = Vec::new();
    let mut idle = Vec::with_capacity(batch.len());
    for sw in batch {
        if backend.key_counts(&sw.1, &sw.0)?.in_flight > 0 {
            busy.push(sw.clone());
        } else {
            idle.push(sw.clone());
        }
    }
    let mut out = BatchMoved {
        busy,
        switched: None,
    };
    if idle.is_empty() {
        return Ok(out);
    }
    let batch = &idle[..];
    // 3. The new shards' next runs of these keys get larger fences than
    //    every run on the old ones (which are over, and sealed).
    raise_fence_floors(backend, batch)?;
    // 4. Copy rounds while producers still write to the old shards.
    let mut cursors: BTreeMap<String, Option<Option<JobId>>> = BTreeMap::new();
    for (key, from, to) in batch {
        let cursor = cursors.entry(key.clone()).or_default();
        for _ in 0..TRANSFER_ROUNDS_MAX {
            let n = copy_backlog(backend, key, from, to, ids, cursor, touched)?;
            *copied.entry(key.clone()).or_default() += n;
            if n < TRANSFER_CHUNK_JOBS as u64 {
                break;
            }
        }
    }
    // 5. Freeze each key on its old shard once its new shard holds all of
    //    it: a last round copies what arrived since the rounds (and the
    //    key's dedup records), then one atomic step on the old shard checks
    //    that nothing arrived since and freezes the key there, so its next
    //    enqueues go to the new shard at once ([`QueueError::Moved`]). No
    //    producer waits. A key that got jobs between every last round and
    //    its freeze (a hot one) is paused on its new shard instead, frozen
    //    unconditionally, copied once more and un-paused: its producers
    //    wait for that one round only.
    let mut left: Vec<Switch> = batch.to_vec();
    let mut pause_ms: BTreeMap<String, u64> = BTreeMap::new();
    for attempt in 0..=FREEZE_ATTEMPTS_MAX {
        if left.is_empty() {
            break;
        }
        let forced = attempt == FREEZE_ATTEMPTS_MAX;
        let pause_started_ms = clock.now_ms();
        if forced {
            set_paused_new(backend, &left, true)?;
            update_old_fences(backend, &left, &mut |fence, key, _| {
                fence.paused_keys.insert(key.to_string());
            })?;
        }
        let fresh = last_round(backend, &left, &mut cursors, ids, copied, touched)?;
        // Dedup records come into being with their jobs: a key that got no
        // job since the last copy of its records has no new one.
        let dedup_keys: Vec<Switch> = left
            .iter()
            .filter(|sw| attempt == 0 || fresh.contains(&sw.0))
            .cloned()
            .collect();
        copy_dedup_many(backend, &dedup_keys, ids, &cursors)?;
        // The copies durable before the freeze (or a forced key's unpause)
        // sends producers to the new shard: after a power loss there, new
        // jobs on it must never come before copies it lost.
        let news: BTreeSet<&str> = left.iter().map(|sw| sw.2.as_str()).collect();
        for to in news {
            backend.sync_imports(to)?;
        }
        if forced {
            set_paused_new(backend, &left, false)?;
            let waited = clock.now_ms().saturating_sub(pause_started_ms);
            for sw in &left {
                pause_ms.insert(sw.0.clone(), waited);
            }
            break;
        }
        let mut by_old: BTreeMap<&str, Vec<(String, Option<JobId>)>> = BTreeMap::new();
        for (key, from, _) in &left {
            let after = cursors.get(key).copied().flatten().flatten();
            by_old
                .entry(from.as_str())
                .or_default()
                .push((key.clone(), after));
        }
        let mut frozen: BTreeSet<String> = BTreeSet::new();
        for (from, items) in by_old {
            frozen.extend(backend.freeze_caught_up(from, &items)?);
        }
        left.retain(|sw| !frozen.contains(&sw.0));
    }
    // A pause on a new shard that a killed forced round left goes: every
    // key of the batch is frozen on its old shard and copied in full now.
    lift_new_pauses(backend, batch)?;
    let mut next = switched_map(cur, target, batch);
    // A key pinned to where its backlog went, if the target differs
    // (a transfer a killed run left): it stays there for now.
    let next_router = Router::new(next.clone())?;
    for (key, _, to) in batch {
        if next_router.route(key) != to.as_str() {
            next.overrides.insert(key.clone(), to.clone());
        }
    }
    publish_next(store, cur, &next)?;
    out.switched = Some((next, pause_ms, batch.to_vec()));
    Ok(out)
}

/// A key and jobs of it, as one import takes them.
type KeyJobs = (String, Vec<MovedJob>);

/// A key's cursor on its old shard as a move keeps it: `None` until read,
/// then the largest id its new shard holds a copy of (`None` inside: none).
type Cursors = BTreeMap<String, Option<Option<JobId>>>;

/// One copy of what arrived since the cursors, for all of `batch`: one
/// export per old shard and one import per (old, new) pair, as few calls as
/// the backend can. Moves the cursors on; returns the keys that had jobs.
fn last_round<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    cursors: &mut Cursors,
    ids: &mut BTreeMap<(String, JobId), JobId>,
    copied: &mut BTreeMap<String, u64>,
    touched: &mut BTreeSet<String>,
) -> Result<BTreeSet<String>, ReshardError> {
    let mut groups: BTreeMap<(&str, &str), Vec<KeyJobs>> = BTreeMap::new();
    let mut reads: BTreeMap<&str, Vec<(String, Option<JobId>)>> = BTreeMap::new();
    let mut dests: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, from, to) in batch {
        let after = match cursors.get(key).copied().flatten() {
            Some(after) => after,
            None => backend.imported_up_to(to, from, key)?,
        };
        cursors.insert(key.clone(), Some(after));
        reads
            .entry(from.as_str())
            .or_default()
            .push((key.clone(), after));
        dests.insert(key.as_str(), to.as_str());
    }
    let mut fresh = BTreeSet::new();
    for (&from, items) in &reads {
        for (key, jobs) in backend.export_many(from, items)? {
            let Some(&to) = dests.get(key.as_str()) else {
                continue;
            };
            if let Some(last) = jobs.last() {
                cursors.insert(key.clone(), Some(Some(last.id)));
                fresh.insert(key.clone());
                groups.entry((from, to)).or_default().push((key, jobs));
            }
        }
    }
    for ((from, to), items) in groups {
        touched.extend(items.iter().map(|(k, _)| k.clone()));
        for (key, src, new) in backend.import_many(to, from, &items)? {
            ids.insert((key.clone(), src), new);
            *copied.entry(key).or_default() += 1;
        }
    }
    Ok(fresh)
}

/// Copies the live dedup records of `batch`'s keys from their old shards to
/// their new ones (one export per old shard); a record of a job this run
/// copied answers with the copy's id.
fn copy_dedup_many<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    ids: &BTreeMap<(String, JobId), JobId>,
    cursors: &Cursors,
) -> Result<(), ReshardError> {
    let mut keys_of: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut dests: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, from, to) in batch {
        keys_of.entry(from.as_str()).or_default().push(key.as_str());
        dests.insert(key.as_str(), to.as_str());
    }
    let mut records_to: BTreeMap<&str, Vec<DedupRecord>> = BTreeMap::new();
    for (from, keys) in keys_of {
        for mut r in backend.dedup_export_many(from, &keys)? {
            let Some(&to) = dests.get(r.key.as_str()) else {
                continue;
            };
            if r.shard == from {
                if let Some(id) = ids.get(&(r.key.clone(), r.job)) {
                    r.shard = to.to_string();
                    r.job = *id;
                } else if cursors
                    .get(r.key.as_str())
                    .copied()
                    .flatten()
                    .flatten()
                    .is_none_or(|c| r.job > c)
                    && backend.job(from, r.job)?.is_some()
                {
                    // Its job came after the last copy and is still here:
                    // the next round copies it, and the record with it (an
                    // import keeps the first record it gets, so one sent
                    // now would name the old shard's id for good).
                    continue;
                }
            }
            records_to.entry(to).or_default().push(r);
        }
    }
    for (to, records) in records_to {
        backend.dedup_import(to, &records)?;
    }
    Ok(())
}

/// Pauses or resumes `batch`'s keys on their *new* shards (a forced freeze:
/// the producers sent there wait while the last jobs are copied).
fn set_paused_new<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    pause: bool,
) -> Result<(), ReshardError> {
    let mut by_new: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (key, _, to) in batch {
        by_new.entry(to.as_str()).or_default().push(key.as_str());
    }
    for (shard, keys) in by_new {
        let mut fence = backend.fence(shard)?;
        let before = fence.paused_keys.len();
        for key in keys {
            if pause {
                fence.paused_keys.insert(key.to_string());
            } else if !fence.sealed_keys.contains_key(key) {
                fence.paused_keys.remove(key);
            }
        }
        if fence.paused_keys.len() != before {
            backend.set_fence(shard, &fence)?;
        }
    }
    Ok(())
}

/// Lifts what [`set_paused_new`] left on the new shards of `batch` (a
/// killed forced round): one read per new shard, a write only if needed.
fn lift_new_pauses<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
) -> Result<(), ReshardError> {
    set_paused_new(backend, batch, false)
}

/// Copies `key`'s jobs from `from` that `to` does not have yet, in chunks,
/// until the export finds none; records (key, source id) -> new id in `ids`.
/// Returns how many were stored.
fn copy_backlog<B: QueueBackend + ?Sized>(
    backend: &B,
    key: &str,
    from: &str,
    to: &str,
    ids: &mut BTreeMap<(String, JobId), JobId>,
    cursor: &mut Option<Option<JobId>>,
    touched: &mut BTreeSet<String>,
) -> Result<u64, ReshardError> {
    // The new shard's cursor, read once per key and then kept here: every
    // import of this key from `from` in this run goes through this copy.
    let mut after = match *cursor {
        Some(after) => after,
        None => backend.imported_up_to(to, from, key)?,
    };
    let mut n = 0u64;
    loop {
        let chunk = backend.export_jobs(from, key, after, TRANSFER_CHUNK_JOBS)?;
        let Some(last) = chunk.last() else {
            *cursor = Some(after);
            return Ok(n);
        };
        after = Some(last.id);
        // From here the new shard may hold copies, whatever the call answers.
        touched.insert(key.to_string());
        for (src, new) in backend.import_jobs(to, from, key, &chunk)? {
            ids.insert((key.to_string(), src), new);
            n += 1;
        }
        if chunk.len() < TRANSFER_CHUNK_JOBS {
            *cursor = Some(after);
            return Ok(n);
        }
    }
}

/// Seals or unseals a batch's keys on their old shards (sealed: no run
/// starts there; the fence names the shard the backlog goes to).
fn set_sealed<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[(String, String, String)],
    seal: bool,
) -> Result<(), ReshardError> {
    update_old_fences(backend, batch, &mut |fence, key, to| {
        if seal {
            fence.sealed_keys.insert(key.to_string(), to.to_string());
        } else if !fence.is_frozen(key) {
            // A frozen key is never unsealed here: its new shard holds its
            // backlog and takes its enqueues, so it must finish its move.
            fence.sealed_keys.remove(key);
        }
    })
}

/// [`set_sealed`], shard by shard: every old shard is tried even when one
/// fails; the first error comes back.
fn set_sealed_each<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[(String, String, String)],
    seal: bool,
) -> Result<(), ReshardError> {
    each_old_shard(batch, |part| set_sealed(backend, part, seal))
}

fn each_old_shard(
    batch: &[(String, String, String)],
    mut f: impl FnMut(&[(String, String, String)]) -> Result<(), ReshardError>,
) -> Result<(), ReshardError> {
    let mut by_shard: BTreeMap<&str, Vec<(String, String, String)>> = BTreeMap::new();
    for sw in batch {
        by_shard.entry(sw.1.as_str()).or_default().push(sw.clone());
    }
    let mut first = None;
    for part in by_shard.values() {
        if let Err(e) = f(part) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Changes the fence of each batch key's old shard, one read and one write
/// per shard: `change` is called with the fence once per key on it (with the
/// key's new shard).
fn update_old_fences<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[(String, String, String)],
    change: &mut dyn FnMut(&mut crate::job::Fence, &str, &str),
) -> Result<(), ReshardError> {
    let mut by_shard: BTreeMap<&str, Vec<(&str, &str)>> = BTreeMap::new();
    for (key, from, to) in batch {
        by_shard
            .entry(from.as_str())
            .or_default()
            .push((key.as_str(), to.as_str()));
    }
    for (shard, keys) in by_shard {
        let mut fence = backend.fence(shard)?;
        for (key, to) in keys {
            change(&mut fence, key, to);
        }
        backend.set_fence(shard, &fence)?;
    }
    Ok(())
}

/// Keys whose runs on their old shards outlived `drain_timeout_ms`:
/// they stay. A key its new shard already holds copies of (a killed run
/// got that far) stays sealed, so its old shard never runs what was
/// copied; a rerun finishes it. The others are unsealed: nothing of them
/// moved. Returns their names.
fn leave_late<B: QueueBackend + ?Sized>(
    backend: &B,
    late: &[Switch],
) -> Result<Vec<String>, ReshardError> {
    let mut unseal = Vec::new();
    for sw in late {
        let (key, from, to) = (&sw.0, &sw.1, &sw.2);
        let copied = match backend.imported_up_to(to, from, key)? {
            None => false,
            Some(up_to) => backend
                .export_jobs(from, key, None, 1)?
                .first()
                .is_some_and(|j| j.id <= up_to),
        };
        if !copied {
            unseal.push(sw.clone());
        }
    }
    set_sealed(backend, &unseal, false)?;
    Ok(late.iter().map(|sw| sw.0.clone()).collect())
}

/// Raises the run-fence floor of each batch key's new shard above the
/// highest fence its old shard issued, before the switch is published: the
/// old shard ran the key's last jobs (it is drained), so the key's next run,
/// on the new shard, gets a larger fence than any earlier one.
fn raise_fence_floors<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[(String, String, String)],
) -> Result<(), ReshardError> {
    let mut floor: BTreeMap<&str, u64> = BTreeMap::new();
    let mut high: BTreeMap<&str, u64> = BTreeMap::new();
    for (_, from, to) in batch {
        if !high.contains_key(from.as_str()) {
            high.insert(from, backend.shard_stats(from)?.fence_high);
        }
        let f = floor.entry(to.as_str()).or_default();
        *f = (*f).max(high[from.as_str()].saturating_add(1));
    }
    for (shard, min) in floor {
        let mut fence = backend.fence(shard)?;
        if fence.run_fence_min < min {
            fence.run_fence_min = min;
            backend.set_fence(shard, &fence)?;
        }
    }
    Ok(())
}

/// Sends [`RebalanceEvent::Waiting`] when [`WAIT_EVENT_EVERY_MS`] passed
/// since the last one (or the start of the wait).
fn say_waiting(
    clock: &dyn Clock,
    started_ms: u64,
    said_ms: &mut u64,
    keys: usize,
    on_event: &mut dyn FnMut(RebalanceEvent),
) {
    let now = clock.now_ms();
    if now.saturating_sub(*said_ms) >= WAIT_EVENT_EVERY_MS {
        *said_ms = now;
        on_event(RebalanceEvent::Waiting {
            keys,
            waited_ms: now.saturating_sub(started_ms),
        });
    }
}

impl fmt::Display for PlannedMove {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}\t{} -> {}\t{} jobs",
            self.key, self.from, self.to, self.jobs
        )
    }
}

/// A backend resharding can drive: queue operations plus the key inventory.
/// Every type with both has it, so `Arc<dyn ReshardBackend>` works for any
/// backend and upcasts to `Arc<dyn QueueBackend>` for the worker pool.
pub trait ReshardBackend: QueueBackend + KeyInventory {}

impl<T: QueueBackend + KeyInventory + ?Sized> ReshardBackend for T {}
