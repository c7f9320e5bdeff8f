//! The backend contract on one standalone instance, on a manual clock.

use std::sync::Arc;

use shardq_core::{
    Coordinator, DeadPolicy, FailOutcome, Fence, InspectJobs, JobId, KeyCounts, ManualClock,
    MoveKeys, QueueError, Receipt, RunJobs, JOB_LEASE_MS_DEFAULT as LEASE,
};
use shardq_redis::{RedisBackend, RedisError, RedisMapStore, RedisOptions};
use shardq_testkit::redis::RedisServer;

use crate::common::{init, job, map_of, opts_manual, owner, payloads, tick_adopt};

const T0: u64 = 1_700_000_000_000;

fn setup(server: &RedisServer, policy: DeadPolicy) -> (RedisBackend, ManualClock) {
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let mut opts = opts_manual(&clock);
    opts.dead_policy = policy;
    opts.backoff = shardq_core::Backoff {
        base_ms: 100,
        max_ms: 1_000,
        jitter_pct: 0,
        ..shardq_core::Backoff::default()
    };
    (RedisBackend::open(&map, opts).expect("open"), clock)
}

#[test]
fn per_key_fifo_one_in_flight_and_retry_first() {
    let server = RedisServer::start();
    let (b, clock) = setup(&server, DeadPolicy::Continue);
    assert!(matches!(
        b.claim("r0", 10, LEASE),
        Err(QueueError::NotOwner { .. })
    ));
    let _c = owner(&b, "w1", 10_000);
    let ids = b
        .enqueue(
            "r0",
            1,
            &[
                job("a", "a1"),
                job("b", "b1"),
                job("a", "a2"),
                job("b", "b2"),
                job("a", "a3"),
            ],
        )
        .unwrap();
    assert_eq!(ids, (1..=5).map(JobId).collect::<Vec<_>>());

    let first = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&first), ["a1", "b1"]);
    assert!(first.iter().all(|j| j.attempt == 1));
    assert!(
        b.claim("r0", 10, LEASE).unwrap().is_empty(),
        "one in flight per key"
    );
    assert_eq!(
        b.key_counts("r0", "a").unwrap(),
        KeyCounts {
            depth: 2,
            in_flight: 1,
            dead: 0
        }
    );

    let a1 = first.iter().find(|j| j.key == "a").unwrap().receipt();
    let b1 = first.iter().find(|j| j.key == "b").unwrap().receipt();
    assert_eq!(b.ack("r0", &[a1]).unwrap().acked, 1);
    // A second ack of the same run is stale and changes nothing.
    let twice = b.ack("r0", &[a1]).unwrap();
    assert_eq!((twice.acked, twice.stale), (0, vec![a1]));
    assert_eq!(
        b.fail("r0", b1, "boom", None).unwrap(),
        FailOutcome::Retry { at_ms: T0 + 100 }
    );
    // The retry waits for its backoff and holds back b2 meanwhile.
    assert_eq!(payloads(&b.claim("r0", 10, LEASE).unwrap()), ["a2"]);
    assert_eq!(b.next_due_ms("r0").unwrap(), Some(T0 + 100));
    clock.advance(100);
    let again = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&again), ["b1"]);
    assert_eq!(again[0].attempt, 2);
    assert_eq!(again[0].id, b1.id);
    assert!(again[0].fence > b1.fence, "a retry's fence grows");
    // The first run's receipt is stale now: fail and ack refuse it.
    assert!(matches!(
        b.fail("r0", b1, "late", None),
        Err(QueueError::StaleReceipt { .. })
    ));
    b.ack("r0", &[again[0].receipt()]).unwrap();
    assert_eq!(payloads(&b.claim("r0", 10, LEASE).unwrap()), ["b2"]);

    let stats = b.shard_stats("r0").unwrap();
    assert_eq!((stats.ready, stats.in_flight, stats.keys), (1, 2, 2));
}

