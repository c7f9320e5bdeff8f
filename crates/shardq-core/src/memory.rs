//! An in-memory backend: the [`QueueBackend`] contract in its simplest form.
//!
//! It exists to test what is written against the traits (the worker pool,
//! resharding) without disks or servers, and as a readable reference of the
//! contract. It keeps nothing across restarts and must never be used where
//! durability is expected. A [`MemoryMapStore`] keeps the shard map beside it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use shardq_route::ShardMap;

use crate::backend::{
    BackedOff, InspectJobs, KeyHold, KeyResume, MoveKeys, RunJobs, KEY_HOLD_SCAN_JOBS,
};
use crate::clock::Clock;
use crate::error::QueueError;
use crate::flow::{Admit, FlowControl, Rank};
use crate::job::{
    keyed_meets, next_fence, validate_job_lease_ms, AckOutcome, Backoff, CancelOutcome, ClaimedJob,
    DeadJob, DeadPolicy, DedupRecord, FailOutcome, Fence, Finish, FinishedJob, JobId, JobInfo,
    JobState, KeyCounts, Keyed, KeyedLive, KeyedMeets, MovedJob, NewJob, Receipt, Retention,
    ShardStats, Stored, FINISHED_STARTS_KEPT, KEY_JOBS_MAX, PAYLOAD_BYTES_MAX_DEFAULT,
};
use crate::reshard::{KeyInventory, MapStore, ReshardError};
use crate::retry::RetryRules;

#[derive(Debug, Clone)]
struct StoredJob {
    key: String,
    payload: Vec<u8>,
    attempt: u32,
    max_attempts: u32,
    created_ms: u64,
    not_before_ms: u64,
    reason: String,
    /// When each attempt started.
    starts: Vec<u64>,
    /// Its wait (`not_before_ms`) is a handler's back-off, which
    /// [`InspectJobs::resume_key`] lifts; cleared when it starts again.
    backed_off: bool,
    /// The dedup id it was enqueued with.
    dedup_id: Option<String>,
}

/// The current run of an in-flight job.
#[derive(Debug, Clone, Copy)]
struct Run {
    fence: u64,
    lease_until_ms: u64,
    /// Cancelled while it ran: its results are refused, and its job is
    /// deleted when the run ends.
    cancelled: bool,
}

#[derive(Debug, Default, Clone)]
struct ShardState {
    jobs: BTreeMap<JobId, StoredJob>,
    /// Pending job ids per key, in key order (a retried job goes back to
    /// its place).
    keys: BTreeMap<String, VecDeque<JobId>>,
    in_flight: BTreeMap<JobId, Run>,
    /// Runs in flight per key (keys with none are absent).
    busy: BTreeMap<String, u32>,
    /// The largest fence issued.
    fence_high: u64,
    dead: BTreeSet<JobId>,
    halted_keys: BTreeSet<String>,
    fence: Fence,
    next_id: u64,
    owned: bool,
    /// What this process saw of the store (the last id and the largest
    /// fence handed out): kept across [`MemoryBackend::rewind`], as a
    /// process keeps it when its store goes back in time.
    seen: (u64, u64),
    /// Dedup records by (key, dedup id).
    dedup: BTreeMap<(String, String), DedupRecord>,
    /// The newest job stored (enqueued or imported) under each keyed id,
    /// by (key, id): the job a keyed enqueue meets while it is live.
    keyed: BTreeMap<(String, String), JobId>,
    /// Per (shard copied from, key), the largest source id imported.
    imported: BTreeMap<(String, String), JobId>,
    /// Ids of keys moved away (`purge_key`).
    moved: crate::job::MovedAway,
    /// Copies stored by imports, by source.
    moved_in: crate::job::MovedIn,
    /// Jobs that finished, newest first, within the retention.
    finished: VecDeque<FinishedJob>,
    /// Keys flow control refused, until when (this process's memory).
    held: BTreeMap<String, u64>,
    /// Finish tags of keys, when flow control ranks them.
    fair: crate::flow::FairQueue<String>,
}

/// What a keyed job `j` (id `d`, `mode`) meets on its key
/// ([`crate::job::keyed_meets`]): the answer when the key's live job with
/// that id takes it (after a debounce has given that job the payload and
/// start), or the start of a new job. A debounce of a job whose key is
/// being copied away is refused as paused.
fn keyed_hit(
    s: &mut ShardState,
    shard: &str,
    j: &NewJob,
    d: &str,
    mode: Keyed,
    now: u64,
) -> Result<Result<Stored, u64>, QueueError> {
    let live = s
        .keyed
        .get(&(j.key.clone(), d.to_string()))
        .filter(|id| !s.dead.contains(id))
        .and_then(|id| s.jobs.get(id).map(|x| (*id, x)))
        .map(|(id, x)| KeyedLive {
            job: id,
            created_ms: x.created_ms,
            running: s.in_flight.contains_key(&id),
        });
    let here = |id, duplicate| Stored {
        id,
        shard: shard.to_string(),
        duplicate,
    };
    match keyed_meets(mode, live, j.delay_ms, now) {
        KeyedMeets::Duplicate(id) => Ok(Ok(here(id, true))),
        KeyedMeets::Debounce { job, not_before_ms } => {
            if s.fence.sealed_keys.contains_key(&j.key) {
                return Err(QueueError::Paused {
                    shard: shard.to_string(),
                    key: j.key.clone(),
                });
            }
            let x = s.jobs.get_mut(&job).expect("found above");
            x.payload = j.payload.clone();
            x.not_before_ms = not_before_ms;
            x.backed_off = false;
            Ok(Ok(here(job, false)))
        }
        KeyedMeets::Store { not_before_ms } => Ok(Err(not_before_ms)),
    }
}

/// Keeps the finished job `j` (newest first), within `retention`.
fn note_finished(
    s: &mut ShardState,
    id: JobId,
    j: StoredJob,
    outcome: Finish,
    now: u64,
    retention: Retention,
    result: Option<Vec<u8>>,
) {
    if retention.finished_jobs == 0 {
        return;
    }
    let mut starts = j.starts;
    starts.drain(..starts.len().saturating_sub(FINISHED_STARTS_KEPT));
    s.finished.push_front(FinishedJob {
        id,
        key: j.key,
        outcome,
        attempts: j.attempt,
        finished_ms: now,
        attempt_starts_ms: starts,
        reason: (!j.reason.is_empty()).then_some(j.reason),
        result,
    });
    s.finished.truncate(retention.finished_jobs);
}

/// A shard's stored state, taken by [`MemoryBackend::checkpoint`].
#[derive(Debug, Clone)]
pub struct MemoryCheckpoint(ShardState);

