//! Simulated power losses ([`CrashStorage`]): bytes not fsynced are dropped
//! (all, or a prefix of them written back), files whose directory entry was
//! never fsynced vanish. What returned success in `fsync` mode survives; in
//! `none` mode a suffix is lost, and the shard still opens cleanly and
//! appends again.

use std::path::PathBuf;
use std::sync::Arc;

use shardq_core::{NewJob, QueueBackend, Receipt, JOB_LEASE_MS_DEFAULT};
use shardq_fs::storage::{list_segments, segment_name, CrashStorage, OsStorage};
use shardq_fs::{Durability, Engine, EngineOptions};
use shardq_route::{Algorithm, ShardMap};

fn data_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardq-crash-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let map = ShardMap::with_shards(Algorithm::Rendezvous, ["shard-0"]).unwrap();
    Engine::init(&dir, &map).unwrap();
    dir
}

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
    assert_eq!(
        crash.crash(0).unwrap(),
        0,
        "fsync mode left nothing unsynced"
    );
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
