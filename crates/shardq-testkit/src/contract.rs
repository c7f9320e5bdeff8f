//! The backend contract as executable checks, written once and run against
//! every [`QueueBackend`]: the memory backend (`shardq-core`'s tests), the
//! embedded engine (`shardq-fs`'s) and Redis (`shardq-redis`'s).
//!
//! Each check starts from an empty shard the harness owns and asserts an
//! invariant a user relies on (per-key order, one run per key, receipts,
//! job leases, dead letters as work, growing fences), never a mechanism.
//! The checks panic with a message naming the broken promise. A backend's
//! test file runs them with [`contract_tests!`](crate::contract_tests), one
//! test per check, each on a harness of its own; [`CHECKS`] names them
//! all. This module does no I/O of its own.

use shardq_core::backend::QueueBackend;
use shardq_core::error::QueueError;
use shardq_core::job::{CancelOutcome, ClaimedJob, JobId, JobState, KeyCounts, NewJob, Receipt};

/// A backend under test and a way to let its time pass.
pub trait ContractHarness {
    /// The backend; `shard()` is adopted by it and empty at the start of
    /// each check.
    fn backend(&self) -> &dyn QueueBackend;
    /// A fresh, empty shard name for the next check.
    fn fresh_shard(&self) -> String;
    /// Lets `ms` of the backend's time pass (a manual clock moves; a real
    /// server is waited for).
    fn pass_ms(&self, ms: u64);
    /// The shortest job lease the backend can be tested with, in ms.
    fn short_lease_ms(&self) -> u64 {
        shardq_core::job::JOB_LEASE_MS_MIN
    }
    /// The backend's flow control, opened with [`flow_settings`], for the
    /// checks that change policies while jobs run (none: they are skipped).
    fn flow(&self) -> Option<&shardq_core::flow::FlowControl> {
        None
    }
}

/// A harness whose store can be put back to an earlier state behind the
/// backend's back (a lagging replica promoted, a restore from an older
/// backup), for [`rewound_store_is_refused`].
pub trait RewindHarness: ContractHarness {
    /// Remembers the stored state of `shard` now.
    fn checkpoint(&self, shard: &str);
    /// Puts the stored state of `shard` back to the last checkpoint; the
    /// backend is not told.
    fn rewind(&self, shard: &str);
}

/// The name of every check on a [`ContractHarness`], in the order the
/// generated tests are written.
pub const CHECKS: &[&str] = crate::__contract_checks! { __contract_check_names () };

/// The name of every check on a [`RewindHarness`] only.
pub const REWIND_CHECKS: &[&str] = crate::__contract_rewind_checks! { __contract_check_names () };

/// What [`contract_tests!`](crate::contract_tests) runs after each check
/// when the caller gives nothing: nothing.
#[doc(hidden)]
pub fn nothing_after<H: ?Sized>(_harness: &H, _check: &str) {}

/// A job lease long enough never to lapse within one check.
const LONG_LEASE_MS: u64 = 600_000;

/// The retry rules every harness opens its backend with, for
/// [`a_keys_retry_rule_decides_its_wait`]: keys starting with
/// `contract-slow:` wait an hour after a failure, and the key
/// `contract-slow:fast` (its own rule beats the prefix) a millisecond.
pub fn retry_rules() -> shardq_core::retry::RetryRules {
    let fixed = |ms: u64| shardq_core::retry::RetryPolicy {
        max_attempts: 5,
        backoff: shardq_core::job::Backoff {
            base_ms: ms,
            max_ms: ms,
            kind: shardq_core::job::BackoffKind::Fixed,
            jitter_pct: 0,
        },
    };
    let mut r = shardq_core::retry::RetryRules::default();
    r.prefixes.insert("contract-slow:".into(), fixed(3_600_000));
    r.keys.insert("contract-slow:fast".into(), fixed(1));
    r
}

/// The flow settings every harness opens its backend with, for
/// [`rate_limits_hold_across_every_claim`]: keys starting with
/// `contract-rate:` start at most 10 a second (burst 2) each; keys starting
/// with `contract-grp:` share the group `contract-group`, 20 a second
/// (burst 3); keys starting with `contract-w1:`, `contract-w2:` and
/// `contract-w4:` have weights 1, 2 and 4, and `contract-vip:` priority 5;
/// keys starting with `contract-slot:` share the group `contract-slots`,
/// two runs at once; keys starting with `contract-c3:` run three at once.
pub fn flow_settings() -> shardq_core::flow::FlowSettings {
    use shardq_core::flow::{FlowPolicy, GroupLimit, Rate};
    let rate = |count: u64| Rate {
        count,
        per_ms: 1_000,
    };
    let mut f = shardq_core::flow::FlowSettings::default();
    f.prefixes.insert(
        "contract-rate:".into(),
        FlowPolicy {
            rate: Some(rate(10)),
            burst: Some(2),
            ..FlowPolicy::default()
        },
    );
    f.groups.insert(
        "contract-group".into(),
        GroupLimit {
            rate: Some(rate(20)),
            burst: Some(3),
            concurrency: None,
        },
    );
    f.groups.insert(
        "contract-slots".into(),
        GroupLimit {
            rate: None,
            burst: None,
            concurrency: Some(2),
        },
    );
    f.prefixes.insert(
        "contract-slot:".into(),
        FlowPolicy {
            group: Some("contract-slots".into()),
            ..FlowPolicy::default()
        },
    );
    for (prefix, weight) in [
        ("contract-w1:", 1),
        ("contract-w2:", 2),
        ("contract-w4:", 4),
    ] {
        f.prefixes.insert(
            prefix.into(),
            FlowPolicy {
                weight,
                ..FlowPolicy::default()
            },
        );
    }
    f.prefixes.insert(
        "contract-c3:".into(),
        FlowPolicy {
            concurrency: 3,
            ..FlowPolicy::default()
        },
    );
    f.prefixes.insert(
        "contract-c3r:".into(),
        FlowPolicy {
            concurrency: 3,
            rate: Some(rate(2)),
            burst: Some(2),
            ..FlowPolicy::default()
        },
    );
    f.prefixes.insert(
        "contract-vip:".into(),
        FlowPolicy {
            priority: 5,
            ..FlowPolicy::default()
        },
    );
    f.prefixes.insert(
        "contract-grp:".into(),
        FlowPolicy {
            group: Some("contract-group".into()),
            ..FlowPolicy::default()
        },
    );
    f
}

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

