//! Full life cycle (enqueue, claim, ack) throughput and enqueue-to-start
//! latency of shardq on Redis, against a plain Redis list queue
//! (LPUSH + LMOVE + LREM) measured in the same run as the floor.
//!
//! Starts its own `redis-server` processes on loopback ports. Run with
//! `cargo bench -p shardq-redis --bench redis_lifecycle`; set
//! `SHARDQ_BENCH_JOBS` to change the job count. This bench must never talk
//! to a server it did not start.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use shardq_core::{Coordinator, NewJob, Receipt, RunJobs};
use shardq_redis::{CoordinatorOptions, RedisBackend, RedisCoordinator, RedisOptions};
use shardq_route::{Algorithm, Router, Shard, ShardMap};
use shardq_testkit::redis::{RedisCluster, RedisServer};

/// Jobs per scenario unless `SHARDQ_BENCH_JOBS` says otherwise.
const JOBS_DEFAULT: u64 = 200_000;
/// Distinct routing keys.
const KEYS: u64 = 1_000;
/// Jobs per enqueue call (and per LPUSH).
const ENQUEUE_BATCH: usize = 200;
/// Most jobs claimed per call (and LMOVEs per pipeline).
const CLAIM_BATCH: usize = 256;
/// Shards in every shardq scenario; consumers per scenario.
const SHARDS: usize = 4;
/// Jobs enqueued but not yet acked before producers wait: keeps latency a
/// measure of the system, not of an ever-growing backlog.
const OUTSTANDING_MAX: u64 = 20_000;
/// Idle sleep of a consumer that found nothing, in µs.
const IDLE_US: u64 = 200;
/// Longest run of one scenario.
const SCENARIO_TIMEOUT_S: u64 = 120;

struct Result {
    name: String,
    jobs: u64,
    secs: f64,
    p50_us: u64,
    p99_us: u64,
}

/// Counters shared by producers and consumers of one scenario.
struct Shared {
    epoch: Instant,
    acked: AtomicU64,
    enqueued: AtomicU64,
    lat_us: Mutex<Vec<u64>>,
    done: AtomicBool,
}

impl Shared {
    fn new() -> Arc<Shared> {
        Arc::new(Shared {
            epoch: Instant::now(),
            acked: AtomicU64::new(0),
            enqueued: AtomicU64::new(0),
            lat_us: Mutex::new(Vec::new()),
            done: AtomicBool::new(false),
        })
    }

    fn stamp(&self) -> [u8; 8] {
        (self.epoch.elapsed().as_micros() as u64).to_le_bytes()
    }

    fn started(&self, payloads: &mut dyn Iterator<Item = &[u8]>, lat: &mut Vec<u64>) {
        let now = self.epoch.elapsed().as_micros() as u64;
        for p in payloads {
            let mut b = [0u8; 8];
            b.copy_from_slice(&p[..8]);
            lat.push(now.saturating_sub(u64::from_le_bytes(b)));
        }
    }

    fn wait_room(&self) {
        while self.enqueued.load(Ordering::Relaxed) - self.acked.load(Ordering::Relaxed)
            > OUTSTANDING_MAX
        {
            thread::sleep(Duration::from_micros(100));
        }
    }
}

fn finish(name: &str, jobs: u64, shared: &Shared, t0: Instant) -> Result {
    let secs = t0.elapsed().as_secs_f64();
    let mut lat = shared.lat_us.lock().unwrap().clone();
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0)
    };
    Result {
        name: name.to_string(),
        jobs,
        secs,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
    }
}

