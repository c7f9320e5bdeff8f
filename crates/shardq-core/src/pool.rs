//! The process-wide worker pool: one concurrency limit shared by every shard
//! the process owns, on any [`QueueBackend`].
//!
//! One dispatcher thread (the caller of [`WorkerPool::run`]) ticks the
//! [`Coordinator`], claims jobs, and records acks and failures; `concurrency`
//! worker threads run the handler. The pool must never touch storage directly
//! and never run more than `concurrency` handlers at once.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use crate::backend::{Coordinator, QueueBackend};
use crate::clock::Clock;
use crate::error::QueueError;
use crate::job::{ClaimedJob, FailOutcome, Receipt, JOB_LEASE_MS_DEFAULT};

/// Largest worker count of one pool.
pub const CONCURRENCY_MAX: usize = 4096;
/// Default time to wait for in-flight jobs on shutdown (30 s).
pub const DRAIN_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Default longest sleep while idle before looking for new jobs again: bounds
/// the latency of jobs enqueued by other processes.
pub const IDLE_POLL_MS_DEFAULT: u64 = 5;
/// Most jobs claimed from one shard in one call.
pub const CLAIM_BATCH_MAX: usize = 1024;

/// A job handler: `Ok` acks the job, `Err(reason)` fails the attempt. A panic
/// counts as a failure.
pub type Handler = dyn Fn(&ClaimedJob) -> Result<(), String> + Send + Sync;

/// Something the pool reports while it runs (for logs).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolEvent {
    /// The process owns no shard and waits; the text says who owns what.
    Standby(String),
    /// A shard was claimed and adopted.
    Gained(String),
    /// A shard's lease was lost to another process.
    Lost(String),
    /// Shutdown began: no more claims, waiting for in-flight jobs.
    Draining {
        /// Jobs in flight when draining started.
        in_flight: usize,
    },
    /// An ack or fail could not be recorded (the job will run again).
    RecordFailed(String),
}

/// Options of [`WorkerPool::run`].
#[derive(Clone)]
pub struct PoolOptions {
    /// Handlers running at once, over all owned shards (1..=[`CONCURRENCY_MAX`]).
    pub concurrency: usize,
    /// How long shutdown waits for in-flight jobs, in ms.
    pub drain_timeout_ms: u64,
    /// Longest idle sleep between looks for new jobs, in ms.
    pub idle_poll_ms: u64,
    /// Return once the owned shards have nothing pending and nothing is in
    /// flight (batch runs and tests). A process that owns nothing keeps
    /// waiting, since a lease may lapse.
    pub exit_when_idle: bool,
    /// Called for each [`PoolEvent`].
    pub on_event: Arc<dyn Fn(PoolEvent) + Send + Sync>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            concurrency: 1,
            drain_timeout_ms: DRAIN_TIMEOUT_MS_DEFAULT,
            idle_poll_ms: IDLE_POLL_MS_DEFAULT,
            exit_when_idle: false,
            on_event: Arc::new(|_| {}),
        }
    }
}

impl std::fmt::Debug for PoolOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolOptions")
            .field("concurrency", &self.concurrency)
            .field("drain_timeout_ms", &self.drain_timeout_ms)
            .field("idle_poll_ms", &self.idle_poll_ms)
            .field("exit_when_idle", &self.exit_when_idle)
            .finish()
    }
}

/// What a pool run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolReport {
    /// Jobs acked.
    pub acked: u64,
    /// Failed attempts that will be retried.
    pub retried: u64,
    /// Jobs dead-lettered.
    pub dead: u64,
    /// Most handlers seen running at once.
    pub peak_in_flight: usize,
    /// Jobs still running when the drain timeout ran out (they run again
    /// under the next owner).
    pub abandoned: usize,
}

struct Outcome {
    shard: String,
    receipt: Receipt,
    result: Result<(), String>,
}

/// The worker pool. See the module docs.
pub struct WorkerPool;

