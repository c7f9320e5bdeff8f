//! The contract's checks of running jobs: per-key order, one run per
//! key, receipts and fences, job leases, retries, results and the
//! finished jobs kept.

use super::*;

/// Finished jobs are kept for the retention (harnesses open their backend
/// with the default, a day): an acked job as completed with its attempts,
/// their starts and its last failure's reason; a cancelled one (queued, or
/// running until its run ends) as cancelled; newest first, by key or all;
/// live jobs are not among them; past the retention's age they are gone.
/// A result given with an ack is kept with the finished job, byte for
/// byte (any bytes, the separators of a store's own format included); a
/// job acked without one has none; a result over the bound is refused
/// with nothing acked; a stale receipt's result is dropped with it.
pub fn a_handlers_result_is_kept_with_its_finished_job(h: &dyn ContractHarness) {
    use shardq_core::job::{Finish, RESULT_BYTES_MAX};
    let shard = h.fresh_shard();
    let b = h.backend();
    for k in ["ra", "rb", "rc"] {
        enqueue(h, &shard, k, k, 3);
    }
    let runs = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(runs.len(), 3);
    let by_key = |k: &str| runs.iter().find(|r| r.key == k).expect("claimed").clone();
    let (ra, rb, rc) = (by_key("ra"), by_key("rb"), by_key("rc"));
    // Over the bound: refused, nothing acked.
    let big = vec![b'x'; RESULT_BYTES_MAX + 1];
    let err = b
        .ack_results(&shard, &[ra.receipt()], &[Some(big)])
        .expect_err("a result over the bound is refused");
    assert!(err.to_string().contains("result"), "{err}");
    assert_eq!(
        b.job(&shard, ra.id).expect("job").map(|j| j.id),
        Some(ra.id)
    );
    // Results that are not text, and that hold the store's separators.
    let odd: Vec<u8> = b"a|b\n\"c\"\x00\xff|9|".to_vec();
    let full = vec![b'z'; RESULT_BYTES_MAX];
    let out = b
        .ack_results(
            &shard,
            &[ra.receipt(), rb.receipt(), rc.receipt()],
            &[Some(odd.clone()), None, Some(full.clone())],
        )
        .expect("ack with results");
    assert_eq!((out.acked, out.stale.len()), (3, 0));
    let got = |k: &str| {
        let f = b.finished(&shard, Some(k), 10).expect("finished");
        assert_eq!(f.len(), 1, "{k}: {f:?}");
        assert_eq!(f[0].outcome, Finish::Completed);
        f[0].result.clone()
    };
    assert_eq!(got("ra"), Some(odd), "bytes kept as given");
    assert_eq!(got("rb"), None, "no result given, none kept");
    assert_eq!(got("rc").map(|r| r.len()), Some(RESULT_BYTES_MAX));
    // A stale receipt's result is dropped with it.
    enqueue(h, &shard, "rd", "rd", 3);
    let rd = claim(h, &shard, 10, LONG_LEASE_MS).remove(0);
    ack_one(h, &shard, rd.receipt());
    let again = b
        .ack_results(&shard, &[rd.receipt()], &[Some(b"late".to_vec())])
        .expect("a stale ack answers");
    assert_eq!((again.acked, again.stale.len()), (0, 1));
    let f = b.finished(&shard, Some("rd"), 10).expect("finished");
    assert_eq!((f.len(), f[0].result.clone()), (1, None));
}

