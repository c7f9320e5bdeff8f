//! The resharding traits on Redis: the key inventory of a shard, the map
//! store (CAS publish, target, rebalance lock), a shard learned from a newer
//! map, and a whole rebalance 2 -> 3 instances driven by `shardq_core`.

use std::collections::BTreeMap;

use shardq_core::reshard::{self, KeyInventory, MapStore, RebalanceOptions, ReshardError};
use shardq_core::{InspectJobs, KeyCounts, ManualClock, MoveKeys, RunJobs};
use shardq_redis::{RedisBackend, RedisMapStore};
use shardq_route::Router;
use shardq_testkit::redis::RedisServer;

use crate::common::{
    concurrency_settings, init, job, map_of, opts_manual, opts_with_flow, owner, tick_adopt,
};

const T0: u64 = 1_700_000_000_000;

fn counts(depth: u64, in_flight: u64, dead: u64) -> KeyCounts {
    KeyCounts {
        depth,
        in_flight,
        dead,
    }
}

/// `rebalance` in batches of 8 keys, waiting up to 20 s for a batch.
fn rebalance_in_batches_of_8(b: &RedisBackend, store: &RedisMapStore) -> reshard::RebalanceReport {
    reshard::rebalance(
        b,
        store,
        &RebalanceOptions {
            batch: 8,
            drain_timeout_ms: 20_000,
            ..RebalanceOptions::default()
        },
        &mut |_| {},
    )
    .unwrap()
}

#[test]
fn inventory_lists_queued_and_in_flight_keys_across_calls() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let _c = owner(&b, "w1", 10_000);
    assert!(b.keys_with_work("r0").unwrap().is_empty());
    // More keys than one script call looks at, with deep and odd keys.
    let n = shardq_redis::backend::INVENTORY_KEYS_PER_CALL + 300;
    let mut jobs = Vec::new();
    for i in 0..n {
        jobs.push(job(&format!("t{i}"), "x"));
    }
    for _ in 0..5 {
        jobs.push(job("deep", "x"));
    }
    jobs.push(job("ünï cödé g~", "x"));
    for chunk in jobs.chunks(1000) {
        b.enqueue("r0", 1, chunk).unwrap();
    }
    // Claim everything claimable once: "deep" keeps 4 queued, the others
    // are in flight only.
    let claimed = b
        .claim("r0", 1024, shardq_core::JOB_LEASE_MS_DEFAULT)
        .unwrap();
    let mut more = b
        .claim("r0", 1024, shardq_core::JOB_LEASE_MS_DEFAULT)
        .unwrap();
    let in_flight = claimed.len() + more.len();
    more.clear();
    assert_eq!(in_flight, n + 2);
    let got: BTreeMap<String, KeyCounts> = b.keys_with_work("r0").unwrap().into_iter().collect();
    assert_eq!(got.len(), n + 2);
    assert_eq!(got["deep"], counts(4, 1, 0));
    assert_eq!(got["t0"], counts(0, 1, 0));
    assert_eq!(got["ünï cödé g~"], counts(0, 1, 0));
    // Acked keys leave the inventory.
    let ids: Vec<_> = claimed.iter().map(|j| j.receipt()).collect();
    b.ack("r0", &ids).unwrap();
    let after = b.keys_with_work("r0").unwrap();
    assert!(after.len() < got.len());
    assert!(after.iter().all(|(_, c)| c.depth + c.in_flight > 0));
}

