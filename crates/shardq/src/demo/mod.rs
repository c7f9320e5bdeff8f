//! `shardq demo`: the specification's story end to end, measured.
//!
//! Producers enqueue numbered jobs for every tenant at a steady rate, a worker
//! pool runs them and checks each tenant's order as it goes, and after a
//! warm-up a new shard is added and the queue rebalanced while everything
//! keeps running. The report says how many keys moved and where, whether any
//! job ran out of order, twice, or never, how long moving keys were paused,
//! and the throughput before, during and after.
//!
//! The demo is generic over a [`DemoEnv`] ([`envs`] has the embedded
//! engine, Redis on local servers, and memory), so the same story runs on
//! each; it holds no queue logic itself. It never prints: progress goes to
//! the caller's observer, and [`render`] turns the report into text
//! (`cmd_demo.rs` does the printing).

pub mod envs;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde::Serialize;
use shardq_core::producer::{ProduceError, Producer, ProducerOptions};
use shardq_core::reshard::{
    self, MapStore, RebalanceEvent, RebalanceOptions, RebalanceReport, ReshardBackend,
};
use shardq_core::{ClaimedJob, Clock, Coordinator, NewJob, PoolOptions, QueueBackend, WorkerPool};
use shardq_route::Router;

/// Most tenants a demo may simulate.
pub const TENANTS_MAX: usize = 1_000_000;
/// Longest wait for the backlog to run after producers stop.
const FINAL_DRAIN_MS: u64 = 120_000;
/// Producers enqueue in slices of this many jobs between rate checks.
const RATE_SLICE: u64 = 50;
/// Stripes of the order-check table (less lock contention between workers).
const STRIPES: usize = 64;

/// What the demo runs on.
pub trait DemoEnv: Send + Sync {
    /// The queue backend.
    fn backend(&self) -> Arc<dyn ReshardBackend>;
    /// Where the shard map lives.
    fn store(&self) -> Arc<dyn MapStore>;
    /// A coordinator that claims every shard, including shards added later.
    fn coordinator(&self) -> Result<Box<dyn Coordinator>, DemoError>;
    /// The clock the pool uses.
    fn clock(&self) -> Arc<dyn Clock>;
    /// Makes storage for a new shard exist before it joins the map.
    fn deploy_shard(&self, name: &str) -> Result<(), DemoError>;
    /// Where the data is, for the report.
    fn location(&self) -> String;
}

/// Demo parameters.
#[derive(Debug, Clone)]
pub struct DemoParams {
    /// Tenants (keys).
    pub tenants: usize,
    /// Jobs enqueued back to back for one tenant before moving to the next,
    /// so tenants carry a backlog (what drain-then-switch must wait out).
    pub burst: u64,
    /// Simulated work per job, in microseconds.
    pub work_us: u64,
    /// Seconds of load before the rebalance, and again after it.
    pub phase_s: f64,
    /// Jobs per second over all producers.
    pub rate: u64,
    /// Producer threads.
    pub producers: usize,
    /// Worker pool concurrency.
    pub concurrency: usize,
    /// Keys per drain-then-switch batch.
    pub batch: usize,
}

