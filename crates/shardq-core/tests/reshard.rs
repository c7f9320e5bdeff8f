//! Resharding under continuous load on the in-memory backend: producers keep
//! enqueueing numbered jobs per key, a worker pool keeps running them, and a
//! shard is added, removed or reweighted meanwhile. Every key's jobs must run
//! exactly in enqueue order, none may be lost, and only the keys that must
//! move may move.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use shardq_core::memory::{MemoryBackend, MemoryCoordinator, MemoryMapStore};
use shardq_core::producer::{ProduceError, Producer, ProducerOptions};
use shardq_core::reshard::{self, MapStore, RebalanceOptions, ReshardError};
use shardq_core::{
    ClaimedJob, Clock, Fence, InspectJobs, MoveKeys, NewJob, PoolOptions, QueueError, RunJobs,
    SystemClock, WorkerPool,
};
use shardq_route::{Algorithm, Router, ShardMap};
use shardq_testkit::maps::HookedMaps;
use shardq_testkit::{wait_until, WAIT_MAX};

const KEYS: usize = 10_000;
const LEASE_MS: u64 = shardq_core::JOB_LEASE_MS_DEFAULT;

fn keys() -> Vec<String> {
    (0..KEYS).map(|i| format!("t-{i}")).collect()
}

struct Outcome {
    moved_fraction: f64,
    moved_to: BTreeMap<String, usize>,
    from_counts: BTreeMap<String, usize>,
    report: reshard::RebalanceReport,
}

