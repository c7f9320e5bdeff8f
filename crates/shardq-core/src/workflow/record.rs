//! The waiting dependents' document (`settings.waiting`), its records and
//! the one way a dependent is added ([`WaitingStore::add`]).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::batch::Batch;
use super::{
    COLLECTED_RESULT_BYTES_MAX, DEPENDENCIES_MAX, DEPENDENT_PAYLOAD_BYTES_MAX, ENDED_KEPT_MAX,
    ENDED_KEPT_MS, SETTING_WAITING, WAITING_BYTES_MAX, WAITING_MAX,
};
use crate::backend::JobLookup;
use crate::error::QueueError;
use crate::job::{JobId, JobState, NewJob};
use crate::reshard::{update_setting, MapStore, ReshardError};

/// The waiting document's format version; another one is refused.
pub const WAITING_FORMAT: u32 = 5;

/// What a dependent does when a dependency did not complete (it was
/// cancelled, dead-lettered, purged or forgotten, or is a dependent that
/// failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnDependencyFailure {
    /// End the dependent as failed, naming the dependency (the default).
    #[default]
    Fail,
    /// Run it, without that dependency's result.
    Ignore,
    /// Run it, with every dependency's outcome.
    Run,
}

impl OnDependencyFailure {
    /// Parses `fail`, `ignore` or `run`, naming the value when it is none.
    pub fn parse(s: &str) -> Result<Self, QueueError> {
        match s {
            "fail" => Ok(Self::Fail),
            "ignore" => Ok(Self::Ignore),
            "run" => Ok(Self::Run),
            _ => Err(QueueError::InvalidOption {
                name: "on dependency failure",
                value: format!("{s:?}"),
                allowed: "fail, ignore or run".into(),
            }),
        }
    }
}

/// How a dependency ended, as a resolver pass saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DepOutcome {
    /// A run of it was acked.
    Completed,
    /// It was cancelled.
    Cancelled,
    /// It ran out of attempts (dead-lettered).
    Dead,
    /// A dependent that failed (or was cancelled) before it was released.
    Failed,
    /// It was nowhere for [`super::FORGOTTEN_AFTER_MS`]: purged, or
    /// finished and forgotten by the retention before a pass saw it.
    Forgotten,
}

impl DepOutcome {
    /// The word used in answers and reasons.
    pub fn as_str(self) -> &'static str {
        match self {
            DepOutcome::Completed => "completed",
            DepOutcome::Cancelled => "cancelled",
            DepOutcome::Dead => "dead",
            DepOutcome::Failed => "failed",
            DepOutcome::Forgotten => "forgotten",
        }
    }
}

/// A dependency as given: a job (`SHARD:ID`) or another dependent (`@N`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DepRef {
    /// A job on a shard.
    Job(String, JobId),
    /// A dependent, by its number.
    Waiting(u64),
    /// The dependent at this index of the same [`WaitingStore::add`]
    /// call (a tree or a graph sent at once).
    Node(usize),
}

impl fmt::Display for DepRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DepRef::Job(s, id) => write!(f, "{s}:{}", id.0),
            DepRef::Waiting(n) => write!(f, "@{n}"),
            DepRef::Node(i) => write!(f, "node {i}"),
        }
    }
}

/// Parses one dependency id: `SHARD:ID` or `@N`.
pub fn parse_dependency(s: &str) -> Result<DepRef, QueueError> {
    let bad = || QueueError::InvalidOption {
        name: "after",
        value: format!("{s:?}"),
        allowed: "job ids SHARD:ID (as enqueue prints them) or dependents' ids @N".into(),
    };
    if let Some(n) = s.strip_prefix('@') {
        return n.parse().map(DepRef::Waiting).map_err(|_| bad());
    }
    let (shard, id) = s.rsplit_once(':').ok_or_else(bad)?;
    if shard.is_empty() {
        return Err(bad());
    }
    Ok(DepRef::Job(
        shard.to_string(),
        JobId(id.parse().map_err(|_| bad())?),
    ))
}

/// One dependency of a dependent and, once a pass saw it end, how.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dependency {
    /// As given (`SHARD:ID` or `@N`).
    pub id: String,
    /// How it ended; `None` while it has not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<DepOutcome>,
    /// Where it ended when that is not `id` (its copy after a move, or
    /// the job a dependent was released as).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    /// Its handler's result (a completed job's), base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_b64: Option<String>,
    /// True when its result was dropped: the dependent had collected
    /// [`COLLECTED_RESULT_BYTES_MAX`] already.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub result_dropped: bool,
    /// The reason of its last failed attempt, or why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Where a dependent stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitState {
    /// Some dependency has not ended.
    Waiting,
    /// Enqueued on its key (`released` names the job).
    Released,
    /// Ended without running: a dependency did not complete under
    /// [`OnDependencyFailure::Fail`].
    Failed,
    /// Cancelled while it waited.
    Cancelled,
}

