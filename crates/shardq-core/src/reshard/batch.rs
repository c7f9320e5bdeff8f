//! One batch of phase 2 (`move_batch`): seal, copy rounds, the last round and
//! the freeze, the switch; and the fence and seal writes the moves share.

use super::*;

/// `cur` at the next version with `batch`'s keys following `target`: its
/// pin where it has one, the computed owner otherwise.
pub(super) fn switched_map(cur: &ShardMap, target: &ShardMap, batch: &[Switch]) -> ShardMap {
    let mut next = cur.clone();
    next.version = cur.version + 1;
    for (key, _, _) in batch {
        match target.overrides.get(key) {
            Some(shard) => next.overrides.insert(key.clone(), shard.clone()),
            None => next.overrides.remove(key),
        };
    }
    next
}

/// (key, source id) -> id on the new shard, of the copies a run made. By
/// key, then id: a chunk's copies are noted under their key found once,
/// where a map keyed by (key, id) cloned the key and compared keys at every
/// step of every copy's insert (a quarter of the instructions of a
/// million-job move).
#[derive(Debug, Default)]
pub(super) struct CopiedIds(BTreeMap<String, BTreeMap<JobId, JobId>>);

impl CopiedIds {
    /// `key`'s copies, to note more in.
    pub(super) fn of_key(&mut self, key: &str) -> &mut BTreeMap<JobId, JobId> {
        if !self.0.contains_key(key) {
            self.0.insert(key.to_string(), BTreeMap::new());
        }
        self.0.get_mut(key).expect("inserted")
    }

    /// The id of the copy of `key`'s job `src`, if this run made one.
    pub(super) fn get(&self, key: &str, src: JobId) -> Option<JobId> {
        self.0.get(key)?.get(&src).copied()
    }
}

/// A key's move: the key, its old shard and its new one.
pub(super) type Switch = (String, String, String);

/// What [`move_batch`] did with a batch.
pub(super) struct BatchMoved {
    /// Keys with a run in flight on their old shard: left sealed, for the
    /// caller to move once their runs end.
    pub(super) busy: Vec<Switch>,
    /// The published map, each forced key's producer pause (keys frozen
    /// without one are not listed), and the keys switched.
    pub(super) switched: Option<(ShardMap, BTreeMap<String, u64>, Vec<Switch>)>,
}

/// Steps 1 to 5 of a batch: seal, wait for runs, raise floors, copy rounds,
/// the last round under a pause and the switch. Every step can be run again
/// after an error (a rerun does): sealing a sealed key changes nothing, the
/// copies skip what the new shard holds, and nothing is published until the
/// last round is complete. An error leaves the batch sealed and paused; the
/// caller lifts what it must. After the publish the caller lifts the pause.
#[allow(clippy::too_many_arguments)]
pub(super) fn move_batch<B>(
    backend: &B,
    store: &dyn MapStore,
    cur: &ShardMap,
    target: &ShardMap,
    batch: &[(String, String, String)],
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
    copied: &mut BTreeMap<String, u64>,
    touched: &mut BTreeSet<String>,
    ids: &mut CopiedIds,
) -> Result<BatchMoved, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    let clock = &*options.clock;
    // 1. Seal: no run of these keys starts on their old shards from now.
    set_sealed(backend, batch, true)?;
    on_event(RebalanceEvent::Moving { keys: batch.len() });
    // 2. A key with a run in flight on its old shard goes back to the
    //    caller, sealed, to wait for it (bounded there: a stopped worker's
    //    run ends when its job lease lapses); the others go on at once.
    let mut busy = Vec::new();
    let mut idle = Vec::with_capacity(batch.len());
    for sw in batch {
        if backend.key_counts(&sw.1, &sw.0)?.in_flight > 0 {
            busy.push(sw.clone());
        } else {
            idle.push(sw.clone());
        }
    }
    let mut out = BatchMoved {
        busy,
        switched: None,
    };
    if idle.is_empty() {
        return Ok(out);
    }
    let batch = &idle[..];
    // 3. The new shards' next runs of these keys get larger fences than
    //    every run on the old ones (which are over, and sealed).
    raise_fence_floors(backend, batch)?;
    // 4. Copy rounds while producers still write to the old shards, the
    //    exports running ahead of the imports.
    let mut cursors: Cursors = BTreeMap::new();
    copy_rounds(backend, batch, &mut cursors, ids, copied, touched)?;
    // 5. Freeze each key on its old shard once its new shard holds all of
    //    it: a last round copies what arrived since the rounds (and the
    //    key's dedup records), then one atomic step on the old shard checks
    //    that nothing arrived since and freezes the key there, so its next
    //    enqueues go to the new shard at once ([`QueueError::Moved`]). No
    //    producer waits. A key that got jobs between every last round and
    //    its freeze (a hot one) is paused on its new shard instead, frozen
    //    unconditionally, copied once more and un-paused: its producers
    //    wait for that one round only.
    let pause_ms = freeze_rounds(backend, clock, batch, &mut cursors, ids, copied, touched)?;
    // A pause on a new shard that a killed forced round left goes: every
    // key of the batch is frozen on its old shard and copied in full now.
    lift_new_pauses(backend, batch)?;
    let mut next = switched_map(cur, target, batch);
    // A key pinned to where its backlog went, if the target differs
    // (a transfer a killed run left): it stays there for now.
    let next_router = Router::new(next.clone())?;
    for (key, _, to) in batch {
        if next_router.route(key) != to.as_str() {
            next.overrides.insert(key.clone(), to.clone());
        }
    }
    publish_next(store, cur, &next)?;
    out.switched = Some((next, pause_ms, batch.to_vec()));
    Ok(out)
}