/// A key sealed for a move freezes only when no job of it is left above
/// its cursor (what its new shard took), atomically: a job that arrived
/// after the last copy keeps it unfrozen. A frozen key's
/// enqueues are refused whole, naming the new shard, and store nothing,
/// with or without dedup ids; other keys' go in. A key not sealed never
/// freezes, and lifting the seal lifts the freeze.
pub fn a_moving_key_freezes_only_once_copied(h: &dyn ContractHarness) {
    let b = h.backend();
    let (from, to) = (h.fresh_shard(), h.fresh_shard());
    enqueue(h, &from, "k", "a", 5);
    enqueue(h, &from, "k", "b", 1);
    enqueue(h, &from, "free", "f", 5);
    let mut fence = b.fence(&from).expect("fence");
    fence.sealed_keys.insert("k".into(), to.clone());
    b.set_fence(&from, &fence).expect("seal");
    let items = |after: Option<JobId>| vec![("k".to_string(), after), ("free".to_string(), None)];
    let frozen = b.freeze_caught_up(&from, &items(None)).expect("freeze");
    assert!(
        frozen.is_empty(),
        "froze a key whose jobs were not copied: {frozen:?}"
    );
    let jobs = b.export_jobs(&from, "k", None, 10).expect("export");
    assert_eq!(jobs.len(), 2);
    let mut cursor = Some(jobs[1].id);
    // A job that arrives after the copy keeps the key unfrozen.
    enqueue(h, &from, "k", "c", 5);
    let frozen = b.freeze_caught_up(&from, &items(cursor)).expect("freeze");
    assert!(frozen.is_empty(), "froze a key with a job above its cursor");
    let late = b.export_jobs(&from, "k", cursor, 10).expect("export");
    assert_eq!(late.len(), 1);
    cursor = Some(late[0].id);
    let frozen = b.freeze_caught_up(&from, &items(cursor)).expect("freeze");
    assert_eq!(
        frozen,
        ["k"],
        "a caught-up sealed key must freeze; an unsealed one never"
    );
    assert!(b.fence(&from).expect("fence").is_frozen("k"));
    // Frozen: enqueues of the key are refused whole and store nothing.
    let before = depth(h, &from, "k");
    let batch = [NewJob::new("free", "g"), NewJob::new("k", "d")];
    match b.enqueue(&from, u64::MAX, &batch) {
        Err(QueueError::Moved { key, to: went, .. }) => {
            assert_eq!((key.as_str(), went.as_str()), ("k", to.as_str()));
        }
        other => panic!("a frozen key's enqueue must be refused as moved, got {other:?}"),
    }
    let with_id = [NewJob::new("k", "d").with_dedup_id("x")];
    assert!(
        matches!(
            b.enqueue_dedup(&from, u64::MAX, &with_id, 60_000),
            Err(QueueError::Moved { .. })
        ),
        "a frozen key's dedup enqueue must be refused as moved"
    );
    assert_eq!(
        depth(h, &from, "k"),
        before,
        "a refused enqueue stored a job"
    );
    assert_eq!(
        depth(h, &from, "free"),
        1,
        "a refused batch stored part of itself"
    );
    enqueue(h, &from, "free", "g", 5);
    // Freezing again is harmless; unsealing ends the freeze.
    assert_eq!(
        b.freeze_caught_up(&from, &items(cursor)).expect("freeze"),
        ["k"]
    );
    let mut fence = b.fence(&from).expect("fence");
    fence.unseal("k");
    b.set_fence(&from, &fence).expect("unseal");
    assert!(!b.fence(&from).expect("fence").is_frozen("k"));
    enqueue(h, &from, "k", "e", 5);
    assert_eq!(depth(h, &from, "k"), before + 1);
}

