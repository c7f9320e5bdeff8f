//! Batches: jobs grouped under one id, added over time until the batch is
//! closed, whose callbacks run once when the batch is complete (every job
//! ended), succeeded (every job acked) or at its first dead job.
//!
//! A batch is a record of the waiting document, like a dependent, with a
//! [`Batch`] part: its `after` lists its jobs (`@m`), and the resolver
//! records each job's end there exactly as it does a dependency's. A job
//! of a batch is a dependent with no dependencies and `member_of` set: it
//! is stored with its payload in the same compare-and-set that adds it to
//! the batch, then released by the next pass (dedup id
//! `after:@m:batch@N`), so a producer killed between the two steps cannot
//! leave a job outside its batch or a batch waiting for a job never
//! stored.
//!
//! # Why each callback runs once
//!
//! A callback is enqueued with the dedup id `batch:@N.NONCE:KIND`
//! ([`callback_dedup_id`]) and the release's dedup window, then recorded
//! in the batch's `fired`; a pass decides from the stored record only.
//! Two passes, or one killed between the enqueue and the record, store
//! the callback once (the second enqueue is a duplicate), on whatever
//! shard its key has moved to since.
//!
//! # When a batch takes jobs
//!
//! While it is open, and after it is closed for as long as one of its jobs
//! has not ended: a job of the batch may add more (fan-out at run time),
//! since the batch cannot be complete while that job runs. Once every job
//! of a closed batch has an outcome, an add is refused (a pass may be
//! firing its callbacks).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::record::{insert, Kind};
use super::{
    DepOutcome, NewDependent, OnDependencyFailure, WaitState, Waiting, WaitingFile, WaitingStore,
    BATCH_JOBS_MAX, DEPENDENT_PAYLOAD_BYTES_MAX,
};
use crate::error::QueueError;
use crate::job::NewJob;
use crate::reshard::{MapStore, ReshardError};

/// When a batch's callback runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallbackKind {
    /// Every job of the closed batch ended, however.
    Complete,
    /// Every job of the closed batch was acked.
    Success,
    /// A job of the batch was dead-lettered (the first one).
    Death,
}

impl CallbackKind {
    /// The word used in ids, answers and the handler's environment.
    pub fn as_str(self) -> &'static str {
        match self {
            CallbackKind::Complete => "complete",
            CallbackKind::Success => "success",
            CallbackKind::Death => "death",
        }
    }

    fn parse(s: &str) -> Option<CallbackKind> {
        match s {
            "complete" => Some(CallbackKind::Complete),
            "success" => Some(CallbackKind::Success),
            "death" => Some(CallbackKind::Death),
            _ => None,
        }
    }
}

/// The batch part of a batch's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// Whether it still takes jobs from anyone (see the module header).
    pub open: bool,
    /// Callback payloads (base64) by kind; a kind not here has none.
    pub callbacks: BTreeMap<CallbackKind, String>,
    /// Callbacks enqueued: the job (`SHARD:ID`) by kind.
    pub fired: BTreeMap<CallbackKind, String>,
    /// Callbacks whose enqueue was refused for good (bad input about the
    /// job, say a payload over the releasing worker's bound): why, by
    /// kind. Such a callback never fires; the batch completes without it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub refused: BTreeMap<CallbackKind, String>,
    /// When it was closed (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed_ms: Option<u64>,
}

/// A batch to open: where its callbacks run and what they carry.
#[derive(Debug, Clone, Default)]
pub struct NewBatch {
    /// The key its callbacks are enqueued on.
    pub key: String,
    /// Attempts each callback gets.
    pub max_attempts: u32,
    /// Payloads by kind (at least one).
    pub callbacks: BTreeMap<CallbackKind, Vec<u8>>,
    /// A producer's dedup id: opening again with it answers the batch
    /// already opened.
    pub dedup_id: Option<String>,
}

