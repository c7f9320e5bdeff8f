//! A deterministic simulation of producers, workers and a live rebalance on
//! the in-memory backend, on a manual clock, with injected faults: workers
//! that crash (their runs lapse), workers stopped past their job lease that
//! then report late, owners that restart (every run of a shard ends), and
//! jobs that dead-letter while their key drains.
//!
//! One thread runs everything: the rebalance's drain waits go through the
//! simulated clock, whose sleep runs one simulation step, so a seed fixes
//! the whole history. After every step the invariants are checked:
//! - a key's runs get strictly growing fences;
//! - a result is accepted only from a key's latest run;
//! - a key's accepted results come in enqueue order (jobs that were dead
//!   letters at some point excepted: the default dead policy lets later
//!   jobs pass a dead one);
//! - at the end, every job a producer was told is stored is acked exactly once;
//! - flow control holds to the millisecond: a key with its own rate (and a
//!   group of keys sharing one) never starts more than `burst + window x
//!   rate` runs in any window, across moves, crashes and handler back-offs
//!   (which end a run without using an attempt, and keep the key's order).
//!
//! Single-key scenarios then kill a rebalance at every write and rerun it:
//! with a producer that never lets the key freeze (a forced round), with
//! the target changed before the rerun, with the old shard's store
//! dropping out for one fence write, and with a third shard that stops
//! answering; each checks that the key's jobs run once, in the order
//! stored, on one shard.
//!
//! Schedules get a seeded scenario of their own: three schedulers (one a
//! stale owner of every shard) fire eight every-second schedules at seeded
//! moments, restarting and reading a clock stepped back now and then,
//! while a rebalance moving the schedules' keys is killed at seeded writes
//! and rerun; every decided tick must have stored exactly one job.
//!
//! Workflows get one too: dependents (a fan-in, a chain link, a dependent
//! run whatever its dependencies' outcomes, one failed by a dead
//! dependency) and two batches, resolved by two resolvers that restart and
//! are killed before or after enqueueing what they release, while a
//! rebalance moving their keys is killed at seeded writes and rerun; each
//! job and dependent starts once and after what it waits for, each due
//! callback once, and nothing that must not start does.
//!
//! `SHARDQ_SIM_SEED=N cargo test -p shardq-core --test simulation` replays
//! seed N alone; CI runs a fixed set of seeds.
//!
//! A second scenario drives the real `WorkerPool` (its threads, its
//! heartbeats, its claims) on a clock that stalls: a seeded share of the
//! pool's readings of the time jump ahead by up to twice the job lease, as
//! a process stopped between a heartbeat and a claim would see it. The
//! thread schedule is the machine's, the stalls are the seed's; checked: no
//! two runs of a key overlap, a key's runs start in enqueue order, and
//! every job is acked exactly once. Run again with every key at concurrency
//! 3: no more than 3 of a key's runs overlap, no job runs twice at once,
//! and a key's jobs first start in enqueue order (by fence).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use shardq_core::flow::{FlowPolicy, FlowSettings, GroupLimit, Rate};
use shardq_core::memory::{MemoryBackend, MemoryMapStore};
use shardq_core::producer::{ProduceError, Producer, ProducerOptions};
use shardq_core::reshard::KeyInventory;
use shardq_core::reshard::{self, MapStore, RebalanceOptions, ReshardError};
use shardq_core::{
    current_run, AckOutcome, CancelOutcome, ClaimedJob, Clock, DeadJob, DedupRecord, FailOutcome,
    Fence, InspectJobs, JobId, KeyCounts, MoveKeys, MovedJob, NewJob, PoolOptions, QueueBackend,
    QueueError, Receipt, RunJobs, ShardStats, Stored, WorkerPool,
};
use shardq_core::{FlowControl, LocalGroupBuckets};
use shardq_route::{Algorithm, ShardMap};

/// The simulation's flow control: key `t-2` starts at most 5 runs a
/// second (burst 1); keys starting with `t-1` (`t-1`, `t-10` .. `t-19`)
/// share the group `sim` at 20 a second (burst 3); keys starting with
/// `t-3` share the group `slots`, two runs at once.
fn sim_flow() -> FlowSettings {
    let mut f = FlowSettings::default();
    f.keys.insert(
        "t-2".into(),
        FlowPolicy {
            rate: Some(Rate {
                count: 5,
                per_ms: 1_000,
            }),
            burst: Some(1),
            ..FlowPolicy::default()
        },
    );
    f.groups.insert(
        "sim".into(),
        GroupLimit {
            rate: Some(Rate {
                count: 20,
                per_ms: 1_000,
            }),
            burst: Some(3),
            concurrency: None,
        },
    );
    f.prefixes.insert(
        "t-1".into(),
        FlowPolicy {
            group: Some("sim".into()),
            ..FlowPolicy::default()
        },
    );
    f.groups.insert(
        "slots".into(),
        GroupLimit {
            rate: None,
            burst: None,
            concurrency: Some(SLOTS),
        },
    );
    f.prefixes.insert(
        "t-3".into(),
        FlowPolicy {
            group: Some("slots".into()),
            ..FlowPolicy::default()
        },
    );
    f
}

/// Runs at once of the group `slots`.
const SLOTS: u32 = 2;

/// SplitMix64: a small seeded generator, so a seed replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

type Step = Box<dyn FnMut() + Send>;

/// A manual clock whose `sleep_ms` runs one simulation step.
#[derive(Default)]
struct SimClock {
    now_ms: AtomicU64,
    step: Mutex<Option<Step>>,
}

impl std::fmt::Debug for SimClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimClock({})", self.now_ms.load(Ordering::SeqCst))
    }
}

impl Clock for SimClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
    fn sleep_ms(&self, ms: u64) {
        self.now_ms.fetch_add(ms, Ordering::SeqCst);
        // A sleep from inside a step (a producer waiting on a paused key)
        // only moves time.
        if let Ok(mut step) = self.step.try_lock() {
            if let Some(f) = step.as_mut() {
                f();
            }
        }
    }
}

const SHARDS: [&str; 3] = ["s0", "s1", "s2"];
const KEYS: u64 = 40;
const LEASE_MS: u64 = 200;

/// One claimed run, as the simulated worker holding it sees it.
struct Held {
    job: ClaimedJob,
    done_at_ms: u64,
    fails: bool,
}

#[derive(Default)]
struct Checks {
    /// Key -> fence of its latest run.
    last_fence: BTreeMap<String, u64>,
    /// (shard, job id) -> (key, sequence number), as enqueues and claims
    /// revealed them (a job moved with its key has a new id on its new shard).
    seq_of: BTreeMap<(String, u64), (String, u64)>,
    /// Key -> sequence number of the last accepted result.
    last_done: BTreeMap<String, u64>,
    /// Jobs (key, sequence number) that were dead letters at some point.
    were_dead: BTreeSet<(String, u64)>,
    /// Accepted acks per job (key, sequence number).
    acked: BTreeMap<(String, u64), u32>,
    /// Jobs (key, sequence number) producers were told are stored.
    stored: BTreeSet<(String, u64)>,
    /// Enqueues a frozen key's old shard sent on to its new one.
    redirects: u64,
    /// Jobs (key, sequence number) an operator cancelled: none may start
    /// or be acked after its cancel returned.
    cancelled: BTreeSet<(String, u64)>,
    /// Key -> the simulated times its runs started.
    starts: BTreeMap<String, Vec<u64>>,
    /// Runs whose handler backed off.
    backed_off: u64,
    /// Runs of the group `slots` by (shard, fence): when each started, when
    /// its lease ends (as extended), and when its worker reported it over.
    slot_runs: BTreeMap<(String, u64), (u64, u64, Option<u64>)>,
    /// The most runs of the group `slots` live at once.
    slots_most: usize,
    violations: Vec<String>,
}

struct World {
    rng: Rng,
    clock: Arc<SimClock>,
    backend: MemoryBackend,
    producer: Producer<MemoryBackend>,
    /// Per simulated worker, the runs it holds; `None` when crashed.
    workers: Vec<Vec<Held>>,
    next_seq: BTreeMap<String, u64>,
    checks: Checks,
    /// Injected failures and one-attempt jobs (off once the operator starts
    /// clearing dead letters, so the rebalance can finish).
    dead_faults: bool,
}

impl World {
    /// One simulated millisecond: jobs produced, every worker's turn, an
    /// operator's cancel, the slot checks and an owner restart, each by the
    /// seeded rng in that order.
    fn step(&mut self) {
        let now = self.clock.now_ms();
        self.produce();
        for w in 0..self.workers.len() {
            self.work(w, now);
        }
        self.operator_cancels();
        self.check_slots(now);
        // Owner restart: every run of one shard ends.
        if self.rng.chance(1) {
            let shards = self.backend.shard_names();
            let shard = &shards[self.rng.below(shards.len() as u64) as usize];
            self.backend.release(shard).unwrap();
            self.backend.adopt(shard).unwrap();
        }
        self.clock.now_ms.fetch_add(1, Ordering::SeqCst);
    }

    /// Produces a few jobs, some that dead-letter at their first failure,
    /// recording what was stored.
    fn produce(&mut self) {
        for _ in 0..self.rng.below(3) {
            let key = format!("t-{}", self.rng.below(KEYS));
            let seq = *self.next_seq.entry(key.clone()).or_default();
            let mut job = NewJob::new(key.clone(), seq.to_string());
            // Some jobs dead-letter at their first failure, also mid-drain.
            job.max_attempts = if self.dead_faults && self.rng.chance(20) {
                1
            } else {
                3
            };
            let placed = self.producer.enqueue(&job);
            self.checks.redirects += self.producer.take_refusals().moved.values().sum::<u64>();
            match placed {
                Ok(p) => {
                    self.next_seq.insert(key.clone(), seq + 1);
                    self.checks
                        .seq_of
                        .insert((p.shard, p.id.0), (key.clone(), seq));
                    self.checks.stored.insert((key.clone(), seq));
                }
                // A clear refusal: nothing stored, the producer knows.
                // (A rebalance killed between fencing and publishing leaves
                // the old map refused until it is rerun.)
                Err(ProduceError::PausedTooLong { .. } | ProduceError::FencedTooLong { .. }) => {}
                Err(e) => self.checks.violations.push(format!("enqueue failed: {e}")),
            }
        }
    }