#[test]
fn map_store_cas_target_and_rebalance_lock() {
    let server = RedisServer::start();
    let store = RedisMapStore::open(&server.url()).unwrap();
    let err = store.load().unwrap_err();
    assert!(
        matches!(err, ReshardError::NoMap { .. }) && err.to_string().contains("shardq init"),
        "{err}"
    );
    let map = map_of(&[("r0", server.url())]);
    store.publish(&map, 0).unwrap();
    assert_eq!(store.load().unwrap(), map);
    let mut next = map.clone();
    next.version = 2;
    assert!(matches!(
        store.publish(&next, 0),
        Err(ReshardError::Conflict {
            expected: 0,
            found: 1
        })
    ));
    store.publish(&next, 1).unwrap();

    assert_eq!(store.load_target().unwrap(), None);
    store.store_target(&map).unwrap();
    assert_eq!(store.load_target().unwrap(), Some(map.clone()));
    // Cleared only by the rebalance that reached that very target.
    let mut other_target = map.clone();
    other_target.shards[0].weight = 7;
    assert!(!store.clear_target(&other_target).unwrap());
    assert_eq!(store.load_target().unwrap(), Some(map.clone()));
    assert!(store.clear_target(&map).unwrap());
    assert_eq!(store.load_target().unwrap(), None);
    assert!(store.clear_target(&map).unwrap(), "none pending: cleared");

    let other = RedisMapStore::open(&server.url()).unwrap();
    let held = store.try_lock_rebalance().unwrap();
    match other.try_lock_rebalance() {
        Err(ReshardError::Busy { holder }) => {
            assert!(
                holder.contains(&format!("@{}", std::process::id())),
                "{holder}"
            )
        }
        Err(e) => panic!("expected Busy, got {e}"),
        Ok(_) => panic!("expected Busy, got the lock"),
    }
    drop(held);
    let again = other.try_lock_rebalance().unwrap();
    drop(again);
}

#[test]
fn rebalance_onto_a_new_instance_moves_keys_with_work_in_order() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", servers[0].url()), ("r1", servers[1].url())]);
    init(&map);
    let store = RedisMapStore::open(&servers[0].url()).unwrap();
    store.publish(&map, 0).unwrap();
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let mut c = owner(&b, "w1", 10_000);
    let router = Router::new(map.clone()).unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    for k in &keys {
        b.enqueue(router.route(k), 1, &[job(k, "x")]).unwrap();
    }

    reshard::add_shard(&store, "r2", 1, Some(servers[2].url())).unwrap();
    // A shard added after init gets its deployment record first.
    let opts = shardq_redis::RedisOptions {
        deployment: b.deployment_id(),
        ..shardq_redis::RedisOptions::default()
    };
    assert_eq!(
        shardq_redis::init_shards(&store.load().unwrap(), &opts).unwrap(),
        ["r2"]
    );
    let added = b.sync_shards(&store.load().unwrap()).unwrap();
    assert_eq!(added, ["r2"]);
    tick_adopt(&b, &mut c);
    // Drain concurrently so drain-then-switch can finish.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = {
        let b = b.clone();
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                for s in b.shard_names() {
                    let jobs = b
                        .claim(&s, 100, shardq_core::JOB_LEASE_MS_DEFAULT)
                        .unwrap_or_default();
                    let ids: Vec<_> = jobs.iter().map(|j| j.receipt()).collect();
                    if !ids.is_empty() {
                        b.ack(&s, &ids).unwrap();
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
    };
    let report = rebalance_in_batches_of_8(&b, &store);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    worker.join().unwrap();
    let fin = store.load().unwrap();
    assert_eq!(fin.shards.len(), 3);
    assert!(fin.overrides.is_empty());
    assert!(report.moved.iter().all(|m| m.to == "r2"));
    assert!(store.load_target().unwrap().is_none());
}

/// A moving key takes its backlog to its new instance: with no worker
/// running during the rebalance (a drain would wait forever), every moving
/// key's queued, delayed and dead jobs land on the new shard and none stays
/// behind; a key with a run in flight moves once that run ended (acked from
/// another thread mid-rebalance, never run again). Afterwards every job
/// runs once, in its key's order, wherever its key now lives.
#[test]
fn a_moving_key_takes_its_backlog_to_its_new_instance() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    moving_keys_take_their_backlogs([servers[0].url(), servers[1].url(), servers[2].url()]);
}