fn plain_list(url: &str, jobs: u64) -> Result {
    let shared = Shared::new();
    let client = redis::Client::open(url).unwrap();
    let t0 = Instant::now();
    let producer = {
        let shared = Arc::clone(&shared);
        let mut con = client.get_connection().unwrap();
        thread::spawn(move || {
            let mut sent = 0u64;
            while sent < jobs {
                shared.wait_room();
                let n = (jobs - sent).min(ENQUEUE_BATCH as u64);
                let mut cmd = redis::cmd("LPUSH");
                cmd.arg("plain:q");
                for i in 0..n {
                    let mut p = shared.stamp().to_vec();
                    p.extend_from_slice(&(sent + i).to_le_bytes());
                    cmd.arg(p);
                }
                let _: u64 = cmd.query(&mut con).unwrap();
                sent += n;
                shared.enqueued.fetch_add(n, Ordering::Relaxed);
            }
        })
    };
    let consumers: Vec<_> = (0..SHARDS)
        .map(|c| {
            let shared = Arc::clone(&shared);
            let mut con = client.get_connection().unwrap();
            thread::spawn(move || {
                let processing = format!("plain:processing:{c}");
                let mut lat = Vec::new();
                while !shared.done.load(Ordering::Relaxed) {
                    let mut pipe = redis::pipe();
                    for _ in 0..CLAIM_BATCH {
                        pipe.cmd("LMOVE")
                            .arg("plain:q")
                            .arg(&processing)
                            .arg("RIGHT")
                            .arg("LEFT");
                    }
                    let got: Vec<Option<Vec<u8>>> = pipe.query(&mut con).unwrap();
                    let got: Vec<Vec<u8>> = got.into_iter().flatten().collect();
                    if got.is_empty() {
                        thread::sleep(Duration::from_micros(IDLE_US));
                        continue;
                    }
                    shared.started(&mut got.iter().map(|p| &p[..]), &mut lat);
                    let mut pipe = redis::pipe();
                    for p in &got {
                        pipe.cmd("LREM").arg(&processing).arg(1).arg(p).ignore();
                    }
                    let _: () = pipe.query(&mut con).unwrap();
                    if shared.acked.fetch_add(got.len() as u64, Ordering::Relaxed)
                        + got.len() as u64
                        >= jobs
                    {
                        shared.done.store(true, Ordering::Relaxed);
                    }
                }
                shared.lat_us.lock().unwrap().extend(lat);
            })
        })
        .collect();
    producer.join().unwrap();
    for c in consumers {
        c.join().unwrap();
    }
    finish("plain list (LPUSH+LMOVE+LREM)", jobs, &shared, t0)
}

fn shardq(name: &str, urls: &[String], jobs: u64) -> Result {
    shardq_keeping(name, urls, jobs, shardq_core::Retention::default())
}

/// [`shardq`] keeping finished jobs for `retention` (0 jobs: no history).
fn shardq_keeping(
    name: &str,
    urls: &[String],
    jobs: u64,
    retention: shardq_core::Retention,
) -> Result {
    shardq_with(name, urls, jobs, retention, None)
}

/// Flow control for [`shardq_with`]: none, or these settings with the
/// group buckets in the first server (as a deployment's map store).
enum Flow {
    Off,
    On(shardq_core::FlowSettings),
}

/// [`shardq_keeping`] asking flow control before each start.
fn shardq_with(
    name: &str,
    urls: &[String],
    jobs: u64,
    retention: shardq_core::Retention,
    flow: Option<Flow>,
) -> Result {
    let (names, router, backend) = open_shards(urls, retention, flow);
    let mut coord = RedisCoordinator::new(
        &backend,
        CoordinatorOptions {
            owner: Some("bench@1".into()),
            lease_ms: 60_000,
            shards: None,
            max_shards: 0,
        },
    )
    .unwrap();
    for s in coord.tick().unwrap().gained {
        backend.adopt(&s).unwrap();
    }
    let shared = Shared::new();
    let t0 = Instant::now();
    let producer = spawn_producer(&shared, &backend, router, jobs);
    let consumers: Vec<_> = names
        .iter()
        .map(|shard| spawn_consumer(&shared, &backend, shard, jobs))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(SCENARIO_TIMEOUT_S);
    while !shared.done.load(Ordering::Relaxed) {
        assert!(Instant::now() < deadline, "{name} timed out");
        thread::sleep(Duration::from_millis(10));
    }
    producer.join().unwrap();
    for c in consumers {
        c.join().unwrap();
    }
    coord.release_all().unwrap();
    finish(name, jobs, &shared, t0)
}

