//! The contract's flow-control checks: a key's concurrency and order,
//! rates and groups over every claim, ranks and weights, back-offs and
//! their resume.

use super::*;

/// The payloads of `runs` of `key`, in claim order.
fn payloads_of(runs: &[ClaimedJob], key: &str) -> Vec<String> {
    (runs.iter())
        .filter(|r| r.key == key)
        .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
        .collect()
}

/// A key whose policy allows 3 runs at once ([`flow_settings`]) starts its
/// jobs in enqueue order, never more than 3 at once; a failed job runs
/// again before the key's later jobs, and while its retry waits nothing
/// later starts. A backend that keeps one run per key
/// ([`shardq_core::BackendLimits::key_concurrency_max`] 1) starts one.
pub fn a_keys_concurrency_runs_its_jobs_in_order_that_many_at_once(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    let key = "contract-c3:k";
    for i in 0..7 {
        enqueue(h, &shard, key, &i.to_string(), 5);
    }
    enqueue(h, &shard, "c3-plain", "p0", 5);
    enqueue(h, &shard, "c3-plain", "p1", 5);
    let first = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&first, "c3-plain"), ["p0"], "{first:?}");
    if b.limits().key_concurrency_max < 3 {
        assert_eq!(
            payloads_of(&first, key),
            ["0"],
            "a backend of one run per key started more: {first:?}"
        );
        return;
    }
    assert_eq!(payloads_of(&first, key), ["0", "1", "2"], "{first:?}");
    let counts = b.key_counts(&shard, key).expect("counts");
    assert_eq!((counts.in_flight, counts.depth), (3, 4), "{counts:?}");
    let none = claim(h, &shard, 10, LONG_LEASE_MS);
    assert!(none.is_empty(), "a fourth run started: {none:?}");
    let run = |p: &str| {
        first
            .iter()
            .find(|r| r.key == key && r.payload == p.as_bytes())
            .expect("run")
            .clone()
    };
    // The middle one ends: the next job starts, alone.
    ack_one(h, &shard, run("1").receipt());
    let next = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&next, key), ["3"], "{next:?}");
    // A failed job runs again before the key's later jobs.
    b.fail(&shard, run("0").receipt(), "again", Some(0))
        .expect("fail");
    let again = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&again, key), ["0"], "{again:?}");
    assert_eq!(again[0].attempt, 2, "{again:?}");
    // A retry that waits holds back the key's later jobs.
    b.fail(&shard, run("2").receipt(), "later", Some(5_000))
        .expect("fail");
    let held = claim(h, &shard, 10, LONG_LEASE_MS);
    assert!(
        payloads_of(&held, key).is_empty(),
        "a later job overtook a waiting retry: {held:?}"
    );
    h.pass_ms(5_000);
    let due = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&due, key), ["2"], "{due:?}");
    // Three run (0, 3, 2): the rest waits for a slot of the key.
    for r in again.iter().chain(&next).chain(&due) {
        ack_one(h, &shard, r.receipt());
    }
    let rest = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&rest, key), ["4", "5", "6"], "{rest:?}");
    for r in rest.iter().filter(|r| r.key == key) {
        ack_one(h, &shard, r.receipt());
    }
    let counts = b.key_counts(&shard, key).expect("counts");
    assert_eq!((counts.in_flight, counts.depth), (0, 0), "{counts:?}");
}

/// Runs of a key of concurrency 3 whose job leases lapse run again in key
/// order, each with a larger fence, and their old receipts are refused.
pub fn lapsed_runs_of_a_concurrent_key_run_again_in_order(h: &dyn ContractHarness) {
    if h.backend().limits().key_concurrency_max < 3 {
        return;
    }
    let shard = h.fresh_shard();
    let key = "contract-c3:lapse";
    for i in 0..4 {
        enqueue(h, &shard, key, &i.to_string(), 5);
    }
    let lease = h.short_lease_ms();
    let old = claim(h, &shard, 10, lease);
    assert_eq!(payloads_of(&old, key), ["0", "1", "2"], "{old:?}");
    h.pass_ms(lease * 3);
    let mut again = Vec::new();
    for _ in 0..200 {
        again.extend(claim(h, &shard, 10, LONG_LEASE_MS));
        if again.len() >= 3 {
            break;
        }
        h.pass_ms(lease);
    }
    assert_eq!(payloads_of(&again, key), ["0", "1", "2"], "{again:?}");
    for (o, n) in old.iter().zip(&again) {
        assert_eq!(o.id, n.id);
        assert!(n.fence > o.fence && n.attempt > o.attempt, "{o:?} {n:?}");
    }
    let out = h.backend().ack(&shard, &[old[1].receipt()]).expect("ack");
    assert_eq!(out.acked, 0, "a lapsed run's ack must be refused");
    for r in &again {
        ack_one(h, &shard, r.receipt());
    }
    let last = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&last, key), ["3"], "{last:?}");
    ack_one(h, &shard, last[0].receipt());
}

