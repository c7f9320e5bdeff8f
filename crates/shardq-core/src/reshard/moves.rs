//! Phase 2: moving each key with its backlog in batches; transfers a killed
//! run left are finished first, a key with a run in flight waits on its own,
//! and a failing shard is set aside (`FailedShards`).

use super::*;

/// Phase 2 on a backend that moves backlogs: each batch of keys is sealed
/// on its old shards, waits for its runs in flight there, has its backlog
/// copied in rounds while its producers keep writing, then, under a pause
/// of one last short round, switches; the copies left behind are deleted.
/// Transfers a killed run left sealed are finished first, to the shard
/// their copies went to. Returns the published map.
///
/// A run that stops with an error (a script error, a reply timeout, a
/// shard that fails) first unseals every key it sealed and did not switch
/// that no copy of can exist ([`OpenSeals`]): such a key runs where it is
/// until a rerun moves it, instead of waiting sealed, unrun, for one. Not
/// after a conflict (the lock lapsed, a newer rebalance took over): that
/// run writes nothing more.
#[allow(clippy::too_many_arguments)]
pub(super) fn move_with_backlogs<B>(
    backend: &B,
    store: &dyn MapStore,
    cur: ShardMap,
    target: &ShardMap,
    switches: Vec<(String, String, String)>,
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
    report: &mut RebalanceReport,
) -> Result<ShardMap, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    let mut open = OpenSeals::default();
    let out = move_all(
        backend, store, cur, target, switches, options, on_event, report, &mut open,
    );
    if let Err(e) = &out {
        if e.kind() != ErrorKind::Conflict {
            let clean = open.clean(backend, open.keys.values());
            let _ = set_sealed_each(backend, &clean, false);
        }
    }
    out
}

/// The keys a run sealed (or found sealed by a killed one) and has not
/// switched yet, and which of them may have copies on their new shards.
#[derive(Default)]
pub(super) struct OpenSeals {
    /// Key -> its move, from its seal until its switch is published (or it
    /// was left where it is and unsealed).
    pub(super) keys: BTreeMap<String, Switch>,
    /// Keys an import was sent for in this run: their new shards may hold
    /// copies, whatever the calls answered.
    pub(super) touched: BTreeSet<String>,
    /// Keys found sealed when this run began (a killed run's transfers):
    /// an earlier run may have copied them.
    pub(super) carried: BTreeSet<String>,
}

impl OpenSeals {
    /// Those of `moves` that no copy of can exist: nothing was sent for
    /// them in this run, and a key found sealed also has none on its new
    /// shard as far as both shards answer ([`may_hold_copies`]). A key this
    /// run sealed and sent nothing for holds no copy anywhere: a key with
    /// copies stays sealed until its move ends, so a killed run's keys are
    /// the carried ones.
    pub(super) fn clean<'a, B: QueueBackend + ?Sized>(
        &self,
        backend: &B,
        moves: impl IntoIterator<Item = &'a Switch>,
    ) -> Vec<Switch> {
        moves
            .into_iter()
            .filter(|sw| {
                !self.touched.contains(&sw.0)
                    && (!self.carried.contains(&sw.0)
                        || !may_hold_copies(backend, &sw.0, &sw.1, &sw.2))
            })
            .cloned()
            .collect()
    }
}

