//! Embedded engine benchmark (a plain binary, `harness = false`):
//! `cargo bench -p shardq-fs --bench engine [-- --jobs N]`.
//!
//! Measures, with 100-byte payloads: batched enqueue without fsync (against
//! a raw file append of the same bytes as baseline), the full life cycle
//! enqueue + claim + ack in one process, durable group commit with 8
//! producer threads, reopening a shard with N pending jobs, and memory per
//! pending job. Prints one line per figure and a JSON summary.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use shardq_core::{NewJob, QueueBackend, Receipt, JOB_LEASE_MS_DEFAULT};
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

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let jobs: usize = args
        .iter()
        .position(|a| a == "--jobs")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let mut summary = serde_json::Map::new();

    // Baseline: the same record bytes appended to a plain file.
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

    // 1. Batched enqueue, durability none.
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

    // 4 + 5. Reopen with `jobs` pending, and memory per pending job.
    let rss0 = rss_bytes();
    let t = Instant::now();
    let engine = Engine::open(&dir, opts(Durability::None)).unwrap();
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
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);

    // 2. Full life cycle in one process.
    let dir = fresh("cycle");
    let engine = Engine::open(&dir, opts(Durability::None)).unwrap();
    let b = engine.backend();
    b.adopt("shard-0").unwrap();
    let cycle_jobs = jobs / 2;
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
    let cycle = cycle_jobs as f64 / t.elapsed().as_secs_f64();
    println!("life cycle enqueue+claim+ack, in-process: {cycle:>11.0} jobs/s");
    summary.insert("lifecycle_jobs_per_s".into(), cycle.round().into());
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);

    // 3. Durable group commit: 8 producer threads, fsync per call.
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

    println!("{}", serde_json::Value::Object(summary));
}