/// One ack batch names a live run and a lapsed run of one key (concurrency
/// 3): the live one is acked; the lapsed one is refused (its job runs again
/// before the key's later jobs) or, on a backend that ends a lapsed run only
/// when it is reclaimed, acked. Either way no run is left behind in flight
/// (a backend that changes a key's queue in memory for the batch must not
/// lose the ack when the lapse writes the key).
pub fn an_ack_batch_with_a_live_and_a_lapsed_run_of_one_key(h: &dyn ContractHarness) {
    if h.backend().limits().key_concurrency_max < 3 {
        return;
    }
    let shard = h.fresh_shard();
    let key = "contract-c3:mixed";
    for i in 0..4 {
        enqueue(h, &shard, key, &i.to_string(), 5);
    }
    let lease = h.short_lease_ms();
    let runs = claim(h, &shard, 10, lease);
    assert_eq!(payloads_of(&runs, key), ["0", "1", "2"], "{runs:?}");
    let b = h.backend();
    let kept = b
        .extend(&shard, &[runs[0].receipt()], LONG_LEASE_MS)
        .expect("extend");
    assert!(kept.is_empty(), "{kept:?}");
    h.pass_ms(lease * 3);
    let out = b
        .ack(&shard, &[runs[0].receipt(), runs[1].receipt()])
        .expect("ack");
    assert!(!out.stale.contains(&runs[0].receipt()), "{out:?}");
    let refused = out.stale.contains(&runs[1].receipt());
    assert_eq!(out.acked, if refused { 1 } else { 2 }, "{out:?}");
    let want: &[&str] = if refused {
        &["1", "2", "3"]
    } else {
        &["2", "3"]
    };
    let mut again = Vec::new();
    for _ in 0..200 {
        again.extend(claim(h, &shard, 10, LONG_LEASE_MS));
        if again.len() >= want.len() {
            break;
        }
        h.pass_ms(lease);
    }
    assert_eq!(payloads_of(&again, key), want, "{again:?}");
    let attempts: Vec<u32> = again.iter().map(|r| r.attempt).collect();
    let lapsed: &[u32] = if refused { &[2, 2, 1] } else { &[2, 1] };
    assert_eq!(
        attempts, lapsed,
        "the lapsed runs' jobs run again first: {again:?}"
    );
    for r in &again {
        ack_one(h, &shard, r.receipt());
    }
    assert_eq!(
        b.key_counts(&shard, key).expect("key counts"),
        KeyCounts::default(),
        "nothing of the key is left waiting or in flight"
    );
    assert!(claim(h, &shard, 10, LONG_LEASE_MS).is_empty());
}

/// A key of concurrency 3 limited to 2 starts a second (burst 2): one
/// claim starts two of its jobs, not three (its runs share its tokens), the
/// next nothing until a token is due, then the third, in order.
pub fn a_concurrent_keys_starts_share_its_rate(h: &dyn ContractHarness) {
    if h.backend().limits().key_concurrency_max < 3 {
        return;
    }
    let shard = h.fresh_shard();
    let key = "contract-c3r:k";
    for i in 0..4 {
        enqueue(h, &shard, key, &i.to_string(), 5);
    }
    let first = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&first, key), ["0", "1"], "the burst: {first:?}");
    let none = claim(h, &shard, 10, LONG_LEASE_MS);
    assert!(
        payloads_of(&none, key).is_empty(),
        "over the rate: {none:?}"
    );
    h.pass_ms(500);
    let third = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&third, key), ["2"], "a token later: {third:?}");
    for r in first.iter().chain(&third) {
        ack_one(h, &shard, r.receipt());
    }
    h.pass_ms(500);
    let last = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&last, key), ["3"], "{last:?}");
    ack_one(h, &shard, last[0].receipt());
}