    /// Worker `w`'s turn: maybe a crash or a stop past the lease, then its
    /// due runs reported, its live runs heartbeated and a claim.
    fn work(&mut self, w: usize, now: u64) {
        match self.rng.below(100) {
            // Crash: every run this worker holds is forgotten (a run
            // at its last attempt dead-letters when its lease lapses).
            0..=1 => {
                for h in std::mem::take(&mut self.workers[w]) {
                    self.may_die(&h.job);
                }
            }
            // Stop past the lease: its runs report much later.
            2..=3 => {
                for h in &mut self.workers[w] {
                    h.done_at_ms = now + LEASE_MS * 3;
                }
            }
            _ => {}
        }
        let (due, keep): (Vec<Held>, Vec<Held>) = std::mem::take(&mut self.workers[w])
            .into_iter()
            .partition(|h| h.done_at_ms <= now);
        self.workers[w] = keep;
        for h in due {
            if !h.fails && self.rng.chance(4) {
                self.back_off(h);
            } else {
                self.finish(h);
            }
        }
        self.heartbeat(w, now);
        self.claim_for(w, now);
    }

    /// Heartbeats worker `w`'s runs that are not stalled, moving the lease
    /// ends the slot checks expect.
    fn heartbeat(&mut self, w: usize, now: u64) {
        let mut per_shard: BTreeMap<String, Vec<_>> = BTreeMap::new();
        for h in &self.workers[w] {
            if h.done_at_ms <= now + LEASE_MS {
                per_shard
                    .entry(h.job.shard.clone())
                    .or_default()
                    .push(h.job.receipt());
            }
        }
        for (shard, receipts) in per_shard {
            let refused = self
                .backend
                .extend(&shard, &receipts, LEASE_MS)
                .unwrap_or_else(|_| receipts.clone());
            for r in receipts.iter().filter(|r| !refused.contains(r)) {
                if let Some(run) = self.checks.slot_runs.get_mut(&(shard.clone(), r.fence)) {
                    run.1 = now + LEASE_MS;
                }
            }
        }
    }

    /// Worker `w` claims on a seeded shard (now and then one only the
    /// backend knows) and holds what it got, some runs set to fail.
    fn claim_for(&mut self, w: usize, now: u64) {
        let shard = SHARDS[self.rng.below(SHARDS.len() as u64) as usize];
        let shards = self.backend.shard_names();
        let shard = if self.rng.chance(30) {
            shards[self.rng.below(shards.len() as u64) as usize].clone()
        } else {
            shard.to_string()
        };
        let jobs = match self.backend.claim(&shard, 4, LEASE_MS) {
            Ok(j) => j,
            Err(e) => {
                self.checks
                    .violations
                    .push(format!("claim on {shard}: {e}"));
                return;
            }
        };
        for job in jobs {
            self.started(&job);
            let fails = self.dead_faults && self.rng.chance(5);
            let done_at_ms = now + 1 + self.rng.below(LEASE_MS / 2);
            self.workers[w].push(Held {
                job,
                done_at_ms,
                fails,
            });
        }
    }

    /// An operator cancels a live job of some key (queued, delayed, dead
    /// or running), on any shard, also while the key moves.
    fn operator_cancels(&mut self) {
        if self.rng.chance(3) {
            let shards = self.backend.shard_names();
            let shard = shards[self.rng.below(shards.len() as u64) as usize].clone();
            let key = format!("t-{}", self.rng.below(KEYS));
            let jobs = self.backend.key_jobs(&shard, &key, 20).unwrap_or_default();
            if !jobs.is_empty() {
                let j = &jobs[self.rng.below(jobs.len() as u64) as usize];
                let seq = std::str::from_utf8(&j.payload)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(u64::MAX);
                match self.backend.cancel(&shard, j.id) {
                    Ok(CancelOutcome::Cancelled | CancelOutcome::Stopping) => {
                        self.trace(&key, format!("cancelled id {} seq {seq}", j.id));
                        self.checks.cancelled.insert((key, seq));
                    }
                    Ok(_) => {}
                    Err(e) => self.checks.violations.push(format!("cancel: {e}")),
                }
            }
        }
    }

    fn trace(&self, key: &str, what: String) {
        if std::env::var("SHARDQ_SIM_TRACE").ok().as_deref() == Some(key) {
            eprintln!("{} {key}: {what}", self.clock.now_ms());
        }
    }

    /// The job's (key, sequence number), from its payload.
    fn ident(job: &ClaimedJob) -> (String, u64) {
        let seq = std::str::from_utf8(&job.payload)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(u64::MAX);
        (job.key.clone(), seq)
    }

    /// A run that will not report: at its last attempt, its lapse makes
    /// the job a dead letter, which may later run out of order.
    fn may_die(&mut self, job: &ClaimedJob) {
        if job.attempt >= job.max_attempts {
            self.checks.were_dead.insert(Self::ident(job));
        }
    }

    fn started(&mut self, job: &ClaimedJob) {
        let now = self.clock.now_ms();
        if job.key.starts_with("t-3") {
            self.checks.slot_runs.insert(
                (job.shard.clone(), job.fence),
                (now, job.lease_until_ms, None),
            );
        }
        self.checks
            .starts
            .entry(job.key.clone())
            .or_default()
            .push(now);
        self.checks
            .seq_of
            .insert((job.shard.clone(), job.id.0), Self::ident(job));
        self.trace(
            &job.key,
            format!(
                "start id {} seq {:?} attempt {} fence {}",
                job.id,
                self.checks.seq_of.get(&(job.shard.clone(), job.id.0)),
                job.attempt,
                job.fence
            ),
        );
        if self.checks.cancelled.contains(&Self::ident(job)) {
            self.checks.violations.push(format!(
                "job {:?} started after it was cancelled",
                Self::ident(job)
            ));
        }
        let last = self.checks.last_fence.insert(job.key.clone(), job.fence);
        if let Some(last) = last {
            if job.fence <= last {
                self.checks.violations.push(format!(
                    "key {} got fence {} after {last}",
                    job.key, job.fence
                ));
            }
        }
    }

    /// The handler backs off (its downstream limits it): the run ends
    /// without using an attempt, for the key or its whole group.
    fn back_off(&mut self, h: Held) {
        self.run_over(&h.job);
        let ms = 1 + self.rng.below(300);
        let group = self.rng.chance(50);
        self.trace(
            &h.job.key,
            format!("back off id {} {ms} ms fence {}", h.job.id, h.job.fence),
        );
        match self
            .backend
            .back_off(&h.job.shard, h.job.receipt(), ms, group)
        {
            Ok(_) => self.checks.backed_off += 1,
            Err(QueueError::StaleReceipt { .. }) => self.may_die(&h.job),
            Err(e) => self.checks.violations.push(format!("back off: {e}")),
        }
    }

    /// The worker is done with run `job` (reported, or given up): from now
    /// on it is not running.
    fn run_over(&mut self, job: &ClaimedJob) {
        let now = self.clock.now_ms();
        if let Some(run) = (self.checks.slot_runs).get_mut(&(job.shard.clone(), job.fence)) {
            run.2.get_or_insert(now);
        }
    }

    /// Runs of the group `slots` live at `now` (started, not reported over,
    /// lease not ended): never more than [`SLOTS`].
    fn check_slots(&mut self, now: u64) {
        let live = (self.checks.slot_runs.values())
            .filter(|(start, until, end)| *start <= now && now < *until && end.is_none())
            .count();
        self.checks.slots_most = self.checks.slots_most.max(live);
        if live > SLOTS as usize {
            self.checks.violations.push(format!(
                "{live} runs of group slots live at {now} (limit {SLOTS})"
            ));
        }
    }

    /// Checks every limited key's and group's starts against its bucket:
    /// in any window of `w` ms at most `burst + w x rate` of them.
    fn check_limits(&mut self) {
        let settings = sim_flow();
        let mut series: BTreeMap<String, (Vec<u64>, Rate, u64)> = BTreeMap::new();
        for (key, ts) in &self.checks.starts {
            let p = settings.for_key(key);
            if let (Some(rate), Some(burst)) = (p.rate, p.burst_or_default()) {
                series.insert(format!("key {key}"), (ts.clone(), rate, burst));
            }
            if let Some((g, limit)) =
                (p.group.as_ref()).and_then(|g| settings.groups.get_key_value(g))
            {
                let e = series
                    .entry(format!("group {g}"))
                    .or_insert_with(|| (Vec::new(), limit.bucket_rate(), limit.burst_or_default()));
                e.0.extend(ts);
            }
        }
        for (what, (mut ts, rate, burst)) in series {
            ts.sort_unstable();
            for w in [1u64, 50, 200, 1_000, 5_000] {
                let bound = burst + w * rate.count / rate.per_ms;
                let mut j = 0;
                for i in 0..ts.len() {
                    while ts[i] - ts[j] >= w {
                        j += 1;
                    }
                    let n = (i - j + 1) as u64;
                    if n > bound {
                        self.checks.violations.push(format!(
                            "{what}: {n} starts within {w} ms from {} (bound {bound})",
                            ts[j]
                        ));
                        return;
                    }
                }
            }
        }
    }

    fn finish(&mut self, h: Held) {
        self.run_over(&h.job);
        self.trace(
            &h.job.key,
            format!(
                "finish id {} fails {} fence {}",
                h.job.id, h.fails, h.job.fence
            ),
        );
        let id = Self::ident(&h.job);
        let latest = self.checks.last_fence.get(&h.job.key) == Some(&h.job.fence);
        let accepted = if h.fails {
            match self
                .backend
                .fail(&h.job.shard, h.job.receipt(), "injected", Some(5))
            {
                Ok(shardq_core::FailOutcome::Dead) => {
                    self.checks.were_dead.insert(id.clone());
                    true
                }
                Ok(_) => true,
                Err(QueueError::StaleReceipt { .. }) => {
                    self.may_die(&h.job);
                    false
                }
                Err(e) => {
                    self.checks.violations.push(format!("fail: {e}"));
                    false
                }
            }
        } else {
            let out = self.backend.ack(&h.job.shard, &[h.job.receipt()]).unwrap();
            if out.acked == 1 {
                if self.checks.cancelled.contains(&id) {
                    self.checks
                        .violations
                        .push(format!("job {id:?} was acked after it was cancelled"));
                }
                *self.checks.acked.entry(id.clone()).or_default() += 1;
                // Among jobs that were never dead letters, a key's results
                // come in enqueue order.
                if !self.checks.were_dead.contains(&id) {
                    let seq = id.1;
                    if let Some(last) = self.checks.last_done.insert(h.job.key.clone(), seq) {
                        if seq <= last {
                            self.checks.violations.push(format!(
                                "key {} finished job #{seq} after job #{last}",
                                h.job.key
                            ));
                        }
                    }
                }
            }
            if out.acked == 0 {
                self.may_die(&h.job);
            }
            out.acked == 1
        };
        if accepted && !latest {
            self.checks.violations.push(format!(
                "a result of an earlier run of key {} was accepted (fence {})",
                h.job.key, h.job.fence
            ));
        }
    }

