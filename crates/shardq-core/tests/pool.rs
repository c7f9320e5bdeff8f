//! The worker pool under hostile handlers and a failing shard: a handler
//! slower than its job lease, one past its job timeout, one still running
//! when the drain timeout ends, and a corrupt shard beside healthy ones.
//! Each test checks the promise (no two runs of a key overlap, no shard is
//! given up while its handler runs, healthy shards keep running), not the
//! mechanism.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use shardq_core::memory::{MemoryBackend, MemoryCoordinator};
use shardq_core::{
    current_run, AckOutcome, ClaimedJob, Clock, DeadJob, FailOutcome, Fence, InspectJobs, JobId,
    KeyCounts, ManualClock, MoveKeys, NewJob, PoolEvent, PoolOptions, PoolReport, QueueBackend,
    QueueError, Receipt, RunJobs, RunOutcome, ShardStats, SystemClock, WorkerPool,
};

fn run_pool(
    backend: Arc<dyn QueueBackend>,
    coordinator_of: MemoryBackend,
    handler: Arc<shardq_core::Handler>,
    opts: PoolOptions,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<Result<PoolReport, QueueError>> {
    run_pool_on(
        Arc::new(SystemClock),
        backend,
        coordinator_of,
        handler,
        opts,
        stop,
    )
}

/// [`run_pool`] on `clock`: on a [`ManualClock`] the pool's waits are short
/// real slices and its leases, heartbeats and timeouts move only with the
/// test's clock.
fn run_pool_on(
    clock: Arc<dyn Clock>,
    backend: Arc<dyn QueueBackend>,
    coordinator_of: MemoryBackend,
    handler: Arc<shardq_core::Handler>,
    opts: PoolOptions,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<Result<PoolReport, QueueError>> {
    thread::spawn(move || {
        let mut coord = MemoryCoordinator::new(coordinator_of);
        WorkerPool::run(backend, &mut coord, handler, clock, opts, &stop)
    })
}

/// Moves `clock` on by `step_ms` every real millisecond until dropped: a
/// pool on a manual clock that waits for time (a retry's backoff) gets it
/// 5 times faster than real time, still in order with its own reads.
struct Ticker {
    done: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Ticker {
    fn start(clock: &ManualClock, step_ms: u64) -> Ticker {
        let done = Arc::new(AtomicBool::new(false));
        let thread = {
            let (clock, done) = (clock.clone(), done.clone());
            thread::spawn(move || {
                while !done.load(Ordering::SeqCst) {
                    clock.advance(step_ms);
                    thread::sleep(Duration::from_millis(1));
                }
            })
        };
        Ticker {
            done,
            thread: Some(thread),
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Options of a pool of 2 that exits when idle, and the events it reports.
fn idle_exiting_pool_recording_events() -> (Arc<Mutex<Vec<PoolEvent>>>, PoolOptions) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let opts = PoolOptions {
        concurrency: 2,
        exit_when_idle: true,
        on_event: {
            let events = events.clone();
            Arc::new(move |e| events.lock().unwrap().push(e))
        },
        ..PoolOptions::default()
    };
    (events, opts)
}

/// Waits for `cond` for at most `secs` seconds.
fn wait_for(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(2));
    }
}

/// A handler several job leases long: heartbeats keep its run the job's
/// only run, so the key's next job waits and the job runs once. On a
/// manual clock: the handler moves time on by more than a heartbeat
/// interval at a time (never a whole lease) and waits for the pool's
/// next heartbeat, for 12 steps (almost 5 leases), in no real time.
#[test]
fn a_handler_slower_than_its_job_lease_runs_once() {
    let clock = ManualClock::new(1_000_000);
    let inner = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    let jobs: Vec<NewJob> = (0..3).map(|i| NewJob::new("k", format!("{i}"))).collect();
    inner.enqueue("s0", 1, &jobs).unwrap();
    let backend = Arc::new(OneBroken::healthy(inner.clone()));
    let extends = backend.extends.clone();
    let running = Arc::new(AtomicUsize::new(0));
    let overlap = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(Mutex::new(Vec::new()));
    let handler: Arc<shardq_core::Handler> = {
        let (running, overlap, runs, clock) = (
            running.clone(),
            overlap.clone(),
            runs.clone(),
            clock.clone(),
        );
        Arc::new(move |job: &ClaimedJob| {
            if running.fetch_add(1, Ordering::SeqCst) > 0 {
                overlap.store(true, Ordering::SeqCst);
            }
            runs.lock()
                .unwrap()
                .push((job.payload.clone(), job.attempt));
            if job.payload == b"0" {
                for _ in 0..12 {
                    let before = extends.load(Ordering::SeqCst);
                    clock.advance(40); // lease 100 ms, a heartbeat every 33
                    wait_for(20, "the pool's next heartbeat", || {
                        extends.load(Ordering::SeqCst) > before
                    });
                }
            }
            running.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
    };
    let opts = PoolOptions {
        concurrency: 4,
        job_lease_ms: 100,
        exit_when_idle: true,
        ..PoolOptions::default()
    };
    let report = run_pool_on(
        Arc::new(clock.clone()),
        backend,
        inner,
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    )
    .join()
    .unwrap()
    .unwrap();
    assert!(
        !overlap.load(Ordering::SeqCst),
        "two runs of one key overlapped"
    );
    let runs = runs.lock().unwrap().clone();
    assert_eq!(
        runs,
        vec![(b"0".to_vec(), 1), (b"1".to_vec(), 1), (b"2".to_vec(), 1)],
        "each job once, in order, first attempt"
    );
    assert_eq!((report.acked, report.stale), (3, 0));
}

/// A running job cancelled by an operator (another thread here) has its
/// handler stopped within about a second, far before the next heartbeat
/// (10 s with the default 30 s job lease), and its key's next job starts
/// as soon as the handler returned, never before: the handler takes a
/// moment to clean up after it is told to stop.
#[test]
fn a_cancelled_runs_key_starts_its_next_job_once_its_handler_returned() {
    let backend = MemoryBackend::new(&["s0"], Arc::new(SystemClock));
    let ids = backend
        .enqueue(
            "s0",
            1,
            &[NewJob::new("k", "long"), NewJob::new("k", "next")],
        )
        .unwrap();
    let stamps: Arc<Mutex<BTreeMap<&'static str, Instant>>> = Arc::default();
    let handler: Arc<shardq_core::Handler> = {
        let stamps = stamps.clone();
        Arc::new(move |job: &ClaimedJob| {
            let note = |what| stamps.lock().unwrap().insert(what, Instant::now());
            if job.payload != b"long" {
                note("next started");
                return Ok(());
            }
            note("long started");
            let run = current_run().expect("a handler runs inside a run");
            let deadline = Instant::now() + Duration::from_secs(60);
            while !run.is_cancelled() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(1));
            }
            thread::sleep(Duration::from_millis(300));
            note("long ended");
            Err(format!("stopped: {}", run.cancel_reason()).into())
        })
    };
    let opts = PoolOptions {
        concurrency: 2,
        exit_when_idle: true,
        ..PoolOptions::default()
    };
    assert_eq!(opts.job_lease_ms, 30_000);
    let pool = run_pool(
        Arc::new(backend.clone()),
        backend.clone(),
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    );
    let stamp = |what| stamps.lock().unwrap().get(what).copied();
    wait_for(20, "the long job's start", || {
        stamp("long started").is_some()
    });
    thread::sleep(Duration::from_millis(200));
    assert_eq!(
        backend.cancel("s0", ids[0]).unwrap(),
        shardq_core::CancelOutcome::Stopping
    );
    let cancelled = Instant::now();
    wait_for(60, "the next job's start", || {
        stamp("next started").is_some()
    });
    let report = pool.join().unwrap().unwrap();
    let (ended, next) = (stamp("long ended").unwrap(), stamp("next started").unwrap());
    assert!(
        ended <= next,
        "the next job started {:?} before the cancelled run's handler returned",
        ended - next
    );
    let took = next - cancelled;
    assert!(
        took < Duration::from_secs(3),
        "the key's next job started {took:?} after the cancel (the heartbeat is 10 s)"
    );
    assert_eq!((report.acked, report.stale, report.retried), (1, 1, 0));
    assert_eq!(
        backend.job("s0", ids[0]).unwrap(),
        None,
        "the cancelled job is gone"
    );
}

/// Past `job_timeout_ms` the run is cancelled; a handler that stops on
/// cancellation fails the attempt, which retries and then dead-letters.
/// On a manual clock moved on 5 ms per real ms (the job timeout and the
/// retry's backoff pass in a fifth of their time).
#[test]
fn a_handler_past_its_job_timeout_is_cancelled_and_fails() {
    let clock = ManualClock::new(1_000_000);
    let backend = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    let mut job = NewJob::new("k", "hang");
    job.max_attempts = 2;
    backend.enqueue("s0", 1, &[job]).unwrap();
    let handler: Arc<shardq_core::Handler> = Arc::new(|_job: &ClaimedJob| {
        let run = current_run().expect("a handler runs inside a run");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !run.is_cancelled() {
            if Instant::now() > deadline {
                return Ok(());
            }
            thread::sleep(Duration::from_millis(1));
        }
        Err(format!("stopped: {}", run.cancel_reason()).into())
    });
    let opts = PoolOptions {
        concurrency: 1,
        job_timeout_ms: Some(50),
        exit_when_idle: true,
        ..PoolOptions::default()
    };
    let started = Instant::now();
    let _ticker = Ticker::start(&clock, 5);
    let report = run_pool_on(
        Arc::new(clock.clone()),
        Arc::new(backend.clone()),
        backend.clone(),
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    )
    .join()
    .unwrap()
    .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!((report.timed_out, report.retried, report.dead), (2, 1, 1));
    let dead = backend.dead_list("s0", 10).unwrap();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].reason.contains("job timeout 50 ms"),
        "{}",
        dead[0].reason
    );
}

/// Shutdown past the drain timeout cancels the running handler and waits
/// for it: the pool returns only after the handler did, and the job is
/// left for the next owner (not acked). On a manual clock, moved on by
/// the handler while it waits for its cancel; its clean-up after the
/// cancel takes real time, which the pool must wait out whatever its clock.
#[test]
fn shutdown_waits_for_cancelled_handlers_before_giving_up_shards() {
    let clock = ManualClock::new(1_000_000);
    let backend = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    backend.enqueue("s0", 1, &[NewJob::new("k", "x")]).unwrap();
    let started = Arc::new(AtomicBool::new(false));
    let returned = Arc::new(AtomicBool::new(false));
    let handler: Arc<shardq_core::Handler> = {
        let (started, returned, clock) = (started.clone(), returned.clone(), clock.clone());
        Arc::new(move |_job: &ClaimedJob| {
            started.store(true, Ordering::SeqCst);
            let run = current_run().unwrap();
            while !run.is_cancelled() {
                clock.advance(5);
                thread::sleep(Duration::from_millis(1));
            }
            // Real time: clean-up takes a while after the cancel (a child
            // being killed), which the pool must wait out.
            thread::sleep(Duration::from_millis(200));
            returned.store(true, Ordering::SeqCst);
            Ok(())
        })
    };
    let stop = Arc::new(AtomicBool::new(false));
    let opts = PoolOptions {
        concurrency: 1,
        drain_timeout_ms: 50,
        ..PoolOptions::default()
    };
    let pool = run_pool_on(
        Arc::new(clock.clone()),
        Arc::new(backend.clone()),
        backend.clone(),
        handler,
        opts,
        stop.clone(),
    );
    wait_for(10, "the handler to start", || {
        started.load(Ordering::SeqCst)
    });
    stop.store(true, Ordering::SeqCst);
    let report = pool.join().unwrap().unwrap();
    assert!(
        returned.load(Ordering::SeqCst),
        "the pool gave its shard up while a handler still ran"
    );
    assert_eq!(report.abandoned, 1);
    assert_eq!(report.acked, 0, "a cancelled run's success is not an ack");
    // The cancelled attempt failed; the job is still there for the next owner.
    backend.adopt("s0").unwrap();
    let mut again = Vec::new();
    wait_for(5, "the job to be claimable again", || {
        clock.advance(50); // past the failed attempt's backoff
        again = backend.claim("s0", 1, 1_000).unwrap();
        !again.is_empty()
    });
    assert_eq!(again[0].attempt, 2);
}

/// A memory backend with faults: one corrupt shard (every call on it fails)
/// and, when armed, a stall of the whole process right before a claim.
struct OneBroken {
    inner: MemoryBackend,
    broken: String,
    /// The clock moves on by this much (once) when the next claim starts,
    /// as if the process had been stopped between heartbeat and claim.
    stall_before_claim: Option<(ManualClock, Arc<AtomicU64>)>,
    /// Extend calls with at least one receipt (the pool's heartbeats).
    extends: Arc<AtomicUsize>,
    /// While set, every extend fails (the store unreachable for a moment).
    extends_fail: Arc<AtomicBool>,
    /// This many of the next ack calls fail as unavailable (a shard's
    /// append lock held by a stalled process).
    acks_fail: Arc<AtomicU64>,
    /// This many of the next claim calls fail as unavailable.
    claims_fail: Arc<AtomicU64>,
}

impl OneBroken {
    /// No shard broken, no stall: `inner` with its heartbeats counted.
    fn healthy(inner: MemoryBackend) -> OneBroken {
        OneBroken {
            inner,
            broken: String::new(),
            stall_before_claim: None,
            extends: Arc::default(),
            extends_fail: Arc::default(),
            acks_fail: Arc::default(),
            claims_fail: Arc::default(),
        }
    }

    /// `inner` whose next claim first moves `clock` on by the returned
    /// counter's ms (once), as a process stopped before a claim sees it.
    fn stalling(inner: &MemoryBackend, clock: &ManualClock) -> (Arc<OneBroken>, Arc<AtomicU64>) {
        let stall = Arc::new(AtomicU64::new(0));
        let backend = OneBroken {
            stall_before_claim: Some((clock.clone(), stall.clone())),
            ..OneBroken::healthy(inner.clone())
        };
        (Arc::new(backend), stall)
    }

    fn check(&self, shard: &str) -> Result<(), QueueError> {
        if shard == self.broken {
            return Err(QueueError::Corrupt {
                shard: shard.to_string(),
                segment: "00000000000000000000.log".into(),
                offset: 4096,
                reason: "checksum mismatch".into(),
            });
        }
        Ok(())
    }
}

/// Takes one from `left` and fails as unavailable (a shard's append lock
/// held by a stalled process) while there was one to take.
fn refuse_one(left: &AtomicU64, shard: &str) -> Result<(), QueueError> {
    if left
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return Err(QueueError::Unavailable {
            shard: shard.to_string(),
            reason: "its append lock is held by another process (stalled?)".into(),
        });
    }
    Ok(())
}