/// A key's backlog moves to another shard whole: a sealed key starts no
/// run where it is, its queued, delayed, retried and dead jobs are exported
/// in key order and imported with their payloads, times and attempts, a
/// second import stores nothing twice, and the purge leaves the other keys
/// alone. A backend without the capability says so.
pub fn backlogs_move_with_their_key(h: &dyn ContractHarness) {
    let b = h.backend();
    let (from, to) = (h.fresh_shard(), h.fresh_shard());
    // a: a dead letter; b: retried once, at the head; c: queued; d: delayed.
    enqueue(h, &from, "k", "a", 1);
    let run = claim(h, &from, 1, LONG_LEASE_MS).remove(0);
    b.fail(&from, run.receipt(), "boom", None).expect("fail");
    enqueue(h, &from, "k", "b", 5);
    let run = claim(h, &from, 1, LONG_LEASE_MS).remove(0);
    b.fail(&from, run.receipt(), "again", Some(0))
        .expect("fail");
    enqueue(h, &from, "k", "c", 5);
    let mut d = NewJob::new("k", "d");
    d.delay_ms = 3_600_000;
    b.enqueue(&from, u64::MAX, &[d]).expect("enqueue");
    enqueue(h, &from, "other", "o", 5);

    let mut fence = b.fence(&from).expect("fence");
    fence.sealed_keys.insert("k".into(), to.clone());
    b.set_fence(&from, &fence).expect("seal");
    let ran: Vec<String> = claim(h, &from, 10, LONG_LEASE_MS)
        .into_iter()
        .map(|j| j.key)
        .collect();
    assert_eq!(ran, ["other"], "a sealed key started a run");

    let first = b.export_jobs(&from, "k", None, 2).expect("export");
    let rest = b
        .export_jobs(&from, "k", Some(first[1].id), 10)
        .expect("export");
    let all: Vec<_> = first.into_iter().chain(rest).collect();
    let payloads: Vec<&[u8]> = all.iter().map(|j| &j.payload[..]).collect();
    assert_eq!(payloads, [b"a", b"b", b"c", b"d"], "export in key order");
    assert_eq!(
        all[0].dead.as_deref(),
        Some("boom"),
        "the dead letter and its reason"
    );
    assert_eq!((all[1].attempt, all[1].dead.is_none()), (1, true));
    assert!(all[3].not_before_ms > all[2].not_before_ms + 3_000_000);

    let stored = b.import_jobs(&to, &from, "k", &all).expect("import");
    assert_eq!(stored.len(), 4);
    assert!(
        b.import_jobs(&to, &from, "k", &all)
            .expect("import")
            .is_empty(),
        "a second import of the same jobs stored them twice"
    );
    assert_eq!(
        b.imported_up_to(&to, &from, "k").expect("cursor"),
        Some(all[3].id)
    );
    let c = b.key_counts(&to, "k").expect("counts");
    assert_eq!((c.depth, c.dead), (3, 1));
    let dead = b.dead_list(&to, 10).expect("dead list");
    assert_eq!((dead.len(), dead[0].reason.as_str()), (1, "boom"));
    let next = claim(h, &to, 10, LONG_LEASE_MS);
    assert_eq!(next.len(), 1);
    assert_eq!((&next[0].payload[..], next[0].attempt), (&b"b"[..], 2));
    ack_one(h, &to, next[0].receipt());
    let next = claim(h, &to, 10, LONG_LEASE_MS);
    assert_eq!(&next[0].payload[..], b"c");
    ack_one(h, &to, next[0].receipt());
    assert!(
        claim(h, &to, 10, LONG_LEASE_MS).is_empty(),
        "a delayed job moved ahead of its time"
    );

    assert_eq!(b.purge_key(&from, "k").expect("purge"), 4);
    let c = b.key_counts(&from, "k").expect("counts");
    assert_eq!((c.depth, c.in_flight, c.dead), (0, 0, 0));
    let c = b.key_counts(&from, "other").expect("counts");
    assert_eq!(c.in_flight, 1, "the purge touched another key");

    several_keys_move_in_one_import(h, &from, &to);
    an_unsealed_key_runs_where_it_is(h, &from, &to);
}

/// The batched export and import of [`backlogs_move_with_their_key`], from
/// `from` to `to`.
fn several_keys_move_in_one_import(h: &dyn ContractHarness, from: &str, to: &str) {
    let b = h.backend();
    // Several keys in one import: each key's jobs land in order, once.
    for i in 0..3 {
        enqueue(h, from, "m1", &format!("x{i}"), 5);
        enqueue(h, from, "m2", &format!("y{i}"), 5);
    }
    let items: Vec<(String, Vec<shardq_core::job::MovedJob>)> = ["m1", "m2"]
        .into_iter()
        .map(|k| {
            (
                k.to_string(),
                b.export_jobs(from, k, None, 10).expect("export"),
            )
        })
        .collect();
    // The batched export gives what the per-key one gives, from each cursor.
    let m2_after = items[1].1[0].id;
    let many = b
        .export_many(
            from,
            &[("m1".to_string(), None), ("m2".to_string(), Some(m2_after))],
        )
        .expect("export many");
    assert_eq!(many.len(), 2);
    assert_eq!((many[0].0.as_str(), &many[0].1), ("m1", &items[0].1));
    assert_eq!(
        (many[1].0.as_str(), &many[1].1[..]),
        ("m2", &items[1].1[1..])
    );
    assert_eq!(b.import_many(to, from, &items).expect("import").len(), 6);
    assert!(b.import_many(to, from, &items).expect("import").is_empty());
    let mut ran: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    loop {
        let jobs = claim(h, to, 10, LONG_LEASE_MS);
        if jobs.is_empty() {
            break;
        }
        for j in jobs {
            ran.entry(j.key.clone())
                .or_default()
                .push(String::from_utf8_lossy(&j.payload).into_owned());
            ack_one(h, to, j.receipt());
        }
    }
    for (k, first) in [("m1", "x"), ("m2", "y")] {
        let want: Vec<String> = (0..3).map(|i| format!("{first}{i}")).collect();
        assert_eq!(ran.get(k), Some(&want), "key {k} after a batched import");
    }
}

/// The move given up of [`backlogs_move_with_their_key`], on `to` (sealed
/// towards `from`).
fn an_unsealed_key_runs_where_it_is(h: &dyn ContractHarness, from: &str, to: &str) {
    let b = h.backend();
    // A move given up: unsealed, a key runs where it is again, one run at a
    // time, whether a claim passed it by while sealed ("u") or not ("w").
    for (k, p) in [("u", "u0"), ("u", "u1"), ("w", "w0"), ("w", "w1")] {
        enqueue(h, to, k, p, 5);
    }
    let seal = |keys: &[&str]| {
        let mut f = b.fence(to).expect("fence");
        f.sealed_keys = keys
            .iter()
            .map(|k| (k.to_string(), from.to_string()))
            .collect();
        b.set_fence(to, &f).expect("fence");
    };
    seal(&["u"]);
    let mut order: Vec<String> = Vec::new();
    for j in claim(h, to, 10, LONG_LEASE_MS) {
        assert_eq!(j.key, "w", "a sealed key started a run");
        order.push(String::from_utf8_lossy(&j.payload).into_owned());
        ack_one(h, to, j.receipt());
    }
    seal(&["w"]);
    seal(&[]);
    assert!(b.fence(to).expect("fence").sealed_keys.is_empty());
    loop {
        let jobs = claim(h, to, 10, LONG_LEASE_MS);
        if jobs.is_empty() {
            break;
        }
        let mut keys: Vec<&str> = jobs.iter().map(|j| j.key.as_str()).collect();
        keys.sort_unstable();
        let n = keys.len();
        keys.dedup();
        assert_eq!(keys.len(), n, "one claim started two runs of a key");
        for j in jobs {
            order.push(String::from_utf8_lossy(&j.payload).into_owned());
            ack_one(h, to, j.receipt());
        }
    }
    for k in ["u", "w"] {
        let mine: Vec<&String> = order.iter().filter(|p| p.starts_with(k)).collect();
        assert_eq!(
            mine,
            [&format!("{k}0"), &format!("{k}1")],
            "key {k} after its unseal"
        );
    }
}

