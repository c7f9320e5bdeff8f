//! The backend trait: the queue semantics every storage engine implements.
//!
//! The worker pool, the CLI and resharding talk only to [`QueueBackend`] and
//! [`Coordinator`], so the embedded file engine and the Redis backend are
//! interchangeable. This module defines behaviour, never storage: it must not
//! assume files, sockets or any particular process layout.
//!
//! # Contract, for every implementation
//!
//! * **Per-key order.** Within a shard, a key's jobs start in the order their
//!   enqueues completed (their [`JobId`]s grow in that order), and at most one
//!   job per key is in flight, or the key's concurrency
//!   ([`RunJobs::key_concurrency`]) where its policy allows more and
//!   the backend can ([`BackendLimits::key_concurrency_max`]). A failed job
//!   is retried before any later job of its key (and while its retry waits,
//!   no later job starts); other keys keep flowing meanwhile.
//! * **At-least-once.** A job is finished only by [`RunJobs::ack`] (or by
//!   being dead-lettered and then purged). A claimed job whose owner vanishes
//!   is claimed again, with its attempt count raised, by the next owner after
//!   [`RunJobs::adopt`].
//! * **Fencing.** Every enqueue carries the shard-map version the producer
//!   routed with. A shard refuses it with [`QueueError::Fenced`] if the
//!   version is older than its [`Fence::map_version_min`], and with
//!   [`QueueError::Paused`] if the key is paused; the check and the append
//!   are atomic with respect to [`MoveKeys::set_fence`], so once
//!   `set_fence` returns, no refused enqueue can land afterwards.
//! * **Drain.** [`InspectJobs::key_counts`] reports a key's depth and
//!   in-flight count as the shard sees it now; drain-then-switch pauses the
//!   key, waits until both are zero, then switches the route.
//! * **One run per key, named by a receipt.** A claim starts a *run*: the
//!   job gets a fencing token ([`ClaimedJob::fence`]) and a job lease
//!   (`lease_ms`). Only the run's [`Receipt`] (id + fence) may ack, fail or
//!   extend it; any other receipt (an earlier attempt, a lapsed lease, an
//!   earlier owner, a run already finished) is refused with
//!   [`QueueError::StaleReceipt`] or listed as stale, and changes nothing.
//!   A run whose job lease lapses without an [`RunJobs::extend`] ends
//!   at the next claim on its shard: its job goes back to the head of its
//!   key with attempt + 1 and the key stays blocked until then, so two runs
//!   of a key never overlap while their leases are honoured. (Until that
//!   claim, no other run has started and the lapsed run's receipt still
//!   counts.)
//! * **Fences grow.** Each new run of a key gets a fence larger than every
//!   earlier run's, across attempts, owners, store restarts and rebalances:
//!   a shard issues [`crate::job::next_fence`] (the backend clock in
//!   microseconds, above the last fence it issued, at least
//!   [`Fence::run_fence_min`]), and resharding raises the new shard's
//!   `run_fence_min` above the old shard's [`ShardStats::fence_high`] before
//!   a moved key's first job there can run.
//! * **Ownership.** Any process may enqueue to any shard. Only a process that
//!   has adopted a shard ([`RunJobs::adopt`]) claims, acks and fails its
//!   jobs; others get [`QueueError::NotOwner`]. Who may adopt is decided by a
//!   [`Coordinator`] (leases), not by the backend.
//! * **Dedup ids belong to their key.** [`RunJobs::enqueue_dedup`]
//!   checks each job's `(key, dedup_id)` against the shard's dedup records
//!   atomically with the append (the same lock, or the same script): of
//!   any number of concurrent enqueues of one `(key, id)` within the
//!   window, exactly one stores a job and the others are told its id. The
//!   records are as durable as the jobs, survive restarts for their window,
//!   and move with their key in a rebalance ([`MoveKeys::dedup_export`],
//!   [`MoveKeys::dedup_import`]).

use crate::error::QueueError;
use crate::flow::Rank;
use crate::job::{
    AckOutcome, CancelOutcome, ClaimedJob, DeadJob, DedupRecord, FailOutcome, Fence, JobId,
    JobInfo, KeyCounts, MovedJob, NewJob, Receipt, ShardStats, Stored,
};

/// The bounds of one call of a backend ([`RunJobs::limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendLimits {
    /// Most jobs in one [`RunJobs::enqueue`].
    pub enqueue_batch_jobs_max: usize,
    /// Most bytes of payloads and keys in one [`RunJobs::enqueue`].
    pub enqueue_batch_bytes_max: usize,
    /// Most runs of one key at once the backend can keep apart
    /// ([`crate::flow::FlowPolicy::concurrency`]): a policy asking more is
    /// refused where it is set.
    pub key_concurrency_max: u32,
}

impl Default for BackendLimits {
    /// No bound on batches; one run per key.
    fn default() -> Self {
        BackendLimits {
            enqueue_batch_jobs_max: usize::MAX,
            enqueue_batch_bytes_max: usize::MAX,
            key_concurrency_max: 1,
        }
    }
}

/// [`MoveKeys::import_jobs`] for a backend whose
/// [`MoveKeys::import_many`] does the work: the one key as a batch of one.
pub fn import_jobs_by_many<B: QueueBackend + ?Sized>(
    backend: &B,
    shard: &str,
    from: &str,
    key: &str,
    jobs: &[MovedJob],
) -> Result<Vec<(JobId, JobId)>, QueueError> {
    let items = [(key.to_string(), jobs.to_vec())];
    Ok(backend
        .import_many(shard, from, &items)?
        .into_iter()
        .map(|(_, src, new)| (src, new))
        .collect())
}