    /// Retries every dead letter (an operator's `dead retry`), noting them:
    /// a run may also dead-letter by lapsing, unseen by any worker.
    fn retry_dead(&mut self) {
        for s in self.backend.shard_names() {
            for d in self.backend.dead_list(&s, usize::MAX).unwrap() {
                if let Some(ident) = self.checks.seq_of.get(&(s.clone(), d.id.0)) {
                    self.checks.were_dead.insert(ident.clone());
                }
            }
            self.backend.dead_retry(&s, None).unwrap();
        }
    }

    fn assert_ok(&self, seed: u64, when: &str) {
        assert!(
            self.checks.violations.is_empty(),
            "seed {seed}, {when}: {:?} (replay: SHARDQ_SIM_SEED={seed})",
            &self.checks.violations[..self.checks.violations.len().min(5)]
        );
    }

    /// Quiesce: no more new jobs or faults; every held run finishes and
    /// the dead are retried until nothing is left to run (bounded).
    fn quiesce(&mut self) {
        for _ in 0..20_000 {
            let now = self.clock.now_ms();
            for i in 0..self.workers.len() {
                let held = std::mem::take(&mut self.workers[i]);
                for mut h in held {
                    h.fails = false;
                    self.finish(h);
                }
            }
            let mut idle = true;
            self.retry_dead();
            for s in self.backend.shard_names() {
                let jobs = self.backend.claim(&s, 64, LEASE_MS).unwrap();
                idle &= jobs.is_empty() && self.backend.next_due_ms(&s).unwrap().is_none();
                for job in jobs {
                    self.started(&job);
                    self.workers[0].push(Held {
                        job,
                        done_at_ms: now,
                        fails: false,
                    });
                }
            }
            self.clock.now_ms.fetch_add(10, Ordering::SeqCst);
            if idle && self.workers.iter().all(Vec::is_empty) {
                break;
            }
        }
    }

    /// The end checks: the limits held, no violation, every stored job
    /// acked exactly once (none of the cancelled), and the run saw load,
    /// cancels and the group `slots` at its limit.
    fn check_at_the_end(&mut self, seed: u64) {
        self.check_limits();
        self.assert_ok(seed, "at the end");
        // Every stored job ran to its ack exactly once, but the cancelled ones,
        // which never did.
        let lost: Vec<_> = self
            .checks
            .stored
            .iter()
            .filter(|id| {
                let want = u32::from(!self.checks.cancelled.contains(*id));
                self.checks.acked.get(*id).copied().unwrap_or(0) != want
            })
            .take(5)
            .collect();
        assert!(
            lost.is_empty(),
            "seed {seed}: stored jobs not acked exactly once: {lost:?} of {} (replay: SHARDQ_SIM_SEED={seed})",
            self.checks.stored.len()
        );
        assert!(
            self.checks.stored.len() > 100,
            "seed {seed}: too little load"
        );
        assert!(
            !self.checks.cancelled.is_empty(),
            "seed {seed}: no job was cancelled"
        );
        assert_eq!(
            self.checks.slots_most, SLOTS as usize,
            "seed {seed}: the group `slots` never ran at its limit (the check saw nothing)"
        );
    }
}

/// Returns how many jobs the last, finishing, rebalance copied with their
/// keys, whether a shard was cut off, and how many enqueues a frozen key
/// sent on.
fn simulate(seed: u64) -> (u64, u64, u64, u64) {
    let (clock, backend, store, world) = sim_world(seed);
    {
        let world = world.clone();
        *clock.step.lock().unwrap() = Some(Box::new(move || {
            let mut w = world.lock().unwrap();
            w.step();
            w.assert_ok(seed, "during the rebalance");
        }));
    }
    let step = |n: usize| {
        for _ in 0..n {
            // Held so that a sleep inside the step (a producer waiting on
            // a key a killed rebalance left paused) only moves time.
            let _hook = clock.step.lock().unwrap();
            let mut w = world.lock().unwrap();
            w.step();
            w.assert_ok(seed, "under load");
        }
    };
    step(300);
    reshard::add_shard(&store, "s3", 1, None).unwrap();
    backend.add_shard("s3");
    let opts = RebalanceOptions {
        batch: 8,
        drain_timeout_ms: 60_000,
        poll_ms: 1,
        clock: clock.clone(),
        runner: "simulation".into(),
    };
    // The rebalance is killed at a seeded write, up to three times, and
    // rerun each time; the producers and workers keep going throughout.
    let crashing = Crashing::new(backend.clone(), clock.clone());
    let mut crash_rng = Rng(seed ^ 0x5eed);
    let mut moved = 0u64;
    let mut cut_offs = 0u64;
    for attempt in 0.. {
        crashing.writes.store(0, Ordering::SeqCst);
        let at = if attempt < 3 {
            1 + crash_rng.below(40)
        } else {
            0
        };
        crashing.crash_at.store(at, Ordering::SeqCst);
        // In the first run without a kill, for every other seed, the rebalance loses one
        // shard (never the new one, which all moving keys need) at a
        // seeded write: the keys moving from it stay, the others move, and
        // the run after it, with the link back, finishes.
        let cut = (attempt == 3 && seed % 2 == 1).then(|| {
            let shard = SHARDS[crash_rng.below(SHARDS.len() as u64) as usize].to_string();
            (shard, crash_rng.below(30))
        });
        *crashing.cut_off.lock().unwrap() = cut.clone();
        let result = reshard::rebalance(&crashing, &store, &opts, &mut |_| {});
        *crashing.cut_off.lock().unwrap() = None;
        match result {
            Ok(r) => {
                moved += r.jobs_moved;
                break;
            }
            Err(ReshardError::ShardsFailed { shards, .. }) if cut.is_some() => {
                let (name, _) = cut.unwrap();
                assert!(
                    shards.len() == 1 && shards[0].starts_with(&format!("{name}:")),
                    "seed {seed}: the failed shards name {name}: {shards:?}"
                );
                cut_offs += 1;
                step(50);
            }
            // Lost before the moves (the scan, the fences) or after them
            // (the last checks): the run stops, naming the shard.
            Err(e)
                if cut.as_ref().is_some_and(|(name, _)| {
                    e.to_string().contains(&format!("shard {name:?}"))
                }) =>
            {
                step(50);
            }
            Err(e) if at != 0 && crashing.writes.load(Ordering::SeqCst) >= at => {
                // Killed: what it wrote stays; the next run finishes it.
                let _ = e;
                step(50);
            }
            Err(e) => panic!("seed {seed}: rebalance: {e}"),
        }
    }
    assert!(store.load().unwrap().shard("s3").is_some());
    // No shard is left with a key sealed for a move.
    for s in backend.shard_names() {
        let sealed = backend.fence(&s).unwrap().sealed_keys;
        assert!(sealed.is_empty(), "seed {seed}: {s} still seals {sealed:?}");
    }
    step(200);
    // Quiesce: no more new jobs or faults, finish everything.
    *clock.step.lock().unwrap() = None;
    let mut w = world.lock().unwrap();
    w.quiesce();
    w.check_at_the_end(seed);
    (moved, cut_offs, w.checks.redirects, w.checks.backed_off)
}

/// The simulated world for `seed`: a clock, a three-shard backend with
/// flow control, its map store and three workers with faults on.
fn sim_world(
    seed: u64,
) -> (
    Arc<SimClock>,
    MemoryBackend,
    MemoryMapStore,
    Arc<Mutex<World>>,
) {
    let clock = Arc::new(SimClock::default());
    clock.now_ms.store(1_700_000_000_000, Ordering::SeqCst);
    let backend = MemoryBackend::new(&SHARDS, clock.clone()).with_flow(Arc::new(FlowControl::new(
        sim_flow(),
        Arc::new(LocalGroupBuckets::default()),
    )));
    let store = MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, SHARDS).unwrap());
    let producer = Producer::new(
        Arc::new(backend.clone()),
        Arc::new(store.clone()),
        ProducerOptions {
            pause_wait_ms: 20,
            fence_wait_ms: 1_000,
            refresh_ms: 50,
            clock: clock.clone(),
            ..ProducerOptions::default()
        },
    )
    .unwrap();
    let world = Arc::new(Mutex::new(World {
        rng: Rng(seed),
        clock: clock.clone(),
        backend: backend.clone(),
        producer,
        workers: (0..3).map(|_| Vec::new()).collect(),
        next_seq: BTreeMap::new(),
        checks: Checks::default(),
        dead_faults: true,
    }));
    (clock, backend, store, world)
}

/// The rebalance's view of the backend, killed at its `crash_at`-th write
/// (a fence, an import, a purge, a dedup copy): that write and every later
/// one fail, as if the process died just before it; what was written
/// before stays. `crash_at == 0` never crashes.
/// Every copy call first lets the world run a step, so producers,
/// workers and faults interleave with a transfer's rounds.
struct Crashing {
    inner: MemoryBackend,
    clock: Arc<SimClock>,
    writes: AtomicU64,
    crash_at: AtomicU64,
    /// A shard the rebalance cannot reach (every call, reads too) once it
    /// made this many writes, as when the link to one store fails mid-move;
    /// producers and workers still reach it.
    cut_off: Mutex<Option<(String, u64)>>,
    /// A shard whose store drops out once, for a fence write that raises
    /// its map-version floor to at least this version and for the read
    /// that follows it; the calls after those succeed.
    blip: Mutex<Option<(String, u64, bool)>>,
}

