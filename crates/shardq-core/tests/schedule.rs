//! Schedules on the in-memory backend and a manual clock: every tick
//! stores exactly one job whatever fires it, whatever the clock does and
//! wherever its key moves; overlap and catch-up as documented in
//! `shardq_core::schedule`.

use std::collections::BTreeSet;
use std::sync::Arc;

use shardq_core::memory::{MemoryBackend, MemoryMapStore};
use shardq_core::reshard::{self, MapStore, RebalanceOptions, ReshardError};
use shardq_core::schedule::{
    tick_dedup_id, Overlap, Schedule, ScheduleStore, Scheduler, SchedulerOptions, When,
    SCHEDULE_DEDUP_MARGIN_MS, SETTING_SCHEDULE_STATE,
};
use shardq_core::{Clock, InspectJobs, ManualClock, NewJob, RunJobs};
use shardq_route::{Algorithm, ShardMap};

const T0: u64 = 1_800_000_000_000;

struct World {
    clock: Arc<ManualClock>,
    backend: Arc<MemoryBackend>,
    maps: Arc<MemoryMapStore>,
}

fn world() -> World {
    let clock = Arc::new(ManualClock::new(T0));
    let backend = Arc::new(MemoryBackend::new(&["a", "b"], clock.clone()));
    let maps = Arc::new(MemoryMapStore::new(
        ShardMap::with_shards(Algorithm::Jump, ["a", "b"]).unwrap(),
    ));
    World {
        clock,
        backend,
        maps,
    }
}

fn every(key: &str, every_ms: u64, overlap: Overlap, catch_up_ms: u64) -> Schedule {
    Schedule {
        key: key.into(),
        when: When::Every { every_ms },
        payload: "tick".into(),
        overlap,
        catch_up_ms,
        jitter_ms: 0,
        start_ms: None,
        end_ms: None,
        max_attempts: 3,
        paused: false,
        since_ms: T0,
    }
}

fn set(w: &World, id: &str, s: Schedule) {
    ScheduleStore::update(&*w.maps, |all| {
        all.schedules.insert(id.to_string(), s.clone());
        Ok::<_, ReshardError>(())
    })
    .unwrap();
}

fn scheduler(w: &World) -> Scheduler {
    Scheduler::new(
        w.backend.clone(),
        w.maps.clone(),
        SchedulerOptions {
            clock: w.clock.clone(),
        },
    )
    .unwrap()
}