impl RunJobs for OneBroken {
    fn shard_names(&self) -> Vec<String> {
        self.inner.shard_names()
    }

    fn enqueue(&self, s: &str, v: u64, jobs: &[NewJob]) -> Result<Vec<JobId>, QueueError> {
        self.inner.enqueue(s, v, jobs)
    }

    fn adopt(&self, s: &str) -> Result<(), QueueError> {
        self.check(s)?;
        self.inner.adopt(s)
    }

    fn release(&self, s: &str) -> Result<(), QueueError> {
        self.inner.release(s)
    }

    fn claim(&self, s: &str, max: usize, lease: u64) -> Result<Vec<ClaimedJob>, QueueError> {
        self.check(s)?;
        refuse_one(&self.claims_fail, s)?;
        if let Some((clock, ms)) = &self.stall_before_claim {
            clock.advance(ms.swap(0, Ordering::SeqCst));
        }
        self.inner.claim(s, max, lease)
    }

    fn ack_results(
        &self,
        s: &str,
        r: &[Receipt],
        results: &[Option<Vec<u8>>],
    ) -> Result<AckOutcome, QueueError> {
        refuse_one(&self.acks_fail, s)?;
        self.inner.ack_results(s, r, results)
    }

    fn fail(
        &self,
        s: &str,
        r: Receipt,
        why: &str,
        retry: Option<u64>,
    ) -> Result<FailOutcome, QueueError> {
        self.inner.fail(s, r, why, retry)
    }

