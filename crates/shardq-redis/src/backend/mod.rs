//! [`RedisBackend`]: the [`QueueBackend`] trait over shards stored in Redis.
//!
//! Each shard of the map whose URL is `redis://...` lives on that instance;
//! shards whose URL is `redis+cluster://...` live in that cluster, each in
//! the one slot of its hashtag. All state (jobs, order, claims, fence,
//! lease) is in Redis, so processes on several hosts cooperate; this type
//! keeps only which shards it adopted, under which lease token, and which
//! of their jobs it handed out. Opening checks every shard's deployment
//! record and layout version, and every script checks the record again, so
//! a store that lost its state is reported ([`QueueError::StoreLost`]) and
//! never silently re-initialised. It must never change a shard except
//! through one script, and never claim, ack, fail or extend without a token
//! the shard's lease still carries.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use redis::Value;
use shardq_core::flow::{ConcurrencyRules, FairQueue, Popped, Rank};
use shardq_core::{
    validate_job_lease_ms, AckOutcome, BackedOff, Backoff, CancelOutcome, ClaimedJob, Clock,
    DeadJob, DeadPolicy, DedupRecord, FailOutcome, Fence, Finish, FinishedJob, InspectJobs, JobId,
    JobInfo, JobState, KeyCounts, Keyed, MoveKeys, MovedJob, NewJob, QueueError, Receipt,
    Retention, RetryRules, RunJobs, ShardStats, Stored, KEY_JOBS_MAX, PAYLOAD_BYTES_MAX_DEFAULT,
};
use shardq_core::{Admit, FlowControl};
use shardq_route::ShardMap;

use crate::conn::{
    Limits, Node, CONNECT_TIMEOUT_MS, RESPONSE_TIMEOUT_MS, RETRY_ATTEMPTS_DEFAULT,
    RETRY_BUDGET_MS_DEFAULT, SCHEME_CLUSTER, SCHEME_INSTANCE,
};
use crate::error::RedisError;
use crate::keys::{self, LAYOUT_VERSION, NAMESPACE_DEFAULT, QUEUE_DEFAULT};
use crate::scripts::{reply, Scripts};

mod inspect;
mod inventory;
mod limits;
mod moves;
mod open;
mod options;
mod records;
mod run;

pub use inventory::*;
pub(crate) use limits::*;
pub use options::*;
pub(crate) use records::*;

/// Most jobs in one enqueue call (one script; Lua's `unpack` bounds it).
pub const ENQUEUE_BATCH_MAX: usize = 1024;
/// Most jobs one claim call hands out.
pub const CLAIM_BATCH_MAX: usize = 1024;
/// Most ids acked by one script; longer ack lists are split.
pub const ACK_BATCH_MAX: usize = 1024;
/// Entries of a shard's finished-jobs list read per call.
const FINISHED_PAGE: usize = 256;
/// In-flight jobs whose lease ran out that one claim puts back.
pub const RECLAIM_BATCH_MAX: usize = 128;
/// Most keys one relimit script call gives a new run limit.
pub const RELIMIT_BATCH_MAX: usize = 512;
/// Most entries (key and prefix limits) one call writes into a shard's
/// copy of the run limits (`limits_put.lua`): a copy of
/// [`shardq_core::flow::FLOW_RULES_MAX`] entries takes ten calls.
pub const LIMITS_BATCH_MAX: usize = 1024;
/// Dead jobs moved by one script in `dead_retry`/`dead_purge` of all.
pub const DEAD_BATCH_MAX: usize = 512;
/// Most dead jobs one `dead_list` returns.
pub const DEAD_LIST_MAX: usize = 10_000;
/// Time budget of the deployment-record check of a shard new to this
/// process (at open, or when a map names it): a server that does not
/// answer within it is added unchecked and costs only its own shards' calls.
pub const OPEN_CHECK_BUDGET_MS: u64 = 500;
/// Most steps a cancel walks down a key's queue to the job (each one field
/// read inside the script, which blocks the server while it runs): a job
/// further back than this is refused with an error naming the bound.
pub const CANCEL_WALK_MAX: usize = 100_000;
/// Most receipts one extend script handles; longer lists are split.
pub const EXTEND_BATCH_MAX: usize = 1024;
/// Most ready keys (and most keys whose wait is over) a claim ranks by
/// priority and weight while flow control ranks keys: the first of the
/// shard's ready list, in the order they became ready.
pub const RANK_LOOKAHEAD: usize = 256;
/// Most jobs one export or import script call moves (a backlog move's
/// copy goes in calls of this many, or of [`TRANSFER_CALL_BYTES_MAX`]).
/// An export call reads at most this many of the key's dead jobs (from the
/// shard's by-key index, `deadk`) and as many of its waiting ones, however
/// many dead jobs the shard's other keys hold; a multi-key export call at
/// most twice this many jobs in all, whatever its number of keys.
pub const TRANSFER_CALL_JOBS_MAX: usize = 1024;
/// Most record bytes one export reply or import call carries (at least one
/// job): no single Redis call of a move holds much more than this.
pub const TRANSFER_CALL_BYTES_MAX: usize = 4 << 20;
/// Most keys one multi-key export call reads (the last round of a move).
pub const EXPORT_MANY_KEYS_MAX: usize = 256;
/// Most jobs one purge script call deletes, waiting and dead ones (a moved
/// key's copies left behind go in calls of this many, so no call blocks the
/// server long; its dead jobs are read from the by-key index, `deadk`).
pub const PURGE_BATCH_MAX: usize = 8192;
/// Longest wait for the replicas after a write with
/// [`RedisOptions::wait_replicas`], in ms (1 s). Kept below the reply
/// timeout, which bounds the `WAIT` command too.
pub const WAIT_REPLICAS_TIMEOUT_MS_DEFAULT: u64 = 1_000;

