//! Moving keys on the Redis backend: [`MoveKeys`] for [`RedisBackend`].

use super::*;

impl MoveKeys for RedisBackend {
    fn overlaps_copies(&self) -> bool {
        true
    }

    fn dedup_export(&self, shard: &str, key: &str) -> Result<Vec<DedupRecord>, QueueError> {
        Ok(self
            .dedup_scan(shard, key)?
            .into_iter()
            .filter(|r| r.key == key)
            .collect())
    }

    fn dedup_export_many(
        &self,
        shard: &str,
        keys: &[&str],
    ) -> Result<Vec<DedupRecord>, QueueError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let want: BTreeSet<&str> = keys.iter().copied().collect();
        Ok(self
            .dedup_scan(shard, "")?
            .into_iter()
            .filter(|r| want.contains(r.key.as_str()))
            .collect())
    }

    fn dedup_import(&self, shard: &str, records: &[DedupRecord]) -> Result<(), QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        for rec in records {
            shardq_core::validate_key(&rec.key)?;
            shardq_core::job::validate_dedup_id(&rec.key, &rec.id)?;
        }
        // In calls of at most ENQUEUE_BATCH_MAX records, as an enqueue: a
        // mark of `dedupm` then names at most that many, which bounds what
        // an enqueue forgets.
        for part in records.chunks(ENQUEUE_BATCH_MAX) {
            let v = self.script(s, &self.inner.scripts.dedup_import, &token, &|c, _| {
                c.arg(part.len());
                for r in part {
                    let on = if r.shard == s.name {
                        ""
                    } else {
                        r.shard.as_str()
                    };
                    c.arg(dedup_field(&r.key, &r.id))
                        .arg(r.job.0)
                        .arg(r.expires_ms)
                        .arg(on);
                }
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "dedup import refused"));
            }
        }
        Ok(())
    }

    fn dedup_keys(&self, shard: &str) -> Result<Vec<String>, QueueError> {
        let keys: std::collections::BTreeSet<String> = self
            .dedup_scan(shard, "")?
            .into_iter()
            .map(|r| r.key)
            .collect();
        Ok(keys.into_iter().collect())
    }

    fn fence(&self, shard: &str) -> Result<Fence, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.fence_get, "", &|_, _| {})?;
        let it = reply::items(&v);
        Ok(Fence {
            map_version_min: it.first().and_then(reply::u64).unwrap_or(0),
            paused_keys: it
                .get(1)
                .map(reply::items)
                .unwrap_or(&[])
                .iter()
                .filter_map(reply::string)
                .collect::<BTreeSet<String>>(),
            run_fence_min: it.get(2).and_then(reply::u64).unwrap_or(0),
            sealed_keys: it
                .get(3)
                .map(reply::items)
                .unwrap_or(&[])
                .chunks(2)
                .filter_map(|p| Some((reply::string(p.first()?)?, reply::string(p.get(1)?)?)))
                .collect(),
        })
    }

    fn set_fence(&self, shard: &str, fence: &Fence) -> Result<(), QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        let keys: Vec<&String> = fence.paused_keys.iter().collect();
        self.script(s, &self.inner.scripts.fence_set, &token, &|c, _| {
            c.arg(fence.map_version_min)
                .arg(fence.run_fence_min)
                .arg(keys.len())
                .arg(&keys);
            for (key, to) in &fence.sealed_keys {
                c.arg(key).arg(to);
            }
        })?;
        Ok(())
    }

    fn enter_rebalance(&self, shard: &str, epoch: u64) -> Result<(), QueueError> {
        self.inner
            .epoch
            .fetch_max(epoch, std::sync::atomic::Ordering::SeqCst);
        let s = self.shard(shard)?;
        let token = self.move_token();
        self.script(&s, &self.inner.scripts.epoch_raise, &token, &|_, _| {})?;
        Ok(())
    }

    fn export_jobs(
        &self,
        shard: &str,
        key: &str,
        after: Option<JobId>,
        max: usize,
    ) -> Result<Vec<MovedJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut out: Vec<MovedJob> = Vec::new();
        let mut after = after.map_or(0, |a| a.0);
        // In calls of bounded size, until `max` is reached or a call says
        // the key has no more (a short call for the byte budget is not the
        // end).
        while out.len() < max {
            let want = (max - out.len()).min(TRANSFER_CALL_JOBS_MAX);
            let v = self.script(s, &self.inner.scripts.export, "", &|c, _| {
                c.arg(key).arg(after).arg(want).arg(TRANSFER_CALL_BYTES_MAX);
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "export refused"));
            }
            let more = reply::items(&v)
                .get(1)
                .and_then(reply::u64)
                .ok_or_else(|| self.protocol(s, "export reply is malformed"))?;
            let items = &reply::items(&v)[2..];
            for j in items.chunks(3) {
                let job = (j.len() == 3)
                    .then(|| moved_job(&j[0], &j[1], &j[2], key, after))
                    .flatten()
                    .ok_or_else(|| {
                        self.protocol(s, format!("export of key {key:?}: a malformed job"))
                    })?;
                after = job.id.0;
                out.push(job);
            }
            if more == 0 || items.is_empty() {
                break;
            }
        }
        Ok(out)
    }

    fn export_many(
        &self,
        shard: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<(String, Vec<MovedJob>)>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut out: Vec<(String, Vec<MovedJob>)> =
            items.iter().map(|(k, _)| (k.clone(), Vec::new())).collect();
        // Indexes into `out` of the keys that may have more, with cursors.
        let mut pending: Vec<(usize, u64)> = items
            .iter()
            .enumerate()
            .map(|(i, (_, a))| (i, a.map_or(0, |a| a.0)))
            .collect();
        while !pending.is_empty() {
            let call = &pending[..pending.len().min(EXPORT_MANY_KEYS_MAX)];
            let v = self.script(s, &self.inner.scripts.export_many, "", &|c, _| {
                c.arg(call.len())
                    .arg(TRANSFER_CALL_JOBS_MAX)
                    .arg(TRANSFER_CALL_BYTES_MAX);
                for (i, after) in call {
                    c.arg(&out[*i].0).arg(*after);
                }
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "export refused"));
            }
            let it = &reply::items(&v)[1..];
            let bad = || self.protocol(s, "export reply is malformed");
            let (mut at, mut done, mut answered) = (0usize, Vec::new(), 0usize);
            while at < it.len() {
                let (Some(key), Some(n), Some(more)) = (
                    it.get(at).and_then(reply::string),
                    it.get(at + 1).and_then(reply::u64),
                    it.get(at + 2).and_then(reply::u64),
                ) else {
                    return Err(bad());
                };
                let (slot, after) = call.get(answered).copied().ok_or_else(bad)?;
                if out[slot].0 != key {
                    return Err(bad());
                }
                let n = usize::try_from(n).map_err(|_| bad())?;
                let jobs = it.get(at + 3..at + 3 + 3 * n).ok_or_else(bad)?;
                let mut last = after;
                for j in jobs.chunks(3) {
                    let job = moved_job(&j[0], &j[1], &j[2], &key, last).ok_or_else(bad)?;
                    last = job.id.0;
                    out[slot].1.push(job);
                }
                done.push((answered, more == 0, last));
                answered += 1;
                at += 3 + 3 * n;
            }
            if answered == 0 {
                return Err(bad());
            }
            let mut next = Vec::new();
            for (pos, (slot, after)) in pending.iter().enumerate() {
                match done.iter().find(|d| d.0 == pos) {
                    Some((_, true, _)) => {}
                    Some((_, false, last)) => next.push((*slot, *last)),
                    None => next.push((*slot, *after)),
                }
            }
            pending = next;
        }
        Ok(out)
    }

    fn import_jobs(
        &self,
        shard: &str,
        from: &str,
        key: &str,
        jobs: &[MovedJob],
    ) -> Result<Vec<(JobId, JobId)>, QueueError> {
        shardq_core::backend::import_jobs_by_many(self, shard, from, key, jobs)
    }

    fn import_many(
        &self,
        shard: &str,
        from: &str,
        items: &[(String, Vec<MovedJob>)],
    ) -> Result<Vec<(String, JobId, JobId)>, QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        for (key, jobs) in items {
            shardq_core::validate_key(key)?;
            for d in jobs.iter().filter_map(|j| j.dedup_id.as_deref()) {
                shardq_core::job::validate_dedup_id(key, d)?;
            }
        }
        // Calls of at most TRANSFER_CALL_JOBS_MAX jobs and about
        // TRANSFER_CALL_BYTES_MAX bytes, each key's jobs in order: every
        // call is atomic and the cursors make a retried call a no-op.
        let mut calls: Vec<Vec<(&str, &[MovedJob])>> = vec![Vec::new()];
        let (mut jobs_in, mut bytes_in) = (0usize, 0usize);
        for (key, jobs) in items {
            let mut rest = &jobs[..];
            while !rest.is_empty() {
                let mut take = 0;
                while take < rest.len()
                    && jobs_in < TRANSFER_CALL_JOBS_MAX
                    && (bytes_in < TRANSFER_CALL_BYTES_MAX || (jobs_in == 0 && take == 0))
                {
                    bytes_in += rest[take].payload.len() + key.len();
                    jobs_in += 1;
                    take += 1;
                }
                if take > 0 {
                    calls
                        .last_mut()
                        .expect("one call at least")
                        .push((key.as_str(), &rest[..take]));
                    rest = &rest[take..];
                }
                if !rest.is_empty() {
                    calls.push(Vec::new());
                    (jobs_in, bytes_in) = (0, 0);
                }
            }
        }
        let mut out = Vec::new();
        for call in calls.iter().filter(|c| !c.is_empty()) {
            let v = self.script(s, &self.inner.scripts.import, &token, &|c, _| {
                c.arg(from).arg(call.len());
                for (key, jobs) in call {
                    c.arg(*key).arg(jobs.len());
                    for j in *jobs {
                        c.arg(j.id.0)
                            .arg(j.not_before_ms)
                            .arg(j.attempt)
                            .arg(j.max_attempts)
                            .arg(j.created_ms)
                            .arg(&j.payload[..])
                            .arg(j.dead.as_deref().map_or("", |r| {
                                if r.is_empty() {
                                    "dead"
                                } else {
                                    r
                                }
                            }))
                            .arg(j.dedup_id.as_deref().unwrap_or(""));
                    }
                }
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "import refused"));
            }
            for t in reply::items(&v)[1..].chunks(3) {
                let bad = || self.protocol(s, "import reply is malformed");
                let (Some(key), Some(src), Some(new)) = (
                    t.first().and_then(reply::string),
                    t.get(1).and_then(reply::u64),
                    t.get(2).and_then(reply::u64),
                ) else {
                    return Err(bad());
                };
                out.push((key, JobId(src), JobId(new)));
            }
        }
        Ok(out)
    }

    fn imported_up_to(
        &self,
        shard: &str,
        from: &str,
        key: &str,
    ) -> Result<Option<JobId>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.imported_up_to, "", &|c, _| {
            c.arg(from).arg(key);
        })?;
        let up_to = reply::items(&v)
            .get(1)
            .and_then(reply::u64)
            .ok_or_else(|| self.protocol(s, "import cursor reply is malformed"))?;
        Ok((up_to > 0).then_some(JobId(up_to)))
    }

    fn freeze_caught_up(
        &self,
        shard: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<String>, QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        let mut out = Vec::new();
        for call in items.chunks(EXPORT_MANY_KEYS_MAX) {
            let v = self.script(s, &self.inner.scripts.freeze, &token, &|c, _| {
                c.arg(call.len());
                for (key, after) in call {
                    c.arg(key).arg(after.map_or(0, |a| a.0));
                }
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "freeze refused"));
            }
            for k in &reply::items(&v)[1..] {
                out.push(
                    reply::string(k)
                        .ok_or_else(|| self.protocol(s, "freeze reply is malformed"))?,
                );
            }
        }
        Ok(out)
    }

    fn purge_key(&self, shard: &str, key: &str) -> Result<u64, QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        let mut total = 0u64;
        loop {
            let v = self.script(s, &self.inner.scripts.purge_key, &token, &|c, _| {
                c.arg(key).arg(PURGE_BATCH_MAX);
            })?;
            let it = reply::items(&v);
            let (Some(n), Some(more)) = (
                it.get(1).and_then(reply::u64),
                it.get(2).and_then(reply::u64),
            ) else {
                return Err(self.protocol(s, "purge reply is malformed"));
            };
            total += n;
            // Nothing deleted yet more reported: a dead count out of step
            // with the dead jobs; what could go is gone.
            if more == 0 || n == 0 {
                return Ok(total);
            }
        }
    }

    fn moved_away(&self, shard: &str, id: JobId) -> Result<Option<String>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.moved_away, "", &|c, _| {
            c.arg(id.0);
        })?;
        match (reply::status(&v).as_str(), reply::items(&v).get(1)) {
            ("NONE", _) => Ok(None),
            ("OK", Some(key)) => reply::string(key)
                .map(Some)
                .ok_or_else(|| self.protocol(s, "moved-away reply is malformed")),
            _ => Err(self.protocol(s, "moved-away reply is malformed")),
        }
    }

    fn imported_as(
        &self,
        shard: &str,
        from: &str,
        source_id: JobId,
    ) -> Result<Option<JobId>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.imported_as, "", &|c, _| {
            c.arg(from).arg(source_id.0);
        })?;
        match (reply::status(&v).as_str(), reply::items(&v).get(1)) {
            ("NONE", _) => Ok(None),
            ("OK", Some(id)) => reply::string(id)
                .and_then(|t| t.parse().ok())
                .map(|id| Some(JobId(id)))
                .ok_or_else(|| self.protocol(s, "imported-as reply is malformed")),
            _ => Err(self.protocol(s, "imported-as reply is malformed")),
        }
    }
}
