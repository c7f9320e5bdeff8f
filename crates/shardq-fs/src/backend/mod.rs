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
    DedupRecord, FailOutcome, Fence, Finish, FinishedJob, FlowControl, JobId, JobInfo, JobState,
    KeyCounts, KeyHold, KeyResume, MovedAway, MovedJob, NewJob, QueueBackend, QueueError, Receipt,
    Retention, RetryRules, ShardStats, Stored, SystemClock, KEY_JOBS_MAX, MOVED_IDS_KEPT,
    MOVED_KEYS_KEPT, PAYLOAD_BYTES_LIMIT, PAYLOAD_BYTES_MAX_DEFAULT,
};
use shardq_route::validate_shard_name;

use crate::log::{Access, ShardLog, Tail, Validate, SEGMENT_BYTES_DEFAULT};
pub use crate::log::{APPEND_LOCK_FILE, APPEND_LOCK_WAIT_MS_DEFAULT};
use crate::record::{self, decode, EnqueueDedup, Record};
use crate::state::{Pick, RunFences, ShardState};
use crate::storage::{LogFile, OsStorage, Storage};

mod files;
mod options;
mod records;
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
    /// [`QueueBackend::sync_imports`] makes durable.
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
    /// [`QueueBackend::sync_imports`], so a big copy is synced once rather
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

impl QueueBackend for FsBackend {
    fn limits(&self) -> shardq_core::BackendLimits {
        // The bytes bound counts the records' headers too: keep a margin
        // of 64 bytes per job below it.
        shardq_core::BackendLimits {
            enqueue_batch_jobs_max: ENQUEUE_BATCH_JOBS_MAX,
            enqueue_batch_bytes_max: ENQUEUE_BATCH_BYTES_MAX - 64 * ENQUEUE_BATCH_JOBS_MAX,
            key_concurrency_max: shardq_core::flow::KEY_CONCURRENCY_MAX,
        }
    }