/// Runs load, applies `change` then rebalances, and checks order and loss.
/// Long on purpose: one scenario, the producers and the pool started,
/// `change` and the rebalance under their load, then the drain and the
/// order and loss checks, in the order they happen.
fn under_load(
    shards: &[&str],
    algorithm: Algorithm,
    change: impl FnOnce(&MemoryMapStore, &MemoryBackend),
) -> Outcome {
    let clock = Arc::new(SystemClock);
    let backend = MemoryBackend::new(shards, clock.clone());
    let store =
        MemoryMapStore::new(ShardMap::with_shards(algorithm, shards.iter().copied()).unwrap());
    let before = Router::new(store.load().unwrap()).unwrap();

    let ran: Arc<Mutex<BTreeMap<String, Vec<u64>>>> = Arc::default();
    let stop_pool = Arc::new(AtomicBool::new(false));
    let pool = {
        let backend = backend.clone();
        let ran = ran.clone();
        let stop = stop_pool.clone();
        let clock = clock.clone();
        thread::spawn(move || {
            let handler = move |job: &ClaimedJob| {
                let seq: u64 = std::str::from_utf8(&job.payload).unwrap().parse().unwrap();
                ran.lock()
                    .unwrap()
                    .entry(job.key.clone())
                    .or_default()
                    .push(seq);
                Ok(())
            };
            let mut coordinator = MemoryCoordinator::new(backend.clone());
            let opts = PoolOptions {
                concurrency: 4,
                ..PoolOptions::default()
            };
            WorkerPool::run(
                Arc::new(backend),
                &mut coordinator,
                Arc::new(handler),
                clock,
                opts,
                &stop,
            )
            .unwrap()
        })
    };

    // Two producers, each cycling over half of the keys, numbering each key's jobs.
    let stop_producers = Arc::new(AtomicBool::new(false));
    let produced = Arc::new(AtomicU64::new(0));
    let mut producers = Vec::new();
    for half in 0..2usize {
        let backend = backend.clone();
        let store = store.clone();
        let stop = stop_producers.clone();
        let produced = produced.clone();
        producers.push(thread::spawn(move || {
            let mine: Vec<String> = keys().into_iter().skip(half).step_by(2).collect();
            let mut next: BTreeMap<String, u64> = BTreeMap::new();
            let mut producer = Producer::new(
                Arc::new(backend.clone()),
                Arc::new(store.clone()),
                ProducerOptions::default(),
            )
            .unwrap();
            'outer: loop {
                for key in mine.iter().take(500) {
                    if stop.load(Ordering::SeqCst) {
                        break 'outer;
                    }
                    let seq = next.entry(key.clone()).or_insert(0);
                    producer
                        .enqueue(&NewJob::new(key.clone(), seq.to_string()))
                        .unwrap();
                    *seq += 1;
                    produced.fetch_add(1, Ordering::SeqCst);
                }
            }
            next
        }));
    }

    // Under load: the producers write on before, through and after the rebalance.
    let produce_more = |n: u64| {
        let from = produced.load(Ordering::SeqCst);
        wait_until(
            &format!("the producers to enqueue {n} more jobs"),
            WAIT_MAX,
            || {
                produced.load(Ordering::SeqCst) >= from + n
                    || producers.iter().any(|p| p.is_finished())
            },
        );
    };
    produce_more(500);
    change(&store, &backend);
    let report = reshard::rebalance(
        &backend,
        &store,
        &RebalanceOptions {
            batch: 16,
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    produce_more(500);
    stop_producers.store(true, Ordering::SeqCst);
    let mut enqueued: BTreeMap<String, u64> = BTreeMap::new();
    for p in producers {
        enqueued.extend(p.join().unwrap());
    }
    // Let the pool finish every job, then stop it.
    let total: u64 = enqueued.values().sum();
    for _ in 0..2000 {
        let done: usize = ran.lock().unwrap().values().map(Vec::len).sum();
        if done as u64 >= total {
            break;
        }
        thread::sleep(Duration::from_millis(5));
    }
    stop_pool.store(true, Ordering::SeqCst);
    pool.join().unwrap();

    let ran = ran.lock().unwrap();
    let mut violations = 0;
    let mut lost = 0;
    for (key, n) in &enqueued {
        let got = ran.get(key).cloned().unwrap_or_default();
        violations += got.windows(2).filter(|w| w[1] != w[0] + 1).count();
        lost += (*n as usize).saturating_sub(got.len());
        assert_eq!(
            got,
            (0..*n).collect::<Vec<_>>(),
            "key {key}: jobs ran out of order or were lost"
        );
    }
    assert_eq!((violations, lost), (0, 0));
    assert!(total > 1000, "the load must be real: only {total} jobs");

    let after = Router::new(store.load().unwrap()).unwrap();
    assert!(
        store.load_target().unwrap().is_none(),
        "the target must be cleared"
    );
    let mut moved_to = BTreeMap::new();
    let mut from_counts = BTreeMap::new();
    let mut moved = 0;
    for k in keys() {
        let (a, b) = (before.route(&k), after.route(&k));
        if a != b {
            moved += 1;
            *moved_to.entry(b.to_string()).or_insert(0) += 1;
            *from_counts.entry(a.to_string()).or_insert(0) += 1;
        }
    }
    // No key is left paused and every shard trusts the final map.
    for shard in backend.shard_names() {
        let fence: Fence = backend.fence(&shard).unwrap();
        assert!(
            fence.paused_keys.is_empty(),
            "{shard}: {:?}",
            fence.paused_keys
        );
    }
    Outcome {
        moved_fraction: moved as f64 / KEYS as f64,
        moved_to,
        from_counts,
        report,
    }
}

#[test]
fn adding_a_fifth_shard_under_load_moves_a_fifth_to_it_in_order() {
    let out = under_load(
        &["s0", "s1", "s2", "s3"],
        Algorithm::Rendezvous,
        |store, backend| {
            backend.add_shard("s4");
            reshard::add_shard(store, "s4", 1, None).unwrap();
        },
    );
    assert!(
        (out.moved_fraction - 0.2).abs() < 0.01,
        "moved {}",
        out.moved_fraction
    );
    assert_eq!(out.moved_to.keys().collect::<Vec<_>>(), ["s4"]);
    assert!(
        !out.report.moved.is_empty(),
        "keys with work must have been drained and switched"
    );
}

#[test]
fn removing_a_shard_under_load_moves_only_its_keys() {
    let out = under_load(
        &["s0", "s1", "s2", "s3", "s4"],
        Algorithm::Rendezvous,
        |store, _| {
            reshard::remove_shard(store, "s2").unwrap();
        },
    );
    assert_eq!(out.from_counts.keys().collect::<Vec<_>>(), ["s2"]);
    assert!(
        (out.moved_fraction - 0.2).abs() < 0.01,
        "moved {}",
        out.moved_fraction
    );
    assert!(!out.moved_to.contains_key("s2"));
}

#[test]
fn raising_a_weight_under_load_moves_keys_only_to_that_shard() {
    let out = under_load(&["s0", "s1", "s2", "s3"], Algorithm::Ring, |store, _| {
        reshard::set_weight(store, "s1", 2).unwrap();
    });
    assert_eq!(out.moved_to.keys().collect::<Vec<_>>(), ["s1"]);
    // s1 goes from 1/4 to 2/5 of the keys: 15% of all keys move to it.
    assert!(
        (out.moved_fraction - 0.15).abs() < 0.03,
        "moved {}",
        out.moved_fraction
    );
}

#[test]
fn pinning_a_hot_key_moves_it_after_its_backlog() {
    let out = under_load(
        &["s0", "s1", "s2", "s3"],
        Algorithm::Rendezvous,
        |store, _| {
            let map = store.load().unwrap();
            let r = Router::new(map).unwrap();
            let target = if r.route("t-0") == "s3" { "s2" } else { "s3" };
            reshard::pin(store, "t-0", target).unwrap();
        },
    );
    assert_eq!(out.moved_fraction, 1.0 / KEYS as f64);
}

#[test]
fn a_stale_producer_is_fenced_and_its_job_lands_on_the_right_shard() {
    let clock = Arc::new(SystemClock);
    let backend = MemoryBackend::new(&["s0", "s1", "s2", "s3"], clock);
    let store = MemoryMapStore::new(
        ShardMap::with_shards(Algorithm::Rendezvous, ["s0", "s1", "s2", "s3"]).unwrap(),
    );
    // A producer that loaded version 1 and never refreshes on its own.
    let opts = ProducerOptions {
        refresh_ms: u64::MAX,
        ..ProducerOptions::default()
    };
    let mut stale =
        Producer::new(Arc::new(backend.clone()), Arc::new(store.clone()), opts).unwrap();
    assert_eq!(stale.map_version(), 1);
    backend.add_shard("s4");
    reshard::add_shard(&store, "s4", 1, None).unwrap();
    reshard::rebalance(&backend, &store, &RebalanceOptions::default(), &mut |_| {}).unwrap();
    let fresh = Router::new(store.load().unwrap()).unwrap();
    // A key whose owner changed: the stale router still points at the old shard.
    let key = (0..)
        .map(|i| format!("t-{i}"))
        .find(|k| fresh.route(k) == "s4")
        .unwrap();
    let placed = stale.enqueue(&NewJob::new(key.clone(), "x")).unwrap();
    assert_eq!(placed.shard, "s4");
    assert!(placed.map_version > 1, "the producer must have reloaded");
    // And the backend itself refuses the stale version outright.
    let old_shard = ShardMap::with_shards(Algorithm::Rendezvous, ["s0", "s1", "s2", "s3"])
        .map(|m| Router::new(m).unwrap().route(&key).to_string())
        .unwrap();
    let err = backend
        .enqueue(&old_shard, 1, &[NewJob::new(key, "y")])
        .unwrap_err();
    assert!(matches!(err, QueueError::Fenced { .. }), "{err}");
}

#[test]
fn a_key_paused_too_long_is_a_clear_error_not_a_drop() {
    let backend = MemoryBackend::new(&["s0"], Arc::new(SystemClock));
    let store = MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["s0"]).unwrap());
    let mut fence = backend.fence("s0").unwrap();
    fence.paused_keys.insert("t-1".into());
    backend.set_fence("s0", &fence).unwrap();
    let opts = ProducerOptions {
        pause_wait_ms: 50,
        ..ProducerOptions::default()
    };
    let mut p = Producer::new(Arc::new(backend.clone()), Arc::new(store.clone()), opts).unwrap();
    let err = p.enqueue(&NewJob::new("t-1", "x")).unwrap_err();
    assert!(matches!(err, ProduceError::PausedTooLong { .. }), "{err}");
    assert!(
        err.to_string().contains("t-1") && err.to_string().contains("NOT enqueued"),
        "{err}"
    );
    assert_eq!(backend.key_counts("s0", "t-1").unwrap().depth, 0);
    // Other keys flow.
    p.enqueue(&NewJob::new("t-2", "x")).unwrap();
}

/// Two shards that send a key to each other (a store put back to a state
/// no move leaves): the producer follows a few redirects, then waits as for
/// a pause and gives up with the same clear error, never looping for good.
#[test]
fn a_redirect_loop_is_a_clear_error_not_an_endless_loop() {
    let (backend, store) = two_shard_store_moving_backlogs();
    for (shard, to) in [("s0", "s1"), ("s1", "s0")] {
        let mut fence = backend.fence(shard).unwrap();
        fence.sealed_keys.insert("t-1".into(), to.into());
        fence.paused_keys.insert("t-1".into());
        backend.set_fence(shard, &fence).unwrap();
    }
    let opts = ProducerOptions {
        pause_wait_ms: 50,
        ..ProducerOptions::default()
    };
    let mut p = Producer::new(Arc::new(backend.clone()), Arc::new(store.clone()), opts).unwrap();
    let err = p.enqueue(&NewJob::new("t-1", "x")).unwrap_err();
    assert!(matches!(err, ProduceError::PausedTooLong { .. }), "{err}");
    assert!(err.to_string().contains("t-1"), "{err}");
    for shard in ["s0", "s1"] {
        assert_eq!(backend.key_counts(shard, "t-1").unwrap().depth, 0);
    }
    p.enqueue(&NewJob::new("t-2", "x")).unwrap();
}