/// Step 5 of a batch ([`move_batch`]): last rounds, each followed by a try
/// to freeze the keys caught up on their old shards, until all are frozen;
/// after [`FREEZE_ATTEMPTS_MAX`] tries the keys left are paused on their new
/// shards for one forced round. Returns each forced key's producer pause
/// in ms.
fn freeze_rounds<B: QueueBackend + ?Sized>(
    backend: &B,
    clock: &dyn Clock,
    batch: &[Switch],
    cursors: &mut Cursors,
    ids: &mut CopiedIds,
    copied: &mut BTreeMap<String, u64>,
    touched: &mut BTreeSet<String>,
) -> Result<BTreeMap<String, u64>, ReshardError> {
    let mut left: Vec<Switch> = batch.to_vec();
    let mut pause_ms: BTreeMap<String, u64> = BTreeMap::new();
    for attempt in 0..=FREEZE_ATTEMPTS_MAX {
        if left.is_empty() {
            break;
        }
        let forced = attempt == FREEZE_ATTEMPTS_MAX;
        let pause_started_ms = clock.now_ms();
        if forced {
            set_paused_new(backend, &left, true)?;
            update_old_fences(backend, &left, &mut |fence, key, _| {
                fence.paused_keys.insert(key.to_string());
            })?;
        }
        let fresh = last_round(backend, &left, cursors, ids, copied, touched)?;
        // Dedup records come into being with their jobs: a key that got no
        // job since the last copy of its records has no new one.
        let dedup_keys: Vec<Switch> = left
            .iter()
            .filter(|sw| attempt == 0 || fresh.contains(&sw.0))
            .cloned()
            .collect();
        copy_dedup_many(backend, &dedup_keys, ids, cursors)?;
        // The copies durable before the freeze (or a forced key's unpause)
        // sends producers to the new shard: after a power loss there, new
        // jobs on it must never come before copies it lost.
        let news: BTreeSet<&str> = left.iter().map(|sw| sw.2.as_str()).collect();
        for to in news {
            backend.sync_imports(to)?;
        }
        if forced {
            set_paused_new(backend, &left, false)?;
            let waited = clock.now_ms().saturating_sub(pause_started_ms);
            for sw in &left {
                pause_ms.insert(sw.0.clone(), waited);
            }
            break;
        }
        let mut by_old: BTreeMap<&str, Vec<(String, Option<JobId>)>> = BTreeMap::new();
        for (key, from, _) in &left {
            let after = cursors.get(key).copied().flatten().flatten();
            by_old
                .entry(from.as_str())
                .or_default()
                .push((key.clone(), after));
        }
        let mut frozen: BTreeSet<String> = BTreeSet::new();
        for (from, items) in by_old {
            frozen.extend(backend.freeze_caught_up(from, &items)?);
        }
        left.retain(|sw| !frozen.contains(&sw.0));
    }
    Ok(pause_ms)
}

