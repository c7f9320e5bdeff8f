//! Two worker processes (two backends, two coordinators) sharing the same
//! Redis shards through the real worker pool; one stops mid-run and the
//! other takes its shards over.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use shardq_core::{ClaimedJob, InspectJobs, PoolOptions, RunJobs, SystemClock, WorkerPool};
use shardq_redis::{CoordinatorOptions, RedisBackend, RedisCoordinator, RedisOptions};
use shardq_route::Router;
use shardq_testkit::redis::RedisServer;

use crate::common::{check_order, init, job, map_of};

const JOBS: u64 = 2_000;
const KEYS: u64 = 40;
const WAIT_MS_MAX: u64 = 30_000;

fn pool(
    backend: RedisBackend,
    name: &str,
    runs: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<shardq_core::PoolReport> {
    let name = name.to_string();
    thread::spawn(move || {
        let mut coord = RedisCoordinator::new(
            &backend,
            CoordinatorOptions {
                owner: Some(name),
                lease_ms: 600,
                shards: None,
                max_shards: 0,
            },
        )
        .unwrap();
        let handler = Arc::new(move |j: &ClaimedJob| {
            runs.lock()
                .unwrap()
                .push(String::from_utf8_lossy(&j.payload).into_owned());
            Ok(())
        });
        WorkerPool::run(
            Arc::new(backend),
            &mut coord,
            handler,
            Arc::new(SystemClock),
            PoolOptions {
                concurrency: 8,
                ..PoolOptions::default()
            },
            &stop,
        )
        .expect("pool run")
    })
}

#[test]
fn two_processes_share_shards_and_take_over() {
    let servers: Vec<RedisServer> = (0..2).map(|_| RedisServer::start()).collect();
    let map = map_of(&[
        ("s0", servers[0].url()),
        ("s1", servers[0].url()),
        ("s2", servers[1].url()),
        ("s3", servers[1].url()),
    ]);
    init(&map);
    let router = Router::new(map.clone()).unwrap();
    let producer = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    let mut expected = BTreeMap::new();
    let mut batches: BTreeMap<String, Vec<_>> = BTreeMap::new();
    for i in 0..JOBS {
        let key = format!("t-{}", i % KEYS);
        *expected.entry(key.clone()).or_insert(0) += 1;
        batches
            .entry(router.route(&key).to_string())
            .or_default()
            .push(job(&key, &format!("{key}/{i}")));
    }
    for (shard, jobs) in &batches {
        for chunk in jobs.chunks(100) {
            producer.enqueue(shard, map.version, chunk).unwrap();
        }
    }

    let runs = Arc::new(Mutex::new(Vec::new()));
    let stop_a = Arc::new(AtomicBool::new(false));
    let stop_b = Arc::new(AtomicBool::new(false));
    let a = pool(
        RedisBackend::open(&map, RedisOptions::default()).unwrap(),
        "host-a@1",
        Arc::clone(&runs),
        Arc::clone(&stop_a),
    );
    let deadline = Instant::now() + Duration::from_millis(WAIT_MS_MAX);
    // B starts once A holds the shards, so B waits in standby.
    while runs.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "A never started");
        thread::sleep(Duration::from_millis(1));
    }
    let b = pool(
        RedisBackend::open(&map, RedisOptions::default()).unwrap(),
        "host-b@2",
        Arc::clone(&runs),
        Arc::clone(&stop_b),
    );
    // Stop A part-way: it releases its leases and B takes them over.
    while runs.lock().unwrap().len() < (JOBS / 4) as usize {
        assert!(Instant::now() < deadline, "no progress");
        thread::sleep(Duration::from_millis(5));
    }
    stop_a.store(true, Ordering::SeqCst);
    let report_a = a.join().unwrap();
    loop {
        let left: u64 = map
            .shards
            .iter()
            .map(|s| {
                let st = producer.shard_stats(&s.name).unwrap();
                st.ready + st.delayed + st.in_flight
            })
            .sum();
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} jobs left after {WAIT_MS_MAX} ms"
        );
        thread::sleep(Duration::from_millis(10));
    }
    stop_b.store(true, Ordering::SeqCst);
    let report_b = b.join().unwrap();
    let runs = runs.lock().unwrap().clone();
    let repeats = check_order(&runs, &expected);
    assert_eq!(repeats, 0, "a clean handover runs nothing twice");
    assert!(report_a.acked > 0, "A ran jobs before stopping");
    assert_eq!(report_a.acked + report_b.acked, JOBS);
}