    fn extend(&self, s: &str, r: &[Receipt], lease: u64) -> Result<Vec<Receipt>, QueueError> {
        if self.extends_fail.load(Ordering::SeqCst) {
            return Err(QueueError::Unavailable {
                shard: s.to_string(),
                reason: "extending job leases: the test makes it fail".into(),
            });
        }
        let out = self.inner.extend(s, r, lease);
        if !r.is_empty() {
            self.extends.fetch_add(1, Ordering::SeqCst);
        }
        out
    }

    fn stale_runs(&self, s: &str, r: &[Receipt]) -> Result<Vec<Receipt>, QueueError> {
        self.inner.stale_runs(s, r)
    }

    fn next_due_ms(&self, s: &str) -> Result<Option<u64>, QueueError> {
        self.check(s)?;
        self.inner.next_due_ms(s)
    }

    fn key_concurrency(&self, key: &str) -> u32 {
        self.inner.key_concurrency(key)
    }
}

impl MoveKeys for OneBroken {
    fn fence(&self, s: &str) -> Result<Fence, QueueError> {
        self.inner.fence(s)
    }

    fn set_fence(&self, s: &str, f: &Fence) -> Result<(), QueueError> {
        self.inner.set_fence(s, f)
    }
}

impl InspectJobs for OneBroken {
    fn key_counts(&self, s: &str, key: &str) -> Result<KeyCounts, QueueError> {
        self.inner.key_counts(s, key)
    }

    fn shard_stats(&self, s: &str) -> Result<ShardStats, QueueError> {
        self.inner.shard_stats(s)
    }

    fn dead_list(&self, s: &str, limit: usize) -> Result<Vec<DeadJob>, QueueError> {
        self.inner.dead_list(s, limit)
    }

    fn dead_retry(&self, s: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.inner.dead_retry(s, ids)
    }

    fn dead_purge(&self, s: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.inner.dead_purge(s, ids)
    }

    fn job(&self, s: &str, id: JobId) -> Result<Option<shardq_core::JobInfo>, QueueError> {
        self.inner.job(s, id)
    }
}