impl WorkerPool {
    /// Runs jobs until `stop` is set (then drains and releases every claim)
    /// or, with `exit_when_idle`, until the owned shards are idle.
    pub fn run(
        backend: Arc<dyn QueueBackend>,
        coordinator: &mut dyn Coordinator,
        handler: Arc<Handler>,
        clock: Arc<dyn Clock>,
        opts: PoolOptions,
        stop: &AtomicBool,
    ) -> Result<PoolReport, QueueError> {
        if opts.concurrency == 0 || opts.concurrency > CONCURRENCY_MAX {
            return Err(QueueError::Backend(format!(
                "invalid concurrency {}: must be 1..={CONCURRENCY_MAX}",
                opts.concurrency
            )));
        }
        let (job_tx, job_rx) = mpsc::channel::<ClaimedJob>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let (out_tx, out_rx) = mpsc::channel::<Outcome>();
        let mut workers = Vec::with_capacity(opts.concurrency);
        for i in 0..opts.concurrency {
            let job_rx = Arc::clone(&job_rx);
            let out_tx = out_tx.clone();
            let handler = Arc::clone(&handler);
            let spawned = thread::Builder::new()
                .name(format!("shardq-worker-{i}"))
                .spawn(move || loop {
                    // The lock is held only while waiting for the next job.
                    let job = match job_rx.lock() {
                        Ok(rx) => match rx.recv() {
                            Ok(job) => job,
                            Err(_) => return,
                        },
                        Err(_) => return,
                    };
                    let result = catch_unwind(AssertUnwindSafe(|| handler(&job)))
                        .unwrap_or_else(|_| Err("handler panicked".to_string()));
                    let receipt = job.receipt();
                    let sent = out_tx.send(Outcome {
                        shard: job.shard,
                        receipt,
                        result,
                    });
                    if sent.is_err() {
                        return;
                    }
                });
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(e) => return Err(QueueError::io("spawning a worker thread", e)),
            }
        }
        drop(out_tx);

        let mut state = Dispatch {
            backend: &*backend,
            opts: &opts,
            report: PoolReport::default(),
            in_flight: 0,
            owned: Vec::new(),
        };
        let result = state.run_loop(coordinator, &*clock, stop, &job_tx, &out_rx);
        let abandoned = state.in_flight;
        for shard in std::mem::take(&mut state.owned) {
            let _ = backend.release(&shard);
        }
        let released = coordinator.release_all();
        drop(job_tx);
        if abandoned == 0 {
            for w in workers {
                let _ = w.join();
            }
        }
        let mut report = state.report;
        report.abandoned = abandoned;
        result?;
        released?;
        Ok(report)
    }
}

struct Dispatch<'a> {
    backend: &'a dyn QueueBackend,
    opts: &'a PoolOptions,
    report: PoolReport,
    in_flight: usize,
    owned: Vec<String>,
}