/// The move above with shards r0 and r1 on `urls[0]` and `urls[1]` (the
/// map store on the first), r2 added on `urls[2]`: three instances, or one
/// cluster's URL three times.
pub(crate) fn moving_keys_take_their_backlogs(urls: [String; 3]) {
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", urls[0].clone()), ("r1", urls[1].clone())]);
    init(&map);
    let store = RedisMapStore::open(&urls[0]).unwrap();
    store.publish(&map, 0).unwrap();
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let mut c = owner(&b, "w1", 600_000);
    reshard::add_shard(&store, "r2", 1, Some(urls[2].clone())).unwrap();
    let opts = shardq_redis::RedisOptions {
        deployment: b.deployment_id(),
        ..shardq_redis::RedisOptions::default()
    };
    shardq_redis::init_shards(&store.load().unwrap(), &opts).unwrap();
    b.sync_shards(&store.load().unwrap()).unwrap();
    tick_adopt(&b, &mut c);
    let now = Router::new(store.load().unwrap()).unwrap();
    let target = Router::new(store.load_target().unwrap().unwrap()).unwrap();
    let keys: Vec<String> = (0..80).map(|i| format!("t{i}")).collect();
    let moving: Vec<&String> = keys
        .iter()
        .filter(|k| now.route(k) != target.route(k))
        .collect();
    assert!(moving.len() >= 3, "too few keys move: {moving:?}");
    let (dead_key, busy_key) = (moving[0].clone(), moving[1].clone());

    // dead_key: its first job dies (one attempt), on its own shard alone.
    let mut first = job(&dead_key, "0");
    first.max_attempts = 1;
    let home = now.route(&dead_key).to_string();
    b.enqueue(&home, 1, &[first]).unwrap();
    let j = b.claim(&home, 1, 60_000).unwrap().remove(0);
    b.fail(&home, j.receipt(), "boom", None).unwrap();
    // busy_key: its first job in flight through the rebalance.
    let busy_home = now.route(&busy_key).to_string();
    b.enqueue(&busy_home, 1, &[job(&busy_key, "0")]).unwrap();
    let busy = b.claim(&busy_home, 10, 60_000).unwrap();
    assert_eq!(busy.len(), 1);
    let busy = busy.into_iter().next().unwrap();
    // 200 jobs per key after those, one of them delayed by a minute.
    const PER_KEY: usize = 200;
    for seq in 1..=PER_KEY {
        for k in &keys {
            let mut j = job(k, &seq.to_string());
            if seq == 100 && k == &moving[2].clone() {
                j.delay_ms = 60_000;
            }
            b.enqueue(now.route(k), 1, &[j]).unwrap();
        }
    }
    let acker = {
        let b = b.clone();
        let (shard, receipt) = (busy_home.clone(), busy.receipt());
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            b.ack(&shard, &[receipt]).unwrap();
        })
    };
    let report = rebalance_in_batches_of_8(&b, &store);
    acker.join().unwrap();
    let moved_keys: Vec<&str> = report.moved.iter().map(|m| m.key.as_str()).collect();
    for k in &moving {
        assert!(
            moved_keys.contains(&k.as_str()),
            "{k} did not move: {moved_keys:?}"
        );
        let old = b.key_counts(now.route(k), k).unwrap();
        assert_eq!(old, counts(0, 0, 0), "{k} left jobs on its old shard");
        let new = b.key_counts(target.route(k), k).unwrap();
        let dead = u64::from(**k == dead_key);
        assert_eq!(new, counts(PER_KEY as u64, 0, dead), "{k} on its new shard");
    }
    assert_eq!(
        report.jobs_moved,
        (moving.len() * PER_KEY + 1) as u64,
        "every moving key's backlog and the dead letter"
    );
    let dead = b.dead_list(target.route(&dead_key), 10).unwrap();
    assert_eq!((dead.len(), dead[0].reason.as_str()), (1, "boom"));

    // Every job runs once, in key order, where its key lives now.
    clock.advance(120_000);
    let mut seen: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    loop {
        let mut any = false;
        for s in b.shard_names() {
            let jobs = b.claim(&s, 1024, 600_000).unwrap();
            any |= !jobs.is_empty();
            for j in &jobs {
                assert_eq!(target.route(&j.key), s, "{} ran on {s}", j.key);
                let seq: usize = String::from_utf8_lossy(&j.payload).parse().unwrap();
                seen.entry(j.key.clone()).or_default().push(seq);
            }
            let receipts: Vec<_> = jobs.iter().map(|j| j.receipt()).collect();
            if !receipts.is_empty() {
                b.ack(&s, &receipts).unwrap();
            }
        }
        if !any {
            break;
        }
    }
    for k in &keys {
        let want: Vec<usize> = (1..=PER_KEY).collect();
        assert_eq!(seen.get(k), Some(&want), "key {k}: each job once, in order");
    }
}