/// Settings whose keys resolve their concurrency every way there is: the
/// default (2), prefixes nested three deep and a multi-byte one, keys whose
/// own policy agrees with their prefix or the default and keys whose
/// policy differs, for checks that a store resolves limits as
/// [`shardq_core::flow::FlowSettings::for_key`] does.
pub fn mixed_concurrency_settings() -> shardq_core::flow::FlowSettings {
    use shardq_core::flow::{FlowPolicy, FlowSettings};
    let conc = |n: u32| FlowPolicy {
        concurrency: n,
        ..FlowPolicy::default()
    };
    let mut s = FlowSettings {
        default: conc(2),
        ..FlowSettings::default()
    };
    for (p, n) in [("a", 4), ("ab", 1), ("abc", 8), ("é", 3)] {
        s.prefixes.insert(p.into(), conc(n));
    }
    for (k, n) in [
        ("abx", 1),
        ("abcd", 2),
        ("z", 2),
        ("ab", 5),
        ("éa", 3),
        ("x", 1),
    ] {
        s.keys.insert(k.into(), conc(n));
    }
    s
}

/// A key's concurrency raised while it runs at its old limit starts more
/// at the next claim; lowered while it runs above the new one, nothing new
/// starts until its runs are below it. The settings are put back at the end.
pub fn a_changed_concurrency_holds_from_the_next_claim(h: &dyn ContractHarness) {
    let Some(flow) = h.flow() else { return };
    if h.backend().limits().key_concurrency_max < 3 {
        return;
    }
    let shard = h.fresh_shard();
    let key = "contract-relimit:k";
    let original = flow.settings();
    let with = |n: u32| {
        let mut s = (*original).clone();
        let p = shardq_core::flow::FlowPolicy {
            concurrency: n,
            ..shardq_core::flow::FlowPolicy::default()
        };
        s.prefixes.insert("contract-relimit:".into(), p);
        flow.set(s, 0);
    };
    for i in 0..6 {
        enqueue(h, &shard, key, &i.to_string(), 5);
    }
    let first = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&first, key), ["0"], "{first:?}");
    with(3);
    let more = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&more, key), ["1", "2"], "raised to 3: {more:?}");
    with(1);
    let runs: Vec<ClaimedJob> = first.iter().chain(&more).cloned().collect();
    for (i, r) in runs.iter().enumerate() {
        let next = claim(h, &shard, 10, LONG_LEASE_MS);
        assert!(
            payloads_of(&next, key).is_empty(),
            "lowered to 1 with {} runs left, one more started: {next:?}",
            runs.len() - i
        );
        ack_one(h, &shard, r.receipt());
    }
    let last = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&last, key), ["3"], "{last:?}");
    flow.set((*original).clone(), 0);
    ack_one(h, &shard, last[0].receipt());
    let rest = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(
        payloads_of(&rest, key),
        ["4"],
        "back to the default: {rest:?}"
    );
    ack_one(h, &shard, rest[0].receipt());
    let end = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&end, key), ["5"], "{end:?}");
    ack_one(h, &shard, end[0].receipt());
}

