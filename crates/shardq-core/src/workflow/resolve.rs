//! The resolver: the pass every worker and server runs that records the
//! ends of dependencies and releases (or fails) the dependents whose
//! dependencies have all ended. The argument is in `mod.rs`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use base64::Engine as _;

use super::batch::{callback_dedup_id, done as batch_done, due as batch_due, CallbackKind};
use super::record::{ended, room};
use super::{
    parse_dependency, release_dedup_id_of, DepOutcome, DepRef, OnDependencyFailure, WaitState,
    Waiting, WaitingFile, WaitingStore, FORGOTTEN_AFTER_MS, FORGOTTEN_MOVED_AFTER_MS,
    RELEASE_DEDUP_WINDOW_MS, RESOLVE_EVERY_MS,
};
use crate::backend::{find_job, JobLookup, QueueBackend};
use crate::clock::Clock;
use crate::error::QueueError;
use crate::job::{FinishedJob, JobId, NewJob, FINISHED_JOBS_KEPT_MAX};
use crate::producer::{ProduceError, Producer, ProducerOptions};
use crate::reshard::{MapStore, ReshardError};

/// Most dependents released in one call of [`Release::release_all`].
const RELEASE_CHUNK: usize = 1_000;
/// Most dependencies one pass looks up (the rest wait for the next).
const LOOKUPS_PER_PASS_MAX: usize = 20_000;
/// Most dependencies a pass looks up by id (live, or followed through
/// moves) when their shards' finished and dead lists do not show them
/// ended: a thousand queued children would cost a thousand reads a pass
/// otherwise, and a slow pass lets the retention forget what it has not
/// seen yet. The next pass goes on from there.
const PROBES_PER_PASS: usize = 64;
/// Newest finished jobs of a shard a pass reads ...
const FINISHED_READ_RECENT: usize = 2_000;
/// ... and how often it reads all the shard keeps instead (2 s).
const FULL_READ_EVERY_MS: u64 = 2_000;
/// Shortest time between two probes of one dependency (1 s).
const PROBE_GAP_MS: u64 = 1_000;
/// Most dead letters of a shard a pass reads (the rest are found by
/// probes).
const DEAD_READ_MAX: usize = 1_000;

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassReport {
    /// Dependency ends recorded.
    pub recorded: usize,
    /// Dependents released: their number and the job (`SHARD:ID`).
    pub released: Vec<(u64, String)>,
    /// Dependents failed: their number and why.
    pub failed: Vec<(u64, String)>,
    /// Batch callbacks enqueued: the batch, the kind, the job.
    pub fired: Vec<(u64, CallbackKind, String)>,
    /// Dependents still waiting after the pass.
    pub waiting: usize,
    /// Lookups or releases that failed (tried again next pass).
    pub errors: Vec<String>,
    /// Time spent enqueueing released jobs and callbacks (ms): work done
    /// for the jobs, not the pass's own cost.
    pub release_ms: u64,
}

/// One finding of a pass: dependency `idx` of dependent `n` ended.
struct Finding {
    n: u64,
    idx: usize,
    outcome: DepOutcome,
    at: Option<String>,
    result: Option<Vec<u8>>,
    reason: Option<String>,
}

/// What one pass's lookups share: the map it routes by, the lists it has
/// read, its bounds spent so far and what it found.
struct LookPass<'a> {
    backend: &'a dyn QueueBackend,
    file: &'a WaitingFile,
    shards: Vec<String>,
    router: shardq_route::Router,
    lists: PassLists,
    now: u64,
    /// Probes spent ([`PROBES_PER_PASS`]).
    probes: usize,
    /// Whether every shard of the map answers, read once a pass when
    /// needed.
    all_readable: Option<bool>,
    /// Whether a lookup ran out of probes and set the next pass's cursor.
    cursor_set: bool,
    out: Vec<Finding>,
    errors: &'a mut Vec<String>,
}

/// Each shard's finished jobs and dead letters, read at most once a pass:
/// the finished list whole for the shards in `full`, else its newest
/// [`FINISHED_READ_RECENT`]; the dead letters up to [`DEAD_READ_MAX`].
struct PassLists {
    full: HashSet<String>,
    finished: HashMap<String, HashMap<JobId, FinishedJob>>,
    dead: HashMap<String, HashMap<JobId, Option<String>>>,
}

impl PassLists {
    fn new(full: HashSet<String>) -> PassLists {
        PassLists {
            full,
            finished: HashMap::new(),
            dead: HashMap::new(),
        }
    }

    /// Job `id` as shard `s` lists it among its finished jobs.
    fn finished(
        &mut self,
        backend: &dyn QueueBackend,
        s: &str,
        id: JobId,
    ) -> Result<Option<FinishedJob>, QueueError> {
        if !self.finished.contains_key(s) {
            let max = if self.full.contains(s) {
                FINISHED_JOBS_KEPT_MAX
            } else {
                FINISHED_READ_RECENT
            };
            let list = backend.finished(s, None, max)?;
            self.finished
                .insert(s.to_string(), list.into_iter().map(|f| (f.id, f)).collect());
        }
        Ok(self.finished.get(s).and_then(|m| m.get(&id)).cloned())
    }

    /// Job `id`'s dead letter on shard `s` (its reason), if it has one.
    fn dead(
        &mut self,
        backend: &dyn QueueBackend,
        s: &str,
        id: JobId,
    ) -> Result<Option<Option<String>>, QueueError> {
        if !self.dead.contains_key(s) {
            let list = backend.dead_list(s, DEAD_READ_MAX)?;
            self.dead.insert(
                s.to_string(),
                list.into_iter().map(|d| (d.id, Some(d.reason))).collect(),
            );
        }
        Ok(self.dead.get(s).and_then(|m| m.get(&id)).cloned())
    }
}

/// Why a release failed, and whether trying again can help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseError {
    /// What went wrong.
    pub text: String,
    /// The job itself was refused (bad input, for example a payload over
    /// the releasing process's `--payload-bytes-max`): the same release
    /// would be refused again, so the record ends as failed instead of
    /// waiting forever.
    pub for_good: bool,
}

impl ReleaseError {
    /// A failure that may pass (tried again next pass).
    pub fn again(text: impl Into<String>) -> ReleaseError {
        ReleaseError {
            text: text.into(),
            for_good: false,
        }
    }