pub fn finished_jobs_are_kept_newest_first(h: &dyn ContractHarness) {
    use shardq_core::job::Finish;
    let shard = h.fresh_shard();
    let b = h.backend();
    assert!(b.finished(&shard, None, 10).expect("finished").is_empty());
    enqueue(h, &shard, "h", "a", 3);
    enqueue(h, &shard, "h", "b", 3);
    enqueue(h, &shard, "other", "c", 3);
    let first = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(first.len(), 2);
    let a = first.iter().find(|j| j.key == "h").expect("a").clone();
    let c = first.iter().find(|j| j.key == "other").expect("c").clone();
    b.fail(&shard, a.receipt(), "flaky", Some(0)).expect("fail");
    ack_one(h, &shard, c.receipt());
    h.pass_ms(1);
    let again = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!((again.len(), again[0].id, again[0].attempt), (1, a.id, 2));
    ack_one(h, &shard, again[0].receipt());
    let queued_b = b.key_jobs(&shard, "h", 10).expect("key_jobs")[0].id;
    assert_eq!(
        b.cancel(&shard, queued_b).expect("cancel"),
        CancelOutcome::Cancelled
    );
    let got = b.finished(&shard, Some("h"), 10).expect("finished");
    let seen: Vec<(JobId, Finish, u32)> =
        got.iter().map(|f| (f.id, f.outcome, f.attempts)).collect();
    assert_eq!(
        seen,
        [
            (queued_b, Finish::Cancelled, 0),
            (a.id, Finish::Completed, 2)
        ],
        "key h's finished jobs, newest first: {got:?}"
    );
    let done_a = &got[1];
    assert_eq!(done_a.reason.as_deref(), Some("flaky"), "{done_a:?}");
    assert_eq!(done_a.attempt_starts_ms.len(), 2, "{done_a:?}");
    assert!(
        done_a.finished_ms >= done_a.attempt_starts_ms[1],
        "{done_a:?}"
    );
    let all = b.finished(&shard, None, 10).expect("finished");
    assert_eq!(all.len(), 3, "{all:?}");
    assert!(all.iter().any(|f| f.id == c.id && f.reason.is_none()));
    assert_eq!(b.finished(&shard, None, 1).expect("finished").len(), 1);
    // A running job cancelled is kept as cancelled when its run ends.
    enqueue(h, &shard, "r", "x", 3);
    let lease = h.short_lease_ms();
    let run = claim(h, &shard, 10, lease).remove(0);
    assert_eq!(
        b.cancel(&shard, run.id).expect("cancel"),
        CancelOutcome::Stopping
    );
    assert!(
        b.finished(&shard, Some("r"), 10)
            .expect("finished")
            .is_empty(),
        "a stopping run has not finished"
    );
    h.pass_ms(lease + 1);
    let _ = claim(h, &shard, 10, LONG_LEASE_MS);
    let r = b.finished(&shard, Some("r"), 10).expect("finished");
    assert_eq!(
        r.iter().map(|f| (f.id, f.outcome)).collect::<Vec<_>>(),
        [(run.id, Finish::Cancelled)],
        "{r:?}"
    );
    // One ack of a batch: its last receipt is the newest.
    let batch_shard = h.fresh_shard();
    for k in ["b1", "b2", "b3"] {
        enqueue(h, &batch_shard, k, "x", 3);
    }
    let runs = claim(h, &batch_shard, 10, LONG_LEASE_MS);
    let mut order: Vec<Receipt> = runs.iter().map(|r| r.receipt()).collect();
    order.swap(0, 2);
    assert_eq!(b.ack(&batch_shard, &order).expect("ack").acked, 3);
    let newest: Vec<JobId> = (b.finished(&batch_shard, None, 10).expect("finished"))
        .iter()
        .map(|f| f.id)
        .collect();
    let want: Vec<JobId> = order.iter().rev().map(|r| r.id).collect();
    assert_eq!(newest, want, "a batch's acks, newest (last) first");
    // Past the retention's age they are forgotten.
    h.pass_ms(shardq_core::job::FINISHED_AGE_MS_DEFAULT + 1);
    assert!(
        b.finished(&shard, None, 10).expect("finished").is_empty(),
        "kept past the retention's age"
    );
}

/// A failed attempt whose handler named no delay waits the backoff of its
/// key's rule ([`retry_rules`]): the key's own rule over its longest
/// prefix's, a prefix's over the backend's default; a delay the handler
/// names wins over every rule.
pub fn a_keys_retry_rule_decides_its_wait(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    let keys = [
        "contract-slow:a",
        "contract-slow:fast",
        "plain",
        "contract-slow:named",
    ];
    for k in keys {
        enqueue(h, &shard, k, "x", 5);
    }
    let runs = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(runs.len(), keys.len());
    let mut at = std::collections::BTreeMap::new();
    for r in &runs {
        let named = (r.key == "contract-slow:named").then_some(5);
        match b.fail(&shard, r.receipt(), "down", named).expect("fail") {
            shardq_core::job::FailOutcome::Retry { at_ms } => at.insert(r.key.as_str(), at_ms),
            other => panic!(
                "{}: a first failure of five attempts must retry, got {other:?}",
                r.key
            ),
        };
    }
    let (slow, fast, plain, named) = (
        at["contract-slow:a"],
        at["contract-slow:fast"],
        at["plain"],
        at["contract-slow:named"],
    );
    // The fails ran within a minute of each other on any harness.
    assert!(
        slow >= fast + 3_540_000,
        "the prefix rule's hour: retry at {slow}, the key rule's 1 ms at {fast}"
    );
    assert!(
        slow >= plain + 3_540_000 - shardq_core::job::BACKOFF_MAX_MS_DEFAULT.min(60_000),
        "a key without a rule must not wait its neighbour's hour: {plain} vs {slow}"
    );
    assert!(
        named + 3_000_000 < slow,
        "a delay the handler names beats the rule: {named} vs {slow}"
    );
}