impl ShardState {
    /// [`QueueError::StoreLost`] when the store shows less than this process
    /// saw (it went back in time); else raises what was seen.
    fn check_not_rewound(&mut self, shard: &str) -> Result<(), QueueError> {
        let now = (self.next_id - 1, self.fence_high);
        if now.0 < self.seen.0 || now.1 < self.seen.1 {
            return Err(QueueError::StoreLost(format!(
                "shard {shard:?} (memory): the store went back in time: last job id {} and \
                 fence {}, but this process saw {} and {}",
                now.0, now.1, self.seen.0, self.seen.1
            )));
        }
        self.seen = now;
        Ok(())
    }
}

/// An in-memory [`QueueBackend`] over a fixed set of shard names.
#[derive(Debug, Clone)]
pub struct MemoryBackend {
    shards: Arc<Mutex<BTreeMap<String, ShardState>>>,
    clock: Arc<dyn Clock>,
    backoff: Backoff,
    retry_rules: Arc<RetryRules>,
    retention: Retention,
    dead_policy: DeadPolicy,
    /// Which keys may start now.
    flow: Option<Arc<FlowControl>>,
}

impl MemoryBackend {
    /// Gives back the group run slots of the runs of `keys` that ended.
    fn runs_ended(&self, shard: &str, runs: &[(String, u64)]) {
        if let Some(f) = self.flow.as_ref().filter(|_| !runs.is_empty()) {
            let runs: Vec<(&str, u64)> = runs.iter().map(|(k, f)| (k.as_str(), *f)).collect();
            f.runs_ended(shard, &runs);
        }
    }

    /// The same backend with per-key and per-prefix retry rules: a failed
    /// run of a key with a rule waits its rule's backoff.
    pub fn with_retry_rules(mut self, rules: RetryRules) -> MemoryBackend {
        self.retry_rules = Arc::new(rules);
        self
    }

    /// The same backend asking `flow` before each start.
    pub fn with_flow(mut self, flow: Arc<FlowControl>) -> MemoryBackend {
        self.flow = Some(flow);
        self
    }

    /// The same backend keeping finished jobs for `retention`.
    pub fn with_retention(mut self, retention: Retention) -> MemoryBackend {
        self.retention = retention;
        self
    }

    /// A backend holding `shards`, every one adopted by this process.
    pub fn new(shards: &[&str], clock: Arc<dyn Clock>) -> MemoryBackend {
        let map = shards
            .iter()
            .map(|s| {
                (
                    s.to_string(),
                    ShardState {
                        owned: true,
                        next_id: 1,
                        ..ShardState::default()
                    },
                )
            })
            .collect();
        MemoryBackend {
            shards: Arc::new(Mutex::new(map)),
            clock,
            backoff: Backoff {
                base_ms: 1,
                max_ms: 10,
                ..Backoff::default()
            },
            retry_rules: Arc::default(),
            retention: Retention::default(),
            dead_policy: DeadPolicy::Continue,
            flow: None,
        }
    }

    /// Adds a shard (as `add-shard` deploys one).
    pub fn add_shard(&self, name: &str) {
        self.lock().entry(name.to_string()).or_insert(ShardState {
            owned: true,
            next_id: 1,
            ..ShardState::default()
        });
    }

    /// The stored state of `shard` now (test support: see
    /// [`MemoryBackend::rewind`]).
    pub fn checkpoint(&self, shard: &str) -> Option<MemoryCheckpoint> {
        self.lock().get(shard).cloned().map(MemoryCheckpoint)
    }