/// The window the dedup checks use (long enough never to lapse in a check).
const DEDUP_WINDOW_MS: u64 = 600_000;

fn enqueue_dedup(
    h: &dyn ContractHarness,
    shard: &str,
    jobs: &[(&str, &str)],
    window_ms: u64,
) -> Vec<shardq_core::job::Stored> {
    let jobs: Vec<NewJob> = jobs
        .iter()
        .map(|(k, d)| NewJob::new(*k, "p").with_dedup_id(*d))
        .collect();
    h.backend()
        .enqueue_dedup(shard, u64::MAX, &jobs, window_ms)
        .unwrap_or_else(|e| panic!("enqueue_dedup to {shard}: {e}"))
}

fn depth(h: &dyn ContractHarness, shard: &str, key: &str) -> u64 {
    h.backend()
        .key_counts(shard, key)
        .expect("key_counts")
        .depth
}

/// A dedup id is scoped to its key: a second enqueue of one `(key, id)` is
/// told the first job's id and stores nothing; another key's job with the
/// same id is stored; two jobs of one batch with one `(key, id)` store one;
/// past the window the id is free again; a fenced batch stores nothing and
/// records nothing.
pub fn dedup_ids_belong_to_their_key(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let first = enqueue_dedup(h, &shard, &[("a", "inv-1")], DEDUP_WINDOW_MS);
    assert!(!first[0].duplicate, "a fresh id stores its job");
    assert_eq!(first[0].shard, shard);
    let again = enqueue_dedup(
        h,
        &shard,
        &[("a", "inv-1"), ("b", "inv-1")],
        DEDUP_WINDOW_MS,
    );
    assert!(
        again[0].duplicate,
        "the same (key, id) again is a duplicate"
    );
    assert_eq!(again[0].id, first[0].id, "a duplicate names the first job");
    assert!(
        !again[1].duplicate,
        "another key's job with the same id is stored"
    );
    assert_eq!(depth(h, &shard, "a"), 1, "the duplicate was not stored");
    assert_eq!(depth(h, &shard, "b"), 1);
    let twice = enqueue_dedup(
        h,
        &shard,
        &[("c", "x"), ("c", "x"), ("c", "y")],
        DEDUP_WINDOW_MS,
    );
    assert!(!twice[0].duplicate && twice[1].duplicate && !twice[2].duplicate);
    assert_eq!(
        twice[1].id, twice[0].id,
        "the second of a batch names the first"
    );
    assert_eq!(depth(h, &shard, "c"), 2);
    // A plain enqueue does not take dedup ids (they would go unchecked).
    let plain = h.backend().enqueue(
        &shard,
        u64::MAX,
        &[NewJob::new("a", "p").with_dedup_id("inv-1")],
    );
    assert!(plain.is_err(), "enqueue must refuse a job with a dedup id");
    assert_eq!(depth(h, &shard, "a"), 1);
    // A bad id is refused, naming it, and stores nothing.
    let bad = h.backend().enqueue_dedup(
        &shard,
        u64::MAX,
        &[NewJob::new("d", "p").with_dedup_id("a\nb")],
        DEDUP_WINDOW_MS,
    );
    assert!(
        matches!(bad, Err(QueueError::InvalidDedupId { .. })),
        "{bad:?}"
    );
    assert_eq!(depth(h, &shard, "d"), 0);
    // A fenced batch records nothing: the id is fresh afterwards.
    let mut fence = h.backend().fence(&shard).expect("fence");
    fence.map_version_min = 10;
    h.backend().set_fence(&shard, &fence).expect("set_fence");
    let fenced = h.backend().enqueue_dedup(
        &shard,
        9,
        &[NewJob::new("e", "p").with_dedup_id("z")],
        DEDUP_WINDOW_MS,
    );
    assert!(
        matches!(fenced, Err(QueueError::Fenced { .. })),
        "{fenced:?}"
    );
    assert!(!enqueue_dedup(h, &shard, &[("e", "z")], DEDUP_WINDOW_MS)[0].duplicate);
    // Past its window an id is free again.
    let short = enqueue_dedup(h, &shard, &[("f", "w")], 200);
    assert!(!short[0].duplicate);
    h.pass_ms(400);
    let later = enqueue_dedup(h, &shard, &[("f", "w")], 200);
    assert!(
        !later[0].duplicate,
        "an expired record no longer suppresses a job"
    );
    assert_ne!(later[0].id, short[0].id);
    assert_eq!(depth(h, &shard, "f"), 2);
}

/// What schedules stand on (`shardq_core::schedule`): a tick's job, fired
/// again and again with its tick's dedup id and a schedule's window (the
/// default catch-up plus the margin), is stored once, and is read back live while it waits and runs
/// (the overlap policies ask for it by id).
pub fn schedule_ticks_store_once(h: &dyn ContractHarness) {
    use shardq_core::schedule::{tick_dedup_id, CATCH_UP_MS_DEFAULT, SCHEDULE_DEDUP_MARGIN_MS};
    let shard = h.fresh_shard();
    let fire = |tick: u64| {
        h.backend()
            .enqueue_dedup(
                &shard,
                u64::MAX,
                &[NewJob::new("sched-key", "tick").with_dedup_id(tick_dedup_id("s-1", tick))],
                CATCH_UP_MS_DEFAULT + SCHEDULE_DEDUP_MARGIN_MS,
            )
            .expect("fire")
            .remove(0)
    };
    let first = fire(1_000);
    assert!(!first.duplicate);
    h.pass_ms(300);
    let again = fire(1_000);
    assert!(again.duplicate, "a tick fired again is not stored again");
    assert_eq!(again.id, first.id);
    assert!(!fire(2_000).duplicate, "the next tick is its own job");
    assert_eq!(depth(h, &shard, "sched-key"), 2);
    let info = h
        .backend()
        .job(&shard, first.id)
        .expect("job")
        .expect("live");
    assert_eq!(info.state, shardq_core::JobState::Queued);
    let run = claim(h, &shard, 1, 30_000);
    assert_eq!(run.len(), 1);
    let info = h
        .backend()
        .job(&shard, first.id)
        .expect("job")
        .expect("live");
    assert_eq!(info.state, shardq_core::JobState::Running);
    ack_one(h, &shard, run[0].receipt());
    assert!(h.backend().job(&shard, first.id).expect("job").is_none());
    assert!(
        fire(1_000).duplicate,
        "an ended tick's job is still not stored again"
    );
}

