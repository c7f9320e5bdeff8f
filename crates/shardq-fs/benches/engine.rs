//! Embedded engine benchmark (a plain binary, `harness = false`):
//! `cargo bench -p shardq-fs --bench engine [-- --jobs N]`.
//!
//! Measures, with 100-byte payloads: batched enqueue without fsync (against
//! a raw file append of the same bytes as baseline), the full life cycle
//! enqueue + claim + ack in one process, durable group commit with 8
//! producer threads, reopening a shard with N pending jobs, and memory per
//! pending job. Prints one line per figure and a JSON summary.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use shardq_core::flow::{FlowControl, FlowPolicy, FlowSettings, LocalGroupBuckets, Rate};
use shardq_core::{InspectJobs, NewJob, Receipt, RunJobs, JOB_LEASE_MS_DEFAULT};
use shardq_fs::{Durability, Engine, EngineOptions};
use shardq_route::{Algorithm, ShardMap};

const PAYLOAD_BYTES: usize = 100;
const KEYS: usize = 1000;
const BATCH: usize = 1000;

fn fresh(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardq-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let map = ShardMap::with_shards(Algorithm::Rendezvous, ["shard-0"]).unwrap();
    Engine::init(&dir, &map).unwrap();
    dir
}

fn opts(d: Durability) -> EngineOptions {
    EngineOptions {
        durability: d,
        ..EngineOptions::default()
    }
}

fn batch(start: usize) -> Vec<NewJob> {
    (start..start + BATCH)
        .map(|i| NewJob::new(format!("key-{}", i % KEYS), vec![b'x'; PAYLOAD_BYTES]))
        .collect()
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Enqueue, claim and ack `cycle_jobs` jobs of 1000 keys in one process,
/// keeping `keep` finished jobs and asking `flow`; jobs per second.
fn run_cycle_with(
    cycle_jobs: usize,
    name: &str,
    keep: usize,
    flow: Option<Arc<FlowControl>>,
) -> f64 {
    let dir = fresh(name);
    let mut o = opts(Durability::None);
    o.retention.finished_jobs = keep;
    o.flow = flow;
    let engine = Engine::open(&dir, o).unwrap();
    let b = engine.backend();
    b.adopt("shard-0").unwrap();
    let t = Instant::now();
    let mut done = 0;
    let mut next = 0;
    let one = batch(0);
    while done < cycle_jobs {
        if next < cycle_jobs {
            b.enqueue("shard-0", 1, &one).unwrap();
            next += BATCH;
        }
        let claimed = b.claim("shard-0", 1024, JOB_LEASE_MS_DEFAULT).unwrap();
        let ids: Vec<Receipt> = claimed.iter().map(|c| c.receipt()).collect();
        b.ack("shard-0", &ids).unwrap();
        done += ids.len();
    }
    let rate = cycle_jobs as f64 / t.elapsed().as_secs_f64();
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
    rate
}

/// The JSON summary printed at the end: one figure per name.
type Summary = serde_json::Map<String, serde_json::Value>;

/// Runs every group in turn, then prints the JSON summary.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let jobs: usize = args
        .iter()
        .position(|a| a == "--jobs")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let mut summary = Summary::new();
    let raw = bench_raw_append(jobs, &mut summary);
    let dir = bench_enqueue(jobs, raw, &mut summary);
    bench_reopen(&dir, jobs, &mut summary);
    let cycle_jobs = jobs / 2;
    bench_lifecycle(cycle_jobs, &mut summary);
    bench_flow_control(cycle_jobs, &mut summary);
    bench_durable(jobs, &mut summary);
    bench_worker_pool(jobs, &mut summary);
    println!("{}", serde_json::Value::Object(summary));
}

/// Baseline: the same record bytes appended to a plain file; jobs per second.
fn bench_raw_append(jobs: usize, summary: &mut Summary) -> f64 {
    let dir = fresh("raw");
    let sample = {
        let mut b = Vec::new();
        for j in batch(0) {
            shardq_fs::record::encode(
                &mut b,
                &shardq_fs::record::Record::Enqueue {
                    created_ms: 0,
                    not_before_ms: 0,
                    max_attempts: 5,
                    key: &j.key,
                    dedup: None,
                    payload: &j.payload,
                },
            );
        }
        b
    };
    let mut f = std::fs::File::create(dir.join("raw")).unwrap();
    let t = Instant::now();
    for _ in 0..jobs / BATCH {
        f.write_all(&sample).unwrap();
    }
    let raw = jobs as f64 / t.elapsed().as_secs_f64();
    drop(f);
    let _ = std::fs::remove_dir_all(&dir);
    println!("baseline raw append (same bytes):        {raw:>12.0} jobs/s");
    summary.insert("raw_append_jobs_per_s".into(), raw.round().into());
    raw
}