/// The last round's multi-key export across its bounds: more keys than one
/// call reads, a key longer than one call's job limit, and a key whose
/// payloads pass one call's byte budget. Each key gets every job above
/// its cursor, in order, as the per-key export gives them.
#[test]
fn the_multi_key_export_gives_every_job_across_its_call_bounds() {
    use shardq_redis::backend::{
        EXPORT_MANY_KEYS_MAX, TRANSFER_CALL_BYTES_MAX, TRANSFER_CALL_JOBS_MAX,
    };
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let _c = owner(&b, "w1", 600_000);
    let mut items: Vec<(String, Option<shardq_core::JobId>)> = Vec::new();
    for i in 0..EXPORT_MANY_KEYS_MAX + 20 {
        let k = format!("small-{i}");
        let jobs: Vec<_> = (0..3).map(|n| job(&k, &n.to_string())).collect();
        b.enqueue("r0", 1, &jobs).unwrap();
        items.push((k, None));
    }
    let long: Vec<_> = (0..TRANSFER_CALL_JOBS_MAX + 500)
        .map(|n| job("long", &n.to_string()))
        .collect();
    for chunk in long.chunks(1000) {
        b.enqueue("r0", 1, chunk).unwrap();
    }
    let big_payload = 900 * 1024;
    let big_jobs = TRANSFER_CALL_BYTES_MAX / big_payload + 2;
    for n in 0..big_jobs {
        let payload = format!("{n}{}", "x".repeat(big_payload));
        b.enqueue("r0", 1, &[job("big", &payload)]).unwrap();
    }
    let first_long = b.export_jobs("r0", "long", None, 1).unwrap()[0].id;
    items.insert(3, ("long".into(), Some(first_long)));
    items.push(("big".into(), None));
    let fence = shardq_core::Fence {
        sealed_keys: items
            .iter()
            .map(|(k, _)| (k.clone(), "r9".into()))
            .collect(),
        ..b.fence("r0").unwrap()
    };
    b.set_fence("r0", &fence).unwrap();
    let many = b.export_many("r0", &items).unwrap();
    assert_eq!(many.len(), items.len());
    for ((key, after), (got_key, got)) in items.iter().zip(&many) {
        assert_eq!(key, got_key);
        let mut want = Vec::new();
        let mut cur = *after;
        loop {
            let chunk = b.export_jobs("r0", key, cur, 4096).unwrap();
            if chunk.is_empty() {
                break;
            }
            cur = chunk.last().map(|j| j.id);
            want.extend(chunk);
        }
        assert_eq!(got.len(), want.len(), "{key}");
        assert!(got == &want, "{key}: the batched export differs");
    }
    let n = |k: &str| many.iter().find(|(x, _)| x == k).unwrap().1.len();
    assert_eq!(
        (n("long"), n("big"), n("small-0")),
        (TRANSFER_CALL_JOBS_MAX + 499, big_jobs, 3)
    );
}

