//! A Redis server with `appendonly yes` / `appendfsync always` killed with
//! SIGKILL and restarted on the same port while producers and a worker run:
//! clients reconnect within their bounded retries, and no enqueue that was
//! acknowledged is lost.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use shardq_core::{Receipt, RunJobs};
use shardq_redis::{RedisBackend, RedisOptions};
use shardq_testkit::redis::{RedisServer, ServerOptions};

use crate::common::{check_order, init, job, map_of, owner};

const BATCHES: u64 = 300;
const BATCH: u64 = 10;
const KEYS: u64 = 16;
const WAIT_MS_MAX: u64 = 60_000;

#[test]
fn sigkill_and_restart_loses_no_acknowledged_enqueue() {
    let mut server = RedisServer::start_with(ServerOptions {
        aof_always: true,
        ..ServerOptions::default()
    });
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let produced = Arc::new(AtomicBool::new(false));

    let producer = {
        let b = RedisBackend::open(&map, RedisOptions::default()).unwrap();
        let acked = Arc::clone(&acked);
        let produced = Arc::clone(&produced);
        thread::spawn(move || {
            let mut seq = 0u64;
            for _ in 0..BATCHES {
                let jobs: Vec<_> = (0..BATCH)
                    .map(|_| {
                        seq += 1;
                        let key = format!("k{}", seq % KEYS);
                        job(&key, &format!("{key}/{seq}"))
                    })
                    .collect();
                // Only an enqueue that returned Ok counts as acknowledged.
                if b.enqueue("r0", 1, &jobs).is_ok() {
                    let mut a = acked.lock().unwrap();
                    a.extend(
                        jobs.iter()
                            .map(|j| String::from_utf8_lossy(&j.payload).into_owned()),
                    );
                }
                thread::sleep(Duration::from_micros(500));
            }
            produced.store(true, Ordering::SeqCst);
        })
    };

    let worker = {
        let b = RedisBackend::open(&map, RedisOptions::default()).unwrap();
        let runs = Arc::clone(&runs);
        let produced = Arc::clone(&produced);
        thread::spawn(move || {
            let mut c = owner(&b, "worker@1", 2_000);
            let deadline = Instant::now() + Duration::from_millis(WAIT_MS_MAX);
            let mut idle_after_produced = 0;
            let mut next_tick = Instant::now();
            while Instant::now() < deadline {
                if Instant::now() >= next_tick {
                    c_tick(&b, &mut c);
                    next_tick = Instant::now() + Duration::from_millis(200);
                }
                match b.claim("r0", 64, shardq_core::JOB_LEASE_MS_DEFAULT) {
                    Ok(jobs) if !jobs.is_empty() => {
                        idle_after_produced = 0;
                        let ids: Vec<Receipt> = jobs.iter().map(|j| j.receipt()).collect();
                        runs.lock().unwrap().extend(
                            jobs.iter()
                                .map(|j| String::from_utf8_lossy(&j.payload).into_owned()),
                        );
                        let _ = b.ack("r0", &ids);
                    }
                    _ => {
                        if produced.load(Ordering::SeqCst) {
                            idle_after_produced += 1;
                            if idle_after_produced > 50 {
                                return;
                            }
                        }
                        thread::sleep(Duration::from_millis(2));
                    }
                }
            }
        })
    };

    // Let load build up, then crash the server mid-stream.
    while (acked.lock().unwrap().len() as u64) < BATCHES * BATCH / 3 {
        thread::sleep(Duration::from_millis(2));
    }
    server.kill();
    thread::sleep(Duration::from_millis(300));
    server.restart();
    producer.join().unwrap();
    worker.join().unwrap();

    let acked = acked.lock().unwrap().clone();
    assert!(
        acked.len() as u64 >= BATCHES * BATCH * 9 / 10,
        "most enqueues succeed: {}",
        acked.len()
    );
    let runs = runs.lock().unwrap().clone();
    // Every acknowledged job ran, in key order; a job whose enqueue was
    // retried after a lost reply may run twice (at least once).
    check_order(&runs, &BTreeMap::new());
    let ran: BTreeSet<&String> = runs.iter().collect();
    let lost: Vec<&String> = acked.iter().filter(|p| !ran.contains(p)).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged jobs lost, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
}

fn c_tick(b: &RedisBackend, c: &mut shardq_redis::RedisCoordinator) {
    // The server may be down: a failed tick is retried on the next round.
    if let Ok(own) = shardq_core::Coordinator::tick(c) {
        for s in &own.gained {
            let _ = b.adopt(s);
        }
    }
}
