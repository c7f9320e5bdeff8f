//! Job views read from the log and the replica (`JobInfo`, `FinishedJob`, a
//! dead job's record) and the dead-letter changes (`dead_change`: retry and
//! purge).

use super::*;

impl FsBackend {
    pub(super) fn dead_change(
        &self,
        name: &str,
        ids: Option<&[JobId]>,
        retry: bool,
    ) -> Result<usize, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let mut count = 0usize;
        let (_, end) = self.append_with(&shard, &mut inner, &mut |inner, _| {
            // A dead job of a key sealed for a move stays as it is: its copy
            // goes (or went) with the key, and a retry or purge here would
            // be undone or lost with the copies left behind.
            let fence = self.read_fence(&shard, inner)?;
            let r = inner.replica.as_ref().expect("refreshed");
            let movable = |&i: &u64| {
                r.dead_key(i)
                    .is_some_and(|k| !fence.sealed_keys.contains_key(k))
            };
            let chosen: Vec<u64> = match ids {
                None => r.dead_ids().into_iter().filter(movable).collect(),
                Some(ids) => ids.iter().map(|i| i.0).filter(movable).collect(),
            };
            count = chosen.len();
            let mut bytes = Vec::new();
            for job in chosen {
                let rec = if retry {
                    Record::DeadRetry { job }
                } else {
                    Record::DeadPurge { job }
                };
                record::encode(&mut bytes, &rec);
            }
            Ok(bytes)
        })?;
        if !retry {
            self.compact(&mut inner)?;
        }
        drop(inner);
        self.after_append(&shard, end)?;
        Ok(count)
    }
}

/// What a job's own record holds that the replayed state does not keep.
pub(super) struct Recorded {
    /// Enqueue time.
    pub created_ms: u64,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// The dedup id it was enqueued with.
    pub dedup_id: Option<String>,
}

/// Job `id` of `key` as its Enqueue or Import record holds it (the state
/// keeps none of it), with the payload of the Debounce record at
/// `payload_at` when a debounce gave it one.
pub(super) fn read_job(
    name: &str,
    log: &mut ShardLog,
    id: u64,
    key: &str,
    payload_at: Option<u64>,
) -> Result<Recorded, QueueError> {
    let mut job = job_of_record(name, &log.read_record_at(id)?, id, key)?;
    if let Some(at) = payload_at {
        job.payload = debounced_payload(name, &log.read_record_at(at)?, at, id)?;
    }
    Ok(job)
}

/// The payload a Debounce record (`bytes`, at `at`) gave job `id`.
pub(super) fn debounced_payload(
    name: &str,
    bytes: &[u8],
    at: u64,
    id: u64,
) -> Result<Vec<u8>, QueueError> {
    match decode(bytes) {
        Ok((Record::Debounce { job, payload, .. }, _)) if job == id => Ok(payload.to_vec()),
        other => Err(QueueError::Inconsistent {
            shard: name.to_string(),
            segment: "-".into(),
            offset: at,
            reason: format!(
                "the payload of job {id} should be the Debounce record at {at}, found {:?}",
                other.map(|(r, _)| format!("{r:?}").chars().take(80).collect::<String>())
            ),
        }),
    }
}

/// Job `id` of `key` as `bytes`, its record, hold it.
pub(super) fn job_of_record(
    name: &str,
    bytes: &[u8],
    id: u64,
    key: &str,
) -> Result<Recorded, QueueError> {
    let bad = |reason: String| QueueError::Inconsistent {
        shard: name.to_string(),
        segment: "-".into(),
        offset: id,
        reason,
    };
    let (rec, _) =
        decode(bytes).map_err(|e| bad(format!("the record of job {id} does not decode: {e:?}")))?;
    let (created_ms, k, payload, dedup_id) = match rec {
        Record::Enqueue {
            created_ms,
            key,
            payload,
            dedup,
            ..
        } => (created_ms, key, payload, dedup.map(|d| d.id)),
        Record::Import {
            created_ms,
            key,
            payload,
            dedup_id,
            ..
        } => (
            created_ms,
            key,
            payload,
            Some(dedup_id).filter(|d| !d.is_empty()),
        ),
        _ => {
            return Err(bad(format!(
                "job {id} of key {key:?} does not start at an enqueue"
            )))
        }
    };
    if k != key {
        return Err(bad(format!(
            "the enqueue record of job {id} has key {k:?}, the replica has {key:?}"
        )));
    }
    Ok(Recorded {
        created_ms,
        payload: payload.to_vec(),
        dedup_id: dedup_id.map(str::to_string),
    })
}

/// A live job that just finished, as the finished file keeps it.
pub(super) fn finished_job(
    j: &crate::state::LiveJob<'_>,
    outcome: Finish,
    now: u64,
) -> FinishedJob {
    let starts = &j.starts[j
        .starts
        .len()
        .saturating_sub(shardq_core::FINISHED_STARTS_KEPT)..];
    FinishedJob {
        id: JobId(j.slot.id),
        key: j.key.to_string(),
        outcome,
        attempts: j.slot.attempt,
        finished_ms: now,
        attempt_starts_ms: starts.to_vec(),
        reason: j.reason.map(str::to_string),
        result: None,
    }
}

/// A live job of the state as [`JobInfo`], its record read back.
pub(super) fn job_info(
    name: &str,
    log: &mut ShardLog,
    j: &crate::state::LiveJob<'_>,
    now: u64,
) -> Result<JobInfo, QueueError> {
    let Recorded {
        created_ms,
        payload,
        dedup_id,
    } = read_job(name, log, j.slot.id, j.key, j.payload_at)?;
    let (state, attempts) = if j.run.is_some() {
        (JobState::Running, j.slot.attempt.saturating_sub(1))
    } else if j.dead {
        (JobState::Dead, j.slot.attempt)
    } else if j.slot.not_before_ms > now {
        (JobState::Delayed, j.slot.attempt)
    } else {
        (JobState::Queued, j.slot.attempt)
    };
    Ok(JobInfo {
        id: JobId(j.slot.id),
        key: j.key.to_string(),
        state,
        attempts,
        max_attempts: j.slot.max_attempts,
        created_ms,
        not_before_ms: j.slot.not_before_ms,
        run: j.run,
        reason: j.reason.map(str::to_string),
        attempt_starts_ms: j.starts.to_vec(),
        payload,
        dedup_id,
    })
}
