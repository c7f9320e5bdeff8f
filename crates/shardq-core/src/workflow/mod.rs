//! Dependencies: a job that waits until other jobs have ended, then runs
//! with their outcomes and results.
//!
//! A *dependent* is enqueued with `after` (job ids `SHARD:ID`, or the ids
//! of other dependents, `@N`) and a policy for a dependency that did not
//! succeed ([`OnDependencyFailure`]). Until every dependency has ended it
//! is not on any shard: it is a [`Waiting`] record in the deployment's
//! `waiting` setting ([`SETTING_WAITING`]), the document every process
//! of the deployment reads and changes by compare-and-set
//! ([`crate::reshard::update_setting`]), the same primitive that settings
//! and schedules use. So a dependent does not hold up its key's later jobs
//! while it waits (it joins its key's order when it is released, as a job
//! enqueued at that moment would), and a move of its key or of any
//! dependency's key strands nothing: the record is on no shard.
//!
//! # How a dependent is resolved (`resolve.rs`)
//!
//! Every worker and server runs a [`Resolver`] pass every
//! [`RESOLVE_EVERY_MS`]. A pass looks up each unresolved dependency where
//! a job is found (live or finished on its shard, else its copy after a
//! move: [`crate::backend::find_job`]) and records its end as it sees it:
//! `completed` (with its result), `cancelled`, `dead`, a dependent that
//! `failed`, or `forgotten` (see below). Recorded outcomes never change, so
//! a dependency retried from the dead-letter list, or one the retention
//! forgets later, cannot change a decision made. When every dependency has
//! an outcome, the pass decides: under [`OnDependencyFailure::Fail`] a
//! dependency that did not complete ends the dependent as failed, with a
//! reason naming it; otherwise the dependent is enqueued on its key.
//!
//! # Why each dependent starts once
//!
//! The release enqueues the job with the dedup id `after:@N.NONCE`
//! ([`release_dedup_id`]) and a dedup window of [`RELEASE_DEDUP_WINDOW_MS`],
//! then records where it landed. Two passes releasing at once (two
//! processes), or a pass killed between its enqueue and its record, store
//! the job once: the second enqueue is a duplicate and answers the first
//! one's id, on whatever shard the key has moved to since (dedup records
//! move with their key). A pass that loses the compare-and-set reads the
//! document again and applies its findings to what it finds; a finding
//! never overwrites one recorded earlier.
//!
//! The `NONCE` is drawn at random when the record is stored
//! ([`Waiting::nonce`]): a settings store that comes back without
//! acknowledged writes gives a number out again, and the new record's
//! release must not be answered as the duplicate of the old one's (of the
//! same key) within the dedup window.
//!
//! # Why nothing waits forever
//!
//! Every end of a job is visible to the lookup: an ack or a cancel leaves
//! a finished job, a dead letter stays on its shard, a dependent that
//! failed stays in the document. A job that is nowhere (purged, or
//! finished and forgotten by the retention before a pass saw it) was seen
//! at enqueue (an id no shard knows is refused), so it has ended: after
//! it has been missing for [`FORGOTTEN_AFTER_MS`] its outcome is
//! `forgotten`, which is not a success. A release refused for good (bad
//! input about the job, [`ReleaseError::for_good`]) ends the dependent as
//! failed; one that may pass is tried again every pass. The retention keeps the newest
//! [`crate::job::Retention::finished_jobs`] finished jobs per shard; a
//! shard that finishes more than that between two passes can turn a
//! completion into `forgotten`, so keep it above a shard's finishes per
//! second (docs/workflows.md).
//!
//! # Bounds
//!
//! [`DEPENDENCIES_MAX`] dependencies per job, [`WAITING_MAX`] dependents
//! waiting at once in a deployment, a payload of at most
//! [`DEPENDENT_PAYLOAD_BYTES_MAX`], the document at most
//! [`WAITING_BYTES_MAX`] after an enqueue, [`COLLECTED_RESULT_BYTES_MAX`] of
//! dependencies' results kept per dependent (results past it are dropped
//! and the dependency says so), ended records kept for
//! [`ENDED_KEPT_MS`] and at most [`ENDED_KEPT_MAX`] of them.

