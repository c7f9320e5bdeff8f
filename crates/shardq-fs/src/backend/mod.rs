//! [`FsBackend`]: the [`QueueBackend`] of the embedded engine, over the shard
//! logs of one data directory.
//!
//! Each shard has one in-process handle (a mutex around its log and its
//! replayed state) plus a group-commit syncer outside that mutex, so threads
//! keep appending while one of them fsyncs. With `interval` durability a
//! background flusher thread (one per backend, holding only a weak reference
//! to the shards) fsyncs whatever an idle shard left unsynced.
//!
//! A claim starts a run per job: a fence from [`next_fence`] (above the
//! shard's replayed high-water and `fence.json`'s `run_fence_min`), written
//! in the Claim record, and a job lease kept in the owner's memory. Ack, fail
//! and extend check the receipt's fence; a run whose lease lapsed is ended
//! at the next claim by a Fail record, so replay agrees. This module
//! must never route keys (callers pass the shard) nor decide ownership (the
//! coordinator does).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use shardq_core::flow::Rank;
use shardq_core::job::{keyed_meets, validate_job_lease_ms, KeyedLive, KeyedMeets, DELAY_MS_MAX};
use shardq_core::{
    AckOutcome, BackedOff, Backoff, CancelOutcome, ClaimedJob, Clock, DeadJob, DeadPolicy,
    DedupRecord, FailOutcome, Fence, Finish, FinishedJob, FlowControl, InspectJobs, JobId, JobInfo,
    JobState, KeyCounts, KeyHold, KeyResume, MoveKeys, MovedAway, MovedJob, NewJob, QueueError,
    Receipt, Retention, RetryRules, RunJobs, ShardStats, Stored, SystemClock, KEY_JOBS_MAX,
    MOVED_IDS_KEPT, MOVED_KEYS_KEPT, PAYLOAD_BYTES_LIMIT, PAYLOAD_BYTES_MAX_DEFAULT,
};
use shardq_route::validate_shard_name;

use crate::log::{Access, ShardLog, Tail, Validate, SEGMENT_BYTES_DEFAULT};
pub use crate::log::{APPEND_LOCK_FILE, APPEND_LOCK_WAIT_MS_DEFAULT};
use crate::record::{self, decode, EnqueueDedup, Record};
use crate::state::{Pick, RunFences, ShardState};
use crate::storage::{LogFile, OsStorage, Storage};

mod files;
mod inspect;
mod moves;
mod options;
mod records;
mod run;
mod sync;

pub use files::*;
pub use options::*;
use records::*;
use sync::*;

/// Most jobs in one enqueue batch.
pub const ENQUEUE_BATCH_JOBS_MAX: usize = 65_536;
/// Most bytes of records in one enqueue batch (256 MiB).
pub const ENQUEUE_BATCH_BYTES_MAX: usize = 256 << 20;
struct Inner {
    log: ShardLog,
    /// Replayed state; `None` for a process that only appends.
    replica: Option<ShardState>,
    owned: bool,
    fence: Option<(FenceStamp, Fence)>,
}

/// Builds the records of an append, given the caught-up shard and the
/// position they will start at.
type BuildRecords<'a> = dyn FnMut(&mut Inner, u64) -> Result<Vec<u8>, QueueError> + 'a;

type FenceStamp = (u64, i64, i64, u64);

struct Shard {
    name: String,
    dir: PathBuf,
    inner: Mutex<Inner>,
    sync: Syncer,
    /// [`MOVED_FILE`] as last read, with the length it had then: read again
    /// only once it changed (a lookup of an id that is not live must not
    /// parse the file each time).
    moved: Mutex<Option<(u64, Arc<MovedAway>)>>,
    /// [`MOVED_IN_FILE`] as last read, with the length it had then.
    moved_in: Mutex<Option<(u64, Arc<shardq_core::MovedIn>)>>,
    /// Held while this process appends to or cuts [`FINISHED_FILE`], so
    /// two threads never cut it at once or append into a file being cut.
    /// Held by the one writer of the finished file; the size past which
    /// it is cut next: at least [`finished_cut_bytes`], and twice what the
    /// last cut kept, so lines longer than planned still keep the whole
    /// retention and cuts stay rare.
    finished: Mutex<u64>,
}