/// A job keeps the dedup id it was enqueued with, and its claim, its view
/// and its copy in a move carry it: a retried run, a dead letter and a
/// job moved to another shard still name it (a schedule's job, its
/// schedule and tick). A job enqueued without one has none.
pub fn a_jobs_dedup_id_follows_it_through_claims_and_moves(h: &dyn ContractHarness) {
    use shardq_core::schedule::{tick_dedup_id, ScheduleTick};
    let b = h.backend();
    let (from, to) = (h.fresh_shard(), h.fresh_shard());
    let tick = tick_dedup_id("nightly", 1_800_000_000_000);
    let mut dies = NewJob::new("dk", "dead").with_dedup_id("order-17");
    dies.max_attempts = 1;
    let jobs = [
        dies,
        NewJob::new("dk", "tick").with_dedup_id(tick.clone()),
        NewJob::new("dk", "plain"),
    ];
    let stored = b
        .enqueue_dedup(&from, u64::MAX, &jobs, DEDUP_WINDOW_MS)
        .expect("enqueue");
    let dedup_of = |shard: &str, id| b.job(shard, id).expect("job").expect("live").dedup_id;
    assert_eq!(dedup_of(&from, stored[0].id).as_deref(), Some("order-17"));
    assert_eq!(dedup_of(&from, stored[2].id), None);
    // The first dies on its one attempt; the second's run lapses and it
    // runs again: every claim names its id.
    let run = claim(h, &from, 1, LONG_LEASE_MS).remove(0);
    assert_eq!(run.dedup_id.as_deref(), Some("order-17"));
    b.fail(&from, run.receipt(), "boom", None).expect("fail");
    let dead = b.job(&from, stored[0].id).expect("job").expect("kept");
    assert_eq!(
        (dead.state, dead.dedup_id.as_deref()),
        (JobState::Dead, Some("order-17"))
    );
    let first = claim(h, &from, 1, 1_000).remove(0);
    assert_eq!(first.dedup_id.as_deref(), Some(tick.as_str()));
    h.pass_ms(1_001);
    let again = claim(h, &from, 1, LONG_LEASE_MS).remove(0);
    assert_eq!(
        (again.id, again.attempt),
        (first.id, 2),
        "the lapsed run again"
    );
    let named =
        ScheduleTick::of_dedup_id(again.dedup_id.as_deref().expect("kept")).expect("a schedule's");
    assert_eq!(
        (named.id.as_str(), named.tick_ms),
        ("nightly", 1_800_000_000_000)
    );
    b.fail(&from, again.receipt(), "later", Some(3_600_000))
        .expect("fail");
    // Moved: the copies keep their ids, dead letter included.
    let moved = b.export_jobs(&from, "dk", None, 10).expect("export");
    let ids: Vec<Option<&str>> = moved.iter().map(|j| j.dedup_id.as_deref()).collect();
    assert_eq!(ids, [Some("order-17"), Some(tick.as_str()), None]);
    let pairs = b.import_jobs(&to, &from, "dk", &moved).expect("import");
    assert_eq!(pairs.len(), 3);
    for ((_, new), want) in pairs.iter().zip(&ids) {
        assert_eq!(dedup_of(&to, *new).as_deref(), *want);
    }
    // A moved job with a dedup id no backend could hold is refused whole.
    let mut bad = moved[2].clone();
    bad.id = JobId(bad.id.0 + 1_000);
    bad.dedup_id = Some("x".repeat(shardq_core::job::DEDUP_ID_BYTES_MAX + 1));
    assert!(b.import_jobs(&to, &from, "dk", &[bad]).is_err());
}

/// One keyed job through `enqueue_dedup`.
fn put_keyed(h: &dyn ContractHarness, shard: &str, job: NewJob) -> shardq_core::job::Stored {
    h.backend()
        .enqueue_dedup(shard, u64::MAX, &[job], DEDUP_WINDOW_MS)
        .unwrap_or_else(|e| panic!("keyed enqueue to {shard}: {e}"))
        .remove(0)
}