/// A batch's jobs in numbers, from its record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BatchCounts {
    /// Jobs added.
    pub jobs: usize,
    /// Jobs that have not ended (or whose end no pass has seen yet).
    pub pending: usize,
    /// Acked.
    pub completed: usize,
    /// Dead-lettered.
    pub dead: usize,
    /// Cancelled, or ended in another way that is not a success.
    pub other: usize,
}

/// Its counts.
pub fn counts(w: &Waiting) -> BatchCounts {
    let mut c = BatchCounts {
        jobs: w.after.len(),
        ..BatchCounts::default()
    };
    for d in &w.after {
        match d.outcome {
            None => c.pending += 1,
            Some(DepOutcome::Completed) => c.completed += 1,
            Some(DepOutcome::Dead) => c.dead += 1,
            Some(_) => c.other += 1,
        }
    }
    c
}

/// The callbacks of batch record `w` due now and not yet fired.
pub fn due(w: &Waiting) -> Vec<CallbackKind> {
    let Some(b) = &w.batch else {
        return Vec::new();
    };
    let c = counts(w);
    let all_ended = !b.open && c.pending == 0;
    b.callbacks
        .keys()
        .copied()
        .filter(|k| !b.fired.contains_key(k) && !b.refused.contains_key(k))
        .filter(|k| match k {
            CallbackKind::Death => c.dead > 0,
            CallbackKind::Complete => all_ended,
            CallbackKind::Success => all_ended && c.completed == c.jobs,
        })
        .collect()
}

/// Whether batch record `w` is done: closed, every job ended and every
/// callback due has fired or been refused for good (a death callback with
/// no dead job never is due).
pub fn done(w: &Waiting) -> bool {
    w.batch
        .as_ref()
        .is_some_and(|b| !b.open && counts(w).pending == 0)
        && due(w).is_empty()
}

/// The dedup id callback `kind` of batch `n` (its record's nonce `nonce`)
/// is enqueued with: `batch:@N.NONCE:KIND`.
pub fn callback_dedup_id(n: u64, nonce: &str, kind: CallbackKind) -> String {
    format!("{BATCH_PREFIX}@{n}.{nonce}:{}", kind.as_str())
}

/// The dedup id prefix of a batch's callbacks; refused from producers.
pub const BATCH_PREFIX: &str = "batch:";

/// The batch a released job belongs to, from its dedup id: a callback
/// (`batch:@N.NONCE:KIND`: the batch and the kind) or a job of the batch
/// (`after:@m.NONCE:batch@N`: the batch, no kind).
pub fn batch_of_dedup_id(dedup_id: &str) -> Option<(u64, Option<CallbackKind>)> {
    if let Some(rest) = dedup_id.strip_prefix(BATCH_PREFIX) {
        let (n, kind) = rest.strip_prefix('@')?.split_once(':')?;
        let (n, nonce) = n.split_once('.')?;
        if nonce.is_empty() {
            return None;
        }
        return Some((n.parse().ok()?, Some(CallbackKind::parse(kind)?)));
    }
    let rest = dedup_id.strip_prefix(super::AFTER_PREFIX)?;
    let (_, batch) = rest.split_once(":batch@")?;
    Some((batch.parse().ok()?, None))
}

/// What a handler is told of a job's batch, from its dedup id: the batch
/// (`@N`) for a job of a batch or a callback, and the callback's kind.
pub fn batch_fields(dedup_id: Option<&str>) -> (Option<String>, Option<&'static str>) {
    match dedup_id.and_then(batch_of_dedup_id) {
        Some((n, kind)) => (Some(format!("@{n}")), kind.map(CallbackKind::as_str)),
        None => (None, None),
    }
}

/// Parses a batch's id, `@N`, naming the value when it is not one.
pub fn parse_batch_id(s: &str) -> Result<u64, QueueError> {
    s.trim()
        .strip_prefix('@')
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| QueueError::InvalidOption {
            name: "batch",
            value: format!("{s:?}"),
            allowed: "a batch's id @N, as `shardq batch open` prints it".into(),
        })
}

fn refuse(name: &'static str, value: String, allowed: impl Into<String>) -> ReshardError {
    QueueError::InvalidOption {
        name,
        value,
        allowed: allowed.into(),
    }
    .into()
}