/// A key and jobs of it, as one import takes them.
pub(super) type KeyJobs = (String, Vec<MovedJob>);

/// A key's cursor on its old shard as a move keeps it: `None` until read,
/// then the largest id its new shard holds a copy of (`None` inside: none).
pub(super) type Cursors = BTreeMap<String, Option<Option<JobId>>>;

/// One copy of what arrived since the cursors, for all of `batch`: one
/// export per old shard and one import per (old, new) pair, as few calls as
/// the backend can. Moves the cursors on; returns the keys that had jobs.
pub(super) fn last_round<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    cursors: &mut Cursors,
    ids: &mut CopiedIds,
    copied: &mut BTreeMap<String, u64>,
    touched: &mut BTreeSet<String>,
) -> Result<BTreeSet<String>, ReshardError> {
    let mut groups: BTreeMap<(&str, &str), Vec<KeyJobs>> = BTreeMap::new();
    let mut reads: BTreeMap<&str, Vec<(String, Option<JobId>)>> = BTreeMap::new();
    let mut dests: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, from, to) in batch {
        let after = match cursors.get(key).copied().flatten() {
            Some(after) => after,
            None => backend.imported_up_to(to, from, key)?,
        };
        cursors.insert(key.clone(), Some(after));
        reads
            .entry(from.as_str())
            .or_default()
            .push((key.clone(), after));
        dests.insert(key.as_str(), to.as_str());
    }
    let mut fresh = BTreeSet::new();
    for (&from, items) in &reads {
        for (key, jobs) in backend.export_many(from, items)? {
            let Some(&to) = dests.get(key.as_str()) else {
                continue;
            };
            if let Some(last) = jobs.last() {
                cursors.insert(key.clone(), Some(Some(last.id)));
                fresh.insert(key.clone());
                groups.entry((from, to)).or_default().push((key, jobs));
            }
        }
    }
    for ((from, to), items) in groups {
        touched.extend(items.iter().map(|(k, _)| k.clone()));
        for (key, src, new) in backend.import_many(to, from, &items)? {
            ids.of_key(&key).insert(src, new);
            *copied.entry(key).or_default() += 1;
        }
    }
    Ok(fresh)
}

/// Copies the live dedup records of `batch`'s keys from their old shards to
/// their new ones (one export per old shard); a record of a job this run
/// copied answers with the copy's id.
pub(super) fn copy_dedup_many<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    ids: &CopiedIds,
    cursors: &Cursors,
) -> Result<(), ReshardError> {
    let mut keys_of: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut dests: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, from, to) in batch {
        keys_of.entry(from.as_str()).or_default().push(key.as_str());
        dests.insert(key.as_str(), to.as_str());
    }
    let mut records_to: BTreeMap<&str, Vec<DedupRecord>> = BTreeMap::new();
    for (from, keys) in keys_of {
        for mut r in backend.dedup_export_many(from, &keys)? {
            let Some(&to) = dests.get(r.key.as_str()) else {
                continue;
            };
            if r.shard == from {
                if let Some(id) = ids.get(&r.key, r.job) {
                    r.shard = to.to_string();
                    r.job = id;
                } else if cursors
                    .get(r.key.as_str())
                    .copied()
                    .flatten()
                    .flatten()
                    .is_none_or(|c| r.job > c)
                    && backend.job(from, r.job)?.is_some()
                {
                    // Its job came after the last copy and is still here:
                    // the next round copies it, and the record with it (an
                    // import keeps the first record it gets, so one sent
                    // now would name the old shard's id for good).
                    continue;
                }
            }
            records_to.entry(to).or_default().push(r);
        }
    }
    for (to, records) in records_to {
        backend.dedup_import(to, &records)?;
    }
    Ok(())
}

