//! Running jobs on the Redis backend: [`RunJobs`] for [`RedisBackend`].

use super::*;

impl RunJobs for RedisBackend {
    fn limits(&self) -> shardq_core::BackendLimits {
        shardq_core::BackendLimits {
            enqueue_batch_jobs_max: ENQUEUE_BATCH_MAX,
            key_concurrency_max: shardq_core::flow::KEY_CONCURRENCY_MAX,
            ..shardq_core::BackendLimits::default()
        }
    }

    fn shard_names(&self) -> Vec<String> {
        self.registry()
            .shards
            .iter()
            .map(|s| s.name.clone())
            .collect()
    }

    fn enqueue(
        &self,
        shard: &str,
        map_version: u64,
        jobs: &[NewJob],
    ) -> Result<Vec<JobId>, QueueError> {
        shardq_core::job::refuse_dedup_ids(jobs)?;
        Ok(self
            .enqueue_jobs(shard, map_version, jobs, 0)?
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
        shardq_core::job::validate_dedup_window_ms(window_ms)?;
        self.enqueue_jobs(shard, map_version, jobs, window_ms)
    }

    fn adopt(&self, shard: &str) -> Result<(), QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let token = self
            .tokens()
            .get(shard)
            .cloned()
            .ok_or_else(|| Self::not_owner(s))?;
        let keep = self.inner.opts.retention;
        let v = self.script(s, &self.inner.scripts.adopt, &token, &|c, _| {
            c.arg(keep.finished_jobs)
                .arg(keep.finished_age_ms)
                .arg(crate::scripts::keys_pin_value());
        })?;
        if reply::status(&v) != "OK" {
            return Err(Self::not_owner(s));
        }
        *s.held() = Some(Held {
            token,
            in_flight: HashMap::new(),
            limits_version: 0,
        });
        Ok(())
    }

