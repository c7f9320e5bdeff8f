//! The process-wide worker pool: one concurrency limit shared by every shard
//! the process owns, on any [`QueueBackend`].
//!
//! One dispatcher thread (the caller of [`WorkerPool::run`]) ticks the
//! [`Coordinator`], claims jobs, and records acks and failures; `concurrency`
//! worker threads run the handler. The pool must never touch storage directly
//! and never run more than `concurrency` handlers at once.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;

use crate::backend::{Coordinator, QueueBackend, RunJobs};
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
/// How long a shard that failed (corrupt, unreachable, full) rests before
/// the pool tries it again (5 s); the other shards keep running meanwhile.
pub const SHARD_RETRY_MS: u64 = 5_000;
/// The pool keeps up to this many times its concurrency claimed (running
/// or queued for a worker thread), so claims are batched.
pub const CLAIM_AHEAD: usize = 2;
/// Job leases are extended this many times per lease period, so a run
/// survives two missed heartbeats.
pub const HEARTBEATS_PER_LEASE: u64 = 3;
/// How often the pool asks the store whether its runs are still current
/// ([`RunJobs::stale_runs`], read-only, one call per shard for all its
/// runs), between heartbeats: a run a cancel stopped (`job cancel`,
/// `DELETE /v1/jobs/{id}`) has its handler stopped within about this long,
/// and once the handler returned its key's next job may start, instead of
/// at the next heartbeat (a third of the job lease).
pub const CANCEL_CHECK_MS: u64 = 1_000;
/// How long acks refused for a transient reason (a shard's append lock
/// held by a stalled process, an unreachable store) wait before they are
/// sent again. They are kept until they are stored, their runs turn stale
/// (a lapsed job lease) or the shard is lost: a finished run is not run
/// again only because its ack could not be stored at once.
pub const ACK_RETRY_MS: u64 = 250;
/// How long a pool that exits when idle waits for a shard that failed for
/// a transient reason before it ends with [`QueueError::ShardFailed`].
pub const TRANSIENT_SHARD_WAIT_MS: u64 = 30_000;

/// A job handler: `Ok` acks the job, `Err(e)` fails the attempt with `e`'s
/// text as the reason (any error converts with `?`, a `String` with
/// `.into()`). A panic counts as a failure. A handler that can stop early (a
/// child process, a loop) checks [`current_run`] and returns once it is
/// cancelled.
pub type Handler = dyn Fn(&ClaimedJob) -> Result<(), HandlerError> + Send + Sync;

/// What a [`Handler`] fails an attempt with.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// A handler's answer that its downstream is limiting it ("retry in
/// `ms`"): returned as its error, it ends the run without using an attempt
/// ([`RunJobs::back_off`]); the job goes back to the head of its key
/// and the key (with `group`, every key of its flow-control group) starts
/// nothing for `ms`, while other keys run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackOff {
    /// How long, in ms (at most [`crate::flow::BACKOFF_MS_MAX`]).
    pub ms: u64,
    /// Hold the key's whole group, not only the key.
    pub group: bool,
}

impl std::fmt::Display for BackOff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scope = if self.group { "its group" } else { "its key" };
        write!(f, "the handler backed off for {} ms ({scope})", self.ms)
    }
}

impl std::error::Error for BackOff {}

/// How a run's handler ended, short of success.
#[derive(Debug)]
enum Failure {
    /// The attempt failed, for this reason.
    Failed(String),
    /// The handler backed off.
    BackOff(BackOff),
}

impl From<String> for Failure {
    fn from(reason: String) -> Failure {
        Failure::Failed(reason)
    }
}

impl From<HandlerError> for Failure {
    fn from(e: HandlerError) -> Failure {
        match e.downcast_ref::<BackOff>() {
            Some(b) if b.ms > crate::flow::BACKOFF_MS_MAX => Failure::Failed(format!(
                "the handler asked to back off {} ms, over the longest back-off of {} ms",
                b.ms,
                crate::flow::BACKOFF_MS_MAX
            )),
            Some(b) => Failure::BackOff(*b),
            None => Failure::Failed(e.to_string()),
        }
    }
}

/// The cancellation signal of one run.
#[derive(Debug, Default)]
struct RunSignal {
    cancelled: AtomicBool,
    reason: Mutex<String>,
}

