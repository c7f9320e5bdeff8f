//! The contract's checks of reading, cancelling and settings: job views,
//! cancels of waiting and running jobs, settings changes never lost, and a
//! store that went back in time.

use super::*;

/// An operator reads a live job by id and a key's live jobs in key order,
/// with their state, attempts, reason and payload; cancels a queued, a
/// delayed or a dead job so that it never runs, and the key's next job
/// becomes due at once; a finished, a cancelled or an unknown id is not
/// found. Other keys are untouched.
/// Long on purpose: one scenario on one set of keys, each read and cancel
/// checked on the state the ones before it left.
pub fn jobs_can_be_read_and_cancelled(h: &dyn ContractHarness) {
    let b = h.backend();
    let shard = h.fresh_shard();
    let ids = |key: &str| -> Vec<JobId> {
        b.key_jobs(&shard, key, 100)
            .expect("key_jobs")
            .into_iter()
            .map(|j| j.id)
            .collect()
    };
    // a: dead; b: running; c: queued; d: delayed an hour; e: queued.
    enqueue(h, &shard, "k", "a", 1);
    let run = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    b.fail(&shard, run.receipt(), "boom", None).expect("fail");
    for p in ["b", "c"] {
        enqueue(h, &shard, "k", p, 5);
    }
    let mut d = NewJob::new("k", "d");
    d.delay_ms = 3_600_000;
    b.enqueue(&shard, u64::MAX, &[d]).expect("enqueue");
    enqueue(h, &shard, "k", "e", 5);
    enqueue(h, &shard, "other", "o", 5);
    let runs = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(runs.len(), 2, "k's head and other's head start");
    let run_b = runs.iter().find(|r| r.key == "k").expect("k runs").clone();
    assert_eq!(&run_b.payload[..], b"b");

    let all = b.key_jobs(&shard, "k", 100).expect("key_jobs");
    let seen: Vec<(&[u8], JobState)> = all.iter().map(|j| (&j.payload[..], j.state)).collect();
    assert_eq!(
        seen,
        [
            (&b"a"[..], JobState::Dead),
            (&b"b"[..], JobState::Running),
            (&b"c"[..], JobState::Queued),
            (&b"d"[..], JobState::Delayed),
            (&b"e"[..], JobState::Queued),
        ],
        "a key's live jobs in key order, with their states"
    );
    assert_eq!(
        (all[0].attempts, all[0].reason.as_deref()),
        (1, Some("boom")),
        "the dead letter's attempts and reason"
    );
    // Each attempt's start time: the dead letter's one, the running job's
    // one, none for a job not started yet; the dead list says the same.
    assert_eq!(
        all.iter()
            .map(|j| j.attempt_starts_ms.len())
            .collect::<Vec<_>>(),
        [1, 1, 0, 0, 0],
        "attempt start times: {all:?}"
    );
    assert!(all[1].attempt_starts_ms[0] >= all[0].attempt_starts_ms[0]);
    let listed = b.dead_list(&shard, 10).expect("dead list");
    assert_eq!(listed[0].attempt_starts_ms, all[0].attempt_starts_ms);
    assert_eq!(
        all[1].run.map(|r| r.0),
        Some(run_b.fence),
        "the run's fence"
    );
    assert_eq!((all[2].attempts, all[2].max_attempts), (0, 5));
    assert!(all[3].not_before_ms > all[2].not_before_ms + 3_000_000);
    assert_eq!(b.key_jobs(&shard, "k", 2).expect("key_jobs").len(), 2);
    let one = b.job(&shard, all[2].id).expect("job").expect("c is live");
    assert_eq!(
        one, all[2],
        "a job by id reads as it does in its key's list"
    );
    assert_eq!(b.job(&shard, JobId(u64::MAX / 2)).expect("job"), None);

    assert_eq!(
        b.cancel(&shard, all[2].id).expect("cancel"),
        CancelOutcome::Cancelled
    );
    assert_eq!(
        b.cancel(&shard, all[2].id).expect("cancel"),
        CancelOutcome::NotFound
    );
    assert_eq!(
        b.cancel(&shard, all[0].id).expect("cancel"),
        CancelOutcome::Cancelled
    );
    assert_eq!(
        b.job(&shard, all[2].id).expect("job"),
        None,
        "a cancelled job is gone"
    );
    assert_eq!(b.dead_list(&shard, 10).expect("dead list").len(), 0);
    assert_eq!(ids("k"), [all[1].id, all[3].id, all[4].id]);

    ack_one(h, &shard, run_b.receipt());
    assert_eq!(
        b.job(&shard, run_b.id).expect("job"),
        None,
        "an acked job is not live"
    );
    assert!(
        claim(h, &shard, 10, LONG_LEASE_MS).is_empty(),
        "the delayed head holds its key"
    );
    assert_eq!(
        b.cancel(&shard, all[3].id).expect("cancel"),
        CancelOutcome::Cancelled
    );
    let next = claim(h, &shard, 10, LONG_LEASE_MS);
    let got: Vec<&[u8]> = next.iter().map(|j| &j.payload[..]).collect();
    assert_eq!(
        got,
        [b"e"],
        "the key's next job is due once its delayed head is cancelled"
    );
    assert_eq!(
        b.cancel(&shard, JobId(u64::MAX / 2)).expect("cancel"),
        CancelOutcome::NotFound
    );
    assert_eq!(b.key_counts(&shard, "other").expect("counts").in_flight, 1);
    assert_eq!(ids("k"), [next[0].id]);
    // A key sealed for a move: its jobs may have copies on the new shard,
    // so a cancel here is refused until the move is done.
    enqueue(h, &shard, "moving", "m", 5);
    let m = b.key_jobs(&shard, "moving", 10).expect("key_jobs")[0].id;
    let mut fence = b.fence(&shard).expect("fence");
    fence
        .sealed_keys
        .insert("moving".into(), "elsewhere".into());
    b.set_fence(&shard, &fence).expect("seal");
    assert_eq!(b.cancel(&shard, m).expect("cancel"), CancelOutcome::Moving);
    assert!(
        b.job(&shard, m).expect("job").is_some(),
        "a refused cancel changed the job"
    );
    fence.sealed_keys.clear();
    b.set_fence(&shard, &fence).expect("unseal");
    assert_eq!(
        b.cancel(&shard, m).expect("cancel"),
        CancelOutcome::Cancelled
    );
}