#[test]
fn dead_letter_after_max_attempts_then_retry_and_purge() {
    let server = RedisServer::start();
    for policy in [DeadPolicy::Continue, DeadPolicy::Halt] {
        server.cli(&["flushall"]);
        let (b, clock) = setup(&server, policy);
        let _c = owner(&b, "w1", 10_000);
        let mut j = job("k", "k1");
        j.max_attempts = 2;
        b.enqueue("r0", 1, &[j, job("k", "k2")]).unwrap();
        for attempt in 1..=2 {
            let got = b.claim("r0", 10, LEASE).unwrap();
            assert_eq!(payloads(&got), ["k1"]);
            assert_eq!(got[0].attempt, attempt);
            let out = b
                .fail("r0", got[0].receipt(), &format!("bad {attempt}"), None)
                .unwrap();
            clock.advance(10_000);
            assert_eq!(out == FailOutcome::Dead, attempt == 2, "{policy:?}");
        }
        let dead = b.dead_list("r0", 10).unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!((dead[0].attempts, dead[0].reason.as_str()), (2, "bad 2"));
        assert_eq!(b.key_counts("r0", "k").unwrap().dead, 1);
        let next = b.claim("r0", 10, LEASE).unwrap();
        match policy {
            DeadPolicy::Halt => {
                assert!(next.is_empty(), "a dead job halts its key");
                assert_eq!(b.next_due_ms("r0").unwrap(), None);
                assert_eq!(b.dead_retry("r0", None).unwrap(), 1);
                let got = b.claim("r0", 10, LEASE).unwrap();
                assert_eq!(payloads(&got), ["k1"], "retried dead job keeps its place");
                assert_eq!(got[0].attempt, 1);
                b.ack("r0", &[got[0].receipt()]).unwrap();
                assert_eq!(payloads(&b.claim("r0", 10, LEASE).unwrap()), ["k2"]);
            }
            _ => {
                assert_eq!(payloads(&next), ["k2"]);
                assert_eq!(b.dead_purge("r0", Some(&[dead[0].id])).unwrap(), 1);
                assert!(b.dead_list("r0", 10).unwrap().is_empty());
                assert_eq!(b.key_counts("r0", "k").unwrap().dead, 0);
            }
        }
    }
}

/// A key's queue is a linked list: a dead job retried goes back to its
/// place by id (not simply to the head), behind a job already in flight;
/// a delayed head waits while other keys run.
#[test]
fn dead_retries_out_of_order_keep_key_order_and_delayed_heads_wait() {
    let server = RedisServer::start();
    let (b, clock) = setup(&server, DeadPolicy::Continue);
    let _c = owner(&b, "w1", 10_000);
    let once = |p: &str| {
        let mut j = job("k", p);
        j.max_attempts = 1;
        j
    };
    b.enqueue("r0", 1, &[once("a"), once("b"), job("k", "c")])
        .unwrap();
    let mut dead = Vec::new();
    for p in ["a", "b"] {
        let got = b.claim("r0", 10, LEASE).unwrap();
        assert_eq!(payloads(&got), [p]);
        assert_eq!(
            b.fail("r0", got[0].receipt(), "x", None).unwrap(),
            FailOutcome::Dead
        );
        dead.push(got[0].id);
    }
    let c = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&c), ["c"]);
    b.enqueue("r0", 1, &[job("k", "d")]).unwrap();
    // Oldest first, one call each: b must walk past a to reach its place.
    assert_eq!(b.dead_retry("r0", Some(&[dead[0]])).unwrap(), 1);
    assert_eq!(b.dead_retry("r0", Some(&[dead[1]])).unwrap(), 1);
    assert!(
        b.claim("r0", 10, LEASE).unwrap().is_empty(),
        "c is still in flight"
    );
    assert_eq!(b.key_counts("r0", "k").unwrap().depth, 3);
    b.ack("r0", &[c[0].receipt()]).unwrap();
    let mut order = Vec::new();
    loop {
        let got = b.claim("r0", 10, LEASE).unwrap();
        if got.is_empty() {
            break;
        }
        assert_eq!(got.len(), 1, "one in flight per key");
        order.extend(payloads(&got));
        b.ack("r0", &[got[0].receipt()]).unwrap();
    }
    assert_eq!(order, ["a", "b", "d"]);
    assert_eq!(b.key_counts("r0", "k").unwrap(), KeyCounts::default());

    let mut late = job("late", "l1");
    late.delay_ms = 500;
    b.enqueue("r0", 1, &[late, job("late", "l2"), job("now", "n1")])
        .unwrap();
    assert_eq!(payloads(&b.claim("r0", 10, LEASE).unwrap()), ["n1"]);
    assert!(b.claim("r0", 10, LEASE).unwrap().is_empty());
    assert_eq!(b.next_due_ms("r0").unwrap(), Some(T0 + 500));
    clock.advance(500);
    assert_eq!(payloads(&b.claim("r0", 10, LEASE).unwrap()), ["l1"]);
}