/// A dependent: the job it becomes, what it waits for, where it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiting {
    /// Its key.
    pub key: String,
    /// Its payload, base64.
    pub payload_b64: String,
    /// Attempts of the job it becomes.
    pub max_attempts: u32,
    /// Delay of the job it becomes, from its release.
    pub delay_ms: u64,
    /// What a dependency that did not complete does to it.
    pub on_failure: OnDependencyFailure,
    /// Its dependencies, in the order given.
    pub after: Vec<Dependency>,
    /// When it was enqueued (ms since the epoch).
    pub created_ms: u64,
    /// Where it stands.
    pub state: WaitState,
    /// The job it was released as (`SHARD:ID`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<String>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it was released, failed or cancelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_ms: Option<u64>,
    /// The dedup id it was enqueued with: a second enqueue of its key
    /// with the same id answers this dependent while its record is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup_id: Option<String>,
    /// Set when this record is a batch (`after` lists its jobs): it is
    /// never released itself; its callbacks are (`batch.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<Batch>,
    /// The batch this record is a job of (it has no dependencies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub member_of: Option<u64>,
    /// Drawn at random when the record is made, and part of every dedup
    /// id it releases with (`after:@N.NONCE`, `batch:@N.NONCE:KIND`): a
    /// store that lost acknowledged writes (a failover to a lagging
    /// replica, a restore) may give its number to a new record, whose
    /// release must not be taken for the old one's.
    pub nonce: String,
}

impl Waiting {
    /// Bytes of dependencies' results it holds (decoded size).
    pub fn collected_bytes(&self) -> usize {
        self.after
            .iter()
            .filter_map(|d| d.result_b64.as_ref())
            .map(|b| b.len() / 4 * 3)
            .sum()
    }

    /// Its payload bytes.
    pub fn payload(&self) -> Vec<u8> {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(&self.payload_b64)
            .unwrap_or_default()
    }
}

/// The `waiting` document: every dependent by number, and the next number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitingFile {
    /// [`WAITING_FORMAT`].
    pub format: u32,
    /// The number the next dependent gets.
    pub next: u64,
    /// Dependents by number.
    pub jobs: BTreeMap<u64, Waiting>,
    /// Dependents ever released (grows); a batch's jobs are not dependents
    /// and are counted in `batch_jobs_released_total`.
    pub released_total: u64,
    /// Jobs of batches ever released onto their keys (grows).
    pub batch_jobs_released_total: u64,
    /// Dependents ever failed or cancelled before release (grows).
    pub failed_total: u64,
    /// Batch callbacks ever fired (grows).
    pub callbacks_fired_total: u64,
}

/// The dependents of a deployment in numbers, for `status` and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DependentTotals {
    /// Waiting now.
    pub waiting: u64,
    /// Released since the deployment began (grows).
    pub released: u64,
    /// Failed or cancelled before release since it began (grows).
    pub failed: u64,
    /// Batches not yet complete.
    pub batches: u64,
    /// Jobs added to a batch and not yet on their key (a pass releases
    /// them).
    pub batch_jobs_waiting: u64,
    /// Jobs of batches released onto their keys since it began (grows).
    pub batch_jobs_released: u64,
    /// Batch callbacks fired since it began (grows).
    pub callbacks_fired: u64,
}

impl Default for WaitingFile {
    fn default() -> Self {
        WaitingFile {
            format: WAITING_FORMAT,
            next: 1,
            jobs: BTreeMap::new(),
            released_total: 0,
            batch_jobs_released_total: 0,
            failed_total: 0,
            callbacks_fired_total: 0,
        }
    }
}

impl WaitingFile {
    /// Parses the stored text, refusing another format version.
    pub fn parse(text: &str) -> Result<WaitingFile, ReshardError> {
        let f: WaitingFile = serde_json::from_str(text).map_err(|e| {
            ReshardError::Invalid(format!(
                "the waiting dependents' setting does not parse: {e}"
            ))
        })?;
        if f.format != WAITING_FORMAT {
            return Err(ReshardError::Invalid(format!(
                "the waiting dependents' setting is format {}; this shardq reads format {WAITING_FORMAT}",
                f.format
            )));
        }
        Ok(f)
    }