/// A rebalance that stalled past its lock's lease (stopped, paused) wakes
/// and writes again, while the rebalance that took the lock over works:
/// every write of the stalled one to a shard the newer one entered is
/// refused naming both epochs (no purge, no fence change, no copy, no
/// freeze), and the newer one's writes go on.
#[test]
fn a_rebalance_that_lost_its_lock_cannot_write_behind_the_next_one() {
    use shardq_core::{Fence, MovedJob, QueueError};
    let servers = [RedisServer::start(), RedisServer::start()];
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", servers[0].url()), ("r1", servers[1].url())]);
    init(&map);
    let store = RedisMapStore::open(&servers[0].url()).unwrap();
    let stalled = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let newer = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let jobs: Vec<_> = (0..5).map(|i| job("k", &format!("j{i}"))).collect();
    newer.enqueue("r0", 1, &jobs).unwrap();
    // An epoch is only handed out under the lock.
    assert!(store.rebalance_epoch().is_err());
    // The first rebalance takes the lock, enters, seals k and copies part
    // of it...
    let lock = store.try_lock_rebalance().unwrap();
    let first = store.rebalance_epoch().unwrap();
    for s in ["r0", "r1"] {
        stalled.enter_rebalance(s, first).unwrap();
    }
    let mut sealed = stalled.fence("r0").unwrap();
    sealed.sealed_keys.insert("k".into(), "r1".into());
    stalled.set_fence("r0", &sealed).unwrap();
    let exported: Vec<MovedJob> = stalled.export_jobs("r0", "k", None, 100).unwrap();
    assert_eq!(exported.len(), 5);
    // ...then stalls; its lock lapses (deleted here, as the lease would
    // let it go) and the next rebalance takes it over and enters.
    let mut con = redis::Client::open(servers[0].url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(shardq_redis::keys::rebalance_lock_key(
            shardq_redis::keys::NAMESPACE_DEFAULT,
        ))
        .query(&mut con)
        .unwrap();
    let other = RedisMapStore::open(&servers[0].url()).unwrap();
    let _taken = other.try_lock_rebalance().unwrap();
    let second = other.rebalance_epoch().unwrap();
    assert!(second > first, "epochs grow: {first} then {second}");
    // The stalled holder, awake, gets no new epoch: its lock is gone.
    match store.rebalance_epoch() {
        Err(ReshardError::Busy { holder }) => assert!(holder.contains("lapsed"), "{holder}"),
        other => panic!("a lapsed holder got an epoch: {other:?}"),
    }
    drop(lock);
    for s in ["r0", "r1"] {
        newer.enter_rebalance(s, second).unwrap();
    }
    let superseded = |e: QueueError| match e {
        e @ QueueError::Superseded { .. } => {
            let QueueError::Superseded { epoch, newer, .. } = &e else {
                unreachable!()
            };
            assert_eq!((*epoch, *newer), (first, second));
            let text = e.to_string();
            assert!(
                text.contains(&format!("epoch {first}"))
                    && text.contains(&format!("epoch {second}")),
                "{text}"
            );
        }
        other => panic!("expected Superseded, got {other}"),
    };
    superseded(stalled.purge_key("r0", "k").unwrap_err());
    superseded(stalled.set_fence("r0", &Fence::default()).unwrap_err());
    superseded(stalled.import_jobs("r1", "r0", "k", &exported).unwrap_err());
    superseded(
        stalled
            .freeze_caught_up("r0", &[("k".to_string(), exported.last().map(|j| j.id))])
            .unwrap_err(),
    );
    superseded(stalled.enter_rebalance("r0", first).unwrap_err());
    // Nothing of it landed: k's jobs all on r0, still sealed, none on r1.
    assert_eq!(newer.key_counts("r0", "k").unwrap().depth, 5);
    assert_eq!(newer.key_counts("r1", "k").unwrap().depth, 0);
    assert_eq!(newer.fence("r0").unwrap().sealed_keys, sealed.sealed_keys);
    assert!(newer.fence("r0").unwrap().paused_keys.is_empty());
    // The newer rebalance's own writes go in.
    let stored = newer.import_jobs("r1", "r0", "k", &exported).unwrap();
    assert_eq!(stored.len(), 5);
    assert_eq!(newer.purge_key("r0", "k").unwrap(), 5);
    // Producers and owners carry no epoch and are never refused for one.
    newer.enqueue("r1", 1, &[job("k", "after")]).unwrap();
    stalled.enqueue("r1", 1, &[job("k", "after-2")]).unwrap();
    assert_eq!(newer.key_counts("r1", "k").unwrap().depth, 7);
}

/// An owner name starting with `@` is refused: its lease tokens would read
/// as a rebalance's epoch in the scripts.
#[test]
fn an_owner_named_like_an_epoch_is_refused() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let err = shardq_redis::RedisCoordinator::new(
        &b,
        shardq_redis::CoordinatorOptions {
            owner: Some("@svc".into()),
            ..Default::default()
        },
    )
    .err()
    .expect("refused");
    assert!(err.to_string().contains("\"@svc\""), "{err}");
}

