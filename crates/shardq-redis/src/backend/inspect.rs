//! Operators' reads and actions on the Redis backend: [`InspectJobs`] for [`RedisBackend`].

use super::*;

impl InspectJobs for RedisBackend {
    fn key_counts(&self, shard: &str, key: &str) -> Result<KeyCounts, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.key_counts, "", &|c, _| {
            c.arg(key);
        })?;
        let it = reply::items(&v);
        let n = |i: usize| it.get(i).and_then(reply::u64).unwrap_or(0);
        Ok(KeyCounts {
            depth: n(0),
            in_flight: n(1),
            dead: n(2),
        })
    }

    fn shard_stats(&self, shard: &str) -> Result<ShardStats, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.stats, "", &|_, _| {})?;
        let it = reply::items(&v);
        let n = |i: usize| it.get(i).and_then(reply::u64).unwrap_or(0);
        Ok(ShardStats {
            name: s.name.clone(),
            ready: n(0),
            delayed: n(1),
            in_flight: n(2),
            dead: n(3),
            keys: n(4),
            fence_high: n(5),
        })
    }

    fn finished(
        &self,
        shard: &str,
        key: Option<&str>,
        max: usize,
    ) -> Result<Vec<FinishedJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let keep = self.inner.opts.retention;
        if keep.finished_jobs == 0 || max == 0 {
            return Ok(Vec::new());
        }
        // In pages, newest first, until `max` match, the retention's count
        // is read, or an entry is past its age (entries are in finish
        // order); an entry that does not parse is skipped.
        let mut out = Vec::new();
        let mut first = 0usize;
        while first < keep.finished_jobs && out.len() < max {
            let last = (first + FINISHED_PAGE).min(keep.finished_jobs) - 1;
            let v = self.script(s, &self.inner.scripts.finished, "", &|c, _| {
                c.arg(first).arg(last);
            })?;
            let items = reply::items(&v);
            let now = (items.first().and_then(reply::u64))
                .ok_or_else(|| self.protocol(s, "finished-jobs reply is malformed"))?;
            let entries = &items[1..];
            for f in entries.iter().filter_map(|e| parse_done(reply::bytes(e)?)) {
                if !keep.keeps(f.finished_ms, now) {
                    return Ok(out);
                }
                if key.is_none_or(|k| f.key == k) {
                    out.push(f);
                    if out.len() == max {
                        return Ok(out);
                    }
                }
            }
            if entries.len() < last - first + 1 {
                break;
            }
            first = last + 1;
        }
        Ok(out)
    }

    fn dead_list(&self, shard: &str, limit: usize) -> Result<Vec<DeadJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let limit = limit.min(DEAD_LIST_MAX);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let v = self.script(s, &self.inner.scripts.dead_list, "", &|c, _| {
            c.arg(limit);
        })?;
        let mut out = Vec::new();
        for d in reply::items(&v).chunks(5) {
            let bad = || self.protocol(s, "dead list reply is malformed");
            if d.len() != 5 {
                return Err(bad());
            }
            out.push(DeadJob {
                shard: s.name.clone(),
                id: JobId(reply::u64(&d[0]).ok_or_else(bad)?),
                attempts: reply::u64(&d[1]).ok_or_else(bad)? as u32,
                key: reply::string(&d[2]).ok_or_else(bad)?,
                reason: reply::string(&d[3]).unwrap_or_default(),
                attempt_starts_ms: parse_starts(&d[4]).ok_or_else(bad)?,
            });
        }
        Ok(out)
    }

    fn dead_retry(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.dead_move(shard, "retry", ids)
    }

    fn dead_purge(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.dead_move(shard, "purge", ids)
    }

    fn job(&self, shard: &str, id: JobId) -> Result<Option<JobInfo>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.job_show, "", &|c, _| {
            c.arg(id.0);
        })?;
        let items = reply::items(&v);
        if reply::status(&v) == "NONE" {
            return Ok(None);
        }
        job_info(id, items)
            .map(Some)
            .ok_or_else(|| self.protocol(s, format!("job {} reply is malformed", id.0)))
    }

    fn key_jobs(&self, shard: &str, key: &str, max: usize) -> Result<Vec<JobInfo>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let max = max.min(KEY_JOBS_MAX);
        if max == 0 {
            return Ok(Vec::new());
        }
        let v = self.script(s, &self.inner.scripts.key_jobs, "", &|c, _| {
            c.arg(key).arg(max).arg(TRANSFER_CALL_BYTES_MAX);
        })?;
        if reply::status(&v) != "OK" {
            return Err(self.protocol(s, "key jobs refused"));
        }
        let mut out = Vec::new();
        for row in reply::items(&v)[1..].chunks(7) {
            let job = (row.len() == 7)
                .then(|| reply::u64(&row[0]).and_then(|id| job_info(JobId(id), &row[1..])))
                .flatten()
                .filter(|j| j.key == key)
                .ok_or_else(|| self.protocol(s, format!("jobs of key {key:?}: a malformed job")))?;
            out.push(job);
        }
        out.sort_by_key(|j| j.id);
        out.truncate(max);
        Ok(out)
    }

    fn key_hold(&self, shard: &str, key: &str) -> Result<Option<shardq_core::KeyHold>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.key_hold, "", &|c, _| {
            c.arg(key).arg(shardq_core::KEY_HOLD_SCAN_JOBS);
        })?;
        match reply::status(&v).as_str() {
            "OK" => self.parse_hold(s, &v),
            other => Err(self.protocol(s, format!("key hold answered {other:?}"))),
        }
    }

    fn resume_key(&self, shard: &str, key: &str) -> Result<shardq_core::KeyResume, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.key_resume, "", &|c, _| {
            c.arg(key).arg(shardq_core::KEY_HOLD_SCAN_JOBS);
        })?;
        match reply::status(&v).as_str() {
            "OK" => Ok(match self.parse_hold(s, &v)? {
                Some(hold) => shardq_core::KeyResume::Resumed(hold),
                None => shardq_core::KeyResume::NotHeld,
            }),
            "MOVING" => Ok(shardq_core::KeyResume::Moving),
            other => Err(self.protocol(s, format!("key resume answered {other:?}"))),
        }
    }

    fn cancel(&self, shard: &str, id: JobId) -> Result<CancelOutcome, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.cancel, "", &|c, _| {
            c.arg(id.0).arg(CANCEL_WALK_MAX);
        })?;
        match reply::status(&v).as_str() {
            "CANCELLED" => Ok(CancelOutcome::Cancelled),
            "RUNNING" => Ok(CancelOutcome::Running),
            "STOPPING" => Ok(CancelOutcome::Stopping),
            "MOVING" => Ok(CancelOutcome::Moving),
            "NOTFOUND" => Ok(CancelOutcome::NotFound),
            "TOOFAR" => Err(QueueError::InvalidOption {
                name: "job to cancel",
                value: format!("{}:{}", s.name, id.0),
                allowed: format!(
                    "a job at most {CANCEL_WALK_MAX} places behind its key's head on Redis \
                     (cancel the jobs ahead of it first, or wait for them to run)"
                ),
            }),
            other => Err(self.protocol(s, format!("cancel answered {other:?}"))),
        }
    }
}
