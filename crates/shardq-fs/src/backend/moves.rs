//! Moving keys on the embedded engine: [`MoveKeys`] for [`FsBackend`].

use super::*;

impl MoveKeys for FsBackend {
    fn dedup_export(&self, name: &str, key: &str) -> Result<Vec<DedupRecord>, QueueError> {
        let shard = self.shard(name)?;
        let now = self.opts.clock.now_ms();
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let r = inner.replica.as_ref().expect("refreshed");
        Ok(r.dedup_records(Some(key), now)
            .into_iter()
            .map(|(k, id, e)| DedupRecord {
                key: k.to_string(),
                id: id.to_string(),
                shard: e.shard.as_deref().unwrap_or(name).to_string(),
                job: JobId(e.job),
                expires_ms: e.expires_ms,
            })
            .collect())
    }

    fn dedup_import(&self, name: &str, records: &[DedupRecord]) -> Result<(), QueueError> {
        for rec in records {
            shardq_core::validate_key(&rec.key)?;
            shardq_core::job::validate_dedup_id(&rec.key, &rec.id)?;
            validate_shard_name(&rec.shard).map_err(|e| QueueError::InvalidOption {
                name: "dedup record shard",
                value: format!("{:?} (key {:?})", rec.shard, rec.key),
                allowed: e,
            })?;
        }
        let shard = self.shard(name)?;
        let now = self.opts.clock.now_ms();
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let (_, end) = self.append_with(&shard, &mut inner, &mut |inner, _start| {
            let r = inner.replica.as_ref().expect("refreshed");
            let mut bytes = Vec::new();
            let mut seen = std::collections::HashSet::new();
            for rec in records {
                // Judged under the append lock: a live record here is kept.
                if rec.expires_ms <= now
                    || r.dedup_lookup(&rec.key, &rec.id, now).is_some()
                    || !seen.insert((rec.key.as_str(), rec.id.as_str()))
                {
                    continue;
                }
                record::encode(
                    &mut bytes,
                    &Record::Dedup {
                        job: rec.job.0,
                        expires_ms: rec.expires_ms,
                        key: &rec.key,
                        id: &rec.id,
                        shard: if rec.shard == name { "" } else { &rec.shard },
                    },
                );
            }
            Ok(bytes)
        })?;
        drop(inner);
        self.after_append(&shard, end)
    }

    fn dedup_keys(&self, name: &str) -> Result<Vec<String>, QueueError> {
        let shard = self.shard(name)?;
        let now = self.opts.clock.now_ms();
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let r = inner.replica.as_ref().expect("refreshed");
        let keys: std::collections::BTreeSet<String> = r
            .dedup_records(None, now)
            .into_iter()
            .map(|(k, _, _)| k.to_string())
            .collect();
        Ok(keys.into_iter().collect())
    }