/// A unique job is not stored while the key's newest job with its id
/// waits (or, asked for, runs): the enqueue answers that job. The id is
/// scoped to its key; a dead job frees it; a job that runs frees it for
/// `--unique-while queued`; moved with its key, the job holds its id on
/// its new shard.
pub fn unique_jobs_hold_their_id_while_they_wait_or_run(h: &dyn ContractHarness) {
    let b = h.backend();
    let shard = h.fresh_shard();
    let u = |p: &str, running: bool| NewJob::new("uk", p).unique("sync", running);
    let first = put_keyed(h, &shard, u("a", false));
    assert!(!first.duplicate, "a fresh id stores its job");
    let again = put_keyed(h, &shard, u("b", true));
    assert!(
        again.duplicate && again.id == first.id,
        "a waiting job holds its id: {again:?}"
    );
    assert!(!put_keyed(h, &shard, NewJob::new("uk2", "c").unique("sync", false)).duplicate);
    assert!(!put_keyed(h, &shard, NewJob::new("uk3", "d").unique("other", false)).duplicate);
    assert_eq!(depth(h, &shard, "uk"), 1);
    let runs = claim(h, &shard, 10, LONG_LEASE_MS);
    let run = runs.iter().find(|r| r.key == "uk").expect("uk runs");
    assert_eq!(run.id, first.id);
    let held = put_keyed(h, &shard, u("e", true));
    assert!(
        held.duplicate && held.id == first.id,
        "a running job holds it when asked"
    );
    let mut queued_only = u("f", false);
    queued_only.max_attempts = 1;
    let second = put_keyed(h, &shard, queued_only);
    assert!(
        !second.duplicate,
        "a running job does not hold it for queued-only"
    );
    let third = put_keyed(h, &shard, u("g", true));
    assert!(
        third.duplicate && third.id == second.id,
        "the newest job holds it"
    );
    ack_one(h, &shard, run.receipt());
    let fourth = put_keyed(h, &shard, u("h", false));
    assert!(fourth.duplicate && fourth.id == second.id);
    // The second dies on its one attempt: the id is free.
    let run = claim(h, &shard, 10, LONG_LEASE_MS)
        .into_iter()
        .find(|r| r.key == "uk")
        .expect("the second runs");
    assert_eq!(run.id, second.id);
    b.fail(&shard, run.receipt(), "boom", None).expect("fail");
    let fresh = put_keyed(h, &shard, u("i", false));
    assert!(!fresh.duplicate, "a dead job does not hold its id");
    // Moved with its key: the copy holds the id on the new shard.
    let to = h.fresh_shard();
    let moved = b.export_jobs(&shard, "uk", None, 100).expect("export");
    let pairs = b.import_jobs(&to, &shard, "uk", &moved).expect("import");
    let (_, copy) = pairs
        .iter()
        .find(|(old, _)| *old == fresh.id)
        .copied()
        .expect("the waiting job was copied");
    let there = put_keyed(h, &to, u("j", false));
    assert!(there.duplicate && there.id == copy, "{there:?} vs {copy:?}");
}

/// A debounced job whose key holds a waiting job with its id is not
/// stored: that job takes the new payload and starts `delay` after this
/// enqueue, never later than `max` after its first; once it runs, the
/// next enqueue starts a new burst. Moved with its key, the waiting job
/// still takes the burst's enqueues on its new shard.
pub fn debounced_jobs_take_the_last_payload_and_run_once(h: &dyn ContractHarness) {
    let b = h.backend();
    let shard = h.fresh_shard();
    let d = |p: &str| NewJob::new("dk", p).debounced("recalc", 5_000, 20_000);
    let info = |shard: &str, id| b.job(shard, id).expect("job").expect("live");
    let first = put_keyed(h, &shard, d("v1"));
    assert!(!first.duplicate);
    let created = info(&shard, first.id).created_ms;
    assert_eq!(info(&shard, first.id).not_before_ms, created + 5_000);
    let mut starts = vec![created + 5_000];
    for (n, p) in ["v2", "v3", "v4", "v5"].iter().enumerate() {
        h.pass_ms(6_000);
        let st = put_keyed(h, &shard, d(p));
        assert_eq!((st.id, st.duplicate), (first.id, false), "{p}: {st:?}");
        let j = info(&shard, first.id);
        assert_eq!(j.payload, p.as_bytes(), "the last payload");
        starts.push(j.not_before_ms);
        // 6 s apart: each pushes the start by 5 s past its enqueue, up to
        // the first enqueue + 20 s.
        let want = (created + 6_000 * (n as u64 + 1) + 5_000).min(created + 20_000);
        assert_eq!(j.not_before_ms, want, "{p}");
    }
    assert_eq!(depth(h, &shard, "dk"), 1, "one job for the burst");
    assert!(
        put_keyed(
            h,
            &shard,
            NewJob::new("dk", "x").debounced("other", 1_000, 1_000)
        )
        .id != first.id,
        "another id is another burst"
    );
    // Due: it runs with the last payload; a debounce while it runs starts
    // a new burst.
    h.pass_ms(1_000);
    let run = claim(h, &shard, 10, LONG_LEASE_MS)
        .into_iter()
        .find(|r| r.id == first.id)
        .expect("the burst's job runs");
    assert_eq!(run.payload, b"v5");
    let next = put_keyed(h, &shard, d("w1"));
    assert!(
        next.id != first.id && !next.duplicate,
        "a running job takes no more"
    );
    ack_one(h, &shard, run.receipt());
    // Moved: the waiting job on the new shard takes the next enqueue.
    let to = h.fresh_shard();
    let moved = b.export_jobs(&shard, "dk", None, 100).expect("export");
    let pairs = b.import_jobs(&to, &shard, "dk", &moved).expect("import");
    let (_, copy) = pairs
        .iter()
        .find(|(old, _)| *old == next.id)
        .copied()
        .expect("copied");
    let st = put_keyed(h, &to, d("w2"));
    assert_eq!((st.id, st.duplicate), (copy, false));
    assert_eq!(info(&to, copy).payload, b"w2");
    // A debounce on a key being copied away waits for the move (paused).
    let mut fence = b.fence(&shard).expect("fence");
    fence.sealed_keys.insert("dk".into(), to.clone());
    b.set_fence(&shard, &fence).expect("seal");
    let err = b
        .enqueue_dedup(&shard, u64::MAX, &[d("w3")], DEDUP_WINDOW_MS)
        .expect_err("paused while copied");
    assert!(matches!(err, QueueError::Paused { .. }), "{err}");
}