/// Errors of the demo: a parameter out of bounds, or a failure of the
/// queue it runs on (named with what was being done).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// A parameter is outside its bounds.
    #[error("{0}")]
    Invalid(String),
    /// The queue layer failed.
    #[error(transparent)]
    Queue(#[from] shardq_core::QueueError),
    /// Resharding or the map store failed.
    #[error(transparent)]
    Reshard(#[from] shardq_core::reshard::ReshardError),
    /// A producer gave up.
    #[error(transparent)]
    Produce(#[from] shardq_core::producer::ProduceError),
    /// A map is invalid.
    #[error(transparent)]
    Map(#[from] shardq_route::MapError),
    /// The deployment could not be set up.
    #[error(transparent)]
    Deploy(#[from] shardq_deploy::DeployError),
    /// A thread or file could not be made.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Setting up or running the queue failed.
    #[error("{doing}: {cause}")]
    Failed {
        /// What was being done.
        doing: String,
        /// What went wrong.
        cause: String,
    },
}

impl DemoError {
    /// A failure while `doing`.
    pub fn failed(doing: impl Into<String>, cause: impl std::fmt::Display) -> DemoError {
        DemoError::Failed {
            doing: doing.into(),
            cause: cause.to_string(),
        }
    }
}

macro_rules! bail {
    ($($arg:tt)*) => {
        return Err(DemoError::Invalid(format!($($arg)*)))
    };
}

/// Per-shard figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ShardLoad {
    /// Tenants routed to the shard by the map before the change.
    pub tenants_before: u64,
    /// Tenants routed to the shard by the map after the change.
    pub tenants_after: u64,
    /// Jobs the shard ran during the "before" phase.
    pub jobs_before: u64,
    /// Jobs the shard ran during the "after" phase.
    pub jobs_after: u64,
}

/// The final report (`--json` prints it).
#[derive(Debug, Clone, Default, Serialize)]
pub struct DemoReport {
    /// Where the data lived.
    pub location: String,
    /// Tenants simulated.
    pub tenants: usize,
    /// Shards before.
    pub shards_before: usize,
    /// The shard added.
    pub new_shard: String,
    /// Fraction of tenants whose shard changed.
    pub moved_fraction: f64,
    /// Fraction of moved tenants that went to the new shard.
    pub moved_to_new_fraction: f64,
    /// Tenants with work (queued, delayed or running jobs) when the move
    /// began, moved with their backlogs; the others followed the new map at
    /// once. (The name is kept for `--json` readers.)
    pub keys_drained: usize,
    /// Jobs that started before an earlier job of their key.
    pub order_violations: u64,
    /// Jobs enqueued successfully that never ran.
    pub lost_jobs: u64,
    /// Job runs beyond the first (at-least-once re-runs).
    pub duplicate_runs: u64,
    /// Jobs enqueued.
    pub jobs_enqueued: u64,
    /// Jobs run (first runs).
    pub jobs_run: u64,
    /// Enqueues that failed (a paused key past its bound, say).
    pub enqueue_errors: u64,
    /// A producer's enqueue call (one batch), 99th percentile before the
    /// change, ms.
    pub enqueue_ms_p99_before: f64,
    /// The same during the rebalance.
    pub enqueue_ms_p99_during: f64,
    /// The longest enqueue call during the rebalance, ms.
    pub enqueue_ms_max_during: f64,
    /// Appends the producers had refused because a key was paused (each
    /// one a wait).
    pub enqueues_refused_paused: u64,
    /// Appends a frozen key's old shard sent on to its new one (no wait).
    pub enqueues_sent_on: u64,
    /// Per-key pause while moving (a forced freeze's one round; 0 for a
    /// key frozen without one), median, ms.
    pub pause_ms_p50: f64,
    /// Per-key pause, 99th percentile, ms.
    pub pause_ms_p99: f64,
    /// Longest per-key pause, ms.
    pub pause_ms_max: f64,
    /// Wall time of the rebalance, ms.
    pub rebalance_ms: f64,
    /// Jobs run per second before the change.
    pub jobs_per_s_before: f64,
    /// Jobs run per second while rebalancing.
    pub jobs_per_s_during: f64,
    /// Jobs run per second after.
    pub jobs_per_s_after: f64,
    /// Map version before and after.
    pub map_version_before: u64,
    /// Map version after.
    pub map_version_after: u64,
    /// Per-shard load.
    pub shards: BTreeMap<String, ShardLoad>,
    /// The last enqueue error, when some failed.
    pub last_enqueue_error: Option<String>,
}

#[derive(Default)]
struct KeyTrack {
    /// Next sequence number expected to run.
    next: u64,
    runs: u64,
}

/// Per-key order checking, striped to keep workers from queueing on one lock.
struct Tracker {
    stripes: Vec<Mutex<BTreeMap<String, KeyTrack>>>,
    violations: AtomicU64,
    duplicates: AtomicU64,
    first_runs: AtomicU64,
    per_shard: Mutex<BTreeMap<String, u64>>,
}

impl Tracker {
    fn new() -> Tracker {
        Tracker {
            stripes: (0..STRIPES).map(|_| Mutex::new(BTreeMap::new())).collect(),
            violations: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            first_runs: AtomicU64::new(0),
            per_shard: Mutex::new(BTreeMap::new()),
        }
    }

    fn stripe(&self, key: &str) -> &Mutex<BTreeMap<String, KeyTrack>> {
        let h = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
        &self.stripes[(h % STRIPES as u64) as usize]
    }

    fn record(&self, job: &ClaimedJob) -> Result<(), String> {
        let seq: u64 = std::str::from_utf8(&job.payload)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                format!(
                    "job {} of key {:?} has a payload that is not a sequence number",
                    job.id, job.key
                )
            })?;
        {
            let mut stripe = self
                .stripe(&job.key)
                .lock()
                .map_err(|_| "tracker lock poisoned".to_string())?;
            let t = stripe.entry(job.key.clone()).or_default();
            t.runs += 1;
            if seq < t.next {
                self.duplicates.fetch_add(1, Ordering::Relaxed);
            } else {
                if seq > t.next {
                    self.violations.fetch_add(1, Ordering::Relaxed);
                }
                t.next = seq + 1;
                self.first_runs.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Ok(mut m) = self.per_shard.lock() {
            *m.entry(job.shard.clone()).or_default() += 1;
        }
        Ok(())
    }

    fn shard_counts(&self) -> BTreeMap<String, u64> {
        self.per_shard.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    reshard::percentile(values, p)
}

/// Runs the demo on `env`; `observe` gets a one-line progress message every
/// 100 ms or so.
pub fn run(
    env: Arc<dyn DemoEnv>,
    p: &DemoParams,
    observe: &(dyn Fn(&str) + Sync),
) -> Result<DemoReport, DemoError> {
    check(p)?;
    let backend = env.backend();
    let store = env.store();
    let before_map = store
        .load()
        .map_err(|e| DemoError::failed("loading the shard map", e))?;
    let before = Router::new(before_map.clone())
        .map_err(|e| DemoError::failed("compiling the shard map", e))?;
    let new_shard = format!("shard-{}", before_map.shards.len());

    let tracker = Arc::new(Tracker::new());
    let stop_pool = Arc::new(AtomicBool::new(false));
    let pool = spawn_pool(&*env, &backend, &tracker, &stop_pool, p)?;
    let shared = Produced::default();
    let mut producers = Vec::new();
    for i in 0..p.producers {
        producers.push(spawn_producer(i, p, &backend, &store, &shared)?);
    }
    let (enqueued, enqueue_errors) = (&shared.enqueued, &shared.errors);
    let show = |phase: &str, extra: &str| {
        let e = enqueued.load(Ordering::Relaxed);
        let r = tracker.first_runs.load(Ordering::Relaxed);
        observe(&format!(
            "{phase:<10} enqueued {e:>9}  ran {r:>9}  backlog {:>7}  violations {}{extra}",
            e.saturating_sub(r),
            tracker.violations.load(Ordering::Relaxed)
        ));
    };
    let watch = |phase: &str, secs: f64| {
        let end = Instant::now() + Duration::from_secs_f64(secs);
        while Instant::now() < end {
            show(phase, "");
            thread::sleep(Duration::from_millis(100));
        }
    };

    // Before.
    let t0 = Instant::now();
    let ran0 = tracker.first_runs.load(Ordering::Relaxed);
    watch("before", p.phase_s);
    let ran1 = tracker.first_runs.load(Ordering::Relaxed);
    let t1 = Instant::now();
    let shard_jobs_before = tracker.shard_counts();

    // During: add a shard and rebalance while producers and workers run.
    env.deploy_shard(&new_shard)?;
    reshard::add_shard(&*store, &new_shard, 1, None)?;
    let report = rebalance_showing_progress(&*backend, &*store, p.batch, &show)?;
    let t2 = Instant::now();
    let ran2 = tracker.first_runs.load(Ordering::Relaxed);
    let shard_jobs_mid = tracker.shard_counts();

    // After.
    watch("after", p.phase_s);
    let t3 = Instant::now();
    let ran3 = tracker.first_runs.load(Ordering::Relaxed);
    let shard_jobs_end = tracker.shard_counts();

    shared.stop.store(true, Ordering::SeqCst);
    let expected = join_producers(producers)?;
    let total: u64 = expected.values().sum();
    drain_and_stop_pool(&tracker, total, pool, &stop_pool, &show)?;
    let lost = count_lost(&tracker, &expected)?;

    let after_map = store.load()?;
    let after = Router::new(after_map.clone())?;
    let mut out = DemoReport {
        location: env.location(),
        tenants: p.tenants,
        shards_before: before_map.shards.len(),
        new_shard: new_shard.clone(),
        order_violations: tracker.violations.load(Ordering::Relaxed),
        duplicate_runs: tracker.duplicates.load(Ordering::Relaxed),
        lost_jobs: lost,
        jobs_enqueued: total,
        jobs_run: tracker.first_runs.load(Ordering::Relaxed),
        enqueue_errors: enqueue_errors.load(Ordering::Relaxed),
        keys_drained: report.moved.len(),
        rebalance_ms: report.elapsed_ms,
        jobs_per_s_before: (ran1 - ran0) as f64 / (t1 - t0).as_secs_f64(),
        jobs_per_s_during: (ran2 - ran1) as f64 / (t2 - t1).as_secs_f64().max(1e-3),
        jobs_per_s_after: (ran3 - ran2) as f64 / (t3 - t2).as_secs_f64(),
        map_version_before: before_map.version,
        map_version_after: after_map.version,
        ..DemoReport::default()
    };
    shared.measure(&mut out, [t0, t1, t2])?;
    record_pauses(&mut out, &report);
    count_moves(&mut out, p.tenants, &before, &after, &new_shard);
    record_shard_jobs(
        &mut out,
        &shard_jobs_before,
        &shard_jobs_mid,
        &shard_jobs_end,
    );
    Ok(out)
}

/// Rebalances onto the map with the new shard, showing how many keys have
/// moved as it goes.
fn rebalance_showing_progress(
    backend: &dyn ReshardBackend,
    store: &dyn MapStore,
    batch: usize,
    show: &dyn Fn(&str, &str),
) -> Result<RebalanceReport, DemoError> {
    let moved_so_far = AtomicU64::new(0);
    let to_move = AtomicU64::new(0);
    let opts = RebalanceOptions {
        batch,
        runner: format!("shardq demo (pid {})", std::process::id()),
        ..RebalanceOptions::default()
    };
    let report = reshard::rebalance(backend, store, &opts, &mut |ev| {
        match ev {
            RebalanceEvent::Pinned { pinned, .. } => {
                to_move.store(pinned as u64, Ordering::Relaxed)
            }
            RebalanceEvent::Switched { done, .. } => {
                moved_so_far.store(done as u64, Ordering::Relaxed)
            }
            _ => {}
        }
        show(
            "rebalance",
            &format!(
                "  moved {}/{}",
                moved_so_far.load(Ordering::Relaxed),
                to_move.load(Ordering::Relaxed)
            ),
        );
    })?;
    Ok(report)
}

/// Waits for the producer threads; returns the next sequence number of
/// every key they enqueued for.
fn join_producers(producers: Vec<ProducerThread>) -> Result<BTreeMap<String, u64>, DemoError> {
    let mut expected: BTreeMap<String, u64> = BTreeMap::new();
    for h in producers {
        let next = h
            .join()
            .map_err(|_| DemoError::failed("producing", "a producer thread panicked"))??;
        expected.extend(next);
    }
    Ok(expected)
}

/// Waits (bounded) for the `total` jobs enqueued to run, then stops the
/// pool and returns its failure if it had one.
fn drain_and_stop_pool(
    tracker: &Tracker,
    total: u64,
    pool: thread::JoinHandle<Result<shardq_core::PoolReport, shardq_core::QueueError>>,
    stop_pool: &AtomicBool,
    show: &dyn Fn(&str, &str),
) -> Result<(), DemoError> {
    let drain_started = Instant::now();
    while tracker.first_runs.load(Ordering::Relaxed) < total
        && drain_started.elapsed() < Duration::from_millis(FINAL_DRAIN_MS)
        && !pool.is_finished()
    {
        show("draining", "");
        thread::sleep(Duration::from_millis(20));
    }
    stop_pool.store(true, Ordering::SeqCst);
    let pool_result = pool
        .join()
        .map_err(|_| DemoError::failed("running jobs", "the worker pool panicked"))?;
    pool_result.map_err(|e| DemoError::failed("worker pool", e))?;
    Ok(())
}

/// Jobs enqueued that never ran: every sequence number below a key's
/// `expected` next one must have run.
fn count_lost(tracker: &Tracker, expected: &BTreeMap<String, u64>) -> Result<u64, DemoError> {
    let mut lost = 0u64;
    for (key, n) in expected {
        let stripe = tracker
            .stripe(key)
            .lock()
            .map_err(|_| DemoError::failed("checking order", "tracker lock poisoned"))?;
        let ran_next = stripe.get(key).map_or(0, |t| t.next);
        lost += n.saturating_sub(ran_next);
    }
    Ok(lost)
}

/// Fills in the per-key pause figures of the moves.
fn record_pauses(out: &mut DemoReport, report: &RebalanceReport) {
    let mut pauses: Vec<f64> = report.moved.iter().map(|m| m.pause_ms).collect();
    out.pause_ms_p50 = percentile(&mut pauses, 50.0);
    out.pause_ms_p99 = percentile(&mut pauses, 99.0);
    out.pause_ms_max = pauses.iter().copied().fold(0.0, f64::max);
}

/// Fills in the jobs each shard ran before the change and after it (the
/// runs counted at the end less those counted when the rebalance ended).
fn record_shard_jobs(
    out: &mut DemoReport,
    before: &BTreeMap<String, u64>,
    mid: &BTreeMap<String, u64>,
    end: &BTreeMap<String, u64>,
) {
    for (shard, n) in before {
        out.shards.entry(shard.clone()).or_default().jobs_before = *n;
    }
    for (shard, n) in end {
        let mid = mid.get(shard).copied().unwrap_or(0);
        out.shards.entry(shard.clone()).or_default().jobs_after = n - mid;
    }
}

/// Refuses parameters out of their bounds, naming the flag.
fn check(p: &DemoParams) -> Result<(), DemoError> {
    if p.tenants == 0 || p.tenants > TENANTS_MAX {
        bail!("--tenants {}: must be 1..={TENANTS_MAX}", p.tenants);
    }
    if p.producers == 0 || p.producers > 64 {
        bail!("--producers {}: must be 1..=64", p.producers);
    }
    if p.burst == 0 || p.burst > RATE_SLICE {
        bail!("--burst {}: must be 1..={RATE_SLICE}", p.burst);
    }
    if p.rate == 0 {
        bail!("--rate must be at least 1 job/s");
    }
    if !(p.phase_s > 0.0 && p.phase_s <= 3600.0) {
        bail!("--phase-s {}: must be in (0, 3600]", p.phase_s);
    }
    Ok(())
}

/// Starts the worker pool on its own thread: every job checked against its
/// tenant's order by `tracker`, until `stop`.
fn spawn_pool(
    env: &dyn DemoEnv,
    backend: &Arc<dyn ReshardBackend>,
    tracker: &Arc<Tracker>,
    stop: &Arc<AtomicBool>,
    p: &DemoParams,
) -> Result<thread::JoinHandle<Result<shardq_core::PoolReport, shardq_core::QueueError>>, DemoError>
{
    let backend: Arc<dyn QueueBackend> = backend.clone();
    let tracker = tracker.clone();
    let stop = stop.clone();
    let mut coordinator = env.coordinator()?;
    let clock = env.clock();
    let work_us = p.work_us;
    let opts = PoolOptions {
        concurrency: p.concurrency,
        idle_poll_ms: 1,
        ..PoolOptions::default()
    };
    Ok(thread::Builder::new()
        .name("demo-pool".into())
        .spawn(move || {
            let handler = move |job: &ClaimedJob| {
                if work_us > 0 {
                    thread::sleep(Duration::from_micros(work_us));
                }
                tracker.record(job).map_err(Into::into)
            };
            WorkerPool::run(
                backend,
                &mut *coordinator,
                Arc::new(handler),
                clock,
                opts,
                &stop,
            )
        })?)
}

/// What the producer threads share with the demo: the stop flag, counts,
/// the last error, each enqueue call's start and length, and the
/// refusals met (what a producer saw of the move, measured where it
/// waits).
#[derive(Default, Clone)]
struct Produced {
    stop: Arc<AtomicBool>,
    enqueued: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    last_error: Arc<Mutex<Option<String>>>,
    calls: Arc<Mutex<Vec<(Instant, f32)>>>,
    refused_paused: Arc<AtomicU64>,
    refused_moved: Arc<AtomicU64>,
}

impl Produced {
    /// The producers' side of the report: enqueue call times before and
    /// during the rebalance (`at` = its start, the rebalance's start and
    /// end), refusals, the last error.
    fn measure(&self, out: &mut DemoReport, at: [Instant; 3]) -> Result<(), DemoError> {
        let calls = self
            .calls
            .lock()
            .map_err(|_| DemoError::failed("measuring", "a producer panicked"))?;
        let window = |from: Instant, to: Instant| -> Vec<f64> {
            calls
                .iter()
                .filter(|(t, _)| *t >= from && *t < to)
                .map(|(_, ms)| f64::from(*ms))
                .collect()
        };
        let (mut before, mut during) = (window(at[0], at[1]), window(at[1], at[2]));
        out.enqueue_ms_p99_before = percentile(&mut before, 99.0);
        out.enqueue_ms_p99_during = percentile(&mut during, 99.0);
        out.enqueue_ms_max_during = during.iter().copied().fold(0.0, f64::max);
        out.enqueues_refused_paused = self.refused_paused.load(Ordering::Relaxed);
        out.enqueues_sent_on = self.refused_moved.load(Ordering::Relaxed);
        if out.enqueue_errors > 0 {
            out.last_enqueue_error = self.last_error.lock().ok().and_then(|l| l.clone());
        }
        Ok(())
    }
}

/// A producer thread: each of its tenants' next number, once stopped.
type ProducerThread = thread::JoinHandle<Result<BTreeMap<String, u64>, DemoError>>;

/// Starts producer `i` of `p.producers`: it enqueues numbered jobs for its
/// share of the tenants at its share of the rate until `shared.stop`, and
/// returns each tenant's next number (every number below it was stored).
fn spawn_producer(
    i: usize,
    p: &DemoParams,
    backend: &Arc<dyn ReshardBackend>,
    store: &Arc<dyn MapStore>,
    shared: &Produced,
) -> Result<ProducerThread, DemoError> {
    let backend = backend.clone();
    let store = store.clone();
    let shared = shared.clone();
    let burst = p.burst.max(1);
    let per_producer_rate = (p.rate as f64 / p.producers as f64).max(1.0);
    let mine: Vec<String> = (i..p.tenants)
        .step_by(p.producers)
        .map(|t| format!("t-{t}"))
        .collect();
    Ok(thread::Builder::new()
        .name(format!("demo-producer-{i}"))
        .spawn(move || -> Result<BTreeMap<String, u64>, DemoError> {
            let mut next: BTreeMap<String, u64> = BTreeMap::new();
            if mine.is_empty() {
                return Ok(next);
            }
            let mut producer =
                Producer::new(backend.clone(), store.clone(), ProducerOptions::default())?;
            let started = Instant::now();
            let mut sent = 0u64;
            let mut cursor = 0usize;
            while !shared.stop.load(Ordering::SeqCst) {
                // One slice is one batch: one append (and fsync) per shard.
                let mut batch = Vec::with_capacity(RATE_SLICE as usize);
                let mut tentative: BTreeMap<String, u64> = BTreeMap::new();
                for n in 0..RATE_SLICE {
                    let key = &mine[cursor % mine.len()];
                    if (n + 1) % burst == 0 {
                        cursor += 1;
                    }
                    let seq = tentative
                        .get(key)
                        .copied()
                        .unwrap_or_else(|| next.get(key).copied().unwrap_or(0));
                    batch.push(NewJob::new(key.clone(), seq.to_string()));
                    tentative.insert(key.clone(), seq + 1);
                }
                sent += batch.len() as u64;
                let call_started = Instant::now();
                let outcome = producer.enqueue_batch(&batch);
                let took_ms = call_started.elapsed().as_secs_f32() * 1000.0;
                if let Ok(mut c) = shared.calls.lock() {
                    c.push((call_started, took_ms));
                }
                let r = producer.take_refusals();
                shared
                    .refused_paused
                    .fetch_add(r.paused.values().sum(), Ordering::Relaxed);
                shared
                    .refused_moved
                    .fetch_add(r.moved.values().sum(), Ordering::Relaxed);
                // A key's jobs of one call land all together or not at
                // all; keys whose jobs did not land keep their numbering.
                let placed: Vec<usize> = match &outcome {
                    Ok(placed) => placed.iter().map(|p| p.index).collect(),
                    Err(
                        ProduceError::PausedTooLong { placed, .. }
                        | ProduceError::Partial { placed, .. },
                    ) => placed.iter().map(|p| p.index).collect(),
                    Err(_) => Vec::new(),
                };
                let mut landed: BTreeMap<&str, bool> = BTreeMap::new();
                for (i, job) in batch.iter().enumerate() {
                    let ok = placed.binary_search(&i).is_ok();
                    let e = landed.entry(job.key.as_str()).or_insert(true);
                    *e &= ok;
                }
                for (key, ok) in landed {
                    if ok {
                        if let Some(seq) = tentative.get(key) {
                            next.insert(key.to_string(), *seq);
                        }
                    }
                }
                shared
                    .enqueued
                    .fetch_add(placed.len() as u64, Ordering::Relaxed);
                if let Err(e) = outcome {
                    shared
                        .errors
                        .fetch_add((batch.len() - placed.len()) as u64, Ordering::Relaxed);
                    if let Ok(mut l) = shared.last_error.lock() {
                        *l = Some(e.to_string());
                    }
                }
                let due = Duration::from_secs_f64(sent as f64 / per_producer_rate);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    thread::sleep(wait);
                }
            }
            Ok(next)
        })?)
}

/// Counts the tenants that moved, and those that moved to the new shard,
/// and each shard's tenants before and after.
fn count_moves(
    out: &mut DemoReport,
    tenants: usize,
    before: &Router,
    after: &Router,
    new_shard: &str,
) {
    let mut moved = 0u64;
    let mut moved_to_new = 0u64;
    for t in 0..tenants {
        let k = format!("t-{t}");
        let (a, b) = (before.route(&k), after.route(&k));
        out.shards.entry(a.to_string()).or_default().tenants_before += 1;
        out.shards.entry(b.to_string()).or_default().tenants_after += 1;
        if a != b {
            moved += 1;
            moved_to_new += u64::from(b == new_shard);
        }
    }
    out.moved_fraction = moved as f64 / tenants as f64;
    out.moved_to_new_fraction = if moved == 0 {
        0.0
    } else {
        moved_to_new as f64 / moved as f64
    };
}

/// The report for people, as printed by `shardq demo`.
pub fn render(r: &DemoReport) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let ok = |b: bool| if b { "ok" } else { "FAILED" };
    let _ = writeln!(o, "shardq demo on {}", r.location);
    let _ = writeln!(
        o,
        "  {} tenants, {} shards -> {} shards (added {}), map v{} -> v{}",
        r.tenants,
        r.shards_before,
        r.shards_before + 1,
        r.new_shard,
        r.map_version_before,
        r.map_version_after
    );
    o.push('\n');
    let _ = writeln!(
        o,
        "  keys moved            {:>8.2}%   (ideal 1/{} = {:.2}%)",
        r.moved_fraction * 100.0,
        r.shards_before + 1,
        100.0 / (r.shards_before + 1) as f64
    );
    let _ = writeln!(
        o,
        "  moved to the new shard {:>7.2}%",
        r.moved_to_new_fraction * 100.0
    );
    let _ = writeln!(o, "  keys moved with work  {:>8}", r.keys_drained);
    let _ = writeln!(
        o,
        "  order violations      {:>8}   {}",
        r.order_violations,
        ok(r.order_violations == 0)
    );
    let _ = writeln!(
        o,
        "  lost jobs             {:>8}   {}",
        r.lost_jobs,
        ok(r.lost_jobs == 0)
    );
    let _ = writeln!(o, "  duplicate runs        {:>8}", r.duplicate_runs);
    let _ = writeln!(
        o,
        "  jobs enqueued / run   {:>8} / {}",
        r.jobs_enqueued, r.jobs_run
    );
    if r.enqueue_errors > 0 {
        let _ = writeln!(o, "  enqueue errors        {:>8}", r.enqueue_errors);
    }
    let _ = writeln!(
        o,
        "  pause per moved key   p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        r.pause_ms_p50, r.pause_ms_p99, r.pause_ms_max
    );
    let _ = writeln!(
        o,
        "  enqueue call p99      before {:.1} ms, during {:.1} ms (max {:.1} ms); {} refused as paused, {} sent on",
        r.enqueue_ms_p99_before,
        r.enqueue_ms_p99_during,
        r.enqueue_ms_max_during,
        r.enqueues_refused_paused,
        r.enqueues_sent_on
    );
    let _ = writeln!(o, "  rebalance took        {:>8.0} ms", r.rebalance_ms);
    let _ = writeln!(
        o,
        "  jobs/s                before {:.0}, during {:.0} ({:.0}%), after {:.0}",
        r.jobs_per_s_before,
        r.jobs_per_s_during,
        if r.jobs_per_s_before > 0.0 {
            100.0 * r.jobs_per_s_during / r.jobs_per_s_before
        } else {
            0.0
        },
        r.jobs_per_s_after
    );
    o.push('\n');
    let _ = writeln!(
        o,
        "  {:<12} {:>14} {:>14} {:>12} {:>12}",
        "shard", "tenants before", "tenants after", "jobs before", "jobs after"
    );
    for (name, s) in &r.shards {
        let _ = writeln!(
            o,
            "  {:<12} {:>14} {:>14} {:>12} {:>12}",
            name, s.tenants_before, s.tenants_after, s.jobs_before, s.jobs_after
        );
    }
    if let Some(e) = &r.last_enqueue_error {
        let _ = writeln!(o, "  last enqueue error: {e}");
    }
    o
}