    /// The stored text.
    pub fn to_text(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Its numbers.
    pub fn totals(&self) -> DependentTotals {
        let waiting = |pick: fn(&Waiting) -> bool| {
            self.jobs
                .values()
                .filter(|w| w.state == WaitState::Waiting && pick(w))
                .count() as u64
        };
        DependentTotals {
            waiting: waiting(|w| w.batch.is_none() && w.member_of.is_none()),
            released: self.released_total,
            batches: waiting(|w| w.batch.is_some()),
            batch_jobs_waiting: waiting(|w| w.member_of.is_some()),
            batch_jobs_released: self.batch_jobs_released_total,
            failed: self.failed_total,
            callbacks_fired: self.callbacks_fired_total,
        }
    }

    /// Whether a resolver pass has work ahead: a dependent (or a batch's
    /// job) waits, a closed batch is not complete, or a batch has a
    /// callback due. An open batch with nothing due is not work: it waits
    /// for its producer, not for a pass.
    pub fn work_ahead(&self) -> bool {
        self.jobs.values().any(|w| {
            w.state == WaitState::Waiting
                && match &w.batch {
                    None => true,
                    // An open batch whose death callback may still fire
                    // waits for its jobs' ends to be seen: a job that just
                    // died has no recorded outcome yet.
                    Some(b) => {
                        !b.open
                            || !super::batch::due(w).is_empty()
                            || (b.callbacks.contains_key(&super::CallbackKind::Death)
                                && !b.fired.contains_key(&super::CallbackKind::Death)
                                && w.after.iter().any(|d| d.outcome.is_none()))
                    }
                }
        })
    }

    /// Records still waiting: dependents, and batches not yet complete.
    pub fn waiting(&self) -> usize {
        self.jobs
            .values()
            .filter(|w| w.state == WaitState::Waiting)
            .count()
    }

    /// Drops ended records older than [`ENDED_KEPT_MS`] at `now_ms`, and
    /// the oldest past [`ENDED_KEPT_MAX`].
    pub fn trim(&mut self, now_ms: u64) {
        // A record a waiting dependent still needs (it names it and has
        // not seen it end) stays, however old: dropping it would turn
        // a dependency that has not run yet into a forgotten one.
        // Every job of a batch not yet complete stays too, ended or not:
        // its record holds its dedup id, so a job of the batch that runs
        // again and adds it again adds nothing twice.
        let needed: std::collections::BTreeSet<u64> = self
            .jobs
            .values()
            .filter(|w| w.state == WaitState::Waiting)
            .flat_map(|w| {
                let all = w.batch.is_some();
                w.after.iter().filter(move |d| all || d.outcome.is_none())
            })
            .filter_map(|d| d.id.strip_prefix('@')?.parse().ok())
            .collect();
        self.jobs.retain(|n, w| {
            needed.contains(n)
                || w.ended_ms
                    .is_none_or(|t| now_ms.saturating_sub(t) <= ENDED_KEPT_MS)
        });
        let ended: Vec<(u64, u64)> = self
            .jobs
            .iter()
            .filter(|(n, _)| !needed.contains(n))
            .filter_map(|(n, w)| w.ended_ms.map(|t| (t, *n)))
            .collect();
        if ended.len() > ENDED_KEPT_MAX {
            let mut ended = ended;
            ended.sort_unstable();
            for (_, n) in &ended[..ended.len() - ENDED_KEPT_MAX] {
                self.jobs.remove(n);
            }
        }
    }
}

/// A dependent to add: its job, what it waits for and its policy.
#[derive(Debug, Clone)]
pub struct NewDependent {
    /// The job it becomes (its dedup id must be unset).
    pub job: NewJob,
    /// Its dependencies.
    pub after: Vec<DepRef>,
    /// What a dependency that did not complete does to it.
    pub on_failure: OnDependencyFailure,
}

/// Checks a list of dependencies: at most [`DEPENDENCIES_MAX`], none
/// twice. An empty list is a graph's root: released at the next pass.
pub fn check_after(after: &[DepRef]) -> Result<(), QueueError> {
    if after.len() > DEPENDENCIES_MAX {
        return Err(QueueError::InvalidOption {
            name: "after",
            value: format!("{} dependencies", after.len()),
            allowed: format!("0 to {DEPENDENCIES_MAX} job ids"),
        });
    }
    let mut seen = std::collections::BTreeSet::new();
    for d in after {
        if !seen.insert(d) {
            return Err(QueueError::InvalidOption {
                name: "after",
                value: d.to_string(),
                allowed: "each job id once".into(),
            });
        }
    }
    Ok(())
}

/// Reading and changing the waiting document.
pub struct WaitingStore;

impl WaitingStore {
    /// The document (empty when unset).
    pub fn load(maps: &dyn MapStore) -> Result<WaitingFile, ReshardError> {
        match maps.load_setting(SETTING_WAITING)? {
            None => Ok(WaitingFile::default()),
            Some(text) => WaitingFile::parse(&text),
        }
    }

