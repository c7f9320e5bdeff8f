//! Firing schedules: the [`Scheduler`] a worker runs beside its pool, the
//! settings it reads and writes, and the one-off fires (trigger, backfill).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::{
    tick_dedup_id, trigger_dedup_id, Compiled, LastFire, Overlap, Schedule, ScheduleState,
    ScheduleStates, Schedules, BACKFILL_TICKS_MAX, SCHEDULE_RECHECK_MS, SETTING_SCHEDULES,
    SETTING_SCHEDULE_STATE, TICKS_PER_PASS_MAX,
};
use crate::backend::QueueBackend;
use crate::clock::Clock;
use crate::error::QueueError;
use crate::job::{JobId, JobState, NewJob};
use crate::producer::{Placed, ProduceError, Producer, ProducerOptions};
use crate::reshard::{update_setting, MapStore, ReshardError};

/// Longest wait of a pass for a key paused by a move (1 s).
const SCHEDULE_PAUSE_WAIT_MS: u64 = 1_000;
/// Longest wait of a pass for a newer map after a fence (5 s): the
/// others' ticks wait meanwhile.
const SCHEDULE_FENCE_WAIT_MS: u64 = 5_000;
/// How long after a change of its key a schedule starts again (2 s, two
/// re-reads of the list).
pub const KEY_CHANGE_GAP_MS: u64 = 2 * SCHEDULE_RECHECK_MS;

/// Most missed ticks one schedule counts in one pass (a longer outage is
/// counted over the next passes).
const MISSED_PER_PASS_MAX: u64 = 100_000;

/// Reading and changing the two schedule settings of a deployment.
pub struct ScheduleStore;

impl ScheduleStore {
    /// The deployment's schedules (none when unset), as stored (each was
    /// checked when it was; a worker checks them all again when they
    /// change, [`Scheduler::pass`]).
    pub fn load(maps: &dyn MapStore) -> Result<Schedules, ReshardError> {
        match maps.load_setting(SETTING_SCHEDULES)? {
            None => Ok(Schedules::default()),
            Some(text) => Ok(Schedules::read(&text)?),
        }
    }

    /// Edits the schedules atomically against every other writer:
    /// `change` edits the schedules stored now (it may run more than once),
    /// the result is checked and stored. An `Ok` means stored.
    pub fn update<R, E>(
        maps: &dyn MapStore,
        mut change: impl FnMut(&mut Schedules) -> Result<R, E>,
    ) -> Result<R, E>
    where
        E: From<ReshardError> + From<QueueError>,
    {
        update_setting(maps, SETTING_SCHEDULES, |current| {
            let before = match current {
                None => Schedules::default(),
                Some(text) => Schedules::read(text)?,
            };
            let mut s = before.clone();
            let out = change(&mut s)?;
            s.validate_changes(&before)?;
            Ok((s.to_text(), out))
        })
    }

    /// Every schedule's recorded state.
    pub fn states(maps: &dyn MapStore) -> Result<ScheduleStates, ReshardError> {
        match maps.load_setting(SETTING_SCHEDULE_STATE)? {
            None => Ok(ScheduleStates::default()),
            Some(text) => Ok(ScheduleStates::parse(&text)?),
        }
    }

    /// Merges `states` into the stored ones ([`ScheduleState::merge`]: a
    /// schedule's state never moves back). It drops nothing: a writer whose
    /// list of schedules is a second old must not erase the state of one
    /// set since; [`ScheduleStore::delete`] drops a schedule's state.
    pub fn record(
        maps: &dyn MapStore,
        states: &BTreeMap<String, ScheduleState>,
    ) -> Result<(), ReshardError> {
        update_setting(maps, SETTING_SCHEDULE_STATE, |current| {
            let mut all = match current {
                None => ScheduleStates::default(),
                Some(text) => ScheduleStates::parse(text)?,
            };
            for (id, s) in states {
                all.states.entry(id.clone()).or_default().merge(s);
            }
            Ok::<_, ReshardError>((all.to_text(), ()))
        })
    }
}

/// What [`ScheduleStore::apply`] did, by schedule id.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Applied {
    /// Schedules that did not exist.
    pub added: Vec<String>,
    /// Schedules replaced by a different one.
    pub changed: Vec<String>,
    /// Schedules already as asked.
    pub unchanged: Vec<String>,
    /// Schedules deleted because the file did not name them (`prune`).
    pub removed: Vec<String>,
}