    /// A producer's failure: for good when it is bad input about the job,
    /// not about where it goes (an unknown shard may be one a live
    /// `add-shard` has not opened here yet).
    pub fn of(e: &ProduceError) -> ReleaseError {
        fn for_good(e: &ProduceError) -> bool {
            match e {
                ProduceError::Queue(QueueError::UnknownShard { .. }) => false,
                ProduceError::Partial { cause, .. } => for_good(cause),
                e => e.kind() == crate::ErrorKind::BadInput,
            }
        }
        ReleaseError {
            text: e.to_string(),
            for_good: for_good(e),
        }
    }
}

impl From<&str> for ReleaseError {
    fn from(text: &str) -> ReleaseError {
        ReleaseError::again(text)
    }
}

impl std::fmt::Display for ReleaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// One release's answer: the shard and id stored (a duplicate's: the
/// first release's).
pub type Released = Result<(String, JobId), ReleaseError>;

/// How a pass enqueues a released dependent: a routing producer in a
/// worker ([`Producer`], with the release's dedup window), a fixed shard in
/// the contract's check.
pub trait Release {
    /// Enqueues `job` (it carries its dedup id `after:@N.NONCE`).
    fn release(&mut self, job: &NewJob) -> Released;

    /// Enqueues `jobs`, each answered in order (a batch's many jobs go
    /// together: one append per shard). By default one at a time.
    fn release_all(&mut self, jobs: &[NewJob]) -> Vec<Released> {
        jobs.iter().map(|j| self.release(j)).collect()
    }
}

impl Release for Producer<dyn QueueBackend> {
    fn release(&mut self, job: &NewJob) -> Released {
        self.enqueue(job)
            .map(|p| (p.shard, p.id))
            .map_err(|e| ReleaseError::of(&e))
    }

    /// One call for all; when the call is refused for good (one bad job
    /// refuses the whole call), the jobs it did not place are released
    /// one at a time, so only the bad one is refused.
    fn release_all(&mut self, jobs: &[NewJob]) -> Vec<Released> {
        let (placed, failure) = match self.enqueue_batch(jobs) {
            Ok(p) => (p, None),
            Err(ProduceError::PausedTooLong { placed, keys, .. }) => {
                let e = ReleaseError::again(format!("keys {keys:?} stayed paused by a move"));
                (placed, Some(e))
            }
            Err(ProduceError::Partial { placed, cause }) => {
                (placed, Some(ReleaseError::of(&cause)))
            }
            Err(e) => (Vec::new(), Some(ReleaseError::of(&e))),
        };
        let mut out: Vec<Option<Released>> = vec![None; jobs.len()];
        for p in placed {
            if let Some(o) = out.get_mut(p.index) {
                *o = Some(Ok((p.shard, p.id)));
            }
        }
        let one_by_one = jobs.len() > 1 && failure.as_ref().is_some_and(|e| e.for_good);
        out.into_iter()
            .zip(jobs)
            .map(|(o, job)| match o {
                Some(r) => r,
                None if one_by_one => self.release(job),
                None => Err(failure
                    .clone()
                    .unwrap_or_else(|| ReleaseError::again("not placed"))),
            })
            .collect()
    }
}

/// A producer for releases: the release's dedup window, and a short wait
/// for a key paused by a move (the release is tried again next pass).
pub fn release_producer(
    backend: Arc<dyn QueueBackend>,
    maps: Arc<dyn MapStore>,
    clock: Arc<dyn Clock>,
) -> Result<Producer<dyn QueueBackend>, ProduceError> {
    Producer::new(
        backend,
        maps,
        ProducerOptions {
            clock,
            dedup_window_ms: RELEASE_DEDUP_WINDOW_MS,
            pause_wait_ms: 1_000,
            ..ProducerOptions::default()
        },
    )
}

/// Resolves the deployment's dependents (see the module header).
pub struct Resolver {
    maps: Arc<dyn MapStore>,
    clock: Arc<dyn Clock>,
    /// When each (dependent, dependency) was first found nowhere.
    missing_since: HashMap<(u64, usize), u64>,
    /// The dependency the next pass starts at, as (dependent, index in
    /// its `after`): where this one ran out of lookups or probes.
    cursor: (u64, usize),
    /// When each shard's finished jobs were last read whole.
    full_read_at: HashMap<String, u64>,
    /// When each (dependent, dependency) was last probed.
    probed_at: HashMap<(u64, usize), u64>,
    /// Where a probe last found a dependency that moved with its key (its
    /// copy), whose shard's lists the fast path then reads.
    located: HashMap<(u64, usize), (String, JobId)>,
    /// The waiting document as last read or written, parsed.
    cache: Option<(String, WaitingFile)>,
}

impl Resolver {
    /// A resolver over the deployment's map store (its map routes the
    /// lookups; its `waiting` setting holds the dependents).
    pub fn new(maps: Arc<dyn MapStore>, clock: Arc<dyn Clock>) -> Resolver {
        Resolver {
            maps,
            clock,
            missing_since: HashMap::new(),
            cursor: (0, 0),
            full_read_at: HashMap::new(),
            probed_at: HashMap::new(),
            located: HashMap::new(),
            cache: None,
        }
    }

    /// One pass over `backend`: records what ended, then decides each
    /// dependent whose dependencies all have an outcome, from the stored
    /// outcomes only, releasing through `release`.
    pub fn pass(
        &mut self,
        backend: &dyn QueueBackend,
        release: &mut dyn Release,
    ) -> Result<PassReport, ReshardError> {
        let mut report = PassReport::default();
        let file = WaitingStore::load_cached(&*self.maps, &mut self.cache)?;
        if file.waiting() == 0 {
            return Ok(report);
        }
        let findings = self.look(backend, &file, &mut report)?;
        report.recorded = findings.len();
        let stored = if findings.is_empty() {
            file
        } else {
            let now = self.clock.now_ms();
            WaitingStore::update_cached(&*self.maps, &mut self.cache, |f, len| {
                apply(f, &findings, len);
                f.trim(now);
                Ok::<_, ReshardError>(f.clone())
            })?
        };
        self.decide(backend, release, &stored, &mut report)?;
        // What still waits, from the document this pass decided on (not
        // read again: it sets only how soon the next pass runs).
        report.waiting = stored
            .waiting()
            .saturating_sub(report.released.len() + report.failed.len());
        Ok(report)
    }