    /// As [`WaitingStore::load`], reusing `cache` (the text last read or
    /// written by its owner, parsed) when the stored text is the same: a
    /// resolver's passes over a large document parse it only when another
    /// process changed it.
    pub fn load_cached(
        maps: &dyn MapStore,
        cache: &mut Option<(String, WaitingFile)>,
    ) -> Result<WaitingFile, ReshardError> {
        match maps.load_setting(SETTING_WAITING)? {
            None => Ok(WaitingFile::default()),
            Some(text) => cached_parse(cache, text),
        }
    }

    /// As [`WaitingStore::update`], reusing and refreshing `cache` as
    /// [`WaitingStore::load_cached`] does. `change` gets the document and
    /// the length of its stored text.
    pub fn update_cached<R, E>(
        maps: &dyn MapStore,
        cache: &mut Option<(String, WaitingFile)>,
        mut change: impl FnMut(&mut WaitingFile, usize) -> Result<R, E>,
    ) -> Result<R, E>
    where
        E: From<ReshardError>,
    {
        let mut written: Option<(String, WaitingFile)> = None;
        let out = update_setting(maps, SETTING_WAITING, |current| -> Result<_, E> {
            let (mut f, len) = match current {
                None => (WaitingFile::default(), 0),
                Some(text) => (cached_parse(cache, text.to_string())?, text.len()),
            };
            let out = change(&mut f, len)?;
            let text = f.to_text();
            written = Some((text.clone(), f));
            Ok((Some(text), out))
        })?;
        if let Some(w) = written {
            *cache = Some(w);
        }
        Ok(out)
    }

    /// Changes the document atomically against every other writer
    /// (`change` may run more than once). An `Ok` means stored.
    pub fn update<R, E>(
        maps: &dyn MapStore,
        mut change: impl FnMut(&mut WaitingFile) -> Result<R, E>,
    ) -> Result<R, E>
    where
        E: From<ReshardError>,
    {
        update_setting(maps, SETTING_WAITING, |current| {
            let mut f = match current {
                None => WaitingFile::default(),
                Some(text) => WaitingFile::parse(text)?,
            };
            let out = change(&mut f)?;
            Ok((Some(f.to_text()), out))
        })
    }

    /// Adds dependents that wait for each other or for jobs, in one
    /// compare-and-set, and returns their numbers, each with whether it
    /// was a duplicate: a dependent whose key already has one with its
    /// dedup id (kept while that one's record is) is not stored again and
    /// answers that one's number, so a graph sent again after a lost
    /// answer stores nothing twice. A `DepRef::Node(i)`
    /// names the `i`-th dependent of this call (a tree or a graph sent at
    /// once); cycles are refused. Each job dependency must be found
    /// (`lookup` answers whether it is live, finished, or copied after a
    /// move); an unknown one is refused, naming it.
    pub fn add(
        maps: &dyn MapStore,
        lookup: &mut dyn FnMut(&str, JobId) -> Result<JobLookup, QueueError>,
        now_ms: u64,
        deps: &[NewDependent],
    ) -> Result<Vec<(u64, bool)>, ReshardError> {
        if deps.is_empty() {
            return Ok(Vec::new());
        }
        if deps.len() > WAITING_MAX {
            return Err(QueueError::InvalidOption {
                name: "dependents",
                value: deps.len().to_string(),
                allowed: format!("at most {WAITING_MAX} in one call"),
            }
            .into());
        }
        for d in deps {
            check_after(&d.after)?;
            d.job.validate(DEPENDENT_PAYLOAD_BYTES_MAX)?;
            if let Some(DepRef::Node(i)) = d
                .after
                .iter()
                .find(|a| matches!(a, DepRef::Node(i) if *i >= deps.len()))
            {
                return Err(QueueError::InvalidOption {
                    name: "after",
                    value: format!("node {i}"),
                    allowed: format!("nodes 0 to {} of this graph", deps.len() - 1),
                }
                .into());
            }
            if d.job.keyed.is_some() {
                return Err(QueueError::InvalidOption {
                    name: "after",
                    value: "a unique or debounced job".into(),
                    allowed: "a dependent without a unique or debounce id (a dedup id is fine)"
                        .into(),
                }
                .into());
            }
        }
        refuse_cycles(deps)?;
        // Every job dependency must exist now (outside the swap: lookups
        // read the shards).
        for d in deps {
            for a in &d.after {
                if let DepRef::Job(shard, id) = a {
                    if let JobLookup::Unknown = lookup(shard, *id)? {
                        return Err(QueueError::InvalidOption {
                            name: "after",
                            value: a.to_string(),
                            allowed: "ids of jobs that exist (this one is not live, not finished within the retention and not known to have moved)".into(),
                        }
                        .into());
                    }
                }
            }
        }
        Self::update(maps, |f: &mut WaitingFile| {
            insert(f, now_ms, deps, Kind::Dependent)
        })
    }