/// Jobs per `export_jobs` call of the default [`MoveKeys::export_many`].
pub const EXPORT_CHUNK_JOBS: usize = 4096;

/// Waiting jobs of a key, from its head, that [`InspectJobs::key_hold`]
/// and [`InspectJobs::resume_key`] look at. A back-off puts its job back
/// at the head of its key, so a key's backed-off jobs are its first waiting
/// ones: at most its concurrency of them
/// ([`crate::flow::KEY_CONCURRENCY_MAX`]), behind any dead letter retried in
/// front of them.
pub const KEY_HOLD_SCAN_JOBS: usize = 2 * crate::flow::KEY_CONCURRENCY_MAX as usize;

/// A handler's back-off standing on a key now ([`InspectJobs::key_hold`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyHold {
    /// The key's waiting jobs a back-off put back and whose wait has not
    /// ended, in key order (one, unless the key runs several at once).
    pub jobs: Vec<JobId>,
    /// When the last of them may start again (ms since the epoch).
    pub until_ms: u64,
}

/// What [`InspectJobs::resume_key`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyResume {
    /// The back-off is lifted: its jobs are due now.
    Resumed(KeyHold),
    /// No handler's back-off holds the key: nothing changed. Its jobs may
    /// still wait for a delay their producer gave or for a retry after a
    /// failure, which a resume leaves as they are.
    NotHeld,
    /// The key is moving to another shard (sealed for a rebalance), which
    /// may already hold a copy of its jobs: nothing changed. The move
    /// carries each job with its wait, which its new shard keeps as a
    /// plain delay: a resume there does not lift it.
    Moving,
}

/// What [`RunJobs::back_off`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackedOff {
    /// When the job (and its key) may start again.
    pub at_ms: u64,
    /// The flow-control group held until then, if one was asked for and
    /// the key has one.
    pub group: Option<String>,
}

/// The queue operations of one storage engine, over all shards it holds:
/// the three narrower traits together. Every backend implements all three;
/// code that needs only one part asks for that trait ([`RunJobs`] for a
/// worker pool, [`MoveKeys`] for a move, [`InspectJobs`] for operators'
/// reads and actions), so each part's contract can be read and checked
/// alone.
///
/// Implementations are shared between threads (`Send + Sync`); every method
/// takes `&self`. Shard names are those of the shard map.
pub trait QueueBackend: RunJobs + MoveKeys + InspectJobs {}

impl<T: RunJobs + MoveKeys + InspectJobs + ?Sized> QueueBackend for T {}

/// Running a shard's jobs: enqueue, claim, ack, fail, extend and back off,
/// and taking or giving up a shard ([`RunJobs::adopt`]). What a producer
/// and a worker pool need.
pub trait RunJobs: Send + Sync {
    /// Names of the shards this backend holds, in map order.
    fn shard_names(&self) -> Vec<String>;

    /// The bounds of one call: callers (the producer) split their work by
    /// them, so no caller needs to know which backend it talks to.
    fn limits(&self) -> BackendLimits {
        BackendLimits::default()
    }

    /// Appends `jobs`, in order, to `shard`, as one batch.
    ///
    /// `map_version` is the version of the shard map the caller routed with;
    /// the shard may refuse the batch with [`QueueError::Fenced`] or
    /// [`QueueError::Paused`] (nothing of the batch is appended then). On
    /// success every job is stored (as durably as the backend's durability
    /// setting promises) and the returned ids are in the order of `jobs`.
    fn enqueue(
        &self,
        shard: &str,
        map_version: u64,
        jobs: &[NewJob],
    ) -> Result<Vec<JobId>, QueueError>;

    /// Appends `jobs` like [`RunJobs::enqueue`], except that a job whose
    /// `(key, dedup_id)` has a live record on `shard` is not stored: its
    /// [`Stored`] names the job it was enqueued as (`duplicate: true`,
    /// maybe on another shard after a move). The check and the records of
    /// the stored jobs are atomic with the append, and each record expires
    /// `window_ms` after this call (1..=[`crate::DEDUP_WINDOW_MS_MAX`]). A
    /// second job of `jobs` with the same `(key, id)` is a duplicate of the
    /// first. A fence or pause refuses the whole batch, duplicates included.
    ///
    /// A keyed job ([`NewJob::keyed`], its dedup id a [`crate::job::keyed_id`])
    /// is checked against the key's live job with the same id on `shard`,
    /// not against a dedup record, and leaves none: a unique job whose id a
    /// waiting (or, asked for, running) job holds is not stored (its
    /// [`Stored`] names that job, `duplicate: true`); a debounced job whose
    /// id a waiting job holds is not stored either: that job takes its
    /// payload and starts at `min(now + delay_ms, created_ms + max_ms)`,
    /// keeping its id and place (its [`Stored`] names it, `duplicate:
    /// false`); a debounce of a key being copied away ([`Fence::sealed_keys`](crate::Fence))
    /// is refused with [`QueueError::Paused`]. A stored debounced job starts
    /// at `now + min(delay_ms, max_ms)`. Jobs keep their id through moves,
    /// so the check follows the key.
    ///
    /// The default stores jobs without dedup ids through `enqueue` and
    /// refuses any that carry one.
    fn enqueue_dedup(
        &self,
        shard: &str,
        map_version: u64,
        jobs: &[NewJob],
        window_ms: u64,
    ) -> Result<Vec<Stored>, QueueError> {
        let _ = window_ms;
        crate::job::refuse_dedup_ids(jobs)?;
        Ok(self
            .enqueue(shard, map_version, jobs)?
            .into_iter()
            .map(|id| Stored {
                id,
                shard: shard.to_string(),
                duplicate: false,
            })
            .collect())
    }