/// Ranks compare over the shards of one process
/// ([`RunJobs::ready_ranks`]): with one slot given each time to the
/// shard of the best-ranked key, a key of weight 4 on one shard and a key
/// of weight 1 on another start 4:1. The weight-1 key arrives after the
/// other ran alone for 40 starts, and starts from the process's virtual
/// time: no burst to catch up on what it never asked for.
pub fn ranks_compare_across_the_shards_of_a_process(h: &dyn ContractHarness) {
    let (a, b) = (h.fresh_shard(), h.fresh_shard());
    let backend = h.backend();
    for i in 0..100 {
        enqueue(h, &b, "contract-w4:x", &i.to_string(), 1);
    }
    let start_best = || {
        let best = [&a, &b]
            .into_iter()
            .filter_map(|s| {
                let r = backend.ready_ranks(s, 1).expect("ready ranks");
                r.first().map(|r| (*r, s.clone()))
            })
            .min()
            .expect("a ready key on one of the shards");
        let run = claim(h, &best.1, 1, LONG_LEASE_MS);
        assert_eq!(run.len(), 1, "the best-ranked shard starts its key");
        ack_one(h, &best.1, run[0].receipt());
        run[0].key.clone()
    };
    for _ in 0..40 {
        assert_eq!(start_best(), "contract-w4:x", "alone on its shards");
    }
    assert!(
        backend.ready_ranks(&a, 5).expect("ranks").is_empty(),
        "an idle shard ranks nothing"
    );
    for i in 0..60 {
        enqueue(h, &a, "contract-w1:x", &i.to_string(), 1);
    }
    let mut w1 = 0;
    for _ in 0..50 {
        if start_best() == "contract-w1:x" {
            w1 += 1;
        }
    }
    assert!(
        (w1 - 10i32).abs() <= 2,
        "weights 1:4 over two shards, 50 starts: {w1} of the weight-1 key"
    );
}

/// Backlogged keys of weights 1, 2 and 4 ([`flow_settings`]) claimed one
/// job at a time start in the ratio 1:2:4, each in its own order; a key of
/// a higher priority that becomes ready starts next.
pub fn weights_share_slots_and_priorities_go_first(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let keys = ["contract-w1:a", "contract-w2:a", "contract-w4:a"];
    for i in 0..60 {
        for k in keys {
            enqueue(h, &shard, k, &i.to_string(), 1);
        }
    }
    let mut count = std::collections::BTreeMap::new();
    let mut next_payload = std::collections::BTreeMap::new();
    for _ in 0..70 {
        let run = claim(h, &shard, 1, LONG_LEASE_MS);
        assert_eq!(run.len(), 1, "one slot, one start");
        let r = &run[0];
        let want = next_payload.entry(r.key.clone()).or_insert(0);
        assert_eq!(
            r.payload,
            want.to_string().into_bytes(),
            "{}: in order",
            r.key
        );
        *want += 1;
        *count.entry(r.key.clone()).or_insert(0) += 1;
        ack_one(h, &shard, r.receipt());
    }
    let got: Vec<i32> = keys
        .iter()
        .map(|k| count.get(*k).copied().unwrap_or(0))
        .collect();
    for (g, want) in got.iter().zip([10, 20, 40]) {
        assert!(
            (g - want).abs() <= 1,
            "weights 1:2:4 over 70 starts: {got:?}"
        );
    }
    enqueue(h, &shard, "contract-vip:a", "v", 1);
    let run = claim(h, &shard, 1, LONG_LEASE_MS);
    assert_eq!(run[0].key, "contract-vip:a", "the higher priority first");
    ack_one(h, &shard, run[0].receipt());
}

/// A handler's back-off ends its run without using an attempt: the job is
/// the key's head again with the attempt count it had, the key starts
/// nothing until the back-off ends while other keys run on, an old receipt
/// changes nothing, and a back-off for the group ([`flow_settings`]) holds
/// every key of the group.
pub fn a_backed_off_run_keeps_its_attempt_and_holds_its_key(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    enqueue(h, &shard, "bo", "first", 1);
    enqueue(h, &shard, "bo", "second", 1);
    enqueue(h, &shard, "bo-other", "x", 1);
    let runs = claim(h, &shard, 10, LONG_LEASE_MS);
    let run = runs
        .iter()
        .find(|r| r.key == "bo")
        .expect("bo runs")
        .clone();
    let other = runs
        .iter()
        .find(|r| r.key == "bo-other")
        .expect("other runs");
    ack_one(h, &shard, other.receipt());
    let backed = b
        .back_off(&shard, run.receipt(), 2_000, false)
        .expect("back off");
    assert!(backed.group.is_none(), "{backed:?}");
    let again = b.back_off(&shard, run.receipt(), 2_000, false);
    assert!(
        matches!(again, Err(QueueError::StaleReceipt { .. })),
        "a run ended by a back-off is over: {again:?}"
    );
    enqueue(h, &shard, "bo-other", "y", 1);
    let during = claim(h, &shard, 10, LONG_LEASE_MS);
    assert!(
        during.iter().all(|r| r.key != "bo") && during.len() == 1,
        "the key waits, others run: {during:?}"
    );
    ack_one(h, &shard, during[0].receipt());
    h.pass_ms(2_000);
    let after = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(
        (after[0].id, after[0].attempt),
        (run.id, 1),
        "the same job first, its one attempt not used up"
    );
    ack_one(h, &shard, after[0].receipt());
    // A back-off for the group holds the group's other keys.
    enqueue(h, &shard, "contract-grp:bo1", "g", 1);
    enqueue(h, &shard, "contract-grp:bo2", "g", 1);
    h.pass_ms(1_000);
    let both = claim(h, &shard, 16, LONG_LEASE_MS);
    let first = both
        .iter()
        .find(|r| r.key == "contract-grp:bo1")
        .expect("bo1");
    let second = both
        .iter()
        .find(|r| r.key == "contract-grp:bo2")
        .expect("bo2");
    ack_one(h, &shard, second.receipt());
    enqueue(h, &shard, "contract-grp:bo2", "g2", 1);
    let held = b
        .back_off(&shard, first.receipt(), 3_000, true)
        .expect("back off the group");
    assert_eq!(held.group.as_deref(), Some("contract-group"));
    h.pass_ms(1_500);
    assert!(
        claim(h, &shard, 10, LONG_LEASE_MS).is_empty(),
        "the group's other key waits for the group's back-off"
    );
    h.pass_ms(1_600);
    let resumed = run_until_held(h, &shard);
    assert_eq!(
        resumed.len(),
        2,
        "both keys start once it ends: {resumed:?}"
    );
}