    /// Looks up every unresolved dependency (up to the per-pass bound),
    /// from where the last pass ran out of its bounds.
    fn look(
        &mut self,
        backend: &dyn QueueBackend,
        file: &WaitingFile,
        report: &mut PassReport,
    ) -> Result<Vec<Finding>, ReshardError> {
        self.forget_ended(file);
        let map = self.maps.load()?;
        let router = shardq_route::Router::new(map.clone())?;
        let shards: Vec<String> = map.shards.iter().map(|s| s.name.clone()).collect();
        let full = self.full_reads_due(file, &shards);
        let mut pass = LookPass {
            backend,
            file,
            shards,
            router,
            lists: PassLists::new(full),
            now: self.clock.now_ms(),
            probes: 0,
            all_readable: None,
            cursor_set: false,
            out: Vec::new(),
            errors: &mut report.errors,
        };
        let waiting = self.round_from_cursor(file);
        self.cursor = (0, 0);
        let mut looked = 0;
        'dependents: for (n, w, range) in waiting {
            // Ends in the shards' finished and dead lists are seen every
            // pass; probes (a job looked up by id, followed through moves)
            // are bounded per pass and per dependency.
            for idx in range {
                if w.after[idx].outcome.is_some() {
                    continue;
                }
                if looked >= LOOKUPS_PER_PASS_MAX {
                    if !pass.cursor_set {
                        self.cursor = (n, idx);
                    }
                    break 'dependents;
                }
                looked += 1;
                self.look_one(&mut pass, n, w, idx);
            }
        }
        Ok(pass.out)
    }

    /// What this resolver remembers of dependents that no longer wait
    /// goes.
    fn forget_ended(&mut self, file: &WaitingFile) {
        let waits = |n: &u64| {
            file.jobs
                .get(n)
                .is_some_and(|w| w.state == WaitState::Waiting)
        };
        self.probed_at.retain(|(n, _), _| waits(n));
        self.located.retain(|(n, _), _| waits(n));
        self.missing_since.retain(|(n, _), _| waits(n));
    }

    /// The shards whose finished lists this pass reads whole: each one
    /// every [`FULL_READ_EVERY_MS`] (what finished since the last pass is
    /// among the newest [`FINISHED_READ_RECENT`] unless the shard finished
    /// more), and all of them while more dependencies are unresolved than
    /// that recent read holds (a batch of thousands of jobs).
    fn full_reads_due(&mut self, file: &WaitingFile, shards: &[String]) -> HashSet<String> {
        let now = self.clock.now_ms();
        let unresolved = file
            .jobs
            .values()
            .filter(|w| w.state == WaitState::Waiting)
            .flat_map(|w| w.after.iter())
            .filter(|d| d.outcome.is_none())
            .count();
        let mut full = HashSet::new();
        for s in shards {
            let due = unresolved > FINISHED_READ_RECENT
                || self
                    .full_read_at
                    .get(s)
                    .is_none_or(|t| now.saturating_sub(*t) >= FULL_READ_EVERY_MS);
            if due {
                self.full_read_at.insert(s.clone(), now);
                full.insert(s.clone());
            }
        }
        full
    }

    /// The waiting dependents in the order this pass looks at them, each
    /// with the range of its dependencies to look at: from the cursor
    /// round the document and back to it, so a later dependent is not left
    /// behind by earlier ones with many dependencies. The cursor is a
    /// dependency, not a dependent: a batch of thousands of queued jobs
    /// would otherwise spend every pass's probes on its first few hundred.
    fn round_from_cursor<'f>(
        &self,
        file: &'f WaitingFile,
    ) -> Vec<(u64, &'f Waiting, Range<usize>)> {
        let (cursor, cursor_idx) = self.cursor;
        file.jobs
            .range(cursor..)
            .map(|(n, w)| {
                let from = if *n == cursor { cursor_idx } else { 0 };
                (*n, w, from.min(w.after.len())..w.after.len())
            })
            .chain(
                file.jobs
                    .range(..cursor)
                    .map(|(n, w)| (*n, w, 0..w.after.len())),
            )
            .chain(
                file.jobs
                    .get_key_value(&cursor)
                    .filter(|_| cursor_idx > 0)
                    .map(|(n, w)| (*n, w, 0..cursor_idx.min(w.after.len()))),
            )
            .filter(|(_, w, _)| w.state == WaitState::Waiting)
            .collect()
    }

    /// Looks up dependency `idx` of dependent `n` (`w`), which has no
    /// outcome yet, and adds a finding to the pass when it has ended.
    fn look_one(&mut self, pass: &mut LookPass<'_>, n: u64, w: &Waiting, idx: usize) {
        let d = &w.after[idx];
        let Ok(dep) = parse_dependency(&d.id) else {
            return;
        };
        let (shard, id, at) = match dep {
            DepRef::Job(s, id) => (s, id, None),
            DepRef::Node(_) => return,
            DepRef::Waiting(m) => match self.dependent_ran_as(pass, n, idx, m) {
                Some(place) => place,
                None => return,
            },
        };
        // The fast path: where it ran (its copy, once a probe found it
        // moved), as listed once a pass.
        let (shard, id) = self.located.get(&(n, idx)).cloned().unwrap_or((shard, id));
        let backend = pass.backend;
        let listed = match pass.lists.finished(backend, &shard, id) {
            Ok(Some(f)) => Some(JobLookup::Finished(shard.clone(), f)),
            Ok(None) => match pass.lists.dead(backend, &shard, id) {
                Ok(Some(reason)) => {
                    self.missing_since.remove(&(n, idx));
                    pass.out.push(Finding {
                        n,
                        idx,
                        outcome: DepOutcome::Dead,
                        at,
                        result: None,
                        reason,
                    });
                    return;
                }
                _ => None,
            },
            Err(e) => {
                pass.errors
                    .push(format!("dependency {} of @{n}: {e}", d.id));
                return;
            }
        };
        if listed.is_none() {
            let recent = self
                .probed_at
                .get(&(n, idx))
                .is_some_and(|t| pass.now.saturating_sub(*t) < PROBE_GAP_MS);
            if recent {
                return;
            }
            if pass.probes >= PROBES_PER_PASS {
                if !pass.cursor_set {
                    self.cursor = (n, idx);
                    pass.cursor_set = true;
                }
                return;
            }
            pass.probes += 1;
            self.probed_at.insert((n, idx), pass.now);
        }
        let found = match listed {
            Some(l) => Ok(l),
            None => {
                let router = &pass.router;
                let routed = |key: &str| Some(router.route(key).to_string());
                let lists = &mut pass.lists;
                let mut finished = |s: &str, id: JobId| lists.finished(backend, s, id);
                find_job(backend, &pass.shards, &routed, &mut finished, &shard, id)
            }
        };
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                pass.errors
                    .push(format!("dependency {} of @{n}: {e}", d.id));
                return;
            }
        };
        self.note_found(pass, n, idx, (&shard, id), at, found);
    }

    /// Dependency `idx` of dependent `n` is itself a dependent, `@m`: ended
    /// (a finding added to the pass) when it failed or was cancelled;
    /// else, once released, the job it was released as, to look up.
    fn dependent_ran_as(
        &mut self,
        pass: &mut LookPass<'_>,
        n: u64,
        idx: usize,
        m: u64,
    ) -> Option<(String, JobId, Option<String>)> {
        let Some(o) = pass.file.jobs.get(&m) else {
            pass.out.extend(self.missing(n, idx, pass.now));
            return None;
        };
        match o.state {
            WaitState::Waiting => None,
            WaitState::Failed | WaitState::Cancelled => {
                pass.out.push(Finding {
                    n,
                    idx,
                    outcome: DepOutcome::Failed,
                    at: None,
                    result: None,
                    reason: o.reason.clone(),
                });
                None
            }
            WaitState::Released => match o.released.as_deref().map(parse_dependency) {
                Some(Ok(DepRef::Job(s, id))) => {
                    let at = format!("{s}:{}", id.0);
                    Some((s, id, Some(at)))
                }
                _ => None,
            },
        }
    }

    /// What a lookup of dependency `idx` of dependent `n` (looked for as
    /// `looked`, first known `at`) found: a finding when it ended; where
    /// it lives when it moved; the grace before `forgotten` when it is
    /// nowhere.
    fn note_found(
        &mut self,
        pass: &mut LookPass<'_>,
        n: u64,
        idx: usize,
        looked: (&str, JobId),
        at: Option<String>,
        found: JobLookup,
    ) {
        let backend = pass.backend;
        let d = &pass.file.jobs[&n].after[idx];
        let place = match &found {
            JobLookup::Live(s, j) => Some(format!("{s}:{}", j.id.0)),
            JobLookup::Finished(s, f) => Some(format!("{s}:{}", f.id.0)),
            _ => None,
        };
        match ended(&found) {
            Some((outcome, result, reason)) => {
                self.missing_since.remove(&(n, idx));
                let at = at.or(place).filter(|p| *p != d.id);
                pass.out.push(Finding {
                    n,
                    idx,
                    outcome,
                    at,
                    result,
                    reason,
                });
            }
            None if matches!(found, JobLookup::Live(..)) => {
                self.missing_since.remove(&(n, idx));
                if let JobLookup::Live(s, j) = &found {
                    if (s.as_str(), j.id) != looked {
                        self.located.insert((n, idx), (s.clone(), j.id));
                    }
                }
            }
            // Moved with its key and no copy found: its new shard may not
            // answer for a while, so the grace is longer. Its copy may be
            // on a shard that does not answer: the lookup passes over such
            // a shard, so while any shard of the map cannot be read the
            // grace does not run.
            None if matches!(found, JobLookup::Moved { .. }) => {
                let shards = &pass.shards;
                let readable = *pass
                    .all_readable
                    .get_or_insert_with(|| shards.iter().all(|s| backend.fence(s).is_ok()));
                if !readable {
                    self.missing_since.remove(&(n, idx));
                    return;
                }
                pass.out
                    .extend(self.missing_for(n, idx, pass.now, FORGOTTEN_MOVED_AFTER_MS));
            }
            None => pass.out.extend(self.missing(n, idx, pass.now)),
        }
    }

    /// A dependency found nowhere: `forgotten` once it has been missing
    /// for [`FORGOTTEN_AFTER_MS`] (seen by this resolver).
    fn missing(&mut self, n: u64, idx: usize, now: u64) -> Option<Finding> {
        self.missing_for(n, idx, now, FORGOTTEN_AFTER_MS)
    }

    /// As [`Resolver::missing`], with a grace of `grace_ms`.
    fn missing_for(&mut self, n: u64, idx: usize, now: u64, grace_ms: u64) -> Option<Finding> {
        let since = *self.missing_since.entry((n, idx)).or_insert(now);
        if now.saturating_sub(since) < grace_ms {
            return None;
        }
        self.missing_since.remove(&(n, idx));
        Some(Finding {
            n,
            idx,
            outcome: DepOutcome::Forgotten,
            at: None,
            result: None,
            reason: Some(
                "it was nowhere: purged, or finished and forgotten by the retention before it was seen"
                    .into(),
            ),
        })
    }

    /// Releases or fails each waiting dependent whose stored dependencies
    /// all have an outcome, fires each batch's callbacks due, and records
    /// it all in one compare-and-set.
    fn decide(
        &mut self,
        backend: &dyn QueueBackend,
        release: &mut dyn Release,
        stored: &WaitingFile,
        report: &mut PassReport,
    ) -> Result<(), ReshardError> {
        let mut d = Decisions::default();
        let mut to_release: Vec<(u64, NewJob)> = Vec::new();
        for (n, w) in stored
            .jobs
            .iter()
            .filter(|(_, w)| w.state == WaitState::Waiting)
        {
            if w.batch.is_some() {
                fire_due(release, *n, w, &mut d, report);
                continue;
            }
            if w.after.iter().any(|d| d.outcome.is_none()) {
                continue;
            }
            if let Some(why) = failure(w) {
                d.failed.insert(*n, why);
                continue;
            }
            to_release.push((
                *n,
                NewJob {
                    key: w.key.clone(),
                    payload: w.payload(),
                    delay_ms: w.delay_ms,
                    max_attempts: w.max_attempts,
                    dedup_id: Some(release_dedup_id_of(*n, w)),
                    keyed: None,
                },
            ));
        }
        // Released together: a batch's thousand jobs are one append per
        // shard, not a thousand.
        let releasing = std::time::Instant::now();
        for chunk in to_release.chunks(RELEASE_CHUNK) {
            let jobs: Vec<NewJob> = chunk.iter().map(|(_, j)| j.clone()).collect();
            for ((n, _), r) in chunk.iter().zip(release.release_all(&jobs)) {
                match r {
                    Ok((shard, id)) => {
                        d.released.insert(*n, format!("{shard}:{}", id.0));
                    }
                    // Refused for good: it would be refused every pass, so
                    // it ends as failed (its own dependents then see it
                    // failed) rather than wait forever.
                    Err(e) if e.for_good => {
                        d.failed.insert(*n, format!("its release was refused: {e}"));
                    }
                    Err(e) => report.errors.push(format!("releasing @{n}: {e}")),
                }
            }
        }
        report.release_ms += releasing.elapsed().as_millis() as u64;
        if d.is_empty() {
            return Ok(());
        }
        let now = self.clock.now_ms();
        let late = WaitingStore::update_cached(&*self.maps, &mut self.cache, |f, _| {
            let late = d.apply(f, now);
            f.trim(now);
            Ok::<_, ReshardError>(late)
        })?;
        // A dependent cancelled while it was released: its job is
        // cancelled.
        for at in late {
            if let Ok(DepRef::Job(s, id)) = parse_dependency(&at) {
                let _ = backend.cancel(&s, id);
            }
        }
        report.released = d.released.into_iter().collect();
        report.failed = d.failed.into_iter().collect();
        report.fired = d.fired;
        Ok(())
    }
}

