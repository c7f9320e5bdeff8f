//! Cluster mode against a real 3-master Redis Cluster: client-side slots
//! agree with `CLUSTER KEYSLOT`, shards spread over the masters, and a live
//! `redis-cli --cluster reshard` of a busy shard's slot loses nothing and
//! reorders no key, and a shardq rebalance inside the cluster moves keys
//! with their backlogs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use shardq_core::{InspectJobs, Receipt, RunJobs};
use shardq_redis::keys::{map_key, shard_keys, shard_slot, NAMESPACE_DEFAULT as NS, QUEUE_DEFAULT};
use shardq_redis::{RedisBackend, RedisMapStore, RedisOptions};
use shardq_testkit::redis::{slot_ranges, RedisCluster};

use crate::common::{check_order, init, job, map_of, owner, payloads, tick_adopt};

const KEYS: u64 = 20;
const WAIT_MS_MAX: u64 = 60_000;
const NAME_SEARCH_MAX: u32 = 2_000_000;
/// Pause after each key moved by hand, in ms: keeps the slot split.
const MIGRATE_PAUSE_MS: u64 = 40;

/// A shard name (from `prefix-<n>`) whose slot satisfies `want`.
fn name_where(prefix: &str, want: impl Fn(u16) -> bool) -> String {
    (0..NAME_SEARCH_MAX)
        .map(|i| format!("{prefix}-{i}"))
        .find(|n| want(shard_slot(NS, QUEUE_DEFAULT, n)))
        .expect("a shard name with the wanted slot")
}

/// A shardq rebalance inside one cluster: moving keys take their backlogs
/// (the scripts of both shards run on whichever masters hold their slots).
#[test]
fn a_moving_key_takes_its_backlog_within_the_cluster() {
    let cluster = RedisCluster::start(3);
    let url = cluster.url();
    crate::reshard::moving_keys_take_their_backlogs([url.clone(), url.clone(), url]);
}

#[test]
fn cluster_mode_spreads_shards_and_slots_match_the_server() {
    let cluster = RedisCluster::start(3);
    // Client-side slots agree with the server's, for shard keys and the
    // reserved namespace.
    for (q, s) in [
        ("default", "c-0"),
        ("orders.v2", "redis-7"),
        ("q_1", "a.b-c"),
    ] {
        let mut keys = shard_keys(NS, q, s);
        keys.push(map_key(NS));
        for k in keys {
            let server: u16 = cluster.nodes[0]
                .cli(&["cluster", "keyslot", &k])
                .trim()
                .parse()
                .unwrap();
            assert_eq!(shardq_route::slot(k.as_bytes()), server, "{k}");
        }
        assert_eq!(
            shard_slot(NS, q, s),
            shardq_route::slot(shard_keys(NS, q, s)[0].as_bytes())
        );
    }

    // One shard on each master.
    let names: Vec<String> = (0..3)
        .map(|m| name_where("c", |slot| cluster.node_for_slot(slot) == m))
        .collect();
    let shards: Vec<(&str, String)> = names.iter().map(|n| (n.as_str(), cluster.url())).collect();
    let map = map_of(&shards);
    init(&map);
    let b = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    assert!(b.is_cluster(&names[0]));
    let _c = owner(&b, "w@1", 10_000);
    for n in &names {
        let jobs: Vec<_> = (0..30)
            .map(|i| job(&format!("k{}", i % 3), &format!("{n}/{i}")))
            .collect();
        b.enqueue(n, 1, &jobs).unwrap();
    }
    for (m, n) in names.iter().enumerate() {
        // The shard's keys physically live on the master that serves its slot.
        let mut con = cluster.nodes[m].connection();
        let exists: u64 = redis::cmd("EXISTS")
            .arg(&shard_keys(NS, QUEUE_DEFAULT, n)[1])
            .query(&mut con)
            .unwrap();
        assert_eq!(exists, 1, "{n} on node {m}");
        let mut seen = Vec::new();
        loop {
            let got = b.claim(n, 100, shardq_core::JOB_LEASE_MS_DEFAULT).unwrap();
            if got.is_empty() {
                break;
            }
            assert!(got.len() <= 3, "one in flight per key");
            seen.extend(payloads(&got));
            let ids: Vec<Receipt> = got.iter().map(|j| j.receipt()).collect();
            b.ack(n, &ids).unwrap();
        }
        assert_eq!(seen.len(), 30);
    }
    let store = RedisMapStore::open(&cluster.url()).unwrap();
    store.publish_map(&map, 0).unwrap();
    assert_eq!(store.load_map().unwrap(), Some(map));
}