/// A rebalance that died after fencing every shard at the next version and
/// before publishing it leaves every producer refused: a producer that
/// finds no newer map for a while, and no rebalance running, publishes the
/// map again at the fenced version (routing unchanged) and goes in. While
/// a rebalance holds the lock, nothing is published (it will publish), and
/// a stalled rebalance's own publish then fails.
#[test]
fn a_fence_whose_rebalance_died_before_publishing_is_lifted() {
    let (backend, store) = two_shard_store_moving_backlogs();
    let v = store.load().unwrap().version;
    for shard in ["s0", "s1"] {
        let mut fence = backend.fence(shard).unwrap();
        fence.map_version_min = v + 1;
        backend.set_fence(shard, &fence).unwrap();
    }
    // A rebalance still holds the lock: no lift, the producer waits and
    // is refused in the end.
    let lock = store.try_lock_rebalance().unwrap();
    assert!(!reshard::lift_orphaned_fence(&backend, &store).unwrap());
    let clock = Arc::new(shardq_core::ManualClock::new(1_700_000_000_000));
    let opts = || ProducerOptions {
        fence_wait_ms: 10_000,
        clock: clock.clone(),
        ..ProducerOptions::default()
    };
    let mut p = Producer::new(Arc::new(backend.clone()), Arc::new(store.clone()), opts()).unwrap();
    let err = p.enqueue(&NewJob::new("t-1", "held")).unwrap_err();
    assert!(matches!(err, ProduceError::FencedTooLong { .. }), "{err}");
    assert_eq!(
        store.load().unwrap().version,
        v,
        "published while a rebalance ran"
    );
    // The rebalance is gone: the next producer goes in, routed as before.
    let router = Router::new(store.load().unwrap()).unwrap();
    drop(lock);
    let mut p = Producer::new(Arc::new(backend.clone()), Arc::new(store.clone()), opts()).unwrap();
    let placed = p.enqueue(&NewJob::new("t-1", "in")).unwrap();
    assert_eq!(placed.shard, router.route("t-1"));
    let now = store.load().unwrap();
    assert_eq!(now.version, v + 1);
    assert_eq!(now.shards, router.map().shards, "the routing is unchanged");
    // A rebalance that planned on version v can no longer publish.
    let stale = store.publish(
        &ShardMap {
            version: v + 1,
            ..now.clone()
        },
        v,
    );
    assert!(
        stale.is_err(),
        "a stalled rebalance published over the lift"
    );
}

#[test]
fn only_one_rebalance_at_a_time() {
    let store = MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["s0"]).unwrap());
    let _held = store.try_lock_rebalance().unwrap();
    let backend = MemoryBackend::new(&["s0"], Arc::new(SystemClock));
    let err = reshard::rebalance(&backend, &store, &RebalanceOptions::default(), &mut |_| {})
        .unwrap_err();
    assert!(matches!(err, ReshardError::Busy { .. }), "{err}");
}

#[test]
fn paused_keys_in_a_batch_are_all_named_and_the_other_keys_go_in() {
    let backend = MemoryBackend::new(&["s0"], Arc::new(SystemClock));
    let store = MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["s0"]).unwrap());
    let mut fence = backend.fence("s0").unwrap();
    fence.paused_keys.insert("k2".into());
    fence.paused_keys.insert("k3".into());
    backend.set_fence("s0", &fence).unwrap();
    // A zero bound: the first refusal already counts as too long, and still
    // the unpaused keys sharing the group must land.
    let opts = ProducerOptions {
        pause_wait_ms: 0,
        ..ProducerOptions::default()
    };
    let mut p = Producer::new(Arc::new(backend.clone()), Arc::new(store.clone()), opts).unwrap();
    let jobs: Vec<NewJob> = ["k1", "k2", "k3", "k4"]
        .iter()
        .map(|k| NewJob::new(*k, "x"))
        .collect();
    match p.enqueue_batch(&jobs).unwrap_err() {
        ProduceError::PausedTooLong { keys, placed, .. } => {
            assert_eq!(keys, ["k2", "k3"]);
            assert_eq!(placed.iter().map(|p| p.index).collect::<Vec<_>>(), [0, 3]);
        }
        other => panic!("unexpected {other}"),
    }
    for (key, depth) in [("k1", 1), ("k2", 0), ("k3", 0), ("k4", 1)] {
        assert_eq!(backend.key_counts("s0", key).unwrap().depth, depth, "{key}");
    }
}

/// Two shards whose rebalances move backlogs with their keys.
fn two_shard_store_moving_backlogs() -> (MemoryBackend, MemoryMapStore) {
    let backend = MemoryBackend::new(&["s0", "s1"], Arc::new(SystemClock));
    let store =
        MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["s0", "s1"]).unwrap());
    (backend, store)
}

/// A key on `shard` of the published map.
fn key_on(store: &MemoryMapStore, shard: &str) -> String {
    let router = Router::new(store.load().unwrap()).unwrap();
    (0..)
        .map(|i| format!("t-{i}"))
        .find(|k| router.route(k) == shard)
        .unwrap()
}

/// Regression: `pin KEY SHARD` where KEY already routed to SHARD was dropped
/// by the finish step, so `unpin` said it was not pinned and a later
/// rebalance moved the key.
#[test]
fn a_pin_to_the_computed_owner_survives_the_rebalance() {
    let (backend, store) = two_shard_store_moving_backlogs();
    let key = key_on(&store, "s0");
    reshard::pin(&store, &key, "s0").unwrap();
    reshard::rebalance(&backend, &store, &RebalanceOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(
        store
            .load()
            .unwrap()
            .overrides
            .get(&key)
            .map(String::as_str),
        Some("s0")
    );
    // Weighting s1 up would move some keys; the pinned one stays.
    reshard::set_weight(&store, "s1", 50).unwrap();
    reshard::rebalance(&backend, &store, &RebalanceOptions::default(), &mut |_| {}).unwrap();
    let router = Router::new(store.load().unwrap()).unwrap();
    assert_eq!(router.route(&key), "s0");
    assert!(reshard::unpin(&store, &key).unwrap(), "it was pinned");
    assert!(
        !reshard::unpin(&store, &key).unwrap(),
        "unpinned already: nothing to do"
    );
}

/// Enqueues `payloads` for `key` through its current route.
fn enqueue_all(backend: &MemoryBackend, store: &MemoryMapStore, key: &str, payloads: &[String]) {
    let router = Router::new(store.load().unwrap()).unwrap();
    let jobs: Vec<NewJob> = payloads
        .iter()
        .map(|p| NewJob::new(key, p.as_str()))
        .collect();
    for chunk in jobs.chunks(1000) {
        backend
            .enqueue(router.route(key), router.version(), chunk)
            .unwrap();
    }
}

/// Runs `shard`'s ready jobs one at a time, acking each; their payloads.
fn run_serially(backend: &MemoryBackend, shard: &str) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let jobs = backend.claim(shard, 1, LEASE_MS).unwrap();
        let Some(j) = jobs.first() else {
            return out;
        };
        out.push(String::from_utf8(j.payload.clone()).unwrap());
        backend.ack(shard, &[j.receipt()]).unwrap();
    }
}

