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
//!    their durability to [`MoveKeys::sync_imports`], called on each new
//!    shard before any source is deleted), then a last round
//!    (with the key's dedup records; one read per old shard for the batch,
//!    from the cursors the rounds kept) and a *freeze*: one atomic step on
//!    the old shard ([`MoveKeys::freeze_caught_up`]) that checks no job
//!    of the key arrived since and marks it frozen, so its next enqueues
//!    there are sent to the new shard ([`QueueError::Moved`]) at once. No
//!    producer waits. A key that gets a job before every one of
//!    [`FREEZE_ATTEMPTS_MAX`] freezes is paused on its new shard for one
//!    more round instead (its producers wait for that round only). Then
//!    publish the switch, fence the old shards at it, delete the copies
//!    left behind and unseal (which unfreezes). A frozen key is never
//!    unsealed otherwise: it must finish its move. Every
//!    copy is idempotent: the new shard skips source ids at or below what it
//!    took from that shard for that key ([`MoveKeys::imported_up_to`]),
//!    and a rerun first finishes every transfer a killed run left sealed,
//!    to the shard the seal names (keeping the pauses of sealed keys, and
//!    pinning such a key where the published map sends its producers, even
//!    when the target changed since). `docs/design.md` ("Moving a key with its
//!    backlog") argues each step, killed anywhere. Dead letters move with
//!    their key, so no key is held back. A shard that fails mid-move (its
//!    read fails once a batch step failed) is set aside: its keys stay
//!    where they are, the others move, and the run ends with
//!    [`ReshardError::ShardsFailed`] naming it; the rerun finishes. A run
//!    that ends in any error but a conflict (a script error, a reply
//!    timeout no failing shard explains) first unseals every key it sealed
//!    and did not switch of which no copy can exist (no import of it was
//!    sent; for a key a killed run left sealed, its new shard holds none
//!    of what is left): such a key runs where it is until a rerun moves it.
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
//! and first raises every shard's to it ([`MoveKeys::enter_rebalance`]):
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
/// Chunks a move's exports may run ahead of its imports (besides the one
/// being exported and the one being imported): what a batch's copy rounds
/// hold in memory at most, and what overlaps the old shard's reads with the
/// new shard's writes.
pub const COPY_AHEAD_CHUNKS: usize = 1;
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

/// Which keys have work on a shard: what a rebalance must drain.
pub trait KeyInventory {
    /// Every key with queued, delayed or in-flight jobs on `shard`, with its counts.
    fn keys_with_work(&self, shard: &str) -> Result<Vec<(String, KeyCounts)>, QueueError>;
}

/// A backend resharding can drive: queue operations plus the key inventory.
/// Every type with both has it, so `Arc<dyn ReshardBackend>` works for any
/// backend and upcasts to `Arc<dyn QueueBackend>` for the worker pool.
pub trait ReshardBackend: QueueBackend + KeyInventory {}

impl<T: QueueBackend + KeyInventory + ?Sized> ReshardBackend for T {}

mod batch;
mod error;
mod moves;
mod plan;
mod progress;
mod report;
mod run;
mod store;
mod targets;

use batch::*;
pub use error::*;
use moves::*;
pub use plan::*;
pub use progress::*;
pub use report::*;
pub use run::*;
pub use store::*;
pub use targets::*;