/// A run this process handed out: its job's routing key, and the attempt it
/// is (the claim's record count + 1).
struct Run {
    key: String,
    attempt: u32,
}

/// What this process holds of an adopted shard.
struct Held {
    token: String,
    /// Jobs handed out and not yet acked or failed here, with their routing
    /// keys and attempts: an ack names both, so the script checks the key's
    /// runs instead of reading the job, and writes the finished job's entry
    /// without reading its record (payload and all).
    in_flight: HashMap<u64, Run>,
    /// The flow settings' version whose run limits the keys with runs here
    /// were last given ([`RedisBackend::relimit`]).
    limits_version: u64,
}

pub(crate) struct ShardRef {
    pub(crate) name: String,
    pub(crate) url: String,
    pub(crate) node: Arc<Node>,
    pub(crate) keys: Vec<String>,
    held: Mutex<Option<Held>>,
    marks: Mutex<Marks>,
    /// The keys' start tags while flow control ranks them (this process's
    /// memory: a new owner starts every key from the same turn).
    fair: Mutex<FairQueue<String>>,
}

/// The high-water marks of one shard this process saw in the store's
/// replies: the store only ever grows them, so a reply below a mark means
/// the store went back in time (a lagging replica promoted, a restore from
/// an older snapshot) and would hand out job ids and fences twice.
#[derive(Debug, Default, Clone, Copy)]
struct Marks {
    /// The largest job-id sequence (`meta.seq`): the last id handed out.
    seq: u64,
    /// The largest run fence.
    fence: u64,
}

impl ShardRef {
    fn held(&self) -> MutexGuard<'_, Option<Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lease_key(&self) -> &[String] {
        std::slice::from_ref(&self.keys[keys::LEASE_PART])
    }

    fn marks(&self) -> Marks {
        *self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks what one script reply showed against the marks taken before
    /// it was sent (`before`: anything this process saw finish earlier was
    /// in the store when the script ran, whatever replies raced since):
    /// `seq` the store's sequence before the script's own writes, `fences`
    /// the fences it issued. Raises the marks, or answers
    /// [`QueueError::StoreLost`].
    fn observe(
        &self,
        before: Marks,
        seq: u64,
        seq_after: u64,
        fences: &[u64],
    ) -> Result<(), QueueError> {
        if seq < before.seq {
            return Err(self.rewound("job-id sequence", seq, before.seq));
        }
        if let Some(&f) = fences.iter().find(|&&f| f <= before.fence) {
            return Err(self.rewound("run fence", f, before.fence));
        }
        let mut m = self.marks.lock().unwrap_or_else(|p| p.into_inner());
        m.seq = m.seq.max(seq_after);
        m.fence = m.fence.max(fences.iter().copied().max().unwrap_or(0));
        Ok(())
    }

    fn rewound(&self, what: &str, found: u64, seen: u64) -> QueueError {
        QueueError::StoreLost(format!(
            "shard {:?} at {}: the store went back in time: its {what} is {found}, but this              process saw {seen} there earlier (a lagging replica promoted, a restore from an              older snapshot); acknowledged work may be lost and ids would be handed out twice,              so workers stop rather than run on it (restore the newer data, or init a new              deployment; --redis-wait-replicas makes acknowledged writes survive a failover)",
            self.name, self.url
        ))
    }
}