/// An operator's resume lifts a handler's back-off of a key at once
/// ([`InspectJobs::resume_key`]): the backed-off job starts at the next
/// claim with its attempt unused, while another key's back-off stands. A
/// wait a resume does not own is left as it is: a delay its producer gave,
/// a retry's backoff after a failure (of a job that backed off before too),
/// a back-off that is over. A key held by none answers `NotHeld`, a key
/// sealed for a move `Moving`, and neither changes anything.
pub fn a_resumed_key_starts_at_once_and_other_waits_stand(h: &dyn ContractHarness) {
    use shardq_core::{KeyHold, KeyResume};
    let shard = h.fresh_shard();
    let b = h.backend();
    enqueue(h, &shard, "rk-a", "a", 3);
    enqueue(h, &shard, "rk-b", "b", 3);
    enqueue(h, &shard, "rk-retry", "r", 3);
    let mut delayed = NewJob::new("rk-delay", "d");
    delayed.delay_ms = 60_000;
    b.enqueue(&shard, u64::MAX, &[delayed]).expect("enqueue");
    let runs = claim(h, &shard, 10, LONG_LEASE_MS);
    let run = |k: &str| {
        (runs.iter().find(|r| r.key == k))
            .unwrap_or_else(|| panic!("{k} runs: {runs:?}"))
            .clone()
    };
    assert_eq!(runs.len(), 3, "the delayed job waits: {runs:?}");
    let (a, bb) = (run("rk-a"), run("rk-b"));
    let until = (b.back_off(&shard, a.receipt(), 60_000, false))
        .expect("back off a")
        .at_ms;
    b.back_off(&shard, bb.receipt(), 60_000, false)
        .expect("back off b");
    b.fail(&shard, run("rk-retry").receipt(), "later", Some(60_000))
        .expect("fail");
    let hold = |k: &str| b.key_hold(&shard, k).expect("key hold");
    let held_a = KeyHold {
        jobs: vec![a.id],
        until_ms: until,
    };
    assert_eq!(hold("rk-a"), Some(held_a.clone()));
    assert_eq!(hold("rk-b").map(|x| x.jobs), Some(vec![bb.id]));
    for k in ["rk-retry", "rk-delay", "rk-none"] {
        assert_eq!(hold(k), None, "{k} is not held by a back-off");
    }
    h.pass_ms(1_000);
    assert!(claim(h, &shard, 10, LONG_LEASE_MS).is_empty());
    let resume = |k: &str| b.resume_key(&shard, k).expect("resume");
    assert_eq!(resume("rk-a"), KeyResume::Resumed(held_a));
    assert_eq!(hold("rk-a"), None, "a resumed key is held no more");
    let again = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(again.len(), 1, "only the resumed key starts: {again:?}");
    assert_eq!(
        (again[0].id, again[0].attempt),
        (a.id, 1),
        "the backed-off job, its attempt unused"
    );
    assert_eq!(resume("rk-a"), KeyResume::NotHeld, "it runs");
    for k in ["rk-retry", "rk-delay", "rk-none"] {
        assert_eq!(resume(k), KeyResume::NotHeld, "{k}");
    }
    // A job that backed off, then failed: its retry's wait is not lifted.
    b.fail(&shard, again[0].receipt(), "later", Some(60_000))
        .expect("fail");
    assert_eq!(hold("rk-a"), None, "a retry is not a back-off");
    assert_eq!(resume("rk-a"), KeyResume::NotHeld);
    assert!(
        claim(h, &shard, 10, LONG_LEASE_MS).is_empty(),
        "the other waits stand"
    );
    // A key moving to another shard is left as it is.
    let mut fence = b.fence(&shard).expect("fence");
    fence.sealed_keys.insert("rk-b".into(), "elsewhere".into());
    b.set_fence(&shard, &fence).expect("seal");
    assert_eq!(resume("rk-b"), KeyResume::Moving);
    assert!(hold("rk-b").is_some(), "a moving key keeps its back-off");
    fence.sealed_keys.remove("rk-b");
    b.set_fence(&shard, &fence).expect("unseal");
    assert!(matches!(resume("rk-b"), KeyResume::Resumed(_)));
    let b_run = claim(h, &shard, 10, LONG_LEASE_MS);
    assert_eq!(payloads_of(&b_run, "rk-b"), ["b"], "{b_run:?}");
    // A back-off that is over holds nothing.
    b.back_off(&shard, b_run[0].receipt(), 1_000, false)
        .expect("back off b again");
    assert!(hold("rk-b").is_some());
    h.pass_ms(1_000);
    assert_eq!(hold("rk-b"), None, "its wait is over");
    assert_eq!(resume("rk-b"), KeyResume::NotHeld);
    // The other waits end when they were to.
    h.pass_ms(60_000);
    let rest = run_until_held(h, &shard);
    let mut rest_keys = rest.clone();
    rest_keys.sort();
    assert_eq!(
        rest_keys,
        ["rk-a", "rk-b", "rk-delay", "rk-retry"],
        "{rest:?}"
    );
}