    /// Cancels dependent `n` if it still waits: `Some(state)` it had
    /// (`Waiting` when this call cancelled it), `None` if unknown.
    pub fn cancel(
        maps: &dyn MapStore,
        n: u64,
        now_ms: u64,
    ) -> Result<Option<Waiting>, ReshardError> {
        Self::update(maps, |f: &mut WaitingFile| {
            let Some(w) = f.jobs.get_mut(&n) else {
                return Ok::<_, ReshardError>(None);
            };
            if w.batch.is_some() {
                return Err(QueueError::InvalidOption {
                    name: "job id",
                    value: format!("@{n}"),
                    allowed: "a dependent or a job; this is a batch, which is not cancelled: cancel its jobs (`shardq batch show`)".into(),
                }
                .into());
            }
            let before = w.clone();
            // Every dependency has an outcome: a pass may be releasing it
            // now (its job enqueued, not yet recorded); a cancel here could
            // not stop that job. Refused: cancel its job once released.
            if w.state == WaitState::Waiting && w.after.iter().all(|d| d.outcome.is_some()) {
                return Err(ReshardError::Unavailable(format!(
                    "dependent @{n} is being released (every dependency has ended): try again in a moment, and cancel the job it becomes"
                )));
            }
            if w.state == WaitState::Waiting {
                w.state = WaitState::Cancelled;
                w.ended_ms = Some(now_ms);
                w.reason = Some("cancelled while it waited".into());
                f.failed_total += 1;
            }
            Ok(Some(before))
        })
    }

    /// A dependent's record.
    pub fn get(maps: &dyn MapStore, n: u64) -> Result<Option<Waiting>, ReshardError> {
        Ok(Self::load(maps)?.jobs.remove(&n))
    }
}

/// What [`insert`] adds: dependents, a batch, or jobs of batch `N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Dependent,
    Batch,
    JobOf(u64),
}

/// `text` parsed, or the cached document when `cache` holds the same text
/// (the cache then holds `text`).
fn cached_parse(
    cache: &mut Option<(String, WaitingFile)>,
    text: String,
) -> Result<WaitingFile, ReshardError> {
    if let Some((t, f)) = cache.as_ref() {
        if *t == text {
            return Ok(f.clone());
        }
    }
    let f = WaitingFile::parse(&text)?;
    *cache = Some((text, f.clone()));
    Ok(f)
}

/// Stores new dependents in `f` (the body of [`WaitingStore::add`]'s
/// compare-and-set; `member_of` makes them jobs of that batch): their
/// numbers, each with whether it was a duplicate.
pub(super) fn insert(
    f: &mut WaitingFile,
    now_ms: u64,
    deps: &[NewDependent],
    kind: Kind,
) -> Result<Vec<(u64, bool)>, ReshardError> {
    let member_of = match kind {
        Kind::JobOf(b) => Some(b),
        _ => None,
    };
    f.trim(now_ms);
    let found = duplicates(f, deps, kind)?;
    if f.waiting() + deps.len() > WAITING_MAX {
        return Err(ReshardError::Unavailable(format!(
            "{} dependents wait already; at most {WAITING_MAX} may wait at once: try again once some are released",
            f.waiting()
        )));
    }
    let base = f.next;
    let mut next = base;
    let numbers: Vec<u64> = found
        .iter()
        .map(|dup| {
            dup.unwrap_or_else(|| {
                next += 1;
                next - 1
            })
        })
        .collect();
    check_waiting_refs(f, deps)?;
    for ((d, n), dup) in deps.iter().zip(&numbers).zip(&found) {
        if dup.is_none() {
            let w = new_record(d, &numbers, now_ms, member_of)?;
            f.jobs.insert(*n, w);
        }
    }
    f.next = next;
    let size = f.to_text().len();
    if size > WAITING_BYTES_MAX {
        return Err(ReshardError::Unavailable(format!(
                "the waiting dependents would take {size} bytes, over the {WAITING_BYTES_MAX} bytes they may: try again once some are released"
            )));
    }
    Ok(numbers
        .into_iter()
        .zip(found)
        .map(|(n, dup)| (n, dup.is_some()))
        .collect())
}