/// A running job's cancel asks its run to stop: its ack and extend are
/// refused from then, the key's next job does not start while the run's
/// job lease lasts (no two runs of a key overlap), and when it lapses the
/// job is gone, not retried, and the next job starts. A backend that
/// cannot stop a run says so ([`CancelOutcome::Running`]) and changes
/// nothing.
pub fn a_running_job_cancelled_ends_with_its_run(h: &dyn ContractHarness) {
    let b = h.backend();
    let shard = h.fresh_shard();
    let lease = h.short_lease_ms();
    enqueue(h, &shard, "k", "r1", 5);
    enqueue(h, &shard, "k", "r2", 5);
    let run = claim(h, &shard, 10, lease).remove(0);
    assert_eq!(&run.payload[..], b"r1");
    match b.cancel(&shard, run.id).expect("cancel") {
        CancelOutcome::Running => {
            let out = b.ack(&shard, &[run.receipt()]).expect("ack");
            assert_eq!(
                out.acked, 1,
                "a cancel that answered Running changed the run"
            );
            return;
        }
        CancelOutcome::Stopping => {}
        other => panic!("a running job's cancel answered {other:?}"),
    }
    assert_eq!(
        b.cancel(&shard, run.id).expect("cancel"),
        CancelOutcome::Stopping,
        "a second cancel of the stopping run"
    );
    let info = b.job(&shard, run.id).expect("job").expect("still live");
    assert_eq!(info.state, JobState::Running, "it runs until its run ends");
    let stale = b.extend(&shard, &[run.receipt()], lease).expect("extend");
    assert_eq!(
        stale,
        [run.receipt()],
        "a cancelled run's extend must be refused"
    );
    let out = b.ack(&shard, &[run.receipt()]).expect("ack");
    assert_eq!(
        (out.acked, out.stale.len()),
        (0, 1),
        "a cancelled run's ack must be refused"
    );
    assert!(
        claim(h, &shard, 10, lease).is_empty(),
        "the key's next job started while the cancelled run's lease lasted"
    );
    h.pass_ms(lease + 1);
    let next = claim(h, &shard, 10, LONG_LEASE_MS);
    let got: Vec<&[u8]> = next.iter().map(|j| &j.payload[..]).collect();
    assert_eq!(
        got,
        [b"r2"],
        "the cancelled job ran again, or the next did not start"
    );
    assert_eq!(
        b.job(&shard, run.id).expect("job"),
        None,
        "the cancelled job is gone"
    );
    ack_one(h, &shard, next[0].receipt());
    assert!(claim(h, &shard, 10, LONG_LEASE_MS).is_empty());
}