/// Claims and acks everything claimable of `shard` until a claim finds
/// nothing, without letting time pass; the keys started, in order.
fn run_until_held(h: &dyn ContractHarness, shard: &str) -> Vec<String> {
    let mut started = Vec::new();
    loop {
        let runs = claim(h, shard, 16, LONG_LEASE_MS);
        if runs.is_empty() {
            return started;
        }
        for r in runs {
            ack_one(h, shard, r.receipt());
            started.push(r.key);
        }
    }
}

/// A key's rate limit and its group's ([`flow_settings`]) hold over every
/// claim: a limited key starts its burst, then one job per token, while
/// keys without a limit run everything meanwhile; the keys of a group share
/// one bucket; a held key is not reported as due now (a pool would spin).
pub fn rate_limits_hold_across_every_claim(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    for _ in 0..6 {
        enqueue(h, &shard, "contract-rate:a", "r", 1);
    }
    for _ in 0..3 {
        enqueue(h, &shard, "contract-plain", "p", 1);
    }
    for i in 0..4 {
        for _ in 0..2 {
            enqueue(h, &shard, &format!("contract-grp:{i}"), "g", 1);
        }
    }
    let count = |v: &[String], prefix: &str| v.iter().filter(|k| k.starts_with(prefix)).count();
    let first = run_until_held(h, &shard);
    assert_eq!(
        count(&first, "contract-rate:"),
        2,
        "a key at 10/s with a burst of 2 starts 2 at once: {first:?}"
    );
    assert_eq!(
        count(&first, "contract-plain"),
        3,
        "a key without a limit runs on: {first:?}"
    );
    assert_eq!(
        count(&first, "contract-grp:"),
        3,
        "four keys of one group at 20/s with a burst of 3 start 3 together: {first:?}"
    );
    let due = b.next_due_ms(&shard).expect("next_due").expect("work left");
    assert!(
        b.claim(&shard, 16, LONG_LEASE_MS)
            .expect("claim")
            .is_empty()
            && due > 0,
        "held keys are not due now"
    );
    // 50 ms: one group token (20/s), no key token (10/s).
    h.pass_ms(50);
    let second = run_until_held(h, &shard);
    assert_eq!(
        (
            count(&second, "contract-rate:"),
            count(&second, "contract-grp:")
        ),
        (0, 1),
        "after 50 ms: {second:?}"
    );
    // 50 ms more: one of each.
    h.pass_ms(50);
    let third = run_until_held(h, &shard);
    assert_eq!(
        (
            count(&third, "contract-rate:"),
            count(&third, "contract-grp:")
        ),
        (1, 1),
        "after 100 ms: {third:?}"
    );
    // A long wait refills to the burst, no further.
    h.pass_ms(10_000);
    let fourth = run_until_held(h, &shard);
    assert_eq!(
        (
            count(&fourth, "contract-rate:"),
            count(&fourth, "contract-grp:")
        ),
        (2, 3),
        "after 10 s only the bursts: {fourth:?}"
    );
}