impl Dispatch<'_> {
    fn run_loop(
        &mut self,
        coordinator: &mut dyn Coordinator,
        clock: &dyn Clock,
        stop: &AtomicBool,
        job_tx: &mpsc::Sender<ClaimedJob>,
        out_rx: &mpsc::Receiver<Outcome>,
    ) -> Result<(), QueueError> {
        let tick_interval_ms = coordinator.tick_interval_ms().max(1);
        let mut next_tick_ms = 0u64;
        let mut drain_deadline_ms: Option<u64> = None;
        let mut standby_told = false;
        let mut rotate = 0usize;
        loop {
            let now = clock.now_ms();
            if drain_deadline_ms.is_none() && stop.load(Ordering::SeqCst) {
                coordinator.stop_claiming();
                drain_deadline_ms = Some(now.saturating_add(self.opts.drain_timeout_ms));
                (self.opts.on_event)(PoolEvent::Draining {
                    in_flight: self.in_flight,
                });
            }
            if now >= next_tick_ms {
                let own = coordinator.tick()?;
                for shard in &own.lost {
                    (self.opts.on_event)(PoolEvent::Lost(shard.clone()));
                    let _ = self.backend.release(shard);
                }
                for shard in &own.gained {
                    self.backend.adopt(shard)?;
                    (self.opts.on_event)(PoolEvent::Gained(shard.clone()));
                }
                self.owned = own.owned;
                if self.owned.is_empty() && !standby_told {
                    (self.opts.on_event)(PoolEvent::Standby(coordinator.standby_reason()));
                    standby_told = true;
                } else if !self.owned.is_empty() {
                    standby_told = false;
                }
                next_tick_ms = now.saturating_add(tick_interval_ms);
            }

            // Record every finished job at once: acks are grouped per shard,
            // so a durable backend fsyncs once per shard, not once per job.
            let finished: Vec<Outcome> = out_rx.try_iter().collect();
            if !finished.is_empty() {
                self.record(finished);
            }

            if let Some(deadline) = drain_deadline_ms {
                if self.in_flight == 0 || now >= deadline {
                    return Ok(());
                }
            }

            let mut claimed_any = false;
            if drain_deadline_ms.is_none() && !self.owned.is_empty() {
                let n = self.owned.len();
                for i in 0..n {
                    let free = self.opts.concurrency - self.in_flight;
                    if free == 0 {
                        break;
                    }
                    let shard = self.owned[(rotate + i) % n].clone();
                    // Share the free slots between shards so one busy shard
                    // cannot starve the others.
                    let share = free.div_ceil(n - i).clamp(1, CLAIM_BATCH_MAX);
                    let jobs = match self.backend.claim(&shard, share, JOB_LEASE_MS_DEFAULT) {
                        Ok(jobs) => jobs,
                        Err(QueueError::NotOwner { .. }) => continue,
                        Err(e) => return Err(e),
                    };
                    for job in jobs {
                        claimed_any = true;
                        self.in_flight += 1;
                        if job_tx.send(job).is_err() {
                            return Err(QueueError::Backend("all worker threads exited".into()));
                        }
                    }
                }
                rotate = rotate.wrapping_add(1);
                self.report.peak_in_flight = self.report.peak_in_flight.max(self.in_flight);
            }

            if self.opts.exit_when_idle
                && drain_deadline_ms.is_none()
                && !claimed_any
                && self.in_flight == 0
                && !self.owned.is_empty()
                && self.all_idle()?
            {
                return Ok(());
            }

            if claimed_any && self.in_flight < self.opts.concurrency {
                continue;
            }
            let mut wait_ms = self.opts.idle_poll_ms.max(1);
            wait_ms = wait_ms.min(next_tick_ms.saturating_sub(now).max(1));
            if let Some(due) = self.next_due()? {
                wait_ms = wait_ms.min(due.saturating_sub(now).max(1));
            }
            match out_rx.recv_timeout(Duration::from_millis(wait_ms)) {
                Ok(out) => {
                    let mut batch = vec![out];
                    while let Ok(more) = out_rx.try_recv() {
                        batch.push(more);
                    }
                    self.record(batch);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(QueueError::Backend("all worker threads exited".into()))
                }
            }
        }
    }

    fn all_idle(&self) -> Result<bool, QueueError> {
        // Called right after a claim round that found nothing with every
        // slot free, so nothing is claimable now; only future work counts.
        // Keys halted by a dead job never become claimable and do not count.
        for shard in &self.owned {
            if self.backend.next_due_ms(shard)?.is_some() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn next_due(&self) -> Result<Option<u64>, QueueError> {
        let mut due: Option<u64> = None;
        for shard in &self.owned {
            if let Some(d) = self.backend.next_due_ms(shard)? {
                due = Some(due.map_or(d, |x| x.min(d)));
            }
        }
        Ok(due)
    }

    /// Records outcomes; acks are grouped per shard into one call.
    fn record(&mut self, outcomes: Vec<Outcome>) {
        let mut acks: BTreeMap<String, Vec<Receipt>> = BTreeMap::new();
        for out in outcomes {
            self.in_flight -= 1;
            match out.result {
                Ok(()) => acks.entry(out.shard).or_default().push(out.receipt),
                Err(reason) => match self.backend.fail(&out.shard, out.receipt, &reason, None) {
                    Ok(FailOutcome::Dead) => self.report.dead += 1,
                    Ok(_) => self.report.retried += 1,
                    Err(e) => (self.opts.on_event)(PoolEvent::RecordFailed(e.to_string())),
                },
            }
        }
        for (shard, ids) in acks {
            match self.backend.ack(&shard, &ids) {
                Ok(outcome) => self.report.acked += outcome.acked,
                Err(e) => (self.opts.on_event)(PoolEvent::RecordFailed(e.to_string())),
            }
        }
    }
}