/// Each of `deps` that duplicates a record by (key, dedup id): that
/// record's number. Refused: a duplicate of another kind of record (a
/// dependent's id does not answer a batch or a batch's job, nor the other
/// way round), and one (key, dedup id) twice in one call (it would be
/// stored twice).
fn duplicates(
    f: &WaitingFile,
    deps: &[NewDependent],
    kind: Kind,
) -> Result<Vec<Option<u64>>, ReshardError> {
    let found: Vec<Option<u64>> = deps
        .iter()
        .map(|d| {
            let id = d.job.dedup_id.as_ref()?;
            f.jobs
                .iter()
                .find(|(_, w)| w.key == d.job.key && w.dedup_id.as_ref() == Some(id))
                .map(|(n, _)| *n)
        })
        .collect();
    for ((d, dup), i) in deps.iter().zip(&found).zip(0..) {
        let Some(n) = dup else { continue };
        let w = &f.jobs[n];
        let same_kind = match kind {
            Kind::Dependent => w.batch.is_none() && w.member_of.is_none(),
            Kind::Batch => w.batch.is_some(),
            Kind::JobOf(b) => w.member_of == Some(b),
        };
        if !same_kind {
            return Err(QueueError::InvalidOption {
                name: "dedup id",
                value: format!(
                    "{:?} (jobs[{i}])",
                    d.job.dedup_id.clone().unwrap_or_default()
                ),
                allowed: format!(
                    "an id not already used on key {:?} by another kind of record (@{n} is {})",
                    d.job.key,
                    if w.batch.is_some() {
                        "a batch"
                    } else if w.member_of.is_some() {
                        "another batch's job"
                    } else {
                        "a dependent"
                    }
                ),
            }
            .into());
        }
    }
    let mut seen = std::collections::BTreeMap::new();
    for (i, d) in deps.iter().enumerate() {
        if let Some(id) = &d.job.dedup_id {
            if let Some(first) = seen.insert((d.job.key.as_str(), id.as_str()), i) {
                return Err(QueueError::InvalidOption {
                    name: "dedup id",
                    value: format!("{id:?} (jobs[{i}])"),
                    allowed: format!("an id used once per key in a call (jobs[{first}] has it)"),
                }
                .into());
            }
        }
    }
    Ok(found)
}

/// Every `@N` that `deps` wait for names a record that exists and is not
/// a batch (a batch is not a job: nothing would record its end).
fn check_waiting_refs(f: &WaitingFile, deps: &[NewDependent]) -> Result<(), ReshardError> {
    for a in deps.iter().flat_map(|d| &d.after) {
        let DepRef::Waiting(n) = a else { continue };
        if !f.jobs.contains_key(n) {
            return Err(QueueError::InvalidOption {
                name: "after",
                value: a.to_string(),
                allowed: "ids of dependents that exist (this one is unknown, or ended longer ago than they are kept)".into(),
            }
            .into());
        }
        if f.jobs[n].batch.is_some() {
            return Err(QueueError::InvalidOption {
                name: "after",
                value: a.to_string(),
                allowed: "ids of jobs and dependents; this is a batch: run what follows it as its on-complete or on-success callback".into(),
            }
            .into());
        }
    }
    Ok(())
}

/// The waiting record of `d`, its dependencies on other records of the
/// same call (`DepRef::Node(i)`) named by their `numbers`.
fn new_record(
    d: &NewDependent,
    numbers: &[u64],
    now_ms: u64,
    member_of: Option<u64>,
) -> Result<Waiting, ReshardError> {
    use base64::Engine as _;
    let after = d
        .after
        .iter()
        .map(|a| {
            let id = match a {
                DepRef::Node(i) => format!("@{}", numbers[*i]),
                other => other.to_string(),
            };
            Dependency {
                id,
                outcome: None,
                at: None,
                result_b64: None,
                result_dropped: false,
                reason: None,
            }
        })
        .collect();
    Ok(Waiting {
        key: d.job.key.clone(),
        payload_b64: base64::engine::general_purpose::STANDARD.encode(&d.job.payload),
        max_attempts: d.job.max_attempts,
        delay_ms: d.job.delay_ms,
        on_failure: d.on_failure,
        after,
        created_ms: now_ms,
        state: WaitState::Waiting,
        released: None,
        reason: None,
        ended_ms: None,
        dedup_id: d.job.dedup_id.clone(),
        batch: None,
        member_of,
        nonce: nonce()?,
    })
}