impl RunSignal {
    fn cancel(&self, reason: &str) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if !self.cancelled.load(Ordering::SeqCst) {
            *r = reason.to_string();
            self.cancelled.store(true, Ordering::SeqCst);
        }
    }

    fn reason(&self) -> String {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The run a handler is executing, as seen from inside the handler: whether
/// the pool wants it to stop (job timeout, shutdown past the drain timeout,
/// the run's lease or shard lost), and why.
#[derive(Debug, Clone)]
pub struct RunContext {
    signal: Arc<RunSignal>,
}

impl RunContext {
    /// True once the pool asked the handler to stop.
    pub fn is_cancelled(&self) -> bool {
        self.signal.cancelled.load(Ordering::SeqCst)
    }

    /// Why the run was cancelled (empty while it is not).
    pub fn cancel_reason(&self) -> String {
        self.signal.reason()
    }
}

thread_local! {
    static CURRENT_RUN: RefCell<Option<RunContext>> = const { RefCell::new(None) };
    static RUN_RESULT: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
}

/// Gives the calling handler's run a result: kept with the job when the
/// handler returns `Ok` and the ack is recorded
/// ([`crate::job::FinishedJob::result`]), dropped on a failure. A later
/// call replaces an earlier one. A result over the pool's
/// [`PoolOptions::result_bytes_max`] fails the attempt with a reason that
/// says so. Outside a pool's worker thread it does nothing.
pub fn set_result(result: impl Into<Vec<u8>>) {
    if current_run().is_some() {
        RUN_RESULT.with(|r| *r.borrow_mut() = Some(result.into()));
    }
}

/// The run the calling handler executes, when called from a pool's worker
/// thread; `None` elsewhere.
pub fn current_run() -> Option<RunContext> {
    CURRENT_RUN.with(|c| c.borrow().clone())
}

/// Runs `handler` on `job` in this worker thread, as the run `signal`
/// names ([`current_run`] and [`set_result`] work inside it): its outcome,
/// with the result it set when it succeeded within `result_bytes_max`. A
/// panic, or a success of a run the pool cancelled, fails the attempt.
fn run_handler(
    handler: &Handler,
    job: &ClaimedJob,
    signal: Arc<RunSignal>,
    result_bytes_max: usize,
) -> Outcome {
    let ctx = RunContext { signal };
    CURRENT_RUN.with(|c| *c.borrow_mut() = Some(ctx.clone()));
    RUN_RESULT.with(|r| *r.borrow_mut() = None);
    let mut result = catch_unwind(AssertUnwindSafe(|| handler(job)))
        .unwrap_or_else(|_| Err("handler panicked".into()))
        .map_err(Failure::from);
    CURRENT_RUN.with(|c| *c.borrow_mut() = None);
    if !matches!(result, Err(Failure::Failed(_))) && ctx.is_cancelled() {
        // A cancelled run's success is not trusted: a job timeout means
        // the attempt failed.
        result = Err(format!("cancelled: {}", ctx.cancel_reason()).into());
    }
    let mut value = RUN_RESULT.with(|r| r.borrow_mut().take());
    if let (Ok(()), Some(v)) = (&result, &value) {
        if let Err(why) = crate::job::check_result(v, result_bytes_max) {
            result = Err(why.into());
        }
    }
    if result.is_err() {
        value = None;
    }
    Outcome {
        shard: job.shard.clone(),
        receipt: job.receipt(),
        result,
        value,
    }
}

/// How a finished run was recorded (see [`PoolEvent::RunFinished`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunOutcome {
    /// The handler succeeded and the ack was recorded.
    Acked,
    /// The attempt failed and the job will run again.
    Retried,
    /// The attempt failed and the job was dead-lettered.
    Dead,
    /// The result was refused: the run was no longer current.
    Stale,
    /// The handler backed off: the job waits at its key's head, its
    /// attempt not used.
    BackedOff,
}

/// Something the pool reports while it runs (for logs and metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolEvent {
    /// The process owns no shard and waits; the text says who owns what.
    Standby(String),
    /// A shard was claimed and adopted.
    Gained(String),
    /// A shard's lease was lost to another process; its running handlers
    /// were told to stop.
    Lost(String),
    /// Shutdown began: no more claims, waiting for in-flight jobs.
    Draining {
        /// Jobs in flight when draining started.
        in_flight: usize,
    },
    /// The drain timeout ran out: the running handlers were told to stop,
    /// and the pool waits for them before it gives up any shard.
    Cancelling {
        /// Handlers still running.
        running: usize,
    },
    /// An ack or fail could not be recorded (the job will run again).
    RecordFailed(String),
    /// A shard stopped serving (corrupt, unreachable, full); the pool keeps
    /// its other shards running and tries this one again later.
    ShardFailed {
        /// The shard.
        shard: String,
        /// What went wrong.
        error: String,
    },
    /// A failed shard serves again.
    ShardRecovered(String),
    /// A run was claimed and handed to a worker thread.
    RunStarted {
        /// The shard.
        shard: String,
        /// How long the job waited: the claim time minus the moment it
        /// became due (the later of its enqueue and its `not_before_ms`),
        /// in ms, 0 when the clocks disagree.
        wait_ms: u64,
    },
    /// A run's result was recorded (or refused as stale). Not sent when
    /// recording failed ([`PoolEvent::RecordFailed`]).
    RunFinished {
        /// The shard.
        shard: String,
        /// How it was recorded.
        outcome: RunOutcome,
        /// The run's wait before it started, in ms (as in `RunStarted`).
        wait_ms: u64,
        /// From the claim to the handler's result being recorded, in ms.
        run_ms: u64,
    },
}

/// Options of [`WorkerPool::run`].
#[derive(Clone)]
pub struct PoolOptions {
    /// Handlers running at once, over all owned shards (1..=[`CONCURRENCY_MAX`]).
    pub concurrency: usize,
    /// Handlers that run at once when fewer than `concurrency` (a stdio
    /// handler's pipeline: the other runs wait written ahead to it). While
    /// the backend limits starts ([`RunJobs::limits_starts`]) the pool
    /// keeps no more runs than this in flight. `None`: `concurrency`.
    pub handlers: Option<usize>,
    /// How long shutdown waits for in-flight jobs, in ms.
    pub drain_timeout_ms: u64,
    /// Longest idle sleep between looks for new jobs, in ms.
    pub idle_poll_ms: u64,
    /// Job lease of each run, in ms; the pool extends it every
    /// `job_lease_ms / HEARTBEATS_PER_LEASE` while the handler runs.
    pub job_lease_ms: u64,
    /// Longest run of one handler, in ms: past it the run is cancelled (see
    /// [`current_run`]) and, once the handler returns, fails. `None`: no limit.
    pub job_timeout_ms: Option<u64>,
    /// Return once idle (batch runs and tests): no owned shard has a job
    /// ready or delayed or a run in flight, and, while this process may
    /// still take more shards ([`Coordinator::max_shards`]), neither has
    /// any other shard (any process's run can lapse back into work, and a
    /// lease may lapse to this one). At its bound, other shards' work is
    /// not this process's: it stops, and the report lists the shards that
    /// still have work (`left_on_other_shards`). A process that owns
    /// nothing keeps waiting, since a lease may lapse.
    pub exit_when_idle: bool,
    /// Work this pool cannot see on its shards that an idle exit waits
    /// for while it answers true (dependents waiting to be released).
    pub pending_elsewhere: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
    /// Most bytes of a handler's result ([`set_result`]; at most
    /// [`crate::job::RESULT_BYTES_MAX`], the default): a larger one fails
    /// its attempt.
    pub result_bytes_max: usize,
    /// Called for each [`PoolEvent`].
    pub on_event: Arc<dyn Fn(PoolEvent) + Send + Sync>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            concurrency: 1,
            handlers: None,
            drain_timeout_ms: DRAIN_TIMEOUT_MS_DEFAULT,
            idle_poll_ms: IDLE_POLL_MS_DEFAULT,
            job_lease_ms: JOB_LEASE_MS_DEFAULT,
            job_timeout_ms: None,
            exit_when_idle: false,
            pending_elsewhere: None,
            result_bytes_max: crate::job::RESULT_BYTES_MAX,
            on_event: Arc::new(|_| {}),
        }
    }
}