    fn shard_names(&self) -> Vec<String> {
        let mut names: Vec<String> = match fs::read_dir(&self.dir) {
            Ok(rd) => rd
                .filter_map(|e| e.ok())
                .filter(|e| e.path().is_dir())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| validate_shard_name(n).is_ok())
                .collect(),
            Err(_) => Vec::new(),
        };
        names.sort_by_key(|n| natural_key(n));
        names
    }

    fn enqueue(
        &self,
        shard_name: &str,
        map_version: u64,
        jobs: &[NewJob],
    ) -> Result<Vec<JobId>, QueueError> {
        if jobs.len() > ENQUEUE_BATCH_JOBS_MAX {
            return Err(QueueError::BatchTooLarge {
                jobs: jobs.len(),
                max: ENQUEUE_BATCH_JOBS_MAX,
            });
        }
        shardq_core::job::refuse_dedup_ids(jobs)?;
        for job in jobs {
            job.validate(self.opts.payload_bytes_max)?;
        }
        let shard = self.shard(shard_name)?;
        let now = self.opts.clock.now_ms();
        let mut bytes = Vec::with_capacity(
            jobs.iter()
                .map(|j| j.payload.len() + j.key.len() + 40)
                .sum(),
        );
        let mut offsets = Vec::with_capacity(jobs.len());
        for job in jobs {
            offsets.push(bytes.len() as u64);
            record::encode(
                &mut bytes,
                &Record::Enqueue {
                    created_ms: now,
                    not_before_ms: now + job.delay_ms,
                    max_attempts: job.max_attempts,
                    key: &job.key,
                    dedup: None,
                    payload: &job.payload,
                },
            );
        }
        if bytes.len() > ENQUEUE_BATCH_BYTES_MAX {
            return Err(QueueError::BatchTooLarge {
                jobs: jobs.len(),
                max: ENQUEUE_BATCH_JOBS_MAX,
            });
        }
        let mut inner = lock(&shard.inner);
        let mut bytes = Some(bytes);
        let (start, end) = self.append_with(&shard, &mut inner, &mut |inner, _start| {
            // The fence is read under the append lock, so a fence set before
            // this point is honoured and one set after sees this batch.
            let fence = self.read_fence(&shard, inner)?;
            for job in jobs {
                fence.check(shard_name, map_version, &job.key)?;
            }
            Ok(bytes.take().unwrap_or_default())
        })?;
        drop(inner);
        self.after_append(&shard, end)?;
        Ok(offsets.into_iter().map(|o| JobId(start + o)).collect())
    }

    fn enqueue_dedup(
        &self,
        shard_name: &str,
        map_version: u64,
        jobs: &[NewJob],
        window_ms: u64,
    ) -> Result<Vec<Stored>, QueueError> {
        shardq_core::job::validate_dedup_window_ms(window_ms)?;
        if jobs.len() > ENQUEUE_BATCH_JOBS_MAX {
            return Err(QueueError::BatchTooLarge {
                jobs: jobs.len(),
                max: ENQUEUE_BATCH_JOBS_MAX,
            });
        }
        for job in jobs {
            job.validate(self.opts.payload_bytes_max)?;
        }
        let shard = self.shard(shard_name)?;
        let now = self.opts.clock.now_ms();
        let expires_ms = now.saturating_add(window_ms);
        let mut inner = lock(&shard.inner);
        // The dedup records are in the replayed state: build it (once).
        self.refresh(&mut inner)?;
        let mut out: Vec<Stored> = Vec::with_capacity(jobs.len());
        let (_, end) = self.append_with(&shard, &mut inner, &mut |inner, start| {
            let fence = self.read_fence(&shard, inner)?;
            for job in jobs {
                fence.check(shard_name, map_version, &job.key)?;
            }
            let r = inner.replica.as_mut().expect("refreshed");
            // Caught up under the append lock: no other appender can add a
            // record of these ids until this append is written.
            r.prune_dedup(now);
            out.clear();
            let mut bytes = Vec::with_capacity(
                jobs.iter()
                    .map(|j| j.payload.len() + j.key.len() + 64)
                    .sum(),
            );
            // Ids met earlier in this batch (not in the replica until it
            // is written); allocated only when a batch holds more than one.
            // Seeded at random per process: the ids are the producer's.
            let mut in_batch: HashMap<(&str, &str), u64, ahash::RandomState> =
                HashMap::with_hasher(ahash::RandomState::new());
            if jobs.len() > 1 {
                in_batch.reserve(jobs.len());
            }
            // Keyed jobs stored earlier in this batch, the newest per id.
            let mut keyed_batch: HashMap<(&str, &str), KeyedLive, ahash::RandomState> =
                HashMap::with_hasher(ahash::RandomState::new());
            for job in jobs {
                let mut not_before_ms = now + job.delay_ms;
                if let (Some(mode), Some(d)) = (job.keyed, job.dedup_id.as_deref()) {
                    let live = keyed_batch
                        .get(&(job.key.as_str(), d))
                        .copied()
                        .or_else(|| r.keyed_live(&job.key, d));
                    match keyed_meets(mode, live, job.delay_ms, now) {
                        KeyedMeets::Duplicate(id) => {
                            out.push(Stored {
                                id,
                                shard: shard_name.to_string(),
                                duplicate: true,
                            });
                            continue;
                        }
                        KeyedMeets::Debounce {
                            job: waiting,
                            not_before_ms,
                        } => {
                            if fence.sealed_keys.contains_key(&job.key) {
                                // Its copy on the new shard would miss the
                                // payload: the producer waits for the move.
                                return Err(QueueError::Paused {
                                    shard: shard_name.to_string(),
                                    key: job.key.clone(),
                                });
                            }
                            record::encode(
                                &mut bytes,
                                &Record::Debounce {
                                    job: waiting.0,
                                    not_before_ms,
                                    key: &job.key,
                                    payload: &job.payload,
                                },
                            );
                            out.push(Stored {
                                id: waiting,
                                shard: shard_name.to_string(),
                                duplicate: false,
                            });
                            continue;
                        }
                        KeyedMeets::Store {
                            not_before_ms: start,
                        } => not_before_ms = start,
                    }
                } else if let Some(d) = job.dedup_id.as_deref() {
                    let known = r
                        .dedup_lookup(&job.key, d, now)
                        .map(|e| (e.job, e.shard.as_deref().unwrap_or(shard_name).to_string()));
                    let known = known.or_else(|| {
                        in_batch
                            .get(&(job.key.as_str(), d))
                            .map(|&id| (id, shard_name.to_string()))
                    });
                    if let Some((id, on)) = known {
                        out.push(Stored {
                            id: JobId(id),
                            shard: on,
                            duplicate: true,
                        });
                        continue;
                    }
                }
                let pos = start + bytes.len() as u64;
                // The dedup id is a field of its job's record: one append,
                // one checksum, so neither exists without the other.
                // A keyed id leaves no dedup record (it answers while its
                // job lives): written as expired.
                let expires_ms = if job.keyed.is_some() { now } else { expires_ms };
                record::encode(
                    &mut bytes,
                    &Record::Enqueue {
                        created_ms: now,
                        not_before_ms,
                        max_attempts: job.max_attempts,
                        key: &job.key,
                        dedup: job
                            .dedup_id
                            .as_deref()
                            .map(|id| EnqueueDedup { id, expires_ms }),
                        payload: &job.payload,
                    },
                );
                if let Some(d) = job.dedup_id.as_deref() {
                    if job.keyed.is_some() {
                        let live = KeyedLive {
                            job: JobId(pos),
                            created_ms: now,
                            running: false,
                        };
                        keyed_batch.insert((job.key.as_str(), d), live);
                    } else if jobs.len() > 1 {
                        in_batch.insert((job.key.as_str(), d), pos);
                    }
                }
                out.push(Stored {
                    id: JobId(pos),
                    shard: shard_name.to_string(),
                    duplicate: false,
                });
            }
            if bytes.len() > ENQUEUE_BATCH_BYTES_MAX {
                return Err(QueueError::BatchTooLarge {
                    jobs: jobs.len(),
                    max: ENQUEUE_BATCH_JOBS_MAX,
                });
            }
            Ok(bytes)
        })?;
        drop(inner);
        self.after_append(&shard, end)?;
        Ok(out)
    }

    fn dedup_export(&self, name: &str, key: &str) -> Result<Vec<DedupRecord>, QueueError> {
        let shard = self.shard(name)?;
        let now = self.opts.clock.now_ms();
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let r = inner.replica.as_ref().expect("refreshed");
        Ok(r.dedup_records(Some(key), now)
            .into_iter()
            .map(|(k, id, e)| DedupRecord {
                key: k.to_string(),
                id: id.to_string(),
                shard: e.shard.as_deref().unwrap_or(name).to_string(),
                job: JobId(e.job),
                expires_ms: e.expires_ms,
            })
            .collect())
    }

    fn dedup_import(&self, name: &str, records: &[DedupRecord]) -> Result<(), QueueError> {
        for rec in records {
            shardq_core::validate_key(&rec.key)?;
            shardq_core::job::validate_dedup_id(&rec.key, &rec.id)?;
            validate_shard_name(&rec.shard).map_err(|e| QueueError::InvalidOption {
                name: "dedup record shard",
                value: format!("{:?} (key {:?})", rec.shard, rec.key),
                allowed: e,
            })?;
        }
        let shard = self.shard(name)?;
        let now = self.opts.clock.now_ms();
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let (_, end) = self.append_with(&shard, &mut inner, &mut |inner, _start| {
            let r = inner.replica.as_ref().expect("refreshed");
            let mut bytes = Vec::new();
            let mut seen = std::collections::HashSet::new();
            for rec in records {
                // Judged under the append lock: a live record here is kept.
                if rec.expires_ms <= now
                    || r.dedup_lookup(&rec.key, &rec.id, now).is_some()
                    || !seen.insert((rec.key.as_str(), rec.id.as_str()))
                {
                    continue;
                }
                record::encode(
                    &mut bytes,
                    &Record::Dedup {
                        job: rec.job.0,
                        expires_ms: rec.expires_ms,
                        key: &rec.key,
                        id: &rec.id,
                        shard: if rec.shard == name { "" } else { &rec.shard },
                    },
                );
            }
            Ok(bytes)
        })?;
        drop(inner);
        self.after_append(&shard, end)
    }

    fn dedup_keys(&self, name: &str) -> Result<Vec<String>, QueueError> {
        let shard = self.shard(name)?;
        let now = self.opts.clock.now_ms();
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let r = inner.replica.as_ref().expect("refreshed");
        let keys: std::collections::BTreeSet<String> = r
            .dedup_records(None, now)
            .into_iter()
            .map(|(k, _, _)| k.to_string())
            .collect();
        Ok(keys.into_iter().collect())
    }

    fn adopt(&self, name: &str) -> Result<(), QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        // A previous owner may have reclaimed ranges this replica has not
        // stepped over yet.
        let reclaimed = inner.log.reload_reclaimed()?.clone();
        let r = inner.replica.as_mut().expect("refreshed");
        r.set_reclaimed(&reclaimed);
        r.reset_in_flight();
        inner.owned = true;
        if self.opts.retention.finished_jobs == 0 {
            // No history kept: none is left on disk either.
            let _ = self.opts.storage.remove(&shard.dir.join(FINISHED_FILE));
        }
        Ok(())
    }

    fn release(&self, name: &str) -> Result<(), QueueError> {
        let shard = self.shard(name)?;
        lock(&shard.inner).owned = false;
        Ok(())
    }

    fn claim(&self, name: &str, max: usize, lease_ms: u64) -> Result<Vec<ClaimedJob>, QueueError> {
        validate_job_lease_ms(lease_ms)?;
        let shard = self.shard(name)?;
        let mut inner = self.owned_inner(&shard)?;
        let now = self.opts.clock.now_ms();
        if let Some(f) = &self.opts.flow {
            f.refresh(now);
        }
        // Runs whose job lease lapsed end first.
        let (lapse_start, mut end) = self.end_lapsed_runs(&shard, &mut inner, now)?;
        let mut picks: Vec<(Pick, u64)> = Vec::new();
        let lease_until_ms = now.saturating_add(lease_ms);
        let res = self.append_with(&shard, &mut inner, &mut |inner, _| {
            let fence = self.read_fence(&shard, inner)?;
            let floor = fence.run_fence_min;
            let sealed = |k: &str| fence.sealed_keys.contains_key(k);
            let r = inner.replica.as_mut().expect("owner has a replica");
            let mut runs = RunFences {
                shard: name,
                lease_until_ms,
                now_us: now.saturating_mul(1000),
                last: r.fence_high(),
                floor,
            };
            picks = r
                .pick(now, &mut runs, max, &sealed, self.opts.flow.as_deref())
                .into_iter()
                .map(|p| {
                    let fence = p.fence;
                    (p, fence)
                })
                .collect();
            let mut bytes = Vec::with_capacity(picks.len() * 40);
            for (p, fence) in &picks {
                record::encode(
                    &mut bytes,
                    &Record::Claim {
                        job: p.id,
                        attempt: p.attempt,
                        fence: *fence,
                        started_ms: now,
                        key: &p.key,
                    },
                );
            }
            Ok(bytes)
        });
        let mut wrote = end > lapse_start;
        match res {
            Ok((s, e)) => {
                wrote |= e > s;
                end = end.max(e);
            }
            Err(e) => {
                if let Some(r) = inner.replica.as_mut() {
                    let only: Vec<Pick> = picks.iter().map(|(p, _)| p.clone()).collect();
                    r.unpick(&only);
                }
                // Not started: their group slots go back.
                let runs: Vec<(&str, u64)> = picks.iter().map(|(p, f)| (&*p.key, *f)).collect();
                self.runs_ended(name, &runs);
                return Err(e);
            }
        };
        let mut out = Vec::with_capacity(picks.len());
        for (p, fence) in &picks {
            inner
                .replica
                .as_mut()
                .expect("owner has a replica")
                .set_lease(p.id, lease_until_ms);
            out.push(self.claimed_job(&shard, &mut inner, p, *fence, lease_until_ms)?);
        }
        drop(inner);
        if wrote {
            self.after_run_record(&shard, end)?;
        }
        Ok(out)
    }

    fn ack(&self, name: &str, receipts: &[Receipt]) -> Result<AckOutcome, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = self.owned_inner(&shard)?;
        let mut outcome = AckOutcome::default();
        let now = self.opts.clock.now_ms();
        // No history kept: nothing to gather per acked job.
        let keep_history = self.opts.retention.finished_jobs > 0;
        let mut finished = Vec::new();
        let mut ended: Vec<(String, u64)> = Vec::new();
        let slots = self.opts.flow.as_ref().is_some_and(|f| f.limits_starts());
        let (start, end) = self.append_with(&shard, &mut inner, &mut |inner, _| {
            let r = inner.replica.as_ref().expect("owner has a replica");
            outcome = AckOutcome::default();
            finished.clear();
            ended.clear();
            let mut done: Vec<u64> = Vec::new();
            let mut bytes = Vec::with_capacity(receipts.len() * 24);
            for rc in receipts {
                // A receipt given twice in one batch finishes its run once.
                match r.current_run(rc.id.0, rc.fence) {
                    Some(run) if !done.contains(&rc.id.0) => {
                        if let Some(j) = r.live_job(rc.id.0).filter(|_| keep_history) {
                            finished.push(finished_job(&j, Finish::Completed, now));
                        }
                        record::encode(
                            &mut bytes,
                            &Record::Ack {
                                job: rc.id.0,
                                key: run.key,
                            },
                        );
                        done.push(rc.id.0);
                        if slots {
                            ended.push((run.key.to_string(), rc.fence));
                        }
                    }
                    _ => {
                        // Over (cancelled, lapsed, ended): its slot goes too.
                        if let Some(j) = r.live_job(rc.id.0).filter(|_| slots) {
                            ended.push((j.key.to_string(), rc.fence));
                        }
                        outcome.stale.push(*rc)
                    }
                }
            }
            outcome.acked = done.len() as u64;
            Ok(bytes)
        })?;
        let ended: Vec<(&str, u64)> = ended.iter().map(|(k, f)| (k.as_str(), *f)).collect();
        if end > start {
            let compacted = self.compact(&mut inner);
            drop(inner);
            // Written: the runs are over whatever the sync says.
            self.runs_ended(name, &ended);
            compacted?;
            self.after_run_record(&shard, end)?;
            // After the acks are written (and, once synced, durable): a
            // history line never stands for an ack that failed.
            self.note_finished(&shard, &finished);
        } else {
            drop(inner);
            self.runs_ended(name, &ended);
        }
        Ok(outcome)
    }

    fn fail(
        &self,
        name: &str,
        receipt: Receipt,
        reason: &str,
        retry_in_ms: Option<u64>,
    ) -> Result<FailOutcome, QueueError> {
        if let Some(ms) = retry_in_ms.filter(|&ms| ms > DELAY_MS_MAX) {
            return Err(QueueError::InvalidDelay {
                delay_ms: ms,
                max: DELAY_MS_MAX,
            });
        }
        let shard = self.shard(name)?;
        let mut inner = self.owned_inner(&shard)?;
        let now = self.opts.clock.now_ms();
        let reason = shardq_core::job::cut_at_char(reason, shardq_core::job::FAIL_REASON_BYTES_MAX);
        let mut outcome = FailOutcome::Dead;
        let mut key = String::new();
        let mut cancelled = None;
        let res = self.append_with(&shard, &mut inner, &mut |inner, _| {
            let r = inner.replica.as_ref().expect("owner has a replica");
            cancelled = None;
            if let Some(run) = (r.in_flight(receipt.id.0))
                .filter(|run| run.cancelled && run.fence == receipt.fence)
            {
                // The run a cancel stopped, over now that its handler
                // failed: its job goes at once (as when its lease lapses),
                // so the key's next job need not wait for the lease.
                key = run.key.to_string();
                cancelled = r
                    .live_job(receipt.id.0)
                    .map(|j| finished_job(&j, Finish::Cancelled, now));
                let mut bytes = Vec::new();
                record::encode(
                    &mut bytes,
                    &Record::Cancel {
                        job: receipt.id.0,
                        key: run.key,
                    },
                );
                return Ok(bytes);
            }
            let run = current_run_or_stale(r, name, receipt, &mut key)?;
            let dead = run.attempt >= run.max_attempts;
            let delay = retry_in_ms.unwrap_or_else(|| {
                let backoff = (self.opts.retry_rules.for_key(run.key))
                    .map_or(self.opts.backoff, |p| p.backoff);
                backoff.delay_for(run.attempt, shardq_core::job::run_seed(receipt))
            });
            let retry_at_ms = now.saturating_add(delay);
            outcome = if dead {
                FailOutcome::Dead
            } else {
                FailOutcome::Retry { at_ms: retry_at_ms }
            };
            let mut bytes = Vec::new();
            record::encode(
                &mut bytes,
                &Record::Fail {
                    job: receipt.id.0,
                    retry_at_ms,
                    dead,
                    key: run.key,
                    reason,
                },
            );
            Ok(bytes)
        });
        drop(inner);
        if !key.is_empty() && matches!(res, Ok(_) | Err(QueueError::StaleReceipt { .. })) {
            self.runs_ended(name, &[(&key, receipt.fence)]);
        }
        let (_, end) = res?;
        self.after_run_record(&shard, end)?;
        if let Some(job) = cancelled {
            self.note_finished(&shard, &[job]);
            return Err(QueueError::StaleReceipt {
                shard: name.to_string(),
                id: receipt.id.0,
                fence: receipt.fence,
                reason: "the job was cancelled while it ran".into(),
            });
        }
        Ok(outcome)
    }

    fn ranks_keys(&self) -> bool {
        self.opts.flow.as_ref().is_some_and(|f| f.ranks_keys())
    }

    fn limits_starts(&self) -> bool {
        self.opts.flow.as_ref().is_some_and(|f| f.limits_starts())
    }

    fn key_concurrency(&self, key: &str) -> u32 {
        self.opts.flow.as_ref().map_or(1, |f| f.concurrency_of(key))
    }

    fn ready_ranks(&self, name: &str, max: usize) -> Result<Vec<Rank>, QueueError> {
        let Some(flow) = self.opts.flow.as_deref().filter(|f| f.ranks_keys()) else {
            return Ok(Vec::new());
        };
        let shard = self.shard(name)?;
        let mut inner = self.owned_inner(&shard)?;
        let now = self.opts.clock.now_ms();
        flow.refresh(now);
        // What producers appended since counts: read up to the log's end.
        self.refresh(&mut inner)?;
        let fence = self.read_fence(&shard, &mut inner)?;
        let sealed = |k: &str| fence.sealed_keys.contains_key(k);
        let r = inner.replica.as_mut().expect("owner has a replica");
        Ok(r.ranks(now, max, &sealed, flow))
    }

    fn back_off(
        &self,
        name: &str,
        receipt: Receipt,
        retry_in_ms: u64,
        group: bool,
    ) -> Result<BackedOff, QueueError> {
        shardq_core::flow::validate_backoff_ms(retry_in_ms)?;
        let shard = self.shard(name)?;
        let mut inner = self.owned_inner(&shard)?;
        let at_ms = self.opts.clock.now_ms().saturating_add(retry_in_ms);
        let mut key = String::new();
        let res = self.append_with(&shard, &mut inner, &mut |inner, _| {
            let r = inner.replica.as_ref().expect("owner has a replica");
            let run = current_run_or_stale(r, name, receipt, &mut key)?;
            let mut bytes = Vec::new();
            record::encode(
                &mut bytes,
                &Record::BackOff {
                    job: receipt.id.0,
                    retry_at_ms: at_ms,
                    key: run.key,
                },
            );
            Ok(bytes)
        });
        drop(inner);
        if !key.is_empty() && matches!(res, Ok(_) | Err(QueueError::StaleReceipt { .. })) {
            self.runs_ended(name, &[(&key, receipt.fence)]);
        }
        let (_, end) = res?;
        self.after_run_record(&shard, end)?;
        let held = match (&self.opts.flow, group) {
            (Some(f), true) => f.hold_group_of(&key, at_ms),
            _ => None,
        };
        Ok(BackedOff { at_ms, group: held })
    }

    fn key_hold(&self, name: &str, key: &str) -> Result<Option<KeyHold>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let now = self.opts.clock.now_ms();
        let r = inner.replica.as_ref().expect("refreshed");
        Ok(r.key_hold(key, now))
    }

    fn resume_key(&self, name: &str, key: &str) -> Result<KeyResume, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let mut outcome = KeyResume::NotHeld;
        // Read and written under the append lock: no claim of the key's
        // jobs comes between.
        let (_, end) = self.append_with(&shard, &mut inner, &mut |inner, _| {
            let fence = self.read_fence(&shard, inner)?;
            let r = inner.replica.as_ref().expect("refreshed");
            let now = self.opts.clock.now_ms();
            let mut bytes = Vec::new();
            outcome = if fence.sealed_keys.contains_key(key) {
                KeyResume::Moving
            } else {
                match r.key_hold(key, now) {
                    None => KeyResume::NotHeld,
                    Some(hold) => {
                        for id in &hold.jobs {
                            record::encode(
                                &mut bytes,
                                &Record::Resume {
                                    job: id.0,
                                    at_ms: now,
                                    key,
                                },
                            );
                        }
                        KeyResume::Resumed(hold)
                    }
                }
            };
            Ok(bytes)
        })?;
        drop(inner);
        self.after_append(&shard, end)?;
        Ok(outcome)
    }

    fn extend(
        &self,
        name: &str,
        receipts: &[Receipt],
        lease_ms: u64,
    ) -> Result<Vec<Receipt>, QueueError> {
        validate_job_lease_ms(lease_ms)?;
        let shard = self.shard(name)?;
        let mut inner = self.owned_inner(&shard)?;
        let until = self.opts.clock.now_ms().saturating_add(lease_ms);
        let r = inner.replica.as_mut().expect("owner has a replica");
        // Leases live in the owner's memory only: a new owner ends every
        // replayed run at adopt, so there is nothing to write. A lapsed run
        // is still current until the next claim ends it.
        let mut stale = Vec::new();
        let mut renewed: Vec<(String, u64)> = Vec::new();
        let slots = self.opts.flow.as_ref().filter(|f| f.limits_starts());
        for rc in receipts {
            if let Some(run) = r.current_run(rc.id.0, rc.fence) {
                if slots.is_some() {
                    renewed.push((run.key.to_string(), rc.fence));
                }
                r.set_lease(rc.id.0, until);
            } else {
                stale.push(*rc);
            }
        }
        drop(inner);
        if let Some(f) = slots.filter(|_| !renewed.is_empty()) {
            let runs: Vec<(&str, u64)> = renewed.iter().map(|(k, f)| (k.as_str(), *f)).collect();
            f.runs_extended(name, &runs, until);
        }
        Ok(stale)
    }

    fn next_due_ms(&self, name: &str) -> Result<Option<u64>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        Ok(inner.replica.as_mut().and_then(|r| r.next_due_ms()))
    }

    fn key_counts(&self, name: &str, key: &str) -> Result<KeyCounts, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        Ok(inner.replica.as_ref().expect("refreshed").key_counts(key))
    }

    fn shard_stats(&self, name: &str) -> Result<ShardStats, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let now = self.opts.clock.now_ms();
        Ok(inner.replica.as_ref().expect("refreshed").stats(name, now))
    }

    fn fence(&self, name: &str) -> Result<Fence, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.read_fence(&shard, &mut inner)
    }

    fn set_fence(&self, name: &str, fence: &Fence) -> Result<(), QueueError> {
        let shard = self.shard(name)?;
        let inner = lock(&shard.inner);
        // Written under the append lock: no enqueue is between its fence
        // check and its append while the fence changes.
        let _guard = inner.log.lock()?;
        self.write_fence_locked(&shard, fence)
    }

    fn dead_list(&self, name: &str, limit: usize) -> Result<Vec<DeadJob>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        Ok(inner
            .replica
            .as_ref()
            .expect("refreshed")
            .dead_list(name, limit))
    }

    fn dead_retry(&self, name: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.dead_change(name, ids, true)
    }

    fn dead_purge(&self, name: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.dead_change(name, ids, false)
    }

    fn job(&self, name: &str, id: JobId) -> Result<Option<JobInfo>, QueueError> {
        let shard = self.shard(name)?;
        let now = self.opts.clock.now_ms();
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let Inner { log, replica, .. } = &mut *inner;
        let r = replica.as_ref().expect("refreshed");
        match r.live_job(id.0) {
            Some(j) => Ok(Some(job_info(name, log, &j, now)?)),
            None => Ok(None),
        }
    }

    fn key_jobs(&self, name: &str, key: &str, max: usize) -> Result<Vec<JobInfo>, QueueError> {
        let shard = self.shard(name)?;
        let now = self.opts.clock.now_ms();
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let Inner { log, replica, .. } = &mut *inner;
        let r = replica.as_ref().expect("refreshed");
        r.key_live_jobs(key, max.min(KEY_JOBS_MAX))
            .iter()
            .map(|j| job_info(name, log, j, now))
            .collect()
    }

    fn cancel(&self, name: &str, id: JobId) -> Result<CancelOutcome, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let mut outcome = CancelOutcome::NotFound;
        let now = self.opts.clock.now_ms();
        let mut finished = None;
        let (_, end) = self.append_with(&shard, &mut inner, &mut |inner, _| {
            let fence = self.read_fence(&shard, inner)?;
            let r = inner.replica.as_ref().expect("refreshed");
            let mut bytes = Vec::new();
            let live = r.live_job(id.0);
            finished = (live.as_ref())
                .filter(|j| j.run.is_none())
                .map(|j| finished_job(j, Finish::Cancelled, now));
            outcome = match live {
                None => CancelOutcome::NotFound,
                Some(j) if j.run.is_some() => {
                    let (fence, _) = j.run.expect("a run");
                    // Asked to stop: a second cancel writes nothing more.
                    if r.current_run(id.0, fence).is_some() {
                        record::encode(&mut bytes, &Record::CancelRun { job: id.0, fence });
                    }
                    CancelOutcome::Stopping
                }
                Some(j) if fence.sealed_keys.contains_key(j.key) => CancelOutcome::Moving,
                Some(j) if j.dead => {
                    record::encode(&mut bytes, &Record::DeadPurge { job: id.0 });
                    CancelOutcome::Cancelled
                }
                Some(j) => {
                    record::encode(
                        &mut bytes,
                        &Record::Cancel {
                            job: id.0,
                            key: j.key,
                        },
                    );
                    CancelOutcome::Cancelled
                }
            };
            Ok(bytes)
        })?;
        drop(inner);
        self.after_append(&shard, end)?;
        if outcome == CancelOutcome::Cancelled {
            self.note_finished(&shard, finished.as_slice());
        }
        Ok(outcome)
    }

    fn finished(
        &self,
        name: &str,
        key: Option<&str>,
        max: usize,
    ) -> Result<Vec<FinishedJob>, QueueError> {
        let shard = self.shard(name)?;
        let now = self.opts.clock.now_ms();
        let keep = self.opts.retention;
        let path = shard.dir.join(FINISHED_FILE);
        // The whole file up to its bound: a cut leaves the retention's
        // count of lines, however long they are.
        let bytes = self
            .read_tail(
                &path,
                2 * FINISHED_FILE_BYTES_MAX.max(finished_cut_bytes(keep))
                    + FINISHED_BATCH_BYTES_MAX,
            )
            .map_err(|e| QueueError::io(format!("reading {}", path.display()), e))?;
        // Newest first, parsing only the lines the retention keeps; a line
        // that does not parse (torn by a crash, damaged) is skipped.
        Ok(bytes
            .rsplit(|&b| b == b'\n')
            .filter_map(|line| serde_json::from_slice::<FinishedJob>(line).ok())
            .take(keep.finished_jobs)
            .filter(|f| keep.keeps(f.finished_ms, now))
            .filter(|f| key.is_none_or(|k| f.key == k))
            .take(max)
            .collect())
    }

    fn export_jobs(
        &self,
        name: &str,
        key: &str,
        after: Option<JobId>,
        max: usize,
    ) -> Result<Vec<MovedJob>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let picked: Vec<(crate::state::Slot, Option<String>)> = inner
            .replica
            .as_ref()
            .expect("refreshed")
            .key_jobs(key, after.map(|a| a.0), max)
            .into_iter()
            .map(|(s, reason)| (s, reason.map(str::to_string)))
            .collect();
        let replica = inner.replica.as_ref().expect("refreshed");
        let payload_ats: Vec<Option<u64>> = picked
            .iter()
            .map(|(slot, _)| replica.payload_at(slot.id))
            .collect();
        let places = picked
            .iter()
            .map(|(slot, _)| inner.log.locate(slot.id))
            .collect::<Result<Vec<_>, _>>()?;
        let payload_places = payload_ats
            .iter()
            .map(|at| {
                at.map(|at| inner.log.locate(at).map(|p| (at, p)))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        // The payloads are read without the shard's lock, so enqueues and
        // claims go on meanwhile: a sealed key's records stay where they
        // are (none of its jobs finishes while it is sealed, so no
        // compaction drops them, and the handles outlive a deleted file).
        drop(inner);
        let mut out = Vec::with_capacity(picked.len());
        for (((slot, dead), at), payload) in picked.into_iter().zip(places).zip(payload_places) {
            let mut r = job_of_record(name, &at.read()?, slot.id, key)?;
            if let Some((pos, place)) = payload {
                r.payload = debounced_payload(name, &place.read()?, pos, slot.id)?;
            }
            out.push(MovedJob {
                id: JobId(slot.id),
                created_ms: r.created_ms,
                not_before_ms: slot.not_before_ms,
                attempt: slot.attempt,
                max_attempts: slot.max_attempts,
                payload: r.payload,
                dead,
                dedup_id: r.dedup_id,
            });
        }
        Ok(out)
    }

    fn import_jobs(
        &self,
        name: &str,
        from: &str,
        key: &str,
        jobs: &[MovedJob],
    ) -> Result<Vec<(JobId, JobId)>, QueueError> {
        shardq_core::backend::import_jobs_by_many(self, name, from, key, jobs)
    }

    fn import_many(
        &self,
        name: &str,
        from: &str,
        items: &[(String, Vec<MovedJob>)],
    ) -> Result<Vec<(String, JobId, JobId)>, QueueError> {
        validate_shard_name(from).map_err(|reason| QueueError::InvalidOption {
            name: "source shard",
            value: format!("{from:?}"),
            allowed: reason,
        })?;
        for (key, jobs) in items {
            shardq_core::validate_key(key)?;
            for j in jobs {
                if j.payload.len() > PAYLOAD_BYTES_LIMIT {
                    return Err(QueueError::PayloadTooLarge {
                        key: key.to_string(),
                        bytes: j.payload.len(),
                        max: PAYLOAD_BYTES_LIMIT,
                    });
                }
                if let Some(d) = &j.dedup_id {
                    shardq_core::job::validate_dedup_id(key, d)?;
                }
            }
        }
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let transfers = self.read_transfers(&shard.dir)?;
        let on_file = |key: &str| {
            transfers
                .iter()
                .find(|t| t.from == from && t.key == key)
                .map(|t| t.up_to)
        };
        let cursors: Vec<Option<u64>> = items.iter().map(|(k, _)| on_file(k)).collect();
        // Every job to store, in order: (item, job).
        let all: Vec<(usize, &MovedJob)> = items
            .iter()
            .enumerate()
            .flat_map(|(i, (_, jobs))| jobs.iter().map(move |j| (i, j)))
            .collect();
        let mut out: Vec<(String, JobId, JobId)> = Vec::new();
        // One append per slice of at most ENQUEUE_BATCH_BYTES_MAX.
        let mut rest = &all[..];
        while !rest.is_empty() {
            let mut taken = 0usize;
            let mut size = 0usize;
            while taken < rest.len()
                && (taken == 0
                    || size + rest[taken].1.payload.len() + 256 <= ENQUEUE_BATCH_BYTES_MAX)
            {
                size += rest[taken].1.payload.len() + 256;
                taken += 1;
            }
            let (slice, tail) = rest.split_at(taken);
            rest = tail;
            let mut stored: Vec<(String, JobId, JobId)> = Vec::new();
            let mut build = |inner: &mut Inner, start: u64| {
                let r = inner.replica.as_ref().expect("refreshed");
                stored.clear();
                let mut bytes = Vec::new();
                for &(i, j) in slice {
                    let key = items[i].0.as_str();
                    let cursor = r.imported_up_to(from, key).max(cursors[i]);
                    if cursor.is_some_and(|c| j.id.0 <= c) {
                        continue;
                    }
                    let pos = start + bytes.len() as u64;
                    record::encode(
                        &mut bytes,
                        &Record::Import {
                            source_id: j.id.0,
                            created_ms: j.created_ms,
                            not_before_ms: j.not_before_ms,
                            attempt: j.attempt,
                            max_attempts: j.max_attempts,
                            dead: j.dead.is_some(),
                            from,
                            key,
                            reason: cut_reason(j.dead.as_deref().unwrap_or("")),
                            dedup_id: j.dedup_id.as_deref().unwrap_or(""),
                            payload: &j.payload,
                        },
                    );
                    stored.push((key.to_string(), j.id, JobId(pos)));
                }
                Ok(bytes)
            };
            self.append_records(&shard, &mut inner, &mut build, false)?;
            out.extend(stored);
        }
        // Written, not yet synced: a move makes a whole backlog's copies
        // durable at once ([`QueueBackend::sync_imports`]) before it deletes
        // the sources, instead of an fsync per chunk, which every fsync of
        // the shards' producers would queue behind. Their cursors are in the
        // Import records; compaction saves them to the transfers file before
        // it deletes a segment holding any.
        Ok(out)
    }

    fn sync_imports(&self, name: &str) -> Result<(), QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        // Whoever appended them (this process, or one a rerun replaces): a
        // sealed segment was synced by its roller, or by the writer that
        // went on past a roller that died, so syncing the current one makes
        // every copy durable.
        self.refresh(&mut inner)?;
        inner.log.sync_current()
    }

    fn imported_up_to(
        &self,
        name: &str,
        from: &str,
        key: &str,
    ) -> Result<Option<JobId>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let replayed = inner
            .replica
            .as_ref()
            .expect("refreshed")
            .imported_up_to(from, key);
        let on_file = self
            .read_transfers(&shard.dir)?
            .into_iter()
            .find(|t| t.from == from && t.key == key)
            .map(|t| t.up_to);
        Ok(replayed.max(on_file).map(JobId))
    }

    fn moved_away(&self, name: &str, id: JobId) -> Result<Option<String>, QueueError> {
        let shard = self.shard(name)?;
        let path = shard.dir.join(MOVED_FILE);
        let len = match self.opts.storage.open(&path, false) {
            Ok(file) => file
                .len()
                .map_err(|e| QueueError::io(format!("reading {}", path.display()), e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(QueueError::io(format!("reading {}", path.display()), e)),
        };
        let cached = lock(&shard.moved)
            .as_ref()
            .filter(|(at, _)| *at == len)
            .map(|(_, m)| Arc::clone(m));
        let moved = match cached {
            Some(m) => m,
            None => {
                let mut m = MovedAway::default();
                for line in self.read_moved(&shard)? {
                    m.note(&line.key, line.ids);
                }
                let m = Arc::new(m);
                *lock(&shard.moved) = Some((len, Arc::clone(&m)));
                m
            }
        };
        Ok(moved.key_of(id.0).map(str::to_string))
    }

    fn freeze_caught_up(
        &self,
        name: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<String>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let mut out = Vec::new();
        // Checked and written under the append lock, with the replica caught
        // up to the log's end: no enqueue lands between the two.
        self.append_with(&shard, &mut inner, &mut |inner, _| {
            let mut fence = self.read_fence(&shard, inner)?;
            let r = inner.replica.as_ref().expect("refreshed");
            out.clear();
            for (key, after) in items {
                if fence.sealed_keys.contains_key(key)
                    && r.key_jobs(key, after.map(|a| a.0), 1).is_empty()
                {
                    fence.paused_keys.insert(key.clone());
                    out.push(key.clone());
                }
            }
            if !out.is_empty() {
                self.write_fence_locked(&shard, &fence)?;
            }
            Ok(Vec::new())
        })?;
        Ok(out)
    }

    fn purge_key(&self, name: &str, key: &str) -> Result<u64, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        // The ids it deletes are remembered first (a purge that then fails
        // leaves ids that are still live, which a lookup finds live first).
        let ids: Vec<u64> = inner
            .replica
            .as_ref()
            .expect("refreshed")
            .key_jobs(key, None, usize::MAX)
            .iter()
            .map(|(slot, _)| slot.id)
            .collect();
        if !ids.is_empty() {
            self.note_moved(
                &shard,
                MovedLine {
                    key: key.to_string(),
                    ids,
                },
            )?;
        }
        let mut count = 0u64;
        let (_, end) = self.append_with(&shard, &mut inner, &mut |inner, _| {
            let c = inner.replica.as_ref().expect("refreshed").key_counts(key);
            count = c.depth + c.dead;
            let mut bytes = Vec::new();
            if count > 0 {
                record::encode(&mut bytes, &Record::PurgeKey { key });
            }
            Ok(bytes)
        })?;
        if count > 0 {
            self.compact(&mut inner)?;
        }
        drop(inner);
        self.sync_to(&shard, end)?;
        Ok(count)
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