/// What a pass decided, to record: dependents released (where to) and
/// failed (why), callbacks fired, batches that may have ended.
#[derive(Default)]
struct Decisions {
    released: BTreeMap<u64, String>,
    failed: BTreeMap<u64, String>,
    fired: Vec<(u64, CallbackKind, String)>,
    /// Callbacks refused for good: the batch, the kind, why.
    refused: Vec<(u64, CallbackKind, String)>,
    batch_ends: Vec<u64>,
}

impl Decisions {
    fn is_empty(&self) -> bool {
        self.released.is_empty()
            && self.failed.is_empty()
            && self.fired.is_empty()
            && self.refused.is_empty()
            && self.batch_ends.is_empty()
    }

    /// Records the decisions in `f` (as read for the compare-and-set) where
    /// they still apply; returns the jobs released for dependents that were
    /// cancelled meanwhile, to cancel.
    fn apply(&self, f: &mut WaitingFile, now: u64) -> Vec<String> {
        let mut late = Vec::new();
        for (n, at) in &self.released {
            match f.jobs.get_mut(n) {
                Some(w) if w.state == WaitState::Waiting => {
                    w.state = WaitState::Released;
                    w.released = Some(at.clone());
                    w.ended_ms = Some(now);
                    // The job carries it now.
                    w.payload_b64 = String::new();
                    if w.member_of.is_some() {
                        f.batch_jobs_released_total += 1;
                    } else {
                        f.released_total += 1;
                    }
                }
                Some(w) if w.state == WaitState::Cancelled => late.push(at.clone()),
                _ => {}
            }
        }
        for (n, why) in &self.failed {
            if let Some(w) = f.jobs.get_mut(n).filter(|w| w.state == WaitState::Waiting) {
                w.state = WaitState::Failed;
                w.reason = Some(why.clone());
                w.ended_ms = Some(now);
                // A batch's job (its release refused for good) is counted
                // by its batch, not among the dependents.
                if w.member_of.is_none() {
                    f.failed_total += 1;
                }
            }
        }
        for (n, kind, at) in &self.fired {
            if let Some(b) = f.jobs.get_mut(n).and_then(|w| w.batch.as_mut()) {
                if !b.fired.contains_key(kind) {
                    b.fired.insert(*kind, at.clone());
                    f.callbacks_fired_total += 1;
                }
            }
        }
        for (n, kind, why) in &self.refused {
            if let Some(b) = f.jobs.get_mut(n).and_then(|w| w.batch.as_mut()) {
                if !b.fired.contains_key(kind) {
                    b.refused.entry(*kind).or_insert_with(|| why.clone());
                }
            }
        }
        for n in &self.batch_ends {
            if let Some(w) = f.jobs.get_mut(n).filter(|w| w.state == WaitState::Waiting) {
                if batch_done(w) {
                    w.state = WaitState::Released;
                    w.ended_ms = Some(now);
                }
            }
        }
        late
    }
}