/// Acks refused for a moment (a shard's append lock held by a stalled
/// process) are kept and sent again: every job runs once, none waits for
/// its job lease to lapse and runs again, and the results given with the
/// refused acks are kept.
#[test]
fn acks_refused_for_a_moment_are_sent_again_and_no_job_runs_twice() {
    let inner = MemoryBackend::new(&["s0"], Arc::new(SystemClock));
    let jobs: Vec<NewJob> = (0..30)
        .map(|i| NewJob::new(format!("k{}", i % 6), format!("{i}")))
        .collect();
    let ids = inner.enqueue("s0", 1, &jobs).unwrap();
    let backend = OneBroken::healthy(inner.clone());
    backend.acks_fail.store(4, Ordering::SeqCst);
    let acks_fail = backend.acks_fail.clone();
    let runs: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
    let handler: Arc<shardq_core::Handler> = {
        let runs = runs.clone();
        Arc::new(move |job: &ClaimedJob| {
            runs.lock().unwrap().push((
                String::from_utf8_lossy(&job.payload).into_owned(),
                job.attempt,
            ));
            shardq_core::pool::set_result(format!("r{}", String::from_utf8_lossy(&job.payload)));
            Ok(())
        })
    };
    let (_events, mut opts) = idle_exiting_pool_recording_events();
    // Long enough that a dropped ack's job would run again within the test
    // only by a bug (its lease lapsing), short enough to see it if it did.
    opts.job_lease_ms = 3_000;
    let report = run_pool(
        Arc::new(backend),
        inner.clone(),
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    )
    .join()
    .unwrap()
    .unwrap();
    assert_eq!(acks_fail.load(Ordering::SeqCst), 0, "the refusals happened");
    let runs = runs.lock().unwrap().clone();
    let mut payloads: Vec<u32> = runs.iter().map(|(p, _)| p.parse().unwrap()).collect();
    payloads.sort_unstable();
    assert_eq!(
        payloads,
        (0..30).collect::<Vec<u32>>(),
        "each job ran once: {runs:?}"
    );
    assert!(runs.iter().all(|(_, a)| *a == 1), "{runs:?}");
    assert_eq!(report.acked, 30);
    let f = inner.finished("s0", None, 100).unwrap();
    assert_eq!(f.len(), 30);
    for id in ids {
        let done = f.iter().find(|j| j.id == id).expect("finished");
        assert!(done.result.is_some(), "job {id} kept its result");
    }
}

/// A pool that exits when idle waits for a shard whose claim failed for a
/// moment (its append lock held) and runs its jobs at the shard's retry,
/// instead of ending with the shard failed while its jobs wait.
#[test]
fn an_idle_exiting_pool_waits_for_a_shard_that_failed_for_a_moment() {
    let clock = ManualClock::new(1_000_000);
    let inner = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    let jobs: Vec<NewJob> = (0..5).map(|i| NewJob::new(format!("k{i}"), "x")).collect();
    inner.enqueue("s0", 1, &jobs).unwrap();
    let backend = OneBroken::healthy(inner.clone());
    backend.claims_fail.store(1, Ordering::SeqCst);
    let ran = Arc::new(AtomicUsize::new(0));
    let handler: Arc<shardq_core::Handler> = {
        let ran = ran.clone();
        Arc::new(move |_: &ClaimedJob| {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    };
    let (_events, opts) = idle_exiting_pool_recording_events();
    let _ticker = Ticker::start(&clock, 20);
    let report = run_pool_on(
        Arc::new(clock.clone()),
        Arc::new(backend),
        inner.clone(),
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    )
    .join()
    .unwrap()
    .expect("the pool waits for the shard's retry and ends cleanly");
    assert_eq!((report.acked, ran.load(Ordering::SeqCst)), (5, 5));
}

/// Regression: one corrupt shard stopped the whole worker. Now it stops
/// that shard only (reported once), the others run all their jobs, and a
/// batch run ends with an error naming the failed shard.
#[test]
fn one_corrupt_shard_stops_only_itself() {
    let inner = MemoryBackend::new(&["s0", "s1", "s2"], Arc::new(SystemClock));
    for s in ["s0", "s1", "s2"] {
        let jobs: Vec<NewJob> = (0..50)
            .map(|i| NewJob::new(format!("{s}-k{}", i % 5), "x"))
            .collect();
        inner.enqueue(s, 1, &jobs).unwrap();
    }
    let backend = Arc::new(OneBroken {
        inner: inner.clone(),
        broken: "s1".into(),
        stall_before_claim: None,
        extends: Arc::default(),
        extends_fail: Arc::default(),
        acks_fail: Arc::default(),
        claims_fail: Arc::default(),
    });
    let events = Arc::new(Mutex::new(Vec::new()));
    let opts = PoolOptions {
        concurrency: 4,
        exit_when_idle: true,
        on_event: {
            let events = events.clone();
            Arc::new(move |e| events.lock().unwrap().push(e))
        },
        ..PoolOptions::default()
    };
    let err = run_pool(
        backend,
        inner.clone(),
        Arc::new(|_: &ClaimedJob| Ok(())),
        opts,
        Arc::new(AtomicBool::new(false)),
    )
    .join()
    .unwrap()
    .unwrap_err();
    assert!(err.to_string().contains("\"s1\""), "{err}");
    for s in ["s0", "s2"] {
        let st = inner.shard_stats(s).unwrap();
        assert_eq!(
            (st.ready, st.in_flight),
            (0, 0),
            "healthy shard {s} was not drained"
        );
    }
    assert_eq!(
        inner.shard_stats("s1").unwrap().ready,
        50,
        "nothing of s1 ran"
    );
    let failed: Vec<PoolEvent> = events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, PoolEvent::ShardFailed { .. }))
        .cloned()
        .collect();
    assert_eq!(failed.len(), 1, "the failure is reported once: {failed:?}");
}