type Shards = RwLock<BTreeMap<String, Arc<Shard>>>;

/// The embedded engine's backend. See the module docs.
pub struct FsBackend {
    dir: PathBuf,
    opts: EngineOptions,
    shards: Arc<Shards>,
    _flusher: Option<Flusher>,
}

impl std::fmt::Debug for FsBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsBackend").field("dir", &self.dir).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a shard mutex leaves the state as it was at the
    // last whole record; carrying on is no worse than restarting.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl FsBackend {
    /// A backend over the shard directories of data dir `dir`.
    pub fn new(dir: &Path, opts: EngineOptions) -> Result<FsBackend, QueueError> {
        if opts.payload_bytes_max > PAYLOAD_BYTES_LIMIT {
            return Err(QueueError::InvalidOption {
                name: "payload_bytes_max",
                value: opts.payload_bytes_max.to_string(),
                allowed: format!("at most the hard limit of {PAYLOAD_BYTES_LIMIT} bytes"),
            });
        }
        let shards: Arc<Shards> = Arc::new(RwLock::new(BTreeMap::new()));
        let flusher = match opts.durability {
            Durability::Interval { ms } => Some(spawn_flusher(
                Arc::downgrade(&shards),
                Arc::clone(&opts.clock),
                ms.max(SYNC_INTERVAL_MS_MIN),
            )?),
            // Run records (claims, acks, fails) are fsynced within
            // `run_record_sync_ms` even when the shard goes idle.
            Durability::Fsync => Some(spawn_flusher(
                Arc::downgrade(&shards),
                Arc::clone(&opts.clock),
                opts.run_record_sync_ms.max(SYNC_INTERVAL_MS_MIN),
            )?),
            Durability::None => None,
        };
        Ok(FsBackend {
            dir: dir.to_path_buf(),
            opts,
            shards,
            _flusher: flusher,
        })
    }

    /// The engine options.
    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    fn shard(&self, name: &str) -> Result<Arc<Shard>, QueueError> {
        if let Some(s) = self
            .shards
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
        {
            return Ok(Arc::clone(s));
        }
        validate_shard_name(name).map_err(|_| QueueError::UnknownShard {
            shard: name.to_string(),
        })?;
        let dir = self.dir.join(name);
        if !dir.is_dir() {
            return Err(QueueError::UnknownShard {
                shard: name.to_string(),
            });
        }
        let mut map = self.shards.write().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = map.get(name) {
            return Ok(Arc::clone(s));
        }
        let log = ShardLog::open(
            name,
            &dir,
            Arc::clone(&self.opts.storage),
            self.opts.segment_bytes_max,
            self.opts.append_lock_wait_ms,
            false,
        )?;
        let shard = Arc::new(Shard {
            name: name.to_string(),
            dir,
            inner: Mutex::new(Inner {
                log,
                replica: None,
                owned: false,
                fence: None,
            }),
            sync: Syncer {
                synced_to: Mutex::new(0),
                latest: Mutex::new(None),
                last_sync_ms: Mutex::new(self.opts.clock.now_ms()),
                failed: AtomicBool::new(false),
            },
            moved: Mutex::new(None),
            moved_in: Mutex::new(None),
            finished: Mutex::new(0),
        });
        map.insert(name.to_string(), Arc::clone(&shard));
        Ok(shard)
    }

    /// Drops this process's handle of `shard` (after a failed write, or to
    /// re-read it from scratch). The next use reopens it.
    pub fn reopen_shard(&self, name: &str) {
        self.shards
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
    }

    /// Makes everything this process appended so far durable (for
    /// `interval` and `none` before exit), but a move's copies, which
    /// [`MoveKeys::sync_imports`] makes durable.
    pub fn flush(&self) -> Result<(), QueueError> {
        let shards: Vec<Arc<Shard>> = self
            .shards
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for s in shards {
            let end = lock(&s.sync.latest).as_ref().map(|(e, _)| *e).unwrap_or(0);
            sync_shard(&s, end, &*self.opts.clock)?;
        }
        Ok(())
    }

    /// Bytes cut off as torn tails by this process, per shard.
    pub fn torn_bytes_truncated(&self, name: &str) -> Result<u64, QueueError> {
        let shard = self.shard(name)?;
        let inner = lock(&shard.inner);
        Ok(inner.log.torn_bytes_truncated)
    }

    fn sync_to(&self, shard: &Shard, end: u64) -> Result<(), QueueError> {
        sync_shard(shard, end, &*self.opts.clock)
    }

    fn after_append(&self, shard: &Shard, end: u64) -> Result<(), QueueError> {
        match self.opts.durability {
            Durability::None => Ok(()),
            Durability::Fsync => self.sync_to(shard, end),
            Durability::Interval { ms } => {
                let last = *lock(&shard.sync.last_sync_ms);
                if self.opts.clock.now_ms().saturating_sub(last) >= ms {
                    self.sync_to(shard, end)
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Gives back the group run slots of the runs `runs` (key, fence) of
    /// shard `name` that are over (or never started).
    fn runs_ended(&self, name: &str, runs: &[(&str, u64)]) {
        if let Some(f) = self.opts.flow.as_ref().filter(|_| !runs.is_empty()) {
            f.runs_ended(name, runs);
        }
    }

    /// Durability of a claim, ack or fail record: see
    /// [`EngineOptions::run_record_sync_ms`].
    fn after_run_record(&self, shard: &Shard, end: u64) -> Result<(), QueueError> {
        match self.opts.durability {
            Durability::Fsync => {
                let last = *lock(&shard.sync.last_sync_ms);
                if self.opts.clock.now_ms().saturating_sub(last) >= self.opts.run_record_sync_ms {
                    self.sync_to(shard, end)
                } else {
                    Ok(())
                }
            }
            _ => self.after_append(shard, end),
        }
    }

    /// Brings this process's replica of the shard up to date, building it
    /// from the first segment if needed.
    fn refresh(&self, inner: &mut Inner) -> Result<(), QueueError> {
        if inner.replica.is_none() {
            let log = ShardLog::open(
                &inner.log.name,
                &self.dir.join(&inner.log.name),
                Arc::clone(&self.opts.storage),
                self.opts.segment_bytes_max,
                self.opts.append_lock_wait_ms,
                true,
            )?;
            let replica = ShardState::new(log.reclaimed(), self.opts.dead_policy);
            inner.log = log;
            inner.replica = Some(replica);
        }
        let Inner { log, replica, .. } = inner;
        let replica = replica.as_mut().expect("built above");
        // A reader: it may judge bad bytes under the lock, but it never
        // truncates or creates anything (status must not change the disk).
        if log.catch_up(Access::Unlocked, replica)? == Tail::NeedsLock {
            let _guard = log.lock()?;
            log.catch_up(Access::LockedRead, replica)?;
        }
        Ok(())
    }

    /// Takes the append lock, catches up, asks `build` for the records to
    /// append (given the replica and the position they will start at),
    /// appends them and applies them. Returns the start and end positions.
    fn append_with(
        &self,
        shard: &Shard,
        inner: &mut Inner,
        build: &mut BuildRecords<'_>,
    ) -> Result<(u64, u64), QueueError> {
        self.append_records(shard, inner, build, true)
    }

    /// [`FsBackend::append_with`], with `tracked` false for a move's
    /// copies: this process's flusher and syncs then leave them to
    /// [`MoveKeys::sync_imports`], so a big copy is synced once rather
    /// than every `run_record_sync_ms`.
    fn append_records(
        &self,
        shard: &Shard,
        inner: &mut Inner,
        build: &mut BuildRecords<'_>,
        tracked: bool,
    ) -> Result<(u64, u64), QueueError> {
        let guard = inner.log.lock()?;
        {
            let Inner { log, replica, .. } = &mut *inner;
            match replica {
                Some(r) => log.catch_up(Access::LockedWrite, r)?,
                None => log.catch_up(Access::LockedWrite, &mut Validate)?,
            };
        }
        let start = inner.log.end_pos();
        let bytes = build(inner, start)?;
        if bytes.is_empty() {
            return Ok((start, start));
        }
        let file = inner.log.append_locked(&bytes)?;
        drop(guard);
        let start = inner.log.end_pos() - bytes.len() as u64;
        let end = inner.log.end_pos();
        let seg_base = inner.log.end_pos() - inner.log.cur_off();
        if let Some(r) = inner.replica.as_mut() {
            let mut p = 0usize;
            while p < bytes.len() {
                // Assert the data right after writing: we built it.
                let (rec, n) = decode(&bytes[p..]).expect("own records decode");
                r.apply(start + p as u64, seg_base, &rec)
                    .map_err(|reason| QueueError::Inconsistent {
                        shard: shard.name.clone(),
                        segment: crate::storage::segment_name(seg_base),
                        offset: start - seg_base + p as u64,
                        reason,
                    })?;
                p += n;
            }
        }
        if tracked {
            *lock(&shard.sync.latest) = Some((end, file));
        }
        Ok((start, end))
    }

    /// The first step of a claim: runs whose job lease lapsed end, each as
    /// a failed attempt (written, so replay agrees): their jobs go back to
    /// the head of their keys, or dead-letter when out of attempts; runs
    /// cancelled meanwhile (and those a previous owner left cancelled) end
    /// their jobs. Only the owner starts and ends runs, so its replica
    /// knows every run even before it reads what producers appended: with
    /// none lapsed, this step needs no lock and no read. The log positions
    /// it wrote between.
    fn end_lapsed_runs(
        &self,
        shard: &Shard,
        inner: &mut Inner,
        now: u64,
    ) -> Result<(u64, u64), QueueError> {
        let mut cancelled_done = Vec::new();
        let any_lapsed = inner
            .replica
            .as_ref()
            .is_some_and(|r| !r.lapsed(now).is_empty() || !r.cancel_pending().is_empty());
        let written = if !any_lapsed {
            let at = inner.log.end_pos();
            (at, at)
        } else {
            self.append_with(shard, inner, &mut |inner, _| {
                let r = inner.replica.as_ref().expect("owner has a replica");
                let mut bytes = Vec::new();
                cancelled_done.clear();
                // Cancelled runs a previous owner left: their jobs go now.
                for (job, key) in r.cancel_pending() {
                    if let Some(j) = r.live_job(job) {
                        cancelled_done.push(finished_job(&j, Finish::Cancelled, now));
                    }
                    record::encode(&mut bytes, &Record::Cancel { job, key });
                }
                for id in r.lapsed(now) {
                    let run = r.in_flight(id).expect("lapsed runs are in flight");
                    if run.cancelled {
                        // Its cancel takes effect now that the run is over.
                        if let Some(j) = r.live_job(id) {
                            cancelled_done.push(finished_job(&j, Finish::Cancelled, now));
                        }
                        record::encode(
                            &mut bytes,
                            &Record::Cancel {
                                job: id,
                                key: run.key,
                            },
                        );
                        continue;
                    }
                    let reason = format!(
                        "job lease lapsed at {} ms (run fence {}) without an ack, fail or extend",
                        run.lease_until_ms, run.fence
                    );
                    record::encode(
                        &mut bytes,
                        &Record::Fail {
                            job: id,
                            retry_at_ms: now,
                            dead: run.attempt >= run.max_attempts,
                            key: run.key,
                            reason: &reason,
                        },
                    );
                }
                Ok(bytes)
            })?
        };
        self.note_finished(shard, &cancelled_done);
        Ok(written)
    }

    /// A claimed job as its handler gets it: its key and payload read back
    /// from its enqueue (or import) record, checked against the replica.
    fn claimed_job(
        &self,
        shard: &Shard,
        inner: &mut Inner,
        p: &Pick,
        fence: u64,
        lease_until_ms: u64,
    ) -> Result<ClaimedJob, QueueError> {
        let name = shard.name.as_str();
        let payload_at = inner.replica.as_ref().and_then(|r| r.payload_at(p.id));
        let r = records::read_job(name, &mut inner.log, p.id, &p.key, payload_at)?;
        Ok(ClaimedJob {
            shard: name.to_string(),
            id: JobId(p.id),
            key: p.key.to_string(),
            payload: r.payload,
            attempt: p.attempt,
            max_attempts: p.max_attempts,
            created_ms: r.created_ms,
            not_before_ms: p.not_before_ms,
            fence,
            lease_until_ms,
            dedup_id: r.dedup_id,
        })
    }

    fn owned_inner<'a>(&self, shard: &'a Shard) -> Result<MutexGuard<'a, Inner>, QueueError> {
        let inner = lock(&shard.inner);
        if !inner.owned {
            return Err(QueueError::NotOwner {
                shard: shard.name.clone(),
            });
        }
        Ok(inner)
    }

    /// Writes the fence file; the caller holds the shard's append lock.
    fn write_fence_locked(&self, shard: &Shard, fence: &Fence) -> Result<(), QueueError> {
        let path = shard.dir.join(FENCE_FILE);
        let text = serde_json::to_string_pretty(fence).map_err(|e| QueueError::Internal {
            what: format!("encoding the fence as JSON: {e}"),
        })?;
        self.opts
            .storage
            .write_file_atomic(&path, text.as_bytes())
            .map_err(|e| QueueError::io(format!("writing {}", path.display()), e))
    }

    fn read_fence(&self, shard: &Shard, inner: &mut Inner) -> Result<Fence, QueueError> {
        let path = shard.dir.join(FENCE_FILE);
        let meta = match fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Fence::default()),
            Err(e) => return Err(QueueError::io(format!("reading {}", path.display()), e)),
        };
        let stamp = (meta.ino(), meta.mtime(), meta.mtime_nsec(), meta.len());
        if let Some((s, f)) = &inner.fence {
            if *s == stamp {
                return Ok(f.clone());
            }
        }
        let bytes = self
            .opts
            .storage
            .read_file(&path, FENCE_FILE_BYTES_MAX)
            .map_err(|e| QueueError::io(format!("reading {}", path.display()), e))?
            .unwrap_or_default();
        if bytes.len() as u64 > FENCE_FILE_BYTES_MAX {
            return Err(QueueError::BadFile {
                path: path.display().to_string(),
                what: "fence file",
                reason: format!("over {FENCE_FILE_BYTES_MAX} bytes"),
            });
        }
        let fence: Fence = serde_json::from_slice(&bytes).map_err(|e| QueueError::BadFile {
            path: path.display().to_string(),
            what: "fence file",
            reason: e.to_string(),
        })?;
        inner.fence = Some((stamp, fence.clone()));
        Ok(fence)
    }

    /// Reclaims finished segments (owner only; see "Compaction" in
    /// `docs/design.md`): records every sealed segment whose jobs are all
    /// finished as reclaimed, then deletes the files of reclaimed segments
    /// whose records refer only to reclaimed jobs. A failed fsync or list
    /// write poisons the log; a failed deletion leaves the file for the next
    /// round.
    fn compact(&self, inner: &mut Inner) -> Result<(), QueueError> {
        let Inner {
            log,
            replica,
            owned,
            ..
        } = inner;
        let Some(r) = replica.as_mut().filter(|_| *owned) else {
            return Ok(());
        };
        let sealed = log.sealed_segments();
        let finished: Vec<(u64, u64)> = sealed
            .iter()
            .copied()
            .filter(|&(b, e)| r.live_in_segment(b) == 0 && !log.reclaimed().covers(b, e))
            .collect();
        if !finished.is_empty() {
            // The records that finished these jobs reach the disk before the
            // list says they are finished (sealed segments already did).
            log.sync_current()?;
            // Union with the list on disk: a previous owner may have
            // recorded ranges this replica has not heard of.
            let mut next = log.reload_reclaimed()?.clone();
            for &(b, e) in &finished {
                next.insert(b, e);
            }
            // The claims in these segments may be deleted next: keep the
            // fence high-water they carried.
            next.raise_fence_high(r.fence_high());
            log.store_reclaimed(next)?;
            r.set_reclaimed(log.reclaimed());
        }
        let now = self.opts.clock.now_ms();
        let mut cursors_saved = false;
        for (b, e) in sealed {
            // A segment holding a dedup record that has not expired stays,
            // so the record survives restarts for its window.
            if log.reclaimed().covers(b, e)
                && !r.segment_refers_to_live(b)
                && r.dedup_until_ms(b) <= now
            {
                // Its Import records may be the only note of a move's
                // cursor: saved first, or the segment stays for now. The
                // log is synced before: the replica's cursors may count
                // copies a move appended and has not synced yet, and a
                // saved cursor must never run ahead of durable copies (a
                // rerun would skip the jobs a power loss took).
                if !cursors_saved && r.imported().next().is_some() {
                    if log.sync_current().is_err()
                        || self.save_import_cursors(log.dir(), r).is_err()
                    {
                        break;
                    }
                    cursors_saved = true;
                }
                if log.delete_segment(b).is_err() {
                    // Kept for now: it is recorded as reclaimed, so replay
                    // skips its jobs, and the next round deletes it.
                    break;
                }
                r.forget_segment(b);
            }
        }
        Ok(())
    }
}