/// Batch `n` (`w`): enqueues each callback due, with its own dedup id, and
/// notes the batch as possibly ended once it is closed and every job ended
/// (it ends once every callback due has fired, checked on the record).
fn fire_due(
    release: &mut dyn Release,
    n: u64,
    w: &Waiting,
    d: &mut Decisions,
    report: &mut PassReport,
) {
    let Some(b) = &w.batch else {
        return;
    };
    for kind in batch_due(w) {
        let payload = b
            .callbacks
            .get(&kind)
            .and_then(|p| base64::engine::general_purpose::STANDARD.decode(p).ok())
            .unwrap_or_default();
        let job = NewJob {
            key: w.key.clone(),
            payload,
            delay_ms: 0,
            max_attempts: w.max_attempts,
            dedup_id: Some(callback_dedup_id(n, &w.nonce, kind)),
            keyed: None,
        };
        match release.release(&job) {
            Ok((shard, id)) => d.fired.push((n, kind, format!("{shard}:{}", id.0))),
            // Refused for good: it would be refused every pass and keep
            // the batch from completing; recorded as refused, with why.
            Err(e) if e.for_good => {
                report.errors.push(format!(
                    "batch @{n}'s {} callback refused for good: {e}",
                    kind.as_str()
                ));
                d.refused
                    .push((n, kind, format!("its enqueue was refused: {e}")));
            }
            Err(e) => report
                .errors
                .push(format!("batch @{n}'s {} callback: {e}", kind.as_str())),
        }
    }
    if !b.open && w.after.iter().all(|d| d.outcome.is_some()) {
        d.batch_ends.push(n);
    }
}