    /// Makes this process the runner of `shard`: loads its backlog, and puts
    /// jobs left in flight by a previous owner back at the head of their keys
    /// (they run again with attempt + 1). Call only after the
    /// [`Coordinator`] granted the shard.
    fn adopt(&self, shard: &str) -> Result<(), QueueError>;

    /// Stops running `shard` in this process. Jobs still in flight stay in
    /// flight for the next owner to retry; call after draining.
    fn release(&self, shard: &str) -> Result<(), QueueError>;

    /// Claims up to `max` jobs that may start now: the head job of keys that
    /// have nothing in flight and whose head's start time has come. Each
    /// claimed job starts a new run: attempt + 1, a new fence, and a job
    /// lease of `lease_ms` (checked with [`crate::validate_job_lease_ms`]).
    /// Runs whose lease lapsed end first (their jobs go back to the head of
    /// their keys). Needs ownership ([`QueueError::NotOwner`]).
    fn claim(&self, shard: &str, max: usize, lease_ms: u64) -> Result<Vec<ClaimedJob>, QueueError>;

    /// Finishes runs. Receipts that are not their job's current run are
    /// refused one by one (listed in [`AckOutcome::stale`]); the others are
    /// acked. Needs ownership.
    fn ack(&self, shard: &str, receipts: &[Receipt]) -> Result<AckOutcome, QueueError> {
        self.ack_results(shard, receipts, &[])
    }

    /// [`RunJobs::ack`], keeping `results[i]` (when given) with the job
    /// `receipts[i]` finished as its [`FinishedJob::result`](crate::job::FinishedJob)
    /// for the shard's retention. `results` is empty (no results) or as
    /// long as `receipts`; each result is at most
    /// [`crate::job::RESULT_BYTES_MAX`] (larger is refused as
    /// [`QueueError::InvalidOption`], nothing acked). A stale receipt's
    /// result is dropped with it.
    fn ack_results(
        &self,
        shard: &str,
        receipts: &[Receipt],
        results: &[Option<Vec<u8>>],
    ) -> Result<AckOutcome, QueueError>;

    /// Records a failed run: the job is retried after `retry_in_ms` (or the
    /// backoff), ahead of its key's later jobs, or dead-lettered once out of
    /// attempts. A receipt that is not the current run gets
    /// [`QueueError::StaleReceipt`]. Needs ownership.
    fn fail(
        &self,
        shard: &str,
        receipt: Receipt,
        reason: &str,
        retry_in_ms: Option<u64>,
    ) -> Result<FailOutcome, QueueError>;

    /// Whether a claim ranks ready keys by priority and weight now (flow
    /// control): a pool then claims only for its free slots, never ahead,
    /// so that every free slot goes to the best-ranked ready key.
    fn ranks_keys(&self) -> bool {
        false
    }

    /// Whether a claim takes rate tokens or group slots now (some policy
    /// sets a rate or a group): a pool then claims only for handlers that
    /// start at once, so the tokens are taken when the handler starts and a
    /// group's limit holds for the starts its downstream sees.
    fn limits_starts(&self) -> bool {
        false
    }

    /// Runs of `key` a claim lets be in flight at once (its policy's
    /// concurrency, within [`BackendLimits::key_concurrency_max`]): a pool
    /// that sees more runs of a key than this knows some of them are over.
    fn key_concurrency(&self, key: &str) -> u32 {
        let _ = key;
        1
    }

    /// While keys are ranked ([`RunJobs::ranks_keys`]): the ranks of
    /// up to `max` keys a claim on `shard` would start now, best first
    /// (runs whose lease lapsed count as ready again; limits are not asked,
    /// so a key over its rate may be among them). Nothing is claimed or
    /// charged. A process that runs several shards gives its free slots to
    /// the shards of the best-ranked keys over all of them. Empty when keys
    /// are not ranked, and on backends that rank no keys. Needs ownership.
    fn ready_ranks(&self, shard: &str, max: usize) -> Result<Vec<Rank>, QueueError> {
        let _ = (shard, max);
        Ok(Vec::new())
    }

    /// Ends a run without using an attempt, because its handler said its
    /// downstream is limiting it: the job goes back to the head of its key
    /// with its attempt count as before the run, and starts again not
    /// before `retry_in_ms` from now (at most
    /// [`crate::flow::BACKOFF_MS_MAX`]), so its key starts nothing until
    /// then while other keys run on. With `group`, every key of the key's
    /// flow-control group is held until then too, in every process
    /// ([`BackedOff::group`] names it; none when the key has no group). A
    /// receipt that is not the current run gets
    /// [`QueueError::StaleReceipt`]. Needs ownership.
    fn back_off(
        &self,
        shard: &str,
        receipt: Receipt,
        retry_in_ms: u64,
        group: bool,
    ) -> Result<BackedOff, QueueError> {
        let _ = (shard, receipt, retry_in_ms, group);
        Err(QueueError::Unsupported {
            what: "backing off a run",
        })
    }

    /// Extends the job leases of running runs to `lease_ms` from now (the
    /// heartbeat of a long handler). Returns the receipts refused as stale;
    /// their runs are over and their handlers should stop. Needs ownership.
    fn extend(
        &self,
        shard: &str,
        receipts: &[Receipt],
        lease_ms: u64,
    ) -> Result<Vec<Receipt>, QueueError>;