impl std::fmt::Debug for PoolOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolOptions")
            .field("concurrency", &self.concurrency)
            .field("handlers", &self.handlers)
            .field("drain_timeout_ms", &self.drain_timeout_ms)
            .field("idle_poll_ms", &self.idle_poll_ms)
            .field("job_lease_ms", &self.job_lease_ms)
            .field("job_timeout_ms", &self.job_timeout_ms)
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
    /// Runs whose handler backed off (no attempt used).
    pub backed_off: u64,
    /// Jobs dead-lettered.
    pub dead: u64,
    /// Most handlers seen running at once.
    pub peak_in_flight: usize,
    /// Runs cancelled because the drain timeout ran out, and finished runs
    /// whose acks could not be stored by then (their jobs run again under
    /// the next owner; the pool waited for their handlers).
    pub abandoned: usize,
    /// Results refused because their run was no longer current (a lapsed
    /// job lease, a lost shard): they changed nothing.
    pub stale: u64,
    /// Runs cancelled by the job timeout.
    pub timed_out: u64,
    /// With `exit_when_idle`: shards this process did not run that still
    /// had work when it stopped (it was at its bound of shards).
    pub left_on_other_shards: Vec<String>,
}

struct Outcome {
    shard: String,
    receipt: Receipt,
    result: Result<(), Failure>,
    /// What the handler gave [`set_result`], on success.
    value: Option<Vec<u8>>,
}

/// A run claimed and not yet recorded: handed to a worker thread, or
/// parked until an older run of its key in this process has returned.
struct Running {
    key: String,
    started_ms: u64,
    wait_ms: u64,
    signal: Arc<RunSignal>,
    /// Not handed to a worker yet: older, cancelled runs here are over
    /// (their job leases lapsed and the store started this one) and their
    /// handlers have not returned: `after`, on the same shard.
    parked: Option<ClaimedJob>,
    after: Vec<Receipt>,
}

/// A shard that stopped serving, and when to try it again.
struct Failed {
    retry_at_ms: u64,
    needs_adopt: bool,
    /// Until when a transient failure (a held append lock, an unreachable
    /// store) keeps an idle-exiting pool waiting for the shard instead of
    /// ending with [`QueueError::ShardFailed`]; 0 for a lasting failure.
    wait_until_ms: u64,
}

/// The worker pool. See the module docs.
pub struct WorkerPool;

impl WorkerPool {
    /// Runs jobs until `stop` is set (then drains and releases every claim)
    /// or, with `exit_when_idle`, until the owned shards are idle.
    ///
    /// A shard is given up (released, or dropped at shutdown) only once none
    /// of its handlers runs any more: past the drain timeout the running
    /// handlers are cancelled and waited for, while the pool keeps renewing
    /// its shard leases and job leases.
    pub fn run(
        backend: Arc<dyn QueueBackend>,
        coordinator: &mut dyn Coordinator,
        handler: Arc<Handler>,
        clock: Arc<dyn Clock>,
        opts: PoolOptions,
        stop: &AtomicBool,
    ) -> Result<PoolReport, QueueError> {
        if opts.concurrency == 0 || opts.concurrency > CONCURRENCY_MAX {
            return Err(QueueError::InvalidOption {
                name: "concurrency",
                value: opts.concurrency.to_string(),
                allowed: format!("1..={CONCURRENCY_MAX}"),
            });
        }
        crate::job::validate_job_lease_ms(opts.job_lease_ms)?;
        let (job_tx, job_rx) = mpsc::channel::<(ClaimedJob, Arc<RunSignal>)>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let (out_tx, out_rx) = mpsc::channel::<Outcome>();
        let mut workers = Vec::with_capacity(opts.concurrency);
        // Handlers running now, and the most seen at once.
        let running = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        for i in 0..opts.concurrency {
            let (running, peak) = (Arc::clone(&running), Arc::clone(&peak));
            let job_rx = Arc::clone(&job_rx);
            let out_tx = out_tx.clone();
            let handler = Arc::clone(&handler);
            let result_bytes_max = opts.result_bytes_max;
            let spawned = thread::Builder::new()
                .name(format!("shardq-worker-{i}"))
                .spawn(move || loop {
                    // The lock is held only while waiting for the next job.
                    let (job, signal) = match job_rx.lock() {
                        Ok(rx) => match rx.recv() {
                            Ok(next) => next,
                            Err(_) => return,
                        },
                        Err(_) => return,
                    };
                    let now_running = running.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now_running, Ordering::SeqCst);
                    let outcome = run_handler(&*handler, &job, signal, result_bytes_max);
                    running.fetch_sub(1, Ordering::SeqCst);
                    if out_tx.send(outcome).is_err() {
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
            job_tx: &job_tx,
            report: PoolReport::default(),
            running: BTreeMap::new(),
            owned: Vec::new(),
            failed: BTreeMap::new(),
            max_shards: coordinator.max_shards(),
            backoffs: crate::backoff::BackOffs::default(),
            unacked: BTreeMap::new(),
            checks_runs: true,
        };
        let result = state.run_loop(coordinator, &*clock, stop, &out_rx);
        // Never give a shard up while one of its handlers runs: cancel what
        // still runs and wait for it, renewing the leases meanwhile.
        let waited = state.wait_for_running(coordinator, &*clock, &out_rx);
        for shard in std::mem::take(&mut state.owned) {
            let _ = backend.release(&shard);
        }
        // A release the store could not take in time (a stalled lock
        // holder, an unreachable Redis) costs only the takeover wait: the
        // leases lapse by themselves. The drain's report stands.
        let released = match coordinator.release_all() {
            Err(e) if e.is_transient() => {
                (state.opts.on_event)(PoolEvent::RecordFailed(format!(
                    "releasing the shards: {e} (their leases lapse instead)"
                )));
                Ok(())
            }
            other => other,
        };
        let mut report = state.report;
        drop(job_tx);
        for w in workers {
            let _ = w.join();
        }
        report.peak_in_flight = peak.load(Ordering::SeqCst);
        result?;
        waited?;
        released?;
        Ok(report)
    }
}

type JobSender = mpsc::Sender<(ClaimedJob, Arc<RunSignal>)>;

struct Dispatch<'a> {
    backend: &'a dyn QueueBackend,
    opts: &'a PoolOptions,
    job_tx: &'a JobSender,
    report: PoolReport,
    /// Runs claimed and not yet recorded, by shard and receipt: a run is
    /// its receipt, and two runs of one job (a lapsed one whose handler
    /// still runs, and its successor) are two entries.
    running: BTreeMap<(String, Receipt), Running>,
    owned: Vec<String>,
    failed: BTreeMap<String, Failed>,
    /// The coordinator's bound of shards for this process.
    max_shards: usize,
    /// Each job's back-offs in a row ([`crate::backoff`]).
    backoffs: crate::backoff::BackOffs,
    /// Acks refused for a transient reason, by shard, sent again at
    /// [`ACK_RETRY_MS`] intervals ([`Dispatch::retry_acks`]).
    unacked: BTreeMap<String, Unacked>,
    /// False once the backend said it cannot check runs
    /// ([`RunJobs::stale_runs`]): the heartbeat alone finds them stale.
    checks_runs: bool,
}

/// Finished runs of one shard whose ack waits to be sent again.
struct Unacked {
    /// (receipt, wait ms, run ms) per run, and the results in step.
    runs: Vec<(Receipt, u64, u64)>,
    results: Vec<Option<Vec<u8>>>,
    retry_at_ms: u64,
}

impl Dispatch<'_> {
    fn in_flight(&self) -> usize {
        self.running.len()
    }