    /// Puts the stored state of `shard` back to `to`, as a restore from an
    /// older backup would, keeping what this process saw: its next enqueue
    /// or claim on the shard answers [`QueueError::StoreLost`].
    pub fn rewind(&self, shard: &str, to: &MemoryCheckpoint) {
        if let Some(s) = self.lock().get_mut(shard) {
            let seen = s.seen;
            *s = to.0.clone();
            s.seen = seen;
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, ShardState>> {
        // A panic while holding the lock is a test failure already.
        self.shards.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with_shard<R>(
        &self,
        shard: &str,
        f: impl FnOnce(&mut ShardState) -> Result<R, QueueError>,
    ) -> Result<R, QueueError> {
        let mut all = self.lock();
        let s = all.get_mut(shard).ok_or_else(|| QueueError::UnknownShard {
            shard: shard.to_string(),
        })?;
        f(s)
    }

    fn owned<R>(
        &self,
        shard: &str,
        f: impl FnOnce(&mut ShardState) -> Result<R, QueueError>,
    ) -> Result<R, QueueError> {
        self.with_shard(shard, |s| {
            if !s.owned {
                return Err(QueueError::NotOwner {
                    shard: shard.to_string(),
                });
            }
            f(s)
        })
    }
}

/// The dead jobs an operator named (`None`: all of them), in id order.
fn chosen_dead(s: &ShardState, ids: Option<&[JobId]>) -> Vec<JobId> {
    // A dead job of a key sealed for a move stays as it is: its copy goes
    // (or went) with the key, and a retry or purge here would be undone or
    // lost with the copies left behind.
    let movable = |id: &JobId| {
        s.dead.contains(id)
            && !s
                .jobs
                .get(id)
                .is_some_and(|j| s.fence.sealed_keys.contains_key(&j.key))
    };
    match ids {
        Some(ids) => ids.iter().copied().filter(movable).collect(),
        None => s.dead.iter().copied().filter(movable).collect(),
    }
}

/// The current run named by `receipt`, or why it is not current.
fn current_run(s: &ShardState, receipt: Receipt) -> Result<Run, String> {
    match s.in_flight.get(&receipt.id) {
        None => Err("the job is not running (finished, or its run ended)".into()),
        Some(run) if run.fence != receipt.fence => {
            Err(format!("the job's current run has fence {}", run.fence))
        }
        Some(run) if run.cancelled => Err("the job was cancelled while it ran".into()),
        // A lapsed run stays the job's run until a claim ends it: until
        // then no other run has started, so its result is still the only one.
        Some(run) => Ok(*run),
    }
}

fn stale(shard: &str, receipt: Receipt, reason: String) -> QueueError {
    QueueError::StaleReceipt {
        shard: shard.to_string(),
        id: receipt.id.0,
        fence: receipt.fence,
        reason,
    }
}

/// Ends runs whose job lease lapsed: each counts as a failed attempt (the
/// job goes back to the head of its key, or to the dead letters).
fn end_lapsed_runs(
    s: &mut ShardState,
    now: u64,
    backoff: Backoff,
    policy: DeadPolicy,
    retention: Retention,
) {
    let lapsed: Vec<JobId> = s
        .in_flight
        .iter()
        .filter(|(_, run)| run.lease_until_ms <= now)
        .map(|(id, _)| *id)
        .collect();
    for id in lapsed {
        let run = s.in_flight.remove(&id);
        if run.is_some_and(|r| r.cancelled) {
            end_cancelled_run(s, id, now, retention);
            continue;
        }
        // The run vanished rather than failed: retry at once.
        finish_failed(s, id, "job lease lapsed", now, Some(0), backoff, policy);
    }
}

/// A cancelled run is over (its lease lapsed, or its handler failed): its
/// cancel takes effect now that no run of the job is left.
fn end_cancelled_run(s: &mut ShardState, id: JobId, now: u64, retention: Retention) {
    s.in_flight.remove(&id);
    if let Some(j) = s.jobs.remove(&id) {
        run_over(s, &j.key);
        note_finished(s, id, j, Finish::Cancelled, now, retention, None);
    }
}

/// A failed run's job: back to the head of its key, or dead.
fn finish_failed(
    s: &mut ShardState,
    id: JobId,
    reason: &str,
    now: u64,
    retry_in_ms: Option<u64>,
    backoff: Backoff,
    policy: DeadPolicy,
) -> FailOutcome {
    let Some(key) = s.jobs.get(&id).map(|j| j.key.clone()) else {
        return FailOutcome::Dead;
    };
    run_over(s, &key);
    let Some(j) = s.jobs.get_mut(&id) else {
        return FailOutcome::Dead;
    };
    j.reason = reason.to_string();
    if j.attempt >= j.max_attempts {
        s.dead.insert(id);
        if policy == DeadPolicy::Halt {
            s.halted_keys.insert(key);
        }
        return FailOutcome::Dead;
    }
    let seed = id.0 ^ u64::from(j.attempt).rotate_left(32);
    let at_ms = now + retry_in_ms.unwrap_or_else(|| backoff.delay_for(j.attempt, seed));
    j.not_before_ms = at_ms;
    back_in_order(s, key, id);
    FailOutcome::Retry { at_ms }
}

/// One run of `key` is over.
fn run_over(s: &mut ShardState, key: &str) {
    if let Some(n) = s.busy.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            s.busy.remove(key);
        }
    }
}

/// Runs of `key` in flight.
fn busy_of(s: &ShardState, key: &str) -> u32 {
    s.busy.get(key).copied().unwrap_or(0)
}

/// Job `id` back among the pending jobs of `key`, before every later id: a
/// failed or backed-off job runs before the key's later jobs (with one run
/// per key it is the head; with more, a job started after it may have
/// failed back first, or be running still).
fn back_in_order(s: &mut ShardState, key: String, id: JobId) {
    let q = s.keys.entry(key).or_default();
    let pos = q.iter().position(|x| *x > id).unwrap_or(q.len());
    q.insert(pos, id);
}

/// The head job of `key` when a claim may start it at `now`: fewer than
/// `limit` runs of the key in flight, not halted, not sealed for a move,
/// due, and not held back by flow control.
fn startable_head(s: &ShardState, key: &str, now: u64, limit: u32) -> Option<JobId> {
    if busy_of(s, key) >= limit
        || s.halted_keys.contains(key)
        || s.fence.sealed_keys.contains_key(key)
    {
        return None;
    }
    let id = *s.keys.get(key)?.front()?;
    let j = s.jobs.get(&id)?;
    (j.not_before_ms <= now && s.held.get(key).is_none_or(|&at| at <= now)).then_some(id)
}

/// The live job `id` as an operator sees it (`None`: not live).
fn job_info(s: &ShardState, id: JobId, now: u64) -> Option<JobInfo> {
    let j = s.jobs.get(&id)?;
    let run = s.in_flight.get(&id);
    let (state, attempts) = if let Some(_run) = run {
        (JobState::Running, j.attempt.saturating_sub(1))
    } else if s.dead.contains(&id) {
        (JobState::Dead, j.attempt)
    } else if j.not_before_ms > now {
        (JobState::Delayed, j.attempt)
    } else {
        (JobState::Queued, j.attempt)
    };
    Some(JobInfo {
        id,
        key: j.key.clone(),
        state,
        attempts,
        max_attempts: j.max_attempts,
        created_ms: j.created_ms,
        not_before_ms: j.not_before_ms,
        run: run.map(|r| (r.fence, r.lease_until_ms)),
        reason: (!j.reason.is_empty()).then(|| j.reason.clone()),
        attempt_starts_ms: j.starts.clone(),
        payload: j.payload.clone(),
        dedup_id: j.dedup_id.clone(),
    })
}

/// The back-off holding `key` at `now`: its first waiting jobs that a
/// handler's back-off put back and whose wait has not ended.
fn hold_of(s: &ShardState, key: &str, now: u64) -> Option<KeyHold> {
    let mut hold = KeyHold {
        jobs: Vec::new(),
        until_ms: 0,
    };
    for id in s.keys.get(key)?.iter().take(KEY_HOLD_SCAN_JOBS) {
        if let Some(j) = (s.jobs.get(id)).filter(|j| j.backed_off && j.not_before_ms > now) {
            hold.jobs.push(*id);
            hold.until_ms = hold.until_ms.max(j.not_before_ms);
        }
    }
    (!hold.jobs.is_empty()).then_some(hold)
}

fn counts(s: &ShardState, key: &str) -> KeyCounts {
    let depth = s.keys.get(key).map_or(0, |q| q.len() as u64);
    let in_flight = u64::from(busy_of(s, key));
    let dead = s
        .dead
        .iter()
        .filter(|id| s.jobs.get(id).is_some_and(|j| j.key == key))
        .count() as u64;
    KeyCounts {
        depth,
        in_flight,
        dead,
    }
}

impl RunJobs for MemoryBackend {
    fn limits(&self) -> crate::BackendLimits {
        crate::BackendLimits {
            key_concurrency_max: crate::flow::KEY_CONCURRENCY_MAX,
            ..crate::BackendLimits::default()
        }
    }

    fn shard_names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    fn enqueue(
        &self,
        shard: &str,
        map_version: u64,
        jobs: &[NewJob],
    ) -> Result<Vec<JobId>, QueueError> {
        crate::job::refuse_dedup_ids(jobs)?;
        Ok(self
            .enqueue_dedup(shard, map_version, jobs, 1)?
            .into_iter()
            .map(|s| s.id)
            .collect())
    }