    fn fence(&self, name: &str) -> Result<Fence, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.read_fence(&shard, &mut inner)
    }

    fn set_fence(&self, name: &str, fence: &Fence) -> Result<(), QueueError> {
        let shard = self.shard(name)?;
        let inner = lock(&shard.inner);
        // Written under the append lock: no enqueue is between its fence
        // check and its append while the fence changes.
        let _guard = inner.log.lock()?;
        self.write_fence_locked(&shard, fence)
    }

    fn export_jobs(
        &self,
        name: &str,
        key: &str,
        after: Option<JobId>,
        max: usize,
    ) -> Result<Vec<MovedJob>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let picked: Vec<(crate::state::Slot, Option<String>)> = inner
            .replica
            .as_ref()
            .expect("refreshed")
            .key_jobs(key, after.map(|a| a.0), max)
            .into_iter()
            .map(|(s, reason)| (s, reason.map(str::to_string)))
            .collect();
        let replica = inner.replica.as_ref().expect("refreshed");
        // Debounced jobs whose payload is a later record's: (index in
        // `picked`, the record's position), in `picked` order; most keys
        // have none, and then nothing is kept per job.
        let payload_ats: Vec<(usize, u64)> = picked
            .iter()
            .enumerate()
            .filter_map(|(i, (slot, _))| Some((i, replica.payload_at(slot.id)?)))
            .collect();
        let places = picked
            .iter()
            .map(|(slot, _)| inner.log.locate(slot.id))
            .collect::<Result<Vec<_>, _>>()?;
        let payload_places = payload_ats
            .iter()
            .map(|&(i, at)| inner.log.locate(at).map(|p| (i, at, p)))
            .collect::<Result<Vec<_>, _>>()?;
        // The payloads are read without the shard's lock, so enqueues and
        // claims go on meanwhile: a sealed key's records stay where they
        // are (none of its jobs finishes while it is sealed, so no
        // compaction drops them, and the handles outlive a deleted file).
        drop(inner);
        let mut out = Vec::with_capacity(picked.len());
        let mut payloads = payload_places.into_iter().peekable();
        for (i, ((slot, dead), at)) in picked.into_iter().zip(places).enumerate() {
            let mut r = job_of_record(name, &at.read()?, slot.id, key)?;
            if let Some((_, pos, place)) = payloads.next_if(|&(at, _, _)| at == i) {
                r.payload = debounced_payload(name, &place.read()?, pos, slot.id)?;
            }
            out.push(MovedJob {
                id: JobId(slot.id),
                created_ms: r.created_ms,
                not_before_ms: slot.not_before_ms,
                attempt: slot.attempt,
                max_attempts: slot.max_attempts,
                payload: r.payload,
                dead,
                dedup_id: r.dedup_id,
            });
        }
        Ok(out)
    }

    fn import_jobs(
        &self,
        name: &str,
        from: &str,
        key: &str,
        jobs: &[MovedJob],
    ) -> Result<Vec<(JobId, JobId)>, QueueError> {
        shardq_core::backend::import_jobs_by_many(self, name, from, key, jobs)
    }

    fn import_many(
        &self,
        name: &str,
        from: &str,
        items: &[(String, Vec<MovedJob>)],
    ) -> Result<Vec<(String, JobId, JobId)>, QueueError> {
        validate_shard_name(from).map_err(|reason| QueueError::InvalidOption {
            name: "source shard",
            value: format!("{from:?}"),
            allowed: reason,
        })?;
        for (key, jobs) in items {
            shardq_core::validate_key(key)?;
            for j in jobs {
                if j.payload.len() > PAYLOAD_BYTES_LIMIT {
                    return Err(QueueError::PayloadTooLarge {
                        key: key.to_string(),
                        bytes: j.payload.len(),
                        max: PAYLOAD_BYTES_LIMIT,
                    });
                }
                if let Some(d) = &j.dedup_id {
                    shardq_core::job::validate_dedup_id(key, d)?;
                }
            }
        }
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let transfers = self.read_transfers(&shard.dir)?;
        let on_file = |key: &str| {
            transfers
                .iter()
                .find(|t| t.from == from && t.key == key)
                .map(|t| t.up_to)
        };
        let cursors: Vec<Option<u64>> = items.iter().map(|(k, _)| on_file(k)).collect();
        // Every job to store, in order: (item, job).
        let all: Vec<(usize, &MovedJob)> = items
            .iter()
            .enumerate()
            .flat_map(|(i, (_, jobs))| jobs.iter().map(move |j| (i, j)))
            .collect();
        let mut out: Vec<(String, JobId, JobId)> = Vec::new();
        // One append per slice of at most ENQUEUE_BATCH_BYTES_MAX.
        let mut rest = &all[..];
        while !rest.is_empty() {
            let mut taken = 0usize;
            let mut size = 0usize;
            while taken < rest.len()
                && (taken == 0
                    || size + rest[taken].1.payload.len() + 256 <= ENQUEUE_BATCH_BYTES_MAX)
            {
                size += rest[taken].1.payload.len() + 256;
                taken += 1;
            }
            let (slice, tail) = rest.split_at(taken);
            rest = tail;
            let mut stored: Vec<(String, JobId, JobId)> = Vec::new();
            let mut build = |inner: &mut Inner, start: u64| {
                let r = inner.replica.as_ref().expect("refreshed");
                stored.clear();
                let mut bytes = Vec::new();
                // An item's jobs are adjacent: its cursor is looked up once
                // (the replica does not change while this runs).
                let mut last: Option<(usize, Option<u64>)> = None;
                for &(i, j) in slice {
                    let key = items[i].0.as_str();
                    let cursor = match last {
                        Some((at, cursor)) if at == i => cursor,
                        _ => {
                            let cursor = r.imported_up_to(from, key).max(cursors[i]);
                            last = Some((i, cursor));
                            cursor
                        }
                    };
                    if cursor.is_some_and(|c| j.id.0 <= c) {
                        continue;
                    }
                    let pos = start + bytes.len() as u64;
                    record::encode(
                        &mut bytes,
                        &Record::Import {
                            source_id: j.id.0,
                            created_ms: j.created_ms,
                            not_before_ms: j.not_before_ms,
                            attempt: j.attempt,
                            max_attempts: j.max_attempts,
                            dead: j.dead.is_some(),
                            from,
                            key,
                            reason: cut_reason(j.dead.as_deref().unwrap_or("")),
                            dedup_id: j.dedup_id.as_deref().unwrap_or(""),
                            payload: &j.payload,
                        },
                    );
                    stored.push((key.to_string(), j.id, JobId(pos)));
                }
                Ok(bytes)
            };
            self.append_records(&shard, &mut inner, &mut build, false)?;
            // Each chunk's copies are noted as soon as they are written, so
            // a move killed between chunks loses no earlier chunk's ids.
            self.note_moved_in(
                &shard,
                MovedInLine {
                    from: from.to_string(),
                    pairs: stored.iter().map(|(_, src, new)| (src.0, new.0)).collect(),
                },
            )?;
            out.extend(stored);
        }
        // Written, not yet synced: a move makes a whole backlog's copies
        // durable at once ([`MoveKeys::sync_imports`]) before it deletes
        // the sources, instead of an fsync per chunk, which every fsync of
        // the shards' producers would queue behind. Their cursors are in the
        // Import records; compaction saves them to the transfers file before
        // it deletes a segment holding any.
        Ok(out)
    }

    fn sync_imports(&self, name: &str) -> Result<(), QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        // Whoever appended them (this process, or one a rerun replaces): a
        // sealed segment was synced by its roller, or by the writer that
        // went on past a roller that died, so syncing the current one makes
        // every copy durable.
        self.refresh(&mut inner)?;
        inner.log.sync_current()?;
        // The copies' ids, before the old shard forgets the jobs.
        let path = shard.dir.join(MOVED_IN_FILE);
        let io = |e| QueueError::io(format!("syncing {}", path.display()), e);
        match self.opts.storage.open(&path, false) {
            Ok(file) => file.sync().map_err(io),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(e)),
        }
    }

    fn imported_up_to(
        &self,
        name: &str,
        from: &str,
        key: &str,
    ) -> Result<Option<JobId>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let replayed = inner
            .replica
            .as_ref()
            .expect("refreshed")
            .imported_up_to(from, key);
        let on_file = self
            .read_transfers(&shard.dir)?
            .into_iter()
            .find(|t| t.from == from && t.key == key)
            .map(|t| t.up_to);
        Ok(replayed.max(on_file).map(JobId))
    }

    fn moved_away(&self, name: &str, id: JobId) -> Result<Option<String>, QueueError> {
        let shard = self.shard(name)?;
        let moved = self.cached_history(&shard, MOVED_FILE, &shard.moved, || {
            let mut m = MovedAway::default();
            for line in self.read_moved(&shard)? {
                m.note(&line.key, line.ids);
            }
            Ok(m)
        })?;
        Ok(moved.and_then(|m| m.key_of(id.0).map(str::to_string)))
    }

    fn imported_as(
        &self,
        name: &str,
        from: &str,
        source_id: JobId,
    ) -> Result<Option<JobId>, QueueError> {
        let shard = self.shard(name)?;
        let moved_in = self.cached_history(&shard, MOVED_IN_FILE, &shard.moved_in, || {
            let mut m = shardq_core::MovedIn::default();
            for line in self.read_moved_in(&shard)? {
                m.note(&line.from, line.pairs);
            }
            Ok(m)
        })?;
        Ok(moved_in.and_then(|m| m.new_id_of(from, source_id.0).map(JobId)))
    }

    fn freeze_caught_up(
        &self,
        name: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<String>, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        let mut out = Vec::new();
        // Checked and written under the append lock, with the replica caught
        // up to the log's end: no enqueue lands between the two.
        self.append_with(&shard, &mut inner, &mut |inner, _| {
            let mut fence = self.read_fence(&shard, inner)?;
            let r = inner.replica.as_ref().expect("refreshed");
            out.clear();
            for (key, after) in items {
                if fence.sealed_keys.contains_key(key)
                    && r.key_jobs(key, after.map(|a| a.0), 1).is_empty()
                {
                    fence.paused_keys.insert(key.clone());
                    out.push(key.clone());
                }
            }
            if !out.is_empty() {
                self.write_fence_locked(&shard, &fence)?;
            }
            Ok(Vec::new())
        })?;
        Ok(out)
    }

    fn purge_key(&self, name: &str, key: &str) -> Result<u64, QueueError> {
        let shard = self.shard(name)?;
        let mut inner = lock(&shard.inner);
        self.refresh(&mut inner)?;
        // The ids it deletes are remembered first (a purge that then fails
        // leaves ids that are still live, which a lookup finds live first).
        let ids: Vec<u64> = inner
            .replica
            .as_ref()
            .expect("refreshed")
            .key_jobs(key, None, usize::MAX)
            .iter()
            .map(|(slot, _)| slot.id)
            .collect();
        if !ids.is_empty() {
            self.note_moved(
                &shard,
                MovedLine {
                    key: key.to_string(),
                    ids,
                },
            )?;
        }
        let mut count = 0u64;
        let (_, end) = self.append_with(&shard, &mut inner, &mut |inner, _| {
            let c = inner.replica.as_ref().expect("refreshed").key_counts(key);
            count = c.depth + c.dead;
            let mut bytes = Vec::new();
            if count > 0 {
                record::encode(&mut bytes, &Record::PurgeKey { key });
            }
            Ok(bytes)
        })?;
        if count > 0 {
            self.compact(&mut inner)?;
        }
        drop(inner);
        self.sync_to(&shard, end)?;
        Ok(count)
    }
}