/// Pauses or resumes `batch`'s keys on their *new* shards (a forced freeze:
/// the producers sent there wait while the last jobs are copied).
pub(super) fn set_paused_new<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    pause: bool,
) -> Result<(), ReshardError> {
    let mut by_new: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (key, _, to) in batch {
        by_new.entry(to.as_str()).or_default().push(key.as_str());
    }
    for (shard, keys) in by_new {
        let mut fence = backend.fence(shard)?;
        let before = fence.paused_keys.len();
        for key in keys {
            if pause {
                fence.paused_keys.insert(key.to_string());
            } else if !fence.sealed_keys.contains_key(key) {
                fence.paused_keys.remove(key);
            }
        }
        if fence.paused_keys.len() != before {
            backend.set_fence(shard, &fence)?;
        }
    }
    Ok(())
}

/// Lifts what [`set_paused_new`] left on the new shards of `batch` (a
/// killed forced round): one read per new shard, a write only if needed.
pub(super) fn lift_new_pauses<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
) -> Result<(), ReshardError> {
    set_paused_new(backend, batch, false)
}

/// What the export side of [`copy_rounds`] hands its import side, in order.
enum Exported {
    /// A chunk of the jobs of the batch's `.0`th key, in key order.
    Chunk(usize, Vec<MovedJob>),
    /// The rounds of the batch's `.0`th key are over: the largest id
    /// exported (`None`: none, nor any copy before), the key's cursor once
    /// every chunk before this message is imported.
    Done(usize, Option<JobId>),
}