/// Why a dependent whose dependencies all ended fails, under
/// [`OnDependencyFailure::Fail`]: the first that did not complete.
fn failure(w: &Waiting) -> Option<String> {
    if w.on_failure != OnDependencyFailure::Fail {
        return None;
    }
    let d = w
        .after
        .iter()
        .find(|d| d.outcome.is_some_and(|o| o != DepOutcome::Completed))?;
    let outcome = d.outcome.map(DepOutcome::as_str).unwrap_or("unknown");
    Some(match &d.reason {
        Some(r) => format!("dependency {} ended {outcome}: {r}", d.id),
        None => format!("dependency {} ended {outcome}", d.id),
    })
}

/// Records findings in `f`: a dependency's outcome is set once, and a
/// dependent that no longer waits takes none.
fn apply(f: &mut WaitingFile, findings: &[Finding], stored_len: usize) {
    // Results are kept while the document stays within its bound (its
    // stored length, plus what this adds).
    let mut size = stored_len;
    for x in findings {
        let Some(w) = f
            .jobs
            .get_mut(&x.n)
            .filter(|w| w.state == WaitState::Waiting)
        else {
            continue;
        };
        let left = room(w);
        let ignore = w.on_failure == OnDependencyFailure::Ignore;
        let Some(d) = w.after.get_mut(x.idx).filter(|d| d.outcome.is_none()) else {
            continue;
        };
        d.outcome = Some(x.outcome);
        d.at = x.at.clone();
        d.reason = x
            .reason
            .as_ref()
            .map(|r| crate::job::cut_at_char(r, 512).to_string());
        if let Some(r) = &x.result {
            if ignore && x.outcome != DepOutcome::Completed {
                continue;
            }
            let grows = r.len().div_ceil(3) * 4 + 16;
            if r.len() <= left && size + grows <= super::WAITING_BYTES_MAX {
                d.result_b64 = Some(base64::engine::general_purpose::STANDARD.encode(r));
                size += grows;
            } else {
                d.result_dropped = true;
            }
        }
    }
}

/// Wakes a resolver before its next pass is due: this process ended a
/// job (an ack, a fail, a cancel), which may let a dependent go.
#[derive(Debug, Default)]
pub struct Wake {
    woken: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Wake {
    /// Asks for a pass now.
    pub fn wake(&self) {
        *self.woken.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.cv.notify_all();
    }

    /// Waits up to `ms` (real time) or until woken.
    fn wait_ms(&self, ms: u64) {
        let mut woken = self.woken.lock().unwrap_or_else(|e| e.into_inner());
        if !*woken {
            woken = self
                .cv
                .wait_timeout(woken, std::time::Duration::from_millis(ms))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *woken = false;
    }
}

/// Shortest gap between two passes woken by this process's acks (10 ms),
/// so a stream of acks does not run passes back to back.
const WOKEN_GAP_MS: u64 = 10;
/// The gap after a pass is at least this many times the pass's own time.
const PASS_GAP_FACTOR: u64 = 1;

/// Runs resolver passes until `stop` is set: every
/// [`RESOLVE_EVERY_MS`] while dependents wait (sooner when `wake` is
/// woken, at most every [`WOKEN_GAP_MS`]), four times as seldom while none
/// does, and never sooner after a pass than [`PASS_GAP_FACTOR`] times
/// what it took. Errors go to `on_error`; the loop keeps going.
pub fn run_resolver(
    mut resolver: Resolver,
    backend: Arc<dyn QueueBackend>,
    mut release: Producer<dyn QueueBackend>,
    stop: &std::sync::atomic::AtomicBool,
    on_error: &dyn Fn(String),
    wake: &Wake,
) {
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let started = std::time::Instant::now();
        let mut released_ms = 0;
        let wait = match resolver.pass(&*backend, &mut release) {
            Ok(r) => {
                released_ms = r.release_ms;
                for e in &r.errors {
                    on_error(format!("dependents: {e}"));
                }
                if r.waiting > 0 {
                    RESOLVE_EVERY_MS
                } else {
                    4 * RESOLVE_EVERY_MS
                }
            }
            Err(e) => {
                on_error(format!("dependents: {e}"));
                4 * RESOLVE_EVERY_MS
            }
        };
        // A pass over a large document (a batch of thousands of jobs)
        // takes long: the gap after it grows with it, so passes take at
        // most half a core however often acks wake them.
        // The pass's own cost: what it spent enqueueing is the jobs' work.
        let took = (started.elapsed().as_millis() as u64).saturating_sub(released_ms);
        let gap = WOKEN_GAP_MS.max(took.saturating_mul(PASS_GAP_FACTOR));
        std::thread::sleep(std::time::Duration::from_millis(gap));
        wake.wait_ms(wait.saturating_sub(gap));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{InspectJobs as _, MoveKeys as _, RunJobs as _};
    use crate::clock::ManualClock;
    use crate::memory::{MemoryBackend, MemoryMapStore};
    use crate::workflow::{NewDependent, FORGOTTEN_MOVED_AFTER_MS, SETTING_WAITING};

    /// Releases nothing: the dependent here never gets that far.
    struct Never;

    impl Release for Never {
        fn release(&mut self, _: &NewJob) -> Released {
            Err("not in this test".into())
        }
    }

    /// A dependency that moved away with its key and whose copy is found
    /// nowhere is forgotten only after the grace, and not while a shard
    /// of the map cannot be read (its copy may be there).
    #[test]
    fn a_moved_dependency_is_not_forgotten_while_a_shard_is_unreadable() {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let backend = MemoryBackend::new(&["a", "b"], clock.clone());
        let with_ghost = shardq_route::ShardMap::with_shards(
            shardq_route::Algorithm::default(),
            ["a", "b", "ghost"],
        )
        .unwrap();
        let maps = Arc::new(MemoryMapStore::new(with_ghost.clone()));
        backend
            .enqueue("a", u64::MAX, &[NewJob::new("k", "p")])
            .unwrap();
        let id = backend.key_jobs("a", "k", 1).unwrap()[0].id;
        assert_eq!(backend.purge_key("a", "k").unwrap(), 1);
        let shards = ["a".to_string(), "b".to_string()];
        let mut lookup = |s: &str, id| {
            let mut finished = |s: &str, id| crate::backend::finished_job(&backend, s, id);
            find_job(
                &backend,
                &shards,
                &|_| Some("a".to_string()),
                &mut finished,
                s,
                id,
            )
        };
        let n = WaitingStore::add(
            &*maps,
            &mut lookup,
            clock.now_ms(),
            &[NewDependent {
                job: NewJob::new("d", "x"),
                after: vec![DepRef::Job("a".into(), id)],
                on_failure: OnDependencyFailure::Fail,
            }],
        )
        .unwrap()[0]
            .0;
        let mut r = Resolver::new(maps.clone(), clock.clone());
        for _ in 0..3 {
            let report = r.pass(&backend, &mut Never).unwrap();
            assert!(report.failed.is_empty(), "{report:?}");
            clock.advance(FORGOTTEN_MOVED_AFTER_MS + 1);
        }
        // The ghost leaves the map: the grace starts, and ends.
        let mut map = with_ghost;
        map.shards.retain(|s| s.name != "ghost");
        map.version = 2;
        maps.publish(&map, 1).unwrap();
        let report = r.pass(&backend, &mut Never).unwrap();
        assert!(report.failed.is_empty(), "{report:?}");
        clock.advance(FORGOTTEN_MOVED_AFTER_MS + 1);
        let report = r.pass(&backend, &mut Never).unwrap();
        assert_eq!(
            report.failed.iter().map(|f| f.0).collect::<Vec<_>>(),
            vec![n]
        );
        assert!(report.failed[0].1.contains("forgotten"), "{report:?}");
    }

    /// Enqueues onto shard "a" of a memory backend.
    struct OnA<'a>(&'a MemoryBackend);

    impl Release for OnA<'_> {
        fn release(&mut self, job: &NewJob) -> Released {
            let stored = self
                .0
                .enqueue_dedup(
                    "a",
                    u64::MAX,
                    std::slice::from_ref(job),
                    RELEASE_DEDUP_WINDOW_MS,
                )
                .map_err(|e| ReleaseError::again(e.to_string()))?;
            Ok(("a".into(), stored[0].id))
        }
    }

