//! `rebalance`: its options, the lock and the epoch, phase 1, and phase 3
//! (`finish`: publish the target, clear it by compare-and-delete).

use super::*;

/// Options of [`rebalance`].
#[derive(Debug, Clone)]
pub struct RebalanceOptions {
    /// Keys per move batch (1..=[`BATCH_MAX`]).
    pub batch: usize,
    /// Longest wait for one batch to drain, in ms.
    pub drain_timeout_ms: u64,
    /// Interval between drain checks, in ms.
    pub poll_ms: u64,
    /// Time for the drain waits and the pause figures (a manual clock in
    /// simulations).
    pub clock: Arc<dyn Clock>,
    /// Who runs it, as the deployment's progress record names it (the
    /// dashboard shows it): a command and its process.
    pub runner: String,
}

impl Default for RebalanceOptions {
    fn default() -> Self {
        RebalanceOptions {
            batch: BATCH_DEFAULT,
            drain_timeout_ms: DRAIN_TIMEOUT_MS_DEFAULT,
            poll_ms: DRAIN_POLL_MS_DEFAULT,
            clock: Arc::new(SystemClock),
            runner: format!("pid {}", std::process::id()),
        }
    }
}

/// Walks the published map to the target, moving keys with drain-then-switch.
/// Resumable: rerun after any failure or kill.
pub fn rebalance<B>(
    backend: &B,
    store: &dyn MapStore,
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
) -> Result<RebalanceReport, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    if options.batch == 0 || options.batch > BATCH_MAX {
        return Err(ReshardError::Invalid(format!(
            "batch {} is out of range: 1..={BATCH_MAX}",
            options.batch
        )));
    }
    let clock = &*options.clock;
    let _lock = store.try_lock_rebalance()?;
    // Under the lock, so a second run refused as busy never overwrites
    // the first one's record.
    let now = clock.now_ms();
    let mut rec = ProgressRecorder {
        store,
        clock,
        progress: RebalanceProgress::started(now, &options.runner),
        written_ms: now,
        written_phase: String::new(),
        superseded: false,
    };
    if let Ok(cur) = store.load() {
        rec.progress.from_version = Some(cur.version);
    }
    rec.write(now);
    let result = rebalance_locked(backend, store, options, &mut |ev| {
        rec.note(&ev);
        on_event(ev);
    });
    rec.progress.ended(&result, clock.now_ms());
    rec.write(clock.now_ms());
    result
}

/// [`rebalance`], under the rebalance lock.
pub(super) fn rebalance_locked<B>(
    backend: &B,
    store: &dyn MapStore,
    options: &RebalanceOptions,
    on_event: &mut dyn FnMut(RebalanceEvent),
) -> Result<RebalanceReport, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    let clock = &*options.clock;
    let started_ms = clock.now_ms();
    // Taken first, while the lock is surely ours (the store checks): a run
    // stalled before this point gets no epoch once its lock lapsed.
    let epoch = store.rebalance_epoch()?;
    let mut cur = store.load()?;
    let mut report = RebalanceReport {
        from_version: cur.version,
        ..RebalanceReport::default()
    };
    let target = current_target(store)?;
    let target_router = Router::new(with_version(&target, cur.version))?;
    if epoch > 0 {
        shut_out_stalled_runs(backend, epoch, &cur, &target)?;
    }
    // Phase 1: pin the keys with work, fence, publish the intermediate map.
    if !is_intermediate(&cur, &target) {
        cur = pin_and_publish(backend, store, &cur, &target)?;
    }
    settle_left_pauses(backend, &cur)?;
    let switches = pending_switches(&cur, &target_router);
    on_event(RebalanceEvent::Pinned {
        pinned: switches.len(),
        version: cur.version,
    });
    // Phase 2, moving each key's backlog with it: no drain, no holdback.
    cur = move_with_backlogs(
        backend,
        store,
        cur,
        &target,
        switches,
        options,
        on_event,
        &mut report,
    )?;
    finish(
        backend, store, cur, &target, report, started_ms, clock, on_event,
    )
}