/// Checks what a put can check before it reads the stored schedules.
fn check_put(id: &str, s: &Schedule, payload_bytes_max: usize) -> Result<(), QueueError> {
    super::validate_schedule_id(id)?;
    if s.payload.len() > payload_bytes_max {
        return Err(QueueError::InvalidOption {
            name: "payload",
            value: format!("of {} bytes (schedule {id:?})", s.payload.len()),
            allowed: format!("at most {payload_bytes_max} bytes on this deployment"),
        });
    }
    Ok(())
}

/// `s` as it is stored over what `all` holds under `id`: a replaced
/// schedule keeps its pause and its `since_ms`, unless its key changes
/// (then it starts again [`KEY_CHANGE_GAP_MS`] after `now_ms`); a new one
/// starts at `now_ms`.
fn merged(all: &Schedules, id: &str, s: &Schedule, now_ms: u64) -> Schedule {
    let mut new = s.clone();
    match all.schedules.get(id) {
        Some(old) if old.key != new.key => {
            new.since_ms = now_ms.saturating_add(KEY_CHANGE_GAP_MS);
            new.paused = old.paused;
        }
        Some(old) => {
            new.since_ms = old.since_ms;
            new.paused = old.paused;
        }
        None => new.since_ms = now_ms,
    }
    new
}

/// Drops the states of deleted schedules `ids` (a worker that fired one a
/// moment ago may still write its state back; a schedule set again under
/// the id starts after its own set time whatever that state says).
fn drop_states(maps: &dyn MapStore, ids: &[String]) -> Result<(), ReshardError> {
    update_setting(maps, SETTING_SCHEDULE_STATE, |current| {
        let mut all = match current {
            None => ScheduleStates::default(),
            Some(text) => ScheduleStates::parse(text)?,
        };
        for id in ids {
            all.states.remove(id);
        }
        Ok::<_, ReshardError>((all.to_text(), ()))
    })
}

fn unknown(id: &str) -> QueueError {
    QueueError::InvalidOption {
        name: "schedule",
        value: format!("{id:?}"),
        allowed: "the id of one of the deployment's schedules (see `shardq schedule list`)".into(),
    }
}

impl ScheduleStore {
    /// Creates or replaces schedule `id` with `s` (checked). A schedule
    /// replaced keeps its `since_ms` and whether it is paused, so ticks
    /// already due are not lost to an edit; a new one starts at `now_ms`.
    /// The schedule stored.
    ///
    /// A schedule whose key changes starts again [`KEY_CHANGE_GAP_MS`]
    /// after `now_ms`: a worker still holding the old list may fire the
    /// ticks up to then for the old key, and the tick's dedup record, kept
    /// per key, could not stop the new key's owner from firing them too.
    /// A payload over `payload_bytes_max` (the deployment's bound) is
    /// refused, since no tick of it could be stored.
    pub fn put(
        maps: &dyn MapStore,
        id: &str,
        s: &Schedule,
        now_ms: u64,
        payload_bytes_max: usize,
    ) -> Result<Schedule, ReshardError> {
        check_put(id, s, payload_bytes_max)?;
        Self::update(maps, |all| {
            let new = merged(all, id, s, now_ms);
            new.validate(id)?;
            all.schedules.insert(id.to_string(), new.clone());
            Ok::<_, ReshardError>(new)
        })
    }

    /// Sets every schedule of `wanted` in one compare-and-set (as
    /// [`ScheduleStore::put`] sets one: a replaced schedule keeps its
    /// state and pause), and with `prune` deletes every other schedule
    /// and its state: the deployment's schedules become those of a file.
    /// Either all of it is stored or nothing (the first bad schedule is
    /// named); a `dry_run` checks the same and stores nothing. What
    /// changed (or would), by id.
    pub fn apply(
        maps: &dyn MapStore,
        wanted: &BTreeMap<String, Schedule>,
        prune: bool,
        dry_run: bool,
        now_ms: u64,
        payload_bytes_max: usize,
    ) -> Result<Applied, ReshardError> {
        for (id, s) in wanted {
            check_put(id, s, payload_bytes_max)?;
        }
        if dry_run {
            let before = Self::load(maps)?;
            let mut all = before.clone();
            let applied = Self::apply_to(&mut all, wanted, prune, now_ms);
            all.validate_changes(&before)?;
            return Ok(applied);
        }
        let applied = Self::update(maps, |all| {
            Ok::<_, ReshardError>(Self::apply_to(all, wanted, prune, now_ms))
        })?;
        if !applied.removed.is_empty() {
            drop_states(maps, &applied.removed)?;
        }
        Ok(applied)
    }

