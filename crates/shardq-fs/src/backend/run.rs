//! Running jobs on the embedded engine: [`RunJobs`] for [`FsBackend`].

use super::*;

impl RunJobs for FsBackend {
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
            let mut batch = DedupBatch::new(shard_name, jobs, now, expires_ms, start);
            for job in jobs {
                out.push(batch.place(job, r, &fence)?);
            }
            if batch.bytes.len() > ENQUEUE_BATCH_BYTES_MAX {
                return Err(QueueError::BatchTooLarge {
                    jobs: jobs.len(),
                    max: ENQUEUE_BATCH_JOBS_MAX,
                });
            }
            Ok(batch.bytes)
        })?;
        drop(inner);
        self.after_append(&shard, end)?;
        Ok(out)
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
            // No finished jobs kept: none is left on disk either.
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

    fn ack_results(
        &self,
        name: &str,
        receipts: &[Receipt],
        results: &[Option<Vec<u8>>],
    ) -> Result<AckOutcome, QueueError> {
        shardq_core::job::check_ack_results(receipts, results)?;
        let shard = self.shard(name)?;
        let mut inner = self.owned_inner(&shard)?;
        let mut outcome = AckOutcome::default();
        let now = self.opts.clock.now_ms();
        // No finished jobs kept: nothing to gather per acked job.
        let keep_finished = self.opts.retention.finished_jobs > 0;
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
            for (i, rc) in receipts.iter().enumerate() {
                // A receipt given twice in one batch finishes its run once.
                match r.current_run(rc.id.0, rc.fence) {
                    Some(run) if !done.contains(&rc.id.0) => {
                        if let Some(j) = r.live_job(rc.id.0).filter(|_| keep_finished) {
                            let mut f = finished_job(&j, Finish::Completed, now);
                            f.result = shardq_core::job::result_at(results, i);
                            finished.push(f);
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
            // finished line never stands for an ack that failed.
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

    fn stale_runs(&self, name: &str, receipts: &[Receipt]) -> Result<Vec<Receipt>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        // Catches up with the log: a cancel is a record any process appends.
        self.refresh(&mut inner)?;
        let r = inner.replica.as_ref().expect("refreshed");
        Ok((receipts.iter())
            .filter(|rc| r.current_run(rc.id.0, rc.fence).is_none())
            .copied()
            .collect())
    }

    fn next_due_ms(&self, name: &str) -> Result<Option<u64>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        Ok(inner.replica.as_mut().and_then(|r| r.next_due_ms()))
    }
}

/// One [`RunJobs::enqueue_dedup`] batch as it is encoded under the append
/// lock: the records' bytes, and the ids met earlier in the batch (not in
/// the replayed state until the batch is written).
struct DedupBatch<'a> {
    shard: &'a str,
    now: u64,
    /// When this batch's dedup records expire.
    expires_ms: u64,
    /// Where the batch's first record lands in the log (job ids are
    /// positions).
    start: u64,
    multi: bool,
    bytes: Vec<u8>,
    /// Dedup ids stored earlier in this batch; allocated only when a batch
    /// holds more than one job. Seeded at random per process: the ids are
    /// the producer's.
    in_batch: HashMap<(&'a str, &'a str), u64, ahash::RandomState>,
    /// Keyed jobs stored earlier in this batch, the newest per id.
    keyed_batch: HashMap<(&'a str, &'a str), KeyedLive, ahash::RandomState>,
}

impl<'a> DedupBatch<'a> {
    fn new(shard: &'a str, jobs: &[NewJob], now: u64, expires_ms: u64, start: u64) -> Self {
        let bytes = Vec::with_capacity(
            jobs.iter()
                .map(|j| j.payload.len() + j.key.len() + 64)
                .sum(),
        );
        let mut in_batch = HashMap::with_hasher(ahash::RandomState::new());
        if jobs.len() > 1 {
            in_batch.reserve(jobs.len());
        }
        DedupBatch {
            shard,
            now,
            expires_ms,
            start,
            multi: jobs.len() > 1,
            bytes,
            in_batch,
            keyed_batch: HashMap::with_hasher(ahash::RandomState::new()),
        }
    }

    fn stored(&self, id: JobId, duplicate: bool) -> Stored {
        Stored {
            id,
            shard: self.shard.to_string(),
            duplicate,
        }
    }

    /// Encodes `job` (or the Debounce record of the waiting job it meets)
    /// and says what became of it.
    fn place(
        &mut self,
        job: &'a NewJob,
        r: &ShardState,
        fence: &Fence,
    ) -> Result<Stored, QueueError> {
        let now = self.now;
        let mut not_before_ms = now + job.delay_ms;
        if let (Some(mode), Some(d)) = (job.keyed, job.dedup_id.as_deref()) {
            let live = (self.keyed_batch.get(&(job.key.as_str(), d)).copied())
                .or_else(|| r.keyed_live(&job.key, d));
            match keyed_meets(mode, live, job.delay_ms, now) {
                KeyedMeets::Duplicate(id) => return Ok(self.stored(id, true)),
                KeyedMeets::Debounce {
                    job: waiting,
                    not_before_ms,
                } => {
                    if fence.sealed_keys.contains_key(&job.key) {
                        // Its copy on the new shard would miss the
                        // payload: the producer waits for the move.
                        return Err(QueueError::Paused {
                            shard: self.shard.to_string(),
                            key: job.key.clone(),
                        });
                    }
                    record::encode(
                        &mut self.bytes,
                        &Record::Debounce {
                            job: waiting.0,
                            not_before_ms,
                            key: &job.key,
                            payload: &job.payload,
                        },
                    );
                    return Ok(self.stored(waiting, false));
                }
                KeyedMeets::Store {
                    not_before_ms: start,
                } => not_before_ms = start,
            }
        } else if let Some(d) = job.dedup_id.as_deref() {
            let known = r
                .dedup_lookup(&job.key, d, now)
                .map(|e| (e.job, e.shard.as_deref().unwrap_or(self.shard).to_string()));
            let known = known.or_else(|| {
                (self.in_batch.get(&(job.key.as_str(), d))).map(|&id| (id, self.shard.to_string()))
            });
            if let Some((id, on)) = known {
                return Ok(Stored {
                    id: JobId(id),
                    shard: on,
                    duplicate: true,
                });
            }
        }
        let pos = self.start + self.bytes.len() as u64;
        // The dedup id is a field of its job's record: one append, one
        // checksum, so neither exists without the other. A keyed id leaves
        // no dedup record (it answers while its job lives): written as
        // expired.
        let expires_ms = if job.keyed.is_some() {
            now
        } else {
            self.expires_ms
        };
        record::encode(
            &mut self.bytes,
            &Record::Enqueue {
                created_ms: now,
                not_before_ms,
                max_attempts: job.max_attempts,
                key: &job.key,
                dedup: (job.dedup_id.as_deref()).map(|id| EnqueueDedup { id, expires_ms }),
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
                self.keyed_batch.insert((job.key.as_str(), d), live);
            } else if self.multi {
                self.in_batch.insert((job.key.as_str(), d), pos);
            }
        }
        Ok(self.stored(JobId(pos), false))
    }
}