impl WaitingStore {
    /// Opens a batch: its number (`@N`), and whether it is a duplicate of
    /// one opened with the same dedup id on the same key.
    pub fn open_batch(
        maps: &dyn MapStore,
        now_ms: u64,
        new: &NewBatch,
    ) -> Result<(u64, bool), ReshardError> {
        if new.callbacks.is_empty() {
            return Err(refuse(
                "callbacks",
                "none".into(),
                "at least one of on complete, on success, on death",
            ));
        }
        let mut probe = NewJob::new(new.key.clone(), Vec::new());
        probe.max_attempts = new.max_attempts;
        probe.validate(DEPENDENT_PAYLOAD_BYTES_MAX)?;
        for (kind, p) in &new.callbacks {
            let mut j = NewJob::new(new.key.clone(), p.clone());
            j.max_attempts = new.max_attempts;
            j.validate(DEPENDENT_PAYLOAD_BYTES_MAX).map_err(|e| {
                refuse(
                    "callback payload",
                    format!("on {}: {e}", kind.as_str()),
                    format!("at most {DEPENDENT_PAYLOAD_BYTES_MAX} bytes"),
                )
            })?;
        }
        let mut job = probe;
        job.dedup_id = new.dedup_id.clone();
        let callbacks: BTreeMap<CallbackKind, String> = new
            .callbacks
            .iter()
            .map(|(k, p)| {
                use base64::Engine as _;
                (*k, base64::engine::general_purpose::STANDARD.encode(p))
            })
            .collect();
        Self::update(maps, |f: &mut WaitingFile| {
            let dep = NewDependent {
                job: job.clone(),
                after: Vec::new(),
                on_failure: OnDependencyFailure::Run,
            };
            let (n, dup) = insert(f, now_ms, std::slice::from_ref(&dep), Kind::Batch)?[0];
            if !dup {
                if let Some(w) = f.jobs.get_mut(&n) {
                    w.batch = Some(Batch {
                        open: true,
                        callbacks: callbacks.clone(),
                        fired: BTreeMap::new(),
                        refused: BTreeMap::new(),
                        closed_ms: None,
                    });
                }
            } else if f.jobs.get(&n).is_some_and(|w| w.batch.is_none()) {
                return Err(refuse(
                    "dedup id",
                    format!("{:?}", new.dedup_id.clone().unwrap_or_default()),
                    "an id not already used by a dependent of this key",
                ));
            }
            Ok((n, dup))
        })
    }