impl Crashing {
    fn new(inner: MemoryBackend, clock: Arc<SimClock>) -> Crashing {
        Crashing {
            inner,
            clock,
            writes: AtomicU64::new(0),
            crash_at: AtomicU64::new(0),
            cut_off: Mutex::new(None),
            blip: Mutex::new(None),
        }
    }

    fn reach(&self, shard: &str) -> Result<(), QueueError> {
        if let Some((cut, after)) = &*self.cut_off.lock().unwrap() {
            if cut == shard && self.writes.load(Ordering::SeqCst) >= *after {
                return Err(QueueError::Unavailable {
                    shard: shard.to_string(),
                    reason: "the rebalance lost its link to this shard's store".into(),
                });
            }
        }
        Ok(())
    }

    fn write(&self, shard: &str) -> Result<(), QueueError> {
        let n = self.writes.fetch_add(1, Ordering::SeqCst) + 1;
        let at = self.crash_at.load(Ordering::SeqCst);
        if at != 0 && n >= at {
            return Err(QueueError::Unavailable {
                shard: shard.to_string(),
                reason: format!("the rebalance was killed before write {n}"),
            });
        }
        Ok(())
    }
}

impl KeyInventory for Crashing {
    fn keys_with_work(&self, shard: &str) -> Result<Vec<(String, KeyCounts)>, QueueError> {
        self.reach(shard)?;
        self.inner.keys_with_work(shard)
    }
}

impl RunJobs for Crashing {
    fn shard_names(&self) -> Vec<String> {
        self.inner.shard_names()
    }

    fn enqueue(&self, shard: &str, v: u64, jobs: &[NewJob]) -> Result<Vec<JobId>, QueueError> {
        self.reach(shard)?;
        self.inner.enqueue(shard, v, jobs)
    }

    fn enqueue_dedup(
        &self,
        shard: &str,
        v: u64,
        jobs: &[NewJob],
        window_ms: u64,
    ) -> Result<Vec<Stored>, QueueError> {
        self.reach(shard)?;
        self.inner.enqueue_dedup(shard, v, jobs, window_ms)
    }

    fn adopt(&self, shard: &str) -> Result<(), QueueError> {
        self.reach(shard)?;
        self.inner.adopt(shard)
    }

    fn release(&self, shard: &str) -> Result<(), QueueError> {
        self.reach(shard)?;
        self.inner.release(shard)
    }

    fn claim(&self, shard: &str, max: usize, lease_ms: u64) -> Result<Vec<ClaimedJob>, QueueError> {
        self.reach(shard)?;
        self.inner.claim(shard, max, lease_ms)
    }

    fn ack_results(
        &self,
        shard: &str,
        receipts: &[Receipt],
        results: &[Option<Vec<u8>>],
    ) -> Result<AckOutcome, QueueError> {
        self.reach(shard)?;
        self.inner.ack_results(shard, receipts, results)
    }

    fn fail(
        &self,
        shard: &str,
        receipt: Receipt,
        reason: &str,
        retry_in_ms: Option<u64>,
    ) -> Result<FailOutcome, QueueError> {
        self.reach(shard)?;
        self.inner.fail(shard, receipt, reason, retry_in_ms)
    }

    fn extend(
        &self,
        shard: &str,
        receipts: &[Receipt],
        lease_ms: u64,
    ) -> Result<Vec<Receipt>, QueueError> {
        self.reach(shard)?;
        self.inner.extend(shard, receipts, lease_ms)
    }

    fn next_due_ms(&self, shard: &str) -> Result<Option<u64>, QueueError> {
        self.reach(shard)?;
        self.inner.next_due_ms(shard)
    }
}

impl MoveKeys for Crashing {
    fn dedup_export(&self, shard: &str, key: &str) -> Result<Vec<DedupRecord>, QueueError> {
        self.reach(shard)?;
        self.inner.dedup_export(shard, key)
    }

    fn dedup_import(&self, shard: &str, records: &[DedupRecord]) -> Result<(), QueueError> {
        self.reach(shard)?;
        self.write(shard)?;
        self.inner.dedup_import(shard, records)
    }

    fn dedup_keys(&self, shard: &str) -> Result<Vec<String>, QueueError> {
        self.reach(shard)?;
        self.inner.dedup_keys(shard)
    }

    fn export_jobs(
        &self,
        shard: &str,
        key: &str,
        after: Option<JobId>,
        max: usize,
    ) -> Result<Vec<MovedJob>, QueueError> {
        self.reach(shard)?;
        self.clock.sleep_ms(1);
        self.inner.export_jobs(shard, key, after, max)
    }

    fn import_jobs(
        &self,
        shard: &str,
        from: &str,
        key: &str,
        jobs: &[MovedJob],
    ) -> Result<Vec<(JobId, JobId)>, QueueError> {
        self.reach(shard)?;
        self.clock.sleep_ms(1);
        self.write(shard)?;
        self.inner.import_jobs(shard, from, key, jobs)
    }

    fn imported_up_to(
        &self,
        shard: &str,
        from: &str,
        key: &str,
    ) -> Result<Option<JobId>, QueueError> {
        self.reach(shard)?;
        self.inner.imported_up_to(shard, from, key)
    }

    fn sync_imports(&self, shard: &str) -> Result<(), QueueError> {
        self.reach(shard)?;
        self.inner.sync_imports(shard)
    }

    fn freeze_caught_up(
        &self,
        shard: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<String>, QueueError> {
        self.reach(shard)?;
        // Time for producers to slip a job in between the last copy and
        // the freeze (which must then refuse to freeze).
        self.clock.sleep_ms(1);
        self.write(shard)?;
        self.inner.freeze_caught_up(shard, items)
    }

    fn purge_key(&self, shard: &str, key: &str) -> Result<u64, QueueError> {
        self.reach(shard)?;
        self.write(shard)?;
        self.inner.purge_key(shard, key)
    }

    fn fence(&self, shard: &str) -> Result<Fence, QueueError> {
        self.reach(shard)?;
        self.inner.fence(shard)
    }

    fn set_fence(&self, shard: &str, fence: &Fence) -> Result<(), QueueError> {
        self.reach(shard)?;
        self.write(shard)?;
        if let Some((name, version, fired)) = &mut *self.blip.lock().unwrap() {
            if name == shard && !*fired && fence.map_version_min >= *version {
                *fired = true;
                return Err(QueueError::Unavailable {
                    shard: shard.to_string(),
                    reason: "the store dropped out for a moment".into(),
                });
            }
        }
        self.inner.set_fence(shard, fence)
    }
}

impl InspectJobs for Crashing {
    fn key_counts(&self, shard: &str, key: &str) -> Result<KeyCounts, QueueError> {
        self.reach(shard)?;
        self.inner.key_counts(shard, key)
    }

    fn shard_stats(&self, shard: &str) -> Result<ShardStats, QueueError> {
        self.reach(shard)?;
        let mut blip = self.blip.lock().unwrap();
        if let Some((name, _, fired)) = &*blip {
            if name == shard && *fired {
                *blip = None;
                return Err(QueueError::Unavailable {
                    shard: shard.to_string(),
                    reason: "the store dropped out for a moment".into(),
                });
            }
        }
        drop(blip);
        self.inner.shard_stats(shard)
    }

    fn dead_list(&self, shard: &str, limit: usize) -> Result<Vec<DeadJob>, QueueError> {
        self.reach(shard)?;
        self.inner.dead_list(shard, limit)
    }

    fn job(&self, shard: &str, id: JobId) -> Result<Option<shardq_core::JobInfo>, QueueError> {
        self.reach(shard)?;
        self.inner.job(shard, id)
    }

    fn dead_retry(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.reach(shard)?;
        self.inner.dead_retry(shard, ids)
    }

    fn dead_purge(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.reach(shard)?;
        self.inner.dead_purge(shard, ids)
    }
}

#[test]
fn seeded_simulations_keep_order_single_runs_and_every_job() {
    if let Ok(seed) = std::env::var("SHARDQ_SIM_SEED") {
        simulate(seed.parse().expect("SHARDQ_SIM_SEED must be a number"));
        return;
    }
    let (mut moved, mut cut_offs, mut redirects, mut backed_off) = (0, 0, 0, 0);
    for seed in 1..=16 {
        let (m, c, r, b) = simulate(seed);
        moved += m;
        cut_offs += c;
        redirects += r;
        backed_off += b;
    }
    // Handlers backed off (their keys and groups kept order and limits).
    assert!(backed_off > 0, "no handler backed off");
    // Producers met frozen keys and followed them (order and every job
    // checked above, through those redirects).
    assert!(redirects > 0, "no producer was sent on by a frozen key");
    // The moves took backlogs along (not only keys that had drained).
    assert!(moved > 0, "no rebalance copied a job");
    // Some runs lost a shard mid-move and went on with the others.
    assert!(cut_offs > 0, "no rebalance lost a shard it moved keys from");
}

/// A clock some of whose readings jump ahead: the process "stalled" just
/// before it looked at the time.
#[derive(Debug)]
struct StallingClock {
    now_ms: AtomicU64,
    rng: Mutex<Rng>,
    /// Percent of readings that stall.
    stall_percent: u64,
    stall_ms_max: u64,
    stalls: AtomicU64,
}

impl std::fmt::Debug for Rng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Rng")
    }
}

impl Clock for StallingClock {
    fn now_ms(&self) -> u64 {
        let jump = {
            let mut r = self.rng.lock().unwrap();
            if r.chance(self.stall_percent) {
                r.below(self.stall_ms_max) + 1
            } else {
                0
            }
        };
        if jump > 0 {
            self.stalls.fetch_add(1, Ordering::SeqCst);
        }
        self.now_ms.fetch_add(jump, Ordering::SeqCst) + jump
    }
    fn sleep_ms(&self, ms: u64) {
        self.now_ms.fetch_add(ms, Ordering::SeqCst);
        std::thread::yield_now();
    }
}

/// Per key: (fence, job index) of every start.
type StartsByKey = BTreeMap<String, Vec<(u64, usize)>>;