/// Has every shard of either map refuse the writes of older runs (those
/// with an epoch below `epoch`).
fn shut_out_stalled_runs<B>(
    backend: &B,
    epoch: u64,
    cur: &ShardMap,
    target: &ShardMap,
) -> Result<(), ReshardError>
where
    B: QueueBackend + ?Sized,
{
    // A rebalance that stalled past its lock's lease (stopped, paused)
    // may wake and write again: every shard of either map refuses its
    // writes from here on. A shard that does not answer is passed by (its
    // moves fail below; this run's first write there raises it as well).
    let names: BTreeSet<&str> = cur
        .shards
        .iter()
        .chain(&target.shards)
        .map(|s| s.name.as_str())
        .collect();
    for name in names {
        if let Err(e @ QueueError::Superseded { .. }) = backend.enter_rebalance(name, epoch) {
            return Err(e.into());
        }
    }
    Ok(())
}

/// Phase 1: pins the keys with work where they are, fences the shards of
/// `cur`, and publishes the intermediate map, which it returns.
fn pin_and_publish<B>(
    backend: &B,
    store: &dyn MapStore,
    cur: &ShardMap,
    target: &ShardMap,
) -> Result<ShardMap, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    let next_version = cur.version + 1;
    let first = plan_moves(backend, cur, target)?;
    for shard in &cur.shards {
        let mut fence = backend.fence(&shard.name)?;
        fence.map_version_min = fence.map_version_min.max(next_version);
        backend.set_fence(&shard.name, &fence)?;
    }
    // Enqueues that landed between the scan and the fence.
    let second = plan_moves(backend, cur, target)?;
    let mut pins: BTreeMap<String, String> = first
        .into_iter()
        .chain(second)
        .map(|m| (m.key, m.from))
        .collect();
    pin_sealed_where_routed(backend, cur, &mut pins)?;
    raise_run_fences(backend, cur, target)?;
    let next = intermediate(cur, target, &pins);
    publish_next(store, cur, &next)?;
    Ok(next)
}

/// Pins a key whose transfer a killed run left sealed where the published
/// map sends its producers.
fn pin_sealed_where_routed<B>(
    backend: &B,
    cur: &ShardMap,
    pins: &mut BTreeMap<String, String>,
) -> Result<(), ReshardError>
where
    B: QueueBackend + ?Sized,
{
    // A transfer a killed run left sealed has work on both sides (the
    // new shard may run copies already): the key stays pinned where the
    // published map sends its producers, never where its copies are
    // while its old shard still holds the rest, or its new jobs would
    // overtake them. Phase 2 finishes the transfer first.
    let now = Router::new(cur.clone())?;
    for shard in &cur.shards {
        for (key, to) in backend.fence(&shard.name)?.sealed_keys {
            if let Some(pin) = pins.get_mut(&key) {
                *pin = if now.route(&key) == to.as_str() {
                    to
                } else {
                    shard.name.clone()
                };
            }
        }
    }
    Ok(())
}

/// Raises the run fence of every target shard above every run so far on
/// the shards of `cur`.
fn raise_run_fences<B>(backend: &B, cur: &ShardMap, target: &ShardMap) -> Result<(), ReshardError>
where
    B: QueueBackend + ?Sized,
{
    // Keys without work follow the target at once: their next run, on
    // any shard, must get a larger fence than every run so far.
    let mut high = 0u64;
    for shard in &cur.shards {
        high = high.max(backend.shard_stats(&shard.name)?.fence_high);
    }
    for shard in &target.shards {
        let mut fence = backend.fence(&shard.name)?;
        if fence.run_fence_min <= high {
            fence.run_fence_min = high.saturating_add(1);
            backend.set_fence(&shard.name, &fence)?;
        }
    }
    Ok(())
}