/// A key of concurrency 3 with three runs in flight on its Redis shard is
/// pinned to the other instance: the move waits for all three runs to end
/// (acked one by one meanwhile, the route unchanged while any is left),
/// then takes the backlog along, which starts there three at once, in
/// order, and nothing stays behind.
#[test]
fn a_key_with_several_runs_moves_once_they_all_ended() {
    let servers: Vec<RedisServer> = (0..2).map(|_| RedisServer::start()).collect();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", servers[0].url()), ("r1", servers[1].url())]);
    init(&map);
    let store = RedisMapStore::open(&servers[0].url()).unwrap();
    store.publish(&map, 0).unwrap();
    let opts = opts_with_flow(&clock, concurrency_settings(3), &servers[0].url());
    let b = RedisBackend::open(&map, opts).unwrap();
    let _c = owner(&b, "w1", 600_000);
    let router = Router::new(map.clone()).unwrap();
    let key = (0..100)
        .map(|i| format!("c{i}"))
        .find(|k| router.route(k) == "r0")
        .expect("a key on r0");
    let jobs: Vec<_> = (0..6).map(|i| job(&key, &i.to_string())).collect();
    b.enqueue("r0", 1, &jobs).unwrap();
    let running = b.claim("r0", 10, 600_000).unwrap();
    assert_eq!(crate::common::payloads(&running), ["0", "1", "2"]);
    reshard::pin(&store, &key, "r1").unwrap();
    let acker = {
        let (b, store, key) = (b.clone(), store.clone(), key.clone());
        let receipts: Vec<_> = running.iter().map(|j| j.receipt()).collect();
        std::thread::spawn(move || {
            for r in receipts {
                std::thread::sleep(std::time::Duration::from_millis(100));
                assert!(b.key_counts("r0", &key).unwrap().in_flight > 0);
                let route = Router::new(store.load().unwrap()).unwrap();
                assert_eq!(route.route(&key), "r0", "switched with runs on r0");
                assert_eq!(b.ack("r0", &[r]).unwrap().acked, 1);
            }
        })
    };
    let report = rebalance_in_batches_of_8(&b, &store);
    acker.join().unwrap();
    assert_eq!(report.moved.len(), 1, "{report:?}");
    let now = Router::new(store.load().unwrap()).unwrap();
    assert_eq!(now.route(&key), "r1");
    assert_eq!(b.key_counts("r0", &key).unwrap(), counts(0, 0, 0));
    let moved = b.claim("r1", 10, 600_000).unwrap();
    let order: Vec<String> = (moved.iter())
        .map(|j| String::from_utf8_lossy(&j.payload).into_owned())
        .collect();
    assert_eq!(order, ["3", "4", "5"], "the backlog, in order");
    assert!(
        moved.windows(2).all(|w| w[0].fence < w[1].fence),
        "{moved:?}"
    );
    assert_eq!(b.key_counts("r1", &key).unwrap(), counts(0, 3, 0));
}

fn drop_lock_key(url: &str) {
    let mut con = redis::Client::open(url).unwrap().get_connection().unwrap();
    let _: () = redis::cmd("DEL")
        .arg(shardq_redis::keys::rebalance_lock_key(
            shardq_redis::keys::NAMESPACE_DEFAULT,
        ))
        .query(&mut con)
        .unwrap();
}