    /// What [`ScheduleStore::apply`] does to the schedules `all`, in
    /// memory.
    pub fn apply_to(
        all: &mut Schedules,
        wanted: &BTreeMap<String, Schedule>,
        prune: bool,
        now_ms: u64,
    ) -> Applied {
        let mut out = Applied::default();
        for (id, s) in wanted {
            let new = merged(all, id, s, now_ms);
            match all.schedules.get(id) {
                None => out.added.push(id.clone()),
                Some(old) if *old == new => out.unchanged.push(id.clone()),
                Some(_) => out.changed.push(id.clone()),
            }
            all.schedules.insert(id.clone(), new);
        }
        if prune {
            out.removed = all
                .schedules
                .keys()
                .filter(|id| !wanted.contains_key(*id))
                .cloned()
                .collect();
            for id in &out.removed {
                all.schedules.remove(id);
            }
        }
        out
    }

    /// Pauses or resumes schedule `id`. A resumed schedule fires no tick
    /// of its pause (its `since_ms` becomes `now_ms`). The schedule stored.
    pub fn set_paused(
        maps: &dyn MapStore,
        id: &str,
        paused: bool,
        now_ms: u64,
    ) -> Result<Schedule, ReshardError> {
        Self::update(maps, |all| {
            let s = all.schedules.get_mut(id).ok_or_else(|| unknown(id))?;
            if s.paused && !paused {
                s.since_ms = s.since_ms.max(now_ms);
            }
            s.paused = paused;
            Ok::<_, ReshardError>(s.clone())
        })
    }

    /// Deletes schedule `id`; whether it existed.
    pub fn delete(maps: &dyn MapStore, id: &str) -> Result<bool, ReshardError> {
        let existed = Self::update(maps, |all| {
            Ok::<_, ReshardError>(all.schedules.remove(id).is_some())
        })?;
        drop_states(maps, &[id.to_string()])?;
        Ok(existed)
    }

    /// Schedule `id`, or an error naming it.
    pub fn get(maps: &dyn MapStore, id: &str) -> Result<Schedule, ReshardError> {
        Ok(Self::load(maps)?
            .schedules
            .remove(id)
            .ok_or_else(|| unknown(id))?)
    }

    /// The sums over every schedule and its state.
    pub fn totals(maps: &dyn MapStore) -> Result<super::ScheduleTotals, ReshardError> {
        Ok(super::ScheduleTotals::of(
            &Self::load(maps)?,
            &Self::states(maps)?,
        ))
    }

    /// Every schedule with its state and next fire, by id.
    pub fn views(maps: &dyn MapStore) -> Result<Vec<super::ScheduleView>, ReshardError> {
        let all = Self::load(maps)?;
        let mut states = Self::states(maps)?.states;
        let mut out = Vec::with_capacity(all.schedules.len());
        for (id, schedule) in all.schedules {
            let state = states.remove(&id).unwrap_or_default();
            let next_fire_ms = if schedule.paused {
                None
            } else {
                let c = Compiled::new(&id, &schedule)?;
                c.next_after(state.decided_ms.max(schedule.since_ms))
                    .map(|t| t.saturating_add(c.jitter(t)))
            };
            out.push(super::ScheduleView {
                id,
                schedule,
                state,
                next_fire_ms,
            });
        }
        Ok(out)
    }
}

/// Options of a [`Scheduler`].
#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// Time for ticks and waits (a manual clock in simulations).
    pub clock: Arc<dyn Clock>,
}