/// Fences every shard of `cur` at its version and lifts the pauses a killed
/// run left behind, keeping those of a transfer still under way.
fn settle_left_pauses<B>(backend: &B, cur: &ShardMap) -> Result<(), ReshardError>
where
    B: QueueBackend + ?Sized,
{
    // A run killed between a switch and its un-pause leaves keys paused and
    // old shards unfenced: fence every shard at the published version (stale
    // producers reload) and lift the pauses; the batches re-pause what they
    // move. Not the pauses of a transfer still under way: a key frozen on
    // its old shard stays frozen (its new shard holds its backlog and takes
    // its enqueues), and a key paused on its new shard by a killed forced
    // round stays paused there until its batch has copied the rest, or a
    // producer sent on there would overtake the jobs not copied yet.
    // A shard whose store fails here (unreachable, damaged, lost) is left
    // for the moves, which set it aside and move the other keys; with one
    // unread, no pause is lifted anywhere (its seals are unknown).
    let store_failure = |e: QueueError| match e.kind() {
        ErrorKind::Retryable | ErrorKind::Corrupt | ErrorKind::Lost => Ok(()),
        _ => Err(ReshardError::from(e)),
    };
    let mut fences = Vec::with_capacity(cur.shards.len());
    let mut unread = false;
    for shard in &cur.shards {
        match backend.fence(&shard.name) {
            Ok(f) => fences.push((shard.name.as_str(), f)),
            Err(e) => {
                store_failure(e)?;
                unread = true;
            }
        }
    }
    let moving: BTreeMap<String, String> = fences
        .iter()
        .flat_map(|(_, f)| f.sealed_keys.iter().map(|(k, to)| (k.clone(), to.clone())))
        .collect();
    for (shard, mut fence) in fences {
        let before = fence.paused_keys.len();
        fence.paused_keys.retain(|key| {
            unread
                || fence.sealed_keys.contains_key(key)
                || moving.get(key).is_some_and(|to| to == shard)
        });
        if fence.map_version_min < cur.version || fence.paused_keys.len() != before {
            fence.map_version_min = fence.map_version_min.max(cur.version);
            if let Err(e) = backend.set_fence(shard, &fence) {
                store_failure(e)?;
            }
        }
    }
    Ok(())
}

/// Phase 3: publishes the target itself and clears it.
#[allow(clippy::too_many_arguments)]
pub(super) fn finish<B>(
    backend: &B,
    store: &dyn MapStore,
    mut cur: ShardMap,
    target: &ShardMap,
    mut report: RebalanceReport,
    started_ms: u64,
    clock: &dyn Clock,
    on_event: &mut dyn FnMut(RebalanceEvent),
) -> Result<RebalanceReport, ReshardError>
where
    B: QueueBackend + KeyInventory + ?Sized,
{
    let mut fin = target.clone();
    fin.version = cur.version + 1;
    // The target's overrides are the operator's pins (the temporary ones
    // live only in the published map); keep every one of them.
    let fin_router = Router::new(fin.clone())?;
    let leaving: Vec<&Shard> = cur
        .shards
        .iter()
        .filter(|s| fin.shard(&s.name).is_none())
        .collect();
    for s in &leaving {
        let mut fence = backend.fence(&s.name)?;
        fence.map_version_min = fence.map_version_min.max(fin.version);
        backend.set_fence(&s.name, &fence)?;
        let left = backend.keys_with_work(&s.name)?;
        if let Some((key, counts)) = left.into_iter().find(|(_, c)| has_work(c) > 0) {
            return Err(ReshardError::Invalid(format!(
                "shard {:?} still holds work for key {key:?} ({} queued, {} in flight, {} dead) after its keys moved; rerun rebalance",
                s.name, counts.depth, counts.in_flight, counts.dead
            )));
        }
    }
    // Backstop: the final map must route every key with work to the shard
    // that holds it, or publishing it would split that key across shards.
    for s in cur.shards.iter().filter(|s| fin.shard(&s.name).is_some()) {
        for (key, counts) in backend.keys_with_work(&s.name)? {
            if has_work(&counts) > 0 && fin_router.route(&key) != s.name {
                return Err(ReshardError::Invalid(format!(
                    "refusing to publish map version {}: key {key:?} has work on shard {:?} but would route to {:?}; rerun rebalance",
                    fin.version,
                    s.name,
                    fin_router.route(&key)
                )));
            }
        }
    }
    if fin.shards != cur.shards || fin.overrides != cur.overrides {
        publish_next(store, &cur, &fin)?;
        cur = fin;
    } else {
        report.nothing_to_do = report.moved.is_empty() && report.from_version == cur.version;
    }
    if !store.clear_target(target)? {
        return Err(ReshardError::LockLost {
            reason: format!(
                "another change recorded a new target while it ran; map version {} is published and the new target stays pending",
                cur.version
            ),
        });
    }
    on_event(RebalanceEvent::Finished {
        version: cur.version,
    });
    report.to_version = cur.version;
    report.elapsed_ms = clock.now_ms().saturating_sub(started_ms) as f64;
    Ok(report)
}