/// A rebalance stalled past its lock's lease (the lease lets the lock go;
/// here it is deleted) while an operator's `set-weight` took the lock and
/// recorded a new target: on waking, the stalled one can publish no map,
/// record no target and erase the newer one, and its renewal marks the
/// lock lost so it stops at its next step.
#[test]
fn a_rebalance_whose_lock_lapsed_publishes_nothing_and_keeps_the_newer_target() {
    let server = RedisServer::start();
    let url = server.url();
    let store = RedisMapStore::open(&url).unwrap();
    let map = map_of(&[("r0", url.clone()), ("r1", url.clone())]);
    store.publish(&map, 0).unwrap();
    let stalled_lock = store.try_lock_rebalance().unwrap();
    let reached = reshard::current_target(&store).unwrap();
    store.check_lock().unwrap();
    drop_lock_key(&url);
    let operator = RedisMapStore::open(&url).unwrap();
    reshard::set_weight(&operator, "r1", 4).unwrap();
    let newer = operator
        .load_target()
        .unwrap()
        .expect("the operator's target");

    let mut next = map.clone();
    next.version = 2;
    let lost = |e: ReshardError| {
        assert!(matches!(e, ReshardError::LockLost { .. }), "{e}");
        assert!(e.to_string().contains("lock lapsed"), "{e}");
    };
    lost(store.publish(&next, 1).unwrap_err());
    lost(store.store_target(&reached).unwrap_err());
    assert!(!store.clear_target(&reached).unwrap());
    assert_eq!(store.load().unwrap().version, 1, "nothing published");
    assert_eq!(store.load_target().unwrap(), Some(newer.clone()));
    // The renewal (every REBALANCE_LOCK_MS / REBALANCE_LOCK_RENEWALS) finds
    // the lock gone and marks it lost: the run stops at its next step.
    let every =
        shardq_redis::mapstore::REBALANCE_LOCK_MS / shardq_redis::mapstore::REBALANCE_LOCK_RENEWALS;
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(every * 2 + 2_000);
    loop {
        match store.check_lock() {
            Err(e) => {
                lost(e);
                break;
            }
            Ok(()) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(50))
            }
            Ok(()) => panic!("no renewal found the lock lost within {every} ms x 2"),
        }
    }
    drop(stalled_lock);
    // Another process's map writes, with no lock, go in as before.
    operator.publish(&next, 1).unwrap();
    assert_eq!(operator.load_target().unwrap(), Some(newer));
}

/// A lock held by a process of this host that is gone (SIGKILLed, so it
/// released nothing) is taken at once, not after its lease; a live
/// holder's, or another host's, is not.
#[test]
fn a_dead_local_holders_rebalance_lock_is_taken_at_once() {
    let server = RedisServer::start();
    let url = server.url();
    let store = RedisMapStore::open(&url).unwrap();
    store.publish(&map_of(&[("r0", url.clone())]), 0).unwrap();
    let me = shardq_redis::coord::default_owner();
    let host = me.split('@').next().unwrap().to_string();
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let mut alive = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let key = shardq_redis::keys::rebalance_lock_key(shardq_redis::keys::NAMESPACE_DEFAULT);
    let mut con = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut hold = |token: &str| {
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(token)
            .arg("PX")
            .arg(60_000)
            .query(&mut con)
            .unwrap();
    };
    for busy in [
        format!("{host}@{}#0", alive.id()),
        format!("another-host-{host}@{dead_pid}#0"),
        "not-a-token".to_string(),
    ] {
        hold(&busy);
        match store.try_lock_rebalance() {
            Err(ReshardError::Busy { holder }) => assert!(holder.contains(&busy), "{holder}"),
            Err(e) => panic!("expected Busy for {busy}, got {e}"),
            Ok(_) => panic!("took the lock of a holder that may live: {busy}"),
        }
    }
    hold(&format!("{host}@{dead_pid}#3"));
    let started = std::time::Instant::now();
    let lock = store
        .try_lock_rebalance()
        .expect("a dead holder's lock is free");
    assert!(started.elapsed() < std::time::Duration::from_secs(2));
    assert!(store.rebalance_epoch().unwrap() > 0);
    drop(lock);
    alive.kill().unwrap();
    let _ = alive.wait();
}