/// With `concurrency` above 1 every key may run that many jobs at once:
/// checked then that no more of its runs overlap, and that its jobs first
/// start in enqueue order (by their runs' fences: handlers of one key race
/// each other to the bookkeeping).
/// Long on purpose: one seeded scenario, the jobs, the handler that checks
/// each start against the state it shares with the end checks, the pool's
/// run and those checks, in the order they happen.
fn real_pool_with_stalls(seed: u64, concurrency: u32) {
    const KEYS: usize = 12;
    const PER_KEY: usize = 15;
    const JOB_LEASE_MS: u64 = 300;
    let clock = Arc::new(StallingClock {
        now_ms: AtomicU64::new(1_000_000),
        rng: Mutex::new(Rng(seed)),
        stall_percent: 3,
        stall_ms_max: 2 * JOB_LEASE_MS,
        stalls: AtomicU64::new(0),
    });
    let mut backend = MemoryBackend::new(&["s0", "s1"], clock.clone());
    if concurrency > 1 {
        let settings = FlowSettings {
            default: FlowPolicy {
                concurrency,
                ..FlowPolicy::default()
            },
            ..FlowSettings::default()
        };
        let groups = Arc::new(LocalGroupBuckets::default());
        backend = backend.with_flow(Arc::new(FlowControl::new(settings, groups)));
    }
    let most = concurrency as usize;
    for k in 0..KEYS {
        let jobs: Vec<NewJob> = (0..PER_KEY)
            .map(|i| {
                let mut j = NewJob::new(format!("k{k}"), i.to_string());
                j.max_attempts = 1_000;
                j
            })
            .collect();
        let shard = if k % 2 == 0 { "s0" } else { "s1" };
        backend.enqueue(shard, 1, &jobs).unwrap();
    }
    // Per key: how many of its runs are in a handler now, and the last
    // started job's index.
    let running: Arc<Mutex<BTreeMap<String, (usize, usize)>>> = Arc::default();
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    // Per key: (fence, job index) of every start; the jobs in a handler.
    let starts: Arc<Mutex<StartsByKey>> = Arc::default();
    let in_handler: Arc<Mutex<BTreeSet<(String, usize)>>> = Arc::default();
    let rng = Arc::new(Mutex::new(Rng(seed ^ 0xA5A5)));
    let handler: Arc<shardq_core::Handler> = {
        let (running, violations, rng) = (running.clone(), violations.clone(), rng.clone());
        let (starts, in_handler) = (starts.clone(), in_handler.clone());
        Arc::new(move |job: &ClaimedJob| {
            let seq: usize = String::from_utf8_lossy(&job.payload).parse().unwrap();
            if !in_handler.lock().unwrap().insert((job.key.clone(), seq)) {
                violations
                    .lock()
                    .unwrap()
                    .push(format!("{}: job {seq} started while it ran", job.key));
            }
            (starts.lock().unwrap().entry(job.key.clone()).or_default()).push((job.fence, seq));
            {
                let mut r = running.lock().unwrap();
                let (n, last) = r.entry(job.key.clone()).or_insert((0, 0));
                if *n >= most {
                    violations.lock().unwrap().push(format!(
                        "{}: job {seq} started while {most} runs of the key ran",
                        job.key
                    ));
                }
                if most == 1 && seq < *last {
                    violations.lock().unwrap().push(format!(
                        "{}: job {seq} started after job {}",
                        job.key, *last
                    ));
                }
                *n += 1;
                *last = seq;
            }
            let (work_us, fail) = {
                let mut r = rng.lock().unwrap();
                (r.below(1_500), r.chance(5))
            };
            let run = current_run();
            let until = std::time::Instant::now() + std::time::Duration::from_micros(work_us);
            while std::time::Instant::now() < until
                && !run.as_ref().is_some_and(|r| r.is_cancelled())
            {
                std::thread::yield_now();
            }
            running.lock().unwrap().get_mut(&job.key).unwrap().0 -= 1;
            in_handler.lock().unwrap().remove(&(job.key.clone(), seq));
            if fail {
                Err("a seeded failure".into())
            } else {
                Ok(())
            }
        })
    };
    let opts = PoolOptions {
        concurrency: 6,
        job_lease_ms: JOB_LEASE_MS,
        idle_poll_ms: 1,
        exit_when_idle: true,
        ..PoolOptions::default()
    };
    let mut coord = shardq_core::memory::MemoryCoordinator::new(backend.clone());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let b: Arc<dyn QueueBackend> = Arc::new(backend.clone());
    let report = WorkerPool::run(b, &mut coord, handler, clock.clone(), opts, &stop)
        .unwrap_or_else(|e| panic!("seed {seed}: the pool failed: {e}"));
    let mut v = violations.lock().unwrap().clone();
    for (key, mut runs) in starts.lock().unwrap().clone() {
        runs.sort_unstable();
        let mut seen = BTreeSet::new();
        let firsts: Vec<usize> = (runs.iter())
            .filter(|(_, seq)| seen.insert(*seq))
            .map(|(_, seq)| *seq)
            .collect();
        if firsts != (0..PER_KEY).collect::<Vec<_>>() {
            v.push(format!("{key}: first starts by fence {firsts:?}"));
        }
    }
    assert!(v.is_empty(), "seed {seed}: {v:#?}");
    assert_eq!(
        report.acked,
        (KEYS * PER_KEY) as u64,
        "seed {seed}: every job acked exactly once: {report:?}"
    );
    for k in 0..KEYS {
        let shard = if k % 2 == 0 { "s0" } else { "s1" };
        let c = backend.key_counts(shard, &format!("k{k}")).unwrap();
        assert_eq!(
            (c.depth, c.in_flight, c.dead),
            (0, 0, 0),
            "seed {seed}: key k{k}"
        );
    }
    assert!(
        clock.stalls.load(Ordering::SeqCst) > 0,
        "seed {seed}: the clock never stalled"
    );
}

#[test]
fn the_real_pool_keeps_one_run_per_key_in_order_through_seeded_stalls() {
    if let Ok(seed) = std::env::var("SHARDQ_SIM_SEED") {
        real_pool_with_stalls(seed.parse().expect("SHARDQ_SIM_SEED must be a number"), 1);
        return;
    }
    for seed in 1..=8 {
        real_pool_with_stalls(seed, 1);
    }
}

#[test]
fn the_real_pool_keeps_a_keys_concurrency_and_order_through_seeded_stalls() {
    if let Ok(seed) = std::env::var("SHARDQ_SIM_SEED") {
        real_pool_with_stalls(seed.parse().expect("SHARDQ_SIM_SEED must be a number"), 3);
        return;
    }
    for seed in 1..=8 {
        real_pool_with_stalls(seed, 3);
    }
}

/// The rebalance options of the single-key scenarios: small batches,
/// waits on the simulated clock.
fn single_key_opts(clock: &Arc<SimClock>) -> RebalanceOptions {
    RebalanceOptions {
        batch: 8,
        drain_timeout_ms: 60_000,
        poll_ms: 1,
        clock: clock.clone(),
        runner: "simulation".into(),
    }
}

/// A producer, the jobs it sent so far, and the payloads it was told are stored.
type Sending = (Producer<MemoryBackend>, u64, Vec<String>);

/// One key moving between two shards under a producer that sends a job at
/// every step of the simulated clock, with a rebalance that can be killed
/// at a counted write: what the single-key tests below share.
struct OneKeyMove {
    key: &'static str,
    clock: Arc<SimClock>,
    backend: MemoryBackend,
    store: MemoryMapStore,
    from: String,
    to: &'static str,
    producer: Arc<Mutex<Sending>>,
    crashing: Crashing,
    opts: RebalanceOptions,
}

impl OneKeyMove {
    /// Two shards, `key` on its own, `jobs` of it enqueued, and a pin that
    /// sends it to the other shard (not rebalanced yet).
    fn new(key: &'static str, jobs: usize) -> OneKeyMove {
        let clock = Arc::new(SimClock::default());
        clock.now_ms.store(1_700_000_000_000, Ordering::SeqCst);
        let backend = MemoryBackend::new(&["a", "b"], clock.clone());
        let store =
            MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["a", "b"]).unwrap());
        let from = shardq_route::Router::new(store.load().unwrap())
            .unwrap()
            .route(key)
            .to_string();
        let to = if from == "a" { "b" } else { "a" };
        let producer = Producer::new(
            Arc::new(backend.clone()),
            Arc::new(store.clone()),
            ProducerOptions {
                pause_wait_ms: 0,
                fence_wait_ms: 0,
                clock: clock.clone(),
                ..ProducerOptions::default()
            },
        )
        .unwrap();
        let crashing = Crashing::new(backend.clone(), clock.clone());
        let opts = single_key_opts(&clock);
        let m = OneKeyMove {
            key,
            clock,
            backend,
            store,
            from,
            to,
            producer: Arc::new(Mutex::new((producer, 0, Vec::new()))),
            crashing,
            opts,
        };
        for _ in 0..jobs {
            m.sender()();
        }
        reshard::pin(&m.store, key, to).unwrap();
        m
    }

    /// Sends one job of the key; a job refused whole (paused on its new
    /// shard, or fenced by a killed run with no newer map yet) is not
    /// stored, and the producer is told so. A send from inside a send (the
    /// producer waiting on a pause sleeps, and the clock's step sends) is
    /// skipped.
    fn sender(&self) -> impl FnMut() + Send + Clone + 'static {
        let (producer, key) = (self.producer.clone(), self.key);
        move || {
            let Ok(mut p) = producer.try_lock() else {
                return;
            };
            let (prod, n, stored) = &mut *p;
            let payload = format!("j-{n}");
            *n += 1;
            match prod.enqueue(&NewJob::new(key, payload.clone())) {
                Ok(_) => stored.push(payload),
                Err(ProduceError::PausedTooLong { .. } | ProduceError::FencedTooLong { .. }) => {}
                Err(e) => panic!("enqueue: {e}"),
            }
        }
    }

    fn send(&self, n: usize) {
        let mut send = self.sender();
        for _ in 0..n {
            send();
        }
    }

    /// From now, every step of the clock (a wait of the rebalance) sends a job.
    fn send_at_every_step(&self, on: bool) {
        *self.clock.step.lock().unwrap() = on.then(|| Box::new(self.sender()) as Step);
    }

    /// A rebalance, killed at its `crash_at`-th write counted from now (0:
    /// never).
    fn rebalance(&self, crash_at: u64) -> Result<reshard::RebalanceReport, ReshardError> {
        self.crashing.writes.store(0, Ordering::SeqCst);
        self.crashing.crash_at.store(crash_at, Ordering::SeqCst);
        reshard::rebalance(&self.crashing, &self.store, &self.opts, &mut |_| {})
    }

    /// Runs the key's jobs on `shard` one at a time: their payloads.
    fn run_all(&self, shard: &str) -> Vec<String> {
        std::iter::from_fn(|| {
            let job = self.backend.claim(shard, 1, LEASE_MS).unwrap().pop()?;
            self.backend.ack(shard, &[job.receipt()]).unwrap();
            Some(String::from_utf8(job.payload).unwrap())
        })
        .collect()
    }

    fn stored(&self) -> Vec<String> {
        self.producer.lock().unwrap().2.clone()
    }

    fn depth(&self, shard: &str) -> u64 {
        self.backend.key_counts(shard, self.key).unwrap().depth
    }
}

