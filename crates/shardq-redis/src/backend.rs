//! [`RedisBackend`]: the [`QueueBackend`] trait over shards stored in Redis.
//!
//! Each shard of the map whose URL is `redis://...` lives on that instance;
//! shards whose URL is `redis+cluster://...` live in that cluster, each in
//! the one slot of its hashtag. All state (jobs, order, claims, fence,
//! lease) is in Redis, so processes on several hosts cooperate; this type
//! keeps only which shards it adopted, under which fencing token, and which
//! of their jobs it handed out. It must never change a shard except through
//! one script, and never claim, ack or fail without a token the shard's
//! lease still carries.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use redis::Value;
use shardq_core::{
    Backoff, ClaimedJob, Clock, DeadJob, DeadPolicy, FailOutcome, Fence, JobId, KeyCounts, NewJob,
    QueueBackend, QueueError, ShardStats, PAYLOAD_BYTES_MAX_DEFAULT,
};
use shardq_route::ShardMap;

use crate::conn::{Node, RETRY_ATTEMPTS_DEFAULT, SCHEME_CLUSTER, SCHEME_INSTANCE};
use crate::error::RedisError;
use crate::keys::{self, QUEUE_DEFAULT};
use crate::scripts::{reply, Scripts};

/// Most jobs in one enqueue call (one script; Lua's `unpack` bounds it).
pub const ENQUEUE_BATCH_MAX: usize = 1024;
/// Most jobs one claim call hands out.
pub const CLAIM_BATCH_MAX: usize = 1024;
/// Most ids acked by one script; longer ack lists are split.
pub const ACK_BATCH_MAX: usize = 1024;
/// In-flight jobs whose lease ran out that one claim puts back.
pub const RECLAIM_BATCH_MAX: usize = 128;
/// Dead jobs moved by one script in `dead_retry`/`dead_purge` of all.
pub const DEAD_BATCH_MAX: usize = 512;
/// Most dead jobs one `dead_list` returns.
pub const DEAD_LIST_MAX: usize = 10_000;
/// Default time a claimed job may run before another claim takes it back
/// (5 min). A worker that dies is normally noticed sooner, through the
/// shard lease and `adopt`; this bound covers a stuck handler.
pub const JOB_LEASE_MS_DEFAULT: u64 = 300_000;

/// Options of [`RedisBackend::open`].
#[derive(Clone)]
pub struct RedisOptions {
    /// Queue name: the first half of every key's hashtag.
    pub queue: String,
    /// How long a claimed job may run before it is claimed again, in ms.
    pub job_lease_ms: u64,
    /// Retry backoff after a failed attempt.
    pub backoff: Backoff,
    /// Whether a dead job halts its key.
    pub dead_policy: DeadPolicy,
    /// Largest payload accepted, in bytes.
    pub payload_bytes_max: usize,
    /// Attempts per Redis operation before reporting the server unreachable.
    pub retry_attempts: u32,
    /// Time source for leases and delays; `None` uses the Redis server's
    /// clock (one clock for every host, the default).
    pub clock: Option<Arc<dyn Clock>>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            queue: QUEUE_DEFAULT.to_string(),
            job_lease_ms: JOB_LEASE_MS_DEFAULT,
            backoff: Backoff::default(),
            dead_policy: DeadPolicy::default(),
            payload_bytes_max: PAYLOAD_BYTES_MAX_DEFAULT,
            retry_attempts: RETRY_ATTEMPTS_DEFAULT,
            clock: None,
        }
    }
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("queue", &self.queue)
            .field("job_lease_ms", &self.job_lease_ms)
            .field("backoff", &self.backoff)
            .field("dead_policy", &self.dead_policy)
            .field("payload_bytes_max", &self.payload_bytes_max)
            .field("retry_attempts", &self.retry_attempts)
            .field("clock", &self.clock.is_some())
            .finish()
    }
}

/// What this process holds of an adopted shard.
struct Held {
    token: u64,
    /// Jobs handed out and not yet acked or failed here, with their routing
    /// keys: an ack names the key, so the script checks the key's one job in
    /// flight instead of reading the job.
    in_flight: HashMap<u64, String>,
}

pub(crate) struct ShardRef {
    pub(crate) name: String,
    pub(crate) url: String,
    pub(crate) node: Arc<Node>,
    pub(crate) keys: Vec<String>,
    held: Mutex<Option<Held>>,
}

impl ShardRef {
    fn held(&self) -> MutexGuard<'_, Option<Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lease_key(&self) -> &[String] {
        std::slice::from_ref(&self.keys[keys::LEASE_PART])
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
    /// Fencing tokens granted by a [`crate::RedisCoordinator`].
    tokens: Mutex<HashMap<String, u64>>,
    pub(crate) scripts: Scripts,
}