/// A key's jobs start in enqueue order, across keys interleaved.
pub fn keys_start_in_enqueue_order(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    for i in 0..20 {
        enqueue(h, &shard, &format!("k{}", i % 3), &i.to_string(), 5);
    }
    let mut seen: Vec<(String, u32)> = Vec::new();
    loop {
        let jobs = claim(h, &shard, 100, LONG_LEASE_MS);
        if jobs.is_empty() {
            break;
        }
        for j in jobs {
            seen.push((
                j.key.clone(),
                String::from_utf8_lossy(&j.payload).parse().unwrap(),
            ));
            ack_one(h, &shard, j.receipt());
        }
    }
    assert_eq!(seen.len(), 20, "every job runs once");
    for k in ["k0", "k1", "k2"] {
        let order: Vec<u32> = seen
            .iter()
            .filter(|(x, _)| x == k)
            .map(|(_, n)| *n)
            .collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(order, sorted, "key {k} ran out of order");
    }
}

/// While a key has a run in flight, no claim hands out another of its jobs.
pub fn one_run_per_key(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    for i in 0..3 {
        enqueue(h, &shard, "solo", &i.to_string(), 5);
    }
    let first = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(first.len(), 1, "one run per key at a time");
    assert!(
        claim(h, &shard, 10, LONG_LEASE_MS).is_empty(),
        "a second run of a busy key started"
    );
    ack_one(h, &shard, first[0].receipt());
    let second = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].payload, b"1");
}

/// A receipt of an earlier run, or of a finished one, changes nothing.
pub fn stale_receipts_change_nothing(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    enqueue(h, &shard, "r", "a", 5);
    enqueue(h, &shard, "r", "b", 5);
    let run1 = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    h.backend()
        .fail(&shard, run1.receipt(), "first try", Some(0))
        .expect("fail of the current run");
    let run2 = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    assert_eq!(
        run2.id, run1.id,
        "a failed job retries before its key's later jobs"
    );
    assert_eq!(run2.attempt, run1.attempt + 1);
    // The first run's late ack and fail are refused.
    let out = h
        .backend()
        .ack(&shard, &[run1.receipt()])
        .expect("ack call");
    assert_eq!((out.acked, out.stale.clone()), (0, vec![run1.receipt()]));
    match h.backend().fail(&shard, run1.receipt(), "late", None) {
        Err(QueueError::StaleReceipt { .. }) => {}
        other => panic!("a stale fail must be refused, got {other:?}"),
    }
    // Still exactly one run in flight: the key's next job has not started.
    assert!(claim(h, &shard, 10, LONG_LEASE_MS).is_empty());
    ack_one(h, &shard, run2.receipt());
    // A finished run's receipt is stale too.
    let again = h
        .backend()
        .ack(&shard, &[run2.receipt()])
        .expect("ack call");
    assert_eq!(again.acked, 0);
    let next = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    assert_eq!(next.payload, b"b", "the acked job must not run again");
    // The same receipt twice in one batch: acked once, then stale.
    let twice = h
        .backend()
        .ack(&shard, &[next.receipt(), next.receipt()])
        .expect("ack call");
    assert_eq!((twice.acked, twice.stale), (1, vec![next.receipt()]));
    let st = h.backend().shard_stats(&shard).expect("stats");
    assert_eq!(
        (st.ready, st.in_flight),
        (0, 0),
        "a receipt repeated in one batch changes nothing more"
    );
}

/// A run whose job lease lapses ends: its job runs again (attempt + 1,
/// before the key's later jobs) and its receipt is refused.
pub fn lapsed_job_lease_runs_again_and_old_receipt_is_refused(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    enqueue(h, &shard, "slow", "a", 5);
    enqueue(h, &shard, "slow", "b", 5);
    let lease = h.short_lease_ms();
    let run1 = claim(h, &shard, 1, lease).remove(0);
    h.pass_ms(lease * 3);
    let mut run2 = Vec::new();
    for _ in 0..200 {
        run2 = claim(h, &shard, 10, LONG_LEASE_MS);
        if !run2.is_empty() {
            break;
        }
        h.pass_ms(lease);
    }
    assert_eq!(run2.len(), 1, "the lapsed run's job must run again, alone");
    assert_eq!(
        run2[0].id, run1.id,
        "the lapsed job runs before the key's later job"
    );
    assert!(run2[0].attempt > run1.attempt);
    assert!(run2[0].fence > run1.fence);
    let out = h
        .backend()
        .ack(&shard, &[run1.receipt()])
        .expect("ack call");
    assert_eq!(out.acked, 0, "a lapsed run's ack must be refused");
    ack_one(h, &shard, run2[0].receipt());
    let next = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    assert_eq!(next.payload, b"b");
    ack_one(h, &shard, next.receipt());
}

