//! Flow policies on Redis claims: the shard's copy of the run limits
//! (`limits`) follows a policy change in every worker within a second, and
//! many policies cost a claim nothing for the keys they do not match.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardq_core::flow::{FlowPolicy, FlowSettings, FLOW_RECHECK_MS, FLOW_RULES_MAX};
use shardq_core::{ClaimedJob, FlowControl, ManualClock, RunJobs};
use shardq_redis::{CoordinatorOptions, RedisBackend, RedisCoordinator, RedisOptions};
use shardq_testkit::redis::RedisServer;
use shardq_testkit::wait_until;

use crate::common::{init, job, map_of, tick_adopt};

fn conc(n: u32) -> FlowPolicy {
    FlowPolicy {
        concurrency: n,
        ..FlowPolicy::default()
    }
}

/// A coordinator of `backend` that takes part in `shard` only.
fn owner_of(backend: &RedisBackend, name: &str, shard: &str) -> RedisCoordinator {
    let mut c = RedisCoordinator::new(
        backend,
        CoordinatorOptions {
            owner: Some(name.to_string()),
            lease_ms: 600_000,
            shards: Some(vec![shard.to_string()]),
            max_shards: 0,
        },
    )
    .expect("coordinator");
    assert_eq!(tick_adopt(backend, &mut c), [shard.to_string()]);
    c
}

/// Two worker processes (a backend each, the server's clock, each its own
/// flow control reading the one stored settings every second), each
/// claiming its own shard every 20 ms while a key there holds two runs at
/// its concurrency of 2. The stored settings change its policy to 5 (among
/// 1,000 other prefix policies): both workers start its next three jobs
/// within a second and a half of the change (a second between reads of the
/// settings, and a claim), and neither ever has more than the limit it
/// was under. Then back to 2: nothing new starts while it holds 5.
#[test]
fn a_policy_change_reaches_every_workers_claims_within_a_second() {
    let server = RedisServer::start();
    let map = map_of(&[("w0", server.url()), ("w1", server.url())]);
    init(&map);
    let stored = Arc::new(Mutex::new(FlowSettings::default()));
    let set_hot = |n: u32| {
        let mut s = FlowSettings::default();
        for i in 0..1_000 {
            s.prefixes.insert(format!("cold-{i}:"), conc(3));
        }
        s.prefixes.insert("hot:".into(), conc(n));
        *stored.lock().unwrap() = s;
    };
    set_hot(2);
    let worker = |name: &str, shard: &str| {
        let source = {
            let stored = Arc::clone(&stored);
            Box::new(move || Ok(Some(stored.lock().unwrap().clone())))
                as shardq_core::flow::FlowSource
        };
        let groups = shardq_redis::RedisMapStore::open(&server.url()).expect("map store");
        let first = stored.lock().unwrap().clone();
        let flow = FlowControl::new(first, Arc::new(groups)).with_source(source);
        let opts = RedisOptions {
            flow: Some(Arc::new(flow)),
            ..RedisOptions::default()
        };
        let b = RedisBackend::open(&map, opts).expect("open");
        let c = owner_of(&b, name, shard);
        let jobs: Vec<_> = (0..10).map(|i| job("hot:k", &i.to_string())).collect();
        b.enqueue(shard, 1, &jobs).expect("enqueue");
        (b, c)
    };
    let (b0, _c0) = worker("w0", "w0");
    let (b1, _c1) = worker("w1", "w1");
    // Runs held per worker, and when it first held 5.
    let limit = Arc::new(Mutex::new(2usize));
    let stop = Arc::new(AtomicBool::new(false));
    let holding = [Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0))];
    let run = |b: RedisBackend, shard: &'static str, holding: &Arc<AtomicUsize>| {
        let limit = Arc::clone(&limit);
        let stop = Arc::clone(&stop);
        let holding = Arc::clone(holding);
        std::thread::spawn(move || {
            let mut held: Vec<ClaimedJob> = Vec::new();
            let mut five_at = None;
            while !stop.load(Ordering::SeqCst) {
                let allowed = *limit.lock().unwrap();
                held.extend(b.claim(shard, 10, 600_000).expect("claim"));
                assert!(
                    held.len() <= allowed,
                    "{shard}: {} runs of a key limited to {allowed}",
                    held.len()
                );
                holding.store(held.len(), Ordering::SeqCst);
                if held.len() == 5 && five_at.is_none() {
                    five_at = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let payloads: Vec<String> = (held.iter())
                .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
                .collect();
            (payloads, five_at)
        })
    };
    let t0 = run(b0, "w0", &holding[0]);
    let t1 = run(b1, "w1", &holding[1]);
    // Both hold n runs (or a worker thread ended: its join says why).
    let hold = |n: usize| {
        wait_until(
            &format!("both workers to hold {n} runs"),
            Duration::from_secs(30),
            || {
                holding.iter().all(|h| h.load(Ordering::SeqCst) >= n)
                    || t0.is_finished()
                    || t1.is_finished()
            },
        )
    };
    hold(2);
    // A negative check: no third run may start through a read of the
    // settings (every FLOW_RECHECK_MS).
    std::thread::sleep(Duration::from_millis(FLOW_RECHECK_MS + 500));
    // Raised: the limit the checks allow goes up first.
    *limit.lock().unwrap() = 5;
    let changed = Instant::now();
    set_hot(5);
    hold(5);
    // Lowered while 5 run: no claim may start any more.
    set_hot(2);
    // A negative check: no sixth run may start through a read of the
    // settings (every FLOW_RECHECK_MS).
    std::thread::sleep(Duration::from_millis(FLOW_RECHECK_MS + 500));
    stop.store(true, Ordering::SeqCst);
    for (shard, t) in [("w0", t0), ("w1", t1)] {
        let (payloads, five_at) = t.join().expect("worker thread");
        assert_eq!(
            payloads,
            ["0", "1", "2", "3", "4"],
            "{shard}: the key's first five jobs, in order"
        );
        let took = five_at.expect("five runs").duration_since(changed);
        assert!(
            took <= Duration::from_millis(FLOW_RECHECK_MS + 500),
            "{shard}: the raised limit took {took:?}"
        );
    }
}