/// The shards this backend knows, and the nodes they live on. Grows when
/// a newer map adds shards ([`RedisBackend::sync_shards`]); never shrinks, so
/// a shard a rebalance removed stays reachable for its last drain.
#[derive(Default)]
struct Registry {
    shards: Vec<Arc<ShardRef>>,
    index: HashMap<String, usize>,
    nodes: HashMap<String, Arc<Node>>,
}

pub(crate) struct Inner {
    pub(crate) opts: RedisOptions,
    registry: RwLock<Registry>,
    /// Lease tokens granted by a [`crate::RedisCoordinator`].
    tokens: Mutex<HashMap<String, String>>,
    /// The deployment id every shard must carry (found at open, or given).
    deployment: RwLock<Option<String>>,
    pub(crate) scripts: Scripts,
    /// The rebalance epoch this process's move writes carry (0: none; see
    /// [`MoveKeys::enter_rebalance`]).
    epoch: std::sync::atomic::AtomicU64,
    /// The run limits the shards' copies must hold (none: every key runs
    /// once at a time) and the flow settings' version they were built from.
    limits: Mutex<(u64, Option<Arc<LimitsCopy>>)>,
    /// The server's time at the last claim reply, and when it came: a
    /// claim reads the flow settings again (when due) before it starts, by
    /// this estimate of the server's time.
    server_time: Mutex<Option<(u64, std::time::Instant)>>,
}

/// The Redis backend. Cheap to clone; clones share connections and state.
#[derive(Clone)]
pub struct RedisBackend {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("namespace", &self.inner.opts.namespace)
            .field("queue", &self.inner.opts.queue)
            .field("shards", &self.shard_names())
            .finish()
    }
}

/// Whether `url` names a Redis shard (instance or cluster).
pub fn is_redis_url(url: &str) -> bool {
    url.starts_with(SCHEME_INSTANCE) || url.starts_with(SCHEME_CLUSTER)
}