/// The batch loop of [`move_with_backlogs`]: each turn takes the waiting
/// keys whose runs ended and fills up with new keys ([`Todo::next_batch`]),
/// moves that batch, cleans up after its switch and notes it
/// ([`finish_switched`]); it ends when no key is left to move or wait for.
#[allow(clippy::too_many_arguments)]
fn move_all<B>(
    backend: &B,
    store: &dyn MapStore,
    mut cur: ShardMap,
    target: &ShardMap,
    switches: Vec<(String, String, String)>,
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
    report: &mut RebalanceReport,
    open: &mut OpenSeals,
) -> Result<ShardMap, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    // Shards that failed here (unreadable, unreachable), with their first
    // error: the keys that move from or to one stay where they are, and
    // the other keys move on.
    let mut failed = FailedShards::default();
    let all = take_over_sealed(backend, &cur, switches, &mut failed, open)?;
    let total = all.len();
    let mut done = 0usize;
    let clock = &*options.clock;
    let mut todo = Todo {
        pending: all.into_iter().collect(),
        waiting: Vec::new(),
        stuck: Vec::new(),
        waited_most: 0,
    };
    let mut said_ms = clock.now_ms();
    loop {
        // A run whose lock lapsed (a renewal found it gone) stops here,
        // between batches, with nothing of the next batch sealed.
        store.check_lock()?;
        let now = clock.now_ms();
        let (batch, sealed_at) = todo.next_batch(backend, options, now, &mut failed, open)?;
        if batch.is_empty() {
            if todo.waiting.is_empty() && todo.pending.is_empty() {
                break;
            }
            let oldest = todo.waiting.iter().map(|(_, at)| *at).min().unwrap_or(now);
            say_waiting(clock, oldest, &mut said_ms, todo.waiting.len(), on_event);
            clock.sleep_ms(options.poll_ms.max(1));
            continue;
        }
        let batch_started = clock.now_ms();
        // Sealed from here (the batch's first step) until switched.
        for sw in &batch {
            open.keys.insert(sw.0.clone(), sw.clone());
        }
        // Per key: the jobs copied.
        let mut copied: BTreeMap<String, u64> = BTreeMap::new();
        let moved = move_batch_or_set_aside(
            backend,
            store,
            &cur,
            target,
            batch,
            options,
            on_event,
            &mut copied,
            open,
            &mut failed,
        )?;
        let Some(moved) = moved else {
            continue;
        };
        // Keys with runs in flight stay sealed and wait, each on its own.
        let sealed_now = clock.now_ms();
        todo.waiting.extend(moved.busy.into_iter().map(|sw| {
            let since = sealed_at.get(&sw.0).copied().unwrap_or(sealed_now);
            (sw, since)
        }));
        let Some((next, pauses, batch)) = moved.switched else {
            continue;
        };
        let moved = Moved {
            copied: &copied,
            pauses: &pauses,
            sealed_at: &sealed_at,
            batch_started,
        };
        cur = next;
        let (keys, pause_ms, jobs) = finish_switched(
            backend,
            &batch,
            cur.version,
            &moved,
            open,
            &mut failed,
            report,
        )?;
        done += keys;
        on_event(RebalanceEvent::Switched {
            done,
            total,
            keys,
            pause_ms,
            jobs,
        });
    }
    if let Some(e) = failed.into_error() {
        return Err(e);
    }
    if !todo.stuck.is_empty() {
        return Err(ReshardError::DrainTimeout {
            keys: todo.stuck.into_iter().take(8).collect(),
            waited_ms: todo.waited_most,
        });
    }
    Ok(cur)
}

/// The keys [`move_all`] has yet to move. A key waits only for its own
/// runs: the next batch takes the keys whose runs ended and fills up with
/// new ones, so one long run holds up its own key and no other.
struct Todo {
    /// Keys not sealed yet, in order.
    pending: std::collections::VecDeque<Switch>,
    /// Keys sealed whose runs on their old shards had not ended, with when
    /// each was sealed.
    waiting: Vec<(Switch, u64)>,
    /// Keys left where they are because their runs outlived the drain
    /// timeout ([`leave_late`]).
    stuck: Vec<String>,
    /// The longest wait of those, in ms.
    waited_most: u64,
}

