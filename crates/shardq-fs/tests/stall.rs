//! A process stalled while holding a lock must not stall the others: one
//! shard's append lock makes only that shard `Unavailable` (transient)
//! after its bound while the others keep working, the data dir's
//! membership lock makes lease ticks fail after theirs while the owned
//! shards keep running, and the map's publish lock fails a publish after
//! its bound with nothing published.

use std::fs::OpenOptions;
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};
use shardq_core::{Coordinator, InspectJobs, RunJobs, SystemClock};
use shardq_core::{NewJob, QueueError, Receipt, JOB_LEASE_MS_DEFAULT};
use shardq_fs::backend::{APPEND_LOCK_FILE, APPEND_LOCK_WAIT_MS_DEFAULT};
use shardq_fs::layout::{MEMBERSHIP_LOCK_FILE, MEMBERSHIP_LOCK_WAIT_MS};
use shardq_fs::{Durability, Engine, EngineOptions, FsCoordinator};

mod support;

use support::{data_dir_with, member};

/// The "stalled process": a separate open file description holding the
/// flock of `path` (created if missing) until unlocked or dropped.
fn hold(path: &std::path::Path) -> std::fs::File {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap();
    flock(&f, FlockOperation::LockExclusive).unwrap();
    f
}

#[test]
fn a_held_append_lock_makes_only_its_shard_unavailable() {
    assert_eq!(APPEND_LOCK_WAIT_MS_DEFAULT, 1_000);
    assert_eq!(
        EngineOptions::default().append_lock_wait_ms,
        APPEND_LOCK_WAIT_MS_DEFAULT
    );
    let dir = data_dir_with("held", &["shard-0", "shard-1"]);
    let bound_ms = 1_500;
    let engine = Engine::open(
        &dir,
        EngineOptions {
            durability: Durability::None,
            append_lock_wait_ms: bound_ms,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let b = engine.backend();
    for shard in ["shard-0", "shard-1"] {
        let jobs: Vec<NewJob> = (0..3).map(|i| NewJob::new(format!("k{i}"), "")).collect();
        b.enqueue(shard, 1, &jobs).unwrap();
        b.adopt(shard).unwrap();
    }

    // The stalled process holds shard-1's append lock.
    let held = hold(&dir.join("shard-1").join(APPEND_LOCK_FILE));

    let b1 = engine.backend();
    let stuck = std::thread::spawn(move || {
        let start = Instant::now();
        let res = b1.claim("shard-1", 10, JOB_LEASE_MS_DEFAULT);
        (res, start.elapsed())
    });
    // Meanwhile shard-0 serves claims and acks, one key at a time.
    for _ in 0..3 {
        let c = b.claim("shard-0", 1, JOB_LEASE_MS_DEFAULT).unwrap();
        assert_eq!(c.len(), 1);
        let rs: Vec<Receipt> = c.iter().map(|j| j.receipt()).collect();
        assert_eq!(b.ack("shard-0", &rs).unwrap().acked, 1);
    }
    assert!(
        !stuck.is_finished(),
        "shard-0 finished its work while shard-1 still waits for its lock"
    );
    let (res, took) = stuck.join().unwrap();
    let err = res.unwrap_err();
    assert!(
        matches!(&err, QueueError::Unavailable { shard, .. } if shard == "shard-1"),
        "{err}"
    );
    assert!(err.is_transient());
    let msg = err.to_string();
    assert!(
        msg.contains(APPEND_LOCK_FILE) && msg.contains(&format!("bound {bound_ms} ms")),
        "{msg}"
    );
    assert!(
        took >= Duration::from_millis(bound_ms),
        "gave up after {took:?}"
    );
    assert!(
        took < Duration::from_millis(bound_ms + 5_000),
        "waited {took:?}, far past the bound"
    );
    // Nothing was claimed on shard-1 meanwhile.
    assert_eq!(b.shard_stats("shard-1").unwrap().in_flight, 0);

    // The stalled process resumes and lets go: shard-1 works again.
    flock(&held, FlockOperation::Unlock).unwrap();
    assert_eq!(
        b.claim("shard-1", 10, JOB_LEASE_MS_DEFAULT).unwrap().len(),
        3
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_held_membership_lock_bounds_the_lease_tick_and_the_owned_shard_runs_on() {
    assert_eq!(MEMBERSHIP_LOCK_WAIT_MS, 1_000);
    let dir = data_dir_with("membership-held", &["shard-0"]);
    let engine = Engine::open(
        &dir,
        EngineOptions {
            durability: Durability::None,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let b = engine.backend();
    let mut c = FsCoordinator::new(&dir, member("m@1"), std::sync::Arc::new(SystemClock)).unwrap();
    assert_eq!(c.tick().unwrap().gained, ["shard-0"]);
    b.adopt("shard-0").unwrap();
    let jobs: Vec<NewJob> = (0..3).map(|i| NewJob::new(format!("k{i}"), "")).collect();
    b.enqueue("shard-0", 1, &jobs).unwrap();

    // The "stalled process" holds the membership lock.
    let held = hold(&dir.join(MEMBERSHIP_LOCK_FILE));
    let start = Instant::now();
    let err = c.tick().unwrap_err();
    let took = start.elapsed();
    assert!(err.is_transient(), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(MEMBERSHIP_LOCK_FILE) && msg.contains("bound 1000 ms"),
        "{msg}"
    );
    assert!(
        took >= Duration::from_millis(MEMBERSHIP_LOCK_WAIT_MS),
        "gave up after {took:?}"
    );
    assert!(
        took < Duration::from_millis(MEMBERSHIP_LOCK_WAIT_MS + 5_000),
        "waited {took:?}"
    );
    // The shard it owns runs on meanwhile (its flock, not the file, keeps
    // others out).
    let claimed = b.claim("shard-0", 10, JOB_LEASE_MS_DEFAULT).unwrap();
    assert_eq!(claimed.len(), 3);
    let rs: Vec<Receipt> = claimed.iter().map(|j| j.receipt()).collect();
    assert_eq!(b.ack("shard-0", &rs).unwrap().acked, 3);

    // The stalled process lets go: the tick renews, nothing was lost.
    flock(&held, FlockOperation::Unlock).unwrap();
    let own = c.tick().unwrap();
    assert_eq!((own.owned, own.lost), (vec!["shard-0".to_string()], vec![]));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_held_map_lock_fails_the_publish_after_its_bound_and_publishes_nothing() {
    use shardq_core::reshard::MapStore;
    use shardq_fs::map_store::{FileMapStore, MAP_LOCK_FILE, MAP_LOCK_WAIT_MS};
    assert_eq!(MAP_LOCK_WAIT_MS, 5_000);
    let dir = data_dir_with("map-held", &["shard-0"]);
    let store = FileMapStore::open(&dir).unwrap();
    let old = store.load().unwrap();
    let mut next = old.clone();
    next.version += 1;
    let held = hold(&dir.join(MAP_LOCK_FILE));
    let start = Instant::now();
    let e = store.publish(&next, old.version).unwrap_err();
    let took = start.elapsed();
    // A stalled holder is "retry later" (503, exit 75), not a failure of
    // the store.
    assert_eq!(e.kind(), shardq_core::ErrorKind::Retryable, "{e}");
    let err = e.to_string();
    assert!(
        err.contains(MAP_LOCK_FILE) && err.contains("nothing was published"),
        "{err}"
    );
    assert!(
        took >= Duration::from_millis(MAP_LOCK_WAIT_MS),
        "gave up after {took:?}"
    );
    assert!(
        took < Duration::from_millis(MAP_LOCK_WAIT_MS + 5_000),
        "waited {took:?}"
    );
    assert_eq!(store.load().unwrap().version, old.version);
    flock(&held, FlockOperation::Unlock).unwrap();
    store.publish(&next, old.version).unwrap();
    assert_eq!(store.load().unwrap().version, next.version);
    let _ = std::fs::remove_dir_all(&dir);
}