    /// Adds jobs to batch `n` in one compare-and-set: their numbers
    /// (`@m`), each with whether it was a duplicate (same key and dedup id
    /// as one the document keeps). Refused when the batch is unknown,
    /// complete, or closed with every job ended; and past
    /// [`BATCH_JOBS_MAX`] jobs.
    pub fn add_to_batch(
        maps: &dyn MapStore,
        now_ms: u64,
        n: u64,
        jobs: &[NewJob],
    ) -> Result<Vec<(u64, bool)>, ReshardError> {
        for j in jobs {
            j.validate(DEPENDENT_PAYLOAD_BYTES_MAX)?;
            if j.keyed.is_some() {
                return Err(refuse(
                    "batch",
                    "a unique or debounced job".into(),
                    "jobs without a unique or debounce id (a dedup id is fine)",
                ));
            }
        }
        let deps: Vec<NewDependent> = jobs
            .iter()
            .map(|j| NewDependent {
                job: j.clone(),
                after: Vec::new(),
                on_failure: OnDependencyFailure::Fail,
            })
            .collect();
        Self::update(maps, |f: &mut WaitingFile| {
            let Some(w) = f.jobs.get(&n) else {
                return Err(refuse(
                    "batch",
                    format!("@{n}"),
                    "the id of a batch that exists (this one is unknown, or ended longer ago than records are kept)",
                ));
            };
            let Some(b) = &w.batch else {
                return Err(refuse(
                    "batch",
                    format!("@{n}"),
                    "the id of a batch (this one is a dependent)",
                ));
            };
            if w.state != WaitState::Waiting || (!b.open && counts(w).pending == 0) {
                return Err(refuse(
                    "batch",
                    format!("@{n}"),
                    "a batch that is open, or closed with a job not yet ended (this one is complete)",
                ));
            }
            let had = w.after.len();
            let numbers = insert(f, now_ms, &deps, Kind::JobOf(n))?;
            let fresh: Vec<u64> = numbers
                .iter()
                .filter(|(_, dup)| !dup)
                .map(|(m, _)| *m)
                .collect();
            if had + fresh.len() > BATCH_JOBS_MAX {
                return Err(refuse(
                    "batch",
                    format!("@{n} with {} jobs", had + fresh.len()),
                    format!("at most {BATCH_JOBS_MAX} jobs in a batch"),
                ));
            }
            // A duplicate found elsewhere (a job of another batch, or a
            // dependent) is not this batch's.
            for (m, dup) in &numbers {
                if *dup && f.jobs.get(m).is_none_or(|w| w.member_of != Some(n)) {
                    return Err(refuse(
                        "dedup id",
                        format!("@{m}"),
                        "an id not already used on this key by a dependent or another batch's job",
                    ));
                }
            }
            if let Some(w) = f.jobs.get_mut(&n) {
                for m in fresh {
                    w.after.push(super::Dependency {
                        id: format!("@{m}"),
                        outcome: None,
                        at: None,
                        result_b64: None,
                        result_dropped: false,
                        reason: None,
                    });
                }
            }
            Ok(numbers)
        })
    }

