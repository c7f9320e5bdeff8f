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
    DeadJob, DeadPolicy, DedupRecord, FailOutcome, Fence, Finish, FinishedJob, JobId, JobInfo,
    JobState, KeyCounts, Keyed, MovedJob, NewJob, QueueBackend, QueueError, Receipt, Retention,
    RetryRules, ShardStats, Stored, KEY_JOBS_MAX, PAYLOAD_BYTES_MAX_DEFAULT,
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

mod inventory;
mod limits;
mod open;
mod options;
mod records;

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
    /// [`QueueBackend::enter_rebalance`]).
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

impl QueueBackend for RedisBackend {
    fn limits(&self) -> shardq_core::BackendLimits {
        shardq_core::BackendLimits {
            enqueue_batch_jobs_max: ENQUEUE_BATCH_MAX,
            key_concurrency_max: shardq_core::flow::KEY_CONCURRENCY_MAX,
            ..shardq_core::BackendLimits::default()
        }
    }

    fn shard_names(&self) -> Vec<String> {
        self.registry()
            .shards
            .iter()
            .map(|s| s.name.clone())
            .collect()
    }

    fn enqueue(
        &self,
        shard: &str,
        map_version: u64,
        jobs: &[NewJob],
    ) -> Result<Vec<JobId>, QueueError> {
        shardq_core::job::refuse_dedup_ids(jobs)?;
        Ok(self
            .enqueue_jobs(shard, map_version, jobs, 0)?
            .into_iter()
            .map(|s| s.id)
            .collect())
    }

    fn enqueue_dedup(
        &self,
        shard: &str,
        map_version: u64,
        jobs: &[NewJob],
        window_ms: u64,
    ) -> Result<Vec<Stored>, QueueError> {
        shardq_core::job::validate_dedup_window_ms(window_ms)?;
        self.enqueue_jobs(shard, map_version, jobs, window_ms)
    }

    fn dedup_export(&self, shard: &str, key: &str) -> Result<Vec<DedupRecord>, QueueError> {
        Ok(self
            .dedup_scan(shard, key)?
            .into_iter()
            .filter(|r| r.key == key)
            .collect())
    }