mod batch;
mod record;
mod resolve;

pub use batch::{
    batch_fields, batch_of_dedup_id, callback_dedup_id, counts as batch_counts, done as batch_done,
    due as batch_due, parse_batch_id, Batch, BatchCounts, CallbackKind, NewBatch, BATCH_PREFIX,
};

pub use record::{
    check_after, parse_dependency, DepOutcome, DepRef, Dependency, DependentTotals, NewDependent,
    OnDependencyFailure, WaitState, Waiting, WaitingFile, WaitingStore, WAITING_FORMAT,
};
pub use resolve::{
    release_producer, run_resolver, PassReport, Release, ReleaseError, Released, Resolver, Wake,
};

/// The deployment setting that holds the waiting dependents.
pub const SETTING_WAITING: &str = "waiting";
/// Most dependencies of one job.
pub const DEPENDENCIES_MAX: usize = 1_000;
/// Most jobs in one batch.
pub const BATCH_JOBS_MAX: usize = 10_000;
/// Most dependents waiting at once in a deployment (a batch's jobs not
/// yet released count: room for a whole batch and more).
pub const WAITING_MAX: usize = 20_000;
/// Largest payload of a dependent (64 KiB): it is kept in the shared
/// document until released.
pub const DEPENDENT_PAYLOAD_BYTES_MAX: usize = 64 * 1024;
/// Largest the waiting document may grow by an enqueue (32 MiB); past it
/// new dependents are refused as retryable until some are released.
pub const WAITING_BYTES_MAX: usize = 32 << 20;
/// Most bytes of dependencies' results one dependent collects (1 MiB).
pub const COLLECTED_RESULT_BYTES_MAX: usize = 1 << 20;
/// How long a released, failed or cancelled dependent's record is kept,
/// so its id still answers (one day).
pub const ENDED_KEPT_MS: u64 = 86_400_000;
/// Most ended dependents' records kept (the oldest go first).
pub const ENDED_KEPT_MAX: usize = 10_000;
/// How often a resolver pass runs (100 ms).
pub const RESOLVE_EVERY_MS: u64 = 100;
/// How long a dependency must be missing from every shard before its
/// outcome is `forgotten` (2 s: longer than a move's switch).
pub const FORGOTTEN_AFTER_MS: u64 = 2_000;
/// As [`FORGOTTEN_AFTER_MS`], for a dependency its shard remembers as
/// moved away with its key whose copy is not found (60 s: the copy's shard
/// may be down for a while).
pub const FORGOTTEN_MOVED_AFTER_MS: u64 = 60_000;
/// The dedup window of a release (7 days, the longest a dedup id is kept).
pub const RELEASE_DEDUP_WINDOW_MS: u64 = crate::job::DEDUP_WINDOW_MS_MAX;
/// The dedup id prefix of a released dependent; refused from producers.
pub const AFTER_PREFIX: &str = "after:";

/// The dedup id dependent `id` with nonce `nonce` is released with:
/// `after:@N.NONCE`.
pub fn release_dedup_id(id: u64, nonce: &str) -> String {
    format!("{AFTER_PREFIX}@{id}.{nonce}")
}

/// The dedup id a dependent is released with, for its record: a job of a
/// batch says which (`after:@N.NONCE:batch@B`), so its handler can add to
/// it.
pub fn release_dedup_id_of(id: u64, w: &Waiting) -> String {
    match w.member_of {
        Some(b) => format!("{}:batch@{b}", release_dedup_id(id, &w.nonce)),
        None => release_dedup_id(id, &w.nonce),
    }
}

/// A record's number from its part of a dedup id, `N.NONCE`.
fn number_of(part: &str) -> Option<u64> {
    let (n, nonce) = part.split_once('.')?;
    if nonce.is_empty() {
        return None;
    }
    n.parse().ok()
}

/// The dependent a released job was, from its dedup id (`after:@N.NONCE`,
/// or `after:@N.NONCE:batch@B` for a job of a batch).
pub fn dependent_of_dedup_id(dedup_id: &str) -> Option<u64> {
    let rest = dedup_id.strip_prefix(AFTER_PREFIX)?.strip_prefix('@')?;
    number_of(rest.split(':').next()?)
}