/// A hot key's deep backlog (no worker running anywhere) moves with it:
/// the rebalance does not wait for the backlog, and the new shard runs the
/// jobs in enqueue order, attempts and all, once each.
#[test]
fn a_hot_key_takes_its_backlog_along() {
    let (backend, store) = two_shard_store_moving_backlogs();
    let key = key_on(&store, "s1");
    let payloads: Vec<String> = (0..10_000).map(|i| i.to_string()).collect();
    enqueue_all(&backend, &store, &key, &payloads);
    reshard::remove_shard(&store, "s1").unwrap();
    let quick = RebalanceOptions {
        // Drain-then-switch would fail here: nothing runs the backlog.
        drain_timeout_ms: 100,
        ..RebalanceOptions::default()
    };
    let report = reshard::rebalance(&backend, &store, &quick, &mut |_| {}).unwrap();
    assert_eq!(report.jobs_moved, 10_000);
    assert_eq!(report.moved.len(), 1);
    assert_eq!(report.moved[0].jobs_moved, 10_000);
    let c = backend.key_counts("s1", &key).unwrap();
    assert_eq!(
        (c.depth, c.in_flight, c.dead),
        (0, 0, 0),
        "copies left behind"
    );
    assert!(backend.fence("s1").unwrap().sealed_keys.is_empty());
    assert_eq!(run_serially(&backend, "s0"), payloads);
}

/// A key whose only job is delayed by an hour moves at once, and the job
/// keeps its start time.
#[test]
fn a_key_with_only_a_delayed_job_moves_at_once() {
    let (backend, store) = two_shard_store_moving_backlogs();
    let key = key_on(&store, "s1");
    let mut job = NewJob::new(key.as_str(), "later");
    job.delay_ms = 3_600_000;
    backend.enqueue("s1", 1, &[job]).unwrap();
    reshard::remove_shard(&store, "s1").unwrap();
    let quick = RebalanceOptions {
        drain_timeout_ms: 100,
        ..RebalanceOptions::default()
    };
    reshard::rebalance(&backend, &store, &quick, &mut |_| {}).unwrap();
    assert!(
        backend.claim("s0", 10, LEASE_MS).unwrap().is_empty(),
        "ran early"
    );
    let due = backend.next_due_ms("s0").unwrap().unwrap();
    let now = SystemClock.now_ms();
    assert!(
        due > now + 3_500_000,
        "the delay was lost: due {due}, now {now}"
    );
}

/// Dead letters go with their key: the rebalance finishes, and the dead
/// job, reason kept, can be retried on the new shard and runs there.
#[test]
fn dead_letters_move_with_their_key() {
    let (backend, store) = two_shard_store_moving_backlogs();
    let key = key_on(&store, "s1");
    let mut job = NewJob::new(key.as_str(), "doomed");
    job.max_attempts = 1;
    backend.enqueue("s1", 1, &[job]).unwrap();
    let run = backend.claim("s1", 1, LEASE_MS).unwrap().remove(0);
    backend.fail("s1", run.receipt(), "exit 3", None).unwrap();
    enqueue_all(&backend, &store, &key, &["after".to_string()]);
    reshard::remove_shard(&store, "s1").unwrap();
    reshard::rebalance(&backend, &store, &RebalanceOptions::default(), &mut |_| {}).unwrap();
    let dead = backend.dead_list("s0", 10).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].key.as_str(), dead[0].reason.as_str()),
        (key.as_str(), "exit 3")
    );
    assert_eq!(run_serially(&backend, "s0"), ["after"]);
    assert_eq!(backend.dead_retry("s0", None).unwrap(), 1);
    assert_eq!(run_serially(&backend, "s0"), ["doomed"]);
}

/// A run in flight on the old shard holds its key's move until it ends;
/// meanwhile no other run of the key starts anywhere, and its producer is
/// not refused. Once it is acked the backlog moves, and the next run, on
/// the new shard, has a larger fence.
#[test]
fn a_run_in_flight_holds_the_move_until_it_ends_and_fences_keep_growing() {
    let (backend, store) = two_shard_store_moving_backlogs();
    let key = key_on(&store, "s1");
    enqueue_all(&backend, &store, &key, &["a".into(), "b".into()]);
    let a = backend.claim("s1", 1, LEASE_MS).unwrap().remove(0);
    reshard::remove_shard(&store, "s1").unwrap();
    let rebalance = {
        let (backend, store) = (backend.clone(), store.clone());
        thread::spawn(move || {
            reshard::rebalance(&backend, &store, &RebalanceOptions::default(), &mut |_| {})
        })
    };
    // Sealed on s1: b does not start there while a runs.
    let sealed = |b: &MemoryBackend| b.fence("s1").unwrap().sealed_keys.contains_key(&key);
    let t0 = std::time::Instant::now();
    while !sealed(&backend) {
        assert!(t0.elapsed() < Duration::from_secs(10), "never sealed");
        thread::sleep(Duration::from_millis(1));
    }
    let mut p = Producer::new(
        Arc::new(backend.clone()),
        Arc::new(store.clone()),
        ProducerOptions::default(),
    )
    .unwrap();
    p.enqueue(&NewJob::new(key.as_str(), "c")).unwrap();
    assert!(backend.claim("s1", 10, LEASE_MS).unwrap().is_empty());
    assert!(backend.claim("s0", 10, LEASE_MS).unwrap().is_empty());
    backend.ack("s1", &[a.receipt()]).unwrap();
    let report = rebalance.join().unwrap().unwrap();
    assert_eq!(report.jobs_moved, 2, "b and c moved");
    let b = backend.claim("s0", 1, LEASE_MS).unwrap().remove(0);
    assert_eq!(b.payload, b"b");
    assert!(b.fence > a.fence, "fence {} after {}", b.fence, a.fence);
    backend.ack("s0", &[b.receipt()]).unwrap();
    assert_eq!(run_serially(&backend, "s0"), ["c"]);
}

