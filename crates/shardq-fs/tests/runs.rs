//! Runs, receipts and fences on the embedded engine: a receipt that is not
//! the job's current run changes nothing, a lapsed job lease ends the run at
//! the next claim, and fences grow for a key across attempts, reopens, a
//! clock stepped back and compaction, and respect `run_fence_min`.

use shardq_core::{
    ClaimedJob, FailOutcome, Fence, InspectJobs, ManualClock, MoveKeys, NewJob, QueueError,
    Receipt, RunJobs,
};
use shardq_fs::{Engine, EngineOptions};

mod support;

use support::{data_dir, job, opts};

const LEASE_MS: u64 = 1_000;
const T0: u64 = 1_700_000_000_000;

fn one(jobs: Vec<ClaimedJob>) -> ClaimedJob {
    assert_eq!(jobs.len(), 1, "expected one claimed job: {jobs:?}");
    jobs.into_iter().next().unwrap()
}

fn payload(j: &ClaimedJob) -> &str {
    std::str::from_utf8(&j.payload).unwrap()
}

#[test]
fn stale_receipt_of_an_earlier_attempt_is_refused_and_changes_nothing() {
    let dir = data_dir("stale");
    let clock = ManualClock::new(T0);
    let engine = Engine::open(&dir, opts(&clock)).unwrap();
    let b = engine.backend();
    b.enqueue("shard-0", 1, &[job("k", "k1", 3), job("k", "k2", 3)])
        .unwrap();
    b.adopt("shard-0").unwrap();
    let first = one(b.claim("shard-0", 10, LEASE_MS).unwrap());
    assert_eq!((payload(&first), first.attempt), ("k1", 1));
    assert_eq!(
        b.fail("shard-0", first.receipt(), "boom", Some(0)).unwrap(),
        FailOutcome::Retry { at_ms: T0 }
    );
    let second = one(b.claim("shard-0", 10, LEASE_MS).unwrap());
    assert_eq!((second.id, second.attempt), (first.id, 2));
    assert!(second.fence > first.fence);

    // The first attempt's receipt: ack lists it stale, fail refuses it,
    // extend returns it; the second run is untouched.
    let out = b.ack("shard-0", &[first.receipt()]).unwrap();
    assert_eq!((out.acked, out.stale.clone()), (0, vec![first.receipt()]));
    let err = b
        .fail("shard-0", first.receipt(), "late", None)
        .unwrap_err();
    assert!(
        matches!(&err, QueueError::StaleReceipt { id, fence, .. } if *id == first.id.0 && *fence == first.fence),
        "{err}"
    );
    assert!(err.to_string().contains(&second.fence.to_string()), "{err}");
    assert_eq!(
        b.extend("shard-0", &[first.receipt()], LEASE_MS).unwrap(),
        vec![first.receipt()]
    );
    // A receipt with the right id and a made-up fence is stale too.
    let forged = Receipt {
        id: second.id,
        fence: second.fence + 1,
    };
    assert_eq!(b.ack("shard-0", &[forged]).unwrap().stale, vec![forged]);
    let counts = b.key_counts("shard-0", "k").unwrap();
    assert_eq!((counts.depth, counts.in_flight), (1, 1));
    assert!(b.claim("shard-0", 10, LEASE_MS).unwrap().is_empty());

    // Replay agrees: one in flight, one waiting, nothing dead.
    let fresh = Engine::open(&dir, opts(&clock)).unwrap();
    let st = fresh.status().unwrap().totals;
    assert_eq!((st.ready, st.in_flight, st.dead), (1, 1, 0));

    // The current receipt acks, once, even if given twice.
    let out = b
        .ack("shard-0", &[second.receipt(), second.receipt()])
        .unwrap();
    assert_eq!((out.acked, out.stale.len()), (1, 1));
    assert_eq!(
        payload(&one(b.claim("shard-0", 10, LEASE_MS).unwrap())),
        "k2"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lapsed_job_lease_puts_the_job_back_at_the_head_with_attempt_plus_one() {
    let dir = data_dir("lapse");
    let clock = ManualClock::new(T0);
    let engine = Engine::open(&dir, opts(&clock)).unwrap();
    let b = engine.backend();
    b.enqueue("shard-0", 1, &[job("k", "a1", 3), job("k", "a2", 3)])
        .unwrap();
    b.adopt("shard-0").unwrap();
    let run1 = one(b.claim("shard-0", 10, LEASE_MS).unwrap());
    assert_eq!(run1.lease_until_ms, T0 + LEASE_MS);

    // Until the lease ends the key stays blocked; an extend prolongs it.
    clock.advance(LEASE_MS - 1);
    assert!(b.claim("shard-0", 10, LEASE_MS).unwrap().is_empty());
    assert!(b
        .extend("shard-0", &[run1.receipt()], LEASE_MS)
        .unwrap()
        .is_empty());
    clock.advance(LEASE_MS - 1);
    assert!(
        b.claim("shard-0", 10, LEASE_MS).unwrap().is_empty(),
        "extended"
    );

    // Lapsed: the next claim ends the run and hands out the same job again
    // (not a2), attempt + 1, with a larger fence.
    clock.advance(1);
    let run2 = one(b.claim("shard-0", 10, LEASE_MS).unwrap());
    assert_eq!((payload(&run2), run2.attempt, run2.id), ("a1", 2, run1.id));
    assert!(run2.fence > run1.fence);
    assert_eq!(
        b.ack("shard-0", &[run1.receipt()]).unwrap().stale,
        vec![run1.receipt()]
    );
    assert!(matches!(
        b.fail("shard-0", run1.receipt(), "late", None),
        Err(QueueError::StaleReceipt { .. })
    ));

    // Replay counts the lapsed run as a failed attempt: after a reopen and
    // adopt the job runs with attempt 3, still before a2.
    let reopened = Engine::open(&dir, opts(&clock)).unwrap();
    let rb = reopened.backend();
    rb.adopt("shard-0").unwrap();
    let run3 = one(rb.claim("shard-0", 10, LEASE_MS).unwrap());
    assert_eq!((payload(&run3), run3.attempt), ("a1", 3));
    assert!(run3.fence > run2.fence);
    // Out of attempts: the lapse dead-letters it and a2 runs.
    clock.advance(LEASE_MS);
    let next = one(rb.claim("shard-0", 10, LEASE_MS).unwrap());
    assert_eq!(payload(&next), "a2");
    let dead = rb.dead_list("shard-0", 10).unwrap();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].reason.contains("lease lapsed"),
        "{}",
        dead[0].reason
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fences_grow_across_attempts_reopen_and_a_clock_stepped_back() {
    let dir = data_dir("fences");
    let clock = ManualClock::new(T0);
    let mut fences = Vec::new();
    {
        let engine = Engine::open(&dir, opts(&clock)).unwrap();
        let b = engine.backend();
        b.enqueue("shard-0", 1, &[job("k", "x", 10)]).unwrap();
        b.adopt("shard-0").unwrap();
        // Same millisecond: the counter, not the clock, makes them grow.
        for _ in 0..3 {
            let r = one(b.claim("shard-0", 10, LEASE_MS).unwrap());
            fences.push(r.fence);
            b.fail("shard-0", r.receipt(), "again", Some(0)).unwrap();
        }
        let last = one(b.claim("shard-0", 10, LEASE_MS).unwrap());
        fences.push(last.fence);
        assert_eq!(b.ack("shard-0", &[last.receipt()]).unwrap().acked, 1);
        assert_eq!(
            b.shard_stats("shard-0").unwrap().fence_high,
            *fences.last().unwrap()
        );
    }
    // A new backend on the same dir, with the clock an hour behind.
    clock.set(T0 - 3_600_000);
    let engine = Engine::open(&dir, opts(&clock)).unwrap();
    let b = engine.backend();
    assert_eq!(
        b.shard_stats("shard-0").unwrap().fence_high,
        *fences.last().unwrap(),
        "replay restores the high-water"
    );
    // The key's next job, due at once on the stepped-back clock.
    b.enqueue("shard-0", 1, &[job("k", "y", 10)]).unwrap();
    b.adopt("shard-0").unwrap();
    let r = one(b.claim("shard-0", 10, LEASE_MS).unwrap());
    assert_eq!(payload(&r), "y");
    fences.push(r.fence);
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences must grow strictly: {fences:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fence_high_water_survives_compaction_of_every_claim() {
    let dir = data_dir("fences-compact");
    let clock = ManualClock::new(T0);
    let small = || EngineOptions {
        segment_bytes_max: 4096,
        durability: shardq_fs::Durability::None,
        ..opts(&clock)
    };
    let high = {
        let engine = Engine::open(&dir, small()).unwrap();
        let b = engine.backend();
        b.adopt("shard-0").unwrap();
        for round in 0..100 {
            let jobs: Vec<NewJob> = (0..10)
                .map(|i| NewJob::new(format!("k{i}"), vec![round as u8; 100]))
                .collect();
            b.enqueue("shard-0", 1, &jobs).unwrap();
            let c = b.claim("shard-0", 100, LEASE_MS).unwrap();
            let rs: Vec<Receipt> = c.iter().map(|j| j.receipt()).collect();
            assert_eq!(b.ack("shard-0", &rs).unwrap().acked, 10);
        }
        b.shard_stats("shard-0").unwrap().fence_high
    };
    let segs = shardq_fs::storage::list_segments(&dir.join("shard-0")).unwrap();
    assert!(segs[0] > 0, "the segments with the first claims are gone");
    clock.set(T0 - 3_600_000);
    let engine = Engine::open(&dir, small()).unwrap();
    let b = engine.backend();
    assert!(b.shard_stats("shard-0").unwrap().fence_high >= high);
    b.enqueue("shard-0", 1, &[NewJob::new("k0", "after")])
        .unwrap();
    b.adopt("shard-0").unwrap();
    let r = one(b.claim("shard-0", 10, LEASE_MS).unwrap());
    assert!(r.fence > high, "{} <= {high}", r.fence);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_fence_min_is_honoured() {
    let dir = data_dir("fence-min");
    let clock = ManualClock::new(T0);
    let engine = Engine::open(&dir, opts(&clock)).unwrap();
    let b = engine.backend();
    let floor = T0 * 1000 * 2;
    b.set_fence(
        "shard-0",
        &Fence {
            run_fence_min: floor,
            ..Fence::default()
        },
    )
    .unwrap();
    assert_eq!(b.fence("shard-0").unwrap().run_fence_min, floor);
    b.enqueue("shard-0", 1, &[job("k", "x", 5), job("j", "y", 5)])
        .unwrap();
    b.adopt("shard-0").unwrap();
    let c = b.claim("shard-0", 10, LEASE_MS).unwrap();
    assert_eq!(c.len(), 2);
    assert!(c[0].fence >= floor && c[1].fence > c[0].fence, "{c:?}");
    // A fence.json without run_fence_min (what an earlier development
    // build wrote) is refused naming the file and the field: read as 0, it
    // would let this shard issue fences below the key's earlier runs.
    std::fs::write(
        dir.join("shard-0").join("fence.json"),
        r#"{"map_version_min":0,"paused_keys":[]}"#,
    )
    .unwrap();
    let err = b.fence("shard-0").unwrap_err().to_string();
    assert!(
        err.contains("fence.json") && err.contains("run_fence_min"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn claims_refuse_a_lease_out_of_bounds() {
    let dir = data_dir("lease-bounds");
    let clock = ManualClock::new(T0);
    let engine = Engine::open(&dir, opts(&clock)).unwrap();
    let b = engine.backend();
    b.adopt("shard-0").unwrap();
    let err = b.claim("shard-0", 1, 5).unwrap_err().to_string();
    assert!(err.contains("5 ms"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