    /// Of `receipts`, the runs of `shard` that are no longer current, as of
    /// now and with every process's writes seen: ended, followed by a newer
    /// run of their job, or asked to stop by a cancel
    /// ([`InspectJobs::cancel`], [`CancelOutcome::Stopping`]). Read-only:
    /// it extends no lease and ends no run, so a pool asks it often (about
    /// once a second, [`crate::pool::CANCEL_CHECK_MS`]) and stops a
    /// cancelled run's handler well before its next [`RunJobs::extend`]
    /// would say so. A run whose job lease lapsed and that no claim ended
    /// yet is still current. Costs one store call for all the receipts.
    /// Needs no ownership.
    fn stale_runs(&self, shard: &str, receipts: &[Receipt]) -> Result<Vec<Receipt>, QueueError> {
        let _ = (shard, receipts);
        Err(QueueError::Unsupported {
            what: "checking runs",
        })
    }

    /// The earliest time (ms since the epoch) work of `shard` may start: a
    /// pending job becomes claimable, or a run in flight (of any process)
    /// reaches the end of its job lease and would lapse back into work; now
    /// or earlier when a job is claimable now; `None` when nothing is
    /// waiting and nothing is in flight. Lets a pool sleep instead of
    /// polling, and tells it whether it is idle. Needs no ownership.
    fn next_due_ms(&self, shard: &str) -> Result<Option<u64>, QueueError>;
}

/// Moving keys between shards with their backlogs: fences, the copy of
/// jobs and dedup records, the freeze of a caught-up key and the purge of
/// the copies left behind (the protocol in [`crate::reshard`]).
pub trait MoveKeys: Send + Sync {
    /// The live dedup records of `key` on `shard` (for a move).
    fn dedup_export(&self, shard: &str, key: &str) -> Result<Vec<DedupRecord>, QueueError> {
        let _ = (shard, key);
        Ok(Vec::new())
    }

    /// The live dedup records of each of `keys` on `shard`, in as few reads
    /// as the backend can (Redis: one scan of the shard's records for all
    /// of them, where [`MoveKeys::dedup_export`] scans once per key), as
    /// the last round of a move under a pause needs.
    fn dedup_export_many(
        &self,
        shard: &str,
        keys: &[&str],
    ) -> Result<Vec<DedupRecord>, QueueError> {
        let mut out = Vec::new();
        for key in keys {
            out.extend(self.dedup_export(shard, key)?);
        }
        Ok(out)
    }

    /// Stores `records` on `shard`, atomically; a `(key, id)` that already
    /// has a live record there keeps it, so a rerun of a copy changes
    /// nothing. Expired records are dropped.
    fn dedup_import(&self, shard: &str, records: &[DedupRecord]) -> Result<(), QueueError> {
        let _ = shard;
        if records.is_empty() {
            return Ok(());
        }
        Err(QueueError::Unsupported {
            what: "dedup records",
        })
    }

    /// Keys with live dedup records on `shard` (a rebalance moves them with
    /// drain-then-switch even when they have no jobs).
    fn dedup_keys(&self, shard: &str) -> Result<Vec<String>, QueueError> {
        let _ = shard;
        Ok(Vec::new())
    }

    /// Up to `max` of `key`'s jobs on `shard` that are not running, queued
    /// or delayed or dead, with an id above `after`, in id order (which is
    /// key order). Only for a key sealed on `shard`, whose set of such jobs
    /// then only grows, at the top, as enqueues arrive.
    fn export_jobs(
        &self,
        shard: &str,
        key: &str,
        after: Option<JobId>,
        max: usize,
    ) -> Result<Vec<MovedJob>, QueueError> {
        let _ = (shard, key, after, max);
        Err(QueueError::Unsupported {
            what: "moving a backlog",
        })
    }

    /// Appends `jobs`, copied from shard `from`, to `key` on `shard`, in
    /// order, atomically: payload, times, attempts and dead letters as
    /// given, new ids here. A job whose source id is at or below
    /// [`MoveKeys::imported_up_to`] is skipped, so a rerun of a copy
    /// stores nothing twice. Returns (source id, new id) per job stored.
    fn import_jobs(
        &self,
        shard: &str,
        from: &str,
        key: &str,
        jobs: &[MovedJob],
    ) -> Result<Vec<(JobId, JobId)>, QueueError> {
        let _ = (shard, from, key, jobs);
        Err(QueueError::Unsupported {
            what: "moving a backlog",
        })
    }