/// Every run is reported when it starts and when its result is recorded,
/// with how it ended, so metrics can count and time runs.
#[test]
fn runs_are_reported_when_they_start_and_finish() {
    let backend = MemoryBackend::new(&["s0"], Arc::new(SystemClock));
    let mut jobs: Vec<NewJob> = (0..4).map(|i| NewJob::new(format!("k{i}"), "ok")).collect();
    jobs[3].payload = b"fail".to_vec();
    jobs[3].max_attempts = 2;
    backend.enqueue("s0", 1, &jobs).unwrap();
    let (events, opts) = idle_exiting_pool_recording_events();
    let handler: Arc<shardq_core::Handler> = Arc::new(|job: &ClaimedJob| {
        if job.payload == b"fail" {
            Err("no".into())
        } else {
            Ok(())
        }
    });
    let report = run_pool(
        Arc::new(backend.clone()),
        backend,
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    )
    .join()
    .unwrap()
    .unwrap();
    assert_eq!((report.acked, report.retried, report.dead), (3, 1, 1));
    let events = events.lock().unwrap().clone();
    let started = events
        .iter()
        .filter(|e| matches!(e, PoolEvent::RunStarted { shard, .. } if shard == "s0"))
        .count();
    let mut outcomes: Vec<RunOutcome> = events
        .iter()
        .filter_map(|e| match e {
            PoolEvent::RunFinished { outcome, .. } => Some(*outcome),
            _ => None,
        })
        .collect();
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(started, 5, "{events:?}");
    assert_eq!(
        outcomes,
        [
            RunOutcome::Acked,
            RunOutcome::Acked,
            RunOutcome::Acked,
            RunOutcome::Dead,
            RunOutcome::Retried
        ]
    );
}

/// A coordinator whose release cannot be taken in time (a stalled lock
/// holder, an unreachable store): the shards' leases lapse by themselves,
/// and the drain that finished still reports its work.
struct ReleaseUnavailable(MemoryCoordinator);

impl shardq_core::Coordinator for ReleaseUnavailable {
    fn tick(&mut self) -> Result<shardq_core::backend::Ownership, QueueError> {
        self.0.tick()
    }
    fn stop_claiming(&mut self) {
        self.0.stop_claiming()
    }
    fn release_all(&mut self) -> Result<(), QueueError> {
        Err(QueueError::Unavailable {
            shard: "*".into(),
            reason: "the membership lock is held (test)".into(),
        })
    }
    fn tick_interval_ms(&self) -> u64 {
        self.0.tick_interval_ms()
    }
    fn standby_reason(&self) -> String {
        self.0.standby_reason()
    }
}

#[test]
fn a_release_that_times_out_keeps_the_drains_report() {
    let backend = MemoryBackend::new(&["s0"], Arc::new(SystemClock));
    let jobs: Vec<NewJob> = (0..3).map(|i| NewJob::new(format!("k{i}"), "ok")).collect();
    backend.enqueue("s0", 1, &jobs).unwrap();
    let (events, opts) = idle_exiting_pool_recording_events();
    let mut coord = ReleaseUnavailable(MemoryCoordinator::new(backend.clone()));
    let report = WorkerPool::run(
        Arc::new(backend.clone()),
        &mut coord,
        Arc::new(|_: &ClaimedJob| Ok(())),
        Arc::new(SystemClock),
        opts,
        &AtomicBool::new(false),
    )
    .expect("a release the store could not take is not the drain's failure");
    assert_eq!(report.acked, 3);
    let events = events.lock().unwrap().clone();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, PoolEvent::RecordFailed(m) if m.contains("releasing the shards"))),
        "{events:?}"
    );
}

/// Regression: a stall longer than the job lease between a heartbeat and a
/// claim made the claim start the lapsed jobs again while their handlers
/// still ran, in the same pool (two runs of a key at once), and the new
/// runs were tracked under the old runs' entries. Now the pool stops the
/// old handler and starts the new run once it returned. The real pool runs
/// on a manual clock; the stall is the clock jumping inside the claim.
#[test]
fn a_stall_past_the_job_lease_never_runs_a_key_twice_at_once() {
    let clock = ManualClock::new(1_000_000);
    let inner = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    for key in ["a", "b"] {
        let jobs: Vec<NewJob> = (0..2).map(|i| NewJob::new(key, format!("{i}"))).collect();
        inner.enqueue("s0", 1, &jobs).unwrap();
    }
    let (backend, stall) = OneBroken::stalling(&inner, &clock);
    let running: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let overlaps = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(AtomicBool::new(false));
    let handler: Arc<shardq_core::Handler> = {
        let (running, overlaps, started, release) = (
            running.clone(),
            overlaps.clone(),
            started.clone(),
            release.clone(),
        );
        Arc::new(move |job: &ClaimedJob| {
            {
                let mut r = running.lock().unwrap();
                let n = r.entry(job.key.clone()).or_default();
                if *n > 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                *n += 1;
            }
            started.fetch_add(1, Ordering::SeqCst);
            // Runs until released or cancelled (bounded: 20 s).
            let run = current_run().unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            while !release.load(Ordering::SeqCst) && !run.is_cancelled() {
                assert!(Instant::now() < deadline, "the handler was never released");
                thread::sleep(Duration::from_millis(1));
            }
            *running.lock().unwrap().get_mut(&job.key).unwrap() -= 1;
            Ok(())
        })
    };
    let pool = run_stalling_pool(&backend, &clock, 4, handler);
    wait_for(10, "both keys' first jobs to run", || {
        started.load(Ordering::SeqCst) == 2
    });
    // Stopped for 5 s, past the 3 s job lease, right before a claim.
    stall.store(5_000, Ordering::SeqCst);
    wait_for(10, "the claim after the stall", || {
        stall.load(Ordering::SeqCst) == 0
    });
    wait_for(10, "the lapsed jobs to run again", || {
        started.load(Ordering::SeqCst) >= 4
    });
    release.store(true, Ordering::SeqCst);
    let report = pool.join().unwrap().unwrap();
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "a key ran twice at once"
    );
    assert_eq!(report.acked, 4, "{report:?}");
    assert_eq!(
        report.stale, 2,
        "the lapsed runs' results were refused: {report:?}"
    );
    for key in ["a", "b"] {
        let c = backend.key_counts("s0", key).unwrap();
        assert_eq!((c.depth, c.in_flight, c.dead), (0, 0, 0), "key {key}");
    }
}