impl RedisBackend {
    /// The deployment id the shards carry.
    pub fn deployment_id(&self) -> Option<String> {
        self.inner
            .deployment
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The namespace this backend serves.
    pub fn namespace(&self) -> &str {
        &self.inner.opts.namespace
    }

    fn dep_arg(&self) -> String {
        self.deployment_id().unwrap_or_default()
    }

    fn registry(&self) -> std::sync::RwLockReadGuard<'_, Registry> {
        self.inner
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The options this backend was opened with (its connection bounds
    /// among them: a shard added later is checked within the same ones).
    pub fn options(&self) -> &RedisOptions {
        &self.inner.opts
    }

    /// The queue name this backend serves.
    pub fn queue(&self) -> &str {
        &self.inner.opts.queue
    }

    /// The URL a shard lives at.
    pub fn shard_url(&self, shard: &str) -> Option<String> {
        let reg = self.registry();
        reg.index.get(shard).map(|&i| reg.shards[i].url.clone())
    }

    /// Whether the shard lives in a Redis Cluster.
    pub fn is_cluster(&self, shard: &str) -> bool {
        let reg = self.registry();
        reg.index
            .get(shard)
            .is_some_and(|&i| reg.shards[i].node.cluster)
    }

    /// Every Redis key of a shard (for operators and tests).
    pub fn shard_keys(&self, shard: &str) -> Option<Vec<String>> {
        let reg = self.registry();
        reg.index.get(shard).map(|&i| reg.shards[i].keys.clone())
    }

    pub(crate) fn grant(&self, shard: &str, token: &str) {
        self.tokens().insert(shard.to_string(), token.to_string());
    }

    pub(crate) fn revoke(&self, shard: &str) {
        self.tokens().remove(shard);
        if let Ok(s) = self.shard(shard) {
            *s.held() = None;
        }
    }

    fn tokens(&self) -> MutexGuard<'_, HashMap<String, String>> {
        self.inner.tokens.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn shard(&self, shard: &str) -> Result<Arc<ShardRef>, QueueError> {
        let reg = self.registry();
        reg.index
            .get(shard)
            .map(|&i| Arc::clone(&reg.shards[i]))
            .ok_or_else(|| QueueError::UnknownShard {
                shard: shard.to_string(),
            })
    }

    pub(crate) fn lease_args(&self) -> String {
        self.dep_arg()
    }

    pub(crate) fn now_arg(&self) -> String {
        self.inner
            .opts
            .clock
            .as_ref()
            .map(|c| c.now_ms().to_string())
            .unwrap_or_default()
    }

    fn halt_arg(&self) -> &'static str {
        match self.inner.opts.dead_policy {
            DeadPolicy::Halt => "1",
            _ => "0",
        }
    }

    /// This process's flow control, if it has one.
    pub fn flow(&self) -> Option<&Arc<FlowControl>> {
        self.inner.opts.flow.as_ref()
    }

    /// A script's `{'STALE', why}` answer about run `r`, as the error.
    fn stale_reply(s: &ShardRef, r: Receipt, v: &Value) -> QueueError {
        QueueError::StaleReceipt {
            shard: s.name.clone(),
            id: r.id.0,
            fence: r.fence,
            reason: reply::items(v)
                .get(1)
                .and_then(reply::string)
                .unwrap_or_default(),
        }
    }

    /// Ends run `r` of `key` ('' when unknown) without using an attempt:
    /// its job waits `ms` at the head of its key. When it may start again.
    /// Up to `max` of the shard's ready keys (and keys whose wait is
    /// over), the first [`RANK_LOOKAHEAD`] of each, in the order flow
    /// control ranks them (priority, then start-time fair queuing by
    /// weight); not yet charged: the claim charges the ones it starts.
    /// Runs whose lease ended are put back first, as a claim does. None
    /// when `token` no longer owns the shard.
    /// The claim script, with the shard's copy of the run limits written
    /// once and the call made again when the script finds it is another
    /// version (the settings changed, or another owner wrote its own).
    /// Its reply and the marks before it; `None` when this process no
    /// longer owns the shard.
    fn claim_script(
        &self,
        s: &ShardRef,
        held: &Held,
        max: usize,
        lease_ms: u64,
        picked: Option<&[Popped<String>]>,
    ) -> Result<Option<(Value, Marks)>, QueueError> {
        // A retried call (its reply lost) names the runs this process
        // knows, so the script puts back only the others.
        let known: Vec<String> = held.in_flight.keys().map(|i| i.to_string()).collect();
        let limits = self.limits_copy();
        let version = limits.as_ref().map_or("", |l| l.version.as_str());
        let mut rewritten = false;
        loop {
            let before = s.marks();
            let v = self.script(s, &self.inner.scripts.claim, &held.token, &|c, attempt| {
                c.arg(max).arg(lease_ms).arg(RECLAIM_BATCH_MAX).arg(version);
                match picked {
                    None => c.arg("-"),
                    Some(p) => c
                        .arg(p.len())
                        .arg(p.iter().map(|x| &x.key).collect::<Vec<_>>()),
                };
                if attempt == 0 {
                    c.arg("0");
                } else {
                    c.arg("1").arg(&known);
                }
            })?;
            match reply::status(&v).as_str() {
                "OK" => return Ok(Some((v, before))),
                "NOTOWNER" => return Ok(None),
                "LIMITS" if !rewritten => {
                    let copy = limits.as_deref().ok_or_else(|| {
                        self.protocol(s, "claim asked for run limits it was not given")
                    })?;
                    if !self.put_limits(s, &held.token, copy)? {
                        return Ok(None);
                    }
                    rewritten = true;
                }
                other => return Err(self.protocol(s, format!("claim answered {other:?}"))),
            }
        }
    }

    fn rank_ready(
        &self,
        s: &ShardRef,
        token: &str,
        flow: &FlowControl,
        max: usize,
    ) -> Result<Option<Vec<Popped<String>>>, QueueError> {
        let v = self.script(s, &self.inner.scripts.peek_ready, token, &|c, _| {
            c.arg(RANK_LOOKAHEAD).arg(RECLAIM_BATCH_MAX);
        })?;
        match reply::status(&v).as_str() {
            "OK" => {}
            "NOTOWNER" => return Ok(None),
            other => return Err(self.protocol(s, format!("peek answered {other:?}"))),
        }
        let parts = reply::items(&v);
        let now = parts.get(1).and_then(reply::u64).unwrap_or(0);
        let ready = parts.get(2).map(reply::items).unwrap_or_default();
        let due = parts.get(3).map(reply::items).unwrap_or_default();
        // Keys whose wait is over (many of them may be over their limits,
        // back every few ms) take at most half the claim while keys are
        // ready, as in the shard's own order.
        let mut due_max = max;
        if !ready.is_empty() {
            due_max = max / 2 + usize::from(max % 2 == 1 && now % 2 == 0);
        }
        let mut seen = std::collections::HashMap::new();
        let mut fair = s.fair.lock().unwrap_or_else(|p| p.into_inner());
        fair.raise_vtime(flow.fair_vtime());
        for (list, was_due) in [(&ready, false), (&due, true)] {
            for k in list.iter().filter_map(reply::string) {
                if let std::collections::hash_map::Entry::Vacant(e) = seen.entry(k.clone()) {
                    e.insert(was_due);
                    let (priority, weight) = flow.rank_of(&k);
                    fair.push(k, priority, weight);
                }
            }
        }
        let mut picked = Vec::with_capacity(max.min(seen.len()));
        let mut due_picked = 0;
        while picked.len() < max {
            let Some(p) = fair.pop() else { break };
            if seen.get(&p.key) == Some(&true) {
                if due_picked >= due_max {
                    continue;
                }
                due_picked += 1;
            }
            picked.push(p);
        }
        fair.drain();
        Ok(Some(picked))
    }

    /// Gives back the group run slots of the runs `runs` (key, fence) of
    /// `shard` that are over.
    fn runs_ended(&self, shard: &str, runs: &[(String, u64)]) {
        if let Some(f) = self.inner.opts.flow.as_deref().filter(|_| !runs.is_empty()) {
            let runs: Vec<(&str, u64)> = runs.iter().map(|(k, f)| (k.as_str(), *f)).collect();
            f.runs_ended(shard, &runs);
        }
    }

    /// Ends run `r` without using an attempt, its job not due before `ms`
    /// from now; `handler` when its handler backed off (a wait `key resume`
    /// lifts), not flow control. When it is due.
    fn give_back(
        &self,
        s: &ShardRef,
        held: &mut Held,
        r: Receipt,
        key: &str,
        ms: u64,
        handler: bool,
    ) -> Result<u64, QueueError> {
        let v = self.script(s, &self.inner.scripts.back_off, &held.token, &|c, _| {
            c.arg(r.id.0)
                .arg(r.fence)
                .arg(key)
                .arg(ms)
                .arg(if handler { "1" } else { "" });
        })?;
        match reply::status(&v).as_str() {
            "OK" => {
                held.in_flight.remove(&r.id.0);
                Ok(reply::items(&v).get(1).and_then(reply::u64).unwrap_or(0))
            }
            "NOTOWNER" => Err(Self::not_owner(s)),
            "STALE" => Err(Self::stale_reply(s, r, &v)),
            other => Err(self.protocol(s, format!("back-off answered {other:?}"))),
        }
    }

    /// The hold of a `key_resume.lua` reply `OK[, latest, id...]`.
    fn parse_hold(
        &self,
        s: &ShardRef,
        v: &Value,
    ) -> Result<Option<shardq_core::KeyHold>, QueueError> {
        let items = reply::items(v);
        if items.len() < 2 {
            return Ok(None);
        }
        let num = |x: &Value| {
            reply::u64(x).ok_or_else(|| self.protocol(s, format!("key hold answered {v:?}")))
        };
        Ok(Some(shardq_core::KeyHold {
            until_ms: num(&items[1])?,
            jobs: (items[2..].iter())
                .map(|x| num(x).map(JobId))
                .collect::<Result<_, _>>()?,
        }))
    }

    /// The token a move's writes pass: `@EPOCH` under a rebalance that has
    /// one (the prelude refuses it once the shard saw a newer one), else
    /// none.
    fn move_token(&self) -> String {
        match self.inner.epoch.load(std::sync::atomic::Ordering::SeqCst) {
            0 => String::new(),
            e => format!("@{e}"),
        }
    }

    /// Runs a shard script with the common ARGV (time, token, halt,
    /// deployment) and `extra` after them. A `LOST` reply (the shard's
    /// deployment record is gone or another) becomes
    /// [`QueueError::StoreLost`].
    fn script(
        &self,
        s: &ShardRef,
        lua: &crate::scripts::Lua,
        token: &str,
        extra: &dyn Fn(&mut redis::Cmd, u32),
    ) -> Result<Value, RedisError> {
        let dep = self.dep_arg();
        let want = if lua.writes {
            self.inner.opts.wait_replicas
        } else {
            0
        };
        let timeout_ms = self.inner.opts.wait_timeout_ms();
        let (v, acked) = s.node.run(&s.name, |con, attempt| {
            let now = self.now_arg();
            let v = lua.call(con, &s.keys, &|c| {
                c.arg(&now).arg(token).arg(self.halt_arg()).arg(&dep);
                extra(c, attempt);
            })?;
            if want == 0 {
                return Ok((v, 0));
            }
            // On the connection that wrote: WAIT covers its writes, and
            // everything replicated before them.
            let acked: u64 = redis::cmd("WAIT").arg(want).arg(timeout_ms).query(con)?;
            Ok((v, acked))
        })?;
        if reply::status(&v) == "LOST" {
            let found = reply::items(&v).get(1).and_then(reply::string);
            return Err(Self::lost(s, &dep, found.as_deref().unwrap_or("")).into());
        }
        if reply::status(&v) == "SUPERSEDED" {
            return Err(RedisError::Queue(QueueError::Superseded {
                shard: s.name.clone(),
                epoch: token
                    .strip_prefix('@')
                    .and_then(|e| e.parse().ok())
                    .unwrap_or(0),
                newer: reply::items(&v).get(1).and_then(reply::u64).unwrap_or(0),
            }));
        }
        if acked < u64::from(want) {
            return Err(RedisError::ReplicasBehind {
                shard: s.name.clone(),
                url: s.url.clone(),
                wanted: want,
                acked,
                timeout_ms,
            });
        }
        Ok(v)
    }

    /// The enqueue script: dedup ids checked and recorded when `window_ms`
    /// is not 0.
    fn enqueue_jobs(
        &self,
        shard: &str,
        map_version: u64,
        jobs: &[NewJob],
        window_ms: u64,
    ) -> Result<Vec<Stored>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        if jobs.len() > ENQUEUE_BATCH_MAX {
            return Err(QueueError::BatchTooLarge {
                jobs: jobs.len(),
                max: ENQUEUE_BATCH_MAX,
            });
        }
        for job in jobs {
            job.validate(self.inner.opts.payload_bytes_max)?;
        }
        // A retry after a lost reply may append the batch twice: at least
        // once, and in order, but possibly duplicated (a job with a dedup
        // id is not: the retry finds its record and reports a duplicate).
        let before = s.marks();
        let v = self.script(s, &self.inner.scripts.enqueue, "", &|c, _| {
            c.arg(map_version).arg(jobs.len()).arg(window_ms);
            for job in jobs {
                c.arg(&job.key)
                    .arg(&job.payload[..])
                    .arg(job.delay_ms)
                    .arg(job.max_attempts)
                    .arg(job.dedup_id.as_deref().unwrap_or(""))
                    .arg(match job.keyed {
                        None => String::new(),
                        Some(Keyed::Unique { running: false }) => "u".into(),
                        Some(Keyed::Unique { running: true }) => "U".into(),
                        Some(Keyed::Debounce { max_ms }) => format!("d{max_ms}"),
                    });
            }
        })?;
        let it = reply::items(&v);
        match reply::status(&v).as_str() {
            "OK" => {
                if it.len() != jobs.len() + 1 {
                    return Err(self.protocol(s, "enqueue answered for another number of jobs"));
                }
                // Each answer, and whether it is a new id of the sequence.
                let answers: Vec<(Stored, bool)> = it[1..]
                    .iter()
                    .map(|item| {
                        let text = reply::string(item)
                            .ok_or_else(|| self.protocol(s, "enqueue without an id"))?;
                        let bad = || self.protocol(s, format!("enqueue answered {text:?}"));
                        let here = |job: &str, duplicate| -> Result<Stored, QueueError> {
                            Ok(Stored {
                                id: JobId(job.parse().map_err(|_| bad())?),
                                shard: s.name.clone(),
                                duplicate,
                            })
                        };
                        if let Some(job) = text.strip_prefix('B') {
                            // A debounce gave a waiting job its payload.
                            return Ok((here(job, false)?, false));
                        }
                        let Some(dup) = text.strip_prefix('D') else {
                            return Ok((here(&text, false)?, true));
                        };
                        let (job, on) = dup.split_once('|').ok_or_else(bad)?;
                        let mut st = here(job, true)?;
                        if !on.is_empty() {
                            st.shard = on.to_string();
                        }
                        Ok((st, false))
                    })
                    .collect::<Result<_, QueueError>>()?;
                // The new ids are the sequence's next values: one lower
                // than this process saw means the store went back in time.
                let fresh = answers.iter().filter(|(_, new)| *new).map(|(x, _)| x.id.0);
                if let (Some(lo), Some(hi)) = (fresh.clone().min(), fresh.max()) {
                    s.observe(before, lo.saturating_sub(1), hi, &[])?;
                }
                Ok(answers.into_iter().map(|(x, _)| x).collect())
            }
            "FENCED" => Err(QueueError::Fenced {
                shard: s.name.clone(),
                key: it.get(1).and_then(reply::string).unwrap_or_default(),
                map_version,
                map_version_min: it.get(2).and_then(reply::u64).unwrap_or(0),
            }),
            "PAUSED" => Err(QueueError::Paused {
                shard: s.name.clone(),
                key: it.get(1).and_then(reply::string).unwrap_or_default(),
            }),
            "MOVED" => Err(QueueError::Moved {
                shard: s.name.clone(),
                key: it.get(1).and_then(reply::string).unwrap_or_default(),
                to: it
                    .get(2)
                    .and_then(reply::string)
                    .ok_or_else(|| self.protocol(s, "enqueue answered MOVED without a shard"))?,
            }),
            other => Err(self.protocol(s, format!("enqueue answered {other:?}"))),
        }
    }