/// What one [`Scheduler::pass`] did.
#[derive(Debug, Clone, Default)]
pub struct FireReport {
    /// Each stored job: schedule id, tick, where it went.
    pub fired: Vec<(String, u64, Placed)>,
    /// Fires that found their tick's job already stored (another process
    /// fired it first).
    pub duplicates: u64,
    /// Ticks not fired by the overlap policy.
    pub skipped: u64,
    /// Ticks past their catch-up window.
    pub missed: u64,
    /// Schedules whose fire failed this pass, with why (they are tried
    /// again at the next pass; nothing was decided for them).
    pub errors: Vec<(String, String)>,
    /// The earliest fire due among the schedules this process runs.
    pub next_due_ms: Option<u64>,
}

struct Loaded {
    id: String,
    schedule: Schedule,
    compiled: Compiled,
    /// The first tick after a cursor, as last computed: `(cursor, tick)`.
    /// Most passes find nothing due, and a cron tick costs a calendar walk,
    /// so it is worked out once per cursor, not once per pass.
    first: std::cell::Cell<Option<(u64, Option<u64>)>>,
}

impl Loaded {
    fn first_after(&self, cursor: u64) -> Option<u64> {
        match self.first.get() {
            Some((c, tick)) if c == cursor => tick,
            _ => {
                let tick = self.compiled.next_after(cursor);
                self.first.set(Some((cursor, tick)));
                tick
            }
        }
    }
}

/// Fires the schedules whose key routes to a shard this process owns.
pub struct Scheduler {
    maps: Arc<dyn MapStore>,
    backend: Arc<dyn QueueBackend>,
    producer: Producer<dyn QueueBackend>,
    clock: Arc<dyn Clock>,
    text: Option<Option<String>>,
    loaded: Vec<Loaded>,
    /// Each schedule's state as this process knows it: the stored one
    /// merged with its own fires. Its cursor never moves back.
    local: BTreeMap<String, ScheduleState>,
    dirty: BTreeSet<String>,
    checked_ms: Option<u64>,
}

impl Scheduler {
    /// A scheduler over `backend` and the deployment's map store `maps`.
    pub fn new(
        backend: Arc<dyn QueueBackend>,
        maps: Arc<dyn MapStore>,
        opts: SchedulerOptions,
    ) -> Result<Scheduler, ProduceError> {
        let producer = Producer::new(
            Arc::clone(&backend),
            Arc::clone(&maps),
            ProducerOptions {
                clock: Arc::clone(&opts.clock),
                // A key paused by a move holds up this thread's other
                // schedules while it waits: its tick is given up on soon
                // (nothing is decided for it) and fired at a later pass.
                pause_wait_ms: SCHEDULE_PAUSE_WAIT_MS,
                fence_wait_ms: SCHEDULE_FENCE_WAIT_MS,
                ..ProducerOptions::default()
            },
        )?;
        Ok(Scheduler {
            maps,
            backend,
            producer,
            clock: opts.clock,
            text: None,
            loaded: Vec::new(),
            local: BTreeMap::new(),
            dirty: BTreeSet::new(),
            checked_ms: None,
        })
    }

    /// How many schedules are loaded.
    pub fn len(&self) -> usize {
        self.loaded.len()
    }

    /// Whether no schedule is loaded.
    pub fn is_empty(&self) -> bool {
        self.loaded.is_empty()
    }