/// 1. Batched enqueue, durability none; returns the data dir, `jobs` pending.
fn bench_enqueue(jobs: usize, raw: f64, summary: &mut Summary) -> PathBuf {
    let dir = fresh("enqueue");
    let engine = Engine::open(&dir, opts(Durability::None)).unwrap();
    let b = engine.backend();
    // One batch, sent again and again: keeps the bench's own memory small so
    // the RSS figure below is the engine's.
    let one = batch(0);
    let t = Instant::now();
    for _ in 0..jobs / BATCH {
        b.enqueue("shard-0", 1, &one).unwrap();
    }
    let enq = jobs as f64 / t.elapsed().as_secs_f64();
    println!(
        "enqueue, batches of {BATCH}, durability none: {enq:>12.0} jobs/s ({:.2}x raw append)",
        enq / raw
    );
    summary.insert("enqueue_none_jobs_per_s".into(), enq.round().into());
    drop(engine);
    dir
}

/// 4 + 5. Reopen with `jobs` pending, memory per pending job, and reads on that shard.
fn bench_reopen(dir: &Path, jobs: usize, summary: &mut Summary) {
    let rss0 = rss_bytes();
    let t = Instant::now();
    let engine = Engine::open(dir, opts(Durability::None)).unwrap();
    let st = engine.status().unwrap();
    let reopen = t.elapsed().as_secs_f64();
    assert_eq!(st.totals.ready as usize, jobs);
    let per_job = (rss_bytes().saturating_sub(rss0)) as f64 / jobs as f64;
    println!("reopen + replay with {jobs} pending:     {reopen:>12.3} s");
    println!("memory per pending job (RSS delta):      {per_job:>12.1} bytes ({KEYS} keys)");
    summary.insert("reopen_s".into(), reopen.into());
    summary.insert("pending_jobs".into(), jobs.into());
    summary.insert(
        "memory_bytes_per_pending_job".into(),
        per_job.round().into(),
    );
    // 5b. Reads on that shard cost what they return: a key's first job
    // against its first 10,000 (the most one read returns), and a job
    // looked up by an id that names none (a finished one, say), which once
    // walked every key's queue.
    let b = engine.backend();
    let reads = 200u32;
    let time = |f: &dyn Fn()| {
        let t = Instant::now();
        for _ in 0..reads {
            f();
        }
        t.elapsed().as_secs_f64() * 1e6 / f64::from(reads)
    };
    let first = time(&|| assert_eq!(b.key_jobs("shard-0", "key-7", 1).unwrap().len(), 1));
    let page = time(&|| {
        let max = shardq_core::job::KEY_JOBS_MAX;
        assert!(!b.key_jobs("shard-0", "key-7", max).unwrap().is_empty());
    });
    let unknown = time(&|| {
        assert!(b
            .job("shard-0", shardq_core::JobId(u64::MAX / 2))
            .unwrap()
            .is_none())
    });
    println!(
        "a key's first job:                       {first:>12.1} us ({:.0}x less than its first {})",
        page / first,
        shardq_core::job::KEY_JOBS_MAX
    );
    println!(
        "a job by an id that names none:         {unknown:>12.1} us ({jobs} jobs, {KEYS} keys)"
    );
    summary.insert("key_first_job_us".into(), first.into());
    summary.insert("key_jobs_page_us".into(), page.into());
    summary.insert("unknown_job_lookup_us".into(), unknown.into());
    drop(engine);
    let _ = std::fs::remove_dir_all(dir);
}

/// 2. Full life cycle in one process, with and without the finished jobs' history.
fn bench_lifecycle(cycle_jobs: usize, summary: &mut Summary) {
    // With the finished jobs' history kept (the default retention) and
    // with it off (`finished_jobs: 0`), alternated three times each so
    // both see the same machine.
    let run_cycle = |keep: usize, round: usize| -> f64 {
        run_cycle_with(cycle_jobs, &format!("cycle-{keep}-{round}"), keep, None)
    };
    let (mut kept, mut off) = (Vec::new(), Vec::new());
    for round in 0..3 {
        kept.push(run_cycle(shardq_core::FINISHED_JOBS_KEPT_DEFAULT, round));
        off.push(run_cycle(0, round));
    }
    let (cycle, cycle_off) = (median(&mut kept), median(&mut off));
    println!("life cycle enqueue+claim+ack, in-process: {cycle:>11.0} jobs/s (finished jobs kept)");
    println!(
        "  the same, no history kept:              {cycle_off:>11.0} jobs/s (kept/off {:.2})",
        cycle / cycle_off
    );
    summary.insert("lifecycle_jobs_per_s".into(), cycle.round().into());
    summary.insert(
        "lifecycle_no_history_jobs_per_s".into(),
        cycle_off.round().into(),
    );
}