/// A run whose job lease lapses on the old shard is moved as a retry; its
/// late result on the old shard is refused.
#[test]
fn a_lapsed_run_moves_as_a_retry_and_its_late_ack_is_refused() {
    let (backend, store) = two_shard_store_moving_backlogs();
    let key = key_on(&store, "s1");
    enqueue_all(&backend, &store, &key, &["a".into()]);
    let a = backend
        .claim("s1", 1, shardq_core::JOB_LEASE_MS_MIN)
        .unwrap()
        .remove(0);
    reshard::remove_shard(&store, "s1").unwrap();
    let rebalance = {
        let (backend, store) = (backend.clone(), store.clone());
        thread::spawn(move || {
            reshard::rebalance(&backend, &store, &RebalanceOptions::default(), &mut |_| {})
        })
    };
    // The old shard's owner keeps claiming: that ends the lapsed run.
    while !rebalance.is_finished() {
        let _ = backend.claim("s1", 10, LEASE_MS).unwrap();
        thread::sleep(Duration::from_millis(5));
    }
    rebalance.join().unwrap().unwrap();
    let out = backend.ack("s1", &[a.receipt()]).unwrap();
    assert_eq!(out.acked, 0, "a late ack on the old shard was accepted");
    let again = backend.claim("s0", 1, LEASE_MS).unwrap().remove(0);
    assert_eq!((again.payload.as_slice(), again.attempt), (&b"a"[..], 2));
    assert!(again.fence > a.fence);
}

/// A map store that refuses every publish after the first `ok`, as one that
/// stops answering mid-rebalance would, and, with `settings_fail`, every
/// write of a setting.
fn publish_fails(
    inner: MemoryMapStore,
    ok: u32,
    settings_fail: bool,
) -> HookedMaps<MemoryMapStore> {
    let ok = std::sync::atomic::AtomicU32::new(ok);
    HookedMaps::new(inner)
        .on_publish(move |inner, map, expected| {
            if ok.fetch_sub(1, Ordering::SeqCst) == 0 {
                ok.store(0, Ordering::SeqCst);
                return Err(ReshardError::Unavailable(
                    "the map store stopped answering".into(),
                ));
            }
            inner.publish(map, expected)
        })
        .on_swap_setting(move |inner, name, expected, value| {
            if settings_fail {
                return Err(ReshardError::Unavailable("settings are read-only".into()));
            }
            inner.swap_setting(name, expected, value)
        })
}

/// A move whose switch cannot be published (the map store fails, not a
/// shard) stops the run with that error, and leaves no key paused: a key
/// it froze on its old shard (its backlog copied) sends its producers to
/// its new shard, so none waits, and none of their jobs is lost or run out
/// of order. The rerun finishes.
#[test]
fn a_failed_switch_leaves_no_producer_paused_and_the_rerun_finishes() {
    let clock = Arc::new(shardq_core::ManualClock::new(1_700_000_000_000));
    let backend = MemoryBackend::new(&["a", "b"], clock.clone());
    let inner =
        MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["a", "b"]).unwrap());
    let keys: Vec<String> = (0..50).map(|i| format!("t-{i}")).collect();
    let router = Router::new(inner.load().unwrap()).unwrap();
    for k in &keys {
        backend
            .enqueue(router.route(k), 1, &[NewJob::new(k.as_str(), "x")])
            .unwrap();
    }
    reshard::add_shard(&inner, "c", 1, None).unwrap();
    backend.add_shard("c");
    // The intermediate map publishes; the first switch does not.
    let store = publish_fails(inner.clone(), 1, false);
    let opts = RebalanceOptions {
        batch: 4,
        drain_timeout_ms: 1_000,
        poll_ms: 1,
        clock: clock.clone(),
        ..RebalanceOptions::default()
    };
    let err = reshard::rebalance(&backend, &store, &opts, &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("stopped answering"), "{err}");
    let mut frozen = 0;
    for s in ["a", "b", "c"] {
        let fence = backend.fence(s).unwrap();
        for k in &fence.paused_keys {
            assert!(
                fence.is_frozen(k),
                "{s} pauses {k:?} without having moved it"
            );
            frozen += 1;
        }
    }
    assert!(
        frozen > 0,
        "the failed switch froze no key (the test lost its point)"
    );
    // A producer that may not wait at all still gets every key's job in.
    let mut producer = Producer::new(
        Arc::new(backend.clone()),
        Arc::new(inner.clone()),
        ProducerOptions {
            pause_wait_ms: 0,
            clock: clock.clone(),
            ..ProducerOptions::default()
        },
    )
    .unwrap();
    let jobs: Vec<NewJob> = keys.iter().map(|k| NewJob::new(k.as_str(), "y")).collect();
    let placed = producer.enqueue_batch(&jobs).unwrap();
    assert_eq!(placed.len(), keys.len());
    assert!(producer.take_refusals().moved.values().sum::<u64>() > 0);
    let report = reshard::rebalance(&backend, &inner, &opts, &mut |_| {}).unwrap();
    assert!(report.jobs_moved > 0, "the rerun moved nothing");
    let total: u64 = ["a", "b", "c"]
        .iter()
        .map(|s| backend.shard_stats(s).unwrap().ready)
        .sum();
    assert_eq!(total, 100, "jobs lost or stored twice");
    // Each key's two jobs sit on one shard, the first one first.
    let router = Router::new(inner.load().unwrap()).unwrap();
    for k in &keys {
        let on = router.route(k);
        let payloads: Vec<Vec<u8>> = backend
            .export_jobs(on, k, None, 10)
            .unwrap()
            .into_iter()
            .map(|j| j.payload)
            .collect();
        assert_eq!(payloads, [b"x".to_vec(), b"y".to_vec()], "{k} on {on}");
    }
}

/// Two shards with work on both, and a third added to the target.
fn growing_store() -> (MemoryBackend, MemoryMapStore) {
    let backend = MemoryBackend::new(&["s0", "s1", "s2"], Arc::new(SystemClock));
    let store =
        MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["s0", "s1"]).unwrap());
    let router = Router::new(store.load().unwrap()).unwrap();
    for i in 0..200 {
        let key = format!("t-{i}");
        let shard = router.route(&key).to_string();
        backend
            .enqueue(&shard, 1, &[NewJob::new(&key, b"x".to_vec())])
            .unwrap();
    }
    reshard::add_shard(&store, "s2", 1, None).unwrap();
    (backend, store)
}