/// A failure reason as a record keeps it (at most 1 KiB, cut at a char).
fn cut_reason(reason: &str) -> &str {
    let mut end = reason.len().min(1024);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// The run `receipt` names, if it is its job's current run on `r`, with
/// `key` set to its key; else the stale-receipt error, with `key` set to
/// the job's key while the job is live (its group slot goes back).
fn current_run_or_stale<'r>(
    r: &'r ShardState,
    name: &str,
    receipt: Receipt,
    key: &mut String,
) -> Result<crate::state::RunInfo<'r>, QueueError> {
    let Some(run) = r.current_run(receipt.id.0, receipt.fence) else {
        *key = r
            .live_job(receipt.id.0)
            .map(|j| j.key.to_string())
            .unwrap_or_default();
        return Err(stale(
            name,
            receipt,
            r.in_flight(receipt.id.0).map(|x| x.fence),
        ));
    };
    *key = run.key.to_string();
    Ok(run)
}

/// The error for a receipt that is not its job's current run.
fn stale(shard: &str, receipt: Receipt, current: Option<u64>) -> QueueError {
    QueueError::StaleReceipt {
        shard: shard.to_string(),
        id: receipt.id.0,
        fence: receipt.fence,
        reason: match current {
            Some(f) => format!("the job's current run has fence {f}"),
            None => {
                "the job is not in flight (finished, lapsed and ended, or adopted by a new owner)"
                    .into()
            }
        },
    }
}

/// Sorts `shard-10` after `shard-9`.
fn natural_key(name: &str) -> (String, u64) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, num) = name.split_at(name.len() - digits);
    (stem.to_string(), num.parse().unwrap_or(0))
}

impl shardq_core::reshard::KeyInventory for FsBackend {
    fn keys_with_work(&self, name: &str) -> Result<Vec<(String, KeyCounts)>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        Ok(inner.replica.as_ref().expect("refreshed").keys_with_work())
    }
}