/// A fresh deployment of [`SHARDS`] shards over `urls`: their names, its router and its backend.
fn open_shards(
    urls: &[String],
    retention: shardq_core::Retention,
    flow: Option<Flow>,
) -> (Vec<String>, Router, RedisBackend) {
    let names: Vec<String> = (0..SHARDS).map(|i| format!("b-{i}")).collect();
    let mut map = ShardMap::with_shards(Algorithm::Rendezvous, names.clone()).unwrap();
    for (i, s) in map.shards.iter_mut().enumerate() {
        *s = Shard {
            url: Some(urls[i % urls.len()].clone()),
            ..s.clone()
        };
    }
    let router = Router::new(map.clone()).unwrap();
    let ns = format!("bench{}", std::process::id());
    let dep =
        shardq_redis::init_deployment(&map, &urls[0], Some(&ns), &RedisOptions::default()).unwrap();
    let flow = match flow {
        Some(Flow::On(settings)) => {
            let groups = shardq_redis::RedisMapStore::open_in(
                &urls[0],
                &dep.namespace,
                &RedisOptions::default(),
            )
            .unwrap();
            Some(Arc::new(shardq_core::FlowControl::new(
                settings,
                Arc::new(groups),
            )))
        }
        Some(Flow::Off) | None => None,
    };
    let opts = RedisOptions {
        namespace: dep.namespace,
        deployment: Some(dep.id),
        retention,
        flow,
        ..RedisOptions::default()
    };
    let backend = RedisBackend::open(&map, opts).unwrap();
    (names, router, backend)
}

/// The producer thread: enqueues `jobs` jobs over [`KEYS`] keys, a batch per shard at a time.
fn spawn_producer(
    shared: &Arc<Shared>,
    backend: &RedisBackend,
    router: Router,
    jobs: u64,
) -> thread::JoinHandle<()> {
    let (shared, backend) = (Arc::clone(shared), backend.clone());
    thread::spawn(move || {
        let mut sent = 0u64;
        let mut per: Vec<Vec<NewJob>> = vec![Vec::new(); SHARDS];
        while sent < jobs {
            shared.wait_room();
            let n = (jobs - sent).min((ENQUEUE_BATCH * SHARDS) as u64);
            for i in 0..n {
                let key = format!("key-{}", (sent + i) % KEYS);
                let shard = router.route_index(key.as_bytes());
                per[shard].push(NewJob::new(key, shared.stamp().to_vec()));
            }
            for (s, batch) in per.iter_mut().enumerate() {
                if !batch.is_empty() {
                    backend.enqueue(&format!("b-{s}"), 1, batch).unwrap();
                    shared
                        .enqueued
                        .fetch_add(batch.len() as u64, Ordering::Relaxed);
                    batch.clear();
                }
            }
            sent += n;
        }
    })
}