    /// The live dedup records of `shard` (of `key`, or all when it is
    /// empty), read in bounded pages.
    fn dedup_scan(&self, shard: &str, key: &str) -> Result<Vec<DedupRecord>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut cursor = "0".to_string();
        let mut out = Vec::new();
        loop {
            let v = self.script(s, &self.inner.scripts.dedup_export, "", &|c, _| {
                c.arg(key).arg(INVENTORY_KEYS_PER_CALL).arg(&cursor);
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "dedup export refused"));
            }
            let it = reply::items(&v);
            let next = it
                .get(1)
                .and_then(reply::string)
                .ok_or_else(|| self.protocol(s, "dedup export without a cursor"))?;
            for pair in it[2..].chunks(2) {
                let (Some(f), Some(r)) = (
                    pair.first().and_then(reply::string),
                    pair.get(1).and_then(reply::string),
                ) else {
                    return Err(self.protocol(s, "dedup export: a field without a record"));
                };
                let rec = parse_dedup(&s.name, &f, &r)
                    .ok_or_else(|| self.protocol(s, format!("dedup record {f:?} = {r:?}")))?;
                out.push(rec);
            }
            if next == "0" {
                return Ok(out);
            }
            if out.len() > INVENTORY_KEYS_MAX {
                return Err(self.protocol(s, "more dedup records than the inventory reads"));
            }
            cursor = next;
        }
    }

    pub(crate) fn lost(s: &ShardRef, want: &str, found: &str) -> QueueError {
        let what = if found.is_empty() {
            format!(
                "its deployment record ({} field `dep`) is missing: the server lost its state \
                 (flushed, or restarted without its data)",
                s.keys[0]
            )
        } else {
            format!("it now belongs to deployment {found:?}")
        };
        QueueError::StoreLost(format!(
            "shard {:?} at {}: the store no longer holds deployment {want:?}: {what}; workers \
             stop rather than run on it (restore the data, or init a new deployment)",
            s.name, s.url
        ))
    }

    /// Reads `id, fence, why` triples of refused receipts.
    fn stale_list(
        &self,
        s: &ShardRef,
        items: &[Value],
    ) -> Result<Vec<(Receipt, String)>, QueueError> {
        let mut out = Vec::with_capacity(items.len() / 3);
        for t in items.chunks(3) {
            let bad = || self.protocol(s, "a stale receipt in the reply is malformed");
            if t.len() != 3 {
                return Err(bad());
            }
            let id = reply::u64(&t[0]).ok_or_else(bad)?;
            let fence = reply::u64(&t[1]).ok_or_else(bad)?;
            out.push((
                Receipt {
                    id: JobId(id),
                    fence,
                },
                reply::string(&t[2]).unwrap_or_default(),
            ));
        }
        Ok(out)
    }

    fn protocol(&self, s: &ShardRef, reason: impl Into<String>) -> QueueError {
        RedisError::Protocol {
            shard: s.name.clone(),
            url: s.url.clone(),
            reason: reason.into(),
        }
        .into()
    }

    fn not_owner(s: &ShardRef) -> QueueError {
        QueueError::NotOwner {
            shard: s.name.clone(),
        }
    }

    /// Removes dead jobs in batches: `retry` or `purge`.
    fn dead_move(
        &self,
        shard: &str,
        mode: &str,
        ids: Option<&[JobId]>,
    ) -> Result<usize, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let lua = &self.inner.scripts.dead_move;
        let mut total = 0usize;
        match ids {
            // The dead jobs left in place (of keys sealed for a move) are
            // stepped over, so the ones behind them are reached.
            None => {
                let mut skip = 0usize;
                loop {
                    let v = self.script(s, lua, "", &|c, _| {
                        c.arg(mode).arg("1").arg(DEAD_BATCH_MAX).arg(skip);
                    })?;
                    let it = reply::items(&v);
                    let moved = it.first().and_then(reply::u64).unwrap_or(0) as usize;
                    let seen = it.get(1).and_then(reply::u64).unwrap_or(0) as usize;
                    total += moved;
                    skip += seen.saturating_sub(moved);
                    if seen < DEAD_BATCH_MAX {
                        return Ok(total);
                    }
                }
            }
            Some(ids) => {
                for chunk in ids.chunks(DEAD_BATCH_MAX) {
                    let list: Vec<String> = chunk.iter().map(|i| i.0.to_string()).collect();
                    let v = self.script(s, lua, "", &|c, _| {
                        c.arg(mode).arg("0").arg(DEAD_BATCH_MAX).arg(&list);
                    })?;
                    total += reply::items(&v).first().and_then(reply::u64).unwrap_or(0) as usize;
                }
                Ok(total)
            }
        }
    }
}