/// A move whose copy stops mid-way, its exports running ahead of its
/// imports, and a rerun: keys of several chunks each (more than
/// [`reshard::TRANSFER_CHUNK_JOBS`] jobs) leave a shard whose store
/// (`victim` 0) or whose keys' new shard's store (`victim` 1) is killed
/// (SIGKILL, AOF with fsync always) as soon as the new shard took the
/// first chunk, so chunks exported and not yet imported are dropped with
/// the run. After a restart and a rerun every key's jobs are on its new
/// shard once each, in order, and none is left on the old one.
fn a_move_killed_mid_copy_loses_and_repeats_nothing(victim: usize) {
    use shardq_testkit::redis::ServerOptions;
    let mut servers: Vec<RedisServer> = (0..2)
        .map(|_| {
            RedisServer::start_with(ServerOptions {
                aof_always: true,
                ..ServerOptions::default()
            })
        })
        .collect();
    let store_server = RedisServer::start();
    let map = map_of(&[("r0", servers[0].url()), ("r1", servers[1].url())]);
    init(&map);
    let store = RedisMapStore::open(&store_server.url()).unwrap();
    store.publish(&map, 0).unwrap();
    let b = RedisBackend::open(&map, shardq_redis::RedisOptions::default()).unwrap();
    let router = Router::new(map.clone()).unwrap();
    let keys: Vec<String> = (0..40)
        .map(|i| format!("t{i}"))
        .filter(|k| router.route(k) == "r0")
        .take(3)
        .collect();
    assert_eq!(keys.len(), 3);
    let per_key = 2 * reshard::TRANSFER_CHUNK_JOBS + 800;
    for k in &keys {
        let jobs: Vec<_> = (0..per_key).map(|s| job(k, &s.to_string())).collect();
        for part in jobs.chunks(1000) {
            b.enqueue("r0", 1, part).unwrap();
        }
    }
    reshard::remove_shard(&store, "r0").unwrap();

    // The interrupted run's backend gives up on the killed server after
    // 0.2 s instead of the default 5 s budget per call (several calls
    // retry it before the run fails); the run is not timed.
    let impatient = RedisBackend::open(
        &map,
        shardq_redis::RedisOptions {
            retry_budget_ms: 200,
            ..shardq_redis::RedisOptions::default()
        },
    )
    .unwrap();
    let mover = {
        let (b, store) = (impatient, RedisMapStore::open(&store_server.url()).unwrap());
        std::thread::spawn(move || {
            reshard::rebalance(&b, &store, &RebalanceOptions::default(), &mut |_| {})
        })
    };
    let watch = RedisBackend::open(&map, shardq_redis::RedisOptions::default()).unwrap();
    let started = std::time::Instant::now();
    while watch.key_counts("r1", &keys[0]).unwrap().depth == 0 {
        assert!(started.elapsed().as_secs() < 60, "no copy arrived");
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    servers[victim].kill();
    let first = mover.join().unwrap();
    assert!(
        first.is_err(),
        "the run went on without its store: {first:?}"
    );
    servers[victim].restart();
    let report = reshard::rebalance(&b, &store, &RebalanceOptions::default(), &mut |_| {})
        .expect("the rerun finishes the move");
    assert!(report.moved.iter().any(|m| m.key == keys[2]), "{report:?}");

    // The crash is over: the stores need not fsync each of the reading
    // loop's claims and acks (one job per key per claim, thousands of
    // writes, tens of seconds on a slow disk) to tell what they hold.
    for s in &servers {
        let said = s.cli(&["CONFIG", "SET", "appendfsync", "no"]);
        assert_eq!(said.trim(), "OK", "{said}");
    }
    let mut c = owner(&b, "w1", 600_000);
    tick_adopt(&b, &mut c);
    let mut seen: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    loop {
        let jobs = b.claim("r1", 1024, 600_000).unwrap();
        if jobs.is_empty() {
            break;
        }
        for j in &jobs {
            let seq: usize = String::from_utf8_lossy(&j.payload).parse().unwrap();
            seen.entry(j.key.clone()).or_default().push(seq);
        }
        let receipts: Vec<_> = jobs.iter().map(|j| j.receipt()).collect();
        b.ack("r1", &receipts).unwrap();
    }
    for k in &keys {
        let got = seen.get(k).map(Vec::as_slice).unwrap_or(&[]);
        let want: Vec<usize> = (0..per_key).collect();
        assert!(
            got == want.as_slice(),
            "key {k}: {} jobs, first out of place at {:?}",
            got.len(),
            got.iter().zip(&want).position(|(a, b)| a != b)
        );
        assert_eq!(
            b.key_counts("r0", k).unwrap(),
            counts(0, 0, 0),
            "{k} left on r0"
        );
    }
}

#[test]
fn a_move_whose_new_shard_is_killed_mid_copy_loses_and_repeats_nothing() {
    a_move_killed_mid_copy_loses_and_repeats_nothing(1);
}

#[test]
fn a_move_whose_old_shard_is_killed_mid_copy_loses_and_repeats_nothing() {
    a_move_killed_mid_copy_loses_and_repeats_nothing(0);
}