    /// Reads the schedules (when changed) and every state again, at most
    /// every [`SCHEDULE_RECHECK_MS`] unless `force`.
    fn refresh(
        &mut self,
        now: u64,
        force: bool,
        invalid: &mut Vec<(String, String)>,
    ) -> Result<(), ReshardError> {
        if !force
            && self
                .checked_ms
                .is_some_and(|t| now.saturating_sub(t) < SCHEDULE_RECHECK_MS)
        {
            return Ok(());
        }
        let text = self.maps.load_setting(SETTING_SCHEDULES)?;
        if self.text.as_ref() != Some(&text) {
            let schedules = match &text {
                None => Schedules::default(),
                Some(t) => Schedules::read(t)?,
            };
            // A schedule that does not check (a document edited by hand)
            // is left out and reported; the others run.
            let mut loaded = Vec::with_capacity(schedules.schedules.len());
            for (id, schedule) in schedules.schedules {
                let compiled = match schedule
                    .validate(&id)
                    .and_then(|()| Compiled::new(&id, &schedule))
                {
                    Ok(c) => c,
                    Err(e) => {
                        invalid.push((id, format!("not run: {e}")));
                        continue;
                    }
                };
                loaded.push(Loaded {
                    id,
                    schedule,
                    compiled,
                    first: std::cell::Cell::new(None),
                });
            }
            // A schedule set again (deleted and set, or its key changed)
            // has a new `since_ms`: what this process remembered of the
            // one before is dropped (the stored state is merged below).
            let before: BTreeMap<&str, u64> = (self.loaded.iter())
                .map(|l| (l.id.as_str(), l.schedule.since_ms))
                .collect();
            let keep: BTreeSet<String> = (loaded.iter())
                .filter(|l| {
                    before
                        .get(l.id.as_str())
                        .is_none_or(|&s| s == l.schedule.since_ms)
                })
                .map(|l| l.id.clone())
                .collect();
            self.local.retain(|id, _| keep.contains(id));
            self.loaded = loaded;
            self.text = Some(text);
        }
        for (id, stored) in ScheduleStore::states(&*self.maps)?.states {
            // `loaded` is in id order (read from a map by id).
            if self
                .loaded
                .binary_search_by(|l| l.id.as_str().cmp(id.as_str()))
                .is_ok()
            {
                self.local.entry(id).or_default().merge(&stored);
            }
        }
        self.checked_ms = Some(now);
        Ok(())
    }

    /// Whether the job of `last` is live, and whether it waits (queued or
    /// delayed) rather than runs. A job not found (finished, or moved
    /// away with its key) counts as ended.
    fn previous(&self, last: Option<&LastFire>) -> Result<(bool, bool), QueueError> {
        let Some(last) = last else {
            return Ok((false, false));
        };
        match self.backend.job(&last.shard, JobId(last.job))? {
            Some(info) => match info.state {
                JobState::Queued | JobState::Delayed => Ok((true, true)),
                JobState::Running => Ok((true, false)),
                JobState::Dead => Ok((false, false)),
            },
            None => Ok((false, false)),
        }
    }

    /// One pass: fires every due tick of the schedules whose key routes
    /// to a shard in `owned`, as their overlap policies allow, counts the
    /// ticks past their catch-up window as missed, and records what it
    /// decided. Safe to run in any number of processes at once: a tick's
    /// job is stored once wherever it is fired from.
    pub fn pass(&mut self, owned: &BTreeSet<String>) -> Result<FireReport, ProduceError> {
        let now = self.clock.now_ms();
        let mut report = FireReport::default();
        self.refresh(now, false, &mut report.errors)?;
        let mut plans = Vec::new();
        for i in 0..self.loaded.len() {
            let shard = self.producer.shard_of(&self.loaded[i].schedule.key)?;
            if !owned.contains(&shard) {
                continue;
            }
            match self.plan_one(i, now, &mut report) {
                Ok(Some(plan)) => plans.push(plan),
                Ok(None) => {}
                Err(e) => report
                    .errors
                    .push((self.loaded[i].id.clone(), e.to_string())),
            }
        }
        let stored = self.store_fires(&plans);
        for (plan, outcome) in plans.into_iter().zip(stored) {
            self.finish_one(plan, outcome, now, &mut report);
        }
        if !self.dirty.is_empty() {
            let changed: BTreeMap<String, ScheduleState> = self
                .dirty
                .iter()
                .filter_map(|id| self.local.get(id).map(|s| (id.clone(), s.clone())))
                .collect();
            ScheduleStore::record(&*self.maps, &changed)?;
            self.dirty.clear();
        }
        Ok(report)
    }