/// ARGV of receipts: id, fence and the key when this process knows it (the
/// script looks the key up in the job's record otherwise).
fn receipt_args(receipts: &[Receipt], known: &HashMap<u64, Run>) -> Vec<String> {
    let mut list = Vec::with_capacity(receipts.len() * 3);
    for r in receipts {
        list.push(r.id.0.to_string());
        list.push(r.fence.to_string());
        list.push(
            known
                .get(&r.id.0)
                .map(|x| x.key.clone())
                .unwrap_or_default(),
        );
    }
    list
}

/// The ack script's arguments: id, fence, key and attempt per receipt (key
/// and attempt empty for a run this process did not hand out).
fn ack_args(
    receipts: &[Receipt],
    results: &[Option<Vec<u8>>],
    known: &HashMap<u64, Run>,
) -> Vec<Vec<u8>> {
    let mut list = Vec::with_capacity(receipts.len() * 5);
    for (i, r) in receipts.iter().enumerate() {
        list.push(r.id.0.to_string().into_bytes());
        list.push(r.fence.to_string().into_bytes());
        match known.get(&r.id.0) {
            Some(run) => {
                list.push(run.key.clone().into_bytes());
                list.push(run.attempt.to_string().into_bytes());
            }
            None => list.extend([Vec::new(), Vec::new()]),
        }
        list.push(match results.get(i).and_then(Option::as_deref) {
            Some(b) => [b"+".as_slice(), b].concat(),
            None => Vec::new(),
        });
    }
    list
}

/// Most bytes of results one ack script call carries (more receipts go in
/// the next call): bounds the script's argument and its time.
const ACK_RESULT_BYTES_MAX: usize = 1 << 20;

/// `receipts` (with their `results`, when given) in chunks of at most
/// [`ACK_BATCH_MAX`] receipts and about [`ACK_RESULT_BYTES_MAX`] bytes of
/// results: (start, end) index pairs.
fn ack_chunks(receipts: &[Receipt], results: &[Option<Vec<u8>>]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0usize, 0usize);
    for i in 0..receipts.len() {
        let b = results.get(i).and_then(Option::as_ref).map_or(0, Vec::len);
        if i > start && (i - start == ACK_BATCH_MAX || bytes + b > ACK_RESULT_BYTES_MAX) {
            out.push((start, i));
            (start, bytes) = (i, 0);
        }
        bytes += b;
    }
    if start < receipts.len() {
        out.push((start, receipts.len()));
    }
    out
}