#[test]
fn fence_refuses_old_maps_and_paused_keys_atomically() {
    let server = RedisServer::start();
    let (b, _clock) = setup(&server, DeadPolicy::Continue);
    let mut fence = Fence {
        map_version_min: 5,
        run_fence_min: 42,
        ..Fence::default()
    };
    fence.paused_keys.insert("t-42".into());
    b.set_fence("r0", &fence).unwrap();
    assert_eq!(b.fence("r0").unwrap(), fence);
    match b.enqueue("r0", 4, &[job("a", "x")]) {
        Err(QueueError::Fenced {
            map_version: 4,
            map_version_min: 5,
            ..
        }) => {}
        other => panic!("expected Fenced, got {other:?}"),
    }
    let err = b
        .enqueue("r0", 5, &[job("a", "x"), job("t-42", "y")])
        .unwrap_err();
    assert!(matches!(err, QueueError::Paused { ref key, .. } if key == "t-42"));
    assert!(err.to_string().contains("r0"));
    assert_eq!(
        b.key_counts("r0", "a").unwrap().depth,
        0,
        "nothing of a refused batch lands"
    );
    b.enqueue("r0", 6, &[job("a", "x")]).unwrap();
    b.set_fence("r0", &Fence::default()).unwrap();
    b.enqueue("r0", 1, &[job("t-42", "y")]).unwrap();
    assert_eq!(b.key_counts("r0", "t-42").unwrap().depth, 1);
}

#[test]
fn killed_worker_is_taken_over_with_attempt_plus_one_in_order() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let a = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let mut ca = owner(&a, "host-a@1", 300);
    a.enqueue("r0", 1, &[job("k", "k1"), job("k", "k2")])
        .unwrap();
    let got = a.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&got), ["k1"]);

    // Process A stops ticking (it died mid-job). B waits for the lease.
    let mut cb = owner(&b, "host-b@2", 300);
    assert!(tick_adopt(&b, &mut cb).is_empty());
    assert!(
        cb.standby_reason().contains("host-a@1"),
        "{}",
        cb.standby_reason()
    );
    clock.advance(301);
    assert_eq!(tick_adopt(&b, &mut cb), ["r0"]);
    let again = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&again), ["k1"]);
    assert_eq!(again[0].attempt, 2);

    assert!(again[0].fence > got[0].fence, "fences grow across owners");
    // A's late ack carries a stale token and is refused.
    assert!(matches!(
        a.ack("r0", &[got[0].receipt()]),
        Err(QueueError::NotOwner { .. })
    ));
    let own = ca.tick().unwrap();
    assert_eq!(own.lost, ["r0"]);

    b.ack("r0", &[again[0].receipt()]).unwrap();
    let k2 = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&k2), ["k2"]);
    assert_eq!(k2[0].attempt, 1);
    // Giving the lease up lets A take over at once.
    cb.release_all().unwrap();
    assert_eq!(tick_adopt(&a, &mut ca), ["r0"]);
    let k2b = a.claim("r0", 10, LEASE).unwrap();
    assert_eq!((payloads(&k2b)[0].as_str(), k2b[0].attempt), ("k2", 2));
}

#[test]
fn unreachable_server_names_shard_and_url() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("redis://127.0.0.1:{port}/0");
    let map = map_of(&[("gone-0", url.clone())]);
    let opts = RedisOptions {
        retry_attempts: 3,
        ..RedisOptions::default()
    };
    let err = RedisBackend::open(&map, opts).unwrap_err();
    assert!(matches!(err, RedisError::Unreachable { attempts: 3, .. }));
    let text = err.to_string();
    assert!(text.contains("gone-0") && text.contains(&url), "{text}");
    let q: QueueError = err.into();
    assert!(q.is_transient(), "{q}");
    assert!(matches!(q, QueueError::Unavailable { ref shard, .. } if shard == "gone-0"));
}