#[test]
fn every_rebalance_leaves_its_progress_in_the_map_store() {
    let (backend, store) = growing_store();
    assert_eq!(reshard::stored_progress(&store).unwrap(), None);
    let opts = RebalanceOptions {
        runner: "test runner".into(),
        ..RebalanceOptions::default()
    };
    let mut seen = Vec::new();
    let report = reshard::rebalance(&backend, &store, &opts, &mut |_| {
        // Written while it runs, not only at the end.
        seen.push(reshard::stored_progress(&store).unwrap().unwrap().phase);
    })
    .unwrap();
    assert!(!report.moved.is_empty());
    assert!(
        seen.iter().all(|p| p == "pinning" || p == "moving"),
        "{seen:?}"
    );
    let p = reshard::stored_progress(&store).unwrap().unwrap();
    assert_eq!(p.phase, "finished");
    assert_eq!(p.keys_moved, report.moved.len());
    assert_eq!(p.keys_to_move, report.moved.len());
    assert_eq!(p.jobs_moved, report.jobs_moved);
    assert_eq!(p.from_version, Some(report.from_version));
    assert_eq!(p.to_version, Some(report.to_version));
    assert_eq!(p.runner, "test runner");
    assert!(p.started_ms.unwrap() <= p.finished_ms.unwrap());
    assert!(!p.is_running());

    // A run whose record another run replaced (it stalled past its lock,
    // and the next one started) writes no more over it.
    let (backend, store) = growing_store();
    let newer = reshard::RebalanceProgress::started(u64::MAX / 2, "the next run");
    let mut replaced = false;
    reshard::rebalance(&backend, &store, &opts, &mut |_| {
        if !replaced {
            store
                .store_setting(
                    reshard::SETTING_REBALANCE,
                    Some(&serde_json::to_string(&newer).unwrap()),
                )
                .unwrap();
            replaced = true;
        }
    })
    .unwrap();
    assert_eq!(reshard::stored_progress(&store).unwrap().unwrap(), newer);
    let (backend, store) = growing_store();
    reshard::rebalance(&backend, &store, &opts, &mut |_| {}).unwrap();
    let p = reshard::stored_progress(&store).unwrap().unwrap();

    // A second run refused as busy leaves the record as it was.
    let held = store.try_lock_rebalance().unwrap();
    let err = reshard::rebalance(&backend, &store, &opts, &mut |_| {}).unwrap_err();
    assert!(matches!(err, ReshardError::Busy { .. }), "{err}");
    assert_eq!(reshard::stored_progress(&store).unwrap().unwrap(), p);
    drop(held);
}

#[test]
fn a_failed_rebalance_says_why_and_a_progress_write_never_fails_one() {
    let (backend, store) = growing_store();
    let down = publish_fails(store.clone(), 0, false);
    let err =
        reshard::rebalance(&backend, &down, &RebalanceOptions::default(), &mut |_| {}).unwrap_err();
    let p = reshard::stored_progress(&store).unwrap().unwrap();
    assert_eq!(p.phase, "failed");
    assert_eq!(p.last_error.as_deref(), Some(err.to_string().as_str()));
    assert!(p.finished_ms.is_some());

    // Settings refused: the rebalance itself goes through.
    let read_only = publish_fails(store.clone(), u32::MAX, true);
    let report = reshard::rebalance(
        &backend,
        &read_only,
        &RebalanceOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    assert!(!report.moved.is_empty());
    assert_eq!(
        reshard::stored_progress(&store).unwrap().unwrap().phase,
        "failed"
    );
}

/// Two keys move while their producers write on: a calm one (a job every
/// few ms) and a hot one (a producer in a tight loop). The calm key is
/// frozen without a pause, its producer never refused as paused; the hot
/// one may be forced through one paused round. Either way every job each
/// producer was told is stored ends up on the new shard, once, in the
/// order it was enqueued, and nothing is left on the old one.
#[test]
fn moving_keys_take_their_producers_along_without_a_pause() {
    let backend = MemoryBackend::new(&["a", "b"], Arc::new(SystemClock));
    let store =
        MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["a", "b"]).unwrap());
    let router = Router::new(store.load().unwrap()).unwrap();
    let from = |k: &str| router.route(k).to_string();
    let to = |k: &str| if from(k) == "a" { "b" } else { "a" };
    for k in ["calm", "hot"] {
        for i in 0..2_000 {
            backend
                .enqueue(&from(k), 1, &[NewJob::new(k, format!("{k}-pre-{i}"))])
                .unwrap();
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let counts = [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))];
    let produce = |key: &'static str, gap_ms: u64, count: &Arc<AtomicU64>| {
        let (backend, store, stop) = (backend.clone(), store.clone(), stop.clone());
        let count = count.clone();
        thread::spawn(move || {
            let mut p = Producer::new(
                Arc::new(backend),
                Arc::new(store),
                ProducerOptions::default(),
            )
            .unwrap();
            let mut sent = Vec::new();
            let mut paused = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let payload = format!("{key}-{}", sent.len());
                p.enqueue(&NewJob::new(key, payload.clone())).unwrap();
                sent.push(payload);
                count.fetch_add(1, Ordering::SeqCst);
                paused += p.take_refusals().paused.values().sum::<u64>();
                if gap_ms > 0 {
                    thread::sleep(Duration::from_millis(gap_ms));
                }
            }
            (sent, paused)
        })
    };
    // The calm key gets a job every 25 ms: a freeze attempt (a last round
    // and the freeze, well under that) rarely has one land inside it, and
    // four times running is as good as never, even on a loaded machine.
    let (calm, hot) = (
        produce("calm", 25, &counts[0]),
        produce("hot", 0, &counts[1]),
    );
    // Both producers write on before and after the rebalance: the calm one
    // two jobs, the hot one a hundred.
    let both_produce = || {
        let from: Vec<u64> = counts.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        wait_until(
            "the calm and hot producers to enqueue more",
            WAIT_MAX,
            || {
                let now: Vec<u64> = counts.iter().map(|c| c.load(Ordering::SeqCst)).collect();
                (now[0] >= from[0] + 2 && now[1] >= from[1] + 100)
                    || calm.is_finished()
                    || hot.is_finished()
            },
        );
    };
    both_produce();
    reshard::pin(&store, "calm", to("calm")).unwrap();
    reshard::pin(&store, "hot", to("hot")).unwrap();
    let report =
        reshard::rebalance(&backend, &store, &RebalanceOptions::default(), &mut |_| {}).unwrap();
    both_produce();
    stop.store(true, Ordering::SeqCst);
    let (calm_sent, calm_paused) = calm.join().unwrap();
    let (hot_sent, _) = hot.join().unwrap();
    let pause_of = |k: &str| {
        report
            .moved
            .iter()
            .find(|m| m.key == k)
            .unwrap_or_else(|| panic!("{k} did not move: {report:?}"))
            .pause_ms
    };
    assert_eq!(pause_of("calm"), 0.0, "the calm key was paused: {report:?}");
    assert_eq!(
        calm_paused, 0,
        "the calm key's producer was refused as paused"
    );
    for (key, sent) in [("calm", calm_sent), ("hot", hot_sent)] {
        let mut want: Vec<String> = (0..2_000).map(|i| format!("{key}-pre-{i}")).collect();
        want.extend(sent);
        let got: Vec<String> = backend
            .export_jobs(to(key), key, None, usize::MAX)
            .unwrap()
            .into_iter()
            .map(|j| String::from_utf8(j.payload).unwrap())
            .collect();
        assert_eq!(got.len(), want.len(), "{key}: jobs lost or stored twice");
        assert!(got == want, "{key}: jobs out of order on the new shard");
        assert_eq!(
            backend.key_counts(&from(key), key).unwrap().depth,
            0,
            "{key} left jobs behind"
        );
    }
}