    fn enqueue_dedup(
        &self,
        shard: &str,
        map_version: u64,
        jobs: &[NewJob],
        window_ms: u64,
    ) -> Result<Vec<Stored>, QueueError> {
        crate::job::validate_dedup_window_ms(window_ms)?;
        let now = self.clock.now_ms();
        self.with_shard(shard, |s| {
            s.check_not_rewound(shard)?;
            for j in jobs {
                j.validate(PAYLOAD_BYTES_MAX_DEFAULT)?;
                s.fence.check(shard, map_version, &j.key)?;
            }
            s.dedup.retain(|_, r| r.expires_ms > now);
            let mut out = Vec::with_capacity(jobs.len());
            for j in jobs {
                let mut not_before_ms = now + j.delay_ms;
                if let (Some(mode), Some(d)) = (j.keyed, &j.dedup_id) {
                    match keyed_hit(s, shard, j, d, mode, now)? {
                        Ok(hit) => {
                            out.push(hit);
                            continue;
                        }
                        Err(start) => not_before_ms = start,
                    }
                } else if let Some(d) = &j.dedup_id {
                    if let Some(r) = s.dedup.get(&(j.key.clone(), d.clone())) {
                        out.push(Stored {
                            id: r.job,
                            shard: r.shard.clone(),
                            duplicate: true,
                        });
                        continue;
                    }
                }
                let id = JobId(s.next_id);
                s.next_id += 1;
                s.jobs.insert(
                    id,
                    StoredJob {
                        key: j.key.clone(),
                        payload: j.payload.clone(),
                        attempt: 0,
                        max_attempts: j.max_attempts,
                        created_ms: now,
                        not_before_ms,
                        reason: String::new(),
                        starts: Vec::new(),
                        backed_off: false,
                        dedup_id: j.dedup_id.clone(),
                    },
                );
                s.keys.entry(j.key.clone()).or_default().push_back(id);
                if let (Some(d), Some(_)) = (&j.dedup_id, j.keyed) {
                    s.keyed.insert((j.key.clone(), d.clone()), id);
                }
                if let (Some(d), None) = (&j.dedup_id, j.keyed) {
                    s.dedup.insert(
                        (j.key.clone(), d.clone()),
                        DedupRecord {
                            key: j.key.clone(),
                            id: d.clone(),
                            shard: shard.to_string(),
                            job: id,
                            expires_ms: now.saturating_add(window_ms),
                        },
                    );
                }
                out.push(Stored {
                    id,
                    shard: shard.to_string(),
                    duplicate: false,
                });
            }
            s.check_not_rewound(shard)?;
            Ok(out)
        })
    }

    fn adopt(&self, shard: &str) -> Result<(), QueueError> {
        self.with_shard(shard, |s| {
            s.owned = true;
            // Jobs left in flight go back to the head of their keys, but a
            // job whose run was cancelled goes with its run.
            let runs: Vec<(JobId, Run)> = std::mem::take(&mut s.in_flight).into_iter().collect();
            for (id, run) in runs.into_iter().rev() {
                if let Some(j) = s.jobs.get(&id) {
                    let key = j.key.clone();
                    run_over(s, &key);
                    if run.cancelled {
                        s.jobs.remove(&id);
                    } else {
                        back_in_order(s, key, id);
                    }
                }
            }
            Ok(())
        })
    }

    fn release(&self, shard: &str) -> Result<(), QueueError> {
        self.with_shard(shard, |s| {
            s.owned = false;
            Ok(())
        })
    }

    fn claim(&self, shard: &str, max: usize, lease_ms: u64) -> Result<Vec<ClaimedJob>, QueueError> {
        validate_job_lease_ms(lease_ms)?;
        let now = self.clock.now_ms();
        let (backoff, policy, retention) = (self.backoff, self.dead_policy, self.retention);
        if let Some(f) = &self.flow {
            f.refresh(now);
        }
        self.owned(shard, |s| {
            s.check_not_rewound(shard)?;
            end_lapsed_runs(s, now, backoff, policy, retention);
            let mut out = Vec::new();
            let mut keys: std::collections::VecDeque<String> = s.keys.keys().cloned().collect();
            // Ranked: by priority and weight (FairQueue), else key order.
            let ranked = self.flow.as_ref().filter(|f| f.ranks_keys());
            if let Some(f) = ranked {
                s.fair.raise_vtime(f.fair_vtime());
                for k in keys.drain(..) {
                    let (priority, weight) = f.rank_of(&k);
                    s.fair.push(k, priority, weight);
                }
            }
            loop {
                if out.len() >= max {
                    break;
                }
                let popped = if ranked.is_some() { s.fair.pop() } else { None };
                let Some(key) = popped
                    .as_ref()
                    .map(|p| p.key.clone())
                    .or_else(|| keys.pop_front())
                else {
                    break;
                };
                let limit = self.key_concurrency(&key);
                let Some(id) = startable_head(s, &key, now, limit) else {
                    continue;
                };
                let lease_until_ms = now.saturating_add(lease_ms);
                let fence = next_fence(
                    now.saturating_mul(1000),
                    s.fence_high,
                    s.fence.run_fence_min,
                );
                let start = crate::flow::RunStart {
                    shard,
                    fence,
                    lease_until_ms,
                };
                if let Some(Admit::NotBefore(at)) =
                    (self.flow.as_ref()).map(|f| f.admit(&key, now, &start))
                {
                    s.held.insert(key, at);
                    continue;
                }
                s.held.remove(&key);
                if let Some(p) = &popped {
                    s.fair.charge(p);
                }
                // A key that may run more than once at once stays in line
                // for its next job (in its turn, or by its new start tag).
                let again = limit > 1 && busy_of(s, &key) + 1 < limit;
                let Some(j) = s.jobs.get_mut(&id) else {
                    continue;
                };
                j.attempt += 1;
                j.starts.push(now);
                j.backed_off = false;
                s.fence_high = fence;
                out.push(ClaimedJob {
                    shard: shard.to_string(),
                    id,
                    key: key.clone(),
                    payload: j.payload.clone(),
                    attempt: j.attempt,
                    max_attempts: j.max_attempts,
                    created_ms: j.created_ms,
                    not_before_ms: j.not_before_ms,
                    fence,
                    lease_until_ms,
                    dedup_id: j.dedup_id.clone(),
                });
                let mut more = false;
                if let Some(q) = s.keys.get_mut(&key) {
                    q.pop_front();
                    more = !q.is_empty();
                    if q.is_empty() {
                        s.keys.remove(&key);
                    }
                }
                if again && more {
                    match (ranked, &popped) {
                        (Some(f), Some(_)) => {
                            let (priority, weight) = f.rank_of(&key);
                            s.fair.push(key.clone(), priority, weight);
                        }
                        _ => keys.push_back(key.clone()),
                    }
                }
                s.in_flight.insert(
                    id,
                    Run {
                        cancelled: false,
                        fence,
                        lease_until_ms,
                    },
                );
                *s.busy.entry(key).or_insert(0) += 1;
            }
            // Not started this time: queued again at the next claim.
            s.fair.drain();
            if let Some(f) = ranked {
                f.raise_fair_vtime(s.fair.vtime());
            }
            s.check_not_rewound(shard)?;
            Ok(out)
        })
    }

