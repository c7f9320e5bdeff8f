//! Operators' reads and actions on the embedded engine: [`InspectJobs`] for [`FsBackend`].

use super::*;

impl InspectJobs for FsBackend {
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
}
