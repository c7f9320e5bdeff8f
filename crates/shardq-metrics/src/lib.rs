//! shardq-metrics: the Prometheus metrics of a shardq process, in the
//! Prometheus text format (0.0.4) from the `prometheus-client` crate.
//!
//! One [`Metrics`] value per process holds every series (`docs/metrics.md`
//! lists them). It is fed from three places, none of which depends on this
//! crate's types beyond a method call:
//! - the worker pool's [`PoolEvent`]s ([`Metrics::pool_event`]: runs started
//!   and finished, with their wait and run time);
//! - the server's handlers (enqueues and producer refusals, remote claims,
//!   acks and fails; [`Metrics::run_claimed`], [`Metrics::run_acked`], ...);
//! - a rebalance's [`RebalanceEvent`]s ([`Metrics::rebalance_event`]).
//!
//! The per-shard gauges are not fed: they are read from a [`StatusSource`]
//! (normally [`Deployment::status`]) when a scrape comes, at most once per
//! [`STATUS_TTL`] however many scrapes arrive (see [`shards`]).
//!
//! This crate observes and reports; it must never change the queue, and a
//! feeding call must stay cheap (atomics and a short lock) so that metrics
//! never slow the queue down.

pub mod flow;
pub mod history;
pub mod http;
pub mod outbox;
pub mod runs;
pub mod serve;
pub mod shards;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use shardq_core::producer::Refusals;
use shardq_core::reshard::RebalanceEvent;
use shardq_core::{PoolEvent, Receipt, RunOutcome};
use shardq_deploy::Deployment;

pub use history::{History, Window, HISTORY_SECONDS};
pub use runs::RunTracker;
pub use serve::{spawn_listener, Listener, MetricsError};
pub use shards::{StatusSnapshot, StatusSource, STATUS_TTL};

/// The `Content-Type` of what [`Metrics::render`] returns.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Bucket upper bounds (seconds) of the job wait and run time histograms:
/// 1 ms to 1 h.
pub const JOB_SECONDS_BUCKETS: [f64; 18] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    300.0, 900.0, 3600.0,
];
/// Bucket upper bounds (seconds) of the per-key rebalance pause histogram:
/// 1 ms to 2 min.
pub const PAUSE_SECONDS_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0, 120.0,
];
/// The phases of `shardq_rebalance_phase`, in order.
pub const PHASES: [&str; 5] = ["idle", "pinning", "moving", "finished", "failed"];

/// Label set of the per-shard series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShardLabel {
    /// The shard's name.
    pub shard: String,
}

/// Label set of `shardq_shard_owner`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OwnerLabel {
    /// The shard's name.
    pub shard: String,
    /// The lease holder.
    pub owner: String,
}

/// Label set of `shardq_rebalance_phase`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// One of [`PHASES`].
    pub phase: &'static str,
}

type Counters = Family<ShardLabel, Counter>;

/// Counters fed by the pool and the server, per shard.
#[derive(Default)]
struct Flow {
    enqueued: Counters,
    claimed: Counters,
    acked: Counters,
    retried: Counters,
    dead_lettered: Counters,
    stale: Counters,
    backed_off: Counters,
    fenced: Counters,
    paused: Counters,
    moved: Counters,
}

/// The rebalance series.
struct Rebalance {
    phase: Family<PhaseLabel, Gauge>,
    keys_to_move: Gauge,
    keys_moved: Gauge,
    keys_paused: Gauge,
    pause: Histogram,
    jobs_moved: Counter,
}