    /// Closes batch `n`: from now on only its own jobs add to it, and its
    /// complete and success callbacks fire once every job has ended. The
    /// record before the call; closing twice is not an error.
    pub fn close_batch(maps: &dyn MapStore, n: u64, now_ms: u64) -> Result<Waiting, ReshardError> {
        Self::update(maps, |f: &mut WaitingFile| {
            let Some(w) = f.jobs.get_mut(&n) else {
                return Err(refuse(
                    "batch",
                    format!("@{n}"),
                    "the id of a batch that exists (this one is unknown, or ended longer ago than records are kept)",
                ));
            };
            let before = w.clone();
            let Some(b) = w.batch.as_mut() else {
                return Err(refuse(
                    "batch",
                    format!("@{n}"),
                    "the id of a batch (this one is a dependent)",
                ));
            };
            if b.open {
                b.open = false;
                b.closed_ms = Some(now_ms);
            }
            Ok(before)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryMapStore;
    use crate::workflow::{Dependency, Resolver};

    fn maps() -> MemoryMapStore {
        MemoryMapStore::new(
            shardq_route::ShardMap::with_shards(shardq_route::Algorithm::default(), ["a"]).unwrap(),
        )
    }

    fn batch(kinds: &[CallbackKind]) -> NewBatch {
        NewBatch {
            key: "cb".into(),
            max_attempts: 3,
            callbacks: kinds.iter().map(|k| (*k, b"x".to_vec())).collect(),
            dedup_id: None,
        }
    }

    fn set_outcomes(maps: &dyn MapStore, n: u64, outcomes: &[Option<DepOutcome>]) {
        WaitingStore::update(maps, |f: &mut WaitingFile| {
            let w = f.jobs.get_mut(&n).unwrap();
            for (d, o) in w.after.iter_mut().zip(outcomes) {
                d.outcome = *o;
            }
            Ok::<_, ReshardError>(())
        })
        .unwrap();
    }

    #[test]
    fn callbacks_are_due_by_outcomes_and_only_once_closed() {
        let m = maps();
        let all = [
            CallbackKind::Complete,
            CallbackKind::Success,
            CallbackKind::Death,
        ];
        let (n, _) = WaitingStore::open_batch(&m, 1, &batch(&all)).unwrap();
        let jobs = [NewJob::new("k1", "a"), NewJob::new("k2", "b")];
        WaitingStore::add_to_batch(&m, 1, n, &jobs).unwrap();
        let get = |m: &MemoryMapStore| WaitingStore::get(m, n).unwrap().unwrap();
        set_outcomes(&m, n, &[Some(DepOutcome::Completed), None]);
        assert!(due(&get(&m)).is_empty(), "open, one pending: nothing due");
        set_outcomes(
            &m,
            n,
            &[Some(DepOutcome::Completed), Some(DepOutcome::Dead)],
        );
        assert_eq!(due(&get(&m)), vec![CallbackKind::Death], "open: only death");
        WaitingStore::close_batch(&m, n, 2).unwrap();
        assert_eq!(
            due(&get(&m)),
            vec![CallbackKind::Complete, CallbackKind::Death],
            "closed with a dead job: complete and death, never success"
        );
        set_outcomes(
            &m,
            n,
            &[Some(DepOutcome::Completed), Some(DepOutcome::Completed)],
        );
        assert_eq!(
            due(&get(&m)),
            vec![CallbackKind::Complete, CallbackKind::Success]
        );
        // A closed batch with every job ended takes no more jobs.
        let e = WaitingStore::add_to_batch(&m, 3, n, &[NewJob::new("k3", "c")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("@{n}")) && e.contains("complete"),
            "{e}"
        );
    }

    #[test]
    fn a_closed_batch_takes_jobs_while_one_of_its_jobs_runs() {
        let m = maps();
        let (n, _) = WaitingStore::open_batch(&m, 1, &batch(&[CallbackKind::Complete])).unwrap();
        WaitingStore::add_to_batch(&m, 1, n, &[NewJob::new("k1", "a")]).unwrap();
        WaitingStore::close_batch(&m, n, 2).unwrap();
        let more = WaitingStore::add_to_batch(&m, 3, n, &[NewJob::new("k1", "child")]).unwrap();
        assert_eq!(more.len(), 1);
        let w = WaitingStore::get(&m, n).unwrap().unwrap();
        assert_eq!(w.after.len(), 2);
        assert_eq!(
            WaitingStore::get(&m, more[0].0).unwrap().unwrap().member_of,
            Some(n)
        );
    }

    #[test]
    fn bad_batches_are_refused_by_name() {
        let m = maps();
        let e = WaitingStore::open_batch(&m, 1, &batch(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("callbacks"), "{e}");
        let e = WaitingStore::add_to_batch(&m, 1, 77, &[NewJob::new("k", "a")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("@77"), "{e}");
        // A dependent is not a batch.
        let mut lookup = |_: &str, _| Ok(crate::backend::JobLookup::Unknown);
        let d = WaitingStore::add(
            &m,
            &mut lookup,
            1,
            &[NewDependent {
                job: NewJob::new("k", "p"),
                after: Vec::new(),
                on_failure: OnDependencyFailure::Fail,
            }],
        )
        .unwrap()[0]
            .0;
        let e = WaitingStore::add_to_batch(&m, 1, d, &[NewJob::new("k", "a")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("dependent"), "{e}");
        let e = WaitingStore::close_batch(&m, d, 1).unwrap_err().to_string();
        assert!(e.contains("dependent"), "{e}");
        // The bound on jobs per batch.
        let (n, _) = WaitingStore::open_batch(&m, 1, &batch(&[CallbackKind::Complete])).unwrap();
        WaitingStore::update(&m, |f: &mut WaitingFile| {
            let w = f.jobs.get_mut(&n).unwrap();
            w.after = (0..BATCH_JOBS_MAX)
                .map(|i| Dependency {
                    id: format!("@{}", 1_000_000 + i),
                    outcome: Some(DepOutcome::Completed),
                    at: None,
                    result_b64: None,
                    result_dropped: false,
                    reason: None,
                })
                .collect();
            Ok::<_, ReshardError>(())
        })
        .unwrap();
        let e = WaitingStore::add_to_batch(&m, 1, n, &[NewJob::new("k", "a")])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&BATCH_JOBS_MAX.to_string()), "{e}");
        let _ = Resolver::new;
    }

    /// What an attacker's read found: a dependent after a batch (nothing
    /// would record its end), a dependent answered as the duplicate of a
    /// batch, one dedup id twice in one add, an idle exit before a death
    /// callback, and a trim that lost a pending batch's ended jobs (and
    /// with them their dedup ids).
    #[test]
    fn mixed_kinds_repeats_exits_and_trims_are_caught() {
        let m = maps();
        let mut b = batch(&[CallbackKind::Death]);
        b.dedup_id = Some("nightly".into());
        let (n, _) = WaitingStore::open_batch(&m, 1, &b).unwrap();
        let mut lookup = |_: &str, _| Ok(crate::backend::JobLookup::Unknown);
        let dep = |after: Vec<crate::workflow::DepRef>, dedup: Option<&str>| NewDependent {
            job: NewJob {
                dedup_id: dedup.map(String::from),
                ..NewJob::new("cb", "p")
            },
            after,
            on_failure: OnDependencyFailure::Fail,
        };
        let e = WaitingStore::add(
            &m,
            &mut lookup,
            1,
            &[dep(vec![crate::workflow::DepRef::Waiting(n)], None)],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(&format!("@{n}")) && e.contains("batch"), "{e}");
        let e = WaitingStore::add(&m, &mut lookup, 1, &[dep(Vec::new(), Some("nightly"))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("nightly") && e.contains("a batch"), "{e}");
        let twice = NewJob {
            dedup_id: Some("c".into()),
            ..NewJob::new("k", "x")
        };
        let e = WaitingStore::add_to_batch(&m, 1, n, &[twice.clone(), twice.clone()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("jobs[1]") && e.contains("jobs[0]"), "{e}");
        // An open batch with a death callback and a job whose end is not
        // recorded is work ahead; without a death callback it is not.
        let added = WaitingStore::add_to_batch(&m, 1, n, &[twice]).unwrap();
        WaitingStore::update(&m, |f: &mut WaitingFile| {
            f.jobs.get_mut(&added[0].0).unwrap().state = WaitState::Released;
            f.jobs.get_mut(&added[0].0).unwrap().ended_ms = Some(1);
            Ok::<_, ReshardError>(())
        })
        .unwrap();
        assert!(WaitingStore::load(&m).unwrap().work_ahead());
        let (quiet, _) =
            WaitingStore::open_batch(&m, 1, &batch(&[CallbackKind::Complete])).unwrap();
        set_outcomes(&m, n, &[Some(DepOutcome::Completed)]);
        let f = WaitingStore::load(&m).unwrap();
        assert!(!f.work_ahead(), "open batches with nothing due: {f:?}");
        let _ = quiet;
        // Two days on, the pending batch's ended job is still kept: its
        // dedup id still answers.
        let mut f = WaitingStore::load(&m).unwrap();
        f.trim(2 * crate::workflow::ENDED_KEPT_MS + 10);
        assert!(f.jobs.contains_key(&added[0].0), "{f:?}");
    }

    #[test]
    fn dedup_ids_name_the_batch() {
        assert_eq!(
            batch_of_dedup_id(&callback_dedup_id(7, "9f", CallbackKind::Success)),
            Some((7, Some(CallbackKind::Success)))
        );
        assert_eq!(batch_of_dedup_id("after:@3.9f:batch@7"), Some((7, None)));
        assert_eq!(batch_of_dedup_id("after:@3.9f"), None);
        assert_eq!(batch_of_dedup_id("batch:@x.9f:complete"), None);
        assert_eq!(batch_of_dedup_id("batch:@1.9f:later"), None);
        assert_eq!(batch_of_dedup_id("batch:@1:complete"), None, "no nonce");
        assert_eq!(
            crate::workflow::dependent_of_dedup_id("after:@3.9f:batch@7"),
            Some(3)
        );
        assert_eq!(
            crate::workflow::dependent_of_dedup_id("after:@3.9f"),
            Some(3)
        );
        assert_eq!(
            crate::workflow::dependent_of_dedup_id("after:@3"),
            None,
            "no nonce"
        );
    }
}