/// A stall past the job lease while keys of concurrency 3 run three jobs
/// each: the store starts their jobs again (key `c:a`) or, their one
/// attempt used up, the key's next three (`c:b`); the pool runs the new
/// runs only once the old handlers returned, so no key ever has more than
/// three handlers at once, and every job is acked once.
#[test]
fn a_stall_never_runs_a_key_more_often_at_once_than_its_concurrency() {
    use shardq_core::flow::{FlowPolicy, FlowSettings};
    use shardq_core::{FlowControl, LocalGroupBuckets};
    let clock = ManualClock::new(1_000_000);
    let mut settings = FlowSettings::default();
    settings.prefixes.insert(
        "c:".into(),
        FlowPolicy {
            concurrency: 3,
            ..FlowPolicy::default()
        },
    );
    let flow = Arc::new(FlowControl::new(
        settings,
        Arc::new(LocalGroupBuckets::default()),
    ));
    let inner = MemoryBackend::new(&["s0"], Arc::new(clock.clone())).with_flow(flow);
    for (key, attempts) in [("c:a", 5), ("c:b", 1)] {
        let jobs: Vec<NewJob> = (0..6)
            .map(|i| {
                let mut j = NewJob::new(key, format!("{i}"));
                j.max_attempts = attempts;
                j
            })
            .collect();
        inner.enqueue("s0", 1, &jobs).unwrap();
    }
    let (backend, stall) = OneBroken::stalling(&inner, &clock);
    let running: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let peak: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let started = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(AtomicBool::new(false));
    let handler: Arc<shardq_core::Handler> = {
        let (running, peak, started, release) = (
            running.clone(),
            peak.clone(),
            started.clone(),
            release.clone(),
        );
        Arc::new(move |job: &ClaimedJob| {
            {
                let mut r = running.lock().unwrap();
                let n = r.entry(job.key.clone()).or_default();
                *n += 1;
                let mut p = peak.lock().unwrap();
                let m = p.entry(job.key.clone()).or_default();
                *m = (*m).max(*n);
            }
            started.fetch_add(1, Ordering::SeqCst);
            let run = current_run().unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            while !release.load(Ordering::SeqCst) && !run.is_cancelled() {
                assert!(Instant::now() < deadline, "the handler was never released");
                thread::sleep(Duration::from_millis(1));
            }
            *running.lock().unwrap().get_mut(&job.key).unwrap() -= 1;
            Ok(())
        })
    };
    let pool = run_stalling_pool(&backend, &clock, 16, handler);
    wait_for(10, "three jobs of each key to run", || {
        started.load(Ordering::SeqCst) == 6
    });
    stall.store(5_000, Ordering::SeqCst);
    wait_for(10, "the claim after the stall", || {
        stall.load(Ordering::SeqCst) == 0
    });
    wait_for(10, "the new runs to start", || {
        started.load(Ordering::SeqCst) >= 12
    });
    release.store(true, Ordering::SeqCst);
    let report = pool.join().unwrap().unwrap();
    let peak = peak.lock().unwrap().clone();
    assert_eq!(
        peak.values().copied().collect::<Vec<_>>(),
        [3, 3],
        "handlers of a key at once: {peak:?}"
    );
    // c:a: 6 acked (3 of them on their second run); c:b: 3 dead, 3 acked.
    assert_eq!(report.acked, 9, "{report:?}");
    assert_eq!(report.stale, 6, "the lapsed runs' results were refused");
    let a = backend.key_counts("s0", "c:a").unwrap();
    assert_eq!((a.depth, a.in_flight, a.dead), (0, 0, 0));
    let b = backend.key_counts("s0", "c:b").unwrap();
    assert_eq!((b.depth, b.in_flight, b.dead), (0, 0, 3));
}