    /// What is due for schedule `i` at `now`: the ticks to fire, those
    /// missed and skipped, and the cursor they would move it to; `None`
    /// when nothing is due (the common pass).
    fn plan_one(
        &mut self,
        i: usize,
        now: u64,
        report: &mut FireReport,
    ) -> Result<Option<Plan>, ProduceError> {
        let l = &self.loaded[i];
        if l.schedule.paused {
            return Ok(None);
        }
        let decided_ms = self.local.get(&l.id).map_or(0, |s| s.decided_ms);
        let cursor = decided_ms.max(l.schedule.since_ms);
        // The common pass: the next tick is not due yet, nothing to do.
        match l.first_after(cursor) {
            Some(next) => {
                let fire_at = next.saturating_add(l.compiled.jitter(next));
                if fire_at > now {
                    let at = report.next_due_ms.get_or_insert(fire_at);
                    *at = (*at).min(fire_at);
                    return Ok(None);
                }
            }
            None => return Ok(None),
        }
        let state = self.local.get(&l.id).cloned().unwrap_or_default();
        // The ticks due now: missed ones counted, the others collected.
        let mut missed = 0u64;
        let mut due: Vec<u64> = Vec::new();
        let mut decided = cursor;
        let mut next_tick = l.first_after(cursor);
        while let Some(next) = next_tick.take() {
            let fire_at = next.saturating_add(l.compiled.jitter(next));
            if fire_at > now {
                let at = report.next_due_ms.get_or_insert(fire_at);
                *at = (*at).min(fire_at);
                break;
            }
            next_tick = l.compiled.next_after(next);
            if now > fire_at.saturating_add(l.schedule.catch_up_ms) {
                missed += 1;
                decided = next;
                if missed >= MISSED_PER_PASS_MAX {
                    break;
                }
                continue;
            }
            due.push(next);
            if due.len() >= TICKS_PER_PASS_MAX {
                break;
            }
        }
        let mut skipped = 0u64;
        let fire: Vec<u64> = match l.schedule.overlap {
            Overlap::All => due.clone(),
            Overlap::Skip | Overlap::One if due.is_empty() => Vec::new(),
            policy => {
                let (live, waiting) = self.previous(state.last.as_ref())?;
                let hold = match policy {
                    Overlap::Skip => live,
                    _ => waiting,
                };
                if hold {
                    skipped = due.len() as u64;
                    Vec::new()
                } else {
                    skipped = due.len() as u64 - 1;
                    due.last().copied().into_iter().collect()
                }
            }
        };
        if let Some(&last) = due.last() {
            if fire.is_empty() {
                decided = decided.max(last);
            }
        }
        Ok(Some(Plan {
            i,
            st: state,
            cursor,
            decided,
            missed,
            skipped,
            fire,
        }))
    }

    /// Stores the fires of every plan: the clock read again first (a pass
    /// held up since it planned, by a fence or a stopped process, must not
    /// store a tick past its catch-up, whose dedup record may be gone:
    /// such a tick is left out, and counted missed), then one call per
    /// dedup window (most schedules share one), so the producer sends one
    /// append per shard for all of them rather than one per schedule.
    /// Per plan, each tick's placement (`None`: not stored) or why none.
    fn store_fires(&mut self, plans: &[Plan]) -> Vec<Fired> {
        let late_now = self.clock.now_ms();
        let mut out: Vec<Fired> = plans
            .iter()
            .map(|p| Fired {
                late: Vec::new(),
                placed: vec![None; p.fire.len()],
                error: None,
            })
            .collect();
        let mut by_window: BTreeMap<u64, Vec<(usize, usize)>> = BTreeMap::new();
        for (pi, plan) in plans.iter().enumerate() {
            let l = &self.loaded[plan.i];
            for (ti, &t) in plan.fire.iter().enumerate() {
                let deadline = t
                    .saturating_add(l.compiled.jitter(t))
                    .saturating_add(l.schedule.catch_up_ms);
                if late_now > deadline {
                    out[pi].late.push(ti);
                } else {
                    by_window
                        .entry(l.schedule.dedup_window_ms())
                        .or_default()
                        .push((pi, ti));
                }
            }
        }
        for (window, fires) in by_window {
            self.producer.set_dedup_window_ms(window);
            let refused = self.send_fires(plans, &fires, &mut out);
            // Refused whole (a job the store will not take): each plan on
            // its own, so one schedule cannot hold up the others.
            if refused {
                let mut of_plan: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
                for &(pi, ti) in &fires {
                    of_plan.entry(pi).or_default().push((pi, ti));
                }
                if of_plan.len() > 1 {
                    for one in of_plan.values() {
                        self.send_fires(plans, one, &mut out);
                    }
                }
            }
        }
        out
    }