    /// Runs this process still answers for: running, or finished with an
    /// ack not stored yet.
    fn unfinished(&self) -> usize {
        self.running.len() + self.unacked.values().map(|u| u.runs.len()).sum::<usize>()
    }

    fn run_loop(
        &mut self,
        coordinator: &mut dyn Coordinator,
        clock: &dyn Clock,
        stop: &AtomicBool,
        out_rx: &mpsc::Receiver<Outcome>,
    ) -> Result<(), QueueError> {
        let tick_interval_ms = coordinator.tick_interval_ms().max(1);
        let heartbeat_ms = (self.opts.job_lease_ms / HEARTBEATS_PER_LEASE).max(1);
        let mut next_tick_ms = 0u64;
        let mut next_heartbeat_ms = 0u64;
        let mut next_check_ms = 0u64;
        let mut drain_deadline_ms: Option<u64> = None;
        let mut standby_told = false;
        let mut rotate = 0usize;
        loop {
            let now = clock.now_ms();
            if drain_deadline_ms.is_none() && stop.load(Ordering::SeqCst) {
                coordinator.stop_claiming();
                drain_deadline_ms = Some(now.saturating_add(self.opts.drain_timeout_ms));
                (self.opts.on_event)(PoolEvent::Draining {
                    in_flight: self.in_flight(),
                });
            }
            if now >= next_tick_ms {
                self.tick(coordinator, now)?;
                if self.owned.is_empty() && !standby_told {
                    (self.opts.on_event)(PoolEvent::Standby(coordinator.standby_reason()));
                    standby_told = true;
                } else if !self.owned.is_empty() {
                    standby_told = false;
                }
                next_tick_ms = now.saturating_add(tick_interval_ms);
            }
            if now >= next_heartbeat_ms {
                self.heartbeat();
                next_heartbeat_ms = now.saturating_add(heartbeat_ms);
                next_check_ms = now.saturating_add(CANCEL_CHECK_MS);
            } else if now >= next_check_ms {
                self.check_runs();
                next_check_ms = now.saturating_add(CANCEL_CHECK_MS);
            }
            self.enforce_job_timeout(now);

            // Record every finished job at once: acks are grouped per shard,
            // so a durable backend fsyncs once per shard, not once per job.
            let finished: Vec<Outcome> = out_rx.try_iter().collect();
            if !finished.is_empty() {
                self.record(finished, now);
            }
            self.retry_acks(now);

            if let Some(deadline) = drain_deadline_ms {
                if self.unfinished() == 0 {
                    return Ok(());
                }
                if now >= deadline {
                    self.report.abandoned = self.unfinished();
                    return Ok(());
                }
            }

            let mut claimed_any = false;
            if drain_deadline_ms.is_none() && !self.owned.is_empty() {
                claimed_any = self.claim_round(rotate, now)?;
                rotate = rotate.wrapping_add(1);
            }

            if self.opts.exit_when_idle && drain_deadline_ms.is_none() && !claimed_any {
                if let Some(end) = self.idle_end(now) {
                    return end;
                }
            }

            if claimed_any && self.in_flight() < self.opts.concurrency {
                continue;
            }
            let wait_ms = self.wait_ms(now, [next_tick_ms, next_heartbeat_ms, next_check_ms]);
            match out_rx.recv_timeout(clock.event_wait(wait_ms)) {
                Ok(out) => {
                    let mut batch = vec![out];
                    while let Ok(more) = out_rx.try_recv() {
                        batch.push(more);
                    }
                    self.record(batch, clock.now_ms());
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(QueueError::WorkersExited),
            }
        }
    }

    /// How `work --exit-when-idle` ends at `now`, once a round claimed
    /// nothing: `None` while there is work (a run unfinished, a job due,
    /// work elsewhere, a shard failed for a moment and waited for, within
    /// a bound); else `Ok`, or the error naming a shard that failed for
    /// good.
    fn idle_end(&mut self, now: u64) -> Option<Result<(), QueueError>> {
        if self.unfinished() != 0
            || self.owned.is_empty()
            || !self.all_idle(now)
            || self.opts.pending_elsewhere.as_ref().is_some_and(|p| p())
            || self.failed.values().any(|f| now < f.wait_until_ms)
        {
            return None;
        }
        Some(match self.failed.keys().next() {
            Some(shard) => Err(QueueError::ShardFailed {
                shard: shard.clone(),
            }),
            None => Ok(()),
        })
    }

    /// How long the loop may wait for a finished run at `now`: until the
    /// next of its timers (`[tick, heartbeat, run check]`), a job timeout,
    /// a job due, an ack to send again, or the idle poll.
    fn wait_ms(&mut self, now: u64, [tick, heartbeat, check]: [u64; 3]) -> u64 {
        let check = (self.checks_runs && !self.running.is_empty()).then_some(check);
        [
            Some(tick),
            Some(heartbeat),
            check,
            self.next_timeout_ms(),
            self.next_due(now),
            self.unacked.values().map(|u| u.retry_at_ms).min(),
        ]
        .into_iter()
        .flatten()
        .map(|at| at.saturating_sub(now).max(1))
        .fold(self.opts.idle_poll_ms.max(1), u64::min)
    }

    /// Ticks the coordinator: adopts gained shards, stops the handlers of
    /// lost ones. A transient coordinator error keeps the current shards.
    fn tick(&mut self, coordinator: &mut dyn Coordinator, now: u64) -> Result<(), QueueError> {
        let own = match coordinator.tick() {
            Ok(own) => own,
            Err(e) if e.is_transient() => {
                (self.opts.on_event)(PoolEvent::RecordFailed(format!(
                    "lease renewal: {e} (keeping the shards while their leases last)"
                )));
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        for shard in &own.lost {
            (self.opts.on_event)(PoolEvent::Lost(shard.clone()));
            self.cancel_shard(shard, "the shard's lease was lost to another process");
            let _ = self.backend.release(shard);
            self.failed.remove(shard);
        }
        for shard in &own.gained {
            self.adopt(shard, now);
        }
        self.owned = own.owned;
        self.failed.retain(|s, _| self.owned.contains(s));
        // Whatever path lost a shard, none of its handlers runs on here.
        for ((shard, _), run) in &self.running {
            if !self.owned.contains(shard) {
                run.signal.cancel("this process no longer holds the shard");
            }
        }
        Ok(())
    }

    fn adopt(&mut self, shard: &str, now: u64) {
        match self.backend.adopt(shard) {
            Ok(()) => {
                if self.failed.remove(shard).is_some() {
                    (self.opts.on_event)(PoolEvent::ShardRecovered(shard.to_string()));
                }
                (self.opts.on_event)(PoolEvent::Gained(shard.to_string()));
            }
            Err(e) => self.shard_failed(shard, &e, now, true),
        }
    }

    fn shard_failed(&mut self, shard: &str, error: &QueueError, now: u64, needs_adopt: bool) {
        let first = !self.failed.contains_key(shard);
        // A transient failure keeps the wait it started with.
        let wait_until_ms = match self.failed.get(shard) {
            Some(f) if error.is_transient() => f.wait_until_ms,
            _ if error.is_transient() => now.saturating_add(TRANSIENT_SHARD_WAIT_MS),
            _ => 0,
        };
        self.failed.insert(
            shard.to_string(),
            Failed {
                retry_at_ms: now.saturating_add(SHARD_RETRY_MS),
                needs_adopt,
                wait_until_ms,
            },
        );
        if first {
            (self.opts.on_event)(PoolEvent::ShardFailed {
                shard: shard.to_string(),
                error: error.to_string(),
            });
        }
    }

    /// One claim call per healthy shard, sharing the free slots.
    fn claim_round(&mut self, rotate: usize, now: u64) -> Result<bool, QueueError> {
        let mut claimed_any = false;
        let n = self.owned.len();
        let (window, batch) = self.claim_window();
        let room = window - self.in_flight().min(window);
        if room < batch && self.in_flight() > 0 {
            return Ok(false);
        }
        // Ranked: the free slots go to the shards of the best-ranked ready
        // keys over all of them, those first; the others share what is
        // left, in turn. Resting shards are not asked for their ranks.
        let resting =
            |s: &str| (self.failed.get(s)).is_some_and(|f| now < f.retry_at_ms || f.needs_adopt);
        let order =
            crate::backend::claim_order(self.backend, &self.owned, rotate, room, |s| !resting(s));
        for (i, (shard, ranked_share)) in order.into_iter().enumerate() {
            let free = window - self.in_flight().min(window);
            if free == 0 {
                break;
            }
            let Some(recovering) = self.claimable(&shard, now) else {
                continue;
            };
            // Share the free slots between shards so one busy shard cannot
            // starve the others.
            let share = ranked_share
                .unwrap_or_else(|| free.div_ceil(n - i))
                .clamp(1, CLAIM_BATCH_MAX)
                .min(free);
            let jobs = match self.backend.claim(&shard, share, self.opts.job_lease_ms) {
                Ok(jobs) => jobs,
                Err(QueueError::NotOwner { .. }) => continue,
                Err(e @ QueueError::StoreLost(_)) => return Err(e),
                Err(e) => {
                    self.shard_failed(&shard, &e, now, false);
                    continue;
                }
            };
            if recovering && self.failed.remove(&shard).is_some() {
                (self.opts.on_event)(PoolEvent::ShardRecovered(shard.clone()));
            }
            for job in jobs {
                claimed_any = true;
                self.take_run(job, now)?;
            }
        }
        Ok(claimed_any)
    }

    /// The most runs in flight a claim may fill up to, and the fewest free
    /// slots worth a claim call while some run.
    fn claim_window(&self) -> (usize, usize) {
        // Claim ahead up to CLAIM_AHEAD x concurrency runs (the extra ones
        // wait in the workers' queue), and only once a whole concurrency's
        // worth is free or nothing runs: claims then come in batches, not
        // one call per finished job.
        // Ranked keys (flow control): no claim ahead, and a claim for each
        // slot that frees, so it goes to the best-ranked key ready then,
        // not to one claimed early (nor waits for the other slots).
        // Limited starts (rates, groups): the store takes a run's tokens
        // when it is claimed, so a run claimed ahead would take them long
        // before its handler starts and let a bucketful start at once
        // later. Claims are then only for handlers that start at once:
        // at most `handlers` runs in flight, one claim per freed slot.
        let ranked = self.backend.ranks_keys();
        let limited = self.backend.limits_starts();
        let window = if limited {
            (self.opts.handlers)
                .unwrap_or(self.opts.concurrency)
                .clamp(1, self.opts.concurrency)
        } else if ranked {
            self.opts.concurrency
        } else {
            self.opts.concurrency.saturating_mul(CLAIM_AHEAD)
        };
        let batch = if ranked || limited {
            1
        } else {
            self.opts.concurrency
        };
        (window, batch)
    }

    /// Whether to claim from `shard` now (`None`: it rests, or adopting it
    /// failed again), and whether it is recovering from a failure.
    fn claimable(&mut self, shard: &str, now: u64) -> Option<bool> {
        let Some(f) = self.failed.get(shard) else {
            return Some(false);
        };
        if now < f.retry_at_ms {
            return None;
        }
        if f.needs_adopt {
            self.adopt(shard, now);
            if self.failed.contains_key(shard) {
                return None;
            }
        }
        Some(true)
    }

    /// Takes one claimed run: starts it, or parks it until the older runs
    /// it overlaps here have returned.
    fn take_run(&mut self, job: ClaimedJob, now: u64) -> Result<(), QueueError> {
        let signal = Arc::new(RunSignal::default());
        let wait_ms = now.saturating_sub(job.created_ms.max(job.not_before_ms));
        // The store started a run that runs over the key's
        // concurrency here, or of a job that runs here: older runs
        // are over (their job leases lapsed, say in a stall). Stop
        // their handlers, and start this run only once they
        // returned, so a key never has more handlers than runs.
        let (over, after) = self.runs_over(&job);
        for r in &over {
            if let Some(run) = self.running.get(&(job.shard.clone(), *r)) {
                run.signal
                    .cancel("the run's job lease lapsed and its job runs again");
            }
        }
        let older = !after.is_empty();
        (self.opts.on_event)(PoolEvent::RunStarted {
            shard: job.shard.clone(),
            wait_ms,
        });
        let entry = (job.shard.clone(), job.receipt());
        let key = job.key.clone();
        let parked = if older {
            Some(job)
        } else {
            self.start(job, Arc::clone(&signal))?;
            None
        };
        self.running.insert(
            entry,
            Running {
                key,
                started_ms: now,
                wait_ms,
                signal,
                parked,
                after,
            },
        );
        Ok(())
    }

    fn start(&self, job: ClaimedJob, signal: Arc<RunSignal>) -> Result<(), QueueError> {
        self.job_tx
            .send((job, signal))
            .map_err(|_| QueueError::WorkersExited)
    }

    /// What the store's new run `job` shows of the runs of its key here:
    /// those that are over, to cancel (a run of the same job; and, when the
    /// key's runs here, parked ones too, reach its concurrency, those the
    /// store no longer counts current), and those the new run waits for
    /// (the over ones in a handler, and what the key's older parked runs
    /// wait for, so its runs start here in the order the store started
    /// them).
    fn runs_over(&self, job: &ClaimedJob) -> (Vec<Receipt>, Vec<Receipt>) {
        let mine: Vec<(Receipt, &Running)> = (self.running.iter())
            .filter(|((s, _), r)| *s == job.shard && r.key == job.key)
            .map(|((_, receipt), r)| (*receipt, r))
            .collect();
        let mut over: Vec<Receipt> = (mine.iter())
            .filter(|(r, _)| r.id == job.id)
            .map(|(r, _)| *r)
            .collect();
        let limit = self.backend.key_concurrency(&job.key).max(1) as usize;
        if mine.len() - over.len() >= limit {
            for (r, _) in mine.iter().filter(|(r, _)| r.id != job.id) {
                // A store that cannot say (no job reads) has them all over.
                let current = matches!(
                    self.backend.job(&job.shard, r.id),
                    Ok(Some(info)) if info.run.is_some_and(|(fence, _)| fence == r.fence)
                );
                if !current {
                    over.push(*r);
                }
            }
        }
        let mut after: Vec<Receipt> = Vec::new();
        for (r, run) in &mine {
            match (over.contains(r), run.parked.is_some()) {
                (true, false) => after.push(*r),
                (false, true) => after.extend(run.after.iter().copied()),
                _ => {}
            }
        }
        after.sort_unstable();
        after.dedup();
        (over, after)
    }

    /// Hands parked runs whose older runs all returned to the workers; a
    /// parked run cancelled meanwhile fails without running.
    fn start_parked(&mut self) -> Vec<Outcome> {
        let mut cancelled = Vec::new();
        let ready: Vec<(String, Receipt)> = self
            .running
            .iter()
            .filter(|(_, r)| r.parked.is_some())
            .filter(|((shard, _), r)| {
                r.signal.cancelled.load(Ordering::SeqCst)
                    || (r.after.iter()).all(|a| !self.running.contains_key(&(shard.clone(), *a)))
            })
            .map(|(k, _)| k.clone())
            .collect();
        // In the order the store started them (by fence), not by job id.
        let mut ready = ready;
        ready.sort_by_key(|(_, r)| r.fence);
        for entry in ready {
            let Some(run) = self.running.get_mut(&entry) else {
                continue;
            };
            let Some(job) = run.parked.take() else {
                continue;
            };
            if run.signal.cancelled.load(Ordering::SeqCst) {
                cancelled.push(Outcome {
                    shard: entry.0.clone(),
                    receipt: entry.1,
                    result: Err(
                        format!("cancelled before it started: {}", run.signal.reason()).into(),
                    ),
                    value: None,
                });
                continue;
            }
            let signal = Arc::clone(&run.signal);
            if self.start(job, signal).is_err() {
                // The workers are gone; the loop reports it on its next wait.
                return cancelled;
            }
        }
        cancelled
    }

    /// Extends the job lease of every running run; a run the backend calls
    /// stale is over, so its handler is told to stop.
    fn heartbeat(&mut self) {
        let mut per_shard: BTreeMap<String, Vec<Receipt>> = BTreeMap::new();
        for (shard, receipt) in self.running.keys() {
            per_shard.entry(shard.clone()).or_default().push(*receipt);
        }
        for (shard, receipts) in per_shard {
            match self
                .backend
                .extend(&shard, &receipts, self.opts.job_lease_ms)
            {
                Ok(stale) => {
                    for r in stale {
                        if let Some(run) = self.running.get(&(shard.clone(), r)) {
                            run.signal.cancel("the run's job lease was lost");
                        }
                    }
                }
                Err(e) => (self.opts.on_event)(PoolEvent::RecordFailed(format!(
                    "extending job leases on shard {shard:?}: {e}"
                ))),
            }
        }
    }

    /// Asks the store which running runs are no longer current (a cancel
    /// stopped them, or they ended elsewhere), without extending anything,
    /// and tells their handlers to stop. Once such a handler returns, its
    /// failure is recorded as any other ([`Dispatch::record`]): for a run
    /// a cancel stopped that ends it at once, so its key's next job may
    /// start (parked here until the handler is gone).
    fn check_runs(&mut self) {
        if !self.checks_runs {
            return;
        }
        let mut per_shard: BTreeMap<&str, Vec<Receipt>> = BTreeMap::new();
        for ((shard, receipt), run) in &self.running {
            if !run.signal.cancelled.load(Ordering::SeqCst) {
                per_shard.entry(shard).or_default().push(*receipt);
            }
        }
        for (shard, receipts) in per_shard {
            match RunJobs::stale_runs(self.backend, shard, &receipts) {
                Ok(stale) => {
                    for r in stale {
                        if let Some(run) = self.running.get(&(shard.to_string(), r)) {
                            run.signal
                                .cancel("the job was cancelled, or its run ended elsewhere");
                        }
                    }
                }
                Err(QueueError::Unsupported { .. }) => {
                    self.checks_runs = false;
                    return;
                }
                // The heartbeat reports a store that cannot answer.
                Err(_) => {}
            }
        }
    }

    fn enforce_job_timeout(&mut self, now: u64) {
        let Some(limit) = self.opts.job_timeout_ms else {
            return;
        };
        for run in self.running.values() {
            if now >= run.started_ms.saturating_add(limit)
                && !run.signal.cancelled.load(Ordering::SeqCst)
            {
                run.signal.cancel(&format!("job timeout {limit} ms"));
                self.report.timed_out += 1;
            }
        }
    }

    fn next_timeout_ms(&self) -> Option<u64> {
        let limit = self.opts.job_timeout_ms?;
        self.running
            .values()
            .filter(|r| !r.signal.cancelled.load(Ordering::SeqCst))
            .map(|r| r.started_ms.saturating_add(limit))
            .min()
    }

    fn cancel_shard(&mut self, shard: &str, reason: &str) {
        for ((s, _), run) in &self.running {
            if s == shard {
                run.signal.cancel(reason);
            }
        }
    }

    /// After the loop: cancels every run still going and waits until all
    /// handlers returned, ticking the coordinator and extending job leases
    /// so no other process starts a key's next job meanwhile.
    fn wait_for_running(
        &mut self,
        coordinator: &mut dyn Coordinator,
        clock: &dyn Clock,
        out_rx: &mpsc::Receiver<Outcome>,
    ) -> Result<(), QueueError> {
        if self.running.is_empty() {
            return Ok(());
        }
        (self.opts.on_event)(PoolEvent::Cancelling {
            running: self.running.len(),
        });
        let reason = format!(
            "the worker is stopping (drain timeout {} ms)",
            self.opts.drain_timeout_ms
        );
        for run in self.running.values() {
            run.signal.cancel(&reason);
        }
        let tick_interval_ms = coordinator.tick_interval_ms().max(1);
        let heartbeat_ms = (self.opts.job_lease_ms / HEARTBEATS_PER_LEASE).max(1);
        let mut next_tick_ms = 0u64;
        let mut next_heartbeat_ms = 0u64;
        while !self.running.is_empty() {
            let now = clock.now_ms();
            if now >= next_tick_ms {
                if let Err(e) = self.tick(coordinator, now) {
                    (self.opts.on_event)(PoolEvent::RecordFailed(e.to_string()));
                }
                next_tick_ms = now.saturating_add(tick_interval_ms);
            }
            if now >= next_heartbeat_ms {
                self.heartbeat();
                next_heartbeat_ms = now.saturating_add(heartbeat_ms);
            }
            let wait = tick_interval_ms.min(heartbeat_ms).clamp(1, 50);
            match out_rx.recv_timeout(clock.event_wait(wait)) {
                Ok(out) => {
                    let mut batch = vec![out];
                    batch.extend(out_rx.try_iter());
                    self.record(batch, clock.now_ms());
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(QueueError::WorkersExited),
            }
        }
        Ok(())
    }

    fn all_idle(&mut self, now: u64) -> bool {
        // Called right after a claim round that found nothing with every
        // slot free, so nothing is claimable now; only future work counts:
        // a delayed job, or a run in flight (another process's, a dead
        // one's) that can lapse back into work. Keys halted by a dead job
        // never become claimable and do not count. Shards other processes
        // hold count too: their work may come to this one when a lease
        // lapses (a shard that cannot be read there is its owner's to
        // report).
        for shard in self.owned.clone() {
            if self.failed.contains_key(&shard) {
                continue;
            }
            match self.backend.next_due_ms(&shard) {
                Ok(Some(_)) => return false,
                Ok(None) => {}
                Err(e) => {
                    self.shard_failed(&shard, &e, now, false);
                }
            }
        }
        let busy: Vec<String> = self
            .backend
            .shard_names()
            .into_iter()
            .filter(|s| !self.owned.contains(s))
            .filter(|s| matches!(self.backend.next_due_ms(s), Ok(Some(_))))
            .collect();
        if self.owned.len() < self.max_shards {
            return busy.is_empty();
        }
        self.report.left_on_other_shards = busy;
        true
    }

    fn next_due(&mut self, now: u64) -> Option<u64> {
        let mut due: Option<u64> = None;
        for shard in self.owned.clone() {
            if self.failed.contains_key(&shard) {
                continue;
            }
            match self.backend.next_due_ms(&shard) {
                Ok(Some(d)) => due = Some(due.map_or(d, |x| x.min(d))),
                Ok(None) => {}
                Err(e) => self.shard_failed(&shard, &e, now, false),
            }
        }
        due
    }

    /// Records outcomes; acks are grouped per shard into one call.
    fn record(&mut self, mut outcomes: Vec<Outcome>, now: u64) {
        while !outcomes.is_empty() {
            self.record_batch(outcomes, now);
            outcomes = self.start_parked();
        }
    }

    fn record_batch(&mut self, outcomes: Vec<Outcome>, now: u64) {
        let mut acks: BTreeMap<String, Vec<(Receipt, u64, u64)>> = BTreeMap::new();
        let mut values: BTreeMap<String, Vec<Option<Vec<u8>>>> = BTreeMap::new();
        for out in outcomes {
            let (wait_ms, run_ms) = self
                .running
                .remove(&(out.shard.clone(), out.receipt))
                .map(|r| (r.wait_ms, now.saturating_sub(r.started_ms)))
                .unwrap_or((0, 0));
            // A back-off past the bound in a row is a failed attempt.
            let result = match out.result {
                Err(Failure::BackOff(b)) => {
                    match self.backoffs.note(&out.shard, out.receipt.id, b.ms) {
                        Ok(()) => Err(Failure::BackOff(BackOff {
                            ms: crate::backoff::floored_ms(b.ms),
                            ..b
                        })),
                        Err(why) => Err(Failure::Failed(why)),
                    }
                }
                other => {
                    self.backoffs.ended(&out.shard, out.receipt.id);
                    other
                }
            };
            let outcome = match result {
                Ok(()) => {
                    values.entry(out.shard.clone()).or_default().push(out.value);
                    acks.entry(out.shard)
                        .or_default()
                        .push((out.receipt, wait_ms, run_ms));
                    continue;
                }
                Err(failure) => {
                    // What the backend made of it: an outcome, or nothing
                    // recorded.
                    let recorded = match failure {
                        Failure::BackOff(b) => (self.backend)
                            .back_off(&out.shard, out.receipt, b.ms, b.group)
                            .map(|_| RunOutcome::BackedOff),
                        Failure::Failed(reason) => (self.backend)
                            .fail(&out.shard, out.receipt, &reason, None)
                            .map(|o| match o {
                                FailOutcome::Dead => RunOutcome::Dead,
                                _ => RunOutcome::Retried,
                            }),
                    };
                    match recorded {
                        Ok(o) => {
                            *match o {
                                RunOutcome::BackedOff => &mut self.report.backed_off,
                                RunOutcome::Dead => &mut self.report.dead,
                                _ => &mut self.report.retried,
                            } += 1;
                            o
                        }
                        Err(QueueError::StaleReceipt { .. }) => {
                            self.report.stale += 1;
                            RunOutcome::Stale
                        }
                        Err(e) => {
                            (self.opts.on_event)(PoolEvent::RecordFailed(e.to_string()));
                            continue;
                        }
                    }
                }
            };
            (self.opts.on_event)(PoolEvent::RunFinished {
                shard: out.shard,
                outcome,
                wait_ms,
                run_ms,
            });
        }
        for (shard, runs) in acks {
            let results = values.remove(&shard).unwrap_or_default();
            let results = if results.iter().any(Option::is_some) {
                results
            } else {
                Vec::new()
            };
            self.send_acks(shard, runs, results, now, false);
        }
    }

    /// Acks `runs` of `shard` with `results` (empty: none). Refused for a
    /// transient reason, they are kept and sent again
    /// ([`Dispatch::retry_acks`], `retry`: this is such a send; the
    /// refusal was reported at the first); refused otherwise, they are
    /// reported and dropped (their runs end when their job leases lapse).
    fn send_acks(
        &mut self,
        shard: String,
        runs: Vec<(Receipt, u64, u64)>,
        results: Vec<Option<Vec<u8>>>,
        now: u64,
        retry: bool,
    ) {
        let receipts: Vec<Receipt> = runs.iter().map(|r| r.0).collect();
        match crate::backend::ack_ending_cancelled(self.backend, &shard, &receipts, &results) {
            Ok(out) => {
                self.report.acked += out.acked;
                self.report.stale += out.stale.len() as u64;
                for (receipt, wait_ms, run_ms) in runs {
                    let outcome = if out.stale.contains(&receipt) {
                        RunOutcome::Stale
                    } else {
                        RunOutcome::Acked
                    };
                    (self.opts.on_event)(PoolEvent::RunFinished {
                        shard: shard.clone(),
                        outcome,
                        wait_ms,
                        run_ms,
                    });
                }
            }
            Err(e) if e.is_transient() && self.owned.contains(&shard) => {
                if !retry && !self.unacked.contains_key(&shard) {
                    (self.opts.on_event)(PoolEvent::RecordFailed(format!(
                        "acking {} runs: {e} (kept; sent again every {ACK_RETRY_MS} ms while their job leases last)",
                        runs.len()
                    )));
                }
                let u = self.unacked.entry(shard).or_insert_with(|| Unacked {
                    runs: Vec::new(),
                    results: Vec::new(),
                    retry_at_ms: 0,
                });
                // Results stay in step with their runs: none given is None.
                if !results.is_empty() || !u.results.is_empty() {
                    u.results.resize(u.runs.len(), None);
                    let mut results = results;
                    results.resize(runs.len(), None);
                    u.results.extend(results);
                }
                u.runs.extend(runs);
                u.retry_at_ms = now.saturating_add(ACK_RETRY_MS);
            }
            Err(e) => (self.opts.on_event)(PoolEvent::RecordFailed(e.to_string())),
        }
    }

    /// Sends again the acks a transient refusal kept, for each shard whose
    /// wait is over; those of a shard no longer owned are dropped (their
    /// receipts are stale there: the jobs run again under the new owner).
    fn retry_acks(&mut self, now: u64) {
        let due: Vec<String> = self
            .unacked
            .iter()
            .filter(|(_, u)| u.retry_at_ms <= now)
            .map(|(s, _)| s.clone())
            .collect();
        for shard in due {
            let Some(u) = self.unacked.remove(&shard) else {
                continue;
            };
            if !self.owned.contains(&shard) {
                (self.opts.on_event)(PoolEvent::RecordFailed(format!(
                    "{} acks of shard {shard} dropped: this process no longer holds it",
                    u.runs.len()
                )));
                continue;
            }
            self.send_acks(shard, u.runs, u.results, now, true);
        }
    }
}