    /// Every job [`MoveKeys::export_jobs`] would give for each of
    /// `items` (a key and its cursor) on `shard`, all of them, in as few
    /// reads as the backend can (Redis: one script call for many keys), as
    /// the last round of a move under a pause needs.
    fn export_many(
        &self,
        shard: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<(String, Vec<MovedJob>)>, QueueError> {
        let mut out = Vec::new();
        for (key, after) in items {
            let mut after = *after;
            let mut jobs = Vec::new();
            loop {
                let chunk = self.export_jobs(shard, key, after, EXPORT_CHUNK_JOBS)?;
                let full = chunk.len() == EXPORT_CHUNK_JOBS;
                after = chunk.last().map(|j| j.id).or(after);
                jobs.extend(chunk);
                if !full {
                    break;
                }
            }
            out.push((key.clone(), jobs));
        }
        Ok(out)
    }

    /// [`MoveKeys::import_jobs`] for several keys copied from the same
    /// shard, in as few writes as the backend can (the embedded engine: one
    /// append, one sync), as a move's last round under a pause needs.
    /// Returns (key, source id, new id) per job stored.
    fn import_many(
        &self,
        shard: &str,
        from: &str,
        items: &[(String, Vec<MovedJob>)],
    ) -> Result<Vec<(String, JobId, JobId)>, QueueError> {
        let mut out = Vec::new();
        for (key, jobs) in items {
            for (src, new) in self.import_jobs(shard, from, key, jobs)? {
                out.push((key.clone(), src, new));
            }
        }
        Ok(out)
    }

    /// Whether a move's copy should export the next chunk from the old
    /// shard while the new shard stores this one, on a second thread: for
    /// a backend whose shards are separate servers (Redis), which then
    /// work at once. Default: no (one thread, export then import, which
    /// keeps a seeded simulation's history fixed).
    fn overlaps_copies(&self) -> bool {
        false
    }

    /// Makes this backend's later writes for a move (fences, copies,
    /// freezes, purges) carry rebalance epoch `epoch`
    /// ([`MapStore::rebalance_epoch`](crate::reshard::MapStore::rebalance_epoch)),
    /// and raises `shard`'s epoch to it: from then on `shard` refuses such
    /// writes of an older epoch ([`QueueError::Superseded`]), so a
    /// rebalance that stalled past its lock's lease cannot write behind the
    /// one that took over. Default: nothing (a backend whose rebalance lock
    /// lives as long as its holder, as the embedded engine's file lock
    /// does, has no stale holder to fence off).
    fn enter_rebalance(&self, shard: &str, epoch: u64) -> Result<(), QueueError> {
        let _ = (shard, epoch);
        Ok(())
    }

    /// Makes the copies [`MoveKeys::import_jobs`] and
    /// [`MoveKeys::import_many`] stored on `shard` durable, whoever
    /// wrote them, where the backend defers that: the embedded engine syncs
    /// its log once for a move's backlog rather than once per chunk, since
    /// each sync of a big copy holds up the syncs of the shards' producers.
    /// A move calls it on the new shard before it deletes anything on the
    /// old one. Default: nothing to do (each import was durable as it
    /// returned).
    fn sync_imports(&self, shard: &str) -> Result<(), QueueError> {
        let _ = shard;
        Ok(())
    }

    /// The largest source id `shard` has taken from shard `from` for `key`.
    fn imported_up_to(
        &self,
        shard: &str,
        from: &str,
        key: &str,
    ) -> Result<Option<JobId>, QueueError> {
        let _ = (shard, from, key);
        Err(QueueError::Unsupported {
            what: "moving a backlog",
        })
    }

    /// Deletes `key`'s jobs on `shard` that are not running (queued,
    /// delayed and dead), atomically: the copies left behind by a move.
    /// The shard remembers their ids as moved away with `key`
    /// ([`MoveKeys::moved_away`]). Returns how many.
    fn purge_key(&self, shard: &str, key: &str) -> Result<u64, QueueError> {
        let _ = (shard, key);
        Err(QueueError::Unsupported {
            what: "moving a backlog",
        })
    }

    /// The key a job of `shard` moved away with, when `id` is no longer
    /// live there because [`MoveKeys::purge_key`] deleted it after its
    /// key's move (its copy is on the key's new shard): for the last
    /// [`crate::MOVED_KEYS_KEPT`] keys purged, at most
    /// [`crate::MOVED_IDS_KEPT`] ids. `None` for any other id. Needs no
    /// ownership.
    fn moved_away(&self, shard: &str, id: JobId) -> Result<Option<String>, QueueError> {
        let _ = (shard, id);
        Ok(None)
    }

    /// The id under which `shard` stored its copy of job `source_id` of
    /// shard `from` ([`MoveKeys::import_jobs`], [`MoveKeys::import_many`]),
    /// for the last [`crate::MOVED_KEYS_KEPT`] imports, at most
    /// [`crate::MOVED_IDS_KEPT`] jobs: with [`MoveKeys::moved_away`] on the
    /// old shard, how an id from before a move finds its job
    /// ([`follow_moves`]). `None` for any other. Needs no ownership.
    fn imported_as(
        &self,
        shard: &str,
        from: &str,
        source_id: JobId,
    ) -> Result<Option<JobId>, QueueError> {
        let _ = (shard, from, source_id);
        Ok(None)
    }

    /// Freezes each of `items`' keys on `shard` (a key sealed there for a
    /// move, with the largest id of it its new shard took: its cursor)
    /// when none of its jobs there that is not running has a larger id,
    /// atomically with enqueues: no job arrives between the check and the
    /// freeze. A frozen key's enqueues are refused with
    /// [`QueueError::Moved`] naming its new shard, which holds its whole
    /// backlog. Returns the keys frozen (one frozen before counts); a key
    /// not sealed here is never frozen.
    fn freeze_caught_up(
        &self,
        shard: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<String>, QueueError> {
        let _ = (shard, items);
        Err(QueueError::Unsupported {
            what: "freezing a moving key",
        })
    }

    /// The shard's current fence.
    fn fence(&self, shard: &str) -> Result<Fence, QueueError>;

    /// Replaces the shard's fence, atomically with respect to enqueues.
    fn set_fence(&self, shard: &str, fence: &Fence) -> Result<(), QueueError>;
}

/// What operators read and do to jobs: counts, a job or a key's jobs, the
/// finished jobs, dead letters (retry, purge), cancel, and a key's
/// back-off (read, resume). Needs no ownership of the shard.
pub trait InspectJobs: Send + Sync {
    /// The handler's back-off holding `key` on `shard` now, if one does:
    /// its waiting jobs (among its first [`KEY_HOLD_SCAN_JOBS`]) that a
    /// [`RunJobs::back_off`] put back and whose wait has not ended. A
    /// job delayed by its producer, or waiting for a retry after a failure,
    /// is not held by a back-off; nor is a job whose wait a flow-control
    /// refusal (a rate, a group's slots) set. Needs no ownership.
    fn key_hold(&self, shard: &str, key: &str) -> Result<Option<KeyHold>, QueueError> {
        let _ = (shard, key);
        Err(QueueError::Unsupported {
            what: "reading a key's back-off",
        })
    }

    /// Lifts the back-off holding `key` on `shard`: every job
    /// [`InspectJobs::key_hold`] names is due now, keeping its place and
    /// its attempt count, so the key starts again at its shard owner's next
    /// claim, whichever process calls this. Jobs waiting for a producer's
    /// delay or a retry's backoff are left as they are, and so is the
    /// hold on the key's flow-control group a back-off for the group put
    /// ([`crate::flow::FlowControl::resume_group`] lifts that). A key
    /// sealed for a move answers [`KeyResume::Moving`] and changes
    /// nothing. Atomic with respect to claims. Needs no ownership.
    fn resume_key(&self, shard: &str, key: &str) -> Result<KeyResume, QueueError> {
        let _ = (shard, key);
        Err(QueueError::Unsupported {
            what: "resuming a key",
        })
    }

    /// A key's depth, in-flight and dead counts on `shard`, as of now
    /// (including enqueues made by other processes).
    fn key_counts(&self, shard: &str, key: &str) -> Result<KeyCounts, QueueError>;

    /// Counts for `status`.
    fn shard_stats(&self, shard: &str) -> Result<ShardStats, QueueError>;

    /// Up to `limit` dead-lettered jobs of `shard`, oldest first.
    fn dead_list(&self, shard: &str, limit: usize) -> Result<Vec<DeadJob>, QueueError>;

    /// Puts dead jobs back in their keys (at their original place in key
    /// order, attempts reset). `None` means all. Returns how many moved.
    fn dead_retry(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError>;

    /// Deletes dead jobs for good. `None` means all. Returns how many.
    fn dead_purge(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError>;

    /// The live job `id` of `shard` (queued, delayed, running or dead), as
    /// of now; `None` when no live job has that id. Needs no ownership.
    fn job(&self, shard: &str, id: JobId) -> Result<Option<JobInfo>, QueueError> {
        let _ = (shard, id);
        Err(QueueError::Unsupported {
            what: "reading a job",
        })
    }

    /// Up to `max` (at most [`crate::job::KEY_JOBS_MAX`]) of `key`'s live
    /// jobs on `shard`, in key order (id order): its run in flight, its
    /// queued and delayed jobs, and its dead letters. Needs no ownership.
    fn key_jobs(&self, shard: &str, key: &str, max: usize) -> Result<Vec<JobInfo>, QueueError> {
        let _ = (shard, key, max);
        Err(QueueError::Unsupported {
            what: "listing a key's jobs",
        })
    }

    /// Up to `max` of the jobs of `shard` that finished (acked or
    /// cancelled) within its [`crate::job::Retention`], newest first; with
    /// `key`, only that key's. A job finished before the shard's last
    /// owner change may be missing where the backend says so. Needs no
    /// ownership.
    fn finished(
        &self,
        shard: &str,
        key: Option<&str>,
        max: usize,
    ) -> Result<Vec<crate::job::FinishedJob>, QueueError> {
        let _ = (shard, key, max);
        Err(QueueError::Unsupported {
            what: "listing finished jobs",
        })
    }

    /// Deletes the job `id` of `shard` if it is queued, delayed or dead,
    /// atomically with respect to claims: a cancelled job never starts. A
    /// running job's run is asked to stop ([`CancelOutcome::Stopping`]): its
    /// results are refused from then, and the job is deleted when the run
    /// ends (its failure, which says its handler is over; its job lease
    /// lapsing; or a new owner finding it), never
    /// retried; the key's next job starts only after that, so the key's one
    /// run is never overlapped by a store write its handler cannot see.
    /// Needs no ownership.
    fn cancel(&self, shard: &str, id: JobId) -> Result<CancelOutcome, QueueError> {
        let _ = (shard, id);
        Err(QueueError::Unsupported {
            what: "cancelling a job",
        })
    }
}

/// Decides which shards this process may run: leases, renewal, takeover.
///
/// The pool calls [`Coordinator::tick`] regularly; the coordinator claims free
/// or lapsed shards, renews its leases and reports the shards it owns. It
/// must never run jobs itself.
pub trait Coordinator: Send {
    /// Claims and renews; returns the shards owned after this tick, with the
    /// ones newly gained (to be adopted) and lost (to be dropped at once,
    /// e.g. a lease that lapsed and was taken over, or one that could not be
    /// renewed and was given up). A transient error means nothing changed:
    /// every shard owned before is still owned. A coordinator that gives a
    /// shard up in a tick reports it in `lost`, never behind an error
    /// (except [`QueueError::StoreLost`], which stops the process).
    fn tick(&mut self) -> Result<Ownership, QueueError>;

    /// Stops claiming; further ticks only renew.
    fn stop_claiming(&mut self);

    /// Gives up every claim so others can take over without waiting for the
    /// lease to lapse.
    fn release_all(&mut self) -> Result<(), QueueError>;

    /// How often [`Coordinator::tick`] must run to keep leases alive, in ms.
    fn tick_interval_ms(&self) -> u64;

    /// A human-readable reason when nothing is owned (who owns what), for
    /// the standby message.
    fn standby_reason(&self) -> String;

    /// Most shards this process may hold at once (`usize::MAX`: no bound).
    /// A pool at this bound cannot take another shard's work, so that work
    /// does not keep it from being idle.
    fn max_shards(&self) -> usize {
        usize::MAX
    }
}

/// Result of a [`Coordinator::tick`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ownership {
    /// All shards owned now.
    pub owned: Vec<String>,
    /// Shards gained in this tick.
    pub gained: Vec<String>,
    /// Shards lost in this tick (someone else holds them now).
    pub lost: Vec<String>,
}

/// The `max` newest finished jobs of `key` over `shards` (newest first,
/// each with the shard that keeps it), and the shards whose finished jobs
/// could not be read with why: a finished job stays where it finished, so
/// after a move a key's older finished jobs are on its old shard, and a
/// reader that looked only where the key routes now would miss them.
#[allow(clippy::type_complexity)]
pub fn key_finished<B: QueueBackend + ?Sized>(
    backend: &B,
    shards: &[String],
    key: &str,
    max: usize,
) -> (
    Vec<(String, crate::job::FinishedJob)>,
    Vec<(String, QueueError)>,
) {
    let mut all = Vec::new();
    let mut failed = Vec::new();
    for shard in shards {
        match backend.finished(shard, Some(key), max) {
            Ok(list) => all.extend(list.into_iter().map(|f| (shard.clone(), f))),
            Err(e) => failed.push((shard.clone(), e)),
        }
    }
    all.sort_by_key(|(_, f)| std::cmp::Reverse(f.finished_ms));
    all.truncate(max);
    (all, failed)
}

/// [`RunJobs::ack_results`], then a fail of each receipt refused as
/// stale: a run whose job was cancelled while it ran is refused by the ack
/// but still holds its key until its job lease lapses, and the fail of its
/// receipt (refused too) ends it at once, so the key's next job may start
/// as soon as the handler is gone, whether it then succeeded or failed.
/// For a run that lapsed or already ended the fail changes nothing.
pub fn ack_ending_cancelled<B: RunJobs + ?Sized>(
    backend: &B,
    shard: &str,
    receipts: &[Receipt],
    results: &[Option<Vec<u8>>],
) -> Result<AckOutcome, QueueError> {
    let out = backend.ack_results(shard, receipts, results)?;
    for r in &out.stale {
        // Refused whatever it finds: only a cancelled run ends by it.
        let _ = backend.fail(shard, *r, "acked after its job was cancelled", None);
    }
    Ok(out)
}

/// How [`find_job`] reads a shard's finished job by id.
pub type FinishedLookup<'a> =
    dyn FnMut(&str, JobId) -> Result<Option<crate::job::FinishedJob>, QueueError> + 'a;

/// What [`find_job`] found for an id.
#[derive(Debug, Clone)]
pub enum JobLookup {
    /// Live (queued, delayed, running or dead) on the shard named.
    Live(String, crate::job::JobInfo),
    /// Finished or cancelled on the shard named, within its retention.
    Finished(String, crate::job::FinishedJob),
    /// It left with `key` in a move and no copy was found: the shard the
    /// map routes the key to now.
    Moved {
        /// Its key.
        key: String,
        /// Where the key runs now.
        shard: String,
    },
    /// Not known: finished longer ago than the retention keeps, moved
    /// longer ago than the shards remember, or never handed out.
    Unknown,
}

/// Where job `id` of `shard` is: live or finished there while the
/// retention keeps it; else, when it left with its key in a move, its copy
/// on the shard that stored it ([`follow_moves`]), live or finished there;
/// else, a move `shard` remembers with no copy found, the key and the
/// shard `routed` names for it now. `finished` reads a shard's finished
/// job by id (a caller looking many up reads each shard's list once).
/// Read-only: needs no ownership.
pub fn find_job<B: QueueBackend + ?Sized>(
    backend: &B,
    shards: &[String],
    routed: &dyn Fn(&str) -> Option<String>,
    finished: &mut FinishedLookup<'_>,
    shard: &str,
    id: JobId,
) -> Result<JobLookup, QueueError> {
    let mut here = |s: &str, id| -> Result<Option<JobLookup>, QueueError> {
        if let Some(job) = backend.job(s, id)? {
            return Ok(Some(JobLookup::Live(s.to_string(), job)));
        }
        Ok(finished(s, id)?.map(|job| JobLookup::Finished(s.to_string(), job)))
    };
    if let Some(found) = here(shard, id)? {
        return Ok(found);
    }
    // Where it went is a courtesy: a lookup that fails says no more.
    if let Ok(Some((s, copy))) = follow_moves(backend, shards, routed, shard, id) {
        // A copy that cannot be read now is answered as a move.
        if let Ok(Some(found)) = here(&s, copy) {
            return Ok(found);
        }
    }
    Ok(match backend.moved_away(shard, id).unwrap_or(None) {
        Some(key) => match routed(&key) {
            Some(now) => JobLookup::Moved { key, shard: now },
            None => JobLookup::Unknown,
        },
        None => JobLookup::Unknown,
    })
}

/// Most moves [`follow_moves`] follows from one id (a key moved back and
/// forth more often than this since the id was given is not followed).
pub const MOVE_HOPS_MAX: usize = 16;

/// Where job `id` of `shard` went when it left with its key in a move:
/// the shard that stored its copy and the copy's id, followed through
/// later moves of the copy (at most [`MOVE_HOPS_MAX`]), looking for the
/// copy on the shard `routed` names for the key first, then on each of
/// `shards` (one that cannot be read is passed over). `None` when `id` did not move away (it is
/// live or finished where it is, or unknown), or when no shard remembers
/// storing its copy ([`MoveKeys::moved_away`] and [`MoveKeys::imported_as`]
/// keep bounded histories). Read-only: needs no ownership.
pub fn follow_moves<B: QueueBackend + ?Sized>(
    backend: &B,
    shards: &[String],
    routed: &dyn Fn(&str) -> Option<String>,
    shard: &str,
    id: JobId,
) -> Result<Option<(String, JobId)>, QueueError> {
    let mut at = (shard.to_string(), id);
    let mut moved = false;
    for _ in 0..MOVE_HOPS_MAX {
        let Some(key) = backend.moved_away(&at.0, at.1)? else {
            break;
        };
        // The shard the key routes to now first (the copy is there unless
        // the key moved on), then the others; one that cannot be read is
        // passed over.
        let first = routed(&key).filter(|s| *s != at.0);
        let order = first.iter().chain(
            shards
                .iter()
                .filter(|s| **s != at.0 && Some(*s) != first.as_ref()),
        );
        let mut next = None;
        for s in order {
            if let Ok(Some(copy)) = backend.imported_as(s, &at.0, at.1) {
                next = Some((s.clone(), copy));
                break;
            }
        }
        match next {
            Some(n) => {
                at = n;
                moved = true;
            }
            None => return Ok(None),
        }
    }
    Ok(moved.then_some(at))
}

/// Finished (acked or cancelled) job `id` of `shard`, while the shard's
/// retention keeps it ([`InspectJobs::finished`]): what `job show` and
/// `GET /v1/jobs/{id}` answer for a job that is no longer live.
pub fn finished_job<B: QueueBackend + ?Sized>(
    backend: &B,
    shard: &str,
    id: JobId,
) -> Result<Option<crate::job::FinishedJob>, QueueError> {
    Ok(backend
        .finished(shard, None, crate::job::FINISHED_JOBS_KEPT_MAX)?
        .into_iter()
        .find(|f| f.id == id))
}

/// Dead letters of `shard` that a retry or purge of `ids` (`None`: every
/// one) leaves as they are because their key is moving now (sealed by a
/// rebalance; [`InspectJobs::dead_retry`] skips them): how many, and their
/// keys. Read after the change, so a caller can say what to rerun.
pub fn dead_left_moving<B: QueueBackend + ?Sized>(
    backend: &B,
    shard: &str,
    ids: Option<&[JobId]>,
) -> Result<(u64, Vec<String>), QueueError> {
    let fence = backend.fence(shard)?;
    let mut left = 0;
    let mut keys = std::collections::BTreeSet::new();
    if fence.sealed_keys.is_empty() {
        return Ok((0, Vec::new()));
    }
    match ids {
        None => {
            for key in fence.sealed_keys.keys() {
                let dead = backend.key_counts(shard, key)?.dead;
                if dead > 0 {
                    left += dead;
                    keys.insert(key.clone());
                }
            }
        }
        Some(ids) => {
            for id in ids {
                if let Some(j) = backend.job(shard, *id)? {
                    if j.state == crate::job::JobState::Dead
                        && fence.sealed_keys.contains_key(&j.key)
                    {
                        left += 1;
                        keys.insert(j.key);
                    }
                }
            }
        }
    }
    Ok((left, keys.into_iter().collect()))
}

/// The order of one claim round over `shards` (each shard once, `first`
/// the one whose turn it is), for up to `free` slots: while `backend`
/// ranks keys and there are several shards, the shards of the best-ranked
/// ready keys over all of them come first, each with its share
/// ([`crate::flow::shares_by_rank`], ties going round from `first`); then
/// the others in turn, with no share (they split what is left). `rankable`
/// says whose ranks to read (a caller skips shards that are resting). A
/// shard whose ranks cannot be read ranks [`Rank::FIRST`], so its claim
/// runs and reports why rather than busier shards hiding it.
pub fn claim_order(
    backend: &dyn QueueBackend,
    shards: &[String],
    first: usize,
    free: usize,
    rankable: impl Fn(&str) -> bool,
) -> Vec<(String, Option<usize>)> {
    let n = shards.len();
    let in_turn = (0..n).map(|i| &shards[(first + i) % n]);
    let shares = if n > 1 && backend.ranks_keys() {
        let ranks: Vec<(String, Vec<Rank>)> = (shards.iter())
            .filter(|s| rankable(s))
            .map(|s| {
                let r = (backend.ready_ranks(s, free)).unwrap_or_else(|_| vec![Rank::FIRST]);
                (s.clone(), r)
            })
            .collect();
        crate::flow::shares_by_rank(&ranks, free, first)
    } else {
        Vec::new()
    };
    let others: Vec<(String, Option<usize>)> = in_turn
        .filter(|s| !shares.iter().any(|(r, _)| r == *s))
        .map(|s| (s.clone(), None))
        .collect();
    (shares.into_iter())
        .map(|(s, k)| (s, Some(k)))
        .chain(others)
        .collect()
}