/// Settings changes on Redis lose nothing: writers through three map
/// store handles (three processes' connections) racing on one setting.
#[test]
fn settings_changes_on_redis_are_never_lost() {
    let server = RedisServer::start();
    let stores: Vec<std::sync::Arc<dyn shardq_core::reshard::MapStore>> = (0..3)
        .map(|_| {
            std::sync::Arc::new(RedisMapStore::open(&server.url()).unwrap())
                as std::sync::Arc<dyn shardq_core::reshard::MapStore>
        })
        .collect();
    shardq_testkit::contract::settings_changes_are_never_lost(&stores);
}

/// A settings swap sent again after its reply was lost (the script ran,
/// the answer did not arrive) finds its own write and answers stored, so
/// the caller does not apply its change a second time; a swap whose
/// expected text is gone and whose new text is not there still fails.
#[test]
fn a_settings_swap_retried_after_a_lost_reply_answers_stored() {
    use shardq_core::reshard::MapStore;
    let server = RedisServer::start();
    let store = RedisMapStore::open(&server.url()).unwrap();
    assert!(store.swap_setting("waiting", None, Some("v1")).unwrap());
    // The same call again: the field holds v1, not "absent".
    assert!(store.swap_setting("waiting", None, Some("v1")).unwrap());
    assert!(store
        .swap_setting("waiting", Some("v1"), Some("v2"))
        .unwrap());
    assert!(store
        .swap_setting("waiting", Some("v1"), Some("v2"))
        .unwrap());
    assert!(!store
        .swap_setting("waiting", Some("v1"), Some("v3"))
        .unwrap());
    assert_eq!(
        store.load_setting("waiting").unwrap().as_deref(),
        Some("v2")
    );
    assert!(store.swap_setting("waiting", Some("v2"), None).unwrap());
    assert!(store.swap_setting("waiting", Some("v2"), None).unwrap());
    assert_eq!(store.load_setting("waiting").unwrap(), None);
}

#[test]
fn map_store_publishes_by_compare_and_set() {
    let server = RedisServer::start();
    let store = RedisMapStore::open(&server.url()).unwrap();
    assert!(store.load_map().unwrap().is_none());
    let mut map = map_of(&[("r0", server.url()), ("r1", server.url())]);
    store.publish_map(&map, 0).unwrap();
    assert_eq!(store.load_map().unwrap().as_ref(), Some(&map));
    map.version = 2;
    assert!(matches!(
        store.publish_map(&map, 0),
        Err(RedisError::VersionConflict { found: 1, .. })
    ));
    store.publish_map(&map, 1).unwrap();
    assert_eq!(store.load_map().unwrap().unwrap().version, 2);
    let stale = map.clone();
    assert!(store.publish_map(&stale, 2).is_err(), "version must grow");
}

#[test]
fn batches_and_shared_instances() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    // Two shards on one instance keep separate keys.
    let map = map_of(&[("r0", server.url()), ("r1", server.url())]);
    init(&map);
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let _c = owner(&b, "w", 10_000);
    let jobs: Vec<_> = (0..1000)
        .map(|i| job(&format!("k{}", i % 100), &format!("{i}")))
        .collect();
    b.enqueue("r0", 1, &jobs).unwrap();
    assert!(matches!(
        b.enqueue("r0", 1, &vec![job("k", "x"); 1025]),
        Err(QueueError::BatchTooLarge { .. })
    ));
    assert_eq!(b.shard_stats("r1").unwrap().ready, 0);
    let mut total = 0;
    loop {
        let got = b.claim("r0", 1024, LEASE).unwrap();
        if got.is_empty() {
            break;
        }
        assert!(got.len() <= 100);
        total += got.len();
        let ids: Vec<Receipt> = got.iter().map(|j| j.receipt()).collect();
        b.ack("r0", &ids).unwrap();
    }
    assert_eq!(total, 1000);
    let stats = b.shard_stats("r0").unwrap();
    assert_eq!((stats.ready, stats.in_flight, stats.keys), (0, 0, 0));
    let _ = Arc::new(b);
}