    fn dedup_export_many(
        &self,
        shard: &str,
        keys: &[&str],
    ) -> Result<Vec<DedupRecord>, QueueError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let want: BTreeSet<&str> = keys.iter().copied().collect();
        Ok(self
            .dedup_scan(shard, "")?
            .into_iter()
            .filter(|r| want.contains(r.key.as_str()))
            .collect())
    }

    fn dedup_import(&self, shard: &str, records: &[DedupRecord]) -> Result<(), QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        for rec in records {
            shardq_core::validate_key(&rec.key)?;
            shardq_core::job::validate_dedup_id(&rec.key, &rec.id)?;
        }
        // In calls of at most ENQUEUE_BATCH_MAX records, as an enqueue: a
        // mark of `dedupm` then names at most that many, which bounds what
        // an enqueue forgets.
        for part in records.chunks(ENQUEUE_BATCH_MAX) {
            let v = self.script(s, &self.inner.scripts.dedup_import, &token, &|c, _| {
                c.arg(part.len());
                for r in part {
                    let on = if r.shard == s.name {
                        ""
                    } else {
                        r.shard.as_str()
                    };
                    c.arg(dedup_field(&r.key, &r.id))
                        .arg(r.job.0)
                        .arg(r.expires_ms)
                        .arg(on);
                }
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "dedup import refused"));
            }
        }
        Ok(())
    }

    fn dedup_keys(&self, shard: &str) -> Result<Vec<String>, QueueError> {
        let keys: std::collections::BTreeSet<String> = self
            .dedup_scan(shard, "")?
            .into_iter()
            .map(|r| r.key)
            .collect();
        Ok(keys.into_iter().collect())
    }

    fn adopt(&self, shard: &str) -> Result<(), QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let token = self
            .tokens()
            .get(shard)
            .cloned()
            .ok_or_else(|| Self::not_owner(s))?;
        let keep = self.inner.opts.retention;
        let v = self.script(s, &self.inner.scripts.adopt, &token, &|c, _| {
            c.arg(keep.finished_jobs)
                .arg(keep.finished_age_ms)
                .arg(crate::scripts::keys_pin_value());
        })?;
        if reply::status(&v) != "OK" {
            return Err(Self::not_owner(s));
        }
        *s.held() = Some(Held {
            token,
            in_flight: HashMap::new(),
            limits_version: 0,
        });
        Ok(())
    }

    fn release(&self, shard: &str) -> Result<(), QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        *s.held() = None;
        Ok(())
    }

    fn claim(&self, shard: &str, max: usize, lease_ms: u64) -> Result<Vec<ClaimedJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        validate_job_lease_ms(lease_ms)?;
        // Held for the whole call: a retried claim puts back in-flight jobs
        // this process does not know, so no other claim may be half done.
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let max = max.min(CLAIM_BATCH_MAX);
        if max == 0 {
            return Ok(Vec::new());
        }
        // Before ranking: a key whose limit rose is ready again.
        if let Some(f) = self.inner.opts.flow.as_deref() {
            // Settings changed since the last claim are used by this one:
            // read again (when due) by the scripts' clock, or an estimate
            // of the server's from its last reply.
            let now = match self.inner.opts.clock.as_ref() {
                Some(c) => Some(c.now_ms()),
                None => (*self
                    .inner
                    .server_time
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()))
                .map(|(ms, at)| ms.saturating_add(at.elapsed().as_millis() as u64)),
            };
            if let Some(now) = now {
                f.refresh(now);
            }
            if held.limits_version != f.version() && !self.relimit(s, held, f)? {
                *guard = None;
                return Err(Self::not_owner(s));
            }
        }
        let ranked = (self.inner.opts.flow.as_deref()).filter(|f| f.ranks_keys());
        let picked = match ranked {
            Some(f) => match self.rank_ready(s, &held.token, f, max)? {
                Some(p) => Some(p),
                None => {
                    *guard = None;
                    return Err(Self::not_owner(s));
                }
            },
            None => None,
        };
        let Some((v, before)) = self.claim_script(s, held, max, lease_ms, picked.as_deref())?
        else {
            *guard = None;
            return Err(Self::not_owner(s));
        };
        let it = reply::items(&v);
        let bad = || self.protocol(s, "claim reply has a malformed job");
        let lease_until_ms = it.get(1).and_then(reply::u64).ok_or_else(bad)?;
        // The server's now (the lease deadline less the lease): flow
        // control reads its settings and counts its buckets in it.
        let now = lease_until_ms.saturating_sub(lease_ms);
        *self
            .inner
            .server_time
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some((now, std::time::Instant::now()));
        let flow = (self.inner.opts.flow.as_deref()).filter(|f| {
            f.refresh(now);
            f.limits_starts()
        });
        let seq = it.get(2).and_then(reply::u64).ok_or_else(bad)?;
        let jobs = it.get(3..).unwrap_or(&[]);
        let fences: Vec<u64> = jobs
            .chunks(3)
            .map(|j| j.get(2).and_then(reply::u64).unwrap_or(0))
            .collect();
        s.observe(before, seq, seq, &fences)?;
        let mut claimed = Vec::with_capacity(jobs.len() / 3);
        for j in jobs.chunks(3) {
            if j.len() != 3 {
                return Err(bad());
            }
            let id = reply::u64(&j[0]).ok_or_else(bad)?;
            let rec = reply::bytes(&j[1])
                .and_then(JobRecord::parse)
                .ok_or_else(bad)?;
            let fence = reply::u64(&j[2]).ok_or_else(bad)?;
            let run = Run {
                key: rec.key.clone(),
                attempt: rec.attempts.saturating_add(1),
            };
            held.in_flight.insert(id, run);
            claimed.push((id, rec, fence));
        }
        // Every start's limits asked at once: one call per group.
        let admits = match flow {
            Some(flow) => {
                let runs: Vec<(&str, shardq_core::flow::RunStart<'_>)> = (claimed.iter())
                    .map(|(_, rec, fence)| {
                        let start = shardq_core::flow::RunStart {
                            shard: &s.name,
                            fence: *fence,
                            lease_until_ms,
                        };
                        (rec.key.as_str(), start)
                    })
                    .collect();
                flow.admit_many(&runs, now)
            }
            None => vec![Admit::Now; claimed.len()],
        };
        let mut out = Vec::with_capacity(claimed.len());
        for ((id, rec, fence), admit) in claimed.into_iter().zip(admits) {
            if let Admit::NotBefore(at) = admit {
                let r = Receipt {
                    id: JobId(id),
                    fence,
                };
                match self.give_back(s, held, r, &rec.key, at.saturating_sub(now), false) {
                    Ok(_) => continue,
                    // Its first try went through and the reply was
                    // lost: it is given back.
                    Err(QueueError::StaleReceipt { .. }) => {
                        held.in_flight.remove(&id);
                        continue;
                    }
                    // Not given back: the run is in flight, so it
                    // starts now (over the limit by one) rather than
                    // waiting out its lease and losing an attempt.
                    Err(_) => {}
                }
            }
            if let Some(p) = (picked.as_ref()).and_then(|p| p.iter().find(|p| p.key == rec.key)) {
                let mut fair = s.fair.lock().unwrap_or_else(|p| p.into_inner());
                fair.charge(p);
                // Picked keys mean ranking, with or without limits.
                if let Some(f) = self.inner.opts.flow.as_deref() {
                    f.raise_fair_vtime(fair.vtime());
                }
            }
            out.push(ClaimedJob {
                shard: s.name.clone(),
                id: JobId(id),
                // The record counts finished attempts; this is the next one.
                attempt: rec.attempts + 1,
                max_attempts: rec.max_attempts,
                created_ms: rec.created_ms,
                not_before_ms: rec.not_before_ms,
                key: rec.key,
                payload: rec.payload.to_vec(),
                fence,
                lease_until_ms,
                dedup_id: rec.dedup_id,
            });
        }
        Ok(out)
    }

    fn ack(&self, shard: &str, receipts: &[Receipt]) -> Result<AckOutcome, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let token = held.token.clone();
        let mut outcome = AckOutcome::default();
        // Runs over (acked, or refused as not current), whose group slots
        // go back, whatever a later chunk does.
        let mut ended: Vec<(String, u64)> = Vec::new();
        let mut not_owner = false;
        let res = (|| -> Result<(), QueueError> {
            for chunk in receipts.chunks(ACK_BATCH_MAX) {
                let list = ack_args(chunk, &held.in_flight);
                let retried = std::cell::Cell::new(false);
                let v = self.script(s, &self.inner.scripts.ack, &token, &|c, attempt| {
                    retried.set(attempt > 0);
                    c.arg(&list);
                })?;
                match reply::status(&v).as_str() {
                    "OK" => {}
                    "NOTOWNER" => {
                        not_owner = true;
                        return Err(Self::not_owner(s));
                    }
                    other => return Err(self.protocol(s, format!("ack answered {other:?}"))),
                }
                let stale = self.stale_list(s, reply::items(&v).get(1..).unwrap_or(&[]))?;
                let mut refused = Vec::new();
                for (r, why) in stale {
                    // After a lost reply the first attempt may have acked it:
                    // a job that is gone was finished, by this call.
                    if retried.get() && why == "gone" && held.in_flight.contains_key(&r.id.0) {
                        continue;
                    }
                    refused.push(r.id.0);
                    outcome.stale.push(r);
                }
                outcome.acked += (chunk.len() - refused.len()) as u64;
                for r in chunk {
                    if let Some(run) = held.in_flight.remove(&r.id.0) {
                        ended.push((run.key, r.fence));
                    }
                }
            }
            Ok(())
        })();
        if not_owner {
            *guard = None;
        }
        drop(guard);
        self.runs_ended(shard, &ended);
        res.map(|()| outcome)
    }

    fn fail(
        &self,
        shard: &str,
        receipt: Receipt,
        reason: &str,
        retry_in_ms: Option<u64>,
    ) -> Result<FailOutcome, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        if let Some(ms) = retry_in_ms {
            if ms > shardq_core::job::DELAY_MS_MAX {
                return Err(QueueError::InvalidDelay {
                    delay_ms: ms,
                    max: shardq_core::job::DELAY_MS_MAX,
                });
            }
        }
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let reason = shardq_core::job::cut_at_char(reason, shardq_core::job::FAIL_REASON_BYTES_MAX);
        let opts = &self.inner.opts;
        let backoff = (held.in_flight.get(&receipt.id.0))
            .and_then(|run| opts.retry_rules.for_key(&run.key))
            .map_or(opts.backoff, |p| p.backoff);
        let retry = retry_in_ms.map(|m| m.to_string()).unwrap_or_default();
        let v = self.script(s, &self.inner.scripts.fail, &held.token, &|c, _| {
            c.arg(receipt.id.0)
                .arg(receipt.fence)
                .arg(reason)
                .arg(backoff.base_ms)
                .arg(backoff.max_ms)
                .arg(&retry)
                .arg(match backoff.kind {
                    shardq_core::BackoffKind::Exponential => "exp",
                    shardq_core::BackoffKind::Fixed => "fixed",
                })
                .arg(backoff.jitter_share(shardq_core::job::run_seed(receipt)));
        })?;
        match reply::status(&v).as_str() {
            "RETRY" => {
                let key = held.in_flight.remove(&receipt.id.0).map(|r| r.key);
                drop(guard);
                self.runs_ended(shard, &Vec::from_iter(key.map(|k| (k, receipt.fence))));
                Ok(FailOutcome::Retry {
                    at_ms: reply::items(&v).get(1).and_then(reply::u64).unwrap_or(0),
                })
            }
            "DEAD" => {
                let key = held.in_flight.remove(&receipt.id.0).map(|r| r.key);
                drop(guard);
                self.runs_ended(shard, &Vec::from_iter(key.map(|k| (k, receipt.fence))));
                Ok(FailOutcome::Dead)
            }
            "NOTOWNER" => {
                *guard = None;
                Err(Self::not_owner(s))
            }
            "STALE" => {
                // Not current (or ended by a first try whose reply was
                // lost): over either way, so its slot goes.
                let key = held.in_flight.get(&receipt.id.0).map(|r| r.key.clone());
                drop(guard);
                self.runs_ended(shard, &Vec::from_iter(key.map(|k| (k, receipt.fence))));
                Err(Self::stale_reply(s, receipt, &v))
            }
            other => Err(self.protocol(s, format!("fail answered {other:?}"))),
        }
    }

    fn ready_ranks(&self, shard: &str, max: usize) -> Result<Vec<Rank>, QueueError> {
        let Some(f) = (self.inner.opts.flow.as_deref()).filter(|f| f.ranks_keys()) else {
            return Ok(Vec::new());
        };
        let s = self.shard(shard)?;
        let s = &*s;
        // As a claim: its peek may put back lapsed runs.
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        match self.rank_ready(s, &held.token, f, max.min(CLAIM_BATCH_MAX))? {
            Some(picked) => Ok(picked.iter().map(Popped::rank).collect()),
            None => {
                *guard = None;
                Err(Self::not_owner(s))
            }
        }
    }

    fn ranks_keys(&self) -> bool {
        self.inner
            .opts
            .flow
            .as_ref()
            .is_some_and(|f| f.ranks_keys())
    }

    fn limits_starts(&self) -> bool {
        self.inner
            .opts
            .flow
            .as_ref()
            .is_some_and(|f| f.limits_starts())
    }

    fn key_concurrency(&self, key: &str) -> u32 {
        self.inner
            .opts
            .flow
            .as_ref()
            .map_or(1, |f| f.concurrency_of(key))
    }

    fn back_off(
        &self,
        shard: &str,
        receipt: Receipt,
        retry_in_ms: u64,
        group: bool,
    ) -> Result<BackedOff, QueueError> {
        shardq_core::flow::validate_backoff_ms(retry_in_ms)?;
        let s = self.shard(shard)?;
        let s = &*s;
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let key = (held.in_flight.get(&receipt.id.0))
            .map(|r| r.key.clone())
            .unwrap_or_default();
        let given = self.give_back(s, held, receipt, &key, retry_in_ms, true);
        if let Err(QueueError::NotOwner { .. }) = given {
            *guard = None;
            return Err(Self::not_owner(s));
        }
        drop(guard);
        // Given back, or refused as not current: over either way.
        if !key.is_empty() && matches!(given, Ok(_) | Err(QueueError::StaleReceipt { .. })) {
            self.runs_ended(shard, &[(key.clone(), receipt.fence)]);
        }
        let at_ms = given?;
        let held_group = match (&self.inner.opts.flow, group, key.is_empty()) {
            (Some(f), true, false) => f.hold_group_of(&key, at_ms),
            _ => None,
        };
        Ok(BackedOff {
            at_ms,
            group: held_group,
        })
    }

    fn extend(
        &self,
        shard: &str,
        receipts: &[Receipt],
        lease_ms: u64,
    ) -> Result<Vec<Receipt>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        validate_job_lease_ms(lease_ms)?;
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let token = held.token.clone();
        let mut stale = Vec::new();
        let slots = (self.inner.opts.flow.as_deref()).filter(|f| f.limits_starts());
        let mut renewed: Vec<(u64, Vec<(String, u64)>)> = Vec::new();
        for chunk in receipts.chunks(EXTEND_BATCH_MAX) {
            let list = receipt_args(chunk, &held.in_flight);
            let v = self.script(s, &self.inner.scripts.extend, &token, &|c, _| {
                c.arg(lease_ms).arg(&list);
            })?;
            match reply::status(&v).as_str() {
                "OK" => {}
                "NOTOWNER" => {
                    *guard = None;
                    return Err(Self::not_owner(s));
                }
                other => return Err(self.protocol(s, format!("extend answered {other:?}"))),
            }
            let before = stale.len();
            for (r, _) in self.stale_list(s, reply::items(&v).get(2..).unwrap_or(&[]))? {
                held.in_flight.remove(&r.id.0);
                stale.push(r);
            }
            if slots.is_some() {
                let deadline = reply::items(&v).get(1).and_then(reply::u64).unwrap_or(0);
                let refused = &stale[before..];
                let keys = (chunk.iter())
                    .filter(|r| !refused.iter().any(|x| x.id == r.id))
                    .filter_map(|r| (held.in_flight.get(&r.id.0)).map(|x| (x.key.clone(), r.fence)))
                    .collect();
                renewed.push((deadline, keys));
            }
        }
        drop(guard);
        if let Some(f) = slots {
            for (deadline, runs) in &renewed {
                let runs: Vec<(&str, u64)> = runs.iter().map(|(k, f)| (k.as_str(), *f)).collect();
                f.runs_extended(shard, &runs, *deadline);
            }
        }
        Ok(stale)
    }

    fn next_due_ms(&self, shard: &str) -> Result<Option<u64>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.next_due, "", &|_, _| {})?;
        Ok(reply::u64(&v))
    }

    fn key_counts(&self, shard: &str, key: &str) -> Result<KeyCounts, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.key_counts, "", &|c, _| {
            c.arg(key);
        })?;
        let it = reply::items(&v);
        let n = |i: usize| it.get(i).and_then(reply::u64).unwrap_or(0);
        Ok(KeyCounts {
            depth: n(0),
            in_flight: n(1),
            dead: n(2),
        })
    }

    fn shard_stats(&self, shard: &str) -> Result<ShardStats, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.stats, "", &|_, _| {})?;
        let it = reply::items(&v);
        let n = |i: usize| it.get(i).and_then(reply::u64).unwrap_or(0);
        Ok(ShardStats {
            name: s.name.clone(),
            ready: n(0),
            delayed: n(1),
            in_flight: n(2),
            dead: n(3),
            keys: n(4),
            fence_high: n(5),
        })
    }

    fn fence(&self, shard: &str) -> Result<Fence, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.fence_get, "", &|_, _| {})?;
        let it = reply::items(&v);
        Ok(Fence {
            map_version_min: it.first().and_then(reply::u64).unwrap_or(0),
            paused_keys: it
                .get(1)
                .map(reply::items)
                .unwrap_or(&[])
                .iter()
                .filter_map(reply::string)
                .collect::<BTreeSet<String>>(),
            run_fence_min: it.get(2).and_then(reply::u64).unwrap_or(0),
            sealed_keys: it
                .get(3)
                .map(reply::items)
                .unwrap_or(&[])
                .chunks(2)
                .filter_map(|p| Some((reply::string(p.first()?)?, reply::string(p.get(1)?)?)))
                .collect(),
        })
    }

    fn set_fence(&self, shard: &str, fence: &Fence) -> Result<(), QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        let keys: Vec<&String> = fence.paused_keys.iter().collect();
        self.script(s, &self.inner.scripts.fence_set, &token, &|c, _| {
            c.arg(fence.map_version_min)
                .arg(fence.run_fence_min)
                .arg(keys.len())
                .arg(&keys);
            for (key, to) in &fence.sealed_keys {
                c.arg(key).arg(to);
            }
        })?;
        Ok(())
    }

    fn enter_rebalance(&self, shard: &str, epoch: u64) -> Result<(), QueueError> {
        self.inner
            .epoch
            .fetch_max(epoch, std::sync::atomic::Ordering::SeqCst);
        let s = self.shard(shard)?;
        let token = self.move_token();
        self.script(&s, &self.inner.scripts.epoch_raise, &token, &|_, _| {})?;
        Ok(())
    }

    fn export_jobs(
        &self,
        shard: &str,
        key: &str,
        after: Option<JobId>,
        max: usize,
    ) -> Result<Vec<MovedJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut out: Vec<MovedJob> = Vec::new();
        let mut after = after.map_or(0, |a| a.0);
        // In calls of bounded size; a short call (the byte budget) is not
        // the end: only an empty one is, or `max` reached.
        while out.len() < max {
            let want = (max - out.len()).min(TRANSFER_CALL_JOBS_MAX);
            let v = self.script(s, &self.inner.scripts.export, "", &|c, _| {
                c.arg(key).arg(after).arg(want).arg(TRANSFER_CALL_BYTES_MAX);
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "export refused"));
            }
            let items = &reply::items(&v)[1..];
            if items.is_empty() {
                break;
            }
            for j in items.chunks(3) {
                let job = (j.len() == 3)
                    .then(|| moved_job(&j[0], &j[1], &j[2], key, after))
                    .flatten()
                    .ok_or_else(|| {
                        self.protocol(s, format!("export of key {key:?}: a malformed job"))
                    })?;
                after = job.id.0;
                out.push(job);
            }
        }
        Ok(out)
    }

    fn export_many(
        &self,
        shard: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<(String, Vec<MovedJob>)>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut out: Vec<(String, Vec<MovedJob>)> =
            items.iter().map(|(k, _)| (k.clone(), Vec::new())).collect();
        // Indexes into `out` of the keys that may have more, with cursors.
        let mut pending: Vec<(usize, u64)> = items
            .iter()
            .enumerate()
            .map(|(i, (_, a))| (i, a.map_or(0, |a| a.0)))
            .collect();
        while !pending.is_empty() {
            let call = &pending[..pending.len().min(EXPORT_MANY_KEYS_MAX)];
            let v = self.script(s, &self.inner.scripts.export_many, "", &|c, _| {
                c.arg(call.len())
                    .arg(TRANSFER_CALL_JOBS_MAX)
                    .arg(TRANSFER_CALL_BYTES_MAX);
                for (i, after) in call {
                    c.arg(&out[*i].0).arg(*after);
                }
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "export refused"));
            }
            let it = &reply::items(&v)[1..];
            let bad = || self.protocol(s, "export reply is malformed");
            let (mut at, mut done, mut answered) = (0usize, Vec::new(), 0usize);
            while at < it.len() {
                let (Some(key), Some(n), Some(more)) = (
                    it.get(at).and_then(reply::string),
                    it.get(at + 1).and_then(reply::u64),
                    it.get(at + 2).and_then(reply::u64),
                ) else {
                    return Err(bad());
                };
                let (slot, after) = call.get(answered).copied().ok_or_else(bad)?;
                if out[slot].0 != key {
                    return Err(bad());
                }
                let n = usize::try_from(n).map_err(|_| bad())?;
                let jobs = it.get(at + 3..at + 3 + 3 * n).ok_or_else(bad)?;
                let mut last = after;
                for j in jobs.chunks(3) {
                    let job = moved_job(&j[0], &j[1], &j[2], &key, last).ok_or_else(bad)?;
                    last = job.id.0;
                    out[slot].1.push(job);
                }
                done.push((answered, more == 0, last));
                answered += 1;
                at += 3 + 3 * n;
            }
            if answered == 0 {
                return Err(bad());
            }
            let mut next = Vec::new();
            for (pos, (slot, after)) in pending.iter().enumerate() {
                match done.iter().find(|d| d.0 == pos) {
                    Some((_, true, _)) => {}
                    Some((_, false, last)) => next.push((*slot, *last)),
                    None => next.push((*slot, *after)),
                }
            }
            pending = next;
        }
        Ok(out)
    }

    fn import_jobs(
        &self,
        shard: &str,
        from: &str,
        key: &str,
        jobs: &[MovedJob],
    ) -> Result<Vec<(JobId, JobId)>, QueueError> {
        shardq_core::backend::import_jobs_by_many(self, shard, from, key, jobs)
    }

    fn import_many(
        &self,
        shard: &str,
        from: &str,
        items: &[(String, Vec<MovedJob>)],
    ) -> Result<Vec<(String, JobId, JobId)>, QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        for (key, jobs) in items {
            shardq_core::validate_key(key)?;
            for d in jobs.iter().filter_map(|j| j.dedup_id.as_deref()) {
                shardq_core::job::validate_dedup_id(key, d)?;
            }
        }
        // Calls of at most TRANSFER_CALL_JOBS_MAX jobs and about
        // TRANSFER_CALL_BYTES_MAX bytes, each key's jobs in order: every
        // call is atomic and the cursors make a retried call a no-op.
        let mut calls: Vec<Vec<(&str, &[MovedJob])>> = vec![Vec::new()];
        let (mut jobs_in, mut bytes_in) = (0usize, 0usize);
        for (key, jobs) in items {
            let mut rest = &jobs[..];
            while !rest.is_empty() {
                let mut take = 0;
                while take < rest.len()
                    && jobs_in < TRANSFER_CALL_JOBS_MAX
                    && (bytes_in < TRANSFER_CALL_BYTES_MAX || (jobs_in == 0 && take == 0))
                {
                    bytes_in += rest[take].payload.len() + key.len();
                    jobs_in += 1;
                    take += 1;
                }
                if take > 0 {
                    calls
                        .last_mut()
                        .expect("one call at least")
                        .push((key.as_str(), &rest[..take]));
                    rest = &rest[take..];
                }
                if !rest.is_empty() {
                    calls.push(Vec::new());
                    (jobs_in, bytes_in) = (0, 0);
                }
            }
        }
        let mut out = Vec::new();
        for call in calls.iter().filter(|c| !c.is_empty()) {
            let v = self.script(s, &self.inner.scripts.import, &token, &|c, _| {
                c.arg(from).arg(call.len());
                for (key, jobs) in call {
                    c.arg(*key).arg(jobs.len());
                    for j in *jobs {
                        c.arg(j.id.0)
                            .arg(j.not_before_ms)
                            .arg(j.attempt)
                            .arg(j.max_attempts)
                            .arg(j.created_ms)
                            .arg(&j.payload[..])
                            .arg(j.dead.as_deref().map_or("", |r| {
                                if r.is_empty() {
                                    "dead"
                                } else {
                                    r
                                }
                            }))
                            .arg(j.dedup_id.as_deref().unwrap_or(""));
                    }
                }
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "import refused"));
            }
            for t in reply::items(&v)[1..].chunks(3) {
                let bad = || self.protocol(s, "import reply is malformed");
                let (Some(key), Some(src), Some(new)) = (
                    t.first().and_then(reply::string),
                    t.get(1).and_then(reply::u64),
                    t.get(2).and_then(reply::u64),
                ) else {
                    return Err(bad());
                };
                out.push((key, JobId(src), JobId(new)));
            }
        }
        Ok(out)
    }

    fn imported_up_to(
        &self,
        shard: &str,
        from: &str,
        key: &str,
    ) -> Result<Option<JobId>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.imported_up_to, "", &|c, _| {
            c.arg(from).arg(key);
        })?;
        let up_to = reply::items(&v)
            .get(1)
            .and_then(reply::u64)
            .ok_or_else(|| self.protocol(s, "import cursor reply is malformed"))?;
        Ok((up_to > 0).then_some(JobId(up_to)))
    }

    fn freeze_caught_up(
        &self,
        shard: &str,
        items: &[(String, Option<JobId>)],
    ) -> Result<Vec<String>, QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        let mut out = Vec::new();
        for call in items.chunks(EXPORT_MANY_KEYS_MAX) {
            let v = self.script(s, &self.inner.scripts.freeze, &token, &|c, _| {
                c.arg(call.len());
                for (key, after) in call {
                    c.arg(key).arg(after.map_or(0, |a| a.0));
                }
            })?;
            if reply::status(&v) != "OK" {
                return Err(self.protocol(s, "freeze refused"));
            }
            for k in &reply::items(&v)[1..] {
                out.push(
                    reply::string(k)
                        .ok_or_else(|| self.protocol(s, "freeze reply is malformed"))?,
                );
            }
        }
        Ok(out)
    }

    fn purge_key(&self, shard: &str, key: &str) -> Result<u64, QueueError> {
        let token = self.move_token();
        let s = self.shard(shard)?;
        let s = &*s;
        let mut total = 0u64;
        loop {
            let v = self.script(s, &self.inner.scripts.purge_key, &token, &|c, _| {
                c.arg(key).arg(PURGE_BATCH_MAX);
            })?;
            let it = reply::items(&v);
            let (Some(n), Some(more)) = (
                it.get(1).and_then(reply::u64),
                it.get(2).and_then(reply::u64),
            ) else {
                return Err(self.protocol(s, "purge reply is malformed"));
            };
            total += n;
            // Nothing deleted yet more reported: a dead count out of step
            // with the dead jobs; what could go is gone.
            if more == 0 || n == 0 {
                return Ok(total);
            }
        }
    }

    fn moved_away(&self, shard: &str, id: JobId) -> Result<Option<String>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.moved_away, "", &|c, _| {
            c.arg(id.0);
        })?;
        match (reply::status(&v).as_str(), reply::items(&v).get(1)) {
            ("NONE", _) => Ok(None),
            ("OK", Some(key)) => reply::string(key)
                .map(Some)
                .ok_or_else(|| self.protocol(s, "moved-away reply is malformed")),
            _ => Err(self.protocol(s, "moved-away reply is malformed")),
        }
    }

    fn finished(
        &self,
        shard: &str,
        key: Option<&str>,
        max: usize,
    ) -> Result<Vec<FinishedJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let keep = self.inner.opts.retention;
        if keep.finished_jobs == 0 || max == 0 {
            return Ok(Vec::new());
        }
        // In pages, newest first, until `max` match, the retention's count
        // is read, or an entry is past its age (entries are in finish
        // order); an entry that does not parse is skipped.
        let mut out = Vec::new();
        let mut first = 0usize;
        while first < keep.finished_jobs && out.len() < max {
            let last = (first + FINISHED_PAGE).min(keep.finished_jobs) - 1;
            let v = self.script(s, &self.inner.scripts.finished, "", &|c, _| {
                c.arg(first).arg(last);
            })?;
            let items = reply::items(&v);
            let now = (items.first().and_then(reply::u64))
                .ok_or_else(|| self.protocol(s, "finished-jobs reply is malformed"))?;
            let entries = &items[1..];
            for f in entries.iter().filter_map(|e| parse_done(reply::bytes(e)?)) {
                if !keep.keeps(f.finished_ms, now) {
                    return Ok(out);
                }
                if key.is_none_or(|k| f.key == k) {
                    out.push(f);
                    if out.len() == max {
                        return Ok(out);
                    }
                }
            }
            if entries.len() < last - first + 1 {
                break;
            }
            first = last + 1;
        }
        Ok(out)
    }

    fn dead_list(&self, shard: &str, limit: usize) -> Result<Vec<DeadJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let limit = limit.min(DEAD_LIST_MAX);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let v = self.script(s, &self.inner.scripts.dead_list, "", &|c, _| {
            c.arg(limit);
        })?;
        let mut out = Vec::new();
        for d in reply::items(&v).chunks(5) {
            let bad = || self.protocol(s, "dead list reply is malformed");
            if d.len() != 5 {
                return Err(bad());
            }
            out.push(DeadJob {
                shard: s.name.clone(),
                id: JobId(reply::u64(&d[0]).ok_or_else(bad)?),
                attempts: reply::u64(&d[1]).ok_or_else(bad)? as u32,
                key: reply::string(&d[2]).ok_or_else(bad)?,
                reason: reply::string(&d[3]).unwrap_or_default(),
                attempt_starts_ms: parse_starts(&d[4]).ok_or_else(bad)?,
            });
        }
        Ok(out)
    }

    fn dead_retry(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.dead_move(shard, "retry", ids)
    }

    fn dead_purge(&self, shard: &str, ids: Option<&[JobId]>) -> Result<usize, QueueError> {
        self.dead_move(shard, "purge", ids)
    }

    fn job(&self, shard: &str, id: JobId) -> Result<Option<JobInfo>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.job_show, "", &|c, _| {
            c.arg(id.0);
        })?;
        let items = reply::items(&v);
        if reply::status(&v) == "NONE" {
            return Ok(None);
        }
        job_info(id, items)
            .map(Some)
            .ok_or_else(|| self.protocol(s, format!("job {} reply is malformed", id.0)))
    }

    fn key_jobs(&self, shard: &str, key: &str, max: usize) -> Result<Vec<JobInfo>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let max = max.min(KEY_JOBS_MAX);
        if max == 0 {
            return Ok(Vec::new());
        }
        let v = self.script(s, &self.inner.scripts.key_jobs, "", &|c, _| {
            c.arg(key).arg(max).arg(TRANSFER_CALL_BYTES_MAX);
        })?;
        if reply::status(&v) != "OK" {
            return Err(self.protocol(s, "key jobs refused"));
        }
        let mut out = Vec::new();
        for row in reply::items(&v)[1..].chunks(7) {
            let job = (row.len() == 7)
                .then(|| reply::u64(&row[0]).and_then(|id| job_info(JobId(id), &row[1..])))
                .flatten()
                .filter(|j| j.key == key)
                .ok_or_else(|| self.protocol(s, format!("jobs of key {key:?}: a malformed job")))?;
            out.push(job);
        }
        out.sort_by_key(|j| j.id);
        out.truncate(max);
        Ok(out)
    }

    fn key_hold(&self, shard: &str, key: &str) -> Result<Option<shardq_core::KeyHold>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.key_hold, "", &|c, _| {
            c.arg(key).arg(shardq_core::KEY_HOLD_SCAN_JOBS);
        })?;
        match reply::status(&v).as_str() {
            "OK" => self.parse_hold(s, &v),
            other => Err(self.protocol(s, format!("key hold answered {other:?}"))),
        }
    }

    fn resume_key(&self, shard: &str, key: &str) -> Result<shardq_core::KeyResume, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.key_resume, "", &|c, _| {
            c.arg(key).arg(shardq_core::KEY_HOLD_SCAN_JOBS);
        })?;
        match reply::status(&v).as_str() {
            "OK" => Ok(match self.parse_hold(s, &v)? {
                Some(hold) => shardq_core::KeyResume::Resumed(hold),
                None => shardq_core::KeyResume::NotHeld,
            }),
            "MOVING" => Ok(shardq_core::KeyResume::Moving),
            other => Err(self.protocol(s, format!("key resume answered {other:?}"))),
        }
    }

    fn cancel(&self, shard: &str, id: JobId) -> Result<CancelOutcome, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.cancel, "", &|c, _| {
            c.arg(id.0).arg(CANCEL_WALK_MAX);
        })?;
        match reply::status(&v).as_str() {
            "CANCELLED" => Ok(CancelOutcome::Cancelled),
            "RUNNING" => Ok(CancelOutcome::Running),
            "STOPPING" => Ok(CancelOutcome::Stopping),
            "MOVING" => Ok(CancelOutcome::Moving),
            "NOTFOUND" => Ok(CancelOutcome::NotFound),
            "TOOFAR" => Err(QueueError::InvalidOption {
                name: "job to cancel",
                value: format!("{}:{}", s.name, id.0),
                allowed: format!(
                    "a job at most {CANCEL_WALK_MAX} places behind its key's head on Redis \
                     (cancel the jobs ahead of it first, or wait for them to run)"
                ),
            }),
            other => Err(self.protocol(s, format!("cancel answered {other:?}"))),
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
fn ack_args(receipts: &[Receipt], known: &HashMap<u64, Run>) -> Vec<String> {
    let mut list = Vec::with_capacity(receipts.len() * 4);
    for r in receipts {
        list.push(r.id.0.to_string());
        list.push(r.fence.to_string());
        match known.get(&r.id.0) {
            Some(run) => {
                list.push(run.key.clone());
                list.push(run.attempt.to_string());
            }
            None => list.extend([String::new(), String::new()]),
        }
    }
    list
}