/// A cancelled run whose handler stopped and failed is over: the failure
/// is refused (the job was cancelled, never retried), the job is gone at
/// once and kept as cancelled, and the key's next job starts without
/// waiting for the cancelled run's job lease. An older run's late failure
/// ends nothing.
pub fn a_cancelled_runs_failure_ends_it_at_once(h: &dyn ContractHarness) {
    let b = h.backend();
    let shard = h.fresh_shard();
    enqueue(h, &shard, "k", "c1", 5);
    enqueue(h, &shard, "k", "c2", 5);
    let lease = h.short_lease_ms();
    // A first run that lapses, so a late result of an older run exists.
    let old = claim(h, &shard, 10, lease).remove(0);
    h.pass_ms(lease + 1);
    let run = claim(h, &shard, 10, LONG_LEASE_MS).remove(0);
    assert_eq!((&run.payload[..], run.id), (&b"c1"[..], old.id));
    match b.cancel(&shard, run.id).expect("cancel") {
        // A backend that cannot stop a run changes nothing.
        CancelOutcome::Running => return,
        CancelOutcome::Stopping => {}
        other => panic!("a running job's cancel answered {other:?}"),
    }
    let late = b.fail(&shard, old.receipt(), "late", None);
    assert!(
        matches!(late, Err(QueueError::StaleReceipt { .. })),
        "an older run's failure: {late:?}"
    );
    assert!(
        claim(h, &shard, 10, LONG_LEASE_MS).is_empty(),
        "an older run's late failure ended the cancelled run"
    );
    let failed = b.fail(&shard, run.receipt(), "killed: cancelled", None);
    assert!(
        matches!(failed, Err(QueueError::StaleReceipt { .. })),
        "a cancelled run's failure must be refused: {failed:?}"
    );
    assert_eq!(
        b.job(&shard, run.id).expect("job"),
        None,
        "the cancelled job is gone once its run failed"
    );
    let next = claim(h, &shard, 10, LONG_LEASE_MS);
    let got: Vec<&[u8]> = next.iter().map(|j| &j.payload[..]).collect();
    assert_eq!(
        got,
        [b"c2"],
        "the key's next job waited for the cancelled run's lease"
    );
    let kept = b.finished(&shard, Some("k"), 10).expect("finished");
    assert!(
        kept.iter()
            .any(|f| f.id == run.id && f.outcome == shardq_core::job::Finish::Cancelled),
        "the cancelled job is kept as cancelled: {kept:?}"
    );
    ack_one(h, &shard, next[0].receipt());
}

/// A run a cancel stopped is stale to [`RunJobs::stale_runs`] at once, as
/// are a receipt of an ended run and one with another fence; a current
/// run is not. The read changes nothing: it extends no lease (a run it
/// called current still lapses and runs again) and ends no run (the key's
/// next job waits for the cancelled run's end as before).
///
/// [`RunJobs::stale_runs`]: shardq_core::RunJobs::stale_runs
pub fn a_cancelled_run_is_stale_to_a_read_at_once(h: &dyn ContractHarness) {
    let b = h.backend();
    let shard = h.fresh_shard();
    let lease = h.short_lease_ms();
    enqueue(h, &shard, "k", "s1", 5);
    enqueue(h, &shard, "k", "s2", 5);
    enqueue(h, &shard, "o", "o1", 5);
    let runs = claim(h, &shard, 10, lease);
    let run = runs.iter().find(|r| r.key == "k").expect("k runs").clone();
    let other = runs.iter().find(|r| r.key == "o").expect("o runs").clone();
    let both = [run.receipt(), other.receipt()];
    assert_eq!(
        b.stale_runs(&shard, &both).expect("stale_runs"),
        [],
        "current runs read as stale"
    );
    let wrong_fence = Receipt {
        id: run.id,
        fence: run.fence + 1,
    };
    let unknown = Receipt {
        id: JobId(run.id.0 + 1_000_000),
        fence: 1,
    };
    assert_eq!(
        b.stale_runs(&shard, &[wrong_fence, unknown])
            .expect("stale_runs"),
        [wrong_fence, unknown],
        "a receipt of no current run must read as stale"
    );
    match b.cancel(&shard, run.id).expect("cancel") {
        // A backend that cannot stop a run changes nothing.
        CancelOutcome::Running => return,
        CancelOutcome::Stopping => {}
        other => panic!("a running job's cancel answered {other:?}"),
    }
    assert_eq!(
        b.stale_runs(&shard, &both).expect("stale_runs"),
        [run.receipt()],
        "the cancelled run must read as stale at once, the other as current"
    );
    assert!(
        claim(h, &shard, 10, lease).is_empty(),
        "reading the cancelled run as stale ended it before its handler did"
    );
    // Read again and again while the leases run out: nothing is extended.
    h.pass_ms(lease / 2);
    assert_eq!(
        b.stale_runs(&shard, &[other.receipt()])
            .expect("stale_runs"),
        []
    );
    h.pass_ms(lease / 2 + 1);
    let again = claim(h, &shard, 10, LONG_LEASE_MS);
    let mut got: Vec<&[u8]> = again.iter().map(|j| &j.payload[..]).collect();
    got.sort_unstable();
    assert_eq!(
        got,
        [&b"o1"[..], b"s2"],
        "a run read as current lapsed and ran again, and the cancelled job's \
         key went on with its next job"
    );
    assert_eq!(
        b.stale_runs(&shard, &both).expect("stale_runs"),
        both,
        "runs that ended must read as stale"
    );
    for j in &again {
        ack_one(h, &shard, j.receipt());
    }
}