fn owned(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// Jobs of `key` on every shard (queued, delayed, running or dead).
fn jobs_of(w: &World, key: &str) -> u64 {
    ["a", "b"]
        .iter()
        .map(|s| {
            let c = w.backend.key_counts(s, key).unwrap();
            c.depth + c.in_flight + c.dead
        })
        .sum()
}

/// Whether tick `t`'s job of schedule `id` is stored: a fire of it now is
/// a duplicate.
fn stored(w: &World, id: &str, key: &str, t: u64) -> bool {
    let shard = shardq_route::Router::new(w.maps.load().unwrap())
        .unwrap()
        .route(key)
        .to_string();
    let version = w.maps.load().unwrap().version;
    let out = w
        .backend
        .enqueue_dedup(
            &shard,
            version,
            &[NewJob::new(key, "probe").with_dedup_id(tick_dedup_id(id, t))],
            60_000 + SCHEDULE_DEDUP_MARGIN_MS,
        )
        .unwrap();
    out[0].duplicate
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Three schedulers fire one schedule while its key is pinned back and
/// forth between two shards (each move a full rebalance), one of them
/// restarts with no memory, the recorded state is put back to an older
/// copy, and the clock steps back and forward. Invariant: the ticks that
/// stored a job are exactly the ticks up to the latest time a pass saw,
/// each once.
#[test]
fn every_tick_stores_one_job_through_moves_restarts_old_state_and_clock_steps() {
    for seed in 1..=12u64 {
        let w = world();
        set(&w, "s1", every("tenant-7", 1_000, Overlap::All, 60_000));
        let mut rng = Rng(0x9E37_79B9 ^ seed.wrapping_mul(0x1234_5678_9ABC));
        // A owns a, B owns b, C believes it owns both (a stale owner).
        let mut a = scheduler(&w);
        let mut b = scheduler(&w);
        let mut c = scheduler(&w);
        let mut snapshot: Option<String> = None;
        let mut latest = T0;
        let mut pinned_to = "a";
        for _ in 0..150 {
            match rng.below(10) {
                0 => w
                    .clock
                    .set(w.clock.now_ms().saturating_sub(rng.below(20_000))),
                _ => w.clock.advance(rng.below(1_500)),
            }
            match rng.below(12) {
                0 => a = scheduler(&w),
                1 => snapshot = w.maps.load_setting(SETTING_SCHEDULE_STATE).unwrap(),
                2 => {
                    let now = w.maps.load_setting(SETTING_SCHEDULE_STATE).unwrap();
                    let _ = w.maps.swap_setting(
                        SETTING_SCHEDULE_STATE,
                        now.as_deref(),
                        snapshot.as_deref(),
                    );
                    a = scheduler(&w);
                    b = scheduler(&w);
                }
                3 | 4 => {
                    pinned_to = if pinned_to == "a" { "b" } else { "a" };
                    reshard::pin(&*w.maps, "tenant-7", pinned_to).unwrap();
                    reshard::rebalance(
                        &*w.backend,
                        &*w.maps,
                        &RebalanceOptions::default(),
                        &mut |_| {},
                    )
                    .unwrap();
                }
                _ => {}
            }
            let mut order = [0, 1, 2];
            order.swap(0, rng.below(3) as usize);
            for who in order {
                match who {
                    0 => a.pass(&owned(&["a"])).unwrap(),
                    1 => b.pass(&owned(&["b"])).unwrap(),
                    _ => c.pass(&owned(&["a", "b"])).unwrap(),
                };
            }
            latest = latest.max(w.clock.now_ms());
        }
        let expected = (latest - T0) / 1_000;
        assert_eq!(jobs_of(&w, "tenant-7"), expected, "seed {seed}");
        for n in 1..=expected {
            assert!(
                stored(&w, "s1", "tenant-7", T0 + n * 1_000),
                "seed {seed} tick {n}"
            );
        }
    }
}

#[test]
fn ticks_past_the_catch_up_window_are_counted_missed_and_the_rest_fire() {
    let w = world();
    set(&w, "all", every("k-all", 1_000, Overlap::All, 10_000));
    set(&w, "skip", every("k-skip", 1_000, Overlap::Skip, 10_000));
    let mut s = scheduler(&w);
    w.clock.advance(60_000);
    let r = s.pass(&owned(&["a", "b"])).unwrap();
    // 60 ticks due: 49 are more than 10 s late; 11 (10 s late or less)
    // fire (all), or the newest fires and 10 are skipped (skip).
    assert_eq!(jobs_of(&w, "k-all"), 11);
    assert_eq!(jobs_of(&w, "k-skip"), 1);
    assert_eq!(r.missed, 98);
    assert_eq!(r.skipped, 10);
    let states = ScheduleStore::states(&*w.maps).unwrap().states;
    assert_eq!(states["all"].missed, 49);
    assert_eq!(states["all"].fired, 11);
    assert_eq!(states["skip"].skipped, 10);
    assert_eq!(states["skip"].decided_ms, T0 + 60_000);
    // A new process decides nothing twice.
    let mut again = scheduler(&w);
    let r = again.pass(&owned(&["a", "b"])).unwrap();
    assert!(
        r.fired.is_empty() && r.missed == 0 && r.duplicates == 0,
        "{r:?}"
    );
}

#[test]
fn overlap_skip_waits_for_the_previous_job_and_one_keeps_one_waiting() {
    let w = world();
    set(&w, "skip", every("k-skip", 1_000, Overlap::Skip, 60_000));
    set(&w, "one", every("k-one", 1_000, Overlap::One, 60_000));
    let all = owned(&["a", "b"]);
    let shard_of = |key: &str| {
        shardq_route::Router::new(w.maps.load().unwrap())
            .unwrap()
            .route(key)
            .to_string()
    };
    let mut s = scheduler(&w);
    w.clock.advance(1_000);
    s.pass(&all).unwrap();
    assert_eq!((jobs_of(&w, "k-skip"), jobs_of(&w, "k-one")), (1, 1));
    // Both first jobs wait: neither schedule fires.
    w.clock.advance(1_000);
    s.pass(&all).unwrap();
    assert_eq!((jobs_of(&w, "k-skip"), jobs_of(&w, "k-one")), (1, 1));
    // Both start running: `one` queues one more, `skip` still waits.
    let runs: Vec<_> = ["k-skip", "k-one"]
        .iter()
        .flat_map(|k| w.backend.claim(&shard_of(k), 10, 30_000).unwrap())
        .collect();
    assert_eq!(runs.len(), 2);
    w.clock.advance(1_000);
    s.pass(&all).unwrap();
    assert_eq!((jobs_of(&w, "k-skip"), jobs_of(&w, "k-one")), (1, 2));
    // `one` keeps one waiting, however many ticks pass.
    w.clock.advance(3_000);
    s.pass(&all).unwrap();
    assert_eq!(jobs_of(&w, "k-one"), 2);
    // The runs end: each fires at its next tick.
    for r in runs {
        w.backend.ack(&r.shard, &[r.receipt()]).unwrap();
    }
    w.clock.advance(1_000);
    s.pass(&all).unwrap();
    assert_eq!(
        jobs_of(&w, "k-skip"),
        1,
        "the ended job is gone, the new one waits"
    );
    assert_eq!(
        jobs_of(&w, "k-one"),
        1,
        "the waiting one still waits: no new one"
    );
}

#[test]
fn a_paused_schedule_fires_nothing_and_resuming_fires_no_past_tick() {
    let w = world();
    let mut sch = every("k", 1_000, Overlap::All, 60_000);
    sch.paused = true;
    set(&w, "p", sch.clone());
    let mut s = scheduler(&w);
    w.clock.advance(5_000);
    s.pass(&owned(&["a", "b"])).unwrap();
    assert_eq!(jobs_of(&w, "k"), 0);
    sch.paused = false;
    sch.since_ms = w.clock.now_ms();
    set(&w, "p", sch);
    w.clock.advance(2_000);
    let r = s.pass(&owned(&["a", "b"])).unwrap();
    assert_eq!(jobs_of(&w, "k"), 2, "{r:?}");
    assert_eq!(r.missed, 0);
}

#[test]
fn more_schedules_than_the_bound_are_refused_and_nothing_is_stored() {
    use shardq_core::schedule::SCHEDULES_MAX;
    let w = world();
    let err = ScheduleStore::update(&*w.maps, |all| {
        for i in 0..=SCHEDULES_MAX {
            all.schedules.insert(
                format!("s-{i}"),
                every(&format!("k-{i}"), 60_000, Overlap::All, 60_000),
            );
        }
        Ok::<_, ReshardError>(())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains(&format!("invalid schedules {}", SCHEDULES_MAX + 1)),
        "{err}"
    );
    assert!(ScheduleStore::load(&*w.maps).unwrap().schedules.is_empty());
    // At the bound it is taken.
    ScheduleStore::update(&*w.maps, |all| {
        for i in 0..SCHEDULES_MAX {
            all.schedules.insert(
                format!("s-{i}"),
                every(&format!("k-{i}"), 60_000, Overlap::All, 60_000),
            );
        }
        Ok::<_, ReshardError>(())
    })
    .unwrap();
    assert_eq!(
        ScheduleStore::load(&*w.maps).unwrap().schedules.len(),
        SCHEDULES_MAX
    );
}

#[test]
fn a_schedule_edited_by_hand_into_nonsense_is_reported_and_the_others_run() {
    use shardq_core::schedule::SETTING_SCHEDULES;
    let w = world();
    set(&w, "good", every("k-good", 1_000, Overlap::All, 60_000));
    set(&w, "bad", every("k-bad", 2_000, Overlap::All, 60_000));
    let text = w.maps.load_setting(SETTING_SCHEDULES).unwrap().unwrap();
    let edited = text.replace("\"every_ms\":2000", "\"every_ms\":20");
    assert_ne!(edited, text);
    assert!(w
        .maps
        .swap_setting(SETTING_SCHEDULES, Some(&text), Some(&edited))
        .unwrap());
    let mut s = scheduler(&w);
    w.clock.advance(3_000);
    let r = s.pass(&owned(&["a", "b"])).unwrap();
    assert_eq!(jobs_of(&w, "k-good"), 3);
    assert_eq!(jobs_of(&w, "k-bad"), 0);
    assert_eq!(r.errors.len(), 1, "{r:?}");
    assert!(
        r.errors[0].0 == "bad" && r.errors[0].1.contains("invalid every 20 ms"),
        "{r:?}"
    );
}

#[test]
fn a_writer_with_a_stale_list_keeps_a_new_schedules_state_and_delete_drops_it() {
    let w = world();
    // Ticks at T0 + 500, T0 + 1500, ...
    let mut old = every("k-old", 1_000, Overlap::All, 60_000);
    old.start_ms = Some(T0 + 500);
    set(&w, "old", old);
    let all = owned(&["a", "b"]);
    let mut stale = scheduler(&w);
    w.clock.advance(1_000);
    stale.pass(&all).unwrap();
    // Set after `stale` read the list (it reads it again only after 1 s),
    // and fired at once by another process.
    set(&w, "new", every("k-new", 1_000, Overlap::All, 60_000));
    scheduler(&w).pass(&all).unwrap();
    assert_eq!(
        ScheduleStore::states(&*w.maps).unwrap().states["new"].fired,
        1
    );
    // `stale` fires its own tick and records its state, list unread.
    w.clock.advance(500);
    let r = stale.pass(&all).unwrap();
    assert_eq!(r.fired.len(), 1, "{r:?}");
    let states = ScheduleStore::states(&*w.maps).unwrap().states;
    assert!(
        states.contains_key("new"),
        "the stale writer erased it: {states:?}"
    );
    assert!(ScheduleStore::delete(&*w.maps, "new").unwrap());
    assert!(!ScheduleStore::states(&*w.maps)
        .unwrap()
        .states
        .contains_key("new"));
}

/// A schedule whose every fire is refused by the store (a payload over the
/// backend's bound, set behind the checks) still counts the ticks that
/// pass their catch-up as missed: none is dropped silently.
#[test]
fn ticks_that_cannot_be_stored_are_counted_missed_once_past_catch_up() {
    let w = world();
    let mut big = every("k-big", 1_000, Overlap::All, 10_000);
    big.payload = "x".repeat(shardq_core::PAYLOAD_BYTES_MAX_DEFAULT + 1);
    set(&w, "big", big);
    let mut s = scheduler(&w);
    w.clock.advance(30_000);
    let r = s.pass(&owned(&["a", "b"])).unwrap();
    assert_eq!(r.errors.len(), 1, "{r:?}");
    assert!(r.errors[0].1.contains("payload"), "{r:?}");
    assert_eq!(jobs_of(&w, "k-big"), 0);
    // Ticks 1..=19 were more than 10 s late: missed, recorded.
    let st = &ScheduleStore::states(&*w.maps).unwrap().states["big"];
    assert_eq!((st.missed, st.fired), (19, 0), "{st:?}");
    w.clock.advance(5_000);
    s.pass(&owned(&["a", "b"])).unwrap();
    let st = &ScheduleStore::states(&*w.maps).unwrap().states["big"];
    assert_eq!(st.missed, 24, "{st:?}");
}

/// A pass held up past a tick's catch-up between reading the clock and
/// storing (a stalled process: here the map read takes 20 minutes) does
/// not fire that tick, whose dedup record may be gone: it is missed.
#[test]
fn a_pass_stalled_past_the_catch_up_fires_nothing_late() {
    let clock = Arc::new(ManualClock::new(T0));
    let backend = Arc::new(MemoryBackend::new(&["a", "b"], clock.clone()));
    let inner = MemoryMapStore::new(ShardMap::with_shards(Algorithm::Jump, ["a", "b"]).unwrap());
    let stall = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (c, st) = (clock.clone(), stall.clone());
    let maps = Arc::new(
        shardq_testkit::maps::HookedMaps::new(inner).on_load(move |inner| {
            if st.swap(false, std::sync::atomic::Ordering::SeqCst) {
                c.advance(20 * 60_000);
            }
            inner.load()
        }),
    );
    ScheduleStore::update(&*maps, |all| {
        all.schedules
            .insert("s".into(), every("k", 1_000, Overlap::All, 60_000));
        Ok::<_, ReshardError>(())
    })
    .unwrap();
    let mut s = Scheduler::new(
        backend.clone(),
        maps.clone(),
        SchedulerOptions {
            clock: clock.clone(),
        },
    )
    .unwrap();
    clock.advance(5_000);
    stall.store(true, std::sync::atomic::Ordering::SeqCst);
    let r = s.pass(&owned(&["a", "b"])).unwrap();
    assert!(r.fired.is_empty(), "{r:?}");
    let c: u64 = ["a", "b"]
        .iter()
        .map(|sh| backend.key_counts(sh, "k").unwrap().depth)
        .sum();
    assert_eq!(c, 0);
    assert_eq!(ScheduleStore::states(&*maps).unwrap().states["s"].missed, 5);
}

#[test]
fn a_changed_key_starts_after_a_gap_and_a_backfill_of_the_future_is_refused() {
    use shardq_core::schedule::KEY_CHANGE_GAP_MS;
    let w = world();
    let now = w.clock.now_ms();
    let s1 = ScheduleStore::put(
        &*w.maps,
        "s",
        &every("k1", 1_000, Overlap::All, 60_000),
        now,
        1024,
    )
    .unwrap();
    assert_eq!(s1.since_ms, now);
    w.clock.advance(10_000);
    let now = w.clock.now_ms();
    let same = ScheduleStore::put(
        &*w.maps,
        "s",
        &every("k1", 1_000, Overlap::One, 60_000),
        now,
        1024,
    )
    .unwrap();
    assert_eq!(
        same.since_ms, s1.since_ms,
        "an edit keeps the ticks already due"
    );
    let moved = ScheduleStore::put(
        &*w.maps,
        "s",
        &every("k2", 1_000, Overlap::One, 60_000),
        now,
        1024,
    )
    .unwrap();
    assert_eq!(moved.since_ms, now + KEY_CHANGE_GAP_MS);
    let big = every("k3", 1_000, Overlap::All, 60_000);
    let mut big = big;
    big.payload = "x".repeat(2048);
    let err = ScheduleStore::put(&*w.maps, "b", &big, now, 1024)
        .unwrap_err()
        .to_string();
    assert!(err.contains("invalid payload of 2048 bytes"), "{err}");
    let mut p = shardq_core::producer::Producer::new(
        w.backend.clone(),
        w.maps.clone(),
        shardq_core::producer::ProducerOptions::default(),
    )
    .unwrap();
    let err = shardq_core::schedule::backfill(&mut p, "s", &moved, now - 5_000, now + 5_000, now)
        .unwrap_err()
        .to_string();
    assert!(err.contains("invalid backfill end"), "{err}");
}

/// Fires of one pass go to the store together; one the store refuses (an
/// oversized payload, set behind the checks) does not hold up the others.
#[test]
fn one_schedule_the_store_refuses_does_not_hold_up_the_others() {
    let w = world();
    let mut big = every("k-big", 1_000, Overlap::All, 60_000);
    big.payload = "x".repeat(shardq_core::PAYLOAD_BYTES_MAX_DEFAULT + 1);
    set(&w, "big", big);
    for i in 0..5 {
        set(
            &w,
            &format!("ok-{i}"),
            every(&format!("k-{i}"), 1_000, Overlap::All, 60_000),
        );
    }
    let mut s = scheduler(&w);
    w.clock.advance(3_000);
    let r = s.pass(&owned(&["a", "b"])).unwrap();
    assert_eq!(r.fired.len(), 15, "{r:?}");
    for i in 0..5 {
        assert_eq!(jobs_of(&w, &format!("k-{i}")), 3);
    }
    assert_eq!(jobs_of(&w, "k-big"), 0);
    assert_eq!(r.errors.len(), 1, "{r:?}");
    assert_eq!(r.errors[0].0, "big");
}

/// `apply` sets a whole file in one change: a replaced schedule keeps its
/// pause and its start, an unchanged one is reported so, `prune` deletes
/// the others with their state, a bad schedule anywhere stores nothing,
/// and applies racing puts from other threads lose none of them.
#[test]
fn apply_sets_a_file_in_one_change_and_loses_no_racing_change() {
    use std::collections::BTreeMap;
    let w = world();
    let all = owned(&["a", "b"]);
    set(&w, "old", every("k-old", 1_000, Overlap::All, 60_000));
    w.clock.advance(1_000);
    scheduler(&w).pass(&all).unwrap();
    assert!(ScheduleStore::states(&*w.maps)
        .unwrap()
        .states
        .contains_key("old"));
    ScheduleStore::set_paused(&*w.maps, "kept", true, T0).unwrap_err();
    let mut file: BTreeMap<String, Schedule> = BTreeMap::new();
    file.insert("kept".into(), every("k1", 5_000, Overlap::Skip, 60_000));
    file.insert("other".into(), every("k2", 5_000, Overlap::Skip, 60_000));
    let now = w.clock.now_ms();
    let a = ScheduleStore::apply(&*w.maps, &file, false, false, now, 1 << 20).unwrap();
    assert_eq!(
        (a.added.len(), a.changed.len(), a.removed.len()),
        (2, 0, 0),
        "{a:?}"
    );
    ScheduleStore::set_paused(&*w.maps, "kept", true, now).unwrap();
    // The same file again: unchanged, still paused, same start.
    w.clock.advance(10_000);
    let a = ScheduleStore::apply(&*w.maps, &file, false, false, w.clock.now_ms(), 1 << 20).unwrap();
    assert_eq!(a.unchanged.len(), 2, "{a:?}");
    let kept = ScheduleStore::get(&*w.maps, "kept").unwrap();
    assert!(kept.paused && kept.since_ms == now, "{kept:?}");
    // A dry run with prune says what it would delete and deletes nothing.
    let dry = ScheduleStore::apply(&*w.maps, &file, true, true, w.clock.now_ms(), 1 << 20).unwrap();
    assert_eq!(dry.removed, vec!["old".to_string()]);
    assert!(ScheduleStore::get(&*w.maps, "old").is_ok());
    // A bad schedule (payload over the bound) stores nothing of the file.
    let mut bad = file.clone();
    bad.get_mut("other").unwrap().payload = "x".repeat(100);
    bad.insert("new".into(), every("k3", 5_000, Overlap::Skip, 60_000));
    let err = ScheduleStore::apply(&*w.maps, &bad, true, false, w.clock.now_ms(), 10).unwrap_err();
    assert!(err.to_string().contains("\"other\""), "{err}");
    assert!(
        ScheduleStore::get(&*w.maps, "new").is_err() && ScheduleStore::get(&*w.maps, "old").is_ok()
    );
    // Prune: "old" and its state go; a changed schedule is reported.
    file.get_mut("other").unwrap().payload = "v2".into();
    let a = ScheduleStore::apply(&*w.maps, &file, true, false, w.clock.now_ms(), 1 << 20).unwrap();
    assert_eq!(
        (a.changed.clone(), a.removed.clone()),
        (vec!["other".to_string()], vec!["old".to_string()])
    );
    assert!(!ScheduleStore::states(&*w.maps)
        .unwrap()
        .states
        .contains_key("old"));
    // Racing writers: 4 threads apply files of their own ids while 4 put
    // single ones; every change each was told was stored is there.
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let maps = w.maps.clone();
            std::thread::spawn(move || {
                for i in 0..10 {
                    let id = format!("t{t}-{i}");
                    let s = every(&format!("k{t}"), 5_000, Overlap::Skip, 60_000);
                    if t % 2 == 0 {
                        let one = BTreeMap::from([(id, s)]);
                        ScheduleStore::apply(&*maps, &one, false, false, T0, 1 << 20).unwrap();
                    } else {
                        ScheduleStore::put(&*maps, &id, &s, T0, 1 << 20).unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stored = ScheduleStore::load(&*w.maps).unwrap();
    for t in 0..8 {
        for i in 0..10 {
            assert!(
                stored.schedules.contains_key(&format!("t{t}-{i}")),
                "t{t}-{i} lost"
            );
        }
    }
}
