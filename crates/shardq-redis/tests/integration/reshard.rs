//! The resharding traits on Redis: the key inventory of a shard, the map
//! store (CAS publish, target, rebalance lock), a shard learned from a newer
//! map, and a whole rebalance 2 -> 3 instances driven by `shardq_core`.

use std::collections::BTreeMap;

use shardq_core::reshard::{self, KeyInventory, MapStore, RebalanceOptions, ReshardError};
use shardq_core::{KeyCounts, ManualClock, QueueBackend};
use shardq_redis::testing::RedisServer;
use shardq_redis::{RedisBackend, RedisMapStore};
use shardq_route::Router;

use crate::common::{init, job, map_of, opts_manual, owner, tick_adopt};

const T0: u64 = 1_700_000_000_000;

fn counts(depth: u64, in_flight: u64, dead: u64) -> KeyCounts {
    KeyCounts {
        depth,
        in_flight,
        dead,
    }
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
    store.store_target(Some(&map)).unwrap();
    assert_eq!(store.load_target().unwrap(), Some(map.clone()));
    store.store_target(None).unwrap();
    assert_eq!(store.load_target().unwrap(), None);

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
    let report = reshard::rebalance(
        &b,
        &store,
        &RebalanceOptions {
            batch: 8,
            drain_timeout_ms: 20_000,
            ..RebalanceOptions::default()
        },
        &mut |_| {},
    )
    .unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    worker.join().unwrap();
    let fin = store.load().unwrap();
    assert_eq!(fin.shards.len(), 3);
    assert!(fin.overrides.is_empty());
    assert!(report.moved.iter().all(|m| m.to == "r2"));
    assert!(store.load_target().unwrap().is_none());
}