/// Flow settings whose default policy, `p`, applies to every key.
fn every_key(p: FlowPolicy) -> FlowSettings {
    FlowSettings {
        default: p,
        ..FlowSettings::default()
    }
}

/// A weight on every key: flow control ranks the ready keys.
fn weighted() -> FlowSettings {
    every_key(FlowPolicy {
        weight: 2,
        ..FlowPolicy::default()
    })
}

/// 2b. The cost of flow control on the same life cycle, per kind of policy.
fn bench_flow_control(cycle_jobs: usize, summary: &mut Summary) {
    // No flow control at all (as before it existed), flow control with no
    // policy (what every deployment runs now), a rate limit on every key
    // (high enough never to hold one back: the cost is the buckets),
    // weights on every key (ready keys ranked by FairQueue), and every key
    // at concurrency 4 (a key's next jobs picked past its running ones).
    // Alternated five times, medians.
    let flow = |f: Option<FlowSettings>| {
        f.map(|s| Arc::new(FlowControl::new(s, Arc::new(LocalGroupBuckets::default()))))
    };
    let rated = every_key(FlowPolicy {
        rate: Some(Rate {
            count: 1_000_000,
            per_ms: 1_000,
        }),
        burst: Some(1_000_000),
        ..FlowPolicy::default()
    });
    let weighted = weighted();
    let several = every_key(FlowPolicy {
        concurrency: 4,
        ..FlowPolicy::default()
    });
    let mut rates: [Vec<f64>; 5] = Default::default();
    for round in 0..5 {
        let keep = shardq_core::FINISHED_JOBS_KEPT_DEFAULT;
        let cases = [
            None,
            flow(Some(FlowSettings::default())),
            flow(Some(rated.clone())),
            flow(Some(weighted.clone())),
            flow(Some(several.clone())),
        ];
        for (i, f) in cases.into_iter().enumerate() {
            rates[i].push(run_cycle_with(
                cycle_jobs,
                &format!("flow-{i}-{round}"),
                keep,
                f,
            ));
        }
    }
    let [none, empty, rate_all, weight_all, conc_all] = rates.map(|mut v| median(&mut v));
    println!("life cycle without flow control:          {none:>11.0} jobs/s");
    println!(
        "  flow control, no policy:                {empty:>11.0} jobs/s ({:.2} of none)",
        empty / none
    );
    println!(
        "  a rate limit on every key:              {rate_all:>11.0} jobs/s ({:.2} of none)",
        rate_all / none
    );
    println!(
        "  a weight on every key (ranked):         {weight_all:>11.0} jobs/s ({:.2} of none)",
        weight_all / none
    );
    println!(
        "  every key at concurrency 4:             {conc_all:>11.0} jobs/s ({:.2} of none)",
        conc_all / none
    );
    for (name, v) in [
        ("lifecycle_no_flow_jobs_per_s", none),
        ("lifecycle_flow_no_policy_jobs_per_s", empty),
        ("lifecycle_rate_every_key_jobs_per_s", rate_all),
        ("lifecycle_weight_every_key_jobs_per_s", weight_all),
        ("lifecycle_concurrency_4_every_key_jobs_per_s", conc_all),
    ] {
        summary.insert(name.into(), v.round().into());
    }
}