    fn ready_ranks(&self, shard: &str, max: usize) -> Result<Vec<Rank>, QueueError> {
        let Some(f) = self.flow.as_ref().filter(|f| f.ranks_keys()) else {
            return Ok(Vec::new());
        };
        let now = self.clock.now_ms();
        let (backoff, policy, retention) = (self.backoff, self.dead_policy, self.retention);
        f.refresh(now);
        self.owned(shard, |s| {
            s.check_not_rewound(shard)?;
            end_lapsed_runs(s, now, backoff, policy, retention);
            s.fair.raise_vtime(f.fair_vtime());
            let keys: Vec<String> = (s.keys.keys())
                .filter(|k| startable_head(s, k, now, f.concurrency_of(k)).is_some())
                .cloned()
                .collect();
            for k in keys {
                let (priority, weight) = f.rank_of(&k);
                s.fair.push(k, priority, weight);
            }
            let ranks = s.fair.ranks(max, |_| true);
            s.fair.drain();
            Ok(ranks)
        })
    }

    fn ack_results(
        &self,
        shard: &str,
        receipts: &[Receipt],
        results: &[Option<Vec<u8>>],
    ) -> Result<AckOutcome, QueueError> {
        crate::job::check_ack_results(receipts, results)?;
        let (now, retention) = (self.clock.now_ms(), self.retention);
        let mut ended = Vec::new();
        let out = self.owned(shard, |s| {
            let mut out = AckOutcome::default();
            for (i, r) in receipts.iter().enumerate() {
                if current_run(s, *r).is_err() {
                    // Over (cancelled, lapsed, ended): its slot goes too.
                    ended.extend(s.jobs.get(&r.id).map(|j| (j.key.clone(), r.fence)));
                    out.stale.push(*r);
                    continue;
                }
                s.in_flight.remove(&r.id);
                if let Some(j) = s.jobs.remove(&r.id) {
                    run_over(s, &j.key);
                    ended.push((j.key.clone(), r.fence));
                    let result = crate::job::result_at(results, i);
                    note_finished(s, r.id, j, Finish::Completed, now, retention, result);
                }
                out.acked += 1;
            }
            Ok(out)
        })?;
        self.runs_ended(shard, &ended);
        Ok(out)
    }

    fn fail(
        &self,
        shard: &str,
        receipt: Receipt,
        reason: &str,
        retry_in_ms: Option<u64>,
    ) -> Result<FailOutcome, QueueError> {
        let now = self.clock.now_ms();
        let (backoff, policy) = (self.backoff, self.dead_policy);
        let retention = self.retention;
        let mut ended = Vec::new();
        let out = self.owned(shard, |s| {
            let job = s.jobs.get(&receipt.id);
            // Over, current or not: its group slot goes back below.
            ended.extend(job.map(|j| (j.key.clone(), receipt.fence)));
            if let Some(run) =
                (s.in_flight.get(&receipt.id)).filter(|r| r.cancelled && r.fence == receipt.fence)
            {
                // The run a cancel stopped, over now that its handler
                // failed: its job goes at once, not when its lease lapses.
                let why = format!("the job was cancelled while it ran (run {})", run.fence);
                end_cancelled_run(s, receipt.id, now, retention);
                return Err(stale(shard, receipt, why));
            }
            current_run(s, receipt).map_err(|why| stale(shard, receipt, why))?;
            s.in_flight.remove(&receipt.id);
            let job = s.jobs.get(&receipt.id);
            let backoff = job
                .and_then(|j| self.retry_rules.for_key(&j.key))
                .map_or(backoff, |p| p.backoff);
            Ok(finish_failed(
                s,
                receipt.id,
                reason,
                now,
                retry_in_ms,
                backoff,
                policy,
            ))
        });
        if matches!(out, Ok(_) | Err(QueueError::StaleReceipt { .. })) {
            self.runs_ended(shard, &ended);
        }
        out
    }

    fn ranks_keys(&self) -> bool {
        self.flow.as_ref().is_some_and(|f| f.ranks_keys())
    }

    fn limits_starts(&self) -> bool {
        self.flow.as_ref().is_some_and(|f| f.limits_starts())
    }

    fn key_concurrency(&self, key: &str) -> u32 {
        self.flow.as_ref().map_or(1, |f| f.concurrency_of(key))
    }

    fn back_off(
        &self,
        shard: &str,
        receipt: Receipt,
        retry_in_ms: u64,
        group: bool,
    ) -> Result<BackedOff, QueueError> {
        crate::flow::validate_backoff_ms(retry_in_ms)?;
        let now = self.clock.now_ms();
        let at_ms = now.saturating_add(retry_in_ms);
        let mut ended = Vec::new();
        let key = self.owned(shard, |s| {
            // Over, current or not: its group slot goes back below.
            ended.extend(
                s.jobs
                    .get(&receipt.id)
                    .map(|j| (j.key.clone(), receipt.fence)),
            );
            current_run(s, receipt).map_err(|why| stale(shard, receipt, why))?;
            s.in_flight.remove(&receipt.id);
            let Some(j) = s.jobs.get_mut(&receipt.id) else {
                return Err(QueueError::Internal {
                    what: format!("the run of {receipt:?} has no job"),
                });
            };
            j.attempt = j.attempt.saturating_sub(1);
            j.starts.pop();
            j.not_before_ms = at_ms;
            j.backed_off = true;
            let key = j.key.clone();
            run_over(s, &key);
            back_in_order(s, key.clone(), receipt.id);
            Ok(key)
        });
        if matches!(key, Ok(_) | Err(QueueError::StaleReceipt { .. })) {
            self.runs_ended(shard, &ended);
        }
        let key = key?;
        let held = match (&self.flow, group) {
            (Some(f), true) => f.hold_group_of(&key, at_ms),
            _ => None,
        };
        Ok(BackedOff { at_ms, group: held })
    }