    /// One enqueue call for `fires` (plan, tick) of `plans`, filling `out`;
    /// whether it was refused with nothing stored.
    fn send_fires(&mut self, plans: &[Plan], fires: &[(usize, usize)], out: &mut [Fired]) -> bool {
        let jobs: Vec<NewJob> = fires
            .iter()
            .map(|&(pi, ti)| {
                let l = &self.loaded[plans[pi].i];
                NewJob {
                    key: l.schedule.key.clone(),
                    payload: l.schedule.payload.clone().into_bytes(),
                    delay_ms: 0,
                    max_attempts: l.schedule.max_attempts,
                    dedup_id: Some(tick_dedup_id(&l.id, plans[pi].fire[ti])),
                    keyed: None,
                }
            })
            .collect();
        let result = self.producer.enqueue_batch(&jobs);
        let error = result.as_ref().err().map(ToString::to_string);
        let placed = match result {
            Ok(placed)
            | Err(
                ProduceError::Partial { placed, .. } | ProduceError::PausedTooLong { placed, .. },
            ) => placed,
            Err(_) => Vec::new(),
        };
        let none = placed.is_empty();
        for p in placed {
            let (pi, ti) = fires[p.index];
            out[pi].placed[ti] = Some(p);
        }
        if let Some(e) = &error {
            for &(pi, ti) in fires {
                if out[pi].placed[ti].is_none() {
                    out[pi].error = Some(e.clone());
                }
            }
        }
        error.is_some() && none
    }

    /// Applies what was stored for `plan` to its schedule's state: the
    /// cursor moves over every tick decided, up to the first tick to fire
    /// that was not stored (a later pass fires it, or counts it missed).
    fn finish_one(&mut self, plan: Plan, fired: Fired, now: u64, report: &mut FireReport) {
        let Plan {
            i,
            mut st,
            cursor,
            mut decided,
            mut missed,
            skipped,
            fire,
        } = plan;
        let id = self.loaded[i].id.clone();
        missed += fired.late.len() as u64;
        let mut first_unstored: Option<u64> = None;
        for (ti, &tick) in fire.iter().enumerate() {
            if fired.late.contains(&ti) {
                decided = decided.max(tick);
                continue;
            }
            match &fired.placed[ti] {
                Some(p) => {
                    if p.duplicate {
                        report.duplicates += 1;
                    } else {
                        st.fired += 1;
                        report.fired.push((id.clone(), tick, p.clone()));
                    }
                    st.last = Some(LastFire {
                        tick_ms: tick,
                        at_ms: now,
                        shard: p.shard.clone(),
                        job: p.id.0,
                    });
                    decided = decided.max(tick);
                }
                None => {
                    first_unstored.get_or_insert(tick);
                }
            }
        }
        if let Some(t) = first_unstored {
            decided = decided.min(t.saturating_sub(1)).max(cursor);
            let why = fired.error.unwrap_or_else(|| "not stored".into());
            report.errors.push((id.clone(), why));
        }
        if decided > st.decided_ms || missed > 0 || skipped > 0 {
            st.decided_ms = st.decided_ms.max(decided);
            st.missed += missed;
            st.skipped += skipped;
            report.missed += missed;
            report.skipped += skipped;
            self.local.insert(id.clone(), st);
            self.dirty.insert(id);
        }
    }
}

/// What a pass decided for one schedule before storing anything.
struct Plan {
    /// The schedule, by its place in the loaded list.
    i: usize,
    /// Its state, to be updated.
    st: ScheduleState,
    /// Its cursor before the pass.
    cursor: u64,
    /// The cursor over the ticks decided without storing (missed,
    /// skipped).
    decided: u64,
    missed: u64,
    skipped: u64,
    /// The ticks to fire, in order.
    fire: Vec<u64>,
}

/// What became of one plan's fires.
struct Fired {
    /// Ticks (by index into the plan's `fire`) left out as past their
    /// catch-up by the time they were to be stored.
    late: Vec<usize>,
    /// Each tick's placement; `None` for one not stored.
    placed: Vec<Option<Placed>>,
    /// Why some tick was not stored.
    error: Option<String>,
}