/// A run whose job lease lapses ends: the job runs again with attempt + 1
/// and a larger fence, and the lapsed run's receipt is refused by ack, fail
/// and extend; an extended run is not reclaimed.
#[test]
fn lapsed_job_lease_reruns_with_attempt_plus_one_and_refuses_the_old_receipt() {
    let server = RedisServer::start();
    let (b, clock) = setup(&server, DeadPolicy::Continue);
    let _c = owner(&b, "w1", 600_000);
    b.enqueue("r0", 1, &[job("k", "k1"), job("k", "k2"), job("x", "x1")])
        .unwrap();
    let first = b.claim("r0", 10, 1_000).unwrap();
    assert_eq!(payloads(&first), ["k1", "x1"]);
    let k1 = first.iter().find(|j| j.key == "k").unwrap().clone();
    let x1 = first.iter().find(|j| j.key == "x").unwrap().clone();
    assert_eq!(k1.lease_until_ms, T0 + 1_000);
    // x1 is a long job: its heartbeat keeps it; k1's lease lapses.
    clock.advance(900);
    assert!(b.extend("r0", &[x1.receipt()], 1_000).unwrap().is_empty());
    clock.advance(200);
    let again = b.claim("r0", 10, 1_000).unwrap();
    assert_eq!(
        payloads(&again),
        ["k1"],
        "k1 reruns, k2 waits, x1 is still running"
    );
    assert_eq!(again[0].attempt, 2);
    assert!(again[0].fence > k1.fence, "fences grow across attempts");
    assert_eq!(b.key_counts("r0", "k").unwrap().in_flight, 1);
    // Every use of the lapsed run's receipt is refused and changes nothing.
    let out = b.ack("r0", &[k1.receipt()]).unwrap();
    assert_eq!((out.acked, out.stale), (0, vec![k1.receipt()]));
    assert!(matches!(
        b.fail("r0", k1.receipt(), "late", None),
        Err(QueueError::StaleReceipt { id, .. }) if id == k1.id.0
    ));
    assert_eq!(
        b.extend("r0", &[k1.receipt()], 1_000).unwrap(),
        [k1.receipt()]
    );
    assert_eq!(b.key_counts("r0", "k").unwrap().in_flight, 1);
    // A made-up fence for the current job is stale too.
    let forged = Receipt {
        id: again[0].id,
        fence: again[0].fence + 1,
    };
    assert_eq!(b.ack("r0", &[forged]).unwrap().stale, [forged]);
    // The current runs finish normally; fail with an explicit retry delay.
    assert_eq!(
        b.fail("r0", again[0].receipt(), "retry soon", Some(5))
            .unwrap(),
        FailOutcome::Retry {
            at_ms: T0 + 1_100 + 5
        }
    );
    assert_eq!(b.ack("r0", &[x1.receipt()]).unwrap().acked, 1);
    clock.advance(5);
    let third = b.claim("r0", 10, 1_000).unwrap();
    assert_eq!(
        (payloads(&third), third[0].attempt),
        (vec!["k1".to_string()], 3)
    );
    assert!(third[0].fence > again[0].fence);
    let stats = b.shard_stats("r0").unwrap();
    assert_eq!(stats.fence_high, third[0].fence);
    // A fence floor raised by a rebalance is honoured.
    b.ack("r0", &[third[0].receipt()]).unwrap();
    let floor = stats.fence_high + 1_000_000_000_000;
    b.set_fence(
        "r0",
        &Fence {
            run_fence_min: floor,
            ..Fence::default()
        },
    )
    .unwrap();
    let k2 = b.claim("r0", 10, 1_000).unwrap();
    assert_eq!(payloads(&k2), ["k2"]);
    assert!(k2[0].fence >= floor);
    assert!(matches!(
        b.claim("r0", 10, 1),
        Err(QueueError::InvalidOption {
            name: "job lease",
            ..
        })
    ));
}