/// A record's nonce: 64 random bits, in hex.
fn nonce() -> Result<String, ReshardError> {
    getrandom::u64().map(|n| format!("{n:016x}")).map_err(|e| {
        ReshardError::Unavailable(format!("drawing a random nonce for a waiting record: {e}"))
    })
}

/// Refuses a graph sent at once whose in-call references loop.
fn refuse_cycles(deps: &[NewDependent]) -> Result<(), QueueError> {
    // Depth-first over in-call references: 0 unseen, 1 on the path, 2 done.
    let n = deps.len();
    let mut mark = vec![0u8; n];
    for start in 0..n {
        if mark[start] != 0 {
            continue;
        }
        let mut stack = vec![(start, 0usize)];
        mark[start] = 1;
        while let Some((node, next)) = stack.last_mut() {
            let node = *node;
            let edges: Vec<usize> = deps[node]
                .after
                .iter()
                .filter_map(|a| match a {
                    DepRef::Node(i) => Some(*i),
                    _ => None,
                })
                .collect();
            if *next < edges.len() {
                let to = edges[*next];
                *next += 1;
                match mark[to] {
                    0 => {
                        mark[to] = 1;
                        stack.push((to, 0));
                    }
                    1 => {
                        return Err(QueueError::InvalidOption {
                            name: "after",
                            value: format!("node {to} (reached again from node {node})"),
                            allowed: "a graph without cycles".into(),
                        })
                    }
                    _ => {}
                }
            } else {
                mark[node] = 2;
                stack.pop();
            }
        }
    }
    Ok(())
}

/// How a found job ended, if it has: the outcome, its result, its reason.
pub(super) fn ended(found: &JobLookup) -> Option<(DepOutcome, Option<Vec<u8>>, Option<String>)> {
    match found {
        JobLookup::Live(_, j) if j.state == JobState::Dead => {
            Some((DepOutcome::Dead, None, j.reason.clone()))
        }
        JobLookup::Live(..) => None,
        JobLookup::Finished(_, f) => Some(match f.outcome {
            crate::job::Finish::Completed => (DepOutcome::Completed, f.result.clone(), None),
            crate::job::Finish::Cancelled => (DepOutcome::Cancelled, None, f.reason.clone()),
        }),
        JobLookup::Moved { .. } | JobLookup::Unknown => None,
    }
}