/// Step 4 of a batch: each key's copy rounds (up to [`TRANSFER_ROUNDS_MAX`]
/// rounds of [`TRANSFER_CHUNK_JOBS`]-job chunks; a round ends at a short
/// chunk, the rounds at a short round), the keys one after the other. The
/// exports run on a thread of their own, at most [`COPY_AHEAD_CHUNKS`]
/// chunks ahead of the imports on this one, so the old shard reads the next
/// chunk while the new shard stores this one (on Redis, two servers at
/// work at once instead of in turn). Nothing else changes: the imports go
/// in the exports' order (a key's chunks in key order, each call as
/// [`copy_backlog`] would make it), a key is in `touched` before its first
/// import is sent, and its cursor is set only once its last chunk is
/// imported. The exports only read, and their cursors start from
/// [`MoveKeys::imported_up_to`](crate::MoveKeys::imported_up_to), so a
/// rerun after a kill anywhere copies from where the new shard is. An
/// error on either side ends both (the exports stop at their next chunk)
/// and comes back; records (key, source id) -> new id in `ids` and the
/// jobs stored per key in `copied`.
pub(super) fn copy_rounds<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    cursors: &mut Cursors,
    ids: &mut CopiedIds,
    copied: &mut BTreeMap<String, u64>,
    touched: &mut BTreeSet<String>,
) -> Result<(), ReshardError> {
    let mut done = 0usize;
    // What the import side does with each message, in order.
    let mut take = |msg: Result<Exported, ReshardError>| -> Result<(), ReshardError> {
        match msg? {
            Exported::Chunk(i, jobs) => {
                let (key, from, to) = &batch[i];
                // From here the new shard may hold copies, whatever the
                // call answers.
                touched.insert(key.clone());
                let n = copied.entry(key.clone()).or_default();
                let copies = ids.of_key(key);
                for (src, new) in backend.import_jobs(to, from, key, &jobs)? {
                    copies.insert(src, new);
                    *n += 1;
                }
            }
            Exported::Done(i, after) => {
                cursors.insert(batch[i].0.clone(), Some(after));
                done += 1;
            }
        }
        Ok(())
    };
    if !backend.overlaps_copies() {
        // One thread, in the same order: export a chunk, import it.
        let mut failed = None;
        export_rounds(backend, batch, &mut |msg| match take(msg) {
            Ok(()) => true,
            Err(e) => {
                failed = Some(e);
                false
            }
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
    } else {
        std::thread::scope(|scope| -> Result<(), ReshardError> {
            let (tx, rx) = std::sync::mpsc::sync_channel(COPY_AHEAD_CHUNKS);
            scope.spawn(move || {
                let mut send = |msg| tx.send(msg).is_ok();
                if let Err(e) = export_rounds(backend, batch, &mut send) {
                    // The import side may be gone (it failed): nothing to tell.
                    send(Err(e));
                }
            });
            let out = rx.iter().try_for_each(&mut take);
            // Dropped before the export thread is joined: a send it is
            // blocked in (or its next one) fails, and it stops.
            drop(rx);
            out
        })?;
    }
    if done != batch.len() {
        return Err(QueueError::Internal {
            what: "a move's exports ended before their last key's".into(),
        }
        .into());
    }
    Ok(())
}

/// The export side of [`copy_rounds`]: each key's cursor on its new shard,
/// then its chunks, sent in order; stops when the import side is gone.
fn export_rounds<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    send: &mut dyn FnMut(Result<Exported, ReshardError>) -> bool,
) -> Result<(), ReshardError> {
    for (i, (key, from, to)) in batch.iter().enumerate() {
        let mut after = backend.imported_up_to(to, from, key)?;
        for _ in 0..TRANSFER_ROUNDS_MAX {
            let mut round = 0usize;
            loop {
                let chunk = backend.export_jobs(from, key, after, TRANSFER_CHUNK_JOBS)?;
                let len = chunk.len();
                if let Some(last) = chunk.last() {
                    after = Some(last.id);
                    round += len;
                    if !send(Ok(Exported::Chunk(i, chunk))) {
                        return Ok(());
                    }
                }
                if len < TRANSFER_CHUNK_JOBS {
                    break;
                }
            }
            if round < TRANSFER_CHUNK_JOBS {
                break;
            }
        }
        if !send(Ok(Exported::Done(i, after))) {
            return Ok(());
        }
    }
    Ok(())
}

/// Copies `key`'s jobs from `from` that `to` does not have yet, in chunks,
/// until the export finds none; records (key, source id) -> new id in `ids`.
/// Returns how many were stored.
pub(super) fn copy_backlog<B: QueueBackend + ?Sized>(
    backend: &B,
    key: &str,
    from: &str,
    to: &str,
    ids: &mut CopiedIds,
    cursor: &mut Option<Option<JobId>>,
    touched: &mut BTreeSet<String>,
) -> Result<u64, ReshardError> {
    // The new shard's cursor, read once per key and then kept here: every
    // import of this key from `from` in this run goes through this copy.
    let mut after = match *cursor {
        Some(after) => after,
        None => backend.imported_up_to(to, from, key)?,
    };
    let mut n = 0u64;
    loop {
        let chunk = backend.export_jobs(from, key, after, TRANSFER_CHUNK_JOBS)?;
        let Some(last) = chunk.last() else {
            *cursor = Some(after);
            return Ok(n);
        };
        after = Some(last.id);
        // From here the new shard may hold copies, whatever the call answers.
        touched.insert(key.to_string());
        let copies = ids.of_key(key);
        for (src, new) in backend.import_jobs(to, from, key, &chunk)? {
            copies.insert(src, new);
            n += 1;
        }
        if chunk.len() < TRANSFER_CHUNK_JOBS {
            *cursor = Some(after);
            return Ok(n);
        }
    }
}

/// Seals or unseals a batch's keys on their old shards (sealed: no run
/// starts there; the fence names the shard the backlog goes to).
pub(super) fn set_sealed<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[(String, String, String)],
    seal: bool,
) -> Result<(), ReshardError> {
    update_old_fences(backend, batch, &mut |fence, key, to| {
        if seal {
            fence.sealed_keys.insert(key.to_string(), to.to_string());
        } else if !fence.is_frozen(key) {
            // A frozen key is never unsealed here: its new shard holds its
            // backlog and takes its enqueues, so it must finish its move.
            fence.sealed_keys.remove(key);
        }
    })
}

/// [`set_sealed`], shard by shard: every old shard is tried even when one
/// fails; the first error comes back.
pub(super) fn set_sealed_each<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[(String, String, String)],
    seal: bool,
) -> Result<(), ReshardError> {
    each_old_shard(batch, |part| set_sealed(backend, part, seal))
}