/// 10,000 prefix policies (the most there may be), at 2, 3 or 4 runs at
/// once, on a shard with 200 keys that match none and three that match one:
/// one claim starts every unmatched key's first job (the default, one at
/// a time) and exactly its prefix's limit of each matched key. Claims of
/// unmatched keys then cost what they cost without the policies: the
/// claim script reads each key's entries, never the list of policies, and
/// no claim carries the policies. Checked by what reaches the server
/// (`total_net_input_bytes`), not by time: the build that passed every
/// policy in every claim sent about 100 KB a claim here (and took 39 ms
/// for an ack and a claim of 20 keys; this one 1.3 ms, debug builds).
#[test]
fn ten_thousand_prefix_policies_limit_only_the_keys_they_match() {
    let server = RedisServer::start();
    let map = map_of(&[("p0", server.url())]);
    init(&map);
    let clock = ManualClock::new(1_700_000_000_000);
    let mut settings = FlowSettings::default();
    for i in 0..FLOW_RULES_MAX {
        settings
            .prefixes
            .insert(format!("p{i}:"), conc(2 + (i % 3) as u32));
    }
    settings.validate().expect("10,000 policies are allowed");
    let opts = crate::common::opts_with_flow(&clock, settings.clone(), &server.url());
    let b = RedisBackend::open(&map, opts).expect("open");
    let _owner = crate::common::owner(&b, "prefixes", 600_000);
    let matched = ["p0:a", "p1:b", "p9998:c"];
    let free: Vec<String> = (0..200).map(|i| format!("free-{i}")).collect();
    for k in matched
        .iter()
        .copied()
        .chain(free.iter().map(String::as_str))
    {
        let jobs: Vec<_> = (0..6).map(|i| job(k, &i.to_string())).collect();
        b.enqueue("p0", 1, &jobs).expect("enqueue");
    }
    let runs = b.claim("p0", 1_000, 600_000).expect("claim");
    let started = |k: &str| -> Vec<String> {
        (runs.iter())
            .filter(|r| r.key == k)
            .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
            .collect()
    };
    for k in &free {
        assert_eq!(started(k), ["0"], "{k} matches no policy");
    }
    for (k, want) in [("p0:a", 2), ("p1:b", 3), ("p9998:c", 4)] {
        assert_eq!(settings.for_key(k).concurrency, want);
        let first: Vec<String> = (0..want).map(|i| i.to_string()).collect();
        assert_eq!(started(k), first, "{k}: its prefix's limit");
    }
    assert!(
        b.claim("p0", 1_000, 600_000).expect("claim").is_empty(),
        "every key is at its limit"
    );
    // Claims of unmatched keys, 20 at a time: each ends a run of 20 keys
    // and starts their next jobs.
    let mut held: Vec<ClaimedJob> = (runs.iter())
        .filter(|r| r.key.starts_with("free-"))
        .cloned()
        .collect();
    let net_in = || -> u64 {
        let mut con = redis::Client::open(server.url().as_str())
            .unwrap()
            .get_connection()
            .unwrap();
        let info: String = redis::cmd("INFO").arg("stats").query(&mut con).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("total_net_input_bytes:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("INFO stats has total_net_input_bytes")
    };
    let before = net_in();
    let mut claims = 0u32;
    while held.len() >= 20 && claims < 40 {
        let done: Vec<ClaimedJob> = held.drain(..20).collect();
        let receipts: Vec<_> = done.iter().map(|r| r.receipt()).collect();
        b.ack("p0", &receipts).expect("ack");
        let next = b.claim("p0", 20, 600_000).expect("claim");
        assert_eq!(next.len(), 20, "the freed keys start their next jobs");
        assert!(next.iter().all(|r| r.key.starts_with("free-")));
        held.extend(next);
        claims += 1;
    }
    let per_claim = (net_in() - before) / u64::from(claims);
    assert!(
        per_claim < 8 * 1024,
        "an ack and a claim of 20 unmatched keys sent {per_claim} bytes to Redis beside 10,000 policies"
    );
}