/// One hot key whose producer slips a job in before every freeze attempt,
/// so its move always ends in the forced round (paused on its new shard,
/// frozen on its old one). The rebalance is killed at its `crash_at`-th
/// write; the producer goes on between the runs and during the rerun; the
/// rerun finishes. Checked: every job the producer was told is stored runs
/// once, on the key's new shard, in the order it was stored. Returns
/// whether the kill left the key paused on its new shard (the case a rerun
/// must not undo early).
fn hot_move_killed_at(crash_at: u64) -> bool {
    let m = OneKeyMove::new("hot", 40);
    m.send_at_every_step(true);
    let killed = m.rebalance(crash_at).is_err();
    let paused_on_new = killed && m.backend.fence(m.to).unwrap().paused_keys.contains("hot");
    m.send(3);
    if let Err(e) = m.rebalance(0) {
        panic!("crash at {crash_at}: the rerun failed: {e}");
    }
    m.send_at_every_step(false);
    m.send(3);
    let ran = m.run_all(m.to);
    assert_eq!(
        m.depth(&m.from),
        0,
        "crash at {crash_at}: jobs left on the old shard"
    );
    let stored = m.stored();
    assert!(
        ran == stored,
        "crash at {crash_at}: the new shard ran {ran:?}, the producer stored {stored:?}"
    );
    paused_on_new
}

#[test]
fn a_hot_move_killed_at_any_write_keeps_every_job_in_order() {
    let mut paused_kills = 0;
    for crash_at in 1..=30 {
        paused_kills += u32::from(hot_move_killed_at(crash_at));
    }
    assert!(
        paused_kills > 0,
        "no kill landed in a forced round (the test lost its point)"
    );
}

/// The old shard's store drops out for the one fence write that raises its
/// floor to the switch (and for the read that follows), then answers again.
/// The key must not be unsealed there under the old floor: a producer still
/// routing with the map before the switch would store the key's job on the
/// shard it no longer runs on. The rerun finishes, and every job runs once,
/// in order, on the new shard.
#[test]
fn a_blip_at_the_old_shards_fence_raise_leaves_no_stale_door_open() {
    let m = OneKeyMove::new("k", 5);
    let v0 = m.store.load().unwrap().version;
    // v0 + 1 is the pinned map, v0 + 2 the switch.
    *m.crashing.blip.lock().unwrap() = Some((m.from.clone(), v0 + 2, false));
    let first = m.rebalance(0);
    assert!(
        matches!(first, Err(ReshardError::ShardsFailed { .. })),
        "the blip must be reported: {first:?}"
    );
    assert!(
        m.store.load().unwrap().version >= v0 + 2,
        "the switch was published"
    );
    // A producer still on the pinned map (v0 + 1) sends the key to its old shard.
    let stale = m
        .backend
        .enqueue(&m.from, v0 + 1, &[NewJob::new("k", "stale")]);
    assert!(
        stale.is_err(),
        "the old shard took a stale producer's job for a key that runs elsewhere"
    );
    m.rebalance(0).expect("the rerun finishes");
    assert_eq!(m.run_all(m.to), m.stored());
    assert_eq!(m.depth(&m.from), 0);
}

/// A rebalance is killed at its `crash_at`-th write, perhaps with the key's
/// backlog half copied (its new shard may run the copies, its old shard
/// holds the rest); the producer goes on; then the operator reweights a
/// shard and pins the key back to its old shard, and reruns, the rerun
/// killed at its `second_crash_at`-th write, then reruns until a run
/// finishes, the producer still going between the runs. Checked: the key's
/// jobs end on one shard, and every job the producer was told is stored
/// runs once, in the order it was stored. Returns whether the kill left
/// copies on the new shard with the key still sealed on its old one (the
/// case the check is about).
fn target_changed_after_kill_at(crash_at: u64, second_crash_at: u64) -> bool {
    let m = OneKeyMove::new("k", 40);
    m.send_at_every_step(true);
    let killed = m.rebalance(crash_at).is_err();
    let half = killed
        && m.backend
            .fence(&m.from)
            .unwrap()
            .sealed_keys
            .contains_key("k")
        && m.depth(m.to) > 0;
    m.send(3);
    // A new target: another weight (so the rerun pins afresh), and the key
    // back where it came from.
    reshard::set_weight(&m.store, m.to, 3).unwrap();
    reshard::pin(&m.store, "k", &m.from).unwrap();
    let _ = m.rebalance(second_crash_at);
    m.send(3);
    let mut reruns = 0;
    while let Err(e) = m.rebalance(0) {
        reruns += 1;
        assert!(
            reruns < 3,
            "crash at {crash_at}: the reruns do not finish: {e}"
        );
        m.send(2);
    }
    m.send_at_every_step(false);
    m.send(3);
    let holding: Vec<&str> = [m.from.as_str(), m.to]
        .into_iter()
        .filter(|s| m.depth(s) > 0)
        .collect();
    assert_eq!(
        holding.len(),
        1,
        "crash at {crash_at}: the key is split over {holding:?}"
    );
    let ran = m.run_all(holding[0]);
    let stored = m.stored();
    assert!(
        ran == stored,
        "crash at {crash_at}/{second_crash_at}: {} ran {ran:?}, the producer stored {stored:?}",
        holding[0]
    );
    half
}

#[test]
fn a_target_changed_after_a_killed_copy_keeps_the_key_in_order() {
    let mut half = 0;
    for crash_at in 1..=30 {
        for second_crash_at in 1..=12 {
            half += u32::from(target_changed_after_kill_at(crash_at, second_crash_at));
        }
    }
    assert!(
        half > 0,
        "no kill left a half-copied key (the test lost its point)"
    );
}

/// A rebalance of one key between two of three shards is killed at its
/// `crash_at`-th write; the third shard's store then stops answering the
/// rebalance. Once the pinned map is published, a rerun moves the key all
/// the same (every job on its new shard, in order) and ends naming the
/// shard it could not reach; before that, a rerun cannot plan without it.
/// Returns whether the rerun had the pinned map to go on.
fn rerun_past_a_dead_bystander(crash_at: u64) -> bool {
    let clock = Arc::new(SimClock::default());
    clock.now_ms.store(1_700_000_000_000, Ordering::SeqCst);
    let backend = MemoryBackend::new(&["a", "b", "c"], clock.clone());
    let store =
        MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, ["a", "b", "c"]).unwrap());
    let v0 = store.load().unwrap().version;
    let router = shardq_route::Router::new(store.load().unwrap()).unwrap();
    let key = (0..)
        .map(|i| format!("k{i}"))
        .find(|k| router.route(k) != "c")
        .unwrap();
    let from = router.route(&key).to_string();
    let (to, bystander) = if from == "a" { ("b", "c") } else { ("a", "c") };
    let payloads: Vec<String> = (0..20).map(|i| format!("j-{i}")).collect();
    for p in &payloads {
        backend
            .enqueue(&from, v0, &[NewJob::new(key.as_str(), p.as_str())])
            .unwrap();
    }
    reshard::pin(&store, &key, to).unwrap();
    let crashing = Crashing::new(backend.clone(), clock.clone());
    let opts = single_key_opts(&clock);
    crashing.crash_at.store(crash_at, Ordering::SeqCst);
    let _ = reshard::rebalance(&crashing, &store, &opts, &mut |_| {});
    let pinned = store.load().unwrap().version > v0;
    crashing.crash_at.store(0, Ordering::SeqCst);
    *crashing.cut_off.lock().unwrap() = Some((bystander.to_string(), 0));
    let rerun = reshard::rebalance(&crashing, &store, &opts, &mut |_| {});
    if !pinned {
        assert!(
            rerun.is_err(),
            "crash at {crash_at}: planned without a shard"
        );
        return false;
    }
    match &rerun {
        Err(ReshardError::ShardsFailed { shards, .. }) => assert!(
            shards.iter().any(|s| s.starts_with(bystander)),
            "crash at {crash_at}: {shards:?}"
        ),
        other => panic!("crash at {crash_at}: the rerun must name {bystander}: {other:?}"),
    }
    let ran: Vec<String> = std::iter::from_fn(|| {
        let job = backend.claim(to, 1, LEASE_MS).unwrap().pop()?;
        backend.ack(to, &[job.receipt()]).unwrap();
        Some(String::from_utf8(job.payload).unwrap())
    })
    .collect();
    assert_eq!(
        ran, payloads,
        "crash at {crash_at}: the key's jobs on its new shard"
    );
    assert_eq!(backend.key_counts(&from, &key).unwrap().depth, 0);
    true
}

#[test]
fn a_rerun_moves_its_keys_past_a_shard_that_stopped_answering() {
    let mut pinned = 0;
    for crash_at in 1..=20 {
        pinned += u32::from(rerun_past_a_dead_bystander(crash_at));
    }
    assert!(
        pinned > 0,
        "no kill came after the pinned map (the test lost its point)"
    );
}