impl Todo {
    /// The next batch: the waiting keys whose runs ended (with when each
    /// was sealed, in the map), then new keys up to the batch size. Keys of
    /// a failed shard go to `failed`; those that waited past the drain
    /// timeout are left where they are ([`leave_late`]) and noted stuck.
    fn next_batch<B: QueueBackend + ?Sized>(
        &mut self,
        backend: &B,
        options: &RebalanceOptions,
        now: u64,
        failed: &mut FailedShards,
        open: &mut OpenSeals,
    ) -> Result<(Vec<Switch>, BTreeMap<String, u64>), ReshardError> {
        let mut batch: Vec<Switch> = Vec::new();
        let mut sealed_at: BTreeMap<String, u64> = BTreeMap::new();
        if !self.waiting.is_empty() {
            let late = take_ended(
                backend,
                options,
                now,
                &mut self.waiting,
                &mut batch,
                &mut sealed_at,
                failed,
            )?;
            for (sw, since) in &late {
                self.waited_most = self.waited_most.max(now.saturating_sub(*since));
                open.keys.remove(&sw.0);
            }
            let late: Vec<Switch> = late.into_iter().map(|(sw, _)| sw).collect();
            self.stuck.extend(leave_late(backend, &late)?);
        }
        while batch.len() < options.batch {
            let Some(sw) = self.pending.pop_front() else {
                break;
            };
            if failed.involves(&sw) {
                failed.keys.push(sw.0);
            } else {
                batch.push(sw);
            }
        }
        Ok((batch, sealed_at))
    }
}

/// What a switched batch's report needs ([`note_moved`]).
struct Moved<'a> {
    /// Per key: the jobs copied.
    copied: &'a BTreeMap<String, u64>,
    /// Each forced key's producer pause.
    pauses: &'a BTreeMap<String, u64>,
    /// When each key that waited for its runs was sealed.
    sealed_at: &'a BTreeMap<String, u64>,
    batch_started: u64,
}

/// After `batch`'s switch was published at `version`: its keys finish
/// their move (by this run or a rerun), so they leave `open`; the old
/// shards are cleaned up ([`clean_up_switched`]) and the batch noted in
/// `report`. Returns the keys switched, the longest producer pause (ms)
/// and the jobs copied.
fn finish_switched<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    version: u64,
    moved: &Moved<'_>,
    open: &mut OpenSeals,
    failed: &mut FailedShards,
    report: &mut RebalanceReport,
) -> Result<(usize, f64, u64), ReshardError> {
    for sw in batch {
        open.keys.remove(&sw.0);
    }
    // Published: the keys follow the new map. Their old shards' fences
    // now refuse producers still routing with the old one (they reload
    // and route to the new shards); the keys stay frozen there until
    // their copies are gone.
    clean_up_switched(backend, batch, version, failed)?;
    let pause_ms = moved.pauses.values().copied().max().unwrap_or(0) as f64;
    let jobs = note_moved(
        report,
        batch,
        moved.copied,
        moved.pauses,
        moved.sealed_at,
        moved.batch_started,
    );
    report.jobs_moved += jobs;
    Ok((batch.len(), pause_ms, jobs))
}

/// Adds the keys of a switched batch to `report` (jobs copied, producer
/// pause, wait for runs since each key's seal); returns the jobs copied.
fn note_moved(
    report: &mut RebalanceReport,
    batch: &[Switch],
    copied: &BTreeMap<String, u64>,
    pauses: &BTreeMap<String, u64>,
    sealed_at: &BTreeMap<String, u64>,
    batch_started: u64,
) -> u64 {
    let mut jobs = 0u64;
    for (key, from, to) in batch {
        let n = copied.get(key).copied().unwrap_or(0);
        jobs += n;
        report.moved.push(MovedKey {
            key: key.clone(),
            from: from.clone(),
            to: to.clone(),
            pause_ms: pauses.get(key).copied().unwrap_or(0) as f64,
            jobs_moved: n,
            run_wait_ms: sealed_at
                .get(key)
                .map_or(0, |at| batch_started.saturating_sub(*at)) as f64,
        });
    }
    jobs
}