/// A store that went back in time (job ids and fences it handed out are
/// unknown to it again) is refused with [`QueueError::StoreLost`] naming
/// the shard, by the enqueue and the claim that would otherwise hand out an
/// id or a fence a second time.
pub fn rewound_store_is_refused(h: &dyn RewindHarness) {
    let shard = h.fresh_shard();
    enqueue(h, &shard, "t", "1", 5);
    h.checkpoint(&shard);
    enqueue(h, &shard, "t", "2", 5);
    enqueue(h, &shard, "u", "3", 5);
    let runs = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(runs.len(), 2, "one run per key");
    ack_one(h, &shard, runs[0].receipt());
    h.rewind(&shard);
    let lost = |what: &str, r: Result<(), QueueError>| match r {
        Err(QueueError::StoreLost(msg)) => assert!(
            msg.contains(&shard),
            "the StoreLost of {what} must name shard {shard}: {msg}"
        ),
        other => panic!(
            "{what} on a store that went back in time must fail with StoreLost (it would hand out \
             ids or fences twice), got {other:?}"
        ),
    };
    lost(
        "an enqueue",
        h.backend()
            .enqueue(&shard, u64::MAX, &[NewJob::new("v", "4")])
            .map(|_| ()),
    );
    lost(
        "a claim",
        h.backend().claim(&shard, 10, LONG_LEASE_MS).map(|_| ()),
    );
}

/// The map store's settings: [`shardq_core::reshard::update_setting`] over
/// [`shardq_core::reshard::MapStore::swap_setting`] loses no change. Writers in
/// threads, each through one of `stores` (several handles on one store
/// stand for several processes or servers), each add their own entries to
/// one setting and clear another behind each other: every acknowledged
/// entry is stored once, and no reader ever sees a text that does not
/// parse.
pub fn settings_changes_are_never_lost(
    stores: &[std::sync::Arc<dyn shardq_core::reshard::MapStore>],
) {
    use shardq_core::reshard::{update_setting, ReshardError};
    const WRITERS: usize = 8;
    const CHANGES: usize = 25;
    let name = "contract-settings";
    let read = |t: Option<&str>| -> Vec<String> {
        t.map(|t| serde_json::from_str(t).unwrap_or_else(|e| panic!("{t:?} does not parse: {e}")))
            .unwrap_or_default()
    };
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut reads = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let t = stores[0].load_setting(name).unwrap();
                read(t.as_deref());
                reads += 1;
            }
            reads
        });
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let store = &stores[w % stores.len()];
                scope.spawn(move || {
                    for i in 0..CHANGES {
                        update_setting(&**store, name, |cur| {
                            let mut all = read(cur);
                            all.push(format!("w{w}-{i}"));
                            Ok::<_, ReshardError>((Some(serde_json::to_string(&all).unwrap()), ()))
                        })
                        .unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(reader.join().unwrap() > 0);
    });
    let all = read(stores[0].load_setting(name).unwrap().as_deref());
    assert_eq!(all.len(), WRITERS * CHANGES, "changes lost: {all:?}");
    let unique: std::collections::BTreeSet<_> = all.iter().collect();
    assert_eq!(unique.len(), all.len(), "a change stored twice: {all:?}");
    // A compare-and-set against a text no longer there stores nothing.
    assert!(!stores[0].swap_setting(name, Some("[]"), None).unwrap());
    assert_eq!(
        read(stores[0].load_setting(name).unwrap().as_deref()).len(),
        all.len()
    );
    // Clearing goes through the same primitive.
    stores[0].store_setting(name, None).unwrap();
    assert_eq!(stores[0].load_setting(name).unwrap(), None);
}