    fn extend(
        &self,
        shard: &str,
        receipts: &[Receipt],
        lease_ms: u64,
    ) -> Result<Vec<Receipt>, QueueError> {
        validate_job_lease_ms(lease_ms)?;
        let until = self.clock.now_ms().saturating_add(lease_ms);
        let mut renewed = Vec::new();
        let refused = self.owned(shard, |s| {
            let mut refused = Vec::new();
            for r in receipts {
                if current_run(s, *r).is_err() {
                    refused.push(*r);
                } else if let Some(run) = s.in_flight.get_mut(&r.id) {
                    run.lease_until_ms = until;
                    renewed.extend(s.jobs.get(&r.id).map(|j| (j.key.clone(), r.fence)));
                }
            }
            Ok(refused)
        })?;
        if let Some(f) = self.flow.as_ref().filter(|_| !renewed.is_empty()) {
            let runs: Vec<(&str, u64)> = renewed.iter().map(|(k, f)| (k.as_str(), *f)).collect();
            f.runs_extended(shard, &runs, until);
        }
        Ok(refused)
    }

    fn stale_runs(&self, shard: &str, receipts: &[Receipt]) -> Result<Vec<Receipt>, QueueError> {
        self.with_shard(shard, |s| {
            Ok((receipts.iter())
                .filter(|r| current_run(s, **r).is_err())
                .copied()
                .collect())
        })
    }

    fn next_due_ms(&self, shard: &str) -> Result<Option<u64>, QueueError> {
        self.with_shard(shard, |s| {
            Ok(s.keys
                .iter()
                .filter(|(k, _)| {
                    busy_of(s, k) < self.key_concurrency(k) && !s.fence.sealed_keys.contains_key(*k)
                })
                .filter_map(|(k, q)| {
                    q.front()
                        .and_then(|id| s.jobs.get(id))
                        .map(|j| j.not_before_ms.max(s.held.get(k).copied().unwrap_or(0)))
                })
                .chain(s.in_flight.values().map(|run| run.lease_until_ms))
                .min())
        })
    }
}

impl MoveKeys for MemoryBackend {
    fn dedup_export(&self, shard: &str, key: &str) -> Result<Vec<DedupRecord>, QueueError> {
        let now = self.clock.now_ms();
        self.with_shard(shard, |s| {
            Ok(s.dedup
                .values()
                .filter(|r| r.key == key && r.expires_ms > now)
                .cloned()
                .collect())
        })
    }

    fn dedup_import(&self, shard: &str, records: &[DedupRecord]) -> Result<(), QueueError> {
        let now = self.clock.now_ms();
        self.with_shard(shard, |s| {
            for r in records.iter().filter(|r| r.expires_ms > now) {
                crate::job::validate_dedup_id(&r.key, &r.id)?;
                let live = s
                    .dedup
                    .get(&(r.key.clone(), r.id.clone()))
                    .is_some_and(|old| old.expires_ms > now);
                if !live {
                    s.dedup.insert((r.key.clone(), r.id.clone()), r.clone());
                }
            }
            Ok(())
        })
    }

    fn dedup_keys(&self, shard: &str) -> Result<Vec<String>, QueueError> {
        let now = self.clock.now_ms();
        self.with_shard(shard, |s| {
            let keys: BTreeSet<String> = s
                .dedup
                .values()
                .filter(|r| r.expires_ms > now)
                .map(|r| r.key.clone())
                .collect();
            Ok(keys.into_iter().collect())
        })
    }

    fn fence(&self, shard: &str) -> Result<Fence, QueueError> {
        self.with_shard(shard, |s| Ok(s.fence.clone()))
    }

    fn set_fence(&self, shard: &str, fence: &Fence) -> Result<(), QueueError> {
        self.with_shard(shard, |s| {
            s.fence = fence.clone();
            Ok(())
        })
    }

    fn export_jobs(
        &self,
        shard: &str,
        key: &str,
        after: Option<JobId>,
        max: usize,
    ) -> Result<Vec<MovedJob>, QueueError> {
        self.with_shard(shard, |s| {
            let mut ids: Vec<JobId> = s
                .keys
                .get(key)
                .map_or_else(Vec::new, |q| q.iter().copied().collect());
            ids.extend(
                s.dead
                    .iter()
                    .filter(|id| s.jobs.get(id).is_some_and(|j| j.key == key)),
            );
            ids.retain(|id| after.is_none_or(|a| *id > a));
            ids.sort_unstable();
            ids.truncate(max);
            Ok(ids
                .into_iter()
                .filter_map(|id| {
                    let j = s.jobs.get(&id)?;
                    Some(MovedJob {
                        id,
                        created_ms: j.created_ms,
                        not_before_ms: j.not_before_ms,
                        attempt: j.attempt,
                        max_attempts: j.max_attempts,
                        payload: j.payload.clone(),
                        dead: s.dead.contains(&id).then(|| j.reason.clone()),
                        dedup_id: j.dedup_id.clone(),
                    })
                })
                .collect())
        })
    }

    fn import_jobs(
        &self,
        shard: &str,
        from: &str,
        key: &str,
        jobs: &[MovedJob],
    ) -> Result<Vec<(JobId, JobId)>, QueueError> {
        crate::job::validate_key(key)?;
        for d in jobs.iter().filter_map(|j| j.dedup_id.as_deref()) {
            crate::job::validate_dedup_id(key, d)?;
        }
        self.with_shard(shard, |s| {
            s.check_not_rewound(shard)?;
            let cursor = (from.to_string(), key.to_string());
            let mut done = s.imported.get(&cursor).copied();
            let mut out = Vec::new();
            for j in jobs {
                if done.is_some_and(|d| j.id <= d) {
                    continue;
                }
                let id = JobId(s.next_id);
                s.next_id += 1;
                s.jobs.insert(
                    id,
                    StoredJob {
                        key: key.to_string(),
                        payload: j.payload.clone(),
                        attempt: j.attempt,
                        max_attempts: j.max_attempts,
                        created_ms: j.created_ms,
                        not_before_ms: j.not_before_ms,
                        reason: j.dead.clone().unwrap_or_default(),
                        starts: Vec::new(),
                        backed_off: false,
                        dedup_id: j.dedup_id.clone(),
                    },
                );
                if let Some(d) = j.dedup_id.as_deref().filter(|d| crate::job::is_keyed_id(d)) {
                    s.keyed.insert((key.to_string(), d.to_string()), id);
                }
                if j.dead.is_some() {
                    s.dead.insert(id);
                } else {
                    s.keys.entry(key.to_string()).or_default().push_back(id);
                }
                done = Some(j.id);
                out.push((j.id, id));
            }
            if let Some(d) = done {
                s.imported.insert(cursor, d);
            }
            s.moved_in
                .note(from, out.iter().map(|(src, new)| (src.0, new.0)).collect());
            s.check_not_rewound(shard)?;
            Ok(out)
        })
    }