/// One batch's move ([`move_batch`]), tried again without the keys of a
/// shard that failed in it (set aside in `failed`, unsealed where no copy
/// of them can exist) until it moves or none is left. `None`: no key of
/// the batch was left to move.
#[allow(clippy::too_many_arguments)]
fn move_batch_or_set_aside<B>(
    backend: &B,
    store: &dyn MapStore,
    cur: &ShardMap,
    target: &ShardMap,
    mut batch: Vec<Switch>,
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
    copied: &mut BTreeMap<String, u64>,
    open: &mut OpenSeals,
    failed: &mut FailedShards,
) -> Result<Option<BatchMoved>, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    // (key, source id) -> id on the new shard, of every copy this run
    // made: kept across a retry of the batch, whose dedup records must
    // still name the copies made before it.
    let mut ids = CopiedIds::default();
    loop {
        if batch.is_empty() {
            return Ok(None);
        }
        let attempt = move_batch(
            backend,
            store,
            cur,
            target,
            &batch,
            options,
            on_event,
            copied,
            &mut open.touched,
            &mut ids,
        );
        match attempt {
            Ok(moved) => return Ok(Some(moved)),
            Err(e) => {
                // Pauses stay as they are: a frozen key's producers go
                // to its new shard (no wait), and a key paused on its
                // new shard mid forced round stays so until a rerun has
                // copied the rest, or its order would break. The keys
                // stay sealed.
                let shards: BTreeSet<&str> = batch
                    .iter()
                    .flat_map(|(_, from, to)| [from.as_str(), to.as_str()])
                    .collect();
                let shards: Vec<&str> = shards.into_iter().collect();
                // An error no failing shard explains stops the run
                // (the caller unseals what holds no copies).
                failed.note_or_raise(backend, &shards, e)?;
                let (drop, keep): (Vec<_>, Vec<_>) =
                    batch.into_iter().partition(|sw| failed.involves(sw));
                // The keys that stay where they are lose their seal too
                // when no copy of them can exist: they run there again.
                // One whose old shard does not answer now stays open,
                // for the unseal when the run ends.
                let clean = open.clean(backend, &drop);
                if set_sealed_each(backend, &clean, false).is_ok() {
                    for sw in &clean {
                        open.keys.remove(&sw.0);
                    }
                }
                failed.keys.extend(drop.into_iter().map(|sw| sw.0));
                batch = keep;
            }
        }
    }
}

/// The moves to make, from `switches` and the transfers a killed rebalance
/// left sealed: those it switched already are finished here (what a
/// producer still routing with the old map stored on the old shard is
/// copied, then the copies there are deleted and the key unsealed); the
/// others go on to where their copies went, whatever the target says now
/// (the next rebalance moves them on), and are noted as carried.
fn take_over_sealed<B: QueueBackend + ?Sized>(
    backend: &B,
    cur: &ShardMap,
    switches: Vec<Switch>,
    failed: &mut FailedShards,
    open: &mut OpenSeals,
) -> Result<Vec<Switch>, ReshardError> {
    let mut todo: BTreeMap<String, (String, String)> = switches
        .into_iter()
        .map(|(k, from, to)| (k, (from, to)))
        .collect();
    let router = Router::new(cur.clone())?;
    for shard in &cur.shards {
        let fence = match backend.fence(&shard.name) {
            Ok(f) => f,
            Err(e) => {
                failed.note_or_raise(backend, &[shard.name.as_str()], e.into())?;
                continue;
            }
        };
        for (key, to) in &fence.sealed_keys {
            if router.route(key) == to.as_str() {
                // Switched already: what a producer still routing with the
                // old map stored here before the fence is copied, then the
                // copies here are deleted.
                let finished = (|| -> Result<(), ReshardError> {
                    let mut ids = CopiedIds::default();
                    let mut touched = BTreeSet::new();
                    copy_backlog(
                        backend,
                        key,
                        &shard.name,
                        to,
                        &mut ids,
                        &mut None,
                        &mut touched,
                    )?;
                    // The copies durable before their sources go.
                    backend.sync_imports(to)?;
                    backend.purge_key(&shard.name, key)?;
                    let mut f = backend.fence(&shard.name)?;
                    // The floor is raised in the same write: unsealed
                    // under an older one, the key would take a stale
                    // producer's job here, where it no longer runs.
                    f.map_version_min = f.map_version_min.max(cur.version);
                    f.unseal(key);
                    backend.set_fence(&shard.name, &f)?;
                    Ok(())
                })();
                if let Err(e) = finished {
                    // Left sealed: a rerun finishes it.
                    failed.note_or_raise(backend, &[shard.name.as_str(), to.as_str()], e)?;
                    failed.keys.push(key.clone());
                }
                todo.remove(key);
            } else {
                todo.insert(key.clone(), (shard.name.clone(), to.clone()));
                open.carried.insert(key.clone());
            }
        }
    }
    Ok(todo
        .into_iter()
        .map(|(k, (from, to))| (k, from, to))
        .collect())
}