/// A group's concurrency ([`flow_settings`]: two runs at once) caps the
/// runs of its keys together, over every shard: a start holds a slot until
/// its run ends (ack, fail, back-off) or its lease lapses, and other keys
/// run on meanwhile.
pub fn a_groups_concurrency_caps_its_runs_over_every_shard(h: &dyn ContractHarness) {
    use shardq_core::flow::GROUP_SLOT_RECHECK_MS;
    let (a, b) = (h.fresh_shard(), h.fresh_shard());
    let be = h.backend();
    for i in 0..3 {
        enqueue(h, &a, &format!("contract-slot:a{i}"), "s", 2);
        enqueue(h, &b, &format!("contract-slot:b{i}"), "s", 2);
    }
    enqueue(h, &a, "contract-slotless", "p", 1);
    const LEASE_MS: u64 = 60_000;
    let both = || {
        let mut v = claim(h, &a, 16, LEASE_MS);
        v.extend(claim(h, &b, 16, LEASE_MS));
        v
    };
    let in_group = |v: &[ClaimedJob]| -> Vec<ClaimedJob> {
        v.iter()
            .filter(|r| r.key.starts_with("contract-slot:"))
            .cloned()
            .collect()
    };
    let first = both();
    let running = in_group(&first);
    assert_eq!(running.len(), 2, "two of six keys start: {first:?}");
    assert!(
        first.iter().any(|r| r.key == "contract-slotless"),
        "a key outside the group runs on: {first:?}"
    );
    h.pass_ms(GROUP_SLOT_RECHECK_MS + 1);
    assert!(in_group(&both()).is_empty(), "no third run while two run");
    // An ack gives its slot back: one more starts.
    let acked = &running[0];
    ack_one(h, &acked.shard, acked.receipt());
    h.pass_ms(GROUP_SLOT_RECHECK_MS + 1);
    let second = in_group(&both());
    assert_eq!(second.len(), 1, "one slot freed by an ack: {second:?}");
    // A failure with a retry gives its slot back too.
    let failed = &running[1];
    be.fail(&failed.shard, failed.receipt(), "boom", Some(0))
        .expect("fail");
    h.pass_ms(GROUP_SLOT_RECHECK_MS + 1);
    let third = in_group(&both());
    assert_eq!(third.len(), 1, "one slot freed by a failure: {third:?}");
    // So does a back-off.
    be.back_off(&third[0].shard, third[0].receipt(), 60_000, false)
        .expect("back off");
    h.pass_ms(GROUP_SLOT_RECHECK_MS + 1);
    let fourth = in_group(&both());
    assert_eq!(fourth.len(), 1, "one slot freed by a back-off: {fourth:?}");
    // An extended run keeps its slot past its first lease; a run whose
    // lease lapses gives its slot up with it.
    h.pass_ms(LEASE_MS / 2);
    let kept = &second[0];
    let refused = be
        .extend(&kept.shard, &[kept.receipt()], LEASE_MS)
        .expect("extend");
    assert!(refused.is_empty(), "{refused:?}");
    h.pass_ms(LEASE_MS / 2 + 1);
    let fifth = in_group(&both());
    assert_eq!(
        fifth.len(),
        1,
        "the lapsed run's slot is free, the extended one's is not: {fifth:?}"
    );
    assert!(fifth.iter().all(|r| r.key != kept.key), "{fifth:?}");
    // Both slots given back for the next check.
    ack_one(h, &kept.shard, kept.receipt());
    ack_one(h, &fifth[0].shard, fifth[0].receipt());
    an_old_runs_late_end_frees_no_newer_runs_slot(h);
}