/// Many threads enqueueing one `(key, id)` at once store exactly one job,
/// and every one of them is told its id.
pub fn dedup_is_atomic_with_the_append(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let backend = h.backend();
    let results: Vec<Vec<shardq_core::job::Stored>> = std::thread::scope(|sc| {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let shard = &shard;
                sc.spawn(move || {
                    (0..10)
                        .flat_map(|_| {
                            backend
                                .enqueue_dedup(
                                    shard,
                                    u64::MAX,
                                    &[NewJob::new("k", "p").with_dedup_id("once")],
                                    DEDUP_WINDOW_MS,
                                )
                                .expect("enqueue_dedup")
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .collect()
    });
    let all: Vec<&shardq_core::job::Stored> = results.iter().flatten().collect();
    assert_eq!(all.len(), 40);
    assert_eq!(
        all.iter().filter(|s| !s.duplicate).count(),
        1,
        "exactly one enqueue of a (key, id) stores its job"
    );
    let id = all[0].id;
    assert!(all.iter().all(|s| s.id == id && s.shard == shard));
    assert_eq!(depth(h, &shard, "k"), 1, "one job stored");
}

/// A key's records exported from one shard and imported into another make
/// the other shard answer with the original job (on the first shard); an
/// import again changes nothing, and a record the target already holds is
/// kept.
pub fn dedup_records_move_with_export_and_import(h: &dyn ContractHarness) {
    let from = h.fresh_shard();
    let to = h.fresh_shard();
    let orig = enqueue_dedup(
        h,
        &from,
        &[("m", "1"), ("m", "2"), ("other", "1")],
        DEDUP_WINDOW_MS,
    );
    let on_to = enqueue_dedup(h, &to, &[("m", "2")], DEDUP_WINDOW_MS);
    let records = h.backend().dedup_export(&from, "m").expect("export");
    let mut ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["1", "2"], "export gives the key's records only");
    assert!(records.iter().all(|r| r.key == "m" && r.shard == from));
    for _ in 0..2 {
        h.backend().dedup_import(&to, &records).expect("import");
    }
    let after = enqueue_dedup(
        h,
        &to,
        &[("m", "1"), ("m", "2"), ("other", "1")],
        DEDUP_WINDOW_MS,
    );
    assert!(after[0].duplicate, "an imported record suppresses the job");
    assert_eq!(
        (after[0].shard.as_str(), after[0].id),
        (from.as_str(), orig[0].id)
    );
    assert!(after[1].duplicate);
    assert_eq!(
        (after[1].shard.as_str(), after[1].id),
        (to.as_str(), on_to[0].id),
        "a record the target held is kept"
    );
    assert!(!after[2].duplicate, "another key's records did not move");
    assert_eq!(depth(h, &to, "m"), 1);
    let keys = h.backend().dedup_keys(&from).expect("dedup_keys");
    assert!(keys.contains(&"m".to_string()) && keys.contains(&"other".to_string()));
}

/// An operator reads a live job by id and a key's live jobs in key order,
/// with their state, attempts, reason and payload; cancels a queued, a
/// delayed or a dead job so that it never runs, and the key's next job
/// becomes due at once; a finished, a cancelled or an unknown id is not
/// found. Other keys are untouched.
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

fn enqueue(h: &dyn ContractHarness, shard: &str, key: &str, payload: &str, attempts: u32) {
    let mut job = NewJob::new(key, payload);
    job.max_attempts = attempts;
    h.backend()
        .enqueue(shard, u64::MAX, &[job])
        .unwrap_or_else(|e| panic!("enqueue to {shard}: {e}"));
}

fn claim(h: &dyn ContractHarness, shard: &str, max: usize, lease_ms: u64) -> Vec<ClaimedJob> {
    h.backend()
        .claim(shard, max, lease_ms)
        .unwrap_or_else(|e| panic!("claim on {shard}: {e}"))
}

fn ack_one(h: &dyn ContractHarness, shard: &str, r: Receipt) {
    let out = h.backend().ack(shard, &[r]).expect("ack");
    assert_eq!(out.acked, 1, "the current run's ack must finish the job");
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

/// A dead letter of a key sealed for a move is neither retried nor purged
/// (its copy goes with the key; a change here would be lost with the
/// copies left behind), by id or with "all"; other keys' are, and once the
/// seal is lifted, so is it.
pub fn dead_letters_of_a_sealed_key_stay_as_they_are(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    enqueue(h, &shard, "s", "a", 1);
    enqueue(h, &shard, "f", "a", 1);
    let mut sealed_id = None;
    for run in claim(h, &shard, 10, LONG_LEASE_MS) {
        if run.key == "s" {
            sealed_id = Some(run.id);
        }
        b.fail(&shard, run.receipt(), "dead", None).expect("fail");
    }
    let sealed_id = sealed_id.expect("the key's head was claimed");
    let mut fence = b.fence(&shard).expect("fence");
    fence.sealed_keys.insert("s".into(), "elsewhere".into());
    b.set_fence(&shard, &fence).expect("seal");
    assert_eq!(b.dead_purge(&shard, Some(&[sealed_id])).expect("purge"), 0);
    assert_eq!(
        b.dead_retry(&shard, None).expect("retry all"),
        1,
        "only the other key's"
    );
    let dead = |k: &str| b.key_counts(&shard, k).expect("counts").dead;
    assert_eq!((dead("s"), dead("f")), (1, 0));
    // What a caller reports as left for a rerun, for every and for named ids.
    let left = |ids: Option<&[JobId]>| {
        shardq_core::backend::dead_left_moving(b, &shard, ids).expect("left")
    };
    assert_eq!(left(None), (1, vec!["s".to_string()]));
    assert_eq!(left(Some(&[sealed_id])), (1, vec!["s".to_string()]));
    fence.sealed_keys.remove("s");
    b.set_fence(&shard, &fence).expect("unseal");
    assert_eq!(b.dead_retry(&shard, Some(&[sealed_id])).expect("retry"), 1);
    assert_eq!(dead("s"), 0);
    assert_eq!(left(None), (0, Vec::new()));
}

/// An export from a cursor returns every job of the key above it, in id
/// order, even when dead letters retried around a retried head left the
/// key's queue out of id order (a skipped job would be purged by the move
/// that copied the others).
pub fn exports_find_every_job_above_a_cursor(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    for (payload, attempts) in [("1", 1), ("2", 1), ("3", 5), ("4", 5)] {
        enqueue(h, &shard, "x", payload, attempts);
    }
    let mut ids = Vec::new();
    for _ in 0..2 {
        let run = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
        ids.push(run.id);
        b.fail(&shard, run.receipt(), "dead", None).expect("fail");
    }
    let third = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    ids.push(third.id);
    // The second dead letter goes back behind the running third job, the
    // third is retried (it stays the head), then the first goes back in
    // front of it.
    assert_eq!(b.dead_retry(&shard, Some(&ids[1..2])).expect("retry"), 1);
    b.fail(&shard, third.receipt(), "again", Some(0))
        .expect("fail");
    assert_eq!(b.dead_retry(&shard, Some(&ids[0..1])).expect("retry"), 1);
    let mut all: Vec<JobId> = b
        .key_jobs(&shard, "x", 10)
        .expect("key_jobs")
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(all.len(), 4, "every job is live: {all:?}");
    all.sort_unstable();
    for cursor in std::iter::once(None).chain(all.iter().copied().map(Some)) {
        let got: Vec<JobId> = b
            .export_jobs(&shard, "x", cursor, 100)
            .expect("export")
            .iter()
            .map(|j| j.id)
            .collect();
        let want: Vec<JobId> = all
            .iter()
            .copied()
            .filter(|&id| cursor.is_none_or(|c| id > c))
            .collect();
        assert_eq!(got, want, "export after {cursor:?}");
    }
}

/// The jobs a move's purge deleted (queued and dead) answer which key they
/// left with; a finished job, another key's live job and an id never
/// handed out answer nothing.
pub fn purged_jobs_say_they_moved_away(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    enqueue(h, &shard, "m", "a", 1);
    enqueue(h, &shard, "o", "a", 5);
    enqueue(h, &shard, "m", "b", 5);
    enqueue(h, &shard, "m", "c", 5);
    let mut finished = None;
    for run in claim(h, &shard, 10, LONG_LEASE_MS) {
        if run.key == "m" {
            b.fail(&shard, run.receipt(), "dead", None).expect("fail");
        } else {
            finished = Some(run.id);
            ack_one(h, &shard, run.receipt());
        }
    }
    let finished = finished.expect("both keys' heads were claimed");
    enqueue(h, &shard, "o", "b", 5);
    let ids = |key: &str| -> Vec<JobId> {
        b.key_jobs(&shard, key, 10)
            .expect("key_jobs")
            .iter()
            .map(|j| j.id)
            .collect()
    };
    let (moving, other) = (ids("m"), ids("o"));
    assert_eq!((moving.len(), other.len()), (3, 1), "{moving:?} {other:?}");
    assert_eq!(b.purge_key(&shard, "m").expect("purge"), 3);
    for id in &moving {
        assert_eq!(
            b.moved_away(&shard, *id).expect("moved_away").as_deref(),
            Some("m"),
            "job {id} was deleted as its key moved"
        );
    }
    for id in [other[0], finished, JobId(u64::MAX / 2)] {
        assert_eq!(
            b.moved_away(&shard, id).expect("moved_away"),
            None,
            "job {id}"
        );
    }
}

/// An id from before a move finds its job's copy, through two moves
/// (a -> b -> c), with [`shardq_core::backend::follow_moves`] over the
/// backend's `moved_away` and `imported_as`; the copy's result is kept
/// under its new id. A job that never moved, and an id never handed out,
/// follow to nothing; a shard answers only for its own imports.
pub fn an_old_id_finds_its_copy_after_moves(h: &dyn ContractHarness) {
    use shardq_core::backend::follow_moves;
    let b = h.backend();
    let (sa, sb, sc) = (h.fresh_shard(), h.fresh_shard(), h.fresh_shard());
    let shards = [sa.clone(), sb.clone(), sc.clone()];
    for p in ["1", "2", "3"] {
        enqueue(h, &sa, "mv", p, 3);
    }
    enqueue(h, &sa, "st", "s", 3);
    let old: Vec<JobId> = b
        .key_jobs(&sa, "mv", 10)
        .expect("key_jobs")
        .iter()
        .map(|j| j.id)
        .collect();
    let stays = b.key_jobs(&sa, "st", 1).expect("key_jobs")[0].id;
    let move_key = |from: &str, to: &str| -> Vec<(JobId, JobId)> {
        let jobs = b.export_jobs(from, "mv", None, 10).expect("export");
        let pairs = b.import_jobs(to, from, "mv", &jobs).expect("import");
        b.purge_key(from, "mv").expect("purge");
        pairs
    };
    let ab = move_key(&sa, &sb);
    assert_eq!(ab.len(), 3);
    for (src, new) in &ab {
        assert_eq!(
            follow_moves(b, &shards, &sa, *src).expect("follow"),
            Some((sb.clone(), *new)),
            "job {src} of {sa} after one move"
        );
        assert_eq!(
            b.imported_as(&sb, &sa, *src).expect("imported_as"),
            Some(*new)
        );
        assert_eq!(b.imported_as(&sc, &sa, *src).expect("imported_as"), None);
    }
    let bc = move_key(&sb, &sc);
    let now: Vec<(String, JobId)> = old
        .iter()
        .map(|id| {
            follow_moves(b, &shards, &sa, *id)
                .expect("follow")
                .expect("found")
        })
        .collect();
    let want: Vec<(String, JobId)> = bc.iter().map(|(_, new)| (sc.clone(), *new)).collect();
    assert_eq!(now, want, "each old id follows to its copy on {sc}");
    // The copy runs and finishes with a result: the old id reaches it.
    let run = claim(h, &sc, 1, LONG_LEASE_MS).remove(0);
    assert_eq!((run.key.as_str(), run.id), ("mv", now[0].1));
    b.ack_results(&sc, &[run.receipt()], &[Some(b"r1".to_vec())])
        .expect("ack");
    let (at, id) = follow_moves(b, &shards, &sa, old[0])
        .expect("follow")
        .expect("found");
    let f = shardq_core::backend::finished_job(b, &at, id)
        .expect("finished")
        .expect("kept");
    assert_eq!(f.result.as_deref(), Some(&b"r1"[..]));
    for id in [stays, JobId(u64::MAX / 2)] {
        assert_eq!(
            follow_moves(b, &shards, &sa, id).expect("follow"),
            None,
            "job {id}"
        );
    }
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