/// Most bytes of results a dependent may still collect.
pub(super) fn room(w: &Waiting) -> usize {
    COLLECTED_RESULT_BYTES_MAX.saturating_sub(w.collected_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dep(after: Vec<DepRef>) -> NewDependent {
        NewDependent {
            job: NewJob::new("k", "p"),
            after,
            on_failure: OnDependencyFailure::Fail,
        }
    }

    #[test]
    fn ids_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_dependency("shard-0:17").unwrap(),
            DepRef::Job("shard-0".into(), JobId(17))
        );
        assert_eq!(parse_dependency("@4").unwrap(), DepRef::Waiting(4));
        for bad in ["", "17", ":3", "s:x", "@", "@x", "@-1"] {
            let e = parse_dependency(bad).unwrap_err().to_string();
            assert!(
                e.contains("after") && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
        assert_eq!(
            OnDependencyFailure::parse("run").unwrap(),
            OnDependencyFailure::Run
        );
        let e = OnDependencyFailure::parse("retry").unwrap_err().to_string();
        assert!(
            e.contains("\"retry\"") && e.contains("fail, ignore or run"),
            "{e}"
        );
    }

    #[test]
    fn lists_are_bounded_and_cycles_refused() {
        check_after(&[]).unwrap();
        let many: Vec<DepRef> = (0..=DEPENDENCIES_MAX as u64).map(DepRef::Waiting).collect();
        let e = check_after(&many).unwrap_err().to_string();
        assert!(e.contains("1001 dependencies"), "{e}");
        let twice = [DepRef::Waiting(1), DepRef::Waiting(1)];
        assert!(check_after(&twice).unwrap_err().to_string().contains("@1"));
        // 0 -> 1 -> 2 -> 0 loops; 0 -> 1 -> 2 does not.
        let cyc = [
            dep(vec![DepRef::Node(1)]),
            dep(vec![DepRef::Node(2)]),
            dep(vec![DepRef::Node(0)]),
        ];
        assert!(refuse_cycles(&cyc)
            .unwrap_err()
            .to_string()
            .contains("cycles"));
        let dag = [
            dep(vec![DepRef::Node(1), DepRef::Node(2)]),
            dep(vec![DepRef::Node(2)]),
            dep(vec![DepRef::Job("s".into(), JobId(1))]),
        ];
        refuse_cycles(&dag).unwrap();
        let own = [dep(vec![DepRef::Node(0)])];
        assert!(refuse_cycles(&own).is_err());
    }

    fn waiting_on(id: &str) -> Waiting {
        Waiting {
            key: "k".into(),
            payload_b64: String::new(),
            max_attempts: 1,
            delay_ms: 0,
            on_failure: OnDependencyFailure::Fail,
            after: vec![Dependency {
                id: id.into(),
                outcome: None,
                at: None,
                result_b64: None,
                result_dropped: false,
                reason: None,
            }],
            created_ms: 0,
            state: WaitState::Waiting,
            released: None,
            reason: None,
            ended_ms: None,
            dedup_id: None,
            batch: None,
            member_of: None,
            nonce: "0123456789abcdef".into(),
        }
    }

    #[test]
    fn a_record_a_waiting_dependent_needs_is_never_trimmed() {
        let mut f = WaitingFile::default();
        let mut old = waiting_on("s:1");
        old.state = WaitState::Released;
        old.ended_ms = Some(0);
        f.jobs.insert(1, old.clone());
        f.jobs.insert(2, old);
        f.jobs.insert(3, waiting_on("@1"));
        f.trim(10 * ENDED_KEPT_MS);
        assert_eq!(f.jobs.keys().copied().collect::<Vec<_>>(), vec![1, 3]);
    }

    #[test]
    fn a_cancel_is_refused_while_a_release_may_be_in_flight() {
        use crate::reshard::MapStore as _;
        let map = shardq_route::ShardMap::with_shards(shardq_route::Algorithm::default(), ["s"])
            .expect("map");
        let maps = crate::memory::MemoryMapStore::new(map);
        let mut f = WaitingFile::default();
        f.jobs.insert(1, waiting_on("s:1"));
        let mut ready = waiting_on("s:2");
        ready.after[0].outcome = Some(DepOutcome::Completed);
        f.jobs.insert(2, ready);
        maps.store_setting(SETTING_WAITING, Some(&f.to_text()))
            .unwrap();
        let was = WaitingStore::cancel(&maps, 1, 5).unwrap().unwrap();
        assert_eq!(was.state, WaitState::Waiting);
        let e = WaitingStore::cancel(&maps, 2, 5).unwrap_err().to_string();
        assert!(e.contains("@2") && e.contains("being released"), "{e}");
        let now = WaitingStore::load(&maps).unwrap();
        assert_eq!(now.jobs[&1].state, WaitState::Cancelled);
        assert_eq!(now.jobs[&2].state, WaitState::Waiting);
        assert_eq!(now.failed_total, 1);
    }

    #[test]
    fn ended_records_are_trimmed_by_age_and_count() {
        let mut f = WaitingFile::default();
        let w = |ended: Option<u64>| Waiting {
            key: "k".into(),
            payload_b64: String::new(),
            max_attempts: 1,
            delay_ms: 0,
            on_failure: OnDependencyFailure::Fail,
            after: Vec::new(),
            created_ms: 0,
            state: if ended.is_some() {
                WaitState::Released
            } else {
                WaitState::Waiting
            },
            released: None,
            reason: None,
            ended_ms: ended,
            dedup_id: None,
            batch: None,
            member_of: None,
            nonce: "0123456789abcdef".into(),
        };
        f.jobs.insert(1, w(Some(0)));
        f.jobs.insert(2, w(None));
        f.jobs.insert(3, w(Some(ENDED_KEPT_MS)));
        f.trim(ENDED_KEPT_MS + 1);
        assert_eq!(f.jobs.keys().copied().collect::<Vec<_>>(), vec![2, 3]);
        let text = f.to_text();
        assert_eq!(WaitingFile::parse(&text).unwrap(), f);
        let other = text.replace(
            &format!("\"format\":{WAITING_FORMAT}"),
            &format!("\"format\":{}", WAITING_FORMAT + 1),
        );
        let e = WaitingFile::parse(&other).unwrap_err().to_string();
        assert!(
            e.contains(&format!("format {}", WAITING_FORMAT + 1))
                && e.contains(&format!("format {WAITING_FORMAT}")),
            "{e}"
        );
    }
}