/// A slot names one run: an old run's end that arrives late (an ack sent
/// twice, then a fail and a back-off of it) never frees the slot of a newer
/// run of the same key, so a third run never joins the group's two.
fn an_old_runs_late_end_frees_no_newer_runs_slot(h: &dyn ContractHarness) {
    use shardq_core::flow::GROUP_SLOT_RECHECK_MS;
    let shard = h.fresh_shard();
    let be = h.backend();
    enqueue(h, &shard, "contract-slot:r", "r1", 1);
    enqueue(h, &shard, "contract-slot:r", "r2", 1);
    enqueue(h, &shard, "contract-slot:q", "q", 1);
    let first = claim(h, &shard, 16, LONG_LEASE_MS);
    assert_eq!(first.len(), 2, "{first:?}");
    let r1 = first
        .iter()
        .find(|r| r.key == "contract-slot:r")
        .expect("r runs");
    ack_one(h, &shard, r1.receipt());
    h.pass_ms(GROUP_SLOT_RECHECK_MS + 1);
    let second = claim(h, &shard, 16, LONG_LEASE_MS);
    assert_eq!(
        second.iter().map(|r| &r.payload[..]).collect::<Vec<_>>(),
        [b"r2"],
        "the slot r1 gave back goes to r's next job"
    );
    let late = be.ack(&shard, &[r1.receipt()]).expect("ack");
    assert_eq!((late.acked, late.stale.len()), (0, 1), "{late:?}");
    let late_fail = be.fail(&shard, r1.receipt(), "late", None);
    assert!(
        matches!(late_fail, Err(QueueError::StaleReceipt { .. })),
        "{late_fail:?}"
    );
    let late_back_off = be.back_off(&shard, r1.receipt(), 1_000, false);
    assert!(
        matches!(late_back_off, Err(QueueError::StaleReceipt { .. })),
        "{late_back_off:?}"
    );
    enqueue(h, &shard, "contract-slot:p", "p", 1);
    h.pass_ms(GROUP_SLOT_RECHECK_MS + 1);
    assert!(
        claim(h, &shard, 16, LONG_LEASE_MS).is_empty(),
        "r1's late ack freed r2's slot: a third run of the group started"
    );
    for r in first.iter().filter(|r| r.key != r1.key).chain(&second) {
        ack_one(h, &shard, r.receipt());
    }
    h.pass_ms(GROUP_SLOT_RECHECK_MS + 1);
    let third = claim(h, &shard, 16, LONG_LEASE_MS);
    assert_eq!(third.len(), 1, "p starts once slots are free: {third:?}");
    ack_one(h, &shard, third[0].receipt());
    // A cancelled run's ack, refused, gives its slot back at once (not at
    // the end of its long lease).
    for k in ["c", "d", "e"] {
        enqueue(h, &shard, &format!("contract-slot:{k}"), k, 1);
    }
    let two = claim(h, &shard, 16, LONG_LEASE_MS);
    assert_eq!(two.len(), 2, "{two:?}");
    match be.cancel(&shard, two[0].id).expect("cancel") {
        CancelOutcome::Running => ack_one(h, &shard, two[0].receipt()),
        CancelOutcome::Stopping => {
            let out = be.ack(&shard, &[two[0].receipt()]).expect("ack");
            assert_eq!(out.stale.len(), 1, "a cancelled run's ack is refused");
        }
        other => panic!("a running job's cancel answered {other:?}"),
    }
    h.pass_ms(GROUP_SLOT_RECHECK_MS + 1);
    let last = claim(h, &shard, 16, LONG_LEASE_MS);
    assert_eq!(
        last.len(),
        1,
        "the cancelled run's slot went back: {last:?}"
    );
    for r in two.iter().skip(1).chain(&last) {
        ack_one(h, &shard, r.receipt());
    }
}