    fn release(&self, shard: &str) -> Result<(), QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        *s.held() = None;
        Ok(())
    }

    fn claim(&self, shard: &str, max: usize, lease_ms: u64) -> Result<Vec<ClaimedJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        validate_job_lease_ms(lease_ms)?;
        // Held for the whole call: a retried claim puts back in-flight jobs
        // this process does not know, so no other claim may be half done.
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let max = max.min(CLAIM_BATCH_MAX);
        if max == 0 {
            return Ok(Vec::new());
        }
        // Before ranking: a key whose limit rose is ready again.
        if !self.refresh_limits(s, held)? {
            *guard = None;
            return Err(Self::not_owner(s));
        }
        let ranked = (self.inner.opts.flow.as_deref()).filter(|f| f.ranks_keys());
        let picked = match ranked {
            Some(f) => match self.rank_ready(s, &held.token, f, max)? {
                Some(p) => Some(p),
                None => {
                    *guard = None;
                    return Err(Self::not_owner(s));
                }
            },
            None => None,
        };
        let Some((v, before)) = self.claim_script(s, held, max, lease_ms, picked.as_deref())?
        else {
            *guard = None;
            return Err(Self::not_owner(s));
        };
        let it = reply::items(&v);
        let bad = || self.protocol(s, "claim reply has a malformed job");
        let lease_until_ms = it.get(1).and_then(reply::u64).ok_or_else(bad)?;
        // The server's now (the lease deadline less the lease): flow
        // control reads its settings and counts its buckets in it.
        let now = lease_until_ms.saturating_sub(lease_ms);
        *self
            .inner
            .server_time
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some((now, std::time::Instant::now()));
        let seq = it.get(2).and_then(reply::u64).ok_or_else(bad)?;
        let claimed = self.take_claimed(s, held, before, seq, it.get(3..).unwrap_or(&[]))?;
        let admits = self.admit_claimed(s, &claimed, now, lease_until_ms);
        let mut out = Vec::with_capacity(claimed.len());
        for ((id, rec, fence), admit) in claimed.into_iter().zip(admits) {
            if let Admit::NotBefore(at) = admit {
                let r = Receipt {
                    id: JobId(id),
                    fence,
                };
                match self.give_back(s, held, r, &rec.key, at.saturating_sub(now), false) {
                    Ok(_) => continue,
                    // Its first try went through and the reply was
                    // lost: it is given back.
                    Err(QueueError::StaleReceipt { .. }) => {
                        held.in_flight.remove(&id);
                        continue;
                    }
                    // Not given back: the run is in flight, so it
                    // starts now (over the limit by one) rather than
                    // waiting out its lease and losing an attempt.
                    Err(_) => {}
                }
            }
            if let Some(p) = (picked.as_ref()).and_then(|p| p.iter().find(|p| p.key == rec.key)) {
                let mut fair = s.fair.lock().unwrap_or_else(|p| p.into_inner());
                fair.charge(p);
                // Picked keys mean ranking, with or without limits.
                if let Some(f) = self.inner.opts.flow.as_deref() {
                    f.raise_fair_vtime(fair.vtime());
                }
            }
            out.push(ClaimedJob {
                shard: s.name.clone(),
                id: JobId(id),
                // The record counts finished attempts; this is the next one.
                attempt: rec.attempts + 1,
                max_attempts: rec.max_attempts,
                created_ms: rec.created_ms,
                not_before_ms: rec.not_before_ms,
                key: rec.key,
                payload: rec.payload.to_vec(),
                fence,
                lease_until_ms,
                dedup_id: rec.dedup_id,
            });
        }
        Ok(out)
    }

    fn ack_results(
        &self,
        shard: &str,
        receipts: &[Receipt],
        results: &[Option<Vec<u8>>],
    ) -> Result<AckOutcome, QueueError> {
        shardq_core::job::check_ack_results(receipts, results)?;
        let s = self.shard(shard)?;
        let s = &*s;
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let token = held.token.clone();
        let mut outcome = AckOutcome::default();
        // Runs over (acked, or refused as not current), whose group slots
        // go back, whatever a later chunk does.
        let mut ended: Vec<(String, u64)> = Vec::new();
        let mut not_owner = false;
        let res = (|| -> Result<(), QueueError> {
            for (from, to) in ack_chunks(receipts, results) {
                let chunk = &receipts[from..to];
                let list = ack_args(chunk, results.get(from..to).unwrap_or(&[]), &held.in_flight);
                let retried = std::cell::Cell::new(false);
                let v = self.script(s, &self.inner.scripts.ack, &token, &|c, attempt| {
                    retried.set(attempt > 0);
                    c.arg(&list);
                })?;
                match reply::status(&v).as_str() {
                    "OK" => {}
                    "NOTOWNER" => {
                        not_owner = true;
                        return Err(Self::not_owner(s));
                    }
                    other => return Err(self.protocol(s, format!("ack answered {other:?}"))),
                }
                let stale = self.stale_list(s, reply::items(&v).get(1..).unwrap_or(&[]))?;
                let mut refused = Vec::new();
                for (r, why) in stale {
                    // After a lost reply the first attempt may have acked it:
                    // a job that is gone was finished, by this call.
                    if retried.get() && why == "gone" && held.in_flight.contains_key(&r.id.0) {
                        continue;
                    }
                    refused.push(r.id.0);
                    outcome.stale.push(r);
                }
                outcome.acked += (chunk.len() - refused.len()) as u64;
                for r in chunk {
                    if let Some(run) = held.in_flight.remove(&r.id.0) {
                        ended.push((run.key, r.fence));
                    }
                }
            }
            Ok(())
        })();
        if not_owner {
            *guard = None;
        }
        drop(guard);
        self.runs_ended(shard, &ended);
        res.map(|()| outcome)
    }

    fn fail(
        &self,
        shard: &str,
        receipt: Receipt,
        reason: &str,
        retry_in_ms: Option<u64>,
    ) -> Result<FailOutcome, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        if let Some(ms) = retry_in_ms {
            if ms > shardq_core::job::DELAY_MS_MAX {
                return Err(QueueError::InvalidDelay {
                    delay_ms: ms,
                    max: shardq_core::job::DELAY_MS_MAX,
                });
            }
        }
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let reason = shardq_core::job::cut_at_char(reason, shardq_core::job::FAIL_REASON_BYTES_MAX);
        let opts = &self.inner.opts;
        let backoff = (held.in_flight.get(&receipt.id.0))
            .and_then(|run| opts.retry_rules.for_key(&run.key))
            .map_or(opts.backoff, |p| p.backoff);
        let retry = retry_in_ms.map(|m| m.to_string()).unwrap_or_default();
        let v = self.script(s, &self.inner.scripts.fail, &held.token, &|c, _| {
            c.arg(receipt.id.0)
                .arg(receipt.fence)
                .arg(reason)
                .arg(backoff.base_ms)
                .arg(backoff.max_ms)
                .arg(&retry)
                .arg(match backoff.kind {
                    shardq_core::BackoffKind::Exponential => "exp",
                    shardq_core::BackoffKind::Fixed => "fixed",
                })
                .arg(backoff.jitter_share(shardq_core::job::run_seed(receipt)));
        })?;
        match reply::status(&v).as_str() {
            "RETRY" => {
                let key = held.in_flight.remove(&receipt.id.0).map(|r| r.key);
                drop(guard);
                self.runs_ended(shard, &Vec::from_iter(key.map(|k| (k, receipt.fence))));
                Ok(FailOutcome::Retry {
                    at_ms: reply::items(&v).get(1).and_then(reply::u64).unwrap_or(0),
                })
            }
            "DEAD" => {
                let key = held.in_flight.remove(&receipt.id.0).map(|r| r.key);
                drop(guard);
                self.runs_ended(shard, &Vec::from_iter(key.map(|k| (k, receipt.fence))));
                Ok(FailOutcome::Dead)
            }
            "NOTOWNER" => {
                *guard = None;
                Err(Self::not_owner(s))
            }
            "STALE" => {
                // Not current (or ended by a first try whose reply was
                // lost): over either way, so its slot goes.
                let key = held.in_flight.get(&receipt.id.0).map(|r| r.key.clone());
                drop(guard);
                self.runs_ended(shard, &Vec::from_iter(key.map(|k| (k, receipt.fence))));
                Err(Self::stale_reply(s, receipt, &v))
            }
            other => Err(self.protocol(s, format!("fail answered {other:?}"))),
        }
    }

    fn ready_ranks(&self, shard: &str, max: usize) -> Result<Vec<Rank>, QueueError> {
        let Some(f) = (self.inner.opts.flow.as_deref()).filter(|f| f.ranks_keys()) else {
            return Ok(Vec::new());
        };
        let s = self.shard(shard)?;
        let s = &*s;
        // As a claim: its peek may put back lapsed runs.
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        match self.rank_ready(s, &held.token, f, max.min(CLAIM_BATCH_MAX))? {
            Some(picked) => Ok(picked.iter().map(Popped::rank).collect()),
            None => {
                *guard = None;
                Err(Self::not_owner(s))
            }
        }
    }

    fn ranks_keys(&self) -> bool {
        self.inner
            .opts
            .flow
            .as_ref()
            .is_some_and(|f| f.ranks_keys())
    }

    fn limits_starts(&self) -> bool {
        self.inner
            .opts
            .flow
            .as_ref()
            .is_some_and(|f| f.limits_starts())
    }

    fn key_concurrency(&self, key: &str) -> u32 {
        self.inner
            .opts
            .flow
            .as_ref()
            .map_or(1, |f| f.concurrency_of(key))
    }

    fn back_off(
        &self,
        shard: &str,
        receipt: Receipt,
        retry_in_ms: u64,
        group: bool,
    ) -> Result<BackedOff, QueueError> {
        shardq_core::flow::validate_backoff_ms(retry_in_ms)?;
        let s = self.shard(shard)?;
        let s = &*s;
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let key = (held.in_flight.get(&receipt.id.0))
            .map(|r| r.key.clone())
            .unwrap_or_default();
        let given = self.give_back(s, held, receipt, &key, retry_in_ms, true);
        if let Err(QueueError::NotOwner { .. }) = given {
            *guard = None;
            return Err(Self::not_owner(s));
        }
        drop(guard);
        // Given back, or refused as not current: over either way.
        if !key.is_empty() && matches!(given, Ok(_) | Err(QueueError::StaleReceipt { .. })) {
            self.runs_ended(shard, &[(key.clone(), receipt.fence)]);
        }
        let at_ms = given?;
        let held_group = match (&self.inner.opts.flow, group, key.is_empty()) {
            (Some(f), true, false) => f.hold_group_of(&key, at_ms),
            _ => None,
        };
        Ok(BackedOff {
            at_ms,
            group: held_group,
        })
    }

    fn extend(
        &self,
        shard: &str,
        receipts: &[Receipt],
        lease_ms: u64,
    ) -> Result<Vec<Receipt>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        validate_job_lease_ms(lease_ms)?;
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let token = held.token.clone();
        let mut stale = Vec::new();
        let slots = (self.inner.opts.flow.as_deref()).filter(|f| f.limits_starts());
        let mut renewed: Vec<(u64, Vec<(String, u64)>)> = Vec::new();
        for chunk in receipts.chunks(EXTEND_BATCH_MAX) {
            let list = receipt_args(chunk, &held.in_flight);
            let v = self.script(s, &self.inner.scripts.extend, &token, &|c, _| {
                c.arg(lease_ms).arg(&list);
            })?;
            match reply::status(&v).as_str() {
                "OK" => {}
                "NOTOWNER" => {
                    *guard = None;
                    return Err(Self::not_owner(s));
                }
                other => return Err(self.protocol(s, format!("extend answered {other:?}"))),
            }
            let before = stale.len();
            for (r, _) in self.stale_list(s, reply::items(&v).get(2..).unwrap_or(&[]))? {
                held.in_flight.remove(&r.id.0);
                stale.push(r);
            }
            if slots.is_some() {
                let deadline = reply::items(&v).get(1).and_then(reply::u64).unwrap_or(0);
                let refused = &stale[before..];
                let keys = (chunk.iter())
                    .filter(|r| !refused.iter().any(|x| x.id == r.id))
                    .filter_map(|r| (held.in_flight.get(&r.id.0)).map(|x| (x.key.clone(), r.fence)))
                    .collect();
                renewed.push((deadline, keys));
            }
        }
        drop(guard);
        if let Some(f) = slots {
            for (deadline, runs) in &renewed {
                let runs: Vec<(&str, u64)> = runs.iter().map(|(k, f)| (k.as_str(), *f)).collect();
                f.runs_extended(shard, &runs, *deadline);
            }
        }
        Ok(stale)
    }

    fn stale_runs(&self, shard: &str, receipts: &[Receipt]) -> Result<Vec<Receipt>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut stale = Vec::new();
        for chunk in receipts.chunks(EXTEND_BATCH_MAX) {
            // The keys of the runs this process handed out; the script
            // reads the others' from their jobs.
            let list = match s.held().as_ref() {
                Some(held) => receipt_args(chunk, &held.in_flight),
                None => receipt_args(chunk, &HashMap::new()),
            };
            let v = self.script(s, &self.inner.scripts.runs_stale, "", &|c, _| {
                c.arg(&list);
            })?;
            if reply::status(&v) != "OK" {
                return Err(
                    self.protocol(s, format!("runs_stale answered {:?}", reply::status(&v)))
                );
            }
            let items = reply::items(&v).get(1..).unwrap_or(&[]);
            if items.len() % 2 != 0 {
                return Err(self.protocol(s, "a stale run in the reply is malformed"));
            }
            for t in items.chunks(2) {
                let bad = || self.protocol(s, "a stale run in the reply is malformed");
                stale.push(Receipt {
                    id: JobId(reply::u64(&t[0]).ok_or_else(bad)?),
                    fence: reply::u64(&t[1]).ok_or_else(bad)?,
                });
            }
        }
        Ok(stale)
    }

    fn next_due_ms(&self, shard: &str) -> Result<Option<u64>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.next_due, "", &|_, _| {})?;
        Ok(reply::u64(&v))
    }
}

