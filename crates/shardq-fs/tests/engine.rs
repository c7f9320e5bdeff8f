//! Engine tests in one process: per-key order, retries, dead letters, torn
//! tails, corruption and repair, failed fsyncs, fencing, compaction, leases
//! with a manual clock, and the shared pool limit.

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use shardq_core::{
    Coordinator, DeadPolicy, FailOutcome, Fence, InspectJobs, ManualClock, MoveKeys, NewJob,
    PoolOptions, QueueError, Receipt, RunJobs,
};
use shardq_fs::storage::{list_segments, FaultyStorage};
use shardq_fs::{Engine, EngineOptions, FsCoordinator, FsError, MemberOptions};

mod support;

use support::{data_dir_n, job, member, opts, wait_for};

/// Job lease used by direct claims in these tests.
const LEASE_MS: u64 = shardq_core::JOB_LEASE_MS_DEFAULT;

fn ids(jobs: &[shardq_core::ClaimedJob]) -> Vec<String> {
    jobs.iter()
        .map(|j| String::from_utf8_lossy(&j.payload).into_owned())
        .collect()
}

#[test]
fn key_order_retries_first_and_no_head_of_line_blocking() {
    let dir = data_dir_n("order", 1);
    let clock = ManualClock::new(1_000_000);
    let engine = Engine::open(&dir, opts(&clock)).unwrap();
    let b = engine.backend();
    b.enqueue(
        "shard-0",
        1,
        &[job("a", "a1", 3), job("a", "a2", 3), job("b", "b1", 3)],
    )
    .unwrap();
    assert!(matches!(
        b.claim("shard-0", 10, LEASE_MS),
        Err(QueueError::NotOwner { .. })
    ));
    b.adopt("shard-0").unwrap();

    let first = b.claim("shard-0", 10, LEASE_MS).unwrap();
    assert_eq!(ids(&first), ["a1", "b1"], "one job per key in flight");
    assert_eq!(b.key_counts("shard-0", "a").unwrap().depth, 1);
    assert_eq!(b.key_counts("shard-0", "a").unwrap().in_flight, 1);
    let out = b.fail("shard-0", first[0].receipt(), "boom", None).unwrap();
    assert_eq!(out, FailOutcome::Retry { at_ms: 1_000_100 });
    b.ack("shard-0", &[first[1].receipt()]).unwrap();
    // a2 waits behind the failed a1; b keeps flowing.
    b.enqueue("shard-0", 1, &[job("b", "b2", 3)]).unwrap();
    assert_eq!(ids(&b.claim("shard-0", 10, LEASE_MS).unwrap()), ["b2"]);
    clock.advance(100);
    let retry = b.claim("shard-0", 10, LEASE_MS).unwrap();
    assert_eq!(ids(&retry), ["a1"]);
    assert_eq!(retry[0].attempt, 2);
    b.ack("shard-0", &[retry[0].receipt()]).unwrap();
    assert_eq!(ids(&b.claim("shard-0", 10, LEASE_MS).unwrap()), ["a2"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dead_letter_continue_and_halt() {
    for policy in [DeadPolicy::Continue, DeadPolicy::Halt] {
        let dir = data_dir_n(&format!("dead-{policy:?}"), 1);
        let clock = ManualClock::new(1_000_000);
        let engine = Engine::open(
            &dir,
            EngineOptions {
                dead_policy: policy,
                ..opts(&clock)
            },
        )
        .unwrap();
        let b = engine.backend();
        b.enqueue("shard-0", 1, &[job("k", "k1", 1), job("k", "k2", 1)])
            .unwrap();
        b.adopt("shard-0").unwrap();
        let c = b.claim("shard-0", 10, LEASE_MS).unwrap();
        assert_eq!(
            b.fail("shard-0", c[0].receipt(), "bad", None).unwrap(),
            FailOutcome::Dead
        );
        let next = b.claim("shard-0", 10, LEASE_MS).unwrap();
        let dead = b.dead_list("shard-0", 10).unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(
            (dead[0].key.as_str(), dead[0].reason.as_str()),
            ("k", "bad")
        );
        match policy {
            DeadPolicy::Continue => assert_eq!(ids(&next), ["k2"]),
            _ => {
                assert!(next.is_empty(), "a halted key must not run");
                assert_eq!(b.dead_retry("shard-0", None).unwrap(), 1);
                let again = b.claim("shard-0", 10, LEASE_MS).unwrap();
                assert_eq!(ids(&again), ["k1"]);
                assert_eq!(again[0].attempt, 1, "retry resets attempts");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn only_segment(dir: &Path, shard: &str) -> PathBuf {
    let sdir = dir.join(shard);
    let bases = list_segments(&sdir).unwrap();
    sdir.join(shardq_fs::storage::segment_name(*bases.last().unwrap()))
}

#[test]
fn torn_tail_is_truncated_and_appends_continue() {
    let dir = data_dir_n("torn", 1);
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    for i in 0..3 {
        engine.enqueue(NewJob::new("k", format!("p{i}"))).unwrap();
    }
    drop(engine);
    let seg = only_segment(&dir, "shard-0");
    let len = std::fs::metadata(&seg).unwrap().len();
    // Half a record: a length that runs past the end, then some bytes.
    let mut f = OpenOptions::new().append(true).open(&seg).unwrap();
    f.write_all(&[40, 0, 0, 0, 1, 2, 3, 4, 1, 9, 9]).unwrap();
    drop(f);

    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert_eq!(engine.status().unwrap().totals.ready, 3);
    engine.enqueue(NewJob::new("k", "p3")).unwrap();
    assert_eq!(engine.status().unwrap().totals.ready, 4);
    assert!(engine.backend().torn_bytes_truncated("shard-0").unwrap() > 0);
    assert!(std::fs::metadata(&seg).unwrap().len() > len);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mid_file_corruption_is_reported_until_repaired() {
    let dir = data_dir_n("corrupt", 1);
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    let (_, second) = {
        engine.enqueue(NewJob::new("k", "first")).unwrap();
        let s = engine.enqueue(NewJob::new("k", "second")).unwrap();
        engine.enqueue(NewJob::new("k", "third")).unwrap();
        s
    };
    drop(engine);
    let seg = only_segment(&dir, "shard-0");
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[second.0 as usize + 20] ^= 0xff;
    std::fs::write(&seg, &bytes).unwrap();

    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    let err = engine.status().unwrap_err().to_string();
    assert!(
        err.contains("shard-0") && err.contains(&format!("offset {}", second.0)),
        "{err}"
    );
    assert!(
        err.contains("checksum") && err.contains("shardq repair"),
        "{err}"
    );
    let err = engine.enqueue(NewJob::new("k", "more")).unwrap_err();
    assert!(
        matches!(err, FsError::Queue(QueueError::Corrupt { .. })),
        "{err}"
    );
    drop(engine);

    let report = shardq_fs::repair::repair(&dir, "shard-0").unwrap();
    assert_eq!(report.cuts.len(), 1);
    assert_eq!(report.cuts[0].offset, second.0);
    assert!(report.cuts[0].saved_to.exists());
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert_eq!(
        engine.status().unwrap().totals.ready,
        2,
        "only the cut job is lost"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn failed_fsync_refuses_work_until_reopened() {
    let dir = data_dir_n("fsync", 1);
    let faulty = FaultyStorage::default();
    let engine = Engine::open(
        &dir,
        EngineOptions {
            storage: Arc::new(faulty.clone()),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    engine.enqueue(NewJob::new("k", "ok")).unwrap();
    faulty.fail_syncs.store(true, Ordering::SeqCst);
    assert!(engine.enqueue(NewJob::new("k", "lost?")).is_err());
    faulty.fail_syncs.store(false, Ordering::SeqCst);
    let err = engine.enqueue(NewJob::new("k", "after")).unwrap_err();
    assert!(
        matches!(err, FsError::Queue(QueueError::Poisoned { .. })),
        "{err}"
    );
    drop(engine);
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    engine.enqueue(NewJob::new("k", "reopened")).unwrap();

    faulty.fail_appends.store(true, Ordering::SeqCst);
    let engine2 = Engine::open(
        &dir,
        EngineOptions {
            storage: Arc::new(faulty.clone()),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    assert!(engine2.enqueue(NewJob::new("k", "half")).is_err());
    faulty.fail_appends.store(false, Ordering::SeqCst);
    assert!(
        engine2.enqueue(NewJob::new("k", "x")).is_err(),
        "still poisoned"
    );
    // The half-written record never became visible.
    assert_eq!(engine.status().unwrap().totals.ready, 3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fence_refuses_stale_versions_and_paused_keys() {
    let dir = data_dir_n("fence", 1);
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    let b = engine.backend();
    let mut fence = Fence {
        map_version_min: 2,
        ..Fence::default()
    };
    b.set_fence("shard-0", &fence).unwrap();
    assert!(matches!(
        b.enqueue("shard-0", 1, &[NewJob::new("k", "")]),
        Err(QueueError::Fenced { .. })
    ));
    // The engine reloads the map and waits (bounded) for a newer one, then
    // reports the fence.
    engine
        .set_producer_options(shardq_core::producer::ProducerOptions {
            fence_wait_ms: 50,
            ..Default::default()
        })
        .unwrap();
    let err = engine
        .enqueue(NewJob::new("k", ""))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("refuses map version 1") && err.contains("NOT enqueued"),
        "{err}"
    );
    fence.paused_keys.insert("moving".into());
    b.set_fence("shard-0", &fence).unwrap();
    assert!(matches!(
        b.enqueue("shard-0", 2, &[NewJob::new("moving", "")]),
        Err(QueueError::Paused { .. })
    ));
    b.enqueue("shard-0", 2, &[NewJob::new("other", "")])
        .unwrap();
    assert_eq!(b.fence("shard-0").unwrap(), fence);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn finished_segments_are_deleted() {
    let dir = data_dir_n("compact", 1);
    let clock = ManualClock::new(1_000_000);
    let engine = Engine::open(
        &dir,
        EngineOptions {
            segment_bytes_max: 4096,
            durability: shardq_fs::Durability::None,
            ..opts(&clock)
        },
    )
    .unwrap();
    let b = engine.backend();
    b.adopt("shard-0").unwrap();
    let mut max_segments = 0;
    for round in 0..200 {
        let jobs: Vec<NewJob> = (0..10)
            .map(|i| NewJob::new(format!("k{i}"), vec![round as u8; 100]))
            .collect();
        b.enqueue("shard-0", 1, &jobs).unwrap();
        let claimed = b.claim("shard-0", 100, LEASE_MS).unwrap();
        let ids: Vec<Receipt> = claimed.iter().map(|c| c.receipt()).collect();
        b.ack("shard-0", &ids).unwrap();
        max_segments = max_segments.max(list_segments(&dir.join("shard-0")).unwrap().len());
    }
    // 200 rounds wrote ~70 segments' worth; finished ones are gone.
    assert!(max_segments <= 3, "{max_segments} segments kept");
    drop(engine);
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    let st = engine.status().unwrap();
    assert_eq!((st.totals.ready, st.totals.in_flight), (0, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn concurrent_appenders_with_separate_locks_lose_nothing() {
    let dir = data_dir_n("appenders", 1);
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                // A separate Engine has its own lock file descriptions, as a
                // separate process would.
                let e = Engine::open(
                    &dir,
                    EngineOptions {
                        segment_bytes_max: 8192,
                        durability: shardq_fs::Durability::None,
                        ..EngineOptions::default()
                    },
                )
                .unwrap();
                (0..500)
                    .map(|i| {
                        e.enqueue(NewJob::new(format!("t{t}"), format!("{i}")))
                            .unwrap()
                            .1
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all = BTreeSet::new();
    for h in handles {
        for id in h.join().unwrap() {
            assert!(all.insert(id), "duplicate id {id}");
        }
    }
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert_eq!(engine.status().unwrap().totals.ready, 2000);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lease_takeover_standby_and_graceful_release() {
    let dir = data_dir_n("lease", 2);
    let clock = ManualClock::new(1_000_000);
    let c: Arc<dyn shardq_core::Clock> = Arc::new(clock.clone());
    let mut a = FsCoordinator::new(&dir, member("a@1"), Arc::clone(&c)).unwrap();
    let mut b = FsCoordinator::new(&dir, member("b@2"), Arc::clone(&c)).unwrap();
    let mut s = FsCoordinator::new(&dir, member("s@3"), Arc::clone(&c)).unwrap();
    assert_eq!(a.tick().unwrap().gained, ["shard-0"]);
    assert_eq!(b.tick().unwrap().gained, ["shard-1"]);
    assert!(s.tick().unwrap().owned.is_empty(), "standby");
    assert!(
        s.standby_reason().contains("owns no shards"),
        "{}",
        s.standby_reason()
    );
    assert_eq!(a.tick_interval_ms(), 10_000);

    // a renews; its lease never lapses while it ticks.
    clock.advance(20_000);
    a.tick().unwrap();
    b.tick().unwrap();
    clock.advance(20_000);
    assert!(s.tick().unwrap().owned.is_empty());

    // b dies: its flock goes, its lease stays until it lapses plus skew.
    b.abandon();
    clock.advance(30_000 - 20_000 + 1_000);
    a.tick().unwrap();
    assert!(
        s.tick().unwrap().owned.is_empty(),
        "not before lease + skew"
    );
    clock.advance(1);
    assert_eq!(s.tick().unwrap().gained, ["shard-1"]);

    // a live owner whose lease lapsed (stalled) keeps its flock: no takeover.
    let mut t = FsCoordinator::new(&dir, member("t@4"), Arc::clone(&c)).unwrap();
    clock.advance(40_000);
    s.tick().unwrap();
    assert!(t.tick().unwrap().owned.is_empty(), "flock still held by a");
    // a finds it lost nothing (still listed as owner) and renews.
    assert_eq!(a.tick().unwrap().owned, ["shard-0"]);

    // graceful release: t takes over at once.
    a.release_all().unwrap();
    assert_eq!(t.tick().unwrap().gained, ["shard-0"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn corrupt_membership_is_reported_and_left_alone() {
    let dir = data_dir_n("membership", 1);
    std::fs::write(dir.join("membership.json"), "{not json").unwrap();
    let err = Engine::open(&dir, EngineOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("membership.json") && err.contains("corrupt"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("membership.json")).unwrap(),
        "{not json"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pool_limit_is_shared_by_all_owned_shards() {
    let dir = data_dir_n("pool", 3);
    let engine = Engine::open(
        &dir,
        EngineOptions {
            durability: shardq_fs::Durability::None,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let jobs: Vec<NewJob> = (0..300).map(|i| NewJob::new(format!("k{i}"), "")).collect();
    engine.enqueue_batch(jobs).unwrap();
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let shards = Arc::new(Mutex::new(BTreeSet::new()));
    let (r, p, s) = (Arc::clone(&running), Arc::clone(&peak), Arc::clone(&shards));
    let report = engine
        .run_workers(
            MemberOptions {
                max_local_shards: usize::MAX,
                ..member("p@1")
            },
            PoolOptions {
                concurrency: 2,
                exit_when_idle: true,
                ..PoolOptions::default()
            },
            Arc::new(move |job| {
                let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(now, Ordering::SeqCst);
                s.lock().unwrap().insert(job.shard.clone());
                // Real time: each run lasts a moment, so runs overlap and reach the limit.
                std::thread::sleep(std::time::Duration::from_micros(200));
                r.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            }),
            &AtomicBool::new(false),
        )
        .unwrap();
    assert_eq!(report.acked, 300);
    assert_eq!(peak.load(Ordering::SeqCst), 2, "limit shared, and reached");
    assert_eq!(shards.lock().unwrap().len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Polls `cond` every few ms for up to `limit`; returns how long it took.
#[test]
fn interval_durability_syncs_an_idle_tail_within_the_interval() {
    let dir = data_dir_n("interval-idle", 1);
    // The clock stands still, so no append ever finds the interval passed:
    // only the background flusher can sync.
    let clock = ManualClock::new(1_000_000);
    let faulty = FaultyStorage::default();
    let interval_ms = 100;
    let engine = Engine::open(
        &dir,
        EngineOptions {
            durability: shardq_fs::Durability::Interval { ms: interval_ms },
            storage: Arc::new(faulty.clone()),
            ..opts(&clock)
        },
    )
    .unwrap();
    let b = engine.backend();
    for round in 0..3 {
        let before = faulty.syncs.load(Ordering::SeqCst);
        b.enqueue("shard-0", 1, &[NewJob::new("k", format!("idle {round}"))])
            .unwrap();
        // One period plus generous slack for a loaded machine.
        let took = wait_for(std::time::Duration::from_secs(2), || {
            faulty.syncs.load(Ordering::SeqCst) > before
        });
        let took = took.unwrap_or_else(|| panic!("round {round}: idle tail never synced"));
        assert!(
            took < std::time::Duration::from_millis(interval_ms * 10),
            "round {round}: synced after {took:?}"
        );
    }
    // Dropping the engine stops the flusher (the drop joins it).
    drop(b);
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A shard's queue as replay sees it: counts and the dead list.
fn shard_view(engine: &Engine) -> (shardq_fs::StatusTotals, Vec<(u64, String, String)>) {
    let dead = engine
        .backend()
        .dead_list("shard-0", 100)
        .unwrap()
        .into_iter()
        .map(|d| (d.id.0, d.key, d.reason))
        .collect();
    (engine.status().unwrap().totals, dead)
}

/// Options for the compaction tests: small segments, no fsync per append.
fn small_segments(
    clock: &ManualClock,
    storage: Arc<dyn shardq_fs::storage::Storage>,
) -> EngineOptions {
    EngineOptions {
        segment_bytes_max: 4096,
        durability: shardq_fs::Durability::None,
        storage,
        ..opts(clock)
    }
}

/// Dead-letters one job (in the first segment), then runs `rounds` of
/// enqueue 10 / claim / ack; returns the most segment files seen at once.
fn dead_job_then_traffic(b: &shardq_fs::FsBackend, dir: &Path, rounds: usize) -> usize {
    b.adopt("shard-0").unwrap();
    b.enqueue("shard-0", 1, &[job("poison", "never works", 1)])
        .unwrap();
    let c = b.claim("shard-0", 10, LEASE_MS).unwrap();
    let (poison, others): (Vec<_>, Vec<_>) = c.iter().partition(|j| j.payload == b"never works");
    assert_eq!(poison.len(), 1);
    assert_eq!(
        b.fail("shard-0", poison[0].receipt(), "bad", None).unwrap(),
        FailOutcome::Dead
    );
    let others: Vec<Receipt> = others.iter().map(|j| j.receipt()).collect();
    if !others.is_empty() {
        b.ack("shard-0", &others).unwrap();
    }
    let mut max_segments = 0;
    for round in 0..rounds {
        let jobs: Vec<NewJob> = (0..10)
            .map(|i| NewJob::new(format!("k{i}"), vec![round as u8; 100]))
            .collect();
        b.enqueue("shard-0", 1, &jobs).unwrap();
        let claimed = b.claim("shard-0", 100, LEASE_MS).unwrap();
        let ids: Vec<Receipt> = claimed.iter().map(|c| c.receipt()).collect();
        b.ack("shard-0", &ids).unwrap();
        max_segments = max_segments.max(list_segments(&dir.join("shard-0")).unwrap().len());
    }
    max_segments
}

#[test]
fn a_dead_job_in_the_first_segment_does_not_pin_later_ones() {
    let dir = data_dir_n("compact-dead", 1);
    let clock = ManualClock::new(1_000_000);
    let os: Arc<dyn shardq_fs::storage::Storage> = Arc::new(shardq_fs::storage::OsStorage);
    // A producer that appended before the traffic and a replica that read
    // the shard before it: both must step over the reclaimed middle later.
    let producer = Engine::open(&dir, small_segments(&clock, Arc::clone(&os))).unwrap();
    producer
        .backend()
        .enqueue("shard-0", 1, &[NewJob::new("p", "early")])
        .unwrap();
    let lagging = Engine::open(&dir, small_segments(&clock, Arc::clone(&os))).unwrap();
    assert_eq!(lagging.status().unwrap().totals.ready, 1);

    let owner = Engine::open(&dir, small_segments(&clock, Arc::clone(&os))).unwrap();
    let b = owner.backend();
    let max_segments = dead_job_then_traffic(&b, &dir, 300);
    // 300 rounds write ~100 segments' worth. Kept: the first (dead job), the
    // next (it acks jobs of the first), the current, and one being reclaimed.
    assert!(max_segments <= 5, "{max_segments} segments kept");
    let sdir = dir.join("shard-0");
    assert_eq!(
        list_segments(&sdir).unwrap()[0],
        0,
        "the dead job's segment stays"
    );

    let late = producer
        .backend()
        .enqueue("shard-0", 1, &[NewJob::new("p", "late")])
        .unwrap();
    let got = b.claim("shard-0", 10, LEASE_MS).unwrap();
    assert_eq!(
        ids(&got),
        ["late"],
        "the producer's append after the gap is seen"
    );
    assert_eq!(got[0].id, late[0]);
    b.ack("shard-0", &[got[0].receipt()]).unwrap();
    b.enqueue("shard-0", 1, &[NewJob::new("q", "pending")])
        .unwrap();

    let expected = shard_view(&owner);
    assert_eq!(expected.0.ready, 1);
    assert_eq!(expected.1.len(), 1);
    assert_eq!(shard_view(&lagging), expected, "lagging replica");
    drop((owner, lagging, producer));
    let fresh = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert_eq!(shard_view(&fresh), expected, "replay from scratch");

    // Purging the dead job lets the first segments go too.
    let b = fresh.backend();
    b.adopt("shard-0").unwrap();
    assert_eq!(b.dead_purge("shard-0", None).unwrap(), 1);
    let c = b.claim("shard-0", 10, LEASE_MS).unwrap();
    b.ack("shard-0", &[c[0].receipt()]).unwrap();
    let left = list_segments(&sdir).unwrap();
    assert!(left.len() <= 2 && left[0] > 0, "segments left: {left:?}");
    drop(fresh);
    let again = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert_eq!(
        again.status().unwrap().totals,
        shardq_fs::StatusTotals::default()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

#[test]
fn a_crash_during_compaction_loses_nothing() {
    let dir = data_dir_n("compact-crash", 1);
    let clock = ManualClock::new(1_000_000);
    // Every deletion fails: what a crash right after the reclaimed list was
    // written leaves behind, for every segment at once.
    let faulty = FaultyStorage::default();
    faulty.fail_removes.store(true, Ordering::SeqCst);
    let owner = Engine::open(&dir, small_segments(&clock, Arc::new(faulty.clone()))).unwrap();
    dead_job_then_traffic(&owner.backend(), &dir, 60);
    owner
        .backend()
        .enqueue("shard-0", 1, &[NewJob::new("q", "pending")])
        .unwrap();
    let expected = shard_view(&owner);
    assert_eq!((expected.0.ready, expected.1.len()), (1, 1));
    drop(owner);
    let sdir = dir.join("shard-0");
    let all = list_segments(&sdir).unwrap();
    assert!(
        all.len() > 10,
        "nothing was deleted: {} segments",
        all.len()
    );
    assert!(sdir.join(shardq_fs::reclaim::RECLAIMED_FILE).exists());
    let seg = |b: u64| shardq_fs::storage::segment_name(b);

    // Each crash image: (name, files to delete, keep the reclaimed list).
    // Only files whose whole range is recorded may be gone after a crash
    // (the segment before the current one may be sealed but not yet
    // recorded, depending on where the last roll fell).
    let list =
        shardq_fs::reclaim::Reclaimed::load(&shardq_fs::storage::OsStorage, "shard-0", &sdir)
            .unwrap();
    let middle: Vec<u64> = all
        .windows(2)
        .skip(2)
        .filter(|w| list.covers(w[0], w[1]))
        .map(|w| w[0])
        .collect();
    assert!(middle.len() > 5, "recorded segments: {middle:?}");
    let middle = &middle[..];
    let images: Vec<(&str, Vec<u64>, bool)> = vec![
        ("after the list, before any deletion", vec![], true),
        ("before the list was written", vec![], false),
        (
            "during deletion, oldest first",
            middle[..middle.len() / 2].to_vec(),
            true,
        ),
        // Deletions not yet durable come back after a power loss in any
        // combination.
        (
            "deletions partly undone",
            middle.iter().copied().step_by(3).collect(),
            true,
        ),
    ];
    for (name, delete, keep_list) in images {
        let img = dir.with_file_name(format!(
            "{}-img",
            dir.file_name().unwrap().to_str().unwrap()
        ));
        copy_dir(&dir, &img);
        let isdir = img.join("shard-0");
        for b in delete {
            std::fs::remove_file(isdir.join(seg(b))).unwrap();
        }
        if !keep_list {
            std::fs::remove_file(isdir.join(shardq_fs::reclaim::RECLAIMED_FILE)).unwrap();
        }
        let engine = Engine::open(
            &img,
            small_segments(&clock, Arc::new(shardq_fs::storage::OsStorage)),
        )
        .unwrap();
        assert_eq!(shard_view(&engine), expected, "{name}: replay");
        // Recovery: the next compaction finishes the job.
        let b = engine.backend();
        b.adopt("shard-0").unwrap();
        // Same key: "pending" runs, "one more" waits in its place.
        b.enqueue("shard-0", 1, &[NewJob::new("q", "one more")])
            .unwrap();
        let c = b.claim("shard-0", 10, LEASE_MS).unwrap();
        assert_eq!(ids(&c), ["pending"], "{name}");
        b.ack("shard-0", &[c[0].receipt()]).unwrap();
        let left = list_segments(&isdir).unwrap().len();
        assert!(left <= 4, "{name}: {left} segments left after compaction");
        drop(engine);
        let engine = Engine::open(&img, EngineOptions::default()).unwrap();
        assert_eq!(
            shard_view(&engine),
            expected,
            "{name}: replay after compaction"
        );
        drop(engine);
        let _ = std::fs::remove_dir_all(&img);
    }

    // A middle segment missing without being recorded is corruption, never
    // skipped silently.
    std::fs::remove_file(sdir.join(shardq_fs::reclaim::RECLAIMED_FILE)).unwrap();
    std::fs::remove_file(sdir.join(seg(middle[0]))).unwrap();
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    let err = engine.status().unwrap_err();
    assert!(
        matches!(err, FsError::Queue(QueueError::Corrupt { .. })),
        "{err}"
    );
    assert!(
        err.to_string().contains("not recorded as reclaimed"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A backlog moved from shard-0 to shard-1 replays the same after a
/// restart: the copies with their attempts and dead letter, none left on
/// shard-0; and once the copies ran and their segments were compacted away,
/// shard-1 still knows what it took, so a rerun of the copy stores nothing.
#[test]
fn a_moved_backlog_survives_restart_and_compaction_and_is_never_taken_twice() {
    let dir = data_dir_n("transfer", 2);
    let clock = ManualClock::new(1_000_000);
    let storage: Arc<dyn shardq_fs::storage::Storage> = Arc::new(shardq_fs::storage::OsStorage);
    let exported = {
        let engine = Engine::open(&dir, small_segments(&clock, Arc::clone(&storage))).unwrap();
        let b = engine.backend();
        b.adopt("shard-0").unwrap();
        b.enqueue("shard-0", 1, &[job("k", "dead", 1)]).unwrap();
        let run = b.claim("shard-0", 1, LEASE_MS).unwrap().remove(0);
        b.fail("shard-0", run.receipt(), "exit 3", None).unwrap();
        let jobs: Vec<NewJob> = (0..200).map(|i| job("k", &format!("j{i}"), 3)).collect();
        b.enqueue("shard-0", 1, &jobs).unwrap();
        let exported = b.export_jobs("shard-0", "k", None, 10_000).unwrap();
        assert_eq!(exported.len(), 201);
        let stored = b.import_jobs("shard-1", "shard-0", "k", &exported).unwrap();
        assert_eq!(stored.len(), 201);
        assert_eq!(b.purge_key("shard-0", "k").unwrap(), 201);
        (exported, stored.last().unwrap().1 .0)
    };
    let (exported, last_copy) = exported;
    // Restart: replay agrees.
    let engine = Engine::open(&dir, small_segments(&clock, Arc::clone(&storage))).unwrap();
    let b = engine.backend();
    let c0 = b.key_counts("shard-0", "k").unwrap();
    assert_eq!(
        (c0.depth, c0.dead),
        (0, 0),
        "copies came back on the old shard"
    );
    // An id from before the move still says where its job went.
    for j in [&exported[0], &exported[200]] {
        assert_eq!(
            b.moved_away("shard-0", j.id).unwrap().as_deref(),
            Some("k"),
            "job {} after the restart",
            j.id
        );
    }
    let c1 = b.key_counts("shard-1", "k").unwrap();
    assert_eq!((c1.depth, c1.dead), (200, 1));
    assert_eq!(b.dead_list("shard-1", 10).unwrap()[0].reason, "exit 3");
    b.adopt("shard-1").unwrap();
    let mut ran = Vec::new();
    loop {
        let jobs = b.claim("shard-1", 1, LEASE_MS).unwrap();
        let Some(j) = jobs.first() else { break };
        ran.push(String::from_utf8_lossy(&j.payload).into_owned());
        b.ack("shard-1", &[j.receipt()]).unwrap();
    }
    let want: Vec<String> = (0..200).map(|i| format!("j{i}")).collect();
    assert_eq!(ran, want, "order kept through the move and the restart");
    b.dead_purge("shard-1", None).unwrap();
    // Everything ran: its segments go; the cursor stays.
    for _ in 0..50 {
        b.enqueue("shard-1", 1, &[job("x", &"p".repeat(200), 3)])
            .unwrap();
        let j = b.claim("shard-1", 1, LEASE_MS).unwrap().remove(0);
        b.ack("shard-1", &[j.receipt()]).unwrap();
    }
    drop(engine);
    let first_kept = list_segments(&dir.join("shard-1")).unwrap()[0];
    assert!(
        first_kept > last_copy,
        "the copies' segments were not compacted (first kept {first_kept}, last copy {last_copy})"
    );
    let engine = Engine::open(&dir, small_segments(&clock, storage)).unwrap();
    let b = engine.backend();
    assert_eq!(
        b.imported_up_to("shard-1", "shard-0", "k").unwrap(),
        Some(exported[200].id)
    );
    assert!(
        b.import_jobs("shard-1", "shard-0", "k", &exported)
            .unwrap()
            .is_empty(),
        "a rerun of the copy stored jobs twice"
    );
    assert_eq!(b.key_counts("shard-1", "k").unwrap().depth, 0);
}

/// A crash that cut an append to the moved file leaves a torn line: it is
/// skipped, and the next purge's line still reads.
#[test]
fn a_torn_line_of_the_moved_file_costs_only_itself() {
    let dir = data_dir_n("moved-torn", 1);
    let clock = ManualClock::new(1_000_000);
    let engine = Engine::open(&dir, opts(&clock)).unwrap();
    let b = engine.backend();
    b.adopt("shard-0").unwrap();
    b.enqueue("shard-0", 1, &[job("k", "a", 3)]).unwrap();
    let id = b.key_jobs("shard-0", "k", 10).unwrap()[0].id;
    std::fs::write(
        dir.join("shard-0").join(shardq_fs::MOVED_FILE),
        b"{\"key\":\"x\",\"ids\":[1,",
    )
    .unwrap();
    assert_eq!(b.purge_key("shard-0", "k").unwrap(), 1);
    assert_eq!(b.moved_away("shard-0", id).unwrap().as_deref(), Some("k"));
    assert_eq!(
        b.moved_away("shard-0", shardq_core::JobId(1)).unwrap(),
        None
    );
}

/// The finished jobs' history stays within its retention on disk too:
/// after many acks the file is cut back to about the jobs kept, a reopened
/// engine (another process) lists exactly the newest ones, newest first,
/// and a flipped byte or a torn line costs only the lines it hits.
#[test]
fn the_finished_file_is_cut_to_the_retention_and_survives_damage() {
    let dir = data_dir_n("finished-cut", 1);
    let clock = ManualClock::new(1_000_000);
    let mut o = opts(&clock);
    o.retention.finished_jobs = 50;
    let engine = Engine::open(&dir, o.clone()).unwrap();
    let b = engine.backend();
    b.adopt("shard-0").unwrap();
    let mut last = Vec::new();
    // 100,000 acks: past the size at which the file is first cut.
    for round in 0..1000 {
        let jobs: Vec<NewJob> = (0..100)
            .map(|i| job(&format!("k{i}"), &format!("{round}-{i}"), 3))
            .collect();
        b.enqueue("shard-0", 1, &jobs).unwrap();
        let runs = b.claim("shard-0", 100, LEASE_MS).unwrap();
        last = runs.iter().map(|r| r.id).collect();
        let rs: Vec<Receipt> = runs.iter().map(|r| r.receipt()).collect();
        assert_eq!(b.ack("shard-0", &rs).unwrap().acked, 100);
    }
    let path = dir.join("shard-0").join(shardq_fs::FINISHED_FILE);
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(
        size < 100_000 * 100,
        "100,000 acks (over 100 bytes each) left a {size}-byte file: never cut"
    );
    drop(engine);
    let engine = Engine::open(&dir, o.clone()).unwrap();
    let got = engine.backend().finished("shard-0", None, 1000).unwrap();
    assert_eq!(got.len(), 50, "the retention's count");
    // Newest first: the last batch's jobs (acked in id order), reversed.
    let want: Vec<_> = last.iter().rev().take(50).copied().collect();
    assert_eq!(got.iter().map(|f| f.id).collect::<Vec<_>>(), want);
    drop(engine);
    // A flipped byte inside the third newest line and a torn last line:
    // the other lines still read, and the next append ends the torn line.
    let mut bytes = std::fs::read(&path).unwrap();
    let starts: Vec<usize> = (bytes.iter().enumerate())
        .filter(|(_, &c)| c == b'\n')
        .map(|(i, _)| i + 1)
        .collect();
    let third_newest = starts[starts.len() - 4];
    bytes[third_newest + 3] = b'{';
    bytes.truncate(bytes.len() - 5);
    std::fs::write(&path, &bytes).unwrap();
    let engine = Engine::open(&dir, o).unwrap();
    let b = engine.backend();
    let damaged: Vec<_> = (b.finished("shard-0", None, 1000).unwrap())
        .iter()
        .map(|f| f.id)
        .collect();
    assert_eq!(damaged.len(), 50, "older lines fill the retention");
    assert_eq!(
        &damaged[..3],
        [want[1], want[3], want[4]],
        "the torn newest and the damaged third are skipped, nothing else"
    );
    b.adopt("shard-0").unwrap();
    b.enqueue("shard-0", 1, &[job("after", "x", 3)]).unwrap();
    let run = b.claim("shard-0", 1, LEASE_MS).unwrap().remove(0);
    b.ack("shard-0", &[run.receipt()]).unwrap();
    let now = b.finished("shard-0", None, 1).unwrap();
    assert_eq!(
        now.iter().map(|f| f.id).collect::<Vec<_>>(),
        [run.id],
        "the newest after the damage"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The retention keeps its count of finished jobs whatever their lines'
/// length: with 1,000-byte keys (lines of ~1.1 KB, past the 512 bytes a
/// line was once planned at) the newest `finished_jobs` are all kept,
/// through the cuts, and read back newest first by another process.
#[test]
fn long_finished_lines_still_keep_the_whole_retention() {
    let dir = data_dir_n("finished-long", 1);
    let clock = ManualClock::new(1_000_000);
    let mut o = opts(&clock);
    o.retention.finished_jobs = 5_000;
    let engine = Engine::open(&dir, o.clone()).unwrap();
    let b = engine.backend();
    b.adopt("shard-0").unwrap();
    let mut acked = Vec::new();
    for round in 0..120 {
        let jobs: Vec<NewJob> = (0..100)
            .map(|i| {
                job(
                    &format!("{i:03}-{}", "k".repeat(996)),
                    &format!("{round}"),
                    3,
                )
            })
            .collect();
        b.enqueue("shard-0", 1, &jobs).unwrap();
        let runs = b.claim("shard-0", 100, LEASE_MS).unwrap();
        assert_eq!(runs.len(), 100);
        acked.extend(runs.iter().map(|r| r.id));
        let rs: Vec<Receipt> = runs.iter().map(|r| r.receipt()).collect();
        assert_eq!(b.ack("shard-0", &rs).unwrap().acked, 100);
    }
    let path = dir.join("shard-0").join(shardq_fs::FINISHED_FILE);
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size < 12_000 * 1_100, "never cut: {size} bytes");
    drop(engine);
    let engine = Engine::open(&dir, o).unwrap();
    let got = engine.backend().finished("shard-0", None, 10_000).unwrap();
    assert_eq!(
        got.len(),
        5_000,
        "the retention's count, not what fits in bytes"
    );
    let want: Vec<_> = acked.iter().rev().take(5_000).copied().collect();
    assert_eq!(got.iter().map(|f| f.id).collect::<Vec<_>>(), want);
}

/// A debounced job's payload lives in its last Debounce record: traffic
/// that fills and compacts many segments around it, and restarts, keep the
/// burst's last payload and start, and the job runs once with it; once it
/// ran, the segments holding its Debounce records go too. A unique id
/// holds across the restart.
#[test]
fn a_debounced_payload_survives_restarts_and_compaction() {
    let dir = data_dir_n("debounce", 1);
    let clock = ManualClock::new(1_000_000);
    let storage: Arc<dyn shardq_fs::storage::Storage> = Arc::new(shardq_fs::storage::OsStorage);
    let open = || Engine::open(&dir, small_segments(&clock, Arc::clone(&storage))).unwrap();
    let debounced = |p: &str| NewJob::new("d", p.to_string()).debounced("recalc", 60_000, 600_000);
    let traffic = |b: &shardq_fs::FsBackend, n: usize| {
        for round in 0..n {
            let jobs: Vec<NewJob> = (0..10)
                .map(|i| NewJob::new(format!("k{i}"), vec![round as u8; 100]))
                .collect();
            b.enqueue("shard-0", 1, &jobs).unwrap();
            let claimed = b.claim("shard-0", 100, LEASE_MS).unwrap();
            assert!(
                claimed.iter().all(|c| c.key != "d"),
                "the debounced job is not due"
            );
            let r: Vec<Receipt> = claimed.iter().map(|c| c.receipt()).collect();
            b.ack("shard-0", &r).unwrap();
        }
    };
    let id = {
        let engine = open();
        let b = engine.backend();
        b.adopt("shard-0").unwrap();
        let first = b
            .enqueue_dedup("shard-0", 1, &[debounced("v0")], 1)
            .unwrap()[0]
            .id;
        let mut unique = NewJob::new("u", "once").unique("import-7", false);
        unique.delay_ms = 3_600_000;
        assert!(!b.enqueue_dedup("shard-0", 1, &[unique], 1).unwrap()[0].duplicate);
        for v in 1..=5 {
            traffic(&b, 20);
            clock.advance(1_000);
            let st = b
                .enqueue_dedup("shard-0", 1, &[debounced(&format!("v{v}"))], 1)
                .unwrap();
            assert_eq!(st[0].id, first);
        }
        traffic(&b, 40);
        first
    };
    let segments_before = list_segments(&dir.join("shard-0")).unwrap();
    assert!(
        segments_before.len() < 30,
        "compaction ran: {segments_before:?}"
    );
    let engine = open();
    let b = engine.backend();
    b.adopt("shard-0").unwrap();
    let j = b
        .job("shard-0", id)
        .unwrap()
        .expect("live after the restart");
    assert_eq!(
        j.payload, b"v5",
        "the last payload after restart and compaction"
    );
    assert_eq!(j.not_before_ms, 1_000_000 + 5_000 + 60_000);
    let unique = NewJob::new("u", "twice").unique("import-7", false);
    let held = b
        .enqueue_dedup("shard-0", 1, &[unique], 1)
        .unwrap()
        .remove(0);
    assert!(held.duplicate, "a unique id holds across the restart");
    b.cancel("shard-0", held.id).unwrap();
    clock.advance(60_000);
    let runs = b.claim("shard-0", 10, LEASE_MS).unwrap();
    let run = runs.iter().find(|r| r.key == "d").expect("due");
    assert_eq!((run.id, &run.payload[..]), (id, &b"v5"[..]));
    let all: Vec<Receipt> = runs.iter().map(|r| r.receipt()).collect();
    b.ack("shard-0", &all).unwrap();
    traffic(&b, 60);
    drop(engine);
    let first_kept = list_segments(&dir.join("shard-0")).unwrap()[0];
    assert!(
        first_kept > id.0,
        "the burst's segments were kept after it ran"
    );
    let engine = open();
    assert_eq!(
        engine.backend().key_counts("shard-0", "d").unwrap().depth,
        0
    );
}