/// Of the keys `waiting` for their runs on their old shards: those whose
/// runs ended join `batch` (up to the batch size, with when each was
/// sealed in `sealed_at`); those still running past `drain_timeout_ms`
/// from their seal are returned (with their seal time) to be left where
/// they are; the others keep waiting.
#[allow(clippy::too_many_arguments)]
fn take_ended<B: QueueBackend + ?Sized>(
    backend: &B,
    options: &RebalanceOptions,
    now: u64,
    waiting: &mut Vec<(Switch, u64)>,
    batch: &mut Vec<Switch>,
    sealed_at: &mut BTreeMap<String, u64>,
    failed: &mut FailedShards,
) -> Result<Vec<(Switch, u64)>, ReshardError> {
    let mut still = Vec::with_capacity(waiting.len());
    let mut late = Vec::new();
    for (sw, since) in std::mem::take(waiting) {
        if failed.involves(&sw) {
            failed.keys.push(sw.0);
            continue;
        }
        match backend.key_counts(&sw.1, &sw.0) {
            Ok(c) if c.in_flight == 0 && batch.len() < options.batch => {
                sealed_at.insert(sw.0.clone(), since);
                batch.push(sw);
            }
            Ok(c) if c.in_flight > 0 && now.saturating_sub(since) >= options.drain_timeout_ms => {
                late.push((sw, since));
            }
            Ok(_) => still.push((sw, since)),
            Err(e) => {
                failed.note_or_raise(backend, &[sw.1.as_str()], e.into())?;
                failed.keys.push(sw.0);
            }
        }
    }
    *waiting = still;
    Ok(late)
}

