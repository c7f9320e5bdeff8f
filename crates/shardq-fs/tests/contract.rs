//! The backend contract (`shardq_testkit::contract`) on the embedded engine
//! with a manual clock: one test per check, each on an engine of its own in
//! a data dir of its own (`cargo test -p shardq-fs --test contract
//! one_run_per_key` runs one).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use shardq_core::{Clock, FlowControl, InspectJobs, ManualClock, QueueBackend, RunJobs};
use shardq_fs::{Engine, EngineOptions, FileGroupBuckets, FsBackend};
use shardq_route::{Algorithm, ShardMap};
use shardq_testkit::contract::{self, ContractHarness};

const SHARDS: usize = 40;

struct Fs {
    backend: Arc<FsBackend>,
    clock: ManualClock,
    next: AtomicUsize,
    flow: Arc<FlowControl>,
    _engine: Engine,
    /// Removed once the engine above is dropped (fields drop in order).
    _dir: tempfile::TempDir,
}

impl ContractHarness for Fs {
    fn backend(&self) -> &dyn QueueBackend {
        &*self.backend
    }
    fn fresh_shard(&self) -> String {
        let i = self.next.fetch_add(1, Ordering::SeqCst);
        assert!(i < SHARDS, "the harness has {SHARDS} shards");
        format!("c-{i}")
    }
    fn pass_ms(&self, ms: u64) {
        self.clock.advance(ms);
    }
    fn flow(&self) -> Option<&FlowControl> {
        Some(&self.flow)
    }
}

