//! Simulated power losses ([`CrashStorage`]): bytes not fsynced are dropped
//! (all, or a prefix of them written back), files whose directory entry was
//! never fsynced vanish. What returned success in `fsync` mode survives; in
//! `none` mode a suffix is lost, and the shard still opens cleanly and
//! appends again.

use std::sync::Arc;

use shardq_core::{InspectJobs, MoveKeys, NewJob, Receipt, RunJobs, JOB_LEASE_MS_DEFAULT};
use shardq_fs::storage::{list_segments, segment_name, CrashStorage, OsStorage};
use shardq_fs::{Durability, Engine, EngineOptions};

mod support;

use support::data_dir;

fn opts(storage: Arc<dyn shardq_fs::storage::Storage>, durability: Durability) -> EngineOptions {
    EngineOptions {
        storage,
        durability,
        segment_bytes_max: 2048,
        ..EngineOptions::default()
    }
}

fn counts(dir: &std::path::Path) -> (u64, u64, u64) {
    let engine = Engine::open(dir, opts(Arc::new(OsStorage), Durability::Fsync)).unwrap();
    let t = engine.status().unwrap().totals;
    (t.ready, t.in_flight, t.dead)
}

#[test]
fn what_returned_success_in_fsync_mode_survives_a_power_loss() {
    let dir = data_dir("fsync");
    let crash = CrashStorage::default();
    let before = {
        let engine = Engine::open(&dir, opts(Arc::new(crash.clone()), Durability::Fsync)).unwrap();
        let b = engine.backend();
        b.adopt("shard-0").unwrap();
        for i in 0..120 {
            b.enqueue(
                "shard-0",
                1,
                &[NewJob::new(format!("k{}", i % 7), vec![7; 40])],
            )
            .unwrap();
            if i % 3 == 0 {
                let c = b.claim("shard-0", 2, JOB_LEASE_MS_DEFAULT).unwrap();
                let rs: Vec<Receipt> = c.iter().skip(1).map(|j| j.receipt()).collect();
                b.ack("shard-0", &rs).unwrap();
            }
        }
        let s = b.shard_stats("shard-0").unwrap();
        (s.ready, s.in_flight, s.dead)
    };
    assert!(
        list_segments(&dir.join("shard-0")).unwrap().len() > 1,
        "the test must cross segment rolls"
    );
    // The finished jobs' history is appended without an fsync on purpose:
    // it is what happened, not work; everything else must be durable.
    assert_eq!(
        crash.unsynced_bytes_but(shardq_fs::FINISHED_FILE),
        0,
        "fsync mode left nothing unsynced"
    );
    crash.crash(0).unwrap();
    assert_eq!(counts(&dir), before);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_power_loss_in_none_mode_loses_only_a_suffix_and_the_shard_reopens() {
    for keep in [0u64, 1, 7, 35, 36, 100, 1_000, u64::MAX] {
        let dir = data_dir(&format!("none-{keep}"));
        let crash = CrashStorage::default();
        let engine = Engine::open(&dir, opts(Arc::new(crash.clone()), Durability::None)).unwrap();
        let b = engine.backend();
        let mut ids = Vec::new();
        for i in 0..40 {
            let id = b
                .enqueue("shard-0", 1, &[NewJob::new("k", format!("p{i:03}"))])
                .unwrap()[0];
            ids.push(id.0);
            if i == 9 {
                b.flush().unwrap();
            }
        }
        drop(b);
        drop(engine);
        let seg = dir.join("shard-0").join(segment_name(0));
        let durable = crash.durable_len(&seg).unwrap();
        let len = std::fs::metadata(&seg).unwrap().len();
        crash.crash(keep).unwrap();
        let left = std::fs::metadata(&seg).unwrap().len();
        assert_eq!(left, len.min(durable.saturating_add(keep)), "keep {keep}");
        // A job survives iff its whole record is in what is left.
        let mut ends: Vec<u64> = ids.iter().skip(1).copied().collect();
        ends.push(len);
        let expected = ends.iter().filter(|&&end| end <= left).count() as u64;
        assert!(expected >= 10, "the flushed jobs are durable");

        let engine = Engine::open(&dir, opts(Arc::new(OsStorage), Durability::Fsync)).unwrap();
        assert_eq!(
            engine.status().unwrap().totals.ready,
            expected,
            "keep {keep}"
        );
        // Appending again cuts any torn tail, and order is the enqueue order.
        engine.enqueue(NewJob::new("k", "after")).unwrap();
        let b = engine.backend();
        b.adopt("shard-0").unwrap();
        let mut seen = Vec::new();
        loop {
            let c = b.claim("shard-0", 1, JOB_LEASE_MS_DEFAULT).unwrap();
            let Some(j) = c.first() else { break };
            seen.push(String::from_utf8(j.payload.clone()).unwrap());
            b.ack("shard-0", &[j.receipt()]).unwrap();
        }
        let mut want: Vec<String> = (0..expected).map(|i| format!("p{i:03}")).collect();
        want.push("after".into());
        assert_eq!(seen, want, "keep {keep}");
        drop(b);
        drop(engine);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Run records (claims and acks) are not fsynced before they return in
/// `fsync` mode: a power loss right after an ack may drop it, and then the
/// job is there again to run (at-least-once), never lost; once
/// `run_record_sync_ms` has passed the flusher has made them durable.
#[test]
fn a_power_loss_after_unsynced_acks_runs_the_jobs_again_and_loses_none() {
    for (sync_ms, acks_survive) in [(3_600_000u64, false), (5, true)] {
        let dir = data_dir(&format!("acks-{sync_ms}"));
        let crash = CrashStorage::default();
        {
            let mut o = opts(Arc::new(crash.clone()), Durability::Fsync);
            o.run_record_sync_ms = sync_ms;
            let engine = Engine::open(&dir, o).unwrap();
            let b = engine.backend();
            b.adopt("shard-0").unwrap();
            let jobs: Vec<NewJob> = (0..10).map(|i| NewJob::new(format!("k{i}"), "x")).collect();
            b.enqueue("shard-0", 1, &jobs).unwrap();
            let c = b.claim("shard-0", 10, JOB_LEASE_MS_DEFAULT).unwrap();
            let rs: Vec<Receipt> = c.iter().map(|j| j.receipt()).collect();
            assert_eq!(b.ack("shard-0", &rs).unwrap().acked, 10);
            if acks_survive {
                // Bounded wait for the flusher (it runs every `sync_ms`).
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while crash.unsynced_bytes_but(shardq_fs::FINISHED_FILE) > 0 {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the flusher never synced"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
            crash.crash(0).unwrap();
            std::mem::forget(engine);
        }
        let (ready, in_flight, dead) = counts(&dir);
        assert_eq!((in_flight, dead), (0, 0));
        if acks_survive {
            assert_eq!(ready, 0, "synced acks must survive");
        } else {
            assert_eq!(
                ready, 10,
                "every job whose ack was lost is there to run again"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A full disk while a rebalance writes a shard's fence: the write fails
/// with an error naming `fence.json`, the old fence stays in force (nothing
/// half-applied), and once the disk has room the fence is written.
#[test]
fn a_full_disk_while_writing_a_fence_keeps_the_old_fence() {
    use shardq_core::{Fence, QueueError};
    use shardq_fs::storage::FaultyStorage;
    use std::sync::atomic::Ordering;
    let dir = data_dir("fence-full");
    let faulty = FaultyStorage::default();
    let engine = Engine::open(&dir, opts(Arc::new(faulty.clone()), Durability::Fsync)).unwrap();
    let b = engine.backend();
    b.enqueue("shard-0", 1, &[NewJob::new("k", "x")]).unwrap();
    faulty.fail_file_writes.store(true, Ordering::SeqCst);
    let raised = Fence {
        map_version_min: 5,
        ..Fence::default()
    };
    let err = b.set_fence("shard-0", &raised).unwrap_err();
    assert!(err.to_string().contains("fence.json"), "{err}");
    // The old fence holds: version 1 is still accepted.
    b.enqueue("shard-0", 1, &[NewJob::new("k", "y")]).unwrap();
    faulty.fail_file_writes.store(false, Ordering::SeqCst);
    b.set_fence("shard-0", &raised).unwrap();
    assert!(matches!(
        b.enqueue("shard-0", 1, &[NewJob::new("k", "z")]),
        Err(QueueError::Fenced { .. })
    ));
    assert_eq!(
        b.shard_stats("shard-0").unwrap().ready,
        2,
        "nothing lost, nothing extra"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A full disk while a lease is renewed: the tick fails naming
/// `membership.json`, the file keeps its last good contents (the lease is
/// still this process's, nothing half-written), and once the disk has room
/// the next tick renews it.
#[test]
fn a_full_disk_while_renewing_a_lease_keeps_the_old_membership() {
    use shardq_core::{Coordinator, ManualClock};
    use shardq_fs::storage::FaultyStorage;
    use shardq_fs::{FsCoordinator, MemberOptions};
    use std::sync::atomic::Ordering;
    let dir = data_dir("membership-full");
    let faulty = FaultyStorage::default();
    let clock = ManualClock::new(1_000_000);
    let member = MemberOptions {
        member_id: "m@1".into(),
        lease_ms: 30_000,
        clock_skew_ms: 1_000,
        max_local_shards: 1,
    };
    let mut c = FsCoordinator::new(&dir, member, Arc::new(clock.clone()))
        .unwrap()
        .with_storage(Arc::new(faulty.clone()));
    assert_eq!(c.tick().unwrap().gained, ["shard-0"]);
    let path = dir.join("membership.json");
    let before = std::fs::read(&path).unwrap();

    faulty.fail_file_writes.store(true, Ordering::SeqCst);
    clock.advance(10_000);
    let err = c.tick().unwrap_err().to_string();
    assert!(
        err.contains("membership.json") && err.contains("disk full"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "a failed write changed the file"
    );

    faulty.fail_file_writes.store(false, Ordering::SeqCst);
    let own = c.tick().unwrap();
    assert_eq!((own.owned, own.lost), (vec!["shard-0".to_string()], vec![]));
    let after: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let old: serde_json::Value = serde_json::from_slice(&before).unwrap();
    let lease =
        |v: &serde_json::Value| v["shards"]["shard-0"]["lease_expires_ms"].as_u64().unwrap();
    assert_eq!(
        lease(&after),
        lease(&old) + 10_000,
        "renewed once the disk had room"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A full disk while a new map is published: the publish fails naming
/// `shardmap.yaml`, readers keep the old version (nothing half-written),
/// and once the disk has room the same publish goes through.
#[test]
fn a_full_disk_while_publishing_a_map_keeps_the_old_map() {
    use shardq_core::reshard::MapStore;
    use shardq_fs::map_store::FileMapStore;
    use shardq_fs::storage::FaultyStorage;
    use std::sync::atomic::Ordering;
    let dir = data_dir("map-full");
    let faulty = FaultyStorage::default();
    let store = FileMapStore::open(&dir)
        .unwrap()
        .with_storage(Arc::new(faulty.clone()));
    let old = store.load().unwrap();
    let mut next = old.clone();
    next.version += 1;
    faulty.fail_file_writes.store(true, Ordering::SeqCst);
    let err = store.publish(&next, old.version).unwrap_err().to_string();
    assert!(
        err.contains("shardmap.yaml") && err.contains("disk full"),
        "{err}"
    );
    assert_eq!(store.load().unwrap().version, old.version);
    assert_eq!(
        FileMapStore::open(&dir).unwrap().load().unwrap().version,
        old.version,
        "another reader sees the old map"
    );
    faulty.fail_file_writes.store(false, Ordering::SeqCst);
    store.publish(&next, old.version).unwrap();
    assert_eq!(
        FileMapStore::open(&dir).unwrap().load().unwrap().version,
        next.version
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// State-file reads go through `Storage` too: a disk that fails reads
/// fails the lease tick and the map load naming the file, changes nothing,
/// and once reads work again both go on as before.
#[test]
fn a_disk_that_fails_reads_fails_the_tick_and_the_map_load_naming_the_file() {
    use shardq_core::reshard::MapStore;
    use shardq_core::{Coordinator, ManualClock};
    use shardq_fs::map_store::FileMapStore;
    use shardq_fs::storage::FaultyStorage;
    use shardq_fs::{FsCoordinator, MemberOptions};
    use std::sync::atomic::Ordering;
    let dir = data_dir("reads-fail");
    let faulty = FaultyStorage::default();
    let clock = ManualClock::new(1_000_000);
    let member = MemberOptions {
        member_id: "m@1".into(),
        lease_ms: 30_000,
        clock_skew_ms: 1_000,
        max_local_shards: 1,
    };
    let mut c = FsCoordinator::new(&dir, member, Arc::new(clock.clone()))
        .unwrap()
        .with_storage(Arc::new(faulty.clone()));
    let store = FileMapStore::open(&dir)
        .unwrap()
        .with_storage(Arc::new(faulty.clone()));
    assert_eq!(c.tick().unwrap().gained, ["shard-0"]);
    let version = store.load().unwrap().version;
    let before = std::fs::read(dir.join("membership.json")).unwrap();

    faulty.fail_file_reads.store(true, Ordering::SeqCst);
    clock.advance(10_000);
    let err = c.tick().unwrap_err().to_string();
    assert!(
        err.contains("membership.json") && err.contains("injected state-file read failure"),
        "{err}"
    );
    let err = store.load().unwrap_err().to_string();
    assert!(err.contains("shardmap.yaml"), "{err}");
    assert_eq!(std::fs::read(dir.join("membership.json")).unwrap(), before);

    faulty.fail_file_reads.store(false, Ordering::SeqCst);
    let own = c.tick().unwrap();
    assert_eq!((own.owned, own.lost), (vec!["shard-0".to_string()], vec![]));
    assert_eq!(store.load().unwrap().version, version);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Enqueues jobs `000`..`059` to each of four keys routed to shard-1;
/// returns the keys.
fn sixty_jobs_of_four_keys_on_shard_1(engine: &Engine) -> Vec<String> {
    let router = engine.router();
    let keys: Vec<String> = (0..100)
        .map(|i| format!("tenant-{i}"))
        .filter(|k| router.route(k) == "shard-1")
        .take(4)
        .collect();
    assert_eq!(keys.len(), 4);
    for i in 0..60 {
        for k in &keys {
            engine.enqueue(NewJob::new(k, format!("{i:03}"))).unwrap();
        }
    }
    keys
}

/// A move writes its copies without an fsync per chunk and syncs the new
/// shard once, before it deletes anything on the old one: a power loss
/// right after a rebalance that moved a backlog loses no job of it, and
/// each key's jobs still run in order on the new shard.
#[test]
fn a_power_loss_after_a_move_keeps_every_moved_job_in_order() {
    use shardq_core::reshard::{self, RebalanceOptions};
    use shardq_fs::map_store::FileMapStore;
    let dir = support::data_dir_n("move-power-loss", 2);
    let crash = CrashStorage::default();
    let keys: Vec<String> = {
        let engine = Engine::open(&dir, opts(Arc::new(crash.clone()), Durability::Fsync)).unwrap();
        let keys = sixty_jobs_of_four_keys_on_shard_1(&engine);
        let store = FileMapStore::open(&dir).unwrap();
        reshard::remove_shard(&store, "shard-1").unwrap();
        let report = reshard::rebalance(
            &*engine.backend(),
            &store,
            &RebalanceOptions::default(),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(report.jobs_moved, 240, "{report:?}");
        assert!(
            list_segments(&dir.join("shard-0")).unwrap().len() > 1,
            "the copies must cross segment rolls"
        );
        keys
    };
    crash.crash(0).unwrap();
    let engine = Engine::open(&dir, opts(Arc::new(OsStorage), Durability::Fsync)).unwrap();
    let b = engine.backend();
    b.adopt("shard-0").unwrap();
    let mut seen: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    loop {
        let c = b.claim("shard-0", 8, JOB_LEASE_MS_DEFAULT).unwrap();
        if c.is_empty() {
            break;
        }
        for j in &c {
            seen.entry(j.key.clone())
                .or_default()
                .push(String::from_utf8(j.payload.clone()).unwrap());
        }
        let rs: Vec<Receipt> = c.iter().map(|j| j.receipt()).collect();
        b.ack("shard-0", &rs).unwrap();
    }
    let want: Vec<String> = (0..60).map(|i| format!("{i:03}")).collect();
    for k in &keys {
        assert_eq!(seen.get(k), Some(&want), "key {k}");
    }
    drop(b);
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A map store whose publishes fail after the first `ok`: a rebalance
/// stopped between its freeze and its switch.
struct PublishStops {
    inner: shardq_fs::map_store::FileMapStore,
    ok: std::sync::atomic::AtomicUsize,
}

impl shardq_core::reshard::MapStore for PublishStops {
    fn load(&self) -> Result<shardq_route::ShardMap, shardq_core::reshard::ReshardError> {
        self.inner.load()
    }
    fn publish(
        &self,
        map: &shardq_route::ShardMap,
        expected: u64,
    ) -> Result<(), shardq_core::reshard::ReshardError> {
        use std::sync::atomic::Ordering;
        if self.ok.load(Ordering::SeqCst) == 0 {
            return Err(shardq_core::reshard::ReshardError::Invalid(
                "the switch never came".into(),
            ));
        }
        self.ok.fetch_sub(1, Ordering::SeqCst);
        self.inner.publish(map, expected)
    }
    fn load_target(
        &self,
    ) -> Result<Option<shardq_route::ShardMap>, shardq_core::reshard::ReshardError> {
        self.inner.load_target()
    }
    fn store_target(
        &self,
        target: &shardq_route::ShardMap,
    ) -> Result<(), shardq_core::reshard::ReshardError> {
        self.inner.store_target(target)
    }
    fn clear_target(
        &self,
        reached: &shardq_route::ShardMap,
    ) -> Result<bool, shardq_core::reshard::ReshardError> {
        self.inner.clear_target(reached)
    }
    fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, shardq_core::reshard::ReshardError> {
        self.inner.try_lock_rebalance()
    }
    fn load_setting(
        &self,
        name: &str,
    ) -> Result<Option<String>, shardq_core::reshard::ReshardError> {
        self.inner.load_setting(name)
    }
    fn swap_setting(
        &self,
        name: &str,
        expected: Option<&str>,
        value: Option<&str>,
    ) -> Result<bool, shardq_core::reshard::ReshardError> {
        self.inner.swap_setting(name, expected, value)
    }
}

/// The power fails after a move froze its keys on the old shard (which
/// from then on sends their producers to the new one) and before the
/// switch: the new shard still holds every copy the freeze counted on, so
/// no job sent there can come before one it lost.
#[test]
fn a_power_loss_after_a_freeze_keeps_every_copy_it_counted_on() {
    use shardq_core::reshard::{self, MapStore, RebalanceOptions};
    use shardq_fs::map_store::FileMapStore;
    let dir = support::data_dir_n("freeze-power-loss", 2);
    let crash = CrashStorage::default();
    {
        let engine = Engine::open(&dir, opts(Arc::new(crash.clone()), Durability::Fsync)).unwrap();
        sixty_jobs_of_four_keys_on_shard_1(&engine);
        let store = PublishStops {
            inner: FileMapStore::open(&dir).unwrap(),
            ok: std::sync::atomic::AtomicUsize::new(1),
        };
        reshard::remove_shard(&store.inner, "shard-1").unwrap();
        let err = reshard::rebalance(
            &*engine.backend(),
            &store,
            &RebalanceOptions::default(),
            &mut |_| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("the switch never came"), "{err}");
        let _ = store.load();
    }
    crash.crash(0).unwrap();
    let engine = Engine::open(&dir, opts(Arc::new(OsStorage), Durability::Fsync)).unwrap();
    let b = engine.backend();
    let fence = b.fence("shard-1").unwrap();
    let frozen: Vec<&String> = fence
        .paused_keys
        .iter()
        .filter(|k| fence.sealed_keys.contains_key(*k))
        .collect();
    assert!(!frozen.is_empty(), "no key was frozen: {fence:?}");
    for k in frozen {
        assert_eq!(
            b.key_counts("shard-0", k).unwrap().depth,
            60,
            "key {k} is frozen on shard-1 but shard-0 lost copies"
        );
    }
    drop(b);
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}