pub(super) fn each_old_shard(
    batch: &[(String, String, String)],
    mut f: impl FnMut(&[(String, String, String)]) -> Result<(), ReshardError>,
) -> Result<(), ReshardError> {
    let mut by_shard: BTreeMap<&str, Vec<(String, String, String)>> = BTreeMap::new();
    for sw in batch {
        by_shard.entry(sw.1.as_str()).or_default().push(sw.clone());
    }
    let mut first = None;
    for part in by_shard.values() {
        if let Err(e) = f(part) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Changes the fence of each batch key's old shard, one read and one write
/// per shard: `change` is called with the fence once per key on it (with the
/// key's new shard).
pub(super) fn update_old_fences<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[(String, String, String)],
    change: &mut dyn FnMut(&mut crate::job::Fence, &str, &str),
) -> Result<(), ReshardError> {
    let mut by_shard: BTreeMap<&str, Vec<(&str, &str)>> = BTreeMap::new();
    for (key, from, to) in batch {
        by_shard
            .entry(from.as_str())
            .or_default()
            .push((key.as_str(), to.as_str()));
    }
    for (shard, keys) in by_shard {
        let mut fence = backend.fence(shard)?;
        for (key, to) in keys {
            change(&mut fence, key, to);
        }
        backend.set_fence(shard, &fence)?;
    }
    Ok(())
}

/// Keys whose runs on their old shards outlived `drain_timeout_ms`:
/// they stay. A key its new shard already holds copies of (a killed run
/// got that far) stays sealed, so its old shard never runs what was
/// copied; a rerun finishes it. The others are unsealed: nothing of them
/// moved. Returns their names.
pub(super) fn leave_late<B: QueueBackend + ?Sized>(
    backend: &B,
    late: &[Switch],
) -> Result<Vec<String>, ReshardError> {
    let mut unseal = Vec::new();
    for sw in late {
        let (key, from, to) = (&sw.0, &sw.1, &sw.2);
        let copied = match backend.imported_up_to(to, from, key)? {
            None => false,
            Some(up_to) => backend
                .export_jobs(from, key, None, 1)?
                .first()
                .is_some_and(|j| j.id <= up_to),
        };
        if !copied {
            unseal.push(sw.clone());
        }
    }
    set_sealed(backend, &unseal, false)?;
    Ok(late.iter().map(|sw| sw.0.clone()).collect())
}

/// Raises the run-fence floor of each batch key's new shard above the
/// highest fence its old shard issued, before the switch is published: the
/// old shard ran the key's last jobs (it is drained), so the key's next run,
/// on the new shard, gets a larger fence than any earlier one.
pub(super) fn raise_fence_floors<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[(String, String, String)],
) -> Result<(), ReshardError> {
    let mut floor: BTreeMap<&str, u64> = BTreeMap::new();
    let mut high: BTreeMap<&str, u64> = BTreeMap::new();
    for (_, from, to) in batch {
        if !high.contains_key(from.as_str()) {
            high.insert(from, backend.shard_stats(from)?.fence_high);
        }
        let f = floor.entry(to.as_str()).or_default();
        *f = (*f).max(high[from.as_str()].saturating_add(1));
    }
    for (shard, min) in floor {
        let mut fence = backend.fence(shard)?;
        if fence.run_fence_min < min {
            fence.run_fence_min = min;
            backend.set_fence(shard, &fence)?;
        }
    }
    Ok(())
}

/// Sends [`RebalanceEvent::Waiting`] when [`WAIT_EVENT_EVERY_MS`] passed
/// since the last one (or the start of the wait).
pub(super) fn say_waiting(
    clock: &dyn Clock,
    started_ms: u64,
    said_ms: &mut u64,
    keys: usize,
    on_event: &mut dyn FnMut(RebalanceEvent),
) {
    let now = clock.now_ms();
    if now.saturating_sub(*said_ms) >= WAIT_EVENT_EVERY_MS {
        *said_ms = now;
        on_event(RebalanceEvent::Waiting {
            keys,
            waited_ms: now.saturating_sub(started_ms),
        });
    }
}