/// Schedules in the seeded world: eight schedules firing every second on
/// their own keys, fired by three schedulers (two owning part of the
/// shards, one believing it owns them all, as a process past its lease
/// would), each pass at a seeded moment, while a rebalance that moves the
/// schedules' keys to a new shard is killed at seeded writes and rerun,
/// and the scheduler's own clock readings step back now and then. Every
/// step of the rebalance's copies lets the schedulers run, so ticks are
/// fired while their key is sealed, copied, frozen and switched. At the
/// end, for every schedule, the ticks that stored a job are exactly the
/// ticks it decided, each once.
/// Long on purpose: one seeded scenario, its set-up, the scheduler passes
/// the rebalance's writes call, the killed and rerun rebalance and the
/// checks per schedule, in the order they happen.
fn schedules_through_a_killed_rebalance(seed: u64) {
    use shardq_core::schedule::{
        tick_dedup_id, Overlap, Schedule, ScheduleStore, Scheduler, SchedulerOptions, When,
        SCHEDULE_DEDUP_MARGIN_MS,
    };
    const T0: u64 = 1_700_000_000_000;
    let clock = Arc::new(SimClock::default());
    clock.now_ms.store(T0, Ordering::SeqCst);
    let backend = MemoryBackend::new(&SHARDS, clock.clone());
    let store = MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, SHARDS).unwrap());
    let ids: Vec<String> = (0..8).map(|i| format!("sim-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        let s = Schedule {
            key: format!("sched-{i}"),
            when: When::Every { every_ms: 1_000 },
            payload: "tick".into(),
            overlap: Overlap::All,
            catch_up_ms: 600_000,
            jitter_ms: if i % 2 == 0 { 0 } else { 300 },
            start_ms: None,
            end_ms: None,
            max_attempts: 3,
            paused: false,
            since_ms: 0,
        };
        ScheduleStore::put(&store, id, &s, T0, 1 << 20).unwrap();
    }
    let scheduler = || {
        Scheduler::new(
            Arc::new(backend.clone()),
            Arc::new(store.clone()),
            SchedulerOptions {
                clock: clock.clone(),
            },
        )
        .unwrap()
    };
    let owned =
        |names: &[&str]| -> BTreeSet<String> { names.iter().map(|s| s.to_string()).collect() };
    let views: [BTreeSet<String>; 3] = [
        owned(&["s0", "s1"]),
        owned(&["s2", "s3"]),
        owned(&["s0", "s1", "s2", "s3"]),
    ];
    let schedulers = Arc::new(Mutex::new((
        vec![scheduler(), scheduler(), scheduler()],
        Rng(seed ^ 0x5c4e_d01e),
    )));
    let run_step = {
        let schedulers = schedulers.clone();
        let clock = clock.clone();
        let backend = backend.clone();
        let store = store.clone();
        move || {
            let mut g = schedulers.lock().unwrap();
            let (list, rng) = &mut *g;
            clock.now_ms.fetch_add(1 + rng.below(250), Ordering::SeqCst);
            let who = rng.below(3) as usize;
            // A scheduler restarts now and then, with nothing in memory.
            if rng.chance(3) {
                list[who] = Scheduler::new(
                    Arc::new(backend.clone()),
                    Arc::new(store.clone()),
                    SchedulerOptions {
                        clock: clock.clone(),
                    },
                )
                .unwrap();
            }
            // Its clock reading steps back for this pass.
            let back = if rng.chance(5) { rng.below(5_000) } else { 0 };
            clock.now_ms.fetch_sub(back, Ordering::SeqCst);
            let r = list[who].pass(&views[who]);
            clock.now_ms.fetch_add(back, Ordering::SeqCst);
            if let Err(e) = r {
                panic!("seed {seed}: a pass failed: {e}");
            }
        }
    };
    *clock.step.lock().unwrap() = Some(Box::new(run_step.clone()));
    for _ in 0..100 {
        let _hook = clock.step.lock().unwrap();
        run_step();
    }
    reshard::add_shard(&store, "s3", 1, None).unwrap();
    backend.add_shard("s3");
    for i in 0..8 {
        reshard::pin(&store, &format!("sched-{i}"), "s3").unwrap();
    }
    let opts = RebalanceOptions {
        batch: 2,
        drain_timeout_ms: 60_000,
        poll_ms: 1,
        clock: clock.clone(),
        runner: "simulation".into(),
    };
    let crashing = Crashing::new(backend.clone(), clock.clone());
    let mut crash_rng = Rng(seed ^ 0xdead);
    for attempt in 0.. {
        crashing.writes.store(0, Ordering::SeqCst);
        let at = if attempt < 3 {
            1 + crash_rng.below(30)
        } else {
            0
        };
        crashing.crash_at.store(at, Ordering::SeqCst);
        match reshard::rebalance(&crashing, &store, &opts, &mut |_| {}) {
            Ok(_) => break,
            Err(_) if at != 0 && crashing.writes.load(Ordering::SeqCst) >= at => {
                for _ in 0..20 {
                    let _hook = clock.step.lock().unwrap();
                    run_step();
                }
            }
            Err(e) => panic!("seed {seed}: rebalance: {e}"),
        }
    }
    for _ in 0..100 {
        let _hook = clock.step.lock().unwrap();
        run_step();
    }
    *clock.step.lock().unwrap() = None;
    // One last pass by a process owning every shard decides every due tick.
    let mut last = scheduler();
    last.pass(&owned(&["s0", "s1", "s2", "s3"])).unwrap();
    let states = ScheduleStore::states(&store).unwrap().states;
    let version = store.load().unwrap().version;
    for (i, id) in ids.iter().enumerate() {
        let key = format!("sched-{i}");
        let decided = states[id].decided_ms;
        let ticks = decided / 1_000 - T0 / 1_000;
        let jobs: u64 = backend
            .shard_names()
            .iter()
            .map(|s| {
                let c = backend.key_counts(s, &key).unwrap();
                c.depth + c.in_flight + c.dead
            })
            .sum();
        assert!(ticks > 20, "seed {seed}: {id} decided only {ticks} ticks");
        assert_eq!(jobs, ticks, "seed {seed}: {id}: jobs vs ticks decided");
        assert_eq!(states[id].missed, 0, "seed {seed}: {id} missed ticks");
        for n in 1..=ticks {
            let stored = backend
                .enqueue_dedup(
                    "s3",
                    version,
                    &[NewJob::new(key.clone(), "probe")
                        .with_dedup_id(tick_dedup_id(id, T0 + n * 1_000))],
                    600_000 + SCHEDULE_DEDUP_MARGIN_MS,
                )
                .unwrap();
            assert!(
                stored[0].duplicate,
                "seed {seed}: {id}: tick {n} has no job"
            );
        }
    }
}

#[test]
fn seeded_schedules_fire_each_tick_once_through_a_killed_rebalance() {
    if let Ok(seed) = std::env::var("SHARDQ_SIM_SEED") {
        schedules_through_a_killed_rebalance(
            seed.parse().expect("SHARDQ_SIM_SEED must be a number"),
        );
        return;
    }
    for seed in 1..=16 {
        schedules_through_a_killed_rebalance(seed);
    }
}

/// What the workflow scenario's handlers saw, by payload.
#[derive(Default)]
struct WorkflowLog {
    /// Starts of each payload.
    starts: BTreeMap<String, u32>,
    /// Payloads whose job ended (acked or dead), and whether it was acked.
    ended: BTreeMap<String, bool>,
    /// Starts on the shard the keys moved to.
    on_new_shard: u32,
}

/// A release that a seeded share of the time is killed before its enqueue
/// or after it and before the pass records it (the resolver then learns
/// nothing of it, as a process killed there would).
struct Killable<'a> {
    inner: &'a mut Producer<dyn QueueBackend>,
    rng: &'a mut Rng,
}

impl shardq_core::workflow::Release for Killable<'_> {
    fn release(&mut self, job: &NewJob) -> shardq_core::workflow::Released {
        if self.rng.chance(10) {
            return Err("killed before the enqueue".into());
        }
        let r = self.inner.release(job);
        if self.rng.chance(10) {
            return Err("killed after the enqueue, before the record".into());
        }
        r
    }
}