/// The Redis backend. Cheap to clone; clones share connections and state.
#[derive(Clone)]
pub struct RedisBackend {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
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
    /// Opens the shards of `map` whose URL is `redis://host:port/db` or
    /// `redis+cluster://host:port,...`, and checks that each server answers.
    /// Shards with other URLs (or none) are left to other backends.
    pub fn open(map: &ShardMap, options: RedisOptions) -> Result<RedisBackend, RedisError> {
        keys::validate_queue_name(&options.queue).map_err(|reason| RedisError::InvalidName {
            what: "queue",
            name: options.queue.clone(),
            reason,
        })?;
        let backend = RedisBackend {
            inner: Arc::new(Inner {
                opts: options,
                registry: RwLock::new(Registry::default()),
                tokens: Mutex::new(HashMap::new()),
                scripts: Scripts::new(),
            }),
        };
        backend.sync_shards(map)?;
        if backend.registry().shards.is_empty() {
            return Err(RedisError::NoRedisShards {
                version: map.version,
            });
        }
        Ok(backend)
    }

    /// Adds the Redis shards of `map` this backend does not know yet (a map
    /// published after it was opened, e.g. by `add-shard`), checking that
    /// each new server answers. Returns the names added. Known shards keep
    /// their URL: a shard never moves between servers under one name.
    pub fn sync_shards(&self, map: &ShardMap) -> Result<Vec<String>, RedisError> {
        let mut added = Vec::new();
        for shard in &map.shards {
            let Some(url) = shard.url.as_deref().filter(|u| is_redis_url(u)) else {
                continue;
            };
            if self.registry().index.contains_key(&shard.name) {
                continue;
            }
            shardq_route::validate_shard_name(&shard.name).map_err(|reason| {
                RedisError::InvalidName {
                    what: "shard",
                    name: shard.name.clone(),
                    reason,
                }
            })?;
            let known = self.registry().nodes.get(url).cloned();
            let node = match known {
                Some(n) => n,
                None => {
                    // Connect outside the lock: an unreachable server takes
                    // seconds to be reported and must not stall other shards.
                    let n = Arc::new(Node::new(&shard.name, url, self.inner.opts.retry_attempts)?);
                    n.run(&shard.name, |con, _| {
                        redis::cmd("PING").query::<String>(con)
                    })?;
                    n
                }
            };
            let mut reg = self
                .inner
                .registry
                .write()
                .unwrap_or_else(|p| p.into_inner());
            if reg.index.contains_key(&shard.name) {
                continue;
            }
            let node = Arc::clone(reg.nodes.entry(url.to_string()).or_insert(node));
            let i = reg.shards.len();
            reg.index.insert(shard.name.clone(), i);
            reg.shards.push(Arc::new(ShardRef {
                name: shard.name.clone(),
                url: url.to_string(),
                node,
                keys: keys::shard_keys(&self.inner.opts.queue, &shard.name),
                held: Mutex::new(None),
            }));
            added.push(shard.name.clone());
        }
        Ok(added)
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

    pub(crate) fn grant(&self, shard: &str, token: u64) {
        self.tokens().insert(shard.to_string(), token);
    }

    pub(crate) fn revoke(&self, shard: &str) {
        self.tokens().remove(shard);
        if let Ok(s) = self.shard(shard) {
            *s.held() = None;
        }
    }

    fn tokens(&self) -> MutexGuard<'_, HashMap<String, u64>> {
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

    /// Runs a shard script with the common ARGV (time, token, halt) and
    /// `extra` after them.
    fn script(
        &self,
        s: &ShardRef,
        lua: &crate::scripts::Lua,
        token: u64,
        extra: &dyn Fn(&mut redis::Cmd, u32),
    ) -> Result<Value, RedisError> {
        let token = token.to_string();
        s.node.run(&s.name, |con, attempt| {
            let now = self.now_arg();
            lua.call(con, &s.keys, &|c| {
                c.arg(&now).arg(&token).arg(self.halt_arg());
                extra(c, attempt);
            })
        })
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
            None => loop {
                let v = self.script(s, lua, 0, &|c, _| {
                    c.arg(mode).arg("1").arg(DEAD_BATCH_MAX);
                })?;
                let it = reply::items(&v);
                let moved = it.first().and_then(reply::u64).unwrap_or(0) as usize;
                let seen = it.get(1).and_then(reply::u64).unwrap_or(0) as usize;
                total += moved;
                if seen < DEAD_BATCH_MAX {
                    return Ok(total);
                }
            },
            Some(ids) => {
                for chunk in ids.chunks(DEAD_BATCH_MAX) {
                    let list: Vec<String> = chunk.iter().map(|i| i.0.to_string()).collect();
                    let v = self.script(s, lua, 0, &|c, _| {
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
        // once, and in order, but possibly duplicated.
        let v = self.script(s, &self.inner.scripts.enqueue, 0, &|c, _| {
            c.arg(map_version).arg(jobs.len());
            for job in jobs {
                c.arg(&job.key)
                    .arg(&job.payload[..])
                    .arg(job.delay_ms)
                    .arg(job.max_attempts);
            }
        })?;
        let it = reply::items(&v);
        match reply::status(&v).as_str() {
            "OK" => {
                let first = it
                    .get(1)
                    .and_then(reply::u64)
                    .ok_or_else(|| self.protocol(s, "enqueue without a first id"))?;
                Ok((0..jobs.len() as u64).map(|i| JobId(first + i)).collect())
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
            other => Err(self.protocol(s, format!("enqueue answered {other:?}"))),
        }
    }

    fn adopt(&self, shard: &str) -> Result<(), QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let token = self
            .tokens()
            .get(shard)
            .copied()
            .ok_or_else(|| Self::not_owner(s))?;
        let v = self.script(s, &self.inner.scripts.adopt, token, &|_, _| {})?;
        if reply::status(&v) != "OK" {
            return Err(Self::not_owner(s));
        }
        *s.held() = Some(Held {
            token,
            in_flight: HashMap::new(),
        });
        Ok(())
    }

    fn release(&self, shard: &str) -> Result<(), QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        *s.held() = None;
        Ok(())
    }

    fn claim(&self, shard: &str, max: usize) -> Result<Vec<ClaimedJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        // Held for the whole call: a retried claim puts back in-flight jobs
        // this process does not know, so no other claim may be half done.
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let max = max.min(CLAIM_BATCH_MAX);
        if max == 0 {
            return Ok(Vec::new());
        }
        let known: Vec<String> = held.in_flight.keys().map(|i| i.to_string()).collect();
        let job_lease_ms = self.inner.opts.job_lease_ms;
        let v = self.script(s, &self.inner.scripts.claim, held.token, &|c, attempt| {
            c.arg(max).arg(job_lease_ms).arg(RECLAIM_BATCH_MAX);
            if attempt == 0 {
                c.arg("0");
            } else {
                c.arg("1").arg(&known);
            }
        })?;
        match reply::status(&v).as_str() {
            "OK" => {}
            "NOTOWNER" => {
                *guard = None;
                return Err(Self::not_owner(s));
            }
            other => return Err(self.protocol(s, format!("claim answered {other:?}"))),
        }
        let it = reply::items(&v);
        let mut out = Vec::with_capacity((it.len() - 1) / 2);
        for j in it[1..].chunks(2) {
            let bad = || self.protocol(s, "claim reply has a malformed job");
            if j.len() != 2 {
                return Err(bad());
            }
            let id = reply::u64(&j[0]).ok_or_else(bad)?;
            let rec = reply::bytes(&j[1])
                .and_then(JobRecord::parse)
                .ok_or_else(bad)?;
            held.in_flight.insert(id, rec.key.clone());
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
            });
        }
        Ok(out)
    }

    fn ack(&self, shard: &str, ids: &[JobId]) -> Result<(), QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let token = held.token;
        let mut first_missing = None;
        for chunk in ids.chunks(ACK_BATCH_MAX) {
            let mut list: Vec<String> = Vec::with_capacity(chunk.len() * 2);
            for id in chunk {
                list.push(id.0.to_string());
                // Unknown here (not claimed by this process): the script
                // looks the key up in the job's record.
                list.push(held.in_flight.get(&id.0).cloned().unwrap_or_default());
            }
            let retried = std::cell::Cell::new(false);
            let v = self.script(s, &self.inner.scripts.ack, token, &|c, attempt| {
                retried.set(attempt > 0);
                c.arg(&list);
            })?;
            for id in chunk {
                held.in_flight.remove(&id.0);
            }
            match reply::status(&v).as_str() {
                "OK" => {}
                "NOTOWNER" => {
                    *guard = None;
                    return Err(Self::not_owner(s));
                }
                // After a lost reply the first attempt may have acked them.
                "NOTINFLIGHT" if retried.get() => {}
                "NOTINFLIGHT" => {
                    let id = reply::items(&v).get(1).and_then(reply::u64).unwrap_or(0);
                    first_missing.get_or_insert(id);
                }
                other => return Err(self.protocol(s, format!("ack answered {other:?}"))),
            }
        }
        match first_missing {
            Some(id) => Err(QueueError::NotInFlight {
                shard: s.name.clone(),
                id,
            }),
            None => Ok(()),
        }
    }