/// Enqueues one job of schedule `id` now, outside its ticks (a manual
/// trigger): the overlap policy does not apply. Where it went. Sets the
/// producer's dedup window to the schedule's.
pub fn trigger<B: QueueBackend + ?Sized>(
    producer: &mut Producer<B>,
    id: &str,
    s: &Schedule,
    now_ms: u64,
) -> Result<Placed, ProduceError> {
    producer.set_dedup_window_ms(s.dedup_window_ms());
    producer.enqueue(&NewJob {
        key: s.key.clone(),
        payload: s.payload.clone().into_bytes(),
        delay_ms: 0,
        max_attempts: s.max_attempts,
        dedup_id: Some(trigger_dedup_id(id, now_ms)),
        keyed: None,
    })
}

/// Enqueues the job of every tick of schedule `id` in `from_ms..=to_ms`,
/// in order, each with its tick's dedup id: a tick whose job is already
/// stored (fired, or backfilled before, within the schedule's dedup
/// window, [`Schedule::dedup_window_ms`]) is not stored again. At most
/// [`BACKFILL_TICKS_MAX`] ticks. The placements. Sets the producer's
/// dedup window to the schedule's.
pub fn backfill<B: QueueBackend + ?Sized>(
    producer: &mut Producer<B>,
    id: &str,
    s: &Schedule,
    from_ms: u64,
    to_ms: u64,
    now_ms: u64,
) -> Result<Vec<(u64, Placed)>, ProduceError> {
    if to_ms > now_ms {
        return Err(QueueError::InvalidOption {
            name: "backfill end",
            value: format!("{to_ms} ms"),
            allowed: format!(
                "a time in the past (now is {now_ms} ms): the ticks to come fire on their own"
            ),
        }
        .into());
    }
    let compiled = Compiled::new(id, s)?;
    producer.set_dedup_window_ms(s.dedup_window_ms());
    let mut ticks = Vec::new();
    let mut t = from_ms.saturating_sub(1);
    while let Some(next) = compiled.next_after(t) {
        if next > to_ms {
            break;
        }
        if ticks.len() == BACKFILL_TICKS_MAX {
            return Err(QueueError::InvalidOption {
                name: "backfill range",
                value: format!("{from_ms}..={to_ms} ms"),
                allowed: format!("a range of at most {BACKFILL_TICKS_MAX} ticks"),
            }
            .into());
        }
        ticks.push(next);
        t = next;
    }
    let jobs: Vec<NewJob> = ticks
        .iter()
        .map(|&tick| NewJob {
            key: s.key.clone(),
            payload: s.payload.clone().into_bytes(),
            delay_ms: 0,
            max_attempts: s.max_attempts,
            dedup_id: Some(tick_dedup_id(id, tick)),
            keyed: None,
        })
        .collect();
    let mut out = Vec::with_capacity(jobs.len());
    for chunk in jobs.chunks(500) {
        let base = out.len();
        for p in producer.enqueue_batch(chunk)? {
            out.push((ticks[base + p.index], p));
        }
    }
    Ok(out)
}

/// Runs `scheduler` until `stop`: a pass over the shards `owned()` names
/// now, then a sleep until the next fire is due (at most
/// [`SCHEDULE_RECHECK_MS`] / 4, so a changed schedule is read within
/// [`SCHEDULE_RECHECK_MS`]). A failed pass is reported to `on_error` and
/// tried again at the next. `passes` counts the rounds that ended (a pass,
/// when this process owns a shard, and what it recorded).
pub fn run_scheduler(
    mut scheduler: Scheduler,
    owned: &dyn Fn() -> BTreeSet<String>,
    stop: &std::sync::atomic::AtomicBool,
    on_error: &dyn Fn(String),
    passes: &std::sync::atomic::AtomicU64,
) {
    let clock = Arc::clone(&scheduler.clock);
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let mine = owned();
        let mut wait = SCHEDULE_RECHECK_MS / 4;
        if !mine.is_empty() {
            match scheduler.pass(&mine) {
                Ok(r) => {
                    for (id, e) in &r.errors {
                        on_error(format!("schedule {id:?}: {e}"));
                    }
                    if let Some(due) = r.next_due_ms {
                        wait = wait.min(due.saturating_sub(clock.now_ms()));
                    }
                }
                Err(e) => on_error(format!("schedules: {e}")),
            }
        }
        // Counted after the pass recorded what it decided (or failed): a
        // reader that sees the count move past a pass in flight knows it
        // is over.
        passes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        clock.sleep_ms(wait.max(1));
    }
}