/// Worker A stops past its lease, B takes over and reruns job 1, B dies,
/// A resumes and regains the lease and runs attempt 3: A's late ack of
/// attempt 1 must be refused while attempt 3 runs.
#[test]
fn stale_result_after_regaining_a_lease_is_refused() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let a = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let mut ca = owner(&a, "host-a@1", 300);
    a.enqueue("r0", 1, &[job("k", "job1"), job("k", "job2")])
        .unwrap();
    let run1 = a.claim("r0", 10, 60_000).unwrap();
    assert_eq!(
        (payloads(&run1), run1[0].attempt),
        (vec!["job1".to_string()], 1)
    );
    // A stops (a long GC pause): its shard lease lapses, B takes over.
    clock.advance(301);
    let mut cb = owner(&b, "host-b@2", 300);
    assert_eq!(cb.tick().unwrap().owned, ["r0"]);
    let run2 = b.claim("r0", 10, 60_000).unwrap();
    assert_eq!(
        (payloads(&run2), run2[0].attempt),
        (vec!["job1".to_string()], 2)
    );
    // B dies; A resumes: its old lease is gone, it regains the shard.
    clock.advance(301);
    let own = ca.tick().unwrap();
    assert_eq!(own.lost, ["r0"], "A's renewal with its old token fails");
    assert_eq!(tick_adopt(&a, &mut ca), ["r0"]);
    let run3 = a.claim("r0", 10, 60_000).unwrap();
    assert_eq!(
        (payloads(&run3), run3[0].attempt),
        (vec!["job1".to_string()], 3)
    );
    assert!(run1[0].fence < run2[0].fence && run2[0].fence < run3[0].fence);
    // A's handler of attempt 1 finally returns: its ack is stale.
    let late = a.ack("r0", &[run1[0].receipt()]).unwrap();
    assert_eq!((late.acked, late.stale), (0, vec![run1[0].receipt()]));
    assert_eq!(
        a.key_counts("r0", "k").unwrap(),
        KeyCounts {
            depth: 1,
            in_flight: 1,
            dead: 0
        },
        "attempt 3 still runs and job2 still waits"
    );
    assert!(
        b.ack("r0", &[run2[0].receipt()]).is_err(),
        "B lost the shard"
    );
    assert_eq!(a.ack("r0", &[run3[0].receipt()]).unwrap().acked, 1);
    assert_eq!(payloads(&a.claim("r0", 10, 60_000).unwrap()), ["job2"]);
}

/// The retry backoff's kind and jitter on Redis are core's arithmetic,
/// to the millisecond: the fail script takes the share core computes for
/// the run, and a fixed backoff does not grow.
#[test]
fn retry_backoff_kind_and_jitter_match_core_exactly() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let mut opts = opts_manual(&clock);
    for backoff in [
        shardq_core::Backoff {
            base_ms: 10_000,
            max_ms: 3_600_000,
            kind: shardq_core::BackoffKind::Fixed,
            jitter_pct: 30,
        },
        shardq_core::Backoff {
            base_ms: 1_000,
            max_ms: 3_600_000,
            kind: shardq_core::BackoffKind::Exponential,
            jitter_pct: 50,
        },
    ] {
        opts.backoff = backoff;
        let b = RedisBackend::open(&map, opts.clone()).expect("open");
        let _c = owner(&b, "w1", 600_000);
        let jobs: Vec<_> = (0..20).map(|i| job(&format!("j-{i}"), "p")).collect();
        b.enqueue("r0", 1, &jobs).unwrap();
        let mut delays = Vec::new();
        for attempt in 1..=2u32 {
            clock.advance(4_000_000);
            let runs = b.claim("r0", 100, LEASE).unwrap();
            assert_eq!(runs.len(), 20);
            for r in runs {
                assert_eq!(r.attempt, attempt);
                let now = shardq_core::Clock::now_ms(&clock);
                let FailOutcome::Retry { at_ms } = b.fail("r0", r.receipt(), "no", None).unwrap()
                else {
                    panic!("retried");
                };
                let want = backoff.delay_for(attempt, shardq_core::job::run_seed(r.receipt()));
                assert_eq!(at_ms - now, want, "{backoff:?} attempt {attempt}");
                delays.push(want);
            }
        }
        // The jitter spreads the runs; none waits longer than the nominal.
        let distinct: std::collections::BTreeSet<_> = delays.iter().collect();
        assert!(distinct.len() > 10, "{delays:?}");
        for (i, d) in delays.iter().enumerate() {
            let nominal = backoff.delay_ms(if i < 20 { 1 } else { 2 });
            assert!(*d <= nominal && *d >= nominal - nominal * u64::from(backoff.jitter_pct) / 100);
        }
        // Clear the shard for the next backoff: every job acked.
        clock.advance(4_000_000);
        let runs = b.claim("r0", 100, LEASE).unwrap();
        let receipts: Vec<_> = runs.iter().map(|r| r.receipt()).collect();
        b.ack("r0", &receipts).unwrap();
    }
}