/// The parts of a claim on Redis around its script.
impl RedisBackend {
    /// Puts flow-control settings changed since the last claim in use
    /// (read again when due, by the scripts' clock or an estimate of the
    /// server's from its last reply) and rewrites the shard's copy of the
    /// run limits when its version is not ours. False when the shard was
    /// lost meanwhile.
    fn refresh_limits(&self, s: &ShardRef, held: &mut Held) -> Result<bool, QueueError> {
        let Some(f) = self.inner.opts.flow.as_deref() else {
            return Ok(true);
        };
        let now = match self.inner.opts.clock.as_ref() {
            Some(c) => Some(c.now_ms()),
            None => (*self
                .inner
                .server_time
                .lock()
                .unwrap_or_else(|p| p.into_inner()))
            .map(|(ms, at)| ms.saturating_add(at.elapsed().as_millis() as u64)),
        };
        if let Some(now) = now {
            f.refresh(now);
        }
        if held.limits_version != f.version() {
            return self.relimit(s, held, f);
        }
        Ok(true)
    }

    /// Reads the claim script's jobs (`<id> <record> <fence>` each),
    /// checks the store has not rewound ([`ShardRef::observe`]), and
    /// records each run as in flight here: (id, record, fence) per job.
    fn take_claimed<'a>(
        &self,
        s: &ShardRef,
        held: &mut Held,
        before: Marks,
        seq: u64,
        jobs: &'a [redis::Value],
    ) -> Result<Vec<(u64, JobRecord<'a>, u64)>, QueueError> {
        let bad = || self.protocol(s, "claim reply has a malformed job");
        let fences: Vec<u64> = jobs
            .chunks(3)
            .map(|j| j.get(2).and_then(reply::u64).unwrap_or(0))
            .collect();
        s.observe(before, seq, seq, &fences)?;
        let mut claimed = Vec::with_capacity(jobs.len() / 3);
        for j in jobs.chunks(3) {
            if j.len() != 3 {
                return Err(bad());
            }
            let id = reply::u64(&j[0]).ok_or_else(bad)?;
            let rec = reply::bytes(&j[1])
                .and_then(JobRecord::parse)
                .ok_or_else(bad)?;
            let fence = reply::u64(&j[2]).ok_or_else(bad)?;
            let run = Run {
                key: rec.key.clone(),
                attempt: rec.attempts.saturating_add(1),
            };
            held.in_flight.insert(id, run);
            claimed.push((id, rec, fence));
        }
        Ok(claimed)
    }

    /// Flow control's answer for each claimed run's start, asked at once
    /// (one call per group); every run starts now when no policy limits
    /// starts.
    fn admit_claimed(
        &self,
        s: &ShardRef,
        claimed: &[(u64, JobRecord<'_>, u64)],
        now: u64,
        lease_until_ms: u64,
    ) -> Vec<Admit> {
        let flow = (self.inner.opts.flow.as_deref()).filter(|f| {
            f.refresh(now);
            f.limits_starts()
        });
        let Some(flow) = flow else {
            return vec![Admit::Now; claimed.len()];
        };
        let runs: Vec<(&str, shardq_core::flow::RunStart<'_>)> = (claimed.iter())
            .map(|(_, rec, fence)| {
                let start = shardq_core::flow::RunStart {
                    shard: &s.name,
                    fence: *fence,
                    lease_until_ms,
                };
                (rec.key.as_str(), start)
            })
            .collect();
        flow.admit_many(&runs, now)
    }
}