/// Extending a run's lease keeps it the job's run past its first lease.
pub fn extend_keeps_a_long_run_alive(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    enqueue(h, &shard, "long", "a", 5);
    let lease = h.short_lease_ms();
    let run = claim(h, &shard, 1, lease).remove(0);
    for _ in 0..6 {
        h.pass_ms(lease / 3);
        let stale = h
            .backend()
            .extend(&shard, &[run.receipt()], lease)
            .expect("extend");
        assert!(stale.is_empty(), "a live run's extend was refused");
        assert!(
            claim(h, &shard, 10, LONG_LEASE_MS).is_empty(),
            "an extended run was handed out again"
        );
    }
    ack_one(h, &shard, run.receipt());
    let stale = h
        .backend()
        .extend(&shard, &[run.receipt()], lease)
        .expect("extend");
    assert_eq!(
        stale,
        vec![run.receipt()],
        "a finished run cannot be extended"
    );
}

/// A dead letter is work: `key_counts` reports it and it stays until
/// retried or purged.
pub fn dead_letters_count_as_work(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    enqueue(h, &shard, "d", "a", 1);
    let run = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    h.backend()
        .fail(&shard, run.receipt(), "boom", None)
        .expect("fail");
    let c = h.backend().key_counts(&shard, "d").expect("counts");
    assert_eq!((c.depth, c.in_flight, c.dead), (0, 0, 1));
    assert_eq!(h.backend().dead_retry(&shard, None).expect("retry"), 1);
    let again = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    assert_eq!(again.id, run.id);
    ack_one(h, &shard, again.receipt());
    let c = h.backend().key_counts(&shard, "d").expect("counts");
    assert_eq!((c.depth, c.in_flight, c.dead), (0, 0, 0));
}

/// Every new run of a key gets a larger fence, and the shard reports the
/// largest it issued.
pub fn fences_grow_for_every_new_run(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    for i in 0..4 {
        enqueue(h, &shard, "f", &i.to_string(), 5);
    }
    let mut last = 0u64;
    for round in 0..8 {
        let run = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
        assert!(run.fence > last, "fence {} after {last}", run.fence);
        last = run.fence;
        if round % 2 == 0 {
            h.backend()
                .fail(&shard, run.receipt(), "again", Some(0))
                .expect("fail");
        } else {
            ack_one(h, &shard, run.receipt());
        }
    }
    let high = h.backend().shard_stats(&shard).expect("stats").fence_high;
    assert_eq!(high, last, "fence_high must be the largest fence issued");
}

/// `fail` with `retry_in_ms` sets the retry time; the job stays first.
pub fn fail_with_retry_in_runs_again_first(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    enqueue(h, &shard, "w", "a", 5);
    enqueue(h, &shard, "w", "b", 5);
    let run = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    h.backend()
        .fail(&shard, run.receipt(), "later", Some(60_000))
        .expect("fail");
    assert!(
        claim(h, &shard, 10, LONG_LEASE_MS).is_empty(),
        "the key's later job overtook its retry"
    );
    let due = h.backend().next_due_ms(&shard).expect("next due");
    assert!(due.is_some(), "a waiting retry must be due some time");
    // The waiting retry says why its last attempt failed; its key's later
    // job has no reason of its own.
    let b = h.backend();
    let jobs = b.key_jobs(&shard, "w", 10).expect("key_jobs");
    assert_eq!(
        jobs.iter()
            .map(|j| (&j.payload[..], j.attempts, j.reason.as_deref()))
            .collect::<Vec<_>>(),
        [(&b"a"[..], 1, Some("later")), (&b"b"[..], 0, None)],
        "a retried job's attempts and last failure"
    );
    let one = b
        .job(&shard, run.id)
        .expect("job")
        .expect("the retry is live");
    assert_eq!(one.reason.as_deref(), Some("later"));
    assert_eq!(one.state, JobState::Delayed);
    // Its one attempt's start is kept, not before the job was made; the
    // later job never started.
    assert_eq!(one.attempt_starts_ms.len(), 1, "{one:?}");
    assert!(one.attempt_starts_ms[0] >= one.created_ms, "{one:?}");
    assert!(jobs[1].attempt_starts_ms.is_empty(), "{:?}", jobs[1]);
}