    /// Refuses, for good, every job whose payload is `poison`; releases
    /// the rest onto shard "a".
    struct RefusesPoison<'a>(&'a MemoryBackend);

    impl Release for RefusesPoison<'_> {
        fn release(&mut self, job: &NewJob) -> Released {
            if job.payload == b"poison" {
                return Err(ReleaseError {
                    text: "payload refused".into(),
                    for_good: true,
                });
            }
            OnA(self.0).release(job)
        }
    }

    /// A dependent whose release is refused for good (here by the
    /// releasing process's limits) ends as failed, naming why, and does
    /// not hold up the others released in the same pass; its own
    /// dependent fails by it. Nothing waits forever.
    #[test]
    fn a_release_refused_for_good_fails_the_dependent_and_spares_the_others() {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let backend = MemoryBackend::new(&["a"], clock.clone());
        let maps = Arc::new(MemoryMapStore::new(
            shardq_route::ShardMap::with_shards(shardq_route::Algorithm::default(), ["a"]).unwrap(),
        ));
        let dependent = |payload: &str, after: Vec<DepRef>| NewDependent {
            job: NewJob::new("tenant", payload),
            after,
            on_failure: OnDependencyFailure::Fail,
        };
        let mut lookup = |_: &str, _| Ok(crate::backend::JobLookup::Unknown);
        let roots = WaitingStore::add(
            &*maps,
            &mut lookup,
            clock.now_ms(),
            &[dependent("ok", Vec::new()), dependent("poison", Vec::new())],
        )
        .unwrap();
        let (ok, poison) = (roots[0].0, roots[1].0);
        let after_poison = WaitingStore::add(
            &*maps,
            &mut lookup,
            clock.now_ms(),
            &[dependent("next", vec![DepRef::Waiting(poison)])],
        )
        .unwrap()[0]
            .0;
        let mut r = Resolver::new(maps.clone(), clock.clone());
        let report = r.pass(&backend, &mut RefusesPoison(&backend)).unwrap();
        assert_eq!(
            report.released.iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![ok],
            "{report:?}"
        );
        assert_eq!(report.failed.len(), 1, "{report:?}");
        assert_eq!(report.failed[0].0, poison);
        assert!(
            report.failed[0].1.contains("refused") && report.failed[0].1.contains("payload"),
            "{report:?}"
        );
        clock.advance(RESOLVE_EVERY_MS);
        let report = r.pass(&backend, &mut RefusesPoison(&backend)).unwrap();
        assert_eq!(
            report.failed.iter().map(|f| f.0).collect::<Vec<_>>(),
            vec![after_poison],
            "{report:?}"
        );
        let f = WaitingStore::load(&*maps).unwrap();
        assert_eq!(f.waiting(), 0, "nothing waits");
        assert_eq!(f.jobs[&poison].state, WaitState::Failed);
    }

    /// A producer's call refused for good because of one job (a payload
    /// over the backend's limit) is tried again job by job: the others
    /// are stored and only that one is refused, for good.
    #[test]
    fn one_bad_job_does_not_refuse_the_others_of_a_release_call() {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let backend: Arc<dyn QueueBackend> = Arc::new(MemoryBackend::new(&["a"], clock.clone()));
        let maps = Arc::new(MemoryMapStore::new(
            shardq_route::ShardMap::with_shards(shardq_route::Algorithm::default(), ["a"]).unwrap(),
        ));
        let mut producer = release_producer(backend.clone(), maps, clock).unwrap();
        let big = vec![b'x'; crate::job::PAYLOAD_BYTES_MAX_DEFAULT + 1];
        let jobs = vec![
            NewJob::new("k1", "one"),
            NewJob::new("k2", big),
            NewJob::new("k3", "three"),
        ];
        let out = producer.release_all(&jobs);
        assert!(out[0].is_ok() && out[2].is_ok(), "{out:?}");
        let e = out[1].as_ref().unwrap_err();
        assert!(e.for_good && e.text.contains("payload"), "{e:?}");
        assert_eq!(backend.key_jobs("a", "k3", 10).unwrap().len(), 1);
    }

    /// A manual clock, a memory backend with shard "a", and a map store
    /// whose map has that shard.
    fn one_shard() -> (Arc<ManualClock>, MemoryBackend, Arc<MemoryMapStore>) {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let backend = MemoryBackend::new(&["a"], clock.clone());
        let maps = Arc::new(MemoryMapStore::new(
            shardq_route::ShardMap::with_shards(shardq_route::Algorithm::default(), ["a"]).unwrap(),
        ));
        (clock, backend, maps)
    }

    /// Opens a batch on key `cb` with these callbacks: its number.
    fn open_batch(
        maps: &MemoryMapStore,
        clock: &ManualClock,
        callbacks: &[(crate::workflow::CallbackKind, &str)],
    ) -> u64 {
        let new = crate::workflow::NewBatch {
            key: "cb".into(),
            max_attempts: 1,
            callbacks: callbacks
                .iter()
                .map(|(k, p)| (*k, p.as_bytes().to_vec()))
                .collect(),
            dedup_id: None,
        };
        WaitingStore::open_batch(maps, clock.now_ms(), &new)
            .unwrap()
            .0
    }

    /// A batch callback whose enqueue is refused for good (a payload the
    /// releasing process refuses) is recorded as refused, with why, and
    /// tried no more; the other callback due fires once and the batch
    /// completes rather than wait forever.
    #[test]
    fn a_callback_refused_for_good_is_recorded_and_the_batch_completes() {
        use crate::workflow::CallbackKind::{Complete, Success};
        let (clock, backend, maps) = one_shard();
        let n = open_batch(&maps, &clock, &[(Complete, "poison"), (Success, "done")]);
        WaitingStore::close_batch(&*maps, n, clock.now_ms()).unwrap();
        let mut r = Resolver::new(maps.clone(), clock.clone());
        let report = r.pass(&backend, &mut RefusesPoison(&backend)).unwrap();
        assert_eq!(
            report.fired.iter().map(|f| (f.0, f.1)).collect::<Vec<_>>(),
            vec![(n, Success)],
            "{report:?}"
        );
        let f = WaitingStore::load(&*maps).unwrap();
        let w = &f.jobs[&n];
        let b = w.batch.as_ref().unwrap();
        assert!(
            b.refused[&Complete].contains("refused") && b.refused[&Complete].contains("payload"),
            "{b:?}"
        );
        assert!(!b.fired.contains_key(&Complete));
        assert_eq!(w.state, WaitState::Released, "the batch completed");
        assert!(!f.work_ahead());
        // Later passes fire nothing more: the success callback ran once.
        for _ in 0..3 {
            clock.advance(RESOLVE_EVERY_MS);
            let report = r.pass(&backend, &mut RefusesPoison(&backend)).unwrap();
            assert!(
                report.fired.is_empty() && report.errors.is_empty(),
                "{report:?}"
            );
        }
        assert_eq!(backend.key_jobs("a", "cb", 10).unwrap().len(), 1);
    }

    /// A batch of 2,000 queued jobs: the probes (64 a pass, each job at
    /// most once a second) go round every job, not the first 640 again
    /// and again.
    #[test]
    fn probes_go_round_every_job_of_a_large_batch() {
        let (clock, backend, maps) = one_shard();
        let n = open_batch(
            &maps,
            &clock,
            &[(crate::workflow::CallbackKind::Complete, "x")],
        );
        let jobs: Vec<NewJob> = (0..2_000)
            .map(|i| NewJob::new(format!("k{i}"), "p"))
            .collect();
        WaitingStore::add_to_batch(&*maps, clock.now_ms(), n, &jobs).unwrap();
        let mut r = Resolver::new(maps.clone(), clock.clone());
        for _ in 0..40 {
            r.pass(&backend, &mut OnA(&backend)).unwrap();
            clock.advance(RESOLVE_EVERY_MS);
        }
        let probed = (0..2_000)
            .filter(|i| r.probed_at.contains_key(&(n, *i)))
            .count();
        assert_eq!(probed, 2_000, "jobs probed at least once in 40 passes");
    }

    /// A store that lost acknowledged writes (restored to an older
    /// document) gives a released dependent's number to a new dependent
    /// of the same key: the new one is released as its own job, not
    /// answered as a duplicate of the old one's release.
    #[test]
    fn a_number_reused_after_a_store_rollback_releases_the_new_dependent() {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let backend = MemoryBackend::new(&["a"], clock.clone());
        let maps = Arc::new(MemoryMapStore::new(
            shardq_route::ShardMap::with_shards(shardq_route::Algorithm::default(), ["a"]).unwrap(),
        ));
        let root = |payload: &str| NewDependent {
            job: NewJob::new("tenant", payload),
            after: Vec::new(),
            on_failure: OnDependencyFailure::Fail,
        };
        let mut lookup = |_: &str, _| Ok(crate::backend::JobLookup::Unknown);
        let before = maps.load_setting(SETTING_WAITING).unwrap();
        let old =
            WaitingStore::add(&*maps, &mut lookup, clock.now_ms(), &[root("old")]).unwrap()[0].0;
        let mut r = Resolver::new(maps.clone(), clock.clone());
        assert_eq!(
            r.pass(&backend, &mut OnA(&backend)).unwrap().released.len(),
            1
        );
        // The store comes back with the document as it was before.
        maps.store_setting(SETTING_WAITING, before.as_deref())
            .unwrap();
        let new =
            WaitingStore::add(&*maps, &mut lookup, clock.now_ms(), &[root("new")]).unwrap()[0].0;
        assert_eq!(new, old, "the number is given again");
        let mut r = Resolver::new(maps.clone(), clock.clone());
        let report = r.pass(&backend, &mut OnA(&backend)).unwrap();
        assert_eq!(report.released.len(), 1, "{report:?}");
        let payloads: Vec<Vec<u8>> = backend
            .key_jobs("a", "tenant", 10)
            .unwrap()
            .into_iter()
            .map(|j| backend.job("a", j.id).unwrap().unwrap().payload)
            .collect();
        assert_eq!(payloads, vec![b"old".to_vec(), b"new".to_vec()]);
    }
}