/// Dependents and batches through killed resolvers, a killed rebalance and
/// moves, on a manual clock: children on many keys, a fan-in after all of
/// them, a chain link after the fan-in, a dependent that runs whatever its
/// dependencies' outcomes (one of them dead), a dependent failed by a
/// dead dependency and its own dependent; a batch with a dead job and one
/// without, closed at seeded moments. Two resolvers pass at seeded moments,
/// restart with nothing in memory, and are killed before or after
/// enqueueing what they release; a rebalance moving the keys (pins) is
/// killed at seeded writes and rerun. Checked from the handlers' starts:
/// each job and each released dependent starts once and only after
/// everything it waits for ended; each due callback starts once, success
/// never beside a dead job, death once; the failed dependents never start.
/// Long on purpose: one seeded scenario; the step the clock calls closes
/// over the jobs, batches, waits and log it builds, and the checks read
/// that log, so its set-up, disturbances and checks stay in the order
/// they happen.
fn workflows_through_killed_resolvers_and_a_killed_rebalance(seed: u64) {
    use shardq_core::backend::{find_job, finished_job};
    use shardq_core::workflow::{
        release_producer, CallbackKind, DepRef, NewBatch, NewDependent, OnDependencyFailure,
        Resolver, WaitState, WaitingStore,
    };
    const T0: u64 = 1_700_000_000_000;
    const CHILDREN: usize = 8;
    let clock = Arc::new(SimClock::default());
    clock.now_ms.store(T0, Ordering::SeqCst);
    let backend = MemoryBackend::new(&SHARDS, clock.clone());
    for s in SHARDS {
        backend.adopt(s).unwrap();
    }
    let store = MemoryMapStore::new(ShardMap::with_shards(Algorithm::Rendezvous, SHARDS).unwrap());
    let queue: Arc<dyn QueueBackend> = Arc::new(backend.clone());
    let maps: Arc<dyn MapStore> = Arc::new(store.clone());
    let mut producer = Producer::new(
        Arc::clone(&queue),
        Arc::clone(&maps),
        ProducerOptions {
            clock: clock.clone(),
            ..ProducerOptions::default()
        },
    )
    .unwrap();
    let mut child = |key: &str, payload: &str, attempts: u32| {
        let mut j = NewJob::new(key, payload);
        j.max_attempts = attempts;
        let p = producer.enqueue(&j).unwrap();
        DepRef::Job(p.shard, p.id)
    };
    let children: Vec<DepRef> = (0..CHILDREN)
        .map(|i| child(&format!("wf-c{i}"), &format!("c{i}"), 3))
        .collect();
    let poison = child("wf-poison", "poison", 1);
    let shards: Vec<String> = SHARDS.iter().map(|s| s.to_string()).collect();
    let b2 = backend.clone();
    let mut lookup = move |s: &str, id: JobId| {
        let mut finished = |s: &str, id| finished_job(&b2, s, id);
        find_job(&b2, &shards, &|_: &str| None, &mut finished, s, id)
    };
    let dependent = |key: &str, after: Vec<DepRef>, on_failure| NewDependent {
        job: NewJob::new(key, key.trim_start_matches("wf-")),
        after,
        on_failure,
    };
    let added = WaitingStore::add(
        &store,
        &mut lookup,
        T0,
        &[
            dependent("wf-fanin", children.clone(), OnDependencyFailure::Fail),
            dependent("wf-tail", vec![DepRef::Node(0)], OnDependencyFailure::Fail),
            dependent(
                "wf-anyway",
                vec![children[0].clone(), poison.clone()],
                OnDependencyFailure::Run,
            ),
            dependent("wf-failed", vec![poison], OnDependencyFailure::Fail),
            dependent(
                "wf-after-failed",
                vec![DepRef::Node(3)],
                OnDependencyFailure::Fail,
            ),
        ],
    )
    .unwrap();
    let numbers: Vec<u64> = added.iter().map(|(n, _)| *n).collect();
    let all = [
        CallbackKind::Complete,
        CallbackKind::Success,
        CallbackKind::Death,
    ];
    let batch = |key: &str| NewBatch {
        key: key.into(),
        max_attempts: 3,
        callbacks: all
            .iter()
            .map(|k| (*k, format!("{key}:{}", k.as_str()).into_bytes()))
            .collect(),
        dedup_id: None,
    };
    // Batch 1 has a job that dies (one attempt); batch 2 has none.
    let mut batches = Vec::new();
    for (b, bad) in [("wf-cb1", true), ("wf-cb2", false)] {
        let (n, _) = WaitingStore::open_batch(&store, T0, &batch(b)).unwrap();
        let mut jobs: Vec<NewJob> = (0..4)
            .map(|i| NewJob::new(format!("{b}-j{i}"), format!("{b}-j{i}")))
            .collect();
        if bad {
            let mut j = NewJob::new(format!("{b}-poison"), format!("{b}-poison"));
            j.max_attempts = 1;
            jobs.push(j);
        }
        WaitingStore::add_to_batch(&store, T0, n, &jobs).unwrap();
        batches.push((n, b, jobs.iter().map(|j| j.key.clone()).collect::<Vec<_>>()));
    }
    let log = Arc::new(Mutex::new(WorkflowLog::default()));
    let state = Arc::new(Mutex::new((
        [
            Resolver::new(Arc::clone(&maps), clock.clone()),
            Resolver::new(Arc::clone(&maps), clock.clone()),
        ],
        release_producer(Arc::clone(&queue), Arc::clone(&maps), clock.clone()).unwrap(),
        Rng(seed ^ 0x00f1_0a71),
        false,
    )));
    // What a start must find ended first (payload -> payloads), and
    // whether they must have been acked.
    let c: Vec<String> = (0..CHILDREN).map(|i| format!("c{i}")).collect();
    let mut waits: BTreeMap<String, (Vec<String>, bool)> = BTreeMap::new();
    waits.insert("fanin".into(), (c.clone(), true));
    waits.insert("tail".into(), (vec!["fanin".into()], true));
    waits.insert(
        "anyway".into(),
        (vec![c[0].clone(), "poison".into()], false),
    );
    for (_, b, keys) in &batches {
        waits.insert(format!("{b}:complete"), (keys.clone(), false));
        waits.insert(format!("{b}:success"), (keys.clone(), true));
        waits.insert(format!("{b}:death"), (vec![format!("{b}-poison")], false));
    }
    let run_step = {
        let (state, log, clock, backend, queue, maps) = (
            Arc::clone(&state),
            Arc::clone(&log),
            clock.clone(),
            backend.clone(),
            Arc::clone(&queue),
            Arc::clone(&maps),
        );
        let batch_numbers: Vec<u64> = batches.iter().map(|(n, _, _)| *n).collect();
        move || {
            let mut g = state.lock().unwrap();
            let (resolvers, release, rng, closed) = &mut *g;
            clock.now_ms.fetch_add(1 + rng.below(200), Ordering::SeqCst);
            // The batches close at a seeded moment.
            if !*closed && rng.chance(5) {
                for n in &batch_numbers {
                    WaitingStore::close_batch(&*maps, *n, clock.now_ms()).unwrap();
                }
                *closed = true;
            }
            // Now and then a worker claims on one shard and ends what it
            // got (slowly enough that the work goes on across the move).
            let names = backend.shard_names();
            let shard = &names[rng.below(names.len() as u64) as usize];
            let jobs = if rng.chance(30) {
                backend.claim(shard, 2, 60_000).unwrap_or_default()
            } else {
                Vec::new()
            };
            let mut l = log.lock().unwrap();
            for j in jobs {
                let payload = String::from_utf8(j.payload.clone()).unwrap();
                *l.starts.entry(payload.clone()).or_default() += 1;
                l.on_new_shard += u32::from(j.shard == "s3");
                if let Some((before, acked)) = waits.get(&payload) {
                    for b in before {
                        match l.ended.get(b) {
                            Some(ok) => assert!(
                                *ok || !*acked,
                                "seed {seed}: {payload} started though {b} did not complete"
                            ),
                            None => panic!("seed {seed}: {payload} started before {b} ended"),
                        }
                    }
                }
                if payload.ends_with("poison") {
                    backend
                        .fail(shard, j.receipt(), "poisoned", Some(0))
                        .unwrap();
                    l.ended.insert(payload, false);
                } else {
                    let acked = backend
                        .ack_results(shard, &[j.receipt()], &[Some(payload.clone().into_bytes())])
                        .unwrap();
                    assert_eq!(acked.acked, 1, "seed {seed}: {payload} not acked");
                    l.ended.insert(payload, true);
                }
            }
            drop(l);
            // A resolver passes, now and then after a restart.
            let who = rng.below(2) as usize;
            if rng.chance(10) {
                resolvers[who] = Resolver::new(Arc::clone(&maps), clock.clone());
            }
            let mut killable = Killable {
                inner: release,
                rng,
            };
            if let Err(e) = resolvers[who].pass(&*queue, &mut killable) {
                panic!("seed {seed}: a resolver pass failed: {e}");
            }
        }
    };
    *clock.step.lock().unwrap() = Some(Box::new(run_step.clone()));
    let mut rng = Rng(seed ^ 0xbee5);
    for _ in 0..rng.below(20) {
        let _hook = clock.step.lock().unwrap();
        run_step();
    }
    // Keys move: to a new shard, killed at seeded writes and rerun.
    reshard::add_shard(&store, "s3", 1, None).unwrap();
    backend.add_shard("s3");
    backend.adopt("s3").unwrap();
    let mut moved: Vec<String> = (0..CHILDREN)
        .step_by(2)
        .map(|i| format!("wf-c{i}"))
        .collect();
    moved.extend(["wf-fanin", "wf-poison", "wf-cb1", "wf-cb1-j1", "wf-cb2-j2"].map(String::from));
    for k in &moved {
        reshard::pin(&store, k, "s3").unwrap();
    }
    let opts = RebalanceOptions {
        batch: 2,
        drain_timeout_ms: 60_000,
        poll_ms: 1,
        clock: clock.clone(),
        runner: "simulation".into(),
    };
    let crashing = Crashing::new(backend.clone(), clock.clone());
    for attempt in 0.. {
        crashing.writes.store(0, Ordering::SeqCst);
        let at = if attempt < 3 { 1 + rng.below(30) } else { 0 };
        crashing.crash_at.store(at, Ordering::SeqCst);
        match reshard::rebalance(&crashing, &store, &opts, &mut |_| {}) {
            Ok(_) => break,
            Err(_) if at != 0 && crashing.writes.load(Ordering::SeqCst) >= at => {
                for _ in 0..rng.below(20) {
                    let _hook = clock.step.lock().unwrap();
                    run_step();
                }
            }
            Err(e) => panic!("seed {seed}: rebalance: {e}"),
        }
    }
    // Until everything that is due has started (bounded).
    let expected = |l: &WorkflowLog| {
        ["fanin", "tail", "anyway", "wf-cb1:complete", "wf-cb1:death"]
            .iter()
            .chain(["wf-cb2:complete", "wf-cb2:success"].iter())
            .all(|p| l.starts.contains_key(*p))
    };
    for _ in 0..3_000 {
        if expected(&log.lock().unwrap()) {
            break;
        }
        let _hook = clock.step.lock().unwrap();
        run_step();
    }
    // A few more steps: nothing may start twice late.
    for _ in 0..50 {
        let _hook = clock.step.lock().unwrap();
        run_step();
    }
    *clock.step.lock().unwrap() = None;
    let l = log.lock().unwrap();
    assert!(
        expected(&l),
        "seed {seed}: not everything due started: {:?}",
        l.starts
    );
    for (payload, n) in &l.starts {
        assert_eq!(*n, 1, "seed {seed}: {payload} started {n} times");
    }
    assert!(
        l.on_new_shard > 0,
        "seed {seed}: nothing ran where keys moved"
    );
    for never in ["failed", "after-failed", "wf-cb1:success", "wf-cb2:death"] {
        assert!(
            !l.starts.contains_key(never),
            "seed {seed}: {never} started: {:?}",
            l.starts
        );
    }
    for i in [3, 4] {
        let w = WaitingStore::get(&store, numbers[i]).unwrap().unwrap();
        assert!(
            w.state == WaitState::Failed,
            "seed {seed}: dependent {i} is {:?}",
            w.state
        );
    }
}

#[test]
fn seeded_workflows_release_and_fire_once_through_killed_resolvers_and_a_killed_rebalance() {
    if let Ok(seed) = std::env::var("SHARDQ_SIM_SEED") {
        workflows_through_killed_resolvers_and_a_killed_rebalance(
            seed.parse().expect("SHARDQ_SIM_SEED must be a number"),
        );
        return;
    }
    for seed in 1..=16 {
        workflows_through_killed_resolvers_and_a_killed_rebalance(seed);
    }
}