    fn imported_up_to(
        &self,
        shard: &str,
        from: &str,
        key: &str,
    ) -> Result<Option<JobId>, QueueError> {
        self.with_shard(shard, |s| {
            Ok(s.imported
                .get(&(from.to_string(), key.to_string()))
                .copied())
        })
    }

    fn freeze_caught_up(
        &self,
        shard: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<String>, QueueError> {
        self.with_shard(shard, |s| {
            let mut out = Vec::new();
            for (key, after) in items {
                if !s.fence.sealed_keys.contains_key(key) {
                    continue;
                }
                let above = |id: &JobId| after.is_none_or(|a| *id > a);
                let behind = s.keys.get(key).is_some_and(|q| {
                    q.iter()
                        .any(|id| above(id) && !s.in_flight.contains_key(id))
                }) || s
                    .dead
                    .iter()
                    .any(|id| above(id) && s.jobs.get(id).is_some_and(|j| j.key == *key));
                if !behind {
                    s.fence.paused_keys.insert(key.clone());
                    out.push(key.clone());
                }
            }
            Ok(out)
        })
    }

    fn purge_key(&self, shard: &str, key: &str) -> Result<u64, QueueError> {
        self.with_shard(shard, |s| {
            let mut gone = Vec::new();
            if let Some(q) = s.keys.remove(key) {
                for id in q {
                    s.jobs.remove(&id);
                    gone.push(id.0);
                }
            }
            let dead: Vec<JobId> = s
                .dead
                .iter()
                .copied()
                .filter(|id| s.jobs.get(id).is_some_and(|j| j.key == key))
                .collect();
            for id in dead {
                s.dead.remove(&id);
                s.jobs.remove(&id);
                gone.push(id.0);
            }
            s.halted_keys.remove(key);
            let n = gone.len() as u64;
            s.moved.note(key, gone);
            Ok(n)
        })
    }

    fn moved_away(&self, shard: &str, id: JobId) -> Result<Option<String>, QueueError> {
        self.with_shard(shard, |s| Ok(s.moved.key_of(id.0).map(str::to_string)))
    }

    fn imported_as(
        &self,
        shard: &str,
        from: &str,
        source_id: JobId,
    ) -> Result<Option<JobId>, QueueError> {
        self.with_shard(shard, |s| {
            Ok(s.moved_in.new_id_of(from, source_id.0).map(JobId))
        })
    }
}

impl InspectJobs for MemoryBackend {
    fn key_hold(&self, shard: &str, key: &str) -> Result<Option<KeyHold>, QueueError> {
        let now = self.clock.now_ms();
        self.with_shard(shard, |s| Ok(hold_of(s, key, now)))
    }

    fn resume_key(&self, shard: &str, key: &str) -> Result<KeyResume, QueueError> {
        let now = self.clock.now_ms();
        self.with_shard(shard, |s| {
            if s.fence.sealed_keys.contains_key(key) {
                return Ok(KeyResume::Moving);
            }
            let Some(hold) = hold_of(s, key, now) else {
                return Ok(KeyResume::NotHeld);
            };
            for id in &hold.jobs {
                if let Some(j) = s.jobs.get_mut(id) {
                    j.not_before_ms = now;
                    j.backed_off = false;
                }
            }
            Ok(KeyResume::Resumed(hold))
        })
    }

    fn key_counts(&self, shard: &str, key: &str) -> Result<KeyCounts, QueueError> {
        self.with_shard(shard, |s| Ok(counts(s, key)))
    }

    fn shard_stats(&self, shard: &str) -> Result<ShardStats, QueueError> {
        let now = self.clock.now_ms();
        self.with_shard(shard, |s| {
            let mut stats = ShardStats {
                name: shard.to_string(),
                in_flight: s.in_flight.len() as u64,
                dead: s.dead.len() as u64,
                fence_high: s.fence_high,
                ..ShardStats::default()
            };
            let mut keys = BTreeSet::new();
            for (k, q) in &s.keys {
                keys.insert(k.clone());
                for id in q {
                    match s.jobs.get(id) {
                        Some(j) if j.not_before_ms > now => stats.delayed += 1,
                        Some(_) => stats.ready += 1,
                        None => {}
                    }
                }
            }
            keys.extend(s.busy.keys().cloned());
            stats.keys = keys.len() as u64;
            Ok(stats)
        })
    }

    fn dead_list(&self, shard: &str, limit: usize) -> Result<Vec<DeadJob>, QueueError> {
        self.with_shard(shard, |s| {
            Ok(s.dead
                .iter()
                .take(limit)
                .filter_map(|id| {
                    s.jobs.get(id).map(|j| DeadJob {
                        shard: shard.to_string(),
                        id: *id,
                        key: j.key.clone(),
                        attempts: j.attempt,
                        reason: j.reason.clone(),
                        attempt_starts_ms: j.starts.clone(),
                    })
                })
                .collect())
        })
    }

    fn dead_retry(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.with_shard(shard, |s| {
            let chosen = chosen_dead(s, ids);
            for id in chosen.iter().rev() {
                s.dead.remove(id);
                if let Some(j) = s.jobs.get_mut(id) {
                    j.attempt = 0;
                    j.starts.clear();
                    let key = j.key.clone();
                    s.halted_keys.remove(&key);
                    back_in_order(s, key, *id);
                }
            }
            Ok(chosen.len())
        })
    }

    fn dead_purge(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.with_shard(shard, |s| {
            let chosen = chosen_dead(s, ids);
            for id in &chosen {
                s.dead.remove(id);
                if let Some(j) = s.jobs.remove(id) {
                    s.halted_keys.remove(&j.key);
                }
            }
            Ok(chosen.len())
        })
    }

    fn job(&self, shard: &str, id: JobId) -> Result<Option<JobInfo>, QueueError> {
        let now = self.clock.now_ms();
        self.with_shard(shard, |s| Ok(job_info(s, id, now)))
    }

    fn key_jobs(&self, shard: &str, key: &str, max: usize) -> Result<Vec<JobInfo>, QueueError> {
        let now = self.clock.now_ms();
        self.with_shard(shard, |s| {
            let mut ids: Vec<JobId> = s
                .jobs
                .iter()
                .filter(|(_, j)| j.key == key)
                .map(|(id, _)| *id)
                .collect();
            ids.sort_unstable();
            ids.truncate(max.min(KEY_JOBS_MAX));
            Ok(ids
                .into_iter()
                .filter_map(|id| job_info(s, id, now))
                .collect())
        })
    }