/// One consumer thread on `shard`: claims and acks until `jobs` jobs are acked in all.
fn spawn_consumer(
    shared: &Arc<Shared>,
    backend: &RedisBackend,
    shard: &str,
    jobs: u64,
) -> thread::JoinHandle<()> {
    let (shared, backend, shard) = (Arc::clone(shared), backend.clone(), shard.to_string());
    thread::spawn(move || {
        let mut lat = Vec::new();
        while !shared.done.load(Ordering::Relaxed) {
            let got = backend
                .claim(&shard, CLAIM_BATCH, shardq_core::JOB_LEASE_MS_DEFAULT)
                .unwrap();
            if got.is_empty() {
                thread::sleep(Duration::from_micros(IDLE_US));
                continue;
            }
            shared.started(&mut got.iter().map(|j| &j.payload[..]), &mut lat);
            let ids: Vec<Receipt> = got.iter().map(|j| j.receipt()).collect();
            backend.ack(&shard, &ids).unwrap();
            if shared.acked.fetch_add(ids.len() as u64, Ordering::Relaxed) + ids.len() as u64
                >= jobs
            {
                shared.done.store(true, Ordering::Relaxed);
            }
        }
        shared.lat_us.lock().unwrap().extend(lat);
    })
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` would too, but
    // this bench is only built, never run, by the test suite.
    let jobs = std::env::var("SHARDQ_BENCH_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(JOBS_DEFAULT);
    if std::env::var_os("SHARDQ_BENCH_FLOW").is_some() {
        flow_cost(jobs);
        return;
    }
    let mut results = Vec::new();
    {
        let server = RedisServer::start();
        results.push(plain_list(&server.url(), jobs));
    }
    {
        // The same without the finished jobs (the `finished` list).
        let server = RedisServer::start();
        results.push(shardq_keeping(
            "shardq, 1 instance (4 shards), no history",
            &[server.url()],
            jobs,
            shardq_core::Retention {
                finished_jobs: 0,
                ..shardq_core::Retention::default()
            },
        ));
    }
    {
        let server = RedisServer::start();
        results.push(shardq(
            "shardq, 1 instance (4 shards)",
            &[server.url()],
            jobs,
        ));
        if std::env::var_os("SHARDQ_BENCH_STATS").is_some() {
            // Server-side cost per script call, to see where time goes.
            let stats = server.cli(&["info", "commandstats"]);
            for line in stats.lines().filter(|l| l.contains("eval")) {
                eprintln!("{line}");
            }
            eprintln!("{}", server.cli(&["info", "cpu"]));
        }
    }
    {
        let servers: Vec<RedisServer> = (0..SHARDS).map(|_| RedisServer::start()).collect();
        let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
        results.push(shardq("shardq, 4 instances (1 shard each)", &urls, jobs));
    }
    {
        let cluster = RedisCluster::start(3);
        results.push(shardq(
            "shardq, 3-master cluster (4 shards)",
            &[cluster.url()],
            jobs,
        ));
    }
    let floor = results[0].jobs as f64 / results[0].secs;
    println!("| system | jobs | jobs/s | vs plain list | enqueue-to-start p50 | p99 |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &results {
        let rate = r.jobs as f64 / r.secs;
        println!(
            "| {} | {} | {:.0} | {:.2}x | {:.2} ms | {:.2} ms |",
            r.name,
            r.jobs,
            rate,
            rate / floor,
            r.p50_us as f64 / 1000.0,
            r.p99_us as f64 / 1000.0
        );
    }
}

/// `SHARDQ_BENCH_FLOW=1`: the life cycle on one instance (4 shards)
/// without flow control, with it and no policy, with a rate limit on every
/// key (never reached: the cost is the buckets), and with every key in one
/// group (never reached: one script on the map store per start), and with
/// a weight on every key (each claim ranks the ready keys first), and with
/// every key at concurrency 4 (the claim script resolves limits), alternated
/// twice, each on a fresh server; the mean of the two.
fn flow_cost(jobs: u64) {
    use shardq_core::flow::{FlowPolicy, FlowSettings, GroupLimit, Rate};
    let high = Rate {
        count: 1_000_000,
        per_ms: 1_000,
    };
    let every = |p: FlowPolicy| {
        let mut f = FlowSettings {
            default: p,
            ..FlowSettings::default()
        };
        f.groups.insert(
            "all".into(),
            GroupLimit {
                rate: Some(high),
                burst: Some(1_000_000),
                concurrency: None,
            },
        );
        f
    };
    let names = [
        "no flow control",
        "flow control, no policy",
        "a rate limit on every key",
        "every key in one group",
        "a weight on every key (ranked claims)",
        "every key at concurrency 4",
    ];
    let case = |i: usize| match i {
        0 => Flow::Off,
        1 => Flow::On(FlowSettings::default()),
        2 => Flow::On(every(FlowPolicy {
            rate: Some(high),
            burst: Some(1_000_000),
            ..FlowPolicy::default()
        })),
        3 => Flow::On(every(FlowPolicy {
            group: Some("all".into()),
            ..FlowPolicy::default()
        })),
        4 => Flow::On(every(FlowPolicy {
            weight: 2,
            ..FlowPolicy::default()
        })),
        _ => Flow::On(every(FlowPolicy {
            concurrency: 4,
            ..FlowPolicy::default()
        })),
    };
    let mut rates = vec![Vec::new(); names.len()];
    for _ in 0..2 {
        for (i, name) in names.iter().enumerate() {
            let server = RedisServer::start();
            let r = shardq_with(
                name,
                &[server.url()],
                jobs,
                shardq_core::Retention::default(),
                Some(case(i)),
            );
            rates[i].push(r.jobs as f64 / r.secs);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let base = mean(&rates[0]);
    println!("| flow control (1 instance, 4 shards) | jobs/s | of none |");
    println!("|---|---:|---:|");
    for (name, r) in names.iter().zip(&rates) {
        println!("| {name} | {:.0} | {:.2} |", mean(r), mean(r) / base);
    }
}