/// After a batch's switch is published at `version`: the old shards'
/// fences raised to it, the copies left there deleted (once the new shards
/// made theirs durable) and the keys unsealed. A shard that fails here is
/// set aside in `failed`, its keys left sealed (and frozen) for a rerun.
fn clean_up_switched<B: QueueBackend + ?Sized>(
    backend: &B,
    batch: &[Switch],
    version: u64,
    failed: &mut FailedShards,
) -> Result<(), ReshardError> {
    let olds: Vec<String> = batch
        .iter()
        .map(|sw| sw.1.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let olds: Vec<&str> = olds.iter().map(String::as_str).collect();
    if let Err(e) = each_old_shard(batch, |part| {
        update_old_fences(backend, part, &mut |fence, _, _| {
            fence.map_version_min = fence.map_version_min.max(version);
        })
    }) {
        failed.note_or_raise(backend, &olds, e)?;
    }
    // 6. Delete the copies left on the old shards, then unseal. The
    //    switch is published: a key whose old shard fails here keeps its
    //    copies there sealed (and frozen), and a rerun deletes them
    //    (above). Not on an old shard whose fence could not be raised:
    //    unsealed there, the key would take a stale producer's job on
    //    the shard it no longer runs on.
    let mut cleaned = Vec::with_capacity(batch.len());
    // The copies are made durable before any source is deleted, once
    // per new shard for the whole batch: a new shard that fails that
    // keeps its keys' sources where they are, sealed, for the rerun.
    let mut synced: BTreeMap<&str, bool> = BTreeMap::new();
    for sw in batch {
        if !synced.contains_key(sw.2.as_str()) {
            let ok = match backend.sync_imports(&sw.2) {
                Ok(()) => true,
                Err(e) => {
                    failed.note_or_raise(backend, &[sw.2.as_str()], e.into())?;
                    false
                }
            };
            synced.insert(&sw.2, ok);
        }
    }
    for sw in batch {
        if failed.shards.contains_key(&sw.1) || !synced[sw.2.as_str()] {
            failed.keys.push(sw.0.clone());
            continue;
        }
        match backend.purge_key(&sw.1, &sw.0) {
            Ok(_) => cleaned.push(sw.clone()),
            Err(e) => failed.note_or_raise(backend, &[sw.1.as_str()], e.into())?,
        }
    }
    if let Err(e) = each_old_shard(&cleaned, |part| {
        update_old_fences(backend, part, &mut |fence, key, _| {
            // Raised again in the same write, so no unseal is ever seen
            // under the old floor.
            fence.map_version_min = fence.map_version_min.max(version);
            fence.unseal(key);
        })
    }) {
        failed.note_or_raise(backend, &olds, e)?;
    }
    Ok(())
}

/// Shards a rebalance found failing, and the keys left where they are
/// because they move from or to one.
#[derive(Default)]
pub(super) struct FailedShards {
    pub(super) shards: BTreeMap<String, ReshardError>,
    pub(super) keys: Vec<String>,
}

impl FailedShards {
    fn involves(&self, sw: &(String, String, String)) -> bool {
        self.shards.contains_key(&sw.1) || self.shards.contains_key(&sw.2)
    }

    /// After `e`: when it is a store's failure (unreachable, damaged,
    /// lost), each of `shards` is read once to learn which fail; those are
    /// noted and `Ok` comes back. Any other error, or one no shard of
    /// `shards` explains, is returned: the rebalance stops as before.
    fn note_or_raise<B: QueueBackend + ?Sized>(
        &mut self,
        backend: &B,
        shards: &[&str],
        e: ReshardError,
    ) -> Result<(), ReshardError> {
        if !matches!(
            e.kind(),
            ErrorKind::Retryable | ErrorKind::Corrupt | ErrorKind::Lost
        ) {
            return Err(e);
        }
        let mut found = false;
        for &shard in shards {
            if self.shards.contains_key(shard) {
                found = true;
                continue;
            }
            if let Err(probe) = backend.shard_stats(shard) {
                self.shards.insert(shard.to_string(), probe.into());
                found = true;
            }
        }
        if found {
            Ok(())
        } else {
            Err(e)
        }
    }

    fn into_error(self) -> Option<ReshardError> {
        if self.shards.is_empty() {
            return None;
        }
        let kind = self
            .shards
            .values()
            .next()
            .map_or(ErrorKind::Retryable, ReshardError::kind);
        Some(ReshardError::ShardsFailed {
            kind,
            shards: self
                .shards
                .into_iter()
                .map(|(name, e)| format!("{name}: {e}"))
                .collect(),
            count: self.keys.len(),
            keys: self.keys.into_iter().take(8).collect(),
        })
    }
}

/// Whether `to` may hold copies of `key` from `from` (a killed run got that
/// far): true unless both shards answer that it holds none of the jobs
/// still on `from`.
pub(super) fn may_hold_copies<B: QueueBackend + ?Sized>(
    backend: &B,
    key: &str,
    from: &str,
    to: &str,
) -> bool {
    let check = || -> Result<bool, QueueError> {
        Ok(match backend.imported_up_to(to, from, key)? {
            None => false,
            Some(up_to) => backend
                .export_jobs(from, key, None, 1)?
                .first()
                .is_none_or(|j| j.id <= up_to),
        })
    };
    check().unwrap_or(true)
}