/// Every series of one process; see the module docs.
pub struct Metrics {
    registry: Registry,
    flow: Flow,
    wait: Histogram,
    run: Histogram,
    rebalance: Rebalance,
    shards: shards::ShardGauges,
    runs: Mutex<RunTracker>,
    history: History,
    flow_control: flow::FlowSeries,
    outbox: Option<outbox::OutboxGauges>,
    http: Option<http::HttpGauges>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn shard(s: &str) -> ShardLabel {
    ShardLabel {
        shard: s.to_string(),
    }
}

/// The wall clock's second (the history's buckets follow it).
pub fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn seconds(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

impl Metrics {
    /// Metrics with per-shard gauges read from `source` (at most once per
    /// `ttl`), or without them (`None`).
    ///
    /// Long on purpose: it registers every metric family, each with its
    /// help text, in one list in the order docs/metrics.md gives them.
    pub fn new(source: Option<StatusSource>, ttl: Duration) -> Metrics {
        let mut registry = Registry::default();
        let flow = Flow::default();
        let c = |r: &mut Registry, name: &str, help: &str, f: &Counters| {
            r.register(name, help, f.clone())
        };
        c(
            &mut registry,
            "shardq_jobs_enqueued",
            "Jobs enqueued by this process, per shard (duplicates of a dedup id not counted)",
            &flow.enqueued,
        );
        c(
            &mut registry,
            "shardq_jobs_claimed",
            "Runs started by this process (its worker pool or its remote workers' claims), per shard",
            &flow.claimed,
        );
        c(
            &mut registry,
            "shardq_jobs_acked",
            "Runs acked through this process, per shard",
            &flow.acked,
        );
        c(
            &mut registry,
            "shardq_jobs_retried",
            "Failed attempts recorded through this process whose job will run again, per shard",
            &flow.retried,
        );
        c(
            &mut registry,
            "shardq_jobs_dead_lettered",
            "Failed last attempts recorded through this process: the job went to the dead letters, per shard",
            &flow.dead_lettered,
        );
        c(
            &mut registry,
            "shardq_runs_backed_off",
            "Runs whose handler backed off (its downstream limits it): the job waits at its key's head, no attempt used, per shard",
            &flow.backed_off,
        );
        c(
            &mut registry,
            "shardq_results_stale",
            "Acks and fails refused because their run was no longer current (nothing changed), per shard",
            &flow.stale,
        );
        c(
            &mut registry,
            "shardq_enqueue_fenced",
            "Appends refused by a shard's fence (stale map version; the producer reloaded and retried), per shard",
            &flow.fenced,
        );
        c(
            &mut registry,
            "shardq_enqueue_paused",
            "Appends refused because the key was paused for a move (retried, bounded), per shard",
            &flow.paused,
        );
        c(
            &mut registry,
            "shardq_enqueue_moved",
            "Appends refused because the key's backlog had moved to another shard mid-rebalance (sent there at once, no wait), per refusing shard",
            &flow.moved,
        );
        let wait = Histogram::new(JOB_SECONDS_BUCKETS);
        registry.register(
            "shardq_job_wait_seconds",
            "Time from a job becoming due (the later of its enqueue and its not-before time) to the start of its run",
            wait.clone(),
        );
        let run = Histogram::new(JOB_SECONDS_BUCKETS);
        registry.register(
            "shardq_job_run_seconds",
            "Time from a run's claim to its result (ack or fail) being recorded",
            run.clone(),
        );
        let rebalance = Rebalance {
            phase: Family::default(),
            keys_to_move: Gauge::default(),
            keys_moved: Gauge::default(),
            keys_paused: Gauge::default(),
            pause: Histogram::new(PAUSE_SECONDS_BUCKETS),
            jobs_moved: Counter::default(),
        };
        registry.register(
            "shardq_rebalance_phase",
            "Phase of the last rebalance run by this process: 1 for the current phase, 0 for the others",
            rebalance.phase.clone(),
        );
        registry.register(
            "shardq_rebalance_keys_to_move",
            "Keys with work the current or last rebalance drains and switches",
            rebalance.keys_to_move.clone(),
        );
        registry.register(
            "shardq_rebalance_keys_moved",
            "Keys the current or last rebalance has switched so far",
            rebalance.keys_moved.clone(),
        );
        registry.register(
            "shardq_rebalance_keys_paused",
            "Keys whose enqueues are paused right now by this process's rebalance",
            rebalance.keys_paused.clone(),
        );
        registry.register(
            "shardq_rebalance_jobs_moved",
            "Jobs (queued, delayed, dead) this process's rebalances copied to new shards with their keys",
            rebalance.jobs_moved.clone(),
        );
        registry.register(
            "shardq_rebalance_key_pause_seconds",
            "How long each moved key's enqueues were paused (one observation per key)",
            rebalance.pause.clone(),
        );
        let shards = shards::ShardGauges::register(&mut registry, source, ttl);
        let flow_control = flow::FlowSeries::register(&mut registry);
        let m = Metrics {
            registry,
            flow,
            wait,
            run,
            rebalance,
            shards,
            runs: Mutex::new(RunTracker::default()),
            history: History::default(),
            flow_control,
            outbox: None,
            http: None,
        };
        m.set_phase("idle");
        m
    }

    /// Metrics over `deployment`: per-shard gauges from its `status()`,
    /// cached for [`STATUS_TTL`].
    pub fn for_deployment(deployment: Arc<Deployment>) -> Metrics {
        Metrics::for_deployment_with(deployment, None)
    }

    /// [`Metrics::for_deployment`], with the Postgres outbox's gauges read
    /// from `outbox` (at most once per [`STATUS_TTL`]) when given.
    pub fn for_deployment_with(
        deployment: Arc<Deployment>,
        outbox: Option<outbox::OutboxSource>,
    ) -> Metrics {
        let names = deployment.shard_names().unwrap_or_default();
        let flow = deployment.flow().cloned();
        let mut m = Metrics::new(Some(shards::deployment_source(deployment)), STATUS_TTL);
        if let Some(source) = outbox {
            m.outbox = Some(outbox::OutboxGauges::register(
                &mut m.registry,
                source,
                STATUS_TTL,
            ));
        }
        m.start_at_zero(&names);
        if let Some(f) = flow {
            m.flow_control.set_source(f);
        }
        m
    }

    /// Makes every per-shard counter of `shards` exist at 0, so that a
    /// query over them (a failure ratio, say) has a value before the first
    /// event rather than none.
    pub fn start_at_zero(&self, shards: &[String]) {
        let f = &self.flow;
        for s in shards {
            let l = shard(s);
            for family in [
                &f.enqueued,
                &f.claimed,
                &f.acked,
                &f.retried,
                &f.dead_lettered,
                &f.stale,
                &f.backed_off,
                &f.fenced,
                &f.paused,
                &f.moved,
            ] {
                let _ = family.get_or_create(&l);
            }
        }
    }

    /// Adds the HTTP server's load gauges, read from `source` at every
    /// scrape ([`http`]).
    pub fn with_http(mut self, source: http::HttpSource) -> Metrics {
        self.http = Some(http::HttpGauges::register(&mut self.registry, source));
        self
    }

    /// Every series in the Prometheus text format. Reads the status first
    /// when the cached one is older than the TTL (one read at a time; a
    /// scrape arriving meanwhile waits for it and uses its result).
    pub fn render(&self) -> String {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.flow_control.update(now_ms);
        if let Some(o) = &self.outbox {
            o.refresh();
        }
        if let Some(h) = &self.http {
            h.refresh();
        }
        self.shards.render(&self.registry)
    }

    // -- The worker pool -------------------------------------------------

    /// Feeds a pool event (runs started and finished; the others are
    /// ignored).
    pub fn pool_event(&self, ev: &PoolEvent) {
        match ev {
            PoolEvent::RunStarted { shard: s, wait_ms } => {
                self.flow.claimed.get_or_create(&shard(s)).inc();
                self.wait.observe(seconds(*wait_ms));
            }
            PoolEvent::RunFinished {
                shard: s,
                outcome,
                run_ms,
                ..
            } => {
                self.finished(s, *outcome, 1);
                if *outcome != RunOutcome::Stale {
                    self.run.observe(seconds(*run_ms));
                }
            }
            _ => {}
        }
    }

    fn finished(&self, s: &str, outcome: RunOutcome, n: u64) {
        if n == 0 {
            return;
        }
        let family = match outcome {
            RunOutcome::Acked => &self.flow.acked,
            RunOutcome::Retried => &self.flow.retried,
            RunOutcome::Dead => &self.flow.dead_lettered,
            RunOutcome::BackedOff => &self.flow.backed_off,
            _ => &self.flow.stale,
        };
        family.get_or_create(&shard(s)).inc_by(n);
    }

    // -- Producers -------------------------------------------------------

    /// `n` jobs were enqueued on shard `s`.
    pub fn enqueued(&self, s: &str, n: u64) {
        if n > 0 {
            self.flow.enqueued.get_or_create(&shard(s)).inc_by(n);
            self.history.add(history::Flow::Enqueued, n, now_s());
        }
    }

    /// The per-second counts of the last hour and the totals since start
    /// (this process's enqueues and remote runs).
    pub fn history(&self) -> &History {
        &self.history
    }

    /// Adds a producer's refusals ([`shardq_core::producer::Producer::take_refusals`]).
    pub fn refusals(&self, r: &Refusals) {
        for (s, n) in &r.fenced {
            self.flow.fenced.get_or_create(&shard(s)).inc_by(*n);
        }
        for (s, n) in &r.paused {
            self.flow.paused.get_or_create(&shard(s)).inc_by(*n);
        }
        for (s, n) in &r.moved {
            self.flow.moved.get_or_create(&shard(s)).inc_by(*n);
        }
    }

    // -- Remote workers (the server's claim, ack and fail) -----------------

    /// A remote worker claimed run `receipt` of shard `s` at `now_ms`; the
    /// job became due at `due_ms` (the later of its enqueue and not-before
    /// times). The claim time is kept (bounded, see [`RunTracker`]) until
    /// the run's ack or fail.
    pub fn run_claimed(&self, s: &str, receipt: Receipt, due_ms: u64, now_ms: u64) {
        self.runs_claimed(s, &[(receipt, due_ms)], now_ms);
    }

    /// [`Metrics::run_claimed`] for every run of one claim on shard `s`
    /// (run, due time): the shard's counter, the clock and the run book
    /// each taken once.
    pub fn runs_claimed(&self, s: &str, runs: &[(Receipt, u64)], now_ms: u64) {
        if runs.is_empty() {
            return;
        }
        self.flow
            .claimed
            .get_or_create(&shard(s))
            .inc_by(runs.len() as u64);
        let now_secs = now_s();
        for &(_, due_ms) in runs {
            let wait = now_ms.saturating_sub(due_ms);
            self.history.claimed(wait, now_secs);
            self.wait.observe(seconds(wait));
        }
        let mut book = self.tracker();
        for &(receipt, _) in runs {
            book.started(s, receipt, now_ms);
        }
    }

    /// An ack of `receipts` on shard `s` was recorded at `now_ms`; the ones
    /// in `stale` were refused.
    pub fn run_acked(&self, s: &str, receipts: &[Receipt], stale: &[Receipt], now_ms: u64) {
        let mut acked = 0;
        let mut runs = self.tracker();
        for r in receipts {
            let started = runs.finished(s, *r);
            if stale.contains(r) {
                continue;
            }
            acked += 1;
            if let Some(t) = started {
                self.run.observe(seconds(now_ms.saturating_sub(t)));
            }
        }
        drop(runs);
        self.history.add(history::Flow::Acked, acked, now_s());
        self.finished(s, RunOutcome::Acked, acked);
        self.finished(s, RunOutcome::Stale, stale.len() as u64);
    }

    /// A fail of run `receipt` on shard `s` was recorded at `now_ms`:
    /// `dead` when it was the job's last attempt.
    pub fn run_failed(&self, s: &str, receipt: Receipt, dead: bool, now_ms: u64) {
        let started = self.tracker().finished(s, receipt);
        if let Some(t) = started {
            self.run.observe(seconds(now_ms.saturating_sub(t)));
        }
        let outcome = if dead {
            RunOutcome::Dead
        } else {
            RunOutcome::Retried
        };
        self.history.add(history::Flow::Failed, 1, now_s());
        self.finished(s, outcome, 1);
    }

    /// Run `receipt` on shard `s` ended by its handler's back-off.
    pub fn run_backed_off(&self, s: &str, receipt: Receipt) {
        self.tracker().finished(s, receipt);
        self.finished(s, RunOutcome::BackedOff, 1);
    }

    /// A fail of run `receipt` on shard `s` was refused as stale.
    pub fn run_fail_stale(&self, s: &str, receipt: Receipt) {
        self.tracker().finished(s, receipt);
        self.finished(s, RunOutcome::Stale, 1);
    }

    fn tracker(&self) -> std::sync::MutexGuard<'_, RunTracker> {
        self.runs.lock().unwrap_or_else(|p| p.into_inner())
    }

    // -- Resharding ------------------------------------------------------

    fn set_phase(&self, phase: &str) {
        for p in PHASES {
            self.rebalance
                .phase
                .get_or_create(&PhaseLabel { phase: p })
                .set(i64::from(p == phase));
        }
    }

    /// A rebalance starts (phase `pinning`, the key gauges at 0).
    pub fn rebalance_started(&self) {
        self.set_phase("pinning");
        self.rebalance.keys_to_move.set(0);
        self.rebalance.keys_moved.set(0);
        self.rebalance.keys_paused.set(0);
    }

    /// Feeds a rebalance event.
    pub fn rebalance_event(&self, ev: &RebalanceEvent) {
        let r = &self.rebalance;
        match ev {
            RebalanceEvent::Pinned { pinned, .. } => {
                self.set_phase("moving");
                r.keys_to_move.set(gauge(*pinned));
            }
            RebalanceEvent::Moving { keys } => {
                r.keys_paused.set(gauge(*keys));
            }
            RebalanceEvent::Switched {
                done,
                total,
                keys,
                pause_ms,
                jobs,
            } => {
                r.jobs_moved.inc_by(*jobs);
                r.keys_paused.set(0);
                r.keys_moved.set(gauge(*done));
                r.keys_to_move.set(gauge(*total));
                let s = (pause_ms / 1000.0).max(0.0);
                for _ in 0..*keys {
                    r.pause.observe(s);
                }
            }
            RebalanceEvent::Finished { .. } => {
                r.keys_paused.set(0);
            }
            _ => {}
        }
    }

    /// The rebalance ended: `Ok(keys moved)` or failed.
    pub fn rebalance_ended(&self, result: Result<usize, ()>) {
        self.rebalance.keys_paused.set(0);
        match result {
            Ok(moved) => {
                self.set_phase("finished");
                self.rebalance.keys_moved.set(gauge(moved));
                if self.rebalance.keys_to_move.get() < gauge(moved) {
                    self.rebalance.keys_to_move.set(gauge(moved));
                }
            }
            Err(()) => self.set_phase("failed"),
        }
    }
}

fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests;