/// A batch that waits for a run in flight on the old shard says so every
/// second, and the deployment's progress record is written as it does, so
/// a long wait never looks like a stalled rebalance.
#[test]
fn a_long_wait_for_a_run_keeps_the_progress_record_fresh() {
    let clock = Arc::new(shardq_core::ManualClock::new(1_700_000_000_000));
    let backend = MemoryBackend::new(&["a", "b"], clock.clone());
    let store =
        MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["a", "b"]).unwrap());
    let router = Router::new(store.load().unwrap()).unwrap();
    let from = router.route("k").to_string();
    let to = if from == "a" { "b" } else { "a" };
    backend.enqueue(&from, 1, &[NewJob::new("k", "x")]).unwrap();
    backend.adopt(&from).unwrap();
    assert_eq!(backend.claim(&from, 1, 600_000).unwrap().len(), 1);
    reshard::pin(&store, "k", to).unwrap();
    let opts = RebalanceOptions {
        drain_timeout_ms: 3_500,
        poll_ms: 100,
        clock: clock.clone(),
        ..RebalanceOptions::default()
    };
    let mut seen: Vec<(u64, u64)> = Vec::new();
    let err = reshard::rebalance(&backend, &store, &opts, &mut |ev| {
        if let reshard::RebalanceEvent::Waiting { keys, waited_ms } = ev {
            assert_eq!(keys, 1);
            let stored = reshard::stored_progress(&store).unwrap().unwrap();
            assert!(stored.is_running(), "{stored:?}");
            seen.push((waited_ms, stored.updated_ms.unwrap()));
        }
    })
    .unwrap_err();
    assert!(err.to_string().contains("k"), "{err}");
    let waits: Vec<u64> = seen.iter().map(|s| s.0 / 1000).collect();
    assert_eq!(
        waits,
        [1, 2, 3],
        "one word per second of the wait: {seen:?}"
    );
    for pair in seen.windows(2) {
        assert!(
            pair[1].1 >= pair[0].1 + 1_000,
            "the record was not rewritten: {seen:?}"
        );
    }
}

/// A key of concurrency 3 with three runs in flight is pinned to the other
/// shard: the move waits for all three runs to end (acked meanwhile), then
/// takes the key's backlog along, which starts there three at once, in
/// order; nothing runs twice and nothing stays behind.
#[test]
fn a_key_with_several_runs_moves_once_they_all_ended() {
    use shardq_core::flow::{FlowPolicy, FlowSettings};
    use shardq_core::{FlowControl, LocalGroupBuckets};
    let (backend, store) = two_shard_store_moving_backlogs();
    let settings = FlowSettings {
        default: FlowPolicy {
            concurrency: 3,
            ..FlowPolicy::default()
        },
        ..FlowSettings::default()
    };
    let flow = Arc::new(FlowControl::new(
        settings,
        Arc::new(LocalGroupBuckets::default()),
    ));
    let backend = backend.with_flow(flow);
    let key = key_on(&store, "s0");
    let jobs: Vec<NewJob> = (0..6)
        .map(|i| NewJob::new(key.clone(), i.to_string()))
        .collect();
    backend.enqueue("s0", 1, &jobs).unwrap();
    let running = backend.claim("s0", 10, LEASE_MS).unwrap();
    assert_eq!(running.len(), 3, "three at once: {running:?}");
    reshard::pin(&store, &key, "s1").unwrap();
    let acker = {
        let (backend, store) = (backend.clone(), store.clone());
        let receipts: Vec<_> = running.iter().map(|j| j.receipt()).collect();
        thread::spawn(move || {
            for r in receipts {
                thread::sleep(Duration::from_millis(100));
                // Runs left on s0: the key is not switched yet.
                let key = key_of(&backend, r);
                assert!(backend.key_counts("s0", &key).unwrap().in_flight > 0);
                let route = Router::new(store.load().unwrap()).unwrap();
                assert_eq!(route.route(&key), "s0", "switched with runs on s0");
                assert_eq!(backend.ack("s0", &[r]).unwrap().acked, 1);
            }
        })
    };
    let report =
        reshard::rebalance(&backend, &store, &RebalanceOptions::default(), &mut |_| {}).unwrap();
    acker.join().unwrap();
    assert_eq!(report.moved.len(), 1, "{report:?}");
    assert_eq!(
        Router::new(store.load().unwrap()).unwrap().route(&key),
        "s1"
    );
    let old = backend.key_counts("s0", &key).unwrap();
    assert_eq!((old.depth, old.in_flight, old.dead), (0, 0, 0));
    let moved = backend.claim("s1", 10, LEASE_MS).unwrap();
    let payloads: Vec<&[u8]> = moved.iter().map(|j| &j.payload[..]).collect();
    assert_eq!(payloads, [&b"3"[..], b"4", b"5"], "the backlog, in order");
    assert!(moved.iter().all(|j| j.fence > running[2].fence));
}

/// The key of the job a receipt names, on `s0`.
fn key_of(backend: &MemoryBackend, r: shardq_core::Receipt) -> String {
    backend.job("s0", r.id).unwrap().expect("live").key
}

/// Settings changes on the memory map store lose nothing to concurrent
/// writers (the contract check written once in `shardq_testkit`).
#[test]
fn memory_settings_changes_are_never_lost() {
    let store: Arc<dyn MapStore> = Arc::new(MemoryMapStore::new(
        ShardMap::with_shards(Algorithm::Rendezvous, ["a"]).unwrap(),
    ));
    shardq_testkit::contract::settings_changes_are_never_lost(&[store]);
}

/// A key's finished jobs are read from every shard: after the key moved
/// (its older jobs finished on its old shard, its newer on the new one),
/// `key_finished` lists them all, newest first, each with its shard.
#[test]
fn a_keys_finished_jobs_are_found_on_every_shard_they_finished_on() {
    let clock = shardq_core::ManualClock::new(1_000_000);
    let backend = MemoryBackend::new(&["s0", "s1"], Arc::new(clock.clone()));
    for (shard, payload) in [("s0", "old"), ("s1", "new")] {
        backend
            .enqueue(shard, 1, &[NewJob::new("k", payload)])
            .unwrap();
        let run = backend.claim(shard, 1, 30_000).unwrap().remove(0);
        backend.ack(shard, &[run.receipt()]).unwrap();
        clock.advance(1_000);
    }
    let shards = vec!["s0".to_string(), "s1".to_string()];
    let (all, failed) = shardq_core::backend::key_finished(&backend, &shards, "k", 10);
    assert!(failed.is_empty());
    let where_: Vec<&str> = all.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(where_, ["s1", "s0"], "newest first, over both shards");
    let (one, _) = shardq_core::backend::key_finished(&backend, &shards, "k", 1);
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].0, "s1");
}

/// A map store where an operator records a new target while the
/// rebalance runs (on Redis: its lock lapsed while it stalled, and a
/// `set-weight` took the lock for its own write).
fn target_changes_mid_run(inner: MemoryMapStore, newer: ShardMap) -> HookedMaps<MemoryMapStore> {
    let publishes = std::sync::atomic::AtomicU32::new(0);
    HookedMaps::new(inner).on_publish(move |inner, map, expected| {
        if publishes.fetch_add(1, Ordering::SeqCst) == 0 {
            inner.store_target(&newer)?;
        }
        inner.publish(map, expected)
    })
}