/// 3. Durable group commit: 8 producer threads, fsync per call.
fn bench_durable(jobs: usize, summary: &mut Summary) {
    let dir = fresh("durable");
    let engine = Arc::new(Engine::open(&dir, opts(Durability::Fsync)).unwrap());
    let per_call = 100;
    let calls = (jobs / 10 / 8 / per_call).max(1);
    let t = Instant::now();
    let handles: Vec<_> = (0..8)
        .map(|p| {
            let e = Arc::clone(&engine);
            std::thread::spawn(move || {
                let b = e.backend();
                for c in 0..calls {
                    let jb: Vec<NewJob> = (0..per_call)
                        .map(|i| {
                            NewJob::new(
                                format!("p{p}-{}", (c * per_call + i) % KEYS),
                                vec![b'x'; PAYLOAD_BYTES],
                            )
                        })
                        .collect();
                    b.enqueue("shard-0", 1, &jb).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let durable = (8 * calls * per_call) as f64 / t.elapsed().as_secs_f64();
    println!("durable (fsync) 8 producers x {per_call}/call:  {durable:>11.0} jobs/s");
    summary.insert(
        "durable_8_producers_jobs_per_s".into(),
        durable.round().into(),
    );
    summary.insert("durable_jobs_per_call".into(), per_call.into());
    let _ = std::fs::remove_dir_all(&dir);
}

/// 6. The worker path: a WorkerPool with synced and deferred acks, then ranked keys.
fn bench_worker_pool(jobs: usize, summary: &mut Summary) {
    // WorkerPool at concurrency 8 over 4 shards, a no-op handler, on jobs
    // enqueued with fsync; run records fsynced within
    // `run_record_sync_ms` (the default) against the same run with every
    // claim and ack fsynced before it returns (the baseline).
    let pool_jobs = (jobs / 5).max(10_000);
    let mut rates = Vec::new();
    for (label, sync_ms) in [("sync acks (baseline)", 0u64), ("acks within 50 ms", 50)] {
        let rate = worker_pool_rate(pool_jobs, sync_ms);
        println!("WorkerPool c=8, 4 shards, {label}: {rate:>11.0} jobs/s");
        rates.push(rate);
    }
    println!(
        "WorkerPool: deferred run-record fsync is {:.1}x the synchronous baseline",
        rates[1] / rates[0]
    );
    summary.insert("pool_sync_acks_jobs_per_s".into(), rates[0].round().into());
    summary.insert("pool_jobs_per_s".into(), rates[1].round().into());
    // 6b. The same pool with a weight on every key: flow control ranks the
    // ready keys, and the pool claims for each slot that frees instead of
    // a concurrency's worth ahead (alternated with the unranked pool).
    let (mut plain, mut ranked) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        plain.push(worker_pool_rate_with(pool_jobs, 50, None));
        ranked.push(worker_pool_rate_with(pool_jobs, 50, Some(weighted())));
    }
    let (plain, ranked) = (median(&mut plain), median(&mut ranked));
    println!("WorkerPool c=8, 4 shards, no policy:      {plain:>11.0} jobs/s");
    println!(
        "WorkerPool c=8, 4 shards, weights (ranked): {ranked:>11.0} jobs/s ({:.2} of no policy)",
        ranked / plain
    );
    summary.insert("pool_ranked_jobs_per_s".into(), ranked.round().into());
    summary.insert("pool_ranked_of_plain".into(), (ranked / plain).into());
}

/// Jobs per second of a WorkerPool (concurrency 8, 4 shards, no-op handler)
/// draining `n` jobs enqueued with fsync, run records synced within
/// `sync_ms` (0: before each call returns).
fn worker_pool_rate(n: usize, sync_ms: u64) -> f64 {
    worker_pool_rate_with(n, sync_ms, None)
}

/// [`worker_pool_rate`] with flow control asking `flow` (none: no flow
/// control at all).
fn worker_pool_rate_with(n: usize, sync_ms: u64, flow: Option<FlowSettings>) -> f64 {
    use shardq_core::PoolOptions;
    use std::sync::atomic::AtomicBool;
    let dir = std::env::temp_dir().join(format!(
        "shardq-bench-pool-{sync_ms}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let names = ["shard-0", "shard-1", "shard-2", "shard-3"];
    let map = ShardMap::with_shards(Algorithm::Rendezvous, names).unwrap();
    Engine::init(&dir, &map).unwrap();
    let mut o = opts(Durability::Fsync);
    o.run_record_sync_ms = sync_ms;
    o.flow = flow.map(|s| Arc::new(FlowControl::new(s, Arc::new(LocalGroupBuckets::default()))));
    let engine = Engine::open(&dir, o).unwrap();
    let jobs: Vec<NewJob> = (0..n)
        .map(|i| NewJob::new(format!("key-{}", i % KEYS), vec![b'x'; PAYLOAD_BYTES]))
        .collect();
    for chunk in jobs.chunks(BATCH) {
        engine.enqueue_batch(chunk.to_vec()).unwrap();
    }
    let member = shardq_fs::MemberOptions {
        max_local_shards: usize::MAX,
        ..shardq_fs::MemberOptions::default()
    };
    let pool = PoolOptions {
        concurrency: 8,
        exit_when_idle: true,
        ..PoolOptions::default()
    };
    let stop = AtomicBool::new(false);
    let t = Instant::now();
    let report = engine
        .run_workers(
            member,
            pool,
            Arc::new(|_: &shardq_core::ClaimedJob| Ok(())),
            &stop,
        )
        .unwrap();
    let rate = report.acked as f64 / t.elapsed().as_secs_f64();
    assert_eq!(report.acked as usize, n, "every job acked");
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
    rate
}