    fn cancel(&self, shard: &str, id: JobId) -> Result<CancelOutcome, QueueError> {
        let (now, retention) = (self.clock.now_ms(), self.retention);
        self.with_shard(shard, |s| {
            let Some(j) = s.jobs.get(&id) else {
                return Ok(CancelOutcome::NotFound);
            };
            if let Some(run) = s.in_flight.get_mut(&id) {
                run.cancelled = true;
                return Ok(CancelOutcome::Stopping);
            }
            if s.fence.sealed_keys.contains_key(&j.key) {
                return Ok(CancelOutcome::Moving);
            }
            let key = j.key.clone();
            if s.dead.remove(&id) {
                s.halted_keys.remove(&key);
            } else if let Some(q) = s.keys.get_mut(&key) {
                q.retain(|&i| i != id);
                if q.is_empty() {
                    s.keys.remove(&key);
                }
            }
            if let Some(j) = s.jobs.remove(&id) {
                note_finished(s, id, j, Finish::Cancelled, now, retention, None);
            }
            Ok(CancelOutcome::Cancelled)
        })
    }

    fn finished(
        &self,
        shard: &str,
        key: Option<&str>,
        max: usize,
    ) -> Result<Vec<FinishedJob>, QueueError> {
        let (now, retention) = (self.clock.now_ms(), self.retention);
        self.with_shard(shard, |s| {
            Ok(s.finished
                .iter()
                .take(retention.finished_jobs)
                .take_while(|f| retention.keeps(f.finished_ms, now))
                .filter(|f| key.is_none_or(|k| f.key == k))
                .take(max)
                .cloned()
                .collect())
        })
    }
}

impl KeyInventory for MemoryBackend {
    fn keys_with_work(&self, shard: &str) -> Result<Vec<(String, KeyCounts)>, QueueError> {
        self.with_shard(shard, |s| {
            let dead_keys: Vec<&String> = s
                .dead
                .iter()
                .filter_map(|id| s.jobs.get(id).map(|j| &j.key))
                .collect();
            let keys: BTreeSet<&String> = s
                .keys
                .keys()
                .chain(s.busy.keys())
                .chain(dead_keys)
                .collect();
            Ok(keys
                .into_iter()
                .map(|k| (k.clone(), counts(s, k)))
                .collect())
        })
    }
}

/// A [`MapStore`] in memory, with a real rebalance lock.
#[derive(Debug, Clone)]
pub struct MemoryMapStore {
    inner: Arc<Mutex<(ShardMap, Option<ShardMap>)>>,
    lock: Arc<Mutex<bool>>,
    settings: Arc<Mutex<BTreeMap<String, String>>>,
}

impl MemoryMapStore {
    /// A store publishing `map`.
    pub fn new(map: ShardMap) -> MemoryMapStore {
        MemoryMapStore {
            inner: Arc::new(Mutex::new((map, None))),
            lock: Arc::new(Mutex::new(false)),
            settings: Arc::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, (ShardMap, Option<ShardMap>)> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct MemoryLockGuard(Arc<Mutex<bool>>);

impl Drop for MemoryLockGuard {
    fn drop(&mut self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = false;
    }
}

impl MapStore for MemoryMapStore {
    fn load(&self) -> Result<ShardMap, ReshardError> {
        Ok(self.state().0.clone())
    }

    fn publish(&self, map: &ShardMap, expected_version: u64) -> Result<(), ReshardError> {
        let mut st = self.state();
        if st.0.version != expected_version {
            return Err(ReshardError::Conflict {
                expected: expected_version,
                found: st.0.version,
            });
        }
        if map.version <= expected_version {
            return Err(ReshardError::Invalid(format!(
                "new map version {} must be greater than {expected_version}",
                map.version
            )));
        }
        map.validate()?;
        st.0 = map.clone();
        Ok(())
    }

    fn load_target(&self) -> Result<Option<ShardMap>, ReshardError> {
        Ok(self.state().1.clone())
    }

    fn store_target(&self, target: &ShardMap) -> Result<(), ReshardError> {
        self.state().1 = Some(target.clone());
        Ok(())
    }

    fn clear_target(&self, reached: &ShardMap) -> Result<bool, ReshardError> {
        let mut st = self.state();
        if st
            .1
            .as_ref()
            .is_some_and(|t| !crate::reshard::same_target(t, reached))
        {
            return Ok(false);
        }
        st.1 = None;
        Ok(true)
    }

    fn load_setting(&self, name: &str) -> Result<Option<String>, ReshardError> {
        crate::reshard::validate_setting_name(name)?;
        let settings = self.settings.lock().unwrap_or_else(|e| e.into_inner());
        Ok(settings.get(name).cloned())
    }

    fn swap_setting(
        &self,
        name: &str,
        expected: Option<&str>,
        value: Option<&str>,
    ) -> Result<bool, ReshardError> {
        crate::reshard::validate_setting_name(name)?;
        let mut settings = self.settings.lock().unwrap_or_else(|e| e.into_inner());
        if settings.get(name).map(String::as_str) != expected {
            return Ok(false);
        }
        match value {
            Some(v) => settings.insert(name.to_string(), v.to_string()),
            None => settings.remove(name),
        };
        Ok(true)
    }

    fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, ReshardError> {
        let mut held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if *held {
            return Err(ReshardError::Busy {
                holder: "this process".into(),
            });
        }
        *held = true;
        Ok(Box::new(MemoryLockGuard(self.lock.clone())))
    }
}

/// A [`crate::Coordinator`] that owns every shard of a [`MemoryBackend`],
/// including shards added later: one process, no leases.
#[derive(Debug)]
pub struct MemoryCoordinator {
    backend: MemoryBackend,
    owned: Vec<String>,
}

impl MemoryCoordinator {
    /// A coordinator over `backend`.
    pub fn new(backend: MemoryBackend) -> MemoryCoordinator {
        MemoryCoordinator {
            backend,
            owned: Vec::new(),
        }
    }
}

impl crate::Coordinator for MemoryCoordinator {
    fn tick(&mut self) -> Result<crate::Ownership, QueueError> {
        let all = self.backend.shard_names();
        let gained: Vec<String> = all
            .iter()
            .filter(|s| !self.owned.contains(s))
            .cloned()
            .collect();
        self.owned = all.clone();
        Ok(crate::Ownership {
            owned: all,
            gained,
            lost: Vec::new(),
        })
    }

    fn stop_claiming(&mut self) {}

    fn release_all(&mut self) -> Result<(), QueueError> {
        self.owned.clear();
        Ok(())
    }

    fn tick_interval_ms(&self) -> u64 {
        5
    }

    fn standby_reason(&self) -> String {
        "the memory backend has no shards".into()
    }
}