/// An engine in a new temporary data dir, with `SHARDS` shards adopted,
/// the contract's retry rules and flow settings (group buckets in the data
/// dir, as a deployment has them).
fn engine() -> Fs {
    let dir = tempfile::Builder::new()
        .prefix("shardq-fs-contract-")
        .tempdir()
        .unwrap();
    let names: Vec<String> = (0..SHARDS).map(|i| format!("c-{i}")).collect();
    let map =
        ShardMap::with_shards(Algorithm::Rendezvous, names.iter().map(String::as_str)).unwrap();
    Engine::init(dir.path(), &map).unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let flow = Arc::new(FlowControl::new(
        contract::flow_settings(),
        Arc::new(FileGroupBuckets::new(dir.path())),
    ));
    let engine = Engine::open(
        dir.path(),
        EngineOptions {
            clock: Arc::new(clock.clone()),
            retry_rules: Arc::new(contract::retry_rules()),
            flow: Some(Arc::clone(&flow)),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let backend = engine.backend();
    for n in &names {
        backend.adopt(n).unwrap();
    }
    Fs {
        backend,
        clock,
        next: AtomicUsize::new(0),
        flow,
        _engine: engine,
        _dir: dir,
    }
}

shardq_testkit::contract_tests!(engine());

/// Dedup records live in the shard's log: a reopened engine (another
/// process, a restart) still answers with the original job, after the job
/// was acked and its segments compacted, until the window ends; and two
/// engines over one data dir enqueueing one `(key, id)` at once store it
/// once (the check is under the shard's append lock).
/// Long on purpose: one dedup record followed through compaction, a
/// restart, two engines and the end of its window, in the order they
/// happen.
#[test]
fn dedup_records_survive_a_restart_and_compaction_for_their_window() {
    let tmp = std::env::temp_dir().join(format!("shardq-fs-dedup-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    struct Dir(std::path::PathBuf);
    impl Dir {
        fn path(&self) -> &std::path::Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir = Dir(tmp);
    let map = ShardMap::with_shards(Algorithm::Rendezvous, ["s0"]).unwrap();
    Engine::init(dir.path(), &map).unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let open = || {
        Engine::open(
            dir.path(),
            EngineOptions {
                clock: Arc::new(clock.clone()),
                // Small segments, so the job's segment is sealed and compacted.
                segment_bytes_max: 4096,
                ..EngineOptions::default()
            },
        )
        .unwrap()
    };
    let window = 60_000;
    let job = |d: &str| shardq_core::NewJob::new("k", vec![b'x'; 600]).with_dedup_id(d);
    let first = {
        let engine = open();
        let b = engine.backend();
        b.adopt("s0").unwrap();
        let first = b.enqueue_dedup("s0", 1, &[job("inv-1")], window).unwrap();
        assert!(!first[0].duplicate);
        // Fill later segments, run and ack everything: the first segment
        // is finished, recorded as reclaimed, and would be deleted but
        // for its dedup record.
        for _ in 0..20 {
            b.enqueue(
                "s0",
                1,
                &[shardq_core::NewJob::new("other", vec![b'y'; 600])],
            )
            .unwrap();
        }
        loop {
            let c = b.claim("s0", 100, 60_000).unwrap();
            if c.is_empty() {
                break;
            }
            let receipts: Vec<_> = c.iter().map(|j| j.receipt()).collect();
            b.ack("s0", &receipts).unwrap();
        }
        b.flush().unwrap();
        first
    };
    let segments = |d: &std::path::Path| {
        let mut names: Vec<String> = std::fs::read_dir(d.join("s0"))
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".seg"))
            .collect();
        names.sort();
        names
    };
    let kept = segments(dir.path());
    assert!(
        kept.len() >= 2 && kept.len() <= 3,
        "the first segment stays while its record lives, the other finished ones go: {kept:?}"
    );
    let first_segment = kept[0].clone();
    clock.advance(window / 2);
    {
        // A restart: the record is replayed from the log.
        let engine = open();
        let b = engine.backend();
        let again = b.enqueue_dedup("s0", 1, &[job("inv-1")], window).unwrap();
        assert!(again[0].duplicate, "a restart keeps the record");
        assert_eq!(again[0].id, first[0].id);
        assert_eq!(b.key_counts("s0", "k").unwrap().depth, 0, "nothing stored");
        // Two engines over one data dir, one id at once: stored once.
        let other = open();
        let (x, y) = std::thread::scope(|sc| {
            let t1 = sc.spawn(|| {
                (0..20)
                    .map(|_| b.enqueue_dedup("s0", 1, &[job("inv-2")], window).unwrap())
                    .collect::<Vec<_>>()
            });
            let ob = other.backend();
            let t2 = sc.spawn(move || {
                (0..20)
                    .map(|_| ob.enqueue_dedup("s0", 1, &[job("inv-2")], window).unwrap())
                    .collect::<Vec<_>>()
            });
            (t1.join().unwrap(), t2.join().unwrap())
        });
        let all: Vec<_> = x.iter().chain(&y).flatten().collect();
        assert_eq!(all.iter().filter(|s| !s.duplicate).count(), 1);
        assert!(all.iter().all(|s| s.id == all[0].id));
        assert_eq!(b.key_counts("s0", "k").unwrap().depth, 1);
    }
    // Past the window the id is free, and compaction may drop the segment.
    clock.advance(window);
    let engine = open();
    let b = engine.backend();
    b.adopt("s0").unwrap();
    let later = b.enqueue_dedup("s0", 1, &[job("inv-1")], window).unwrap();
    assert!(!later[0].duplicate, "an expired record frees the id");
    loop {
        let c = b.claim("s0", 100, 60_000).unwrap();
        if c.is_empty() {
            break;
        }
        let receipts: Vec<_> = c.iter().map(|j| j.receipt()).collect();
        b.ack("s0", &receipts).unwrap();
    }
    assert!(
        !segments(dir.path()).contains(&first_segment),
        "the expired record no longer keeps its segment"
    );
}

/// A cancel written by another process (an operator's CLI beside the
/// owning worker) holds: the owner never claims the cancelled job, a
/// running one's run is refused its ack and the job goes when its lease
/// lapses, and a restart replays the cancels (and compacts past them)
/// without bringing a job back.
#[test]
fn a_cancel_from_another_process_holds_for_the_owner_and_across_a_restart() {
    let (dir, clock) = one_shard_dir("cancel");
    let open = || open_small(&dir, &clock, 4096);
    let payload = |p: &str| format!("{p}{}", "-".repeat(700));
    {
        let owner = open();
        let operator = open();
        let (o, op) = (owner.backend(), operator.backend());
        o.adopt("s0").unwrap();
        for p in ["a", "b", "c"] {
            o.enqueue("s0", 1, &[shardq_core::NewJob::new("k", payload(p))])
                .unwrap();
        }
        let run_a = o.claim("s0", 10, 60_000).unwrap().remove(0);
        let jobs = op.key_jobs("s0", "k", 10).unwrap();
        assert_eq!(jobs.len(), 3);
        assert_eq!(jobs[0].state, shardq_core::JobState::Running);
        // The operator asks the owner's run to stop: the owner refuses its
        // ack from then (it sees the record at its next append).
        assert_eq!(
            op.cancel("s0", run_a.id).unwrap(),
            shardq_core::CancelOutcome::Stopping
        );
        assert_eq!(
            op.cancel("s0", jobs[1].id).unwrap(),
            shardq_core::CancelOutcome::Cancelled
        );
        let out = o.ack("s0", &[run_a.receipt()]).unwrap();
        assert_eq!(out.acked, 0, "the owner took the ack of a cancelled run");
        assert!(
            o.claim("s0", 10, 60_000).unwrap().is_empty(),
            "the key's next job started under the cancelled run"
        );
        clock.advance(60_001);
        let next = o.claim("s0", 10, 60_000).unwrap();
        assert_eq!(next.len(), 1);
        assert_eq!(
            next[0].payload,
            payload("c").into_bytes(),
            "the owner claimed a job another process had cancelled"
        );
        o.flush().unwrap();
    }
    let engine = open();
    let b = engine.backend();
    b.adopt("s0").unwrap();
    let left: Vec<Vec<u8>> = b
        .key_jobs("s0", "k", 10)
        .unwrap()
        .into_iter()
        .map(|j| j.payload)
        .collect();
    assert_eq!(left, [payload("c").into_bytes()], "after a restart");
    let run = b.claim("s0", 10, 60_000).unwrap();
    assert_eq!(run.len(), 1);
    b.ack("s0", &[run[0].receipt()]).unwrap();
    assert!(b.key_jobs("s0", "k", 10).unwrap().is_empty());
    assert!(b.claim("s0", 10, 60_000).unwrap().is_empty());
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run cancelled while its owner held it, then the owner gone (a crash):
/// the next owner does not run the job again; it deletes it (a Cancel
/// record) before it picks, and the key's next job runs.
#[test]
fn a_new_owner_deletes_a_job_whose_run_was_cancelled() {
    let (dir, clock) = one_shard_dir("cancel-run");
    let open = || open_small(&dir, &clock, EngineOptions::default().segment_bytes_max);
    let first_id = {
        let owner = open();
        let o = owner.backend();
        o.adopt("s0").unwrap();
        for p in ["r1", "r2"] {
            o.enqueue("s0", 1, &[shardq_core::NewJob::new("k", p)])
                .unwrap();
        }
        let run = o.claim("s0", 10, 60_000).unwrap().remove(0);
        let operator = open();
        assert_eq!(
            operator.backend().cancel("s0", run.id).unwrap(),
            shardq_core::CancelOutcome::Stopping
        );
        o.flush().unwrap();
        run.id
        // The owner goes without releasing or acking.
    };
    let next = open();
    let b = next.backend();
    b.adopt("s0").unwrap();
    let runs = b.claim("s0", 10, 60_000).unwrap();
    let got: Vec<&[u8]> = runs.iter().map(|j| &j.payload[..]).collect();
    assert_eq!(
        got,
        [b"r2"],
        "the cancelled job ran again under the new owner"
    );
    assert_eq!(b.job("s0", first_id).unwrap(), None);
    b.ack("s0", &[runs[0].receipt()]).unwrap();
    assert!(b.claim("s0", 10, 60_000).unwrap().is_empty());
    drop(next);
    // And a replay of it all agrees.
    let again = open();
    assert!(again.backend().key_jobs("s0", "k", 10).unwrap().is_empty());
    drop(again);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh data dir with one shard, `s0`, and a manual clock.
fn one_shard_dir(name: &str) -> (std::path::PathBuf, ManualClock) {
    let dir = std::env::temp_dir().join(format!("shardq-fs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let map = ShardMap::with_shards(Algorithm::Rendezvous, ["s0"]).unwrap();
    Engine::init(&dir, &map).unwrap();
    (dir, ManualClock::new(1_700_000_000_000))
}

/// An engine over `dir` on `clock`, rolling segments at `segment_bytes`.
fn open_small(dir: &std::path::Path, clock: &ManualClock, segment_bytes: u64) -> Engine {
    Engine::open(
        dir,
        EngineOptions {
            clock: Arc::new(clock.clone()),
            segment_bytes_max: segment_bytes,
            ..EngineOptions::default()
        },
    )
    .unwrap()
}

/// A back-off is a record in the shard's log: an engine opened afresh (a
/// new owner after the worker was killed) replays it and finds the job at
/// its key's head with the attempt it had, waiting out the back-off, and
/// the key's next job behind it. Then the job's one attempt still runs.
#[test]
fn a_back_off_survives_a_restart_with_its_wait_and_its_attempt() {
    let dir = std::env::temp_dir().join(format!("shardq-fs-backoff-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let map = ShardMap::with_shards(Algorithm::Rendezvous, ["s0"]).unwrap();
    Engine::init(&dir, &map).unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let open = || {
        Engine::open(
            &dir,
            EngineOptions {
                clock: Arc::new(clock.clone()),
                ..EngineOptions::default()
            },
        )
        .unwrap()
    };
    let first = {
        let engine = open();
        let b = engine.backend();
        b.adopt("s0").unwrap();
        let mut jobs = vec![shardq_core::NewJob::new("k", "first")];
        jobs.push(shardq_core::NewJob::new("k", "second"));
        for j in &mut jobs {
            j.max_attempts = 1;
        }
        b.enqueue("s0", 1, &jobs).unwrap();
        let run = b.claim("s0", 10, 60_000).unwrap().remove(0);
        assert_eq!(run.payload, b"first");
        b.back_off("s0", run.receipt(), 5_000, false).unwrap();
        b.flush().unwrap();
        run
        // Dropped without a release: the process is gone.
    };
    let engine = open();
    let b = engine.backend();
    b.adopt("s0").unwrap();
    let info = b.job("s0", first.id).unwrap().expect("still live");
    assert_eq!(info.attempts, 0, "no attempt used: {info:?}");
    assert_eq!(info.not_before_ms, clock.now_ms() + 5_000, "{info:?}");
    assert!(
        b.claim("s0", 10, 60_000).unwrap().is_empty(),
        "the key waits"
    );
    clock.advance(5_000);
    let again = b.claim("s0", 10, 60_000).unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].id, again[0].attempt), (first.id, 1));
    b.ack("s0", &[again[0].receipt()]).unwrap();
    let next = b.claim("s0", 10, 60_000).unwrap();
    assert_eq!(next[0].payload, b"second", "the key's order holds");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A resume from another process than the shard's owner (`shardq key
/// resume`) is a record in the shard's log: the owner starts the backed-off
/// job at its next claim, its attempt unused, while another key's back-off
/// stands; a restart replays the back-offs and the resume alike, and
/// compacts past them.
#[test]
fn a_resume_from_another_process_holds_for_the_owner_and_across_a_restart() {
    let (dir, clock) = one_shard_dir("resume");
    let open = || open_small(&dir, &clock, 4096);
    let payload = |p: &str| format!("{p}{}", "-".repeat(700));
    let (held_id, other_id) = {
        let owner = open();
        let operator = open();
        let (o, op) = (owner.backend(), operator.backend());
        o.adopt("s0").unwrap();
        for (k, p) in [("k", "a"), ("k", "b"), ("other", "x")] {
            o.enqueue("s0", 1, &[shardq_core::NewJob::new(k, payload(p))])
                .unwrap();
        }
        let runs = o.claim("s0", 10, 60_000).unwrap();
        assert_eq!(runs.len(), 2);
        for r in &runs {
            o.back_off("s0", r.receipt(), 3_600_000, false).unwrap();
        }
        let id_of = |k: &str| runs.iter().find(|r| r.key == k).unwrap().id;
        let hold = op
            .key_hold("s0", "k")
            .unwrap()
            .expect("the operator sees it");
        assert_eq!(hold.jobs, [id_of("k")]);
        assert_eq!(
            op.resume_key("s0", "k").unwrap(),
            shardq_core::KeyResume::Resumed(hold)
        );
        clock.advance(10);
        let next = o.claim("s0", 10, 60_000).unwrap();
        assert_eq!(next.len(), 1, "only the resumed key starts: {next:?}");
        assert_eq!((next[0].id, next[0].attempt), (id_of("k"), 1));
        o.ack("s0", &[next[0].receipt()]).unwrap();
        assert!(o.key_hold("s0", "other").unwrap().is_some());
        o.flush().unwrap();
        (id_of("k"), id_of("other"))
    };
    let engine = open();
    let b = engine.backend();
    b.adopt("s0").unwrap();
    assert_eq!(b.job("s0", held_id).unwrap(), None, "acked before");
    assert_eq!(b.key_hold("s0", "k").unwrap(), None);
    assert_eq!(
        b.key_hold("s0", "other").unwrap().map(|h| h.jobs),
        Some(vec![other_id]),
        "the other back-off is replayed as one"
    );
    let run = b.claim("s0", 10, 60_000).unwrap();
    assert_eq!(run.len(), 1);
    assert_eq!(run[0].payload, payload("b").into_bytes());
    b.ack("s0", &[run[0].receipt()]).unwrap();
    assert_eq!(
        b.resume_key("s0", "other").unwrap(),
        shardq_core::KeyResume::Resumed(shardq_core::KeyHold {
            jobs: vec![other_id],
            until_ms: 1_700_000_000_000 + 3_600_000,
        })
    );
    let run = b.claim("s0", 10, 60_000).unwrap();
    assert_eq!(run.len(), 1);
    b.ack("s0", &[run[0].receipt()]).unwrap();
    b.flush().unwrap();
    drop(engine);
    let again = open();
    let b = again.backend();
    assert!(b.key_jobs("s0", "k", 10).unwrap().is_empty());
    assert!(b.key_jobs("s0", "other", 10).unwrap().is_empty());
    drop(again);
    let _ = std::fs::remove_dir_all(&dir);
}