#[test]
fn reshard_of_a_busy_slot_under_load_loses_nothing_and_keeps_key_order() {
    busy_slot_moves_under_load(|cluster, slot| {
        let port0 = cluster.nodes[0].port();
        let (from, to) = (cluster.node_id(0), cluster.node_id(1));
        let out = cluster.nodes[0].cli(&[
            "--cluster",
            "reshard",
            &format!("127.0.0.1:{port0}"),
            "--cluster-from",
            &from,
            "--cluster-to",
            &to,
            "--cluster-slots",
            "1",
            "--cluster-yes",
            "--cluster-pipeline",
            "1",
        ]);
        assert!(
            out.contains(&format!("Moving slot {slot} from")),
            "reshard output:\n{out}"
        );
    });
}

/// Moves the slot by hand, one key at a time with a pause after each, so
/// the shard's keys stay split between two masters while load runs: every
/// script must see `TRYAGAIN`/`ASK`, never half a shard.
#[test]
fn manual_slot_migration_key_by_key_under_load_keeps_every_job() {
    busy_slot_moves_under_load(|cluster, slot| {
        let s = slot.to_string();
        let (from, to) = (cluster.node_id(0), cluster.node_id(1));
        let target_port = cluster.nodes[1].port().to_string();
        let ok = |out: String| assert!(out.trim() == "OK", "{out}");
        ok(cluster.nodes[1].cli(&["cluster", "setslot", &s, "importing", &from]));
        ok(cluster.nodes[0].cli(&["cluster", "setslot", &s, "migrating", &to]));
        let mut moved = 0;
        loop {
            let keys = cluster.nodes[0].cli(&["cluster", "getkeysinslot", &s, "1"]);
            let Some(key) = keys.lines().map(str::trim).find(|k| !k.is_empty()) else {
                break;
            };
            let out = cluster.nodes[0].cli(&[
                "migrate",
                "127.0.0.1",
                &target_port,
                "",
                "0",
                "5000",
                "keys",
                key,
            ]);
            assert!(
                out.trim() == "OK" || out.contains("NOKEY"),
                "MIGRATE {key}: {out}"
            );
            moved += 1;
            assert!(moved < 100, "slot {slot} never empties");
            thread::sleep(Duration::from_millis(MIGRATE_PAUSE_MS));
        }
        assert!(moved >= 2, "only {moved} keys moved");
        for node in [1, 0, 2] {
            ok(cluster.nodes[node].cli(&["cluster", "setslot", &s, "node", &to]));
        }
    });
}