/// A rebalance never erases a target recorded after it started: it
/// publishes what it reached, ends with `LockLost` naming the newer
/// target as pending, and the rerun reaches the newer one.
#[test]
fn a_target_recorded_during_a_rebalance_is_never_erased() {
    let clock = Arc::new(shardq_core::ManualClock::new(1_700_000_000_000));
    let backend = MemoryBackend::new(&["a", "b"], clock.clone());
    let inner =
        MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["a", "b"]).unwrap());
    let router = Router::new(inner.load().unwrap()).unwrap();
    for i in 0..40 {
        let k = format!("t-{i}");
        backend
            .enqueue(router.route(&k), 1, &[NewJob::new(k.as_str(), "x")])
            .unwrap();
    }
    reshard::add_shard(&inner, "c", 1, None).unwrap();
    backend.add_shard("c");
    let mut newer = inner.load_target().unwrap().unwrap();
    newer
        .shards
        .iter_mut()
        .find(|s| s.name == "c")
        .unwrap()
        .weight = 5;
    let store = target_changes_mid_run(inner.clone(), newer.clone());
    let opts = RebalanceOptions {
        poll_ms: 1,
        clock: clock.clone(),
        ..RebalanceOptions::default()
    };
    let err = reshard::rebalance(&backend, &store, &opts, &mut |_| {}).unwrap_err();
    assert!(matches!(err, ReshardError::LockLost { .. }), "{err}");
    assert!(
        err.to_string().contains("new target stays pending"),
        "{err}"
    );
    let pending = inner
        .load_target()
        .unwrap()
        .expect("the newer target is kept");
    assert!(reshard::same_target(&pending, &newer));
    // The rerun reaches it and only then clears it.
    reshard::rebalance(&backend, &inner, &opts, &mut |_| {}).unwrap();
    assert_eq!(inner.load_target().unwrap(), None);
    assert_eq!(inner.load().unwrap().shard("c").unwrap().weight, 5);
}

/// A key waits only for its own runs: with one long run among a batch of
/// moving keys, every other key of the batch moves (its switch published,
/// its backlog on the new shard) while that run goes on; the running key
/// moves once its run is acked, in the same rebalance.
#[test]
fn one_long_run_holds_up_its_own_key_and_no_other_of_its_batch() {
    let (backend, store) = two_shard_store_moving_backlogs();
    let router = Router::new(store.load().unwrap()).unwrap();
    let keys: Vec<String> = (0..)
        .map(|i| format!("t-{i}"))
        .filter(|k| router.route(k) == "s1")
        .take(12)
        .collect();
    // The first key's first job runs, long.
    enqueue_all(&backend, &store, &keys[0], &["a".into(), "b".into()]);
    let long = backend.claim("s1", 1, LEASE_MS).unwrap().remove(0);
    assert_eq!(long.key, keys[0]);
    for k in &keys[1..] {
        enqueue_all(&backend, &store, k, &["a".into(), "b".into()]);
    }
    reshard::remove_shard(&store, "s1").unwrap();
    let rebalance = {
        let (backend, store) = (backend.clone(), store.clone());
        thread::spawn(move || {
            let opts = RebalanceOptions {
                batch: 64,
                drain_timeout_ms: 30_000,
                ..RebalanceOptions::default()
            };
            reshard::rebalance(&backend, &store, &opts, &mut |_| {})
        })
    };
    // Every other key moves while the long run is still in flight.
    let t0 = std::time::Instant::now();
    let others_moved = || {
        keys[1..].iter().all(|k| {
            backend.key_counts("s0", k).unwrap().depth == 2
                && store
                    .load()
                    .unwrap()
                    .overrides
                    .get(k)
                    .is_none_or(|s| s == "s0")
        })
    };
    while !others_moved() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the other keys of the batch waited for one key's run"
        );
        thread::sleep(Duration::from_millis(5));
    }
    assert!(
        !rebalance.is_finished(),
        "the long run's key has not moved yet"
    );
    assert_eq!(backend.key_counts("s1", &keys[0]).unwrap().in_flight, 1);
    assert_eq!(backend.key_counts("s0", &keys[0]).unwrap().depth, 0);
    // The rebalance has sealed the long run's key and waits for the run (on
    // a loaded machine the others can be seen moved before it gets there).
    while !backend
        .fence("s1")
        .unwrap()
        .sealed_keys
        .contains_key(&keys[0])
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the long run's key was never sealed"
        );
        thread::sleep(Duration::from_millis(5));
    }
    backend.ack("s1", &[long.receipt()]).unwrap();
    let report = rebalance.join().unwrap().unwrap();
    assert_eq!(report.moved.len(), keys.len());
    let waited = report.moved.iter().find(|m| m.key == keys[0]).unwrap();
    assert!(waited.run_wait_ms > 0.0, "{waited:?}");
    assert_eq!(backend.key_counts("s0", &keys[0]).unwrap().depth, 1);
}

/// An `add-shard` stopped between recording its target and publishing the
/// warming map is finished by the same `add-shard` run again; another
/// weight for that name is still refused, and so is a second add.
#[test]
fn an_add_stopped_before_its_publish_is_finished_by_running_it_again() {
    let inner =
        MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["a", "b"]).unwrap());
    let stopped = publish_fails(inner.clone(), 0, false);
    let err = reshard::add_shard(&stopped, "c", 2, None).unwrap_err();
    assert!(err.to_string().contains("stopped answering"), "{err}");
    assert!(inner.load().unwrap().shard("c").is_none());
    assert!(inner.load_target().unwrap().unwrap().shard("c").is_some());
    let other_weight = reshard::add_shard(&inner, "c", 3, None).unwrap_err();
    assert!(
        other_weight.to_string().contains("already exists"),
        "{other_weight}"
    );
    let version = reshard::add_shard(&inner, "c", 2, None).unwrap();
    let map = inner.load().unwrap();
    assert_eq!(map.version, version);
    assert_eq!(
        map.shard("c").unwrap().state,
        shardq_route::ShardState::Warming
    );
    let again = reshard::add_shard(&inner, "c", 2, None).unwrap_err();
    assert!(again.to_string().contains("already exists"), "{again}");
    // A shard in neither map: the refusal names the shards there are.
    let none = reshard::remove_shard(&inner, "zz").unwrap_err();
    assert!(none.to_string().contains("its shards: a, b, c"), "{none}");
    reshard::rebalance(
        &backend_for(&["a", "b", "c"]),
        &inner,
        &RebalanceOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(
        inner.load().unwrap().shard("c").unwrap().state,
        shardq_route::ShardState::Active
    );
}

fn backend_for(shards: &[&str]) -> MemoryBackend {
    MemoryBackend::new(shards, Arc::new(SystemClock))
}