/// Two stalls past the job lease while a job's first handler hangs (it
/// ignores its cancel): the first makes the store run the job again, and
/// that run waits (parked) for the hung handler; the second makes the
/// store run it a third time while the second run is still parked. The
/// parked run is over too: it never runs, and the job has one handler at
/// a time, the third run's once the first returned.
#[test]
fn a_parked_run_whose_job_runs_again_never_starts() {
    let clock = ManualClock::new(1_000_000);
    let inner = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    let mut job = NewJob::new("a", "x");
    job.max_attempts = 10;
    inner.enqueue("s0", 1, &[job]).unwrap();
    let store = inner.clone();
    let (backend, stall) = OneBroken::stalling(&inner, &clock);
    let (running, peak, started) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let release = Arc::new(AtomicBool::new(false));
    let handler: Arc<shardq_core::Handler> = {
        let (running, peak, started, release) = (
            running.clone(),
            peak.clone(),
            started.clone(),
            release.clone(),
        );
        Arc::new(move |_job: &ClaimedJob| {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            if started.fetch_add(1, Ordering::SeqCst) == 0 {
                // The first run hangs, deaf to its cancel (bounded: 20 s).
                let deadline = Instant::now() + Duration::from_secs(20);
                while !release.load(Ordering::SeqCst) {
                    assert!(Instant::now() < deadline, "never released");
                    thread::sleep(Duration::from_millis(1));
                }
            }
            running.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
    };
    let pool = run_stalling_pool(&backend, &clock, 4, handler);
    wait_for(10, "the first run", || started.load(Ordering::SeqCst) == 1);
    // The job's current run's fence (0 between runs).
    let fence_now = || {
        let jobs = store.key_jobs("s0", "a", 1).unwrap();
        jobs.first()
            .and_then(|j| j.run)
            .map_or(0, |(fence, _)| fence)
    };
    // Heartbeats fail from now on, so only claims can tell the pool a run
    // is over.
    backend.extends_fail.store(true, Ordering::SeqCst);
    for _ in 0..2 {
        let before = fence_now();
        stall.store(5_000, Ordering::SeqCst);
        wait_for(10, "a new run after the stall", || fence_now() > before);
    }
    release.store(true, Ordering::SeqCst);
    let report = pool.join().unwrap().unwrap();
    assert_eq!(
        peak.load(Ordering::SeqCst),
        1,
        "two handlers of one job at once"
    );
    assert_eq!(
        started.load(Ordering::SeqCst),
        2,
        "the first run and the third ran; the parked second never did"
    );
    assert_eq!(report.acked, 1, "{report:?}");
}

/// A pool of `concurrency` slots on `clock` running `handler` over
/// `backend` (a 3 s job lease, a 1 ms idle poll) until idle.
fn run_stalling_pool(
    backend: &Arc<OneBroken>,
    clock: &ManualClock,
    concurrency: usize,
    handler: Arc<shardq_core::Handler>,
) -> thread::JoinHandle<Result<PoolReport, QueueError>> {
    let opts = PoolOptions {
        concurrency,
        job_lease_ms: 3_000,
        idle_poll_ms: 1,
        exit_when_idle: true,
        ..PoolOptions::default()
    };
    let coordinator_of = backend.inner.clone();
    let backend: Arc<dyn QueueBackend> = backend.clone();
    run_pool_on(
        Arc::new(clock.clone()),
        backend,
        coordinator_of,
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    )
}

/// A memory backend over `shards` whose keys with each prefix of
/// `weights` have that weight (flow control ranks them).
fn weighted_memory(shards: &[&str], weights: &[(&str, u32)]) -> MemoryBackend {
    use shardq_core::flow::{FlowPolicy, FlowSettings};
    use shardq_core::{FlowControl, LocalGroupBuckets};
    let mut settings = FlowSettings::default();
    for (p, w) in weights {
        settings.prefixes.insert(
            (*p).into(),
            FlowPolicy {
                weight: *w,
                ..FlowPolicy::default()
            },
        );
    }
    let flow = Arc::new(FlowControl::new(
        settings,
        Arc::new(LocalGroupBuckets::default()),
    ));
    MemoryBackend::new(shards, Arc::new(SystemClock)).with_flow(flow)
}

/// Runs `mem`'s jobs with a pool of one slot until idle: the keys in the
/// order their runs started.
fn one_slot_starts(mem: MemoryBackend) -> Vec<String> {
    let order = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&order);
    let handler: Arc<shardq_core::Handler> = Arc::new(move |job: &ClaimedJob| {
        seen.lock().unwrap().push(job.key.clone());
        Ok(())
    });
    let opts = PoolOptions {
        concurrency: 1,
        exit_when_idle: true,
        ..PoolOptions::default()
    };
    let backend: Arc<dyn QueueBackend> = Arc::new(mem.clone());
    run_pool(
        backend,
        mem,
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    )
    .join()
    .unwrap()
    .unwrap();
    let starts = order.lock().unwrap().clone();
    starts
}

/// How many of the first `n` of `starts` are of each of `keys`.
fn counts_of(starts: &[String], n: usize, keys: &[&str]) -> Vec<i64> {
    (keys.iter())
        .map(|k| starts[..n].iter().filter(|x| x == k).count() as i64)
        .collect()
}

/// A pool of one slot over keys of weights 1, 2 and 4 (flow control ranks
/// them) starts them 1:2:4: with ranked keys it claims only for its free
/// slot, so every start goes to the best-ranked ready key (claimed ahead,
/// the two keys in flight would leave one choice, round robin).
#[test]
fn a_pool_of_one_slot_starts_weighted_keys_in_proportion() {
    let mem = weighted_memory(&["s"], &[("w1:", 1), ("w2:", 2), ("w4:", 4)]);
    for i in 0..100 {
        for k in ["w1:a", "w2:a", "w4:a"] {
            mem.enqueue("s", u64::MAX, &[NewJob::new(k, i.to_string())])
                .unwrap();
        }
    }
    let starts = one_slot_starts(mem);
    assert_eq!(starts.len(), 300);
    let got = counts_of(&starts, 140, &["w1:a", "w2:a", "w4:a"]);
    for (g, want) in got.iter().zip([20, 40, 80]) {
        assert!(
            (g - want).abs() <= 2,
            "the first 140 starts by weight 1:2:4: {got:?}"
        );
    }
}

/// With ranked keys a pool claims for every slot that frees, not once all
/// are free: a pool of 2 slots whose first run blocks keeps running the
/// other keys' jobs on its second slot meanwhile (it used to wait for the
/// blocked run, leaving the slot idle).
#[test]
fn a_ranked_pool_refills_a_slot_while_another_run_goes_on() {
    use shardq_core::flow::{FlowPolicy, FlowSettings};
    use shardq_core::{FlowControl, LocalGroupBuckets};
    let settings = FlowSettings {
        default: FlowPolicy {
            weight: 2,
            ..FlowPolicy::default()
        },
        ..FlowSettings::default()
    };
    let flow = Arc::new(FlowControl::new(
        settings,
        Arc::new(LocalGroupBuckets::default()),
    ));
    let mem = MemoryBackend::new(&["s"], Arc::new(SystemClock)).with_flow(flow);
    mem.enqueue("s", u64::MAX, &[NewJob::new("slow", "x")])
        .unwrap();
    for i in 0..20 {
        mem.enqueue("s", u64::MAX, &[NewJob::new("quick", i.to_string())])
            .unwrap();
    }
    let release = Arc::new(AtomicBool::new(false));
    let quick_done = Arc::new(AtomicUsize::new(0));
    let (r, q) = (Arc::clone(&release), Arc::clone(&quick_done));
    let handler: Arc<shardq_core::Handler> = Arc::new(move |job: &ClaimedJob| {
        if job.key == "slow" {
            while !r.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(1));
            }
        } else {
            q.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    });
    let opts = PoolOptions {
        concurrency: 2,
        exit_when_idle: true,
        ..PoolOptions::default()
    };
    let backend: Arc<dyn QueueBackend> = Arc::new(mem.clone());
    let pool = run_pool(
        backend,
        mem,
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    );
    let t0 = Instant::now();
    while quick_done.load(Ordering::SeqCst) < 20 && t0.elapsed() < Duration::from_secs(20) {
        thread::sleep(Duration::from_millis(2));
    }
    let done_while_blocked = quick_done.load(Ordering::SeqCst);
    release.store(true, Ordering::SeqCst);
    let report = pool.join().unwrap().unwrap();
    assert_eq!(report.acked, 21, "{report:?}");
    assert_eq!(
        done_while_blocked, 20,
        "the quick key's jobs run on the free slot while the slow run goes on"
    );
}