/// Runs a producer and a worker on a busy shard whose slot is node 0's
/// lowest, calls `mover` to move that slot to node 1 mid-load, and checks
/// that every acknowledged job ran once, in key order.
fn busy_slot_moves_under_load(mover: impl FnOnce(&RedisCluster, u16)) {
    let cluster = RedisCluster::start(3);
    // redis-cli moves a source's lowest slots first: put the busy shard there.
    let ranges = slot_ranges(cluster.nodes[0].port());
    let port0 = cluster.nodes[0].port();
    let first0 = ranges.iter().find(|r| r.2 == port0).unwrap().0;
    let busy = name_where("busy", |slot| slot == first0);
    let slot = shard_slot(NS, QUEUE_DEFAULT, &busy);
    assert_eq!(cluster.node_for_slot(slot), 0);
    let map = map_of(&[(busy.as_str(), cluster.url())]);
    init(&map);

    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let b = RedisBackend::open(&map, RedisOptions::default()).unwrap();
        let (acked, stop, busy) = (Arc::clone(&acked), Arc::clone(&stop), busy.clone());
        thread::spawn(move || {
            let mut seq = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let jobs: Vec<_> = (0..5)
                    .map(|_| {
                        seq += 1;
                        let key = format!("k{}", seq % KEYS);
                        job(&key, &format!("{key}/{seq}"))
                    })
                    .collect();
                b.enqueue(&busy, 1, &jobs).expect("enqueue during reshard");
                acked.lock().unwrap().extend(
                    jobs.iter()
                        .map(|j| String::from_utf8_lossy(&j.payload).into_owned()),
                );
                thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let worker = {
        let b = RedisBackend::open(&map, RedisOptions::default()).unwrap();
        let (runs, stop, busy) = (Arc::clone(&runs), Arc::clone(&stop), busy.clone());
        thread::spawn(move || {
            let mut c = owner(&b, "w@1", 5_000);
            let deadline = Instant::now() + Duration::from_millis(WAIT_MS_MAX);
            let mut idle = 0;
            let mut next_tick = Instant::now();
            while Instant::now() < deadline {
                if Instant::now() >= next_tick {
                    tick_adopt(&b, &mut c);
                    next_tick = Instant::now() + Duration::from_millis(500);
                }
                // Small claims keep a backlog, so the shard has many keys to move.
                let jobs = b
                    .claim(&busy, 4, shardq_core::JOB_LEASE_MS_DEFAULT)
                    .expect("claim during reshard");
                if jobs.is_empty() {
                    if stop.load(Ordering::SeqCst) {
                        idle += 1;
                        if idle > 50 {
                            return;
                        }
                    }
                    thread::sleep(Duration::from_millis(1));
                    continue;
                }
                idle = 0;
                runs.lock().unwrap().extend(
                    jobs.iter()
                        .map(|j| String::from_utf8_lossy(&j.payload).into_owned()),
                );
                let ids: Vec<Receipt> = jobs.iter().map(|j| j.receipt()).collect();
                b.ack(&busy, &ids).expect("ack during reshard");
            }
        })
    };

    while acked.lock().unwrap().len() < 500 {
        thread::sleep(Duration::from_millis(5));
    }
    mover(&cluster, slot);
    cluster.wait_consistent();
    assert_eq!(cluster.node_for_slot(slot), 1, "slot moved");
    let before = acked.lock().unwrap().len();
    while acked.lock().unwrap().len() < before + 500 {
        thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::SeqCst);
    producer.join().unwrap();
    worker.join().unwrap();

    let mut con = cluster.nodes[1].connection();
    let exists: u64 = redis::cmd("EXISTS")
        .arg(&shard_keys(NS, QUEUE_DEFAULT, &busy)[0])
        .query(&mut con)
        .unwrap();
    assert_eq!(exists, 1, "the shard's keys live on the new master");

    let acked = acked.lock().unwrap().clone();
    let runs = runs.lock().unwrap().clone();
    let repeats = check_order(&runs, &BTreeMap::new());
    let ran: BTreeSet<&String> = runs.iter().collect();
    let lost: Vec<&String> = acked.iter().filter(|p| !ran.contains(p)).collect();
    assert!(lost.is_empty(), "{} acknowledged jobs lost", lost.len());
    assert_eq!(repeats, 0, "nothing ran twice");
}

/// Flow control on a cluster: one group's bucket (in the map store, on
/// whichever master holds its slot) is shared by keys on two shards in
/// different slots; a run over the limit is handed back unused and starts
/// once a token is due.
#[test]
fn a_groups_limit_holds_across_shards_of_a_cluster() {
    use shardq_core::flow::{FlowPolicy, FlowSettings, GroupLimit, Rate};
    use shardq_core::{FlowControl, ManualClock};
    let cluster = RedisCluster::start(3);
    let url = cluster.url();
    let a = name_where("fa", |s| s < 5_000);
    let b = name_where("fb", |s| s > 11_000);
    let map = map_of(&[(a.as_str(), url.clone()), (b.as_str(), url.clone())]);
    init(&map);
    let mut settings = FlowSettings::default();
    settings.groups.insert(
        "api".into(),
        GroupLimit {
            rate: Some(Rate {
                count: 10,
                per_ms: 1_000,
            }),
            burst: Some(2),
            concurrency: None,
        },
    );
    settings.default = FlowPolicy {
        group: Some("api".into()),
        ..FlowPolicy::default()
    };
    let clock = ManualClock::new(1_700_000_000_000);
    let mut opts = crate::common::opts_manual(&clock);
    let store = RedisMapStore::open(&url).expect("map store");
    opts.flow = Some(Arc::new(FlowControl::new(settings, Arc::new(store))));
    let backend = RedisBackend::open(&map, opts).expect("open");
    let mut c = owner(&backend, "flow", 600_000);
    tick_adopt(&backend, &mut c);
    for (i, shard) in [&a, &b].into_iter().enumerate() {
        for n in 0..5 {
            backend
                .enqueue(shard, u64::MAX, &[job(&format!("k{i}"), &n.to_string())])
                .expect("enqueue");
        }
    }
    let started = || -> usize {
        let mut n = 0;
        for shard in [&a, &b] {
            let runs = backend.claim(shard, 10, 600_000).expect("claim");
            let receipts: Vec<Receipt> = runs.iter().map(|r| r.receipt()).collect();
            n += receipts.len();
            backend.ack(shard, &receipts).expect("ack");
        }
        n
    };
    assert_eq!(
        started() + started(),
        2,
        "the group's burst of 2 over both shards"
    );
    clock.advance(100);
    assert_eq!(started(), 1, "one token per 100 ms");
    clock.advance(1_000);
    assert_eq!(started(), 2, "a second refills the burst, no more");
    let left: u64 = [&a, &b]
        .iter()
        .map(|s| {
            let st = backend.shard_stats(s).expect("stats");
            st.ready + st.delayed
        })
        .sum();
    assert_eq!(left, 5, "runs handed back wait, none lost");
}

/// A key of concurrency 3 on shards of two masters of a cluster: each
/// claim starts its next jobs in order, three at once, and one more as one
/// ends (the key's record and its runs live in the shard's slot).
#[test]
fn a_keys_concurrency_holds_on_shards_of_a_cluster() {
    use shardq_core::ManualClock;
    let cluster = RedisCluster::start(3);
    let url = cluster.url();
    let a = name_where("ca", |s| s < 5_000);
    let b = name_where("cb", |s| s > 11_000);
    let map = map_of(&[(a.as_str(), url.clone()), (b.as_str(), url.clone())]);
    init(&map);
    let clock = ManualClock::new(1_700_000_000_000);
    let settings = crate::common::concurrency_settings(3);
    let opts = crate::common::opts_with_flow(&clock, settings, &url);
    let backend = RedisBackend::open(&map, opts).expect("open");
    let mut c = owner(&backend, "conc", 600_000);
    tick_adopt(&backend, &mut c);
    let in_order = |runs: &[shardq_core::ClaimedJob]| -> Vec<String> {
        runs.iter()
            .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
            .collect()
    };
    for shard in [&a, &b] {
        let jobs: Vec<_> = (0..5).map(|n| job("k", &n.to_string())).collect();
        backend.enqueue(shard, u64::MAX, &jobs).expect("enqueue");
        let first = backend.claim(shard, 10, 600_000).expect("claim");
        assert_eq!(in_order(&first), ["0", "1", "2"], "{shard}");
        assert!(backend.claim(shard, 10, 600_000).expect("claim").is_empty());
        backend.ack(shard, &[first[1].receipt()]).expect("ack");
        let next = backend.claim(shard, 10, 600_000).expect("claim");
        assert_eq!(in_order(&next), ["3"], "{shard}");
        assert_eq!(backend.key_counts(shard, "k").expect("counts").in_flight, 3);
    }
}