    fn fail(&self, shard: &str, id: JobId, reason: &str) -> Result<FailOutcome, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut guard = s.held();
        let held = guard.as_mut().ok_or_else(|| Self::not_owner(s))?;
        let reason = shardq_core::job::cut_at_char(reason, shardq_core::job::FAIL_REASON_BYTES_MAX);
        let backoff = self.inner.opts.backoff;
        let v = self.script(s, &self.inner.scripts.fail, held.token, &|c, _| {
            c.arg(id.0)
                .arg(reason)
                .arg(backoff.base_ms)
                .arg(backoff.max_ms);
        })?;
        held.in_flight.remove(&id.0);
        match reply::status(&v).as_str() {
            "RETRY" => Ok(FailOutcome::Retry {
                at_ms: reply::items(&v).get(1).and_then(reply::u64).unwrap_or(0),
            }),
            "DEAD" => Ok(FailOutcome::Dead),
            "NOTOWNER" => {
                *guard = None;
                Err(Self::not_owner(s))
            }
            "NOTINFLIGHT" => Err(QueueError::NotInFlight {
                shard: s.name.clone(),
                id: id.0,
            }),
            other => Err(self.protocol(s, format!("fail answered {other:?}"))),
        }
    }

    fn next_due_ms(&self, shard: &str) -> Result<Option<u64>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.next_due, 0, &|_, _| {})?;
        Ok(reply::u64(&v))
    }

    fn key_counts(&self, shard: &str, key: &str) -> Result<KeyCounts, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.key_counts, 0, &|c, _| {
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
        let v = self.script(s, &self.inner.scripts.stats, 0, &|_, _| {})?;
        let it = reply::items(&v);
        let n = |i: usize| it.get(i).and_then(reply::u64).unwrap_or(0);
        Ok(ShardStats {
            name: s.name.clone(),
            ready: n(0),
            delayed: n(1),
            in_flight: n(2),
            dead: n(3),
            keys: n(4),
        })
    }

    fn fence(&self, shard: &str) -> Result<Fence, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let v = self.script(s, &self.inner.scripts.fence_get, 0, &|_, _| {})?;
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
        })
    }

    fn set_fence(&self, shard: &str, fence: &Fence) -> Result<(), QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let keys: Vec<&String> = fence.paused_keys.iter().collect();
        self.script(s, &self.inner.scripts.fence_set, 0, &|c, _| {
            c.arg(fence.map_version_min).arg(&keys);
        })?;
        Ok(())
    }

    fn dead_list(&self, shard: &str, limit: usize) -> Result<Vec<DeadJob>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let limit = limit.min(DEAD_LIST_MAX);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let v = self.script(s, &self.inner.scripts.dead_list, 0, &|c, _| {
            c.arg(limit);
        })?;
        let mut out = Vec::new();
        for d in reply::items(&v).chunks(4) {
            let bad = || self.protocol(s, "dead list reply is malformed");
            if d.len() != 4 {
                return Err(bad());
            }
            out.push(DeadJob {
                shard: s.name.clone(),
                id: JobId(reply::u64(&d[0]).ok_or_else(bad)?),
                attempts: reply::u64(&d[1]).ok_or_else(bad)? as u32,
                key: reply::string(&d[2]).ok_or_else(bad)?,
                reason: reply::string(&d[3]).unwrap_or_default(),
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
}

/// `HSCAN` count hint of one inventory script call (routing keys looked at).
pub const INVENTORY_KEYS_PER_CALL: usize = 1024;
/// Most keys with work one inventory reports per shard; a shard with more
/// is refused with an error rather than scanned without end.
pub const INVENTORY_KEYS_MAX: usize = 4_000_000;

impl RedisBackend {
    /// Who holds `shard`'s lease and until when (ms, server clock), if
    /// anyone does and it has not lapsed.
    pub fn lease_holder(&self, shard: &str) -> Result<Option<(String, u64)>, QueueError> {
        let s = self.shard(shard)?;
        let key = &s.keys[keys::LEASE_PART];
        let (owner, until): (Option<String>, Option<u64>) = s.node.run(&s.name, |con, _| {
            redis::cmd("HMGET")
                .arg(key)
                .arg("owner")
                .arg("until")
                .query(con)
        })?;
        Ok(match (owner, until) {
            (Some(o), Some(u)) if !o.is_empty() && u > 0 => Some((o, u)),
            _ => None,
        })
    }

    fn too_many_keys(s: &ShardRef) -> QueueError {
        QueueError::Backend(format!(
            "shard {:?} at {}: more than {INVENTORY_KEYS_MAX} keys with work; the inventory stops there",
            s.name, s.url
        ))
    }
}

impl shardq_core::reshard::KeyInventory for RedisBackend {
    /// One bounded walk of the shard's `keys` hash by `HSCAN` (a field per
    /// key with a waiting job or one in flight; concurrent writes never make
    /// it loop). Not one atomic snapshot: a rebalance scans again after
    /// fencing, which catches what raced.
    fn keys_with_work(&self, shard: &str) -> Result<Vec<(String, KeyCounts)>, QueueError> {
        let s = self.shard(shard)?;
        let s = &*s;
        let mut found: std::collections::BTreeMap<String, KeyCounts> = Default::default();
        let mut cursor = "0".to_string();
        loop {
            let v = self.script(s, &self.inner.scripts.inventory, 0, &|c, _| {
                c.arg(&cursor).arg(INVENTORY_KEYS_PER_CALL);
            })?;
            let it = reply::items(&v);
            let bad = || self.protocol(s, "inventory reply is malformed");
            let next = it.first().and_then(reply::string).ok_or_else(bad)?;
            for k in it[1..].chunks(4) {
                if k.len() != 4 {
                    return Err(bad());
                }
                let n = |i: usize| reply::u64(&k[i]).ok_or_else(bad);
                // HSCAN may return a key twice; the later look is fresher.
                found.insert(
                    reply::string(&k[0]).ok_or_else(bad)?,
                    KeyCounts {
                        depth: n(1)?,
                        in_flight: n(2)?,
                        dead: n(3)?,
                    },
                );
            }
            if found.len() > INVENTORY_KEYS_MAX {
                return Err(Self::too_many_keys(s));
            }
            if next == "0" {
                break;
            }
            cursor = next;
        }
        Ok(found.into_iter().collect())
    }
}

/// One job's record in the shard's `jobs` hash:
/// `<not_before_ms>|<attempts>|<max_attempts>|<created_ms>|<key len>|<key><payload>`
/// (the scripts in `scripts.rs` write it).
#[derive(Debug, PartialEq)]
pub(crate) struct JobRecord<'a> {
    pub(crate) not_before_ms: u64,
    /// Finished attempts (a job in flight is on attempt `attempts + 1`).
    pub(crate) attempts: u32,
    pub(crate) max_attempts: u32,
    pub(crate) created_ms: u64,
    pub(crate) key: String,
    pub(crate) payload: &'a [u8],
}

impl JobRecord<'_> {
    /// `None` for anything but a well-formed record.
    pub(crate) fn parse(b: &[u8]) -> Option<JobRecord<'_>> {
        let mut rest = b;
        let mut num = || -> Option<u64> {
            let end = rest.iter().position(|&c| c == b'|')?;
            let v = std::str::from_utf8(&rest[..end]).ok()?.parse().ok()?;
            rest = &rest[end + 1..];
            Some(v)
        };
        let not_before_ms = num()?;
        let attempts = u32::try_from(num()?).ok()?;
        let max_attempts = u32::try_from(num()?).ok()?;
        let created_ms = num()?;
        let key_len = usize::try_from(num()?).ok()?;
        if rest.len() < key_len {
            return None;
        }
        let (key, payload) = rest.split_at(key_len);
        Some(JobRecord {
            not_before_ms,
            attempts,
            max_attempts,
            created_ms,
            key: String::from_utf8(key.to_vec()).ok()?,
            payload,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::JobRecord;

    fn check(rec: &[u8], expected: Option<JobRecord<'_>>) {
        assert_eq!(
            JobRecord::parse(rec),
            expected,
            "{:?}",
            String::from_utf8_lossy(rec)
        );
    }

    fn job(attempts: u32, key: &str, payload: &'static [u8]) -> Option<JobRecord<'static>> {
        Some(JobRecord {
            not_before_ms: 5,
            attempts,
            max_attempts: 3,
            created_ms: 4,
            key: key.to_string(),
            payload,
        })
    }

    #[test]
    fn job_records() {
        check(b"5|0|3|4|1|kp", job(0, "k", b"p"));
        // Keys and payloads may hold the separator; the key length decides.
        check(b"5|1|3|4|3|a|b|x|", job(1, "a|b", b"|x|"));
        check(b"5|0|3|4|2|ab", job(0, "ab", b""));
        check(b"5|0|3|4|3|ab", None);
        check(b"5|0|3|4|", None);
        check(b"5|x|3|4|1|k", None);
        check(b"", None);
    }
}