/// Weights hold over every shard of the process, not per shard: a pool of
/// one slot over two shards, a key of weight 1 on one and a key of weight
/// 4 on the other, starts them 1:4 (it used to give each shard its turn,
/// 1:1).
#[test]
fn a_pool_shares_its_slots_by_weight_across_its_shards() {
    let mem = weighted_memory(&["s0", "s1"], &[("w1:", 1), ("w4:", 4)]);
    for i in 0..100 {
        mem.enqueue("s0", u64::MAX, &[NewJob::new("w1:a", i.to_string())])
            .unwrap();
        mem.enqueue("s1", u64::MAX, &[NewJob::new("w4:a", i.to_string())])
            .unwrap();
    }
    let starts = one_slot_starts(mem);
    assert_eq!(starts.len(), 200);
    let got = counts_of(&starts, 100, &["w1:a", "w4:a"]);
    for (g, want) in got.iter().zip([20, 80]) {
        assert!(
            (g - want).abs() <= 2,
            "the first 100 starts by weight 1:4 over two shards: {got:?}"
        );
    }
}

/// Keys of equal rank on several shards (one job per key, so each starts
/// at the process's virtual time: all tie) take turns over the shards: a
/// pool of one slot over two shards starts them about half and half, not
/// one shard's every key before the other's first.
#[test]
fn equal_ranks_on_two_shards_take_turns() {
    let mem = weighted_memory(&["s0", "s1"], &[("t", 2)]);
    for i in 0..40 {
        for s in ["s0", "s1"] {
            let key = format!("t-{s}-{i}");
            mem.enqueue(s, u64::MAX, &[NewJob::new(key, "x")]).unwrap();
        }
    }
    let starts = one_slot_starts(mem);
    assert_eq!(starts.len(), 80);
    let from_s0 = starts[..40]
        .iter()
        .filter(|k| k.starts_with("t-s0"))
        .count();
    assert!(
        (15..=25).contains(&from_s0),
        "the first 40 starts take turns over the shards: {from_s0} from s0"
    );
}

/// A handler that always backs off, for 0 ms, neither spins its key nor
/// keeps its job forever: every back-off holds the key at least
/// `BACKOFF_MS_MIN` (by the clock the pool runs on), and past
/// `BACKOFFS_IN_A_ROW_MAX` in a row the next is a failed attempt, so the
/// job ends in the dead letters with a reason that says why.
#[test]
fn a_handler_that_always_backs_off_ends_in_the_dead_letters() {
    use shardq_core::backoff::{BACKOFFS_IN_A_ROW_MAX, BACKOFF_MS_MIN};
    let clock = ManualClock::new(1_000_000);
    let backend = MemoryBackend::new(&["s0"], Arc::new(clock.clone()));
    let mut job = NewJob::new("k", "x");
    job.max_attempts = 2;
    backend.enqueue("s0", 1, &[job]).unwrap();
    let starts = Arc::new(Mutex::new(Vec::new()));
    let handler: Arc<shardq_core::Handler> = {
        let (starts, clock) = (starts.clone(), clock.clone());
        Arc::new(move |_job: &ClaimedJob| {
            starts.lock().unwrap().push(clock.now_ms());
            Err(Box::new(shardq_core::BackOff {
                ms: 0,
                group: false,
            }))
        })
    };
    let opts = PoolOptions {
        concurrency: 1,
        exit_when_idle: true,
        ..PoolOptions::default()
    };
    let _ticker = Ticker::start(&clock, 50);
    let report = run_pool_on(
        Arc::new(clock.clone()),
        Arc::new(backend.clone()),
        backend.clone(),
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    )
    .join()
    .unwrap()
    .unwrap();
    let dead = backend.dead_list("s0", 10).unwrap();
    assert_eq!(dead.len(), 1, "{report:?}");
    assert!(
        dead[0].reason.contains("times in a row"),
        "{}",
        dead[0].reason
    );
    let starts = starts.lock().unwrap();
    // Two attempts, each ending after the bound of back-offs.
    assert_eq!(
        starts.len() as u32,
        2 * (BACKOFFS_IN_A_ROW_MAX + 1),
        "{report:?}"
    );
    assert_eq!(report.backed_off as u32, 2 * BACKOFFS_IN_A_ROW_MAX);
    // No back-off started its key again sooner than the floor.
    let backed: Vec<u64> = starts.windows(2).map(|w| w[1] - w[0]).collect();
    let too_soon = (0..backed.len())
        .filter(|i| (i + 1) % (BACKOFFS_IN_A_ROW_MAX as usize + 1) != 0)
        .filter(|&i| backed[i] < BACKOFF_MS_MIN)
        .count();
    assert_eq!(too_soon, 0, "gaps {backed:?}");
}

/// A handler's `set_result` is kept with its finished job; a result over
/// the pool's bound fails the attempt (the job dies with the reason rather
/// than finishing without its result); a failed run's result is dropped.
#[test]
fn a_handlers_result_is_kept_and_one_over_the_bound_fails_its_attempt() {
    let inner = MemoryBackend::new(&["s0"], Arc::new(SystemClock));
    let mut jobs: Vec<NewJob> = ["ok", "big", "fails"]
        .iter()
        .map(|k| NewJob::new(*k, "p"))
        .collect();
    for j in &mut jobs[1..] {
        j.max_attempts = 1;
    }
    inner.enqueue("s0", 1, &jobs).unwrap();
    let handler: Arc<shardq_core::Handler> = Arc::new(|job: &ClaimedJob| {
        match job.key.as_str() {
            "ok" => shardq_core::pool::set_result(b"done".to_vec()),
            "big" => shardq_core::pool::set_result(vec![0u8; 9]),
            _ => {
                shardq_core::pool::set_result(b"never kept".to_vec());
                return Err("broken".into());
            }
        }
        Ok(())
    });
    let opts = PoolOptions {
        exit_when_idle: true,
        result_bytes_max: 8,
        ..PoolOptions::default()
    };
    run_pool(
        Arc::new(inner.clone()),
        inner.clone(),
        handler,
        opts,
        Arc::new(AtomicBool::new(false)),
    )
    .join()
    .unwrap()
    .unwrap();
    let ok = inner.finished("s0", Some("ok"), 10).unwrap();
    assert_eq!(ok[0].result.as_deref(), Some(&b"done"[..]));
    let dead = inner.dead_list("s0", 10).unwrap();
    let why = |k: &str| {
        dead.iter()
            .find(|d| d.key == k)
            .expect("dead")
            .reason
            .clone()
    };
    assert!(
        why("big").contains("9 bytes, over the 8-byte bound"),
        "{dead:?}"
    );
    assert_eq!(why("fails"), "broken");
    assert!(inner.finished("s0", Some("fails"), 10).unwrap().is_empty());
}
